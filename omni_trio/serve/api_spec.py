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
    "ANSWER_BODIES",
    "EDIT_FIELDS",
    "ENDPOINTS",
    "ERROR_CODES",
    "ENGINE_ERROR_CODES",
    "EVENTS",
    "GENERATION_FIELDS",
    "JOB_FIELDS",
    "PROFILE_FIELDS",
    "SLEEP_FIELDS",
    "MAX_PARTIAL_IMAGES",
    "MAX_SEED",
    "Endpoint",
    "FieldSpec",
    "ServeLimits",
    "api_markdown",
    "bounds",
    "field_named",
    "openapi_document",
    "response_schemas",
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
    type: str  # "string", "integer", "number", "boolean", "file", "lora"
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
        "lora",
        "lora",
        "LoRA adapters to apply (the server's --lora names, listed by GET /v1/models): a name "
        '(scale 1.0), or a list of names and {"name", "scale"} objects (scale a finite number '
        "in -10..10); requests with other adapters never share a forward",
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


# POST /v1/admin/start_profile.
PROFILE_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec(
        "directory",
        "string",
        "where the workers write their traces, on the server: made if missing; a relative "
        "path is the server's working directory's",
        default="profiles",
        extension=True,
    ),
)


# POST /v1/admin/sleep.
SLEEP_FIELDS: tuple[FieldSpec, ...] = (
    FieldSpec(
        "level",
        "integer",
        "1: every worker keeps a copy of the weights off the device (on a CPU in a file); "
        "2: none, reloaded from the model's directory at the wake",
        minimum=1,
        maximum=2,
        default=1,
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
    # "generation", "edit", "variation", "job", "profile", "sleep"
    request: str | None = None
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
    Endpoint(
        "GET",
        "/v1/models",
        "the served model, then each LoRA adapter (--lora) with its parent",
        answers={200: "the model list"},
    ),
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
    Endpoint(
        "POST",
        "/v1/admin/start_profile",
        "start torch.profiler on every worker of every replica",
        "profile",
        {200: '{"directory", "replicas": [index], "skipped": [index]}'},
    ),
    Endpoint(
        "POST",
        "/v1/admin/stop_profile",
        "stop profiling: each worker writes its Chrome trace",
        answers={200: '{"traces": [path]}'},
    ),
    Endpoint(
        "POST",
        "/v1/admin/sleep",
        "release the weights of every replica's workers; generations wait until the wake",
        "sleep",
        {200: '{"sleeping": true, "level", "replicas": [{"index", "ranks"}]}'},
    ),
    Endpoint(
        "GET",
        "/v1/admin/sleep",
        "whether the server sleeps",
        answers={200: '{"sleeping", "level", "replicas": [{"index", "state", "level"}]}'},
    ),
    Endpoint(
        "POST",
        "/v1/admin/wake_up",
        "give the workers their weights back; waiting generations run",
        answers={200: '{"sleeping": false, "level": 0, "replicas": [{"index", "ranks"}]}'},
    ),
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
    # Answered by the HTTP server itself (omni_trio.serve.http), before the app sees a request.
    "invalid_http_request": (400, "a malformed request line, header or framing (HTTP/1.1)"),
    "not_implemented": (501, "an unsupported transfer coding (HTTP/1.1)"),
    "http_version_not_supported": (505, "an HTTP version other than 1.x or 2"),
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
    "queue_full": (
        429,
        "max_queue_len requests in flight, or (policy `priority`) better-priority arrivals "
        "would hold this one longer than a full queue would (Retry-After)",
    ),
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
    "already_profiling": (409, "start_profile while profiling"),
    "not_profiling": (409, "stop_profile while not profiling"),
    "invalid_profile_directory": (400, "a profile directory the server cannot make or write"),
    "profile_failed": (500, "a worker could not start profiling or write its trace"),
    "invalid_lora": (400, "a LoRA adapter the workers cannot apply (not an adapter, wrong model)"),
    "engine_asleep": (503, "the server sleeps and reject_while_asleep is set (Retry-After)"),
    "sleep_timeout": (503, "the requests running did not finish within sleep_drain_timeout_s"),
    "sleep_failed": (500, "a worker could not release its weights; the server stays awake"),
    "wake_failed": (500, "a worker could not take its weights back; the server still sleeps"),
    "internal_error": (500, "a bug: the message names the request id"),
}


# -- the OpenAPI document ------------------------------------------------------------------


def _schema(spec: FieldSpec, limits: ServeLimits) -> dict[str, Any]:
    if spec.type == "file":
        return {"type": "string", "format": "binary", "description": spec.description}
    if spec.type == "lora":
        adapter = {
            "type": "object",
            "additionalProperties": False,
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "scale": {"type": "number", "minimum": -10, "maximum": 10, "default": 1.0},
            },
        }
        return {
            "oneOf": [
                {"type": "string"},
                {"type": "array", "items": {"oneOf": [{"type": "string"}, adapter]}},
            ],
            "description": spec.description,
            "x-omni-trio-extension": True,
        }
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
    """The fields of a request body: ``generation``, ``edit``, ``variation``, ``job``,
    ``profile`` or ``sleep``."""
    if kind == "generation":
        return GENERATION_FIELDS
    if kind == "job":
        return tuple(f for f in GENERATION_FIELDS if f.name != "stream") + JOB_FIELDS
    if kind == "profile":
        return PROFILE_FIELDS
    if kind == "sleep":
        return SLEEP_FIELDS
    base = EDIT_FIELDS + GENERATION_FIELDS
    if kind == "variation":
        return tuple(f for f in base if f.name not in NOT_FOR_VARIATIONS)
    return base


# -- response bodies and headers -------------------------------------------------------------

# A request that failed on the workers answers with the engine's error type as its code
# (omni_trio.serve.app: ImagesApp._terminal_error): an open set -- whatever a model raises --
# so the Error schema takes any such type name besides ERROR_CODES.  These are the ones the
# runtime names itself, and an example of a model's.
ENGINE_ERROR_CODES: dict[str, tuple[int, str]] = {
    "WorkerFailedError": (503, "its worker group failed under it, past the server's own retries"),
    "StallError": (503, "its workers stalled or lost its output, past the server's own retries"),
    "MissingOutputError": (500, "its workers ended it without an output"),
    "RuntimeError": (500, "the model raised it; any other exception's type name is a 500 alike"),
}
# An engine error code: a Python exception's type name (ERROR_CODES are all lower case).
ENGINE_ERROR_CODE = "^[A-Z][A-Za-z0-9_]*$"
JOB_STATUSES = ("queued", "running", "completed", "failed", "cancelled")
_STR: dict[str, Any] = {"type": "string"}
_INT: dict[str, Any] = {"type": "integer"}
_SSE: dict[str, Any] = {"type": "string", "description": "server-sent events (see the events)"}
_BINARY: dict[str, Any] = {"type": "string", "format": "binary"}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _or_null(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


def _record(
    required: Mapping[str, Any], optional: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """A JSON object with exactly these properties (``required`` always there)."""
    return {
        "type": "object",
        "additionalProperties": False,
        "required": list(required),
        "properties": {**required, **(optional or {})},
    }


def response_schemas() -> dict[str, dict[str, Any]]:
    """The JSON bodies the API answers with, as JSON Schema (``components/schemas``)."""
    code = {
        "anyOf": [
            {"enum": [*sorted(ERROR_CODES), None]},
            {"type": "string", "pattern": ENGINE_ERROR_CODE},
        ],
        "description": "one of the error codes, or for a request that failed on the workers "
        f"the engine's error type ({', '.join(ENGINE_ERROR_CODES)}, ...): an open set",
    }
    number = {"type": "number"}
    metrics = _record({"queue_wait_ms": number, "execution_ms": number, "total_ms": number})
    return {
        "ErrorDetail": _record(
            {"message": _STR, "type": _STR, "param": {"type": ["string", "null"]}, "code": code}
        ),
        "Error": _record({"error": _ref("ErrorDetail")}),
        "Image": {
            **_record(
                {},
                {"b64_json": _STR, "url": _STR, "revised_prompt": {"type": ["string", "null"]}},
            ),
            "anyOf": [{"required": ["b64_json"]}, {"required": ["url"]}],
        },
        "ImagesResponse": _record(
            {
                "created": _INT,
                "data": {"type": "array", "items": _ref("Image")},
                "id": _STR,
                "model": _STR,
                "seed": {"type": ["integer", "null"]},
                "output_format": {"enum": ["png", "jpeg", "webp"]},
                "size": _STR,
                "metrics": metrics,
            }
        ),
        "Progress": _record({"step": _INT, "total": _INT}),
        "RequestStatus": _record(
            {
                "id": _STR,
                "object": {"enum": ["request"]},
                "status": {"enum": ["queued", "running", "finished"]},
                "progress": _or_null(_ref("Progress")),
            }
        ),
        "RequestCancelled": _record(
            {"id": _STR, "object": {"enum": ["request"]}, "status": {"enum": ["cancelled"]}}
        ),
        "Job": _record(
            {
                "id": _STR,
                "object": {"enum": ["job"]},
                "status": {"enum": list(JOB_STATUSES)},
                "created_at": _INT,
                "started_at": {"type": ["integer", "null"]},
                "finished_at": {"type": ["integer", "null"]},
                "queue_position": {"type": ["integer", "null"]},
                "progress": _or_null(_ref("Progress")),
                "result": _or_null(_ref("ImagesResponse")),
                "error": _or_null(_ref("ErrorDetail")),
                "http_status": {"type": ["integer", "null"]},
                "webhook_url": {"type": ["string", "null"]},
            }
        ),
        "JobCancelled": _record(
            {
                "id": _STR,
                "object": {"enum": ["job"]},
                "cancelled": {"type": "boolean"},
                "status": {"enum": list(JOB_STATUSES)},
            }
        ),
        "ModelList": _record(
            {
                "object": {"enum": ["list"]},
                "data": {
                    "type": "array",
                    "items": _record(
                        {
                            "id": _STR,
                            "object": {"enum": ["model"]},
                            "created": _INT,
                            "owned_by": _STR,
                        },
                        {"parent": _STR},  # a LoRA adapter: the model it applies to
                    ),
                },
            }
        ),
        "Health": _record({"status": {"enum": ["ok"]}}),
        "ProfileStarted": _record(
            {
                "directory": _STR,
                "replicas": {"type": "array", "items": _INT},
                "skipped": {"type": "array", "items": _INT},
            }
        ),
        "ProfileTraces": _record({"traces": {"type": "array", "items": _STR}}),
        "SleepAnswer": _record(
            {
                "sleeping": {"type": "boolean"},
                "level": {"enum": [0, 1, 2]},
                "replicas": {
                    "type": "array",
                    "items": _record(
                        {"index": _INT, "ranks": {"type": "array", "items": {"type": "object"}}}
                    ),
                },
            }
        ),
        "SleepState": _record(
            {
                "sleeping": {"type": "boolean"},
                "level": {"enum": [0, 1, 2]},
                "replicas": {
                    "type": "array",
                    "items": _record(
                        {
                            "index": _INT,
                            "state": {"enum": ["awake", "falling_asleep", "asleep", "waking"]},
                            "level": {"enum": [0, 1, 2]},
                        }
                    ),
                },
            }
        ),
        "Ready": _record(
            {"status": {"enum": ["ready"]}},
            {"replicas": {"type": "array", "items": {"type": "object"}}},
        ),
    }


# (method, path) -> status -> media type -> its schema (a components/schemas name, or one).
ANSWER_BODIES: dict[tuple[str, str], dict[int, dict[str, str | dict[str, Any]]]] = {
    ("POST", "/v1/images/generations"): {
        200: {"application/json": "ImagesResponse", "text/event-stream": _SSE}
    },
    ("POST", "/v1/images/edits"): {
        200: {"application/json": "ImagesResponse", "text/event-stream": _SSE}
    },
    ("POST", "/v1/images/variations"): {200: {"application/json": "ImagesResponse"}},
    ("GET", "/v1/requests/{id}"): {200: {"application/json": "RequestStatus"}},
    ("DELETE", "/v1/requests/{id}"): {200: {"application/json": "RequestCancelled"}},
    ("POST", "/v1/jobs"): {202: {"application/json": "Job"}, 200: {"application/json": "Job"}},
    ("GET", "/v1/jobs/{id}"): {200: {"application/json": "Job"}},
    ("GET", "/v1/jobs/{id}/events"): {200: {"text/event-stream": _SSE}},
    ("DELETE", "/v1/jobs/{id}"): {200: {"application/json": "JobCancelled"}},
    ("GET", "/v1/files/{id}/content"): {
        200: {"image/png": _BINARY, "image/jpeg": _BINARY, "image/webp": _BINARY}
    },
    ("GET", "/v1/models"): {200: {"application/json": "ModelList"}},
    ("GET", "/openapi.json"): {200: {"application/json": {"type": "object"}}},
    ("GET", "/health"): {200: {"application/json": "Health"}},
    ("GET", "/ready"): {200: {"application/json": "Ready"}},
    ("GET", "/metrics"): {200: {"text/plain": _STR}},
    ("POST", "/v1/admin/start_profile"): {200: {"application/json": "ProfileStarted"}},
    ("POST", "/v1/admin/stop_profile"): {200: {"application/json": "ProfileTraces"}},
    ("POST", "/v1/admin/sleep"): {200: {"application/json": "SleepAnswer"}},
    ("GET", "/v1/admin/sleep"): {200: {"application/json": "SleepState"}},
    ("POST", "/v1/admin/wake_up"): {200: {"application/json": "SleepAnswer"}},
}

_REQUEST_ID_SCHEMA = {"type": "string", "pattern": "^[A-Za-z0-9._:-]{1,128}$"}
HEADERS: dict[str, dict[str, Any]] = {
    "X-Request-Id": {
        "description": "the request's id: the client's, or one the server made (every answer)",
        "schema": _REQUEST_ID_SCHEMA,
    },
    "Retry-After": {
        "description": "seconds to wait before sending it again (429, 503), computed from "
        "what the server measured",
        "schema": {"type": "integer", "minimum": 1, "maximum": 60},
    },
    "x-should-retry": {
        "description": "false: the request ran (or will fail the same way again); do not "
        "resend it unasked (the official OpenAI clients honour it)",
        "schema": {"enum": ["false"]},
    },
}
PARAMETERS: dict[str, dict[str, Any]] = {
    "X-Request-Id": {
        "name": "X-Request-Id",
        "in": "header",
        "required": False,
        "description": "the id of the generation (or job) it makes, scoped to the key; "
        "default: a generated one",
        "schema": _REQUEST_ID_SCHEMA,
    },
    "Idempotency-Key": {
        "name": "Idempotency-Key",
        "in": "header",
        "required": False,
        "description": "a resubmission with the same key and body attaches to the first "
        "request; another body is a 422",
        "schema": {"type": "string", "minLength": 1, "maxLength": 255},
    },
    "Last-Event-ID": {
        "name": "Last-Event-ID",
        "in": "header",
        "required": False,
        "description": "resume after this event",
        "schema": {"type": "string", "pattern": "^[0-9]{1,20}$"},
    },
}


def _header_refs(*names: str) -> dict[str, Any]:
    return {name: {"$ref": f"#/components/headers/{name}"} for name in names}


def _error_response(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "headers": _header_refs("X-Request-Id", "Retry-After", "x-should-retry"),
        "content": {"application/json": {"schema": _ref("Error")}},
    }


ERROR_RESPONSES: dict[str, dict[str, Any]] = {
    "ClientError": _error_response("an error: the OpenAI envelope (429: with Retry-After)"),
    "ServerError": _error_response("an error: the OpenAI envelope (503: with Retry-After)"),
}


def _responses(endpoint: Endpoint) -> dict[str, Any]:
    """Every answer of ``endpoint``: its own (with a body schema where ANSWER_BODIES has
    one), then the error envelope on every 4xx and 5xx status."""
    bodies = ANSWER_BODIES.get((endpoint.method, endpoint.path), {})
    out: dict[str, Any] = {}
    for status, text in endpoint.answers.items():
        if status >= 400:
            out[str(status)] = _error_response(text)
            continue
        response: dict[str, Any] = {"description": text, "headers": _header_refs("X-Request-Id")}
        content = bodies.get(status)
        if content:
            response["content"] = {
                media: {"schema": _ref(schema) if isinstance(schema, str) else schema}
                for media, schema in content.items()
            }
        out[str(status)] = response
    out["4XX"] = {"$ref": "#/components/responses/ClientError"}
    out["5XX"] = {"$ref": "#/components/responses/ServerError"}
    return out


def _parameters(endpoint: Endpoint) -> list[dict[str, Any]]:
    params: list[dict[str, Any]] = []
    if "{id}" in endpoint.path:
        params.append({"name": "id", "in": "path", "required": True, "schema": {"type": "string"}})
    names = ["X-Request-Id"]
    if endpoint.request in ("generation", "edit", "variation", "job"):
        names.append("Idempotency-Key")
    if endpoint.path.endswith("/events"):
        names.append("Last-Event-ID")
    params += [{"$ref": f"#/components/parameters/{name}"} for name in names]
    return params


def openapi_document(limits: ServeLimits, model_name: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document of the API under ``limits``."""
    paths: dict[str, dict[str, Any]] = {}
    for endpoint in ENDPOINTS:
        operation: dict[str, Any] = {
            "summary": endpoint.summary,
            "parameters": _parameters(endpoint),
            "responses": _responses(endpoint),
        }
        if endpoint.request is not None:
            media = (
                "application/json"
                if endpoint.request in ("generation", "job", "profile", "sleep")
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
                **response_schemas(),
                **{
                    kind.capitalize() + "Request": _object(request_fields(kind), limits)
                    for kind in ("generation", "edit", "variation", "job", "profile", "sleep")
                },
            },
            "responses": ERROR_RESPONSES,
            "headers": HEADERS,
            "parameters": PARAMETERS,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "x-omni-trio-error-codes": {
            code: {"status": status, "when": when} for code, (status, when) in ERROR_CODES.items()
        },
        "x-omni-trio-engine-error-codes": {
            code: {"status": status, "when": when}
            for code, (status, when) in ENGINE_ERROR_CODES.items()
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


def _type_cell(spec: FieldSpec) -> str:
    return "string or array" if spec.type == "lora" else spec.type


def _field_table(fields: Sequence[FieldSpec], limits: ServeLimits) -> list[str]:
    lines = ["| field | type | range | default | meaning |", "|---|---|---|---|---|"]
    for spec in fields:
        name = f"`{spec.name}`" + (" (required)" if spec.required else "")
        if spec.extension:
            name += " ext."
        default = "-" if spec.default is None else f"`{json.dumps(spec.default)}`"
        lines.append(
            f"| {name} | {_type_cell(spec)} | {_cell(_range(spec, limits))} | {default} "
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
    out += ["", "### POST /v1/admin/start_profile (JSON)", ""]
    out += ["A JSON object, `{}` for the default directory:", ""]
    out += _field_table(PROFILE_FIELDS, limits)
    out += ["", "### POST /v1/admin/sleep (JSON)", ""]
    out += ["A JSON object, or an empty body for level 1:", ""]
    out += _field_table(SLEEP_FIELDS, limits)
    out += ["", "## Headers", ""]
    out += [
        "- `X-Request-Id` (request and response): 1..128 of `[A-Za-z0-9._:-]`; a generation's",
        "  (or job's) id, scoped to the key.",
        "- `Idempotency-Key` (generations, edits, jobs): a resubmission with the same key and",
        "  body attaches to the first; another body is a 422.",
        "- `Last-Event-ID` (job events): resume after that event.",
        "- `Retry-After` (429, 503: 1..60 seconds, from what the server measured),",
        "  `x-should-retry: false` (the request ran, or its failure will recur: do not resend",
        "  it unasked), `X-Omni-Trio-Ignored-Fields` (fields accepted and ignored),",
        "  `Location` (jobs).",
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
        "another error type: 500), with `x-should-retry: false`.  The set is open (any",
        "exception a model raises), so the `Error` schema's `code` is one of the codes above",
        f"or a type name (`{ENGINE_ERROR_CODE}`); those the runtime names itself:",
        "",
        "| code | status | when |",
        "|---|---|---|",
    ]
    out += [
        f"| `{code}` | {status} | {_cell(when)} |"
        for code, (status, when) in ENGINE_ERROR_CODES.items()
    ]
    out += _response_tables()
    return "\n".join(out) + "\n"


def _schema_text(schema: Mapping[str, Any]) -> str:
    """A short type for a schema in the page: a component's name, ``a | b``, ``[items]``."""
    if "$ref" in schema:
        return str(schema["$ref"]).rsplit("/", 1)[1]
    if "anyOf" in schema:
        return " or ".join(_schema_text(part) for part in schema["anyOf"])
    if schema.get("pattern") == ENGINE_ERROR_CODE:
        return "an engine error type"
    if "enum" in schema:
        values = schema["enum"]
        if len(values) > 6:
            return "an error code (or null)"
        return " or ".join(json.dumps(value) for value in values)
    kind = schema.get("type", "any")
    if kind == "array":
        return f"[{_schema_text(schema.get('items', {}))}]"
    return " or ".join(kind) if isinstance(kind, list) else str(kind)


def _response_tables() -> list[str]:
    out = ["", "## Responses", ""]
    out += [
        "Every error status (4xx, 5xx) answers the `Error` envelope.  The other bodies, by",
        "endpoint and status (the schemas are in `/openapi.json`'s `components/schemas`):",
        "",
        "| method | path | status | body |",
        "|---|---|---|---|",
    ]
    for (method, path), answers in ANSWER_BODIES.items():
        for status, media in answers.items():
            body = "; ".join(
                f"{kind}: " + (f"`{schema}`" if isinstance(schema, str) else "-")
                for kind, schema in media.items()
            )
            out.append(f"| {method} | `{path}` | {status} | {_cell(body)} |")
    out += ["", "| schema | fields |", "|---|---|"]
    for name, schema in response_schemas().items():
        required = set(schema.get("required", ()))
        fields = ", ".join(
            f"`{field}`{'' if field in required else '?'}: {_schema_text(sub)}"
            for field, sub in schema.get("properties", {}).items()
        )
        out.append(f"| `{name}` | {_cell(fields)} |")
    out += ["", "`?`: not always there.  `Image` has `b64_json` or `url`."]
    return out


if __name__ == "__main__":  # pragma: no cover - the page's generator
    print(api_markdown(ServeLimits()), end="")
