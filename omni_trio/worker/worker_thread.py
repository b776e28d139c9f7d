"""A dedicated, owned OS thread that runs blocking worker calls for a trio program.

Why not ``trio.to_thread``: its threads are pooled and outlive the call, and a cancelled
``to_thread`` call abandons a thread that may still be running a forward on the model.  Here
one thread belongs to one worker; jobs run one at a time in submission order; a cancelled
caller first asks the job to stop (``on_cancel``) and then waits for it, so two forwards never
run on one pipeline; ``stop()`` ends and joins the thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import outcome
import trio

from ..errors import EngineClosedError, StallError

__all__ = ["WorkerThread"]

log = logging.getLogger(__name__)
T = TypeVar("T")
_Job = tuple[Callable[[], Any], Callable[[outcome.Outcome[Any]], None]]


class WorkerThread:
    """Runs callables in one owned thread; results come back to the trio loop."""

    def __init__(self, name: str, *, stall_timeout_s: float | None = 30.0) -> None:
        self.name = name
        self.stall_timeout_s = stall_timeout_s
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._token: trio.lowlevel.TrioToken | None = None
        self._exited = trio.Event()
        self._stopping = False

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        """Start the thread; must be called from inside the trio run that will use it."""
        self._token = trio.lowlevel.current_trio_token()
        self._thread.start()

    def _main(self) -> None:
        try:
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                fn, deliver = job
                deliver(outcome.capture(fn))
                del job, fn, deliver  # drop references to results and models promptly
        finally:
            self._call_soon(self._exited.set)

    def _call_soon(self, fn: Callable[[], None]) -> None:
        assert self._token is not None
        try:
            self._token.run_sync_soon(fn)
        except trio.RunFinishedError:  # the trio run is gone; nobody is waiting any more
            pass

    async def run(
        self,
        fn: Callable[[], T],
        *,
        on_cancel: Callable[[], None] | None = None,
        abandon_on_cancel: bool = False,
    ) -> T:
        """Run ``fn()`` in the thread and return its result (or raise its exception).

        If cancelled: ``on_cancel`` is called (it should make ``fn`` return soon, e.g. set a
        stop flag); then, unless ``abandon_on_cancel``, the call waits (shielded, at most
        ``stall_timeout_s``) for ``fn`` to finish before ``Cancelled`` propagates, so the
        thread is never left running work its caller believes is over.  Raises
        :class:`StallError` if that wait runs out, :class:`EngineClosedError` after ``stop()``.
        """
        if self._stopping or self._token is None:
            raise EngineClosedError(f"{self.name} is stopped")
        done = trio.Event()
        box: list[outcome.Outcome[T]] = []

        def deliver(result: outcome.Outcome[T]) -> None:
            def settle() -> None:
                box.append(result)
                done.set()

            self._call_soon(settle)

        self._jobs.put((fn, deliver))
        try:
            await done.wait()
        except trio.Cancelled:
            if on_cancel is not None:
                on_cancel()
            if abandon_on_cancel:
                raise
            with trio.CancelScope(shield=True):
                with trio.move_on_after(self._stall_budget()) as scope:
                    await done.wait()
            if scope.cancelled_caught:
                raise StallError(
                    "forward", f"{self.name} did not stop within {self.stall_timeout_s} s"
                )
            raise
        return box[0].unwrap()

    def _stall_budget(self) -> float:
        return float("inf") if self.stall_timeout_s is None else self.stall_timeout_s

    async def stop(self) -> bool:
        """Ask the thread to exit after its queued jobs and join it; idempotent.

        Returns False if the thread did not exit within ``stall_timeout_s`` (it is a daemon
        thread and is left behind; the caller should report that).  Shielded from
        cancellation so a closing owner never leaves the thread unjoined by accident.
        """
        if not self._stopping:
            self._stopping = True
            self._jobs.put(None)
        if not self._thread.is_alive() and self._thread.ident is None:
            return True  # never started
        with trio.CancelScope(shield=True):
            with trio.move_on_after(self._stall_budget()):
                await self._exited.wait()
        if self._exited.is_set():
            self._thread.join()
            return True
        log.error("%s did not exit within %s s", self.name, self.stall_timeout_s)
        return False
