"""The tractor backend: one tractor sub-actor (an OS process) per worker, behind a
:class:`~omni_trio.executors.group.Transport` (the group's rules are the
:class:`~omni_trio.executors.group.GroupExecutor`'s).

Shape (see ``notes/tractor-0.1.0a5.md`` for why each piece is there):

- ``open`` opens a tractor nursery on an explicit free registry port (two engines never join
  each other's tree); ``serve_rank`` starts one worker actor and opens ONE ``open_context``
  with a persistent bidirectional stream.  The worker loads its model inside that context
  and reports its pid and model info in ``ctx.started``.
- Each rank's stream has a single reader (every message goes to the executor's ``deliver``:
  its replies to the rank's result pump, its heartbeats to the liveness tracker) and a single
  writer task fed by an unbounded channel, so ``send`` never blocks.  Messages are the typed
  wire messages of :mod:`omni_trio._core.messages`, encoded by :mod:`omni_trio.ipc`.
- tractor 0.1.0a5 never notices a dead child, so ``wait_exited`` watches each worker's pid
  with ``os.pidfd_open`` + ``trio.lowlevel.wait_readable``; ``kill`` is a SIGKILL.
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

import logging
import math
import multiprocessing
import os
import secrets
import signal
import socket
import threading
import warnings
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import trio
import trio.testing

from .._core.messages import WorkerAbort, WorkerCall
from ..config import EngineConfig
from ..errors import EngineDeadError, InvalidConfigError, WorkerError
from ..ipc import SegmentRegistry, owner_tag, sweep_orphans
from ..ipc.handshake import guard_tractor_handshake
from ._main_guard import check_main_guard, main_rerun_failure
from ._process import ForkedProcess, call_import_path
from ._process import runs as _runs
from ._process import wait_exited as _wait_exited
from .group import (
    KILL_WAIT_S,
    STARTED,
    Deliver,
    GroupExecutor,
    RankInit,
    RankStarted,
    RankStatus,
    Transport,
    exit_status,
    is_secret_env_name,
    secrets_hidden,
)

__all__ = [
    "FORKSERVER_PRELOAD",
    "TractorExecutor",
    "TractorTransport",
    "cuda_possible",
    "resolve_start_method",
    "forked_environment",
    "stage_forks",
    "start_fork_server_early",
    "start_forked",
    "warm_fork_server",
]

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


# Device nodes and driver files whose presence means CUDA may be used on this machine.
_CUDA_MARKERS = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia")


def cuda_possible() -> bool:
    """Whether this machine may run CUDA (an NVIDIA driver or device is present), judged
    without importing torch."""
    return any(os.path.exists(path) for path in _CUDA_MARKERS)


def resolve_start_method(method: str, device: str | None) -> str:
    """The start method ``method`` means here: ``"auto"`` is ``"forkserver"`` when the
    engine runs in the main process (the fork server starts only from there) and its
    workers cannot touch CUDA (``device`` ``cpu``, or no device named on a machine without
    an NVIDIA driver: forking a worker next to CUDA is untested), else ``"trio"``.  Any
    other method is itself."""
    if method != "auto":
        return method
    if multiprocessing.current_process().name != "MainProcess":
        return "trio"
    cpu = device is not None and device.split(":", 1)[0] == "cpu"
    if cpu or (device is None and not cuda_possible()):
        return "forkserver"
    return "trio"


def _may_handle_sigterm() -> bool:
    """Only the main thread may take signals, and only if the application has not."""
    return threading.current_thread() is threading.main_thread() and signal.getsignal(
        signal.SIGTERM
    ) in (signal.SIG_DFL, None)


# What the fork server imports once, so that no forked worker pays for it: torch, diffusers
# (with the pipeline, UNet and CLIP modules the built-in and local SD-family models load) and
# our worker and stage code.  "__main__" as in the stdlib default: the engine's main script is run
# (as ``__mp_main__``) once in the fork server instead of once in every worker.  A module
# that is not installed is skipped by the fork server.  None of them starts a thread or
# initialises CUDA at import (a fork server must stay single-threaded and CUDA-free).
FORKSERVER_PRELOAD = (
    "__main__",
    "numpy",
    "torch",
    "omni_trio.models.loading",  # first: it quiets transformers' torchvision advice
    "diffusers",
    "diffusers.pipelines.pipeline_utils",
    "diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion",
    "transformers.models.clip.modeling_clip",
    "omni_trio.ipc",
    "omni_trio.models.pipeline",
    "omni_trio.worker.worker_thread",
    "omni_trio.worker.worker",
    "omni_trio.worker.tractor_actor",
    "omni_trio.runtime.stage_child",  # a stage process of an inproc engine is forked too
)

# What tractor 0.1.0a5's root actor sets PYTHONBREAKPOINT to (tractor/_root.py).
TRACTOR_BREAKPOINT_HOOK = "tractor._debug._set_trace"

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


def stage_forks(config: EngineConfig) -> bool:
    """Whether a stage process of ``config`` (``open_engine(config, stage="process")``) is
    forked from the fork server rather than started as a new interpreter: where its engine
    runs in the stage process itself (the ``inproc`` backend: the stage process is the one
    that runs the model), ``worker_start_method`` means ``forkserver`` here
    (:func:`resolve_start_method`: the main process, no CUDA possible unless asked for) and
    the main module is guarded (the fork server runs it).  A stage process of a tractor or
    Ray engine starts as a new interpreter: its own workers need a main process of their
    own."""
    if config.backend != "inproc":
        return False
    if resolve_start_method(config.worker_start_method, config.device) != "forkserver":
        return False
    try:
        check_main_guard()
    except InvalidConfigError:
        return False
    return True


# Held while the fork server is started (the environment is changed for that moment) and
# while a forked process's environment is taken: both may run in threads at once.
_FORK_SERVER_LOCK = threading.Lock()


def _use_fork_server() -> None:
    """Install tractor's fork server (it replaces the stdlib's; tractor's own start method
    is left as it is) and start it if none runs, with :data:`FORKSERVER_PRELOAD` and the
    environment the engine would give it (secrets hidden, tractor's warning filters and
    breakpoint hook).  Returns at once: the preload runs on in the server."""
    with _FORK_SERVER_LOCK:
        _silence_tractor_warnings()  # the server's environment is every worker's: first
        from multiprocessing import forkserver

        from tractor import _forkserver_override

        _forkserver_override.override_stdlib()
        if _forkserver_pid() is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(list(FORKSERVER_PRELOAD))
        with secrets_hidden(), _tractor_breakpoint_hook():
            forkserver.ensure_running()  # (re)starts it if there is none or it died


def forked_environment() -> dict[str, str]:
    """This process's environment as a process forked now should get it (the fork server's
    is that of when it started): secrets left out, as for workers, and never caught while
    the fork server is being started (the environment is changed for that moment)."""
    with _FORK_SERVER_LOCK:
        return {k: v for k, v in os.environ.items() if not is_secret_env_name(k)}


def start_fork_server_early(config: EngineConfig, stage: str = "inline") -> bool:
    """Start now the fork server that an engine of ``config`` would start when it opens
    (``stage="process"``: that its stage processes are forked from), and return without
    waiting for its preload (:data:`FORKSERVER_PRELOAD`: seconds of import on one core), so
    that the preload overlaps what the caller does before it opens the engine
    (``omni-trio serve`` binds its listener meanwhile); True if it was started here.  Does
    nothing (False) unless the engine would start one itself: inline, the tractor backend
    with workers forked from the fork server (:func:`resolve_start_method`), this the main
    process, the main module guarded and no tractor runtime in this process; as a stage,
    :func:`stage_forks`; never if a fork server runs already, nor where starting it fails
    (the engine then reports that itself).  Blocks for the few milliseconds of spawning a
    process; the server lives as long as this process (the engine's open then only waits
    for its preload)."""
    if stage == "process":
        if not stage_forks(config):
            return False
    elif (
        config.backend != "tractor"
        or multiprocessing.current_process().name != "MainProcess"
        or resolve_start_method(config.worker_start_method, config.device) != "forkserver"
    ):
        return False
    else:
        try:
            check_main_guard()  # the server runs the main module: refused later, one line
        except InvalidConfigError:
            return False
    try:
        _silence_tractor_warnings()  # before the first import of tractor, which warns
        import tractor

        if tractor.current_actor(err_on_no_runtime=False) is not None or _forkserver_pid():
            return False
        _use_fork_server()
    except Exception as exc:  # the engine starts it (or fails to) itself, and says so
        log.debug("fork server not started early: %r", exc)
        return False
    log.debug("fork server started early (pid %s)", _forkserver_pid())
    return True


def warm_fork_server() -> None:
    """Start the fork server if none runs (as :func:`start_fork_server_early` starts it) and
    return once its preload is done: at once when it is.  Blocking, for seconds the first
    time: call it in a thread.  Raises ``OSError``/``EOFError`` if it cannot start."""
    _use_fork_server()
    _ensure_forkserver(list(FORKSERVER_PRELOAD))


def start_forked(target: str, args: tuple[Any, ...], *, name: str) -> ForkedProcess:
    """Fork a process running ``target(*args)`` (``target``: the import path of a function,
    ``"package.module:function"``; ``args`` picklable, no file descriptors: tractor's fork
    server loses them) from the fork server (started first if none runs, as
    :func:`start_fork_server_early` starts it) and return it once it is forked.  It starts
    with multiprocessing's preparation (this process's ``sys.path``, ``sys.argv``, working
    directory and main module; stdin ``/dev/null``), the fork server's environment and
    stdout/stderr.  It is not multiprocessing's to join at exit: the caller owns it.
    Blocking, for as long as the server's preload may still take (seconds): call it in a
    thread.  Raises ``OSError``/``EOFError`` if the fork server cannot start or fork."""
    warm_fork_server()
    context = multiprocessing.get_context("forkserver")
    process = context.Process(target=call_import_path, args=(target, *args), name=name)
    process.start()
    # Not joined at this interpreter's exit (it would wait for a stage that waits for this
    # process's end of its socket to close), nor polled by Process.start()'s cleanup: its
    # exit status is read by ForkedProcess alone.
    multiprocessing.process._children.discard(process)  # type: ignore[attr-defined]
    return ForkedProcess(process)


@contextmanager
def _tractor_breakpoint_hook() -> Iterator[None]:
    """``PYTHONBREAKPOINT`` as tractor's root actor sets it for the process (and so for a
    fork server the engine starts under it), for the block only."""
    before = os.environ.get("PYTHONBREAKPOINT")
    os.environ["PYTHONBREAKPOINT"] = TRACTOR_BREAKPOINT_HOOK
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONBREAKPOINT", None)
        else:
            os.environ["PYTHONBREAKPOINT"] = before


# How long _wait_released waits for the process to go idle once tractor let go of a channel.
_SETTLE_S = 0.2


async def _wait_released(channel: Any) -> None:
    """Until tractor's runtime has let go of ``channel``: it no longer lists it among its
    peers' channels and its handler of the channel has ended."""
    import tractor

    runtime = tractor.current_actor(err_on_no_runtime=False)
    peers = getattr(runtime, "_peers", None)
    if peers is None:  # pragma: no cover - tractor without the (private) peer table
        return
    # tractor signals no event per channel: poll its table (bounded by the caller).
    while channel in peers.get(channel.uid, ()):  # noqa: ASYNC110
        await trio.sleep(0.005)
    # The handler lets go of the channel and then sends it a last message, which needs a
    # few checkpoints: let every runnable task run.  A busy process may never be idle: then
    # go on after a moment (the backstop in ``open`` covers the race that is left).
    with trio.move_on_after(_SETTLE_S):
        await trio.testing.wait_all_tasks_blocked()


def _exit_code_of(process: Any) -> int | None:
    """The exit status tractor's process object knows (trio.Process or, under forkserver, a
    multiprocessing.Process), if any."""
    try:
        code = process.poll() if hasattr(process, "poll") else process.exitcode
    except (ValueError, OSError):
        return None
    return code if isinstance(code, int) else None


@dataclass(eq=False)
class _WorkerLink:
    """The transport's side of one worker: its pid, outbox and process."""

    rank: int
    pid: int
    outbox: trio.MemorySendChannel[bytes]
    # Set by kill(): the worker is being SIGKILLed, never asked.
    killed: bool = False
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


class TractorTransport(Transport):
    """Worker processes under one tractor nursery; see the module docstring.

    One per process at a time: tractor 0.1.0a5 keeps a single runtime (root actor) per
    process in a module global, and it lives inside the ``open_nursery`` of whichever
    executor opened it.  A second one would silently nest in that runtime and lose its
    workers' channels when the first engine closes, so ``open`` refuses it with
    :class:`InvalidConfigError` instead.  (An application that is itself a tractor actor is
    different: its runtime outlives the engine, so the workers nest in it.)
    """

    # The transport whose ``open`` opened this process's tractor runtime, if any.  Class
    # state because tractor's runtime is process state.
    _runtime_owner: ClassVar[TractorTransport | None] = None

    def __init__(self) -> None:
        self._links: dict[int, _WorkerLink] = {}
        self._actors: Any = None
        self._tag = secrets.token_hex(3)
        # The engine process owns its workers' segments: a SIGKILLed engine's leftovers are
        # found by this tag and swept by the next start (sweep_orphans).
        self._owner = owner_tag()
        # What the engine sends (a request's big picture) goes by shared memory under a tag
        # of its own, so what a worker never decoded (it died first) is swept with the group.
        self._encoder: Any = None
        # This group's own tractor registry (arbiter) address, chosen when ``open`` starts:
        # a free loopback port, never tractor's global default 1616, so two engines in one
        # host (or one process) never join each other's tree.
        self.registry_addr: tuple[str, int] | None = None
        self._sigterm_received = False
        self._world_size = 0

    def shm_tag(self, rank: int) -> str:
        return f"{self._owner}w{rank}{self._tag}"

    @property
    def sent_shm_tag(self) -> str:
        """The tag of the segments the engine creates for what it sends to the workers."""
        return f"{self._owner}e{self._tag}"

    @asynccontextmanager
    async def open(
        self, config: EngineConfig, fail: Callable[[BaseException], None]
    ) -> AsyncIterator[None]:
        # Every worker runs the main module again: a script without a __name__ guard
        # would open engines inside them.  Refused before anything is spawned.
        check_main_guard()
        _silence_tractor_warnings()  # before the first import of tractor, which warns
        import tractor

        # Only this group's processes may connect to its ports (junk is dropped).
        guard_tractor_handshake()
        self._world_size = config.num_workers
        start_method = resolve_start_method(config.worker_start_method, config.device)
        if config.worker_start_method == "auto":
            log.info("worker_start_method auto: %s", start_method)
        # What engines that died without cleaning up (SIGKILL, OOM) left in /dev/shm.
        orphans = sweep_orphans()
        if orphans:
            log.warning("unlinked %d shared-memory segment(s) of dead engines", len(orphans))
        if start_method == "forkserver" and multiprocessing.current_process().name != "MainProcess":
            # tractor 0.1.0a5 starts its fork server only from the main process.
            raise InvalidConfigError(
                "worker_start_method='forkserver' needs the engine in the main process, not "
                f"in the multiprocessing child {multiprocessing.current_process().name!r}",
                field="worker_start_method",
            )
        runtime = tractor.current_actor(err_on_no_runtime=False)
        if runtime is None:
            # We open the process's tractor runtime: it lives exactly as long as this group.
            TractorTransport._runtime_owner = self
            self.registry_addr = ("127.0.0.1", _free_port())
        elif TractorTransport._runtime_owner is not None:
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
            # The start method is process-wide tractor state: select it explicitly every
            # time (a forkserver engine earlier in this process must not leave it set).  An
            # application's own runtime keeps the method it chose.
            nursery_options: dict[str, Any] = (
                {"start_method": start_method} if runtime is None else {}
            )
            async with tractor.open_nursery(
                arbiter_addr=self.registry_addr, loglevel="critical", **nursery_options
            ) as actors:
                self._actors = actors
                try:
                    await self._warm_fork_server(start_method)
                    async with trio.open_nursery() as tasks:
                        if _may_handle_sigterm():
                            tasks.start_soon(self._stop_on_sigterm, fail)
                        yield
                        tasks.cancel_scope.cancel()
                finally:
                    with trio.CancelScope(shield=True):
                        # Every rank is stopped or killed by now; let tractor reap them.
                        for link in self._links.values():
                            link.outbox.close()
                        with trio.move_on_after(5):
                            await actors.cancel(hard_kill=True)
        except trio.ClosedResourceError as exc:
            # A backstop for a tractor race on a SIGKILLed worker's channel (see
            # _wait_released): the group's failure is already recorded; this is not it.
            if not any(link.killed for link in self._links.values()):
                raise
            log.debug("tractor's runtime raised on a killed worker's channel: %r", exc)
        except BaseException as exc:
            # A worker that failed while re-running the main module (tractor adds its error
            # to the start failure): one line saying what to add instead of the whole tree.
            guard = main_rerun_failure(exc)
            if guard is None:
                raise
            raise guard from None
        finally:
            if TractorTransport._runtime_owner is self:
                TractorTransport._runtime_owner = None
            # Every worker process is gone: unlink what they created and nobody received,
            # and what this engine sent them that they never decoded.
            for rank in range(self._world_size):
                swept = SegmentRegistry(self.shm_tag(rank)).sweep()
                if swept:
                    log.info("unlinked %d shared-memory segment(s) of worker %d", len(swept), rank)
            unread = SegmentRegistry(self.sent_shm_tag).sweep()
            if unread:
                log.info("unlinked %d shared-memory segment(s) sent and never read", len(unread))
            if self._sigterm_received:
                # The workers are down and their segments gone; now die of the SIGTERM.
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

    async def _warm_fork_server(self, start_method: str) -> None:
        from tractor import _spawn

        if _spawn._spawn_method == "forkserver":
            # After tractor selected the method (it replaced the stdlib's fork server with
            # its own); the env (PYTHONWARNINGS above) is frozen now.
            try:
                # The fork server's environment is every forked worker's: no secrets.
                with secrets_hidden():
                    await trio.to_thread.run_sync(_ensure_forkserver, list(FORKSERVER_PRELOAD))
            except (OSError, EOFError) as exc:
                raise WorkerError(
                    f"the fork server did not start: {exc!r}", error_type="ForkServerError"
                ) from exc
        elif start_method != "trio":
            log.warning(
                "worker_start_method=%r ignored: the application's tractor runtime spawns with %r",
                start_method,
                _spawn._spawn_method,
            )

    async def _stop_on_sigterm(self, fail: Callable[[BaseException], None]) -> None:
        """A SIGTERM to the engine's process (``kill <pid>``, systemd, Kubernetes) tears the
        worker group down and then lets the SIGTERM end the process, instead of the default
        instant death that skips every cleanup.  Installed only while nobody else handles
        SIGTERM."""
        with trio.open_signal_receiver(signal.SIGTERM) as signals:
            async for _ in signals:
                log.warning("SIGTERM: stopping the worker processes, then exiting")
                self._sigterm_received = True
                fail(EngineDeadError("the engine process received SIGTERM"))
                return

    async def serve_rank(
        self, init: RankInit, deliver: Deliver, *, task_status: RankStatus = STARTED
    ) -> None:
        import tractor

        from ..worker.tractor_actor import WORKER_MODULE

        rank = init.rank
        ready = trio.Event()
        try:
            # A worker inherits the engine's environment, secrets excepted (the API key, hub
            # tokens): hidden while it is spawned.
            with secrets_hidden():
                portal = await self._actors.start_actor(
                    f"omni-trio-worker-{rank}-{self._tag}", enable_modules=[WORKER_MODULE]
                )
            # Watched from the moment it is spawned: a worker that dies while it loads the
            # model (an OOM kill) fails the start instead of leaving it waiting for ever.
            spawned = self._process_of(portal)
            died: list[int | None] = []
            async with trio.open_nursery() as tasks:
                with trio.CancelScope() as start_scope:
                    if spawned is not None:
                        tasks.start_soon(self._watch_start, spawned, ready, died, start_scope)
                    await self._serve_spawned(init, portal, deliver, task_status, ready)
                ready.set()  # ends the start watch
            if died:
                raise WorkerError(
                    f"process {spawned.pid} died while starting ({exit_status(died[0])})",
                    worker=rank,
                    error_type="WorkerDied",
                )
        except tractor.RemoteActorError as exc:
            raise self._box_remote(rank, exc) from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.EndOfChannel) as exc:
            what = "link broke" if ready.is_set() else "lost during startup"
            raise WorkerError(f"{what}: {exc!r}", worker=rank) from exc

    @staticmethod
    async def _watch_start(
        process: Any, ready: trio.Event, died: list[int | None], start_scope: trio.CancelScope
    ) -> None:
        """Until the worker is ready: if its process exits first, note the exit status and
        cancel the start (``start_scope``)."""
        async with trio.open_nursery() as race:

            async def exited() -> None:
                await _wait_exited(process.pid)
                if not ready.is_set():
                    died.append(_exit_code_of(process))
                    start_scope.cancel()
                race.cancel_scope.cancel()

            async def became_ready() -> None:
                await ready.wait()
                race.cancel_scope.cancel()

            race.start_soon(exited)
            race.start_soon(became_ready)

    def _process_of(self, portal: Any) -> Any:
        """tractor's (private) process object of the worker behind ``portal``, if found."""
        for entry in getattr(self._actors, "_children", {}).values():
            if len(entry) > 2 and entry[2] is portal and getattr(entry[1], "pid", None):
                return entry[1]
        return None

    async def _serve_spawned(
        self,
        init: RankInit,
        portal: Any,
        deliver: Deliver,
        task_status: RankStatus,
        ready: trio.Event,
    ) -> None:
        """A spawned worker's life: open its context (it loads the model and answers
        ``started``), report the rank started (``ready``), then deliver what it sends until
        its stream ends."""
        from ..worker.tractor_actor import serve_worker

        rank = init.rank
        async with portal.open_context(
            serve_worker,
            config=dict(init.config),
            rank=rank,
            world_size=init.world_size,
            dist_init_method=init.dist_init_method,
            shm_tag=self.shm_tag(rank),
            # Under forkserver the worker's OS parent is the fork server: say who the
            # engine is, so the worker ends when this process dies.
            engine_pid=os.getpid(),
            data_parallel_size=init.data_parallel_size,
        ) as (ctx, started):
            refused = started.get("refused")
            if refused is not None:  # the worker refused the configuration, and ended
                raise InvalidConfigError(str(refused["message"]), field=refused.get("field"))
            async with ctx.open_stream() as stream:
                await self._serve_stream(rank, portal, stream, started, deliver, task_status, ready)

    async def _serve_stream(
        self,
        rank: int,
        portal: Any,
        stream: Any,
        started: dict[str, Any],
        deliver: Deliver,
        task_status: RankStatus,
        ready: trio.Event,
    ) -> None:
        """A started worker's stream: report the rank started, then deliver what it sends
        until the stream ends."""
        from ..ipc import decode

        send, receive = trio.open_memory_channel[bytes](math.inf)
        pid = int(started["pid"])
        link = _WorkerLink(rank, pid, send)
        link.process = self._find_process(pid)
        if isinstance(link.process, multiprocessing.process.BaseProcess):
            link.fork_server = _forkserver_pid()
        self._links[rank] = link
        ready.set()  # from here on the executor's exit watch reports a death
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_link, stream, receive)
                task_status.started(RankStarted(pid, started["model_info"]))
                async for raw in stream:
                    deliver(decode(raw))
                nursery.cancel_scope.cancel()
        finally:
            if link.killed:
                # tractor would ask the dead worker to cancel its context and wait 0.5 s
                # for an answer that cannot come; a closed channel skips it.  Close it
                # only once tractor's own handler of the channel has seen the EOF and
                # let go of it: closing under that handler's final send raises
                # ClosedResourceError out of tractor's root nursery.
                with trio.CancelScope(shield=True), trio.move_on_after(KILL_WAIT_S):
                    await _wait_exited(pid)
                    await _wait_released(portal.channel)
                    await portal.channel.aclose()

    @staticmethod
    def _box_remote(rank: int, exc: Any) -> Exception:
        guard = main_rerun_failure(exc)
        if guard is not None:
            return guard
        data = getattr(exc, "msgdata", {}) or {}
        type_str = data.get("type_str", type(exc).__name__)
        tb = data.get("tb_str", "")
        last = tb.strip().splitlines()[-1] if tb.strip() else str(exc)
        message = last.split(": ", 1)[1] if ": " in last else last
        if type_str == "InvalidConfigError":
            return InvalidConfigError(message)
        return WorkerError(message, worker=rank, error_type=type_str, traceback_text=tb)

    async def _write_link(self, stream: Any, receive: trio.MemoryReceiveChannel[bytes]) -> None:
        try:
            async for data in receive:
                await stream.send(data)
        finally:
            # What was queued for a worker that is gone is never decoded: release it.
            self._discard_queued(receive)
            receive.close()

    def _discard_queued(self, receive: trio.MemoryReceiveChannel[bytes]) -> None:
        from ..ipc import discard_message

        registry = self._encoder.registry if self._encoder is not None else None
        while True:
            try:
                data = receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
            discard_message(data, registry=registry)

    def _find_process(self, pid: int) -> Any:
        # tractor keeps its process objects privately (trio.Process or, for the forkserver
        # method, multiprocessing.Process); best effort (exit statuses).
        for entry in getattr(self._actors, "_children", {}).values():
            proc = entry[1] if len(entry) > 1 else None
            if proc is not None and getattr(proc, "pid", None) == pid:
                return proc
        return None

    async def replace_ranks(self, ranks: Sequence[int]) -> None:
        """The processes of ``ranks`` are gone (a data-parallel group restarting alone):
        forget their links (a kill before the new process reports signals nothing), and
        unlink the segments they created that nobody will receive."""
        for rank in ranks:
            link = self._links.pop(rank, None)
            if link is not None:
                link.outbox.close()
            swept = SegmentRegistry(self.shm_tag(rank)).sweep()
            if swept:
                log.info("unlinked %d shared-memory segment(s) of worker %d", len(swept), rank)

    def send(self, rank: int, message: WorkerCall | WorkerAbort) -> None:
        from ..ipc import Encoder, discard_message

        link = self._links.get(rank)
        if link is None:
            return
        if self._encoder is None:
            self._encoder = Encoder(registry=SegmentRegistry(self.sent_shm_tag))
        data = self._encoder.encode(message)
        try:
            link.outbox.send_nowait(data)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            # Never sent: nobody will decode (and unlink) it.
            discard_message(data, registry=self._encoder.registry)

    def kill(self, rank: int) -> None:
        link = self._links.get(rank)
        if link is not None:
            link.killed = True
        self._signal(rank, signal.SIGKILL)

    def terminate(self, rank: int) -> None:
        self._signal(rank, signal.SIGTERM)

    def _signal(self, rank: int, sig: signal.Signals) -> None:
        link = self._links.get(rank)
        if link is None:
            return
        try:
            os.kill(link.pid, sig)
        except ProcessLookupError:
            pass

    async def wait_exited(self, rank: int) -> int | None:
        link = self._links[rank]
        await _wait_exited(link.pid)
        return await link.wait_exit_code()

    async def stop(self, ranks: Sequence[int]) -> None:
        """Close each worker's stream and send tractor's cancel request: each worker stops
        its forward at a step boundary and shuts down."""
        for rank in ranks:
            link = self._links.get(rank)
            if link is not None:
                link.outbox.close()
        await self._actors.cancel()


class TractorExecutor(GroupExecutor):
    """Backend ``"tractor"``: ``num_workers`` worker processes under one tractor nursery.
    One per process at a time (see :class:`TractorTransport`)."""

    one_per_process = True
    transport: TractorTransport

    def make_transport(self) -> TractorTransport:
        return TractorTransport()

    @property
    def registry_addr(self) -> tuple[str, int] | None:
        """This group's own tractor registry address (a free loopback port)."""
        return self.transport.registry_addr
