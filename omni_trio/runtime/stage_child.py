"""The stage process: one engine in a child process, served over a socket to its caller.

Run as ``python -m omni_trio.runtime.stage_child FD`` by :func:`.stage.open_stage_engine`,
``FD`` being this process's end of a socketpair (see :mod:`.stage_wire` for the messages), or
forked from the fork server into :func:`serve_forked`, which connects back to the caller's
Unix socket instead.
:func:`serve_stage` opens the engine the first message configures, says ``ready`` (or
``failed``, with the error, and returns), then carries out the caller's messages until
``close`` or the end of the connection -- the caller closed or died: the engine is closed
either way, so no worker of it outlives its caller.  Every ``submit`` becomes a stream whose
outputs go back as they come; ``gone`` leaves that stream (the request is aborted, as for a
consumer that left); a ``state`` snapshot (health, statistics, each request's status,
progress and queue position) follows every change, at most every :data:`STATE_PERIOD_S`,
and always precedes a terminal output and a call's answer.  An engine that dies here (not
closed) is reported in a last snapshot and ends the session: this process then exits, so
its caller sees a dead stage at once.  A request, output, argument or value that cannot be
(un)pickled fails its own request or call only.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
import socket
import sys
from typing import Any

import trio

from .._core.lifecycle import RequestStatus
from .._core.messages import DiffusionOutput
from .._core.request import DiffusionRequest
from ..config import EngineConfig
from ..errors import InvalidConfigError, PayloadError
from .engine import AsyncEngine, open_engine
from .request_stream import RequestStream
from .stage_wire import FrameReader, WireError, encode_error, frame

__all__ = [
    "CALLS",
    "PROCESS_NAME",
    "STATE_PERIOD_S",
    "main",
    "serve_forked",
    "serve_stage",
    "snapshot",
]

log = logging.getLogger(__name__)

# How often the stage looks for a change to report (health, statistics, requests).
STATE_PERIOD_S = 0.05
# The engine methods a "call" message may run (each awaited, its result sent back).
CALLS = frozenset(
    {
        "collective_rpc",
        "sleep",
        "start_profile",
        "stop_profile",
        "wait_idle",
        "wake_up",
        "worker_leftovers",
    }
)


def snapshot(engine: AsyncEngine, request_ids: set[str]) -> dict[str, Any]:
    """What the caller's synchronous accessors answer from, until the next one."""
    try:
        engine.check_health()
    except Exception as exc:
        health_error: WireError | None = encode_error(exc)
    else:
        health_error = None
    return {
        "health_error": health_error,
        "health": engine.health(),
        "statistics": engine.statistics(),
        "idle": engine.is_idle(),
        "sleeping": engine.is_sleeping,
        "profiling": engine.profiling,
        "closed": engine.is_closed,
        "dead": engine.is_dead,
        "model_info": engine.model_info,
        "cost_model": engine.core.cost_model,
        "leftovers": engine.leftovers(),
        "requests": {
            rid: (engine.status(rid), engine.progress(rid), engine.queue_position(rid))
            for rid in request_ids
        },
    }


class _Session:
    """One engine and the caller's submissions on it (all on this process's trio thread)."""

    def __init__(self, engine: AsyncEngine, send: trio.MemorySendChannel[tuple[Any, ...]]) -> None:
        self.engine = engine
        self.send = send
        # wire key -> (request id, the scope of the task forwarding its outputs)
        self.streams: dict[int, tuple[str, trio.CancelScope]] = {}
        self.changed = trio.Event()

    def post(self, message: tuple[Any, ...]) -> None:
        _post(self.send, message)

    def request_ids(self) -> set[str]:
        return {rid for rid, _ in self.streams.values()}

    def post_state(self) -> None:
        self.post(("state", snapshot(self.engine, self.request_ids())))

    def submit(self, nursery: trio.Nursery, key: int, rid: str, payload: bytes) -> None:
        try:
            request = pickle.loads(payload)
            if not isinstance(request, DiffusionRequest):
                raise TypeError(f"a {type(request).__name__}, not a DiffusionRequest")
        except Exception as exc:
            error: BaseException = PayloadError(
                f"the request could not be read in the stage process: {type(exc).__name__}: {exc}"
            )
            self.post(("rejected", key, _dump_error(error)))
            return
        try:
            stream = self.engine.stream(request, None, request_id=rid)
        except Exception as exc:
            self.post(("rejected", key, _dump_error(exc)))
            return
        scope = trio.CancelScope()
        self.streams[key] = (rid, scope)
        self.changed.set()
        nursery.start_soon(self._forward, key, rid, stream, scope)

    async def _forward(
        self, key: int, rid: str, stream: RequestStream, scope: trio.CancelScope
    ) -> None:
        try:
            with scope:
                async with stream:
                    async for output in stream:
                        if output.finished:  # what the caller reads next agrees with it
                            self.post_state()
                        try:
                            payload = pickle.dumps(output, pickle.HIGHEST_PROTOCOL)
                        except Exception as exc:
                            # Its output cannot cross: the request ends here, with that error.
                            payload = pickle.dumps(_unsendable(rid, exc))
                            self.post(("out", key, payload))
                            if not output.finished:
                                self.engine.abort(rid)
                            return
                        self.post(("out", key, payload))
                        self.changed.set()
        finally:
            self.streams.pop(key, None)
            self.changed.set()

    def gone(self, key: int) -> None:
        """The caller's consumer left: abort at once, as the engine does for its own."""
        entry = self.streams.pop(key, None)
        if entry is not None:
            rid, scope = entry
            self.engine.abort(rid)
            scope.cancel()
            self.changed.set()

    async def call(self, call_id: int, method: str, payload: bytes) -> None:
        try:
            if method not in CALLS:
                raise InvalidConfigError(f"a stage does not run {method!r}")
            try:
                args, kwargs = pickle.loads(payload)
            except Exception as exc:
                raise PayloadError(
                    f"the arguments of {method!r} could not be read in the stage process: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            result = await getattr(self.engine, method)(*args, **kwargs)
            try:
                reply: tuple[Any, ...] = ("reply", call_id, True, pickle.dumps(result))
            except Exception as exc:
                raise PayloadError(
                    f"the value of {method!r} cannot be sent back: {type(exc).__name__}: {exc}"
                ) from exc
        except Exception as exc:
            reply = ("reply", call_id, False, _dump_error(exc))
        # What the caller reads once the call returned agrees with it.
        self.post_state()
        self.post(reply)
        self.changed.set()

    async def push_state(self) -> None:
        last: dict[str, Any] | None = None
        while True:
            with trio.move_on_after(STATE_PERIOD_S):
                await self.changed.wait()
            self.changed = trio.Event()
            state = snapshot(self.engine, self.request_ids())
            if state != last:
                self.post(("state", state))
                last = state
            await trio.sleep(STATE_PERIOD_S)

    async def watch_engine(self, session_scope: trio.CancelScope) -> None:
        """The engine died (not closed): say so and end the session, so this process ends
        and its caller sees a dead stage at once."""
        await self.engine.wait_ended()
        if self.engine.is_dead:
            self.post_state()
            session_scope.cancel()


def _post(send: trio.MemorySendChannel[tuple[Any, ...]], message: tuple[Any, ...]) -> None:
    """Queue ``message`` for the writer (dropped once the caller is gone)."""
    try:
        send.send_nowait(message)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


def _dump_error(exc: BaseException) -> bytes:
    try:
        return pickle.dumps(encode_error(exc))
    except Exception:  # pragma: no cover - encode_error keeps only what pickles
        return pickle.dumps(encode_error(RuntimeError(f"{type(exc).__name__}: {exc}")))


def _unsendable(rid: str, exc: BaseException) -> DiffusionOutput:
    return DiffusionOutput(
        rid,
        RequestStatus.FINISHED_ERROR,
        error=f"the output cannot be sent to the caller: {type(exc).__name__}: {exc}",
        error_type="PayloadError",
    )


async def _serve_session(session: _Session, reader: FrameReader) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(session.push_state)
        nursery.start_soon(session.watch_engine, nursery.cancel_scope)
        while True:
            message = await reader.receive()
            if message is None or message[0] == "close":
                break
            kind = message[0]
            if kind == "submit":
                _, key, rid, payload = message
                session.submit(nursery, key, rid, payload)
            elif kind == "abort":
                session.engine.abort(*message[1])
            elif kind == "gone":
                session.gone(message[1])
            elif kind == "call":
                _, call_id, method, payload = message
                nursery.start_soon(session.call, call_id, method, payload)
            else:
                raise ValueError(f"unknown stage message {kind!r}")
        nursery.cancel_scope.cancel()


async def serve_stage(sock: socket.socket) -> None:
    """Serve one engine over ``sock`` until the caller says ``close`` or goes away.  Returns
    once the engine is closed and ``closed`` was sent (or could not be: the caller is
    gone)."""
    connection = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
    reader = FrameReader(connection)
    send, receive = trio.open_memory_channel[tuple[Any, ...]](math.inf)

    async def write() -> None:
        async with receive:
            async for message in receive:
                try:
                    await connection.send_all(frame(message))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return  # the caller is gone: nothing more to say

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write)
        async with send:
            first = await reader.receive()
            if first is None:
                return
            if first[0] != "open" or not isinstance(first[1], EngineConfig):
                raise ValueError(f"the first stage message must be 'open', not {first[0]!r}")
            config: EngineConfig = first[1]
            opened: list[AsyncEngine] = []
            try:
                async with open_engine(config) as engine:
                    opened.append(engine)
                    _post(send, ("ready", engine.model_info, snapshot(engine, set())))
                    await _serve_session(_Session(engine, send), reader)
                    # (Leaving the block closes the engine: it ends what still runs.)
            except Exception as exc:
                if opened:
                    raise
                _post(send, ("failed", encode_error(exc)))
                return
            _post(send, ("closed", snapshot(opened[0], set())))


# What ``ps``/``top`` call a stage process (Linux ``/proc/PID/comm``; a forked one's command
# line is its fork server's).
PROCESS_NAME = "omni-trio-stage"


def _name_process(name: str) -> None:
    """Set this process's name (``PR_SET_NAME``) where the platform allows; else nothing."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # 15: PR_SET_NAME
    except (OSError, AttributeError):  # pragma: no cover - not Linux
        pass


def _serve(sock: socket.socket) -> None:
    _name_process(PROCESS_NAME)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s stage %(name)s: %(message)s")
    trio.run(serve_stage, sock)


def main(argv: list[str] | None = None) -> None:
    """The entry of a stage process started as a new interpreter: ``python -m
    omni_trio.runtime.stage_child FD``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0].isdigit():
        raise SystemExit("usage: python -m omni_trio.runtime.stage_child FD")
    _serve(socket.socket(fileno=int(args[0])))


def serve_forked(path: str, environ: dict[str, str]) -> None:
    """The entry of a stage process forked from the fork server (the caller's
    :func:`~omni_trio.executors.tractor_executor.start_forked`, which already gave it the
    caller's working directory and ``sys.path``): first it takes what a new interpreter
    started by the caller would have -- its own session and process group (the caller
    kills the group), the caller's environment of the moment the stage was opened
    (``environ``, secrets left out; the fork server's is that of when it started) and the
    ``PYTHONPATH`` entries in it on ``sys.path`` -- then it connects to the caller's Unix
    socket at ``path`` and serves there as :func:`main` does."""
    os.setsid()
    os.environ.clear()
    os.environ.update(environ)
    entries = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for entry in reversed(entries):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    _serve(sock)


if __name__ == "__main__":
    main()
