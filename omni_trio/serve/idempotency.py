"""``Idempotency-Key``: a resubmission attaches to the first request instead of running again.

A client (or an SDK's automatic retry) that sends the same ``Idempotency-Key`` header with the
same body gets the first request's answer -- its result, or its failure, or its cancellation
-- and the model runs once.  The same key with another body is a 422.  Keys are scoped to the
owner (the API key or client token that sent them), so two clients never share one, and
expire ``ttl_s`` after the first request ended.  Stored answers count against ``max_bytes``;
past it the oldest answers are dropped (their keys stay known, and a resubmission is told the
answer is gone rather than run again).

:class:`IdempotencyStore` holds the entries and decides; the app carries out (it waits on an
entry's ``done`` event, replays ``response``).  Every method is synchronous and checkpoints
never; all of it runs on the app's trio thread.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import trio

__all__ = [
    "DEFAULT_IDEMPOTENCY_MAX_BYTES",
    "DEFAULT_IDEMPOTENCY_TTL_S",
    "MAX_KEY_LENGTH",
    "IdempotencyStore",
    "StoredResponse",
    "body_digest",
    "check_key",
]

DEFAULT_IDEMPOTENCY_TTL_S = 3600.0
DEFAULT_IDEMPOTENCY_MAX_BYTES = 64 * 2**20
MAX_KEY_LENGTH = 255


def check_key(key: str) -> str | None:
    """What is wrong with an ``Idempotency-Key`` value (None: nothing)."""
    if not key or len(key) > MAX_KEY_LENGTH:
        return f"Idempotency-Key must be 1..{MAX_KEY_LENGTH} characters"
    if not key.isprintable() or not key.isascii():
        return "Idempotency-Key must be printable ASCII"
    return None


def body_digest(body: Any) -> str:
    """The fingerprint of a decoded JSON body: key order and whitespace do not matter."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """The answer a resubmission replays: status, headers and body bytes (``body`` None once
    the store dropped it for memory; ``stream`` for an answer that was a stream of events,
    which cannot be replayed)."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes | None
    content_type: str = "application/json"
    stream: bool = False


@dataclass(slots=True)
class _Entry:
    digest: str
    request_id: str
    done: trio.Event = field(default_factory=trio.Event)
    response: StoredResponse | None = None
    ended_at: float | None = None


class IdempotencyStore:
    """The keys seen, by ``(owner, key)``: in flight (``done`` not set) or ended (with the
    answer to replay until ``ttl_s`` after the end).  Lookups cost O(1) amortised: ended
    keys are kept in the order they ended and expire from the front."""

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_IDEMPOTENCY_TTL_S,
        max_bytes: int = DEFAULT_IDEMPOTENCY_MAX_BYTES,
    ) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes!r}")
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self._entries: dict[tuple[str, str], _Entry] = {}
        # Ended keys, oldest end first (what expires, and whose bodies go first).
        self._ended: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._bytes = 0

    @property
    def stored_bytes(self) -> int:
        """Bytes of the answers kept for replay (at most ``max_bytes``)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, owner: str, key: str, now: float) -> _Entry | None:
        """The live entry of ``(owner, key)``, after expiring what is past its time."""
        self._expire(now)
        return self._entries.get((owner, key))

    def begin(self, owner: str, key: str, digest: str, request_id: str) -> _Entry:
        """Record a new request under ``(owner, key)`` (which must not be live)."""
        assert (owner, key) not in self._entries, "begin() on a live key"
        entry = _Entry(digest, request_id)
        self._entries[(owner, key)] = entry
        return entry

    def finish(
        self, owner: str, key: str, entry: _Entry, response: StoredResponse, now: float
    ) -> None:
        """The request ended with ``response``: keep it for resubmissions; wake the waiters."""
        entry.done.set()
        if self._entries.get((owner, key)) is not entry:
            return
        entry.response = response
        entry.ended_at = now
        self._ended[(owner, key)] = None
        if response.body is not None:
            self._bytes += len(response.body)
        self._shrink()

    def forget(self, owner: str, key: str, entry: _Entry) -> None:
        """The request ended without an answer worth keeping (it never ran, or its client
        left): the key is free again, and its waiters run their own request."""
        entry.done.set()
        if self._entries.get((owner, key)) is entry:
            del self._entries[(owner, key)]

    def _expire(self, now: float) -> None:
        ended = self._ended
        while ended:
            key = next(iter(ended))
            entry = self._entries[key]
            assert entry.ended_at is not None
            if now - entry.ended_at < self.ttl_s:
                return
            del ended[key]
            del self._entries[key]
            if entry.response is not None and entry.response.body is not None:
                self._bytes -= len(entry.response.body)

    def _shrink(self) -> None:
        """Drop the oldest stored bodies (keeping their keys) while over ``max_bytes``."""
        for key in self._ended:
            if self._bytes <= self.max_bytes:
                return
            entry = self._entries[key]
            response = entry.response
            if response is None or response.body is None:
                continue
            self._bytes -= len(response.body)
            entry.response = StoredResponse(
                response.status, response.headers, None, response.content_type, response.stream
            )
