"""POSIX shared-memory transport for large tensors, arrays and images.

A payload larger than a threshold (:data:`DEFAULT_SHM_THRESHOLD`, 1 MB) does not travel inside
a message: the sender copies it into a fresh segment and sends a small :class:`ShmHandle`; the
receiver copies it out and unlinks the segment.  The ownership rule (DESIGN §3):

* the **creator** registers each name it creates in its :class:`SegmentRegistry` *before* it
  writes the data, so that :meth:`SegmentRegistry.unlink_all` also reaches half-written ones;
* the **receiver** consumes a handle exactly once, with :func:`unpack` (copy out) or
  :func:`discard` (dropped result).  Both unlink; unlinking a name that is already gone is a
  no-op, never an error;
* when the peer of a connection dies, the survivor unlinks what the dead side may still
  have held: ``registry.unlink_all()`` for the segments it created itself and
  ``registry.sweep()`` / :func:`sweep_segments` for those the dead peer created (names carry
  the registry's ``tag``, so they can be found by prefix even if no message ever reported them).

Why not :class:`multiprocessing.shared_memory.SharedMemory`: on Python 3.11 it registers every
segment with ``multiprocessing.resource_tracker``, which spawns a tracker process, warns about
"leaked" segments that another process legitimately consumed and unlinks them on its own at
exit, racing our receiver.  We call ``_posixshmem.shm_open`` (the same C helper ``SharedMemory``
uses) with ``O_CREAT | O_EXCL`` and mode ``0o600`` and map the file descriptor with
:mod:`mmap` ourselves.  Space is reserved with ``posix_fallocate`` before the copy, so a full
``/dev/shm`` (64 MB by default in Docker) raises ``OSError(ENOSPC)`` instead of killing the
process with ``SIGBUS`` on the first write to an unbacked page.

Segment names are ``omni_trio_`` + optional ``<tag>_`` + 32 hex digits; :class:`ShmHandle`
refuses any other name, so a handle from a peer can never make us unlink foreign segments.
A tag may start with an :func:`owner_tag` (``o<pid>x<start ticks>`` of the process that owns
the segments' lifetime); :func:`sweep_orphans` unlinks the segments of owners that are gone,
so what a SIGKILLed engine left is removed by the next start.

torch, numpy and PIL are imported lazily: importing this module stays cheap (a worker module
that tractor's parent imports must not pull in torch, see notes/tractor-0.1.0a5.md §5 item 4).
Linux only (``/dev/shm``).
"""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]
import errno
import math
import mmap
import os
import re
import secrets
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import torch
    from PIL import Image

__all__ = [
    "DEFAULT_SHM_THRESHOLD",
    "SHM_PREFIX",
    "SegmentRegistry",
    "ShmHandle",
    "ShmKind",
    "discard",
    "list_our_segments",
    "owner_tag",
    "pack_array",
    "pack_image",
    "pack_tensor",
    "payload_nbytes",
    "sweep_orphans",
    "sweep_segments",
    "unlink_segment",
    "unpack",
]

SHM_PREFIX = "omni_trio_"
# A payload goes to shared memory iff its size is strictly greater than this (bytes).
DEFAULT_SHM_THRESHOLD = 1_000_000

ShmKind = Literal["tensor", "ndarray", "image"]
_KINDS = frozenset({"tensor", "ndarray", "image"})
_SHM_DIR = Path("/dev/shm")
_NAME_RE = re.compile(r"omni_trio_(?:[a-z0-9]{1,64}_)?[0-9a-f]{32}")
_TAG_RE = re.compile(r"[a-z0-9]{1,64}")
_MODE = 0o600
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ShmHandle:
    """Where a payload lies in shared memory, and how to rebuild it.

    Plain data: :meth:`to_wire` gives a list of str/int values that any msgpack encodes, and
    :meth:`from_wire` validates and rebuilds it.

    ``dtype`` is the torch dtype name (``"bfloat16"``) for ``kind="tensor"``, the numpy
    ``dtype.str`` (``"<f4"``, byte order included) for ``"ndarray"``, and the PIL mode for
    ``"image"``, whose ``shape`` is PIL's ``(width, height)``.  ``nbytes`` is the exact size of
    the data in the segment (C order, no padding), always > 0.
    """

    name: str
    kind: ShmKind
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.fullmatch(self.name):
            raise ValueError(f"not an omni_trio segment name: {self.name!r}")
        if self.kind not in _KINDS:
            raise ValueError(f"unknown ShmHandle kind {self.kind!r}")
        if not isinstance(self.dtype, str) or not self.dtype:
            raise ValueError(f"ShmHandle dtype must be a non-empty string, got {self.dtype!r}")
        if not isinstance(self.shape, tuple) or not all(
            type(d) is int and d >= 0 for d in self.shape
        ):
            raise ValueError(f"ShmHandle shape must be a tuple of ints >= 0, got {self.shape!r}")
        if type(self.nbytes) is not int or self.nbytes <= 0:
            raise ValueError(f"ShmHandle nbytes must be a positive int, got {self.nbytes!r}")

    def to_wire(self) -> list[Any]:
        """``[name, kind, dtype, [shape...], nbytes]``: plain msgpack-able values."""
        return [self.name, self.kind, self.dtype, list(self.shape), self.nbytes]

    @classmethod
    def from_wire(cls, obj: Sequence[Any]) -> ShmHandle:
        """Rebuild a handle from :meth:`to_wire` output; raises ValueError if malformed."""
        try:
            name, kind, dtype, shape, nbytes = obj
            return cls(name, kind, dtype, tuple(shape), nbytes)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"malformed ShmHandle {obj!r}: {exc}") from None


class SegmentRegistry:
    """Creator-side bookkeeping: segments created and not known to be consumed.

    One registry per connection and direction, e.g. one per worker.  ``tag`` (lowercase
    letters and digits) goes into every name created through this registry, so the names a
    peer created with the same tag can be swept by prefix after that peer crashed.

    The receiver unlinks; the creator does not learn about it.  So that a long-lived registry
    does not grow without bound, :meth:`register` prunes names that no longer exist whenever
    the registry has doubled since the last prune (amortised O(1)).  Thread-safe.
    """

    def __init__(self, tag: str = "") -> None:
        if tag and not _TAG_RE.fullmatch(tag):
            raise ValueError(f"registry tag must match [a-z0-9]{{1,64}}, got {tag!r}")
        self._tag = tag
        self._names: set[str] = set()
        self._lock = threading.Lock()
        self._prune_at = 64

    @property
    def tag(self) -> str:
        return self._tag

    @property
    def prefix(self) -> str:
        """The prefix of every name :meth:`new_name` makes (``omni_trio_`` + ``tag_``)."""
        return f"{SHM_PREFIX}{self._tag}_" if self._tag else SHM_PREFIX

    def new_name(self) -> str:
        """A fresh random segment name under :attr:`prefix` (not registered, not created)."""
        return self.prefix + secrets.token_hex(16)

    def register(self, name: str) -> None:
        """Record that ``name`` was created and is not yet consumed."""
        with self._lock:
            self._names.add(name)
            if len(self._names) >= self._prune_at:
                self._prune_locked()
                self._prune_at = max(64, 2 * len(self._names))

    def forget(self, name: str) -> bool:
        """Drop ``name`` without unlinking it (it was consumed); False if it was not here."""
        with self._lock:
            try:
                self._names.remove(name)
            except KeyError:
                return False
            return True

    def unlink(self, name: str) -> bool:
        """Unlink ``name`` and forget it; True if this call removed the segment."""
        self.forget(name)
        return unlink_segment(name)

    def unlink_all(self) -> list[str]:
        """Unlink every registered name (crash cleanup); returns those this call removed."""
        with self._lock:
            names = sorted(self._names)
            self._names.clear()
        return [name for name in names if unlink_segment(name)]

    def sweep(self) -> list[str]:
        """Unlink every existing segment under :attr:`prefix`, registered or not.

        Meant for a tagged registry after its peer (which created names with the same tag)
        died.  Refused for an untagged registry: its prefix covers every omni_trio segment on
        the machine, other engines' included.
        """
        if not self._tag:
            raise ValueError("sweep() needs a tagged registry; use unlink_all()")
        removed = sweep_segments(self.prefix)
        with self._lock:
            self._names.difference_update(removed)
        return removed

    def prune(self) -> int:
        """Forget names whose segment no longer exists; returns how many were dropped."""
        with self._lock:
            return self._prune_locked()

    def _prune_locked(self) -> int:
        gone = {name for name in self._names if not (_SHM_DIR / name).exists()}
        self._names -= gone
        return len(gone)

    def names(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._names)

    def __len__(self) -> int:
        with self._lock:
            return len(self._names)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._names


# --- segments -----------------------------------------------------------------------------


def unlink_segment(name: str) -> bool:
    """Unlink segment ``name``; True if it existed, False (no error) if it was already gone."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True


def list_our_segments(prefix: str = SHM_PREFIX) -> list[str]:
    """Sorted names in ``/dev/shm`` that start with ``prefix`` (for leak checks)."""
    if not _SHM_DIR.is_dir():
        return []
    return sorted(p.name for p in _SHM_DIR.iterdir() if p.name.startswith(prefix))


_OWNER_RE = re.compile(r"o(\d+)x(\d+)")


def _start_ticks(pid: int) -> int | None:
    """Process ``pid``'s start time (clock ticks since boot, /proc), or None if it is gone
    (or this system has no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def owner_tag(pid: int | None = None) -> str:
    """``o<pid>x<start ticks>``: names this process (default: the current one) for as long as
    it lives; a tag that starts with it marks segments :func:`sweep_orphans` may remove once
    their owner is gone.  (pid alone could be reused by a new process.)"""
    pid = os.getpid() if pid is None else pid
    return f"o{pid}x{_start_ticks(pid) or 0}"


def owner_of(name: str) -> int | None:
    """The pid of the live process that owns segment ``name`` (by its :func:`owner_tag`),
    or None when it has no owner tag or its owner is gone (the pid reused counts as
    gone)."""
    match = _OWNER_RE.match(name, len(SHM_PREFIX))
    if match is None:
        return None
    pid = int(match.group(1))
    return pid if _start_ticks(pid) == int(match.group(2)) else None


def segments_of_this_process() -> list[str]:
    """Our segments that may belong to this process: those under its :func:`owner_tag`, and
    those with no owner tag at all (which nothing can attribute); never another live or
    dead process's.  What a leak check of this process's engines counts, so that another
    engine on the machine cannot fail it."""
    mine = owner_tag()
    found = []
    for name in list_our_segments():
        match = _OWNER_RE.match(name, len(SHM_PREFIX))
        if match is None or match.group(0) == mine:  # whole tags: o12x456 is not o12x4567
            found.append(name)
    return found


def sweep_orphans() -> list[str]:
    """Unlink every segment whose tag starts with an :func:`owner_tag` of a process that is
    gone (or whose pid now belongs to a process started at another time): what a crashed or
    SIGKILLed engine left.  Returns the names removed.  Segments without an owner tag are
    left alone."""
    removed: list[str] = []
    for name in list_our_segments():
        match = _OWNER_RE.match(name, len(SHM_PREFIX))
        if match is None:
            continue
        pid, ticks = int(match.group(1)), int(match.group(2))
        alive = _start_ticks(pid)
        if alive is not None and (ticks == 0 or alive == ticks):
            continue
        if unlink_segment(name):
            removed.append(name)
    return removed


def sweep_segments(prefix: str) -> list[str]:
    """Unlink every segment whose name starts with ``prefix`` (which must start with
    ``omni_trio_``); returns the names this call removed."""
    if not prefix.startswith(SHM_PREFIX):
        raise ValueError(f"refusing to sweep segments outside {SHM_PREFIX!r}: {prefix!r}")
    return [name for name in list_our_segments(prefix) if unlink_segment(name)]


def _write_segment(
    nbytes: int, fill: Callable[[mmap.mmap], None], registry: SegmentRegistry | None
) -> str:
    """Create a 0o600 segment of ``nbytes``, ``fill`` it, return its name.

    The name is registered before any data is written; on any failure the segment is
    unlinked and forgotten again, and the error propagates.
    """
    prefix = registry.prefix if registry is not None else SHM_PREFIX
    for _attempt in range(8):
        name = prefix + secrets.token_hex(16)
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=_MODE)
        except FileExistsError:
            continue
        break
    else:  # pragma: no cover - 128 random bits colliding eight times
        raise FileExistsError(errno.EEXIST, "could not find a free shared-memory name")
    if registry is not None:
        registry.register(name)
    try:
        try:
            os.fchmod(fd, _MODE)  # exact mode whatever the umask
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"cannot reserve {nbytes} bytes of shared memory in {_SHM_DIR} "
                    f"for {name}: {exc.strerror}",
                ) from None
            mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        try:
            fill(mm)
        finally:
            mm.close()
    except BaseException:
        unlink_segment(name)
        if registry is not None:
            registry.forget(name)
        raise
    return name


def _read_segment(
    handle: ShmHandle, read: Callable[[mmap.mmap], T], registry: SegmentRegistry | None
) -> T:
    """Open ``handle``'s segment, unlink it at once, then ``read`` the mapping.

    The name is gone before any data is read, so no failure after the open can leak it.
    Raises FileNotFoundError if the segment does not exist (already consumed or never made).
    """
    try:
        fd = _posixshmem.shm_open("/" + handle.name, os.O_RDONLY, mode=0)
    except FileNotFoundError:
        if registry is not None:
            registry.forget(handle.name)
        raise FileNotFoundError(
            errno.ENOENT,
            f"shared-memory segment {handle.name} does not exist (already consumed?)",
        ) from None
    unlink_segment(handle.name)
    if registry is not None:
        registry.forget(handle.name)
    try:
        size = os.fstat(fd).st_size
        if size < handle.nbytes:
            raise ValueError(
                f"segment {handle.name} holds {size} bytes, its handle says {handle.nbytes}"
            )
        mm = mmap.mmap(fd, handle.nbytes, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        return read(mm)
    finally:
        mm.close()


def discard(handle: ShmHandle, *, registry: SegmentRegistry | None = None) -> bool:
    """Unlink ``handle``'s segment without reading it (a dropped result).

    True if this call removed it; False, not an error, if it was already gone.
    """
    if registry is not None:
        registry.forget(handle.name)
    return unlink_segment(handle.name)


# --- sizes --------------------------------------------------------------------------------


def payload_nbytes(obj: torch.Tensor | np.ndarray) -> int:
    """The size judged against the threshold: max(view bytes, underlying storage bytes).

    Judging on the storage too sends a small view of a big batch tensor through shared
    memory as well (only the view's data is copied).
    """
    np_mod = sys.modules.get("numpy")
    if np_mod is not None and isinstance(obj, np_mod.ndarray):
        view = int(obj.nbytes)
        root: Any = obj
        while isinstance(root.base, np_mod.ndarray):
            root = root.base
        storage = int(root.nbytes)
        if root.base is not None:
            try:
                with memoryview(root.base) as mv:
                    storage = max(storage, mv.nbytes)
            except TypeError:
                pass
        return max(view, storage)
    tensor: Any = obj
    view = tensor.numel() * tensor.element_size()
    try:
        storage = tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):  # e.g. tensors without storage
        storage = 0
    return max(view, storage)


def _check_threshold(threshold: int) -> None:
    if type(threshold) is not int or threshold < 0:
        raise ValueError(f"shm threshold must be an int >= 0, got {threshold!r}")


# --- tensors ------------------------------------------------------------------------------


def _plain_cpu_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, on CPU, with conj/neg bits resolved (strides may stay as they are)."""
    import torch

    if t.layout is not torch.strided or t.is_nested:
        raise TypeError(f"cannot serialise a {t.layout} tensor; only dense (strided) tensors")
    if t.is_quantized:
        raise TypeError(f"cannot serialise a quantized tensor ({t.dtype})")
    if t.device.type == "meta":
        raise TypeError("cannot serialise a meta tensor: it has no data")
    t = t.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.resolve_conj().resolve_neg()


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def _torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tensor_bytes_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of contiguous ``t`` (bit-exact, any dtype, bf16 included)."""
    import torch

    return t.reshape(-1).view(torch.uint8)


def pack_tensor(
    t: torch.Tensor,
    *,
    threshold: int = DEFAULT_SHM_THRESHOLD,
    registry: SegmentRegistry | None = None,
) -> ShmHandle | torch.Tensor:
    """Put ``t`` in shared memory iff ``payload_nbytes(t) > threshold``.

    Returns a :class:`ShmHandle`, or, when the tensor stays inline, ``t`` detached, on CPU
    and with conj/neg resolved (not necessarily contiguous) for the caller to serialise.
    Any device: a CUDA tensor is copied to CPU first.  Only the view's elements are written,
    in C order, as raw bytes with the torch dtype name (bf16 exact).  Registers the new name
    in ``registry`` before writing.  Raises TypeError for sparse, nested, quantized or meta
    tensors, OSError if ``/dev/shm`` has no room.
    """
    _check_threshold(threshold)
    judged = payload_nbytes(t)
    cpu = _plain_cpu_tensor(t)
    nbytes = cpu.numel() * cpu.element_size()
    if judged <= threshold or nbytes == 0:
        return cpu

    def fill(mm: mmap.mmap) -> None:
        import torch

        dst = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes)
        try:
            dst.view(cpu.dtype).view(cpu.shape).copy_(cpu)
        finally:
            del dst  # release the buffer export before the mapping is closed

    name = _write_segment(nbytes, fill, registry)
    return ShmHandle(name, "tensor", _torch_dtype_name(cpu.dtype), tuple(cpu.shape), nbytes)


def _read_tensor(handle: ShmHandle, registry: SegmentRegistry | None) -> torch.Tensor:
    import numpy as np
    import torch

    dtype = _torch_dtype(handle.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if math.prod(handle.shape) * itemsize != handle.nbytes:
        raise ValueError(f"ShmHandle {handle.name}: shape/dtype do not match nbytes")
    out = torch.empty(handle.shape, dtype=dtype)

    def read(mm: mmap.mmap) -> None:
        src = np.frombuffer(mm, dtype=np.uint8, count=handle.nbytes)
        try:
            np.copyto(_tensor_bytes_view(out).numpy(), src)
        finally:
            del src

    _read_segment(handle, read, registry)
    return out


# --- numpy arrays -------------------------------------------------------------------------


def _check_array_dtype(a: np.ndarray) -> None:
    if a.dtype.hasobject:
        raise TypeError(
            f"cannot serialise a numpy array of dtype {a.dtype}: object arrays hold Python "
            "references, not data; convert them first"
        )
    if a.dtype.fields is not None or a.dtype.subdtype is not None:
        raise TypeError(f"cannot serialise a numpy array of structured dtype {a.dtype}")


def pack_array(
    a: np.ndarray,
    *,
    threshold: int = DEFAULT_SHM_THRESHOLD,
    registry: SegmentRegistry | None = None,
) -> ShmHandle | np.ndarray:
    """Put ``a`` in shared memory iff ``payload_nbytes(a) > threshold``; else return ``a``.

    Only the view's elements are written (C order); the dtype travels as ``dtype.str``, byte
    order included.  Raises TypeError for object or structured dtypes (never shipped).
    """
    import numpy as np

    _check_threshold(threshold)
    _check_array_dtype(a)
    nbytes = int(a.nbytes)
    if payload_nbytes(a) <= threshold or nbytes == 0:
        return a

    def fill(mm: mmap.mmap) -> None:
        dst = np.frombuffer(mm, dtype=a.dtype, count=a.size).reshape(a.shape)
        try:
            np.copyto(dst, a, casting="no")
        finally:
            del dst

    name = _write_segment(nbytes, fill, registry)
    return ShmHandle(name, "ndarray", a.dtype.str, tuple(int(d) for d in a.shape), nbytes)


def _read_array(handle: ShmHandle, registry: SegmentRegistry | None) -> np.ndarray:
    import numpy as np

    dtype = np.dtype(handle.dtype)
    if dtype.hasobject or math.prod(handle.shape) * dtype.itemsize != handle.nbytes:
        raise ValueError(f"ShmHandle {handle.name}: bad dtype or shape for {handle.nbytes} bytes")

    def read(mm: mmap.mmap) -> np.ndarray:
        src = np.frombuffer(mm, dtype=dtype, count=math.prod(handle.shape))
        try:
            return src.reshape(handle.shape).copy()
        finally:
            del src

    return _read_segment(handle, read, registry)


# --- PIL images ---------------------------------------------------------------------------


def pack_image(
    im: Image.Image,
    *,
    threshold: int = DEFAULT_SHM_THRESHOLD,
    registry: SegmentRegistry | None = None,
) -> ShmHandle | bytes:
    """Put ``im``'s raw pixel bytes in shared memory iff there are more than ``threshold``.

    Returns a handle (``dtype`` = mode, ``shape`` = ``(width, height)``) or, inline, the raw
    bytes (``im.tobytes()``).  A palette (``P`` images) is not in the segment; the codec ships
    it beside the handle, and :func:`unpack` of an image handle alone returns no palette.
    """
    _check_threshold(threshold)
    data = im.tobytes()
    if len(data) <= threshold:
        return data

    def fill(mm: mmap.mmap) -> None:
        mm[: len(data)] = data

    name = _write_segment(len(data), fill, registry)
    return ShmHandle(name, "image", im.mode, (im.width, im.height), len(data))


def _read_image(handle: ShmHandle, registry: SegmentRegistry | None) -> Image.Image:
    from PIL import Image

    if len(handle.shape) != 2:
        raise ValueError(f"ShmHandle {handle.name}: an image shape is (width, height)")
    width, height = handle.shape

    def read(mm: mmap.mmap) -> Image.Image:
        with memoryview(mm) as view:
            return Image.frombytes(handle.dtype, (width, height), view)

    return _read_segment(handle, read, registry)


# --- receiving ----------------------------------------------------------------------------


def unpack(
    handle: ShmHandle, *, registry: SegmentRegistry | None = None
) -> torch.Tensor | np.ndarray | Image.Image:
    """Copy ``handle``'s data into a fresh tensor/array/image and unlink the segment.

    The segment is gone when this returns, on every path, errors included.  Raises
    FileNotFoundError if it no longer exists (consumed twice), ValueError or TypeError if the
    handle does not describe the segment (bad dtype, shape or size); it is unlinked anyway.
    ``registry``, if given, forgets the name.
    """
    try:
        if handle.kind == "tensor":
            return _read_tensor(handle, registry)
        if handle.kind == "ndarray":
            return _read_array(handle, registry)
        return _read_image(handle, registry)
    except BaseException:
        discard(handle, registry=registry)  # a no-op when the reader already unlinked it
        raise
