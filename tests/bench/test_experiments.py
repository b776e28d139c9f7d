"""Each experiment runs end to end with ``--quick`` and writes JSON with the promised fields.

Smoke tests only: they check that the harness works and what the JSON holds, never a speed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from omni_trio.bench import add_bench_parser, run_bench

pytestmark = pytest.mark.slow


def _run(argv: list[str], tmp_path: Path) -> tuple[int, dict[str, Any], str]:
    parser = argparse.ArgumentParser(prog="omni-trio")
    add_bench_parser(parser.add_subparsers(dest="command"))
    target = tmp_path / "result.json"
    full = ["bench", *argv, "--quick", "--no-progress", "--json", str(target)]
    args = parser.parse_args(full)
    lines: list[str] = []
    code = run_bench(args, argv=["omni-trio", *full], out=lines.append)
    data = json.loads(target.read_text()) if target.exists() else {}
    return code, data, "\n".join(lines)


def _check_common(data: dict[str, Any], experiment: str) -> None:
    assert data["experiment"] == experiment
    assert data["command"].startswith(f"omni-trio bench {experiment} ")
    assert "--quick" in data["command"]
    machine = data["machine"]
    assert machine["cores"] >= 1
    assert machine["torch_threads"] >= 1
    assert machine["device"]
    assert data["params"]["quick"] is True
    assert data["rows"]


def _check_summary(summary: dict[str, Any]) -> None:
    assert {"min", "median", "max", "p50", "p90", "p99", "n"} <= set(summary)
    assert summary["min"] <= summary["median"] <= summary["max"]


def test_scheduler_quick(tmp_path: Path) -> None:
    code, data, out = _run(["scheduler"], tmp_path)
    assert code == 0, out
    _check_common(data, "scheduler")
    assert data["params"]["queue_lengths"] == [10, 1000]
    for mode in ("request", "step"):
        per_mode = data["results"]["modes"][mode]
        for length in ("10", "1000"):
            _check_summary(per_mode[length]["tick_us"])
            _check_summary(per_mode[length]["ratio_vs_shortest"])
        assert isinstance(per_mode["flat_within_target"], bool)
    assert "| mode" in out


def test_throughput_quick_on_echo(tmp_path: Path, cache_dir: Path) -> None:
    code, data, out = _run(
        [
            "throughput",
            "--cache-dir",
            str(cache_dir),
            "--max-num-seqs",
            "1,4",
            "--concurrency",
            "4",
            "--torch-threads",
            "1",
        ],
        tmp_path,
    )
    assert code == 0, out
    _check_common(data, "throughput")
    params = data["params"]
    assert params["model"] == "builtin:echo"
    assert (params["height"], params["width"], params["steps"]) == (64, 64, 2)
    variants = data["results"]["variants"]
    assert set(variants) == {"request max_num_seqs=1", "request max_num_seqs=4"}
    for entry in variants.values():
        assert entry["failed"] == 0
        assert entry["completed"] == params["requests_per_round"] * params["repeats"]
        for key in ("requests_per_s", "images_per_s", "latency_ms", "queue_wait_ms"):
            _check_summary(entry[key])


def test_overhead_quick(tmp_path: Path, cache_dir: Path) -> None:
    code, data, out = _run(
        [
            "overhead",
            "--cache-dir",
            str(cache_dir),
            "--models",
            "builtin:tiny-sd,builtin:tiny-ddim",
            "--torch-threads",
            "1",
            "--echo-concurrency",
            "8",
            "--echo-max-num-seqs",
            "1,8",
        ],
        tmp_path,
    )
    assert code == 0, out
    _check_common(data, "overhead")
    models = data["results"]["models"]
    assert [m["model"] for m in models] == ["builtin:tiny-sd", "builtin:tiny-ddim"]
    for entry in models:
        assert entry["steps"] == 2
        assert entry["height"] > 0 and entry["width"] > 0
        assert entry["baseline"] == "pipeline"
        assert entry["baseline_model_object"] == "shared with the engine"
        assert entry["direct_call_thread"] == "engine worker thread"
        assert entry["torch_threads_worker"] == entry["torch_threads_direct"] == 1
        for variant in ("engine", "adapter", "pipeline"):
            _check_summary(entry["latency_ms"][variant])
        _check_summary(entry["ratio_engine_vs_pipeline"])
        _check_summary(entry["overhead_ms"])
    echo = data["results"]["echo"]
    _check_summary(echo["concurrency_1"]["runtime_cost_us"])
    _check_summary(echo["concurrency_1"]["requests_per_s"])
    assert set(echo["concurrency_8"]) == {"1", "8"}
    for entry in echo["concurrency_8"].values():
        assert entry["failed"] == 0
        _check_summary(entry["requests_per_s"])


def test_an_unknown_model_is_a_usage_error(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, data, _ = _run(
        ["throughput", "--cache-dir", str(cache_dir), "--model", "builtin:nope"], tmp_path
    )
    assert code == 2
    assert data == {}
    assert "builtin:nope" in capsys.readouterr().err
