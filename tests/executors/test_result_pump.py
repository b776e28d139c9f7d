"""``ResultPump``: resolves a worker's replies by id, in any order, and never leaks a payload.

Replies are fake ``AsyncOutput`` messages fed through a memory channel; after each one the test
waits until every task is blocked, so the pump has handled it.  Timed tests run on an
autojumping ``MockClock`` and assert exact virtual times.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import FrozenInstanceError, dataclass, field
from typing import Any

import pytest
import trio
import trio.testing
from trio.testing import wait_all_tasks_blocked

from omni_trio._core.messages import AsyncOutput, AsyncOutputKind, BatchRunnerOutput, RunnerOutput
from omni_trio.errors import EngineClosedError, EngineDeadError, StallError, WorkerError
from omni_trio.executors import result_pump
from omni_trio.executors.result_pump import (
    ASYNC_OUTPUT_TIMEOUT_ENV,
    DEFAULT_ASYNC_OUTPUT_TIMEOUT_S,
    MISSING_BATCH_OUTPUT,
    ResultPump,
    ThreadReplySender,
    async_output_timeout_s,
    batch_output_key,
)

CAP_S = 10.0  # every real-time wait in this module is bounded by this


@dataclass(frozen=True)
class Payload:
    """A fake packed output; ``name`` makes a swapped result visible."""

    name: str


def compute_done(rpc_id: str, output_id: str, **kw: Any) -> AsyncOutput:
    return AsyncOutput(AsyncOutputKind.COMPUTE_DONE, rpc_id=rpc_id, async_output_id=output_id, **kw)


def output_ready(output_id: str, result: Any = None, **kw: Any) -> AsyncOutput:
    return AsyncOutput(AsyncOutputKind.OUTPUT_READY, async_output_id=output_id, result=result, **kw)


def rpc_result(rpc_id: str, result: Any = None, **kw: Any) -> AsyncOutput:
    return AsyncOutput(AsyncOutputKind.RPC_RESULT, rpc_id=rpc_id, result=result, **kw)


def batch(*request_ids: str) -> BatchRunnerOutput:
    return BatchRunnerOutput.from_list(
        [RunnerOutput(rid, images=(f"img-{rid}",)) for rid in request_ids]
    )


@dataclass
class Harness:
    pump: ResultPump
    send: trio.MemorySendChannel[AsyncOutput]
    released: list[Any] = field(default_factory=list)

    async def deliver(self, *replies: AsyncOutput) -> None:
        """Send replies and return once the pump (and everything it woke) has run."""
        for reply in replies:
            self.send.send_nowait(reply)
        await wait_all_tasks_blocked()

    def assert_idle(self) -> None:
        stats = self.pump.statistics()
        assert (
            stats.pending_rpcs,
            stats.waiting_outputs,
            stats.cached_outputs,
            stats.dropped_outputs,
            stats.unsplit_batches,
        ) == (0, 0, 0, 0, 0), stats


@asynccontextmanager
async def running_pump(
    default_timeout_s: float = 600.0, cap_s: float = CAP_S
) -> AsyncIterator[Harness]:
    """A pump serving a memory channel.  ``cap_s`` bounds the whole block (virtual seconds
    under a MockClock, so timed tests raise it past the timeouts they exercise)."""
    released: list[Any] = []
    pump = ResultPump(worker=0, on_discard=released.append, default_timeout_s=default_timeout_s)
    send, receive = trio.open_memory_channel[AsyncOutput](math.inf)
    with trio.fail_after(cap_s):
        async with trio.open_nursery() as nursery:
            await nursery.start(pump.serve, receive)
            yield Harness(pump, send, released)
            nursery.cancel_scope.cancel()


# --------------------------------------------------------------------------- correlation


@pytest.mark.parametrize(
    "order", list(itertools.permutations(["compute_done", "output_ready", "wait"]))
)
async def test_output_arrives_whatever_the_order(order: tuple[str, ...]) -> None:
    payload = Payload("o1")
    async with running_pump() as h:
        h.pump.register_rpc("1")
        got: list[Any] = []

        async def waiter() -> None:
            got.append(await h.pump.wait_output("o1"))

        async with trio.open_nursery() as nursery:
            for step in order:
                if step == "compute_done":
                    await h.deliver(compute_done("1", "o1"))
                elif step == "output_ready":
                    await h.deliver(output_ready("o1", payload))
                else:
                    nursery.start_soon(waiter)
                    await wait_all_tasks_blocked()
        reply = await h.pump.wait_rpc("1")
        assert reply.kind is AsyncOutputKind.COMPUTE_DONE
        assert reply.async_output_id == "o1"
        assert got == [payload]
        assert h.released == []
        h.assert_idle()


async def test_rpc_result_returns_the_reply_even_if_it_came_first() -> None:
    async with running_pump() as h:
        h.pump.register_rpc("7")
        await h.deliver(rpc_result("7", {"pong": True}))
        assert h.pump.statistics().pending_rpcs == 0
        reply = await h.pump.wait_rpc("7")
        assert reply.kind is AsyncOutputKind.RPC_RESULT
        assert reply.result == {"pong": True}
        h.assert_idle()


async def test_rpc_error_raises_worker_error_with_its_type() -> None:
    async with running_pump() as h:
        h.pump.register_rpc("1")
        await h.deliver(rpc_result("1", error="CUDA out of memory", error_type="OutOfMemoryError"))
        with pytest.raises(
            WorkerError, match="worker 0: OutOfMemoryError: CUDA out of memory"
        ) as info:
            await h.pump.wait_rpc("1")
        assert info.value.error_type == "OutOfMemoryError"
        assert info.value.worker == 0
        h.assert_idle()


async def test_output_ready_error_raises_worker_error() -> None:
    async with running_pump() as h:
        await h.deliver(
            output_ready(
                "o1", error="Background output packing failed: boom", error_type="ValueError"
            )
        )
        with pytest.raises(WorkerError, match="packing failed: boom") as info:
            await h.pump.wait_output("o1")
        assert info.value.error_type == "ValueError"


async def test_rpc_must_be_registered_once() -> None:
    async with running_pump() as h:
        with pytest.raises(LookupError, match="not registered"):
            await h.pump.wait_rpc("nope")
        h.pump.register_rpc("1")
        with pytest.raises(ValueError, match="already registered"):
            h.pump.register_rpc("1")


async def test_one_waiter_per_output() -> None:
    async with running_pump() as h, trio.open_nursery() as nursery:
        nursery.start_soon(h.pump.wait_output, "o1")
        await wait_all_tasks_blocked()
        with pytest.raises(RuntimeError, match="already awaited"):
            await h.pump.wait_output("o1")
        await h.deliver(output_ready("o1", Payload("o1")))


async def test_duplicate_output_is_released_not_cached_twice() -> None:
    async with running_pump() as h:
        first, second = Payload("first"), Payload("second")
        await h.deliver(output_ready("o1", first), output_ready("o1", second))
        assert h.released == [second]
        assert await h.pump.wait_output("o1") == first


async def test_zero_timeout_still_returns_a_cached_output() -> None:
    async with running_pump() as h:
        await h.deliver(output_ready("o1", Payload("o1")))
        assert await h.pump.wait_output("o1", timeout=0) == Payload("o1")


# --------------------------------------------------------------------------- batch split


@pytest.mark.parametrize("split_first", [True, False], ids=["split-early", "split-late"])
async def test_batch_output_is_split_per_request(split_first: bool) -> None:
    async with running_pump() as h:
        h.pump.register_rpc("1")
        await h.deliver(compute_done("1", "b1"))
        assert (await h.pump.wait_rpc("1")).async_output_id == "b1"
        if split_first:
            h.pump.register_batch_split("b1", ["a", "b"])
            assert h.pump.statistics().unsplit_batches == 1
            await h.deliver(output_ready("b1", batch("b", "a")))
        else:
            await h.deliver(output_ready("b1", batch("b", "a")))
            assert h.pump.statistics().cached_outputs == 1
            h.pump.register_batch_split("b1", ["a", "b"])
        a = await h.pump.wait_output(batch_output_key("b1", "a"))
        b = await h.pump.wait_output("b1/b")
        assert (a.request_id, a.images) == ("a", ("img-a",))
        assert (b.request_id, b.images) == ("b", ("img-b",))
        assert h.released == []
        h.assert_idle()


@pytest.mark.parametrize("split_first", [True, False], ids=["split-early", "split-late"])
async def test_missing_request_gets_an_error_and_extras_are_released(split_first: bool) -> None:
    payload = {"a": RunnerOutput("a", images=("img-a",)), "x": RunnerOutput("x", images=("img-x",))}
    async with running_pump() as h:
        if split_first:
            h.pump.register_batch_split("b1", ["a", "c"])
            await h.deliver(output_ready("b1", payload))
        else:
            await h.deliver(output_ready("b1", payload))
            h.pump.register_batch_split("b1", ["a", "c"])
        assert (await h.pump.wait_output("b1/a")).images == ("img-a",)
        missing = await h.pump.wait_output("b1/c")
        assert (missing.request_id, missing.error) == ("c", MISSING_BATCH_OUTPUT)
        assert h.released == [payload["x"]]
        h.assert_idle()


async def test_split_waiters_registered_before_the_batch_arrives() -> None:
    async with running_pump() as h:
        h.pump.register_batch_split("b1", ["a", "b"])
        got: dict[str, Any] = {}

        async def wait(rid: str) -> None:
            got[rid] = await h.pump.wait_output(f"b1/{rid}")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait, "a")
            nursery.start_soon(wait, "b")
            await wait_all_tasks_blocked()
            assert h.pump.statistics().waiting_outputs == 2
            await h.deliver(output_ready("b1", batch("a", "b")))
        assert {rid: out.request_id for rid, out in got.items()} == {"a": "a", "b": "b"}
        h.assert_idle()


async def test_packing_error_becomes_a_per_request_error() -> None:
    async with running_pump() as h:
        h.pump.register_batch_split("b1", ["a", "b"])
        await h.deliver(
            output_ready("b1", error="Background output packing failed: x", error_type="OSError")
        )
        for rid in ("a", "b"):
            out = await h.pump.wait_output(f"b1/{rid}")
            assert (out.request_id, out.error, out.error_type) == (
                rid,
                "Background output packing failed: x",
                "OSError",
            )


async def test_a_split_batch_cannot_be_awaited_whole() -> None:
    async with running_pump() as h:
        h.pump.register_batch_split("b1", ["a"])
        with pytest.raises(ValueError, match="split"):
            await h.pump.wait_output("b1")
        with pytest.raises(ValueError, match="already registered"):
            h.pump.register_batch_split("b1", ["a"])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(h.pump.wait_output, "b2")
            await wait_all_tasks_blocked()
            with pytest.raises(ValueError, match="awaited as a whole"):
                h.pump.register_batch_split("b2", ["a"])
            await h.deliver(output_ready("b2", Payload("b2")))


# --------------------------------------------------------------------------- cancel and drop


async def test_cancelled_waiter_then_late_result_is_released() -> None:
    async with running_pump() as h:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(h.pump.wait_output, "o1")
                await wait_all_tasks_blocked()
                scope.cancel()
        assert h.pump.statistics().dropped_outputs == 1
        late = Payload("late")
        await h.deliver(output_ready("o1", late))
        assert h.released == [late]
        h.assert_idle()
        # The pump is still serving.
        await h.deliver(output_ready("o2", Payload("o2")))
        assert await h.pump.wait_output("o2") == Payload("o2")


async def test_result_delivered_as_its_waiter_is_cancelled_is_released() -> None:
    async with running_pump() as h:
        scope = trio.CancelScope()

        async def waiter() -> None:
            with scope:
                await h.pump.wait_output("o1")

        payload = Payload("o1")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await wait_all_tasks_blocked()
            scope.cancel()  # the waiter is rescheduled with Cancelled ...
            h.pump.deliver(output_ready("o1", payload))  # ... before it runs again
        assert h.released == [payload]
        h.assert_idle()


async def test_cancelled_rpc_waiter_drops_the_output_it_announces() -> None:
    async with running_pump() as h:
        h.pump.register_rpc("1")
        with trio.move_on_after(CAP_S / 10) as scope:
            await h.pump.wait_rpc("1")
        assert scope.cancelled_caught
        await h.deliver(compute_done("1", "o1"))
        assert h.pump.statistics().dropped_outputs == 1
        late = Payload("o1")
        await h.deliver(output_ready("o1", late))
        assert h.released == [late]
        h.assert_idle()


async def test_reply_to_unknown_rpc_is_released() -> None:
    async with running_pump() as h:
        stray = Payload("stray")
        await h.deliver(rpc_result("99", stray))
        assert h.released == [stray]
        h.assert_idle()


async def test_forget_rpc_discards_the_late_reply() -> None:
    async with running_pump() as h:
        h.pump.register_rpc("1")
        h.pump.forget_rpc("1")
        h.pump.forget_rpc("1")
        await h.deliver(rpc_result("1", Payload("late")))
        assert h.released == [Payload("late")]
        h.assert_idle()


async def test_drop_evicts_and_releases_a_cached_result() -> None:
    async with running_pump() as h:
        payload = Payload("o1")
        await h.deliver(output_ready("o1", payload))
        assert h.pump.drop("o1")
        assert h.released == [payload]
        h.assert_idle()


async def test_late_result_after_drop_is_released_not_cached() -> None:
    async with running_pump() as h:
        h.pump.register_rpc("1")
        await h.deliver(compute_done("1", "o1"))
        await h.pump.wait_rpc("1")
        assert h.pump.drop("o1")
        assert h.pump.drop("o1")  # idempotent
        late = Payload("o1")
        await h.deliver(output_ready("o1", late))
        assert h.released == [late]
        h.assert_idle()


async def test_drop_of_an_unknown_key_leaves_no_tombstone() -> None:
    async with running_pump() as h:
        assert not h.pump.drop("never-announced")
        h.assert_idle()


async def test_drop_leaves_a_real_waiter_alone() -> None:
    async with running_pump() as h:
        got: list[Any] = []

        async def waiter() -> None:
            got.append(await h.pump.wait_output("o1"))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter)
            await wait_all_tasks_blocked()
            assert not h.pump.drop("o1")
            await h.deliver(output_ready("o1", Payload("o1")))
        assert got == [Payload("o1")]
        assert h.released == []


async def test_waiting_for_a_dropped_key_revives_it() -> None:
    async with running_pump() as h:
        h.pump.register_rpc("1")
        await h.deliver(compute_done("1", "o1"))
        await h.pump.wait_rpc("1")
        h.pump.drop("o1")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(h.pump.wait_output, "o1")
            await wait_all_tasks_blocked()
            await h.deliver(output_ready("o1", Payload("o1")))
        assert h.released == []
        h.assert_idle()


@pytest.mark.parametrize("drop_whole_batch", [True, False])
async def test_dropped_split_parts_are_released_on_arrival(drop_whole_batch: bool) -> None:
    async with running_pump() as h:
        h.pump.register_batch_split("b1", ["a", "b"])
        if drop_whole_batch:
            assert h.pump.drop("b1")
        else:
            assert h.pump.drop("b1/a")
        outputs = batch("a", "b")
        await h.deliver(output_ready("b1", outputs))
        if drop_whole_batch:
            assert h.released == [outputs.get("a"), outputs.get("b")]
        else:
            assert h.released == [outputs.get("a")]
            assert await h.pump.wait_output("b1/b") == outputs.get("b")
        h.assert_idle()


async def test_a_failing_on_discard_does_not_stop_the_pump(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def explode(payload: Any) -> None:
        raise OSError("unlink failed")

    pump = ResultPump(worker=0, on_discard=explode)
    send, receive = trio.open_memory_channel[AsyncOutput](math.inf)
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(pump.serve, receive)
            send.send_nowait(rpc_result("stray", Payload("x")))
            send.send_nowait(output_ready("o1", Payload("o1")))
            await wait_all_tasks_blocked()
            assert await pump.wait_output("o1") == Payload("o1")
            nursery.cancel_scope.cancel()
    assert "on_discard failed" in caplog.text
    assert pump.statistics().discarded == 1


# --------------------------------------------------------------------------- failure


async def test_end_of_replies_fails_pending_and_later_waits() -> None:
    released: list[Any] = []
    pump = ResultPump(worker=3, on_discard=released.append)
    send, receive = trio.open_memory_channel[AsyncOutput](math.inf)
    errors: list[BaseException] = []

    async def waiter() -> None:
        try:
            await pump.wait_output("o1")
        except EngineDeadError as exc:
            errors.append(exc)

    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(pump.serve, receive)
            nursery.start_soon(waiter)
            pump.register_rpc("1")
            send.send_nowait(output_ready("cached", Payload("cached")))
            await wait_all_tasks_blocked()
            await send.aclose()  # serve returns: the worker's replies ended
    assert len(errors) == 1
    assert "replies from worker 3 ended" in str(errors[0])
    assert released == [Payload("cached")]
    with pytest.raises(EngineDeadError):
        await pump.wait_rpc("1")
    with pytest.raises(EngineDeadError):
        await pump.wait_output("cached")
    assert pump.statistics().failed


async def test_fail_fails_current_and_later_waits_and_releases_arrivals() -> None:
    async with running_pump() as h:
        boom = EngineDeadError("worker 0 died")
        await h.deliver(output_ready("cached", Payload("cached")))
        h.pump.register_rpc("1")
        raised: list[BaseException] = []

        async def waiter(wait: Any, key: str) -> None:
            try:
                await wait(key)
            except EngineDeadError as exc:
                raised.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter, h.pump.wait_output, "o1")
            nursery.start_soon(waiter, h.pump.wait_rpc, "1")
            await wait_all_tasks_blocked()
            h.pump.fail(boom)
            h.pump.fail(EngineClosedError("later failures are ignored"))
        assert raised == [boom, boom]
        assert h.released == [Payload("cached")]
        with pytest.raises(EngineDeadError, match="worker 0 died"):
            await h.pump.wait_output("o2")
        with pytest.raises(EngineDeadError):
            h.pump.register_rpc("2")
        with pytest.raises(EngineDeadError):
            h.pump.register_batch_split("b", ["a"])
        assert not h.pump.drop("cached")
        await h.deliver(output_ready("o1", Payload("after")))
        assert h.released == [Payload("cached"), Payload("after")]
        h.assert_idle()


async def test_failure_given_before_the_replies_end_wins() -> None:
    pump = ResultPump(worker=0)
    send, receive = trio.open_memory_channel[AsyncOutput](math.inf)
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(pump.serve, receive)
            pump.fail(EngineClosedError("executor closed"))
            await send.aclose()
    with pytest.raises(EngineClosedError, match="executor closed"):
        await pump.wait_output("o1")


async def test_cancelled_serve_fails_closed_and_releases_buffered_replies() -> None:
    released: list[Any] = []
    pump = ResultPump(worker=0, on_discard=released.append)
    send, receive = trio.open_memory_channel[AsyncOutput](math.inf)
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(pump.serve, receive)
            await wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
            # Sent after serve was cancelled: still buffered when serve exits.
            send.send_nowait(output_ready("o1", Payload("buffered")))
    assert released == [Payload("buffered")]
    with pytest.raises(EngineClosedError, match="result pump of worker 0 stopped"):
        await pump.wait_output("o1")
    with pytest.raises(trio.BrokenResourceError):
        send.send_nowait(output_ready("o2"))


async def test_serve_runs_once() -> None:
    async with running_pump() as h:
        _, receive = trio.open_memory_channel[AsyncOutput](0)
        with pytest.raises(RuntimeError, match="only reader"):
            await h.pump.serve(receive)


async def test_broken_replies_fail_the_pump_and_propagate() -> None:
    class Broken:
        def __aiter__(self) -> Broken:
            return self

        async def __anext__(self) -> AsyncOutput:
            await trio.lowlevel.checkpoint()
            raise trio.BrokenResourceError("stream died")

    pump = ResultPump(worker=1)
    with pytest.raises(trio.BrokenResourceError):
        await pump.serve(Broken())
    with pytest.raises(EngineDeadError, match="replies from worker 1 broke") as info:
        await pump.wait_output("o1")
    assert isinstance(info.value.__cause__, trio.BrokenResourceError)


# --------------------------------------------------------------------------- bounded waits


async def test_wait_output_times_out_with_a_description(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_pump(default_timeout_s=600.0, cap_s=1000.0) as h:
        await h.deliver(output_ready("cached-1", Payload("c")))
        h.pump.register_batch_split("b1", ["a"])
        h.pump.register_rpc("r1")
        async with trio.open_nursery() as nursery:
            for i in range(6):  # one at a time: the description keeps registration order
                nursery.start_soon(h.pump.wait_output, f"other-{i}", math.inf)
                await wait_all_tasks_blocked()
            start = trio.current_time()
            with pytest.raises(StallError) as info:
                await h.pump.wait_output("o1")
            assert trio.current_time() - start == 600.0
            nursery.cancel_scope.cancel()
        message = str(info.value)
        assert info.value.phase == "output"
        assert message.startswith("output stalled: output 'o1' from worker 0 not ready after 600 s")
        assert (
            "waiting outputs ['other-0', 'other-1', 'other-2', 'other-3', 'other-4', +2 more]"
            in message
        )
        assert "cached outputs ['cached-1']" in message
        assert "unsplit batches ['b1']" in message
        assert "pending rpcs ['r1']" in message
        # The timed-out output is abandoned: released when it finally comes.
        await h.deliver(output_ready("o1", Payload("late")))
        assert h.released[-1] == Payload("late")


async def test_wait_rpc_timeout_is_exact_and_forgets_the_rpc(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_pump(cap_s=1000.0) as h:
        h.pump.register_rpc("1")
        start = trio.current_time()
        with pytest.raises(
            StallError, match=r"rpc stalled: reply to rpc '1' from worker 0 not ready after 2.5 s"
        ) as info:
            await h.pump.wait_rpc("1", timeout=2.5)
        assert trio.current_time() - start == 2.5
        assert info.value.phase == "rpc"
        h.assert_idle()
        await h.deliver(rpc_result("1", Payload("late")))
        assert h.released == [Payload("late")]


async def test_output_that_arrives_in_time_is_returned(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with running_pump(default_timeout_s=10.0, cap_s=1000.0) as h:

        async def late_delivery() -> None:
            await trio.sleep(9.0)
            h.send.send_nowait(output_ready("o1", Payload("o1")))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(late_delivery)
            start = trio.current_time()
            assert await h.pump.wait_output("o1") == Payload("o1")
            assert trio.current_time() - start == 9.0


@pytest.fixture
def fresh_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(result_pump, "_warned_bad_timeout", False)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [(None, 600.0), ("", 600.0), ("12.5", 12.5), (" 30 ", 30.0), ("inf", math.inf)],
)
def test_timeout_env_values(raw: str | None, expected: float, fresh_warning: None) -> None:
    environ = {} if raw is None else {ASYNC_OUTPUT_TIMEOUT_ENV: raw}
    assert async_output_timeout_s(environ) == expected


def test_bad_timeout_env_warns_once_per_process(
    fresh_warning: None, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.WARNING, logger=result_pump.__name__)
    for raw in ("abc", "0", "-3", "nan"):
        assert (
            async_output_timeout_s({ASYNC_OUTPUT_TIMEOUT_ENV: raw})
            == DEFAULT_ASYNC_OUTPUT_TIMEOUT_S
        )
    monkeypatch.setenv(ASYNC_OUTPUT_TIMEOUT_ENV, "soon")
    assert ResultPump().default_timeout_s == DEFAULT_ASYNC_OUTPUT_TIMEOUT_S
    warnings = [r for r in caplog.records if ASYNC_OUTPUT_TIMEOUT_ENV in r.getMessage()]
    assert len(warnings) == 1
    assert "'abc'" in warnings[0].getMessage()


def test_pump_reads_its_default_timeout_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ASYNC_OUTPUT_TIMEOUT_ENV, "42")
    assert ResultPump().default_timeout_s == 42.0
    assert ResultPump(default_timeout_s=1.0).default_timeout_s == 1.0


def test_statistics_is_a_frozen_snapshot() -> None:
    stats = ResultPump(default_timeout_s=1.0).statistics()
    with pytest.raises(FrozenInstanceError):
        stats.discarded = 3  # type: ignore[misc]


# --------------------------------------------------------------------------- thread sender


async def test_thread_sender_feeds_the_pump_in_order_then_ends_it() -> None:
    released: list[Any] = []
    pump = ResultPump(worker=0, on_discard=released.append)
    send, receive = trio.open_memory_channel[AsyncOutput](math.inf)
    sender = ThreadReplySender(send, on_discard=released.append)
    for i in range(20):
        pump.register_rpc(str(i))

    def worker() -> None:
        for i in range(20):
            sender(rpc_result(str(i), i))

    thread = threading.Thread(target=worker, name="fake-worker")
    with trio.fail_after(CAP_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(pump.serve, receive)
            thread.start()
            results = [(await pump.wait_rpc(str(i))).result for i in range(20)]
            sender.close()  # serve sees the replies end and returns
            sender.close()
    thread.join(CAP_S)
    assert results == list(range(20))
    assert pump.failed
    sender(rpc_result("after-close", Payload("after-close")))
    assert released == [Payload("after-close")]


async def test_thread_sender_releases_what_a_closed_pump_cannot_take() -> None:
    released: list[Any] = []
    send, receive = trio.open_memory_channel[AsyncOutput](math.inf)
    sender = ThreadReplySender(send, on_discard=released.append)
    await receive.aclose()
    sender(output_ready("o1", Payload("orphan")))
    sender(compute_done("1", "o1"))  # no payload, nothing to release
    await wait_all_tasks_blocked()
    assert released == [Payload("orphan")]
    sender.close()


# --------------------------------------------------------------------------- claims


class Claimant:
    """Records what a claim's callback is given."""

    def __init__(self) -> None:
        self.got: list[tuple[Any, BaseException | None]] = []

    def __call__(self, payload: Any, error: BaseException | None) -> None:
        self.got.append((payload, error))


async def test_a_claim_is_called_back_on_arrival_or_at_once_if_cached() -> None:
    async with running_pump() as h:
        pump = h.pump
        pump.register_batch_split("b1", ["a", "b"])
        early, late = Claimant(), Claimant()
        pump.claim("b1/a", late)
        assert pump.leftovers()["pump_claims"] == {"a"}
        assert not pump.is_settled()
        await h.deliver(output_ready("b1", batch("a", "b")))
        assert [p.images for p, e in late.got] == [("img-a",)]
        assert pump.leftovers()["pump_cached"] == {"b"}
        pump.claim("b1/b", early)  # already there: called back before claim returns
        assert [p.images for p, e in early.got] == [("img-b",)]
        assert pump.is_settled()
        h.assert_idle()


async def test_dropping_a_claim_releases_the_late_arrival() -> None:
    async with running_pump() as h:
        pump = h.pump
        pump.register_batch_split("b1", ["a"])
        claimant = Claimant()
        pump.claim("b1/a", claimant)
        assert pump.drop("b1/a") is True
        assert pump.leftovers()["pump_tombstones"] == {"a"}
        await h.deliver(output_ready("b1", batch("a")))
        assert claimant.got == []
        assert len(h.released) == 1  # released, never cached
        assert pump.is_settled()
        h.assert_idle()


async def test_a_failed_pump_calls_every_claim_back_with_its_failure() -> None:
    async with running_pump() as h:
        pump = h.pump
        pump.register_batch_split("b1", ["a"])
        claimant = Claimant()
        pump.claim("b1/a", claimant)
        pump.fail(EngineDeadError("group died"))
        [(payload, error)] = claimant.got
        assert payload is None and isinstance(error, EngineDeadError)
        with pytest.raises(EngineDeadError):
            pump.claim("b1/a", Claimant())


async def test_a_remote_error_on_a_whole_output_reaches_the_claim_as_a_worker_error() -> None:
    async with running_pump() as h:
        claimant = Claimant()
        h.pump.claim("whole", claimant)
        await h.deliver(output_ready("whole", error="packing failed", error_type="OSError"))
        [(payload, error)] = claimant.got
        assert payload is None
        assert isinstance(error, WorkerError) and error.error_type == "OSError"


async def test_a_claim_whose_callback_raises_does_not_stop_the_pump(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(payload: Any, error: BaseException | None) -> None:
        raise RuntimeError("claimant bug")

    async with running_pump() as h:
        h.pump.register_batch_split("b1", ["a", "b"])
        h.pump.claim("b1/a", broken)
        good = Claimant()
        h.pump.claim("b1/b", good)
        with caplog.at_level(logging.ERROR):
            await h.deliver(output_ready("b1", batch("a", "b")))
        assert "output callback failed" in caplog.text
        assert len(good.got) == 1


async def test_a_key_is_claimed_or_awaited_once() -> None:
    async with running_pump() as h:
        h.pump.claim("k", Claimant())
        with pytest.raises(RuntimeError, match="already awaited"):
            h.pump.claim("k", Claimant())
        h.pump.register_batch_split("b", ["x"])
        with pytest.raises(ValueError, match="split"):
            h.pump.claim("b", Claimant())


async def test_wait_settled_returns_once_nothing_is_outstanding() -> None:
    async with running_pump() as h:
        pump = h.pump
        pump.register_batch_split("b1", ["a"])
        pump.drop("b1")  # its request was aborted: the arrival is still expected
        settled = trio.Event()

        async def wait() -> None:
            await pump.wait_settled()
            settled.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await wait_all_tasks_blocked()
            assert not settled.is_set()
            await h.deliver(output_ready("b1", batch("a")))
            await settled.wait()
        assert pump.leftovers() == {
            "pump_claims": set(),
            "pump_cached": set(),
            "pump_tombstones": set(),
            "pump_unsplit": set(),
        }


async def test_an_unsplit_whole_batch_is_held_for_every_request_it_names() -> None:
    async with running_pump() as h:
        await h.deliver(output_ready("b1", batch("a", "b")))  # its COMPUTE_DONE is late
        assert h.pump.leftovers()["pump_cached"] == {"a", "b"}


async def test_giving_up_an_rpc_wakes_a_wait_for_the_pump_to_settle() -> None:
    async with running_pump() as h:
        pump = h.pump
        pump.register_rpc("r1")
        settled = trio.Event()

        async def wait() -> None:
            await pump.wait_settled()
            settled.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait)
            await wait_all_tasks_blocked()
            assert not settled.is_set()
            pump.forget_rpc("r1")
            await settled.wait()


async def test_a_claims_remote_error_names_the_worker() -> None:
    async with running_pump() as h:
        claimant = Claimant()
        h.pump.claim("whole", claimant)
        await h.deliver(output_ready("whole", error="packing failed", error_type="OSError"))
        [(_, error)] = claimant.got
        assert isinstance(error, WorkerError) and error.worker == 0
        assert str(error).startswith("worker 0: OSError")
