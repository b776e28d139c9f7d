"""The untrained ``builtin:shapes`` pipeline: its tokenizer and its deterministic build."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from omni_trio.models.shapes import COLOURS, SHAPES
from omni_trio.models.shapes._architecture import (
    MAX_TOKENS,
    VOCABULARY,
    build_untrained_pipeline,
)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_untrained_pipeline(tmp_path_factory.mktemp("arch") / "scratch", seed=3)


def test_every_caption_word_is_one_token(pipe: Any) -> None:
    tokenizer = pipe.tokenizer
    assert set(VOCABULARY) >= {*COLOURS, *SHAPES, "small", "large", "background"}
    for word in VOCABULARY:
        ids = tokenizer(word).input_ids
        assert len(ids) == 3, (word, tokenizer.convert_ids_to_tokens(ids))
        assert tokenizer.convert_ids_to_tokens(ids)[1] == f"{word}</w>"


def test_any_other_prompt_tokenizes_byte_by_byte(pipe: Any) -> None:
    tokenizer = pipe.tokenizer
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("a red hexagon, é!").input_ids)
    assert tokens[1:3] == ["a</w>", "red</w>"]
    assert "h" in tokens
    assert tokenizer.unk_token not in tokens[1:-1]  # (the unknown token is the end token)
    assert tokenizer.model_max_length == MAX_TOKENS


def test_the_pipeline_is_pixel_space_and_deterministic(pipe: Any, tmp_path: Path) -> None:
    p = pipe
    assert p.vae_scale_factor == 1
    assert p.unet.config.sample_size == 32 and p.unet.config.in_channels == 3
    assert p.scheduler.config.prediction_type == "v_prediction"
    again = build_untrained_pipeline(tmp_path / "scratch", seed=3)
    other = build_untrained_pipeline(tmp_path / "scratch-other", seed=4)
    state = p.unet.state_dict()
    assert all(torch.equal(v, again.unet.state_dict()[k]) for k, v in state.items())
    assert not all(torch.equal(v, other.unet.state_dict()[k]) for k, v in state.items())
