"""``Engine``: the synchronous front door for plain Python programs.

It runs an :class:`AsyncEngine` in its own trio run on a background thread and forwards
calls to it.  The thread is owned: :meth:`Engine.close` (or leaving the ``with`` block) closes
the engine and joins the thread, so nothing outlives it.
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any

import trio

from .._core.messages import DiffusionOutput
from .._core.request import DiffusionRequest, SamplingParams
from ..config import EngineConfig
from ..errors import EngineClosedError
from .engine import AsyncEngine, EngineStatistics, open_engine

__all__ = ["Engine"]


class Engine:
    """Synchronous engine: ``with Engine(config) as engine: engine.generate("a cat")``.

    Construction blocks until the engine is ready (model loaded, warmup done) and raises
    what ``open_engine`` raised.  Every method is thread-safe.
    """

    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        self.config = (config or EngineConfig()).replace(**overrides)
        self._ready = threading.Event()
        self._engine: AsyncEngine | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._error: BaseException | None = None
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
        async with open_engine(self.config) as engine:
            self._engine = engine
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._stop.wait()

    def _target(self) -> tuple[AsyncEngine, trio.lowlevel.TrioToken]:
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

    def abort(self, *request_ids: str) -> None:
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

    def check_health(self) -> None:
        engine, token = self._target()
        trio.from_thread.run_sync(engine.check_health, trio_token=token)

    def statistics(self) -> EngineStatistics:
        engine, token = self._target()
        return trio.from_thread.run_sync(engine.statistics, trio_token=token)

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
