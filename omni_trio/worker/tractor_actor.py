"""The worker side of the tractor backend: one OS process per worker.

This module is enabled in each worker sub-actor, and tractor imports it in the parent too, so
its top level stays light (no torch): the model is loaded inside :func:`serve_worker`.  With
the ``forkserver`` start method the fork server preloads it (and torch), so its import must
also start no thread outside a worker.

Every worker ends the moment the engine process dies (:func:`watch_parent_process`), armed as
early as the start method allows: at import in a ``trio`` worker, by an after-fork hook in a
``forkserver`` worker, and in any case by ``serve_worker(engine_pid=...)``.

Over one persistent ``open_context`` stream, each direction carries the typed messages of
:mod:`omni_trio._core.messages`, encoded to bytes by :mod:`omni_trio.ipc`, around one
:class:`~omni_trio.worker.host.WorkerHost` (which says what each message does):

- executor -> worker: :class:`~omni_trio._core.messages.WorkerCall` (run in the worker's own
  thread, one at a time, in order) and :class:`~omni_trio._core.messages.WorkerAbort` (at
  once, even while a forward runs);
- worker -> executor: one :class:`~omni_trio._core.messages.AsyncOutput` reply per call,
  the output packer's ``OUTPUT_READY`` messages, and a
  :class:`~omni_trio._core.messages.Heartbeat` whenever
  :meth:`~omni_trio.worker.host.WorkerHost.heartbeat_due` says.

A call that raises :class:`~omni_trio.worker.faults.WorkerFatalError` gets a ``fatal``
reply (see :mod:`omni_trio.worker.host`); injected crash faults end the process themselves
(see :mod:`omni_trio.worker.faults`).
"""

from __future__ import annotations

import logging
import math
import os
import select
import sys
import threading
import time
from multiprocessing import util as multiprocessing_util
from typing import Any

import tractor
import trio

from ..ipc.handshake import guard_tractor_handshake
from .faults import mark_worker_process

__all__ = ["WORKER_MODULE", "watch_parent_process", "serve_worker"]

log = logging.getLogger(__name__)

WORKER_MODULE = __name__

# A worker imports this module right after it dialled its parent, before anything else can
# reach it: from then on only its group's processes may connect to its port.
guard_tractor_handshake()


# The engine process this worker watches (see :func:`watch_parent_process`), once armed.
_watched_engine: int | None = None


def watch_parent_process(engine_pid: int | None = None) -> None:
    """End this worker the moment the engine process that started it dies, so a SIGKILLed
    engine never leaves a worker behind.  ``engine_pid`` defaults to the OS parent, which is
    the engine only with tractor's ``trio`` start method: a ``forkserver`` worker is a child
    of the fork server, so the engine passes its pid explicitly (``serve_worker``'s
    ``engine_pid``).  Idempotent: the first call arms the watch, later ones do nothing.

    ``PR_SET_PDEATHSIG`` cannot be used: the kernel ties it to the parent *thread*, and trio
    spawns processes from its cached helper threads, which retire after 10 s idle (the worker
    would be killed then); under forkserver the parent is not even the engine.  Instead a
    daemon thread of this process waits on a pidfd of the engine process and calls
    ``os._exit`` when it becomes readable (the engine exited).  A pidfd works for any pid,
    not only the parent's.
    """
    global _watched_engine
    if _watched_engine is not None:
        return
    pid = os.getppid() if engine_pid is None else engine_pid
    if pid == 1:  # already orphaned
        os._exit(1)
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # the engine is already gone
        os._exit(1)
    except (AttributeError, OSError):  # pragma: no cover - not Linux >= 5.3
        return
    _watched_engine = pid

    def wait_for_parent() -> None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while not poller.poll():
            pass
        os._exit(1)

    threading.Thread(target=wait_for_parent, name="omni-trio-parent-watch", daemon=True).start()


def _in_worker_process() -> bool:
    """This process is a worker sub-actor started with tractor's ``trio`` method.

    tractor runs each such sub-actor as ``python -m tractor._child --uid .. --parent_addr ..``
    (and then swaps ``__main__`` for the parent's); the parent imports this module too,
    before its runtime says it is the root, and must not watch its own parent.  (A
    ``forkserver`` worker has the engine's argv and the fork server as its OS parent: it is
    armed by :func:`_arm_forked_worker` and by ``serve_worker`` instead.)
    """
    return "--parent_addr" in sys.argv and sys.argv[0].endswith(
        os.path.join("tractor", "_child.py")
    )


def _engine_pid_of_forked_worker() -> int | None:
    """In a process that ``multiprocessing`` (tractor's ``forkserver`` method) is starting
    as a tractor actor serving this module: the pid of the process that created it (the
    engine; pickled with the process object), else None."""
    import multiprocessing

    process = multiprocessing.current_process()
    target = getattr(process, "_target", None)
    args = getattr(process, "_args", ())
    if getattr(target, "__qualname__", None) != "_mp_main" or not args:
        return None
    if getattr(target, "__module__", None) != "tractor._entry":
        return None
    if WORKER_MODULE not in (getattr(args[0], "enable_modules", None) or ()):
        return None
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None else None


def _arm_forked_worker(_: object) -> None:
    """``multiprocessing`` after-fork hook: a forkserver child that is about to become one
    of our workers watches the engine from its first instant, before tractor's runtime (or
    ``serve_worker``) runs.  Registered where this module is imported; it matters in the
    fork server, which preloads this module, and does nothing in any other child."""
    pid = _engine_pid_of_forked_worker()
    if pid is not None:
        watch_parent_process(pid)


class _AfterForkToken:
    """A weak-referenceable owner for the after-fork hook (multiprocessing keeps it weakly)."""


_AFTER_FORK_TOKEN = _AfterForkToken()
multiprocessing_util.register_after_fork(_AFTER_FORK_TOKEN, _arm_forked_worker)

if _in_worker_process():
    watch_parent_process()
else:
    # A forkserver worker whose fork server did not preload this module imports it here.
    _arm_forked_worker(None)


@tractor.context
async def serve_worker(
    ctx: tractor.Context,
    config: dict[str, Any],
    rank: int,
    world_size: int,
    dist_init_method: str | None = None,
    shm_tag: str = "",
    engine_pid: int | None = None,
    data_parallel_size: int = 1,
) -> None:
    """Load the model, report ready (pid and model info), then serve the executor's
    messages until the stream ends or the context is cancelled; the worker is shut down on
    the way out (its forwards stopped at their next step, at most ``close_timeout_s``).

    Shared-memory segments this worker creates are named with ``shm_tag``, so the executor
    can sweep them if the worker dies before their receiver unlinked them.  ``engine_pid``
    is the engine's process: this worker ends when it dies (None: the OS parent, right only
    for tractor's ``trio`` start method).
    """
    from .._core.messages import AsyncOutput, WorkerAbort, WorkerCall
    from ..config import EngineConfig
    from ..errors import InvalidConfigError
    from ..ipc import Encoder, SegmentRegistry, decode, discard_message
    from .host import HEARTBEAT_CHECK_S, WorkerHost
    from .worker import Worker
    from .worker_thread import WorkerThread

    # First of all: never outlive the engine (a no-op where the watch is already armed).
    watch_parent_process(engine_pid)
    mark_worker_process()  # injected crash faults end this process, not just a call
    engine_config = EngineConfig.from_dict(config)
    registry = SegmentRegistry(shm_tag)
    # One encoder per thread that encodes: this trio thread and the output packer's.
    encoder = Encoder(registry=registry)
    packer_encoder = Encoder(registry=registry)
    outbox, outgoing = trio.open_memory_channel[bytes](math.inf)
    token = trio.lowlevel.current_trio_token()

    def post(data: bytes) -> None:
        """Queue encoded bytes for the writer task (trio thread).  Bytes that can no longer
        be sent have their shared memory unlinked."""
        try:
            outbox.send_nowait(data)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            discard_message(data, registry=registry)

    def post_output(message: AsyncOutput) -> None:
        """An ``OUTPUT_READY``, from the packer's thread.  Raises if it cannot be queued
        (the packer then reports itself dead: the group fails at once)."""
        data = packer_encoder.encode(message)
        try:
            token.run_sync_soon(post, data)
        except trio.RunFinishedError:
            discard_message(data, registry=registry)
            raise

    thread = WorkerThread(f"omni-trio-worker-{rank}", stall_timeout_s=engine_config.close_timeout_s)
    thread.start()
    worker = Worker(
        engine_config,
        rank=rank,
        world_size=world_size,
        dist_init_method=dist_init_method,
        data_parallel_size=data_parallel_size,
    )
    host = WorkerHost(worker, post_output)
    try:
        try:
            info = await thread.run(host.start)
        except InvalidConfigError as exc:
            # Refused: say so in the handshake, with the field (a remote error would carry
            # only its text), and end.
            await ctx.started({"refused": {"message": str(exc), "field": exc.field}})
            return
        await ctx.started({"pid": os.getpid(), "model_info": info.to_dict()})

        async def write(stream: Any) -> None:
            try:
                async for data in outgoing:
                    await stream.send(data)
            finally:
                # Unsent messages may name shared memory: unlink it (the executor also
                # sweeps this worker's tag when the group ends).
                outgoing.close()
                while True:
                    try:
                        discard_message(outgoing.receive_nowait(), registry=registry)
                    except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                        break

        async def run_call(call: WorkerCall) -> None:
            # Cancelled only when this worker is being shut down (the executor closed):
            # stop the forward at its next step instead of running it to the end while
            # the shutdown waits behind it.
            reply = await thread.run(
                lambda: host.call(call), on_cancel=worker.stop_flags.stop_everything
            )
            post(encoder.encode(reply))

        async def heartbeat() -> None:
            while True:
                now = time.monotonic()
                if host.heartbeat_due(now):
                    post(encoder.encode(host.heartbeat(now)))
                await trio.sleep(HEARTBEAT_CHECK_S)

        async with ctx.open_stream() as stream, trio.open_nursery() as nursery:
            nursery.start_soon(write, stream)
            nursery.start_soon(heartbeat)
            async for raw in stream:
                message = decode(raw)
                if isinstance(message, WorkerAbort):
                    host.abort(message)
                elif isinstance(message, WorkerCall):
                    host.received(message)
                    nursery.start_soon(run_call, message)
                else:
                    log.error("worker %d: unexpected message %r", rank, type(message).__name__)
            nursery.cancel_scope.cancel()
    finally:
        outbox.close()
        with trio.CancelScope(shield=True):
            worker.stop_flags.stop_everything()
            if thread.alive:
                with trio.move_on_after(engine_config.close_timeout_s):
                    try:
                        await thread.run(host.shutdown, abandon_on_cancel=True)
                    except Exception:
                        log.exception("worker %d shutdown failed", rank)
            await thread.stop()
