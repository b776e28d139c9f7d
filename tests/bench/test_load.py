"""The load generators and their figures (omni_trio/bench/load.py), on fake calls and a
``MockClock``."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from omni_trio.bench.load import (
    LoadResult,
    Outcome,
    closed_loop,
    mode_summary,
    open_loop,
    poisson_arrivals,
)

from .conftest import LoadRun


def test_poisson_arrivals_are_seeded_increasing_and_inside_the_duration() -> None:
    arrivals = poisson_arrivals(50.0, 20.0, seed=6)
    assert arrivals == poisson_arrivals(50.0, 20.0, seed=6)
    assert arrivals != poisson_arrivals(50.0, 20.0, seed=7)
    assert all(a < b for a, b in itertools.pairwise(arrivals))
    assert arrivals[0] > 0.0 and arrivals[-1] < 20.0
    # 1000 expected; a Poisson count's standard deviation is sqrt(1000) ~ 32.
    assert 850 < len(arrivals) < 1150


@pytest.mark.parametrize(("rate", "duration"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_poisson_arrivals_reject_a_rate_or_duration_that_is_not_positive(
    rate: float, duration: float
) -> None:
    with pytest.raises(ValueError, match="> 0"):
        poisson_arrivals(rate, duration, seed=0)


def test_a_load_result_counts_completions_and_errors_apart(load_result: LoadRun) -> None:
    run = load_result([10.0, 20.0], 0.5, e429=2)
    assert (run.completed, run.failed, run.requests) == (2, 2, 4)
    assert run.requests_per_s == pytest.approx(4.0)
    assert run.errors == Counter({"429": 2})
    assert run.server_ms == [5.0, 10.0] and run.queue_wait_ms == [1.0, 1.0]
    assert LoadResult(requests=0).requests_per_s == 0.0


def test_mode_summary_pools_latencies_and_summarises_rounds(load_result: LoadRun) -> None:
    figures = mode_summary([load_result([10.0, 30.0], 1.0), load_result([20.0], 0.5, e503=1)])
    assert figures["requests_per_s"].spread("{:.0f}") == "2 / 2 / 2"
    assert figures["latency_ms"].p50 == pytest.approx(20.0)
    assert figures["server_ms"].p50 == pytest.approx(10.0)
    assert (figures["requests"], figures["completed"], figures["failed"]) == (4, 3, 1)
    assert figures["errors"] == {"503": 1}
    empty = mode_summary([load_result([], 1.0, e429=3)])
    assert empty["latency_ms"] is None and empty["failed"] == 3


# -- load generators ---------------------------------------------------------------------------


def _sleeper(
    seconds: float, fail_every: int = 0
) -> tuple[list[float], Callable[[], Awaitable[Outcome]]]:
    """A fake call that takes ``seconds``; every ``fail_every``-th call answers 429."""
    starts: list[float] = []

    async def call() -> Outcome:
        starts.append(trio.current_time())
        n = len(starts)
        await trio.sleep(seconds)
        if fail_every and n % fail_every == 0:
            return Outcome("429")
        return Outcome()

    return starts, call


async def test_closed_loop_clients_send_back_to_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    starts, call = _sleeper(1.0, fail_every=4)
    t0 = trio.current_time()
    result = await closed_loop(call, requests=8, concurrency=3)
    # 3 clients: requests start at 0, 0, 0, 1, 1, 1, 2, 2; the run ends at 3 s.
    assert [s - t0 for s in starts] == [0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 2.0, 2.0]
    assert result.wall_s == pytest.approx(3.0)
    assert result.latencies_s == pytest.approx([1.0] * 6)
    assert result.errors == Counter({"429": 2})
    assert result.requests_per_s == pytest.approx(2.0)


async def test_open_loop_sends_at_the_arrival_times_whatever_is_in_flight(
    autojump_clock: trio.testing.MockClock,
) -> None:
    starts, call = _sleeper(2.0)
    t0 = trio.current_time()
    result = await open_loop(call, [0.5, 0.6, 3.0], duration_s=4.0)
    assert [s - t0 for s in starts] == pytest.approx([0.5, 0.6, 3.0])
    assert result.latencies_s == pytest.approx([2.0, 2.0, 2.0])
    # The last completion (5 s) is past the duration (4 s): 3 / 5 s.
    assert result.wall_s == pytest.approx(5.0)
    assert result.requests_per_s == pytest.approx(0.6)
    assert result.unfinished == 0


async def test_open_loop_latency_counts_from_the_scheduled_arrival(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # One server slot: the second request queues behind the first.
    slot = trio.Lock()

    async def call() -> Outcome:
        async with slot:
            await trio.sleep(1.0)
        return Outcome()

    result = await open_loop(call, [0.0, 0.25], duration_s=1.0)
    assert result.latencies_s == pytest.approx([1.0, 1.75])
    assert result.wall_s == pytest.approx(2.0)


async def test_open_loop_cancels_what_is_left_after_the_drain_limit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    _, call = _sleeper(100.0)
    t0 = trio.current_time()
    result = await open_loop(call, [0.0, 1.0], duration_s=2.0, drain_s=5.0)
    assert trio.current_time() - t0 == pytest.approx(7.0)
    assert (result.completed, result.failed, result.unfinished) == (0, 0, 2)
    assert result.wall_s == pytest.approx(2.0)
    figures = mode_summary([result])
    assert (figures["unfinished"], figures["errors"]) == (2, {})
