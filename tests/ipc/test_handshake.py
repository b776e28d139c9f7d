"""Junk on a worker group's ports is dropped; the group never notices.

A real two-worker tractor group on echo: every port of it (the engine's root actor and each
worker) gets null bytes, an HTTP request line, random bytes, a well-framed actor id that is
not one of the group's, and a connection that never speaks; then the group still serves a
request with no restart.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import msgspec
import pytest
import trio

from omni_trio import EngineConfig, SamplingParams, open_engine
from omni_trio.ipc import handshake

pytestmark = pytest.mark.slow

CAP_S = 90


def _listening_ports(pid: int) -> set[int]:
    """The TCP ports ``pid`` listens on (from /proc: its socket inodes in LISTEN state)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _framed(value: object) -> bytes:
    body = msgspec.msgpack.encode(value)
    return struct.pack("<I", len(body)) + body


JUNK = [
    b"\x00" * 64,
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    os.urandom(4096),
    _framed(["omni-trio-worker-0-guess", "00000000-0000-0000-0000-000000000000"]),
    _framed({"not": "an id"}),
]


async def _poke(port: int, data: bytes) -> bytes:
    """Send ``data``, half-close, and return whatever comes back before the peer closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    got = b""
    async with stream:
        await stream.send_all(data)
        await stream.send_eof()
        with trio.move_on_after(10):
            while chunk := await stream.receive_some(65536):
                got += chunk
    return got


async def test_junk_on_every_port_is_dropped_and_the_group_keeps_serving(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(handshake, "HANDSHAKE_TIMEOUT_S", 0.5)  # the engine side's
    config = EngineConfig(
        model="builtin:echo",
        backend="tractor",
        num_workers=2,
        # Replicas, not a CFG-parallel pair: every port the workers listen on is then
        # tractor's (torch.distributed's are checked in tests/worker/test_cfg_parallel.py).
        cfg_parallel=False,
        warmup=False,
        cache_dir=str(cache_dir),
        torch_threads=1,
    )
    caplog.set_level(logging.WARNING, logger=handshake.__name__)
    with trio.fail_after(CAP_S):
        async with open_engine(config) as engine:
            pids = [w.pid for w in engine.health().workers]
            assert all(pids)
            # The engine's own tractor port (the test process may listen on others: a Ray
            # driver's gRPC server from an earlier test, say).
            registry = engine.executor.registry_addr  # type: ignore[attr-defined]
            root_ports = {int(registry[1])}
            assert root_ports <= _listening_ports(os.getpid())
            worker_ports = set().union(*(_listening_ports(p) for p in pids if p))  # type: ignore[arg-type]
            assert worker_ports and root_ports
            for port in sorted(root_ports | worker_ports):
                for data in JUNK:
                    # Nothing of ours (an actor id) is ever sent to a peer that failed.
                    assert await _poke(port, data) == b""
            # A root-side connection that never says who it is is dropped after the timeout.
            for port in root_ports:
                silent = await trio.open_tcp_stream("127.0.0.1", port)
                async with silent:
                    with trio.fail_after(5):
                        assert await silent.receive_some(1) == b""
            out = await engine.generate(
                "x", SamplingParams(height=32, width=32, num_inference_steps=2)
            )
            assert out.ok
            stats = engine.statistics()
            assert stats.restarts == 0 and stats.last_failure is None
    reasons = [r.getMessage() for r in caplog.records if "dropped a connection" in r.getMessage()]
    assert any("not a process of this worker group" in m for m in reasons), reasons
    assert any("does not speak the protocol" in m for m in reasons), reasons
    assert any("sent nothing" in m for m in reasons), reasons


def test_the_guard_installs_once() -> None:
    from tractor._actor import Actor

    handshake.guard_tractor_handshake()
    first = Actor._do_handshake
    handshake.guard_tractor_handshake()
    assert Actor._do_handshake is first
