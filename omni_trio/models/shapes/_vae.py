""":class:`PixelSpaceVAE`: the identity "autoencoder" that lets a pixel-space UNet run inside
``StableDiffusionPipeline``.

``builtin:shapes`` denoises RGB pixels directly, but ``StableDiffusionPipeline`` (and so the
runtime's text-to-image family and its step adapter) wants a VAE: it reads
``vae.config.block_out_channels`` for the latent scale factor, ``vae.config.scaling_factor``,
and calls ``vae.decode``.  This module is all of that with no computation: one block (scale
factor 1), scaling factor 1, and ``decode``/``encode`` that return their input.  Being a
diffusers ``ModelMixin``, it is saved and loaded like any component (``model_index.json``
records it as ``omni_trio.models.shapes._vae.PixelSpaceVAE``; diffusers resolves it from
``sys.modules``, so this module must be imported before ``DiffusionPipeline.from_pretrained``
-- ``DiffusersModel.from_pretrained``, which :func:`omni_trio.models.load_model` uses, does).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import AutoencoderKL
from diffusers.configuration_utils import register_to_config
from diffusers.models.autoencoders.vae import DecoderOutput
from diffusers.models.modeling_outputs import AutoencoderKLOutput

# diffusers finds a custom component's loading method by looking the base classes it knows
# (ModelMixin, ...) up in the component's module: this module must have ModelMixin.
from diffusers.models.modeling_utils import ModelMixin  # noqa: F401

__all__ = ["PixelSpaceVAE"]


class _PointMass:
    """A "latent distribution" that is the image itself (what ``encode`` returns)."""

    def __init__(self, sample: torch.Tensor) -> None:
        self.mean = sample
        self.mode_value = sample

    def sample(self, generator: Any = None) -> torch.Tensor:
        return self.mean

    def mode(self) -> torch.Tensor:
        return self.mean


class PixelSpaceVAE(AutoencoderKL):
    """The identity map in the shape of a diffusers VAE: latents are pixels in [-1, 1].

    A subclass of ``AutoencoderKL`` only so that pipelines' type checks accept it (diffusers
    warns about any other class); ``AutoencoderKL.__init__`` is skipped, so none of its
    layers exist, and everything but ``encode``/``decode``/``forward`` (tiling, slicing) is
    unsupported.
    """

    config_name = "config.json"

    @register_to_config
    def __init__(
        self,
        in_channels: int = 3,
        latent_channels: int = 3,
        block_out_channels: tuple[int, ...] = (3,),
        scaling_factor: float = 1.0,
        force_upcast: bool = False,
    ) -> None:
        # ModelMixin's __init__, skipping AutoencoderKL's: no encoder or decoder layers.
        super(AutoencoderKL, self).__init__()
        # One buffer-like parameter so the model has a dtype and a device (it is not used).
        self.anchor = torch.nn.Parameter(torch.zeros(1), requires_grad=False)

    def encode(self, x: torch.Tensor, return_dict: bool = True) -> Any:
        """``x`` itself, as a point-mass latent distribution."""
        dist = _PointMass(x)
        if not return_dict:
            return (dist,)
        return AutoencoderKLOutput(latent_dist=dist)

    def decode(
        self, z: torch.Tensor, return_dict: bool = True, generator: Any = None
    ) -> DecoderOutput | tuple[torch.Tensor]:
        """``z`` itself (the pipeline then maps [-1, 1] to [0, 1] and clips)."""
        if not return_dict:
            return (z,)
        return DecoderOutput(sample=z)

    def forward(self, sample: torch.Tensor, return_dict: bool = True) -> Any:
        return self.decode(sample, return_dict=return_dict)
