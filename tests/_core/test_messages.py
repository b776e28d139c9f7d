"""Messages between engine, scheduler, executors and workers: frozen, keyed by request id."""

from __future__ import annotations

import dataclasses

import pytest

from omni_trio._core.lifecycle import RequestStatus
from omni_trio._core.messages import (
    AsyncOutput,
    AsyncOutputKind,
    BatchRunnerOutput,
    DiffusionOutput,
    NewRequestData,
    RequestMetrics,
    RunnerOutput,
    SchedulerOutput,
)
from omni_trio._core.request import DiffusionRequest


def make_request(request_id: str) -> DiffusionRequest:
    return DiffusionRequest("a cat", request_id=request_id)


def test_new_request_data_checks_identity() -> None:
    data = NewRequestData("r1", make_request("r1"))
    assert data.request.request_id == "r1"
    with pytest.raises(ValueError, match=r"'r1'.*'r2'"):
        NewRequestData("r1", make_request("r2"))


def test_scheduler_output_defaults_are_empty() -> None:
    out = SchedulerOutput(step_id=3)
    assert out.step_id == 3
    assert out.scheduled_new_reqs == ()
    assert out.scheduled_cached_reqs == ()
    assert out.finished_req_ids == frozenset()
    assert out.scheduled_request_ids == ()
    assert out.is_empty


def test_scheduled_request_ids_are_new_then_cached() -> None:
    out = SchedulerOutput(
        step_id=1,
        scheduled_new_reqs=(
            NewRequestData("n2", make_request("n2")),
            NewRequestData("n1", make_request("n1")),
        ),
        scheduled_cached_reqs=("c2", "c1"),
    )
    assert out.scheduled_request_ids == ("n2", "n1", "c2", "c1")
    assert not out.is_empty


def test_output_with_only_cached_or_only_finished() -> None:
    assert not SchedulerOutput(step_id=1, scheduled_cached_reqs=("c",)).is_empty
    # Finished ids alone schedule nothing.
    assert SchedulerOutput(step_id=1, finished_req_ids=frozenset({"f"})).is_empty


def test_runner_output_defaults() -> None:
    out = RunnerOutput("r1", images=("img",))
    assert out.finished is True
    assert out.aborted is False
    assert out.error is None and out.error_type is None
    assert out.step_index is None
    assert out.async_output_id is None
    assert dict(out.timings) == {}


def test_runner_output_from_exception() -> None:
    out = RunnerOutput.from_exception("r1", RuntimeError("CUDA out of memory"), step_index=3)
    assert out.request_id == "r1"
    assert out.error == "CUDA out of memory"
    assert out.error_type == "RuntimeError"
    assert out.step_index == 3
    assert out.images is None


def test_runner_output_from_exception_without_message_uses_repr() -> None:
    out = RunnerOutput.from_exception("r1", KeyError())
    assert out.error == "KeyError()"
    assert out.error_type == "KeyError"


def test_batch_runner_output_is_keyed_by_id() -> None:
    a, b = RunnerOutput("a", images=(1,)), RunnerOutput("b", error="x")
    batch = BatchRunnerOutput.from_list([b, a])
    assert batch.get("a") is a
    assert batch.get("b") is b
    assert batch.get("c") is None
    assert batch.request_ids == ("b", "a")
    assert len(batch) == 2
    assert list(batch) == [b, a]


def test_batch_runner_output_rejects_two_outputs_for_one_id() -> None:
    with pytest.raises(ValueError, match="'a'"):
        BatchRunnerOutput.from_list([RunnerOutput("a"), RunnerOutput("b"), RunnerOutput("a")])


def test_empty_batch_runner_output() -> None:
    batch = BatchRunnerOutput()
    assert len(batch) == 0
    assert batch.get("a") is None
    assert batch.request_ids == ()


def test_async_output_kinds() -> None:
    assert {k.value for k in AsyncOutputKind} == {"rpc_result", "compute_done", "output_ready"}
    out = AsyncOutput(AsyncOutputKind.OUTPUT_READY, async_output_id="b1/r1", result=b"png")
    assert out.async_output_id == "b1/r1"
    assert out.rpc_id is None and out.error is None


@pytest.mark.parametrize(
    ("status", "ok"),
    [
        (RequestStatus.FINISHED_COMPLETED, True),
        (RequestStatus.FINISHED_ERROR, False),
        (RequestStatus.FINISHED_ABORTED, False),
        (RequestStatus.RUNNING, False),
    ],
)
def test_diffusion_output_ok(status: RequestStatus, ok: bool) -> None:
    assert DiffusionOutput("r1", status).ok is ok


def test_diffusion_output_defaults() -> None:
    out = DiffusionOutput("r1", RequestStatus.FINISHED_COMPLETED, images=("img",), seed=7)
    assert out.finished is True
    assert out.chunk_index == 0 and out.total_chunks == 1
    assert out.metrics == RequestMetrics()
    assert out.seed == 7


@pytest.mark.parametrize(
    "message",
    [
        NewRequestData("r1", make_request("r1")),
        SchedulerOutput(step_id=1),
        RunnerOutput("r1"),
        BatchRunnerOutput(),
        AsyncOutput(AsyncOutputKind.RPC_RESULT, rpc_id="1"),
        RequestMetrics(),
        DiffusionOutput("r1", RequestStatus.FINISHED_COMPLETED),
    ],
    ids=lambda m: type(m).__name__,
)
def test_messages_are_frozen(message: object) -> None:
    field = dataclasses.fields(message)[0].name  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(message, field, None)
