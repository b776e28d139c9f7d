"""Fault injection for fuzzing: ask a worker to fail on purpose, with any model.

Faults travel in ``SamplingParams.extra_args["faults"]`` as a list of dicts (build them with
:func:`with_faults`) and fire only in an engine with ``EngineConfig(fault_injection=True)``;
anywhere else the worker ignores them.  ``step`` is the 0-based denoising step (fired right
after the runner's step callback for it; a step past the last never fires), ``delay_s`` is in
seconds, ``rank`` (optional) restricts a fault to the worker of that rank.

==================  =======  ====================================  ===============================
kind                args     in-process worker (inproc)            worker process (tractor)
==================  =======  ====================================  ===============================
raise_at_step       step     FaultInjectedError at step k: the     same
                             request fails (with its whole fused
                             forward in request mode, alone in
                             step mode)
crash_at_step       step     WorkerCrashInjected out of the        ``os._exit(3)``: the worker
                             worker call: the executor fails       process dies
                             closed
sigkill_at_step     step     as crash_at_step (the engine process  SIGKILL to itself
                             is never killed)
hang_at_step        step     blocks at step k, ignoring aborts,    sleeps forever, ignoring aborts
                             until the worker is shut down; then   (the executor's stall check
                             WorkerCrashInjected                   must catch it)
slow_packing        delay_s  sleeps before packing the request's   same
                             output (async packer and synchronous
                             packing)
fail_packing        --       packing the request's output raises   same
                             FaultInjectedError: the request ends
                             FINISHED_ERROR
delay_compute_done  delay_s  request mode: sleeps after the        same
                             forward before returning it
                             (COMPUTE_DONE late; OUTPUT_READY may
                             come first)
delay_output_ready  delay_s  async output packer only: sleeps      same
                             after packing, before OUTPUT_READY
                             (outputs complete out of order)
kill_packer         --       async output packer only: the         same (the heartbeat says
                             packer thread dies as it starts       ``packer_alive=False``)
                             packing this request's output; the
                             liveness monitor fails the group
poison_device       step     the device breaks for good at step    same (a ``fatal`` reply)
                             k, like a sticky CUDA error: the
                             forward fails with a CUDA-like
                             error, the device probe fails, the
                             executor fails closed
fail_warmup         --       not per request: model_options        same
                             ``{"fault_fail_warmup": True}``
                             fails the warmup request at step 0
                             with FaultInjectedError
==================  =======  ====================================  ===============================

Three more are worker-level ``model_options`` switches: ``fault_crash_on_prompt="<text>"``
(a poison prompt: the worker crashes at the first step of every request whose prompt
contains the text), ``fault_exit_on_load`` / ``fault_hang_on_load`` (a path: while that file
exists, a worker process exits / hangs as it loads the model).

Example::

    params = with_faults(SamplingParams(seed=1), FaultSpec(Fault.RAISE_AT_STEP, step=2))
    async with open_engine(fault_injection=True) as engine:
        await engine.generate("a cat", params)  # RequestFailedError, "FaultInjectedError"
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._core.faults import FAULT_DOCS as FAULT_DOCS
from .._core.faults import FAULTS_KEY as FAULTS_KEY
from .._core.faults import PROCESS_ONLY_FAULTS as PROCESS_ONLY_FAULTS
from .._core.faults import Fault as Fault
from .._core.faults import FaultSpec as FaultSpec
from .._core.faults import parse_faults as parse_faults
from .._core.request import SamplingParams
from ..worker.faults import FaultInjectedError as FaultInjectedError
from ..worker.faults import WorkerCrashInjected as WorkerCrashInjected
from ..worker.faults import WorkerFatalError as WorkerFatalError

__all__ = [
    "FAULTS_KEY",
    "FAULT_DOCS",
    "PROCESS_ONLY_FAULTS",
    "Fault",
    "FaultInjectedError",
    "FaultSpec",
    "WorkerCrashInjected",
    "WorkerFatalError",
    "parse_faults",
    "with_faults",
]


def with_faults(
    params: SamplingParams, *faults: FaultSpec | Fault | str | Mapping[str, Any]
) -> SamplingParams:
    """A copy of ``params`` whose ``extra_args["faults"]`` holds its faults plus ``faults``.

    Each fault is a :class:`FaultSpec`, a bare :class:`Fault` (or its value) for kinds that
    take no arguments, or an ``extra_args`` dict.  Entries are stored as plain dicts, so the
    params cross process boundaries.  Raises ``ValueError`` for a malformed fault (including
    the faults ``params`` already had) and for ``fail_warmup`` (a model option, not a
    request fault).  ``params`` itself is unchanged.
    """
    added: list[dict[str, Any]] = []
    for fault in faults:
        if isinstance(fault, FaultSpec):
            spec = fault
        elif isinstance(fault, Mapping):
            spec = FaultSpec.from_dict(fault)
        else:
            spec = FaultSpec.from_dict({"kind": fault})
        added.append(spec.to_dict())
    extra = dict(params.extra_args)
    extra[FAULTS_KEY] = [*extra.get(FAULTS_KEY, ()), *added]
    parse_faults(extra)  # validates old and new entries alike
    return params.replace(extra_args=extra)
