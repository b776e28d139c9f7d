from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_trio.errors import InvalidConfigError
from omni_trio.models import BUILTIN_MODELS, load_model
from omni_trio.models.echo import EchoModel
from omni_trio.models.loading import check_model, quiet_import_advice

from .support import generators, no_steps, request

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)


def load(model: str, cache_dir: Path, **options: Any) -> Any:
    return load_model(
        model,
        device=torch.device("cpu"),
        dtype=torch.float32,
        cache_dir=cache_dir,
        options=options,
    )


def test_unknown_builtin_lists_the_builtins(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfigError) as info:
        load("builtin:tiny-flux", tmp_path)
    assert info.value.field == "model"
    for name in BUILTIN_MODELS:
        assert name in str(info.value)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("make", ["missing", "file", "empty-dir", "bad-index"])
def test_bad_paths_are_config_errors(tmp_path: Path, make: str) -> None:
    path = tmp_path / "model"
    if make == "file":
        path.write_text("not a model")
    elif make == "empty-dir":
        path.mkdir()
    elif make == "bad-index":
        path.mkdir()
        (path / "model_index.json").write_text("{not json")
    with pytest.raises(InvalidConfigError) as info:
        load(str(path), tmp_path)
    assert info.value.field == "model"
    assert str(path) in str(info.value)


def test_echo_is_built_with_its_options(tmp_path: Path) -> None:
    model = load("builtin:echo", tmp_path, step_delay_s=0.5)
    assert isinstance(model, EchoModel)
    assert model.step_delay_s == 0.5
    assert model.info.name == "builtin:echo"
    assert not list(tmp_path.iterdir())  # nothing is cached for the fake


def test_diffusers_models_take_no_options(model_cache_dir: Path) -> None:
    with pytest.raises(InvalidConfigError) as info:
        load("builtin:tiny-ddim", model_cache_dir, step_delay_s=1)
    assert info.value.field == "model_options"


def test_a_user_directory_loads_like_the_builtin(
    tmp_path: Path, model_cache_dir: Path, tiny_sd: Any
) -> None:
    directory = tmp_path / "my-sd"
    tiny_sd.pipeline.save_pretrained(directory)
    model = load(str(directory), model_cache_dir)
    try:
        assert model.info.name == str(directory)
        assert model.info.family == "text2image"
        ours = model.generate([request()], generators(4), output_type="np", on_step=no_steps)
        builtin = tiny_sd.generate([request()], generators(4), output_type="np", on_step=no_steps)
        assert np.array_equal(ours[0][0], builtin[0][0])
    finally:
        model.close()


def test_an_unsupported_pipeline_directory_is_named(tmp_path: Path, tiny_sd: Any) -> None:
    from diffusers import StableDiffusionImg2ImgPipeline

    directory = tmp_path / "img2img"
    StableDiffusionImg2ImgPipeline(**tiny_sd.pipeline.components).save_pretrained(directory)
    with pytest.raises(InvalidConfigError, match="StableDiffusionImg2ImgPipeline"):
        load(str(directory), tmp_path)


def test_importing_the_package_does_not_import_torch() -> None:
    code = (
        "import sys, omni_trio.models; "
        "from omni_trio.models.loading import check_model; check_model('builtin:shapes'); "
        "heavy = [m for m in ('torch', 'diffusers', 'transformers', 'numpy') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unwritable_cache_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    with pytest.raises(InvalidConfigError) as info:
        load("builtin:tiny-ddim", blocker)
    assert info.value.field == "cache_dir"


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("builtin:nosuch", "unknown built-in model 'builtin:nosuch'; built-ins are "),
        ("nosuch", "model 'nosuch' is neither a built-in ("),
        ("./models/nosuch", "model './models/nosuch' is neither a built-in ("),
    ],
)
def test_check_model_says_what_is_wrong_in_one_line(model: str, expected: str) -> None:
    with pytest.raises(InvalidConfigError) as info:
        check_model(model)
    assert str(info.value).startswith(expected)
    assert "\n" not in str(info.value)
    assert info.value.field == "model"
    for name in BUILTIN_MODELS:
        check_model(name)


def test_check_model_accepts_a_pipeline_directory(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfigError, match=r"no model_index\.json"):
        check_model(str(tmp_path))
    (tmp_path / "model_index.json").write_text("{}")
    check_model(str(tmp_path))


@pytest.mark.parametrize("hub_id", ["stabilityai/sd-turbo", "runwayml/stable-diffusion-v1-5"])
def test_a_hub_id_says_how_to_make_a_local_copy(tmp_path: Path, hub_id: str) -> None:
    with pytest.raises(InvalidConfigError) as info:
        load(hub_id, tmp_path)  # load_model says the same as check_model
    message = str(info.value)
    assert "\n" not in message
    assert "looks like a Hugging Face Hub id" in message
    assert f"huggingface-cli download {hub_id} --local-dir DIR" in message
    assert f"huggingface_hub.snapshot_download({hub_id!r}, local_dir=DIR)" in message
    assert message.endswith("then use that directory as the model (--model DIR)")


def test_only_the_torchvision_advice_is_dropped() -> None:
    quiet_import_advice()
    quiet_import_advice()  # idempotent
    logger = logging.getLogger("transformers.utils.import_utils")
    assert len([f for f in logger.filters if type(f).__name__ == "_DropTorchvisionFallback"]) == 1

    def kept(message: str) -> bool:
        record = logger.makeRecord(logger.name, logging.WARNING, __file__, 1, message, (), None)
        return bool(logger.filter(record))

    assert not kept(
        "`CLIPImageProcessor` requires torchvision (not installed); falling back to "
        "`CLIPImageProcessorPil` for backward compatibility."
    )
    assert kept("something else transformers says")


def test_loading_prints_nothing_of_transformers(tmp_path: Path) -> None:
    """A fresh process (transformers warns once per process): loading builtin:shapes, which
    imports diffusers' SD pipeline and with it transformers' image processors, is silent."""
    code = (
        "import torch; from omni_trio.models import load_model; "
        "load_model('builtin:shapes', device=torch.device('cpu'), dtype=torch.float32, "
        f"cache_dir={str(tmp_path)!r}, options={{}})"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert "torchvision" not in proc.stderr
    assert proc.stderr == ""


def test_a_worker_not_rank_0_builds_a_builtin_in_a_fresh_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers saves weights on rank 0 of an initialised torch.distributed group only:
    a CFG-parallel pair's second worker once built tiny-sd without its text encoder's
    weights, which could win the rename and break the cache for good.  Such a rank builds in
    a process of its own, outside the group, and gets a complete copy."""
    import torch

    from omni_trio.models import builtin

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    target = builtin.ensure_builtin("tiny-sd", tmp_path)
    assert (target / builtin.MARKER).is_file()
    weights = {p.parent.name for p in target.rglob("*.safetensors")}
    assert {"unet", "vae", "text_encoder"} <= weights, weights
    model = load_model(
        str(target), device=torch.device("cpu"), dtype=torch.float32, cache_dir=tmp_path,
        options={},
    )  # fmt: skip
    model.close()
