"""The schedulers: pure state machines driven with explicit ``now`` values (a fake clock)."""

from __future__ import annotations

import itertools
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import given, note, settings

from omni_trio._core.keys import request_batch_key, step_batch_key
from omni_trio._core.lifecycle import RequestStatus
from omni_trio._core.messages import BatchRunnerOutput, RunnerOutput, SchedulerOutput
from omni_trio._core.policy import SCHEDULING_POLICIES, request_cost
from omni_trio._core.request import DiffusionRequest, SamplingParams
from omni_trio._core.scheduler import (
    MISSING_OUTPUT_ERROR,
    MISSING_STEP_INDEX_ERROR,
    NO_RESULT_ERROR,
    RequestScheduler,
    Scheduler,
    StepScheduler,
)
from omni_trio.errors import DuplicateRequestError, InvalidTransition

S = RequestStatus
SchedulerType = type[RequestScheduler] | type[StepScheduler]
BOTH: list[SchedulerType] = [RequestScheduler, StepScheduler]
both_modes = pytest.mark.parametrize("cls", BOTH, ids=lambda c: c.mode)


def make_request(
    rid: str,
    *,
    height: int = 64,
    steps: int = 4,
    condition_key: Any = None,
    **sampling: Any,
) -> DiffusionRequest:
    return DiffusionRequest(
        f"prompt of {rid}",
        SamplingParams(height=height, width=64, num_inference_steps=steps, **sampling),
        request_id=rid,
        condition_key=condition_key,
    )


def done(rid: str, steps: int = 4) -> RunnerOutput:
    """An output that completes ``rid`` in either mode (request mode ignores step fields)."""
    return RunnerOutput(rid, images=(f"image of {rid}",), step_index=steps, finished=True)


def step(rid: str, step_index: int, *, finished: bool = False) -> RunnerOutput:
    return RunnerOutput(rid, step_index=step_index, finished=finished)


def batch(*outputs: RunnerOutput) -> BatchRunnerOutput:
    return BatchRunnerOutput.from_list(outputs)


def add_all(sched: Scheduler, *rids: str, now: float = 0.0, **kw: Any) -> None:
    for rid in rids:
        sched.add_request(make_request(rid, **kw), now)


def new_ids(out: SchedulerOutput) -> list[str]:
    return [r.request_id for r in out.scheduled_new_reqs]


def status(sched: Scheduler, rid: str) -> RequestStatus:
    state = sched.get_request_state(rid)
    assert state is not None, rid
    return state.status


# -- construction -------------------------------------------------------------------------


@both_modes
@pytest.mark.parametrize("capacity", [0, -1, 1.5, True, "2"], ids=repr)
def test_capacity_must_be_a_positive_int(cls: SchedulerType, capacity: Any) -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        cls(capacity)


@pytest.mark.parametrize("wait", [-1.0, float("nan"), float("inf")], ids=repr)
def test_request_batch_max_wait_must_be_finite_and_non_negative(wait: float) -> None:
    with pytest.raises(ValueError, match="request_batch_max_wait_ms"):
        RequestScheduler(2, wait)


def test_modes_and_keys() -> None:
    assert RequestScheduler.mode == "request"
    assert StepScheduler.mode == "step"
    assert RequestScheduler(2)._key_fn is request_batch_key
    assert StepScheduler(2)._key_fn is step_batch_key


# -- admission ------------------------------------------------------------------------------


@both_modes
def test_add_request_queues_as_waiting(cls: SchedulerType) -> None:
    sched = cls(2)
    assert not sched.has_unfinished_requests()
    state = sched.add_request(make_request("r1"), 3.5)
    assert state.status is S.WAITING
    assert state.queued_at == 3.5
    assert state.first_scheduled_at is None
    assert sched.get_request_state("r1") is state
    assert sched.num_waiting == 1
    assert sched.num_running == 0
    assert sched.has_unfinished_requests()
    assert sched.live_request_ids() == ["r1"]


@both_modes
def test_capacity_limits_the_wave(cls: SchedulerType) -> None:
    sched = cls(3)
    add_all(sched, "r0", "r1", "r2", "r3", "r4")
    out = sched.schedule(1.0)
    assert new_ids(out) == ["r0", "r1", "r2"]
    assert out.num_running_reqs == 3
    assert out.num_waiting_reqs == 2
    assert sched.running_request_ids() == ("r0", "r1", "r2")
    assert [status(sched, r) for r in ("r0", "r3")] == [S.RUNNING, S.WAITING]


@both_modes
def test_queue_position_counts_who_starts_first(cls: SchedulerType) -> None:
    sched = cls(1, policy="priority")
    add_all(sched, "a", "b")
    sched.add_request(make_request("urgent", priority=-1), 0.0)
    assert [sched.queue_position(r) for r in ("urgent", "a", "b")] == [0, 1, 2]
    out = sched.schedule(1.0)
    assert new_ids(out) == ["urgent"]
    assert sched.queue_position("urgent") is None  # running: not waiting
    assert [sched.queue_position(r) for r in ("a", "b")] == [0, 1]
    assert sched.queue_position("unknown") is None


@both_modes
def test_capacity_one_runs_one_at_a_time_in_fifo_order(cls: SchedulerType) -> None:
    sched = cls(1)
    add_all(sched, "a", "b", "c")
    order = []
    for t in range(3):
        out = sched.schedule(float(t))
        assert len(out.scheduled_request_ids) == 1
        order.extend(out.scheduled_request_ids)
        sched.update_from_output(out, batch(done(order[-1])), float(t))
    assert order == ["a", "b", "c"]
    assert not sched.has_unfinished_requests()


@both_modes
def test_incompatible_head_blocks_later_compatible_requests(cls: SchedulerType) -> None:
    sched = cls(4)
    sched.add_request(make_request("a1", height=64), 0.0)
    sched.add_request(make_request("b1", height=128), 0.0)
    sched.add_request(make_request("a2", height=64), 0.0)
    out = sched.schedule(1.0)
    # a2 matches the running wave but may not jump ahead of b1.
    assert out.scheduled_request_ids == ("a1",)
    assert status(sched, "a2") is S.WAITING
    sched.update_from_output(out, batch(done("a1")), 2.0)
    out = sched.schedule(3.0)
    assert new_ids(out) == ["b1"]  # b1 now heads the queue; a2 is incompatible with it
    sched.update_from_output(out, batch(done("b1")), 4.0)
    out = sched.schedule(5.0)
    assert new_ids(out) == ["a2"]


@both_modes
def test_a_wave_holds_only_compatible_requests(cls: SchedulerType) -> None:
    sched = cls(4)
    sched.add_request(make_request("a1", guidance_scale=7.5), 0.0)
    sched.add_request(make_request("a2", guidance_scale=7.5), 0.0)
    sched.add_request(make_request("b1", guidance_scale=1.0), 0.0)
    sched.add_request(make_request("a3", guidance_scale=7.5), 0.0)
    out = sched.schedule(1.0)
    assert new_ids(out) == ["a1", "a2"]
    keys = {sched._key_fn(sched.get_request_state(r).request) for r in sched.running_request_ids()}  # type: ignore[union-attr]
    assert len(keys) == 1


@both_modes
def test_condition_key_separates_waves(cls: SchedulerType) -> None:
    sched = cls(4)
    sched.add_request(make_request("a", condition_key="ref-1"), 0.0)
    sched.add_request(make_request("b", condition_key="ref-2"), 0.0)
    assert sched.schedule(1.0).scheduled_request_ids == ("a",)


def test_request_mode_waves_need_equal_step_counts() -> None:
    sched = RequestScheduler(4)
    sched.add_request(make_request("a", steps=4), 0.0)
    sched.add_request(make_request("b", steps=8), 0.0)
    assert sched.schedule(1.0).scheduled_request_ids == ("a",)


def test_step_mode_batches_different_step_counts() -> None:
    sched = StepScheduler(4)
    sched.add_request(make_request("a", steps=4), 0.0)
    sched.add_request(make_request("b", steps=8), 0.0)
    sched.add_request(make_request("c", steps=2, timesteps=(999.0, 1.0)), 0.0)
    assert new_ids(sched.schedule(1.0)) == ["a", "b", "c"]


def test_request_mode_admits_no_new_wave_while_one_is_in_flight() -> None:
    sched = RequestScheduler(4)
    add_all(sched, "r1")
    first = sched.schedule(1.0)
    add_all(sched, "r2", now=1.5)  # compatible, and there is room
    second = sched.schedule(2.0)
    assert second.is_empty
    assert second.num_running_reqs == 1
    assert second.num_waiting_reqs == 1
    sched.update_from_output(first, batch(done("r1")), 3.0)
    assert new_ids(sched.schedule(4.0)) == ["r2"]


def test_step_mode_joins_the_running_batch_at_a_step_boundary() -> None:
    sched = StepScheduler(4)
    add_all(sched, "r1")
    out = sched.schedule(1.0)
    sched.update_from_output(out, batch(step("r1", 1)), 1.5)
    add_all(sched, "r2", now=1.6)
    out = sched.schedule(2.0)
    assert new_ids(out) == ["r2"]
    assert out.scheduled_cached_reqs == ("r1",)
    assert out.scheduled_request_ids == ("r2", "r1")


@both_modes
def test_step_id_counts_schedule_calls(cls: SchedulerType) -> None:
    sched = cls(1)
    assert sched.step_id == 0
    assert [sched.schedule(float(t)).step_id for t in range(3)] == [1, 2, 3]
    assert sched.step_id == 3


@both_modes
def test_empty_schedule(cls: SchedulerType) -> None:
    out = cls(2).schedule(0.0)
    assert out.is_empty
    assert out.finished_req_ids == frozenset()
    assert out.num_running_reqs == 0 and out.num_waiting_reqs == 0


# -- duplicate ids ----------------------------------------------------------------------------


@both_modes
def test_duplicate_waiting_id_is_rejected(cls: SchedulerType) -> None:
    sched = cls(2)
    first = sched.add_request(make_request("r1"), 0.0)
    with pytest.raises(DuplicateRequestError) as info:
        sched.add_request(make_request("r1", height=128), 1.0)
    assert info.value.request_id == "r1"
    assert sched.get_request_state("r1") is first
    assert sched.num_waiting == 1


@both_modes
def test_duplicate_running_id_is_rejected(cls: SchedulerType) -> None:
    sched = cls(2)
    add_all(sched, "r1")
    sched.schedule(1.0)
    with pytest.raises(DuplicateRequestError):
        sched.add_request(make_request("r1"), 2.0)
    assert sched.num_waiting == 0


@both_modes
def test_terminal_but_not_popped_id_is_still_a_duplicate(cls: SchedulerType) -> None:
    sched = cls(2)
    add_all(sched, "r1")
    out = sched.schedule(1.0)
    assert sched.update_from_output(out, batch(done("r1")), 2.0) == ["r1"]
    with pytest.raises(DuplicateRequestError):
        sched.add_request(make_request("r1"), 3.0)
    sched.finish_requests("r1", S.FINISHED_ABORTED, 3.0)  # no effect on a finished id
    with pytest.raises(DuplicateRequestError):
        sched.add_request(make_request("r1"), 3.0)


@both_modes
def test_id_can_be_reused_after_pop(cls: SchedulerType) -> None:
    sched = cls(2)
    add_all(sched, "r1")
    sched.finish_requests("r1", S.FINISHED_ABORTED, 1.0)
    old = sched.pop_request_state("r1")
    assert old is not None and old.status is S.FINISHED_ABORTED
    again = sched.add_request(make_request("r1"), 2.0)
    assert again is not old
    assert again.status is S.WAITING
    out = sched.schedule(3.0)
    assert new_ids(out) == ["r1"]
    assert out.finished_req_ids == {"r1"}  # the first incarnation's terminal report


# -- pop --------------------------------------------------------------------------------------


@both_modes
def test_pop_request_state(cls: SchedulerType) -> None:
    sched = cls(2)
    assert sched.pop_request_state("ghost") is None
    add_all(sched, "r1", "r2")
    with pytest.raises(ValueError, match="WAITING"):
        sched.pop_request_state("r1")
    out = sched.schedule(1.0)
    with pytest.raises(ValueError, match="RUNNING"):
        sched.pop_request_state("r1")
    sched.update_from_output(out, batch(done("r1"), done("r2")), 2.0)
    assert sorted(sched.pending_finished_request_ids()) == ["r1", "r2"]
    state = sched.pop_request_state("r1")
    assert state is not None and state.status is S.FINISHED_COMPLETED
    assert sched.get_request_state("r1") is None
    assert sched.pop_request_state("r1") is None
    assert sched.pending_finished_request_ids() == ["r2"]


# -- finished reporting -----------------------------------------------------------------------


@both_modes
def test_finished_ids_are_reported_once_in_the_next_schedule(cls: SchedulerType) -> None:
    sched = cls(2)
    add_all(sched, "r1", "r2")
    out = sched.schedule(1.0)
    assert out.finished_req_ids == frozenset()
    assert sched.update_from_output(out, batch(done("r1"), done("r2")), 2.0) == ["r1", "r2"]
    assert sched.schedule(3.0).finished_req_ids == {"r1", "r2"}
    assert sched.schedule(4.0).finished_req_ids == frozenset()


@both_modes
def test_has_finished_to_report_until_the_next_schedule(cls: SchedulerType) -> None:
    sched = cls(2)
    add_all(sched, "r1", "r2")
    assert not sched.has_finished_to_report()
    sched.finish_requests("r2", S.FINISHED_ABORTED, 1.0)
    assert sched.has_finished_to_report()
    out = sched.schedule(2.0)
    assert not sched.has_finished_to_report()
    sched.update_from_output(out, batch(done("r1")), 3.0)
    assert sched.has_finished_to_report()
    sched.pop_request_state("r1")
    assert sched.has_finished_to_report()  # popping the state does not cancel the report
    sched.schedule(4.0)
    assert not sched.has_finished_to_report()


@both_modes
def test_finished_id_is_reported_even_after_pop(cls: SchedulerType) -> None:
    sched = cls(2)
    add_all(sched, "r1")
    sched.finish_requests("r1", S.FINISHED_ABORTED, 1.0)
    sched.pop_request_state("r1")
    assert sched.schedule(2.0).finished_req_ids == {"r1"}
    assert sched.schedule(3.0).finished_req_ids == frozenset()


# -- runner outputs -----------------------------------------------------------------------


@both_modes
def test_completed_output(cls: SchedulerType) -> None:
    sched = cls(2)
    add_all(sched, "r1")
    out = sched.schedule(1.0)
    assert sched.update_from_output(out, batch(done("r1")), 2.5) == ["r1"]
    state = sched.get_request_state("r1")
    assert state is not None
    assert state.status is S.FINISHED_COMPLETED
    assert state.finished_at == 2.5
    assert state.error is None and state.error_type is None
    assert not sched.has_unfinished_requests()
    assert sched.num_running == 0


@both_modes
def test_missing_runner_output_is_an_error(cls: SchedulerType) -> None:
    sched = cls(2)
    add_all(sched, "r1", "r2")
    out = sched.schedule(1.0)
    assert sched.update_from_output(out, batch(done("r2")), 2.0) == ["r1", "r2"]
    state = sched.get_request_state("r1")
    assert state is not None
    assert state.status is S.FINISHED_ERROR
    assert state.error == MISSING_OUTPUT_ERROR
    assert "without an output for this request" in state.error
    assert state.error_type == "MissingOutputError"
    assert status(sched, "r2") is S.FINISHED_COMPLETED


@both_modes
def test_runner_error_finishes_with_its_text_and_type(cls: SchedulerType) -> None:
    sched = cls(2)
    add_all(sched, "r1")
    out = sched.schedule(1.0)
    err = RunnerOutput.from_exception("r1", MemoryError("out of memory"))
    assert sched.update_from_output(out, batch(err), 2.0) == ["r1"]
    state = sched.get_request_state("r1")
    assert state is not None
    assert state.status is S.FINISHED_ERROR
    assert state.error == "out of memory"
    assert state.error_type == "MemoryError"


@both_modes
def test_aborted_output_finishes_aborted(cls: SchedulerType) -> None:
    sched = cls(2)
    add_all(sched, "r1")
    out = sched.schedule(1.0)
    assert sched.update_from_output(out, batch(RunnerOutput("r1", aborted=True)), 2.0) == ["r1"]
    state = sched.get_request_state("r1")
    assert state is not None
    assert state.status is S.FINISHED_ABORTED
    assert state.error == "Request r1 aborted."
    assert state.error_type == "RequestAbortedError"


@both_modes
def test_outputs_for_unscheduled_ids_are_ignored(cls: SchedulerType) -> None:
    sched = cls(1)
    add_all(sched, "r1", "r2")
    out = sched.schedule(1.0)
    assert sched.update_from_output(out, batch(done("r1"), done("r2")), 2.0) == ["r1"]
    assert status(sched, "r2") is S.WAITING


def test_request_mode_async_output_id_moves_to_packing_and_frees_the_slot() -> None:
    sched = RequestScheduler(1)
    add_all(sched, "r1", "r2")
    out = sched.schedule(1.0)
    result = RunnerOutput("r1", async_output_id="b1/r1")
    # Compute done, output still packing: not terminal, but out of the batch.
    assert sched.update_from_output(out, batch(result), 2.0) == []
    assert status(sched, "r1") is S.PACKING
    assert (sched.num_running, sched.num_packing) == (0, 1)
    assert sched.packing_request_ids() == ("r1",)
    assert sched.live_request_ids() == ["r1", "r2"]
    # The next wave is admitted while r1's output is packed.
    assert sched.schedule(2.5).scheduled_request_ids == ("r2",)
    # The output arrives: r1 completes, and is reported finished once.
    assert sched.finish_requests("r1", S.FINISHED_COMPLETED, 3.0) == ["r1"]
    assert sched.num_packing == 0
    state = sched.get_request_state("r1")
    assert state is not None
    assert state.history == [S.WAITING, S.RUNNING, S.PACKING, S.FINISHED_COMPLETED]
    assert state.finished_at == 3.0


def test_a_packing_request_whose_output_is_lost_goes_back_to_the_front() -> None:
    sched = RequestScheduler(1)
    add_all(sched, "r1", "r2")
    out = sched.schedule(1.0)
    sched.update_from_output(out, batch(RunnerOutput("r1", async_output_id="b1/r1")), 2.0)
    assert sched.preempt_request("r1") is True
    state = sched.get_request_state("r1")
    assert state is not None
    assert state.history == [S.WAITING, S.RUNNING, S.PACKING, S.PREEMPTED]
    assert (sched.num_packing, sched.num_waiting) == (0, 2)
    assert sched.schedule(3.0).scheduled_request_ids == ("r1",)


def test_request_mode_output_without_result_is_an_error() -> None:
    sched = RequestScheduler(1)
    add_all(sched, "r1")
    out = sched.schedule(1.0)
    assert sched.update_from_output(out, batch(RunnerOutput("r1")), 2.0) == ["r1"]
    state = sched.get_request_state("r1")
    assert state is not None
    assert state.status is S.FINISHED_ERROR
    assert state.error == NO_RESULT_ERROR
    assert state.error_type == "MissingOutputError"


def test_request_mode_resolves_the_whole_wave_in_one_update() -> None:
    sched = RequestScheduler(3)
    add_all(sched, "ok", "bad", "gone")
    out = sched.schedule(1.0)
    outputs = batch(done("ok"), RunnerOutput("bad", error="boom", error_type="ValueError"))
    assert sched.update_from_output(out, outputs, 2.0) == ["ok", "bad", "gone"]
    assert sched.num_running == 0
    assert [status(sched, r) for r in ("ok", "bad", "gone")] == [
        S.FINISHED_COMPLETED,
        S.FINISHED_ERROR,
        S.FINISHED_ERROR,
    ]


# -- finish_requests / abort ----------------------------------------------------------------


@both_modes
def test_abort_waiting_request_is_never_scheduled(cls: SchedulerType) -> None:
    sched = cls(4)
    add_all(sched, "r1", "r2", "r3")
    assert sched.finish_requests(["r2"], S.FINISHED_ABORTED, 1.0) == ["r2"]
    assert sched.num_waiting == 2
    assert sched.live_request_ids() == ["r1", "r3"]
    state = sched.get_request_state("r2")
    assert state is not None
    assert state.status is S.FINISHED_ABORTED
    assert state.finished_at == 1.0
    assert state.first_scheduled_at is None
    out = sched.schedule(2.0)
    assert new_ids(out) == ["r1", "r3"]
    assert out.finished_req_ids == {"r2"}
    sched.update_from_output(out, batch(done("r1"), done("r3")), 3.0)
    assert "r2" not in sched.schedule(4.0).scheduled_request_ids


@both_modes
def test_aborted_head_does_not_block_the_queue(cls: SchedulerType) -> None:
    sched = cls(2)
    sched.add_request(make_request("blocker", height=128), 0.0)
    add_all(sched, "r1", "r2")
    sched.finish_requests("blocker", S.FINISHED_ABORTED, 0.5)
    assert new_ids(sched.schedule(1.0)) == ["r1", "r2"]


@both_modes
def test_abort_running_request_ignores_its_late_result(cls: SchedulerType) -> None:
    sched = cls(2)
    add_all(sched, "r1", "r2")
    out = sched.schedule(1.0)
    assert sched.finish_requests("r1", S.FINISHED_ABORTED, 1.5) == ["r1"]
    assert sched.running_request_ids() == ("r2",)
    # The worker finished r1 anyway; that late result must not be delivered.
    assert sched.update_from_output(out, batch(done("r1"), done("r2")), 2.0) == ["r2"]
    state = sched.get_request_state("r1")
    assert state is not None
    assert state.status is S.FINISHED_ABORTED
    assert state.finished_at == 1.5
    assert sched.schedule(3.0).finished_req_ids == {"r1", "r2"}


@both_modes
def test_abort_unknown_or_finished_ids_is_ignored(cls: SchedulerType) -> None:
    sched = cls(2)
    add_all(sched, "r1")
    assert sched.finish_requests(["ghost"], S.FINISHED_ABORTED, 1.0) == []
    assert sched.finish_requests(["r1", "r1"], S.FINISHED_ABORTED, 1.0) == ["r1"]
    assert sched.finish_requests("r1", S.FINISHED_ERROR, 2.0) == []
    assert status(sched, "r1") is S.FINISHED_ABORTED
    assert sched.schedule(3.0).finished_req_ids == {"r1"}


@both_modes
def test_finish_requests_needs_a_terminal_status(cls: SchedulerType) -> None:
    sched = cls(2)
    add_all(sched, "r1")
    with pytest.raises(ValueError, match="terminal"):
        sched.finish_requests("r1", S.PREEMPTED, 1.0)
    assert status(sched, "r1") is S.WAITING


@both_modes
def test_finish_with_error_status_and_messages(cls: SchedulerType) -> None:
    sched = cls(2)
    add_all(sched, "r1", "r2", "r3")
    sched.finish_requests("r1", S.FINISHED_ERROR, 1.0)
    sched.finish_requests(
        "r2", S.FINISHED_ERROR, 1.0, error="worker died", error_type="WorkerError"
    )
    sched.finish_requests("r3", S.FINISHED_ABORTED, 1.0, error="deadline exceeded")
    s1, s2, s3 = (sched.get_request_state(r) for r in ("r1", "r2", "r3"))
    assert s1 is not None and s2 is not None and s3 is not None
    assert (s1.status, s1.error, s1.error_type) == (
        S.FINISHED_ERROR,
        "request failed",
        "RequestFailedError",
    )
    assert (s2.error, s2.error_type) == ("worker died", "WorkerError")
    assert (s3.status, s3.error, s3.error_type) == (
        S.FINISHED_ABORTED,
        "deadline exceeded",
        "RequestAbortedError",
    )


@both_modes
def test_illegal_finish_raises_and_leaves_the_request_queued(cls: SchedulerType) -> None:
    sched = cls(2)
    add_all(sched, "r1")
    with pytest.raises(InvalidTransition) as info:
        sched.finish_requests("r1", S.FINISHED_COMPLETED, 1.0)
    assert info.value.start is S.WAITING
    assert info.value.finish is S.FINISHED_COMPLETED
    assert status(sched, "r1") is S.WAITING
    assert sched.num_waiting == 1
    assert sched.live_request_ids() == ["r1"]
    out = sched.schedule(2.0)
    assert new_ids(out) == ["r1"]
    assert out.finished_req_ids == frozenset()


# -- preemption -------------------------------------------------------------------------------


@both_modes
def test_preempt_moves_running_request_to_the_front(cls: SchedulerType) -> None:
    sched = cls(2)
    add_all(sched, "r1", "r2", "r3")
    sched.schedule(1.0)
    assert sched.preempt_request("r2") is True
    state = sched.get_request_state("r2")
    assert state is not None
    assert state.status is S.PREEMPTED
    assert state.num_preemptions == 1
    assert sched.running_request_ids() == ("r1",)
    assert sched.live_request_ids() == ["r1", "r2", "r3"]
    assert sched.num_waiting == 2


@both_modes
def test_preempt_only_running_requests(cls: SchedulerType) -> None:
    sched = cls(1)
    add_all(sched, "r1", "r2")
    sched.schedule(1.0)
    assert sched.preempt_request("r2") is False  # waiting
    assert sched.preempt_request("ghost") is False
    sched.finish_requests("r1", S.FINISHED_ABORTED, 2.0)
    assert sched.preempt_request("r1") is False  # finished
    assert status(sched, "r2") is S.WAITING
    assert status(sched, "r1") is S.FINISHED_ABORTED


def test_request_mode_preempted_request_is_sent_again_whole() -> None:
    sched = RequestScheduler(2)
    add_all(sched, "r1", "r2")
    sched.schedule(1.0)
    assert sched.preempt_request("r1")
    assert sched.preempt_request("r2")
    out = sched.schedule(2.0)
    # Each preemption pushes to the front, so the last preempted comes back first.
    assert new_ids(out) == ["r2", "r1"]
    assert out.scheduled_cached_reqs == ()
    assert [status(sched, r) for r in ("r1", "r2")] == [S.RUNNING, S.RUNNING]
    assert sched.get_request_state("r1").history == [  # type: ignore[union-attr]
        S.WAITING,
        S.RUNNING,
        S.PREEMPTED,
        S.RUNNING,
    ]


def test_step_mode_preempted_request_keeps_progress_and_returns_as_cached() -> None:
    sched = StepScheduler(2)
    add_all(sched, "r1", steps=4)
    out = sched.schedule(1.0)
    sched.update_from_output(out, batch(step("r1", 2)), 1.5)
    assert sched.preempt_request("r1")
    state = sched.get_request_state("r1")
    assert state is not None
    assert state.num_computed_steps == 2
    assert state.sent_to_worker
    out = sched.schedule(2.0)
    assert out.scheduled_new_reqs == ()
    assert out.scheduled_cached_reqs == ("r1",)
    assert state.status is S.RUNNING


def test_step_mode_preempt_with_reset_sends_the_payload_again() -> None:
    sched = StepScheduler(2)
    add_all(sched, "r1", steps=4)
    out = sched.schedule(1.0)
    sched.update_from_output(out, batch(step("r1", 3)), 1.5)
    assert sched.preempt_request("r1", reset_progress=True)
    state = sched.get_request_state("r1")
    assert state is not None
    assert state.num_computed_steps == 0
    assert not state.sent_to_worker
    out = sched.schedule(2.0)
    assert new_ids(out) == ["r1"]
    assert out.scheduled_cached_reqs == ()
    assert state.sent_to_worker


@both_modes
def test_preempted_request_goes_ahead_of_an_incompatible_head(cls: SchedulerType) -> None:
    sched = cls(2)
    add_all(sched, "a1")
    sched.schedule(1.0)
    sched.add_request(make_request("b1", height=128), 1.5)
    sched.preempt_request("a1")
    out = sched.schedule(2.0)
    assert out.scheduled_request_ids == ("a1",)
    assert status(sched, "b1") is S.WAITING


@both_modes
def test_preempted_request_can_be_aborted(cls: SchedulerType) -> None:
    sched = cls(2)
    add_all(sched, "r1")
    sched.schedule(1.0)
    sched.preempt_request("r1")
    assert sched.finish_requests("r1", S.FINISHED_ABORTED, 2.0) == ["r1"]
    assert sched.num_waiting == 0
    assert not sched.has_unfinished_requests()
    out = sched.schedule(3.0)
    assert out.is_empty
    assert out.finished_req_ids == {"r1"}


@both_modes
def test_result_for_a_preempted_request_is_ignored(cls: SchedulerType) -> None:
    sched = cls(2)
    add_all(sched, "r1", "r2")
    out = sched.schedule(1.0)
    sched.preempt_request("r1")
    assert sched.update_from_output(out, batch(done("r1"), done("r2")), 2.0) == ["r2"]
    assert status(sched, "r1") is S.PREEMPTED


# -- step progress ----------------------------------------------------------------------------


def test_step_mode_tracks_progress_until_the_runner_says_finished() -> None:
    sched = StepScheduler(1)
    add_all(sched, "r1", steps=3)
    state = sched.get_request_state("r1")
    assert state is not None and state.total_steps == 3
    for i in (1, 2, 3):
        out = sched.schedule(float(i))
        assert out.scheduled_request_ids == ("r1",)
        # Step 3 of 3 is done, but only the runner decides that denoising is complete.
        assert sched.update_from_output(out, batch(step("r1", i)), i + 0.5) == []
        assert state.num_computed_steps == i
        assert state.status is S.RUNNING
    out = sched.schedule(4.0)
    assert out.scheduled_new_reqs == ()
    assert out.scheduled_cached_reqs == ("r1",)
    assert sched.update_from_output(out, batch(step("r1", 3, finished=True)), 4.5) == ["r1"]
    assert state.status is S.FINISHED_COMPLETED
    assert state.finished_at == 4.5


def test_step_mode_finishes_early_when_the_runner_says_so() -> None:
    sched = StepScheduler(1)
    add_all(sched, "r1", steps=10)
    out = sched.schedule(1.0)
    assert sched.update_from_output(out, batch(step("r1", 2, finished=True)), 2.0) == ["r1"]
    state = sched.get_request_state("r1")
    assert state is not None
    assert state.status is S.FINISHED_COMPLETED
    assert state.num_computed_steps == 2


def test_step_mode_preview_chunk_keeps_running() -> None:
    sched = StepScheduler(1)
    add_all(sched, "r1")
    out = sched.schedule(1.0)
    preview = RunnerOutput("r1", images=("preview",), step_index=1, finished=False)
    assert sched.update_from_output(out, batch(preview), 2.0) == []
    assert status(sched, "r1") is S.RUNNING


def test_step_mode_missing_step_index_is_an_error() -> None:
    sched = StepScheduler(1)
    add_all(sched, "r1")
    out = sched.schedule(1.0)
    bad = RunnerOutput("r1", images=("img",), finished=True)
    assert sched.update_from_output(out, batch(bad), 2.0) == ["r1"]
    state = sched.get_request_state("r1")
    assert state is not None
    assert state.status is S.FINISHED_ERROR
    assert state.error == MISSING_STEP_INDEX_ERROR
    assert state.error_type == "MissingOutputError"


@pytest.mark.parametrize(
    ("sampling", "expected"),
    [
        ({"steps": 5}, 5),
        ({"steps": 5, "sigmas": (1.0, 0.5, 0.0)}, 3),
        ({"steps": 5, "timesteps": (999.0, 1.0)}, 2),
        ({"steps": 5, "timesteps": (999.0,), "sigmas": (1.0, 0.5, 0.0)}, 1),
    ],
)
def test_step_mode_total_steps_precedence(sampling: dict[str, Any], expected: int) -> None:
    state = StepScheduler(1).add_request(make_request("r1", **sampling), 0.0)
    assert state.total_steps == expected


def test_step_mode_rejects_a_request_without_steps() -> None:
    sched = StepScheduler(1)
    with pytest.raises(ValueError, match="no denoising steps"):
        sched.add_request(make_request("r1", timesteps=()), 0.0)
    assert sched.get_request_state("r1") is None
    assert sched.num_waiting == 0


def test_step_mode_one_error_in_a_mixed_batch_finishes_only_that_request() -> None:
    sched = StepScheduler(3)
    add_all(sched, "a", "b", "c", steps=4)
    out = sched.schedule(1.0)
    outputs = batch(
        step("a", 1),
        RunnerOutput("b", error="NaN latents", error_type="FloatingPointError"),
        step("c", 1),
    )
    assert sched.update_from_output(out, outputs, 2.0) == ["b"]
    assert sched.running_request_ids() == ("a", "c")
    state = sched.get_request_state("b")
    assert state is not None
    assert (state.status, state.error, state.error_type) == (
        S.FINISHED_ERROR,
        "NaN latents",
        "FloatingPointError",
    )
    out = sched.schedule(3.0)
    assert out.scheduled_cached_reqs == ("a", "c")
    assert out.finished_req_ids == {"b"}


def test_step_mode_freed_capacity_admits_the_next_request() -> None:
    sched = StepScheduler(2)
    add_all(sched, "a", "b", "c")
    out = sched.schedule(1.0)
    sched.update_from_output(out, batch(step("a", 1, finished=True), step("b", 1)), 2.0)
    out = sched.schedule(3.0)
    assert new_ids(out) == ["c"]
    assert out.scheduled_cached_reqs == ("b",)


# -- times ------------------------------------------------------------------------------------


@both_modes
def test_times_are_recorded(cls: SchedulerType) -> None:
    sched = cls(1)
    sched.add_request(make_request("r1"), 10.0)
    sched.add_request(make_request("r2"), 11.0)
    out = sched.schedule(12.0)
    sched.preempt_request("r1")
    out = sched.schedule(13.0)  # r1 again: first_scheduled_at stays
    sched.update_from_output(out, batch(done("r1")), 14.0)
    out = sched.schedule(15.0)
    sched.update_from_output(out, batch(done("r2")), 16.0)
    s1, s2 = sched.get_request_state("r1"), sched.get_request_state("r2")
    assert s1 is not None and s2 is not None
    assert (s1.queued_at, s1.first_scheduled_at, s1.finished_at) == (10.0, 12.0, 14.0)
    assert (s2.queued_at, s2.first_scheduled_at, s2.finished_at) == (11.0, 15.0, 16.0)


# -- admission coalescing (request mode) ------------------------------------------------------


def coalescing(capacity: int = 4, wait_ms: float = 250.0) -> RequestScheduler:
    return RequestScheduler(capacity, wait_ms)


def test_stable_window_is_min_of_50ms_and_a_fifth_of_the_wait() -> None:
    assert coalescing(wait_ms=250.0).stable_window_s == 0.05
    assert coalescing(wait_ms=1000.0).stable_window_s == 0.05
    assert coalescing(wait_ms=100.0).stable_window_s == 0.1 / 5
    assert coalescing(wait_ms=100.0).max_wait_s == 0.1


def test_no_wait_when_max_wait_is_zero() -> None:
    sched = coalescing(wait_ms=0.0)
    add_all(sched, "r1", now=10.0)
    assert sched.admission_wait(10.0) is None


def test_no_wait_with_capacity_one() -> None:
    sched = coalescing(capacity=1)
    add_all(sched, "r1", now=10.0)
    assert sched.admission_wait(10.0) is None


def test_no_wait_with_an_empty_queue() -> None:
    assert coalescing().admission_wait(10.0) is None


def test_no_wait_while_something_is_running() -> None:
    sched = coalescing()
    add_all(sched, "r1", now=10.0)
    sched.schedule(10.0)
    add_all(sched, "r2", now=10.01)
    assert sched.admission_wait(10.01) is None


def test_step_and_base_schedulers_never_wait() -> None:
    sched = StepScheduler(4)
    add_all(sched, "r1", now=10.0)
    assert sched.admission_wait(10.0) is None


def test_wait_ends_on_a_full_wave() -> None:
    sched = coalescing(capacity=3)
    add_all(sched, "r1", now=10.0)
    assert sched.admission_wait(10.0) == 10.0 + 0.05
    add_all(sched, "r2", "r3", now=10.01)
    assert sched.admission_wait(10.01) is None


def test_wait_ends_after_the_quiet_window() -> None:
    sched = coalescing()
    add_all(sched, "r1", now=10.0)
    assert sched.admission_wait(10.0) == 10.0 + 0.05
    assert sched.admission_wait(10.04) == 10.0 + 0.05
    assert sched.admission_wait(10.0 + 0.05) is None


def test_quiet_window_restarts_when_the_queue_grows() -> None:
    sched = coalescing()
    add_all(sched, "r1", now=10.0)
    assert sched.admission_wait(10.0) == 10.0 + 0.05
    add_all(sched, "r2", now=10.03)
    assert sched.admission_wait(10.03) == 10.03 + 0.05
    assert sched.admission_wait(10.0 + 0.05) == 10.03 + 0.05
    assert sched.admission_wait(10.03 + 0.05) is None


def test_short_wait_uses_a_fifth_of_it_as_quiet_window() -> None:
    sched = coalescing(wait_ms=100.0)
    add_all(sched, "r1", now=5.0)
    assert sched.admission_wait(5.0) == 5.0 + 0.1 / 5


def test_wait_ends_at_the_deadline_despite_a_steady_trickle() -> None:
    sched = coalescing(capacity=16)
    deadline = 10.0 + 0.25
    for i, t in enumerate([10.0, 10.04, 10.08, 10.12, 10.16, 10.2]):
        add_all(sched, f"r{i}", now=t)
        assert sched.admission_wait(t) == t + 0.05
    add_all(sched, "late", now=10.24)
    assert sched.admission_wait(10.24) == deadline  # quiet window would end at 10.29
    assert sched.admission_wait(10.2499) == deadline
    assert sched.admission_wait(deadline) is None


def test_deadline_counts_from_when_the_wait_began() -> None:
    sched = coalescing(capacity=16, wait_ms=100.0)  # quiet window 20 ms
    add_all(sched, "r1", now=3.0)
    assert sched.admission_wait(3.01) == 3.0 + 0.02  # the queue last grew at 3.0
    add_all(sched, "r2", now=3.1)  # not past a deadline counted from the add (3.0 + 0.1)
    assert sched.admission_wait(3.1) == 3.01 + 0.1  # deadline: 100 ms after 3.01


def test_after_a_wave_a_new_wait_starts_fresh() -> None:
    sched = coalescing()
    add_all(sched, "r1", now=10.0)
    assert sched.admission_wait(10.0) == 10.0 + 0.05
    assert sched.admission_wait(10.0 + 0.05) is None
    out = sched.schedule(10.05)
    sched.update_from_output(out, batch(done("r1")), 11.0)
    add_all(sched, "r2", now=20.0)
    assert sched.admission_wait(20.0) == 20.0 + 0.05
    add_all(sched, "r3", now=20.04)
    assert sched.admission_wait(20.04) == 20.04 + 0.05  # deadline 20.25 is further away


def test_queued_during_a_wave_are_admitted_without_waiting() -> None:
    sched = coalescing()
    add_all(sched, "r1", now=10.0)
    out = sched.schedule(10.1)
    add_all(sched, "r2", now=10.2)
    sched.update_from_output(out, batch(done("r1")), 12.0)
    assert sched.admission_wait(12.0) is None  # r2 has been quiet for far longer than 50 ms


def test_aborting_every_waiting_request_ends_the_wait() -> None:
    sched = coalescing()
    add_all(sched, "r1", now=10.0)
    assert sched.admission_wait(10.0) == 10.0 + 0.05
    sched.finish_requests("r1", S.FINISHED_ABORTED, 10.01)
    assert sched.admission_wait(10.01) is None


@both_modes
def test_a_solo_request_never_shares_a_wave(cls: SchedulerType) -> None:
    """A suspect (``solo``, after its group failed under it) runs alone: it joins no
    running batch, and nothing joins it."""
    sched = cls(max_num_seqs=4)
    add_all(sched, "a", "suspect", "c", "d")
    state = sched.get_request_state("suspect")
    assert state is not None
    state.solo = True
    first = sched.schedule(1.0)
    assert first.scheduled_request_ids == ("a",)  # the suspect does not join a
    sched.update_from_output(first, batch(done("a")), 2.0)
    alone = sched.schedule(3.0)
    assert alone.scheduled_request_ids == ("suspect",)  # and c does not join the suspect
    sched.update_from_output(alone, batch(done("suspect")), 4.0)
    assert sched.schedule(5.0).scheduled_request_ids == ("c", "d")


def test_a_solo_request_waits_for_the_packing_ones_and_nothing_starts_while_it_packs() -> None:
    sched = RequestScheduler(max_num_seqs=4)
    add_all(sched, "a", "suspect", "c")
    suspect = sched.get_request_state("suspect")
    assert suspect is not None
    suspect.solo = True
    first = sched.schedule(1.0)
    assert first.scheduled_request_ids == ("a",)
    sched.update_from_output(first, batch(RunnerOutput("a", async_output_id="k/a")), 2.0)
    assert sched.num_packing == 1
    assert not sched.has_schedulable_work()  # the suspect waits for a's packing
    assert sched.schedule(2.5).is_empty
    sched.finish_requests("a", S.FINISHED_COMPLETED, 3.0)
    assert sched.has_schedulable_work()
    alone = sched.schedule(3.5)
    assert alone.scheduled_request_ids == ("suspect",)
    sched.update_from_output(
        alone, batch(RunnerOutput("suspect", async_output_id="k/suspect")), 4.0
    )
    assert not sched.has_schedulable_work()  # c waits while the suspect packs
    sched.finish_requests("suspect", S.FINISHED_COMPLETED, 5.0)
    assert sched.schedule(6.0).scheduled_request_ids == ("c",)


# -- scheduling policies ---------------------------------------------------------------------

POLICIES = list(SCHEDULING_POLICIES)
every_policy = pytest.mark.parametrize("policy", POLICIES)
# Deterministic and quick: the whole of tests/_core must stay fast.
quick = settings(max_examples=150, deadline=None, derandomize=True, database=None)


def make_sched(cls: SchedulerType, capacity: int, policy: str, **kw: Any) -> Scheduler:
    if cls is RequestScheduler:
        return RequestScheduler(capacity, policy=policy, **kw)
    return StepScheduler(capacity, policy=policy, **kw)


def advance(sched: Scheduler, out: SchedulerOutput, now: float) -> list[str]:
    """One denoising step for everything scheduled (step mode); returns the finished ids."""
    outputs = []
    for rid in out.scheduled_request_ids:
        state = sched.get_request_state(rid)
        assert state is not None
        n = state.num_computed_steps + 1
        outputs.append(step(rid, n, finished=n >= state.total_steps))
    return sched.update_from_output(out, batch(*outputs), now)


def test_policy_is_fifo_by_default_and_recorded() -> None:
    assert Scheduler().policy == "fifo"
    assert RequestScheduler(2).policy == "fifo"
    assert StepScheduler(2).policy == "fifo"
    assert RequestScheduler(2, 5.0, policy="fair", fair_quantum=10).policy == "fair"
    assert StepScheduler(2, policy="priority", aging_ticks=3).policy == "priority"
    assert Scheduler(2, step_batch_key, policy="priority").policy == "priority"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"policy": "lottery"},
        {"aging_ticks": 0},
        {"fair_quantum": 0},
        {"fair_quantum": -1},
        {"policy": "priority", "aging_ticks": -3},
    ],
    ids=repr,
)
@pytest.mark.parametrize("cls", [Scheduler, RequestScheduler, StepScheduler], ids=str)
def test_bad_policy_settings_are_rejected(cls: type[Scheduler], kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"policy|aging_ticks|fair_quantum"):
        cls(2, **kwargs)


@both_modes
@every_policy
def test_every_policy_drops_aborted_waiting_requests_and_counts_exactly(
    cls: SchedulerType, policy: str
) -> None:
    sched = make_sched(cls, 1, policy)
    add_all(sched, "a", "b", "c")
    sched.finish_requests(["a", "c"], S.FINISHED_ABORTED, 1.0)
    assert sched.num_waiting == 1
    assert sched.live_request_ids() == ["b"]
    out = sched.schedule(2.0)
    assert out.scheduled_request_ids == ("b",)
    assert out.finished_req_ids == {"a", "c"}
    assert sched.num_waiting == 0


@both_modes
@every_policy
def test_every_policy_runs_a_crash_requeue_ahead_of_everything(
    cls: SchedulerType, policy: str
) -> None:
    sched = make_sched(cls, 1, policy)
    sched.add_request(make_request("low", priority=9), 0.0)
    out = sched.schedule(1.0)
    add_all(sched, "urgent", priority=-9)
    sched.add_request(make_request("other-class", height=32, priority=-9), 1.0)
    assert sched.preempt_request("low", reset_progress=True)
    assert sched.live_request_ids()[0] == "low"
    out = sched.schedule(2.0)
    assert out.scheduled_request_ids == ("low",)


@every_policy
def test_every_policy_forgets_worker_state_of_every_waiting_request(policy: str) -> None:
    sched = StepScheduler(2, policy=policy, fair_quantum=10**9)  # "fair": a, b share a visit
    add_all(sched, "a", "b")
    sched.add_request(make_request("c", height=32), 0.0)
    out = sched.schedule(1.0)
    advance(sched, out, 1.5)
    assert sched.preempt_request("a", requeue="key")
    assert sched.preempt_request("b")
    assert sorted(sched.forget_worker_state()) == ["a", "b"]  # c was never sent
    for rid in ("a", "b"):
        state = sched.get_request_state(rid)
        assert state is not None
        assert (state.num_computed_steps, state.sent_to_worker) == (0, False)


@both_modes
@every_policy
def test_every_policy_holds_a_suspect_until_the_group_is_empty(
    cls: SchedulerType, policy: str
) -> None:
    sched = make_sched(cls, 4, policy)
    add_all(sched, "a")
    first = sched.schedule(1.0)
    add_all(sched, "suspect")
    state = sched.get_request_state("suspect")
    assert state is not None
    state.solo = True
    sched.update_from_output(first, batch(done("a")), 2.0)
    assert sched.has_schedulable_work()
    assert sched.schedule(3.0).scheduled_request_ids == ("suspect",)
    add_all(sched, "c")
    assert sched.preemption_victims() == ()
    out = sched.schedule(4.0)
    assert out.scheduled_new_reqs == ()  # c does not join the suspect


@every_policy
def test_every_policy_coalesces_request_mode_waves(policy: str) -> None:
    sched = RequestScheduler(4, 250.0, policy=policy)
    add_all(sched, "a", now=0.0)
    assert sched.admission_wait(0.0) == pytest.approx(0.05)
    add_all(sched, "b", "c", "d", now=0.01)
    assert sched.admission_wait(0.02) is None  # a full wave
    assert len(sched.schedule(0.02).scheduled_request_ids) == 4


@both_modes
@every_policy
def test_every_policy_lists_each_live_id_once(cls: SchedulerType, policy: str) -> None:
    sched = make_sched(cls, 2, policy)
    add_all(sched, "a", "b", priority=2)
    sched.add_request(make_request("c", height=32, priority=-1), 0.0)
    add_all(sched, "d", priority=0)
    sched.schedule(1.0)
    live = sched.live_request_ids()
    assert sorted(live) == ["a", "b", "c", "d"]
    assert live[: sched.num_running] == list(sched.running_request_ids())


# -- priority -------------------------------------------------------------------------------


@both_modes
def test_priority_runs_lower_numbers_first(cls: SchedulerType) -> None:
    sched = make_sched(cls, 1, "priority")
    for rid, prio in [("p2", 2), ("p0", 0), ("p1", 1), ("p0b", 0)]:
        sched.add_request(make_request(rid, priority=prio), 0.0)
    assert sched.live_request_ids() == ["p0", "p0b", "p1", "p2"]
    order: list[str] = []
    for t in range(4):
        out = sched.schedule(float(t))
        order.extend(out.scheduled_request_ids)
        sched.update_from_output(out, batch(done(order[-1])), float(t))
    assert order == ["p0", "p0b", "p1", "p2"]


@both_modes
def test_priority_blocks_on_an_incompatible_best(cls: SchedulerType) -> None:
    sched = make_sched(cls, 4, "priority")
    sched.add_request(make_request("a", priority=0), 0.0)
    sched.add_request(make_request("tall", height=128, priority=1), 0.0)
    sched.add_request(make_request("b", priority=2), 0.0)
    out = sched.schedule(1.0)
    assert out.scheduled_request_ids == ("a",)  # tall is the best waiting: b does not pass it


def test_priority_ages_old_requests_past_new_urgent_ones() -> None:
    sched = RequestScheduler(1, policy="priority", aging_ticks=2)
    sched.add_request(make_request("old", priority=3), 0.0)  # tick 0: key 6
    for t in range(1, 8):  # an urgent request arrives every tick: key t
        sched.add_request(make_request(f"u{t}"), float(t))
        out = sched.schedule(float(t))
        (rid,) = out.scheduled_request_ids
        sched.update_from_output(out, batch(done(rid)), float(t))
        if rid == "old":
            break
    # u_t arrives at tick t - 1 (the step id before this schedule): u1..u6 arrived within
    # 3 * 2 ticks of old (keys 0..5 < 6) and pass it; u7 (key 6, a later seq) does not.
    assert rid == "old" and t == 7


@quick
@given(
    cls=st.sampled_from(BOTH),
    aging=st.integers(1, 4),
    arrivals=st.lists(st.lists(st.integers(-3, 3), max_size=3), min_size=1, max_size=20),
)
def test_priority_starvation_bound(
    cls: SchedulerType, aging: int, arrivals: list[list[int]]
) -> None:
    """Each admission takes the lowest ``(tick + priority * aging, seq)`` waiting; so a later
    arrival B runs before an earlier A only if ``tick_B - tick_A < (p_A - p_B) * aging``."""
    sched = make_sched(cls, 1, "priority", aging_ticks=aging)
    arrived: dict[str, tuple[int, int, int]] = {}  # rid -> (tick, priority, seq)
    waiting: set[str] = set()
    order: list[str] = []
    now = 0.0
    for batch_prios in [*arrivals, *[[]] * (sum(map(len, arrivals)) + 1)]:
        for prio in batch_prios:
            rid = f"r{len(arrived)}"
            arrived[rid] = (sched.step_id, prio, len(arrived))
            sched.add_request(make_request(rid, priority=prio), now)
            waiting.add(rid)
        now += 1.0
        out = sched.schedule(now)
        if not out.scheduled_request_ids:
            assert not waiting
            continue
        (rid,) = out.scheduled_request_ids
        best = min(waiting, key=lambda r: (arrived[r][0] + arrived[r][1] * aging, arrived[r][2]))
        assert rid == best
        waiting.discard(rid)
        order.append(rid)
        sched.update_from_output(out, batch(done(rid)), now)
    assert sorted(order) == sorted(arrived)
    position = {rid: i for i, rid in enumerate(order)}
    for a, b in itertools.combinations(arrived, 2):  # a arrived before b
        (ta, pa, _), (tb, pb, _) = arrived[a], arrived[b]
        if position[b] < position[a]:
            note(f"{b} (tick {tb}, priority {pb}) passed {a} (tick {ta}, priority {pa})")
            assert tb - ta < (pa - pb) * aging


def test_priority_requeue_by_key_keeps_the_place_front_goes_first() -> None:
    sched = StepScheduler(1, policy="priority")
    sched.add_request(make_request("mid", priority=1), 0.0)
    out = sched.schedule(1.0)
    advance(sched, out, 1.5)
    sched.add_request(make_request("better"), 1.0)  # key 1 < mid's 16
    sched.add_request(make_request("worse", priority=2), 1.0)
    sched.preempt_request("mid", requeue="key")
    assert sched.live_request_ids() == ["better", "mid", "worse"]
    out = sched.schedule(2.0)
    assert out.scheduled_request_ids == ("better",)
    sched.preempt_request("better")  # front: ahead of everything
    assert sched.live_request_ids() == ["better", "mid", "worse"]


def test_preempt_rejects_an_unknown_requeue_and_changes_nothing() -> None:
    sched = StepScheduler(1, policy="priority")
    add_all(sched, "a")
    sched.schedule(1.0)
    with pytest.raises(ValueError, match="requeue"):
        sched.preempt_request("a", requeue="back")  # type: ignore[arg-type]
    assert status(sched, "a") is S.RUNNING


# -- priority preemption (step mode) ------------------------------------------------------------


def test_priority_preemption_cycle_keeps_progress() -> None:
    """The core's cycle: victims at a step boundary, preempt them by key, schedule: the
    better request starts in that call; the victim later resumes as a cached id with its
    progress."""
    sched = StepScheduler(2, policy="priority")
    add_all(sched, "a", "b", steps=4, priority=5)
    out = sched.schedule(1.0)
    advance(sched, out, 1.5)
    sched.add_request(make_request("w", steps=4, priority=0), 1.5)
    assert sched.preemption_victims() == ("b",)  # ties: the latest admitted
    assert sched.get_request_state("b").num_computed_steps == 1  # type: ignore[union-attr]
    for rid in sched.preemption_victims():
        assert sched.preempt_request(rid, requeue="key")
    out = sched.schedule(2.0)
    assert new_ids(out) == ["w"]
    assert out.scheduled_cached_reqs == ("a",)
    assert status(sched, "b") is S.PREEMPTED
    assert sched.preemption_victims() == ()  # b is worse than nothing running
    t = 2.0
    while status(sched, "b") is not S.RUNNING:
        t += 1.0
        advance(sched, out, t)
        out = sched.schedule(t)
    assert "b" in out.scheduled_cached_reqs and "b" not in new_ids(out)
    assert sched.get_request_state("b").num_computed_steps == 1  # type: ignore[union-attr]
    assert sched.get_request_state("b").num_preemptions == 1  # type: ignore[union-attr]


def test_priority_victim_is_the_worst_running() -> None:
    sched = StepScheduler(3, policy="priority")
    for rid, prio in [("p5", 5), ("p3", 3), ("p5b", 5)]:
        sched.add_request(make_request(rid, priority=prio), 0.0)
    sched.schedule(1.0)
    sched.add_request(make_request("w", priority=4), 1.0)
    assert sched.preemption_victims() == ("p5b",)
    sched.finish_requests("p5b", S.FINISHED_COMPLETED, 2.0)
    assert sched.preemption_victims() == ()  # a free slot: w starts at the next schedule
    sched.add_request(make_request("x", priority=4), 2.0)
    sched.schedule(2.0)
    assert sched.running_request_ids() == ("p3", "p5", "w")  # admitted in priority order
    assert sched.preemption_victims() == ("p5",)  # x (4) against p5: the only worse one


def test_priority_no_victim_unless_strictly_better() -> None:
    sched = StepScheduler(1, policy="priority")
    sched.add_request(make_request("a", priority=2), 0.0)
    sched.schedule(1.0)
    sched.add_request(make_request("same", priority=2), 1.0)
    assert sched.preemption_victims() == ()


def test_priority_an_aged_running_request_is_not_preempted() -> None:
    sched = StepScheduler(1, policy="priority", aging_ticks=4)
    sched.add_request(make_request("old", priority=1, steps=50), 0.0)  # key 4
    out = sched.schedule(1.0)
    for t in range(2, 7):
        advance(sched, out, float(t))
        out = sched.schedule(float(t))
    sched.add_request(make_request("new", priority=0), 6.0)  # key 6 > 4
    assert sched.preemption_victims() == ()


def test_priority_other_key_preempts_the_whole_batch_only_if_all_are_worse() -> None:
    sched = StepScheduler(4, policy="priority")
    add_all(sched, "a", priority=2)
    add_all(sched, "b", priority=3)
    sched.schedule(1.0)
    sched.add_request(make_request("tall", height=128, priority=0), 1.0)
    victims = sched.preemption_victims()
    assert victims == ("a", "b")
    for rid in victims:
        sched.preempt_request(rid, requeue="key")
    out = sched.schedule(2.0)
    assert out.scheduled_request_ids == ("tall",)
    # Against a batch holding one request as good as the waiting one: nothing.
    sched2 = StepScheduler(4, policy="priority")
    add_all(sched2, "a", priority=2)
    add_all(sched2, "keen", priority=0)
    sched2.schedule(1.0)
    sched2.add_request(make_request("tall", height=128, priority=0), 1.0)
    assert sched2.preemption_victims() == ()


def test_priority_never_preempts_around_a_suspect() -> None:
    sched = StepScheduler(1, policy="priority")
    add_all(sched, "a", priority=5)
    sched.schedule(1.0)
    sched.add_request(make_request("w", priority=0), 1.0)
    assert sched.preemption_victims() == ("a",)
    w = sched.get_request_state("w")
    assert w is not None
    w.solo = True
    assert sched.preemption_victims() == ()
    w.solo = False
    a = sched.get_request_state("a")
    assert a is not None
    a.solo = True
    assert sched.preemption_victims() == ()


@pytest.mark.parametrize("policy", ["fifo", "fair"])
def test_only_priority_step_mode_preempts(policy: str) -> None:
    sched = StepScheduler(1, policy=policy)
    add_all(sched, "a", priority=5)
    sched.schedule(1.0)
    sched.add_request(make_request("w", priority=0), 1.0)
    assert sched.preemption_victims() == ()
    request_sched = RequestScheduler(1, policy="priority")
    add_all(request_sched, "a", priority=5)
    request_sched.schedule(1.0)
    request_sched.add_request(make_request("w", priority=0), 1.0)
    assert request_sched.preemption_victims() == ()


# -- fair -----------------------------------------------------------------------------------------


def square(rid: str, side: int) -> DiffusionRequest:
    sampling = SamplingParams(height=side, width=side, num_inference_steps=2)
    return DiffusionRequest(f"prompt of {rid}", sampling, request_id=rid)


def large(rid: str) -> DiffusionRequest:
    return square(rid, 64)


@both_modes
def test_fair_shares_cost_between_two_backlogged_classes(cls: SchedulerType) -> None:
    """32x32 and 64x64 streams, both kept backlogged: the cost admitted per class stays
    within one quantum (the largest cost, 64*64*2) of equal, wave after wave."""
    sched = make_sched(cls, 8, "fair")
    quantum = request_cost(large("x"))
    admitted = {32: 0, 64: 0}
    waves = {32: 0, 64: 0}
    side_of: dict[str, int] = {}
    counter = itertools.count()
    now = 0.0
    for _ in range(400):
        for side in (32, 64):  # top both classes up to 8 waiting
            waiting = [r for r in sched.live_request_ids() if status(sched, r) is S.WAITING]
            for _ in range(8 - sum(side_of[r] == side for r in waiting)):
                rid = f"r{next(counter)}"
                side_of[rid] = side
                sched.add_request(square(rid, side), now)
        now += 1.0
        was_idle = sched.num_running == 0
        out = sched.schedule(now)
        for data in out.scheduled_new_reqs:
            admitted[side_of[data.request_id]] += request_cost(data.request)
        if was_idle and out.scheduled_new_reqs:
            waves[side_of[out.scheduled_new_reqs[0].request_id]] += 1
        assert abs(admitted[32] - admitted[64]) <= quantum
        if cls is RequestScheduler:
            sched.update_from_output(out, batch(*(done(r) for r in out.scheduled_request_ids)), now)
        else:
            advance(sched, out, now)
    assert min(waves.values()) >= 20  # both classes kept getting waves
    assert min(admitted.values()) >= 20 * quantum


@quick
@given(
    capacity=st.integers(1, 4),
    quantum=st.one_of(st.none(), st.integers(500, 20_000)),
    arrivals=st.lists(
        st.lists(st.tuples(st.sampled_from([16, 32, 48]), st.integers(1, 4)), max_size=4),
        min_size=1,
        max_size=15,
    ),
)
def test_fair_never_starves_a_class(
    capacity: int, quantum: int | None, arrivals: list[list[tuple[int, int]]]
) -> None:
    """Random arrivals over up to twelve classes (request mode: side and step count): a
    request with ``j`` requests ahead in its class is admitted within ``(j + 1) * classes *
    ceil(max cost / quantum)`` waves (each class is visited at least once every ``classes``
    waves, and its head fits after that many visits)."""
    sched = RequestScheduler(capacity, policy="fair", fair_quantum=quantum)
    classes = len({a for wave in arrivals for a in wave})
    max_cost = 48 * 48 * 4
    visits = 1 if quantum is None else -(-max_cost // quantum)
    info: dict[str, tuple[int, int]] = {}  # rid -> (wave count at arrival, ahead in class)
    waves = 0
    admitted: set[str] = set()
    counter = itertools.count()
    for i in itertools.count():
        for side, steps in arrivals[i] if i < len(arrivals) else []:
            rid = f"r{next(counter)}"
            ahead = 0
            for r in sched.live_request_ids():
                sp = sched.get_request_state(r).request.sampling  # type: ignore[union-attr]
                ahead += (sp.height, sp.num_inference_steps) == (side, steps)
            info[rid] = (waves, ahead)
            request = DiffusionRequest(
                "p", SamplingParams(height=side, width=side, num_inference_steps=steps), rid
            )
            sched.add_request(request, float(i))
        out = sched.schedule(float(i))
        if out.scheduled_request_ids:
            waves += 1
        for rid in out.scheduled_request_ids:
            arrived_at, ahead = info[rid]
            note(f"{rid} admitted in wave {waves}, arrived before wave {arrived_at + 1}")
            assert waves - arrived_at <= (ahead + 1) * classes * visits
            admitted.add(rid)
        sched.update_from_output(out, batch(*(done(r) for r in out.scheduled_request_ids)), i)
        if i >= len(arrivals) and not sched.has_unfinished_requests():
            break
        assert i < 10_000
    assert admitted == set(info)


def test_fair_step_mode_class_that_spent_its_share_drains() -> None:
    """A running 16x64 batch takes 16x64 joins at step boundaries while its deficit lasts;
    once it is spent (a 64x64 request waiting) the class drains and the 64x64 request starts
    the next wave."""
    sched = StepScheduler(2, policy="fair")
    sched.add_request(large("big"), 0.0)  # the quantum: big's cost, 64 * 64 * 2 = 8192
    sched.finish_requests("big", S.FINISHED_ABORTED, 0.0)  # seen, then gone
    for rid, steps in [("a0", 1), ("a1", 4), ("a2", 1), ("a3", 1), ("a4", 1), ("a5", 1)]:
        sched.add_request(make_request(rid, height=16, steps=steps), 0.0)  # 1024 a step
    sched.add_request(large("big2"), 0.0)
    out = sched.schedule(1.0)
    started = new_ids(out)
    assert started == ["a0", "a1"]  # deficit 8192 - 1024 - 4096: 3072, three more joins
    t = 1.0
    while "big2" not in started:
        t += 1.0
        advance(sched, out, t)
        out = sched.schedule(t)
        started.extend(new_ids(out))
    assert started == ["a0", "a1", "a2", "a3", "a4", "big2"]


def test_fair_refuses_an_unresolved_size_and_keeps_nothing() -> None:
    sched = StepScheduler(2, policy="fair")
    request = DiffusionRequest("p", SamplingParams(width=64), request_id="r")
    with pytest.raises(ValueError, match="height/width"):
        sched.add_request(request, 0.0)
    assert sched.get_request_state("r") is None
    assert sched.num_waiting == 0
    sched.add_request(make_request("r"), 0.0)  # the id is free
