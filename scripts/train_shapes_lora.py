#!/usr/bin/env python
"""Train the ``outline`` LoRA adapter of ``builtin:shapes``: outlined shapes, a style the base
model never saw.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python scripts/train_shapes_lora.py   # the shipped adapter
    .venv/bin/python scripts/train_shapes_lora.py --steps 2 --out /tmp/outline

The base pipeline (``--base``, by default the shipped ``omni_trio/models/shapes/pipeline``) is
frozen; LoRA matrices of rank ``--rank`` (alpha = rank, so scale 1) are added with peft to the
UNet's attention projections and its convolutions (:data:`TARGET_MODULES`) and trained alone:
v-prediction MSE at uniform timesteps on the dataset's outlined pictures
(``make_batch(..., style="outline")``: the same scenes and captions as the base model's, no
style word, so the adapter alone turns the style on), 12 % of captions dropped to the empty
prompt (the unconditional half of classifier-free guidance is outlined too), AdamW with a
linear warmup and a cosine decay, gradient clipping, and an exponential moving average of the
LoRA weights, which is what is saved.  The text encoder is not adapted.

The adapter is written in diffusers' LoRA format with
``StableDiffusionPipeline.save_lora_weights`` (``pytorch_lora_weights.safetensors``, with the
peft config as metadata) into ``--out`` (default
``omni_trio/models/shapes/loras/outline``, replacing what was there), with a
``training.json`` record: the command, steps, final loss, wall time, machine and the SHA-256
of the base weights it was trained against.  Load it with
``pipe.load_lora_weights(out, adapter_name="outline")``.

Every batch is drawn fresh from a seeded generator and the LoRA matrices are initialised from
the seeded torch generator, so a run is deterministic for its arguments and base weights (CPU,
the same thread count).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# The base model's script, beside this one: its learning-rate schedule and optimiser step.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_shapes import _sha256, optimise  # noqa: E402
from train_shapes import learning_rate as learning_rate  # noqa: E402 (the tests read it here)

DEFAULT_BASE = REPO / "omni_trio" / "models" / "shapes" / "pipeline"
DEFAULT_OUT = REPO / "omni_trio" / "models" / "shapes" / "loras" / "outline"
WEIGHT_NAME = "pytorch_lora_weights.safetensors"
# The UNet's attention projections (8x8 and the middle) and every resnet convolution plus the
# output convolution: an outline is a fine, full-resolution change, which attention at 8x8
# alone cannot draw.
TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0", "conv1", "conv2", "conv_out")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--base", type=Path, default=DEFAULT_BASE, help="base pipeline directory (the shipped)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="adapter directory")
    parser.add_argument("--steps", type=int, default=1000, help="optimiser steps (1000)")
    parser.add_argument("--batch-size", type=int, default=16, help="images per step (16)")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank, alpha = rank (8)")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (3e-3)")
    parser.add_argument("--warmup", type=int, default=50, help="warmup steps (50)")
    parser.add_argument("--ema", type=float, default=0.995, help="EMA decay (0.995)")
    parser.add_argument(
        "--caption-dropout", type=float, default=0.12, help="share of empty captions (0.12)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of everything (0)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.rank < 1 or args.threads < 1:
        parser.error("--steps, --batch-size, --rank and --threads must be >= 1")
    return args


def command_line(args: argparse.Namespace) -> str:
    """The command ``training.json`` records: every option but the paths and --no-progress."""
    return "scripts/train_shapes_lora.py " + " ".join(
        f"--{k.replace('_', '-')} {v}"
        for k, v in sorted(vars(args).items())
        if k not in ("base", "out", "no_progress")
    )


def describe_base(directory: Path) -> dict[str, Any]:
    """The base pipeline the adapter is trained against: its UNet's and text encoder's
    weights' SHA-256 (an adapter is only meaningful on these weights)."""
    return {
        "unet_sha256": _sha256(directory / "unet" / "diffusion_pytorch_model.safetensors"),
        "text_encoder_sha256": _sha256(directory / "text_encoder" / "model.safetensors"),
    }


def load_base(directory: Path) -> Any:
    """The base ``StableDiffusionPipeline`` saved in ``directory`` (CPU, float32)."""
    import importlib.util

    from diffusers import StableDiffusionPipeline

    # diffusers resolves PixelSpaceVAE (model_index.json) from sys.modules.
    import omni_trio.models.shapes._vae  # noqa: F401

    kwargs: dict[str, Any] = {"local_files_only": True}
    if importlib.util.find_spec("accelerate") is None:
        kwargs["low_cpu_mem_usage"] = False  # what diffusers falls back to, minus a warning
    return StableDiffusionPipeline.from_pretrained(Path(directory), **kwargs)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run the training described by ``args``; returns the ``training.json`` record."""
    import numpy as np
    import torch
    from diffusers import DDPMScheduler, StableDiffusionPipeline
    from peft import LoraConfig, get_peft_model_state_dict
    from tqdm import tqdm

    from omni_trio.models.progress_bars import quiet_hf
    from omni_trio.models.shapes._architecture import MAX_TOKENS
    from omni_trio.models.shapes._dataset import make_batch

    torch.set_num_threads(args.threads)
    started = time.monotonic()
    base = describe_base(Path(args.base))
    with quiet_hf():
        pipe = load_base(Path(args.base))
    unet, text_encoder, tokenizer = pipe.unet, pipe.text_encoder, pipe.tokenizer
    unet.requires_grad_(False)
    text_encoder.requires_grad_(False).eval()
    torch.manual_seed(args.seed)
    config = LoraConfig(
        r=args.rank,
        lora_alpha=args.rank,
        init_lora_weights=True,  # A Kaiming-uniform (seeded above), B zero: starts as the base
        target_modules=list(TARGET_MODULES),
    )
    unet.add_adapter(config)
    unet.train()
    params = [p for p in unet.parameters() if p.requires_grad]
    ema_params = [p.detach().clone() for p in params]
    optimiser = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    noise_schedule = DDPMScheduler.from_config(pipe.scheduler.config)
    num_t = noise_schedule.config.num_train_timesteps
    rng = np.random.default_rng(args.seed)
    losses: list[float] = []
    bar = tqdm(
        range(args.steps), desc="train outline LoRA", disable=args.no_progress, file=sys.stderr
    )
    for step in bar:
        images, captions, _ = make_batch(rng, args.batch_size, style="outline")
        drop = rng.random(args.batch_size) < args.caption_dropout
        captions = ["" if d else c for c, d in zip(captions, drop, strict=True)]
        ids = tokenizer(
            captions,
            padding="max_length",
            max_length=MAX_TOKENS,
            truncation=True,
            return_tensors="pt",
        ).input_ids
        x0 = torch.from_numpy(images)
        noise = torch.randn_like(x0)
        t = torch.randint(0, num_t, (args.batch_size,))
        noisy = noise_schedule.add_noise(x0, noise, t)
        target = noise_schedule.get_velocity(x0, noise, t)
        with torch.no_grad():
            embeds = text_encoder(ids)[0]  # what encode_prompt computes
        pred = unet(noisy, t, encoder_hidden_states=embeds).sample
        loss = torch.nn.functional.mse_loss(pred, target)
        optimise(step, loss, optimiser, params, ema_params, args, losses, bar)
    bar.close()
    with torch.no_grad():
        for p, e in zip(params, ema_params, strict=True):
            p.copy_(e)
    wall_s = time.monotonic() - started
    tail = losses[-100:]
    record: dict[str, Any] = {
        "name": "builtin:shapes-outline",
        "version": 1,
        "style": "outline",
        "command": command_line(args),
        "steps": args.steps,
        "batch_size": args.batch_size,
        "rank": args.rank,
        "target_modules": list(TARGET_MODULES),
        "final_loss_mean_last_100": sum(tail) / max(1, len(tail)),
        "wall_s": round(wall_s, 1),
        "threads": args.threads,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        "base": base,
    }
    work = Path(tempfile.mkdtemp(prefix="train-shapes-lora-"))
    try:
        staged = work / "outline"
        StableDiffusionPipeline.save_lora_weights(
            staged,
            # peft's own key names (lora_A / lora_B), which diffusers' loader reads as they
            # are; convert_state_dict_to_diffusers would rename the attention layers' alone
            # to the old lora.down / lora.up, and the loader then skips those.
            unet_lora_layers=get_peft_model_state_dict(unet),
            weight_name=WEIGHT_NAME,
            safe_serialization=True,
            unet_lora_adapter_metadata=unet.peft_config["default"].to_dict(),
        )
        (staged / "training.json").write_text(json.dumps(record, indent=2) + "\n", "utf-8")
        out = Path(args.out)
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(staged, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return record


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    record = train(args)
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
