"""``omni-trio serve``: the engine pool and the HTTP API in one trio run, under a supervisor.

:func:`serve_daemon` runs, in one ``trio.run``::

    signal receiver (SIGTERM, SIGINT)   installed first, so the tractor executor leaves
                                        SIGTERM to us (it handles it only when nobody does)
    watchdog                            WATCHDOG=1 every WATCHDOG_USEC/2 from the event loop
    HTTP server (serve.http)            hypercorn's protocols under our listener: binds,
                                        prints the listening line; /health answers, /ready
                                        says 503 "starting" while the pool warms up
    EnginePool.serve                    opens every replica (warmup included), then READY=1
    status reporter                     a log line (INFO) whenever readiness changes, from
                                        the start; STATUS= once serving

Shutdown (SIGTERM or SIGINT): ``STOPPING=1``, the pool stops admitting (new requests get 503
with ``Retry-After``), in-flight requests get ``drain_timeout_s`` to finish (a second signal
cuts that short), the rest are aborted with a terminal error ("server shutting down") and get
:data:`ABORT_GRACE_S` to write it, then the HTTP server stops (open connections get
:data:`GRACEFUL_TIMEOUT_S`, then are closed), the pool closes its engines (each bounded by
``engine.close_timeout_s``), and the process exits 0.

The whole shutdown is bounded: it ends within :func:`shutdown_bound_s` of the signal, always
-- ``drain_timeout_s`` + the engines' close (:func:`engine_close_bound_s`: every wait of it,
by backend) + :data:`SHUTDOWN_GRACE_S` (the aborted requests' answers, the HTTP server's stop
and the process exit).  A slow but healthy stop fits: every term is the longest its phase may
wait.  Should anything hold it past that (a worker that does not die, a hang in the
interpreter's own teardown), a watchdog thread (:class:`ExitDeadline`, armed at the stop
request and on the command line kept armed to the very end of the process) kills the daemon's
processes -- children and theirs -- says so on stderr and ends the process with exit 1 (or
the exit code already decided, when it is not 0).  The shipped unit files' stop timeouts
exceed the bound.

Exit codes (:data:`EXIT_CODES`): 0 stopped by a signal, drained; 1 failed to start (cannot
bind, model failed to load or warm up), an unexpected error, or a shutdown that overran its
bound; 2 bad configuration; 3 the engine pool died while serving (past its restart limit):
restart the process.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, TextIO

import trio
from trio_typing import TaskStatus

from ..errors import InvalidConfigError
from ..runtime.stage import engine_close_bound_s
from .config import ServeConfig, add_serve_arguments
from .notify import SystemdNotifier, serve_watchdog, watchdog_interval

if TYPE_CHECKING:
    from hypercorn.config import Config as HypercornConfig

    from .app import ImagesApp
    from .http import HttpLimits
    from .pool import EnginePool

__all__ = [
    "ABORT_GRACE_S",
    "EXIT_CODES",
    "EXIT_CONFIG",
    "EXIT_FAILED",
    "EXIT_MARGIN_S",
    "EXIT_OK",
    "EXIT_POOL_DIED",
    "GRACEFUL_TIMEOUT_S",
    "SHUTDOWN_GRACE_S",
    "ExitDeadline",
    "JsonFormatter",
    "TextFormatter",
    "add_serve_parser",
    "configure_logging",
    "descendant_pids",
    "engine_close_bound_s",
    "serve_daemon",
    "shutdown_bound_s",
]

log = logging.getLogger("omni_trio.serve.daemon")

PROG = "omni-trio"
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_POOL_DIED = 3
EXIT_CODES = {
    EXIT_OK: "stopped by SIGTERM/SIGINT after draining",
    EXIT_FAILED: "failed to start (bind, model load, warmup), an unexpected error, or a "
    "shutdown that overran its bound (drain + engine close + grace)",
    EXIT_CONFIG: "bad configuration (flags, TOML file, environment)",
    EXIT_POOL_DIED: "the engine pool died past its restart limit",
}

SHUTDOWN_REASON = "server shutting down"
# After the drain timeout aborted what was left: time for those handlers to write their
# terminal errors before the HTTP server stops.
ABORT_GRACE_S = 5.0
# The HTTP server: after it stops, open connections get this long to finish writing; then
# they are closed.
GRACEFUL_TIMEOUT_S = 3.0
# From the engines' close to the process's end: the trio run's teardown and the
# interpreter's (atexit handlers such as ray.shutdown, multiprocessing's joins).
EXIT_MARGIN_S = 2.0
# The fixed terms of the shutdown bound (see shutdown_bound_s): the abort grace, the HTTP
# server's stop and the exit margin.
SHUTDOWN_GRACE_S = ABORT_GRACE_S + GRACEFUL_TIMEOUT_S + EXIT_MARGIN_S
# The watchdog's last words: at most this long for stderr to take them (a full pipe must
# not hold the exit).
LAST_WORDS_S = 1.0
STATUS_POLL_S = 1.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)


# -- logging ---------------------------------------------------------------------------------

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_RECORD_ATTRS = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys() | {"message", "asctime"}
)


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _RECORD_ATTRS and k[0] != "_"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (UTC, ISO 8601, ms), ``level``, ``logger``, ``msg``,
    every ``extra=`` field (``request_id``, ``status``, ``outcome``, ``ms`` ...) and ``exc``
    (the traceback) when there is one.  Values JSON cannot hold are written with ``str``."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        entry: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in _extras(record).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc"] = record.exc_text
        return json.dumps(entry, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``2025-01-01 12:00:00,123 INFO logger: message key=value ...``: the ``extra=`` fields
    whose value the message does not already show are appended."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        message = record.getMessage()
        fields = " ".join(
            f"{k}={v}"
            for k, v in _extras(record).items()
            if v is not None and str(v) not in message
        )
        if not fields:
            return text
        head, sep, tail = text.partition("\n")  # keep a traceback after the fields
        return f"{head} {fields}{sep}{tail}"


def configure_logging(log_format: str, level: str, stream: TextIO | None = None) -> None:
    """Send every log record to ``stream`` (stderr) as text or JSON lines: omni_trio's and
    hypercorn's loggers at ``level``, everything else at warning or above; Python warnings
    too."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    logging.captureWarnings(True)  # Python warnings as log records (JSON stays JSON)
    # Records propagate to the root handler whatever the root's level: the root level only
    # filters loggers that have none of their own (third-party libraries).
    root.setLevel(logging.WARNING)
    numeric = logging.getLevelName(level.upper())
    logging.getLogger("omni_trio").setLevel(numeric)
    logging.getLogger("hypercorn.error").setLevel(numeric)


# -- the daemon --------------------------------------------------------------------------------


def _find(exc: BaseException, types: type[BaseException] | tuple[type[BaseException], ...]) -> Any:
    """The first exception of ``types`` in ``exc``, its groups and its causes; else None."""
    for item in _walk(exc):
        if isinstance(item, types):
            return item
    return None


def _walk(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    stack = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if isinstance(current, BaseExceptionGroup):
            stack.extend(reversed(current.exceptions))
        if current.__cause__ is not None:
            stack.append(current.__cause__)


def _describe(exc: BaseException) -> str:
    leaves = [
        e
        for e in _walk(exc)
        if not isinstance(e, BaseExceptionGroup) and not isinstance(e, trio.Cancelled)
    ]
    first = leaves[0] if leaves else exc
    return f"{type(first).__name__}: {first}"


def shutdown_bound_s(config: ServeConfig) -> float:
    """The longest a shutdown may take from its signal: ``drain_timeout_s``, then
    :func:`engine_close_bound_s`, then :data:`SHUTDOWN_GRACE_S` (:data:`ABORT_GRACE_S` for
    the aborted requests' answers, :data:`GRACEFUL_TIMEOUT_S` for the HTTP server's stop,
    :data:`EXIT_MARGIN_S` for the exit).  Past it the :class:`ExitDeadline` fires."""
    from .pool import resolve_stage

    stage = resolve_stage(config.stage, config.replicas, config.engine.backend)
    return config.drain_timeout_s + engine_close_bound_s(config.engine, stage) + SHUTDOWN_GRACE_S


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process this one can see (Linux ``/proc``)."""
    parents: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return parents
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as file:
                stat = file.read()
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        parents[int(entry)] = ppid
    return parents


def descendant_pids(root: int | None = None) -> list[int]:
    """Every descendant of process ``root`` (default: this one) -- children, theirs, and so
    on (a forkserver's workers are grandchildren) -- nearest first; empty where there is no
    ``/proc``."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    found: list[int] = []
    frontier = [root]
    while frontier:
        below = [c for pid in frontier for c in sorted(children.get(pid, ())) if c not in found]
        found.extend(below)
        frontier = below
    return found


def _kill_children() -> None:
    """SIGKILL every descendant (children, grandchildren...); twice, for one forked
    meanwhile."""
    for _ in range(2):
        for pid in descendant_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _write_stderr(text: str) -> None:
    """``text`` to file descriptor 2 itself -- no logging handler, whose lock a stuck
    thread may hold, and no Python-level buffer -- for at most :data:`LAST_WORDS_S`."""
    data = text.encode("utf-8", "replace")
    done = threading.Event()

    def write() -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(2, view) :]
        except OSError:
            pass
        finally:
            done.set()

    threading.Thread(target=write, name="omni-trio-last-words", daemon=True).start()
    done.wait(LAST_WORDS_S)


def _log_line(level: int, message: str) -> str:
    """``message`` as the daemon's log handler would format it (text or JSON), built
    without taking any logging lock."""
    record = logging.LogRecord(log.name, level, __file__, 0, message, None, None)
    formatter: logging.Formatter | None = None
    for handler in logging.getLogger().handlers:
        formatter = handler.formatter
        break
    try:
        return (formatter or TextFormatter()).format(record) + "\n"
    except Exception:  # pragma: no cover - a broken formatter must not stop the exit
        return message + "\n"


class ExitDeadline:
    """The last resort of the shutdown bound: once :meth:`arm` ed, a thread waits
    ``seconds`` and then, unless :meth:`disarm` ed first, kills every descendant process,
    writes one CRITICAL line straight to stderr and ends the process with ``code()`` -- in
    that order, taking no lock the stuck program may hold.  A daemon thread, so that it
    fires even when the event loop is stuck, and so that it may stay armed through the
    interpreter's teardown (a process that ends first takes it along); it never outlives
    :meth:`disarm`.

    ``exit``, ``kill_children`` and ``write`` are injectable for tests (default
    ``os._exit``, SIGKILL to every descendant, and a bounded write to file descriptor 2)."""

    def __init__(
        self,
        *,
        exit: Callable[[int], object] = os._exit,
        kill_children: Callable[[], None] = _kill_children,
        write: Callable[[str], None] = _write_stderr,
    ) -> None:
        self._exit = exit
        self._kill_children = kill_children
        self._write = write
        self._disarmed = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def armed(self) -> bool:
        return self._thread is not None and not self._disarmed.is_set()

    def arm(self, seconds: float, code: Callable[[], int]) -> None:
        """Start the countdown (once; later calls do nothing)."""
        if self._thread is not None or self._disarmed.is_set():
            return

        def run() -> None:
            if self._disarmed.wait(seconds):
                return
            self._kill_children()
            exit_code = code()
            self._write(
                _log_line(
                    logging.CRITICAL,
                    f"the shutdown overran its bound of {seconds:.1f} s (drain + engine close "
                    f"+ {SHUTDOWN_GRACE_S:.0f} s): killed the worker processes; exiting "
                    f"{exit_code}",
                )
            )
            self._exit(exit_code)

        self._thread = threading.Thread(target=run, name="omni-trio-exit-deadline", daemon=True)
        self._thread.start()

    def disarm(self) -> None:
        """Cancel the countdown and join its thread (idempotent)."""
        self._disarmed.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()


async def _first_of(*waits: Callable[[], Awaitable[object]]) -> None:
    """Return as soon as any of ``waits`` returns (the others are cancelled)."""
    async with trio.open_nursery() as nursery:
        for wait in waits:

            async def run(wait: Callable[[], Awaitable[object]] = wait) -> None:
                await wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(run)


class _Daemon:
    """One run of the daemon; owns the pool, the app, the HTTP server and the shutdown.

    Invariants: ``stop`` is set once, by the first signal or by the pool ending;
    ``hurry`` (a second signal) only shortens the drain; ``exit_code`` is decided by whoever
    sets ``stop`` and read once everything is closed.
    """

    def __init__(
        self,
        config: ServeConfig,
        notifier: SystemdNotifier,
        watchdog_s: float | None,
        out: TextIO,
        deadline: ExitDeadline | None = None,
    ) -> None:
        self.config = config
        self.notifier = notifier
        self.watchdog_s = watchdog_s
        self.out = out
        self.stop = trio.Event()
        self.hurry = trio.Event()
        self.pool_ready = trio.Event()
        self.pool_closed = trio.Event()
        self.stop_http = trio.Event()
        self.http_stopped = trio.Event()
        self.exit_code = EXIT_OK
        self.stop_reason = ""
        self.url = f"http://{config.bind}"  # the bound address once listening (port 0 resolved)
        self.deadline = deadline if deadline is not None else ExitDeadline()
        self.max_connections = config.max_connections  # lowered to fit RLIMIT_NOFILE

    def _request_stop(self, code: int, reason: str) -> None:
        if not self.stop.is_set():
            self.exit_code = code
            self.stop_reason = reason
            self.stop.set()
            self.deadline.arm(shutdown_bound_s(self.config), self._forced_exit_code)

    def _forced_exit_code(self) -> int:
        return self.exit_code if self.exit_code != EXIT_OK else EXIT_FAILED

    # -- building -------------------------------------------------------------------------

    def _build_app(self, pool: EnginePool) -> ImagesApp:
        from .app import ImagesApp
        from .images import ImageStore, ServeLimits
        from .metrics import ServeMetrics

        c = self.config
        limits = ServeLimits(
            max_body_bytes=c.max_body_bytes,
            max_prompt_chars=c.max_prompt_chars,
            max_n=c.max_n,
            max_pixels=c.max_pixels,
            max_steps=c.max_steps,
            max_upload_bytes=c.max_upload_bytes,
            max_upload_pixels=c.max_upload_pixels,
        )
        store = ImageStore(ttl_s=c.url_ttl_s, max_bytes=c.url_store_max_bytes)
        return ImagesApp(
            pool,
            model_name=c.served_model_name,
            limits=limits,
            api_key=c.api_key,
            api_keys=c.api_keys,
            priority_ranges=c.priority_ranges,
            idempotency_ttl_s=c.idempotency_ttl_s,
            idempotency_max_bytes=c.idempotency_max_bytes,
            store=store,
            metrics=ServeMetrics(pool),
            public_url=c.public_url,
            body_read_timeout_s=c.body_read_timeout_s,
            send_timeout_s=c.send_timeout_s,
            max_response_bytes_in_flight=c.max_response_bytes_in_flight,
            log=logging.getLogger("omni_trio.serve.access"),
            image_metadata=c.image_metadata,
            job_ttl_s=c.job_ttl_s,
            job_max_bytes=c.job_max_bytes,
            webhook_secret=c.webhook_secret,
            webhook_hosts=c.webhook_hosts,
        )

    def _http_limits(self) -> HttpLimits:
        from .http import HttpLimits

        c = self.config
        return HttpLimits(
            max_connections=self.max_connections,
            keep_alive_timeout_s=c.keep_alive_timeout_s,
            send_timeout_s=c.send_timeout_s,
            max_connection_buffer_bytes=c.max_connection_buffer_bytes,
            graceful_timeout_s=GRACEFUL_TIMEOUT_S,
        )

    def _hypercorn_config(self) -> HypercornConfig:
        """hypercorn's settings (the app logs one structured line per request, hypercorn's
        own errors go through our handler), with the HTTP limits applied."""
        return self._http_limits().hypercorn_config([self.config.bind])

    # -- running --------------------------------------------------------------------------

    async def run(self, signals: Any) -> int:
        """Serve until stopped; the exit code.  The shutdown bound (:attr:`deadline`, an
        :class:`ExitDeadline`) is armed by the first stop request and is still armed when
        this returns: what follows (the trio run's and the interpreter's teardown) is under
        it too, until its owner disarms it."""
        from .http import fit_connection_cap
        from .pool import EnginePool

        c = self.config
        try:
            pool = EnginePool(
                c.engine,
                replicas=c.replicas,
                stage=c.stage,
                max_queue_len=c.max_queue_len,
                max_queue_wait_s=c.max_queue_wait_s,
                restart_wait_s=c.restart_wait_s,
            )
            app = self._build_app(pool)
            self.max_connections, warning = fit_connection_cap(c.max_connections)
            if warning is not None:
                log.warning("%s", warning)
            hc = self._hypercorn_config()
        except (InvalidConfigError, ValueError) as exc:
            log.error("bad configuration: %s", exc)
            return EXIT_CONFIG
        self._log_start()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_signals, signals)
            await nursery.start(app.serve)  # jobs run here (cancelled last, after the pool)
            await nursery.start(partial(serve_watchdog, self.notifier, interval=self.watchdog_s))
            self.notifier.status("starting: binding the HTTP listener")
            try:
                binds = await nursery.start(self._serve_http, app, hc)
            except Exception as exc:
                error = _find(exc, OSError)
                if error is None:
                    raise
                log.error("cannot listen on %s: %s", c.bind, error)
                nursery.cancel_scope.cancel()
                return EXIT_FAILED
            url = self.url = binds[0] if binds else self.url
            print(
                f"{PROG} serve: listening on {url} "
                f"(model {c.served_model_name}, {c.replicas} replica(s))",
                file=self.out,
                flush=True,
            )
            self.notifier.status(f"starting: warming up {c.replicas} replica(s)")
            pool_scope = trio.CancelScope()
            nursery.start_soon(self._serve_pool, pool, pool_scope)
            nursery.start_soon(self._report_status, pool)
            await _first_of(self.pool_ready.wait, self.stop.wait)
            if self.pool_ready.is_set() and not self.stop.is_set():
                log.info("ready: serving %d replica(s) on %s", c.replicas, url, extra={"url": url})
                self.notifier.ready(status=self._serving_status())
            await self.stop.wait()
            if self.exit_code == EXIT_OK:
                await self._drain(pool)
            self.notifier.status(f"stopping: {self.stop_reason}")
            self.stop_http.set()  # within GRACEFUL_TIMEOUT_S; then it closes what is left
            await self.http_stopped.wait()
            pool_scope.cancel()
            await self.pool_closed.wait()
            nursery.cancel_scope.cancel()  # the watchdog, signal watcher, status reporter
        log.info(
            "stopped: %s (exit %d)",
            self.stop_reason,
            self.exit_code,
            extra={"exit_code": self.exit_code},
        )
        return self.exit_code

    async def _serve_http(
        self,
        app: ImagesApp,
        hc: HypercornConfig,
        *,
        task_status: TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """The HTTP server (:mod:`omni_trio.serve.http`) until :attr:`stop_http` is set, then
        at most :data:`GRACEFUL_TIMEOUT_S` more; ``started`` gets the bound URLs."""
        from .http import serve_http

        try:
            await serve_http(
                app,
                hc,
                self._http_limits(),
                shutdown_trigger=self.stop_http.wait,
                metrics=app.metrics,
                # A connection frees as a request ends: one service time at the measured rate.
                retry_after=partial(app.pool.retry_after_s, excess=1),
                task_status=task_status,
            )
        finally:
            self.http_stopped.set()

    def _log_start(self) -> None:
        c = self.config
        e = c.engine
        log.info(
            "starting: model %s, backend %s, %d replica(s) x %d worker(s), listening on %s",
            e.model,
            e.backend,
            c.replicas,
            e.num_workers,
            c.bind,
            extra={"api_key": f"{len(c.all_api_keys)} key(s)" if c.all_api_keys else "unset"},
        )
        if c.exposed_without_key:
            log.warning(
                "SECURITY: listening on %s, which is not loopback, WITHOUT an API key: anyone "
                "who can reach this port can generate images and abort requests.  Set "
                "--api-key (or OMNI_TRIO_API_KEY), or bind 127.0.0.1 behind a reverse proxy "
                "that authenticates.",
                c.host,
            )
        if not e.warmup and (e.max_request_s is not None or e.max_step_s is not None):
            log.warning(
                "warmup is off, so no compute budget applies (max_request_s %s, max_step_s %s "
                "need the step time the warmup measures): any request within the size and "
                "step limits is admitted, however long it runs",
                e.max_request_s,
                e.max_step_s,
            )

    def _serving_status(self) -> str:
        n = self.config.replicas
        return f"serving {n} replica{'s' if n != 1 else ''} on {self.url}"

    async def _watch_signals(self, signals: Any) -> None:
        async for signum in signals:
            name = signal.Signals(signum).name
            if not self.stop.is_set():
                log.info("%s: draining, then stopping", name, extra={"signal": name})
                self._request_stop(EXIT_OK, f"{name} received")
            elif not self.hurry.is_set():
                log.warning("%s again: aborting in-flight requests now", name)
                self.hurry.set()

    async def _serve_pool(self, pool: EnginePool, scope: trio.CancelScope) -> None:
        """Run the pool until ``scope`` is cancelled.  A pool that fails to start, or dies
        while serving, requests the stop with the matching exit code."""
        try:
            with scope:
                async with trio.open_nursery() as inner:
                    await inner.start(pool.serve)
                    self.pool_ready.set()
        except Exception as exc:
            if not self.pool_ready.is_set():
                config_error = _find(exc, InvalidConfigError)
                if config_error is not None:
                    log.error("bad configuration: %s", config_error)
                    self._request_stop(EXIT_CONFIG, "bad configuration")
                else:
                    log.error("the engine pool failed to start: %s", _describe(exc), exc_info=exc)
                    self._request_stop(EXIT_FAILED, "the engine pool failed to start")
            else:
                log.error(
                    "the engine pool died: %s; exiting %d so the supervisor restarts the process",
                    _describe(exc),
                    EXIT_POOL_DIED,
                    exc_info=exc,
                )
                self._request_stop(EXIT_POOL_DIED, "the engine pool died")
        finally:
            self.pool_closed.set()
        if not scope.cancelled_caught and not self.stop.is_set():  # pragma: no cover
            self._request_stop(EXIT_POOL_DIED, "the engine pool stopped")

    async def _drain(self, pool: EnginePool) -> None:
        """Stop admitting, let in-flight requests finish (at most ``drain_timeout_s``, less
        after a second signal), abort the rest and give their handlers time to answer."""
        pool.start_draining()
        in_flight = pool.in_flight
        self.notifier.stopping(status=f"draining: {in_flight} request(s) in flight")
        log.info(
            "draining: %d request(s) in flight, waiting up to %.1f s",
            in_flight,
            self.config.drain_timeout_s,
            extra={"in_flight": in_flight},
        )
        if not self.pool_ready.is_set():
            return
        if not pool.sleep_level:
            with trio.move_on_after(self.config.drain_timeout_s):
                await _first_of(pool.wait_idle, self.hurry.wait)
        # (Asleep, what waits in the queue would run only after a wake: it is aborted now.)
        left = pool.in_flight
        if left:
            log.warning(
                "drain timeout: aborting %d request(s) still in flight",
                left,
                extra={"in_flight": left},
            )
            self.notifier.status(f"draining: aborting {left} request(s)")
            pool.abort_all(SHUTDOWN_REASON)
            with trio.move_on_after(ABORT_GRACE_S):
                await pool.wait_idle()
        else:
            log.info("drained: no request in flight")

    async def _report_status(self, pool: EnginePool) -> None:
        """Log (INFO) whenever the pool's readiness changes -- once per change, however often
        ``/ready`` is probed: ``not ready: starting`` at startup, ``not ready: replica 0:
        restarting ...``, ``ready again`` -- and, once serving, send it as STATUS= too.
        Stops at the first stop request (the drain logs its own lines)."""
        last: tuple[bool, str | None] | None = None
        was_ready = False
        while not self.stop.is_set():
            now = pool.readiness()
            if now != last:
                ready, reason = now
                if not ready:
                    log.info("not ready: %s", reason, extra={"reason": reason})
                    if self.pool_ready.is_set():
                        self.notifier.status(f"degraded: {reason}")
                elif was_ready:
                    log.info("ready again: all replicas healthy")
                    self.notifier.status(self._serving_status())
                was_ready = was_ready or ready
                last = now
            await trio.sleep(STATUS_POLL_S)


async def _main(
    config: ServeConfig,
    notifier: SystemdNotifier,
    watchdog_s: float | None,
    out: TextIO,
    deadline: ExitDeadline,
) -> int:
    # The receiver goes in before anything starts an engine: the tractor executor installs
    # its own SIGTERM handler only while SIGTERM is SIG_DFL, and ours must win.
    with trio.open_signal_receiver(*SIGNALS) as signals:
        return await _Daemon(config, notifier, watchdog_s, out, deadline).run(signals)


def _start_fork_server_early(config: ServeConfig) -> None:
    """The fork server, if this process's replica engines (inline) or stage processes
    would start one: started now, its preload (torch and diffusers: seconds, on one core)
    runs while this process imports the HTTP stack, binds its listener and opens the
    engines.  Stage processes of a tractor or Ray engine start their own; a bad
    configuration is the daemon's to report.  (A daemon that then fails, say to bind,
    leaves it to end with this process.)"""
    from .pool import resolve_stage

    try:
        stage = resolve_stage(config.stage, config.replicas, config.engine.backend)
    except InvalidConfigError:
        return
    from ..executors.tractor_executor import start_fork_server_early

    start_fork_server_early(config.engine, stage)


def serve_daemon(
    config: ServeConfig,
    *,
    out: TextIO | None = None,
    exit_deadline: ExitDeadline | None = None,
) -> int:
    """Run the daemon until SIGTERM/SIGINT (then drain) or until the engine pool dies;
    returns the process exit code (see :data:`EXIT_CODES`).  Configures logging from
    ``config`` and reads (then clears from the environment) ``NOTIFY_SOCKET`` and the
    watchdog variables.  Must run in the main thread (signal handling).

    The shutdown bound: without ``exit_deadline`` the daemon's own one is disarmed before
    this returns (the caller goes on with its process).  Given one (``omni-trio serve``
    gives one), it is armed at the stop request and left armed: the caller is about to end
    the process, and the interpreter's teardown is bounded by it too."""
    configure_logging(config.log_format, config.log_level)
    watchdog_s = watchdog_interval()
    notifier = SystemdNotifier.from_environ(unset=True)
    _start_fork_server_early(config)  # (systemd's variables are gone: workers inherit it)
    deadline = exit_deadline if exit_deadline is not None else ExitDeadline()
    try:
        return trio.run(_main, config, notifier, watchdog_s, out or sys.stdout, deadline)
    except (Exception, BaseExceptionGroup) as exc:
        log.critical("unexpected error: %s", _describe(exc), exc_info=exc)
        return EXIT_FAILED
    finally:
        notifier.close()
        if exit_deadline is None:
            deadline.disarm()


# -- command line ------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    """``omni-trio serve``: build the config (exit 2 with one line on stderr if it is bad),
    then :func:`serve_daemon`, whose shutdown bound stays armed until the process ends."""
    try:
        config = ServeConfig.from_args(args)
        # A bad model is one line now, not after the listener is up and a replica failed.
        check = getattr(args, "check_engine_config", None)
        if check is not None:
            check(config.engine)
    except InvalidConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    return serve_daemon(config, exit_deadline=ExitDeadline())


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``omni-trio serve`` on the CLI's subparsers (imports nothing heavy)."""
    epilog = "exit status: " + "; ".join(f"{code} {text}" for code, text in EXIT_CODES.items())
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="serve an OpenAI-compatible images API (engines + HTTP, under a supervisor)",
        description="Run engine replicas and the HTTP API (POST /v1/images/generations, "
        "/health, /ready, /metrics) in one process.  Binds 127.0.0.1 unless told otherwise.  "
        "Every flag can also be set in a TOML file (--config); flags override the file and "
        "the environment (OMNI_TRIO_API_KEY).  SIGTERM/SIGINT drain, then exit 0.  Speaks "
        "the systemd notify protocol when NOTIFY_SOCKET is set.  See docs/operations.md.",
        epilog=epilog,
    )
    add_serve_arguments(parser)
    parser.set_defaults(handler=cmd_serve)
    return parser
