"""A real server for the serve tests: the real :class:`ImagesApp` under the daemon's HTTP
server (:mod:`omni_trio.serve.http`: hypercorn's protocols under our listener), on a free
loopback port, in the test's own trio run, in front of a real :class:`EnginePool` of
``builtin:echo`` engines (inproc, no warmup, a small step delay).

``run_server(...)`` takes the knobs a test needs (replicas, queue length, API keys, limits,
the app's slow-client bounds, the HTTP server's :class:`HttpLimits`, engine overrides); the
``server`` fixture is the default flavour and ``stream_server`` the step-mode one whose
engines stream preview chunks (``streaming_output=True``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from omni_trio.config import EngineConfig
from omni_trio.runtime.engine import AsyncEngine
from omni_trio.serve.app import ImagesApp
from omni_trio.serve.http import HttpLimits, HttpServer
from omni_trio.serve.images import ImageStore, ServeLimits
from omni_trio.serve.metrics import ServeMetrics
from omni_trio.serve.pool import EnginePool

MODEL = "builtin:echo"
STEP_DELAY_S = 0.02  # echo's sleep per denoising step: 200 steps (max_steps) take ~4 s
CAP_S = 30.0  # every test's trio.fail_after


class FakeClock:
    """A clock the test moves by hand (for the image store's expiry)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class Server:
    url: str
    pool: EnginePool
    app: ImagesApp
    store: ImageStore
    metrics: ServeMetrics
    clock: FakeClock
    records: list[dict[str, Any]] = field(default_factory=list)
    http: HttpServer | None = None

    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        kwargs.setdefault("timeout", 20.0)
        return httpx.AsyncClient(base_url=self.url, **kwargs)

    def engine(self, index: int = 0) -> AsyncEngine:
        engine = self.pool.replica_engine(index)
        assert engine is not None, f"replica {index} has no open engine"
        return engine


@asynccontextmanager
async def run_server(
    *,
    replicas: int = 1,
    max_queue_len: int = 64,
    api_key: str | None = None,
    api_keys: tuple[str, ...] = (),
    limits: ServeLimits | None = None,
    step_delay_s: float = STEP_DELAY_S,
    model: str = MODEL,
    store: ImageStore | None = None,
    http_limits: HttpLimits | None = None,
    app_options: dict[str, Any] | None = None,
    **engine_overrides: Any,
) -> AsyncIterator[Server]:
    """Start pool + app + HTTP server; yield once the port is bound; cancel all on exit.

    The image store (600 s ttl) runs on ``Server.clock`` unless ``store`` is given;
    ``app_options`` go to :class:`ImagesApp` (``public_url``, ``send_timeout_s`` ...)."""
    options = {"step_delay_s": step_delay_s} if model == MODEL else {}
    config = EngineConfig(model=model, warmup=False, model_options=options).replace(
        **engine_overrides
    )
    pool = EnginePool(config, replicas=replicas, max_queue_len=max_queue_len)
    clock = FakeClock()
    store = store if store is not None else ImageStore(clock=clock)
    metrics = ServeMetrics(pool)
    records: list[dict[str, Any]] = []
    app = ImagesApp(
        pool,
        model_name=model,
        limits=limits or ServeLimits(),
        api_key=api_key,
        api_keys=api_keys,
        store=store,
        metrics=metrics,
        log=records.append,
        **(app_options or {}),
    )
    http_limits = http_limits or HttpLimits(graceful_timeout_s=1.0)
    http = HttpServer(
        app,
        http_limits.hypercorn_config(["127.0.0.1:0"]),
        http_limits,
        metrics=metrics,
        retry_after=partial(pool.retry_after_s, excess=1),  # as the daemon wires it
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.serve)
        await nursery.start(app.serve)
        binds = await nursery.start(partial(http.serve, shutdown_trigger=trio.sleep_forever))
        try:
            yield Server(binds[0], pool, app, store, metrics, clock, records, http)
        finally:
            nursery.cancel_scope.cancel()  # the HTTP server closes what is still open


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    async with run_server() as s:
        yield s


@pytest.fixture
async def stream_server() -> AsyncIterator[Server]:
    async with run_server(streaming_output=True) as s:
        yield s


def parse_sse(text: str) -> list[tuple[str, Any]]:
    """Server-sent events as a client reads them: blocks split on blank lines, ``event:``
    and ``data:`` lines (several data lines joined by newlines), comments skipped."""
    events: list[tuple[str, Any]] = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        name, data = "message", []
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            key, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if key == "event":
                name = value
            elif key == "data":
                data.append(value)
        if data:
            events.append((name, json.loads("\n".join(data))))
    return events


def assert_envelope(
    response: httpx.Response, status: int, *, param: Any = ..., code: Any = ...
) -> dict[str, Any]:
    """``response`` is ``status`` with a well-formed OpenAI error envelope and nothing that
    looks like a traceback or framework text; returns the inner error."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"] == "application/json"
    assert response.headers.get("x-request-id")
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    for leak in ("Traceback", 'File "', "hypercorn", "Internal Server Error", "omni_trio/"):
        assert leak not in response.text, response.text
    if param is not ...:
        assert error["param"] == param, error
    if code is not ...:
        assert error["code"] == code, error
    return error


async def wait_until(predicate: Callable[[], bool], interval: float = 0.01) -> None:
    """Poll ``predicate`` (real threads run the model: there is no event to wait on)."""
    while not predicate():  # noqa: ASYNC110
        await trio.sleep(interval)


# -- a webhook receiver ---------------------------------------------------------------------


@dataclass
class Receiver:
    """Records every call; answers ``503`` to the first ``fail[event]`` calls of an event."""

    fail: dict[str, int] = field(default_factory=dict)
    calls: list[tuple[dict[str, str], bytes, float]] = field(default_factory=list)
    url: str = ""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        self.calls.append((headers, b"".join(chunks), trio.current_time()))
        event = headers.get("x-omni-trio-event", "")
        status = 200
        if self.fail.get(event, 0) > 0:
            self.fail[event] -= 1
            status = 503
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def events(self) -> list[str]:
        return [h["x-omni-trio-event"] for h, _, _ in self.calls]


@asynccontextmanager
async def receiving(receiver: Receiver) -> AsyncIterator[Receiver]:
    limits = HttpLimits(graceful_timeout_s=1.0)
    server = HttpServer(receiver, limits.hypercorn_config(["127.0.0.1:0"]), limits)
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(server.serve, shutdown_trigger=trio.sleep_forever))
        receiver.url = f"{binds[0]}/hook"
        try:
            yield receiver
        finally:
            nursery.cancel_scope.cancel()
