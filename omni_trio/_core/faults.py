"""Fault specs: what a request may ask a worker to do wrong, for fuzzing (pure data).

A request asks for faults in ``sampling.extra_args["faults"]``: a list of dicts
``{"kind": <Fault value>, "step": int, "delay_s": float, "rank": int}`` (only the fields its
kind takes; see :class:`FaultSpec`).  Admission validates them with :func:`parse_faults`; the
worker carries them out (:mod:`omni_trio.worker.faults`) only when
``EngineConfig.fault_injection`` is True.

Two faults are worker-level switches instead, set in ``EngineConfig.model_options`` (with
``fault_injection=True``): ``fault_fail_warmup`` (the warmup request fails) and
``fault_crash_on_prompt`` (a poison prompt: every request whose prompt contains the text
crashes the worker at its first step), ``fault_exit_on_load`` / ``fault_hang_on_load`` (a
path: while that file exists, a worker process loading the model exits / hangs).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CRASH_ON_PROMPT_OPTION",
    "DELAY_FAULTS",
    "EXIT_CODE",
    "EXIT_ON_LOAD_OPTION",
    "FAIL_WARMUP_OPTION",
    "FAULTS_KEY",
    "FAULT_DOCS",
    "FAULT_OPTIONS",
    "FAULT_OPTION_PREFIX",
    "HANG_ON_LOAD_OPTION",
    "PROCESS_ONLY_FAULTS",
    "STEP_FAULTS",
    "WARMUP_REQUEST_ID",
    "Fault",
    "FaultSpec",
    "parse_faults",
]

FAULTS_KEY = "faults"
# Exit status of a worker process ended by CRASH_AT_STEP (the same as builtin:echo's exit).
EXIT_CODE = 3
# The id of the engine's warmup request (the worker's ``fault_fail_warmup`` switch fires on it).
WARMUP_REQUEST_ID = "omni-trio-warmup"
FAULT_OPTION_PREFIX = "fault_"
FAIL_WARMUP_OPTION = "fault_fail_warmup"
# A poison prompt: every request whose prompt contains this model option's text crashes the
# worker at its first step (CRASH_AT_STEP at step 0), however often it is run, like a model
# bug that one input triggers.  Not per request: the request itself asks for nothing.
CRASH_ON_PROMPT_OPTION = "fault_crash_on_prompt"
# A start that goes wrong: while the file this option names exists, a worker process loading
# the model ends itself (exit code EXIT_CODE; an OOM kill during load looks alike) or hangs.
# Removing the file lets the next start succeed.
EXIT_ON_LOAD_OPTION = "fault_exit_on_load"
HANG_ON_LOAD_OPTION = "fault_hang_on_load"
# Every fault_* model option the worker knows.
FAULT_OPTIONS = frozenset(
    {FAIL_WARMUP_OPTION, CRASH_ON_PROMPT_OPTION, EXIT_ON_LOAD_OPTION, HANG_ON_LOAD_OPTION}
)


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
    KILL_PACKER = "kill_packer"
    POISON_DEVICE = "poison_device"
    FAIL_WARMUP = "fail_warmup"


# Kinds that take ``step`` (required) and fire from on_step.
STEP_FAULTS = frozenset(
    {
        Fault.RAISE_AT_STEP,
        Fault.CRASH_AT_STEP,
        Fault.SIGKILL_AT_STEP,
        Fault.HANG_AT_STEP,
        Fault.POISON_DEVICE,
    }
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
    Fault.KILL_PACKER: "the async output packer's thread dies as it starts packing this "
    "request's output (request mode with async output only): the outputs it holds never "
    "come, so liveness must fail the group",
    Fault.POISON_DEVICE: "at step k the worker's device breaks for good, like a sticky CUDA "
    "error: this forward fails with a CUDA-like error and the device probe after it fails, "
    "so the worker is broken (its group fails closed)",
    Fault.FAIL_WARMUP: "not per request: model_options['fault_fail_warmup']=True makes the "
    "warmup request raise FaultInjectedError at its first step",
}


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
