"""``start_profile`` / ``stop_profile`` on the process backends: two real worker processes
(tractor; Ray against the session's local Ray), each profiling the thread its forwards run in
and writing its own trace of a real ``builtin:tiny-sd`` forward, relative directories taken
from each worker's working directory.  (In-process engines: ``test_profiling.py``.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import trio

from omni_trio import SamplingParams, WorkerError
from omni_trio.executors.group import GroupExecutor
from tests.executors.test_tractor_executor import (
    CAP_S,
    _no_worker_processes,  # noqa: F401 - the autouse leak check, for this module too
    engine_on,
)

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)


def event_names(path: str | Path) -> set[str]:
    with open(path, encoding="utf-8") as trace:
        return {event.get("name", "") for event in json.load(trace)["traceEvents"]}


def op_process_ids(path: str | Path) -> set[int]:
    """The processes the trace's CPU ops ran in."""
    with open(path, encoding="utf-8") as trace:
        events = json.load(trace)["traceEvents"]
    return {event["pid"] for event in events if event.get("cat") == "cpu_op"}


@pytest.fixture(params=["tractor", "ray"])
def process_backend(request: pytest.FixtureRequest) -> str:
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")  # a local Ray the engine joins
    return str(request.param)


async def test_every_worker_process_traces_its_own_forwards(
    process_backend: str, cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # tractor's workers start here; Ray's may not: absolute below
    relative = process_backend == "tractor"
    directory = "traces" if relative else str(tmp_path / "traces")
    params = SamplingParams(height=64, width=64, num_inference_steps=2, seed=4)
    with trio.fail_after(2 * CAP_S):
        async with engine_on(
            process_backend, cache_dir, model="builtin:tiny-sd", num_workers=2
        ) as engine:
            executor = engine.executor
            assert isinstance(executor, GroupExecutor)
            pids = executor.worker_pids()  # rank -> pid
            await engine.start_profile(directory, prefix="procs")
            with pytest.raises(WorkerError, match="already profiling"):
                # Bypassing the engine's own refusal: each worker refuses too.
                await engine.collective_rpc(
                    "start_profile", directory, "again", unique_reply_rank=None
                )
            assert engine.profiling  # the workers' sessions run on
            assert (await engine.generate("a red circle", params)).ok
            paths = await engine.stop_profile()
    expected = [str(tmp_path / "traces" / f"procs-rank{rank}.json") for rank in (0, 1)]
    assert paths == expected
    for rank, path in enumerate(paths):
        # The worker's forward thread was the one recording: the model's ops are there,
        # and they ran in that worker's process.
        assert {"omni_trio.forward", "aten::conv2d"} <= event_names(path), path
        assert op_process_ids(path) == {pids[rank]} != {os.getpid()}, path
