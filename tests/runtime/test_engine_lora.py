"""Per-request LoRA through the engine (inproc, ``builtin:shapes`` with random test
adapters), in request and step mode: adapters never share a forward, each request gets the
picture its adapter draws (the same as alone), and a bad adapter fails only its requests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from omni_trio import (
    AsyncEngine,
    EngineConfig,
    InvalidRequestError,
    RequestFailedError,
    SamplingParams,
    open_engine,
)
from omni_trio._core.trace import TraceKind, TraceRecorder
from tests.lora_support import make_foreign_lora, make_lora

CAP_S = 120.0
MODES = [pytest.param(False, id="request"), pytest.param(True, id="step")]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "a": str(make_lora(root / "a", seed=1)),
        "b": str(make_lora(root / "b", seed=2)),
        "foreign": str(make_foreign_lora(root / "foreign")),
    }


@asynccontextmanager
async def shapes_engine(
    cache_dir: Path, adapters: dict[str, str], *, step: bool, **overrides: Any
) -> AsyncIterator[AsyncEngine]:
    config = EngineConfig(
        model="builtin:shapes",
        cache_dir=str(cache_dir),
        torch_threads=1,
        warmup=False,
        loras=adapters,
        max_num_seqs=4,
        step_execution=step,
        request_batch_max_wait_ms=200.0,
        **overrides,
    )
    async with open_engine(config) as engine:
        yield engine


def ask(lora: Any = (), seed: int = 5) -> SamplingParams:
    return SamplingParams(num_inference_steps=4, seed=seed, lora=lora)


def pixels(output: Any) -> np.ndarray:
    return np.asarray(output.images[0])


@pytest.mark.parametrize("step", MODES)
async def test_requests_with_other_adapters_never_share_a_forward(
    cache_dir: Path, adapters: dict[str, str], step: bool
) -> None:
    trace = TraceRecorder()
    # Admitted in this order: FIFO runs a1 and a2 together, then plain, then b1.
    wanted = {"a1": "a", "a2": "a", "plain": (), "b1": (("b", 0.7),)}
    outputs: dict[str, Any] = {}
    with trio.fail_after(CAP_S):
        async with shapes_engine(cache_dir, adapters, step=step) as engine:
            # The references, run as the mixed run should batch them: a1 and a2 together
            # (torch's CPU kernels need not give a batch of two what each gets alone, and a
            # strong random adapter amplifies the last-bit difference), the others alone.
            alone: dict[str, np.ndarray] = {}

            async def reference(rid: str, lora: Any) -> None:
                out = await engine.generate("a red circle", ask(lora), request_id=f"ref-{rid}")
                alone[rid] = pixels(out)

            async with trio.open_nursery() as nursery:
                for rid in ("a1", "a2"):
                    nursery.start_soon(reference, rid, wanted[rid])
            for rid in ("plain", "b1"):
                await reference(rid, wanted[rid])
            engine.trace = trace
            streams = {
                rid: engine.stream("a red circle", ask(lora), request_id=rid)
                for rid, lora in wanted.items()
            }

            async def read(rid: str) -> None:
                async with streams[rid] as stream:
                    outputs[rid] = [chunk async for chunk in stream][-1]

            async with trio.open_nursery() as nursery:
                for rid in wanted:
                    nursery.start_soon(read, rid)
    # Every request drew what its reference drew, with its own adapter.
    for rid in wanted:
        assert np.array_equal(pixels(outputs[rid]), alone[rid]), rid
    assert not np.array_equal(alone["a1"], alone["plain"])
    assert not np.array_equal(alone["b1"], alone["a1"])
    # No forward mixed adapters: the requests of each dispatch share one adapter set.
    groups = {"plain": 0, "a1": 1, "a2": 1, "b1": 2}
    dispatches: dict[int, set[str]] = {}
    for event in trace.events:
        if event.kind is TraceKind.SCHEDULE and event.request_id in groups:
            dispatches.setdefault(event.step_id, set()).add(event.request_id)
    assert dispatches
    for ids in dispatches.values():
        assert len({groups[rid] for rid in ids}) == 1, ids
    # ... and the two requests with the same adapter did share one (max_num_seqs 4, a wait).
    assert any(ids == {"a1", "a2"} for ids in dispatches.values()), sorted(dispatches.items())


@pytest.mark.parametrize("step", MODES)
async def test_a_bad_adapter_fails_its_request_alone_and_the_worker_serves_on(
    cache_dir: Path, adapters: dict[str, str], step: bool
) -> None:
    with trio.fail_after(CAP_S):
        async with shapes_engine(cache_dir, adapters, step=step) as engine:
            good = pixels(await engine.generate("a blue square", ask("a")))
            with pytest.raises(RequestFailedError) as info:
                await engine.generate("a blue square", ask("foreign"))
            assert info.value.error_type == "InvalidLoraError"
            assert "does not fit this model" in str(info.value)
            # Right after the failure, a request without an adapter draws the base model.
            plain = pixels(await engine.generate("a blue square", ask()))
            assert not np.array_equal(plain, good)
            with pytest.raises(InvalidRequestError, match="unknown LoRA adapter") as refused:
                engine.stream("a blue square", ask("nope"))
            assert refused.value.param == "lora"
            assert np.array_equal(pixels(await engine.generate("a blue square", ask("a"))), good)
            assert engine.health().healthy
