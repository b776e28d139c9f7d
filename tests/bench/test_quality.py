"""``bench quality`` runs end to end on a tiny N and reports adherence per prompt and in total.

Smoke tests: 1 image per prompt at 2 steps says nothing about the model (see
tests/models/shapes/test_trained_model.py and docs/benchmarks.md for that).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from omni_trio.bench import add_bench_parser, run_bench
from omni_trio.bench.quality import COLOUR_TARGET, SHAPE_TARGET, prompt_for
from omni_trio.models.shapes import COLOURS, SHAPES

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)


def _run(argv: list[str], tmp_path: Path) -> tuple[int, dict[str, Any], str]:
    parser = argparse.ArgumentParser(prog="omni-trio")
    add_bench_parser(parser.add_subparsers(dest="command"))
    target = tmp_path / "result.json"
    full = ["bench", "quality", *argv, "--quick", "--no-progress", "--json", str(target)]
    args = parser.parse_args(full)
    lines: list[str] = []
    code = run_bench(args, argv=["omni-trio", *full], out=lines.append)
    data = json.loads(target.read_text()) if target.exists() else {}
    return code, data, "\n".join(lines)


def test_the_prompts_name_a_colour_and_a_shape() -> None:
    assert len(COLOURS) == 6 and len(SHAPES) == 3
    assert prompt_for("red", "circle") == "a red circle"
    assert prompt_for("orange", "triangle") == "an orange triangle"
    assert (COLOUR_TARGET, SHAPE_TARGET) == (0.90, 0.70)


@pytest.mark.slow
def test_quality_quick_on_the_tractor_backend(tmp_path: Path, cache_dir: Path) -> None:
    # tractor: the worker process loads builtin:shapes the way inproc does (the demo test in
    # tests/test_cli.py runs it inproc).
    argv = ["--cache-dir", str(cache_dir), "--steps", "1", "--backend", "tractor"]
    code, data, out = _run([*argv, "--colours", "red,blue", "--shapes", "circle"], tmp_path)
    assert code == 0, out
    assert data["experiment"] == "quality"
    assert data["params"]["samples_per_prompt"] == 1 and data["params"]["steps"] == 1
    assert data["params"]["backend"] == "tractor"
    results = data["results"]
    assert results["images"] == 2
    for key in ("colour_adherence", "shape_adherence", "both_adherence"):
        assert 0.0 <= results[key] <= 1.0
    assert set(results["per_prompt"]) == {"a red circle", "a blue circle"}
    assert [row["prompt"] for row in data["rows"]] == ["a red circle", "a blue circle", "total"]
    assert "| a red circle" in out and "colour adherence" in out


def test_an_unknown_colour_is_bad_input(tmp_path: Path, cache_dir: Path) -> None:
    code, _, _ = _run(["--cache-dir", str(cache_dir), "--colours", "teal"], tmp_path)
    assert code == 2
