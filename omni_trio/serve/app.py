"""The ASGI app of ``omni-trio serve``: raw ASGI, no web framework, so every byte a client
sees is ours (no framework error page can ever leak).

Routes::

    POST   /v1/images/generations    generate (JSON, or server-sent events with stream=true)
    GET    /v1/requests/{id}         where a generation is: queued, running or finished
    DELETE /v1/requests/{id}         abort a queued or running generation
    GET    /v1/files/{id}/content    an image kept for response_format=url
    POST   /v1/jobs                  a generation in the background: the job, at once (202)
    GET    /v1/jobs/{id}             the job: status, queue position, progress, result/error
    GET    /v1/jobs/{id}/events      its events (SSE), resumable with Last-Event-ID
    DELETE /v1/jobs/{id}             cancel it (idempotent): {"cancelled": true|false}
    GET    /v1/models                the served model
    POST   /v1/admin/start_profile   torch.profiler on every worker (profiling.py)
    POST   /v1/admin/stop_profile    stop it: {"traces": [paths]}, one Chrome trace per worker
    POST   /v1/admin/sleep           release the weights ({"level": 1|2}; sleeping.py)
    GET    /v1/admin/sleep           {"sleeping", "level", "replicas"}
    POST   /v1/admin/wake_up         take them back; queued generations run
    GET    /openapi.json             this API as an OpenAPI 3.1 document (api_spec.py)
    GET    /health                   200 while the event loop answers (liveness)
    GET    /ready                    200 when every replica is open and healthy, else 503
    GET    /metrics                  Prometheus text exposition

Auth: when API keys are set (``api_key``, ``api_keys``), every ``/v1/*`` route and
``/metrics`` need ``Authorization: Bearer <key>`` with one of them (compared in constant time),
else 401.  ``/health`` and ``/ready`` stay open for probes (they reveal nothing but the replica
states).

Ownership: a generation belongs to the key it was made with -- or, when no key is set, to the
bearer token the client sent (any value: a *client token*; clients that send none share one
anonymous owner).  Only its owner can ``GET`` or ``DELETE /v1/requests/{id}`` it; anyone else
gets the 404 of an unknown id.  Client-chosen ids are scoped per owner: two owners may use the
same ``X-Request-Id`` at once (see :func:`~omni_trio.serve.pool.engine_request_id`).

Every error is the OpenAI envelope ``{"error": {"message", "type", "param", "code"}}``;
an unexpected failure is logged with its traceback and answered 500 with a generic message
naming the request id.  ``__call__`` never raises for anything a client sends.

Every response carries ``X-Request-Id``: the client's (validated: 1..128 characters of
``[A-Za-z0-9._:-]``; an invalid one is a 400 on ``/v1/*``, replaced elsewhere) or a
generated one (``req-`` + 128 random bits).  For a generation it is the request's public id,
so ``DELETE /v1/requests/{id}`` by its owner cancels it.  Each request ends with one
structured access record passed to ``log`` (see :class:`ImagesApp`).

Slow clients: the request body must arrive within ``body_read_timeout_s`` (else 408, and the
connection is closed).  Bodies go out in :data:`~omni_trio.serve.http.SEND_CHUNK` pieces,
each under the write deadline on its own: the HTTP server's (:mod:`omni_trio.serve.http`,
``send_timeout_s`` per piece on HTTP/1.1 and HTTP/2; it closes the connection and counts the
drop), seen here through the scope's :class:`~omni_trio.serve.http.SendDeadline` so that a
handler stops at once; under another ASGI server the app bounds each piece itself.  Response
memory is bounded by ``max_response_bytes_in_flight`` (:class:`ResponseBytes`): a generation
reserves an estimate of its answer at admission (``n * width * height *``
:data:`RESPONSE_BYTES_PER_PIXEL` plus :data:`RESPONSE_BYTES_PER_IMAGE` per image), held until
its answer is written or it ends, and every answer holds its bytes while they are written; a
generation or a file download that does not fit gets 429 ``response_memory_full``.  File URLs
are built from ``public_url``, else from the address the client connected to, never from the
``Host`` header.

Cancellation: a client that disconnects while its generation is queued or running aborts
it (the worker stops at its next step); a request ``timeout`` aborts it too (504).  If the
server cancels a handler (shutdown), the request is aborted the same way.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import trio

from .._core.lifecycle import RequestStatus
from .._core.messages import DiffusionOutput
from ..errors import (
    QUARANTINED_ERROR_TYPE,
    RETRYABLE_ERROR_TYPES,
    TIMEOUT_ERROR_TYPE,
    DuplicateRequestError,
    EngineAsleepError,
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    OmniTrioError,
)
from .api_spec import openapi_document
from .config import MIB
from .edits import form_digest, parse_edit_form
from .http import HEAD_MAX_BYTES, SEND_CHUNK, SEND_DEADLINE, SendDeadline
from .idempotency import (
    DEFAULT_IDEMPOTENCY_MAX_BYTES,
    DEFAULT_IDEMPOTENCY_TTL_S,
    IdempotencyStore,
    StoredResponse,
    body_digest,
    check_key,
)
from .images import (
    IGNORED_FIELDS_HEADER,
    ApiError,
    ImageStore,
    ParsedRequest,
    ServeLimits,
    encode_b64,
    encode_image,
    error_body,
    image_size,
    images_response,
    parse_generation_request,
)
from .jobs import DEFAULT_JOB_MAX_BYTES, DEFAULT_JOB_TTL_S, Job, JobStore
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import ServeMetrics
from .multipart import MultipartError, boundary_of, parse_form
from .pool import (
    DrainingError,
    EnginePool,
    NotReadyError,
    QueueFullError,
    QueueWaitError,
    Submission,
    clamp_retry_after,
)
from .pool import new_request_id as _new_request_id
from .profiling import PROFILE_PATHS, ProfileAdmin
from .sleeping import SLEEP_PATH, SLEEP_PATHS, SleepAdmin
from .webhooks import PROGRESS_INTERVAL_S, WebhookSender, check_webhook_url

__all__ = [
    "RESPONSE_BYTES_PER_IMAGE",
    "RESPONSE_BYTES_PER_PIXEL",
    "ImagesApp",
    "Receive",
    "Reservation",
    "ResponseBytes",
    "Scope",
    "Send",
    "NO_USAGE",
    "is_openai_sdk",
    "is_valid_request_id",
    "logger_sink",
]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
AccessLog = Callable[[dict[str, Any]], None]

_log = logging.getLogger(__name__)
_access_log = logging.getLogger("omni_trio.serve.access")

# DELETE /v1/jobs/{id} waits this long for the aborted job to end before answering.
JOB_CANCEL_WAIT_S = 5.0
# A job's event stream sends a comment after this long without an event.
JOB_KEEPALIVE_S = 15.0
# After answering without reading the whole body (413, 401...), the rest is read and
# discarded for at most this long / this many bytes so the client, still sending, can read
# the answer; then the connection is closed.
LINGER_S = 2.0
LINGER_MAX_BYTES = 64 * 1024 * 1024
DISCONNECTED_STATUS = 499  # logs and metrics only: nobody reads it
# A generation's answer, estimated at admission: 3 bytes of RGB per pixel, as PNG (about the
# raw size at worst: noise does not compress) in base64 (x 4/3), plus headers and JSON or SSE
# framing per image.
RESPONSE_BYTES_PER_PIXEL = 4
RESPONSE_BYTES_PER_IMAGE = 4096
# Uploads decoded at once: each holds a picture's pixels (up to max_upload_pixels x 4 bytes)
# beside its body while it is decoded; the others wait their turn.
UPLOAD_DECODERS = 2
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# Engine parameter names -> API field names, for errors the engine's validation raises.
_ENGINE_PARAMS = {
    "height": "size",
    "width": "size",
    "num_outputs_per_prompt": "n",
    "request_id": "X-Request-Id",
    "sampling": None,
    "extra_args": None,
}


def is_valid_request_id(value: str) -> bool:
    """A client-chosen ``X-Request-Id``: 1..128 characters of ``[A-Za-z0-9._:-]``."""
    return _REQUEST_ID.fullmatch(value) is not None


# What writing to a client's connection raises when the connection is in trouble (the
# client closed or reset it while we answered, or the HTTP server's own writer was busy
# answering it): not a failure of the request.
_TRANSPORT_ERRORS = (
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    trio.BusyResourceError,
    ConnectionError,
)


def _log_safe(text: str) -> str:
    """``text`` with every non-printable character escaped (``\\n``, ``\\x1b``...): a
    client's percent-encoded newline must not start a forged line in a text log."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class _Disconnected(Exception):
    """The client went away before we could answer."""


class _SendTimedOut(Exception):
    """The client did not take what we sent within the send timeout.  ``counted``: the HTTP
    server already counted and logged the drop (it owns the deadline)."""

    def __init__(self, message: str, *, counted: bool) -> None:
        super().__init__(message)
        self.counted = counted


class ResponseBytes:
    """Bytes of responses the server holds for their clients: reserved for generations at
    admission (:meth:`reserve`), built and not yet written (:meth:`hold`).  What clients that
    read slowly (or not at all) and generations in flight make the server hold is bounded by
    ``limit``: whoever asks :meth:`fits` first.  Single-threaded (the app's trio thread).

    Invariant: ``in_flight`` is the sum of what every open hold and reservation counts.
    """

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"max_response_bytes_in_flight must be >= 1, got {limit!r}")
        self.limit = limit
        self.in_flight = 0

    def fits(self, size: int) -> bool:
        """Whether ``size`` more bytes stay within the limit.  With nothing held anything
        fits, so an answer larger than the whole limit waits for a quiet moment instead of
        being refused for ever."""
        return self.in_flight == 0 or self.in_flight + size <= self.limit

    @contextmanager
    def hold(self, size: int) -> Iterator[None]:
        """Count ``size`` bytes while the block runs."""
        self.in_flight += size
        try:
            yield
        finally:
            self.in_flight -= size

    def reserve(self, size: int) -> Reservation:
        """Count ``size`` bytes (an estimate) until the returned reservation is released."""
        return Reservation(self, size)


class Reservation:
    """The bytes counted for one generation's answer from admission to its end: the estimate
    made at admission, or what the answer really holds (:meth:`hold`) when that is more.
    A context manager; leaving it (or :meth:`release`) stops counting (idempotent)."""

    def __init__(self, owner: ResponseBytes, size: int) -> None:
        self._owner = owner
        self.estimate = size
        self._held = 0
        self._counted = 0
        self._released = False
        self._recount()

    @property
    def counted(self) -> int:
        return self._counted

    def _recount(self) -> None:
        now = 0 if self._released else max(self.estimate, self._held)
        self._owner.in_flight += now - self._counted
        self._counted = now

    @contextmanager
    def hold(self, size: int) -> Iterator[None]:
        """The answer holds ``size`` bytes while the block runs."""
        self._held += size
        self._recount()
        try:
            yield
        finally:
            self._held -= size
            self._recount()

    def release(self) -> None:
        self._released = True
        self._recount()

    def __enter__(self) -> Reservation:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


@dataclass(eq=False)
class _Exchange:
    """One HTTP request being answered: its identity, and what the log line and metrics
    need once it ends."""

    method: str
    path: str
    headers: dict[str, list[str]]
    request_id: str
    client: str | None
    http1: bool = True  # "Connection: close" exists only in HTTP/1
    owner: str = ""  # who may see and cancel the generations it makes ("": anonymous)
    start: float = field(default_factory=time.perf_counter)
    route: str = "unknown"
    status: int = 0
    outcome: str = "ok"
    started: bool = False  # the response headers went out
    sse: bool = False  # the response is an event stream
    body_complete: bool = False  # the request body was read to its end
    response_headers: list[tuple[str, str]] = field(default_factory=list)
    detail: str | None = None  # for the log only, never for the client
    submitted: bool = False  # a generation was admitted (it ran, or was meant to)
    answer: bytes | None = None  # a generation's 200 JSON body (kept for Idempotency-Key)

    def header(self, name: str) -> str | None:
        values = self.headers.get(name)
        return values[0] if values else None


def _retry_after(seconds: int) -> list[tuple[str, str]]:
    return [("Retry-After", str(seconds))]


# The official OpenAI clients retry 5xx (and 408/409/429) unless told not to: a failure that
# will recur says so.
_NO_RETRY = (("x-should-retry", "false"),)


def _unavailable(message: str, code: str, retry_after_s: int) -> ApiError:
    return ApiError(
        503, message, type="server_error", code=code, headers=_retry_after(retry_after_s)
    )


def _server_url(scope: Scope) -> str:
    """``scheme://address:port`` of the local end of the connection (our bound address as
    the client reached it), never the client-controlled ``Host`` header."""
    scheme = scope.get("scheme", "http")
    server = scope.get("server")
    if server and server[0]:
        host = str(server[0])
        if ":" in host:
            host = f"[{host}]"
        return f"{scheme}://{host}" + (f":{server[1]}" if server[1] is not None else "")
    return f"{scheme}://localhost"


def _partial_targets(previews: int, wanted: int) -> set[int]:
    """Which of ``previews`` preview chunks to send when ``wanted`` partial images are asked:
    evenly spaced, ending at the last preview."""
    if previews <= 0 or wanted <= 0:
        return set()
    if wanted >= previews:
        return set(range(previews))
    return {math.ceil((i + 1) * previews / wanted) - 1 for i in range(wanted)}


# The ``usage`` of a completed stream event (the SDK's type requires one): a diffusion model
# counts no tokens, so every count is 0.
NO_USAGE: dict[str, Any] = {
    "input_tokens": 0,
    "input_tokens_details": {"image_tokens": 0, "text_tokens": 0},
    "output_tokens": 0,
    "total_tokens": 0,
}


def is_openai_sdk(headers: Mapping[str, Sequence[str]]) -> bool:
    """Whether a request comes from an official OpenAI SDK (lower-case header names): the
    generated SDKs send ``X-Stainless-*`` headers and a ``User-Agent`` of ``OpenAI/...``."""
    if any(name.startswith("x-stainless-") for name in headers):
        return True
    return any(agent.lower().startswith("openai/") for agent in headers.get("user-agent", ()))


class ImagesApp:
    """The ASGI app (see the module docstring).  Serve it with hypercorn's trio worker in
    the same trio run as ``pool.serve``.

    ``public_url`` (``scheme://host[:port][/prefix]``) is put in front of file URLs
    (default: the address the client connected to).  ``api_key`` and ``api_keys`` are the
    accepted keys (none: no auth).  ``body_read_timeout_s``, ``send_timeout_s`` and
    ``max_response_bytes_in_flight`` bound slow clients (module docstring).

    ``log(record)`` receives one dict per request: ``request_id``, ``method``, ``path``,
    ``route``, ``status``, ``outcome`` (``ok``, ``rejected``, ``error``, ``cancelled``,
    ``timeout``, ``disconnected``, ``aborted``, ``send_failed``: the answer's status was
    chosen but writing it failed, ``send_timeout``: the client stopped taking it), ``ms``,
    ``client``, ``owner`` (a tag of the key or client token, when there is one) and, for
    failures, ``detail`` (server-side only).  ``log`` may also be a :class:`logging.Logger`
    (default: ``omni_trio.serve.access``): one line per request (INFO; WARNING for 5xx but
    a not-ready ``/ready``, which is DEBUG: probes repeat it, the daemon logs the change
    once) with the record's fields as ``extra``.
    """

    def __init__(
        self,
        pool: EnginePool,
        *,
        model_name: str,
        limits: ServeLimits,
        api_key: str | None,
        store: ImageStore,
        metrics: ServeMetrics,
        api_keys: Sequence[str] = (),
        priority_ranges: Mapping[str, tuple[int, int]] | None = None,
        idempotency_ttl_s: float = DEFAULT_IDEMPOTENCY_TTL_S,
        idempotency_max_bytes: int = DEFAULT_IDEMPOTENCY_MAX_BYTES,
        public_url: str | None = None,
        body_read_timeout_s: float = 30.0,
        send_timeout_s: float = 30.0,
        max_response_bytes_in_flight: int = 256 * MIB,
        log: AccessLog | logging.Logger | None = None,
        progress_interval_s: float = 0.25,
        image_metadata: bool = True,
        job_ttl_s: float = DEFAULT_JOB_TTL_S,
        job_max_bytes: int = DEFAULT_JOB_MAX_BYTES,
        webhook_secret: str | None = None,
        webhook_hosts: Sequence[str] = (),
        webhook_progress_interval_s: float | None = None,
    ) -> None:
        self.pool = pool
        self.model_name = model_name
        self.limits = limits
        keys = ([api_key] if api_key else []) + list(api_keys)
        self._api_keys = tuple(dict.fromkeys(key.encode() for key in keys))
        # Owner tags are HMACs under a per-process salt: stable while the process lives (as
        # long as its request ids), and a log line never carries anything derived from a key
        # alone.
        self._owner_salt = secrets.token_bytes(32)
        # The priorities a key may ask for, by its owner tag (the key itself is not kept).
        self._priority_ranges = {
            self._owner_of(key.encode()): bounds for key, bounds in (priority_ranges or {}).items()
        }
        self.store = store
        self.metrics = metrics
        self.idempotency = IdempotencyStore(
            ttl_s=idempotency_ttl_s, max_bytes=idempotency_max_bytes
        )
        self._public_url = public_url.rstrip("/") if public_url else None
        self.body_read_timeout_s = body_read_timeout_s
        self.send_timeout_s = send_timeout_s
        self.responses = ResponseBytes(max_response_bytes_in_flight)
        # Uploaded pictures decoded at once (/v1/images/edits, /variations).
        self._decoders = trio.CapacityLimiter(UPLOAD_DECODERS)
        metrics.response_bytes_in_flight.set_function(lambda: self.responses.in_flight)
        self._log: AccessLog = (
            log if callable(log) and not isinstance(log, logging.Logger) else logger_sink(log)
        )
        self._progress_interval_s = progress_interval_s
        # Every image carries its recipe (serve.images.image_metadata); False: none does.
        self.image_metadata = image_metadata
        self._created = int(time.time())
        self.jobs = JobStore(ttl_s=job_ttl_s, max_bytes=job_max_bytes)
        self.webhooks = (
            WebhookSender(
                webhook_secret.encode(),
                progress_interval_s=(
                    PROGRESS_INTERVAL_S
                    if webhook_progress_interval_s is None
                    else webhook_progress_interval_s
                ),
                on_delivery=metrics.observe_webhook,
            )
            if webhook_secret
            else None
        )
        self.webhook_hosts = tuple(webhook_hosts)
        # The nursery of the jobs' tasks, while serve() runs (None: jobs are refused).
        self._background: trio.Nursery | None = None
        # POST /v1/admin/start_profile and stop_profile (.profiling).
        self.profiles = ProfileAdmin(pool)
        # /v1/admin/sleep and /v1/admin/wake_up (.sleeping).
        self.sleeping = SleepAdmin(pool)

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run the app's background work -- the jobs of ``POST /v1/jobs`` and their
        webhooks -- until cancelled; ``task_status.started()`` once jobs are taken.  While
        it does not run, ``POST /v1/jobs`` is a 503.  Cancelling it ends every job still
        running: its request is aborted (as a client's disconnect aborts a generation) and
        its webhooks stop."""
        async with trio.open_nursery() as nursery:
            self._background = nursery
            try:
                task_status.started()
                await trio.sleep_forever()
            finally:
                self._background = None

    # -- ASGI entry ------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        elif kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """Nothing to set up: the pool is started by the daemon, not by the app."""
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _base_url(self, scope: Scope) -> str:
        return self._public_url or _server_url(scope)

    def _deadlined(self, scope: Scope, send: Send) -> Send:
        """``send`` under one write deadline, whose expiry raises :class:`_SendTimedOut`.

        Under the daemon's HTTP server the deadline is the server's (the scope's
        :class:`~omni_trio.serve.http.SendDeadline`): it bounds every socket write and, on
        HTTP/2, flow control, closes the connection and counts the drop; here a handler
        only learns of it, before and after each send, so it stops at once.  Under another
        ASGI server the app bounds each message itself (``send_timeout_s`` per
        :data:`SEND_CHUNK` of it) and counts the drop.  Either way a drop is counted once.
        """
        extensions = scope.get("extensions") or {}
        deadline = extensions.get(SEND_DEADLINE)
        if isinstance(deadline, SendDeadline):
            return self._watching(deadline, send)
        timeout = self.send_timeout_s

        async def bounded_send(message: MutableMapping[str, Any]) -> None:
            size = len(message.get("body", b""))
            with trio.move_on_after(timeout * (1 + size // SEND_CHUNK)) as cancel:
                await send(message)
            if cancel.cancelled_caught:
                raise _SendTimedOut(f"the client took no data for {timeout:g} s", counted=False)

        return bounded_send

    @staticmethod
    def _watching(deadline: SendDeadline, send: Send) -> Send:
        async def expired() -> None:
            # A checkpoint first: a handler task cancelled meanwhile (its sibling saw the
            # same expiry and raised) ends with Cancelled rather than a second error.
            await trio.lowlevel.checkpoint()
            raise _SendTimedOut(
                f"the client took no data for {deadline.timeout_s:g} s", counted=True
            )

        async def watched_send(message: MutableMapping[str, Any]) -> None:
            if deadline.expired:
                await expired()
            await send(message)
            if deadline.expired:
                await expired()

        return watched_send

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        send = self._deadlined(scope, send)
        headers: dict[str, list[str]] = {}
        head_bytes = len(scope.get("raw_path", b"")) + len(scope.get("query_string", b""))
        for raw_name, raw_value in scope.get("headers", ()):
            head_bytes += len(raw_name) + len(raw_value) + 4
            name = raw_name.decode("latin-1").lower()
            headers.setdefault(name, []).append(raw_value.decode("latin-1"))
        client = scope.get("client")
        ex = _Exchange(
            method=scope.get("method", "GET"),
            path=scope.get("path", "/"),
            headers=headers,
            request_id=_new_request_id(),
            client=f"{client[0]}:{client[1]}" if client else None,
            http1=str(scope.get("http_version", "1.1")).startswith("1"),
        )
        # HTTP/1.1: a request with neither header has no body (nothing to read or discard).
        lengths = headers.get("content-length", [])
        ex.body_complete = "transfer-encoding" not in headers and lengths in ([], ["0"])
        try:
            try:
                if head_bytes > HEAD_MAX_BYTES:
                    raise ApiError(
                        431,
                        f"the request line and headers exceed {HEAD_MAX_BYTES} bytes",
                        code="request_header_fields_too_large",
                    )
                await self._dispatch(ex, scope, receive, send)
            except ApiError as err:
                await self._send_error(ex, send, err)
            except _Disconnected:
                ex.status, ex.outcome = DISCONNECTED_STATUS, "disconnected"
            if not ex.body_complete and ex.status != DISCONNECTED_STATUS:
                await self._discard_body(ex, receive)
        except _SendTimedOut as exc:
            ex.detail = str(exc)
            ex.outcome = "send_timeout"
            if not ex.started:
                ex.status = DISCONNECTED_STATUS
            if not exc.counted:  # the HTTP server counted and logged its own drops
                self.metrics.observe_slow_client("send_timeout")
                _log.info("request %s: %s; dropped", ex.request_id, exc)
        except Exception as exc:
            ex.detail = f"{type(exc).__name__}: {exc}"
            if ex.started and isinstance(exc, _TRANSPORT_ERRORS):
                # The answer (its status already chosen) could not be written out: the
                # connection's trouble, not a server error.  Keep the status; no traceback.
                ex.outcome = "send_failed"
                _log.info("request %s: sending the answer failed: %r", ex.request_id, exc)
            else:
                _log.exception(
                    "request %s (%s %s) failed", ex.request_id, ex.method, _log_safe(ex.path)
                )
                await self._answer_internal_error(ex, send)
        finally:
            self._finish(ex)

    def _finish(self, ex: _Exchange) -> None:
        if ex.outcome == "ok" and ex.status >= 400:
            ex.outcome = "rejected" if ex.status < 500 else "error"
        record = {
            "request_id": ex.request_id,
            "method": ex.method,
            "path": _log_safe(ex.path),
            "route": ex.route,
            "status": ex.status,
            "outcome": ex.outcome,
            "ms": round((time.perf_counter() - ex.start) * 1000.0, 3),
            "client": ex.client,
        }
        if ex.owner:
            record["owner"] = ex.owner
        if ex.detail is not None:
            record["detail"] = ex.detail
        try:
            self.metrics.observe_request(ex.route, ex.status)
            self._log(record)
        except Exception:  # pragma: no cover - a broken logger must not break serving
            _log.exception("access log failed for %s", ex.request_id)

    # -- routing ---------------------------------------------------------------------------

    async def _dispatch(self, ex: _Exchange, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = ex.path, ex.method
        ids = ex.headers.get("x-request-id")
        bad_id = False
        if ids is not None:
            if len(ids) == 1 and is_valid_request_id(ids[0]):
                ex.request_id = ids[0]
            else:
                bad_id = path.startswith("/v1/")  # probes and scrapes are never refused
        if "content-length" in ex.headers and "transfer-encoding" in ex.headers:
            # RFC 9112 6.3: a request smuggling vector behind a proxy that reads the other one.
            raise ApiError(
                400,
                "a request must not carry both Content-Length and Transfer-Encoding",
                code="invalid_request",
            )
        if path.startswith("/v1/") or path == "/metrics":
            self._authenticate(ex)
            ex.owner = self._owner(ex)
        if bad_id:
            raise ApiError(
                400,
                "X-Request-Id must be 1..128 characters of [A-Za-z0-9._:-], given once",
                param="X-Request-Id",
                code="invalid_request_id",
            )

        if path == "/v1/images/generations":
            ex.route = path
            self._allow(ex, "POST")
            await self._generate(ex, receive, send, self._base_url(scope))
        elif path in ("/v1/images/edits", "/v1/images/variations"):
            ex.route = path
            self._allow(ex, "POST")
            await self._edit(
                ex, receive, send, self._base_url(scope), variation=path.endswith("variations")
            )
        elif path.startswith("/v1/requests/") and path.count("/") == 3:
            ex.route = "/v1/requests/{id}"
            self._allow(ex, "GET", "DELETE")
            if ex.method == "GET":
                await self._request_status(ex, send, path.rsplit("/", 1)[1])
            else:
                await self._cancel(ex, send, path.rsplit("/", 1)[1])
        elif path == "/v1/jobs":
            ex.route = path
            self._allow(ex, "POST")
            await self._create_job(ex, receive, send, self._base_url(scope))
        elif path.startswith("/v1/jobs/") and path.count("/") == 3:
            ex.route = "/v1/jobs/{id}"
            self._allow(ex, "GET", "DELETE")
            if ex.method == "GET":
                await self._job_status(ex, send, path.rsplit("/", 1)[1])
            else:
                await self._cancel_job(ex, send, path.rsplit("/", 1)[1])
        elif path.startswith("/v1/jobs/") and path.endswith("/events") and path.count("/") == 4:
            ex.route = "/v1/jobs/{id}/events"
            self._allow(ex, "GET")
            await self._job_events(ex, receive, send, path.split("/")[3])
        elif path.startswith("/v1/files/") and path.endswith("/content") and path.count("/") == 4:
            ex.route = "/v1/files/{id}/content"
            self._allow(ex, "GET")
            await self._file(ex, send, path.split("/")[3])
        elif path == "/v1/models":
            ex.route = path
            self._allow(ex, "GET")
            await self._models(ex, send)
        elif path in SLEEP_PATHS:
            ex.route = path
            if path == SLEEP_PATH:
                self._allow(ex, "GET", "POST")
            else:
                self._allow(ex, "POST")
            if ex.method == "GET":
                answer = self.sleeping.state()
            else:
                body = await self._read_body(ex, receive)
                handle = self.sleeping.sleep if path == SLEEP_PATH else self.sleeping.wake_up
                answer = await handle(ex.header("content-type"), body)
            await self._send_json(ex, send, 200, answer)
        elif path in PROFILE_PATHS:
            ex.route = path
            self._allow(ex, "POST")
            body = await self._read_body(ex, receive)
            answer = await self.profiles.answer(path, ex.header("content-type"), body)
            await self._send_json(ex, send, 200, answer)
        elif path == "/openapi.json":
            ex.route = path
            self._allow(ex, "GET")
            document = openapi_document(self.limits, self.model_name)
            await self._send_json(ex, send, 200, document)
        elif path == "/health":
            ex.route = path
            self._allow(ex, "GET")
            await self._send_json(ex, send, 200, {"status": "ok"})
        elif path == "/ready":
            ex.route = path
            self._allow(ex, "GET")
            await self._ready(ex, send)
        elif path == "/metrics":
            ex.route = path
            self._allow(ex, "GET")
            await self._send_bytes(ex, send, 200, self.metrics.render(), METRICS_CONTENT_TYPE)
        else:
            raise ApiError(404, f"Invalid URL ({method} {path})", code="unknown_url")

    def _allow(self, ex: _Exchange, *methods: str) -> None:
        if ex.method not in methods:
            allowed = ", ".join(methods)
            raise ApiError(
                405,
                f"Method {ex.method} is not allowed for {ex.route}; use {' or '.join(methods)}",
                code="method_not_allowed",
                headers=[("Allow", allowed)],
            )

    def _given_key(self, ex: _Exchange) -> bytes:
        values = ex.headers.get("authorization") or []
        if len(values) == 1:
            scheme, _, token = values[0].partition(" ")
            if scheme.lower() == "bearer":
                return token.strip().encode("latin-1")
        return b""

    def _key_matches(self, given: bytes) -> bool:
        # Every key is compared (constant time each), so the time says nothing of which.
        matches = [hmac.compare_digest(given, key) for key in self._api_keys]
        return bool(given) and any(matches)

    def _authenticated(self, ex: _Exchange) -> bool:
        """No key is configured, or the request carries one."""
        return not self._api_keys or self._key_matches(self._given_key(ex))

    def _owner(self, ex: _Exchange) -> str:
        """The owner tag of what this request makes or may touch: an HMAC of the bearer
        token it sent (the API key it authenticated with; without keys, its client token),
        or ``""`` (anonymous) without one."""
        given = self._given_key(ex)
        return self._owner_of(given) if given else ""

    def _owner_of(self, token: bytes) -> str:
        return hmac.new(self._owner_salt, token, hashlib.sha256).hexdigest()[:16]

    @staticmethod
    def _keeps_answers(ex: _Exchange) -> bool:
        return ex.header("idempotency-key") is not None

    def _check_priority(self, ex: _Exchange, parsed: ParsedRequest) -> None:
        """A key with a configured priority range may ask only for priorities within it
        (400 ``priority_not_allowed``); every other request meets the engine's range."""
        bounds = self._priority_ranges.get(ex.owner)
        if bounds is None:
            return
        priority = parsed.params.priority
        if not bounds[0] <= priority <= bounds[1]:
            raise ApiError(
                400,
                f"priority {priority} is not allowed for this API key "
                f"(allowed: {bounds[0]}..{bounds[1]})",
                param="priority",
                code="priority_not_allowed",
                headers=_NO_RETRY,
            )

    def _authenticate(self, ex: _Exchange) -> None:
        if not self._api_keys:
            return
        given = self._given_key(ex)
        if not self._key_matches(given):
            message = (
                "Incorrect API key provided"
                if given
                else "Missing API key: send 'Authorization: Bearer <key>'"
            )
            raise ApiError(
                401, message, code="invalid_api_key", headers=[("WWW-Authenticate", "Bearer")]
            )

    # -- small routes ----------------------------------------------------------------------

    async def _models(self, ex: _Exchange, send: Send) -> None:
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self._created,
            "owned_by": "omni-trio",
        }
        # The LoRA adapters requests may name (--lora), as models of the served one.
        adapters = [
            {
                "id": name,
                "object": "model",
                "created": self._created,
                "owned_by": "omni-trio",
                "parent": self.model_name,
            }
            for name in sorted(self.pool.engine_config.loras)
        ]
        await self._send_json(ex, send, 200, {"object": "list", "data": [model, *adapters]})

    async def _ready(self, ex: _Exchange, send: Send) -> None:
        """Readiness.  The details (each replica's state, pids, counts, the last failure's
        text) only for a caller with the API key, when one is set: probes need the status,
        not the internals."""
        ready, reason = self.pool.readiness()
        detailed = self._authenticated(ex)
        if not ready:
            if not detailed:  # "replica 0: restarting (last failure: ...)" -> "restarting"
                words = [w.strip(":(") for w in (reason or "").split()]
                known = (
                    "starting",
                    "restarting",
                    "sleeping",
                    "draining",
                    "failed",
                    "dead",
                    "closed",
                )
                reason = next((w for w in words if w in known), "unavailable")
            raise _unavailable(
                f"not ready: {reason}", "not_ready", self.pool.unavailable_retry_after_s()
            )
        body: dict[str, Any] = {"status": "ready"}
        if detailed:
            body["replicas"] = self.pool.replicas_info()
        await self._send_json(ex, send, 200, body)

    def _not_found(self, request_id: str) -> ApiError:
        # The same answer for an id that never existed and for another owner's: ids do not
        # leak across keys.
        return ApiError(
            404, f"No request with id {request_id!r}", param="id", code="request_not_found"
        )

    async def _request_status(self, ex: _Exchange, send: Send, request_id: str) -> None:
        status = self.pool.status(request_id, owner=ex.owner)
        if status is None:
            raise self._not_found(request_id)
        progress = self.pool.progress(request_id, owner=ex.owner) if status == "running" else None
        body = {
            "id": request_id,
            "object": "request",
            "status": status,
            "progress": {"step": progress[0], "total": progress[1]} if progress else None,
        }
        await self._send_json(ex, send, 200, body)

    async def _cancel(self, ex: _Exchange, send: Send, request_id: str) -> None:
        outcome = self.pool.abort(request_id, owner=ex.owner)
        if outcome == "unknown":
            raise self._not_found(request_id)
        if outcome == "finished":
            raise ApiError(
                409,
                f"Request {request_id!r} already finished",
                param="id",
                code="request_finished",
                headers=_NO_RETRY,
            )
        await self._send_json(
            ex, send, 200, {"id": request_id, "object": "request", "status": "cancelled"}
        )

    # -- jobs ------------------------------------------------------------------------------

    def _job_not_found(self, job_id: str) -> ApiError:
        return ApiError(
            404, f"No job with id {job_id!r} (unknown or expired)", param="id", code="job_not_found"
        )

    def _job_body(self, job: Job) -> dict[str, Any]:
        """The job now: what its task recorded, brought up to date with the engine (the
        task records only every tick)."""
        position = None
        if not job.finished:
            status = self.pool.status(job.id, owner=job.owner)
            if status == "running":
                progress = self.pool.progress(job.id, owner=job.owner)
                self.jobs.running(job)
                if progress is not None:
                    self.jobs.progressed(job, *progress)
            elif status == "queued" and job.status == "queued":
                position = self.pool.queue_position(job.id, owner=job.owner)
        return job.body(position)

    async def _create_job(self, ex: _Exchange, receive: Receive, send: Send, base_url: str) -> None:
        """``POST /v1/jobs``: admit the generation now (every refusal the generations
        endpoint makes, made here at once), answer 202 with the job, and run it in the
        background (:meth:`_run_job`).  ``webhook_url`` (an extension field) asks for
        webhooks; ``stream`` is refused (a job's events are ``/v1/jobs/{id}/events``)."""
        content_type = (ex.header("content-type") or "").split(";", 1)[0].strip().lower()
        if content_type != "application/json":
            raise ApiError(
                415,
                "Content-Type must be application/json",
                param="Content-Type",
                code="unsupported_media_type",
            )
        body = await self._read_body(ex, receive)
        try:
            decoded = json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise ApiError(
                400,
                f"the request body is not valid JSON ({type(exc).__name__})",
                code="invalid_json",
            )
        webhook_url = decoded.pop("webhook_url", None) if isinstance(decoded, dict) else None
        if isinstance(decoded, dict) and decoded.get("stream"):
            raise ApiError(
                400,
                "a job does not stream its answer: follow GET /v1/jobs/{id}/events instead",
                param="stream",
                code="invalid_value",
            )
        parsed = parse_generation_request(
            decoded,
            limits=self.limits,
            default_model=self.model_name,
            adapters=self.pool.engine_config.loras,
        )
        if parsed.ignored_fields:
            ex.response_headers.append((IGNORED_FIELDS_HEADER, ",".join(parsed.ignored_fields)))
        if webhook_url is not None:
            if self.webhooks is None:
                raise ApiError(
                    400,
                    "this server sends no webhooks (start it with --webhook-secret)",
                    param="webhook_url",
                    code="webhooks_disabled",
                )
            problem = check_webhook_url(webhook_url, self.webhook_hosts)
            if problem is not None:
                raise ApiError(400, problem, param="webhook_url", code="invalid_webhook_url")
        key = ex.header("idempotency-key")
        digest = None
        if key is not None:
            problem = check_key(key)
            if problem is not None:
                raise ApiError(
                    400, problem, param="Idempotency-Key", code="invalid_idempotency_key"
                )
            digest = body_digest(json.loads(body))
            found = self.jobs.by_key(ex.owner, key)
            if found is not None:
                if found[0] != digest:
                    raise ApiError(
                        422,
                        "this Idempotency-Key was used with another request body; use a new "
                        "key for a new job",
                        param="Idempotency-Key",
                        code="idempotency_key_reused",
                        headers=_NO_RETRY,
                    )
                ex.outcome = "replayed"
                job = found[1]
                await self._send_json(
                    ex,
                    send,
                    200,
                    self._job_body(job),
                    extra=(("Location", f"/v1/jobs/{job.id}"), ("Idempotent-Replayed", "true")),
                )
                return
        nursery = self._background
        if nursery is None:
            # Its jobs run only while serve() does: it is starting or going away.
            raise _unavailable(
                "this server runs no jobs right now",
                "jobs_unavailable",
                self.pool.unavailable_retry_after_s(),
            )
        if self.jobs.get(ex.owner, ex.request_id) is not None:
            raise ApiError(
                409,
                f"a job with id {ex.request_id!r} exists",
                param="X-Request-Id",
                code="duplicate_request_id",
                headers=_NO_RETRY,
            )
        estimate = self._response_estimate(parsed)
        if not self.responses.fits(estimate):
            raise self._memory_full()
        reservation = self.responses.reserve(estimate)
        try:
            submission = self._submit(ex, parsed)
        except BaseException:
            reservation.release()
            raise
        ex.submitted = True
        self.metrics.observe_admission(ex.route, time.perf_counter() - ex.start)
        job = self.jobs.create(
            ex.owner, ex.request_id, webhook_url=webhook_url, key=key, digest=digest
        )
        # No checkpoint since the admission: the task owns the request from here on.
        nursery.start_soon(self._run_job, job, submission, parsed, reservation, base_url)
        if job.webhook_url is not None and self.webhooks is not None:
            nursery.start_soon(self.webhooks.follow, job, job.webhook_url)
        await self._send_json(
            ex, send, 202, self._job_body(job), extra=(("Location", f"/v1/jobs/{job.id}"),)
        )

    async def _run_job(
        self,
        job: Job,
        submission: Submission,
        parsed: ParsedRequest,
        reservation: Reservation,
        base_url: str,
    ) -> None:
        """Follow a job's request to its end and record it: progress on every tick and
        preview, then ``completed`` with the generations answer, ``cancelled``, or ``failed``
        with the error the generations endpoint would have answered.  Cancelled (the app
        stops), the request is aborted and the job stays as it was."""
        ex = _Exchange(method="POST", path="/v1/jobs", headers={}, request_id=job.id, client=None)
        ex.owner, ex.route, ex.submitted = job.owner, "job", True
        store = self.jobs

        async def never() -> MutableMapping[str, Any]:
            await trio.sleep_forever()
            raise AssertionError("unreachable")  # pragma: no cover

        async def on_tick() -> None:
            status = self.pool.status(job.id, owner=job.owner)
            if status == "running":
                store.running(job)
                progress = self.pool.progress(job.id, owner=job.owner)
                if progress is not None:
                    store.progressed(job, *progress)

        async def on_chunk(output: DiffusionOutput) -> None:
            store.progressed(job, output.chunk_index + 1, output.total_chunks)

        with reservation:
            async with submission.stream:
                err: ApiError | None = None
                try:
                    final = await self._follow(ex, submission, parsed, never, on_chunk, on_tick)
                    if final is None:  # its timeout
                        err = self._timeout_error(ex, parsed)
                    elif final.status is not RequestStatus.FINISHED_COMPLETED:
                        err = self._terminal_error(ex, final, submission)
                    else:
                        encoded = await self._encode_all(final.images, parsed, final.seed)
                        with reservation.hold(sum(len(blob) for blob in encoded)):
                            result = self._images_body(ex, final, parsed, base_url, encoded)
                            if job.progress is None:  # too quick for any tick
                                total = parsed.params.total_steps
                                store.progressed(job, total, total)
                            store.finish(job, "completed", result=result)
                            del result
                        ex.status = 200
                except Exception as exc:
                    _log.exception("job %s failed", job.id)
                    ex.detail = f"{type(exc).__name__}: {exc}"
                    err = ApiError(
                        500,
                        f"job {job.id} failed inside the server",
                        type="server_error",
                        code="internal_error",
                    )
                if err is not None:
                    ex.status = err.status
                    if err.code == "request_cancelled":
                        store.finish(job, "cancelled")
                    else:
                        store.finish(
                            job, "failed", error=err.body()["error"], http_status=err.status
                        )
                self.metrics.observe_job(job.status)
                self._finish(ex)

    async def _job_status(self, ex: _Exchange, send: Send, job_id: str) -> None:
        job = self.jobs.get(ex.owner, job_id)
        if job is None:
            raise self._job_not_found(job_id)
        if job.final is not None:
            if not self.responses.fits(len(job.final)):
                raise self._memory_full()
            await self._send_bytes(ex, send, 200, job.final, "application/json")
            return
        await self._send_json(ex, send, 200, self._job_body(job))

    async def _cancel_job(self, ex: _Exchange, send: Send, job_id: str) -> None:
        """``DELETE /v1/jobs/{id}``: abort a queued or running job and answer once it
        ended (at most :data:`JOB_CANCEL_WAIT_S`): ``cancelled`` is whether the job ends
        cancelled -- by this call or an earlier one (idempotent) -- not completed or
        failed first."""
        job = self.jobs.get(ex.owner, job_id)
        if job is None:
            raise self._job_not_found(job_id)
        if not job.finished:
            self.pool.abort(job.id, owner=job.owner, reason="cancelled")
            with trio.move_on_after(JOB_CANCEL_WAIT_S):
                while not job.finished:
                    await job.changed.wait()
        cancelled = job.status == "cancelled" or not job.finished
        body = {"id": job.id, "object": "job", "cancelled": cancelled, "status": job.status}
        await self._send_json(ex, send, 200, body)

    async def _job_events(self, ex: _Exchange, receive: Receive, send: Send, job_id: str) -> None:
        """``GET /v1/jobs/{id}/events``: the job's events after ``Last-Event-ID`` (all of
        them without it) from its buffer, then each new one as it comes, until its terminal
        event went out; a comment every :data:`JOB_KEEPALIVE_S` keeps idle proxies open.
        Events that fell out of the buffer are told by a ``: <n> events dropped`` comment."""
        job = self.jobs.get(ex.owner, job_id)
        if job is None:
            raise self._job_not_found(job_id)
        given = ex.header("last-event-id")
        last = 0
        if given is not None:
            if not given.strip().isdigit() or len(given) > 20:
                raise ApiError(
                    400,
                    f"Last-Event-ID must be an event number of this job, got {given!r}",
                    param="Last-Event-ID",
                    code="invalid_last_event_id",
                )
            last = int(given)
        ex.sse = True
        await self._start(ex, send, 200, "text/event-stream", cache="no-cache")

        async def watch_disconnect(scope: trio.CancelScope) -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            ex.status, ex.outcome = DISCONNECTED_STATUS, "disconnected"
            scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_disconnect, nursery.cancel_scope)
            while True:
                changed = job.changed
                events = job.events_after(last)
                if events and events[0].id > last + 1:
                    note = f": {events[0].id - last - 1} events dropped\n\n".encode()
                    await _send_body(send, note, more_body=True)
                for event in events:
                    frame = event.sse()
                    with self.responses.hold(len(frame)):
                        await _send_body(send, frame, more_body=True)
                    del frame
                    last = event.id
                if job.finished and last >= job.last_event_id:
                    break
                with trio.move_on_after(JOB_KEEPALIVE_S) as idle:
                    await changed.wait()
                if idle.cancelled_caught:
                    await _send_body(send, b": keep-alive\n\n", more_body=True)
            nursery.cancel_scope.cancel()
        if ex.outcome != "disconnected":
            await self._end(send)

    async def _file(self, ex: _Exchange, send: Send, file_id: str) -> None:
        found = self.store.get(file_id)
        if found is None:
            raise ApiError(
                404, f"No file with id {file_id!r} (unknown or expired)", code="file_not_found"
            )
        data, content_type = found
        if not self.responses.fits(len(data)):
            raise self._memory_full()
        await self._send_bytes(ex, send, 200, data, content_type, cache="private, max-age=60")

    def _memory_full(self) -> ApiError:
        return ApiError(
            429,
            f"the server holds {self.responses.in_flight} bytes of responses not yet taken by "
            f"their clients (max_response_bytes_in_flight={self.responses.limit}); retry later",
            type="rate_limit_error",
            code="response_memory_full",
            # Responses are taken as requests complete: one service time.
            headers=_retry_after(self.pool.retry_after_s(excess=1)),
        )

    def _response_estimate(self, parsed: ParsedRequest) -> int:
        """The bytes a generation's answer will hold, estimated at admission (module
        docstring).  A size left unset is the served model's default size, or while no
        replica is open the largest size allowed."""
        width, height = parsed.params.width, parsed.params.height
        if width is None or height is None:
            default = self.pool.default_size()
            if default is not None:
                width = default[0] if width is None else width
                height = default[1] if height is None else height
        pixels = width * height if width is not None and height is not None else None
        if pixels is None:
            pixels = self.limits.max_pixels
        answer = parsed.n * (pixels * RESPONSE_BYTES_PER_PIXEL + RESPONSE_BYTES_PER_IMAGE)
        held = 0  # an edit's decoded picture (RGB) and mask (L), held until it ends
        for picture, channels in ((parsed.params.image, 3), (parsed.params.mask_image, 1)):
            if picture is not None:
                held += picture.size[0] * picture.size[1] * channels
        return answer + held

    # -- generation ------------------------------------------------------------------------

    async def _read_body(
        self, ex: _Exchange, receive: Receive, *, limit: int | None = None
    ) -> bytes:
        """The request body, refused (413) past ``limit`` (default ``max_body_bytes``) -- by
        Content-Length before reading anything, else as soon as the count passes the cap --
        and (408) when all of it has not arrived within ``body_read_timeout_s``."""
        with trio.move_on_after(self.body_read_timeout_s):
            return await self._read_body_now(ex, receive, limit or self.limits.max_body_bytes)
        self.metrics.observe_slow_client("body_timeout")
        raise ApiError(
            408,
            f"the request body did not arrive within {self.body_read_timeout_s:g} s",
            code="request_timeout",
        )

    async def _read_body_now(self, ex: _Exchange, receive: Receive, limit: int) -> bytes:
        declared = ex.header("content-length")
        if declared is not None:
            if not declared.isdigit() or len(ex.headers["content-length"]) != 1:
                raise ApiError(400, "invalid Content-Length header", code="invalid_request")
            if int(declared) > limit:
                raise ApiError(
                    413,
                    f"request body of {declared} bytes exceeds the limit of {limit} bytes",
                    code="request_too_large",
                )
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                ex.body_complete = True
                raise _Disconnected()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise ApiError(
                    413,
                    f"request body exceeds the limit of {limit} bytes",
                    code="request_too_large",
                )
            chunks.append(chunk)
            if not message.get("more_body", False):
                ex.body_complete = True
                return b"".join(chunks)

    async def _discard_body(self, ex: _Exchange, receive: Receive) -> None:
        """Read and drop what is left of the body (bounded), so a client still sending it
        can read our answer."""
        discarded = 0
        with trio.move_on_after(LINGER_S):
            while discarded <= LINGER_MAX_BYTES:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body", False):
                    break
                discarded += len(message.get("body", b""))
        ex.body_complete = True

    def _parse(self, ex: _Exchange, body: bytes) -> ParsedRequest:
        try:
            decoded = json.loads(body)
        except (ValueError, RecursionError) as exc:
            raise ApiError(
                400,
                f"the request body is not valid JSON ({type(exc).__name__})",
                code="invalid_json",
            )
        parsed = parse_generation_request(
            decoded,
            limits=self.limits,
            default_model=self.model_name,
            adapters=self.pool.engine_config.loras,
        )
        if parsed.ignored_fields:
            ex.response_headers.append((IGNORED_FIELDS_HEADER, ",".join(parsed.ignored_fields)))
        return parsed

    def _submit(self, ex: _Exchange, parsed: ParsedRequest) -> Submission:
        self._check_priority(ex, parsed)
        try:
            return self.pool.submit(
                parsed.prompt, parsed.params, request_id=ex.request_id, owner=ex.owner
            )
        except OmniTrioError as exc:
            raise self._refusal(ex, exc) from exc

    def _refusal(self, ex: _Exchange, error: OmniTrioError) -> ApiError:
        """The answer for a request refused at admission: by the pool (at submit), or by a
        stage process's engine (on the stream's first read: its state changed since the
        snapshot the pool's admission used).  Raises ``error`` again when it is not a
        refusal."""
        try:
            raise error
        except DuplicateRequestError:
            return ApiError(
                409,
                f"a request with id {ex.request_id!r} is already in flight",
                param="X-Request-Id",
                code="duplicate_request_id",
                # The SDKs retry every 409: a resend after the first ended would run it twice.
                headers=_NO_RETRY,
            )
        except InvalidRequestError as exc:
            param = _ENGINE_PARAMS.get(exc.param or "", exc.param)
            # RequestTooCostlyError says "request_too_costly"; the others are plain values.
            code = getattr(exc, "code", None) or "invalid_value"
            return ApiError(400, str(exc), param=param, code=code)
        except QueueFullError as exc:
            return ApiError(
                429,
                str(exc),
                type="rate_limit_error",
                code="queue_full",
                headers=_retry_after(exc.retry_after_s or self.pool.retry_after_s()),
            )
        except QueueWaitError as exc:
            # Come back when the queue is short enough: its excess at the measured rate.
            wait = clamp_retry_after(exc.estimate_s - exc.limit_s)
            return ApiError(
                503,
                str(exc),
                type="server_error",
                param="timeout" if exc.what == "the request's timeout" else None,
                code="queue_wait_too_long",
                headers=_retry_after(wait),
            )
        except DrainingError as exc:
            return _unavailable(str(exc), "draining", self.pool.restart_retry_after_s())
        except NotReadyError as exc:
            return _unavailable(
                f"not ready: {exc}", "not_ready", self.pool.unavailable_retry_after_s()
            )
        except EngineAsleepError as exc:
            return _unavailable(str(exc), "engine_asleep", self.pool.unavailable_retry_after_s())
        except EngineDeadError:
            return _unavailable(
                "the engine is dead; the server is restarting",
                "engine_dead",
                self.pool.restart_retry_after_s(),
            )
        except EngineClosedError:
            return _unavailable(
                "the engine is closed", "engine_closed", self.pool.restart_retry_after_s()
            )

    async def _generate(self, ex: _Exchange, receive: Receive, send: Send, base_url: str) -> None:
        content_type = (ex.header("content-type") or "").split(";", 1)[0].strip().lower()
        if content_type != "application/json":
            raise ApiError(
                415,
                "Content-Type must be application/json",
                param="Content-Type",
                code="unsupported_media_type",
            )
        body = await self._read_body(ex, receive)
        parsed = self._parse(ex, body)
        key = ex.header("idempotency-key")
        if key is None:
            await self._generate_parsed(ex, parsed, receive, send, base_url)
        else:
            digest = body_digest(json.loads(body))
            await self._generate_idempotent(ex, key, digest, parsed, receive, send, base_url)

    async def _edit(
        self, ex: _Exchange, receive: Receive, send: Send, base_url: str, *, variation: bool
    ) -> None:
        """``POST /v1/images/edits`` / ``variations`` (multipart, :mod:`.edits`): the form
        read within ``max_upload_bytes``, parsed and its pictures decoded in a thread, then
        run as a generation (idempotency, streaming, cancellation and limits alike)."""
        try:
            boundary = boundary_of(ex.header("content-type") or "")
        except MultipartError as exc:
            status = 415 if exc.code == "unsupported_media_type" else 400
            raise ApiError(status, exc.message, param="Content-Type", code=exc.code) from None
        body = await self._read_body(ex, receive, limit=self.limits.max_upload_bytes)
        limits, model = self.limits, self.model_name

        def parse(data: bytes) -> tuple[ParsedRequest, str]:
            try:
                parts = parse_form(data, boundary, max_file_bytes=limits.max_upload_bytes)
            except MultipartError as exc:
                raise ApiError(400, exc.message, param=exc.param, code=exc.code) from None
            parsed = parse_edit_form(
                parts,
                limits=limits,
                default_model=model,
                variation=variation,
                adapters=self.pool.engine_config.loras,
            )
            return parsed, form_digest(parts)

        # Decoding holds a picture's pixels beside its body: a few at a time, not one per
        # connection (the rest wait here, each within its own body timeout's worth of work).
        parsed, digest = await trio.to_thread.run_sync(parse, body, limiter=self._decoders)
        del body
        if parsed.ignored_fields:
            ex.response_headers.append((IGNORED_FIELDS_HEADER, ",".join(parsed.ignored_fields)))
        key = ex.header("idempotency-key")
        if key is None:
            await self._generate_parsed(ex, parsed, receive, send, base_url)
        else:
            await self._generate_idempotent(ex, key, digest, parsed, receive, send, base_url)

    async def _generate_idempotent(
        self,
        ex: _Exchange,
        key: str,
        digest: str,
        parsed: ParsedRequest,
        receive: Receive,
        send: Send,
        base_url: str,
    ) -> None:
        """``Idempotency-Key``: attach to the request this owner made with the key and the
        same body (wait for it if it runs, then replay its answer: result, failure or
        cancellation); 422 for the key with another body; else run it and keep its answer.
        A request that never ran, or whose client left, keeps nothing: its key is free."""
        problem = check_key(key)
        if problem is not None:
            raise ApiError(400, problem, param="Idempotency-Key", code="invalid_idempotency_key")
        store, owner = self.idempotency, ex.owner
        while (entry := store.lookup(owner, key, trio.current_time())) is not None:
            if entry.digest != digest:
                raise ApiError(
                    422,
                    "this Idempotency-Key was used with another request body; use a new key "
                    "for a new request",
                    param="Idempotency-Key",
                    code="idempotency_key_reused",
                    headers=_NO_RETRY,
                )
            if not entry.done.is_set():
                await entry.done.wait()  # the first request's own limits bound this
                continue  # ended: replay it, or (it kept nothing) run this one
            await self._replay(ex, send, entry.request_id, entry.response)
            return
        entry = store.begin(owner, key, digest, ex.request_id)
        kept: StoredResponse | None = None
        try:
            await self._generate_parsed(ex, parsed, receive, send, base_url)
            if ex.answer is not None:
                kept = StoredResponse(200, (), ex.answer)
            elif ex.sse and ex.outcome not in ("disconnected", "send_timeout"):
                kept = StoredResponse(200, (), None, "text/event-stream", stream=True)
        except ApiError as err:
            if ex.submitted:  # it ran (or was cancelled, or timed out): that is the answer
                kept = StoredResponse(err.status, err.headers, _json_bytes(err.body()))
            raise
        finally:
            if kept is not None:
                store.finish(owner, key, entry, kept, trio.current_time())
            else:
                store.forget(owner, key, entry)

    async def _replay(
        self, ex: _Exchange, send: Send, first_id: str, response: StoredResponse | None
    ) -> None:
        """Answer a resubmission with the first request's answer, marked
        ``Idempotent-Replayed: true``; what cannot be replayed is a 409 that says so."""
        ex.outcome = "replayed"
        if response is None or response.stream or response.body is None:
            why = (
                "its events were streamed and cannot be replayed"
                if response is not None and response.stream
                else "its answer is no longer kept"
            )
            raise ApiError(
                409,
                f"this Idempotency-Key belongs to request {first_id}, which ended; {why}. "
                "It is not run again: use a new key for a new request",
                param="Idempotency-Key",
                code="idempotency_key_used",
                headers=_NO_RETRY,
            )
        await self._send_bytes(
            ex,
            send,
            response.status,
            response.body,
            response.content_type,
            extra=(*response.headers, ("Idempotent-Replayed", "true")),
        )

    async def _generate_parsed(
        self, ex: _Exchange, parsed: ParsedRequest, receive: Receive, send: Send, base_url: str
    ) -> None:
        if parsed.stream and parsed.partial_images and not self.pool.streams_previews:
            raise ApiError(
                400,
                f"partial_images={parsed.partial_images} cannot be honoured: this server's "
                "engine streams no previews (start it with --streaming, which needs --mode "
                "step); send partial_images=0",
                param="partial_images",
                code="partial_images_unsupported",
            )
        if parsed.stream and parsed.partial_images:
            # A preview every preview_interval steps before the last (the engine's
            # _expected_chunks): asking for more would silently send fewer.
            steps = parsed.params.total_steps
            interval = self.pool.engine_config.preview_interval
            previews = max(steps - 1, 0) // interval
            if parsed.partial_images > previews:
                every = "each step" if interval == 1 else f"every {interval} steps"
                raise ApiError(
                    400,
                    f"partial_images={parsed.partial_images} is more than a request of {steps} "
                    f"steps can stream: it makes a preview {every} before the last, so "
                    f"partial_images can be at most {previews} for {steps} steps",
                    param="partial_images",
                    code="invalid_value",
                )
        estimate = self._response_estimate(parsed)
        if not self.responses.fits(estimate):
            raise self._memory_full()
        # The answer's bytes count from admission until it is written or the request ends.
        with self.responses.reserve(estimate) as reservation:
            submission = self._submit(ex, parsed)
            ex.submitted = True
            self.metrics.observe_admission(ex.route, time.perf_counter() - ex.start)
            # Whatever happens from here on, leaving this block ends the request and frees its
            # slot in the pool (re-entering the stream below is harmless).
            async with submission.stream:
                if parsed.stream:
                    await self._generate_events(ex, submission, parsed, receive, send, reservation)
                else:
                    await self._generate_json(
                        ex, submission, parsed, receive, send, base_url, reservation
                    )

    async def _follow(
        self,
        ex: _Exchange,
        submission: Submission,
        parsed: ParsedRequest,
        receive: Receive,
        on_chunk: Callable[[DiffusionOutput], Awaitable[None]] | None = None,
        on_tick: Callable[[], Awaitable[None]] | None = None,
    ) -> DiffusionOutput | None:
        """Read the request's stream to its terminal output, which is returned.

        Meanwhile a task watches for the client's disconnect and another calls ``on_tick``
        every ``progress_interval_s``.  A disconnect or the request's ``timeout`` stops
        reading, which aborts the request (the worker stops at its next step); then None
        is returned with ``ex.outcome`` set to ``disconnected`` or ``timeout``.
        """
        final: DiffusionOutput | None = None
        gone = False

        async def watch_disconnect(scope: trio.CancelScope) -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            scope.cancel()

        async def tick() -> None:
            assert on_tick is not None
            while True:
                await trio.sleep(self._progress_interval_s)
                await on_tick()

        timeout = parsed.timeout if parsed.timeout is not None else math.inf
        async with submission.stream as stream, trio.open_nursery() as nursery:
            nursery.start_soon(watch_disconnect, nursery.cancel_scope)
            if on_tick is not None:
                nursery.start_soon(tick)
            with trio.move_on_after(timeout) as timer:
                try:
                    async for output in stream:
                        if output.finished:
                            final = output
                        elif on_chunk is not None:
                            await on_chunk(output)
                except OmniTrioError as exc:
                    # A stage process's engine refused it after all (no chunk was read: a
                    # refusal ends the stream before any): answered as at admission.
                    raise self._refusal(ex, exc) from exc
            nursery.cancel_scope.cancel()
        if final is not None:
            return final
        if gone:
            ex.status, ex.outcome = DISCONNECTED_STATUS, "disconnected"
            self.metrics.observe_abort("disconnect")
        elif timer.cancelled_caught:
            ex.outcome = "timeout"
            self.metrics.observe_abort("timeout")
        return None

    def _timeout_error(self, ex: _Exchange, parsed: ParsedRequest) -> ApiError:
        return ApiError(
            504,
            f"request {ex.request_id} did not finish within its timeout of {parsed.timeout} s "
            "and was aborted",
            type="server_error",
            param="timeout",
            code="timeout",
            headers=_NO_RETRY,
        )

    def _terminal_error(
        self, ex: _Exchange, output: DiffusionOutput, submission: Submission
    ) -> ApiError:
        """The answer for a terminal output that is not a success."""
        rid = submission.request_id
        ex.detail = f"{output.status.name}: {output.error_type}: {output.error}"
        if output.status is RequestStatus.FINISHED_ABORTED:
            if output.error_type == TIMEOUT_ERROR_TYPE:  # the engine ended it at deadline_s
                ex.outcome = "timeout"
                self.metrics.observe_abort("timeout")
                return ApiError(
                    504,
                    f"{output.error or f'request {rid} did not finish in time'}; "
                    "it was aborted (timeout)",
                    type="server_error",
                    param="timeout",
                    code="timeout",
                    headers=_NO_RETRY,
                )
            reason = submission.stream.abort_reason
            ex.outcome = "cancelled" if reason == "cancelled" else "aborted"
            self.metrics.observe_abort(reason or "engine")
            if reason == "cancelled":
                return ApiError(
                    409,
                    f"request {rid} was cancelled (DELETE /v1/requests/{rid}); it is not run again",
                    type="invalid_request_error",
                    code="request_cancelled",
                    headers=_NO_RETRY,
                )
            if output.error_type == "EngineClosedError" or reason is not None:
                why = reason or "the server is shutting down"
                return _unavailable(
                    f"request {rid} was aborted: {why}",
                    "aborted",
                    self.pool.unavailable_retry_after_s(),
                )
            return _unavailable(
                f"request {rid} was aborted", "aborted", self.pool.unavailable_retry_after_s()
            )
        error_type = output.error_type or "Error"
        if error_type == "EngineDeadError":
            return _unavailable(
                f"request {rid} failed: its engine died; retry",
                "engine_dead",
                self.pool.ready_retry_after_s(),
            )
        if error_type == "EngineClosedError":
            return _unavailable(
                f"request {rid} was aborted: the engine closed",
                "engine_closed",
                self.pool.unavailable_retry_after_s(),
            )
        if error_type in RETRYABLE_ERROR_TYPES:
            # Its retries on the server are used up; a client may send it again, but the
            # SDKs' automatic retries must not (a failed job is never recomputed unasked).
            return ApiError(
                503,
                f"request {rid} failed on a worker failure ({error_type}) after the server's "
                "own retries; it may succeed if sent again",
                type="server_error",
                code=error_type,
                headers=[*_retry_after(self.pool.ready_retry_after_s()), *_NO_RETRY],
            )
        if error_type == "InvalidLoraError":  # a worker could not apply the adapter
            return ApiError(
                400,
                f"request {rid}: {output.error}",
                param="lora",
                code="invalid_lora",
                headers=_NO_RETRY,
            )
        if error_type == "InvalidRequestError":  # found after admission (its payload)
            return ApiError(
                400,
                f"request {rid} is invalid: {output.error}",
                param="payload",
                code="invalid_payload",
                headers=_NO_RETRY,
            )
        if error_type == QUARANTINED_ERROR_TYPE:
            return ApiError(
                500,
                f"request {rid} was quarantined: the workers failed each time it ran, so it "
                "is not run again; do not resend it",
                type="server_error",
                code="request_quarantined",
                headers=_NO_RETRY,
            )
        return ApiError(
            500,
            f"request {rid} failed ({error_type})",
            type="server_error",
            code=error_type,
            headers=_NO_RETRY,
        )

    async def _encode_all(
        self, images: Sequence[Any], parsed: ParsedRequest, seed: int | None = None
    ) -> list[bytes]:
        """Encode ``images`` (in a thread) as ``parsed`` asks, each with its recipe unless
        ``image_metadata`` is off: ``seed`` is the one the engine used (``output.seed``; None:
        the request's own, if it gave one), shared by all ``n`` images, told apart by their
        ``image_index`` (see :func:`~omni_trio.serve.images.image_metadata`); the scheduler
        named is the served model's (``ModelInfo.scheduler``)."""
        from .images import image_metadata

        fmt, quality = parsed.output_format, parsed.output_compression
        params = parsed.params if seed is None else parsed.params.replace(seed=seed)
        info = self.pool.model_info() if self.image_metadata else None
        scheduler = None if info is None else info.scheduler

        def recipe(image: Any, index: int) -> dict[str, str] | None:
            if not self.image_metadata:
                return None
            return image_metadata(
                parsed.prompt,
                params,
                model=self.model_name,
                scheduler=scheduler,
                size=None if image_size(image) == "auto" else image_size(image),
                image_index=index,
            )

        started = time.perf_counter()
        encoded = await trio.to_thread.run_sync(
            lambda: [
                encode_image(image, fmt, quality, metadata=recipe(image, index))
                for index, image in enumerate(images)
            ]
        )
        self.metrics.observe_encode(time.perf_counter() - started)
        return encoded

    async def _generate_json(
        self,
        ex: _Exchange,
        submission: Submission,
        parsed: ParsedRequest,
        receive: Receive,
        send: Send,
        base_url: str,
        reservation: Reservation,
    ) -> None:
        final = await self._follow(ex, submission, parsed, receive)
        if final is None:
            if ex.outcome == "timeout":
                raise self._timeout_error(ex, parsed)
            return  # disconnected: nobody to answer
        if final.status is not RequestStatus.FINISHED_COMPLETED:
            raise self._terminal_error(ex, final, submission)
        encoded = await self._encode_all(final.images, parsed, final.seed)
        with reservation.hold(sum(len(blob) for blob in encoded)):
            body = self._images_body(ex, final, parsed, base_url, encoded)
            del encoded
            payload = _json_bytes(body)
            # While the answer is written only its bytes are held: not the JSON tree, and
            # not the decoded images (a stalled reader would keep them for its send timeout).
            del body, final
        if self._keeps_answers(ex):
            ex.answer = payload
        await self._send_bytes(ex, send, 200, payload, "application/json", reservation=reservation)

    def _images_body(
        self,
        ex: _Exchange,
        final: DiffusionOutput,
        parsed: ParsedRequest,
        base_url: str,
        encoded: list[bytes],
    ) -> dict[str, Any]:
        """The generations answer for a completed request's ``encoded`` images (consumed:
        the list is emptied as each goes into the answer or the url store); observed in the
        metrics."""
        data: list[dict[str, Any]] = []
        while encoded:
            blob = encoded.pop(0)
            if parsed.response_format == "url":
                file_id = self.store.put(blob, parsed.content_type)
                data.append({"url": ImageStore.url_for(base_url, file_id), "revised_prompt": None})
            else:
                data.append({"b64_json": encode_b64(blob), "revised_prompt": None})
            del blob
        total_ms = (time.perf_counter() - ex.start) * 1000.0
        body = images_response(
            request_id=ex.request_id,
            model=self.model_name,
            seed=final.seed,
            data=data,
            output_format=parsed.output_format,
            size=image_size(final.images[0]) if final.images else "auto",
            metrics=final.metrics,
            total_ms=total_ms,
        )
        self.metrics.observe_generation(final.metrics, total_ms, len(data))
        return body

    async def _generate_events(
        self,
        ex: _Exchange,
        submission: Submission,
        parsed: ParsedRequest,
        receive: Receive,
        send: Send,
        reservation: Reservation,
    ) -> None:
        """Answer with server-sent events: ``image_generation.progress`` (step/total, when
        known), up to ``partial_images`` ``image_generation.partial_image`` (from step-mode
        previews, evenly picked), then one ``image_generation.completed`` per image (an
        edit's are named ``image_edit.*``: ``parsed.event_prefix``); any
        failure after the headers went out is an ``error`` event with the envelope.  Images
        in events are always ``b64_json`` (``response_format`` applies to JSON answers).

        The partial-image and completed events carry every field of the official SDK's
        stream types (``usage`` included: :data:`NO_USAGE`).  Progress is an event unless
        the request says ``stream_progress: false`` or, leaving it unset, comes from an
        OpenAI SDK (:func:`is_openai_sdk`), whose stream types read any other event as a
        partial image: then it is an SSE comment line, ``: <prefix>.progress {json}``."""
        rid = submission.request_id
        lock = trio.Lock()
        ex.sse = True
        await self._start(ex, send, 200, "text/event-stream", cache="no-cache")
        last_progress: tuple[int, int] | None = None
        targets: set[int] | None = None
        partial_index = 0

        async def emit(event: str, data: dict[str, Any]) -> None:
            payload = f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
            body = payload.encode()
            del payload
            with reservation.hold(len(body)):
                async with lock:  # one event at a time, whole
                    await _send_body(send, body, more_body=True)

        as_events = (
            parsed.stream_progress
            if parsed.stream_progress is not None
            else not is_openai_sdk(ex.headers)
        )

        async def progress(fallback: tuple[int, int] | None = None) -> None:
            nonlocal last_progress
            current = self.pool.progress(rid, owner=ex.owner) or fallback
            if current is not None and current != last_progress:
                last_progress = current
                step, total = current
                kind = f"{parsed.event_prefix}.progress"
                data = {"type": kind, "id": rid, "step": step, "total": total}
                if as_events:
                    await emit(kind, data)
                else:  # a comment: every SSE reader skips it, a person reading it sees it
                    text = f": {kind} {json.dumps(data, separators=(',', ':'))}\n\n"
                    async with lock:
                        await _send_body(send, text.encode(), more_body=True)

        async def emit_images(kind: str, images: Any, **extra: Any) -> None:
            """One SSE event per image: ``kind`` with the image and the shared fields."""
            encoded = await self._encode_all(images, parsed, extra.get("seed"))
            created = int(time.time())
            with reservation.hold(sum(len(blob) for blob in encoded)):
                for image_index, (image, blob) in enumerate(zip(images, encoded, strict=True)):
                    event = {
                        "type": kind,
                        "b64_json": encode_b64(blob),
                        "image_index": image_index,
                        "created_at": created,
                        "size": image_size(image),
                        "output_format": parsed.output_format,
                        "quality": "auto",
                        "background": "auto",
                        "id": rid,
                    }
                    event.update(extra)
                    await emit(kind, event)

        async def on_chunk(output: DiffusionOutput) -> None:
            nonlocal targets, partial_index
            await progress((output.chunk_index + 1, output.total_chunks))
            if targets is None:
                targets = _partial_targets(output.total_chunks - 1, parsed.partial_images)
            if output.chunk_index not in targets or not output.images:
                return
            await emit_images(
                f"{parsed.event_prefix}.partial_image",
                output.images,
                partial_image_index=partial_index,
            )
            partial_index += 1

        final = await self._follow(ex, submission, parsed, receive, on_chunk, progress)
        if final is None:
            if ex.outcome == "timeout":
                ex.status = 504
                await emit("error", {"type": "error", **self._timeout_error(ex, parsed).body()})
                await self._end(send)
            return  # disconnected: nobody to answer
        if final.status is not RequestStatus.FINISHED_COMPLETED:
            err = self._terminal_error(ex, final, submission)
            ex.status = err.status
            await emit("error", {"type": "error", **err.body()})
            await self._end(send)
            return
        await emit_images(
            f"{parsed.event_prefix}.completed", final.images, usage=NO_USAGE, seed=final.seed
        )
        total_ms = (time.perf_counter() - ex.start) * 1000.0
        self.metrics.observe_generation(final.metrics, total_ms, len(final.images))
        await self._end(send)

    # -- responses -------------------------------------------------------------------------

    async def _start(
        self,
        ex: _Exchange,
        send: Send,
        status: int,
        content_type: str,
        *,
        length: int | None = None,
        cache: str = "no-store",
        extra: Sequence[tuple[str, str]] = (),
    ) -> None:
        headers = [
            (b"content-type", content_type.encode()),
            (b"x-request-id", ex.request_id.encode()),
            (b"cache-control", cache.encode()),
        ]
        if length is not None:
            headers.append((b"content-length", str(length).encode()))
        if not ex.body_complete and ex.http1:
            headers.append((b"connection", b"close"))
        for name, value in (*ex.response_headers, *extra):
            headers.append((name.lower().encode(), value.encode("latin-1")))
        ex.status = status
        ex.started = True
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def _end(self, send: Send) -> None:
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _send_bytes(
        self,
        ex: _Exchange,
        send: Send,
        status: int,
        payload: bytes,
        content_type: str,
        *,
        cache: str = "no-store",
        extra: Sequence[tuple[str, str]] = (),
        reservation: Reservation | None = None,
    ) -> None:
        """The whole answer (headers, then the body in :data:`SEND_CHUNK` pieces); its bytes
        count against the response limit while they are written (through ``reservation``,
        a generation's, when given)."""
        hold = reservation.hold if reservation is not None else self.responses.hold
        with hold(len(payload)):
            await self._start(
                ex, send, status, content_type, length=len(payload), cache=cache, extra=extra
            )
            await _send_body(send, payload, more_body=False)

    async def _send_json(
        self,
        ex: _Exchange,
        send: Send,
        status: int,
        body: Any,
        extra: Sequence[tuple[str, str]] = (),
    ) -> None:
        await self._send_bytes(ex, send, status, _json_bytes(body), "application/json", extra=extra)

    async def _send_error(self, ex: _Exchange, send: Send, err: ApiError) -> None:
        if ex.started:  # pragma: no cover - errors after the headers are events
            raise RuntimeError("an error raised after the response started") from err
        await self._send_json(ex, send, err.status, err.body(), extra=err.headers)

    async def _answer_internal_error(self, ex: _Exchange, send: Send) -> None:
        """Answer an unexpected failure without internals (best effort: the client may be
        gone, or the headers may have gone out already)."""
        message = f"The server had an error while processing request {ex.request_id}"
        body = error_body(message, type="server_error", code="internal_error")
        # Once admitted, the work was done (or under way): an SDK's automatic retry would
        # compute it again, and a failure after it (the url store, encoding) would recur.
        extra = _NO_RETRY if ex.submitted else ()
        try:
            if not ex.started:
                await self._send_json(ex, send, 500, body, extra=extra)
            else:
                if ex.sse:
                    payload = f"event: error\ndata: {json.dumps({'type': 'error', **body})}\n\n"
                    await send(
                        {"type": "http.response.body", "body": payload.encode(), "more_body": True}
                    )
                await self._end(send)
                ex.status = 500
        except Exception:  # pragma: no cover - the transport itself failed
            _log.debug("could not answer request %s", ex.request_id, exc_info=True)
        ex.outcome = "error"


def _json_bytes(body: Any) -> bytes:
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()


async def _send_body(send: Send, payload: bytes, *, more_body: bool) -> None:
    """``payload`` as ``http.response.body`` messages of at most :data:`SEND_CHUNK` bytes, each
    under the write deadline on its own (and h11 never joins a whole large body into one more
    copy); the last one says ``more_body``."""
    size = len(payload)
    if size <= SEND_CHUNK:
        await send({"type": "http.response.body", "body": payload, "more_body": more_body})
        return
    view = memoryview(payload)
    for start in range(0, size, SEND_CHUNK):
        end = start + SEND_CHUNK
        await send(
            {
                "type": "http.response.body",
                "body": bytes(view[start:end]),
                "more_body": more_body or end < size,
            }
        )


def logger_sink(logger: logging.Logger | None = None) -> AccessLog:
    """The access-record sink writing to ``logger`` (default ``omni_trio.serve.access``):
    one line per record, at the level the class docstring of :class:`ImagesApp` gives."""
    target = logger or _access_log

    def sink(record: dict[str, Any]) -> None:
        if record["route"] == "/ready" and record["status"] == 503:
            level = logging.DEBUG  # every probe while not ready; the daemon logs the change
        elif record["status"] >= 500:
            level = logging.WARNING
        else:
            level = logging.INFO
        # The latency appears once: as it is in the record (the text formatter then does
        # not repeat it as a field).
        target.log(
            level,
            "%s %s %s -> %s %s %sms",
            record["request_id"],
            record["method"],
            record["path"],
            record["status"],
            record["outcome"],
            record["ms"],
            extra=record,
        )

    return sink
