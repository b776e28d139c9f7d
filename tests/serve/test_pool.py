"""EnginePool against real ``builtin:echo`` engines (inproc): routing, admission errors, ids,
aborts, draining, and one_for_one supervision of replicas."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

import omni_trio.serve.pool as pool_module
from omni_trio import RequestStatus
from omni_trio._core.messages import DiffusionOutput
from omni_trio._core.request import SamplingParams
from omni_trio.config import EngineConfig
from omni_trio.errors import (
    DuplicateRequestError,
    EngineDeadError,
    InvalidConfigError,
    InvalidRequestError,
    OmniTrioError,
    RestartLimitError,
    WorkerError,
)
from omni_trio.models.echo import decode_echo_image
from omni_trio.serve.pool import (
    ArrivalLog,
    DrainingError,
    EnginePool,
    EstimateError,
    NotReadyError,
    OpenTime,
    PassedTooLongError,
    QueueFullError,
    QueueWaitError,
    ServiceRate,
    Submission,
    clamp_retry_after,
    engine_request_id,
    new_request_id,
)
from omni_trio.supervisor import RestartPolicy
from tests.fakes import ScriptedExecutor
from tests.serve.conftest import CAP_S, STEP_DELAY_S, wait_until

LONG = SamplingParams(height=64, width=64, num_inference_steps=200)  # ~4 s: aborted by tests
SHORT = SamplingParams(height=64, width=64, num_inference_steps=2)


def echo_config(**overrides: Any) -> EngineConfig:
    return EngineConfig(
        model="builtin:echo", warmup=False, model_options={"step_delay_s": STEP_DELAY_S}
    ).replace(**overrides)


@asynccontextmanager
async def serving(pool: EnginePool) -> AsyncIterator[EnginePool]:
    async with trio.open_nursery() as nursery:
        started = await nursery.start(pool.serve)
        assert started is pool
        try:
            yield pool
        finally:
            nursery.cancel_scope.cancel()


async def final_of(submission: Submission) -> DiffusionOutput:
    async with submission.stream as stream:
        async for output in stream:
            if output.finished:
                return output
    raise AssertionError("the stream ended without a terminal output")


def test_errors_are_omni_trio_errors() -> None:
    for cls in (QueueFullError, DrainingError, NotReadyError):
        assert issubclass(cls, OmniTrioError)
    assert QueueFullError(3, 3).max_queue_len == 3
    assert QueueFullError(3, 3).retry_after_s is None  # the pool's own Retry-After
    passed = PassedTooLongError(12.2, 4.0, 3, 4)
    assert isinstance(passed, QueueFullError) and passed.max_queue_len == 4
    assert passed.retry_after_s == 9  # the excess over what a full queue takes


def test_configuration_is_checked() -> None:
    # Several tractor engines cannot share a process: they run as stage processes unless
    # told to run inline, which is refused.
    with pytest.raises(InvalidConfigError, match="tractor") as info:
        EnginePool(EngineConfig(backend="tractor"), replicas=2, stage="inline")
    assert info.value.field == "replicas"
    assert EnginePool(EngineConfig(backend="tractor"), replicas=2).stage == "process"
    assert EnginePool(EngineConfig(backend="tractor"), replicas=1).stage == "inline"
    assert EnginePool(echo_config(), replicas=2).stage == "inline"
    assert EnginePool(echo_config(), replicas=2, stage="process").stage == "process"
    with pytest.raises(InvalidConfigError, match="stage") as info:
        EnginePool(echo_config(), stage="thread")
    assert info.value.field == "stage"
    for bad in (0, True, 1.5):
        with pytest.raises(InvalidConfigError):
            EnginePool(echo_config(), replicas=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidConfigError):
            EnginePool(echo_config(), max_queue_len=bad)  # type: ignore[arg-type]


def test_generated_ids_are_unique_and_unguessable() -> None:
    """128 random bits each: no client can guess another's id to cancel or query its
    request, or claim the next one (a counter made both easy)."""
    ids = [new_request_id() for _ in range(1000)]
    assert len(set(ids)) == 1000
    assert all(re.fullmatch(r"req-[0-9a-f]{32}", rid) for rid in ids), ids[:3]
    assert len({rid[4:12] for rid in ids}) > 990  # no shared prefix


def test_not_ready_before_serving() -> None:
    pool = EnginePool(echo_config())
    assert pool.readiness() == (False, "starting")
    with pytest.raises(NotReadyError):
        pool.submit("x", SHORT)
    assert [r["state"] for r in pool.replicas_info()] == ["starting"]
    assert pool.default_size() is None  # no model loaded yet


async def test_every_replica_opens_before_ready_and_serves() -> None:
    with trio.fail_after(CAP_S):
        traced: list[int] = []

        def trace_factory(index: int) -> None:
            traced.append(index)

        async with serving(
            EnginePool(echo_config(), replicas=2, trace_factory=trace_factory)
        ) as pool:
            assert traced == [0, 1]
            assert pool.readiness() == (True, None)
            info = pool.replicas_info()
            assert [(r["index"], r["state"], r["healthy"], r["restarts"]) for r in info] == [
                (0, "ready", True, 0),
                (1, "ready", True, 0),
            ]
            assert info[0]["statistics"]["waiting"] == 0
            assert pool.default_size() == (64, 64)  # builtin:echo's default size
            sub = pool.submit("x", SHORT.replace(seed=11), request_id="one")
            assert (sub.request_id, sub.replica, sub.seed) == ("one", 0, 11)
            assert pool.in_flight == 1
            engine = pool.replica_engine(0)
            assert engine is not None and engine.status("one") is RequestStatus.WAITING
            assert engine.status("nobody") is None
            out = await final_of(sub)
            assert out.status is RequestStatus.FINISHED_COMPLETED
            assert decode_echo_image(out.images[0]) == ("one", 11, 0)
            assert pool.in_flight == 0
            await pool.wait_idle()
        assert pool.readiness() == (False, "the engine pool is stopped")


async def test_least_loaded_routing() -> None:
    with trio.fail_after(CAP_S):
        async with serving(EnginePool(echo_config(), replicas=2)) as pool:
            a = pool.submit("a", LONG)
            b = pool.submit("b", LONG)
            c = pool.submit("c", LONG)
            assert [s.replica for s in (a, b, c)] == [0, 1, 0]
            assert [r["in_flight"] for r in pool.replicas_info()] == [2, 1]
            assert pool.abort(b.request_id) == "aborted"
            out = await final_of(b)
            assert out.status is RequestStatus.FINISHED_ABORTED
            assert b.stream.abort_reason == "cancelled"
            d = pool.submit("d", LONG)
            e = pool.submit("e", LONG)
            assert (d.replica, e.replica) == (1, 1)  # 2 vs 0, then 2 vs 1
            pool.abort_all("test over")
            for sub in (a, c, d, e):
                assert (await final_of(sub)).status is RequestStatus.FINISHED_ABORTED
                assert sub.stream.abort_reason == "test over"
            await pool.wait_idle()
            assert pool.in_flight == 0


async def test_request_ids_are_unique_across_replicas() -> None:
    with trio.fail_after(CAP_S):
        async with serving(EnginePool(echo_config(), replicas=2)) as pool:
            first = pool.submit("x", LONG, request_id="same")
            assert first.replica == 0
            # Replica 1 is idle, but the id is in flight on replica 0.
            with pytest.raises(DuplicateRequestError):
                pool.submit("x", LONG, request_id="same")
            assert pool.in_flight == 1
            assert pool.abort("same") == "aborted"
            await final_of(first)
            assert pool.abort("same") == "finished"
            assert pool.abort("never-seen") == "unknown"
            again = pool.submit("x", SHORT, request_id="same")  # reusable once ended
            assert (await final_of(again)).status is RequestStatus.FINISHED_COMPLETED
            assert pool.abort("same") == "finished"


async def test_ids_are_scoped_per_owner() -> None:
    """Two owners may hold the same public id at once; the engine runs each under its own
    id (``public@owner``; the anonymous owner's is the public id); every lookup by another
    owner finds nothing."""
    assert engine_request_id("r", "") == "r"
    assert engine_request_id("r", "tag") == "r@tag"
    with trio.fail_after(CAP_S):
        async with serving(EnginePool(echo_config())) as pool:
            anonymous = pool.submit("x", SHORT, request_id="r")
            mine = pool.submit("x", LONG, request_id="r", owner="aaaa")
            theirs = pool.submit("x", LONG, request_id="r", owner="bbbb")
            with pytest.raises(DuplicateRequestError):
                pool.submit("x", LONG, request_id="r", owner="aaaa")
            assert (mine.request_id, theirs.request_id) == ("r", "r")
            assert mine.stream.engine_request_id == "r@aaaa"
            assert anonymous.stream.engine_request_id == "r"
            out = await final_of(anonymous)
            assert decode_echo_image(out.images[0])[0] == "r"
            assert pool.status("r", owner="bbbb") == "queued"  # behind "r@aaaa"
            await wait_until(lambda: pool.progress("r", owner="aaaa") is not None)
            assert pool.status("r", owner="aaaa") == "running"
            assert pool.status("r", owner="cccc") is None
            assert pool.progress("r", owner="cccc") is None
            assert pool.abort("r", owner="cccc") == "unknown"
            # a public id spelling another owner's engine id reaches nothing
            assert pool.abort("r@aaaa") == "unknown"
            assert pool.status("r@aaaa") is None and pool.progress("r@aaaa") is None
            assert pool.abort("r", owner="bbbb") == "aborted"
            assert (await final_of(theirs)).status is RequestStatus.FINISHED_ABORTED
            assert pool.status("r", owner="bbbb") == "finished"
            assert pool.status("r", owner="aaaa") == "running"  # untouched
            generated = pool.submit("x", LONG, owner="aaaa")
            assert generated.request_id.startswith("req-")
            assert pool.abort(generated.request_id) == "unknown"  # anonymous is not aaaa
            assert pool.abort(generated.request_id, owner="aaaa") == "aborted"
            assert pool.abort("r", owner="aaaa") == "aborted"
            await final_of(mine)
            await final_of(generated)


async def test_engine_validation_errors_admit_nothing() -> None:
    with trio.fail_after(CAP_S):
        async with serving(EnginePool(echo_config())) as pool:
            with pytest.raises(InvalidRequestError) as info:
                pool.submit("x", SHORT.replace(height=63))
            assert info.value.param == "height"
            assert pool.in_flight == 0
            assert pool.abort("anything") == "unknown"


async def test_queue_full_and_draining() -> None:
    with trio.fail_after(CAP_S):
        async with serving(EnginePool(echo_config(), max_queue_len=2)) as pool:
            a = pool.submit("a", LONG)
            b = pool.submit("b", SamplingParams(height=64, width=64, num_inference_steps=5))
            with pytest.raises(QueueFullError, match="max_queue_len=2"):
                pool.submit("c", SHORT)
            pool.abort(a.request_id)
            await final_of(a)
            pool.start_draining()
            assert pool.draining
            ready, reason = pool.readiness()
            assert not ready and reason is not None and "draining" in reason
            with pytest.raises(DrainingError):
                pool.submit("c", SHORT)
            # In-flight requests finish while draining.
            done = trio.Event()

            async def drain() -> None:
                await pool.wait_idle()
                done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(drain)
                assert not done.is_set()
                out = await final_of(b)
                assert out.status is RequestStatus.FINISHED_COMPLETED
            assert done.is_set() and pool.in_flight == 0


async def test_finished_ids_are_remembered_in_a_bounded_lru(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pool_module, "FINISHED_IDS_KEPT", 2)
    with trio.fail_after(CAP_S):
        async with serving(EnginePool(echo_config())) as pool:
            for rid in ("r1", "r2", "r3"):
                await final_of(pool.submit("x", SHORT, request_id=rid))
            assert [pool.abort(rid) for rid in ("r1", "r2", "r3")] == [
                "unknown",
                "finished",
                "finished",
            ]


async def test_a_dead_replica_is_reopened_and_the_others_are_not_disturbed() -> None:
    with trio.fail_after(CAP_S):
        # The engine gives up on its first worker-group failure: the replica's engine dies.
        pool = EnginePool(
            echo_config(max_worker_restarts=0),
            replicas=2,
            restart_policy=RestartPolicy(max_restarts=3, backoff_s=0.0),
        )
        async with serving(pool):
            victim = pool.submit("a", LONG, request_id="victim")
            bystander = pool.submit(
                "b",
                SamplingParams(height=64, width=64, num_inference_steps=40, seed=5),
                request_id="bystander",
            )
            assert (victim.replica, bystander.replica) == (0, 1)
            engine0, engine1 = pool.replica_engine(0), pool.replica_engine(1)
            assert engine0 is not None and engine1 is not None
            await wait_until(lambda: engine0.statistics().running == 1)
            results: dict[str, DiffusionOutput] = {}

            async def consume(sub: Submission) -> None:
                results[sub.request_id] = await final_of(sub)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(consume, victim)
                nursery.start_soon(consume, bystander)
                await trio.sleep(0.1)
                engine0.executor.fail(WorkerError("killed by the test", worker=0))
            # The victim's engine died before any chunk of it was read: it moved to the live
            # replica (same id, same seed) and completed there.
            assert results["victim"].status is RequestStatus.FINISHED_COMPLETED
            assert (victim.stream.moves, victim.stream.replica) == (1, 1)
            assert pool.moved == {"replica_died": 1, "workers_restarting": 0}
            assert decode_echo_image(results["victim"].images[0]) == ("victim", victim.seed, 0)
            # The bystander on replica 1 ran to completion on the same engine.
            assert results["bystander"].status is RequestStatus.FINISHED_COMPLETED
            assert decode_echo_image(results["bystander"].images[0]) == ("bystander", 5, 0)
            assert pool.replica_engine(1) is engine1 and engine1.health().healthy
            assert engine1.statistics().finished_error == 0
            # Replica 0 comes back with a fresh engine.
            await wait_until(lambda: pool.readiness()[0])
            info = pool.replicas_info()
            assert [(r["state"], r["restarts"]) for r in info] == [("ready", 1), ("ready", 0)]
            assert pool.replica_engine(0) is not engine0
            out = await final_of(pool.submit("c", SHORT, request_id="after"))
            assert out.status is RequestStatus.FINISHED_COMPLETED


async def test_past_the_restart_limit_serve_raises() -> None:
    with trio.fail_after(CAP_S):
        pool = EnginePool(
            echo_config(max_worker_restarts=0),
            replicas=2,
            restart_policy=RestartPolicy(max_restarts=0),
        )
        with pytest.raises(RestartLimitError) as info:
            async with trio.open_nursery() as nursery:
                await nursery.start(pool.serve)
                engine = pool.replica_engine(1)
                assert engine is not None
                engine.executor.fail(WorkerError("killed by the test"))
                await trio.sleep_forever()
        assert info.value.child == "replica-1"
        ready, reason = pool.readiness()
        assert not ready and reason is not None and "gave up" in reason
        with pytest.raises(EngineDeadError):
            pool.submit("x", SHORT)
        assert pool.replica_engine(0) is None and pool.replica_engine(1) is None


# -- the service rate, Retry-After and the queue-wait limit -----------------------------------


def test_the_service_rate_is_measured_over_recent_completions() -> None:
    meter = ServiceRate(window=4, window_s=10.0)
    assert meter.rate(0.0) is None
    meter.record(1.0)
    assert meter.rate(1.0) is None  # one completion measures nothing
    meter.record(1.5)
    meter.record(2.0)
    assert meter.rate(2.0) == pytest.approx(2 / 1.0)
    assert meter.rate(3.0) == pytest.approx(2 / 2.0)  # a stall since decays the rate
    for t in (3.0, 4.0, 5.0):
        meter.record(t)
    assert meter.rate(5.0) == pytest.approx(3 / 3.0)  # only the last 4 count
    assert meter.rate(14.5) is None  # all but one older than the window


def test_the_rate_of_work_weighs_each_completion_by_its_steps() -> None:
    meter = ServiceRate(window=4, window_s=10.0)
    meter.record(1.0, work=16.0)
    assert meter.work_rate(1.0) is None
    meter.record(2.0, work=4.0)
    meter.record(3.0, work=16.0)
    # The completions after the first, over the time since it: (4 + 16) / 2 s.
    assert meter.work_rate(3.0) == pytest.approx(20 / 2.0)
    assert meter.rate(3.0) == pytest.approx(2 / 2.0)
    assert meter.work_rate(4.0) == pytest.approx(20 / 3.0)  # a lull decays it
    assert pool_module.request_work(SHORT) == SHORT.num_inference_steps
    assert pool_module.request_work(SHORT.replace(num_outputs_per_prompt=2)) == 4.0
    assert pool_module.request_work(SHORT.replace(num_inference_steps=-1)) == 1.0


async def test_retry_after_and_the_queue_wait_come_from_the_measured_rate() -> None:
    """Before anything completed: the default Retry-After and no queue-wait check.  Once
    requests completed: a request whose timeout is shorter than the estimated wait behind
    the one in flight is refused with QueueWaitError (nothing admitted), and so is any
    request past ``max_queue_wait_s``; Retry-After stays within its bounds."""
    with trio.fail_after(CAP_S):
        async with serving(EnginePool(echo_config(), max_queue_len=2)) as pool:
            assert pool.service_rate() is None and pool.estimated_wait_s() is None
            assert pool.retry_after_s() == pool_module.DEFAULT_RETRY_AFTER_S
            # Nothing measured: admitted (and then timed out by the engine).
            early = await final_of(pool.submit("x", SHORT.replace(deadline_s=0.001)))
            assert early.error_type == "RequestTimeoutError"
            for index in range(3):
                await final_of(pool.submit(f"p{index}", SHORT))
            rate = pool.service_rate()
            assert rate is not None and rate > 0
            running = pool.submit("long", LONG)
            wait = pool.estimated_wait_s()
            assert wait is not None and wait >= 1 / rate
            with pytest.raises(QueueWaitError, match="timeout") as info:
                pool.submit("late", SHORT.replace(deadline_s=wait / 10))
            assert info.value.estimate_s >= wait  # the rate only decays meanwhile
            assert pool.in_flight == 1  # "late" was not admitted
            assert 1 <= pool.retry_after_s() <= pool_module.MAX_RETRY_AFTER_S
            pool.abort(running.request_id)
            await final_of(running)
        strict = EnginePool(echo_config(), max_queue_wait_s=1e-6)
        async with serving(strict) as pool:
            for index in range(3):
                await final_of(pool.submit(f"p{index}", SHORT))
            running = pool.submit("long", LONG)
            with pytest.raises(QueueWaitError, match="max_queue_wait_s"):
                pool.submit("next", SHORT)
            pool.abort(running.request_id)
            await final_of(running)
    with pytest.raises(InvalidConfigError, match="max_queue_wait_s"):
        EnginePool(echo_config(), max_queue_wait_s=0)


def test_the_rates_weigh_each_step_by_the_time_a_step_of_its_size_takes() -> None:
    """Completions and arrivals keep their pixels: the rates weigh each step by the weight
    given when asked (so one measured before a new weight is weighed by the new one)."""
    meter = ServiceRate(window=4, window_s=10.0)
    log = ArrivalLog(window=4, window_s=10.0)
    for t, work, px in ((1.0, 10.0, 1024), (2.0, 10.0, 4096), (3.0, 10.0, 1024)):
        meter.record(t, work, px)
        log.record(t, 0, "k", work, px)
    weight = {1024: 0.01, 4096: 0.04}.get
    assert meter.work_rate(3.0) == pytest.approx(20 / 2.0)  # unweighted: steps
    assert meter.work_rate(3.0, lambda px: weight(px) or 0.0) == pytest.approx(0.5 / 2.0)
    assert log.rate(3.0, lambda p, k: True, lambda px: weight(px) or 0.0) == pytest.approx(0.25)


async def test_the_step_weight_is_the_engines_measured_step_time_per_size() -> None:
    """Before anything ran every step weighs 1; then a measured size weighs what its engine
    measured, and another size is scaled from the nearest measured one by its pixels."""
    with trio.fail_after(CAP_S):
        async with serving(EnginePool(echo_config(), max_queue_len=4)) as pool:
            assert pool.step_weight()(64 * 64) == 1.0
            await final_of(pool.submit("p", SHORT))
            engine = pool.replica_engine(0)
            assert engine is not None
            measured = engine.step_times()
            assert set(measured) == {64 * 64} and measured[64 * 64] > 0
            weight = pool.step_weight()
            assert weight(64 * 64) == measured[64 * 64]
            assert weight(32 * 32) == pytest.approx(measured[64 * 64] / 4)
            assert weight(128 * 128) == pytest.approx(measured[64 * 64] * 4)


def test_the_estimate_factor_is_a_high_quantile_of_how_far_estimates_fell_short() -> None:
    error = EstimateError(window=10, quantile=0.9, min_samples=4, max_factor=4.0)
    for measured in (1.0, 1.0, 1.0):
        error.record(1.0, measured)
    assert error.factor() == 1.0  # too few measured
    error.record(2.0, 5.0)  # 2.5x
    assert error.factor() == 2.5
    for _ in range(10):
        error.record(1.0, 0.5)  # estimates too pessimistic: never made more optimistic
    assert error.factor() == 1.0
    for _ in range(10):
        error.record(1.0, 9.0)
    assert error.factor() == 4.0  # bounded
    error.record(0.0, 1.0)  # no estimate: nothing to measure
    error.record(float("inf"), 1.0)
    assert error.factor() == 4.0


async def test_a_deadline_is_checked_against_the_estimate_scaled_by_its_measured_error() -> None:
    """Once finishes were measured longer than estimated, a request whose deadline covers
    the estimate but not the estimate scaled by that error is refused; every admitted
    request's own finish is measured against its estimate."""
    with trio.fail_after(CAP_S):
        async with serving(EnginePool(echo_config(), max_queue_len=8)) as pool:
            for index in range(3):
                await final_of(pool.submit(f"p{index}", SHORT))
            running = pool.submit("p", LONG, request_id="running")
            assert running.stream.estimate_s is not None  # (no deadline: measured all the same)
            work_rate = pool.work_rate()
            assert work_rate is not None
            w = pool.step_weight()(64 * 64)
            fits = (LONG.num_inference_steps + 2 * SHORT.num_inference_steps) * w / work_rate
            first = pool.submit("p", SHORT.replace(deadline_s=fits), request_id="fits")
            pool.abort(first.request_id)
            await final_of(first)
            assert pool.estimate_factor() == 1.0
            for _ in range(pool_module.ESTIMATE_MIN_SAMPLES):
                pool._estimate_error.record(1.0, 3.0)  # (as if finishes took 3x)
            assert pool.estimate_factor() == 3.0
            with pytest.raises(QueueWaitError, match="timeout"):
                pool.submit("p", SHORT.replace(deadline_s=fits), request_id="refused")
            pool.abort(running.request_id)
            await final_of(running)


async def test_under_priority_each_priority_gets_its_own_measured_estimate_error() -> None:
    """Later better arrivals pass a worse request beyond any estimate: under ``priority``
    each priority's finishes measure its own factor (once enough were measured); before,
    and under other policies, everyone's."""
    for policy in ("priority", "fifo"):
        config = echo_config(scheduling_policy=policy)
        with trio.fail_after(CAP_S):
            async with serving(EnginePool(config, max_queue_len=64)) as pool:
                # (The first ones are not estimated: no rate is measured before them.)
                for index in range(pool_module.ESTIMATE_MIN_SAMPLES + 4):
                    await final_of(pool.submit(f"p{index}", SHORT.replace(priority=5)))
                if policy == "priority":
                    assert pool._priority_errors[5].measured
                    for _ in range(pool_module.ESTIMATE_WINDOW):
                        pool._priority_errors[5].record(1.0, 3.0)  # (as if passed: 3x)
                    assert pool.estimate_factor(5) == 3.0
                    assert pool.estimate_factor(0) == pool.estimate_factor() < 3.0
                else:
                    assert not pool._priority_errors
                    assert pool.estimate_factor(5) == pool.estimate_factor()
                await _check_deadlines_scaled_by_priority(pool, refused=policy == "priority")


async def _check_deadlines_scaled_by_priority(pool: EnginePool, *, refused: bool) -> None:
    """A deadline that covers the estimate but not 3x it: refused for priority 5 whose own
    factor is 3 (``refused``), admitted for priority 0 (everyone's factor, about 1)."""
    running = pool.submit("p", LONG, request_id="running")
    engine = pool.replica_engine(0)
    assert engine is not None
    await wait_until(lambda: engine.status("running") is RequestStatus.RUNNING)
    work_rate = pool.work_rate()
    assert work_rate is not None
    w = pool.step_weight()(64 * 64)
    fits = 1.5 * (LONG.num_inference_steps + 2 * SHORT.num_inference_steps) * w / work_rate
    assert pool.estimate_factor() < 1.5
    held = [running]
    low = SHORT.replace(priority=5, deadline_s=fits)  # first: nothing waits, nothing passes
    if refused:
        with pytest.raises(QueueWaitError, match="timeout"):
            pool.submit("p", low, request_id="p5")
    else:
        held.append(pool.submit("p", low, request_id="p5"))
    held.append(pool.submit("p", SHORT.replace(deadline_s=fits), request_id="p0"))
    for submission in held:
        pool.abort(submission.request_id)
        await final_of(submission)


async def test_under_priority_the_wait_counts_only_who_runs_first() -> None:
    """``scheduling_policy="priority"``: a high-priority request is not refused for the
    waiting low-priority requests it will pass, but is for the one running (it holds the
    slot) and for requests of its own priority; a low one waits for everyone.  Waits are
    the work left (steps, each weighed by its size's measured step time), at the measured
    rate of work."""
    config = echo_config(scheduling_policy="priority")
    with trio.fail_after(CAP_S):
        # (A queue limit that lets the low ones in although the priority-0 ones measured
        # before pass them: PassedTooLongError's own test is below.)
        async with serving(EnginePool(config, max_queue_len=64)) as pool:
            for index in range(3):
                await final_of(pool.submit(f"p{index}", SHORT))
            running = pool.submit("p", LONG.replace(priority=5), request_id="running")
            engine = pool.replica_engine(0)
            assert engine is not None
            await wait_until(lambda: engine.status("running") is RequestStatus.RUNNING)
            waiting = [
                pool.submit("p", LONG.replace(priority=5), request_id=f"w{i}") for i in range(6)
            ]
            work_rate = pool.work_rate()
            assert work_rate is not None
            w = pool.step_weight()(64 * 64)  # every request here is 64x64
            steps = LONG.num_inference_steps
            # Its finish: what the running one has left, then itself: < 1.5 x (LONG + SHORT).
            deadline = 1.5 * (steps + SHORT.num_inference_steps) * w / work_rate
            high = pool.submit(
                "p", SHORT.replace(priority=-5, deadline_s=deadline), request_id="high"
            )
            # A low one with the same deadline waits for all seven (and "high"): refused.
            with pytest.raises(QueueWaitError, match="timeout") as info:
                pool.submit("p", SHORT.replace(priority=5, deadline_s=deadline), request_id="low")
            assert info.value.estimate_s >= len(waiting) * steps * w / work_rate
            for submission in (running, high, *waiting):
                pool.abort(submission.request_id)
            for submission in (running, high, *waiting):
                await final_of(submission)


def test_the_arrival_log_measures_who_arrives_per_second() -> None:
    """As the service rate: the arrivals after the first in the window, over the time
    since the first (so one stream of arrivals and completions give the same rate)."""
    log = ArrivalLog(window=4, window_s=10.0)
    better_than_5 = lambda priority, _klass: priority < 5  # noqa: E731
    of_b = lambda _priority, klass: klass == "b"  # noqa: E731
    assert log.rate(0.0, better_than_5) == 0.0
    log.record(1.0, 0, "a")
    assert log.rate(1.0, better_than_5) == 0.0  # one arrival measures nothing
    log.record(1.5, 5, "b")
    log.record(2.0, 0, "a")
    assert log.rate(2.0, better_than_5) == pytest.approx(1 / 1.0)
    assert log.rate(2.0, of_b) == pytest.approx(1 / 1.0)
    assert log.rate(3.0, better_than_5) == pytest.approx(1 / 2.0)  # a lull decays it
    for t in (3.0, 4.0, 5.0):
        log.record(t, 5, "b")
    # Only the last 4 count: (2.0, a) starts the window, the three "b" after it.
    assert log.rate(5.0, of_b) == pytest.approx(3 / 3.0)
    assert log.rate(5.0, better_than_5) == 0.0
    assert log.rate(20.0, of_b) == 0.0  # all older than the window


async def test_under_priority_better_arrivals_to_come_count_in_the_estimate() -> None:
    """While requests wait, a low-priority request is passed by the better ones that keep
    arriving: right after a burst of them, a low request whose deadline covers the
    work ahead of it in arrival order is refused (503); a request of the best priority
    with the same deadline, which nothing passes, is admitted.  With nothing waiting (a
    pool that keeps up) no share is taken out."""
    config = echo_config(scheduling_policy="priority", max_num_seqs=1)
    with trio.fail_after(CAP_S):
        async with serving(EnginePool(config, max_queue_len=32)) as pool:
            for index in range(3):
                await final_of(pool.submit(f"p{index}", SHORT))
            burst = [
                pool.submit("p", LONG.replace(priority=-5), request_id=f"h{i}") for i in range(8)
            ]
            for submission in burst:  # gone again: only their arrivals are remembered
                pool.abort(submission.request_id)
                await final_of(submission)
            work_rate = pool.work_rate()
            assert work_rate is not None
            steps = LONG.num_inference_steps * pool.step_weight()(64 * 64)
            # Two LONG ahead of it in arrival order, and its own run: 2 x LONG + SHORT.
            roomy = SHORT.replace(priority=5, deadline_s=3 * steps / work_rate)
            alone = pool.submit("p", roomy, request_id="alone")  # nothing waits: admitted
            pool.abort(alone.request_id)
            await final_of(alone)
            running, waiting = await _one_running_one_waiting(pool)
            # In arrival order it would finish within its deadline; the better ones that
            # keep coming take most of the rate of work.
            with pytest.raises(QueueWaitError, match="timeout"):
                pool.submit("p", roomy, request_id="low")
            high = pool.submit("p", roomy.replace(priority=-5), request_id="high")
            for submission in (running, waiting, high):
                pool.abort(submission.request_id)
                await final_of(submission)


async def test_under_priority_a_request_passed_longer_than_a_full_queue_takes_gets_429() -> None:
    """Right after a burst of better-priority arrivals, a low request (no deadline) that
    they would hold past what a full queue in arrival order takes is refused with
    :class:`PassedTooLongError` (the queue is full for its priority, though not by count);
    a request of the best priority is admitted, and so is the low one under ``fifo``."""
    for policy in ("priority", "fifo"):
        config = echo_config(scheduling_policy=policy, max_num_seqs=1)
        with trio.fail_after(CAP_S):
            async with serving(EnginePool(config, max_queue_len=4)) as pool:
                await _check_passed_after_a_burst(pool, policy)


async def test_under_priority_nothing_waiting_means_nothing_passes() -> None:
    """With nothing waiting no later arrival passes a request: not refused with 429 even
    where its priority's measured error is larger than everyone's (``max_queue_len`` 1:
    its own finish is a full queue's)."""
    config = echo_config(scheduling_policy="priority", max_num_seqs=1)
    with trio.fail_after(CAP_S):
        async with serving(EnginePool(config, max_queue_len=1)) as pool:
            for index in range(3):
                await final_of(pool.submit(f"p{index}", SHORT.replace(priority=-5)))
            for _ in range(pool_module.ESTIMATE_WINDOW):
                pool._priority_errors.setdefault(5, EstimateError()).record(1.0, 3.0)
            assert pool.estimate_factor(5) == 3.0 > pool.estimate_factor()
            await final_of(pool.submit("p", SHORT.replace(priority=5), request_id="low"))


async def _check_passed_after_a_burst(pool: EnginePool, policy: str) -> None:
    for index in range(3):
        await final_of(pool.submit(f"p{index}", SHORT))
    burst = [pool.submit("p", LONG.replace(priority=-5), request_id=f"h{i}") for i in range(3)]
    for submission in burst:  # gone again: only their arrivals are remembered
        pool.abort(submission.request_id)
        await final_of(submission)
    held = list(await _one_running_one_waiting(pool))
    low = SHORT.replace(priority=5)
    if policy == "priority":
        with pytest.raises(PassedTooLongError) as info:
            pool.submit("p", low, request_id="low")
        assert info.value.estimate_s > info.value.limit_s > 0
        assert info.value.retry_after_s is not None and info.value.retry_after_s >= 1
        held.append(pool.submit("p", low.replace(priority=-5), request_id="high"))
    else:
        held.append(pool.submit("p", low, request_id="low"))
    for submission in held:
        pool.abort(submission.request_id)
        await final_of(submission)


async def _one_running_one_waiting(pool: EnginePool) -> tuple[Submission, Submission]:
    """Two LONG requests of priority 5 on a one-slot pool: "running" (once it runs), then
    "waiting" behind it."""
    running = pool.submit("p", LONG.replace(priority=5), request_id="running")
    engine = pool.replica_engine(0)
    assert engine is not None
    await wait_until(lambda: engine.status("running") is RequestStatus.RUNNING)
    return running, pool.submit("p", LONG.replace(priority=5), request_id="waiting")


async def test_under_fair_the_estimate_counts_turns_not_arrival_order() -> None:
    """``fair``: a request of a class with nothing in flight waits for at most as much
    work of each other class as its own (they take turns), not for all of it: with two
    long 64-px requests in flight, a short 32-px request whose deadline covers a few
    times its own work is admitted under fair and refused under fifo."""
    small = SamplingParams(height=32, width=32, num_inference_steps=2)
    for policy, admitted in (("fair", True), ("fifo", False)):
        with trio.fail_after(CAP_S):
            async with serving(
                EnginePool(echo_config(scheduling_policy=policy), max_queue_len=16)
            ) as pool:
                for index in range(3):
                    await final_of(pool.submit(f"p{index}", SHORT))
                big = [pool.submit("p", LONG, request_id=f"big{i}") for i in range(2)]
                work_rate = pool.work_rate()
                assert work_rate is not None
                w = pool.step_weight()(32 * 32)
                deadline = 10 * small.num_inference_steps * w / work_rate
                try:
                    ours = pool.submit("p", small.replace(deadline_s=deadline), request_id="s")
                except QueueWaitError:
                    refused = True
                else:
                    refused = False
                    pool.abort(ours.request_id)
                    await final_of(ours)
                assert refused is not admitted, policy
                for submission in big:
                    pool.abort(submission.request_id)
                    await final_of(submission)


async def test_under_fair_a_class_of_larger_pictures_gets_fewer_steps_per_turn() -> None:
    """The ``fair`` scheduler deals turns of equal cost (pixels x steps), so a 64-px class
    gets a quarter of the steps a 32-px class gets while both wait: with one long 64-px and
    two long 32-px requests in flight, a short 64-px request waits for all of the 32-px
    work (four 32-px steps per step of its own class), a short 32-px one for only a
    quarter of the 64-px work.  One deadline between the two estimates admits the 32-px
    request and refuses the 64-px one.  (Step mode: a class is a size, whatever the steps.)"""
    small = SamplingParams(height=32, width=32, num_inference_steps=2)
    large = SamplingParams(height=64, width=64, num_inference_steps=2)
    config = echo_config(scheduling_policy="fair", step_execution=True)
    with trio.fail_after(CAP_S):
        async with serving(EnginePool(config, max_queue_len=16)) as pool:
            for index in range(3):
                await final_of(pool.submit(f"p{index}", SHORT))
            long_32 = LONG.replace(height=32, width=32)
            held = [
                pool.submit("p", LONG, request_id="big64"),
                pool.submit("p", long_32, request_id="big32a"),
                pool.submit("p", long_32, request_id="big32b"),
            ]
            work_rate = pool.work_rate()
            assert work_rate is not None
            weight = pool.step_weight()
            w64, w32 = weight(64 * 64), weight(32 * 32)
            # 64-px: its own 200 steps + all 400 32-px steps; 32-px: its own 400 + a
            # quarter of the 64-px steps (~100); each step weighed by its size's time.
            wait_64, wait_32 = 200 * w64 + 400 * w32, 400 * w32 + 100 * w64
            assert wait_64 > wait_32
            deadline = (wait_64 + wait_32) / 2 / work_rate
            ours = pool.submit("p", small.replace(deadline_s=deadline), request_id="s32")
            with pytest.raises(QueueWaitError):
                pool.submit("p", large.replace(deadline_s=deadline), request_id="s64")
            for submission in [*held, ours]:
                pool.abort(submission.request_id)
                await final_of(submission)


def test_the_open_time_is_the_median_of_the_last_opens() -> None:
    times = OpenTime(window=4)
    assert times.expected_s() is None
    times.record(3.0)
    assert times.expected_s() == 3.0
    times.record(1.0)
    assert times.expected_s() == 2.0  # (1 + 3) / 2
    for seconds in (10.0, 11.0, 12.0):  # 3.0 leaves the window of 4
        times.record(seconds)
    assert times.expected_s() == pytest.approx((10.0 + 11.0) / 2)
    times.record(-1.0)  # a clock oddity counts as an instant open
    assert times.expected_s() == pytest.approx((10.0 + 11.0) / 2)


def test_retry_after_is_whole_seconds_within_its_bounds() -> None:
    assert clamp_retry_after(0.0) == 1
    assert clamp_retry_after(1.2) == 2
    assert clamp_retry_after(-5.0) == 1
    assert clamp_retry_after(1e9) == pool_module.MAX_RETRY_AFTER_S
    assert clamp_retry_after(float("inf")) == pool_module.MAX_RETRY_AFTER_S
    assert clamp_retry_after(float("nan")) == pool_module.MAX_RETRY_AFTER_S


class SlowOpeningExecutor(ScriptedExecutor):
    """A fake backend whose workers take :data:`OPEN_S` (virtual time) to start."""

    OPEN_S = 4.0

    async def serve(self, *, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        await trio.sleep(self.OPEN_S)
        await super().serve(task_status=task_status)


async def test_retry_after_of_an_unready_pool_comes_from_the_measured_open_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Before any open: the default.  A replica opening (its workers take 4 s): what is left
    of the measured open time.  A worker group restarting: its backoff plus the open time.
    Ready: 1 s.  Draining: the time to open every replica again."""
    config = EngineConfig(
        backend=SlowOpeningExecutor,
        warmup=False,
        max_worker_restarts=0,  # the engine dies on a group failure: the replica reopens
    )
    with trio.fail_after(CAP_S):
        pool = EnginePool(config, restart_policy=RestartPolicy(max_restarts=3, backoff_s=0.0))
        assert pool.open_time_s() is None
        assert pool.ready_retry_after_s() == pool_module.DEFAULT_RETRY_AFTER_S
        assert pool.restart_retry_after_s() == pool_module.DEFAULT_RETRY_AFTER_S
        async with serving(pool):
            assert pool.open_time_s() == pytest.approx(SlowOpeningExecutor.OPEN_S)
            assert pool.ready_retry_after_s() == 1
            engine = pool.replica_engine(0)
            assert engine is not None
            engine.executor.fail(WorkerError("killed by the test", worker=0))
            await wait_until(lambda: pool.replica_engine(0) is None)
            await trio.sleep(1.0)  # 1 s into the reopen: 3 s left
            assert not pool.readiness()[0]
            assert pool.ready_retry_after_s() == 3
            assert pool.unavailable_retry_after_s() == 3
            with pytest.raises(NotReadyError):
                pool.submit("x", SHORT)
            await wait_until(lambda: pool.readiness()[0])
            pool.start_draining()
            assert pool.unavailable_retry_after_s() == pool.restart_retry_after_s() == 4
    restarting = EngineConfig(
        backend=SlowOpeningExecutor,
        warmup=False,
        worker_restart_backoff_s=30.0,
        worker_restart_backoff_max_s=30.0,
    )
    with trio.fail_after(CAP_S):
        async with serving(EnginePool(restarting)) as pool:
            await fail_the_group(pool)
            assert pool.ready_retry_after_s() == 30 + 4


# -- restarts: requests wait in the queue, at most restart_wait_s ------------------------------


def scripted_config(backoff_s: float) -> EngineConfig:
    """A thread-free engine (the fake backend of tests/fakes.py, forwards in virtual time)
    whose worker group, once failed, restarts after ``backoff_s``."""
    return EngineConfig(
        backend=ScriptedExecutor,
        warmup=False,
        worker_restart_backoff_s=backoff_s,
        worker_restart_backoff_max_s=backoff_s,
    )


async def fail_the_group(pool: EnginePool) -> None:
    """Fail replica 0's worker group; return once its engine says it is restarting."""
    engine = pool.replica_engine(0)
    assert engine is not None
    engine.executor.fail(WorkerError("killed by the test", worker=0))
    while engine.health().state != "restarting":  # noqa: ASYNC110 - virtual time
        await trio.sleep(0.001)


async def test_a_request_admitted_during_a_restart_waits_at_most_restart_wait_s(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The group stays down (a 1000 s backoff): a request admitted meanwhile is aborted
    exactly ``restart_wait_s`` after admission, with RESTART_WAIT_REASON; one whose own
    timeout is shorter ends by that timeout instead, and is not marked."""
    with trio.fail_after(CAP_S):
        pool = EnginePool(scripted_config(backoff_s=1000.0), restart_wait_s=5.0)
        async with serving(pool):
            await fail_the_group(pool)
            admitted = trio.current_time()
            waiting = pool.submit("x", SHORT, request_id="waiting")
            short = pool.submit("x", SHORT.replace(deadline_s=2.0), request_id="short")
            assert pool.status("waiting") == "queued"
            out = await final_of(short)
            assert out.error_type == "RequestTimeoutError" and short.stream.abort_reason is None
            assert trio.current_time() - admitted == pytest.approx(2.0)
            out = await final_of(waiting)
            assert out.status is RequestStatus.FINISHED_ABORTED
            assert waiting.stream.abort_reason == pool_module.RESTART_WAIT_REASON
            assert trio.current_time() - admitted == pytest.approx(5.0)
            assert pool.in_flight == 0 and not pool._restart_waits
            # Still restarting: the next request gets the same bound, from its own admission.
            again_at = trio.current_time()
            again = pool.submit("x", SHORT, request_id="again")
            assert (await final_of(again)).status is RequestStatus.FINISHED_ABORTED
            assert trio.current_time() - again_at == pytest.approx(5.0)


async def test_a_restart_within_restart_wait_s_serves_the_waiting_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The group is back after 3 s: the request admitted during the restart runs on it and
    is never aborted, though it is still running when its 5 s wait would have ended."""
    with trio.fail_after(CAP_S):
        pool = EnginePool(scripted_config(backoff_s=3.0), restart_wait_s=5.0)
        async with serving(pool):
            await fail_the_group(pool)
            admitted = trio.current_time()
            sub = pool.submit("x", SHORT, request_id="during")
            out = await final_of(sub)
            assert out.status is RequestStatus.FINISHED_COMPLETED, out
            assert sub.stream.abort_reason is None
            assert 3.0 <= trio.current_time() - admitted < 5.0
            assert not pool._restart_waits


async def test_requests_queued_on_a_restarting_replica_move_to_a_ready_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Replica 0's group fails with two requests on it (one in the failed forward, one
    waiting behind it) and stays down (a 1000 s backoff): both move to replica 1 within one
    poll and complete there, each moved once; the request already on replica 1 stays."""
    config = scripted_config(backoff_s=1000.0).replace(max_num_seqs=1)
    with trio.fail_after(CAP_S):
        pool = EnginePool(config, replicas=2)
        async with serving(pool):
            first = pool.submit("a", SHORT, request_id="first")
            bystander = pool.submit("b", SHORT, request_id="bystander")
            behind = pool.submit("c", SHORT, request_id="behind")
            assert (first.replica, bystander.replica, behind.replica) == (0, 1, 0)
            engine0 = pool.replica_engine(0)
            assert engine0 is not None
            assert engine0.status(engine_request_id("behind")) is RequestStatus.WAITING
            await fail_the_group(pool)
            failed_at = trio.current_time()
            outs = {}
            for sub in (first, behind, bystander):
                outs[sub.request_id] = await final_of(sub)
            assert all(o.status is RequestStatus.FINISHED_COMPLETED for o in outs.values())
            assert trio.current_time() - failed_at <= 2 * pool_module.RESTART_POLL_S
            assert [(s.stream.moves, s.stream.replica) for s in (first, behind, bystander)] == [
                (1, 1),
                (1, 1),
                (0, 1),
            ]
            # The old engine holds nothing of them; the replica's slots moved with them.
            assert engine0.status("first") is None and engine0.status("behind") is None
            assert [r["in_flight"] for r in pool.replicas_info()] == [0, 0]
            assert pool.in_flight == 0 and pool.move_off_restarting() == 0
            assert pool.moved == {"replica_died": 0, "workers_restarting": 2}


async def test_a_moved_request_does_not_move_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A request moves off a restarting replica at most once (one that brings groups down
    cannot take every replica down in turn): moved to replica 1, it brings replica 1's group
    down too, and stays there, waiting for that restart, even once replica 0 is ready
    again; while no replica is ready nothing moves."""
    with trio.fail_after(CAP_S):
        pool = EnginePool(scripted_config(backoff_s=5.0), replicas=2)
        async with serving(pool):
            engine0, engine1 = pool.replica_engine(0), pool.replica_engine(1)
            assert engine0 is not None and engine1 is not None
            sub = pool.submit("a", SHORT, request_id="r")
            assert sub.replica == 0
            engine1.executor.die_in_forward = WorkerError("r crashes it", worker=0)
            await fail_the_group(pool)
            await wait_until(lambda: engine1.health().state == "restarting")
            assert (sub.stream.moves, sub.stream.replica) == (1, 1)
            assert engine0.health().state == "restarting"
            assert pool.move_off_restarting() == 0  # no replica is ready
            await wait_until(lambda: engine0.health().healthy)
            assert engine1.health().state == "restarting"
            assert pool.move_off_restarting() == 0  # replica 0 is ready: it moved once
            assert (sub.stream.moves, sub.stream.replica) == (1, 1)
            out = await final_of(sub)  # on replica 1, once its group is back
            assert out.status is RequestStatus.FINISHED_COMPLETED
            assert pool.moved["workers_restarting"] == 1


async def test_a_moved_request_keeps_what_is_left_of_its_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A request with a 10 s timeout moves 0.1 s after admission to a replica that never
    finishes it: it times out 10 s after its first admission, not 10 s after the move."""
    with trio.fail_after(CAP_S):
        pool = EnginePool(scripted_config(backoff_s=1000.0), replicas=2)
        async with serving(pool):
            engine1 = pool.replica_engine(1)
            assert engine1 is not None
            engine1.executor.hold = True  # replica 1 never finishes a forward
            admitted = trio.current_time()
            sub = pool.submit("a", SHORT.replace(deadline_s=10.0), request_id="r")
            await fail_the_group(pool)
            out = await final_of(sub)
            assert sub.stream.moves == 1
            assert out.error_type == "RequestTimeoutError"
            assert trio.current_time() - admitted == pytest.approx(10.0, abs=0.02)


async def test_a_read_blocked_on_the_stream_it_moved_from_goes_on_with_the_new_one() -> None:
    """PooledStream alone, over two raw request streams: the consumer waits on stream A when
    the request moves to B; A then ends with an error (a stage that refused the request
    late) and then its channel closes: neither is the request's any more, and the consumer
    reads B's terminal output; A's consumer-gone is never reported (the move aborted it)."""
    import math

    from omni_trio.runtime.request_stream import RequestStream
    from omni_trio.serve.pool import PooledStream

    def raw(name: str, gone: list[str]) -> tuple[Any, RequestStream]:
        send, receive = trio.open_memory_channel[DiffusionOutput](math.inf)
        return send, RequestStream("r", 1, receive, gone.append)

    gone_a: list[str] = []
    gone_b: list[str] = []
    send_a, a = raw("a", gone_a)
    send_b, b = raw("b", gone_b)
    released: list[PooledStream] = []
    aborted: list[str] = []
    stream = PooledStream(a, 0, released.append, move=lambda _: b)
    done = DiffusionOutput("r", RequestStatus.FINISHED_COMPLETED, finished=True, seed=1)
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            outputs: list[DiffusionOutput] = []

            async def consume() -> None:
                outputs.append(await stream.__anext__())

            nursery.start_soon(consume)
            await trio.testing.wait_all_tasks_blocked()  # blocked on A
            assert stream.move_off(aborted.append)
            assert aborted == ["r"] and stream.moves == 1
            a.fail_with(InvalidRequestError("the stage refused it late"))
            await send_a.aclose()  # A ends (its error is raised on this read)
            await trio.testing.wait_all_tasks_blocked()
            assert not outputs  # not A's end: now blocked on B
            send_b.send_nowait(done)
    assert outputs == [done]
    assert released == [stream] and stream.completed
    assert gone_b == []  # B ended with its terminal output


async def test_a_request_whose_chunk_reached_its_consumer_never_moves() -> None:
    """Step mode with previews (real echo engines): once a preview of the request reached
    its consumer, its replica's group failing does not move it (the client would see the
    run start over); it waits for its own replica."""
    config = echo_config(
        step_execution=True,
        streaming_output=True,
        worker_restart_backoff_s=30.0,
        worker_restart_backoff_max_s=30.0,
    )
    with trio.fail_after(CAP_S):
        pool = EnginePool(config, replicas=2)
        async with serving(pool):
            sub = pool.submit("a", LONG.replace(seed=3), request_id="seen")
            assert sub.replica == 0
            first = await sub.stream.__anext__()
            assert not first.finished
            engine0 = pool.replica_engine(0)
            assert engine0 is not None
            engine0.executor.fail(WorkerError("killed by the test", worker=0))
            await wait_until(lambda: engine0.health().state == "restarting")
            for _ in range(5):  # polls of the move check
                await trio.sleep(pool_module.RESTART_POLL_S)
            assert pool.move_off_restarting() == 0
            assert (sub.stream.moves, sub.stream.replica) == (0, 0)
            assert pool.moved["workers_restarting"] == 0
            await sub.stream.aclose()
            assert pool.in_flight == 0


async def warm_then_fail_once(pool: EnginePool) -> None:
    """Forwards of 0.05 s on both replicas, eight completions (a measured rate), then
    replica 0's group failed once and back: a failure right after completions restarts at
    once (a group that was serving), so the next one, with nothing completed since, waits
    for the configured backoff."""
    for index in (0, 1):
        engine = pool.replica_engine(index)
        assert engine is not None
        engine.executor.forward_s = 0.05
    for index in range(8):
        await final_of(pool.submit("w", SHORT, request_id=f"warm{index}"))
    assert pool.work_rate() is not None
    engine0 = pool.replica_engine(0)
    assert engine0 is not None
    await fail_the_group(pool)
    await wait_until(lambda: engine0.health().healthy)


async def test_an_overdue_restart_no_longer_keeps_its_requests(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Restarts measured at 0.2 s; this one takes 1000 s.  Behind replica 1's queue (seconds
    of work) the request first waits for its own replica, then, once the restart has taken
    longer than that queue would, moves, and completes long before the restart."""
    with trio.fail_after(CAP_S):
        pool = EnginePool(scripted_config(backoff_s=1000.0), replicas=2, max_queue_len=64)
        async with serving(pool):
            await warm_then_fail_once(pool)
            pool._group_restart_time.record(0.2)
            mine = pool.submit("x", SHORT, request_id="mine")
            await fail_the_group(pool)  # nothing completed since: the 1000 s backoff
            failed_at = trio.current_time()
            queue = [pool.submit("q", SHORT, request_id=f"q{i}") for i in range(30)]
            assert {sub.replica for sub in queue} == {1}
            await trio.sleep(0.5)
            assert mine.stream.moves == 0  # the restart is expected first
            out = await final_of(mine)
            assert out.status is RequestStatus.FINISHED_COMPLETED
            assert (mine.stream.moves, mine.stream.replica) == (1, 1)
            assert 0.5 < trio.current_time() - failed_at < 60.0
            for sub in queue:
                await final_of(sub)


async def test_a_restart_expected_before_the_live_replica_could_run_it_keeps_the_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A request moves only when the live replica would start it sooner than its own
    replica's restart is expected to be over: behind a queue of 30 requests on replica 1
    (seconds of work at the measured rate) and with a 0.5 s restart, the request waits for
    its own replica and completes there; the restart is measured."""
    with trio.fail_after(CAP_S):
        pool = EnginePool(scripted_config(backoff_s=0.5), replicas=2, max_queue_len=64)
        async with serving(pool):
            await warm_then_fail_once(pool)
            assert pool.expected_group_restart_s() == pytest.approx(0.5, abs=0.1)
            mine = pool.submit("x", SHORT, request_id="mine")
            assert mine.replica == 0
            await fail_the_group(pool)
            queue = [pool.submit("q", SHORT, request_id=f"q{i}") for i in range(30)]
            assert {sub.replica for sub in queue} == {1}
            out = await final_of(mine)
            assert out.status is RequestStatus.FINISHED_COMPLETED
            assert (mine.stream.moves, mine.stream.replica) == (0, 0)
            for sub in queue:
                await final_of(sub)
            assert pool.expected_group_restart_s() == pytest.approx(0.5, abs=0.2)


async def test_a_request_queued_on_a_replica_whose_workers_restart_completes_elsewhere() -> None:
    """Real echo engines (worker threads): replica 0's group fails under a running request
    and restarts only after 30 s; the request completes on replica 1 long before, with its
    own id and seed (the echo image says so)."""
    with trio.fail_after(CAP_S):
        pool = EnginePool(
            echo_config(worker_restart_backoff_s=30.0, worker_restart_backoff_max_s=30.0),
            replicas=2,
        )
        async with serving(pool):
            victim = pool.submit("a", LONG.replace(seed=11), request_id="victim")
            assert victim.replica == 0
            engine0 = pool.replica_engine(0)
            assert engine0 is not None
            await wait_until(lambda: engine0.statistics().running == 1)
            engine0.executor.fail(WorkerError("killed by the test", worker=0))
            failed_at = trio.current_time()
            out = await final_of(victim)
            assert out.status is RequestStatus.FINISHED_COMPLETED, out
            assert (victim.stream.moves, victim.stream.replica) == (1, 1)
            assert decode_echo_image(out.images[0]) == ("victim", 11, 0)
            assert trio.current_time() - failed_at < 20.0  # not after the 30 s restart
            assert engine0.health().state == "restarting"


async def test_restart_wait_none_leaves_only_the_requests_own_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(CAP_S):
        pool = EnginePool(scripted_config(backoff_s=1000.0), restart_wait_s=None)
        async with serving(pool):
            await fail_the_group(pool)
            admitted = trio.current_time()
            sub = pool.submit("x", SHORT.replace(deadline_s=20.0), request_id="r")
            out = await final_of(sub)
            assert out.error_type == "RequestTimeoutError"
            assert trio.current_time() - admitted == pytest.approx(20.0)
    for bad in (0, -1.0, float("inf"), float("nan"), True, "5"):
        with pytest.raises(InvalidConfigError, match="restart_wait_s"):
            EnginePool(echo_config(), restart_wait_s=bad)  # type: ignore[arg-type]
    assert EnginePool(echo_config()).restart_wait_s == pool_module.DEFAULT_RESTART_WAIT_S
