"""The stage wire: frames round-trip in pieces, errors cross with their type and fields."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from omni_trio.errors import (
    DuplicateRequestError,
    InvalidConfigError,
    InvalidRequestError,
    WorkerError,
)
from omni_trio.runtime.stage_wire import FrameReader, decode_error, encode_error, frame
from omni_trio.serve.pool import QueueFullError


def test_errors_cross_with_their_type_message_and_fields() -> None:
    cases: list[BaseException] = [
        InvalidRequestError("bad size", param="size"),
        DuplicateRequestError("r1"),
        InvalidConfigError("no", field="stage"),
        WorkerError("died", worker=1, error_type="WorkerDied", fatal=True),
        QueueFullError(3, 3),
        ValueError("plain"),
    ]
    for original in cases:
        back = decode_error(encode_error(original))
        assert type(back) is type(original)
        assert str(back) == str(original)
        assert vars(back) == vars(original)


def test_an_error_of_a_type_not_importable_here_becomes_a_runtime_error() -> None:
    class Local(Exception):
        pass

    record = encode_error(Local("boom"))
    back = decode_error(record)
    assert type(back) is RuntimeError
    assert "Local" in str(back) and "boom" in str(back)
    # A BaseException that is not an Exception never crosses as itself.
    back = decode_error(encode_error(KeyboardInterrupt("stop")))
    assert type(back) is RuntimeError


def test_unpicklable_attributes_are_left_out() -> None:
    exc = InvalidRequestError("x", param="p")
    exc.handle = lambda: None  # type: ignore[attr-defined]
    back = decode_error(encode_error(exc))
    assert back.param == "p"  # type: ignore[attr-defined]
    assert not hasattr(back, "handle")


async def test_frames_arrive_whole_however_the_bytes_are_split() -> None:
    send, receive = trio.testing.memory_stream_one_way_pair()
    reader = FrameReader(receive)
    messages = [("out", "r1", {"x": list(range(1000))}), ("closed", None), ("state", b"\0" * 70000)]
    data = b"".join(frame(m) for m in messages)

    async def write() -> None:
        for i in range(0, len(data), 777):
            await send.send_all(data[i : i + 777])
        await send.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(write)
        got = [await reader.receive() for _ in messages]
        assert got == messages
        assert await reader.receive() is None


async def test_a_connection_cut_inside_a_frame_is_an_error() -> None:
    send, receive = trio.testing.memory_stream_one_way_pair()
    reader = FrameReader(receive)
    await send.send_all(frame(("out", "r1", None))[:-3])
    await send.aclose()
    with pytest.raises(ValueError, match="inside a frame"):
        await reader.receive()


async def test_something_that_is_not_a_message_is_an_error() -> None:
    import pickle
    import struct

    send, receive = trio.testing.memory_stream_one_way_pair()
    body = pickle.dumps([1, 2])
    await send.send_all(struct.pack(">I", len(body)) + body)
    with pytest.raises(ValueError, match="not a message"):
        await FrameReader(receive).receive()
