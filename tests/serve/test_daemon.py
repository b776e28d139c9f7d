"""The real daemon as a subprocess (``python -m omni_trio.cli serve``) on a free loopback port,
with a fake systemd ``NOTIFY_SOCKET``: readiness, the notify sequence READY -> WATCHDOG... ->
STOPPING, generation, SIGTERM drain (in-flight requests finish; new ones get 503 with
Retry-After; past the drain timeout they get a terminal error), exit codes (0 drained, 2 bad
config, 3 the engine pool died), and the logging formats.

Every wait is bounded (subprocess timeouts, polling deadlines); every process is killed and
reaped in a ``finally``.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from omni_trio.executors.inproc import InprocExecutor
from omni_trio.serve.daemon import (
    EXIT_CONFIG,
    EXIT_OK,
    EXIT_POOL_DIED,
    JsonFormatter,
    TextFormatter,
    add_serve_parser,
)

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 120.0  # first start builds nothing for builtin:echo, but imports torch
EXIT_TIMEOUT_S = 60.0
STEP_S = 0.05  # builtin:echo step delay in these tests


# -- a backend whose engine dies (for the exit-3 test; imported by the daemon subprocess) ------


class DyingExecutor(InprocExecutor):
    """Starts once, fails closed ``DIE_AFTER_S`` later; every later start in this process
    fails, so the engine's and then the pool's restarts run out."""

    DIE_AFTER_S = 1.0
    starts = 0

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        DyingExecutor.starts += 1
        if DyingExecutor.starts > 1:
            raise RuntimeError("injected: this backend cannot start again")
        async with trio.open_nursery() as nursery:
            await nursery.start(super().serve)
            task_status.started(self)
            await trio.sleep(self.DIE_AFTER_S)
            self.fail(RuntimeError("injected: the worker group died"))
            await trio.sleep_forever()


# -- harness ---------------------------------------------------------------------------------


class NotifyListener:
    """A fake ``NOTIFY_SOCKET``: a bound datagram socket collecting (time, message)."""

    def __init__(self, directory: Path) -> None:
        self.path = str(directory / "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.setblocking(False)
        self.messages: list[tuple[float, str]] = []

    def poll(self) -> list[str]:
        """Collect what arrived; return every message so far."""
        while True:
            try:
                data = self.sock.recv(4096)
            except BlockingIOError:
                break
            self.messages.append((time.monotonic(), data.decode()))
        return [m for _, m in self.messages]

    def wait_for(self, line: str, timeout: float) -> float:
        """Wait until a datagram holding ``line`` arrives; its arrival time."""
        deadline = time.monotonic() + timeout
        while True:
            self.poll()
            for at, message in self.messages:
                if line in message.splitlines():
                    return at
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{line!r} not received in {timeout} s: {self.poll()}")
            select.select([self.sock], [], [], min(left, 0.5))

    def lines(self) -> list[str]:
        """Every KEY=VALUE line received, in order."""
        return [line for m in self.poll() for line in m.splitlines()]

    def close(self) -> None:
        self.sock.close()


class Daemon:
    """``omni-trio serve`` in a subprocess; stdout read for the listening line, stderr kept
    in a file (the logs)."""

    def __init__(self, proc: subprocess.Popen[bytes], stderr_path: Path) -> None:
        self.proc = proc
        self.stderr_path = stderr_path
        self.url = ""
        self.stdout_lines: list[str] = []

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def read_line(self, timeout: float) -> str | None:
        """The next stdout line, or None if the process ended first."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        buffer = b""
        fd = self.proc.stdout.fileno()
        while not buffer.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no stdout line in {timeout} s; stderr:\n{self.stderr}")
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if not ready:
                continue
            chunk = os.read(fd, 1)
            if not chunk:
                return None
            buffer += chunk
        line = buffer.decode().rstrip("\n")
        self.stdout_lines.append(line)
        return line

    def wait_listening(self, timeout: float = START_TIMEOUT_S) -> str:
        line = self.read_line(timeout)
        assert line is not None, f"exited {self.proc.poll()} before listening:\n{self.stderr}"
        prefix = "omni-trio serve: listening on "
        assert line.startswith(prefix), line
        self.url = line[len(prefix) :].split(" ", 1)[0]
        return line

    def client(self, **kwargs: Any) -> httpx.Client:
        kwargs.setdefault("timeout", 30.0)
        return httpx.Client(base_url=self.url, trust_env=False, **kwargs)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> list[int]:
        """Poll /ready until 200; the statuses seen on the way."""
        seen: list[int] = []
        deadline = time.monotonic() + timeout
        with self.client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, f"daemon exited:\n{self.stderr}"
                status = client.get("/ready").status_code
                seen.append(status)
                if status == 200:
                    return seen
                time.sleep(0.05)
        raise AssertionError(f"/ready never 200 in {timeout} s:\n{self.stderr}")

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def wait_exit(self, timeout: float = EXIT_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"daemon did not exit in {timeout} s:\n{self.stderr}") from None


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    # AF_UNIX paths are limited to 108 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="omni-serve-") as directory:
        yield Path(directory)


@pytest.fixture
def start_daemon(short_tmp: Path) -> Iterator[Callable[..., Daemon]]:
    started: list[Daemon] = []

    def start(*args: str, env: dict[str, str] | None = None, model_args: bool = True) -> Daemon:
        argv = [sys.executable, "-m", "omni_trio.cli", "serve", "--port", "0"]
        if model_args:
            argv += ["--model", "builtin:echo", "--cache-dir", str(short_tmp / "cache")]
        argv += list(args)
        full_env = {
            k: v for k, v in os.environ.items() if not k.startswith(("NOTIFY_", "WATCHDOG_"))
        }
        full_env.pop("OMNI_TRIO_API_KEY", None)
        full_env.update(env or {})
        stderr_path = short_tmp / f"stderr-{len(started)}.log"
        with stderr_path.open("wb") as stderr:
            proc = subprocess.Popen(
                argv, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=stderr
            )
        daemon = Daemon(proc, stderr_path)
        started.append(daemon)
        return daemon

    try:
        yield start
    finally:
        for daemon in started:
            if daemon.proc.poll() is None:
                daemon.proc.kill()
            daemon.proc.wait(timeout=30)
            if daemon.proc.stdout is not None:
                daemon.proc.stdout.close()


@pytest.fixture
def notify(short_tmp: Path) -> Iterator[NotifyListener]:
    listener = NotifyListener(short_tmp)
    try:
        yield listener
    finally:
        listener.close()


def generate(client: httpx.Client, steps: int, **fields: Any) -> httpx.Response:
    body = {"prompt": "a test", "size": "64x64", "num_inference_steps": steps, **fields}
    return client.post("/v1/images/generations", json=body)


def generate_in_background(daemon: Daemon, steps: int) -> tuple[threading.Thread, list[Any]]:
    def run() -> httpx.Response:
        with daemon.client() as client:
            return generate(client, steps)

    return in_background(run)


def in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # reported by the test through result
            result.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, result


def wait_in_flight(daemon: Daemon, count: int, timeout: float = 30.0) -> None:
    """Poll /metrics until the pool holds ``count`` requests in flight."""
    deadline = time.monotonic() + timeout
    with daemon.client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            text = client.get("/metrics").text
            for line in text.splitlines():
                if line.startswith("omni_trio_in_flight ") and float(line.split()[1]) >= count:
                    return
            time.sleep(0.02)
    raise AssertionError(f"never {count} request(s) in flight")


def result_of(thread: threading.Thread, result: list[Any], timeout: float = 60.0) -> Any:
    thread.join(timeout)
    assert not thread.is_alive(), "request thread did not finish"
    (value,) = result
    if isinstance(value, BaseException):
        raise value
    return value


# -- tests -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_notify_generate_and_drain(
    start_daemon: Callable[..., Daemon], notify: NotifyListener
) -> None:
    from omni_trio.models import decode_echo_image

    daemon = start_daemon(
        "--model-option",
        f"step_delay_s={STEP_S}",
        "--drain-timeout",
        "30",
        env={"NOTIFY_SOCKET": notify.path, "WATCHDOG_USEC": "400000"},
    )
    line = daemon.wait_listening()
    assert "(model builtin:echo, 1 replica(s))" in line
    ready_at = notify.wait_for("READY=1", START_TIMEOUT_S)
    with daemon.client() as client:
        # READY=1 comes only once /ready says 200.
        assert client.get("/ready").status_code == 200
        assert client.get("/health").status_code == 200
        # The watchdog is fed from the event loop, every 0.2 s.
        deadline = time.monotonic() + 10
        while notify.lines().count("WATCHDOG=1") < 3 and time.monotonic() < deadline:
            select.select([notify.sock], [], [], 0.5)
        assert notify.lines().count("WATCHDOG=1") >= 3
        status_lines = [x for x in notify.lines() if x.startswith("STATUS=")]
        assert any(x.startswith("STATUS=serving 1 replica") for x in status_lines), status_lines

        response = generate(client, 2, seed=7)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["seed"] == 7
        png = base64.b64decode(body["data"][0]["b64_json"])
        from PIL import Image

        request_id, seed, index = decode_echo_image(Image.open(io.BytesIO(png)))
        assert request_id == response.headers["x-request-id"] == body["id"]
        assert (seed, index) == (7, 0)

        # A slow request in flight (60 steps), then SIGTERM.
        thread, result = generate_in_background(daemon, 60)
        wait_in_flight(daemon, 1)
        daemon.signal(signal.SIGTERM)
        stopping_at = notify.wait_for("STOPPING=1", 10)
        # Draining: new requests are refused with 503 + Retry-After; the server still answers.
        late = generate(client, 1)
        assert late.status_code == 503, late.text
        assert "retry-after" in late.headers
        assert late.json()["error"]["type"] == "server_error"
        assert client.get("/ready").status_code == 503
        assert client.get("/health").status_code == 200
    slow = result_of(thread, result)
    assert slow.status_code == 200, slow.text  # the in-flight request finished
    assert daemon.wait_exit() == EXIT_OK
    # READY -> WATCHDOG ... -> STOPPING, in that order; the watchdog kept going in between.
    lines = notify.lines()
    first_ready = lines.index("READY=1")
    assert lines.index("STOPPING=1") > first_ready
    assert "WATCHDOG=1" in lines[first_ready : lines.index("STOPPING=1")]
    assert ready_at < stopping_at
    stderr = daemon.stderr
    assert "SIGTERM: draining" in stderr
    assert "stopped: SIGTERM received (exit 0)" in stderr


@pytest.mark.slow
def test_drain_timeout_aborts_with_terminal_error(
    start_daemon: Callable[..., Daemon], notify: NotifyListener
) -> None:
    daemon = start_daemon(
        "--model-option",
        f"step_delay_s={STEP_S}",
        "--drain-timeout",
        "0.5",
        "--log-format",
        "json",
        env={"NOTIFY_SOCKET": notify.path},
    )
    daemon.wait_listening()
    daemon.wait_ready()
    # 200 steps (10 s) cannot finish within the 0.5 s drain.
    thread, result = generate_in_background(daemon, 200)
    wait_in_flight(daemon, 1)
    started = time.monotonic()
    daemon.signal(signal.SIGTERM)
    response = result_of(thread, result)
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "shutting down" in error["message"]
    assert daemon.wait_exit() == EXIT_OK
    assert time.monotonic() - started < 30
    assert "STOPPING=1" in notify.lines()
    # --log-format json: every stderr line is one JSON object.
    records = [json.loads(line) for line in daemon.stderr.splitlines() if line.strip()]
    assert records, daemon.stderr
    assert all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    assert any("drain timeout: aborting 1 request" in r["msg"] for r in records)
    access = [r for r in records if r["logger"] == "omni_trio.serve.access"]
    aborted = [r for r in access if r.get("route") == "/v1/images/generations"]
    assert aborted and aborted[-1]["status"] == 503 and aborted[-1]["outcome"] == "aborted"
    assert {"request_id", "status", "outcome", "ms"} <= set(aborted[-1])


@pytest.mark.slow
def test_ready_is_503_during_warmup_then_200(start_daemon: Callable[..., Daemon]) -> None:
    # The warmup request runs 2 steps of 1 s: /ready must say 503 meanwhile.
    daemon = start_daemon("--model-option", "step_delay_s=1.0", "--warmup")
    daemon.wait_listening()
    with daemon.client() as client:
        early = client.get("/ready")
        assert early.status_code == 503
        assert early.json()["error"]["message"]  # names the reason
        assert "retry-after" in early.headers
        assert client.get("/health").status_code == 200
    seen = daemon.wait_ready()
    assert seen[-1] == 200
    daemon.signal(signal.SIGINT)  # SIGINT drains like SIGTERM
    assert daemon.wait_exit() == EXIT_OK


@pytest.mark.slow
def test_signal_during_warmup_exits_0(
    start_daemon: Callable[..., Daemon], notify: NotifyListener
) -> None:
    daemon = start_daemon("--model-option", "step_delay_s=2.0", env={"NOTIFY_SOCKET": notify.path})
    daemon.wait_listening()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit() == EXIT_OK
    assert "READY=1" not in notify.lines()
    assert "STOPPING=1" in notify.lines()


def test_bad_flag_exits_2(start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon("--workers", "0")
    assert daemon.wait_exit() == EXIT_CONFIG
    lines = daemon.stderr.strip().splitlines()
    assert lines == [
        "omni-trio: error: [engine] num_workers must be a positive integer, got 0 "
        "(from command line)"
    ]


def test_missing_model_exits_2(start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon(model_args=False)
    assert daemon.wait_exit() == EXIT_CONFIG
    assert "no model given" in daemon.stderr


def test_bad_toml_exits_2(start_daemon: Callable[..., Daemon], short_tmp: Path) -> None:
    config = short_tmp / "serve.toml"
    config.write_text('prot = 80\n[engine]\nmodel = "builtin:echo"\n')
    daemon = start_daemon("--config", str(config), model_args=False)
    assert daemon.wait_exit() == EXIT_CONFIG
    assert "unknown setting(s): prot" in daemon.stderr


@pytest.mark.slow
def test_unknown_model_exits_2(start_daemon: Callable[..., Daemon]) -> None:
    # Found only when the engine loads it: after listening, before ready.
    daemon = start_daemon("--model", "builtin:nope")
    assert daemon.wait_exit() == EXIT_CONFIG
    assert "unknown built-in model 'builtin:nope'" in daemon.stderr


def test_tractor_replicas_exit_2(start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon("--backend", "tractor", "--replicas", "2")
    assert daemon.wait_exit() == EXIT_CONFIG
    assert "replicas > 1 needs the inproc or ray backend" in daemon.stderr


@pytest.mark.slow
def test_ray_replicas_join_the_given_cluster_and_serve(
    start_daemon: Callable[..., Daemon], ray_cluster: Any
) -> None:
    """``--backend ray --ray-address``: the daemon joins the tests' local Ray (no Ray of its
    own), two replicas each with their own actor serve requests, SIGTERM drains and exits 0
    and the actors are gone from the cluster."""
    from ray._private.state import actors

    address = ray_cluster.get_runtime_context().gcs_address
    before = {key for key, a in actors().items() if a["State"] == "ALIVE"}
    daemon = start_daemon(
        "--backend", "ray", "--ray-address", address, "--replicas", "2", "--threads", "1"
    )  # fmt: skip
    daemon.wait_listening()
    daemon.wait_ready()
    with daemon.client() as client:
        responses = [generate(client, 2, seed=i) for i in range(4)]
    assert [r.status_code for r in responses] == [200] * 4, responses[-1].text
    assert [r.json()["seed"] for r in responses] == [0, 1, 2, 3]
    ours = [
        a
        for key, a in actors().items()
        if key not in before and a["State"] == "ALIVE" and a["Name"].startswith("omni-trio-")
    ]
    assert len(ours) == 2  # one worker actor per replica, in the tests' cluster
    assert {a["Address"]["IPAddress"] for a in ours} == {"127.0.0.1"}
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit() == 0, daemon.stderr
    names = {a["Name"] for a in ours}
    left = [a for a in actors().values() if a["Name"] in names and a["State"] != "DEAD"]
    assert not left, left


def test_port_in_use_exits_1(start_daemon: Callable[..., Daemon]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        daemon = start_daemon("--port", str(port))
        assert daemon.wait_exit() == 1
    assert "cannot listen on 127.0.0.1:" in daemon.stderr


@pytest.mark.slow
def test_pool_death_exits_3(start_daemon: Callable[..., Daemon], short_tmp: Path) -> None:
    config = short_tmp / "serve.toml"
    config.write_text(
        f"""
[engine]
model = "builtin:echo"
backend = "{__name__}:DyingExecutor"
cache_dir = "{short_tmp / "cache"}"
max_worker_restarts = 0
"""
    )
    daemon = start_daemon("--config", str(config), model_args=False)
    daemon.wait_listening()
    assert daemon.wait_exit() == EXIT_POOL_DIED
    assert "the engine pool died" in daemon.stderr


@pytest.mark.slow
def test_exposed_without_key_warns(start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon("--host", "0.0.0.0", "--no-warmup")
    daemon.wait_listening()
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit() == EXIT_OK
    assert "WITHOUT an API key" in daemon.stderr


def test_serve_parser_registered() -> None:
    from omni_trio.cli import build_parser

    args = build_parser().parse_args(["serve", "--model", "m", "--port", "0"])
    assert args.command == "serve"
    assert args.serve_engine_model == "m"
    assert callable(args.handler)
    import argparse

    sub = argparse.ArgumentParser().add_subparsers()
    assert add_serve_parser(sub).prog.endswith("serve")


def _record(**extra: Any) -> logging.LogRecord:
    record = logging.LogRecord("omni_trio.x", logging.INFO, __file__, 1, "hello %s", ("w",), None)
    for key, value in extra.items():
        setattr(record, key, value)
    return record


def test_json_formatter() -> None:
    line = JsonFormatter().format(_record(request_id="r1", status=200, ms=1.5, obj=object()))
    entry = json.loads(line)
    assert entry["level"] == "info"
    assert entry["logger"] == "omni_trio.x"
    assert entry["msg"] == "hello w"
    assert entry["ts"].endswith("Z")
    assert (entry["request_id"], entry["status"], entry["ms"]) == ("r1", 200, 1.5)
    assert entry["obj"].startswith("<object")
    try:
        raise ValueError("boom")
    except ValueError:
        record = _record()
        record.exc_info = sys.exc_info()
    assert "ValueError: boom" in json.loads(JsonFormatter().format(record))["exc"]


def test_text_formatter() -> None:
    text = TextFormatter().format(_record(request_id="w", status=503))
    assert text.endswith("INFO omni_trio.x: hello w status=503")
