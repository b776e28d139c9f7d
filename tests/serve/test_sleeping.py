"""The daemon's sleep endpoints on the real app under hypercorn, with httpx as the client."""

from __future__ import annotations

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import CAP_S, assert_envelope, run_server, wait_until
from tests.serve.test_api_spec import check_answer
from tests.serve.test_app import decode_b64

pytestmark = pytest.mark.slow  # (the same servers as test_app.py)

GEN = "/v1/images/generations"
SLEEP = "/v1/admin/sleep"
WAKE = "/v1/admin/wake_up"


def sleep_samples(text: str) -> dict[tuple[str, str], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("omni_trio_sleep"):
                out[(sample.name, sample.labels.get("state", ""))] = sample.value
    return out


async def test_sleep_queues_generations_until_the_wake_and_reports_it_everywhere() -> None:
    with trio.fail_after(CAP_S):
        async with run_server() as server, server.client() as client:
            document = (await client.get("/openapi.json")).json()
            r = await client.post(SLEEP, json={"level": 2})
            assert r.status_code == 200, r.text
            check_answer(document, "POST", SLEEP, r)
            check_answer(document, "GET", SLEEP, await client.get(SLEEP))
            body = r.json()
            assert (body["sleeping"], body["level"]) == (True, 2)
            (replica,) = body["replicas"]
            assert replica["index"] == 0 and replica["ranks"][0]["level"] == 2
            state = (await client.get(SLEEP)).json()
            assert state == {
                "sleeping": True,
                "level": 2,
                "replicas": [{"index": 0, "state": "asleep", "level": 2}],
            }
            r = await client.get("/ready")
            error = assert_envelope(r, 503, code="not_ready")
            assert "sleeping" in error["message"]
            metrics = sleep_samples((await client.get("/metrics")).text)
            assert metrics[("omni_trio_sleep_state", "asleep")] == 1
            assert metrics[("omni_trio_sleep_level", "")] == 2

            answer: dict[str, object] = {}

            async def generate() -> None:
                response = await client.post(
                    GEN,
                    json={"prompt": "p", "size": "32x32", "seed": 9},
                    headers={"X-Request-Id": "while-asleep"},
                )
                answer["response"] = response

            async with trio.open_nursery() as nursery:
                nursery.start_soon(generate)
                # The generation waits in the sleeping replica's queue.
                await wait_until(lambda: server.engine().status("while-asleep") is not None)
                status = (await client.get("/v1/requests/while-asleep")).json()
                assert status["status"] == "queued"
                r = await client.post(WAKE)
                assert r.status_code == 200, r.text
                check_answer(document, "POST", WAKE, r)
                assert r.json()["sleeping"] is False
            response = answer["response"]
            assert response.status_code == 200, response.text  # type: ignore[attr-defined]
            data = response.json()["data"]  # type: ignore[attr-defined]
            assert decode_b64(data[0]["b64_json"])[1][:2] == ("while-asleep", 9)
            assert (await client.get("/ready")).status_code == 200
            assert (await client.get(SLEEP)).json()["sleeping"] is False
            metrics = sleep_samples((await client.get("/metrics")).text)
            assert metrics[("omni_trio_sleep_state", "awake")] == 1
            assert metrics[("omni_trio_sleeps_total", "")] == 1


async def test_bad_sleep_requests_are_envelopes_and_change_nothing() -> None:
    with trio.fail_after(CAP_S):
        async with run_server() as server, server.client() as client:
            for body, code in (
                ({"level": 3}, "invalid_value"),
                ({"level": True}, "invalid_value"),
                ({"level": 1, "now": True}, "unknown_parameter"),
                ([1], "invalid_type"),
            ):
                assert_envelope(await client.post(SLEEP, json=body), 400, code=code)
            r = await client.post(SLEEP, content=b"level=1", headers={"content-type": "text/plain"})
            assert_envelope(r, 415, code="unsupported_media_type")
            assert_envelope(await client.get(WAKE), 405, code="method_not_allowed")
            assert (await client.get(SLEEP)).json()["sleeping"] is False
            # Waking an awake server is fine and changes nothing.
            assert (await client.post(WAKE)).json()["sleeping"] is False
            assert server.engine().health().healthy


async def test_sleep_needs_the_api_key() -> None:
    with trio.fail_after(CAP_S):
        async with run_server(api_key="k") as server, server.client() as client:
            assert_envelope(await client.post(SLEEP), 401, code="invalid_api_key")
            assert_envelope(await client.post(WAKE), 401, code="invalid_api_key")
            headers = {"Authorization": "Bearer k"}
            assert (await client.post(SLEEP, headers=headers)).status_code == 200
            assert (await client.post(WAKE, headers=headers)).status_code == 200


async def test_reject_while_asleep_answers_503_engine_asleep() -> None:
    with trio.fail_after(CAP_S):
        async with run_server(reject_while_asleep=True) as server, server.client() as client:
            assert (await client.post(SLEEP)).status_code == 200
            r = await client.post(GEN, json={"prompt": "p", "size": "32x32"})
            assert_envelope(r, 503, code="engine_asleep")
            assert int(r.headers["retry-after"]) >= 1
            await client.post(WAKE)
            r = await client.post(GEN, json={"prompt": "p", "size": "32x32"})
            assert r.status_code == 200


async def test_a_sleep_that_cannot_drain_in_time_is_a_503_and_the_server_stays_awake() -> None:
    with trio.fail_after(CAP_S):
        async with (
            run_server(sleep_drain_timeout_s=0.05) as server,
            server.client() as client,
            trio.open_nursery() as nursery,
        ):

            async def long_one() -> None:
                await client.post(
                    GEN,
                    json={"prompt": "p", "size": "32x32", "num_inference_steps": 200},
                    headers={"X-Request-Id": "long"},
                )

            nursery.start_soon(long_one)
            await wait_until(lambda: server.engine().progress("long") is not None)
            r = await client.post(SLEEP)
            error = assert_envelope(r, 503, code="sleep_timeout")
            check_answer((await client.get("/openapi.json")).json(), "POST", SLEEP, r)
            assert "long" in error["message"]
            assert "retry-after" in r.headers
            assert (await client.get(SLEEP)).json()["sleeping"] is False
            assert (await client.delete("/v1/requests/long")).status_code == 200
