"""The worked example of docs/backends.md, run as written: a custom backend that implements
only a ``Transport`` (spawned processes over pipes) serves requests, and gets the group's
rules for free (a SIGKILLed rank fails the group, the supervisor replaces it, the request in
flight reruns with its seed)."""

from __future__ import annotations

import importlib
import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import trio

from omni_trio import EngineConfig, SamplingParams, open_engine
from omni_trio._core.lifecycle import RequestStatus
from omni_trio.executors.group import GroupExecutor
from omni_trio.models.echo import ECHO_STEP_DELAY_S, decode_echo_image
from tests.executors.test_tractor_executor import _exists, poll_until, wait_running

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

CAP_S = 90.0
DOC = Path(__file__).resolve().parents[2] / "docs" / "backends.md"


def example_source() -> str:
    """The one Python block of the "Writing a transport" section."""
    text = DOC.read_text()
    section = text.split("### Writing a transport", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return block


@pytest.fixture
def pipe_transport(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The example as an importable module (spawned children import it by name too)."""
    (tmp_path / "pipe_transport_example.py").write_text(example_source())
    monkeypatch.syspath_prepend(str(tmp_path))
    # A spawned child finds the module through PYTHONPATH (its sys.path is rebuilt).
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *sys.path]))
    module = importlib.import_module("pipe_transport_example")
    yield module
    sys.modules.pop("pipe_transport_example", None)


def params(steps: int, seed: int, delay: float | None = None) -> SamplingParams:
    extra = {ECHO_STEP_DELAY_S: delay} if delay is not None else {}
    return SamplingParams(
        num_inference_steps=steps, seed=seed, height=32, width=32, extra_args=extra
    )


def test_the_example_is_a_transport() -> None:
    source = example_source()
    assert "class PipeTransport(Transport):" in source
    assert "class PipeExecutor(GroupExecutor):" in source


async def test_a_custom_transport_serves_and_is_supervised(
    pipe_transport: ModuleType, cache_dir: Path
) -> None:
    executor_class = pipe_transport.PipeExecutor
    assert issubclass(executor_class, GroupExecutor)
    config = EngineConfig(
        backend=executor_class,
        num_workers=2,
        cfg_parallel=False,
        cache_dir=str(cache_dir),
        torch_threads=1,
        warmup=False,
        worker_restart_backoff_s=0.0,
        max_retries_on_worker_failure=1,
    )
    pids: dict[int, int] = {}
    with trio.fail_after(CAP_S):
        async with open_engine(config) as engine:
            executor = engine.executor
            assert isinstance(executor, executor_class)
            out = await engine.generate("p", params(2, seed=4), request_id="first")
            assert decode_echo_image(out.images[0]) == ("first", 4, 0)
            # The rules come with the executor: a killed rank fails the group, the
            # supervisor starts a new one and the request reruns with its seed.
            slow = params(40, seed=9, delay=0.02)
            undisturbed = await engine.generate("p", slow, request_id="a")
            pids = executor.worker_pids()
            stream = engine.stream("p", slow, request_id="a")
            await wait_running(engine, "a")
            os.kill(pids[0], signal.SIGKILL)
            async with stream:
                outs = [o async for o in stream]
            await poll_until(lambda: engine.health().healthy)
            health = engine.health()
    assert outs[-1].status is RequestStatus.FINISHED_COMPLETED
    assert np.array_equal(np.asarray(outs[-1].images[0]), np.asarray(undisturbed.images[0]))
    assert health.restarts == 1 and health.last_failure is not None
    assert f"process {pids[0]} died (killed by SIGKILL)" in health.last_failure
    assert not [pid for pid in pids.values() if _exists(pid)]
