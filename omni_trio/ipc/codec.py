"""The wire codec: our messages to msgpack ``bytes`` and back, big payloads via shared memory.

tractor 0.1.0a5's channel carries msgpack only: tuples arrive as lists, and numpy, torch and
dataclasses cannot be sent at all (notes/tractor-0.1.0a5.md §5 item 7).  So a message is
encoded here to ``bytes``, which the channel carries untouched, and decoded on the other side.

Wire format (msgspec's msgpack encoder; one pass in Python builds the tree it encodes):

* ``None``, ``bool``, ``int``, ``float``, ``str``, ``bytes`` and ``list`` are native msgpack.
  A ``dict`` must have ``str`` keys; any other :class:`~collections.abc.Mapping` arrives as a
  ``dict``.
* Everything else that is structured is a **one-entry map with an integer key** (user dicts
  have ``str`` keys, so nothing collides): ``{0: [items]}`` tuple, ``{1: [items]}`` frozenset,
  ``{2: [items]}`` set, ``{3: [type name, {field: value}]}`` a registered dataclass
  (rebuilt through its ``__init__``, so its validation runs), ``{4: [type name, value]}`` a
  registered enum.
* Binary leaves are msgpack **ext types**, each a little-endian u32 header length, a msgpack
  header and raw bytes: ``1`` numpy array ``[dtype.str, shape]``, ``2`` torch tensor
  ``[dtype name, shape]`` (raw bytes, so bf16 is bit-exact; detached, moved to CPU, made
  contiguous), ``3`` numpy scalar ``[dtype.str]``, ``4`` PIL image ``[mode, width, height,
  palette mode, palette bytes, shm handle]``, ``5`` :class:`~omni_trio.ipc.shm.ShmHandle`
  (header only).  A tensor or array whose :func:`~omni_trio.ipc.shm.payload_nbytes` exceeds
  the encoder's ``shm_threshold``, or an image with more raw bytes than that, is written to
  shared memory and only its handle travels.
* What arrives is sometimes plainer than what left: tensor and ndarray subclasses arrive as
  the base class, a tensor on CPU without ``requires_grad``, a PIL image as a plain
  ``Image.Image`` (pixels, mode, size and palette; ``info`` is not kept).  Types not listed
  here, and ``bytearray``/``memoryview``, raise TypeError rather than arrive as something else.
* Raw bytes are in native byte order for tensors (little-endian everywhere we run); numpy
  dtypes carry their byte order.

:class:`Decoder` copies every shared-memory payload out and unlinks its segment while it
decodes; if decoding fails half-way it still unlinks every segment the message names.
Bytes that were encoded but will never be decoded (a dropped result, a send that failed) must
go through :func:`discard_message`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from .._core.lifecycle import RequestStatus
from .._core.messages import (
    AsyncOutput,
    AsyncOutputKind,
    BatchRunnerOutput,
    DiffusionOutput,
    Heartbeat,
    NewRequestData,
    RequestMetrics,
    RunnerOutput,
    SchedulerOutput,
    WorkerAbort,
    WorkerCall,
)
from .._core.request import DiffusionRequest, SamplingParams
from .shm import (
    DEFAULT_SHM_THRESHOLD,
    SegmentRegistry,
    ShmHandle,
    _check_array_dtype,
    _plain_cpu_tensor,
    _tensor_bytes_view,
    _torch_dtype,
    _torch_dtype_name,
    discard,
    pack_array,
    pack_image,
    pack_tensor,
    unpack,
)

if TYPE_CHECKING:
    import numpy as np
    import torch
    from PIL import Image

__all__ = ["MESSAGE_TYPES", "Decoder", "Encoder", "decode", "discard_message", "encode"]

# The dataclasses and enums every Encoder/Decoder knows, by ``__qualname__``.
MESSAGE_TYPES: tuple[type, ...] = (
    AsyncOutput,
    AsyncOutputKind,
    BatchRunnerOutput,
    DiffusionOutput,
    DiffusionRequest,
    Heartbeat,
    NewRequestData,
    RequestMetrics,
    RequestStatus,
    RunnerOutput,
    SamplingParams,
    SchedulerOutput,
    WorkerAbort,
    WorkerCall,
)

_TAG_TUPLE = 0
_TAG_FROZENSET = 1
_TAG_SET = 2
_TAG_DATACLASS = 3
_TAG_ENUM = 4

_EXT_NDARRAY = 1
_EXT_TENSOR = 2
_EXT_NPSCALAR = 3
_EXT_IMAGE = 4
_EXT_SHM = 5

_ATOMIC = frozenset({type(None), bool, int, float, str, bytes})
_U32 = struct.Struct("<I")
_Ext = msgspec.msgpack.Ext
_header_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder()


def _registry_of(extra_types: Iterable[type]) -> dict[str, type]:
    by_name: dict[str, type] = {}
    for cls in (*MESSAGE_TYPES, *extra_types):
        if not (dataclasses.is_dataclass(cls) or issubclass(cls, enum.Enum)):
            raise TypeError(f"{cls!r} is neither a dataclass nor an Enum")
        name = cls.__qualname__
        if by_name.get(name, cls) is not cls:
            raise ValueError(f"two message types are named {name!r}")
        by_name[name] = cls
    return by_name


def _ext(code: int, header: list[Any], *raw: Any) -> msgspec.msgpack.Ext:
    head = _header_encoder.encode(header)
    return _Ext(code, b"".join((_U32.pack(len(head)), head, *raw)))


def _split_ext(data: memoryview) -> tuple[Any, memoryview]:
    if len(data) < 4:
        raise ValueError("truncated ext payload")
    (size,) = _U32.unpack_from(data)
    if 4 + size > len(data):
        raise ValueError("truncated ext header")
    return _header_decoder.decode(data[4 : 4 + size]), data[4 + size :]


def _shape(obj: Any) -> tuple[int, ...]:
    if not isinstance(obj, list) or not all(type(d) is int and d >= 0 for d in obj):
        raise ValueError(f"bad shape {obj!r}")
    return tuple(obj)


class Encoder:
    """Encodes messages to ``bytes``; big tensors/arrays/images go to shared memory.

    ``shm_threshold``: a payload goes to shared memory iff its size is strictly greater
    (``None``: never, everything inline).  ``registry``: where the names of segments this
    encoder creates are registered (see :class:`~omni_trio.ipc.shm.SegmentRegistry`).
    ``extra_types``: more dataclasses/enums to accept besides :data:`MESSAGE_TYPES` (the
    decoder must be given the same ones).  Use one encoder per thread.
    """

    def __init__(
        self,
        *,
        shm_threshold: int | None = DEFAULT_SHM_THRESHOLD,
        registry: SegmentRegistry | None = None,
        extra_types: Iterable[type] = (),
    ) -> None:
        if shm_threshold is not None and (type(shm_threshold) is not int or shm_threshold < 0):
            raise ValueError(f"shm_threshold must be an int >= 0 or None, got {shm_threshold!r}")
        self.shm_threshold = shm_threshold
        self.registry = registry
        self._types = _registry_of(extra_types)
        self._msgpack = msgspec.msgpack.Encoder()
        # type -> how to turn an instance into wire form; filled lazily for leaf types.
        self._handlers: dict[type, Callable[[Any, list[ShmHandle]], Any]] = {
            list: self._list,
            tuple: self._tuple,
            dict: self._dict,
            frozenset: self._frozenset,
            set: self._set,
        }
        for cls in self._types.values():
            self._handlers[cls] = self._enum if issubclass(cls, enum.Enum) else self._dataclass
        self._fields: dict[type, tuple[str, ...]] = {
            cls: tuple(f.name for f in dataclasses.fields(cls) if f.init)
            for cls in self._types.values()
            if dataclasses.is_dataclass(cls)
        }

    def encode(self, obj: Any) -> bytes:
        """``obj`` as msgpack bytes.

        Raises TypeError naming the type of the first value it cannot encode (and
        OverflowError for ints outside [-2**63, 2**64)).  On any error, the segments this
        call created are unlinked again.
        """
        created: list[ShmHandle] = []
        try:
            return self._msgpack.encode(self._walk(obj, created))
        except BaseException:
            for handle in created:
                discard(handle, registry=self.registry)
            raise

    # --- the walk -------------------------------------------------------------------------

    def _walk(self, obj: Any, created: list[ShmHandle]) -> Any:
        cls = type(obj)
        if cls in _ATOMIC:
            return obj
        handler = self._handlers.get(cls)
        if handler is None:
            handler = self._handler_for(cls)
        return handler(obj, created)

    def _handler_for(self, cls: type) -> Callable[[Any, list[ShmHandle]], Any]:
        handler: Callable[[Any, list[ShmHandle]], Any] | None = None
        np = sys.modules.get("numpy")
        torch = sys.modules.get("torch")
        pil = sys.modules.get("PIL.Image")
        if np is not None and issubclass(cls, np.ndarray):
            handler = self._ndarray
        elif np is not None and issubclass(cls, np.generic):
            handler = self._npscalar
        elif torch is not None and issubclass(cls, torch.Tensor):
            handler = self._tensor
        elif pil is not None and issubclass(cls, pil.Image):
            handler = self._image
        elif issubclass(cls, Mapping):
            handler = self._dict
        if handler is None:
            raise TypeError(
                f"cannot encode an object of type {cls.__module__}.{cls.__qualname__}: not a "
                "registered message type, container, array, tensor or PIL image"
            )
        self._handlers[cls] = handler
        return handler

    def _list(self, obj: list[Any], created: list[ShmHandle]) -> list[Any]:
        return [self._walk(x, created) for x in obj]

    def _tuple(self, obj: tuple[Any, ...], created: list[ShmHandle]) -> dict[int, Any]:
        return {_TAG_TUPLE: [self._walk(x, created) for x in obj]}

    def _frozenset(self, obj: frozenset[Any], created: list[ShmHandle]) -> dict[int, Any]:
        return {_TAG_FROZENSET: [self._walk(x, created) for x in obj]}

    def _set(self, obj: set[Any], created: list[ShmHandle]) -> dict[int, Any]:
        return {_TAG_SET: [self._walk(x, created) for x in obj]}

    def _dict(self, obj: Mapping[Any, Any], created: list[ShmHandle]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in obj.items():
            if type(key) is not str:
                raise TypeError(f"dict keys must be str, got {type(key).__name__} key {key!r}")
            out[key] = self._walk(value, created)
        return out

    def _dataclass(self, obj: Any, created: list[ShmHandle]) -> dict[int, Any]:
        cls = type(obj)
        fields = {name: self._walk(getattr(obj, name), created) for name in self._fields[cls]}
        return {_TAG_DATACLASS: [cls.__qualname__, fields]}

    def _enum(self, obj: enum.Enum, created: list[ShmHandle]) -> dict[int, Any]:
        return {_TAG_ENUM: [type(obj).__qualname__, self._walk(obj.value, created)]}

    def _shm(self, handle: ShmHandle, created: list[ShmHandle]) -> msgspec.msgpack.Ext:
        created.append(handle)
        return _Ext(_EXT_SHM, _header_encoder.encode(handle.to_wire()))

    def _ndarray(self, obj: np.ndarray, created: list[ShmHandle]) -> msgspec.msgpack.Ext:
        import numpy as np

        if self.shm_threshold is not None:
            packed = pack_array(obj, threshold=self.shm_threshold, registry=self.registry)
            if isinstance(packed, ShmHandle):
                return self._shm(packed, created)
        else:
            _check_array_dtype(obj)
        flat = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
        return _ext(_EXT_NDARRAY, [obj.dtype.str, list(obj.shape)], flat.data)

    def _npscalar(self, obj: np.generic, created: list[ShmHandle]) -> msgspec.msgpack.Ext:
        if obj.dtype.hasobject:
            raise TypeError(f"cannot encode a numpy scalar of dtype {obj.dtype}")
        return _ext(_EXT_NPSCALAR, [obj.dtype.str], obj.tobytes())

    def _tensor(self, obj: torch.Tensor, created: list[ShmHandle]) -> msgspec.msgpack.Ext:
        if self.shm_threshold is not None:
            packed = pack_tensor(obj, threshold=self.shm_threshold, registry=self.registry)
            if isinstance(packed, ShmHandle):
                return self._shm(packed, created)
            cpu = packed.contiguous()
        else:
            cpu = _plain_cpu_tensor(obj).contiguous()
        raw = _tensor_bytes_view(cpu).numpy().data if cpu.numel() else b""
        header = [_torch_dtype_name(cpu.dtype), list(cpu.shape)]
        return _ext(_EXT_TENSOR, header, raw)

    def _image(self, obj: Image.Image, created: list[ShmHandle]) -> msgspec.msgpack.Ext:
        palette_mode: str | None = None
        palette: bytes | None = None
        if obj.mode in ("P", "PA") and obj.palette is not None:
            palette_mode = obj.palette.mode
            palette = obj.palette.tobytes()
        threshold = sys.maxsize if self.shm_threshold is None else self.shm_threshold
        packed = pack_image(obj, threshold=threshold, registry=self.registry)
        header = [obj.mode, obj.width, obj.height, palette_mode, palette]
        if isinstance(packed, ShmHandle):
            created.append(packed)
            return _ext(_EXT_IMAGE, [*header, packed.to_wire()])
        return _ext(_EXT_IMAGE, [*header, None], packed)


class Decoder:
    """Decodes what :class:`Encoder` made; copies shared-memory payloads out and unlinks them.

    ``registry``: if given, the names of consumed segments are forgotten in it (useful when
    the encoder and decoder share one in a process).  ``extra_types`` must match the
    encoder's.  Use one decoder per thread.
    """

    def __init__(
        self, *, registry: SegmentRegistry | None = None, extra_types: Iterable[type] = ()
    ) -> None:
        self.registry = registry
        self._types = _registry_of(extra_types)
        self._msgpack = msgspec.msgpack.Decoder(ext_hook=self._ext_hook)

    def decode(self, data: bytes | bytearray | memoryview) -> Any:
        """The object ``data`` encodes.

        Every shared-memory segment named in ``data`` is unlinked when this returns or
        raises.  Raises ValueError for malformed data, an unknown type name or a message
        its dataclass rejects (msgspec.DecodeError is a ValueError), FileNotFoundError if a
        segment was already consumed.
        """
        try:
            return self._restore(self._msgpack.decode(data))
        except BaseException as exc:
            discard_message(data, registry=self.registry)
            if isinstance(exc, TypeError | AttributeError | IndexError | KeyError):
                raise ValueError(f"malformed message: {exc!r}") from exc
            raise

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code == _EXT_SHM:
            return unpack(ShmHandle.from_wire(_header_decoder.decode(data)), registry=self.registry)
        header, raw = _split_ext(data)
        if code == _EXT_NDARRAY:
            return _decode_ndarray(header, raw)
        if code == _EXT_TENSOR:
            return _decode_tensor(header, raw)
        if code == _EXT_NPSCALAR:
            return _decode_npscalar(header, raw)
        if code == _EXT_IMAGE:
            return self._decode_image(header, raw)
        raise ValueError(f"unknown msgpack ext type {code}")

    def _decode_image(self, header: Any, raw: memoryview) -> Image.Image:
        from PIL import Image

        mode, width, height, palette_mode, palette, handle = header
        if handle is not None:
            image = unpack(ShmHandle.from_wire(handle), registry=self.registry)
            if not isinstance(image, Image.Image):
                raise ValueError("image ext names a segment that is not an image")
        else:
            image = Image.frombytes(mode, (width, height), raw)
        if palette is not None:
            image.putpalette(palette, palette_mode)
        return image

    def _restore(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is list:
            return [self._restore(x) for x in obj]
        if cls is not dict:
            return obj
        if not obj or type(next(iter(obj))) is str:
            return {key: self._restore(value) for key, value in obj.items()}
        if len(obj) != 1:
            raise ValueError(f"malformed tagged value with keys {list(obj)}")
        [(tag, payload)] = obj.items()
        if tag == _TAG_TUPLE:
            return tuple(self._restore(x) for x in payload)
        if tag == _TAG_FROZENSET:
            return frozenset(self._restore(x) for x in payload)
        if tag == _TAG_SET:
            return {self._restore(x) for x in payload}
        if tag == _TAG_DATACLASS:
            name, fields = payload
            cls = self._lookup(name, is_enum=False)
            return cls(**{key: self._restore(value) for key, value in fields.items()})
        if tag == _TAG_ENUM:
            name, value = payload
            return self._lookup(name, is_enum=True)(self._restore(value))
        raise ValueError(f"unknown tag {tag!r}")

    def _lookup(self, name: str, *, is_enum: bool) -> Any:
        cls = self._types.get(name)
        if cls is None:
            raise ValueError(f"unknown message type {name!r}")
        if issubclass(cls, enum.Enum) != is_enum:
            raise ValueError(f"{name!r} is not {'an enum' if is_enum else 'a dataclass'}")
        return cls


def _decode_ndarray(header: Any, raw: memoryview) -> np.ndarray:
    import numpy as np

    dtype_str, shape = header
    dtype = np.dtype(dtype_str)
    if dtype.hasobject:
        raise ValueError("object arrays are never on the wire")
    shape = _shape(shape)
    count = math.prod(shape)
    if count * dtype.itemsize != len(raw):
        raise ValueError(f"array of {dtype} {shape} cannot hold {len(raw)} bytes")
    return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape).copy()


def _decode_npscalar(header: Any, raw: memoryview) -> np.generic:
    import numpy as np

    (dtype_str,) = header
    dtype = np.dtype(dtype_str)
    if dtype.hasobject or dtype.itemsize != len(raw):
        raise ValueError(f"bad numpy scalar of {dtype}")
    scalar: np.generic = np.frombuffer(raw, dtype=dtype, count=1).copy()[0]
    return scalar


def _decode_tensor(header: Any, raw: memoryview) -> torch.Tensor:
    import numpy as np
    import torch

    dtype_name, shape = header
    dtype, shape = _torch_dtype(dtype_name), _shape(shape)
    if math.prod(shape) * dtype.itemsize != len(raw):  # checked before allocating
        raise ValueError(f"tensor of {dtype} {shape} cannot hold {len(raw)} bytes")
    out = torch.empty(shape, dtype=dtype)
    if len(raw):
        np.copyto(_tensor_bytes_view(out).numpy(), np.frombuffer(raw, dtype=np.uint8))
    return out


def _discard_hook(registry: SegmentRegistry | None, dropped: list[str]) -> Callable[..., None]:
    def hook(code: int, data: memoryview) -> None:
        try:
            if code == _EXT_SHM:
                wire = _header_decoder.decode(data)
            elif code == _EXT_IMAGE:
                wire = _split_ext(data)[0][5]
            else:
                return
            if wire is not None:
                handle = ShmHandle.from_wire(wire)
                if discard(handle, registry=registry):
                    dropped.append(handle.name)
        except (ValueError, TypeError, IndexError):
            pass  # not a valid handle: nothing of ours to unlink

    return hook


def discard_message(
    data: bytes | bytearray | memoryview, *, registry: SegmentRegistry | None = None
) -> int:
    """Unlink every shared-memory segment named in encoded ``data`` without reading any.

    For encoded messages that will never be decoded (a dropped result, a failed send).
    Tolerates malformed data (unlinks what it can reach).  Returns how many segments this
    call removed; names already gone are skipped silently.
    """
    dropped: list[str] = []
    try:
        msgspec.msgpack.Decoder(ext_hook=_discard_hook(registry, dropped)).decode(data)
    except msgspec.DecodeError:
        pass
    return len(dropped)


_defaults = threading.local()


def encode(obj: Any) -> bytes:
    """:meth:`Encoder.encode` with a default encoder (1 MB threshold, no registry), one per
    thread.  A process that must clean up after a crashed peer wants an :class:`Encoder`
    with a tagged :class:`~omni_trio.ipc.shm.SegmentRegistry` instead."""
    encoder = getattr(_defaults, "encoder", None)
    if encoder is None:
        encoder = _defaults.encoder = Encoder()
    return encoder.encode(obj)


def decode(data: bytes | bytearray | memoryview) -> Any:
    """:meth:`Decoder.decode` with a default decoder, one per thread."""
    decoder = getattr(_defaults, "decoder", None)
    if decoder is None:
        decoder = _defaults.decoder = Decoder()
    return decoder.decode(data)
