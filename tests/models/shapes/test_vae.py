"""PixelSpaceVAE is the identity and saves and loads like any diffusers model."""

from __future__ import annotations

from pathlib import Path

import torch

from omni_trio.models.shapes._vae import PixelSpaceVAE


def test_decode_and_encode_are_the_identity() -> None:
    vae = PixelSpaceVAE()
    x = torch.randn(2, 3, 32, 32)
    assert vae.decode(x).sample is x
    assert vae.decode(x, return_dict=False)[0] is x
    assert vae.encode(x).latent_dist.sample() is x
    assert vae.encode(x, return_dict=False)[0].mode() is x
    assert vae.config.scaling_factor == 1.0
    assert len(vae.config.block_out_channels) == 1  # the pipeline's scale factor is 1


def test_it_round_trips_through_save_pretrained(tmp_path: Path) -> None:
    PixelSpaceVAE().save_pretrained(tmp_path / "vae", safe_serialization=True)
    loaded = PixelSpaceVAE.from_pretrained(tmp_path / "vae", local_files_only=True)
    assert isinstance(loaded, PixelSpaceVAE)
    assert loaded.dtype == torch.float32
