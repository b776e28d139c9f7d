"""Messages between the engine, the scheduler, executors and workers (frozen data).

Every message that concerns a request carries its ``request_id``; batch positions are never
identity.  Results are mapped back by id, whatever order they complete in (INV-5).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import (
    TIMEOUT_ERROR_TYPE,
    EngineClosedError,
    EngineDeadError,
    RequestAbortedError,
    RequestFailedError,
    RequestTimeoutError,
)
from .lifecycle import RequestStatus
from .request import DiffusionRequest

__all__ = [
    "AsyncOutput",
    "AsyncOutputKind",
    "BatchRunnerOutput",
    "DiffusionOutput",
    "Heartbeat",
    "NewRequestData",
    "RequestMetrics",
    "RunnerOutput",
    "SchedulerOutput",
    "WorkerAbort",
    "WorkerCall",
]


@dataclass(frozen=True, slots=True)
class NewRequestData:
    """A request sent to the workers for the first time (its whole payload)."""

    request_id: str
    request: DiffusionRequest

    def __post_init__(self) -> None:
        if self.request.request_id != self.request_id:
            raise ValueError(
                f"envelope id {self.request_id!r} != request id {self.request.request_id!r}"
            )


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """One scheduling decision.

    ``scheduled_new_reqs`` carry payloads; ``scheduled_cached_reqs`` are ids the workers
    already hold state for (step mode).  ``finished_req_ids`` are requests that reached a
    terminal state since the previous output: each id is reported exactly once, so workers
    can free what they hold for it.
    """

    step_id: int
    scheduled_new_reqs: tuple[NewRequestData, ...] = ()
    scheduled_cached_reqs: tuple[str, ...] = ()
    finished_req_ids: frozenset[str] = frozenset()
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0

    @property
    def scheduled_request_ids(self) -> tuple[str, ...]:
        """New ids first, then cached ids (the order of batch rows)."""
        return tuple(r.request_id for r in self.scheduled_new_reqs) + self.scheduled_cached_reqs

    @property
    def is_empty(self) -> bool:
        return not self.scheduled_new_reqs and not self.scheduled_cached_reqs


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """What a worker produced for one request in one execute call.

    Exactly one of: ``images`` (a result), ``error`` (this request failed), ``aborted`` (it
    stopped at a step boundary because it was aborted) or ``async_output_id`` (the payload
    follows as an ``OUTPUT_READY``).  Step mode sets ``step_index`` (steps done so far),
    ``total_steps`` (the steps the worker runs in all, which a model may make fewer than the
    request asked for) and ``finished`` only when the request's denoising is complete; a
    non-terminal chunk may carry preview ``images``.
    """

    request_id: str
    images: tuple[Any, ...] | None = None
    error: str | None = None
    error_type: str | None = None
    aborted: bool = False
    finished: bool = True
    step_index: int | None = None
    total_steps: int | None = None
    async_output_id: str | None = None
    # Worker-side timings in ms, e.g. {"forward_ms": ..., "postprocess_ms": ...}.
    timings: Mapping[str, float] = field(default_factory=dict)
    # Request mode: denoising steps the forward started after the abort of its last member
    # reached the worker; None when not every member was aborted (or in step mode).
    # Promptness (INV-7) allows at most one.
    steps_after_abort: int | None = None

    @classmethod
    def from_exception(cls, request_id: str, exc: BaseException, **kw: Any) -> RunnerOutput:
        return cls(request_id, error=str(exc) or repr(exc), error_type=type(exc).__name__, **kw)


@dataclass(frozen=True, slots=True)
class BatchRunnerOutput:
    """Runner outputs of one execute call, keyed by request id (never by position).

    ``lost``: scheduled requests whose data-parallel rank died under them while the other
    ranks served (``lost_error`` says how); they have no output here and run again."""

    outputs: Mapping[str, RunnerOutput] = field(default_factory=dict)
    lost: frozenset[str] = frozenset()
    lost_error: str = ""

    @classmethod
    def from_list(cls, outputs: Sequence[RunnerOutput]) -> BatchRunnerOutput:
        mapping: dict[str, RunnerOutput] = {}
        for out in outputs:
            if out.request_id in mapping:
                raise ValueError(f"two runner outputs for request {out.request_id!r}")
            mapping[out.request_id] = out
        return cls(mapping)

    def get(self, request_id: str) -> RunnerOutput | None:
        return self.outputs.get(request_id)

    @property
    def request_ids(self) -> tuple[str, ...]:
        return tuple(self.outputs)

    def __len__(self) -> int:
        return len(self.outputs)

    def __iter__(self) -> Iterator[RunnerOutput]:
        return iter(self.outputs.values())


class AsyncOutputKind(enum.Enum):
    RPC_RESULT = "rpc_result"
    COMPUTE_DONE = "compute_done"
    OUTPUT_READY = "output_ready"


@dataclass(frozen=True, slots=True)
class AsyncOutput:
    """A worker reply.  ``RPC_RESULT`` answers the call ``rpc_id``; an execute call whose
    outputs are still being packed is answered by ``COMPUTE_DONE`` instead (the device is
    free; ``result`` holds each request's ``async_output_id``), and the packed outputs follow
    as one ``OUTPUT_READY`` for ``async_output_id``.  The two may arrive in either order.

    ``rank`` and ``steps`` (the denoising steps the rank has run) say who answered and how
    far it is (liveness); a failed call carries ``error``, ``error_type`` and ``traceback``,
    and ``fatal`` when the worker itself is broken (its group must be replaced).
    """

    kind: AsyncOutputKind
    rpc_id: str | None = None
    async_output_id: str | None = None
    result: Any = None
    error: str | None = None
    error_type: str | None = None
    rank: int | None = None
    steps: int | None = None
    traceback: str | None = None
    fatal: bool = False


@dataclass(frozen=True, slots=True)
class WorkerCall:
    """Executor -> every rank of a group: run the worker method ``method``.  Every rank
    answers exactly once (an :class:`AsyncOutput` for ``rpc_id``); only ``reply_rank`` ships
    its result (None: every rank does)."""

    rpc_id: str
    method: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    reply_rank: int | None = 0


@dataclass(frozen=True, slots=True)
class WorkerAbort:
    """Executor -> every rank, out of band (never queued behind a call): set the stop
    flags of ``request_ids`` (``everything``: stop every forward), so a running forward
    stops at its next step boundary."""

    request_ids: tuple[str, ...] = ()
    everything: bool = False


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A rank -> its executor, every ``HEARTBEAT_INTERVAL_S`` whatever it is doing: the steps
    it has run, the progress of its running requests and whether its output packer lives."""

    rank: int
    steps: int
    progress: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    packer_alive: bool = True


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """Per-request timings in milliseconds; ``step_ms`` is one denoising step of the
    request's forward (the median between step ends), None when the worker did not time
    steps (fewer than two, or step mode)."""

    queue_wait_ms: float = 0.0
    execution_ms: float = 0.0
    postprocess_ms: float = 0.0
    e2e_ms: float = 0.0
    step_ms: float | None = None


@dataclass(frozen=True, slots=True)
class DiffusionOutput:
    """The one result/chunk type on every request stream.

    A stream yields zero or more chunks with ``finished=False`` (step-mode previews) and ends
    with exactly one terminal output (``finished=True``) whose ``status`` is terminal.
    ``images`` holds PIL images, numpy arrays or tensors according to ``output_type``.
    """

    request_id: str
    status: RequestStatus
    finished: bool = True
    images: tuple[Any, ...] = ()
    error: str | None = None
    error_type: str | None = None
    seed: int | None = None
    chunk_index: int = 0
    total_chunks: int = 1
    metrics: RequestMetrics = field(default_factory=RequestMetrics)

    @property
    def ok(self) -> bool:
        return self.status is RequestStatus.FINISHED_COMPLETED

    def raise_for_status(self) -> DiffusionOutput:
        """Return this output if it completed; raise the matching error if it did not:
        :class:`EngineClosedError` / :class:`EngineDeadError` when the engine ended it,
        :class:`RequestAbortedError` when aborted, :class:`RequestFailedError` (with the
        error text and type) when it failed."""
        if self.status is RequestStatus.FINISHED_COMPLETED:
            return self
        if self.error_type == "EngineClosedError":
            raise EngineClosedError(self.error or "engine is closed")
        if self.error_type == "EngineDeadError":
            raise EngineDeadError(self.error or "engine is dead")
        if self.status is RequestStatus.FINISHED_ABORTED:
            if self.error_type == TIMEOUT_ERROR_TYPE:
                raise RequestTimeoutError(self.request_id, self.error)
            raise RequestAbortedError(self.request_id, self.error)
        raise RequestFailedError(self.request_id, self.error or "failed", self.error_type)
