"""The bench's simulated clients and direct calls, on the fake echo model."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_trio import SamplingParams, open_engine
from omni_trio.bench import _clients
from omni_trio.bench._clients import DirectCall, drive, run_direct, same_model


async def test_drive_counts_every_request_and_its_images(cache_dir: Path) -> None:
    params = SamplingParams(height=16, width=16, num_inference_steps=2, seed=3)
    async with open_engine(model="builtin:echo", cache_dir=str(cache_dir), max_num_seqs=2) as eng:
        result = await drive(
            eng, params.replace(num_outputs_per_prompt=2), requests=7, concurrency=3
        )
    assert (result.completed, result.failed, result.images) == (7, 0, 14)
    assert len(result.queue_wait_ms) == len(result.e2e_ms) == 7
    assert result.requests_per_s > 0 and result.images_per_s == pytest.approx(
        2 * result.requests_per_s
    )


async def test_drive_counts_failures_by_type(cache_dir: Path) -> None:
    params = SamplingParams(
        height=16, width=16, num_inference_steps=2, seed=3, extra_args={"echo_fail_at_step": 0}
    )
    async with open_engine(model="builtin:echo", cache_dir=str(cache_dir)) as eng:
        result = await drive(eng, params, requests=3, concurrency=2)
    assert (result.completed, result.failed) == (0, 3)
    assert sum(result.errors.values()) == 3


async def test_direct_calls_share_the_engine_model_and_thread(cache_dir: Path) -> None:
    params = SamplingParams(height=16, width=16, num_inference_steps=2, seed=3)
    async with open_engine(model="builtin:echo", cache_dir=str(cache_dir)) as eng:
        with same_model(eng) as (model, shared):
            assert shared
            direct = DirectCall(model, params)
            elapsed, where = await run_direct(eng, direct.adapter)
    assert elapsed > 0
    assert where == "engine worker thread"
    assert not direct.has_pipeline
    with pytest.raises(ValueError, match="fixed seed"):
        DirectCall(model, params.replace(seed=None))


async def test_an_unreachable_model_is_loaded_again_and_closed(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_clients, "engine_model", lambda engine: None)
    params = SamplingParams(height=16, width=16, num_inference_steps=2, seed=3)
    async with open_engine(model="builtin:echo", cache_dir=str(cache_dir)) as eng:
        with same_model(eng) as (model, shared):
            assert not shared
            assert DirectCall(model, params).adapter() > 0
    with pytest.raises(RuntimeError, match="closed"):
        DirectCall(model, params).adapter()
