"""Per-request LoRA on worker processes (tractor with a fork server, and Ray), in request and
step mode: each worker loads the adapter on first use, draws what the in-process engine
draws with it, and a bad adapter fails only its request."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from omni_trio import EngineConfig, RequestFailedError, SamplingParams, open_engine
from tests.lora_support import make_foreign_lora, make_lora

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

CAP_S = 180.0


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "a": str(make_lora(root / "a", seed=1)),
        "foreign": str(make_foreign_lora(root / "foreign")),
    }


@pytest.fixture(params=["tractor", "ray"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    return str(request.param)


async def _render_all(config: EngineConfig) -> dict[str, Any]:
    ask = SamplingParams(num_inference_steps=4, seed=9)
    out: dict[str, Any] = {}
    async with open_engine(config) as engine:
        out["plain"] = np.asarray((await engine.generate("a green square", ask)).images[0])
        adapted = await engine.generate("a green square", ask.replace(lora="a"))
        out["a"] = np.asarray(adapted.images[0])
        try:
            await engine.generate("a green square", ask.replace(lora="foreign"))
        except RequestFailedError as exc:
            out["foreign"] = exc.error_type
        again = await engine.generate("a green square", ask.replace(lora="a"))
        out["a_again"] = np.asarray(again.images[0])
        out["healthy"] = engine.health().healthy
    return out


@pytest.mark.parametrize("step", [False, True], ids=["request", "step"])
async def test_lora_on_worker_processes_draws_what_inproc_draws(
    backend: str, step: bool, cache_dir: Path, adapters: dict[str, str]
) -> None:
    settings: dict[str, Any] = {
        "model": "builtin:shapes",
        "cache_dir": str(cache_dir),
        "torch_threads": 1,
        "warmup": False,
        "loras": adapters,
        "step_execution": step,
        "close_timeout_s": 10.0,
    }
    with trio.fail_after(CAP_S):
        here = await _render_all(EngineConfig(**settings))
        extra = {"worker_start_method": "forkserver"} if backend == "tractor" else {}
        there = await _render_all(EngineConfig(**settings, backend=backend, **extra))
    assert here["foreign"] == there["foreign"] == "InvalidLoraError"
    assert there["healthy"]
    assert not np.array_equal(there["a"], there["plain"])
    for key in ("plain", "a", "a_again"):
        assert np.array_equal(here[key], there[key]), key
