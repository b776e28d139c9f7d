"""``bench serve``'s API parts (issue #20): what the jobs API, event replay and the metrics
cost, next to the synchronous endpoint, on the same server in the same run.

jobs     closed loop at the highest ``--concurrency``: ``sync`` posts the generation and
         decodes its answer; ``job`` posts it to ``/v1/jobs`` (202), follows
         ``/v1/jobs/{id}/events`` to its terminal event and decodes the result it carries.
         Rounds interleave the two; the job overhead per request is job p50 - sync p50.
replay   ``--replay-jobs`` jobs of 50x the steps (at most max_steps), one at a time: the
         follower drops its connection after two events, reconnects with
         ``Last-Event-ID`` and reads to the end; after the job ended the whole event list is
         read again.  Events lost (in
         the whole list but seen by neither connection) must be 0, and none seen twice.
metrics  closed loop at the highest concurrency against the server as it runs and against a
         second one whose metrics record nothing (:class:`NullMetrics`, a bench-only stand-in
         whose ``observe_*`` calls do nothing), rounds interleaved: throughput and latency
         with and without the metrics.  While the ``with`` side runs, a :class:`Scraper`
         reads its ``/metrics`` every :data:`SCRAPE_INTERVAL_S` (as Prometheus would), so the
         cost of rendering them counts too.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any

import trio

from ..serve.metrics import ServeMetrics
from .load import Call, LoadResult, Outcome, closed_loop, mode_summary

if TYPE_CHECKING:
    import httpx

__all__ = ["SCRAPE_INTERVAL_S", "NullMetrics", "Scraper", "compare", "job_call", "replay_probe"]

JOBS = "/v1/jobs"
# The metrics part's scrape interval on the "with" side (Prometheus scrapes every 15 s by
# default: once a second is a heavy scraper).
SCRAPE_INTERVAL_S = 1.0


class NullMetrics(ServeMetrics):
    """A fake for the "without metrics" side: the same registry and gauges (the app and the
    HTTP server touch them), but every ``observe_*`` records nothing."""

    def __init__(self, pool: Any = None) -> None:
        super().__init__(None)
        for name in dir(ServeMetrics):
            if name.startswith("observe_"):
                setattr(self, name, _nothing)


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


class Scraper:
    """Reads ``GET /metrics`` through ``client`` every ``interval_s`` while :meth:`serve`
    runs; counts the scrapes that answered 200 and those that did not."""

    def __init__(self, client: httpx.AsyncClient, interval_s: float = SCRAPE_INTERVAL_S) -> None:
        self._client = client
        self.interval_s = interval_s
        self.scrapes = 0
        self.failed = 0

    async def serve(self) -> None:
        """Scrape until cancelled (the first at once)."""
        import httpx

        while True:
            try:
                r = await self._client.get("/metrics")
                ok = r.status_code == 200 and r.content.startswith(b"# HELP")
            except httpx.HTTPError:
                ok = False
            if ok:
                self.scrapes += 1
            else:
                self.failed += 1
            await trio.sleep(self.interval_s)


def job_call(client: httpx.AsyncClient, body: dict[str, Any]) -> Call:
    """One job, submitted and followed to its end (the result decoded from its terminal
    event), as an :class:`Outcome`."""
    import httpx

    async def call() -> Outcome:
        try:
            created = await client.post(JOBS, json=body)
            if created.status_code != 202:
                return Outcome(str(created.status_code))
            job_id = created.json()["id"]
            last, data = None, None
            async with client.stream("GET", f"{JOBS}/{job_id}/events") as stream:
                async for line in stream.aiter_lines():
                    if line.startswith("event: "):
                        last = line[7:]
                    elif line.startswith("data: "):
                        data = line[6:]
        except httpx.HTTPError as exc:
            return Outcome(type(exc).__name__)
        if last != "job.completed" or data is None:
            return Outcome(last or "no terminal event")
        result = json.loads(data)["result"]
        if not isinstance(result["data"][0].get("b64_json"), str):
            return Outcome("completed without b64_json")
        metrics = result.get("metrics") or {}
        return Outcome(None, None, metrics.get("queue_wait_ms"))

    return call


async def _ids(client: httpx.AsyncClient, job_id: str, **headers: str) -> list[int]:
    async with client.stream("GET", f"{JOBS}/{job_id}/events", headers=headers) as stream:
        return [int(line[4:]) async for line in stream.aiter_lines() if line.startswith("id: ")]


async def replay_probe(
    client: httpx.AsyncClient, body: dict[str, Any], jobs: int
) -> dict[str, Any]:
    """The replay part (module docstring): totals over ``jobs`` jobs."""
    events = lost = duplicated = reconnects = 0
    failed: list[str] = []
    for index in range(jobs):
        created = await client.post(JOBS, json={**body, "seed": 7000 + index})
        if created.status_code != 202:
            failed.append(str(created.status_code))
            continue
        job_id = created.json()["id"]
        seen: list[int] = []
        async with client.stream("GET", f"{JOBS}/{job_id}/events") as stream:
            async for line in stream.aiter_lines():
                if line.startswith("id: "):
                    seen.append(int(line[4:]))
                    if len(seen) == 2:
                        break  # leaving the block drops the connection
        reconnects += 1
        seen += await _ids(client, job_id, **{"Last-Event-ID": str(seen[-1])})
        whole = await _ids(client, job_id)
        events += len(whole)
        lost += len(set(whole) - set(seen))
        duplicated += len(seen) - len(set(seen))
        final = (await client.get(f"{JOBS}/{job_id}")).json()["status"]
        if final != "completed":
            failed.append(final)
    return {
        "jobs": jobs,
        "events": events,
        "reconnects": reconnects,
        "events_lost": lost,
        "events_seen_twice": duplicated,
        "failed": failed,
    }


async def compare(
    calls: dict[str, Call],
    *,
    requests: int,
    concurrency: int,
    repeats: int,
    warmup: int,
    alongside: Mapping[str, Callable[[], Awaitable[object]]] | None = None,
) -> dict[str, list[LoadResult]]:
    """Closed-loop rounds of every call in turn (``warmup`` unmeasured rounds first).
    ``alongside[name]``, when given, runs (cancelled after) during each round of ``name``:
    load that belongs to that side, such as a :class:`Scraper`."""
    runs: dict[str, list[LoadResult]] = {name: [] for name in calls}
    extra = alongside or {}
    for round_index in range(warmup + repeats):
        for name, call in calls.items():
            async with trio.open_nursery() as nursery:
                if name in extra:
                    nursery.start_soon(extra[name])
                result = await closed_loop(call, requests=requests, concurrency=concurrency)
                nursery.cancel_scope.cancel()
            if round_index >= warmup:
                runs[name].append(result)
    return runs


def summaries(runs: dict[str, list[LoadResult]]) -> dict[str, Any]:
    """Each mode's figures, and the p50 latency difference and req/s ratio of the second
    mode against the first."""
    names = list(runs)
    out: dict[str, Any] = {name: mode_summary(runs[name]) for name in names}
    base, other = (out[name] for name in names[:2])
    if base["latency_ms"] and other["latency_ms"]:
        out["p50_difference_ms"] = other["latency_ms"].p50 - base["latency_ms"].p50
    if base["requests_per_s"].median:
        out["requests_per_s_ratio"] = other["requests_per_s"].median / base["requests_per_s"].median
    return out
