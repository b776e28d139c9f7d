"""The engine actor: admission, one output stream per request, aborts, control RPCs, the busy loop.

The engine loop is the only owner of the scheduler and the only place that drives the
executor::

    wait for work -> run queued RPCs -> (admission wait) -> schedule -> execute -> update -> emit

Control RPCs run between batches, never during one.  An execution error becomes a per-request
error output and the loop goes on.

Supervision (DESIGN.md section 5): the worker group (the executor) is the one child of a
``one_for_all`` :class:`~omni_trio.supervisor.Supervisor`.  When the group fails closed (a
worker died, hung or raised a fatal error) the loop recovers its in-flight requests -- each
goes back to the front of the queue as PREEMPTED while its retry budget
(``max_retries_on_worker_failure``) lasts, and otherwise ends FINISHED_ERROR with the
retryable error type ``WorkerFailedError`` -- while the supervisor restarts the group with
backoff.  Waiting requests stay queued.  Past the restart-intensity limit, or on a scheduler
failure, the engine dies: every open stream gets a terminal error and later calls raise
:class:`EngineDeadError`.

Every method here runs on the engine's trio thread.  Methods that change scheduler state
(admission, abort) are synchronous critical sections: they never checkpoint, so they cannot
interleave with the loop's own use of the scheduler.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import random
import secrets
import statistics as _stats
from collections import deque
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
from trio_typing import TaskStatus

from .._core.lifecycle import RequestState, RequestStatus
from .._core.messages import (
    BatchRunnerOutput,
    DiffusionOutput,
    RequestMetrics,
    RunnerOutput,
    SchedulerOutput,
)
from .._core.request import DiffusionRequest, SamplingParams, validate_request
from .._core.scheduler import RequestScheduler, Scheduler, StepScheduler
from .._core.trace import TraceKind, TraceRecorder
from ..config import EngineConfig
from ..errors import (
    DuplicateRequestError,
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    RequestAbortedError,
    RequestFailedError,
    RestartLimitError,
    StallError,
    WorkerError,
)
from ..executors.base import Executor, WorkerState, open_executor
from ..supervisor import ChildSpec, RestartPolicy, Strategy, Supervisor, SupervisorEvent
from .request_stream import RequestStream

__all__ = [
    "WARMUP_REQUEST_ID",
    "AsyncEngine",
    "EngineHealth",
    "EngineStatistics",
    "PhaseSummary",
    "open_engine",
]

log = logging.getLogger(__name__)

WARMUP_REQUEST_ID = "omni-trio-warmup"
_TIMING_WINDOW = 1024
_S = RequestStatus
_K = TraceKind
WORKER_FAILED = "WorkerFailedError"


class _GroupFailed(Exception):
    """Internal: the worker group failed closed during a call; the loop recovers."""


@dataclass(frozen=True, slots=True)
class PhaseSummary:
    """Summary of one phase's recent timings (ms) over the last 1024 requests."""

    count: int = 0
    mean_ms: float = 0.0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    max_ms: float = 0.0

    @classmethod
    def of(cls, samples: Iterable[float]) -> PhaseSummary:
        data = sorted(samples)
        if not data:
            return cls()
        return cls(
            count=len(data),
            mean_ms=_stats.fmean(data),
            p50_ms=data[len(data) // 2],
            p90_ms=data[min(len(data) - 1, math.ceil(len(data) * 0.9) - 1)],
            max_ms=data[-1],
        )


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """A snapshot of the engine (``AsyncEngine.statistics()``)."""

    waiting: int
    running: int
    admitted: int
    finished_completed: int
    finished_aborted: int
    finished_error: int
    open_streams: int
    dead: bool
    closed: bool
    # Supervision: restarts of the worker group so far, requests sent back to the queue
    # after a group failure, the group's state (starting, running, restarting, failed,
    # stopped), each worker's state, and the last group failure ("Type: message").
    restarts: int = 0
    requeued: int = 0
    worker_group: str = "running"
    workers: tuple[WorkerState, ...] = ()
    last_failure: str | None = None
    queue_wait: PhaseSummary = field(default_factory=PhaseSummary)
    execution: PhaseSummary = field(default_factory=PhaseSummary)
    postprocess: PhaseSummary = field(default_factory=PhaseSummary)
    end_to_end: PhaseSummary = field(default_factory=PhaseSummary)


@dataclass(frozen=True, slots=True)
class EngineHealth:
    """``AsyncEngine.health()``: never ``healthy`` while a worker is gone or restarting.

    ``state`` is ``"ready"``, ``"starting"``, ``"restarting"``, ``"dead"`` or ``"closed"``;
    ``reason`` says why it is not ready.
    """

    healthy: bool
    state: str
    reason: str | None
    restarts: int
    workers: tuple[WorkerState, ...]
    last_failure: str | None


@dataclass(eq=False)
class _PendingOutput:
    """A completed request whose payload is still being packed by ``executor``."""

    state: RequestState
    announced: RunnerOutput
    executor: Executor
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


@dataclass(eq=False)
class _Handle:
    """The engine's side of one request stream."""

    request: DiffusionRequest
    send: trio.MemorySendChannel[DiffusionOutput]
    chunks_sent: int = 0
    # The total_chunks every preview of this stream announces; fixed at the first preview.
    total_chunks: int | None = None
    # Times this request was sent back to the queue after its worker group failed.
    retries: int = 0


@dataclass(eq=False)
class _PendingRpc:
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    timeout: float | None
    unique_reply_rank: int | None
    done: trio.Event = field(default_factory=trio.Event)
    abandoned: bool = False
    result: Any = None
    error: BaseException | None = None


class AsyncEngine:
    """The engine.  Create it with :func:`open_engine`; never construct it directly."""

    def __init__(self, config: EngineConfig, *, trace: TraceRecorder | None = None) -> None:
        self.config = config
        self.scheduler: Scheduler = (
            StepScheduler(config.max_num_seqs)
            if config.step_execution
            else RequestScheduler(config.max_num_seqs, config.request_batch_max_wait_ms)
        )
        self.trace = trace
        self._limits = config.request_limits
        self._step_mode = config.step_execution
        self._handles: dict[str, _Handle] = {}
        self._pending: dict[str, _PendingOutput] = {}
        self._rpcs: deque[_PendingRpc] = deque()
        self._wake = trio.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._loop_scope: trio.CancelScope | None = None
        self._deliveries: trio.Nursery | None = None
        self._loop_done = trio.Event()
        self._closed = False
        self._close_done = trio.Event()
        self._dead: BaseException | None = None
        self._ended = trio.Event()  # set when the engine died or closed
        self._admitted = 0
        # Supervision: the current worker group, its generation (1 = the first group), and
        # the generation whose failure the loop has already recovered from.
        self._executor: Executor | None = None
        self._generation = 0
        self._recovered_generation = 0
        self._group_changed = trio.Event()
        self._group_state = "starting"
        self._last_failure: str | None = None
        self._last_failed_rank: int | None = None
        self._requeued = 0
        self._supervisor: Supervisor | None = None
        # Generated ids and seeds: random per engine, cheap per request.
        self._id_prefix = secrets.token_hex(4)
        self._id_counter = itertools.count(1)
        self._seeds = random.Random(secrets.randbits(64))
        # Warmup traffic is nobody's request: it is kept out of the statistics.
        self._warming = False
        self._uncounted: set[str] = set()
        self._finished_counts = {s: 0 for s in _S if s.finished}
        self._timings: dict[str, deque[float]] = {
            k: deque(maxlen=_TIMING_WINDOW)
            for k in ("queue_wait", "execution", "postprocess", "end_to_end")
        }

    @property
    def executor(self) -> Executor:
        """The current worker group (a new object after each restart)."""
        if self._executor is None:
            raise EngineClosedError("the engine has no worker group yet")
        return self._executor

    def _record(
        self,
        kind: TraceKind,
        request_id: str | None = None,
        *,
        step_id: int | None = None,
        worker: int | None = None,
        detail: dict[str, Any] | None = None,
    ) -> None:
        trace = self.trace
        if trace is not None:
            trace.record(
                trio.current_time(),
                kind,
                request_id,
                step_id=step_id,
                worker=worker,
                detail=detail,
            )

    # -- supervision ---------------------------------------------------------------------

    def _restart_policy(self) -> RestartPolicy:
        c = self.config
        return RestartPolicy(
            max_restarts=c.max_worker_restarts,
            window_s=c.worker_restart_window_s,
            backoff_s=c.worker_restart_backoff_s,
            backoff_max_s=max(c.worker_restart_backoff_s, c.worker_restart_backoff_max_s),
        )

    async def _serve_worker_group(
        self, *, task_status: TaskStatus[Executor] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The supervised child: one executor (the whole worker group, restarted as one --
        a collective group is never partially restarted).  Runs until the group fails
        closed, then raises its failure so the supervisor restarts it.  Cancellation closes
        the group (bounded)."""
        async with open_executor(self.config) as executor:
            self._install(executor)
            task_status.started(executor)
            reason = await executor.wait_failed()
        if self._closed or self._dead is not None:
            return  # failed while the engine closes: nothing to restart
        if isinstance(reason, Exception):
            raise reason
        raise WorkerError(f"worker group failed: {reason!r}")  # pragma: no cover

    def _install(self, executor: Executor) -> None:
        """A worker group started: make it the current one and wake the loop."""
        first = self._executor is None
        old = self._executor.model_info if self._executor is not None else None
        if old is not None and executor.model_info not in (None, old):
            log.warning("the restarted worker group reports different model info")
        self._executor = executor
        self._generation += 1
        self._group_state = "running"
        if not first:
            self._record(_K.RESTART, detail={"generation": self._generation})
            log.warning("worker group restarted (generation %d)", self._generation)
        self._group_changed.set()
        self._group_changed = trio.Event()
        self._wake.set()

    def _on_supervisor_event(self, event: SupervisorEvent) -> None:
        if event.kind in ("failed", "exited"):
            error = event.error
            self._group_state = "restarting"
            self._last_failure = (
                f"{type(error).__name__}: {error}" if error is not None else "worker group exited"
            )
            rank = getattr(error, "worker", None)
            self._last_failed_rank = rank if isinstance(rank, int) else None
            self._wake.set()  # an idle loop recovers at once
        elif event.kind == "restarting":
            self._group_state = "restarting"
        elif event.kind == "gave_up":
            self._group_state = "failed"

    async def _run_supervisor(
        self,
        supervisor: Supervisor,
        *,
        task_status: TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Run the worker-group supervisor; past its restart limit the engine dies."""
        try:
            await supervisor.serve(task_status=task_status)
        except RestartLimitError as exc:
            log.error("engine dead: %s", exc)
            self._die(exc)

    # -- the loop ------------------------------------------------------------------------

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the supervised worker group, then run the busy loop until cancelled (by
        :meth:`aclose`) or until the engine dies.  A worker group that fails to start the
        first time raises here (nothing is retried: that is a configuration error)."""
        self._token = trio.lowlevel.current_trio_token()
        started = False
        try:
            with trio.CancelScope() as scope:
                self._loop_scope = scope
                async with trio.open_nursery() as nursery:
                    # Tasks that wait for async outputs (packed after their forward) live
                    # here, so cancelling the loop cancels them too.
                    self._deliveries = nursery
                    self._supervisor = Supervisor(
                        [ChildSpec("worker-group", self._serve_worker_group, restart="transient")],
                        strategy=Strategy.ONE_FOR_ALL,
                        policy=self._restart_policy(),
                        name="engine",
                        on_event=self._on_supervisor_event,
                    )
                    await nursery.start(self._run_supervisor, self._supervisor)
                    started = True
                    # From now on only aclose() (or death) ends the loop and the workers: a
                    # cancellation from outside must not tear the worker group down
                    # abruptly while open_engine's exit closes it gracefully.
                    scope.shield = True
                    task_status.started()
                    await self._run_loop()
        except Exception as exc:  # a scheduler bug
            if not started:
                raise
            log.exception("engine loop failed")
            self._die(exc)
        finally:
            self._loop_done.set()

    def _group_failed(self) -> bool:
        executor = self._executor
        return executor is not None and executor.is_dead and not self._closed

    async def _run_loop(self) -> None:
        scheduler = self.scheduler
        while True:
            if self._group_failed():
                await self._recover()
                continue
            while not scheduler.has_unfinished_requests() and not self._rpcs:
                if self._group_failed():
                    break
                if self._step_mode and scheduler.has_finished_to_report():
                    # Let the workers evict step state of requests that ended while idle.
                    try:
                        await self._execute(scheduler.schedule(trio.current_time()))
                    except _GroupFailed:
                        break
                    continue
                self._wake = trio.Event()
                await self._wake.wait()
            if self._group_failed():
                continue
            await self._run_rpcs()
            if not scheduler.has_unfinished_requests():
                continue
            while (deadline := scheduler.admission_wait(trio.current_time())) is not None:
                self._wake = trio.Event()
                with trio.move_on_at(deadline):
                    await self._wake.wait()
                if self._rpcs or self._group_failed():
                    break
            if self._rpcs or self._group_failed():
                continue  # RPCs go first; schedule on the next turn
            sched_out = scheduler.schedule(trio.current_time())
            if sched_out.is_empty:
                if scheduler.num_running == 0:
                    await trio.lowlevel.checkpoint()
                continue
            try:
                runner_out = await self._execute(sched_out)
            except _GroupFailed:
                continue  # the scheduled requests are still RUNNING: recovery requeues them
            finished = scheduler.update_from_output(sched_out, runner_out, trio.current_time())
            if self._step_mode:
                self._emit_chunks(sched_out, runner_out, set(finished))
            self._emit_finished(finished, runner_out)
            await trio.lowlevel.checkpoint()

    async def _execute(self, sched_out: SchedulerOutput) -> BatchRunnerOutput:
        if self._closed:
            # Closing: the worker group is being shut down and every request has ended.
            await trio.lowlevel.checkpoint()
            return BatchRunnerOutput()
        executor = self.executor
        trace = self.trace
        if trace is not None:
            for rid in sched_out.scheduled_request_ids:
                self._record(_K.SCHEDULE, rid, step_id=sched_out.step_id)
                self._record(_K.EXEC_START, rid, step_id=sched_out.step_id, worker=0)
        try:
            if self.config.step_execution:
                result = await executor.execute_step(sched_out)
            else:
                result = await executor.execute_batch(sched_out)
        except trio.Cancelled:
            raise
        except Exception as exc:
            if executor.is_dead:
                raise _GroupFailed() from exc
            if isinstance(exc, StallError):
                raise
            if not self._closed:
                log.warning(
                    "execution of %s failed", sched_out.scheduled_request_ids, exc_info=True
                )
            result = BatchRunnerOutput.from_list(
                [RunnerOutput.from_exception(rid, exc) for rid in sched_out.scheduled_request_ids]
            )
        if executor.is_dead:
            # The group failed while this call ran (an in-process worker told to stop
            # everything returns "aborted" for requests nobody aborted): its results are not
            # trusted; recovery reruns the requests with their seeds.
            raise _GroupFailed()
        if trace is not None:
            for out in result:
                if out.error is not None:
                    outcome = "error"
                elif out.aborted:
                    outcome = "aborted"
                elif out.images is None and out.async_output_id:
                    outcome = "pending"
                else:
                    outcome = "ok"
                self._record(
                    _K.EXEC_RESULT,
                    out.request_id,
                    step_id=sched_out.step_id,
                    worker=0,
                    detail={"outcome": outcome},
                )
        return result

    async def _recover(self) -> None:
        """The worker group failed: requeue or fail its in-flight requests (once per
        group), then wait until the supervisor installed a new group (or the engine died,
        which cancels this wait)."""
        executor = self.executor
        generation = self._generation
        if self._recovered_generation != generation:
            self._recovered_generation = generation
            reason = executor.dead_reason
            self._group_state = "restarting"
            if reason is not None:
                self._last_failure = f"{type(reason).__name__}: {reason}"
            rank = getattr(reason, "worker", None)
            self._record(
                _K.CRASH,
                worker=rank if isinstance(rank, int) else None,
                detail={
                    "generation": generation,
                    "error_type": type(reason).__name__,
                    "error": str(reason),
                },
            )
            if isinstance(reason, StallError):
                self._record(_K.STALL, detail={"phase": reason.phase, "error": str(reason)})
            self._requeue_or_fail(self.scheduler.running_request_ids(), reason)
        while self._generation == generation:
            await self._group_changed.wait()

    def _requeue_or_fail(self, request_ids: Iterable[str], reason: BaseException | None) -> None:
        """Requests that were running on a failed group: back to the front of the queue
        (reverse order keeps their order) while retries last; else FINISHED_ERROR."""
        now = trio.current_time()
        failed: list[str] = []
        budget = self.config.max_retries_on_worker_failure
        for rid in reversed(tuple(request_ids)):
            handle = self._handles.get(rid)
            if handle is not None and handle.retries < budget:
                handle.retries += 1
                self._requeued += 1
                self.scheduler.preempt_request(rid, reset_progress=True)
                self._record(_K.REQUEUE, rid, detail={"retry": handle.retries})
            else:
                failed.append(rid)
        if failed:
            message = (
                f"the worker group failed while this request ran "
                f"({type(reason).__name__}: {reason}); retries exhausted"
            )
            done = self.scheduler.finish_requests(
                reversed(failed), _S.FINISHED_ERROR, now, error=message, error_type=WORKER_FAILED
            )
            self._emit_finished(done)
        self._wake.set()

    async def _run_rpcs(self) -> None:
        while self._rpcs:
            rpc = self._rpcs.popleft()
            if rpc.abandoned:
                continue
            try:
                rpc.result = await self.executor.collective_rpc(
                    rpc.method,
                    *rpc.args,
                    timeout=rpc.timeout,
                    unique_reply_rank=rpc.unique_reply_rank,
                    **rpc.kwargs,
                )
            except trio.Cancelled:
                rpc.error = EngineClosedError("engine closed while the RPC ran")
                rpc.done.set()
                raise
            except Exception as exc:
                rpc.error = exc
            rpc.done.set()

    # -- emission ------------------------------------------------------------------------

    def _emit_chunks(
        self, sched_out: SchedulerOutput, runner_out: BatchRunnerOutput, finished: set[str]
    ) -> None:
        """Step mode: deliver the non-terminal chunks (streaming previews) of this tick.

        A preview goes only to the request that was scheduled: if its id was aborted and
        re-admitted while the tick ran, the new incarnation (still WAITING) gets nothing.
        """
        for rid in sched_out.scheduled_request_ids:
            if rid in finished:
                continue
            runner = runner_out.get(rid)
            handle = self._handles.get(rid)
            state = self.scheduler.get_request_state(rid)
            if runner is None or not runner.images or handle is None or state is None:
                continue
            if state.status not in (_S.RUNNING, _S.PREEMPTED):
                continue  # finished, or a new incarnation of a reused id
            if handle.total_chunks is None:
                handle.total_chunks = self._expected_chunks(state)
            # A preview is never the last chunk.
            handle.total_chunks = max(handle.total_chunks, handle.chunks_sent + 2)
            output = DiffusionOutput(
                request_id=rid,
                status=state.status,
                finished=False,
                images=runner.images,
                seed=state.request.sampling.seed,
                chunk_index=handle.chunks_sent,
                total_chunks=handle.total_chunks,
            )
            handle.chunks_sent += 1
            self._record(_K.CHUNK, rid, detail={"chunk_index": output.chunk_index})
            try:
                handle.send.send_nowait(output)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

    def _expected_chunks(self, state: RequestState) -> int:
        """Previews every ``preview_interval`` steps before the last, plus the final output.

        The step count is the one the worker runs (its progress report) when it has one: a
        model may run fewer steps than ``SamplingParams.total_steps`` says (Euler given
        explicit sigmas).
        """
        if not self.config.streaming_output:
            return 1
        progress = self.executor.progress(state.request_id)
        total = progress[1] if progress is not None else state.total_steps
        return (max(total, 1) - 1) // self.config.preview_interval + 1

    def _emit_finished(
        self, request_ids: Iterable[str], runner_out: BatchRunnerOutput | None = None
    ) -> None:
        for rid in request_ids:
            state = self.scheduler.pop_request_state(rid)
            if state is None:
                continue
            runner = runner_out.get(rid) if runner_out is not None else None
            self._deliver_terminal(state, runner)

    def _deliver_terminal(self, state: RequestState, runner: RunnerOutput | None) -> None:
        rid = state.request_id
        if (
            state.status is _S.FINISHED_COMPLETED
            and runner is not None
            and runner.async_output_id
            and runner.images is None
        ):
            # Compute is done; the payload is still being packed.  Deliver when it is ready.
            executor = self.executor
            if rid not in self._handles or self._deliveries is None:
                executor.drop_output(runner.async_output_id)
                self._deliver_output(state, None, _S.FINISHED_ABORTED)
                return
            pending = _PendingOutput(state, runner, executor)
            self._pending[rid] = pending
            self._deliveries.start_soon(self._deliver_when_packed, pending)
            return
        self._deliver_output(state, runner, state.status)

    async def _deliver_when_packed(self, pending: _PendingOutput) -> None:
        """Wait for an async output, then deliver the terminal output.

        A packing failure or an output that never comes (StallError) ends the request with
        an error.  If the worker group died with the output in flight, the request goes back
        to the queue while its retry budget lasts.  If the request is aborted meanwhile
        (``pending.scope`` cancelled), the output is dropped and nothing more happens here.
        """
        state, announced, executor = pending.state, pending.announced, pending.executor
        rid = state.request_id
        key = announced.async_output_id
        assert key is not None
        with pending.scope:
            try:
                packed = await executor.wait_output(key)
            except trio.Cancelled:
                executor.drop_output(key)
                raise
            except Exception as exc:
                if executor.is_dead:
                    if self._pending.get(rid) is pending and self._retry_lost_output(pending):
                        return
                    packed = RunnerOutput(
                        rid,
                        error=(
                            f"the worker group failed while this request's output was packed "
                            f"({type(exc).__name__}: {exc}); retries exhausted"
                        ),
                        error_type=WORKER_FAILED,
                    )
                else:
                    packed = RunnerOutput.from_exception(rid, exc)
        if pending.scope.cancelled_caught or self._pending.get(rid) is not pending:
            executor.drop_output(key)
            return  # aborted or ended by close/death meanwhile: it has had its terminal output
        del self._pending[rid]
        timings = {**announced.timings, **packed.timings}
        packed = dataclasses.replace(packed, timings=timings)
        if packed.error is not None or packed.images is None:
            state.error = packed.error or "async output carried no images"
            state.error_type = packed.error_type or "MissingOutputError"
            self._deliver_output(state, packed, _S.FINISHED_ERROR)
        else:
            self._deliver_output(state, packed, _S.FINISHED_COMPLETED)

    def _retry_lost_output(self, pending: _PendingOutput) -> bool:
        """The output of a finished compute was lost with its worker group: run the request
        again (same seed, so the same image) if its retry budget allows.  Returns True if
        it was requeued."""
        state = pending.state
        rid = state.request_id
        handle = self._handles.get(rid)
        if (
            handle is None
            or handle.retries >= self.config.max_retries_on_worker_failure
            or self._closed
            or self._dead is not None
        ):
            return False
        del self._pending[rid]
        handle.retries += 1
        self._requeued += 1
        self.scheduler.requeue_request(
            state.request,
            trio.current_time(),
            queued_at=state.queued_at,
            first_scheduled_at=state.first_scheduled_at,
        )
        self._record(_K.REQUEUE, rid, detail={"retry": handle.retries})
        self._wake.set()
        return True

    def _deliver_output(
        self, state: RequestState, runner: RunnerOutput | None, status: RequestStatus
    ) -> None:
        """The one terminal path of every request (INV-1, INV-3): count it, send its terminal
        output (or drop it if the consumer is gone), close its stream, forget it."""
        rid = state.request_id
        counted = rid not in self._uncounted
        self._uncounted.discard(rid)
        if counted:
            self._finished_counts[status] += 1
        if status is _S.FINISHED_ABORTED and state.error is None:
            state.error = f"Request {rid} aborted."
            state.error_type = "RequestAbortedError"
        images: tuple[Any, ...] = ()
        if status is _S.FINISHED_COMPLETED and runner is not None and runner.images:
            images = runner.images
        metrics = self._metrics(state, runner, status, counted=counted)
        output = DiffusionOutput(
            request_id=rid,
            status=status,
            finished=True,
            images=images,
            error=state.error if status is not _S.FINISHED_COMPLETED else None,
            error_type=state.error_type if status is not _S.FINISHED_COMPLETED else None,
            seed=state.request.sampling.seed,
            metrics=metrics,
        )
        self._record(
            _K.TERMINAL, rid, detail={"status": status.name, "error_type": output.error_type}
        )
        handle = self._handles.pop(rid, None)
        if handle is None:
            # Consumer already gone: the output is dropped, the state is cleaned.
            self._record(_K.OUTPUT, rid, detail={"status": status.name, "delivered": False})
            self._record(_K.CLEANUP, rid)
            return
        if handle.chunks_sent:
            # The terminal output is always the last chunk.  For a completed request this is
            # what its previews announced; an aborted or failed one ends early.
            output = dataclasses.replace(
                output, chunk_index=handle.chunks_sent, total_chunks=handle.chunks_sent + 1
            )
        delivered = True
        try:
            handle.send.send_nowait(output)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            delivered = False
        handle.send.close()
        self._record(_K.OUTPUT, rid, detail={"status": status.name, "delivered": delivered})
        self._record(_K.CLEANUP, rid)

    def _metrics(
        self,
        state: RequestState,
        runner: RunnerOutput | None,
        status: RequestStatus,
        *,
        counted: bool = True,
    ) -> RequestMetrics:
        # An async output is delivered after the scheduler finished the request: end now.
        end = (
            trio.current_time()
            if state.finished_at is None
            else max(state.finished_at, trio.current_time())
        )
        started = state.first_scheduled_at
        queue_wait = ((started if started is not None else end) - state.queued_at) * 1000.0
        timings = runner.timings if runner is not None else {}
        execution = timings.get("forward_ms")
        if execution is None:
            execution = (end - started) * 1000.0 if started is not None else 0.0
        metrics = RequestMetrics(
            queue_wait_ms=queue_wait,
            execution_ms=execution,
            postprocess_ms=timings.get("postprocess_ms", 0.0),
            e2e_ms=(end - state.queued_at) * 1000.0,
        )
        if counted and status is _S.FINISHED_COMPLETED:
            self._timings["queue_wait"].append(metrics.queue_wait_ms)
            self._timings["execution"].append(metrics.execution_ms)
            self._timings["postprocess"].append(metrics.postprocess_ms)
            self._timings["end_to_end"].append(metrics.e2e_ms)
        return metrics

    # -- admission -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(
                f"engine is dead: {type(self._dead).__name__}: {self._dead}"
            ) from self._dead
        if self._closed:
            raise EngineClosedError("engine is closed")

    def _new_request_id(self) -> str:
        # Unique per engine (a random prefix) without a syscall per request.
        return f"req-{self._id_prefix}-{next(self._id_counter)}"

    def _make_request(
        self,
        prompt_or_request: str | DiffusionRequest,
        params: SamplingParams | None,
        request_id: str | None,
    ) -> DiffusionRequest:
        if isinstance(prompt_or_request, DiffusionRequest):
            request = prompt_or_request
            if params is not None:
                request = request.replace(sampling=params)
            if request_id is not None:
                request = request.replace(request_id=request_id)
        else:
            if not isinstance(prompt_or_request, str):
                raise InvalidRequestError(
                    f"prompt must be a string, not {type(prompt_or_request).__name__}",
                    param="prompt",
                )
            request = DiffusionRequest(
                prompt_or_request,
                params if params is not None else SamplingParams(),
                request_id if request_id is not None else self._new_request_id(),
            )
        if not request.request_id:
            request = request.replace(request_id=self._new_request_id())
        return request

    def stream(
        self,
        prompt_or_request: str | DiffusionRequest,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> RequestStream:
        """Admit a request and return its output stream (no checkpoint).

        Raises :class:`InvalidRequestError` or :class:`DuplicateRequestError` before anything
        is admitted, :class:`EngineClosedError` / :class:`EngineDeadError` if the engine no
        longer accepts work.  A seed is chosen now if the request has none.
        """
        self._check_open()
        request = self._make_request(prompt_or_request, params, request_id)
        validate_request(request, self._limits)
        request = self._resolve_defaults(request)
        rid = request.request_id
        if rid in self._handles:
            raise DuplicateRequestError(rid)
        if "faults" in request.sampling.extra_args:
            self._check_faults(request)
        state = self.scheduler.add_request(request, trio.current_time())
        send, receive = trio.open_memory_channel[DiffusionOutput](math.inf)
        self._handles[rid] = _Handle(request, send)
        if self.trace is not None:
            self._record(
                _K.ADMIT,
                rid,
                detail={
                    "seed": request.sampling.seed,
                    "steps": state.total_steps or request.sampling.total_steps,
                    "mode": self.scheduler.mode,
                },
            )
        if rid == WARMUP_REQUEST_ID and self._warming:
            self._uncounted.add(rid)
        else:
            self._admitted += 1
        self._wake.set()
        return RequestStream(
            rid, request.sampling.seed, receive, self._consumer_gone, self._consumer_dropped
        )

    def _check_faults(self, request: DiffusionRequest) -> None:
        """Fault injection (``omni_trio.testing.faults``) only where the config allows it,
        and only well-formed."""
        if not self.config.fault_injection:
            raise InvalidRequestError(
                "extra_args['faults'] asks for fault injection, which this engine does not "
                "allow (EngineConfig.fault_injection=False)",
                param="extra_args",
            )
        from ..worker.faults import parse_faults

        try:
            parse_faults(request.sampling.extra_args)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="extra_args") from exc

    def _resolve_defaults(self, request: DiffusionRequest) -> DiffusionRequest:
        """Fill what admission decides: the model's default size and a random seed.

        Resolving the size here means a request that leaves it unset and one that asks for
        the default explicitly share a compatibility key.  A model that renders one fixed
        size (unconditional UNets) rejects any other size before admission.
        """
        sp = request.sampling
        changes: dict[str, Any] = {}
        info = self.executor.model_info
        if info is not None:
            if sp.height is None:
                changes["height"] = info.default_height
            if sp.width is None:
                changes["width"] = info.default_width
            if info.family == "unconditional":
                size = (changes.get("height", sp.height), changes.get("width", sp.width))
                if size != (info.default_height, info.default_width):
                    raise InvalidRequestError(
                        f"model {info.name} only renders "
                        f"{info.default_width}x{info.default_height}, not {size[1]}x{size[0]}",
                        param="size",
                    )
        if sp.seed is None:
            changes["seed"] = self._seeds.randrange(2**31)
        if not changes:
            return request
        request = request.replace(sampling=sp.replace(**changes))
        validate_request(request, self._limits)  # the filled-in size must obey the limits too
        return request

    async def generate(
        self,
        prompt_or_request: str | DiffusionRequest,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
    ) -> DiffusionOutput:
        """Run one request to completion and return its terminal output.

        Raises :class:`RequestAbortedError` if it was aborted, :class:`RequestFailedError`
        (with the error text and type) if it failed, :class:`EngineClosedError` /
        :class:`EngineDeadError` if the engine closed or died first.  If cancelled, the
        request is aborted and its slot freed.
        """
        final: DiffusionOutput | None = None
        async with self.stream(prompt_or_request, params, request_id=request_id) as chunks:
            async for output in chunks:
                if output.finished:
                    final = output
        if final is None:  # pragma: no cover - streams always end with a terminal output
            raise EngineClosedError("the request stream ended without an output")
        return raise_for_status(final)

    def _consumer_dropped(self, request_id: str) -> None:
        """A stream was finalized unread: abort its request on the loop's next turn.

        Finalizers run wherever the garbage collector happens to run, including in the middle
        of a scheduler update on this very thread; aborting right there would re-enter the
        scheduler (and could finish a request twice), so the abort is always deferred.
        """
        token = self._token
        if token is None:  # pragma: no cover - streams exist only while the loop serves
            self._consumer_gone(request_id)
            return
        try:
            token.run_sync_soon(self._consumer_gone, request_id)
        except trio.RunFinishedError:
            pass

    def _consumer_gone(self, request_id: str) -> None:
        """The consumer stopped reading: abort its request.  Safe from any thread."""
        token = self._token
        try:
            here = trio.lowlevel.current_trio_token()
        except RuntimeError:
            here = None
        if token is not None and here is not token:
            try:
                token.run_sync_soon(self._consumer_gone, request_id)
            except trio.RunFinishedError:
                pass
            return
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            self._record(_K.CONSUMER_DROP, request_id)
            handle.send.close()
            self._abort((request_id,), "consumer")

    # -- control -------------------------------------------------------------------------

    def abort(self, *request_ids: str) -> None:
        """Abort requests (unknown or finished ids are ignored); no checkpoint.

        A waiting request reaches FINISHED_ABORTED at once.  A running request's stream gets
        its terminal output at once too; its forward stops at the next step boundary (when
        all members of its fused batch are aborted) and any late result is dropped.
        """
        self._abort(request_ids, "api")

    def _abort(self, request_ids: Iterable[str], reason: str) -> None:
        request_ids = tuple(request_ids)
        if not request_ids:
            return
        if self.trace is not None:
            for rid in request_ids:
                if rid in self._handles or self.scheduler.get_request_state(rid) is not None:
                    self._record(_K.ABORT, rid, detail={"reason": reason})
        running = set(self.scheduler.running_request_ids())
        finished = self.scheduler.finish_requests(
            request_ids, _S.FINISHED_ABORTED, trio.current_time()
        )
        stop = [rid for rid in finished if rid in running]
        if stop and self._executor is not None:
            self._executor.abort_requests(stop)
        self._emit_finished(finished)
        # Compute done, output still being packed: drop the output and end it now.
        for rid in request_ids:
            pending = self._pending.pop(rid, None)
            if pending is not None:
                pending.scope.cancel()
                pending.executor.drop_output(pending.announced.async_output_id or "")
                self._deliver_output(pending.state, None, _S.FINISHED_ABORTED)
        self._wake.set()

    async def collective_rpc(
        self,
        method: str,
        *args: Any,
        timeout: float | None = None,
        unique_reply_rank: int | None = 0,
        **kwargs: Any,
    ) -> Any:
        """Run ``method`` on the workers between batches (never during one).

        ``timeout`` of None means ``EngineConfig.rpc_timeout_s`` (itself None: no deadline).
        Raises :class:`StallError` if the timeout passes first (an RPC still queued is then
        skipped), :class:`WorkerError` if a worker raised.  If cancelled while queued, the
        RPC never runs.
        """
        self._check_open()
        if timeout is None:
            timeout = self.config.rpc_timeout_s
        rpc = _PendingRpc(method, args, kwargs, timeout, unique_reply_rank)
        self._rpcs.append(rpc)
        self._wake.set()
        try:
            with trio.fail_after(math.inf if timeout is None else timeout):
                await rpc.done.wait()
        except trio.TooSlowError:
            rpc.abandoned = True
            raise StallError("rpc", f"RPC {method!r} did not finish within {timeout} s") from None
        except BaseException:
            rpc.abandoned = True
            raise
        if rpc.error is not None:
            raise rpc.error
        return rpc.result

    def progress(self, request_id: str) -> tuple[int, int] | None:
        """(steps done, total steps) of a running request, where the backend tracks it."""
        return self.executor.progress(request_id)

    def check_health(self) -> None:
        """Return None when healthy.  Raise :class:`EngineDeadError` if the engine died,
        :class:`EngineClosedError` if it was closed, and :class:`WorkerError` while its worker
        group is failed or restarting (requests wait in the queue meanwhile)."""
        self._check_open()
        executor = self._executor
        if executor is None or executor.is_dead or self._group_state != "running":
            dead = executor.dead_reason if executor is not None else None
            if dead is not None:
                state, reason = "restarting", f"{type(dead).__name__}: {dead}"
            else:
                state, reason = self._group_state, self._last_failure or "starting"
            raise WorkerError(
                f"worker group is {state}: {reason}",
                worker=self._last_failed_rank,
                error_type="WorkerGroupRestarting",
            )

    def _worker_states(self) -> tuple[WorkerState, ...]:
        executor = self._executor
        if executor is None:
            return ()
        states = executor.worker_states()
        if executor.is_dead and self._dead is None and not self._closed:
            states = [dataclasses.replace(w, state="restarting") for w in states]
        return tuple(states)

    def health(self) -> EngineHealth:
        """A snapshot for readiness checks (no checkpoint, never raises)."""
        restarts = self._supervisor.restarts if self._supervisor is not None else 0
        reason: str | None
        if self._dead is not None:
            state, reason = "dead", f"{type(self._dead).__name__}: {self._dead}"
        elif self._closed:
            state, reason = "closed", "engine is closed"
        elif self._executor is None:
            state, reason = "starting", "the worker group is starting"
        elif self._executor.is_dead or self._group_state != "running":
            dead = self._executor.dead_reason
            state = "restarting"
            reason = f"{type(dead).__name__}: {dead}" if dead is not None else self._last_failure
        else:
            state, reason = "ready", None
        return EngineHealth(
            healthy=state == "ready",
            state=state,
            reason=reason,
            restarts=restarts,
            workers=self._worker_states(),
            last_failure=self._last_failure,
        )

    async def wait_ended(self) -> None:
        """Return once the engine has died or been closed (at once if it already has).
        Cancelling the wait is harmless.  A supervisor of engines waits here."""
        await self._ended.wait()

    @property
    def is_closed(self) -> bool:
        return self._closed

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def statistics(self) -> EngineStatistics:
        counts = self._finished_counts
        return EngineStatistics(
            waiting=self.scheduler.num_waiting,
            running=self.scheduler.num_running,
            admitted=self._admitted,
            finished_completed=counts[_S.FINISHED_COMPLETED],
            finished_aborted=counts[_S.FINISHED_ABORTED],
            finished_error=counts[_S.FINISHED_ERROR],
            open_streams=len(self._handles),
            dead=self._dead is not None,
            closed=self._closed,
            restarts=self._supervisor.restarts if self._supervisor is not None else 0,
            requeued=self._requeued,
            worker_group=(
                "failed"
                if self._dead is not None
                else "stopped"
                if self._closed
                else self._group_state
            ),
            workers=self._worker_states(),
            last_failure=self._last_failure,
            queue_wait=PhaseSummary.of(self._timings["queue_wait"]),
            execution=PhaseSummary.of(self._timings["execution"]),
            postprocess=PhaseSummary.of(self._timings["postprocess"]),
            end_to_end=PhaseSummary.of(self._timings["end_to_end"]),
        )

    # -- ending --------------------------------------------------------------------------

    def _terminate_all(self, status: RequestStatus, message: str, error_type: str) -> None:
        live = self.scheduler.live_request_ids()
        if live and self._executor is not None:
            self._executor.abort_requests(live)
        now = trio.current_time()
        finished = self.scheduler.finish_requests(
            live, status, now, error=message, error_type=error_type
        )
        self._emit_finished(finished)
        # Requests whose output is still being packed end with this error too.
        for rid, pending in list(self._pending.items()):
            del self._pending[rid]
            pending.scope.cancel()
            pending.executor.drop_output(pending.announced.async_output_id or "")
            pending.state.error = message
            pending.state.error_type = error_type
            self._deliver_output(pending.state, None, status)
        # Anything else still open (there should be nothing) ends the same way.
        for rid in list(self._handles):
            handle = self._handles.pop(rid)
            log.error("stream of %s was open with no state; ending it", rid)
            try:
                handle.send.send_nowait(
                    DiffusionOutput(
                        request_id=rid,
                        status=status,
                        error=message,
                        error_type=error_type,
                        seed=handle.request.sampling.seed,
                        chunk_index=handle.chunks_sent,
                        total_chunks=handle.chunks_sent + 1,
                    )
                )
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            handle.send.close()
        for rpc in self._rpcs:
            rpc.error = (
                EngineClosedError(message)
                if status is _S.FINISHED_ABORTED
                else EngineDeadError(message)
            )
            rpc.done.set()
        self._rpcs.clear()

    def _die(self, exc: BaseException) -> None:
        if self._dead is not None or self._closed:
            return
        self._dead = exc
        self._ended.set()
        self._group_state = "failed"
        self._record(_K.DEAD, detail={"error": f"{type(exc).__name__}: {exc}"})
        self._terminate_all(
            _S.FINISHED_ERROR, f"engine died: {type(exc).__name__}: {exc}", "EngineDeadError"
        )
        if self._loop_scope is not None:
            self._loop_scope.cancel()

    async def aclose(self) -> None:
        """Close the engine; idempotent.

        Pending streams get a terminal ``EngineClosedError`` output, the forward in flight is
        stopped at its next step, and the executor shuts its workers down.  Afterwards no
        task, thread or model reference of the engine remains.  Shielded from cancellation.
        """
        if self._closed:
            with trio.CancelScope(shield=True):
                await self._close_done.wait()
            return
        self._closed = True
        self._ended.set()
        self._record(_K.CLOSE)
        with trio.CancelScope(shield=True):
            try:
                if self._dead is None:
                    self._terminate_all(
                        _S.FINISHED_ABORTED, "engine is closed", "EngineClosedError"
                    )
                # Close the worker group gracefully first (each worker stops its forward at
                # a step and exits); then stop the loop and the supervisor.
                if self._executor is not None:
                    await self._executor.aclose()
                if self._loop_scope is not None:
                    self._loop_scope.cancel()
                    await self._loop_done.wait()
            finally:
                self._record(_K.CLOSED, detail={"leftovers": self._leftovers()})
                self._close_done.set()

    def _leftovers(self) -> dict[str, int]:
        """What the engine still holds (all zero after a clean close; INV-3)."""
        return {
            "open_streams": len(self._handles),
            "scheduler_states": len(self.scheduler.pending_finished_request_ids())
            + len(self.scheduler.live_request_ids()),
            "pending_outputs": len(self._pending),
            "queued_rpcs": len(self._rpcs),
        }


def raise_for_status(output: DiffusionOutput) -> DiffusionOutput:
    """Return a completed output; raise the matching error for an aborted or failed one."""
    if output.status is _S.FINISHED_COMPLETED:
        return output
    if output.error_type == "EngineClosedError":
        raise EngineClosedError(output.error or "engine is closed")
    if output.error_type == "EngineDeadError":
        raise EngineDeadError(output.error or "engine is dead")
    if output.status is _S.FINISHED_ABORTED:
        raise RequestAbortedError(output.request_id, output.error)
    raise RequestFailedError(output.request_id, output.error or "failed", output.error_type)


async def _warmup(engine: AsyncEngine) -> None:
    """Run one small dummy request (2 steps) through the whole path; kept out of statistics."""
    info = engine.executor.model_info
    size: int | None = 64
    if info is not None:
        # Fixed-size models render only their own size; others warm up small.
        size = None if info.family == "unconditional" else min(64, info.default_height)
    params = SamplingParams(height=size, width=size, num_inference_steps=2, seed=0)
    engine._warming = True
    try:
        await engine.generate("warmup", params, request_id=WARMUP_REQUEST_ID)
    except Exception as exc:
        raise RuntimeError(f"engine warmup failed: {exc}") from exc
    finally:
        engine._warming = False


@asynccontextmanager
async def open_engine(
    config: EngineConfig | None = None,
    *,
    trace: TraceRecorder | None = None,
    **overrides: Any,
) -> AsyncIterator[AsyncEngine]:
    """Start an engine (supervised worker group, model, busy loop, warmup) and yield it when
    ready.

    ``overrides`` are ``EngineConfig`` fields applied on top of ``config``.  ``trace``
    records every lifecycle event (see :mod:`omni_trio.testing`).  Leaving the block for any
    reason closes the engine and cleans up everything (INV-3).  A worker group that cannot
    start raises its error; a warmup failure closes the engine and raises ``RuntimeError``
    from the original error.
    """
    config = (
        (config or EngineConfig()).replace(**overrides) if overrides else (config or EngineConfig())
    )
    async with trio.open_nursery() as nursery:
        engine = AsyncEngine(config, trace=trace)
        try:
            await nursery.start(engine.serve)
        except BaseException:
            await engine.aclose()
            raise
        try:
            if config.warmup:
                await _warmup(engine)
            yield engine
        finally:
            await engine.aclose()
