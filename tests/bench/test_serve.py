"""``bench serve``'s pure helpers and its load generators, on fake calls and a ``MockClock``.

The experiment end to end (real server, real engines) is the smoke test in
``test_experiments.py``.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from omni_trio.bench.serve import (
    SEED,
    LoadResult,
    Outcome,
    closed_loop,
    compare_modes,
    format_errors,
    generation_body,
    mode_summary,
    open_loop,
    open_loop_rate,
    poisson_arrivals,
)
from omni_trio.serve.images import ServeLimits, parse_generation_request

# -- pure helpers ------------------------------------------------------------------------------


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


def test_the_open_loop_rate_is_given_or_a_fraction_of_the_closed_loop_median() -> None:
    assert open_loop_rate(12.5, [100.0]) == (12.5, "given")
    rate, source = open_loop_rate(None, [90.0, 100.0, 200.0])
    assert rate == pytest.approx(70.0)
    assert source == "70% of 100 req/s"
    with pytest.raises(ValueError, match="no closed-loop throughput"):
        open_loop_rate(None, [0.0])


def test_errors_are_formatted_most_frequent_first() -> None:
    assert format_errors(Counter()) == "0"
    assert format_errors({"503": 1, "429": 3}) == "429 x3, 503 x1"
    assert format_errors({}, unfinished=2) == "unfinished x2"


def test_the_direct_mode_runs_what_the_app_parses_from_the_http_body() -> None:
    body = generation_body(steps=10, size=64)
    assert body["response_format"] == "b64_json"
    parsed = parse_generation_request(body, limits=ServeLimits(), default_model="builtin:echo")
    params = parsed.params
    assert (params.height, params.width, params.num_inference_steps) == (64, 64, 10)
    assert params.seed == SEED and params.num_outputs_per_prompt == 1


def _run(latencies_ms: list[float], wall_s: float, **errors: int) -> LoadResult:
    result = LoadResult(requests=len(latencies_ms) + sum(errors.values()), wall_s=wall_s)
    for ms in latencies_ms:
        result.record(Outcome(server_ms=ms / 2, queue_wait_ms=1.0), ms / 1000.0)
    for key, n in errors.items():
        for _ in range(n):
            result.record(Outcome(key.removeprefix("e")), 0.0)
    return result


def test_a_load_result_counts_completions_and_errors_apart() -> None:
    run = _run([10.0, 20.0], 0.5, e429=2)
    assert (run.completed, run.failed, run.requests) == (2, 2, 4)
    assert run.requests_per_s == pytest.approx(4.0)
    assert run.errors == Counter({"429": 2})
    assert run.server_ms == [5.0, 10.0] and run.queue_wait_ms == [1.0, 1.0]
    assert LoadResult(requests=0).requests_per_s == 0.0


def test_mode_summary_pools_latencies_and_summarises_rounds() -> None:
    figures = mode_summary([_run([10.0, 30.0], 1.0), _run([20.0], 0.5, e503=1)])
    assert figures["requests_per_s"].spread("{:.0f}") == "2 / 2 / 2"
    assert figures["latency_ms"].p50 == pytest.approx(20.0)
    assert figures["server_ms"].p50 == pytest.approx(10.0)
    assert (figures["requests"], figures["completed"], figures["failed"]) == (4, 3, 1)
    assert figures["errors"] == {"503": 1}
    empty = mode_summary([_run([], 1.0, e429=3)])
    assert empty["latency_ms"] is None and empty["failed"] == 3


def test_http_is_compared_with_direct_pair_by_pair() -> None:
    http = [_run([12.0, 14.0], 2.0), _run([16.0], 1.0)]
    direct = [_run([10.0, 10.0], 1.0), _run([10.0], 0.5)]
    compared = compare_modes(http, direct)
    assert compared["http_over_direct_requests_per_s"].spread("{:.2f}") == "0.50 / 0.50 / 0.50"
    # Pooled p50s: http 14 ms, direct 10 ms.  Per round: 13 - 10 and 16 - 10.
    assert compared["added_latency_ms_p50"] == pytest.approx(4.0)
    assert compared["added_latency_ms_p50_per_round"].spread("{:.1f}") == "3.0 / 4.5 / 6.0"
    nothing = compare_modes([_run([], 1.0, e429=1)], [_run([10.0], 1.0)])
    assert nothing["added_latency_ms_p50"] is None
    assert nothing["added_latency_ms_p50_per_round"] is None


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
    assert format_errors(mode_summary([result])["errors"], result.unfinished) == "unfinished x2"
