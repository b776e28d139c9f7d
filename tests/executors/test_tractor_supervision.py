"""Supervision with real worker processes: SIGKILL, exit and hang under load.

The worker group is restarted (one_for_all) and each in-flight request runs again with its
seed -- so it produces the image it would have produced -- until its retry budget is used;
past the restart limit the engine is dead.  Nothing is left behind in any case: no worker
process (autouse fixture), no shared-memory segment, no stream without a terminal output.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import pytest
import trio

from omni_trio import (
    EngineDeadError,
    RequestFailedError,
    RequestStatus,
    SamplingParams,
)
from omni_trio._core.trace import TraceKind, TraceRecorder
from omni_trio.executors.tractor_executor import TractorExecutor
from omni_trio.ipc import list_our_segments
from omni_trio.testing import Fault, FaultSpec, assert_trace_ok, with_faults
from tests.executors.test_tractor_executor import (
    START_METHODS,
    _no_worker_processes,  # noqa: F401  (autouse: no worker process outlives a test)
    engine_on,
    params,
    poll_until,
    terminal,
    wait_running,
    wait_scheduled,
    wait_until_gone,
)

pytestmark = pytest.mark.slow

S = RequestStatus
CAP_S = 120.0
# A restarted group must serve again this fast (tiny echo model, 2 vCPUs).
RECOVERY_S = 15.0
# ... and with a warm fork server (issue #5's target is 3 s to the first completed request;
# measured ~0.1-0.3 s to a serving group).
FORKSERVER_RECOVERY_S = 3.0


def slow(seed: int, steps: int = 20, delay: float = 0.02, **kw: Any) -> SamplingParams:
    return params(steps, delay=delay, seed=seed, **kw)


def pixels(out: Any) -> np.ndarray:
    return np.asarray(out.images[0])


def pids_of(engine: Any) -> list[int]:
    executor = engine.executor
    assert isinstance(executor, TractorExecutor)
    return sorted(executor.worker_pids().values())


async def kill_and_wait_for_restart(engine: Any) -> int:
    """SIGKILL the (single) worker; return its pid once a new group serves."""
    [pid] = pids_of(engine)
    os.kill(pid, signal.SIGKILL)
    with trio.fail_after(RECOVERY_S):
        await poll_until(lambda: pids_of(engine) != [pid] and engine.health().healthy)
    return pid


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_a_sigkill_mid_forward_under_load_costs_no_request(
    cache_dir: Any, start_method: str
) -> None:
    trace = TraceRecorder()
    with trio.fail_after(CAP_S):
        async with engine_on(
            "tractor",
            cache_dir,
            max_num_seqs=2,
            worker_restart_backoff_s=0.0,
            worker_start_method=start_method,
        ) as engine:
            engine.trace = trace
            streams = [
                engine.stream("p", slow(seed=i, steps=50), request_id=f"r{i}") for i in range(6)
            ]
            await wait_scheduled(engine)  # r0 and r1 are in the forward (1 s each)
            [pid] = pids_of(engine)
            killed_at = trio.current_time()
            os.kill(pid, signal.SIGKILL)
            await poll_until(lambda: pids_of(engine) != [pid] and engine.health().healthy)
            serving_after = trio.current_time() - killed_at
            outs = [await terminal(stream) for stream in streams]
            assert [o.status for o in outs] == [S.FINISHED_COMPLETED] * 6
            stats = engine.statistics()
            assert stats.restarts == 1 and stats.requeued >= 1
            assert pids_of(engine) != [pid]
            if start_method == "forkserver":
                # The new worker is forked ready-made (torch and the worker code preloaded).
                assert serving_after < FORKSERVER_RECOVERY_S, serving_after
            # Each retried request produced exactly the image an undisturbed run gives.
            for i, out in enumerate(outs):
                again = await engine.generate("p", slow(seed=i, delay=0.0), request_id=f"r{i}")
                assert np.array_equal(pixels(out), pixels(again))
        await wait_until_gone([pid], timeout=5.0)
    assert list_our_segments() == []
    assert_trace_ok(trace)


async def test_a_crash_while_outputs_are_packed_requeues_them(cache_dir: Any) -> None:
    big = SamplingParams(height=512, width=512, num_inference_steps=2, output_type="np")
    with trio.fail_after(CAP_S):
        async with engine_on(
            "tractor", cache_dir, async_output=True, max_num_seqs=1, worker_restart_backoff_s=0.0
        ) as engine:
            [pid] = pids_of(engine)
            results: dict[int, Any] = {}

            async def one(i: int) -> None:
                results[i] = await engine.generate("p", big.replace(seed=i), request_id=f"b{i}")

            async with trio.open_nursery() as nursery:
                for i in range(6):
                    nursery.start_soon(one, i)
                await poll_until(lambda: len(results) >= 1)
                os.kill(pid, signal.SIGKILL)
            assert sorted(results) == list(range(6)) and all(r.ok for r in results.values())
            assert engine.statistics().restarts == 1
    assert list_our_segments() == []


async def test_a_request_that_crashes_every_attempt_is_quarantined_and_nothing_hangs(
    cache_dir: Any,
) -> None:
    # The crash fault fires on every attempt: the first run and its one retry both die, and
    # the second death quarantines it (not retryable: it would crash the workers again).
    crash = with_faults(params(4, seed=1), FaultSpec(Fault.CRASH_AT_STEP, step=1))
    with trio.fail_after(CAP_S):
        async with engine_on(
            "tractor", cache_dir, fault_injection=True, worker_restart_backoff_s=0.0
        ) as engine:
            assert (await engine.generate("p", params(2, seed=5), request_id="fine")).ok
            with pytest.raises(RequestFailedError) as info:
                await engine.generate("p", crash, request_id="doomed")
            assert info.value.quarantined and not info.value.retryable
            assert "exit code 3" in info.value.error
            await poll_until(lambda: engine.health().healthy)
            assert (await engine.generate("p", params(2, seed=2), request_id="after")).ok
            health = engine.health()
            assert health.restarts == 2 and [w.state for w in health.workers] == ["running"]
    assert list_our_segments() == []


async def test_a_hung_worker_is_caught_by_the_stall_check_and_replaced(cache_dir: Any) -> None:
    hang = with_faults(params(4, seed=1), FaultSpec(Fault.HANG_AT_STEP, step=1))
    with trio.fail_after(CAP_S):
        async with engine_on(
            "tractor",
            cache_dir,
            fault_injection=True,
            worker_stall_timeout_s=1.0,
            max_retries_on_worker_failure=0,
            worker_restart_backoff_s=0.0,
        ) as engine:
            [pid] = pids_of(engine)
            with pytest.raises(RequestFailedError, match="stalled") as info:
                await engine.generate("p", hang, request_id="hung")
            assert info.value.retryable
            await poll_until(lambda: engine.health().healthy)
            assert pids_of(engine) != [pid]
            assert (await engine.generate("p", params(2, seed=3), request_id="next")).ok
        await wait_until_gone([pid], timeout=10.0)


async def test_past_the_restart_limit_the_engine_is_dead_and_says_why(cache_dir: Any) -> None:
    with trio.fail_after(CAP_S):
        async with engine_on(
            "tractor",
            cache_dir,
            max_worker_restarts=1,
            max_retries_on_worker_failure=5,
            quarantine_after_crashes=None,
            worker_restart_backoff_s=0.0,
        ) as engine:
            stream = engine.stream("p", slow(seed=1, steps=200), request_id="victim")
            killed: list[int] = []
            await wait_running(engine, "victim")
            killed.append(await kill_and_wait_for_restart(engine))
            await wait_running(engine, "victim")  # its retry, on the new group
            [pid] = pids_of(engine)
            killed.append(pid)
            os.kill(pid, signal.SIGKILL)
            out = await terminal(stream)
            assert out.error_type == "EngineDeadError"
            assert "RestartLimitError" in (out.error or "") and "SIGKILL" in (out.error or "")
            with pytest.raises(EngineDeadError, match="RestartLimitError"):
                engine.check_health()
            assert engine.health().state == "dead"
        await wait_until_gone(killed, timeout=5.0)
    assert list_our_segments() == []


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_repeated_sigkills_under_load_lose_no_request(
    cache_dir: Any, start_method: str
) -> None:
    """A short version of the soak in ``omni-trio bench recovery``: kill the worker three
    times while requests keep coming; every request completes or ends with an explicit
    error (retryable, or quarantined when it was killed on both of its runs), and nothing
    leaks."""
    trace = TraceRecorder()
    with trio.fail_after(CAP_S):
        async with engine_on(
            "tractor",
            cache_dir,
            max_num_seqs=2,
            max_retries_on_worker_failure=2,
            worker_restart_backoff_s=0.0,
            worker_start_method=start_method,
        ) as engine:
            engine.trace = trace
            outcomes: dict[str, Any] = {}

            async def client(c: int) -> None:
                for i in range(6):
                    rid = f"c{c}-{i}"
                    try:
                        outcomes[rid] = await engine.generate(
                            "p", slow(seed=i, steps=10), request_id=rid
                        )
                    except RequestFailedError as exc:
                        outcomes[rid] = exc

            async with trio.open_nursery() as nursery:
                for c in range(3):
                    nursery.start_soon(client, c)
                for _ in range(3):
                    await poll_until(lambda: engine.statistics().running > 0)
                    await kill_and_wait_for_restart(engine)
            assert len(outcomes) == 18
            for rid, result in outcomes.items():
                if isinstance(result, RequestFailedError):
                    assert result.retryable or result.quarantined, rid
                else:
                    assert result.ok, rid
            assert engine.statistics().restarts == 3
    assert list_our_segments() == []
    assert_trace_ok(trace)
    assert sum(1 for e in trace if e.kind is TraceKind.RESTART) == 3
