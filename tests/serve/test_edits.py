"""``POST /v1/images/edits`` and ``/v1/images/variations``: the form parser alone, then a real
server with the official ``openai`` SDK and raw ``httpx`` (a hostile multipart corpus).

The engines are ``builtin:echo`` (which carries a picture like any payload and does not look
at it) for the HTTP behaviour, and the real ``builtin:shapes`` where the picture must matter.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import openai
import pytest
import trio
from PIL import Image

from omni_trio.models.echo import decode_echo_image
from omni_trio.serve.edits import form_digest, parse_edit_form
from omni_trio.serve.images import ApiError, ServeLimits
from omni_trio.serve.multipart import Part

from .conftest import CAP_S, MODEL, Server, assert_envelope, parse_sse, run_server

EDITS = "/v1/images/edits"
VARIATIONS = "/v1/images/variations"
LIMITS = ServeLimits()


def png(width: int = 64, height: int = 64, *, mode: str = "RGB", seed: int = 0) -> bytes:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    shape = (height, width, channels) if channels > 1 else (height, width)
    pixels = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    if mode == "RGBA":
        pixels[..., 3] = 255
    out = io.BytesIO()
    Image.fromarray(pixels, mode).save(out, format="PNG")
    return out.getvalue()


def mask_png(
    width: int = 64, height: int = 64, box: tuple[int, int, int, int] = (16, 16, 48, 48)
) -> bytes:
    """OpenAI's mask: opaque everywhere but the box, which is fully transparent."""
    mask = Image.new("RGBA", (width, height), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), box)
    out = io.BytesIO()
    mask.save(out, format="PNG")
    return out.getvalue()


def file_part(name: str, data: bytes) -> Part:
    return Part(name, data, "a.png", "image/png")


def text_part(name: str, value: str) -> Part:
    return Part(name, value.encode(), None, None)


def parse(*parts: Part, variation: bool = False, limits: ServeLimits = LIMITS) -> Any:
    return parse_edit_form(list(parts), limits=limits, default_model=MODEL, variation=variation)


# -- the form parser ------------------------------------------------------------------------


def test_an_edit_form_becomes_an_inpainting_generation() -> None:
    parsed = parse(
        file_part("image", png(40, 48)),
        file_part("mask", mask_png(40, 48, (0, 0, 8, 8))),
        text_part("prompt", "a blue square"),
        text_part("n", "2"),
        text_part("strength", "0.6"),
        text_part("seed", "7"),
        text_part("stream", "true"),
        text_part("num_inference_steps", "12"),
    )
    sp = parsed.params
    assert (parsed.prompt, parsed.n, parsed.stream, parsed.event_prefix) == (
        "a blue square",
        2,
        True,
        "image_edit",
    )
    assert (sp.width, sp.height, sp.seed, sp.strength, sp.num_inference_steps) == (
        40,
        48,
        7,
        0.6,
        12,
    )
    assert sp.conditioning == "inpaint" and sp.image.mode == "RGB" and sp.mask_image.mode == "L"
    mask = np.asarray(sp.mask_image)
    assert mask[:8, :8].min() == 255 and mask[8:, 8:].max() == 0  # transparent = repaint


def test_without_a_mask_an_opaque_picture_is_edited_whole_and_alpha_marks_the_region() -> None:
    opaque = parse(file_part("image[]", png(32, 32)), text_part("prompt", "p"))
    assert opaque.params.conditioning == "image" and opaque.params.strength is None
    holed = Image.new("RGBA", (32, 32), (200, 10, 10, 255))
    holed.paste((0, 0, 0, 0), (0, 0, 16, 32))
    out = io.BytesIO()
    holed.save(out, format="PNG")
    own = parse(file_part("image", out.getvalue()), text_part("prompt", "p"))
    assert own.params.conditioning == "inpaint"
    assert np.asarray(own.params.mask_image)[:, :16].min() == 255


def test_the_size_defaults_to_the_picture_rounded_down_and_an_explicit_one_wins() -> None:
    auto = parse(file_part("image", png(45, 63)), text_part("prompt", "p"))
    assert (auto.params.width, auto.params.height) == (40, 56)
    sized = parse(
        file_part("image", png(45, 63)), text_part("prompt", "p"), text_part("size", "32x32")
    )
    assert (sized.params.width, sized.params.height) == (32, 32)
    with pytest.raises(ApiError) as info:
        parse(
            file_part("image", png(96, 96)),
            text_part("prompt", "p"),
            limits=ServeLimits(max_pixels=4096),
        )
    assert (info.value.status, info.value.param) == (400, "size")


def test_a_variation_has_no_prompt_and_refuses_edit_fields() -> None:
    parsed = parse(file_part("image", png(32, 32)), text_part("n", "1"), variation=True)
    assert parsed.prompt == "" and parsed.params.conditioning == "image"
    for extra in (
        text_part("prompt", "p"),
        file_part("mask", mask_png(32, 32)),
        text_part("stream", "true"),
    ):
        with pytest.raises(ApiError) as info:
            parse(file_part("image", png(32, 32)), extra, variation=True)
        assert info.value.body()["error"]["code"] == "unknown_parameter"


@pytest.mark.parametrize(
    ("parts", "param", "code"),
    [
        ([text_part("prompt", "p")], "image", "missing_required_parameter"),
        ([file_part("image", png()), file_part("image[]", png())], "image", "too_many_images"),
        ([file_part("image", png())], "prompt", "missing_required_parameter"),
        ([file_part("image", b"not an image"), text_part("prompt", "p")], "image", "invalid_image"),
        ([file_part("image", png()[:-30]), text_part("prompt", "p")], "image", "invalid_image"),
        (
            [
                file_part("image", png()),
                file_part("mask", mask_png(32, 32)),
                text_part("prompt", "p"),
            ],
            "mask",
            "mask_size_mismatch",
        ),
        (
            [
                file_part("image", png()),
                file_part("mask", png(mode="L", seed=1)[:0]),
                text_part("prompt", "p"),
            ],
            "mask",
            "empty_image",
        ),
        (
            [
                file_part("image", png()),
                file_part("mask", mask_png(box=(0, 0, 0, 0))),
                text_part("prompt", "p"),
            ],
            "mask",
            "empty_mask",
        ),
        (
            [file_part("image", png()), text_part("mask", "x"), text_part("prompt", "p")],
            "mask",
            "invalid_type",
        ),
        (
            [file_part("image", png()), text_part("prompt", "p"), text_part("n", "two")],
            "n",
            "invalid_type",
        ),
        (
            [file_part("image", png()), text_part("prompt", "p"), text_part("n", "1_0")],
            "n",
            "invalid_type",
        ),
        (
            [file_part("image", png()), text_part("prompt", "p"), text_part("strength", " .5")],
            "strength",
            "invalid_type",
        ),
        (
            [file_part("image", png()), text_part("prompt", "p"), text_part("strength", "0")],
            "strength",
            "invalid_value",
        ),
        (
            [file_part("image", png()), text_part("prompt", "p"), text_part("strength", "nan")],
            "strength",
            "invalid_type",
        ),
        (
            [file_part("image", png()), text_part("prompt", "p"), text_part("stream", "yes")],
            "stream",
            "invalid_type",
        ),
        (
            [file_part("image", png()), text_part("prompt", "p"), text_part("frame_count", "3")],
            "frame_count",
            "unknown_parameter",
        ),
        (
            [file_part("image", png()), file_part("other", png()), text_part("prompt", "p")],
            "other",
            "unknown_parameter",
        ),
        (
            [file_part("image", png()), text_part("prompt", "p"), text_part("prompt", "q")],
            "prompt",
            "duplicate_field",
        ),
        (
            [file_part("image", png(9000, 9000, mode="L")), text_part("prompt", "p")],
            "image",
            "image_too_large",
        ),
    ],
)
def test_bad_forms_are_400s_naming_the_field(parts: list[Part], param: str, code: str) -> None:
    with pytest.raises(ApiError) as info:
        parse(*parts)
    error = info.value.body()["error"]
    assert info.value.status == 400, error
    assert (error["param"], error["code"]) == (param, code), error


def test_the_idempotency_digest_reads_the_content_not_the_boundary() -> None:
    a = [file_part("image", png()), text_part("prompt", "p")]
    assert form_digest(a) == form_digest(list(a))
    renamed = [Part("image", png(), "other.png", "application/octet-stream"), a[1]]
    assert form_digest(a) == form_digest(renamed)  # the bytes say what the file is
    assert form_digest(a) != form_digest(
        [file_part("image", png(seed=1)), text_part("prompt", "p")]
    )
    assert form_digest(a) != form_digest([text_part("prompt", "p"), file_part("image", png())])


# -- over HTTP ------------------------------------------------------------------------------


def _b64_image(item: Any) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(item.b64_json))))


# The SDK marks create_variation deprecated (OpenAI's newer models do not offer it).
@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")
async def test_the_openai_sdk_edits_and_makes_variations(server: Server) -> None:
    def call() -> dict[str, Any]:
        with openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20
        ) as client:
            edit = client.images.edit(
                model=MODEL,
                image=("in.png", png(64, 64), "image/png"),
                mask=("mask.png", mask_png(), "image/png"),
                prompt="a blue square",
                n=2,
                size="64x64",
                response_format="b64_json",
                extra_body={"seed": 5, "num_inference_steps": 4, "strength": 0.5},
            )
            variation = client.images.create_variation(
                model=MODEL,
                image=("in.png", png(32, 32), "image/png"),
                response_format="b64_json",
                extra_body={"seed": 6},
            )
            with pytest.raises(openai.BadRequestError) as bad:
                client.images.edit(
                    model=MODEL, image=("x.png", b"GIF89a....", "image/gif"), prompt="p"
                )
            return {"edit": edit, "variation": variation, "bad": bad.value}

    with trio.fail_after(CAP_S):
        out = await trio.to_thread.run_sync(call)
    edit = out["edit"]
    assert len(edit.data) == 2 and edit.to_dict()["seed"] == 5
    for index, item in enumerate(edit.data):
        assert decode_echo_image(_b64_image(item))[1:] == (5, index)
    (item,) = out["variation"].data
    assert _b64_image(item).shape == (32, 32, 3)  # the picture's own size
    assert out["bad"].body["code"] == "unsupported_image_format"
    assert out["bad"].body["param"] == "image"


async def test_an_edit_streams_image_edit_events() -> None:
    with trio.fail_after(CAP_S):
        async with (
            run_server(step_execution=True, streaming_output=True) as server,
            server.client() as client,
        ):
            r = await client.post(
                EDITS,
                files={"image": ("in.png", png(32, 32), "image/png")},
                data={
                    "prompt": "p",
                    "stream": "true",
                    "partial_images": "1",
                    "num_inference_steps": "6",
                },
            )
    assert r.status_code == 200, r.text
    names = [name for name, _ in parse_sse(r.text)]
    assert names[-1] == "image_edit.completed"
    assert "image_edit.partial_image" in names and "image_edit.progress" in names
    assert not [name for name in names if name.startswith("image_generation.")]


async def test_hostile_multipart_bodies_get_envelopes_and_the_server_stays_healthy() -> None:
    limits = ServeLimits(max_upload_bytes=200_000, max_upload_pixels=512 * 512)
    boundary = "b0undary"
    multipart = f"multipart/form-data; boundary={boundary}"
    good = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="prompt"\r\n\r\np\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n'
            "Content-Type: image/png\r\n\r\n"
        ).encode()
        + png(32, 32)
        + f"\r\n--{boundary}--\r\n".encode()
    )
    bomb = io.BytesIO()
    Image.new("1", (6000, 6000)).save(bomb, format="PNG")  # 36 MP in a few KB
    cases: list[tuple[dict[str, Any], int, str | None]] = [
        (
            {"content": good, "headers": {"content-type": "application/json"}},
            415,
            "unsupported_media_type",
        ),
        (
            {"content": good, "headers": {"content-type": "multipart/form-data"}},
            400,
            "missing_boundary",
        ),
        ({"content": good[:-40], "headers": {"content-type": multipart}}, 400, "invalid_multipart"),
        ({"content": b"garbage", "headers": {"content-type": multipart}}, 400, "invalid_multipart"),
        (
            {"content": b"x" * 300_000, "headers": {"content-type": multipart}},
            413,
            "request_too_large",
        ),
        (
            {"files": {"image": ("a.png", bomb.getvalue(), "image/png")}, "data": {"prompt": "p"}},
            400,
            "image_too_large",
        ),
        (
            {
                "files": {"image": ("a.png", png(32, 32)[:200], "image/png")},
                "data": {"prompt": "p"},
            },
            400,
            "invalid_image",
        ),
        (
            {"files": {"image": ("a.txt", b"hello", "text/plain")}, "data": {"prompt": "p"}},
            400,
            "invalid_image",
        ),
        (
            {
                "files": [
                    ("image", ("a.png", png(32, 32), "image/png")),
                    ("image", ("b.png", png(32, 32), "image/png")),
                ],
                "data": {"prompt": "p"},
            },
            400,
            "too_many_images",
        ),
        ({"data": {"prompt": "p"}}, 415, "unsupported_media_type"),  # urlencoded
    ]
    with trio.fail_after(CAP_S):
        async with run_server(limits=limits) as server, server.client() as client:
            for kwargs, status, code in cases:
                r = await client.post(EDITS, **kwargs)
                assert_envelope(r, status, **({"code": code} if code else {}))
            r = await client.post(EDITS, content=good, headers={"content-type": multipart})
            assert r.status_code == 200, r.text
            assert (await client.get("/health")).status_code == 200
    assert [rec["status"] for rec in server.records][-1] == 200
    assert not [rec for rec in server.records if rec["status"] >= 500]


async def test_a_big_picture_renders_at_a_smaller_size_asked_for() -> None:
    # The picture is bounded by max_upload_pixels (and the engine's max_image_pixels), the
    # size rendered by max_pixels: a 96x96 photo edited at 32x32 is fine where 96x96 is not.
    limits = ServeLimits(max_pixels=32 * 32)
    with trio.fail_after(CAP_S):
        async with run_server(limits=limits, max_pixels=32 * 32) as server, server.client() as c:
            r = await c.post(
                EDITS,
                files={"image": ("in.png", png(96, 96), "image/png")},
                data={"prompt": "p", "size": "32x32", "num_inference_steps": "2"},
            )
            too_big = await c.post(
                EDITS,
                files={"image": ("in.png", png(96, 96), "image/png")},
                data={"prompt": "p", "num_inference_steps": "2"},
            )
    assert r.status_code == 200, r.text
    image = Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"])))
    assert image.size == (32, 32)
    assert_envelope(too_big, 400, param="size")


async def test_an_idempotent_edit_runs_once_for_two_sends() -> None:
    with trio.fail_after(CAP_S):
        async with run_server() as server, server.client() as client:
            sends = []
            for _ in range(2):  # httpx picks a new boundary for every send
                sends.append(
                    await client.post(
                        EDITS,
                        files={"image": ("in.png", png(32, 32), "image/png")},
                        data={"prompt": "p", "seed": "1"},
                        headers={"idempotency-key": "edit-1"},
                    )
                )
            other = await client.post(
                EDITS,
                files={"image": ("in.png", png(32, 32, seed=9), "image/png")},
                data={"prompt": "p", "seed": "1"},
                headers={"idempotency-key": "edit-1"},
            )
    assert [r.status_code for r in sends] == [200, 200]
    assert sends[1].headers.get("idempotent-replayed") == "true"
    assert sends[0].json()["data"] == sends[1].json()["data"]
    assert_envelope(other, 422, code="idempotency_key_reused")


async def test_a_real_model_repaints_only_inside_the_mask() -> None:
    """builtin:shapes (identity VAE): outside the mask the uploaded pixels come back."""
    picture = png(32, 32, seed=3)
    with trio.fail_after(CAP_S * 2):
        async with (
            run_server(model="builtin:shapes", torch_threads=1) as server,
            server.client() as client,
        ):
            r = await client.post(
                EDITS,
                files={
                    "image": ("in.png", picture, "image/png"),
                    "mask": ("m.png", mask_png(32, 32, (8, 8, 24, 24)), "image/png"),
                },
                data={"prompt": "a blue circle", "num_inference_steps": "8", "seed": "2"},
            )
    assert r.status_code == 200, r.text
    out = np.asarray(Image.open(io.BytesIO(base64.b64decode(r.json()["data"][0]["b64_json"]))))
    original = np.asarray(Image.open(io.BytesIO(picture)))
    keep = np.ones((32, 32), bool)
    keep[8:24, 8:24] = False
    assert np.abs(out[keep].astype(int) - original[keep]).max() <= 1
    assert np.abs(out[~keep].astype(int) - original[~keep]).mean() > 20
