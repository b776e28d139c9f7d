"""``EnginePool``: K independent engine replicas behind a least-loaded router.

Each replica is one :func:`~omni_trio.runtime.engine.open_engine` (with its own worker group
and its own worker-group supervisor), run as a child of a ``one_for_one``
:class:`~omni_trio.supervisor.Supervisor`: when a replica's engine dies (its worker group
failed past the engine's own restart limit) only that replica is closed and reopened; the
other replicas and their requests are never disturbed.  Past the *pool* supervisor's restart
limit :meth:`EnginePool.serve` raises :class:`~omni_trio.errors.RestartLimitError` (the daemon
then exits non-zero so the OS supervisor restarts the process).

Admission is synchronous (:meth:`EnginePool.submit` never checkpoints) and the pool keeps an
index ``engine request id -> stream`` of every request in flight, so request ids are unique
across replicas and ``DELETE /v1/requests/{id}`` can find the replica to abort on.  The ids of
the last :data:`FINISHED_IDS_KEPT` requests that ended are remembered (an LRU) so that a
cancel of an id that already finished is told apart from an unknown id.

Ownership: every request has an ``owner`` (an opaque tag of the API key or client token that
made it; ``""`` for anonymous) and a *public* id (the client's ``X-Request-Id`` or a generated
one).  Public ids are scoped per owner: the engine runs the request under
:func:`engine_request_id` ``(public id, owner)`` -- the public id itself for the anonymous
owner, ``"{public id}@{owner}"`` otherwise -- so two owners may use the same public id, and
every lookup (:meth:`~EnginePool.abort`, :meth:`~EnginePool.progress`,
:meth:`~EnginePool.status`) by another owner finds nothing, as if the id did not exist.

Restarts queue, within a bound: while no replica is ready, a request is admitted on one whose
worker group is restarting and waits in that engine's queue.  It waits at most
``restart_wait_s`` (default :data:`DEFAULT_RESTART_WAIT_S`) for its replica to become ready;
past it the pool aborts it with :data:`RESTART_WAIT_REASON` (HTTP 503 ``aborted`` +
``Retry-After``), unless its own timeout is shorter (then that ends it, 504).

Nothing waits for a restart while another replica is ready: a request whose replica's engine
died, or which is queued on a replica whose worker group is restarting (it ran in the failed
forward, or waited behind it), moves to the least-loaded ready replica (same engine id, same
seed) as long as no chunk of it reached its consumer (:meth:`EnginePool.move_off_restarting`,
checked every :data:`RESTART_POLL_S` while requests are in flight).  A request moves off a
restarting replica at most once: one that brings worker groups down cannot take every replica
down in turn.

Small errors of the pool (all :class:`~omni_trio.errors.OmniTrioError`)::

    QueueFullError    in-flight requests reached max_queue_len (HTTP 429); its
                      PassedTooLongError: under priority, better-priority arrivals would
                      hold the request longer than a full queue in arrival order would
    QueueWaitError    the estimated queue wait already exceeds the request's deadline, or
                      max_queue_wait_s (HTTP 503)
    DrainingError     the pool stopped admitting (shutdown drain) (HTTP 503)
    NotReadyError     no replica is open and healthy right now (HTTP 503)

Where a replica's engine runs (``stage``): ``"inline"`` in this process, or ``"process"``, each
replica's whole engine in a stage process of its own (:mod:`omni_trio.runtime.stage`): a
replica's crash, even in native code, never touches the others or the HTTP loop, and no forward
shares this process's GIL.  The default (None) is inline, except for ``replicas > 1`` on the
``tractor`` backend: tractor 0.1.0a5 allows one tractor runtime (hence one tractor engine) per
process, so those replicas run as stage processes (an explicit ``stage="inline"`` is refused
with :class:`~omni_trio.errors.InvalidConfigError`).  A stage replica records no trace.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import secrets
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Any, cast

import trio
from trio_typing import TaskStatus

from .._core.health import EngineState
from .._core.keys import request_batch_key, step_batch_key
from .._core.lifecycle import RequestStatus
from .._core.messages import DiffusionOutput
from .._core.model_info import ModelInfo
from .._core.request import DiffusionRequest, SamplingParams
from .._core.trace import TraceRecorder
from ..config import EngineConfig
from ..errors import (
    TIMEOUT_ERROR_TYPE,
    DuplicateRequestError,
    EngineClosedError,
    EngineDeadError,
    InvalidConfigError,
    OmniTrioError,
)
from ..executors.base import resolve_executor_class
from ..runtime.engine import AsyncEngine, open_engine
from ..runtime.request_stream import RequestStream
from ..runtime.stage import STAGES, StageEngine
from ..supervisor import ChildSpec, ChildState, RestartPolicy, Strategy, Supervisor, SupervisorEvent

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_RESTART_WAIT_S",
    "FINISHED_IDS_KEPT",
    "MOVE_REASONS",
    "RESTART_WAIT_REASON",
    "DrainingError",
    "EnginePool",
    "NotReadyError",
    "PooledStream",
    "PassedTooLongError",
    "QueueFullError",
    "Submission",
    "engine_request_id",
    "new_request_id",
]

# A replica's engine: in this process, or in a stage process of its own.
AnyEngine = AsyncEngine | StageEngine

FINISHED_IDS_KEPT = 10_000
# The service rate is measured over the last completions: at most this many, this recent.
RATE_WINDOW = 64
RATE_WINDOW_S = 60.0
# Retry-After (seconds) without a measured rate, and its bounds with one.
DEFAULT_RETRY_AFTER_S = 2
MAX_RETRY_AFTER_S = 60
# The most of the service rate the wait estimate lets later arrivals that pass a waiting
# request take (priority: better ones; fair: other classes), so it stays finite.
MAX_PASSING_SHARE = 0.9
# The time to open a replica is the median of this many last opens.
OPEN_WINDOW = 8
# The admission estimate is scaled by how far the finishes it estimated fell short of the
# measured ones: this quantile of their ratios, over this many last requests (none until
# this many were measured), at most this factor.
ESTIMATE_QUANTILE = 0.9
ESTIMATE_WINDOW = 64
ESTIMATE_MIN_SAMPLES = 8
MAX_ESTIMATE_FACTOR = 4.0
# Requests without a deadline are estimated too (to measure the estimate) while at most this
# many are in flight (an estimate is O(in flight)).
ESTIMATE_MAX_IN_FLIGHT = 256
# The longest a request admitted during a worker restart waits for its replica to be ready.
DEFAULT_RESTART_WAIT_S = 60.0
# The abort reason of a request whose restart wait ran out (PooledStream.abort_reason, the
# omni_trio_aborts_total label, the 503's message).
RESTART_WAIT_REASON = "no replica became ready within restart_wait_s"
# How often a replica that requests wait for is checked for being ready again (its engine
# has no event for it); the wait's own end is exact.
RESTART_POLL_S = 0.1
# Why a request moved to another replica (EnginePool.moved, omni_trio_requests_moved_total).
MOVE_REASONS = ("replica_died", "workers_restarting")


class QueueFullError(OmniTrioError):
    """The pool already holds ``max_queue_len`` requests in flight; try again later."""

    def __init__(self, in_flight: int, max_queue_len: int) -> None:
        super().__init__(
            f"the server is at capacity ({in_flight} requests in flight, "
            f"max_queue_len={max_queue_len}); retry later"
        )
        self.in_flight = in_flight
        self.max_queue_len = max_queue_len
        self.retry_after_s: int | None = None  # None: the pool's retry_after_s()


class PassedTooLongError(QueueFullError):
    """Under ``scheduling_policy="priority"``: the requests of a better priority arriving at
    the measured rate would hold this one past both what a full queue takes in arrival
    order (``max_queue_len - 1`` requests of the recent mean work ahead of it) and what it
    would take without them: the queue is full for its priority (HTTP 429, ``Retry-After``
    the excess)."""

    def __init__(
        self, estimate_s: float, limit_s: float, in_flight: int, max_queue_len: int
    ) -> None:
        OmniTrioError.__init__(
            self,
            f"the server is at capacity for this priority: requests of a better priority "
            f"would pass this one until an estimated {estimate_s:.1f} s, past the "
            f"{limit_s:.1f} s a full queue takes (max_queue_len={max_queue_len}); retry "
            "later or with a better priority",
        )
        self.in_flight = in_flight
        self.max_queue_len = max_queue_len
        self.estimate_s = estimate_s
        self.limit_s = limit_s
        self.retry_after_s = clamp_retry_after(estimate_s - limit_s)


def _window_span(events: deque[Any], now: float, window_s: float) -> float | None:
    """Drop the ``(time, ...)`` events older than ``window_s``; the time since the first
    one left, or None with fewer than two left (a rate then measures nothing)."""
    while events and now - events[0][0] > window_s:
        events.popleft()
    if len(events) < 2:
        return None
    span = now - events[0][0]
    return span if span > 0 else None


def flat_weight(pixels: int) -> float:
    """The weight of a denoising step before any step time is measured: 1 at every size."""
    return 1.0


class ServiceRate:
    """Requests completed per second, and work completed per second, measured over the last
    ``window`` completions of the last ``window_s`` seconds.  A request's work is its
    denoising steps x images, each step weighted by its size's ``weight(pixels)`` (given
    when the rate is asked: the seconds one step of one image takes at that size, as last
    measured, so completions measured before and after a new weight stay comparable).
    Pure: the caller passes the time."""

    def __init__(self, window: int = RATE_WINDOW, window_s: float = RATE_WINDOW_S) -> None:
        self._done: deque[tuple[float, float, int]] = deque(maxlen=window)
        self._window_s = window_s

    def record(self, now: float, work: float = 1.0, pixels: int = 1) -> None:
        """One request of ``work`` (steps x images) of ``pixels`` per image completed at
        ``now``."""
        self._done.append((now, work, pixels))

    def _span(self, now: float) -> float | None:
        return _window_span(self._done, now, self._window_s)

    def rate(self, now: float) -> float | None:
        """Completions per second (None: fewer than two in the window).  The time since
        the last completion counts, so a rate measured before a stall decays instead of
        staying optimistic."""
        span = self._span(now)
        return None if span is None else (len(self._done) - 1) / span

    def work_rate(self, now: float, weight: Callable[[int], float] = flat_weight) -> float | None:
        """Work completed per second, each step weighted by ``weight(pixels)``, measured the
        same way (the completions after the first in the window over the time since it);
        None as :meth:`rate`."""
        span = self._span(now)
        if span is None:
            return None
        later = itertools.islice(self._done, 1, None)
        return sum(work * weight(px) for _, work, px in later) / span


def request_work(params: SamplingParams) -> float:
    """A request's work for the pool's estimates: denoising steps x images (its run time
    grows with both; with the size too, but the rate is measured on this pool's own mix).
    One for parameters the engine's validation will refuse (it reports them, not this)."""
    try:
        work = float(params.total_steps * params.num_outputs_per_prompt)
    except Exception:
        return 1.0
    return work if work > 0 else 1.0


class ArrivalLog:
    """The requests admitted recently (time, priority, compatibility class), over the last
    ``window`` admissions of the last ``window_s`` seconds: how often requests arrive that
    a given policy would run before an earlier one.  Pure: the caller passes the time."""

    def __init__(self, window: int = 4 * RATE_WINDOW, window_s: float = RATE_WINDOW_S) -> None:
        self._arrivals: deque[tuple[float, int, Hashable, float, int]] = deque(maxlen=window)
        self._window_s = window_s

    def record(
        self, now: float, priority: int, klass: Hashable, work: float = 1.0, pixels: int = 1
    ) -> None:
        """A request of ``priority``, class ``klass``, ``work`` (steps x images) and
        ``pixels`` per image was admitted at ``now``."""
        self._arrivals.append((now, priority, klass, work, pixels))

    def rate(
        self,
        now: float,
        counts: Callable[[int, Hashable], bool],
        weight: Callable[[int], float] = flat_weight,
    ) -> float:
        """Work admitted per second (weighted as :meth:`ServiceRate.work_rate` weighs it) in
        the requests for which ``counts(priority, klass)`` holds (0.0 with fewer than two in
        the window), measured as :class:`ServiceRate` measures completions: the ones after
        the first in the window over the time since it.  The time since the last one
        counts, so a burst that ended decays."""
        span = _window_span(self._arrivals, now, self._window_s)
        if span is None:
            return 0.0
        later = itertools.islice(self._arrivals, 1, None)
        return sum(work * weight(px) for _, p, klass, work, px in later if counts(p, klass)) / span

    def mean_work(self, now: float, weight: Callable[[int], float] = flat_weight) -> float | None:
        """The mean work (weighted as :meth:`rate` weighs it) of the requests admitted in
        the last ``window_s`` seconds (None: none)."""
        since = now - self._window_s
        recent = [work * weight(px) for t, _, _, work, px in self._arrivals if t >= since]
        return sum(recent) / len(recent) if recent else None


class EstimateError:
    """How far the pool's estimated finishes fall short of the measured ones: the ratios
    measured / estimated of the last ``window`` requests (a completion; also a timeout, as a
    lower bound: its finish was at least that).  :meth:`factor` is their ``quantile`` (at
    least 1: the estimate is never made more optimistic, at most ``max_factor``; 1 until
    ``min_samples`` were measured).  Pure: the caller passes the times."""

    def __init__(
        self,
        window: int = ESTIMATE_WINDOW,
        quantile: float = ESTIMATE_QUANTILE,
        min_samples: int = ESTIMATE_MIN_SAMPLES,
        max_factor: float = MAX_ESTIMATE_FACTOR,
    ) -> None:
        self._ratios: deque[float] = deque(maxlen=window)
        self._quantile = quantile
        self._min_samples = min_samples
        self._max_factor = max_factor

    def record(self, estimated_s: float, measured_s: float) -> None:
        """A request estimated to finish in ``estimated_s`` took ``measured_s``."""
        if estimated_s > 0 and math.isfinite(estimated_s) and measured_s >= 0:
            self._ratios.append(measured_s / estimated_s)

    @property
    def measured(self) -> bool:
        """Enough were measured for :meth:`factor` to be more than its default."""
        return len(self._ratios) >= self._min_samples

    def factor(self) -> float:
        """What estimates are scaled by (see the class doc)."""
        if not self.measured:
            return 1.0
        ordered = sorted(self._ratios)
        value = ordered[min(len(ordered) - 1, int(self._quantile * len(ordered)))]
        return min(self._max_factor, max(1.0, value))


class OpenTime:
    """How long opening a replica takes (its engine's workers started, the model loaded and
    warmed up), measured over the last ``window`` opens.  Pure: the caller passes the times."""

    def __init__(self, window: int = OPEN_WINDOW) -> None:
        self._durations: deque[float] = deque(maxlen=window)

    def record(self, duration_s: float) -> None:
        """One replica opened in ``duration_s``."""
        self._durations.append(max(0.0, duration_s))

    def expected_s(self) -> float | None:
        """The median of the opens measured (None: none yet)."""
        if not self._durations:
            return None
        ordered = sorted(self._durations)
        middle = len(ordered) // 2
        if len(ordered) % 2:
            return ordered[middle]
        return (ordered[middle - 1] + ordered[middle]) / 2


def clamp_retry_after(seconds: float) -> int:
    """``Retry-After`` seconds: ``seconds`` rounded up, at least 1, at most
    :data:`MAX_RETRY_AFTER_S`."""
    if not math.isfinite(seconds):
        return MAX_RETRY_AFTER_S
    return int(min(MAX_RETRY_AFTER_S, max(1, math.ceil(seconds))))


class QueueWaitError(OmniTrioError):
    """A request would wait longer in the queue than it may (its ``deadline_s``, or the
    pool's ``max_queue_wait_s``): refused now rather than timed out later."""

    def __init__(
        self, estimate_s: float, limit_s: float, what: str, measure: str = "queue wait"
    ) -> None:
        super().__init__(
            f"the estimated {measure} ({estimate_s:.1f} s, from the measured service rate) "
            f"exceeds {what} ({limit_s:g} s); retry later"
        )
        self.estimate_s = estimate_s
        self.limit_s = limit_s
        self.what = what


class DrainingError(OmniTrioError):
    """The pool stopped admitting new requests (it is draining before shutdown)."""


class NotReadyError(OmniTrioError):
    """No replica is open and healthy (starting, restarting, or the pool is not serving)."""


def new_request_id() -> str:
    """A fresh request id: 128 random bits, so nobody can guess another client's id (to
    cancel or query its request) or claim the next one."""
    return f"req-{secrets.token_hex(16)}"


def engine_request_id(public_id: str, owner: str = "") -> str:
    """The id the engine runs ``owner``'s request ``public_id`` under: unique across owners
    (client ids never hold ``@``), and the public id itself for the anonymous owner."""
    return f"{public_id}@{owner}" if owner else public_id


class PooledStream:
    """One request's output stream as the pool hands it out: the replica's
    :class:`~omni_trio.runtime.request_stream.RequestStream` plus the pool's bookkeeping.

    Use it as ``async with stream: async for output in stream: ...``.  Its in-flight slot is
    released when the terminal output has been read or the stream is left (``async with``
    exit, :meth:`aclose`); leaving early aborts the request, as with ``RequestStream``.
    ``abort_reason`` is set by the pool when it aborted the request on purpose
    (``"cancelled"`` for :meth:`EnginePool.abort`, the reason given to
    :meth:`EnginePool.abort_all`), so the consumer can tell why it ended.
    """

    def __init__(
        self,
        inner: RequestStream,
        replica: int,
        on_done: Callable[[PooledStream], None],
        *,
        public_id: str | None = None,
        owner: str = "",
        move: Callable[[PooledStream], RequestStream | None] | None = None,
        priority: int = 0,
        klass: Hashable = None,
        work: float = 1.0,
        pixels: int = 1,
    ) -> None:
        self._inner = inner
        # Its SamplingParams.priority, compatibility class, work (denoising steps x images)
        # and pixels per image: the pool's wait estimate.
        self.priority = priority
        self.klass = klass
        self.work = work
        self.pixels = pixels
        # When the pool admitted it (trio time): a move keeps what is left of its deadline.
        self.admitted_at = trio.current_time()
        self._move = move
        self._started = False  # a chunk reached the consumer: it can no longer move
        self.moves = 0  # times it moved to another replica after its own died or restarted
        # Streams it moved away from while they were still open: closed by the consumer's
        # next read (a read in progress on one of them sees it was left, and reads on).
        self._left: list[RequestStream] = []
        self.replica = replica
        self.owner = owner
        self.public_id = inner.request_id if public_id is None else public_id
        self.abort_reason: str | None = None
        self.completed = False  # its terminal output was a success (the service rate counts it)
        self.timed_out = False  # it ended past its own deadline (RequestTimeoutError)
        # The pool's estimate of its finish at admission (seconds; None: none was made).
        self.estimate_s: float | None = None
        self._on_done: Callable[[PooledStream], None] | None = on_done

    @property
    def request_id(self) -> str:
        """The public id (what the client sees)."""
        return self.public_id

    @property
    def engine_request_id(self) -> str:
        return self._inner.request_id

    @property
    def seed(self) -> int | None:
        return self._inner.seed

    def _release(self) -> None:
        on_done, self._on_done = self._on_done, None
        if on_done is not None:
            on_done(self)

    def __aiter__(self) -> PooledStream:
        return self

    async def __anext__(self) -> DiffusionOutput:
        """The next chunk; if cancelled, the request is aborted and its slot released.  A
        request whose replica's engine died, or whose replica's worker group failed while
        it waited or ran there, before any chunk reached the consumer moves to another
        ready replica (same id, same seed) when the pool has one (see
        :meth:`EnginePool.submit`), instead of ending with the dead engine's error or
        waiting for the restart."""
        while True:
            self._close_left()
            inner = self._inner
            try:
                output = await inner.__anext__()
            except EngineDeadError:
                if self._inner is not inner:
                    continue  # it moved while this read waited: read the new stream
                # Refused by an engine that had died (a stage process's, seen late).
                moved = self._move_after_death()
                if moved is None:
                    self._release()
                    raise
                self._inner = moved
                continue
            except BaseException as exc:
                if self._inner is not inner:  # it moved while this read waited
                    if isinstance(exc, Exception):
                        continue  # the stream it moved from ended or failed: not its own
                    self._inner.close()  # cancelled: the request it moved to is left too
                self._release()
                raise
            if self._inner is not inner:
                continue  # the stream it moved from (its abort, a late chunk): not its own
            if output.finished and output.error_type == "EngineDeadError" and not self._started:
                moved = self._move_after_death()
                if moved is not None:
                    self._inner = moved
                    continue
            self._started = True
            if output.finished:
                self.completed = output.ok
                self.timed_out = output.error_type == TIMEOUT_ERROR_TYPE
                self._release()
            return output

    def _move_after_death(self) -> RequestStream | None:
        """The request's engine died before any chunk reached the consumer: the stream of
        the same request admitted on another replica, or None."""
        if self._started or self.abort_reason is not None or self._move is None:
            return None
        moved = self._move(self)
        if moved is not None:
            self.moves += 1
        return moved

    def move_off(self, abort: Callable[[str], None]) -> bool:
        """Move the request, still queued on a replica whose worker group is restarting,
        to another ready replica now (no checkpoint): admit it there (same id, same seed),
        read from there, then ``abort(engine request id)`` on the old engine.  Not once a
        chunk reached the consumer, after an abort, or after a move already (a request
        that brings a group down moves once: it cannot take every replica down in turn).
        Whether it moved."""
        if self._started or self.abort_reason is not None or self._move is None or self.moves:
            return False
        old = self._inner
        moved = self._move(self)
        if moved is None:
            return False
        self.moves += 1
        self._inner = moved
        self._left.append(old)
        abort(old.request_id)
        return True

    def _close_left(self) -> None:
        left, self._left = self._left, []
        for stream in left:
            stream.close()

    async def aclose(self) -> None:
        """Stop consuming: aborts the request if it has not ended; releases its slot."""
        try:
            self._close_left()
            await self._inner.aclose()
        finally:
            self._release()

    async def __aenter__(self) -> PooledStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


@dataclass(frozen=True, slots=True)
class Submission:
    """What :meth:`EnginePool.submit` returns: the request's public id, the replica it runs
    on, its output stream and the seed it runs with (chosen at admission when the caller gave
    none)."""

    request_id: str
    replica: int
    stream: PooledStream
    seed: int | None


@dataclass(eq=False)
class _Replica:
    """One replica slot.  ``engine`` is set only while its engine is open; ``in_flight``
    counts the pool's streams routed to it and not yet released (the router's load)."""

    index: int
    engine: AnyEngine | None = None
    in_flight: int = 0
    # Worker-group restarts of the engines this replica already closed (the current engine
    # counts its own); their sum is monotonic, for a Prometheus counter.
    past_worker_restarts: int = 0
    last_failure: str | None = None
    # When its engine began opening (trio time), while it opens; None once open.
    opening_since: float | None = None
    # When the pool first saw its worker group restarting (trio time); None otherwise.
    restarting_since: float | None = None


class _StartedAs:
    """Forwards ``started()`` to ``inner`` with a fixed value (the pool, not its supervisor)."""

    def __init__(self, inner: TaskStatus[Any], value: Any) -> None:
        self._inner = inner
        self._value = value

    def started(self, value: Any = None) -> None:
        self._inner.started(self._value)


async def _each(
    engines: list[tuple[int, AnyEngine]], call: Callable[[AnyEngine], Awaitable[Any]]
) -> tuple[dict[int, Any], list[Exception]]:
    """``call`` every engine at once: the results by replica index, and the errors."""
    results: dict[int, Any] = {}
    errors: list[Exception] = []

    async def one(index: int, engine: AnyEngine) -> None:
        try:
            results[index] = await call(engine)
        except Exception as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        for index, engine in engines:
            nursery.start_soon(one, index, engine)
    return results, errors


def _refuses_replicas(backend: Any) -> bool:
    """The backend's executor allows one per process (an unresolvable one is the engine's
    to report)."""
    try:
        return resolve_executor_class(backend).one_per_process
    except InvalidConfigError:
        return False


def resolve_stage(stage: str | None, replicas: int, backend: Any) -> str:
    """Where the replicas' engines run: ``stage`` when given, else ``"process"`` for
    several replicas of a one-per-process backend (tractor) and ``"inline"`` otherwise.
    Raises :class:`InvalidConfigError` for an unknown stage, or ``"inline"`` replicas a
    backend cannot have in one process."""
    if stage is not None and stage not in STAGES:
        raise InvalidConfigError(
            f"stage must be one of {', '.join(STAGES)}, got {stage!r}", field="stage"
        )
    one_per_process = replicas > 1 and _refuses_replicas(backend)
    if stage is None:
        return "process" if one_per_process else "inline"
    if stage == "inline" and one_per_process:
        raise InvalidConfigError(
            "replicas > 1 on the tractor backend need stage processes: tractor allows only "
            "one tractor engine per process; leave stage unset or use stage='process'",
            field="replicas",
        )
    return stage


class EnginePool:
    """K independent engine replicas behind a least-loaded router; each replica is a child of
    a ``one_for_one`` :class:`~omni_trio.supervisor.Supervisor` (a dead replica is reopened;
    the others are never disturbed).

    ``max_queue_len`` bounds the requests in flight across the pool (queued and running).
    ``restart_policy`` rate-limits replica restarts (default ``RestartPolicy()``: 5 restarts
    in 60 s).  ``restart_wait_s`` bounds how long a request admitted while every replica is
    restarting waits for its replica to be ready (None: only its own timeout bounds it).
    ``trace_factory(index)``, if given, makes the trace recorder for each new engine of
    replica ``index``.  Everything but :meth:`serve` and :meth:`wait_idle` is
    synchronous and never checkpoints; all of it runs on the trio thread that serves.
    """

    def __init__(
        self,
        engine_config: EngineConfig,
        *,
        replicas: int = 1,
        max_queue_len: int = 64,
        max_queue_wait_s: float | None = None,
        restart_wait_s: float | None = DEFAULT_RESTART_WAIT_S,
        restart_policy: RestartPolicy | None = None,
        trace_factory: Callable[[int], TraceRecorder | None] | None = None,
        stage: str | None = None,
    ) -> None:
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise InvalidConfigError(
                f"replicas must be a positive integer, got {replicas!r}", field="replicas"
            )
        if isinstance(max_queue_len, bool) or not isinstance(max_queue_len, int):
            raise InvalidConfigError(
                f"max_queue_len must be a positive integer, got {max_queue_len!r}",
                field="max_queue_len",
            )
        if max_queue_len < 1:
            raise InvalidConfigError(
                f"max_queue_len must be a positive integer, got {max_queue_len!r}",
                field="max_queue_len",
            )
        self.stage = resolve_stage(stage, replicas, engine_config.backend)
        if max_queue_wait_s is not None and (
            isinstance(max_queue_wait_s, bool)
            or not isinstance(max_queue_wait_s, int | float)
            or not 0 < max_queue_wait_s < float("inf")
        ):
            raise InvalidConfigError(
                f"max_queue_wait_s must be a number of seconds > 0 or None, "
                f"got {max_queue_wait_s!r}",
                field="max_queue_wait_s",
            )
        if restart_wait_s is not None and (
            isinstance(restart_wait_s, bool)
            or not isinstance(restart_wait_s, int | float)
            or not 0 < restart_wait_s < float("inf")
        ):
            raise InvalidConfigError(
                f"restart_wait_s must be a number of seconds > 0 or None, got {restart_wait_s!r}",
                field="restart_wait_s",
            )
        self.engine_config = engine_config
        self.replicas = replicas
        self.restart_wait_s = restart_wait_s
        self.max_queue_len = max_queue_len
        self.max_queue_wait_s = max_queue_wait_s
        self._service = ServiceRate()
        self._arrivals = ArrivalLog()
        self._estimate_error = EstimateError()
        # Under "priority": each priority's own (a worse one is passed more than estimated).
        self._priority_errors: dict[int, EstimateError] = {}
        # The weight of one denoising step of one image by its pixels (step_weight()),
        # refreshed at each estimate.
        self._weight: Callable[[int], float] = flat_weight
        self._open_time = OpenTime()
        # How long a replica's worker group takes to restart (failure seen -> ready again).
        self._group_restart_time = OpenTime()
        self.restart_policy = restart_policy or RestartPolicy()
        self._trace_factory = trace_factory
        self._replicas = [_Replica(i) for i in range(replicas)]
        # Invariant: an id is in _active exactly while its PooledStream is unreleased.
        self._active: dict[str, PooledStream] = {}
        # (owner, public id) of the last requests that ended.
        self._finished: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._draining = False
        self._serving = False
        self._stopped = False
        self._dead: BaseException | None = None
        self._supervisor: Supervisor | None = None
        self._idle = trio.Event()
        self._idle.set()
        # Engine id -> (when its wait ends, its stream) of every request admitted on a
        # restarting replica whose replica has not been ready since.  Invariant: each is
        # also in _active (released streams leave both).
        self._restart_waits: dict[str, tuple[float, PooledStream]] = {}
        self._restart_wake = trio.Event()  # set when a wait is added
        self._busy = trio.Event()  # set when a request is admitted (the move check wakes)
        # Requests moved to another replica, by why: "replica_died", "workers_restarting".
        self.moved: dict[str, int] = dict.fromkeys(MOVE_REASONS, 0)
        # The level the operator put the pool to sleep at (0: awake); a replica opened
        # meanwhile (a reopen after its engine died) is put to sleep too.
        self.sleep_level = 0
        self._sleep_lock = trio.Lock()

    # -- running ---------------------------------------------------------------------------

    async def serve(
        self, *, task_status: TaskStatus[EnginePool] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Open every replica (warmup included; in order, or all at once when each runs in
        a stage process of its own), report ``started(self)`` once all are ready, then
        supervise them until cancelled.

        A replica that fails its first start raises its error here (a configuration error;
        the replicas already open are closed).  Past the restart limit raises
        :class:`RestartLimitError` after closing every replica; requests in flight end with
        a terminal error.  Cancelling closes every engine (each close is bounded and
        shielded).  Runs once.
        """
        if self._supervisor is not None:
            raise RuntimeError("EnginePool.serve runs once")
        self._supervisor = Supervisor(
            [
                ChildSpec(f"replica-{r.index}", partial(self._serve_replica, r))
                for r in self._replicas
            ],
            strategy=Strategy.ONE_FOR_ONE,
            policy=self.restart_policy,
            name="engine-pool",
            on_event=self._on_event,
            # Stage processes import and load on their own cores: opened at once, the pool
            # is ready in the time of one (in order, of all of them).
            concurrent_start=self.stage == "process",
        )
        relay = cast(TaskStatus[Any], _StartedAs(task_status, self))
        self._serving = True
        error: Exception | None = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._serve_restart_waits)
                if len(self._replicas) > 1:
                    nursery.start_soon(self._serve_moves)
                try:
                    await self._supervisor.serve(task_status=relay)
                except Exception as exc:  # raised below, unwrapped by the nursery
                    error = exc
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            self._serving = False
            self._stopped = True
        if error is not None:
            self._dead = error
            raise error

    async def _serve_replica(self, replica: _Replica, *, task_status: TaskStatus[Any]) -> None:
        """The supervised child: one open engine.  Returns never; raises
        :class:`EngineDeadError` when the engine died so the supervisor reopens this replica
        alone.  Cancellation closes the engine (bounded, shielded by the engine)."""
        trace = (
            self._trace_factory(replica.index)
            if self._trace_factory is not None and self.stage == "inline"
            else None
        )
        replica.opening_since = began = trio.current_time()
        try:
            async with open_engine(self.engine_config, trace=trace, stage=self.stage) as engine:
                replica.opening_since = None
                self._open_time.record(trio.current_time() - began)
                replica.engine = engine
                try:
                    if self.sleep_level or self._sleep_lock.locked():
                        await self._sleep_replica(replica.index, engine)
                    task_status.started(engine)
                    await engine.wait_ended()
                    health = engine.health()
                finally:
                    replica.engine = None
                    replica.past_worker_restarts += engine.health().restarts
        finally:
            replica.opening_since = None
        replica.last_failure = health.reason
        raise EngineDeadError(f"replica {replica.index}: engine {health.state}: {health.reason}")

    # -- sleep and wake --------------------------------------------------------------------

    def _open_engines(self) -> list[tuple[int, AnyEngine]]:
        return [(r.index, r.engine) for r in self._replicas if r.engine is not None]

    async def _sleep_replica(self, index: int, engine: AnyEngine) -> None:
        """A replica opened while the pool sleeps (or falls asleep): put it to sleep too
        (logged on failure).  Under the sleep lock, so a sleep or wake of the pool under
        way finishes first and the level read is the pool's after it."""
        async with self._sleep_lock:
            if not self.sleep_level:
                return
            try:
                await engine.sleep(self.sleep_level)
            except Exception:
                log.exception("could not put reopened replica %d to sleep", index)

    async def sleep(self, level: int = 1) -> list[dict[str, Any]]:
        """Put every open replica to sleep at ``level`` (``AsyncEngine.sleep``), all at once;
        replicas opened later sleep too until :meth:`wake_up`.  Returns one report per
        replica: ``index`` and ``ranks`` (each worker's report).  Raises the first replica's
        error (:class:`~omni_trio.errors.InvalidRequestError` for a bad level,
        :class:`~omni_trio.errors.StallError` if it could not drain in time, a
        :class:`~omni_trio.errors.WorkerError`); the replicas that did fall asleep are then
        woken again, so the pool is awake as before."""
        async with self._sleep_lock:
            engines = self._open_engines()
            if not engines:
                raise NotReadyError(self.readiness()[1] or "no replica is open")
            before = self.sleep_level
            # Shielded: a caller that leaves halfway must not leave some replicas asleep
            # with the pool awake (each engine's sleep is bounded by its drain timeout).
            with trio.CancelScope(shield=True):
                reports, errors = await _each(engines, lambda engine: engine.sleep(level))
                if errors:
                    if not before:  # it was awake: so are the replicas again
                        await _each(
                            [(i, e) for i, e in engines if i in reports],
                            lambda engine: engine.wake_up(),
                        )
                    raise errors[0]
                self.sleep_level = max(level, before)
            return [{"index": i, "ranks": reports[i]} for i in sorted(reports)]

    async def wake_up(self) -> list[dict[str, Any]]:
        """Wake every open replica (``AsyncEngine.wake_up``).  Returns one report per
        replica, as :meth:`sleep`.  Raises the first replica's error; the pool stays asleep
        (the replicas that woke serve; :meth:`wake_up` may be called again)."""
        async with self._sleep_lock:
            engines = self._open_engines()
            with trio.CancelScope(shield=True):  # (as sleep: all or the error)
                reports, errors = await _each(engines, lambda engine: engine.wake_up())
            if errors:
                raise errors[0]
            self.sleep_level = 0
            return [{"index": i, "ranks": reports[i]} for i in sorted(reports)]

    def sleep_states(self) -> list[dict[str, Any]]:
        """Per open replica: ``index``, ``state`` (awake, falling_asleep, asleep, waking)
        and ``level`` (0 while awake)."""
        states = []
        for index, engine in self._open_engines():
            stats = engine.statistics()
            states.append(
                {"index": index, "state": str(stats.sleep_state), "level": stats.sleep_level}
            )
        return states

    async def _serve_restart_waits(self) -> None:
        """End the restart waits (see :meth:`submit`): a request whose replica is ready
        again stops waiting; one still waiting when its ``restart_wait_s`` is over is
        aborted with :data:`RESTART_WAIT_REASON`, at that time exactly.  Runs until
        cancelled; checks its replicas every :data:`RESTART_POLL_S` while any request waits."""
        while True:
            if not self._restart_waits:
                self._restart_wake = trio.Event()
                await self._restart_wake.wait()
                continue
            now = trio.current_time()
            for rid, (until, stream) in list(self._restart_waits.items()):
                engine = self._replicas[stream.replica].engine
                if engine is not None and engine.health().healthy:
                    del self._restart_waits[rid]  # its replica is ready: it waits no more
                elif now >= until:
                    del self._restart_waits[rid]
                    self._abort(stream, RESTART_WAIT_REASON)
            if self._restart_waits:
                until = min(until for until, _ in self._restart_waits.values())
                await trio.sleep_until(min(until, now + RESTART_POLL_S))

    async def _serve_moves(self) -> None:
        """Move the requests queued on a replica whose worker group is restarting to the
        ready replicas (:meth:`move_off_restarting`), every :data:`RESTART_POLL_S` while
        requests are in flight.  Runs until cancelled."""
        while True:
            if not self._active:
                # Idle: a restart seen now is not timed (its end would not be seen on time).
                for replica in self._replicas:
                    replica.restarting_since = None
                self._busy = trio.Event()
                await self._busy.wait()
            await trio.sleep(RESTART_POLL_S)
            self.move_off_restarting()

    def expected_group_restart_s(self) -> float:
        """How long a worker group takes to restart: the median of the restarts measured
        (failure seen to ready again), else the engine's restart backoff plus the measured
        open time of a replica (an upper estimate: it includes the warmup), else
        :data:`DEFAULT_RETRY_AFTER_S`."""
        measured = self._group_restart_time.expected_s()
        if measured is not None:
            return measured
        opened = self._open_time.expected_s()
        if opened is None:
            return float(DEFAULT_RETRY_AFTER_S)
        return self.engine_config.worker_restart_backoff_s + opened

    def move_off_restarting(self) -> int:
        """Move the requests queued (waiting, or put back by the failure) on a replica
        whose worker group is restarting to the least-loaded ready replica, one by one,
        while that replica would start each sooner than the restart is expected to be
        over (:meth:`expected_group_restart_s`, less the time since the failure was seen;
        once overdue, as long again as it has taken): its work in flight at its share of
        the measured rate of work is less than that.
        The requests the failed group ran are then retried on a live replica at once, and
        those behind them do not wait for the restart; a restart that is nearly over, or
        a live replica with a queue longer than it, keeps them.  Only requests no chunk of
        which reached their consumer yet, each at most once (:meth:`PooledStream.move_off`).
        Also measures the restarts.  No checkpoint; how many moved."""
        now = trio.current_time()
        restarting: dict[int, float] = {}  # replica -> restart time left (s)
        for replica in self._replicas:
            engine = replica.engine
            state = None if engine is None or engine.is_dead else engine.health().state
            if state is EngineState.RESTARTING:
                if replica.restarting_since is None:
                    replica.restarting_since = now
                elapsed = now - replica.restarting_since
                # Overdue: expect it to take about as long again as it has (never "over").
                left = max(self.expected_group_restart_s() - elapsed, elapsed)
                restarting[replica.index] = left
            elif replica.restarting_since is not None:
                if state is EngineState.READY:
                    self._group_restart_time.record(now - replica.restarting_since)
                replica.restarting_since = None
        if not restarting or self._dead is not None or self._draining:
            return 0
        ready = self._ready_replicas()
        if not ready:
            return 0
        rate = self.work_rate()
        per_replica = None if rate is None or rate <= 0 else rate / self.replicas
        # The work in flight on each ready replica (grows as requests move there).
        queued = {r.index: 0.0 for r in ready}
        for stream in self._active.values():
            if stream.replica in queued:
                queued[stream.replica] += self._work_left(stream)
        moved = 0
        for stream in list(self._active.values()):
            engine = self._replicas[stream.replica].engine
            if stream.replica not in restarting or engine is None:
                continue
            restart_left = restarting[stream.replica]
            target = min(ready, key=lambda r: (r.in_flight, r.index))  # as _move_elsewhere
            if per_replica is not None and queued[target.index] / per_replica >= restart_left:
                continue  # the restart is expected first
            status = engine.status(stream.engine_request_id)
            if status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) and stream.move_off(
                engine.abort
            ):
                self._restart_waits.pop(stream.engine_request_id, None)
                queued[stream.replica] += stream.work * self._weight(stream.pixels)
                moved += 1
        return moved

    def _on_event(self, event: SupervisorEvent) -> None:
        if event.kind == "failed" and event.error is not None:
            index = int(event.child.rsplit("-", 1)[1])
            self._replicas[index].last_failure = f"{type(event.error).__name__}: {event.error}"

    # -- admission -------------------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet released (queued or running, on any replica)."""
        return len(self._active)

    def _ready_replicas(self) -> list[_Replica]:
        return [r for r in self._replicas if r.engine is not None and r.engine.health().healthy]

    def _admitting_replicas(self) -> list[_Replica]:
        """The ready replicas; without any, those whose worker group is restarting: their
        engine queues what it is given and runs it on the new group (bounded by
        ``restart_wait_s`` and the request's own timeout), which beats a 503 for a restart
        of a second or two."""
        ready = self._ready_replicas()
        if ready:
            return ready
        return [
            r
            for r in self._replicas
            if r.engine is not None
            and r.engine.health().state in (EngineState.RESTARTING, EngineState.SLEEPING)
        ]

    def submit(
        self,
        prompt: str,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        owner: str = "",
    ) -> Submission:
        """Admit ``owner``'s request on the least-loaded ready replica (no checkpoint); while
        none is ready, on one whose worker group is restarting (it waits in that engine's
        queue, at most ``restart_wait_s`` for the replica to be ready, else it is aborted
        with :data:`RESTART_WAIT_REASON`; not so bounded when its own ``deadline_s`` is not
        longer: that ends it first).  ``request_id`` is the public id (default: a generated
        one); the engine runs it as :func:`engine_request_id` ``(request_id, owner)``.

        Load is the replica's requests in flight through the pool (each of its waiting and
        running requests has one open stream); ties go to the lowest index.  Raises
        :class:`DrainingError`, :class:`QueueFullError`, :class:`NotReadyError`,
        :class:`~omni_trio.errors.DuplicateRequestError` (the owner has that id in flight on
        any replica), :class:`~omni_trio.errors.InvalidRequestError` from the engine's
        validation, and :class:`~omni_trio.errors.EngineDeadError` once the pool gave up.
        Nothing is admitted when it raises.
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine pool gave up: {self._dead}")
        if self._draining:
            raise DrainingError("the server is draining and admits no new requests")
        if len(self._active) >= self.max_queue_len:
            raise QueueFullError(len(self._active), self.max_queue_len)
        klass = self._class_of(prompt, params)
        estimate = self._check_queue_wait(params, klass)
        self._check_passing(params)
        public = request_id if request_id is not None else new_request_id()
        rid = engine_request_id(public, owner)
        if rid in self._active:
            raise DuplicateRequestError(public)
        admitting = self._admitting_replicas()
        if not admitting:
            raise NotReadyError(self.readiness()[1] or "no replica is ready")
        if estimate is None:
            estimate = self._estimated_finish_s(params, klass)
        replica = min(admitting, key=lambda r: (r.in_flight, r.index))
        assert replica.engine is not None
        restarting = replica.engine.health().state is EngineState.RESTARTING
        inner = replica.engine.stream(prompt, params, request_id=rid)
        stream = PooledStream(
            inner,
            replica.index,
            self._release,
            public_id=public,
            owner=owner,
            move=partial(self._move_elsewhere, prompt, params.replace(seed=inner.seed)),
            priority=params.priority,
            klass=klass,
            work=request_work(params),
            pixels=self._pixels_of(params),
        )
        stream.estimate_s = estimate
        self._active[rid] = stream
        self._arrivals.record(
            trio.current_time(), params.priority, klass, stream.work, stream.pixels
        )
        wait = self.restart_wait_s
        if (
            restarting
            and wait is not None
            and (params.deadline_s is None or params.deadline_s > wait)
        ):
            self._restart_waits[rid] = (trio.current_time() + wait, stream)
            self._restart_wake.set()
        self._finished.pop((owner, public), None)
        replica.in_flight += 1
        self._busy.set()
        if self._idle.is_set():
            self._idle = trio.Event()
        return Submission(public, replica.index, stream, inner.seed)

    # -- the service rate -------------------------------------------------------------------

    def service_rate(self) -> float | None:
        """Requests the pool completed per second, over the last :data:`RATE_WINDOW`
        completions of the last :data:`RATE_WINDOW_S` seconds (None: too few measured)."""
        return self._service.rate(trio.current_time())

    def step_weight(self) -> Callable[[int], float]:
        """``weight(pixels)``: how long one denoising step of one image takes at that size
        (pixels per image), as the replicas' engines measured it (the mean of theirs);
        a size not measured yet is scaled from the nearest one measured by its pixel count
        (one not known, ``pixels`` 1, weighs as the slowest measured); before any is
        measured every step weighs 1 (the estimates then count steps).  The
        pool's estimates weigh every step by it, so a queue of large images is not taken for
        one of small ones."""
        measured: dict[int, list[float]] = {}
        for replica in self._replicas:
            engine = replica.engine
            if engine is None:
                continue
            for pixels, seconds in engine.step_times().items():
                measured.setdefault(pixels, []).append(seconds)
        if not measured:
            return flat_weight
        table = {px: sum(times) / len(times) for px, times in measured.items()}
        slowest = max(table.values())

        def weight(pixels: int) -> float:
            known = table.get(pixels)
            if known is not None:
                return known
            if pixels <= 1:  # a size not known when it was admitted: the safe side
                return slowest
            nearest = min(table, key=lambda px: (abs(math.log(px / pixels)), px))
            return table[nearest] * pixels / nearest

        return weight

    def work_rate(self) -> float | None:
        """Work the pool completed per second, over the same window as
        :meth:`service_rate` (None: too few measured): denoising steps x images, each step
        weighted by :meth:`step_weight` (so, once measured, in seconds of steps per second)."""
        self._weight = self.step_weight()
        return self._service.work_rate(trio.current_time(), self._weight)

    def estimated_wait_s(self) -> float | None:
        """How long a request admitted now would wait behind the requests in flight (the
        work they have left, at the measured rate of work; None: nothing measured yet)."""
        work_rate = self.work_rate()
        if work_rate is None:
            return None
        return sum(map(self._work_left, self._active.values())) / work_rate

    def retry_after_s(self, excess: int | None = None) -> int:
        """What a client refused for load should wait before trying again
        (``Retry-After``): the time for ``excess`` requests (default: those over
        ``max_queue_len``, at least one) to be served at the measured rate, at least 1 s and
        at most :data:`MAX_RETRY_AFTER_S`; :data:`DEFAULT_RETRY_AFTER_S` with nothing
        measured."""
        rate = self.service_rate()
        if rate is None:
            return DEFAULT_RETRY_AFTER_S
        if excess is None:
            excess = len(self._active) - self.max_queue_len + 1
        return clamp_retry_after(max(1, excess) / rate)

    def open_time_s(self) -> float | None:
        """How long opening a replica takes, as measured (the median of the last
        :data:`OPEN_WINDOW` opens; None before the first one)."""
        return self._open_time.expected_s()

    def ready_retry_after_s(self) -> int:
        """``Retry-After`` of a 503 for a pool that is not ready (starting, a replica
        reopening, every worker group restarting): 1 s when a replica is ready; else the
        soonest a replica should be: one opening since ``t`` is ready at ``t`` plus the
        measured open time; a worker group restarting, after the engine's restart backoff
        plus that time (its workers start again, without the warmup's share being known:
        an upper estimate).  :data:`DEFAULT_RETRY_AFTER_S` before any open was measured;
        within 1 .. :data:`MAX_RETRY_AFTER_S`."""
        if self._ready_replicas():
            return 1
        expected = self._open_time.expected_s()
        if expected is None:
            return DEFAULT_RETRY_AFTER_S
        now = trio.current_time()
        soonest: list[float] = []
        for replica in self._replicas:
            if replica.opening_since is not None:
                soonest.append(replica.opening_since + expected - now)
            elif replica.engine is not None:
                backoff = self.engine_config.worker_restart_backoff_s
                soonest.append(backoff + expected)
        return clamp_retry_after(min(soonest)) if soonest else clamp_retry_after(expected)

    def unavailable_retry_after_s(self) -> int:
        """``Retry-After`` of a 503 that the pool's state explains:
        :meth:`restart_retry_after_s` while it drains, after it stopped or gave up;
        :meth:`ready_retry_after_s` otherwise."""
        if self._draining or self._stopped or self._dead is not None:
            return self.restart_retry_after_s()
        return self.ready_retry_after_s()

    def restart_retry_after_s(self) -> int:
        """``Retry-After`` of a 503 for a server that is going away (draining, or the pool
        gave up so the process exits for its OS supervisor to start again): the measured
        time to open every replica again (in turn; stage processes all at once).
        :data:`DEFAULT_RETRY_AFTER_S` before any open was measured."""
        expected = self._open_time.expected_s()
        if expected is None:
            return DEFAULT_RETRY_AFTER_S
        turns = 1 if self.stage == "process" else self.replicas
        return clamp_retry_after(expected * turns)

    def estimate_factor(self, priority: int | None = None) -> float:
        """What the admission estimates are scaled by: how far the finishes estimated fell
        short of the measured ones (the 0.9 quantile of measured / estimated over the last
        requests, at least 1, at most :data:`MAX_ESTIMATE_FACTOR`; 1 until enough were
        measured).  The estimate's model (a measured rate shared by what runs) leaves out
        what it cannot know (the tick in flight, the turn order, later arrivals); this
        measures what it leaves out.  Under ``scheduling_policy="priority"`` a
        ``priority`` given gets its own priority's factor once enough of them were
        measured (later better arrivals pass a worse request more than any other)."""
        own = self._priority_errors.get(priority) if priority is not None else None
        if own is not None and own.measured:
            return own.factor()
        return self._estimate_error.factor()

    def _check_queue_wait(self, params: SamplingParams, klass: Hashable = None) -> float | None:
        """Refuse a request whose estimated queue wait exceeds ``max_queue_wait_s``, or
        whose estimated finish (that wait plus its own run) exceeds its own deadline
        (:class:`QueueWaitError`); nothing is checked before a rate is measured.  Both are
        :meth:`_estimated_wait_s` scaled by :meth:`estimate_factor`.  Returns the unscaled
        estimated finish (None when nothing was checked), which the request's own finish
        measures against."""
        if params.deadline_s is None and self.max_queue_wait_s is None:
            return None
        work_rate = self.work_rate()
        if work_rate is None or work_rate <= 0:
            return None
        wait, run = self._estimated_wait_s(params, klass, work_rate)
        estimate = wait + run
        factor = self.estimate_factor(params.priority)
        wait, run = wait * factor, run * factor
        if self.max_queue_wait_s is not None and wait > self.max_queue_wait_s:
            raise QueueWaitError(wait, self.max_queue_wait_s, "max_queue_wait_s")
        # Its deadline covers its own run too.
        finish = wait + run
        if params.deadline_s is not None and finish > params.deadline_s:
            raise QueueWaitError(
                finish, params.deadline_s, "the request's timeout", "time to finish"
            )
        return estimate

    def _check_passing(self, params: SamplingParams) -> None:
        """Under ``scheduling_policy="priority"``, refuse (:class:`PassedTooLongError`) a
        request that the better-priority requests arriving meanwhile would hold past both
        what a full queue in arrival order takes (:meth:`_full_queue_finish_s`) and what
        it would take without them: the queue limit bounds every admitted request's
        latency, not just the count in flight.  A request that no better-priority arrival
        was measured for is never refused here.  Nothing is checked before a rate is
        measured, or with more than :data:`ESTIMATE_MAX_IN_FLIGHT` in flight (an estimate
        is O(in flight))."""
        config = self.engine_config
        if config.scheduling_policy != "priority":
            return
        own_priority = params.priority
        if not config.min_priority <= own_priority <= config.max_priority:
            return  # invalid: the engine's validation says so (400), not a 429
        if len(self._active) > ESTIMATE_MAX_IN_FLIGHT:
            return
        work_rate = self.work_rate()
        if work_rate is None or work_rate <= 0:
            return
        if not self._arrivals.rate(trio.current_time(), lambda p, _: p < own_priority):
            return  # nothing better arrives: nothing passes it
        ahead, own_run, share = self._priority_estimate(params, work_rate)
        # Its own finish scaled by its priority's measured error (how far later better
        # arrivals passed such requests beyond the estimate), a full queue's by everyone's.
        plain = (ahead / work_rate + own_run) * self.estimate_factor(own_priority)
        finish = plain / share
        own_work = request_work(params) * self._weight(self._pixels_of(params))
        full = self._full_queue_finish_s(own_work, work_rate) * self.estimate_factor()
        limit = max(plain, full)  # nothing passing it: never refused
        if finish > limit:
            raise PassedTooLongError(finish, limit, len(self._active), self.max_queue_len)

    def _full_queue_finish_s(self, own_work: float, work_rate: float) -> float:
        """The finish of a request of ``own_work`` admitted last into a full queue served in
        arrival order: ``max_queue_len - 1`` requests of the recent mean work (weighted as
        the rate is) ahead of it, then its own run shared as :meth:`_run_s` shares it."""
        config = self.engine_config
        slots = self.replicas * config.max_num_seqs * config.data_parallel_size
        mean = self._arrivals.mean_work(trio.current_time(), self._weight)
        ahead = (self.max_queue_len - 1) * (own_work if mean is None else mean)
        return (ahead + own_work * max(1, min(slots, self.max_queue_len))) / work_rate

    def _estimated_finish_s(self, params: SamplingParams, klass: Hashable) -> float | None:
        """The unscaled estimated finish of a request no limit applies to, made only to
        measure the estimate (:meth:`estimate_factor`), while at most
        :data:`ESTIMATE_MAX_IN_FLIGHT` are in flight (an estimate is O(in flight))."""
        if len(self._active) > ESTIMATE_MAX_IN_FLIGHT:
            return None
        work_rate = self.work_rate()
        if work_rate is None or work_rate <= 0:
            return None
        wait, run = self._estimated_wait_s(params, klass, work_rate)
        return wait + run

    def _run_s(self, own_work: float, work_rate: float) -> float:
        """How long a request of ``own_work`` runs once started: the rate of work is
        shared by every request that runs at once (a batch on each replica), so its own
        steps come at ``work_rate / sharing``, where ``sharing`` is the requests running
        beside it: the pool's slots (``replicas x max_num_seqs x data_parallel_size``),
        or fewer while fewer are in flight."""
        config = self.engine_config
        slots = self.replicas * config.max_num_seqs * config.data_parallel_size
        sharing = max(1, min(slots, len(self._active) + 1))
        return own_work * sharing / work_rate

    def _work_left(self, stream: PooledStream) -> float:
        """:meth:`_steps_left` weighted by the step time of its size."""
        return self._steps_left(stream) * self._weight(stream.pixels)

    def _steps_left(self, stream: PooledStream) -> float:
        """What ``stream``'s request has left to do: its steps x images, less the share of
        its steps done where its engine tracks them; nothing once its engine is done with
        it (its consumer has not read the end yet)."""
        engine = self._replicas[stream.replica].engine
        if engine is not None and engine.status(stream.engine_request_id) is None:
            return 0.0
        progress = None if engine is None else engine.progress(stream.engine_request_id)
        if progress is None or progress[1] <= 0:
            return stream.work
        done, total = progress
        return stream.work * max(0.0, 1.0 - done / total)

    def _estimated_wait_s(
        self, params: SamplingParams, klass: Hashable, work_rate: float
    ) -> tuple[float, float]:
        """``(wait, run)``: how long a request admitted now would wait, and then run, at
        the measured rate of work (denoising steps x images completed per second, each
        step weighted by the time a step takes at its size, :meth:`step_weight`: a 16-step
        request counts four times a 4-step one, one half done half, and a step of a size
        measured four times slower four times one of the faster size).

        ``fifo``: it waits for the work left in every request in flight, and runs its
        own beside the others running (:meth:`_run_s`).

        ``priority``: it waits for the work left in those it does not pass
        (:meth:`_ahead_of`); while some wait, requests of a better priority keep arriving
        and run first (in step mode they preempt it too): their measured share ``rho`` of
        the rate of work is not its (``rate x (1 - rho)``, ``rho`` at most
        :data:`MAX_PASSING_SHARE`; the waiting time of a low class under a high one).

        ``fair``: it waits for the work left in its own class and, from every other
        class, at most what the classes' turns give that class meanwhile: the scheduler
        deals turns of equal cost (pixels x steps), so for each of its own steps a class
        of ``p`` pixels per image gets ``own pixels / p`` steps; while some wait, later
        arrivals of other classes take turns too, but its class gets at least its turn
        among the classes in flight (its share of the time under turns of equal cost,
        ``(w(own) / own pixels) / sum(w(p) / p)`` with ``w`` the step weight), which
        bounds its wait.

        The rate is a measured throughput, not a capacity: on a pool that keeps up,
        nothing waits and no share is taken out."""
        policy = self.engine_config.scheduling_policy
        now = trio.current_time()
        weight = self._weight
        own_px = self._pixels_of(params)
        own_steps = request_work(params)
        own_work = own_steps * weight(own_px)
        if policy == "fair":
            own = 0.0  # steps left in its own class
            others: dict[Hashable, list[float]] = {}  # class -> [steps left, pixels]
            for stream in self._active.values():
                left = self._steps_left(stream)
                if stream.klass == klass:
                    own += left
                else:
                    others.setdefault(stream.klass, [0.0, stream.pixels])[0] += left
            turns = own + own_steps
            own_time = own * weight(own_px)
            ahead = own_time + sum(
                min(steps, turns * own_px / px) * weight(int(px)) for steps, px in others.values()
            )
            rho = 0.0
            if self._any_waiting():
                rho = self._arrivals.rate(now, lambda _, c: c != klass, weight) / work_rate
            # (Its class gets at least its turn among the classes in flight: turns of equal
            # cost, so its share of the time is its steps' time per pixel over everyone's.)
            per_px = weight(own_px) / own_px
            own_share = per_px / (per_px + sum(weight(int(px)) / px for _, px in others.values()))
            share = max(1 - min(rho, MAX_PASSING_SHARE), own_share)
            run = self._run_s(own_work, work_rate)
            wait = ahead / (work_rate * share)
            share_bound = own_time / (work_rate * own_share)
            return min(wait, share_bound), run / share
        if policy == "priority":
            ahead, run, share = self._priority_estimate(params, work_rate)
            return ahead / (work_rate * share), run / share
        left = sum(map(self._work_left, self._active.values()))
        return left / work_rate, self._run_s(own_work, work_rate)

    def _priority_estimate(
        self, params: SamplingParams, work_rate: float
    ) -> tuple[float, float, float]:
        """``(ahead, run, share)`` under ``priority`` (see :meth:`_estimated_wait_s`): the
        work left in the requests it does not pass, its own run were the rate all its, and
        the share of the rate that better-priority arrivals leave it while some wait."""
        ahead_streams, waiting = self._ahead_of(params)
        rho = 0.0
        if waiting:
            own_priority = params.priority
            passing = self._arrivals.rate(
                trio.current_time(), lambda p, _: p < own_priority, self._weight
            )
            rho = passing / work_rate
        own_work = request_work(params) * self._weight(self._pixels_of(params))
        ahead = sum(map(self._work_left, ahead_streams))
        return ahead, self._run_s(own_work, work_rate), 1 - min(rho, MAX_PASSING_SHARE)

    def _pixels_of(self, params: SamplingParams) -> int:
        """Pixels per image of a request (the model's default size where it leaves it
        unset; 1 where that is not known yet): what the ``fair`` scheduler weighs its
        steps by."""
        height, width = params.height, params.width
        if height is None or width is None:
            default = self.default_size()
            if default is None:
                return 1
            width = width if width is not None else default[0]
            height = height if height is not None else default[1]
        try:
            return max(1, int(height) * int(width))
        except (TypeError, ValueError, OverflowError):  # the engine's validation says why
            return 1

    def _any_waiting(self) -> bool:
        """Whether some request in flight still waits in its engine's queue (O(n))."""
        for stream in self._active.values():
            engine = self._replicas[stream.replica].engine
            if engine is not None and engine.status(stream.engine_request_id) in (
                RequestStatus.WAITING,
                RequestStatus.PREEMPTED,
            ):
                return True
        return False

    def _class_of(self, prompt: str, params: SamplingParams) -> Hashable:
        """The compatibility class the ``fair`` policy balances (the engine's batch key for
        its mode; as given, before the model fills in default sizes); None otherwise."""
        if self.engine_config.scheduling_policy != "fair":
            return None
        key = step_batch_key if self.engine_config.step_execution else request_batch_key
        try:
            return key(DiffusionRequest(prompt, params, "estimate"))
        except Exception:  # the engine's validation reports a bad request, not this
            return None

    def _ahead_of(self, params: SamplingParams) -> tuple[list[PooledStream], bool]:
        """Under ``scheduling_policy="priority"``: the requests in flight that a request
        with ``params`` admitted now would wait for (not a waiting one of a worse, higher
        priority: it passes those; the ones of a better or equal priority, and those
        already running), and whether any request in flight is waiting (O(n))."""
        ahead: list[PooledStream] = []
        waiting = False
        for stream in self._active.values():
            engine = self._replicas[stream.replica].engine
            status = None if engine is None else engine.status(stream.engine_request_id)
            queued = status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            waiting = waiting or queued
            if stream.priority <= params.priority or not queued:
                ahead.append(stream)  # better or equal, or running (or packing)
        return ahead, waiting

    def _move_elsewhere(
        self, prompt: str, params: SamplingParams, stream: PooledStream
    ) -> RequestStream | None:
        """``stream``'s replica died under it, or its worker group is restarting: admit it
        again (same engine id, same seed) on the least-loaded other ready replica; None when
        there is none (it then ends with the dead engine's error, or waits for the restart)
        or the pool no longer admits."""
        if self._dead is not None or self._draining:
            return None
        rid = stream.engine_request_id
        if self._active.get(rid) is not stream:
            return None
        if params.deadline_s is not None:  # its deadline counts from its first admission
            left = params.deadline_s - (trio.current_time() - stream.admitted_at)
            if left <= 0:
                return None  # it ends by its timeout where it is
            params = params.replace(deadline_s=left)
        others = [
            r
            for r in self._ready_replicas()
            if r.index != stream.replica and r.engine is not None and not r.engine.is_dead
        ]
        if not others:
            return None
        replica = min(others, key=lambda r: (r.in_flight, r.index))
        assert replica.engine is not None
        try:
            inner = replica.engine.stream(prompt, params, request_id=rid)
        except OmniTrioError:
            return None
        old = self._replicas[stream.replica].engine
        died = old is None or old.is_dead
        self.moved["replica_died" if died else "workers_restarting"] += 1
        log.warning(
            "request %s: %s; moved to replica %d",
            stream.public_id,
            f"replica {stream.replica} "
            + ("died under it" if died else "is restarting its workers"),
            replica.index,
        )
        self._replicas[stream.replica].in_flight -= 1
        replica.in_flight += 1
        stream.replica = replica.index
        return inner

    def _release(self, stream: PooledStream) -> None:
        rid = stream.engine_request_id
        if self._active.get(rid) is not stream:  # pragma: no cover - released once by design
            return
        now = trio.current_time()
        if stream.completed:
            self._service.record(now, stream.work, stream.pixels)
        # (A request that moved ran elsewhere, later: not what was estimated.)
        measured = (stream.completed or stream.timed_out) and not stream.moves
        if measured and stream.estimate_s is not None:
            self._estimate_error.record(stream.estimate_s, now - stream.admitted_at)
            if self.engine_config.scheduling_policy == "priority":
                own = self._priority_errors.setdefault(stream.priority, EstimateError())
                own.record(stream.estimate_s, now - stream.admitted_at)
        del self._active[rid]
        self._restart_waits.pop(rid, None)
        self._replicas[stream.replica].in_flight -= 1
        key = (stream.owner, stream.public_id)
        self._finished[key] = None
        self._finished.move_to_end(key)
        while len(self._finished) > FINISHED_IDS_KEPT:
            self._finished.popitem(last=False)
        if not self._active:
            self._idle.set()

    # -- control ---------------------------------------------------------------------------

    def abort(self, request_id: str, *, owner: str = "", reason: str = "cancelled") -> str:
        """Abort ``owner``'s request ``request_id`` (public id; no checkpoint): ``"aborted"``
        if it was in flight (its stream gets a terminal FINISHED_ABORTED output; its forward
        stops at the next step), ``"finished"`` if it already ended (among the last ids
        remembered), else ``"unknown"`` -- also for another owner's request."""
        stream = self._lookup(request_id, owner)
        if stream is None:
            return "finished" if (owner, request_id) in self._finished else "unknown"
        return self._abort(stream, reason)

    def _lookup(self, request_id: str, owner: str) -> PooledStream | None:
        """``owner``'s stream for public id ``request_id``, if in flight.  The owner is
        checked too, not only implied by the engine id: a path id holding ``@`` must never
        reach another owner's request."""
        stream = self._active.get(engine_request_id(request_id, owner))
        if stream is None or stream.owner != owner or stream.public_id != request_id:
            return None
        return stream

    def _abort(self, stream: PooledStream, reason: str) -> str:
        rid = stream.engine_request_id
        if stream.abort_reason is None:
            stream.abort_reason = reason
        engine = self._replicas[stream.replica].engine
        if engine is not None:
            engine.abort(rid)
        return "aborted"

    def abort_all(self, reason: str) -> None:
        """Abort every request in flight, marking each with ``reason`` (no checkpoint)."""
        for stream in list(self._active.values()):
            self._abort(stream, reason)

    def start_draining(self) -> None:
        """Stop admitting: every later :meth:`submit` raises :class:`DrainingError` and
        :meth:`readiness` says not ready.  Requests in flight go on."""
        self._draining = True

    async def wait_idle(self) -> None:
        """Wait until no request is in flight.  Cancelling it is harmless."""
        while self._active:
            await self._idle.wait()

    def progress(self, request_id: str, *, owner: str = "") -> tuple[int, int] | None:
        """(steps done, total steps) of ``owner``'s running request ``request_id`` (public
        id) where its backend tracks it."""
        stream = self._lookup(request_id, owner)
        if stream is None:
            return None
        engine = self._replicas[stream.replica].engine
        if engine is None or not engine.health().healthy:
            return None
        return engine.progress(stream.engine_request_id)

    def status(self, request_id: str, *, owner: str = "") -> str | None:
        """Where ``owner``'s request ``request_id`` (public id) is: ``"queued"`` (waiting,
        or requeued after a worker failure), ``"running"``, ``"finished"`` (ended, among
        the last ids remembered), or None when unknown -- also for another owner's."""
        stream = self._lookup(request_id, owner)
        if stream is None:
            return "finished" if (owner, request_id) in self._finished else None
        engine = self._replicas[stream.replica].engine
        state = engine.status(stream.engine_request_id) if engine is not None else None
        if state is None or state.finished:  # its terminal output is on its way
            return "finished"
        if state in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            return "queued"
        return "running"

    @property
    def streams_previews(self) -> bool:
        """Whether the engines stream preview chunks (step mode with ``streaming_output``):
        what ``partial_images`` needs."""
        return self.engine_config.streaming_output

    def queue_position(self, request_id: str, *, owner: str = "") -> int | None:
        """Requests queued ahead of ``owner``'s waiting request ``request_id`` (public id)
        on its replica (0: next), or None when it is not waiting (or unknown)."""
        stream = self._lookup(request_id, owner)
        if stream is None:
            return None
        engine = self._replicas[stream.replica].engine
        return None if engine is None else engine.queue_position(stream.engine_request_id)

    def model_info(self) -> ModelInfo | None:
        """The served model's :class:`ModelInfo`, from the first replica whose worker group
        has started; None while none has."""
        for replica in self._replicas:
            engine = replica.engine
            if engine is None:
                continue
            try:
                info = engine.model_info
            except EngineClosedError:  # no worker group yet
                continue
            if info is not None:
                return info
        return None

    def default_size(self) -> tuple[int, int] | None:
        """``(width, height)`` a request that leaves its size unset renders at: the served
        model's default (see :meth:`model_info`); None while no worker group has started."""
        info = self.model_info()
        return None if info is None else (info.default_width, info.default_height)

    def replica_engine(self, index: int) -> AnyEngine | None:
        """Replica ``index``'s engine while it is open (for diagnostics and tests)."""
        return self._replicas[index].engine

    # -- health ----------------------------------------------------------------------------

    def readiness(self) -> tuple[bool, str | None]:
        """``(True, None)`` when not draining and every replica is open and healthy; else
        ``(False, reason)``."""
        if self._dead is not None:
            return False, f"the engine pool gave up: {self._dead}"
        if self._draining:
            return False, "draining: the server is shutting down"
        if not self._serving:
            return False, "the engine pool is stopped" if self._stopped else "starting"
        for replica in self._replicas:
            engine = replica.engine
            if engine is None:
                state, reason = self._closed_state(replica)
                suffix = f" (last failure: {reason})" if reason else ""
                return False, f"replica {replica.index}: {state}{suffix}"
            health = engine.health()
            if not health.healthy:
                return False, f"replica {replica.index}: {health.state}: {health.reason}"
        return True, None

    def _closed_state(self, replica: _Replica) -> tuple[str, str | None]:
        """State and reason of a replica whose engine is not open."""
        if self._supervisor is None:
            return "starting", None
        child = self._supervisor.children()[replica.index]
        state = {
            ChildState.STARTING: "starting",
            ChildState.RESTARTING: "restarting",
            ChildState.RUNNING: "restarting",  # its engine closed; the child is ending
        }.get(child.state, "failed")
        return state, child.last_error or replica.last_failure

    def replicas_info(self) -> list[dict[str, Any]]:
        """Per replica: ``index``, ``state`` (``ready``, ``starting``, ``restarting``,
        ``failed``, ``dead``, ``closed``), ``healthy``, ``reason``, ``restarts`` (reopens by
        the pool), ``worker_restarts`` (worker-group restarts of all its engines so far),
        ``in_flight``, and ``statistics`` (the engine's, as a dict; None while closed)."""
        children = self._supervisor.children() if self._supervisor is not None else None
        info: list[dict[str, Any]] = []
        for replica in self._replicas:
            restarts = children[replica.index].restarts if children is not None else 0
            engine = replica.engine
            worker_restarts = replica.past_worker_restarts
            stats: dict[str, Any] | None = None
            if engine is not None:
                health = engine.health()
                state: str = health.state
                healthy, reason = health.healthy, health.reason
                worker_restarts += health.restarts
                stats = dataclasses.asdict(engine.statistics())
            else:
                healthy = False
                state, reason = self._closed_state(replica)
            info.append(
                {
                    "index": replica.index,
                    "state": state,
                    "healthy": healthy,
                    "reason": reason,
                    "restarts": restarts,
                    "worker_restarts": worker_restarts,
                    "in_flight": replica.in_flight,
                    "statistics": stats,
                }
            )
        return info
