"""The fuzzing toolkit: fault injection, the lifecycle trace, the invariant checker, and a
synchronous driver for a real engine.  The Hypothesis state machines (which need the
``testing`` extra: ``pip install omni-trio[testing]``) are in :mod:`omni_trio.testing.machine`.
See docs/fuzzing.md for a walkthrough.
"""

from .._core.trace import TraceEvent as TraceEvent
from .._core.trace import TraceKind as TraceKind
from .._core.trace import TraceRecorder as TraceRecorder
from .driver import ConsumerRecord as ConsumerRecord
from .driver import EngineDriver as EngineDriver
from .driver import leftover_resources as leftover_resources
from .driver import run_driven as run_driven
from .faults import FAULT_DOCS as FAULT_DOCS
from .faults import PROCESS_ONLY_FAULTS as PROCESS_ONLY_FAULTS
from .faults import Fault as Fault
from .faults import FaultInjectedError as FaultInjectedError
from .faults import FaultSpec as FaultSpec
from .faults import WorkerCrashInjected as WorkerCrashInjected
from .faults import WorkerFatalError as WorkerFatalError
from .faults import with_faults as with_faults
from .invariants import INVARIANTS as INVARIANTS
from .invariants import InvariantViolation as InvariantViolation
from .invariants import Violation as Violation
from .invariants import assert_trace_ok as assert_trace_ok
from .invariants import check_leftovers as check_leftovers
from .invariants import check_trace as check_trace

__all__ = [
    "FAULT_DOCS",
    "INVARIANTS",
    "PROCESS_ONLY_FAULTS",
    "ConsumerRecord",
    "EngineDriver",
    "Fault",
    "FaultInjectedError",
    "FaultSpec",
    "InvariantViolation",
    "TraceEvent",
    "TraceKind",
    "TraceRecorder",
    "Violation",
    "WorkerCrashInjected",
    "WorkerFatalError",
    "assert_trace_ok",
    "check_leftovers",
    "check_trace",
    "leftover_resources",
    "run_driven",
    "with_faults",
]
