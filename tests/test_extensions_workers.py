"""The worker-side extension points with real worker processes: a runner subclass, a worker
extension and a model factory, each named so that it travels (the config crosses to the
workers as plain data: classes as import paths), on tractor and on a local Ray.

Per rank: each worker process builds its own runner and extension instance, answers
``collective_rpc`` on its own (``unique_reply_rank=None``: one reply per rank) and boxes an
extension's error with its rank, as for the built-in calls.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio

from omni_trio import WorkerError
from tests.executors.test_tractor_executor import (
    CAP_S,
    _no_worker_processes,  # noqa: F401 - the autouse leak check, for this module too
    engine_on,
    params,
)
from tests.extension_examples import CountingRunner

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

ROOT = Path(__file__).resolve().parent.parent
HOOKS: dict[str, Any] = {
    "model": "tests.extension_examples:echo_factory",
    "runner_cls": CountingRunner,  # a class: it travels as its import path
    "worker_extension_cls": "tests.extension_examples:InspectExtension",
}


def rank_pids(engine: Any) -> dict[int, int]:
    """Each rank's worker process (tractor and ray executors)."""
    return dict(engine.executor.worker_pids())


@pytest.fixture(autouse=True)
def importable_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker processes import ``tests.extension_examples`` by name, wherever they start."""
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), *([path] if path else [])]))


async def test_tractor_workers_serve_the_runner_extension_and_factory(cache_dir: Path) -> None:
    with trio.fail_after(CAP_S):
        async with engine_on(
            "tractor", cache_dir, num_workers=2, max_num_seqs=2, **HOOKS
        ) as engine:
            out = await engine.generate("p", params(seed=3), request_id="a")
            every = await engine.collective_rpc("inspect", unique_reply_rank=None)
            one = await engine.collective_rpc("inspect", unique_reply_rank=1)
            pids = rank_pids(engine)
            with pytest.raises(WorkerError) as failed:
                await engine.collective_rpc("fail", "boom", unique_reply_rank=None)
            with pytest.raises(WorkerError, match="no RPC method '_helper'") as private:
                await engine.collective_rpc("_helper")
            engine.check_health()  # a failed RPC is the caller's, not the group's
    assert out.ok
    assert [(r["rank"], r["pid"]) for r in every] == [(0, pids[0]), (1, pids[1])]
    for reply in every:
        assert reply["model"] == "echo-by-factory" and reply["runner"] == "CountingRunner"
        assert reply["forwards"] == 1 and reply["calls"] == 1  # both ranks ran the wave
    assert (one["rank"], one["calls"]) == (1, 2)  # each rank keeps its own instance
    error = failed.value
    assert error.error_type == "RuntimeError"
    for rank in (0, 1):
        assert f"rank {rank}: RuntimeError: boom" in str(error)
    assert error.traceback_text is not None and ", in fail" in error.traceback_text
    assert private.value.error_type == "AttributeError"


async def test_ray_workers_serve_the_runner_extension_and_factory(
    ray_cluster: Any, cache_dir: Path
) -> None:
    with trio.fail_after(CAP_S):
        async with engine_on("ray", cache_dir, **HOOKS) as engine:
            assert (await engine.generate("p", params(seed=4), request_id="b")).ok
            [reply] = await engine.collective_rpc("inspect", unique_reply_rank=None)
            pids = rank_pids(engine)
            with pytest.raises(WorkerError, match="boom") as failed:
                await engine.collective_rpc("fail", "boom")
    assert reply["pid"] == pids[0] and reply["model"] == "echo-by-factory"
    assert reply["runner"] == "CountingRunner" and reply["forwards"] == 1
    assert failed.value.error_type == "RuntimeError"
