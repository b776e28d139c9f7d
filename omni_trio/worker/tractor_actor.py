"""The worker side of the tractor backend: one OS process per worker.

This module is enabled in each worker sub-actor, and tractor imports it in the parent too, so
its top level stays light (no torch): the model is loaded inside :func:`serve_worker`.  With
the ``forkserver`` start method the fork server preloads it (and torch), so its import must
also start no thread outside a worker.

Every worker ends the moment the engine process dies (:func:`watch_parent_process`), armed as
early as the start method allows: at import in a ``trio`` worker, by an after-fork hook in a
``forkserver`` worker, and in any case by ``serve_worker(engine_pid=...)``.

Protocol over one persistent ``open_context`` stream (bytes encoded by ``omni_trio.ipc``):

- executor -> worker: ``{"op": "call", "id", "method", "args", "kwargs"}`` runs a worker
  method in the worker's own thread (calls run one at a time, in order);
  ``{"op": "abort", "ids"}`` sets stop flags at once, even while a forward runs.
- worker -> executor: ``{"op": "reply", "id", "rank", "steps", "ok", "result" | "error",
  "error_type", "traceback"}`` for every call (ranks other than the output rank reply
  with ``result=None``); ``{"op": "heartbeat", "rank", "steps", "progress"}`` every second.
  ``steps`` counts the denoising steps this worker has run so far (progress-aware
  liveness); a reply carries the count as of the end of its call, so it is exact for every
  call that returned before it.

A call that raises :class:`~omni_trio.worker.faults.WorkerFatalError` gets no reply: the
worker process ends with :data:`~omni_trio.worker.faults.EXIT_CODE`, so the executor sees a
dead worker, as for any crash (injected crash faults end the process themselves, see
:mod:`omni_trio.worker.faults`).
"""

from __future__ import annotations

import logging
import math
import os
import select
import sys
import threading
from multiprocessing import util as multiprocessing_util
from typing import Any

import tractor
import trio

from .faults import EXIT_CODE, WorkerFatalError, mark_worker_process
from .replies import failure_fields

__all__ = ["HEARTBEAT_INTERVAL_S", "WORKER_MODULE", "watch_parent_process", "serve_worker"]

log = logging.getLogger(__name__)

WORKER_MODULE = __name__
HEARTBEAT_INTERVAL_S = 1.0


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
) -> None:
    """Load the model, report ready (pid, rank, model info), then serve calls until the
    stream ends or the context is cancelled; the worker is shut down on the way out.

    Shared-memory segments this worker creates are named with ``shm_tag``, so the executor
    can sweep them if the worker dies before their receiver unlinked them.  ``engine_pid``
    is the engine's process: this worker ends when it dies (None: the OS parent, right only
    for tractor's ``trio`` start method).
    """
    import functools
    from dataclasses import asdict

    from .._core.messages import AsyncOutput, AsyncOutputKind
    from ..config import EngineConfig
    from ..ipc import Encoder, SegmentRegistry, decode, discard_message
    from .worker import Worker
    from .worker_thread import WorkerThread

    # First of all: never outlive the engine (a no-op where the watch is already armed).
    watch_parent_process(engine_pid)
    mark_worker_process()  # injected crash faults end this process, not just a call
    engine_config = EngineConfig.from_dict(config)
    thread = WorkerThread(f"omni-trio-worker-{rank}", stall_timeout_s=engine_config.close_timeout_s)
    thread.start()
    worker = Worker(
        engine_config, rank=rank, world_size=world_size, dist_init_method=dist_init_method
    )
    try:
        await thread.run(worker.init_device)
        info = await thread.run(worker.load_model)
        registry = SegmentRegistry(shm_tag)
        # One encoder per thread that encodes: this trio thread and the output packer's.
        encoder = Encoder(registry=registry)
        packer_encoder = Encoder(registry=registry)
        outbox, outgoing = trio.open_memory_channel[bytes](math.inf)
        token = trio.lowlevel.current_trio_token()

        def post(data: bytes) -> None:
            """Queue encoded bytes for the writer task; from any thread.  Bytes that can no
            longer be sent have their shared memory unlinked."""
            try:
                outbox.send_nowait(data)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                discard_message(data, registry=registry)

        def post_output(message: AsyncOutput) -> None:
            # Called in the packer thread.  The call's own reply is this backend's
            # COMPUTE_DONE, so only OUTPUT_READY travels.
            if message.kind is not AsyncOutputKind.OUTPUT_READY:
                return
            data = packer_encoder.encode({"op": "async", "message": message})
            try:
                token.run_sync_soon(post, data)
            except trio.RunFinishedError:
                discard_message(data, registry=registry)

        if engine_config.async_output and not engine_config.step_execution:
            await thread.run(functools.partial(worker.start_output_packer, post_output))
        await ctx.started({"pid": os.getpid(), "rank": rank, "model_info": asdict(info)})

        async def send(stream: Any, message: dict[str, Any]) -> None:
            post(encoder.encode(message))

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

        async def run_call(stream: Any, message: dict[str, Any]) -> None:
            reply: dict[str, Any] = {"op": "reply", "id": message["id"], "rank": rank}
            reply_rank = message.get("reply_rank", 0)
            try:
                # Cancelled only when this worker is being shut down (the executor closed, or
                # the group failed): stop the forward at its next step instead of running it
                # to the end while the shutdown waits behind it.
                result = await thread.run(
                    lambda: worker.execute_method(
                        message["method"], *message.get("args", ()), **message.get("kwargs", {})
                    ),
                    on_cancel=worker.stop_flags.stop_everything,
                )
                # Only the output rank ships its result; the others just say they are done.
                reply.update(ok=True, result=result if reply_rank in (None, rank) else None)
            except WorkerFatalError:
                # The worker itself is broken: die like a crashed worker instead of
                # answering, so the executor fails closed through its dead-worker path.
                log.critical(
                    "worker %d: fatal error in %r; ending the process",
                    rank,
                    message["method"],
                    exc_info=True,
                )
                os._exit(EXIT_CODE)
            except Exception as exc:
                reply.update(failure_fields(exc))
            reply["steps"] = worker.steps_done
            await send(stream, reply)

        async def heartbeat(stream: Any) -> None:
            while True:
                beat = {
                    "op": "heartbeat",
                    "rank": rank,
                    "steps": worker.steps_done,
                    "progress": {k: list(v) for k, v in worker.progress.items()},
                }
                await send(stream, beat)
                await trio.sleep(HEARTBEAT_INTERVAL_S)

        async with ctx.open_stream() as stream, trio.open_nursery() as nursery:
            nursery.start_soon(write, stream)
            nursery.start_soon(heartbeat, stream)
            async for raw in stream:
                message = decode(raw)
                op = message.get("op")
                if op == "abort":
                    worker.stop_flags.abort(message["ids"])
                elif op == "call":
                    nursery.start_soon(run_call, stream, message)
                elif op == "shutdown":
                    break
            nursery.cancel_scope.cancel()
    finally:
        if "outbox" in locals():
            outbox.close()
        with trio.CancelScope(shield=True):
            worker.stop_flags.stop_everything()
            if thread.alive:
                with trio.move_on_after(engine_config.close_timeout_s):
                    try:
                        await thread.run(worker.shutdown, abandon_on_cancel=True)
                    except Exception:
                        log.exception("worker %d shutdown failed", rank)
            await thread.stop()
