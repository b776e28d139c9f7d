"""A process-backed stage: the whole engine in a child process, the same API in the caller.

``open_engine(config, stage="process")`` (and ``Engine(config, stage="process")``) start
a stage process in a new session (its own process group) -- ``python -m
omni_trio.runtime.stage_child`` handed one end of a socketpair, or, for an inproc engine
whose ``worker_start_method`` allows it (:func:`~omni_trio.executors.tractor_executor.stage_forks`),
forked from the fork server and connecting back to a Unix socket -- hand it ``config`` and
wait for its READY handshake: the child has opened the engine (worker group up, warmup
done) -- or its error, raised here.  The caller then holds a
:class:`StageEngine`, which answers what :class:`~omni_trio.runtime.engine.AsyncEngine`
answers:

* ``stream`` / ``generate`` admit in the child; each output (previews included) crosses as
  it comes.  The caller decides admission first as the core will
  (:func:`~omni_trio._core.engine_core.check_admission` with the child's latest model info,
  cost model and sleep state; a duplicate id of its own; a closed or dead stage) and raises
  at once, as the inline engine does, filling in the size and a seed (``stream.seed`` is
  known at once); a request that cannot be pickled raises :class:`PayloadError`.  What the
  child still refuses (its state changed since its last snapshot) ends the stream by
  raising the child's error, typed, on its first read.
* Leaving a stream early aborts the request in the child (consumer drop crosses over);
  ``abort`` crosses too, and the terminal output follows from the child.
* Synchronous accessors (``health``, ``statistics``, ``status``, ``progress``,
  ``queue_position``, ``is_idle``, ...) answer from the child's latest state snapshot, sent
  after every change (at most every :data:`~.stage_child.STATE_PERIOD_S`); the async control
  calls (``sleep``, ``wake_up``, profiling, ``collective_rpc``, ``worker_leftovers``,
  ``wait_idle``) run in the child and return or raise what the engine there did.
* A stage process that dies (killed, crashed, or its engine died: the child then ends) is
  seen at once (its end of the socket
  closes and the process exits): every open stream ends with an ``EngineDeadError``
  output, every control call raises :class:`EngineDeadError`, and so does every later call;
  what is left of its process group (its worker processes) is killed.
* ``aclose`` ends the open streams (``EngineClosedError`` output, as the inline engine
  does), asks the child to close its engine, and waits as long as that close may take
  (:func:`engine_close_bound_s`) plus a margin for it to exit; then SIGTERM, then SIGKILL
  to the whole process group: no orphan.  A caller that dies closes the socket, and the
  child closes its engine on its own.

A stage records no trace in the caller (``trace`` is refused) and has no ``core``,
``scheduler`` or ``executor`` here: those live in the child.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import pickle
import random
import secrets
import signal
import socket
import struct
import sys
import tempfile
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from .._core.engine_core import build_request, check_admission
from .._core.health import EngineHealth, EngineState, EngineStatistics
from .._core.lifecycle import RequestStatus
from .._core.messages import DiffusionOutput
from .._core.model_info import ModelInfo
from .._core.request import DiffusionRequest, SamplingParams
from ..config import EngineConfig
from ..errors import (
    DuplicateRequestError,
    EngineClosedError,
    EngineDeadError,
    InvalidConfigError,
    PayloadError,
)
from ..executors._process import ForkedProcess
from ..executors.group import KILL_WAIT_S, TERMINATE_WAIT_S
from ..executors.tractor_executor import (
    forked_environment,
    stage_forks,
    start_forked,
    warm_fork_server,
)
from .pictures import canonical_pictures
from .request_stream import RequestStream
from .stage_wire import FrameReader, WireError, decode_error, frame


def _load_error(payload: bytes) -> BaseException:
    """An error the stage sent (a pickled :class:`WireError`)."""
    try:
        record = pickle.loads(payload)
    except Exception as exc:
        return PayloadError(f"the stage's error could not be read: {exc}")
    if not isinstance(record, WireError):
        return PayloadError(f"the stage sent {type(record).__name__} as an error")
    return decode_error(record)


__all__ = ["STAGES", "StageEngine", "engine_close_bound_s", "open_stage_engine"]

log = logging.getLogger(__name__)

STAGES = ("inline", "process")
# The entry of a forked stage process (by path: that module imports the engine, which imports
# this one).
SERVE_FORKED = "omni_trio.runtime.stage_child:serve_forked"
# Past close_timeout_s: how long the stage process gets to exit after closing its engine,
# then after SIGTERM, before its process group is killed.
CLOSE_MARGIN_S = 5.0
TERM_GRACE_S = 2.0
KILL_GRACE_S = 2.0
# After the stage process exited: how long what it sent before may still be read.
DRAIN_S = 1.0
# After its connection closed: how long its exit status is waited for (the reason says it).
EXIT_STATUS_WAIT_S = 0.25

_S = RequestStatus


def engine_close_bound_s(engine: EngineConfig, stage: str = "inline") -> float:
    """The longest one engine's close may take (the replicas close at the same time), from
    every wait it makes, for ``engine.backend``:

    - ``inproc`` -- ``3 * close_timeout_s``: the worker thread's shutdown (queued behind the
      forward in flight, which stops at its next step) is awaited for ``close_timeout_s``,
      the thread is then joined for as long, and the engine loop's own wait for that forward
      (its stall bound) is as long again;
    - ``tractor`` and ``ray`` -- ``close_timeout_s`` for the workers to stop when asked, then
      :data:`~omni_trio.executors.group.TERMINATE_WAIT_S` after a terminate,
      :data:`~omni_trio.executors.group.KILL_WAIT_S` after a kill, and as long again for the
      transport to reap its processes or actors;
    - any other backend: the larger of the two;
    - ``stage="process"`` -- the inline bound plus :data:`CLOSE_MARGIN_S` for the stage
      process to exit after closing its engine, :data:`TERM_GRACE_S` after a SIGTERM and
      :data:`KILL_GRACE_S` after the process group's SIGKILL.

    A forward in flight stops at its next step boundary; with the compute budget
    (``max_step_s``, 10 s by default, after a warmup) that is well within
    ``close_timeout_s``.  A longer step is cut off by these same waits (the close gives up
    on it), so it never extends the bound."""
    close = engine.close_timeout_s
    inproc = 3 * close
    group = close + TERMINATE_WAIT_S + 2 * KILL_WAIT_S
    backend = engine.backend
    if backend == "inproc":
        bound = inproc
    elif backend in ("tractor", "ray"):
        bound = group
    else:
        bound = max(inproc, group)
    if stage == "process":
        bound += CLOSE_MARGIN_S + TERM_GRACE_S + KILL_GRACE_S
    return bound


@dataclass(eq=False)
class _Call:
    done: trio.Event = field(default_factory=trio.Event)
    ok: bool = False
    value: Any = None


@dataclass(eq=False)
class _Open:
    """One submission still streaming here (``key``: its number on the wire, so a reused
    request id never gets another submission's messages)."""

    key: int
    request_id: str
    send: trio.MemorySendChannel[DiffusionOutput]
    stream: weakref.ref[RequestStream]


class StageEngine:
    """The caller's side of an engine running in a stage process (see the module doc).
    Every method runs on the caller's trio thread; the synchronous ones never checkpoint."""

    def __init__(
        self,
        config: EngineConfig,
        process: _StageProcess,
        connection: trio.SocketStream,
        reader: FrameReader,
        model_info: ModelInfo | None,
        state: dict[str, Any],
    ) -> None:
        self.config = config
        self._process = process
        self._connection = connection
        self._reader = reader
        self._model_info = model_info
        self._state = state
        self._core_config = config.core_config()
        # Frames ready to send, in order (each pickled when queued: a message that cannot
        # be sent is refused to its caller, never found out by the writer).
        self._outbox_send, self._outbox = trio.open_memory_channel[bytes](math.inf)
        self._open: dict[int, _Open] = {}  # by wire key
        self._by_id: dict[str, _Open] = {}  # by request id: the current submission
        self._keys = itertools.count()
        self._calls: dict[int, _Call] = {}
        self._call_ids = itertools.count()
        self._request_ids = itertools.count()
        self._id_prefix = secrets.token_hex(4)
        self._seeds = random.Random(secrets.randbits(64))
        self._read_done = trio.Event()
        self._token = trio.lowlevel.current_trio_token()
        self._dead: str | None = None
        self._closing = False
        self._close_done = trio.Event()
        self._ended = trio.Event()
        self._closed_ack = trio.Event()

    # -- what the child says ---------------------------------------------------------------

    async def _read(self) -> None:
        """Carry out the child's messages until its end of the socket closes."""
        try:
            while True:
                message = await self._reader.receive()
                if message is None:
                    break
                self._on_message(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        except Exception as exc:  # a malformed frame: nothing more can be trusted
            log.exception("stage process sent something unreadable")
            self._die(f"the stage connection broke: {type(exc).__name__}: {exc}", kill=True)
        finally:
            self._read_done.set()
        if not self._closed_ack.is_set() and self._dead is None and not self._closing:
            # A process that died closes its socket a moment before its exit status is
            # known (a forked one's comes from the fork server): wait that moment, so
            # that the reason says how it ended.
            with trio.move_on_after(EXIT_STATUS_WAIT_S):
                await self._process.wait()
            self._die(self._exit_text("closed its connection"), kill=True)

    def _on_message(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "out":
            _, key, payload = message
            entry = self._open.get(key)
            if entry is None:
                return  # the consumer left, or the stage ended it here already
            try:
                output: DiffusionOutput = pickle.loads(payload)
            except Exception as exc:
                output = DiffusionOutput(
                    entry.request_id,
                    _S.FINISHED_ERROR,
                    error=f"the stage's output could not be read here: {type(exc).__name__}: {exc}",
                    error_type="PayloadError",
                )
                self._post(("gone", key))  # (the request is aborted there if it still runs)
            if output.finished:
                self._forget(entry)
                self._deliver(entry.send, output)
                entry.send.close()
            else:
                self._deliver(entry.send, output)
        elif kind == "rejected":
            _, key, error = message
            entry = self._open.get(key)
            if entry is None:
                return
            self._forget(entry)
            stream = entry.stream()
            if stream is not None:
                stream.fail_with(_load_error(error))
            entry.send.close()
        elif kind == "reply":
            _, call_id, ok, payload = message
            call = self._calls.pop(call_id, None)
            if call is None:
                return
            try:
                value = pickle.loads(payload) if ok else _load_error(payload)
            except Exception as exc:
                ok, value = False, PayloadError(f"the stage's answer could not be read: {exc}")
            call.ok, call.value = ok, value
            call.done.set()
        elif kind == "state":
            self._on_state(message[1])
        elif kind == "closed":
            self._on_state(message[1])
            self._closed_ack.set()
        else:
            raise ValueError(f"unknown stage message {kind!r}")

    def _on_state(self, state: dict[str, Any]) -> None:
        self._state = state
        self._model_info = state.get("model_info") or self._model_info
        if state.get("dead"):  # the engine there died (the stage process then ends)
            self._die(f"the stage's engine died: {state['health'].reason}")

    def _forget(self, entry: _Open) -> None:
        self._open.pop(entry.key, None)
        if self._by_id.get(entry.request_id) is entry:
            del self._by_id[entry.request_id]

    @staticmethod
    def _deliver(send: trio.MemorySendChannel[DiffusionOutput], output: DiffusionOutput) -> None:
        try:
            send.send_nowait(output)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def _write(self) -> None:
        """Send the queued messages in order until :meth:`aclose` has queued ``close``; a
        broken socket is the reader's to report.  Shielded: a caller cancelled around the
        engine still gets its ``close`` across (a stage that never reads it is killed)."""
        with trio.CancelScope(shield=True):
            async with self._outbox:
                async for data in self._outbox:
                    try:
                        await self._connection.send_all(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        return

    async def _watch_process(self) -> None:
        await self._process.wait()
        # What it sent before it ended is read first (a result that made it across is
        # delivered), within a bound.
        with trio.move_on_after(DRAIN_S):
            await self._read_done.wait()
        if not self._closing:
            self._die(self._exit_text("exited"))
        if self._process.returncode != 0:
            _kill_group(self._process.pid)  # its workers, if it left any

    def _exit_text(self, what: str) -> str:
        code = self._process.returncode
        if code is None:
            return f"the stage process {self._process.pid} {what}"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = str(-code)
            return f"the stage process {self._process.pid} {what} (killed by {name})"
        return f"the stage process {self._process.pid} {what} (exit code {code})"

    def _post(self, message: tuple[Any, ...] | bytes) -> None:
        """Queue a message (or a frame made already) for the writer."""
        data = message if isinstance(message, bytes) else frame(message)
        try:
            self._outbox_send.send_nowait(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    def _die(self, reason: str, *, kill: bool = False) -> None:
        """The stage is gone for this caller: end everything here.  ``kill``: the process
        may still run (its connection broke): end it and its process group now."""
        if self._dead is not None or self._closing:
            return
        self._dead = reason
        log.error("stage engine died: %s", reason)
        self._end_streams(_S.FINISHED_ERROR, f"engine died: {reason}", "EngineDeadError")
        self._fail_calls(EngineDeadError(f"engine died: {reason}"))
        self._ended.set()
        if kill and self._process.returncode is None:
            _kill_group(self._process.pid)
            self._process.kill()

    def _end_streams(self, status: RequestStatus, message: str, error_type: str) -> None:
        entries, self._open = self._open, {}
        self._by_id.clear()
        for entry in entries.values():
            output = DiffusionOutput(entry.request_id, status, error=message, error_type=error_type)
            self._deliver(entry.send, output)
            entry.send.close()

    def _fail_calls(self, error: BaseException) -> None:
        calls, self._calls = self._calls, {}
        for call in calls.values():
            call.ok, call.value = False, error
            call.done.set()

    # -- admission -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"engine died: {self._dead}")
        if self._closing:
            raise EngineClosedError("engine is closed")
        if self._state.get("dead"):
            raise EngineDeadError(str(self._state["health"].reason or "engine died"))

    def stream(
        self,
        prompt_or_request: str | DiffusionRequest,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> RequestStream:
        """Admit a request in the stage and return its output stream (no checkpoint).

        Raises at once what the engine's admission raises, decided here as the core decides
        it (:func:`~omni_trio._core.engine_core.check_admission` with the stage's latest
        snapshot): :class:`InvalidRequestError`, :class:`EngineAsleepError`,
        :class:`DuplicateRequestError` (an id still streaming from this stage),
        :class:`PayloadError` (it cannot be pickled), :class:`EngineClosedError` /
        :class:`EngineDeadError`.  What the stage still refuses (its state changed since the
        snapshot) ends the stream by raising its error on the first read."""
        self._check_open()
        request = build_request(prompt_or_request, params, request_id, new_id=self._new_request_id)
        sampling = request.sampling
        if isinstance(sampling, SamplingParams) and sampling.image is not None:
            request = request.replace(sampling=canonical_pictures(sampling))
        stats: EngineStatistics = self._state["statistics"]
        request = check_admission(
            request,
            self._core_config,
            model_info=self._model_info,
            cost_model=self._state.get("cost_model"),
            sleep_state=stats.sleep_state,
            seeds=self._seeds,
        )
        rid = request.request_id
        if rid in self._by_id:
            raise DuplicateRequestError(rid)
        key = next(self._keys)
        try:
            data = frame(("submit", key, rid, pickle.dumps(request, pickle.HIGHEST_PROTOCOL)))
        except Exception as exc:
            raise PayloadError(
                f"the request cannot be sent to the stage process: {type(exc).__name__}: {exc}"
            ) from exc
        send, receive = trio.open_memory_channel[DiffusionOutput](math.inf)
        stream = RequestStream(
            rid,
            request.sampling.seed,
            receive,
            functools.partial(self._gone, key),
            functools.partial(self._dropped, key),
        )
        entry = _Open(key, rid, send, weakref.ref(stream))
        self._open[key] = entry
        self._by_id[rid] = entry
        self._post(data)
        return stream

    def _new_request_id(self) -> str:
        return f"req-{self._id_prefix}-{next(self._request_ids)}"

    def _gone(self, key: int, rid: str) -> None:
        entry = self._open.get(key)
        if entry is None:
            return  # already ended
        self._forget(entry)
        entry.send.close()
        self._post(("gone", key))

    def _dropped(self, key: int, rid: str) -> None:
        # Finalized unread, from any thread at any moment: act on the loop's next turn.
        try:
            self._token.run_sync_soon(self._gone, key, rid)
        except trio.RunFinishedError:
            pass

    async def generate(
        self,
        prompt_or_request: str | DiffusionRequest,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> DiffusionOutput:
        """Run one request to completion in the stage; raises as
        :meth:`AsyncEngine.generate <omni_trio.runtime.engine.AsyncEngine.generate>` does.
        If cancelled, the request is aborted."""
        final: DiffusionOutput | None = None
        async with self.stream(prompt_or_request, params, request_id=request_id) as chunks:
            async for output in chunks:
                if output.finished:
                    final = output
        if final is None:  # pragma: no cover - streams always end with a terminal output
            raise EngineClosedError("the request stream ended without an output")
        return final.raise_for_status()

    def abort(self, *request_ids: str) -> None:
        """Abort requests in the stage (unknown or finished ids are ignored); no checkpoint.
        Their terminal outputs follow from the stage."""
        if request_ids and self._dead is None and not self._closing:
            self._post(("abort", tuple(request_ids)))

    # -- control calls ---------------------------------------------------------------------

    async def _call(self, method: str, *args: Any, _shield: bool = False, **kwargs: Any) -> Any:
        """Run ``method`` on the stage's engine.  Cancelled, the caller stops waiting
        (``_shield``: once asked, the answer is awaited, as the engine's own sleep and wake
        do); the stage dying or closing ends the wait with its error."""
        self._check_open()
        call_id = next(self._call_ids)
        try:
            data = frame(("call", call_id, method, pickle.dumps((args, kwargs))))
        except Exception as exc:
            raise PayloadError(
                f"the arguments of {method!r} cannot be sent to the stage process: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        call = _Call()
        self._calls[call_id] = call
        self._post(data)
        try:
            with trio.CancelScope(shield=_shield):
                await call.done.wait()
        finally:
            self._calls.pop(call_id, None)
        if not call.ok:
            raise call.value
        return call.value

    async def collective_rpc(
        self,
        method: str,
        *args: Any,
        timeout: float | None = None,
        unique_reply_rank: int | None = 0,
        **kwargs: Any,
    ) -> Any:
        """``AsyncEngine.collective_rpc`` in the stage (arguments and result cross by
        pickle).  If cancelled, the caller stops waiting; the RPC may still run there."""
        return await self._call(
            "collective_rpc",
            method,
            *args,
            timeout=timeout,
            unique_reply_rank=unique_reply_rank,
            **kwargs,
        )

    async def sleep(self, level: int = 1) -> list[dict[str, Any]]:
        """``AsyncEngine.sleep`` in the stage."""
        result: list[dict[str, Any]] = await self._call("sleep", level, _shield=True)
        return result

    async def wake_up(self) -> list[dict[str, Any]]:
        """``AsyncEngine.wake_up`` in the stage."""
        result: list[dict[str, Any]] = await self._call("wake_up", _shield=True)
        return result

    async def start_profile(
        self, directory: str | os.PathLike[str], prefix: str | None = None
    ) -> None:
        """``AsyncEngine.start_profile`` in the stage (a relative directory is the stage
        process's, which shares the caller's working directory)."""
        await self._call("start_profile", os.fspath(directory), prefix)

    async def stop_profile(self) -> list[str]:
        """``AsyncEngine.stop_profile`` in the stage."""
        result: list[str] = await self._call("stop_profile")
        return result

    async def worker_leftovers(self) -> dict[str, set[str]]:
        """``AsyncEngine.worker_leftovers`` in the stage."""
        result: dict[str, set[str]] = await self._call("worker_leftovers")
        return result

    async def wait_idle(self) -> None:
        """Return once this side holds no stream or call and the stage's engine is idle
        (``AsyncEngine.wait_idle`` there), or once the stage has ended (died or closed), as
        the inline engine's does.  Unbounded; cancelling it is harmless."""
        while self._dead is None and not self._closing:
            try:
                await self._call("wait_idle")
            except (EngineDeadError, EngineClosedError):
                return  # it ended meanwhile: nothing will run any more
            if not self._open and not self._calls:
                return
            await trio.sleep(0.01)  # outputs still crossing: look again

    # -- state -----------------------------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo | None:
        return self._model_info

    @property
    def profiling(self) -> bool:
        return bool(self._state.get("profiling"))

    @property
    def is_sleeping(self) -> bool:
        return bool(self._state.get("sleeping"))

    @property
    def is_closed(self) -> bool:
        return self._closing

    @property
    def is_dead(self) -> bool:
        return self._dead is not None or bool(self._state.get("dead"))

    @property
    def pid(self) -> int:
        """The stage process's pid (its process group's id too)."""
        return self._process.pid

    def health(self) -> EngineHealth:
        """The stage's latest health; DEAD or CLOSED as seen here (never raises)."""
        health: EngineHealth = self._state["health"]
        if self._dead is not None:
            return EngineHealth(
                healthy=False,
                state=EngineState.DEAD,
                reason=self._dead,
                restarts=health.restarts,
                workers=(),
                last_failure=self._dead,
            )
        if self._closing:
            return EngineHealth(
                healthy=False,
                state=EngineState.CLOSED,
                reason="engine is closed",
                restarts=health.restarts,
                workers=(),
                last_failure=health.last_failure,
            )
        return health

    def check_health(self) -> None:
        """Return None when healthy; raise what the stage's ``check_health`` raised at its
        latest snapshot (:class:`EngineDeadError` at once when the stage process died)."""
        self._check_open()
        error: WireError | None = self._state.get("health_error")
        if error is not None:
            raise decode_error(error)

    def statistics(self) -> EngineStatistics:
        stats: EngineStatistics = self._state["statistics"]
        return stats

    def status(self, request_id: str) -> RequestStatus | None:
        known = self._state["requests"].get(request_id)
        if known is not None:
            status: RequestStatus | None = known[0]
            return status
        return _S.WAITING if request_id in self._by_id else None

    def progress(self, request_id: str) -> tuple[int, int] | None:
        known = self._state["requests"].get(request_id)
        return None if known is None else known[1]

    def step_times(self) -> dict[int, float]:
        """As :meth:`AsyncEngine.step_times`, at the stage's latest snapshot."""
        stats: EngineStatistics = self._state["statistics"]
        return dict(stats.step_time_s)

    def queue_position(self, request_id: str) -> int | None:
        known = self._state["requests"].get(request_id)
        return None if known is None else known[2]

    def is_idle(self) -> bool:
        if self._dead is not None or self._closing:
            return True
        return not self._open and not self._calls and bool(self._state.get("idle"))

    def leftovers(self) -> dict[str, set[str]]:
        """What the stage's engine held at its latest snapshot, plus this side's open
        streams (``stage_streams``) and control calls (``stage_calls``)."""
        held: dict[str, set[str]] = {k: set(v) for k, v in self._state["leftovers"].items()}
        held["stage_streams"] = set(self._by_id)
        held["stage_calls"] = {str(call_id) for call_id in self._calls}
        return held

    async def wait_ended(self) -> None:
        """Return once the stage died or was closed.  Cancelling the wait is harmless."""
        await self._ended.wait()

    # -- ending ----------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the stage; idempotent, shielded from cancellation.  Open streams end with
        an ``EngineClosedError`` output at once; the stage closes its engine and exits
        within its engine's close bound (:func:`engine_close_bound_s`) plus
        :data:`CLOSE_MARGIN_S`, else it is terminated, then its whole process group
        killed."""
        if self._closing:
            with trio.CancelScope(shield=True):
                await self._close_done.wait()
            return
        was_dead = self._dead is not None
        self._closing = True
        self._ended.set()
        with trio.CancelScope(shield=True):
            try:
                if not was_dead:
                    self._end_streams(_S.FINISHED_ABORTED, "engine is closed", "EngineClosedError")
                self._fail_calls(EngineClosedError("engine is closed"))
                self._post(("close",))
                self._outbox_send.close()
                await self._reap()
            finally:
                self._close_done.set()

    async def _reap(self) -> None:
        process = self._process
        with trio.move_on_after(engine_close_bound_s(self.config) + CLOSE_MARGIN_S):
            await process.wait()
        if process.returncode is None:
            log.warning("stage process %d did not exit; terminating it", process.pid)
            process.terminate()
            with trio.move_on_after(TERM_GRACE_S):
                await process.wait()
        if process.returncode != 0:
            _kill_group(process.pid)  # what is left of its group (its workers)
        if process.returncode is None:
            process.kill()
            with trio.move_on_after(KILL_GRACE_S):
                await process.wait()
        await self._connection.aclose()


def _kill_group(pgid: int) -> None:
    """SIGKILL what is left of a stage's process group (nothing, normally)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _StageProcess(Protocol):
    """What the stage needs of its process: a :class:`trio.Process` (a new interpreter, our
    child) or a :class:`~omni_trio.executors._process.ForkedProcess` (the fork server's)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def kill(self) -> None: ...

    def terminate(self) -> None: ...


_Socket = trio.socket.SocketType


async def _start_stage_process(config: EngineConfig) -> tuple[_StageProcess, _Socket]:
    """The stage process and this side of its connection: forked from the fork server where
    :func:`~omni_trio.executors.tractor_executor.stage_forks` says so (the fork server's
    preload is done once for every stage; waited for, uncancellably, the first time), else
    -- or if the fork server cannot start or fork -- a new interpreter in a new session,
    handed one end of a socketpair.  Either gets this process's environment without its
    secrets."""
    if stage_forks(config):
        try:
            return await _fork_stage()
        except (OSError, EOFError) as exc:
            log.warning("stage process not forked (%r): starting a new interpreter", exc)
    ours, theirs = socket.socketpair()
    try:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "omni_trio.runtime.stage_child", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            start_new_session=True,
            env=forked_environment(),
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    return process, trio.socket.from_stdlib_socket(ours)


async def _fork_stage() -> tuple[ForkedProcess, _Socket]:
    """Fork a stage process, which connects back to a Unix socket in a directory only this
    user can enter (tractor's fork server loses the descriptors it is sent, so it cannot be
    handed a socketpair); a connection from any other process is refused.  Raises
    :class:`EngineDeadError` if it ends before it connected; cancelled meanwhile (or on any
    other error), it is killed."""
    # The preload first (seconds, uncancellable, the first time), then the socket's
    # directory: a caller killed meanwhile leaves none behind.
    await trio.to_thread.run_sync(warm_fork_server)
    environ = forked_environment()
    with tempfile.TemporaryDirectory(prefix="omni-trio-stage-") as directory:
        path = os.path.join(directory, "stage.sock")
        with trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            await listener.bind(path)
            listener.listen(4)
            start = functools.partial(
                start_forked, SERVE_FORKED, (path, environ), name="omni-trio-stage"
            )
            process = await trio.to_thread.run_sync(start)
            connected: list[_Socket] = []
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_cancel_on_exit, process, nursery.cancel_scope)
                    connected.append(await _accept_from(listener, process.pid))
                    nursery.cancel_scope.cancel()
            except BaseException:
                for connection in connected:
                    connection.close()
                connected.clear()
                raise
            finally:
                if not connected:
                    with trio.CancelScope(shield=True):
                        _kill_group(process.pid)
                        process.kill()
                        await process.wait()
    if not connected:
        code = process.returncode
        raise EngineDeadError(
            f"the stage process {process.pid} ended while starting"
            + ("" if code is None else f" (exit code {code})")
        )
    return process, connected[0]


async def _accept_from(listener: _Socket, pid: int) -> _Socket:
    """The first connection to ``listener`` from process ``pid`` (others are closed; where
    the platform cannot say who connected, the first: the directory is the user's own)."""
    option = getattr(socket, "SO_PEERCRED", None)
    while True:
        connection, _ = await listener.accept()
        if option is None:  # pragma: no cover - not Linux
            return connection
        credentials = connection.getsockopt(socket.SOL_SOCKET, option, _CRED.size)
        if _CRED.unpack(credentials)[0] == pid:
            return connection
        connection.close()


# struct ucred: pid, uid, gid.
_CRED = struct.Struct("3i")


async def _cancel_on_exit(process: _StageProcess, scope: trio.CancelScope) -> None:
    await process.wait()
    scope.cancel()


@asynccontextmanager
async def open_stage_engine(config: EngineConfig) -> AsyncIterator[StageEngine]:
    """Start a stage process running ``open_engine(config)`` and yield its
    :class:`StageEngine` once the engine there is ready; raises what opening it raised
    there (the same type), or :class:`EngineDeadError` if the process ended first.  Leaving
    the block closes the stage (see :meth:`StageEngine.aclose`); cancelled while starting,
    the stage process group is killed."""
    try:
        pickle.dumps(config)
    except Exception as exc:
        raise InvalidConfigError(
            f"the engine config cannot be sent to a stage process: {type(exc).__name__}: {exc}",
            field="stage",
        ) from exc
    process, ours = await _start_stage_process(config)
    connection = trio.SocketStream(ours)
    reader = FrameReader(connection)
    started = False
    try:
        await connection.send_all(frame(("open", config)))
        first = await reader.receive()
        if first is None or first[0] not in ("ready", "failed"):
            with trio.move_on_after(TERM_GRACE_S):
                await process.wait()
            code = process.returncode
            raise EngineDeadError(
                f"the stage process {process.pid} ended while starting"
                + ("" if code is None else f" (exit code {code})")
            )
        if first[0] == "failed":
            with trio.move_on_after(CLOSE_MARGIN_S):
                await process.wait()
            raise decode_error(first[1])
        _, model_info, state = first
        engine = StageEngine(config, process, connection, reader, model_info, state)
        started = True
    finally:
        if not started:
            with trio.CancelScope(shield=True):
                _kill_group(process.pid)
                if process.returncode is None:
                    process.kill()
                await process.wait()
                await connection.aclose()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine._read)
        nursery.start_soon(engine._write)
        nursery.start_soon(engine._watch_process)
        try:
            yield engine
        finally:
            await engine.aclose()
            nursery.cancel_scope.cancel()
