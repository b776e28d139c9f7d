"""Fault injection in the worker, for fuzzing the runtime's lifecycle invariants with any model.

A request asks for faults in ``sampling.extra_args["faults"]``: a list of dicts
``{"kind": <Fault value>, "step": int, "delay_s": float, "rank": int}`` (only the fields its
kind takes; see :class:`FaultSpec`).  The worker honours them only when
``EngineConfig.fault_injection`` is True; otherwise the key is ignored.  The warmup request
carries no ``extra_args``, so its fault is a worker-level switch instead:
``model_options["fault_fail_warmup"] = True`` (every ``fault_*`` model option is taken out
before the model loader sees the options).

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

import enum
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import InvalidConfigError

if TYPE_CHECKING:
    from .._core.request import DiffusionRequest
    from ..config import EngineConfig
    from .stop_flags import StopFlags

__all__ = [
    "DELAY_FAULTS",
    "EXIT_CODE",
    "FAIL_WARMUP_OPTION",
    "FAULTS_KEY",
    "FAULT_DOCS",
    "FAULT_OPTION_PREFIX",
    "PROCESS_ONLY_FAULTS",
    "STEP_FAULTS",
    "WARMUP_REQUEST_ID",
    "Fault",
    "FaultInjectedError",
    "FaultInjector",
    "FaultPlan",
    "FaultSpec",
    "WorkerCrashInjected",
    "WorkerFatalError",
    "in_worker_process",
    "mark_worker_process",
    "parse_faults",
    "split_fault_options",
]

log = logging.getLogger(__name__)

FAULTS_KEY = "faults"
# Exit status of a worker process ended by CRASH_AT_STEP (the same as builtin:echo's exit).
EXIT_CODE = 3
# The engine's warmup request id: a copy of omni_trio.runtime.engine.WARMUP_REQUEST_ID (the
# worker must not import the engine).  Keep the two equal.
WARMUP_REQUEST_ID = "omni-trio-warmup"
FAULT_OPTION_PREFIX = "fault_"
FAIL_WARMUP_OPTION = "fault_fail_warmup"
_FAULT_OPTIONS = frozenset({FAIL_WARMUP_OPTION})
# How often an in-process hang looks whether the worker is being shut down.
HANG_POLL_S = 0.02


class Fault(enum.StrEnum):
    """The kinds of fault; the value is what ``extra_args["faults"][i]["kind"]`` holds."""

    RAISE_AT_STEP = "raise_at_step"
    CRASH_AT_STEP = "crash_at_step"
    SIGKILL_AT_STEP = "sigkill_at_step"
    HANG_AT_STEP = "hang_at_step"
    SLOW_PACKING = "slow_packing"
    FAIL_PACKING = "fail_packing"
    DELAY_COMPUTE_DONE = "delay_compute_done"
    DELAY_OUTPUT_READY = "delay_output_ready"
    FAIL_WARMUP = "fail_warmup"


# Kinds that take ``step`` (required) and fire from on_step.
STEP_FAULTS = frozenset(
    {Fault.RAISE_AT_STEP, Fault.CRASH_AT_STEP, Fault.SIGKILL_AT_STEP, Fault.HANG_AT_STEP}
)
# Kinds that take ``delay_s`` (required).
DELAY_FAULTS = frozenset({Fault.SLOW_PACKING, Fault.DELAY_COMPUTE_DONE, Fault.DELAY_OUTPUT_READY})
# Kinds whose effect in an in-process worker differs from the one in a worker process.
PROCESS_ONLY_FAULTS = frozenset({Fault.CRASH_AT_STEP, Fault.SIGKILL_AT_STEP, Fault.HANG_AT_STEP})

FAULT_DOCS: dict[Fault, str] = {
    Fault.RAISE_AT_STEP: "raise FaultInjectedError at step k: the whole fused forward fails "
    "(request mode), only this request (step mode)",
    Fault.CRASH_AT_STEP: f"the worker dies at step k: os._exit({EXIT_CODE}) in a worker "
    "process; WorkerCrashInjected (the executor fails closed) in-process",
    Fault.SIGKILL_AT_STEP: "SIGKILL to itself at step k in a worker process; in-process the "
    "same as crash_at_step (the engine process is never killed)",
    Fault.HANG_AT_STEP: "stop at step k ignoring aborts: sleep forever in a worker process "
    "(liveness checks must catch it); in-process block until the worker is shut down, then "
    "raise WorkerCrashInjected",
    Fault.SLOW_PACKING: "sleep delay_s before packing this request's output (async packer "
    "and synchronous packing)",
    Fault.FAIL_PACKING: "packing this request's output raises FaultInjectedError (the request "
    "ends FINISHED_ERROR)",
    Fault.DELAY_COMPUTE_DONE: "sleep delay_s after a request-mode forward before the worker "
    "returns it (delays COMPUTE_DONE; OUTPUT_READY may come first)",
    Fault.DELAY_OUTPUT_READY: "the async output packer sleeps delay_s after packing, before "
    "sending OUTPUT_READY (outputs complete out of order)",
    Fault.FAIL_WARMUP: "not per request: model_options['fault_fail_warmup']=True makes the "
    "warmup request raise FaultInjectedError at its first step",
}


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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """One requested fault.  ``step`` (0-based denoising step) is required by, and only
    taken by, :data:`STEP_FAULTS`; ``delay_s`` (seconds, finite, >= 0) by
    :data:`DELAY_FAULTS`.  ``rank``: only the worker of that rank fires it (``None``: every
    rank).  Raises ``ValueError`` naming the bad field."""

    kind: Fault
    step: int | None = None
    delay_s: float | None = None
    rank: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Fault):
            try:
                object.__setattr__(self, "kind", Fault(self.kind))
            except ValueError:
                known = ", ".join(f.value for f in Fault)
                raise ValueError(f"unknown fault kind {self.kind!r} (known: {known})") from None
        kind = self.kind
        if kind in STEP_FAULTS:
            if self.step is None:
                raise ValueError(f"{kind.value} needs a 'step' (0-based denoising step)")
            if not _is_int(self.step) or self.step < 0:
                raise ValueError(f"{kind.value}: step must be an integer >= 0, got {self.step!r}")
        elif self.step is not None:
            raise ValueError(f"{kind.value} takes no 'step', got {self.step!r}")
        if kind in DELAY_FAULTS:
            delay = self.delay_s
            if delay is None:
                raise ValueError(f"{kind.value} needs a 'delay_s' (seconds)")
            if (
                isinstance(delay, bool)
                or not isinstance(delay, int | float)
                or not math.isfinite(delay)
                or delay < 0
            ):
                raise ValueError(
                    f"{kind.value}: delay_s must be a finite number >= 0, got {delay!r}"
                )
            object.__setattr__(self, "delay_s", float(delay))
        elif self.delay_s is not None:
            raise ValueError(f"{kind.value} takes no 'delay_s', got {self.delay_s!r}")
        if self.rank is not None and (not _is_int(self.rank) or self.rank < 0):
            raise ValueError(f"{kind.value}: rank must be an integer >= 0, got {self.rank!r}")

    def to_dict(self) -> dict[str, Any]:
        """The ``extra_args["faults"]`` entry for this fault (plain types only)."""
        data: dict[str, Any] = {"kind": self.kind.value}
        for name in ("step", "delay_s", "rank"):
            value = getattr(self, name)
            if value is not None:
                data[name] = value
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FaultSpec:
        """Inverse of :meth:`to_dict`; ``ValueError`` for a missing kind, unknown keys or
        bad values."""
        if not isinstance(data, Mapping):
            raise ValueError(f"a fault must be a dict, got {type(data).__name__}")
        unknown = sorted(str(key) for key in set(data) - {"kind", "step", "delay_s", "rank"})
        if unknown:
            raise ValueError(
                f"unknown fault field(s) {', '.join(unknown)} (known: kind, step, delay_s, rank)"
            )
        if "kind" not in data:
            raise ValueError("a fault needs a 'kind'")
        return cls(
            data["kind"], step=data.get("step"), delay_s=data.get("delay_s"), rank=data.get("rank")
        )


def parse_faults(extra_args: Mapping[str, Any]) -> tuple[FaultSpec, ...]:
    """The faults ``extra_args["faults"]`` asks for (``()`` when the key is absent).

    Entries are dicts (see :meth:`FaultSpec.from_dict`) or :class:`FaultSpec` s.  Raises
    ``ValueError`` naming the bad entry: not a list, an unknown kind, a missing or negative
    ``step``/``delay_s``, a field its kind does not take, a wrong type, or ``fail_warmup``
    (not a per-request fault).
    """
    raw = extra_args.get(FAULTS_KEY)
    if raw is None:
        return ()
    if not isinstance(raw, list | tuple):
        raise ValueError(
            f"extra_args[{FAULTS_KEY!r}] must be a list of fault dicts, got {type(raw).__name__}"
        )
    specs: list[FaultSpec] = []
    for index, entry in enumerate(raw):
        where = f"extra_args[{FAULTS_KEY!r}][{index}] ({entry!r})"
        try:
            spec = entry if isinstance(entry, FaultSpec) else FaultSpec.from_dict(entry)
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if spec.kind is Fault.FAIL_WARMUP:
            raise ValueError(
                f"{where}: fail_warmup is not a per-request fault; set "
                f"model_options[{FAIL_WARMUP_OPTION!r}] = True (with fault_injection=True)"
            )
        specs.append(spec)
    return tuple(specs)


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
            if key not in _FAULT_OPTIONS:
                raise InvalidConfigError(
                    f"unknown fault option {key!r} in model_options "
                    f"(known: {', '.join(sorted(_FAULT_OPTIONS))})",
                    field="model_options",
                )
            faults[key] = value
        else:
            model[key] = value
    return model, faults


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
        stop_flags: StopFlags | None = None,
        worker_process: bool | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.enabled = enabled
        self.rank = rank
        self.fail_warmup = enabled and fail_warmup
        self.stop_flags = stop_flags
        self._worker_process = worker_process
        self._sleep = sleep
        self._released = threading.Event()
        self._empty = FaultPlan(self, {})

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
        ``config.model_options["fault_fail_warmup"]`` (truthy)."""
        return cls(
            enabled=config.fault_injection,
            rank=rank,
            fail_warmup=bool(config.model_options.get(FAIL_WARMUP_OPTION)),
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
            if specs:
                faults[rid] = specs
        if not faults and not invalid:
            return self._empty
        return FaultPlan(self, faults, invalid)

    def release(self) -> None:
        """End every in-process hang (now and later) with :class:`WorkerCrashInjected`;
        from any thread."""
        self._released.set()

    # -- carrying faults out ----------------------------------------------------------------

    def _fire_step(self, request_id: str, spec: FaultSpec, step: int) -> None:
        kind = spec.kind
        if kind in (Fault.RAISE_AT_STEP, Fault.FAIL_WARMUP):
            raise FaultInjectedError(request_id, kind, step)
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
