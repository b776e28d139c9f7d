"""``bench quality`` runs end to end on a tiny N and reports adherence per prompt and in total;
``--img2img`` recolours and inpaints the renders and reports per mode; ``--lora`` renders the
grid with and without the shipped outline adapter and reports the style rates.

Smoke tests: 1 image per prompt at 2 steps says nothing about the model (see
tests/models/shapes/test_trained_model.py and docs/benchmarks.md for that).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omni_trio.bench import add_bench_parser, run_bench
from omni_trio.bench.quality import (
    COLOUR_TARGET,
    LORA_ADHERENCE_TARGET,
    SHAPE_TARGET,
    STYLE_WITH_TARGET,
    STYLE_WITHOUT_TARGET,
    UNMASKED_TARGET,
    inpaint_mask,
    other,
    prompt_for,
)
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


def test_the_edits_ask_for_another_colour_and_shape_and_mask_the_shape() -> None:
    assert [other("red", tuple(COLOURS), turn) for turn in range(5)] == [
        c for c in COLOURS if c != "red"
    ]
    assert other("circle", SHAPES, 0) != "circle" and other("circle", SHAPES, 7) != "circle"
    picture = np.ones((32, 32, 3))
    assert inpaint_mask(picture) is None
    picture[10:14, 1:5] = (1.0, 0.0, 0.0)
    mask = inpaint_mask(picture)
    assert mask is not None and mask.sum() == 10 * 8  # rows 7..16, columns 0..7 (clipped at 0)
    assert mask[7:17, 0:8].all()


@pytest.mark.slow
def test_img2img_quick_recolours_and_inpaints_from_the_picture(
    tmp_path: Path, cache_dir: Path
) -> None:
    argv = ["--cache-dir", str(cache_dir), "--img2img", "--steps", "2", "--strength", "0.5"]
    code, data, out = _run([*argv, "--colours", "red", "--shapes", "circle"], tmp_path)
    assert code == 0, out
    params, results = data["params"], data["results"]
    assert params["img2img"] is True and params["steps"] == 2
    assert params["strength"] == 0.5 and params["inpaint_strength"] == 1.0
    assert params["backend"] == "inproc" and params["samples_per_prompt"] == 1
    assert results["strength"] == 0.5 and results["inpaint_strength"] == 1.0
    assert results["images"] == 2 and results["inpaint_skipped"] == 0
    for key in (
        "recolour_colour_adherence",
        "recolour_shape_kept",
        "inpaint_colour_adherence",
        "inpaint_shape_adherence",
    ):
        assert 0.0 <= results[key] <= 1.0, key
    assert (results["colour_target"], results["unmasked_target"]) == (0.90, UNMASKED_TARGET)
    for key in ("recolour_colour_target_met", "inpaint_colour_target_met"):
        assert isinstance(results[key], bool)
    # Outside the mask the picture is kept: a request that ignored it would draw a new picture
    # there (~70/255 off at 2 steps).
    assert isinstance(results["inpaint_unmasked_max_dev"], float)
    assert results["inpaint_unmasked_max_dev"] <= UNMASKED_TARGET
    assert results["unmasked_target_met"] is True
    assert [row["mode"] for row in data["rows"]] == [
        "recolour (strength 0.5)",
        "inpaint (strength 1)",
        "total",
    ]
    assert "unmasked max deviation" in out


def test_strength_without_img2img_is_bad_input(tmp_path: Path, cache_dir: Path) -> None:
    code, _, _ = _run(["--cache-dir", str(cache_dir), "--strength", "0.5"], tmp_path)
    assert code == 2


def test_an_unknown_colour_is_bad_input(tmp_path: Path, cache_dir: Path) -> None:
    code, _, _ = _run(["--cache-dir", str(cache_dir), "--colours", "teal"], tmp_path)
    assert code == 2


@pytest.mark.slow
def test_lora_quick_renders_with_and_without_the_shipped_adapter(
    tmp_path: Path, cache_dir: Path
) -> None:
    argv = ["--cache-dir", str(cache_dir), "--lora", "--steps", "2"]
    code, data, out = _run([*argv, "--colours", "red", "--shapes", "circle,square"], tmp_path)
    assert code == 0, out
    params, results = data["params"], data["results"]
    assert params["lora"] is True and params["lora_path"] == "builtin:shapes-outline"
    assert params["lora_scale"] == 1.0 and params["steps"] == 2
    assert results["images"] == 4 and results["style"] == "outline"
    for key in (
        "style_rate_with_lora",
        "style_rate_without_lora",
        "colour_adherence_with_lora",
        "shape_adherence_with_lora",
        "colour_adherence_without_lora",
        "shape_adherence_without_lora",
    ):
        assert 0.0 <= results[key] <= 1.0, key
    assert (
        results["style_with_target"],
        results["style_without_target"],
        results["adherence_target"],
    ) == (STYLE_WITH_TARGET, STYLE_WITHOUT_TARGET, LORA_ADHERENCE_TARGET)
    assert (STYLE_WITH_TARGET, STYLE_WITHOUT_TARGET, LORA_ADHERENCE_TARGET) == (0.9, 0.05, 0.9)
    for key in ("style_with_target_met", "style_without_target_met", "shape_target_met"):
        assert isinstance(results[key], bool)
    assert set(results["per_prompt"]) == {"a red circle", "a red square"}
    assert [row["prompt"] for row in data["rows"]] == ["a red circle", "a red square", "total"]
    assert "style with the adapter" in out and "| a red square" in out


@pytest.mark.parametrize(
    "argv",
    [["--lora-path", "/tmp/x"], ["--lora-scale", "0.5"], ["--lora", "--img2img"]],
)
def test_lora_options_need_lora_alone(tmp_path: Path, cache_dir: Path, argv: list[str]) -> None:
    code, _, _ = _run(["--cache-dir", str(cache_dir), *argv], tmp_path)
    assert code == 2
