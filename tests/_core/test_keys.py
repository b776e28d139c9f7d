"""Compatibility keys: which requests may share a wave (request mode) or batch (step mode)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import pytest

from omni_trio._core.keys import request_batch_key, step_batch_key
from omni_trio._core.request import DiffusionRequest, SamplingParams

KeyFn = Callable[[DiffusionRequest], Hashable]
BOTH: list[KeyFn] = [request_batch_key, step_batch_key]

BASE: dict[str, Any] = {"height": 512, "width": 512, "guidance_scale": 7.5}


def make_request(
    request_id: str = "r1",
    prompt: str = "a cat",
    condition_key: Hashable | None = None,
    **sampling: Any,
) -> DiffusionRequest:
    return DiffusionRequest(
        prompt,
        SamplingParams(**{**BASE, **sampling}),
        request_id=request_id,
        condition_key=condition_key,
    )


@pytest.mark.parametrize("key_fn", BOTH, ids=lambda f: f.__name__)
def test_keys_are_hashable_and_deterministic(key_fn: KeyFn) -> None:
    a = key_fn(make_request(timesteps=(1.0, 2.0)))
    b = key_fn(make_request(timesteps=(1.0, 2.0)))
    assert a == b
    assert hash(a) == hash(b)


def test_request_and_step_keys_never_collide() -> None:
    req = make_request()
    assert request_batch_key(req) != step_batch_key(req)


@pytest.mark.parametrize("key_fn", BOTH, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "change",
    [
        {"seed": 1},
        {"seed": 2**63 - 1},
        {"prompt": "a dog"},
        {"request_id": "other"},
        {"negative_prompt": "blurry"},  # against "ugly": only presence matters
    ],
    ids=repr,
)
def test_request_local_fields_do_not_change_the_key(key_fn: KeyFn, change: dict[str, Any]) -> None:
    base = make_request(seed=0, negative_prompt="ugly")
    fields = {"request_id": base.request_id, "prompt": base.prompt}
    sampling = {**BASE, "seed": 0, "negative_prompt": "ugly"}
    for name, value in change.items():
        if name in fields:
            fields[name] = value
        else:
            sampling[name] = value
    other = DiffusionRequest(fields["prompt"], SamplingParams(**sampling), fields["request_id"])
    assert key_fn(other) == key_fn(base)


@pytest.mark.parametrize("key_fn", BOTH, ids=lambda f: f.__name__)
def test_seed_is_never_in_the_key(key_fn: KeyFn) -> None:
    keys = {key_fn(make_request(seed=s)) for s in (None, 0, 1, 12345)}
    assert len(keys) == 1


SHARED_CHANGES: list[dict[str, Any]] = [
    {"height": 768},
    {"width": 768},
    {"height": None},
    {"guidance_scale": 1.0},
    {"negative_prompt": "blurry"},  # against None: presence changes the key
    {"num_outputs_per_prompt": 2},
    {"output_type": "np"},
    {"condition_key": ("ref-image", 3)},
]


def _with(change: dict[str, Any]) -> DiffusionRequest:
    change = dict(change)
    condition_key = change.pop("condition_key", None)
    return make_request(condition_key=condition_key, **change)


@pytest.mark.parametrize("key_fn", BOTH, ids=lambda f: f.__name__)
@pytest.mark.parametrize("change", SHARED_CHANGES, ids=repr)
def test_each_shared_field_changes_the_key(key_fn: KeyFn, change: dict[str, Any]) -> None:
    assert key_fn(_with(change)) != key_fn(make_request())


@pytest.mark.parametrize(
    "change",
    [
        {"num_inference_steps": 30},
        {"timesteps": (999.0, 500.0)},
        {"sigmas": (1.0, 0.0)},
    ],
    ids=repr,
)
def test_schedule_changes_the_request_key(change: dict[str, Any]) -> None:
    assert request_batch_key(make_request(**change)) != request_batch_key(make_request())


@pytest.mark.parametrize(
    "change",
    [
        {"num_inference_steps": 30},
        {"num_inference_steps": 1},
        {"timesteps": (999.0, 500.0)},
        {"sigmas": (1.0, 0.5, 0.0)},
    ],
    ids=repr,
)
def test_step_key_ignores_steps_and_schedule(change: dict[str, Any]) -> None:
    assert step_batch_key(make_request(**change)) == step_batch_key(make_request())


def test_different_timesteps_of_equal_length_differ_in_request_key() -> None:
    a = make_request(timesteps=(999.0, 500.0))
    b = make_request(timesteps=(999.0, 400.0))
    assert request_batch_key(a) != request_batch_key(b)


@pytest.mark.parametrize("key_fn", BOTH, ids=lambda f: f.__name__)
def test_int_and_float_guidance_share_a_key(key_fn: KeyFn) -> None:
    assert key_fn(make_request(guidance_scale=7)) == key_fn(make_request(guidance_scale=7.0))


# -- pictures ---------------------------------------------------------------------------------


def _picture(value: int = 0) -> Any:
    import numpy as np

    return np.full((512, 512, 3), value, np.uint8)


@pytest.mark.parametrize("key_fn", BOTH, ids=lambda f: f.__name__)
def test_the_conditioning_separates_text_image_and_inpaint(key_fn: KeyFn) -> None:
    text = make_request()
    image = make_request(image=_picture())
    inpaint = make_request(image=_picture(), mask_image=_picture()[:, :, 0])
    assert len({key_fn(text), key_fn(image), key_fn(inpaint)}) == 3


@pytest.mark.parametrize("key_fn", BOTH, ids=lambda f: f.__name__)
def test_requests_of_one_size_fuse_whatever_their_pictures(key_fn: KeyFn) -> None:
    # Pictures are resized to the request's size: the picture itself never splits a batch.
    assert key_fn(make_request(image=_picture(0))) == key_fn(make_request(image=_picture(255)))


def test_strength_is_part_of_the_request_key_only() -> None:
    # It decides where the schedule starts: one wave runs one schedule; a step batch does not.
    a = make_request(image=_picture(), strength=0.5)
    b = make_request(image=_picture(), strength=0.7)
    default = make_request(image=_picture())
    explicit = make_request(image=_picture(), strength=0.8)  # the image-to-image default
    assert request_batch_key(a) != request_batch_key(b)
    assert request_batch_key(default) == request_batch_key(explicit)
    assert step_batch_key(a) == step_batch_key(b)


@pytest.mark.parametrize("key_fn", BOTH, ids=lambda f: f.__name__)
def test_lora_adapters_and_scales_are_in_both_keys(key_fn: KeyFn) -> None:
    plain = key_fn(make_request())
    outline = key_fn(make_request(lora=(("outline", 1.0),)))
    assert len({plain, outline}) == 2
    assert outline == key_fn(make_request("r2", "a dog", lora=(("outline", 1.0),)))
    assert outline != key_fn(make_request(lora=(("outline", 0.5),)))
    assert outline != key_fn(make_request(lora=(("outline", 1.0), ("stripes", 1.0))))
    hash(outline)
