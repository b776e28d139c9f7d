"""The worker side of the tractor backend: one OS process per worker.

This module is enabled in each worker sub-actor, and tractor imports it in the parent too, so
its top level stays light (no torch): the model is loaded inside :func:`serve_worker`.

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
import traceback
from typing import Any

import tractor
import trio

from .faults import EXIT_CODE, WorkerFatalError, mark_worker_process

__all__ = ["HEARTBEAT_INTERVAL_S", "WORKER_MODULE", "watch_parent_process", "serve_worker"]

log = logging.getLogger(__name__)

WORKER_MODULE = __name__
HEARTBEAT_INTERVAL_S = 1.0


def watch_parent_process() -> None:
    """End this worker the moment the engine process that spawned it dies, so a SIGKILLed
    engine never leaves a worker behind.

    ``PR_SET_PDEATHSIG`` cannot be used: the kernel ties it to the parent *thread*, and trio
    spawns processes from its cached helper threads, which retire after 10 s idle (the worker
    would be killed then).  Instead a daemon thread of this process waits on a pidfd of the
    parent process and calls ``os._exit`` when it becomes readable (the parent exited).
    """
    parent = os.getppid()
    if parent == 1:  # already orphaned
        os._exit(1)
    try:
        fd = os.pidfd_open(parent)
    except (AttributeError, OSError):  # pragma: no cover - not Linux >= 5.3
        return

    def wait_for_parent() -> None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while not poller.poll():
            pass
        os._exit(1)

    threading.Thread(target=wait_for_parent, name="omni-trio-parent-watch", daemon=True).start()


def _in_worker_process() -> bool:
    # tractor runs each sub-actor as ``python -m tractor._child --uid .. --parent_addr ..``
    # (and then swaps ``__main__`` for the parent's); the parent imports this module too,
    # before its runtime says it is the root, and must not watch its own parent.
    return "--parent_addr" in sys.argv and sys.argv[0].endswith(
        os.path.join("tractor", "_child.py")
    )


if _in_worker_process():
    watch_parent_process()


@tractor.context
async def serve_worker(
    ctx: tractor.Context,
    config: dict[str, Any],
    rank: int,
    world_size: int,
    dist_init_method: str | None = None,
    shm_tag: str = "",
) -> None:
    """Load the model, report ready (pid, rank, model info), then serve calls until the
    stream ends or the context is cancelled; the worker is shut down on the way out.

    Shared-memory segments this worker creates are named with ``shm_tag``, so the executor
    can sweep them if the worker dies before their receiver unlinked them.
    """
    import functools
    from dataclasses import asdict

    from .._core.messages import AsyncOutput, AsyncOutputKind
    from ..config import EngineConfig
    from ..executors.worker_thread import WorkerThread
    from ..ipc import Encoder, SegmentRegistry, decode, discard_message
    from .worker import Worker

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
                reply.update(
                    ok=False,
                    error=str(exc) or repr(exc),
                    error_type=type(exc).__name__,
                    traceback="".join(traceback.format_exception(exc)),
                )
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
