"""``EngineConfig``: every engine knob, validated at construction (the bad field is named)."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ._core.engine_core import CoreConfig
from ._core.policy import SCHEDULING_POLICIES
from ._core.request import RequestLimits
from .errors import InvalidConfigError
from .extensions import check_extensions, scheduler_class

__all__ = [
    "AUTO_BACKEND",
    "BACKENDS",
    "DEVICE_TYPES",
    "WORKER_START_METHODS",
    "EngineConfig",
    "check_device_available",
    "default_cache_dir",
    "default_torch_threads",
]

BACKENDS = ("inproc", "tractor", "ray")
# The default backend: "inproc" for one worker, "tractor" for more (resolved when made).
AUTO_BACKEND = "auto"
# How the tractor backend starts a worker process (see docs/backends.md): "trio" runs a fresh
# interpreter per worker; "forkserver" forks it from a server that already imported torch,
# diffusers and the worker code, so a restarted worker is ready in a fraction of a second;
# "auto" (the daemon's default) is "forkserver" where that is known to be safe (the engine in
# the main process, no CUDA on the machine) and "trio" elsewhere
# (:func:`omni_trio.executors.tractor_executor.resolve_start_method`).
WORKER_START_METHODS = ("trio", "forkserver", "auto")
# The torch device types a worker can run on; a device is TYPE or TYPE:INDEX.
DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu")
_DEVICE_RE = re.compile(r"(?P<type>[a-z_]+)(?::(?P<index>[0-9]+))?")
# Backends whose workers run on this machine: their device can be checked here.
_LOCAL_BACKENDS = ("inproc", "tractor")


def default_cache_dir() -> Path:
    """Where built-in models are materialised: ``$OMNI_TRIO_CACHE`` or ``~/.cache/omni_trio``."""
    env = os.environ.get("OMNI_TRIO_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "omni_trio"


def default_torch_threads(num_workers: int) -> int:
    """Cores divided among worker processes, at least 1, after keeping one core for the
    engine's own process (event loop, admission, output packing).

    Measured on a 2-vCPU machine: a worker with 2 intra-op threads stalled for seconds per
    tiny image whenever the other vCPU was busy, against ~0.25 s with 1 thread.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    spare = max(1, (cores or 1) - 1)
    return max(1, spare // max(1, num_workers))


def _parse_device(device: Any) -> tuple[str, int | None]:
    """``"cuda:1"`` -> ``("cuda", 1)``; :class:`InvalidConfigError` (``field="device"``) for
    anything that is not ``TYPE`` or ``TYPE:INDEX`` with a type of :data:`DEVICE_TYPES`."""
    match = _DEVICE_RE.fullmatch(device) if isinstance(device, str) else None
    if match is None or match["type"] not in DEVICE_TYPES:
        raise InvalidConfigError(
            f"unknown device {device!r}: expected one of {', '.join(DEVICE_TYPES)}, "
            "optionally with an index (cuda:1), or None to pick cuda when present",
            field="device",
        )
    index = match["index"]
    return match["type"], None if index is None else int(index)


def check_device_available(device: str) -> None:
    """Raise :class:`InvalidConfigError` (``field="device"``) unless torch on this machine can
    use ``device`` (``TYPE`` or ``TYPE:INDEX``): CUDA built in and a GPU with that index
    visible, MPS or XPU available.  ``cpu`` always is.  Imports torch for any other type.

    Checked by :class:`EngineConfig` for the backends whose workers run on this machine
    (``inproc``, ``tractor``), so a bad device fails before anything starts.
    """
    kind, index = _parse_device(device)
    if kind == "cpu":
        return
    import torch

    if kind == "cuda":
        if not torch.cuda.is_available():
            why = (
                f"this torch ({torch.__version__}) is built without CUDA"
                if torch.version.cuda is None
                else "torch sees no CUDA device (check the driver and CUDA_VISIBLE_DEVICES)"
            )
            raise InvalidConfigError(
                f"device {device!r} is not available: {why}; use device 'cpu' or leave it "
                "unset (cuda when present, else cpu)",
                field="device",
            )
        count = torch.cuda.device_count()
        if index is not None and index >= count:
            raise InvalidConfigError(
                f"device {device!r} is not available: torch sees {count} CUDA device(s) "
                f"(cuda:0 to cuda:{count - 1})",
                field="device",
            )
        return
    backend = getattr(torch, kind, None) if kind == "xpu" else getattr(torch.backends, kind, None)
    available = backend is not None and bool(backend.is_available())
    if not available:
        raise InvalidConfigError(
            f"device {device!r} is not available to this torch ({torch.__version__}); use "
            "device 'cpu' or leave it unset (cuda when present, else cpu)",
            field="device",
        )


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidConfigError(f"{name} must be a positive integer, got {value!r}", field=name)


def _nonneg_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidConfigError(f"{name} must be an integer >= 0, got {value!r}", field=name)


def _nonneg_float(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise InvalidConfigError(f"{name} must be a finite number >= 0, got {value!r}", field=name)


# Not slots: an instance also remembers (outside its fields) whether its backend was chosen by
# worker count, so that ``replace(num_workers=...)`` chooses again.
_LORA_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def _check_loras(loras: Any, max_loras: Any) -> None:
    """``loras`` maps names of 1..64 of ``[A-Za-z0-9._-]`` to non-empty paths (str);
    ``max_loras`` is a positive integer.  Whether a path holds an adapter is known when a
    worker loads it (a request naming a bad one fails with ``InvalidLoraError``)."""
    if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 1:
        raise InvalidConfigError(
            f"max_loras must be a positive integer, got {max_loras!r}", field="max_loras"
        )
    if not isinstance(loras, Mapping):
        raise InvalidConfigError(
            "loras must map adapter names to paths ({name: path})", field="loras"
        )
    for name, path in loras.items():
        if not isinstance(name, str) or not 1 <= len(name) <= 64 or set(name) - _LORA_NAME_CHARS:
            raise InvalidConfigError(
                f"LoRA name {name!r}: use 1..64 of letters, digits, '.', '_' and '-'",
                field="loras",
            )
        if not isinstance(path, str) or not path or "\0" in path:
            raise InvalidConfigError(
                f"LoRA {name!r}: the path must be a non-empty string, got {path!r}",
                field="loras",
            )


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Configuration of one engine.

    ``model`` is a local diffusers directory, a built-in name (``builtin:shapes``,
    ``builtin:tiny-sd``, ``builtin:tiny-ddim``, ``builtin:echo``) or a model factory
    ``"pkg.mod:factory"`` (:mod:`omni_trio.models.factory`).  ``model_options`` go to the
    model loader (for ``builtin:echo``: ``step_delay_s``; a factory's ``options``).
    ``backend`` is ``"inproc"``, ``"tractor"``, ``"ray"``, an ``Executor`` subclass or an
    import path ``"pkg.mod:Class"``;
    ``"auto"`` (the default) chooses by worker count when the config is made: one worker runs
    in this process (``"inproc"``), more run as worker processes (``"tractor"``).

    ``cfg_parallel``: with exactly two workers, split every classifier-free-guidance UNet call
    between them (rank 0 the conditional half, rank 1 the unconditional half; see
    :mod:`omni_trio.worker.cfg_parallel`) for models that support it; other models run whole
    on each worker.  More than two workers with ``cfg_parallel=True`` is refused here, when
    the config is made; ``False`` makes every worker a full replica.

    ``data_parallel_size``: run that many worker processes, each on *different* requests (a
    wave or tick of up to ``data_parallel_size x max_num_seqs`` compatible requests is split
    across the ranks, results mapped back by request id); one engine, one scheduler.  It
    implies ``num_workers`` (left at 1, it becomes ``data_parallel_size``; set, it must be
    equal) and needs a process backend (``"auto"`` chooses tractor).  Each rank runs the
    whole model, unless ``num_workers`` is twice ``data_parallel_size`` with
    ``cfg_parallel``: then each data-parallel rank is a CFG-parallel *pair* of workers
    (ranks ``2g`` and ``2g + 1`` run replica group ``g``'s requests together, splitting every
    guidance step; ``num_workers = data_parallel_size x 2``).

    Cross-field rules are checked here too, not first when the engine opens: the inproc
    backend runs exactly one worker, and ``cfg_parallel`` uses at most two.  ``device`` must
    be ``cpu``, ``cuda``, ``mps`` or ``xpu`` (with an optional ``:INDEX``); for the backends
    whose workers run on this machine (inproc, tractor) it must also be available to torch
    here (:func:`check_device_available`, which imports torch for a non-cpu device).
    """

    model: str = "builtin:echo"
    model_options: Mapping[str, Any] = field(default_factory=dict)
    backend: Any = AUTO_BACKEND
    num_workers: int = 1
    cfg_parallel: bool = True
    data_parallel_size: int = 1
    device: str | None = None
    dtype: str = "auto"
    torch_threads: int | None = None
    cache_dir: str | None = None

    max_num_seqs: int = 1
    request_batch_max_wait_ms: float = 0.0
    step_execution: bool = False
    streaming_output: bool = False
    preview_interval: int = 1

    # Who runs next (docs/execution-modes.md, *Scheduling policies*): "fifo" (arrival order,
    # stopping at the first request that cannot join the running wave), "priority"
    # (SamplingParams.priority, lower first; a waiting request is passed by later arrivals of
    # better priority only within priority_aging_ticks ticks per priority level; in step
    # mode a better one preempts a worse running one at the next step boundary) or "fair"
    # (deficit round-robin across compatibility classes, fair_quantum pixels x steps per
    # turn; None: the largest request seen).  Priorities outside min_priority..max_priority
    # are refused.
    scheduling_policy: str = "fifo"
    priority_aging_ticks: int = 16
    fair_quantum: int | None = None
    min_priority: int = -10
    max_priority: int = 10
    # Step mode, "priority": preempted requests whose step state (latents, scheduler) the
    # workers keep; a preemption past it drops the state: that request restarts from step 0.
    max_preempted_states: int = 16

    warmup: bool = True
    # Request mode: pack outputs (postprocess, D2H, shared memory) in a background thread
    # while the next forward runs.  Step mode always packs synchronously.
    async_output: bool = True
    # Limits applied to every request before admission.
    max_pixels: int = 1024 * 1024
    # A picture to start from (SamplingParams.image / mask_image), before it is resized.
    max_image_pixels: int = 4096 * 4096
    max_prompt_chars: int = 10_000
    max_steps: int = 1000
    max_outputs_per_prompt: int = 16
    # The compute budget: at warmup the model's step time is measured on this machine, and a
    # request estimated to take longer than max_request_s, or whose longest uninterruptible
    # part (one denoising step of all its images, or their decode) is longer than max_step_s,
    # is refused with RequestTooCostlyError (None: no such limit; without warmup nothing is
    # measured and neither applies).
    max_request_s: float | None = 120.0
    max_step_s: float | None = 10.0
    # Bounded waits (INV-6); None means no deadline for that phase.
    rpc_timeout_s: float | None = None
    close_timeout_s: float = 30.0
    # Sleep and wake (AsyncEngine.sleep / wake_up, docs/user-guide.md#sleep-and-wake): how
    # long falling asleep may wait for the requests running and the outputs being packed to
    # finish (past it the sleep fails with a StallError naming them, and the engine stays
    # awake); whether requests that arrive while the engine sleeps are refused with
    # EngineAsleepError (default: they wait and run after wake_up); and where level-1 sleep
    # keeps the weights of a CPU worker (a private directory made in it; None: the system's
    # temporary directory).
    sleep_drain_timeout_s: float = 10.0
    reject_while_asleep: bool = False
    sleep_dir: str | None = None
    # LoRA adapters requests may name (SamplingParams.lora): name -> a local directory of a
    # diffusers LoRA (pytorch_lora_weights.safetensors) or a shipped one ("builtin:shapes-
    # outline").  Each worker loads one on first use and keeps at most max_loras loaded
    # (least recently used evicted); a request may apply at most max_loras at once.
    loras: Mapping[str, str] = field(default_factory=dict)
    max_loras: int = 4
    # Multi-process liveness: a worker silent (no heartbeat) this long is hung; a call with
    # no denoising-step progress for worker_stall_timeout_s is hung (None: never).
    worker_heartbeat_timeout_s: float = 30.0
    worker_stall_timeout_s: float | None = 300.0
    # Supervision (see docs/user-guide.md#supervision): a failed worker group is restarted
    # with exponential backoff (worker_restart_backoff_s, doubling, at most
    # worker_restart_backoff_max_s) while fewer than max_worker_restarts restarts happened in
    # the last worker_restart_window_s; past that the engine is dead.  A request in flight
    # when its group failed runs again (same seed) up to max_retries_on_worker_failure times.
    max_worker_restarts: int = 5
    worker_restart_window_s: float = 60.0
    worker_restart_backoff_s: float = 0.05
    worker_restart_backoff_max_s: float = 5.0
    max_retries_on_worker_failure: int = 1
    # A request its group failed under this many times (from the first on it runs alone) is
    # quarantined: failed for good with the non-retryable RequestQuarantinedError, never run
    # again, so one poison request cannot crash-loop the workers.  None: never.
    quarantine_after_crashes: int | None = 2
    # How long a worker group may take to start (spawn -> every rank ready, model loaded);
    # past it the start failed.  Workers are watched from the moment they are spawned.
    worker_start_timeout_s: float = 600.0
    # tractor backend: "trio" (a fresh interpreter per worker), "forkserver" (forked from
    # a preloaded fork server that lives as long as this process: fast restarts) or "auto"
    # (forkserver where safe: in the main process, on a machine without CUDA; else trio).
    worker_start_method: str = "trio"
    # Accept fault-injection requests (``omni_trio.testing.faults``) in extra_args.  Off by
    # default: a production engine never lets a request crash its workers on purpose.
    fault_injection: bool = False
    # ray backend: the cluster to join ("auto", "ray://host:10001", "host:6379"); None uses
    # $RAY_ADDRESS, an already initialised Ray, or else starts a local Ray on 127.0.0.1.  A
    # placement group for the workers must be ready within ray_placement_timeout_s.
    ray_address: str | None = None
    ray_placement_timeout_s: float = 30.0
    # Extension points (docs/extending.md), each a class or an import path
    # "package.module:Name" (None: the built-in): the scheduler (a subclass of the mode's,
    # RequestScheduler or StepScheduler, checked here), the workers' runner (a ModelRunner
    # subclass) and a worker extension whose public methods collective_rpc can call.  For
    # the tractor and ray backends a class travels as its import path: one defined in
    # __main__ or inside a function is refused here.
    scheduler_cls: Any = None
    runner_cls: Any = None
    worker_extension_cls: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise InvalidConfigError("model must be a non-empty string", field="model")
        if not isinstance(self.model_options, Mapping):
            raise InvalidConfigError("model_options must be a mapping", field="model_options")
        _positive_int("data_parallel_size", self.data_parallel_size)
        if self.data_parallel_size > 1 and self.num_workers == 1:  # implied
            object.__setattr__(self, "num_workers", self.data_parallel_size)
        backend = self.backend
        chosen = backend == AUTO_BACKEND
        if chosen:
            # Not chosen: by worker count.
            backend = "inproc" if self.num_workers == 1 else "tractor"
            object.__setattr__(self, "backend", backend)
        object.__setattr__(self, "_backend_by_count", chosen)
        if isinstance(backend, str):
            if backend not in BACKENDS and ":" not in backend:
                raise InvalidConfigError(
                    f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}, "
                    "an Executor subclass or an import path 'pkg.module:Class'",
                    field="backend",
                )
        elif not isinstance(backend, type):
            raise InvalidConfigError(
                f"backend must be a name, an Executor subclass or an import path, got {backend!r}",
                field="backend",
            )
        _positive_int("num_workers", self.num_workers)
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("preview_interval", self.preview_interval)
        _positive_int("max_pixels", self.max_pixels)
        _positive_int("max_image_pixels", self.max_image_pixels)
        _positive_int("max_prompt_chars", self.max_prompt_chars)
        _positive_int("max_steps", self.max_steps)
        _positive_int("max_outputs_per_prompt", self.max_outputs_per_prompt)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidConfigError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}",
                field="scheduling_policy",
            )
        _positive_int("priority_aging_ticks", self.priority_aging_ticks)
        _nonneg_int("max_preempted_states", self.max_preempted_states)
        if self.fair_quantum is not None:
            _positive_int("fair_quantum", self.fair_quantum)
        for name in ("min_priority", "max_priority"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidConfigError(f"{name} must be an integer, got {value!r}", field=name)
        if self.min_priority > self.max_priority:
            raise InvalidConfigError(
                f"min_priority ({self.min_priority}) must be <= max_priority ({self.max_priority})",
                field="min_priority",
            )
        if self.torch_threads is not None:
            _positive_int("torch_threads", self.torch_threads)
        _nonneg_float("request_batch_max_wait_ms", self.request_batch_max_wait_ms)
        _nonneg_float("rpc_timeout_s", self.rpc_timeout_s, allow_none=True)
        for name in ("max_request_s", "max_step_s"):
            _nonneg_float(name, getattr(self, name), allow_none=True)
            if getattr(self, name) == 0:
                raise InvalidConfigError(f"{name} must be > 0 or None", field=name)
        _nonneg_float("close_timeout_s", self.close_timeout_s)
        _nonneg_float("sleep_drain_timeout_s", self.sleep_drain_timeout_s)
        _nonneg_float("worker_heartbeat_timeout_s", self.worker_heartbeat_timeout_s)
        _nonneg_float("worker_stall_timeout_s", self.worker_stall_timeout_s, allow_none=True)
        _nonneg_int("max_worker_restarts", self.max_worker_restarts)
        _nonneg_int("max_retries_on_worker_failure", self.max_retries_on_worker_failure)
        if self.quarantine_after_crashes is not None:
            _positive_int("quarantine_after_crashes", self.quarantine_after_crashes)
        _nonneg_float("worker_start_timeout_s", self.worker_start_timeout_s)
        if self.worker_start_timeout_s == 0:
            raise InvalidConfigError(
                "worker_start_timeout_s must be > 0", field="worker_start_timeout_s"
            )
        _nonneg_float("worker_restart_window_s", self.worker_restart_window_s)
        _nonneg_float("worker_restart_backoff_s", self.worker_restart_backoff_s)
        _nonneg_float("worker_restart_backoff_max_s", self.worker_restart_backoff_max_s)
        if self.worker_start_method not in WORKER_START_METHODS:
            raise InvalidConfigError(
                f"worker_start_method must be one of {', '.join(WORKER_START_METHODS)}, "
                f"got {self.worker_start_method!r}",
                field="worker_start_method",
            )
        if self.ray_address is not None and (
            not isinstance(self.ray_address, str) or not self.ray_address.strip()
        ):
            raise InvalidConfigError(
                f"ray_address must be a non-empty string or None, got {self.ray_address!r}",
                field="ray_address",
            )
        _nonneg_float("ray_placement_timeout_s", self.ray_placement_timeout_s)
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise InvalidConfigError(
                f"dtype must be auto, float32, float16 or bfloat16, got {self.dtype!r}",
                field="dtype",
            )
        for name in (
            "step_execution",
            "streaming_output",
            "warmup",
            "async_output",
            "cfg_parallel",
            "fault_injection",
            "reject_while_asleep",
        ):
            if not isinstance(getattr(self, name), bool):
                raise InvalidConfigError(f"{name} must be a bool", field=name)
        if self.sleep_dir is not None and not isinstance(self.sleep_dir, str):
            raise InvalidConfigError("sleep_dir must be a path (str) or None", field="sleep_dir")
        _check_loras(self.loras, self.max_loras)
        if self.device is not None:
            _parse_device(self.device)
        if self.streaming_output and not self.step_execution:
            # Streaming previews need step execution; turning it on is what users mean.
            object.__setattr__(self, "step_execution", True)
        check_extensions(
            scheduler_cls=self.scheduler_cls,
            runner_cls=self.runner_cls,
            worker_extension_cls=self.worker_extension_cls,
            step_execution=self.step_execution,
            backend=self.backend,
        )
        self._check_cross_fields()
        if self.device is not None and self.backend in _LOCAL_BACKENDS:
            check_device_available(self.device)

    def _check_cross_fields(self) -> None:
        """The rules between fields that the executors and workers would otherwise only
        enforce when the engine opens (they still do, as a defence)."""
        workers = self.num_workers
        dp = self.data_parallel_size
        if dp > 1:
            if self.backend == "inproc":
                raise InvalidConfigError(
                    f"data_parallel_size={dp} runs {dp} worker processes; the inproc backend "
                    "runs one worker in this process: use backend 'tractor' or 'ray' (or leave "
                    "backend unset)",
                    field="data_parallel_size",
                )
            if workers == 2 * dp and self.cfg_parallel:
                return  # dp CFG-parallel pairs
            if workers != dp:
                raise InvalidConfigError(
                    f"data_parallel_size={dp} runs one worker per rank, so num_workers must be "
                    f"{dp} (or left unset), or {2 * dp} with cfg_parallel (a CFG-parallel pair "
                    f"per rank), not {workers}",
                    field="num_workers",
                )
            return  # every rank runs the whole model: cfg_parallel does not apply
        if self.backend == "inproc" and workers != 1:
            raise InvalidConfigError(
                f"the inproc backend runs exactly one worker, not num_workers={workers}; use "
                "backend 'tractor' or 'ray' for more (or leave backend unset: more than one "
                "worker chooses tractor)",
                field="num_workers",
            )
        if self.cfg_parallel and workers > 2:
            raise InvalidConfigError(
                f"cfg_parallel splits each guidance step between exactly 2 workers, so it "
                f"cannot use num_workers={workers}; use num_workers=2, or cfg_parallel=False "
                f"to make each of the {workers} workers a full replica",
                field="cfg_parallel",
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EngineConfig:
        """Build from a mapping; unknown keys raise :class:`InvalidConfigError` naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(str(key) for key in set(data) - known)
        if unknown:
            raise InvalidConfigError(
                f"unknown EngineConfig field(s): {', '.join(unknown)}", field=unknown[0]
            )
        return cls(**dict(data))

    def replace(self, **changes: Any) -> EngineConfig:
        """A copy with ``changes``, validated like a new config (cross-field rules included).
        A backend that was chosen by worker count (``"auto"``) is chosen again when
        ``num_workers`` changes and ``backend`` is not given."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise InvalidConfigError(
                f"unknown EngineConfig field(s): {', '.join(unknown)}", field=unknown[0]
            )
        if (
            "data_parallel_size" in changes
            and "num_workers" not in changes
            and self.data_parallel_size > 1
        ):
            # With data parallelism num_workers is the size: it follows a new one (even
            # when it was given, or came back from a dict), as if it had been left unset.
            changes["num_workers"] = 1
        resized = "num_workers" in changes or "data_parallel_size" in changes
        if resized and "backend" not in changes and self.backend_by_count:
            changes["backend"] = AUTO_BACKEND
        return dataclasses.replace(self, **changes)

    @property
    def backend_by_count(self) -> bool:
        """Whether ``backend`` was chosen by worker count (``"auto"``), not named."""
        return bool(getattr(self, "_backend_by_count", False))

    def core_config(self, *, output_timeout_s: float = 600.0) -> CoreConfig:
        """What the engine core decides with (``output_timeout_s``: how long a request
        may wait for its packed output)."""
        return CoreConfig(
            step_execution=self.step_execution,
            # Each data-parallel rank runs up to max_num_seqs of a wave's requests.
            max_num_seqs=self.max_num_seqs * self.data_parallel_size,
            request_batch_max_wait_ms=self.request_batch_max_wait_ms,
            streaming_output=self.streaming_output,
            preview_interval=self.preview_interval,
            limits=self.request_limits,
            max_retries_on_worker_failure=self.max_retries_on_worker_failure,
            quarantine_after_crashes=self.quarantine_after_crashes,
            fault_injection=self.fault_injection,
            output_timeout_s=output_timeout_s,
            max_request_s=self.max_request_s,
            max_step_s=self.max_step_s,
            scheduling_policy=self.scheduling_policy,
            priority_aging_ticks=self.priority_aging_ticks,
            fair_quantum=self.fair_quantum,
            max_preempted_states=self.max_preempted_states,
            reject_while_asleep=self.reject_while_asleep,
            lora_names=frozenset(self.loras),
            max_loras=self.max_loras,
            scheduler_cls=scheduler_class(self.scheduler_cls, step_execution=self.step_execution),
        )

    @property
    def request_limits(self) -> RequestLimits:
        return RequestLimits(
            max_pixels=self.max_pixels,
            max_image_pixels=self.max_image_pixels,
            max_prompt_chars=self.max_prompt_chars,
            max_steps=self.max_steps,
            max_outputs=self.max_outputs_per_prompt,
            min_priority=self.min_priority,
            max_priority=self.max_priority,
        )

    @property
    def resolved_cache_dir(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else default_cache_dir()

    @property
    def resolved_torch_threads(self) -> int:
        return self.torch_threads or default_torch_threads(self.num_workers)
