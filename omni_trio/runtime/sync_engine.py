"""``Engine``: the synchronous front door for plain Python programs.

It runs an :class:`AsyncEngine` in its own trio run on a background thread and forwards
calls to it; its surface is the async engine's, blocking: ``generate``, ``stream`` (a
:class:`SyncRequestStream`, a blocking iterator), ``abort``, ``progress``, ``collective_rpc``,
``sleep`` / ``wake_up``, ``start_profile`` / ``stop_profile``, ``check_health``, ``health`` and
``statistics``.  The thread is owned: :meth:`Engine.close` (or leaving the ``with`` block)
closes the engine and joins the thread, so nothing outlives it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import trio

from .._core.health import EngineState
from .._core.messages import DiffusionOutput
from .._core.request import DiffusionRequest, SamplingParams
from ..config import EngineConfig
from ..errors import EngineClosedError
from .engine import AsyncEngine, EngineHealth, EngineStatistics, open_engine
from .request_stream import RequestStream
from .stage import StageEngine

__all__ = ["Engine", "SyncRequestStream"]


class SyncRequestStream:
    """One request's outputs as a blocking iterator; also a context manager.

    ``Engine.stream()`` returns it once the request is admitted, so ``request_id`` and
    ``seed`` are known at once.  Iterating yields :class:`DiffusionOutput` chunks and stops
    after the one terminal output (``chunk.finished``), as the async :class:`RequestStream`
    does.  Leaving it before the terminal output aborts the request: :meth:`close`, leaving
    the ``with`` block, or dropping the stream (a ``break`` out of ``for chunk in
    engine.stream(...)`` drops it).  Read it from one thread at a time.
    """

    def __init__(self, stream: RequestStream, token: trio.lowlevel.TrioToken) -> None:
        self.request_id = stream.request_id
        self.seed = stream.seed
        self._stream = stream
        self._token = token
        self._done = False

    def __iter__(self) -> Iterator[DiffusionOutput]:
        return self

    def __next__(self) -> DiffusionOutput:
        """Block until the next chunk.  Raises :class:`EngineClosedError` if the engine's
        run ended before this stream's terminal output was read."""
        if self._done:
            raise StopIteration
        try:
            output = trio.from_thread.run(self._stream.__anext__, trio_token=self._token)
        except StopAsyncIteration:
            self._done = True
            raise StopIteration from None
        except (trio.RunFinishedError, trio.Cancelled):
            self._done = True
            raise EngineClosedError("engine is closed") from None
        if output.finished:
            self._done = True
        return output

    def close(self) -> None:
        """Stop reading; aborts the request if its terminal output was not read yet.
        Idempotent; harmless after the engine closed."""
        if self._done:
            return
        self._done = True
        try:
            trio.from_thread.run_sync(self._finish, trio_token=self._token)
        except trio.RunFinishedError:
            pass

    def _finish(self) -> None:
        # On the engine's thread: what leaving an async stream early does (consumer gone).
        self._stream._finish(consumer_gone=True)

    def __del__(self) -> None:
        # Dropped unread (a ``break`` out of a for loop): abort on the engine's thread, at
        # its next turn, without blocking whatever thread runs this finalizer.
        if getattr(self, "_done", True):
            return
        self._done = True
        try:
            self._token.run_sync_soon(self._finish)
        except trio.RunFinishedError:  # the engine closed: nothing left to abort
            pass

    def __enter__(self) -> SyncRequestStream:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class Engine:
    """Synchronous engine: ``with Engine(config) as engine: engine.generate("a cat")``.

    Construction blocks until the engine is ready (model loaded, warmup done) and raises
    what ``open_engine`` raised.  ``stage="process"`` runs the engine in a child process
    (see :mod:`omni_trio.runtime.stage`); the methods are the same.  Every method is
    thread-safe, blocks until the engine's thread has answered, and raises what the
    :class:`AsyncEngine` method raises; after :meth:`close`, every method but
    :meth:`health` raises :class:`EngineClosedError`.
    """

    def __init__(
        self, config: EngineConfig | None = None, *, stage: str = "inline", **overrides: Any
    ) -> None:
        self.config = (config or EngineConfig()).replace(**overrides)
        self.stage = stage
        self._ready = threading.Event()
        self._engine: AsyncEngine | StageEngine | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._error: BaseException | None = None
        self._final_health: EngineHealth | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._main, name="omni-trio-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # reported to the constructor, or lost after close
            if not self._ready.is_set():
                self._error = exc
        finally:
            self._ready.set()

    async def _serve(self) -> None:
        self._stop = trio.Event()
        async with open_engine(self.config, stage=self.stage) as engine:
            self._engine = engine
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._stop.wait()
        self._final_health = engine.health()

    def _target(self) -> tuple[AsyncEngine | StageEngine, trio.lowlevel.TrioToken]:
        if self._closed or self._engine is None or self._token is None:
            raise EngineClosedError("engine is closed")
        return self._engine, self._token

    def generate(
        self,
        prompt_or_request: str | DiffusionRequest,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> DiffusionOutput:
        """Blocking ``AsyncEngine.generate``; raises the same errors."""
        engine, token = self._target()
        try:
            return trio.from_thread.run(
                lambda: engine.generate(prompt_or_request, params, request_id=request_id),
                trio_token=token,
            )
        except trio.RunFinishedError:
            raise EngineClosedError("engine is closed") from None

    def stream(
        self,
        prompt_or_request: str | DiffusionRequest,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> SyncRequestStream:
        """Admit a request and return its output stream, a blocking iterator (see
        :class:`SyncRequestStream`).  Raises :class:`InvalidRequestError` /
        :class:`DuplicateRequestError` here, before anything is admitted, as
        ``AsyncEngine.stream`` does."""
        engine, token = self._target()
        try:
            stream = trio.from_thread.run_sync(
                lambda: engine.stream(prompt_or_request, params, request_id=request_id),
                trio_token=token,
            )
        except trio.RunFinishedError:
            raise EngineClosedError("engine is closed") from None
        return SyncRequestStream(stream, token)

    def abort(self, *request_ids: str) -> None:
        """Abort requests (unknown or finished ids are ignored); see ``AsyncEngine.abort``."""
        engine, token = self._target()
        try:
            trio.from_thread.run_sync(engine.abort, *request_ids, trio_token=token)
        except trio.RunFinishedError:
            pass

    def collective_rpc(
        self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> Any:
        engine, token = self._target()
        return trio.from_thread.run(
            lambda: engine.collective_rpc(method, *args, timeout=timeout, **kwargs),
            trio_token=token,
        )

    def start_profile(self, directory: str | os.PathLike[str], prefix: str | None = None) -> None:
        """Blocking ``AsyncEngine.start_profile``: every worker starts ``torch.profiler``."""
        engine, token = self._target()
        try:
            trio.from_thread.run(lambda: engine.start_profile(directory, prefix), trio_token=token)
        except trio.RunFinishedError:
            raise EngineClosedError("engine is closed") from None

    def stop_profile(self) -> list[str]:
        """Blocking ``AsyncEngine.stop_profile``: the trace paths, one per rank."""
        engine, token = self._target()
        try:
            paths: list[str] = trio.from_thread.run(engine.stop_profile, trio_token=token)
        except trio.RunFinishedError:
            raise EngineClosedError("engine is closed") from None
        return paths

    def sleep(self, level: int = 1) -> list[dict[str, Any]]:
        """Release the model's weights; see ``AsyncEngine.sleep``."""
        engine, token = self._target()
        try:
            return trio.from_thread.run(engine.sleep, level, trio_token=token)
        except trio.RunFinishedError:
            raise EngineClosedError("engine is closed") from None

    def wake_up(self) -> list[dict[str, Any]]:
        """Take the weights back; see ``AsyncEngine.wake_up``."""
        engine, token = self._target()
        try:
            return trio.from_thread.run(engine.wake_up, trio_token=token)
        except trio.RunFinishedError:
            raise EngineClosedError("engine is closed") from None

    def progress(self, request_id: str) -> tuple[int, int] | None:
        """(steps done, total steps) of a running request, ``None`` while it is queued or
        once it is done; see ``AsyncEngine.progress``."""
        engine, token = self._target()
        return self._call(engine.progress, request_id, token=token)

    def check_health(self) -> None:
        """None when healthy; raises as ``AsyncEngine.check_health`` does."""
        engine, token = self._target()
        self._call(engine.check_health, token=token)

    def health(self) -> EngineHealth:
        """An :class:`EngineHealth` snapshot; never raises.  After :meth:`close` it is the
        engine's last one (state ``closed``)."""
        engine, token = self._engine, self._token
        if not self._closed and engine is not None and token is not None:
            try:
                return trio.from_thread.run_sync(engine.health, trio_token=token)
            except trio.RunFinishedError:
                pass
        if threading.current_thread() is not self._thread:
            self._thread.join()
        if self._final_health is not None:
            return self._final_health
        return EngineHealth(  # the run ended before it could take the snapshot
            healthy=False,
            state=EngineState.CLOSED,
            reason="engine is closed",
            restarts=0,
            workers=(),
            last_failure=None,
        )

    def statistics(self) -> EngineStatistics:
        """An :class:`EngineStatistics` snapshot; see ``AsyncEngine.statistics``."""
        engine, token = self._target()
        return self._call(engine.statistics, token=token)

    @staticmethod
    def _call(fn: Any, *args: Any, token: trio.lowlevel.TrioToken) -> Any:
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=token)
        except trio.RunFinishedError:
            raise EngineClosedError("engine is closed") from None

    def close(self) -> None:
        """Close the engine and join its thread; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        token, stop = self._token, self._stop
        if token is not None and stop is not None:
            try:
                trio.from_thread.run_sync(stop.set, trio_token=token)
            except trio.RunFinishedError:
                pass
        self._thread.join()
        self._engine = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
