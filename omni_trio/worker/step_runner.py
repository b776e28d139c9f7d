"""Step-mode execution: one denoising step per tick for every scheduled request.

The step runner keeps each request's :class:`StepState` (prompt embeddings, latents, its own
copy of the diffusers scheduler, its generator) between ticks; the scheduler holds only
lifecycle and progress.  Every tick:

1. evicts the state of requests the scheduler reports finished (and of aborted ones),
2. runs ``prepare_encode`` once for each new request,
3. runs ONE fused ``denoise_step`` over every live request, each at its own timestep,
4. advances each request with ``step_scheduler`` and decodes finished ones (``post_decode``),
   plus a preview every ``preview_interval`` steps when streaming.

A failure of one request's call finishes only that request; the others continue.

With several ranks (``world_size > 1``) every rank runs every tick in lockstep (under CFG
parallelism each fused UNet call is split across them), so a tick must not depend on
per-rank state: the stop flags are NOT consulted at tick start there, since an abort reaches
the ranks at different moments.  Nothing is lost: the engine never schedules an aborted
request, and it reports the abort itself; the state is evicted once the request shows up in
``finished_req_ids``.  A failed collective
(:class:`~omni_trio.worker.cfg_parallel.CollectiveError`) ends the tick with that error: the
worker, not a request, has failed; so does a
:class:`~omni_trio.worker.faults.WorkerFatalError`.

Fault injection (:mod:`omni_trio.worker.faults`): a request's plan is built when it arrives
(a malformed ``faults`` entry fails it with ``ValueError``); its step faults fire at its
``k``-th step, after the fused denoise and before ``step_scheduler`` (so a raise fails only
that request, leaving its ``step_index`` at ``k``); its packing faults fire before its final
decode.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .._core.messages import BatchRunnerOutput, RunnerOutput, SchedulerOutput
from ..config import EngineConfig
from .cfg_parallel import CollectiveError
from .device import check_device
from .faults import FaultInjector, FaultPlan, WorkerFatalError
from .stop_flags import StopFlags

if TYPE_CHECKING:
    import torch

    from ..models import StepAdapter, StepState

__all__ = ["StepRunner"]

log = logging.getLogger(__name__)


class StepRunner:
    """Owns per-request step state for one worker; synchronous (runs in the worker's thread)."""

    def __init__(
        self,
        config: EngineConfig,
        adapter: StepAdapter,
        device: torch.device,
        stop_flags: StopFlags,
        progress: dict[str, tuple[int, int]] | Any,
        convert: Callable[[Any, str], Any],
        *,
        world_size: int = 1,
        faults: FaultInjector | None = None,
    ) -> None:
        self.config = config
        self.adapter = adapter
        self.device = device
        self.stop_flags = stop_flags
        self.progress = progress
        self._convert = convert
        # Ranks running each tick in lockstep; above 1 the stop flags are not consulted.
        self.world_size = world_size
        self.states: dict[str, StepState] = {}
        # Wall time each live request has spent in ticks (ms), reported as forward_ms.
        self._elapsed_ms: dict[str, float] = {}
        self.faults = (
            faults
            if faults is not None
            else FaultInjector.from_config(config, stop_flags=stop_flags)
        )
        # Fault plans of live requests that have faults (and only those).
        self._fault_plans: dict[str, FaultPlan] = {}

    def leftovers(self) -> dict[str, set[str]]:
        """``step_states``: requests this runner holds step state (or a fault plan) for."""
        return {"step_states": snapshot_keys(self.states) | snapshot_keys(self._fault_plans)}

    def evict(self, request_ids: Sequence[str] | frozenset[str]) -> None:
        """Drop the state of requests that are over (finished, aborted or unknown ids)."""
        for rid in request_ids:
            state = self.states.pop(rid, None)
            self._elapsed_ms.pop(rid, None)
            self._fault_plans.pop(rid, None)
            self.progress.pop(rid, None)
            if state is not None:
                try:
                    self.adapter.release(state)
                except Exception:  # pragma: no cover - cleanup must not fail a tick
                    log.exception("releasing step state of %s failed", rid)

    def execute(self, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
        """Run one tick for ``scheduler_output``; one output per scheduled request.

        Raises only for a broken worker: a failed collective, a :class:`WorkerFatalError`.
        """
        import torch

        self.evict(scheduler_output.finished_req_ids)
        self.stop_flags.forget(scheduler_output.finished_req_ids)
        outputs: dict[str, RunnerOutput] = {}
        started = time.perf_counter()
        with torch.inference_mode():
            for new in scheduler_output.scheduled_new_reqs:
                rid = new.request_id
                if rid in self.states:
                    outputs[rid] = RunnerOutput(
                        rid, error=f"request {rid} already has step state", error_type="ValueError"
                    )
                    continue
                plan = self.faults.plan((new.request,))
                if plan.invalid:
                    outputs[rid] = RunnerOutput(
                        rid, error=plan.invalid[rid], error_type="ValueError"
                    )
                    continue
                try:
                    self.states[rid] = self._prepare(new.request)
                    self._elapsed_ms[rid] = 0.0
                except Exception as exc:
                    outputs[rid] = RunnerOutput.from_exception(rid, exc)
                    continue
                if plan:
                    self._fault_plans[rid] = plan
            live: list[StepState] = []
            for rid in scheduler_output.scheduled_request_ids:
                if rid in outputs:
                    continue
                state = self.states.get(rid)
                if state is None:
                    outputs[rid] = RunnerOutput(
                        rid, error=f"no step state for request {rid}", error_type="LookupError"
                    )
                elif self.world_size == 1 and self.stop_flags.is_aborted(rid):
                    outputs[rid] = RunnerOutput(rid, aborted=True)
                    self.evict((rid,))
                else:
                    live.append(state)
            if live:
                outputs.update(self._tick(live, started))
        return BatchRunnerOutput(outputs)

    def _prepare(self, request: Any) -> StepState:
        import torch

        gen_device = self.device if self.device.type == "cuda" else torch.device("cpu")
        generator = torch.Generator(device=gen_device).manual_seed(int(request.sampling.seed))
        return self.adapter.prepare_encode(request, generator)

    def _denoise(self, live: list[StepState]) -> dict[str, Any]:
        """Fused call; if it fails with several requests, find the failing ones alone."""
        try:
            preds = self.adapter.denoise_step(live)
            return {s.request_id: p for s, p in zip(live, preds, strict=True)}
        except (CollectiveError, WorkerFatalError):
            raise  # the worker (e.g. its CFG-parallel group) is broken: no retry can succeed
        except Exception as exc:
            if len(live) == 1:
                return {live[0].request_id: exc}
        results: dict[str, Any] = {}
        for state in live:
            try:
                results[state.request_id] = self.adapter.denoise_step([state])[0]
            except (CollectiveError, WorkerFatalError):
                raise
            except Exception as exc:
                results[state.request_id] = exc
        return results

    def _tick(self, live: list[StepState], started: float) -> dict[str, RunnerOutput]:
        outputs: dict[str, RunnerOutput] = {}
        preds = self._denoise(live)
        streaming = self.config.streaming_output
        interval = self.config.preview_interval
        plans = self._fault_plans
        for state in live:
            rid = state.request_id
            pred = preds[rid]
            try:
                if isinstance(pred, Exception):
                    raise pred
                plan = plans.get(rid)
                if plan is not None:
                    plan.on_step(rid, state.step_index, state.total_steps)
                self.adapter.step_scheduler(state, pred)
                self._elapsed_ms[rid] = (
                    self._elapsed_ms.get(rid, 0.0) + (time.perf_counter() - started) * 1000.0
                )
                self.progress[rid] = (state.step_index, state.total_steps)
                if state.denoise_completed:
                    outputs[rid] = self._final(state)
                elif streaming and state.step_index % interval == 0:
                    outputs[rid] = RunnerOutput(
                        rid,
                        images=self._decode(state),
                        finished=False,
                        step_index=state.step_index,
                        total_steps=state.total_steps,
                    )
                else:
                    outputs[rid] = RunnerOutput(
                        rid,
                        finished=False,
                        step_index=state.step_index,
                        total_steps=state.total_steps,
                    )
            except WorkerFatalError:
                raise
            except Exception as exc:
                check_device(self.device, self.faults, exc)  # a broken device ends the worker
                log.debug("step of %s failed", rid, exc_info=True)
                outputs[rid] = RunnerOutput.from_exception(rid, exc, step_index=state.step_index)
                self.evict((rid,))
        return outputs

    def _decode(self, state: StepState) -> tuple[Any, ...]:
        output_type = state.request.sampling.output_type
        raw = self.adapter.post_decode(
            state, output_type="latent" if output_type == "latent" else "np"
        )
        return tuple(self._convert(img, output_type) for img in raw)

    def _final(self, state: StepState) -> RunnerOutput:
        rid = state.request_id
        post_started = time.perf_counter()
        plan = self._fault_plans.get(rid)
        if plan is not None:
            plan.before_pack(rid)
        images = self._decode(state)
        timings = {
            "forward_ms": self._elapsed_ms.get(rid, 0.0),
            "postprocess_ms": (time.perf_counter() - post_started) * 1000.0,
        }
        step_index = state.step_index
        self.evict((rid,))
        return RunnerOutput(
            rid, images=images, finished=True, step_index=step_index, timings=timings
        )

    def close(self) -> None:
        self.evict(list(self.states))


def snapshot_keys(mapping: Mapping[str, Any]) -> set[str]:
    """A copy of ``mapping``'s keys, safe while another thread resizes it."""
    while True:
        try:
            return set(mapping)
        except RuntimeError:  # pragma: no cover - resized meanwhile
            continue
