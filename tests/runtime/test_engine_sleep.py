"""Sleep and wake of the engine (``AsyncEngine.sleep`` / ``wake_up``) on the inproc backend.

The ordering tests run ``builtin:echo`` behind a :class:`StepGate` (a forward held at a
known step); the memory tests run the real ``builtin:shapes`` pipeline, whose weights are
released and taken back bit for bit.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from omni_trio import (
    AsyncEngine,
    EngineAsleepError,
    EngineClosedError,
    EngineConfig,
    InvalidRequestError,
    RequestStatus,
    SamplingParams,
    StallError,
    WorkerError,
    open_engine,
)
from omni_trio._core.health import EngineState, SleepState
from omni_trio._core.trace import TraceKind, TraceRecorder
from omni_trio.models.offload import SLEEP_DIR_PREFIX
from omni_trio.worker.faults import WorkerFatalError
from tests.fakes import GatedEchoModel, StepGate, register_models

CAP_S = 60.0


def params(**kw: Any) -> SamplingParams:
    kw.setdefault("height", 32)
    kw.setdefault("width", 32)
    kw.setdefault("num_inference_steps", 3)
    return SamplingParams(**kw)


@asynccontextmanager
async def gated_engine(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path, **overrides: Any
) -> AsyncIterator[tuple[AsyncEngine, StepGate]]:
    gate = StepGate()
    register_models(monkeypatch, {"fake:gated-echo": lambda options: GatedEchoModel(gate)})
    overrides.setdefault("warmup", False)
    config = EngineConfig(
        model="fake:gated-echo", cache_dir=str(cache_dir), torch_threads=1, **overrides
    )
    async with open_engine(config) as engine:
        try:
            yield engine, gate
        finally:
            gate.open()


@asynccontextmanager
async def shapes_engine(cache_dir: Path, **overrides: Any) -> AsyncIterator[AsyncEngine]:
    overrides.setdefault("warmup", False)
    config = EngineConfig(
        model="builtin:shapes", cache_dir=str(cache_dir), torch_threads=1, **overrides
    )
    async with open_engine(config) as engine:
        yield engine


def pixels(output: Any) -> np.ndarray:
    return np.asarray(output.images[0])


async def test_sleep_waits_for_the_running_request_and_holds_the_queue(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    with trio.fail_after(CAP_S):
        async with gated_engine(monkeypatch, cache_dir) as (engine, gate):
            first = engine.stream("p", params(seed=1), request_id="first")
            await gate.wait_for_step(("first",), 1)
            async with trio.open_nursery() as nursery:
                reports: list[Any] = []

                async def sleep() -> None:
                    reports.extend(await engine.sleep(1))

                nursery.start_soon(sleep)
                await trio.testing.wait_all_tasks_blocked()
                # Falling asleep: the running request goes on, a new one waits.
                assert engine.statistics().sleep_state is SleepState.FALLING_ASLEEP
                assert engine.health().state is EngineState.SLEEPING
                second = engine.stream("p", params(seed=2), request_id="second")
                gate.open()
            assert reports == [
                {"rank": 0, "level": 1, "released_bytes": 0, "rss_bytes": reports[0]["rss_bytes"]}
            ]
            async with first:
                assert [o.ok async for o in first] == [True]
            health = engine.health()
            assert (health.state, health.healthy, health.sleep_level) == (
                EngineState.SLEEPING,
                False,
                1,
            )
            assert health.reason == "asleep (level 1)"
            # Asleep: the second request was admitted and waits.
            await trio.testing.wait_all_tasks_blocked()
            assert engine.status("second") is RequestStatus.WAITING
            assert gate.forwards == [("first",)]
            woke = await engine.wake_up()
            assert [(r["rank"], r["restored_bytes"]) for r in woke] == [(0, 0)]
            async with second:
                assert [o.ok async for o in second] == [True]
            stats = engine.statistics()
            assert (stats.sleep_state, stats.sleep_level, stats.sleeps) == (
                SleepState.AWAKE,
                0,
                1,
            )
            assert engine.health().healthy
    assert gate.forwards == [("first",), ("second",)]


async def test_sleep_times_out_naming_what_still_runs_and_stays_awake(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    with trio.fail_after(CAP_S):
        async with gated_engine(monkeypatch, cache_dir, sleep_drain_timeout_s=0.05) as (
            engine,
            gate,
        ):
            held = engine.stream("p", params(), request_id="held")
            await gate.wait_for_step(("held",), 1)
            with pytest.raises(StallError) as info:
                await engine.sleep(2)
            assert info.value.phase == "sleep"
            assert "held" in str(info.value)
            assert not engine.is_sleeping
            assert engine.statistics().sleep_state is SleepState.AWAKE
            gate.open()
            async with held:
                assert [o.ok async for o in held] == [True]
            # Awake: a new request runs at once.
            assert (await engine.generate("p", params(seed=3))).ok
            assert engine.statistics().sleeps == 0


async def test_a_cancelled_sleep_leaves_the_engine_awake(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    with trio.fail_after(CAP_S):
        async with gated_engine(monkeypatch, cache_dir) as (engine, gate):
            held = engine.stream("p", params(), request_id="held")
            await gate.wait_for_step(("held",), 1)
            with trio.move_on_after(0.05):
                await engine.sleep(1)
            assert engine.statistics().sleep_state is SleepState.AWAKE
            gate.open()
            async with held:
                assert [o.ok async for o in held] == [True]


async def test_reject_while_asleep_refuses_new_requests(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    with trio.fail_after(CAP_S):
        async with gated_engine(monkeypatch, cache_dir, reject_while_asleep=True) as (
            engine,
            gate,
        ):
            gate.open()
            await engine.sleep(1)
            with pytest.raises(EngineAsleepError, match="asleep"):
                engine.stream("p", params())
            assert engine.statistics().admitted == 0
            await engine.wake_up()
            assert (await engine.generate("p", params(seed=4))).ok


async def test_bad_levels_and_waking_an_awake_engine(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    with trio.fail_after(CAP_S):
        async with gated_engine(monkeypatch, cache_dir) as (engine, gate):
            gate.open()
            for level in (0, 3, True, "1"):
                with pytest.raises(InvalidRequestError) as info:
                    await engine.sleep(level)  # type: ignore[arg-type]
                assert info.value.param == "level"
            assert await engine.wake_up() == []
            assert engine.statistics().sleep_state is SleepState.AWAKE


async def test_sleep_and_wake_are_traced(monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> None:
    trace = TraceRecorder()
    with trio.fail_after(CAP_S):
        async with gated_engine(monkeypatch, cache_dir) as (engine, gate):
            engine.trace = trace
            gate.open()
            await engine.sleep(2)
            await engine.sleep(1)  # already deeper: stays at level 2
            assert engine.health().sleep_level == 2
            await engine.wake_up()
    states = [
        (e.kind, e.detail["state"])
        for e in trace.events
        if e.kind in (TraceKind.SLEEP, TraceKind.WAKE)
    ]
    assert states == [
        (TraceKind.SLEEP, "falling_asleep"),
        (TraceKind.SLEEP, "asleep"),
        (TraceKind.SLEEP, "falling_asleep"),
        (TraceKind.SLEEP, "asleep"),
        (TraceKind.WAKE, "waking"),
        (TraceKind.WAKE, "awake"),
    ]


@pytest.mark.parametrize("level", [1, 2])
async def test_a_real_model_releases_its_weights_and_wakes_bit_for_bit(
    cache_dir: Path, tmp_path: Path, level: int
) -> None:
    sleep_dir = tmp_path / "sleep"
    ask = SamplingParams(num_inference_steps=6, seed=11)
    with trio.fail_after(CAP_S):
        async with shapes_engine(cache_dir, sleep_dir=str(sleep_dir)) as engine:
            before = await engine.generate("a red circle", ask)
            (report,) = await engine.sleep(level)
            assert report["level"] == level
            assert report["released_bytes"] > 5_000_000  # the UNet and the text encoder
            kept = list(sleep_dir.glob(f"{SLEEP_DIR_PREFIX}*")) if sleep_dir.exists() else []
            # Level 1 on a CPU keeps the weights in a private file; level 2 keeps nothing.
            assert len(kept) == (1 if level == 1 else 0)
            waiting = engine.stream("a red circle", ask)
            (woke,) = await engine.wake_up()
            assert woke["restored_bytes"] == report["released_bytes"]
            async with waiting:
                after = [o async for o in waiting][-1]
            assert np.array_equal(pixels(before), pixels(after))
            assert list(sleep_dir.glob(f"{SLEEP_DIR_PREFIX}*")) == []


async def test_a_failed_release_leaves_the_engine_awake_and_serving(
    cache_dir: Path, tmp_path: Path
) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with trio.fail_after(CAP_S):
        async with shapes_engine(cache_dir, sleep_dir=str(not_a_dir)) as engine:
            with pytest.raises(WorkerError):
                await engine.sleep(1)
            assert engine.statistics().sleep_state is SleepState.AWAKE
            assert engine.health().healthy
            out = await engine.generate("a blue square", SamplingParams(num_inference_steps=4))
            assert out.ok


async def test_a_sleep_under_way_when_the_engine_closes_raises_and_never_hangs(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    outcome: list[BaseException] = []
    with trio.fail_after(CAP_S):
        async with (
            trio.open_nursery() as nursery,
            gated_engine(monkeypatch, cache_dir) as (engine, gate),
        ):
            held = engine.stream("p", params(), request_id="held")  # (kept: read later)
            await gate.wait_for_step(("held",), 1)

            async def sleep() -> None:
                try:
                    await engine.sleep(1)
                except BaseException as exc:
                    outcome.append(exc)

            nursery.start_soon(sleep)
            await trio.testing.wait_all_tasks_blocked()
            # Closing ends "held": the sleep would go on to ask the workers, whose RPCs
            # were failed already.  It raises at once, before the forward even stops.
            nursery.start_soon(engine.aclose)
            await trio.testing.wait_all_tasks_blocked()
            assert len(outcome) == 1
            gate.open()
            async with held:
                assert [o.finished async for o in held] == [True]
    (error,) = outcome
    assert isinstance(error, EngineClosedError)
    assert engine._rpcs.methods == []


class _NoDeepSleep(GatedEchoModel):
    """A FAKE echo model that counts its sleeps and refuses level 2."""

    level = 0

    def sleep(self, level: int, directory: str | None = None) -> int:
        if level == 2:
            raise ValueError("no source to reload from: use level 1")
        _NoDeepSleep.level = max(_NoDeepSleep.level, level)
        return 1

    def wake_up(self) -> int:
        _NoDeepSleep.level = 0
        return 1


async def test_a_failed_deeper_sleep_leaves_the_engine_and_its_workers_asleep(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    gate = StepGate()
    gate.open()
    register_models(monkeypatch, {"fake:no-deep-sleep": lambda options: _NoDeepSleep(gate)})
    config = EngineConfig(
        model="fake:no-deep-sleep", cache_dir=str(cache_dir), torch_threads=1, warmup=False
    )
    with trio.fail_after(CAP_S):
        async with open_engine(config) as engine:
            await engine.sleep(1)
            with pytest.raises(WorkerError, match="no source to reload"):
                await engine.sleep(2)
            # Asleep at level 1 as before, in the core and in the worker.
            stats = engine.statistics()
            assert (stats.sleep_state, stats.sleep_level) == (SleepState.ASLEEP, 1)
            assert _NoDeepSleep.level == 1
            await engine.wake_up()
            assert _NoDeepSleep.level == 0
            assert (await engine.generate("p", params(seed=2))).ok


class _DiesOnWake(GatedEchoModel):
    """A FAKE echo model whose first wake breaks its worker (a device fault while the
    weights come back): the group fails closed and is replaced."""

    wakes = 0

    def sleep(self, level: int, directory: str | None = None) -> int:
        return 1

    def wake_up(self) -> int:
        _DiesOnWake.wakes += 1
        if _DiesOnWake.wakes == 1:
            raise WorkerFatalError("device lost while the weights came back")
        return 1


async def test_a_group_that_dies_while_waking_is_replaced_awake_and_the_queue_runs(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    gate = StepGate()
    gate.open()
    _DiesOnWake.wakes = 0
    register_models(monkeypatch, {"fake:dies-on-wake": lambda options: _DiesOnWake(gate)})
    config = EngineConfig(
        model="fake:dies-on-wake",
        cache_dir=str(cache_dir),
        torch_threads=1,
        warmup=False,
        worker_restart_backoff_s=0.0,
    )
    with trio.fail_after(CAP_S):
        async with open_engine(config) as engine:
            await engine.sleep(1)
            waiting = engine.stream("p", params(), request_id="waiting")
            # The wake's worker breaks: the wake is done all the same (the new group
            # loads its weights when it starts and is not put to sleep again).
            assert await engine.wake_up() == []
            assert engine.statistics().sleep_state is SleepState.AWAKE
            async with waiting:
                outputs = [o async for o in waiting]
            assert outputs[-1].finished and outputs[-1].ok
            assert engine.core.generation == 2
            assert _DiesOnWake.wakes == 1  # nothing asked the new group to wake
