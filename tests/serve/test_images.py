"""Request parsing, image encoding, response bodies and the url store (pure; no server)."""

from __future__ import annotations

import base64
import io
import math
import struct
from typing import Any

import numpy as np
import pytest
from PIL import ExifTags, Image

from omni_trio._core.messages import RequestMetrics
from omni_trio._core.request import SamplingParams
from omni_trio.models.echo import decode_echo_image, encode_echo_header
from omni_trio.serve.images import (
    IGNORED_FIELDS,
    MAX_METADATA_FIELD_CHARS,
    MAX_METADATA_VALUE_CHARS,
    MAX_SEED,
    ApiError,
    ImageStore,
    ServeLimits,
    encode_b64,
    encode_image,
    image_metadata,
    image_size,
    images_response,
    parse_generation_request,
    pil_save_options,
)
from tests.serve.conftest import FakeClock

LIMITS = ServeLimits()
MODEL = "builtin:echo"


def parse(body: Any, limits: ServeLimits = LIMITS) -> Any:
    return parse_generation_request(body, limits=limits, default_model=MODEL)


def test_defaults() -> None:
    p = parse({"prompt": "a cat"})
    assert p.prompt == "a cat" and p.model == MODEL
    assert (p.n, p.response_format, p.output_format) == (1, "b64_json", "png")
    assert (p.stream, p.partial_images, p.timeout, p.output_compression) == (False, 0, None, None)
    assert p.ignored_fields == ()
    sp = p.params
    assert (sp.height, sp.width, sp.seed, sp.negative_prompt) == (None, None, None, None)
    assert sp.num_outputs_per_prompt == 1
    assert p.content_type == "image/png"


def test_every_field_maps() -> None:
    p = parse(
        {
            "prompt": "a cat",
            "model": MODEL,
            "n": 3,
            "size": "128x64",
            "response_format": "url",
            "output_format": "webp",
            "output_compression": 50,
            "user": "someone",
            "safety_identifier": "x",
            "stream": True,
            "partial_images": 2,
            "timeout": 1.5,
            "num_inference_steps": 7,
            "guidance_scale": 3,
            "negative_prompt": "dogs",
            "seed": MAX_SEED,
            "priority": -3,
        }
    )
    sp = p.params
    assert (sp.priority, sp.deadline_s) == (-3, 1.5)  # the timeout is the engine's deadline
    assert (sp.width, sp.height, sp.num_inference_steps, sp.guidance_scale) == (128, 64, 7, 3.0)
    assert (sp.negative_prompt, sp.seed, sp.num_outputs_per_prompt) == ("dogs", MAX_SEED, 3)
    assert (p.n, p.response_format, p.output_format, p.output_compression) == (3, "url", "webp", 50)
    assert (p.stream, p.partial_images, p.timeout) == (True, 2, 1.5)
    assert p.content_type == "image/webp"


def test_null_means_default_and_auto_size() -> None:
    p = parse({"prompt": "x", "n": None, "size": "auto", "seed": None, "model": None})
    assert p.n == 1 and p.params.height is None and p.params.seed is None


def test_gpt_image_only_fields_are_ignored_and_listed() -> None:
    body = {"prompt": "x", **{name: "whatever" for name in IGNORED_FIELDS}}
    p = parse(body)
    assert p.ignored_fields == tuple(sorted(IGNORED_FIELDS))
    assert {"quality", "style", "background", "moderation", "input_fidelity"} <= IGNORED_FIELDS


BAD: list[tuple[Any, int, str | None, str]] = [
    # body, status, param, code
    ([], 400, None, "invalid_type"),
    ("prompt", 400, None, "invalid_type"),
    (None, 400, None, "invalid_type"),
    ({}, 400, "prompt", "missing_required_parameter"),
    ({"prompt": None}, 400, "prompt", "missing_required_parameter"),
    ({"prompt": ""}, 400, "prompt", "invalid_value"),
    ({"prompt": 5}, 400, "prompt", "invalid_type"),
    ({"prompt": ["a"]}, 400, "prompt", "invalid_type"),
    ({"prompt": "x" * 4001}, 400, "prompt", "invalid_value"),
    ({"prompt": "x", "model": "dall-e-3"}, 404, "model", "model_not_found"),
    ({"prompt": "x", "model": 3}, 400, "model", "invalid_type"),
    ({"prompt": "x", "n": True}, 400, "n", "invalid_type"),
    ({"prompt": "x", "n": 1.0}, 400, "n", "invalid_type"),
    ({"prompt": "x", "n": "2"}, 400, "n", "invalid_type"),
    ({"prompt": "x", "n": 0}, 400, "n", "invalid_value"),
    ({"prompt": "x", "n": 5}, 400, "n", "invalid_value"),
    ({"prompt": "x", "size": "64"}, 400, "size", "invalid_value"),
    ({"prompt": "x", "size": "64x"}, 400, "size", "invalid_value"),
    ({"prompt": "x", "size": "-64x64"}, 400, "size", "invalid_value"),
    ({"prompt": "x", "size": "0x64"}, 400, "size", "invalid_value"),
    ({"prompt": "x", "size": "65x64"}, 400, "size", "invalid_value"),
    ({"prompt": "x", "size": " 64x64"}, 400, "size", "invalid_value"),
    ({"prompt": "x", "size": "100000x100000"}, 400, "size", "invalid_value"),
    ({"prompt": "x", "size": "2048x1024"}, 400, "size", "invalid_value"),
    ({"prompt": "x", "size": 64}, 400, "size", "invalid_type"),
    ({"prompt": "x", "response_format": "png"}, 400, "response_format", "invalid_value"),
    ({"prompt": "x", "output_format": "gif"}, 400, "output_format", "invalid_value"),
    ({"prompt": "x", "output_format": "PNG"}, 400, "output_format", "invalid_value"),
    ({"prompt": "x", "output_compression": 101}, 400, "output_compression", "invalid_value"),
    ({"prompt": "x", "output_compression": -1}, 400, "output_compression", "invalid_value"),
    ({"prompt": "x", "user": 1}, 400, "user", "invalid_type"),
    ({"prompt": "x", "stream": "true"}, 400, "stream", "invalid_type"),
    ({"prompt": "x", "stream": 1}, 400, "stream", "invalid_type"),
    ({"prompt": "x", "partial_images": 4}, 400, "partial_images", "invalid_value"),
    ({"prompt": "x", "partial_images": False}, 400, "partial_images", "invalid_type"),
    ({"prompt": "x", "timeout": 0}, 400, "timeout", "invalid_value"),
    ({"prompt": "x", "timeout": -1}, 400, "timeout", "invalid_value"),
    ({"prompt": "x", "timeout": math.inf}, 400, "timeout", "invalid_value"),
    ({"prompt": "x", "timeout": "5"}, 400, "timeout", "invalid_type"),
    ({"prompt": "x", "priority": 1.5}, 400, "priority", "invalid_type"),
    ({"prompt": "x", "priority": True}, 400, "priority", "invalid_type"),
    ({"prompt": "x", "priority": 2**40}, 400, "priority", "invalid_value"),
    ({"prompt": "x", "num_inference_steps": 0}, 400, "num_inference_steps", "invalid_value"),
    ({"prompt": "x", "num_inference_steps": -5}, 400, "num_inference_steps", "invalid_value"),
    ({"prompt": "x", "num_inference_steps": 201}, 400, "num_inference_steps", "invalid_value"),
    ({"prompt": "x", "num_inference_steps": 2.5}, 400, "num_inference_steps", "invalid_type"),
    ({"prompt": "x", "guidance_scale": math.nan}, 400, "guidance_scale", "invalid_value"),
    ({"prompt": "x", "guidance_scale": -1}, 400, "guidance_scale", "invalid_value"),
    ({"prompt": "x", "guidance_scale": True}, 400, "guidance_scale", "invalid_type"),
    ({"prompt": "x", "negative_prompt": 3}, 400, "negative_prompt", "invalid_type"),
    ({"prompt": "x", "seed": -1}, 400, "seed", "invalid_value"),
    ({"prompt": "x", "seed": MAX_SEED + 1}, 400, "seed", "invalid_value"),
    ({"prompt": "x", "seed": "7"}, 400, "seed", "invalid_type"),
    ({"prompt": "x", "extra_args": {}}, 400, "extra_args", "unknown_parameter"),
    ({"prompt": "x", "height": 64}, 400, "height", "unknown_parameter"),
]


@pytest.mark.parametrize(("body", "status", "param", "code"), BAD)
def test_bad_requests_name_the_field(body: Any, status: int, param: str | None, code: str) -> None:
    with pytest.raises(ApiError) as info:
        parse(body)
    err = info.value
    assert (err.status, err.param, err.code) == (status, param, code)
    assert err.body() == {
        "error": {
            "message": err.message,
            "type": "invalid_request_error",
            "param": param,
            "code": code,
        }
    }


def test_limits_are_configurable() -> None:
    tight = ServeLimits(max_prompt_chars=3, max_n=1, max_pixels=64 * 64, max_steps=2)
    for body, param in [
        ({"prompt": "abcd"}, "prompt"),
        ({"prompt": "a", "n": 2}, "n"),
        ({"prompt": "a", "size": "72x64"}, "size"),
        ({"prompt": "a", "num_inference_steps": 3}, "num_inference_steps"),
        ({"prompt": "a", "negative_prompt": "abcd"}, "negative_prompt"),
    ]:
        with pytest.raises(ApiError) as info:
            parse(body, tight)
        assert info.value.param == param
    with pytest.raises(ValueError, match="max_n"):
        ServeLimits(max_n=0)
    with pytest.raises(ValueError, match="max_steps"):
        ServeLimits(max_steps=True)


# -- encoding -------------------------------------------------------------------------------


def echo_image(request_id: str = "req-1", seed: int = 3, size: int = 64) -> Image.Image:
    values = np.random.default_rng(0).random((size, size, 3), dtype=np.float32)
    encode_echo_header(values, request_id, seed, 0)
    return Image.fromarray(np.clip(np.rint(values * 255), 0, 255).astype(np.uint8))


def test_png_is_lossless_and_keeps_the_echo_header() -> None:
    data = encode_image(echo_image("abc", 9), "png")
    assert data.startswith(b"\x89PNG")
    assert decode_echo_image(Image.open(io.BytesIO(data))) == ("abc", 9, 0)


@pytest.mark.parametrize(("fmt", "magic"), [("jpeg", b"\xff\xd8"), ("webp", b"RIFF")])
def test_lossy_formats_honour_the_quality(fmt: str, magic: bytes) -> None:
    image = echo_image()
    small = encode_image(image, fmt, 5)
    large = encode_image(image, fmt, 100)
    assert small.startswith(magic) and large.startswith(magic)
    assert len(small) < len(large)
    assert Image.open(io.BytesIO(small)).size == (64, 64)


def test_arrays_are_encoded_too() -> None:
    floats = np.zeros((16, 24, 3), dtype=np.float32)
    floats[0, 0] = 1.0
    decoded = Image.open(io.BytesIO(encode_image(floats, "png")))
    assert decoded.size == (24, 16) and decoded.getpixel((0, 0)) == (255, 255, 255)
    gray = Image.open(io.BytesIO(encode_image(np.zeros((8, 8), dtype=np.uint8), "jpeg")))
    assert gray.size == (8, 8)
    assert image_size(floats) == "24x16" and image_size(echo_image()) == "64x64"
    with pytest.raises(ValueError):
        encode_image(floats, "gif")
    with pytest.raises(ValueError):
        encode_image(np.zeros(5), "png")


def test_response_body() -> None:
    body = images_response(
        request_id="r",
        model=MODEL,
        seed=4,
        data=[{"b64_json": encode_b64(b"abc"), "revised_prompt": None}],
        output_format="png",
        size="64x64",
        metrics=RequestMetrics(queue_wait_ms=1.23456, execution_ms=2.0, e2e_ms=3.0),
        total_ms=5.5,
        created=7,
    )
    assert body == {
        "created": 7,
        "data": [{"b64_json": base64.b64encode(b"abc").decode(), "revised_prompt": None}],
        "id": "r",
        "model": MODEL,
        "seed": 4,
        "output_format": "png",
        "size": "64x64",
        "metrics": {"queue_wait_ms": 1.235, "execution_ms": 2.0, "total_ms": 5.5},
    }


# -- the url store --------------------------------------------------------------------------


def test_store_round_trip_and_expiry() -> None:
    clock = FakeClock()
    store = ImageStore(ttl_s=10, clock=clock)
    a = store.put(b"aaa", "image/png")
    clock.advance(5)
    b = store.put(b"bb", "image/jpeg")
    assert a != b and a.startswith("file-") and len(a) > 20
    assert store.get(a) == (b"aaa", "image/png")
    assert store.get(b) == (b"bb", "image/jpeg")
    assert (len(store), store.total_bytes) == (2, 5)
    clock.advance(5)  # a expires at exactly its ttl
    assert store.get(a) is None
    assert store.get(b) == (b"bb", "image/jpeg")
    clock.advance(5)
    assert store.get(b) is None
    assert (len(store), store.total_bytes) == (0, 0)
    assert store.get("file-unknown") is None


def test_store_evicts_the_oldest_to_stay_under_max_bytes() -> None:
    store = ImageStore(max_bytes=10, clock=FakeClock())
    ids = [store.put(bytes([i]) * 4, "image/png") for i in range(3)]
    assert store.get(ids[0]) is None  # 12 bytes would not fit
    assert store.get(ids[1]) is not None and store.get(ids[2]) is not None
    assert store.total_bytes == 8
    with pytest.raises(ValueError):
        store.put(b"x" * 11, "image/png")
    with pytest.raises(ValueError):
        ImageStore(ttl_s=0)
    assert ImageStore.url_for("http://h:1/", "file-x") == "http://h:1/v1/files/file-x/content"


# -- the recipe in the image (#20) ----------------------------------------------------------


def png_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """``(type, payload)`` of every chunk of a PNG file, in order."""
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    chunks, at = [], 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at : at + 4])
        chunks.append((data[at + 4 : at + 8], data[at + 8 : at + 8 + length]))
        at += 12 + length
    return chunks


def user_comment(data: bytes) -> str:
    """The EXIF UserComment of a JPEG/WebP file, decoded (``UNICODE\\0`` + UTF-16BE)."""
    exif = Image.open(io.BytesIO(data)).getexif().get_ifd(ExifTags.IFD.Exif)
    comment = exif[ExifTags.Base.UserComment]
    assert comment[:8] == b"UNICODE\x00"
    return str(comment[8:].decode("utf-16-be"))


RECIPE = SamplingParams(
    width=64, height=48, num_inference_steps=7, guidance_scale=4.0, negative_prompt="blur", seed=5
)


def test_image_metadata_writes_down_the_recipe() -> None:
    meta = image_metadata("a red fox", RECIPE, model="builtin:echo", scheduler="DDIMScheduler")
    assert meta == {
        "prompt": "a red fox",
        "negative_prompt": "blur",
        "seed": "5",
        "steps": "7",
        "guidance_scale": "4",
        "size": "64x48",
        "model": "builtin:echo",
        "scheduler": "DDIMScheduler",
        "parameters": "a red fox\nNegative prompt: blur\nSteps: 7, Sampler: DDIMScheduler, "
        'CFG scale: 4, Seed: 5, Size: 64x48, Model: "builtin:echo"',
    }


def test_image_metadata_leaves_out_what_is_unknown_and_numbers_several_images() -> None:
    bare = image_metadata("x", SamplingParams(guidance_scale=7.25), model="m", scheduler=None)
    assert bare == {
        "prompt": "x",
        "steps": "20",
        "guidance_scale": "7.25",
        "model": "m",
        "parameters": "x\nSteps: 20, CFG scale: 7.25, Model: m",
    }
    # n images share the request's seed; image_index tells them apart.
    params = RECIPE.replace(num_outputs_per_prompt=3, timesteps=(900.0, 500.0, 100.0))
    meta = image_metadata("x", params, model="m", scheduler=None, size="8x16", image_index=2)
    assert (meta["seed"], meta["n"], meta["image_index"]) == ("5", "3", "2")
    assert (meta["steps"], meta["size"]) == ("3", "8x16")  # explicit timesteps; the image's size
    assert meta["parameters"].endswith(", Size: 8x16, Model: m, Batch size: 3, Batch pos: 2")
    one = image_metadata("x", RECIPE, model="m", scheduler=None, image_index=0)
    assert "Batch" not in one["parameters"] and one["n"] == "1"


def test_a_recipe_from_a_picture_records_the_schedule_asked_for_and_the_strength() -> None:
    picture = Image.new("RGB", (64, 48))
    params = RECIPE.replace(image=picture, strength=0.6)  # runs int(7 * 0.6) = 4 steps
    meta = image_metadata("a red fox", params, model="m", scheduler=None)
    assert (meta["steps"], meta["strength"], meta["conditioning"]) == ("7", "0.6", "image")
    assert "Steps: 7," in meta["parameters"]
    assert "Size: 64x48, Denoising strength: 0.6, Model: m" in meta["parameters"]
    inpaint = params.replace(mask_image=Image.new("L", (64, 48)), strength=None)
    meta = image_metadata("a red fox", inpaint, model="m", scheduler=None)
    assert (meta["strength"], meta["conditioning"]) == ("1", "inpaint")


def test_png_carries_every_key_as_a_text_chunk_and_stays_lossless() -> None:
    meta = image_metadata("a fox, 狐 🦊", RECIPE, model="builtin:echo", scheduler=None)
    data = encode_image(echo_image("abc", 9), "png", metadata=meta)
    decoded = Image.open(io.BytesIO(data))
    assert decoded.text == meta  # type: ignore[attr-defined]
    assert decode_echo_image(decoded) == ("abc", 9, 0)
    kinds = {payload.split(b"\0", 1)[0].decode(): kind for kind, payload in png_chunks(data)
             if kind in (b"tEXt", b"iTXt", b"zTXt")}  # fmt: skip
    assert kinds["prompt"] == b"iTXt" and kinds["parameters"] == b"iTXt"  # beyond Latin-1
    assert kinds["seed"] == kinds["model"] == kinds["negative_prompt"] == b"tEXt"
    assert set(kinds) == set(meta)


def test_without_metadata_an_image_has_no_text() -> None:
    for metadata in (None, {}):
        data = encode_image(echo_image(), "png", metadata=metadata)
        assert Image.open(io.BytesIO(data)).text == {}  # type: ignore[attr-defined]
        assert not [k for k, _ in png_chunks(data) if k in (b"tEXt", b"iTXt", b"zTXt")]
        for fmt in ("jpeg", "webp"):
            lossy = Image.open(io.BytesIO(encode_image(echo_image(), fmt, metadata=metadata)))
            assert ExifTags.Base.UserComment not in lossy.getexif().get_ifd(ExifTags.IFD.Exif)


@pytest.mark.parametrize("fmt", ["jpeg", "webp"])
def test_lossy_formats_carry_the_parameters_text_as_exif_user_comment(fmt: str) -> None:
    meta = image_metadata('ünïcode 🦊, "quoted"', RECIPE, model="m", scheduler=None)
    data = encode_image(echo_image(), fmt, 80, metadata=meta)
    assert user_comment(data) == meta["parameters"]
    # Without a parameters text, the keys are written one per line.
    data = encode_image(echo_image(), fmt, metadata={"seed": "5", "prompt": "p"})
    assert user_comment(data) == "seed: 5\nprompt: p"


HOSTILE = "\ud800 lone surrogate \x00 nul \x1b[31m \x7f \x85 tab\tnew\nline " + "🦊" * 20_000


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp"])
def test_hostile_text_never_breaks_the_encoder(fmt: str) -> None:
    params = RECIPE.replace(negative_prompt=HOSTILE)
    meta = image_metadata(HOSTILE, params, model=HOSTILE, scheduler=HOSTILE)
    assert len(meta["prompt"]) == MAX_METADATA_FIELD_CHARS and meta["prompt"].endswith("…")
    assert len(meta["parameters"]) == MAX_METADATA_VALUE_CHARS  # four cut fields: cut again
    data = encode_image(echo_image(), fmt, metadata=meta)
    if fmt == "png":
        text = Image.open(io.BytesIO(data)).text  # type: ignore[attr-defined]
        assert set(text) == set(meta)
        assert text["prompt"].startswith("? lone surrogate  nul [31m   tab\tnew\nline 🦊")
        assert len(text["prompt"]) == MAX_METADATA_FIELD_CHARS - 4  # 4 controls dropped
    else:
        comment = user_comment(data)
        assert comment.startswith("? lone surrogate  nul [31m   tab\tnew\nline 🦊")
        assert len(comment) <= MAX_METADATA_VALUE_CHARS
    # Any caller's value, however long, is cut to fit (JPEG's EXIF segment is 64 KiB).
    huge = encode_image(echo_image(), fmt, metadata={"parameters": "🦊" * 100_000})
    assert Image.open(io.BytesIO(huge)).size == (64, 64)


@pytest.mark.parametrize("key", ["", " lead", "trail ", "x" * 80, "ключ", "a\0b"])
def test_a_key_that_is_not_a_png_keyword_is_a_value_error(key: str) -> None:
    with pytest.raises(ValueError, match="PNG text keyword"):
        encode_image(echo_image(), "png", metadata={key: "v"})
    assert pil_save_options("PNG", {"x" * 79: "v", "Ünï code": "v"})  # 79 Latin-1: fine


def test_pil_save_options_by_format() -> None:
    meta = {"parameters": "p"}
    assert set(pil_save_options("png", meta)) == {"pnginfo"}
    assert set(pil_save_options("JPEG", meta)) == set(pil_save_options("WEBP", meta)) == {"exif"}
    assert pil_save_options("BMP", meta) == {} and pil_save_options("PNG", None) == {}
