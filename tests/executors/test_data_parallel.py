"""Data-parallel worker processes (``data_parallel_size``): each rank runs different requests.

Real worker processes (tractor with the forkserver start method, and Ray) running the echo
model, whose images encode ``(request id, seed, image index)``: every result is checked to
be its own request's, so a result mapped back by rank order instead of by request id fails
here.  Step counts per rank show that the ranks shared the work (a replica group would show
every rank running every step).
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from omni_trio import AsyncEngine, DiffusionOutput, EngineConfig, SamplingParams, open_engine
from omni_trio._core.lifecycle import RequestStatus
from omni_trio.executors.group import GroupExecutor
from omni_trio.models.echo import ECHO_STEP_DELAY_S, decode_echo_image
from tests.executors.test_tractor_executor import _exists, poll_until, wait_until_gone

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

CAP_S = 90.0
S = RequestStatus


@pytest.fixture(params=["tractor", "ray"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")  # a local Ray the engine joins
    return str(request.param)


def params(steps: int = 3, *, seed: int, delay: float | None = None, **kw: Any) -> SamplingParams:
    kw.setdefault("height", 32)
    kw.setdefault("width", 32)
    extra = {ECHO_STEP_DELAY_S: delay} if delay is not None else {}
    return SamplingParams(num_inference_steps=steps, seed=seed, extra_args=extra, **kw)


@asynccontextmanager
async def dp_engine(backend: str, cache_dir: Path, **overrides: Any) -> AsyncIterator[AsyncEngine]:
    """An echo engine with two data-parallel ranks; on a normal exit no worker is left."""
    settings: dict[str, Any] = {
        "backend": backend,
        "data_parallel_size": 2,
        "cache_dir": str(cache_dir),
        "torch_threads": 1,
        "warmup": False,
        "worker_restart_backoff_s": 0.0,
        "close_timeout_s": 10.0,
    }
    if backend == "tractor":
        settings["worker_start_method"] = "forkserver"
    settings.update(overrides)
    seen: set[int] = set()
    async with open_engine(EngineConfig(**settings)) as engine:
        seen.update(group(engine).worker_pids().values())
        assert len(seen) == 2
        yield engine
        seen.update(group(engine).worker_pids().values())
    assert not [pid for pid in seen if _exists(pid)], "close left worker processes"


def group(engine: AsyncEngine) -> GroupExecutor:
    executor = engine.executor
    assert isinstance(executor, GroupExecutor)
    return executor


async def steps_per_rank(engine: AsyncEngine) -> dict[int, int]:
    """Each rank's denoising steps, read after every earlier call returned (the ping is
    queued behind them; its reply carries the count)."""
    await engine.collective_rpc("ping", unique_reply_rank=None)
    return group(engine).worker_steps()


async def assert_nothing_left(engine: AsyncEngine) -> None:
    await engine.wait_idle()
    held = {**engine.leftovers(), **await engine.worker_leftovers()}
    assert {kind: ids for kind, ids in held.items() if ids} == {}


def assert_own(out: DiffusionOutput, request_id: str, seed: int) -> None:
    assert out.status is S.FINISHED_COMPLETED, out
    assert [decode_echo_image(image) for image in out.images] == [
        (request_id, seed, k) for k in range(len(out.images))
    ]


async def generate_all(engine: AsyncEngine, jobs: dict[str, SamplingParams]) -> dict[str, Any]:
    """Admit every job at once (in order: streams are opened synchronously), then read
    them all concurrently."""
    streams = {rid: engine.stream(f"prompt {rid}", p, request_id=rid) for rid, p in jobs.items()}
    finals: dict[str, Any] = {}

    async def read(rid: str) -> None:
        async with streams[rid] as stream:
            async for out in stream:
                finals[rid] = out

    async with trio.open_nursery() as nursery:
        for rid in streams:
            nursery.start_soon(read, rid)
    return finals


async def test_each_rank_runs_its_own_share_of_a_wave_and_results_map_back_by_id(
    backend: str, cache_dir: Path
) -> None:
    """Request mode, four requests of three steps: two waves of two, one request per rank
    per wave (each rank ran six steps, not twelve); a large image (shared memory on
    tractor) comes back from rank 1 as well; n=2 keeps its images together."""
    jobs = {f"r{i}": params(seed=100 + i) for i in range(4)}
    jobs["big"] = params(seed=7, height=640, width=640)  # 1.2 MB: over the shm threshold
    jobs["pair"] = params(seed=8, num_outputs_per_prompt=2)
    with trio.fail_after(CAP_S):
        async with dp_engine(backend, cache_dir) as engine:
            finals = await generate_all(engine, jobs)
            for rid, p in jobs.items():
                assert p.seed is not None
                assert_own(finals[rid], rid, p.seed)
            steps = await steps_per_rank(engine)
            # 6 requests x 3 steps, shared: r0..r3 in two waves of two (the big one and the
            # pair have other shapes: waves of their own, on one rank each).
            assert sum(steps.values()) == 6 * 3 and min(steps.values()) >= 6, steps
            await assert_nothing_left(engine)
            assert engine.statistics().finished_completed == 6


async def test_step_mode_pins_each_request_to_one_rank_and_streams_previews(
    cache_dir: Path,
) -> None:
    """Step mode with previews, three requests at once on two ranks (capacity 2): the
    ticks carry one request per rank, each request's steps all run where its state is (a
    tick sent to the wrong rank would fail with "no step state"), previews stream, and
    the third request runs when a rank frees up."""
    jobs = {f"s{i}": params(4, seed=40 + i, delay=0.01) for i in range(3)}
    with trio.fail_after(CAP_S):
        async with dp_engine("tractor", cache_dir, streaming_output=True) as engine:
            streams = {
                rid: engine.stream(f"prompt {rid}", p, request_id=rid) for rid, p in jobs.items()
            }
            outs: dict[str, list[DiffusionOutput]] = {}

            async def read(rid: str) -> None:
                async with streams[rid] as stream:
                    outs[rid] = [out async for out in stream]

            async with trio.open_nursery() as nursery:
                for rid in streams:
                    nursery.start_soon(read, rid)
            for rid, p in jobs.items():
                assert p.seed is not None
                assert_own(outs[rid][-1], rid, p.seed)
                previews = [o for o in outs[rid][:-1] if not o.finished]
                assert previews, f"{rid} streamed no preview"
            steps = await steps_per_rank(engine)
            assert sum(steps.values()) >= 3 * 4 and min(steps.values()) >= 4, steps
            await assert_nothing_left(engine)


async def test_an_abort_stops_the_request_on_the_rank_that_runs_it(cache_dir: Path) -> None:
    """Two long requests of one shape run side by side, one per rank; aborting one stops it
    within a step while the other runs on to its image."""
    long = 150
    with trio.fail_after(CAP_S):
        async with dp_engine("tractor", cache_dir) as engine:
            keep = engine.stream("p", params(long, seed=1, delay=0.02), request_id="keep")
            gone = engine.stream("p", params(long, seed=2, delay=0.02), request_id="gone")
            await poll_until(
                lambda: all(engine.progress(rid) is not None for rid in ("keep", "gone"))
            )
            engine.abort("gone")
            async with gone:
                [last] = [out async for out in gone]
            assert last.status is S.FINISHED_ABORTED
            async with keep:
                final = [out async for out in keep][-1]
            assert_own(final, "keep", 1)
            steps = await steps_per_rank(engine)
            # One rank ran all of "keep"; the other stopped "gone" early.
            assert max(steps.values()) == long and min(steps.values()) < long // 2, steps
            await assert_nothing_left(engine)


async def test_a_killed_rank_restarts_alone_while_the_other_serves_and_its_request_reruns(
    backend: str, cache_dir: Path
) -> None:
    """SIGKILL rank 1 while both ranks run a request: only rank 1's group is written off and
    started again (rank 0 keeps its process and finishes its own request without a retry);
    rank 1's request runs again (same seed: the same image) and completes; the engine never
    restarts its worker group, and the next wave again uses both ranks."""
    with trio.fail_after(CAP_S):
        async with dp_engine(
            backend, cache_dir, max_retries_on_worker_failure=1, worker_stall_timeout_s=5.0
        ) as engine:
            executor = group(engine)
            first = executor.worker_pids()
            streams = {
                rid: engine.stream("p", params(60, seed=seed, delay=0.02), request_id=rid)
                for rid, seed in (("a", 11), ("b", 12))
            }
            await poll_until(lambda: all(engine.progress(rid) is not None for rid in ("a", "b")))
            victim = next(rid for rid in ("a", "b") if executor.holder_of(rid) == 1)
            os.kill(first[1], signal.SIGKILL)
            finals: dict[str, DiffusionOutput] = {}

            async def read(rid: str) -> None:
                async with streams[rid] as stream:
                    finals[rid] = [out async for out in stream][-1]

            async with trio.open_nursery() as nursery:
                for rid in streams:
                    nursery.start_soon(read, rid)
            assert_own(finals["a"], "a", 11)
            assert_own(finals["b"], "b", 12)
            health = engine.health()
            assert health.restarts == 0 and health.healthy, health
            assert engine.statistics().requeued == 1  # the victim alone ran again
            await wait_until_gone([first[1]], timeout=15.0)
            await poll_until(lambda: executor.rank_restarts == 1)
            assert engine.statistics().rank_restarts == 1
            second = executor.worker_pids()
            assert second[0] == first[0] and second[1] != first[1], (first, second)
            assert [w.state for w in engine.health().workers] == ["running", "running"]
            again = await generate_all(engine, {"c": params(seed=21), "d": params(seed=22)})
            assert_own(again["c"], "c", 21)
            assert_own(again["d"], "d", 22)
            steps = await steps_per_rank(engine)
            assert steps[0] >= 3 and steps[1] >= 3, (steps, victim)
            await assert_nothing_left(engine)


async def test_a_mixed_queue_runs_every_class_and_ranks_answer_for_their_share_only(
    cache_dir: Path,
) -> None:
    """Requests of two sizes and step counts interleaved (they never share a wave) with
    max_num_seqs=2: waves of up to four split two per rank, every request gets its own
    image."""
    jobs: dict[str, SamplingParams] = {}
    for i in range(8):
        size = 32 if i % 2 else 48
        jobs[f"m{i}"] = params(2 + i % 2, seed=300 + i, height=size, width=size)
    with trio.fail_after(CAP_S):
        async with dp_engine("tractor", cache_dir, max_num_seqs=2) as engine:
            finals = await generate_all(engine, jobs)
            for rid, p in jobs.items():
                assert p.seed is not None
                assert_own(finals[rid], rid, p.seed)
            await assert_nothing_left(engine)


async def cfg_pair_reference(
    cache_dir: Path, steps: int, seeds: range, *, step_execution: bool, backend: str
) -> tuple[dict[str, SamplingParams], dict[str, Any], dict[str, Any]]:
    """Guided ``builtin:tiny-sd`` jobs ``r0..``, their images from one inproc worker (the
    reference), and the engine settings the CFG-pair engine under test shares with it."""
    sampling = SamplingParams(
        height=32,
        width=32,
        num_inference_steps=steps,
        guidance_scale=7.5,
        negative_prompt="blurry",
        output_type="np",
    )
    jobs = {f"r{i}": sampling.replace(seed=seed) for i, seed in enumerate(seeds)}
    base: dict[str, Any] = {
        "model": "builtin:tiny-sd",
        "cache_dir": str(cache_dir),
        "torch_threads": 1,
        "warmup": False,
        "step_execution": step_execution,
    }
    async with open_engine(EngineConfig(backend="inproc", **base)) as engine:
        alone = await generate_all(engine, jobs)
    if backend == "tractor":
        base["worker_start_method"] = "forkserver"
    return jobs, alone, base


@pytest.mark.parametrize(
    ("pair_backend", "step_execution"),
    [("tractor", False), ("tractor", True), ("ray", False)],
    ids=["tractor-request", "tractor-step", "ray-request"],
)
async def test_cfg_parallel_pairs_split_guidance_within_each_data_parallel_rank(
    cache_dir: Path, request: pytest.FixtureRequest, pair_backend: str, step_execution: bool
) -> None:
    """``num_workers = 2 x data_parallel_size`` with ``cfg_parallel``: two CFG-parallel
    pairs (ranks 0+1 and 2+3, each with its own rendezvous), each running its own requests
    and splitting every guidance step between its two ranks; every image equals the
    single-worker one (same seeds), and each pair's two ranks ran the same steps while the
    pairs shared the requests."""
    if pair_backend == "ray":
        request.getfixturevalue("ray_cluster")
    with trio.fail_after(3 * CAP_S):
        jobs, alone, base = await cfg_pair_reference(
            cache_dir, 4, range(20, 24), step_execution=step_execution, backend=pair_backend
        )
        config = EngineConfig(
            backend=pair_backend,
            data_parallel_size=2,
            num_workers=4,
            cfg_parallel=True,
            close_timeout_s=10.0,
            **base,
        )
        async with open_engine(config) as engine:
            described = await engine.collective_rpc("describe", unique_reply_rank=None)
            assert [d["cfg_parallel"] for d in described] == [True] * 4
            pairs = await generate_all(engine, jobs)
            steps = await steps_per_rank(engine)
            await assert_nothing_left(engine)
    for rid in jobs:
        assert pairs[rid].status is S.FINISHED_COMPLETED, pairs[rid]
        assert abs(alone[rid].images[0] - pairs[rid].images[0]).max() <= 1e-4, rid
    assert steps[0] == steps[1] and steps[2] == steps[3], steps
    assert steps[0] > 0 and steps[2] > 0, steps  # both pairs ran requests
    assert steps[0] + steps[2] == 4 * 4, steps  # each request's steps ran on one pair


@pytest.mark.parametrize("pair_backend", ["tractor", "ray"])
async def test_a_killed_rank_of_a_cfg_pair_restarts_its_pair_alone(
    cache_dir: Path, request: pytest.FixtureRequest, pair_backend: str
) -> None:
    """Two CFG-parallel pairs as data-parallel ranks: SIGKILL the second rank of pair 1
    while both pairs run a request: pair 1 (both its ranks: they share a torch.distributed
    group) is restarted with a new rendezvous while pair 0 keeps its processes and finishes
    its own request; pair 1's request runs again and both images equal the single-worker
    ones (same seeds)."""
    if pair_backend == "ray":
        request.getfixturevalue("ray_cluster")
    with trio.fail_after(3 * CAP_S):
        jobs, alone, base = await cfg_pair_reference(
            cache_dir, 30, range(40, 42), step_execution=True, backend=pair_backend
        )
        config = EngineConfig(
            backend=pair_backend,
            data_parallel_size=2,
            num_workers=4,
            cfg_parallel=True,
            close_timeout_s=10.0,
            max_retries_on_worker_failure=1,
            **base,
        )
        async with open_engine(config) as engine:
            executor = group(engine)
            first = executor.worker_pids()
            streams = {
                rid: engine.stream(f"prompt {rid}", p, request_id=rid) for rid, p in jobs.items()
            }
            # Both run from the first tick on (capacity 2), one per pair: no need to wait
            # for a heartbeat's progress (a short tiny-sd render may end before one).
            await poll_until(lambda: {executor.holder_of(rid) for rid in jobs} == {0, 1})
            os.kill(first[3], signal.SIGKILL)
            finals: dict[str, DiffusionOutput] = {}

            async def read(rid: str) -> None:
                async with streams[rid] as stream:
                    finals[rid] = [out async for out in stream][-1]

            async with trio.open_nursery() as nursery:
                for rid in streams:
                    nursery.start_soon(read, rid)
            await poll_until(lambda: executor.rank_restarts == 1)
            second = executor.worker_pids()
            assert len(second) == 4 and engine.health().restarts == 0
            assert (second[0], second[1]) == (first[0], first[1])
            assert second[2] != first[2] and second[3] != first[3]
            assert engine.statistics().requeued == 1
            await assert_nothing_left(engine)
    for rid in jobs:
        assert finals[rid].status is S.FINISHED_COMPLETED, finals[rid]
        assert abs(alone[rid].images[0] - finals[rid].images[0]).max() <= 1e-4, rid
