"""Small builders shared by the model tests."""

from __future__ import annotations

from typing import Any

import torch

from omni_trio._core.request import DiffusionRequest, SamplingParams


def request(request_id: str = "r", prompt: str = "a red fox", **sampling: Any) -> DiffusionRequest:
    sampling.setdefault("num_inference_steps", 3)
    return DiffusionRequest(prompt, SamplingParams(**sampling), request_id=request_id)


def generators(*seeds: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed) for seed in seeds]


class Stop(Exception):
    """What :class:`StepRecorder` raises to stop a forward (as the runner's abort would)."""


class StepRecorder:
    """An ``on_step`` hook that records its calls and raises :class:`Stop` at ``stop_at``."""

    def __init__(self, stop_at: int | None = None) -> None:
        self.calls: list[tuple[int, int]] = []
        self.stop_at = stop_at

    def __call__(self, step: int, total: int) -> None:
        self.calls.append((step, total))
        if step == self.stop_at:
            raise Stop(f"stopped at step {step}")


def no_steps(step: int, total: int) -> None:
    pass


def step_alone(
    adapter: Any, req: DiffusionRequest, seed: int, output_type: str = "np"
) -> list[Any]:
    """Step ``req`` alone from ``prepare_encode`` to ``post_decode`` (what generate does alone)."""
    state = adapter.prepare_encode(req, torch.Generator().manual_seed(seed))
    while not state.denoise_completed:
        (pred,) = adapter.denoise_step([state])
        adapter.step_scheduler(state, pred)
    return list(adapter.post_decode(state, output_type=output_type))


def step_continuously(
    adapter: Any, plan: list[tuple[DiffusionRequest, int, int]], output_type: str = "np"
) -> dict[str, list[Any]]:
    """A tiny continuous-batching runner: ``plan`` holds ``(request, seed, join_tick)``.

    Every tick admits the requests whose tick it is, runs ONE fused ``denoise_step`` over all
    live requests (at different steps) and steps each; finished ones are decoded and leave.
    """
    live: dict[str, Any] = {}
    results: dict[str, list[Any]] = {}
    tick = 0
    while len(results) < len(plan):
        for req, seed, join in plan:
            if join == tick:
                live[req.request_id] = adapter.prepare_encode(
                    req, torch.Generator().manual_seed(seed)
                )
        states = list(live.values())
        if states:
            preds = adapter.denoise_step(states)
            assert len(preds) == len(states)
            for state, pred in zip(states, preds, strict=True):
                adapter.step_scheduler(state, pred)
                if state.denoise_completed:
                    results[state.request_id] = adapter.post_decode(state, output_type=output_type)
                    adapter.release(live.pop(state.request_id))
        tick += 1
        assert tick < 1000, "the plan never finishes"
    return results
