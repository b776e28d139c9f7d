"""``scripts/train_shapes.py`` runs a couple of iterations and writes a loadable pipeline.

The full training (the committed weights) is not run here; see docs/user-guide.md.
"""

from __future__ import annotations

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
