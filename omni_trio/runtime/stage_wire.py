"""The wire between a process-backed stage and its caller (:mod:`.stage`, :mod:`.stage_child`).

One stream socket (a socketpair made by the caller) carries frames in both directions: a
4-byte big-endian length, then a pickle.  Both ends are this package in processes one of
them started, so pickle is the codec (outputs carry PIL images and numpy arrays as they
are).  Exceptions travel as :class:`WireError` records, rebuilt without calling their
``__init__`` (the error tree's constructors take keyword arguments pickle would not pass):
same type, same message, same attributes.

Messages are tuples whose first item names them:

* caller -> stage: ``("open", config)`` once, first; ``("submit", key, request_id,
  request)``; ``("abort", ids)``; ``("gone", key)`` (the consumer left its stream);
  ``("call", call_id, method, (args, kwargs))``; ``("close",)``.
* stage -> caller: ``("ready", model_info, snapshot)`` or ``("failed", error)`` once, first;
  ``("rejected", key, error)``; ``("out", key, output)``; ``("reply", call_id, ok,
  value_or_error)``; ``("state", snapshot)``; ``("closed", snapshot)`` last.

``key`` numbers a submission (a request id may be used again once its request ended, and a
late message of the old one must never reach the new one).  What the user gave or the model
made (``request``, ``output``, the call's arguments, its value or error) travels as bytes
pickled on their own, inside the frame: what cannot be pickled is refused to its one request
or call where it is made, and what cannot be unpickled on the other side fails only that
request or call, never the connection.
"""

from __future__ import annotations

import importlib
import pickle
import struct
from dataclasses import dataclass
from typing import Any

import trio

__all__ = ["MAX_FRAME", "FrameReader", "WireError", "decode_error", "encode_error", "frame"]

_HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 31  # a frame longer than this is a protocol error


@dataclass(frozen=True)
class WireError:
    """An exception as it crosses the wire."""

    module: str
    qualname: str
    args: tuple[Any, ...]
    attrs: dict[str, Any]
    text: str


def encode_error(exc: BaseException) -> WireError:
    """``exc`` as a record whose parts pickle (an attribute that does not is left out)."""
    attrs: dict[str, Any] = {}
    for name, value in vars(exc).items():
        try:
            pickle.dumps(value)
        except Exception:
            continue
        attrs[name] = value
    args: tuple[Any, ...] = ()
    try:
        pickle.dumps(exc.args)
        args = exc.args
    except Exception:
        args = (str(exc),)
    cls = type(exc)
    return WireError(cls.__module__, cls.__qualname__, args, attrs, str(exc))


def decode_error(record: WireError) -> BaseException:
    """The exception ``record`` describes: the same type where it can be imported here (an
    ``Exception``, never a ``BaseException`` that would unwind the caller's task), else a
    ``RuntimeError`` naming the type."""
    cls: Any = None
    try:
        cls = importlib.import_module(record.module)
        for part in record.qualname.split("."):
            cls = getattr(cls, part)
    except Exception:
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return RuntimeError(f"{record.qualname}: {record.text}")
    exc: Exception = cls.__new__(cls)
    Exception.__init__(exc, *record.args)
    try:
        vars(exc).update(record.attrs)
    except TypeError:  # pragma: no cover - an exception type without a __dict__
        pass
    return exc


def frame(message: tuple[Any, ...]) -> bytes:
    """One message as the bytes of its frame; raises what pickling raised, or ``ValueError``
    past :data:`MAX_FRAME`."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(body) > MAX_FRAME:
        raise ValueError(f"a message of {len(body)} bytes (at most {MAX_FRAME})")
    return _HEADER.pack(len(body)) + body


class FrameReader:
    """Reads whole messages from a trio stream."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = bytearray()

    async def _fill(self, size: int) -> bool:
        while len(self._buffer) < size:
            chunk = await self._stream.receive_some(max(65536, size - len(self._buffer)))
            if not chunk:
                return False
            self._buffer += chunk
        return True

    async def receive(self) -> tuple[Any, ...] | None:
        """The next message; None at the end of the stream (the peer closed or died).
        Raises ``ValueError`` on a malformed frame."""
        if not await self._fill(_HEADER.size):
            if self._buffer:
                raise ValueError("the stage connection ended inside a frame header")
            return None
        (length,) = _HEADER.unpack_from(self._buffer)
        if length > MAX_FRAME:
            raise ValueError(f"frame of {length} bytes")
        if not await self._fill(_HEADER.size + length):
            raise ValueError("the stage connection ended inside a frame")
        body = bytes(self._buffer[_HEADER.size : _HEADER.size + length])
        del self._buffer[: _HEADER.size + length]
        message = pickle.loads(body)
        if not isinstance(message, tuple) or not message or not isinstance(message[0], str):
            raise ValueError(f"not a message: {type(message).__name__}")
        return message
