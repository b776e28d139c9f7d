from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_trio.models import builtin
from omni_trio.models.builtin import MARKER, builtin_dir, ensure_builtin


def _files(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_the_cache_is_built_once_and_reused(
    model_cache_dir: Path, tiny_sd: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = builtin_dir("tiny-sd", model_cache_dir)
    assert target == model_cache_dir / "builtin" / "tiny-sd-v1"
    assert (target / MARKER).is_file()
    before = _files(target)

    def no_rebuild(*args: object) -> None:
        raise AssertionError("the built-in was rebuilt")

    monkeypatch.setattr(builtin, "build_builtin_pipeline", no_rebuild)
    assert ensure_builtin("tiny-sd", model_cache_dir) == target
    assert _files(target) == before
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".")]


def test_the_files_are_small(model_cache_dir: Path, tiny_sd: Any, tiny_ddim: Any) -> None:
    for name in ("tiny-sd", "tiny-ddim"):
        size = sum(p.stat().st_size for p in builtin_dir(name, model_cache_dir).rglob("*"))
        assert size < 8 * 2**20, (name, size)


def test_building_leaves_the_global_rng_alone(tmp_path: Path) -> None:
    state = torch.get_rng_state()
    ensure_builtin("tiny-ddim", tmp_path)
    assert torch.equal(state, torch.get_rng_state())


def test_an_incomplete_directory_is_rebuilt(tmp_path: Path) -> None:
    target = builtin_dir("tiny-ddim", tmp_path)
    target.mkdir(parents=True)
    (target / "half-written").write_text("")
    assert ensure_builtin("tiny-ddim", tmp_path) == target
    assert (target / MARKER).is_file() and (target / "model_index.json").is_file()
    assert not (target / "half-written").exists()
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]


def test_concurrent_builders_agree(tmp_path: Path) -> None:
    results: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(ensure_builtin("tiny-ddim", tmp_path))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert results == [builtin_dir("tiny-ddim", tmp_path)] * 2
    assert sorted(p.name for p in results[0].parent.iterdir()) == [results[0].name]


def test_the_same_seeds_build_the_same_weights(
    tmp_path: Path, model_cache_dir: Path, tiny_ddim: Any
) -> None:
    fresh = ensure_builtin("tiny-ddim", tmp_path)
    cached = builtin_dir("tiny-ddim", model_cache_dir)
    weights = "unet/diffusion_pytorch_model.safetensors"
    assert (fresh / weights).read_bytes() == (cached / weights).read_bytes()


@pytest.mark.parametrize("prompt", ["a cat", "Ünïcödé ☃ 日本語 🙂", "", "tabs\tand  spaces!!"])
def test_any_prompt_tokenizes_without_unknown_tokens(tiny_sd: Any, prompt: str) -> None:
    tokenizer = tiny_sd.pipeline.tokenizer
    ids = tokenizer(prompt).input_ids
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    body = ids[1:-1]
    assert tokenizer.unk_token_id not in body
    assert len(body) == len("".join(prompt.lower().split()).encode())


def test_unknown_names_are_not_built(tmp_path: Path) -> None:
    with pytest.raises(KeyError):
        builtin.build_builtin_pipeline("tiny-flux", tmp_path)


def test_shapes_ships_small_safetensors_in_the_package() -> None:
    root = builtin.shapes_dir()
    assert root.parent.name == "shapes" and root.parent.parent.name == "models"
    assert (root / "model_index.json").is_file()
    assert json.loads((root / MARKER).read_text())["name"] == "builtin:shapes"
    weights = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.safetensors"))
    assert weights == [
        "text_encoder/model.safetensors",
        "unet/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
    ]
    assert not list(root.rglob("*.bin")) and not list(root.rglob("*.pt"))
    size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert size < 20 * 2**20, size
    assert "shapes" not in builtin._DIFFUSERS_BUILTINS  # never built, never cached
