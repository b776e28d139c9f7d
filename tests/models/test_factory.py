"""``omni_trio.models.factory``: ``model="package.module:factory"`` through the real loader
and the early model check of the command line."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_trio.errors import InvalidConfigError
from omni_trio.models import load_model
from omni_trio.models.echo import EchoModel
from omni_trio.models.factory import is_factory_model, load_factory_model, resolve_factory
from omni_trio.models.loading import check_model, check_model_early
from tests.extension_examples import echo_factory

FACTORY = "tests.extension_examples:echo_factory"
HERE = "tests.models.test_factory"
CLOSED: list[str] = []
NOT_CALLABLE = 42


def wrong_signature(device: Any) -> EchoModel:
    return EchoModel(device=device)


def flexible(**kwargs: Any) -> EchoModel:
    return EchoModel(device=kwargs["device"], name="flexible")


class NotAModel:
    def close(self) -> None:
        CLOSED.append("closed")


def returns_something_else(
    *, device: torch.device, dtype: torch.dtype, options: Mapping[str, Any]
) -> Any:
    return NotAModel()


def load(model: str, **options: Any) -> Any:
    return load_model(
        model,
        device=torch.device("cpu"),
        dtype=torch.float32,
        cache_dir=Path("/nonexistent"),
        options=options,
    )


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        (FACTORY, True),
        ("mymodule:make", True),
        ("builtin:echo", False),
        ("builtin:nope", False),
        ("/models/sd15", False),
        ("org/repo", False),
        ("hf:org/repo", False),
    ],
)
def test_is_factory_model(model: str, expected: bool) -> None:
    assert is_factory_model(model) is expected


def test_an_existing_directory_is_a_directory_even_if_shaped_like_a_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models:sd").mkdir()
    assert not is_factory_model("models:sd")


def test_the_factory_is_called_with_device_dtype_and_options() -> None:
    model = load(FACTORY, step_delay_s=0.25)
    try:
        assert isinstance(model, EchoModel)
        assert model.info.name == "echo-by-factory" and model.step_delay_s == 0.25
    finally:
        model.close()
    assert resolve_factory(FACTORY) is echo_factory
    flexible_model = load(f"{HERE}:flexible")  # **kwargs takes the keywords too
    assert flexible_model.info.name == "flexible"
    flexible_model.close()


def test_the_factory_refuses_its_own_bad_options() -> None:
    with pytest.raises(InvalidConfigError, match="takes step_delay_s only") as failed:
        load(FACTORY, nope=1)
    assert failed.value.field == "model_options"


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("no_such_pkg_xyz.models:make", "cannot import module 'no_such_pkg_xyz.models'"),
        (f"{HERE}:missing", f"module {HERE!r} has no 'missing'"),
        (f"{HERE}:NOT_CALLABLE", "names int 42, not a callable model factory"),
        (f"{HERE}:wrong_signature", "must accept the keyword arguments device, dtype, options"),
    ],
)
def test_a_bad_factory_path_is_one_line_naming_the_model_field(model: str, message: str) -> None:
    for check in (check_model, load):
        with pytest.raises(InvalidConfigError) as failed:
            check(model)
        assert failed.value.field == "model"
        assert message in str(failed.value) and "\n" not in str(failed.value)


def test_a_factory_returning_something_else_is_refused_and_it_is_closed() -> None:
    CLOSED.clear()
    model = f"{HERE}:returns_something_else"
    check_model(model)  # the path and signature are fine; what it returns is not
    with pytest.raises(InvalidConfigError, match="returned NotAModel, not an omni_trio") as failed:
        load_factory_model(model, device=torch.device("cpu"), dtype=torch.float32, options={})
    assert failed.value.field == "model" and CLOSED == ["closed"]


def test_the_early_check_imports_factories_unless_workers_may_be_elsewhere() -> None:
    bad = "no_such_pkg_xyz:make"  # a one-word module: once taken for a foreign scheme
    for backend in ("inproc", "tractor"):
        check_model_early(FACTORY, backend)
        with pytest.raises(InvalidConfigError, match="cannot import module"):
            check_model_early(bad, backend)
    check_model_early(bad, "ray")  # a Ray worker may have modules this machine lacks
    check_model_early("hf:org/repo", "inproc")  # still a foreign scheme: not ours to check
