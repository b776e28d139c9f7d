"""``WorkerThread``: one owned thread runs blocking jobs in order for a trio program."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator

import pytest
import trio
import trio.testing

from omni_trio.errors import EngineClosedError, StallError
from omni_trio.worker.worker_thread import WorkerThread

# Real-thread waits in these tests are bounded by this (a hung test fails instead of hanging).
GATE_S = 10.0


class ThreadSignal:
    """Set from any thread, awaited in trio (no polling).  Create it inside the trio run."""

    def __init__(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._event = trio.Event()

    def set(self) -> None:
        self._token.run_sync_soon(self._event.set)

    async def wait(self) -> None:
        await self._event.wait()


@pytest.fixture
async def worker_thread() -> AsyncIterator[WorkerThread]:
    thread = WorkerThread("test-worker", stall_timeout_s=GATE_S)
    thread.start()
    try:
        yield thread
    finally:
        assert await thread.stop()


async def test_run_returns_the_result(worker_thread: WorkerThread) -> None:
    with trio.fail_after(GATE_S):
        assert await worker_thread.run(lambda: 6 * 7) == 42


async def test_jobs_run_in_submission_order_in_one_named_thread(
    worker_thread: WorkerThread,
) -> None:
    gate = threading.Event()
    ran: list[tuple[int, str, int | None]] = []

    def job(index: int) -> int:
        if index == 0:
            assert gate.wait(GATE_S)
        current = threading.current_thread()
        ran.append((index, current.name, current.ident))
        return index

    results: dict[int, int] = {}

    async def submit(index: int) -> None:
        results[index] = await worker_thread.run(lambda: job(index))

    with trio.fail_after(GATE_S):
        async with trio.open_nursery() as nursery:
            for index in range(5):
                nursery.start_soon(submit, index)
                # run() enqueues before its first checkpoint: once every task is blocked,
                # job ``index`` is in the queue ahead of the next one.
                await trio.testing.wait_all_tasks_blocked()
            gate.set()

    assert [index for index, _, _ in ran] == [0, 1, 2, 3, 4]
    assert results == {i: i for i in range(5)}
    assert {name for _, name, _ in ran} == {"test-worker"}
    idents = {ident for _, _, ident in ran}
    assert len(idents) == 1
    assert threading.main_thread().ident not in idents


async def test_an_exception_propagates_and_the_thread_lives_on(
    worker_thread: WorkerThread,
) -> None:
    def boom() -> None:
        raise KeyError("no such thing")

    with trio.fail_after(GATE_S):
        with pytest.raises(KeyError, match="no such thing"):
            await worker_thread.run(boom)
        assert worker_thread.alive
        assert await worker_thread.run(lambda: "still here") == "still here"


async def test_cancel_calls_on_cancel_and_waits_for_the_job(
    worker_thread: WorkerThread,
) -> None:
    started = ThreadSignal()
    stop = threading.Event()
    events: list[str] = []

    def forward() -> str:
        started.set()
        # Stands for a denoising loop: returns only once its stop flag is set.
        assert stop.wait(GATE_S)
        events.append("forward returned")
        return "late result"

    def on_cancel() -> None:
        events.append("on_cancel")
        stop.set()

    with trio.fail_after(GATE_S):
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:

                async def cancel_when_started() -> None:
                    await started.wait()
                    scope.cancel()

                nursery.start_soon(cancel_when_started)
                await worker_thread.run(forward, on_cancel=on_cancel)
                pytest.fail("run() returned although it was cancelled")
        assert scope.cancelled_caught
    # Cancelled propagated only after the job had finished.
    assert events == ["on_cancel", "forward returned"]


async def test_cancel_without_on_cancel_still_waits_for_the_job(
    worker_thread: WorkerThread,
) -> None:
    finished = threading.Event()

    def job() -> None:
        finished.wait(0.05)  # a short job that ignores cancellation
        finished.set()

    with trio.fail_after(GATE_S):
        with trio.CancelScope() as scope:
            scope.cancel()  # cancelled before the job even starts
            await worker_thread.run(job)
        assert scope.cancelled_caught
        assert finished.is_set()


async def test_abandon_on_cancel_returns_at_once(worker_thread: WorkerThread) -> None:
    started = ThreadSignal()
    release = threading.Event()
    calls: list[str] = []

    def job() -> None:
        started.set()
        assert release.wait(GATE_S)

    with trio.fail_after(GATE_S):
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:

                async def cancel_when_started() -> None:
                    await started.wait()
                    scope.cancel()

                nursery.start_soon(cancel_when_started)
                await worker_thread.run(
                    job, on_cancel=lambda: calls.append("on_cancel"), abandon_on_cancel=True
                )
        assert scope.cancelled_caught
        # The job is still running: the caller was not made to wait for it.
        assert not release.is_set()
        assert worker_thread.alive
        assert calls == ["on_cancel"]
        release.set()
        # The next job runs after the abandoned one, in the same thread.
        assert await worker_thread.run(lambda: "next") == "next"


async def test_stop_joins_the_thread_and_is_idempotent() -> None:
    thread = WorkerThread("test-stop", stall_timeout_s=GATE_S)
    with trio.fail_after(GATE_S):
        thread.start()
        assert await thread.run(lambda: 1) == 1
        assert thread.alive
        assert await thread.stop()
        assert not thread.alive
        assert "test-stop" not in {t.name for t in threading.enumerate()}
        assert await thread.stop()


async def test_stop_runs_queued_jobs_first() -> None:
    thread = WorkerThread("test-drain", stall_timeout_s=GATE_S)
    gate = threading.Event()
    ran: list[int] = []

    def job(index: int) -> None:
        if index == 0:
            assert gate.wait(GATE_S)
        ran.append(index)

    with trio.fail_after(GATE_S):
        thread.start()
        async with trio.open_nursery() as nursery:
            for index in range(3):
                nursery.start_soon(thread.run, lambda i=index: job(i))
                await trio.testing.wait_all_tasks_blocked()
            gate.set()
            assert await thread.stop()
    assert ran == [0, 1, 2]


async def test_stop_of_a_thread_never_started_succeeds() -> None:
    thread = WorkerThread("never-started")
    with trio.fail_after(GATE_S):
        assert await thread.stop()
    assert not thread.alive


async def test_run_after_stop_raises_engine_closed() -> None:
    thread = WorkerThread("test-closed", stall_timeout_s=GATE_S)
    with trio.fail_after(GATE_S):
        thread.start()
        assert await thread.stop()
        with pytest.raises(EngineClosedError, match="test-closed"):
            await thread.run(lambda: 1)


async def test_run_before_start_raises_engine_closed() -> None:
    thread = WorkerThread("test-unstarted")
    with trio.fail_after(GATE_S):
        with pytest.raises(EngineClosedError):
            await thread.run(lambda: 1)


async def test_stall_timeout_on_cancel_raises_stall_error() -> None:
    thread = WorkerThread("test-stall", stall_timeout_s=0.05)
    started = ThreadSignal()
    release = threading.Event()

    def stuck() -> None:
        started.set()
        assert release.wait(GATE_S)  # ignores its stop flag

    with trio.fail_after(GATE_S):
        thread.start()
        try:
            with trio.CancelScope() as scope:
                async with trio.open_nursery() as nursery:

                    async def cancel_when_started() -> None:
                        await started.wait()
                        scope.cancel()

                    nursery.start_soon(cancel_when_started)
                    with pytest.raises(StallError) as info:
                        await thread.run(stuck, on_cancel=lambda: None)
            assert info.value.phase == "forward"
            assert "test-stall" in str(info.value)
        finally:
            release.set()
            thread.stall_timeout_s = GATE_S
            assert await thread.stop()


async def test_stop_reports_a_thread_that_does_not_exit() -> None:
    thread = WorkerThread("test-stuck", stall_timeout_s=0.05)
    started = ThreadSignal()
    release = threading.Event()

    def stuck() -> None:
        started.set()
        assert release.wait(GATE_S)

    with trio.fail_after(GATE_S):
        thread.start()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(thread.run, stuck)
            await started.wait()
            assert not await thread.stop()
            assert thread.alive
            release.set()
        thread.stall_timeout_s = GATE_S
        assert await thread.stop()
    assert not thread.alive
