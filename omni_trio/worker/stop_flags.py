"""Cooperative stop flags shared between the event loop and a forward running in a thread.

The engine (or an executor's control path) marks request ids as aborted; the runner checks
the flags before every denoising step and stops a forward whose requests are *all* aborted.
A fused batch with one live member runs on; the aborted member's result is discarded.
Set and frozenset operations on these attributes are atomic under the GIL, which is the
only synchronisation needed between one writer (the loop) and one reader (the forward).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["ForwardStopped", "StopFlags"]


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
        while True:
            try:
                return set(self._aborted)
            except RuntimeError:  # pragma: no cover - resized by the other thread meanwhile
                continue
