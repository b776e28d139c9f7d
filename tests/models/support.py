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
