"""Job webhooks: the server POSTs a job's progress and its end to the job's ``webhook_url``.

Enabled by a signing secret (``--webhook-secret`` / ``[serve] webhook_secret``); a job that
asks for a webhook on a server without one is refused (400).  ``webhook_hosts`` (when set)
lists the only host names a webhook may go to: a webhook is a request the *server* makes to
an address a *client* chose, so an operator who serves untrusted clients should set it.

Each call is ``POST <webhook_url>`` with a JSON body::

    {"type": "job.progress" | "job.completed" | "job.failed" | "job.cancelled",
     "delivery_id": "<32 hex digits, unique per call>",
     "timestamp": <unix seconds>,
     "data": <the event's data: {"id", "step", "total"} for progress, else the job>}

and the headers ``X-Omni-Trio-Event`` (the type), ``X-Omni-Trio-Delivery`` (the delivery id)
and ``X-Omni-Trio-Signature-256: sha256=<hex>``, the HMAC-SHA256 of the raw body under the
secret (:func:`sign`; compare with :func:`hmac.compare_digest`).  The body carries its own
timestamp and delivery id, so a receiver can refuse old or repeated calls.

Per job, calls are made one at a time, in order.  Progress: at most one call per
:data:`PROGRESS_INTERVAL_S`, the latest step (a step passed meanwhile is not sent), never
retried (the next one supersedes it), none after the end.  The end: retried on a connection
error, a timeout, 408, 429 or a 5xx, with backoff (0.5 s doubling, at most
:data:`ATTEMPTS` calls); any other status is final (a 2xx is a delivery).  Redirects are not
followed.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import trio

from .jobs import Job, JobEvent

__all__ = [
    "ATTEMPTS",
    "DELIVERY_HEADER",
    "EVENT_HEADER",
    "PROGRESS_INTERVAL_S",
    "SIGNATURE_HEADER",
    "WebhookSender",
    "check_webhook_url",
    "sign",
]

_log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.5
ATTEMPTS = 5
BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0
TIMEOUT_S = 10.0
MAX_URL_CHARS = 2048
SIGNATURE_HEADER = "X-Omni-Trio-Signature-256"
EVENT_HEADER = "X-Omni-Trio-Event"
DELIVERY_HEADER = "X-Omni-Trio-Delivery"
_RETRIED = frozenset({408, 429})


def sign(secret: bytes, body: bytes) -> str:
    """The signature header's value for ``body``: ``sha256=`` + hex HMAC-SHA256."""
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


def check_webhook_url(url: Any, allowed_hosts: Sequence[str] = ()) -> str | None:
    """What is wrong with ``url`` as a webhook address (None: nothing): an ``http`` or
    ``https`` URL with a host, at most :data:`MAX_URL_CHARS`, no user info, and (when
    ``allowed_hosts`` is not empty) one of those hosts."""
    if not isinstance(url, str):
        return "webhook_url must be a string"
    if len(url) > MAX_URL_CHARS:
        return f"webhook_url is longer than {MAX_URL_CHARS} characters"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"webhook_url is not a valid URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "webhook_url must be an http:// or https:// URL with a host"
    if parts.username is not None or parts.password is not None:
        return "webhook_url must not carry a user name or password"
    if port == 0:
        return "webhook_url has port 0"
    if allowed_hosts and parts.hostname.lower() not in {h.lower() for h in allowed_hosts}:
        return f"webhook_url's host {parts.hostname!r} is not among the server's webhook_hosts"
    return None


class WebhookSender:
    """Sends the webhooks of jobs (module docstring).  ``secret`` signs every body.

    ``on_delivery(event, outcome)`` (optional) hears of every call's end: ``outcome`` is
    ``delivered``, ``failed`` (a final status, or the attempts used up) or ``retry``.
    """

    def __init__(
        self,
        secret: bytes,
        *,
        progress_interval_s: float = PROGRESS_INTERVAL_S,
        attempts: int = ATTEMPTS,
        backoff_s: float = BACKOFF_S,
        timeout_s: float = TIMEOUT_S,
        on_delivery: Callable[[str, str], None] | None = None,
    ) -> None:
        if not secret:
            raise ValueError("a webhook secret must not be empty")
        self._secret = secret
        self.progress_interval_s = progress_interval_s
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self._on_delivery = on_delivery

    def payload(self, event: JobEvent) -> tuple[bytes, list[tuple[str, str]]]:
        """One call's body and headers for ``event`` (a fresh delivery id each time)."""
        delivery = secrets.token_hex(16)
        body = b'{"type":"%s","delivery_id":"%s","timestamp":%d,"data":%s}' % (
            event.event.encode(),
            delivery.encode(),
            int(time.time()),
            event.data,
        )
        headers = [
            ("Content-Type", "application/json"),
            ("User-Agent", "omni-trio-webhook"),
            (EVENT_HEADER, event.event),
            (DELIVERY_HEADER, delivery),
            (SIGNATURE_HEADER, sign(self._secret, body)),
        ]
        return body, headers

    async def follow(self, job: Job, url: str) -> None:
        """Send ``job``'s webhooks to ``url`` until its end was sent (or given up on), then
        return.  Cancelling it stops at once (a call in flight is abandoned)."""
        import httpx

        seen = 0
        pending: JobEvent | None = None
        next_progress = -math.inf
        async with httpx.AsyncClient(timeout=self.timeout_s, follow_redirects=False) as client:
            while True:
                changed = job.changed  # before reading: an event after this sets it
                for event in job.events_after(seen):
                    seen = event.id
                    if event.event == "job.progress":
                        pending = event
                if job.finished:
                    assert job.final is not None
                    await self._deliver_end(client, url, job.events[-1])
                    return
                now = trio.current_time()
                if pending is not None and now >= next_progress:
                    await self._call(client, url, pending)
                    pending = None
                    next_progress = trio.current_time() + self.progress_interval_s
                    continue
                with trio.move_on_at(next_progress if pending is not None else math.inf):
                    await changed.wait()

    async def _deliver_end(self, client: Any, url: str, event: JobEvent) -> None:
        delay = self.backoff_s
        for attempt in range(1, self.attempts + 1):
            outcome = await self._call(client, url, event, last=attempt == self.attempts)
            if outcome != "retry":
                return
            await trio.sleep(delay)
            delay = min(MAX_BACKOFF_S, delay * 2)

    async def _call(self, client: Any, url: str, event: JobEvent, *, last: bool = True) -> str:
        """One POST; ``delivered``, ``failed`` or (a retryable failure, not ``last``)
        ``retry``.  Never raises for the receiver's trouble."""
        import httpx

        body, headers = self.payload(event)
        try:
            response = await client.post(url, content=body, headers=headers)
        except httpx.HTTPError as exc:
            status, why = None, f"{type(exc).__name__}: {exc}"
        else:
            status, why = response.status_code, f"HTTP {response.status_code}"
        if status is not None and 200 <= status < 300:
            outcome = "delivered"
        elif (status is None or status >= 500 or status in _RETRIED) and not last:
            outcome = "retry"
        else:
            outcome = "failed"
        if outcome != "delivered" and event.event != "job.progress":
            _log.log(
                logging.INFO if outcome == "retry" else logging.WARNING,
                "webhook %s of a job to %s: %s (%s)",
                event.event,
                urlsplit(url).hostname,
                why,
                "retrying" if outcome == "retry" else "given up",
            )
        if self._on_delivery is not None:
            self._on_delivery(event.event, outcome)
        return outcome
