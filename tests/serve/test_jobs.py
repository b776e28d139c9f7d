"""Jobs: the pure :class:`JobStore` (ttl, memory bound, event buffer, keys), and the
``/v1/jobs`` API on the real server (hypercorn, a real engine pool, httpx): submit, poll,
follow and resume events, cancel, idempotency, ownership, bad input, and a job that lives
through a SIGKILLed tractor worker."""

from __future__ import annotations

import base64
import io
import os
import signal
from typing import Any

import httpx
import pytest
import trio
from PIL import Image

from omni_trio.models.echo import decode_echo_image
from omni_trio.serve.jobs import JobStore
from omni_trio.serve.webhooks import sign
from tests.serve.conftest import (
    CAP_S,
    Server,
    assert_envelope,
    parse_sse,
    run_server,
    wait_until,
)

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

JOBS = "/v1/jobs"
LONG = 200  # steps: ~4 s with echo's step delay; every test that starts one ends it early


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def store(**kw: Any) -> tuple[JobStore, Clock]:
    clock = Clock()
    return JobStore(clock=clock, wall=lambda: 1_700_000_000.0, **kw), clock


# -- the store ------------------------------------------------------------------------------


def test_a_job_moves_queued_running_completed_with_its_events() -> None:
    jobs, _ = store()
    job = jobs.create("o", "j1")
    jobs.progressed(job, 1, 4)  # the first step: running, then its progress
    jobs.progressed(job, 1, 4)  # the same step again is no event
    jobs.progressed(job, 3, 4)
    jobs.finish(job, "completed", result={"data": [1]})
    jobs.finish(job, "failed")  # a second end is ignored
    names = [e.event for e in job.events]
    assert names == ["job.queued", "job.running", "job.progress", "job.progress", "job.completed"]
    assert [e.id for e in job.events] == [1, 2, 3, 4, 5]
    body = job.body()
    assert body["status"] == "completed" and body["result"] == {"data": [1]}
    assert body["progress"] == {"step": 4, "total": 4}
    assert job.final is not None and job.result is None  # the result lives in the bytes
    assert [e.id for e in job.events_after(3)] == [4, 5]
    with pytest.raises(KeyError):
        jobs.create("o", "j1")
    assert jobs.create("other", "j1").owner == "other"  # ids are per owner


def test_finished_jobs_expire_after_the_ttl_and_live_ones_never() -> None:
    jobs, clock = store(ttl_s=10.0)
    done, live = jobs.create("o", "done"), jobs.create("o", "live")
    jobs.finish(done, "cancelled")
    clock.now += 9.9
    assert jobs.get("o", "done") is done
    clock.now += 0.2
    assert jobs.get("o", "done") is None
    clock.now += 1e6
    assert jobs.get("o", "live") is live


def test_finished_jobs_stay_within_max_bytes_oldest_first() -> None:
    jobs, _ = store(max_bytes=3000)
    made = []
    for index in range(4):
        job = jobs.create("o", f"j{index}", key=f"k{index}", digest="d")
        jobs.finish(job, "completed", result={"blob": "x" * 900})
        made.append(job)
    assert jobs.finished_bytes <= 3000
    assert jobs.get("o", "j0") is None and jobs.by_key("o", "k0") is None
    assert jobs.get("o", "j3") is made[3] and jobs.by_key("o", "k3") == ("d", made[3])


def test_the_event_buffer_is_bounded_and_keeps_the_end() -> None:
    jobs, _ = store(events_kept=4)
    job = jobs.create("o", "j")
    for step in range(1, 10):
        jobs.progressed(job, step, 9)
    jobs.finish(job, "completed", result={})
    assert len(job.events) == 4 and job.events[-1].event == "job.completed"
    assert job.dropped == job.last_event_id - 4
    assert job.size == sum(len(e.data) for e in job.events)


def test_a_store_refuses_bad_bounds() -> None:
    for bad in ({"ttl_s": 0}, {"max_bytes": -1}, {"events_kept": 1}):
        with pytest.raises(ValueError):
            JobStore(**bad)


# -- the API ---------------------------------------------------------------------------------


async def submit(client: httpx.AsyncClient, **fields: Any) -> httpx.Response:
    body = {"prompt": "x", "size": "64x64", "num_inference_steps": 4, **fields}
    headers = fields.pop("headers", None)
    body.pop("headers", None)
    return await client.post(JOBS, json=body, headers=headers)


async def read_events(client: httpx.AsyncClient, job_id: str, **headers: str) -> str:
    async with client.stream("GET", f"{JOBS}/{job_id}/events", headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"] == "text/event-stream"
        return (await r.aread()).decode()


def event_ids(text: str) -> list[int]:
    return [int(line[4:]) for line in text.splitlines() if line.startswith("id: ")]


def image_of(body: dict[str, Any]) -> tuple[str, int, int]:
    b64 = body["result"]["data"][0]["b64_json"]
    return decode_echo_image(Image.open(io.BytesIO(base64.b64decode(b64))))


async def test_a_job_is_answered_at_once_and_its_result_kept(server: Server) -> None:
    with trio.fail_after(CAP_S):
        async with server.client() as client:
            r = await submit(client, seed=5, headers={"X-Request-Id": "job-1"})
            assert r.status_code == 202, r.text
            assert r.headers["location"] == f"{JOBS}/job-1"
            first = r.json()
            assert (first["id"], first["object"]) == ("job-1", "job")
            assert first["status"] in ("queued", "running") and first["result"] is None
            text = await read_events(client, "job-1")
            done = (await client.get(f"{JOBS}/job-1")).json()
            again = (await client.get(f"{JOBS}/job-1")).json()
    names = [name for name, _ in parse_sse(text)]
    assert names[0] == "job.queued" and names[-1] == "job.completed"
    assert names[1] == "job.running"  # every completed job ran, seen by a tick or not
    assert event_ids(text) == list(range(1, len(names) + 1))
    assert done == again and done["status"] == "completed"
    assert done["progress"] == {"step": 4, "total": 4}
    assert done["result"]["seed"] == 5 and done["error"] is None
    assert image_of(done) == ("job-1", 5, 0)
    assert parse_sse(text)[-1][1] == done  # the terminal event is the job itself


async def test_a_queued_job_says_its_place_and_a_cancelled_one_frees_it() -> None:
    with trio.fail_after(CAP_S):
        async with run_server(max_num_seqs=1) as server, server.client() as client:
            for name in ("a", "b", "c"):
                r = await submit(client, num_inference_steps=LONG, headers={"X-Request-Id": name})
                assert r.status_code == 202
            await wait_until(lambda: server.pool.status("a") == "running")
            c = (await client.get(f"{JOBS}/c")).json()
            assert (c["status"], c["queue_position"]) == ("queued", 1)
            b = await client.delete(f"{JOBS}/b")
            assert b.json() == {
                "id": "b",
                "object": "job",
                "cancelled": True,
                "status": "cancelled",
            }
            assert (await client.delete(f"{JOBS}/b")).json()["cancelled"] is True  # idempotent
            assert (await client.get(f"{JOBS}/c")).json()["queue_position"] == 0
            a = (await client.get(f"{JOBS}/a")).json()
            assert a["status"] == "running" and a["progress"]["total"] == LONG
            for name in ("a", "c"):
                assert (await client.delete(f"{JOBS}/{name}")).json()["cancelled"] is True
            cancelled = (await client.get(f"{JOBS}/b")).json()
            await wait_until(lambda: server.pool.in_flight == 0)
    assert cancelled["status"] == "cancelled" and cancelled["error"] is None


async def test_cancelling_a_finished_job_says_false(server: Server) -> None:
    with trio.fail_after(CAP_S):
        async with server.client() as client:
            await submit(client, headers={"X-Request-Id": "quick"})
            await read_events(client, "quick")
            r = await client.delete(f"{JOBS}/quick")
    assert r.status_code == 200
    assert r.json() == {"id": "quick", "object": "job", "cancelled": False, "status": "completed"}


async def test_events_resume_after_last_event_id_with_nothing_lost(server: Server) -> None:
    """A follower that drops its connection after two events and reconnects with the last
    id it saw gets exactly the rest: together, every event once, in order."""
    with trio.fail_after(CAP_S):
        async with server.client() as client:
            await submit(client, num_inference_steps=40, headers={"X-Request-Id": "resume"})
            seen: list[int] = []
            async with client.stream("GET", f"{JOBS}/resume/events") as r:
                async for line in r.aiter_lines():
                    if line.startswith("id: "):
                        seen.append(int(line[4:]))
                        if len(seen) == 2:
                            break  # leaving the block drops the connection
            rest = await read_events(client, "resume", **{"Last-Event-ID": str(seen[-1])})
            whole = await read_events(client, "resume")
            tail = await read_events(client, "resume", **{"Last-Event-ID": "1000"})
    assert seen == [1, 2]
    assert seen + event_ids(rest) == event_ids(whole) == list(range(1, event_ids(whole)[-1] + 1))
    assert parse_sse(whole)[-1][0] == "job.completed"
    assert event_ids(tail) == []  # past the end: nothing, and the stream ends


async def test_a_failed_job_keeps_the_error_the_endpoint_would_answer(server: Server) -> None:
    with trio.fail_after(CAP_S):
        async with server.client() as client:
            r = await submit(client, num_inference_steps=LONG, timeout=0.3)
            job_id = r.json()["id"]
            text = await read_events(client, job_id)
            body = (await client.get(f"{JOBS}/{job_id}")).json()
    assert parse_sse(text)[-1][0] == "job.failed"
    assert body["status"] == "failed" and body["http_status"] == 504
    assert body["error"]["code"] == "timeout" and body["result"] is None


async def test_an_idempotency_key_names_the_job(server: Server) -> None:
    with trio.fail_after(CAP_S):
        async with server.client() as client:
            key = {"Idempotency-Key": "k-1"}
            first = await submit(client, seed=1, headers=key)
            second = await submit(client, seed=1, headers=key)
            other = await submit(client, seed=2, headers=key)
            await read_events(client, first.json()["id"])
            third = await submit(client, seed=1, headers=key)
    assert first.status_code == 202 and second.status_code == 200
    assert second.headers["idempotent-replayed"] == "true"
    assert second.json()["id"] == third.json()["id"] == first.json()["id"]
    assert third.json()["status"] == "completed"
    assert_envelope(other, 422, param="Idempotency-Key", code="idempotency_key_reused")
    assert server.engine().statistics().finished_completed == 1  # one computation


async def test_jobs_belong_to_their_key() -> None:
    with trio.fail_after(CAP_S):
        async with run_server(api_keys=("alice", "bob")) as server:
            alice = server.client(headers={"Authorization": "Bearer alice"})
            bob = server.client(headers={"Authorization": "Bearer bob"})
            async with alice, bob:
                r = await submit(alice, headers={"X-Request-Id": "mine"})
                assert r.status_code == 202
                for answer in (
                    await bob.get(f"{JOBS}/mine"),
                    await bob.delete(f"{JOBS}/mine"),
                    await bob.get(f"{JOBS}/mine/events"),
                ):
                    assert_envelope(answer, 404, code="job_not_found")
                assert (await submit(bob, headers={"X-Request-Id": "mine"})).status_code == 202
                await read_events(alice, "mine")
                await read_events(bob, "mine")
                assert (await alice.get(f"{JOBS}/mine")).json()["status"] == "completed"
                anonymous = await server.client().get(f"{JOBS}/mine")
                assert anonymous.status_code == 401


async def test_bad_job_requests_get_envelopes(server: Server) -> None:
    with trio.fail_after(CAP_S):
        async with server.client() as client:
            cases = [
                (await submit(client, stream=True), 400, "stream", "invalid_value"),
                (
                    await submit(client, webhook_url="http://127.0.0.1:9/x"),
                    400,
                    "webhook_url",
                    "webhooks_disabled",
                ),
                (await submit(client, n=0), 400, "n", "invalid_value"),
                (await submit(client, bogus=1), 400, "bogus", "unknown_parameter"),
                (
                    await client.post(
                        JOBS, content=b"{nope", headers={"content-type": "application/json"}
                    ),
                    400,
                    None,
                    "invalid_json",
                ),
                (
                    await client.post(JOBS, content=b"x"),
                    415,
                    "Content-Type",
                    "unsupported_media_type",
                ),
                (await client.get(f"{JOBS}/none"), 404, "id", "job_not_found"),
                (await client.delete(f"{JOBS}/none"), 404, "id", "job_not_found"),
                (await client.get(f"{JOBS}/none/events"), 404, "id", "job_not_found"),
                (await client.get(JOBS), 405, None, "method_not_allowed"),
            ]
            await submit(client, headers={"X-Request-Id": "twice"})
            cases.append(
                (
                    await submit(client, headers={"X-Request-Id": "twice"}),
                    409,
                    "X-Request-Id",
                    "duplicate_request_id",
                )
            )
            bad_id = await client.get(f"{JOBS}/twice/events", headers={"Last-Event-ID": "x"})
            cases.append((bad_id, 400, "Last-Event-ID", "invalid_last_event_id"))
            await read_events(client, "twice")
            health = await client.get("/health")
    for response, status, param, code in cases:
        assert_envelope(response, status, param=param, code=code)
    assert health.status_code == 200


async def test_a_server_that_runs_no_jobs_says_503(server: Server) -> None:
    # The app's background work is not running (as under another harness): no job is
    # admitted, so nothing would be left unfollowed.
    with trio.fail_after(CAP_S):
        async with run_server() as other:
            other.app._background = None
            async with other.client() as client:
                r = await submit(client)
            # From the pool's state (here ready: 1 s), not a constant.
            expected = other.pool.unavailable_retry_after_s()
    assert_envelope(r, 503, code="jobs_unavailable")
    assert r.headers["retry-after"] == str(expected) == "1"
    assert other.pool.in_flight == 0


async def test_a_job_its_events_and_its_webhook_live_through_a_sigkilled_worker() -> None:
    """The tractor worker process dies mid-job: the engine restarts its group and runs the
    job again (same seed, same picture).  The job completes; a follower that lost its
    connection across the restart resumes with Last-Event-ID and misses nothing; the webhook
    still gets the end, signed."""
    from tests.serve.test_webhooks import Receiver, receiving

    with trio.fail_after(60):
        async with (
            receiving(Receiver()) as hook,
            run_server(
                backend="tractor",
                worker_start_method="forkserver",
                worker_restart_backoff_s=0.5,
                app_options={"webhook_secret": "s3cret"},
            ) as server,
            server.client() as client,
        ):
            r = await submit(
                client,
                seed=7,
                num_inference_steps=60,
                webhook_url=hook.url,
                headers={"X-Request-Id": "k"},
            )
            assert r.status_code == 202
            await wait_until(lambda: (server.pool.progress("k") or (0, 0))[0] >= 2)
            seen: list[int] = []
            async with client.stream("GET", f"{JOBS}/k/events") as stream:
                async for line in stream.aiter_lines():
                    if line.startswith("id: "):
                        seen.append(int(line[4:]))
                        break  # the follower's connection drops at the kill
            (pid,) = server.engine().executor.worker_pids().values()  # type: ignore[attr-defined]
            os.kill(pid, signal.SIGKILL)
            rest = await read_events(client, "k", **{"Last-Event-ID": str(seen[-1])})
            whole = await read_events(client, "k")
            body = (await client.get(f"{JOBS}/k")).json()
            await wait_until(lambda: "job.completed" in hook.events())
            restarts = server.engine().health().restarts
    assert parse_sse(rest)[-1][0] == "job.completed", rest[-500:]
    assert seen + event_ids(rest) == event_ids(whole)
    assert body["status"] == "completed" and image_of(body) == ("k", 7, 0)
    assert restarts == 1
    headers, raw, _ = hook.calls[-1]
    assert headers["x-omni-trio-signature-256"] == sign(b"s3cret", raw)
