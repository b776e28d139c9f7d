"""An :class:`EnginePool` whose replicas are stage processes (``stage="process"``): a stage
killed under a running request moves the request to the other replica (same id, same seed,
the same picture), and the pool reopens the dead replica."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import trio

from omni_trio import EngineConfig, SamplingParams
from omni_trio.models import decode_echo_image
from omni_trio.runtime.stage import StageEngine
from omni_trio.serve.pool import EnginePool
from tests.executors.test_tractor_executor import poll_until
from tests.serve.test_pool import final_of, serving

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

CAP_S = 90.0


async def test_a_request_on_a_killed_stage_moves_to_the_live_replica(cache_dir: Path) -> None:
    config = EngineConfig(
        model="builtin:echo",
        cache_dir=str(cache_dir),
        torch_threads=1,
        warmup=False,
        model_options={"step_delay_s": 0.02},
    )
    pool = EnginePool(config, replicas=2, stage="process")
    with trio.fail_after(CAP_S):
        async with serving(pool):
            engines = [pool.replica_engine(i) for i in range(2)]
            assert all(isinstance(e, StageEngine) for e in engines)
            ask = SamplingParams(height=32, width=32, num_inference_steps=100, seed=42)
            submission = pool.submit("p", ask, request_id="moving")
            victim = engines[submission.replica]
            assert isinstance(victim, StageEngine)
            # Polled, capped: running in the stage.
            await poll_until(
                lambda: victim.progress(submission.stream.engine_request_id) is not None
            )
            os.kill(victim.pid, signal.SIGKILL)
            output = await final_of(submission)
            assert output.ok, output.error
            assert submission.stream.moves == 1
            assert submission.stream.replica != submission.replica
            assert decode_echo_image(output.images[0]) == ("moving", 42, 0)
            # The dead replica is reopened (a new stage process) and serves again.
            await poll_until(
                lambda: (
                    pool.replica_engine(submission.replica) not in (None, victim)
                    and pool.readiness()[0]
                )
            )
            again = pool.replica_engine(submission.replica)
            assert isinstance(again, StageEngine) and again.pid != victim.pid
            assert (await final_of(pool.submit("p", ask.replace(num_inference_steps=2)))).ok
