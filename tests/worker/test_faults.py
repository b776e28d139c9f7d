"""Fault injection in the worker: parsing, where each fault fires, and what it does.

Driven through a real :class:`Worker` on ``builtin:echo`` (and the inproc executor for the
fail-closed check).  Delays go through a fake clock (:class:`FakeClock`); ordering between the
worker's thread and the output packer's thread is forced with ``threading.Event`` gates, and
every real-thread wait is bounded by ``CAP_S``.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import omni_trio.worker.faults as faults_module
from omni_trio._core.messages import (
    AsyncOutput,
    AsyncOutputKind,
    BatchRunnerOutput,
    NewRequestData,
    RunnerOutput,
    SchedulerOutput,
)
from omni_trio._core.request import DiffusionRequest, SamplingParams
from omni_trio.errors import EngineClosedError, EngineDeadError, InvalidConfigError
from omni_trio.executors.base import open_executor
from omni_trio.executors.inproc import InprocExecutor
from omni_trio.models.echo import decode_echo_image
from omni_trio.worker.faults import (
    EXIT_CODE,
    STEP_FAULTS,
    WARMUP_REQUEST_ID,
    DeviceFaultInjected,
    Fault,
    FaultInjectedError,
    FaultInjector,
    FaultSpec,
    WorkerCrashInjected,
    WorkerFatalError,
    split_fault_options,
)
from omni_trio.worker.stop_flags import StopFlags
from omni_trio.worker.worker import Worker
from tests.worker.test_worker import config, wave

CAP_S = 10.0
STEPS = 4
COMPUTE_DONE = AsyncOutputKind.COMPUTE_DONE
OUTPUT_READY = AsyncOutputKind.OUTPUT_READY


def request(rid: str, *faults: FaultSpec | dict[str, Any], seed: int = 3) -> DiffusionRequest:
    extra = {"faults": [f.to_dict() if isinstance(f, FaultSpec) else f for f in faults]}
    return DiffusionRequest(
        "p",
        SamplingParams(
            height=32,
            width=32,
            num_inference_steps=STEPS,
            seed=seed,
            output_type="np",
            extra_args=extra if faults else {},
        ),
        request_id=rid,
    )


def at(kind: Fault, step: int, **kw: Any) -> FaultSpec:
    return FaultSpec(kind, step=step, **kw)


def delayed(kind: Fault, delay_s: float) -> FaultSpec:
    return FaultSpec(kind, delay_s=delay_s)


class FakeClock:
    """Records every fault delay instead of sleeping; ``hook`` runs on each one."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self.hook: Callable[[float], None] = lambda seconds: None

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.hook(seconds)
        self.now += seconds


class ObservedFlags(StopFlags):
    """Stop flags that tell the test when a hang has polled them ``polls`` more times."""

    def __init__(self) -> None:
        super().__init__()
        self._cond = threading.Condition()
        self._empty_polls = 0

    def should_stop(self, request_ids: Any) -> bool:
        ids = list(request_ids)
        if not ids:  # only the in-process hang asks about nothing
            with self._cond:
                self._empty_polls += 1
                self._cond.notify_all()
        return super().should_stop(ids)

    def wait_polls(self, more: int) -> None:
        with self._cond:
            target = self._empty_polls + more
            assert self._cond.wait_for(lambda: self._empty_polls >= target, CAP_S)


def make_worker(
    cache_dir: Path,
    *,
    clock: FakeClock | None = None,
    stop_flags: StopFlags | None = None,
    rank: int = 0,
    world_size: int = 1,
    **overrides: Any,
) -> Worker:
    overrides.setdefault("fault_injection", True)
    cfg = config(cache_dir, **overrides)
    w = Worker(cfg, rank=rank, world_size=world_size, stop_flags=stop_flags)
    if clock is not None:
        w.faults = FaultInjector.from_config(
            cfg, rank=rank, stop_flags=w.stop_flags, sleep=clock.sleep
        )
    w.init_device()
    w.load_model()
    return w


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def worker(cache_dir: Path, clock: FakeClock) -> Iterator[Worker]:
    w = make_worker(cache_dir, clock=clock)
    yield w
    w.shutdown()


@pytest.fixture
def step_worker(cache_dir: Path, clock: FakeClock) -> Iterator[Worker]:
    w = make_worker(cache_dir, clock=clock, step_execution=True)
    yield w
    w.shutdown()


def ok(out: RunnerOutput | None, rid: str, seed: int = 3) -> None:
    assert out is not None and out.error is None, out
    assert out.images is not None
    assert decode_echo_image(out.images[0]) == (rid, seed, 0)


def failed(out: RunnerOutput | None, error_type: str = "FaultInjectedError") -> str:
    assert out is not None and out.error_type == error_type, out
    assert out.error is not None
    return out.error


def test_fault_options_are_split_off_and_checked() -> None:
    model, fault = split_fault_options({"step_delay_s": 0.1, "fault_fail_warmup": True})
    assert model == {"step_delay_s": 0.1}
    assert fault == {"fault_fail_warmup": True}
    with pytest.raises(InvalidConfigError, match="unknown fault option 'fault_typo'") as info:
        split_fault_options({"fault_typo": 1})
    assert info.value.field == "model_options"


# -- plans ----------------------------------------------------------------------------------


def test_a_disabled_injector_ignores_faults_even_malformed_ones() -> None:
    injector = FaultInjector(enabled=False, fail_warmup=True)
    plan = injector.plan(
        [
            request("a", at(Fault.RAISE_AT_STEP, 0)),
            request("bad", {"kind": "explode"}),
            request(WARMUP_REQUEST_ID),
        ]
    )
    assert not plan and not plan.invalid
    plan.on_step("a", 0, STEPS)  # nothing fires


def test_plans_keep_this_ranks_faults_and_list_malformed_requests() -> None:
    injector = FaultInjector(enabled=True, rank=1)
    plan = injector.plan(
        [
            request("mine", at(Fault.RAISE_AT_STEP, 0, rank=1), FaultSpec(Fault.FAIL_PACKING)),
            request("theirs", at(Fault.RAISE_AT_STEP, 0, rank=0)),
            request("bad", {"kind": "raise_at_step"}),
            request("clean"),
        ]
    )
    assert plan
    assert [s.kind for s in plan.faults_for("mine")] == [Fault.RAISE_AT_STEP, Fault.FAIL_PACKING]
    assert plan.faults_for("theirs") == () and plan.faults_for("clean") == ()
    assert list(plan.invalid) == ["bad"] and "needs a 'step'" in plan.invalid["bad"]
    assert not injector.plan(
        [request("clean"), request("theirs", at(Fault.HANG_AT_STEP, 0, rank=0))]
    )


@pytest.mark.parametrize("kind", sorted(STEP_FAULTS))
def test_step_faults_fire_exactly_at_their_step(kind: Fault) -> None:
    injector = FaultInjector(enabled=True, stop_flags=StopFlags(), worker_process=False)
    injector.release()  # a hang returns at once
    plan = injector.plan([request("r", at(kind, 2)), request("peer")])
    for step in (0, 1):
        plan.on_step("r", step, STEPS)
    plan.on_step("peer", 2, STEPS)
    plan.before_pack("r")
    plan.after_pack("r")
    plan.after_forward(["r"])
    expected: type[Exception] = {
        Fault.RAISE_AT_STEP: FaultInjectedError,
        Fault.POISON_DEVICE: DeviceFaultInjected,
    }.get(kind, WorkerCrashInjected)
    assert not injector.device_poisoned
    with pytest.raises(expected, match=f"{kind.value} at step 2 for request 'r'") as info:
        plan.on_step("r", 2, STEPS)
    error: Any = info.value
    assert error.step == 2 and error.kind is kind and error.request_id == "r"
    assert injector.device_poisoned is (kind is Fault.POISON_DEVICE)
    plan.on_step("r", 3, STEPS)  # later steps do not fire again


def test_errors_are_flat_and_crashes_are_fatal() -> None:
    assert issubclass(FaultInjectedError, RuntimeError)
    assert not issubclass(FaultInjectedError, WorkerFatalError)
    assert issubclass(WorkerCrashInjected, WorkerFatalError)
    assert not issubclass(WorkerFatalError, RuntimeError)


class FakeOs:
    """Stands in for ``os`` in the faults module: records how the process would end."""

    class Ended(BaseException):
        pass

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def getpid(self) -> int:
        return 4242

    def kill(self, pid: int, sig: int) -> None:
        self.calls.append(("kill", (pid, sig)))
        raise self.Ended

    def _exit(self, code: int) -> None:
        self.calls.append(("_exit", code))
        raise self.Ended


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (Fault.CRASH_AT_STEP, [("_exit", EXIT_CODE)]),
        (Fault.SIGKILL_AT_STEP, [("kill", (4242, signal.SIGKILL))]),
    ],
)
def test_in_a_worker_process_crashes_end_the_process(
    monkeypatch: pytest.MonkeyPatch, kind: Fault, expected: list[tuple[str, Any]]
) -> None:
    fake = FakeOs()
    monkeypatch.setattr(faults_module, "os", fake)
    plan = FaultInjector(enabled=True, worker_process=True).plan([request("r", at(kind, 1))])
    plan.on_step("r", 0, STEPS)
    with pytest.raises(FakeOs.Ended):
        plan.on_step("r", 1, STEPS)
    assert fake.calls == expected


def test_in_a_worker_process_a_hang_sleeps_forever_ignoring_stop_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Ended(BaseException):
        pass

    naps: list[float] = []

    class FakeTime:
        def sleep(self, seconds: float) -> None:
            naps.append(seconds)
            if len(naps) == 3:
                raise Ended

    monkeypatch.setattr(faults_module, "time", FakeTime())
    flags = StopFlags()
    flags.stop_everything()
    injector = FaultInjector(enabled=True, stop_flags=flags, worker_process=True)
    injector.release()
    with pytest.raises(Ended):
        injector.plan([request("r", at(Fault.HANG_AT_STEP, 0))]).on_step("r", 0, STEPS)
    assert len(naps) == 3  # still asleep after shutdown was asked: only a kill ends it


def test_worker_process_defaults_to_the_process_mark(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(faults_module, "_worker_process", False)
    injector = FaultInjector(enabled=True)
    assert not injector.worker_process and not faults_module.in_worker_process()
    faults_module.mark_worker_process()
    assert faults_module.in_worker_process() and injector.worker_process


# -- request mode through a Worker ----------------------------------------------------------


def test_raise_at_step_fails_the_whole_fused_forward(worker: Worker) -> None:
    out = worker.execute_scheduler_output(
        wave(request("a", at(Fault.RAISE_AT_STEP, 2)), request("b"))
    )
    assert "raise_at_step at step 2 for request 'a'" in failed(out.get("a"))
    failed(out.get("b"))  # one forward: its peer fails with it
    assert worker.steps_done == 3  # the fault fired right after on_step(2, total)
    assert worker.progress == {}
    ok(worker.execute_scheduler_output(wave(request("next"))).get("next"), "next")


def test_a_step_past_the_last_never_fires(worker: Worker) -> None:
    out = worker.execute_scheduler_output(wave(request("a", at(Fault.RAISE_AT_STEP, STEPS))))
    ok(out.get("a"), "a")


def test_faults_are_ignored_without_fault_injection(cache_dir: Path) -> None:
    w = make_worker(cache_dir, fault_injection=False)
    try:
        out = w.execute_scheduler_output(
            wave(
                request("a", at(Fault.CRASH_AT_STEP, 0), FaultSpec(Fault.FAIL_PACKING)),
                request("bad", {"kind": "explode"}),
            )
        )
        step = make_worker(cache_dir, fault_injection=False, step_execution=True)
        try:
            first = step.execute_stepwise(wave(request("s", at(Fault.RAISE_AT_STEP, 0))))
        finally:
            step.shutdown()
    finally:
        w.shutdown()
    ok(out.get("a"), "a")
    ok(out.get("bad"), "bad")
    result = first.get("s")
    assert result is not None and result.error is None and result.step_index == 1


def test_faults_of_another_rank_do_not_fire(cache_dir: Path) -> None:
    w = make_worker(cache_dir, rank=0)
    try:
        out = w.execute_scheduler_output(wave(request("a", at(Fault.RAISE_AT_STEP, 0, rank=1))))
    finally:
        w.shutdown()
    ok(out.get("a"), "a")


def test_a_malformed_fault_fails_only_its_request(worker: Worker) -> None:
    out = worker.execute_scheduler_output(
        wave(request("bad", {"kind": "raise_at_step", "step": -2}), request("good"))
    )
    assert "step must be an integer >= 0" in failed(out.get("bad"), "ValueError")
    ok(out.get("good"), "good")


@pytest.mark.parametrize("kind", [Fault.CRASH_AT_STEP, Fault.SIGKILL_AT_STEP])
def test_an_in_process_crash_propagates_out_of_the_worker_call(worker: Worker, kind: Fault) -> None:
    with pytest.raises(WorkerCrashInjected, match=f"{kind.value} at step 1"):
        worker.execute_scheduler_output(wave(request("a", at(kind, 1)), request("b")))
    assert worker.steps_done == 2
    assert worker.progress == {}
    runner = worker.runner
    assert runner is not None
    with pytest.raises(WorkerCrashInjected):
        runner.forward_batch([request("c", at(kind, 0))])
    with pytest.raises(WorkerCrashInjected):
        runner.execute_model_batch([request("c", at(kind, 0))])


def test_an_in_process_hang_ignores_aborts_until_shutdown(cache_dir: Path) -> None:
    flags = ObservedFlags()
    w = make_worker(cache_dir, stop_flags=flags)
    outcome: list[BaseException | BatchRunnerOutput] = []

    def forward() -> None:
        try:
            outcome.append(
                w.execute_scheduler_output(wave(request("a", at(Fault.HANG_AT_STEP, 1))))
            )
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=forward, name="test-hang")
    try:
        thread.start()
        flags.wait_polls(2)  # hanging at step 1
        flags.abort(["a"])
        flags.wait_polls(2)  # the abort is ignored
        assert thread.is_alive() and not outcome
        assert w.progress == {"a": (1, STEPS)}
        flags.stop_everything()  # what the executor's close does first
        thread.join(CAP_S)
        assert not thread.is_alive()
    finally:
        w.faults.release()
        thread.join(CAP_S)
        w.shutdown()
    assert len(outcome) == 1 and isinstance(outcome[0], WorkerCrashInjected)
    assert "hang_at_step at step 1" in str(outcome[0])


def test_release_ends_an_in_process_hang() -> None:
    injector = FaultInjector(enabled=True, stop_flags=StopFlags(), worker_process=False)
    plan = injector.plan([request("a", at(Fault.HANG_AT_STEP, 0))])
    errors: list[BaseException] = []

    def hang() -> None:
        try:
            plan.on_step("a", 0, STEPS)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=hang, name="test-hang")
    thread.start()
    injector.release()
    thread.join(CAP_S)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], WorkerCrashInjected)


def test_fail_packing_fails_only_its_request_in_synchronous_packing(worker: Worker) -> None:
    out = worker.execute_scheduler_output(
        wave(request("a", FaultSpec(Fault.FAIL_PACKING)), request("b"))
    )
    assert "fail_packing for request 'a'" in failed(out.get("a"))
    ok(out.get("b"), "b")
    runner = worker.runner
    assert runner is not None
    packed = runner.execute_model_batch([request("c", FaultSpec(Fault.FAIL_PACKING))])
    failed(packed.get("c"))


def test_delays_in_synchronous_request_mode(worker: Worker, clock: FakeClock) -> None:
    out = worker.execute_scheduler_output(
        wave(
            request(
                "a",
                delayed(Fault.SLOW_PACKING, 0.5),
                delayed(Fault.DELAY_COMPUTE_DONE, 0.25),
                delayed(Fault.DELAY_OUTPUT_READY, 9.0),  # async packer only
            ),
            request("b", delayed(Fault.DELAY_COMPUTE_DONE, 0.75)),
        )
    )
    ok(out.get("a"), "a")
    ok(out.get("b"), "b")
    # After the forward: the largest compute-done delay, once; then a's packing delay.
    assert clock.sleeps == [0.75, 0.5]


# -- request mode with the async output packer ----------------------------------------------


class Replies:
    """The worker's reply sink: records messages; ``seen(kind)`` events gate the test."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.messages: list[AsyncOutput] = []
        self.output_ready = threading.Event()

    def __call__(self, message: AsyncOutput) -> None:
        with self._lock:
            self.messages.append(message)
        if message.kind is OUTPUT_READY:
            self.output_ready.set()

    def kinds(self) -> list[AsyncOutputKind]:
        with self._lock:
            return [m.kind for m in self.messages]

    def ready(self) -> list[AsyncOutput]:
        with self._lock:
            return [m for m in self.messages if m.kind is OUTPUT_READY]


@pytest.fixture
def packed_worker(worker: Worker) -> tuple[Worker, Replies]:
    replies = Replies()
    worker.start_output_packer(replies)
    return worker, replies


def ready_result(message: AsyncOutput) -> BatchRunnerOutput:
    assert message.error is None, message
    assert isinstance(message.result, BatchRunnerOutput)
    return message.result


def test_fail_and_slow_packing_in_the_async_packer(
    packed_worker: tuple[Worker, Replies], clock: FakeClock
) -> None:
    worker, replies = packed_worker
    out = worker.execute_scheduler_output(
        wave(
            request("a", FaultSpec(Fault.FAIL_PACKING)),
            request("b", delayed(Fault.SLOW_PACKING, 0.5)),
        ),
        rpc_id="rpc-1",
    )
    assert all(o.async_output_id for o in out)  # both left the forward fine
    assert worker.drain_outputs(CAP_S)
    [message] = replies.ready()
    result = ready_result(message)
    assert "fail_packing" in failed(result.get("a"))
    ok(result.get("b"), "b")
    assert clock.sleeps == [0.5]


def test_delay_compute_done_lets_output_ready_come_first(
    packed_worker: tuple[Worker, Replies], clock: FakeClock
) -> None:
    worker, replies = packed_worker
    # The delay waits until the packer has sent OUTPUT_READY: proof that the forward's
    # return (this backend's COMPUTE_DONE) is what is late, not the packing.
    clock.hook = lambda seconds: replies.output_ready.wait(CAP_S)
    out = worker.execute_scheduler_output(
        wave(request("a", delayed(Fault.DELAY_COMPUTE_DONE, 0.3))), rpc_id="rpc-1"
    )
    assert clock.sleeps == [0.3]
    assert replies.kinds() == [COMPUTE_DONE, OUTPUT_READY]  # all sent before the return
    ok(ready_result(replies.ready()[0]).get("a"), "a")
    assert out.get("a") is not None


def test_delay_output_ready_holds_the_output_behind_later_forwards(
    packed_worker: tuple[Worker, Replies], clock: FakeClock
) -> None:
    worker, replies = packed_worker
    go_on = threading.Event()
    clock.hook = lambda seconds: go_on.wait(CAP_S)
    first = worker.execute_scheduler_output(
        wave(request("slow", delayed(Fault.DELAY_OUTPUT_READY, 0.2))), rpc_id="rpc-1"
    )
    second = worker.execute_scheduler_output(wave(request("fast")), rpc_id="rpc-2")
    # Both forwards answered while the first output is held back after packing.
    assert replies.kinds() == [COMPUTE_DONE, COMPUTE_DONE]
    go_on.set()
    assert worker.drain_outputs(CAP_S)
    assert clock.sleeps == [0.2]
    ids = [m.async_output_id for m in replies.messages]
    slow_id = first.outputs["slow"].async_output_id
    fast_id = second.outputs["fast"].async_output_id
    assert slow_id and fast_id
    assert ids[2:] == [slow_id.split("/")[0], fast_id.split("/")[0]]
    ok(ready_result(replies.ready()[0]).get("slow"), "slow")


# -- step mode ------------------------------------------------------------------------------


def tick(
    worker: Worker,
    new: tuple[DiffusionRequest, ...] = (),
    cached: tuple[str, ...] = (),
    step_id: int = 1,
) -> BatchRunnerOutput:
    return worker.execute_stepwise(
        SchedulerOutput(
            step_id=step_id,
            scheduled_new_reqs=tuple(NewRequestData(r.request_id, r) for r in new),
            scheduled_cached_reqs=cached,
        )
    )


def test_step_mode_raise_fails_only_its_request_at_its_step(step_worker: Worker) -> None:
    out = tick(step_worker, new=(request("a", at(Fault.RAISE_AT_STEP, 1)), request("b")))
    assert out.outputs["a"].step_index == 1 and out.outputs["b"].step_index == 1
    out = tick(step_worker, cached=("a", "b"), step_id=2)
    a = out.outputs["a"]
    assert "raise_at_step at step 1 for request 'a'" in failed(a)
    assert a.step_index == 1  # left at the failed step
    assert out.outputs["b"].error is None and out.outputs["b"].step_index == 2
    runner = step_worker.runner
    assert runner is not None and runner._step_runner is not None
    assert "a" not in runner._step_runner.states  # evicted with its plan
    assert "a" not in runner._step_runner._fault_plans


def test_step_mode_crash_propagates_out_of_execute_stepwise(step_worker: Worker) -> None:
    tick(step_worker, new=(request("a", at(Fault.CRASH_AT_STEP, 1)), request("b")))
    with pytest.raises(WorkerCrashInjected, match="crash_at_step at step 1"):
        tick(step_worker, cached=("a", "b"), step_id=2)


def test_step_mode_packing_faults_hit_the_final_decode(
    step_worker: Worker, clock: FakeClock
) -> None:
    requests = (
        request("a", FaultSpec(Fault.FAIL_PACKING)),
        request("b", delayed(Fault.SLOW_PACKING, 0.5)),
        request("bad", {"kind": "slow_packing"}),
    )
    out = tick(step_worker, new=requests)
    assert "needs a 'delay_s'" in failed(out.outputs["bad"], "ValueError")
    for step in range(2, STEPS + 1):
        assert clock.sleeps == []  # not before the final decode
        out = tick(step_worker, cached=("a", "b"), step_id=step)
    assert "fail_packing" in failed(out.outputs["a"])
    assert out.outputs["a"].step_index == STEPS  # denoised, failed while packing
    b = out.outputs["b"]
    assert b.finished and b.step_index == STEPS
    ok(b, "b")
    assert clock.sleeps == [0.5]


# -- fail_warmup ----------------------------------------------------------------------------


@pytest.mark.parametrize("step_execution", [False, True])
def test_fail_warmup_fails_the_warmup_request_only(cache_dir: Path, step_execution: bool) -> None:
    w = make_worker(
        cache_dir,
        model_options={"fault_fail_warmup": True},  # the echo loader never sees it
        step_execution=step_execution,
    )
    try:
        run = w.execute_stepwise if step_execution else w.execute_scheduler_output
        out = run(wave(request(WARMUP_REQUEST_ID), request("user")))
    finally:
        w.shutdown()
    assert "fail_warmup at step 0" in failed(out.get(WARMUP_REQUEST_ID))
    user = out.get("user")
    if step_execution:
        assert user is not None and user.error is None
    else:
        failed(user)  # request mode: one fused forward fails as a whole


def test_fail_warmup_needs_fault_injection_and_unknown_fault_options_are_refused(
    cache_dir: Path,
) -> None:
    w = make_worker(cache_dir, fault_injection=False, model_options={"fault_fail_warmup": True})
    try:
        out = w.execute_scheduler_output(wave(request(WARMUP_REQUEST_ID)))
    finally:
        w.shutdown()
    ok(out.get(WARMUP_REQUEST_ID), WARMUP_REQUEST_ID)
    w = Worker(config(cache_dir, fault_injection=True, model_options={"fault_oops": 1}))
    try:
        with pytest.raises(InvalidConfigError, match="fault_oops"):
            w.load_model()
    finally:
        w.shutdown()


# -- crash_on_prompt (a poison prompt) ------------------------------------------------------


def test_a_poison_prompt_plans_a_crash_at_its_first_step_every_time() -> None:
    injector = FaultInjector(enabled=True, crash_on_prompt="poison")
    poison = request("x").replace(prompt="a poison pill")
    for _ in range(2):  # however often it is run
        plan = injector.plan([poison, request("clean")])
        assert plan.faults_for("x") == (FaultSpec(Fault.CRASH_AT_STEP, step=0),)
        assert plan.faults_for("clean") == ()
    assert not FaultInjector(enabled=False, crash_on_prompt="poison").plan([poison])


def test_a_poison_prompt_crashes_an_in_process_worker(cache_dir: Path) -> None:
    w = make_worker(cache_dir, model_options={"fault_crash_on_prompt": "poison"})
    try:
        with pytest.raises(WorkerCrashInjected):
            w.execute_scheduler_output(wave(request("x").replace(prompt="poison")))
    finally:
        w.shutdown()


# -- the inproc executor fails closed -------------------------------------------------------


async def test_inproc_executor_fails_closed_on_an_injected_crash(cache_dir: Path) -> None:
    cfg = config(cache_dir, fault_injection=True, max_num_seqs=1)
    with trio.fail_after(CAP_S * 3):
        async with open_executor(cfg) as executor:
            with pytest.raises(EngineDeadError, match="WorkerCrashInjected"):
                await executor.execute_batch(wave(request("a", at(Fault.CRASH_AT_STEP, 1))))
            assert executor.is_dead
            with pytest.raises(EngineDeadError):
                await executor.execute_batch(wave(request("b")))


async def test_inproc_executor_close_releases_an_injected_hang(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(cache_dir, fault_injection=True, max_num_seqs=1)
    errors: list[BaseException] = []
    hanging = threading.Event()
    with trio.fail_after(CAP_S * 3):
        async with open_executor(cfg) as executor:
            assert isinstance(executor, InprocExecutor)
            flags = executor.stop_flags
            should_stop = flags.should_stop

            def observed(request_ids: Any) -> bool:
                ids = list(request_ids)
                if not ids:  # only the in-process hang asks about nothing
                    hanging.set()
                return should_stop(ids)

            monkeypatch.setattr(flags, "should_stop", observed)

            async def forward() -> None:
                try:
                    await executor.execute_batch(wave(request("a", at(Fault.HANG_AT_STEP, 1))))
                except (EngineDeadError, EngineClosedError) as exc:
                    errors.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(forward)
                assert await trio.to_thread.run_sync(hanging.wait, CAP_S)
                assert executor.progress("a") == (1, STEPS)
                executor.abort_requests(["a"])  # ignored by the hang
                await executor.aclose()  # stop everything: the hang ends, the thread joins
    assert len(errors) == 1
