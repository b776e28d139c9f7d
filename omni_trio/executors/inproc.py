"""The in-process executor: one worker in the engine's process, forwards in an owned thread.

The event loop never blocks on the model: every worker call runs in the worker's own
:class:`WorkerThread`, one at a time, so the loop stays responsive to aborts, health checks
and new requests while a forward runs.

The same liveness rules as the process backends (docs/backends.md), through the same
:class:`~omni_trio._core.liveness.LivenessTracker` and poll period: a forward with no step
progress for ``worker_stall_timeout_s``, a dead output packer, an RPC past its timeout and a
broken device (:class:`~omni_trio.worker.faults.WorkerFatalError`) fail the executor closed,
so the engine's supervisor replaces it.  (Silence is no verdict here: the worker shares this
process, so there is nothing to hear from.)
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import trio
from trio_typing import TaskStatus

from .._core.liveness import LivenessTracker
from .._core.messages import (
    AsyncOutput,
    AsyncOutputKind,
    BatchRunnerOutput,
    SchedulerOutput,
)
from ..config import EngineConfig
from ..errors import EngineClosedError, EngineDeadError, StallError, WorkerError
from ..worker.faults import WorkerFatalError
from ..worker.runner import StepProgress
from ..worker.stop_flags import StopFlags
from ..worker.worker import Worker
from ..worker.worker_thread import WorkerThread
from .base import Executor, WorkerState
from .result_pump import ResultPump, ThreadReplySender

__all__ = ["InprocExecutor"]

log = logging.getLogger(__name__)


class InprocExecutor(Executor):
    """Backend ``"inproc"``: a single worker (rank 0) living in this process."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        if config.num_workers != 1:
            from ..errors import InvalidConfigError

            raise InvalidConfigError(
                "the inproc backend runs exactly one worker; use backend='tractor' for more",
                field="num_workers",
            )
        self.stop_flags = StopFlags()
        self._progress: StepProgress = {}
        self._worker: Worker | None = None
        self._thread = WorkerThread("omni-trio-worker-0", stall_timeout_s=config.close_timeout_s)
        self._closed_event = trio.Event()
        self._closing = False
        self._reply: ThreadReplySender | None = None
        self._tracker = LivenessTracker(
            ranks=1, heartbeat_timeout_s=None, stall_timeout_s=config.worker_stall_timeout_s
        )
        # The wait of the forward or RPC in flight, which a failure cancels.
        self._call_scope: trio.CancelScope | None = None

    async def serve(self, *, task_status: TaskStatus[Executor] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the model in the worker thread, report ready, run until cancelled.

        Cancellation during loading waits for the load to finish (it cannot be interrupted)
        and then shuts the worker down.
        """
        self._thread.start()
        try:
            async with trio.open_nursery() as nursery:
                worker = Worker(self.config, stop_flags=self.stop_flags, progress=self._progress)
                self._worker = worker
                await self._thread.run(worker.init_device)
                self.model_info = await self._thread.run(worker.load_model)
                if self.config.async_output and not self.config.step_execution:
                    # The same COMPUTE_DONE / OUTPUT_READY path as the process backends:
                    # packer thread -> channel -> result pump.
                    send, receive = trio.open_memory_channel[AsyncOutput](math.inf)
                    self._pump = ResultPump(worker=0)
                    await nursery.start(self._pump.serve, receive)
                    self._reply = reply = ThreadReplySender(send)

                    def forward_output_ready(message: AsyncOutput) -> None:
                        # The forward's own return is this backend's COMPUTE_DONE; the pump
                        # would otherwise take an unclaimed COMPUTE_DONE as "nobody waits".
                        if message.kind is AsyncOutputKind.OUTPUT_READY:
                            reply(message)

                    await self._thread.run(
                        functools.partial(worker.start_output_packer, forward_output_ready)
                    )
                self._tracker.start(trio.current_time())
                nursery.start_soon(self._monitor, worker)
                task_status.started(self)
                await trio.sleep_forever()
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self._closing:
            with trio.CancelScope(shield=True):
                await self._closed_event.wait()
            return
        self._closing = True
        self._closed = True
        with trio.CancelScope(shield=True):
            try:
                self.stop_flags.stop_everything()
                worker, self._worker = self._worker, None
                if worker is not None and self._thread.alive:
                    # Bounded (INV-6): a forward that never reaches a step boundary must not
                    # hold close forever.  On timeout the shutdown stays queued behind it.
                    budget = self.config.close_timeout_s
                    with trio.move_on_after(budget) as scope:
                        try:
                            await self._thread.run(worker.shutdown, abandon_on_cancel=True)
                        except Exception:
                            log.exception("worker shutdown failed")
                    if scope.cancelled_caught:
                        self.fail(StallError("close", f"worker 0 did not shut down in {budget} s"))
                if not await self._thread.stop():
                    self.fail(StallError("close", "worker thread did not exit"))
                if self._pump is not None:
                    self._pump.fail(EngineClosedError("executor is closed"))
                if self._reply is not None:
                    self._reply.close()
            finally:
                self._progress.clear()
                self._closed_event.set()

    def _usable_worker(self) -> Worker:
        if self._dead_reason is not None:
            self.check_health()
        if self._closed or self._worker is None:
            raise EngineClosedError("executor is closed")
        return self._worker

    async def execute_batch(self, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
        worker = self._usable_worker()
        result = await self._run_forward(worker.execute_scheduler_output, scheduler_output)
        self._announce_async_outputs(result)
        return result

    async def execute_step(self, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
        worker = self._usable_worker()
        return await self._run_forward(worker.execute_stepwise, scheduler_output)

    async def _run_forward(
        self,
        method: Callable[[SchedulerOutput], BatchRunnerOutput],
        scheduler_output: SchedulerOutput,
    ) -> BatchRunnerOutput:
        ids = scheduler_output.scheduled_request_ids
        if self._worker is not None:  # in order with aborts, which run on this thread too
            self._worker.forward_dispatched(ids)
        try:
            with self._calling() as scope:
                result = await self._thread.run(
                    functools.partial(method, scheduler_output),
                    on_cancel=functools.partial(self.stop_flags.abort, ids),
                )
                # An abort that came after the worker forgot the forward's flags (between
                # the thread's return and now) is over too.
                self.stop_flags.forget(ids)
            if scope.cancelled_caught:
                self.check_health()  # the monitor failed the executor: raises why
            return result
        except trio.Cancelled:
            if self._dead_reason is not None:
                self.check_health()
            raise
        except EngineClosedError:
            raise
        except Exception as exc:
            # The runner turns request failures into outputs; an exception here means the
            # worker itself is broken (a device fault, a torn collective).  Fail closed.
            self._fail(exc)
            raise EngineDeadError(f"worker 0 failed: {type(exc).__name__}: {exc}") from exc

    @contextlib.contextmanager
    def _calling(self) -> Iterator[trio.CancelScope]:
        """One call in flight: the liveness clock runs, and a failure cancels its wait."""
        with trio.CancelScope() as scope:
            self._call_scope = scope
            self._tracker.call_started(trio.current_time())
            try:
                yield scope
            finally:
                self._tracker.call_ended()
                self._call_scope = None

    async def _monitor(self, worker: Worker) -> None:
        """The worker's liveness, every ``poll_s`` (the process backends' period): a call
        with no step progress for ``worker_stall_timeout_s`` or a dead output packer fails
        the executor closed."""
        tracker = self._tracker
        while True:
            await trio.sleep(tracker.poll_s)
            now = trio.current_time()
            tracker.heard(0, now, steps=worker.steps_done, packer_alive=worker.packer_alive)
            verdict = tracker.check(now)
            if verdict is not None:
                self._fail(verdict)
                return

    def _fail(self, error: BaseException) -> None:
        """Fail closed: remember why, stop every forward, fail every pending output and
        cancel the wait of the call in flight (the worker thread gets ``close_timeout_s``
        to come back at close)."""
        first = self._dead_reason is None
        self.fail(error)
        if not first:
            return
        log.warning("worker failed: %s: %s", type(error).__name__, error)
        self.stop_flags.stop_everything()
        if self._pump is not None:
            self._pump.fail(error)
        if self._call_scope is not None:
            self._call_scope.cancel()

    async def collective_rpc(
        self,
        method: str,
        *args: Any,
        timeout: float | None = None,
        unique_reply_rank: int | None = 0,
        **kwargs: Any,
    ) -> Any:
        worker = self._usable_worker()
        call = functools.partial(worker.execute_method, method, *args, **kwargs)
        with (
            self._calling() as failed,
            trio.move_on_after(math.inf if timeout is None else timeout) as scope,
        ):
            try:
                result = await self._thread.run(call, abandon_on_cancel=True)
            except (AttributeError, TypeError):
                raise
            except WorkerFatalError as exc:
                self._fail(exc)  # the worker itself is broken, as in a forward
                raise WorkerError(str(exc), worker=0, error_type=type(exc).__name__) from exc
            except Exception as exc:
                raise WorkerError(str(exc), worker=0, error_type=type(exc).__name__) from exc
        if failed.cancelled_caught:
            self.check_health()
        if scope.cancelled_caught:
            # The worker runs one call at a time: every later call would queue behind this
            # one.  Fail closed, as every backend does.
            error = StallError("rpc", f"{method!r} got no reply within {timeout} s")
            self._fail(error)
            raise error
        return result if unique_reply_rank is not None else [result]

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        ids = tuple(request_ids)
        worker = self._worker
        if worker is not None:  # noted before the flags are set, and apart from them
            worker.mark_aborted(ids)
        self.stop_flags.abort(ids)
        if worker is not None:
            worker.drop_late_aborts(ids)  # a forward already over: nothing to stop

    def progress(self, request_id: str) -> tuple[int, int] | None:
        return self._progress.get(request_id)

    def worker_states(self) -> list[WorkerState]:
        (entry,) = super().worker_states()
        worker = self._worker
        steps = worker.steps_done if worker is not None else None
        return [WorkerState(0, entry.state, pid=os.getpid(), steps=steps)]
