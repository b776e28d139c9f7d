"""Load generators and what they measure: a closed loop (C clients back to back) and an open
loop (Poisson arrivals, one task each), over any :data:`Call`, and the figures of a mode over
its rounds.  Shared by ``bench serve`` (:mod:`.serve`) and its API parts (:mod:`.serve_api`).

Times come from trio's clock (``perf_counter`` unless a test gives a ``MockClock``).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import trio

from .harness import Summary

__all__ = [
    "DRAIN_S",
    "Call",
    "LoadResult",
    "Outcome",
    "closed_loop",
    "mode_summary",
    "open_loop",
    "poisson_arrivals",
]

# Open loop: after the last arrival, requests still in flight get this long; the rest are
# cancelled (aborted) and counted as unfinished.
DRAIN_S = 30.0


class Outcome(NamedTuple):
    """How one request ended: ``error`` is None on success, else its key (an HTTP status like
    ``"429"``, a transport error's type name, or the engine's error type); ``server_ms`` is the
    server's own time from the answer (http successes only); ``queue_wait_ms`` the engine's
    queue wait of the request (successes)."""

    error: str | None = None
    server_ms: float | None = None
    queue_wait_ms: float | None = None


@dataclass
class LoadResult:
    """What one load run measured.  ``wall_s`` is the run's duration; latencies are of
    completed requests, in seconds; ``unfinished`` counts open-loop requests cancelled at the
    drain limit."""

    requests: int
    wall_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    server_ms: list[float] = field(default_factory=list)
    queue_wait_ms: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    unfinished: int = 0

    @property
    def completed(self) -> int:
        return len(self.latencies_s)

    @property
    def failed(self) -> int:
        return sum(self.errors.values())

    @property
    def requests_per_s(self) -> float:
        return self.completed / self.wall_s if self.wall_s > 0 else 0.0

    def record(self, outcome: Outcome, latency_s: float) -> None:
        if outcome.error is not None:
            self.errors[outcome.error] += 1
            return
        self.latencies_s.append(latency_s)
        if outcome.server_ms is not None:
            self.server_ms.append(outcome.server_ms)
        if outcome.queue_wait_ms is not None:
            self.queue_wait_ms.append(outcome.queue_wait_ms)


def poisson_arrivals(rate: float, duration_s: float, *, seed: int) -> list[float]:
    """Arrival times (seconds from the start, increasing, all < ``duration_s``) of a Poisson
    process of ``rate`` per second, drawn from ``random.Random(seed)``."""
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a finite number > 0, got {rate!r}")
    if not (math.isfinite(duration_s) and duration_s > 0):
        raise ValueError(f"duration must be a finite number > 0, got {duration_s!r}")
    draw = random.Random(seed)
    arrivals: list[float] = []
    now = draw.expovariate(rate)
    while now < duration_s:
        arrivals.append(now)
        now += draw.expovariate(rate)
    return arrivals


def mode_summary(runs: Sequence[LoadResult]) -> dict[str, Any]:
    """One mode's figures over its rounds: requests/s per round, latency over every completed
    request (ms), the server's time (ms, http only), the engine's queue wait (ms), counts and
    errors."""
    latencies = [s for r in runs for s in r.latencies_s]
    server = [s for r in runs for s in r.server_ms]
    queue_wait = [s for r in runs for s in r.queue_wait_ms]
    errors: Counter[str] = Counter()
    for r in runs:
        errors.update(r.errors)
    return {
        "requests_per_s": Summary.of([r.requests_per_s for r in runs]),
        "latency_ms": Summary.of(latencies).scaled(1000.0) if latencies else None,
        "server_ms": Summary.of(server) if server else None,
        "queue_wait_ms": Summary.of(queue_wait) if queue_wait else None,
        "requests": sum(r.requests for r in runs),
        "completed": sum(r.completed for r in runs),
        "failed": sum(r.failed for r in runs),
        "unfinished": sum(r.unfinished for r in runs),
        "errors": dict(errors),
    }


Call = Callable[[], Awaitable[Outcome]]


async def closed_loop(call: Call, *, requests: int, concurrency: int) -> LoadResult:
    """``requests`` calls from ``concurrency`` client tasks, each calling again as soon as its
    previous call returned.  Failures are counted (``Outcome.error``), never raised; an
    exception from ``call`` (the engine died) cancels the other clients and propagates.
    Times come from trio's clock (``perf_counter`` unless a test gives a ``MockClock``)."""
    result = LoadResult(requests=requests)
    remaining = iter(range(requests))  # shared: each client takes the next request
    clock = trio.current_time

    async def client() -> None:
        for _ in remaining:
            started = clock()
            outcome = await call()
            result.record(outcome, clock() - started)

    started = clock()
    async with trio.open_nursery() as nursery:
        for _ in range(max(1, min(concurrency, requests))):
            nursery.start_soon(client)
    result.wall_s = clock() - started
    return result


async def open_loop(
    call: Call, arrivals: Sequence[float], *, duration_s: float, drain_s: float = DRAIN_S
) -> LoadResult:
    """One task per arrival, started at its time (seconds from now) whatever is still in
    flight.  Latency counts from the scheduled arrival.  Requests still in flight
    ``drain_s`` after ``duration_s`` are cancelled and counted as unfinished.  Achieved
    requests/s is completed / max(``duration_s``, time of the last completion)."""
    result = LoadResult(requests=len(arrivals))
    start = trio.current_time()
    last_end = start

    async def one(at: float) -> None:
        nonlocal last_end
        outcome = await call()
        now = trio.current_time()
        last_end = max(last_end, now)
        result.record(outcome, now - at)

    with trio.move_on_after(duration_s + drain_s):
        async with trio.open_nursery() as nursery:
            for offset in arrivals:
                await trio.sleep_until(start + offset)
                nursery.start_soon(one, start + offset)
    result.unfinished = len(arrivals) - result.completed - result.failed
    result.wall_s = max(duration_s, last_end - start)
    return result
