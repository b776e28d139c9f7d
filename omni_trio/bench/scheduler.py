"""``bench scheduler``: per-tick cost of ``schedule()`` + ``update_from_output()`` vs queue length.

For each mode (request, step) and each queue length (10, 1 000, 100 000 waiting requests) a
scheduler is filled and then ticked with a fixed wave (``--wave`` requests per batch): a tick
is one ``schedule(now)`` plus one ``update_from_output(...)`` with a synthetic result for every
scheduled request, exactly what the engine loop does around an execute.  Only those two calls
are timed; building the fake runner output, popping finished states and topping the queue
back up to its length happen between timed sections, so the queue length stays fixed.

The queue lengths run interleaved (a block of ticks per length, round after round) and each
length's cost is compared with the shortest queue's block by block (ratio of block medians,
so a tick the hypervisor preempted does not decide the comparison).  The garbage collector is
off inside timed blocks (as in ``timeit``) unless ``--gc``: a collection's cost scales with
the whole heap, not with the scheduler's algorithm.  Target: flat within 2x from 10 to
100 000 waiting requests.
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .._core.messages import BatchRunnerOutput, RunnerOutput, SchedulerOutput
from .._core.policy import SCHEDULING_POLICIES, SchedulingPolicy
from .._core.request import DiffusionRequest, SamplingParams
from .._core.scheduler import RequestScheduler, Scheduler, StepScheduler
from .harness import Progress, Report, Summary, machine_info, pair_ratios

__all__ = ["add_arguments", "run"]

DEFAULT_QUEUE_LENGTHS = (10, 1_000, 100_000)
QUICK_QUEUE_LENGTHS = (10, 1_000)
FLATNESS_TARGET = 2.0


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v.replace("_", "")) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in ("request", "step")]
    if not modes or bad:
        raise argparse.ArgumentTypeError(f"modes are 'request' and 'step', got {text!r}")
    return modes


def _policies(text: str) -> tuple[str, ...]:
    policies = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in policies if m not in SCHEDULING_POLICIES]
    if not policies or bad:
        raise argparse.ArgumentTypeError(
            f"policies are {', '.join(SCHEDULING_POLICIES)}, got {text!r}"
        )
    return policies


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--queue-lengths",
        type=_int_list,
        default=None,
        help="waiting-queue lengths to compare (default 10,1000,100000; --quick: 10,1000)",
    )
    parser.add_argument(
        "--modes", type=_modes, default=("request", "step"), help="request,step (default both)"
    )
    parser.add_argument(
        "--policies",
        type=_policies,
        default=("fifo",),
        help="scheduling policies to measure: fifo,priority,fair (default fifo); priority "
        "gets three priority levels, fair two image sizes (two classes)",
    )
    parser.add_argument("--wave", type=int, default=8, help="max_num_seqs: requests per tick")
    parser.add_argument(
        "--steps", type=int, default=4, help="denoising steps per request (step mode)"
    )
    parser.add_argument("--ticks", type=int, default=None, help="ticks per block (default 500)")
    parser.add_argument(
        "--gc", action="store_true", help="leave the garbage collector on in timed blocks"
    )


@dataclass
class _Bench:
    """One scheduler held at a fixed queue length, ticked in blocks."""

    mode: str
    queue_length: int
    wave: int
    steps: int
    policy: SchedulingPolicy = "fifo"
    scheduler: Scheduler = field(init=False)
    _next_id: int = 0
    _now: float = 0.0
    _params: list[SamplingParams] = field(init=False)

    def __post_init__(self) -> None:
        if self.mode == "step":
            self.scheduler = StepScheduler(self.wave, policy=self.policy)
        else:
            self.scheduler = RequestScheduler(self.wave, policy=self.policy)
        base = SamplingParams(
            height=64, width=64, num_inference_steps=self.steps, seed=0, output_type="np"
        )
        # What the policy sorts by varies: three priorities, or two classes (sizes).
        if self.policy == "priority":
            self._params = [base.replace(priority=p) for p in (1, 0, -1)]
        elif self.policy == "fair":
            self._params = [base, base.replace(height=32, width=32)]
        else:
            self._params = [base]
        self.top_up()

    def top_up(self) -> None:
        """Add requests until ``queue_length`` are waiting (untimed)."""
        sched = self.scheduler
        params = self._params
        while sched.num_waiting < self.queue_length:
            self._next_id += 1
            sampling = params[self._next_id % len(params)]
            request = DiffusionRequest("p", sampling, f"r{self._next_id}")
            sched.add_request(request, self._now)

    def _result(self, out: SchedulerOutput) -> BatchRunnerOutput:
        """What a worker would return for ``out`` (built outside the timed section)."""
        if self.mode == "request":
            return BatchRunnerOutput(
                {rid: RunnerOutput(rid, images=()) for rid in out.scheduled_request_ids}
            )
        outputs: dict[str, RunnerOutput] = {}
        for rid in out.scheduled_request_ids:
            state = self.scheduler.get_request_state(rid)
            assert state is not None
            done = state.num_computed_steps + 1
            outputs[rid] = RunnerOutput(rid, step_index=done, finished=done >= state.total_steps)
        return BatchRunnerOutput(outputs)

    def block(self, ticks: int, *, keep_gc: bool) -> list[float]:
        """Run ``ticks`` ticks; return each tick's timed cost in seconds."""
        sched = self.scheduler
        clock = time.perf_counter
        costs: list[float] = []
        gc_was_enabled = gc.isenabled()
        if not keep_gc:
            gc.disable()
        try:
            for _ in range(ticks):
                self._now += 0.001
                t0 = clock()
                out = sched.schedule(self._now)
                t1 = clock()
                result = self._result(out)
                t2 = clock()
                finished = sched.update_from_output(out, result, self._now)
                t3 = clock()
                costs.append((t1 - t0) + (t3 - t2))
                for rid in finished:
                    sched.pop_request_state(rid)
                if finished:
                    self.top_up()
        finally:
            if gc_was_enabled:
                gc.enable()
        if sched.num_running == 0 and sched.num_waiting == 0:  # pragma: no cover - bug guard
            raise RuntimeError("scheduler ran dry; the benchmark is not measuring a full wave")
        return costs


def run(args: argparse.Namespace, command: str) -> Report:
    quick: bool = args.quick
    lengths: tuple[int, ...] = args.queue_lengths or (
        QUICK_QUEUE_LENGTHS if quick else DEFAULT_QUEUE_LENGTHS
    )
    modes: tuple[str, ...] = args.modes
    policies: tuple[SchedulingPolicy, ...] = getattr(args, "policies", ("fifo",))
    if args.wave < 1 or args.steps < 1:
        raise ValueError("--wave and --steps must be >= 1")
    ticks = args.ticks or (50 if quick else 500)
    repeats = args.repeats or (3 if quick else 20)
    warmup = 1 if args.warmup is None else args.warmup
    report = Report(
        experiment="scheduler",
        command=command,
        params={
            "modes": list(modes),
            "policies": list(policies),
            "queue_lengths": list(lengths),
            "wave": args.wave,
            "steps": args.steps,
            "ticks_per_block": ticks,
            "repeats": repeats,
            "warmup_rounds": warmup,
            "gc_in_timed_blocks": bool(args.gc),
            "quick": quick,
        },
        machine=machine_info(device="cpu"),
        columns=[
            "mode",
            "policy",
            "waiting",
            "tick us min / median / max",
            "tick us p50 / p90 / p99",
            "ratio vs shortest (min / med / max)",
        ],
    )
    started = time.perf_counter()
    results: dict[str, dict[str, object]] = {}
    total = len(modes) * len(policies) * repeats
    runs = [(mode, policy) for mode in modes for policy in policies]
    with Progress(total, "scheduler", enabled=not args.no_progress) as bar:
        for mode, policy in runs:
            # fifo keeps its old key; the others are "mode/policy".
            name = mode if policy == "fifo" else f"{mode}/{policy}"
            benches = [_Bench(mode, n, args.wave, args.steps, policy) for n in lengths]
            run_block: list[Callable[[], list[float]]] = [
                functools.partial(b.block, ticks, keep_gc=args.gc) for b in benches
            ]
            for _ in range(warmup):
                for fn in run_block:
                    fn()
            samples: list[list[float]] = [[] for _ in benches]
            block_medians: list[list[float]] = [[] for _ in benches]
            for _ in range(repeats):
                for i, fn in enumerate(run_block):  # interleaved: 10, 1000, 100000, 10, ...
                    costs = fn()
                    samples[i].extend(costs)
                    block_medians[i].append(statistics.median(costs))
                bar.advance()
            mode_results: dict[str, object] = {}
            for i, bench in enumerate(benches):
                tick = Summary.of(samples[i]).scaled(1e6)
                ratio = Summary.of(pair_ratios(block_medians[i], block_medians[0]))
                mode_results[str(bench.queue_length)] = {
                    "waiting": bench.queue_length,
                    "tick_us": tick,
                    "ratio_vs_shortest": ratio,
                }
                report.rows.append(
                    {
                        "mode": mode,
                        "policy": policy,
                        "waiting": bench.queue_length,
                        "tick us min / median / max": tick.spread("{:.2f}"),
                        "tick us p50 / p90 / p99": tick.tail("{:.2f}"),
                        "ratio vs shortest (min / med / max)": ratio.spread("{:.2f}"),
                    }
                )
            worst = max(
                Summary.of(pair_ratios(block_medians[i], block_medians[0])).median
                for i in range(len(benches))
            )
            mode_results["worst_median_ratio"] = worst
            mode_results["flat_within_target"] = worst <= FLATNESS_TARGET
            results[name] = mode_results
            if worst > FLATNESS_TARGET:
                report.notes.append(
                    f"{name} mode: per-tick cost grows {worst:.2f}x from {lengths[0]} to "
                    f"{lengths[-1]} waiting requests (target <= {FLATNESS_TARGET}x)"
                )
            del benches, run_block
    report.results = {"modes": results, "target_ratio": FLATNESS_TARGET}
    report.duration_s = time.perf_counter() - started
    return report
