"""The engine actor: admission, one output stream per request, aborts, control RPCs, the busy loop.

The engine loop is the only owner of the scheduler and the only place that drives the
executor::

    wait for work -> run queued RPCs -> (admission wait) -> schedule -> execute -> update -> emit

Control RPCs run between batches, never during one.  An execution error becomes a per-request
error output and the loop goes on; a scheduler failure or a dead executor kills the engine:
every open stream gets a terminal error and later calls raise :class:`EngineDeadError`.

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
from ..config import EngineConfig
from ..errors import (
    DuplicateRequestError,
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    RequestAbortedError,
    RequestFailedError,
    StallError,
)
from ..executors.base import Executor, open_executor
from .request_stream import RequestStream

__all__ = [
    "WARMUP_REQUEST_ID",
    "AsyncEngine",
    "EngineStatistics",
    "PhaseSummary",
    "open_engine",
]

log = logging.getLogger(__name__)

WARMUP_REQUEST_ID = "omni-trio-warmup"
_TIMING_WINDOW = 1024
_S = RequestStatus


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
    queue_wait: PhaseSummary = field(default_factory=PhaseSummary)
    execution: PhaseSummary = field(default_factory=PhaseSummary)
    postprocess: PhaseSummary = field(default_factory=PhaseSummary)
    end_to_end: PhaseSummary = field(default_factory=PhaseSummary)


@dataclass(eq=False)
class _Handle:
    """The engine's side of one request stream."""

    request: DiffusionRequest
    send: trio.MemorySendChannel[DiffusionOutput]
    chunks_sent: int = 0
    # The total_chunks every preview of this stream announces; fixed at the first preview.
    total_chunks: int | None = None


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

    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        self.scheduler: Scheduler = (
            StepScheduler(config.max_num_seqs)
            if config.step_execution
            else RequestScheduler(config.max_num_seqs, config.request_batch_max_wait_ms)
        )
        self._limits = config.request_limits
        self._step_mode = config.step_execution
        self._handles: dict[str, _Handle] = {}
        self._rpcs: deque[_PendingRpc] = deque()
        self._wake = trio.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._loop_scope: trio.CancelScope | None = None
        self._deliveries: trio.Nursery | None = None
        self._loop_done = trio.Event()
        self._closed = False
        self._close_done = trio.Event()
        self._dead: BaseException | None = None
        self._admitted = 0
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

    # -- the loop ------------------------------------------------------------------------

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The busy loop.  Runs until cancelled (by :meth:`aclose`) or the engine dies."""
        self._token = trio.lowlevel.current_trio_token()
        try:
            with trio.CancelScope() as scope:
                self._loop_scope = scope
                async with trio.open_nursery() as nursery:
                    # Tasks that wait for async outputs (packed after their forward) live
                    # here, so cancelling the loop cancels them too.
                    self._deliveries = nursery
                    task_status.started()
                    await self._run_loop()
        except Exception as exc:  # a scheduler bug or a dead executor
            log.exception("engine loop failed")
            self._die(exc)
        finally:
            self._loop_done.set()

    async def _run_loop(self) -> None:
        scheduler = self.scheduler
        while True:
            while not scheduler.has_unfinished_requests() and not self._rpcs:
                if self._step_mode and scheduler.has_finished_to_report():
                    # Let the workers evict step state of requests that ended while idle.
                    await self._execute(scheduler.schedule(trio.current_time()))
                    continue
                self._wake = trio.Event()
                await self._wake.wait()
            await self._run_rpcs()
            if not scheduler.has_unfinished_requests():
                continue
            while (deadline := scheduler.admission_wait(trio.current_time())) is not None:
                self._wake = trio.Event()
                with trio.move_on_at(deadline):
                    await self._wake.wait()
                if self._rpcs:
                    break
            if self._rpcs:
                continue  # RPCs go first; schedule on the next turn
            sched_out = scheduler.schedule(trio.current_time())
            if sched_out.is_empty:
                if scheduler.num_running == 0:
                    await trio.lowlevel.checkpoint()
                continue
            runner_out = await self._execute(sched_out)
            finished = scheduler.update_from_output(sched_out, runner_out, trio.current_time())
            if self._step_mode:
                self._emit_chunks(sched_out, runner_out, set(finished))
            self._emit_finished(finished, runner_out)
            await trio.lowlevel.checkpoint()

    async def _execute(self, sched_out: SchedulerOutput) -> BatchRunnerOutput:
        executor = self.executor
        try:
            if self.config.step_execution:
                return await executor.execute_step(sched_out)
            return await executor.execute_batch(sched_out)
        except (trio.Cancelled, StallError):
            raise
        except Exception as exc:
            if executor.is_dead:
                raise
            log.warning("execution of %s failed", sched_out.scheduled_request_ids, exc_info=True)
            return BatchRunnerOutput.from_list(
                [RunnerOutput.from_exception(rid, exc) for rid in sched_out.scheduled_request_ids]
            )

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
            if rid not in self._handles or self._deliveries is None:
                self.executor.drop_output(runner.async_output_id)
                self._uncounted.discard(rid)
                return
            self._deliveries.start_soon(self._deliver_when_packed, state, runner)
            return
        self._deliver_output(state, runner, state.status)

    async def _deliver_when_packed(self, state: RequestState, announced: RunnerOutput) -> None:
        """Wait for an async output, then deliver the terminal output.  A packing failure or
        an output that never comes (StallError) ends the request with an error."""
        key = announced.async_output_id
        assert key is not None
        try:
            packed = await self.executor.wait_output(key)
        except trio.Cancelled:
            self.executor.drop_output(key)
            raise
        except Exception as exc:
            if self.executor.is_dead:
                # The worker group died with the output in flight: like every other open
                # stream, this one ends because the engine died.
                packed = RunnerOutput(
                    state.request_id,
                    error=f"engine died: {type(exc).__name__}: {exc}",
                    error_type="EngineDeadError",
                )
            else:
                packed = RunnerOutput.from_exception(state.request_id, exc)
        timings = {**announced.timings, **packed.timings}
        packed = dataclasses.replace(packed, timings=timings)
        if packed.error is not None or packed.images is None:
            state.error = packed.error or "async output carried no images"
            state.error_type = packed.error_type or "MissingOutputError"
            self._deliver_output(state, packed, _S.FINISHED_ERROR)
        else:
            self._deliver_output(state, packed, _S.FINISHED_COMPLETED)

    def _deliver_output(
        self, state: RequestState, runner: RunnerOutput | None, status: RequestStatus
    ) -> None:
        rid = state.request_id
        counted = rid not in self._uncounted
        self._uncounted.discard(rid)
        if counted:
            self._finished_counts[status] += 1
        images: tuple[Any, ...] = ()
        if status is _S.FINISHED_COMPLETED and runner is not None and runner.images:
            images = runner.images
        metrics = self._metrics(state, runner, status, counted=counted)
        output = DiffusionOutput(
            request_id=rid,
            status=status,
            finished=True,
            images=images,
            error=state.error,
            error_type=state.error_type,
            seed=state.request.sampling.seed,
            metrics=metrics,
        )
        handle = self._handles.pop(rid, None)
        if handle is None:
            return  # consumer already gone: the output is dropped, the state is cleaned
        if handle.chunks_sent:
            # The terminal output is always the last chunk.  For a completed request this is
            # what its previews announced; an aborted or failed one ends early.
            output = dataclasses.replace(
                output, chunk_index=handle.chunks_sent, total_chunks=handle.chunks_sent + 1
            )
        try:
            handle.send.send_nowait(output)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        handle.send.close()

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
        self.scheduler.add_request(request, trio.current_time())
        send, receive = trio.open_memory_channel[DiffusionOutput](math.inf)
        self._handles[rid] = _Handle(request, send)
        if rid == WARMUP_REQUEST_ID and self._warming:
            self._uncounted.add(rid)
        else:
            self._admitted += 1
        self._wake.set()
        return RequestStream(
            rid, request.sampling.seed, receive, self._consumer_gone, self._consumer_dropped
        )

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
            handle.send.close()
            self.abort(request_id)

    # -- control -------------------------------------------------------------------------

    def abort(self, *request_ids: str) -> None:
        """Abort requests (unknown or finished ids are ignored); no checkpoint.

        A waiting request reaches FINISHED_ABORTED at once.  A running request's stream gets
        its terminal output at once too; its forward stops at the next step boundary (when
        all members of its fused batch are aborted) and any late result is dropped.
        """
        if not request_ids:
            return
        running = set(self.scheduler.running_request_ids())
        finished = self.scheduler.finish_requests(
            request_ids, _S.FINISHED_ABORTED, trio.current_time()
        )
        stop = [rid for rid in finished if rid in running]
        if stop:
            self.executor.abort_requests(stop)
        self._emit_finished(finished)
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
        """Raise EngineDeadError if the engine or its workers failed, EngineClosedError if
        it was closed; return None when healthy."""
        self._check_open()
        self.executor.check_health()

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
            queue_wait=PhaseSummary.of(self._timings["queue_wait"]),
            execution=PhaseSummary.of(self._timings["execution"]),
            postprocess=PhaseSummary.of(self._timings["postprocess"]),
            end_to_end=PhaseSummary.of(self._timings["end_to_end"]),
        )

    # -- ending --------------------------------------------------------------------------

    def _terminate_all(self, status: RequestStatus, message: str, error_type: str) -> None:
        live = self.scheduler.live_request_ids()
        if live:
            self.executor.abort_requests(live)
        finished = self.scheduler.finish_requests(
            live, status, trio.current_time(), error=message, error_type=error_type
        )
        self._emit_finished(finished)
        # Streams still open here wait for an async output: they end with this error too.
        for rid in list(self._handles):
            handle = self._handles.pop(rid)
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
        self._terminate_all(
            _S.FINISHED_ERROR, f"engine died: {type(exc).__name__}: {exc}", "EngineDeadError"
        )

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
        with trio.CancelScope(shield=True):
            try:
                if self._dead is None:
                    self._terminate_all(
                        _S.FINISHED_ABORTED, "engine is closed", "EngineClosedError"
                    )
                if self._loop_scope is not None:
                    self._loop_scope.cancel()
                    await self._loop_done.wait()
                await self.executor.aclose()
            finally:
                self._close_done.set()


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
    config: EngineConfig | None = None, **overrides: Any
) -> AsyncIterator[AsyncEngine]:
    """Start an engine (executor, workers, model, busy loop, warmup) and yield it when ready.

    ``overrides`` are ``EngineConfig`` fields applied on top of ``config``.  Leaving the block
    for any reason closes the engine and cleans up everything (INV-3).  A warmup failure
    closes the engine and raises ``RuntimeError`` from the original error.
    """
    config = (
        (config or EngineConfig()).replace(**overrides) if overrides else (config or EngineConfig())
    )
    async with open_executor(config) as executor, trio.open_nursery() as nursery:
        engine = AsyncEngine(config, executor)
        await nursery.start(engine.serve)
        try:
            if config.warmup:
                await _warmup(engine)
            yield engine
        finally:
            await engine.aclose()
