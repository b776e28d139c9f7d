"""``OutputPacker``: COMPUTE_DONE at once, OUTPUT_READY from its own thread, in order.

Real threads, so every wait is bounded by ``CAP_S`` and ordering is forced with
``threading.Event`` gates, never with sleeps.  The conftest leak check proves ``close`` joins
the packer thread.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from omni_trio._core.messages import AsyncOutput, AsyncOutputKind, BatchRunnerOutput, RunnerOutput
from omni_trio.errors import EngineClosedError
from omni_trio.executors.result_pump import ResultPump, ThreadReplySender
from omni_trio.worker.output_packer import OutputPacker, record_ready_event
from omni_trio.worker.runner import convert_output

CAP_S = 10.0
COMPUTE_DONE = AsyncOutputKind.COMPUTE_DONE
OUTPUT_READY = AsyncOutputKind.OUTPUT_READY


class Replies:
    """A thread-safe reply sink that records what was sent, in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.messages: list[AsyncOutput] = []

    def __call__(self, message: AsyncOutput) -> None:
        with self._lock:
            self.messages.append(message)

    def kinds(self) -> list[tuple[AsyncOutputKind, str | None]]:
        with self._lock:
            return [(m.kind, m.async_output_id) for m in self.messages]


def batch(*request_ids: str) -> BatchRunnerOutput:
    return BatchRunnerOutput.from_list([RunnerOutput(rid, images=(rid,)) for rid in request_ids])


class Gate:
    """Blocks ``pack`` until opened; reports when packing started."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.opened = threading.Event()

    def pack(self, output: BatchRunnerOutput) -> Any:
        self.started.set()
        assert self.opened.wait(CAP_S), "gate never opened"
        return ("packed", output.request_ids)


@pytest.fixture
def replies() -> Replies:
    return Replies()


@pytest.fixture
def gate() -> Gate:
    return Gate()


@pytest.fixture
def make_packer(replies: Replies) -> Iterator[Callable[..., OutputPacker]]:
    packers: list[OutputPacker] = []

    def make(pack: Callable[[BatchRunnerOutput], Any] | None = None, **kw: Any) -> OutputPacker:
        packer = OutputPacker(replies, pack, **kw)
        packers.append(packer)
        return packer

    yield make
    for packer in packers:
        assert packer.close(CAP_S)


def test_compute_done_is_sent_before_packing_finishes(
    make_packer: Callable[..., OutputPacker], replies: Replies, gate: Gate
) -> None:
    packer = make_packer(gate.pack)
    output_id = packer.submit("rpc-1", batch("a", "b"))
    # COMPUTE_DONE was handed to reply before submit returned.
    assert replies.messages == [
        AsyncOutput(COMPUTE_DONE, rpc_id="rpc-1", async_output_id=output_id)
    ]
    assert gate.started.wait(CAP_S)
    # Packing is under way and blocked: still only COMPUTE_DONE, one output pending.
    assert replies.kinds() == [(COMPUTE_DONE, output_id)]
    assert packer.pending == 1
    gate.opened.set()
    assert packer.drain(CAP_S)
    assert packer.pending == 0
    assert replies.messages[1] == AsyncOutput(
        OUTPUT_READY, async_output_id=output_id, result=("packed", ("a", "b"))
    )


def test_packing_error_becomes_an_error_output_ready(
    make_packer: Callable[..., OutputPacker], replies: Replies
) -> None:
    def pack(output: BatchRunnerOutput) -> Any:
        if output.request_ids == ("a",):
            raise ValueError("cannot encode")
        return output.request_ids

    packer = make_packer(pack)
    output_id = packer.submit("rpc-1", batch("a"))
    assert packer.drain(CAP_S)
    ready = replies.messages[1]
    assert (ready.kind, ready.async_output_id, ready.result) == (OUTPUT_READY, output_id, None)
    assert ready.error == "Background output packing failed: ValueError: cannot encode"
    assert ready.error_type == "ValueError"
    # The packer lives on.
    packer.submit("rpc-2", batch("b"))
    assert packer.drain(CAP_S)
    assert (replies.messages[3].error, replies.messages[3].result) == (None, ("b",))


def test_many_submissions_keep_their_order(
    make_packer: Callable[..., OutputPacker], replies: Replies, gate: Gate
) -> None:
    packer_threads: set[str] = set()

    def pack(output: BatchRunnerOutput) -> Any:
        packer_threads.add(threading.current_thread().name)
        if output.request_ids == ("r0",):
            gate.pack(output)  # hold the first so the rest queue up behind it
        return output.request_ids[0]

    packer = make_packer(pack, name="packer-under-test")
    ids = [packer.submit(f"rpc-{i}", batch(f"r{i}")) for i in range(50)]
    assert len(set(ids)) == 50
    assert gate.started.wait(CAP_S)
    assert replies.kinds() == [(COMPUTE_DONE, i) for i in ids]
    gate.opened.set()
    assert packer.drain(CAP_S)
    ready = [m for m in replies.messages if m.kind is OUTPUT_READY]
    assert [(m.async_output_id, m.result) for m in ready] == [
        (output_id, f"r{i}") for i, output_id in enumerate(ids)
    ]
    assert packer_threads == {"packer-under-test"}


def test_ready_event_is_waited_in_the_packer_thread_before_packing(
    make_packer: Callable[..., OutputPacker],
) -> None:
    calls: list[tuple[str, str]] = []

    class FakeEvent:
        def synchronize(self) -> None:
            calls.append(("synchronize", threading.current_thread().name))

    def pack(output: BatchRunnerOutput) -> Any:
        calls.append(("pack", threading.current_thread().name))
        return None

    packer = make_packer(pack, name="packer")
    packer.submit("rpc-1", batch("a"), ready_event=FakeEvent())
    assert packer.drain(CAP_S)
    assert calls == [("synchronize", "packer"), ("pack", "packer")]


def test_a_failing_ready_event_is_a_packing_error(
    make_packer: Callable[..., OutputPacker], replies: Replies
) -> None:
    class BrokenEvent:
        def synchronize(self) -> None:
            raise RuntimeError("CUDA error: an illegal memory access")

    packer = make_packer()
    packer.submit("rpc-1", batch("a"), ready_event=BrokenEvent())
    assert packer.drain(CAP_S)
    assert replies.messages[1].error_type == "RuntimeError"
    assert "illegal memory access" in (replies.messages[1].error or "")


def test_default_pack_sends_the_output_itself_with_fresh_ids(
    make_packer: Callable[..., OutputPacker], replies: Replies
) -> None:
    packer = make_packer()
    output = batch("a")
    first = packer.submit(None, output)
    second = packer.submit(None, output)
    assert first != second and len(first) == 32  # uuid4 hex
    assert packer.drain(CAP_S)
    # COMPUTE_DONE of the second submit and OUTPUT_READY of the first may come in either
    # order (the packer thread races the submitter): find the OUTPUT_READYs by kind.
    ready = [m for m in replies.messages if m.kind is AsyncOutputKind.OUTPUT_READY]
    assert [m.result for m in ready] == [output, output]
    assert [m.async_output_id for m in ready] == [first, second]


def test_all_replies_go_through_one_writer(make_packer: Callable[..., OutputPacker]) -> None:
    inside = 0
    most = 0
    count = 0
    guard = threading.Lock()

    def reply(message: AsyncOutput) -> None:
        nonlocal inside, most, count
        with guard:
            inside += 1
            most = max(most, inside)
            count += 1
        with guard:
            inside -= 1

    packer = OutputPacker(reply)
    try:

        def rpc_sender(n: int) -> None:
            for i in range(200):
                packer.send(AsyncOutput(AsyncOutputKind.RPC_RESULT, rpc_id=f"{n}-{i}"))

        senders = [threading.Thread(target=rpc_sender, args=(n,)) for n in range(3)]
        for thread in senders:
            thread.start()
        for i in range(100):
            packer.submit(str(i), batch("a"))
        for thread in senders:
            thread.join(CAP_S)
        assert packer.drain(CAP_S)
    finally:
        assert packer.close(CAP_S)
    assert count == 3 * 200 + 2 * 100
    assert most == 1


def test_drain_is_bounded(make_packer: Callable[..., OutputPacker], gate: Gate) -> None:
    packer = make_packer(gate.pack)
    packer.submit("rpc-1", batch("a"))
    assert gate.started.wait(CAP_S)
    assert not packer.drain(0.01)
    assert packer.pending == 1
    gate.opened.set()
    assert packer.drain(CAP_S)


def test_close_drains_joins_and_is_idempotent(replies: Replies, gate: Gate) -> None:
    packer = OutputPacker(replies, gate.pack, name="closing-packer")
    output_id = packer.submit("rpc-1", batch("a"))
    assert gate.started.wait(CAP_S)
    assert not packer.close(0.01)  # still packing: close gives up in time
    assert packer.closed
    gate.opened.set()
    assert packer.close(CAP_S)
    assert packer.close(CAP_S)
    assert replies.kinds() == [(COMPUTE_DONE, output_id), (OUTPUT_READY, output_id)]
    assert not any(t.name == "closing-packer" for t in threading.enumerate())
    with pytest.raises(EngineClosedError, match="closing-packer is closed"):
        packer.submit("rpc-2", batch("b"))


def test_close_without_work_starts_no_thread(replies: Replies) -> None:
    with OutputPacker(replies, name="idle-packer") as packer:
        assert packer.pending == 0
    assert packer.closed
    assert replies.messages == []


def test_a_failing_compute_done_queues_nothing(make_packer: Callable[..., OutputPacker]) -> None:
    def reply(message: AsyncOutput) -> None:
        raise BrokenPipeError("worker pipe closed")

    packer = OutputPacker(reply)
    with pytest.raises(BrokenPipeError):
        packer.submit("rpc-1", batch("a"))
    assert packer.pending == 0
    assert packer.close(CAP_S)


def test_a_failing_output_ready_send_is_logged_and_not_pending(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sent: list[AsyncOutput] = []

    def reply(message: AsyncOutput) -> None:
        if message.kind is OUTPUT_READY:
            raise BrokenPipeError("worker pipe closed")
        sent.append(message)

    packer = OutputPacker(reply)
    try:
        packer.submit("rpc-1", batch("a"))
        assert packer.drain(CAP_S)
    finally:
        assert packer.close(CAP_S)
    assert [m.kind for m in sent] == [COMPUTE_DONE]
    assert "could not send OUTPUT_READY" in caplog.text
    # Outputs after it may never come: the packer says it is no longer alive (liveness).
    assert not packer.alive


class _ThreadKilled(BaseException):
    """A FAKE end of the packer's thread (not a packing error)."""


def test_a_packer_thread_that_dies_is_not_alive_and_says_why(
    make_packer: Callable[..., OutputPacker], replies: Replies, caplog: pytest.LogCaptureFixture
) -> None:
    def die(output: BatchRunnerOutput) -> Any:
        raise _ThreadKilled

    packer = make_packer(die)
    assert packer.alive  # no thread yet
    packer.submit("rpc-1", batch("a"))
    assert packer.drain(CAP_S)  # the job is not pending any more
    thread = packer._thread
    assert thread is not None
    thread.join(CAP_S)
    assert not packer.alive
    assert replies.kinds()[0][0] is COMPUTE_DONE and len(replies.kinds()) == 1
    assert "the packer thread died packing" in caplog.text


def test_a_closed_packer_is_still_alive(make_packer: Callable[..., OutputPacker]) -> None:
    packer = make_packer()
    packer.submit("rpc-1", batch("a"))
    assert packer.close(CAP_S)
    assert packer.alive  # stopped when asked: nothing of it is lost


def test_drain_from_the_packer_thread_is_refused(
    make_packer: Callable[..., OutputPacker], replies: Replies
) -> None:
    holder: list[OutputPacker] = []

    def pack(output: BatchRunnerOutput) -> Any:
        holder[0].drain(CAP_S)

    packer = make_packer(pack)
    holder.append(packer)
    packer.submit("rpc-1", batch("a"))
    assert packer.drain(CAP_S)
    assert replies.messages[1].error_type == "RuntimeError"
    assert "called from the packer thread" in (replies.messages[1].error or "")


def test_record_ready_event_off_cuda_is_none() -> None:
    import torch

    assert record_ready_event(torch.device("cpu")) is None
    assert record_ready_event("cpu") is None


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_record_ready_event_on_cuda_orders_the_copy(replies: Replies) -> None:
    import torch

    device = torch.device("cuda")
    side = torch.cuda.Stream(device)

    def pack(output: BatchRunnerOutput) -> Any:
        with torch.cuda.stream(side):
            images = {
                r.request_id: (r.images or ())[0].to("cpu", non_blocking=True) for r in output
            }
        side.synchronize()
        return images

    with OutputPacker(replies, pack) as packer:
        data = torch.arange(1 << 20, device=device, dtype=torch.float32) * 2
        event = record_ready_event(device)
        assert event is not None
        packer.submit(
            "rpc-1",
            BatchRunnerOutput.from_list([RunnerOutput("a", images=(data,))]),
            ready_event=event,
        )
        assert packer.drain(CAP_S)
    result = replies.messages[1].result["a"]
    assert torch.equal(result, torch.arange(1 << 20, dtype=torch.float32) * 2)


# --------------------------------------------------------------------------- end to end


def to_pil(output: BatchRunnerOutput) -> BatchRunnerOutput:
    """The packer stage as the worker would use it: convert raw arrays to the output type."""
    return BatchRunnerOutput.from_list(
        [
            dataclasses.replace(
                r, images=tuple(convert_output(img, "pil") for img in r.images or ())
            )
            for r in output
        ]
    )


async def test_packer_thread_to_result_pump_end_to_end() -> None:
    released: list[Any] = []
    pump = ResultPump(worker=0, on_discard=released.append, default_timeout_s=CAP_S)
    send, receive = trio.open_memory_channel[AsyncOutput](math.inf)
    sender = ThreadReplySender(send, on_discard=released.append)
    hold = threading.Event()

    def pack(output: BatchRunnerOutput) -> BatchRunnerOutput:
        if "late" in output.request_ids:
            assert hold.wait(CAP_S)  # OUTPUT_READY only after the pump is waiting for it
        return to_pil(output)

    packer = OutputPacker(sender, pack, name="e2e-packer")
    pixels = {
        rid: np.full((2, 3, 3), shade, dtype=np.float32)
        for rid, shade in [("a", 0.0), ("b", 1.0), ("late", 0.5)]
    }

    def forward(rpc_id: str, *request_ids: str) -> None:
        packer.submit(
            rpc_id,
            BatchRunnerOutput.from_list(
                [RunnerOutput(rid, images=(pixels[rid],)) for rid in request_ids]
            ),
        )

    try:
        with trio.fail_after(CAP_S):
            async with trio.open_nursery() as nursery:
                await nursery.start(pump.serve, receive)
                pump.register_rpc("1")
                pump.register_rpc("2")

                def forwards() -> None:
                    forward("1", "a", "b")
                    forward("2", "late")

                worker = threading.Thread(target=forwards, name="e2e-worker")
                worker.start()

                batch_id = (await pump.wait_rpc("1")).async_output_id
                assert batch_id is not None
                pump.register_batch_split(batch_id, ["a", "b"])
                a = await pump.wait_output(f"{batch_id}/a")
                b = await pump.wait_output(f"{batch_id}/b")
                assert (a.request_id, a.images[0].size, a.images[0].getpixel((0, 0))) == (
                    "a",
                    (3, 2),
                    (0, 0, 0),
                )
                assert (b.request_id, b.images[0].getpixel((0, 0))) == ("b", (255, 255, 255))

                late_id = (await pump.wait_rpc("2")).async_output_id
                assert late_id is not None

                async def release_late() -> None:
                    await wait_all_tasks_blocked()
                    assert pump.statistics().waiting_outputs == 1
                    hold.set()

                nursery.start_soon(release_late)
                whole = await pump.wait_output(late_id)
                assert isinstance(whole, BatchRunnerOutput)
                late = whole.get("late")
                assert late is not None and late.images is not None
                assert late.images[0].getpixel((0, 0)) == (128, 128, 128)

                worker.join(CAP_S)
                assert packer.close(CAP_S)
                sender.close()  # the pump sees the replies end
    finally:
        hold.set()
        packer.close(CAP_S)
    assert released == []
    assert pump.failed and pump.statistics().cached_outputs == 0


def test_leftovers_name_the_requests_still_being_packed(gate: Gate) -> None:
    seen_at_send: list[dict[str, set[str]]] = []
    packer: OutputPacker

    def reply(message: AsyncOutput) -> None:
        if message.kind is OUTPUT_READY:
            seen_at_send.append(packer.leftovers())

    packer = OutputPacker(reply, gate.pack)
    try:
        packer.submit("rpc-1", batch("a", "b"))
        assert packer.leftovers() == {"packer_queue": {"a", "b"}}
        gate.opened.set()
        assert packer.drain(CAP_S)
        # Released before its OUTPUT_READY went out: whoever receives it sees nothing here.
        assert seen_at_send == [{"packer_queue": set()}]
        assert packer.leftovers() == {"packer_queue": set()}
    finally:
        assert packer.close(CAP_S)
