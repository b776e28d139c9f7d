"""``AsyncEngine.start_profile`` / ``stop_profile`` (omni_trio/runtime/profiling.py).

First :class:`EngineProfile` against fake workers (what it asks, in which order, what it
refuses before asking, what a failure or a cancellation leaves); then real in-process engines:
``builtin:tiny-sd``, whose trace must hold the model's own ops inside the runner's
``omni_trio.forward`` span (the worker thread that runs the forwards is the one recording),
and ``builtin:echo`` for the step-mode span and the refusals.  The process backends are in
``test_profiling_backends.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from omni_trio import EngineClosedError, SamplingParams, WorkerError, open_engine
from omni_trio.runtime.profiling import EngineProfile, check_prefix, default_prefix

CAP_S = 60.0


def event_names(path: str | Path) -> set[str]:
    with open(path, encoding="utf-8") as trace:
        return {event.get("name", "") for event in json.load(trace)["traceEvents"]}


class FakeWorkers:
    """The engine's ``collective_rpc`` over ``ranks`` fake workers that keep a profiling flag
    each; ``fail`` maps a method to the error its call raises."""

    def __init__(self, ranks: int = 2, fail: dict[str, Exception] | None = None) -> None:
        self.ranks = ranks
        self.fail = fail or {}
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.profiling = False

    async def __call__(self, method: str, *args: Any, unique_reply_rank: Any = 0) -> Any:
        assert unique_reply_rank is None  # every rank answers
        self.calls.append((method, args))
        await trio.sleep(0.01)  # the workers take a while (a checkpoint, a cancel point)
        if method in self.fail:
            raise self.fail[method]
        if method == "start_profile":
            self.profiling = True
            return [f"{args[0]}/{args[1]}-rank{r}.json" for r in range(self.ranks)]
        if method == "stop_profile":
            self.profiling = False
            return [Path(f"/t/rank{r}.json") for r in range(self.ranks)]
        assert method == "discard_profile"
        self.profiling = False
        return [True] * self.ranks


# -- EngineProfile -----------------------------------------------------------------------------


def test_the_default_prefix_is_dated_and_distinct() -> None:
    first, second = default_prefix(), default_prefix()
    assert re.fullmatch(r"omni-trio-\d{8}-\d{6}-[0-9a-f]{4}", first)
    assert first != second or pytest.fail("two profiles in a second collided")
    assert check_prefix(first) == first
    for bad in ("", ".x", "a/b"):
        with pytest.raises(ValueError, match="prefix"):
            check_prefix(bad)


async def test_start_and_stop_ask_every_worker_in_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    workers, profile = FakeWorkers(), EngineProfile()
    await profile.start(workers, Path("/traces"), "p")
    assert profile.active and (profile.directory, profile.prefix) == ("/traces", "p")
    assert await profile.stop(workers) == ["/t/rank0.json", "/t/rank1.json"]
    assert not profile.active
    assert workers.calls == [("start_profile", ("/traces", "p")), ("stop_profile", ())]
    await profile.start(workers, "rel")  # a default prefix; the path as given
    assert workers.calls[-1][1][0] == "rel" and workers.calls[-1][1][1].startswith("omni-trio-")


async def test_refusals_ask_no_worker(
    autojump_clock: trio.testing.MockClock,
) -> None:
    workers, profile = FakeWorkers(), EngineProfile()
    with pytest.raises(RuntimeError, match="not profiling"):
        await profile.stop(workers)
    for directory, prefix, error in (
        ("", "p", ValueError),
        (b"/bytes", "p", ValueError),
        ("/d", "../p", ValueError),
        (3, "p", TypeError),
    ):
        with pytest.raises(error):
            await profile.start(workers, directory, prefix)  # type: ignore[arg-type]
    assert workers.calls == [] and not profile.active
    async with trio.open_nursery() as nursery:
        nursery.start_soon(profile.start, workers, "/d", "p")
        await trio.testing.wait_all_tasks_blocked()  # the first start is with the workers
        with pytest.raises(RuntimeError, match="already profiling"):
            await profile.start(workers, "/e", "q")
    assert workers.calls == [("start_profile", ("/d", "p"))]


async def test_a_failed_start_discards_what_started_and_profiles_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    boom = WorkerError("cannot make the directory", worker=1, error_type="FileExistsError")
    workers, profile = FakeWorkers(fail={"start_profile": boom}), EngineProfile()
    with pytest.raises(WorkerError, match="cannot make"):
        await profile.start(workers, "/d", "p")
    assert not profile.active
    assert [method for method, _ in workers.calls] == ["start_profile", "discard_profile"]
    workers.fail = {}
    await profile.start(workers, "/d", "p")  # and it may be tried again
    assert profile.active


async def test_a_failed_stop_still_ends_the_profile(
    autojump_clock: trio.testing.MockClock,
) -> None:
    lost = WorkerError("not profiling", worker=0, error_type="RuntimeError")
    workers, profile = FakeWorkers(fail={"stop_profile": lost}), EngineProfile()
    await profile.start(workers, "/d", "p")
    with pytest.raises(WorkerError, match="not profiling"):
        await profile.stop(workers)
    assert not profile.active


async def test_a_cancelled_caller_waits_for_the_workers_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Cancelled 1 ms in, the caller still waits the workers' 10 ms: the engine's state
    stays what the workers did."""
    workers, profile = FakeWorkers(), EngineProfile()
    began = trio.current_time()
    with trio.move_on_after(0.001) as scope:
        await profile.start(workers, "/d", "p")
        await trio.sleep_forever()
    assert scope.cancelled_caught and profile.active and workers.profiling
    assert trio.current_time() - began == pytest.approx(0.01)
    with trio.move_on_after(0.001):
        await profile.stop(workers)
    assert not profile.active and not workers.profiling
    assert trio.current_time() - began == pytest.approx(0.02)


# -- real in-process engines ---------------------------------------------------------------------


async def test_the_trace_of_a_tiny_sd_forward_holds_the_model_s_ops(
    cache_dir: Path, tmp_path: Path
) -> None:
    with trio.fail_after(CAP_S):
        async with open_engine(
            model="builtin:tiny-sd", cache_dir=str(cache_dir), torch_threads=1, warmup=False
        ) as engine:
            assert not engine.profiling
            await engine.start_profile(tmp_path / "traces", prefix="sd")
            assert engine.profiling
            out = await engine.generate(
                "a red circle", SamplingParams(height=64, width=64, num_inference_steps=2, seed=1)
            )
            assert out.ok
            paths = await engine.stop_profile()
            assert not engine.profiling
    assert paths == [str(tmp_path / "traces" / "sd-rank0.json")]
    names = event_names(paths[0])
    assert {"omni_trio.forward", "aten::conv2d"} <= names


async def test_echo_engine_step_mode_refusals_and_relative_directories(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a-file").write_text("x")
    params = SamplingParams(height=32, width=32, num_inference_steps=2, seed=3)
    with trio.fail_after(CAP_S):
        async with open_engine(
            model="builtin:echo",
            cache_dir=str(cache_dir),
            warmup=False,
            step_execution=True,
        ) as engine:
            with pytest.raises(RuntimeError, match="not profiling"):
                await engine.stop_profile()
            with pytest.raises(WorkerError, match="a-file"):
                await engine.start_profile("a-file")
            assert not engine.profiling
            await engine.start_profile("rel", prefix="step")  # the worker's cwd: this one
            with pytest.raises(RuntimeError, match="already profiling"):
                await engine.start_profile("elsewhere")
            assert (await engine.generate("x", params)).ok
            (path,) = await engine.stop_profile()
            await engine.start_profile("rel", prefix="open")  # running when the engine closes
    assert path == str(tmp_path / "rel" / "step-rank0.json")
    assert "omni_trio.step" in event_names(path)
    assert sorted(p.name for p in (tmp_path / "rel").iterdir()) == ["step-rank0.json"]
    with pytest.raises(EngineClosedError):
        await engine.stop_profile()
