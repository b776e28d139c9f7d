"""Job webhooks: URL checks and signatures (pure), and real deliveries from a real server to
a real receiver (an ASGI app under our HTTP server on loopback): signed bodies, at most one
progress call per interval, the end retried with backoff, a receiver that is down."""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json

import pytest
import trio

from omni_trio.serve.webhooks import SIGNATURE_HEADER, check_webhook_url, sign
from tests.serve.conftest import (
    CAP_S,
    Receiver,
    assert_envelope,
    receiving,
    run_server,
    wait_until,
)

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

SECRET = "s3cret"


def test_urls_are_checked() -> None:
    assert check_webhook_url("http://127.0.0.1:8080/hook") is None
    assert check_webhook_url("https://example.com/h?x=1") is None
    for bad in ("ftp://x/y", "http:///nohost", "http://u:p@x/", 5, "http://x:0/", "x" * 3000):
        assert check_webhook_url(bad) is not None, bad
    assert check_webhook_url("http://evil.example/", ("127.0.0.1",)) is not None
    assert check_webhook_url("http://LOCALHOST:9/", ("localhost",)) is None


def test_the_signature_is_hmac_sha256_of_the_body() -> None:
    body = b'{"a":1}'
    expected = hmac.new(b"k", body, hashlib.sha256).hexdigest()
    assert sign(b"k", body) == f"sha256={expected}"


async def test_a_job_calls_its_webhook_signed_rate_limited_and_retried() -> None:
    """Progress at most once per interval (0.3 s here), then the end, signed; the end's first
    two calls answered 503 are retried, so it arrives on the third."""
    with trio.fail_after(CAP_S):
        async with (
            receiving(Receiver(fail={"job.completed": 2})) as hook,
            run_server(
                app_options={"webhook_secret": SECRET, "webhook_progress_interval_s": 0.3}
            ) as server,
            server.client() as client,
        ):
            body = {"prompt": "x", "num_inference_steps": 60, "webhook_url": hook.url}
            r = await client.post("/v1/jobs", json=body, headers={"X-Request-Id": "hooked"})
            assert r.status_code == 202 and r.json()["webhook_url"] == hook.url
            delivered = 'omni_trio_webhook_calls_total{event="job.completed",outcome="delivered"}'
            await wait_until(lambda: f"{delivered} 1.0" in server.metrics.render().decode())
            metrics = server.metrics.render().decode()
    events = hook.events()
    assert events[-3:] == ["job.completed"] * 3 and "job.progress" in events
    progress_times = [t for h, _, t in hook.calls if h["x-omni-trio-event"] == "job.progress"]
    gaps = [b - a for a, b in itertools.pairwise(progress_times)]
    assert all(gap >= 0.3 - 0.01 for gap in gaps), gaps
    deliveries = set()
    for headers, raw, _ in hook.calls:
        assert headers[SIGNATURE_HEADER.lower()] == sign(SECRET.encode(), raw)
        payload = json.loads(raw)
        assert payload["type"] == headers["x-omni-trio-event"]
        assert payload["delivery_id"] == headers["x-omni-trio-delivery"]
        deliveries.add(payload["delivery_id"])
    assert len(deliveries) == len(hook.calls)  # every call its own id
    final = json.loads(hook.calls[-1][1])["data"]
    assert final["id"] == "hooked" and final["status"] == "completed"
    assert final["result"]["data"][0]["b64_json"]
    steps = [
        json.loads(raw)["data"]["step"]
        for h, raw, _ in hook.calls
        if "progress" in h["x-omni-trio-event"]
    ]
    assert steps == sorted(steps)
    assert 'omni_trio_webhook_calls_total{event="job.completed",outcome="retry"} 2.0' in metrics


async def test_a_cancelled_job_calls_back_once_and_a_dead_receiver_is_given_up() -> None:
    with trio.fail_after(CAP_S):
        async with (
            receiving(Receiver()) as hook,
            run_server(app_options={"webhook_secret": SECRET}) as server,
            server.client() as client,
        ):
            body = {"prompt": "x", "num_inference_steps": 200, "webhook_url": hook.url}
            await client.post("/v1/jobs", json=body, headers={"X-Request-Id": "c"})
            await wait_until(lambda: (server.pool.progress("c") or (0, 0))[0] >= 2)
            assert (await client.delete("/v1/jobs/c")).json()["cancelled"] is True
            await wait_until(lambda: "job.cancelled" in hook.events())
            # A port nobody listens on: the end is tried ATTEMPTS times, then given up.
            server.app.webhooks.backoff_s = 0.01  # type: ignore[union-attr]
            dead = {"prompt": "x", "num_inference_steps": 2, "webhook_url": "http://127.0.0.1:9/"}
            await client.post("/v1/jobs", json=dead, headers={"X-Request-Id": "d"})
            failed = 'omni_trio_webhook_calls_total{event="job.completed",outcome="failed"} 1.0'
            await wait_until(lambda: failed in server.metrics.render().decode())
            assert (await client.get("/v1/jobs/d")).json()["status"] == "completed"
    assert hook.events().count("job.cancelled") == 1
    assert hook.events()[-1] == "job.cancelled"


async def test_webhook_urls_are_refused_outside_the_allowed_hosts() -> None:
    with trio.fail_after(CAP_S):
        async with (
            run_server(
                app_options={"webhook_secret": SECRET, "webhook_hosts": ("127.0.0.1",)}
            ) as server,
            server.client() as client,
        ):
            body = {"prompt": "x", "webhook_url": "http://example.com/hook"}
            r = await client.post("/v1/jobs", json=body)
            bad = await client.post("/v1/jobs", json={**body, "webhook_url": "gopher://x"})
    assert_envelope(r, 400, param="webhook_url", code="invalid_webhook_url")
    assert_envelope(bad, 400, param="webhook_url", code="invalid_webhook_url")
    assert server.pool.in_flight == 0
