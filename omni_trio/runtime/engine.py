"""The engine actor: the trio shell around :class:`~omni_trio._core.engine_core.EngineCore`.

The core decides every per-request matter; this shell feeds it events and carries out its
instructions.  It owns what needs trio: one output channel per request, the RPC queue
(:mod:`.rpc_queue`), the supervised worker group (:mod:`.worker_group`), a deadline timer
and the busy loop::

    wait for work -> run queued RPCs -> (admission wait) -> schedule -> execute -> carry out

Every method runs on the engine's trio thread.  Core events are synchronous (no checkpoint),
so they never interleave; one that fires while instructions are carried out (a result pump
callback) is handled then, nested but never inside another event.  A bug in the loop or the
core, or the supervisor giving up, kills the engine: every stream gets a terminal error and
later calls raise :class:`EngineDeadError`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import secrets
from collections.abc import AsyncIterator, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Literal, overload

import trio
from trio_typing import TaskStatus

from .._core.engine_core import (
    WARMUP_REQUEST_ID,
    AwaitOutput,
    DeliverChunk,
    DeliverTerminal,
    DropOutput,
    EngineCore,
    Instruction,
    StopForwards,
)
from .._core.health import SLEEP_LEVELS, GroupState, SleepState, WorkerState
from .._core.health import EngineHealth as EngineHealth
from .._core.health import EngineStatistics as EngineStatistics
from .._core.health import PhaseSummary as PhaseSummary
from .._core.lifecycle import RequestStatus
from .._core.messages import DiffusionOutput, RunnerOutput, SchedulerOutput
from .._core.model_info import ModelInfo
from .._core.request import DiffusionRequest, SamplingParams
from .._core.scheduler import Scheduler
from .._core.trace import TraceKind, TraceRecorder
from ..config import EngineConfig
from ..errors import (
    EngineClosedError,
    EngineDeadError,
    InvalidConfigError,
    InvalidRequestError,
    PayloadError,
    StallError,
    WorkerError,
)
from ..executors.base import Executor
from ..executors.result_pump import async_output_timeout_s
from .calibration import calibrate
from .pictures import canonical_pictures
from .profiling import EngineProfile
from .request_stream import OutputStreams, RequestStream
from .rpc_queue import RpcQueue
from .stage import STAGES, StageEngine, open_stage_engine
from .worker_group import GroupEvents, WorkerGroup

__all__ = [
    "WARMUP_REQUEST_ID",
    "AsyncEngine",
    "EngineHealth",
    "EngineStatistics",
    "PhaseSummary",
    "open_engine",
]

log = logging.getLogger(__name__)

_S = RequestStatus


def _pulse(event: trio.Event) -> trio.Event:
    event.set()
    return trio.Event()


class AsyncEngine:
    """The engine.  Create it with :func:`open_engine`; never construct it directly."""

    def __init__(self, config: EngineConfig, *, trace: TraceRecorder | None = None) -> None:
        self.config = config
        self.core = EngineCore(
            config.core_config(output_timeout_s=async_output_timeout_s()),
            trace=trace,
            id_prefix=secrets.token_hex(4),
            seed=secrets.randbits(64),
        )
        self._streams = OutputStreams(on_gone=self._consumer_gone)
        self._rpcs = RpcQueue(on_queued=self._wake_loop)
        self._wake = trio.Event()  # work for the loop (set by _wake_loop)
        self._changed = trio.Event()  # pulsed after every carried-out event (wait_idle)
        self._timer_wake = trio.Event()  # a deadline appeared
        self._timer_until = math.inf  # when the deadline task wakes next (inf: idle)
        self._group_changed = trio.Event()
        self._loop_scope: trio.CancelScope | None = None
        self._loop_done = trio.Event()
        self._closing = False
        self._close_done = trio.Event()
        self._ended = trio.Event()  # set when the engine died or closed
        self._executor: Executor | None = None
        # Rank groups the failed groups restarted alone (data parallel), before the current.
        self._past_rank_restarts = 0
        # Whether the supervisor's next ``failed`` event is the running group's (it reported
        # started since the last one) rather than a restart's failed start.
        self._group_up = False
        self._group: WorkerGroup | None = None
        self._warming = False  # warmup traffic is nobody's request: kept out of statistics
        self._ignored_warned: set[str] = set()
        # Sleep and wake run one at a time; the group whose workers were put to sleep (a
        # group started since, by a restart, is put to sleep again before anything else).
        self._sleep_lock = trio.Lock()
        self._asleep_group: Executor | None = None
        self._profile = EngineProfile()  # start_profile / stop_profile (.profiling)

    @property
    def trace(self) -> TraceRecorder | None:
        """The lifecycle trace the core records into (settable: a new recorder takes the
        events from now on)."""
        return self.core.trace

    @trace.setter
    def trace(self, recorder: TraceRecorder | None) -> None:
        self.core.trace = recorder

    @property
    def scheduler(self) -> Scheduler:
        """The core's scheduler (read it; only the core changes it)."""
        return self.core.scheduler

    @property
    def executor(self) -> Executor:
        """The current worker group (a new object after each restart)."""
        if self._executor is None:
            raise EngineClosedError("the engine has no worker group yet")
        return self._executor

    def _wake_loop(self) -> None:
        self._wake.set()

    # -- carrying out --------------------------------------------------------------------

    def _carry_out(self, instructions: Iterable[Instruction], executor: Executor | None) -> None:
        """Do what the core said, in order (no checkpoint).  ``executor`` is the group the
        instructions are about.  An executor that raises never keeps a delivery from
        happening (it is logged: a backend bug)."""
        for ins in instructions:
            if isinstance(ins, DeliverTerminal):
                self._streams.finish(ins.request_id, ins.output)
            elif isinstance(ins, DeliverChunk):
                self._streams.send(ins.request_id, ins.output)
            elif executor is not None:
                try:
                    if isinstance(ins, StopForwards):
                        executor.abort_requests(ins.request_ids)
                    elif isinstance(ins, DropOutput):
                        executor.drop_output(ins.key)
                    elif self.core.awaits(ins.request_id, ins.key):  # AwaitOutput, still wanted
                        self._claim(executor, ins)
                except Exception:
                    log.exception("executor failed to carry out %r", ins)
        self._changed = _pulse(self._changed)
        self._wake.set()

    def _claim(self, executor: Executor, ins: AwaitOutput) -> None:
        callback = functools.partial(self._on_output, executor, ins.request_id, ins.key)
        try:
            executor.claim_output(ins.key, callback)
        except Exception as exc:  # the pump failed already: the output is lost with it
            callback(None, exc)
        self._deadline_added()

    def _deadline_added(self) -> None:
        """Wake the deadline task if the core's next deadline is now sooner than its own."""
        deadline = self.core.next_deadline()
        if deadline is not None and deadline < self._timer_until:
            self._timer_wake.set()

    def _on_output(
        self,
        executor: Executor,
        request_id: str,
        key: str,
        output: Any,
        error: BaseException | None,
    ) -> None:
        """The result pump resolved a claimed output (on this thread)."""
        now = trio.current_time()
        core = self.core
        try:
            if error is None and isinstance(output, RunnerOutput):
                instructions = core.output_ready(request_id, key, output, now)
            else:
                if error is None:
                    error = TypeError(f"output {key!r} is a {type(output).__name__}")
                # A remote packing error is the request's; anything else lost the group.
                lost = executor.is_dead or not isinstance(error, WorkerError)
                instructions = core.output_lost(
                    request_id, key, str(error), type(error).__name__, now, group_lost=lost
                )
            self._carry_out(instructions, executor)
        except Exception as exc:  # a bug in the core: nothing can be trusted any more
            log.exception("engine core failed on an output of %s", request_id)
            self._die(exc)

    # -- the worker group --------------------------------------------------------------

    def _group_events(self) -> GroupEvents:
        return GroupEvents(
            started=self._group_started,
            failed=self._group_failed,
            restarting=lambda: None,  # the supervisor counts them (WorkerGroup.restarts)
            gave_up=self._die,
            wanted=lambda: self.core.accepting,
            excused=lambda: self.core.failure_excused,
        )

    def _group_started(self, executor: Executor) -> None:
        """A worker group started: make it the current one and wake the loop."""
        old = self.core.model_info
        if old is not None and executor.model_info not in (None, old):
            log.warning("the restarted worker group reports different model info")
        previous = self._executor
        if previous is not None and previous is not executor:
            self._past_rank_restarts += getattr(previous, "rank_restarts", 0)
        self._executor = executor
        self._group_up = True
        self.core.group_started(executor.model_info, trio.current_time())
        if self.core.generation > 1:
            log.warning("worker group restarted (generation %d)", self.core.generation)
        self._group_changed = _pulse(self._group_changed)
        self._changed = _pulse(self._changed)
        self._wake.set()

    def _group_failed(self, error: BaseException | None) -> None:
        was_up, self._group_up = self._group_up, False
        self._observe_group()
        if self.core.group is GroupState.RUNNING and self.core.accepting:
            # The group ended without failing closed (a backend bug): the same thing.
            error = error or WorkerError("worker group exited")
            self._carry_out(
                self.core.group_failed(str(error), type(error).__name__, trio.current_time()),
                self._executor,
            )
        elif not was_up and error is not None and self.core.group is GroupState.RESTARTING:
            # A restart's start failed (a worker died or hung while starting): health says
            # so while the supervisor tries again.  (The running group's own failure, which
            # the core may have seen first through _observe_group, is not one.)
            self.core.start_failed(str(error), type(error).__name__)

    def _observe_group(self) -> None:
        """If the current group failed closed and the core does not know yet, tell it."""
        executor = self._executor
        if executor is None or not executor.is_dead or self.core.group is not GroupState.RUNNING:
            return
        reason = executor.dead_reason
        rank = getattr(reason, "worker", None)
        instructions = self.core.group_failed(
            str(reason),
            type(reason).__name__,
            trio.current_time(),
            rank=rank if isinstance(rank, int) else None,
            stall_phase=reason.phase if isinstance(reason, StallError) else None,
        )
        self._carry_out(instructions, executor)

    # -- the loop ------------------------------------------------------------------------

    async def serve(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the supervised worker group, then run the busy loop until cancelled (by
        :meth:`aclose`) or until the engine dies.  A worker group that fails to start the
        first time raises here (nothing is retried: that is a configuration error)."""
        started = False
        try:
            with trio.CancelScope() as scope:
                self._loop_scope = scope
                async with trio.open_nursery() as nursery:
                    self._group = WorkerGroup(self.config, self._group_events())
                    await nursery.start(self._group.serve)
                    nursery.start_soon(self._serve_deadlines)
                    started = True
                    # From now on only aclose() (or death) ends the loop and the workers: a
                    # cancellation from outside must not tear the worker group down
                    # abruptly while open_engine's exit closes it gracefully.
                    scope.shield = True
                    task_status.started()
                    await self._run_loop()
        except Exception as exc:  # a bug in the loop or the core
            if not started:
                raise
            log.exception("engine loop failed")
            self._die(exc)
        finally:
            self._loop_done.set()

    async def _serve_deadlines(self) -> None:
        """Sleep until the core's next deadline (a PACKING output's, or a request's
        ``deadline_s``), then let it expire."""
        core = self.core
        while True:
            self._timer_wake = trio.Event()
            deadline = core.next_deadline()
            self._timer_until = math.inf if deadline is None else deadline
            with trio.move_on_at(self._timer_until):
                await self._timer_wake.wait()
            now = trio.current_time()
            if deadline is not None and now >= deadline:
                self._carry_out(core.expire(now), self._executor)

    async def _run_loop(self) -> None:
        core = self.core
        while True:
            self._observe_group()
            executor = self._executor
            if executor is None or core.group is not GroupState.RUNNING:
                await self._group_changed.wait()  # a new group; death cancels the loop
                continue
            if core.sleep_state is SleepState.ASLEEP and self._asleep_group is not executor:
                await self._sleep_again(executor)
                continue
            if not core.has_work() and not self._rpcs:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            await self._rpcs.run_pending(executor)
            self._changed = _pulse(self._changed)
            if not core.has_work():
                continue
            while (deadline := core.admission_wait(trio.current_time())) is not None:
                self._wake = trio.Event()
                with trio.move_on_at(deadline):
                    await self._wake.wait()
                if self._rpcs or executor.is_dead:
                    break
            if self._rpcs or executor.is_dead:
                continue  # RPCs go first; schedule on the next turn
            sched_out = core.schedule(trio.current_time(), worker=executor.output_rank)
            if sched_out is None:
                await trio.lowlevel.checkpoint()
                continue
            await self._execute(executor, sched_out)
            await trio.lowlevel.checkpoint()

    async def _execute(self, executor: Executor, sched_out: SchedulerOutput) -> None:
        try:
            if self.config.step_execution:
                result = await executor.execute_step(sched_out)
            else:
                result = await executor.execute_batch(sched_out)
        except trio.Cancelled:
            raise
        except Exception as exc:
            if executor.is_dead:
                self._observe_group()  # the forward is written off; its requests requeued
                return
            if isinstance(exc, StallError):
                raise
            if isinstance(exc, PayloadError):  # nothing was sent; the group is fine
                log.warning("could not send %s: %s", sched_out.scheduled_request_ids, exc)
                instructions = self.core.payload_rejected(sched_out, str(exc), trio.current_time())
                self._carry_out(instructions, executor)
                return
            if self.core.accepting:
                log.warning(
                    "execution of %s failed", sched_out.scheduled_request_ids, exc_info=True
                )
            instructions = self.core.execution_failed(
                sched_out, str(exc) or repr(exc), type(exc).__name__, trio.current_time()
            )
            self._carry_out(instructions, executor)
            return
        if executor.is_dead:
            # The group failed while this call ran (an in-process worker told to stop
            # everything returns "aborted" for requests nobody aborted): its results are not
            # trusted; the core writes the forward off and its requests run again.
            self._observe_group()
            return
        instructions = self.core.runner_output(
            sched_out, result, trio.current_time(), worker=executor.output_rank
        )
        self._carry_out(instructions, executor)

    # -- admission -----------------------------------------------------------------------

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
        longer accepts work.  A seed is chosen now if the request has none, and a picture to
        start from is made a loaded RGB image (its mask L) here (:mod:`.pictures`).
        """
        core = self.core
        core.check_open()
        request = core.build_request(prompt_or_request, params, request_id)
        sampling = request.sampling
        if isinstance(sampling, SamplingParams) and sampling.image is not None:
            # Loaded RGB / L now: a picture that cannot be read is the caller's error.
            request = request.replace(sampling=canonical_pictures(sampling))
        counted = not (self._warming and request.request_id == WARMUP_REQUEST_ID)
        request = core.admit(request, trio.current_time(), counted=counted)
        if core.model_info is not None and counted:
            self._warn_ignored(core.model_info.ignored(request.sampling))
        stream = self._streams.open(request.request_id, request.sampling.seed)
        if request.sampling.deadline_s is not None:
            self._deadline_added()
        self._wake.set()
        return stream

    def _warn_ignored(self, names: tuple[str, ...]) -> None:
        """Say once per engine and field that the model does not use a field it was given."""
        for name in names:
            if name not in self._ignored_warned:
                self._ignored_warned.add(name)
                log.warning("model %s ignores %s", self.config.model, name)

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

    def _consumer_gone(self, request_id: str) -> None:
        """The consumer of ``request_id``'s current stream left it: abort the request."""
        self._carry_out(self.core.consumer_gone(request_id, trio.current_time()), self._executor)

    # -- control -------------------------------------------------------------------------

    def abort(self, *request_ids: str) -> None:
        """Abort requests (unknown or finished ids are ignored); no checkpoint.

        A waiting request reaches FINISHED_ABORTED at once.  A running request's stream gets
        its terminal output at once too; its forward stops at the next step boundary (when
        all members of its fused batch are aborted) and any late result is dropped.  A
        request whose output is being packed ends at once and its output is dropped.
        """
        self._carry_out(self.core.abort(request_ids, trio.current_time()), self._executor)

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
        self.core.check_open()
        if timeout is None:
            timeout = self.config.rpc_timeout_s
        return await self._rpcs.call(
            method, args, kwargs, timeout=timeout, unique_reply_rank=unique_reply_rank
        )

    @property
    def model_info(self) -> ModelInfo | None:
        """What the worker group reported about its model; None before it first started."""
        return self.core.model_info

    @property
    def profiling(self) -> bool:
        """Between :meth:`start_profile` and :meth:`stop_profile`."""
        return self._profile.active

    async def start_profile(
        self, directory: str | os.PathLike[str], prefix: str | None = None
    ) -> None:
        """Start ``torch.profiler`` on every worker, between batches (a control RPC).

        Each worker will write ``<directory>/<prefix>-rank<N>.json``, a Chrome trace
        (chrome://tracing, Perfetto); ``directory`` is made if missing, a relative one is
        each worker process's.  ``prefix`` defaults to ``omni-trio-<date-time>-<hex>``.
        Raises ``RuntimeError`` while profiling, ``ValueError`` for a bad prefix, and
        :class:`WorkerError` when a worker cannot start (no worker is left profiling then).
        See :mod:`omni_trio.runtime.profiling`.
        """
        self.core.check_open()
        await self._profile.start(self.collective_rpc, directory, prefix)

    async def stop_profile(self) -> list[str]:
        """Stop profiling (between batches); every worker writes its trace.  Returns their
        absolute paths, one per rank.  Raises ``RuntimeError`` when not profiling and
        :class:`WorkerError` when a worker could not write its trace, or was not profiling
        (its group restarted meanwhile); the engine profiles no more either way."""
        self.core.check_open()
        return await self._profile.stop(self.collective_rpc)

    def progress(self, request_id: str) -> tuple[int, int] | None:
        """(steps done, total steps) of a running request, where the backend tracks it."""
        return self.executor.progress(request_id)

    def step_times(self) -> dict[int, float]:
        """Seconds one denoising step of one image takes, by pixels per image, as measured
        on this engine's dispatches (``EngineCore.step_times``; empty before any).  No
        checkpoint."""
        return self.core.step_times

    def queue_position(self, request_id: str) -> int | None:
        """Waiting requests that start before this waiting one (0: it is next; None when
        it is not waiting).  No checkpoint; O(waiting)."""
        return self.scheduler.queue_position(request_id)

    def status(self, request_id: str) -> RequestStatus | None:
        """Where an admitted request is in its lifecycle (no checkpoint); None once its state
        is removed (it ended) or for an unknown id."""
        return self.core.status_of(request_id)

    # -- sleep and wake ----------------------------------------------------------------

    async def sleep(self, level: int = 1) -> list[dict[str, Any]]:
        """Put the workers to sleep: release the model's weights at ``level``.

        Level 1 keeps a copy off the device (on an accelerator in host memory, on a CPU in
        a file under ``EngineConfig.sleep_dir``); level 2 keeps nothing, and
        :meth:`wake_up` reloads the weights from the model's directory.  From the call on no
        waiting request starts (nor is admitted, with ``reject_while_asleep``: then
        :class:`EngineAsleepError`); the requests running and the outputs being packed
        finish first, within ``sleep_drain_timeout_s``.  Then every worker drains its
        output packer and releases its weights, between forwards, never during one.
        Requests that arrive meanwhile wait and run after :meth:`wake_up`.

        Returns each rank's report (``rank``, ``level``, ``released_bytes``, ``rss_bytes``).
        Raises :class:`InvalidRequestError` for a level other than 1 or 2,
        :class:`StallError` (phase ``sleep``, naming them) if the running requests or the
        outputs being packed did not finish in time, and what a worker raised (a
        :class:`WorkerError`; an engine that was awake has every rank woken again; a
        worker's packer that did not drain in time is a :class:`StallError` too).  After
        any failure the engine is as it was (awake and waiting requests start, or asleep at
        its former level).  Sleeping when asleep at a deeper level changes nothing; a second
        sleep or wake waits for the first.  If cancelled while waiting for the running
        requests, the engine stays as it was; once the workers were asked, it waits for
        their answer.  :class:`EngineClosedError` / :class:`EngineDeadError` if the engine
        ends first.
        """
        if level not in SLEEP_LEVELS or isinstance(level, bool):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level!r}", param="level")
        core = self.core
        async with self._sleep_lock:
            was_awake = core.sleep_state is SleepState.AWAKE
            core.begin_sleep(level, trio.current_time())
            self._wake.set()
            reports: list[dict[str, Any]] = []
            asked = False
            try:
                await self._wait_not_busy()
                core.check_open()  # (no checkpoint from here to the queued RPC)
                asked = True
                with trio.CancelScope(shield=True):
                    reports = await self._rpcs.call(
                        "sleep",
                        (level,),
                        {"drain_timeout_s": self.config.sleep_drain_timeout_s},
                        timeout=self.config.rpc_timeout_s,
                        unique_reply_rank=None,
                    )
            except BaseException as exc:
                core.sleep_failed(trio.current_time(), f"{type(exc).__name__}: {exc}")
                self._wake.set()
                if asked and was_awake and core.accepting:
                    with trio.CancelScope(shield=True):
                        await self._wake_every_rank()
                if isinstance(exc, WorkerError) and exc.error_type == "StallError":
                    raise StallError("sleep", str(exc)) from exc  # a packer that did not drain
                raise
            core.fell_asleep(level, trio.current_time())
            self._asleep_group = self._executor
            self._changed = _pulse(self._changed)
            return reports

    async def _wait_not_busy(self) -> None:
        """Wait (bounded by ``sleep_drain_timeout_s``) until nothing runs or packs."""
        core = self.core
        timeout = self.config.sleep_drain_timeout_s
        with trio.move_on_after(timeout):
            while core.busy_ids():
                await self._changed.wait()
            return
        raise StallError(
            "sleep",
            f"requests {core.busy_ids()} were still running or being packed after "
            f"{timeout} s (sleep_drain_timeout_s); the engine stays awake",
        )

    async def _wake_every_rank(self) -> None:
        """After a failed sleep: wake every rank that did sleep (best effort, logged)."""
        try:
            await self._rpcs.call(
                "wake_up", (), {}, timeout=self.config.rpc_timeout_s, unique_reply_rank=None
            )
        except Exception:
            log.exception("could not wake the workers after a failed sleep")

    async def _sleep_again(self, executor: Executor) -> None:
        """A group started while the engine sleeps (a restart): put it to sleep too."""
        self._asleep_group = executor
        try:
            await executor.collective_rpc(
                "sleep",
                self.core.sleep_level,
                timeout=self.config.rpc_timeout_s,
                unique_reply_rank=None,
                drain_timeout_s=self.config.sleep_drain_timeout_s,
            )
        except Exception:
            log.exception("could not put the restarted worker group to sleep")

    async def wake_up(self) -> list[dict[str, Any]]:
        """Give the workers their weights back; waiting requests start again.  Returns each
        rank's report (``rank``, ``restored_bytes``, ``rss_bytes``), ``[]`` when awake.

        Raises what a worker raised (e.g. a :class:`WorkerError` when a level-2 reload
        failed): the engine then stays asleep and ``wake_up`` may be tried again.  If the
        worker group fails meanwhile (a worker died before or while it answered), the wake
        is done all the same and returns ``[]``: the group that replaces it loads its
        weights when it starts, and is not put to sleep again.  Once the workers were
        asked, cancelling waits for their answer."""
        core = self.core
        async with self._sleep_lock:
            core.check_open()
            if not core.begin_wake(trio.current_time()):
                return []
            executor, generation = self._executor, core.generation
            try:
                with trio.CancelScope(shield=True):
                    reports: list[dict[str, Any]] = await self._rpcs.call(
                        "wake_up",
                        (),
                        {},
                        timeout=self.config.rpc_timeout_s,
                        unique_reply_rank=None,
                    )
            except Exception as exc:
                if not (core.accepting and self._group_lost_since(executor, generation)):
                    core.wake_failed(trio.current_time(), f"{type(exc).__name__}: {exc}")
                    raise
                log.warning(
                    "the worker group failed while waking up (%s): its successor starts awake", exc
                )
                reports = []
            except BaseException as exc:
                core.wake_failed(trio.current_time(), f"{type(exc).__name__}: {exc}")
                raise
            core.woke(trio.current_time())
            self._asleep_group = None
            self._changed = _pulse(self._changed)
            self._wake.set()
            return reports

    def _group_lost_since(self, executor: Executor | None, generation: int) -> bool:
        """The group that was current (``executor``, core ``generation``) has failed: a
        restart is under way or done."""
        self._observe_group()
        return (
            executor is None
            or executor.is_dead
            or self._executor is not executor
            or self.core.generation != generation
            or self.core.group is not GroupState.RUNNING
        )

    @property
    def is_sleeping(self) -> bool:
        """Falling asleep, asleep or waking up (no waiting request starts)."""
        return self.core.sleep_state is not SleepState.AWAKE

    # -- health, statistics, leftovers -----------------------------------------------------

    def _workers(self) -> tuple[WorkerState, ...]:
        executor = self._executor
        return tuple(executor.worker_states()) if executor is not None else ()

    def check_health(self) -> None:
        """Return None when healthy.  Raise :class:`EngineDeadError` if the engine died,
        :class:`EngineClosedError` if it was closed, and :class:`WorkerError` while its worker
        group is failed or restarting (requests wait in the queue meanwhile)."""
        self._observe_group()
        self.core.check_health()

    def health(self) -> EngineHealth:
        """A snapshot for readiness checks (no checkpoint, never raises)."""
        self._observe_group()
        return self.core.health(self._workers(), self._restarts())

    def statistics(self) -> EngineStatistics:
        self._observe_group()
        stats = self.core.statistics(self._workers(), self._restarts())
        current = getattr(self._executor, "rank_restarts", 0)
        return dataclasses.replace(stats, rank_restarts=self._past_rank_restarts + current)

    def _restarts(self) -> int:
        return self._group.restarts if self._group is not None else 0

    def leftovers(self) -> dict[str, set[str]]:
        """Every per-request resource the engine holds in its own process, by kind, as
        owning request ids: the core's, the open streams and the executor's (its result
        pump).  No checkpoint.  Read by :func:`omni_trio.testing.check_leftovers` (INV-3);
        :meth:`worker_leftovers` adds the workers'."""
        held = self.core.leftovers()
        held["engine_streams"] = self._streams.ids()
        executor = self._executor
        if executor is not None:
            for kind, ids in executor.leftovers().items():
                held.setdefault(kind, set()).update(ids)
        return held

    async def worker_leftovers(self) -> dict[str, set[str]]:
        """What every worker holds per request (runner and step state, stop flags, the
        output packer's queue), merged over ranks: a ``leftovers`` RPC, so it runs between
        batches."""
        replies = await self.collective_rpc("leftovers", unique_reply_rank=None)
        held: dict[str, set[str]] = {}
        for reply in replies:
            for kind, ids in reply.items():
                held.setdefault(kind, set()).update(ids)
        return held

    def is_idle(self) -> bool:
        """The worker group is up with nothing queued, running, packing, to report or RPC'd
        (or the engine has ended).  Its workers may still be delivering: :meth:`wait_idle`
        waits for them too."""
        core = self.core
        if not core.accepting:
            return True
        return (
            core.group is GroupState.RUNNING
            and not core.has_work()
            # (Held by a sleep, waiting requests are no work now, but the engine is not idle.)
            and not core.scheduler.has_unfinished_requests()
            and core.dispatch is None
            and core.scheduler.num_packing == 0
            and not self._rpcs
            and not self._rpcs.running
        )

    async def wait_idle(self) -> None:
        """Return once the engine is idle and everything its workers announced has arrived
        or been released.  Unbounded (callers bound it); cancelling it is harmless."""
        while True:
            while not self.is_idle():
                await self._changed.wait()
            executor = self._executor
            if executor is None or not self.core.accepting:
                return
            await executor.wait_settled()
            if self.is_idle():
                return

    async def wait_ended(self) -> None:
        """Return once the engine has died or been closed (at once if it already has).
        Cancelling the wait is harmless.  A supervisor of engines waits here."""
        await self._ended.wait()

    @property
    def is_closed(self) -> bool:
        return self.core.closed

    @property
    def is_dead(self) -> bool:
        return self.core.dead is not None

    # -- ending --------------------------------------------------------------------------

    def _die(self, exc: BaseException) -> None:
        core = self.core
        if core.dead is not None or core.closed:
            return
        self._ended.set()
        self._carry_out(core.die(exc, trio.current_time()), self._executor)
        self._end_streams(f"engine died: {type(exc).__name__}: {exc}", "EngineDeadError")
        self._rpcs.fail_all(EngineDeadError(f"engine died: {type(exc).__name__}: {exc}"))
        self._group_changed = _pulse(self._group_changed)
        if self._loop_scope is not None:
            self._loop_scope.cancel()

    async def aclose(self) -> None:
        """Close the engine; idempotent.

        Pending streams get a terminal ``EngineClosedError`` output, the forward in flight is
        stopped at its next step, and the executor shuts its workers down.  Afterwards no
        task, thread or model reference of the engine remains.  Shielded from cancellation.
        """
        if self._closing:
            with trio.CancelScope(shield=True):
                await self._close_done.wait()
            return
        self._closing = True
        self._ended.set()
        with trio.CancelScope(shield=True):
            try:
                dead = self.core.dead is not None
                self._carry_out(self.core.close(trio.current_time()), self._executor)
                if not dead:
                    self._end_streams("engine is closed", "EngineClosedError")
                    self._rpcs.fail_all(EngineClosedError("engine is closed"))
                # Close the worker group gracefully first (each worker stops its forward at
                # a step and exits); then stop the loop and the supervisor.
                if self._executor is not None:
                    await self._executor.aclose()
                if self._loop_scope is not None:
                    self._loop_scope.cancel()
                    await self._loop_done.wait()
            finally:
                self._record_closed()
                self._close_done.set()

    def _end_streams(self, message: str, error_type: str) -> None:
        """A safety net: a stream still open once the core has ended everything (there
        should be none) gets a terminal error, so no consumer waits forever."""
        status = _S.FINISHED_ABORTED if error_type == "EngineClosedError" else _S.FINISHED_ERROR
        ended = self._streams.end_all(
            lambda rid: DiffusionOutput(rid, status, error=message, error_type=error_type)
        )
        if ended:
            log.error("streams of %s were open with no request behind them; ended", ended)

    def _record_closed(self) -> None:
        trace = self.trace
        if trace is None:
            return
        held: dict[str, Any] = {k: sorted(v) for k, v in self.leftovers().items() if v}
        if self._rpcs:
            held["queued_rpcs"] = self._rpcs.methods
        trace.record(trio.current_time(), TraceKind.CLOSED, detail={"leftovers": held})


def raise_for_status(output: DiffusionOutput) -> DiffusionOutput:
    """Return a completed output; raise the matching error for an aborted or failed one."""
    return output.raise_for_status()


async def _warmup(engine: AsyncEngine) -> None:
    """Run one small dummy request (2 steps) through the whole path, then measure the model
    for the compute budget (:mod:`.calibration`); kept out of statistics."""
    info = engine.executor.model_info
    params = (
        info.warmup_sampling()
        if info is not None
        else SamplingParams(height=64, width=64, num_inference_steps=2, seed=0)
    )
    engine._warming = True
    try:
        await engine.generate("warmup", params, request_id=WARMUP_REQUEST_ID)
    except Exception as exc:
        raise RuntimeError(f"engine warmup failed: {exc}") from exc
    try:
        await calibrate(engine)  # the compute budget's measurement
    finally:
        engine._warming = False


@overload
def open_engine(
    config: EngineConfig | None = None,
    *,
    trace: TraceRecorder | None = None,
    stage: Literal["inline"] = "inline",
    **overrides: Any,
) -> AbstractAsyncContextManager[AsyncEngine]: ...


@overload
def open_engine(
    config: EngineConfig | None = None,
    *,
    trace: TraceRecorder | None = None,
    stage: Literal["process"],
    **overrides: Any,
) -> AbstractAsyncContextManager[StageEngine]: ...


@overload
def open_engine(
    config: EngineConfig | None = None,
    *,
    trace: TraceRecorder | None = None,
    stage: str,
    **overrides: Any,
) -> AbstractAsyncContextManager[AsyncEngine | StageEngine]: ...


def open_engine(
    config: EngineConfig | None = None,
    *,
    trace: TraceRecorder | None = None,
    stage: str = "inline",
    **overrides: Any,
) -> AbstractAsyncContextManager[AsyncEngine | StageEngine]:
    """Start an engine (supervised worker group, model, busy loop, warmup) and yield it when
    ready.

    ``overrides`` are ``EngineConfig`` fields applied on top of ``config``.  ``trace``
    records every lifecycle event (see :mod:`omni_trio.testing`).  Leaving the block for any
    reason closes the engine and cleans up everything (INV-3).  A worker group that cannot
    start raises its error; a warmup failure closes the engine and raises ``RuntimeError``
    from the original error.

    ``stage="process"`` runs the whole engine in a child process and yields a
    :class:`~omni_trio.runtime.stage.StageEngine` with the same API (see
    :mod:`omni_trio.runtime.stage`); it records no trace here (``trace`` must be None).
    """
    config = (
        (config or EngineConfig()).replace(**overrides) if overrides else (config or EngineConfig())
    )
    if stage == "inline":
        return _open_inline_engine(config, trace)
    if stage != "process":
        raise InvalidConfigError(
            f"stage must be one of {', '.join(STAGES)}, got {stage!r}", field="stage"
        )
    if trace is not None:
        raise InvalidConfigError(
            "a process-backed stage records no trace in the caller", field="stage"
        )
    return open_stage_engine(config)


@asynccontextmanager
async def _open_inline_engine(
    config: EngineConfig, trace: TraceRecorder | None
) -> AsyncIterator[AsyncEngine]:
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
