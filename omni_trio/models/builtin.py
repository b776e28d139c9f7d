"""Built-in models: a trained text-to-image model shipped in the package, tiny randomly
initialised diffusers pipelines built locally, and the echo fake.

``builtin:shapes`` draws "a red circle", "a small blue square": a 32x32 pixel-space
``StableDiffusionPipeline`` trained here by ``scripts/train_shapes.py`` on procedural shapes
(see :mod:`omni_trio.models.shapes`).  Its weights ship inside the package
(:func:`shapes_dir`, about 9 MB of safetensors) and load from there like a user's directory;
nothing is built or written.

``builtin:tiny-sd`` is the Stable Diffusion architecture shrunk to a few MB (8x8 latents,
64x64 images, a 2-layer CLIP text encoder with a byte-level tokenizer written here, so any
prompt tokenizes) and :class:`~diffusers.EulerDiscreteScheduler` (takes explicit timesteps or
sigmas); ``builtin:tiny-ddim`` an unconditional 32x32 pixel-space UNet with
:class:`~diffusers.DDIMScheduler`.  Both schedulers make exactly one UNet call per step and
draw any step noise from the per-request generators.  Weights are random with fixed seeds:
they produce noise-like images, deterministically.

A built-in pipeline is built once and saved with ``save_pretrained`` under
``cache_dir / "builtin" / "<name>-v<version>"``, then always loaded from there through the same
path as a user directory.  Building writes into a private temporary directory and renames it
into place, so concurrent processes and interrupted builds never expose a partial directory;
a directory is complete only when it holds :data:`MARKER`.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from ..errors import InvalidConfigError

__all__ = [
    "BUILTIN_MODELS",
    "BUILTIN_PREFIX",
    "MARKER",
    "build_builtin_pipeline",
    "builtin_dir",
    "ensure_builtin",
    "shapes_dir",
]

BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS: tuple[str, ...] = (
    "builtin:tiny-sd",
    "builtin:tiny-ddim",
    "builtin:shapes",
    "builtin:echo",
)
# Bump a version when the architecture or seeds change: a new directory is built beside the old.
_DIFFUSERS_BUILTINS: dict[str, int] = {"tiny-sd": 1, "tiny-ddim": 1}
MARKER = "omni_trio_builtin.json"
_SEED = 0
_BOS = "<|startoftext|>"
_EOS = "<|endoftext|>"


def shapes_dir() -> Path:
    """The shipped ``builtin:shapes`` pipeline directory (package data; read-only use)."""
    return Path(__file__).resolve().parent / "shapes" / "pipeline"


def builtin_dir(name: str, cache_dir: Path) -> Path:
    """Where the diffusers built-in ``name`` (``"tiny-sd"``, ``"tiny-ddim"``) lives."""
    return Path(cache_dir) / "builtin" / f"{name}-v{_DIFFUSERS_BUILTINS[name]}"


def _byte_level_alphabet() -> list[str]:
    """The 256 printable characters byte-level BPE uses for the 256 byte values (GPT-2/CLIP)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = [chr(b) for b in printable]
    extra = 0
    for b in range(256):
        if b not in printable:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _write_clip_vocab(directory: Path) -> int:
    """Write ``vocab.json`` + ``merges.txt`` for a merge-free byte-level CLIP tokenizer.

    Every byte is a token, with and without the ``</w>`` end-of-word suffix, so any utf-8
    prompt tokenizes (one token per byte).  Returns the vocabulary size.
    """
    directory.mkdir(parents=True)
    alphabet = _byte_level_alphabet()
    tokens = [*alphabet, *(c + "</w>" for c in alphabet), _BOS, _EOS]
    vocab = {token: i for i, token in enumerate(tokens)}
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), "utf-8")
    (directory / "merges.txt").write_text("#version: 0.2\n", "utf-8")
    return len(vocab)


def _build_tiny_sd(scratch: Path) -> Any:
    import torch
    from diffusers import (
        AutoencoderKL,
        EulerDiscreteScheduler,
        StableDiffusionPipeline,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    vocab_dir = scratch / "tokenizer-source"
    vocab_size = _write_clip_vocab(vocab_dir)
    tokenizer = CLIPTokenizer.from_pretrained(vocab_dir, model_max_length=77, local_files_only=True)
    torch.manual_seed(_SEED)
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            intermediate_size=37,
            num_attention_heads=4,
            num_hidden_layers=2,
            max_position_embeddings=77,
            projection_dim=32,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    torch.manual_seed(_SEED + 1)
    unet = UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=32,
    )
    torch.manual_seed(_SEED + 2)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(16, 16, 32, 32),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=16,
        sample_size=64,
    )
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
    )
    return StableDiffusionPipeline(
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        image_encoder=None,
        requires_safety_checker=False,
    )


def _build_tiny_ddim() -> Any:
    import torch
    from diffusers import DDIMPipeline, DDIMScheduler, UNet2DModel

    torch.manual_seed(_SEED + 3)
    unet = UNet2DModel(
        sample_size=32,
        in_channels=3,
        out_channels=3,
        block_out_channels=(32, 64),
        layers_per_block=1,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"),
        up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=32,
    )
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear", clip_sample=True)
    return DDIMPipeline(unet=unet, scheduler=scheduler)


def build_builtin_pipeline(name: str, scratch: Path) -> Any:
    """Construct the diffusers built-in ``name`` in memory (fixed seeds, nothing downloaded).

    ``scratch`` is an empty-or-missing directory the builder may use for intermediate files
    (the tokenizer's source vocabulary).  The global torch RNG state is left as it was.
    """
    import torch

    if name not in _DIFFUSERS_BUILTINS:
        raise KeyError(name)
    with torch.random.fork_rng(devices=[]):
        if name == "tiny-sd":
            return _build_tiny_sd(Path(scratch))
        return _build_tiny_ddim()


def _fsync_tree(root: Path) -> None:
    """Flush every file under ``root`` so a rename after a crash never exposes empty files."""
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


# How long a build in a separate process may take (about a second here; a loaded machine, or
# a slow disk, longer).
BUILD_TIMEOUT_S = 300.0


def _distributed_rank() -> int | None:
    """This process's rank in an initialised torch.distributed group, else None."""
    import torch

    distributed = getattr(torch, "distributed", None)
    if distributed is None or not distributed.is_available() or not distributed.is_initialized():
        return None
    return int(distributed.get_rank())


def _build_in_subprocess(name: str, cache_dir: Path, target: Path) -> Path:
    """:func:`ensure_builtin` in a fresh interpreter (no torch.distributed group there)."""
    import subprocess
    import sys

    code = (
        "import sys, pathlib\n"
        "from omni_trio.models.builtin import ensure_builtin\n"
        "ensure_builtin(sys.argv[1], pathlib.Path(sys.argv[2]))\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, name, str(cache_dir)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise InvalidConfigError(
            f"building builtin:{name} in {str(cache_dir)!r} took over {BUILD_TIMEOUT_S:g} s",
            field="cache_dir",
        ) from None
    if done.returncode != 0 or not (target / MARKER).is_file():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise InvalidConfigError(
            f"could not build builtin:{name} in {str(cache_dir)!r}: {last}", field="cache_dir"
        )
    return target


def ensure_builtin(name: str, cache_dir: Path) -> Path:
    """Return the directory of the diffusers built-in ``name``, building it if missing.

    Safe against concurrent callers (in any process) and interrupted builds: each builder
    writes a private temporary directory and renames it into place; the first rename wins and
    the others discard their copy.  A directory without :data:`MARKER` (not ours, or damaged)
    is moved aside and rebuilt.
    """
    from .progress_bars import quiet_hf

    target = builtin_dir(name, cache_dir)
    if (target / MARKER).is_file():
        return target
    if _distributed_rank() not in (None, 0):
        # transformers writes a model's weights on rank 0 of an initialised torch.distributed
        # group only: a copy saved here would lack them.  A fresh process, outside the group,
        # builds it (rank 0 may be on another node, with a cache of its own).
        return _build_in_subprocess(name, cache_dir, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        with quiet_hf():
            pipe = build_builtin_pipeline(name, tmp / "scratch")
            out = tmp / "pipeline"
            pipe.save_pretrained(out, safe_serialization=True)
        info = {"name": f"{BUILTIN_PREFIX}{name}", "version": _DIFFUSERS_BUILTINS[name]}
        (out / MARKER).write_text(json.dumps(info) + "\n", "utf-8")
        _fsync_tree(out)
        if target.exists() and not (target / MARKER).is_file():
            aside = target.parent / f".{target.name}.broken-{uuid.uuid4().hex}"
            try:
                target.rename(aside)
            except OSError:
                pass  # someone else moved or replaced it; the rename below decides
            else:
                shutil.rmtree(aside, ignore_errors=True)
        try:
            out.rename(target)
        except OSError:
            # Another builder won the race; its copy is identical (same seeds).
            if not (target / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
