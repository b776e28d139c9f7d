"""``RequestStream``: one request's outputs; leaving it early for any reason aborts the request."""

from __future__ import annotations

import gc
import math

import pytest
import trio
import trio.testing

from omni_trio._core.lifecycle import RequestStatus
from omni_trio._core.messages import DiffusionOutput
from omni_trio.runtime.request_stream import OutputStreams, RequestStream

CAP_S = 5.0
S = RequestStatus


def chunk(index: int) -> DiffusionOutput:
    return DiffusionOutput("r", S.RUNNING, finished=False, chunk_index=index, total_chunks=3)


TERMINAL = DiffusionOutput("r", S.FINISHED_COMPLETED, finished=True, seed=9)


class Harness:
    def __init__(self, *, with_on_dropped: bool = False) -> None:
        self.send, receive = trio.open_memory_channel[DiffusionOutput](math.inf)
        self.gone: list[str] = []
        self.dropped: list[str] = []
        self.stream = RequestStream(
            "r", 9, receive, self.gone.append, self.dropped.append if with_on_dropped else None
        )


async def test_attributes() -> None:
    h = Harness()
    assert h.stream.request_id == "r"
    assert h.stream.seed == 9
    assert h.stream.__aiter__() is h.stream
    await h.stream.aclose()


async def test_yields_chunks_then_ends_after_the_terminal_output() -> None:
    h = Harness()
    for i in range(2):
        h.send.send_nowait(chunk(i))
    h.send.send_nowait(TERMINAL)
    with trio.fail_after(CAP_S):
        received = [out async for out in h.stream]
    assert received == [chunk(0), chunk(1), TERMINAL]
    assert h.gone == []  # read to the end: nothing to abort
    # The engine side sees the consumer gone only as a closed channel.
    with pytest.raises(trio.BrokenResourceError):
        h.send.send_nowait(chunk(9))
    with pytest.raises(StopAsyncIteration):
        await h.stream.__anext__()


async def test_output_after_the_terminal_one_is_never_yielded() -> None:
    h = Harness()
    h.send.send_nowait(TERMINAL)
    with trio.fail_after(CAP_S):
        assert await h.stream.__anext__() == TERMINAL
        with pytest.raises(StopAsyncIteration):
            await h.stream.__anext__()


async def test_channel_closed_without_terminal_ends_without_abort() -> None:
    h = Harness()
    h.send.send_nowait(chunk(0))
    await h.send.aclose()
    with trio.fail_after(CAP_S):
        received = [out async for out in h.stream]
    assert received == [chunk(0)]
    assert h.gone == []


async def test_cancelled_consumer_aborts_the_request() -> None:
    h = Harness()
    with trio.fail_after(CAP_S):
        with trio.CancelScope() as scope:
            scope.cancel()
            await h.stream.__anext__()
    assert scope.cancelled_caught
    assert h.gone == ["r"]
    with pytest.raises(StopAsyncIteration):
        await h.stream.__anext__()


async def test_cancelled_while_blocked_aborts_the_request() -> None:
    h = Harness()
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:

            async def consume() -> None:
                async for _ in h.stream:
                    pass  # pragma: no cover

            nursery.start_soon(consume)
            await trio.testing.wait_all_tasks_blocked()
            assert h.gone == []
            nursery.cancel_scope.cancel()
    assert h.gone == ["r"]


async def test_aclose_before_the_terminal_output_aborts_once() -> None:
    h = Harness()
    h.send.send_nowait(chunk(0))
    with trio.fail_after(CAP_S):
        assert await h.stream.__anext__() == chunk(0)
        await h.stream.aclose()
        await h.stream.aclose()
    assert h.gone == ["r"]
    with pytest.raises(trio.BrokenResourceError):
        h.send.send_nowait(TERMINAL)


def test_close_is_synchronous_aborts_once_and_ends_the_stream() -> None:
    h = Harness()
    h.send.send_nowait(chunk(0))
    h.stream.close()
    h.stream.close()
    assert h.gone == ["r"]
    with pytest.raises(trio.BrokenResourceError):
        h.send.send_nowait(TERMINAL)
    finished = Harness()
    finished.send.send_nowait(TERMINAL)

    async def read_all() -> None:
        async for _ in finished.stream:
            pass

    trio.run(read_all)
    finished.stream.close()
    assert finished.gone == []


async def test_aclose_after_the_terminal_output_does_not_abort() -> None:
    h = Harness()
    h.send.send_nowait(TERMINAL)
    with trio.fail_after(CAP_S):
        async for _ in h.stream:
            pass
        await h.stream.aclose()
    assert h.gone == []


async def test_break_out_of_async_with_aborts() -> None:
    h = Harness()
    h.send.send_nowait(chunk(0))
    h.send.send_nowait(chunk(1))
    with trio.fail_after(CAP_S):
        async with h.stream as chunks:
            async for _ in chunks:
                break
    assert h.gone == ["r"]


async def test_an_exception_in_the_body_aborts() -> None:
    h = Harness()
    with trio.fail_after(CAP_S):
        with pytest.raises(KeyError):
            async with h.stream:
                raise KeyError("consumer failed")
    assert h.gone == ["r"]


async def test_async_with_read_to_the_end_does_not_abort() -> None:
    h = Harness()
    h.send.send_nowait(TERMINAL)
    with trio.fail_after(CAP_S):
        async with h.stream as chunks:
            outs = [out async for out in chunks]
    assert outs == [TERMINAL]
    assert h.gone == []


async def test_a_dropped_unread_stream_aborts() -> None:
    h = Harness()
    stream = h.stream
    del h.stream
    del stream
    gc.collect()
    assert h.gone == ["r"]


async def test_a_dropped_finished_stream_does_not_abort() -> None:
    h = Harness()
    h.send.send_nowait(TERMINAL)
    with trio.fail_after(CAP_S):
        async for _ in h.stream:
            pass
    del h.stream
    gc.collect()
    assert h.gone == []


async def test_a_dropped_stream_uses_on_dropped_when_given() -> None:
    h = Harness(with_on_dropped=True)
    del h.stream
    gc.collect()
    assert h.dropped == ["r"]
    assert h.gone == []


async def test_leaving_early_uses_on_consumer_gone_even_with_on_dropped() -> None:
    h = Harness(with_on_dropped=True)
    with trio.fail_after(CAP_S):
        await h.stream.aclose()
    del h.stream
    gc.collect()
    assert h.gone == ["r"]
    assert h.dropped == []


# -- OutputStreams: the engine's ends -------------------------------------------------------


async def test_output_streams_deliver_chunks_then_the_terminal_one() -> None:
    gone: list[str] = []
    streams = OutputStreams(on_gone=gone.append)
    with trio.fail_after(CAP_S):
        stream = streams.open("r", seed=9)
        assert streams.ids() == {"r"}
        streams.send("r", chunk(0))
        streams.finish("r", TERMINAL)
        assert streams.ids() == set()
        assert [o.chunk_index for o in [o async for o in stream]] == [0, 0]
    assert gone == []  # it ended by its terminal output, not by its consumer


async def test_output_streams_report_a_leaving_consumer_once_and_only_for_its_own_stream() -> None:
    gone: list[str] = []
    streams = OutputStreams(on_gone=gone.append)
    with trio.fail_after(CAP_S):
        old = streams.open("x", seed=1)
        streams.finish("x", TERMINAL)  # x ended; its output sits unread
        new = streams.open("x", seed=2)  # the id is reused
        await old.aclose()
        assert gone == [] and streams.ids() == {"x"}
        await new.aclose()
        assert gone == ["x"] and streams.ids() == set()
        del old, new
        gc.collect()
        await trio.testing.wait_all_tasks_blocked()
    assert gone == ["x"]


async def test_a_stream_dropped_unread_is_reported_on_the_next_turn() -> None:
    gone: list[str] = []
    streams = OutputStreams(on_gone=gone.append)
    with trio.fail_after(CAP_S):
        stream = streams.open("d", seed=1)
        del stream
        gc.collect()
        assert gone == []  # deferred: a finalizer may run anywhere
        await trio.testing.wait_all_tasks_blocked()
    assert gone == ["d"]
