"""``scripts/train_shapes_lora.py`` runs a couple of iterations and writes an adapter that
diffusers loads into the shipped ``builtin:shapes`` pipeline.

The full training (the shipped adapter) is not run here; see docs/user-guide.md.
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
from safetensors.torch import load_file

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_shapes_lora.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_shapes_lora", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_shapes_lora", module)
    spec.loader.exec_module(module)
    return module


def test_the_learning_rate_warms_up_then_decays() -> None:
    script = _script()
    args = script.parse_args(["--steps", "100", "--warmup", "10", "--lr", "1.0"])
    rates = [script.learning_rate(step, args) for step in range(100)]
    assert rates[0] == pytest.approx(0.1) and rates[9] == pytest.approx(1.0)
    assert rates[-1] == pytest.approx(0.1, abs=0.01)
    assert all(a >= b for a, b in itertools.pairwise(rates[10:]))
    assert args.out == script.DEFAULT_OUT and args.base == script.DEFAULT_BASE
    assert "--rank 8" in script.command_line(args) and "--out" not in script.command_line(args)
    with pytest.raises(SystemExit):
        script.parse_args(["--rank", "0"])


@pytest.mark.slow
def test_a_short_run_writes_an_adapter_that_diffusers_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script()
    out = tmp_path / "outline"
    argv = ["--steps", "2", "--batch-size", "4", "--warmup", "1", "--rank", "4", "--no-progress"]
    threads = torch.get_num_threads()
    try:
        assert script.main([*argv, "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    record = json.loads((out / "training.json").read_text())
    assert json.loads(capsys.readouterr().out) == record
    assert record["name"] == "builtin:shapes-outline" and record["style"] == "outline"
    assert record["steps"] == 2 and record["rank"] == 4 and record["wall_s"] > 0
    assert np.isfinite(record["final_loss_mean_last_100"])
    base = script.DEFAULT_BASE
    assert record["base"] == script.describe_base(base)
    weights = out / script.WEIGHT_NAME
    assert 1_000 < weights.stat().st_size < 1_000_000

    pipe = script.load_base(base)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(out), adapter_name="outline")
    pipe.set_adapters(["outline"], adapter_weights=[1.0])
    lora_layers = [n for n, _ in pipe.unet.named_parameters() if "lora_" in n]
    # Every matrix in the file is loaded: none skipped for its key names (diffusers' loader
    # skips keys it does not recognise with a warning only).
    assert len(lora_layers) == len(load_file(weights)) > 50

    def render() -> np.ndarray:
        return pipe(
            "a red circle",
            num_inference_steps=2,
            height=32,
            width=32,
            generator=torch.Generator().manual_seed(0),
            output_type="np",
        ).images[0]

    with torch.no_grad():
        adapted = render()
        pipe.disable_lora()
        plain = render()
    assert adapted.shape == (32, 32, 3) and np.isfinite(adapted).all()
    # Two steps move the LoRA B matrices off zero: the adapter changes the picture.
    assert not np.array_equal(adapted, plain)

    # The same arguments train the same adapter.
    again = tmp_path / "again"
    try:
        assert script.main([*argv, "--out", str(again)]) == 0
    finally:
        torch.set_num_threads(threads)
    # (Compared by tensor: safetensors writes the metadata keys in no fixed order.)
    first, second = load_file(weights), load_file(again / script.WEIGHT_NAME)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)
