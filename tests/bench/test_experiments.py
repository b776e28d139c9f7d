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
from omni_trio.bench.backends import ideal_overlap_speedup, overlap_gain_fraction
from omni_trio.bench.steps import draw_steps

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


def test_steps_quick(tmp_path: Path, cache_dir: Path) -> None:
    code, data, out = _run(["steps", "--cache-dir", str(cache_dir)], tmp_path)
    assert code == 0, out
    _check_common(data, "steps")
    params = data["params"]
    assert params["model"] == "builtin:tiny-sd"
    assert params["steps_mix"] == [1, 2, 3] and params["short_steps"] == 1
    assert (params["concurrency"], params["max_num_seqs"], params["torch_threads"]) == (8, 8, 1)
    modes = data["results"]["modes"]
    for mode in ("step", "request"):
        entry = modes[mode]
        assert entry["failed"] == 0
        assert entry["completed"] == params["requests_per_round"] * params["repeats"]
        for key in ("requests_per_s", "images_per_s", "latency_ms"):
            _check_summary(entry[key])
        if entry["short_requests"]:
            _check_summary(entry["latency_ms_short"])
    _check_summary(modes["step"]["ratio_requests_per_s_vs_request"])
    comparison = modes["comparison"]
    assert isinstance(comparison["step_throughput_higher"], bool)
    assert isinstance(comparison["step_short_p99_lower"], bool)
    assert "| mode" in out


def test_backends_quick(tmp_path: Path, cache_dir: Path) -> None:
    code, data, out = _run(["backends", "--cache-dir", str(cache_dir)], tmp_path)
    assert code == 0, out
    _check_common(data, "backends")
    results = data["results"]
    assert data["params"]["parts"] == ["overhead", "async", "transfer", "cfg"]
    overhead = results["overhead"]
    for backend in ("inproc", "tractor"):
        _check_summary(overhead["latency_ms"][backend])
    _check_summary(overhead["tractor_minus_inproc_ms"])
    assert isinstance(overhead["target_met"], bool)
    for backend in ("inproc", "tractor"):
        entry = results["async"]["backends"][backend]
        assert entry["failed"] == 0
        for key in ("requests_per_s_off", "requests_per_s_on", "forward_ms_off", "pack_ms_off"):
            _check_summary(entry[key])
        _check_summary(entry["ratio_on_over_off"])
        assert entry["ideal_speedup"] >= 1.0
        assert isinstance(entry["gain_fraction"], float)
        assert entry["outputs_via_wait_output"] <= entry["outputs_completed_async_on"]
    assert results["async"]["backends"]["inproc"]["async_output_path_used"] is True
    sizes = results["transfer"]["sizes"]
    assert set(sizes) == {"1"}
    assert sizes["1"]["nbytes"] == 1 << 20
    for key in ("shm_ms", "inline_ms", "inline_over_shm"):
        _check_summary(sizes["1"][key])
    cfg = results["cfg"]
    assert cfg["cfg_parallel_active_on_both_ranks"] is True
    for series in cfg["latency_ms"].values():
        _check_summary(series)
    _check_summary(cfg["speedup"])
    assert "| part" in out


def test_overlap_helpers() -> None:
    assert ideal_overlap_speedup(20.0, 5.0) == pytest.approx(1.25)
    assert ideal_overlap_speedup(10.0, 10.0) == pytest.approx(2.0)
    assert ideal_overlap_speedup(0.0, 0.0) == 1.0
    assert overlap_gain_fraction(1.2, 1.25) == pytest.approx(0.8)
    assert overlap_gain_fraction(1.1, 1.0) != overlap_gain_fraction(1.1, 1.0)  # NaN


def test_step_draws_are_seeded_and_from_the_mix() -> None:
    draws = draw_steps((4, 10, 30), 48, 3, seed=0)
    assert draws == draw_steps((4, 10, 30), 48, 3, seed=0)
    assert len(draws) == 3 and all(len(d) == 48 for d in draws)
    assert {s for d in draws for s in d} == {4, 10, 30}


def test_an_unknown_model_is_a_usage_error(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, data, _ = _run(
        ["throughput", "--cache-dir", str(cache_dir), "--model", "builtin:nope"], tmp_path
    )
    assert code == 2
    assert data == {}
    assert "builtin:nope" in capsys.readouterr().err


def test_recovery_quick(tmp_path: Path, cache_dir: Path) -> None:
    code, data, out = _run(["recovery", "--cache-dir", str(cache_dir)], tmp_path)
    assert code == 0, out
    _check_common(data, "recovery")
    results = data["results"]
    for key in ("noticed_s", "serving_s", "recovered_s"):
        _check_summary(results["recovery"][key])
    assert results["recovery"]["noticed_s"]["max"] <= results["recovery"]["recovered_s"]["max"]
    soak = results["soak"]
    assert soak["kills"] >= 1 and soak["restarts"] == soak["kills"]
    assert soak["requests_completed"] > 0 and soak["lost"] == []
    assert results["invariant_violations"] == {"recovery": 0, "soak": 0}


def test_serve_quick(tmp_path: Path, cache_dir: Path) -> None:
    code, data, out = _run(["serve", "--cache-dir", str(cache_dir)], tmp_path)
    assert code == 0, out
    _check_common(data, "serve")
    params = data["params"]
    assert (params["model"], params["steps"], params["size"]) == ("builtin:echo", 4, "64x64")
    assert params["concurrency"] == [4] and params["duration_s"] == 3.0
    assert params["url"].startswith("http://127.0.0.1:")
    results = data["results"]
    assert set(results["closed_loop"]) == {"4"}
    for entry in (results["closed_loop"]["4"], results["open_loop"]):
        for mode in ("http", "direct"):
            figures = entry[mode]
            assert figures["failed"] == figures["unfinished"] == 0, figures["errors"]
            assert figures["completed"] == figures["requests"] > 0
            _check_summary(figures["requests_per_s"])
            _check_summary(figures["latency_ms"])
            _check_summary(figures["queue_wait_ms"])
        _check_summary(entry["http"]["server_ms"])
        _check_summary(entry["http_over_direct_requests_per_s"])
        assert isinstance(entry["added_latency_ms_p50"], float)
    open_loop = results["open_loop"]
    assert open_loop["rate_per_s"] > 0 and open_loop["rate_source"].startswith("70% of ")
    assert open_loop["http"]["requests"] == open_loop["direct"]["requests"]
    modes = [(r["part"], r["mode"]) for r in data["rows"]]
    assert modes == [
        ("closed", "http"),
        ("closed", "direct"),
        ("open", "http"),
        ("open", "direct"),
        ("jobs", "sync"),
        ("jobs", "job"),
        ("metrics", "with"),
        ("metrics", "without"),
    ]
    for part, modes_of in (("jobs", ("sync", "job")), ("metrics", ("with", "without"))):
        for mode in modes_of:
            figures = results[part][mode]
            assert figures["failed"] == 0 and figures["completed"] == figures["requests"] > 0
        assert isinstance(results[part]["p50_difference_ms"], float)
        assert results[part]["requests_per_s_ratio"] > 0
    # The "with" side is scraped meanwhile (the first scrape of each round at once).
    scrapes = results["metrics"]["scrapes"]
    assert scrapes["ok"] >= 1 and scrapes["failed"] == 0
    replay = results["replay"]
    assert replay["jobs"] == 3 and replay["events"] >= 3 * 4 and replay["reconnects"] == 3
    assert replay["events_lost"] == replay["events_seen_twice"] == 0 and replay["failed"] == []
    assert "| part" in out
