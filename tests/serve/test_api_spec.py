"""The API description (omni_trio/serve/api_spec.py) against what it describes: docs/api.md is
what it generates; the parsers take their fields and bounds from it; every error code and
event the server's source can produce is in it, and nothing else; and the running app
serves /openapi.json from it and answers every endpoint it lists."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import pytest
import trio

from omni_trio.errors import RequestTooCostlyError
from omni_trio.serve.api_spec import (
    ENDPOINTS,
    ERROR_CODES,
    EVENTS,
    GENERATION_FIELDS,
    api_markdown,
    bounds,
    openapi_document,
)
from omni_trio.serve.images import ApiError, ServeLimits, parse_generation_request
from tests.serve.conftest import CAP_S, MODEL, run_server

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

ROOT = Path(__file__).parents[2]
SERVE = ROOT / "omni_trio" / "serve"


def test_docs_api_md_is_what_the_definitions_generate() -> None:
    page = (ROOT / "docs" / "api.md").read_text()
    assert page == api_markdown(ServeLimits()), (
        "docs/api.md is stale: run `python -m omni_trio.serve.api_spec > docs/api.md`"
    )


def _codes_in_source() -> set[str]:
    """Every error code literal the serve package can answer with."""
    codes: set[str] = {RequestTooCostlyError.code}
    positional = {"_bad": 2, "_unavailable": 1}
    for path in SERVE.glob("*.py"):
        if path.name == "api_spec.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", ""))
            for keyword in node.keywords:
                if keyword.arg == "code" and isinstance(keyword.value, ast.Constant):
                    codes.add(keyword.value.value)
            index = positional.get(name)
            if index is not None and len(node.args) > index:
                arg = node.args[index]
                if isinstance(arg, ast.Constant):
                    codes.add(arg.value)
    return codes


def test_every_error_code_is_described_and_none_is_stale() -> None:
    found = _codes_in_source()
    assert found - set(ERROR_CODES) == set(), "codes the server answers, not in api_spec"
    assert set(ERROR_CODES) - found == set(), "codes in api_spec the server never answers"


def test_every_event_name_is_described() -> None:
    source = (SERVE / "app.py").read_text() + (SERVE / "jobs.py").read_text()
    used = set(re.findall(r'"(job\.[a-z]+)"', source))
    used |= {
        f"{prefix}.{kind}"
        for prefix in ("image_generation", "image_edit")
        for kind in ("partial_image", "completed", "progress")
    }
    used.add("error")
    assert used <= set(EVENTS), sorted(used - set(EVENTS))
    listed = {name for endpoint in ENDPOINTS for name in endpoint.events}
    assert listed <= set(EVENTS)


def test_the_parser_takes_its_bounds_from_the_definitions() -> None:
    """Each bounded integer field: its maximum passes, one more is a 400 naming it; a
    changed limit moves the bound (the parser reads it through the same definitions)."""
    limits = ServeLimits(max_n=3, max_steps=7)
    for spec in GENERATION_FIELDS:
        if spec.type != "integer":
            continue
        low, high = bounds(spec.name, limits)
        body: dict[str, Any] = {"prompt": "x"}
        if spec.name == "partial_images":
            body["stream"] = True
        parse_generation_request({**body, spec.name: high}, limits=limits, default_model="m")
        parse_generation_request({**body, spec.name: low}, limits=limits, default_model="m")
        for bad in (high + 1, low - 1):
            with pytest.raises(ApiError) as info:
                parse_generation_request({**body, spec.name: bad}, limits=limits, default_model="m")
            assert info.value.param == spec.name
    assert bounds("n", limits) == (1, 3) and bounds("num_inference_steps", limits) == (1, 7)
    known = {spec.name for spec in GENERATION_FIELDS}
    with pytest.raises(ApiError) as unknown:
        parse_generation_request({"prompt": "x", "nope": 1}, limits=limits, default_model="m")
    assert unknown.value.code == "unknown_parameter" and "nope" not in known


async def test_the_running_app_serves_the_document_and_every_listed_endpoint() -> None:
    limits = ServeLimits(max_n=2)
    with trio.fail_after(CAP_S):
        async with run_server(api_key="k", limits=limits) as server:
            async with server.client() as anonymous:
                served = await anonymous.get("/openapi.json")
            answers = {}
            async with server.client(headers={"Authorization": "Bearer k"}) as client:
                for endpoint in ENDPOINTS:
                    path = endpoint.path.replace("{id}", "nosuch")
                    r = await client.request(endpoint.method, path)
                    answers[(endpoint.method, endpoint.path)] = r
                unlisted = await client.get("/v1/nothing-here")
    assert served.status_code == 200
    document = served.json()
    assert document == json.loads(json.dumps(openapi_document(limits, MODEL)))
    assert document["openapi"] == "3.1.0"
    assert document["components"]["schemas"]["GenerationRequest"]["properties"]["n"]["maximum"] == 2
    for (method, path), r in answers.items():
        code = (
            r.json().get("error", {}).get("code")
            if r.headers.get("content-type", "").startswith("application/json")
            else None
        )
        assert code not in ("unknown_url", "method_not_allowed"), (method, path, r.text)
    assert unlisted.json()["error"]["code"] == "unknown_url"
    # Every route the app dispatches is listed (its route templates in the source).
    source = (SERVE / "app.py").read_text()
    routes = set(re.findall(r'ex\.route = "([^"]+)"', source)) - {"job"}
    routes |= {"/v1/images/generations", "/v1/images/edits", "/v1/images/variations"}
    listed = {endpoint.path for endpoint in ENDPOINTS}
    assert routes - {"path"} <= listed, sorted(routes - listed)
