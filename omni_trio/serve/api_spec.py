"""The HTTP API, described once: the request fields (whose names, types and bounds the
parsers in :mod:`.images` and :mod:`.edits` read from here), the endpoints, the server-sent
events and the error codes.  ``GET /openapi.json`` (:func:`openapi_document`) and
``docs/api.md`` (:func:`api_markdown`; ``python -m omni_trio.serve.api_spec > docs/api.md``)
are both generated from these definitions, with the limits of the server at hand (the
document) or the defaults (the page); a test keeps the page equal to what this module
generates and checks every code, event and route against the running app.

Pure: no trio, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "EDIT_FIELDS",
    "ENDPOINTS",
    "ERROR_CODES",
    "EVENTS",
    "GENERATION_FIELDS",
    "JOB_FIELDS",
    "MAX_PARTIAL_IMAGES",
    "MAX_SEED",
    "Endpoint",
    "FieldSpec",
    "ServeLimits",
    "api_markdown",
    "bounds",
    "field_named",
    "openapi_document",
]

MAX_SEED = 2**32 - 1
MAX_PARTIAL_IMAGES = 3
MAX_PRIORITY = 2**31 - 1


@dataclass(frozen=True, slots=True)
class ServeLimits:
    """Hard limits of the HTTP API, checked before anything reaches an engine (whose own
    ``EngineConfig`` limits still apply after these)."""

    max_body_bytes: int = 1_000_000
    max_prompt_chars: int = 4000
    max_n: int = 4
    max_pixels: int = 1024 * 1024
    max_steps: int = 200
    # POST /v1/images/edits and /variations: the whole multipart body, and each picture's
    # width * height as its file says (checked before it is decoded).
    max_upload_bytes: int = 16 * 1024 * 1024
    max_upload_pixels: int = 4096 * 4096

    def __post_init__(self) -> None:
        for name in (
            "max_body_bytes",
            "max_prompt_chars",
            "max_n",
            "max_pixels",
            "max_steps",
            "max_upload_bytes",
            "max_upload_pixels",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One request field.  ``minimum`` / ``maximum`` are numbers or the name of a
    :class:`ServeLimits` attribute (the server's limit);
    ``exclusive_minimum`` makes the minimum exclusive.  ``ignored``: accepted and ignored
    (named in ``X-Omni-Trio-Ignored-Fields``); ``extension``: not in OpenAI's API."""

    name: str
    type: str  # "string", "integer", "number", "boolean", "file"
    description: str
    minimum: int | float | str | None = None
    maximum: int | float | str | None = None
    exclusive_minimum: bool = False
    enum: tuple[str, ...] = ()
    default: Any = None
    required: bool = False
    extension: bool = False
    ignored: bool = False
    max_length: str | None = None  # a ServeLimits attribute


def _ignored(name: str) -> FieldSpec:
    return FieldSpec(name, "string", "GPT-image only: accepted and ignored", ignored=True)


GENERATION_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec(
        "prompt",
        "string",
        "what to draw",
        required=True,
        max_length="max_prompt_chars",
    ),
    FieldSpec("model", "string", "the served model's name (any other: 404 model_not_found)"),
    FieldSpec("n", "integer", "images to generate", minimum=1, maximum="max_n", default=1),
    FieldSpec(
        "size",
        "string",
        '"WxH", both multiples of 8, at most max_pixels pixels; or "auto" (the model\'s '
        "default size)",
        default="auto",
    ),
    FieldSpec(
        "response_format",
        "string",
        "images inline as base64, or as URLs of /v1/files/{id}/content",
        enum=("b64_json", "url"),
        default="b64_json",
    ),
    FieldSpec(
        "output_format", "string", "image format", enum=("png", "jpeg", "webp"), default="png"
    ),
    FieldSpec(
        "output_compression",
        "integer",
        "JPEG/WebP quality (ignored for PNG)",
        minimum=0,
        maximum=100,
    ),
    FieldSpec("user", "string", "accepted and ignored"),
    FieldSpec("safety_identifier", "string", "accepted and ignored"),
    FieldSpec("stream", "boolean", "answer with server-sent events", default=False),
    FieldSpec(
        "stream_progress",
        "boolean",
        "progress as <prefix>.progress events (default: yes, but SSE comments for an OpenAI "
        "SDK client)",
        extension=True,
    ),
    FieldSpec(
        "partial_images",
        "integer",
        "previews streamed before the result (needs a server started with --streaming)",
        minimum=0,
        maximum=MAX_PARTIAL_IMAGES,
        default=0,
    ),
    FieldSpec(
        "timeout",
        "number",
        "seconds; past it the request is aborted (504 timeout); the engine's deadline_s",
        minimum=0,
        exclusive_minimum=True,
        extension=True,
    ),
    FieldSpec(
        "priority",
        "integer",
        "lower runs first under --scheduling-policy priority (within the key's or engine's "
        "range: 400 priority_not_allowed outside it)",
        minimum=-(2**31),
        maximum=MAX_PRIORITY,
        extension=True,
    ),
    FieldSpec(
        "num_inference_steps",
        "integer",
        "denoising steps (default: the model's)",
        minimum=1,
        maximum="max_steps",
        extension=True,
    ),
    FieldSpec(
        "guidance_scale",
        "number",
        "classifier-free guidance (default: the model's)",
        minimum=0,
        extension=True,
    ),
    FieldSpec(
        "negative_prompt",
        "string",
        "what not to draw",
        max_length="max_prompt_chars",
        extension=True,
    ),
    FieldSpec(
        "seed",
        "integer",
        "random seed (random when absent; echoed in the answer)",
        minimum=0,
        maximum=MAX_SEED,
        extension=True,
    ),
    *(
        _ignored(name)
        for name in ("quality", "style", "background", "moderation", "input_fidelity", "complexity")
    ),
)

# Multipart fields of /v1/images/edits and /variations besides the generation fields (sent
# as form text and read as their JSON type).
EDIT_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec(
        "image",
        "file",
        "the picture (PNG, JPEG or WebP; one; at most max_upload_pixels); also image[]",
        required=True,
    ),
    FieldSpec(
        "mask",
        "file",
        "edits: the same size as image; its fully transparent (or white) pixels are repainted",
    ),
    FieldSpec(
        "strength",
        "number",
        "how far from the picture: in (0, 1]; default 0.8, 1.0 with a mask",
        minimum=0,
        exclusive_minimum=True,
        maximum=1,
        extension=True,
    ),
)
# Fields a variation may not carry.
NOT_FOR_VARIATIONS = ("prompt", "stream", "stream_progress", "partial_images", "mask")

# POST /v1/jobs: the generation fields but stream, plus these.
JOB_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec(
        "webhook_url",
        "string",
        "http(s) URL the server POSTs the job's progress and end to (needs --webhook-secret; "
        "only webhook_hosts when set)",
        extension=True,
    ),
)


def field_named(name: str, fields: Sequence[FieldSpec] = GENERATION_FIELDS) -> FieldSpec:
    for spec in fields:
        if spec.name == name:
            return spec
    raise KeyError(name)


def _limit(value: int | float | str | None, limits: ServeLimits) -> Any:
    return getattr(limits, value) if isinstance(value, str) else value


def bounds(
    name: str, limits: ServeLimits, fields: Sequence[FieldSpec] = GENERATION_FIELDS
) -> tuple[Any, Any]:
    """``(minimum, maximum)`` of field ``name`` under ``limits`` (None: unbounded)."""
    spec = field_named(name, fields)
    return _limit(spec.minimum, limits), _limit(spec.maximum, limits)


@dataclass(frozen=True, slots=True)
class Endpoint:
    method: str
    path: str
    summary: str
    request: str | None = None  # "generation", "edit", "variation", "job"
    answers: Mapping[int, str] = field(default_factory=dict)
    events: tuple[str, ...] = ()
    open: bool = False  # no API key needed


_GEN_ANSWERS = {
    200: "the ImagesResponse (JSON), or with stream=true the events (text/event-stream)",
}
ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint(
        "POST",
        "/v1/images/generations",
        "generate images",
        "generation",
        _GEN_ANSWERS,
        (
            "image_generation.partial_image",
            "image_generation.completed",
            "image_generation.progress",
            "error",
        ),
    ),
    Endpoint(
        "POST",
        "/v1/images/edits",
        "edit a picture (image-to-image, inpainting)",
        "edit",
        _GEN_ANSWERS,
        ("image_edit.partial_image", "image_edit.completed", "image_edit.progress", "error"),
    ),
    Endpoint(
        "POST",
        "/v1/images/variations",
        "variations of a picture",
        "variation",
        {200: "the ImagesResponse"},
    ),
    Endpoint(
        "GET",
        "/v1/requests/{id}",
        "where a generation is",
        answers={
            200: '{"id", "object": "request", "status": queued|running|finished, '
            '"progress": {"step", "total"} | null}'
        },
    ),
    Endpoint(
        "DELETE",
        "/v1/requests/{id}",
        "abort a queued or running generation",
        answers={200: '{"id", "object": "request", "status": "cancelled"}'},
    ),
    Endpoint(
        "POST",
        "/v1/jobs",
        "a generation in the background",
        "job",
        {
            202: "the job (Location: /v1/jobs/{id})",
            200: "the same job again (Idempotency-Key replay)",
        },
    ),
    Endpoint(
        "GET",
        "/v1/jobs/{id}",
        "a job: status, queue position, progress, result or error",
        answers={200: "the job"},
    ),
    Endpoint(
        "GET",
        "/v1/jobs/{id}/events",
        "a job's events (SSE), resumable with Last-Event-ID",
        answers={200: "text/event-stream"},
        events=(
            "job.queued",
            "job.running",
            "job.progress",
            "job.completed",
            "job.failed",
            "job.cancelled",
        ),
    ),
    Endpoint(
        "DELETE",
        "/v1/jobs/{id}",
        "cancel a job (idempotent)",
        answers={200: '{"id", "object": "job", "cancelled": true|false, "status"}'},
    ),
    Endpoint(
        "GET",
        "/v1/files/{id}/content",
        "an image kept for response_format=url",
        answers={200: "the image bytes"},
    ),
    Endpoint("GET", "/v1/models", "the served model", answers={200: "the model list"}),
    Endpoint(
        "GET",
        "/openapi.json",
        "this API as an OpenAPI 3.1 document",
        answers={200: "application/json"},
        open=True,
    ),
    Endpoint("GET", "/health", "liveness", answers={200: '{"status": "ok"}'}, open=True),
    Endpoint(
        "GET",
        "/ready",
        "readiness: every replica open, healthy and warm",
        answers={200: '{"status": "ready"}', 503: "not ready, with the reason"},
        open=True,
    ),
    Endpoint("GET", "/metrics", "Prometheus metrics", answers={200: "text exposition"}),
)

EVENTS: dict[str, str] = {
    "image_generation.partial_image": "a preview: b64_json, partial_image_index, size, "
    "quality, background, output_format, created_at",
    "image_generation.completed": "one per image: b64_json, image_index, size, quality, "
    "background, output_format, created_at, usage (zeros), seed",
    "image_generation.progress": '{"type", "id", "step", "total"}; an SSE comment for an '
    "OpenAI SDK client unless stream_progress says otherwise",
    "image_edit.partial_image": "as image_generation.partial_image, for edits",
    "image_edit.completed": "as image_generation.completed, for edits",
    "image_edit.progress": "as image_generation.progress, for edits",
    "error": "a failure after the stream started: the error envelope",
    "job.queued": "the job, at creation",
    "job.running": "the job, once it runs",
    "job.progress": '{"id", "step", "total"}',
    "job.completed": "the job with its result",
    "job.failed": "the job with its error and http_status",
    "job.cancelled": "the job",
}

# code -> (HTTP status, when).  Every code the server answers is here (a test reads the
# source for them).
ERROR_CODES: dict[str, tuple[int, str]] = {
    "invalid_api_key": (401, "no or a wrong Authorization: Bearer key"),
    "unknown_url": (404, "no such route"),
    "method_not_allowed": (405, "the route takes other methods (Allow says which)"),
    "request_header_fields_too_large": (431, "request line and headers over 16 KiB"),
    "invalid_request": (
        400,
        "a malformed request (both Content-Length and Transfer-Encoding, a bad Content-Length)",
    ),
    "invalid_request_id": (400, "X-Request-Id is not 1..128 of [A-Za-z0-9._:-], once"),
    "unsupported_media_type": (415, "the wrong Content-Type"),
    "request_too_large": (413, "the body is over max_body_bytes (max_upload_bytes)"),
    "request_timeout": (408, "the body did not arrive within body_read_timeout_s"),
    "invalid_json": (400, "the body is not JSON"),
    "invalid_type": (400, "a field of the wrong type"),
    "invalid_value": (400, "a field out of range"),
    "unknown_parameter": (400, "a field the endpoint does not take"),
    "missing_required_parameter": (400, "a required field is missing"),
    "model_not_found": (404, "model names another model"),
    "duplicate_field": (400, "a form field sent twice"),
    "partial_images_unsupported": (400, "partial_images on a server that streams no previews"),
    "priority_not_allowed": (400, "priority outside the key's range"),
    "request_too_costly": (400, "the estimated compute is over max_request_s / max_step_s"),
    "invalid_payload": (400, "found invalid once admitted (its payload)"),
    "invalid_multipart": (400, "a malformed multipart body"),
    "missing_boundary": (400, "multipart without a boundary"),
    "invalid_boundary": (400, "a malformed boundary"),
    "too_many_parts": (400, "more parts than the form allows"),
    "part_too_large": (413, "a part over max_upload_bytes"),
    "headers_too_large": (400, "a part's headers too long"),
    "invalid_disposition": (400, "a malformed Content-Disposition"),
    "invalid_encoding": (400, "a part's transfer encoding is not supported"),
    "missing_name": (400, "a part without a name"),
    "invalid_image": (400, "a picture that cannot be decoded (truncated, corrupt)"),
    "unsupported_image_format": (400, "a picture that is not PNG, JPEG or WebP"),
    "empty_image": (400, "an empty file"),
    "image_too_large": (400, "a picture over max_upload_pixels (read from its header)"),
    "image_too_small": (400, "a picture under 8x8"),
    "too_many_images": (400, "more than one picture"),
    "mask_size_mismatch": (400, "a mask of another size than the picture"),
    "empty_mask": (400, "a mask that marks nothing"),
    "invalid_idempotency_key": (400, "an Idempotency-Key that is not 1..255 printable ASCII"),
    "idempotency_key_reused": (422, "the key came with another body"),
    "idempotency_key_used": (409, "the key's request ended and cannot be replayed"),
    "duplicate_request_id": (409, "the owner has a request (or job) with that id"),
    "request_not_found": (404, "no such request (or another key's)"),
    "request_finished": (409, "the request already ended"),
    "request_cancelled": (409, "the request was cancelled (not retried)"),
    "job_not_found": (404, "no such job (unknown, expired, or another key's)"),
    "jobs_unavailable": (503, "the server runs no jobs right now"),
    "webhooks_disabled": (400, "webhook_url on a server without a webhook secret"),
    "invalid_webhook_url": (400, "a webhook_url that is not an allowed http(s) URL"),
    "invalid_last_event_id": (400, "Last-Event-ID is not an event number"),
    "file_not_found": (404, "no such file (unknown or expired)"),
    "queue_full": (429, "max_queue_len requests in flight (Retry-After)"),
    "response_memory_full": (429, "max_response_bytes_in_flight held (Retry-After)"),
    "too_many_connections": (503, "max_connections open"),
    "queue_wait_too_long": (503, "the estimated wait is over max_queue_wait_s or the timeout"),
    "not_ready": (503, "no replica is ready (Retry-After)"),
    "draining": (503, "the server is shutting down"),
    "engine_dead": (503, "the engine died; the server restarts"),
    "engine_closed": (503, "the engine is closed"),
    "aborted": (503, "the request was aborted by the server (drain, restart_wait_s)"),
    "timeout": (504, "the request's timeout passed; it was aborted (not retried)"),
    "request_quarantined": (500, "the workers failed each time it ran (not retried)"),
    "internal_error": (500, "a bug: the message names the request id"),
}


# -- the OpenAPI document ------------------------------------------------------------------


def _schema(spec: FieldSpec, limits: ServeLimits) -> dict[str, Any]:
    if spec.type == "file":
        return {"type": "string", "format": "binary", "description": spec.description}
    schema: dict[str, Any] = {"type": spec.type, "description": spec.description}
    low, high = _limit(spec.minimum, limits), _limit(spec.maximum, limits)
    if low is not None:
        schema["exclusiveMinimum" if spec.exclusive_minimum else "minimum"] = low
    if high is not None:
        schema["maximum"] = high
    if spec.enum:
        schema["enum"] = list(spec.enum)
    if spec.default is not None:
        schema["default"] = spec.default
    if spec.max_length is not None:
        schema["maxLength"] = getattr(limits, spec.max_length)
        if spec.required:
            schema["minLength"] = 1
    if spec.extension:
        schema["x-omni-trio-extension"] = True
    if spec.ignored:
        schema["x-omni-trio-ignored"] = True
    return schema


def _object(fields: Sequence[FieldSpec], limits: ServeLimits) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": [f.name for f in fields if f.required],
        "properties": {f.name: _schema(f, limits) for f in fields},
    }


def request_fields(kind: str) -> tuple[FieldSpec, ...]:
    """The fields of a request body: ``generation``, ``edit``, ``variation`` or ``job``."""
    if kind == "generation":
        return GENERATION_FIELDS
    if kind == "job":
        return tuple(f for f in GENERATION_FIELDS if f.name != "stream") + JOB_FIELDS
    base = EDIT_FIELDS + GENERATION_FIELDS
    if kind == "variation":
        return tuple(f for f in base if f.name not in NOT_FOR_VARIATIONS)
    return base


def openapi_document(limits: ServeLimits, model_name: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the API under ``limits``."""
    error = {
        "type": "object",
        "properties": {
            "error": {
                "type": "object",
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": ["string", "null"], "enum": [*sorted(ERROR_CODES), None]},
                },
            }
        },
    }
    paths: dict[str, dict[str, Any]] = {}
    for endpoint in ENDPOINTS:
        operation: dict[str, Any] = {
            "summary": endpoint.summary,
            "responses": {
                str(status): {"description": text} for status, text in endpoint.answers.items()
            },
        }
        operation["responses"]["default"] = {
            "description": "an error: the OpenAI envelope",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        if "{id}" in endpoint.path:
            operation["parameters"] = [
                {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}
            ]
        if endpoint.request is not None:
            media = (
                "application/json"
                if endpoint.request in ("generation", "job")
                else ("multipart/form-data")
            )
            name = endpoint.request.capitalize() + "Request"
            operation["requestBody"] = {
                "required": True,
                "content": {media: {"schema": {"$ref": f"#/components/schemas/{name}"}}},
            }
        if endpoint.events:
            operation["x-omni-trio-events"] = {name: EVENTS[name] for name in endpoint.events}
        if endpoint.open:
            operation["security"] = []
        paths.setdefault(endpoint.path, {})[endpoint.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "omni-trio images API",
            "version": "1",
            "description": f"OpenAI-compatible images API serving {model_name}",
        },
        "paths": paths,
        "components": {
            "schemas": {
                "Error": error,
                **{
                    kind.capitalize() + "Request": _object(request_fields(kind), limits)
                    for kind in ("generation", "edit", "variation", "job")
                },
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "x-omni-trio-error-codes": {
            code: {"status": status, "when": when} for code, (status, when) in ERROR_CODES.items()
        },
    }


# -- the reference page ----------------------------------------------------------------------


def _cell(text: str) -> str:
    """Text for a Markdown table cell (a bare ``|`` would end the cell)."""
    return text.replace("\\|", "|").replace("|", "\\|")


def _range(spec: FieldSpec, limits: ServeLimits) -> str:
    low, high = _limit(spec.minimum, limits), _limit(spec.maximum, limits)
    parts = []
    if spec.enum:
        parts.append(" | ".join(f"`{v}`" for v in spec.enum))
    if low is not None or high is not None:
        left = "(" if spec.exclusive_minimum else "["
        parts.append(f"{left}{'' if low is None else low}, {'' if high is None else high}]")
    if spec.max_length is not None:
        parts.append(f"at most {getattr(limits, spec.max_length)} characters")
    return "; ".join(parts) or "-"


def _field_table(fields: Sequence[FieldSpec], limits: ServeLimits) -> list[str]:
    lines = ["| field | type | range | default | meaning |", "|---|---|---|---|---|"]
    for spec in fields:
        name = f"`{spec.name}`" + (" (required)" if spec.required else "")
        if spec.extension:
            name += " ext."
        default = "-" if spec.default is None else f"`{json.dumps(spec.default)}`"
        lines.append(
            f"| {name} | {spec.type} | {_cell(_range(spec, limits))} | {default} "
            f"| {_cell(spec.description)} |"
        )
    return lines


def api_markdown(limits: ServeLimits) -> str:
    """``docs/api.md``: the reference page, under ``limits`` (the defaults for the page)."""
    out = [
        "# HTTP API reference",
        "",
        "<!-- Generated by `python -m omni_trio.serve.api_spec > docs/api.md` from",
        "omni_trio/serve/api_spec.py, the definitions the server validates requests with; a",
        "test fails when this page and the definitions differ.  Do not edit by hand. -->",
        "",
        "`omni-trio serve` speaks OpenAI's images API plus the extensions marked *ext.* below.",
        "The same description, with the running server's own limits, is served as an OpenAPI",
        "3.1 document at `GET /openapi.json`.  Limits shown here are the defaults (see",
        "[operations.md](operations.md#configuration) to change them).  With API keys set,",
        "every route but `/health`, `/ready` and `/openapi.json` needs",
        "`Authorization: Bearer <key>`.  Every response carries `X-Request-Id`; every error is",
        '`{"error": {"message", "type", "param", "code"}}`.',
        "",
        "## Endpoints",
        "",
        "| method | path | what | answers |",
        "|---|---|---|---|",
    ]
    for e in ENDPOINTS:
        answers = "; ".join(f"{status}: {text}" for status, text in e.answers.items())
        out.append(f"| {e.method} | `{e.path}` | {_cell(e.summary)} | {_cell(answers)} |")
    out += ["", "## Request fields", ""]
    out += ["### POST /v1/images/generations (JSON)", ""]
    out += _field_table(GENERATION_FIELDS, limits)
    out += ["", "### POST /v1/images/edits and /v1/images/variations (multipart/form-data)", ""]
    out += [
        "The generation fields as form text (read as their JSON type), plus the ones below.",
        f"Variations take none of {', '.join(f'`{n}`' for n in NOT_FOR_VARIATIONS)}.",
        "",
    ]
    out += _field_table(EDIT_FIELDS, limits)
    out += ["", "### POST /v1/jobs (JSON)", ""]
    out += ["The generation fields but `stream`, plus:", ""]
    out += _field_table(JOB_FIELDS, limits)
    out += ["", "## Headers", ""]
    out += [
        "- `X-Request-Id` (request and response): 1..128 of `[A-Za-z0-9._:-]`; a generation's",
        "  (or job's) id, scoped to the key.",
        "- `Idempotency-Key` (generations, edits, jobs): a resubmission with the same key and",
        "  body attaches to the first; another body is a 422.",
        "- `Last-Event-ID` (job events): resume after that event.",
        "- `Retry-After` (429, 503), `x-should-retry: false` (failures that will recur),",
        "  `X-Omni-Trio-Ignored-Fields` (fields accepted and ignored), `Location` (jobs).",
        "",
        "## Events",
        "",
        "| event | data |",
        "|---|---|",
    ]
    out += [f"| `{name}` | {_cell(text)} |" for name, text in EVENTS.items()]
    out += ["", "## Error codes", "", "| code | status | when |", "|---|---|---|"]
    out += [
        f"| `{code}` | {status} | {_cell(when)} |" for code, (status, when) in ERROR_CODES.items()
    ]
    out += [
        "",
        "A request that failed on the workers carries the engine's error type as its code",
        "instead (`WorkerFailedError` and the like: 503 after the server's own retries;",
        "another error type: 500), with `x-should-retry: false`.",
    ]
    return "\n".join(out) + "\n"


if __name__ == "__main__":  # pragma: no cover - the page's generator
    print(api_markdown(ServeLimits()), end="")
