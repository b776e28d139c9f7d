"""LoRA adapters on a diffusers pipeline: loaded on first use, kept in an LRU, applied per
forward.

:class:`LoraSlots` owns the adapters of one pipeline.  ``registry`` maps the names requests
use (``EngineConfig.loras``) to where each adapter lives: a local directory holding a
diffusers LoRA (``pytorch_lora_weights.safetensors``, as ``save_lora_weights`` writes it)
or a shipped one, ``builtin:<name>`` (:data:`BUILTIN_LORAS`).  :meth:`LoraSlots.apply`
makes exactly the given ``(name, scale)`` pairs active: an adapter not loaded yet is loaded
with diffusers' ``load_lora_weights`` (the peft backend), the least recently used one is
unloaded first when ``max_loaded`` are loaded already, and ``()`` turns every adapter off.
A forward's requests all carry the same adapters (they are part of the compatibility keys),
so one ``apply`` per forward (per tick in step mode) serves them all.

A name that is not registered, a directory that is not a LoRA, or an adapter whose target
modules are not in the pipeline raise :class:`InvalidLoraError`; whatever the failed load
left behind is deleted, so the pipeline serves on as before.  Not thread-safe: the model
calls it under its own lock, between forwards.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import InvalidLoraError

__all__ = ["BUILTIN_LORAS", "LoraSlots", "check_loras", "resolve_lora_path"]

_PACKAGE = Path(__file__).resolve().parent
# The adapters that ship with the package, by the path a registry names them with.
BUILTIN_LORAS: dict[str, Path] = {
    "builtin:shapes-outline": _PACKAGE / "shapes" / "loras" / "outline",
}
WEIGHTS_NAME = "pytorch_lora_weights.safetensors"


@contextlib.contextmanager
def _warnings_off() -> Iterator[None]:
    """diffusers' logging at error level inside the block (process-wide; restored)."""
    from diffusers.utils import logging as diffusers_logging

    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            # peft's note that a model holds several adapters: that is what the LRU is for.
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            yield
    finally:
        diffusers_logging.set_verbosity(level)


def resolve_lora_path(path: str) -> Path:
    """The directory ``path`` names: a shipped adapter (``builtin:...``) or a local path
    (``~`` expanded).  Raises :class:`InvalidLoraError` for an unknown ``builtin:`` name."""
    if path.startswith("builtin:"):
        found = BUILTIN_LORAS.get(path)
        if found is None:
            known = ", ".join(sorted(BUILTIN_LORAS))
            raise InvalidLoraError(f"no shipped LoRA {path!r} (shipped: {known})")
        return found
    return Path(path).expanduser()


def check_loras(registry: Mapping[str, str]) -> None:
    """Raise :class:`~omni_trio.errors.InvalidConfigError` (``field="loras"``) for a
    registered path that holds no LoRA here (an unknown shipped name, a directory without
    its weights file).  Cheap, no torch: the command line and the daemon run it before
    anything starts, where the workers share this machine's files."""
    from ..errors import InvalidConfigError

    for name, path_text in registry.items():
        try:
            path = resolve_lora_path(path_text)
        except InvalidLoraError as exc:
            raise InvalidConfigError(f"LoRA {name!r}: {exc}", field="loras") from None
        if not (path / WEIGHTS_NAME).is_file():
            raise InvalidConfigError(
                f"LoRA {name!r}: {path_text!r} is not a LoRA adapter directory "
                f"(no {WEIGHTS_NAME} in it)",
                field="loras",
            )


class LoraSlots:
    """The adapters of ``pipe`` (a diffusers pipeline with the LoRA loader mixin)."""

    def __init__(self, pipe: Any, registry: Mapping[str, str], max_loaded: int = 4) -> None:
        self._pipe = pipe
        self.registry = dict(registry)
        self.max_loaded = max(1, max_loaded)
        self._loaded: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self.active: tuple[tuple[str, float], ...] = ()
        self.loads = 0  # adapters loaded so far (a reload after an eviction counts again)

    @property
    def loaded(self) -> tuple[str, ...]:
        """The adapters loaded now, least recently used first."""
        return tuple(self._loaded)

    def apply(self, spec: Sequence[Sequence[Any]]) -> None:
        """Make exactly ``spec`` (``(name, scale)`` pairs) active; ``()``: none.  Raises
        :class:`InvalidLoraError` (nothing is active then)."""
        pairs = tuple((str(name), float(scale)) for name, scale in spec)
        if pairs == self.active:
            for name, _ in pairs:
                self._loaded.move_to_end(name)
            return
        pipe = self._pipe
        if not pairs:
            if self._loaded:
                pipe.disable_lora()
            self.active = ()
            return
        if len(pairs) > self.max_loaded:
            raise InvalidLoraError(
                f"{len(pairs)} adapters at once; this worker keeps at most {self.max_loaded}"
            )
        try:
            self._activate(pairs)
        except BaseException:
            # Nothing may stay active from before: the next forward applies its own.
            with contextlib.suppress(Exception):
                pipe.disable_lora()
            self.active = ()
            raise
        self.active = pairs

    def _activate(self, pairs: tuple[tuple[str, float], ...]) -> None:
        pipe = self._pipe
        wanted = {name for name, _ in pairs}
        for name, _ in pairs:
            if name in self._loaded:
                self._loaded.move_to_end(name)
                continue
            while len(self._loaded) >= self.max_loaded:
                victim = next(n for n in self._loaded if n not in wanted)
                self._unload(victim)
            self._load(name)
        try:
            pipe.enable_lora()
            pipe.set_adapters([n for n, _ in pairs], adapter_weights=[s for _, s in pairs])
        except (ValueError, KeyError, RuntimeError) as exc:
            raise InvalidLoraError(f"cannot apply LoRA {sorted(wanted)}: {exc}") from exc

    def _load(self, name: str) -> None:
        path_text = self.registry.get(name)
        if path_text is None:
            known = ", ".join(sorted(self.registry)) or "none"
            raise InvalidLoraError(f"unknown LoRA adapter {name!r} (registered: {known})")
        path = resolve_lora_path(path_text)
        if not (path / WEIGHTS_NAME).is_file():
            raise InvalidLoraError(
                f"LoRA {name!r}: {path_text!r} is not a LoRA adapter directory "
                f"(no {WEIGHTS_NAME} in it)"
            )
        try:
            with _warnings_off():  # (diffusers warns of components the adapter leaves alone)
                self._pipe.load_lora_weights(str(path), adapter_name=name)
        except Exception as exc:  # a broken file, or target modules this model lacks
            self._forget(name)
            raise InvalidLoraError(
                f"LoRA {name!r} from {path_text!r} does not fit this model: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if name not in self._adapter_names():
            self._forget(name)
            raise InvalidLoraError(
                f"LoRA {name!r} from {path_text!r} matched no module of this model"
            )
        self._loaded[name] = None
        self.loads += 1

    def _adapter_names(self) -> set[str]:
        with contextlib.suppress(Exception):
            names = self._pipe.get_list_adapters()
            return {n for adapters in names.values() for n in adapters}
        return set()

    def _forget(self, name: str) -> None:
        """Delete whatever a failed load of ``name`` left in the pipeline."""
        with contextlib.suppress(Exception):
            self._pipe.delete_adapters(name)

    def _unload(self, name: str) -> None:
        self._loaded.pop(name, None)
        self._forget(name)

    def close(self) -> None:
        for name in list(self._loaded):
            self._unload(name)
        self.active = ()
