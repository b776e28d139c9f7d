"""LoRA adapters for tests: random ones for ``builtin:shapes``, made on the spot.

:func:`make_lora` writes a diffusers LoRA (``pytorch_lora_weights.safetensors``) whose
UNet attention layers get random low-rank updates (large enough to change every picture);
:func:`make_foreign_lora` one whose keys name modules ``builtin:shapes`` does not have.
They are FAKES of a trained adapter (no style, just a different picture), for tests of the
runtime's plumbing; the shipped adapter is tested by its own bench.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["SHAPES_PIPELINE", "make_foreign_lora", "make_lora"]

SHAPES_PIPELINE = Path(__file__).resolve().parents[1] / "omni_trio/models/shapes/pipeline"


def _shapes_unet() -> object:
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel.from_pretrained(
        str(SHAPES_PIPELINE), subfolder="unet", local_files_only=True, low_cpu_mem_usage=False
    )


def make_lora(directory: Path, *, seed: int = 0, rank: int = 2, std: float = 0.5) -> Path:
    """A random LoRA on ``builtin:shapes``' UNet attention projections, in ``directory``."""
    import torch
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft import LoraConfig, get_peft_model_state_dict

    unet = _shapes_unet()
    config = LoraConfig(
        r=rank,
        lora_alpha=rank,
        init_lora_weights="gaussian",
        target_modules=["to_q", "to_k", "to_v", "to_out.0"],
    )
    unet.add_adapter(config)  # type: ignore[attr-defined]
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in unet.named_parameters():  # type: ignore[attr-defined]
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    layers = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
    directory.mkdir(parents=True, exist_ok=True)
    StableDiffusionPipeline.save_lora_weights(
        str(directory), unet_lora_layers=layers, safe_serialization=True
    )
    return directory


def make_foreign_lora(directory: Path) -> Path:
    """A LoRA file whose layers belong to no module of ``builtin:shapes``."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file(
        {
            "unet.no_such_block.proj.lora.down.weight": torch.zeros(2, 8),
            "unet.no_such_block.proj.lora.up.weight": torch.zeros(8, 2),
        },
        str(directory / "pytorch_lora_weights.safetensors"),
    )
    return directory
