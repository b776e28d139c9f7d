"""``load_model``: a model name or local directory in, a :class:`DiffusionModel` out.

Nothing is ever downloaded: local directories load with ``local_files_only=True`` and the
built-ins are built locally (see :mod:`omni_trio.models.builtin`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InvalidConfigError
from .builtin import BUILTIN_MODELS, BUILTIN_PREFIX, ensure_builtin, shapes_dir
from .echo import EchoModel
from .progress_bars import quiet_hf as quiet_hf

if TYPE_CHECKING:
    import torch

    from .base import DiffusionModel

__all__ = ["load_model", "quiet_hf"]


def _reject_options(model: str, options: Mapping[str, Any]) -> None:
    if options:
        raise InvalidConfigError(
            f"model {model!r} takes no model options, got: {', '.join(sorted(map(str, options)))}",
            field="model_options",
        )


def _no_progress_monitor_thread() -> None:
    """diffusers shows tqdm bars while loading; tqdm then starts a monitor thread that
    outlives every bar (and the engine).  Nothing of the engine may outlive it: turn the
    monitor off (bars still work)."""
    try:
        import tqdm
    except ImportError:  # pragma: no cover - a diffusers dependency
        return
    tqdm.tqdm.monitor_interval = 0


def load_model(
    model: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    cache_dir: Path,
    options: Mapping[str, Any],
) -> DiffusionModel:
    """Load ``model``: a built-in name (:data:`BUILTIN_MODELS`) or a local diffusers directory.

    Blocking (may build a built-in on first use, about a second, under
    ``cache_dir / "builtin"``; ``builtin:shapes`` ships built, in the package).
    ``options`` are model-specific (``builtin:echo``:
    ``step_delay_s``; the diffusers models take none).  Raises :class:`InvalidConfigError`
    (``field="model"``) for an unknown built-in (listing the built-ins), a path that is not a
    directory, a directory diffusers cannot load, or a pipeline of an unsupported family
    (naming its class); ``field="model_options"`` for bad options; ``field="cache_dir"`` if a
    built-in cannot be written under ``cache_dir``.
    """
    from .pipeline import DiffusersModel

    _no_progress_monitor_thread()
    if model.startswith(BUILTIN_PREFIX):
        if model not in BUILTIN_MODELS:
            raise InvalidConfigError(
                f"unknown built-in model {model!r}; built-ins are {', '.join(BUILTIN_MODELS)}",
                field="model",
            )
        if model == "builtin:echo":
            return EchoModel.from_options(options, device=device)
        _reject_options(model, options)
        if model == "builtin:shapes":
            return DiffusersModel.from_pretrained(
                shapes_dir(), name=model, device=device, dtype=dtype
            )
        try:
            path = ensure_builtin(model[len(BUILTIN_PREFIX) :], Path(cache_dir))
        except OSError as exc:
            raise InvalidConfigError(
                f"cannot materialise {model} under cache_dir {str(cache_dir)!r}: {exc}",
                field="cache_dir",
            ) from exc
        return DiffusersModel.from_pretrained(path, name=model, device=device, dtype=dtype)

    path = Path(model).expanduser()
    if not path.is_dir():
        raise InvalidConfigError(
            f"model {model!r} is neither a built-in ({', '.join(BUILTIN_MODELS)}) nor an "
            "existing local directory",
            field="model",
        )
    if not (path / "model_index.json").is_file():
        raise InvalidConfigError(
            f"model directory {model!r} is not a diffusers pipeline (no model_index.json)",
            field="model",
        )
    _reject_options(model, options)
    return DiffusersModel.from_pretrained(path, name=model, device=device, dtype=dtype)
