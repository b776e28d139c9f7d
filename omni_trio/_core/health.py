"""Snapshots of an engine's health and statistics (pure data), and the typed states they use.

The engine core derives both from one place (:meth:`EngineCore.health`,
:meth:`EngineCore.statistics`); the states are ``StrEnum`` members, so they compare equal to
(and serialise as) their lower-case names.
"""

from __future__ import annotations

import enum
import math
import statistics as _stats
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = [
    "SLEEP_LEVELS",
    "EngineHealth",
    "EngineState",
    "EngineStatistics",
    "GroupState",
    "PhaseSummary",
    "SleepState",
    "WorkerState",
    "WorkerStatus",
]


class GroupState(enum.StrEnum):
    """The worker group, as the engine sees it."""

    STARTING = "starting"  # the first group is loading
    RUNNING = "running"  # up and trusted
    RESTARTING = "restarting"  # failed closed; the supervisor is starting a new one
    FAILED = "failed"  # the supervisor gave up (or the engine died): no group will come
    STOPPED = "stopped"  # the engine was closed


class WorkerStatus(enum.StrEnum):
    """One worker, as its executor (or, between two groups, the engine) reports it."""

    RUNNING = "running"
    FAILED = "failed"  # its group failed closed
    STOPPED = "stopped"  # closed
    RESTARTING = "restarting"  # reported by the engine while a new group starts


class EngineState(enum.StrEnum):
    """What ``AsyncEngine.health().state`` says."""

    READY = "ready"
    STARTING = "starting"
    RESTARTING = "restarting"
    SLEEPING = "sleeping"  # falling asleep, asleep or waking up: requests wait (or are refused)
    DEAD = "dead"
    CLOSED = "closed"


# What AsyncEngine.sleep(level) takes: 1 keeps a copy of the weights off the device, 2 none.
SLEEP_LEVELS = (1, 2)


class SleepState(enum.StrEnum):
    """Where the engine is between :meth:`AsyncEngine.sleep` and :meth:`~AsyncEngine.wake_up`.

    ``falling_asleep``: no new request starts; the running ones finish and the outputs being
    packed arrive, then the workers release their weights.  ``asleep``: they did.
    ``waking``: the workers take their weights back.  Only ``awake`` runs new requests."""

    AWAKE = "awake"
    FALLING_ASLEEP = "falling_asleep"
    ASLEEP = "asleep"
    WAKING = "waking"


@dataclass(frozen=True, slots=True)
class WorkerState:
    """A snapshot of one worker: its rank, status and, where the backend knows them, its pid
    and the denoising steps it has run."""

    rank: int
    state: WorkerStatus
    pid: int | None = None
    steps: int | None = None


@dataclass(frozen=True, slots=True)
class PhaseSummary:
    """Summary of one phase's recent timings (ms) over the last 1024 requests."""

    count: int = 0
    mean_ms: float = 0.0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    max_ms: float = 0.0

    @classmethod
    def of(cls, samples: Iterable[float]) -> PhaseSummary:
        data = sorted(samples)
        if not data:
            return cls()
        return cls(
            count=len(data),
            mean_ms=_stats.fmean(data),
            p50_ms=data[len(data) // 2],
            p90_ms=data[min(len(data) - 1, math.ceil(len(data) * 0.9) - 1)],
            max_ms=data[-1],
        )


# Upper bounds (seconds) of the cancel-latency buckets of EngineStatistics.
CANCEL_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Upper bounds (seconds) of the step-mode tick-time buckets of EngineStatistics.
TICK_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """A snapshot of the engine (``AsyncEngine.statistics()``).

    ``packing`` counts requests whose compute is done and whose output is still being packed.
    Supervision: ``restarts`` of the worker group so far, requests ``requeued`` after a group
    failure, the group's state, each worker's state, and the last group failure
    (``"Type: message"``).
    """

    waiting: int
    running: int
    admitted: int
    finished_completed: int
    finished_aborted: int
    finished_error: int
    open_streams: int
    dead: bool
    closed: bool
    restarts: int = 0
    requeued: int = 0
    worker_group: GroupState = GroupState.RUNNING
    workers: tuple[WorkerState, ...] = ()
    last_failure: str | None = None
    queue_wait: PhaseSummary = field(default_factory=PhaseSummary)
    execution: PhaseSummary = field(default_factory=PhaseSummary)
    postprocess: PhaseSummary = field(default_factory=PhaseSummary)
    end_to_end: PhaseSummary = field(default_factory=PhaseSummary)
    packing: int = 0
    # Diffusion accounting.  ``batch_sizes``: (requests in it, how many) of every wave
    # (request mode) or tick (step mode) dispatched, by size.  ``cancel_latency_counts``:
    # aborts of requests whose compute was in flight, by the time from the abort to the end
    # of that compute (per bucket of CANCEL_LATENCY_BUCKETS_S, then one past the last;
    # ``cancel_latency_sum_s`` their total).  ``wasted_steps``: denoising steps computed for
    # requests that then ended aborted or failed.
    batch_sizes: tuple[tuple[int, int], ...] = ()
    cancel_latency_counts: tuple[int, ...] = ()
    cancel_latency_sum_s: float = 0.0
    wasted_steps: int = 0
    # Step mode: every tick (one denoising step of each request in it) by its time from
    # dispatch to result (per bucket of TICK_BUCKETS_S, then one past the last;
    # ``tick_sum_s`` their total).  Request mode times no ticks.
    tick_counts: tuple[int, ...] = ()
    tick_sum_s: float = 0.0
    # Sleep and wake: the state, the level slept at (0 while awake), and the number of
    # sleeps and wakes completed so far.
    sleep_state: SleepState = SleepState.AWAKE
    sleep_level: int = 0
    sleeps: int = 0
    # Seconds one denoising step of one image takes, by pixels per image, as measured on
    # this engine's dispatches (an exponential moving average; ``EngineCore.step_times``).
    step_time_s: tuple[tuple[int, float], ...] = ()
    # Data parallel: rank groups restarted on their own while the others served (the
    # engine's worker group did not restart for them; ``restarts`` counts those).
    rank_restarts: int = 0


@dataclass(frozen=True, slots=True)
class EngineHealth:
    """``AsyncEngine.health()``: never ``healthy`` while a worker is gone or restarting.

    ``state`` is ready, starting, restarting, sleeping, dead or closed; ``reason`` says why
    it is not ready.  ``sleep_level``: the level the engine sleeps at (0: awake).
    """

    healthy: bool
    state: EngineState
    reason: str | None
    restarts: int
    workers: tuple[WorkerState, ...]
    last_failure: str | None
    sleep_level: int = 0
