"""The multi-process executor: one tractor sub-actor (an OS process) per worker.

Shape (see ``notes/tractor-0.1.0a5.md`` for why each piece is there):

- ``serve`` opens a tractor nursery on an explicit free registry port (two engines never join
  each other's tree), starts every worker actor, and opens ONE ``open_context`` per worker
  with a persistent bidirectional stream.  Each worker loads its model inside that context
  and reports ``pid``, ``rank`` and its model info in ``ctx.started``.
- Each worker link has a single reader (it resolves replies by call id and records
  heartbeats) and a single writer task fed by an unbounded channel, so ``abort_requests``
  never blocks.
- tractor 0.1.0a5 never notices a dead child, so each worker's pid is watched with
  ``os.pidfd_open`` + ``trio.lowlevel.wait_readable``; a missing heartbeat, or a call that
  makes no step progress for ``worker_stall_timeout_s``, marks the worker hung.  Either way
  the executor *fails closed*: every pending call fails with a :class:`WorkerError` naming
  the rank, the pid and the exit status, and the whole group is torn down.
- Every call is sent to all ranks; only the output rank ships its result, the others reply
  with an acknowledgement (so a failure on any rank is seen, with its traceback).
- ``EngineConfig.worker_start_method``: ``"trio"`` (tractor's default) runs each worker as a
  fresh interpreter, which imports torch, diffusers and our worker code again on every
  restart; ``"forkserver"`` selects tractor's forkserver method with the heavy modules
  preloaded (:data:`FORKSERVER_PRELOAD`) in the stdlib fork server, which lives as long as
  this process and forks every later worker ready-made.  A forkserver worker is a child of
  the fork server, not of the engine: it is handed the engine's pid to watch
  (``serve_worker(engine_pid=...)``), and its exit status comes from the fork server
  through tractor's ``multiprocessing.Process`` (``waitpid`` is not ours to call).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import multiprocessing
import os
import secrets
import signal
import socket
import threading
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import trio
from trio_typing import TaskStatus

from .._core.health import WorkerStatus
from .._core.messages import AsyncOutput
from ..config import EngineConfig
from ..errors import EngineClosedError, EngineDeadError, InvalidConfigError, StallError, WorkerError
from ..ipc import SegmentRegistry
from ._process import wait_exited as _wait_exited
from .base import Executor, GroupExecutor, WorkerState
from .result_pump import ResultPump

__all__ = ["FORKSERVER_PRELOAD", "TractorExecutor"]

log = logging.getLogger(__name__)

_WARNING_FILTERS = (
    "ignore:trio.MultiError is deprecated",
    "ignore:MultiError.filter() is deprecated",
    "ignore::FutureWarning",
)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# tractor 0.1.0a5 uses APIs trio deprecated; the warnings are about tractor, not the user.
_PARENT_WARNINGS = (
    r"trio\.MultiError is deprecated",
    r"MultiError\.filter\(\) is deprecated",
    r"using trio\.Process as an async context manager is deprecated",
    r"trio\.Process\.aclose is deprecated",
)


def _silence_tractor_warnings() -> None:
    """Filter tractor's deprecation noise here, and (by env, since children import tractor
    before our code runs) in every worker process."""
    for message in _PARENT_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
    current = os.environ.get("PYTHONWARNINGS", "")
    parts = [p for p in current.split(",") if p]
    for flt in _WARNING_FILTERS:
        if flt not in parts:
            parts.append(flt)
    os.environ["PYTHONWARNINGS"] = ",".join(parts)


def _may_handle_sigterm() -> bool:
    """Only the main thread may take signals, and only if the application has not."""
    return threading.current_thread() is threading.main_thread() and signal.getsignal(
        signal.SIGTERM
    ) in (signal.SIG_DFL, None)


def _exit_status(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# What the fork server imports once, so that no forked worker pays for it: torch, diffusers
# (with the pipeline, UNet and CLIP modules the built-in and local SD-family models load) and
# our worker code.  "__main__" as in the stdlib default: the engine's main script is run
# (as ``__mp_main__``) once in the fork server instead of once in every worker.  A module
# that is not installed is skipped by the fork server.  None of them starts a thread or
# initialises CUDA at import (a fork server must stay single-threaded and CUDA-free).
FORKSERVER_PRELOAD = (
    "__main__",
    "numpy",
    "torch",
    "diffusers",
    "diffusers.pipelines.pipeline_utils",
    "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion",
    "transformers.models.clip.modeling_clip",
    "omni_trio.ipc",
    "omni_trio.models.loading",
    "omni_trio.models.pipeline",
    "omni_trio.worker.worker_thread",
    "omni_trio.worker.worker",
    "omni_trio.worker.tractor_actor",
)

# pid of the fork server that has answered a fork request (its preload is done), if any.
_forkserver_warm_pid: int | None = None


def _forkserver_pid() -> int | None:
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    return int(pid) if pid is not None else None


def _ensure_forkserver(preload: list[str]) -> None:
    """Start the fork server with ``preload`` if none runs yet, and return once it answers
    a fork request, i.e. once its preload is done (blocking: call it in a thread).

    tractor's ``forkserver`` spawn starts each worker with a blocking ``Process.start()`` on
    the event loop, which waits for the fork server: warming it here keeps the first
    group's multi-second preload off the loop; a warm server forks in milliseconds.  Must
    run after tractor selected the method (it swaps in its own fork server then)."""
    global _forkserver_warm_pid
    from multiprocessing import forkserver

    ctx = multiprocessing.get_context("forkserver")
    if _forkserver_pid() is None:
        # Only a server started from here on sees it; a running one keeps its own.
        ctx.set_forkserver_preload(preload)
    forkserver.ensure_running()  # (re)starts it if there is none or it died
    pid = _forkserver_pid()
    if pid is None or pid == _forkserver_warm_pid:
        return
    probe = ctx.Process(target=os.getpid, name="omni-trio-forkserver-probe", daemon=True)
    probe.start()  # returns once the server forked: its preload is done
    probe.join()
    _forkserver_warm_pid = pid


def _runs(pid: int) -> bool:
    """Process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            return True
        return True


@dataclass(eq=False)
class _Waiter:
    done: trio.Event = field(default_factory=trio.Event)
    reply: dict[str, Any] | None = None
    error: BaseException | None = None

    def settle(
        self, reply: dict[str, Any] | None = None, error: BaseException | None = None
    ) -> None:
        if not self.done.is_set():
            self.reply, self.error = reply, error
            self.done.set()


@dataclass(eq=False)
class _WorkerLink:
    """The executor's side of one worker: its pid, outbox, pending calls and liveness."""

    rank: int
    pid: int
    outbox: trio.MemorySendChannel[bytes]
    last_beat: float
    steps: int = 0
    last_progress_at: float = 0.0
    progress: dict[str, tuple[int, int]] = field(default_factory=dict)
    pending: dict[int, _Waiter] = field(default_factory=dict)
    # tractor's (private) process object of this worker, when found, for its exit status:
    # a trio.Process (start method "trio": our child, reaped with waitpid), or a
    # multiprocessing.Process ("forkserver": the fork server's child; the fork server reaps
    # it and reports the status on the Process's sentinel).
    process: Any = None
    # The process's exit status once it is known (negative: killed by that signal).
    exit_code: int | None = None
    # forkserver: the pid of the fork server that forked this worker (it reports the status).
    fork_server: int | None = None

    def poll_exit_code(self) -> int | None:
        """The exit status if the process has exited (reaping it if needed), else None."""
        if self.exit_code is None and self.process is not None:
            proc = self.process
            try:
                if isinstance(proc, multiprocessing.process.BaseProcess):
                    code = proc.exitcode
                    if code == 255 and self._status_lost():
                        return None
                else:
                    code = proc.poll()
            except (ValueError, OSError):  # a closed Process object
                code = None
            self.exit_code = code if isinstance(code, int) else None
        return self.exit_code

    def _status_lost(self) -> bool:
        """multiprocessing says 255 when the fork server's status pipe hits EOF: if the fork
        server itself is gone, this worker's real exit status is lost."""
        return self.fork_server is not None and not _runs(self.fork_server)

    async def wait_exit_code(self, timeout: float = 1.0) -> int | None:
        """The exit status of the process, which has exited: at once for our own child; a
        forkserver worker's status arrives from the fork server a moment after the exit
        (it reaps on SIGCHLD), so that one is polled for up to ``timeout`` seconds."""
        with trio.move_on_after(timeout):
            while self.poll_exit_code() is None and self.process is not None:
                if not isinstance(self.process, multiprocessing.process.BaseProcess):
                    break
                if self._status_lost():
                    break
                await trio.sleep(0.005)
        return self.exit_code

    def fail_pending(self, error: BaseException) -> None:
        for waiter in self.pending.values():
            waiter.settle(error=error)
        self.pending.clear()


class TractorExecutor(GroupExecutor):
    """Backend ``"tractor"``: ``num_workers`` worker processes under one tractor nursery.

    One per process at a time: tractor 0.1.0a5 keeps a single runtime (root actor) per
    process in a module global, and it lives inside the ``open_nursery`` of whichever
    executor opened it.  A second executor would silently nest in that runtime and lose its
    workers' channels when the first engine closes, so ``serve`` refuses it with
    :class:`InvalidConfigError` instead.  (An application that is itself a tractor actor is
    different: its runtime outlives the engine, so the workers nest in it.)
    """

    one_per_process = True
    # The executor whose ``serve`` opened this process's tractor runtime, if any.  Class
    # state because tractor's runtime is process state.
    _runtime_owner: ClassVar[TractorExecutor | None] = None

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._links: dict[int, _WorkerLink] = {}
        self._ids = itertools.count(1)
        self._group_scope: trio.CancelScope | None = None
        self._serve_done = trio.Event()
        self._closing = False
        self._tag = secrets.token_hex(3)
        # This group's own tractor registry (arbiter) address, chosen when ``serve`` starts:
        # a free loopback port, never tractor's global default 1616, so two engines in one
        # host (or one process) never join each other's tree.
        self.registry_addr: tuple[str, int] | None = None
        # torch.distributed rendezvous of a CFG-parallel group (2 workers), else None.
        self._dist_init_method: str | None = None
        self._sigterm_received = False
        self._pump_send: trio.MemorySendChannel[AsyncOutput] | None = None
        self._pump_replies: trio.MemoryReceiveChannel[AsyncOutput] | None = None

    # -- lifecycle ----------------------------------------------------------------------

    def _wire_config(self) -> dict[str, Any]:
        data = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config)}
        data["backend"] = "inproc"  # inside the worker there is no executor
        data["num_workers"] = 1
        # Threads are divided among *all* workers here, not recomputed per process.
        data["torch_threads"] = self.config.resolved_torch_threads
        data["model_options"] = dict(self.config.model_options)
        return data

    async def serve(self, *, task_status: TaskStatus[Executor] = trio.TASK_STATUS_IGNORED) -> None:
        """Spawn the workers, load the model in each (concurrently), report ready, then run
        until cancelled or until the group fails.  Teardown asks each worker to stop, waits
        at most ``close_timeout_s``, then kills the processes."""
        _silence_tractor_warnings()  # before the first import of tractor, which warns
        import tractor

        from .._core.model_info import ModelInfo
        from ..worker.tractor_actor import WORKER_MODULE

        start_method = self.config.worker_start_method
        if start_method == "forkserver" and multiprocessing.current_process().name != "MainProcess":
            # tractor 0.1.0a5 starts its fork server only from the main process.
            raise InvalidConfigError(
                "worker_start_method='forkserver' needs the engine in the main process, not "
                f"in the multiprocessing child {multiprocessing.current_process().name!r}",
                field="worker_start_method",
            )
        runtime = tractor.current_actor(err_on_no_runtime=False)
        if runtime is None:
            # We open the process's tractor runtime: it lives exactly as long as this serve.
            TractorExecutor._runtime_owner = self
            self.registry_addr = ("127.0.0.1", _free_port())
        elif TractorExecutor._runtime_owner is not None:
            raise InvalidConfigError(
                "another engine with backend='tractor' is running in this process; tractor "
                "0.1.0a5 keeps one runtime per process and it ends when that engine closes, "
                "so run tractor engines one at a time per process (or in separate processes)",
                field="backend",
            )
        else:
            # The application runs its own tractor runtime (it is an actor itself): our
            # workers become its children and use its registry; it outlives this engine.
            addr = getattr(runtime, "_arb_addr", None)
            self.registry_addr = (str(addr[0]), int(addr[1])) if addr else None
        try:
            # The tractor runtime itself lives inside ``open_nursery``: the group scope must sit
            # *inside* it, so cancelling the group (close, a dead worker) stops our tasks but
            # leaves the runtime's channels up for the graceful ``actors.cancel()`` below.
            # (Cancelling the runtime first closed every channel, so no cancel request could
            # be sent and tractor SIGKILLed each worker after its 3 s reap timeout.)
            if self.config.num_workers > 1 and self.config.cfg_parallel:
                self._dist_init_method = f"tcp://127.0.0.1:{_free_port()}"
            if self.config.async_output and not self.config.step_execution:
                # Rank 0's packer sends OUTPUT_READY on its stream; the pump is their reader.
                self._pump = ResultPump(worker=0)
                self._pump_send, self._pump_replies = trio.open_memory_channel[AsyncOutput](
                    math.inf
                )
            # The start method is process-wide tractor state: select it explicitly every
            # time (a forkserver engine earlier in this process must not leave it set).  An
            # application's own runtime keeps the method it chose.
            nursery_options: dict[str, Any] = (
                {"start_method": start_method} if runtime is None else {}
            )
            async with tractor.open_nursery(
                arbiter_addr=self.registry_addr, loglevel="critical", **nursery_options
            ) as actors:
                try:
                    from tractor import _spawn

                    if _spawn._spawn_method == "forkserver":
                        # After tractor selected the method (it replaced the stdlib's fork
                        # server with its own); the env (PYTHONWARNINGS above) is frozen now.
                        try:
                            await trio.to_thread.run_sync(
                                _ensure_forkserver, list(FORKSERVER_PRELOAD)
                            )
                        except (OSError, EOFError) as exc:
                            raise WorkerError(
                                f"the fork server did not start: {exc!r}",
                                error_type="ForkServerError",
                            ) from exc
                    elif start_method != "trio":
                        log.warning(
                            "worker_start_method=%r ignored: the application's tractor runtime "
                            "spawns with %r",
                            start_method,
                            _spawn._spawn_method,
                        )
                    with trio.CancelScope() as group_scope:
                        self._group_scope = group_scope
                        async with trio.open_nursery() as links:
                            # Workers start concurrently; the first startup failure wins
                            # (every rank usually fails the same way, e.g. a bad model).
                            startup_errors: list[Exception] = []

                            async def start_one(rank: int, starters: trio.Nursery) -> None:
                                try:
                                    portal = await actors.start_actor(
                                        f"omni-trio-worker-{rank}-{self._tag}",
                                        enable_modules=[WORKER_MODULE],
                                    )
                                    await links.start(self._serve_link, actors, rank, portal)
                                except Exception as exc:
                                    startup_errors.append(exc)
                                    starters.cancel_scope.cancel()

                            async with trio.open_nursery() as starters:
                                for rank in range(self.config.num_workers):
                                    starters.start_soon(start_one, rank, starters)
                            if startup_errors:
                                raise startup_errors[0]
                            info = self._ready_info
                            self.model_info = ModelInfo(**info)
                            if self._pump is not None:
                                await links.start(self._pump.serve, self._pump_replies)
                            links.start_soon(self._monitor_liveness)
                            if _may_handle_sigterm():
                                links.start_soon(self._stop_on_sigterm)
                            task_status.started(self)
                            await trio.sleep_forever()
                finally:
                    with trio.CancelScope(shield=True):
                        await self._stop_actors(actors)
        finally:
            if TractorExecutor._runtime_owner is self:
                TractorExecutor._runtime_owner = None
            self._closed = True
            error = self._dead_reason or EngineClosedError("executor is closed")
            for link in self._links.values():
                link.fail_pending(error)
            if self._pump is not None:
                self._pump.fail(error)
            if self._sigterm_received:
                # The workers are down (gracefully); now die of the SIGTERM as asked.
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)
            # Every worker process is gone: unlink what they created and nobody received.
            for rank in range(self.config.num_workers):
                swept = SegmentRegistry(self._shm_tag(rank)).sweep()
                if swept:
                    log.info("unlinked %d shared-memory segment(s) of worker %d", len(swept), rank)
            self._serve_done.set()

    _ready_info: dict[str, Any]

    async def _stop_actors(self, actors: Any) -> None:
        """Shutdown escalates: ask every worker to stop (tractor's cancel request, 0.5 s ack
        timeout each), wait at most ``close_timeout_s`` for every worker *process* to exit,
        then terminate the ones left (tractor's reap SIGKILLs them 3 s later).

        Waiting for the processes matters: a cancel request a busy worker cannot ack in
        0.5 s comes back False without raising, and tractor's own nursery exit would then
        wait for that process with no deadline."""
        for link in self._links.values():
            link.outbox.close()
        budget = self.config.close_timeout_s
        pids = [link.pid for link in self._links.values()]
        with trio.move_on_after(budget) as scope:
            await actors.cancel()
            async with trio.open_nursery() as waiters:
                for pid in pids:
                    waiters.start_soon(_wait_exited, pid)
        if scope.cancelled_caught:
            log.warning("workers did not stop in %s s; terminating them", budget)
            with trio.move_on_after(5):
                await actors.cancel(hard_kill=True)
                async with trio.open_nursery() as waiters:
                    for pid in pids:
                        waiters.start_soon(_wait_exited, pid)
        for link in self._links.values():
            await link.wait_exit_code(timeout=0.5)

    async def _serve_link(
        self,
        actors: Any,
        rank: int,
        portal: Any,
        *,
        task_status: TaskStatus[_WorkerLink] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        import tractor

        from ..ipc import decode
        from ..worker.tractor_actor import serve_worker

        try:
            async with (
                portal.open_context(
                    serve_worker,
                    config=self._wire_config(),
                    rank=rank,
                    world_size=self.config.num_workers,
                    dist_init_method=self._dist_init_method,
                    shm_tag=self._shm_tag(rank),
                    # Under forkserver the worker's OS parent is the fork server: say who
                    # the engine is, so the worker ends when this process dies.
                    engine_pid=os.getpid(),
                ) as (ctx, started),
                ctx.open_stream() as stream,
            ):
                send, receive = trio.open_memory_channel[bytes](math.inf)
                now = trio.current_time()
                pid = int(started["pid"])
                link = _WorkerLink(rank, pid, send, now, last_progress_at=now)
                link.process = self._find_process(actors, pid)
                if isinstance(link.process, multiprocessing.process.BaseProcess):
                    link.fork_server = _forkserver_pid()
                self._links[rank] = link
                if rank == 0:
                    self._ready_info = started["model_info"]
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._write_link, stream, receive)
                    nursery.start_soon(self._watch_pid, actors, link)
                    task_status.started(link)
                    async for raw in stream:
                        self._on_message(link, decode(raw))
                    if not self._closing:
                        self._fail_group(WorkerError("closed its stream", worker=rank))
                    nursery.cancel_scope.cancel()
        except tractor.RemoteActorError as exc:
            error = self._box_remote(rank, exc)
            if rank not in self._links:
                raise error from None  # startup failure: open_executor raises it
            self._fail_group(error)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.EndOfChannel) as exc:
            if rank not in self._links:
                raise WorkerError(f"lost during startup: {exc!r}", worker=rank) from exc
            self._fail_group(WorkerError(f"link broke: {exc!r}", worker=rank))

    def _box_remote(self, rank: int, exc: Any) -> Exception:
        data = getattr(exc, "msgdata", {}) or {}
        type_str = data.get("type_str", type(exc).__name__)
        tb = data.get("tb_str", "")
        last = tb.strip().splitlines()[-1] if tb.strip() else str(exc)
        message = last.split(": ", 1)[1] if ": " in last else last
        if type_str == "InvalidConfigError":
            return InvalidConfigError(message)
        return WorkerError(message, worker=rank, error_type=type_str, traceback_text=tb)

    async def _write_link(self, stream: Any, receive: trio.MemoryReceiveChannel[bytes]) -> None:
        async with receive:
            async for data in receive:
                await stream.send(data)

    def _on_message(self, link: _WorkerLink, message: dict[str, Any]) -> None:
        op = message.get("op")
        now = trio.current_time()
        steps = message.get("steps")
        if isinstance(steps, int) and steps != link.steps:
            link.steps = steps
            link.last_progress_at = now
        if op == "heartbeat":
            link.last_beat = now
            link.progress = {k: (v[0], v[1]) for k, v in message.get("progress", {}).items()}
        elif op == "reply":
            link.last_beat = now
            waiter = link.pending.pop(message["id"], None)
            if waiter is not None:
                waiter.settle(reply=message)
        elif op == "async":
            link.last_beat = now
            if self._pump_send is not None:
                try:
                    self._pump_send.send_nowait(message["message"])
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    pass

    async def _watch_pid(self, actors: Any, link: _WorkerLink) -> None:
        """Fail the group the moment the worker process exits (tractor would not notice)."""
        await _wait_exited(link.pid)
        code = await link.wait_exit_code()
        if self._closing:
            return
        self._fail_group(
            WorkerError(
                f"process {link.pid} died ({_exit_status(code)})",
                worker=link.rank,
                error_type="WorkerDied",
            )
        )

    @staticmethod
    def _find_process(actors: Any, pid: int) -> Any:
        # tractor keeps its process objects privately (trio.Process or, for the forkserver
        # method, multiprocessing.Process); best effort (exit statuses).
        for entry in getattr(actors, "_children", {}).values():
            proc = entry[1] if len(entry) > 1 else None
            if proc is not None and getattr(proc, "pid", None) == pid:
                return proc
        return None

    async def _monitor_liveness(self) -> None:
        """A worker with no heartbeat for ``worker_heartbeat_timeout_s``, or a call in flight
        with no step progress for ``worker_stall_timeout_s``, is hung: fail closed."""
        beat_timeout = self.config.worker_heartbeat_timeout_s
        stall_timeout = self.config.worker_stall_timeout_s
        while True:
            await trio.sleep(1.0)
            now = trio.current_time()
            for link in self._links.values():
                if now - link.last_beat > beat_timeout:
                    silent = now - link.last_beat
                    self._fail_group(
                        StallError("worker", f"worker {link.rank} silent for {silent:.1f} s")
                    )
                    return
                if (
                    stall_timeout is not None
                    and link.pending
                    and now - link.last_progress_at > stall_timeout
                ):
                    idle = now - link.last_progress_at
                    self._fail_group(
                        StallError("forward", f"worker {link.rank}: no progress in {idle:.1f} s")
                    )
                    return

    async def _stop_on_sigterm(self) -> None:
        """A SIGTERM to the engine's process (``kill <pid>``, systemd, Kubernetes) tears the
        worker group down gracefully (each worker stops its forward at a step boundary and
        exits) and then lets the SIGTERM end the process, instead of the default instant
        death that skips every cleanup.  Installed only while nobody else handles SIGTERM."""
        with trio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                log.warning("SIGTERM: stopping the worker processes, then exiting")
                self._sigterm_received = True
                self._fail_group(EngineDeadError("the engine process received SIGTERM"))
                return

    def _fail_group(self, error: BaseException) -> None:
        """Fail closed: remember why, fail every pending call, tear the group down."""
        if self._closing and self._dead_reason is None:
            return
        self.fail(error)
        for link in self._links.values():
            link.fail_pending(error)
        if self._pump is not None:
            self._pump.fail(error)
        if self._group_scope is not None:
            self._group_scope.cancel()

    async def aclose(self) -> None:
        if self._closing:
            with trio.CancelScope(shield=True):
                await self._serve_done.wait()
            return
        self._closing = True
        self._closed = True
        with trio.CancelScope(shield=True):
            for link in self._links.values():
                link.fail_pending(EngineClosedError("executor is closed"))
            if self._group_scope is not None:
                self._group_scope.cancel()
                await self._serve_done.wait()

    # -- calls --------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._dead_reason is not None or self._closed:
            self.check_health()
        if not self._links:
            raise EngineClosedError("executor is not started")

    async def _call(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        reply_rank: int | None = 0,
        timeout: float | None = None,
        abort_ids: Iterable[str] = (),
    ) -> dict[int, dict[str, Any]]:
        """Send one call to every rank; return each rank's reply (raises if one is missing)."""
        from ..ipc import encode

        self._check_usable()
        call_id = next(self._ids)
        data = encode(
            {
                "op": "call",
                "id": call_id,
                "method": method,
                "args": list(args),
                "kwargs": kwargs or {},
                "reply_rank": reply_rank,
            }
        )
        waiters: dict[int, _Waiter] = {}
        for rank, link in self._links.items():
            waiters[rank] = link.pending[call_id] = _Waiter()
            link.outbox.send_nowait(data)
        try:
            with trio.fail_after(math.inf if timeout is None else timeout):
                for waiter in waiters.values():
                    await waiter.done.wait()
        except trio.TooSlowError:
            raise StallError("rpc", f"{method!r} got no reply within {timeout} s") from None
        except trio.Cancelled:
            ids = list(abort_ids)
            if ids:
                self.abort_requests(ids)
            raise
        finally:
            for link in self._links.values():
                link.pending.pop(call_id, None)
        replies: dict[int, dict[str, Any]] = {}
        for rank, waiter in waiters.items():
            if waiter.error is not None:
                raise waiter.error
            assert waiter.reply is not None
            replies[rank] = waiter.reply
        return replies

    def _shm_tag(self, rank: int) -> str:
        return f"w{rank}{self._tag}"

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        from ..ipc import encode

        ids = list(request_ids)
        if not ids or self._closed:
            return
        data = encode({"op": "abort", "ids": ids})
        for link in self._links.values():
            try:
                link.outbox.send_nowait(data)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass

    def progress(self, request_id: str) -> tuple[int, int] | None:
        link = self._links.get(0)
        return link.progress.get(request_id) if link is not None else None

    def worker_states(self) -> list[WorkerState]:
        base = super().worker_states()
        out = []
        for entry in base:
            link = self._links.get(entry.rank)
            if link is None:
                out.append(entry)
                continue
            state = entry.state
            if link.exit_code is not None and state is WorkerStatus.RUNNING:
                state = WorkerStatus.FAILED
            out.append(WorkerState(entry.rank, state, pid=link.pid, steps=link.steps))
        return out

    def worker_pids(self) -> dict[int, int]:
        """rank -> pid of every worker process."""
        return {rank: link.pid for rank, link in self._links.items()}

    def worker_exit_codes(self) -> dict[int, int | None]:
        """rank -> exit status of each worker process once it exited (0: it stopped when
        asked; negative: killed by that signal), None while it runs or if unknown."""
        return {rank: link.exit_code for rank, link in self._links.items()}

    def worker_steps(self) -> dict[int, int]:
        """rank -> denoising steps that worker has run, as last reported (its latest reply
        or heartbeat): exact for every call that has returned."""
        return {rank: link.steps for rank, link in self._links.items()}
