"""LoRA adapters on the real ``builtin:shapes`` pipeline (random test adapters from
:mod:`tests.lora_support`): applied per forward, off again bit for bit, kept in an LRU, and
a bad adapter fails alone while the pipeline serves on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from omni_trio._core.request import DiffusionRequest, SamplingParams
from omni_trio.errors import InvalidConfigError, InvalidLoraError
from omni_trio.models.lora import BUILTIN_LORAS, check_loras, resolve_lora_path
from tests.lora_support import make_foreign_lora, make_lora
from tests.models.conftest import _load


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "a": str(make_lora(root / "a", seed=1)),
        "b": str(make_lora(root / "b", seed=2)),
        "foreign": str(make_foreign_lora(root / "foreign")),
        "empty": str(root),  # a directory, but no adapter in it
    }


@pytest.fixture
def shapes(model_cache_dir: Path) -> Iterator[Any]:
    model = _load("builtin:shapes", model_cache_dir)
    yield model
    model.close()


def render(model: Any, lora: Any = (), seed: int = 3) -> np.ndarray:
    import torch

    request = DiffusionRequest(
        "a red circle", SamplingParams(num_inference_steps=4, lora=lora), "r"
    )
    generator = torch.Generator().manual_seed(seed)
    (images,) = model.generate([request], [generator], output_type="np", on_step=lambda s, t: None)
    return np.asarray(images[0])


def test_an_adapter_changes_the_picture_and_off_gives_the_base_back_bit_for_bit(
    shapes: Any, adapters: dict[str, str]
) -> None:
    assert shapes.info.lora_input
    shapes.configure_loras({"a": adapters["a"]}, 4)
    base = render(shapes)
    adapted = render(shapes, (("a", 1.0),))
    assert np.abs(adapted - base).mean() > 0.01
    assert np.array_equal(render(shapes, (("a", 1.0),)), adapted)  # deterministic
    assert np.array_equal(render(shapes), base)
    half = render(shapes, (("a", 0.5),))
    assert not np.array_equal(half, adapted) and not np.array_equal(half, base)
    assert np.array_equal(render(shapes, (("a", 0.0),)), base)


def test_past_max_loaded_the_least_recently_used_adapter_is_unloaded(
    shapes: Any, adapters: dict[str, str]
) -> None:
    shapes.configure_loras({"a": adapters["a"], "b": adapters["b"]}, 1)
    slots = shapes._loras
    first_a = render(shapes, (("a", 1.0),))
    render(shapes, (("b", 1.0),))
    assert slots.loaded == ("b",) and slots.loads == 2
    # "a" is loaded again, and draws what it drew.
    assert np.array_equal(render(shapes, (("a", 1.0),)), first_a)
    assert slots.loaded == ("a",) and slots.loads == 3
    with pytest.raises(InvalidLoraError, match="at most 1"):
        render(shapes, (("a", 1.0), ("b", 1.0)))


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("foreign", "does not fit this model"),
        ("empty", "is not a LoRA adapter directory"),
        ("unregistered", "unknown LoRA adapter"),
    ],
)
def test_a_bad_adapter_fails_alone_and_the_pipeline_serves_on(
    shapes: Any, adapters: dict[str, str], name: str, message: str
) -> None:
    registry = {k: v for k, v in adapters.items() if k != "b"}
    shapes.configure_loras(registry, 4)
    base = render(shapes)
    adapted = render(shapes, (("a", 1.0),))
    with pytest.raises(InvalidLoraError, match=message) as info:
        render(shapes, ((name, 1.0),))
    assert info.value.param == "lora" and info.value.code == "invalid_lora"
    # Right after the failure, no adapter is left on from before.
    assert np.array_equal(render(shapes), base)
    assert np.array_equal(render(shapes, (("a", 1.0),)), adapted)
    assert np.array_equal(render(shapes), base)


def test_a_model_without_a_registry_refuses_adapters(shapes: Any) -> None:
    shapes.configure_loras({}, 4)
    with pytest.raises(InvalidLoraError, match="no LoRA adapters registered"):
        render(shapes, (("a", 1.0),))


def test_sleeping_unloads_the_adapters_and_both_levels_wake_them_on_use(
    shapes: Any, adapters: dict[str, str], tmp_path: Path
) -> None:
    shapes.configure_loras({"a": adapters["a"]}, 4)
    base, adapted = render(shapes), render(shapes, (("a", 1.0),))
    for level in (1, 2):
        assert shapes.sleep(level, str(tmp_path)) > 0
        assert shapes._loras.loaded == ()
        shapes.wake_up()
        assert np.array_equal(render(shapes, (("a", 1.0),)), adapted)
        assert np.array_equal(render(shapes), base)


def test_paths_resolve_and_are_checked_before_anything_loads(adapters: dict[str, str]) -> None:
    assert resolve_lora_path("builtin:shapes-outline") == BUILTIN_LORAS["builtin:shapes-outline"]
    assert resolve_lora_path("~/x") == Path.home() / "x"
    with pytest.raises(InvalidLoraError, match="no shipped LoRA"):
        resolve_lora_path("builtin:nope")
    check_loras({"a": adapters["a"]})
    for bad in ({"e": adapters["empty"]}, {"n": "builtin:nope"}, {"m": "/no/such/dir"}):
        with pytest.raises(InvalidConfigError) as info:
            check_loras(bad)
        assert info.value.field == "loras"
