"""Weights a model can let go of and take back: what ``sleep`` and ``wake_up`` do to a model.

:class:`WeightSleeper` holds a model's torch modules (by component name) and, asked to sleep,
releases the storage of every parameter (buffers, which are small, stay):

* **level 1** keeps a copy elsewhere: on an accelerator in host memory, on a CPU in a file
  in a private directory (``omni_trio-sleep-<pid>-<random>`` under ``directory``, default
  the system's temporary directory).  On a CPU a copy in host memory would free nothing, and
  a lossy compact form would not wake bit for bit, so the copy goes to disk.  Waking reads it
  back, and the directory is removed.
* **level 2** keeps nothing.  Waking loads the parameters again from the model's source
  (``reload``: component name -> parameter name -> tensor; typically the model directory
  read once more), which must have what was released.

A released parameter keeps its :class:`torch.nn.Parameter` object (only its ``.data`` is
swapped for an empty tensor on the same device), so hooks and every reference to a module
survive a sleep, and a woken model computes exactly what it computed before (level 2: what
the source holds).  Parameters tied across modules are released and restored once.

Nothing here is thread-safe: the model calls it under its own lock, never during a forward.
A private directory whose process has died (a worker killed while asleep) is removed by the
next worker that loads a model, or sleeps, on the same machine with the same ``sleep_dir``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._core.health import SLEEP_LEVELS

if TYPE_CHECKING:
    import torch

__all__ = [
    "SLEEP_DIR_PREFIX",
    "Reload",
    "WeightSleeper",
    "private_dir_name",
    "return_free_memory",
    "sweep_orphan_dirs",
]
SLEEP_DIR_PREFIX = "omni_trio-sleep-"
_WEIGHTS_FILE = "weights.safetensors"

# component name -> parameter name -> tensor (a level-2 wake's source).
Reload = Callable[[], Mapping[str, Mapping[str, "torch.Tensor"]]]


def return_free_memory() -> None:
    """Ask the C allocator to give freed memory back to the OS (glibc ``malloc_trim``; a
    no-op elsewhere), so a release shows in the process's resident size."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _host_tag() -> str:
    """This machine's name in a directory name (only ``[A-Za-z0-9.]``)."""
    return "".join(c for c in socket.gethostname() if c.isalnum() or c == ".") or "host"


def private_dir_name() -> str:
    """``omni_trio-sleep-<host>-<pid>-<random>``: whose copy it is, so that only a process
    on the same machine judges whether its owner still runs."""
    return f"{SLEEP_DIR_PREFIX}{_host_tag()}-{os.getpid()}-{secrets.token_hex(4)}"


def sweep_orphan_dirs(parent: Path) -> list[Path]:
    """Remove the private sleep directories under ``parent`` made on this machine by a
    process that is gone (a worker killed while asleep).  Another machine's (a shared
    ``sleep_dir``) are never touched.  Workers run it when they load their model, and
    every level-1 sleep does."""
    removed = []
    host = _host_tag()
    with contextlib.suppress(OSError):
        for entry in parent.iterdir():
            name = entry.name
            if not name.startswith(SLEEP_DIR_PREFIX) or not entry.is_dir():
                continue
            owner, _, pid_text = name[len(SLEEP_DIR_PREFIX) :].rpartition("-")[0].rpartition("-")
            if owner == host and pid_text.isdigit() and not _pid_alive(int(pid_text)):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


class WeightSleeper:
    """Releases and restores the parameters of ``modules`` (see the module docstring).

    ``device`` is where the parameters live while awake.  ``reload`` is the level-2 source;
    without one, level 2 is refused (``ValueError``).
    """

    def __init__(
        self,
        modules: Mapping[str, torch.nn.Module],
        device: torch.device,
        *,
        reload: Reload | None = None,
    ) -> None:
        self._modules = dict(modules)
        self.device = device
        self._reload = reload
        self.level = 0  # 0: awake
        self._host: dict[str, torch.Tensor] = {}  # level 1 on an accelerator
        self._dir: Path | None = None  # level 1 on a CPU
        self._shapes: dict[str, tuple[int, ...]] = {}  # what was released, to check a wake

    @property
    def asleep(self) -> bool:
        return self.level != 0

    @property
    def can_reload(self) -> bool:
        return self._reload is not None

    def _parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Every parameter once (tied ones under their first name), as ``component.name``."""
        seen: set[int] = set()
        for component, module in self._modules.items():
            for name, param in module.named_parameters():
                if id(param) in seen:
                    continue
                seen.add(id(param))
                yield f"{component}.{name}", param

    def parameter_bytes(self) -> int:
        """The bytes the parameters hold now (0 while asleep)."""
        return sum(p.data.numel() * p.data.element_size() for _, p in self._parameters())

    def sleep(self, level: int, directory: str | os.PathLike[str] | None = None) -> int:
        """Release the parameters at ``level``; returns the bytes released.  Asleep already:
        a deeper level releases the level-1 copy too (level 1 after 2 changes nothing).
        Raises ``ValueError`` for another level or level 2 without a source, ``OSError``
        when the level-1 file cannot be written (then nothing was released)."""
        import torch

        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if level == 2 and self._reload is None:
            raise ValueError("this model has no source to reload its weights from: use level 1")
        if self.asleep:
            if level > self.level:
                self._forget_copy()
                self.level = level
            return 0
        params = dict(self._parameters())
        released = sum(p.data.numel() * p.data.element_size() for p in params.values())
        if level == 1:
            if self.device.type == "cpu":
                self._dir = self._write(params, directory)
            else:
                self._host = {name: p.data.to("cpu") for name, p in params.items()}
        self._shapes = {name: tuple(p.data.shape) for name, p in params.items()}
        for param in params.values():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self.level = level
        _empty_cache(self.device)
        return_free_memory()
        return released

    def _write(self, params: Mapping[str, torch.Tensor], directory: Any) -> Path:
        from safetensors.torch import save_file

        parent = Path(directory) if directory is not None else Path(tempfile.gettempdir())
        parent.mkdir(parents=True, exist_ok=True)
        sweep_orphan_dirs(parent)
        path = parent / private_dir_name()
        path.mkdir(mode=0o700)
        try:
            save_file(
                {name: p.data.contiguous() for name, p in params.items()},
                str(path / _WEIGHTS_FILE),
            )
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        return path

    def wake_up(self) -> int:
        """Put every parameter back; returns the bytes restored (0 when awake).  Raises what
        reading the copy or the source raised (``OSError``, ``KeyError`` for a parameter the
        source lacks, ``ValueError`` for one of another shape); then the model stays asleep
        and waking may be tried again."""
        if not self.asleep:
            return 0
        params = dict(self._parameters())
        if self.level == 1 and self._dir is not None:
            from safetensors.torch import load_file

            loaded = load_file(str(self._dir / _WEIGHTS_FILE), device=str(self.device))
        elif self.level == 1:
            loaded = {name: tensor.to(self.device) for name, tensor in self._host.items()}
        else:
            assert self._reload is not None
            loaded = {}
            for component, tensors in self._reload().items():
                for name, tensor in tensors.items():
                    loaded[f"{component}.{name}"] = tensor
            for name in params:  # peft wraps an adapted layer: its base is the source's
                alias = name.replace(".base_layer.", ".")
                if name not in loaded and alias in loaded:
                    loaded[name] = loaded[alias]
        missing = sorted(set(params) - set(loaded))
        if missing:
            raise KeyError(
                f"the weights to wake from lack {len(missing)} parameters: {missing[:3]}"
            )
        for name, param in params.items():
            tensor, shape = loaded[name], self._shapes.get(name)
            if tensor.dtype != param.dtype or (shape is not None and tuple(tensor.shape) != shape):
                raise ValueError(
                    f"{name}: the weights to wake from hold {tensor.dtype} {tuple(tensor.shape)}, "
                    f"the model released {param.dtype} {shape}"
                )
        for name, param in params.items():
            param.data = loaded[name].to(self.device)
        restored = sum(p.data.numel() * p.data.element_size() for p in params.values())
        self._forget_copy()
        self._shapes = {}
        self.level = 0
        return restored

    def _forget_copy(self) -> None:
        self._host = {}
        path, self._dir = self._dir, None
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        """Drop any copy (and its directory); idempotent."""
        self._forget_copy()


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
