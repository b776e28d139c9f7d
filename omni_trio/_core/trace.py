"""The lifecycle trace: every event of every request, recorded cheaply enough to leave on.

The engine records into a :class:`TraceRecorder` when one is given to ``open_engine(...,
trace=recorder)``; the invariant checker (``omni_trio.testing.check_trace``) reads it back.
Recording is one tuple append (no formatting, no lock: every engine-side event is recorded on
the engine's trio thread).  A consumer may record its own events (``RECEIVED``) from the same
thread.

Events and the fields they use (``request_id`` is None for engine-wide events)::

    ADMIT          rid   detail: seed, steps, mode              admitted (stream() returned)
    SCHEDULE       rid   step_id                                in this scheduler output
    EXEC_START     rid   step_id, worker                        handed to the executor
    EXEC_RESULT    rid   step_id, worker, detail: outcome       a runner output came back for it
                                                                (outcome: ok|pending|error|aborted)
    CHUNK          rid   detail: chunk_index                    a non-terminal chunk was sent
    ABORT          rid   detail: reason (api|consumer|close)    abort asked
    CONSUMER_DROP  rid                                          the consumer stopped reading
    REQUEUE        rid   detail: retry                          back to the queue after a crash
    PREEMPT        rid   detail: progress                       preempted at a step boundary
    TERMINAL       rid   detail: status, error_type             reached its terminal state
    OUTPUT         rid   detail: status, delivered (bool)       terminal output sent (or dropped,
                                                                delivered=False: consumer gone)
    CLEANUP        rid                                          every piece of its state released
    RECEIVED       rid   detail: consumer's view (finished, chunk_index, identity...)
    CRASH          -     worker, detail: generation, error_type, error
    RESTART        -     detail: generation, backoff_s
    STALL          -     detail: phase, error
    DEAD           -     detail: error
    SLEEP          -     detail: level, state (falling_asleep|asleep|failed)
    WAKE           -     detail: state (waking|awake|failed)
    CLOSE          -     (engine closing)
    CLOSED         -     detail: leftovers (a dict of what is still held; empty when clean)
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TraceEvent", "TraceKind", "TraceRecorder"]


class TraceKind(enum.StrEnum):
    ADMIT = "admit"
    SCHEDULE = "schedule"
    EXEC_START = "exec_start"
    EXEC_RESULT = "exec_result"
    CHUNK = "chunk"
    ABORT = "abort"
    CONSUMER_DROP = "consumer_drop"
    REQUEUE = "requeue"
    PREEMPT = "preempt"
    TERMINAL = "terminal"
    OUTPUT = "output"
    CLEANUP = "cleanup"
    RECEIVED = "received"
    CRASH = "crash"
    RESTART = "restart"
    STALL = "stall"
    DEAD = "dead"
    SLEEP = "sleep"
    WAKE = "wake"
    CLOSE = "close"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One recorded event; ``seq`` orders events totally (times can tie)."""

    seq: int
    time: float
    kind: TraceKind
    request_id: str | None = None
    step_id: int | None = None
    worker: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "time": self.time,
            "kind": self.kind.value,
            "request_id": self.request_id,
            "step_id": self.step_id,
            "worker": self.worker,
            "detail": self.detail,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TraceEvent:
        return cls(
            seq=int(data["seq"]),
            time=float(data["time"]),
            kind=TraceKind(data["kind"]),
            request_id=data.get("request_id"),
            step_id=data.get("step_id"),
            worker=data.get("worker"),
            detail=dict(data.get("detail") or {}),
        )


_Row = tuple[float, TraceKind, "str | None", "int | None", "int | None", "dict[str, Any] | None"]


class TraceRecorder:
    """An append-only list of lifecycle events.

    ``record`` is the hot path: it stores a tuple; :attr:`events` builds the
    :class:`TraceEvent` objects on demand.  ``limit`` bounds memory for long campaigns (the
    oldest events are dropped, and ``dropped`` counts them; the checker then skips the
    whole-trace checks that need a request's full history).
    """

    def __init__(self, *, limit: int | None = None) -> None:
        self._rows: list[_Row] = []
        self._limit = limit
        self._base = 0
        self.dropped = 0

    def record(
        self,
        time: float,
        kind: TraceKind,
        request_id: str | None = None,
        *,
        step_id: int | None = None,
        worker: int | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        self._rows.append((time, kind, request_id, step_id, worker, detail))
        if self._limit is not None and len(self._rows) > self._limit:
            cut = len(self._rows) - self._limit
            del self._rows[:cut]
            self._base += cut
            self.dropped += cut

    def __len__(self) -> int:
        return len(self._rows)

    def clear(self) -> None:
        self._base += len(self._rows)
        self._rows.clear()

    @property
    def events(self) -> list[TraceEvent]:
        return list(self)

    def __iter__(self) -> Iterator[TraceEvent]:
        for i, (time, kind, rid, step_id, worker, detail) in enumerate(self._rows):
            yield TraceEvent(self._base + i, time, kind, rid, step_id, worker, detail or {})

    def for_request(self, request_id: str) -> list[TraceEvent]:
        """Every event of one request id, in order (all its incarnations)."""
        return [e for e in self if e.request_id == request_id]

    def to_json_lines(self) -> str:
        import json

        return "".join(json.dumps(e.to_dict(), default=str) + "\n" for e in self)

    @classmethod
    def from_json_lines(cls, text: str) -> list[TraceEvent]:
        import json

        return [TraceEvent.from_dict(json.loads(line)) for line in text.splitlines() if line]
