"""A small synchronous wrapper that drives a real, running engine from another thread.

Hypothesis state machines are synchronous; the engine is a trio program.  :func:`run_driven`
runs a trio loop in the *calling* thread (so the tractor backend, which wants the main
thread, works) and calls ``fn(driver)`` in a worker thread; every :class:`EngineDriver`
method hops into the trio loop with ``trio.from_thread.run`` and returns when that step is
done.  One consumer task per request reads its stream and records what it received
(``RECEIVED`` trace events, with the identity decoded from echo images), exactly as a client
would see it.

Example::

    def scenario(driver: EngineDriver) -> None:
        driver.open(EngineConfig(model="builtin:echo", warmup=False))
        rid = driver.submit("a cat", SamplingParams(num_inference_steps=2, seed=1))
        driver.wait_finished([rid], timeout=10)
        driver.close()
        assert_trace_ok(driver.trace)

    run_driven(scenario)
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import signal
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import trio

from .._core.messages import DiffusionOutput
from .._core.request import DiffusionRequest, SamplingParams
from .._core.trace import TraceKind, TraceRecorder
from ..config import EngineConfig
from ..errors import OmniTrioError, StallError, WorkerError
from ..ipc import segments_of_this_process
from ..runtime.engine import AsyncEngine, open_engine

__all__ = ["ConsumerRecord", "EngineDriver", "leftover_resources", "run_driven"]

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class ConsumerRecord:
    """What one request's consumer saw."""

    request_id: str
    outputs: list[DiffusionOutput] = field(default_factory=list)
    dropped: bool = False
    error: BaseException | None = None
    done: bool = False

    @property
    def final(self) -> DiffusionOutput | None:
        if self.outputs and self.outputs[-1].finished:
            return self.outputs[-1]
        return None


def _identity(output: DiffusionOutput) -> dict[str, Any] | None:
    if not output.images:
        return None
    try:
        from ..models.echo import decode_echo_image

        rid, seed, _ = decode_echo_image(output.images[0])
    except Exception:  # not an echo image (a preview of latents, a real model)
        return None
    return {"request_id": rid, "seed": seed}


def _worker_processes() -> list[int]:
    """Live (or unreaped) tractor worker children of this process, by a /proc scan."""
    me = os.getpid()
    found: list[int] = []
    proc = Path("/proc")
    if not proc.is_dir():
        return found
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == me and (b"tractor._child" in cmdline or fields[0] == "Z"):
            found.append(int(entry.name))
    return found


def leftover_resources() -> dict[str, list[Any]]:
    """What an engine may leave behind, process-wide: our threads, our shared-memory
    segments, worker processes.  All lists are empty when nothing leaked (INV-3)."""
    from ..executors.ray_executor import RAY_OWNER_THREAD

    # Ray's owner thread lives as long as the local Ray this process started, not an engine.
    threads = [
        t.name
        for t in threading.enumerate()
        if t.name.startswith("omni-trio") and t.name != RAY_OWNER_THREAD and t.is_alive()
    ]
    return {
        "threads": threads,
        # Only this process's (and untagged ones): another engine on the machine is not ours.
        "shm_segments": segments_of_this_process(),
        "processes": _worker_processes(),
    }


class EngineDriver:
    """Synchronous control of one engine at a time (open, submit, abort, drop, crash,
    RPC, close), from the thread :func:`run_driven` runs ``fn`` in.  Every call is bounded
    by ``call_timeout_s`` (a call that takes longer raises ``trio.TooSlowError``)."""

    def __init__(
        self,
        token: trio.lowlevel.TrioToken,
        nursery: trio.Nursery,
        *,
        trace: TraceRecorder | None = None,
        call_timeout_s: float = 60.0,
    ) -> None:
        self._token = token
        self._nursery = nursery
        self.trace = trace if trace is not None else TraceRecorder()
        self.call_timeout_s = call_timeout_s
        self.engine: AsyncEngine | None = None
        self.consumers: dict[str, ConsumerRecord] = {}
        self._scopes: dict[str, trio.CancelScope] = {}
        self._close: trio.Event | None = None
        self._closed: trio.Event | None = None
        self._serve_scope: trio.CancelScope | None = None
        self._ids = itertools.count(1)
        self._changed = trio.Event()

    # -- plumbing ------------------------------------------------------------------------

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run a synchronous ``fn()`` in the trio thread and return its result."""

        async def run() -> Any:
            return fn()

        return self.run(run)

    def run(self, afn: Callable[[], Any]) -> Any:
        """Run ``await afn()`` in the trio thread (bounded) and return its result."""

        async def bounded() -> Any:
            with trio.fail_after(self.call_timeout_s):
                return await afn()

        return trio.from_thread.run(bounded, trio_token=self._token)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # -- the engine ----------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self.engine is not None

    def open(self, config: EngineConfig) -> AsyncEngine:
        """Open an engine with ``config`` (recording into :attr:`trace`); returns it."""
        if self.engine is not None:
            raise RuntimeError("an engine is already open; close() it first")

        scope = self._serve_scope = trio.CancelScope()

        async def serve(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            close, closed = trio.Event(), trio.Event()
            self._close, self._closed = close, closed
            try:
                with scope:
                    async with open_engine(config, trace=self.trace) as engine:
                        task_status.started(engine)
                        await close.wait()
            finally:
                closed.set()

        async def start() -> AsyncEngine:
            engine: AsyncEngine = await self._nursery.start(serve)
            return engine

        self.engine = self.run(start)
        return self.engine

    def close(self, *, consumer_timeout: float | None = None) -> list[str]:
        """Close the engine, then wait for its consumers to read their terminal outputs.

        Returns the ids of consumers still not done ``consumer_timeout`` seconds after the
        engine closed (None: wait for all, bounded only by ``call_timeout_s``); those are
        stopped (their streams closed unread), so nothing of the engine outlives the call."""
        if self.engine is None:
            return []
        close, closed = self._close, self._closed
        assert close is not None and closed is not None

        async def shut() -> list[str]:
            close.set()
            await closed.wait()
            with trio.move_on_after(math.inf if consumer_timeout is None else consumer_timeout):
                await self._wait_consumers(None)
                return []
            stuck = sorted(rid for rid, record in self.consumers.items() if not record.done)
            for rid in stuck:
                scope = self._scopes.get(rid)
                if scope is not None:
                    scope.cancel()
            return stuck

        try:
            stuck: list[str] = self.run(shut)
        except trio.TooSlowError:
            # The close itself hung: cancel the engine's task and every consumer, so that
            # nothing of this engine outlives the call (the caller reports the hang).
            self._cancel_engine(closed)
            raise
        finally:
            self.engine = None
        return stuck

    def _cancel_engine(self, closed: trio.Event) -> None:
        """Cancel the engine's task and its consumers; wait (bounded) until it ended."""

        async def cancel() -> None:
            if self._serve_scope is not None:
                self._serve_scope.cancel()
            for scope in self._scopes.values():
                scope.cancel()
            # (At least a second: a bound of zero, which times every call out, must still
            # leave the cancelled engine the moment it needs to end.)
            with trio.move_on_after(max(1.0, self.call_timeout_s)):
                await closed.wait()

        trio.from_thread.run(cancel, trio_token=self._token)

    # -- requests ------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"fuzz-{next(self._ids)}"

    def submit(self, prompt: str, params: SamplingParams, request_id: str | None = None) -> str:
        """Admit a request and start its consumer; returns its id.  Admission errors
        (invalid input, engine closed or dead) are raised here."""
        engine = self._engine()
        rid = request_id or self.new_request_id()

        def admit() -> str:
            stream = engine.stream(DiffusionRequest(prompt, params, rid))
            record = ConsumerRecord(rid)
            self.consumers[rid] = record
            scope = trio.CancelScope()
            self._scopes[rid] = scope
            self._nursery.start_soon(self._consume, stream, record, scope)
            return rid

        result: str = self.call(admit)
        return result

    async def _consume(self, stream: Any, record: ConsumerRecord, scope: trio.CancelScope) -> None:
        try:
            with scope:
                async with stream:
                    async for output in stream:
                        record.outputs.append(output)
                        self._record_received(output)
        except Exception as exc:  # pragma: no cover - a stream never raises
            record.error = exc
        finally:
            record.dropped = record.dropped or scope.cancelled_caught
            record.done = True
            self._scopes.pop(record.request_id, None)
            self._notify()

    def _record_received(self, output: DiffusionOutput) -> None:
        self.trace.record(
            trio.current_time(),
            TraceKind.RECEIVED,
            output.request_id,
            detail={
                "finished": output.finished,
                "chunk_index": output.chunk_index,
                "status": output.status.name,
                "seed": output.seed,
                "identity": _identity(output),
            },
        )

    def abort(self, request_id: str) -> None:
        engine = self._engine()
        self.call(lambda: engine.abort(request_id))

    def drop(self, request_id: str) -> bool:
        """The consumer stops reading (its stream is closed unread); False if it already
        finished."""

        def cancel() -> bool:
            scope = self._scopes.get(request_id)
            if scope is None:
                return False
            scope.cancel()
            return True

        result: bool = self.call(cancel)
        return result

    def rpc(self, method: str, *args: Any, timeout: float | None = 10.0) -> Any:
        engine = self._engine()

        async def call() -> Any:
            return await engine.collective_rpc(method, *args, timeout=timeout)

        return self.run(call)

    def sleep_engine(self, level: int) -> bool:
        """``AsyncEngine.sleep(level)``; True if the engine fell asleep, False if the sleep
        failed with a typed error (requests still running past the drain timeout, a failed
        group: the engine is then awake)."""
        engine = self._engine()
        try:
            self.run(lambda: engine.sleep(level))
        except OmniTrioError:
            return False
        return True

    def wake_engine(self) -> None:
        """``AsyncEngine.wake_up()``: waiting requests run again."""
        engine = self._engine()
        self.run(engine.wake_up)

    def leftovers(self) -> tuple[dict[str, set[str]], frozenset[str]]:
        """What the engine holds now, by kind (``AsyncEngine.leftovers()``), and the ids of
        the forward in flight; see :func:`~omni_trio.testing.check_leftovers`."""
        engine = self._engine()
        result: tuple[dict[str, set[str]], frozenset[str]] = self.call(
            lambda: (engine.leftovers(), engine.core.in_flight_ids())
        )
        return result

    def settle(self, *, timeout: float = 30.0) -> dict[str, set[str]] | None:
        """Wait until the engine is idle and its workers drained, then return everything
        held by the engine and its workers (the ``leftovers`` RPC) and our shared-memory
        segments (``shm_segments``); None if it did not settle within ``timeout`` (INV-6).
        Raises :class:`StallError` when the ``leftovers`` RPC got no answer within the
        engine's ``rpc_timeout_s`` (fine only if the group failed meanwhile: the caller
        decides); other typed errors of that RPC mean the group failed under it."""
        engine = self._engine()

        async def wait() -> dict[str, set[str]] | None:
            with trio.move_on_after(timeout):
                await engine.wait_idle()
                held = engine.leftovers()
                if engine.core.accepting:
                    try:
                        workers = await engine.worker_leftovers()
                    except StallError:
                        raise
                    except OmniTrioError:  # the group failed under it: its state is gone
                        workers = {}
                    for kind, ids in workers.items():
                        held.setdefault(kind, set()).update(ids)
                held["shm_segments"] = set(segments_of_this_process())
                return held
            return None

        result: dict[str, set[str]] | None = self.run(wait)
        return result

    def sleep(self, seconds: float) -> None:
        async def pause() -> None:
            await trio.sleep(seconds)

        self.run(pause)

    def wait_finished(
        self, request_ids: Iterable[str] | None = None, *, timeout: float = 30.0
    ) -> bool:
        """Wait until the consumers of ``request_ids`` (default: all) are done; False if
        ``timeout`` passed first."""
        ids = None if request_ids is None else list(request_ids)

        async def wait() -> bool:
            with trio.move_on_after(timeout):
                await self._wait_consumers(ids)
                return True
            return False

        result: bool = self.run(wait)
        return result

    async def _wait_consumers(self, ids: list[str] | None) -> None:
        while True:
            pending = [
                r for rid, r in self.consumers.items() if not r.done and (ids is None or rid in ids)
            ]
            if not pending:
                return
            await self._changed.wait()

    # -- faults --------------------------------------------------------------------------

    def crash_worker(self, rank: int = 0, sig: int = signal.SIGKILL) -> str:
        """Kill worker ``rank``: SIGKILL its process (process backends), or, in-process,
        fail the group closed as a dead process would (the thread is stopped by the
        restart).  Returns what was done."""
        engine = self._engine()

        def crash() -> str:
            executor = engine.executor
            pids = getattr(executor, "worker_pids", None)
            if callable(pids):
                pid = pids().get(rank)
                if pid is not None:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        return "gone"
                    return f"killed pid {pid}"
            executor.fail(
                WorkerError("injected crash (in-process)", worker=rank, error_type="WorkerDied")
            )
            stop = getattr(executor, "stop_flags", None)
            if stop is not None:
                stop.stop_everything()
            return "failed in-process group"

        result: str = self.call(crash)
        return result

    def _engine(self) -> AsyncEngine:
        if self.engine is None:
            raise RuntimeError("no engine is open")
        return self.engine


def run_driven(
    fn: Callable[[EngineDriver], T],
    *,
    trace: TraceRecorder | None = None,
    call_timeout_s: float = 60.0,
) -> T:
    """Run a trio loop in this thread and ``fn(driver)`` in a worker thread; return what
    ``fn`` returns (or raise what it raised).  An engine ``fn`` left open is closed."""
    box: list[T] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            driver = EngineDriver(
                trio.lowlevel.current_trio_token(),
                nursery,
                trace=trace,
                call_timeout_s=call_timeout_s,
            )
            try:
                box.append(await trio.to_thread.run_sync(fn, driver))
            finally:
                with trio.CancelScope(shield=True):
                    if driver.engine is not None:
                        if driver._close is not None:
                            driver._close.set()
                        if driver._closed is not None:  # bounded: the nursery's cancel
                            with trio.move_on_after(driver.call_timeout_s):  # ends the rest
                                await driver._closed.wait()
                        driver.engine = None
                nursery.cancel_scope.cancel()

    trio.run(main)
    return box[0]
