"""``WorkerHost`` and ``handle_call`` on a real ``builtin:echo`` worker: one reply per call,
the packer's ``COMPUTE_DONE`` as the execute call's reply, ``OUTPUT_READY`` posted from the
packer's thread, error replies with tracebacks, aborts, heartbeats and a dead packer."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omni_trio._core.liveness import HEARTBEAT_INTERVAL_S
from omni_trio._core.messages import (
    AsyncOutput,
    AsyncOutputKind,
    BatchRunnerOutput,
    WorkerAbort,
    WorkerCall,
)
from omni_trio.worker.faults import Fault, FaultSpec
from omni_trio.worker.host import WorkerHost, announced_batch, failure_reply, handle_call
from omni_trio.worker.worker import Worker
from tests.worker.test_faults import request as fault_request
from tests.worker.test_worker import config, request, wave

CAP_S = 10.0
RPC_RESULT = AsyncOutputKind.RPC_RESULT
COMPUTE_DONE = AsyncOutputKind.COMPUTE_DONE
OUTPUT_READY = AsyncOutputKind.OUTPUT_READY


class Posted:
    """What a host posted (from the packer's thread), with a bounded wait."""

    def __init__(self) -> None:
        self.messages: list[AsyncOutput] = []
        self._cond = threading.Condition()

    def __call__(self, message: AsyncOutput) -> None:
        with self._cond:
            self.messages.append(message)
            self._cond.notify_all()

    def wait(self, n: int) -> list[AsyncOutput]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.messages) >= n, CAP_S)
            return list(self.messages)


def make_host(cache_dir: Path, *, rank: int = 0, **overrides: Any) -> tuple[WorkerHost, Posted]:
    posted = Posted()
    worker = Worker(config(cache_dir, **overrides), rank=rank, world_size=max(rank + 1, 1))
    host = WorkerHost(worker, posted)
    host.start()
    return host, posted


@pytest.fixture
def host(cache_dir: Path) -> Iterator[tuple[WorkerHost, Posted]]:
    made = make_host(cache_dir)
    yield made
    made[0].shutdown()


def _raise() -> None:
    raise KeyError("missing")


def test_failure_reply_names_the_error_and_carries_its_traceback() -> None:
    call = WorkerCall("r-1", "ping")
    try:
        _raise()
    except KeyError as exc:
        reply = failure_reply(call, exc, rank=1, steps=7)
    assert reply.kind is RPC_RESULT and reply.rpc_id == "r-1"
    assert (reply.error, reply.error_type, reply.rank, reply.steps) == (
        "'missing'",
        "KeyError",
        1,
        7,
    )
    assert reply.traceback is not None and "_raise" in reply.traceback
    bare = failure_reply(call, RuntimeError(), rank=0, steps=0)
    assert bare.error == "RuntimeError()"


def test_an_rpc_gets_one_rpc_result_with_its_value(host: tuple[WorkerHost, Posted]) -> None:
    h, posted = host
    reply = h.call(WorkerCall("r-1", "ping"))
    assert reply.kind is RPC_RESULT and reply.rpc_id == "r-1" and reply.rank == 0
    assert reply.error is None and reply.result == h.worker.ping()
    assert reply.result["loaded"] is True
    assert reply.steps == 0
    assert posted.messages == []


def test_only_the_reply_rank_ships_its_result(cache_dir: Path) -> None:
    worker = Worker(config(cache_dir, cfg_parallel=False), rank=1, world_size=2)
    worker.init_device()
    worker.load_model()
    try:
        never: Any = lambda rpc_id: None  # noqa: E731 - no packer here
        not_me = handle_call(worker, WorkerCall("r", "ping", reply_rank=0), compute_done=never)
        me = handle_call(worker, WorkerCall("r", "ping", reply_rank=1), compute_done=never)
        everyone = handle_call(worker, WorkerCall("r", "ping", reply_rank=None), compute_done=never)
        expected = worker.ping()
    finally:
        worker.shutdown()
    assert not_me.result is None and not_me.error is None and not_me.rank == 1
    assert me.result == everyone.result == expected


def test_a_method_that_raises_is_answered_with_its_error(host: tuple[WorkerHost, Posted]) -> None:
    h, _ = host
    reply = h.call(WorkerCall("r-2", "no_such_method"))
    assert reply.kind is RPC_RESULT and reply.rpc_id == "r-2"
    assert reply.error is not None and reply.error_type is not None
    assert reply.traceback is not None and "Traceback" in reply.traceback


def test_an_execute_call_is_answered_by_compute_done_and_the_outputs_follow(
    host: tuple[WorkerHost, Posted],
) -> None:
    h, posted = host
    call = WorkerCall(
        "r-3", "execute_scheduler_output", (wave(request("a"), request("b")),), {"rpc_id": "r-3"}
    )
    reply = h.call(call)
    assert reply.kind is COMPUTE_DONE and reply.rpc_id == "r-3" and reply.rank == 0
    assert isinstance(reply.result, BatchRunnerOutput)
    batch = announced_batch(reply.result)
    assert batch is not None and reply.async_output_id == batch
    assert {o.async_output_id for o in reply.result} == {f"{batch}/a", f"{batch}/b"}
    assert reply.steps == h.worker.steps_done > 0
    (ready,) = posted.wait(1)
    assert ready.kind is OUTPUT_READY and ready.async_output_id == batch and ready.rank == 0
    assert set(ready.result.outputs) == {"a", "b"}


def test_without_async_output_the_execute_reply_carries_the_images(cache_dir: Path) -> None:
    h, posted = make_host(cache_dir, async_output=False)
    try:
        reply = h.call(WorkerCall("r", "execute_scheduler_output", (wave(request("a")),)))
    finally:
        h.shutdown()
    assert reply.kind is RPC_RESULT and announced_batch(reply.result) is None
    assert reply.result.outputs["a"].images
    assert posted.messages == []


def test_abort_and_heartbeat_answer_at_any_time(host: tuple[WorkerHost, Posted]) -> None:
    h, _ = host
    h.call(WorkerCall("r", "execute_scheduler_output", (wave(request("a")),), {"rpc_id": "r"}))
    beat = h.heartbeat()
    assert beat.rank == 0 and beat.steps == h.worker.steps_done and beat.packer_alive
    h.abort(WorkerAbort(("x",)))
    assert h.worker.stop_flags.should_stop(["x"])
    assert not h.worker.stop_flags.should_stop(["y"])
    h.abort(WorkerAbort(everything=True))
    assert h.worker.stop_flags.should_stop(["y"])


def test_a_killed_packer_shows_in_the_heartbeat(cache_dir: Path) -> None:
    h, posted = make_host(cache_dir, fault_injection=True)
    try:
        doomed = fault_request("a", FaultSpec(Fault.KILL_PACKER))
        reply = h.call(
            WorkerCall("r", "execute_scheduler_output", (wave(doomed),), {"rpc_id": "r"})
        )
        assert reply.kind is COMPUTE_DONE
        packer = h.worker.packer
        assert packer is not None
        thread = packer._thread  # the packer's own thread, which the fault ends
        assert thread is not None
        thread.join(CAP_S)
        assert not h.heartbeat().packer_alive
        assert posted.messages == []  # the output never comes: liveness must fail the group
    finally:
        h.shutdown()


def test_a_heartbeat_is_due_each_interval_and_when_the_running_set_changes(
    host: tuple[WorkerHost, Posted],
) -> None:
    h, _ = host
    assert h.heartbeat_due(100.0)  # none sent yet
    h.heartbeat(100.0)
    assert not h.heartbeat_due(100.0 + HEARTBEAT_INTERVAL_S / 2)
    assert h.heartbeat_due(100.0 + HEARTBEAT_INTERVAL_S)
    h.heartbeat(200.0)
    h.worker.progress["r"] = (1, 4)  # a request started running
    assert h.heartbeat_due(200.001)
    beat = h.heartbeat(200.001)
    assert beat.progress == {"r": (1, 4)}
    h.worker.progress["r"] = (2, 4)  # the same request, one step on: wait for the interval
    assert not h.heartbeat_due(200.002)
    del h.worker.progress["r"]  # it stopped running
    assert h.heartbeat_due(200.003)
