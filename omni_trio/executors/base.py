"""The executor contract: runs scheduler decisions, never makes them (INV-2).

An executor is an actor started by :func:`open_executor` in its own nursery: ``serve`` loads
the worker group and reports ready through ``task_status.started()``; the engine then calls
``execute_batch`` (request mode) or ``execute_step`` (step mode) one at a time, and
``collective_rpc`` only between them.  ``abort_requests`` is synchronous and never waits: it
sets the stop flags that running forwards check at their next step boundary.

A backend that can no longer be trusted (a worker died, a fatal error) *fails closed*:
``is_dead`` turns True, every later call raises :class:`EngineDeadError`, and the engine
decides what happens to its requests.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any, ClassVar

import trio
from trio_typing import TaskStatus

from .._core.health import WorkerState as WorkerState
from .._core.health import WorkerStatus
from .._core.messages import BatchRunnerOutput, RunnerOutput, SchedulerOutput
from .._core.model_info import ModelInfo
from ..config import EngineConfig
from ..errors import EngineClosedError, EngineDeadError, InvalidConfigError
from .result_pump import OutputCallback, ResultPump, register_async_outputs

__all__ = [
    "BUILTIN_BACKENDS",
    "Executor",
    "WorkerState",
    "open_executor",
    "resolve_executor_class",
]


class Executor(abc.ABC):
    """Base class of every backend (inproc, tractor, ray, or a user's subclass).

    ``one_per_process``: at most one executor of this class may run in a process at a time
    (tractor keeps one runtime per process), so an engine pool cannot hold several.
    ``output_rank``: the rank whose replies carry results (the one trace events name).
    """

    one_per_process: ClassVar[bool] = False
    output_rank: int = 0

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_info: ModelInfo | None = None
        self._dead_reason: BaseException | None = None
        # Set by backends with async output: the reader of OUTPUT_READY replies.
        self._pump: ResultPump | None = None
        self._closed = False
        self._failed = trio.Event()

    # -- lifecycle ----------------------------------------------------------------------

    @abc.abstractmethod
    async def serve(self, *, task_status: TaskStatus[Executor] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the workers, load the model, call ``task_status.started(self)``, then run
        until cancelled.  Cancellation stops the workers (bounded) and releases everything."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Stop in-flight work at its next step, shut the workers down (ask, bounded wait,
        terminate); idempotent and shielded from cancellation."""

    # -- execution ----------------------------------------------------------------------

    @abc.abstractmethod
    async def execute_batch(self, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
        """Request mode: run the wave in ``scheduler_output``; outputs keyed by request id.

        Per-request failures come back as error outputs.  Raises only when the executor
        itself failed (then ``is_dead`` is True) or was closed.  If cancelled, the forward is
        stopped at its next step and its results are discarded.
        """

    async def execute_step(self, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
        """Step mode: run one denoising step for every scheduled request."""
        raise NotImplementedError(f"{type(self).__name__} does not support step execution")

    @abc.abstractmethod
    async def collective_rpc(
        self,
        method: str,
        *args: Any,
        timeout: float | None = None,
        unique_reply_rank: int | None = 0,
        **kwargs: Any,
    ) -> Any:
        """Call ``method`` on every worker.  Returns the reply of ``unique_reply_rank``, or a
        list of every rank's reply when it is None.  Raises :class:`StallError` on timeout."""

    @abc.abstractmethod
    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Mark requests aborted so running forwards stop at their next step; never blocks."""

    async def wait_output(self, async_output_id: str) -> RunnerOutput:
        """The packed output announced by a runner output's ``async_output_id``.

        Backends with async output set ``self._pump`` (the sole reader of OUTPUT_READY
        replies).  Raises :class:`StallError` if the output does not come within the
        async-output timeout, the pump's failure if the worker group failed.
        """
        if self._pump is None:
            raise RuntimeError(f"{type(self).__name__} has no async outputs")
        output: RunnerOutput = await self._pump.wait_output(async_output_id)
        return output

    def claim_output(self, async_output_id: str, callback: OutputCallback) -> None:
        """Take the packed output announced as ``async_output_id`` when it arrives:
        ``callback(output, None)``, or ``callback(None, error)`` if it cannot come (its
        packing failed remotely, or the worker group failed).  The callback runs in the
        engine's trio thread, possibly before this returns.  :meth:`drop_output` withdraws
        the claim.  Raises ``RuntimeError`` for a backend without async outputs."""
        if self._pump is None:
            raise RuntimeError(f"{type(self).__name__} has no async outputs")
        self._pump.claim(async_output_id, callback)

    def drop_output(self, async_output_id: str) -> None:
        """Nobody will wait for this output (its request was aborted or its consumer left):
        release it now, or when it arrives.  Backends without async outputs ignore it."""
        if self._pump is not None:
            self._pump.drop(async_output_id)

    def _announce_async_outputs(self, result: BatchRunnerOutput) -> None:
        """Register the batch splits a request-mode result announced with the pump."""
        if self._pump is not None:
            register_async_outputs(self._pump, result)

    def progress(self, request_id: str) -> tuple[int, int] | None:
        """(steps done, total steps) of a running request, if the backend tracks it."""
        return None

    # -- health -------------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self._dead_reason is not None

    @property
    def dead_reason(self) -> BaseException | None:
        return self._dead_reason

    def fail(self, reason: BaseException) -> None:
        """Fail closed: remember the first reason; every later call raises EngineDeadError."""
        if self._dead_reason is None:
            self._dead_reason = reason
            self._failed.set()

    async def wait_failed(self) -> BaseException:
        """Return the failure once the group has failed closed (at once if it already has).

        The engine's supervisor waits here to notice a worker dying while idle.  Cancelling
        it is harmless.
        """
        await self._failed.wait()
        assert self._dead_reason is not None
        return self._dead_reason

    def worker_states(self) -> list[WorkerState]:
        """One entry per worker rank: its state and, where the backend knows them, its pid
        and the denoising steps it has run.  Backends override this to say more."""
        state = (
            WorkerStatus.FAILED
            if self._dead_reason is not None
            else (WorkerStatus.STOPPED if self._closed else WorkerStatus.RUNNING)
        )
        return [WorkerState(rank, state) for rank in range(self.config.num_workers)]

    def leftovers(self) -> dict[str, set[str]]:
        """The per-request resources this executor holds in the engine's process, by kind,
        as owning request ids (its result pump's).  The workers' own are asked for with the
        ``leftovers`` RPC.  See :func:`omni_trio.testing.check_leftovers`."""
        return self._pump.leftovers() if self._pump is not None else {}

    async def wait_settled(self) -> None:
        """Return once nothing announced is still on its way (every output expected has
        arrived, been released or been written off with the group).  Unbounded: callers
        bound it.  Backends whose workers hold more add their own drain."""
        if self._pump is not None:
            await self._pump.wait_settled()

    def check_health(self) -> None:
        """Raise EngineDeadError if the worker group failed, EngineClosedError if closed."""
        if self._dead_reason is not None:
            raise EngineDeadError(
                f"executor failed: {type(self._dead_reason).__name__}: {self._dead_reason}"
            ) from self._dead_reason
        if self._closed:
            raise EngineClosedError("executor is closed")


# The built-in backends, by import path: base never imports a backend (they import base).
BUILTIN_BACKENDS: dict[str, str] = {
    "inproc": "omni_trio.executors.inproc:InprocExecutor",
    "tractor": "omni_trio.executors.tractor_executor:TractorExecutor",
    "ray": "omni_trio.executors.ray_executor:RayExecutor",
}


def resolve_executor_class(backend: Any) -> type[Executor]:
    """Map ``EngineConfig.backend`` (a built-in name, an import path ``"pkg.mod:Class"`` or
    an :class:`Executor` subclass) to an executor class; :class:`InvalidConfigError` if it
    names none."""
    if isinstance(backend, type):
        cls: Any = backend
    elif isinstance(backend, str) and (backend in BUILTIN_BACKENDS or ":" in backend):
        module_name, _, attr = BUILTIN_BACKENDS.get(backend, backend).partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise InvalidConfigError(
                f"cannot import executor {backend!r}: {exc}", field="backend"
            ) from exc
    else:
        raise InvalidConfigError(f"unknown backend {backend!r}", field="backend")
    if not (isinstance(cls, type) and issubclass(cls, Executor)):
        raise InvalidConfigError(
            f"backend {backend!r} is not an omni_trio Executor subclass", field="backend"
        )
    return cls


@asynccontextmanager
async def open_executor(config: EngineConfig) -> AsyncIterator[Executor]:
    """Start the configured executor in its own nursery and yield it once its workers are
    ready.  Leaving the block for any reason closes it (bounded) and joins its tasks."""
    cls = resolve_executor_class(config.backend)
    executor = cls(config)
    async with trio.open_nursery() as nursery:
        try:
            await nursery.start(executor.serve)
            yield executor
        finally:
            with trio.CancelScope(shield=True):
                await executor.aclose()
            nursery.cancel_scope.cancel()
