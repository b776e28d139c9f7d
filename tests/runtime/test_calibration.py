"""The compute budget on a real model: measured at warmup, applied at admission.

One real ``builtin:tiny-sd`` engine (inproc, one torch thread) is measured; the requests the
issue names (1024x1024 with n=4 took ~137 s per step here) are refused with the estimate and
the limit before anything runs, while ordinary ones run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from omni_trio import EngineConfig, RequestTooCostlyError, SamplingParams, open_engine
from omni_trio.runtime import calibration

CAP_S = 120


@pytest.fixture(autouse=True)
def _fresh_measurements() -> Iterator[None]:
    calibration.forget_measurements()
    yield
    calibration.forget_measurements()


def _config(cache_dir: Path, **overrides: object) -> EngineConfig:
    return EngineConfig(
        model="builtin:tiny-sd", cache_dir=str(cache_dir), torch_threads=1, **overrides
    )


async def test_warmup_measures_the_model_and_admission_refuses_what_is_over_budget(
    cache_dir: Path,
) -> None:
    with trio.fail_after(CAP_S):
        async with open_engine(_config(cache_dir)) as engine:
            cost = engine.core.cost_model
            assert cost is not None and cost.probe.side >= 64 and cost.probe.step_s > 0
            # The probes are warmup traffic: nobody's requests.
            assert engine.statistics().admitted == 0
            big = SamplingParams(height=1024, width=1024, num_outputs_per_prompt=4)
            with pytest.raises(RequestTooCostlyError) as info:
                engine.stream("a red circle", big)
            err = info.value
            assert err.param == "size" and err.limit_s == 10.0 and err.estimate_s > 10.0
            assert "1024x1024, n=4" in str(err) and "max_step_s" in str(err)
            assert engine.is_idle()
            # Many steps of a size each step of which is fine: over the wall-time budget.
            long = SamplingParams(height=512, width=512, num_inference_steps=1000)
            with pytest.raises(RequestTooCostlyError, match="max_request_s"):
                engine.stream("a red circle", long)
            out = await engine.generate(
                "a red circle", SamplingParams(height=64, width=64, num_inference_steps=2)
            )
            assert out.ok and out.metrics.step_ms is not None and out.metrics.step_ms > 0
            assert engine.statistics().admitted == 1


async def test_a_second_engine_reuses_the_measurement_and_no_budget_measures_nothing(
    cache_dir: Path,
) -> None:
    huge = SamplingParams(height=1024, width=1024, num_outputs_per_prompt=4)
    with trio.fail_after(CAP_S):
        async with open_engine(_config(cache_dir, max_request_s=None, max_step_s=None)) as off:
            assert off.core.cost_model is None
            await off.stream("x", huge).aclose()  # admitted, then dropped (aborted)
        async with open_engine(_config(cache_dir)) as first:
            measured = first.core.cost_model
            assert measured is not None
        async with open_engine(
            _config(cache_dir, max_request_s=1000.0, max_step_s=1000.0)
        ) as second:
            assert second.core.cost_model is measured
            # The limits are the engine's own: what the first refused, the second admits.
            await second.stream("x", huge.replace(num_inference_steps=1)).aclose()


async def test_models_that_are_not_measured_have_no_budget(cache_dir: Path) -> None:
    with trio.fail_after(CAP_S):
        async with open_engine(
            EngineConfig(model="builtin:echo", cache_dir=str(cache_dir), warmup=True)
        ) as engine:
            assert engine.core.cost_model is None
            out = await engine.generate(
                "x",
                SamplingParams(
                    height=1024, width=1024, num_outputs_per_prompt=4, num_inference_steps=1
                ),
            )
            assert out.ok
