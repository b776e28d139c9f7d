#!/usr/bin/env python
"""Train ``builtin:shapes`` on the procedural shapes dataset, or fine-tune saved weights.

    .venv/bin/python scripts/train_shapes.py --out /tmp/shapes-base     # the base model
    .venv/bin/python scripts/train_shapes.py --init-from /tmp/shapes-base --steps 300 \
        --warmup 20 --lr 0.0002 --ema 0.99 --recolour-share 0.45 \
        --recolour-keep-share 0.35                                   # the committed model
    .venv/bin/python scripts/train_shapes.py --steps 2 --out /tmp/shapes --loss-png /tmp/l.png

(docs/user-guide.md gives the exact fine-tune command, which training.json records.)

From scratch it builds the untrained pipeline
(:mod:`omni_trio.models.shapes._architecture`), then trains the UNet and the text encoder
jointly: v-prediction MSE at uniform timesteps, AdamW with a linear warmup and a cosine
decay, gradient clipping, 12 % of captions dropped to the empty prompt (so classifier-free
guidance and negative prompts work), and an exponential moving average of the weights, which
is what is saved.  ``--init-from DIR`` starts from the pipeline saved in ``DIR`` instead (a
fresh optimiser and an EMA starting at those weights), which is how the committed weights
were made: the base run with the defaults, then a short fine-tune.

``--recolour-share P`` is SDEdit-style training for image-to-image: of each batch's examples
whose caption was not dropped, a share ``P`` is noised from a *source* picture -- the same
shape at the same place and size in another colour -- at a timestep drawn from
``--recolour-t-min`` .. ``--recolour-t-max`` (the timesteps image-to-image starts from and
passes through at strength ~0.5-0.7 with 20 steps), while the target stays the captioned
picture: the v that makes the model's estimate of the clean picture the captioned one,
``v* = (sqrt(a_t) * x_t - x0) / sqrt(1 - a_t)``.  The rest of the batch is ordinary training,
so text-to-image does not drift.  With ``P`` 0 (the default) no extra random number is drawn:
the run is the plain one.

``--recolour-keep-share Q`` turns a share ``Q`` of those examples into *keep* examples: the
same mismatched source, but at a timestep of 0 .. ``--recolour-keep-t-max`` (149: the last
three of 20 steps) and with the source itself as the target, ordinary training on a caption
that contradicts the picture.  Without them the recolouring leaks to the last steps, where
the model then fights any region of another colour it cannot change: inpainting only part of
a red circle as "a green square" filled the repainted half with speckles.  With them the
last steps keep what is there, as the base model does.

Every batch is drawn fresh from a seeded generator, so a run is deterministic for its
arguments (CPU, the same thread count, and for a fine-tune the same starting weights).  The
pipeline is saved with ``save_pretrained`` (safetensors) into ``--out``, replacing what was
there, with a ``training.json`` record (a fine-tune's records the one it started from under
``"base"``, and its other files but the weights are the base's, byte for byte); the loss
curve goes to ``--loss-png`` (by default
``docs/images/shapes-training-loss.png`` from scratch, none for a fine-tune).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
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
# Image-to-image with 20 steps starts at timestep 499 / 599 / 699 for strength 0.5 / 0.6 / 0.7
# (DPM-Solver++, trailing spacing: 999, 949, ..., 49) and passes the ones below.
RECOLOUR_T_MIN = 400
RECOLOUR_T_MAX = 700
# Keep examples' timesteps: the last steps of a 20-step schedule (149, 99, 49), where a model
# that recolours unasked fills an inpainted region with speckles.
KEEP_T_MAX = 149
# Options of a fine-tune, recorded in its command only when --init-from is given (a run from
# scratch records the command it always did).
_FINE_TUNE_OPTIONS = (
    "init_from",
    "recolour_share",
    "recolour_t_min",
    "recolour_t_max",
    "recolour_keep_share",
    "recolour_keep_t_max",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="pipeline directory")
    parser.add_argument(
        "--loss-png",
        type=Path,
        default=None,
        help="loss curve (default docs/images/shapes-training-loss.png; none with --init-from)",
    )
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
    parser.add_argument(
        "--init-from", type=Path, default=None, help="fine-tune the pipeline saved in this dir"
    )
    parser.add_argument(
        "--recolour-share",
        type=float,
        default=0.0,
        help="share of captioned examples noised from a recoloured source (0)",
    )
    parser.add_argument(
        "--recolour-t-min",
        type=int,
        default=RECOLOUR_T_MIN,
        help=f"lowest timestep of the recolour examples ({RECOLOUR_T_MIN})",
    )
    parser.add_argument(
        "--recolour-t-max",
        type=int,
        default=RECOLOUR_T_MAX,
        help=f"highest timestep of the recolour examples ({RECOLOUR_T_MAX})",
    )
    parser.add_argument(
        "--recolour-keep-share",
        type=float,
        default=0.0,
        help="share of the recolour examples that keep their source's colour, at timesteps "
        "0 .. --recolour-keep-t-max (0)",
    )
    parser.add_argument(
        "--recolour-keep-t-max",
        type=int,
        default=KEEP_T_MAX,
        help=f"highest timestep of the keep examples ({KEEP_T_MAX})",
    )
    args = parser.parse_args(argv)
    if not 0.0 <= args.recolour_share <= 1.0:
        parser.error(f"--recolour-share must be in [0, 1], got {args.recolour_share}")
    if not 0 <= args.recolour_t_min <= args.recolour_t_max <= 999:
        parser.error("need 0 <= --recolour-t-min <= --recolour-t-max <= 999")
    if not 0.0 <= args.recolour_keep_share <= 1.0:
        parser.error(f"--recolour-keep-share must be in [0, 1], got {args.recolour_keep_share}")
    if args.recolour_keep_share > 0 and not 0 <= args.recolour_keep_t_max < args.recolour_t_min:
        parser.error("keep examples need 0 <= --recolour-keep-t-max < --recolour-t-min")
    if args.loss_png is None and args.init_from is None:
        args.loss_png = DEFAULT_LOSS_PNG
    return args


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warmup to ``args.lr``, then a cosine decay to a tenth of it."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def optimise(
    step: int,
    loss: Any,
    optimiser: Any,
    params: list[Any],
    ema_params: list[Any],
    args: argparse.Namespace,
    losses: list[float],
    bar: Any,
) -> None:
    """One optimiser step on ``loss`` (scheduled learning rate, gradient clipping at 1.0),
    the exponential moving average of ``params`` into ``ema_params``, and the loss logged.
    Shared with ``scripts/train_shapes_lora.py``."""
    import torch

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


def recoloured(scene: Any, rng: Any) -> Any:
    """``scene`` in another named colour (jittered as the dataset jitters): the same shape,
    size and place, what a recolour example is noised from."""
    from omni_trio.models.shapes._dataset import COLOURS, sample_scene

    others = [name for name in COLOURS if name != scene.colour]
    colour = others[int(rng.integers(len(others)))]
    drawn = sample_scene(rng, shape=scene.shape, colour=colour, size=scene.size)
    return dataclasses.replace(scene, colour=colour, rgb=drawn.rgb)


def command_line(args: argparse.Namespace) -> str:
    """The command ``training.json`` records: every option but the output paths.  The
    fine-tune options appear only for a fine-tune or with recolour examples."""
    fine_tune = args.init_from is not None or args.recolour_share > 0
    return "scripts/train_shapes.py " + " ".join(
        f"--{k.replace('_', '-')} {v}"
        for k, v in sorted(vars(args).items())
        if k not in ("out", "loss_png", "no_progress")
        and (fine_tune or k not in _FINE_TUNE_OPTIONS)
    )


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def describe_base(directory: Path) -> dict[str, Any]:
    """What a fine-tune started from: the directory as given, its weights' SHA-256 and its
    own ``training.json`` record (None if it has none)."""
    record_path = directory / "training.json"
    return {
        "path": str(directory),
        "unet_sha256": _sha256(directory / "unet" / "diffusion_pytorch_model.safetensors"),
        "text_encoder_sha256": _sha256(directory / "text_encoder" / "model.safetensors"),
        "training": json.loads(record_path.read_text("utf-8")) if record_path.is_file() else None,
    }


def _load_pipeline(args: argparse.Namespace, scratch: Path) -> Any:
    """The pipeline to train: ``--init-from``'s, or the untrained one for ``--seed``."""
    from omni_trio.models.shapes._architecture import build_untrained_pipeline

    if args.init_from is None:
        return build_untrained_pipeline(scratch, seed=args.seed)
    import importlib.util

    from diffusers import StableDiffusionPipeline

    # diffusers resolves PixelSpaceVAE (model_index.json) from sys.modules.
    import omni_trio.models.shapes._vae  # noqa: F401

    kwargs: dict[str, Any] = {"local_files_only": True}
    if importlib.util.find_spec("accelerate") is None:
        kwargs["low_cpu_mem_usage"] = False  # what diffusers falls back to, minus a warning
    return StableDiffusionPipeline.from_pretrained(Path(args.init_from), **kwargs)


def keep_base_files(base: Path, staged: Path) -> None:
    """Put ``base``'s own copy back over every file of the ``staged`` fine-tune but the
    weights (``*.safetensors``): a fine-tune changes weights only.  Saved as loaded, each
    config would record the base's directory (``_name_or_path``, often a temporary one) and
    the tokenizer's config the keyword arguments it was loaded and called with."""
    for path in sorted(staged.rglob("*")):
        if path.is_file() and path.suffix != ".safetensors":
            original = base / path.relative_to(staged)
            if original.is_file():
                shutil.copyfile(original, path)


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run the training described by ``args``; returns the ``training.json`` record."""
    import numpy as np
    import torch
    from diffusers import DDPMScheduler
    from tqdm import tqdm

    from omni_trio.models.builtin import MARKER
    from omni_trio.models.progress_bars import quiet_hf
    from omni_trio.models.shapes._architecture import MAX_TOKENS
    from omni_trio.models.shapes._dataset import make_batch, render_scene

    torch.set_num_threads(args.threads)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="train-shapes-"))
    try:
        base = None if args.init_from is None else describe_base(Path(args.init_from))
        with quiet_hf():
            pipe = _load_pipeline(args, work / "scratch")
        unet, text_encoder, tokenizer = pipe.unet, pipe.text_encoder, pipe.tokenizer
        noise_schedule = DDPMScheduler.from_config(pipe.scheduler.config)
        alphas_cumprod = noise_schedule.alphas_cumprod
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
        recolour_examples = keep_examples = 0
        bar = tqdm(
            range(args.steps), desc="train shapes", disable=args.no_progress, file=sys.stderr
        )
        for step in bar:
            images, captions, scenes = make_batch(rng, args.batch_size)
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
            if args.recolour_share > 0:
                # SDEdit-style: noised from the same shape in another colour, at the
                # timesteps image-to-image runs, with the captioned picture as the target.
                chosen = ~drop & (rng.random(args.batch_size) < args.recolour_share)
                sources = images.copy()
                for i in np.flatnonzero(chosen):
                    picture = render_scene(recoloured(scenes[i], rng))
                    sources[i] = picture.transpose(2, 0, 1) * 2.0 - 1.0
                t_recolour = torch.randint(
                    args.recolour_t_min, args.recolour_t_max + 1, (args.batch_size,)
                )
                # Keep examples: at the last timesteps a picture keeps its colour whatever
                # the caption says, as inpainting needs when the region it keeps has another
                # colour than the prompt's (no extra draw without them).
                keep = np.zeros_like(chosen)
                if args.recolour_keep_share > 0:
                    keep = chosen & (rng.random(args.batch_size) < args.recolour_keep_share)
                    t_keep = torch.randint(0, args.recolour_keep_t_max + 1, (args.batch_size,))
                    t_recolour = torch.where(torch.from_numpy(keep), t_keep, t_recolour)
                rows = torch.from_numpy(chosen & ~keep).view(-1, 1, 1, 1)
                t = torch.where(torch.from_numpy(chosen), t_recolour, t)
                noisy = noise_schedule.add_noise(torch.from_numpy(sources), noise, t)
                a_t = alphas_cumprod[t].view(-1, 1, 1, 1)
                # x0_hat = sqrt(a) x_t - sqrt(1 - a) v  is x0 for this v:
                v_star = (a_t.sqrt() * noisy - x0) / (1 - a_t).sqrt()
                # The ordinary target elsewhere: of the source for a keep example.
                keep_rows = torch.from_numpy(keep).view(-1, 1, 1, 1)
                clean = torch.where(keep_rows, torch.from_numpy(sources), x0)
                velocity = noise_schedule.get_velocity(clean, noise, t)
                target = torch.where(rows, v_star, velocity)
                recolour_examples += int((chosen & ~keep).sum())
                keep_examples += int(keep.sum())
            else:
                noisy = noise_schedule.add_noise(x0, noise, t)
                target = noise_schedule.get_velocity(x0, noise, t)
            embeds = text_encoder(ids)[0]  # what encode_prompt computes
            pred = unet(noisy, t, encoder_hidden_states=embeds).sample
            loss = torch.nn.functional.mse_loss(pred, target)
            optimise(step, loss, optimiser, params, ema_params, args, losses, bar)
        bar.close()
        pipe.unet = ema_unet
        pipe.text_encoder = ema_text
        pipe.register_modules(unet=ema_unet, text_encoder=ema_text)
        wall_s = time.monotonic() - started
        tail = losses[-100:]
        record: dict[str, Any] = {
            "name": "builtin:shapes",
            "version": 1,
            "command": command_line(args),
            "steps": args.steps,
            "batch_size": args.batch_size,
            "final_loss_mean_last_100": sum(tail) / max(1, len(tail)),
            "wall_s": round(wall_s, 1),
            "threads": args.threads,
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}",
        }
        if args.recolour_share > 0:
            record["recolour_examples"] = recolour_examples
        if args.recolour_keep_share > 0:
            record["keep_examples"] = keep_examples
        if base is not None:
            record["base"] = base
        staged = work / "pipeline"
        with quiet_hf():
            pipe.save_pretrained(staged, safe_serialization=True)
        if args.init_from is not None:
            keep_base_files(Path(args.init_from), staged)
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
        if args.loss_png is not None:
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
