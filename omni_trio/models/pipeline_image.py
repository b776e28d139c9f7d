"""Starting from a picture: the image-to-image and inpainting math of diffusers, for the
step adapter of a text-to-image pipeline (:mod:`omni_trio.models.pipeline_step`).

The same components serve all three conditionings: no second pipeline, no second copy of
the weights.  What each adds to text-to-image is what diffusers' own pipelines do, in their
order, so that a request gives the picture diffusers would (tested bit for bit):

- ``image`` (``StableDiffusionImg2ImgPipeline``): the schedule is cut to its last
  ``int(steps * strength)`` steps (``get_timesteps``, with ``set_begin_index``); the
  picture is preprocessed to ``[-1, 1]`` at the request's size, repeated per output and
  encoded one row at a time (``retrieve_latents`` with each row's generator), scaled by the
  VAE's scaling factor, and noised to the first kept timestep (``scheduler.add_noise``).
- ``inpaint`` (``StableDiffusionInpaintPipeline`` with a UNet whose input is the latent
  alone, the "legacy" inpainting): the same cut schedule; the latents start as noise times
  ``init_noise_sigma`` at strength 1, else as the noised picture; the mask (binarised at 0.5,
  white repaints) is resized to the latent size; the masked picture is encoded as diffusers
  does (drawing from the generator, so later draws match).  After every scheduler step the
  kept region is put back: the picture noised to the next timestep (the clean picture after
  the last step) outside the mask.

A UNet that takes mask channels of its own (9-channel inpainting checkpoints) is not driven
here: :func:`takes_pictures` says no, and such requests are refused at admission.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from PIL import Image

__all__ = [
    "PictureStart",
    "as_pil_mask",
    "as_pil_rgb",
    "keep_unmasked",
    "start_from_picture",
    "takes_pictures",
]


def takes_pictures(pipe: Any) -> bool:
    """Whether the pipeline's UNet takes the VAE's latent alone (so the blend of legacy
    inpainting applies) and the VAE can encode."""
    vae = getattr(pipe, "vae", None)
    latent_channels = getattr(getattr(vae, "config", None), "latent_channels", None)
    return (
        vae is not None
        and callable(getattr(vae, "encode", None))
        and latent_channels is not None
        and int(pipe.unet.config.in_channels) == int(latent_channels)
    )


def _as_pil(image: Any) -> Image.Image:
    from PIL import Image

    if isinstance(image, Image.Image):
        return image
    array = image
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    return Image.fromarray(array)


def as_pil_rgb(image: Any) -> Image.Image:
    """A PIL image or uint8 array as RGB (an alpha channel is dropped)."""
    pil = _as_pil(image)
    return pil if pil.mode == "RGB" else pil.convert("RGB")


def as_pil_mask(image: Any) -> Image.Image:
    """A PIL image or uint8 array as a grayscale mask (``L``; white marks what to repaint)."""
    pil = _as_pil(image)
    return pil if pil.mode == "L" else pil.convert("L")


class PictureStart:
    """What a picture-conditioned request starts from: its cut schedule and first latents,
    and for inpainting what every step's blend needs (``image_latents``, ``noise``, ``mask``,
    each with the request's ``n`` rows)."""

    __slots__ = ("image_latents", "latents", "mask", "noise", "timesteps")

    def __init__(
        self,
        timesteps: torch.Tensor,
        latents: torch.Tensor,
        *,
        image_latents: torch.Tensor | None = None,
        noise: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> None:
        self.timesteps = timesteps
        self.latents = latents
        self.image_latents = image_latents
        self.noise = noise
        self.mask = mask


def _cut_schedule(scheduler: Any, num_inference_steps: int, strength: float) -> Any:
    """diffusers' ``get_timesteps`` on the request's own scheduler."""
    init_timestep = min(int(num_inference_steps * strength), num_inference_steps)
    t_start = max(num_inference_steps - init_timestep, 0)
    timesteps = scheduler.timesteps[t_start * scheduler.order :]
    if hasattr(scheduler, "set_begin_index"):
        scheduler.set_begin_index(t_start * scheduler.order)
    return timesteps


def _encode_rows(pipe: Any, image: torch.Tensor, generators: list[Any]) -> torch.Tensor:
    """``retrieve_latents`` of each row with its own generator, scaled (diffusers' loop)."""
    import torch
    from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion_img2img import (
        retrieve_latents,
    )

    rows = [
        retrieve_latents(pipe.vae.encode(image[i : i + 1]), generator=generators[i])
        for i in range(image.shape[0])
    ]
    return pipe.vae.config.scaling_factor * torch.cat(rows, dim=0)


def start_from_picture(
    pipe: Any,
    scheduler: Any,
    *,
    image: Any,
    mask_image: Any | None,
    strength: float,
    num_inference_steps: int,
    height: int,
    width: int,
    generators: list[Any],
    device: torch.device,
    dtype: torch.dtype,
) -> PictureStart:
    """The cut schedule and first latents of an image-to-image (``mask_image`` None) or an
    inpainting request with ``len(generators)`` outputs; ``scheduler`` (the request's own,
    its timesteps already set) gets its begin index.  Runs under ``torch.no_grad`` and the
    model lock, as the rest of ``prepare_encode``."""
    import torch
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.utils.torch_utils import randn_tensor

    n = len(generators)
    timesteps = _cut_schedule(scheduler, num_inference_steps, strength)
    latent_timestep = timesteps[:1].repeat(n)
    init_image = pipe.image_processor.preprocess(as_pil_rgb(image), height=height, width=width)
    init_image = init_image.to(dtype=torch.float32)
    if mask_image is None:  # StableDiffusionImg2ImgPipeline.prepare_latents
        picture = init_image.to(device=device, dtype=dtype)
        picture = torch.cat([picture] * n, dim=0)
        init_latents = _encode_rows(pipe, picture, generators)
        noise = randn_tensor(init_latents.shape, generator=generators, device=device, dtype=dtype)
        latents = scheduler.add_noise(init_latents, noise, latent_timestep)
        return PictureStart(timesteps, latents)
    # StableDiffusionInpaintPipeline.prepare_latents and prepare_mask_latents (4-channel UNet)
    scale = int(pipe.vae_scale_factor)
    shape = (n, int(pipe.vae.config.latent_channels), height // scale, width // scale)
    picture = init_image.to(device=device, dtype=dtype)
    image_latents = _encode_rows(pipe, picture, generators)
    image_latents = image_latents.repeat(n // image_latents.shape[0], 1, 1, 1)
    noise = randn_tensor(shape, generator=generators, device=device, dtype=dtype)
    if strength == 1.0:
        latents = noise * scheduler.init_noise_sigma
    else:
        latents = scheduler.add_noise(image_latents, noise, latent_timestep)
    masks = VaeImageProcessor(
        vae_scale_factor=scale, do_normalize=False, do_binarize=True, do_convert_grayscale=True
    )
    mask_condition = masks.preprocess(as_pil_mask(mask_image), height=height, width=width)
    masked_image = (init_image * (mask_condition < 0.5)).to(device=device, dtype=dtype)
    # Encoded only for what it draws from the generator (the legacy blend does not use it).
    _encode_rows(pipe, masked_image, generators)
    mask = torch.nn.functional.interpolate(mask_condition, size=(height // scale, width // scale))
    mask = mask.to(device=device, dtype=dtype).repeat(n, 1, 1, 1)
    return PictureStart(timesteps, latents, image_latents=image_latents, noise=noise, mask=mask)


def keep_unmasked(
    scheduler: Any, latents: torch.Tensor, start: PictureStart, next_index: int
) -> torch.Tensor:
    """Inpainting, after the scheduler step that led to ``next_index``: outside the mask the
    picture noised to the next timestep (the clean picture once the schedule is done)."""
    import torch

    assert start.image_latents is not None and start.noise is not None and start.mask is not None
    proper = start.image_latents
    if next_index < len(start.timesteps):
        proper = scheduler.add_noise(
            proper, start.noise, torch.tensor([start.timesteps[next_index]])
        )
    return (1 - start.mask) * proper + start.mask * latents
