"""Request lifecycle: the states, the one transition function, and the scheduler-owned state.

::

    WAITING --schedule--> RUNNING --compute done--> PACKING --output ready--> FINISHED_COMPLETED
       |                    |  |                      |  '--packing failed/lost--> FINISHED_ERROR
       |                    |  '--output in hand--> FINISHED_COMPLETED
       |                    |--error/missing output--> FINISHED_ERROR
       |                    |--worker crash, retries left--> PREEMPTED --> (front of WAITING)
       |                    |--step-boundary preemption--> PREEMPTED       ^
       |                    |                         '--group lost it-----'
       '--abort--> FINISHED_ABORTED <--abort-- (RUNNING, PACKING, PREEMPTED)

``PACKING`` is "compute done, output still being packed": the request has left its batch
(the slot is free, as the reference's ``COMPUTE_DONE`` says) but it has no output yet.  Only
the engine core moves a request, and only through :func:`transition`: no status is ever set
anywhere else.

Terminal states are ordered after live ones, so ``status.finished`` is a comparison.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..errors import InvalidTransition
from .request import DiffusionRequest

__all__ = ["HISTORY_LIMIT", "RequestState", "RequestStatus", "transition"]

HISTORY_LIMIT = 16


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    PACKING = 3
    FINISHED_COMPLETED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_COMPLETED


_S = RequestStatus
_TERMINAL = frozenset({_S.FINISHED_COMPLETED, _S.FINISHED_ABORTED, _S.FINISHED_ERROR})
_ALLOWED: dict[RequestStatus, frozenset[RequestStatus]] = {
    _S.WAITING: frozenset({_S.RUNNING, _S.FINISHED_ABORTED, _S.FINISHED_ERROR}),
    _S.RUNNING: frozenset({_S.PREEMPTED, _S.PACKING} | _TERMINAL),
    _S.PREEMPTED: frozenset({_S.RUNNING, _S.FINISHED_ABORTED, _S.FINISHED_ERROR}),
    _S.PACKING: frozenset({_S.PREEMPTED} | _TERMINAL),
    _S.FINISHED_COMPLETED: frozenset(),
    _S.FINISHED_ABORTED: frozenset(),
    _S.FINISHED_ERROR: frozenset(),
}


@dataclass(slots=True, eq=False)
class RequestState:
    """Everything the scheduler knows about one admitted request.

    Invariant: ``status`` only changes through :func:`transition`; ``history`` holds the
    last :data:`HISTORY_LIMIT` states (oldest first, current last).
    """

    request: DiffusionRequest
    queued_at: float
    status: RequestStatus = RequestStatus.WAITING
    history: list[RequestStatus] = field(default_factory=lambda: [RequestStatus.WAITING])
    # Set on the first WAITING -> RUNNING move (scheduler time, seconds).
    first_scheduled_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    error_type: str | None = None
    # Step mode: denoising progress.  Preemption keeps it unless reset.
    total_steps: int = 0
    num_computed_steps: int = 0
    num_preemptions: int = 0
    # Times this request was run again because its worker group failed under it (the one
    # retry counter; bounded by max_retries_on_worker_failure).
    num_retries: int = 0
    # Times its worker group failed while it ran or packed; at QUARANTINE_AFTER_CRASHES the
    # request is quarantined (failed for good) instead of run again.
    num_crashes: int = 0
    # Runs alone (never shares a wave or a tick): a suspect, after its group failed under it
    # or its wave's payload could not be sent, so a poison request harms nobody twice.
    solo: bool = False
    # Step mode: True once the worker holds state for it (new payload already sent).
    sent_to_worker: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id


def transition(state: RequestState, to: RequestStatus) -> None:
    """Move ``state`` to ``to`` or raise :class:`InvalidTransition` naming both and the history."""
    if to not in _ALLOWED[state.status]:
        raise InvalidTransition(state.request_id, state.status, to, state.history)
    state.status = to
    state.history.append(to)
    if len(state.history) > HISTORY_LIMIT:
        del state.history[0]
