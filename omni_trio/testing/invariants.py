"""The invariant checker: reads a lifecycle trace and reports every broken invariant.

``check_trace(events)`` runs one check per invariant of DESIGN.md section 4 (INV-1..INV-7) over
a trace recorded by :class:`~omni_trio._core.trace.TraceRecorder` and returns the
:class:`Violation` list, sorted by invariant and then by the offending event's ``seq``; an empty
list means the trace is clean.  ``assert_trace_ok`` raises :class:`InvariantViolation` instead.
Each check is also public on its own (``check_inv1_single_owner`` ...
``check_inv7_prompt_cancellation``).

``check_leftovers(held, events)`` holds what the components *say they hold* (the engine's
``leftovers()`` and ``worker_leftovers()``: resource kind -> owning request ids) against the
trace: nothing may be held for a request that is not live, and every live request must be
held by the core.  It names the owning request of every violation (see :data:`STRICT_KINDS`).

How a trace is read:

- An *incarnation* of a request id runs from its ADMIT to its CLEANUP.  The id may be admitted
  again after the CLEANUP; that is a new incarnation.  Every event of an id belongs to the id's
  latest incarnation (after its CLEANUP it is reported as an event after cleanup).
- An EXEC_RESULT belongs to the incarnation that started its step instead.  A request that
  ends while its forward is in flight (an abort ends a running request at once) gets that
  forward's result after its CLEANUP; the engine drops it, and it is not a violation.
- RECEIVED events are the consumer's view and may come late (a consumer reads its stream after
  the engine cleaned up, even after the id was admitted again).  They go to the oldest
  incarnation of the id whose consumer may still read: admitted, and not yet received its
  finished result, dropped by its consumer (CONSUMER_DROP) or had its output dropped
  (OUTPUT delivered=False).
- *Closed* (``closed=None``: the trace holds a CLOSED event) means the story is over: every
  admitted incarnation must have reached TERMINAL, OUTPUT and CLEANUP.  A trace that is not
  closed is a snapshot of a running engine: a live request is never a violation for being live.
- A trace whose first event has ``seq > 0`` lost its beginning (``TraceRecorder(limit=...)``
  drops the oldest events; ``clear()`` too).  Ids first seen without an ADMIT are then not
  reported and their incarnation is not checked; later incarnations (from an ADMIT on) are.

The checker is one pass to group the events by incarnation plus one pass per invariant: linear
in the number of events.  A violation's ``history`` is every event of the offending incarnation
(for an id admitted twice before its CLEANUP: of both incarnations; for a never-admitted id:
all its events), or the engine-wide events concerned.
"""

from __future__ import annotations

import bisect
import enum
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._core.lifecycle import RequestStatus
from .._core.trace import TraceEvent, TraceKind

__all__ = [
    "ENGINE_WIDE_KINDS",
    "INVARIANTS",
    "SETTLING_KINDS",
    "STALL_PHASES",
    "STRICT_KINDS",
    "InvariantViolation",
    "Violation",
    "assert_trace_ok",
    "check_inv1_single_owner",
    "check_inv2_execution_follows_schedule",
    "check_inv3_terminal_cleanup",
    "check_inv4_no_second_lifecycle",
    "check_inv5_identity",
    "check_inv6_bounded_waits",
    "check_inv7_prompt_cancellation",
    "check_leftovers",
    "check_liveness",
    "check_trace",
]

INVARIANTS: dict[str, str] = {
    "INV-1": "One lifecycle owner",
    "INV-2": "Execution follows scheduler output",
    "INV-3": "Terminal cleanup is complete",
    "INV-4": "Optional features use hooks (no second lifecycle)",
    "INV-5": "Results keep request identity",
    "INV-6": "Bounded waits",
    "INV-7": "Cancellation is prompt",
}

#: The phases a STALL event may name (INV-6: a stall names the phase that stalled).
STALL_PHASES = frozenset(
    {"admission", "forward", "output", "packing", "rpc", "worker", "close", "restart"}
)

# Module-level names: an enum member lookup on the class costs more than the rest of a check.
_ABORT = TraceKind.ABORT
_ADMIT = TraceKind.ADMIT
_CHUNK = TraceKind.CHUNK
_CLEANUP = TraceKind.CLEANUP
_CLOSE = TraceKind.CLOSE
_CLOSED = TraceKind.CLOSED
_CONSUMER_DROP = TraceKind.CONSUMER_DROP
_CRASH = TraceKind.CRASH
_EXEC_RESULT = TraceKind.EXEC_RESULT
_EXEC_START = TraceKind.EXEC_START
_OUTPUT = TraceKind.OUTPUT
_RECEIVED = TraceKind.RECEIVED
_RESTART = TraceKind.RESTART
_PREEMPT = TraceKind.PREEMPT
_REQUEUE = TraceKind.REQUEUE
_SCHEDULE = TraceKind.SCHEDULE
_SLEEP = TraceKind.SLEEP
_WAKE = TraceKind.WAKE
_STALL = TraceKind.STALL
_TERMINAL = TraceKind.TERMINAL
# After an abort, one of these events of the request shows the engine has moved past the abort,
# so the TERMINAL must already have come (EXEC_RESULT only when its outcome is not "pending":
# a pending output is still being packed and ends later).  RECEIVED, a second ABORT or
# CONSUMER_DROP, and a REQUEUE after a crash may all still come before the TERMINAL.
_AFTER_ABORT_TERMINAL = frozenset({_OUTPUT, _CLEANUP, _EXEC_RESULT})


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken invariant.

    ``history`` is every event of the offending incarnation, in order (or the engine-wide
    events concerned, with ``request_id`` None); ``seq`` is the offending event's, marked with
    ``>`` in :meth:`format` (None when the violation is about something missing).
    """

    invariant: str
    message: str
    request_id: str | None
    history: tuple[TraceEvent, ...]
    seq: int | None = None

    def format(self) -> str:
        """A human report: the invariant, the message, then one line per history event."""
        name = INVARIANTS.get(self.invariant, "")
        who = f"request {self.request_id!r}" if self.request_id is not None else "engine"
        lines = [f"{self.invariant} ({name}) {who}: {self.message}"]
        lines.append(f"  history ({len(self.history)} events):")
        for e in self.history:
            mark = ">" if e.seq == self.seq else " "
            step = "-" if e.step_id is None else str(e.step_id)
            worker = "-" if e.worker is None else str(e.worker)
            detail = e.detail if e.detail else ""
            line = (
                f"  {mark} seq={e.seq:<6} t={e.time:<10.4f} {e.kind.value:<13} "
                f"step={step:<5} worker={worker:<3} {detail}"
            )
            lines.append(line.rstrip())
        return "\n".join(lines)


class InvariantViolation(AssertionError):
    """Raised by :func:`assert_trace_ok`; ``violations`` lists them all, ``str()`` formats them."""

    def __init__(self, violations: Sequence[Violation]) -> None:
        self.violations: tuple[Violation, ...] = tuple(violations)
        super().__init__(self._text())

    def _text(self) -> str:
        head = f"{len(self.violations)} invariant violation(s):"
        return "\n\n".join([head, *(v.format() for v in self.violations)])

    def __str__(self) -> str:
        return self._text()


# --------------------------------------------------------------------------------------------
# Grouping the trace into incarnations


class _Incarnation:
    """One ADMIT..CLEANUP life of a request id, with every event attributed to it."""

    __slots__ = ("admit", "cleaned", "events", "partial", "readmit", "rid")

    def __init__(self, rid: str, admit: TraceEvent | None) -> None:
        self.rid = rid
        # None for a partial incarnation (its ADMIT was cut off a truncated trace).
        self.admit = admit
        self.partial = admit is None
        self.events: list[TraceEvent] = [] if admit is None else [admit]
        self.cleaned = False  # its CLEANUP was seen
        # The next incarnation of the id when its ADMIT came before this one's CLEANUP.
        self.readmit: _Incarnation | None = None


@dataclass(slots=True)
class _Trace:
    incarnations: list[_Incarnation]
    # Events of an id with no incarnation at the time (never admitted), per id.
    strays: dict[str, list[TraceEvent]]
    engine: list[TraceEvent]
    crash_seqs: list[int]  # seqs of CRASH and RESTART, ascending
    closed_event: TraceEvent | None
    closed: bool

    def history(self, inc: _Incarnation) -> tuple[TraceEvent, ...]:
        if inc.readmit is not None:
            merged = inc.events + inc.readmit.events
            merged.sort(key=_seq)
            return tuple(merged)
        return tuple(inc.events)


def _seq(e: TraceEvent) -> int:
    return e.seq


def _build(events: Iterable[TraceEvent], closed: bool | None) -> _Trace:
    evs = list(events)
    if any(evs[i].seq > evs[i + 1].seq for i in range(len(evs) - 1)):
        evs.sort(key=_seq)
    truncated = bool(evs) and evs[0].seq > 0
    incarnations: list[_Incarnation] = []
    strays: dict[str, list[TraceEvent]] = {}
    engine: list[TraceEvent] = []
    crash_seqs: list[int] = []
    closed_event: TraceEvent | None = None
    latest: dict[str, _Incarnation] = {}
    # Per id, the incarnations whose consumer may still read, oldest first.
    readers: dict[str, deque[_Incarnation]] = {}
    # (id, step_id) of every EXEC_START still waiting for its EXEC_RESULT: a late result
    # belongs to the incarnation that started the step, even if the id was admitted again.
    in_flight: dict[tuple[str, int | None], _Incarnation] = {}

    def stop_reading(inc: _Incarnation) -> None:
        queue = readers.get(inc.rid)
        if queue is not None and inc in queue:
            queue.remove(inc)

    for e in evs:
        rid = e.request_id
        kind = e.kind
        if rid is None:
            engine.append(e)
            if kind is _CRASH or kind is _RESTART:
                crash_seqs.append(e.seq)
            elif kind is _CLOSED and closed_event is None:
                closed_event = e
            continue
        if kind is _ADMIT:
            new = _Incarnation(rid, e)
            old = latest.get(rid)
            if old is not None and not old.partial and not old.cleaned:
                old.readmit = new
            latest[rid] = new
            incarnations.append(new)
            readers.setdefault(rid, deque()).append(new)
            continue
        inc: _Incarnation | None
        if kind is _RECEIVED:
            queue = readers.get(rid)
            inc = queue[0] if queue else latest.get(rid)
        elif kind is _EXEC_RESULT:
            inc = in_flight.pop((rid, e.step_id), None) or latest.get(rid)
        else:
            inc = latest.get(rid)
        if inc is None:
            if truncated:
                inc = _Incarnation(rid, None)
                latest[rid] = inc
                incarnations.append(inc)
            else:
                strays.setdefault(rid, []).append(e)
                continue
        inc.events.append(e)
        if kind is _EXEC_START:
            in_flight[(rid, e.step_id)] = inc
        elif kind is _CLEANUP:
            inc.cleaned = True
        elif kind is _CONSUMER_DROP:
            stop_reading(inc)
        elif kind is _RECEIVED:
            if e.detail.get("finished"):
                stop_reading(inc)
        elif kind is _OUTPUT and e.detail.get("delivered") is False:
            stop_reading(inc)
    is_closed = closed_event is not None if closed is None else closed
    return _Trace(incarnations, strays, engine, crash_seqs, closed_event, is_closed)


def _status_name(value: Any) -> str:
    """A status as its name: enum members, their int values and "RequestStatus.X" all work."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            return RequestStatus(value).name
        except ValueError:
            return str(value)
    text = str(value)
    return text.rsplit(".", 1)[-1]


def _nonempty(value: Any) -> bool:
    if value is None or value is False:
        return False
    if isinstance(value, int | float):
        return value != 0
    if isinstance(value, str | bytes | list | tuple | set | frozenset | dict):
        return len(value) > 0
    return True


class _Report:
    """Collects violations for one invariant."""

    def __init__(self, trace: _Trace, invariant: str) -> None:
        self.trace = trace
        self.invariant = invariant
        self.items: list[Violation] = []

    def inc(self, inc: _Incarnation, message: str, at: TraceEvent | None = None) -> None:
        self.items.append(
            Violation(
                self.invariant,
                message,
                inc.rid,
                self.trace.history(inc),
                None if at is None else at.seq,
            )
        )

    def stray(self, rid: str, message: str, at: TraceEvent) -> None:
        history = tuple(self.trace.strays.get(rid, ()))
        self.items.append(Violation(self.invariant, message, rid, history, at.seq))

    def engine(self, message: str, history: Sequence[TraceEvent], at: TraceEvent) -> None:
        self.items.append(Violation(self.invariant, message, None, tuple(history), at.seq))


def _at(e: TraceEvent) -> str:
    return f"{e.kind.value.upper()} (seq {e.seq})"


def _sorted(items: list[Violation]) -> list[Violation]:
    return sorted(items, key=lambda v: (v.invariant, -1 if v.seq is None else v.seq))


def _checked(trace: _Trace) -> Iterable[_Incarnation]:
    return (inc for inc in trace.incarnations if not inc.partial)


# --------------------------------------------------------------------------------------------
# The invariants, each over a grouped trace


def _inv1(t: _Trace) -> list[Violation]:
    r = _Report(t, "INV-1")
    for inc in _checked(t):
        terminal = output = cleanup = None
        for e in inc.events:
            kind = e.kind
            if kind is _TERMINAL:
                if terminal is not None:
                    r.inc(inc, f"second TERMINAL (seq {e.seq}); the first was {_at(terminal)}", e)
                else:
                    terminal = e
            elif kind is _OUTPUT:
                if output is not None:
                    r.inc(inc, f"second OUTPUT (seq {e.seq}); the first was {_at(output)}", e)
                    continue
                output = e
                if terminal is None:
                    r.inc(inc, f"OUTPUT (seq {e.seq}) before any TERMINAL", e)
                else:
                    got = _status_name(e.detail.get("status"))
                    want = _status_name(terminal.detail.get("status"))
                    if got != want:
                        r.inc(
                            inc, f"OUTPUT (seq {e.seq}) has status {got}, TERMINAL said {want}", e
                        )
            elif kind is _CLEANUP:
                if cleanup is not None:
                    r.inc(inc, f"second CLEANUP (seq {e.seq}); the first was {_at(cleanup)}", e)
                    continue
                cleanup = e
                if output is None:
                    r.inc(inc, f"CLEANUP (seq {e.seq}) before any OUTPUT", e)
        if inc.readmit is not None and inc.readmit.admit is not None:
            again = inc.readmit.admit
            r.inc(
                inc, f"id admitted again at {_at(again)} before this incarnation's CLEANUP", again
            )
        if t.closed:
            missing = [
                name
                for name, seen in (("TERMINAL", terminal), ("OUTPUT", output), ("CLEANUP", cleanup))
                if seen is None
            ]
            if missing:
                r.inc(inc, f"closed trace, but the request never had its {', '.join(missing)}")
    return r.items


def _inv2(t: _Trace) -> list[Violation]:
    r = _Report(t, "INV-2")
    for inc in _checked(t):
        scheduled: set[int | None] = set()
        started: set[int | None] = set()
        terminal = cleanup = None
        for e in inc.events:
            kind = e.kind
            if kind is _SCHEDULE:
                if cleanup is not None:
                    r.inc(
                        inc, f"SCHEDULE (seq {e.seq}) of an id no longer admitted (cleaned up)", e
                    )
                elif terminal is not None:
                    r.inc(inc, f"SCHEDULE (seq {e.seq}) after TERMINAL (seq {terminal.seq})", e)
                scheduled.add(e.step_id)
            elif kind is _EXEC_START:
                if e.step_id not in scheduled:
                    r.inc(inc, f"EXEC_START (seq {e.seq}) of step {e.step_id}, never scheduled", e)
                elif terminal is not None:
                    r.inc(inc, f"EXEC_START (seq {e.seq}) after TERMINAL (seq {terminal.seq})", e)
                started.add(e.step_id)
            elif kind is _EXEC_RESULT:
                if e.step_id not in started:
                    r.inc(inc, f"EXEC_RESULT (seq {e.seq}) of step {e.step_id}, never started", e)
            elif kind is _TERMINAL:
                if terminal is None:
                    terminal = e
            elif kind is _CLEANUP and cleanup is None:
                cleanup = e
    for rid, evs in t.strays.items():
        for e in evs:
            if e.kind in (_SCHEDULE, _EXEC_START, _EXEC_RESULT):
                r.stray(rid, f"{_at(e)} of an id that is not admitted", e)
    return r.items


def _inv3(t: _Trace) -> list[Violation]:
    r = _Report(t, "INV-3")
    closed_at = t.closed_event
    for inc in _checked(t):
        terminal = cleanup = None
        running: set[int | None] = set()  # steps started and not yet answered
        for e in inc.events:
            kind = e.kind
            if kind is _EXEC_START:
                running.add(e.step_id)
            elif kind is _EXEC_RESULT and e.step_id in running:
                running.discard(e.step_id)
                if cleanup is not None:
                    continue  # the late result of a forward in flight when it ended: dropped
            if cleanup is not None and kind is not _RECEIVED:
                r.inc(inc, f"{_at(e)} after CLEANUP (seq {cleanup.seq})", e)
            if kind is _TERMINAL:
                if terminal is None:
                    terminal = e
            elif kind is _CLEANUP and cleanup is None:
                cleanup = e
        if not t.closed:
            continue
        if terminal is not None and (cleanup is None or cleanup.seq < terminal.seq):
            r.inc(inc, f"TERMINAL (seq {terminal.seq}) never followed by CLEANUP", terminal)
        elif terminal is None:
            r.inc(inc, "still live when the trace closed: no TERMINAL, no CLEANUP")
        elif closed_at is not None and cleanup is not None and cleanup.seq > closed_at.seq:
            r.inc(
                inc, f"CLEANUP (seq {cleanup.seq}) only after CLOSED (seq {closed_at.seq})", cleanup
            )
    for e in t.engine:
        if e.kind is not _CLOSED:
            continue
        leftovers = e.detail.get("leftovers")
        if isinstance(leftovers, dict):
            held = {k: v for k, v in leftovers.items() if _nonempty(v)}
        else:
            held = {"leftovers": leftovers} if _nonempty(leftovers) else {}
        if held:
            history = [x for x in t.engine if x.kind in (_CLOSE, _CLOSED)]
            r.engine(f"engine closed with state left: {held}", history, e)
    return r.items


def _inv4(t: _Trace) -> list[Violation]:
    r = _Report(t, "INV-4")
    for rid, evs in t.strays.items():
        kinds = sorted({e.kind.value.upper() for e in evs})
        r.stray(
            rid,
            f"{len(evs)} event(s) of an id with no admitted incarnation ({', '.join(kinds)}), "
            f"first {_at(evs[0])}",
            evs[0],
        )
    for inc in _checked(t):
        scheduled: set[int | None] = set()
        started: set[int | None] = set()
        for e in inc.events:
            if e.kind is _SCHEDULE:
                if e.step_id in scheduled:
                    r.inc(inc, f"scheduled twice in step {e.step_id}: {_at(e)}", e)
                scheduled.add(e.step_id)
            elif e.kind is _EXEC_START:
                if e.step_id in started:
                    r.inc(inc, f"started twice in step {e.step_id}: {_at(e)}", e)
                started.add(e.step_id)
    return r.items


def _inv5(t: _Trace) -> list[Violation]:
    r = _Report(t, "INV-5")
    for inc in _checked(t):
        assert inc.admit is not None
        rid = inc.rid
        seed = inc.admit.detail.get("seed")
        terminal = cleanup = finished = None
        last_chunk: Any = None
        for e in inc.events:
            kind = e.kind
            if kind is _TERMINAL:
                if terminal is None:
                    terminal = e
            elif kind is _CLEANUP:
                if cleanup is None:
                    cleanup = e
            elif kind is _CHUNK:
                if cleanup is not None:
                    r.inc(inc, f"CHUNK (seq {e.seq}) after CLEANUP (seq {cleanup.seq})", e)
                elif terminal is not None:
                    r.inc(inc, f"CHUNK (seq {e.seq}) after TERMINAL (seq {terminal.seq})", e)
            elif kind is _OUTPUT:
                if cleanup is not None:
                    r.inc(inc, f"OUTPUT (seq {e.seq}) after CLEANUP (seq {cleanup.seq})", e)
            elif kind is _RECEIVED:
                d = e.detail
                if finished is not None:
                    r.inc(inc, f"{_at(e)} after the finished result {_at(finished)}", e)
                    continue
                identity = d.get("identity")
                if isinstance(identity, dict):
                    if identity.get("request_id") != rid:
                        r.inc(
                            inc,
                            f"{_at(e)} carries the image of request {identity.get('request_id')!r}",
                            e,
                        )
                    if seed is not None and identity.get("seed") != seed:
                        r.inc(
                            inc,
                            f"{_at(e)}: the image has seed {identity.get('seed')!r}, "
                            f"admitted with {seed!r}",
                            e,
                        )
                got_seed = d.get("seed")
                if seed is not None and got_seed is not None and got_seed != seed:
                    r.inc(inc, f"{_at(e)} has seed {got_seed!r}, admitted with {seed!r}", e)
                chunk = d.get("chunk_index")
                if chunk is not None:
                    if last_chunk is not None and chunk <= last_chunk:
                        r.inc(inc, f"{_at(e)} has chunk {chunk} after chunk {last_chunk}", e)
                    last_chunk = chunk
                if d.get("finished"):
                    finished = e
                    if terminal is None:
                        r.inc(inc, f"finished result {_at(e)} before any TERMINAL", e)
                    else:
                        got = _status_name(d.get("status"))
                        want = _status_name(terminal.detail.get("status"))
                        if got != want:
                            r.inc(inc, f"{_at(e)} has status {got}, TERMINAL said {want}", e)
    for rid, evs in t.strays.items():
        for e in evs:
            if e.kind is _CHUNK or e.kind is _OUTPUT:
                r.stray(rid, f"{_at(e)} for an id that is not admitted", e)
    return r.items


def _inv6(t: _Trace, max_idle_s: float | None) -> list[Violation]:
    r = _Report(t, "INV-6")
    if t.closed:
        for inc in _checked(t):
            if not any(e.kind is _TERMINAL for e in inc.events):
                r.inc(inc, "closed trace, but the request never reached a terminal state")
    for e in t.engine:
        if e.kind is _STALL:
            phase = e.detail.get("phase")
            if phase not in STALL_PHASES:
                r.engine(
                    f"STALL (seq {e.seq}) names phase {phase!r}, not one of {sorted(STALL_PHASES)}",
                    [e],
                    e,
                )
    if max_idle_s is None:
        return r.items
    crashes = t.crash_seqs
    for inc in _checked(t):
        prev: TraceEvent | None = None
        for e in inc.events:
            if e.kind is _RECEIVED:
                continue
            if prev is not None and e.time - prev.time > max_idle_s:
                i = bisect.bisect_right(crashes, prev.seq)
                if not (i < len(crashes) and crashes[i] < e.seq):
                    r.inc(
                        inc,
                        f"no event for {e.time - prev.time:.3f} s (> max_idle_s={max_idle_s}) "
                        f"between {_at(prev)} and {_at(e)}",
                        e,
                    )
            if e.kind is _CLEANUP:
                break
            prev = e
    return r.items


# Promptness: denoising steps a request-mode forward may start after the abort of every request
# in it reached its worker (the step running then finishes; the next one may have begun).
MAX_STEPS_AFTER_ABORT = 1


def _inv7(t: _Trace, abort_latency_s: float | None) -> list[Violation]:
    r = _Report(t, "INV-7")
    for inc in _checked(t):
        abort = terminal = moved_on = None
        for e in inc.events:
            kind = e.kind
            if kind is _TERMINAL:
                if terminal is not None:
                    continue
                terminal = e
                if abort is not None and abort_latency_s is not None:
                    latency = e.time - abort.time
                    if latency > abort_latency_s:
                        r.inc(
                            inc,
                            f"TERMINAL (seq {e.seq}) came {latency:.3f} s after {_at(abort)} "
                            f"(> abort_latency_s={abort_latency_s})",
                            e,
                        )
            elif kind is _ABORT or kind is _CONSUMER_DROP:
                if abort is None and terminal is None:
                    abort = e
            elif abort is not None and terminal is None:
                if kind is _SCHEDULE or kind is _EXEC_START or kind is _CHUNK:
                    r.inc(inc, f"{_at(e)} after {_at(abort)}", e)
                if (
                    moved_on is None
                    and kind in _AFTER_ABORT_TERMINAL
                    and not (kind is _EXEC_RESULT and e.detail.get("outcome") == "pending")
                ):
                    moved_on = e
        if abort is not None and terminal is None and (t.closed or moved_on is not None):
            why = "the trace closed" if moved_on is None else f"{_at(moved_on)} came"
            r.inc(inc, f"{_at(abort)} never reached TERMINAL, though {why}", moved_on or abort)
        for e in inc.events:  # promptness, as the worker measured it
            after = e.detail.get("steps_after_abort") if e.kind is _EXEC_RESULT else None
            if isinstance(after, int) and after > MAX_STEPS_AFTER_ABORT:
                r.inc(
                    inc,
                    f"{_at(e)}: its forward started {after} more denoising steps after the abort "
                    f"of every request in it reached the worker (at most {MAX_STEPS_AFTER_ABORT})",
                    e,
                )
    return r.items


# --------------------------------------------------------------------------------------------
# Public entry points


def check_inv1_single_owner(
    events: Iterable[TraceEvent], *, closed: bool | None = None
) -> list[Violation]:
    """INV-1: per incarnation at most one TERMINAL and one OUTPUT (after the TERMINAL, same
    status), CLEANUP after OUTPUT, no second ADMIT before CLEANUP; when closed, exactly one of
    each."""
    return _sorted(_inv1(_build(events, closed)))


def check_inv2_execution_follows_schedule(
    events: Iterable[TraceEvent], *, closed: bool | None = None
) -> list[Violation]:
    """INV-2: EXEC_START only for a step the request was scheduled in, before its TERMINAL;
    EXEC_RESULT only after its EXEC_START; no SCHEDULE after TERMINAL or of an id not admitted."""
    return _sorted(_inv2(_build(events, closed)))


def check_inv3_terminal_cleanup(
    events: Iterable[TraceEvent], *, closed: bool | None = None
) -> list[Violation]:
    """INV-3: nothing but RECEIVED after a CLEANUP; when closed, every TERMINAL followed by
    CLEANUP before CLOSED, no live incarnation left, and CLOSED leftovers empty."""
    return _sorted(_inv3(_build(events, closed)))


def check_inv4_no_second_lifecycle(
    events: Iterable[TraceEvent], *, closed: bool | None = None
) -> list[Violation]:
    """INV-4: every event of an id belongs to an admitted incarnation; no (id, step_id) is
    scheduled or started twice in one incarnation."""
    return _sorted(_inv4(_build(events, closed)))


def check_inv5_identity(
    events: Iterable[TraceEvent], *, closed: bool | None = None
) -> list[Violation]:
    """INV-5: what the consumer received carries its own request id and seed, chunks in strictly
    increasing order, nothing after the finished result, whose status is the TERMINAL's; no
    CHUNK or OUTPUT outside a live incarnation."""
    return _sorted(_inv5(_build(events, closed)))


def check_inv6_bounded_waits(
    events: Iterable[TraceEvent], *, closed: bool | None = None, max_idle_s: float | None = None
) -> list[Violation]:
    """INV-6: when closed, every incarnation reached TERMINAL; every STALL names a known phase;
    with ``max_idle_s``, no gap longer than that between a live request's own events unless a
    CRASH or RESTART came in between."""
    return _sorted(_inv6(_build(events, closed), max_idle_s))


def check_inv7_prompt_cancellation(
    events: Iterable[TraceEvent],
    *,
    closed: bool | None = None,
    abort_latency_s: float | None = None,
) -> list[Violation]:
    """INV-7: after an ABORT or CONSUMER_DROP of a live request, no SCHEDULE, EXEC_START or
    CHUNK; its TERMINAL follows (required when closed or once the engine has visibly moved
    on: a later OUTPUT, CLEANUP or non-pending EXEC_RESULT), within ``abort_latency_s``."""
    return _sorted(_inv7(_build(events, closed), abort_latency_s))


def check_trace(
    events: Iterable[TraceEvent],
    *,
    closed: bool | None = None,
    abort_latency_s: float | None = None,
    max_idle_s: float | None = None,
) -> list[Violation]:
    """Run every invariant check over ``events``; the violations sorted by invariant and seq.

    ``closed``: whether the trace is complete (None: it is iff it holds a CLOSED event).
    ``abort_latency_s``: the longest allowed time from an abort to its TERMINAL (None: any).
    ``max_idle_s``: the longest allowed gap between a live request's own events (None: any).
    """
    t = _build(events, closed)
    checks: list[Callable[[], list[Violation]]] = [
        lambda: _inv1(t),
        lambda: _inv2(t),
        lambda: _inv3(t),
        lambda: _inv4(t),
        lambda: _inv5(t),
        lambda: _inv6(t, max_idle_s),
        lambda: _inv7(t, abort_latency_s),
    ]
    found: list[Violation] = []
    for check in checks:
        found.extend(check())
    return _sorted(found)


def assert_trace_ok(
    events: Iterable[TraceEvent],
    *,
    closed: bool | None = None,
    abort_latency_s: float | None = None,
    max_idle_s: float | None = None,
) -> None:
    """Raise :class:`InvariantViolation` (an AssertionError) if :func:`check_trace` finds any."""
    violations = check_trace(
        events, closed=closed, abort_latency_s=abort_latency_s, max_idle_s=max_idle_s
    )
    if violations:
        raise InvariantViolation(violations)


# --------------------------------------------------------------------------------------------
# Liveness: every live request moves, as time goes by

# Where a request whose last own event is of this kind waits: queued requests wait for the
# engine (any progress of any request counts as theirs), the others for their own next event.
_QUEUED_AFTER = frozenset({_ADMIT, _REQUEUE, _PREEMPT})
# Engine-wide events after which everyone's clock starts again (a group failed or
# restarted, the engine fell asleep or woke up).  Not STALL: one request's stalled output
# says nothing of the others.
_ENGINE_PROGRESS = frozenset({_CRASH, _RESTART, _WAKE, _SLEEP})
# A request's events that show the engine's work moving (what a queued request waits for):
# not what callers do (admissions, aborts, drops), which go on while the engine is stuck.
_WORK_PROGRESS = frozenset({_SCHEDULE, _EXEC_START, _EXEC_RESULT, _CHUNK, _REQUEUE, _PREEMPT})


def _phase(e: TraceEvent) -> str:
    """Where a live request is, as its last own event says."""
    kind = e.kind
    if kind in _QUEUED_AFTER:
        return "queued"
    if kind is _SCHEDULE or kind is _EXEC_START:
        return "in a forward"
    if kind is _EXEC_RESULT:
        if e.detail.get("outcome") == "pending":
            return "packing its output"
        return "between steps"
    if kind is _CHUNK:
        return "streaming"
    if kind is _ABORT or kind is _CONSUMER_DROP:
        return "being aborted"
    return f"after {kind.value.upper()}"


def check_liveness(
    events: Iterable[TraceEvent],
    now: float,
    *,
    bound_s: float,
    restart_bound_s: float | None = None,
    queue_bound_s: float | None = None,
    dropped: Collection[str] = (),
) -> list[Violation]:
    """INV-6 as time passes (the liveness oracle): no live request of a running engine goes
    without progress for longer than its bound, whatever phase it is in.

    ``now`` is the engine's clock (the clock of the trace's times).  A request waits at most
    ``bound_s`` for its own next event after being scheduled, running a forward, packing,
    streaming or being aborted; a queued one (admitted, requeued, preempted) at most
    ``bound_s`` without the engine's work moving for *any* request (a schedule, a forward,
    a chunk; admissions and aborts are what callers do: they go on while the engine is
    stuck) and
    at most ``queue_bound_s`` in all (starvation; None: unbounded).  While a worker group
    restarts (a CRASH not yet followed by RESTART) every bound is ``restart_bound_s`` from
    the crash.  After its TERMINAL a request's OUTPUT follows within ``bound_s``, and a
    delivered terminal output reaches its consumer (a finished RECEIVED) within ``bound_s``
    unless the consumer dropped it (a CONSUMER_DROP, or its id in ``dropped``: consumers the
    caller stopped).  Each violation names the phase the request is stuck
    in and its last event.  Only meaningful for an engine that is awake and open.
    """
    t = _build(events, False)
    r = _Report(t, "INV-6")
    engine_moved = float("-inf")  # the latest event of the engine itself
    anyone_moved = float("-inf")  # the latest event of anyone
    crashed_at: float | None = None  # a group failure not yet followed by its restart
    for e in t.engine:
        if e.kind in _ENGINE_PROGRESS:
            engine_moved = max(engine_moved, e.time)
            anyone_moved = max(anyone_moved, e.time)
        if e.kind is _CRASH:
            crashed_at = e.time if crashed_at is None else crashed_at
        elif e.kind is _RESTART:
            crashed_at = None
    for inc in t.incarnations:
        for e in inc.events:
            if e.kind in _WORK_PROGRESS:
                anyone_moved = max(anyone_moved, e.time)
    restarting = crashed_at is not None and restart_bound_s is not None
    for inc in _checked(t):
        own = [e for e in inc.events if e.kind is not _RECEIVED]
        if not own:
            continue
        terminal = next((e for e in own if e.kind is _TERMINAL), None)
        if terminal is not None:
            if inc.rid not in dropped:
                _check_delivery(r, inc, terminal, now, bound_s)
            continue
        last = own[-1]
        phase = _phase(last)
        if restarting:
            assert crashed_at is not None and restart_bound_s is not None
            since, limit, what = max(last.time, crashed_at), restart_bound_s, "the restart"
        elif phase == "queued":
            since, limit, what = max(last.time, anyone_moved), bound_s, "any request"
        else:
            since, limit, what = max(last.time, engine_moved), bound_s, "it"
        if now - since > limit:
            r.inc(
                inc,
                f"{phase} for {now - since:.2f} s without progress of {what} "
                f"(> {limit:g} s; last own event {_at(last)})",
                last,
            )
        elif (
            phase == "queued"
            and queue_bound_s is not None
            and not restarting
            and now - last.time > queue_bound_s
        ):
            r.inc(
                inc,
                f"queued for {now - last.time:.2f} s since {_at(last)} while others ran "
                f"(> {queue_bound_s:g} s: starved)",
                last,
            )
    return _sorted(r.items)


def _check_delivery(
    r: _Report, inc: _Incarnation, terminal: TraceEvent, now: float, bound_s: float
) -> None:
    """After TERMINAL: its OUTPUT, and (delivered, consumer still reading) its receipt."""
    output = next((e for e in inc.events if e.kind is _OUTPUT), None)
    if output is None:
        if now - terminal.time > bound_s:
            r.inc(inc, f"{_at(terminal)} {now - terminal.time:.2f} s ago but no OUTPUT", terminal)
        return
    if output.detail.get("delivered") is False:
        return
    if any(e.kind is _CONSUMER_DROP for e in inc.events):
        return
    if any(e.kind is _RECEIVED and e.detail.get("finished") for e in inc.events):
        return
    if now - output.time > bound_s:
        r.inc(
            inc,
            f"its terminal {_at(output)} was sent {now - output.time:.2f} s ago but its "
            "consumer has not received it",
            output,
        )


# --------------------------------------------------------------------------------------------
# Leftovers: what the components hold, against the trace

#: Kinds that may only ever hold live requests: they are released in the same synchronous
#: step that ends the request (the engine core, its streams, the result pump's claims and
#: split outputs; a whole-batch output may wait for its forward's reply: ``in_flight``).
STRICT_KINDS = frozenset(
    {
        "requests",
        "scheduler_states",
        "streams",
        "awaited_outputs",
        "engine_streams",
        "pump_claims",
        "pump_cached",
    }
)
#: Kinds whose entries belong to no one request (their names are the resource's own): empty
#: once the engine settled.  ``shm_segments``: our segments in /dev/shm (a payload travelling
#: between processes is consumed, and its segment unlinked, as it arrives).
ENGINE_WIDE_KINDS = frozenset({"shm_segments"})
#: Kinds released once the work in flight for a request has drained (a forward reaching
#: its step boundary, a packer finishing, a late arrival being released): checked only when
#: the engine is settled (``wait_idle``), and then they too must hold only live requests.
SETTLING_KINDS = frozenset(
    {
        "pump_tombstones",
        "pump_unsplit",
        "runner_progress",
        "step_states",
        "stop_flags",
        "abort_marks",
        "packer_queue",
    }
)


def _live_ids(t: _Trace) -> tuple[set[str], set[str]]:
    """(ids with a live incarnation, ids of every incarnation seen) of a grouped trace."""
    live: set[str] = set()
    seen: set[str] = set()
    for inc in t.incarnations:
        seen.add(inc.rid)
        if inc.partial:
            continue
        if inc.cleaned:
            live.discard(inc.rid)
        else:
            live.add(inc.rid)
    return live, seen


def check_leftovers(
    held: Mapping[str, Collection[str]],
    events: Iterable[TraceEvent],
    *,
    in_flight: Collection[str] = (),
    settled: bool = False,
) -> list[Violation]:
    """INV-3 over what the components hold now: ``held`` maps a resource kind to the ids of
    the requests it holds something for (``AsyncEngine.leftovers()``, merged with
    ``worker_leftovers()`` when ``settled``).

    - A :data:`STRICT_KINDS` kind may hold only live requests (admitted in ``events`` and
      not cleaned up); ``pump_cached`` may also hold ``in_flight`` ids (a whole batch whose
      forward's reply has not been applied yet).
    - With ``settled`` (the engine is idle and its workers drained), so may every other kind,
      and :data:`ENGINE_WIDE_KINDS` (shared-memory segments) must be empty.
    - Every live request is held by the core (``requests``): none is lost.
    - The core and its shell agree: ``streams`` equals ``engine_streams`` and
      ``awaited_outputs`` equals ``pump_claims`` (each awaited output is claimed from the
      pump, and nothing else is).

    Ids whose incarnation began before a truncated trace are not judged.
    """
    t = _build(events, None)
    live, seen = _live_ids(t)
    truncated = bool(t.incarnations) and any(inc.partial for inc in t.incarnations)
    flying = set(in_flight)
    r = _Report(t, "INV-3")
    latest = {inc.rid: inc for inc in t.incarnations}

    def fail(rid: str, message: str) -> None:
        inc = latest.get(rid)
        if inc is not None:
            r.inc(inc, message)
        else:
            r.items.append(Violation("INV-3", message, rid, tuple(t.strays.get(rid, ())), None))

    for kind in sorted(held):
        strict = kind in STRICT_KINDS
        if not strict and not settled:
            continue
        if kind in ENGINE_WIDE_KINDS:
            for name in sorted(held[kind]):
                message = f"{kind} still holds {name!r} after the engine settled"
                r.items.append(Violation("INV-3", message, None, (), None))
            continue
        for rid in sorted(held[kind]):
            if rid in live:
                continue
            if kind == "pump_cached" and rid in flying:
                continue
            if truncated and rid not in seen:
                continue
            state = "cleaned up" if rid in seen else "never admitted"
            when = "" if strict else " after the engine settled"
            fail(rid, f"{kind} still holds request {rid!r}{when}, which is {state}")
    if "requests" in held:
        for rid in sorted(live - set(held["requests"])):
            fail(rid, f"request {rid!r} is live in the trace but the engine core holds nothing")
    for core_kind, shell_kind in (
        ("streams", "engine_streams"),
        ("awaited_outputs", "pump_claims"),
    ):
        if core_kind in held and shell_kind in held:
            mine, theirs = set(held[core_kind]), set(held[shell_kind])
            for rid in sorted(mine ^ theirs):
                has, lacks = (core_kind, shell_kind) if rid in mine else (shell_kind, core_kind)
                fail(rid, f"{has} holds request {rid!r} but {lacks} does not")
    return _sorted(r.items)
