"""A small Erlang-style supervisor for trio tasks.

A :class:`Supervisor` starts a fixed list of children, each an ``async def fn(*, task_status)``
that calls ``task_status.started(value)`` once it is ready, and keeps them running.  When a
child stops, the strategy decides what comes back:

- ``Strategy.ONE_FOR_ONE`` restarts only that child;
- ``Strategy.ONE_FOR_ALL`` cancels every other running child, waits for them to finish, then
  restarts the whole group in start order (for children that depend on each other).

A child's ``restart`` kind decides whether it comes back at all: ``"permanent"`` always,
``"transient"`` only after an exception, ``"temporary"`` never.

Restarts are rate-limited as in Erlang.  :class:`RestartIntensity` counts the restarts made in
the last ``window_s`` seconds; a failure when ``max_restarts`` of them already happened makes
the supervisor give up: it cancels every child and raises :class:`RestartLimitError`, whose
``__cause__`` is that last failure.  Every restart first waits an exponential backoff
(:meth:`RestartPolicy.backoff`) that grows with the restarts already in the window.

Cancelling ``serve`` cancels every child (they run in its nursery); nothing outlives it.  A
child's ``Cancelled``, ``KeyboardInterrupt`` or other non-``Exception`` error is not
supervised: it propagates out of ``serve`` once the other children are cancelled.

Usage::

    async def serve_cache(*, task_status):
        cache = await connect()
        task_status.started(cache)
        await cache.serve_forever()

    supervisor = Supervisor([ChildSpec("cache", serve_cache)], policy=RestartPolicy(max_restarts=3))
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.serve)
        print(supervisor.statistics())
"""

from __future__ import annotations

import enum
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, NoReturn

import trio
from trio_typing import TaskStatus

from .errors import RestartLimitError

__all__ = [
    "ChildInfo",
    "ChildSpec",
    "ChildState",
    "RestartIntensity",
    "RestartPolicy",
    "Strategy",
    "Supervisor",
    "SupervisorEvent",
    "SupervisorStatistics",
]

log = logging.getLogger(__name__)

_RESTART_KINDS = ("permanent", "transient", "temporary")


class Strategy(enum.StrEnum):
    """What a supervisor restarts when one of its children stops."""

    ONE_FOR_ONE = "one_for_one"
    ONE_FOR_ALL = "one_for_all"


def _check_number(name: str, value: object, minimum: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < minimum:
        raise ValueError(f"{name} must be finite and >= {minimum:g}, got {value!r}")


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How often a supervisor may restart, and how long it waits before each restart."""

    max_restarts: int = 5  # restarts allowed within window_s; one more failure gives up
    window_s: float = 60.0
    backoff_s: float = 0.05  # delay before the first restart in a window
    backoff_max_s: float = 5.0
    backoff_factor: float = 2.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_restarts, int) or isinstance(self.max_restarts, bool):
            raise ValueError(f"max_restarts must be an int, got {self.max_restarts!r}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts!r}")
        _check_number("window_s", self.window_s, 0)
        if self.window_s == 0:  # an empty window would never give up
            raise ValueError("window_s must be > 0")
        _check_number("backoff_s", self.backoff_s, 0)
        _check_number("backoff_max_s", self.backoff_max_s, 0)
        _check_number("backoff_factor", self.backoff_factor, 1)

    def backoff(self, recent_restarts: int) -> float:
        """Delay before the next restart when ``recent_restarts`` restarts already happened in
        the window: ``min(backoff_max_s, backoff_s * backoff_factor ** recent_restarts)``."""
        if self.backoff_s == 0:
            return 0.0
        try:
            delay = self.backoff_s * self.backoff_factor ** max(recent_restarts, 0)
        except OverflowError:
            return self.backoff_max_s
        return min(self.backoff_max_s, delay)


class RestartIntensity:
    """Pure bookkeeping (no trio): the times of the restarts inside a sliding window.

    ``now`` is passed in and must not go backwards between ``record`` calls.
    """

    def __init__(self, policy: RestartPolicy) -> None:
        self._policy = policy
        self._times: deque[float] = deque()  # restarts that may still be inside the window
        self._total = 0

    def recent(self, now: float) -> int:
        """Restarts recorded within ``(now - window_s, now]``."""
        start = now - self._policy.window_s
        return sum(1 for t in self._times if start < t <= now)

    def allow(self, now: float) -> bool:
        """True if one more restart is allowed at ``now``."""
        return self.recent(now) < self._policy.max_restarts

    def record(self, now: float) -> None:
        """A restart happened at ``now``."""
        self._times.append(now)
        self._total += 1
        while self._times and self._times[0] <= now - self._policy.window_s:
            self._times.popleft()

    @property
    def total(self) -> int:
        """Restarts ever recorded."""
        return self._total


class ChildState(enum.StrEnum):
    """Where a child is in its lifecycle (see :meth:`Supervisor.children`)."""

    STARTING = "starting"
    RUNNING = "running"
    RESTARTING = "restarting"  # waiting for its backoff
    STOPPED = "stopped"  # done for good (returned, or temporary); not restarted
    FAILED = "failed"  # the supervisor gave up, or its first start failed


@dataclass(frozen=True, slots=True)
class ChildSpec:
    """One child: ``fn(*, task_status)`` must call ``task_status.started(value)`` when ready.

    ``restart``: ``"permanent"`` is restarted after a failure or a normal return,
    ``"transient"`` only after a failure, ``"temporary"`` never.
    """

    name: str
    fn: Callable[..., Awaitable[Any]]
    restart: str = "permanent"

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a child needs a name")
        if self.restart not in _RESTART_KINDS:
            raise ValueError(f"restart must be one of {_RESTART_KINDS}, got {self.restart!r}")


@dataclass(frozen=True, slots=True)
class ChildInfo:
    """A snapshot of one child."""

    name: str
    state: ChildState
    restarts: int
    last_error: str | None  # "TypeName: message" of its last failure
    started_at: float | None  # trio.current_time() of its latest successful start


@dataclass(frozen=True, slots=True)
class SupervisorEvent:
    """What ``on_event`` receives: "started", "failed", "exited", "restarting" or "gave_up"."""

    kind: str
    child: str
    time: float
    error: BaseException | None = None
    backoff_s: float | None = None
    value: Any = None  # for "started": what the child passed to task_status.started()


@dataclass(frozen=True, slots=True)
class SupervisorStatistics:
    """A snapshot of a supervisor: restarts made, every child, and whether it gave up."""

    restarts: int
    children: tuple[ChildInfo, ...]
    last_failure: str | None  # "child: TypeName: message"
    gave_up: bool


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclass(eq=False, slots=True)
class _Run:
    """One incarnation of a child: its own cancel scope, and an event set when its task ends."""

    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    done: trio.Event = field(default_factory=trio.Event)


@dataclass(eq=False, slots=True)
class _Slot:
    """A child's mutable bookkeeping; only the supervising loop changes it."""

    spec: ChildSpec
    state: ChildState = ChildState.STARTING
    restarts: int = 0
    last_error: str | None = None
    started_at: float | None = None
    run: _Run | None = None  # the current incarnation; a report from any other one is stale


class _Exit(NamedTuple):
    slot: _Slot
    run: _Run
    error: Exception | None  # None: the child returned normally


class _StartSpy:
    """Passes ``started`` through and remembers whether the child called it."""

    def __init__(self, inner: TaskStatus[Any]) -> None:
        self._inner = inner
        self.called = False

    def started(self, value: Any = None) -> None:
        self._inner.started(value)
        self.called = True


class Supervisor:
    """Starts ``children`` in order (all at once with ``concurrent_start``) and keeps them
    running under ``strategy`` and ``policy``.

    ``on_event`` is called synchronously for every :class:`SupervisorEvent`; an exception it
    raises is logged and ignored.  Failures are handled one at a time, in the order they occur.
    ``excused(error)``, asked once per failure after its ``failed`` event: True when the
    failure is not the sign of a crash loop (the engine quarantined the request that crashed
    its workers, or the workers had completed work since), so the restart happens at once and
    does not count against the restart intensity; a crash loop (failures with no progress in
    between) still meets the backoff and the limit.  With ``max_restarts=0`` nothing is
    excused: no failure is restarted.
    """

    def __init__(
        self,
        children: Sequence[ChildSpec],
        *,
        strategy: Strategy = Strategy.ONE_FOR_ONE,
        policy: RestartPolicy = RestartPolicy(),
        name: str = "supervisor",
        on_event: Callable[[SupervisorEvent], None] | None = None,
        excused: Callable[[Exception | None], bool] | None = None,
        concurrent_start: bool = False,
    ) -> None:
        names = [spec.name for spec in children]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"duplicate child names: {duplicates}")
        self._slots = [_Slot(spec) for spec in children]  # in start order
        self._strategy = Strategy(strategy)
        self._policy = policy
        self._name = name
        self._on_event = on_event
        self._excused = excused
        self._concurrent_start = concurrent_start
        self._excused_restarts = 0  # made at once, outside the intensity limit
        self._intensity = RestartIntensity(policy)
        self._last_failure: str | None = None
        self._gave_up = False
        self._nursery: trio.Nursery | None = None  # set while serve runs
        self._send: trio.MemorySendChannel[_Exit] | None = None

    @property
    def restarts(self) -> int:
        """Restarts made so far (a one-for-all group restart counts once; excused ones too)."""
        return self._intensity.total + self._excused_restarts

    def children(self) -> list[ChildInfo]:
        """A snapshot of every child, in start order."""
        return [
            ChildInfo(s.spec.name, s.state, s.restarts, s.last_error, s.started_at)
            for s in self._slots
        ]

    def statistics(self) -> SupervisorStatistics:
        return SupervisorStatistics(
            self.restarts, tuple(self.children()), self._last_failure, self._gave_up
        )

    async def serve(
        self, *, task_status: TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Start every child in order (``concurrent_start``: all at once, for children that
        are slow to start and independent, such as engine replicas in processes of their
        own), report ready with ``task_status.started(self)`` once every one is, then
        supervise them until every child has stopped for good.

        A child that fails its first start is a configuration error: the children already
        started (or starting) are cancelled and its exception propagates unchanged, with no
        restart (with several failing at once, the first to fail).  Raises
        :class:`RestartLimitError` once the restart intensity is exceeded, after cancelling
        every child.  Cancelling ``serve`` cancels every child; nothing outlives it.  Runs once.
        """
        if self._nursery is not None:
            raise RuntimeError(f"{self._name} is already serving")
        send, receive = trio.open_memory_channel[_Exit](math.inf)
        async with trio.open_nursery() as nursery:
            self._nursery, self._send = nursery, send
            if self._concurrent_start:
                await self._start_all()
            else:
                for slot in self._slots:
                    await self._start(slot, first=True)
            task_status.started(self)
            while not all(s.state is ChildState.STOPPED for s in self._slots):
                exit_ = await receive.receive()
                if exit_.run is exit_.slot.run and not exit_.run.scope.cancel_called:
                    await self._handle_exit(exit_.slot, exit_.error)

    async def _run_child(
        self, slot: _Slot, run: _Run, *, task_status: TaskStatus[Any] = trio.TASK_STATUS_IGNORED
    ) -> None:
        # The child runs in this task, inside its own cancel scope; once it has started, its
        # outcome goes to the supervising loop unless the supervisor cancelled it on purpose.
        assert self._send is not None
        spy = _StartSpy(task_status)
        error: Exception | None = None
        try:
            with run.scope:
                try:
                    await slot.spec.fn(task_status=spy)
                except Exception as exc:
                    if not spy.called:
                        raise  # nursery.start raises it in the supervising loop
                    error = exc
            if run.scope.cancel_called:
                if error is not None:
                    log.warning(
                        "%s: %s failed while cancelled: %r", self._name, slot.spec.name, error
                    )
            elif spy.called:
                self._send.send_nowait(_Exit(slot, run, error))
        finally:
            run.done.set()

    async def _start_all(self) -> None:
        """The first start of every child at once; the first failure cancels the starts
        still under way and is raised."""
        errors: list[Exception] = []

        async def start(slot: _Slot, starters: trio.Nursery) -> None:
            try:
                await self._start(slot, first=True)
            except Exception as exc:
                errors.append(exc)
                starters.cancel_scope.cancel()

        async with trio.open_nursery() as starters:
            for slot in self._slots:
                starters.start_soon(start, slot, starters)
        if errors:
            raise errors[0]

    async def _start(self, slot: _Slot, *, first: bool = False) -> None:
        """Start a new incarnation of ``slot``; raises what the child raised before it was
        ready (also a RuntimeError if it returned without calling ``started``).  A failed
        ``first`` start is logged at debug level only: it propagates to the caller of
        :meth:`serve`, who reports it (a bad model named twice is noise)."""
        assert self._nursery is not None
        slot.state = ChildState.STARTING
        slot.run = run = _Run()
        try:
            value = await self._nursery.start(self._run_child, slot, run, name=slot.spec.name)
        except Exception as exc:
            slot.state = ChildState.FAILED
            self._note_failure(slot, exc, level=logging.DEBUG if first else logging.WARNING)
            raise
        slot.state = ChildState.RUNNING
        slot.started_at = trio.current_time()
        self._emit("started", slot, value=value)

    async def _handle_exit(self, slot: _Slot, error: Exception | None) -> None:
        if error is None:
            self._emit("exited", slot)
            restart = slot.spec.restart == "permanent"
        else:
            self._note_failure(slot, error)
            restart = slot.spec.restart != "temporary"
        if not restart:
            slot.state = ChildState.STOPPED
            return
        group = [slot]
        if self._strategy is Strategy.ONE_FOR_ALL:
            others = [s for s in self._slots if s is not slot and s.state is ChildState.RUNNING]
            await self._cancel(others)
            for other in others:  # temporary children never come back, even in a group
                if other.spec.restart == "temporary":
                    other.state = ChildState.STOPPED
            group = [
                s
                for s in self._slots
                if s is slot or (s in others and s.state is not ChildState.STOPPED)
            ]
        await self._restart(slot, error, group)

    async def _cancel(self, slots: Sequence[_Slot]) -> None:
        """Cancel ``slots`` and wait until their tasks have ended."""
        runs = [s.run for s in slots if s.run is not None]
        for run in runs:
            run.scope.cancel()
        for run in runs:
            await run.done.wait()

    def _is_excused(self, error: Exception | None) -> bool:
        if self._excused is None or error is None or self._policy.max_restarts == 0:
            return False  # max_restarts=0 means no restart at all, excused or not
        try:
            return bool(self._excused(error))
        except Exception:
            log.exception("%s: excused raised for %r; not excused", self._name, error)
            return False

    async def _restart(self, failed: _Slot, error: Exception | None, group: list[_Slot]) -> None:
        """Restart ``group`` (in start order) after ``failed`` stopped with ``error``.  A child
        that fails while restarting is one more failure, handled the same way."""
        excused = self._is_excused(error)  # the failure itself; never a failed restart
        while True:
            now = trio.current_time()
            if not excused and not self._intensity.allow(now):
                self._give_up(failed, error)
            delay = 0.0 if excused else self._policy.backoff(self._intensity.recent(now))
            for slot in group:
                slot.state = ChildState.RESTARTING
            self._emit("restarting", failed, error=error, backoff_s=delay)
            log.info("%s: restarting %s in %g s", self._name, failed.spec.name, delay)
            await trio.sleep(delay)
            if excused:
                self._excused_restarts += 1
            else:
                self._intensity.record(trio.current_time())
            excused = False
            for slot in group:
                slot.restarts += 1
            current = group[0]
            try:
                for current in group:
                    await self._start(current)
                return
            except Exception as exc:
                failed, error = current, exc
                await self._cancel([s for s in group if s.state is ChildState.RUNNING])

    def _give_up(self, failed: _Slot, error: Exception | None) -> NoReturn:
        self._gave_up = True
        for slot in self._slots:
            if slot.run is not None:
                slot.run.scope.cancel()
            if slot.state is not ChildState.STOPPED:
                slot.state = ChildState.FAILED
        self._emit("gave_up", failed, error=error)
        log.error("%s: %s failed too often; giving up", self._name, failed.spec.name)
        raise RestartLimitError(
            failed.spec.name,
            restarts=self._intensity.total,
            max_restarts=self._policy.max_restarts,
            window_s=self._policy.window_s,
            last_error=error,
        ) from error

    def _note_failure(self, slot: _Slot, exc: Exception, *, level: int = logging.WARNING) -> None:
        slot.last_error = _describe(exc)
        self._last_failure = f"{slot.spec.name}: {slot.last_error}"
        log.log(level, "%s: child %s failed: %s", self._name, slot.spec.name, slot.last_error)
        self._emit("failed", slot, error=exc)

    def _emit(
        self,
        kind: str,
        slot: _Slot,
        *,
        error: BaseException | None = None,
        backoff_s: float | None = None,
        value: Any = None,
    ) -> None:
        if self._on_event is None:
            return
        event = SupervisorEvent(kind, slot.spec.name, trio.current_time(), error, backoff_s, value)
        try:
            self._on_event(event)
        except Exception:
            log.exception("%s: on_event raised for %s; ignored", self._name, event)
