"""The API description (omni_trio/serve/api_spec.py) against what it describes: docs/api.md is
what it generates; the parsers take their fields and bounds from it; every error code and
event the server's source can produce is in it, and nothing else; and the running app
serves /openapi.json from it and answers every endpoint it lists."""

from __future__ import annotations

import ast
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import trio

from omni_trio.errors import QUARANTINED_ERROR_TYPE, RETRYABLE_ERROR_TYPES, RequestTooCostlyError
from omni_trio.serve.api_spec import (
    ENDPOINTS,
    ENGINE_ERROR_CODES,
    ERROR_CODES,
    EVENTS,
    GENERATION_FIELDS,
    api_markdown,
    bounds,
    openapi_document,
    response_schemas,
)
from omni_trio.serve.http import _PROTOCOL_ERRORS
from omni_trio.serve.images import ApiError, ServeLimits, error_body, parse_generation_request
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
    """Every error code literal the serve package can answer with (the HTTP server's own
    protocol errors are a table)."""
    codes: set[str] = {RequestTooCostlyError.code}
    codes |= {code for _, code in _PROTOCOL_ERRORS.values()}
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


# -- a JSON Schema validator for the subset the document uses ---------------------------------

_TYPES: dict[str, Any] = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}


def _is(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, _TYPES[kind])


def _resolve(document: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        target: Any = document
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = target
    return node


def schema_errors(
    value: Any, schema: dict[str, Any], document: dict[str, Any], at: str = "$"
) -> list[str]:
    """Where ``value`` breaks ``schema`` ($ref, anyOf, type, enum, required, properties,
    additionalProperties: false, items, pattern, minimum, maximum, minLength, maxLength)."""
    schema = _resolve(document, schema)
    known = {
        "$ref",
        "anyOf",
        "type",
        "enum",
        "required",
        "properties",
        "additionalProperties",
        "items",
        "pattern",
        "minimum",
        "maximum",
        "minLength",
        "maxLength",
        "description",
        "format",
    }
    assert set(schema) <= known, f"the validator does not know {set(schema) - known} ({at})"
    errors: list[str] = []
    parts = schema.get("anyOf", ())
    if parts and all(schema_errors(value, part, document, at) for part in parts):
        errors.append(f"{at}: {value!r} matches none of anyOf")
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_is(value, kind) for kind in kinds):
            return [*errors, f"{at}: {value!r} is not {kinds}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{at}: {value!r} not in {schema['enum']}")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        errors += [
            f"{at}: {name!r} missing" for name in schema.get("required", ()) if name not in value
        ]
        if schema.get("additionalProperties") is False:
            errors += [f"{at}: {name!r} not allowed" for name in value if name not in properties]
        for name, sub in properties.items():
            if name in value:
                errors += schema_errors(value[name], sub, document, f"{at}.{name}")
    if isinstance(value, list) and "items" in schema:
        for index, item in enumerate(value):
            errors += schema_errors(item, schema["items"], document, f"{at}[{index}]")
    if isinstance(value, str):
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{at}: {value!r} does not match {schema['pattern']}")
        if len(value) < schema.get("minLength", 0) or len(value) > schema.get("maxLength", 1e9):
            errors.append(f"{at}: {value!r} has the wrong length")
    low, high = schema.get("minimum", -math.inf), schema.get("maximum", math.inf)
    if _is(value, "number") and not low <= value <= high:
        errors.append(f"{at}: {value!r} out of range")
    return errors


def test_the_validator_rejects_what_the_schemas_do_not_allow() -> None:
    document = {"components": {"schemas": response_schemas()}}
    error = {"$ref": "#/components/schemas/Error"}
    ok = error_body("m", type="server_error", code="RuntimeError")
    assert schema_errors(ok, error, document) == []
    assert schema_errors(error_body("m", code="invalid_value"), error, document) == []
    assert schema_errors(error_body("m", code=None), error, document) == []
    assert schema_errors(error_body("m", code="no_such_code"), error, document)
    assert schema_errors({"error": {**ok["error"], "extra": 1}}, error, document)
    assert schema_errors({"error": {"message": "m"}}, error, document)
    job = {"$ref": "#/components/schemas/Job"}
    assert schema_errors({"id": "j", "object": "job", "status": "done"}, job, document)
    image = {"$ref": "#/components/schemas/Image"}
    assert schema_errors({"revised_prompt": None}, image, document)  # neither b64 nor url
    assert schema_errors({"url": "http://x/", "revised_prompt": None}, image, document) == []


def test_engine_error_codes_are_told_apart_from_the_server_codes() -> None:
    """The code of a failure on the workers is the engine's error type (an open set: any
    exception type name); the schema takes those by their shape, and no server code has it."""
    pattern = response_schemas()["ErrorDetail"]["properties"]["code"]["anyOf"][1]["pattern"]
    assert all(re.search(pattern, code) for code in ENGINE_ERROR_CODES)
    assert not any(re.search(pattern, code) for code in ERROR_CODES)
    for name in RETRYABLE_ERROR_TYPES:  # answered 503 after the server's own retries
        assert ENGINE_ERROR_CODES[name][0] == 503
    # The error types the app maps to codes of its own are not engine codes.
    assert QUARANTINED_ERROR_TYPE not in ENGINE_ERROR_CODES
    assert "request_quarantined" in ERROR_CODES


def test_the_component_schemas_are_valid_json_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    document = openapi_document(ServeLimits(), MODEL)
    for name, schema in document["components"]["schemas"].items():
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise AssertionError(f"components/schemas/{name}: {exc.message}") from exc


def test_every_reference_in_the_document_resolves() -> None:
    document = openapi_document(ServeLimits(), MODEL)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "$ref" in node:
                _resolve(document, node)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(document)
    for operations in document["paths"].values():
        for operation in operations.values():
            assert {"4XX", "5XX"} <= set(operation["responses"])
            names = {p.get("$ref", "").rsplit("/", 1)[-1] for p in operation["parameters"]}
            assert "X-Request-Id" in names


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


def check_answer(document: dict[str, Any], method: str, template: str, r: Any) -> None:
    """``r`` is what the document says ``method template`` answers with that status: its
    headers (``X-Request-Id`` always) and, for JSON, its body against the schema."""
    responses = document["paths"][template][method.lower()]["responses"]
    found = responses.get(str(r.status_code)) or responses.get(f"{r.status_code // 100}XX")
    assert found is not None, (method, template, r.status_code)
    response = _resolve(document, found)
    assert "X-Request-Id" in response["headers"]
    for name, header in response["headers"].items():
        value = r.headers.get(name)
        if value is None:
            assert name != "X-Request-Id", f"{method} {template}: no X-Request-Id"
            continue
        schema = _resolve(document, header)["schema"]
        typed = int(value) if schema.get("type") == "integer" else value
        assert schema_errors(typed, schema, document, name) == [], (method, template)
    content = response.get("content")
    if content is None:
        return
    media = r.headers.get("content-type", "").split(";")[0].strip()
    assert media in content, (method, template, r.status_code, media)
    if media == "application/json":
        errors = schema_errors(r.json(), content[media]["schema"], document)
        assert errors == [], (method, template, r.status_code, errors)


async def test_the_running_app_serves_the_document_and_every_listed_endpoint() -> None:
    limits = ServeLimits(max_n=2)
    gen = "/v1/images/generations"
    body = {"prompt": "p", "size": "64x64", "num_inference_steps": 2}
    with trio.fail_after(CAP_S):
        async with run_server(api_key="k", limits=limits) as server:
            real: list[tuple[str, str, Any]] = []
            async with server.client() as anonymous:
                served = await anonymous.get("/openapi.json")
                real.append(("POST", gen, await anonymous.post(gen, json=body)))  # 401
            answers = {}
            async with server.client(headers={"Authorization": "Bearer k"}) as client:
                for endpoint in ENDPOINTS:
                    path = endpoint.path.replace("{id}", "nosuch")
                    r = await client.request(endpoint.method, path)
                    answers[(endpoint.method, endpoint.path)] = r
                unlisted = await client.get("/v1/nothing-here")
                # Real answers: a generation, its status and a late cancel (409), a 400, a
                # job from creation to its end and its cancel, the small routes.
                headers = {"X-Request-Id": "g1"}
                real.append(("POST", gen, await client.post(gen, json=body, headers=headers)))
                real.append(("GET", "/v1/requests/{id}", await client.get("/v1/requests/g1")))
                real.append(("DELETE", "/v1/requests/{id}", await client.delete("/v1/requests/g1")))
                real.append(("POST", gen, await client.post(gen, json={**body, "n": 3})))
                created = await client.post("/v1/jobs", json=body, headers={"X-Request-Id": "j1"})
                real.append(("POST", "/v1/jobs", created))
                for _ in range(1000):
                    job = await client.get("/v1/jobs/j1")
                    if job.json()["status"] == "completed":
                        break
                    await trio.sleep(0.01)
                real.append(("GET", "/v1/jobs/{id}", job))
                real.append(("DELETE", "/v1/jobs/{id}", await client.delete("/v1/jobs/j1")))
                for path in ("/v1/models", "/health", "/ready", "/metrics"):
                    real.append(("GET", path, await client.get(path)))
    assert served.status_code == 200
    document = served.json()
    assert document == json.loads(json.dumps(openapi_document(limits, MODEL)))
    statuses = [r.status_code for _, _, r in real]
    assert statuses == [401, 200, 200, 409, 400, 202, 200, 200, 200, 200, 200, 200], statuses
    assert job.json()["result"]["data"][0]["b64_json"]
    assert real[3][2].headers["x-should-retry"] == "false"
    for method, template, r in real:
        check_answer(document, method, template, r)
    for (method, template), r in answers.items():
        check_answer(document, method, template, r)
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
