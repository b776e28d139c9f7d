"""The HTTP server of ``omni-trio serve``: hypercorn's protocol code (HTTP/1.1 by h11, HTTP/2
by h2) under our own listener and connection wrapper, for the bounds hypercorn 0.18 lacks.

hypercorn already bounds: a connection's idle time *and* the time until a request head is
complete (``keep_alive_timeout``: its idle timer runs from accept until the head is in, so a
client trickling its headers is closed), the size of a request head
(``h11_max_incomplete_size``, 16 KiB: 431 beyond it), and how far reading runs ahead of the app
(``max_app_queue_size`` messages).  It does not bound the number of connections, the time a
response may take to be written (its socket writes are *shielded* from cancellation, so a
client that stops reading holds its handler, the bytes being sent and the server's shutdown
for ever; over HTTP/2 it buffers whatever the client's flow-control window does not take,
without limit), or what happens to connections still open when it stops (it waits for them).
:func:`serve_http` adds, per :class:`HttpLimits`::

    max_connections     beyond it a new connection is answered 503 (the OpenAI envelope,
                        Connection: close, Retry-After from the server's ``retry_after``)
                        and closed; the open ones are not disturbed
    send_timeout_s      the write deadline, owned here for both protocols: each socket write
                        of at most SEND_CHUNK bytes must be taken by the kernel within it and,
                        over HTTP/2, each DATA chunk the app hands over must also leave within
                        it (a client that reads TCP but sends no WINDOW_UPDATE is caught
                        too).  Past it the connection is closed: a blocked write fails at once,
                        the handlers see a disconnect (a streaming request is aborted), what
                        they were sending is freed, and the drop is counted and logged once
                        (``omni_trio_slow_clients_total{reason="send_timeout"}``)
    max_connection_buffer_bytes
                        request bytes read ahead of the app for one connection: every read
                        is at most ``receive_chunk`` bytes and at most ``app_queue_size``
                        reads wait for the app, ``(app_queue_size + 2) * receive_chunk`` in
                        all (HTTP/2: per stream, with the concurrent streams capped to fit)
    graceful_timeout_s  at shutdown: listeners close, idle connections close, the others get
                        this long to finish, then their sockets are closed, so the server
                        always returns

Handlers see the write deadline of their connection in the ASGI scope
(``scope["extensions"][SEND_DEADLINE]``, a :class:`SendDeadline`): once it expired they stop
sending (the app sends its bodies in :data:`SEND_CHUNK` pieces, so each piece is under the
deadline on its own).

The protocol errors hypercorn answers itself (a malformed request line or header, a request
head over 16 KiB, an unsupported HTTP version or transfer coding) get a body with the OpenAI
error envelope over HTTP/1.1.  Over HTTP/2 such errors are frames (``RST_STREAM``,
``GOAWAY``), which carry no body.  A failure of hypercorn's protocol code on one connection
(hypercorn 0.18 raises ``KeyError`` for HTTP/2 DATA on a stream it has already answered)
closes that connection and is logged; the server goes on.

The request-body read timeout is the app's (:class:`~omni_trio.serve.app.ImagesApp`: a 408
with the envelope), and so is the admission bound on response bytes.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import h11
import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config
from hypercorn.events import Closed, Event, RawData
from hypercorn.protocol import ProtocolWrapper
from hypercorn.protocol.events import Body
from hypercorn.protocol.events import Event as StreamEvent
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.protocol.h11 import H2CProtocolRequiredError, H2ProtocolAssumedError, H11Protocol
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.utils import repr_socket_addr
from trio_typing import TaskStatus

from .config import MIB, MIN_CONNECTION_BUFFER_BYTES, _check_float
from .images import error_body
from .pool import new_request_id

if TYPE_CHECKING:
    from .metrics import ServeMetrics

__all__ = [
    "FD_RESERVE",
    "HEAD_MAX_BYTES",
    "SEND_CHUNK",
    "SEND_DEADLINE",
    "GuardedStream",
    "HttpLimits",
    "HttpServer",
    "HttpStatistics",
    "SendDeadline",
    "fit_connection_cap",
    "protocol_error_body",
    "serve_http",
]

log = logging.getLogger(__name__)

SEND_CHUNK = 64 * 1024  # the unit of send_timeout_s
# A request line and headers: hypercorn refuses (431) a head it has not received whole within
# this many bytes; the app measures one that arrived whole in a single read (431 too).
HEAD_MAX_BYTES = 16 * 1024
# The ASGI scope extension holding the connection's SendDeadline.
SEND_DEADLINE = "omni_trio.send_deadline"
MAX_RECEIVE = 64 * 1024  # hypercorn's own read size
H2_FRAME = 16 * 1024  # HTTP/2's default largest inbound DATA frame (hypercorn's setting)
# File descriptors kept for everything but client connections (the listener, logs, worker
# pipes and channels, shared memory, model files); see fit_connection_cap.
FD_RESERVE = 256
# A refused connection: its 503 is written, then what it sent is read and dropped (so the
# close does not reset the answer away), for at most this long / this many bytes.
REFUSE_S = 1.0
REFUSE_READ_MAX = 64 * 1024
MAX_REFUSING = 64  # refusals answered at once; past it a new connection is just closed
ACCEPT_RETRY_S = 0.1
_ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
# Retry-After of a refused connection when the server is given no measure of its own.
RETRY_AFTER_S = 2

_PROTOCOL_ERRORS: dict[int, tuple[str, str]] = {
    400: ("malformed HTTP request (request line, headers or framing)", "invalid_http_request"),
    431: (
        f"the request line and headers exceed {HEAD_MAX_BYTES} bytes",
        "request_header_fields_too_large",
    ),
    501: ("unsupported transfer coding", "not_implemented"),
    505: ("HTTP version not supported; use HTTP/1.1 or HTTP/2", "http_version_not_supported"),
}


def protocol_error_body(status: int) -> dict[str, Any]:
    """The envelope for a protocol error the HTTP server answers itself."""
    message, code = _PROTOCOL_ERRORS.get(status, ("HTTP protocol error", "invalid_http_request"))
    return error_body(message, type="invalid_request_error", code=code)


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """The HTTP server's bounds (see the module docstring); :class:`ServeConfig` fields of the
    same names, ``graceful_timeout_s`` aside (the daemon's constant), checked the same way:
    ``ValueError`` for a bad one."""

    max_connections: int = 1000
    keep_alive_timeout_s: float = 5.0
    send_timeout_s: float = 30.0
    max_connection_buffer_bytes: int = MIB
    graceful_timeout_s: float = 3.0

    def __post_init__(self) -> None:
        for name, minimum in (
            ("max_connections", 1),
            ("max_connection_buffer_bytes", MIN_CONNECTION_BUFFER_BYTES),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        for name, positive in (
            ("keep_alive_timeout_s", True),
            ("send_timeout_s", True),
            ("graceful_timeout_s", False),
        ):
            _check_float(name, getattr(self, name), positive=positive)  # a ValueError

    @property
    def receive_chunk(self) -> int:
        """The most bytes one read takes from a connection."""
        return min(MAX_RECEIVE, self.max_connection_buffer_bytes // 4)

    @property
    def app_queue_size(self) -> int:
        """Reads that may wait for the app (hypercorn's ``max_app_queue_size``)."""
        return max(1, self.max_connection_buffer_bytes // self.receive_chunk - 2)

    @property
    def h2_max_concurrent_streams(self) -> int:
        """HTTP/2 streams per connection such that their queues fit the buffer."""
        return max(1, self.max_connection_buffer_bytes // (self.app_queue_size * H2_FRAME))

    def hypercorn_config(self, bind: Sequence[str]) -> Config:
        """A hypercorn :class:`Config` binding ``bind`` with these bounds applied (its own
        access log off, its error log on ``hypercorn.error``, no ``Server`` header)."""
        hc = Config()
        hc.bind = list(bind)
        hc.accesslog = None
        hc.errorlog = logging.getLogger("hypercorn.error")
        hc.include_server_header = False
        hc.graceful_timeout = self.graceful_timeout_s
        hc.keep_alive_timeout = self.keep_alive_timeout_s
        hc.max_app_queue_size = self.app_queue_size
        hc.h11_max_incomplete_size = HEAD_MAX_BYTES
        hc.h2_max_concurrent_streams = self.h2_max_concurrent_streams
        hc.backlog = min(4096, max(100, self.max_connections))
        return hc


def fit_connection_cap(max_connections: int) -> tuple[int, str | None]:
    """Make room for ``max_connections`` client sockets under ``RLIMIT_NOFILE``: raise the
    soft limit (up to the hard one) to ``max_connections + FD_RESERVE`` when it is lower.
    Returns the cap that fits (``max_connections``, or less when the hard limit is too low)
    and, when it had to be lowered, a warning to log."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):  # pragma: no cover - no such limit here
        return max_connections, None
    need = max_connections + FD_RESERVE
    infinite = resource.RLIM_INFINITY
    if soft != infinite and soft < need:
        target = need if hard == infinite else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError):
            pass
    if soft == infinite or soft >= need:
        return max_connections, None
    cap = max(1, soft - FD_RESERVE)
    return cap, (
        f"max_connections={max_connections} does not fit the open-file limit "
        f"(RLIMIT_NOFILE {soft}, {FD_RESERVE} kept for the daemon itself): serving at most "
        f"{cap} connections; raise the limit (systemd: LimitNOFILE=) or lower max_connections"
    )


class SendDeadline:
    """One connection's write deadline as its handlers see it
    (``scope["extensions"][SEND_DEADLINE]``): ``timeout_s`` per :data:`SEND_CHUNK`, and
    ``expired``, set once the client failed to take a chunk in time.  The connection is then
    closed and the drop already counted and logged by the server: a handler only stops
    sending.  Written by the connection's :class:`GuardedStream` only."""

    __slots__ = ("expired", "timeout_s")

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.expired = False


class GuardedStream(trio.abc.HalfCloseableStream):
    """A client connection's stream with a deadline per :data:`SEND_CHUNK` of every write and
    a cap on every read.

    A write that cannot hand a chunk to the kernel within ``send_timeout_s`` :meth:`expire` s
    the connection and raises :class:`trio.BrokenResourceError` (hypercorn treats that as the
    client gone).  :meth:`abort` closes the socket from any task: a write or read blocked on
    it, shielded or not, fails at once with :class:`trio.ClosedResourceError`.  ``peer`` is
    the client's address as it was at accept (a closed socket has none).
    """

    def __init__(
        self,
        inner: trio.SocketStream,
        *,
        send_timeout_s: float,
        receive_chunk: int = MAX_RECEIVE,
        peer: str = "?",
        on_send_timeout: Callable[[GuardedStream], None] | None = None,
    ) -> None:
        self._inner = inner
        self.deadline = SendDeadline(send_timeout_s)
        self.peer = peer
        self._receive_chunk = receive_chunk
        self._on_send_timeout = on_send_timeout
        self.aborted = False

    @property
    def socket(self) -> trio.socket.SocketType:
        """The socket (hypercorn reads the peer and local addresses from it)."""
        return self._inner.socket

    @property
    def send_timed_out(self) -> bool:
        return self.deadline.expired

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data)
        if not len(view):
            await self._inner.send_all(b"")
            return
        timeout = self.deadline.timeout_s
        for start in range(0, len(view), SEND_CHUNK):
            with trio.move_on_after(timeout) as scope:
                await self._inner.send_all(view[start : start + SEND_CHUNK])
            if scope.cancelled_caught:
                self.expire()
                raise trio.BrokenResourceError(f"the client took no data for {timeout} s")

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self._inner.send_eof()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        size = self._receive_chunk if max_bytes is None else min(max_bytes, self._receive_chunk)
        return await self._inner.receive_some(size)

    def expire(self) -> None:
        """The client took no data within the deadline: mark it expired, close the
        connection and report it to ``on_send_timeout`` -- once, however many writers of the
        connection notice (no checkpoint)."""
        if self.deadline.expired:
            return
        self.deadline.expired = True
        self.abort()
        if self._on_send_timeout is not None:
            self._on_send_timeout(self)

    def abort(self) -> None:
        """Close the connection now, without a checkpoint (idempotent)."""
        self.aborted = True
        self._inner.socket.close()

    async def aclose(self) -> None:
        await self._inner.aclose()


class _H11Protocol(H11Protocol):
    """hypercorn's HTTP/1.1 protocol, answering its own protocol errors with the envelope
    (its ``_send_error_response`` sends an empty body)."""

    on_protocol_error: Callable[[int], None] | None = None

    async def _send_error_response(self, status_code: int) -> None:
        payload = json.dumps(protocol_error_body(status_code), separators=(",", ":")).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"connection", b"close"),
            (b"x-request-id", new_request_id().encode()),
            (b"cache-control", b"no-store"),
            *self.config.response_headers("h11"),
        ]
        await self._send_h11_event(h11.Response(status_code=status_code, headers=headers))
        await self._send_h11_event(h11.Data(data=payload))
        await self._send_h11_event(h11.EndOfMessage())
        if self.on_protocol_error is not None:
            self.on_protocol_error(status_code)


class _H2Protocol(H2Protocol):
    """hypercorn's HTTP/2 protocol with the write deadline on flow control too.

    hypercorn takes a DATA chunk from the app into the stream's buffer and returns once the
    buffer is below its high-water mark -- which a stream whose window is closed also
    reports, so a client that reads TCP but never sends WINDOW_UPDATE would have it buffer
    the whole response and hold the handler until the connection ends.  Here each chunk must
    leave the buffer within ``send_timeout_s`` (the app sends :data:`SEND_CHUNK` pieces), else
    the connection is closed (:meth:`GuardedStream.expire`).  On a close, every stream's buffer
    is dropped at once, which also ends those waits."""

    guard: GuardedStream  # set right after construction

    async def stream_send(self, event: StreamEvent) -> None:
        await super().stream_send(event)
        if not isinstance(event, Body) or self.closed:
            return
        buffer = self.stream_buffers.get(event.stream_id)
        if buffer is None:
            return
        with trio.move_on_after(self.guard.deadline.timeout_s) as scope:
            await buffer.drain()
        if scope.cancelled_caught and not self.closed:
            self.guard.expire()

    async def handle(self, event: Event) -> None:
        await super().handle(event)
        if isinstance(event, Closed):
            for buffer in list(self.stream_buffers.values()):
                await buffer.close()


class _ProtocolWrapper(ProtocolWrapper):
    """hypercorn's protocol switch (HTTP/1.1 first; HTTP/2 by prior knowledge or an h2c
    upgrade), building :class:`_H11Protocol` and :class:`_H2Protocol` instead of hypercorn's
    own classes (its ``handle`` names them directly, so it is restated here)."""

    def __init__(
        self,
        wrapper: ProtocolWrapper,
        guard: GuardedStream,
        on_protocol_error: Callable[[int], None] | None,
    ) -> None:
        super().__init__(
            wrapper.app,
            wrapper.config,
            wrapper.context,
            wrapper.task_group,
            wrapper.state,
            wrapper.ssl,
            wrapper.client,
            wrapper.server,
            wrapper.send,
        )
        self._guard = guard
        self._on_protocol_error = on_protocol_error
        self.protocol = self._h2() if isinstance(wrapper.protocol, H2Protocol) else self._h11()

    def _args(self) -> tuple[Any, ...]:
        return (
            self.app,
            self.config,
            self.context,
            self.task_group,
            self.state,
            self.ssl,
            self.client,
            self.server,
            self.send,
        )

    def _h11(self) -> _H11Protocol:
        protocol = _H11Protocol(*self._args())
        protocol.on_protocol_error = self._on_protocol_error
        return protocol

    def _h2(self) -> _H2Protocol:
        protocol = _H2Protocol(*self._args())
        protocol.guard = self._guard
        return protocol

    async def handle(self, event: Event) -> None:
        try:
            return await self.protocol.handle(event)
        except H2ProtocolAssumedError as error:
            self.protocol = self._h2()
            await self.protocol.initiate()
            if error.data != b"":
                return await self.protocol.handle(RawData(data=error.data))
        except H2CProtocolRequiredError as error:
            self.protocol = self._h2()
            await self.protocol.initiate(error.headers, error.settings)
            if error.data != b"":
                return await self.protocol.handle(RawData(data=error.data))


class _Connection(TCPServer):
    """hypercorn's connection driver with our protocol classes (the driver builds its protocol
    wrapper itself; this catches the assignment), and whose slot is freed as soon as the
    client closes (hypercorn's idle timer would hold it until ``keep_alive_timeout``)."""

    def __init__(
        self,
        app: Any,
        config: Config,
        context: WorkerContext,
        stream: GuardedStream,
        on_protocol_error: Callable[[int], None] | None = None,
    ) -> None:
        state: Any = {}  # hypercorn's lifespan state: the app keeps none
        super().__init__(app, config, context, state, cast(Any, stream))
        self._guard = stream
        self._on_protocol_error = on_protocol_error

    async def _read_data(self) -> None:
        await super()._read_data()
        await self.idle_task.stop()

    @property
    def protocol(self) -> ProtocolWrapper:
        return self._wrapper

    @protocol.setter
    def protocol(self, wrapper: ProtocolWrapper) -> None:
        self._wrapper = _ProtocolWrapper(wrapper, self._guard, self._on_protocol_error)


class _ConnectionApp:
    """The app as one connection's protocol code calls it: with the connection's
    :class:`SendDeadline` in every scope's extensions."""

    def __init__(self, app: ASGIWrapper, deadline: SendDeadline) -> None:
        self._app = app
        self._deadline = deadline

    async def __call__(
        self, scope: Any, receive: Any, send: Any, sync_spawn: Any, call_soon: Any
    ) -> None:
        scope.setdefault("extensions", {})[SEND_DEADLINE] = self._deadline
        await self._app(scope, receive, send, sync_spawn, call_soon)


def _refusal(max_connections: int, retry_after_s: int) -> bytes:
    body = error_body(
        f"the server has too many open connections (max_connections={max_connections}); "
        "retry later",
        type="server_error",
        code="too_many_connections",
    )
    payload = json.dumps(body, separators=(",", ":")).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n"
        f"retry-after: {retry_after_s}\r\n"
        "cache-control: no-store\r\n"
        "connection: close\r\n"
        f"x-request-id: {new_request_id()}\r\n\r\n"
    )
    return head.encode("ascii") + payload


def _peer(stream: trio.SocketStream) -> str:
    try:
        return repr_socket_addr(stream.socket.family, stream.socket.getpeername())
    except OSError:  # already reset by the client
        return "?"


@dataclass(frozen=True, slots=True)
class HttpStatistics:
    """A snapshot of :class:`HttpServer`: connections open now, and since it started: those
    refused at the cap, those closed because the client took no data within
    ``send_timeout_s``, and those still open ``graceful_timeout_s`` after the stop (closed)."""

    open_connections: int
    refused: int
    send_timeouts: int
    closed_at_shutdown: int


class HttpServer:
    """Accepts connections on hypercorn's sockets and runs each under hypercorn's protocol
    code in a :class:`GuardedStream`, within :class:`HttpLimits` (see the module docstring).

    Invariant: ``_open`` holds exactly the connections accepted and not yet ended; it never
    holds more than ``limits.max_connections``.  The counters only grow; read them with
    :meth:`statistics`.
    """

    def __init__(
        self,
        app: Any,
        hc: Config,
        limits: HttpLimits,
        *,
        metrics: ServeMetrics | None = None,
        retry_after: Callable[[], int] | None = None,
    ) -> None:
        self._app = ASGIWrapper(app)
        self._hc = hc
        self.limits = limits
        self._metrics = metrics
        # Retry-After (s) of a refused connection, asked at each refusal (the daemon's: one
        # request's service time at the pool's measured rate); RETRY_AFTER_S without it.
        self._retry_after = retry_after
        self._context = WorkerContext(None)
        self._open: set[GuardedStream] = set()
        self._none_open = trio.Event()
        self._none_open.set()
        self._refusing = 0
        self._at_cap = False
        self._refused = 0
        self._send_timeouts = 0
        self._closed_at_shutdown = 0

    def statistics(self) -> HttpStatistics:
        """The counters and the open connections now (no checkpoint)."""
        return HttpStatistics(
            open_connections=len(self._open),
            refused=self._refused,
            send_timeouts=self._send_timeouts,
            closed_at_shutdown=self._closed_at_shutdown,
        )

    async def serve(
        self,
        *,
        shutdown_trigger: Callable[[], Awaitable[object]],
        task_status: TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Bind, report ``started(urls)``, serve until ``shutdown_trigger()`` returns, then
        stop (see the module docstring): returns within ``graceful_timeout_s`` plus a
        moment, whatever the clients do.  Binding errors (``OSError``) raise before
        ``started``."""
        hc = self._hc
        if hc.ssl_enabled:
            raise ValueError("TLS is not supported here: terminate it in a reverse proxy")
        sockets = hc.create_sockets()
        listeners: list[trio.SocketListener] = []
        binds: list[str] = []
        try:
            for sock in sockets.insecure_sockets:
                sock.listen(hc.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
                binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
        except BaseException:
            for sock in sockets.insecure_sockets:
                sock.close()
            raise
        try:
            async with trio.open_nursery() as connections:
                try:
                    async with trio.open_nursery() as accepting:
                        for listener in listeners:
                            accepting.start_soon(self._accept, listener, connections)
                        task_status.started(binds)
                        await shutdown_trigger()
                        accepting.cancel_scope.cancel()
                    await self._stop(listeners)
                except BaseException:
                    # Cancelled (or failed): a handler blocked in a shielded write would hold
                    # this nursery for ever; closing its socket frees it.
                    self.abort_all()
                    raise
                connections.cancel_scope.cancel()
        finally:
            for listener in listeners:
                with trio.CancelScope(shield=True):
                    await listener.aclose()

    async def _stop(self, listeners: list[trio.SocketListener]) -> None:
        for listener in listeners:
            await listener.aclose()
        # Idle keep-alive connections close now (their idle timer waits on this), and no
        # connection starts another request.
        await self._context.terminated.set()
        with trio.move_on_after(self.limits.graceful_timeout_s):
            await self._none_open.wait()
        if self._open:
            self._closed_at_shutdown = len(self._open)
            log.info(
                "closing %d connection(s) still open %.1f s after the HTTP server stopped",
                len(self._open),
                self.limits.graceful_timeout_s,
            )
            self.abort_all()

    def abort_all(self) -> None:
        """Close every open connection now (their handlers see a disconnect)."""
        for stream in list(self._open):
            stream.abort()

    async def _accept(self, listener: trio.SocketListener, connections: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                    raise
                log.error(
                    "accept failed: %s (%s); retrying in %.1f s",
                    errno.errorcode.get(exc.errno, exc.errno),
                    os.strerror(exc.errno),
                    ACCEPT_RETRY_S,
                )
                await trio.sleep(ACCEPT_RETRY_S)
                continue
            if len(self._open) >= self.limits.max_connections:
                self._refuse(stream, connections)
                continue
            if self._at_cap:
                self._at_cap = False
                log.info("below the connection cap again: accepting new connections")
            guarded = GuardedStream(
                stream,
                send_timeout_s=self.limits.send_timeout_s,
                receive_chunk=self.limits.receive_chunk,
                peer=_peer(stream),
                on_send_timeout=self._on_send_timeout,
            )
            self._open.add(guarded)
            self._none_open = trio.Event() if self._none_open.is_set() else self._none_open
            self._count_connections()
            connections.start_soon(self._run_connection, guarded)

    async def _run_connection(self, stream: GuardedStream) -> None:
        """One connection under hypercorn's protocol code, to its end.  A failure of that
        code (an ``Exception``; never ``Cancelled``) ends this connection only: it is logged
        with its traceback and the socket closed."""
        app = _ConnectionApp(self._app, stream.deadline)
        connection = _Connection(app, self._hc, self._context, stream, self._on_protocol_error)
        try:
            await connection.run()
        except Exception:
            log.exception(
                "the HTTP protocol code failed on the connection of %s; closing it",
                stream.peer,
                extra={"client": stream.peer},
            )
            stream.abort()
        finally:
            self._open.discard(stream)
            if not self._open:
                self._none_open.set()
            self._count_connections()

    def _refuse(self, stream: trio.SocketStream, connections: trio.Nursery) -> None:
        self._refused += 1
        if self._metrics is not None:
            self._metrics.observe_connection_refused()
        if not self._at_cap:
            self._at_cap = True
            log.warning(
                "connection cap reached (%d open, max_connections=%d): refusing new "
                "connections with 503",
                len(self._open),
                self.limits.max_connections,
            )
        if self._refusing >= MAX_REFUSING:
            stream.socket.close()
            return
        self._refusing += 1
        connections.start_soon(self._answer_refused, stream)

    async def _answer_refused(self, stream: trio.SocketStream) -> None:
        retry_after = RETRY_AFTER_S if self._retry_after is None else self._retry_after()
        try:
            with trio.move_on_after(REFUSE_S):
                await stream.send_all(_refusal(self.limits.max_connections, retry_after))
                await stream.send_eof()
                read = 0
                while read < REFUSE_READ_MAX:
                    data = await stream.receive_some(MAX_RECEIVE)
                    if not data:
                        break
                    read += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            self._refusing -= 1
            stream.socket.close()

    def _on_send_timeout(self, stream: GuardedStream) -> None:
        self._send_timeouts += 1
        if self._metrics is not None:
            self._metrics.observe_slow_client("send_timeout")
        log.info(
            "dropped the connection of %s: it took no response data for %.1f s",
            stream.peer,
            self.limits.send_timeout_s,
            extra={"client": stream.peer},
        )

    def _on_protocol_error(self, status: int) -> None:
        if self._metrics is not None:
            self._metrics.observe_request("protocol_error", status)

    def _count_connections(self) -> None:
        if self._metrics is not None:
            self._metrics.connections.set(len(self._open))


async def serve_http(
    app: Any,
    hc: Config,
    limits: HttpLimits,
    *,
    shutdown_trigger: Callable[[], Awaitable[object]],
    metrics: ServeMetrics | None = None,
    retry_after: Callable[[], int] | None = None,
    task_status: TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the ASGI ``app`` on ``hc.bind`` within ``limits`` until ``shutdown_trigger()``
    returns (see :meth:`HttpServer.serve`); ``started`` gets the bound URLs.
    ``retry_after()`` gives the ``Retry-After`` of a connection refused at the cap."""
    server = HttpServer(app, hc, limits, metrics=metrics, retry_after=retry_after)
    await server.serve(shutdown_trigger=shutdown_trigger, task_status=task_status)
