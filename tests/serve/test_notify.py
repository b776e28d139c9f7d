"""The systemd notify protocol against a fake NOTIFY_SOCKET (a bound datagram socket, by path
and abstract), the watchdog interval parsing, and the watchdog loop's timing on a MockClock."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from omni_trio.serve.notify import SystemdNotifier, serve_watchdog, watchdog_interval


@pytest.fixture
def path_socket(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    try:
        yield path, sock
    finally:
        sock.close()


@pytest.fixture
def abstract_socket() -> Iterator[tuple[str, socket.socket]]:
    name = f"omni-trio-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(5)
    try:
        yield "@" + name, sock
    finally:
        sock.close()


def received(sock: socket.socket) -> list[str]:
    """Every datagram waiting on ``sock`` (no wait for more)."""
    out = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096).decode())
    except BlockingIOError:
        pass
    finally:
        sock.settimeout(5)
    return out


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_messages_arrive(
    kind: str,
    path_socket: tuple[str, socket.socket],
    abstract_socket: tuple[str, socket.socket],
) -> None:
    address, sock = path_socket if kind == "path" else abstract_socket
    notifier = SystemdNotifier.from_environ({"NOTIFY_SOCKET": address})
    assert notifier.enabled
    try:
        assert notifier.ready()
        assert notifier.status("serving 2 replicas")
        assert notifier.watchdog()
        assert notifier.stopping(status="draining")
        assert notifier.send(ready=1, status="line one\nline two")
    finally:
        notifier.close()
    assert received(sock) == [
        "READY=1",
        "STATUS=serving 2 replicas",
        "WATCHDOG=1",
        "STOPPING=1\nSTATUS=draining",
        "READY=1\nSTATUS=line one line two",
    ]


def test_noop_without_notify_socket() -> None:
    notifier = SystemdNotifier.from_environ({})
    assert not notifier.enabled
    assert not notifier.ready()
    assert not notifier.watchdog()
    assert not notifier.stopping()
    assert not notifier.status("x")
    notifier.close()


def test_unsupported_address_disables(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="omni_trio.serve.notify"):
        notifier = SystemdNotifier("vsock:2:1234")
    assert not notifier.enabled
    assert "not supported" in caplog.text


def test_send_failure_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    notifier = SystemdNotifier(str(tmp_path / "nobody-listens.sock"))
    with caplog.at_level(logging.DEBUG, logger="omni_trio.serve.notify"):
        assert not notifier.ready()
        assert not notifier.watchdog()
    notifier.close()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # once loudly, then quietly
    assert "READY=1" in warnings[0].getMessage()


def test_from_environ_unset(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "s"))
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    notifier = SystemdNotifier.from_environ(unset=True)
    assert notifier.enabled
    for name in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID"):
        assert name not in os.environ


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "400000"}, 0.2),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-5"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "OWN"}, 1.0),
        ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "OTHER"}, None),
        ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "x"}, None),
        ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": ""}, 1.0),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    pid = env.get("WATCHDOG_PID")
    if pid == "OWN":
        env = {**env, "WATCHDOG_PID": str(os.getpid())}
    elif pid == "OTHER":
        env = {**env, "WATCHDOG_PID": str(os.getpid() + 1)}
    assert watchdog_interval(env) == expected


class RecordingNotifier(SystemdNotifier):
    """Records the virtual time of every WATCHDOG=1 instead of sending it."""

    def __init__(self) -> None:
        super().__init__("@recording")
        self.pings: list[float] = []

    def send(self, **fields: object) -> bool:
        assert fields == {"watchdog": 1}
        self.pings.append(trio.current_time())
        return True


async def test_watchdog_loop_timing(autojump_clock: trio.testing.MockClock) -> None:
    notifier = RecordingNotifier()
    with trio.fail_after(100):
        async with trio.open_nursery() as nursery:
            start = trio.current_time()
            interval = await nursery.start(partial(serve_watchdog, notifier, interval=5.0))
            assert interval == 5.0
            await trio.sleep(22)
            nursery.cancel_scope.cancel()
    assert [round(t - start, 6) for t in notifier.pings] == [0, 5, 10, 15, 20]


async def test_watchdog_stall_does_not_burst(autojump_clock: trio.testing.MockClock) -> None:
    # A blocked loop (simulated by jumping the clock while the task cannot run) stops the
    # pings; afterwards they resume one interval apart, without catching up.
    notifier = RecordingNotifier()
    with trio.fail_after(100):
        async with trio.open_nursery() as nursery:
            start = trio.current_time()
            await nursery.start(partial(serve_watchdog, notifier, interval=5.0))
            autojump_clock.jump(12)  # the loop was stuck for 12 s
            await trio.sleep(9)
            nursery.cancel_scope.cancel()
    assert [round(t - start, 6) for t in notifier.pings] == [0, 12, 17]


async def test_watchdog_from_environ(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    notifier = RecordingNotifier()
    with trio.fail_after(100):
        async with trio.open_nursery() as nursery:
            assert await nursery.start(serve_watchdog, notifier) == 1.0
            await trio.sleep(2.5)
            nursery.cancel_scope.cancel()
    assert len(notifier.pings) == 3


async def test_watchdog_disabled_returns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            # no notify socket
            assert (
                await nursery.start(partial(serve_watchdog, SystemdNotifier(None), interval=1.0))
                is None
            )
            # no watchdog asked for
            assert await nursery.start(serve_watchdog, RecordingNotifier()) is None


async def test_watchdog_real_socket(path_socket: tuple[str, socket.socket]) -> None:
    address, sock = path_socket
    notifier = SystemdNotifier(address)
    try:
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await nursery.start(partial(serve_watchdog, notifier, interval=0.01))
                got: list[bytes] = []
                while len(got) < 3:
                    await trio.lowlevel.wait_readable(sock)
                    got.append(sock.recv(64))
                nursery.cancel_scope.cancel()
    finally:
        notifier.close()
    assert got == [b"WATCHDOG=1"] * 3
