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
import configparser
import io
import json
import logging
import os
import re
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

from omni_trio.config import EngineConfig
from omni_trio.executors.group import KILL_WAIT_S, TERMINATE_WAIT_S
from omni_trio.executors.inproc import InprocExecutor
from omni_trio.runtime.stage import CLOSE_MARGIN_S, KILL_GRACE_S, TERM_GRACE_S
from omni_trio.runtime.stage_child import PROCESS_NAME as STAGE_PROCESS_NAME
from omni_trio.serve.app import ImagesApp
from omni_trio.serve.config import ServeConfig
from omni_trio.serve.daemon import (
    ABORT_GRACE_S,
    EXIT_CONFIG,
    EXIT_FAILED,
    EXIT_MARGIN_S,
    EXIT_OK,
    EXIT_POOL_DIED,
    GRACEFUL_TIMEOUT_S,
    SHUTDOWN_GRACE_S,
    ExitDeadline,
    JsonFormatter,
    TextFormatter,
    _Daemon,
    add_serve_parser,
    descendant_pids,
    engine_close_bound_s,
    shutdown_bound_s,
)
from omni_trio.serve.http import FD_RESERVE
from omni_trio.serve.notify import SystemdNotifier

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

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
        "--webhook-hosts",
        "127.0.0.1",
        env={
            "NOTIFY_SOCKET": notify.path,
            "WATCHDOG_USEC": "400000",
            "OMNI_TRIO_WEBHOOK_SECRET": "s",
        },
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

        # A job: answered at once, run by the daemon's background work, read back.  Its
        # webhook host is outside --webhook-hosts: refused, so webhooks are on.
        job = client.post("/v1/jobs", json={"prompt": "j", "num_inference_steps": 2, "seed": 3})
        assert job.status_code == 202, job.text
        deadline = time.monotonic() + 30
        while (state := client.get(f"/v1/jobs/{job.json()['id']}").json())["status"] != (
            "completed"
        ):
            assert time.monotonic() < deadline, state
            time.sleep(0.05)
        assert state["result"]["seed"] == 3
        hooked = {"prompt": "j", "webhook_url": "http://example.com/h"}
        refused = client.post("/v1/jobs", json=hooked)
        assert refused.json()["error"]["code"] == "invalid_webhook_url", refused.text

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
    assert seen[-1] == 200 and len(seen) > 5
    daemon.signal(signal.SIGINT)  # SIGINT drains like SIGTERM
    assert daemon.wait_exit() == EXIT_OK
    # Every probe of the warmup was a 503, but the log says so once per change of state
    # (INFO), not once per probe (it used to be a WARNING each).
    lines = daemon.stderr.splitlines()
    assert not [x for x in lines if " WARNING " in x and ("/ready" in x or "not ready" in x)]
    not_ready = [x for x in lines if "not ready:" in x]
    assert 1 <= len(not_ready) <= 2 and all(" INFO " in x for x in not_ready), not_ready


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


def test_inline_tractor_replicas_exit_2(start_daemon: Callable[..., Daemon]) -> None:
    daemon = start_daemon("--backend", "tractor", "--replicas", "2", "--stage", "inline")
    assert daemon.wait_exit() == EXIT_CONFIG
    assert "replicas > 1 on the tractor backend need stage processes" in daemon.stderr


def _stage_pids(daemon: Daemon) -> list[int]:
    """The daemon's stage processes, by name (a forked one's command line is its fork
    server's)."""
    pids = []
    for pid in descendant_pids(daemon.proc.pid):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name == STAGE_PROCESS_NAME:
            pids.append(pid)
    return pids


def _kill_one_stage(daemon: Daemon, stages: list[int]) -> list[int]:
    """Both stages answer; the first SIGKILLed, the live one answers at once while the pool
    reopens the dead one.  The stage processes after."""
    with daemon.client() as client:
        responses = [generate(client, 2, seed=i) for i in range(4)]
        assert [r.status_code for r in responses] == [200] * 4, responses[-1].text
        os.kill(stages[0], signal.SIGKILL)
        responses = [generate(client, 2, seed=i) for i in range(4)]
        assert [r.status_code for r in responses] == [200] * 4, responses[-1].text
    daemon.wait_ready()
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(set(_stage_pids(daemon)) - {stages[0]}) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # polled, bounded: the reopened stage has no event here
    now = _stage_pids(daemon)
    assert stages[1] in now and stages[0] not in now and len(now) == 2, (stages, now)
    return now


def _stop_leaving_nothing(daemon: Daemon) -> None:
    """SIGTERM drains, exits 0 and leaves no process of the daemon's behind."""
    everything = descendant_pids(daemon.proc.pid)
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit() == EXIT_OK, daemon.stderr
    deadline = time.monotonic() + 10.0
    while [pid for pid in everything if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in everything if _alive(pid)]


def _parent(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return int(stat[stat.rindex(b")") + 2 :].split()[1])


@pytest.mark.slow
def test_process_stages_fork_from_one_server_and_a_dead_one_stops_only_itself(
    start_daemon: Callable[..., Daemon],
) -> None:
    """``--replicas 2 --stage process`` (inproc engines): each stage process is forked from
    the one fork server the daemon starts (it imports torch and diffusers once, for both);
    one SIGKILLed, the other answers while it is forked again; SIGTERM leaves nothing."""
    from omni_trio.executors.tractor_executor import cuda_possible

    if cuda_possible():  # pragma: no cover - CI has no GPU
        pytest.skip('"auto" starts stages as new interpreters where CUDA may be used')
    daemon = start_daemon(
        "--replicas", "2", "--stage", "process", "--threads", "1", "--log-level", "debug"
    )
    daemon.wait_listening()
    daemon.wait_ready()
    # Started before the listener is bound: its preload overlaps the rest of the start.
    early = daemon.stderr.find("fork server started early")
    assert -1 < early < daemon.stderr.find("listening on"), daemon.stderr
    stages = _stage_pids(daemon)
    assert len(stages) == 2, stages
    servers = {_parent(pid) for pid in stages}
    assert len(servers) == 1 and servers != {daemon.proc.pid}, servers
    [server] = servers
    assert b"forkserver" in Path(f"/proc/{server}/cmdline").read_bytes()
    now = _kill_one_stage(daemon, stages)
    assert {_parent(pid) for pid in now} == {server}
    _stop_leaving_nothing(daemon)


@pytest.mark.slow
def test_tractor_replicas_run_as_stage_processes_and_a_dead_one_stops_only_itself(
    start_daemon: Callable[..., Daemon],
) -> None:
    """``--backend tractor --replicas 2``: each replica's engine in a stage process of its
    own (one tractor runtime each).  One stage SIGKILLed: the other replica keeps answering
    while the pool reopens the dead one; SIGTERM drains and leaves no process behind."""
    daemon = start_daemon("--backend", "tractor", "--replicas", "2", "--threads", "1")
    daemon.wait_listening()
    daemon.wait_ready()
    stages = _stage_pids(daemon)
    assert len(stages) == 2, stages
    _kill_one_stage(daemon, stages)
    _stop_leaving_nothing(daemon)


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


@pytest.mark.slow
def test_data_parallel_workers_serve_concurrent_requests(
    start_daemon: Callable[..., Daemon], notify: NotifyListener
) -> None:
    """``--data-parallel 2``: two worker processes under the daemon (forked from a fork
    server: the daemon's default on a machine without CUDA), four clients at once, each
    answered with its own picture (matched by id, never by position); SIGTERM drains and no
    worker is left.  Under systemd no worker inherits ``NOTIFY_SOCKET``."""
    from PIL import Image

    from omni_trio.models import decode_echo_image

    daemon = start_daemon(
        "--data-parallel", "2", "--threads", "1", "--model-option", f"step_delay_s={STEP_S}",
        "--log-level", "debug", env={"NOTIFY_SOCKET": notify.path},
    )  # fmt: skip
    daemon.wait_listening()
    daemon.wait_ready()
    workers = descendant_pids(daemon.proc.pid)
    assert len(workers) >= 2, workers
    # Without CUDA the daemon's "auto" start method forks them from a fork server, which it
    # starts before it binds its listener (its preload overlaps the rest of the start).
    from omni_trio.executors.tractor_executor import cuda_possible

    cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in workers]
    forked = any(b"forkserver" in cmdline for cmdline in cmdlines)
    assert forked is not cuda_possible(), cmdlines
    early = daemon.stderr.find("fork server started early")
    assert (early != -1) is forked, daemon.stderr
    assert early < daemon.stderr.find("listening on"), daemon.stderr
    for pid in workers:  # the fork server too, where there is one
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert not [e for e in environ if e.startswith(b"NOTIFY_SOCKET=")], pid
    background = [generate_in_background(daemon, 6) for _ in range(4)]
    responses = [result_of(thread, result) for thread, result in background]
    assert [r.status_code for r in responses] == [200] * 4, responses[-1].text
    for response in responses:
        body = response.json()
        png = base64.b64decode(body["data"][0]["b64_json"])
        assert decode_echo_image(Image.open(io.BytesIO(png))) == (body["id"], body["seed"], 0)
    assert len({r.json()["id"] for r in responses}) == 4
    daemon.signal(signal.SIGTERM)
    assert daemon.wait_exit() == EXIT_OK, daemon.stderr
    # The workers are gone with it; the fork server (the daemon forks its workers from one)
    # sees its parent gone a moment later.  Polled, bounded: no event reaches this process.
    deadline = time.monotonic() + 10.0
    while [pid for pid in workers if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if _alive(pid)]


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
    # --no-warmup measures no step time: the compute budget cannot apply, and it says so.
    assert "warmup is off, so no compute budget applies" in daemon.stderr


# -- the shutdown bound -------------------------------------------------------------------------

SUPERVISORS = ROOT / "supervisors"


def _stop_seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+)(s|min)?", text.strip())
    assert match, text
    return int(match.group(1)) * (60 if match.group(2) == "min" else 1)


def test_the_shutdown_bound_counts_every_wait() -> None:
    """drain + the engine's close, every wait of it by backend (inproc: the worker's
    shutdown, the thread's join, the loop's wait for the forward; tractor and ray: ask,
    terminate, kill, reap) + the fixed grace (abort answers, HTTP stop, exit)."""
    assert SHUTDOWN_GRACE_S == ABORT_GRACE_S + GRACEFUL_TIMEOUT_S + EXIT_MARGIN_S
    inproc = EngineConfig(model="m", backend="inproc", close_timeout_s=20.0)
    assert engine_close_bound_s(inproc) == 3 * 20.0
    for backend in ("tractor", "ray"):
        group = inproc.replace(backend=backend)
        assert engine_close_bound_s(group) == 20.0 + TERMINATE_WAIT_S + 2 * KILL_WAIT_S
    custom = inproc.replace(backend="tests.serve.test_daemon:DyingExecutor")
    assert engine_close_bound_s(custom) == max(3 * 20.0, 20.0 + TERMINATE_WAIT_S + 2 * KILL_WAIT_S)
    config = ServeConfig(drain_timeout_s=7.0, engine=inproc)
    assert shutdown_bound_s(config) == 7.0 + 3 * 20.0 + SHUTDOWN_GRACE_S
    # A stage process: its engine's close, then its exit, a SIGTERM's and a SIGKILL's wait.
    stage_waits = CLOSE_MARGIN_S + TERM_GRACE_S + KILL_GRACE_S
    assert engine_close_bound_s(inproc, "process") == 3 * 20.0 + stage_waits
    tractor = inproc.replace(backend="tractor")
    replicas = ServeConfig(drain_timeout_s=7.0, engine=tractor, replicas=2)  # stage processes
    assert shutdown_bound_s(replicas) == (
        7.0 + engine_close_bound_s(tractor) + stage_waits + SHUTDOWN_GRACE_S
    )


def test_the_shipped_stop_timeouts_exceed_the_shutdown_bound() -> None:
    """Each supervisor file's stop timeout exceeds the daemon's shutdown bound for the
    defaults, for the example serve.toml and for the flags the Kubernetes manifest passes,
    whatever the backend; the systemd unit's LimitNOFILE fits the default connection cap
    and the daemon's own descriptors."""
    example = ServeConfig.from_toml(SUPERVISORS / "systemd" / "serve.toml", environ={})
    configs = [ServeConfig(), example]
    configs += [c.replace(engine=c.engine.replace(backend="tractor")) for c in configs]
    bound = max(shutdown_bound_s(c) for c in configs)
    assert bound == 30 + 3 * 30 + SHUTDOWN_GRACE_S  # inproc, the defaults
    unit = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(SUPERVISORS / "systemd" / "omni-trio.service")
    service = unit["Service"]
    assert _stop_seconds(service["TimeoutStopSec"]) > bound
    limit = int(service["LimitNOFILE"])
    assert limit >= max(ServeConfig().max_connections, example.max_connections) + FD_RESERVE
    supervisord = configparser.ConfigParser(
        strict=False, interpolation=None, inline_comment_prefixes=(";",)
    )
    supervisord.read(SUPERVISORS / "supervisord" / "omni-trio.conf")
    assert int(supervisord["program:omni-trio"]["stopwaitsecs"]) > bound
    k8s = (SUPERVISORS / "kubernetes" / "deployment.yaml").read_text()
    grace = re.search(r"terminationGracePeriodSeconds: (\d+)", k8s)
    drain = re.search(r"--drain-timeout=([0-9.]+)", k8s)
    assert grace is not None and drain is not None
    k8s_config = ServeConfig(drain_timeout_s=float(drain.group(1)))
    assert int(grace.group(1)) > shutdown_bound_s(k8s_config)


def test_the_exit_deadline_ends_the_process_only_if_not_disarmed() -> None:
    """It kills first, then writes its line, then exits (a logging lock or a full pipe
    held by the stuck program must not keep the process alive)."""
    steps: list[str] = []
    fired = threading.Event()

    def fake_exit(code: int) -> None:
        steps.append(f"exit {code}")
        fired.set()

    def kill() -> None:
        steps.append("kill")

    deadline = ExitDeadline(exit=fake_exit, kill_children=kill, write=steps.append)
    deadline.arm(0.01, lambda: EXIT_FAILED)
    assert fired.wait(10.0)
    deadline.disarm()
    assert steps[0] == "kill" and steps[2] == f"exit {EXIT_FAILED}" and len(steps) == 3
    assert "CRITICAL" in steps[1] and "overran its bound of 0.0 s" in steps[1]
    assert steps[1].endswith("\n")
    calm = ExitDeadline(exit=fake_exit, kill_children=kill, write=steps.append)
    calm.arm(3600.0, lambda: EXIT_OK)
    assert calm.armed
    calm.disarm()  # joins its thread at once
    assert not calm.armed and len(steps) == 3
    calm.arm(0.0, lambda: EXIT_OK)  # disarmed for good
    assert not calm.armed


# A program stuck in its shutdown: it has a child with a child of its own (as the forkserver
# has the tractor workers), another thread holds the log handler's lock for good, and the
# main thread blocks on that lock as it logs.
STUCK_SHUTDOWN = """
import logging, subprocess, sys, threading, time
from omni_trio.serve.daemon import ExitDeadline, configure_logging
configure_logging("json", "info")
grandchild = "import time; time.sleep(120)"
child = (
    "import subprocess, sys, time; "
    f"g = subprocess.Popen([sys.executable, '-c', {grandchild!r}]); "
    "print(g.pid, flush=True); time.sleep(120)"
)
proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE)
print(proc.pid, int(proc.stdout.readline()), flush=True)
held = threading.Event()
def hold():
    logging.getLogger().handlers[0].acquire()
    held.set()
    time.sleep(120)
threading.Thread(target=hold, daemon=True).start()
held.wait()
ExitDeadline().arm(0.5, lambda: 1)
logging.getLogger("omni_trio").critical("never written: the lock is held")
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc")
def test_a_stuck_shutdown_trips_the_exit_deadline(short_tmp: Path) -> None:
    """For real, in a subprocess: past the deadline every descendant is killed (the
    grandchild too), the CRITICAL line reaches stderr although a logging lock is held for
    good, and the process exits 1 -- within a few seconds of the deadline."""
    stderr_path = short_tmp / "stuck.log"
    with stderr_path.open("wb") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", STUCK_SHUTDOWN], cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr
        )
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2, stderr_path.read_text()
        started = time.monotonic()
        assert proc.wait(timeout=30) == EXIT_FAILED
        assert time.monotonic() - started < 10
        text = stderr_path.read_text()
        (line,) = [json.loads(x) for x in text.splitlines() if x.startswith("{")]
        assert line["level"] == "critical" and "overran its bound of 0.5 s" in line["msg"]
        assert "never written" not in text
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.stdout is not None:
            proc.stdout.close()


def test_descendants_are_found_below_children() -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(g.pid, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        found = descendant_pids()
        assert child.pid in found and grandchild in found
        assert found.index(child.pid) < found.index(grandchild)  # nearest first
        assert descendant_pids(grandchild) == []
    finally:
        child.kill()
        child.wait(timeout=10)
        if _alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)
        if child.stdout is not None:
            child.stdout.close()


class ScriptedPool:
    """readiness() by virtual time: (until, value) steps."""

    def __init__(self, steps: list[tuple[float, tuple[bool, str | None]]]) -> None:
        self.steps = steps

    def readiness(self) -> tuple[bool, str | None]:
        now = trio.current_time()
        return next(value for until, value in self.steps if now < until)


async def test_readiness_changes_are_logged_once_each(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = _Daemon(ServeConfig(), SystemdNotifier(None), None, io.StringIO())
    daemon.deadline = ExitDeadline(exit=lambda code: None, kill_children=lambda: None)
    pool = ScriptedPool(
        [
            (3.5, (False, "replica 0: starting")),
            (6.0, (True, None)),
            (8.0, (False, "replica 0: restarting (last failure: boom)")),
            (float("inf"), (True, None)),
        ]
    )
    caplog.set_level(logging.DEBUG, logger="omni_trio.serve.daemon")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(daemon._report_status, pool)
        await trio.sleep(3.0)
        daemon.pool_ready.set()  # what run() does once the pool is up
        await trio.sleep(7.0)
        daemon._request_stop(EXIT_OK, "test over")
    daemon.deadline.disarm()
    records = [r for r in caplog.records if r.name == "omni_trio.serve.daemon"]
    assert [(r.levelname, r.getMessage()) for r in records] == [
        ("INFO", "not ready: replica 0: starting"),
        ("INFO", "not ready: replica 0: restarting (last failure: boom)"),
        ("INFO", "ready again: all replicas healthy"),
    ]


class CapturingDaemon(_Daemon):
    """The daemon run in this process, with its app kept for the test and an exit deadline
    that records instead of ending the test run."""

    def __init__(self, config: ServeConfig) -> None:
        self.exits: list[int] = []
        deadline = ExitDeadline(exit=self.exits.append, kill_children=lambda: None)
        super().__init__(config, SystemdNotifier(None), None, io.StringIO(), deadline)
        self.app: ImagesApp | None = None

    def _build_app(self, pool: Any) -> ImagesApp:
        self.app = super()._build_app(pool)
        return self.app


async def test_sigterm_ends_within_the_bound_despite_a_stalled_reader_and_a_long_step() -> None:
    """A client that stopped reading a 32 MiB download (its send timeout far away) and a
    request in a 2 s denoising step: SIGTERM still ends the daemon, exit 0, within what its
    waits add up to here -- the drain, the stalled connection's graceful timeout and the
    engine's close -- plus a second, and the exit deadline stays armed (for the interpreter's
    teardown) until its owner disarms it.  (The HTTP server used to wait for that shielded
    write for ever.)"""
    big = 32 * 1024 * 1024
    config = ServeConfig(
        port=0,
        drain_timeout_s=0.5,
        send_timeout_s=1000.0,
        engine=EngineConfig(
            model="builtin:echo",
            warmup=False,
            close_timeout_s=0.5,
            model_options={"step_delay_s": 2.0},
        ),
    )
    daemon = CapturingDaemon(config)
    signals_in, signals_out = trio.open_memory_channel[int](1)
    codes: list[int] = []
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:

            async def run() -> None:
                codes.append(await daemon.run(signals_out))

            nursery.start_soon(run)
            await daemon.pool_ready.wait()
            app = daemon.app
            assert app is not None
            host, port = daemon.url.removeprefix("http://").rsplit(":", 1)
            file_id = app.store.put(b"\0" * big, "image/png")
            sock = trio.socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await sock.connect((host, int(port)))
            stalled = trio.SocketStream(sock)
            await stalled.send_all(
                f"GET /v1/files/{file_id}/content HTTP/1.1\r\nHost: x\r\n\r\n".encode()
            )
            answers: list[httpx.Response] = []

            async def generate_long() -> None:
                async with httpx.AsyncClient(base_url=daemon.url, timeout=30) as client:
                    body = {"prompt": "x", "size": "64x64", "num_inference_steps": 2}
                    answers.append(await client.post("/v1/images/generations", json=body))

            nursery.start_soon(generate_long)
            while app.responses.in_flight < big or app.pool.in_flight < 1:  # noqa: ASYNC110
                await trio.sleep(0.01)
            started = trio.current_time()
            await signals_in.send(signal.SIGTERM)
        elapsed = trio.current_time() - started
    await stalled.aclose()
    assert daemon.deadline.armed  # run() leaves it to its owner
    daemon.deadline.disarm()
    assert codes == [EXIT_OK] and daemon.exits == []
    waits = config.drain_timeout_s + GRACEFUL_TIMEOUT_S + engine_close_bound_s(config.engine)
    assert config.drain_timeout_s + GRACEFUL_TIMEOUT_S <= elapsed < waits + 1.0, elapsed
    assert waits + 1.0 < shutdown_bound_s(config)
    (answer,) = answers
    assert answer.status_code == 503 and "shutting down" in answer.json()["error"]["message"]


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
