"""``bench policy``: the scheduling policies side by side under a seeded open-loop trace.

Issue #16's measurement.  One ``builtin:echo`` engine (inproc, step mode, ``--max-num-seqs``
2, ``--step-delay-ms`` 20 per denoising step, one torch thread, no warmup; with
``--step-cost pixels`` a step sleeps that x (size / 32)^2, as a real model's step grows with
its pixel count, which is what the ``fair`` policy's pixels x steps cost assumes) behind an
in-process :class:`~omni_trio.serve.pool.EnginePool` (the daemon's admission without HTTP:
:class:`~omni_trio.serve.pool.QueueFullError` is its 429, :class:`~omni_trio.serve.pool.
QueueWaitError` its 503), a fresh pool for every (policy, load) run.

The trace is seeded (``--seed``).  A request's *kind* is drawn independently of its arrival
time: size 32 or 64 px, 4 or 16 steps (each half the time), priority *high* (0) with
probability 0.2, else *low* (5); 20 % carry a ``deadline_s`` of 4x their kind's idle latency.
A *class*, for the statistics, is (priority, size): ``high/32``, ``high/64``, ``low/32``,
``low/64``.  Arrivals are Poisson at ``load x capacity`` for ``--duration-s`` (20) seconds;
every policy at a load gets the same arrival list (same times, same kinds), and the kinds
are the same sequence at every load.

First, on a fifo pool: the *idle latency* of each (size, steps) (alone on an idle engine,
``--repeats`` times, the median) and the *capacity* (requests completed per second by a
closed loop that keeps ``4 x max_num_seqs`` requests of the same mix in flight).  The pool's
``max_queue_len`` is what that capacity serves in about 1 s (at least 4) unless
``--max-queue-len``.  Then, load by load, each of ``--policies`` (fifo, priority, fair) at
each of ``--loads`` (0.7, 1.0, 2.0 times the capacity; 1.0 is "at capacity").

Reported per run and class: latency p50 / p95 / p99 of the completed requests (from the
intended arrival time to the terminal output), completed/s, deadline misses -- ``timeouts``
(admitted, then ended by ``RequestTimeoutError``) and ``503 deadline`` (refused at admission
with ``QueueWaitError``: the estimated queue wait already exceeded the deadline) --, ``429``
(``QueueFullError``) and ``failed`` (anything else; must be 0).  The targets, each a row with
``met`` yes / NO:

* ``priority`` at 0.7: the high-priority requests' p95 <= 1.2x the p95 of the same requests'
  idle latencies (each request's kind alone on an idle engine);
* ``fair`` at 0.7: each class's p99 <= 2x the p99 of its *share-proportional ideal*: a
  request's idle latency times the number of classes competing when it arrived (the classes
  with a request in flight, its own included): with ``k`` classes backlogged a fair engine
  gives each ``1/k`` of its time;
* every policy at 2.0: the admitted requests' p99 <= 1.5x that policy's p99 at 1.0, with
  429s > 0 and timeouts <= 1 % of the admitted requests (the excess is refused, not timed out).

``--plot FILE`` draws the p50 and p95 per class per policy at 0.7 (and 2.0) as a PNG, with PIL.
"""

from __future__ import annotations

import argparse
import math
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._core.policy import SCHEDULING_POLICIES
from .harness import Progress, Report, csv_arg, percentile, run_in_trio

__all__ = [
    "CLASSES",
    "Arrival",
    "Kind",
    "Outcome",
    "add_arguments",
    "draw_kind",
    "evaluate_targets",
    "make_trace",
    "run",
    "summarise_run",
]

SIZES = (32, 64)
STEPS = (4, 16)
HIGH, LOW = 0, 5
HIGH_PROBABILITY = 0.2
DEADLINE_PROBABILITY = 0.2
DEADLINE_FACTOR = 4.0  # a deadline is this many times its kind's idle latency
CLASSES = ("high/32", "high/64", "low/32", "low/64")
SHAPES = tuple((size, steps) for size in SIZES for steps in STEPS)
DEFAULT_LOADS = (0.7, 1.0, 2.0)
STEP_COSTS = ("flat", "pixels")
TARGET_LOAD, AT_CAPACITY, OVERLOAD = 0.7, 1.0, 2.0
PRIORITY_TARGET = 1.2  # high p95 at 0.7 over its idle p95
FAIR_TARGET = 2.0  # class p99 at 0.7 over its share-proportional ideal p99
OVERLOAD_TARGET = 1.5  # admitted p99 at 2.0 over p99 at 1.0
TIMEOUT_SHARE = 0.01  # "timeouts stay ~0": at most this share of the admitted requests
CLOSED_LOOP_PER_SLOT = 4  # capacity: requests kept in flight per max_num_seqs
QUEUE_SECONDS = 1.0  # default max_queue_len: what the capacity serves in this long
DRAIN_CAP_S = 60.0  # a run's requests must end within this after its last arrival
PROMPT = "policy bench"
OUTCOMES = ("completed", "timeout", "refused_deadline", "refused_full", "failed")


# -- the trace (pure) ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Kind:
    """What a request asks for: its image size, step count and priority."""

    size: int
    steps: int
    priority: int

    @property
    def shape(self) -> tuple[int, int]:
        """(size, steps): what its idle latency depends on."""
        return self.size, self.steps

    @property
    def cls(self) -> str:
        """Its class for the statistics: ``"high/32"`` ... ``"low/64"``."""
        return f"{'high' if self.priority == HIGH else 'low'}/{self.size}"


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request of the trace: ``at_s`` seconds after the run starts."""

    index: int
    at_s: float
    kind: Kind
    has_deadline: bool


def draw_kind(rng: random.Random) -> tuple[Kind, bool]:
    """One request's kind and whether it carries a deadline, drawn from ``rng`` (four draws,
    always, so a sequence of kinds depends on the seed alone)."""
    size = SIZES[rng.random() < 0.5]
    steps = STEPS[rng.random() < 0.5]
    priority = HIGH if rng.random() < HIGH_PROBABILITY else LOW
    has_deadline = rng.random() < DEADLINE_PROBABILITY
    return Kind(size, steps, priority), has_deadline


def make_trace(rate: float, duration_s: float, seed: int) -> list[Arrival]:
    """Poisson arrivals at ``rate`` per second over ``[0, duration_s)``, kinds seeded.

    Arrival times and kinds come from two generators derived from ``seed``: the same seed
    gives the same kinds in the same order at every rate, and the same list (times too) at
    the same rate.  Raises :class:`ValueError` for a rate or duration that is not > 0.
    """
    if not rate > 0 or not math.isfinite(rate):
        raise ValueError(f"rate must be a finite number > 0, got {rate!r}")
    if not duration_s > 0 or not math.isfinite(duration_s):
        raise ValueError(f"duration_s must be a finite number > 0, got {duration_s!r}")
    times = random.Random(f"policy-times-{seed}")
    kinds = random.Random(f"policy-kinds-{seed}")
    arrivals: list[Arrival] = []
    at = times.expovariate(rate)
    while at < duration_s:
        kind, has_deadline = draw_kind(kinds)
        arrivals.append(Arrival(len(arrivals), at, kind, has_deadline))
        at += times.expovariate(rate)
    return arrivals


# -- the statistics (pure) -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one request of a run ended.

    ``status`` is one of :data:`OUTCOMES`; ``latency_s`` (completed only) runs from its
    intended arrival time to its terminal output; ``competing`` is the number of classes with
    a request in flight when it arrived, its own included.
    """

    arrival: Arrival
    status: str
    latency_s: float | None = None
    competing: int = 1
    error: str | None = None


def _tail_ms(samples_s: Sequence[float]) -> dict[str, float] | None:
    if not samples_s:
        return None
    return {f"p{q}": percentile(samples_s, q) * 1000.0 for q in (50, 95, 99)}


def summarise_group(
    outcomes: Sequence[Outcome], idle_s: Mapping[tuple[int, int], float], span_s: float
) -> dict[str, Any]:
    """The figures of a group of outcomes (one class, or several): counts by status,
    completed/s over ``span_s``, latency p50 / p95 / p99 (ms) of the completed ones, and the
    same percentiles of their idle latencies and of their share-proportional ideals."""
    counts = Counter(o.status for o in outcomes)
    done = [o for o in outcomes if o.status == "completed" and o.latency_s is not None]
    latencies = [o.latency_s for o in done if o.latency_s is not None]
    idle = [idle_s[o.arrival.kind.shape] for o in done]
    ideal = [idle_s[o.arrival.kind.shape] * o.competing for o in done]
    return {
        "requests": len(outcomes),
        **{status: counts.get(status, 0) for status in OUTCOMES},
        "admitted": sum(counts.get(s, 0) for s in ("completed", "timeout", "failed")),
        "completed_per_s": len(done) / span_s if span_s > 0 else 0.0,
        "latency_ms": _tail_ms(latencies),
        "idle_ms": _tail_ms(idle),
        "ideal_ms": _tail_ms(ideal),
    }


def summarise_run(
    outcomes: Sequence[Outcome], idle_s: Mapping[tuple[int, int], float], span_s: float
) -> dict[str, Any]:
    """Per class (:data:`CLASSES`), ``"high"`` (both high classes) and ``"all"``:
    :func:`summarise_group`.  ``idle_s`` maps every (size, steps) to its idle latency."""
    groups: dict[str, list[Outcome]] = {name: [] for name in (*CLASSES, "high", "all")}
    for outcome in outcomes:
        groups[outcome.arrival.kind.cls].append(outcome)
        if outcome.arrival.kind.priority == HIGH:
            groups["high"].append(outcome)
        groups["all"].append(outcome)
    return {name: summarise_group(group, idle_s, span_s) for name, group in groups.items()}


def _find_load(loads: Iterable[float], wanted: float) -> float | None:
    return next((load for load in loads if math.isclose(load, wanted)), None)


def _p(group: Mapping[str, Any], figure: str, q: str) -> float | None:
    tail = group.get(figure)
    return None if tail is None else float(tail[q])


def evaluate_targets(runs: Mapping[float, Mapping[str, Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """The issue's targets over ``runs[load][policy]`` (each a :func:`summarise_run`).

    One dict per target: ``policy``, ``load``, ``class``, ``figure``, ``value``, ``limit``,
    ``text`` and ``met`` (False also when there was nothing to measure).  A target whose
    policy or load was not run is left out.
    """
    targets: list[dict[str, Any]] = []
    low = _find_load(runs, TARGET_LOAD)
    if low is not None and "priority" in runs[low]:
        group = runs[low]["priority"]["high"]
        value, idle = _p(group, "latency_ms", "p95"), _p(group, "idle_ms", "p95")
        limit = None if idle is None else PRIORITY_TARGET * idle
        targets.append(
            {
                "policy": "priority",
                "load": low,
                "class": "high",
                "figure": "p95 ms",
                "value": value,
                "limit": limit,
                "text": f"p95 <= {PRIORITY_TARGET:g}x idle p95"
                + ("" if idle is None else f" = {limit:.0f} ms"),
                "met": value is not None and limit is not None and value <= limit,
            }
        )
    if low is not None and "fair" in runs[low]:
        for name in CLASSES:
            group = runs[low]["fair"][name]
            value, ideal = _p(group, "latency_ms", "p99"), _p(group, "ideal_ms", "p99")
            limit = None if ideal is None else FAIR_TARGET * ideal
            targets.append(
                {
                    "policy": "fair",
                    "load": low,
                    "class": name,
                    "figure": "p99 ms",
                    "value": value,
                    "limit": limit,
                    "text": f"p99 <= {FAIR_TARGET:g}x ideal p99"
                    + ("" if ideal is None else f" = {limit:.0f} ms"),
                    "met": value is not None and limit is not None and value <= limit,
                }
            )
    at, over = _find_load(runs, AT_CAPACITY), _find_load(runs, OVERLOAD)
    if at is not None and over is not None:
        for policy in runs[over]:
            if policy not in runs[at]:
                continue
            group = runs[over][policy]["all"]
            value = _p(group, "latency_ms", "p99")
            base = _p(runs[at][policy]["all"], "latency_ms", "p99")
            limit = None if base is None else OVERLOAD_TARGET * base
            p99_ok = value is not None and limit is not None and value <= limit
            refused_ok = group["refused_full"] > 0
            timeouts_ok = group["timeout"] <= TIMEOUT_SHARE * max(1, group["admitted"])
            missed = [
                what
                for what, ok in (("p99", p99_ok), ("no 429", refused_ok), ("timeouts", timeouts_ok))
                if not ok
            ]
            targets.append(
                {
                    "policy": policy,
                    "load": over,
                    "class": "all",
                    "figure": "p99 ms",
                    "value": value,
                    "limit": limit,
                    "text": f"p99 <= {OVERLOAD_TARGET:g}x @{at:g}"
                    + ("" if limit is None else f" = {limit:.0f} ms")
                    + f"; 429 > 0; timeouts <= {TIMEOUT_SHARE:.0%}",
                    "met": not missed,
                    "missed": missed,
                    "p99_met": p99_ok,
                    "refused_full_met": refused_ok,
                    "timeouts_met": timeouts_ok,
                }
            )
    return targets


# -- the command line ----------------------------------------------------------------------


def _policies(text: str) -> tuple[str, ...]:
    policies = csv_arg(text)
    bad = [p for p in policies if p not in SCHEDULING_POLICIES]
    if not policies or bad or len(set(policies)) != len(policies):
        raise argparse.ArgumentTypeError(
            f"policies are {', '.join(SCHEDULING_POLICIES)} (each once), got {text!r}"
        )
    return policies


def _loads(text: str) -> tuple[float, ...]:
    try:
        loads = tuple(float(v) for v in csv_arg(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    if not loads or any(not (0 < v < math.inf) for v in loads):
        raise argparse.ArgumentTypeError(f"loads must be numbers > 0, got {text!r}")
    return loads


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--policies",
        type=_policies,
        default=SCHEDULING_POLICIES,
        help="scheduling policies to compare (default fifo,priority,fair)",
    )
    parser.add_argument(
        "--loads",
        type=_loads,
        default=DEFAULT_LOADS,
        help="offered loads, multiples of the measured capacity (default 0.7,1.0,2.0)",
    )
    parser.add_argument(
        "--duration-s",
        type=float,
        default=None,
        help="seconds of arrivals per run (default 20; --quick: 0.5)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the trace (default 0)")
    parser.add_argument(
        "--step-delay-ms",
        type=float,
        default=None,
        help="echo's sleep per denoising step (default 20; --quick: 2)",
    )
    parser.add_argument(
        "--step-cost",
        choices=STEP_COSTS,
        default="flat",
        help="flat: every step sleeps --step-delay-ms whatever the size (default); pixels: a "
        "step sleeps that x (size / 32)^2, as a real model's step grows with its pixels",
    )
    parser.add_argument("--max-num-seqs", type=int, default=2, help="engine batch (default 2)")
    parser.add_argument(
        "--priority-aging-ticks",
        type=int,
        default=None,
        help="the engine's priority_aging_ticks (default: the engine's default, 16)",
    )
    parser.add_argument(
        "--max-queue-len",
        type=int,
        default=None,
        help="the pool's in-flight bound (default: what the capacity serves in ~1 s, >= 4)",
    )
    parser.add_argument(
        "--capacity-s",
        type=float,
        default=None,
        help="seconds of the closed-loop capacity measurement (default 10; --quick: 0.5)",
    )
    parser.add_argument(
        "--plot", metavar="FILE", default=None, help="draw latency per class per policy (PNG)"
    )
    parser.add_argument(
        "--torch-threads", type=int, default=1, help="torch threads of the worker (default 1)"
    )


# -- running ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Setup:
    policies: tuple[str, ...]
    loads: tuple[float, ...]
    duration_s: float
    seed: int
    step_delay_s: float
    step_cost: str
    max_num_seqs: int
    priority_aging_ticks: int | None
    max_queue_len: int | None
    capacity_s: float
    idle_repeats: int
    warmup: int
    torch_threads: int
    progress: bool


def _setup(args: argparse.Namespace) -> _Setup:
    quick: bool = args.quick
    duration = args.duration_s if args.duration_s is not None else (0.5 if quick else 20.0)
    delay_ms = args.step_delay_ms if args.step_delay_ms is not None else (2.0 if quick else 20.0)
    capacity_s = args.capacity_s if args.capacity_s is not None else (0.5 if quick else 10.0)
    repeats = args.repeats if args.repeats is not None else (2 if quick else 5)
    warmup = 1 if args.warmup is None else args.warmup
    if not duration > 0 or not capacity_s > 0:
        raise ValueError("--duration-s and --capacity-s must be > 0")
    if not delay_ms >= 0:
        raise ValueError("--step-delay-ms must be >= 0")
    if args.max_num_seqs < 1 or repeats < 1 or args.torch_threads < 1:
        raise ValueError("--max-num-seqs, --repeats and --torch-threads must be >= 1")
    if args.max_queue_len is not None and args.max_queue_len < 1:
        raise ValueError("--max-queue-len must be >= 1")
    aging = getattr(args, "priority_aging_ticks", None)
    if aging is not None and aging < 1:
        raise ValueError("--priority-aging-ticks must be >= 1")
    return _Setup(
        policies=tuple(args.policies),
        loads=tuple(args.loads),
        duration_s=duration,
        seed=args.seed,
        step_delay_s=delay_ms / 1000.0,
        step_cost=args.step_cost,
        max_num_seqs=args.max_num_seqs,
        priority_aging_ticks=aging,
        max_queue_len=args.max_queue_len,
        capacity_s=capacity_s,
        idle_repeats=repeats,
        warmup=max(0, warmup),
        torch_threads=args.torch_threads,
        progress=not args.no_progress,
    )


def _params(kind: Kind, seed: int, setup: _Setup, deadline_s: float | None = None) -> Any:
    """The request of ``kind``; with ``--step-cost pixels`` its echo steps sleep the step
    delay x (size / smallest size)^2."""
    from .._core.request import SamplingParams
    from ..models.echo import ECHO_STEP_DELAY_S

    extra = {}
    if setup.step_cost == "pixels":
        extra[ECHO_STEP_DELAY_S] = setup.step_delay_s * (kind.size / SIZES[0]) ** 2
    return SamplingParams(
        height=kind.size,
        width=kind.size,
        num_inference_steps=kind.steps,
        seed=seed,
        output_type="np",
        priority=kind.priority,
        deadline_s=deadline_s,
        extra_args=extra,
    )


async def _final(submission: Any) -> Any:
    """The terminal output of a pool submission (its stream is closed on the way out)."""
    async with submission.stream as stream:
        async for output in stream:
            if output.finished:
                return output
    raise RuntimeError("a request stream ended without a terminal output")  # pragma: no cover


async def _serving(pool: Any, body: Any) -> Any:
    """Run ``await body()`` while ``pool`` serves; close the pool afterwards."""
    import trio

    async with trio.open_nursery() as nursery:
        await nursery.start(pool.serve)
        try:
            return await body()
        finally:
            nursery.cancel_scope.cancel()


async def _measure_baseline(
    setup: _Setup, config: Any, report: Report
) -> tuple[dict[tuple[int, int], float], dict[str, Any]]:
    """On a fifo pool: the idle latency (median, s) of every (size, steps), then the
    closed-loop capacity."""
    import trio

    from ..serve.pool import EnginePool

    pool = EnginePool(config.replace(scheduling_policy="fifo"), max_queue_len=1_000)
    idle_samples: dict[tuple[int, int], list[float]] = {shape: [] for shape in SHAPES}
    capacity: dict[str, Any] = {}

    async def body() -> None:
        counter = 0

        async def once(kind: Kind) -> float:
            nonlocal counter
            counter += 1
            started = trio.current_time()
            params = _params(kind, counter, setup)
            sub = pool.submit(PROMPT, params, request_id=f"base-{counter}")
            output = await _final(sub)
            output.raise_for_status()
            return trio.current_time() - started

        for _ in range(setup.warmup):
            for size, steps in SHAPES:
                await once(Kind(size, steps, LOW))
        for _ in range(setup.idle_repeats):  # interleaved: every shape once per round
            for size, steps in SHAPES:
                idle_samples[size, steps].append(await once(Kind(size, steps, LOW)))

        rng = random.Random(f"policy-capacity-{setup.seed}")
        finished_at: list[float] = []
        clients = CLOSED_LOOP_PER_SLOT * setup.max_num_seqs
        started = trio.current_time()
        stop = started + setup.capacity_s

        async def client() -> None:
            while trio.current_time() < stop:
                kind, _ = draw_kind(rng)
                await once(kind)
                finished_at.append(trio.current_time())

        with trio.move_on_at(stop):
            async with trio.open_nursery() as nursery:
                for _ in range(clients):
                    nursery.start_soon(client)
        # The first fifth of the window fills the queue; count the rest.
        window_start = started + 0.2 * setup.capacity_s
        counted = [t for t in finished_at if t >= window_start]
        window = stop - window_start
        capacity.update(
            {
                "requests_per_s": len(counted) / window,
                "completed": len(finished_at),
                "counted": len(counted),
                "window_s": window,
                "clients": clients,
            }
        )

    await _serving(pool, body)
    idle = {shape: percentile(samples, 50) for shape, samples in idle_samples.items()}
    report.results["idle_samples_ms"] = {
        _shape_name(shape): [s * 1000.0 for s in samples] for shape, samples in idle_samples.items()
    }
    return idle, capacity


def _shape_name(shape: tuple[int, int]) -> str:
    return f"{shape[0]}px x {shape[1]} steps"


async def _open_loop(
    setup: _Setup,
    config: Any,
    policy: str,
    arrivals: Sequence[Arrival],
    idle_s: Mapping[tuple[int, int], float],
    max_queue_len: int,
    tag: str,
) -> tuple[list[Outcome], float]:
    """Run ``arrivals`` open-loop on a fresh ``policy`` pool; the outcomes and the span (s)
    from the run's start to the last terminal output (or the last arrival)."""
    import trio

    from ..errors import TIMEOUT_ERROR_TYPE
    from ..serve.pool import EnginePool, QueueFullError, QueueWaitError

    pool = EnginePool(config.replace(scheduling_policy=policy), max_queue_len=max_queue_len)
    outcomes: list[Outcome | None] = [None] * len(arrivals)
    in_flight: Counter[str] = Counter()
    last_end = 0.0

    async def body() -> None:
        nonlocal last_end
        start = trio.current_time()

        async def consume(arrival: Arrival, submission: Any, competing: int) -> None:
            nonlocal last_end
            cls = arrival.kind.cls
            try:
                output = await _final(submission)
            except Exception as exc:  # the engine died: a failure, reported, not raised
                outcome = Outcome(arrival, "failed", competing=competing, error=repr(exc))
            else:
                now = trio.current_time()
                if output.ok:
                    latency = now - (start + arrival.at_s)
                    outcome = Outcome(arrival, "completed", latency, competing)
                elif output.error_type == TIMEOUT_ERROR_TYPE:
                    outcome = Outcome(arrival, "timeout", competing=competing)
                else:
                    error = f"{output.status.name}: {output.error_type}: {output.error}"
                    outcome = Outcome(arrival, "failed", competing=competing, error=error)
                last_end = max(last_end, now - start)
            finally:
                in_flight[cls] -= 1
            outcomes[arrival.index] = outcome

        async with trio.open_nursery() as nursery:
            for arrival in arrivals:
                await trio.sleep_until(start + arrival.at_s)
                kind = arrival.kind
                deadline = DEADLINE_FACTOR * idle_s[kind.shape] if arrival.has_deadline else None
                competing = len({c for c, n in in_flight.items() if n > 0} | {kind.cls})
                try:
                    sub = pool.submit(
                        PROMPT,
                        _params(kind, arrival.index, setup, deadline),
                        request_id=f"{tag}-{arrival.index}",
                    )
                except QueueFullError:
                    outcomes[arrival.index] = Outcome(arrival, "refused_full", competing=competing)
                except QueueWaitError:
                    outcomes[arrival.index] = Outcome(
                        arrival, "refused_deadline", competing=competing
                    )
                else:
                    in_flight[kind.cls] += 1
                    nursery.start_soon(consume, arrival, sub, competing)
            # Every admitted request must end (completed or not) within the drain cap.
            with trio.move_on_after(DRAIN_CAP_S):
                await pool.wait_idle()
            nursery.cancel_scope.cancel()
        last_end = max(last_end, arrivals[-1].at_s if arrivals else 0.0)

    await _serving(pool, body)
    done = [
        o if o is not None else Outcome(a, "failed", error="unfinished at the drain cap")
        for o, a in zip(outcomes, arrivals, strict=True)
    ]
    return done, last_end


def _cell(group: Mapping[str, Any]) -> str:
    tail = group["latency_ms"]
    return "-" if tail is None else f"{tail['p50']:.0f} / {tail['p95']:.0f} / {tail['p99']:.0f}"


COLUMNS = [
    "policy",
    "load",
    "class",
    "n",
    "p50 / p95 / p99 ms",
    "done/s",
    "timeouts",
    "503 deadline",
    "429",
    "failed",
    "target",
    "met",
]


def _fill_report(
    report: Report,
    setup: _Setup,
    idle_s: Mapping[tuple[int, int], float],
    capacity: Mapping[str, Any],
    runs: Mapping[float, Mapping[str, Mapping[str, Any]]],
    targets: Sequence[Mapping[str, Any]],
    errors: Sequence[str],
) -> None:
    samples = report.results.get("idle_samples_ms", {})
    for shape in SHAPES:
        ms = samples.get(_shape_name(shape), [])
        report.rows.append(
            {
                "policy": "idle",
                "load": "-",
                "class": _shape_name(shape),
                "n": len(ms),
                "p50 / p95 / p99 ms": f"median {idle_s[shape] * 1000.0:.1f}",
            }
        )
    report.rows.append(
        {
            "policy": "fifo",
            "load": "closed loop",
            "class": "capacity",
            "n": capacity["counted"],
            "done/s": f"{capacity['requests_per_s']:.2f}",
        }
    )
    by_row = {(t["policy"], t["load"], t["class"]): t for t in targets}
    for load, per_policy in runs.items():
        for policy, summary in per_policy.items():
            for name, group in summary.items():
                target = by_row.get((policy, load, name))
                report.rows.append(
                    {
                        "policy": policy,
                        "load": f"{load:g}",
                        "class": name,
                        "n": group["requests"],
                        "p50 / p95 / p99 ms": _cell(group),
                        "done/s": f"{group['completed_per_s']:.2f}",
                        "timeouts": group["timeout"],
                        "503 deadline": group["refused_deadline"],
                        "429": group["refused_full"],
                        "failed": group["failed"],
                        "target": "-" if target is None else target["text"],
                        "met": "-" if target is None else ("yes" if target["met"] else "NO"),
                    }
                )
    for target in targets:
        if target["met"]:
            continue
        value = target["value"]
        shown = "nothing measured" if value is None else f"{value:.0f} ms"
        extra = f" (missed: {', '.join(target['missed'])})" if target.get("missed") else ""
        report.notes.append(
            f"target not met: {target['policy']} at {target['load']:g}, {target['class']}: "
            f"{target['text']}; measured {shown}{extra}"
        )
    skipped = []
    if _find_load(setup.loads, TARGET_LOAD) is None:
        skipped.append(f"the priority and fair targets need load {TARGET_LOAD:g}")
    if _find_load(setup.loads, AT_CAPACITY) is None or _find_load(setup.loads, OVERLOAD) is None:
        skipped.append(f"the overload target needs loads {AT_CAPACITY:g} and {OVERLOAD:g}")
    report.notes.extend(f"not evaluated: {s}" for s in skipped)
    if errors:
        report.notes.append(f"{len(errors)} requests failed; first: {errors[0]}")


async def _main(args: argparse.Namespace, report: Report) -> None:
    from ..config import EngineConfig

    setup = _setup(args)
    aging: dict[str, Any] = {}
    if setup.priority_aging_ticks is not None:
        aging["priority_aging_ticks"] = setup.priority_aging_ticks
    config = EngineConfig(
        model="builtin:echo",
        backend="inproc",
        step_execution=True,
        max_num_seqs=setup.max_num_seqs,
        torch_threads=setup.torch_threads,
        warmup=False,
        model_options={"step_delay_s": setup.step_delay_s},
        **aging,
    )
    report.params.update(
        {
            "model": "builtin:echo",
            "backend": "inproc",
            "step_execution": True,
            "policies": list(setup.policies),
            "loads": list(setup.loads),
            "duration_s": setup.duration_s,
            "seed": setup.seed,
            "step_delay_ms": setup.step_delay_s * 1000.0,
            "step_cost": setup.step_cost,
            "max_num_seqs": setup.max_num_seqs,
            "priority_aging_ticks": config.priority_aging_ticks,
            "torch_threads": setup.torch_threads,
            "sizes": list(SIZES),
            "steps": list(STEPS),
            "priorities": {"high": HIGH, "low": LOW},
            "high_probability": HIGH_PROBABILITY,
            "deadline_probability": DEADLINE_PROBABILITY,
            "deadline_factor": DEADLINE_FACTOR,
            "capacity_s": setup.capacity_s,
            "idle_repeats": setup.idle_repeats,
            "warmup_rounds": setup.warmup,
            "quick": bool(args.quick),
        }
    )
    idle_s, capacity = await _measure_baseline(setup, config, report)
    rate = capacity["requests_per_s"]
    if not rate > 0:
        raise RuntimeError("the capacity measurement completed no request")
    max_queue_len = setup.max_queue_len or max(4, round(rate * QUEUE_SECONDS))
    report.params["max_queue_len"] = max_queue_len
    runs: dict[float, dict[str, dict[str, Any]]] = {}
    offered: dict[str, Any] = {}
    errors: list[str] = []
    total = len(setup.loads) * len(setup.policies)
    with Progress(total, "policy", enabled=setup.progress) as bar:
        for load in setup.loads:  # policies side by side at each load: same arrivals
            arrivals = make_trace(load * rate, setup.duration_s, setup.seed)
            offered[f"{load:g}"] = {
                "rate_per_s": load * rate,
                "requests": len(arrivals),
                "with_deadline": sum(a.has_deadline for a in arrivals),
                "by_class": dict(Counter(a.kind.cls for a in arrivals)),
            }
            runs[load] = {}
            for policy in setup.policies:
                outcomes, span = await _open_loop(
                    setup, config, policy, arrivals, idle_s, max_queue_len, f"{policy}-{load:g}"
                )
                runs[load][policy] = summarise_run(outcomes, idle_s, span)
                errors.extend(o.error for o in outcomes if o.status == "failed" and o.error)
                bar.advance()
    targets = evaluate_targets(runs)
    report.results.update(
        {
            "capacity": dict(capacity),
            "idle_ms": {_shape_name(s): v * 1000.0 for s, v in idle_s.items()},
            "max_queue_len": max_queue_len,
            "offered": offered,
            "runs": {f"{load:g}": per_policy for load, per_policy in runs.items()},
            "targets": targets,
            "all_targets_met": all(t["met"] for t in targets),
            "failed": len(errors),
        }
    )
    _fill_report(report, setup, idle_s, capacity, runs, targets, errors)
    report.columns = COLUMNS
    if args.plot:
        draw_plot(runs, args.plot, setup.policies)
        report.notes.append(f"plot written to {args.plot}")


def run(args: argparse.Namespace, command: str) -> Report:
    report = Report(experiment="policy", command=command)
    return run_in_trio(report, _main, args, torch_threads=args.torch_threads)


# -- the plot ----------------------------------------------------------------------------------

_COLOURS = {
    "high/32": (214, 96, 77),
    "high/64": (178, 24, 43),
    "low/32": (103, 169, 207),
    "low/64": (33, 102, 172),
}


def _nice_step(top: float, ticks: int = 5) -> float:
    """A round tick step (1, 2 or 5 times a power of ten) giving at most ``ticks`` ticks."""
    raw = max(top, 1e-9) / ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def plot_data(
    runs: Mapping[float, Mapping[str, Mapping[str, Any]]],
) -> dict[float, dict[str, dict[str, tuple[float, float] | None]]]:
    """``{load: {policy: {class: (p50 ms, p95 ms) or None}}}`` for the plotted loads
    (0.7 and 2.0 where they ran; else the first load)."""
    loads = [x for x in (_find_load(runs, TARGET_LOAD), _find_load(runs, OVERLOAD)) if x]
    if not loads and runs:
        loads = [next(iter(runs))]
    data: dict[float, dict[str, dict[str, tuple[float, float] | None]]] = {}
    for load in loads:
        data[load] = {}
        for policy, summary in runs[load].items():
            data[load][policy] = {}
            for name in CLASSES:
                tail = summary[name]["latency_ms"]
                data[load][policy][name] = None if tail is None else (tail["p50"], tail["p95"])
    return data


def draw_plot(
    runs: Mapping[float, Mapping[str, Mapping[str, Any]]],
    path: str | Path,
    policies: Sequence[str],
) -> None:
    """Draw p95 bars (p50 as a black tick) per class, grouped per policy, one panel per
    plotted load (see :func:`plot_data`), and write the PNG to ``path``."""
    from PIL import Image, ImageDraw, ImageFont

    data = plot_data(runs)
    panel_w, panel_h, top_pad, bottom_pad, left_pad = 520, 420, 70, 60, 70
    width = max(1, len(data)) * panel_w
    height = panel_h + 70
    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=14)
    small = ImageFont.load_default(size=12)
    title = ImageFont.load_default(size=16)
    draw.text(
        (10, 8),
        "bench policy: latency per class (bar: p95, black tick: p50), builtin:echo, step mode",
        fill="black",
        font=title,
    )
    for index, (load, per_policy) in enumerate(data.items()):
        x0 = index * panel_w + left_pad
        x1 = (index + 1) * panel_w - 20
        y0, y1 = top_pad, panel_h - bottom_pad + top_pad
        values = [v[1] for p in per_policy.values() for v in p.values() if v is not None]
        top = max(values, default=1.0) * 1.1
        step = _nice_step(top)
        top = step * math.ceil(top / step)
        draw.text((x0, y0 - 28), f"load {load:g} x capacity", fill="black", font=font)
        draw.line([(x0, y0), (x0, y1), (x1, y1)], fill="black", width=1)
        tick = 0.0
        while tick <= top + 1e-9:
            y = y1 - (y1 - y0) * tick / top
            draw.line([(x0 - 4, y), (x0, y)], fill="black")
            draw.line([(x0 + 1, y), (x1, y)], fill=(225, 225, 225))
            draw.text((x0 - 8, y), f"{tick:g}", fill="black", font=small, anchor="rm")
            tick += step
        draw.text((x0 - 60, y0 - 14), "ms", fill="black", font=small)
        shown = [p for p in policies if p in per_policy]
        group_w = (x1 - x0) / max(1, len(shown))
        bar_w = group_w * 0.8 / len(CLASSES)
        for g, policy in enumerate(shown):
            gx = x0 + g * group_w + group_w * 0.1
            for c, name in enumerate(CLASSES):
                bx = gx + c * bar_w
                value = per_policy[policy].get(name)
                if value is None:
                    draw.text((bx + bar_w / 2, y1 - 8), "-", fill="black", font=small, anchor="mm")
                    continue
                p50, p95 = value
                yb = y1 - (y1 - y0) * p95 / top
                draw.rectangle([bx + 1, yb, bx + bar_w - 1, y1 - 1], fill=_COLOURS[name])
                ym = y1 - (y1 - y0) * p50 / top
                draw.line([(bx + 1, ym), (bx + bar_w - 1, ym)], fill="black", width=3)
            draw.text((gx + group_w * 0.4, y1 + 14), policy, fill="black", font=font, anchor="mm")
    legend_y = height - 28
    lx = 10
    for name in CLASSES:
        draw.rectangle([lx, legend_y, lx + 16, legend_y + 16], fill=_COLOURS[name])
        draw.text((lx + 22, legend_y + 8), name, fill="black", font=font, anchor="lm")
        lx += 110
    draw.text(
        (lx + 10, legend_y + 8),
        "class = priority (high 0 / low 5) / size (px)",
        fill="black",
        font=font,
        anchor="lm",
    )
    target = Path(path)
    if target.parent and not target.parent.exists():
        target.parent.mkdir(parents=True)
    image.save(target, format="PNG")
