"""``omni-trio fuzz`` (omni_trio/fuzz.py): real campaigns on the inproc backend, a real failure
planted with a FAKE invariant checker (reproducer written, replayed, reproduced while the bug
is there and not once it is gone), flag validation, and docs/fuzzing.md's example.

The campaigns run a real engine on ``builtin:echo``; they are kept to a few short examples.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from omni_trio import fuzz
from omni_trio._core.trace import TraceEvent, TraceKind, TraceRecorder
from omni_trio.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, build_parser, main
from omni_trio.runtime.engine import WARMUP_REQUEST_ID
from omni_trio.testing import machine
from omni_trio.testing.invariants import Violation
from omni_trio.testing.machine import (
    BENIGN_FAULTS,
    FAILING_FAULTS,
    CampaignStats,
    MachineOptions,
    make_engine_machine,
)
from tests.test_readme import python_blocks

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

DOC = Path(__file__).resolve().parent.parent / "docs" / "fuzzing.md"
_SUMMARY = re.compile(
    r"^summary  examples (\d+)  rules (\d+) \([\d.]+/s\)  requests (\d+) \([\d.]+/s\)  "
    r"faults (\d+)  crashes (\d+)  restarts (\d+)  preemptions (\d+)  pictures (\d+)  "
    r"invariant checks (\d+)  "
    r"elapsed [\d.]+ s$",
    re.MULTILINE,
)
# A small, fast machine for the failure path: no faults, no crashes, no reopen.
_PLAIN = ("--no-faults", "--no-crash-rule", "--no-close-rule")


def _fuzz(*args: str, out: Path, cache_dir: Path) -> list[str]:
    return ["fuzz", *args, "--out", str(out), "--cache-dir", str(cache_dir)]


def _summary(text: str) -> dict[str, int]:
    match = _SUMMARY.search(text)
    assert match is not None, text
    names = (
        "examples",
        "rules",
        "requests",
        "faults",
        "crashes",
        "restarts",
        "preemptions",
        "pictures",
        "checks",
    )
    return dict(zip(names, map(int, match.groups()), strict=True))


def _files(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime for p in root.rglob("*")}


def fake_check_trace(events: Iterable[TraceEvent], **_: Any) -> list[Violation]:
    """A FAKE invariant checker with a planted bug: it calls any admitted request (other than
    the engine's own warmup) a violation, so every example with a submit fails, whatever the
    engine's timing -- the verdict depends on the rules alone, so a replay always agrees."""
    for event in events:
        if event.kind is TraceKind.ADMIT and event.request_id != WARMUP_REQUEST_ID:
            return [
                Violation(
                    "INV-1",
                    "FAKE checker: a request was admitted",
                    event.request_id,
                    (event,),
                    event.seq,
                )
            ]
    return []


# -- campaigns ---------------------------------------------------------------------------------


def test_short_campaign_passes_and_prints_the_summary(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "failures"
    argv = _fuzz("--examples", "3", "--steps", "8", "--seed", "3", out=out, cache_dir=cache_dir)
    assert main(argv) == EXIT_OK
    text = capsys.readouterr().out
    assert text.startswith("omni-trio fuzz: inproc/request, 8 steps per example")
    totals = _summary(text)
    assert totals["examples"] >= 3
    assert totals["rules"] > 0 and totals["checks"] > totals["examples"]
    assert "no failure in" in text
    assert not out.exists()  # nothing failed: nothing written


def test_quiet_campaign_prints_only_the_summary(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _fuzz(
        "--examples", "1", "--steps", "3", "--mode", "step", "--quiet",
        out=tmp_path, cache_dir=cache_dir,
    )  # fmt: skip
    assert main(argv) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0] for line in lines] == [
        "summary",
        "paths",
        "no failure in 1 examples",
    ]
    paths = dict(zip(*[iter(lines[1].split()[1:])] * 2, strict=True))
    assert set(paths) == set(machine.PATHS)  # every hard path, with its count


def test_a_planted_bug_is_found_written_and_replayed(
    tmp_path: Path,
    cache_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "failures"
    monkeypatch.setattr(machine, "check_trace", fake_check_trace)
    argv = _fuzz(
        "--examples", "40", "--steps", "6", "--seed", "1", "--no-shrink", *_PLAIN,
        out=out, cache_dir=cache_dir,
    )  # fmt: skip
    assert main(argv) == EXIT_FAILED
    text = capsys.readouterr().out
    assert "FAILURE: InvariantViolation" in text
    (directory,) = out.iterdir()
    assert directory.name.startswith("inproc-request-")
    assert f"reproducer written to {directory}" in text

    record = json.loads((directory / "reproducer.json").read_text("utf-8"))
    assert record["schema"] == fuzz.SCHEMA_VERSION
    assert MachineOptions.from_dict(record["options"]) == MachineOptions(
        faults=(), crash_rule=False, close_rule=False, cache_dir=str(cache_dir)
    )
    assert record["settings"]["stateful_step_count"] == 6
    assert record["settings"]["seed"] == 1  # chunk 0 of --seed 1
    assert record["failure"]["type"] == "InvariantViolation"
    assert record["failure"]["flaky"] is False
    assert record["failure"]["reproduce_failure"].startswith("@reproduce_failure(")
    # When the first example failed (before any shrinking), within the campaign's time.
    first = record["campaign"]["first_failure_s"]
    assert 0 < first <= record["campaign"]["elapsed_s"]
    assert f"first failure after {first:.1f} s" in text
    assert set(record["campaign"]["hits"]) <= set(machine.PATHS)
    assert record["mutant"] is None
    steps = record["steps"]
    assert steps[0] == "state = EngineMachine_inproc_request()"
    assert any(".submit" in step for step in steps)  # submit or submit_wave
    assert steps[-1] == "state.teardown()"
    assert "\n".join(steps) in (directory / "steps.txt").read_text("utf-8")
    assert "FAKE checker: a request was admitted" in (directory / "violations.txt").read_text()

    # The trace is the failing engine's, to its close, and holds what the fake objected to.
    events = TraceRecorder.from_json_lines((directory / "trace.jsonl").read_text("utf-8"))
    assert len(events) == record["trace"]["events"]
    assert record["trace"]["events_at_failure"] <= len(events)
    assert events[-1].kind is TraceKind.CLOSED
    assert fake_check_trace(events)
    assert (directory / "db").is_dir()

    # Replayed while the bug is still there: reproduced from the example database, and the
    # reproducer is left exactly as it was.
    before = _files(out)
    assert main(["fuzz", "--replay", str(directory / "reproducer.json")]) == EXIT_FAILED
    text = capsys.readouterr().out
    assert "reproduced (example database): InvariantViolation" in text
    assert _files(out) == before

    # With --out, a reproduced failure gets a reproducer of its own.
    again = tmp_path / "again"
    assert main(["fuzz", "--replay", str(directory), "--out", str(again)]) == EXIT_FAILED
    capsys.readouterr()
    (copy,) = again.iterdir()
    replayed = json.loads((copy / "reproducer.json").read_text("utf-8"))
    assert replayed["settings"]["replayed_from"] == str(directory / "reproducer.json")
    assert (copy / "db").is_dir() and (copy / "trace.jsonl").is_file()

    # The bug is fixed: neither the database nor the blob reproduces it.
    monkeypatch.undo()
    assert machine.check_trace is not fake_check_trace
    assert main(["fuzz", "--replay", str(directory / "reproducer.json")]) == EXIT_OK
    text = capsys.readouterr().out
    assert "example database: the saved example passed" in text
    assert "@reproduce_failure blob: the example passed" in text
    assert "did not reproduce" in text
    assert _files(out) == before


@pytest.mark.slow
def test_a_planted_bug_is_shrunk_to_a_few_steps(
    tmp_path: Path,
    cache_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(machine, "check_trace", fake_check_trace)
    argv = _fuzz(
        "--examples", "40", "--steps", "6", "--seed", "1", "--quiet", *_PLAIN,
        out=tmp_path, cache_dir=cache_dir,
    )  # fmt: skip
    assert main(argv) == EXIT_FAILED
    capsys.readouterr()
    (directory,) = tmp_path.iterdir()
    reproducer = json.loads((directory / "reproducer.json").read_text("utf-8"))
    steps = reproducer["steps"]
    assert reproducer["failure"]["flaky"] is False
    assert steps, reproducer
    assert steps[0] == "state = EngineMachine_inproc_request()"
    assert steps[-1] == "state.teardown()"
    rules = [s for s in steps[1:-1] if "no_violation_so_far" not in s]
    # Shrunk to the one rule the fake objects to; an unshrunk example has six.
    assert len(rules) == 1 and ".submit" in rules[0], steps


def test_campaign_flags_make_the_machine_options() -> None:
    def _parse(argv: list[str]) -> Any:
        return build_parser().parse_args(["fuzz", *argv])

    plan = fuzz._plan_from_args(
        _parse(["--backend", "tractor", "--start-method", "forkserver", "--mode", "step"])
    )
    assert plan.options.backend == "tractor" and plan.options.mode == "step"
    assert plan.options.worker_start_method == "forkserver"
    assert machine.engine_config_for(plan.options).worker_start_method == "forkserver"
    assert fuzz._plan_from_args(_parse([])).options.worker_start_method == "trio"
    dp = fuzz._plan_from_args(_parse(["--backend", "ray", "--data-parallel", "2"])).options
    assert dp.data_parallel_size == 2
    dp_config = machine.engine_config_for(dp)
    assert (dp_config.data_parallel_size, dp_config.num_workers) == (2, 2)
    assert fuzz._plan_from_args(_parse([])).options.data_parallel_size == 1
    ranked = fuzz._plan_from_args(_parse(["--scheduling-policy", "priority"])).options
    assert ranked.scheduling_policy == "priority"
    assert machine.engine_config_for(ranked).scheduling_policy == "priority"
    assert fuzz._plan_from_args(_parse([])).options.scheduling_policy == "fifo"
    assert fuzz._plan_from_args(_parse(["--pictures"])).options.pictures
    assert not fuzz._plan_from_args(_parse([])).options.pictures


# -- how a campaign is cut into Hypothesis runs, and the database key --------------------------


def _stats(examples: int, elapsed_s: float) -> CampaignStats:
    return CampaignStats(examples=examples, started_at=time.monotonic() - elapsed_s)


def test_chunk_sizes() -> None:
    assert fuzz._chunk_size(50, None, _stats(0, 0.0), 0) == 50  # no deadline: one run
    assert fuzz._chunk_size(50, 100.0, _stats(0, 0.0), 0) == 2  # measures the rate first
    assert fuzz._chunk_size(1, 100.0, _stats(0, 0.0), 0) == 1
    # About one example a second: what fits in the time left, at most CHUNK_TARGET_S.
    assert fuzz._chunk_size(50, 5.5, _stats(10, 9.9), 1) == 5
    assert fuzz._chunk_size(500, 1000.0, _stats(10, 9.9), 1) == int(fuzz.CHUNK_TARGET_S)
    assert fuzz._chunk_size(3, 1000.0, _stats(10, 9.9), 1) == 3
    # A later chunk of one example would only rerun Hypothesis' simplest example: stop.
    assert fuzz._chunk_size(50, 1.5, _stats(10, 9.9), 1) == 0


_DIGEST = """
from hypothesis.internal.reflection import function_digest
from omni_trio.fuzz import _LastEngine, _keeping_trace
from omni_trio.testing.machine import CampaignStats, MachineOptions, make_engine_machine
base = make_engine_machine(MachineOptions({args}), lambda: None, CampaignStats())
print(function_digest(_keeping_trace(base, _LastEngine())).hex())
"""


def _digest(**options: str) -> str:
    from hypothesis.internal.reflection import function_digest

    base = make_engine_machine(MachineOptions(**options), lambda: None, CampaignStats())
    return function_digest(fuzz._keeping_trace(base, fuzz._LastEngine())).hex()


def test_the_database_key_is_stable_across_processes() -> None:
    # Hypothesis keys a machine's examples by this digest: a replay in a new process must
    # find the campaign's examples.
    here = _digest(backend="tractor", mode="step")
    code = _DIGEST.format(args="backend='tractor', mode='step'")
    there = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.strip()
    assert here == there
    assert len({here, _digest(backend="tractor", mode="request"), _digest()}) == 3


# -- flags and errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--faults", "raise_at_step,bogus"], "unknown fault 'bogus'"),
        (["--faults", "fail_warmup"], "unknown fault 'fail_warmup'"),
        (["--faults", ","], "no fault named"),
        (["--faults", "raise_at_step", "--no-faults"], "not allowed with argument"),
        (["--duration", "0"], "--duration: expected seconds > 0, got '0'"),
        (["--duration", "-5"], "--duration: expected seconds > 0, got '-5'"),
        (["--duration", "nan"], "--duration: expected seconds > 0"),
        (["--examples", "0"], "--examples: expected a positive integer"),
        (["--backend", "mp"], "invalid choice: 'mp'"),
        (["--data-parallel", "2"], "--data-parallel 2 runs worker processes: use --backend"),
        (["--data-parallel", "0"], "--data-parallel: expected a positive integer"),
        (["--scheduling-policy", "lifo"], "invalid choice: 'lifo'"),
    ],
)
def test_bad_flags_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["fuzz", *argv]) == EXIT_USAGE
    assert message in capsys.readouterr().err


def test_replay_refuses_campaign_flags(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["fuzz", "--replay", "r.json", "--backend", "tractor", "--seed", "0"]
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "drop --backend, --seed" in err and "Traceback" not in err


def test_replay_of_a_missing_or_bad_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["fuzz", "--replay", str(tmp_path / "nope.json")]) == EXIT_USAGE
    assert "cannot read reproducer" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text('{"schema": 99}')
    assert main(["fuzz", "--replay", str(tmp_path / "bad.json")]) == EXIT_USAGE
    assert f"is not a reproducer of schema {fuzz.SCHEMA_VERSION}" in capsys.readouterr().err


def test_missing_hypothesis_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "hypothesis", None)  # import hypothesis now fails
    assert main(["fuzz", "--examples", "1"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "omni-trio fuzz needs Hypothesis" in err
    assert "pip install 'omni-trio[testing]'" in err


def test_every_fault_the_machine_knows_is_a_flag_choice() -> None:
    assert set(fuzz.fuzzable_faults()) == set(FAILING_FAULTS + BENIGN_FAULTS)


# -- docs/fuzzing.md ---------------------------------------------------------------------------


def test_the_worked_example_runs(tmp_path: Path, cache_dir: Path) -> None:
    (code,) = python_blocks(DOC.read_text("utf-8"))
    script = tmp_path / "example.py"
    script.write_text(code, "utf-8")
    env = dict(os.environ)
    env.update(
        OMNI_TRIO_CACHE=str(cache_dir),
        OMP_WAIT_POLICY="PASSIVE",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "before the crash: FINISHED_COMPLETED, after it: FINISHED_COMPLETED" in proc.stdout
    assert "INV-3 (Terminal cleanup is complete)" in proc.stdout
    events = TraceRecorder.from_json_lines((tmp_path / "trace.jsonl").read_text("utf-8"))
    assert any(e.kind is TraceKind.CRASH for e in events)
