"""The compute budget's estimate: linear below the measured size, quadratic above it,
linear in images and steps; refusals name the estimate and the limit."""

from __future__ import annotations

import pytest

from omni_trio._core.cost import (
    PROBE_MAX_SIDE,
    CostModel,
    CostProbe,
    probe_from_timings,
    probe_sides,
)
from omni_trio.errors import InvalidRequestError, RequestTooCostlyError

# Measured on the 2-core machine for builtin:tiny-sd: 108 ms per step at 256x256.
TINY_SD = CostModel(CostProbe(side=256, step_s=0.108, rest_s=0.15))


def test_the_fit_uses_the_largest_probe() -> None:
    probes = [CostProbe(64, 0.008, 0.04), CostProbe(256, 0.108, 0.15), CostProbe(128, 0.025, 0.06)]
    assert CostModel.fit(probes).probe.side == 256
    with pytest.raises(ValueError):
        CostModel.fit([])


def test_time_grows_with_the_square_of_the_pixels_above_the_probe() -> None:
    at_probe = TINY_SD.estimate(256, 256, 1)
    double_side = TINY_SD.estimate(512, 512, 1)  # 4x the pixels
    assert at_probe.step_s == pytest.approx(0.108)
    assert double_side.step_s == pytest.approx(0.108 * 16)
    assert double_side.rest_s == pytest.approx(0.15 * 16)


def test_time_is_linear_below_the_probe_and_in_images_and_steps() -> None:
    half = TINY_SD.estimate(128, 256, 10, n=3)
    assert half.step_s == pytest.approx(0.108 * 0.5 * 3)
    assert half.total_s == pytest.approx(half.step_s * 10 + 0.15 * 0.5 * 3)


def test_a_fixed_size_model_scales_only_with_images_and_steps() -> None:
    cost = CostModel(CostProbe(32, 0.01, 0.02), fixed_size=True)
    est = cost.estimate(32, 32, 50, n=2)
    assert est.total_s == pytest.approx(0.01 * 2 * 50 + 0.02 * 2)


def test_a_request_over_the_wall_time_budget_is_refused_with_the_estimate() -> None:
    # 1024x1024 at n=1: 16x the side ratio squared -> 256 x 0.108 = 27.6 s per step.
    with pytest.raises(RequestTooCostlyError) as info:
        TINY_SD.check(768, 768, 30, 1, max_request_s=120.0, max_step_s=None)
    err = info.value
    assert isinstance(err, InvalidRequestError) and err.param == "size"
    assert err.limit_s == 120.0
    assert err.estimate_s == pytest.approx(TINY_SD.estimate(768, 768, 30).total_s)
    assert "120 s" in str(err) and "768x768" in str(err) and "max_request_s" in str(err)
    assert err.code == "request_too_costly"


def test_a_step_nothing_can_interrupt_is_bounded_on_its_own() -> None:
    # 1024x1024, n=4, 1 step: fine by total time only if the total limit is huge.
    with pytest.raises(RequestTooCostlyError) as info:
        TINY_SD.check(1024, 1024, 1, 4, max_request_s=None, max_step_s=10.0)
    assert "per uninterruptible step" in str(info.value) and "max_step_s" in str(info.value)
    assert info.value.limit_s == 10.0


def test_requests_within_both_limits_pass_and_no_limit_never_refuses() -> None:
    est = TINY_SD.check(512, 512, 20, 1, max_request_s=120.0, max_step_s=10.0)
    assert est.total_s < 120.0
    TINY_SD.check(4096, 4096, 1000, 16, max_request_s=None, max_step_s=None)


def test_probe_sizes_double_up_to_the_limit() -> None:
    assert probe_sides(64, 256) == [64, 128, 256]
    assert probe_sides(64, 200) == [64, 128, 200]
    assert probe_sides(24, 64) == [24, 48, 64]
    assert probe_sides(64, 4096)[-1] == PROBE_MAX_SIDE
    assert probe_sides(64, 32) == [64]  # never below the start


def test_a_probe_without_step_timings_spreads_the_forward_over_its_steps() -> None:
    timed = probe_from_timings(128, 3, step_ms=25.0, forward_ms=115.0)
    assert timed.step_s == pytest.approx(0.025) and timed.rest_s == pytest.approx(0.04)
    untimed = probe_from_timings(128, 3, step_ms=None, forward_ms=120.0)
    assert untimed.step_s == pytest.approx(0.04) and untimed.rest_s == pytest.approx(0.04)
