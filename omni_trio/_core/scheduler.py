"""The schedulers: pure, synchronous state machines (no trio, no I/O, ``now`` passed in).

The scheduler is the single source of truth for each admitted request's lifecycle (INV-1).
Its owner (the engine loop) feeds it events and carries out its decisions::

    add_request(request, now)            -> WAITING
    schedule(now)                        -> SchedulerOutput (admits a wave / batch)
    update_from_output(out, results, now)-> ids that reached a terminal state; a request whose
                                            compute is done but whose output is still being
                                            packed moves to PACKING and leaves its batch
    finish_requests(ids, status, ...)    -> ids that reached a terminal state (abort, errors,
                                            a PACKING request's output arrived or was lost)
    preempt_request(id, requeue=...)     -> RUNNING or PACKING back to the queue as PREEMPTED
                                            (its front, or its own place under the policy)
    preemption_victims()                 -> running ids to preempt at a step boundary so a
                                            better waiting request can start ("priority")
    pop_request_state(id)                -> the terminal state, removed for good

Which waiting request is offered next is the scheduling policy's (``policy=``, see
:mod:`omni_trio._core.policy`); the scheduler stays the lifecycle owner:

* ``"fifo"`` (default): strict arrival order with head-of-line blocking: an incompatible head
  stops admission and later compatible requests are not moved ahead of it.
* ``"priority"``: lowest ``(tick + priority * aging_ticks, seq)`` first (``priority`` from the
  request's sampling params, lower runs first; ``tick`` the step id at admission), with the
  same head-of-line blocking on the best request.  Aging bounds starvation: a request is
  passed by a later, better-priority one only if it arrived within ``priority difference *
  aging_ticks`` ticks.  In step mode, :meth:`Scheduler.preemption_victims` names the running
  requests to preempt so that a better waiting one can start.
* ``"fair"``: deficit round-robin across compatibility classes, costs in pixels x steps
  (:func:`~omni_trio._core.policy.request_cost`); a wave is one class's visit.

Under every policy a crash requeue goes ahead of everything, and the suspect (``solo``) rules
hold.  A tick costs O(wave size) (plus O(log n) per admission for "priority" and O(classes)
per new wave for "fair"), never O(queue length): aborted waiting requests are dropped lazily
when they reach a head.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import ClassVar, Literal

from ..errors import DuplicateRequestError
from .keys import request_batch_key, step_batch_key
from .lifecycle import RequestState, RequestStatus, transition
from .messages import BatchRunnerOutput, NewRequestData, RunnerOutput, SchedulerOutput
from .policy import PriorityQueue, WaitingQueue, make_waiting_queue
from .request import DiffusionRequest

__all__ = [
    "MISSING_OUTPUT_ERROR",
    "MISSING_STEP_INDEX_ERROR",
    "NO_RESULT_ERROR",
    "RequestScheduler",
    "Scheduler",
    "StepScheduler",
]

MISSING_OUTPUT_ERROR = "Diffusion execution finished without an output for this request"
NO_RESULT_ERROR = "Diffusion execution returned no result for this request"
MISSING_STEP_INDEX_ERROR = "Missing step_index in step-mode runner output"

_S = RequestStatus


class Scheduler:
    """Shared base of the request and step schedulers.

    ``policy`` is one of :data:`~omni_trio._core.policy.SCHEDULING_POLICIES`; ``aging_ticks``
    ("priority": ticks one priority level is worth) and ``fair_quantum`` ("fair": cost one
    visit grants; None: the largest cost seen) are validated for every policy.  Raises
    ValueError for a bad capacity, policy, ``aging_ticks`` < 1 or ``fair_quantum`` <= 0.
    """

    mode: ClassVar[str] = "base"

    def __init__(
        self,
        max_num_seqs: int = 1,
        key_fn: Callable[[DiffusionRequest], Hashable] = request_batch_key,
        *,
        policy: str = "fifo",
        aging_ticks: int = 16,
        fair_quantum: int | None = None,
    ) -> None:
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}")
        self.capacity = max_num_seqs
        self._key_fn = key_fn
        self._queue: WaitingQueue = make_waiting_queue(
            policy, key_fn, aging_ticks=aging_ticks, fair_quantum=fair_quantum
        )
        self.policy = policy
        # Every admitted request until pop_request_state (terminal ones included).
        self._states: dict[str, RequestState] = {}
        # WAITING/PREEMPTED states live in ``_queue`` (the policy's), and only there.
        # Running requests in admission order (batch row order).
        self._running: dict[str, RequestState] = {}
        # Compute done, output still being packed: out of the batch, not terminal yet.
        self._packing: dict[str, RequestState] = {}
        self._wave_key: Hashable | None = None
        # Terminal since the last schedule(); reported once in its finished_req_ids.
        self._finished_pending: set[str] = set()
        self._step_id = 0
        # While set (the engine falls asleep, sleeps or wakes) no waiting request starts;
        # running ones go on (step mode) until they finish.
        self.holding = False

    # -- queries -------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_packing(self) -> int:
        return len(self._packing)

    @property
    def step_id(self) -> int:
        return self._step_id

    def has_unfinished_requests(self) -> bool:
        return bool(self._queue) or bool(self._running)

    def has_schedulable_work(self) -> bool:
        """A schedule() now would run something: a request is running, or the request the
        policy offers next may start (not a suspect waiting for the group to empty, see
        ``solo``)."""
        if self._running:
            return True
        if self.holding:
            return False
        head = self._queue.peek(None)
        return head is not None and not self._solo_blocks(head)

    def has_finished_to_report(self) -> bool:
        """True when the next schedule() output will report finished ids."""
        return bool(self._finished_pending)

    def get_request_state(self, request_id: str) -> RequestState | None:
        return self._states.get(request_id)

    def running_request_ids(self) -> tuple[str, ...]:
        return tuple(self._running)

    def packing_request_ids(self) -> tuple[str, ...]:
        """PACKING requests, oldest compute first."""
        return tuple(self._packing)

    def live_request_ids(self) -> list[str]:
        """Ids of every admitted request that is not terminal: packing first, then running,
        then waiting in the order the policy would run them (exact for "fifo" and
        "priority"; for "fair" class by class in ring order, an approximation).  O(n), and
        O(n log n) for "priority": for listings, not for every tick."""
        ids = list(self._packing)
        ids.extend(self._running)
        ids.extend(s.request_id for s in self._queue)
        return ids

    def queue_position(self, request_id: str) -> int | None:
        """How many waiting requests the policy would start before this waiting (or
        preempted) one -- 0: it is next -- or None when it is not waiting.  O(n) (O(n log
        n) under "priority"), with the order of :meth:`live_request_ids`."""
        state = self._states.get(request_id)
        if state is None or state.status not in (_S.WAITING, _S.PREEMPTED):
            return None
        for index, waiting in enumerate(self._queue):
            if waiting.request_id == request_id:
                return index
        return None  # pragma: no cover - a waiting state is always in the queue

    def pending_finished_request_ids(self) -> list[str]:
        """Terminal requests whose state has not been popped yet."""
        return [rid for rid, s in self._states.items() if s.status.finished]

    # -- events --------------------------------------------------------------------------

    def add_request(self, request: DiffusionRequest, now: float) -> RequestState:
        """Admit ``request`` as WAITING at the back of the queue (its place under the policy).

        Raises :class:`DuplicateRequestError` while a request with the same id has state here
        (terminal-but-not-popped included), and ValueError ("fair") for a request whose
        height/width is not resolved; nothing changes when it raises.  O(1), O(log n) under
        "priority".
        """
        rid = request.request_id
        if rid in self._states:
            raise DuplicateRequestError(rid)
        state = RequestState(request=request, queued_at=now)
        self._init_state(state)
        self._queue.add(state, self._step_id)  # first: a refusal leaves nothing behind
        self._states[rid] = state
        return state

    def schedule(self, now: float) -> SchedulerOutput:
        """Admit compatible requests in policy order while capacity allows."""
        self._step_id += 1
        new, cached = self._admit(now)
        finished = frozenset(self._finished_pending)
        self._finished_pending.clear()
        return SchedulerOutput(
            step_id=self._step_id,
            scheduled_new_reqs=tuple(new),
            scheduled_cached_reqs=tuple(cached),
            finished_req_ids=finished,
            num_running_reqs=len(self._running),
            num_waiting_reqs=self.num_waiting,
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: BatchRunnerOutput, now: float
    ) -> list[str]:
        """Apply one execute result; return the ids that reached a terminal state.

        A request whose output is announced (``async_output_id``) but not in hand moves to
        PACKING: it leaves its batch, so the slot is free for the next wave.  Results for
        requests that finished meanwhile (aborted while running) are ignored: a late result
        is never delivered.
        """
        finished: list[str] = []
        for rid in scheduler_output.scheduled_request_ids:
            state = self._running.get(rid)
            if state is None:
                continue
            status, error, error_type = self._judge(state, runner_output.get(rid))
            if status is None:
                continue
            if status is _S.PACKING:
                self._start_packing(state)
                continue
            self._finish(state, status, now, error, error_type)
            finished.append(rid)
        return finished

    def finish_requests(
        self,
        request_ids: str | Iterable[str],
        status: RequestStatus,
        now: float,
        *,
        error: str | None = None,
        error_type: str | None = None,
    ) -> list[str]:
        """Move live requests to the terminal ``status``; unknown or finished ids are ignored.

        Returns the ids that reached a terminal state now.
        """
        if not status.finished:
            raise ValueError(f"finish_requests needs a terminal status, got {status.name}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        done: list[str] = []
        for rid in dict.fromkeys(request_ids):
            state = self._states.get(rid)
            if state is None or state.status.finished:
                continue
            self._finish(state, status, now, error, error_type)
            done.append(rid)
        return done

    def preempt_request(
        self,
        request_id: str,
        *,
        reset_progress: bool = False,
        requeue: Literal["front", "key"] = "front",
    ) -> bool:
        """Move a RUNNING or PACKING request back to the queue as PREEMPTED.

        ``requeue="front"`` puts it ahead of everything (a crash requeue); ``"key"`` puts it
        back in its own place under the policy ("priority": its original sort key, so it
        keeps its standing and aging; "fair": the head of its class; "fifo": the front).
        Returns False (and changes nothing) if it is neither.  Step progress is kept unless
        ``reset_progress`` (the workers lost the request's state, e.g. after a crash).  A
        PACKING request's output was lost: it runs again from the start.  O(1), or O(log n)
        for ``"key"`` under "priority".
        """
        if requeue not in ("front", "key"):
            raise ValueError(f"requeue must be 'front' or 'key', got {requeue!r}")
        state = self._running.get(request_id)
        if state is None:
            state = self._packing.get(request_id)
            if state is None:
                return False
            reset_progress = True
        transition(state, _S.PREEMPTED)  # first: an illegal move leaves everything as it was
        if self._running.pop(request_id, None) is not None and not self._running:
            self._wave_key = None
        self._packing.pop(request_id, None)
        state.num_preemptions += 1
        if reset_progress:
            state.num_computed_steps = 0
            state.sent_to_worker = False
        if requeue == "key":
            self._queue.requeue(state)
        else:
            self._queue.push_front(state)
        return True

    def preemption_victims(self) -> tuple[str, ...]:
        """Running ids to preempt now so that a better waiting request can start.

        Always ``()`` here: only the step scheduler under "priority" preempts (see
        :meth:`StepScheduler.preemption_victims`).  Pure query, changes nothing.
        """
        return ()

    def forget_worker_state(self) -> list[str]:
        """The workers lost every step state they held (their group failed): each queued
        request that had its payload sent starts again from step 0, its payload sent anew.
        Returns their ids."""
        reset: list[str] = []
        for state in self._queue:
            if state.sent_to_worker:
                state.sent_to_worker = False
                state.num_computed_steps = 0
                reset.append(state.request_id)
        return reset

    def drop_worker_state(self, request_id: str) -> bool:
        """A PREEMPTED request whose step state the workers hold gives it up: its id goes
        out in the next output's ``finished_req_ids`` (the workers evict it before they
        prepare anything new), and it starts again from step 0 with its payload sent anew
        (same seed: same image).  False (nothing changes) unless it is PREEMPTED with state
        on the workers."""
        state = self._states.get(request_id)
        if state is None or state.status is not _S.PREEMPTED or not state.sent_to_worker:
            return False
        state.sent_to_worker = False
        state.num_computed_steps = 0
        self._finished_pending.add(request_id)
        return True

    def pop_request_state(self, request_id: str) -> RequestState | None:
        """Remove and return a terminal request's state (None if unknown).

        Raises ValueError if the request is still live: live state is never dropped.
        """
        state = self._states.get(request_id)
        if state is None:
            return None
        if not state.status.finished:
            raise ValueError(f"request {request_id!r} is still {state.status.name}")
        del self._states[request_id]
        return state

    def admission_wait(self, now: float) -> float | None:
        """None: schedule now; a time: re-check then (or sooner, when the queue grows)."""
        return None

    # -- internals -----------------------------------------------------------------------

    def _init_state(self, state: RequestState) -> None:
        """Hook for subclasses to set per-mode fields on a new state."""

    def _admit(self, now: float) -> tuple[list[NewRequestData], list[str]]:
        new: list[NewRequestData] = []
        cached: list[str] = []
        queue = self._queue
        while len(self._running) < self.capacity and not self.holding:
            wave = self._wave_key if self._running else None
            head = queue.peek(wave)
            if head is None:
                break
            key = self._key_fn(head.request)
            if self._running and key != self._wave_key:
                break  # head-of-line blocking
            if self._solo_blocks(head):
                break  # a suspect runs alone
            if not self._running:
                self._wave_key = key
            popped = queue.pop(wave)
            assert popped is head, "a queue popped something other than what it offered"
            transition(head, _S.RUNNING)
            if head.first_scheduled_at is None:
                head.first_scheduled_at = now
            self._running[head.request_id] = head
            if self._sends_payload(head):
                new.append(NewRequestData(head.request_id, head.request))
                head.sent_to_worker = True
            else:
                cached.append(head.request_id)
        return new, cached

    def _solo_blocks(self, head: RequestState) -> bool:
        """A suspect (``solo``) runs alone in the group: it starts only once nothing else is
        running or packing, and nothing starts while it runs or packs, so a group failure
        under it has one cause."""
        if not self._running and not self._packing:
            return False
        if head.solo:
            return True
        return any(s.solo for s in self._running.values()) or any(
            s.solo for s in self._packing.values()
        )

    def _sends_payload(self, state: RequestState) -> bool:
        return True

    def _judge(
        self, state: RequestState, output: RunnerOutput | None
    ) -> tuple[RequestStatus | None, str | None, str | None]:
        raise NotImplementedError

    def _start_packing(self, state: RequestState) -> None:
        transition(state, _S.PACKING)
        del self._running[state.request_id]
        if not self._running:
            self._wave_key = None
        self._packing[state.request_id] = state

    def _finish(
        self,
        state: RequestState,
        status: RequestStatus,
        now: float,
        error: str | None,
        error_type: str | None,
    ) -> None:
        rid = state.request_id
        transition(state, status)  # first: an illegal move must leave the queues untouched
        if self._running.pop(rid, None) is not None and not self._running:
            self._wave_key = None
        self._packing.pop(rid, None)
        self._queue.discard(state)
        state.finished_at = now
        if status is _S.FINISHED_ERROR:
            state.error = error or "request failed"
            state.error_type = error_type or "RequestFailedError"
        elif status is _S.FINISHED_ABORTED:
            state.error = error or f"Request {rid} aborted."
            state.error_type = error_type or "RequestAbortedError"
        self._finished_pending.add(rid)


class RequestScheduler(Scheduler):
    """Request mode: a wave of compatible whole requests per execute call.

    A new wave is admitted only when the previous one has been resolved by
    :meth:`update_from_output`.  With ``request_batch_max_wait_ms > 0`` and capacity > 1,
    admission into an idle system may wait to coalesce a fuller wave: it ends on a full wave,
    after a quiet window of ``min(50 ms, wait / 5)`` since the queue last grew, or at the
    deadline ``wait`` after the wait began.
    """

    mode = "request"

    def __init__(
        self,
        max_num_seqs: int = 1,
        request_batch_max_wait_ms: float = 0.0,
        *,
        policy: str = "fifo",
        aging_ticks: int = 16,
        fair_quantum: int | None = None,
    ) -> None:
        super().__init__(
            max_num_seqs,
            request_batch_key,
            policy=policy,
            aging_ticks=aging_ticks,
            fair_quantum=fair_quantum,
        )
        if not request_batch_max_wait_ms >= 0 or request_batch_max_wait_ms == float("inf"):
            raise ValueError(
                "request_batch_max_wait_ms must be a finite number >= 0, "
                f"got {request_batch_max_wait_ms!r}"
            )
        self.max_wait_s = request_batch_max_wait_ms / 1000.0
        self.stable_window_s = min(0.05, self.max_wait_s / 5)
        self._wait_deadline: float | None = None
        self._last_growth_at = 0.0

    def add_request(self, request: DiffusionRequest, now: float) -> RequestState:
        state = super().add_request(request, now)
        self._last_growth_at = now
        return state

    def admission_wait(self, now: float) -> float | None:
        if self.max_wait_s <= 0 or self.capacity <= 1 or self._running or not self._queue:
            self._wait_deadline = None
            return None
        if self.num_waiting >= self.capacity:
            self._wait_deadline = None
            return None
        if self._wait_deadline is None:
            self._wait_deadline = now + self.max_wait_s
        quiet_until = self._last_growth_at + self.stable_window_s
        if now >= quiet_until or now >= self._wait_deadline:
            self._wait_deadline = None
            return None
        return min(quiet_until, self._wait_deadline)

    def _admit(self, now: float) -> tuple[list[NewRequestData], list[str]]:
        if self._running:
            return [], []  # a wave is in flight; the next one waits for its update
        self._wait_deadline = None
        return super()._admit(now)

    def _judge(
        self, state: RequestState, output: RunnerOutput | None
    ) -> tuple[RequestStatus | None, str | None, str | None]:
        if output is None:
            return _S.FINISHED_ERROR, MISSING_OUTPUT_ERROR, "MissingOutputError"
        if output.aborted:
            return _S.FINISHED_ABORTED, None, None
        if output.error is not None:
            return _S.FINISHED_ERROR, output.error, output.error_type
        if output.images is None:
            if output.async_output_id is None:
                return _S.FINISHED_ERROR, NO_RESULT_ERROR, "MissingOutputError"
            return _S.PACKING, None, None
        return _S.FINISHED_COMPLETED, None, None


class StepScheduler(Scheduler):
    """Step mode: requests join and leave a running batch at step boundaries.

    The scheduler tracks progress only (``num_computed_steps`` of ``total_steps``; total from
    timesteps > sigmas > num_inference_steps); the workers hold the tensors.  Running requests
    are re-listed as cached ids every tick; a preempted request keeps its progress and comes
    back as a cached id unless its progress was reset.
    """

    mode = "step"

    def __init__(
        self,
        max_num_seqs: int = 1,
        *,
        policy: str = "fifo",
        aging_ticks: int = 16,
        fair_quantum: int | None = None,
    ) -> None:
        super().__init__(
            max_num_seqs,
            step_batch_key,
            policy=policy,
            aging_ticks=aging_ticks,
            fair_quantum=fair_quantum,
        )

    def preemption_victims(self) -> tuple[str, ...]:
        """Under "priority": the running ids to preempt at this step boundary so that the
        best waiting request W can start; ``()`` under the other policies.

        A running request R is *worse* than W when its priority number is strictly larger
        and its sort key is later than W's (one that aged past W is never preempted for it:
        requeued, it would be offered before W again).  When W cannot start now:

        * the batch is full and W shares the wave's key: the single worst running request
          that is worse than W (largest priority number, latest admitted among ties);
        * W's key differs from the wave's: every running request, if each is worse than W;

        otherwise ``()``.  Never when W or any running or packing request is ``solo``;
        PACKING requests are never victims.  Contract: after
        ``preempt_request(rid, requeue="key")`` for each victim (progress kept), the next
        ``schedule(now)`` admits W.  A query: changes nothing.  O(wave size).
        """
        queue = self._queue
        if not isinstance(queue, PriorityQueue) or not self._running or self.holding:
            return ()
        best = queue.peek(None)
        if best is None or best.solo:
            return ()
        running = self._running
        if any(s.solo for s in running.values()) or any(s.solo for s in self._packing.values()):
            return ()
        same_key = self._key_fn(best.request) == self._wave_key
        if same_key and len(running) < self.capacity:
            return ()  # it can start now
        best_priority = best.request.sampling.priority
        best_key = queue.sort_key(best)
        assert best_key is not None

        def worse(state: RequestState) -> bool:
            key = queue.sort_key(state)
            assert key is not None
            return state.request.sampling.priority > best_priority and key > best_key

        if not same_key:
            if all(worse(s) for s in running.values()):
                return tuple(running)
            return ()
        victim: RequestState | None = None
        for state in running.values():  # admission order: a later tie wins
            if worse(state) and (
                victim is None
                or state.request.sampling.priority >= victim.request.sampling.priority
            ):
                victim = state
        return () if victim is None else (victim.request_id,)

    def _init_state(self, state: RequestState) -> None:
        total = state.request.sampling.total_steps
        if total <= 0:
            raise ValueError(f"request {state.request_id!r} has no denoising steps")
        state.total_steps = total

    def _admit(self, now: float) -> tuple[list[NewRequestData], list[str]]:
        already = list(self._running)
        new, cached = super()._admit(now)
        return new, already + cached

    def _sends_payload(self, state: RequestState) -> bool:
        return not state.sent_to_worker

    def _judge(
        self, state: RequestState, output: RunnerOutput | None
    ) -> tuple[RequestStatus | None, str | None, str | None]:
        if output is None:
            return _S.FINISHED_ERROR, MISSING_OUTPUT_ERROR, "MissingOutputError"
        if output.aborted:
            return _S.FINISHED_ABORTED, None, None
        if output.error is not None:
            return _S.FINISHED_ERROR, output.error, output.error_type
        if output.step_index is None:
            return _S.FINISHED_ERROR, MISSING_STEP_INDEX_ERROR, "MissingOutputError"
        state.num_computed_steps = output.step_index
        if output.finished:
            return _S.FINISHED_COMPLETED, None, None
        return None, None, None
