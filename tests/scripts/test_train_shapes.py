"""``scripts/train_shapes.py`` runs a couple of iterations and writes a loadable pipeline.

The full training (the committed weights) is not run here; see docs/user-guide.md.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import json
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from PIL import Image

from omni_trio.models import load_model
from omni_trio.models.builtin import MARKER

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_shapes.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_shapes", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_shapes", module)
    spec.loader.exec_module(module)
    return module


def test_the_learning_rate_warms_up_then_decays() -> None:
    script = _script()
    args = script.parse_args(["--steps", "100", "--warmup", "10", "--lr", "1.0"])
    rates = [script.learning_rate(step, args) for step in range(100)]
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)
    assert rates[10] == pytest.approx(1.0)
    assert rates[-1] == pytest.approx(0.1, abs=0.01)
    assert all(a >= b for a, b in itertools.pairwise(rates[10:]))


@pytest.mark.slow
def test_a_short_run_writes_a_pipeline_that_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script()
    out, png = tmp_path / "pipeline", tmp_path / "loss.png"
    argv = ["--steps", "2", "--batch-size", "4", "--warmup", "1", "--no-progress"]
    threads = torch.get_num_threads()
    assert script.main([*argv, "--out", str(out), "--loss-png", str(png)]) == 0
    torch.set_num_threads(threads)
    record = json.loads((out / "training.json").read_text())
    assert record["steps"] == 2 and record["wall_s"] > 0
    assert json.loads(capsys.readouterr().out)["name"] == "builtin:shapes"
    assert (out / MARKER).is_file()
    assert (out / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    assert (out / "text_encoder" / "model.safetensors").is_file()
    assert Image.open(png).size == (640, 360)
    model = load_model(
        str(out), device=torch.device("cpu"), dtype=torch.float32, cache_dir=tmp_path, options={}
    )
    try:
        assert model.info.supports_steps
        assert (model.info.default_height, model.info.default_width) == (32, 32)
    finally:
        model.close()
    # The same arguments train the same weights.
    again = tmp_path / "again"
    assert script.main([*argv, "--out", str(again), "--loss-png", str(png)]) == 0
    torch.set_num_threads(threads)
    name = "unet/diffusion_pytorch_model.safetensors"
    assert (out / name).read_bytes() == (again / name).read_bytes()
    assert np.isfinite(record["final_loss_mean_last_100"])


def test_the_fine_tune_options_are_checked() -> None:
    script = _script()
    for bad in (["--recolour-share", "1.5"], ["--recolour-share", "-0.1"]):
        with pytest.raises(SystemExit):
            script.parse_args(bad)
    with pytest.raises(SystemExit):
        script.parse_args(["--recolour-t-min", "701", "--recolour-t-max", "700"])
    with pytest.raises(SystemExit):
        script.parse_args(["--recolour-t-max", "1000"])
    with pytest.raises(SystemExit):
        script.parse_args(["--recolour-keep-share", "2"])
    # The keep examples' timesteps are below the recolour ones.
    low = ["--recolour-t-min", "100", "--recolour-keep-t-max", "100"]
    with pytest.raises(SystemExit):
        script.parse_args([*low, "--recolour-keep-share", "0.5"])
    assert script.parse_args(low).recolour_t_min == 100  # no keep examples: no constraint
    # A run from scratch draws the loss curve into the docs, a fine-tune nowhere unless told.
    assert script.parse_args([]).loss_png == script.DEFAULT_LOSS_PNG
    assert script.parse_args(["--init-from", "base"]).loss_png is None


def test_a_recoloured_scene_is_the_same_shape_in_another_colour() -> None:
    from omni_trio.models.shapes import COLOURS, sample_scene

    script = _script()
    rng = np.random.default_rng(3)
    for _ in range(20):
        scene = sample_scene(rng)
        other = script.recoloured(scene, rng)
        assert other.colour != scene.colour and other.colour in COLOURS
        assert (other.shape, other.size, other.radius) == (scene.shape, scene.size, scene.radius)
        assert (other.cx, other.cy) == (scene.cx, scene.cy)
        assert max(abs(a - b) for a, b in zip(other.rgb, COLOURS[other.colour], strict=True)) <= 12


def test_the_shipped_record_is_the_documented_fine_tune_of_the_default_run() -> None:
    """training.json of the shipped weights: a fine-tune (the command docs/user-guide.md
    gives) of a run with the defaults; the command line each records parses back to itself."""
    from omni_trio.models.builtin import shapes_dir

    script = _script()
    record = json.loads((shapes_dir() / "training.json").read_text("utf-8"))
    command = record["command"].split()[1:]
    assert script.command_line(script.parse_args(command)) == record["command"]
    assert record["recolour_examples"] > 0 and record["keep_examples"] > 0
    base = record["base"]["training"]
    assert base["command"] == script.command_line(script.parse_args([]))
    assert "base" not in base and "recolour_examples" not in base


@pytest.mark.slow
def test_a_short_fine_tune_with_recolour_examples_records_its_base(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from omni_trio.models.builtin import shapes_dir

    script = _script()
    # A fine-tune draws no loss curve unless asked: were it to, it would land here.
    monkeypatch.setattr(script, "DEFAULT_LOSS_PNG", tmp_path / "loss.png")
    base, out = shapes_dir(), tmp_path / "pipeline"
    argv = ["--init-from", str(base), "--steps", "2", "--batch-size", "4", "--warmup", "1"]
    threads = torch.get_num_threads()
    argv += ["--recolour-share", "1.0", "--recolour-keep-share", "0.5", "--no-progress"]
    assert script.main([*argv, "--out", str(out)]) == 0
    torch.set_num_threads(threads)
    capsys.readouterr()
    assert not (tmp_path / "loss.png").exists()
    record = json.loads((out / "training.json").read_text())
    assert record["steps"] == 2 and record["recolour_examples"] > 0 and record["keep_examples"] > 0
    assert record["recolour_examples"] + record["keep_examples"] <= 8
    assert "--init-from " + str(base) in record["command"]
    assert "--recolour-share 1.0 --recolour-t-max 700" in record["command"]
    shipped = json.loads((base / "training.json").read_text())
    assert record["base"]["path"] == str(base) and record["base"]["training"] == shipped
    unet = "unet/diffusion_pytorch_model.safetensors"
    assert record["base"]["unet_sha256"] == hashlib.sha256((base / unet).read_bytes()).hexdigest()
    # Only the trained weights change: every other file is the base's, byte for byte.
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(base) for p in base.rglob("*") if p.is_file())
    changed = {unet, "text_encoder/model.safetensors", "training.json"}
    for name in files:
        same = (out / name).read_bytes() == (base / name).read_bytes()
        assert same == (name.as_posix() not in changed), name
    model = load_model(
        str(out), device=torch.device("cpu"), dtype=torch.float32, cache_dir=tmp_path, options={}
    )
    try:
        assert model.info.supports_steps
    finally:
        model.close()
