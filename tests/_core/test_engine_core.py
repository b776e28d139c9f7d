"""The engine core: events in, instructions out, no trio, time passed in.

Each test drives one :class:`EngineCore` by hand, as the shell would, and checks the exact
instructions it answers with, the states it leaves behind and the trace it records.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from omni_trio._core import engine_core as engine_core_module
from omni_trio._core.engine_core import (
    PAYLOAD_REJECTED,
    QUARANTINED,
    WORKER_FAILED,
    AwaitOutput,
    CoreConfig,
    DeliverChunk,
    DeliverTerminal,
    DropOutput,
    EngineCore,
    Instruction,
    StopForwards,
)
from omni_trio._core.health import EngineState, GroupState, WorkerState, WorkerStatus
from omni_trio._core.lifecycle import RequestStatus
from omni_trio._core.messages import BatchRunnerOutput, RunnerOutput, SchedulerOutput
from omni_trio._core.model_info import ModelInfo
from omni_trio._core.request import DiffusionRequest, RequestLimits, SamplingParams
from omni_trio._core.trace import TraceKind, TraceRecorder
from omni_trio.errors import (
    DuplicateRequestError,
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    WorkerError,
)
from omni_trio.testing import check_leftovers, check_trace

S = RequestStatus
K = TraceKind
INFO = ModelInfo("fake", "echo", True, 48, 64, False, supports_steps=True)


def make(**config: Any) -> tuple[EngineCore, TraceRecorder]:
    trace = TraceRecorder()
    core = EngineCore(CoreConfig(**config), trace=trace, seed=1)
    core.group_started(INFO, 0.0)
    return core, trace


def admit(core: EngineCore, rid: str, now: float = 0.0, **sampling: Any) -> DiffusionRequest:
    sampling.setdefault("num_inference_steps", 2)
    sampling.setdefault("seed", 5)
    return core.admit(DiffusionRequest("p", SamplingParams(**sampling), rid), now)


def schedule(core: EngineCore, now: float = 1.0) -> SchedulerOutput:
    out = core.schedule(now, worker=0)
    assert out is not None
    return out


def result(*outputs: RunnerOutput) -> BatchRunnerOutput:
    return BatchRunnerOutput.from_list(list(outputs))


def terminals(instructions: list[Instruction]) -> dict[str, RequestStatus]:
    return {i.request_id: i.output.status for i in instructions if isinstance(i, DeliverTerminal)}


def kinds(trace: TraceRecorder, rid: str) -> list[TraceKind]:
    return [e.kind for e in trace.for_request(rid)]


def assert_clean(core: EngineCore, trace: TraceRecorder, *, closed: bool | None = None) -> None:
    events = trace.events
    assert check_trace(events, closed=closed, abort_latency_s=0.0) == []
    assert check_leftovers(core.leftovers(), events, in_flight=core.in_flight_ids()) == []


# -- admission ------------------------------------------------------------------------------


def test_admission_resolves_the_size_and_a_seed_once() -> None:
    core, trace = make()
    request = core.admit(DiffusionRequest("p", SamplingParams(), "a"), 0.0)
    assert (request.sampling.height, request.sampling.width) == (48, 64)
    assert request.sampling.seed is not None
    explicit = admit(core, "b", seed=0)
    assert explicit.sampling.seed == 0  # an explicit 0 is a seed like any other
    assert core.status_of("a") is S.WAITING
    [event] = [e for e in trace if e.kind is K.ADMIT and e.request_id == "a"]
    assert event.detail == {"seed": request.sampling.seed, "steps": 20, "mode": "request"}
    assert core.statistics().admitted == 2


def test_generated_ids_are_unique_and_carry_the_prefix() -> None:
    core = EngineCore(id_prefix="abcd")
    ids = {core.build_request("p").request_id for _ in range(3)}
    assert ids == {"req-abcd-1", "req-abcd-2", "req-abcd-3"}
    with pytest.raises(InvalidRequestError, match="prompt must be a string"):
        core.build_request(3)  # type: ignore[arg-type]


def test_a_fixed_size_model_refuses_other_sizes_before_admission() -> None:
    core, _ = make()
    core.group_started(ModelInfo("u", "unconditional", True, 32, 32, False, fixed_size=True), 0.0)
    with pytest.raises(InvalidRequestError) as info:
        admit(core, "a", height=64, width=64)
    assert info.value.param == "size"
    assert not core.is_live("a")
    assert admit(core, "b").sampling.height == 32


def test_a_picture_gives_its_own_size_rounded_down_to_a_multiple_of_8() -> None:
    import numpy as np

    core, trace = make()
    core.group_started(dataclasses.replace(INFO, image_input=True, min_side=16), 0.0)
    picture = np.zeros((45, 63, 3), np.uint8)  # 63 wide, 45 high
    request = admit(core, "a", image=picture, num_inference_steps=10, strength=0.5)
    assert (request.sampling.width, request.sampling.height) == (56, 40)
    assert request.sampling.image is picture  # carried as given; the worker resizes it
    explicit = admit(core, "b", image=picture, height=32, width=48)
    assert (explicit.sampling.width, explicit.sampling.height) == (48, 32)
    [event] = [e for e in trace if e.kind is K.ADMIT and e.request_id == "a"]
    assert event.detail is not None and event.detail["steps"] == 5  # strength halves them
    one_side = admit(core, "c", image=picture, width=32)  # the height follows the aspect
    assert (one_side.sampling.width, one_side.sampling.height) == (32, 16)  # 45 * 32 / 63
    with pytest.raises(InvalidRequestError, match=r"renders sizes from.*comes from the image"):
        admit(core, "small", image=np.zeros((9, 9, 3), np.uint8))  # 8x8 < min_side 16
    with pytest.raises(InvalidRequestError) as info:
        admit(core, "small", image=np.zeros((9, 9, 3), np.uint8))
    assert info.value.param == "image"  # the size was the picture's, not the caller's
    with pytest.raises(InvalidRequestError) as info:
        admit(core, "small", image=picture, height=8, width=8)
    assert info.value.param == "size"  # the caller's size


def test_a_model_without_image_input_refuses_pictures_before_admission() -> None:
    import numpy as np

    core, _ = make()
    with pytest.raises(InvalidRequestError, match="does not take an image") as info:
        admit(core, "a", image=np.zeros((48, 64, 3), np.uint8))
    assert info.value.param == "image"
    assert not core.is_live("a")


def test_admission_refuses_bad_input_duplicates_and_faults() -> None:
    core, _ = make(limits=RequestLimits(max_pixels=48 * 64))
    admit(core, "a")
    with pytest.raises(DuplicateRequestError):
        admit(core, "a")
    with pytest.raises(InvalidRequestError, match="pixels"):
        admit(core, "big", height=64, width=64)
    faulty = SamplingParams(extra_args={"faults": [{"kind": "fail_packing"}]})
    with pytest.raises(InvalidRequestError, match="fault_injection=False") as info:
        core.admit(DiffusionRequest("p", faulty, "f"), 0.0)
    assert info.value.param == "extra_args"
    fuzzing, _ = make(fault_injection=True)
    bad = SamplingParams(extra_args={"faults": [{"kind": "explode"}]})
    with pytest.raises(InvalidRequestError, match="unknown fault kind"):
        fuzzing.admit(DiffusionRequest("p", bad, "f"), 0.0)
    assert fuzzing.admit(DiffusionRequest("p", faulty, "g"), 0.0).request_id == "g"


# -- request mode ---------------------------------------------------------------------------


def test_a_result_in_hand_completes_the_request_with_metrics() -> None:
    core, trace = make()
    admit(core, "a", now=0.5)
    out = schedule(core, 1.0)
    image = ("img", "a")
    instructions = core.runner_output(
        out, result(RunnerOutput("a", images=(image,), timings={"forward_ms": 7.0})), 3.0
    )
    [deliver] = instructions
    assert isinstance(deliver, DeliverTerminal)
    final = deliver.output
    assert (final.status, final.images, final.seed) == (S.FINISHED_COMPLETED, (image,), 5)
    assert final.metrics.queue_wait_ms == pytest.approx(500.0)
    assert final.metrics.execution_ms == 7.0
    assert final.metrics.e2e_ms == pytest.approx(2500.0)
    assert not core.is_live("a")
    assert kinds(trace, "a") == [
        K.ADMIT,
        K.SCHEDULE,
        K.EXEC_START,
        K.EXEC_RESULT,
        K.TERMINAL,
        K.OUTPUT,
        K.CLEANUP,
    ]
    assert core.statistics().finished_completed == 1
    assert_clean(core, trace)


def test_an_announced_output_makes_the_request_packing_until_it_arrives() -> None:
    core, trace = make(max_num_seqs=1)
    admit(core, "a")
    admit(core, "b")
    out = schedule(core)
    instructions = core.runner_output(
        out, result(RunnerOutput("a", async_output_id="b1/a", timings={"forward_ms": 3.0})), 2.0
    )
    assert instructions == [AwaitOutput("a", "b1/a")]
    assert core.status_of("a") is S.PACKING
    assert core.awaited_outputs() == {"b1/a": "a"}
    assert core.statistics().packing == 1
    # The slot is free: the next wave runs while a's output is packed.
    assert schedule(core, 2.0).scheduled_request_ids == ("b",)
    packed = RunnerOutput("a", images=("img",), timings={"postprocess_ms": 1.0})
    [deliver] = core.output_ready("a", "b1/a", packed, 4.0)
    assert isinstance(deliver, DeliverTerminal)
    assert deliver.output.status is S.FINISHED_COMPLETED
    assert deliver.output.metrics.execution_ms == 3.0  # the compute's timing is kept
    assert deliver.output.metrics.postprocess_ms == 1.0
    assert core.awaited_outputs() == {}
    assert_clean(core, trace)


def test_a_packing_failure_ends_the_request_with_its_error() -> None:
    core, _ = make()
    admit(core, "a")
    core.runner_output(schedule(core), result(RunnerOutput("a", async_output_id="k/a")), 2.0)
    bad = RunnerOutput("a", error="cannot encode", error_type="FaultInjectedError")
    [deliver] = core.output_ready("a", "k/a", bad, 3.0)
    assert isinstance(deliver, DeliverTerminal)
    assert (deliver.output.status, deliver.output.error_type) == (
        S.FINISHED_ERROR,
        "FaultInjectedError",
    )


def test_an_output_for_a_request_aborted_during_its_forward_is_dropped() -> None:
    """The INV-3 leak of issue #13, at its source: the forward's answer announces an output
    for a request that ended meanwhile; the core drops it instead of ignoring it."""
    core, trace = make(max_num_seqs=2)
    admit(core, "a")
    admit(core, "b")
    out = schedule(core)
    aborted = core.abort(["a"], 1.5)
    assert aborted[0] == StopForwards(("a",))
    assert terminals(aborted) == {"a": S.FINISHED_ABORTED}
    answer = result(
        RunnerOutput("a", async_output_id="w/a"), RunnerOutput("b", async_output_id="w/b")
    )
    instructions = core.runner_output(out, answer, 2.0)
    assert instructions == [AwaitOutput("b", "w/b"), DropOutput("w/a", "a")]
    assert_clean(core, trace)


def test_a_result_for_a_reused_id_never_reaches_its_new_incarnation() -> None:
    core, trace = make()
    admit(core, "x", seed=1)
    out = schedule(core)
    core.abort(["x"], 1.5)
    admit(core, "x", now=1.6, seed=2)  # the id is free again: a new incarnation waits
    instructions = core.runner_output(out, result(RunnerOutput("x", images=("old",))), 2.0)
    assert instructions == []
    assert core.status_of("x") is S.WAITING
    late = core.runner_output(
        schedule(core, 3.0), result(RunnerOutput("x", async_output_id="z/x")), 4.0
    )
    assert late == [AwaitOutput("x", "z/x")]
    assert_clean(core, trace)


def test_a_result_for_an_unscheduled_id_is_dropped_and_shows_in_the_trace() -> None:
    core, trace = make()
    admit(core, "a")
    out = schedule(core)
    answer = result(RunnerOutput("a", images=("i",)), RunnerOutput("ghost", async_output_id="g"))
    instructions = core.runner_output(out, answer, 2.0)
    assert DropOutput("g", "ghost") in instructions
    violations = check_trace(trace.events)
    assert {v.invariant for v in violations} == {"INV-2", "INV-4"}
    assert {v.request_id for v in violations} == {"ghost"}


def test_an_execution_error_fails_the_scheduled_requests_only() -> None:
    core, trace = make(max_num_seqs=1)
    admit(core, "a")
    admit(core, "b")
    instructions = core.execution_failed(schedule(core), "bad call", "TypeError", 2.0)
    [deliver] = instructions
    assert isinstance(deliver, DeliverTerminal)
    assert (deliver.request_id, deliver.output.error_type) == ("a", "TypeError")
    assert core.status_of("b") is S.WAITING
    assert_clean(core, trace)


def test_only_one_dispatch_is_in_flight() -> None:
    core, _ = make()
    admit(core, "a")
    out = schedule(core)
    assert core.in_flight_ids() == {"a"}
    with pytest.raises(RuntimeError, match="already being executed"):
        core.schedule(1.0)
    core.runner_output(out, result(RunnerOutput("a", images=("i",))), 2.0)
    assert core.dispatch is None and core.schedule(2.0) is None


# -- aborts and consumers -------------------------------------------------------------------


def test_abort_while_packing_drops_the_output_and_ends_at_once() -> None:
    core, trace = make()
    admit(core, "a")
    core.runner_output(schedule(core), result(RunnerOutput("a", async_output_id="k/a")), 2.0)
    instructions = core.abort(["a", "a", "nobody"], 3.0)
    assert instructions[0] == DropOutput("k/a", "a")
    assert terminals(instructions) == {"a": S.FINISHED_ABORTED}
    assert core.output_ready("a", "k/a", RunnerOutput("a", images=("i",)), 4.0) == []
    assert_clean(core, trace)


def test_a_consumer_that_leaves_gets_nothing_and_its_request_is_aborted() -> None:
    core, trace = make()
    admit(core, "a")
    out = schedule(core)
    instructions = core.consumer_gone("a", 1.5)
    assert instructions == [StopForwards(("a",))]  # no delivery: nobody reads
    assert core.consumer_gone("a", 1.6) == []
    assert core.runner_output(out, result(RunnerOutput("a", images=("i",))), 2.0) == []
    # The forward's late answer is recorded after the cleanup, and applied to nothing.
    assert kinds(trace, "a")[-6:] == [
        K.CONSUMER_DROP,
        K.ABORT,
        K.TERMINAL,
        K.OUTPUT,
        K.CLEANUP,
        K.EXEC_RESULT,
    ]
    output = next(e for e in trace.for_request("a") if e.kind is K.OUTPUT)
    assert output.detail == {"status": "FINISHED_ABORTED", "delivered": False}
    assert_clean(core, trace)


# -- deadlines ------------------------------------------------------------------------------


def test_an_output_that_never_comes_expires_at_its_deadline() -> None:
    core, trace = make(output_timeout_s=10.0)
    admit(core, "a")
    core.runner_output(schedule(core), result(RunnerOutput("a", async_output_id="k/a")), 2.0)
    assert core.next_deadline() == 12.0
    assert core.expire(11.9) == []
    instructions = core.expire(12.0)
    assert instructions[0] == DropOutput("k/a", "a")
    assert terminals(instructions) == {"a": S.FINISHED_ERROR}
    final = instructions[1]
    assert isinstance(final, DeliverTerminal) and final.output.error_type == "StallError"
    assert core.next_deadline() is None
    [stall] = [e for e in trace if e.kind is K.STALL]
    assert stall.detail["phase"] == "output" and stall.detail["request_id"] == "a"
    assert_clean(core, trace)


def test_a_deadline_of_an_output_that_arrived_is_forgotten() -> None:
    core, _ = make(output_timeout_s=10.0)
    admit(core, "a")
    core.runner_output(schedule(core), result(RunnerOutput("a", async_output_id="k/a")), 2.0)
    core.output_ready("a", "k/a", RunnerOutput("a", images=("i",)), 3.0)
    assert core.next_deadline() is None
    assert core.expire(100.0) == []


# -- the worker group -----------------------------------------------------------------------


def test_a_group_failure_requeues_running_and_packing_requests_in_order() -> None:
    core, trace = make(max_num_seqs=1, max_retries_on_worker_failure=1)
    for rid in ("p", "r", "w"):
        admit(core, rid)
    core.runner_output(schedule(core), result(RunnerOutput("p", async_output_id="k/p")), 2.0)
    schedule(core, 2.0)  # r runs; w waits
    instructions = core.group_failed("died", "WorkerError", 3.0, rank=1)
    assert instructions == [DropOutput("k/p", "p")]
    assert core.group is GroupState.RESTARTING
    assert core.dispatch is None
    assert [core.status_of(r) for r in ("p", "r", "w")] == [S.PREEMPTED, S.PREEMPTED, S.WAITING]
    assert core.scheduler.live_request_ids() == ["p", "r", "w"]  # oldest work first
    assert core.statistics().requeued == 2
    assert not core.has_work()  # nothing runs until a new group is up
    assert core.group_failed("again", "WorkerError", 3.1) == []  # once per group
    [crash] = [e for e in trace if e.kind is K.CRASH]
    assert crash.worker == 1 and crash.detail["error_type"] == "WorkerError"
    health = core.health([WorkerState(0, WorkerStatus.FAILED)])
    assert (health.healthy, health.state, health.reason) == (
        False,
        EngineState.RESTARTING,
        "WorkerError: died",
    )
    assert health.workers == (WorkerState(0, WorkerStatus.RESTARTING),)
    with pytest.raises(WorkerError, match="restarting"):
        core.check_health()
    core.group_started(INFO, 4.0)
    assert core.health().healthy and core.health().restarts == 1
    assert schedule(core, 4.0).scheduled_request_ids == ("p",)
    assert_clean(core, trace)


@pytest.mark.parametrize("step_execution", [False, True])
def test_rows_lost_with_their_data_parallel_rank_run_again_and_the_rest_apply(
    step_execution: bool,
) -> None:
    """A data-parallel rank died under part of a wave while the others served: the result
    reports those rows lost; each still running goes back to the front of the queue (from
    step 0, a retry counted, a suspect from now on) while the other rows apply as usual and
    the group stays RUNNING.  A lost row aborted meanwhile is not run again; a row lost
    twice is quarantined, as after two group failures."""
    core, trace = make(
        max_num_seqs=4, max_retries_on_worker_failure=1, step_execution=step_execution
    )
    for rid in ("a", "b", "c", "d"):
        admit(core, rid, num_inference_steps=1)
    sched = schedule(core)
    assert set(sched.scheduled_request_ids) == {"a", "b", "c", "d"}
    core.abort(["c"], 1.5)
    ok = RunnerOutput("a", images=["img"], step_index=1, finished=True)
    out = core.runner_output(
        sched, BatchRunnerOutput({"a": ok}, lost=frozenset({"b", "c", "d"}), lost_error="gone"), 2.0
    )
    assert terminals(out) == {"a": S.FINISHED_COMPLETED}
    assert core.group is GroupState.RUNNING and core.health().healthy
    assert [core.status_of(r) for r in ("b", "c", "d")] == [S.PREEMPTED, None, S.PREEMPTED]
    assert core.statistics().requeued == 2
    lost = [e for e in trace if e.kind is K.EXEC_RESULT and e.detail["outcome"] == "lost"]
    assert {e.request_id for e in lost} == {"b", "c", "d"}
    assert [e.detail["retry"] for e in trace if e.kind is K.REQUEUE] == [1, 1]
    # They run again, each alone (suspects), from the front of the queue.
    again = schedule(core, 3.0)
    assert again.scheduled_request_ids == ("b",)
    assert again.scheduled_new_reqs[0].request_id == "b"  # from step 0
    out = core.runner_output(
        again, BatchRunnerOutput(lost=frozenset({"b"}), lost_error="gone again"), 4.0
    )
    [deliver] = [i for i in out if isinstance(i, DeliverTerminal)]
    assert deliver.output.error_type == QUARANTINED and "gone again" in deliver.output.error
    last = schedule(core, 5.0)
    done = RunnerOutput("d", images=["img"], step_index=1, finished=True)
    assert terminals(core.runner_output(last, result(done), 6.0)) == {"d": S.FINISHED_COMPLETED}
    assert_clean(core, trace)


def test_past_its_retry_budget_a_request_fails_retryably() -> None:
    core, trace = make(max_retries_on_worker_failure=0)
    admit(core, "a")
    schedule(core)
    [deliver] = core.group_failed("died", "WorkerError", 2.0)
    assert isinstance(deliver, DeliverTerminal)
    assert deliver.output.error_type == WORKER_FAILED
    assert "retries exhausted" in (deliver.output.error or "")
    assert [e for e in trace if e.kind is K.REQUEUE] == []
    assert_clean(core, trace)


@pytest.mark.parametrize("budget", [1, 3])
def test_a_request_its_group_failed_under_twice_is_quarantined(budget: int) -> None:
    """The second failure under the same request (which ran alone by then) marks it as the
    cause: it fails for good, not retryable, whatever retry budget is left, so a poison
    request cannot crash-loop the workers."""
    core, trace = make(max_retries_on_worker_failure=budget)
    admit(core, "a")
    schedule(core)
    assert core.group_failed("died", "WorkerError", 2.0) == []
    core.group_started(INFO, 3.0)
    assert schedule(core, 3.0).scheduled_request_ids == ("a",)
    [deliver] = core.group_failed("died again", "WorkerError", 4.0)
    assert isinstance(deliver, DeliverTerminal)
    assert deliver.output.error_type == QUARANTINED
    assert "quarantined" in (deliver.output.error or "")
    assert "died again" in (deliver.output.error or "")
    assert [e.detail["retry"] for e in trace if e.kind is K.REQUEUE] == [1]
    core.group_started(INFO, 5.0)
    assert core.schedule(5.0, worker=0) is None  # nothing left to run
    assert_clean(core, trace)


def test_a_failure_is_excused_only_with_its_cause_quarantined_or_after_progress() -> None:
    """The supervisor restarts at once, uncounted, after an excused failure: one whose every
    victim it quarantined (a poison request running alone), or the first one after a request
    completed (a serving group, not a crash loop).  A crash with nothing completed since the
    last failure excused by progress, an idle crash of a group that never served, and a failed
    start are not excused."""
    core, trace = make(max_retries_on_worker_failure=1, max_num_seqs=2)
    core.group_failed("idle", "WorkerError", 1.0)  # nothing ran, nothing completed
    assert not core.failure_excused
    core.group_started(INFO, 1.5)
    admit(core, "poison")
    admit(core, "b")
    schedule(core, 2.0)
    core.group_failed("died", "WorkerError", 2.0)  # first crash of both: requeued
    assert not core.failure_excused
    core.group_started(INFO, 3.0)
    assert schedule(core, 3.0).scheduled_request_ids == ("poison",)
    core.group_failed("died", "WorkerError", 4.0)  # alone, second time: quarantined
    assert core.failure_excused
    core.start_failed("worker died while starting", "WorkerError")
    assert not core.failure_excused
    core.group_started(INFO, 5.0)
    out = schedule(core, 5.0)
    assert out.scheduled_request_ids == ("b",)
    assert terminals(core.runner_output(out, result(RunnerOutput("b", images=["i"])), 6.0))
    # b completed: the next failure, though it takes down two first-time suspects, is
    # excused; it spends the credit, so the one after it (nothing completed) is not.
    admit(core, "poison2")
    admit(core, "c")
    assert schedule(core, 7.0).scheduled_request_ids == ("poison2", "c")
    core.group_failed("died", "WorkerError", 7.5)
    assert core.failure_excused
    core.group_started(INFO, 8.0)
    assert schedule(core, 8.0).scheduled_request_ids == ("poison2",)
    core.group_failed("died", "WorkerError", 8.5)  # quarantined: excused, spends nothing
    assert core.failure_excused
    core.group_started(INFO, 9.0)
    out = schedule(core, 9.0)
    assert out.scheduled_request_ids == ("c",)
    assert terminals(core.runner_output(out, result(RunnerOutput("c", images=["i"])), 9.5))
    core.group_failed("idle", "WorkerError", 10.0)  # after progress: excused, credit spent
    assert core.failure_excused
    core.group_started(INFO, 10.5)
    admit(core, "d")
    schedule(core, 11.0)
    core.group_failed("died", "WorkerError", 11.5)  # nothing completed since: counted
    assert not core.failure_excused
    core.group_started(INFO, 12.0)
    core.group_failed("idle", "WorkerError", 12.5)  # still nothing completed: counted
    assert not core.failure_excused
    core.group_started(INFO, 13.0)
    out = schedule(core, 13.0)
    assert out.scheduled_request_ids == ("d",)
    assert terminals(core.runner_output(out, result(RunnerOutput("d", images=["i"])), 13.5))
    assert_clean(core, trace)


@pytest.mark.parametrize("step_execution", [False, True])
def test_the_survivors_of_a_failed_group_run_alone(step_execution: bool) -> None:
    """A poison request fused with innocent ones takes them down once; from then on each
    of them runs alone, so the poison one is quarantined by itself and the others finish."""
    core, trace = make(
        max_retries_on_worker_failure=1, max_num_seqs=4, step_execution=step_execution
    )
    for rid in ("poison", "b", "c"):
        admit(core, rid)
    admit(core, "fresh")
    assert schedule(core).scheduled_request_ids == ("poison", "b", "c", "fresh")
    core.group_failed("died", "WorkerError", 2.0)
    core.group_started(INFO, 3.0)
    # Requeued at the front in their order, each alone; then the untouched one.
    assert schedule(core, 3.0).scheduled_request_ids == ("poison",)
    [deliver] = core.group_failed("died", "WorkerError", 4.0)
    assert deliver.output.error_type == QUARANTINED
    core.group_started(INFO, 5.0)
    for rid in ("b", "c"):
        out = schedule(core, 5.0)
        assert out.scheduled_request_ids == (rid,)
        if step_execution:
            done = result(RunnerOutput(rid, step_index=2, finished=True, images=["img"]))
        else:
            done = result(RunnerOutput(rid, images=["img"]))
        assert terminals(core.runner_output(out, done, 6.0)) == {rid: S.FINISHED_COMPLETED}
    assert schedule(core, 7.0).scheduled_request_ids == ("fresh",)
    assert_clean(core, trace)


def test_a_payload_the_workers_cannot_be_sent_fails_its_request_only() -> None:
    core, trace = make(max_num_seqs=4)
    admit(core, "bad")
    out = schedule(core)
    [deliver] = core.payload_rejected(out, "UnicodeEncodeError: surrogates not allowed", 2.0)
    assert isinstance(deliver, DeliverTerminal)
    assert deliver.output.error_type == PAYLOAD_REJECTED == "InvalidRequestError"
    assert "cannot be sent to the workers" in (deliver.output.error or "")
    assert core.group is GroupState.RUNNING and core.health().healthy
    assert_clean(core, trace)


def test_a_wave_whose_payload_cannot_be_sent_is_split_into_solo_runs() -> None:
    core, trace = make(max_num_seqs=4)
    for rid in ("a", "bad", "c"):
        admit(core, rid)
    out = schedule(core)
    assert out.scheduled_request_ids == ("a", "bad", "c")
    assert core.payload_rejected(out, "TypeError: cannot encode", 2.0) == []
    alone = schedule(core, 3.0)
    assert alone.scheduled_request_ids == ("a",)
    done = core.runner_output(alone, result(RunnerOutput("a", images=["img"])), 4.0)
    assert terminals(done) == {"a": S.FINISHED_COMPLETED}
    bad = schedule(core, 5.0)
    assert bad.scheduled_request_ids == ("bad",)
    [deliver] = core.payload_rejected(bad, "TypeError: cannot encode", 6.0)
    assert deliver.output.error_type == "InvalidRequestError"
    assert schedule(core, 7.0).scheduled_request_ids == ("c",)
    assert_clean(core, trace)


def test_in_step_mode_a_rejected_payload_leaves_the_running_batch_as_it_was() -> None:
    core, trace = make(max_num_seqs=4, step_execution=True)
    admit(core, "a", num_inference_steps=3)
    first = schedule(core)
    core.runner_output(first, result(RunnerOutput("a", step_index=1, finished=False)), 2.0)
    admit(core, "bad", now=2.0, num_inference_steps=3)
    tick = schedule(core, 3.0)
    assert tick.scheduled_cached_reqs == ("a",)
    assert [d.request_id for d in tick.scheduled_new_reqs] == ["bad"]
    [deliver] = core.payload_rejected(tick, "TypeError: cannot encode", 4.0)
    assert deliver.request_id == "bad"
    again = schedule(core, 5.0)
    assert again.scheduled_cached_reqs == ("a",) and not again.scheduled_new_reqs
    state = core.scheduler.get_request_state("a")
    assert state is not None and state.num_computed_steps == 1
    assert_clean(core, trace)


def test_an_output_lost_with_its_group_is_retried_else_it_fails() -> None:
    core, trace = make(max_retries_on_worker_failure=1, max_num_seqs=2)
    admit(core, "a")
    admit(core, "b")
    answer = result(
        RunnerOutput("a", async_output_id="k/a"), RunnerOutput("b", async_output_id="k/b")
    )
    core.runner_output(schedule(core), answer, 2.0)
    assert (
        core.output_lost("a", "k/a", "pump failed", "EngineDeadError", 3.0, group_lost=True) == []
    )
    assert core.status_of("a") is S.PREEMPTED
    state = core.scheduler.get_request_state("a")
    assert state is not None and state.history[-3:] == [S.RUNNING, S.PACKING, S.PREEMPTED]
    lost = core.output_lost("b", "k/b", "no such output", "WorkerError", 3.0)
    assert terminals(lost) == {"b": S.FINISHED_ERROR}
    assert core.output_lost("b", "k/b", "twice", "WorkerError", 3.0) == []  # stale
    assert_clean(core, trace)


# -- ending ---------------------------------------------------------------------------------


def test_close_ends_every_live_request_and_refuses_new_ones() -> None:
    core, trace = make(max_num_seqs=1)
    for rid in ("p", "r", "w"):
        admit(core, rid)
    core.runner_output(schedule(core), result(RunnerOutput("p", async_output_id="k/p")), 2.0)
    schedule(core, 2.0)
    instructions = core.close(3.0)
    assert instructions[:2] == [StopForwards(("r",)), DropOutput("k/p", "p")]
    assert terminals(instructions) == dict.fromkeys(("p", "r", "w"), S.FINISHED_ABORTED)
    assert {i.output.error_type for i in instructions if isinstance(i, DeliverTerminal)} == {
        "EngineClosedError"
    }
    assert core.close(3.1) == []
    with pytest.raises(EngineClosedError):
        admit(core, "late")
    assert core.health().state is EngineState.CLOSED
    assert core.statistics().worker_group is GroupState.STOPPED
    assert all(not ids for ids in core.leftovers().values())
    assert_clean(core, trace, closed=True)


def test_death_ends_every_live_request_with_an_engine_dead_error() -> None:
    core, trace = make()
    admit(core, "a")
    schedule(core)
    instructions = core.die(RuntimeError("supervisor gave up"), 2.0)
    assert terminals(instructions) == {"a": S.FINISHED_ERROR}
    final = instructions[-1]
    assert isinstance(final, DeliverTerminal) and final.output.error_type == "EngineDeadError"
    with pytest.raises(EngineDeadError, match="supervisor gave up"):
        admit(core, "b")
    assert core.die(RuntimeError("again"), 3.0) == []
    assert core.close(3.0) == []  # closing a dead engine ends nothing more
    assert core.health().state is EngineState.DEAD
    assert_clean(core, trace, closed=True)


# -- step mode ------------------------------------------------------------------------------


def step(rid: str, k: int, total: int, *, images: Any = None, done: bool = False) -> RunnerOutput:
    return RunnerOutput(rid, images=images, finished=done, step_index=k, total_steps=total)


def test_step_mode_previews_count_the_steps_the_worker_runs() -> None:
    core, trace = make(step_execution=True, streaming_output=True)
    admit(core, "a", num_inference_steps=5)
    # The worker runs only 3 steps (a model may make fewer than were asked for).
    first = core.runner_output(schedule(core), result(step("a", 1, 3, images=("p1",))), 1.0)
    [chunk] = first
    assert isinstance(chunk, DeliverChunk)
    assert (chunk.output.chunk_index, chunk.output.total_chunks) == (0, 3)
    core.runner_output(schedule(core, 2.0), result(step("a", 2, 3, images=("p2",))), 2.0)
    last = core.runner_output(
        schedule(core, 3.0), result(step("a", 3, 3, images=("final",), done=True)), 3.0
    )
    [deliver] = last
    assert isinstance(deliver, DeliverTerminal)
    assert (deliver.output.chunk_index, deliver.output.total_chunks) == (2, 3)
    # The workers hear of the finished id in an eviction-only tick.
    assert core.has_work()
    evict = schedule(core, 4.0)
    assert evict.is_empty and evict.finished_req_ids == {"a"}
    core.runner_output(evict, result(), 4.0)
    assert not core.has_work()
    assert_clean(core, trace)


def test_step_mode_preemption_keeps_progress_and_only_between_forwards() -> None:
    core, trace = make(step_execution=True)
    admit(core, "a", num_inference_steps=3)
    out = schedule(core)
    assert core.preempt("a", 1.5) is False  # a forward is in flight
    core.runner_output(out, result(step("a", 1, 3)), 2.0)
    assert core.preempt("a", 2.5) is True
    assert core.status_of("a") is S.PREEMPTED
    assert core.preempt("a", 2.6) is False
    again = schedule(core, 3.0)
    assert again.scheduled_cached_reqs == ("a",)  # its worker kept the step state
    state = core.scheduler.get_request_state("a")
    assert state is not None and state.num_computed_steps == 1
    [e] = [e for e in trace if e.kind is K.PREEMPT]
    assert e.detail == {"progress": 1}
    assert_clean(core, trace)


def test_a_group_failure_also_forgets_step_state_of_requests_preempted_at_a_boundary() -> None:
    core, trace = make(step_execution=True)
    admit(core, "a", num_inference_steps=3)
    core.runner_output(schedule(core), result(step("a", 1, 3)), 1.5)
    assert core.preempt("a", 1.6)
    core.group_failed("died", "WorkerError", 2.0)
    core.group_started(INFO, 3.0)
    again = schedule(core, 3.0)
    # The new group holds nothing of it: it gets the payload again, from step 0, no retry.
    assert [r.request_id for r in again.scheduled_new_reqs] == ["a"]
    state = core.scheduler.get_request_state("a")
    assert state is not None and (state.num_computed_steps, state.num_retries) == (0, 0)
    assert_clean(core, trace)


def test_an_output_announced_by_a_failed_result_is_dropped() -> None:
    core, trace = make()
    admit(core, "a")
    odd = RunnerOutput("a", async_output_id="k/a", error="boom", error_type="E")
    instructions = core.runner_output(schedule(core), result(odd), 2.0)
    assert DropOutput("k/a", "a") in instructions
    assert terminals(instructions) == {"a": S.FINISHED_ERROR}
    assert_clean(core, trace)


def test_a_reused_output_key_keeps_its_own_deadline() -> None:
    core, _ = make(output_timeout_s=10.0)
    admit(core, "a")
    core.runner_output(schedule(core), result(RunnerOutput("a", async_output_id="k/a")), 2.0)
    core.output_lost("a", "k/a", "gone", "EngineDeadError", 3.0, group_lost=True)
    core.group_failed("died", "WorkerError", 3.0)
    core.group_started(INFO, 4.0)
    # The rerun announces the same key (a backend may): the first wait's deadline is not its.
    core.runner_output(schedule(core, 9.0), result(RunnerOutput("a", async_output_id="k/a")), 10.0)
    assert core.expire(12.5) == []
    assert core.next_deadline() == 20.0


def test_restarts_count_groups_that_started_again() -> None:
    core, _ = make()
    core.group_failed("died", "WorkerError", 1.0)
    assert core.health().restarts == 0  # during the backoff nothing has restarted yet
    core.group_started(INFO, 2.0)
    assert (core.health().restarts, core.statistics().restarts) == (1, 1)


# -- deadlines (SamplingParams.deadline_s) ---------------------------------------------------


def _timed_out(instructions: list[Instruction]) -> dict[str, str | None]:
    return {
        i.request_id: i.output.error_type
        for i in instructions
        if isinstance(i, DeliverTerminal) and i.output.status is S.FINISHED_ABORTED
    }


@pytest.mark.parametrize("step_execution", [False, True])
def test_a_request_past_its_deadline_is_aborted_with_a_timeout_waiting_or_running(
    step_execution: bool,
) -> None:
    """The earliest deadline is the next wake-up; at it a waiting request ends at once and
    a running one is told to stop (its late result dropped); both FINISHED_ABORTED with
    RequestTimeoutError, all their state released, and a request that finished in time
    leaves no deadline behind."""
    core, trace = make(step_execution=step_execution, max_num_seqs=1)
    admit(core, "running", 0.0, deadline_s=5.0)
    admit(core, "waiting", 0.0, deadline_s=2.0)
    admit(core, "in-time", 0.0, deadline_s=50.0)
    assert core.next_deadline() == 2.0
    out = schedule(core, 1.0)
    assert out.scheduled_request_ids == ("running",)
    assert core.expire(1.9) == []
    ended = core.expire(2.0)
    assert _timed_out(ended) == {"waiting": "RequestTimeoutError"}
    [terminal] = [i for i in ended if isinstance(i, DeliverTerminal)]
    assert "deadline of 2 s" in (terminal.output.error or "")
    assert core.next_deadline() == 5.0
    ended = core.expire(5.5)
    assert isinstance(ended[0], StopForwards) and ended[0].request_ids == ("running",)
    assert _timed_out(ended) == {"running": "RequestTimeoutError"}
    late = RunnerOutput("running", images=["i"], step_index=2, finished=True)
    assert terminals(core.runner_output(out, result(late), 5.6)) == {}
    out = schedule(core, 6.0)
    assert out.scheduled_request_ids == ("in-time",)
    done = RunnerOutput("in-time", images=["i"], step_index=2, finished=True)
    assert terminals(core.runner_output(out, result(done), 7.0)) == {
        "in-time": S.FINISHED_COMPLETED
    }
    assert core.next_deadline() is None
    assert core.expire(100.0) == []
    assert [e.detail["reason"] for e in trace if e.kind is K.ABORT] == ["deadline", "deadline"]
    assert_clean(core, trace)


def test_a_deadline_belongs_to_its_incarnation_not_its_id() -> None:
    """A request that ended and an id reused by a new request: the old deadline does not
    abort the new one."""
    core, trace = make()
    admit(core, "a", 0.0, deadline_s=3.0)
    core.abort(["a"], 1.0)
    admit(core, "a", 1.0, deadline_s=10.0)
    assert core.next_deadline() == 11.0
    assert core.expire(3.0) == []
    assert _timed_out(core.expire(11.0)) == {"a": "RequestTimeoutError"}
    assert_clean(core, trace)


def test_a_reused_id_without_a_deadline_is_not_taken_for_the_one_that_had_it() -> None:
    """The old incarnation's deadline entry names its admission, not its state object's
    address: once the queue lets go of an aborted state (the next schedule pops it), CPython
    hands its address to the next one, and the new request, admitted without a deadline,
    must not be timed out (nor crash the expiry with its missing limit).  Found by the core
    machine in CI."""
    core = EngineCore(CoreConfig(), trace=None, seed=1)
    core.group_started(INFO, 0.0)
    for round_ in range(20):
        now = float(round_)
        admit(core, "a", now, deadline_s=0.5)
        core.abort(["a"], now)
        assert core.schedule(now, worker=0) is None  # pops the aborted state: it is freed
        admit(core, "a", now)
        assert core.expire(now + 1.0) == []
        core.abort(["a"], now + 1.0)
    assert core.next_deadline() is None


# -- diffusion accounting ---------------------------------------------------------------------


def test_request_mode_counts_wave_sizes_cancel_latency_and_wasted_steps() -> None:
    core, trace = make(max_num_seqs=2)
    admit(core, "a", num_inference_steps=10)
    admit(core, "b", num_inference_steps=10)
    out = schedule(core, 1.0)
    core.abort(["a", "b"], 1.5)
    # The stopped forward says how many steps it computed: all wasted.
    stopped = result(
        RunnerOutput("a", aborted=True, step_index=3), RunnerOutput("b", aborted=True, step_index=3)
    )
    core.runner_output(out, stopped, 1.52)
    admit(core, "c", num_inference_steps=10)
    out = schedule(core, 2.0)
    failed = RunnerOutput("c", error="boom", error_type="RuntimeError", step_index=4)
    assert terminals(core.runner_output(out, result(failed), 2.5)) == {"c": S.FINISHED_ERROR}
    admit(core, "d", num_inference_steps=10)
    core.abort(["d"], 3.0)  # waiting: no compute to stop, no latency measured
    stats = core.statistics()
    assert stats.batch_sizes == ((1, 1), (2, 1))
    assert stats.wasted_steps == 3 + 3 + 4
    assert sum(stats.cancel_latency_counts) == 2  # a and b, 20 ms each
    assert stats.cancel_latency_counts[2] == 2  # the (10 ms, 25 ms] bucket
    assert stats.cancel_latency_sum_s == pytest.approx(0.04)
    assert_clean(core, trace)


def test_request_mode_times_a_step_of_one_image_per_size_from_dispatch_to_result() -> None:
    """A wave of one size whose every request ran: its time over steps x images, folded
    into that size's moving average; a wave that stopped early or failed, or mixes sizes,
    measures nothing."""
    core, trace = make(max_num_seqs=2)
    admit(core, "a", num_inference_steps=10, height=32, width=32)
    admit(core, "b", num_inference_steps=10, height=32, width=32)
    out = schedule(core, 1.0)
    assert out.scheduled_request_ids == ("a", "b")
    ok = [RunnerOutput(r, images=["i"], step_index=10, finished=True) for r in ("a", "b")]
    core.runner_output(out, result(*ok), 1.6)  # 0.6 s / (10 steps x 2 images)
    assert core.step_times == {1024: pytest.approx(0.03)}
    admit(core, "c", num_inference_steps=10, height=32, width=32)
    out = schedule(core, 2.0)
    core.runner_output(out, result(RunnerOutput("c", images=["i"], finished=True)), 2.7)
    alpha = engine_core_module.STEP_TIME_ALPHA
    assert core.step_times[1024] == pytest.approx(0.03 + alpha * (0.07 - 0.03))
    before = core.step_times
    admit(core, "d", num_inference_steps=10, height=32, width=32)
    out = schedule(core, 3.0)
    core.abort(["d"], 3.1)
    core.runner_output(out, result(RunnerOutput("d", aborted=True, step_index=1)), 3.2)
    admit(core, "e", num_inference_steps=10, height=64, width=64)
    out = schedule(core, 4.0)
    failed = RunnerOutput("e", error="boom", error_type="RuntimeError")
    core.runner_output(out, result(failed), 4.5)
    assert core.step_times == before  # an abort and a failure say nothing of a step
    assert core.statistics().step_time_s == tuple(sorted(before.items()))
    assert_clean(core, trace)


def test_warmup_and_calibration_requests_are_not_timed() -> None:
    """Uncounted requests (warmup, calibration: cold first forwards) measure no step."""
    core, trace = make()
    request = DiffusionRequest("p", SamplingParams(num_inference_steps=2, seed=5), "warm")
    core.admit(request, 0.0, counted=False)
    out = schedule(core, 1.0)
    core.runner_output(out, result(RunnerOutput("warm", images=["i"], finished=True)), 9.0)
    assert core.step_times == {}
    assert_clean(core, trace)


def test_step_mode_times_each_tick_as_one_step_of_its_images() -> None:
    core, trace = make(max_num_seqs=2, step_execution=True)
    admit(core, "a", num_inference_steps=2, height=64, width=64)
    out = schedule(core, 1.0)
    core.runner_output(out, result(RunnerOutput("a", step_index=1, finished=False)), 1.3)
    assert core.step_times == {4096: pytest.approx(0.3)}
    core.runner_output(
        schedule(core, 2.0), result(RunnerOutput("a", images=["i"], finished=True)), 2.1
    )
    alpha = engine_core_module.STEP_TIME_ALPHA
    assert core.step_times == {4096: pytest.approx(0.3 + alpha * (0.1 - 0.3))}
    assert_clean(core, trace)


def test_step_mode_counts_applied_steps_and_the_tick_in_flight_as_wasted() -> None:
    core, trace = make(max_num_seqs=2, step_execution=True)
    admit(core, "a", num_inference_steps=5)
    for tick in range(2):
        out = schedule(core, 1.0 + tick)
        core.runner_output(
            out, result(RunnerOutput("a", step_index=tick + 1, finished=False)), 1.1 + tick
        )
    out = schedule(core, 3.0)
    core.abort(["a"], 3.05)  # two steps applied, a third in flight
    core.runner_output(out, result(RunnerOutput("a", step_index=3, finished=False)), 3.2)
    stats = core.statistics()
    assert stats.wasted_steps == 3
    assert stats.batch_sizes == ((1, 3),)
    assert stats.cancel_latency_counts[5] == 1  # (100 ms, 250 ms]
    assert_clean(core, trace)


def test_step_mode_times_each_tick_from_dispatch_to_result_and_request_mode_none() -> None:
    from omni_trio._core.health import TICK_BUCKETS_S

    core, trace = make(max_num_seqs=2, step_execution=True)
    admit(core, "a", num_inference_steps=3)
    admit(core, "b", num_inference_steps=3)
    for tick, took in enumerate((0.004, 0.02, 0.3)):
        out = schedule(core, 10.0 + tick)
        done = tick == 2
        outputs = [RunnerOutput(rid, step_index=tick + 1, finished=done) for rid in ("a", "b")]
        core.runner_output(out, result(*outputs), 10.0 + tick + took)
    stats = core.statistics()
    assert len(stats.tick_counts) == len(TICK_BUCKETS_S) + 1
    assert sum(stats.tick_counts) == 3  # one per tick, whatever its batch
    assert stats.tick_counts[2] == 1  # (2.5 ms, 5 ms]
    assert stats.tick_counts[4] == 1  # (10 ms, 25 ms]
    assert stats.tick_counts[8] == 1  # (250 ms, 500 ms]
    assert stats.tick_sum_s == pytest.approx(0.324)
    assert_clean(core, trace)

    core, trace = make(max_num_seqs=1)
    admit(core, "c", num_inference_steps=3)
    out = schedule(core, 1.0)
    core.runner_output(out, result(RunnerOutput("c")), 1.5)
    assert sum(core.statistics().tick_counts) == 0  # request mode: a wave is no tick
    assert_clean(core, trace)


# -- sleep and wake ----------------------------------------------------------------------


def test_falling_asleep_holds_the_queue_and_waits_for_running_and_packing() -> None:
    from omni_trio._core.health import SleepState

    core, trace = make(max_num_seqs=1)
    admit(core, "run")
    out = schedule(core)
    core.begin_sleep(2, 1.5)
    assert core.sleep_state is SleepState.FALLING_ASLEEP
    admit(core, "later", now=1.6)
    # The running request is busy; the waiting one does not start.
    assert core.busy_ids() == ["run"]
    announced = RunnerOutput("run", async_output_id="b/run")
    core.runner_output(out, result(announced), 2.0, worker=0)
    assert core.busy_ids() == ["run"]  # packing
    core.output_ready("run", "b/run", RunnerOutput("run", images=("img",)), 2.1)
    assert core.busy_ids() == []
    assert not core.has_work() and core.schedule(2.2, worker=0) is None
    core.fell_asleep(2, 2.3)
    health = core.health()
    assert (health.state, health.healthy, health.sleep_level) == (EngineState.SLEEPING, False, 2)
    assert core.status_of("later") is S.WAITING
    assert core.begin_wake(3.0)
    assert not core.has_work()  # still holding while waking
    core.woke(3.1)
    assert core.has_work()
    assert schedule(core, 3.2).scheduled_request_ids == ("later",)
    stats = core.statistics()
    assert (stats.sleep_state, stats.sleep_level, stats.sleeps) == (SleepState.AWAKE, 0, 1)
    sleep_events = [
        (e.kind, e.detail["state"]) for e in trace.events if e.kind in (K.SLEEP, K.WAKE)
    ]
    assert sleep_events == [
        (K.SLEEP, "falling_asleep"),
        (K.SLEEP, "asleep"),
        (K.WAKE, "waking"),
        (K.WAKE, "awake"),
    ]
    assert check_trace(trace.events, closed=False, abort_latency_s=0.0) == []


def test_a_failed_sleep_or_wake_goes_back_to_where_it_was() -> None:
    from omni_trio._core.health import SleepState

    core, _ = make()
    core.begin_sleep(1, 0.0)
    core.sleep_failed(0.1, "StallError: still running")
    assert (core.sleep_state, core.scheduler.holding) == (SleepState.AWAKE, False)
    core.begin_sleep(1, 0.2)
    core.fell_asleep(1, 0.3)
    # A deeper sleep that fails leaves it asleep at level 1.
    core.begin_sleep(2, 0.4)
    core.sleep_failed(0.5, "WorkerError")
    assert (core.sleep_state, core.sleep_level, core.scheduler.holding) == (
        SleepState.ASLEEP,
        1,
        True,
    )
    assert core.begin_wake(0.6)
    core.wake_failed(0.7, "OSError")
    assert (core.sleep_state, core.sleep_level) == (SleepState.ASLEEP, 1)
    assert core.begin_wake(0.8)
    core.woke(0.9)
    assert not core.begin_wake(1.0)  # awake: nothing to do


def test_sleep_refuses_bad_levels_overlaps_and_ended_engines() -> None:
    core, _ = make()
    with pytest.raises(ValueError, match="1 or 2"):
        core.begin_sleep(3, 0.0)
    core.begin_sleep(1, 0.0)
    with pytest.raises(RuntimeError, match="under way"):
        core.begin_sleep(1, 0.1)
    with pytest.raises(RuntimeError, match="under way"):
        core.begin_wake(0.1)
    with pytest.raises(RuntimeError):
        core.woke(0.1)
    core.close(0.2)
    with pytest.raises(EngineClosedError):
        core.begin_sleep(1, 0.3)


def test_reject_while_asleep_refuses_admission_without_admitting() -> None:
    from omni_trio.errors import EngineAsleepError

    core, _ = make(reject_while_asleep=True)
    core.begin_sleep(1, 0.0)
    with pytest.raises(EngineAsleepError, match="falling asleep"):
        admit(core, "r")
    core.fell_asleep(1, 0.1)
    with pytest.raises(EngineAsleepError, match="asleep"):
        admit(core, "r")
    assert core.statistics().admitted == 0
    core.begin_wake(0.2)
    core.woke(0.3)
    admit(core, "r")
    assert core.status_of("r") is S.WAITING


# -- the scheduler class (EngineConfig.scheduler_cls) ------------------------------------------


def test_the_core_builds_the_configured_scheduler_class() -> None:
    from omni_trio._core.scheduler import RequestScheduler, StepScheduler

    class Waves(RequestScheduler):
        pass

    class Ticks(StepScheduler):
        pass

    assert type(EngineCore(CoreConfig()).scheduler) is RequestScheduler
    assert type(EngineCore(CoreConfig(scheduler_cls=Waves)).scheduler) is Waves
    core = EngineCore(CoreConfig(step_execution=True, max_num_seqs=3, scheduler_cls=Ticks))
    assert type(core.scheduler) is Ticks and core.scheduler.capacity == 3
    with pytest.raises(ValueError, match="subclass of StepScheduler in step mode"):
        EngineCore(CoreConfig(step_execution=True, scheduler_cls=Waves))
    with pytest.raises(ValueError, match="subclass of RequestScheduler in request mode"):
        EngineCore(CoreConfig(scheduler_cls=Ticks))


# -- LoRA at admission ---------------------------------------------------------------------


def test_lora_is_canonical_after_admission_and_checked_against_the_registry() -> None:
    import dataclasses

    core, _ = make(lora_names=frozenset({"outline", "stripes"}), max_loras=2)
    core.group_started(dataclasses.replace(INFO, lora_input=True), 0.0)
    admitted = admit(core, "r", lora=["stripes", ("outline", 0.5)])
    assert admitted.sampling.lora == (("outline", 0.5), ("stripes", 1.0))
    with pytest.raises(InvalidRequestError, match="unknown LoRA adapter 'dots'") as info:
        admit(core, "r2", lora="dots")
    assert info.value.param == "lora"
    core2, _ = make(lora_names=frozenset({"a", "b", "c"}), max_loras=2)
    core2.group_started(dataclasses.replace(INFO, lora_input=True), 0.0)
    with pytest.raises(InvalidRequestError, match="at most 2"):
        admit(core2, "r", lora=["a", "b", "c"])
    assert core2.statistics().admitted == 0


def test_a_model_that_cannot_apply_lora_refuses_it_at_admission() -> None:
    core, _ = make(lora_names=frozenset({"outline"}))
    with pytest.raises(InvalidRequestError, match="cannot apply LoRA") as info:
        admit(core, "r", lora="outline")
    assert info.value.param == "lora"
    admit(core, "r")  # without one it is admitted


def test_check_admission_decides_as_admit_does_without_the_core() -> None:
    """The pure admission a process-backed stage's caller runs: the model's default size and
    a seed filled in, the limits and reject_while_asleep enforced, nothing recorded."""
    import random

    from omni_trio._core.engine_core import check_admission
    from omni_trio._core.health import SleepState
    from omni_trio.errors import EngineAsleepError

    config = CoreConfig(limits=RequestLimits(max_steps=10), reject_while_asleep=True)
    request = DiffusionRequest("p", SamplingParams(num_inference_steps=4), "r1")

    def check(request: DiffusionRequest, sleep: SleepState = SleepState.AWAKE) -> Any:
        return check_admission(
            request,
            config,
            model_info=INFO,
            cost_model=None,
            sleep_state=sleep,
            seeds=random.Random(0),
        )

    checked = check(request)
    assert (checked.sampling.height, checked.sampling.width) == (48, 64)
    assert checked.sampling.seed == random.Random(0).randrange(2**31)
    # The core's admit fills in the same (its seeds drawn from its own generator).
    core = EngineCore(config)
    core.group_started(INFO, 0.0)
    admitted = core.admit(request, 0.0)
    assert (admitted.sampling.height, admitted.sampling.width) == (48, 64)
    with pytest.raises(InvalidRequestError, match="num_inference_steps"):
        check(request.replace(sampling=SamplingParams(num_inference_steps=11)))
    with pytest.raises(EngineAsleepError):
        check(request, SleepState.ASLEEP)
