"""The engine core: every per-request decision, pure and synchronous (no trio, no I/O).

:class:`EngineCore` owns the scheduler and one record per admitted request.  Nothing else
changes a request's state.  The trio engine (``omni_trio.runtime.engine``) is its shell: it
turns what happens (a request is admitted, a forward returns, an output arrives, a consumer
leaves, the worker group dies, the engine closes) into *events*, calls the matching method
with the current time, and carries out the *instructions* it gets back, in order::

    event (method)                          may answer with
    ----------------------------------      ---------------------------------------------
    build_request(prompt, params, id)       (a request with an id; no state changes)
    admit(request, now)                     (the admitted request, defaults resolved)
    schedule(now, worker)                   a SchedulerOutput to execute (or None)
    runner_output(sched, result, now, w)    AwaitOutput, DropOutput, DeliverChunk,
                                            DeliverTerminal
    execution_failed(sched, error, now)     DeliverTerminal
    output_ready(rid, key, output, now)     DeliverTerminal (or DropOutput if stale)
    output_lost(rid, key, error, now)       DeliverTerminal, or nothing (requeued)
    expire(now)                             as output_lost, for outputs past their deadline
    abort(ids, now) / consumer_gone(id)     StopForwards, DropOutput, DeliverTerminal
    preempt(id, now)                        -- (a step-boundary preemption)
    begin_sleep / fell_asleep / sleep_failed -- (no waiting request starts meanwhile)
    begin_wake / woke / wake_failed         --
    group_started(info, now)                --
    group_failed(error, now)                DropOutput, DeliverTerminal (requeues the rest)
    close(now) / die(error, now)            StopForwards, DropOutput, DeliverTerminal

Every event method is a synchronous critical section that never calls out: the shell may
call it from any task of its run without locks.  Events about something that is no longer
current (an output for a request aborted meanwhile, a result for a superseded incarnation of
an id, a failure of a group already written off) are recognised by identity and answered
with the clean-up they need, never applied.

The core records the lifecycle trace itself (when given a :class:`TraceRecorder`), so the
trace is exactly the story of its decisions; ``omni_trio.testing.check_trace`` reads it.
Every request resource it holds is reported by :meth:`EngineCore.leftovers`.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from ..errors import (
    QUARANTINED_ERROR_TYPE,
    TIMEOUT_ERROR_TYPE,
    DuplicateRequestError,
    EngineAsleepError,
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    WorkerError,
)
from .cost import CostModel
from .faults import FAULTS_KEY, WARMUP_REQUEST_ID, parse_faults
from .health import (
    CANCEL_LATENCY_BUCKETS_S,
    SLEEP_LEVELS,
    TICK_BUCKETS_S,
    EngineHealth,
    EngineState,
    EngineStatistics,
    GroupState,
    PhaseSummary,
    SleepState,
    WorkerState,
    WorkerStatus,
)
from .lifecycle import RequestState, RequestStatus
from .messages import (
    BatchRunnerOutput,
    DiffusionOutput,
    RequestMetrics,
    RunnerOutput,
    SchedulerOutput,
)
from .model_info import ModelInfo
from .policy import SchedulingPolicy
from .request import (
    DiffusionRequest,
    RequestLimits,
    SamplingParams,
    canonical_lora,
    image_size,
    validate_request,
)
from .scheduler import RequestScheduler, Scheduler, StepScheduler
from .trace import TraceKind, TraceRecorder

__all__ = [
    "PAYLOAD_REJECTED",
    "QUARANTINED",
    "QUARANTINE_AFTER_CRASHES",
    "WARMUP_REQUEST_ID",
    "WORKER_FAILED",
    "AwaitOutput",
    "build_request",
    "check_admission",
    "CoreConfig",
    "DeliverChunk",
    "DeliverTerminal",
    "DropOutput",
    "EngineCore",
    "Instruction",
    "StopForwards",
]

_S = RequestStatus
_K = TraceKind
# error_type of a request that failed because its worker group failed and its retries ran out
# (retryable: the request itself was fine).
WORKER_FAILED = "WorkerFailedError"
# error_type of a request failed for good because its worker group failed under it
# QUARANTINE_AFTER_CRASHES times (the default of ``quarantine_after_crashes``; after the
# first it runs alone): it is the likely cause, so it is never run again (not retryable), and
# a crash loop cannot form.
QUARANTINED = QUARANTINED_ERROR_TYPE
QUARANTINE_AFTER_CRASHES = 2
# error_type of a request whose payload the executor could not send to its workers (say, a
# value its wire codec cannot encode): the request's own fault, never the group's.
PAYLOAD_REJECTED = "InvalidRequestError"
_TIMING_WINDOW = 1024
# The weight of each new measurement in a size's moving average of its step time.
STEP_TIME_ALPHA = 0.2
_PHASES = ("queue_wait", "execution", "postprocess", "end_to_end")


@dataclass(frozen=True, slots=True)
class CoreConfig:
    """The knobs the core decides with (the shell builds it from ``EngineConfig``)."""

    step_execution: bool = False
    max_num_seqs: int = 1
    request_batch_max_wait_ms: float = 0.0
    streaming_output: bool = False
    preview_interval: int = 1
    limits: RequestLimits = field(default_factory=RequestLimits)
    max_retries_on_worker_failure: int = 1
    # After this many group failures under it a request is quarantined (None: never).
    quarantine_after_crashes: int | None = QUARANTINE_AFTER_CRASHES
    fault_injection: bool = False
    # How long a PACKING request may wait for its output (INV-6), seconds.
    output_timeout_s: float = 600.0
    # The compute budget (see .cost): with a cost model, a request estimated over either
    # is refused at admission (None: no limit).
    max_request_s: float | None = None
    max_step_s: float | None = None
    # Who runs next (see EngineConfig.scheduling_policy).
    scheduling_policy: str = "fifo"
    priority_aging_ticks: int = 16
    fair_quantum: int | None = None
    # Step mode, "priority": preempted requests whose step state the workers keep; past it a
    # preempted request gives its state up and restarts from step 0 (same seed, same image).
    max_preempted_states: int = 16
    # Refuse admissions while the engine sleeps (EngineAsleepError) instead of queueing them.
    reject_while_asleep: bool = False
    # The LoRA adapters requests may name (EngineConfig.loras); more is refused at admission.
    lora_names: frozenset[str] = frozenset()
    max_loras: int = 4
    # The scheduler class (EngineConfig.scheduler_cls, resolved): a subclass of the mode's
    # scheduler (RequestScheduler, or StepScheduler with step_execution); None: that one.
    scheduler_cls: type[Scheduler] | None = None


# -- instructions ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeliverChunk:
    """Send a non-terminal chunk (a streaming preview) on the request's stream."""

    request_id: str
    output: DiffusionOutput


@dataclass(frozen=True, slots=True)
class DeliverTerminal:
    """Send the request's terminal output on its stream and close the stream.  Only issued
    while the request's consumer is there; its state is already released."""

    request_id: str
    output: DiffusionOutput


@dataclass(frozen=True, slots=True)
class AwaitOutput:
    """The request is PACKING: ask the executor for the output announced as ``key`` and
    report it back as :meth:`EngineCore.output_ready` (or ``output_lost``)."""

    request_id: str
    key: str


@dataclass(frozen=True, slots=True)
class DropOutput:
    """Nobody will take the output announced as ``key``: release it now, or when it arrives
    (and stop waiting for it).  ``request_id`` names its owner, for the record."""

    key: str
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class StopForwards:
    """Set the stop flags of these running requests: their forward stops at its next step
    boundary (once every request of a fused batch is stopped)."""

    request_ids: tuple[str, ...]


Instruction = DeliverChunk | DeliverTerminal | AwaitOutput | DropOutput | StopForwards


@dataclass(slots=True, eq=False)
class _Entry:
    """The core's record of one admitted request (next to its scheduler state)."""

    state: RequestState
    # The consumer is still reading the stream (False once it left: nothing is delivered).
    consumer: bool = True
    # Counted in the statistics (warmup traffic is not).
    counted: bool = True
    chunks_sent: int = 0
    # The total_chunks every preview announces; fixed at the first preview.
    total_chunks: int | None = None
    # PACKING: the output it waits for, until when, and the timings its compute reported.
    output_key: str | None = None
    output_deadline: float | None = None
    compute_timings: Mapping[str, float] = field(default_factory=dict)
    # Admission number: names this admission in the deadline heap (an id may be reused).
    admission: int = -1


def _picture_size(
    picture: tuple[int, int], height: int | None, width: int | None
) -> tuple[int, int]:
    """A picture-conditioned request's size: what it gives, the other side following the
    picture's aspect ratio, or the picture's own; each rounded down to a multiple of 8."""
    image_width, image_height = picture
    if height is None and width is None:
        return image_height // 8 * 8, image_width // 8 * 8
    if height is None:
        assert width is not None
        return max(8, round(image_height * width / image_width) // 8 * 8), width
    if width is None:
        return height, max(8, round(image_width * height / image_height) // 8 * 8)
    return height, width


def build_request(
    prompt_or_request: str | DiffusionRequest,
    params: SamplingParams | None,
    request_id: str | None,
    *,
    new_id: Callable[[], str],
) -> DiffusionRequest:
    """A request from a prompt (or a request with ``params``/``request_id`` applied);
    ``new_id()`` names it when it has no id.  Raises :class:`InvalidRequestError` for a
    prompt that is not a string."""
    if isinstance(prompt_or_request, DiffusionRequest):
        request = prompt_or_request
        if params is not None:
            request = request.replace(sampling=params)
        if request_id is not None:
            request = request.replace(request_id=request_id)
    else:
        if not isinstance(prompt_or_request, str):
            raise InvalidRequestError(
                f"prompt must be a string, not {type(prompt_or_request).__name__}",
                param="prompt",
            )
        request = DiffusionRequest(
            prompt_or_request,
            params if params is not None else SamplingParams(),
            request_id if request_id is not None else new_id(),
        )
    if not request.request_id:
        request = request.replace(request_id=new_id())
    return request


def check_admission(
    request: DiffusionRequest,
    config: CoreConfig,
    *,
    model_info: ModelInfo | None,
    cost_model: CostModel | None,
    sleep_state: SleepState,
    seeds: random.Random,
) -> DiffusionRequest:
    """Everything admission checks and fills in but what needs the core's records (the
    engine being open, a duplicate id): pure, so a caller on the far side of a process
    boundary (:mod:`omni_trio.runtime.stage`) decides as the core will.  Returns the request
    with the model's default size and a seed from ``seeds`` when it had none; raises
    :class:`EngineAsleepError` (``reject_while_asleep``) or :class:`InvalidRequestError`."""
    if config.reject_while_asleep and sleep_state is not SleepState.AWAKE:
        raise EngineAsleepError(
            f"the engine is {sleep_state.value.replace('_', ' ')} and refuses "
            "requests until it is awake (reject_while_asleep)"
        )
    validate_request(request, config.limits)
    request = _resolve_defaults(request, config, model_info, seeds)
    _check_cost(request, config, cost_model)
    if FAULTS_KEY in request.sampling.extra_args:
        _check_faults(request, config)
    return request


def _resolve_defaults(
    request: DiffusionRequest,
    config: CoreConfig,
    info: ModelInfo | None,
    seeds: random.Random,
) -> DiffusionRequest:
    """Resolving the size here means a request that leaves it unset and one that asks
    for the default explicitly share a compatibility key."""
    sp = request.sampling
    changes: dict[str, Any] = {}
    lora = canonical_lora(sp.lora)
    if lora != sp.lora:
        changes["lora"] = lora
    if lora and len(lora) > config.max_loras:
        raise InvalidRequestError(
            f"{len(lora)} LoRA adapters asked for; at most {config.max_loras} (max_loras) at once",
            param="lora",
        )
    if info is not None:
        info.check_extra_args(sp.extra_args)
        info.check_conditioning(sp)
        info.check_lora(lora, config.lora_names)
        height, width = sp.height, sp.width
        picture = image_size(sp.image) if sp.image is not None else None
        derived = picture is not None and (height is None or width is None)
        if picture is not None:
            height, width = _picture_size(picture, height, width)
        try:
            height, width = info.resolve_size(height, width)
        except InvalidRequestError as exc:
            if not derived or picture is None:
                raise
            raise InvalidRequestError(
                f"{exc} (the size comes from the image, {picture[0]}x{picture[1]}: pass "
                "height and width, the image is resized to them)",
                param="image",
            ) from None
        if height != sp.height:
            changes["height"] = height
        if width != sp.width:
            changes["width"] = width
    if sp.seed is None:
        changes["seed"] = seeds.randrange(2**31)
    if not changes:
        return request
    request = request.replace(sampling=sp.replace(**changes))
    validate_request(request, config.limits)  # the filled-in size obeys the limits too
    return request


def _check_cost(request: DiffusionRequest, config: CoreConfig, cost: CostModel | None) -> None:
    """Refuse a request estimated over the compute budget (``RequestTooCostlyError``)."""
    if cost is None or (config.max_request_s is None and config.max_step_s is None):
        return
    sp = request.sampling
    if sp.height is None or sp.width is None:  # no model info yet: nothing to scale
        return
    cost.check(
        sp.height,
        sp.width,
        sp.total_steps,
        sp.num_outputs_per_prompt,
        max_request_s=config.max_request_s,
        max_step_s=config.max_step_s,
    )


def _check_faults(request: DiffusionRequest, config: CoreConfig) -> None:
    """Fault injection only where the config allows it, and only well-formed."""
    if not config.fault_injection:
        raise InvalidRequestError(
            "extra_args['faults'] asks for fault injection, which this engine does not "
            "allow (EngineConfig.fault_injection=False)",
            param="extra_args",
        )
    try:
        parse_faults(request.sampling.extra_args)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="extra_args") from exc


class EngineCore:
    """The engine's one lifecycle owner; see the module docstring for its events.

    ``trace`` records every lifecycle event; ``id_prefix`` and ``seed`` make generated request
    ids and seeds unique per engine and reproducible per core (the shell passes random ones).
    """

    def __init__(
        self,
        config: CoreConfig | None = None,
        *,
        trace: TraceRecorder | None = None,
        id_prefix: str = "core",
        seed: int = 0,
    ) -> None:
        self.config = config = config if config is not None else CoreConfig()
        policy = cast(SchedulingPolicy, config.scheduling_policy)
        aging, quantum = config.priority_aging_ticks, config.fair_quantum
        custom = config.scheduler_cls
        base = StepScheduler if config.step_execution else RequestScheduler
        if custom is not None and not (isinstance(custom, type) and issubclass(custom, base)):
            raise ValueError(
                f"scheduler_cls must be a subclass of {base.__name__} in {base.mode} mode, "
                f"got {custom!r}"
            )
        self.scheduler: Scheduler = (
            cast(type[StepScheduler], custom or StepScheduler)(
                config.max_num_seqs, policy=policy, aging_ticks=aging, fair_quantum=quantum
            )
            if config.step_execution
            else cast(type[RequestScheduler], custom or RequestScheduler)(
                config.max_num_seqs,
                config.request_batch_max_wait_ms,
                policy=policy,
                aging_ticks=aging,
                fair_quantum=quantum,
            )
        )
        self.trace = trace
        # Invariant: one entry per admitted, non-terminal request, keyed by id; its state is
        # the scheduler's.  Terminal requests have neither an entry nor scheduler state.
        self._entries: dict[str, _Entry] = {}
        # The scheduler output being executed, with the states it scheduled (at most one).
        self._dispatch: SchedulerOutput | None = None
        self._dispatch_states: dict[str, RequestState] = {}
        # PACKING deadlines: (deadline, seq, request id, key); stale ones are skipped lazily.
        self._deadlines: list[tuple[float, int, str, str]] = []
        self._deadline_seq = itertools.count()
        # Requests' own deadlines (SamplingParams.deadline_s): (at, seq, request id, state
        # identity); stale ones (the request ended, or its id was reused) skipped lazily.
        self._request_deadlines: list[tuple[float, int, str]] = []
        # PREEMPTED requests whose step state the workers may still hold (pruned lazily).
        self._preempted_kept: set[str] = set()
        self.model_info: ModelInfo | None = None
        # Measured at warmup (the shell's calibration); kept across group restarts.
        self.cost_model: CostModel | None = None
        # Whether the last failure (of a group, or of a start) is excused: not the sign of a
        # crash loop, so the supervisor restarts at once, uncounted (see group_failed).
        self.failure_excused = False
        self._blamed = 0
        self._spared = 0
        # Set when a request completes; spent by a failure it excuses (see group_failed).
        self._progress_credit = False
        self.group = GroupState.STARTING
        self.generation = 0
        self.closed = False
        self.dead: BaseException | None = None
        self.last_failure: str | None = None
        self.last_failed_rank: int | None = None
        self._admitted = 0
        self._requeued = 0
        self._finished_counts = {s: 0 for s in _S if s.finished}
        # Diffusion accounting (EngineStatistics): dispatches by size, aborts of requests in
        # the dispatch in flight (id -> when; measured when it settles), and wasted steps.
        self._batch_sizes: collections.Counter[int] = collections.Counter()
        self._stopping: dict[str, float] = {}
        self._cancel_counts = [0] * (len(CANCEL_LATENCY_BUCKETS_S) + 1)
        self._cancel_sum_s = 0.0
        self._wasted_steps = 0
        # Step mode: tick times (dispatch to result) by bucket, and when the dispatch in
        # flight was scheduled.
        self._tick_counts = [0] * (len(TICK_BUCKETS_S) + 1)
        self._tick_sum_s = 0.0
        self._dispatched_at = 0.0
        # pixels per image -> seconds per denoising step of one image (moving average).
        self._step_times: dict[int, float] = {}
        self._timings: dict[str, deque[float]] = {k: deque(maxlen=_TIMING_WINDOW) for k in _PHASES}
        self._id_prefix = id_prefix
        self._ids = itertools.count(1)
        self._seeds = random.Random(seed)
        # Sleep and wake (see begin_sleep): the state, the level slept at (0: awake), what
        # it was before a sleep or wake began (restored if that fails), and completed sleeps.
        self.sleep_state = SleepState.AWAKE
        self.sleep_level = 0
        self._sleep_before: tuple[SleepState, int] = (SleepState.AWAKE, 0)
        self._sleeps = 0

    # -- queries -------------------------------------------------------------------------

    @property
    def mode(self) -> str:
        return self.scheduler.mode

    @property
    def accepting(self) -> bool:
        """New requests may be admitted (neither closed nor dead)."""
        return not self.closed and self.dead is None

    def has_work(self) -> bool:
        """The loop has something to execute: a running request, a queued one that may start
        (a suspect waits until nothing else is in flight), or (step mode) finished ids the
        workers must hear about.  Otherwise the loop sleeps until the core changes."""
        if self.group is not GroupState.RUNNING:
            return False
        scheduler = self.scheduler
        if scheduler.has_schedulable_work():
            return True
        return self.config.step_execution and scheduler.has_finished_to_report()

    def admission_wait(self, now: float) -> float | None:
        """None: schedule now; a time: the scheduler coalesces a wave until then."""
        return self.scheduler.admission_wait(now)

    @property
    def dispatch(self) -> SchedulerOutput | None:
        """The scheduler output being executed now, if any."""
        return self._dispatch

    def in_flight_ids(self) -> frozenset[str]:
        """Ids scheduled in the forward being executed now."""
        return frozenset(self._dispatch_states)

    def is_live(self, request_id: str) -> bool:
        return request_id in self._entries

    def status_of(self, request_id: str) -> RequestStatus | None:
        entry = self._entries.get(request_id)
        return entry.state.status if entry is not None else None

    def awaited_outputs(self) -> dict[str, str]:
        """Output key -> request id, for every PACKING request."""
        return {e.output_key: rid for rid, e in self._entries.items() if e.output_key}

    def next_deadline(self) -> float | None:
        """When :meth:`expire` next has something to do (None: nothing is timed): a
        PACKING output's deadline or a request's ``deadline_s``, whichever comes first."""
        heap = self._deadlines
        while heap:
            deadline, _, rid, key = heap[0]
            if self._awaits(rid, key, deadline):
                break
            heapq.heappop(heap)
        own = self._request_deadlines
        while own and not self._times_out(own[0][2], own[0][1]):
            heapq.heappop(own)
        times = [h[0][0] for h in (heap, own) if h]
        return min(times) if times else None

    def _times_out(self, request_id: str, admission: int) -> bool:
        entry = self._entries.get(request_id)
        return entry is not None and entry.admission == admission

    def _awaits(self, request_id: str, key: str, deadline: float) -> bool:
        entry = self._entries.get(request_id)
        return entry is not None and entry.output_key == key and entry.output_deadline == deadline

    def awaits(self, request_id: str, key: str) -> bool:
        """Whether ``request_id`` waits for the output ``key`` now."""
        entry = self._entries.get(request_id)
        return entry is not None and entry.output_key == key

    def open_consumers(self) -> int:
        return sum(1 for e in self._entries.values() if e.consumer)

    def leftovers(self) -> dict[str, set[str]]:
        """The request resources the core holds, by kind, as owning request ids.

        ``requests``: admitted and not terminal; ``scheduler_states``: states the scheduler
        still holds; ``streams``: requests whose consumer the core will deliver to;
        ``awaited_outputs``: PACKING requests.  After a clean close everything is empty, and
        at any time nothing here belongs to a terminal request (INV-3).
        """
        scheduler = self.scheduler
        held = set(scheduler.live_request_ids())
        held.update(scheduler.pending_finished_request_ids())
        return {
            "requests": set(self._entries),
            "scheduler_states": held,
            "streams": {rid for rid, e in self._entries.items() if e.consumer},
            "awaited_outputs": {rid for rid, e in self._entries.items() if e.output_key},
        }

    # -- admission -----------------------------------------------------------------------

    def check_open(self) -> None:
        """Raise :class:`EngineDeadError` if the engine died, :class:`EngineClosedError` if
        it was closed."""
        if self.dead is not None:
            raise EngineDeadError(
                f"engine is dead: {type(self.dead).__name__}: {self.dead}"
            ) from self.dead
        if self.closed:
            raise EngineClosedError("engine is closed")

    def new_request_id(self) -> str:
        return f"req-{self._id_prefix}-{next(self._ids)}"

    def build_request(
        self,
        prompt_or_request: str | DiffusionRequest,
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> DiffusionRequest:
        """A request from a prompt (or a request with ``params``/``request_id`` applied); an
        id is generated when none is given (see :func:`build_request`)."""
        return build_request(prompt_or_request, params, request_id, new_id=self.new_request_id)

    def admit(
        self, request: DiffusionRequest, now: float, *, counted: bool = True
    ) -> DiffusionRequest:
        """Admit ``request`` as WAITING; returns it with what admission decides filled in
        (the model's default size, a random seed when it has none).

        Raises :class:`InvalidRequestError` or :class:`DuplicateRequestError` before anything
        is admitted, :class:`EngineClosedError` / :class:`EngineDeadError` when the engine no
        longer accepts work.  ``counted=False`` keeps it out of the statistics (warmup).
        """
        self.check_open()
        request = check_admission(
            request,
            self.config,
            model_info=self.model_info,
            cost_model=self.cost_model,
            sleep_state=self.sleep_state,
            seeds=self._seeds,
        )
        rid = request.request_id
        if rid in self._entries:
            raise DuplicateRequestError(rid)
        state = self.scheduler.add_request(request, now)
        admission = next(self._deadline_seq)
        self._entries[rid] = _Entry(state, counted=counted, admission=admission)
        if request.sampling.deadline_s is not None:
            own = self._request_deadlines
            if len(own) > 2 * len(self._entries) + 64:  # mostly ended requests: compact
                own[:] = [d for d in own if self._times_out(d[2], d[1])]
                heapq.heapify(own)
            at = now + request.sampling.deadline_s
            heapq.heappush(own, (at, admission, rid))
        if counted:
            self._admitted += 1
        if self.trace is not None:
            self._record(
                now,
                _K.ADMIT,
                rid,
                detail={
                    "seed": request.sampling.seed,
                    "steps": state.total_steps or request.sampling.total_steps,
                    "mode": self.scheduler.mode,
                },
            )
        return request

    # -- execution -----------------------------------------------------------------------

    def schedule(self, now: float, *, worker: int | None = None) -> SchedulerOutput | None:
        """The next scheduler output to execute (on ``worker``, for the record), or None.

        Step mode with nothing to run but finished ids to report gives an output that only
        evicts them.  The output is in flight until :meth:`runner_output` (or
        :meth:`execution_failed`, or a group failure) settles it; raises ``RuntimeError`` if
        one is in flight already.
        """
        if self._dispatch is not None:
            raise RuntimeError("a scheduler output is already being executed")
        self._stopping.clear()  # of a dispatch written off: its compute's end is unknown
        if not self.has_work():
            return None
        # A step boundary: under "priority" a better waiting request preempts worse running
        # ones (they keep their progress and their workers' step state, and their place).
        for rid in self.scheduler.preemption_victims():
            self.preempt(rid, now, reason="priority")
        sched_out = self.scheduler.schedule(now)
        if sched_out.is_empty and not sched_out.finished_req_ids:
            return None
        states = self._dispatch_states
        for rid in sched_out.scheduled_request_ids:
            state = self.scheduler.get_request_state(rid)
            assert state is not None
            states[rid] = state
        self._dispatch = sched_out
        self._dispatched_at = now
        if sched_out.scheduled_request_ids:
            self._batch_sizes[len(sched_out.scheduled_request_ids)] += 1
        if self.trace is not None:
            step = sched_out.step_id
            for rid in sched_out.scheduled_request_ids:
                self._record(now, _K.SCHEDULE, rid, step_id=step)
                self._record(now, _K.EXEC_START, rid, step_id=step, worker=worker)
        return sched_out

    def _take_dispatch(self, sched_out: SchedulerOutput) -> dict[str, RequestState] | None:
        if self._dispatch is not sched_out:
            return None  # written off meanwhile (group failure, close): results not trusted
        states = self._dispatch_states
        self._dispatch = None
        self._dispatch_states = {}
        return states

    def runner_output(
        self,
        sched_out: SchedulerOutput,
        result: BatchRunnerOutput,
        now: float,
        *,
        worker: int | None = None,
    ) -> list[Instruction]:
        """The executor ran ``sched_out`` and answered ``result`` (keyed by request id).

        Requests that finished move to their terminal state; a request whose output is
        announced but not in hand moves to PACKING (:class:`AwaitOutput`).  Results for
        anything that is no longer the scheduled, running incarnation (aborted meanwhile,
        never scheduled) are not applied, and any output they announce is dropped.
        """
        out: list[Instruction] = []
        states = self._take_dispatch(sched_out)
        if states is None:
            self._drop_announced(result, out)
            return out
        if self.trace is not None:
            # Every scheduled id, and any id the executor answered for on its own (INV-2).
            for rid in dict.fromkeys((*sched_out.scheduled_request_ids, *result.outputs)):
                self._record(
                    now,
                    _K.EXEC_RESULT,
                    rid,
                    step_id=sched_out.step_id,
                    worker=worker,
                    detail=_result_detail(result.get(rid), lost=rid in result.lost),
                )
        if self.config.step_execution and sched_out.scheduled_request_ids:
            tick = max(0.0, now - self._dispatched_at)
            self._tick_counts[bisect.bisect_left(TICK_BUCKETS_S, tick)] += 1
            self._tick_sum_s += tick
        if result.lost:
            self._rows_lost(sched_out, states, result, now, out)
        self._account(states, result, now)
        self._time_steps(sched_out, states, result, now)
        finished = self.scheduler.update_from_output(sched_out, result, now)
        entries = self._entries
        for rid in sched_out.scheduled_request_ids:
            state = states[rid]
            if state.status is _S.PACKING:
                entry = entries[rid]
                if entry.output_key is None:
                    runner = result.get(rid)
                    assert runner is not None and runner.async_output_id is not None
                    self._await(entry, runner, now, out)
        self._drop_announced(result, out)
        if self.config.step_execution:
            self._emit_chunks(sched_out, result, states, set(finished), now, out)
        for rid in finished:
            done = entries.get(rid)
            if done is not None and done.state is states[rid]:
                self._terminal(done, result.get(rid), now, out)
        return out

    def _rows_lost(
        self,
        sched_out: SchedulerOutput,
        states: dict[str, RequestState],
        result: BatchRunnerOutput,
        now: float,
        out: list[Instruction],
    ) -> None:
        """Scheduled requests whose data-parallel rank died under them (the other ranks
        served on): each still running goes back to the front of the queue, from step 0,
        as after a group failure (:meth:`_requeue_or_fail`: a suspect from now on, counted
        against its retries and its quarantine)."""
        entries = self._entries
        lost = [
            rid
            for rid in sched_out.scheduled_request_ids
            if rid in result.lost
            and states[rid].status is _S.RUNNING
            and (entry := entries.get(rid)) is not None
            and entry.state is states[rid]
        ]
        reason = f"its data-parallel worker died while this request ran ({result.lost_error})"
        self._requeue_or_fail(lost, reason, now, out)

    @property
    def step_times(self) -> dict[int, float]:
        """Seconds one denoising step of one image takes, by pixels per image, as measured
        (a copy): each dispatch of one size whose every request ran (no error, abort or
        loss; no warmup or calibration request, whose first forwards are cold) is timed
        from dispatch to result, over its steps (one per tick in step mode; the request's
        in request mode) times its images, and folded into a moving average (weight
        :data:`STEP_TIME_ALPHA`).  A time of the engine's throughput, not of one forward:
        a batch of two images, or two data-parallel ranks, halve it.  What the pool's
        estimates weigh a step by."""
        return dict(self._step_times)

    def _time_steps(
        self,
        sched_out: SchedulerOutput,
        states: dict[str, RequestState],
        result: BatchRunnerOutput,
        now: float,
    ) -> None:
        elapsed = now - self._dispatched_at
        if elapsed <= 0 or not states or result.lost:
            return
        sizes: set[int] = set()
        steps: set[int] = set()
        images = 0
        for rid, state in states.items():
            runner = result.get(rid)
            sampling = state.request.sampling
            if runner is None or runner.error is not None or runner.aborted:
                return  # stopped early or failed: its time says nothing of a step
            entry = self._entries.get(rid)
            if entry is None or not entry.counted:
                return  # warmup or calibration (cold), or no longer current
            if sampling.height is None or sampling.width is None:
                return
            sizes.add(int(sampling.height) * int(sampling.width))
            steps.add(1 if self.config.step_execution else sampling.total_steps)
            images += sampling.num_outputs_per_prompt
        if len(sizes) != 1 or len(steps) != 1 or images <= 0:
            return  # one size, one step count: a time per step of that size
        (pixels,), (count,) = sizes, steps
        per_step = elapsed / (max(1, count) * images)
        old = self._step_times.get(pixels)
        self._step_times[pixels] = (
            per_step if old is None else old + STEP_TIME_ALPHA * (per_step - old)
        )

    def _account(
        self, states: dict[str, RequestState], result: BatchRunnerOutput, now: float
    ) -> None:
        """A dispatch settled: the cancel latency of its members aborted meanwhile, and the
        steps it computed for requests that end aborted or failed (request mode: the
        runner's ``step_index`` of a stopped or failed forward; step mode: the tick's step,
        when it ran for a request aborted meanwhile -- steps applied before are counted at
        the request's end)."""
        request_mode = not self.config.step_execution
        for rid in states:
            runner = result.get(rid)
            aborted_at = self._stopping.pop(rid, None)
            if aborted_at is not None:
                latency = max(0.0, now - aborted_at)
                self._cancel_counts[bisect.bisect_left(CANCEL_LATENCY_BUCKETS_S, latency)] += 1
                self._cancel_sum_s += latency
            if runner is None:
                continue
            if request_mode:
                if aborted_at is not None or runner.error is not None or runner.aborted:
                    self._wasted_steps += runner.step_index or 0
            elif aborted_at is not None and not runner.aborted and runner.error is None:
                self._wasted_steps += 1

    def execution_failed(
        self, sched_out: SchedulerOutput, error: str, error_type: str, now: float
    ) -> list[Instruction]:
        """The executor raised for ``sched_out`` although its group is healthy: every
        request it scheduled that is still running ends with that error."""
        failure = BatchRunnerOutput(
            {
                rid: RunnerOutput(rid, error=error, error_type=error_type)
                for rid in sched_out.scheduled_request_ids
            }
        )
        return self.runner_output(sched_out, failure, now)

    def payload_rejected(
        self, sched_out: SchedulerOutput, error: str, now: float
    ) -> list[Instruction]:
        """The executor could not send ``sched_out`` to its workers (a payload its wire codec
        cannot carry); nothing of it reached a worker and the group is fine.

        With one new request in it, that request is the cause: it ends FINISHED_ERROR with
        the non-retryable ``InvalidRequestError``.  With several, the cause is unknown: they
        go back to the front of the queue to run alone (``solo``), where it fails by itself
        and the others run.  Requests already running (step mode) keep their progress and
        are scheduled again at the next tick."""
        out: list[Instruction] = []
        states = self._take_dispatch(sched_out)
        if states is None:
            return out
        for rid in sched_out.scheduled_request_ids:
            self._record(
                now, _K.EXEC_RESULT, rid, step_id=sched_out.step_id, detail={"outcome": "unsent"}
            )
        new = [
            data.request_id
            for data in sched_out.scheduled_new_reqs
            if states[data.request_id].status is _S.RUNNING
        ]
        if len(new) == 1:
            (rid,) = new
            self.scheduler.finish_requests(
                rid,
                _S.FINISHED_ERROR,
                now,
                error=f"its payload cannot be sent to the workers: {error}",
                error_type=PAYLOAD_REJECTED,
            )
            self._terminal(self._entries[rid], None, now, out)
            return out
        for rid in reversed(new):  # reversed: they keep their order at the queue's front
            state = states[rid]
            state.solo = True
            self.scheduler.preempt_request(rid, reset_progress=True)
            self._record(now, _K.PREEMPT, rid, detail={"progress": 0, "reason": "isolate"})
        return out

    def _drop_announced(self, result: BatchRunnerOutput, out: list[Instruction]) -> None:
        """Drop every output ``result`` announces that nobody awaits (INV-3: nothing is ever
        cached for it): its request is not the scheduled incarnation or no longer running,
        or its result also says it failed or was aborted."""
        entries = self._entries
        for rid, runner in result.outputs.items():
            key = runner.async_output_id
            if not key:
                continue
            entry = entries.get(rid)
            if entry is None or entry.output_key != key:
                out.append(DropOutput(key, rid))

    def _await(
        self, entry: _Entry, runner: RunnerOutput, now: float, out: list[Instruction]
    ) -> None:
        key = runner.async_output_id
        assert key is not None
        deadline = now + self.config.output_timeout_s
        entry.output_key = key
        entry.output_deadline = deadline
        entry.compute_timings = runner.timings
        rid = entry.state.request_id
        heapq.heappush(self._deadlines, (deadline, next(self._deadline_seq), rid, key))
        out.append(AwaitOutput(rid, key))

    def output_ready(
        self, request_id: str, key: str, output: RunnerOutput, now: float
    ) -> list[Instruction]:
        """The output announced as ``key`` arrived for PACKING ``request_id``: the request
        completes (or fails, if packing failed).  Stale arrivals change nothing."""
        entry = self._awaiting(request_id, key)
        if entry is None:
            return []
        out: list[Instruction] = []
        timings = {**entry.compute_timings, **output.timings}
        output = dataclasses.replace(output, timings=timings)
        entry.output_key = None
        if output.error is not None or output.images is None:
            self.scheduler.finish_requests(
                request_id,
                _S.FINISHED_ERROR,
                now,
                error=output.error or "async output carried no images",
                error_type=output.error_type or "MissingOutputError",
            )
        else:
            self.scheduler.finish_requests(request_id, _S.FINISHED_COMPLETED, now)
        self._terminal(entry, output, now, out)
        return out

    def output_lost(
        self,
        request_id: str,
        key: str,
        error: str,
        error_type: str,
        now: float,
        *,
        group_lost: bool = False,
    ) -> list[Instruction]:
        """The output ``key`` of PACKING ``request_id`` will not come.  ``group_lost``: it
        was lost with its worker group, so the request runs again (same seed) while its
        retry budget lasts; otherwise (or past the budget) it fails."""
        entry = self._awaiting(request_id, key)
        if entry is None:
            return []
        out: list[Instruction] = []
        entry.output_key = None
        if group_lost:
            self._requeue_or_fail(
                [request_id],
                f"the worker group failed while this request's output was packed "
                f"({error_type}: {error})",
                now,
                out,
            )
            return out
        self.scheduler.finish_requests(
            request_id, _S.FINISHED_ERROR, now, error=error, error_type=error_type
        )
        self._terminal(entry, None, now, out)
        return out

    def expire(self, now: float) -> list[Instruction]:
        """End every PACKING request whose output deadline has passed (INV-6), and abort
        every request past its own ``deadline_s`` (``FINISHED_ABORTED`` with
        ``RequestTimeoutError``; a running one's forward is told to stop, as for any abort)."""
        out: list[Instruction] = []
        own = self._request_deadlines
        late: list[str] = []
        while own and own[0][0] <= now:
            _, admission, rid = heapq.heappop(own)
            if self._times_out(rid, admission):
                late.append(rid)
        for rid in late:
            entry = self._entries.get(rid)
            if entry is None:
                continue
            limit = entry.state.request.sampling.deadline_s
            message = f"request {rid} did not finish within its deadline of {limit:g} s"
            out.extend(
                self.abort(
                    (rid,), now, reason="deadline", error=message, error_type=TIMEOUT_ERROR_TYPE
                )
            )
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, _, rid, key = heapq.heappop(heap)
            if not self._awaits(rid, key, deadline):
                continue
            message = (
                f"output {key!r} of request {rid!r} not ready "
                f"{self.config.output_timeout_s:g} s after its compute finished"
            )
            self._record(
                now, _K.STALL, detail={"phase": "output", "error": message, "request_id": rid}
            )
            out.append(DropOutput(key, rid))
            out.extend(self.output_lost(rid, key, message, "StallError", now))
        return out

    def _awaiting(self, request_id: str, key: str) -> _Entry | None:
        entry = self._entries.get(request_id)
        if entry is None or entry.output_key != key or entry.state.status is not _S.PACKING:
            return None
        return entry

    def _emit_chunks(
        self,
        sched_out: SchedulerOutput,
        result: BatchRunnerOutput,
        states: Mapping[str, RequestState],
        finished: set[str],
        now: float,
        out: list[Instruction],
    ) -> None:
        """Step mode: the non-terminal chunks (streaming previews) of this tick, each to the
        incarnation that was scheduled and is still running."""
        for rid in sched_out.scheduled_request_ids:
            if rid in finished:
                continue
            runner = result.get(rid)
            entry = self._entries.get(rid)
            if runner is None or not runner.images or entry is None or not entry.consumer:
                continue
            state = entry.state
            if state is not states[rid] or state.status not in (_S.RUNNING, _S.PREEMPTED):
                continue
            if entry.total_chunks is None:
                entry.total_chunks = self._expected_chunks(state, runner)
            # A preview is never the last chunk.
            entry.total_chunks = max(entry.total_chunks, entry.chunks_sent + 2)
            output = DiffusionOutput(
                request_id=rid,
                status=state.status,
                finished=False,
                images=runner.images,
                seed=state.request.sampling.seed,
                chunk_index=entry.chunks_sent,
                total_chunks=entry.total_chunks,
            )
            entry.chunks_sent += 1
            self._record(now, _K.CHUNK, rid, detail={"chunk_index": output.chunk_index})
            out.append(DeliverChunk(rid, output))

    def _expected_chunks(self, state: RequestState, runner: RunnerOutput) -> int:
        """Previews every ``preview_interval`` steps before the last, plus the final output,
        counted in the steps the worker runs (its report), which a model may make fewer."""
        if not self.config.streaming_output:
            return 1
        total = runner.total_steps or state.total_steps
        return (max(total, 1) - 1) // self.config.preview_interval + 1

    # -- aborts --------------------------------------------------------------------------

    def abort(
        self,
        request_ids: Iterable[str],
        now: float,
        *,
        reason: str = "api",
        error: str | None = None,
        error_type: str | None = None,
    ) -> list[Instruction]:
        """Abort live requests (unknown or finished ids are ignored).

        Each reaches FINISHED_ABORTED at once (with ``error``/``error_type`` when given,
        else ``RequestAbortedError``); a running one's forward is told to stop
        (:class:`StopForwards`) and its late result will be dropped; a PACKING one's output
        is dropped.
        """
        out: list[Instruction] = []
        stop: list[str] = []
        for rid in dict.fromkeys(request_ids):
            entry = self._entries.get(rid)
            if entry is None:
                continue
            self._record(now, _K.ABORT, rid, detail={"reason": reason})
            status = entry.state.status
            if status is _S.RUNNING:
                stop.append(rid)
                if rid in self._dispatch_states:
                    self._stopping[rid] = now
            elif status is _S.PACKING and entry.output_key is not None:
                out.append(DropOutput(entry.output_key, rid))
                entry.output_key = None
            self.scheduler.finish_requests(
                rid, _S.FINISHED_ABORTED, now, error=error, error_type=error_type
            )
            self._terminal(entry, None, now, out)
        if stop:
            out.insert(0, StopForwards(tuple(stop)))
        return out

    def preempt(self, request_id: str, now: float, *, reason: str = "api") -> bool:
        """Step-boundary preemption: a RUNNING request goes back to the queue as PREEMPTED,
        keeping its progress (its workers keep its step state), and resumes when scheduled
        again: at the front of the queue, or (``reason="priority"``, the scheduler's own
        preemption) at the place its priority and arrival give it.  Only between two
        forwards: returns False (and changes nothing) if it is not running or a forward is in
        flight."""
        entry = self._entries.get(request_id)
        requeue: Literal["front", "key"] = "key" if reason == "priority" else "front"
        if (
            self._dispatch is not None
            or entry is None
            or entry.state.status is not _S.RUNNING
            or not self.scheduler.preempt_request(request_id, requeue=requeue)
        ):
            return False
        detail: dict[str, Any] = {"progress": entry.state.num_computed_steps}
        if reason != "api":
            detail["reason"] = reason
        kept = self._preempted_kept
        kept.add(request_id)
        for rid in list(kept):  # those resumed or ended since hold nothing here any more
            state = self.scheduler.get_request_state(rid)
            if state is None or state.status is not _S.PREEMPTED or not state.sent_to_worker:
                kept.discard(rid)
        if len(kept) > self.config.max_preempted_states and self.scheduler.drop_worker_state(
            request_id
        ):
            kept.discard(request_id)
            detail["state_dropped"] = True
        self._record(now, _K.PREEMPT, request_id, detail=detail)
        return True

    # -- sleep and wake ----------------------------------------------------------------

    def begin_sleep(self, level: int, now: float) -> None:
        """The shell begins putting the workers to sleep at ``level`` (1 or 2): from now on
        no waiting request starts (nor preempts); the running ones go on.  The shell waits
        for :meth:`busy_ids` to be empty, asks the workers, then calls :meth:`fell_asleep`
        or :meth:`sleep_failed`.  Raises ``ValueError`` for another level,
        ``RuntimeError`` while a sleep or wake is already under way (the shell runs one at
        a time), and :class:`EngineClosedError` / :class:`EngineDeadError` once ended."""
        self.check_open()
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if self.sleep_state in (SleepState.FALLING_ASLEEP, SleepState.WAKING):
            raise RuntimeError(f"a sleep or wake is under way ({self.sleep_state.value})")
        self._sleep_before = (self.sleep_state, self.sleep_level)
        self.sleep_state = SleepState.FALLING_ASLEEP
        self.scheduler.holding = True
        self._record(now, _K.SLEEP, detail={"level": level, "state": "falling_asleep"})

    def busy_ids(self) -> list[str]:
        """Requests whose compute is in flight or whose output is being packed (RUNNING or
        PACKING): what falling asleep waits for."""
        scheduler = self.scheduler
        busy = set(scheduler.running_request_ids()) | set(scheduler.packing_request_ids())
        busy.update(self._dispatch_states)
        return sorted(busy)

    def fell_asleep(self, level: int, now: float) -> None:
        """Every worker released its weights at ``level``."""
        if self.sleep_state is not SleepState.FALLING_ASLEEP:
            raise RuntimeError(f"fell_asleep while {self.sleep_state.value}")
        self.sleep_state = SleepState.ASLEEP
        self.sleep_level = max(level, self._sleep_before[1])
        self._sleeps += 1
        self._record(now, _K.SLEEP, detail={"level": self.sleep_level, "state": "asleep"})

    def sleep_failed(self, now: float, error: str = "") -> None:
        """Falling asleep failed (it ran out of time, or a worker refused): back to what
        the engine was before :meth:`begin_sleep` (awake: waiting requests start again)."""
        if self.sleep_state is not SleepState.FALLING_ASLEEP:
            return
        self.sleep_state, self.sleep_level = self._sleep_before
        self.scheduler.holding = self.sleep_state is not SleepState.AWAKE
        self._record(now, _K.SLEEP, detail={"state": "failed", "error": error})

    def begin_wake(self, now: float) -> bool:
        """The shell begins waking the workers; False (nothing to do) when awake.  Raises
        ``RuntimeError`` while a sleep or wake is under way."""
        if self.sleep_state is SleepState.AWAKE:
            return False
        if self.sleep_state is not SleepState.ASLEEP:
            raise RuntimeError(f"a sleep or wake is under way ({self.sleep_state.value})")
        self._sleep_before = (self.sleep_state, self.sleep_level)
        self.sleep_state = SleepState.WAKING
        self._record(now, _K.WAKE, detail={"state": "waking"})
        return True

    def woke(self, now: float) -> None:
        """Every worker has its weights back: waiting requests start again."""
        if self.sleep_state is not SleepState.WAKING:
            raise RuntimeError(f"woke while {self.sleep_state.value}")
        self.sleep_state, self.sleep_level = SleepState.AWAKE, 0
        self.scheduler.holding = False
        self._record(now, _K.WAKE, detail={"state": "awake"})

    def wake_failed(self, now: float, error: str = "") -> None:
        """Waking failed: the engine is asleep still (wake_up may be tried again)."""
        if self.sleep_state is not SleepState.WAKING:
            return
        self.sleep_state, self.sleep_level = self._sleep_before
        self._record(now, _K.WAKE, detail={"state": "failed", "error": error})

    def consumer_gone(self, request_id: str, now: float) -> list[Instruction]:
        """The consumer stopped reading: nothing more is delivered and the request is
        aborted."""
        entry = self._entries.get(request_id)
        if entry is None or not entry.consumer:
            return []
        entry.consumer = False
        self._record(now, _K.CONSUMER_DROP, request_id)
        return self.abort((request_id,), now, reason="consumer")

    # -- the worker group ----------------------------------------------------------------

    def _restarts(self, restarts: int | None) -> int:
        """The supervisor's count when the shell has it (restarts made, failed starts
        included); else the groups started after the first."""
        return max(0, self.generation - 1) if restarts is None else restarts

    def group_started(self, info: ModelInfo | None, now: float) -> None:
        """A worker group is up (the first, or a restart): requests may run again."""
        first = self.generation == 0
        self.generation += 1
        if info is not None:
            self.model_info = info
        if not self.accepting:
            return
        self.group = GroupState.RUNNING
        if not first:
            self._record(now, _K.RESTART, detail={"generation": self.generation})

    def group_failed(
        self,
        error: str,
        error_type: str,
        now: float,
        *,
        rank: int | None = None,
        stall_phase: str | None = None,
    ) -> list[Instruction]:
        """The running worker group failed closed (once per group; later reports of the
        same failure change nothing).

        The forward in flight is written off.  Its requests and every PACKING request go
        back to the front of the queue while their retry budget lasts, and otherwise end
        FINISHED_ERROR with the retryable ``WorkerFailedError``.  Waiting requests stay.
        ``failure_excused`` says afterwards whether the supervisor may restart at once,
        uncounted: when the failure took down only requests it quarantined (its cause is
        gone with them), or when a request has completed since the last failure excused this
        way (a group that was serving, not a crash loop; every request it took down now runs
        alone, so a repeat is quarantined).  A group that fails again and again with nothing
        completed in between still meets the backoff and the restart limit.
        """
        if self.group is not GroupState.RUNNING:
            return []
        self.group = GroupState.RESTARTING
        self.last_failure = f"{error_type}: {error}"
        self.last_failed_rank = rank
        self._record(
            now,
            _K.CRASH,
            worker=rank,
            detail={"generation": self.generation, "error_type": error_type, "error": error},
        )
        if stall_phase is not None:
            self._record(now, _K.STALL, detail={"phase": stall_phase, "error": error})
        self._dispatch = None
        self._dispatch_states = {}
        out: list[Instruction] = []
        scheduler = self.scheduler
        packing = scheduler.packing_request_ids()
        for rid in packing:
            entry = self._entries[rid]
            if entry.output_key is not None:
                out.append(DropOutput(entry.output_key, rid))
                entry.output_key = None
        # Step state the failed group held for requests preempted at a step boundary is gone
        # too: they start again from step 0, with their payload (no retry is used up).
        scheduler.forget_worker_state()
        reason = f"the worker group failed while this request ran ({error_type}: {error})"
        # Packing requests ran before the running ones: requeue them last so they end up first.
        self._blamed = self._spared = 0
        self._requeue_or_fail(scheduler.running_request_ids(), reason, now, out)
        self._requeue_or_fail(packing, reason, now, out)
        # Attributed: the failure took down only requests it quarantined (each had already
        # failed a group and ran alone), so restarting at once cannot loop on it.  Otherwise
        # a completion since the last failure excused by progress excuses this one, once: a
        # request-shaped failure costs each request at most two restarts, and progress (not
        # time) is what a crash loop lacks.
        attributed = self._blamed > 0 and self._spared == 0
        after_progress = not attributed and self._progress_credit
        if after_progress:
            self._progress_credit = False
        self.failure_excused = attributed or after_progress
        return out

    def start_failed(self, error: str, error_type: str) -> None:
        """A restart's start failed (a worker died or hung while starting; the supervisor
        tries again): health reports it as the last failure.  Nothing else changes: the
        queue waits for the group that starts."""
        if self.group is GroupState.RESTARTING:
            self.last_failure = f"{error_type}: {error}"
            self.failure_excused = False

    def _requeue_or_fail(
        self, request_ids: Sequence[str], reason: str, now: float, out: list[Instruction]
    ) -> None:
        """The worker group failed under ``request_ids``.  Each is a suspect from now on and
        runs alone.  One whose group has now failed under it ``quarantine_after_crashes``
        times is quarantined (FINISHED_ERROR, not retryable); the others go back to the front of
        the queue (reverse order keeps their order) while retries last, else end
        FINISHED_ERROR, retryable."""
        budget = self.config.max_retries_on_worker_failure
        quarantine = self.config.quarantine_after_crashes
        failed: list[tuple[str, str, str]] = []
        for rid in reversed(request_ids):
            entry = self._entries[rid]
            state = entry.state
            state.num_crashes += 1
            state.solo = True
            if quarantine is not None and state.num_crashes >= quarantine:
                message = (
                    f"quarantined: its worker group failed each of the {state.num_crashes} "
                    f"times it ran, so it is not run again (the last: {reason})"
                )
                failed.append((rid, message, QUARANTINED))
                self._blamed += 1
                continue
            self._spared += 1
            if state.num_retries < budget and self.accepting:
                state.num_retries += 1
                self._requeued += 1
                self.scheduler.preempt_request(rid, reset_progress=True)
                self._record(now, _K.REQUEUE, rid, detail={"retry": state.num_retries})
            else:
                failed.append((rid, f"{reason}; retries exhausted", WORKER_FAILED))
        for rid, message, error_type in reversed(failed):
            entry = self._entries[rid]
            self.scheduler.finish_requests(
                rid, _S.FINISHED_ERROR, now, error=message, error_type=error_type
            )
            self._terminal(entry, None, now, out)

    # -- ending --------------------------------------------------------------------------

    def close(self, now: float) -> list[Instruction]:
        """The owner closes the engine: every live request ends FINISHED_ABORTED with
        ``EngineClosedError``; nothing is admitted from now on.  Idempotent."""
        if self.closed:
            return []
        self.closed = True
        self._record(now, _K.CLOSE)
        if self.dead is not None:
            return []
        self.group = GroupState.STOPPED
        return self._terminate_all(
            _S.FINISHED_ABORTED, "engine is closed", "EngineClosedError", now
        )

    def die(self, error: BaseException, now: float) -> list[Instruction]:
        """Something the engine cannot recover from happened (the supervisor gave up, a bug
        in the loop): every live request ends FINISHED_ERROR with ``EngineDeadError``."""
        if self.dead is not None or self.closed:
            return []
        self.dead = error
        self.group = GroupState.FAILED
        text = f"{type(error).__name__}: {error}"
        self._record(now, _K.DEAD, detail={"error": text})
        return self._terminate_all(
            _S.FINISHED_ERROR, f"engine died: {text}", "EngineDeadError", now
        )

    def _terminate_all(
        self, status: RequestStatus, message: str, error_type: str, now: float
    ) -> list[Instruction]:
        out: list[Instruction] = []
        self._dispatch = None
        self._dispatch_states = {}
        scheduler = self.scheduler
        running = scheduler.running_request_ids()
        if running:
            out.append(StopForwards(tuple(running)))
        live = scheduler.live_request_ids()
        for rid in live:
            entry = self._entries[rid]
            if entry.output_key is not None:
                out.append(DropOutput(entry.output_key, rid))
                entry.output_key = None
        scheduler.finish_requests(live, status, now, error=message, error_type=error_type)
        for rid in live:
            self._terminal(self._entries[rid], None, now, out)
        return out

    # -- the one terminal path -----------------------------------------------------------

    def _terminal(
        self, entry: _Entry, runner: RunnerOutput | None, now: float, out: list[Instruction]
    ) -> None:
        """Every request ends here (INV-1, INV-3): count it, build its terminal output,
        release all its state, and deliver (if its consumer is there)."""
        state = entry.state
        rid = state.request_id
        status = state.status
        assert status.finished, status
        self.scheduler.pop_request_state(rid)
        del self._entries[rid]
        if entry.counted:
            self._finished_counts[status] += 1
        completed = status is _S.FINISHED_COMPLETED
        if not completed:
            self._wasted_steps += state.num_computed_steps  # step mode's applied steps
        if completed:
            self._progress_credit = True
        images: tuple[Any, ...] = ()
        if completed and runner is not None and runner.images:
            images = runner.images
        output = DiffusionOutput(
            request_id=rid,
            status=status,
            finished=True,
            images=images,
            error=None if completed else state.error,
            error_type=None if completed else state.error_type,
            seed=state.request.sampling.seed,
            metrics=self._metrics(state, runner, now, count=entry.counted and completed),
        )
        if entry.chunks_sent:
            # The terminal output is always the last chunk.  For a completed request this is
            # what its previews announced; an aborted or failed one ends early.
            output = dataclasses.replace(
                output, chunk_index=entry.chunks_sent, total_chunks=entry.chunks_sent + 1
            )
        if self.trace is not None:
            self._record(
                now,
                _K.TERMINAL,
                rid,
                detail={"status": status.name, "error_type": output.error_type},
            )
            self._record(
                now, _K.OUTPUT, rid, detail={"status": status.name, "delivered": entry.consumer}
            )
            self._record(now, _K.CLEANUP, rid)
        if entry.consumer:
            out.append(DeliverTerminal(rid, output))

    def _metrics(
        self, state: RequestState, runner: RunnerOutput | None, now: float, *, count: bool
    ) -> RequestMetrics:
        end = now if state.finished_at is None else max(state.finished_at, now)
        started = state.first_scheduled_at
        queue_wait = ((started if started is not None else end) - state.queued_at) * 1000.0
        timings = runner.timings if runner is not None else {}
        execution = timings.get("forward_ms")
        if execution is None:
            execution = (end - started) * 1000.0 if started is not None else 0.0
        metrics = RequestMetrics(
            queue_wait_ms=queue_wait,
            execution_ms=execution,
            postprocess_ms=timings.get("postprocess_ms", 0.0),
            e2e_ms=(end - state.queued_at) * 1000.0,
            step_ms=timings.get("step_ms"),
        )
        if count:
            t = self._timings
            t["queue_wait"].append(metrics.queue_wait_ms)
            t["execution"].append(metrics.execution_ms)
            t["postprocess"].append(metrics.postprocess_ms)
            t["end_to_end"].append(metrics.e2e_ms)
        return metrics

    # -- health and statistics -----------------------------------------------------------

    def worker_view(self, workers: Iterable[WorkerState]) -> tuple[WorkerState, ...]:
        """The executor's worker snapshot as the engine reports it: between two groups
        every worker of the failed one is "restarting"."""
        if self.group is GroupState.RESTARTING:
            return tuple(dataclasses.replace(w, state=WorkerStatus.RESTARTING) for w in workers)
        return tuple(workers)

    def health(
        self, workers: Iterable[WorkerState] = (), restarts: int | None = None
    ) -> EngineHealth:
        """Never ``healthy`` unless the group is running (no worker gone or restarting).
        ``workers`` and ``restarts`` are the executor's and the supervisor's own counts."""
        reason: str | None = None
        if self.dead is not None:
            state = EngineState.DEAD
            reason = f"{type(self.dead).__name__}: {self.dead}"
        elif self.closed:
            state, reason = EngineState.CLOSED, "engine is closed"
        elif self.group is GroupState.STARTING:
            state, reason = EngineState.STARTING, "the worker group is starting"
        elif self.group is GroupState.RUNNING and self.sleep_state is not SleepState.AWAKE:
            state = EngineState.SLEEPING
            reason = (
                f"asleep (level {self.sleep_level})"
                if self.sleep_state is SleepState.ASLEEP
                else self.sleep_state.value.replace("_", " ")
            )
        elif self.group is GroupState.RUNNING:
            state = EngineState.READY
        else:
            state, reason = EngineState.RESTARTING, self.last_failure
        return EngineHealth(
            healthy=state is EngineState.READY,
            state=state,
            reason=reason,
            restarts=self._restarts(restarts),
            workers=self.worker_view(workers),
            last_failure=self.last_failure,
            sleep_level=self.sleep_level,
        )

    def check_health(self) -> None:
        """Return None when healthy.  Raise :class:`EngineDeadError` if the engine died,
        :class:`EngineClosedError` if it was closed, and :class:`WorkerError` while its worker
        group is starting, failed or restarting (requests wait in the queue meanwhile)."""
        self.check_open()
        if self.group is not GroupState.RUNNING:
            raise WorkerError(
                f"worker group is {self.group.value}: {self.last_failure or 'starting'}",
                worker=self.last_failed_rank,
                error_type="WorkerGroupRestarting",
            )

    def statistics(
        self, workers: Iterable[WorkerState] = (), restarts: int | None = None
    ) -> EngineStatistics:
        counts = self._finished_counts
        scheduler = self.scheduler
        return EngineStatistics(
            waiting=scheduler.num_waiting,
            running=scheduler.num_running,
            admitted=self._admitted,
            finished_completed=counts[_S.FINISHED_COMPLETED],
            finished_aborted=counts[_S.FINISHED_ABORTED],
            finished_error=counts[_S.FINISHED_ERROR],
            open_streams=self.open_consumers(),
            dead=self.dead is not None,
            closed=self.closed,
            restarts=self._restarts(restarts),
            requeued=self._requeued,
            worker_group=self.group,
            workers=self.worker_view(workers),
            last_failure=self.last_failure,
            packing=scheduler.num_packing,
            queue_wait=PhaseSummary.of(self._timings["queue_wait"]),
            execution=PhaseSummary.of(self._timings["execution"]),
            postprocess=PhaseSummary.of(self._timings["postprocess"]),
            end_to_end=PhaseSummary.of(self._timings["end_to_end"]),
            batch_sizes=tuple(sorted(self._batch_sizes.items())),
            cancel_latency_counts=tuple(self._cancel_counts),
            cancel_latency_sum_s=self._cancel_sum_s,
            tick_counts=tuple(self._tick_counts),
            tick_sum_s=self._tick_sum_s,
            wasted_steps=self._wasted_steps,
            sleep_state=self.sleep_state,
            sleep_level=self.sleep_level,
            sleeps=self._sleeps,
            step_time_s=tuple(sorted(self._step_times.items())),
        )

    # -- trace ---------------------------------------------------------------------------

    def _record(
        self,
        now: float,
        kind: TraceKind,
        request_id: str | None = None,
        *,
        step_id: int | None = None,
        worker: int | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        trace = self.trace
        if trace is not None:
            trace.record(now, kind, request_id, step_id=step_id, worker=worker, detail=detail)


def _result_detail(output: RunnerOutput | None, *, lost: bool = False) -> dict[str, Any]:
    """An EXEC_RESULT's detail: the outcome ("lost": its data-parallel rank died under it),
    and how many steps the forward started after the abort of every request in it reached
    the worker (the promptness INV-7 checks)."""
    if lost:
        return {"outcome": "lost"}
    detail: dict[str, Any] = {"outcome": _outcome(output)}
    if output is not None and output.steps_after_abort is not None:
        detail["steps_after_abort"] = output.steps_after_abort
    return detail


def _outcome(runner: RunnerOutput | None) -> str:
    if runner is None:
        return "missing"
    if runner.error is not None:
        return "error"
    if runner.aborted:
        return "aborted"
    if runner.images is None and runner.async_output_id:
        return "pending"
    return "ok"
