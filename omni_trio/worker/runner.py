"""The model runner: turns scheduled requests into runner outputs on one device.

Synchronous by design: it runs in the worker's thread (inproc) or process (tractor).  A forward
checks the shared :class:`StopFlags` before every denoising step, so an abort stops it at the
next step boundary instead of waiting for the whole forward.

With CFG parallelism (a :class:`~omni_trio.worker.cfg_parallel.CfgParallel` the model accepted)
the two ranks run every forward in lockstep, exchanging UNet halves, so they must stop at the
same step: the stop decision is collective (:meth:`CfgParallel.agree_stop`: any rank's flag
stops both), taken before the forward and before every step.  A rank acting on its own flags
alone would leave the other waiting in a collective.  A failed collective
(:class:`~omni_trio.worker.cfg_parallel.CollectiveError`) is raised, never turned into the
requests' errors: the group, and so this runner, is unusable after it.  So is a
:class:`~omni_trio.worker.faults.WorkerFatalError` (an injected crash of an in-process worker).

Fault injection (:mod:`omni_trio.worker.faults`, only with ``config.fault_injection``): each
forward builds a :class:`~omni_trio.worker.faults.FaultPlan` for its requests and calls its
hooks at every step and around packing; a request whose ``faults`` entry is malformed fails
alone with a ``ValueError`` output and is left out of the forward.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._core.messages import BatchRunnerOutput, RunnerOutput, SchedulerOutput
from .._core.request import DiffusionRequest
from ..config import EngineConfig
from ..errors import InvalidConfigError
from .cfg_parallel import CollectiveError
from .device import check_device
from .faults import FaultInjector, FaultPlan, WorkerFatalError, split_fault_options
from .profiler import profile_span
from .stop_flags import AbortMarks, ForwardStopped, StopFlags

if TYPE_CHECKING:
    import torch

    from ..models import DiffusionModel, ModelInfo
    from .cfg_parallel import CfgParallel
    from .step_runner import StepRunner

__all__ = [
    "ForwardedBatch",
    "ModelRunner",
    "StepProgress",
    "convert_output",
]

log = logging.getLogger(__name__)

# request id -> (steps done, total steps); written by the forward, read by the event loop.
StepProgress = MutableMapping[str, tuple[int, int]]


def convert_output(raw: Any, output_type: str) -> Any:
    """Turn one model output (HWC float array in [0, 1] or a latent tensor) into output_type."""
    import numpy as np

    if output_type == "latent":
        return raw.detach().to("cpu") if hasattr(raw, "detach") else raw
    array = np.asarray(raw, dtype=np.float32)
    if output_type == "np":
        return array
    if output_type == "pt":
        import torch

        return torch.from_numpy(np.ascontiguousarray(array.transpose(2, 0, 1)))
    from PIL import Image

    pixels = (array * 255.0).round().clip(0, 255).astype(np.uint8)
    if pixels.shape[-1] == 1:
        pixels = pixels[..., 0]
    return Image.fromarray(pixels)


def _median_interval_ms(times: Sequence[float]) -> float | None:
    """The median gap between consecutive ``times`` (seconds) in ms; None below two."""
    gaps = sorted(b - a for a, b in itertools.pairwise(times))
    if not gaps:
        return None
    mid = len(gaps) // 2
    median = gaps[mid] if len(gaps) % 2 else (gaps[mid - 1] + gaps[mid]) / 2
    return median * 1000.0


def _all(ids: Sequence[str], **fields: Any) -> BatchRunnerOutput:
    return BatchRunnerOutput.from_list([RunnerOutput(rid, **fields) for rid in ids])


@dataclass(frozen=True, slots=True)
class ForwardedBatch:
    """Raw outputs of a finished forward, per request, waiting to be packed; ``faults``:
    the forward's fault plan (its packing faults fire in :meth:`ModelRunner.pack_outputs`)."""

    items: tuple[tuple[DiffusionRequest, Sequence[Any]], ...] = ()
    forward_ms: float = 0.0
    faults: FaultPlan | None = None
    # The median time between step ends (ms): one denoising step; None below two steps.
    step_ms: float | None = None
    # Steps started after the abort of every request in it reached the worker (None: not
    # every one was aborted).
    steps_after_abort: int | None = None

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(request.request_id for request, _ in self.items)


class ModelRunner:
    """Owns the loaded model and runs request-mode forwards.

    ``execute_model_batch`` never raises for a request's own failure: it returns a per-request
    error output.  It raises only for errors that make the runner unusable.

    ``cfg``: this rank's CFG-parallel group, offered to the model at :meth:`load_model`;
    :attr:`cfg` stays set only if the model accepted it.  ``world_size``: ranks running the
    same waves in lockstep (passed on to the step runner).  ``faults``: this rank's fault
    injector (default: one built from ``config`` for rank 0).
    """

    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        stop_flags: StopFlags,
        progress: StepProgress | None = None,
        *,
        cfg: CfgParallel | None = None,
        world_size: int = 1,
        faults: FaultInjector | None = None,
        abort_marks: AbortMarks | None = None,
    ) -> None:
        self.config = config
        self.abort_marks = abort_marks if abort_marks is not None else AbortMarks()
        self.device = device
        self.dtype = dtype
        self.stop_flags = stop_flags
        self.progress: StepProgress = progress if progress is not None else {}
        self._model: DiffusionModel | None = None
        self._step_runner: StepRunner | None = None
        # Set iff the loaded model runs CFG-parallel with it (then stops are collective).
        self.cfg: CfgParallel | None = None
        self._offered_cfg = cfg
        self.world_size = world_size
        self.faults = (
            faults
            if faults is not None
            else FaultInjector.from_config(config, stop_flags=stop_flags)
        )
        # Denoising steps started so far, over every forward (read by liveness checks).
        self.steps_done = 0

    @property
    def model_info(self) -> ModelInfo:
        if self._model is None:
            raise RuntimeError("model not loaded")
        return self._model.info

    def load_model(self) -> ModelInfo:
        """Load the configured model; reject configurations the model cannot serve.

        The ``fault_*`` model options are the worker's (:mod:`omni_trio.worker.faults`): the
        model loader never sees them; an unknown one raises :class:`InvalidConfigError`.
        """
        from ..models import load_model

        options, _ = split_fault_options(self.config.model_options)
        model = load_model(
            self.config.model,
            device=self.device,
            dtype=self.dtype,
            cache_dir=self.config.resolved_cache_dir,
            options=options,
        )
        if self.config.max_num_seqs > 1 and not model.info.supports_batch:
            model.close()
            raise InvalidConfigError(
                f"model {model.info.name!r} cannot run several requests in one forward; "
                f"use max_num_seqs=1 (got {self.config.max_num_seqs})",
                field="max_num_seqs",
            )
        if self.config.step_execution:
            adapter = model.step_adapter()
            if adapter is None:
                model.close()
                raise InvalidConfigError(
                    f"model {model.info.name!r} has no step adapter, so it cannot run with "
                    "step_execution=True (or streaming_output=True); use request mode",
                    field="step_execution",
                )
            from .step_runner import StepRunner

            self._step_runner = StepRunner(
                self.config,
                adapter,
                self.device,
                self.stop_flags,
                self.progress,
                convert_output,
                world_size=self.world_size,
                faults=self.faults,
            )
        if self._offered_cfg is not None and model.enable_cfg_parallel(self._offered_cfg):
            self.cfg = self._offered_cfg
        model.configure_loras(self.config.loras, self.config.max_loras)
        self._model = model
        return model.info

    def leftovers(self) -> dict[str, set[str]]:
        """Per-request state this runner holds (step mode: step states)."""
        return self._step_runner.leftovers() if self._step_runner is not None else {}

    def execute_stepwise(self, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
        """Step mode: one denoising step for every scheduled request (see StepRunner)."""
        if self._step_runner is None:
            raise RuntimeError("step execution is not enabled for this runner")
        if not scheduler_output.is_empty:  # (an empty one only frees finished requests)
            self.steps_done += 1
        with profile_span("omni_trio.step"):
            return self._step_runner.execute(scheduler_output)

    def execute_model(self, request: DiffusionRequest) -> BatchRunnerOutput:
        return self.execute_model_batch([request])

    def execute_model_batch(self, requests: Sequence[DiffusionRequest]) -> BatchRunnerOutput:
        """Run one fused forward for a compatible wave and pack its outputs, synchronously;
        one output per request, keyed by id."""
        done, forwarded = self.forward_batch(requests)
        if forwarded.faults:
            forwarded.faults.after_forward(forwarded.request_ids)
        packed = self.pack_outputs(forwarded)
        return BatchRunnerOutput({**done.outputs, **packed.outputs})

    def forward_batch(
        self, requests: Sequence[DiffusionRequest]
    ) -> tuple[BatchRunnerOutput, ForwardedBatch]:
        """The device half of a request-mode forward.

        Returns the requests that already ended (aborted, failed) as runner outputs, and the
        raw outputs of the others still to be packed (:meth:`pack_outputs`), possibly in the
        output packer's thread while the next forward runs.  Raises only for a broken runner
        (no model, a failed collective, a :class:`WorkerFatalError`).
        """
        if self._model is None:
            raise RuntimeError("model not loaded")
        plan = self.faults.plan(requests)
        if not plan.invalid:
            return self._forward(requests, plan)
        rejected = BatchRunnerOutput.from_list(
            [
                RunnerOutput(rid, error=message, error_type="ValueError")
                for rid, message in plan.invalid.items()
            ]
        )
        valid = [r for r in requests if r.request_id not in plan.invalid]
        if not valid:
            return rejected, ForwardedBatch()
        done, forwarded = self._forward(valid, plan)
        return BatchRunnerOutput({**rejected.outputs, **done.outputs}), forwarded

    def _forward(
        self, requests: Sequence[DiffusionRequest], plan: FaultPlan
    ) -> tuple[BatchRunnerOutput, ForwardedBatch]:
        import torch

        assert self._model is not None
        model = self._model
        ids = [r.request_id for r in requests]
        flags = self.stop_flags
        cfg = self.cfg

        def must_stop() -> bool:
            # Collective under CFG parallelism: every rank calls it at the same points.
            local = flags.should_stop(ids)
            return cfg.agree_stop(local) if cfg is not None else local

        if must_stop():
            after = self.abort_marks.steps_after(ids, 0)
            return _all(ids, aborted=True, steps_after_abort=after, step_index=0), ForwardedBatch()
        if any(r.sampling.seed is None for r in requests):
            return _all(
                ids, error="request reached the runner without a seed", error_type="ValueError"
            ), ForwardedBatch()
        gen_device = self.device if self.device.type == "cuda" else torch.device("cpu")
        generators = [
            torch.Generator(device=gen_device).manual_seed(int(r.sampling.seed))  # type: ignore[arg-type]
            for r in requests
        ]
        output_type = requests[0].sampling.output_type
        progress = self.progress

        step_ends: list[float] = []
        begun = 0  # steps this forward started
        marks = self.abort_marks

        def on_step(step: int, total: int) -> None:
            nonlocal begun
            step_ends.append(time.perf_counter())
            if must_stop():
                raise ForwardStopped(ids, step)
            begun += 1
            self.steps_done += 1
            for rid in ids:
                progress[rid] = (step, total)
            if plan:
                for rid in ids:
                    plan.on_step(rid, step, total)

        started = time.perf_counter()
        try:
            with torch.inference_mode(), profile_span("omni_trio.forward"):
                raw = model.generate(
                    requests,
                    generators,
                    output_type="latent" if output_type == "latent" else "np",
                    on_step=on_step,
                )
            if len(raw) != len(requests):
                raise RuntimeError(
                    f"model returned {len(raw)} outputs for {len(requests)} requests"
                )
            # Read while the progress still names the forward: an abort noted after the
            # finally below would see no progress and count every step as late.
            after = marks.steps_after(ids, begun)
        except ForwardStopped:
            after = marks.steps_after(ids, begun)
            # step_index: the steps this forward computed (the engine counts them wasted).
            stopped = _all(ids, aborted=True, steps_after_abort=after, step_index=begun)
            return stopped, ForwardedBatch()
        except (CollectiveError, WorkerFatalError):
            raise  # this worker is broken (e.g. its CFG-parallel group), not the requests
        except Exception as exc:  # a request failure, not a runner failure ...
            check_device(self.device, self.faults, exc)  # ... unless the device broke
            log.debug("forward of %s failed", ids, exc_info=True)
            return BatchRunnerOutput.from_list(
                [RunnerOutput.from_exception(rid, exc, step_index=begun) for rid in ids]
            ), ForwardedBatch()
        finally:
            for rid in ids:
                progress.pop(rid, None)
        forward_ms = (time.perf_counter() - started) * 1000.0
        done: list[RunnerOutput] = []
        items: list[tuple[DiffusionRequest, Sequence[Any]]] = []
        for request, images in zip(requests, raw, strict=True):
            if flags.is_aborted(request.request_id):
                done.append(
                    RunnerOutput(
                        request.request_id, aborted=True, steps_after_abort=after, step_index=begun
                    )
                )
            else:
                items.append((request, images))
        return BatchRunnerOutput.from_list(done), ForwardedBatch(
            tuple(items),
            forward_ms,
            plan if plan else None,
            _median_interval_ms(step_ends),
            steps_after_abort=after,
        )

    def pack_outputs(self, batch: ForwardedBatch) -> BatchRunnerOutput:
        """The host half: convert raw outputs to each request's output type.  Thread-safe
        (it touches no runner state), so the output packer may run it in its own thread.

        A request whose conversion fails (an injected FAIL_PACKING included) gets an error
        output; the others are packed.  SLOW_PACKING sleeps before the conversion.
        """
        outputs = []
        faults = batch.faults
        for request, images in batch.items:
            rid = request.request_id
            post_started = time.perf_counter()
            try:
                if faults:
                    faults.before_pack(rid)
                output_type = request.sampling.output_type
                converted = tuple(convert_output(img, output_type) for img in images)
            except WorkerFatalError:
                raise
            except Exception as exc:
                outputs.append(RunnerOutput.from_exception(rid, exc))
                continue
            timings: dict[str, float] = {
                "forward_ms": batch.forward_ms,
                "postprocess_ms": (time.perf_counter() - post_started) * 1000.0,
            }
            if batch.step_ms is not None:
                timings["step_ms"] = batch.step_ms
            outputs.append(
                RunnerOutput(
                    rid,
                    images=converted,
                    timings=timings,
                    steps_after_abort=batch.steps_after_abort,
                )
            )
        return BatchRunnerOutput.from_list(outputs)

    def sleep(self, level: int, directory: str | None = None) -> int:
        """Release the model's weights at ``level`` (:meth:`DiffusionModel.sleep`); the
        bytes released.  Called between forwards only (the worker's caller orders it)."""
        if self._model is None:
            raise RuntimeError("model not loaded")
        released = self._model.sleep(level, directory)
        if self._model.holds_weights:
            gc.collect()
        return released

    def wake_up(self) -> int:
        """Take the weights back (:meth:`DiffusionModel.wake_up`); the bytes restored."""
        if self._model is None:
            raise RuntimeError("model not loaded")
        return self._model.wake_up()

    def close(self) -> None:
        """Release the model and its memory; idempotent."""
        step_runner, self._step_runner = self._step_runner, None
        if step_runner is not None:
            step_runner.close()
        model, self._model = self._model, None
        collect = model is None or model.holds_weights
        if model is not None:
            model.close()
            del model
        if collect:
            gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # pragma: no cover - best effort
            pass
