"""Fault injection in the worker, for fuzzing the runtime's lifecycle invariants with any model.

A request asks for faults in ``sampling.extra_args["faults"]``: a list of dicts
``{"kind": <Fault value>, "step": int, "delay_s": float, "rank": int}`` (only the fields its
kind takes; see :class:`FaultSpec`).  The worker honours them only when
``EngineConfig.fault_injection`` is True; otherwise the key is ignored.  The warmup request
carries no ``extra_args``, so its fault is a worker-level switch instead:
``model_options["fault_fail_warmup"] = True`` (every ``fault_*`` model option is taken out
before the model loader sees the options).  A poison prompt is one too:
``model_options["fault_crash_on_prompt"] = "<text>"`` crashes the worker at the first step
of every request whose prompt contains the text (as ``crash_at_step`` at step 0 would).

The runner, step runner and worker call a :class:`FaultPlan`'s hooks at fixed points:

- ``on_step(request_id, k, total)``: at denoising step ``k`` (0-based), right after the
  runner's own step callback ran for it (request mode: ``forward_batch``'s ``on_step``; step
  mode: the request's ``k``-th step, after the fused denoise, before ``step_scheduler``).
  A ``k`` past the last step never fires.
- ``before_pack(request_id)`` / ``after_pack(request_id)``: around the conversion of one
  request's output (``after_pack`` only in the async output packer, before OUTPUT_READY).
- ``after_forward(request_ids)``: after a request-mode forward, before the worker returns it.

Errors::

    RuntimeError
    └── FaultInjectedError        a per-request failure (the request ends FINISHED_ERROR)
    Exception
    └── WorkerFatalError          the worker itself is broken: never a per-request error output
        └── WorkerCrashInjected   an injected crash/kill/hang of an in-process worker

Why the in-process twins: the inproc backend's worker is a thread of the engine's own
process, so killing "the worker" would kill the engine.  There a crash raises
:class:`WorkerCrashInjected` out of the worker call, and the executor fails closed exactly as
it does for a dead worker process.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from .._core.faults import CRASH_ON_PROMPT_OPTION as CRASH_ON_PROMPT_OPTION
from .._core.faults import DELAY_FAULTS as DELAY_FAULTS
from .._core.faults import EXIT_CODE as EXIT_CODE
from .._core.faults import EXIT_ON_LOAD_OPTION as EXIT_ON_LOAD_OPTION
from .._core.faults import FAIL_WARMUP_OPTION as FAIL_WARMUP_OPTION
from .._core.faults import FAULT_DOCS as FAULT_DOCS
from .._core.faults import FAULT_OPTION_PREFIX as FAULT_OPTION_PREFIX
from .._core.faults import FAULT_OPTIONS
from .._core.faults import FAULTS_KEY as FAULTS_KEY
from .._core.faults import HANG_ON_LOAD_OPTION as HANG_ON_LOAD_OPTION
from .._core.faults import PROCESS_ONLY_FAULTS as PROCESS_ONLY_FAULTS
from .._core.faults import STEP_FAULTS as STEP_FAULTS
from .._core.faults import WARMUP_REQUEST_ID as WARMUP_REQUEST_ID
from .._core.faults import Fault as Fault
from .._core.faults import FaultSpec as FaultSpec
from .._core.faults import parse_faults as parse_faults
from ..errors import InvalidConfigError

if TYPE_CHECKING:
    from .._core.request import DiffusionRequest
    from ..config import EngineConfig
    from .stop_flags import StopFlags

__all__ = [
    "DELAY_FAULTS",
    "EXIT_CODE",
    "CRASH_ON_PROMPT_OPTION",
    "EXIT_ON_LOAD_OPTION",
    "FAIL_WARMUP_OPTION",
    "HANG_ON_LOAD_OPTION",
    "FAULTS_KEY",
    "FAULT_DOCS",
    "FAULT_OPTION_PREFIX",
    "PROCESS_ONLY_FAULTS",
    "STEP_FAULTS",
    "WARMUP_REQUEST_ID",
    "DeviceFaultError",
    "DeviceFaultInjected",
    "Fault",
    "FaultInjectedError",
    "FaultInjector",
    "FaultPlan",
    "FaultSpec",
    "PackerKilledInjected",
    "WorkerCrashInjected",
    "WorkerFatalError",
    "in_worker_process",
    "mark_worker_process",
    "parse_faults",
    "split_fault_options",
]

log = logging.getLogger(__name__)

# How often an in-process hang looks whether the worker is being shut down.
HANG_POLL_S = 0.02


class FaultInjectedError(RuntimeError):
    """A fault a request asked for: fails that request (error_type ``FaultInjectedError``)."""

    def __init__(self, request_id: str, kind: Fault, step: int | None = None) -> None:
        where = f" at step {step}" if step is not None else ""
        super().__init__(f"injected fault {kind.value}{where} for request {request_id!r}")
        self.request_id = request_id
        self.kind = kind
        self.step = step


class WorkerFatalError(Exception):
    """The worker itself is broken; never converted into a per-request error output.

    The runner lets it propagate out of the worker call; the executor then fails closed
    (a worker process ends itself with :data:`EXIT_CODE` instead of replying).
    """


class DeviceFaultError(WorkerFatalError):
    """The worker's device is broken (a failed probe after an error that looked like a
    device fault): nothing more can run on it, so the worker group must be replaced."""


class DeviceFaultInjected(RuntimeError):
    """The error a poisoned device raises (an injected ``poison_device``): it reads like a
    sticky CUDA error, so the runner probes the device."""

    def __init__(self, request_id: str, step: int) -> None:
        super().__init__(
            f"CUDA error: an illegal memory access was encountered (injected poison_device at "
            f"step {step} for request {request_id!r})"
        )
        self.request_id = request_id
        self.kind = Fault.POISON_DEVICE
        self.step = step


class PackerKilledInjected(BaseException):
    """Ends the output packer's thread (an injected ``kill_packer``): a BaseException, so
    the packer's own error handling does not turn it into a packing error."""


class WorkerCrashInjected(WorkerFatalError):
    """An injected crash, kill or hang of an in-process worker (see :class:`Fault`)."""

    def __init__(self, request_id: str, kind: Fault, step: int | None = None) -> None:
        where = f" at step {step}" if step is not None else ""
        super().__init__(f"injected worker crash: {kind.value}{where} for request {request_id!r}")
        self.request_id = request_id
        self.kind = kind
        self.step = step


_worker_process = False


def mark_worker_process() -> None:
    """Say that this process is a worker process of its own (the tractor backend calls it
    when a worker starts): crash faults then really end it."""
    global _worker_process
    _worker_process = True


def in_worker_process() -> bool:
    """Whether :func:`mark_worker_process` was called in this process."""
    return _worker_process


def split_fault_options(
    options: Mapping[str, Any],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split ``model_options`` into ``(the model's own, the fault_* ones)``.

    Raises :class:`InvalidConfigError` (field ``model_options``) for an unknown ``fault_*``
    option, so a typo does not pass silently.
    """
    model: dict[str, Any] = {}
    faults: dict[str, Any] = {}
    for key, value in options.items():
        if isinstance(key, str) and key.startswith(FAULT_OPTION_PREFIX):
            if key not in FAULT_OPTIONS:
                raise InvalidConfigError(
                    f"unknown fault option {key!r} in model_options "
                    f"(known: {', '.join(sorted(FAULT_OPTIONS))})",
                    field="model_options",
                )
            faults[key] = value
        else:
            model[key] = value
    return model, faults


def _optional_str(value: Any) -> str | None:
    return str(value) if value else None


class FaultInjector:
    """One worker's fault switchboard: builds each forward's :class:`FaultPlan` and carries
    out the faults.

    ``enabled`` False (``config.fault_injection`` off) makes every plan empty: requests'
    faults are ignored.  ``rank`` selects the faults with a matching ``rank``.
    ``fail_warmup``: the warmup request fails at its first step.  ``stop_flags``: an
    in-process hang ends once they say "stop everything" (or :meth:`release` is called).
    ``worker_process`` (default: :func:`in_worker_process` at the time a fault fires) picks
    the process or the in-process effect of crash faults.  ``sleep`` runs every delay (tests
    pass a fake clock).
    """

    def __init__(
        self,
        *,
        enabled: bool,
        rank: int = 0,
        fail_warmup: bool = False,
        crash_on_prompt: str | None = None,
        exit_on_load: str | None = None,
        hang_on_load: str | None = None,
        stop_flags: StopFlags | None = None,
        worker_process: bool | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.enabled = enabled
        self.rank = rank
        self.fail_warmup = enabled and fail_warmup
        self.crash_on_prompt = crash_on_prompt or None if enabled else None
        self.exit_on_load = exit_on_load or None if enabled else None
        self.hang_on_load = hang_on_load or None if enabled else None
        self.stop_flags = stop_flags
        self._worker_process = worker_process
        self._sleep = sleep
        self._released = threading.Event()
        self._empty = FaultPlan(self, {})
        # Set by an injected poison_device: the device probe fails from then on.
        self.device_poisoned = False

    @classmethod
    def from_config(
        cls,
        config: EngineConfig,
        *,
        rank: int = 0,
        stop_flags: StopFlags | None = None,
        **kwargs: Any,
    ) -> FaultInjector:
        """Enabled by ``config.fault_injection``; ``fail_warmup`` from
        ``config.model_options["fault_fail_warmup"]`` (truthy), ``crash_on_prompt`` from
        ``config.model_options["fault_crash_on_prompt"]`` (a string)."""
        poison = config.model_options.get(CRASH_ON_PROMPT_OPTION)
        return cls(
            enabled=config.fault_injection,
            rank=rank,
            fail_warmup=bool(config.model_options.get(FAIL_WARMUP_OPTION)),
            crash_on_prompt=str(poison) if poison else None,
            exit_on_load=_optional_str(config.model_options.get(EXIT_ON_LOAD_OPTION)),
            hang_on_load=_optional_str(config.model_options.get(HANG_ON_LOAD_OPTION)),
            stop_flags=stop_flags,
            **kwargs,
        )

    @property
    def worker_process(self) -> bool:
        if self._worker_process is not None:
            return self._worker_process
        return in_worker_process()

    def plan(self, requests: Iterable[DiffusionRequest]) -> FaultPlan:
        """The faults of ``requests`` that this rank fires.  Never raises: a request with a
        malformed ``faults`` entry is listed in :attr:`FaultPlan.invalid` (with the message)
        and gets no faults.  Disabled: the shared empty plan, without looking at the
        requests; enabled: one dict lookup per request without faults."""
        if not self.enabled:
            return self._empty
        faults: dict[str, tuple[FaultSpec, ...]] = {}
        invalid: dict[str, str] = {}
        for request in requests:
            rid = request.request_id
            specs: tuple[FaultSpec, ...] = ()
            if FAULTS_KEY in request.sampling.extra_args:
                try:
                    specs = parse_faults(request.sampling.extra_args)
                except ValueError as exc:
                    invalid[rid] = str(exc)
                    continue
                specs = tuple(s for s in specs if s.rank is None or s.rank == self.rank)
            if self.fail_warmup and rid == WARMUP_REQUEST_ID:
                specs = (FaultSpec(Fault.FAIL_WARMUP), *specs)
            poison = self.crash_on_prompt
            if poison is not None and poison in request.prompt:
                specs = (FaultSpec(Fault.CRASH_AT_STEP, step=0), *specs)
            if specs:
                faults[rid] = specs
        if not faults and not invalid:
            return self._empty
        return FaultPlan(self, faults, invalid)

    def on_load(self) -> None:
        """Before the model loads, in a worker process only: end the process while the
        ``exit_on_load`` file exists, hang while the ``hang_on_load`` one does (a start
        that goes wrong: an OOM kill, a stuck download)."""
        if not self.worker_process:
            return
        if self.exit_on_load is not None and os.path.exists(self.exit_on_load):
            log.warning("injected exit on load: ending worker process %d", os.getpid())
            os._exit(EXIT_CODE)
        if self.hang_on_load is not None and os.path.exists(self.hang_on_load):
            log.warning("injected hang on load in worker process %d", os.getpid())
            while True:  # only a kill ends it
                time.sleep(3600.0)

    def release(self) -> None:
        """End every in-process hang (now and later) with :class:`WorkerCrashInjected`;
        from any thread."""
        self._released.set()

    # -- carrying faults out ----------------------------------------------------------------

    def _fire_step(self, request_id: str, spec: FaultSpec, step: int) -> None:
        kind = spec.kind
        if kind in (Fault.RAISE_AT_STEP, Fault.FAIL_WARMUP):
            raise FaultInjectedError(request_id, kind, step)
        if kind is Fault.POISON_DEVICE:
            log.warning("injected poison_device at step %d of %s", step, request_id)
            self.device_poisoned = True
            raise DeviceFaultInjected(request_id, step)
        if kind is Fault.HANG_AT_STEP:
            self._hang(request_id, step)
        elif self.worker_process:
            log.warning(
                "injected %s at step %d of %s: ending worker process %d",
                kind.value,
                step,
                request_id,
                os.getpid(),
            )
            if kind is Fault.SIGKILL_AT_STEP:
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(EXIT_CODE)  # the injected crash: no cleanup, like a segfault
        raise WorkerCrashInjected(request_id, kind, step)

    def _hang(self, request_id: str, step: int) -> None:
        log.warning("injected hang at step %d of %s", step, request_id)
        if self.worker_process:
            while True:  # only a kill from the executor ends it
                time.sleep(3600.0)
        flags = self.stop_flags
        # should_stop(()) is True only once the flags say "stop everything" (shutdown).
        while not (flags is not None and flags.should_stop(())):
            if self._released.wait(HANG_POLL_S):
                break

    def _delay(self, seconds: float) -> None:
        if seconds > 0:
            self._sleep(seconds)


class FaultPlan:
    """The faults of the requests of one forward (or one step-mode request), for this rank.

    Falsy when there are none: callers guard each hook with ``if plan:``, so a forward
    without faults costs one truth test per hook point.  ``invalid`` maps request ids whose
    ``faults`` entry was malformed to the ``ValueError`` message.
    """

    __slots__ = ("_faults", "_injector", "invalid")

    def __init__(
        self,
        injector: FaultInjector,
        faults: Mapping[str, tuple[FaultSpec, ...]],
        invalid: Mapping[str, str] | None = None,
    ) -> None:
        self._injector = injector
        self._faults = faults
        self.invalid: Mapping[str, str] = invalid or {}

    def __bool__(self) -> bool:
        return bool(self._faults)

    def faults_for(self, request_id: str) -> tuple[FaultSpec, ...]:
        return self._faults.get(request_id, ())

    def on_step(self, request_id: str, step: int, total: int) -> None:
        """Denoising step ``step`` of ``total`` of ``request_id`` runs now.  Raises
        :class:`FaultInjectedError` (raise, warmup), :class:`WorkerCrashInjected`
        (in-process crash, kill, released hang) or never returns (a worker process's crash,
        kill or hang)."""
        for spec in self._faults.get(request_id, ()):
            if spec.kind is Fault.FAIL_WARMUP:
                if step == 0:
                    self._injector._fire_step(request_id, spec, step)
            elif spec.step == step and spec.kind in STEP_FAULTS:
                self._injector._fire_step(request_id, spec, step)

    def before_pack(self, request_id: str) -> None:
        """About to pack ``request_id``'s output: SLOW_PACKING sleeps, FAIL_PACKING raises
        :class:`FaultInjectedError` (in list order)."""
        for spec in self._faults.get(request_id, ()):
            if spec.kind is Fault.SLOW_PACKING:
                self._injector._delay(spec.delay_s or 0.0)
            elif spec.kind is Fault.FAIL_PACKING:
                raise FaultInjectedError(request_id, spec.kind)

    def in_packer(self, request_ids: Iterable[str]) -> None:
        """The async packer's thread is about to pack these requests' outputs: KILL_PACKER
        ends the thread (:class:`PackerKilledInjected`)."""
        for rid in request_ids:
            for spec in self._faults.get(rid, ()):
                if spec.kind is Fault.KILL_PACKER:
                    log.warning("injected kill_packer for %s", rid)
                    raise PackerKilledInjected(rid)

    def after_pack(self, request_id: str) -> None:
        """``request_id``'s output is packed, OUTPUT_READY not sent yet (async packer only):
        DELAY_OUTPUT_READY sleeps."""
        for spec in self._faults.get(request_id, ()):
            if spec.kind is Fault.DELAY_OUTPUT_READY:
                self._injector._delay(spec.delay_s or 0.0)

    def after_forward(self, request_ids: Iterable[str]) -> None:
        """A request-mode forward of ``request_ids`` is done, not yet returned:
        DELAY_COMPUTE_DONE sleeps once, the largest delay among them."""
        delay = 0.0
        for rid in request_ids:
            for spec in self._faults.get(rid, ()):
                if spec.kind is Fault.DELAY_COMPUTE_DONE:
                    delay = max(delay, spec.delay_s or 0.0)
        self._injector._delay(delay)
