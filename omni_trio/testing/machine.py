"""Hypothesis state machines that drive a real engine and check its lifecycle invariants.

:func:`make_engine_machine` builds a ``RuleBasedStateMachine`` for one backend and mode.
Each example opens a real engine on ``builtin:echo`` (whose images name their request and
seed) and applies rules -- submit (random steps, seed and an optional fault), abort, drop a
consumer, let time pass, crash a worker, RPC, wait for everything, close and reopen --
checking after every rule the invariant checker over the trace and
:func:`~omni_trio.testing.check_leftovers` over what every engine-side component holds (no
violation may ever appear, even mid-flight; ``wait_for_everything`` lets the engine settle
and then checks the workers' state too), and, when an engine closes, its whole trace plus a
small reference model of what each request must have ended as:

* a request with no fault, not aborted, not dropped, not caught by a close and not exposed
  to a fault (another request's fault or a crash while it was live) completes;
* a request whose own fault fires (raise, fail packing, crash, hang) does not complete;
* nothing of the engine is left after close (threads, shared memory, worker processes).

:func:`run_engine_machine` runs one machine as a test (inside :func:`run_driven`, so the
engine lives in a real trio loop in the calling thread) and returns campaign counters.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import logging
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NoReturn, TypeVar, cast

import hypothesis.strategies as st
import trio
from hypothesis import note
from hypothesis import settings as Settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from .._core.lifecycle import RequestStatus
from .._core.messages import DiffusionOutput
from .._core.request import MAX_SEED, SamplingParams
from .._core.trace import TraceEvent, TraceKind, TraceRecorder
from ..config import EngineConfig
from ..errors import OmniTrioError, StallError
from .driver import EngineDriver, leftover_resources, run_driven
from .faults import Fault, FaultSpec, with_faults
from .invariants import (
    InvariantViolation,
    Violation,
    check_leftovers,
    check_liveness,
    check_trace,
)

__all__ = [
    "BENIGN_FAULTS",
    "FAILING_FAULTS",
    "EDGE_SEEDS",
    "CampaignStats",
    "MachineOptions",
    "backend_unavailable",
    "engine_config_for",
    "identity_violations",
    "liveness_bounds",
    "make_engine_machine",
    "path_hits",
    "run_engine_machine",
]

log = logging.getLogger(__name__)
_K = TraceKind
# The steps of a long request (120 x 5 ms: it outlives either deadline by more than the
# slack below).
_LONG_STEPS = 120
# How late after its deadline a request may end: within a step (5 ms) or the next step
# callback, plus the engine loop's own scheduling on a loaded machine.
_DEADLINE_SLACK_S = 0.2
# Trace times and the deadline's clock are the same trio clock; a hair of slack for floats.
_CLOCK_SLACK_S = 1e-3
# How often wait_for_everything looks at the liveness oracle while it waits.
_LIVENESS_POLL_S = 0.25
# The best priority a rising wave gives (the default limits allow -10..10).
_BEST_PRIORITY = -10
# The side of an output over the shared-memory threshold.
_LARGE_SIDE = 640


def _violated(violations: list[Violation]) -> NoReturn:
    """Raise the violations.  Every oracle raises from here: Hypothesis tells failures apart
    by where they were raised, and whether a bug is first seen by the per-rule check or by
    the close check depends on timing; one place keeps the two the same failure, so a replay
    or a shrink step that sees it in the other place still counts."""
    raise InvariantViolation(violations)


def _engine_violation(message: str, where: str = "wait_for_everything") -> Violation:
    return Violation("INV-6", f"{message} ({where})", None, ())


_Rule = TypeVar("_Rule", bound=Callable[..., Any])


def _answered(on_timeout: Callable[..., Any] | None = None) -> Callable[[_Rule], _Rule]:
    """Decorate a rule (or invariant) of the engine machine: when one of its driver calls
    gets no answer within the driver's call bound (``trio.TooSlowError``: a hang where no
    oracle could look, e.g. an RPC or an admission that never returns), the rule records
    that as an INV-6 finding naming it and returns ``on_timeout(**its arguments)`` (None
    without one: what a target rule must return so later draws stay the same) instead of
    raising (rules never raise: see the machine's teardown)."""

    def decorate(fn: _Rule) -> _Rule:
        @functools.wraps(fn)
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except trio.TooSlowError:
                bound = self.driver.call_timeout_s
                message = f"a driver call got no answer within its {bound:.1f} s bound"
                self._found([_engine_violation(message, fn.__name__)])
                return None if on_timeout is None else on_timeout(**kwargs)

        return cast(_Rule, run)

    return decorate


def _is_failure(exc: BaseException | None) -> bool:
    """Whether an exception ending an example is a finding (not Hypothesis' own control)."""
    if exc is None or not isinstance(exc, Exception):
        return False
    from hypothesis.errors import HypothesisException

    return not isinstance(exc, HypothesisException)


# Faults after which the request must not complete (when they fire), and faults that only
# slow it down.
FAILING_FAULTS = (
    Fault.RAISE_AT_STEP,
    Fault.FAIL_PACKING,
    Fault.CRASH_AT_STEP,
    Fault.SIGKILL_AT_STEP,
    Fault.HANG_AT_STEP,
    Fault.KILL_PACKER,
    Fault.POISON_DEVICE,
)
BENIGN_FAULTS = (Fault.SLOW_PACKING, Fault.DELAY_COMPUTE_DONE, Fault.DELAY_OUTPUT_READY)
_STEP_FAULTS = frozenset(
    {
        Fault.RAISE_AT_STEP,
        Fault.CRASH_AT_STEP,
        Fault.SIGKILL_AT_STEP,
        Fault.HANG_AT_STEP,
        Fault.POISON_DEVICE,
    }
)
# Faults that fire only where request-mode outputs go through the async output packer.
_PACKER_FAULTS = frozenset({Fault.KILL_PACKER})


@dataclass(frozen=True)
class MachineOptions:
    """What a campaign fuzzes: backend, mode, batch size and which faults to inject."""

    backend: str = "inproc"
    mode: str = "request"  # "request" or "step"
    # Up to 4: the wave rule fuses 2-4 requests into one forward.
    max_num_seqs: int = 4
    # tractor, ray: data-parallel ranks (each runs different requests).
    data_parallel_size: int = 1
    # The engine's scheduling policy; under "priority" each request draws a priority in
    # -3..3 (so better arrivals pass waiting ones and, in step mode, may preempt running ones).
    scheduling_policy: str = "fifo"
    # Requests may start from a picture (image-to-image, inpainting; echo carries it and does
    # not look at it), some over the shared-memory threshold, so that every lifecycle rule
    # runs with pictures on the wire too.
    pictures: bool = False
    step_delay_s: float = 0.005
    faults: tuple[Fault, ...] = FAILING_FAULTS + BENIGN_FAULTS
    crash_rule: bool = True
    close_rule: bool = True
    cache_dir: str | None = None
    # tractor: how worker processes start ("trio" or "forkserver", see EngineConfig).
    worker_start_method: str = "trio"
    # wait_for_everything: every consumer done and the engine idle, its workers' leftovers
    # reported, within this (INV-6); None: derived from the liveness bounds (a restart and
    # an RPC), see make_engine_machine.
    settle_timeout_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["faults"] = [f.value for f in self.faults]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MachineOptions:
        data = dict(data)
        data["faults"] = tuple(Fault(f) for f in data.get("faults", ()))
        return cls(**data)


def backend_unavailable(backend: str) -> str | None:
    """Why ``backend`` cannot run here (its optional extra is missing), or None."""
    if backend != "ray":
        return None
    from ..errors import InvalidConfigError
    from ..executors.ray_executor import import_ray

    try:
        import_ray()
    except InvalidConfigError as exc:
        return str(exc)
    return None


def _stall_timeout_s(options: MachineOptions) -> float:
    """The machine's stall deadline: in-process a step's progress is seen at once; worker
    processes report it in heartbeats, once a second, so theirs must stay above that."""
    return 0.5 if options.backend == "inproc" else 2.0


def engine_config_for(options: MachineOptions) -> EngineConfig:
    """The engine configuration a machine runs: echo, fault injection on, quick restarts,
    a short stall deadline (so a hang is caught in half a second)."""
    step = options.mode == "step"
    return EngineConfig(
        model="builtin:echo",
        model_options={"step_delay_s": options.step_delay_s},
        backend=options.backend,
        worker_start_method=options.worker_start_method,
        cache_dir=options.cache_dir,
        torch_threads=1,
        step_execution=step,
        streaming_output=step,
        max_num_seqs=options.max_num_seqs,
        data_parallel_size=options.data_parallel_size,
        scheduling_policy=options.scheduling_policy,
        warmup=False,
        fault_injection=True,
        max_worker_restarts=10_000,
        worker_restart_backoff_s=0.01,
        worker_restart_backoff_max_s=0.05,
        max_retries_on_worker_failure=1,
        worker_stall_timeout_s=_stall_timeout_s(options),
        # Sleep and wake are RPCs too: bounded (past a restart), so one that is never
        # answered is a finding (the wake_up rule reports it), not a campaign that hangs.
        rpc_timeout_s=sum(liveness_bounds(options)[:2]),
        worker_heartbeat_timeout_s=10.0,
        close_timeout_s=5.0,
    )


@dataclass
class CampaignStats:
    """Counters of a campaign (updated as it runs; read them from another thread)."""

    examples: int = 0
    rules: int = 0
    requests: int = 0
    faults_injected: int = 0
    crashes: int = 0
    restarts: int = 0
    # Step-boundary preemptions (scheduling_policy "priority"), from each engine's trace.
    preemptions: int = 0
    # Requests that started from a picture (MachineOptions.pictures).
    pictures: int = 0
    invariant_checks: int = 0
    engines: int = 0
    # How often each hard path was reached (see :func:`path_hits`), over every engine closed.
    hits: dict[str, int] = field(default_factory=dict)
    # Seconds into the campaign when the first example failed (before any shrinking).
    first_failure_s: float | None = None
    started_at: float = field(default_factory=time.monotonic)
    last_trace: list[TraceEvent] = field(default_factory=list)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_at

    def rate(self, count: int) -> float:
        return count / max(self.elapsed_s, 1e-9)

    def add_hits(self, hits: dict[str, int]) -> None:
        for path, count in hits.items():
            self.hits[path] = self.hits.get(path, 0) + count

    def failed(self) -> None:
        """Note that an example failed now (only the first time counts)."""
        if self.first_failure_s is None:
            self.first_failure_s = self.elapsed_s


@dataclass
class _Submitted:
    request_id: str
    steps: int
    fault: FaultSpec | None
    # What it asked for, as the reference model knows it (not as the engine reports it).
    seed: int = 0
    outputs: int = 1
    deadline_s: float | None = None
    # How many of its consumer's outputs the identity oracle has compared so far.
    checked: int = 0


# Seeds every campaign draws often besides random ones: the edges of the range (0 is the one
# a falsy check mistakes for "no seed") and a few small ones that repeat across requests.
EDGE_SEEDS = (0, 1, 2, MAX_SEED)


def identity_violations(
    request_id: str,
    seed: int,
    outputs_per_prompt: int,
    outputs: Sequence[DiffusionOutput],
    history: Sequence[TraceEvent] = (),
) -> list[Violation]:
    """The identity oracle (INV-5): every output a request's consumer received carries that
    request's own images, drawn from the seed *it asked for* (not the one the engine
    reports), image k the k-th of its ``outputs_per_prompt``; every output that reports a
    seed (an aborted or failed one too) reports that one; a completed terminal output has
    all of its images.  ``builtin:echo`` writes request id, generator seed
    and index into each image, so a swapped, mis-seeded, mis-ordered or stale result is seen
    whatever the trace says."""
    from ..models.echo import decode_echo_image

    found: list[Violation] = []

    def bad(message: str) -> None:
        found.append(Violation("INV-5", f"{request_id}: {message}", request_id, tuple(history)))

    for output in outputs:
        where = f"output {output.chunk_index + 1}/{output.total_chunks}"
        completed = output.finished and output.status is RequestStatus.FINISHED_COMPLETED
        if output.seed is not None and output.seed != seed:  # any chunk that says one
            bad(f"{where} ({output.status.name}) reports seed {output.seed}; it asked for {seed}")
        if completed:
            if output.seed is None:
                bad(f"the terminal output reports no seed; it asked for {seed}")
            if len(output.images) != outputs_per_prompt:
                bad(f"{len(output.images)} images delivered; it asked for {outputs_per_prompt}")
        for index, image in enumerate(output.images):
            try:
                owner, drawn, position = decode_echo_image(image)
            except Exception:  # a preview that is not an echo image (latents): nothing to read
                if completed:
                    bad(f"{where}: image {index} is not the echo image of any request")
                continue
            if owner != request_id:
                bad(f"{where}: image {index} is the image of request {owner!r}")
            if drawn != seed:
                bad(f"{where}: image {index} was drawn from seed {drawn}; it asked for {seed}")
            if position != index:
                bad(f"{where}: image {index} is output {position} of its request")
    return found


#: The hard paths a campaign should reach, counted per engine by :func:`path_hits` (and by
#: the machine for the ones the trace cannot show) and reported in the campaign summary.
PATHS = (
    "fused_wave",  # a forward ran 2 or more requests
    "abort_mid_forward",  # an abort or consumer drop landed while its forward ran
    "abort_in_fused_wave",  # ... in a forward of 2 or more
    "abort_mid_packing",  # ... while its output was being packed (request mode)
    "mixed_steps",  # admitted while a live request had another step count
    "crash_mid_forward",  # a worker group failed while a forward ran
    "crash_while_packing",  # ... while an output was being packed
    "requeue",  # a request retried on a restarted group
    "close_with_queued",  # the engine closed with requests still queued
    "preemption",  # a step-mode preemption (scheduling_policy "priority")
    "early_output_ready",  # request mode: the output arrived before the forward's reply
    "large_payload",  # a picture or output over the shared-memory threshold
)


def path_hits(events: Sequence[TraceEvent]) -> dict[str, int]:
    """How often one engine's trace reached each hard path of :data:`PATHS` that a trace
    shows (the others are counted by the machine as it submits)."""
    hits = dict.fromkeys(PATHS, 0)
    members: dict[int | None, set[str]] = {}  # step id -> requests in that forward
    in_forward: dict[str, int | None] = {}  # request -> step id of its running forward
    packing: set[str] = set()
    queued: set[str] = set()
    steps: dict[str, Any] = {}  # live request -> its steps
    for e in events:
        rid, kind = e.request_id, e.kind
        if kind is _K.ADMIT and rid is not None:
            mine = e.detail.get("steps")
            if any(other != mine for other in steps.values()):
                hits["mixed_steps"] += 1
            steps[rid] = mine
            queued.add(rid)
        elif kind is _K.REQUEUE and rid is not None:
            hits["requeue"] += 1
            queued.add(rid)
            in_forward.pop(rid, None)
            packing.discard(rid)
        elif kind is _K.PREEMPT and rid is not None:
            hits["preemption"] += 1
            queued.add(rid)
            in_forward.pop(rid, None)
        elif kind is _K.EXEC_START and rid is not None:
            queued.discard(rid)
            in_forward[rid] = e.step_id
            group = members.setdefault(e.step_id, set())
            group.add(rid)
            if len(group) == 2:
                hits["fused_wave"] += 1
        elif kind is _K.EXEC_RESULT and rid is not None:
            in_forward.pop(rid, None)
            if e.detail.get("outcome") == "pending":
                packing.add(rid)
        elif kind in (_K.ABORT, _K.CONSUMER_DROP) and rid is not None:
            if rid in in_forward:
                hits["abort_mid_forward"] += 1
                if len(members.get(in_forward[rid], ())) >= 2:
                    hits["abort_in_fused_wave"] += 1
            elif rid in packing:
                hits["abort_mid_packing"] += 1
        elif kind is _K.TERMINAL and rid is not None:
            in_forward.pop(rid, None)
            packing.discard(rid)
            queued.discard(rid)
            steps.pop(rid, None)
        elif kind is _K.CRASH:
            hits["crash_mid_forward"] += bool(in_forward)
            hits["crash_while_packing"] += bool(packing)
            in_forward.clear()  # the group is gone: what it ran is over (or requeued)
            packing.clear()
        elif kind is _K.CLOSE:
            hits["close_with_queued"] += bool(queued)
    return hits


def _fault_fires(spec: FaultSpec | None, steps: int, mode: str = "request") -> bool:
    """Whether ``spec`` (on a request of ``steps`` steps, in ``mode``) makes it fail."""
    if spec is None or spec.kind not in FAILING_FAULTS:
        return False
    if spec.kind in _PACKER_FAULTS and mode != "request":
        return False
    if spec.kind in _STEP_FAULTS:
        return spec.step is not None and spec.step < steps
    return True


# What a submitted request starts from (MachineOptions.pictures): noise, a small picture, one
# over the shared-memory threshold (640 x 640 x 3 bytes), a small picture and a mask.
PICTURES = ("none", "small", "large", "inpaint")


def _picture_fields(picture: str, seed: int, steps: int) -> dict[str, Any]:
    """``image``/``mask_image``/``strength`` for ``picture``; strength halves the steps when
    there are at least two (so the cut schedule is exercised), else keeps the one."""
    if picture == "none":
        return {}
    import numpy as np

    side = 640 if picture == "large" else 40
    fields: dict[str, Any] = {
        "image": np.full((side, side, 3), seed % 256, dtype=np.uint8),
        "strength": 0.5 if steps >= 2 else 1.0,
    }
    if picture == "inpaint":
        fields["mask_image"] = np.full((side, side), 255, dtype=np.uint8)
    return fields


# How long a worker group may take to restart, per backend (and tractor start method).
_RESTART_BOUND_S = {"inproc": 5.0, "tractor": 30.0, "ray": 45.0}
_FORKSERVER_RESTART_BOUND_S = 10.0


def liveness_bounds(options: MachineOptions) -> tuple[float, float, float]:
    """``(bound_s, restart_bound_s, queue_bound_s)`` of the liveness oracle for ``options``
    (see :func:`~omni_trio.testing.check_liveness`), derived from the fault plan: a hang is
    caught by the stall deadline, the slowest benign fault adds its delay, and a worker group
    restarts within its backend's bound."""
    stall = _stall_timeout_s(options)
    slowest_benign = 0.1  # the longest delay submit draws for a benign fault
    bound = 2 * stall + 3 * slowest_benign + 40 * options.step_delay_s
    if options.backend == "tractor" and options.worker_start_method == "forkserver":
        restart = _FORKSERVER_RESTART_BOUND_S
    else:
        restart = _RESTART_BOUND_S.get(options.backend, 60.0)
    return bound, restart + bound, 10 * bound + restart


def make_engine_machine(
    options: MachineOptions, driver_ref: Callable[[], EngineDriver], stats: CampaignStats
) -> type[RuleBasedStateMachine]:
    """A state machine class for ``options``; ``driver_ref()`` gives the running driver."""
    config = engine_config_for(options)
    fault_kinds = tuple(sorted(options.faults, key=lambda f: f.value))
    fault_strategy = st.sampled_from(fault_kinds) if fault_kinds else st.nothing()
    prioritised = options.scheduling_policy == "priority"
    bound_s, restart_bound_s, queue_bound_s = liveness_bounds(options)
    # After close, every consumer has its terminal output within this (INV-6).
    close_bound_s = (config.close_timeout_s or 5.0) + bound_s
    # A ping RPC on a healthy engine answers within this (a hang or a crash under it ends
    # it sooner, with an error, through the stall deadline and the restart).
    rpc_bound_s = bound_s + restart_bound_s
    # wait_for_everything: once every consumer is done, the engine is idle and its workers
    # answered the leftovers RPC within this (a restart may be under way).
    settle_bound_s = (
        rpc_bound_s + restart_bound_s
        if options.settle_timeout_s is None
        else options.settle_timeout_s
    )
    # No driver call on a live engine takes longer (the longest: a sleep that waits for its
    # drain, gets no answer, and wakes the ranks again); one that does is a hang the oracles
    # could not see into, reported as such (see _answered) within seconds, not minutes.
    call_bound_s = max(
        config.sleep_drain_timeout_s + 2 * rpc_bound_s + restart_bound_s,
        settle_bound_s + bound_s,
        2 * close_bound_s,
    )

    def _wave_total(size: int, rising: bool) -> int:
        """How many requests submit_wave submits (and returns) for ``size``, ``rising``."""
        return max(size, options.max_num_seqs + 1) if rising else size

    class EngineMachine(RuleBasedStateMachine):
        requests = Bundle("requests")
        description: ClassVar[str] = f"{options.backend}/{options.mode}"

        def __init__(self) -> None:
            super().__init__()
            self.driver = driver_ref()
            self.submitted: dict[str, _Submitted] = {}
            # Trace positions (index in the current recorder) where a fault was injected.
            self.fault_marks: list[int] = []
            self.asleep = False  # the engine was put to sleep and not woken yet
            self.dropped: set[str] = set()  # requests whose consumer the machine stopped
            # A hang was injected in this engine and no rule has waited it out since.
            self.hang_pending = False
            # What the oracles found.  A finding ends the example's work at once (every later
            # rule does nothing) and is raised by teardown: the example then always ends at
            # the same place whatever the engine's timing, which Hypothesis needs to replay
            # and shrink it (a failure seen one rule earlier in a replay would read to it as
            # a test whose data generation changed).
            self.found: list[Violation] = []
            self.driver.call_timeout_s = call_bound_s
            try:
                self._open_engine()
            except trio.TooSlowError:  # (as _answered does for the rules)
                message = f"open got no answer within its {call_bound_s:.1f} s bound"
                self._found([_engine_violation(message, "open")])
            stats.examples += 1

        def _found(self, violations: list[Violation]) -> bool:
            """Keep ``violations`` as the example's finding (the first time, its time is the
            campaign's first failure); True if there were any."""
            if not violations:
                return False
            if not self.found:
                stats.failed()
            self.found.extend(violations)
            return True

        # -- engine lifecycle ------------------------------------------------------------

        def _open_engine(self) -> None:
            self.driver.trace = TraceRecorder()
            self.driver.consumers.clear()
            self.submitted.clear()
            self.fault_marks.clear()
            self.dropped.clear()
            self.hang_pending = False
            self.asleep = False
            self.driver.open(config)
            stats.engines += 1

        def _close_engine_and_check(self) -> None:
            driver = self.driver
            stuck = driver.close(consumer_timeout=close_bound_s)
            trace = driver.trace
            last = trace.events[-1].time if len(trace) else 0.0
            trace.record(last, _K.CLOSED, detail={"leftovers": leftover_resources()})
            events = trace.events
            stats.last_trace = events
            stats.restarts += sum(1 for e in events if e.kind is _K.RESTART)
            stats.preemptions += sum(1 for e in events if e.kind is _K.PREEMPT)
            stats.add_hits(path_hits(events))
            stats.invariant_checks += 1
            violations = check_trace(events, closed=True) + self._identity_violations(events)
            violations += self._deadline_violations(events, None)
            for rid in stuck:
                history = tuple(e for e in events if e.request_id == rid)
                violations.append(
                    Violation(
                        "INV-6",
                        f"{rid}: its consumer had no terminal output {close_bound_s:g} s after "
                        "the engine closed",
                        rid,
                        history,
                    )
                )
            if not self._found(violations):
                self._found(self._check_outcomes(events))

        def _check_outcomes(self, events: list[TraceEvent]) -> list[Violation]:
            """The reference model: what each request must have ended as."""
            found: list[Violation] = []

            def bad(rid: str, message: str) -> None:
                history = tuple(e for e in events if e.request_id == rid)
                found.append(Violation("INV-5", f"{rid}: {message}", rid, history))

            first: dict[tuple[str, TraceKind], int] = {}
            terminal_status: dict[str, str] = {}
            for index, event in enumerate(events):
                if event.request_id is not None:
                    first.setdefault((event.request_id, event.kind), index)
                    if event.kind is _K.TERMINAL:
                        terminal_status[event.request_id] = str(event.detail.get("status"))
                elif event.kind is _K.CLOSE:
                    first.setdefault(("", _K.CLOSE), index)
            close_at = first.get(("", _K.CLOSE), len(events))
            crashes = [i for i, event in enumerate(events) if event.kind is _K.CRASH]
            # The forwards (step ids) each request ran in, and those a request with a
            # failing fault ran in: one admitted before another, still waiting when the
            # other came, may share its batch too.
            forwards: dict[str, set[int]] = {}
            for event in events:
                if event.kind is _K.EXEC_START and event.request_id is not None:
                    forwards.setdefault(event.request_id, set()).add(event.step_id or 0)
            faulty: set[int] = set()
            for rid, sub in self.submitted.items():
                if sub.fault is not None and sub.fault.kind in FAILING_FAULTS:
                    faulty |= forwards.get(rid, set())
            for rid, sub in self.submitted.items():
                admit = first.get((rid, _K.ADMIT))
                end = first.get((rid, _K.TERMINAL))
                if admit is None or end is None:
                    bad(rid, "submitted, but no ADMIT or no TERMINAL in the closed trace")
                    continue
                status = terminal_status[rid]
                stopped = min(
                    first.get((rid, _K.ABORT), len(events)),
                    first.get((rid, _K.CONSUMER_DROP), len(events)),
                    close_at,
                )
                if stopped < end:
                    continue  # aborted, dropped or closed while live: any terminal status
                if sub.deadline_s is not None and (
                    events[end].time >= events[admit].time + sub.deadline_s - _CLOCK_SLACK_S
                ):
                    continue  # its deadline came first: ended aborted, or done in time
                if _fault_fires(sub.fault, sub.steps, options.mode):
                    if status == "FINISHED_COMPLETED":
                        bad(rid, f"its fault {sub.fault} fired but it completed")
                    continue
                # Exposed: a failing fault was submitted while it lived, or it shared a
                # forward with a request that has one, or its worker group failed while it
                # lived (a neighbour's crash retried it, perhaps beside the same neighbour
                # again: retries run out).
                exposed = (
                    any(admit <= mark <= end for mark in self.fault_marks)
                    or not faulty.isdisjoint(forwards.get(rid, ()))
                    or any(admit <= at <= end for at in crashes)
                )
                if not exposed and status != "FINISHED_COMPLETED":
                    bad(rid, f"no fault, no abort, no crash while it ran, yet it ended {status}")
            return found

        # -- rules -------------------------------------------------------------------------

        @rule(
            target=requests,
            # Now and then a long one (120 steps): it outlives a deadline, and aborts and
            # drops land inside its forward.
            steps=st.sampled_from([1, 2, 3, 4] * 3 + [_LONG_STEPS] * 2),
            seed=st.one_of(st.sampled_from(EDGE_SEEDS), st.integers(0, MAX_SEED)),
            fault=st.one_of(st.none(), st.none(), fault_strategy),
            fault_step=st.integers(0, 3),
            delay=st.sampled_from([0.0, 0.02, 0.1]),
            # Drawn only under "priority" (st.just draws nothing).
            priority=st.integers(-3, 3) if prioritised else st.just(0),
            picture=st.sampled_from(PICTURES) if options.pictures else st.just("none"),
            # Now and then an output over the shared-memory threshold (640 x 640 x 3 bytes).
            side=st.sampled_from([32, 32, 32, _LARGE_SIDE]),
            # Now and then two images (the identity oracle checks each one's index), and a
            # deadline (the request must end within a step of it; the oracle checks that).
            outputs=st.sampled_from([1, 1, 1, 2]),
            deadline=st.sampled_from([None, None, None, 0.02, 0.3]),
        )
        @_answered(lambda **_: "none")
        def submit(
            self,
            steps: int,
            seed: int,
            fault: Fault | None,
            fault_step: int,
            delay: float,
            priority: int,
            picture: str,
            side: int,
            outputs: int,
            deadline: float | None,
        ) -> str:
            if fault is Fault.HANG_AT_STEP:  # whatever comes of it (rules must not depend
                self.hang_pending = True  # on the engine's timing: Hypothesis replays them)
            if self.found:
                return "none"
            params = SamplingParams(
                num_inference_steps=steps,
                seed=seed,
                height=side,
                width=side,
                priority=priority,
                num_outputs_per_prompt=outputs,
                deadline_s=deadline,
                **_picture_fields(picture, seed, steps),
            )
            steps = params.total_steps
            spec: FaultSpec | None = None
            if fault is not None:
                if fault in _STEP_FAULTS:
                    spec = FaultSpec(fault, step=fault_step)
                elif fault in BENIGN_FAULTS:
                    spec = FaultSpec(fault, delay_s=delay)
                else:
                    spec = FaultSpec(fault)
                params = with_faults(params, spec)
            mark = len(self.driver.trace)
            try:
                rid = self.driver.submit("fuzz", params)
            except OmniTrioError as exc:  # dead engine: acceptable only if it says so
                self._refused(exc)
                return "none"
            if spec is not None:
                stats.faults_injected += 1
                if spec.kind in FAILING_FAULTS:
                    self.fault_marks.append(mark)
            self.submitted[rid] = _Submitted(
                rid, steps, spec, seed=seed, outputs=outputs, deadline_s=deadline
            )
            stats.requests += 1
            self._count_submitted(spec, picture, side)
            stats.rules += 1
            return rid

        def _refused(self, exc: OmniTrioError) -> None:
            """A valid request was refused at admission: fine only from a dead engine."""
            engine = self.driver.engine
            if engine is None or not engine.is_dead:
                message = f"a valid request was refused by a live engine: {exc!r}"
                self._found([_engine_violation(message, "submit")])

        def _count_submitted(self, spec: FaultSpec | None, picture: str, side: int) -> None:
            """The hard paths only the machine sees as it submits (see :data:`PATHS`)."""
            if picture != "none":
                stats.pictures += 1
            if picture == "large" or side >= _LARGE_SIDE:
                stats.add_hits({"large_payload": 1})
            if (
                spec is not None
                and spec.kind is Fault.DELAY_COMPUTE_DONE
                and options.mode == "request"
            ):
                stats.add_hits({"early_output_ready": 1})

        @precondition(lambda self: not self.asleep)
        @rule(
            target=requests,
            size=st.integers(2, 4),
            steps=st.integers(1, 4),
            seeds=st.lists(
                st.one_of(st.sampled_from(EDGE_SEEDS), st.integers(0, MAX_SEED)),
                min_size=4,
                max_size=4,
            ),
            then=st.sampled_from(["nothing", "abort", "drop", "crash"]),
            victim=st.integers(0, 3),
            when=st.sampled_from(["forward", "reply", "packing"]),
            late_reply=st.booleans(),
            # Drawn only where they matter (st.just draws nothing).
            rising=st.booleans() if prioritised else st.just(False),
            mixed=st.booleans() if options.pictures else st.just(False),
        )
        @_answered(lambda size, rising, **_: multiple(*["none"] * _wave_total(size, rising)))
        def submit_wave(
            self,
            size: int,
            steps: int,
            seeds: list[int],
            then: str,
            victim: int,
            when: str,
            late_reply: bool,
            rising: bool,
            mixed: bool,
        ) -> Any:
            """A wave of 2-4 compatible requests submitted at once (they fuse into one
            forward), and then, unless ``then`` is "nothing", one of them aborted, dropped or
            its worker crashed while its forward runs or while its output is packed (a slow
            packing fault on it, where the campaign's faults allow, widens that window).
            ``when`` "reply" acts as the forward ends (after its steps' time): with
            ``late_reply`` that is after its output was packed but before the forward's
            reply, which is delayed past it (request mode; the batch output then also
            arrives before its split is known).  ``rising`` (priority policy): each member
            outranks the one before, so with a full batch later ones preempt earlier ones
            in step mode.  ``mixed`` (pictures): the second member starts from a picture of
            the same size and step count (it must not share their forward)."""
            total = _wave_total(size, rising)
            if self.found:
                return multiple(*["none"] * total)
            driver = self.driver
            ids: list[str] = []
            victim %= size
            batch = options.max_num_seqs
            # Rising priorities (``total`` above): the batch fills first, and once its first
            # member runs, the better rest (one more than fits) arrives: each must preempt
            # a running one (step mode).
            for index in range(total):
                if rising and index == min(size, batch) and ids:
                    self._wait_for_phase(ids[0], "forward")
                picture: dict[str, Any] = {}
                if mixed and index == 1:
                    picture = {**_picture_fields("small", seeds[index], 1), "strength": 1.0}
                params = SamplingParams(
                    num_inference_steps=steps,
                    seed=seeds[index % len(seeds)],
                    height=32,
                    width=32,
                    priority=max(-index, _BEST_PRIORITY) if rising else 0,
                    **picture,
                )
                spec: FaultSpec | None = None
                slow = (
                    index == victim
                    and when == "packing"
                    and then != "nothing"
                    and Fault.SLOW_PACKING in options.faults
                )
                if slow:
                    spec = FaultSpec(Fault.SLOW_PACKING, delay_s=0.1)
                elif (
                    index == (victim if then != "nothing" else 0)
                    and late_reply
                    and Fault.DELAY_COMPUTE_DONE in options.faults
                ):
                    # The forward's reply comes after the batch's packed output (request mode).
                    spec = FaultSpec(Fault.DELAY_COMPUTE_DONE, delay_s=0.05)
                if spec is not None:
                    params = with_faults(params, spec)
                    self._count_submitted(spec, "none", 32)
                try:
                    rid = driver.submit("fuzz", params)
                except OmniTrioError as exc:
                    self._refused(exc)
                    break
                ids.append(rid)
                self.submitted[rid] = _Submitted(rid, steps, spec, seed=seeds[index % len(seeds)])
                stats.requests += 1
                stats.pictures += bool(picture)
                if spec is not None:
                    stats.faults_injected += 1
            if then != "nothing" and victim < len(ids):
                target = ids[victim]
                self._wait_for_phase(target, "packing" if when == "packing" else "forward")
                if when == "reply":  # the forward's steps have run by now
                    self.driver.sleep(steps * options.step_delay_s + 0.005)
                if then == "abort":
                    driver.abort(target)
                elif then == "drop":
                    if driver.drop(target):
                        self.dropped.add(target)
                elif options.crash_rule:
                    self.crash_worker()
            stats.rules += 1
            # Always ``total`` entries ("none" for one refused by a dead engine): what later
            # rules can draw from must not depend on the engine's timing.
            return multiple(*ids, *["none"] * (total - len(ids)))

        def _wait_for_phase(self, request_id: str, phase: str) -> None:
            """Until ``request_id`` is in its forward ("forward") or its output is being
            packed ("packing"), or it ended, for at most a second."""
            driver = self.driver
            engine = driver.engine
            assert engine is not None

            def there() -> bool:
                core = engine.core
                if not core.is_live(request_id):
                    return True
                if phase == "forward":
                    return request_id in core.in_flight_ids()
                return request_id in core.awaited_outputs().values()

            async def wait() -> None:
                with trio.move_on_after(1.0):
                    # Polled: the core has no event for "entered a phase" (a millisecond
                    # is well under one echo step).
                    for _ in itertools.count():
                        if there():
                            return
                        await trio.sleep(0.001)

            driver.run(wait)

        @rule(rid=requests)
        @_answered()
        def abort(self, rid: str) -> None:
            if self.found:
                return
            self.driver.abort(rid)
            stats.rules += 1

        @rule(rid=requests)
        @_answered()
        def drop_consumer(self, rid: str) -> None:
            if self.found:
                return
            if self.driver.drop(rid):
                self.dropped.add(rid)
            stats.rules += 1

        @precondition(lambda self: self.hang_pending)
        @rule()
        @_answered()
        def outwait_a_hang(self) -> None:
            """After a hang was injected: nothing happens for the liveness bound, so the
            stall deadline must end the hung forward by itself (and the oracles see it if
            nothing does) before a crash or a close would clear it."""
            self.hang_pending = False
            if self.found:
                return
            self.driver.sleep(bound_s + _LIVENESS_POLL_S)
            stats.rules += 1

        @rule(seconds=st.sampled_from([0.0, 0.005, 0.02, 0.1]))
        @_answered()
        def let_time_pass(self, seconds: float) -> None:
            if self.found:
                return
            self.driver.sleep(seconds)
            stats.rules += 1

        @precondition(lambda self: options.crash_rule)
        @rule()
        @_answered()
        def crash_worker(self) -> None:
            if self.found:
                return
            self.fault_marks.append(len(self.driver.trace))
            self.driver.crash_worker()
            stats.crashes += 1
            stats.faults_injected += 1
            stats.rules += 1

        @rule()
        @_answered()
        def rpc(self) -> None:
            if self.found:
                return
            mark = len(self.driver.trace)
            try:
                reply = self.driver.rpc("ping", timeout=rpc_bound_s)
            except StallError as exc:
                # No answer in time.  Fine only if the group failed meanwhile (a hang or a
                # crash ends it with an error too, but may take a restart to do so).
                if not self._group_failed_since(mark):
                    self._found([_engine_violation(f"a ping RPC got no answer: {exc}", "rpc")])
            except OmniTrioError:
                pass  # the group failed under it, or the engine died: a typed error is fine
            else:
                assert isinstance(reply, dict), reply
            stats.rules += 1

        @precondition(lambda self: not self.asleep)
        @rule(level=st.sampled_from([1, 2]))
        @_answered()
        def sleep(self, level: int) -> None:
            """Put the workers to sleep (weights released) between waves: requests
            submitted meanwhile wait; the ones running finish first (or the sleep fails,
            typed, and the engine stays awake)."""
            # The machine counts the engine asleep either way (a failed sleep leaves it awake,
            # and waking an awake engine is a no-op): which rules may come next must not
            # depend on the engine's timing, or Hypothesis cannot replay the example.
            self.asleep = True
            if self.found:
                return
            fell = self.driver.sleep_engine(level)  # (no answer at all: see _answered)
            note(f"sleep({level}) -> {'asleep' if fell else 'failed'}")
            stats.rules += 1

        @precondition(lambda self: self.asleep)
        @rule()
        @_answered()
        def wake_up(self) -> None:
            """Give the weights back: every waiting request runs, with its own image."""
            self.asleep = False
            if self.found:
                return
            mark = len(self.driver.trace)
            try:
                self.driver.wake_engine()
            except StallError as exc:  # no answer: a finding unless the group failed
                if not self._group_failed_since(mark):
                    message = f"the wake RPC got no answer: {exc}"
                    self._found([_engine_violation(message, "wake_up")])

        def _group_failed_since(self, mark: int) -> bool:
            """Whether the trace since position ``mark``, or a restart still under way,
            shows the worker group failing (a crash, a stall, a restart, death)."""
            driver = self.driver
            events = driver.call(lambda: driver.trace.events)
            failing = (_K.CRASH, _K.STALL, _K.DEAD, _K.RESTART)
            if any(e.kind in failing for e in events[mark:]):
                return True
            crashes = [e.seq for e in events if e.kind is _K.CRASH]
            restarts = [e.seq for e in events if e.kind is _K.RESTART]
            return bool(crashes) and (not restarts or restarts[-1] < crashes[-1])
            stats.rules += 1

        @rule()
        @_answered()
        def wait_for_everything(self) -> None:
            """Every consumer is done, the engine settles, and then nothing anywhere (core,
            streams, pump, runner and step state, stop flags, packer) holds a request."""
            if self.asleep:  # nothing waiting would ever finish (wake_up clears it first)
                self.wake_up()
            if self.found:
                return
            driver = self.driver
            # (Past the liveness oracle's own bounds: it names a request stuck before this.)
            give_up = time.monotonic() + max(settle_bound_s, queue_bound_s + restart_bound_s)
            while not driver.wait_finished(timeout=_LIVENESS_POLL_S):
                if self._check_liveness():  # a request stuck in some phase: found, named
                    return
                if time.monotonic() > give_up:
                    self._found([_engine_violation("requests did not finish in time")])
                    return
            mark = len(driver.trace)
            try:
                held = driver.settle(timeout=settle_bound_s)
            except StallError as exc:  # the leftovers RPC: no answer, and no failure excuses it
                if not self._group_failed_since(mark):
                    self._found([_engine_violation(f"the leftovers RPC got no answer: {exc}")])
                return
            if held is None:
                self._found([_engine_violation("the engine did not settle in time")])
                return
            events = driver.call(lambda: driver.trace.events)
            stats.invariant_checks += 1
            if self._found(check_leftovers(held, events, settled=True)):
                stats.last_trace = events
            stats.rules += 1

        @precondition(lambda self: options.close_rule)
        @rule()
        @_answered()
        def close_and_reopen(self) -> None:
            # What the reopened engine starts as, whatever happens: later preconditions
            # must not depend on whether something was found first.
            self.asleep = self.hang_pending = False
            if self.found:
                return
            self._close_engine_and_check()
            self._open_engine()
            stats.rules += 1

        @invariant()
        @_answered()
        def no_violation_so_far(self) -> None:
            """The trace so far, and what every component holds now, break no invariant."""
            driver = self.driver
            if not driver.is_open or self.found:
                return
            stats.invariant_checks += 1
            engine = driver.engine
            assert engine is not None
            events, held, flying, now = driver.call(
                lambda: (
                    driver.trace.events,
                    engine.leftovers(),
                    engine.core.in_flight_ids(),
                    trio.current_time(),
                )
            )
            violations = check_trace(events) + check_leftovers(held, events, in_flight=flying)
            violations += self._identity_violations(events)
            if violations:
                stats.last_trace = events
                self._found(violations)
            elif self._liveness_violations(events, now):
                self._check_liveness()  # confirmed after a second look, or not at all

        def _liveness_violations(self, events: list[TraceEvent], now: float) -> list[Violation]:
            """The liveness oracle (INV-6): skipped while the engine sleeps on purpose."""
            if self.asleep:
                return []
            found = check_liveness(
                events,
                now,
                bound_s=bound_s,
                restart_bound_s=restart_bound_s,
                queue_bound_s=queue_bound_s,
                dropped=self.dropped,
            )
            return found + self._deadline_violations(events, now)

        def _deadline_violations(
            self, events: list[TraceEvent], now: float | None
        ) -> list[Violation]:
            """A request with ``deadline_s`` ends within ``_DEADLINE_SLACK_S`` of it (INV-6:
            a step or a step callback, and the loop's scheduling).  A restart, a sleep or a
            close while it lived excuses it (the core ends it once the engine runs again).
            Ended by its deadline (not completed) but late, or still live, it is a finding
            only if the engine went on working (scheduled or started a forward) past the
            deadline plus the slack meanwhile: a loop that did nothing at all for a moment
            (a loaded machine held the whole process up) ends it late for nobody's fault.
            ``now`` None: the trace is closed."""
            found: list[Violation] = []
            timed = {rid: sub for rid, sub in self.submitted.items() if sub.deadline_s}
            if not timed:
                return found
            admitted: dict[str, TraceEvent] = {}
            ended: dict[str, TraceEvent] = {}
            excused: set[str] = set()
            work = sorted(e.time for e in events if e.kind in (_K.SCHEDULE, _K.EXEC_START))
            for event in events:
                rid = event.request_id
                if rid is None:
                    if event.kind in (_K.CRASH, _K.SLEEP, _K.CLOSE):
                        excused.update(r for r in admitted if r not in ended)
                elif rid in timed:
                    if event.kind is _K.ADMIT:
                        admitted.setdefault(rid, event)
                    elif event.kind is _K.TERMINAL:
                        ended.setdefault(rid, event)
            for rid, sub in timed.items():
                admit = admitted.get(rid)
                if admit is None or rid in excused or sub.deadline_s is None:
                    continue
                due = admit.time + sub.deadline_s + _DEADLINE_SLACK_S
                end = ended.get(rid)
                late = (end.time if end is not None else now) or 0.0
                completed = end is not None and end.detail.get("status") == "FINISHED_COMPLETED"
                worked = bisect.bisect_right(work, due) < bisect.bisect_left(work, late)
                if (end is not None or now is not None) and late > due and (completed or worked):
                    what = "ended" if end is not None else "is still live"
                    history = tuple(e for e in events if e.request_id == rid)
                    found.append(
                        Violation(
                            "INV-6",
                            f"{rid}: {what} {late - admit.time:.2f} s after admission; its "
                            f"deadline_s={sub.deadline_s:g} (+ {_DEADLINE_SLACK_S:g} s allowed)",
                            rid,
                            history,
                        )
                    )
            return found

        def _check_liveness(self) -> bool:
            """The liveness oracle now; True if it found something.  What it finds must be
            there on a second look too, after the engine's loop ran for a moment: a real
            hang stays, a loop that was merely held up (a loaded machine) catches up."""
            driver = self.driver

            def look() -> tuple[list[TraceEvent], list[Violation]]:
                events, now = driver.call(lambda: (driver.trace.events, trio.current_time()))
                return events, self._liveness_violations(events, now)

            events, found = look()
            if found:
                driver.sleep(_LIVENESS_POLL_S)
                events, found = look()
            if self._found(found):
                stats.last_trace = events
                return True
            return False

        def _identity_violations(self, events: list[TraceEvent]) -> list[Violation]:
            """The identity oracle over what each consumer received since the last check."""
            driver = self.driver
            received = driver.call(
                lambda: {rid: list(rec.outputs) for rid, rec in driver.consumers.items()}
            )
            found: list[Violation] = []
            for rid, sub in self.submitted.items():
                outputs = received.get(rid, [])
                if len(outputs) <= sub.checked:
                    continue
                new, sub.checked = outputs[sub.checked :], len(outputs)
                history = [e for e in events if e.request_id == rid]
                found += identity_violations(rid, sub.seed, sub.outputs, new, history)
            return found

        def teardown(self) -> None:
            """Close the engine (its whole trace checked) and raise what was found."""
            failing = sys.exc_info()[1]  # teardown runs in Hypothesis' finally
            if _is_failure(failing):
                stats.failed()  # a rule raised (a driver call that timed out, an assert)
            if self.driver.is_open:
                try:
                    self._close_engine_and_check()
                except trio.TooSlowError:  # the close itself hung (the driver let go of it)
                    bound = self.driver.call_timeout_s
                    message = f"close got no answer within its {bound:.1f} s bound"
                    self._found([_engine_violation(message, "teardown")])
            if self.found and not _is_failure(failing):
                _violated(self.found)
            if self.found:  # a rule's own failure is the finding; add what the oracles saw
                note(f"and the oracles found: {InvariantViolation(self.found)}")

    EngineMachine.__name__ = EngineMachine.__qualname__ = (
        f"EngineMachine_{options.backend}_{options.mode}"
    )
    return EngineMachine


def run_engine_machine(
    options: MachineOptions,
    settings: Settings,
    *,
    stats: CampaignStats | None = None,
) -> CampaignStats:
    """Run the machine for ``options`` under ``settings`` as a test; raise on the first
    failure (Hypothesis shrinks it first).  Returns the campaign counters."""
    stats = stats if stats is not None else CampaignStats()
    if options.cache_dir is None:
        options = dataclasses.replace(options, cache_dir=tempfile.gettempdir() + "/omni-trio-fuzz")

    def scenario(driver: EngineDriver) -> None:
        machine = make_engine_machine(options, lambda: driver, stats)
        run_state_machine_as_test(machine, settings=settings)

    run_driven(scenario)
    return stats
