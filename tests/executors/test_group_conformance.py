"""One conformance suite for every process backend (``GroupExecutor`` over its transport):
the same fault, the same expectations, on tractor and on Ray.

Each fault fails the worker group closed, the engine's supervisor starts a new group, the
request in flight is retried on it (``max_retries_on_worker_failure=1``), and the engine then
serves the next request.  A fault that travels with its request (a hang, a dead packer, a
broken device, a crash) fires again on the retry, so that request ends failed (retryable) after
two group failures; a fault from outside (a SIGKILL) does not, so the retry completes with the
image an undisturbed run gives.  Every worker process of every failed group is gone.

The tractor engines here use the forkserver start method (a restart forks a preloaded worker
in ~0.2 s instead of starting an interpreter); the default start method's crash and restart
paths have their own tests in test_tractor_executor.py.  Timings are not asserted (the
recovery times are measured by ``omni-trio bench recovery``); every wait is capped.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from omni_trio import (
    AsyncEngine,
    DiffusionRequest,
    EngineConfig,
    RequestFailedError,
    SamplingParams,
    open_engine,
)
from omni_trio._core.lifecycle import RequestStatus
from omni_trio.errors import StallError
from omni_trio.executors.group import GroupExecutor
from omni_trio.models.echo import ECHO_STEP_DELAY_S, decode_echo_image
from omni_trio.testing.faults import Fault, FaultSpec, with_faults
from tests.executors.test_tractor_executor import (
    _exists,
    poll_until,
    wait_running,
    wait_until_gone,
)

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

CAP_S = 90.0
S = RequestStatus


@pytest.fixture(params=["tractor", pytest.param("ray", marks=pytest.mark.slow)])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")  # a local Ray the engine joins
    return str(request.param)


def params(steps: int = 3, *, seed: int = 1, delay: float | None = None) -> SamplingParams:
    extra = {ECHO_STEP_DELAY_S: delay} if delay is not None else {}
    return SamplingParams(
        num_inference_steps=steps, seed=seed, height=32, width=32, extra_args=extra
    )


@asynccontextmanager
async def engine_on(backend: str, cache_dir: Path, **overrides: Any) -> AsyncIterator[AsyncEngine]:
    """An echo engine on ``backend`` with fault injection, quick restarts, one retry and a
    one-second stall deadline; on a normal exit, no worker process of it is left."""
    settings: dict[str, Any] = {
        "backend": backend,
        "cache_dir": str(cache_dir),
        "torch_threads": 1,
        "warmup": False,
        "cfg_parallel": False,
        "fault_injection": True,
        "worker_stall_timeout_s": 1.0,
        "worker_restart_backoff_s": 0.0,
        "max_retries_on_worker_failure": 1,
        "close_timeout_s": 10.0,
    }
    if backend == "tractor":
        settings["worker_start_method"] = "forkserver"
    settings.update(overrides)
    seen: set[int] = set()
    async with open_engine(EngineConfig(**settings)) as engine:
        seen.update(group(engine).worker_pids().values())
        yield engine
        seen.update(group(engine).worker_pids().values())
    assert not [pid for pid in seen if _exists(pid)], "close left worker processes"


def group(engine: AsyncEngine) -> GroupExecutor:
    executor = engine.executor
    assert isinstance(executor, GroupExecutor)
    return executor


async def fails_twice_then_serves(
    engine: AsyncEngine, faulty: SamplingParams, *, names: str
) -> RequestFailedError:
    """Run a request whose fault fires on every attempt: its group fails twice (the first
    run and the retry), then it is quarantined (failed for good, not retryable); the engine
    is ready again and serves a clean request; every process of the failed groups is gone.
    Returns the failure."""
    first = list(group(engine).worker_pids().values())
    with pytest.raises(RequestFailedError) as info:
        await engine.generate("p", faulty, request_id="faulty")
    error = info.value
    assert error.quarantined and not error.retryable, error
    assert error.error_type == "RequestQuarantinedError", error
    assert names in str(error), error
    await poll_until(lambda: engine.health().healthy)
    health = engine.health()
    assert health.restarts == 2, health
    assert health.last_failure is not None and names in health.last_failure
    clean = await engine.generate("p", params(seed=5), request_id="clean")
    assert clean.status is S.FINISHED_COMPLETED
    assert decode_echo_image(clean.images[0]) == ("clean", 5, 0)
    await wait_until_gone(first, timeout=15.0)
    return error


async def test_a_killed_worker_fails_the_group_and_its_request_reruns_on_the_next(
    backend: str, cache_dir: Path
) -> None:
    with trio.fail_after(CAP_S):
        async with engine_on(backend, cache_dir, num_workers=2) as engine:
            slow = params(40, seed=9, delay=0.02)
            undisturbed = await engine.generate("p", slow, request_id="a")
            pids = group(engine).worker_pids()
            stream = engine.stream("p", slow, request_id="a")
            await wait_running(engine, "a")
            os.kill(pids[1], signal.SIGKILL)  # not the output rank
            async with stream:
                outs = [out async for out in stream]
            await poll_until(lambda: engine.health().healthy)
            health = engine.health()
            new_pids = group(engine).worker_pids()
            await wait_until_gone(pids.values(), timeout=15.0)
    final = outs[-1]
    assert final.status is S.FINISHED_COMPLETED
    assert np.array_equal(np.asarray(final.images[0]), np.asarray(undisturbed.images[0]))
    assert health.restarts == 1
    assert health.last_failure is not None
    assert "worker 1: WorkerDied" in health.last_failure
    assert f"process {pids[1]} died" in health.last_failure
    assert not set(new_pids.values()) & set(pids.values())


async def test_a_worker_that_exits_mid_forward_fails_the_group(
    backend: str, cache_dir: Path
) -> None:
    crash = with_faults(params(4), FaultSpec(Fault.CRASH_AT_STEP, step=1))
    with trio.fail_after(CAP_S):
        async with engine_on(backend, cache_dir) as engine:
            await fails_twice_then_serves(engine, crash, names="WorkerDied")


async def test_a_hung_worker_is_killed_not_asked(
    backend: str, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A forward stuck in the worker makes no step progress: the group fails closed with a
    StallError and the hung worker is killed at once (a failed group is never asked to stop,
    so the 10 s close timeout is never waited for).  The supervisor sees that StallError,
    not an error of the teardown (tractor once raised ClosedResourceError out of its runtime
    when a killed worker's channel was closed under it)."""
    hang = with_faults(params(4), FaultSpec(Fault.HANG_AT_STEP, step=1))
    with trio.fail_after(CAP_S):
        async with engine_on(backend, cache_dir) as engine:
            (pid,) = group(engine).worker_pids().values()
            failed_at: list[float] = []

            async def note_failure(executor: GroupExecutor) -> None:
                await executor.wait_failed()
                failed_at.append(trio.current_time())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(note_failure, group(engine))
                error = await fails_twice_then_serves(engine, hang, names="stalled")
            assert "no step progress" in str(error) or "no progress" in str(error)
            supervisor_saw = [
                r.getMessage()
                for r in caplog.records
                if "child worker-group failed" in r.getMessage()
            ]
            assert len(supervisor_saw) == 2, supervisor_saw
            assert all("StallError" in message for message in supervisor_saw), supervisor_saw
            # Killed, not asked: gone well within the close timeout of its failure.
            with trio.fail_after(5.0):
                await wait_until_gone([pid], timeout=5.0)
            assert failed_at


async def test_an_rpc_past_its_timeout_fails_the_group(backend: str, cache_dir: Path) -> None:
    """A worker runs one call at a time, so every later call would queue behind a stuck one:
    an RPC with no reply within its timeout fails the group closed, on every backend."""
    hang = DiffusionRequest(
        "p",
        with_faults(params(4), FaultSpec(Fault.HANG_AT_STEP, step=1)),
        request_id="stuck",
    )
    with trio.fail_after(CAP_S):
        async with engine_on(backend, cache_dir, worker_stall_timeout_s=None) as engine:
            (pid,) = group(engine).worker_pids().values()
            with pytest.raises(StallError, match=r"'execute_model' got no reply within 1\.0 s"):
                await engine.collective_rpc("execute_model", hang, timeout=1.0)
            await poll_until(lambda: engine.health().healthy)
            health = engine.health()
            assert health.restarts == 1
            assert health.last_failure is not None and "rpc stalled" in health.last_failure
            out = await engine.generate("p", params(seed=2), request_id="after")
            assert decode_echo_image(out.images[0]) == ("after", 2, 0)
            await wait_until_gone([pid], timeout=15.0)


async def test_a_dead_output_packer_fails_the_group_at_once(backend: str, cache_dir: Path) -> None:
    """The packer thread dies as it starts packing: the output would never come.  The
    worker's heartbeat says so and the group fails (long before the output timeout)."""
    doomed = with_faults(params(2), FaultSpec(Fault.KILL_PACKER))
    with trio.fail_after(CAP_S):
        async with engine_on(backend, cache_dir) as engine:
            await fails_twice_then_serves(engine, doomed, names="PackerDied")


async def test_a_broken_device_fails_the_group_closed(backend: str, cache_dir: Path) -> None:
    """A sticky device fault (the device probe fails after a CUDA-like error) breaks the
    worker, not just the request: its group is replaced instead of failing every later
    request while health says ready."""
    poisoned = with_faults(params(4), FaultSpec(Fault.POISON_DEVICE, step=1))
    with trio.fail_after(CAP_S):
        async with engine_on(backend, cache_dir) as engine:
            error = await fails_twice_then_serves(engine, poisoned, names="DeviceFaultError")
            assert "failed its probe" in str(error)


async def test_a_poison_prompt_is_quarantined_and_its_bystanders_finish(
    backend: str, cache_dir: Path
) -> None:
    """A prompt that crashes the worker whenever it runs (a model bug one input triggers),
    fused with innocent requests: the group fails once under all of them, then each runs
    alone; the poison request's second crash quarantines it (no crash loop) and every
    bystander completes with its own picture."""
    with trio.fail_after(CAP_S):
        async with engine_on(
            backend,
            cache_dir,
            max_num_seqs=4,
            request_batch_max_wait_ms=200.0,
            model_options={"fault_crash_on_prompt": "poison"},
        ) as engine:
            results: dict[str, Any] = {}

            async def run(rid: str, prompt: str, seed: int) -> None:
                try:
                    results[rid] = await engine.generate(prompt, params(seed=seed), request_id=rid)
                except RequestFailedError as exc:
                    results[rid] = exc

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "poison", "a poison pill", 1)
                for index in range(3):
                    nursery.start_soon(run, f"b{index}", "p", 10 + index)
            await poll_until(lambda: engine.health().healthy)
            health = engine.health()
    poison = results["poison"]
    assert isinstance(poison, RequestFailedError) and poison.quarantined, poison
    assert "quarantined" in str(poison) and "WorkerDied" in str(poison)
    for index in range(3):
        out = results[f"b{index}"]
        assert not isinstance(out, Exception), out
        assert decode_echo_image(out.images[0]) == (f"b{index}", 10 + index, 0)
    assert health.restarts == 2, health  # once under the wave, once under the poison alone


@pytest.mark.parametrize("fault", ["exit", "hang"])
# tractor only: a Ray actor that dies while starting fails its start call already, and the
# deadline is the GroupExecutor's, the same for every backend.
@pytest.mark.parametrize("backend", ["tractor"])
async def test_a_restart_whose_worker_dies_or_hangs_while_starting_is_retried(
    backend: str, cache_dir: Path, tmp_path: Path, fault: str
) -> None:
    """A worker that dies while it loads the model (an OOM kill) or never becomes ready
    fails its group's start, which health reports and the supervisor retries; once the
    cause is gone (the flag file removed) the next start serves.  Before, the pid watch
    was armed only after ready and the start had no deadline: the engine waited for ever,
    healthy-looking."""
    flag = tmp_path / "start-fault"
    option = "fault_exit_on_load" if fault == "exit" else "fault_hang_on_load"
    with trio.fail_after(CAP_S):
        async with engine_on(
            backend,
            cache_dir,
            worker_start_timeout_s=2.0,
            worker_restart_backoff_s=0.5,
            model_options={option: str(flag)},
        ) as engine:
            (pid,) = group(engine).worker_pids().values()
            flag.touch()
            os.kill(pid, signal.SIGKILL)
            expected = "while starting" if fault == "exit" else "start stalled"
            await poll_until(lambda: expected in (engine.health().last_failure or ""))
            health = engine.health()
            assert not health.healthy and health.state == "restarting", health
            flag.unlink()
            await poll_until(lambda: engine.health().healthy)
            out = await engine.generate("p", params(seed=4), request_id="after")
            assert decode_echo_image(out.images[0]) == ("after", 4, 0)
            assert engine.health().restarts >= 2


@pytest.mark.parametrize("policy", ["priority", "fair"])
async def test_the_scheduling_policies_run_on_worker_processes(
    backend: str, cache_dir: Path, policy: str
) -> None:
    """Step mode on worker processes, one slot.  ``priority``: a better request arriving
    while a worse one runs finishes first (it preempted the worse one at a step boundary:
    without preemption it would wait for all 150 steps), and the worse one resumes from the
    state its worker kept and ends with its own image.  ``fair``: a 64x64 request queued
    behind five 32x32 ones runs before the last of them (FIFO would run it last)."""
    finished: list[str] = []
    results: dict[str, Any] = {}

    async def read(stream: Any) -> None:
        async with stream:
            outs = [out async for out in stream]
        results[stream.request_id] = outs[-1]
        finished.append(stream.request_id)

    with trio.fail_after(CAP_S):
        async with (
            engine_on(
                backend, cache_dir, step_execution=True, max_num_seqs=1, scheduling_policy=policy
            ) as engine,
            trio.open_nursery() as nursery,
        ):
            # Admitted here, in this order (stream() admits at once); read in tasks.
            if policy == "priority":
                # Long enough (3 s) that a loaded machine's poll still sees it running.
                low = params(150, seed=1, delay=0.02).replace(priority=5)
                nursery.start_soon(read, engine.stream("p", low, request_id="low"))
                await poll_until(lambda: (engine.progress("low") or (0, 0))[0] >= 2)
                high = params(2, seed=2).replace(priority=-5)
                nursery.start_soon(read, engine.stream("p", high, request_id="high"))
            else:
                small = params(3, seed=1, delay=0.02)
                nursery.start_soon(read, engine.stream("p", small, request_id="s0"))
                await poll_until(lambda: engine.progress("s0") is not None)
                for index in range(1, 6):
                    sp = small.replace(seed=index)
                    nursery.start_soon(read, engine.stream("p", sp, request_id=f"s{index}"))
                big = params(3, seed=9, delay=0.02).replace(height=64, width=64)
                nursery.start_soon(read, engine.stream("p", big, request_id="big"))
    assert all(out.ok for out in results.values()), results
    if policy == "priority":
        assert finished == ["high", "low"], finished
        assert decode_echo_image(results["low"].images[0]) == ("low", 1, 0)
        assert decode_echo_image(results["high"].images[0]) == ("high", 2, 0)
    else:
        assert finished.index("big") < len(finished) - 1, finished


def _picture(side: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)


@pytest.mark.parametrize("step", [False, True], ids=["request", "step"])
async def test_pictures_travel_to_worker_processes_in_both_modes(
    backend: str, cache_dir: Path, step: bool
) -> None:
    """Image-to-image and inpainting on worker processes (builtin:shapes, whose VAE is the
    identity): the picture and the mask reach the worker with the request (a big picture
    through shared memory), inpainting gives the picture back outside the mask exactly,
    image-to-image and a text request beside them give what they give in this process."""
    import torch

    from omni_trio.models import load_model

    picture = _picture(32, 1)
    mask = np.zeros((32, 32), np.uint8)
    mask[8:24, 8:24] = 255
    common = {"num_inference_steps": 8, "output_type": "np"}
    big = _picture(640, 4)  # 1.2 MB: over the shared-memory threshold, resized to 32x32
    requests = {
        "image": SamplingParams(image=big, strength=0.6, seed=1, height=32, width=32, **common),
        "inpaint": SamplingParams(image=picture, mask_image=mask, strength=0.8, seed=2, **common),
        "text": SamplingParams(seed=3, **common),
    }
    results: dict[str, Any] = {}
    with trio.fail_after(CAP_S):
        async with (
            engine_on(backend, cache_dir, model="builtin:shapes", step_execution=step) as engine,
            trio.open_nursery() as nursery,
        ):

            async def one(name: str) -> None:
                results[name] = await engine.generate("a blue square", requests[name])

            for name in requests:
                nursery.start_soon(one, name)
    assert all(out.ok and len(out.images) == 1 for out in results.values()), results
    keep = mask == 0
    painted = results["inpaint"].images[0]
    original = picture.astype(np.float32) / 255
    assert float(np.abs(painted[keep] - original[keep]).max()) < 1e-6
    assert float(np.abs(painted[~keep] - original[~keep]).mean()) > 0.05
    local = load_model(
        "builtin:shapes",
        device=torch.device("cpu"),
        dtype=torch.float32,
        cache_dir=cache_dir,
        options={},
    )
    try:
        expected = {}
        for name, seed in (("image", 1), ("text", 3)):
            req = DiffusionRequest("a blue square", requests[name], name)
            [[expected[name]]] = local.generate(
                [req],
                [torch.Generator().manual_seed(seed)],
                output_type="np",
                on_step=lambda s, t: None,
            )
    finally:
        local.close()
    for name in ("image", "text"):
        np.testing.assert_allclose(results[name].images[0], expected[name], atol=1e-4)
    assert float(np.abs(expected["text"] - expected["image"]).mean()) > 0.05


async def test_what_the_engine_sent_and_no_worker_read_is_unlinked_with_the_group(
    cache_dir: Path,
) -> None:
    """tractor: what the engine sends through shared memory (a request's big picture) carries
    the group's own tag; a segment a worker never decoded (it died first) is unlinked when
    the group ends, and a message that could not be sent is discarded at once."""
    from omni_trio.executors.tractor_executor import TractorTransport
    from omni_trio.ipc import SegmentRegistry, discard, list_our_segments, pack_array

    with trio.fail_after(CAP_S):
        async with engine_on("tractor", cache_dir) as engine:
            transport = group(engine).transport
            assert isinstance(transport, TractorTransport)
            tag = transport.sent_shm_tag
            assert tag.startswith(transport.shm_tag(0).split("w", 1)[0])  # the owner's tag
            # As if a message went out and its worker died before reading it.
            unread = pack_array(np.ones(400_000), registry=SegmentRegistry(tag))
            assert not isinstance(unread, np.ndarray) and unread.name in list_our_segments()
            # A big picture really travels (decoded and unlinked by the worker).
            big = SamplingParams(
                image=_picture(640, 5), num_inference_steps=2, seed=1, height=32, width=32
            )
            assert (await engine.generate("p", big)).ok
            assert [n for n in list_our_segments() if tag in n] == [unread.name]
    try:
        assert unread.name not in list_our_segments()
    finally:
        if unread.name in list_our_segments():
            discard(unread)
