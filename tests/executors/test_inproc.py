"""``InprocExecutor`` on ``builtin:echo``: forwards in the owned worker thread, aborts, RPCs,
fail-closed worker failures and a clean close."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from omni_trio._core.messages import BatchRunnerOutput, NewRequestData, SchedulerOutput
from omni_trio._core.request import DiffusionRequest, SamplingParams
from omni_trio.config import EngineConfig
from omni_trio.errors import (
    EngineClosedError,
    EngineDeadError,
    InvalidConfigError,
    StallError,
    WorkerError,
)
from omni_trio.executors import inproc
from omni_trio.executors.base import open_executor
from omni_trio.executors.inproc import InprocExecutor
from omni_trio.models.echo import decode_echo_image
from omni_trio.worker.faults import DeviceFaultError, Fault, FaultSpec
from omni_trio.worker.worker import Worker
from tests.fakes import GATE_S, BlockingModel, GatedEchoModel, StepGate, register_models
from tests.worker.test_faults import request as fault_request

CAP_S = 20.0
WORKER_THREAD = "omni-trio-worker-0"


def request(rid: str, *, seed: int = 1, steps: int = 3) -> DiffusionRequest:
    return DiffusionRequest(
        "p",
        SamplingParams(height=32, width=32, num_inference_steps=steps, seed=seed),
        request_id=rid,
    )


def wave(*requests: DiffusionRequest) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=1, scheduled_new_reqs=tuple(NewRequestData(r.request_id, r) for r in requests)
    )


def config(cache_dir: Path, **overrides: Any) -> EngineConfig:
    overrides.setdefault("torch_threads", 1)
    overrides.setdefault("max_num_seqs", 4)
    # Most tests here look at the forward itself: packing inline keeps images in its result.
    overrides.setdefault("async_output", False)
    return EngineConfig(cache_dir=str(cache_dir), **overrides)


def thread_names() -> set[str]:
    return {t.name for t in threading.enumerate()}


@pytest.fixture
async def echo_executor(cache_dir: Path) -> AsyncIterator[InprocExecutor]:
    async with open_executor(config(cache_dir)) as executor:
        assert isinstance(executor, InprocExecutor)
        yield executor


@pytest.fixture
async def gated(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> AsyncIterator[tuple[InprocExecutor, StepGate]]:
    gate = StepGate()
    register_models(monkeypatch, {"fake:gated-echo": lambda options: GatedEchoModel(gate)})
    try:
        async with open_executor(config(cache_dir, model="fake:gated-echo")) as executor:
            assert isinstance(executor, InprocExecutor)
            yield executor, gate
    finally:
        gate.open()


async def run_in_background(nursery: trio.Nursery, fn: Callable[[], Any]) -> list[Any]:
    box: list[Any] = []

    async def runner() -> None:
        box.append(await fn())

    nursery.start_soon(runner)
    return box


def single(out: BatchRunnerOutput, rid: str) -> Any:
    result = out.get(rid)
    assert result is not None
    return result


async def test_executes_a_wave_in_the_worker_thread(echo_executor: InprocExecutor) -> None:
    with trio.fail_after(CAP_S):
        assert echo_executor.model_info is not None
        assert echo_executor.model_info.name == "builtin:echo"
        assert WORKER_THREAD in thread_names()
        out = await echo_executor.execute_batch(wave(request("a", seed=4), request("b", seed=5)))
    assert decode_echo_image(single(out, "a").images[0]) == ("a", 4, 0)
    assert decode_echo_image(single(out, "b").images[0]) == ("b", 5, 0)


async def test_async_output_answers_with_ids_and_the_packer_delivers(cache_dir: Path) -> None:
    with trio.fail_after(CAP_S):
        async with open_executor(config(cache_dir, async_output=True)) as executor:
            out = await executor.execute_batch(wave(request("a", seed=4), request("b", seed=5)))
            ids = {rid: single(out, rid).async_output_id for rid in ("a", "b")}
            assert all(ids.values())
            assert single(out, "a").images is None
            assert len({str(key).partition("/")[0] for key in ids.values()}) == 1  # one batch
            packed = {rid: await executor.wait_output(str(key)) for rid, key in ids.items()}
    assert decode_echo_image(packed["a"].images[0]) == ("a", 4, 0)
    assert decode_echo_image(packed["b"].images[0]) == ("b", 5, 0)


async def test_close_joins_the_worker_thread_and_later_calls_raise_closed(
    cache_dir: Path,
) -> None:
    with trio.fail_after(CAP_S):
        async with open_executor(config(cache_dir)) as executor:
            assert WORKER_THREAD in thread_names()
        assert WORKER_THREAD not in thread_names()
        with pytest.raises(EngineClosedError):
            await executor.execute_batch(wave(request("late")))
        with pytest.raises(EngineClosedError):
            await executor.collective_rpc("ping")
        with pytest.raises(EngineClosedError):
            executor.check_health()
        await executor.aclose()  # idempotent
    assert not executor.is_dead


def test_more_than_one_worker_is_refused(cache_dir: Path) -> None:
    with pytest.raises(InvalidConfigError) as info:
        InprocExecutor(config(cache_dir, num_workers=2))
    assert info.value.field == "num_workers"


async def test_a_load_failure_is_raised_and_leaves_no_thread(cache_dir: Path) -> None:
    with trio.fail_after(CAP_S):
        with pytest.raises(InvalidConfigError) as info:
            async with open_executor(config(cache_dir, model="builtin:no-such-model")):
                pytest.fail("the body must not run")  # pragma: no cover
    assert info.value.field == "model"
    assert WORKER_THREAD not in thread_names()


async def test_collective_rpc_returns_the_reply(echo_executor: InprocExecutor) -> None:
    with trio.fail_after(CAP_S):
        reply = await echo_executor.collective_rpc("ping")
        assert reply["rank"] == 0 and reply["loaded"] is True
        replies = await echo_executor.collective_rpc("ping", unique_reply_rank=None)
        assert replies == [reply]
        assert await echo_executor.collective_rpc("set_torch_threads", 1) == 1


async def test_collective_rpc_unknown_method_raises(echo_executor: InprocExecutor) -> None:
    with trio.fail_after(CAP_S):
        with pytest.raises(AttributeError, match="no_such_method"):
            await echo_executor.collective_rpc("no_such_method")
        with pytest.raises(AttributeError):
            await echo_executor.collective_rpc("shutdown")
        echo_executor.check_health()  # a refused RPC does not hurt the worker


async def test_collective_rpc_boxes_a_worker_error(echo_executor: InprocExecutor) -> None:
    with trio.fail_after(CAP_S):
        with pytest.raises(WorkerError) as info:
            await echo_executor.collective_rpc("set_torch_threads", 0)
    assert info.value.worker == 0
    assert info.value.error_type == "RuntimeError"
    assert not echo_executor.is_dead


async def test_collective_rpc_timeout_fails_the_executor_closed(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    release = threading.Event()

    class SlowPingWorker(Worker):
        def ping(self) -> dict[str, Any]:
            assert release.wait(GATE_S)
            return super().ping()

    monkeypatch.setattr(inproc, "Worker", SlowPingWorker)
    with trio.fail_after(CAP_S):
        async with open_executor(config(cache_dir)) as executor:
            try:
                with pytest.raises(StallError) as info:
                    await executor.collective_rpc("ping", timeout=0.05)
                assert info.value.phase == "rpc"
                assert "'ping' got no reply within 0.05 s" in str(info.value)
                # The worker runs one call at a time: every later call would queue behind
                # the stuck one, so the executor failed closed (its supervisor replaces it).
                assert executor.is_dead and executor.dead_reason is info.value
                with pytest.raises(EngineDeadError, match="got no reply"):
                    await executor.collective_rpc("ping")
            finally:
                release.set()


async def test_a_failing_worker_marks_the_executor_dead(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    class BrokenWorker(Worker):
        def execute_scheduler_output(self, scheduler_output: SchedulerOutput) -> Any:
            raise OSError("device lost")

    monkeypatch.setattr(inproc, "Worker", BrokenWorker)
    with trio.fail_after(CAP_S):
        async with open_executor(config(cache_dir)) as executor:
            with pytest.raises(EngineDeadError, match="device lost") as info:
                await executor.execute_batch(wave(request("a")))
            assert isinstance(info.value.__cause__, OSError)
            assert executor.is_dead
            assert isinstance(executor.dead_reason, OSError)
            with pytest.raises(EngineDeadError, match="device lost"):
                executor.check_health()
            # Fail closed: the group is not used again.
            with pytest.raises(EngineDeadError):
                await executor.execute_batch(wave(request("b")))
            with pytest.raises(EngineDeadError):
                await executor.collective_rpc("ping")
        assert WORKER_THREAD not in thread_names()


async def test_per_request_failures_do_not_kill_the_executor(
    echo_executor: InprocExecutor,
) -> None:
    bad = DiffusionRequest(
        "p",
        SamplingParams(
            height=32, width=32, num_inference_steps=3, seed=1, extra_args={"echo_fail_at_step": 0}
        ),
        request_id="bad",
    )
    with trio.fail_after(CAP_S):
        out = await echo_executor.execute_batch(wave(bad))
        assert single(out, "bad").error_type == "EchoInjectedError"
        echo_executor.check_health()
        out = await echo_executor.execute_batch(wave(request("good")))
    assert single(out, "good").images is not None


async def test_abort_requests_stops_a_running_forward_at_the_next_step(
    gated: tuple[InprocExecutor, StepGate],
) -> None:
    executor, gate = gated
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            box = await run_in_background(
                nursery, lambda: executor.execute_batch(wave(request("r", steps=10)))
            )
            await gate.wait_for_step(("r",), 1)
            gate.release()
            await gate.wait_for_step(("r",), 2)  # steps 0 and 1 done, held after step 1
            assert executor.progress("r") == (1, 10)
            executor.abort_requests(["r"])
            gate.release()
            assert await gate.wait_for_end(("r",)) == "ForwardStopped"
        (out,) = box
    assert single(out, "r").aborted
    assert gate.steps_of(("r",)) == 2  # not one step more
    assert executor.progress("r") is None


async def test_progress_tracks_the_running_forward(
    gated: tuple[InprocExecutor, StepGate],
) -> None:
    executor, gate = gated
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            box = await run_in_background(
                nursery, lambda: executor.execute_batch(wave(request("p", steps=3)))
            )
            for step in range(3):
                await gate.wait_for_step(("p",), step + 1)
                assert executor.progress("p") == (step, 3)
                gate.release()
        (out,) = box
    assert single(out, "p").images is not None
    assert executor.progress("p") is None


async def test_cancelling_execute_batch_stops_the_forward_and_waits_for_it(
    gated: tuple[InprocExecutor, StepGate],
) -> None:
    executor, gate = gated
    scope = trio.CancelScope()
    cancelled = trio.Event()

    async def caller() -> None:
        with scope:
            await executor.execute_batch(wave(request("c", steps=10)))
        assert scope.cancelled_caught
        # Cancelled propagated only once the forward had stopped.
        assert gate.ended(("c",)) == "ForwardStopped"
        cancelled.set()

    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller)
            await gate.wait_for_step(("c",), 1)
            scope.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert not cancelled.is_set()  # still waiting for the held step
            gate.release()
            await cancelled.wait()
    assert gate.steps_of(("c",)) == 1
    # The thread is free for the next forward.
    gate.open()
    with trio.fail_after(CAP_S):
        out = await executor.execute_batch(wave(request("next")))
    assert single(out, "next").images is not None


async def test_aclose_stops_a_running_forward(
    gated: tuple[InprocExecutor, StepGate],
) -> None:
    executor, gate = gated
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            box = await run_in_background(
                nursery, lambda: executor.execute_batch(wave(request("x", steps=10)))
            )
            await gate.wait_for_step(("x",), 1)
            nursery.start_soon(executor.aclose)
            await trio.testing.wait_all_tasks_blocked()
            gate.release()
        (out,) = box
    assert single(out, "x").aborted
    assert gate.steps_of(("x",)) == 1
    assert WORKER_THREAD not in thread_names()


async def test_aclose_is_bounded_when_a_forward_hangs(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    token = trio.lowlevel.current_trio_token()
    entered = trio.Event()
    models: list[BlockingModel] = []

    def make(options: Any) -> BlockingModel:
        model = BlockingModel(on_enter=lambda: token.run_sync_soon(entered.set))
        models.append(model)
        return model

    register_models(monkeypatch, {"fake:blocking": make})
    close_timeout = 0.2
    with trio.fail_after(CAP_S):
        async with (
            open_executor(
                config(cache_dir, model="fake:blocking", close_timeout_s=close_timeout)
            ) as executor,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(executor.execute_batch, wave(request("hung")))
            await entered.wait()
            started = trio.current_time()
            await executor.aclose()
            elapsed = trio.current_time() - started
            # Ask, bounded wait, give up: never an unbounded wait on a hung forward.
            assert elapsed < GATE_S / 2  # the hung forward itself only gives up after GATE_S
            assert executor.is_dead
            assert isinstance(executor.dead_reason, StallError)
            models[0].release.set()  # let the hung thread finish so nothing leaks


# -- the group's rules, in process ----------------------------------------------------------


async def test_a_forward_with_no_step_progress_fails_the_executor_closed(
    cache_dir: Path,
) -> None:
    """The same liveness tracker as the process backends: a forward stuck at a step (an
    injected hang) fails the executor with StallError("forward"), and the wait ends."""
    hang = fault_request("hung", FaultSpec(Fault.HANG_AT_STEP, step=1))
    cfg = config(cache_dir, fault_injection=True, worker_stall_timeout_s=0.3)
    with trio.fail_after(CAP_S):
        async with open_executor(cfg) as executor:
            with pytest.raises(EngineDeadError, match="no step progress"):
                await executor.execute_batch(wave(hang))
            reason = executor.dead_reason
            assert isinstance(reason, StallError) and reason.phase == "forward"


async def test_a_dead_output_packer_fails_the_executor_at_once(cache_dir: Path) -> None:
    doomed = fault_request("doomed", FaultSpec(Fault.KILL_PACKER))
    cfg = config(cache_dir, fault_injection=True, async_output=True)
    with trio.fail_after(CAP_S):
        async with open_executor(cfg) as executor:
            result = await executor.execute_batch(wave(doomed))
            key = result.outputs["doomed"].async_output_id
            assert key is not None
            reason = await executor.wait_failed()  # no 600 s output timeout
            assert isinstance(reason, WorkerError) and reason.error_type == "PackerDied"
            with pytest.raises(WorkerError, match="PackerDied"):
                await executor.wait_output(key)


async def test_a_broken_device_fails_the_executor_closed(cache_dir: Path) -> None:
    poisoned = fault_request("poisoned", FaultSpec(Fault.POISON_DEVICE, step=1))
    cfg = config(cache_dir, fault_injection=True)
    with trio.fail_after(CAP_S):
        async with open_executor(cfg) as executor:
            with pytest.raises(EngineDeadError, match="DeviceFaultError") as info:
                await executor.execute_batch(wave(poisoned))
            assert "failed its probe" in str(info.value)
            assert isinstance(executor.dead_reason, DeviceFaultError)
