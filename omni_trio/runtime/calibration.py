"""Measuring the model at warmup for the compute budget (the shell half of ``_core.cost``).

After warmup the engine runs a few short probe requests (3 steps, one image, growing sizes;
kept out of the statistics) through the whole path and fits a
:class:`~omni_trio._core.cost.CostModel` from their step times, which admission then uses to
refuse requests over ``max_request_s`` / ``max_step_s``.  The probes stop once a step is
compute bound (:data:`~omni_trio._core.cost.PROBE_ENOUGH_S`), at the largest size the limits
and the model allow, or once they took :data:`~omni_trio._core.cost.PROBE_BUDGET_S`; on this
2-core machine ``builtin:tiny-sd`` probes 64, 128 and 256 pixels in about 0.6 s.

A measurement belongs to the machine and the setup, not to one engine: it is kept for the
life of the process, keyed on what changes the time of a step (model, device, dtype, backend,
workers, threads, execution mode), so restarts and later engines reuse it.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any, Protocol

import trio

from .._core.cost import (
    PROBE_BUDGET_S,
    PROBE_ENOUGH_S,
    PROBE_MAX_SIDE,
    PROBE_STEPS,
    CostModel,
    CostProbe,
    probe_from_timings,
    probe_sides,
)
from .._core.engine_core import WARMUP_REQUEST_ID
from .._core.request import SamplingParams
from ..errors import OmniTrioError

if TYPE_CHECKING:
    from .._core.engine_core import EngineCore
    from .._core.messages import DiffusionOutput
    from .._core.model_info import ModelInfo
    from ..config import EngineConfig
    from ..executors.base import Executor


class _Engine(Protocol):
    """What calibration needs of the engine (:class:`~.engine.AsyncEngine`)."""

    config: EngineConfig
    core: EngineCore

    @property
    def executor(self) -> Executor: ...

    async def generate(
        self, prompt: str, params: SamplingParams, *, request_id: str
    ) -> DiffusionOutput: ...


__all__ = ["calibrate", "forget_measurements"]

log = logging.getLogger(__name__)

_MEASURED: dict[tuple[Any, ...], CostModel] = {}


def forget_measurements() -> None:
    """Drop every kept measurement (the next warmup measures again)."""
    _MEASURED.clear()


def _key(config: EngineConfig) -> tuple[Any, ...]:
    return (
        config.model,
        repr(sorted((str(k), repr(v)) for k, v in config.model_options.items())),
        config.device,
        config.dtype,
        repr(config.backend),
        config.num_workers,
        config.cfg_parallel,
        config.torch_threads,
        config.step_execution,
    )


async def calibrate(engine: _Engine) -> CostModel | None:
    """Measure (or recall) the engine's cost model and hand it to the core; None when the
    model is not measured (``ModelInfo.calibrate`` false) or no budget is configured.

    Runs on the engine's trio thread inside warmup (its probes are warmup traffic); a probe
    that fails ends the probing with what was measured so far (nothing measured: no budget,
    logged).  Cancellation aborts the probe in flight (its slot is freed as for any request)
    and measures nothing.
    """
    config = engine.config
    info = engine.executor.model_info
    if info is None or not info.calibrate:
        return None
    if config.max_request_s is None and config.max_step_s is None:
        return None
    key = _key(config)
    cost = _MEASURED.get(key)
    if cost is None:
        started = trio.current_time()
        probes = await _probe(engine, info)
        if not probes:
            log.warning("could not measure %s: no compute budget applies", config.model)
            return None
        cost = CostModel.fit(probes, fixed_size=bool(info.fixed_size))
        _MEASURED[key] = cost
        log.info(
            "measured %s in %.2f s: %.1f ms per step at %dx%d (compute budget: %s s per "
            "request, %s s per step)",
            config.model,
            trio.current_time() - started,
            cost.probe.step_s * 1000.0,
            cost.probe.side,
            cost.probe.side,
            config.max_request_s,
            config.max_step_s,
        )
    engine.core.cost_model = cost
    return cost


async def _probe(engine: _Engine, info: ModelInfo) -> list[CostProbe]:
    config = engine.config
    if info.fixed_size:
        sides: list[int | None] = [None]
    else:
        limit = min(math.isqrt(config.max_pixels), info.max_side or PROBE_MAX_SIDE)
        start = max(info.min_side, min(64, info.default_height))
        sides = list(probe_sides(start, limit))
    probes: list[CostProbe] = []
    started = trio.current_time()
    for side in sides:
        params = SamplingParams(
            height=side, width=side, num_inference_steps=PROBE_STEPS, seed=0, output_type="np"
        )
        try:
            output = await engine.generate("calibration", params, request_id=WARMUP_REQUEST_ID)
        except OmniTrioError as exc:
            log.info("calibration probe at %s px failed (%s): probing stops", side, exc)
            break
        metrics = output.metrics
        actual = side if side is not None else info.default_height
        probe = probe_from_timings(actual, PROBE_STEPS, metrics.step_ms, metrics.execution_ms)
        probes.append(probe)
        if probe.step_s >= PROBE_ENOUGH_S or trio.current_time() - started >= PROBE_BUDGET_S:
            break
    return probes
