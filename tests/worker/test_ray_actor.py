"""The Ray worker class, run in this process without Ray: what its calls reply (typed
messages), rank-aware results, the poll and control calls, and ``to_cpu``.  (The same class
as a real actor is exercised by ``tests/executors/test_ray_executor.py``.)"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_trio import EngineConfig, SamplingParams
from omni_trio._core.messages import (
    AsyncOutput,
    AsyncOutputKind,
    Heartbeat,
    NewRequestData,
    SchedulerOutput,
    WorkerAbort,
    WorkerCall,
)
from omni_trio._core.request import DiffusionRequest
from omni_trio.worker import faults
from omni_trio.worker.ray_actor import RayWorker, to_cpu


@pytest.fixture
def make_worker(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    # RayWorker marks its process as a worker process (crash faults end it): undo that here.
    monkeypatch.setattr(faults, "_worker_process", False)
    made: list[RayWorker] = []

    def make(rank: int = 0, world_size: int = 1, **overrides: Any) -> RayWorker:
        config = EngineConfig(cache_dir=str(cache_dir), warmup=False, torch_threads=1, **overrides)
        data = {name: getattr(config, name) for name in config.__dataclass_fields__}
        data["model_options"] = dict(config.model_options)
        worker = RayWorker(data, rank, world_size)
        made.append(worker)
        return worker

    yield make
    for worker in made:
        worker.shutdown()


def ping(rpc_id: str = "r", reply_rank: int | None = 0, method: str = "ping") -> WorkerCall:
    return WorkerCall(rpc_id, method, reply_rank=reply_rank)


def execute(*requests: DiffusionRequest, rpc_id: str = "x") -> WorkerCall:
    output = SchedulerOutput(
        step_id=1, scheduled_new_reqs=tuple(NewRequestData(r.request_id, r) for r in requests)
    )
    return WorkerCall(rpc_id, "execute_scheduler_output", (output,), {"rpc_id": rpc_id})


def request(rid: str) -> DiffusionRequest:
    return DiffusionRequest(
        "p", SamplingParams(num_inference_steps=3, seed=1, height=32, width=32), request_id=rid
    )


def test_start_reports_pid_node_and_model(make_worker: Any) -> None:
    worker = make_worker()
    info = worker.start()
    assert isinstance(info["pid"], int)
    assert info["model_info"]["name"] == "builtin:echo"
    assert isinstance(info["node_ip"], str) and info["node_ip"]


def test_calls_reply_with_the_result_only_on_the_output_rank(make_worker: Any) -> None:
    rank0, rank1 = make_worker(0, 2, cfg_parallel=False), make_worker(1, 2, cfg_parallel=False)
    rank0.start()
    rank1.start()
    reply0 = rank0.call(ping())
    reply1 = rank1.call(ping())
    assert reply0.kind is AsyncOutputKind.RPC_RESULT and reply0.rpc_id == "r"
    assert reply0.error is None and reply0.rank == 0 and reply0.result["rank"] == 0
    assert (reply1.rank, reply1.error, reply1.result, reply1.steps) == (1, None, None, 0)
    every = rank1.call(ping(reply_rank=None, method="describe"))
    assert every.result["rank"] == 1


def test_a_failing_call_replies_with_its_error_and_traceback(make_worker: Any) -> None:
    worker = make_worker()
    before_start = worker.call(ping())
    assert before_start.error_type == "RuntimeError" and before_start.rpc_id == "r"
    worker.start()
    reply = worker.call(ping(method="nope"))
    assert reply.error_type == "AttributeError"
    assert reply.error is not None and "no RPC method 'nope'" in reply.error
    assert reply.traceback is not None and "Traceback (most recent call last)" in reply.traceback


def test_a_forward_is_answered_by_compute_done_and_its_outputs_come_by_poll(
    make_worker: Any,
) -> None:
    worker = make_worker()
    worker.start()
    reply = worker.call(execute(request("r")))
    assert reply.kind is AsyncOutputKind.COMPUTE_DONE and reply.error is None
    assert reply.steps == 3
    batch = reply.async_output_id
    assert batch and reply.result.outputs["r"].async_output_id == f"{batch}/r"
    # The packed output arrives through poll, then a heartbeat; the wait is bounded.
    messages: list[Any] = []
    for _ in range(50):
        messages += worker.poll(0.2)
        if any(isinstance(m, AsyncOutput) for m in messages):
            break
    (ready,) = [m for m in messages if isinstance(m, AsyncOutput)]
    assert ready.kind is AsyncOutputKind.OUTPUT_READY and ready.async_output_id == batch
    assert ready.result.outputs["r"].images
    beat = messages[-1]
    assert isinstance(beat, Heartbeat) and (beat.rank, beat.steps, beat.packer_alive) == (
        0,
        3,
        True,
    )


def test_without_async_output_the_reply_carries_the_images(make_worker: Any) -> None:
    worker = make_worker(async_output=False)
    worker.start()
    reply = worker.call(execute(request("r")))
    assert reply.kind is AsyncOutputKind.RPC_RESULT
    out = reply.result.outputs["r"]
    assert out.error is None and out.images and out.async_output_id is None


def test_poll_waits_at_most_its_timeout_and_always_ends_with_a_heartbeat(
    make_worker: Any,
) -> None:
    worker = make_worker()
    (before_start,) = worker.poll(0.01)
    assert before_start == Heartbeat(0, 0)
    worker.start()
    (beat,) = worker.poll(0.01)
    assert isinstance(beat, Heartbeat) and beat.steps == 0


def test_abort_sets_the_stop_flags_and_watch_parks(make_worker: Any) -> None:
    worker = make_worker()
    worker.abort(WorkerAbort(("x",)))  # before start: nothing to stop, no error
    worker.start()
    worker.abort(WorkerAbort(("x", "y")))
    flags = worker._host.worker.stop_flags
    assert flags.is_aborted("x") and flags.is_aborted("y")
    watcher = threading.Thread(target=worker.watch, daemon=True)
    watcher.start()
    watcher.join(0.05)
    assert watcher.is_alive()  # parked for as long as the actor lives
    assert worker.shutdown() is True
    assert watcher.is_alive()  # a shut-down actor still lives until it is killed
    assert worker.call(ping()).error_type == "RuntimeError"  # shut down: not started
    worker._never.set()  # the process's death, which ends a real watch, is not here
    watcher.join(5)


@dataclass(frozen=True)
class _Inner:
    tensor: Any
    label: str


def test_to_cpu_keeps_cpu_values_as_they_are() -> None:
    t = torch.ones(2)
    value = {"a": [t, (t, "x")], "b": _Inner(t, "y"), "c": 3}
    assert to_cpu(value) is value
    assert to_cpu(t) is t


def test_to_cpu_moves_device_tensors_everywhere_inside(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor that reports a non-CPU device is replaced by its ``.cpu()`` copy wherever it
    sits: in a dataclass, a dict, a list, a tuple."""

    class FakeDeviceTensor(torch.Tensor):
        """A FAKE accelerator tensor: says it lives on ``cuda``; ``cpu()`` gives a plain one."""

        @property
        def device(self) -> torch.device:  # type: ignore[override]
            return torch.device("cuda", 0)

        def cpu(self) -> torch.Tensor:  # type: ignore[override]
            return torch.Tensor.as_subclass(self, torch.Tensor).clone()

    on_device = torch.ones(2).as_subclass(FakeDeviceTensor)
    moved = to_cpu({"a": [on_device, (on_device, "x")], "b": _Inner(on_device, "y"), "c": 3})
    assert type(moved["a"][0]) is torch.Tensor
    assert isinstance(moved["a"][1], tuple) and type(moved["a"][1][0]) is torch.Tensor
    assert type(moved["b"].tensor) is torch.Tensor and moved["b"].label == "y"
    assert moved["c"] == 3
