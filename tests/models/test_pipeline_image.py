"""Starting from a picture: image-to-image and inpainting give what diffusers' own pipelines
give, bit for bit, in request and step mode, from the same components."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from omni_trio.errors import InvalidRequestError
from omni_trio.models import load_model
from omni_trio.models.pipeline_image import as_pil_mask, as_pil_rgb, takes_pictures

from .support import StepRecorder, Stop, generators, no_steps, request, step_alone

SEED = 3


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = load_model(
        "builtin:shapes",
        device=torch.device("cpu"),
        dtype=torch.float32,
        cache_dir=tmp_path_factory.mktemp("shapes-cache"),
        options={},
    )
    yield model
    model.close()


def _noise_picture(side: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _square_mask(side: int) -> Image.Image:
    mask = Image.new("L", (side, side), 0)
    mask.paste(255, (side // 4, side // 4, 3 * side // 4, 3 * side // 4))
    return mask


def _diffusers(model: Any, kind: str, **kwargs: Any) -> np.ndarray:
    """The same request through diffusers' own image-to-image or inpainting pipeline, built
    from the model's components (a fresh copy of its scheduler)."""
    from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionInpaintPipeline

    cls = StableDiffusionImg2ImgPipeline if kind == "image" else StableDiffusionInpaintPipeline
    # A copy of the scheduler from the start: the inpainting pipeline's __init__ rewrites some
    # scheduler configs (PNDM's skip_prk_steps) in place.
    components = {**model.pipeline.components}
    components["scheduler"] = copy.deepcopy(components["scheduler"])
    pipe = cls(**components)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(generator=generators(SEED), output_type="np", return_dict=False, **kwargs)[0]
    return np.asarray(out[0])


def _ours(model: Any, **sampling: Any) -> tuple[np.ndarray, np.ndarray]:
    """(request mode, step mode) for one request."""
    req = request("r", prompt="a red circle", **sampling)
    [[generated]] = model.generate([req], generators(SEED), output_type="np", on_step=no_steps)
    [stepped] = step_alone(model.step_adapter(), req, SEED)
    return generated, stepped


@pytest.mark.parametrize("kind", ["image", "inpaint"])
def test_tiny_sd_matches_diffusers_bit_for_bit_in_both_modes(tiny_sd: Any, kind: str) -> None:
    # tiny-sd has a real (random-weight) AutoencoderKL: encoding draws from the generator.
    side = tiny_sd.info.default_height
    picture, mask = _noise_picture(side), _square_mask(side)
    common = {"num_inference_steps": 10, "guidance_scale": 3.0}
    extra: dict[str, Any] = {"mask_image": mask} if kind == "inpaint" else {}
    generated, stepped = _ours(tiny_sd, image=picture, strength=0.6, **common, **extra)
    reference = _diffusers(
        tiny_sd, kind, prompt=["a red circle"], image=picture, strength=0.6, **common, **extra
    )
    assert generated.shape == (side, side, 3) and generated.dtype == np.float32
    np.testing.assert_array_equal(generated, reference)
    np.testing.assert_array_equal(stepped, reference)


def test_shapes_image_to_image_matches_diffusers(shapes: Any) -> None:
    picture = _noise_picture(32)
    generated, stepped = _ours(shapes, image=picture, strength=0.5, num_inference_steps=8)
    reference = _diffusers(
        shapes, "image", prompt=["a red circle"], image=picture, strength=0.5, num_inference_steps=8
    )
    np.testing.assert_array_equal(generated, reference)
    np.testing.assert_array_equal(stepped, reference)


def test_inpainting_keeps_the_unmasked_region_of_a_pixel_space_model(shapes: Any) -> None:
    # builtin:shapes' VAE is the identity, so outside the mask the picture comes back as it was
    # (diffusers' inpainting pipeline refuses its 3-channel UNet; ours blends as diffusers
    # does for 4-channel ones).
    picture, mask = _noise_picture(32), _square_mask(32)
    generated, stepped = _ours(
        shapes, image=picture, mask_image=mask, strength=0.8, num_inference_steps=10
    )
    np.testing.assert_array_equal(generated, stepped)
    keep = np.asarray(mask) == 0
    original = np.asarray(picture, np.float32) / 255
    assert float(np.abs(generated[keep] - original[keep]).max()) < 1e-6
    inside = ~keep
    assert float(np.abs(generated[inside] - original[inside]).mean()) > 0.1  # repainted


def test_a_full_mask_at_strength_one_is_text_to_image(shapes: Any) -> None:
    # Nothing is kept and the start is pure noise: the picture cannot matter.
    text, _ = _ours(shapes, num_inference_steps=6, height=32, width=32)
    full = Image.new("L", (32, 32), 255)
    painted, _ = _ours(
        shapes, image=_noise_picture(32), mask_image=full, strength=1.0, num_inference_steps=6
    )
    np.testing.assert_array_equal(painted, text)


def test_strength_sets_the_steps_and_on_step_sees_each_one(shapes: Any) -> None:
    req = request("r", image=_noise_picture(32), strength=0.5, num_inference_steps=10)
    recorder = StepRecorder()
    shapes.generate([req], generators(1), output_type="np", on_step=recorder)
    assert recorder.calls == [(i, 5) for i in range(5)]
    state = shapes.step_adapter().prepare_encode(req, generators(1)[0])
    assert state.total_steps == 5
    shapes.step_adapter().release(state)


def test_an_abort_stops_the_forward_at_its_step(shapes: Any) -> None:
    req = request("r", image=_noise_picture(32), strength=1.0, num_inference_steps=10)
    recorder = StepRecorder(stop_at=2)
    with pytest.raises(Stop):
        shapes.generate([req], generators(1), output_type="np", on_step=recorder)
    assert [step for step, _ in recorder.calls] == [0, 1, 2]


def test_a_fused_wave_gives_each_request_its_own_picture(shapes: Any) -> None:
    a_pic, b_pic = _noise_picture(32, 1), _noise_picture(32, 2)
    common = {"strength": 0.6, "num_inference_steps": 8, "num_outputs_per_prompt": 2}
    a = request("a", prompt="a blue square", image=a_pic, **common)
    b = request("b", prompt="a red circle", image=b_pic, **common)
    fused = shapes.generate([a, b], generators(1, 2), output_type="np", on_step=no_steps)
    [alone_a] = shapes.generate([a], generators(1), output_type="np", on_step=no_steps)
    [alone_b] = shapes.generate([b], generators(2), output_type="np", on_step=no_steps)
    for got, want in ((fused[0], alone_a), (fused[1], alone_b)):
        assert len(got) == 2
        for image, expected in zip(got, want, strict=True):
            np.testing.assert_allclose(image, expected, atol=1e-4)  # batching: last bits
    assert float(np.abs(fused[0][0] - fused[0][1]).max()) > 0.01  # n outputs differ
    assert float(np.abs(fused[0][0] - fused[1][0]).max()) > 0.01  # requests differ


def test_pictures_are_resized_to_the_request_size_and_arrays_work(shapes: Any) -> None:
    big = _noise_picture(64)
    array = np.asarray(big)
    from_pil, _ = _ours(shapes, image=big, height=32, width=32, num_inference_steps=4)
    from_array, _ = _ours(shapes, image=array, height=32, width=32, num_inference_steps=4)
    assert from_pil.shape == (32, 32, 3)
    np.testing.assert_array_equal(from_pil, from_array)


def test_picture_conversions() -> None:
    rgba = Image.new("RGBA", (8, 8), (10, 20, 30, 0))
    assert as_pil_rgb(rgba).mode == "RGB" and as_pil_rgb(rgba).getpixel((0, 0)) == (10, 20, 30)
    assert as_pil_mask(np.full((8, 8, 1), 255, np.uint8)).getpixel((0, 0)) == 255
    assert as_pil_mask(Image.new("RGB", (8, 8), (255, 255, 255))).mode == "L"


def test_which_models_take_pictures(tiny_sd: Any, tiny_ddim: Any, shapes: Any) -> None:
    assert tiny_sd.info.image_input and shapes.info.image_input
    assert takes_pictures(tiny_sd.pipeline) and takes_pictures(shapes.pipeline)
    assert not tiny_ddim.info.image_input
    req = request("r", image=_noise_picture(32))
    with pytest.raises(InvalidRequestError) as info:
        tiny_ddim.generate([req], generators(1), output_type="np", on_step=no_steps)
    assert info.value.param == "image"


def test_a_model_directory_with_a_picture_request_loads_from_disk(tmp_path: Path) -> None:
    # A local diffusers directory (the path users serve real checkpoints from) takes pictures
    # as the built-ins do.
    from omni_trio.models.builtin import ensure_builtin

    directory = ensure_builtin("tiny-sd", tmp_path)
    model = load_model(
        str(directory),
        device=torch.device("cpu"),
        dtype=torch.float32,
        cache_dir=tmp_path,
        options={},
    )
    try:
        assert model.info.image_input
        generated, stepped = _ours(model, image=_noise_picture(64), num_inference_steps=4)
        np.testing.assert_array_equal(generated, stepped)
    finally:
        model.close()


# diffusers warns that tiny-sd's (Euler) config sets clip_sample for DDIM: its advice, harmless.
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(
    "scheduler",
    ["PNDMScheduler", "HeunDiscreteScheduler", "DDIMScheduler", "DPMSolverMultistepScheduler"],
)
@pytest.mark.parametrize("kind", ["image", "inpaint"])
def test_the_cut_schedule_follows_the_step_count_asked_for_on_every_scheduler(
    tiny_sd: Any, scheduler: str, kind: str
) -> None:
    # PNDM has one timestep more than the steps asked for and Heun (second order) nearly
    # twice as many: the strength cuts the steps asked for, as diffusers' get_timesteps does.
    import diffusers

    from omni_trio.models.pipeline import DiffusersModel

    pipe = tiny_sd.pipeline
    # PNDM as Stable Diffusion checkpoints configure it (diffusers' inpainting pipeline
    # forces skip_prk_steps on, so the reference would otherwise run another schedule).
    options = {"skip_prk_steps": True} if scheduler == "PNDMScheduler" else {}
    swapped = type(pipe)(
        **{
            **pipe.components,
            "scheduler": getattr(diffusers, scheduler).from_config(
                pipe.scheduler.config, **options
            ),
        }
    )
    model = DiffusersModel(swapped, name=f"tiny-sd+{scheduler}")
    picture, mask = _noise_picture(64), _square_mask(64)
    extra: dict[str, Any] = {"mask_image": mask} if kind == "inpaint" else {}
    common = {"num_inference_steps": 10, "guidance_scale": 3.0}
    try:
        for strength in (0.3, 0.6):
            generated, stepped = _ours(model, image=picture, strength=strength, **common, **extra)
            reference = _diffusers(
                model,
                kind,
                prompt=["a red circle"],
                image=picture,
                strength=strength,
                **common,
                **extra,
            )
            np.testing.assert_array_equal(generated, reference)
            np.testing.assert_array_equal(stepped, reference)
    finally:
        model.close()
