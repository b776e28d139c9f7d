"""One executor for every process backend, over a :class:`Transport` seam.

A :class:`GroupExecutor` owns everything a group of worker processes needs, whatever carries
its messages: the call skeleton (one :class:`~omni_trio._core.messages.WorkerCall` to every
rank, every rank's one reply, only the output rank's result shipped), one
:class:`~omni_trio.executors.result_pump.ResultPump` per rank as the **only reader** of that
rank's replies (``RPC_RESULT``, ``COMPUTE_DONE``, ``OUTPUT_READY``: correlated by id, in any
order), one :class:`~omni_trio._core.liveness.LivenessTracker` for the group, fail-closed,
teardown escalation, error boxing, statistics and ``aclose``.  The same rules hold on every
backend:

- a rank that exits, goes silent, stops making progress in a call, loses its output packer,
  fails a call that must not fail (an execute call), or does not answer an RPC within its
  timeout **fails the group closed**: every pending call and output fails at once and every
  rank is **killed** (a failed group is never asked: a hung worker would not answer);
- a normal close **asks** every rank to stop (each stops its forward at a step boundary and
  shuts its worker down), waits at most ``close_timeout_s``, then kills what is left.

A backend implements a :class:`Transport` only: open the group's environment, start a rank
and hand on what it sends, send to a rank, kill a rank, wait for it to exit, ask ranks to
stop (docs/backends.md has a worked example).
"""

from __future__ import annotations

import abc
import dataclasses
import itertools
import logging
import math
import os
import secrets
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import trio
from trio_typing import TaskStatus

from .._core.data_parallel import DataParallelRouter
from .._core.health import WorkerState, WorkerStatus
from .._core.liveness import LivenessTracker
from .._core.messages import (
    AsyncOutput,
    AsyncOutputKind,
    BatchRunnerOutput,
    Heartbeat,
    RunnerOutput,
    SchedulerOutput,
    WorkerAbort,
    WorkerCall,
)
from .._core.model_info import ModelInfo
from ..config import EngineConfig
from ..errors import EngineClosedError, EngineDeadError, PayloadError, StallError, WorkerError
from ..extensions import wire_extensions
from .base import Executor
from .result_pump import OutputCallback, ResultPump, register_async_outputs

__all__ = [
    "SECRET_ENV_WORDS",
    "STARTED",
    "Deliver",
    "EXIT_GRACE_S",
    "KILL_WAIT_S",
    "TERMINATE_WAIT_S",
    "RankInit",
    "RankStarted",
    "RankStatus",
    "GroupExecutor",
    "Transport",
    "WireMessage",
    "exit_status",
    "is_secret_env_name",
    "secrets_hidden",
    "wire_config",
]

log = logging.getLogger(__name__)

# What a rank sends its executor, and where the transport hands it.
WireMessage = AsyncOutput | Heartbeat
Deliver = Callable[[WireMessage], None]
# A close that asked in vain terminates, then waits this long before it kills.
TERMINATE_WAIT_S = 3.0
# After a kill: how long to wait for every rank's process to be gone.
KILL_WAIT_S = 10.0
# A rank's channel ended: how long its process may take to be seen gone (then the exit,
# with its status, is the group's failure rather than the channel).
EXIT_GRACE_S = 1.0


# Words that make an environment variable a secret (the daemon's API key, hub tokens): a
# worker process never gets one.
SECRET_ENV_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")


def is_secret_env_name(name: str) -> bool:
    """Whether environment variable ``name`` looks like a credential to keep from workers.
    Ray's own (``RAY_AUTH_TOKEN``...) are not: Ray's processes need them to reach their
    cluster, and they grant nothing beyond it."""
    upper = name.upper()
    if upper.startswith("RAY_"):
        return False
    return any(word in upper for word in SECRET_ENV_WORDS)


# Per environment mapping (by id) being hidden: [blocks inside, the secrets taken out].
_HIDING: dict[int, tuple[list[int], dict[str, str]]] = {}


@contextmanager
def secrets_hidden(environ: MutableMapping[str, str] | None = None) -> Iterator[None]:
    """Take every secret out of ``environ`` (default ``os.environ``) for the block, so a
    process started inside it does not inherit one; put them back when the last of the
    blocks that overlap (two groups starting at once) ends.  (The process's environment is
    shared by its threads: keep the block short.)"""
    env = os.environ if environ is None else environ
    depth, hidden = _HIDING.setdefault(id(env), ([0], {}))
    depth[0] += 1
    for name in [n for n in env if is_secret_env_name(n)]:
        hidden[name] = env.pop(name)
    try:
        yield
    finally:
        depth[0] -= 1
        if not depth[0]:
            del _HIDING[id(env)]
            for name, value in hidden.items():
                env.setdefault(name, value)


def wire_config(config: EngineConfig) -> dict[str, Any]:
    """The configuration a worker process runs with: the engine's, as a single in-process
    worker (inside the worker there is no executor), its thread count resolved here, its
    worker-side extension classes as import paths (:func:`~omni_trio.extensions.wire_extensions`:
    :class:`InvalidConfigError` for a class another process cannot import)."""
    data = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    data["backend"] = "inproc"
    data["num_workers"] = 1
    data["data_parallel_size"] = 1
    data["torch_threads"] = config.resolved_torch_threads
    data["model_options"] = dict(config.model_options)
    data["loras"] = dict(config.loras)
    return wire_extensions(data)  # classes as import paths; no scheduler


def exit_status(code: int | None) -> str:
    """A process's exit status in words (negative: killed by that signal)."""
    import signal

    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


@dataclass(frozen=True, slots=True)
class RankInit:
    """What a rank needs to start."""

    rank: int
    world_size: int
    config: Mapping[str, Any]  # :func:`wire_config`
    dist_init_method: str | None  # a CFG-parallel group's rendezvous (two ranks)
    data_parallel_size: int = 1  # replica groups among the world_size ranks


@dataclass(frozen=True, slots=True)
class RankStarted:
    """What a started rank (its model loaded) reports."""

    pid: int | None
    model_info: Mapping[str, Any]  # ModelInfo fields; rank 0's is the group's
    node: str | None = None  # the host it runs on, where the backend knows it


# ``serve_rank``'s start handshake: it reports the rank started.
RankStatus = TaskStatus["RankStarted"]
STARTED: Any = trio.TASK_STATUS_IGNORED


class Transport(abc.ABC):
    """How a :class:`GroupExecutor` reaches its ranks.

    Everything runs on the engine's trio thread.  ``send`` and ``kill`` never block;
    ``serve_rank`` lives as long as its rank; ``open`` holds whatever the ranks live in.
    """

    #: The rank's messages include a :class:`Heartbeat` at least every
    #: ``HEARTBEAT_INTERVAL_S`` (so silence means a hang).
    heartbeats: ClassVar[bool] = True

    @abc.abstractmethod
    def open(
        self, config: EngineConfig, fail: Callable[[BaseException], None]
    ) -> AbstractAsyncContextManager[None]:
        """Enter what the ranks live in for the group's whole life (a process tree, a
        cluster connection and placement).  ``fail(error)`` fails the group from outside
        (a signal, the cluster going away).  On exit nothing of the group may be left; the
        executor has stopped or killed every rank before."""

    async def rendezvous(self, leader: int = 0) -> str:
        """The torch.distributed rendezvous of a CFG-parallel group (``tcp://host:port``,
        the same for every rank of the group) whose first rank is ``leader`` (data-parallel
        CFG pairs: one group per pair): by default a free port on loopback."""
        import socket

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        return f"tcp://127.0.0.1:{port}"

    @abc.abstractmethod
    async def serve_rank(
        self, init: RankInit, deliver: Deliver, *, task_status: RankStatus = STARTED
    ) -> None:
        """Start rank ``init.rank`` (its worker loads the model), report it started, then
        hand every message it sends to ``deliver``, in order, until its channel ends
        (return) or breaks (raise).  A startup failure raises: :class:`InvalidConfigError`
        for a configuration the worker refused, :class:`WorkerError` otherwise.
        Cancellation closes the rank's channel."""

    async def replace_ranks(self, ranks: Sequence[int]) -> None:
        """Ready ``ranks``, whose processes are gone while the others run (a data-parallel
        rank group restarting on its own), to be started again by :meth:`serve_rank`.  By
        default nothing: a transport whose ``serve_rank`` starts a new process each time."""
        return None

    @abc.abstractmethod
    def send(self, rank: int, message: WorkerCall | WorkerAbort) -> None:
        """Queue ``message`` for ``rank``; never blocks.  A :class:`WorkerAbort` takes
        effect even while a call runs there.  A rank that is gone drops it."""

    @abc.abstractmethod
    def kill(self, rank: int) -> None:
        """End ``rank`` now (SIGKILL, or the cluster's equivalent); idempotent."""

    def terminate(self, rank: int) -> None:
        """Ask the OS to end ``rank`` (SIGTERM): the step between asking the worker and
        killing it, for a close.  By default the same as :meth:`kill`."""
        self.kill(rank)

    @abc.abstractmethod
    async def wait_exited(self, rank: int) -> int | None:
        """Return once ``rank``'s process is gone, with its exit status if known
        (negative: killed by that signal)."""

    @abc.abstractmethod
    async def stop(self, ranks: Sequence[int]) -> None:
        """Ask ``ranks`` to stop (each stops its forward at a step boundary and shuts its
        worker down).  The executor bounds the wait and kills what is left."""


@dataclass(eq=False)
class _Rank:
    """The executor's side of one rank: its pump (the only reader of its replies, made
    before the rank starts) and, once started, what it reported."""

    rank: int
    pump: ResultPump
    started: RankStarted | None = None
    exit_code: int | None = None
    exited: bool = False
    gone: trio.Event = field(default_factory=trio.Event)  # set once the process is gone
    progress: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Written off on its own (data parallel: its rank group restarts while the others
    # serve): what it still sends is dropped, its exit fails nothing.
    lost: bool = False

    @property
    def pid(self) -> int | None:
        return self.started.pid if self.started is not None else None


class GroupExecutor(Executor):
    """The executor of a group of worker processes behind a :class:`Transport`; a backend
    subclasses it and implements :meth:`make_transport`.  See the module docstring."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.transport = self.make_transport()
        self._ranks: dict[int, _Rank] = {}
        self._tracker = LivenessTracker(
            ranks=config.num_workers,
            heartbeat_timeout_s=config.worker_heartbeat_timeout_s
            if self.transport.heartbeats
            else None,
            stall_timeout_s=config.worker_stall_timeout_s,
        )
        self._tag = secrets.token_hex(3)
        self._ids = itertools.count(1)
        self._group_scope: trio.CancelScope | None = None
        self._serve_done = trio.Event()
        self._closing = False
        # Data-parallel ranks (data_parallel_size > 1): who runs what, and which rank's pump
        # each announced async output comes from (absent: rank 0's).
        self._dp = (
            DataParallelRouter(config.data_parallel_size, step_mode=config.step_execution)
            if config.data_parallel_size > 1
            else None
        )
        # Ranks per data-parallel replica group: 1, or 2 (a CFG-parallel pair: ranks 2g and
        # 2g + 1 run group g's share together; the first ships the results).
        self._group_size = max(1, config.num_workers // max(1, config.data_parallel_size))
        # Which rank (its state at the time) announced each async output, in data parallel.
        self._output_ranks: dict[str, _Rank] = {}
        # Data parallel: replica groups down (restarting while the others serve) and why,
        # requests whose state died with one (reported lost when next scheduled), the times
        # of each group's restarts (its limit), and an event set while every group is up.
        self._down: dict[int, BaseException] = {}
        self._lost_ids: dict[str, str] = {}  # request id -> how its group was lost
        self._restart_times: dict[int, list[float]] = {}
        self._all_up = trio.Event()
        self._all_up.set()
        self._ranks_nursery: trio.Nursery | None = None
        self._wire: dict[str, Any] | None = None
        #: Data parallel: rank groups restarted on their own so far.
        self.rank_restarts = 0
        # The last "sleep" every rank answered ((args, kwargs); None once woken): a rank
        # group restarted meanwhile is put to sleep the same way before it gets work.
        self._asleep: tuple[tuple[Any, ...], dict[str, Any]] | None = None

    @abc.abstractmethod
    def make_transport(self) -> Transport:
        """This backend's transport."""

    # -- lifecycle ----------------------------------------------------------------------

    async def serve(self, *, task_status: TaskStatus[Executor] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every rank (concurrently; the first startup failure is raised), report
        ready, then run until closed or failed.  Teardown: a failed group is killed; a
        closing one is asked to stop, for at most ``close_timeout_s``, then killed."""
        config = self.config
        try:
            async with self.transport.open(config, self._fail_group):
                try:
                    with trio.CancelScope() as group_scope:
                        self._group_scope = group_scope
                        async with trio.open_nursery() as ranks:
                            self._ranks_nursery = ranks
                            await self._start_within_deadline(ranks)
                            first = self._ranks[0].started
                            assert first is not None
                            info = first.model_info
                            self.model_info = ModelInfo.from_dict(info)
                            self._tracker.start(trio.current_time())
                            ranks.start_soon(self._monitor)
                            for state in self._ranks.values():
                                ranks.start_soon(self._watch_exit, state)
                            task_status.started(self)
                            await trio.sleep_forever()
                finally:
                    with trio.CancelScope(shield=True):
                        await self._teardown()
        finally:
            self._closed = True
            error = self._dead_reason or EngineClosedError("executor is closed")
            for state in self._ranks.values():
                state.pump.fail(error)
            self._serve_done.set()

    async def _start_within_deadline(self, ranks: trio.Nursery) -> None:
        """Rendezvous (CFG-parallel) and start every rank within ``worker_start_timeout_s``;
        past it the start fails with ``StallError("start")`` (the ranks are killed)."""
        config = self.config
        budget = config.worker_start_timeout_s
        try:
            with trio.fail_after(budget):
                # One rendezvous per CFG-parallel group (the whole group, or each pair).
                dist: dict[int, str | None] = dict.fromkeys(range(config.num_workers))
                size = self._group_size if self._dp is not None else config.num_workers
                if size > 1 and config.cfg_parallel:
                    used: set[str] = set()
                    for leader in range(0, config.num_workers, size):
                        address = await self._rendezvous(leader, used)
                        for rank in range(leader, leader + size):
                            dist[rank] = address
                await self._start_ranks(ranks, dist)
        except trio.TooSlowError:
            pending = sorted(r for r, s in self._ranks.items() if s.started is None)
            raise StallError(
                "start",
                f"the worker group did not start within {budget} s "
                f"(worker_start_timeout_s; not ready: rank(s) {pending or 'all'})",
            ) from None

    async def _rendezvous(self, leader: int, used: set[str]) -> str:
        """A CFG-parallel pair's rendezvous address, never one in ``used`` (added to it)."""
        address = await self.transport.rendezvous(leader)
        for _ in range(8):  # a free port found twice: ask again
            if address not in used:
                break
            address = await self.transport.rendezvous(leader)
        used.add(address)
        return address

    async def _start_ranks(self, ranks: trio.Nursery, dist: Mapping[int, str | None]) -> None:
        n = self.config.num_workers
        wire = self._wire = wire_config(self.config)
        errors: list[BaseException] = []

        async def start(rank: int, starters: trio.Nursery) -> None:
            try:
                init = RankInit(rank, n, wire, dist[rank], self.config.data_parallel_size)
                started = await ranks.start(self._serve_rank, init)
                self._ranks[rank].started = started
            except Exception as exc:
                errors.append(exc)
                starters.cancel_scope.cancel()

        for rank in range(n):
            self._ranks[rank] = _Rank(rank, ResultPump(worker=rank, on_discard=self._on_discard))
        async with trio.open_nursery() as starters:
            for rank in range(n):
                starters.start_soon(start, rank, starters)
        if errors:
            raise errors[0]  # every rank usually fails the same way (a bad model)
        self._pump = self._ranks[0].pump  # the output rank's: async outputs

    async def _serve_rank(
        self, init: RankInit, *, task_status: TaskStatus[RankStarted] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """One rank's life: its transport task.  A startup failure is raised; once started,
        the rank's channel ending or breaking fails the group (unless it is closing)."""
        rank = init.rank
        state = self._ranks[rank]
        running = False

        async def run(*, task_status: TaskStatus[RankStarted] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                await self.transport.serve_rank(
                    init, lambda message: self._deliver(state, message), task_status=task_status
                )
            except Exception as exc:
                if not running:
                    raise
                reason = WorkerError(f"its channel broke: {exc!r}", worker=rank)
            else:
                reason = WorkerError("closed its channel", worker=rank)
            if self._closing or state.lost:
                return
            # A channel usually ends because its process did: then that is the failure
            # (reported by the exit watch, with the exit status), on every backend alike.
            with trio.move_on_after(EXIT_GRACE_S):
                await state.gone.wait()
                return
            self._rank_failed(state, reason)

        async with trio.open_nursery() as inner:
            started = await inner.start(run)
            running = True
            task_status.started(started)

    def _deliver(self, state: _Rank, message: WireMessage) -> None:
        """Everything a rank sends comes here: liveness first, then its pump.  What a rank
        written off still sends (already on its way) is dropped."""
        if state.lost:
            if not isinstance(message, Heartbeat):
                self._on_discard(message.result)
            return
        now = trio.current_time()
        rank = state.rank
        if isinstance(message, Heartbeat):
            self._tracker.heard(rank, now, steps=message.steps, packer_alive=message.packer_alive)
            state.progress = dict(message.progress)
            return
        self._tracker.heard(rank, now, steps=message.steps)
        state.pump.deliver(message)

    def _on_discard(self, payload: Any) -> None:
        """A payload nobody takes; backends whose payloads hold resources override this."""

    async def _watch_exit(self, state: _Rank) -> None:
        """Fail the group (data parallel: restart the rank's group) the moment a rank's
        process exits while it should be running."""
        rank = state.rank
        code = await self.transport.wait_exited(rank)
        state.exited, state.exit_code = True, code
        state.gone.set()
        if self._closing or state.lost:
            return
        pid = state.pid
        self._rank_failed(
            state,
            WorkerError(
                f"process {pid} died ({exit_status(code)})", worker=rank, error_type="WorkerDied"
            ),
        )

    async def _monitor(self) -> None:
        """The group's liveness, every ``poll_s`` (one period for every backend)."""
        tracker = self._tracker
        while True:
            await trio.sleep(tracker.poll_s)
            verdict = tracker.check(trio.current_time())
            if verdict is None:
                continue
            rank = tracker.verdict_rank
            state = self._ranks.get(rank) if rank is not None else None
            if state is None:
                self._fail_group(verdict)
                return
            if self._rank_failed(state, verdict):
                continue  # that rank's group restarts; the others go on
            return

    # -- data parallel: one rank group restarts while the others serve -------------------

    def _rank_failed(self, state: _Rank, error: BaseException) -> bool:
        """Rank ``state`` failed (died, hung, lost its channel): with data-parallel ranks,
        its replica group alone is written off and restarted while the other groups serve
        (True); otherwise, or when no other group is up, or past ``max_worker_restarts``
        restarts of that group in ``worker_restart_window_s``, the whole group fails closed
        (False)."""
        if state.lost:
            return True
        if self._dp is None or self._closing or self._dead_reason is not None:
            self._fail_group(error)
            return False
        group = state.rank // self._group_size
        if group in self._down:
            if self._ranks.get(state.rank) is state and state.started is not None:
                # A rank started in the lost one's place failed before its group was up.
                self._fail_group(error)
                return False
            return True
        config = self.config
        now = trio.current_time()
        recent = [
            t
            for t in self._restart_times.get(group, [])
            if now - t < config.worker_restart_window_s
        ]
        others_up = [g for g in self._dp.ranks_up if g != group]
        if not others_up or len(recent) >= config.max_worker_restarts:
            self._fail_group(error)
            return False
        self._restart_times[group] = [*recent, now]
        self._lose_group(group, error)
        return True

    def _group_ranks(self, group: int) -> range:
        return range(group * self._group_size, (group + 1) * self._group_size)

    def _lose_group(self, group: int, error: BaseException) -> None:
        """Write replica group ``group`` off: no share goes to it, its pumps fail (the wave
        in flight on it comes back lost, its announced outputs are lost), its ranks are
        killed; a task restarts it."""
        assert self._dp is not None and self._ranks_nursery is not None
        log.warning(
            "data-parallel worker group %d failed (%s: %s): restarting it while the others serve",
            group,
            type(error).__name__,
            error,
        )
        self._down[group] = error
        if self._all_up.is_set():  # (one event while any group is down: its waiters stay)
            self._all_up = trio.Event()
        reason = f"{type(error).__name__}: {error}"
        self._lost_ids.update(dict.fromkeys(self._dp.down(group), reason))
        # (Outputs of its ranks that arrived and were not taken yet are released with the
        # pumps: their requests run again, as after a whole-group failure.)
        lost = RankLostError(f"data-parallel worker group {group} failed: {error}")
        ranks = self._group_ranks(group)
        self._tracker.pardon(ranks)
        for rank in ranks:
            state = self._ranks[rank]
            state.lost = True
            state.pump.fail(lost)
            self._kill(rank)
        self._ranks_nursery.start_soon(self._restart_group, group)

    async def _restart_group(self, group: int) -> None:
        """Wait until the lost group's processes are gone, start its ranks again (with a
        fresh rendezvous for a CFG pair), and give it shares again.  A failed start fails
        the whole group."""
        config = self.config
        ranks = self._group_ranks(group)
        old = [self._ranks[rank] for rank in ranks]
        began = trio.current_time()
        try:
            with trio.fail_after(KILL_WAIT_S):
                for state in old:
                    if not state.exited:
                        await self._wait_one_state(state)
            # (Replaced first: a CFG pair meets on its new leader's host.)
            await self.transport.replace_ranks(ranks)
            dist: dict[int, str | None] = dict.fromkeys(ranks)
            if self._group_size > 1 and config.cfg_parallel:
                address = await self._rendezvous(ranks[0], set())
                dist = dict.fromkeys(ranks, address)
            for rank in ranks:
                pump = ResultPump(worker=rank, on_discard=self._on_discard)
                self._ranks[rank] = _Rank(rank, pump)
            assert self._wire is not None and self._ranks_nursery is not None
            nursery = self._ranks_nursery
            n, dp = config.num_workers, config.data_parallel_size
            with trio.fail_after(config.worker_start_timeout_s):
                async with trio.open_nursery() as starters:
                    for rank in ranks:
                        init = RankInit(rank, n, self._wire, dist[rank], dp)
                        starters.start_soon(self._restart_rank, nursery, init)
        except Exception as exc:  # (trio.TooSlowError included)
            if not self._closing:
                self._fail_group(
                    WorkerError(
                        f"data-parallel worker group {group} did not start again: {exc!r}",
                        worker=ranks[0],
                        error_type="WorkerRestartFailed",
                    )
                )
            return
        if self._closing or self._dead_reason is not None:
            return
        now = trio.current_time()
        self._tracker.resume(ranks, now)
        for rank in ranks:
            nursery.start_soon(self._watch_exit, self._ranks[rank])
        if 0 in ranks:
            self._pump = self._ranks[0].pump
        if self._asleep is not None:
            # The engine sleeps: so does the restarted group, before it counts as up.
            args, kwargs = self._asleep
            try:
                await self._call(
                    "sleep",
                    args,
                    kwargs,
                    reply_rank=None,
                    timeout=config.rpc_timeout_s,
                    per_rank={rank: args for rank in ranks},
                )
            except Exception as exc:
                if not self._closing:
                    self._fail_group(exc)
                return
            if self._closing or self._dead_reason is not None or group not in self._down:
                return
            now = trio.current_time()
        del self._down[group]
        assert self._dp is not None
        self._dp.up(group)
        if not self._down:
            self._all_up.set()
        self.rank_restarts += 1
        log.warning(
            "data-parallel worker group %d serves again (restarted in %.2f s)", group, now - began
        )

    async def _restart_rank(self, nursery: trio.Nursery, init: RankInit) -> None:
        self._ranks[init.rank].started = await nursery.start(self._serve_rank, init)

    async def _wait_one_state(self, state: _Rank) -> None:
        code = await self.transport.wait_exited(state.rank)
        state.exited = True
        if state.exit_code is None:
            state.exit_code = code
        state.gone.set()

    def _take_lost(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[SchedulerOutput, dict[str, str]]:
        """The rows of ``scheduler_output`` that go on from state that died with a lost
        group (step mode: a request pinned there, scheduled again as a cached row): taken
        out, to be reported lost, with how.  (A new row starts from step 0: nothing lost.)"""
        lost = self._lost_ids
        if not lost:
            return scheduler_output, {}
        for rid in scheduler_output.finished_req_ids:
            lost.pop(rid, None)
        for new in scheduler_output.scheduled_new_reqs:
            lost.pop(new.request_id, None)
        rows = {rid: lost.pop(rid) for rid in scheduler_output.scheduled_cached_reqs if rid in lost}
        if not rows:
            return scheduler_output, {}
        kept = dataclasses.replace(
            scheduler_output,
            scheduled_cached_reqs=tuple(
                rid for rid in scheduler_output.scheduled_cached_reqs if rid not in rows
            ),
        )
        return kept, rows

    def _fail_group(self, error: BaseException) -> None:
        """Fail closed: remember why, fail every pending call and output, kill every rank
        (never ask a failed group: a hung worker would not answer)."""
        if self._closing and self._dead_reason is None:
            return
        first = self._dead_reason is None
        self.fail(error)
        if not first:
            return
        log.warning("worker group failed: %s: %s", type(error).__name__, error)
        self._all_up.set()  # nothing waits for a group restart any more
        for state in self._ranks.values():
            state.pump.fail(error)
        for rank in self._ranks:
            self._kill(rank)
        if self._group_scope is not None:
            self._group_scope.cancel()

    def _kill(self, rank: int) -> None:
        try:
            self.transport.kill(rank)
        except Exception:  # pragma: no cover - best effort: the wait below bounds it
            log.exception("could not kill worker %d", rank)

    async def _teardown(self) -> None:
        """A failed group: kill, wait.  A closing one: ask, wait at most
        ``close_timeout_s``, terminate, wait a little, kill, wait."""
        # A rank that never started is the transport's to end (its ``open`` exit).
        ranks = [r for r, s in self._ranks.items() if s.started is not None and not s.exited]
        if not ranks:
            return
        if self._dead_reason is None:
            budget = self.config.close_timeout_s
            with trio.move_on_after(budget) as scope:
                await self.transport.stop(ranks)
                await self._wait_exited(ranks)
            if not scope.cancelled_caught:
                return
            log.warning("workers did not stop in %s s; terminating them", budget)
            ranks = [r for r in ranks if not self._ranks[r].exited]
            for rank in ranks:
                self.transport.terminate(rank)
            with trio.move_on_after(TERMINATE_WAIT_S) as scope:
                await self._wait_exited(ranks)
            if not scope.cancelled_caught:
                return
            ranks = [r for r in ranks if not self._ranks[r].exited]
        for rank in ranks:
            self._kill(rank)
        with trio.move_on_after(KILL_WAIT_S) as scope:
            await self._wait_exited(ranks)
        if scope.cancelled_caught:
            log.error("worker processes still exist %s s after the kill", KILL_WAIT_S)

    async def _wait_exited(self, ranks: Sequence[int]) -> None:
        async with trio.open_nursery() as waiters:
            for rank in ranks:
                waiters.start_soon(self._wait_one, rank)

    async def _wait_one(self, rank: int) -> None:
        state = self._ranks[rank]
        if state.exited:
            return
        code = await self.transport.wait_exited(rank)
        state.exited = True
        if state.exit_code is None:
            state.exit_code = code
        state.gone.set()

    async def aclose(self) -> None:
        """Stop in-flight work at its next step, stop the workers (ask, bounded wait, kill);
        idempotent and shielded from cancellation."""
        if self._closing:
            with trio.CancelScope(shield=True):
                await self._serve_done.wait()
            return
        self._closing = True
        self._closed = True
        with trio.CancelScope(shield=True):
            closed = EngineClosedError("executor is closed")
            self._all_up.set()
            for state in self._ranks.values():
                state.pump.fail(closed)
            if self._group_scope is not None:
                self._group_scope.cancel()
                await self._serve_done.wait()

    # -- calls --------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._dead_reason is not None or self._closed:
            self.check_health()
        if self.model_info is None:
            raise EngineClosedError("executor is not started")

    async def _call(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        reply_rank: int | None = 0,
        timeout: float | None = None,
        abort_ids: Sequence[str] = (),
        with_rpc_id: bool = False,
        per_rank: Mapping[int, tuple[Any, ...]] | None = None,
        reply_ranks: Mapping[int, int | None] | None = None,
    ) -> dict[int, AsyncOutput]:
        """Send one call to every rank; every rank's reply, each read by its pump.  A rank's
        error becomes one :class:`WorkerError` naming every failed rank (a ``fatal`` one, a
        broken worker, also fails the group); no reply within
        ``timeout`` fails the group (``StallError("rpc")``): a worker runs one call at a
        time, so every later call would queue behind the stuck one.  If cancelled,
        ``abort_ids`` are aborted (the forward stops at its next step).
        ``with_rpc_id`` passes the call's id to the method (``rpc_id=``).  A call the
        transport cannot send to the first rank (its codec cannot carry an argument) raises
        :class:`PayloadError`: nothing was sent, the group is fine.  ``per_rank`` (data
        parallel): only those ranks are called, each with its own ``args``; ``reply_ranks``
        (data-parallel CFG pairs): each rank's own ``reply_rank``."""
        self._check_usable()
        if per_rank is None and not self._all_up.is_set():
            # Every rank is asked: wait for a data-parallel group that restarts (its own
            # time counts against the call's timeout).
            began = trio.current_time()
            await self._wait_all_up(method, timeout)
            if timeout is not None:
                timeout = max(0.0, timeout - (trio.current_time() - began))
            self._check_usable()
        rpc_id = f"{self._tag}-{next(self._ids)}"
        ranks = sorted(self._ranks) if per_rank is None else sorted(per_rank)
        states = [self._ranks[rank] for rank in ranks]
        call_kwargs = dict(kwargs or {})
        if with_rpc_id:
            call_kwargs["rpc_id"] = rpc_id
        calls = {
            rank: WorkerCall(
                rpc_id,
                method,
                tuple(args if per_rank is None else per_rank[rank]),
                call_kwargs,
                reply_rank if reply_ranks is None else reply_ranks[rank],
            )
            for rank in ranks
        }
        for state in states:
            state.pump.register_rpc(rpc_id)
        for index, state in enumerate(states):
            try:
                self.transport.send(state.rank, calls[state.rank])
            except Exception as exc:
                # Some rank has the call: the ranks no longer agree (also a CFG pair whose
                # first rank has it: it would wait in a collective for its partner): the
                # group fails.
                rank = state.rank
                split_pair = reply_ranks is not None and reply_ranks[rank] != rank
                if index and (per_rank is None or split_pair):
                    raise
                if index:  # data parallel: take back the shares already sent
                    await self._withdraw(rpc_id, states[:index], abort_ids, timeout)
                for done in states:
                    done.pump.forget_rpc(rpc_id)
                raise PayloadError(
                    f"{method!r} could not be sent: {type(exc).__name__}: {exc}"
                ) from exc
        self._tracker.call_started(trio.current_time(), ranks)
        in_call = set(ranks)
        replies: dict[int, AsyncOutput] = {}
        failed_by_rank: dict[int, WorkerError] = {}
        errors: list[Exception] = []
        lost: list[int] = []

        async def wait_reply(state: _Rank) -> None:
            # Every rank's reply is awaited at once: a rank that answered leaves the call
            # (its liveness clock stops) however long the others take.
            try:
                replies[state.rank] = await state.pump.wait_rpc(rpc_id, math.inf)
            except RankLostError as exc:
                if self._dead_reason is not None:
                    errors.append(exc)
                else:
                    lost.append(state.rank)  # its group restarts; the others' replies count
            except WorkerError as exc:
                if self._dead_reason is not None:
                    errors.append(exc)
                else:
                    failed_by_rank[state.rank] = exc
            except Exception as exc:  # the group failed: the pump's failure
                errors.append(exc)
            finally:
                in_call.discard(state.rank)
                self._tracker.call_ended((state.rank,))

        try:
            with trio.fail_after(math.inf if timeout is None else timeout):
                if len(states) == 1:
                    await wait_reply(states[0])
                else:
                    try:
                        async with trio.open_nursery() as waiters:
                            for state in states:
                                waiters.start_soon(wait_reply, state)
                    except BaseExceptionGroup as group:
                        # Several waiters' Cancelled: raise one, as a single wait would
                        # (callers catch ``trio.Cancelled``, not a group of them).
                        cancelled = _sole_cancelled(group)
                        if cancelled is None:
                            raise
                        raise cancelled from None
                if errors:
                    raise errors[0]
        except trio.TooSlowError:
            error = StallError("rpc", f"{method!r} got no reply within {timeout} s")
            self._fail_group(error)
            raise error from None
        except trio.Cancelled:
            if abort_ids:
                self.abort_requests(abort_ids)
            raise
        finally:
            self._tracker.call_ended(in_call)
            for state in states:
                state.pump.forget_rpc(rpc_id)
        if lost and per_rank is None:
            # A call to every rank: every rank of a lost group (a CFG partner that answered
            # died with it) is replaced, and the replacements get it anew.
            size = self._group_size
            groups = {rank // size for rank in lost}
            again = await self._call_replacements(
                method,
                args,
                kwargs,
                [rank for g in sorted(groups) for rank in self._group_ranks(g)],
                reply_rank,
                timeout,
                with_rpc_id,
            )
            replies.update(again)
        failed = [failed_by_rank[rank] for rank in ranks if rank in failed_by_rank]
        if failed:
            failure = _rank_failures(method, failed)
            if failure.fatal:  # a rank is broken itself (a device fault): replace the group
                self._fail_group(failure)
            raise failure
        if per_rank is None and method == "sleep":
            self._asleep = (tuple(args), dict(kwargs or {}))
        elif per_rank is None and method == "wake_up":
            self._asleep = None
        return replies

    async def _wait_all_up(self, method: str, timeout: float | None) -> None:
        """Until no data-parallel group is down (or the group failed or closed); past
        ``timeout``: ``StallError("rpc")``, the group left alone (its restart has its own
        deadline)."""
        with trio.move_on_after(math.inf if timeout is None else timeout):
            await self._all_up.wait()
        if not self._all_up.is_set():
            down = sorted(self._down)
            raise StallError(
                "rpc", f"{method!r}: data-parallel group(s) {down} not back within {timeout} s"
            )

    async def _call_replacements(
        self,
        method: str,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any] | None,
        ranks: Sequence[int],
        reply_rank: int | None,
        timeout: float | None,
        with_rpc_id: bool,
    ) -> dict[int, AsyncOutput]:
        """A call to every rank lost ``ranks`` (their data-parallel group died before they
        all answered): once they are back (within ``timeout``), the ranks started in their
        place, which never ran it, are called; lost again, the call fails (``WorkerDied``)."""
        began = trio.current_time()
        await self._wait_all_up(method, timeout)
        self._check_usable()
        if timeout is not None:
            timeout = max(0.0, timeout - (trio.current_time() - began))
        replies = await self._call(
            method,
            args,
            kwargs,
            reply_rank=reply_rank,
            timeout=timeout,
            with_rpc_id=with_rpc_id,
            per_rank={rank: tuple(args) for rank in ranks},
        )
        missing = [rank for rank in ranks if rank not in replies]
        if missing:
            raise WorkerError(
                f"{method!r}: rank(s) {missing} died twice before they answered",
                worker=missing[0],
                error_type="WorkerDied",
            )
        return replies

    async def _withdraw(
        self,
        rpc_id: str,
        sent: Sequence[_Rank],
        abort_ids: Sequence[str],
        timeout: float | None,
    ) -> None:
        """Data parallel: a later rank's share could not be sent, so the wave is refused
        as a whole (a :class:`PayloadError`, as when nothing was sent): the ranks that got
        theirs are told to abort it (they stop before their first step), their replies are
        awaited (at most ``timeout``, else the group fails) and whatever they announced is
        released."""
        if abort_ids:
            for state in sent:
                self.transport.send(state.rank, WorkerAbort(tuple(abort_ids)))
        try:
            with trio.fail_after(math.inf if timeout is None else timeout):
                for state in sent:
                    try:
                        reply = await state.pump.wait_rpc(rpc_id, math.inf)
                    except WorkerError:
                        if self._dead_reason is not None:
                            raise
                        continue  # that share failed: nothing of it to release
                    result = reply.result
                    if reply.kind is AsyncOutputKind.COMPUTE_DONE and isinstance(
                        result, BatchRunnerOutput
                    ):
                        register_async_outputs(state.pump, result)
                        for output in result:
                            if output.async_output_id:
                                state.pump.drop(output.async_output_id)
        except trio.TooSlowError:
            error = StallError("rpc", f"a withdrawn share got no reply within {timeout} s")
            self._fail_group(error)
            raise error from None

    async def _execute(self, method: str, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
        if self._dp is not None:
            return await self._execute_data_parallel(method, scheduler_output, self._dp)
        try:
            replies = await self._call(
                method,
                (scheduler_output,),
                abort_ids=scheduler_output.scheduled_request_ids,
                with_rpc_id=method == "execute_scheduler_output",
            )
        except (trio.Cancelled, EngineClosedError, PayloadError):
            raise  # a payload that cannot be sent is its request's fault, never the group's
        except Exception as exc:
            # A forward never raises for a request's own failure: this worker is broken.
            self._fail_group(exc)
            raise EngineDeadError(f"worker group failed: {exc}") from exc
        reply = replies[0]
        result = reply.result
        if not isinstance(result, BatchRunnerOutput):
            error = WorkerError(f"{method!r} returned {type(result).__name__}", worker=0)
            self._fail_group(error)
            raise EngineDeadError(str(error)) from error
        if reply.kind is AsyncOutputKind.COMPUTE_DONE:
            register_async_outputs(self._ranks[0].pump, result)
        return result

    async def _execute_data_parallel(
        self, method: str, scheduler_output: SchedulerOutput, router: DataParallelRouter
    ) -> BatchRunnerOutput:
        """Each rank runs its own share (:class:`DataParallelRouter`); the replies are
        merged by request id.  A rank answering for a request it was not given is a broken
        worker (the group fails, as for any bad reply); a request missing from its rank's
        reply ends as any missing output does (``MissingOutputError``).  If the call fails
        before it ran (a payload that cannot be sent, a cancellation), the finished ids the
        shares carried are delivered again with the next call."""
        scheduler_output, lost_rows = self._take_lost(scheduler_output)
        shares = router.split(scheduler_output)
        if not shares:
            return self._with_lost({}, lost_rows)
        size = self._group_size
        # Each group's share goes to every rank of the group; its first rank ships the
        # results (a CFG pair's second rank answers with none).
        per_rank = {
            leader * size + member: (share,)
            for leader, share in shares.items()
            for member in range(size)
        }
        at_call = {rank: self._ranks[rank] for rank in per_rank}
        try:
            replies = await self._call(
                method,
                reply_rank=None,  # every group ships its own share's results
                abort_ids=scheduler_output.scheduled_request_ids,
                with_rpc_id=method == "execute_scheduler_output",
                per_rank=per_rank,
                reply_ranks=(
                    None if size == 1 else {rank: rank - rank % size for rank in per_rank}
                ),
            )
        except (trio.Cancelled, EngineClosedError, PayloadError):
            router.redeliver(shares)
            self._lost_ids.update(lost_rows)  # still to be reported, with the next call
            raise
        except Exception as exc:
            self._fail_group(exc)
            raise EngineDeadError(f"worker group failed: {exc}") from exc
        merged: dict[str, RunnerOutput] = {}
        for group in sorted(shares):
            rank = group * size  # the group's output rank
            share, state = shares[group], at_call[rank]
            reply = replies.get(rank)
            if reply is None or state.lost:  # the group was lost while it ran its share
                if reply is not None:
                    self._on_discard(reply.result)
                reason = self._lost_reason(group)
                for rid in share.scheduled_request_ids:
                    lost_rows[rid] = reason
                    self._lost_ids.pop(rid, None)  # reported now, once
                continue
            result = reply.result
            expected = set(share.scheduled_request_ids)
            if not isinstance(result, BatchRunnerOutput) or set(result.request_ids) - expected:
                what = type(result).__name__
                if isinstance(result, BatchRunnerOutput):
                    what = f"outputs for {sorted(set(result.request_ids) - expected)}"
                error = WorkerError(f"{method!r} returned {what}", worker=rank)
                self._fail_group(error)
                raise EngineDeadError(str(error)) from error
            if reply.kind is AsyncOutputKind.COMPUTE_DONE:
                register_async_outputs(state.pump, result)
            for output in result:
                if output.async_output_id:
                    self._output_ranks[output.async_output_id] = state
                merged[output.request_id] = output
        return self._with_lost(merged, lost_rows)

    def _lost_reason(self, group: int) -> str:
        error = self._down.get(group)
        return f"{type(error).__name__}: {error}" if error is not None else "its worker died"

    @staticmethod
    def _with_lost(merged: dict[str, RunnerOutput], lost: Mapping[str, str]) -> BatchRunnerOutput:
        if not lost:
            return BatchRunnerOutput(merged)
        reasons = "; ".join(dict.fromkeys(lost.values()))
        return BatchRunnerOutput(merged, lost=frozenset(lost), lost_error=reasons)

    async def execute_batch(self, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
        return await self._execute("execute_scheduler_output", scheduler_output)

    async def execute_step(self, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
        return await self._execute("execute_stepwise", scheduler_output)

    async def collective_rpc(
        self,
        method: str,
        *args: Any,
        timeout: float | None = None,
        unique_reply_rank: int | None = 0,
        **kwargs: Any,
    ) -> Any:
        replies = await self._call(
            method, args, kwargs, reply_rank=unique_reply_rank, timeout=timeout
        )
        if unique_reply_rank is None:
            return [replies[rank].result for rank in sorted(replies)]
        return replies[unique_reply_rank].result

    # -- async outputs: each from the pump of the rank that announced it ----------------

    def _pump_of(self, async_output_id: str) -> ResultPump:
        # (A rank since written off answers with its failure: the output is lost.)
        state = self._output_ranks.get(async_output_id)
        return (state or self._ranks[0]).pump

    async def wait_output(self, async_output_id: str) -> RunnerOutput:
        try:
            output: RunnerOutput = await self._pump_of(async_output_id).wait_output(async_output_id)
        finally:
            self._output_ranks.pop(async_output_id, None)
        return output

    def claim_output(self, async_output_id: str, callback: OutputCallback) -> None:
        if async_output_id not in self._output_ranks:
            self._pump_of(async_output_id).claim(async_output_id, callback)
            return

        def resolved(output: Any, error: BaseException | None) -> None:
            self._output_ranks.pop(async_output_id, None)  # (a later drop finds nothing)
            callback(output, error)

        # The entry stays until the claim resolves or is dropped: a drop must reach the
        # pump that holds the claim.
        self._pump_of(async_output_id).claim(async_output_id, resolved)

    def drop_output(self, async_output_id: str) -> None:
        pump = self._pump_of(async_output_id)
        self._output_ranks.pop(async_output_id, None)
        pump.drop(async_output_id)

    def abort_requests(self, request_ids: Sequence[str] | Any) -> None:
        ids = tuple(request_ids)
        if not ids or self._closed:
            return
        if self._dp is None:
            for rank in self._ranks:
                self.transport.send(rank, WorkerAbort(ids))
            return
        # Data parallel: only the rank holding a request (given it, running it) hears of
        # its abort, so no other rank keeps a stop flag for a request it will never run.
        by_rank: dict[int, list[str]] = {}
        for rid in ids:
            holder = self._dp.holder(rid)
            if holder is not None:
                by_rank.setdefault(holder, []).append(rid)
        size = self._group_size
        for holder, owned in by_rank.items():  # every rank of the holding group
            for rank in range(holder * size, holder * size + size):
                self.transport.send(rank, WorkerAbort(tuple(owned)))

    # -- introspection ------------------------------------------------------------------

    def progress(self, request_id: str) -> tuple[int, int] | None:
        if self._dp is None:
            state = self._ranks.get(0)
            return state.progress.get(request_id) if state is not None else None
        for state in self._ranks.values():  # data parallel: whichever rank runs it
            if state.lost:
                continue
            found = state.progress.get(request_id)
            if found is not None:
                return found
        return None

    def holder_of(self, request_id: str) -> int | None:
        """Data parallel: the replica group (its index) holding a live request (given it,
        running it); None if none holds it or without data parallel."""
        return self._dp.holder(request_id) if self._dp is not None else None

    def leftovers(self) -> dict[str, set[str]]:
        held: dict[str, set[str]] = {}
        for state in self._ranks.values():
            for kind, ids in state.pump.leftovers().items():
                held.setdefault(kind, set()).update(ids)
        return held

    async def wait_settled(self) -> None:
        states = list(self._ranks.values())
        while True:  # one pump may get work again while another is awaited
            for state in states:
                await state.pump.wait_settled()
            if all(state.pump.is_settled() for state in states):
                return

    def worker_states(self) -> list[WorkerState]:
        out = []
        for entry in super().worker_states():
            state = self._ranks.get(entry.rank)
            if state is None:
                out.append(entry)
                continue
            status = entry.state
            if status is WorkerStatus.RUNNING and entry.rank // self._group_size in self._down:
                status = WorkerStatus.RESTARTING  # its data-parallel group restarts
            elif state.exited and status is WorkerStatus.RUNNING:
                status = WorkerStatus.FAILED
            steps = self._tracker.steps_of(entry.rank)
            out.append(WorkerState(entry.rank, status, pid=state.pid, steps=steps))
        return out

    def worker_pids(self) -> dict[int, int]:
        """rank -> pid of every worker process (where the backend knows it; a rank being
        restarted has none until its new process reports)."""
        return {r: pid for r, s in self._ranks.items() if (pid := s.pid) is not None and not s.lost}

    def worker_exit_codes(self) -> dict[int, int | None]:
        """rank -> exit status of each worker process once it exited (0: it stopped when
        asked; negative: killed by that signal), None while it runs or if unknown."""
        return {rank: state.exit_code for rank, state in self._ranks.items()}

    def worker_steps(self) -> dict[int, int]:
        """rank -> denoising steps that worker has run, as of its latest message."""
        steps = {rank: self._tracker.steps_of(rank) for rank in self._ranks}
        return {rank: n for rank, n in steps.items() if n is not None}

    def worker_nodes(self) -> dict[int, str]:
        """rank -> the host each worker runs on (where the backend knows it)."""
        nodes = {r: s.started.node for r, s in self._ranks.items() if s.started is not None}
        return {r: node for r, node in nodes.items() if node is not None}


class RankLostError(EngineDeadError):
    """A data-parallel rank group was written off (it restarts while the others serve):
    what was pending on its ranks is lost, and runs again."""


def _sole_cancelled(exc: BaseException) -> trio.Cancelled | None:
    """``exc`` if it is trio's Cancelled, the first one if ``exc`` is a group of nothing
    but Cancelled (nested groups included), else None."""
    if isinstance(exc, trio.Cancelled):
        return exc
    if not isinstance(exc, BaseExceptionGroup):
        return None
    found = [_sole_cancelled(member) for member in exc.exceptions]
    return found[0] if found and all(f is not None for f in found) else None


def _rank_failures(method: str, failed: Sequence[WorkerError]) -> WorkerError:
    """One error naming every rank whose reply to ``method`` failed, with the first failed
    rank's type and every traceback."""
    first = failed[0]
    detail = "; ".join(f"rank {e.worker}: {e.error_type}: {_message(e)}" for e in failed)
    return WorkerError(
        f"{method!r} failed on {len(failed)} rank(s): {detail}",
        worker=first.worker,
        error_type=first.error_type,
        traceback_text="\n".join(e.traceback_text or "" for e in failed),
        fatal=any(e.fatal for e in failed),
    )


def _message(error: WorkerError) -> str:
    """The remote message of a boxed error (without the "worker N: Type: " prefix)."""
    text = str(error)
    prefix = f"worker {error.worker}: {error.error_type}: "
    return text[len(prefix) :] if text.startswith(prefix) else text
