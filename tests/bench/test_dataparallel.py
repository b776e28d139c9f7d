"""``bench dataparallel``: a complete ``--quick`` report on the echo model (real daemons and
limit processes, seconds), the memory reading, and the kill probe's accounting.  No speed is
asserted."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from omni_trio.bench import add_bench_parser, run_bench
from omni_trio.bench.dataparallel import pss_mib

pytestmark = pytest.mark.slow  # starts daemons and worker processes


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-trio")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser


def test_pss_counts_the_processes_given() -> None:
    mine = pss_mib([os.getpid()])
    assert mine is not None and mine > 1
    assert pss_mib([]) is None and pss_mib([2**22 + 7]) is None  # no such process


def test_a_quick_run_gives_a_complete_report(tmp_path: Path, cache_dir: Path) -> None:
    target = tmp_path / "dp.json"
    full = [
        "bench", "dataparallel", "--quick", "--no-progress", "--json", str(target),
        "--model", "builtin:echo", "--steps", "2", "--requests", "4",
        "--systems", "limit,inproc,dp2,stages2", "--kill-probe", "5",
        "--cache-dir", str(cache_dir),
        "--worker-start-method", "forkserver",
    ]  # fmt: skip
    lines: list[str] = []
    code = run_bench(_parser().parse_args(full), argv=["omni-trio", *full], out=lines.append)
    out = "\n".join(lines)
    assert code == 0, out
    data = json.loads(target.read_text())
    assert data["experiment"] == "dataparallel"
    results = data["results"]
    assert set(results) == {"limit", "inproc", "dp2", "stages2", "kill_probe"}
    for name in ("limit", "inproc", "dp2", "stages2"):
        entry = results[name]
        assert entry["cold_start_s"] > 0 and entry["pss_mib"] > 0
        cell = entry["c4"]
        assert cell["rps"]["median"] > 0 and cell["errors"] == {}
        if name != "limit":
            assert cell["ratio_to_limit"]["median"] > 0
            assert cell["latency_ms"]["n"] == 4  # every request answered and timed
    for name in ("dp2", "stages2"):
        probe = results["kill_probe"][name]
        assert probe["killed_pid"] > 0 and probe["requests_ok"] >= 1
        assert probe["first_answer_after_kill_s"] is not None  # it served again after the kill
        assert probe["longest_gap_s"] >= probe["first_answer_after_kill_s"] > 0
        assert f"{name} at c=4" in out and f"kill probe {name}" in out
    # A stage killed: the other replica answers on, its requests moved there; none failed.
    assert results["kill_probe"]["stages2"]["requests_failed"] == {}
    assert [r["system"] for r in data["rows"]] == ["limit", "inproc", "dp2", "stages2"]
