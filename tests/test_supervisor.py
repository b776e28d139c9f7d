"""``Supervisor``: Erlang-style restarts of trio tasks, rate-limited, with exact backoffs.

Children are :class:`FakeChild` instances the test controls (fail now, fail on the next start,
return); every timed test runs on an autojumping ``MockClock`` and asserts exact virtual times.
``RestartPolicy`` and ``RestartIntensity`` are pure and tested without trio.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import trio
import trio.testing
from trio_typing import TaskStatus

from omni_trio.errors import RestartLimitError
from omni_trio.supervisor import (
    ChildInfo,
    ChildSpec,
    ChildState,
    RestartIntensity,
    RestartPolicy,
    Strategy,
    Supervisor,
    SupervisorEvent,
)

CAP_S = 1000.0  # virtual seconds; every test body is bounded by this

# Binary-exact backoffs, so virtual times compare exactly: 0.125, 0.25, 0.5, 0.5, ...
EXACT = RestartPolicy(max_restarts=5, window_s=60.0, backoff_s=0.125, backoff_max_s=0.5)


class FakeFatal(BaseException):
    """Not an ``Exception``: the supervisor must let it through."""


class FakeChild:
    """A fake child the test steers; ``log`` (shared between children) records what happened.

    Each call is one incarnation: it counts the start, raises the next of ``start_errors``
    before it is ready (if any), reports ready with ``"name#n"``, then waits until the test
    calls :meth:`fail` or :meth:`finish`, or ``crash_after_s`` passes (then it raises
    ``RuntimeError("name crash n")``).
    """

    def __init__(
        self,
        name: str,
        log: list[str] | None = None,
        *,
        start_errors: list[Exception] | None = None,
        crash_after_s: float | None = None,
        start_s: float = 0.0,
    ) -> None:
        self.name = name
        self.start_s = start_s  # how long each start takes before it is ready (or fails)
        self.log = [] if log is None else log
        self.start_errors = list(start_errors or [])
        self.crash_after_s = crash_after_s
        self.starts = 0  # calls, including starts that failed
        self.ready = 0  # incarnations that reported ready
        self.ready_times: list[float] = []
        self.cancelled = 0
        self.running = False
        self._wake = trio.Event()
        self._error: Exception | None = None
        self._changed = trio.Event()

    def spec(self, restart: str = "permanent") -> ChildSpec:
        return ChildSpec(self.name, self, restart=restart)

    def fail(self, error: Exception) -> None:
        self._error = error
        self._wake.set()

    def finish(self) -> None:
        self._error = None
        self._wake.set()

    async def wait_ready(self, count: int) -> None:
        """Wait until ``count`` incarnations reported ready and the supervisor has settled."""
        while self.ready < count:
            await self._changed.wait()
        await trio.testing.wait_all_tasks_blocked()

    async def __call__(self, *, task_status: TaskStatus[str]) -> None:
        self.starts += 1
        n = self.starts
        self.log.append(f"start {self.name}")
        await trio.sleep(self.start_s)
        if self.start_errors:
            raise self.start_errors.pop(0)
        self._wake, self._error = trio.Event(), None
        self.running = True
        self.ready += 1
        self.ready_times.append(trio.current_time())
        task_status.started(f"{self.name}#{n}")
        self._changed.set()
        self._changed = trio.Event()
        try:
            if self.crash_after_s is not None:
                await trio.sleep(self.crash_after_s)
                raise RuntimeError(f"{self.name} crash {n}")
            await self._wake.wait()
        except trio.Cancelled:
            self.cancelled += 1
            self.log.append(f"cancel {self.name}")
            raise
        finally:
            self.running = False
        if self._error is not None:
            self.log.append(f"fail {self.name}")
            raise self._error
        self.log.append(f"return {self.name}")


def states(supervisor: Supervisor) -> dict[str, ChildState]:
    return {info.name: info.state for info in supervisor.children()}


# -- RestartPolicy and RestartIntensity (pure) --------------------------------------------


def test_default_backoff_doubles_from_50ms_and_is_capped() -> None:
    policy = RestartPolicy()
    assert [policy.backoff(n) for n in range(4)] == pytest.approx([0.05, 0.1, 0.2, 0.4])
    assert policy.backoff(7) == 5.0
    assert policy.backoff(100_000) == 5.0  # no OverflowError
    assert RestartPolicy(backoff_s=0.0).backoff(100_000) == 0.0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_restarts", -1),
        ("max_restarts", 1.5),
        ("max_restarts", True),
        ("window_s", 0.0),
        ("window_s", -1.0),
        ("window_s", math.inf),
        ("window_s", math.nan),
        ("backoff_s", -0.1),
        ("backoff_s", "1"),
        ("backoff_max_s", math.inf),
        ("backoff_factor", 0.5),
        ("backoff_factor", math.nan),
    ],
)
def test_restart_policy_rejects_bad_fields(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        RestartPolicy(**{field: value})


def test_restart_intensity_counts_a_sliding_window() -> None:
    intensity = RestartIntensity(RestartPolicy(max_restarts=2, window_s=10.0))
    assert intensity.allow(0.0) and intensity.recent(0.0) == 0
    intensity.record(0.0)
    intensity.record(1.0)
    assert intensity.recent(5.0) == 2
    assert not intensity.allow(5.0)
    assert intensity.recent(10.0) == 1  # the window is (now - window_s, now]
    assert intensity.allow(10.0)
    intensity.record(12.0)
    assert intensity.recent(12.0) == 1
    assert intensity.recent(22.0) == 0
    assert intensity.total == 3


def test_zero_max_restarts_never_allows_one() -> None:
    assert not RestartIntensity(RestartPolicy(max_restarts=0)).allow(0.0)


def test_child_spec_and_supervisor_validate_their_arguments() -> None:
    child = FakeChild("a")
    with pytest.raises(ValueError, match="restart"):
        child.spec(restart="sometimes")
    with pytest.raises(ValueError, match="duplicate"):
        Supervisor([child.spec(), child.spec()])


# -- starting --------------------------------------------------------------------------------


async def test_serve_starts_children_in_order_and_reports_itself(
    autojump_clock: trio.testing.MockClock,
) -> None:
    events: list[SupervisorEvent] = []
    log: list[str] = []
    a, b = FakeChild("a", log), FakeChild("b", log)
    supervisor = Supervisor([a.spec(), b.spec()], on_event=events.append)
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            assert await nursery.start(supervisor.serve) is supervisor
            assert log == ["start a", "start b"]
            assert [(e.kind, e.child, e.value) for e in events] == [
                ("started", "a", "a#1"),
                ("started", "b", "b#1"),
            ]
            assert supervisor.children() == [
                ChildInfo("a", ChildState.RUNNING, 0, None, 0.0),
                ChildInfo("b", ChildState.RUNNING, 0, None, 0.0),
            ]
            with pytest.raises(RuntimeError, match="already serving"):
                await supervisor.serve()
            nursery.cancel_scope.cancel()


async def test_a_failed_first_start_propagates_unchanged_and_is_not_restarted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    error = ValueError("bad config")
    log: list[str] = []
    a, b, c = FakeChild("a", log), FakeChild("b", log, start_errors=[error]), FakeChild("c", log)
    supervisor = Supervisor([a.spec(), b.spec(), c.spec()])
    with trio.fail_after(CAP_S):
        with pytest.raises(ValueError) as info:
            await supervisor.serve()
    assert info.value is error
    assert log == ["start a", "start b", "cancel a"]
    assert (b.starts, c.starts, supervisor.restarts) == (1, 0, 0)
    assert states(supervisor)["b"] is ChildState.FAILED
    assert supervisor.children()[1].last_error == "ValueError: bad config"


async def test_a_concurrent_start_starts_every_child_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Two children that take 1 s each to start are both ready at 1 s (in order: 1 s and
    2 s), and the supervisor reports ready then."""
    for concurrent, ready_at in ((True, [1.0, 1.0]), (False, [1.0, 2.0])):
        a, b = FakeChild("a", start_s=1.0), FakeChild("b", start_s=1.0)
        supervisor = Supervisor([a.spec(), b.spec()], concurrent_start=concurrent)
        with trio.fail_after(CAP_S):
            async with trio.open_nursery() as nursery:
                began = trio.current_time()
                await nursery.start(supervisor.serve)
                assert trio.current_time() - began == ready_at[-1]
                assert [t - began for t in (*a.ready_times, *b.ready_times)] == ready_at
                assert set(states(supervisor).values()) == {ChildState.RUNNING}
                nursery.cancel_scope.cancel()


async def test_a_failed_concurrent_start_cancels_the_others_and_propagates(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """One child fails its start at 1 s: the one that started is cancelled, the one still
    starting (it needs 5 s) is cancelled before it is ready, nothing is restarted, and the
    error propagates unchanged at 1 s."""
    error = ValueError("bad config")
    log: list[str] = []
    a = FakeChild("a", log)
    b = FakeChild("b", log, start_errors=[error], start_s=1.0)
    c = FakeChild("c", log, start_s=5.0)
    supervisor = Supervisor([a.spec(), b.spec(), c.spec()], concurrent_start=True)
    with trio.fail_after(CAP_S):
        with pytest.raises(ValueError) as info:
            await supervisor.serve()
    assert info.value is error
    assert trio.current_time() == 1.0
    assert sorted(log) == ["cancel a", "start a", "start b", "start c"]
    assert (a.ready, c.ready, supervisor.restarts) == (1, 0, 0)
    assert states(supervisor)["b"] is ChildState.FAILED


async def test_a_failed_first_start_is_left_to_the_caller_to_report(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # It propagates to serve's caller, who reports it: a warning too would say it twice
    # (omni-trio generate --model nosuch printed a WARNING line before its error).
    caplog.set_level(logging.DEBUG, logger="omni_trio.supervisor")
    a = FakeChild("a", start_errors=[ValueError("bad model")])
    with trio.fail_after(CAP_S), pytest.raises(ValueError):
        await Supervisor([a.spec()], name="engine").serve()
    records = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert records == [("DEBUG", "engine: child a failed: ValueError: bad model")]


async def test_a_failure_after_the_start_is_still_a_warning(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    a = FakeChild("a")
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(Supervisor([a.spec()], policy=EXACT, name="engine").serve)
            a.start_errors.append(OSError("port in use"))
            a.fail(RuntimeError("boom"))
            await a.wait_ready(2)
            nursery.cancel_scope.cancel()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "engine: child a failed: RuntimeError: boom",
        "engine: child a failed: OSError: port in use",  # a failed restart is one too
    ]


async def test_cancelling_serve_cancels_every_child(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a, b = FakeChild("a"), FakeChild("b")
    supervisor = Supervisor([a.spec(), b.spec()], strategy=Strategy.ONE_FOR_ALL)
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.serve)
            nursery.cancel_scope.cancel()
    assert (a.cancelled, b.cancelled) == (1, 1)
    assert not a.running and not b.running


async def test_a_base_exception_is_not_supervised(autojump_clock: trio.testing.MockClock) -> None:
    a, b = FakeChild("a"), FakeChild("b")
    supervisor = Supervisor([a.spec(), b.spec()])
    with trio.fail_after(CAP_S):
        with pytest.raises(FakeFatal):
            async with trio.open_nursery() as nursery:
                await nursery.start(supervisor.serve)
                a.fail(FakeFatal())  # type: ignore[arg-type]
    assert (a.starts, b.cancelled, supervisor.restarts) == (1, 1, 0)


# -- strategies -------------------------------------------------------------------------------


async def test_one_for_one_restarts_only_the_failed_child(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log: list[str] = []
    a, b = FakeChild("a", log), FakeChild("b", log)
    supervisor = Supervisor([a.spec(), b.spec()], policy=EXACT)
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.serve)
            await trio.sleep(1.0)
            a.fail(RuntimeError("boom"))
            await a.wait_ready(2)
            assert log == ["start a", "start b", "fail a", "start a"]
            assert (a.starts, b.starts, b.cancelled) == (2, 1, 0)
            assert a.ready_times == [0.0, 1.125]
            info = supervisor.children()
            assert info[0] == ChildInfo("a", ChildState.RUNNING, 1, "RuntimeError: boom", 1.125)
            assert info[1] == ChildInfo("b", ChildState.RUNNING, 0, None, 0.0)
            assert supervisor.statistics().last_failure == "a: RuntimeError: boom"
            nursery.cancel_scope.cancel()


async def test_one_for_all_cancels_siblings_then_restarts_all_in_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log: list[str] = []
    a, b, c = FakeChild("a", log), FakeChild("b", log), FakeChild("c", log)
    supervisor = Supervisor(
        [a.spec(), b.spec(), c.spec()], strategy=Strategy.ONE_FOR_ALL, policy=EXACT
    )
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.serve)
            b.fail(RuntimeError("boom"))
            await c.wait_ready(2)
            assert log[:4] == ["start a", "start b", "start c", "fail b"]
            assert sorted(log[4:6]) == ["cancel a", "cancel c"]  # siblings first
            assert log[6:] == ["start a", "start b", "start c"]  # then all, in start order
            assert [i.restarts for i in supervisor.children()] == [1, 1, 1]
            assert supervisor.restarts == 1  # a group restart counts once
            nursery.cancel_scope.cancel()


async def test_one_for_all_counts_simultaneous_failures_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a, b = FakeChild("a"), FakeChild("b")
    supervisor = Supervisor([a.spec(), b.spec()], strategy=Strategy.ONE_FOR_ALL, policy=EXACT)
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.serve)
            a.fail(RuntimeError("a"))
            b.fail(RuntimeError("b"))
            await b.wait_ready(2)
            await trio.sleep(10.0)  # the stale report of the other failure changes nothing
            assert (a.starts, b.starts, supervisor.restarts) == (2, 2, 1)
            nursery.cancel_scope.cancel()


async def test_one_for_all_does_not_bring_back_temporary_siblings(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a, t = FakeChild("a"), FakeChild("t")
    supervisor = Supervisor([a.spec(), t.spec("temporary")], strategy=Strategy.ONE_FOR_ALL)
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.serve)
            a.fail(RuntimeError("boom"))
            await a.wait_ready(2)
            assert (t.starts, t.cancelled) == (1, 1)
            assert states(supervisor) == {"a": ChildState.RUNNING, "t": ChildState.STOPPED}
            nursery.cancel_scope.cancel()


# -- restart kinds ----------------------------------------------------------------------------


async def test_permanent_child_is_restarted_after_a_normal_return(
    autojump_clock: trio.testing.MockClock,
) -> None:
    events: list[SupervisorEvent] = []
    a = FakeChild("a")
    supervisor = Supervisor([a.spec()], policy=EXACT, on_event=events.append)
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.serve)
            a.finish()
            await a.wait_ready(2)
            assert [e.kind for e in events] == ["started", "exited", "restarting", "started"]
            assert supervisor.children()[0].last_error is None
            nursery.cancel_scope.cancel()


async def test_transient_child_is_restarted_only_after_an_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a, b = FakeChild("a"), FakeChild("b")
    supervisor = Supervisor([a.spec("transient"), b.spec()], policy=EXACT)
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.serve)
            a.fail(RuntimeError("boom"))
            await a.wait_ready(2)
            a.finish()
            await trio.sleep(10.0)
            assert a.starts == 2
            assert states(supervisor) == {"a": ChildState.STOPPED, "b": ChildState.RUNNING}
            nursery.cancel_scope.cancel()


async def test_temporary_child_is_never_restarted_and_serve_returns_when_all_stop(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a, b = FakeChild("a"), FakeChild("b")
    supervisor = Supervisor([a.spec("temporary"), b.spec("transient")])
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervisor.serve)
            await b.wait_ready(1)
            a.fail(RuntimeError("boom"))
            await trio.sleep(10.0)
            info = supervisor.children()[0]
            assert (info.state, info.last_error) == (ChildState.STOPPED, "RuntimeError: boom")
            b.finish()  # the last child stops: serve returns, so the nursery closes
    assert (a.starts, b.starts, supervisor.restarts) == (1, 1, 0)
    assert trio.current_time() == 10.0


# -- intensity and backoff ---------------------------------------------------------------------


async def test_backoff_delays_are_exact_and_capped(autojump_clock: trio.testing.MockClock) -> None:
    events: list[SupervisorEvent] = []
    a = FakeChild("a", crash_after_s=0.0)
    supervisor = Supervisor([a.spec()], policy=EXACT, on_event=events.append)
    with trio.fail_after(CAP_S):
        with pytest.raises(RestartLimitError):
            await supervisor.serve()
    assert a.ready_times == [0.0, 0.125, 0.375, 0.875, 1.375, 1.875]
    assert [e.backoff_s for e in events if e.kind == "restarting"] == [0.125, 0.25, 0.5, 0.5, 0.5]


async def test_max_restarts_within_the_window_then_give_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    events: list[SupervisorEvent] = []
    a, b = FakeChild("a", crash_after_s=1.0), FakeChild("b")
    policy = RestartPolicy(max_restarts=3, window_s=60.0, backoff_s=0.0)
    supervisor = Supervisor([a.spec(), b.spec()], policy=policy, on_event=events.append)
    with trio.fail_after(CAP_S):
        with pytest.raises(RestartLimitError) as info:
            await supervisor.serve()
    error = info.value
    assert (error.child, error.restarts, error.max_restarts, error.window_s) == ("a", 3, 3, 60.0)
    assert isinstance(error.__cause__, RuntimeError)
    assert str(error.__cause__) == "a crash 4"
    assert error.last_error is error.__cause__
    assert a.starts == 4 and trio.current_time() == 4.0
    assert (b.starts, b.cancelled) == (1, 1)
    assert not a.running and not b.running
    assert [e.kind for e in events][-3:] == ["started", "failed", "gave_up"]
    stats = supervisor.statistics()
    assert stats.gave_up and stats.restarts == 3
    assert stats.last_failure == "a: RuntimeError: a crash 4"
    assert {i.state for i in stats.children} == {ChildState.FAILED}


async def test_failures_spread_wider_than_the_window_never_give_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a = FakeChild("a", crash_after_s=10.0)
    policy = RestartPolicy(max_restarts=1, window_s=5.0, backoff_s=0.0)
    supervisor = Supervisor([a.spec()], policy=policy)
    with trio.fail_after(CAP_S):
        with trio.move_on_after(100.5):
            await supervisor.serve()
    assert a.starts == 11 and supervisor.restarts == 10
    assert not supervisor.statistics().gave_up


async def test_state_is_restarting_during_the_backoff(
    autojump_clock: trio.testing.MockClock,
) -> None:
    a, b = FakeChild("a"), FakeChild("b")
    supervisor = Supervisor([a.spec(), b.spec()], strategy=Strategy.ONE_FOR_ALL, policy=EXACT)
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.serve)
            a.fail(RuntimeError("boom"))
            await trio.sleep(0.0625)  # half-way through the 0.125 s backoff
            assert states(supervisor) == {"a": ChildState.RESTARTING, "b": ChildState.RESTARTING}
            await trio.sleep(0.125)
            assert states(supervisor) == {"a": ChildState.RUNNING, "b": ChildState.RUNNING}
            assert [i.started_at for i in supervisor.children()] == [0.125, 0.125]
            nursery.cancel_scope.cancel()


async def test_a_failure_while_restarting_counts_as_another_failure(
    autojump_clock: trio.testing.MockClock,
) -> None:
    events: list[SupervisorEvent] = []
    a = FakeChild("a", start_errors=[])
    supervisor = Supervisor([a.spec()], policy=EXACT, on_event=events.append)
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.serve)
            a.start_errors.append(OSError("port in use"))
            a.fail(RuntimeError("boom"))
            await a.wait_ready(2)
            assert [(e.kind, e.backoff_s) for e in events] == [
                ("started", None),
                ("failed", None),
                ("restarting", 0.125),
                ("failed", None),  # the restart itself failed: one more failure
                ("restarting", 0.25),
                ("started", None),
            ]
            assert isinstance(events[3].error, OSError)
            assert (a.starts, supervisor.restarts, trio.current_time()) == (3, 2, 0.375)
            nursery.cancel_scope.cancel()


async def test_failures_while_restarting_can_exceed_the_limit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    error = OSError("port in use")
    a = FakeChild("a")
    supervisor = Supervisor([a.spec()], policy=RestartPolicy(max_restarts=1, backoff_s=0.0))
    with trio.fail_after(CAP_S):
        with pytest.raises(RestartLimitError) as info:
            async with trio.open_nursery() as nursery:
                await nursery.start(supervisor.serve)
                a.start_errors.append(error)
                a.fail(RuntimeError("boom"))
    assert info.value.__cause__ is error


async def test_one_for_all_failure_while_restarting_cancels_the_started_part(
    autojump_clock: trio.testing.MockClock,
) -> None:
    log: list[str] = []
    a, b = FakeChild("a", log), FakeChild("b", log)
    supervisor = Supervisor([a.spec(), b.spec()], strategy=Strategy.ONE_FOR_ALL, policy=EXACT)
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.serve)
            b.start_errors.append(OSError("port in use"))
            a.fail(RuntimeError("boom"))
            await b.wait_ready(2)
            assert log[2:] == [
                "fail a",
                "cancel b",
                "start a",
                "start b",  # fails before it is ready
                "cancel a",
                "start a",
                "start b",
            ]
            assert supervisor.restarts == 2
            nursery.cancel_scope.cancel()


# -- events -----------------------------------------------------------------------------------


async def test_events_carry_the_child_time_and_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    events: list[SupervisorEvent] = []
    error = RuntimeError("boom")
    a = FakeChild("a")
    supervisor = Supervisor([a.spec()], policy=EXACT, on_event=events.append)
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.serve)
            await trio.sleep(2.0)
            a.fail(error)
            await a.wait_ready(2)
            nursery.cancel_scope.cancel()
    assert events == [
        SupervisorEvent("started", "a", 0.0, value="a#1"),
        SupervisorEvent("failed", "a", 2.0, error=error),
        SupervisorEvent("restarting", "a", 2.0, error=error, backoff_s=0.125),
        SupervisorEvent("started", "a", 2.125, value="a#2"),
    ]


async def test_a_raising_on_event_does_not_break_supervision(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    kinds: list[str] = []

    def on_event(event: SupervisorEvent) -> None:
        kinds.append(event.kind)
        raise RuntimeError("observer bug")

    a = FakeChild("a")
    supervisor = Supervisor([a.spec()], policy=EXACT, on_event=on_event)
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.serve)
            a.fail(RuntimeError("boom"))
            await a.wait_ready(2)
            nursery.cancel_scope.cancel()
    assert kinds == ["started", "failed", "restarting", "started"]
    assert "on_event raised" in caplog.text


class FakeQuarantine(RuntimeError):
    """A failure whose cause the owner knows and has removed (a quarantined request)."""


async def test_an_excused_failure_restarts_at_once_and_does_not_count(
    autojump_clock: trio.testing.MockClock,
) -> None:
    events: list[SupervisorEvent] = []
    a = FakeChild("a")
    policy = RestartPolicy(max_restarts=1, window_s=60.0, backoff_s=0.125, backoff_max_s=0.5)
    supervisor = Supervisor(
        [a.spec()],
        policy=policy,
        on_event=events.append,
        excused=lambda error: isinstance(error, FakeQuarantine),
    )
    with trio.fail_after(CAP_S), pytest.raises(RestartLimitError):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.serve)
            for n in range(2, 6):  # many more than max_restarts, none counted
                a.fail(FakeQuarantine("poison"))
                await a.wait_ready(n)
            assert [e.backoff_s for e in events if e.kind == "restarting"] == [0.0] * 4
            assert trio.current_time() == 0.0 and supervisor.restarts == 4
            # A failure with no known cause still meets the backoff and the limit.
            a.fail(RuntimeError("boom"))
            await a.wait_ready(6)
            assert trio.current_time() == 0.125
            a.fail(RuntimeError("boom again"))  # the second counted one: past the limit
    assert supervisor.statistics().gave_up and supervisor.restarts == 5


async def test_a_failed_restart_after_an_excused_failure_is_not_excused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    events: list[SupervisorEvent] = []
    a = FakeChild("a")
    supervisor = Supervisor(
        [a.spec()], policy=EXACT, on_event=events.append, excused=lambda e: True
    )
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.serve)
            a.start_errors.append(OSError("port in use"))
            a.fail(FakeQuarantine("poison"))
            await a.wait_ready(2)
            assert [e.backoff_s for e in events if e.kind == "restarting"] == [0.0, 0.125]
            nursery.cancel_scope.cancel()


async def test_with_no_restarts_allowed_an_excused_failure_gives_up_too(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """``max_restarts=0`` means no restart at all: the excuse does not make one."""
    a = FakeChild("a")
    policy = RestartPolicy(max_restarts=0, window_s=60.0, backoff_s=0.125, backoff_max_s=0.5)
    supervisor = Supervisor([a.spec()], policy=policy, excused=lambda error: True)
    with trio.fail_after(CAP_S), pytest.raises(RestartLimitError):
        async with trio.open_nursery() as nursery:
            await nursery.start(supervisor.serve)
            a.fail(FakeQuarantine("poison"))
    assert supervisor.statistics().gave_up and supervisor.restarts == 0
