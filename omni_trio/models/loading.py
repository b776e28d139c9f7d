"""``load_model``: a model name or local directory in, a :class:`DiffusionModel` out.

Nothing is ever downloaded: local directories load with ``local_files_only=True`` and the
built-ins are built locally (see :mod:`omni_trio.models.builtin`).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InvalidConfigError
from .builtin import BUILTIN_MODELS, BUILTIN_PREFIX, ensure_builtin, shapes_dir
from .echo import EchoModel
from .factory import is_factory_model, load_factory_model, resolve_factory
from .progress_bars import quiet_hf as quiet_hf

if TYPE_CHECKING:
    import torch

    from .base import DiffusionModel

__all__ = ["check_model", "check_model_early", "load_model", "quiet_hf", "quiet_import_advice"]


def _reject_options(model: str, options: Mapping[str, Any]) -> None:
    if options:
        raise InvalidConfigError(
            f"model {model!r} takes no model options, got: {', '.join(sorted(map(str, options)))}",
            field="model_options",
        )


# "org/name" (optionally "@revision"): how a Hugging Face Hub repository is named.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")


def _not_found(model: str) -> InvalidConfigError:
    if _HUB_ID.fullmatch(model) and not model.startswith((".", "~")):
        repo = model.split("@", 1)[0]
        return InvalidConfigError(
            f"model {model!r} is not a local directory; it looks like a Hugging Face Hub id "
            "and omni_trio never downloads: make a local copy with `huggingface-cli download "
            f"{repo} --local-dir DIR` (`hf download` since huggingface_hub 1.0) or "
            f"huggingface_hub.snapshot_download({repo!r}, local_dir=DIR), then use that "
            "directory as the model (--model DIR)",
            field="model",
        )
    return InvalidConfigError(
        f"model {model!r} is neither a built-in ({', '.join(BUILTIN_MODELS)}) nor an "
        "existing local directory",
        field="model",
    )


def check_model_early(model: str, backend: object) -> None:
    """:func:`check_model` where this process can answer it: a built-in always, a path or a
    model factory (``"package.module:factory"``) unless the workers may be other machines
    (``backend="ray"``), never a name of another ``scheme:`` (a loader that is not ours).
    The command line and the daemon run it before anything starts."""
    scheme, sep, _ = model.partition(":")
    foreign = bool(sep) and scheme.isidentifier() and "/" not in scheme
    foreign = foreign and not is_factory_model(model)
    if model.startswith(BUILTIN_PREFIX) or (backend != "ray" and not foreign):
        check_model(model)


def check_model(model: str) -> None:
    """The checks :func:`load_model` makes before it loads anything, alone: cheap, no torch.

    Raises :class:`InvalidConfigError` (``field="model"``) for an unknown built-in (listing
    the built-ins), a path that is not a directory (a Hugging Face Hub id gets how to make a
    local copy), a directory without ``model_index.json``, or a model factory
    (``"package.module:factory"``, :mod:`omni_trio.models.factory`) that cannot be imported,
    is not callable or does not take its keyword arguments (its module is imported).  The
    command line runs it before it starts an engine, so a bad model is one line at once.
    """
    if model.startswith(BUILTIN_PREFIX):
        if model not in BUILTIN_MODELS:
            raise InvalidConfigError(
                f"unknown built-in model {model!r}; built-ins are {', '.join(BUILTIN_MODELS)}",
                field="model",
            )
        return
    if is_factory_model(model):
        resolve_factory(model)
        return
    path = Path(model).expanduser()
    if not path.is_dir():
        raise _not_found(model)
    if not (path / "model_index.json").is_file():
        raise InvalidConfigError(
            f"model directory {model!r} is not a diffusers pipeline (no model_index.json)",
            field="model",
        )


class _DropTorchvisionFallback(logging.Filter):
    """transformers says, once per image-processor class, that torchvision is absent and it
    uses the PIL implementation: advice to its own users that ours cannot act on (no
    pipeline we load needs torchvision).  Only that message is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "requires torchvision (not installed)" not in str(record.msg)


# The transformers logger that says it (transformers.utils.import_utils); a logger's own
# filters see every record created on it.
_TORCHVISION_FILTER = _DropTorchvisionFallback()


def quiet_import_advice() -> None:
    """Drop transformers' "requires torchvision (not installed)" advice (only that message;
    idempotent).  Done when this module is imported, so that it holds before anything of
    ours imports diffusers' pipelines (the fork server preloads them; see
    ``omni_trio.executors.tractor_executor.FORKSERVER_PRELOAD``), and again by
    :func:`load_model`."""
    logger = logging.getLogger("transformers.utils.import_utils")
    if _TORCHVISION_FILTER not in logger.filters:
        logger.addFilter(_TORCHVISION_FILTER)


quiet_import_advice()


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
    """Load ``model``: a built-in name (:data:`BUILTIN_MODELS`), a local diffusers directory or
    a model factory ``"package.module:factory"`` (called with ``device``, ``dtype`` and
    ``options``; see :mod:`omni_trio.models.factory`).

    Blocking (may build a built-in on first use, about a second, under
    ``cache_dir / "builtin"``; ``builtin:shapes`` ships built, in the package).
    ``options`` are model-specific (``builtin:echo``:
    ``step_delay_s``; the diffusers models take none).  Raises :class:`InvalidConfigError`
    (``field="model"``) for an unknown built-in (listing the built-ins), a path that is not a
    directory, a directory diffusers cannot load, or a pipeline of an unsupported family
    (naming its class); ``field="model_options"`` for bad options; ``field="cache_dir"`` if a
    built-in cannot be written under ``cache_dir``.  transformers' advice that torchvision
    is absent is filtered out (only that message).
    """
    check_model(model)
    if is_factory_model(model):  # the factory's own model: no diffusers here
        return load_factory_model(model, device=device, dtype=dtype, options=options)
    quiet_import_advice()  # before diffusers imports transformers' image processors
    from .pipeline import DiffusersModel

    _no_progress_monitor_thread()
    if model.startswith(BUILTIN_PREFIX):
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
    _reject_options(model, options)
    return DiffusersModel.from_pretrained(path, name=model, device=device, dtype=dtype)
