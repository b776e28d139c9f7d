"""The real app under hypercorn, talked to by real clients (httpx and the openai SDK).

The model is ``builtin:echo``: every image carries ``request_id|seed|index`` in its first
pixels, so a response with another request's image or the wrong seed is caught.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import trio
from PIL import Image

from omni_trio.config import EngineConfig
from omni_trio.errors import WorkerError
from omni_trio.models.echo import decode_echo_image
from omni_trio.serve.app import (
    NO_USAGE,
    RESPONSE_BYTES_PER_IMAGE,
    RESPONSE_BYTES_PER_PIXEL,
    ImagesApp,
    _partial_targets,
    is_openai_sdk,
    is_valid_request_id,
    logger_sink,
)
from omni_trio.serve.config import MIB
from omni_trio.serve.daemon import TextFormatter
from omni_trio.serve.http import SEND_DEADLINE, SendDeadline
from omni_trio.serve.images import ImageStore, ServeLimits
from omni_trio.serve.metrics import ServeMetrics
from omni_trio.serve.pool import EnginePool, clamp_retry_after
from tests.fakes import ScriptedModel, register_models
from tests.serve.conftest import (
    CAP_S,
    MODEL,
    STEP_DELAY_S,
    FakeClock,
    Server,
    assert_envelope,
    parse_sse,
    run_server,
    wait_until,
)

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

GEN = "/v1/images/generations"
LONG = 200  # steps: ~4 s with echo's step delay; every test that starts one ends it early


def decode_b64(b64: str) -> tuple[Image.Image, tuple[str, int, int]]:
    image = Image.open(io.BytesIO(base64.b64decode(b64)))
    return image, decode_echo_image(image)


async def generate(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    body.setdefault("prompt", "a red fox")
    body.setdefault("size", "64x64")
    body.setdefault("num_inference_steps", 2)
    headers = body.pop("headers", None)
    return await client.post(GEN, json=body, headers=headers)


def worker_steps(server: Server) -> int:
    steps = server.engine().statistics().workers[0].steps
    assert steps is not None
    return steps


# -- generation -----------------------------------------------------------------------------


async def test_generation_returns_the_echo_image_of_this_request(server: Server) -> None:
    with trio.fail_after(CAP_S):
        async with server.client() as client:
            r = await generate(client, seed=42, headers={"X-Request-Id": "client-id.1:a_b-c"})
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "client-id.1:a_b-c"
        assert r.headers["content-type"] == "application/json"
        body = r.json()
        assert set(body) == {
            "created",
            "data",
            "id",
            "model",
            "seed",
            "output_format",
            "size",
            "metrics",
        }
        assert (body["id"], body["seed"], body["model"]) == ("client-id.1:a_b-c", 42, MODEL)
        assert (body["output_format"], body["size"]) == ("png", "64x64")
        assert set(body["metrics"]) == {"queue_wait_ms", "execution_ms", "total_ms"}
        assert body["metrics"]["total_ms"] >= body["metrics"]["execution_ms"] > 0
        (item,) = body["data"]
        assert item["revised_prompt"] is None
        image, header = decode_b64(item["b64_json"])
        assert image.size == (64, 64)
        assert header == ("client-id.1:a_b-c", 42, 0)


async def test_generated_ids_and_random_seeds_are_echoed(server: Server) -> None:
    with trio.fail_after(CAP_S):
        async with server.client() as client:
            r1, r2 = await generate(client, n=2), await generate(client)
        seen = set()
        for r in (r1, r2):
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["id"] == r.headers["x-request-id"] and is_valid_request_id(body["id"])
            assert isinstance(body["seed"], int)
            for index, item in enumerate(body["data"]):
                assert decode_b64(item["b64_json"])[1] == (body["id"], body["seed"], index)
            seen.add(body["id"])
        assert len(r1.json()["data"]) == 2 and len(seen) == 2


async def test_output_formats_and_ignored_fields(server: Server) -> None:
    with trio.fail_after(CAP_S):
        async with server.client() as client:
            r = await generate(
                client, output_format="jpeg", output_compression=40, quality="hd", style="vivid"
            )
            plain = await generate(client, output_format="webp")
        assert r.status_code == 200, r.text
        assert r.headers["x-omni-trio-ignored-fields"] == "quality,style"
        assert base64.b64decode(r.json()["data"][0]["b64_json"]).startswith(b"\xff\xd8")
        assert r.json()["output_format"] == "jpeg"
        assert "x-omni-trio-ignored-fields" not in plain.headers
        assert base64.b64decode(plain.json()["data"][0]["b64_json"]).startswith(b"RIFF")


async def test_url_responses_are_served_from_the_store_until_they_expire(
    server: Server,
) -> None:
    with trio.fail_after(CAP_S):
        async with server.client() as client:
            r = await generate(client, response_format="url", seed=8)
            assert r.status_code == 200, r.text
            body = r.json()
            url = body["data"][0]["url"]
            assert url.startswith(f"{server.url}/v1/files/file-") and url.endswith("/content")
            assert "b64_json" not in body["data"][0]
            image = await client.get(url)
            assert image.status_code == 200
            assert image.headers["content-type"] == "image/png"
            decoded = decode_echo_image(Image.open(io.BytesIO(image.content)))
            assert decoded == (body["id"], 8, 0)
            server.clock.advance(599)
            assert (await client.get(url)).status_code == 200
            server.clock.advance(2)
            assert_envelope(await client.get(url), 404, code="file_not_found")
            assert_envelope(
                await client.get("/v1/files/file-nope/content"), 404, code="file_not_found"
            )


async def test_file_urls_never_come_from_the_host_header(server: Server) -> None:
    with trio.fail_after(CAP_S):
        async with server.client() as client:
            r = await generate(client, response_format="url", headers={"Host": "evil.example"})
        assert r.status_code == 200, r.text
        url = r.json()["data"][0]["url"]
        assert url.startswith(f"{server.url}/v1/files/file-"), url
        assert "evil" not in url


async def test_file_urls_are_built_from_public_url() -> None:
    with trio.fail_after(CAP_S):
        options = {"public_url": "https://images.example.com/omni/"}
        async with run_server(app_options=options) as server, server.client() as client:
            r = await generate(client, response_format="url", headers={"Host": "evil.example"})
            assert r.status_code == 200, r.text
            url = r.json()["data"][0]["url"]
            assert url.startswith("https://images.example.com/omni/v1/files/file-"), url
            path = url.removeprefix("https://images.example.com/omni")
            assert (await client.get(path)).status_code == 200


async def test_the_openai_sdk_generates_and_reads_our_errors(server: Server) -> None:
    def call() -> dict[str, Any]:
        with openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20
        ) as client:
            result = client.images.generate(
                model=MODEL,
                prompt="a red fox",
                size="64x64",
                response_format="b64_json",
                extra_body={"seed": 3, "num_inference_steps": 2},
            )
            with pytest.raises(openai.BadRequestError) as bad:
                client.images.generate(
                    model=MODEL, prompt="x", extra_body={"num_inference_steps": -1}
                )
            with pytest.raises(openai.NotFoundError) as missing:
                client.images.generate(model="dall-e-3", prompt="x")
            return {"result": result, "bad": bad.value, "missing": missing.value}

    with trio.fail_after(CAP_S):
        out = await trio.to_thread.run_sync(call)
    result = out["result"].to_dict()
    assert result["output_format"] == "png" and result["seed"] == 3
    (item,) = out["result"].data
    # The SDK sends its key as a bearer token; without server keys that is a client token,
    # and the engine runs the request under its id scoped to that token's owner tag.
    engine_id, seed, index = decode_b64(item.b64_json)[1]
    assert engine_id.partition("@")[::2] == (result["id"], engine_id.rpartition("@")[2])
    assert (seed, index) == (3, 0) and "@" in engine_id
    bad = out["bad"]
    assert bad.status_code == 400
    assert bad.body["param"] == "num_inference_steps"
    assert "num_inference_steps must be in 1..200" in bad.message
    assert out["missing"].body["code"] == "model_not_found"


# -- poison requests ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["inproc", "tractor"])
async def test_a_prompt_that_cannot_be_encoded_is_a_400_and_harms_nothing(backend: str) -> None:
    """A lone surrogate (valid JSON, no valid UTF-8) once crashed the tractor worker group
    in the engine's encoder, again and again as it was requeued; it is a 400 at admission."""
    overrides: dict[str, Any] = {"backend": backend}
    if backend == "tractor":
        overrides["worker_start_method"] = "forkserver"
    with trio.fail_after(CAP_S):
        async with run_server(**overrides) as server, server.client() as client:
            for raw, what in (
                (b'"a \\ud800 fox"', "lone surrogate U+D800"),
                (b'"\\u0000"', "U+0000"),
            ):
                r = await client.post(
                    GEN,
                    content=b'{"prompt": ' + raw + b', "size": "64x64"}',
                    headers={"content-type": "application/json"},
                )
                error = assert_envelope(r, 400, param="prompt")
                assert what in error["message"]
            ok = await generate(client, headers={"X-Request-Id": "after"})
            assert ok.status_code == 200
            assert decode_b64(ok.json()["data"][0]["b64_json"])[1][0] == "after"
            assert server.engine().health().restarts == 0


async def test_a_request_over_the_compute_budget_is_a_400_with_the_estimate() -> None:
    """builtin:tiny-sd at 1024x1024 with n=4 took ~137 s per step on 2 cores; measured at
    warmup, it is refused before it runs, naming the estimate and the limit."""
    from omni_trio.runtime import calibration

    calibration.forget_measurements()
    try:
        with trio.fail_after(CAP_S):
            async with (
                run_server(model="builtin:tiny-sd", warmup=True, torch_threads=1) as server,
                server.client() as client,
            ):
                r = await client.post(
                    GEN, json={"prompt": "a red circle", "size": "1024x1024", "n": 4}
                )
                error = assert_envelope(r, 400, param="size")
                assert error["code"] == "request_too_costly"
                assert "estimated at" in error["message"] and "max_step_s" in error["message"]
                assert r.headers.get("x-should-retry") in (None, "false")
                small = await client.post(GEN, json={"prompt": "a red circle", "size": "64x64"})
                assert small.status_code == 200
    finally:
        calibration.forget_measurements()


async def test_a_poison_prompt_is_quarantined_and_the_sdk_does_not_resend_it() -> None:
    """A prompt that crashes the worker process whenever it runs: it takes its group down
    twice (the second time running alone), then it is quarantined: a 500 that says not to
    retry (``x-should-retry: false``), so the official client sends it once; the requests
    beside it are served."""
    with trio.fail_after(CAP_S * 2):
        async with run_server(
            backend="tractor",
            worker_start_method="forkserver",
            fault_injection=True,
            worker_restart_backoff_s=0.0,
            max_num_seqs=4,
            request_batch_max_wait_ms=200.0,
            model_options={"step_delay_s": STEP_DELAY_S, "fault_crash_on_prompt": "poison"},
        ) as server:

            def sdk_call() -> openai.APIStatusError:
                with openai.OpenAI(
                    base_url=f"{server.url}/v1", api_key="unused", max_retries=2, timeout=30
                ) as sdk:
                    with pytest.raises(openai.APIStatusError) as info:
                        sdk.images.generate(
                            model=MODEL,
                            prompt="a poison pill",
                            size="64x64",
                            extra_headers={"X-Request-Id": "poison"},
                        )
                    return info.value

            answers: dict[str, Any] = {}

            async def bystander(index: int) -> None:
                async with server.client(timeout=30.0) as client:
                    answers[f"b{index}"] = await generate(
                        client, headers={"X-Request-Id": f"b{index}"}
                    )

            async def poison() -> None:
                answers["poison"] = await trio.to_thread.run_sync(sdk_call)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(poison)
                for index in range(3):
                    nursery.start_soon(bystander, index)
            error = answers["poison"]
            assert error.status_code == 500
            assert error.response.headers["x-should-retry"] == "false"
            assert error.body["code"] == "request_quarantined"
            for index in range(3):
                r = answers[f"b{index}"]
                assert r.status_code == 200, r.text
                assert decode_b64(r.json()["data"][0]["b64_json"])[1][0] == f"b{index}"
            await wait_until(lambda: server.engine().health().healthy)
            async with server.client() as client:
                assert (await client.get("/health")).status_code == 200
            assert server.engine().health().restarts == 2
    sent = [x for x in server.records if x["request_id"] == "poison"]
    assert len(sent) == 1, sent  # the SDK did not resend it


# -- streaming ------------------------------------------------------------------------------


async def read_events(client: httpx.AsyncClient, body: dict[str, Any], **kw: Any) -> Any:
    async with client.stream("POST", GEN, json=body, **kw) as r:
        text = (await r.aread()).decode()
    return r, parse_sse(text)


async def test_sse_streams_progress_previews_and_the_result(stream_server: Server) -> None:
    with trio.fail_after(CAP_S):
        async with stream_server.client() as client:
            body = {
                "prompt": "x",
                "size": "64x64",
                "num_inference_steps": 6,
                "stream": True,
                "partial_images": 2,
                "seed": 9,
            }
            r, events = await read_events(client, body, headers={"X-Request-Id": "sse-1"})
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream"
        assert r.headers["x-request-id"] == "sse-1"
        names = [name for name, _ in events]
        assert names[-1] == "image_generation.completed"
        assert all(data["type"] == name for name, data in events)
        partials = [data for name, data in events if name == "image_generation.partial_image"]
        assert [p["partial_image_index"] for p in partials] == [0, 1]
        for p in partials:
            assert decode_b64(p["b64_json"])[1] == ("sse-1", 9, 0)
            assert (p["size"], p["output_format"]) == ("64x64", "png")
            assert isinstance(p["created_at"], int)
        progress = [(d["step"], d["total"]) for n, d in events if n == "image_generation.progress"]
        assert progress and progress == sorted(progress) and progress[-1][1] == 6
        done = events[-1][1]
        assert (done["id"], done["seed"], done["usage"]) == ("sse-1", 9, NO_USAGE)
        assert decode_b64(done["b64_json"])[1] == ("sse-1", 9, 0)
        # previews come before the result
        assert names.index("image_generation.partial_image") < names.index(
            "image_generation.completed"
        )


def test_partial_images_are_picked_evenly_over_the_previews_ending_at_the_last() -> None:
    assert _partial_targets(19, 2) == {9, 18}  # not the first two
    assert _partial_targets(19, 3) == {6, 12, 18}
    assert _partial_targets(5, 1) == {4}
    assert _partial_targets(3, 3) == {0, 1, 2}
    assert _partial_targets(0, 2) == _partial_targets(4, 0) == set()
    for previews in range(1, 60):
        for wanted in range(1, previews + 1):
            picks = sorted(_partial_targets(previews, wanted))
            assert len(picks) == wanted and picks[-1] == previews - 1
            gaps = [b - a for a, b in zip([-1, *picks[:-1]], picks, strict=True)]
            assert max(gaps) - min(gaps) <= 1, (previews, wanted, picks)


async def test_partial_images_are_spread_over_the_steps_and_no_more_than_the_steps_give() -> None:
    """20 steps give 19 previews: partial_images=2 sends the ones after steps 10 and 19 (each
    follows the progress event of its step), not the first two; asking more previews than
    the steps give is a 400 that says how many they can give."""
    with trio.fail_after(CAP_S):
        async with (
            # Progress only from the previews themselves (no timer), so each partial
            # image follows the progress event of its own step.
            run_server(streaming_output=True, app_options={"progress_interval_s": 60.0}) as server,
            server.client() as client,
        ):
            body = {"prompt": "x", "size": "64x64", "stream": True, "seed": 3}
            r, events = await read_events(
                client, {**body, "num_inference_steps": 20, "partial_images": 2}
            )
            too_many = await client.post(
                GEN, json={**body, "num_inference_steps": 3, "partial_images": 3}
            )
            most = await client.post(
                GEN, json={**body, "num_inference_steps": 3, "partial_images": 2}
            )
    assert r.status_code == 200
    steps_of_partials = []
    step = 0
    for name, data in events:
        if name == "image_generation.progress":
            step = data["step"]
        elif name == "image_generation.partial_image":
            steps_of_partials.append(step)
    assert steps_of_partials == [10, 19], steps_of_partials
    error = assert_envelope(too_many, 400, param="partial_images", code="invalid_value")
    assert "at most 2 for 3 steps" in error["message"], error
    assert most.status_code == 200
    assert [n for n, _ in parse_sse(most.text)].count("image_generation.partial_image") == 2


async def test_sse_without_step_previews_still_completes(server: Server) -> None:
    with trio.fail_after(CAP_S):
        async with server.client() as client:
            body = {"prompt": "x", "size": "64x64", "num_inference_steps": 2, "stream": True}
            r, events = await read_events(client, {**body, "n": 2})
            # Previews asked of a server that streams none: a clear 400, not a silent drop.
            refused = await client.post(GEN, json={**body, "partial_images": 3})
            # Outside a stream there is nothing to send them in: named as ignored.
            plain = await client.post(GEN, json={"prompt": "x", "partial_images": 2})
        assert_envelope(refused, 400, param="partial_images", code="partial_images_unsupported")
        assert "--streaming" in refused.json()["error"]["message"]
        assert plain.status_code == 200
        assert plain.headers["x-omni-trio-ignored-fields"] == "partial_images"
        assert r.status_code == 200
        completed = [d for n, d in events if n == "image_generation.completed"]
        assert [d["image_index"] for d in completed] == [0, 1]
        assert not [n for n, _ in events if n == "image_generation.partial_image"]
        rid = r.headers["x-request-id"]
        for index, data in enumerate(completed):
            assert decode_b64(data["b64_json"])[1] == (rid, data["seed"], index)


def test_openai_sdk_clients_are_told_by_their_headers() -> None:
    assert is_openai_sdk({"x-stainless-lang": ["python"]})
    assert is_openai_sdk({"user-agent": ["OpenAI/Python 3.57.0"]})
    assert not is_openai_sdk({"user-agent": ["python-httpx/0.28.1"]})
    assert not is_openai_sdk({})


async def test_the_sdk_parses_every_stream_event_with_its_own_types(
    stream_server: Server,
) -> None:
    """The official SDK's stream: only its two event types come out, each valid under the
    SDK's own model (every field it defines, usage included); the partial images are real
    previews; progress reached the SDK's connection only as SSE comments.  A raw client
    still gets progress events, and an SDK client that asks for them gets them too."""
    from openai.types import ImageGenCompletedEvent, ImageGenPartialImageEvent

    def call() -> list[Any]:
        with openai.OpenAI(
            base_url=f"{stream_server.url}/v1", api_key="unused", max_retries=0, timeout=20
        ) as client:
            stream = client.images.generate(
                model=MODEL,
                prompt="x",
                size="64x64",
                stream=True,
                partial_images=2,
                extra_body={"seed": 4, "num_inference_steps": 8},
            )
            return list(stream)

    with trio.fail_after(CAP_S):
        events = await trio.to_thread.run_sync(call)
        async with stream_server.client() as client:
            body = {"prompt": "x", "num_inference_steps": 4, "stream": True}
            sdk_like = {"User-Agent": "OpenAI/Python 3.57.0"}
            async with client.stream("POST", GEN, json=body, headers=sdk_like) as r:
                raw = (await r.aread()).decode()
            _, asked = await read_events(
                client, {**body, "stream_progress": True}, headers=sdk_like
            )
            _, plain = await read_events(client, body)
    kinds = [type(event) for event in events]
    assert kinds == [ImageGenPartialImageEvent] * 2 + [ImageGenCompletedEvent], events
    for index, event in enumerate(events[:2]):
        checked = ImageGenPartialImageEvent.model_validate(event.model_dump())
        assert checked.partial_image_index == index
        assert decode_b64(checked.b64_json)[1][1:] == (4, 0)
    done = ImageGenCompletedEvent.model_validate(events[-1].model_dump())
    assert done.usage.total_tokens == 0 and done.size == "64x64"
    assert decode_b64(done.b64_json)[1][1:] == (4, 0)
    # The SDK-like connection: progress only as comments, so no event but the result.
    assert [name for name, _ in parse_sse(raw)] == ["image_generation.completed"]
    comments = [line for line in raw.splitlines() if line.startswith(": ")]
    assert comments and all(c.startswith(": image_generation.progress {") for c in comments)
    assert json.loads(comments[-1].split(" ", 2)[2])["total"] == 4
    for got in (asked, plain):
        assert "image_generation.progress" in [name for name, _ in got]


async def test_the_sdk_raises_a_mid_stream_error(server: Server) -> None:
    def call() -> openai.APIError:
        with openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20
        ) as client:
            stream = client.images.generate(
                model=MODEL,
                prompt="x",
                stream=True,
                extra_body={"num_inference_steps": LONG, "timeout": 0.3},
            )
            with pytest.raises(openai.APIError) as info:
                list(stream)
            return info.value

    with trio.fail_after(CAP_S):
        error = await trio.to_thread.run_sync(call)
    assert "did not finish within its" in error.message and "aborted" in error.message
    assert isinstance(error.body, dict) and error.body["code"] == "timeout"


async def test_sse_errors_before_the_stream_are_plain_envelopes(stream_server: Server) -> None:
    with trio.fail_after(CAP_S):
        async with stream_server.client() as client:
            r = await client.post(GEN, json={"prompt": "x", "stream": True, "n": 0})
        assert_envelope(r, 400, param="n")


async def test_event_stream_progress_is_the_callers_own_request() -> None:
    """A client that sends a bearer token (every OpenAI SDK does) gets the progress of its
    own request, and never that of another owner's request with the same id: here the
    anonymous ``x`` runs while the token holder's ``x`` waits behind it."""
    token = {"Authorization": "Bearer sdk-key", "X-Request-Id": "x"}
    steps = 40
    with trio.fail_after(CAP_S):
        async with (
            run_server(app_options={"progress_interval_s": 0.01}) as server,
            server.client() as client,
            trio.open_nursery() as nursery,
        ):
            answers: dict[str, Any] = {}
            await start_long(client, nursery, answers, "anon", headers={"X-Request-Id": "x"})
            await wait_until(lambda: (server.pool.progress("x") or (0, 0))[0] >= 1)
            got: list[Any] = []

            async def read() -> None:
                body = {"prompt": "y", "size": "64x64", "num_inference_steps": steps}
                got.extend(await read_events(client, {**body, "stream": True}, headers=token))

            nursery.start_soon(read)
            await wait_until(
                lambda: sum(s.public_id == "x" for s in server.pool._active.values()) == 2
            )
            # the token holder's x waits while the anonymous x runs on for 10+ steps (20+
            # progress ticks of its event stream)
            seen = (server.pool.progress("x") or (0, 0))[0]
            await wait_until(lambda: (server.pool.progress("x") or (0, 0))[0] >= seen + 10)
            assert (await client.delete("/v1/requests/x")).status_code == 200  # anonymous x
            await wait_until(lambda: bool(got))
        response, events = got
        assert response.status_code == 200
        assert_envelope(answers["anon"], 409, code="request_cancelled")
        progress = [(d["step"], d["total"]) for n, d in events if n == "image_generation.progress"]
        assert progress, events
        assert all(total == steps and 0 <= step <= steps for step, total in progress), progress
        assert events[-1][0] == "image_generation.completed"


# -- cancel, disconnect, timeout ------------------------------------------------------------


async def test_delete_cancels_a_running_generation_within_a_step(server: Server) -> None:
    with trio.fail_after(CAP_S):
        answers: dict[str, Any] = {}
        async with server.client() as client, trio.open_nursery() as nursery:

            async def post() -> None:
                answers["post"] = await generate(
                    client, num_inference_steps=LONG, headers={"X-Request-Id": "victim"}
                )
                answers["post_at"] = trio.current_time()

            nursery.start_soon(post)
            await wait_until(lambda: (server.pool.progress("victim") or (0, 0))[0] >= 2)
            steps_before = worker_steps(server)
            cancelled_at = trio.current_time()
            r = await client.delete("/v1/requests/victim")
            assert r.status_code == 200, r.text
            assert r.json() == {"id": "victim", "object": "request", "status": "cancelled"}
            assert r.headers["content-type"] == "application/json"
        assert_envelope(answers["post"], 409, code="request_cancelled")
        assert answers["post"].headers["x-request-id"] == "victim"
        assert answers["post_at"] - cancelled_at < 1.0
        engine = server.engine()
        assert engine.statistics().finished_aborted == 1
        # The worker stops at its next step boundary and runs nothing more.
        await wait_until(lambda: engine.statistics().running == 0)
        stopped = worker_steps(server)
        assert stopped - steps_before <= 3
        await trio.sleep(5 * STEP_DELAY_S)
        assert worker_steps(server) == stopped < LONG
        async with server.client() as client:
            again = await client.delete("/v1/requests/victim")
            assert_envelope(again, 409, code="request_finished")
            assert again.headers["x-should-retry"] == "false"  # the SDKs retry 409s
            assert_envelope(
                await client.delete("/v1/requests/nobody"), 404, code="request_not_found"
            )
        assert server.pool.in_flight == 0


async def test_a_client_disconnect_aborts_its_generation(server: Server) -> None:
    with trio.fail_after(CAP_S):
        async with server.client() as client, trio.open_nursery() as nursery:
            scope = trio.CancelScope()

            async def post() -> None:
                with scope:
                    await generate(
                        client, num_inference_steps=LONG, headers={"X-Request-Id": "gone"}
                    )

            nursery.start_soon(post)
            await wait_until(lambda: server.pool.progress("gone") is not None)
            scope.cancel()  # httpx closes the connection
        engine = server.engine()
        await wait_until(lambda: engine.statistics().finished_aborted == 1)
        await wait_until(lambda: server.pool.in_flight == 0 and engine.statistics().running == 0)
        assert worker_steps(server) < LONG
        await wait_until(lambda: any(r["request_id"] == "gone" for r in server.records))
        (record,) = [r for r in server.records if r["request_id"] == "gone"]
        assert (record["outcome"], record["status"]) == ("disconnected", 499)


async def test_closing_an_event_stream_early_aborts_its_generation(
    stream_server: Server,
) -> None:
    with trio.fail_after(CAP_S):
        body = {"prompt": "x", "size": "64x64", "num_inference_steps": LONG, "stream": True}
        headers = {"X-Request-Id": "sse-gone"}
        async with (
            stream_server.client() as client,
            client.stream("POST", GEN, json=body, headers=headers) as r,
        ):
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("event: image_generation.progress"):
                    break  # leaving the block closes the connection
        engine = stream_server.engine()
        await wait_until(lambda: engine.statistics().finished_aborted == 1)
        await wait_until(lambda: stream_server.pool.in_flight == 0)


async def test_a_request_timeout_aborts_it_with_504(server: Server) -> None:
    with trio.fail_after(CAP_S):
        async with server.client() as client:
            r = await generate(client, num_inference_steps=LONG, timeout=0.3)
            error = assert_envelope(r, 504, param="timeout", code="timeout")
            assert error["type"] == "server_error"
            body = {"prompt": "x", "num_inference_steps": LONG, "stream": True, "timeout": 0.3}
            r, events = await read_events(client, body)
        assert r.status_code == 200
        name, data = events[-1]
        assert name == "error" and data["error"]["code"] == "timeout"
        engine = server.engine()
        await wait_until(lambda: engine.statistics().finished_aborted == 2)
        assert server.pool.in_flight == 0


# -- admission ------------------------------------------------------------------------------


async def test_a_timeout_the_queue_cannot_meet_is_refused_at_once_with_503() -> None:
    """Once a service rate is measured, a generation whose timeout is shorter than its
    estimated wait behind the requests in flight gets 503 ``queue_wait_too_long`` with a
    Retry-After at once, instead of waiting and timing out; a full queue's 429 carries a
    Retry-After from the same rate."""
    with trio.fail_after(CAP_S):
        async with run_server(max_queue_len=2) as server, server.client() as client:
            for _ in range(3):
                assert (await generate(client)).status_code == 200
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    lambda: generate(
                        client, num_inference_steps=LONG, headers={"X-Request-Id": "q1"}
                    )
                )
                await wait_until(lambda: server.pool.in_flight == 1)
                wait = server.pool.estimated_wait_s()
                assert wait is not None
                r = await generate(client, timeout=wait / 10)
                assert_envelope(r, 503, param="timeout", code="queue_wait_too_long")
                assert 1 <= int(r.headers["retry-after"]) <= 60
                nursery.start_soon(
                    lambda: generate(
                        client, num_inference_steps=LONG, headers={"X-Request-Id": "q2"}
                    )
                )
                await wait_until(lambda: server.pool.in_flight == 2)
                r = await generate(client)
                assert_envelope(r, 429, code="queue_full")
                assert 1 <= int(r.headers["retry-after"]) <= 60
                for rid in ("q1", "q2"):
                    assert (await client.delete(f"/v1/requests/{rid}")).status_code == 200
        assert server.pool.in_flight == 0


async def test_a_full_queue_answers_429_with_retry_after() -> None:
    with trio.fail_after(CAP_S):
        async with run_server(max_queue_len=1) as server, server.client() as client:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    lambda: generate(
                        client, num_inference_steps=LONG, headers={"X-Request-Id": "q1"}
                    )
                )
                await wait_until(lambda: server.pool.in_flight == 1)
                r = await generate(client)
                error = assert_envelope(r, 429, code="queue_full")
                assert error["type"] == "rate_limit_error"
                assert r.headers["retry-after"] == "2"
                assert (await client.delete("/v1/requests/q1")).status_code == 200
            assert (await generate(client)).status_code == 200


async def test_ready_and_draining(server: Server) -> None:
    with trio.fail_after(CAP_S):
        async with server.client() as client:
            r = await client.get("/ready")
            assert r.status_code == 200
            body = r.json()
            assert body["status"] == "ready"
            assert [(x["index"], x["state"]) for x in body["replicas"]] == [(0, "ready")]
            server.pool.start_draining()
            r = await client.get("/ready")
            error = assert_envelope(r, 503, code="not_ready")
            # Come back when a restarted server would be up: the measured open time.
            restart = str(server.pool.restart_retry_after_s())
            open_s = server.pool.open_time_s()
            assert open_s is not None and restart == str(clamp_retry_after(open_s))
            assert "draining" in error["message"] and r.headers["retry-after"] == restart
            r = await generate(client)
            assert_envelope(r, 503, code="draining")
            assert r.headers["retry-after"] == restart
            assert (await client.get("/health")).json() == {"status": "ok"}


async def test_drain_abort_answers_503() -> None:
    with trio.fail_after(CAP_S):
        async with run_server() as server, server.client() as client:
            answers: list[httpx.Response] = []
            async with trio.open_nursery() as nursery:

                async def post() -> None:
                    answers.append(await generate(client, num_inference_steps=LONG))

                nursery.start_soon(post)
                await wait_until(lambda: server.pool.in_flight == 1)
                server.pool.start_draining()
                server.pool.abort_all("server shutting down")
            error = assert_envelope(answers[0], 503, code="aborted")
            assert "server shutting down" in error["message"]


async def test_a_dying_engine_answers_503_and_its_replica_comes_back() -> None:
    with trio.fail_after(CAP_S):
        async with (
            run_server(max_worker_restarts=0) as server,
            server.client() as client,
            trio.open_nursery() as nursery,
        ):
            answers: list[httpx.Response] = []

            async def post() -> None:
                answers.append(
                    await generate(client, num_inference_steps=LONG, headers={"X-Request-Id": "d"})
                )

            nursery.start_soon(post)
            await wait_until(lambda: server.pool.progress("d") is not None)
            server.engine().executor.fail(WorkerError("killed by the test"))
            await wait_until(lambda: bool(answers))
            assert_envelope(answers[0], 503, code="engine_dead")
            # Retryable: nothing was answered and nothing runs it again but a resend
            # (docs/operations.md, retry-safe answers).
            assert "x-should-retry" not in answers[0].headers
            # At most what is left of the measured open time of the replica reopening.
            open_s = server.pool.open_time_s()
            assert open_s is not None
            assert 1 <= int(answers[0].headers["retry-after"]) <= clamp_retry_after(open_s)
            r = await client.get("/ready")
            if r.status_code != 200:  # the replica may already be back
                assert_envelope(r, 503, code="not_ready")
            await wait_until(lambda: server.pool.readiness()[0])
            assert (await client.get("/ready")).status_code == 200
            assert (await generate(client)).status_code == 200
            assert server.pool.replicas_info()[0]["restarts"] == 1


async def test_probes_replace_a_bad_request_id(server: Server) -> None:
    with trio.fail_after(CAP_S):
        async with server.client() as client:
            r = await client.get("/health", headers={"X-Request-Id": "not valid!"})
        assert r.status_code == 200
        assert is_valid_request_id(r.headers["x-request-id"])


async def test_api_key() -> None:
    with trio.fail_after(CAP_S):
        async with (
            run_server(api_key="sekrit", worker_restart_backoff_s=1.0) as server,
            server.client() as client,
        ):
            good = {"Authorization": "Bearer sekrit"}
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": "Basic sekrit"},
                {"Authorization": "Bearer"},
                {"Authorization": "sekrit"},
            ):
                r = await client.get("/v1/models", headers=headers)
                assert_envelope(r, 401, code="invalid_api_key")
                assert r.headers["www-authenticate"] == "Bearer"
            r = await client.post(GEN, content=b"{not json", headers={"content-type": "text/plain"})
            assert_envelope(r, 401, code="invalid_api_key")  # auth comes first
            assert_envelope(await client.get("/v1/nothing"), 401)
            assert_envelope(await client.get("/v1/nothing", headers=good), 404, code="unknown_url")
            assert_envelope(await client.get("/metrics"), 401)
            assert (await client.get("/metrics", headers=good)).status_code == 200
            assert (await client.get("/health")).status_code == 200
            # /ready stays open for probes, but its details (pids, counts, failure text)
            # need the key.
            open_ready = await client.get("/ready")
            assert open_ready.status_code == 200 and open_ready.json() == {"status": "ready"}
            keyed = (await client.get("/ready", headers=good)).json()
            assert keyed["status"] == "ready" and keyed["replicas"][0]["state"] == "ready"
            server.engine().executor.fail(WorkerError("secret failure text /srv/x"))
            await wait_until(lambda: server.engine().health().state == "restarting")
            r = await client.get("/ready")  # within the restart's 1 s backoff
            error = assert_envelope(r, 503, code="not_ready")
            assert "secret" not in r.text and error["message"] == "not ready: restarting"
            keyed_503 = await client.get("/ready", headers=good)
            assert "secret failure text" in keyed_503.text
            await wait_until(lambda: server.engine().health().healthy)
            assert (await client.get("/v1/models", headers=good)).status_code == 200
            lower = {"Authorization": "bearer sekrit"}
            assert (await generate(client, headers=lower)).status_code == 200

            def sdk(key: str) -> Any:
                with openai.OpenAI(
                    base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=20
                ) as sdk_client:
                    try:
                        return sdk_client.images.generate(
                            model=MODEL,
                            prompt="x",
                            size="64x64",
                            extra_body={"num_inference_steps": 1},
                        )
                    except openai.APIStatusError as exc:
                        return exc

            wrong = await trio.to_thread.run_sync(sdk, "wrong")
            assert isinstance(wrong, openai.AuthenticationError)
            assert wrong.body["code"] == "invalid_api_key"
            right = await trio.to_thread.run_sync(sdk, "sekrit")
            assert len(right.data) == 1


async def test_models_health_and_metrics(server: Server) -> None:
    with trio.fail_after(CAP_S):
        async with server.client() as client:
            r = await client.get("/v1/models")
            assert r.status_code == 200
            (model,) = r.json()["data"]
            assert r.json()["object"] == "list"
            assert (model["id"], model["object"], model["owned_by"]) == (
                MODEL,
                "model",
                "omni-trio",
            )
            assert isinstance(model["created"], int)
            assert (await client.get("/health")).json() == {"status": "ok"}
            assert (await generate(client, n=2)).status_code == 200
            assert (await client.get("/nope")).status_code == 404
            r = await client.get("/metrics")
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/plain")
        text = r.text
        for line in (
            'omni_trio_requests_total{route="/v1/images/generations",status="200"} 1.0',
            'omni_trio_requests_total{route="unknown",status="404"} 1.0',
            'omni_trio_requests_total{route="/v1/models",status="200"} 1.0',
            "omni_trio_images_generated_total 2.0",
            'omni_trio_engine_state{replica="0"} 2.0',
            "omni_trio_replicas_ready 1.0",
            "omni_trio_queue_wait_seconds_count 1.0",
            'omni_trio_worker_restarts_total{replica="0"} 0.0',
        ):
            assert line in text, line


async def test_every_request_gets_one_access_record(server: Server) -> None:
    with trio.fail_after(CAP_S):
        async with server.client() as client:
            await generate(client, headers={"X-Request-Id": "logged"})
            await client.get("/nope", headers={"X-Request-Id": "lost"})
        # The record is written once the answer went out: the client may see it first.
        await wait_until(lambda: len(server.records) == 2)
        by_id = {r["request_id"]: r for r in server.records}
        ok, lost = by_id["logged"], by_id["lost"]
        assert set(ok) == {
            "request_id",
            "method",
            "path",
            "route",
            "status",
            "outcome",
            "ms",
            "client",
        }
        assert (ok["route"], ok["status"], ok["outcome"], ok["method"]) == (GEN, 200, "ok", "POST")
        assert ok["ms"] > 0 and ok["client"].startswith("127.0.0.1:")
        assert (lost["route"], lost["status"], lost["outcome"]) == ("unknown", 404, "rejected")


async def test_an_encoded_newline_in_the_url_cannot_forge_a_log_line(server: Server) -> None:
    with trio.fail_after(CAP_S):
        async with server.client() as client:
            r = await client.get(
                "/nope%0A127.0.0.1%20GET%20/admin%20200%1b[2J", headers={"X-Request-Id": "forge"}
            )
            assert r.status_code == 404
        await wait_until(lambda: any(x["request_id"] == "forge" for x in server.records))
    (record,) = [x for x in server.records if x["request_id"] == "forge"]
    assert record["path"].isprintable() and "\n" not in record["path"]
    assert record["path"] == "/nope\\n127.0.0.1 GET /admin 200\\x1b[2J"


# -- ownership ------------------------------------------------------------------------------


async def start_long(
    client: httpx.AsyncClient, nursery: trio.Nursery, answers: dict[str, Any], name: str, **kw: Any
) -> None:
    async def post() -> None:
        answers[name] = await generate(client, num_inference_steps=LONG, **kw)

    nursery.start_soon(post)


async def test_a_key_with_a_priority_range_may_ask_only_for_priorities_within_it() -> None:
    """``priority_ranges``: the batch key may ask for 0..10 only (its 400 says the range and
    names the field), the other key for the engine's whole range; nothing is admitted for
    the refused request."""
    batch, other = {"Authorization": "Bearer k-batch"}, {"Authorization": "Bearer k-other"}
    with trio.fail_after(CAP_S):
        async with (
            run_server(
                api_keys=("k-batch", "k-other"),
                app_options={"priority_ranges": {"k-batch": (0, 10)}},
            ) as server,
            server.client() as client,
        ):
            r = await generate(client, priority=-3, headers=batch)
            error = assert_envelope(r, 400, param="priority", code="priority_not_allowed")
            assert "0..10" in error["message"]
            assert (await generate(client, priority=3, headers=batch)).status_code == 200
            assert (await generate(client, priority=-3, headers=other)).status_code == 200
            r = await generate(client, priority=-11, headers=other)  # the engine's range
            assert_envelope(r, 400, param="priority", code="invalid_value")
            assert server.engine().statistics().finished_completed == 2


async def test_only_the_key_that_made_a_request_can_see_or_cancel_it() -> None:
    """Two keys: each may use the same X-Request-Id at once (no 409); GET and DELETE
    /v1/requests/{id} act on the caller's own request only; another key's -- generated ids
    included -- is a 404 like an id that never existed."""
    one, two = {"Authorization": "Bearer k-one"}, {"Authorization": "Bearer k-two"}
    with trio.fail_after(CAP_S):
        async with (
            run_server(api_keys=("k-one", "k-two")) as server,
            server.client() as client,
            trio.open_nursery() as nursery,
        ):
            answers: dict[str, Any] = {}
            same = {"X-Request-Id": "same"}
            await start_long(client, nursery, answers, "one", headers={**one, **same})
            await start_long(client, nursery, answers, "two", headers={**two, **same})
            await start_long(client, nursery, answers, "gen", headers=one)
            await wait_until(lambda: server.pool.in_flight == 3)
            for headers in (one, two):
                r = await client.get("/v1/requests/same", headers=headers)
                assert r.status_code == 200, r.text
                assert r.json()["id"] == "same" and r.json()["object"] == "request"
                assert r.json()["status"] in ("queued", "running")
            # the generated id of key one's third request, seen only through the engine
            engine_ids = {
                s.engine_request_id for s in server.pool._active.values() if s.public_id != "same"
            }
            (generated,) = {e.partition("@")[0] for e in engine_ids}
            assert all("@" in e for e in engine_ids)  # scoped to key one
            assert_envelope(
                await client.delete(f"/v1/requests/{generated}", headers=two),
                404,
                code="request_not_found",
            )
            assert_envelope(
                await client.get(f"/v1/requests/{generated}", headers=two),
                404,
                code="request_not_found",
            )
            assert_envelope(await client.delete("/v1/requests/same"), 401, code="invalid_api_key")
            # an engine id ("same@<tag>") as a path is nobody's public id: a 404 for the other
            # key (and for its own, whose public id is "same"); nothing is cancelled
            sames = [s for s in server.pool._active.values() if s.public_id == "same"]
            assert len(sames) == 2 and all("@" in s.engine_request_id for s in sames)
            for stream in sames:
                for headers in (one, two):
                    r = await client.delete(
                        f"/v1/requests/{stream.engine_request_id}", headers=headers
                    )
                    assert_envelope(r, 404, code="request_not_found")
            assert all(s.abort_reason is None for s in sames)
            # key two cancels its own "same"; key one's runs on
            r = await client.delete("/v1/requests/same", headers=two)
            assert r.status_code == 200 and r.json()["status"] == "cancelled"
            await wait_until(lambda: "two" in answers)
            assert_envelope(answers["two"], 409, code="request_cancelled")
            assert (await client.get("/v1/requests/same", headers=one)).json()["status"] in (
                "queued",
                "running",
            )
            assert (await client.get("/v1/requests/same", headers=two)).json()["status"] == (
                "finished"
            )
            for rid in ("same", generated):
                assert (await client.delete(f"/v1/requests/{rid}", headers=one)).status_code == 200
        assert_envelope(answers["one"], 409, code="request_cancelled")
        assert answers["one"].headers["x-request-id"] == "same"
        assert answers["gen"].headers["x-request-id"] == generated
        owners = {r["owner"] for r in server.records if r["route"] == GEN}
        assert len(owners) == 2  # the access records say whose request it was, as a tag
        assert not any("k-one" in str(r) or "k-two" in str(r) for r in server.records)


async def test_without_keys_the_client_token_owns_its_requests(server: Server) -> None:
    """No API key configured: the bearer token a client sends (the OpenAI SDKs always send
    one) is its client token; clients without a token share the anonymous owner."""
    alice, bob = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
    with trio.fail_after(CAP_S):
        async with server.client() as client, trio.open_nursery() as nursery:
            answers: dict[str, Any] = {}
            await start_long(client, nursery, answers, "a", headers={**alice, "X-Request-Id": "r"})
            await start_long(client, nursery, answers, "anon", headers={"X-Request-Id": "r"})
            await wait_until(lambda: server.pool.in_flight == 2)
            for headers in (bob, {"Authorization": "Bearer alice2"}):
                assert_envelope(
                    await client.delete("/v1/requests/r", headers=headers),
                    404,
                    code="request_not_found",
                )
            # a path spelling alice's engine id ("r@<her tag>") reaches nothing, neither for
            # the anonymous owner (whose engine ids are the public ids themselves) nor for bob
            (alices,) = [s for s in server.pool._active.values() if s.owner]
            crafted = f"/v1/requests/{alices.engine_request_id}"
            assert "@" in crafted
            for headers in ({}, bob):
                for method in ("DELETE", "GET"):
                    r = await client.request(method, crafted, headers=headers)
                    assert_envelope(r, 404, code="request_not_found")
            assert alices.abort_reason is None
            # the anonymous "r" and alice's "r" are different requests
            assert (await client.delete("/v1/requests/r")).status_code == 200
            await wait_until(lambda: "anon" in answers)
            assert (await client.get("/v1/requests/r", headers=alice)).json()["status"] in (
                "queued",
                "running",
            )
            assert (await client.delete("/v1/requests/r", headers=alice)).status_code == 200
        assert_envelope(answers["a"], 409, code="request_cancelled")
        assert_envelope(answers["anon"], 409, code="request_cancelled")


async def test_request_status_reports_progress(server: Server) -> None:
    with trio.fail_after(CAP_S):
        async with server.client() as client, trio.open_nursery() as nursery:
            answers: dict[str, Any] = {}
            await start_long(client, nursery, answers, "p", headers={"X-Request-Id": "p"})
            await wait_until(lambda: (server.pool.progress("p") or (0, 0))[0] >= 2)
            body = (await client.get("/v1/requests/p")).json()
            assert body["status"] == "running"
            assert body["progress"]["total"] == LONG and 2 <= body["progress"]["step"] <= LONG
            assert (await client.delete("/v1/requests/p")).status_code == 200
        async with server.client() as client:
            r = await client.get("/v1/requests/p")
        expected = {"id": "p", "object": "request", "status": "finished", "progress": None}
        assert r.json() == expected


# -- the access log -------------------------------------------------------------------------


def test_the_access_line_prints_the_latency_once_and_probes_while_not_ready_are_debug() -> None:
    lines: list[tuple[int, str]] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append((record.levelno, TextFormatter().format(record)))

    logger = logging.getLogger("tests.serve.access")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    handler = Capture()
    logger.addHandler(handler)
    try:
        sink = logger_sink(logger)
        base = {"request_id": "r1", "method": "GET", "outcome": "ok", "client": "1.2.3.4:5"}
        sink({**base, "path": GEN, "route": GEN, "status": 200, "ms": 3029.727})
        sink({**base, "path": "/ready", "route": "/ready", "status": 503, "ms": 0.25})
        sink({**base, "path": GEN, "route": GEN, "status": 503, "ms": 1.5})
    finally:
        logger.removeHandler(handler)
    (level, text), (ready_level, _), (error_level, _) = lines
    assert level == logging.INFO and text.count("3029.7") == 1, text
    assert text.endswith("r1 GET /v1/images/generations -> 200 ok 3029.727ms client=1.2.3.4:5")
    assert ready_level == logging.DEBUG
    assert error_level == logging.WARNING


# -- failures -------------------------------------------------------------------------------


async def test_a_request_during_a_worker_restart_waits_for_the_new_group() -> None:
    """While the only replica's worker group restarts, a new generation is queued in its
    engine and served by the new group, not answered 503 (as docs/supervision.md says)."""
    with trio.fail_after(CAP_S):
        async with (
            run_server(worker_restart_backoff_s=1.0) as server,
            server.client() as client,
        ):
            server.engine().executor.fail(WorkerError("killed by the test"))
            await wait_until(lambda: server.engine().health().state == "restarting")
            r = await generate(client, headers={"X-Request-Id": "during"})
            assert r.status_code == 200, r.text
            assert decode_b64(r.json()["data"][0]["b64_json"])[1][0] == "during"
            assert server.engine().health().restarts == 1


async def test_a_request_posted_while_a_killed_tractor_worker_restarts_gets_200() -> None:
    """A real restart: the tractor worker process is SIGKILLed; a generation posted while
    its group restarts (within the 1 s backoff) waits in the queue and is served by the new
    worker, not answered 503."""
    with trio.fail_after(CAP_S):
        async with (
            run_server(
                backend="tractor", worker_start_method="forkserver", worker_restart_backoff_s=1.0
            ) as server,
            server.client() as client,
        ):
            executor = server.engine().executor
            (pid,) = executor.worker_pids().values()  # type: ignore[attr-defined]
            os.kill(pid, signal.SIGKILL)
            await wait_until(lambda: server.engine().health().state == "restarting")
            posted = trio.current_time()
            r = await generate(client, headers={"X-Request-Id": "during"})
            waited = trio.current_time() - posted
            assert r.status_code == 200, r.text
            assert decode_b64(r.json()["data"][0]["b64_json"])[1][0] == "during"
            health = server.engine().health()
            assert health.restarts == 1 and health.healthy
            assert health.last_failure is not None and f"process {pid}" in health.last_failure
            (new_pid,) = server.engine().executor.worker_pids().values()  # type: ignore[attr-defined]
            assert new_pid != pid
            # It was admitted during the restart, not after it: it waited for the new group.
            assert r.json()["metrics"]["queue_wait_ms"] > 300, r.json()["metrics"]
            assert waited < 10.0


async def test_a_restart_longer_than_restart_wait_s_is_a_503_with_retry_after() -> None:
    """The only replica's worker group stays down (a 30 s backoff): a generation admitted
    meanwhile waits ``restart_wait_s`` (0.5 s here), then gets a retryable 503 with
    ``Retry-After``; one whose own timeout is shorter gets its 504 first."""
    with trio.fail_after(CAP_S):
        async with (
            run_server(worker_restart_backoff_s=30.0, worker_restart_backoff_max_s=30.0) as server,
            server.client() as client,
        ):
            server.pool.restart_wait_s = 0.5
            server.engine().executor.fail(WorkerError("killed by the test"))
            await wait_until(lambda: server.engine().health().state == "restarting")
            posted = trio.current_time()
            r = await generate(client, headers={"X-Request-Id": "waits"})
            waited = trio.current_time() - posted
            error = assert_envelope(r, 503, code="aborted")
            assert "restart_wait_s" in error["message"], error
            # When the group should be back: its 30 s backoff plus the measured open time.
            assert int(r.headers["retry-after"]) == server.pool.ready_retry_after_s() > 30
            assert r.headers.get("x-should-retry") != "false"  # the SDKs may retry it
            assert 0.5 <= waited < 5.0, waited
            short = await generate(client, timeout=0.2, headers={"X-Request-Id": "short"})
            assert_envelope(short, 504, code="timeout")
            assert server.engine().health().state == "restarting"
            assert server.pool.in_flight == 0


async def test_a_failed_request_is_a_500_without_internals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    register_models(
        monkeypatch,
        {
            "fake:failing": lambda options: ScriptedModel(
                fail_with=RuntimeError("secret detail /srv/weights"), name="fake:failing"
            )
        },
    )
    with trio.fail_after(CAP_S):
        async with run_server(model="fake:failing") as server, server.client() as client:
            r = await client.post(
                GEN, json={"prompt": "x", "model": "fake:failing"}, headers={"X-Request-Id": "f1"}
            )
            error = assert_envelope(r, 500, code="RuntimeError")
            assert error["type"] == "server_error"
            assert "secret" not in r.text and "f1" in error["message"]
            r, events = await read_events(client, {"prompt": "x", "stream": True})
            name, data = events[-1]
            assert name == "error" and data["error"]["code"] == "RuntimeError"
            assert "secret" not in json.dumps(data)
            assert (await client.get("/health")).status_code == 200
        (record,) = [x for x in server.records if x["request_id"] == "f1"]
        assert "secret detail" in record["detail"]  # the server-side log keeps it


class BrokenStore(ImageStore):
    def put(self, data: bytes, content_type: str) -> str:
        raise RuntimeError("store internals: /var/secret")


async def test_an_unexpected_error_is_a_generic_500_naming_the_request() -> None:
    with trio.fail_after(CAP_S):
        store = BrokenStore(clock=FakeClock())
        async with run_server(store=store) as server, server.client() as client:
            r = await generate(client, response_format="url", headers={"X-Request-Id": "b1"})
            error = assert_envelope(r, 500, code="internal_error")
            assert "b1" in error["message"] and "secret" not in r.text
            assert (await generate(client)).status_code == 200
        (record,) = [x for x in server.records if x["request_id"] == "b1"]
        assert record["outcome"] == "error" and "/var/secret" in record["detail"]


async def test_the_sdk_with_default_retries_never_recomputes_a_request_that_failed_once_admitted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The official client retries 5xx twice by default.  A failure after the images were
    made (the url store broke: a generic 500) and a model that fails (a 500 with its error
    type) both say ``x-should-retry: false``, so the engine admits each request once."""
    register_models(
        monkeypatch,
        {
            "fake:failing": lambda options: ScriptedModel(
                fail_with=RuntimeError("model failure"), name="fake:failing"
            )
        },
    )

    def sdk_call(url: str, model: str, **extra: Any) -> openai.APIStatusError:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=30) as sdk:
            assert sdk.max_retries == 2  # the default
            with pytest.raises(openai.APIStatusError) as info:
                sdk.images.generate(
                    model=model,
                    prompt="x",
                    size="64x64",
                    extra_body={"num_inference_steps": 2},
                    **extra,
                )
            return info.value

    with trio.fail_after(CAP_S * 2):
        async with run_server(store=BrokenStore(clock=FakeClock())) as server:
            engine = server.engine()
            stored = await trio.to_thread.run_sync(
                lambda: sdk_call(server.url, MODEL, response_format="url")
            )
            assert stored.status_code == 500 and stored.body["code"] == "internal_error"
            assert stored.response.headers["x-should-retry"] == "false"
            assert engine.statistics().admitted == 1
        async with run_server(model="fake:failing") as server:
            engine = server.engine()
            failed = await trio.to_thread.run_sync(lambda: sdk_call(server.url, "fake:failing"))
            assert failed.status_code == 500 and failed.body["code"] == "RuntimeError"
            assert failed.response.headers["x-should-retry"] == "false"
            assert engine.statistics().admitted == 1


# -- the hostile corpus ---------------------------------------------------------------------

J = {"content-type": "application/json"}


def body(**fields: Any) -> bytes:
    return json.dumps({"prompt": "x", "size": "64x64", "num_inference_steps": 2, **fields}).encode()


async def oversize_stream() -> AsyncIterator[bytes]:
    for _ in range(40):
        yield b" " * 50_000  # 2 MB in chunks, no Content-Length


# (name, method, path, content, headers, status, param, code)
CORPUS: list[tuple[str, str, str, Any, Any, int, Any, Any]] = [
    ("invalid json", "POST", GEN, b"{", J, 400, None, "invalid_json"),
    ("empty body", "POST", GEN, b"", J, 400, None, "invalid_json"),
    ("trailing garbage", "POST", GEN, b'{"prompt": "x"} x', J, 400, None, "invalid_json"),
    ("invalid utf-8", "POST", GEN, b'{"prompt": "\xff\xfe"}', J, 400, None, "invalid_json"),
    ("deep nesting", "POST", GEN, b"[" * 100_000, J, 400, None, "invalid_json"),
    (
        "5000-digit int",
        "POST",
        GEN,
        b'{"prompt": "x", "n": ' + b"9" * 5000 + b"}",
        J,
        400,
        None,
        "invalid_json",
    ),
    ("array body", "POST", GEN, b"[]", J, 400, None, "invalid_type"),
    ("string body", "POST", GEN, b'"draw"', J, 400, None, "invalid_type"),
    ("null body", "POST", GEN, b"null", J, 400, None, "invalid_type"),
    ("no prompt", "POST", GEN, b"{}", J, 400, "prompt", "missing_required_parameter"),
    ("number prompt", "POST", GEN, body(prompt=1), J, 400, "prompt", "invalid_type"),
    ("empty prompt", "POST", GEN, body(prompt=""), J, 400, "prompt", "invalid_value"),
    ("huge prompt", "POST", GEN, body(prompt="x" * 4001), J, 400, "prompt", "invalid_value"),
    ("object prompt", "POST", GEN, body(prompt={"a": 1}), J, 400, "prompt", "invalid_type"),
    ("bool n", "POST", GEN, body(n=True), J, 400, "n", "invalid_type"),
    ("zero n", "POST", GEN, body(n=0), J, 400, "n", "invalid_value"),
    ("huge n", "POST", GEN, body(n=10_000), J, 400, "n", "invalid_value"),
    ("string n", "POST", GEN, body(n="1"), J, 400, "n", "invalid_type"),
    ("float n", "POST", GEN, body(n=1.5), J, 400, "n", "invalid_type"),
    ("huge size", "POST", GEN, body(size="99999x99999"), J, 400, "size", "invalid_value"),
    ("too many pixels", "POST", GEN, body(size="2048x2048"), J, 400, "size", "invalid_value"),
    ("odd size", "POST", GEN, body(size="63x64"), J, 400, "size", "invalid_value"),
    ("word size", "POST", GEN, body(size="large"), J, 400, "size", "invalid_value"),
    ("int size", "POST", GEN, body(size=512), J, 400, "size", "invalid_type"),
    ("negative size", "POST", GEN, body(size="-64x-64"), J, 400, "size", "invalid_value"),
    (
        "negative steps",
        "POST",
        GEN,
        body(num_inference_steps=-1),
        J,
        400,
        "num_inference_steps",
        "invalid_value",
    ),
    (
        "zero steps",
        "POST",
        GEN,
        body(num_inference_steps=0),
        J,
        400,
        "num_inference_steps",
        "invalid_value",
    ),
    (
        "too many steps",
        "POST",
        GEN,
        body(num_inference_steps=10**30),
        J,
        400,
        "num_inference_steps",
        "invalid_value",
    ),
    (
        "float steps",
        "POST",
        GEN,
        body(num_inference_steps=1e9),
        J,
        400,
        "num_inference_steps",
        "invalid_type",
    ),
    (
        "bool steps",
        "POST",
        GEN,
        body(num_inference_steps=False),
        J,
        400,
        "num_inference_steps",
        "invalid_type",
    ),
    (
        "NaN guidance",
        "POST",
        GEN,
        b'{"prompt": "x", "guidance_scale": NaN}',
        J,
        400,
        "guidance_scale",
        "invalid_value",
    ),
    (
        "inf guidance",
        "POST",
        GEN,
        b'{"prompt": "x", "guidance_scale": -Infinity}',
        J,
        400,
        "guidance_scale",
        "invalid_value",
    ),
    (
        "negative guidance",
        "POST",
        GEN,
        body(guidance_scale=-0.5),
        J,
        400,
        "guidance_scale",
        "invalid_value",
    ),
    (
        "string guidance",
        "POST",
        GEN,
        body(guidance_scale="7"),
        J,
        400,
        "guidance_scale",
        "invalid_type",
    ),
    ("negative seed", "POST", GEN, body(seed=-1), J, 400, "seed", "invalid_value"),
    ("huge seed", "POST", GEN, body(seed=2**40), J, 400, "seed", "invalid_value"),
    ("float seed", "POST", GEN, body(seed=1.5), J, 400, "seed", "invalid_type"),
    (
        "list negative prompt",
        "POST",
        GEN,
        body(negative_prompt=["a"]),
        J,
        400,
        "negative_prompt",
        "invalid_type",
    ),
    (
        "bad response format",
        "POST",
        GEN,
        body(response_format="xml"),
        J,
        400,
        "response_format",
        "invalid_value",
    ),
    (
        "bad output format",
        "POST",
        GEN,
        body(output_format="bmp"),
        J,
        400,
        "output_format",
        "invalid_value",
    ),
    (
        "bad compression",
        "POST",
        GEN,
        body(output_compression=200),
        J,
        400,
        "output_compression",
        "invalid_value",
    ),
    ("string stream", "POST", GEN, body(stream="yes"), J, 400, "stream", "invalid_type"),
    (
        "too many partials",
        "POST",
        GEN,
        body(partial_images=10),
        J,
        400,
        "partial_images",
        "invalid_value",
    ),
    ("negative timeout", "POST", GEN, body(timeout=-3), J, 400, "timeout", "invalid_value"),
    ("string timeout", "POST", GEN, body(timeout="soon"), J, 400, "timeout", "invalid_type"),
    ("priority too low", "POST", GEN, body(priority=-11), J, 400, "priority", "invalid_value"),
    ("unknown field", "POST", GEN, body(foo=1), J, 400, "foo", "unknown_parameter"),
    ("proto field", "POST", GEN, body(__proto__={}), J, 400, "__proto__", "unknown_parameter"),
    (
        "engine-only field",
        "POST",
        GEN,
        body(extra_args={"faults": []}),
        J,
        400,
        "extra_args",
        "unknown_parameter",
    ),
    ("other model", "POST", GEN, body(model="gpt-image-1"), J, 404, "model", "model_not_found"),
    ("number model", "POST", GEN, body(model=7), J, 400, "model", "invalid_type"),
    ("no content type", "POST", GEN, body(), {}, 415, "Content-Type", "unsupported_media_type"),
    (
        "text content type",
        "POST",
        GEN,
        body(),
        {"content-type": "text/plain"},
        415,
        "Content-Type",
        "unsupported_media_type",
    ),
    (
        "form content type",
        "POST",
        GEN,
        b"prompt=x",
        {"content-type": "application/x-www-form-urlencoded"},
        415,
        "Content-Type",
        "unsupported_media_type",
    ),
    (
        "json-ish content type",
        "POST",
        GEN,
        body(),
        {"content-type": "application/jsonx"},
        415,
        "Content-Type",
        "unsupported_media_type",
    ),
    ("oversize by length", "POST", GEN, b" " * 2_000_000, J, 413, None, "request_too_large"),
    ("oversize chunked", "POST", GEN, oversize_stream, J, 413, None, "request_too_large"),
    (
        "bad request id chars",
        "POST",
        GEN,
        body(),
        {**J, "X-Request-Id": "a b"},
        400,
        "X-Request-Id",
        "invalid_request_id",
    ),
    (
        "long request id",
        "POST",
        GEN,
        body(),
        {**J, "X-Request-Id": "a" * 129},
        400,
        "X-Request-Id",
        "invalid_request_id",
    ),
    (
        "path request id",
        "POST",
        GEN,
        body(),
        {**J, "X-Request-Id": "../etc"},
        400,
        "X-Request-Id",
        "invalid_request_id",
    ),
    (
        "empty request id",
        "POST",
        GEN,
        body(),
        {**J, "X-Request-Id": ""},
        400,
        "X-Request-Id",
        "invalid_request_id",
    ),
    (
        "two request ids",
        "POST",
        GEN,
        body(),
        [("content-type", "application/json"), ("X-Request-Id", "a"), ("X-Request-Id", "b")],
        400,
        "X-Request-Id",
        "invalid_request_id",
    ),
    ("get generations", "GET", GEN, None, {}, 405, None, "method_not_allowed"),
    ("put generations", "PUT", GEN, body(), J, 405, None, "method_not_allowed"),
    ("unknown route", "GET", "/nope", None, {}, 404, None, "unknown_url"),
    ("unknown v1 route", "POST", "/v1/chat/completions", body(), J, 404, None, "unknown_url"),
    ("traversal", "GET", "/v1/files/../../etc/passwd", None, {}, 404, None, ...),
    ("post models", "POST", "/v1/models", body(), J, 405, None, "method_not_allowed"),
    ("get unknown request", "GET", "/v1/requests/x", None, {}, 404, "id", "request_not_found"),
    ("put request", "PUT", "/v1/requests/x", None, {}, 405, None, "method_not_allowed"),
    ("delete unknown", "DELETE", "/v1/requests/nobody", None, {}, 404, "id", "request_not_found"),
    ("delete empty id", "DELETE", "/v1/requests/", None, {}, 404, "id", "request_not_found"),
    ("unknown file", "GET", "/v1/files/file-x/content", None, {}, 404, None, "file_not_found"),
    ("nested file path", "GET", "/v1/files/a/b/content", None, {}, 404, None, "unknown_url"),
    ("post health", "POST", "/health", b"{}", J, 405, None, "method_not_allowed"),
    ("delete metrics", "DELETE", "/metrics", None, {}, 405, None, "method_not_allowed"),
]


async def test_a_413_stays_a_413_when_the_client_hangs_up_while_it_is_answered() -> None:
    """A chunked body over the cap, the client closing as soon as it read the status line:
    writing the answer then races the connection's end (hypercorn's writer may be busy), and
    that once counted as a 500 with a traceback (a quarter of the tries).  Every record must
    say 413."""
    with trio.fail_after(CAP_S):
        async with run_server(limits=ServeLimits(max_body_bytes=1000)) as server:
            host, port = server.url.removeprefix("http://").split(":")
            head = (
                b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            )
            chunk = b"x" * 4000
            tries = 60
            for _ in range(tries):
                stream = await trio.open_tcp_stream(host, int(port))
                try:
                    await stream.send_all(head + b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    data = b""
                    while b"\r\n" not in data:
                        got = await stream.receive_some(65536)
                        if not got:
                            break
                        data += got
                    assert data.startswith(b"HTTP/1.1 413"), data[:80]
                finally:
                    await stream.aclose()
            await wait_until(lambda: len(server.records) == tries)
    assert {record["status"] for record in server.records} == {413}, server.records


async def test_content_length_with_chunked_encoding_is_refused(server: Server) -> None:
    """Both framings in one request is how requests are smuggled past a proxy that reads
    the other one (RFC 9112 6.3): a 400 with the envelope, never a generation."""
    host, port = server.url.removeprefix("http://").split(":")
    payload = b'{"prompt": "smuggled", "size": "64x64"}'
    raw = (
        b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
    ) % (len(payload), len(payload), payload)
    with trio.fail_after(CAP_S):
        stream = await trio.open_tcp_stream(host, int(port))
        try:
            await stream.send_all(raw)
            data = b""
            while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
                got = await stream.receive_some(65536)
                if not got:
                    break
                data += got
        finally:
            await stream.aclose()
    assert data.startswith(b"HTTP/1.1 400"), data[:200]
    assert b"Content-Length and Transfer-Encoding" in data
    assert all(r["status"] == 400 for r in server.records), server.records


async def test_a_corpus_of_hostile_requests_gets_envelopes_and_leaves_the_server_fine(
    server: Server,
) -> None:
    assert len(CORPUS) >= 50
    with trio.fail_after(CAP_S * 2):
        async with server.client() as client:
            for name, method, path, content, headers, status, param, code in CORPUS:
                if callable(content):
                    content = content()
                r = await client.request(method, path, content=content, headers=headers)
                try:
                    assert_envelope(r, status, param=param, code=code)
                    if status == 405:
                        assert r.headers["allow"]
                except AssertionError as exc:
                    raise AssertionError(f"corpus case {name!r}: {exc}") from exc
            # The same id twice while the first request runs: 409, and the first is untouched.
            async with trio.open_nursery() as nursery:
                first: list[httpx.Response] = []

                async def post_first() -> None:
                    first.append(
                        await generate(
                            client, num_inference_steps=30, headers={"X-Request-Id": "dup"}
                        )
                    )

                nursery.start_soon(post_first)
                await wait_until(lambda: server.pool.in_flight == 1)
                r = await generate(client, headers={"X-Request-Id": "dup"})
                assert_envelope(r, 409, param="X-Request-Id", code="duplicate_request_id")
                assert r.headers["x-should-retry"] == "false"  # no SDK resend runs it twice
            assert first[0].status_code == 200
            assert decode_b64(first[0].json()["data"][0]["b64_json"])[1][0] == "dup"
            # Still healthy and still generating.
            assert (await client.get("/health")).json() == {"status": "ok"}
            assert (await client.get("/ready")).status_code == 200
            r = await generate(client, seed=1, headers={"X-Request-Id": "after"})
            assert r.status_code == 200
            assert decode_b64(r.json()["data"][0]["b64_json"])[1] == ("after", 1, 0)
        assert server.pool.in_flight == 0
        statuses = [rec["status"] for rec in server.records]
        assert 500 not in statuses


# -- lifespan -------------------------------------------------------------------------------


def bare_app(**options: Any) -> ImagesApp:
    """The app without a server or a serving pool (routes that need no engine)."""
    pool = EnginePool(EngineConfig(model=MODEL))
    return ImagesApp(
        pool,
        model_name=MODEL,
        limits=ServeLimits(),
        api_key=None,
        store=ImageStore(),
        metrics=ServeMetrics(pool),
        **options,
    )


def health_scope(**extensions: Any) -> dict[str, Any]:
    return {
        "type": "http",
        "http_version": "1.1",
        "method": "GET",
        "path": "/health",
        "headers": [],
        "extensions": extensions,
    }


def slow_clients(app: ImagesApp) -> float:
    value = app.metrics.registry.get_sample_value(
        "omni_trio_slow_clients_total", {"reason": "send_timeout"}
    )
    return value or 0.0


async def test_under_another_asgi_server_the_app_bounds_its_own_sends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Without the HTTP server's deadline in the scope, a send that never returns ends the
    handler after send_timeout_s (virtual time), counted once, by the app."""
    records: list[dict[str, Any]] = []
    app = bare_app(send_timeout_s=7.0, log=records.append)

    async def receive() -> dict[str, Any]:
        await trio.sleep_forever()
        raise AssertionError

    async def stuck_send(message: Any) -> None:
        await trio.sleep_forever()

    start = trio.current_time()
    await app(health_scope(), receive, stuck_send)
    assert trio.current_time() - start == pytest.approx(7.0)
    (record,) = records
    assert (record["status"], record["outcome"]) == (200, "send_timeout")
    assert slow_clients(app) == 1.0


async def test_under_the_http_server_its_deadline_stops_the_handler_uncounted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """With the HTTP server's deadline in the scope, the app never races it (no deadline of
    its own, however long a send takes): when the server has dropped the connection
    (``expired``), the handler stops at its next send and the app counts nothing (the server
    counted the drop)."""
    records: list[dict[str, Any]] = []
    app = bare_app(send_timeout_s=1.0, log=records.append)
    deadline = SendDeadline(1.0)
    sent: list[str] = []

    async def receive() -> dict[str, Any]:
        await trio.sleep_forever()
        raise AssertionError

    async def dropping_send(message: Any) -> None:
        sent.append(message["type"])
        await trio.sleep(5.0)  # the server's business, past the app's own 1 s
        deadline.expired = True  # the server dropped the connection meanwhile

    start = trio.current_time()
    await app(health_scope(**{SEND_DEADLINE: deadline}), receive, dropping_send)
    assert trio.current_time() - start == pytest.approx(5.0)
    assert sent == ["http.response.start"]  # no body after the drop
    (record,) = records
    assert (record["status"], record["outcome"]) == (200, "send_timeout")
    assert slow_clients(app) == 0.0


async def test_a_generation_reserves_its_answer_at_admission() -> None:
    """max_response_bytes_in_flight counts a generation's estimated answer from admission,
    not only once its images are encoded: with room for one 1024x1024 answer, a second such
    generation is refused (429) while the first runs; a size left unset counts the model's
    default size; everything is released when the requests end."""
    per_image = 1024 * 1024 * RESPONSE_BYTES_PER_PIXEL + RESPONSE_BYTES_PER_IMAGE
    with trio.fail_after(CAP_S):
        async with (
            run_server(app_options={"max_response_bytes_in_flight": per_image + MIB}) as server,
            server.client() as client,
        ):
            responses = server.app.responses
            async with trio.open_nursery() as nursery:
                await reserve_and_refuse(server, client, nursery, per_image)
            await wait_until(lambda: responses.in_flight == 0)  # the 409s written
            r = await generate(client, size="1024x1024", num_inference_steps=1)
            assert r.status_code == 200, r.text
            await wait_until(lambda: responses.in_flight == 0)


async def reserve_and_refuse(
    server: Server, client: httpx.AsyncClient, nursery: trio.Nursery, per_image: int
) -> None:
    responses = server.app.responses
    answers: dict[str, Any] = {}
    await start_long(
        client, nursery, answers, "big", size="1024x1024", headers={"X-Request-Id": "b"}
    )
    await wait_until(lambda: server.pool.status("b") == "running")
    assert responses.in_flight == per_image
    r = await generate(client, size="1024x1024", num_inference_steps=1)
    error = assert_envelope(r, 429, code="response_memory_full")
    assert error["type"] == "rate_limit_error" and r.headers["retry-after"] == "2"
    assert f"max_response_bytes_in_flight={per_image + MIB}" in error["message"]
    info = server.engine().executor.model_info
    assert info is not None
    default = info.default_width * info.default_height
    assert server.pool.default_size() == (info.default_width, info.default_height)
    await start_long(
        client, nursery, answers, "auto", size="auto", n=2, headers={"X-Request-Id": "a"}
    )
    await wait_until(lambda: server.pool.status("a") == "queued")
    expected = 2 * (default * RESPONSE_BYTES_PER_PIXEL + RESPONSE_BYTES_PER_IMAGE)
    assert responses.in_flight == per_image + expected
    for rid in ("a", "b"):
        assert (await client.delete(f"/v1/requests/{rid}")).status_code == 200


async def test_lifespan_is_acknowledged() -> None:
    app = bare_app()
    incoming = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return incoming.pop(0)

    async def send(message: Any) -> None:
        sent.append(message)

    with trio.fail_after(CAP_S):
        await app({"type": "lifespan"}, receive, send)
    assert [m["type"] for m in sent] == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


# -- retry-safe answers and Idempotency-Key ----------------------------------------------------


async def test_the_sdk_with_default_retries_never_recomputes_a_cancelled_or_timed_out_request() -> (
    None
):
    """The official client retries 409 and 5xx twice by default: a cancelled request (409)
    and one past its timeout (504) say ``x-should-retry: false``, so each ran once."""
    with trio.fail_after(CAP_S * 2):
        async with run_server() as server:

            def sdk_call(rid: str, **extra: Any) -> openai.APIStatusError:
                with openai.OpenAI(
                    base_url=f"{server.url}/v1", api_key="unused", timeout=30
                ) as sdk:
                    assert sdk.max_retries == 2  # the default
                    with pytest.raises(openai.APIStatusError) as info:
                        sdk.images.generate(
                            model=MODEL,
                            prompt="a long one",
                            size="64x64",
                            extra_headers={"X-Request-Id": rid},
                            extra_body={"num_inference_steps": LONG, **extra},
                        )
                    return info.value

            answers: dict[str, openai.APIStatusError] = {}

            async def call(rid: str, **extra: Any) -> None:
                answers[rid] = await trio.to_thread.run_sync(lambda: sdk_call(rid, **extra))

            engine = server.engine()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, "cancelled")
                await wait_until(lambda: server.pool.in_flight == 1)
                async with server.client() as client:
                    # The SDK's bearer token owns its request: the same token cancels it.
                    token = {"Authorization": "Bearer unused"}
                    r = await client.delete("/v1/requests/cancelled", headers=token)
                    assert r.status_code == 200, r.text
            await call("late", timeout=0.2)
            assert answers["cancelled"].status_code == 409
            assert answers["cancelled"].body["code"] == "request_cancelled"
            assert answers["late"].status_code == 504
            for error in answers.values():
                assert error.response.headers["x-should-retry"] == "false"
            assert engine.statistics().admitted == 2  # once each, no resubmission


async def test_an_idempotency_key_attaches_a_resubmission_to_the_first_request() -> None:
    """The same key and body: one computation, the same answer (replayed, also to a
    resubmission sent while the first still runs); a cancelled request's key replays its
    409; the key with another body is a 422; another client's key of the same name is its
    own; a bad key is a 400."""
    one, two = {"Authorization": "Bearer k-one"}, {"Authorization": "Bearer k-two"}
    with trio.fail_after(CAP_S * 2):
        async with run_server(api_keys=("k-one", "k-two")) as server, server.client() as client:
            engine = server.engine()
            key = {**one, "Idempotency-Key": "job-1"}
            answers: list[httpx.Response] = []

            async def post() -> None:
                answers.append(await generate(client, num_inference_steps=20, seed=3, headers=key))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(post)
                await wait_until(lambda: server.pool.in_flight == 1)
                nursery.start_soon(post)  # attaches while the first runs
            r = await generate(client, num_inference_steps=20, seed=3, headers=key)
            answers.append(r)
            assert [a.status_code for a in answers] == [200, 200, 200]
            assert answers[0].content == answers[1].content == answers[2].content
            assert sorted(a.headers.get("idempotent-replayed", "") for a in answers) == [
                "",
                "true",
                "true",
            ]
            assert engine.statistics().admitted == 1
            r = await generate(client, num_inference_steps=20, seed=4, headers=key)
            assert_envelope(r, 422, param="Idempotency-Key", code="idempotency_key_reused")
            # The same key name from another owner is another key.
            r = await generate(client, seed=3, headers={**two, "Idempotency-Key": "job-1"})
            assert r.status_code == 200 and "idempotent-replayed" not in r.headers
            # A cancelled request's key replays the cancellation: it is not run again.
            cancel_key = {**one, "Idempotency-Key": "job-2", "X-Request-Id": "c"}
            async with trio.open_nursery() as nursery:
                first: list[httpx.Response] = []

                async def post_long() -> None:
                    first.append(
                        await generate(client, num_inference_steps=LONG, headers=cancel_key)
                    )

                nursery.start_soon(post_long)
                await wait_until(lambda: server.pool.in_flight == 1)
                assert (await client.delete("/v1/requests/c", headers=one)).status_code == 200
            assert_envelope(first[0], 409, code="request_cancelled")
            admitted = engine.statistics().admitted
            again = await generate(client, num_inference_steps=LONG, headers=cancel_key)
            assert_envelope(again, 409, code="request_cancelled")
            assert again.headers["idempotent-replayed"] == "true"
            assert again.headers["x-should-retry"] == "false"
            assert engine.statistics().admitted == admitted
            r = await generate(client, headers={**one, "Idempotency-Key": "bad\tkey"})
            assert_envelope(r, 400, param="Idempotency-Key", code="invalid_idempotency_key")
        assert server.pool.in_flight == 0


async def test_images_carry_their_recipe_unless_the_server_says_no_metadata() -> None:
    import argparse

    from omni_trio.serve.config import ServeConfig, add_serve_arguments
    from omni_trio.serve.daemon import _Daemon
    from omni_trio.serve.notify import SystemdNotifier

    prompt = "a red fox, 狐 🦊 " + "x" * 3000  # unicode and long (the limit is 4000)
    with trio.fail_after(CAP_S):
        async with run_server() as server, server.client() as client:
            # No seed given: the one the engine picked is in every image, with its index.
            r = await generate(client, prompt=prompt, n=2, guidance_scale=3, negative_prompt="b")
            assert r.status_code == 200, r.text
            body = r.json()
            for index, item in enumerate(body["data"]):
                image, header = decode_b64(item["b64_json"])
                assert header == (body["id"], body["seed"], index)
                text = image.text  # type: ignore[attr-defined]
                assert (text["prompt"], text["negative_prompt"]) == (prompt, "b")
                assert (text["seed"], text["n"], text["image_index"]) == (
                    str(body["seed"]),
                    "2",
                    str(index),
                )
                assert (text["steps"], text["guidance_scale"], text["size"]) == ("2", "3", "64x64")
                assert text["model"] == MODEL and "scheduler" not in text
                assert f"Seed: {body['seed']}, Size: 64x64" in text["parameters"]
            # The stream's completed events carry it too.
            _, events = await read_events(
                client, {"prompt": "y", "size": "64x64", "num_inference_steps": 1, "stream": True}
            )
            done = events[-1][1]
            image, _ = decode_b64(done["b64_json"])
            assert image.text["seed"] == str(done["seed"])  # type: ignore[attr-defined]
        async with (
            run_server(app_options={"image_metadata": False}) as server,
            server.client() as client,
        ):
            r = await generate(client, seed=4)
            image, header = decode_b64(r.json()["data"][0]["b64_json"])
            assert header[1:] == (4, 0) and image.text == {}  # type: ignore[attr-defined]
    # --no-metadata (or image_metadata = false in the TOML) reaches the app the daemon builds.
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    for flags, expected in (([], True), (["--no-metadata"], False), (["--metadata"], True)):
        config = ServeConfig.from_args(parser.parse_args(["--model", MODEL, *flags]), environ={})
        assert config.image_metadata is expected
        daemon = _Daemon(config, SystemdNotifier(None), None, io.StringIO())
        pool = EnginePool(config.engine)
        assert daemon._build_app(pool).image_metadata is expected


async def test_a_refusal_on_the_first_read_is_answered_as_at_admission(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage process's engine may refuse a request the pool admitted (its state changed
    since the snapshot admission used): the stream raises on its first read.  FAKE here: the
    replica's ``stream`` returns streams that fail so; the answers are the admission's (503
    ``engine_asleep``, 409 ``duplicate_request_id``, 400), never a 500."""
    import math

    from omni_trio.errors import DuplicateRequestError, EngineAsleepError, InvalidRequestError
    from omni_trio.runtime.request_stream import RequestStream

    engine = server.engine()
    errors: list[Exception] = []

    def refusing_stream(prompt: Any, params: Any = None, *, request_id: str | None = None) -> Any:
        send, receive = trio.open_memory_channel[Any](math.inf)
        stream = RequestStream(request_id or "r", params.seed, receive, lambda rid: None)
        stream.fail_with(errors.pop(0))
        send.close()
        return stream

    monkeypatch.setattr(engine, "stream", refusing_stream)
    cases = [
        (EngineAsleepError("asleep now"), 503, "engine_asleep"),
        (DuplicateRequestError("dup"), 409, "duplicate_request_id"),
        (InvalidRequestError("too costly now", param="size"), 400, "invalid_value"),
    ]
    with trio.fail_after(CAP_S):
        async with server.client() as client:
            for error, status, code in cases:
                errors.append(error)
                body = {"prompt": "p", "size": "64x64", "num_inference_steps": 2}
                response = await client.post("/v1/images/generations", json=body)
                assert_envelope(response, status, code=code)
    assert server.pool.in_flight == 0  # each released its slot
