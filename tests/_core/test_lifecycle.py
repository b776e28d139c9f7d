"""Request lifecycle: the states, the one transition function, bounded history."""

from __future__ import annotations

import itertools

import pytest

from omni_trio._core.lifecycle import (
    HISTORY_LIMIT,
    RequestState,
    RequestStatus,
    transition,
)
from omni_trio._core.request import DiffusionRequest
from omni_trio.errors import InvalidTransition

S = RequestStatus
TERMINAL = [S.FINISHED_COMPLETED, S.FINISHED_ABORTED, S.FINISHED_ERROR]
LIVE = [S.WAITING, S.RUNNING, S.PREEMPTED, S.PACKING]

# The diagram in DESIGN.md section 4, written out edge by edge.
ALLOWED = {
    (S.WAITING, S.RUNNING),
    (S.WAITING, S.FINISHED_ABORTED),
    (S.WAITING, S.FINISHED_ERROR),
    (S.RUNNING, S.PREEMPTED),
    (S.RUNNING, S.PACKING),
    (S.RUNNING, S.FINISHED_COMPLETED),
    (S.RUNNING, S.FINISHED_ABORTED),
    (S.RUNNING, S.FINISHED_ERROR),
    (S.PREEMPTED, S.RUNNING),
    (S.PREEMPTED, S.FINISHED_ABORTED),
    (S.PREEMPTED, S.FINISHED_ERROR),
    # Compute done, output still being packed (the batch slot is already free).
    (S.PACKING, S.FINISHED_COMPLETED),
    (S.PACKING, S.FINISHED_ERROR),
    (S.PACKING, S.FINISHED_ABORTED),
    (S.PACKING, S.PREEMPTED),
}
ILLEGAL = sorted(set(itertools.product(S, S)) - ALLOWED)

# The shortest path from WAITING to each state.
PATH_TO = {
    S.WAITING: [],
    S.RUNNING: [S.RUNNING],
    S.PREEMPTED: [S.RUNNING, S.PREEMPTED],
    S.PACKING: [S.RUNNING, S.PACKING],
    S.FINISHED_COMPLETED: [S.RUNNING, S.FINISHED_COMPLETED],
    S.FINISHED_ABORTED: [S.FINISHED_ABORTED],
    S.FINISHED_ERROR: [S.FINISHED_ERROR],
}


def state_in(status: RequestStatus, request_id: str = "r1") -> RequestState:
    state = RequestState(request=DiffusionRequest("p", request_id=request_id), queued_at=0.0)
    for step in PATH_TO[status]:
        transition(state, step)
    assert state.status is status
    return state


def _name(pair: tuple[RequestStatus, RequestStatus]) -> str:
    return f"{pair[0].name}->{pair[1].name}"


def test_new_state_is_waiting_with_history() -> None:
    state = RequestState(request=DiffusionRequest("p", request_id="r9"), queued_at=1.5)
    assert state.status is S.WAITING
    assert state.history == [S.WAITING]
    assert state.request_id == "r9"
    assert state.queued_at == 1.5
    assert state.first_scheduled_at is None
    assert state.finished_at is None
    assert state.error is None and state.error_type is None
    assert state.num_computed_steps == 0
    assert state.num_preemptions == 0
    assert state.sent_to_worker is False


def test_states_do_not_share_history() -> None:
    a, b = state_in(S.WAITING, "a"), state_in(S.WAITING, "b")
    transition(a, S.RUNNING)
    assert b.history == [S.WAITING]


@pytest.mark.parametrize(("start", "finish"), sorted(ALLOWED), ids=map(_name, sorted(ALLOWED)))
def test_allowed_transition(start: RequestStatus, finish: RequestStatus) -> None:
    state = state_in(start)
    before = list(state.history)
    transition(state, finish)
    assert state.status is finish
    assert state.history == [*before, finish]


@pytest.mark.parametrize(("start", "finish"), ILLEGAL, ids=map(_name, ILLEGAL))
def test_illegal_transition_raises_and_changes_nothing(
    start: RequestStatus, finish: RequestStatus
) -> None:
    state = state_in(start, request_id="req-42")
    before = list(state.history)
    with pytest.raises(InvalidTransition) as info:
        transition(state, finish)
    exc = info.value
    assert exc.request_id == "req-42"
    assert exc.start is start
    assert exc.finish is finish
    assert exc.history == tuple(before)
    message = str(exc)
    assert "'req-42'" in message
    assert f"{start.name} -> {finish.name}" in message
    assert " -> ".join(s.name for s in before) in message
    assert state.status is start
    assert state.history == before


def test_every_pair_is_classified() -> None:
    assert len(ALLOWED) + len(ILLEGAL) == len(S) ** 2
    assert len(ILLEGAL) == 34


@pytest.mark.parametrize("status", TERMINAL)
def test_terminal_states_have_no_way_out(status: RequestStatus) -> None:
    for target in S:
        with pytest.raises(InvalidTransition):
            transition(state_in(status), target)


def test_finished_is_an_ordering_comparison() -> None:
    assert [s.finished for s in S] == [False, False, False, False, True, True, True]
    for live, done in itertools.product(LIVE, TERMINAL):
        assert live < done
    assert all(s.finished == (s >= S.FINISHED_COMPLETED) for s in S)


def test_history_is_bounded_and_keeps_the_newest() -> None:
    state = state_in(S.WAITING)
    moves = [S.RUNNING, S.PREEMPTED] * HISTORY_LIMIT + [S.RUNNING, S.FINISHED_COMPLETED]
    for i, move in enumerate(moves):
        transition(state, move)
        assert len(state.history) == min(i + 2, HISTORY_LIMIT)
    assert state.history[-1] is S.FINISHED_COMPLETED
    assert state.history[-2] is S.RUNNING
    assert state.history == ([*moves][-HISTORY_LIMIT:])
    assert S.WAITING not in state.history


def test_illegal_transition_after_long_history_reports_the_bounded_history() -> None:
    state = state_in(S.WAITING)
    for _ in range(HISTORY_LIMIT):
        transition(state, S.RUNNING)
        transition(state, S.PREEMPTED)
    with pytest.raises(InvalidTransition) as info:
        transition(state, S.FINISHED_COMPLETED)
    assert len(info.value.history) == HISTORY_LIMIT
    assert info.value.history[-1] is S.PREEMPTED
