"""One request's output stream, as its consumer sees it.

A :class:`RequestStream` is an async iterator of :class:`DiffusionOutput` chunks that ends
after the terminal output.  The request is admitted when the stream is created (so bad input
raises right there); leaving it early for any reason aborts the request: cancellation of the
consuming task, ``break`` out of ``async with``, ``aclose()``, or the stream being dropped.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from types import TracebackType

import trio

from .._core.messages import DiffusionOutput

__all__ = ["OutputStreams", "RequestStream"]


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
        self._error: BaseException | None = None

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
            error, self._error = self._error, None
            if error is not None:
                raise error from None
            raise StopAsyncIteration from None
        except BaseException:
            self._finish(consumer_gone=True)
            raise
        if output.finished:
            self._finish(consumer_gone=False)
        return output

    def fail_with(self, error: BaseException) -> None:
        """End the stream by raising ``error`` on the read after the last chunk (its
        request was refused where it was admitted: a process-backed stage's engine)."""
        self._error = error

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

    def close(self) -> None:
        """Stop consuming now (no checkpoint); aborts the request if its terminal output
        was not read yet.  A task waiting in :meth:`__anext__` gets ``ClosedResourceError``:
        close only a stream nobody is reading."""
        self._finish(consumer_gone=True)

    async def aclose(self) -> None:
        """Stop consuming; aborts the request if its terminal output was not read yet."""
        self.close()

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


class OutputStreams:
    """The engine's ends of its request streams: one send channel per request whose
    consumer reads (invariant: the ids here are the engine core's ``streams``).

    ``on_gone(request_id)`` runs, on the engine's trio thread, when a consumer leaves its
    stream early; a stream of an id that was admitted again since never reports for the new
    one (its callbacks carry its own channel).
    """

    def __init__(self, on_gone: Callable[[str], None]) -> None:
        self._sends: dict[str, trio.MemorySendChannel[DiffusionOutput]] = {}
        self._on_gone = on_gone
        self._token: trio.lowlevel.TrioToken | None = None

    def ids(self) -> set[str]:
        return set(self._sends)

    def open(self, request_id: str, seed: int | None) -> RequestStream:
        """A new stream for ``request_id`` (on the engine's trio thread, no checkpoint)."""
        self._token = trio.lowlevel.current_trio_token()
        send, receive = trio.open_memory_channel[DiffusionOutput](math.inf)
        self._sends[request_id] = send
        return RequestStream(
            request_id,
            seed,
            receive,
            functools.partial(self._gone, send),
            functools.partial(self._dropped, send),
        )

    def send(self, request_id: str, output: DiffusionOutput) -> None:
        """A non-terminal chunk (a consumer that closed its end just misses it)."""
        try:
            self._sends[request_id].send_nowait(output)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def finish(self, request_id: str, output: DiffusionOutput) -> None:
        """The terminal output; the stream is closed and forgotten."""
        send = self._sends.pop(request_id)
        try:
            send.send_nowait(output)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        send.close()

    def end_all(self, output_for: Callable[[str], DiffusionOutput]) -> list[str]:
        """Finish every stream still open with ``output_for(request_id)``; their ids."""
        ended = list(self._sends)
        for rid in ended:
            self.finish(rid, output_for(rid))
        return ended

    def _gone(self, send: trio.MemorySendChannel[DiffusionOutput], request_id: str) -> None:
        if self._sends.get(request_id) is not send:
            return  # already finished, or a stale stream of a reused id
        del self._sends[request_id]
        send.close()
        self._on_gone(request_id)

    def _dropped(self, send: trio.MemorySendChannel[DiffusionOutput], request_id: str) -> None:
        # Finalized unread: any thread, any moment (even in the middle of a core event), so
        # the consumer-gone is always deferred to the loop's next turn.
        token = self._token
        if token is not None:
            try:
                token.run_sync_soon(self._gone, send, request_id)
            except trio.RunFinishedError:
                pass
