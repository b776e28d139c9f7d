"""Jobs: submit a generation, come back for it (``/v1/jobs``).

``POST /v1/jobs`` takes the body of ``POST /v1/images/generations`` and answers at once with
the job (``id``, ``status`` ``queued``); the generation runs in the background as any request
does (same admission, limits, queue, retries on a worker failure, cancellation).  Its life:

    queued -> running -> completed | failed | cancelled

``GET /v1/jobs/{id}`` is the job now (:meth:`Job.body`: status, queue position, steps done /
total, the result once completed, the error envelope once failed); ``GET
/v1/jobs/{id}/events`` streams its events (SSE, each with an ``id:``), resumable with
``Last-Event-ID``: the events after that id come from the job's own bounded buffer, so a
client that reconnects misses nothing the buffer still holds; ``DELETE /v1/jobs/{id}``
cancels it (idempotent: ``cancelled`` says whether the job ends cancelled).

Events (``event:`` name, ``data:`` JSON)::

    job.queued      the job (at creation)
    job.running     the job (its first step started)
    job.progress    {"id", "step", "total"} (at most one per tick, on change)
    job.completed   the job, with ``result`` (the generations answer)
    job.failed      the job, with ``error`` (the envelope) and ``http_status``
    job.cancelled   the job

A finished job is kept for ``ttl_s`` after it ended, and all finished jobs together within
``max_bytes`` (results and events; past it the oldest finished jobs go first); a job that is
gone is a 404, as an unknown id.  Jobs are scoped to their owner like requests: another
key's job does not exist.  An ``Idempotency-Key`` on the POST names the job: the same key
and body gives the same job back, another body a 422.

:class:`JobStore` holds the jobs and decides; the app carries out (runs each job's request,
streams events, sends webhooks).  Every method is synchronous and never checkpoints; all of
it runs on the app's trio thread.
"""

from __future__ import annotations

import json
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

__all__ = [
    "DEFAULT_JOB_MAX_BYTES",
    "DEFAULT_JOB_TTL_S",
    "JOB_EVENTS_KEPT",
    "TERMINAL_STATUSES",
    "Job",
    "JobEvent",
    "JobStore",
]

DEFAULT_JOB_TTL_S = 3600.0
DEFAULT_JOB_MAX_BYTES = 256 * 2**20
# Events one job's buffer holds (the terminal one always stays): a progress event a tick
# comes at most once per step, so the default step limit (200) fits whole.
JOB_EVENTS_KEPT = 512
TERMINAL_STATUSES = frozenset({"completed", "failed", "cancelled"})


def _json(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class JobEvent:
    """One event of a job: its number (1, 2, ...; the SSE ``id``), name and JSON data."""

    id: int
    event: str
    data: bytes

    def sse(self) -> bytes:
        return b"id: %d\nevent: %s\ndata: %s\n\n" % (self.id, self.event.encode(), self.data)


@dataclass(eq=False, slots=True)
class Job:
    """A job and its event buffer.  ``changed`` is set (and replaced) on every new event:
    a follower waits on the one it saw."""

    id: str
    owner: str
    created_at: int
    webhook_url: str | None = None
    status: str = "queued"
    started_at: int | None = None
    finished_at: int | None = None
    ended_at: float | None = None  # the store's clock, for the ttl
    progress: tuple[int, int] | None = None
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    http_status: int | None = None
    final: bytes | None = None  # the finished job's body (JSON), result included
    events: deque[JobEvent] = field(default_factory=deque)
    last_event_id: int = 0
    dropped: int = 0  # events that fell out of the buffer
    changed: trio.Event = field(default_factory=trio.Event)
    size: int = 0  # bytes of its events (the result is in the terminal one)

    @property
    def finished(self) -> bool:
        return self.status in TERMINAL_STATUSES

    def body(self, queue_position: int | None = None) -> dict[str, Any]:
        """``GET /v1/jobs/{id}``: the job as JSON (``queue_position`` 0 = next to run,
        while queued; ``progress`` while running and after).  A finished job's is
        :attr:`final` (this, rendered once, with its result)."""
        if self.final is not None:
            return dict(json.loads(self.final))
        return {
            "id": self.id,
            "object": "job",
            "status": self.status,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "queue_position": queue_position if self.status == "queued" else None,
            "progress": (
                {"step": self.progress[0], "total": self.progress[1]} if self.progress else None
            ),
            "result": self.result,
            "error": self.error,
            "http_status": self.http_status,
            "webhook_url": self.webhook_url,
        }

    def events_after(self, last_id: int) -> list[JobEvent]:
        """The buffered events numbered above ``last_id``, oldest first."""
        return [event for event in self.events if event.id > last_id]


class JobStore:
    """Every job, by ``(owner, id)``, and the ``Idempotency-Key`` of each that had one.

    ``clock`` (default ``trio.current_time``) times the ttl; ``wall`` (default
    ``time.time``) stamps ``created_at`` and the like.
    """

    def __init__(
        self,
        *,
        ttl_s: float = DEFAULT_JOB_TTL_S,
        max_bytes: int = DEFAULT_JOB_MAX_BYTES,
        events_kept: int = JOB_EVENTS_KEPT,
        clock: Callable[[], float] | None = None,
        wall: Callable[[], float] | None = None,
    ) -> None:
        import time

        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes!r}")
        if events_kept < 2:
            raise ValueError(f"events_kept must be >= 2, got {events_kept!r}")
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.events_kept = events_kept
        self._clock = clock or trio.current_time
        self._wall = wall or time.time
        self._jobs: dict[tuple[str, str], Job] = {}
        # Finished jobs, oldest end first: the eviction order.
        self._finished: OrderedDict[tuple[str, str], Job] = OrderedDict()
        self._finished_bytes = 0
        # (owner, Idempotency-Key) -> (body digest, job id), and its reverse for eviction.
        self._keys: dict[tuple[str, str], tuple[str, str]] = {}
        self._key_of: dict[tuple[str, str], str] = {}

    # -- queries -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._jobs)

    @property
    def finished_bytes(self) -> int:
        return self._finished_bytes

    def get(self, owner: str, job_id: str) -> Job | None:
        """``owner``'s job ``job_id``, or None (unknown, expired, or another owner's)."""
        self._expire()
        return self._jobs.get((owner, job_id))

    def by_key(self, owner: str, key: str) -> tuple[str, Job] | None:
        """(body digest, job) of ``owner``'s job made with ``Idempotency-Key`` ``key``."""
        self._expire()
        found = self._keys.get((owner, key))
        if found is None:
            return None
        job = self._jobs.get((owner, found[1]))
        return None if job is None else (found[0], job)

    # -- changes -------------------------------------------------------------------------

    def create(
        self,
        owner: str,
        job_id: str,
        *,
        webhook_url: str | None = None,
        key: str | None = None,
        digest: str | None = None,
    ) -> Job:
        """A new queued job (its ``job.queued`` event recorded).  Raises KeyError when the
        owner has a job with that id."""
        self._expire()
        if (owner, job_id) in self._jobs:
            raise KeyError(job_id)
        job = Job(job_id, owner, int(self._wall()), webhook_url=webhook_url)
        self._jobs[(owner, job_id)] = job
        if key is not None:
            self._keys[(owner, key)] = (digest or "", job_id)
            self._key_of[(owner, job_id)] = key
        self._record(job, "job.queued", _json(job.body()))
        return job

    def discard(self, job: Job) -> None:
        """Forget a job that never ran (its admission failed)."""
        self._drop(job)

    def running(self, job: Job) -> None:
        if job.status == "queued":
            job.status = "running"
            job.started_at = int(self._wall())
            self._record(job, "job.running", _json(job.body()))

    def progressed(self, job: Job, step: int, total: int) -> None:
        """Record a progress change (the same step twice is one event)."""
        if job.finished or job.progress == (step, total):
            return
        if job.status == "queued":
            self.running(job)
        job.progress = (step, total)
        self._record(job, "job.progress", _json({"id": job.id, "step": step, "total": total}))

    def finish(
        self,
        job: Job,
        status: str,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        http_status: int | None = None,
    ) -> None:
        """End the job (once; later calls are ignored): ``completed`` with ``result``,
        ``failed`` with ``error`` (an envelope) and its ``http_status``, or ``cancelled``."""
        if job.finished:
            return
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"not a terminal job status: {status!r}")
        if status == "completed":
            self.running(job)  # it ran, even if no tick saw it: every completed job did
        job.status = status
        job.finished_at = int(self._wall())
        job.ended_at = self._clock()
        job.result, job.error, job.http_status = result, error, http_status
        if status == "completed" and job.progress is not None:
            job.progress = (job.progress[1], job.progress[1])
        final = _json(job.body())
        # The result lives on only as these bytes: the terminal event, the GET answer and
        # the webhook's payload are all of them.
        job.result = None
        job.final = final
        self._record(job, f"job.{status}", final)
        key = (job.owner, job.id)
        if key in self._jobs:
            self._finished[key] = job
            self._finished_bytes += job.size
            self._shrink()

    # -- inside --------------------------------------------------------------------------

    def _record(self, job: Job, name: str, data: bytes) -> None:
        job.last_event_id += 1
        event = JobEvent(job.last_event_id, name, data)
        job.events.append(event)
        job.size += len(data)
        while len(job.events) > self.events_kept:
            # The oldest goes; never the terminal one (it is the newest).
            gone = job.events.popleft()
            job.size -= len(gone.data)
            job.dropped += 1
        changed, job.changed = job.changed, trio.Event()
        changed.set()

    def _drop(self, job: Job) -> None:
        key = (job.owner, job.id)
        if self._jobs.get(key) is job:
            del self._jobs[key]
        if self._finished.pop(key, None) is not None:
            self._finished_bytes -= job.size
        idem = self._key_of.pop(key, None)
        if idem is not None:
            self._keys.pop((job.owner, idem), None)

    def _expire(self) -> None:
        now = self._clock()
        while self._finished:
            job = next(iter(self._finished.values()))
            assert job.ended_at is not None
            if now - job.ended_at < self.ttl_s:
                break
            self._drop(job)

    def _shrink(self) -> None:
        while self._finished_bytes > self.max_bytes and self._finished:
            self._drop(next(iter(self._finished.values())))
