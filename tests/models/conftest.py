"""Fixtures for the model layer: one torch thread, a per-session model cache, loaded built-ins."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def model_cache_dir(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The cache the session's built-ins are materialised in (never ~/.cache).

    The suite-wide ``cache_dir`` when ``tests/conftest.py`` provides one, so each built-in is
    built once per session; otherwise a session temporary directory of our own.
    """
    try:
        return Path(request.getfixturevalue("cache_dir"))
    except pytest.FixtureLookupError:
        return tmp_path_factory.mktemp("omni_trio_cache")


def _load(name: str, cache_dir: Path) -> Any:
    import torch

    from omni_trio.models import load_model

    return load_model(
        name, device=torch.device("cpu"), dtype=torch.float32, cache_dir=cache_dir, options={}
    )


@pytest.fixture(scope="session")
def tiny_sd(model_cache_dir: Path) -> Iterator[Any]:
    model = _load("builtin:tiny-sd", model_cache_dir)
    yield model
    model.close()


@pytest.fixture(scope="session")
def tiny_ddim(model_cache_dir: Path) -> Iterator[Any]:
    model = _load("builtin:tiny-ddim", model_cache_dir)
    yield model
    model.close()


# diffusers 0.42.1's EulerDiscreteScheduler calls np.array(tensor, copy=False), which numpy 2.4
# deprecates; the warning is theirs and harmless, so keep it out of every report.
_EULER_NUMPY_WARNING = (
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.filterwarnings(_EULER_NUMPY_WARNING))
