"""ModelInfo: what admission asks a model (default and fixed sizes, the warmup request)."""

from __future__ import annotations

import pytest

from omni_trio._core.model_info import ModelInfo
from omni_trio.errors import InvalidRequestError

FREE = ModelInfo("sd", "text2image", True, 512, 768, True, supports_steps=True)
FIXED = ModelInfo("ddim", "unconditional", True, 32, 32, False, fixed_size=True)


def test_unset_sides_take_the_default_and_set_ones_stay() -> None:
    assert FREE.resolve_size(None, None) == (512, 768)
    assert FREE.resolve_size(64, None) == (64, 768)
    assert FREE.resolve_size(64, 128) == (64, 128)


def test_a_fixed_size_model_renders_only_its_own_size() -> None:
    assert FIXED.resolve_size(None, None) == (32, 32)
    assert FIXED.resolve_size(32, None) == (32, 32)
    with pytest.raises(InvalidRequestError, match=r"only renders 32x32, not 64x32") as info:
        FIXED.resolve_size(32, 64)
    assert info.value.param == "size"


def test_sizes_below_the_models_smallest_side_are_refused() -> None:
    info = ModelInfo("m", "text2image", True, 64, 64, True, min_side=24)
    assert info.resolve_size(24, 200) == (24, 200)
    with pytest.raises(InvalidRequestError, match=r"from 24x24 up, not 64x16") as refused:
        info.resolve_size(16, 64)
    assert refused.value.param == "size"


def test_warmup_is_small_and_seeded() -> None:
    warm = FREE.warmup_sampling()
    assert (warm.height, warm.width, warm.num_inference_steps, warm.seed) == (64, 64, 2, 0)
    small = ModelInfo("tiny", "echo", True, 32, 48, False).warmup_sampling()
    assert (small.height, small.width) == (32, 32)
    fixed = FIXED.warmup_sampling()
    assert (fixed.height, fixed.width) == (None, None)  # admission resolves its one size


def test_fixed_size_defaults_to_what_the_family_implies() -> None:
    assert ModelInfo("u", "unconditional", True, 32, 32, False).fixed_size is True
    assert ModelInfo("t", "text2image", True, 64, 64, True).fixed_size is False
    assert ModelInfo("t", "text2image", True, 64, 64, True, fixed_size=True).fixed_size is True


def test_sizes_above_the_models_largest_side_are_refused() -> None:
    info = ModelInfo("shapes", "text2image", True, 32, 32, True, min_side=24, max_side=64)
    assert info.resolve_size(64, 24) == (64, 24)
    with pytest.raises(InvalidRequestError, match=r"up to 64x64, not 128x128") as refused:
        info.resolve_size(128, 128)
    assert refused.value.param == "size"


def test_warmup_never_goes_below_the_smallest_side() -> None:
    info = ModelInfo("m", "text2image", True, 16, 16, True, min_side=24)
    warm = info.warmup_sampling()
    assert (warm.height, warm.width) == (24, 24)


def test_extra_args_keys_the_model_does_not_read_are_refused() -> None:
    reads = ModelInfo("echo", "echo", True, 64, 64, False, extra_args=frozenset({"delay"}))
    reads.check_extra_args({"delay": 1, "faults": []})  # faults are the runtime's own
    with pytest.raises(InvalidRequestError, match=r"does not read extra_args 'strength'") as info:
        reads.check_extra_args({"delay": 1, "strength": 0.5})
    assert info.value.param == "extra_args" and "it reads: delay" in str(info.value)
    none = ModelInfo("sd", "text2image", True, 64, 64, True, extra_args=frozenset())
    with pytest.raises(InvalidRequestError, match=r"it reads: none"):
        none.check_extra_args({"lora": "x"})
    FREE.check_extra_args({"anything": 1})  # None: the model checks its own


def test_an_unconditional_model_names_the_fields_it_ignores() -> None:
    from omni_trio._core.request import SamplingParams

    info = ModelInfo(
        "ddim",
        "unconditional",
        True,
        32,
        32,
        False,
        ignored_params=frozenset({"prompt", "negative_prompt", "guidance_scale"}),
    )
    assert info.ignored(SamplingParams()) == ("prompt",)
    both = SamplingParams(negative_prompt="blurry", guidance_scale=3.0)
    assert info.ignored(both) == ("prompt", "negative_prompt", "guidance_scale")
    assert FREE.ignored(both) == ()
