"""Compatibility keys: which requests may share a wave (request mode) or a batch (step mode).

Two requests may run in one fused forward only if their keys are equal.  The seed is never
part of a key: every request gets its own generator.  Step mode leaves the step count out, so
requests at different steps, with different step counts, can share a denoising batch.  The
conditioning (text, image, inpaint) and the LoRA adapters with their scales are part of both
keys; pictures are resized to the
request's size, so requests of one size and conditioning may fuse whatever their pictures.
"""

from __future__ import annotations

from collections.abc import Hashable

from .request import DiffusionRequest

__all__ = ["request_batch_key", "step_batch_key"]


def _shape_and_guidance(request: DiffusionRequest) -> tuple[Hashable, ...]:
    sp = request.sampling
    return (
        sp.height,
        sp.width,
        float(sp.guidance_scale),
        sp.negative_prompt is not None,
        sp.num_outputs_per_prompt,
        sp.output_type,
        sp.conditioning,
        request.condition_key,
        # The LoRA adapters and scales (canonical after admission: hashable, sorted).
        tuple(tuple(pair) for pair in sp.lora) if sp.lora else (),
    )


def request_batch_key(request: DiffusionRequest) -> tuple[Hashable, ...]:
    """Request mode: shape, guidance, negative-prompt presence, output type and count, the
    conditioning (text, image, inpaint), the model condition key, and the whole schedule
    (steps, timesteps, sigmas, and from a picture its strength, which decides where the
    schedule starts)."""
    sp = request.sampling
    return (
        "request",
        *_shape_and_guidance(request),
        sp.num_inference_steps,
        sp.timesteps,
        sp.sigmas,
        sp.effective_strength,
    )


def step_batch_key(request: DiffusionRequest) -> tuple[Hashable, ...]:
    """Step mode: as request mode but without the step count or schedule."""
    return ("step", *_shape_and_guidance(request))
