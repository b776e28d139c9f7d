"""The engine's control-RPC queue: RPCs wait here and run between batches, one at a time.

Callers :meth:`RpcQueue.call` (and wait, bounded by their timeout); the engine loop runs what
is queued with :meth:`RpcQueue.run_pending` when no forward is in flight.  An RPC whose
caller gave up (timed out or cancelled) before it ran is skipped.  An RPC whose caller's
timeout ran out while it ran ends as the executor says: the executor bounds the call by the
same timeout (and fails its group closed when it passes: a worker runs one call at a time,
so every later call would queue behind a stuck one).  Everything runs on the engine's trio
thread.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from ..errors import EngineClosedError, StallError
from ..executors.base import Executor

__all__ = ["RpcQueue"]


@dataclass(eq=False)
class _PendingRpc:
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    timeout: float | None
    unique_reply_rank: int | None
    done: trio.Event = field(default_factory=trio.Event)
    started: bool = False
    abandoned: bool = False
    result: Any = None
    error: BaseException | None = None


class RpcQueue:
    """Queued control RPCs; ``on_queued()`` is called when one arrives (to wake the loop)."""

    def __init__(self, on_queued: Callable[[], None]) -> None:
        self._queue: deque[_PendingRpc] = deque()
        self._on_queued = on_queued
        self.running = False
        # Set by fail_all (the engine closed or died): later calls raise it at once.
        self._failed: BaseException | None = None

    def __bool__(self) -> bool:
        """Some RPC waits to run."""
        return bool(self._queue)

    @property
    def methods(self) -> list[str]:
        return [rpc.method for rpc in self._queue]

    async def call(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        timeout: float | None,
        unique_reply_rank: int | None,
    ) -> Any:
        """Queue ``method`` and wait for its result.  Raises :class:`StallError` if
        ``timeout`` passes while it is still queued (it is then skipped), and whatever the
        RPC raised (the executor's :class:`StallError` if it ran past ``timeout``), and the
        error of :meth:`fail_all` at once after it.  If cancelled while queued, the RPC
        never runs."""
        if self._failed is not None:
            raise self._failed
        rpc = _PendingRpc(method, args, kwargs, timeout, unique_reply_rank)
        self._queue.append(rpc)
        self._on_queued()
        try:
            with trio.fail_after(math.inf if timeout is None else timeout):
                await rpc.done.wait()
        except trio.TooSlowError:
            if not rpc.started:
                rpc.abandoned = True
                raise StallError(
                    "rpc", f"RPC {method!r} did not finish within {timeout} s (still queued)"
                ) from None
            # It runs: the executor ends it within the same timeout, as it must say.
            try:
                await rpc.done.wait()
            except BaseException:
                rpc.abandoned = True
                raise
        except BaseException:
            rpc.abandoned = True
            raise
        if rpc.error is not None:
            raise rpc.error
        return rpc.result

    async def run_pending(self, executor: Executor) -> None:
        """Run every queued RPC on ``executor``, in order.  If cancelled, the RPC that was
        running fails with :class:`EngineClosedError`."""
        while self._queue:
            rpc = self._queue.popleft()
            if rpc.abandoned:
                continue
            self.running = True
            rpc.started = True
            try:
                rpc.result = await executor.collective_rpc(
                    rpc.method,
                    *rpc.args,
                    timeout=rpc.timeout,
                    unique_reply_rank=rpc.unique_reply_rank,
                    **rpc.kwargs,
                )
            except trio.Cancelled:
                rpc.error = EngineClosedError("engine closed while the RPC ran")
                rpc.done.set()
                raise
            except Exception as exc:
                rpc.error = exc
            finally:
                self.running = False
            rpc.done.set()

    def fail_all(self, error: BaseException) -> None:
        """Every queued RPC raises ``error`` to its caller (the engine closed or died), and
        so does every later :meth:`call`."""
        self._failed = error
        for rpc in self._queue:
            rpc.error = error
            rpc.done.set()
        self._queue.clear()
