"""The engine's worker group under supervision: one executor at a time, restarted as a whole.

A collective group is never partially restarted: the executor (every worker of the group) is
the one child of a ``one_for_all`` :class:`~omni_trio.supervisor.Supervisor` with the
engine's restart policy (backoff inside a restart-intensity limit).  The group tells its
owner what happens through :class:`GroupEvents`; the owner decides what that means for its
requests.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import trio
from trio_typing import TaskStatus

from ..config import EngineConfig
from ..errors import RestartLimitError, WorkerError
from ..executors.base import Executor, open_executor
from ..supervisor import ChildSpec, RestartPolicy, Strategy, Supervisor, SupervisorEvent

__all__ = ["GroupEvents", "WorkerGroup", "restart_policy"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GroupEvents:
    """What a worker group reports to its owner (all on the owner's trio thread):

    ``started(executor)`` a group is up and ready (the first, or a restart);
    ``failed(error)`` the current group failed closed or ended (what the supervisor saw);
    ``restarting()`` a restart is scheduled (its backoff begins);
    ``gave_up(error)`` past the restart limit: no group will come;
    ``wanted()`` whether a failed group is to be replaced (False while the owner closes);
    ``excused()`` whether the failure just reported is not the sign of a crash loop (its
    cause was quarantined, or the group was serving): the supervisor then restarts at once,
    uncounted; see ``Supervisor(excused=...)`` and ``EngineCore.failure_excused``.
    """

    started: Callable[[Executor], None]
    failed: Callable[[BaseException | None], None]
    restarting: Callable[[], None]
    gave_up: Callable[[RestartLimitError], None]
    wanted: Callable[[], bool]
    excused: Callable[[], bool] = lambda: False


def restart_policy(config: EngineConfig) -> RestartPolicy:
    return RestartPolicy(
        max_restarts=config.max_worker_restarts,
        window_s=config.worker_restart_window_s,
        backoff_s=config.worker_restart_backoff_s,
        backoff_max_s=max(config.worker_restart_backoff_s, config.worker_restart_backoff_max_s),
    )


class WorkerGroup:
    """The supervised worker group of one engine; :attr:`current` is the running executor."""

    def __init__(self, config: EngineConfig, events: GroupEvents) -> None:
        self.config = config
        self._events = events
        self.current: Executor | None = None
        self._supervisor = Supervisor(
            [ChildSpec("worker-group", self._serve_one, restart="transient")],
            strategy=Strategy.ONE_FOR_ALL,
            policy=restart_policy(config),
            name="engine",
            on_event=self._on_event,
            excused=lambda error: self._events.excused(),
        )

    @property
    def restarts(self) -> int:
        """Restarts made so far, after their backoff (a start that failed counts too)."""
        return self._supervisor.restarts

    async def serve(
        self, *, task_status: TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Start the first group (its startup error is raised here: nothing is retried,
        that is a configuration error), report ready, then keep a group running until
        cancelled (which closes it, bounded) or until the supervisor gives up."""
        try:
            await self._supervisor.serve(task_status=task_status)
        except RestartLimitError as exc:
            log.error("engine dead: %s", exc)
            self._events.gave_up(exc)

    async def _serve_one(
        self, *, task_status: TaskStatus[Executor] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The supervised child: one executor, until it fails closed (then its failure is
        raised, so the supervisor restarts it).  Cancellation closes it (bounded)."""
        async with open_executor(self.config) as executor:
            self.current = executor
            self._events.started(executor)
            task_status.started(executor)
            reason = await executor.wait_failed()
        if not self._events.wanted():
            return  # failed while the engine closes: nothing to restart
        if isinstance(reason, Exception):
            raise reason
        raise WorkerError(f"worker group failed: {reason!r}")  # pragma: no cover

    def _on_event(self, event: SupervisorEvent) -> None:
        if event.kind in ("failed", "exited"):
            self._events.failed(event.error)
        elif event.kind == "restarting":
            self._events.restarting()
