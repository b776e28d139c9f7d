"""The Ray worker class, run in this process without Ray: what its calls reply, rank-aware
results, the control calls, and ``to_cpu``.  (The same class as a real actor is exercised by
``tests/executors/test_ray_executor.py``.)"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_trio import EngineConfig, SamplingParams
from omni_trio._core.messages import NewRequestData, SchedulerOutput
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


def test_start_reports_pid_rank_node_and_model(make_worker: Any) -> None:
    worker = make_worker()
    info = worker.start()
    assert info["rank"] == 0 and isinstance(info["pid"], int)
    assert info["model_info"]["name"] == "builtin:echo"
    assert isinstance(info["node_ip"], str) and info["node_ip"]


def test_calls_reply_with_the_result_only_on_the_output_rank(make_worker: Any) -> None:
    rank0, rank1 = make_worker(0, 2, cfg_parallel=False), make_worker(1, 2, cfg_parallel=False)
    rank0.start()
    rank1.start()
    reply0 = rank0.call("ping", (), {}, 0)
    reply1 = rank1.call("ping", (), {}, 0)
    assert reply0["ok"] and reply0["rank"] == 0 and reply0["result"]["rank"] == 0
    assert reply1 == {"rank": 1, "ok": True, "result": None, "steps": 0}
    every = rank1.call("describe", (), {}, None)
    assert every["result"]["rank"] == 1


def test_a_failing_call_replies_with_its_error_and_traceback(make_worker: Any) -> None:
    worker = make_worker()
    before_start = worker.call("ping")
    assert before_start["ok"] is False and before_start["error_type"] == "RuntimeError"
    worker.start()
    reply = worker.call("nope")
    assert reply["ok"] is False
    assert reply["error_type"] == "AttributeError"
    assert "no RPC method 'nope'" in reply["error"]
    assert "Traceback (most recent call last)" in reply["traceback"]


def test_a_forward_counts_steps_and_heartbeat_reports_them(make_worker: Any) -> None:
    worker = make_worker()
    worker.start()
    request = DiffusionRequest(
        "p",
        SamplingParams(num_inference_steps=3, seed=1, height=32, width=32),
        request_id="r",
    )
    output = SchedulerOutput(step_id=1, scheduled_new_reqs=(NewRequestData("r", request),))
    reply = worker.call("execute_scheduler_output", (output,), {}, 0)
    assert reply["ok"], reply
    assert reply["steps"] == 3
    out = reply["result"].outputs["r"]
    assert out.error is None and out.images and out.async_output_id is None  # no packer
    assert worker.heartbeat() == {"rank": 0, "steps": 3, "progress": {}}


def test_abort_sets_the_stop_flag_and_shutdown_ends_watch(make_worker: Any) -> None:
    worker = make_worker()
    assert worker.heartbeat() == {"rank": 0, "steps": 0, "progress": {}}
    worker.abort(["x"])  # before start: nothing to stop, no error
    worker.start()
    worker.abort(["x", "y"])
    assert worker._worker.stop_flags.is_aborted("x")
    returned: list[int] = []
    watcher = threading.Thread(target=lambda: returned.append(worker.watch()))
    watcher.start()
    watcher.join(0.05)
    assert watcher.is_alive()  # parked while the worker lives
    assert worker.shutdown() is True
    watcher.join(5)
    assert not watcher.is_alive() and len(returned) == 1


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
