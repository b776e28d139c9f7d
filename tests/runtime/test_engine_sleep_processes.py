"""Sleep and wake with real worker processes (tractor, forkserver): every rank releases its
weights, a group restarted while the engine sleeps is put to sleep again, and the picture
after the wake is the one before, bit for bit."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import trio

from omni_trio import EngineConfig, SamplingParams, open_engine
from omni_trio._core.health import EngineState, GroupState
from tests.executors.test_tractor_executor import poll_until

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

CAP_S = 120.0


async def test_tractor_ranks_sleep_wake_and_a_restarted_group_sleeps_again(
    cache_dir: Path, tmp_path: Path
) -> None:
    config = EngineConfig(
        model="builtin:shapes",
        backend="tractor",
        num_workers=2,
        cfg_parallel=False,
        worker_start_method="forkserver",
        cache_dir=str(cache_dir),
        torch_threads=1,
        warmup=False,
        worker_restart_backoff_s=0.0,
        sleep_dir=str(tmp_path),
        close_timeout_s=10.0,
    )
    ask = SamplingParams(num_inference_steps=4, seed=5)
    with trio.fail_after(CAP_S):
        async with open_engine(config) as engine:
            before = await engine.generate("a green triangle", ask)
            reports = await engine.sleep(1)
            assert sorted(r["rank"] for r in reports) == [0, 1]
            assert all(r["released_bytes"] > 5_000_000 for r in reports)
            # Kill a worker while the engine sleeps: the new group is put to sleep too.
            pids = engine.executor.worker_pids()  # type: ignore[attr-defined]
            os.kill(pids[1], signal.SIGKILL)
            await poll_until(lambda: engine.core.generation > 1)
            await poll_until(lambda: engine.core.group is GroupState.RUNNING)
            assert engine.health().state is EngineState.SLEEPING
            woke = await engine.wake_up()
            # Each rank of the new group had released its weights and takes them back.
            assert sorted(r["rank"] for r in woke) == [0, 1]
            assert all(r["restored_bytes"] > 5_000_000 for r in woke)
            after = await engine.generate("a green triangle", ask)
            assert np.array_equal(np.asarray(before.images[0]), np.asarray(after.images[0]))
            assert engine.health().healthy
    assert os.listdir(tmp_path) == []  # every private weights file was removed
