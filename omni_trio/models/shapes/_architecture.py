"""The ``builtin:shapes`` architecture, untrained: what ``scripts/train_shapes.py`` trains.

A ``StableDiffusionPipeline`` whose "latents" are pixels:

- ``unet``: a small ``UNet2DConditionModel`` on 32x32x3 pixels (channels 24/48/96,
  cross-attention at 8x8 and in the middle block), trained to predict v;
- ``text_encoder``: a 2-layer ``CLIPTextModel`` (width 64), trained from scratch with the UNet;
- ``tokenizer``: a ``CLIPTokenizer`` whose vocabulary is every byte (so any prompt tokenizes)
  plus one token per caption word (merges written here), 20 tokens long;
- ``vae``: :class:`~omni_trio.models.shapes._vae.PixelSpaceVAE` (the identity);
- ``scheduler``: ``DPMSolverMultistepScheduler`` (DPM-Solver++ 2M; cosine schedule,
  v-prediction, trailing timesteps, the predicted clean image clipped to [-1, 1]).

Everything is built locally from fixed seeds; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ._dataset import COLOURS, IMAGE_SIZE, SHAPES, SIZES

__all__ = ["MAX_TOKENS", "VOCABULARY", "build_untrained_pipeline", "write_tokenizer"]

MAX_TOKENS = 20
# One token each; any other word is spelled out byte by byte.
VOCABULARY: tuple[str, ...] = (
    "a",
    "an",
    "the",
    *SIZES,
    *COLOURS,
    *SHAPES,
    "on",
    "white",
    "background",
)


def write_tokenizer(directory: Path) -> int:
    """Write ``vocab.json`` + ``merges.txt`` for the tokenizer into ``directory`` (created);
    returns the vocabulary size.

    The byte-level alphabet of :mod:`omni_trio.models.builtin` (every byte, with and without
    ``</w>``), then for each word of :data:`VOCABULARY` the left-to-right merges that join it
    into one ``word</w>`` token.  Byte-level BPE applies the lowest-ranked merge first, so
    merges are ordered word by word, longest word first.
    """
    from ..builtin import _BOS, _EOS, _byte_level_alphabet

    directory.mkdir(parents=True)
    alphabet = _byte_level_alphabet()
    tokens = [*alphabet, *(c + "</w>" for c in alphabet)]
    merges: list[str] = []
    seen = set(tokens)
    for word in sorted(VOCABULARY, key=lambda w: (-len(w), w)):
        pieces = [*word[:-1], word[-1] + "</w>"]
        left = pieces[0]
        for piece in pieces[1:]:
            merged = left + piece
            line = f"{left} {piece}"
            if merged not in seen:
                merges.append(line)
                tokens.append(merged)
                seen.add(merged)
            left = merged
    tokens += [_BOS, _EOS]
    vocab = {token: i for i, token in enumerate(tokens)}
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), "utf-8")
    (directory / "merges.txt").write_text(
        "#version: 0.2\n" + "".join(m + "\n" for m in merges), "utf-8"
    )
    return len(vocab)


def build_untrained_pipeline(scratch: Path, seed: int = 0) -> Any:
    """The untrained pipeline, deterministic for ``seed``.  ``scratch`` is a missing directory
    the builder writes the tokenizer's source files into."""
    import torch
    from diffusers import DPMSolverMultistepScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    from ._vae import PixelSpaceVAE

    vocab_dir = Path(scratch) / "tokenizer-source"
    vocab_size = write_tokenizer(vocab_dir)
    tokenizer = CLIPTokenizer.from_pretrained(
        vocab_dir, model_max_length=MAX_TOKENS, local_files_only=True
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=vocab_size,
                hidden_size=64,
                intermediate_size=128,
                num_attention_heads=4,
                num_hidden_layers=2,
                max_position_embeddings=MAX_TOKENS,
                projection_dim=64,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
        torch.manual_seed(seed + 1)
        unet = UNet2DConditionModel(
            sample_size=IMAGE_SIZE,
            in_channels=3,
            out_channels=3,
            block_out_channels=(24, 48, 96),
            layers_per_block=1,
            # Text conditions the 8x8 level and the middle: colour and shape are coarse.
            down_block_types=("DownBlock2D", "DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
            cross_attention_dim=64,
            attention_head_dim=8,
            norm_num_groups=8,
        )
    # DPM-Solver++ works on the predicted clean image, so thresholding at 1.0 (clipping it to
    # [-1, 1]) keeps guidance 7.5 in range; DDIM clips it too but then steps with the
    # unclipped noise, and its pictures blow up at guidance above ~2.
    scheduler = DPMSolverMultistepScheduler(
        num_train_timesteps=1000,
        beta_schedule="squaredcos_cap_v2",
        prediction_type="v_prediction",
        algorithm_type="dpmsolver++",
        solver_order=2,
        thresholding=True,
        sample_max_value=1.0,
        timestep_spacing="trailing",
        steps_offset=1,
    )
    return StableDiffusionPipeline(
        vae=PixelSpaceVAE(),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        image_encoder=None,
        requires_safety_checker=False,
    )
