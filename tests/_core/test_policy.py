"""The waiting queues behind the scheduling policies, against small reference models."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Hashable
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, note, settings

from omni_trio._core.keys import request_batch_key
from omni_trio._core.lifecycle import RequestState
from omni_trio._core.policy import (
    SCHEDULING_POLICIES,
    FairQueue,
    FifoQueue,
    PriorityQueue,
    make_waiting_queue,
    request_cost,
)
from omni_trio._core.request import DiffusionRequest, SamplingParams

# Deterministic and quick: the whole of tests/_core must stay fast.
quick = settings(max_examples=150, deadline=None, derandomize=True, database=None)


def make_state(rid: str, *, side: int = 32, steps: int = 2, **sampling: Any) -> RequestState:
    request = DiffusionRequest(
        f"prompt of {rid}",
        SamplingParams(height=side, width=side, num_inference_steps=steps, **sampling),
        request_id=rid,
    )
    return RequestState(request=request, queued_at=0.0)


def side_key(request: DiffusionRequest) -> Hashable:
    return request.sampling.height


def ids(states: Any) -> list[str]:
    return [s.request_id for s in states]


# -- request_cost and construction -----------------------------------------------------------


def test_policy_names() -> None:
    assert SCHEDULING_POLICIES == ("fifo", "priority", "fair")


def test_request_cost_is_pixels_times_steps_times_outputs() -> None:
    assert request_cost(make_state("a", side=32, steps=3).request) == 32 * 32 * 3
    request = DiffusionRequest(
        "p", SamplingParams(height=16, width=48, timesteps=(1.0, 2.0), num_outputs_per_prompt=3)
    )
    assert request_cost(request) == 16 * 48 * 2 * 3


def test_request_cost_needs_a_resolved_size() -> None:
    with pytest.raises(ValueError, match="height/width"):
        request_cost(DiffusionRequest("p", SamplingParams(width=64), request_id="r"))


def test_make_waiting_queue_picks_the_policy_class() -> None:
    assert type(make_waiting_queue("fifo", side_key)) is FifoQueue
    assert type(make_waiting_queue("priority", side_key)) is PriorityQueue
    assert type(make_waiting_queue("fair", side_key)) is FairQueue
    queue = make_waiting_queue("priority", side_key, aging_ticks=3)
    assert isinstance(queue, PriorityQueue) and queue.aging_ticks == 3
    fair = make_waiting_queue("fair", side_key, fair_quantum=7)
    assert isinstance(fair, FairQueue) and fair.quantum == 7


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"policy": "lifo"}, "policy"),
        ({"policy": "FIFO"}, "policy"),
        ({"aging_ticks": 0}, "aging_ticks"),
        ({"aging_ticks": -1}, "aging_ticks"),
        ({"aging_ticks": 1.5}, "aging_ticks"),
        ({"aging_ticks": True}, "aging_ticks"),
        ({"fair_quantum": 0}, "fair_quantum"),
        ({"fair_quantum": -4}, "fair_quantum"),
        ({"fair_quantum": 2.0}, "fair_quantum"),
        ({"fair_quantum": True}, "fair_quantum"),
    ],
    ids=repr,
)
def test_make_waiting_queue_rejects_bad_settings(kwargs: dict[str, Any], match: str) -> None:
    args: dict[str, Any] = {"policy": "fifo", **kwargs}
    policy = args.pop("policy")
    with pytest.raises(ValueError, match=match):
        make_waiting_queue(policy, side_key, **args)


# -- fifo --------------------------------------------------------------------------------------


def test_fifo_queue_order_front_lane_and_lazy_discard() -> None:
    queue = FifoQueue()
    a, b, c, d = (make_state(r) for r in "abcd")
    for s in (a, b, c):
        queue.add(s, 0)
    queue.push_front(d)
    assert ids(queue) == ["d", "a", "b", "c"]
    queue.discard(d)
    queue.discard(b)
    assert len(queue) == 2
    assert ids(queue) == ["a", "c"]
    assert queue.peek(None) is a
    assert queue.pop(None) is a
    queue.requeue(a)  # a FIFO requeue is a front requeue
    assert ids(queue) == ["a", "c"]


# -- priority -----------------------------------------------------------------------------------


def test_priority_queue_orders_by_tick_plus_priority_times_aging() -> None:
    queue = PriorityQueue(aging_ticks=10)
    late_urgent = make_state("late-urgent", priority=-1)
    queue.add(make_state("p0"), 0)  # key 0
    queue.add(make_state("p1"), 0)  # key 0, later seq
    queue.add(make_state("p2", priority=2), 0)  # key 20
    queue.add(late_urgent, 15)  # key 5
    queue.add(make_state("late"), 15)  # key 15
    assert ids(queue) == ["p0", "p1", "late-urgent", "late", "p2"]
    assert queue.sort_key(late_urgent) == (5, 3)
    popped = [queue.pop(None).request_id for _ in range(5)]
    assert popped == ["p0", "p1", "late-urgent", "late", "p2"]
    assert len(queue) == 0


def test_priority_queue_pops_in_key_order() -> None:
    queue = PriorityQueue(aging_ticks=10)
    for rid, prio, tick in [("a", 2, 0), ("b", 0, 0), ("c", 0, 25), ("d", -2, 30), ("e", 1, 1)]:
        queue.add(make_state(rid, priority=prio), tick)
    # keys: a 20, b 0, c 25, d 10, e 11
    assert [queue.pop(None).request_id for _ in range(5)] == ["b", "d", "e", "a", "c"]
    assert queue.peek(None) is None


def test_priority_front_lane_goes_first_and_requeue_keeps_the_key() -> None:
    queue = PriorityQueue(aging_ticks=4)
    a, b, c = make_state("a", priority=3), make_state("b"), make_state("c", priority=1)
    queue.add(a, 0)  # key 12
    queue.add(b, 1)  # key 1
    queue.add(c, 2)  # key 6
    assert queue.pop(None) is b
    queue.push_front(b)  # a crash requeue: ahead of everything
    assert ids(queue) == ["b", "c", "a"]
    assert queue.pop(None) is b
    assert queue.pop(None) is c
    queue.requeue(c)  # back under key 6: still ahead of a
    assert queue.sort_key(c) == (6, 2)
    assert ids(queue) == ["c", "a"]
    queue.discard(c)
    assert queue.sort_key(c) is None  # forgotten once finished
    assert ids(queue) == ["a"]
    assert len(queue) == 1


priority_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(-3, 3), st.integers(0, 3)),
        st.tuples(st.just("pop"), st.just(0), st.just(0)),
        st.tuples(st.just("discard"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("front"), st.just(0), st.just(0)),
        st.tuples(st.just("requeue"), st.just(0), st.just(0)),
    ),
    max_size=60,
)


@quick
@given(aging=st.integers(1, 5), ops=priority_ops)
def test_priority_queue_matches_a_sorted_list_model(
    aging: int, ops: list[tuple[str, int, int]]
) -> None:
    """Against a model: waiting = front lane (newest first) + states sorted by static key;
    ``len`` exact and iteration in exact order after every operation, dead entries and all."""
    queue = PriorityQueue(aging_ticks=aging)
    keys: dict[str, tuple[int, int]] = {}
    front: list[RequestState] = []
    heap: list[RequestState] = []
    out: list[RequestState] = []  # popped, may come back
    tick, seq = 0, 0
    for op, arg, gap in ops:
        note(f"{op} {arg} {gap}")
        if op == "add":
            tick += gap
            state = make_state(f"r{seq}", priority=arg)
            keys[state.request_id] = (tick + arg * aging, seq)
            seq += 1
            queue.add(state, tick)
            heap.append(state)
        elif op == "pop":
            expected = (
                front[0] if front else min(heap, key=lambda s: keys[s.request_id], default=None)
            )
            assert queue.peek(None) is expected
            if expected is None:
                continue
            assert queue.pop(None) is expected
            (front if front and front[0] is expected else heap).remove(expected)
            out.append(expected)
        elif op == "discard":
            live = front + heap
            if live:
                victim = live[arg % len(live)]
                queue.discard(victim)
                (front if victim in front else heap).remove(victim)
        elif op in ("front", "requeue") and out:
            state = out.pop()
            if op == "front":
                queue.push_front(state)
                front.insert(0, state)
            else:
                queue.requeue(state)
                heap.append(state)
        assert len(queue) == len(front) + len(heap)
        assert list(queue) == front + sorted(heap, key=lambda s: keys[s.request_id])


# -- fair: the closed-form DRR against a naive one ---------------------------------------------


class NaiveDRR:
    """Textbook deficit round-robin, one visit at a time (the reference model)."""

    def __init__(self, quantum: int | None) -> None:
        self.fixed = quantum
        self.max_cost = 0
        self.classes: dict[Hashable, deque[tuple[str, int]]] = {}
        self.deficit: dict[Hashable, int] = {}
        self.ring: deque[Hashable] = deque()

    @property
    def quantum(self) -> int:
        return self.fixed if self.fixed is not None else max(1, self.max_cost)

    def add(self, rid: str, key: Hashable, cost: int) -> None:
        self.max_cost = max(self.max_cost, cost)
        if key not in self.classes:
            self.classes[key] = deque()
            self.deficit[key] = 0
            self.ring.append(key)
        self.classes[key].append((rid, cost))

    def _take(self, key: Hashable) -> str:
        rid, cost = self.classes[key].popleft()
        self.deficit[key] -= cost
        if not self.classes[key]:
            del self.classes[key], self.deficit[key]
            self.ring.remove(key)
        return rid

    def wave(self, capacity: int) -> list[str]:
        if not self.ring:
            return []
        while True:  # visit classes one by one until a head fits
            key = self.ring[0]
            self.deficit[key] += self.quantum
            self.ring.rotate(-1)
            if self.classes[key][0][1] <= self.deficit[key]:
                break
        admitted = [self._take(key)]
        while len(admitted) < capacity and key in self.classes:
            if self.classes[key][0][1] > self.deficit[key]:
                if len(self.ring) > 1:
                    break
                self.deficit[key] += self.quantum  # a lone class: its next visit at once
                continue
            admitted.append(self._take(key))
        return admitted


def fair_wave(queue: FairQueue, capacity: int) -> list[RequestState]:
    """Admit one request-mode wave the way the scheduler does (no running batch)."""
    wave: list[RequestState] = []
    key: Hashable | None = None
    while len(wave) < capacity:
        head = queue.peek(key)
        if head is None:
            break
        assert queue.pop(key) is head
        wave.append(head)
        key = side_key(head.request)
    return wave


@quick
@given(
    quantum=st.one_of(st.none(), st.integers(1, 5000)),
    capacity=st.integers(1, 4),
    script=st.lists(
        st.lists(st.tuples(st.sampled_from([8, 16, 24]), st.integers(1, 6)), max_size=4),
        max_size=25,
    ),
)
def test_fair_queue_matches_naive_deficit_round_robin(
    quantum: int | None, capacity: int, script: list[list[tuple[int, int]]]
) -> None:
    """Whatever the quantum (much smaller than a cost included), the O(classes) selection
    admits exactly what one-visit-at-a-time DRR admits, with the same deficits and ring."""
    queue = FairQueue(side_key, quantum)
    model = NaiveDRR(quantum)
    counter = itertools.count()
    for arrivals in [*script, [], [], []]:
        for side, steps in arrivals:
            state = make_state(f"r{next(counter)}", side=side, steps=steps)
            queue.add(state, 0)
            model.add(state.request_id, side, request_cost(state.request))
        note(f"arrivals {arrivals}")
        assert ids(fair_wave(queue, capacity)) == model.wave(capacity)
        assert queue.class_keys() == tuple(model.ring)
        assert {k: queue.deficit(k) for k in queue.class_keys()} == model.deficit
        assert len(queue) == sum(len(q) for q in model.classes.values())


def test_fair_class_that_empties_loses_its_deficit_and_rejoins_at_the_end() -> None:
    queue = FairQueue(side_key, quantum=10_000)
    big, small = make_state("big", side=64), make_state("small", side=16)
    queue.add(small, 0)
    queue.add(big, 0)
    assert queue.class_keys() == (16, 64)
    assert queue.pop(None) is small  # 16's visit: deficit 10_000 - 512, then it empties
    assert queue.deficit(16) == 0
    assert queue.class_keys() == (64,)
    again = make_state("again", side=16)
    queue.add(again, 0)
    assert queue.class_keys() == (64, 16)
    assert queue.deficit(16) == 0


def test_fair_passed_over_class_keeps_its_deficit() -> None:
    queue = FairQueue(side_key, quantum=1000)  # costs: 16x16x2 = 512, 64x64x2 = 8192
    queue.add(make_state("big", side=64), 0)
    queue.add(make_state("small", side=16), 0)
    queue.add(make_state("small2", side=16), 0)
    assert queue.pop(None).request_id == "small"  # big needs 9 visits; small fits at once
    assert queue.deficit(64) == 1000
    assert queue.deficit(16) == 1000 - 512
    assert queue.class_keys() == (64, 16)


def test_fair_wave_joins_only_within_the_deficit_while_another_class_waits() -> None:
    queue = FairQueue(side_key, quantum=None)
    for i in range(5):
        queue.add(make_state(f"s{i}", side=32), 0)  # 32*32*2 = 2048 each
    queue.add(make_state("b", side=64), 0)  # 8192: the quantum
    assert queue.pop(None).request_id == "s0"
    assert queue.deficit(32) == 8192 - 2048
    for rid in ("s1", "s2", "s3"):
        assert queue.peek(32) is not None
        assert queue.pop(32).request_id == rid
    assert queue.deficit(32) == 0
    assert queue.peek(32) is None  # b waits: class 32 has spent its share
    assert queue.class_keys() == (64, 32)
    assert queue.pop(None).request_id == "b"  # the next wave is 64's
    assert queue.class_keys() == (32,)  # 64 emptied: out of the ring, deficit reset
    assert queue.deficit(64) == 0


def test_fair_lone_class_keeps_joining() -> None:
    queue = FairQueue(side_key, quantum=None)
    for i in range(6):
        queue.add(make_state(f"s{i}", side=32), 0)
    assert ids(fair_wave(queue, 4)) == ["s0", "s1", "s2", "s3"]  # one class: full batches


def test_fair_front_lane_goes_first_regardless_of_class() -> None:
    queue = FairQueue(side_key, quantum=None)
    a, b = make_state("a", side=32), make_state("b", side=64)
    queue.add(a, 0)
    queue.add(b, 0)
    crashed = make_state("crashed", side=64)
    queue.push_front(crashed)
    assert ids(queue) == ["crashed", "a", "b"]
    assert queue.peek(None) is crashed
    assert queue.peek(32) is crashed  # even during another class's wave
    assert queue.pop(None) is crashed
    assert queue.class_keys() == (32, 64)  # the ring did not turn
    assert queue.deficit(32) == 0


def test_fair_discard_drops_lazily_and_empties_classes() -> None:
    queue = FairQueue(side_key, quantum=None)
    a, b, c = make_state("a", side=32), make_state("b", side=32), make_state("c", side=64)
    for s in (a, b, c):
        queue.add(s, 0)
    queue.discard(a)
    assert len(queue) == 2
    assert queue.peek(None) is b
    queue.discard(b)
    assert queue.class_keys() == (64,)
    assert queue.peek(None) is c
    queue.discard(c)
    queue.discard(c)  # twice: no effect
    assert len(queue) == 0 and queue.peek(None) is None


def test_fair_requeue_goes_to_the_head_of_its_class() -> None:
    queue = FairQueue(side_key, quantum=None)
    a, b = make_state("a", side=32), make_state("b", side=32)
    queue.add(a, 0)
    queue.add(b, 0)
    assert queue.pop(None) is a
    queue.requeue(a)
    assert ids(queue) == ["a", "b"]


def test_policy_queues_work_with_the_real_keys() -> None:
    fair = FairQueue(request_batch_key, quantum=None)
    fair.add(make_state("a"), 0)
    assert fair.class_keys() == (request_batch_key(make_state("a").request),)
