"""Engine supervision: a failed worker group is restarted, its requests retried or failed.

Deterministic tests on the scripted backend (MockClock, no threads); the real-process
versions (SIGKILL under load) are in tests/executors/test_tractor_supervision.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
import trio.testing

from omni_trio import (
    AsyncEngine,
    EngineConfig,
    EngineDeadError,
    RequestFailedError,
    RequestStatus,
    SamplingParams,
    WorkerError,
    open_engine,
)
from omni_trio._core.messages import BatchRunnerOutput, SchedulerOutput
from omni_trio._core.trace import TraceKind, TraceRecorder
from omni_trio.errors import RestartLimitError
from omni_trio.testing.invariants import assert_trace_ok
from tests.fakes import FakeImage, ScriptedExecutor

S = RequestStatus
CAP_S = 30.0


@dataclass
class CrashScript:
    """What the FAKE crashing backend does, shared by every group it starts."""

    crash_on_forwards: set[int] = field(default_factory=set)  # 1-based, across groups
    crash_every_forward: bool = False
    crash_on_prefix: str | None = None  # a poison: any forward with such a request id
    fail_starts: set[int] = field(default_factory=set)  # 1-based group numbers
    forwards: int = 0
    groups: list[ScriptedExecutor] = field(default_factory=list)
    starts: int = 0
    hold: bool = False


def crashing_backend(script: CrashScript) -> type[ScriptedExecutor]:
    """A FAKE backend whose group dies (fails closed, as a dead worker process makes the
    real ones do) on the scripted forwards."""

    class CrashingExecutor(ScriptedExecutor):
        async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            script.starts += 1
            if script.starts in script.fail_starts:
                raise WorkerError("model load failed on restart", worker=0)
            script.groups.append(self)
            self.hold = script.hold
            await super().serve(task_status=task_status)

        async def execute_batch(self, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
            script.forwards += 1
            poisoned = script.crash_on_prefix is not None and any(
                rid.startswith(script.crash_on_prefix)
                for rid in scheduler_output.scheduled_request_ids
            )
            if (
                script.crash_every_forward
                or poisoned
                or script.forwards in script.crash_on_forwards
            ):
                self.log.append(
                    ("crash", trio.current_time(), scheduler_output.scheduled_request_ids)
                )
                self.fail(WorkerError("process 4242 died (killed by SIGKILL)", worker=0))
                raise EngineDeadError("worker 0 failed")
            return await super().execute_batch(scheduler_output)

    return CrashingExecutor


@asynccontextmanager
async def supervised_engine(
    script: CrashScript, trace: TraceRecorder | None = None, **overrides: Any
) -> AsyncIterator[AsyncEngine]:
    overrides.setdefault("warmup", False)
    overrides.setdefault("worker_restart_backoff_s", 0.5)
    overrides.setdefault("worker_restart_backoff_max_s", 4.0)
    config = EngineConfig(backend=crashing_backend(script), **overrides)
    async with open_engine(config, trace=trace) as engine:
        yield engine


def params(**kw: Any) -> SamplingParams:
    kw.setdefault("height", 32)
    kw.setdefault("width", 32)
    kw.setdefault("num_inference_steps", 2)
    return SamplingParams(**kw)


async def wait_for(predicate: Callable[[], bool]) -> None:
    """Poll in virtual time (every test here runs under MockClock autojump)."""
    while not predicate():  # noqa: ASYNC110
        await trio.sleep(0.01)


async def test_a_crash_mid_forward_reruns_the_request_on_a_restarted_group(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = CrashScript(crash_on_forwards={1})
    trace = TraceRecorder()
    with trio.fail_after(CAP_S):
        async with supervised_engine(script, trace) as engine:
            out = await engine.generate("p", params(seed=7), request_id="r")
            # Same request, same seed: the retried run gives the image the first would have.
            assert out.images == (FakeImage("r", 7),)
            stats = engine.statistics()
            assert (stats.restarts, stats.requeued, stats.finished_completed) == (1, 1, 1)
            assert stats.worker_group == "running"
            assert stats.last_failure is not None and "SIGKILL" in stats.last_failure
            assert len(script.groups) == 2 and script.groups[0].closed
            assert engine.executor is script.groups[1]
    assert_trace_ok(trace)
    kinds = [e.kind for e in trace if e.request_id == "r"]
    assert kinds.count(TraceKind.REQUEUE) == 1 and kinds.count(TraceKind.TERMINAL) == 1
    assert [e.kind for e in trace if e.kind in (TraceKind.CRASH, TraceKind.RESTART)] == [
        TraceKind.CRASH,
        TraceKind.RESTART,
    ]


async def test_the_restart_waits_the_backoff_and_the_backoff_grows(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = CrashScript(crash_on_forwards={1, 2, 3})
    with trio.fail_after(CAP_S):
        async with supervised_engine(
            script,
            max_retries_on_worker_failure=5,
            quarantine_after_crashes=None,
            worker_restart_backoff_s=0.5,
        ) as engine:
            started = trio.current_time()
            out = await engine.generate("p", params(seed=1), request_id="r")
            assert out.ok
            # Three restarts: 0.5 + 1.0 + 2.0 s of backoff, nothing else takes virtual time.
            assert trio.current_time() - started == pytest.approx(3.5)
            assert engine.statistics().restarts == 3


async def test_retries_exhausted_end_the_request_with_a_retryable_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = CrashScript(crash_on_forwards={1, 2})
    with trio.fail_after(CAP_S):
        async with supervised_engine(
            script, max_retries_on_worker_failure=1, quarantine_after_crashes=3
        ) as engine:
            with pytest.raises(RequestFailedError) as info:
                await engine.generate("p", params(seed=1), request_id="r")
            assert info.value.error_type == "WorkerFailedError" and info.value.retryable
            assert "retries exhausted" in info.value.error
            # The engine itself is fine: the next request runs on the third group.
            await wait_for(lambda: engine.health().healthy)
            assert (await engine.generate("p", params(seed=2), request_id="next")).ok
            stats = engine.statistics()
            assert (stats.restarts, stats.requeued, stats.finished_error) == (2, 1, 1)


async def test_a_request_its_group_failed_under_twice_is_quarantined(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Default quarantine_after_crashes=2: the second group failure under the same request
    (running alone by then) fails it for good, not retryable, though retries are left."""
    script = CrashScript(crash_on_forwards={1, 2})
    with trio.fail_after(CAP_S):
        async with supervised_engine(script, max_retries_on_worker_failure=5) as engine:
            with pytest.raises(RequestFailedError) as info:
                await engine.generate("p", params(seed=1), request_id="r")
            assert info.value.quarantined and not info.value.retryable
            assert "failed each of the 2 times it ran" in info.value.error
            await wait_for(lambda: engine.health().healthy)
            assert (await engine.generate("p", params(seed=2), request_id="next")).ok
            stats = engine.statistics()
            assert (stats.restarts, stats.requeued, stats.finished_error) == (2, 1, 1)


async def test_no_retry_budget_fails_the_running_request_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = CrashScript(crash_on_forwards={1})
    with trio.fail_after(CAP_S):
        async with supervised_engine(script, max_retries_on_worker_failure=0) as engine:
            started = trio.current_time()
            with pytest.raises(RequestFailedError, match="WorkerFailedError"):
                await engine.generate("p", params(), request_id="r")
            assert trio.current_time() == started  # not after the restart's backoff


async def test_waiting_requests_stay_queued_through_a_restart_in_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = CrashScript(crash_on_forwards={1})
    with trio.fail_after(CAP_S):
        async with supervised_engine(script, max_num_seqs=1) as engine:
            streams = [engine.stream("p", params(seed=i), request_id=f"r{i}") for i in range(4)]
            outs = []
            for stream in streams:
                async with stream:
                    outs.extend([o async for o in stream])
            assert [o.request_id for o in outs] == ["r0", "r1", "r2", "r3"]
            assert all(o.ok for o in outs)
            assert [o.images[0] for o in outs] == [FakeImage(f"r{i}", i) for i in range(4)]
            # The crashed one ran again first, then the rest in their admission order.
            second = script.groups[1]
            assert second.batches == [("r0",), ("r1",), ("r2",), ("r3",)]


async def test_a_whole_wave_is_requeued_in_its_order_each_request_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The failed wave's requests are suspects now: each runs alone (so a poison one among
    them cannot take the others down again), in their order."""
    script = CrashScript(crash_on_forwards={1})
    with trio.fail_after(CAP_S):
        async with supervised_engine(script, max_num_seqs=3) as engine:
            streams = [engine.stream("p", params(seed=i), request_id=f"w{i}") for i in range(3)]
            for stream in streams:
                async with stream:
                    assert [o.ok async for o in stream] == [True]
            assert script.groups[1].batches == [("w0",), ("w1",), ("w2",)]


async def test_a_poison_storm_within_the_default_restart_limit_leaves_the_engine_serving(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Twelve distinct poison requests in a few seconds, with bystanders completing between
    them, under the shipped limits (5 restarts in 60 s): every poison is quarantined after
    two crashes, every bystander completes, and no restart waits a backoff, because each
    failure either quarantined its cause or came after progress.  Before, each poison's first
    crash counted, so the sixth poison made the engine dead."""
    script = CrashScript(crash_on_prefix="poison")
    defaults = EngineConfig()
    with trio.fail_after(CAP_S):
        async with supervised_engine(
            script,
            max_worker_restarts=defaults.max_worker_restarts,
            worker_restart_window_s=defaults.worker_restart_window_s,
        ) as engine:
            started = trio.current_time()
            for index in range(12):
                assert (await engine.generate("p", params(seed=index), request_id=f"b{index}")).ok
                with pytest.raises(RequestFailedError) as info:
                    await engine.generate("p", params(), request_id=f"poison{index}")
                assert info.value.quarantined, info.value
            await wait_for(lambda: engine.health().healthy)
            assert (await engine.generate("p", params(), request_id="last")).ok
            assert trio.current_time() - started < 1.0  # no backoff anywhere
            assert engine.statistics().restarts == 24 and not engine.is_dead


async def test_a_group_that_breaks_after_serving_still_meets_the_restart_limit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A group that served, then fails on every forward (a broken device): the first failure
    is excused by the earlier progress, the suspects' second failures quarantine them, but
    every failure with nothing completed since counts, so the engine still dies at the
    limit instead of quarantining requests for ever."""
    script = CrashScript()
    with trio.fail_after(CAP_S):
        async with supervised_engine(
            script, max_worker_restarts=2, max_retries_on_worker_failure=1
        ) as engine:
            assert (await engine.generate("p", params(), request_id="served")).ok
            script.crash_every_forward = True
            outcomes: list[str] = []
            for index in range(10):
                try:
                    await engine.generate("p", params(), request_id=f"r{index}")
                except RequestFailedError as exc:
                    outcomes.append("quarantined" if exc.quarantined else str(exc))
                except EngineDeadError:
                    outcomes.append("dead")
                    break
            assert engine.is_dead
            # r0: excused (progress) then quarantined; r1, r2: counted then quarantined; r3's
            # first failure is the third counted one, past max_worker_restarts=2.
            assert outcomes == ["quarantined", "quarantined", "quarantined", "dead"], outcomes


async def test_past_the_restart_limit_the_engine_is_dead_and_says_why(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = CrashScript(crash_every_forward=True)
    trace = TraceRecorder()
    with trio.fail_after(CAP_S):
        async with supervised_engine(
            script,
            trace,
            max_worker_restarts=2,
            max_retries_on_worker_failure=10,
            quarantine_after_crashes=None,
        ) as engine:
            waiting = engine.stream("p", params(), request_id="waiting")
            with pytest.raises(EngineDeadError, match="RestartLimitError") as info:
                await engine.generate("p", params(), request_id="running")
            assert "SIGKILL" in str(info.value)
            async with waiting:
                outs = [o async for o in waiting]
            assert [o.error_type for o in outs] == ["EngineDeadError"]
            assert engine.is_dead
            health = engine.health()
            assert (health.state, health.healthy, health.restarts) == ("dead", False, 2)
            with pytest.raises(EngineDeadError, match="RestartLimitError"):
                engine.check_health()
            with pytest.raises(EngineDeadError):
                engine.stream("p", params())
            assert engine.statistics().worker_group == "failed"
    assert len(script.groups) == 3 and all(g.closed for g in script.groups)
    assert_trace_ok(trace)
    assert [e.kind for e in trace if e.request_id is None][-3:] == [
        TraceKind.DEAD,
        TraceKind.CLOSE,
        TraceKind.CLOSED,
    ]


async def test_restarts_spread_beyond_the_window_never_give_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = CrashScript(crash_on_forwards={1, 3, 5, 7})
    with trio.fail_after(CAP_S * 10):
        async with supervised_engine(
            script, max_worker_restarts=1, worker_restart_window_s=10.0
        ) as engine:
            for i in range(4):
                out = await engine.generate("p", params(seed=i), request_id=f"r{i}")
                assert out.ok
                await trio.sleep(11.0)  # virtual: the window forgets the last restart
            assert engine.statistics().restarts == 4 and not engine.is_dead


async def test_an_idle_group_failure_is_restarted_before_the_next_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = CrashScript()
    with trio.fail_after(CAP_S):
        async with supervised_engine(script) as engine:
            first = script.groups[0]
            first.fail(WorkerError("process 1 died (killed by SIGKILL)", worker=0))
            with pytest.raises(WorkerError, match="restarting"):
                engine.check_health()
            health = engine.health()
            assert health.state == "restarting" and not health.healthy
            assert [w.state for w in health.workers] == ["restarting"]
            await wait_for(lambda: engine.health().healthy)
            assert len(script.groups) == 2 and first.closed
            assert (await engine.generate("p", params(seed=3), request_id="r")).ok
            assert script.groups[1].batches == [("r",)]


async def test_a_request_admitted_during_the_restart_waits_for_the_new_group(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = CrashScript()
    with trio.fail_after(CAP_S):
        async with supervised_engine(script, worker_restart_backoff_s=2.0) as engine:
            script.groups[0].fail(WorkerError("gone", worker=0))
            await trio.testing.wait_all_tasks_blocked()
            started = trio.current_time()
            out = await engine.generate("p", params(seed=1), request_id="r")
            assert out.ok and trio.current_time() - started == pytest.approx(2.0)


async def test_abort_during_the_restart_ends_the_request_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = CrashScript(crash_on_forwards={1})
    with trio.fail_after(CAP_S):
        async with supervised_engine(script, worker_restart_backoff_s=5.0) as engine:
            stream = engine.stream("p", params(), request_id="r")
            await wait_for(lambda: engine.statistics().requeued == 1)
            engine.abort("r")
            async with stream:
                outs = [o async for o in stream]
            assert [o.status for o in outs] == [S.FINISHED_ABORTED]
            assert engine.statistics().restarts <= 1


async def test_a_group_that_fails_to_restart_counts_against_the_limit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = CrashScript(crash_on_forwards={1}, fail_starts={2})
    with trio.fail_after(CAP_S):
        async with supervised_engine(script) as engine:
            out = await engine.generate("p", params(seed=5), request_id="r")
            assert out.ok
            assert script.starts == 3 and len(script.groups) == 2
            assert engine.statistics().restarts == 2


async def test_a_group_that_cannot_start_the_first_time_raises_from_open_engine() -> None:
    script = CrashScript(fail_starts={1})
    with trio.fail_after(CAP_S):
        with pytest.raises(WorkerError, match="model load failed"):
            async with supervised_engine(script):
                pytest.fail("must not start")  # pragma: no cover
    assert script.starts == 1


async def test_close_during_a_restart_backoff_is_prompt_and_clean(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = CrashScript(crash_on_forwards={1})
    with trio.fail_after(CAP_S):
        async with supervised_engine(script, worker_restart_backoff_s=100.0) as engine:
            stream = engine.stream("p", params(), request_id="r")
            await wait_for(lambda: engine.statistics().requeued == 1)
            started = trio.current_time()
            await engine.aclose()
            assert trio.current_time() - started < 1.0
            async with stream:
                outs = [o async for o in stream]
            assert [o.error_type for o in outs] == ["EngineClosedError"]
    assert all(g.closed for g in script.groups)


def test_restart_limit_error_names_the_child_and_the_cause() -> None:
    cause = WorkerError("gone", worker=1)
    error = RestartLimitError(
        "worker-group", restarts=5, max_restarts=5, window_s=60.0, last_error=cause
    )
    assert "worker-group" in str(error) and "gone" in str(error) and error.last_error is cause


async def test_wait_ended_returns_when_the_engine_dies_or_closes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    script = CrashScript(crash_every_forward=True)
    with trio.fail_after(CAP_S):
        async with supervised_engine(script, max_worker_restarts=0) as engine:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.wait_ended)
                with pytest.raises(EngineDeadError):
                    await engine.generate("p", params(), request_id="r")
            assert engine.is_dead
            await engine.wait_ended()  # at once when already ended
        async with supervised_engine(CrashScript()) as engine:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.wait_ended)
                await trio.testing.wait_all_tasks_blocked()
                await engine.aclose()
            assert engine.is_closed and not engine.is_dead
