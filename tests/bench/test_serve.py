"""``bench serve``'s pure helpers and its load generators, on fake calls and a ``MockClock``.

The experiment end to end (real server, real engines) is the smoke test in
``test_experiments.py``.
"""

from __future__ import annotations

from collections import Counter

import pytest

from omni_trio.bench.serve import (
    SEED,
    compare_modes,
    format_errors,
    generation_body,
    open_loop_rate,
)
from omni_trio.serve.images import ServeLimits, parse_generation_request

from .conftest import LoadRun

# -- pure helpers ------------------------------------------------------------------------------


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


def test_http_is_compared_with_direct_pair_by_pair(load_result: LoadRun) -> None:
    http = [load_result([12.0, 14.0], 2.0), load_result([16.0], 1.0)]
    direct = [load_result([10.0, 10.0], 1.0), load_result([10.0], 0.5)]
    compared = compare_modes(http, direct)
    assert compared["http_over_direct_requests_per_s"].spread("{:.2f}") == "0.50 / 0.50 / 0.50"
    # Pooled p50s: http 14 ms, direct 10 ms.  Per round: 13 - 10 and 16 - 10.
    assert compared["added_latency_ms_p50"] == pytest.approx(4.0)
    assert compared["added_latency_ms_p50_per_round"].spread("{:.1f}") == "3.0 / 4.5 / 6.0"
    nothing = compare_modes([load_result([], 1.0, e429=1)], [load_result([10.0], 1.0)])
    assert nothing["added_latency_ms_p50"] is None
    assert nothing["added_latency_ms_p50_per_round"] is None
