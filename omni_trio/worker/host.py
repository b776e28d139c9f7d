"""The worker side of every process backend: one rank's calls, aborts, heartbeats and outputs.

Both worker shims (tractor's :func:`~omni_trio.worker.tractor_actor.serve_worker`, Ray's
:class:`~omni_trio.worker.ray_actor.RayWorker`) put their transport around one
:class:`WorkerHost`, so a rank behaves the same whatever carries its messages (the protocol
is in :mod:`omni_trio._core.messages`):

- a :class:`~omni_trio._core.messages.WorkerCall` runs in the worker's own thread, one at a
  time, and gets exactly one reply (:func:`handle_call`): ``RPC_RESULT``, or for an execute
  call whose outputs went to the output packer, ``COMPUTE_DONE`` (the device is free) with
  the packer's ``async_output_id``; the packed outputs follow as ``OUTPUT_READY``;
- a :class:`~omni_trio._core.messages.WorkerAbort` sets the stop flags at once, even while a
  forward runs;
- a :class:`~omni_trio._core.messages.Heartbeat` says, at least every
  :data:`~omni_trio._core.liveness.HEARTBEAT_INTERVAL_S` and as soon as a request starts or
  stops running (:meth:`WorkerHost.heartbeat_due`), how far the rank is and whether its
  packer lives.

A call that raises :class:`~omni_trio.worker.faults.WorkerFatalError` (the worker itself is
broken: a torn collective, a device fault) is answered with a ``fatal`` failure reply, which
makes the executor fail the group closed (and kill every rank); in case nobody does, the
worker process ends itself :data:`FATAL_EXIT_GRACE_S` later.  (Injected crash faults end
the process at once, without a reply, like a real crash.)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from .._core.liveness import HEARTBEAT_INTERVAL_S
from .._core.messages import (
    AsyncOutput,
    AsyncOutputKind,
    BatchRunnerOutput,
    Heartbeat,
    WorkerAbort,
    WorkerCall,
)
from .._core.model_info import ModelInfo
from .worker import Worker

__all__ = [
    "FATAL_EXIT_GRACE_S",
    "HEARTBEAT_CHECK_S",
    "WorkerHost",
    "announced_batch",
    "end_process_soon",
    "failure_reply",
    "handle_call",
]

# How often a shim asks :meth:`WorkerHost.heartbeat_due`.
HEARTBEAT_CHECK_S = 0.05
# After a fatal reply: how long a worker process waits for its executor to kill it before
# it ends itself.
FATAL_EXIT_GRACE_S = 5.0

log = logging.getLogger(__name__)


def end_process_soon(delay_s: float) -> None:
    """In a worker process, end it with :data:`~omni_trio.worker.faults.EXIT_CODE` in
    ``delay_s`` seconds (a daemon thread); elsewhere (an in-process worker) do nothing."""
    from .faults import EXIT_CODE, in_worker_process

    if not in_worker_process():
        return

    def end() -> None:
        time.sleep(delay_s)
        os._exit(EXIT_CODE)

    threading.Thread(target=end, name="omni-trio-fatal-exit", daemon=True).start()


_RPC_RESULT = AsyncOutputKind.RPC_RESULT
_COMPUTE_DONE = AsyncOutputKind.COMPUTE_DONE


def announced_batch(result: Any) -> str | None:
    """The ``async_output_id`` a request-mode result announces (``{batch}/{request}`` keys
    share one batch id), or None."""
    if isinstance(result, BatchRunnerOutput):
        for output in result:
            if output.async_output_id:
                return output.async_output_id.partition("/")[0]
    return None


def failure_reply(
    call: WorkerCall, exc: BaseException, *, rank: int, steps: int, fatal: bool = False
) -> AsyncOutput:
    """The reply of a call that raised: its message, type name and formatted traceback
    (``fatal``: the worker itself is broken)."""
    return AsyncOutput(
        _RPC_RESULT,
        rpc_id=call.rpc_id,
        error=str(exc) or repr(exc),
        error_type=type(exc).__name__,
        traceback="".join(traceback.format_exception(exc)),
        rank=rank,
        steps=steps,
        fatal=fatal,
    )


def handle_call(
    worker: Worker, call: WorkerCall, *, compute_done: Callable[[str], AsyncOutput | None]
) -> AsyncOutput:
    """Run ``call`` on ``worker`` (in the worker's own thread) and build its one reply.

    Only ``call.reply_rank`` ships its result (None: every rank); the others answer with
    ``result=None``, so a rank's result is never shipped for nothing.  ``compute_done(rpc_id)``
    gives the packer's ``COMPUTE_DONE`` for this call, if the call handed outputs to the
    packer: the reply is then that ``COMPUTE_DONE``.  A method that raises is answered with
    its error, ``fatal`` for a :class:`~omni_trio.worker.faults.WorkerFatalError`.
    """
    from .faults import WorkerFatalError

    rank = worker.rank
    try:
        result = worker.execute_method(call.method, *call.args, **dict(call.kwargs))
    except WorkerFatalError as exc:
        return failure_reply(call, exc, rank=rank, steps=worker.steps_done, fatal=True)
    except Exception as exc:
        return failure_reply(call, exc, rank=rank, steps=worker.steps_done)
    ships = call.reply_rank is None or call.reply_rank == rank
    done = compute_done(call.rpc_id)
    if done is not None:
        return dataclasses.replace(
            done, result=result if ships else None, rank=rank, steps=worker.steps_done
        )
    return AsyncOutput(
        _RPC_RESULT,
        rpc_id=call.rpc_id,
        result=result if ships else None,
        rank=rank,
        steps=worker.steps_done,
    )


class WorkerHost:
    """One rank's :class:`Worker` behind a transport (see the module docstring).

    ``post(message)`` sends a message the rank volunteers (``OUTPUT_READY``) to the executor;
    it is called from the packer's thread.  All other methods run where the shim says:
    :meth:`start`, :meth:`call` and :meth:`shutdown` in the worker's own thread, one at a
    time; :meth:`abort` and :meth:`heartbeat` from anywhere, at any time.
    """

    def __init__(self, worker: Worker, post: Callable[[AsyncOutput], None]) -> None:
        self.worker = worker
        self._post = post
        # COMPUTE_DONEs the packer sent for calls still running, by rpc id.
        self._compute_done: dict[str, AsyncOutput] = {}
        self._lock = threading.Lock()
        # When the last heartbeat was built and which requests it said were running.
        self._last_beat: float | None = None
        self._beat_running: frozenset[str] = frozenset()

    @property
    def rank(self) -> int:
        return self.worker.rank

    def start(self) -> ModelInfo:
        """Select the device, join the CFG group (two ranks), load the model and, for
        request-mode async output, start the output packer."""
        worker = self.worker
        worker.init_device()
        info = worker.load_model()
        config = worker.config
        if config.async_output and not config.step_execution:
            worker.start_output_packer(self._packer_reply)
        return info

    def _packer_reply(self, message: AsyncOutput) -> None:
        if message.kind is _COMPUTE_DONE:  # the answer of the call running now
            if message.rpc_id is not None:
                with self._lock:
                    self._compute_done[message.rpc_id] = message
            return
        self._post(dataclasses.replace(message, rank=self.rank))

    def _take_compute_done(self, rpc_id: str) -> AsyncOutput | None:
        with self._lock:
            return self._compute_done.pop(rpc_id, None)

    def call(self, call: WorkerCall) -> AsyncOutput:
        """:func:`handle_call` on this rank.  After a ``fatal`` reply this worker process
        ends itself :data:`FATAL_EXIT_GRACE_S` later, should its executor not kill it."""
        reply = handle_call(self.worker, call, compute_done=self._take_compute_done)
        if reply.fatal:
            log.critical(
                "worker %d is broken (%s in %r): its group must be replaced",
                self.rank,
                reply.error_type,
                call.method,
            )
            end_process_soon(FATAL_EXIT_GRACE_S)
        return reply

    def received(self, call: WorkerCall) -> None:
        """A call arrived (before it runs, in order with aborts): a forward's requests may
        be aborted again (see :meth:`Worker.forward_dispatched`)."""
        if call.method == "execute_scheduler_output" and call.args:
            ids = getattr(call.args[0], "scheduled_request_ids", ())
            self.worker.forward_dispatched(ids)

    def abort(self, abort: WorkerAbort) -> None:
        worker = self.worker
        ids = abort.request_ids
        if ids:  # noted before the flags are set, and apart from them
            worker.mark_aborted(ids)
        flags = worker.stop_flags
        if abort.everything:
            flags.stop_everything()
        if ids:
            flags.abort(ids)
            worker.drop_late_aborts(ids)  # a forward already over: nothing to stop

    def heartbeat(self, now: float | None = None) -> Heartbeat:
        """The rank's heartbeat now (``now``: the shim's monotonic clock, for
        :meth:`heartbeat_due`)."""
        worker = self.worker
        progress = {k: (int(v[0]), int(v[1])) for k, v in dict(worker.progress).items()}
        with self._lock:
            self._last_beat = time.monotonic() if now is None else now
            self._beat_running = frozenset(progress)
        return Heartbeat(
            rank=self.rank,
            steps=worker.steps_done,
            progress=progress,
            packer_alive=worker.packer_alive,
        )

    def heartbeat_due(self, now: float) -> bool:
        """Whether the shim should send a heartbeat now: ``HEARTBEAT_INTERVAL_S`` passed
        since the last one, or a request started or stopped running since (so progress
        shows within :data:`HEARTBEAT_CHECK_S` of a request's first step, on every
        backend).  Shims check this every :data:`HEARTBEAT_CHECK_S`."""
        with self._lock:
            last, running = self._last_beat, self._beat_running
        if last is None or now - last >= HEARTBEAT_INTERVAL_S:
            return True
        return frozenset(self.worker.progress) != running

    def shutdown(self) -> None:
        """Stop every forward and release the worker (packer, runner, CFG group)."""
        self.worker.stop_flags.stop_everything()
        self.worker.shutdown()
