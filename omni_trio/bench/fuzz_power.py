"""``bench fuzz-power``: the fuzzer's mutation score, on planted bugs that ship with it.

Each mutant (``omni_trio.testing.mutants``: a plausible one-line bug, planted by patching the
runtime in-process) gets its own bounded campaign, ``omni-trio fuzz --mutant NAME`` in a fresh
process (so one mutant's leftovers never reach the next), with the same seed for every
mutant.  Reported per mutant: whether the campaign found it within ``--budget`` seconds, the
time to its first failing example (before shrinking), how long the shrink took, the length
of the shrunk reproducer (its rules), the invariants its violations name and whether they
include the one the mutant breaks.  Control runs come first: the same campaign on the real
runtime, once for each set of options the mutants use (step mode, tractor...); each must
find nothing (a finding there is a false alarm, and says so).  Nothing is asserted: the
score is the result; the target is every mutant found within the budget.

Researchers add their own mutants with ``--mutant package.module:attribute`` (a ``Mutant``
object; repeatable): see docs/fuzzing.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .harness import Report, machine_info

__all__ = ["add_arguments", "run"]

DEFAULT_BUDGET_S = 60.0
DEFAULT_SHRINK_LIMIT_S = 60.0
# What a campaign process may take beyond its budget and shrink limit (start, close, writing).
_SLACK_S = 90.0
_INVARIANT = re.compile(r"INV-\d")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mutant",
        action="append",
        default=None,
        metavar="NAME|MODULE:ATTR",
        help="a mutant to score (repeatable; default: every shipped one)",
    )
    parser.add_argument(
        "--list", action="store_true", help="list the shipped mutants and exit (runs nothing)"
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=DEFAULT_BUDGET_S,
        metavar="SECONDS",
        help="campaign time per mutant (the target: found within it)",
    )
    parser.add_argument(
        "--shrink-limit",
        type=float,
        default=DEFAULT_SHRINK_LIMIT_S,
        metavar="SECONDS",
        help="how long a found failure is shrunk at most",
    )
    parser.add_argument("--seed", type=int, default=0, help="the campaign seed of every run")
    parser.add_argument(
        "--steps", type=int, default=None, help="rules per example (the fuzz default)"
    )
    parser.add_argument(
        "--no-control", action="store_true", help="skip the unmutated control campaign"
    )
    parser.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="keep every reproducer under DIR (default: a temporary directory, removed)",
    )
    parser.add_argument("--cache-dir", default=None)


def run(args: argparse.Namespace, command: str) -> Report:
    from ..testing.mutants import MUTANTS, find_mutant

    report = Report(experiment="fuzz-power", command=command)
    report.machine = machine_info(torch_threads=1, device="cpu")
    if args.list:
        report.rows = [
            {
                "mutant": m.name,
                "invariant": m.invariant,
                "options": _options_text(m.options),
                "bug": m.summary,
            }
            for m in MUTANTS
        ]
        return report
    if args.budget <= 0 or args.shrink_limit <= 0:
        raise ValueError("--budget and --shrink-limit must be positive")
    budget = 10.0 if args.quick else args.budget
    specs = list(args.mutant) if args.mutant else [m.name for m in MUTANTS]
    if args.quick and not args.mutant:
        specs = specs[:2]
    mutants = []
    for spec in specs:  # a bad name fails before any campaign runs
        try:
            mutants.append(find_mutant(spec))
        except KeyError as exc:  # ValueError passes as it is: both are usage errors
            raise ValueError(exc.args[0] if exc.args else str(exc)) from None
    report.params = {
        "budget_s": budget,
        "shrink_limit_s": args.shrink_limit,
        "seed": args.seed,
        "mutants": len(mutants),
        "control": not args.no_control,
    }
    started = time.monotonic()
    keep = args.out is not None
    root = Path(args.out) if keep else Path(tempfile.mkdtemp(prefix="omni-trio-fuzz-power-"))
    try:
        # One control per set of options the mutants run with: the same campaign on the
        # real runtime must find nothing, or a finding proves nothing about a mutant.
        controls: list[dict[str, Any]] = []
        for mutant in mutants:
            if not args.no_control and dict(mutant.options) not in controls:
                controls.append(dict(mutant.options))
        runs: list[tuple[str, Any, dict[str, Any]]] = [("control", None, c) for c in controls]
        runs += [(spec, m, dict(m.options)) for spec, m in zip(specs, mutants, strict=True)]
        for spec, mutant, options in runs:
            outcome = _campaign(args, budget, None if mutant is None else spec, options, root)
            row: dict[str, Any] = {
                "mutant": f"({spec}: no mutant)" if mutant is None else mutant.name,
                "invariant": "-" if mutant is None else mutant.invariant,
                "options": _options_text(options),
            }
            row.update(outcome)
            row["as planted"] = (
                "-"
                if mutant is None or outcome["found"] != "yes"
                else ("yes" if mutant.invariant in outcome["caught as"] else "no")
            )
            report.rows.append(row)
            print(
                f"fuzz-power: {row['mutant']}: found {row['found']} "
                f"first failure {row['first failure s']} s",
                file=sys.stderr,
                flush=True,
            )
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    report.columns = [
        "mutant",
        "invariant",
        "options",
        "found",
        "first failure s",
        "shrink s",
        "rules",
        "caught as",
        "as planted",
    ]
    scored = [r for r in report.rows if r["invariant"] != "-"]
    found = [r for r in scored if r["found"] == "yes"]
    report.results = {
        "found": len(found),
        "mutants": len(scored),
        "score": round(len(found) / len(scored), 3) if scored else None,
        "slowest_first_failure_s": max(
            (r["first failure s"] for r in found if isinstance(r["first failure s"], float)),
            default=None,
        ),
        "control_clean": all(r["found"] == "no" for r in report.rows if r["invariant"] == "-"),
    }
    report.notes.append(f"score: {len(found)} of {len(scored)} mutants found within {budget:g} s")
    missed = [r["mutant"] for r in scored if r["found"] != "yes"]
    if missed:
        report.notes.append("target missed: not found: " + ", ".join(missed))
    if not report.results["control_clean"]:
        report.notes.append("FALSE ALARM: the unmutated runtime failed its campaign")
    report.duration_s = time.monotonic() - started
    return report


def _options_text(options: Any) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(dict(options).items())) or "defaults"


# MachineOptions fields a mutant may set, and the fuzz flag that sets each.
_FLAGS = {
    "backend": "--backend",
    "mode": "--mode",
    "worker_start_method": "--start-method",
    "max_num_seqs": "--max-num-seqs",
    "data_parallel_size": "--data-parallel",
    "scheduling_policy": "--scheduling-policy",
}


def _option_flags(options: dict[str, Any]) -> list[str]:
    """``omni-trio fuzz`` flags for a control campaign with a mutant's ``options``."""
    flags: list[str] = []
    for name, value in sorted(options.items()):
        if name == "pictures":
            flags += ["--pictures"] if value else []
        elif name in _FLAGS:
            flags += [_FLAGS[name], str(value)]
        else:
            raise ValueError(f"a control cannot set the mutant option {name}={value!r}")
    return flags


def _campaign(
    args: argparse.Namespace,
    budget: float,
    mutant: str | None,
    options: dict[str, Any],
    root: Path,
) -> dict[str, Any]:
    """One ``omni-trio fuzz`` campaign in a fresh process (``mutant``, which brings its own
    options, or a control with ``options``); what its reproducer says."""
    name = mutant if mutant else "control-" + (_options_text(options) or "defaults")
    out = root / re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    argv = [
        sys.executable,
        "-c",
        "import sys; from omni_trio.cli import main; sys.exit(main(sys.argv[1:]))",
        "fuzz",
        "--duration",
        f"{budget:g}",
        "--seed",
        str(args.seed),
        "--shrink-limit",
        f"{args.shrink_limit:g}",
        "--quiet",
        "--out",
        str(out),
    ]
    argv += ["--mutant", mutant] if mutant is not None else _option_flags(options)
    if args.steps is not None:
        argv += ["--steps", str(args.steps)]
    if args.cache_dir is not None:
        argv += ["--cache-dir", args.cache_dir]
    started = time.monotonic()
    try:
        done = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=budget + args.shrink_limit + _SLACK_S,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            check=False,
        )
    except subprocess.TimeoutExpired:
        return _row("timeout", None, None, None, f"no answer in {time.monotonic() - started:.0f} s")
    wall = time.monotonic() - started
    if done.returncode == 0:
        return _row("no", None, None, None, "-")
    if done.returncode != 1:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return _row("error", None, None, None, f"exit {done.returncode}: {tail[:80]}")
    found = sorted(out.glob("*/reproducer.json"))
    if not found:
        return _row("yes", None, None, None, "(no reproducer written)")
    record = json.loads(found[-1].read_text("utf-8"))
    campaign = record.get("campaign") or {}
    first = campaign.get("first_failure_s")
    elapsed = campaign.get("elapsed_s")
    shrink = None if first is None or elapsed is None else round(float(elapsed) - float(first), 1)
    failure = record.get("failure") or {}
    # A flaky failure's message is Hypothesis' own: the violations are in violations.txt.
    violations = found[-1].parent / "violations.txt"
    message = str(failure.get("message", ""))
    if violations.is_file():
        message += violations.read_text("utf-8")
    caught = sorted(set(_INVARIANT.findall(message))) or [
        str((record.get("failure") or {}).get("type", "?"))
    ]
    within = first is not None and float(first) <= budget
    return _row(
        "yes" if within else "late",
        None if first is None else round(float(first), 1),
        shrink if shrink is not None else round(wall, 1),
        _rule_count(record.get("steps") or ()),
        ",".join(caught),
    )


def _rule_count(steps: Any) -> int:
    """The rules of a reproducer's steps (not the machine's creation, the per-rule invariant
    checks Hypothesis lists, or the teardown)."""
    return sum(
        1
        for step in steps
        if ".no_violation_so_far()" not in step
        and not str(step).startswith("state = ")
        and step != "state.teardown()"
    )


def _row(
    found: str, first: float | None, shrink: float | None, steps: int | None, caught: str
) -> dict[str, Any]:
    return {
        "found": found,
        "first failure s": first if first is not None else "-",
        "shrink s": shrink if shrink is not None else "-",
        "rules": steps if steps is not None else "-",
        "caught as": caught,
    }
