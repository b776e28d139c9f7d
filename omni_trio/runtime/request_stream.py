"""One request's output stream, as its consumer sees it.

A :class:`RequestStream` is an async iterator of :class:`DiffusionOutput` chunks that ends
after the terminal output.  The request is admitted when the stream is created (so bad input
raises right there); leaving it early for any reason aborts the request: cancellation of the
consuming task, ``break`` out of ``async with``, ``aclose()``, or the stream being dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import trio

from .._core.messages import DiffusionOutput

__all__ = ["RequestStream"]


class RequestStream:
    """Async iterator over one request's outputs; also an async context manager."""

    def __init__(
        self,
        request_id: str,
        seed: int | None,
        receive: trio.MemoryReceiveChannel[DiffusionOutput],
        on_consumer_gone: Callable[[str], None],
        on_dropped: Callable[[str], None] | None = None,
    ) -> None:
        """``on_consumer_gone(request_id)`` runs when the consumer leaves early;
        ``on_dropped(request_id)``, if given, instead when the stream is finalized unread
        (a finalizer can run at any allocation, so that one must not act synchronously)."""
        self.request_id = request_id
        self.seed = seed
        self._receive = receive
        self._on_consumer_gone: Callable[[str], None] | None = on_consumer_gone
        self._on_dropped = on_dropped
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> DiffusionOutput:
        """Wait for the next chunk.  If cancelled, the request is aborted."""
        if self._done:
            raise StopAsyncIteration
        try:
            output = await self._receive.receive()
        except trio.EndOfChannel:
            # The engine closed the stream without a terminal output: it never does this
            # except when its own task is torn down; treat it as the end.
            self._finish(consumer_gone=False)
            raise StopAsyncIteration from None
        except BaseException:
            self._finish(consumer_gone=True)
            raise
        if output.finished:
            self._finish(consumer_gone=False)
        return output

    def _finish(self, *, consumer_gone: bool, dropped: bool = False) -> None:
        if self._done:
            return
        self._done = True
        callback, self._on_consumer_gone = self._on_consumer_gone, None
        on_dropped, self._on_dropped = self._on_dropped, None
        self._receive.close()
        if dropped and on_dropped is not None:
            callback = on_dropped
        if consumer_gone and callback is not None:
            callback(self.request_id)

    async def aclose(self) -> None:
        """Stop consuming; aborts the request if its terminal output was not read yet."""
        self._finish(consumer_gone=True)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._finish(consumer_gone=True)

    def __del__(self) -> None:
        # A stream dropped unread still must not leave its request running.
        if not self._done and self._on_consumer_gone is not None:
            try:
                self._finish(consumer_gone=True, dropped=True)
            except Exception:  # pragma: no cover - interpreter shutdown
                pass
