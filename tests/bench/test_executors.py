"""``bench executors``: the plan and the pairing are pure and tested here; the command runs
end to end with ``--quick`` on ``builtin:echo`` (inproc vs ray, 1 worker) against the session's
Ray, and with Ray reported missing.  Smoke tests: they check the shape of the figures, never a
speed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import trio

import omni_trio.bench.executors as executors
from omni_trio.bench import add_bench_parser, run_bench
from omni_trio.bench.executors import (
    COLUMNS,
    cell_rows,
    counts_for,
    paired,
    plan_cells,
    sampling_for,
)
from omni_trio.bench.harness import Summary, pair_differences, pair_ratios

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-trio")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser


def _args(*argv: str) -> argparse.Namespace:
    return _parser().parse_args(["bench", "executors", *argv])


def _run(argv: list[str], tmp_path: Path) -> tuple[int, dict[str, Any], str]:
    target = tmp_path / "result.json"
    full = ["bench", "executors", *argv, "--quick", "--no-progress", "--json", str(target)]
    args = _parser().parse_args(full)
    lines: list[str] = []
    code = run_bench(args, argv=["omni-trio", *full], out=lines.append)
    data = json.loads(target.read_text()) if target.exists() else {}
    return code, data, "\n".join(lines)


# -- the plan --------------------------------------------------------------------------------


def test_inproc_runs_in_one_worker_cells_only() -> None:
    cells = plan_cells(["builtin:echo", "builtin:tiny-sd"], [1, 2], ["ray", "inproc", "tractor"])
    assert [(c.model, c.workers, c.backends) for c in cells] == [
        ("builtin:echo", 1, ("inproc", "tractor", "ray")),
        ("builtin:echo", 2, ("tractor", "ray")),
        ("builtin:tiny-sd", 1, ("inproc", "tractor", "ray")),
        ("builtin:tiny-sd", 2, ("tractor", "ray")),
    ]
    assert [c.baselines for c in cells] == [
        ("inproc", "tractor"),
        ("tractor",),
        ("inproc", "tractor"),
        ("tractor",),
    ]


def test_cfg_parallel_only_where_there_is_guidance_to_split() -> None:
    cells = plan_cells(["builtin:echo", "builtin:tiny-sd"], [1, 2], ["tractor"])
    assert [(c.model, c.workers, c.cfg_parallel) for c in cells] == [
        ("builtin:echo", 1, False),
        ("builtin:echo", 2, False),
        ("builtin:tiny-sd", 1, False),
        ("builtin:tiny-sd", 2, True),
    ]
    assert cells[1].label == "builtin:echo, 2 workers, replicas (no CFG to split)"
    assert cells[3].label == "builtin:tiny-sd, 2 workers, cfg-parallel"
    assert cells[0].label == "builtin:echo, 1 worker"


def test_a_cell_without_backends_is_dropped() -> None:
    assert plan_cells(["builtin:echo"], [2], ["inproc"]) == []
    (cell,) = plan_cells(["builtin:echo"], [1, 2], ["inproc"])
    assert (cell.workers, cell.backends, cell.baselines) == (1, ("inproc",), ("inproc",))


# -- pairing ---------------------------------------------------------------------------------


def test_paired_compares_every_backend_with_every_other_baseline() -> None:
    series = {"inproc": [1.0, 2.0], "tractor": [2.0, 4.0], "ray": [3.0, 3.0]}
    minus = paired(series, ("inproc", "tractor"), pair_differences)
    assert set(minus) == {"inproc", "tractor", "ray"}
    assert set(minus["inproc"]) == {"tractor"}  # never against itself
    assert set(minus["ray"]) == {"inproc", "tractor"}
    assert minus["ray"]["inproc"] == Summary.of([2.0, 1.0])
    assert minus["ray"]["tractor"] == Summary.of([1.0, -1.0])
    ratio = paired(series, ("inproc",), pair_ratios)
    assert ratio["tractor"]["inproc"] == Summary.of([2.0, 2.0])
    assert "inproc" not in ratio


def test_paired_skips_missing_series_and_empty_pairs() -> None:
    series: dict[str, list[float]] = {"tractor": [1.0], "ray": [], "x": [2.0]}
    assert paired(series, ("inproc", "tractor"), pair_differences) == {
        "x": {"tractor": Summary.of([1.0])}
    }
    # pair_ratios drops a pair whose baseline is 0: nothing left, nothing reported.
    assert paired({"a": [1.0], "b": [0.0]}, ("b",), pair_ratios) == {}
    with pytest.raises(ValueError, match="unpaired"):
        paired({"a": [1.0, 2.0], "b": [1.0]}, ("b",), pair_differences)


# -- arguments and requests ------------------------------------------------------------------


def test_defaults_and_requests() -> None:
    args = _args()
    assert args.models == ("builtin:echo", "builtin:tiny-sd")
    assert args.workers == (1, 2) and args.backends == ("inproc", "tractor", "ray")
    assert (args.concurrency, args.max_num_seqs, args.torch_threads) == (4, 4, 1)
    echo = sampling_for("builtin:echo", args)
    assert (echo.height, echo.width, echo.num_inference_steps) == (32, 32, 4)
    sd = sampling_for("builtin:tiny-sd", args)
    assert (sd.height, sd.num_inference_steps, sd.guidance_scale) == (64, 10, 7.5)
    assert counts_for("builtin:echo", args) == (100, 100)
    assert counts_for("builtin:tiny-sd", args) == (8, 16)
    quick = _args("--quick", "--concurrency", "2", "--requests", "5")
    assert sampling_for("builtin:tiny-sd", quick).num_inference_steps == 2
    assert counts_for("builtin:echo", quick) == (5, 4)


@pytest.mark.parametrize(
    "argv", [["--backends", "inproc,mpi"], ["--backends", ""], ["--workers", "3"]]
)
def test_bad_options_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _args(*argv)
    assert exc.value.code == 2
    capsys.readouterr()


def test_rows_say_what_did_not_run() -> None:
    ms = Summary.of([1.0, 2.0, 3.0])
    result = {
        "label": "builtin:echo, 1 worker",
        "backends": {
            "inproc": {
                "status": "ran",
                "startup_s": 1.25,
                "block_median_latency_ms": ms,
                "latency_ms": ms,
                "minus_ms": {"tractor": Summary.of([-0.5])},
                "requests_per_s": ms,
                "ratio": {"tractor": Summary.of([2.0])},
            },
            "ray": {"status": "not installed"},
        },
    }
    first, second = cell_rows(result)
    assert list(first) == COLUMNS
    assert first["cell"] == "builtin:echo, 1 worker" and second["cell"] == ""
    assert first["startup s"] == "1.2"
    assert first["- tractor ms (min / med / max)"] == "-0.50 / -0.50 / -0.50"
    assert first["- inproc ms (min / med / max)"] == "-"
    assert first["x tractor (min / med / max)"] == "2.00 / 2.00 / 2.00"
    assert all(second[c] == "not installed" for c in COLUMNS[2:])


# -- end to end ------------------------------------------------------------------------------


def _check_ran(entry: dict[str, Any]) -> None:
    assert entry["status"] == "ran" and entry["failed"] == 0
    assert entry["startup_s"] > 0
    for key in ("block_median_latency_ms", "latency_ms", "requests_per_s"):
        assert entry[key]["min"] <= entry[key]["median"] <= entry[key]["max"]


@pytest.mark.slow
def test_inproc_vs_ray_on_echo_reuses_the_session_ray(
    tmp_path: Path, cache_dir: Path, ray_cluster: Any
) -> None:
    code, data, out = _run(
        [
            "--cache-dir",
            str(cache_dir),
            "--models",
            "builtin:echo",
            "--workers",
            "1",
            "--backends",
            "inproc,ray",
        ],
        tmp_path,
    )
    assert code == 0, out
    assert ray_cluster.is_initialized()  # a Ray this command did not start is left running
    assert data["experiment"] == "executors"
    assert data["command"].startswith("omni-trio bench executors ")
    assert data["params"]["quick"] is True
    ray = data["results"]["ray"]
    assert ray["installed"] is True and ray["started_here"] is False
    assert ray["node_ip"] == "127.0.0.1"
    (cell,) = data["results"]["cells"]
    assert (cell["model"], cell["workers"], cell["baselines"]) == ("builtin:echo", 1, ["inproc"])
    assert cell["request"]["height"] == 32 and cell["request"]["steps"] == 4
    assert list(cell["backends"]) == ["inproc", "ray"]
    for entry in cell["backends"].values():
        _check_ran(entry)
    assert cell["backends"]["ray"]["cfg_parallel_per_rank"] == [False]
    assert set(cell["backends"]["ray"]["minus_ms"]) == {"inproc"}
    assert set(cell["backends"]["ray"]["ratio"]) == {"inproc"}
    assert "| builtin:echo, 1 worker | inproc" in out
    assert any("reused the Ray" in n for n in data["notes"])


def test_without_ray_the_ray_rows_say_not_installed(
    tmp_path: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(executors, "ray_installed", lambda: False)
    code, data, out = _run(
        [
            "--cache-dir",
            str(cache_dir),
            "--models",
            "builtin:echo",
            "--workers",
            "1",
            "--backends",
            "inproc,ray",
            "--blocks",
            "1",
            "--warmup",
            "0",
        ],
        tmp_path,
    )
    assert code == 0, out
    assert data["results"]["ray"] == {"installed": False}
    (cell,) = data["results"]["cells"]
    _check_ran(cell["backends"]["inproc"])
    assert cell["backends"]["ray"] == {"status": "not installed"}
    assert "| ray     | not installed" in out


def test_ray_session_without_ray_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(executors, "ray_installed", lambda: False)

    async def main() -> None:
        async with executors._ray_session(True) as session:
            assert session is None
        async with executors._ray_session(False) as session:
            assert session is None

    trio.run(main)
