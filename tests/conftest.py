"""Test-wide settings and leak checks.

Every test must leave nothing of the runtime behind (INV-3): the autouse fixture below fails a
test that leaves a Python thread running (idle threads of trio's own thread cache excepted) or
a shared-memory segment named ``*omni*`` in ``/dev/shm``.  Torch is held to one thread so the
suite behaves the same on small machines.  A test that starts a process must be in a module
marked ``slow`` (:mod:`tests.spawn_guard`), so ``make test-fast`` (``-m "not slow"``) starts
none.  After collection, what is loaded is frozen out of the garbage collector's reach
(:func:`pytest_collection_finish`), so the runtime's ``gc.collect()`` calls stay cheap.
"""

from __future__ import annotations

import os

# Before torch is imported anywhere: one intra-op thread per process.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("MKL_NUM_THREADS", "1")
# Before ray is imported anywhere: a local Ray keeps its own traffic on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import gc
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.spawn_guard import spawns_are_marked_slow as spawns_are_marked_slow

# A thread the runtime started gets this long to finish exiting after its owner closed.
_THREAD_JOIN_S = 5.0
_SHM = Path("/dev/shm")
# Threads of session-long services the tests start (the local Ray's driver threads): they
# live until the session ends, so no test owns them.
_SESSION_THREADS: set[threading.Thread] = set()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what collection imported (torch, diffusers, every test module) out of the
    garbage collector's reach: the runtime's ``gc.collect()`` calls (a runner releasing its
    model) then scan only what tests create, ~0 s instead of ~0.5 s each."""
    gc.collect()
    gc.freeze()


def _torch_one_thread() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def _disable_tqdm_monitor() -> None:
    # tqdm's monitor thread outlives every progress bar; it is not ours and would look leaked.
    tqdm = sys.modules.get("tqdm")
    if tqdm is not None:
        tqdm.tqdm.monitor_interval = 0


def _idle_trio_cache_threads() -> set[threading.Thread]:
    """Threads of trio's own worker-thread cache that are idle (running nothing).

    trio keeps a thread for ~10 s after a ``trio.to_thread`` call, and
    ``trio.lowlevel.open_process`` (tractor's spawn) forks through one.  An idle one runs
    nothing of ours; a busy one (a ``to_thread`` call still running) is not in this set and
    still counts as a leak.  Private trio API (trio is pinned); without it nothing is excused.
    """
    try:
        from trio._core._thread_cache import THREAD_CACHE
    except ImportError:  # pragma: no cover - another trio layout
        return set()
    return {worker._thread for worker in list(THREAD_CACHE._idle_workers)}


def _shm_entries() -> set[str]:
    """Our shared-memory segments that this test session may have made: untagged ones,
    those whose owner is gone, and those of this process or its descendants (workers, a
    local Ray) -- never a segment another live program on the machine owns (a benchmark
    or a campaign beside the suite)."""
    if not _SHM.is_dir():
        return set()
    return {p.name for p in _SHM.iterdir() if "omni" in p.name and _maybe_ours(p.name)}


def _maybe_ours(name: str) -> bool:
    from omni_trio.ipc.shm import owner_of

    pid = owner_of(name)
    for _ in range(64):  # up the parent chain to init
        if pid is None or pid == os.getpid():
            return True
        if pid <= 1:
            return False
        pid = _parent_of(pid)
    return False


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None  # gone meanwhile: as a gone owner, count it


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model cache for the whole session (built-in models materialise here once)."""
    return tmp_path_factory.mktemp("omni-trio-cache")


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """A local Ray for the ``ray`` backend's tests, started once, by the first test that
    needs it, and stopped at the end: 4 (logical) CPUs, no dashboard, its own short temp dir (Ray's
    socket paths must fit in 107 bytes), every address on loopback.  Yields the ``ray``
    module; engines reuse this initialised Ray."""
    from omni_trio.errors import InvalidConfigError
    from omni_trio.executors.ray_executor import import_ray

    try:
        ray = import_ray()  # sets RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 first
    except InvalidConfigError:
        pytest.skip("the ray extra is not installed")
    temp_dir = tempfile.mkdtemp(prefix="omni-ray-", dir="/tmp")
    before = set(threading.enumerate())
    ray.init(
        num_cpus=4,  # logical: a data-parallel pair of CFG-parallel pairs places 4 workers
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        _temp_dir=temp_dir,
        logging_level="WARNING",
    )
    _SESSION_THREADS.update(set(threading.enumerate()) - before)
    try:
        yield ray
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    _torch_one_thread()
    _disable_tqdm_monitor()
    threads_before = set(threading.enumerate())
    shm_before = _shm_entries()
    yield
    _torch_one_thread()
    _disable_tqdm_monitor()
    idle_cache = _idle_trio_cache_threads()
    leaked = [
        t
        for t in threading.enumerate()
        if t not in threads_before
        and t is not threading.main_thread()
        and t not in idle_cache
        and t not in _SESSION_THREADS
    ]
    for thread in leaked:
        thread.join(_THREAD_JOIN_S)
    alive = [t.name for t in leaked if t.is_alive()]
    assert not alive, f"test left threads running: {alive}"
    new_shm = sorted(_shm_entries() - shm_before)
    assert not new_shm, f"test left shared-memory segments: {new_shm}"
