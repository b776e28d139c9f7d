"""Cooperative stop flags shared between the event loop and a forward running in a thread.

The engine (or an executor's control path) marks request ids as aborted; the runner checks
the flags before every denoising step and stops a forward whose requests are *all* aborted.
A fused batch with one live member runs on; the aborted member's result is discarded.
Set and frozenset operations on these attributes are atomic under the GIL, which is the
only synchronisation needed between one writer (the loop) and one reader (the forward).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["AbortMarks", "ForwardStopped", "StopFlags"]


def _snapshot(ids: Iterable[str]) -> set[str]:
    """A copy of a set or dict's keys that the other thread may be resizing meanwhile."""
    while True:
        try:
            return set(ids)
        except RuntimeError:  # pragma: no cover - resized by the other thread meanwhile
            continue


class ForwardStopped(Exception):
    """Raised inside a forward at a step boundary because all of its requests were aborted."""

    def __init__(self, request_ids: Iterable[str], step: int) -> None:
        ids = tuple(request_ids)
        super().__init__(f"forward of {', '.join(ids)} stopped before step {step}")
        self.request_ids = ids
        self.step = step


class StopFlags:
    """Which request ids must stop; ``stop_everything`` stops every forward (close/shutdown)."""

    def __init__(self) -> None:
        self._aborted: set[str] = set()
        self._everything = False

    def abort(self, request_ids: Iterable[str]) -> None:
        self._aborted.update(request_ids)

    def stop_everything(self) -> None:
        self._everything = True

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop flags of requests whose work is over (keeps the set bounded)."""
        self._aborted.difference_update(request_ids)

    def is_aborted(self, request_id: str) -> bool:
        return self._everything or request_id in self._aborted

    def should_stop(self, request_ids: Iterable[str]) -> bool:
        """True when every request of a forward is aborted (or everything must stop)."""
        if self._everything:
            return True
        ids = list(request_ids)
        return bool(ids) and all(rid in self._aborted for rid in ids)

    def __len__(self) -> int:
        return len(self._aborted)

    def aborted_ids(self) -> set[str]:
        """The ids flagged now (a copy; any thread)."""
        return _snapshot(self._aborted)


class AbortMarks:
    """When each abort reached this worker, in steps: the denoising steps its forward had
    started by then (0 if it had not started).  Kept apart from :class:`StopFlags`, which
    decide whether a forward stops, so that promptness (INV-7) is measured, not assumed: a
    forward reports the steps it started after the last of its requests was marked
    (:attr:`RunnerOutput.steps_after_abort`).  Written by the loop, read by the forward.
    Request aborts only: a stop of everything (close) is not measured, nor is step mode (an
    aborted request is simply not scheduled again)."""

    def __init__(self) -> None:
        self._marks: dict[str, int] = {}

    def mark(self, request_ids: Iterable[str], started: dict[str, int]) -> None:
        """``request_ids`` were aborted now; ``started``: steps started per running id."""
        for rid in request_ids:
            self._marks.setdefault(rid, started.get(rid, 0))

    def steps_after(self, request_ids: Iterable[str], started: int) -> int | None:
        """Steps a forward of ``request_ids`` started after the last of them was marked,
        having started ``started`` in all; None unless every one of them is marked."""
        marks = [self._marks.get(rid) for rid in request_ids]
        if not marks or any(m is None for m in marks):
            return None
        return max(0, started - max(m for m in marks if m is not None))

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._marks.pop(rid, None)

    def marked_ids(self) -> set[str]:
        """The ids marked now (a copy; any thread)."""
        return _snapshot(self._marks)

    def __len__(self) -> int:
        return len(self._marks)
