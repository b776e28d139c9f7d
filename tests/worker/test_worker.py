"""``Worker`` on ``builtin:echo``: device setup, scheduler outputs, the RPC surface, shutdown."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_trio._core.messages import NewRequestData, SchedulerOutput
from omni_trio._core.request import DiffusionRequest, SamplingParams
from omni_trio.config import EngineConfig
from omni_trio.errors import InvalidConfigError
from omni_trio.models.echo import EchoModel, decode_echo_image
from omni_trio.worker.runner import StepProgress
from omni_trio.worker.stop_flags import StopFlags
from omni_trio.worker.worker import (
    RPC_METHODS,
    Worker,
    rank_device,
    resolve_device,
    resolve_dtype,
)
from tests.fakes import register_models


def request(rid: str, seed: int = 3, steps: int = 3) -> DiffusionRequest:
    return DiffusionRequest(
        "p",
        SamplingParams(height=32, width=32, num_inference_steps=steps, seed=seed),
        request_id=rid,
    )


def wave(*requests: DiffusionRequest, finished: frozenset[str] = frozenset()) -> SchedulerOutput:
    return SchedulerOutput(
        step_id=1,
        scheduled_new_reqs=tuple(NewRequestData(r.request_id, r) for r in requests),
        finished_req_ids=finished,
    )


def config(cache_dir: Path, **overrides: Any) -> EngineConfig:
    overrides.setdefault("max_num_seqs", 4)
    overrides.setdefault("torch_threads", 1)
    return EngineConfig(cache_dir=str(cache_dir), **overrides)


@pytest.fixture
def worker(cache_dir: Path) -> Iterator[Worker]:
    w = Worker(config(cache_dir))
    w.init_device()
    w.load_model()
    yield w
    w.shutdown()


def test_resolve_device_and_dtype() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(None).type == expected
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) is torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) is torch.float16
    assert resolve_dtype("float32", cpu) is torch.float32
    assert resolve_dtype("float16", cpu) is torch.float16
    assert resolve_dtype("bfloat16", cpu) is torch.bfloat16


def test_rank_device_gives_each_rank_its_own_gpu_only_when_there_are_enough() -> None:
    assert rank_device("cpu", 1, 2) == (torch.device("cpu"), False)
    assert rank_device("cpu", 0, 1) == (torch.device("cpu"), False)
    if torch.cuda.device_count() >= 2:
        assert rank_device("cuda", 1, 2) == (torch.device("cuda", 1), True)
        assert rank_device("cuda:0", 1, 2) == (torch.device("cuda", 0), False)


@pytest.mark.parametrize(
    ("world_size", "init_method", "match"),
    [(2, None, "rendezvous address"), (3, "tcp://127.0.0.1:1", "exactly 2 workers")],
)
def test_cfg_parallel_needs_two_ranks_and_a_rendezvous(
    cache_dir: Path, world_size: int, init_method: str | None, match: str
) -> None:
    w = Worker(config(cache_dir), rank=1, world_size=world_size, dist_init_method=init_method)
    with pytest.raises(InvalidConfigError, match=match) as info:
        w.init_device()
    assert info.value.field == "cfg_parallel"
    assert w.cfg is None


def test_without_cfg_parallel_each_rank_is_a_full_replica(cache_dir: Path) -> None:
    w = Worker(config(cache_dir, cfg_parallel=False), rank=1, world_size=2)
    try:
        w.init_device()  # no group, no rendezvous needed
        w.load_model()
        assert w.cfg is None
        assert w.describe()["cfg_parallel"] is False
        out = w.execute_scheduler_output(wave(request("solo", seed=5)))
        assert out.outputs == {}  # not the output rank: it ships nothing...
        assert w.steps_done == 3  # ...but ran the whole forward itself
    finally:
        w.shutdown()


def test_each_data_parallel_rank_is_an_output_rank_of_its_own_requests(cache_dir: Path) -> None:
    """Two data-parallel ranks are two replica groups of one: neither joins a CFG group
    (cfg_parallel is on here), each ships what it ran, and a share with no requests (only
    finished ids) runs nothing."""
    w = Worker(config(cache_dir), rank=1, world_size=2, data_parallel_size=2)
    try:
        assert (w.group_size, w.group_rank, w.is_output_rank) == (1, 0, True)
        w.init_device()  # no rendezvous needed
        w.load_model()
        assert w.cfg is None
        w.stop_flags.abort(["gone"])
        out = w.execute_scheduler_output(wave(finished=frozenset({"gone"})))
        assert out.outputs == {} and w.steps_done == 0
        assert not w.stop_flags.is_aborted("gone")
        out = w.execute_scheduler_output(wave(request("mine", seed=5)))
        result = out.get("mine")
        assert result is not None and result.images is not None
        assert decode_echo_image(result.images[0]) == ("mine", 5, 0)
    finally:
        w.shutdown()
    pair = Worker(config(cache_dir), rank=3, world_size=4, data_parallel_size=2)
    assert (pair.group_size, pair.group_rank, pair.is_output_rank) == (2, 1, False)


def test_init_device_applies_the_thread_setting(cache_dir: Path) -> None:
    w = Worker(config(cache_dir, torch_threads=1))
    w.init_device()
    assert torch.get_num_threads() == 1
    assert w.set_torch_threads(1) == 1


def test_load_model_returns_info_and_shares_flags_and_progress(cache_dir: Path) -> None:
    flags = StopFlags()
    progress: StepProgress = {}
    w = Worker(config(cache_dir), stop_flags=flags, progress=progress)
    try:
        info = w.load_model()
        assert info.name == "builtin:echo"
        assert w.model_info == info
        assert w.runner is not None
        assert w.runner.stop_flags is flags
        assert w.runner.progress is progress
        assert w.runner.device == torch.device("cpu")
    finally:
        w.shutdown()


def test_execute_scheduler_output_runs_one_request(worker: Worker) -> None:
    out = worker.execute_scheduler_output(wave(request("solo", seed=11)))
    result = out.get("solo")
    assert result is not None and result.images is not None
    assert decode_echo_image(result.images[0]) == ("solo", 11, 0)


def test_execute_scheduler_output_fuses_a_wave_and_keeps_identity(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    calls: list[tuple[str, ...]] = []

    class RecordingEcho(EchoModel):
        def generate(self, requests: Any, generators: Any, **kw: Any) -> Any:
            calls.append(tuple(r.request_id for r in requests))
            return super().generate(requests, generators, **kw)

    register_models(monkeypatch, {"fake:rec": lambda options: RecordingEcho()})
    w = Worker(config(cache_dir, model="fake:rec"))
    try:
        w.load_model()
        out = w.execute_scheduler_output(wave(request("a", 1), request("b", 2), request("c", 3)))
    finally:
        w.shutdown()
    assert calls == [("a", "b", "c")]  # one fused forward
    for rid, seed in (("a", 1), ("b", 2), ("c", 3)):
        result = out.get(rid)
        assert result is not None and result.images is not None
        assert decode_echo_image(result.images[0]) == (rid, seed, 0)


def test_finished_ids_clear_their_stop_flags_before_the_wave_runs(worker: Worker) -> None:
    worker.stop_flags.abort(["reused", "other"])
    out = worker.execute_scheduler_output(wave(request("reused"), finished=frozenset({"reused"})))
    result = out.get("reused")
    assert result is not None and result.images is not None and not result.aborted
    assert worker.stop_flags.is_aborted("other")
    assert not worker.stop_flags.is_aborted("reused")


def test_aborted_request_in_a_wave_comes_back_aborted(worker: Worker) -> None:
    worker.stop_flags.abort(["gone"])
    out = worker.execute_scheduler_output(wave(request("gone")))
    result = out.get("gone")
    assert result is not None and result.aborted


def test_rpc_surface(worker: Worker) -> None:
    assert worker.execute_method("ping") == {"rank": 0, "pid": os.getpid(), "loaded": True}
    assert worker.execute_method("describe") == {
        "rank": 0,
        "pid": os.getpid(),
        "device": "cpu",
        "model": "builtin:echo",
        "cfg_parallel": False,
    }
    assert worker.execute_method("set_torch_threads", 1) == 1
    out = worker.execute_method("execute_model", request("via-rpc"))
    assert out.request_ids == ("via-rpc",)
    out = worker.execute_method("execute_model_batch", [request("x"), request("y")])
    assert set(out.request_ids) == {"x", "y"}


@pytest.mark.parametrize("method", ["shutdown", "load_model", "__init__", "nope", "_runner"])
def test_methods_outside_the_rpc_surface_are_refused(worker: Worker, method: str) -> None:
    assert method not in RPC_METHODS
    with pytest.raises(AttributeError, match=method):
        worker.execute_method(method)
    assert worker.runner is not None  # nothing ran


def test_rank_and_world_size_are_reported(cache_dir: Path) -> None:
    w = Worker(config(cache_dir), rank=3, world_size=4)
    assert w.ping() == {"rank": 3, "pid": os.getpid(), "loaded": False}
    assert w.describe()["device"] is None
    assert w.world_size == 4


def test_shutdown_releases_the_runner_and_is_idempotent(worker: Worker) -> None:
    runner = worker.runner
    assert runner is not None
    worker.shutdown()
    worker.shutdown()
    assert worker.runner is None
    assert worker.ping()["loaded"] is False
    with pytest.raises(RuntimeError, match="no model loaded"):
        worker.execute_scheduler_output(wave(request("late")))
    with pytest.raises(RuntimeError, match="not loaded"):
        runner.execute_model(request("late"))


def test_leftovers_report_what_the_worker_holds_per_request(cache_dir: Path) -> None:
    w = Worker(config(cache_dir, step_execution=True))
    w.init_device()
    w.load_model()
    try:
        assert w.execute_method("leftovers") == {
            "stop_flags": set(),
            "abort_marks": set(),
            "runner_progress": set(),
            "step_states": set(),
        }
        a, b = request("a"), request("b")
        w.execute_stepwise(wave(a, b))
        w.mark_aborted(["b"])  # an abort of b reached the worker between two ticks
        held = w.leftovers()
        assert held["step_states"] == {"a", "b"}
        assert held["runner_progress"] == {"a", "b"}
        assert held["abort_marks"] == {"b"}
        # The scheduler reports them finished: their state (and b's mark) is evicted.
        w.execute_stepwise(SchedulerOutput(step_id=2, finished_req_ids=frozenset({"a", "b"})))
        assert w.leftovers() == {
            "stop_flags": set(),
            "abort_marks": set(),
            "runner_progress": set(),
            "step_states": set(),
        }
    finally:
        w.shutdown()


def test_a_forwards_stop_flags_are_forgotten_when_it_ends(worker: Worker) -> None:
    worker.stop_flags.abort(["a", "b"])  # a and b are aborted while their forward runs
    out = worker.execute_scheduler_output(wave(request("a"), request("b")))
    assert {o.request_id for o in out if o.aborted} == {"a", "b"}
    assert worker.leftovers()["stop_flags"] == set()


def test_profile_rpcs_trace_the_forwards_and_shutdown_writes_nothing(
    worker: Worker, tmp_path: Path
) -> None:
    """start_profile / stop_profile through the RPC surface (omni_trio.worker.profiler): the
    trace names each forward's span and its rank; a profile still running at shutdown is
    ended without a trace."""
    planned = worker.execute_method("start_profile", str(tmp_path), "w")
    worker.execute_scheduler_output(wave(request("traced")))
    path = worker.execute_method("stop_profile")
    assert path == planned == str(tmp_path / "w-rank0.json")
    with open(path, encoding="utf-8") as trace:
        names = {event.get("name") for event in json.load(trace)["traceEvents"]}
    assert "omni_trio.forward" in names
    with pytest.raises(RuntimeError, match="not profiling"):
        worker.execute_method("stop_profile")
    worker.execute_method("start_profile", str(tmp_path), "left")
    worker.shutdown()
    assert not worker.profiler.active and not (tmp_path / "left-rank0.json").exists()
    assert worker.execute_method("discard_profile") is False


def test_an_abort_that_reaches_the_worker_after_its_forward_leaves_nothing(
    worker: Worker,
) -> None:
    """Found by the fuzzer (a wave's reply delayed past its steps, a consumer dropped in
    between): an abort arriving once the request's forward is over set an abort mark (and a
    stop flag) that nothing cleared on an idle engine.  Such an abort is dropped again now;
    one that arrives before its forward starts still counts, and an id dispatched again (a
    request admitted anew under the same id) can be aborted again."""

    def abort(*ids: str) -> None:  # what WorkerHost.abort and the inproc executor do
        worker.mark_aborted(ids)
        worker.stop_flags.abort(ids)
        worker.drop_late_aborts(ids)

    worker.execute_scheduler_output(wave(request("a")))
    abort("a")
    held = worker.leftovers()
    assert held["abort_marks"] == set() and held["stop_flags"] == set()
    abort("b")  # b's wave has not run yet: its abort is noted
    held = worker.leftovers()
    assert held["abort_marks"] == {"b"} and held["stop_flags"] == {"b"}
    worker.execute_scheduler_output(wave(request("b")))
    assert worker.leftovers()["abort_marks"] == set()
    # "a" again, dispatched (the call arrived) but not started: its abort counts.
    worker.forward_dispatched(["a"])
    abort("a")
    assert worker.leftovers()["stop_flags"] == {"a"}
