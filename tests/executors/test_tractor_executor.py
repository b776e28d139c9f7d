"""The tractor backend (one worker process per rank) against the engine's contract.

- The core engine behaviours run on ``inproc``, ``tractor`` and ``ray`` (against the local
  Ray of the ``ray_cluster`` fixture) through the ``backend`` fixture: concurrent requests
  keep their identity, seeds reproduce, aborts (waiting, running, consumer dropped) really
  stop the worker's compute, close ends pending requests, RPCs run between batches, step
  mode runs a whole lifecycle.
- Then what only a multi-process group has: rank-aware replies and boxed per-rank errors, a
  model that fails to load in the worker, a worker killed mid-forward or while idle, the root
  process killed (no orphan may survive it), and one runtime per process.

Aborts are checked where the compute happens: every worker counts its denoising steps, and
the test reads the count (:func:`worker_steps`) after the aborted forward must have returned.
A forward that kept running would add its remaining steps and hold the worker for seconds.

Every test is capped with ``trio.fail_after`` and must leave no worker process: besides the
autouse leak check of ``tests/conftest.py`` (threads, shared memory), :func:`_no_worker_processes`
fails a test that leaves a worker process descended from this one (a ``tractor._child``
process, a child of a fork server, or any unreaped child), and :func:`engine_on` checks right
after each engine closed that its worker pids are gone.
Cross-process waits poll (the worker's progress reaches us only by heartbeat, once a second).

Worker start methods: the ``backend`` fixture's ``"tractor-forkserver"`` runs the core
behaviours with ``worker_start_method="forkserver"``; the death and killed-root tests take a
``start_method`` parameter.  ``OMNI_TRIO_TEST_WORKER_START_METHOD=forkserver`` makes every
other tractor engine of these files use forkserver too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import trio
import trio.testing

from omni_trio import (
    AsyncEngine,
    DiffusionOutput,
    EngineClosedError,
    EngineConfig,
    EngineDeadError,
    InvalidConfigError,
    RequestAbortedError,
    RequestFailedError,
    RequestStatus,
    SamplingParams,
    WorkerError,
    open_engine,
)
from omni_trio.executors.inproc import InprocExecutor
from omni_trio.executors.ray_executor import RayExecutor
from omni_trio.executors.tractor_executor import TractorExecutor
from omni_trio.ipc import (
    SegmentRegistry,
    ShmHandle,
    list_our_segments,
    owner_tag,
    pack_tensor,
)
from omni_trio.models.echo import (
    ECHO_EXIT_AT_STEP,
    ECHO_EXIT_CODE,
    ECHO_STEP_DELAY_S,
    decode_echo_image,
)

pytestmark = pytest.mark.slow

S = RequestStatus
CAP_S = 60.0
# A long forward: 500 steps of 20 ms (10 s) that an abort or a failure must cut short.
LONG_STEPS = 500
STEP_S = 0.02
# A worker's death must reach the requests in flight this fast (pidfd watch, no polling).
DEATH_NOTICE_S = 1.0
POLL_S = 0.01


def params(steps: int = 2, *, delay: float | None = None, **kw: Any) -> SamplingParams:
    kw.setdefault("height", 32)
    kw.setdefault("width", 32)
    if delay is not None:
        kw["extra_args"] = {ECHO_STEP_DELAY_S: delay}
    return SamplingParams(num_inference_steps=steps, **kw)


def long_params(**kw: Any) -> SamplingParams:
    return params(LONG_STEPS, delay=STEP_S, **kw)


# ---------------------------------------------------------------------------------------
# Processes: /proc scanning (no psutil).
# ---------------------------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of ``pid``, or None if there is no such process."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    state, ppid = data.rsplit(")", 1)[1].split()[:2]
    return state, int(ppid)


def _exists(pid: int) -> bool:
    """The process is there at all (a zombie not yet reaped counts)."""
    return _stat(pid) is not None


def _running(pid: int) -> bool:
    """The process still runs code (a zombie does not; nobody may reap one whose parent
    died, e.g. where PID 1 is not an init that reaps)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


FORKSERVER_CMDLINE = b"tractor._forkserver_override"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _environ(pid: int) -> list[bytes]:
    """``NAME=value`` entries of the environment process ``pid`` started with."""
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def _processes() -> dict[int, tuple[str, int]]:
    """pid -> (state, ppid) of every process now."""
    found: dict[int, tuple[str, int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                found[int(entry.name)] = stat
    return found


def _descendants(root: int, table: dict[int, tuple[str, int]]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (_, ppid) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _fork_servers(root: int) -> set[int]:
    """Fork servers (tractor's patched stdlib one) among the descendants of ``root``."""
    return {pid for pid in _descendants(root, _processes()) if _is_fork_server(pid)}


def _is_fork_server(pid: int) -> bool:
    """A fork server runs ``-c 'from tractor._forkserver_override import main; ...'``; the
    workers it forks keep that command line, so: that command line, a different parent."""
    stat = _stat(pid)
    return (
        stat is not None
        and FORKSERVER_CMDLINE in _cmdline(pid)
        and FORKSERVER_CMDLINE not in _cmdline(stat[1])
    )


def _worker_children() -> set[int]:
    """Worker processes descended from this process, or unreaped (zombie) children of it.

    A worker is a ``tractor._child`` process (start method ``trio``: our child) or a child
    of a fork server (``forkserver``: the fork server's child, our grandchild).  The fork
    server itself is not a worker: it is the stdlib's, started by the first forkserver
    engine and kept for the life of this process (it ends when this process does, see
    :func:`test_the_fork_server_ends_with_the_engine_process`); neither is multiprocessing's
    resource tracker.
    """
    me = os.getpid()
    table = _processes()
    found: set[int] = set()
    for pid in _descendants(me, table):
        state, ppid = table[pid]
        zombie = ppid == me and state == "Z"
        trio_worker = b"tractor._child" in _cmdline(pid)
        forked_worker = FORKSERVER_CMDLINE in _cmdline(pid) and FORKSERVER_CMDLINE in _cmdline(ppid)
        if zombie or trio_worker or forked_worker:
            found.add(pid)
    return found


def _threads_and_shm(pid: int) -> tuple[int, list[str]]:
    """(threads of ``pid``, its mappings of files in /dev/shm)."""
    threads = len(list(Path(f"/proc/{pid}/task").iterdir()))
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return threads, [line for line in maps if "/dev/shm" in line]


@pytest.fixture(autouse=True)
def _no_worker_processes() -> Iterator[None]:
    before = _worker_children()
    yield
    left = _worker_children() - before
    assert not left, f"test left worker processes: {sorted(left)}"


async def poll_until(predicate: Callable[[], bool]) -> None:
    """Wait until ``predicate()`` holds.  What happens in another process reaches this one
    only through heartbeats and pids, never as an event to wait on, so this polls."""
    while True:
        if predicate():
            return
        await trio.sleep(POLL_S)


async def wait_until_gone(pids: Iterable[int], *, timeout: float) -> None:
    """Until none of ``pids`` runs (zombies count as gone: they run nothing)."""
    pids = list(pids)
    with trio.fail_after(timeout):
        await poll_until(lambda: not any(_running(pid) for pid in pids))


# ---------------------------------------------------------------------------------------
# Engines.
# ---------------------------------------------------------------------------------------


# The start method of a tractor engine whose test does not choose one.
DEFAULT_START_METHOD = os.environ.get("OMNI_TRIO_TEST_WORKER_START_METHOD", "trio")
START_METHODS = ["trio", "forkserver"]


@pytest.fixture(
    params=["inproc", "tractor", "tractor-forkserver", pytest.param("ray", marks=pytest.mark.slow)]
)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")  # a local Ray the engine joins
    return str(request.param)


def worker_pids(engine: AsyncEngine) -> list[int]:
    executor = engine.executor
    if isinstance(executor, TractorExecutor | RayExecutor):
        return sorted(executor.worker_pids().values())
    return []


@asynccontextmanager
async def engine_on(backend: str, cache_dir: Path, **overrides: Any) -> AsyncIterator[AsyncEngine]:
    """An echo engine; on the way out (normal exit), checks its worker processes are gone.
    ``backend="tractor-forkserver"``: tractor with ``worker_start_method="forkserver"``."""
    if backend == "tractor-forkserver":
        backend = "tractor"
        overrides.setdefault("worker_start_method", "forkserver")
    if backend == "tractor":
        overrides.setdefault("worker_start_method", DEFAULT_START_METHOD)
    overrides.setdefault("torch_threads", 1)
    overrides.setdefault("warmup", False)
    # The process layer is under test here: every worker is a full replica (CFG parallelism
    # between two ranks has its own tests).
    overrides.setdefault("cfg_parallel", False)
    config = EngineConfig(backend=backend, cache_dir=str(cache_dir), **overrides)
    async with open_engine(config) as engine:
        pids = worker_pids(engine)
        assert len(pids) == (config.num_workers if backend in ("tractor", "ray") else 0)
        yield engine
    # Reaped, not just dead: close waits for its processes.
    assert not [pid for pid in pids if _exists(pid)], "close left worker processes"


async def worker_steps(engine: AsyncEngine) -> int:
    """Denoising steps rank 0 has run so far, read after every earlier forward returned.

    The ping is queued behind the forward in flight (RPCs run between batches) and, on
    tractor, its reply carries the worker's step count as of the end of the call.
    """
    await engine.collective_rpc("ping")
    executor = engine.executor
    if isinstance(executor, TractorExecutor | RayExecutor):
        return executor.worker_steps()[0]
    assert isinstance(executor, InprocExecutor)
    worker = executor._worker
    assert worker is not None
    return worker.steps_done


async def wait_running(engine: AsyncEngine, request_id: str) -> None:
    """Until the worker reports a computed step of ``request_id``."""
    await poll_until(lambda: engine.progress(request_id) is not None)


async def wait_scheduled(engine: AsyncEngine, count: int = 1) -> None:
    """Until the engine has ``count`` requests in its forward (sent to the workers)."""
    await poll_until(lambda: engine.statistics().running >= count)


async def terminal(stream: Any) -> DiffusionOutput:
    async with stream:
        outs = [out async for out in stream]
    assert outs and outs[-1].finished
    return outs[-1]


# ---------------------------------------------------------------------------------------
# The engine's core behaviours, on every backend.
# ---------------------------------------------------------------------------------------


async def test_concurrent_requests_each_get_their_own_reproducible_result(
    backend: str, cache_dir: Path
) -> None:
    results: dict[int, DiffusionOutput] = {}
    with trio.fail_after(CAP_S):
        async with engine_on(backend, cache_dir, max_num_seqs=4) as engine:

            async def run(i: int) -> None:
                results[i] = await engine.generate(
                    f"prompt {i}", params(seed=1000 + i), request_id=f"req-{i}"
                )

            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(run, i)
            stats = engine.statistics()
            a = await engine.generate("p", params(seed=77, output_type="np"), request_id="x")
            b = await engine.generate("p", params(seed=77, output_type="np"), request_id="x")
            c = await engine.generate("p", params(seed=78, output_type="np"), request_id="x")
            # Steps count per forward, not per request: five fused waves of four, then three
            # single forwards, two steps each; nothing ran twice.
            assert await worker_steps(engine) == 2 * (5 + 3)
    assert sorted(results) == list(range(20))
    for i, out in results.items():
        assert out.ok and out.seed == 1000 + i
        assert decode_echo_image(out.images[0]) == (f"req-{i}", 1000 + i, 0)
    assert (stats.finished_completed, stats.open_streams, stats.running) == (20, 0, 0)
    assert np.array_equal(a.images[0], b.images[0])
    assert not np.array_equal(a.images[0], c.images[0])


async def test_aborts_stop_the_workers_compute(backend: str, cache_dir: Path) -> None:
    """Waiting, running and consumer-dropped requests end at once, and a running forward
    stops inside the worker: it never runs all its steps nor holds the worker after."""
    with trio.fail_after(CAP_S):
        async with engine_on(backend, cache_dir) as engine:
            base = await worker_steps(engine)

            # A waiting request never runs; a running one stops at its next step.
            running = engine.stream("p", long_params(seed=1), request_id="running")
            waiting = engine.stream("p", long_params(seed=2), request_id="waiting")
            await wait_running(engine, "running")
            engine.abort("waiting")
            assert (await terminal(waiting)).status is S.FINISHED_ABORTED
            engine.abort("running")
            assert (await terminal(running)).status is S.FINISHED_ABORTED
            started = trio.current_time()
            nxt = await engine.generate("p", params(seed=3), request_id="next")
            # The worker was free at once: not after the seconds the aborted forward had left.
            assert trio.current_time() - started < 2.0
            assert decode_echo_image(nxt.images[0]) == ("next", 3, 0)
            steps = await worker_steps(engine) - base
            assert 1 <= steps - 2 < LONG_STEPS, steps  # "running" ran part of its steps

            # Cancelling the consumer (a caller's cancel scope) aborts and frees the slot.
            base = await worker_steps(engine)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    lambda: engine.generate("p", long_params(seed=4), request_id="dropped")
                )
                await wait_running(engine, "dropped")
                nursery.cancel_scope.cancel()
            stats = engine.statistics()
            assert (stats.finished_aborted, stats.running, stats.open_streams) == (3, 0, 0)
            assert 1 <= await worker_steps(engine) - base < LONG_STEPS

            # An aborted generate raises; the engine lives on.
            async with trio.open_nursery() as nursery:

                async def aborted() -> None:
                    with pytest.raises(RequestAbortedError):
                        await engine.generate("p", long_params(seed=5), request_id="aborted")

                nursery.start_soon(aborted)
                await wait_scheduled(engine)
                engine.abort("aborted")
            engine.check_health()


async def test_close_with_pending_requests_ends_them_and_the_forward(
    backend: str, cache_dir: Path
) -> None:
    errors: list[str] = []
    with trio.fail_after(CAP_S):
        async with engine_on(backend, cache_dir) as engine:

            async def run(name: str) -> None:
                with pytest.raises(EngineClosedError):
                    await engine.generate("p", long_params(), request_id=name)
                errors.append(name)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "running")
                await wait_running(engine, "running")
                nursery.start_soon(run, "waiting")
                await trio.testing.wait_all_tasks_blocked()
                started = trio.current_time()
                await engine.aclose()
                closed_in = trio.current_time() - started
            assert engine.is_closed
            with pytest.raises(EngineClosedError):
                engine.check_health()
            executor = engine.executor
    assert sorted(errors) == ["running", "waiting"]
    # Bounded by the forward's next step plus process teardown, not by its 10 s left.
    assert closed_in < 5.0, closed_in
    if isinstance(executor, TractorExecutor):
        # The worker stopped when asked (its forward ended at a step), it was not killed.
        assert executor.worker_exit_codes() == {0: 0}


async def test_an_rpc_runs_between_batches_and_replies_per_rank(
    backend: str, cache_dir: Path
) -> None:
    """An RPC issued during a forward runs after it and before the batch queued behind it.

    Checked with lower bounds on compute time, which no scheduling delay can shorten (when
    each consumer task wakes is up to trio, and outputs may be delivered after the next
    forward began): the RPC cannot return before the 0.8 s forward in flight is over, and the
    0.4 s forward queued behind the RPC must still be ahead when it returns."""
    with trio.fail_after(CAP_S):
        async with engine_on(backend, cache_dir) as engine:
            times: dict[str, float] = {}
            replies: list[Any] = []

            async def rpc() -> None:
                replies.append(await engine.collective_rpc("ping", unique_reply_rank=None))
                times["rpc"] = trio.current_time()

            first = engine.stream("p", params(40, delay=0.02, seed=1), request_id="first")
            async with trio.open_nursery() as nursery:
                await wait_scheduled(engine)
                times["issued"] = trio.current_time()
                nursery.start_soon(rpc)
                await trio.testing.wait_all_tasks_blocked()
                second = engine.stream("p", params(20, delay=0.02, seed=2), request_id="second")
                outs = [await terminal(first), await terminal(second)]
                times["second"] = trio.current_time()
    assert [o.ok for o in outs] == [True, True]
    assert times["rpc"] - times["issued"] > 0.4  # it waited for "first"'s forward
    assert times["second"] - times["rpc"] > 0.2  # "second" ran after it, not before
    [per_rank] = replies
    assert [r["rank"] for r in per_rank] == [0]
    assert all(r["loaded"] for r in per_rank)


async def test_step_mode_runs_a_whole_lifecycle(backend: str, cache_dir: Path) -> None:
    with trio.fail_after(CAP_S):
        async with engine_on(
            backend, cache_dir, step_execution=True, streaming_output=True, max_num_seqs=2
        ) as engine:
            streams = {
                name: engine.stream("p", params(steps, seed=seed), request_id=name)
                for name, steps, seed in [("a", 3, 1), ("b", 4, 2), ("c", 2, 3)]
            }
            outs: dict[str, list[DiffusionOutput]] = {}

            async def collect(name: str) -> None:
                async with streams[name] as stream:
                    outs[name] = [out async for out in stream]

            async with trio.open_nursery() as nursery:
                for name in streams:
                    nursery.start_soon(collect, name)
            # An aborted request leaves the running batch at a step boundary.
            victim = engine.stream("p", long_params(seed=4), request_id="victim")
            await wait_running(engine, "victim")
            engine.abort("victim")
            async with victim:
                victim_outs = [out async for out in victim]
            after = await engine.generate("p", params(2, seed=5), request_id="after")
    for name, steps, seed in [("a", 3, 1), ("b", 4, 2), ("c", 2, 3)]:
        chunks = outs[name]
        assert [c.chunk_index for c in chunks] == list(range(steps))
        assert [c.finished for c in chunks] == [False] * (steps - 1) + [True]
        assert chunks[-1].status is S.FINISHED_COMPLETED
        assert all(decode_echo_image(c.images[0]) == (name, seed, 0) for c in chunks)
    assert victim_outs[-1].status is S.FINISHED_ABORTED
    assert len(victim_outs) < LONG_STEPS
    assert decode_echo_image(after.images[0]) == ("after", 5, 0)


# ---------------------------------------------------------------------------------------
# Rank-aware replies and boxed remote errors.
# ---------------------------------------------------------------------------------------


async def test_rpc_replies_per_rank_and_boxes_each_ranks_error(cache_dir: Path) -> None:
    with trio.fail_after(CAP_S):
        async with engine_on("tractor", cache_dir, num_workers=2, max_num_seqs=2) as engine:
            executor = engine.executor
            assert isinstance(executor, TractorExecutor)
            pids = executor.worker_pids()
            assert executor.registry_addr is not None
            assert executor.registry_addr[1] != 1616  # never tractor's global default

            every = await engine.collective_rpc("ping", unique_reply_rank=None)
            assert [(r["rank"], r["pid"]) for r in every] == [(0, pids[0]), (1, pids[1])]
            assert (await engine.collective_rpc("describe", unique_reply_rank=1))["rank"] == 1
            assert (await engine.collective_rpc("ping"))["rank"] == 0  # the output rank

            with pytest.raises(WorkerError) as failed:
                await engine.collective_rpc("set_torch_threads", "x", unique_reply_rank=None)
            error = failed.value
            assert error.worker in (0, 1)
            assert error.error_type == "RuntimeError"
            assert "rank 0: RuntimeError" in str(error) and "rank 1: RuntimeError" in str(error)
            assert error.traceback_text is not None
            assert "Traceback (most recent call last)" in error.traceback_text
            assert "set_torch_threads" in error.traceback_text

            with pytest.raises(WorkerError, match="no RPC method 'nope'") as unknown:
                await engine.collective_rpc("nope")
            assert unknown.value.error_type == "AttributeError"

            # A failed RPC is the caller's problem, not the group's: it still serves.
            engine.check_health()
            outs = [
                await engine.generate("p", params(seed=i), request_id=f"r{i}") for i in range(2)
            ]
            assert [decode_echo_image(o.images[0]) for o in outs] == [("r0", 0, 0), ("r1", 1, 0)]
            assert executor.worker_steps() == {0: 4, 1: 4}  # both ranks ran both forwards


async def test_a_model_that_fails_to_load_in_the_worker_raises_invalid_config(
    cache_dir: Path,
) -> None:
    with trio.fail_after(CAP_S):
        with pytest.raises(
            InvalidConfigError, match="unknown built-in model 'builtin:nope'"
        ) as info:
            async with engine_on("tractor", cache_dir, model="builtin:nope", num_workers=2):
                pytest.fail("the engine must not start")  # pragma: no cover
    # The worker's refusal keeps the field it names (it comes in the handshake).
    assert info.value.field == "model"
    # The autouse check: no worker process is left.


async def test_a_start_sweeps_what_a_sigkilled_engine_left_in_shared_memory(
    cache_dir: Path,
) -> None:
    """Segments carry their engine's owner tag; an engine SIGKILLed with outputs in flight
    leaves them, and the next tractor start in any process unlinks them."""
    dead = await trio.lowlevel.open_process([sys.executable, "-c", "pass"])
    tag = owner_tag(dead.pid)
    await dead.wait()
    left = pack_tensor(torch.ones(4), threshold=0, registry=SegmentRegistry(f"{tag}w0ab"))
    assert isinstance(left, ShmHandle) and left.name in list_our_segments()
    with trio.fail_after(CAP_S):
        async with engine_on("tractor", cache_dir) as engine:
            assert left.name not in list_our_segments()
            tags = {engine.executor.transport.shm_tag(0)}  # type: ignore[attr-defined]
            assert all(t.startswith(owner_tag()) for t in tags)


def _stop_the_fork_server() -> None:
    """Stop this process's fork server, if one runs (the next forkserver engine starts a
    fresh one, from the environment of that moment)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is not None and getattr(server, "_forkserver_pid", None) is not None:
        server._stop()


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_workers_never_inherit_a_secret(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch, start_method: str
) -> None:
    """The daemon's API key and hub tokens stay in the engine process: a worker process's
    environment (as the kernel shows it) has none, and the engine's own is untouched.
    Under ``forkserver`` the fork server is started by this engine, with the secrets set
    (not reused from an earlier test): its environment, every forked worker's, has none
    either."""
    secrets_env = {"OMNI_TRIO_API_KEY": "sk-daemon", "HF_TOKEN": "hf_x", "MY_DB_PASSWORD": "p"}
    for name, value in secrets_env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OMNI_TRIO_HARMLESS", "1")
    if start_method == "forkserver":
        _stop_the_fork_server()
    with trio.fail_after(CAP_S):
        async with engine_on("tractor", cache_dir, worker_start_method=start_method) as engine:
            (pid,) = engine.executor.worker_pids().values()  # type: ignore[attr-defined]
            pids = [pid]
            if start_method == "forkserver":
                stat = _stat(pid)
                assert stat is not None and _is_fork_server(stat[1]), stat
                pids.append(stat[1])  # the fork server that forked it
            raws = [await trio.Path(f"/proc/{p}/environ").read_bytes() for p in pids]
    for raw in raws:
        names = {item.split(b"=", 1)[0].decode() for item in raw.split(b"\0") if item}
        assert not set(secrets_env) & names, set(secrets_env) & names
        assert "OMNI_TRIO_HARMLESS" in names
    assert {name: os.environ[name] for name in secrets_env} == secrets_env


# ---------------------------------------------------------------------------------------
# Worker death, without supervision (no restart, no retry): the failure itself is
# structured and prompt.  Restarts and retries: tests/executors/test_tractor_supervision.py.
# ---------------------------------------------------------------------------------------

UNSUPERVISED = {"max_worker_restarts": 0, "max_retries_on_worker_failure": 0}


async def test_a_worker_killed_mid_forward_fails_every_request_at_once(cache_dir: Path) -> None:
    """SIGKILL of rank 1 (not the output rank) while both ranks run a forward."""
    with trio.fail_after(CAP_S):
        async with engine_on("tractor", cache_dir, num_workers=2, **UNSUPERVISED) as engine:
            executor = engine.executor
            assert isinstance(executor, TractorExecutor)
            pids = executor.worker_pids()
            running = engine.stream("p", long_params(seed=1), request_id="running")
            generated: list[BaseException] = []

            async def generate_waiting() -> None:
                with pytest.raises(EngineDeadError) as info:
                    await engine.generate("p", long_params(seed=2), request_id="waiting")
                generated.append(info.value)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(generate_waiting)
                await wait_running(engine, "running")
                killed_at = trio.current_time()
                os.kill(pids[1], signal.SIGKILL)
                out = await terminal(running)
                noticed_in = trio.current_time() - killed_at
            assert noticed_in < DEATH_NOTICE_S, noticed_in
            # The running request fails at once (retryable); the rest when the engine dies.
            assert out.status is S.FINISHED_ERROR and out.error_type == "WorkerFailedError"
            assert out.error is not None
            assert "worker 1" in out.error and f"process {pids[1]}" in out.error
            assert "SIGKILL" in out.error
            assert "worker 1" in str(generated[0])
            with pytest.raises(EngineDeadError, match="worker 1"):
                engine.check_health()
            with trio.fail_after(0.5):
                with pytest.raises(EngineDeadError):
                    await engine.generate("p", params(), request_id="later")
            # The surviving rank is torn down too (the group failed closed), at once: a
            # failed group is killed, never asked (a hung worker would not answer).
            await wait_until_gone(pids.values(), timeout=5.0)
        assert trio.current_time() - killed_at < 5.0
        assert executor.worker_exit_codes() == {0: -signal.SIGKILL, 1: -signal.SIGKILL}


@pytest.mark.parametrize("start_method", START_METHODS)
@pytest.mark.parametrize("signame", ["SIGKILL", "SIGTERM"])
async def test_a_worker_that_dies_while_idle_kills_the_engine(
    cache_dir: Path, signame: str, start_method: str
) -> None:
    """The exit status is reported either way: a ``trio`` worker is our child (waitpid); a
    ``forkserver`` worker is the fork server's, which reports its status to tractor."""
    sig = signal.Signals[signame]
    with trio.fail_after(CAP_S):
        async with engine_on(
            "tractor", cache_dir, worker_start_method=start_method, **UNSUPERVISED
        ) as engine:
            executor = engine.executor
            assert isinstance(executor, TractorExecutor)
            [pid] = executor.worker_pids().values()
            assert (await engine.generate("p", params(seed=1), request_id="before")).ok
            os.kill(pid, sig)
            with trio.fail_after(DEATH_NOTICE_S):
                await poll_until(lambda: executor.is_dead)
            with trio.fail_after(DEATH_NOTICE_S):
                await poll_until(lambda: engine.is_dead)
            with pytest.raises(EngineDeadError, match=f"worker 0.*killed by {sig.name}"):
                engine.check_health()
            with trio.fail_after(0.5):
                with pytest.raises(EngineDeadError, match="worker 0"):
                    await engine.generate("p", params(), request_id="after")
            with pytest.raises(EngineDeadError):
                engine.stream("p", params(), request_id="later")
            await wait_until_gone([pid], timeout=5.0)
            assert executor.worker_exit_codes() == {0: -sig}


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_close_terminates_a_worker_that_does_not_stop_in_time(
    cache_dir: Path, start_method: str
) -> None:
    """Shutdown escalates: a forward stuck inside one step (a 30 s step stands for a hung
    kernel; stop flags are only read between steps) is asked to stop, given
    ``close_timeout_s``, then its process is terminated."""
    budget = 1.0
    with trio.fail_after(CAP_S):
        async with engine_on(
            "tractor", cache_dir, close_timeout_s=budget, worker_start_method=start_method
        ) as engine:
            stream = engine.stream("p", params(2, delay=30.0), request_id="stuck")
            await wait_running(engine, "stuck")
            started = trio.current_time()
            await engine.aclose()
            closed_in = trio.current_time() - started
            out = await terminal(stream)
            executor = engine.executor
            assert isinstance(executor, TractorExecutor)
    assert out.status is S.FINISHED_ABORTED and out.error_type == "EngineClosedError"
    # Ask (0.5 s ack timeout), the bounded wait, terminate: nowhere near the 30 s step.
    assert closed_in < budget + 3.0, closed_in
    assert executor.worker_exit_codes() == {0: -signal.SIGTERM}


# ---------------------------------------------------------------------------------------
# The root process dies: no worker may outlive it.
# ---------------------------------------------------------------------------------------

ROOT_SCRIPT = """
import json
import os
import sys

import trio


async def main(cache_dir: str, start_method: str, then: str, early: dict) -> None:
    from omni_trio import open_engine

    async with open_engine(
        model="builtin:echo",
        backend="tractor",
        num_workers=2,
        cfg_parallel=False,
        warmup=False,
        torch_threads=1,
        cache_dir=cache_dir,
        worker_start_method=start_method,
    ) as engine:
        pids = sorted(engine.executor.worker_pids().values())
        print(json.dumps({"root": os.getpid(), "workers": pids, **early}), flush=True)
        if then == "exit":  # a normal exit, once stdin closes
            await trio.to_thread.run_sync(sys.stdin.read)
            return
        await trio.sleep_forever()


# tractor re-runs this module in every worker: entry logic stays under the guard.
if __name__ == "__main__":
    early = {}
    if sys.argv[2] == "forkserver-early":  # as `omni-trio serve` does, before trio starts
        from omni_trio import EngineConfig
        from omni_trio.executors import tractor_executor as te

        config = EngineConfig(
            model="builtin:echo", backend="tractor", num_workers=2, worker_start_method="forkserver"
        )
        started = [te.start_fork_server_early(config), te.start_fork_server_early(config)]
        early = {"started": started, "server": te._forkserver_pid()}
        sys.argv[2] = "forkserver"
    trio.run(main, *sys.argv[1:], early)
"""


@asynccontextmanager
async def root_process(
    tmp_path: Path, cache_dir: Path, start_method: str, then: str = "sleep"
) -> AsyncIterator[tuple[trio.Process, dict[str, Any], Path]]:
    """An engine in a process of its own (ROOT_SCRIPT): yields the process, its first line
    (``{"root": pid, "workers": [pids]}``) and its stderr file.  Anything left is killed."""
    script = tmp_path / "root.py"
    script.write_text(textwrap.dedent(ROOT_SCRIPT))
    stderr = tmp_path / "stderr.txt"
    with stderr.open("wb") as err:
        proc = await trio.lowlevel.open_process(
            [sys.executable, str(script), str(cache_dir), start_method, then],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
        )
        info: dict[str, Any] = {"workers": []}
        others: set[int] = set()
        try:
            assert proc.stdout is not None
            line = b""
            while not line.endswith(b"\n"):
                chunk = await proc.stdout.receive_some()
                assert chunk, f"root exited early: {stderr.read_text()[-2000:]}"
                line += chunk
            info = json.loads(line)
            assert info["root"] == proc.pid and len(info["workers"]) == 2
            others = _descendants(proc.pid, _processes()) - set(info["workers"])
            yield proc, info, stderr
        finally:
            if proc.returncode is None:
                proc.kill()
                with trio.CancelScope(shield=True):
                    await proc.wait()
            for pid in [*info["workers"], *others]:
                if _running(pid):
                    os.kill(pid, signal.SIGKILL)
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    await stream.aclose()


@pytest.mark.parametrize("start_method", START_METHODS)
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGKILL"])
async def test_no_worker_outlives_a_killed_root(
    tmp_path: Path, cache_dir: Path, signame: str, start_method: str
) -> None:
    """Only the root's pid is signalled (plain ``kill``, systemd ``KillMode=process``).
    SIGTERM: the executor stops its workers gracefully, then the root dies of the SIGTERM.
    SIGKILL: each worker's watch of the engine's pid takes it down with the root.  With
    ``forkserver`` the workers are children of the fork server, not of the root, and the
    fork server (the root's child) goes too, once the root and its workers are gone."""
    sig = signal.Signals[signame]
    with trio.fail_after(CAP_S):
        async with root_process(tmp_path, cache_dir, start_method) as (proc, info, stderr):
            workers = info["workers"]
            servers = _fork_servers(proc.pid)
            for pid in workers:
                stat = _stat(pid)
                assert stat is not None
                if start_method == "trio":
                    assert stat[1] == proc.pid  # the root's own children
                else:
                    assert servers == {stat[1]}  # the fork server's children
            assert len(servers) == (1 if start_method == "forkserver" else 0)
            assert all(_stat(server)[1] == proc.pid for server in servers)  # type: ignore[index]
            os.kill(proc.pid, sig)
            with trio.fail_after(5.0):
                assert await proc.wait() == -sig
            await wait_until_gone(workers, timeout=5.0)
            await wait_until_gone(servers, timeout=5.0)
            if sig is signal.SIGTERM:
                assert "SIGTERM: stopping the worker processes" in stderr.read_text()


async def test_the_fork_server_ends_with_the_engine_process(
    tmp_path: Path, cache_dir: Path
) -> None:
    """The fork server is the stdlib's: one per process, kept while the process lives (for
    every later restart), single-threaded, holding no shared memory of ours; it ends when
    the process that started it exits (it reads EOF on the pipe every client holds)."""
    with trio.fail_after(CAP_S):
        async with root_process(tmp_path, cache_dir, "forkserver", then="exit") as (
            proc,
            info,
            _,
        ):
            [server] = _fork_servers(proc.pid)
            assert _threads_and_shm(server) == (1, [])
            assert proc.stdin is not None
            await proc.stdin.aclose()  # the root closes its engine and exits normally
            with trio.fail_after(10.0):
                assert await proc.wait() == 0
            await wait_until_gone([server, *info["workers"]], timeout=5.0)


async def test_a_fork_server_started_early_is_the_one_the_engine_forks_from(
    tmp_path: Path, cache_dir: Path
) -> None:
    """``start_fork_server_early`` (``omni-trio serve`` calls it once its configuration is
    read) starts the server without waiting for its preload; the engine opened later finds
    it and forks its workers from it instead of starting another.  A second call does
    nothing."""
    with trio.fail_after(CAP_S):
        async with root_process(tmp_path, cache_dir, "forkserver-early") as (proc, info, _):
            assert info["started"] == [True, False]
            assert _fork_servers(proc.pid) == {info["server"]}
            for pid in info["workers"]:
                stat = _stat(pid)
                assert stat is not None and stat[1] == info["server"]
            # The environment the engine would have given it (every worker inherits it).
            environ = _environ(info["server"])
            assert b"PYTHONBREAKPOINT=tractor._debug._set_trace" in environ
            warnings = [e for e in environ if e.startswith(b"PYTHONWARNINGS=")]
            assert warnings and b"ignore::FutureWarning" in warnings[0]


def test_a_fork_server_starts_early_only_where_the_engine_would_start_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import multiprocessing

    from omni_trio.executors import tractor_executor as te

    server = te._forkserver_pid()
    monkeypatch.setattr(te, "cuda_possible", lambda: True)
    for config in (
        EngineConfig(backend="inproc"),
        EngineConfig(backend="tractor", num_workers=2, worker_start_method="trio"),
        EngineConfig(backend="tractor", num_workers=2, worker_start_method="auto"),  # CUDA?
    ):
        assert te.start_fork_server_early(config) is False
    monkeypatch.setattr(te, "cuda_possible", lambda: False)
    forked = EngineConfig(backend="tractor", num_workers=2, worker_start_method="forkserver")
    # Only the main process may start one (the engine would refuse in a child).
    monkeypatch.setattr(multiprocessing.current_process(), "name", "Child-1")
    assert te.start_fork_server_early(forked) is False
    assert te._forkserver_pid() == server  # none started


def test_a_stage_forks_only_an_inproc_engine_whose_workers_may_fork(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stage process of an inproc engine is the process that runs the model: forked from
    the fork server where a worker of it would be; a stage of a tractor or Ray engine is a
    new interpreter (its workers need a main process of their own), and so is one where
    CUDA may be used or the start method says ``trio``."""
    import multiprocessing

    from omni_trio.executors import tractor_executor as te

    monkeypatch.setattr(te, "cuda_possible", lambda: False)
    assert te.stage_forks(EngineConfig(worker_start_method="auto"))
    assert te.stage_forks(EngineConfig(worker_start_method="forkserver", device="cpu"))
    assert not te.stage_forks(EngineConfig())  # the library's default: trio
    for backend in ("tractor", "ray"):
        assert not te.stage_forks(EngineConfig(backend=backend, worker_start_method="auto"))
    monkeypatch.setattr(te, "cuda_possible", lambda: True)
    assert not te.stage_forks(EngineConfig(worker_start_method="auto"))  # a GPU may be picked
    assert te.stage_forks(EngineConfig(worker_start_method="auto", device="cpu"))
    monkeypatch.setattr(multiprocessing.current_process(), "name", "Child-1")
    assert not te.stage_forks(EngineConfig(worker_start_method="auto", device="cpu"))


def test_worker_start_method_is_validated() -> None:
    assert EngineConfig().worker_start_method == "trio"
    assert EngineConfig(worker_start_method="forkserver").worker_start_method == "forkserver"
    for bad in ("fork", "spawn", "", None, 1):
        with pytest.raises(InvalidConfigError, match="worker_start_method") as info:
            EngineConfig(worker_start_method=bad)  # type: ignore[arg-type]
        assert info.value.field == "worker_start_method"


def test_auto_forks_from_a_fork_server_only_where_that_is_safe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import multiprocessing

    from omni_trio.executors import tractor_executor as te

    assert EngineConfig(worker_start_method="auto").worker_start_method == "auto"
    for method in ("trio", "forkserver"):  # named: as named
        assert te.resolve_start_method(method, "cuda") == method
    monkeypatch.setattr(te, "cuda_possible", lambda: False)
    assert te.resolve_start_method("auto", None) == "forkserver"
    assert te.resolve_start_method("auto", "cpu") == "forkserver"
    assert te.resolve_start_method("auto", "cuda:1") == "trio"  # CUDA next to a fork: untested
    monkeypatch.setattr(te, "cuda_possible", lambda: True)
    assert te.resolve_start_method("auto", None) == "trio"  # None may pick a GPU
    assert te.resolve_start_method("auto", "cpu") == "forkserver"  # told: CPU only
    # The fork server starts only from the main process.
    monkeypatch.setattr(multiprocessing.current_process(), "name", "Child-1")
    assert te.resolve_start_method("auto", "cpu") == "trio"


# ---------------------------------------------------------------------------------------
# Several engines in one process.
# ---------------------------------------------------------------------------------------


async def test_engines_in_one_process_each_get_their_own_runtime(cache_dir: Path) -> None:
    """One after the other, each engine opens its own registry on its own free port.  At the
    same time is refused: tractor 0.1.0a5 has one runtime per process, owned by the engine
    that opened it, and a second engine would lose its workers when the first closed."""
    seen: list[tuple[tuple[str, int] | None, list[int]]] = []
    with trio.fail_after(CAP_S):
        for i in range(2):
            async with engine_on("tractor", cache_dir) as engine:
                executor = engine.executor
                assert isinstance(executor, TractorExecutor)
                seen.append((executor.registry_addr, worker_pids(engine)))
                out = await engine.generate("p", params(seed=9, output_type="np"), request_id="s")
                assert decode_echo_image(out.images[0]) == ("s", 9, 0)
                if i == 1:
                    started = trio.current_time()
                    with pytest.raises(InvalidConfigError, match="one runtime per process"):
                        async with engine_on("tractor", cache_dir):
                            pytest.fail("a second concurrent tractor engine must be refused")
                    assert trio.current_time() - started < 1.0
                    # The refusal did not disturb the running engine.
                    engine.check_health()
                    again = await engine.generate("p", params(seed=9), request_id="t")
                    assert decode_echo_image(again.images[0]) == ("t", 9, 0)
    (addr_a, pids_a), (addr_b, pids_b) = seen
    assert addr_a is not None and addr_b is not None
    assert addr_a != addr_b and 1616 not in (addr_a[1], addr_b[1])
    assert not set(pids_a) & set(pids_b)


@pytest.mark.parametrize(
    ("group", "start_method"),
    [
        ("tractor", "trio"),
        ("tractor", "forkserver"),
        pytest.param("ray", None, marks=pytest.mark.slow),
    ],
)
async def test_two_workers_run_cfg_parallel_and_match_one_worker(
    cache_dir: Path, group: str, start_method: str | None, request: pytest.FixtureRequest
) -> None:
    """tiny-sd with guidance on 2 tractor workers (or 2 Ray actors, whose torch.distributed
    rendezvous is on the rank-0 actor's host): each rank computes one CFG branch per step
    (exchanged over gloo) and the image equals the inproc single-worker one within 1e-4."""
    overrides: dict[str, Any] = {}
    if group == "ray":
        request.getfixturevalue("ray_cluster")
    else:
        overrides["worker_start_method"] = start_method
    sampling = SamplingParams(
        height=32,
        width=32,
        num_inference_steps=6,
        seed=11,
        guidance_scale=7.5,
        negative_prompt="blurry",
        output_type="np",
    )
    with trio.fail_after(120):
        async with engine_on("inproc", cache_dir, model="builtin:tiny-sd") as engine:
            alone = await engine.generate("a red circle", sampling, request_id="alone")
        async with engine_on(
            group,
            cache_dir,
            model="builtin:tiny-sd",
            num_workers=2,
            cfg_parallel=True,
            **overrides,
        ) as engine:
            described = await engine.collective_rpc("describe", unique_reply_rank=None)
            split = await engine.generate("a red circle", sampling, request_id="split")
    assert [d["cfg_parallel"] for d in described] == [True, True]
    assert np.abs(alone.images[0] - split.images[0]).max() <= 1e-4


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_async_outputs_over_tractor_move_large_images_through_shared_memory(
    cache_dir: Path, start_method: str
) -> None:
    """Request mode with async output: rank 0's packer sends OUTPUT_READY on its stream; a
    12 MB output travels as a shared-memory segment that the executor unlinks on receipt."""
    big = SamplingParams(height=1024, width=1024, num_inference_steps=1, seed=1, output_type="np")
    with trio.fail_after(CAP_S):
        async with engine_on(
            "tractor",
            cache_dir,
            async_output=True,
            max_num_seqs=2,
            worker_start_method=start_method,
        ) as engine:
            executor = engine.executor
            assert isinstance(executor, TractorExecutor) and executor._pump is not None
            out = await engine.generate("p", big, request_id="big")
            small = await engine.generate("p", params(seed=4), request_id="small")
            stats = executor._pump.statistics()
            assert list_our_segments() == []
    assert out.images[0].shape == (1024, 1024, 3)
    assert decode_echo_image(out.images[0]) == ("big", 1, 0)
    assert decode_echo_image(small.images[0]) == ("small", 4, 0)
    assert (stats.waiting_outputs, stats.cached_outputs, stats.unsplit_batches) == (0, 0, 0)


async def test_a_worker_killed_while_outputs_are_in_flight_leaves_no_shared_memory(
    cache_dir: Path,
) -> None:
    big = SamplingParams(height=1024, width=1024, num_inference_steps=2, seed=1, output_type="np")
    with trio.fail_after(CAP_S):
        async with engine_on(
            "tractor", cache_dir, async_output=True, max_num_seqs=1, **UNSUPERVISED
        ) as engine:
            executor = engine.executor
            assert isinstance(executor, TractorExecutor)
            pid = executor.worker_pids()[0]
            outcomes: list[str] = []

            async def one(i: int) -> None:
                try:
                    await engine.generate("p", big.replace(seed=i), request_id=f"big-{i}")
                    outcomes.append("ok")
                except (EngineDeadError, RequestFailedError):
                    outcomes.append("dead")

            async with trio.open_nursery() as nursery:
                for i in range(6):
                    nursery.start_soon(one, i)
                await poll_until(lambda: len(outcomes) >= 1)
                os.kill(pid, signal.SIGKILL)
            assert "dead" in outcomes and len(outcomes) == 6
        await wait_until_gone([pid], timeout=5.0)
    assert list_our_segments() == []


@pytest.mark.parametrize("start_method", START_METHODS)
async def test_a_worker_that_exits_mid_forward_is_reported_with_its_exit_code(
    cache_dir: Path, start_method: str
) -> None:
    """``os._exit`` inside the worker (echo's crash injection) during a forward."""
    crash = params(4, seed=1, extra_args={ECHO_EXIT_AT_STEP: 2})
    with trio.fail_after(CAP_S):
        async with engine_on(
            "tractor", cache_dir, worker_start_method=start_method, **UNSUPERVISED
        ) as engine:
            executor = engine.executor
            assert isinstance(executor, TractorExecutor)
            pid = executor.worker_pids()[0]
            with pytest.raises(RequestFailedError, match=f"exit code {ECHO_EXIT_CODE}"):
                await engine.generate("p", crash, request_id="crash")
            with trio.fail_after(DEATH_NOTICE_S * 5):
                await poll_until(lambda: engine.is_dead)
            with pytest.raises(EngineDeadError, match="worker 0"):
                engine.check_health()
        await wait_until_gone([pid], timeout=5.0)
    assert executor.worker_exit_codes() == {0: ECHO_EXIT_CODE}
    assert list_our_segments() == []


async def test_workers_outlive_the_helper_thread_that_spawned_them(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """trio forks workers from cached helper threads that retire when idle; a worker must be
    tied to the engine *process*, not to that thread (PR_SET_PDEATHSIG would kill it)."""
    from trio._core import _thread_cache

    monkeypatch.setattr(_thread_cache, "IDLE_TIMEOUT", 0.2)  # retire idle helpers fast

    def helper_threads() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("Trio thread")]

    with trio.fail_after(CAP_S):
        async with engine_on("tractor", cache_dir) as engine:
            pid = worker_pids(engine)[0]
            await poll_until(lambda: not helper_threads())  # the spawning thread is gone
            out = await engine.generate("p", params(seed=9), request_id="later")
            assert _running(pid)
    assert decode_echo_image(out.images[0]) == ("later", 9, 0)
