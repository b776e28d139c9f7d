"""The worker: owns one device, its runner and (later) its output packer.

A worker never admits or reorders requests; it runs what it is sent (INV-2).  All methods are
synchronous and run in the worker's own thread (inproc) or process (tractor); the executor
reaches them by name through :meth:`Worker.execute_method`, which is the RPC surface.

With two workers and ``config.cfg_parallel`` (the default) the ranks form a torch.distributed
group at :meth:`Worker.init_device` (rendezvous at the executor-chosen ``dist_init_method``)
and, for models that accept it, split each classifier-free-guidance UNet call between them
(:mod:`omni_trio.worker.cfg_parallel`).  Several workers on CUDA each take their own GPU
(``cuda:<rank>``) when there are enough and ``config.device`` names none.

With ``config.fault_injection`` the worker carries out the faults requests ask for
(:mod:`omni_trio.worker.faults`); a :class:`~omni_trio.worker.faults.WorkerFatalError` (an
injected crash of an in-process worker) propagates out of the worker call.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._core.messages import AsyncOutput, BatchRunnerOutput, RunnerOutput, SchedulerOutput
from .._core.request import DiffusionRequest
from ..config import EngineConfig
from ..errors import InvalidConfigError, StallError
from ..models.offload import sweep_orphan_dirs
from .extension import WorkerExtension, extension_class, runner_class
from .faults import FaultInjector
from .output_packer import OutputPacker, record_ready_event
from .profiler import WorkerProfiler
from .runner import ForwardedBatch, ModelRunner, StepProgress
from .step_runner import snapshot_keys
from .stop_flags import AbortMarks, StopFlags

if TYPE_CHECKING:
    import torch

    from ..models import ModelInfo
    from .cfg_parallel import CfgParallel

__all__ = ["RPC_METHODS", "Worker", "rank_device", "resolve_device", "resolve_dtype"]

log = logging.getLogger(__name__)
# How many request-mode forwards that are over a worker remembers (to ignore late aborts).
_FORWARDS_REMEMBERED = 1024

# Methods callable through collective_rpc.  Anything else is refused, unless it is a public
# method of the worker extension (config.worker_extension_cls; omni_trio.worker.extension).
RPC_METHODS = frozenset(
    {
        "ping",
        "describe",
        "execute_model",
        "execute_model_batch",
        "execute_scheduler_output",
        "execute_stepwise",
        "drain_outputs",
        "sleep",
        "wake_up",
        "leftovers",
        "set_torch_threads",
        "start_profile",
        "stop_profile",
        "discard_profile",
    }
)


def resident_bytes() -> int:
    """This process's resident set size in bytes (0 where ``/proc`` is missing)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def resolve_device(name: str | None) -> torch.device:
    import torch

    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rank_device(name: str | None, rank: int, world_size: int) -> tuple[torch.device, bool]:
    """The device of ``rank`` among ``world_size`` workers, and whether it is the rank's own.

    A CUDA device without an index becomes ``cuda:<rank>`` when there are at least
    ``world_size`` GPUs (``True``: each rank has its own); anything else is shared as named.
    """
    import torch

    device = resolve_device(name)
    if (
        world_size > 1
        and device.type == "cuda"
        and device.index is None
        and torch.cuda.device_count() >= world_size
    ):
        return torch.device("cuda", rank), True
    return device, False


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    import torch

    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


class Worker:
    """One replica of the model on one device.

    ``dist_init_method`` (``tcp://HOST:PORT``, the same for every rank) is where the ranks of
    a CFG-parallel group meet; required when ``world_size > 1`` and ``config.cfg_parallel``.

    ``data_parallel_size``: the ``world_size`` ranks form that many *replica groups* of
    ``world_size // data_parallel_size`` ranks, each group running its own requests; a rank
    cooperates (CFG-parallel, lockstep ticks) only within its group, and the first rank of
    each group is an output rank (it packs and ships its group's results).  Devices are
    still chosen by the global ``rank`` among ``world_size``.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        rank: int = 0,
        world_size: int = 1,
        stop_flags: StopFlags | None = None,
        progress: StepProgress | None = None,
        dist_init_method: str | None = None,
        data_parallel_size: int = 1,
    ) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.data_parallel_size = data_parallel_size
        # This rank's replica group: its size, and this rank's place in it.
        self.group_size = max(1, world_size // max(1, data_parallel_size))
        self.group_rank = rank % self.group_size
        # ``is None``, not ``or``: StopFlags has __len__, so an empty (shared) one is falsy.
        self.stop_flags = stop_flags if stop_flags is not None else StopFlags()
        # When each abort reached this worker (promptness is measured from these).
        self.abort_marks = AbortMarks()
        # Ids of the request-mode forwards that are over, most recent last (a bounded
        # memory): an abort that reaches this worker after its request's forward returned
        # has nothing left to stop or measure, and would otherwise stay flagged until some
        # later wave happened to name the id among its finished ones.
        self._forwards_over: dict[str, None] = {}
        self.progress: StepProgress = progress if progress is not None else {}
        self.runner: ModelRunner | None = None
        self.packer: OutputPacker | None = None
        self.model_info: ModelInfo | None = None
        self.dist_init_method = dist_init_method
        self.device: torch.device | None = None
        # This rank's CFG-parallel group: joined by init_device, kept only if the model
        # accepts it (load_model), closed by shutdown.
        self.cfg: CfgParallel | None = None
        # Off (every plan empty) unless config.fault_injection.
        self.faults = FaultInjector.from_config(config, rank=rank, stop_flags=self.stop_flags)
        # config.worker_extension_cls, built by load_model: its public methods are RPCs too.
        self.extension: WorkerExtension | None = None
        # torch.profiler, between start_profile and stop_profile (omni_trio.worker.profiler).
        self.profiler = WorkerProfiler(rank)

    def init_device(self) -> None:
        """Select the device, apply the thread setting (process-wide in torch) and, with two
        ranks and ``config.cfg_parallel``, join the CFG-parallel group.

        Joining blocks until the other rank joins too (at most ``worker_stall_timeout_s``, or
        30 minutes without one; then ``RuntimeError``).  Raises :class:`InvalidConfigError`
        (field ``cfg_parallel``) for ``cfg_parallel`` with a world size other than 1 or 2, or
        without a ``dist_init_method``.  Idempotent.
        """
        self.set_torch_threads(self.config.resolved_torch_threads)
        device, own = rank_device(self.config.device, self.rank, self.world_size)
        self.device = device
        if self.group_size == 1 or not self.config.cfg_parallel or self.cfg is not None:
            return
        if self.group_size != 2:
            raise InvalidConfigError(
                f"cfg_parallel splits guidance between exactly 2 workers, not "
                f"{self.group_size}; use num_workers=2 or cfg_parallel=False",
                field="cfg_parallel",
            )
        if self.dist_init_method is None:
            raise InvalidConfigError(
                "cfg_parallel needs a rendezvous address (dist_init_method) that this "
                "backend did not give its workers; use cfg_parallel=False",
                field="cfg_parallel",
            )
        from .cfg_parallel import init_cfg_group

        timeout = self.config.worker_stall_timeout_s
        self.cfg = init_cfg_group(
            self.group_rank,
            self.group_size,
            self.dist_init_method,
            timeout_s=timeout if timeout is not None else 1800.0,
            device=device,
            # NCCL refuses two ranks on one GPU: ranks that share one talk through gloo.
            backend="nccl" if own else "gloo",
        )

    def set_torch_threads(self, n: int) -> int:
        import torch

        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        return torch.get_num_threads()

    def load_model(self) -> ModelInfo:
        """Load the model on this worker's device; offer it the CFG-parallel group, which is
        closed at once if the model cannot use it (every rank decides alike)."""
        self.faults.on_load()
        # The weights a worker killed while asleep left on this machine (level 1).
        sweep_orphan_dirs(Path(self.config.sleep_dir or tempfile.gettempdir()))
        device = self.device
        if device is None:  # init_device was skipped
            device = rank_device(self.config.device, self.rank, self.world_size)[0]
        dtype = resolve_dtype(self.config.dtype, device)
        # Extension points (omni_trio.worker.extension), refused before the model loads.
        extension_cls = extension_class(self.config.worker_extension_cls, reserved=RPC_METHODS)
        runner = runner_class(self.config.runner_cls)(
            self.config,
            device,
            dtype,
            self.stop_flags,
            self.progress,
            cfg=self.cfg,
            world_size=self.group_size,
            faults=self.faults,
            abort_marks=self.abort_marks,
        )
        self.model_info = runner.load_model()
        self.runner = runner
        if self.cfg is not None and runner.cfg is None:
            self._close_cfg()
        if extension_cls is not None and self.extension is None:
            self.extension = WorkerExtension(extension_cls, self)
        return self.model_info

    @property
    def cfg_parallel(self) -> bool:
        """The loaded model splits its guided UNet calls with the other rank."""
        return self.runner is not None and self.runner.cfg is not None

    def _close_cfg(self) -> None:
        cfg, self.cfg = self.cfg, None
        if cfg is not None:
            cfg.close()

    @property
    def steps_done(self) -> int:
        """Denoising steps run so far (for progress-aware liveness checks)."""
        return self.runner.steps_done if self.runner is not None else 0

    def _runner(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError(f"worker {self.rank} has no model loaded")
        return self.runner

    def execute_model(self, request: DiffusionRequest) -> BatchRunnerOutput:
        return self._runner().execute_model(request)

    def execute_model_batch(self, requests: Sequence[DiffusionRequest]) -> BatchRunnerOutput:
        return self._runner().execute_model_batch(requests)

    @property
    def is_output_rank(self) -> bool:
        """The first rank of its replica group: it packs and ships the group's results."""
        return self.group_rank == 0

    def start_output_packer(self, reply: Callable[[AsyncOutput], None]) -> None:
        """Turn on async output: packing leaves the forward path (output rank only).

        From now on a request-mode forward answers at once with ``async_output_id``s
        (``{batch_id}/{request_id}``) and the packer thread sends COMPUTE_DONE, then
        OUTPUT_READY with the packed :class:`BatchRunnerOutput`, through ``reply``.
        """
        if not self.is_output_rank or self.packer is not None:
            return
        runner = self._runner()

        def pack(forwarded: ForwardedBatch) -> BatchRunnerOutput:
            if forwarded.faults:  # KILL_PACKER: this thread dies here
                forwarded.faults.in_packer(forwarded.request_ids)
            packed = runner.pack_outputs(forwarded)
            if forwarded.faults:  # DELAY_OUTPUT_READY: after packing, before OUTPUT_READY
                for rid in forwarded.request_ids:
                    forwarded.faults.after_pack(rid)
            return packed

        self.packer = OutputPacker(reply, pack, name=f"omni-trio-packer-{self.rank}")

    def execute_scheduler_output(
        self, scheduler_output: SchedulerOutput, rpc_id: str = ""
    ) -> BatchRunnerOutput:
        """Request mode: run the wave's new requests in one forward (fused when several).

        With the output packer on, successful requests come back as ``async_output_id``s
        and their images follow as OUTPUT_READY; ranks other than the output rank report
        only what ended early (their results are never shipped).  A DELAY_COMPUTE_DONE fault
        sleeps after the forward (and after handing it to the packer, so its OUTPUT_READY
        may be sent before this returns).  Raises :class:`WorkerFatalError` (an injected
        in-process crash) and errors of a broken runner; request failures are outputs.
        """
        runner = self._runner()
        self.stop_flags.forget(scheduler_output.finished_req_ids)
        self.abort_marks.forget(scheduler_output.finished_req_ids)
        requests = [r.request for r in scheduler_output.scheduled_new_reqs]
        if not requests:  # a data-parallel rank told only of finished requests
            return BatchRunnerOutput()
        ids = scheduler_output.scheduled_request_ids
        self.forward_dispatched(ids)  # (the shims say so earlier, as the call arrives)
        try:
            return self._forward(runner, scheduler_output, requests, rpc_id)
        finally:
            # The call is over (a late reply included): its requests' stop flags and abort
            # marks have done their job, and later aborts of them are ignored.
            self._forward_over(ids)

    def _forward_over(self, request_ids: Iterable[str]) -> None:
        over = self._forwards_over
        for rid in request_ids:  # first noted, then forgotten: see drop_late_aborts
            over[rid] = None
        while len(over) > _FORWARDS_REMEMBERED:
            del over[next(iter(over))]
        self.stop_flags.forget(request_ids)
        self.abort_marks.forget(request_ids)

    def forward_dispatched(self, request_ids: Iterable[str]) -> None:
        """A forward of ``request_ids`` was handed to this worker (called as the call
        arrives, in order with aborts): their aborts count again, even for an id whose
        earlier forward is over (admitted anew)."""
        for rid in request_ids:
            self._forwards_over.pop(rid, None)

    def drop_late_aborts(self, request_ids: Iterable[str]) -> None:
        """Called right after an abort of ``request_ids`` set their marks and flags: forget
        them again for the ids whose forward is over (nothing left to stop or measure).
        Flags first, then this check, while the forward adds its ids and then forgets: in
        any interleaving of the two threads nothing is left behind."""
        over = self._forwards_over
        late = [rid for rid in request_ids if rid in over]
        if late:
            self.stop_flags.forget(late)
            self.abort_marks.forget(late)

    def _forward(
        self,
        runner: ModelRunner,
        scheduler_output: SchedulerOutput,
        requests: list[DiffusionRequest],
        rpc_id: str,
    ) -> BatchRunnerOutput:
        try:
            done, forwarded = runner.forward_batch(requests)
        finally:
            # The forward is over: its requests' stop flags have done their job.
            self.stop_flags.forget(scheduler_output.scheduled_request_ids)
            self.abort_marks.forget(scheduler_output.scheduled_request_ids)
        if not forwarded.items:
            return done
        faults = forwarded.faults
        if not self.is_output_rank:
            if faults:
                faults.after_forward(forwarded.request_ids)
            return done
        if self.packer is None:
            if faults:
                faults.after_forward(forwarded.request_ids)
            return BatchRunnerOutput({**done.outputs, **runner.pack_outputs(forwarded).outputs})
        batch_id = self.packer.submit(
            rpc_id, forwarded, ready_event=record_ready_event(runner.device)
        )
        pending = {
            rid: RunnerOutput(
                rid,
                async_output_id=f"{batch_id}/{rid}",
                timings={"forward_ms": forwarded.forward_ms},
                steps_after_abort=forwarded.steps_after_abort,
            )
            for rid in forwarded.request_ids
        }
        if faults:
            faults.after_forward(forwarded.request_ids)
        return BatchRunnerOutput({**done.outputs, **pending})

    @property
    def packer_alive(self) -> bool:
        """No output packer, or one that can still deliver (liveness)."""
        return self.packer is None or self.packer.alive

    def drain_outputs(self, timeout: float | None = 10.0) -> bool:
        """Wait (bounded) until every pending output is packed; before memory-releasing calls."""
        return self.packer.drain(timeout) if self.packer is not None else True

    def sleep(self, level: int, drain_timeout_s: float | None = 10.0) -> dict[str, Any]:
        """Release this rank's weights at ``level`` (1: a copy kept off the device, 2: none;
        :mod:`omni_trio.models.offload`), after the output packer has drained: every output
        still being packed is delivered first (within ``drain_timeout_s``; past it a
        :class:`StallError` (phase ``packing``) names what was still packing and nothing is
        released).  Returns ``rank``, ``level``, ``released_bytes`` and this process's
        ``rss_bytes`` after the release.  The engine calls it between forwards only."""
        if not self.drain_outputs(drain_timeout_s):
            assert self.packer is not None
            packing = sorted(self.packer.leftovers().get("packer_queue", set()))
            raise StallError(
                "packing",
                f"worker {self.rank}: outputs of {packing} were still being packed after "
                f"{drain_timeout_s} s; nothing was released",
            )
        released = self._runner().sleep(level, self.config.sleep_dir)
        return {
            "rank": self.rank,
            "level": level,
            "released_bytes": released,
            "rss_bytes": resident_bytes(),
        }

    def wake_up(self) -> dict[str, Any]:
        """Take this rank's weights back (a no-op when awake).  Returns ``rank``,
        ``restored_bytes`` and ``rss_bytes``.  If it raises, the rank is still asleep."""
        restored = self._runner().wake_up()
        return {"rank": self.rank, "restored_bytes": restored, "rss_bytes": resident_bytes()}

    def execute_stepwise(self, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
        """Step mode: one denoising step for every scheduled request."""
        try:
            return self._runner().execute_stepwise(scheduler_output)
        finally:
            self.stop_flags.forget(scheduler_output.scheduled_request_ids)
            # An aborted step-mode request is usually never scheduled again: its mark goes
            # with the ids the engine says are over.
            self.abort_marks.forget(
                (*scheduler_output.scheduled_request_ids, *scheduler_output.finished_req_ids)
            )

    def mark_aborted(self, request_ids: Iterable[str]) -> None:
        """An abort of ``request_ids`` reached this worker now: note how far their forwards
        were (before the stop flags are set, and apart from them)."""
        started = {rid: step + 1 for rid, (step, _) in dict(self.progress).items()}
        self.abort_marks.mark(request_ids, started)

    def leftovers(self) -> dict[str, set[str]]:
        """The per-request resources this worker holds, by kind, as owning request ids:
        ``runner_progress``, ``step_states``, ``stop_flags`` and ``packer_queue``.  Safe to
        call from another thread while a forward runs (a snapshot)."""
        runner = self.runner
        held: dict[str, set[str]] = {
            "stop_flags": self.stop_flags.aborted_ids(),
            "abort_marks": self.abort_marks.marked_ids(),
        }
        held["runner_progress"] = snapshot_keys(self.progress)
        if runner is not None:
            held.update(runner.leftovers())
        if self.packer is not None:
            held.update(self.packer.leftovers())
        return held

    def ping(self) -> dict[str, Any]:
        return {"rank": self.rank, "pid": os.getpid(), "loaded": self.runner is not None}

    def describe(self) -> dict[str, Any]:
        runner = self.runner
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "device": str(runner.device) if runner else None,
            "model": self.model_info.name if self.model_info else None,
            "cfg_parallel": self.cfg_parallel,
        }

    def start_profile(self, directory: str, prefix: str) -> str:
        """Start ``torch.profiler`` on this worker's thread (CPU, plus CUDA on a GPU); returns
        the absolute path its trace will get, ``<directory>/<prefix>-rank<N>.json`` (a
        relative ``directory`` is this process's).  Raises ``RuntimeError`` while profiling
        and what :meth:`WorkerProfiler.start` raises for a bad directory or prefix."""
        device = self.device or rank_device(self.config.device, self.rank, self.world_size)[0]
        return self.profiler.start(directory, prefix, device=device)

    def stop_profile(self) -> str:
        """Stop profiling and write the Chrome trace; returns its path.  Raises
        ``RuntimeError`` when not profiling."""
        return self.profiler.stop()

    def discard_profile(self) -> bool:
        """Stop profiling without writing a trace; False when not profiling."""
        return self.profiler.discard()

    def execute_method(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method not in RPC_METHODS:
            # Not built in: a public method of the worker extension, if there is one.
            bound = self.extension.method(method) if self.extension is not None else None
            if bound is None:
                raise AttributeError(f"worker has no RPC method {method!r}")
            return bound(*args, **kwargs)
        return getattr(self, method)(*args, **kwargs)

    def shutdown(self) -> None:
        self.faults.release()  # no injected in-process hang outlives the worker
        self.profiler.close()  # a profile still running is not written
        packer, self.packer = self.packer, None
        if packer is not None and not packer.close(self.config.close_timeout_s):
            log.error("worker %d: output packer did not stop in time", self.rank)
        runner, self.runner = self.runner, None
        self.extension = None
        if runner is not None:
            runner.close()
        self._close_cfg()
