"""``validate_request``: every rule rejects with ``InvalidRequestError`` naming its ``param``."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import pytest

from omni_trio._core.request import (
    MAX_REQUEST_ID_LENGTH,
    OUTPUT_TYPES,
    DiffusionRequest,
    RequestLimits,
    SamplingParams,
    image_size,
    validate_request,
)
from omni_trio.errors import InvalidRequestError

LIMITS = RequestLimits(max_pixels=512 * 512, max_prompt_chars=100, max_steps=50, max_outputs=4)


def make_request(
    request_id: str = "r1", prompt: Any = "a cat", **sampling: Any
) -> DiffusionRequest:
    return DiffusionRequest(prompt, SamplingParams(**sampling), request_id=request_id)


def assert_rejected(request: DiffusionRequest, param: str, limits: RequestLimits = LIMITS) -> str:
    with pytest.raises(InvalidRequestError) as info:
        validate_request(request, limits)
    assert info.value.param == param, str(info.value)
    assert isinstance(info.value, ValueError)
    return str(info.value)


# -- data ---------------------------------------------------------------------------------


def test_sampling_defaults() -> None:
    sp = SamplingParams()
    assert sp.height is None and sp.width is None
    assert sp.num_inference_steps == 20
    assert sp.seed is None
    assert sp.output_type == "pil"
    assert sp.total_steps == 20


def test_output_types() -> None:
    assert OUTPUT_TYPES == ("pil", "np", "pt", "latent")


def test_requests_are_frozen_and_replace_copies() -> None:
    req = make_request(seed=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.prompt = "dog"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.sampling.seed = 1  # type: ignore[misc]
    seeded = req.replace(sampling=req.sampling.replace(seed=42))
    assert seeded.sampling.seed == 42
    assert req.sampling.seed is None
    assert seeded.request_id == req.request_id


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"num_inference_steps": 7}, 7),
        ({"num_inference_steps": 7, "sigmas": (1.0, 0.5, 0.0)}, 3),
        ({"num_inference_steps": 7, "timesteps": (999.0, 500.0)}, 2),
        ({"num_inference_steps": 7, "timesteps": (999.0,), "sigmas": (1.0, 0.5, 0.0)}, 1),
    ],
)
def test_total_steps_precedence(kwargs: dict[str, Any], expected: int) -> None:
    assert SamplingParams(**kwargs).total_steps == expected


# -- valid requests -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"height": 512, "width": 512},
        {"height": 8, "width": 8},
        {"height": 256},
        {"num_inference_steps": 1},
        {"num_inference_steps": 50},
        {"guidance_scale": 0},
        {"guidance_scale": 0.0},
        {"guidance_scale": 12},
        {"negative_prompt": "blurry"},
        {"num_outputs_per_prompt": 1},
        {"num_outputs_per_prompt": 4},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"timesteps": (999.0, 500.0, 1.0)},
        {"sigmas": tuple(float(i) for i in range(50))},
        {"extra_args": {"flow_shift": 3.0}},
        {"priority": -10},
        {"priority": 10},
        {"deadline_s": 0.5},
        {"deadline_s": 3600},
        *({"output_type": t} for t in OUTPUT_TYPES),
    ],
    ids=repr,
)
def test_valid_request_passes(kwargs: dict[str, Any]) -> None:
    assert validate_request(make_request(**kwargs), LIMITS) is None


def test_valid_prompts_and_ids() -> None:
    validate_request(make_request(prompt=""), LIMITS)
    validate_request(make_request(prompt="x" * 100), LIMITS)
    validate_request(make_request(request_id="x" * MAX_REQUEST_ID_LENGTH), LIMITS)
    validate_request(make_request(request_id="chatcmpl-42 / ünïcode ✓"), LIMITS)


def test_default_limits_are_used_without_limits() -> None:
    validate_request(make_request(height=4096, width=4096, num_inference_steps=1000))
    with pytest.raises(InvalidRequestError):
        validate_request(make_request(num_inference_steps=1001))


# -- request id ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "rid",
    ["", "x" * (MAX_REQUEST_ID_LENGTH + 1), "a\nb", "tab\there", "nul\x00", "bell\x07", None, 5],
    ids=repr,
)
def test_bad_request_id(rid: Any) -> None:
    assert_rejected(make_request(request_id=rid), "request_id")


def test_overlong_id_message_states_lengths() -> None:
    msg = assert_rejected(make_request(request_id="x" * 300), "request_id")
    assert "300" in msg and str(MAX_REQUEST_ID_LENGTH) in msg


# -- prompt -------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", [None, 3, ["a cat"], b"a cat"], ids=repr)
def test_non_string_prompt(prompt: Any) -> None:
    assert_rejected(make_request(prompt=prompt), "prompt")


def test_overlong_prompt() -> None:
    msg = assert_rejected(make_request(prompt="x" * 101), "prompt")
    assert "101" in msg and "100" in msg


@pytest.mark.parametrize(
    ("prompt", "what"),
    [
        ("\ud800", "lone surrogate U+D800 at index 0"),
        ("a cat \udfff", "lone surrogate U+DFFF at index 6"),
        ("a\x00cat", "control character U+0000 at index 1"),
        ("a cat\x1b[31m", "control character U+001B at index 5"),
        ("a\x85cat", "control character U+0085 at index 1"),
    ],
    ids=repr,
)
def test_prompt_that_cannot_be_carried(prompt: str, what: str) -> None:
    """A lone surrogate cannot be encoded as UTF-8 (it once crashed the worker group in the
    engine's encoder); control characters have no place in a prompt.  Both are rejected at
    admission, naming the character and where it is."""
    msg = assert_rejected(make_request(prompt=prompt), "prompt")
    assert what in msg


def test_prompt_whitespace_and_any_printable_text_pass() -> None:
    for prompt in ("a cat\non a mat\tat noon\r\n", "\U0001f408 ein Kätzchen, 猫", "a" * 100):
        validate_request(make_request(prompt=prompt), LIMITS)


def test_negative_prompt_is_held_to_the_prompt_rules() -> None:
    assert "lone surrogate" in assert_rejected(
        make_request(negative_prompt="blurry \ud83d"), "negative_prompt"
    )
    assert "101" in assert_rejected(make_request(negative_prompt="x" * 101), "negative_prompt")
    assert "control character" in assert_rejected(
        make_request(negative_prompt="\x07"), "negative_prompt"
    )


@pytest.mark.parametrize(
    "extra",
    [{"style": "\ud800"}, {"\udc80": 1}, {"faults": [{"kind": "x\ud800"}]}, {"a": ("\ud800",)}],
    ids=repr,
)
def test_extra_args_strings_must_be_encodable(extra: dict[str, Any]) -> None:
    assert "lone surrogate" in assert_rejected(make_request(extra_args=extra), "extra_args")


def test_extra_args_nesting_is_bounded() -> None:
    deep: Any = "leaf"
    for _ in range(40):
        deep = [deep]
    assert "deeper than" in assert_rejected(make_request(extra_args={"x": deep}), "extra_args")


def test_non_sampling_params() -> None:
    req = DiffusionRequest("a cat", {"height": 64}, request_id="r1")  # type: ignore[arg-type]
    assert_rejected(req, "sampling")


@pytest.mark.parametrize("negative", [3, ["blurry"]], ids=repr)
def test_non_string_negative_prompt(negative: Any) -> None:
    assert_rejected(make_request(negative_prompt=negative), "negative_prompt")


# -- size ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dim", ["height", "width"])
@pytest.mark.parametrize("value", [0, -8, 512.0, "512", True], ids=repr)
def test_non_positive_or_non_int_size(dim: str, value: Any) -> None:
    assert_rejected(make_request(**{dim: value}), dim)


@pytest.mark.parametrize("dim", ["height", "width"])
@pytest.mark.parametrize("value", [1, 7, 12, 513], ids=repr)
def test_size_not_multiple_of_8(dim: str, value: int) -> None:
    msg = assert_rejected(make_request(**{dim: value}), dim)
    assert "multiple of 8" in msg


def test_over_max_pixels() -> None:
    assert_rejected(make_request(height=512, width=520), "size")
    assert_rejected(make_request(height=1024, width=256 + 8), "size")
    validate_request(make_request(height=1024, width=256), LIMITS)  # exactly max_pixels


# -- steps --------------------------------------------------------------------------------


@pytest.mark.parametrize("steps", [0, -1, 51, 2.0, "20", True, None], ids=repr)
def test_steps_outside_range(steps: Any) -> None:
    assert_rejected(make_request(num_inference_steps=steps), "num_inference_steps")


@pytest.mark.parametrize("name", ["timesteps", "sigmas"])
def test_schedule_length_outside_range(name: str) -> None:
    assert_rejected(make_request(**{name: ()}), name)
    assert_rejected(make_request(**{name: tuple(float(i) for i in range(51))}), name)


@pytest.mark.parametrize("name", ["timesteps", "sigmas"])
@pytest.mark.parametrize("value", [5, 2.5, "abc", {1.0: 1}, [999.0, 500.0]], ids=repr)
def test_schedule_must_be_a_sequence(name: str, value: Any) -> None:
    assert_rejected(make_request(**{name: value}), name)


@pytest.mark.parametrize("name", ["timesteps", "sigmas"])
@pytest.mark.parametrize(
    "value", [(1.0, math.nan), (math.inf, 0.0), (1.0, "0.5"), (True, 0.0)], ids=repr
)
def test_schedule_values_must_be_finite_numbers(name: str, value: Any) -> None:
    assert_rejected(make_request(**{name: value}), name)


def test_schedule_of_ints_and_floats_is_accepted() -> None:
    validate_request(make_request(timesteps=(999, 500.0)), LIMITS)


# -- guidance -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "gs", [-0.1, -1, math.nan, math.inf, -math.inf, "7.5", None, True], ids=repr
)
def test_bad_guidance(gs: Any) -> None:
    assert_rejected(make_request(guidance_scale=gs), "guidance_scale")


# -- outputs ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, -1, 5, 17, 2.0, True, None], ids=repr)
def test_num_outputs_outside_range(n: Any) -> None:
    assert_rejected(make_request(num_outputs_per_prompt=n), "num_outputs_per_prompt")


def test_num_outputs_default_limit_is_16() -> None:
    validate_request(make_request(num_outputs_per_prompt=16))
    with pytest.raises(InvalidRequestError) as info:
        validate_request(make_request(num_outputs_per_prompt=17))
    assert info.value.param == "num_outputs_per_prompt"


@pytest.mark.parametrize("output_type", ["png", "PIL", "", None], ids=repr)
def test_unknown_output_type(output_type: Any) -> None:
    msg = assert_rejected(make_request(output_type=output_type), "output_type")
    assert "pil, np, pt, latent" in msg


# -- seed and extras ----------------------------------------------------------------------


@pytest.mark.parametrize("seed", [-1, 2**63, 1.0, "42", True, False], ids=repr)
def test_bad_seed(seed: Any) -> None:
    assert_rejected(make_request(seed=seed), "seed")


@pytest.mark.parametrize("extra", [None, [("a", 1)], "x"], ids=repr)
def test_extra_args_must_be_a_mapping(extra: Any) -> None:
    assert_rejected(make_request(extra_args=extra), "extra_args")


def test_first_failing_rule_is_reported() -> None:
    # A request wrong in several ways names the first field checked: the id.
    assert_rejected(make_request(request_id="", height=3, seed=-1), "request_id")


# -- priority and deadline ------------------------------------------------------------------


@pytest.mark.parametrize("priority", [11, -11, 1.5, True, "1", None], ids=repr)
def test_bad_priority(priority: Any) -> None:
    assert_rejected(make_request(priority=priority), "priority")


def test_the_priority_range_is_the_limits_one() -> None:
    limits = RequestLimits(min_priority=0, max_priority=2)
    msg = assert_rejected(make_request(priority=3), "priority", limits)
    assert "0..2" in msg
    validate_request(make_request(priority=2), limits)


@pytest.mark.parametrize("deadline", [0, -1.0, float("nan"), float("inf"), True, "5"], ids=repr)
def test_bad_deadline(deadline: Any) -> None:
    assert_rejected(make_request(deadline_s=deadline), "deadline_s")


# -- starting from a picture (image-to-image, inpainting) -------------------------------------


def _picture(width: int = 40, height: int = 32, mode: str = "RGB") -> Any:
    from PIL import Image

    return Image.new(mode, (width, height))


def test_the_conditioning_follows_image_and_mask() -> None:
    import numpy as np

    assert SamplingParams().conditioning == "text"
    assert SamplingParams(image=_picture()).conditioning == "image"
    assert SamplingParams(image=_picture(), mask_image=_picture(mode="L")).conditioning == "inpaint"
    arr = np.zeros((32, 40, 3), np.uint8)
    assert SamplingParams(image=arr, mask_image=arr[:, :, 0]).conditioning == "inpaint"


@pytest.mark.parametrize(
    ("kwargs", "strength", "steps"),
    [
        ({}, 1.0, 20),
        ({"image": True}, 0.8, 16),  # diffusers' image-to-image default
        ({"image": True, "mask_image": True}, 1.0, 20),  # and its inpainting default
        ({"image": True, "strength": 0.6}, 0.6, 12),
        ({"image": True, "strength": 0.33}, 0.33, 6),  # int(20 * 0.33): rounded down
        ({"image": True, "strength": 1}, 1.0, 20),
    ],
)
def test_strength_cuts_the_steps_as_diffusers_does(
    kwargs: dict[str, Any], strength: float, steps: int
) -> None:
    picture = _picture()
    for name in ("image", "mask_image"):
        if kwargs.get(name) is True:
            kwargs[name] = picture
    sp = SamplingParams(num_inference_steps=20, **kwargs)
    assert sp.effective_strength == strength
    assert sp.total_steps == steps


def test_images_do_not_take_part_in_equality() -> None:
    import numpy as np

    a = SamplingParams(image=np.zeros((8, 8, 3), np.uint8), seed=1)
    b = SamplingParams(image=np.ones((8, 8, 3), np.uint8), seed=1)
    assert a == b  # arrays would make == ambiguous; pictures are compared by identity
    assert a != b.replace(seed=2)


def test_image_requests_that_validate() -> None:
    import numpy as np

    for sampling in (
        SamplingParams(image=_picture()),
        SamplingParams(image=_picture(mode="RGBA"), strength=0.5),
        SamplingParams(image=np.zeros((16, 24), np.uint8), mask_image=np.zeros((16, 24), np.uint8)),
        SamplingParams(image=np.zeros((16, 24, 4), np.uint8), mask_image=_picture(24, 16, "L")),
    ):
        validate_request(DiffusionRequest("p", sampling, "r"))


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"mask_image": "picture"}, "mask_image", "needs an image"),
        ({"strength": 0.5}, "strength", "only to a request with an image"),
        ({"image": "a.png"}, "image", "PIL image or an (H, W)"),
        ({"image": b"\x89PNG"}, "image", "not bytes"),
        ({"image": "f32"}, "image", "uint8 array"),
        ({"image": "5ch"}, "image", "uint8 array"),
        ({"image": "tiny"}, "image", "at least 8"),
        ({"image": "huge"}, "image", "at most 4096 allowed"),
        ({"image": "picture", "mask_image": 7}, "mask_image", "not int"),
        ({"image": "picture", "mask_image": "small"}, "mask_image", "they must match"),
        ({"image": "picture", "strength": 0}, "strength", "(0, 1]"),
        ({"image": "picture", "strength": 1.5}, "strength", "(0, 1]"),
        ({"image": "picture", "strength": math.nan}, "strength", "(0, 1]"),
        ({"image": "picture", "strength": True}, "strength", "(0, 1]"),
        ({"image": "picture", "timesteps": (1.0, 2.0)}, "timesteps", "cannot be combined"),
        ({"image": "picture", "sigmas": (1.0, 0.0)}, "sigmas", "cannot be combined"),
        ({"image": "picture", "strength": 0.04}, "strength", "runs no step"),
    ],
)
def test_bad_pictures_are_refused_naming_the_field(
    kwargs: dict[str, Any], param: str, message: str
) -> None:
    import numpy as np

    named = {
        "picture": _picture(),
        "f32": np.zeros((16, 16, 3), np.float32),
        "5ch": np.zeros((16, 16, 5), np.uint8),
        "tiny": _picture(4, 16),
        "huge": np.zeros((80, 80), np.uint8),
        "small": _picture(8, 8, "L"),
    }
    kwargs = {k: named.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    if "mask_image" in kwargs and "image" not in kwargs:
        kwargs["mask_image"] = _picture()
    limits = RequestLimits(max_image_pixels=4096)
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as info:
        validate_request(DiffusionRequest("p", SamplingParams(**kwargs), "r"), limits)
    assert info.value.param == param


def test_a_picture_is_bounded_by_max_image_pixels_not_by_the_output_bound() -> None:
    # A big photo resized to a small size is fine: max_pixels bounds the size rendered.
    sampling = SamplingParams(image=_picture(96, 96), height=32, width=32)
    validate_request(DiffusionRequest("p", sampling, "r"), RequestLimits(max_pixels=32 * 32))


def test_image_size_reads_pil_and_arrays_and_nothing_else() -> None:
    import numpy as np

    assert image_size(_picture(40, 32)) == (40, 32)
    assert image_size(np.zeros((32, 40, 3), np.uint8)) == (40, 32)
    assert image_size(np.zeros((32, 40), np.uint8)) == (40, 32)
    assert image_size(np.zeros((32, 40, 2), np.uint8)) is None
    assert image_size(np.zeros((32, 40, 3), np.int64)) is None
    assert image_size("32x40") is None


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        (None, ()),
        ((), ()),
        ("outline", (("outline", 1.0),)),
        (("outline", 0.5), (("outline", 0.5),)),
        (["b", ("a", -2)], (("a", -2.0), ("b", 1.0))),
        ([{"name": "a", "scale": 3}], (("a", 3.0),)),
        ({"name": "a"}, (("a", 1.0),)),
        (("a", "b"), (("a", 1.0), ("b", 1.0))),  # two names, not a (name, scale) pair
        (["a", 0.5], (("a", 0.5),)),  # JSON's form of a pair
    ],
)
def test_lora_is_made_canonical(given: Any, canonical: Any) -> None:
    from omni_trio._core.request import canonical_lora

    assert canonical_lora(given) == canonical


@pytest.mark.parametrize(
    "bad",
    [
        5,
        [("a", 1.0, 2)],
        [("a", math.nan)],
        [("a", 11)],
        [("a", True)],
        ["a", "a"],
        [""],
        ["bad\nname"],
        [{"name": "a", "weight": 1}],
        [{"scale": 1}],
    ],
)
def test_bad_lora_is_refused_naming_the_field(bad: Any) -> None:
    from omni_trio._core.request import canonical_lora

    with pytest.raises(InvalidRequestError) as info:
        canonical_lora(bad)
    assert info.value.param == "lora"
    request = DiffusionRequest("p", SamplingParams(lora=bad), "r")
    with pytest.raises(InvalidRequestError):
        validate_request(request)
