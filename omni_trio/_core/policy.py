"""Scheduling policies: the waiting queues the scheduler admits from (pure, no I/O).

The :class:`~omni_trio._core.scheduler.Scheduler` owns every request's lifecycle; a policy
only decides *which waiting request is offered next*.  All three queues sit behind one small
protocol, :class:`WaitingQueue`, and hold WAITING/PREEMPTED states only::

    "fifo"      FifoQueue      arrival order (today's behaviour, bit for bit)
    "priority"  PriorityQueue  lowest (tick + priority * aging_ticks, seq) first: a heap
    "fair"      FairQueue      deficit round-robin across compatibility classes

Every queue keeps a small *front* lane served before everything else: a crash requeue
(``preempt_request(..., requeue="front")``) goes there, newest first, exactly as the FIFO
queue's ``appendleft`` does.  Aborted waiting requests are dropped lazily: their entries stay
in place, dead, until they reach a head, so ``discard`` is O(1) (O(classes) in the fair queue
when it empties a class) and ``len()`` is always exact.

Identity: a state is queued iff ``id(state)`` is in the queue's ``_queued`` set.  A dead entry
keeps its state object alive, so its ``id`` cannot be reused while the entry exists.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import Literal, Protocol, get_args

from .lifecycle import RequestState
from .request import DiffusionRequest

__all__ = [
    "SCHEDULING_POLICIES",
    "FairQueue",
    "FifoQueue",
    "PriorityQueue",
    "SchedulingPolicy",
    "WaitingQueue",
    "make_waiting_queue",
    "request_cost",
]

SchedulingPolicy = Literal["fifo", "priority", "fair"]
SCHEDULING_POLICIES: tuple[str, ...] = get_args(SchedulingPolicy)


def request_cost(request: DiffusionRequest) -> int:
    """The work a request asks for, in pixels x steps: ``height * width * total_steps *
    num_outputs_per_prompt``.  Height and width must be resolved (ints) by then.  O(1)."""
    sp = request.sampling
    if sp.height is None or sp.width is None:
        raise ValueError(f"request {request.request_id!r} has no resolved height/width")
    return sp.height * sp.width * sp.total_steps * sp.num_outputs_per_prompt


class WaitingQueue(Protocol):
    """What the scheduler needs from a policy.  ``wave_key`` is the running wave's
    compatibility key, or None when nothing runs (the next admission starts a new wave)."""

    def __len__(self) -> int:
        """Live (queued) states; exact."""
        ...

    def __iter__(self) -> Iterator[RequestState]:
        """Live states, in the order the policy would offer them (see each class)."""
        ...

    def add(self, state: RequestState, tick: int) -> None:
        """A new arrival; ``tick`` is the scheduler's step id at admission."""
        ...

    def push_front(self, state: RequestState) -> None:
        """Ahead of everything (a crash requeue): the front lane, newest first."""
        ...

    def requeue(self, state: RequestState) -> None:
        """Back in its own place (a preemption that keeps the request's standing)."""
        ...

    def discard(self, state: RequestState) -> None:
        """Forget ``state`` (it finished): dead if queued; any remembered key is dropped."""
        ...

    def peek(self, wave_key: Hashable | None) -> RequestState | None:
        """The state the policy offers next, or None; changes nothing observable."""
        ...

    def pop(self, wave_key: Hashable | None) -> RequestState:
        """Remove and return what ``peek(wave_key)`` returns (it must not be None)."""
        ...


class _FrontLane:
    """The shared front lane and the live set: a deque with lazy deletion."""

    def __init__(self) -> None:
        self._front: deque[RequestState] = deque()
        # Invariant: id(s) in _queued iff s is live in this queue (front lane or policy part).
        self._queued: set[int] = set()

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, state: RequestState) -> bool:
        return id(state) in self._queued

    def push_front(self, state: RequestState) -> None:
        self._queued.add(id(state))
        self._front.appendleft(state)

    def _front_head(self) -> RequestState | None:
        front = self._front
        while front:
            head = front[0]
            if id(head) in self._queued:
                return head
            front.popleft()  # aborted while waiting: drop lazily
        return None

    def _pop_front(self) -> RequestState:
        head = self._front.popleft()
        self._queued.discard(id(head))
        return head

    def _live_front(self) -> Iterator[RequestState]:
        return (s for s in self._front if id(s) in self._queued)


class FifoQueue(_FrontLane):
    """Arrival order; a requeue (either kind) goes to the front.  Every operation O(1)
    amortised.  This is the scheduler's original deque, unchanged: the front lane *is* the
    queue (``add`` appends to it, ``push_front``/``requeue`` prepend)."""

    def __iter__(self) -> Iterator[RequestState]:
        return self._live_front()

    def add(self, state: RequestState, tick: int) -> None:
        self._queued.add(id(state))
        self._front.append(state)

    def requeue(self, state: RequestState) -> None:
        # A preempted request was admitted before everything still waiting: its FIFO place
        # is the front.
        self.push_front(state)

    def discard(self, state: RequestState) -> None:
        self._queued.discard(id(state))

    def peek(self, wave_key: Hashable | None) -> RequestState | None:
        return self._front_head()

    def pop(self, wave_key: Hashable | None) -> RequestState:
        self._front_head()
        return self._pop_front()


class PriorityQueue(_FrontLane):
    """Lowest static sort key first: ``(tick + priority * aging_ticks, seq)``.

    ``tick`` is the scheduler's step id at :meth:`add`, ``seq`` an arrival counter (FIFO
    among equal keys).  The key is fixed at arrival and kept across preemptions until
    :meth:`discard`, so :meth:`requeue` puts a state back exactly where it stood.

    Starvation bound: a request A is offered after a later arrival B only if B has a better
    priority *and* arrived within ``(A.priority - B.priority) * aging_ticks`` ticks of A
    (``tick_B - tick_A < (p_A - p_B) * aging_ticks``); anything arriving later than that
    queues behind A whatever its priority.

    Costs: add/requeue/pop O(log n), peek O(1) amortised (dead entries are popped lazily),
    discard O(1).  Iteration is exact queue order (front lane, then the heap sorted:
    O(n log n), for occasional listings only).
    """

    def __init__(self, aging_ticks: int) -> None:
        super().__init__()
        self.aging_ticks = aging_ticks
        self._heap: list[tuple[int, int, RequestState]] = []
        self._seq = 0
        # id(state) -> its sort key, from add until discard (running states included).
        self._keys: dict[int, tuple[int, int]] = {}

    def sort_key(self, state: RequestState) -> tuple[int, int] | None:
        """The state's static sort key (None if it was never added or has been discarded)."""
        return self._keys.get(id(state))

    def __iter__(self) -> Iterator[RequestState]:
        yield from self._live_front()
        for _, _, state in sorted(self._heap, key=lambda e: (e[0], e[1])):
            if id(state) in self._queued:
                yield state

    def add(self, state: RequestState, tick: int) -> None:
        key = (tick + state.request.sampling.priority * self.aging_ticks, self._seq)
        self._seq += 1
        self._keys[id(state)] = key
        self._queued.add(id(state))
        heapq.heappush(self._heap, (key[0], key[1], state))

    def requeue(self, state: RequestState) -> None:
        key = self._keys[id(state)]
        self._queued.add(id(state))
        heapq.heappush(self._heap, (key[0], key[1], state))

    def discard(self, state: RequestState) -> None:
        self._queued.discard(id(state))
        self._keys.pop(id(state), None)

    def _heap_head(self) -> RequestState | None:
        heap = self._heap
        while heap:
            state = heap[0][2]
            if id(state) in self._queued:
                return state
            heapq.heappop(heap)  # aborted while waiting: drop lazily
        return None

    def peek(self, wave_key: Hashable | None) -> RequestState | None:
        head = self._front_head()
        return head if head is not None else self._heap_head()

    def pop(self, wave_key: Hashable | None) -> RequestState:
        if self._front_head() is not None:
            return self._pop_front()
        self._heap_head()
        state = heapq.heappop(self._heap)[2]
        self._queued.discard(id(state))
        return state


class FairQueue(_FrontLane):
    """Deficit round-robin (DRR) across compatibility classes (``key_fn``), costs from
    :func:`request_cost`.

    Each class with waiting requests has a FIFO deque, a deficit counter and a place in a
    round-robin ring.  ``quantum`` is ``fair_quantum`` or, when None, the largest cost seen
    so far, so every head fits within one visit.

    * A new wave (``wave_key`` None): the ring is visited from its start; a visit adds the
      quantum to the class's deficit, and the first class whose head then fits (cost <=
      deficit) wins.  Classes passed over keep their deficits (standard DRR).  The visits are
      not looped one by one: the number of rounds each class needs is computed directly, so
      this is O(classes) even when the quantum is much smaller than a cost.  The ring then
      turns so that the winner is last.
    * During a wave only the wave's class is offered, and only while its deficit covers its
      head's cost (each admission subtracts the cost), so a class that has spent its share
      drains and the next class starts the following wave.  Exception (DRR is
      work-conserving): when no other class is waiting, the lone class gets its next visits at
      once, so a single class keeps its batch full as FIFO would.
    * A class that empties is removed from the ring and its deficit reset to 0; a new class
      joins at the ring's end.
    * The front lane (crash requeues) goes first regardless of class and is not charged: the
      request was charged when first admitted.  A wave started from the front lane is joined
      by its class only within that class's current deficit.

    Fairness: with every class backlogged and visits not cut short by capacity, the cost
    admitted per class after each full round differs by less than one quantum.  A visit cut
    short by capacity keeps its deficit for the class's later joins and visits.

    Costs: add/requeue O(1) (O(1) amortised for the ring), peek/pop O(classes) for a new wave,
    O(1) amortised within a wave, discard O(1), or O(classes) when it empties a class.
    Iteration order is approximate: front lane, then each class in ring order, whole classes
    at a time (the real order interleaves them by wave).
    """

    def __init__(self, key_fn: Callable[[DiffusionRequest], Hashable], quantum: int | None):
        super().__init__()
        self._key_fn = key_fn
        self._fixed_quantum = quantum
        self._max_cost = 0
        # Per class: FIFO of its waiting states (lazy deletion), its live count, its deficit.
        # Invariant: a class is in _classes, _live, _deficit and _ring iff _live[c] > 0.
        self._classes: dict[Hashable, deque[RequestState]] = {}
        self._live: dict[Hashable, int] = {}
        self._deficit: dict[Hashable, int] = {}
        self._ring: deque[Hashable] = deque()  # next class to visit first
        # id(state) -> (class, cost) while it sits in a class deque (front lane: absent).
        self._meta: dict[int, tuple[Hashable, int]] = {}

    @property
    def quantum(self) -> int:
        """What one visit adds to a class's deficit (at least 1, so a zero cost never stalls)."""
        if self._fixed_quantum is not None:
            return self._fixed_quantum
        return max(1, self._max_cost)

    def deficit(self, key: Hashable) -> int:
        """A class's deficit (0 for a class with nothing waiting)."""
        return self._deficit.get(key, 0)

    def class_keys(self) -> tuple[Hashable, ...]:
        """Classes with waiting requests, in ring order (next visited first)."""
        return tuple(self._ring)

    def __iter__(self) -> Iterator[RequestState]:
        yield from self._live_front()
        for key in self._ring:
            yield from (s for s in self._classes[key] if id(s) in self._queued)

    def add(self, state: RequestState, tick: int) -> None:
        cost = request_cost(state.request)
        self._max_cost = max(self._max_cost, cost)
        self._into_class(state, self._key_fn(state.request), cost, front=False)

    def requeue(self, state: RequestState) -> None:
        """Back to the head of its class (the class rejoins the ring's end if it emptied)."""
        request = state.request
        self._into_class(state, self._key_fn(request), request_cost(request), front=True)

    def _into_class(self, state: RequestState, key: Hashable, cost: int, *, front: bool) -> None:
        self._queued.add(id(state))
        self._meta[id(state)] = (key, cost)
        queue = self._classes.get(key)
        if queue is None:
            queue = self._classes[key] = deque()
            self._live[key] = 0
            self._deficit[key] = 0
            self._ring.append(key)
        if front:
            queue.appendleft(state)
        else:
            queue.append(state)
        self._live[key] += 1

    def discard(self, state: RequestState) -> None:
        if id(state) not in self._queued:
            return
        self._queued.discard(id(state))
        meta = self._meta.pop(id(state), None)
        if meta is not None:
            self._class_lost_one(meta[0])

    def _class_lost_one(self, key: Hashable) -> None:
        self._live[key] -= 1
        if self._live[key] == 0:  # the class empties: out of the ring, deficit reset
            del self._live[key], self._deficit[key], self._classes[key]
            self._ring.remove(key)

    def _class_head(self, key: Hashable) -> RequestState:
        queue = self._classes[key]
        while id(queue[0]) not in self._queued:
            queue.popleft()  # aborted while waiting: drop lazily
        return queue[0]

    def _head_cost(self, key: Hashable) -> int:
        return self._meta[id(self._class_head(key))][1]

    def _rounds_needed(self, key: Hashable, quantum: int) -> int:
        """Visits (>= 1) until the class's head fits: the first visit adds a quantum."""
        short = self._head_cost(key) - self._deficit[key]
        return max(1, -(-short // quantum))

    def _new_wave_class(self) -> tuple[int, int] | None:
        """(winner's ring index, rounds it needs), or None with nothing in the classes."""
        quantum = self.quantum
        if not self._ring:
            return None
        k = len(self._ring)
        best: tuple[int, int] | None = None  # (visit number, ring index)
        for index, key in enumerate(self._ring):
            visit = (self._rounds_needed(key, quantum) - 1) * k + index
            if best is None or visit < best[0]:
                best = (visit, index)
        assert best is not None
        return best[1], best[0] // k + 1

    def _joiner(self, wave_key: Hashable) -> RequestState | None:
        if wave_key not in self._classes:
            return None
        head = self._class_head(wave_key)
        alone = len(self._ring) == 1
        if self._meta[id(head)][1] <= self._deficit[wave_key] or alone:
            return head
        return None

    def peek(self, wave_key: Hashable | None) -> RequestState | None:
        head = self._front_head()
        if head is not None:
            return head
        if wave_key is not None:
            return self._joiner(wave_key)
        plan = self._new_wave_class()
        return None if plan is None else self._class_head(self._ring[plan[0]])

    def pop(self, wave_key: Hashable | None) -> RequestState:
        if self._front_head() is not None:
            return self._pop_front()
        quantum = self.quantum
        if wave_key is None:
            plan = self._new_wave_class()
            assert plan is not None, "pop() with nothing to offer"
            winner, rounds = plan
            for index, key in enumerate(self._ring):
                self._deficit[key] += (rounds if index <= winner else rounds - 1) * quantum
            key = self._ring[winner]
            self._ring.rotate(-(winner + 1))  # the winner is visited last next time
        else:
            key = wave_key
            if self._head_cost(key) > self._deficit[key]:  # a lone class: its next visits
                self._deficit[key] += self._rounds_needed(key, quantum) * quantum
        state = self._class_head(key)
        self._classes[key].popleft()
        self._queued.discard(id(state))
        cost = self._meta.pop(id(state))[1]
        self._deficit[key] -= cost
        self._class_lost_one(key)
        return state


def make_waiting_queue(
    policy: str,
    key_fn: Callable[[DiffusionRequest], Hashable],
    *,
    aging_ticks: int = 16,
    fair_quantum: int | None = None,
) -> FifoQueue | PriorityQueue | FairQueue:
    """The queue for ``policy`` (one of :data:`SCHEDULING_POLICIES`).

    Raises ValueError for an unknown policy, ``aging_ticks`` that is not an integer >= 1, or
    ``fair_quantum`` that is neither None nor an integer > 0 (checked for every policy).
    """
    if policy not in SCHEDULING_POLICIES:
        raise ValueError(f"policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
    if isinstance(aging_ticks, bool) or not isinstance(aging_ticks, int) or aging_ticks < 1:
        raise ValueError(f"aging_ticks must be an integer >= 1, got {aging_ticks!r}")
    if fair_quantum is not None and (
        isinstance(fair_quantum, bool) or not isinstance(fair_quantum, int) or fair_quantum <= 0
    ):
        raise ValueError(f"fair_quantum must be None or an integer > 0, got {fair_quantum!r}")
    if policy == "priority":
        return PriorityQueue(aging_ticks)
    if policy == "fair":
        return FairQueue(key_fn, fair_quantum)
    return FifoQueue()
