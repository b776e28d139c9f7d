"""The HTTP server's bounds on slow and stalled clients, each against a real socket: a reader
that stops is dropped once (and what it held is freed), over HTTP/1.1 and HTTP/2 (a client that
never opens its flow-control window), a body that stalls gets 408, headers that trickle are cut
off, the connection cap refuses with 503 and recovers, hypercorn's own protocol errors carry
the OpenAI envelope, a failure of its protocol code ends one connection only, and shutdown
closes what is still open.

:class:`GuardedStream` is also driven under ``MockClock`` (exact virtual times); the rest use
small real timeouts, with bounds on both sides, inside ``trio.fail_after``.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import pytest
import trio
import trio.testing

try:  # the HTTP/2 client of these tests; hypercorn's own dependency, so normally present
    import h2.config
    import h2.connection
    import h2.events
except ImportError:  # pragma: no cover
    h2 = None

from omni_trio.errors import InvalidConfigError
from omni_trio.serve.config import MIB, MIN_CONNECTION_BUFFER_BYTES, ServeConfig
from omni_trio.serve.http import (
    FD_RESERVE,
    HEAD_MAX_BYTES,
    SEND_CHUNK,
    GuardedStream,
    HttpLimits,
    HttpServer,
    fit_connection_cap,
    protocol_error_body,
)
from omni_trio.serve.images import ImageStore
from tests.serve.conftest import CAP_S, Server, assert_envelope, run_server, wait_until

GEN = "/v1/images/generations"
BIG = 32 * MIB  # far more than loopback's socket buffers (a few MiB) can take


# -- GuardedStream (virtual time) -----------------------------------------------------------


async def _stream_pair(**kwargs: Any) -> tuple[GuardedStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    return GuardedStream(trio.SocketStream(a), **kwargs), trio.SocketStream(b)


async def test_a_send_the_peer_does_not_take_fails_after_the_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    dropped: list[GuardedStream] = []
    guarded, peer = await _stream_pair(send_timeout_s=7.0, on_send_timeout=dropped.append)
    start = trio.current_time()
    with pytest.raises(trio.BrokenResourceError, match=r"took no data for 7\.0 s"):
        await guarded.send_all(b"x" * (4 * MIB))
    assert trio.current_time() - start == pytest.approx(7.0)
    assert guarded.send_timed_out and guarded.aborted and dropped == [guarded]
    assert guarded.deadline.expired
    assert guarded.socket.fileno() == -1  # closed: its buffers go with it
    guarded.expire()  # another writer noticing the same expiry reports nothing more
    assert dropped == [guarded]
    await peer.aclose()


async def test_a_slow_reader_that_keeps_up_with_each_chunk_is_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The deadline is per 64 KiB: a reader taking 256 KiB every 5 s (timeout 7 s) gets all
    of 2 MiB, although the whole takes far longer than the timeout."""
    guarded, peer = await _stream_pair(send_timeout_s=7.0)
    total = 32 * SEND_CHUNK
    got = bytearray()
    start = trio.current_time()

    async def read_slowly() -> None:
        while len(got) < total:
            await trio.sleep(5.0)
            wake = len(got)
            while len(got) < min(total, wake + 4 * SEND_CHUNK):
                got.extend(await peer.receive_some(SEND_CHUNK))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_slowly)
        await guarded.send_all(b"y" * total)
    assert len(got) == total and not guarded.send_timed_out
    assert trio.current_time() - start > 3 * 7.0
    await guarded.aclose()
    await peer.aclose()


async def test_abort_wakes_a_blocked_shielded_send_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    guarded, peer = await _stream_pair(send_timeout_s=1000.0)
    failed: list[BaseException] = []

    async def send_shielded() -> None:
        with trio.CancelScope(shield=True):  # as hypercorn writes
            try:
                await guarded.send_all(b"z" * (4 * MIB))
            except trio.ClosedResourceError as exc:
                failed.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_shielded)
        await trio.testing.wait_all_tasks_blocked()
        start = trio.current_time()
        guarded.abort()
    assert failed and trio.current_time() == start
    await peer.aclose()


async def test_reads_are_capped_to_the_receive_chunk() -> None:
    guarded, peer = await _stream_pair(send_timeout_s=1.0, receive_chunk=1000)
    await peer.send_all(b"a" * 5000)
    assert len(await guarded.receive_some(10**6)) <= 1000
    assert len(await guarded.receive_some()) <= 1000
    await guarded.aclose()
    await peer.aclose()


# -- limits -----------------------------------------------------------------------------------


@pytest.mark.parametrize("buffer", [MIN_CONNECTION_BUFFER_BYTES, 100_000, MIB, 16 * MIB])
def test_the_read_ahead_fits_the_connection_buffer(buffer: int) -> None:
    limits = HttpLimits(max_connection_buffer_bytes=buffer)
    # a queue of reads waiting for the app, the read being handed over, h11's own buffer
    assert (limits.app_queue_size + 2) * limits.receive_chunk <= buffer
    assert limits.h2_max_concurrent_streams * limits.app_queue_size * 16 * 1024 <= max(
        buffer, limits.app_queue_size * 16 * 1024
    )
    hc = limits.hypercorn_config(["127.0.0.1:0"])
    assert hc.max_app_queue_size == limits.app_queue_size
    assert hc.h11_max_incomplete_size == HEAD_MAX_BYTES
    assert hc.keep_alive_timeout == limits.keep_alive_timeout_s
    assert hc.accesslog is None and not hc.include_server_header


@pytest.mark.parametrize(
    "bad",
    [
        {"max_connections": 0},
        {"max_connections": True},
        {"send_timeout_s": -1.0},
        {"send_timeout_s": 0},
        {"send_timeout_s": float("inf")},
        {"keep_alive_timeout_s": 0.0},
        {"keep_alive_timeout_s": "5"},
        {"graceful_timeout_s": -0.5},
        {"max_connection_buffer_bytes": 1},
        {"max_connection_buffer_bytes": MIN_CONNECTION_BUFFER_BYTES - 1},
        {"max_connection_buffer_bytes": True},
        {"max_connection_buffer_bytes": float(MIB)},
        {"max_connection_buffer_bytes": "1MiB"},
    ],
)
def test_limits_are_checked(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        HttpLimits(**bad)


def test_limits_accept_what_the_serve_config_accepts() -> None:
    """The same minimum buffer on both sides, and zero graceful time is fine (close at once)."""
    assert HttpLimits(max_connection_buffer_bytes=MIN_CONNECTION_BUFFER_BYTES, graceful_timeout_s=0)
    ServeConfig(max_connection_buffer_bytes=MIN_CONNECTION_BUFFER_BYTES)
    with pytest.raises(InvalidConfigError):
        ServeConfig(max_connection_buffer_bytes=MIN_CONNECTION_BUFFER_BYTES - 1)


def test_the_connection_cap_is_fitted_under_the_open_file_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import resource

    limits = {"soft": 1024, "hard": 4096}

    def getrlimit(_: int) -> tuple[int, int]:
        return limits["soft"], limits["hard"]

    def setrlimit(_: int, value: tuple[int, int]) -> None:
        assert value[1] == limits["hard"]
        limits["soft"] = value[0]

    monkeypatch.setattr(resource, "getrlimit", getrlimit)
    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    # the soft limit is raised to make room
    assert fit_connection_cap(1000) == (1000, None)
    assert limits["soft"] == 1000 + FD_RESERVE
    # the hard limit is the ceiling: the cap comes down, with a warning
    limits.update(soft=1024, hard=1024)
    cap, warning = fit_connection_cap(2000)
    assert cap == 1024 - FD_RESERVE
    assert warning is not None and "LimitNOFILE" in warning


def test_protocol_error_bodies_are_envelopes() -> None:
    for status in (400, 431, 501, 505, 418):
        error = protocol_error_body(status)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]


# -- against the real server ----------------------------------------------------------------


async def _connect(server: Server, *, rcvbuf: int | None = None) -> trio.SocketStream:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:  # before connecting, so the window stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect((host, int(port)))
    return trio.SocketStream(sock)


async def _read_until_closed(stream: trio.SocketStream) -> bytes:
    """Everything the server sends until it closes: at EOF, or at a reset (a server that
    closes a socket it has not read to the end resets it), accepted explicitly."""
    data = bytearray()
    try:
        while chunk := await stream.receive_some(65536):
            data.extend(chunk)
    except trio.BrokenResourceError:
        pass
    return bytes(data)


def _split(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    return status, headers, body


def _envelope(raw: bytes, status: int, code: str) -> dict[str, Any]:
    got, headers, body = _split(raw)
    assert got == status, raw[:300]
    assert headers["content-type"] == "application/json" and headers.get("x-request-id")
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error


def _metric(text: str, line: str) -> float:
    """The value of the sample ``line`` (name and labels) in a text exposition; 0 if absent."""
    for sample in text.splitlines():
        name, _, value = sample.rpartition(" ")
        if name == line:
            return float(value)
    return 0.0


SEND_TIMEOUTS = 'omni_trio_slow_clients_total{reason="send_timeout"}'
needs_h2 = pytest.mark.skipif(h2 is None, reason="the h2 library (HTTP/2 client) is not installed")


async def test_a_reader_that_stops_is_dropped_and_what_it_held_is_freed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client asks for 32 MiB and reads nothing.  While its response waits, those bytes
    count against max_response_bytes_in_flight (new generations and downloads get 429);
    after the send timeout its connection is closed, the drop is counted and logged once
    with the client's address, and the bytes are released."""
    timeout = 0.5
    caplog.set_level(logging.INFO, logger="omni_trio.serve.http")
    async with run_server(
        http_limits=HttpLimits(send_timeout_s=timeout, graceful_timeout_s=0.5),
        app_options={"send_timeout_s": timeout, "max_response_bytes_in_flight": 8 * MIB},
        store=ImageStore(max_bytes=2 * BIG + MIB),
    ) as server:
        assert server.http is not None
        http = server.http
        with trio.fail_after(CAP_S):
            file_id = server.store.put(b"\0" * BIG, "image/png")
            small_id = server.store.put(b"\1" * 1000, "image/png")
            stalled = await _connect(server, rcvbuf=4096)
            host, port = stalled.socket.getsockname()[:2]
            client_address = f"{host}:{port}"
            started = trio.current_time()
            await stalled.send_all(
                f"GET /v1/files/{file_id}/content HTTP/1.1\r\nHost: x\r\n\r\n".encode()
            )
            await wait_until(lambda: server.app.responses.in_flight >= BIG)
            async with server.client() as client:
                body = {"prompt": "x", "size": "64x64", "num_inference_steps": 1}
                r = await client.post(GEN, json=body)
                error = assert_envelope(r, 429, code="response_memory_full")
                assert error["type"] == "rate_limit_error" and r.headers["retry-after"] == "2"
                r = await client.get(f"/v1/files/{small_id}/content")
                assert_envelope(r, 429, code="response_memory_full")
                assert r.headers["retry-after"] == "2"
                await wait_until(lambda: server.app.responses.in_flight == 0)
                dropped_after = trio.current_time() - started
                assert timeout <= dropped_after < timeout + 10
                assert http.statistics().send_timeouts == 1
                assert (await client.post(GEN, json=body)).status_code == 200
                assert (await client.get(f"/v1/files/{small_id}/content")).content == b"\1" * 1000
                metrics = (await client.get("/metrics")).text
            assert _metric(metrics, SEND_TIMEOUTS) == 1.0
            got = await _read_until_closed(stalled)  # what it had been sent, then the close
            assert got.startswith(b"HTTP/1.1 200") and len(got) < BIG
            await stalled.aclose()
    (drop,) = [r for r in caplog.records if "took no response data" in r.getMessage()]
    assert client_address in drop.getMessage() and drop.__dict__["client"] == client_address
    (record,) = [r for r in server.records if r["path"] == f"/v1/files/{file_id}/content"]
    assert (record["status"], record["outcome"]) == (200, "send_timeout")


async def test_a_stalled_event_stream_reader_is_dropped_and_counted_once() -> None:
    """An SSE client that stops reading while four 1024x1024 images (about 16 MiB of events)
    are sent: the HTTP server alone owns the write deadline, so the drop is counted once,
    the handler stops at once (outcome ``send_timeout``) and everything it held is freed."""
    timeout = 0.5
    async with run_server(
        http_limits=HttpLimits(
            send_timeout_s=timeout, keep_alive_timeout_s=60.0, graceful_timeout_s=0.5
        ),
        app_options={"send_timeout_s": timeout},
    ) as server:
        assert server.http is not None
        http = server.http
        with trio.fail_after(CAP_S):
            stalled = await _connect(server, rcvbuf=4096)
            body = json.dumps(
                {
                    "prompt": "x",
                    "size": "1024x1024",
                    "n": 4,
                    "num_inference_steps": 1,
                    "stream": True,
                }
            ).encode()
            await stalled.send_all(
                f"POST {GEN} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"X-Request-Id: stalled-sse\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await wait_until(lambda: http.statistics().send_timeouts == 1)
            await wait_until(lambda: any(r["request_id"] == "stalled-sse" for r in server.records))
            await wait_until(lambda: server.pool.in_flight == 0)
            await wait_until(lambda: server.app.responses.in_flight == 0)
            async with server.client() as client:
                metrics = (await client.get("/metrics")).text
            assert _metric(metrics, SEND_TIMEOUTS) == 1.0
            assert http.statistics().send_timeouts == 1
            got = await _read_until_closed(stalled)
            assert got.startswith(b"HTTP/1.1 200") and b"text/event-stream" in got
            await stalled.aclose()
    (record,) = [r for r in server.records if r["request_id"] == "stalled-sse"]
    assert (record["status"], record["outcome"]) == (200, "send_timeout")


# -- HTTP/2, with a bare client (h2 over a loopback socket, prior knowledge) -------------------


class H2Client:
    """An HTTP/2 client that does only what the test says: it reads every byte the server
    sends but never opens its flow-control window (no WINDOW_UPDATE) unless told."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )

    @classmethod
    async def connect(cls, server: Server) -> H2Client:
        client = cls(await _connect(server))
        client.conn.initiate_connection()
        await client.flush()
        return client

    async def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            await self.stream.send_all(data)

    async def request(self, method: str, path: str, *, end_stream: bool = True) -> int:
        stream_id: int = self.conn.get_next_available_stream_id()
        headers = [
            (b":method", method.encode()),
            (b":path", path.encode()),
            (b":scheme", b"http"),
            (b":authority", b"x"),
        ]
        self.conn.send_headers(stream_id, headers, end_stream=end_stream)
        await self.flush()
        return stream_id

    async def events(self) -> list[h2.events.Event] | None:
        """The next events (SETTINGS and PING acknowledged); None once the server closed."""
        try:
            data = await self.stream.receive_some(65536)
        except trio.BrokenResourceError:
            return None
        if not data:
            return None
        events = self.conn.receive_data(data)
        await self.flush()
        return events


@needs_h2
async def test_an_http2_client_that_never_opens_its_window_is_dropped() -> None:
    """A client that reads TCP but sends no WINDOW_UPDATE gets the first 64 KiB of a 1 MiB
    download; then, send_timeout_s later, its connection is closed, the drop is counted once
    and the bytes are released (hypercorn alone would buffer the rest and hold the handler
    until the connection's idle timeout)."""
    timeout = 0.5
    async with run_server(
        http_limits=HttpLimits(
            send_timeout_s=timeout, keep_alive_timeout_s=60.0, graceful_timeout_s=0.5
        ),
        app_options={"send_timeout_s": timeout},
    ) as server:
        assert server.http is not None
        http = server.http
        with trio.fail_after(CAP_S):
            file_id = server.store.put(b"\2" * MIB, "image/png")
            client = await H2Client.connect(server)
            started = trio.current_time()
            stream_id = await client.request("GET", f"/v1/files/{file_id}/content")
            status, received = None, 0
            while (events := await client.events()) is not None:
                for event in events:
                    if isinstance(event, h2.events.ResponseReceived):
                        status = dict(event.headers)[b":status"]
                    elif isinstance(event, h2.events.DataReceived):
                        assert event.stream_id == stream_id
                        received += len(event.data)
            closed_after = trio.current_time() - started
            assert status == b"200"
            assert 0 < received <= 65535  # the initial window, no more
            assert timeout <= closed_after < timeout + 10
            assert http.statistics().send_timeouts == 1
            await wait_until(lambda: server.app.responses.in_flight == 0)
            async with server.client() as http1:
                metrics = (await http1.get("/metrics")).text
            assert _metric(metrics, SEND_TIMEOUTS) == 1.0
            await client.stream.aclose()
        (record,) = [r for r in server.records if r["route"] == "/v1/files/{id}/content"]
        assert record["outcome"] == "send_timeout"


@needs_h2
async def test_an_http2_client_that_keeps_reading_gets_the_whole_download() -> None:
    """The deadline is per chunk: a client that opens its window as it reads gets all of a
    1 MiB download over HTTP/2 (the app's 64 KiB pieces each wait for the window)."""
    async with run_server(http_limits=HttpLimits(send_timeout_s=5.0)) as server:
        assert server.http is not None
        with trio.fail_after(CAP_S):
            payload = bytes(range(256)) * (MIB // 256)
            file_id = server.store.put(payload, "image/png")
            client = await H2Client.connect(server)
            stream_id = await client.request("GET", f"/v1/files/{file_id}/content")
            got = bytearray()
            ended = False
            while not ended:
                events = await client.events()
                assert events is not None
                for event in events:
                    if isinstance(event, h2.events.DataReceived):
                        got.extend(event.data)
                        client.conn.acknowledge_received_data(
                            event.flow_controlled_length, event.stream_id
                        )
                    elif isinstance(event, h2.events.StreamEnded):
                        ended = True
                await client.flush()
            assert bytes(got) == payload and event.stream_id == stream_id
            assert server.http.statistics().send_timeouts == 0
            await client.stream.aclose()


@needs_h2
async def test_a_failure_in_the_protocol_code_ends_one_connection_not_the_server(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """hypercorn 0.18 raises KeyError for HTTP/2 DATA on a stream it has already answered
    (a GET whose client keeps its side open).  That closes this connection and is logged;
    it used to end the whole HTTP server, and the daemon with it."""
    caplog.set_level(logging.ERROR, logger="omni_trio.serve.http")
    async with run_server() as server:
        assert server.http is not None
        http = server.http
        with trio.fail_after(CAP_S):
            client = await H2Client.connect(server)
            stream_id = await client.request("GET", "/health", end_stream=False)
            ended = False
            while not ended:
                events = await client.events()
                assert events is not None
                ended = any(isinstance(e, h2.events.StreamEnded) for e in events)
            client.conn.send_data(stream_id, b"late")
            await client.flush()
            while await client.events() is not None:  # the server closes this connection
                pass
            await client.stream.aclose()
            await wait_until(lambda: http.statistics().open_connections == 0)
            async with server.client() as http1:
                assert (await http1.get("/health")).status_code == 200
    (failure,) = [r for r in caplog.records if "protocol code failed" in r.getMessage()]
    assert failure.levelno == logging.ERROR and failure.exc_info is not None


async def test_a_body_that_stalls_gets_408_and_the_connection_closes() -> None:
    async with run_server(app_options={"body_read_timeout_s": 0.3}) as server:
        assert server.http is not None
        http = server.http
        with trio.fail_after(CAP_S):
            stream = await _connect(server)
            await wait_until(lambda: http.statistics().open_connections == 1)
            started = trio.current_time()
            await stream.send_all(
                f"POST {GEN} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                'Content-Length: 1000\r\n\r\n{"prompt": '.encode()
            )
            raw = await _read_until_closed(stream)
            elapsed = trio.current_time() - started
            error = _envelope(raw, 408, "request_timeout")
            assert "0.3 s" in error["message"]
            assert _split(raw)[1]["connection"] == "close"
            assert 0.3 <= elapsed < 10
            await wait_until(lambda: http.statistics().open_connections == 0)  # closed by us
            await stream.aclose()
            async with server.client() as client:
                metrics = (await client.get("/metrics")).text
        assert _metric(metrics, 'omni_trio_slow_clients_total{reason="body_timeout"}') == 1.0
        timed_out = [r for r in server.records if r["status"] == 408]
        assert [(r["route"], r["outcome"]) for r in timed_out] == [(GEN, "rejected")]


async def test_a_request_head_that_trickles_is_cut_off() -> None:
    """hypercorn's idle timer runs until a request head is complete: a client sending its
    head a byte every 0.1 s (which would take 3 s) is closed keep_alive_timeout_s after it
    connected, whatever it keeps sending."""
    keep_alive = 0.5
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: yes\r\n"  # never ends
    limits = HttpLimits(keep_alive_timeout_s=keep_alive, graceful_timeout_s=0.5)
    async with run_server(http_limits=limits) as server:
        assert server.http is not None
        http = server.http
        with trio.fail_after(CAP_S):
            stream = await _connect(server)
            started = trio.current_time()
            sent = 0

            async def trickle() -> None:
                nonlocal sent
                try:
                    for byte in head:
                        await stream.send_all(bytes([byte]))
                        sent += 1
                        await trio.sleep(0.1)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass  # the server closed it

            async with trio.open_nursery() as nursery:
                nursery.start_soon(trickle)
                assert await _read_until_closed(stream) == b""
                closed_after = trio.current_time() - started
                nursery.cancel_scope.cancel()
            assert keep_alive <= closed_after < 0.1 * len(head) - 0.5
            assert 2 <= sent < len(head)
            await stream.aclose()
            await wait_until(lambda: http.statistics().open_connections == 0)


async def test_past_the_connection_cap_new_connections_get_503_and_the_rest_is_fine() -> None:
    limits = HttpLimits(max_connections=2, keep_alive_timeout_s=60.0, graceful_timeout_s=0.5)
    async with run_server(http_limits=limits) as server:
        assert server.http is not None
        http = server.http
        with trio.fail_after(CAP_S):
            held = [await _connect(server) for _ in range(2)]
            await wait_until(lambda: http.statistics().open_connections == 2)
            refused = await _connect(server)
            await refused.send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            raw = await _read_until_closed(refused)
            error = _envelope(raw, 503, "too_many_connections")
            assert "max_connections=2" in error["message"]
            # As the daemon wires it: one service time at the measured rate (nothing
            # measured yet here: the pool's default).
            assert _split(raw)[1]["retry-after"] == str(server.pool.retry_after_s(excess=1))
            await refused.aclose()
            stats = http.statistics()
            assert (stats.open_connections, stats.refused) == (2, 1)
            # the connections inside the cap still work
            await held[0].send_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = await held[0].receive_some(65536)
            assert reply.startswith(b"HTTP/1.1 200")
            # one goes: room for a new one
            await held[1].aclose()
            await wait_until(lambda: http.statistics().open_connections == 1)
            async with server.client() as client:
                assert (await client.get("/health")).status_code == 200
                metrics = (await client.get("/metrics")).text
            assert "omni_trio_connections_refused_total 1.0" in metrics
            await held[0].aclose()


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        (b"GARBAGE\r\n\r\n", 400, "invalid_http_request"),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", 400, "invalid_http_request"),
        (  # more than one read holds: hypercorn's own 431
            b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (100 * 1024) + b"\r\n\r\n",
            431,
            "request_header_fields_too_large",
        ),
        (
            b"GET /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n",
            501,
            "not_implemented",
        ),
    ],
)
async def test_the_servers_own_protocol_errors_carry_the_envelope(
    request_bytes: bytes, status: int, code: str
) -> None:
    async with run_server() as server:
        with trio.fail_after(CAP_S):
            stream = await _connect(server)
            await stream.send_all(request_bytes)
            raw = await _read_until_closed(stream)
            _envelope(raw, status, code)
            await stream.aclose()
            async with server.client() as client:
                assert (await client.get("/health")).status_code == 200
                metrics = (await client.get("/metrics")).text
        line = f'omni_trio_requests_total{{route="protocol_error",status="{status}"}} 1.0'
        assert line in metrics


async def test_an_oversize_header_from_a_real_client_is_a_431_envelope() -> None:
    """20 KiB of headers arrive in one read, whole, so hypercorn takes them: the app
    measures the head and answers 431."""
    async with run_server() as server, server.client() as client:
        with trio.fail_after(CAP_S):
            r = await client.get("/health", headers={"X-Big": "a" * (20 * 1024)})
            assert_envelope(r, 431, code="request_header_fields_too_large")
            assert (await client.get("/health")).status_code == 200


# -- shutdown --------------------------------------------------------------------------------


class BigBodyApp:
    """A bare ASGI app answering every request with 32 MiB (one write); ``sending`` is set
    as that write starts."""

    def __init__(self) -> None:
        self.sending = trio.Event()

    async def __call__(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        self.sending.set()
        await send({"type": "http.response.body", "body": b"\0" * BIG, "more_body": False})


@asynccontextmanager
async def _bare_server(
    limits: HttpLimits,
) -> AsyncIterator[tuple[HttpServer, BigBodyApp, str, trio.Event]]:
    stop = trio.Event()
    app = BigBodyApp()
    http = HttpServer(app, limits.hypercorn_config(["127.0.0.1:0"]), limits)
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(http.serve, shutdown_trigger=stop.wait))
        yield http, app, binds[0], stop
        if not stop.is_set():  # no orderly stop asked: cancel the server
            nursery.cancel_scope.cancel()


async def test_a_refused_connection_is_told_the_retry_after_the_server_gives_then() -> None:
    """The cap's 503 carries the ``Retry-After`` that ``retry_after()`` gives at each
    refusal (the daemon's measures the pool), not a constant."""
    limits = HttpLimits(max_connections=1, keep_alive_timeout_s=60.0, graceful_timeout_s=0.5)
    waits = iter([7, 9])
    http = HttpServer(
        BigBodyApp(),
        limits.hypercorn_config(["127.0.0.1:0"]),
        limits,
        retry_after=lambda: next(waits),
    )
    seen: list[str] = []
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(partial(http.serve, shutdown_trigger=trio.sleep_forever))
            host, port = binds[0].removeprefix("http://").rsplit(":", 1)
            held = await trio.open_tcp_stream(host, int(port))
            await wait_until(lambda: http.statistics().open_connections == 1)
            for _ in range(2):
                refused = await trio.open_tcp_stream(host, int(port))
                await refused.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                raw = await _read_until_closed(refused)
                _envelope(raw, 503, "too_many_connections")
                seen.append(_split(raw)[1]["retry-after"])
                await refused.aclose()
            await held.aclose()
            nursery.cancel_scope.cancel()
    assert seen == ["7", "9"]


async def test_shutdown_closes_connections_still_open_and_returns() -> None:
    """A reader that stopped (and a send timeout far away) cannot hold the server's stop:
    after graceful_timeout_s its connection is closed and serve returns."""
    limits = HttpLimits(send_timeout_s=1000.0, graceful_timeout_s=0.5)
    with trio.fail_after(CAP_S):
        async with _bare_server(limits) as (http, app, url, stop):
            host, port = url.removeprefix("http://").rsplit(":", 1)
            sock = trio.socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await sock.connect((host, int(port)))
            stalled = trio.SocketStream(sock)
            await stalled.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await app.sending.wait()
            stopped_at = trio.current_time()
            stop.set()
        assert 0.5 <= trio.current_time() - stopped_at < 10
        stats = http.statistics()
        assert (stats.closed_at_shutdown, stats.open_connections) == (1, 0)
        await stalled.aclose()


async def test_cancelling_the_server_frees_a_handler_stuck_in_a_shielded_write() -> None:
    limits = HttpLimits(send_timeout_s=1000.0, graceful_timeout_s=1000.0)
    with trio.fail_after(CAP_S):
        async with _bare_server(limits) as (http, app, url, _stop):
            host, port = url.removeprefix("http://").rsplit(":", 1)
            sock = trio.socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await sock.connect((host, int(port)))
            stalled = trio.SocketStream(sock)
            await stalled.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await app.sending.wait()
            raise_at = trio.current_time()
            # leaving the block cancels serve (no shutdown trigger)
        assert trio.current_time() - raise_at < 10
        assert http.statistics().open_connections == 0
        await stalled.aclose()


async def test_after_shutdown_new_connections_are_refused_by_the_kernel() -> None:
    limits = HttpLimits(graceful_timeout_s=0.5)
    with trio.fail_after(CAP_S):
        async with _bare_server(limits) as (_http, _app, url, stop):
            stop.set()
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient() as client:
                await client.get(url)
