"""``bench policy``: the seeded trace, the statistics and targets, and a complete ``--quick``
report (an inproc echo engine: no process is started).  No speed is asserted."""

from __future__ import annotations

import argparse
import itertools
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from omni_trio.bench import add_bench_parser, run_bench
from omni_trio.bench.policy import (
    CLASSES,
    OUTCOMES,
    Arrival,
    Kind,
    Outcome,
    draw_kind,
    evaluate_targets,
    make_trace,
    summarise_group,
    summarise_run,
)

IDLE = {(32, 4): 0.1, (32, 16): 0.4, (64, 4): 0.1, (64, 16): 0.4}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-trio")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser


# -- the trace -------------------------------------------------------------------------------


def test_the_trace_is_seeded_and_the_same_for_every_run_at_a_load() -> None:
    a = make_trace(10.0, 30.0, seed=3)
    assert a == make_trace(10.0, 30.0, seed=3)
    assert a != make_trace(10.0, 30.0, seed=4)
    times = [x.at_s for x in a]
    assert times == sorted(times)
    assert all(0.0 <= t < 30.0 for t in times)
    assert [x.index for x in a] == list(range(len(a)))


def test_the_kinds_do_not_depend_on_the_rate() -> None:
    """The same seed gives the same kinds, in order, at every load: only the times differ."""
    slow = make_trace(5.0, 40.0, seed=1)
    fast = make_trace(20.0, 40.0, seed=1)
    n = min(len(slow), len(fast))
    assert n > 100
    assert [(x.kind, x.has_deadline) for x in slow[:n]] == [
        (x.kind, x.has_deadline) for x in fast[:n]
    ]


def test_the_mix_and_the_arrival_rate() -> None:
    trace = make_trace(50.0, 200.0, seed=0)
    n = len(trace)
    assert abs(n - 10_000) < 400  # Poisson: sd 100
    kinds = Counter(x.kind for x in trace)
    assert {k.size for k in kinds} == {32, 64}
    assert {k.steps for k in kinds} == {4, 16}
    assert {k.priority for k in kinds} == {0, 5}
    high = sum(x.kind.priority == 0 for x in trace) / n
    deadline = sum(x.has_deadline for x in trace) / n
    small = sum(x.kind.size == 32 for x in trace) / n
    short = sum(x.kind.steps == 4 for x in trace) / n
    assert abs(high - 0.2) < 0.02
    assert abs(deadline - 0.2) < 0.02
    assert abs(small - 0.5) < 0.03
    assert abs(short - 0.5) < 0.03
    gaps = [b.at_s - a.at_s for a, b in itertools.pairwise(trace)]
    assert abs(sum(gaps) / len(gaps) - 0.02) < 0.002  # mean gap 1 / rate


def test_kind_classes() -> None:
    assert Kind(32, 4, 0).cls == "high/32"
    assert Kind(64, 16, 5).cls == "low/64"
    assert Kind(64, 16, 5).shape == (64, 16)
    rng = random.Random(0)
    assert {draw_kind(rng)[0].cls for _ in range(500)} == set(CLASSES)


@pytest.mark.parametrize(("rate", "duration"), [(0.0, 1.0), (1.0, 0.0), (float("inf"), 1.0)])
def test_a_bad_trace_is_refused(rate: float, duration: float) -> None:
    with pytest.raises(ValueError):
        make_trace(rate, duration, seed=0)


# -- the statistics ----------------------------------------------------------------------------


def _outcome(
    i: int, kind: Kind, status: str, latency: float | None = None, competing: int = 1
) -> Outcome:
    return Outcome(Arrival(i, 0.0, kind, False), status, latency, competing)


def test_a_group_counts_every_outcome_and_takes_tails_of_the_completed() -> None:
    kind = Kind(32, 4, 0)
    outcomes = [_outcome(i, kind, "completed", 0.1 * (i + 1), competing=2) for i in range(5)]
    outcomes += [
        _outcome(5, kind, "timeout"),
        _outcome(6, kind, "refused_full"),
        _outcome(7, kind, "refused_deadline"),
    ]
    group = summarise_group(outcomes, IDLE, span_s=2.0)
    assert group["requests"] == 8
    assert [group[s] for s in OUTCOMES] == [5, 1, 1, 1, 0]
    assert group["admitted"] == 6  # completed + timed out (+ failed): refusals are not admitted
    assert group["completed_per_s"] == pytest.approx(2.5)
    assert group["latency_ms"]["p50"] == pytest.approx(300.0)
    assert group["latency_ms"]["p95"] == pytest.approx(480.0)  # 400 + 0.8 * 100
    assert group["idle_ms"]["p99"] == pytest.approx(100.0)
    assert group["ideal_ms"]["p99"] == pytest.approx(200.0)  # idle x 2 classes competing


def test_an_empty_group_has_no_tails() -> None:
    group = summarise_group([_outcome(0, Kind(64, 4, 5), "refused_full")], IDLE, span_s=1.0)
    assert group["latency_ms"] is None
    assert group["refused_full"] == 1
    assert group["completed_per_s"] == 0.0


def test_a_run_groups_by_class_high_and_all() -> None:
    outcomes = [
        _outcome(0, Kind(32, 4, 0), "completed", 0.1),
        _outcome(1, Kind(64, 16, 0), "completed", 0.5),
        _outcome(2, Kind(64, 4, 5), "completed", 0.2),
        _outcome(3, Kind(32, 16, 5), "timeout"),
    ]
    run = summarise_run(outcomes, IDLE, span_s=1.0)
    assert set(run) == {*CLASSES, "high", "all"}
    assert [run[c]["requests"] for c in CLASSES] == [1, 1, 1, 1]
    assert run["high"]["requests"] == 2
    assert run["high"]["latency_ms"]["p50"] == pytest.approx(300.0)
    assert run["all"]["requests"] == 4 and run["all"]["timeout"] == 1


def _run_with(latency_s: float, kind: Kind, competing: int = 1, **extra: Outcome) -> Any:
    outcomes = [_outcome(i, kind, "completed", latency_s, competing) for i in range(10)]
    return summarise_run([*outcomes, *extra.values()], IDLE, span_s=1.0)


def test_the_targets() -> None:
    short_high, short_low = Kind(32, 4, 0), Kind(32, 4, 5)
    full = _outcome(99, short_low, "refused_full")
    runs = {
        0.7: {
            # high p95 0.11 s against 1.2 x 0.1 s idle: met
            "priority": _run_with(0.11, short_high),
            # low/32 p99 0.5 s against 2 x (0.1 s x 2 classes): not met
            "fair": _run_with(0.5, short_low, competing=2),
        },
        1.0: {"fifo": _run_with(0.2, short_low), "fair": _run_with(0.2, short_low)},
        2.0: {
            "fifo": _run_with(0.29, short_low, full=full),  # <= 1.5 x 0.2, with a 429: met
            "fair": _run_with(0.31, short_low),  # p99 over, and no 429: not met
        },
    }
    targets = {(t["policy"], t["load"], t["class"]): t for t in evaluate_targets(runs)}
    assert targets["priority", 0.7, "high"]["met"] is True
    assert targets["priority", 0.7, "high"]["limit"] == pytest.approx(120.0)
    assert targets["fair", 0.7, "low/32"]["met"] is False
    assert targets["fair", 0.7, "low/32"]["limit"] == pytest.approx(400.0)
    assert targets["fair", 0.7, "high/32"]["met"] is False  # nothing measured is not a pass
    assert targets["fifo", 2.0, "all"]["met"] is True
    assert targets["fair", 2.0, "all"]["missed"] == ["p99", "no 429"]
    assert len(targets) == 1 + len(CLASSES) + 2


def test_timeouts_miss_the_overload_target() -> None:
    kind = Kind(32, 4, 5)
    extra = {"full": _outcome(90, kind, "refused_full"), "late": _outcome(91, kind, "timeout")}
    runs = {1.0: {"fifo": _run_with(0.2, kind)}, 2.0: {"fifo": _run_with(0.2, kind, **extra)}}
    (target,) = evaluate_targets(runs)
    assert target["missed"] == ["timeouts"]  # 1 of 11 admitted timed out: over 1 %


def test_targets_of_loads_not_run_are_left_out() -> None:
    assert evaluate_targets({0.5: {"fifo": _run_with(0.1, Kind(32, 4, 5))}}) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--policies", "fifo,lottery"],
        ["--policies", "fifo,fifo"],
        ["--loads", "0.7,-1"],
        ["--priority-aging-ticks", "x"],
    ],
)
def test_bad_options_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["bench", "policy", *argv])


# -- a quick run -------------------------------------------------------------------------------


def test_a_quick_run_gives_a_complete_report(tmp_path: Path) -> None:
    target, plot = tmp_path / "policy.json", tmp_path / "policy.png"
    full = [
        "bench",
        "policy",
        "--quick",
        "--no-progress",
        "--json",
        str(target),
        "--plot",
        str(plot),
    ]
    lines: list[str] = []
    code = run_bench(_parser().parse_args(full), argv=["omni-trio", *full], out=lines.append)
    out = "\n".join(lines)
    assert code == 0, out
    data = json.loads(target.read_text())
    assert data["experiment"] == "policy"
    assert data["params"]["quick"] is True
    assert data["params"]["priority_aging_ticks"] == 16  # the engine's default
    assert data["machine"]["torch_threads"] == 1
    results = data["results"]
    assert results["capacity"]["requests_per_s"] > 0
    assert set(results["idle_ms"]) == {
        f"{size}px x {steps} steps" for size in (32, 64) for steps in (4, 16)
    }
    assert results["max_queue_len"] >= 4
    assert set(results["runs"]) == {"0.7", "1", "2"}
    for load, per_policy in results["runs"].items():
        offered = results["offered"][load]["requests"]
        assert set(per_policy) == {"fifo", "priority", "fair"}
        for policy, summary in per_policy.items():
            assert set(summary) == {*CLASSES, "high", "all"}
            every = summary["all"]
            assert every["requests"] == offered  # every arrival has exactly one outcome
            assert sum(every[s] for s in OUTCOMES) == offered
            assert sum(summary[c]["requests"] for c in CLASSES) == offered
            assert every["failed"] == 0, (load, policy)
            assert every["completed"] > 0
    assert len(results["targets"]) == 1 + len(CLASSES) + 3
    assert all(isinstance(t["met"], bool) for t in results["targets"])
    assert results["failed"] == 0
    # idle rows, the capacity row, and 6 rows per (policy, load)
    assert len(data["rows"]) == 4 + 1 + 3 * 3 * 6
    assert "| policy" in out and "p50 / p95 / p99 ms" in out
    with Image.open(plot) as image:
        assert image.format == "PNG"
        assert image.size[0] > image.size[1] > 100


def test_with_pixel_step_cost_a_larger_picture_takes_longer(tmp_path: Path) -> None:
    """``--step-cost pixels``: echo's steps sleep the delay x (size / 32)^2, as a real
    model's grow with the pixel count, so a 64-px request's idle latency is well over a
    32-px one's (4x the sleep; the default flat cost makes them equal)."""
    target = tmp_path / "policy.json"
    full = ["bench", "policy", "--quick", "--no-progress", "--step-cost", "pixels"]
    full += ["--policies", "fair", "--loads", "0.7", "--json", str(target)]
    full += ["--priority-aging-ticks", "4"]
    lines: list[str] = []
    code = run_bench(_parser().parse_args(full), argv=["omni-trio", *full], out=lines.append)
    assert code == 0, "\n".join(lines)
    data = json.loads(target.read_text())
    assert data["params"]["step_cost"] == "pixels"
    assert data["params"]["priority_aging_ticks"] == 4
    idle = data["results"]["idle_ms"]
    assert idle["64px x 16 steps"] > 1.5 * idle["32px x 16 steps"], idle
