"""``POST /v1/admin/start_profile`` and ``/v1/admin/stop_profile`` (omni_trio/serve/profiling.py)
on a real server (tests/serve/conftest.py): two ``builtin:echo`` replicas behind an API key;
every replica profiles, each writes its trace, and every refusal is the OpenAI envelope."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from omni_trio.serve import profiling
from omni_trio.serve.api_spec import PROFILE_FIELDS, openapi_document
from omni_trio.serve.images import ServeLimits
from omni_trio.serve.profiling import DEFAULT_PROFILE_DIR, START_PROFILE_PATH, STOP_PROFILE_PATH
from tests.serve.conftest import CAP_S, assert_envelope, run_server

KEY = {"Authorization": "Bearer k"}
JSON = {"Content-Type": "application/json"}


def event_names(path: str) -> set[str]:
    with open(path, encoding="utf-8") as trace:
        return {event.get("name", "") for event in json.load(trace)["traceEvents"]}


async def test_start_and_stop_behind_the_key_one_session_per_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two in-process replicas: the first profiles, the second shares its process and is
    skipped (torch.profiler runs one session per process)."""
    monkeypatch.chdir(tmp_path)  # the default directory is the server's working directory's
    with trio.fail_after(CAP_S):
        async with run_server(api_key="k", replicas=2) as server:
            async with server.client() as anonymous:
                for path in (START_PROFILE_PATH, STOP_PROFILE_PATH):
                    refused = await anonymous.post(path, json={})
                    assert_envelope(refused, 401, code="invalid_api_key")
            async with server.client(headers=KEY) as client:
                started = await client.post(START_PROFILE_PATH, json={})
                assert started.status_code == 200, started.text
                assert server.engine(0).profiling and not server.engine(1).profiling
                again = await client.post(START_PROFILE_PATH, json={})
                assert_envelope(again, 409, code="already_profiling")
                stopped = await client.post(STOP_PROFILE_PATH)
                assert stopped.status_code == 200, stopped.text
                assert not server.engine(0).profiling
                late = await client.post(STOP_PROFILE_PATH)
                assert_envelope(late, 409, code="not_profiling")
    directory = tmp_path / DEFAULT_PROFILE_DIR
    assert started.json() == {"directory": str(directory), "replicas": [0], "skipped": [1]}
    assert set(stopped.json()) == {"traces"}
    (trace,) = stopped.json()["traces"]
    assert Path(trace).parent == directory and trace.endswith("-replica0-rank0.json")
    assert event_names(trace)  # a Chrome trace: JSON with traceEvents


async def test_a_named_directory_a_traced_generation_and_bad_bodies(tmp_path: Path) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    bad: list[tuple[dict[str, Any], int, str | None, str]] = [
        ({"content": b"{}"}, 415, "Content-Type", "unsupported_media_type"),
        ({"content": b"{", "headers": JSON}, 400, None, "invalid_json"),
        ({"json": [1]}, 400, None, "invalid_type"),
        ({"json": {"dir": "x"}}, 400, "dir", "unknown_parameter"),
        ({"json": {"directory": 3}}, 400, "directory", "invalid_type"),
        ({"json": {"directory": ""}}, 400, "directory", "invalid_value"),
        ({"json": {"directory": str(a_file)}}, 400, "directory", "invalid_profile_directory"),
        ({"json": {"directory": str(a_file / "x")}}, 400, "directory", "invalid_profile_directory"),
    ]
    named = tmp_path / "named" / "deeper"
    with trio.fail_after(CAP_S):
        async with run_server() as server, server.client() as client:
            for request, status, param, code in bad:
                answer = await client.post(START_PROFILE_PATH, **request)
                assert_envelope(answer, status, param=param, code=code)
            wrong = await client.get(START_PROFILE_PATH)
            assert_envelope(wrong, 405, code="method_not_allowed")
            assert not server.engine().profiling
            started = await client.post(START_PROFILE_PATH, json={"directory": str(named)})
            generated = await client.post(
                "/v1/images/generations",
                json={"prompt": "x", "size": "64x64", "num_inference_steps": 2},
            )
            assert generated.status_code == 200, generated.text
            stopped = await client.post(STOP_PROFILE_PATH, json={})
    assert started.json() == {"directory": str(named), "replicas": [0], "skipped": []}
    (trace,) = stopped.json()["traces"]
    assert Path(trace).parent == named and Path(trace).name.endswith("-rank0.json")
    assert "-replica" not in Path(trace).name  # one replica: no replica part
    assert "omni_trio.forward" in event_names(trace)


async def test_a_replica_that_cannot_start_leaves_none_profiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Taken for replicas of their own, two in-process replicas both try: the second's
    worker refuses (its process already has a session), so the first is stopped again and
    its trace removed; the answer is a 500 naming the cause."""
    traces = tmp_path / "traces"
    monkeypatch.chdir(tmp_path)
    with trio.fail_after(CAP_S):
        async with run_server(replicas=2) as server, server.client() as client:
            with monkeypatch.context() as patched:
                patched.setattr(profiling, "runs_here", lambda engine: False)
                answer = await client.post(START_PROFILE_PATH, json={"directory": str(traces)})
            error = assert_envelope(answer, 500, code="profile_failed")
            assert answer.headers["x-should-retry"] == "false"
            assert "one session per process" in error["message"]
            assert not any(server.engine(i).profiling for i in (0, 1))
            assert list(traces.iterdir()) == []  # the undone start's trace was removed
            # An empty body (with the JSON type) is {}: the default directory.
            retried = await client.post(START_PROFILE_PATH, content=b"", headers=JSON)
            assert retried.json()["replicas"] == [0], retried.text
            stopped = await client.post(STOP_PROFILE_PATH)
    (trace,) = stopped.json()["traces"]
    assert Path(trace).parent == tmp_path / DEFAULT_PROFILE_DIR


def test_the_api_description_names_the_endpoints_and_the_default() -> None:
    (field,) = PROFILE_FIELDS
    assert field.name == "directory" and field.default == DEFAULT_PROFILE_DIR
    document = openapi_document(ServeLimits(), "m")
    start = document["paths"][START_PROFILE_PATH]["post"]
    assert start["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ProfileRequest"
    }
    assert "directory" in document["components"]["schemas"]["ProfileRequest"]["properties"]
    assert "post" in document["paths"][STOP_PROFILE_PATH]
