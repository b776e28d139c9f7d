#!/usr/bin/env python
"""Train ``builtin:shapes`` from scratch on the procedural shapes dataset.

    .venv/bin/python scripts/train_shapes.py            # the committed model (defaults)
    .venv/bin/python scripts/train_shapes.py --steps 2 --out /tmp/shapes --loss-png /tmp/l.png

Builds the untrained pipeline (:mod:`omni_trio.models.shapes._architecture`), then trains the
UNet and the text encoder jointly: v-prediction MSE at uniform timesteps, AdamW with a linear
warmup and a cosine decay, gradient clipping, 12 % of captions dropped to the empty prompt (so
classifier-free guidance and negative prompts work), and an exponential moving average of the
weights, which is what is saved.  Every batch is drawn fresh from a seeded generator, so a run
is deterministic for its arguments (CPU, the same thread count).  The pipeline is saved with
``save_pretrained`` (safetensors) into ``--out``, replacing what was there, with a
``training.json`` record; the loss curve goes to ``--loss-png``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "omni_trio" / "models" / "shapes" / "pipeline"
DEFAULT_LOSS_PNG = REPO / "docs" / "images" / "shapes-training-loss.png"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="pipeline directory")
    parser.add_argument("--loss-png", type=Path, default=DEFAULT_LOSS_PNG, help="loss curve")
    parser.add_argument("--steps", type=int, default=1500, help="optimiser steps (1500)")
    parser.add_argument("--batch-size", type=int, default=32, help="images per step (32)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (1e-3)")
    parser.add_argument("--warmup", type=int, default=100, help="warmup steps (100)")
    parser.add_argument("--ema", type=float, default=0.998, help="EMA decay (0.998)")
    parser.add_argument(
        "--caption-dropout", type=float, default=0.12, help="share of empty captions (0.12)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of everything (0)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warmup to ``args.lr``, then a cosine decay to a tenth of it."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def write_loss_png(losses: list[float], path: Path, width: int = 640, height: int = 360) -> None:
    """Plot the raw loss (light) and its running mean (dark) on a log axis, with PIL."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    left, right, top, bottom = 60, width - 20, 30, height - 40
    ink = (0, 0, 0)
    draw.rectangle((left, top, right, bottom), outline=ink)
    draw.text(
        (left, 8), f"builtin:shapes training loss (v-prediction MSE, {len(losses)} steps)", fill=ink
    )
    if losses:
        logs = [math.log10(max(v, 1e-6)) for v in losses]
        lo, hi = min(logs), max(logs)
        hi = hi if hi > lo else lo + 1

        def point(i: int, value: float) -> tuple[float, float]:
            x = left + (right - left) * i / max(1, len(losses) - 1)
            y = bottom - (bottom - top) * (value - lo) / (hi - lo)
            return x, y

        draw.line([point(i, v) for i, v in enumerate(logs)], fill=(170, 190, 230), width=1)
        smooth: list[float] = []
        running = losses[0]
        for v in losses:
            running = 0.97 * running + 0.03 * v
            smooth.append(math.log10(max(running, 1e-6)))
        draw.line([point(i, v) for i, v in enumerate(smooth)], fill=(20, 40, 140), width=2)
        draw.text((4, top), f"{10**hi:.3g}", fill=ink)
        draw.text((4, bottom - 10), f"{10**lo:.3g}", fill=ink)
    draw.text((left, bottom + 8), "0", fill=ink)
    draw.text((right - 40, bottom + 8), f"{len(losses)}", fill=ink)
    draw.text(((left + right) // 2 - 20, bottom + 20), "step (log-scale loss)", fill=ink)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run the training described by ``args``; returns the ``training.json`` record."""
    import numpy as np
    import torch
    from diffusers import DDPMScheduler
    from tqdm import tqdm

    from omni_trio.models.builtin import MARKER
    from omni_trio.models.progress_bars import quiet_hf
    from omni_trio.models.shapes._architecture import MAX_TOKENS, build_untrained_pipeline
    from omni_trio.models.shapes._dataset import make_batch

    torch.set_num_threads(args.threads)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="train-shapes-"))
    try:
        with quiet_hf():
            pipe = build_untrained_pipeline(work / "scratch", seed=args.seed)
        unet, text_encoder, tokenizer = pipe.unet, pipe.text_encoder, pipe.tokenizer
        noise_schedule = DDPMScheduler.from_config(pipe.scheduler.config)
        unet.train()
        text_encoder.train()
        params = [*unet.parameters(), *text_encoder.parameters()]
        ema_unet = copy.deepcopy(unet).eval().requires_grad_(False)
        ema_text = copy.deepcopy(text_encoder).eval().requires_grad_(False)
        ema_params = [*ema_unet.parameters(), *ema_text.parameters()]
        optimiser = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
        rng = np.random.default_rng(args.seed)
        torch.manual_seed(args.seed)
        num_t = noise_schedule.config.num_train_timesteps
        losses: list[float] = []
        bar = tqdm(
            range(args.steps), desc="train shapes", disable=args.no_progress, file=sys.stderr
        )
        for step in bar:
            images, captions, _ = make_batch(rng, args.batch_size)
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
            embeds = text_encoder(ids)[0]  # what encode_prompt computes
            pred = unet(noisy, t, encoder_hidden_states=embeds).sample
            loss = torch.nn.functional.mse_loss(pred, target)
            for group in optimiser.param_groups:
                group["lr"] = learning_rate(step, args)
            optimiser.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimiser.step()
            decay = min(args.ema, (1 + step) / (10 + step))
            with torch.no_grad():
                torch._foreach_lerp_(ema_params, [p.detach() for p in params], 1 - decay)
            losses.append(float(loss.detach()))
            if step % 10 == 0:
                bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.4f}")
        bar.close()
        pipe.unet = ema_unet
        pipe.text_encoder = ema_text
        pipe.register_modules(unet=ema_unet, text_encoder=ema_text)
        wall_s = time.monotonic() - started
        tail = losses[-100:]
        record = {
            "name": "builtin:shapes",
            "version": 1,
            "command": "scripts/train_shapes.py "
            + " ".join(
                f"--{k.replace('_', '-')} {v}"
                for k, v in sorted(vars(args).items())
                if k not in ("out", "loss_png", "no_progress")
            ),
            "steps": args.steps,
            "batch_size": args.batch_size,
            "final_loss_mean_last_100": sum(tail) / max(1, len(tail)),
            "wall_s": round(wall_s, 1),
            "threads": args.threads,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        }
        staged = work / "pipeline"
        with quiet_hf():
            pipe.save_pretrained(staged, safe_serialization=True)
        (staged / "training.json").write_text(json.dumps(record, indent=2) + "\n", "utf-8")
        (staged / MARKER).write_text(
            json.dumps(
                # The sizes it draws well, measured with the judge (docs/user-guide.md).
                {"name": "builtin:shapes", "version": 1, "min_side": 24, "max_side": 64}
            )
            + "\n",
            "utf-8",
        )
        out = Path(args.out)
        if out.exists():
            shutil.rmtree(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(staged, out)
        write_loss_png(losses, Path(args.loss_png))
        return record
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    record = train(args)
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
