"""The control-RPC queue: RPCs wait, run between batches in order, and callers that gave up
are skipped.  Runs on a ScriptedExecutor under an autojumping MockClock."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from omni_trio.config import EngineConfig
from omni_trio.errors import EngineClosedError, StallError
from omni_trio.runtime.rpc_queue import RpcQueue
from tests.fakes import ScriptedExecutor

CAP_S = 30.0


@pytest.fixture
def executor() -> ScriptedExecutor:
    return ScriptedExecutor(EngineConfig(backend=ScriptedExecutor, warmup=False))


async def test_rpcs_wait_for_the_loop_and_run_in_order(executor: ScriptedExecutor) -> None:
    woken: list[int] = []
    queue = RpcQueue(on_queued=lambda: woken.append(1))
    results: dict[str, object] = {}
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:

            async def call(name: str) -> None:
                results[name] = await queue.call("ping", (), {}, timeout=None, unique_reply_rank=0)

            nursery.start_soon(call, "first")
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(call, "second")
            await trio.testing.wait_all_tasks_blocked()
            assert bool(queue) and queue.methods == ["ping", "ping"] and len(woken) == 2
            assert results == {}  # nothing runs until the loop says so
            await queue.run_pending(executor)
    assert set(results) == {"first", "second"}
    assert [entry[2] for entry in executor.log] == [("ping",), ("ping",)]
    assert not queue and not queue.running


async def test_a_caller_that_timed_out_is_skipped(
    executor: ScriptedExecutor, autojump_clock: trio.testing.MockClock
) -> None:
    queue = RpcQueue(on_queued=lambda: None)
    with trio.fail_after(CAP_S):
        started = trio.current_time()
        with pytest.raises(StallError, match="did not finish within 2"):
            await queue.call("ping", (), {}, timeout=2.0, unique_reply_rank=0)
        assert trio.current_time() - started == 2.0
        await queue.run_pending(executor)
    assert executor.log == []


async def test_a_caller_whose_rpc_runs_past_its_timeout_gets_the_executors_answer(
    executor: ScriptedExecutor, autojump_clock: trio.testing.MockClock
) -> None:
    """The executor bounds a running RPC by the same timeout (and fails its group when it
    passes): the caller gets that verdict, not a second one of its own."""
    queue = RpcQueue(on_queued=lambda: None)
    errors: list[StallError] = []
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:

            async def call() -> None:
                with pytest.raises(StallError) as info:
                    await queue.call("sleep", (10.0,), {}, timeout=2.0, unique_reply_rank=0)
                errors.append(info.value)

            started = trio.current_time()
            nursery.start_soon(call)
            await trio.sleep(1.0)  # queued for a second, then it runs
            await queue.run_pending(executor)
    (error,) = errors
    assert str(error) == "rpc stalled: RPC 'sleep' did not finish within 2.0 s"  # the fake's
    assert trio.current_time() - started == 3.0
    assert executor.log[0][2] == ("sleep",)


async def test_fail_all_answers_every_queued_caller(executor: ScriptedExecutor) -> None:
    queue = RpcQueue(on_queued=lambda: None)
    errors: list[BaseException] = []
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:

            async def call() -> None:
                try:
                    await queue.call("ping", (), {}, timeout=None, unique_reply_rank=0)
                except EngineClosedError as exc:
                    errors.append(exc)

            nursery.start_soon(call)
            await trio.testing.wait_all_tasks_blocked()
            queue.fail_all(EngineClosedError("engine is closed"))
    assert [str(e) for e in errors] == ["engine is closed"]
    assert not queue
