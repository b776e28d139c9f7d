from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from omni_trio.errors import InvalidConfigError, InvalidRequestError
from omni_trio.models import ModelInfo
from omni_trio.models.echo import EchoModel
from omni_trio.models.pipeline import DiffusersModel, min_latent_side
from omni_trio.worker.cfg_parallel import CfgParallel, CfgStatistics

from .support import StepRecorder, Stop, generators, no_steps, request


def images(model: Any, reqs: list[Any], seeds: list[int], **kwargs: Any) -> list[list[Any]]:
    kwargs.setdefault("output_type", "np")
    kwargs.setdefault("on_step", no_steps)
    return model.generate(reqs, generators(*seeds), **kwargs)


@pytest.fixture(params=["tiny_sd", "tiny_ddim"])
def model(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue(request.param)


def test_info(tiny_sd: Any, tiny_ddim: Any) -> None:
    assert tiny_sd.info.name == "builtin:tiny-sd"
    assert (tiny_sd.info.family, tiny_sd.info.text_conditioned) == ("text2image", True)
    assert (tiny_sd.info.default_height, tiny_sd.info.default_width) == (64, 64)
    assert (tiny_ddim.info.family, tiny_ddim.info.text_conditioned) == ("unconditional", False)
    assert (tiny_ddim.info.default_height, tiny_ddim.info.default_width) == (32, 32)
    assert tiny_sd.info.supports_batch and tiny_ddim.info.supports_batch
    # The recipe names the noise scheduler: the pipeline's own class, through the wire form.
    for model in (tiny_sd, tiny_ddim):
        assert model.info.scheduler == type(model._pipe.scheduler).__name__
        assert model.info.scheduler.endswith("Scheduler")
        assert ModelInfo.from_dict(model.info.to_dict()) == model.info


def test_np_outputs_are_float32_hwc_in_unit_range(model: Any) -> None:
    (image,) = images(model, [request()], [0])[0]
    size = model.info.default_height
    assert image.shape == (size, size, 3) and image.dtype == np.float32
    assert image.min() >= 0.0 and image.max() <= 1.0


def test_on_step_is_called_before_every_step(model: Any) -> None:
    steps = StepRecorder()
    images(model, [request(num_inference_steps=4)], [0], on_step=steps)
    assert steps.calls == [(0, 4), (1, 4), (2, 4), (3, 4)]


def test_raising_from_on_step_stops_the_forward(model: Any) -> None:
    steps = StepRecorder(stop_at=1)
    with pytest.raises(Stop):
        images(model, [request(num_inference_steps=5)], [0], on_step=steps)
    assert steps.calls == [(0, 5), (1, 5)]
    assert not model.pipeline.unet._forward_pre_hooks  # the hook is gone
    again = StepRecorder()
    images(model, [request(num_inference_steps=2)], [0], on_step=again)
    assert again.calls == [(0, 2), (1, 2)]


def test_same_seed_and_batch_is_bit_identical(model: Any) -> None:
    reqs = [request("a", prompt="a cat"), request("b", prompt="a dog")]
    first = images(model, reqs, [1, 2])
    second = images(model, reqs, [1, 2])
    for x, y in zip(first, second, strict=True):
        assert np.array_equal(x[0], y[0])


def test_different_seeds_differ(model: Any) -> None:
    (a,) = images(model, [request()], [1])[0]
    (b,) = images(model, [request()], [2])[0]
    assert np.abs(a - b).mean() > 1e-2


def test_each_request_in_a_batch_gets_its_own_generator(model: Any) -> None:
    reqs = [request("a", prompt="a cat"), request("b", prompt="a dog")]
    batch = images(model, reqs, [1, 2])
    alone = [images(model, [reqs[0]], [1])[0][0], images(model, [reqs[1]], [2])[0][0]]
    # Batch composition may change the last bits, never which request gets which image.
    for outs, single in zip(batch, alone, strict=True):
        np.testing.assert_allclose(outs[0], single, atol=1e-3)
    assert np.abs(batch[0][0] - batch[1][0]).mean() > 1e-2


def test_several_outputs_per_prompt(model: Any) -> None:
    outs = images(
        model,
        [request("a", num_outputs_per_prompt=2), request("b", num_outputs_per_prompt=2)],
        [1, 2],
    )
    assert [len(o) for o in outs] == [2, 2]
    assert np.abs(outs[0][0] - outs[0][1]).mean() > 1e-2
    # Output 0 of a request is what it gets alone with n=1 (the generator is drawn in order).
    (alone,) = images(model, [request("a")], [1])[0]
    np.testing.assert_allclose(outs[0][0], alone, atol=1e-3)
    flat = [image for o in outs for image in o]
    assert all(image.base is None for image in flat)  # no output keeps the batch alive


def test_the_smallest_side_is_one_every_group_norm_can_render_unguided(tiny_sd: Any) -> None:
    """A batch of one (no guidance, or one CFG-parallel half) at 16x16 hits a GroupNorm with
    one value per group in tiny-sd's UNet ("Expected more than 1 value per channel"): a 500
    on a 2-worker engine.  The model's smallest side says so, and it renders there."""
    assert tiny_sd.info.min_side == 24
    (out,) = images(tiny_sd, [request("a", height=24, width=24, guidance_scale=1.0)], [1])
    assert np.asarray(out[0]).shape[:2] == (24, 24)
    with pytest.raises(ValueError, match="more than 1 value"):
        images(tiny_sd, [request("a", height=16, width=16, guidance_scale=1.0)], [1])


def test_min_latent_side_from_the_configs() -> None:
    class Config:
        def __init__(self, **fields: Any) -> None:
            self.__dict__.update(fields)

    tiny = Config(block_out_channels=(32, 64), norm_num_groups=32)
    assert min_latent_side(tiny) == 3  # level 1 sees 32 channels at ceil(L / 2)
    assert min_latent_side(Config(block_out_channels=(64, 128), norm_num_groups=32)) == 1
    vae = Config(block_out_channels=(32,), norm_num_groups=32)
    assert min_latent_side(Config(block_out_channels=(64,), norm_num_groups=32), vae) == 2


def test_negative_prompt_changes_the_image(tiny_sd: Any) -> None:
    (plain,) = images(tiny_sd, [request()], [3])[0]
    (negative,) = images(tiny_sd, [request(negative_prompt="blurry, dark")], [3])[0]
    assert np.abs(plain - negative).max() > 1e-3


def test_mixed_negative_prompts_in_one_batch(tiny_sd: Any) -> None:
    reqs = [request("a"), request("b", negative_prompt="blurry")]
    batch = images(tiny_sd, reqs, [1, 2])
    (alone,) = images(tiny_sd, [request("b", negative_prompt="blurry")], [2])[0]
    np.testing.assert_allclose(batch[1][0], alone, atol=1e-3)


def test_prompt_matters_for_text2image(tiny_sd: Any) -> None:
    (cat,) = images(tiny_sd, [request(prompt="a cat")], [3])[0]
    (dog,) = images(tiny_sd, [request(prompt="a dog")], [3])[0]
    assert np.abs(cat - dog).max() > 1e-3


def test_size_is_honoured_for_text2image(tiny_sd: Any) -> None:
    (image,) = images(tiny_sd, [request(height=32, width=48)], [0])[0]
    assert image.shape == (32, 48, 3)


def test_latent_outputs(tiny_sd: Any, tiny_ddim: Any) -> None:
    (latent,) = images(tiny_sd, [request()], [0], output_type="latent")[0]
    assert isinstance(latent, torch.Tensor) and latent.shape == (4, 8, 8)
    (sample,) = images(tiny_ddim, [request()], [0], output_type="latent")[0]
    assert isinstance(sample, torch.Tensor) and sample.shape == (3, 32, 32)
    (image,) = images(tiny_ddim, [request()], [0])[0]
    np.testing.assert_allclose(sample.permute(1, 2, 0).numpy(), image, atol=1e-6)


def test_explicit_schedules_for_text2image(tiny_sd: Any) -> None:
    steps = StepRecorder()
    images(tiny_sd, [request(timesteps=(801.0, 401.0, 1.0))], [0], on_step=steps)
    assert steps.calls == [(0, 3), (1, 3), (2, 3)]
    # Euler's sigmas include the final one: four sigmas make three steps, and on_step says so.
    steps = StepRecorder()
    images(tiny_sd, [request(sigmas=(14.0, 5.0, 1.0, 0.0))], [0], on_step=steps)
    assert steps.calls == [(0, 3), (1, 3), (2, 3)]


def test_unconditional_rejects_what_it_cannot_do(tiny_ddim: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        images(tiny_ddim, [request(height=64, width=64)], [0])
    assert info.value.param == "size"
    with pytest.raises(InvalidRequestError) as info:
        images(tiny_ddim, [request(timesteps=(900.0, 100.0))], [0])
    assert info.value.param == "timesteps"


def test_incompatible_batches_are_rejected(tiny_sd: Any) -> None:
    with pytest.raises(ValueError, match="guidance_scale"):
        images(tiny_sd, [request("a"), request("b", guidance_scale=1.0)], [0, 1])


def test_an_unsupported_pipeline_is_named(tiny_sd: Any) -> None:
    from diffusers import StableDiffusionImg2ImgPipeline

    img2img = StableDiffusionImg2ImgPipeline(**tiny_sd.pipeline.components)
    with pytest.raises(InvalidConfigError, match="StableDiffusionImg2ImgPipeline") as info:
        DiffusersModel(img2img, name="my-model")
    assert "my-model" in str(info.value)


def test_close_releases_and_refuses_work(tiny_ddim: Any) -> None:
    model = DiffusersModel(tiny_ddim.pipeline, name="copy")
    model.close()
    model.close()
    with pytest.raises(RuntimeError, match="closed"):
        images(model, [request()], [0])


class SplitRecorder(CfgParallel):
    """Rank 0 of a CFG group with no peer: the "gathered" batch is this rank's half twice."""

    def __init__(self) -> None:
        super().__init__(0, 2, backend="gloo")
        self.batches: list[int] = []

    def _gather(self, half: torch.Tensor, batch: int) -> torch.Tensor:
        self.batches.append(batch)
        return torch.cat([half, half])


def test_cfg_parallel_splits_exactly_the_guided_unet_calls(tiny_sd: Any, tiny_ddim: Any) -> None:
    """Which calls are split (the numerics are checked with two real ranks in
    ``tests/worker/test_cfg_parallel.py``)."""
    model = DiffusersModel(tiny_sd.pipeline, name="cfg")
    cfg = SplitRecorder()
    unet = tiny_sd.pipeline.unet
    try:
        assert model.enable_cfg_parallel(cfg) is True
        with pytest.raises(RuntimeError, match="already runs CFG-parallel"):
            model.enable_cfg_parallel(cfg)
        images(model, [request(guidance_scale=1.0, num_inference_steps=2)], [0])
        assert cfg.statistics() == CfgStatistics(2, 0, 2, 2)  # not doubled: not split
        guided = [request("a", guidance_scale=7.5), request("b", guidance_scale=7.5)]
        images(model, guided, [0, 1])
        assert cfg.batches == [4, 4, 4]  # 3 steps, uncond + cond rows of 2 requests
        assert cfg.statistics() == CfgStatistics(5, 3, 14, 8)
        adapter = model.step_adapter()
        assert adapter is not None
        state = adapter.prepare_encode(
            request(guidance_scale=7.5, num_outputs_per_prompt=2), generators(0)[0]
        )
        adapter.denoise_step([state])
        assert cfg.batches[-1] == 4
        assert not cfg.active
    finally:
        model.close()
    assert not unet._forward_hooks and not unet._forward_pre_hooks  # close took them off
    ddim = DiffusersModel(tiny_ddim.pipeline, name="ddim")
    try:
        assert ddim.enable_cfg_parallel(SplitRecorder()) is False
        assert not tiny_ddim.pipeline.unet._forward_hooks
    finally:
        ddim.close()
    assert EchoModel().enable_cfg_parallel(SplitRecorder()) is False
