"""The supervised worker group: started, failed, restarted with backoff, given up on; a
ScriptedExecutor backend under an autojumping MockClock (exact virtual times)."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from omni_trio.config import EngineConfig
from omni_trio.errors import RestartLimitError, WorkerError
from omni_trio.executors.base import Executor
from omni_trio.runtime.worker_group import GroupEvents, WorkerGroup, restart_policy
from tests.fakes import ScriptedExecutor

CAP_S = 60.0


class Owner:
    """Records what the group reports; ``wanted`` says whether to replace a failed group."""

    def __init__(self) -> None:
        self.log: list[tuple[str, float, Any]] = []
        self.wanted = True
        self.changed = trio.Event()

    def note(self, kind: str, value: Any = None) -> None:
        self.log.append((kind, trio.current_time(), value))
        self.changed.set()
        self.changed = trio.Event()

    def events(self) -> GroupEvents:
        return GroupEvents(
            started=lambda ex: self.note("started", ex),
            failed=lambda err: self.note("failed", err),
            restarting=lambda: self.note("restarting"),
            gave_up=lambda err: self.note("gave_up", err),
            wanted=lambda: self.wanted,
        )

    def kinds(self) -> list[str]:
        return [kind for kind, _, _ in self.log]

    async def wait_for(self, count: int, kind: str) -> None:
        while self.kinds().count(kind) < count:
            await self.changed.wait()


def config(**kw: Any) -> EngineConfig:
    kw.setdefault("worker_restart_backoff_s", 1.0)
    kw.setdefault("worker_restart_backoff_max_s", 4.0)
    return EngineConfig(backend=ScriptedExecutor, warmup=False, **kw)


def current(group: WorkerGroup) -> Executor:
    assert group.current is not None
    return group.current


async def test_a_failed_group_is_replaced_after_its_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    owner = Owner()
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            group = WorkerGroup(config(), owner.events())
            await nursery.start(group.serve)
            first = current(group)
            assert owner.kinds() == ["started"]
            first.fail(WorkerError("died", worker=0))
            await owner.wait_for(2, "started")
            second = current(group)
            assert second is not first
            assert owner.kinds() == ["started", "failed", "restarting", "started"]
            failed_at = owner.log[1][1]
            assert owner.log[3][1] - failed_at == 1.0  # the backoff, in virtual time
            assert isinstance(owner.log[1][2], WorkerError)
            nursery.cancel_scope.cancel()
    assert first.closed and second.closed  # type: ignore[attr-defined]


async def test_past_the_restart_limit_the_group_gives_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    owner = Owner()
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            group = WorkerGroup(config(max_worker_restarts=1), owner.events())
            await nursery.start(group.serve)
            current(group).fail(WorkerError("one"))
            await owner.wait_for(2, "started")
            current(group).fail(WorkerError("two"))
            await owner.wait_for(1, "gave_up")
    [(_, _, error)] = [entry for entry in owner.log if entry[0] == "gave_up"]
    assert isinstance(error, RestartLimitError)


async def test_a_group_failing_while_its_owner_closes_is_not_replaced(
    autojump_clock: trio.testing.MockClock,
) -> None:
    owner = Owner()
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            group = WorkerGroup(config(), owner.events())
            await nursery.start(group.serve)
            owner.wanted = False
            current(group).fail(WorkerError("died while closing"))
            await trio.sleep(10.0)
            # The child ended normally (nothing to restart): reported once, never replaced.
            assert owner.kinds() == ["started", "failed"]
            assert owner.log[1][2] is None
            nursery.cancel_scope.cancel()
    assert owner.kinds() == ["started", "failed"]


def test_the_restart_policy_comes_from_the_config() -> None:
    policy = restart_policy(config(max_worker_restarts=3, worker_restart_window_s=9.0))
    assert (policy.max_restarts, policy.window_s, policy.backoff_s, policy.backoff_max_s) == (
        3,
        9.0,
        1.0,
        4.0,
    )
    # A maximum below the initial backoff is raised to it.
    assert restart_policy(config(worker_restart_backoff_max_s=0.5)).backoff_max_s == 1.0
