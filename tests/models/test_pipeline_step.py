"""Step mode of diffusers pipelines: fused batches of requests at different steps.

Measured tolerances (CPU, float32, one torch thread, diffusers 0.42.1, 5 seed pairs):

- ALONE, stepping equals ``generate`` bit for bit (test_step.py), also for the scheduler swaps
  and the DDPM/local-directory pipelines below.
- ONE fused ``denoise_step`` vs the same states one by one: the per-request predictions differ
  by at most ~1e-5 (the batch size changes the UNet's float summation order; some batch sizes
  give 0.0); asserted <= 5e-5.
- CONTINUOUS batching (different steps, step counts and join times), end to end vs alone:
  tiny-sd (Euler, CFG, 3-20 steps): <= 2e-6 on "np" images, <= 8.8e-5 on latents (whose
  values reach ~17): asserted 1e-4 (np) and 5e-4 (latent).
  tiny-ddim: <= 4.1e-5 up to 10 steps (1e-5 in the test below): asserted 2e-4 for <= 6
  steps.  Its random-weight UNet
  amplifies the ~1e-5 per-step drift exponentially: at 20 steps a request differs by up to
  0.26 from itself alone -- exactly as in request mode, where ``generate([a, b])`` vs
  ``generate([a])`` differs by 0.18 at 20 steps.  It is the batch size, not step mode.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_trio.errors import InvalidRequestError
from omni_trio.models import load_model
from omni_trio.models.pipeline import DiffusersModel

from .support import generators, no_steps, request, step_alone, step_continuously

STEP_ATOL = 5e-5
SD_NP_ATOL = 1e-4
SD_LATENT_ATOL = 5e-4
DDIM_ATOL = 2e-4


def max_diff(a: Any, b: Any) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


def mean_diff(a: Any, b: Any) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).mean())


@pytest.mark.parametrize(("output_type", "atol"), [("np", SD_NP_ATOL), ("latent", SD_LATENT_ATOL)])
def test_text2image_continuous_batch_matches_each_request_alone(
    tiny_sd: Any, output_type: str, atol: float
) -> None:
    adapter = tiny_sd.step_adapter()
    # Different prompts, seeds, negative prompts, step counts and join times.
    a = request("a", prompt="a cat", num_inference_steps=12, negative_prompt="blurry")
    b = request("b", prompt="a dog", num_inference_steps=8)
    c = request("c", prompt="a cow", sigmas=(14.0, 5.0, 1.0, 0.0))  # three Euler steps
    seeds = {"a": 1, "b": 2, "c": 3}
    plan = [(a, 1, 0), (b, 2, 3), (c, 3, 5)]
    fused = step_continuously(adapter, plan, output_type)
    for req in (a, b, c):
        alone = step_alone(adapter, req, seeds[req.request_id], output_type)
        assert max_diff(fused[req.request_id][0], alone[0]) <= atol, req.request_id
    # Each request got its own result, not a neighbour's.
    assert mean_diff(fused["a"][0], fused["b"][0]) > 1e-2


def test_unconditional_continuous_batch_matches_each_request_alone(tiny_ddim: Any) -> None:
    adapter = tiny_ddim.step_adapter()
    a = request("a", num_inference_steps=6)
    b = request("b", num_inference_steps=4, num_outputs_per_prompt=1)
    fused = step_continuously(adapter, [(a, 1, 0), (b, 2, 2)])
    assert max_diff(fused["a"][0], step_alone(adapter, a, 1)[0]) <= DDIM_ATOL
    assert max_diff(fused["b"][0], step_alone(adapter, b, 2)[0]) <= DDIM_ATOL
    assert mean_diff(fused["a"][0], fused["b"][0]) > 1e-2


@pytest.mark.parametrize("name", ["tiny_sd", "tiny_ddim"])
def test_one_fused_step_maps_every_row_back_to_its_request(request_fixture: Any, name: str) -> None:
    model = request_fixture(name)
    adapter = model.step_adapter()
    # Two outputs each, so a row swap inside a request would show too.
    a = adapter.prepare_encode(
        request("a", prompt="a cat", num_inference_steps=10, num_outputs_per_prompt=2),
        generators(1)[0],
    )
    b = adapter.prepare_encode(
        request(
            "b",
            prompt="a dog",
            num_inference_steps=5,
            num_outputs_per_prompt=2,
            negative_prompt="dark",
        ),
        generators(2)[0],
    )
    for _ in range(3):  # a is three steps ahead of b, on a different schedule
        (pred,) = adapter.denoise_step([a])
        adapter.step_scheduler(a, pred)
    fused_b, fused_a = adapter.denoise_step([b, a])
    (alone_a,) = adapter.denoise_step([a])
    (alone_b,) = adapter.denoise_step([b])
    assert fused_a.shape == alone_a.shape == a.latents.shape
    assert max_diff(fused_a, alone_a) <= STEP_ATOL
    assert max_diff(fused_b, alone_b) <= STEP_ATOL
    assert mean_diff(fused_a[0], fused_a[1]) > 1e-3  # the rows of a request differ too
    assert mean_diff(fused_a, alone_b) > 1e-2


@pytest.fixture
def request_fixture(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue


def test_text2image_rejects_states_that_cannot_share_a_step(tiny_sd: Any) -> None:
    adapter = tiny_sd.step_adapter()
    base = adapter.prepare_encode(request("a"), generators(0)[0])
    other_guidance = adapter.prepare_encode(request("b", guidance_scale=3.0), generators(1)[0])
    no_guidance = adapter.prepare_encode(request("c", guidance_scale=1.0), generators(2)[0])
    other_size = adapter.prepare_encode(request("d", height=32, width=32), generators(3)[0])
    with pytest.raises(ValueError, match=r"'a' and 'b'.*guidance_scale"):
        adapter.denoise_step([base, other_guidance])
    with pytest.raises(ValueError, match=r"'a' and 'c'.*guidance_scale"):
        adapter.denoise_step([base, no_guidance])
    with pytest.raises(ValueError, match=r"'a' and 'd'.*latent shape"):
        adapter.denoise_step([base, other_size])
    # Mixed negative prompts share a step, as they share a generate call.
    negative = adapter.prepare_encode(request("e", negative_prompt="dark"), generators(4)[0])
    assert len(adapter.denoise_step([base, negative])) == 2


def test_step_counts_come_from_the_scheduler(tiny_sd: Any) -> None:
    adapter = tiny_sd.step_adapter()
    sigmas = adapter.prepare_encode(request(sigmas=(14.0, 5.0, 1.0, 0.0)), generators(0)[0])
    assert sigmas.total_steps == len(sigmas.timesteps) == 3
    timesteps = adapter.prepare_encode(request(timesteps=(801.0, 401.0, 1.0)), generators(0)[0])
    assert timesteps.total_steps == 3
    assert timesteps.timesteps.tolist() == [801.0, 401.0, 1.0]


def test_each_request_owns_its_scheduler(tiny_sd: Any) -> None:
    adapter = tiny_sd.step_adapter()
    first = adapter.prepare_encode(request("a", num_inference_steps=3), generators(0)[0])
    second = adapter.prepare_encode(request("b", num_inference_steps=5), generators(0)[0])
    shared = tiny_sd.pipeline.scheduler
    assert first.scheduler is not second.scheduler
    assert shared not in (first.scheduler, second.scheduler)
    (pred,) = adapter.denoise_step([first])
    adapter.step_scheduler(first, pred)
    assert first.scheduler.step_index == 1
    assert second.scheduler.step_index is None


def test_requests_the_model_cannot_serve_fail_at_prepare(tiny_ddim: Any) -> None:
    adapter = tiny_ddim.step_adapter()
    with pytest.raises(InvalidRequestError) as info:
        adapter.prepare_encode(request(height=64, width=64), generators(0)[0])
    assert info.value.param == "size"
    with pytest.raises(InvalidRequestError) as info:
        adapter.prepare_encode(request(timesteps=(900.0, 100.0)), generators(0)[0])
    assert info.value.param == "timesteps"


def assert_step_mode_equals_generate(model: Any, **sampling: Any) -> None:
    req = request("r", prompt="a cat", num_inference_steps=4, **sampling)
    expected = model.generate([req], generators(9), output_type="np", on_step=no_steps)[0]
    got = step_alone(model.step_adapter(), req, 9)
    for x, y in zip(got, expected, strict=True):
        assert np.array_equal(x, y)


@pytest.mark.parametrize(
    "scheduler",
    # Ancestral: step noise from the request's generator; DPM-Solver: a per-request history.
    ["EulerAncestralDiscreteScheduler", "DPMSolverMultistepScheduler"],
)
def test_other_schedulers_of_a_local_sd_directory(
    tiny_sd: Any, tmp_path: Path, model_cache_dir: Path, scheduler: str
) -> None:
    import diffusers

    pipe = tiny_sd.pipeline
    swapped = type(pipe)(
        **{
            **pipe.components,
            "scheduler": getattr(diffusers, scheduler).from_config(pipe.scheduler.config),
        }
    )
    swapped.save_pretrained(tmp_path / "sd")
    model = load_model(
        str(tmp_path / "sd"),
        device=torch.device("cpu"),
        dtype=torch.float32,
        cache_dir=model_cache_dir,
        options={},
    )
    try:
        assert model.info.supports_steps
        assert_step_mode_equals_generate(model, num_outputs_per_prompt=2, negative_prompt="dark")
        adapter = model.step_adapter()
        a = request("a", prompt="a cat", num_inference_steps=6)
        b = request("b", prompt="a dog", num_inference_steps=4)
        fused = step_continuously(adapter, [(a, 1, 0), (b, 2, 1)])
        assert max_diff(fused["a"][0], step_alone(adapter, a, 1)[0]) <= SD_NP_ATOL
        assert max_diff(fused["b"][0], step_alone(adapter, b, 2)[0]) <= SD_NP_ATOL
    finally:
        model.close()


def test_ddpm_draws_its_step_noise_from_the_request_generator(tiny_ddim: Any) -> None:
    from diffusers import DDPMPipeline, DDPMScheduler

    model = DiffusersModel(
        DDPMPipeline(unet=tiny_ddim.pipeline.unet, scheduler=DDPMScheduler()), name="ddpm"
    )
    assert model.info.supports_steps
    assert_step_mode_equals_generate(model, num_outputs_per_prompt=2)


def test_pipelines_whose_call_differs_have_no_step_adapter(tiny_sd: Any, tiny_ddim: Any) -> None:
    from diffusers import PNDMPipeline, PNDMScheduler, StableDiffusionPipeline

    class Custom(StableDiffusionPipeline):
        """Keeps the signature (so the family is detected) but not the ``__call__``."""

        @functools.wraps(StableDiffusionPipeline.__call__)
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return StableDiffusionPipeline.__call__(self, *args, **kwargs)

    for pipe in (
        Custom(**tiny_sd.pipeline.components),
        PNDMPipeline(unet=tiny_ddim.pipeline.unet, scheduler=PNDMScheduler()),
    ):
        model = DiffusersModel(pipe, name="custom")
        assert model.info.family in ("text2image", "unconditional")
        assert not model.info.supports_steps
        assert model.step_adapter() is None
