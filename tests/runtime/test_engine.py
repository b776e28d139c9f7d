"""The engine actor: admission, streams, aborts, RPC ordering, close, death, coalescing.

Two kinds of engine are used:

- a :class:`ScriptedExecutor` backend (no threads): exact ordering and, under
  ``MockClock`` autojump, exact virtual times;
- the real ``inproc`` backend on ``builtin:echo`` (its outputs name request and seed), with a
  :class:`StepGate` where a test must hold a forward at a known step.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import trio
import trio.testing

from omni_trio import (
    AsyncEngine,
    DiffusionRequest,
    DuplicateRequestError,
    EngineClosedError,
    EngineConfig,
    EngineDeadError,
    InvalidRequestError,
    RequestAbortedError,
    RequestFailedError,
    RequestStatus,
    RequestTimeoutError,
    SamplingParams,
    StallError,
    WorkerError,
    open_engine,
)
from omni_trio._core.messages import BatchRunnerOutput, RunnerOutput, SchedulerOutput
from omni_trio.executors import inproc
from omni_trio.models.echo import EchoModel, decode_echo_image
from omni_trio.runtime.engine import WARMUP_REQUEST_ID, raise_for_status
from omni_trio.worker.worker import Worker
from tests.fakes import (
    GATE_S,
    BlockingModel,
    FakeImage,
    GatedEchoModel,
    ScriptedExecutor,
    ScriptedModel,
    StepGate,
    register_models,
)

S = RequestStatus
CAP_S = 30.0
WORKER_THREAD = "omni-trio-worker-0"


def params(**kw: Any) -> SamplingParams:
    kw.setdefault("height", 32)
    kw.setdefault("width", 32)
    kw.setdefault("num_inference_steps", 2)
    return SamplingParams(**kw)


@asynccontextmanager
async def scripted_engine(
    **overrides: Any,
) -> AsyncIterator[tuple[AsyncEngine, ScriptedExecutor]]:
    overrides.setdefault("backend", ScriptedExecutor)
    overrides.setdefault("warmup", False)
    async with open_engine(EngineConfig(**overrides)) as engine:
        executor = engine.executor
        assert isinstance(executor, ScriptedExecutor)
        yield engine, executor


@asynccontextmanager
async def echo_engine(cache_dir: Path, **overrides: Any) -> AsyncIterator[AsyncEngine]:
    overrides.setdefault("torch_threads", 1)
    overrides.setdefault("warmup", False)
    async with open_engine(EngineConfig(cache_dir=str(cache_dir), **overrides)) as engine:
        yield engine


@asynccontextmanager
async def gated_engine(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path, **overrides: Any
) -> AsyncIterator[tuple[AsyncEngine, StepGate]]:
    """An inproc engine on echo whose steps the test releases one by one."""
    gate = StepGate()
    register_models(monkeypatch, {"fake:gated-echo": lambda options: GatedEchoModel(gate)})
    async with echo_engine(cache_dir, model="fake:gated-echo", **overrides) as engine:
        try:
            yield engine, gate
        finally:
            gate.open()  # a held forward must not stall the close


def snapshot(engine: AsyncEngine) -> tuple[int, ...]:
    st = engine.statistics()
    return (
        st.waiting,
        st.running,
        st.admitted,
        st.finished_completed,
        st.finished_aborted,
        st.finished_error,
        st.open_streams,
    )


async def expect_raises(exc_type: type[BaseException], afn: Any, *args: Any, **kw: Any) -> Any:
    with pytest.raises(exc_type) as info:
        await afn(*args, **kw)
    return info.value


# ---------------------------------------------------------------------------------------
# Scripted backend: admission, outputs, aborts, RPCs, close and death.
# ---------------------------------------------------------------------------------------


async def test_generate_returns_the_completed_output() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            out = await engine.generate("a cat", params(seed=5), request_id="r1")
    assert out.ok and out.status is S.FINISHED_COMPLETED and out.finished
    assert out.request_id == "r1"
    assert out.images == (FakeImage("r1", 5),)
    assert out.seed == 5
    assert out.error is None and out.error_type is None
    assert executor.batches == [("r1",)]
    assert executor.requests["r1"].prompt == "a cat"


async def test_seed_is_chosen_at_admission_and_reported() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            stream = engine.stream("p", params(), request_id="s")
            seed = stream.seed
            assert isinstance(seed, int) and 0 <= seed < 2**31
            async with stream:
                outs = [out async for out in stream]
    assert [o.seed for o in outs] == [seed]
    # The workers ran with exactly the seed reported.
    assert executor.requests["s"].sampling.seed == seed
    assert outs[0].images == (FakeImage("s", seed),)


async def test_an_explicit_seed_is_kept() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            stream = engine.stream("p", params(seed=0))
            assert stream.seed == 0
            async with stream:
                assert [o.seed async for o in stream] == [0]
    assert executor.requests[stream.request_id].sampling.seed == 0


async def test_request_ids_are_generated_or_taken_from_the_caller() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, _):
            generated = await engine.generate("p", params(seed=1))
            empty = await engine.generate("p", params(seed=1), request_id="")
            named = await engine.generate("p", params(seed=1), request_id="mine")
            request = DiffusionRequest("obj", params(seed=2), request_id="obj-id")
            from_obj = await engine.generate(request)
            overridden = await engine.generate(request, params(seed=3), request_id="other")
    assert generated.request_id.startswith("req-")
    assert empty.request_id.startswith("req-") and empty.request_id != generated.request_id
    assert named.request_id == "mine"
    assert (from_obj.request_id, from_obj.seed) == ("obj-id", 2)
    assert (overridden.request_id, overridden.seed) == ("other", 3)


@pytest.mark.parametrize(
    ("prompt", "sampling", "request_id", "param"),
    [
        (42, None, None, "prompt"),
        ("p", params(height=30), None, "height"),
        ("p", params(num_inference_steps=0), None, "num_inference_steps"),
        ("p", params(output_type="gif"), None, "output_type"),
        ("p", params(seed=-1), None, "seed"),
        ("p", params(guidance_scale=float("nan")), None, "guidance_scale"),
        ("p", params(), "bad\nid", "request_id"),
        ("p", params(), "x" * 257, "request_id"),
        ("x" * 10_001, params(), None, "prompt"),
        ("p", params(num_outputs_per_prompt=17), None, "num_outputs_per_prompt"),
        ("p", params(height=2048, width=2048), None, "size"),
        ("p", {"seed": 1}, None, "sampling"),  # not SamplingParams at all
        ("p", params(image="in.png"), None, "image"),
    ],
)
async def test_invalid_requests_are_rejected_before_admission(
    prompt: Any, sampling: SamplingParams | None, request_id: str | None, param: str
) -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            before = snapshot(engine)
            error = await expect_raises(
                InvalidRequestError, engine.generate, prompt, sampling, request_id=request_id
            )
            assert error.param == param
            with pytest.raises(InvalidRequestError):
                engine.stream(prompt, sampling, request_id=request_id)
            await trio.testing.wait_all_tasks_blocked()
            assert snapshot(engine) == before
            assert executor.log == []
            # The engine is unharmed.
            assert (await engine.generate("p", params(seed=1))).ok


async def test_a_duplicate_active_id_is_rejected_and_reusable_later() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            executor.hold = True
            first = engine.stream("p", params(seed=1), request_id="dup")
            await executor.wait_for_forward("dup")
            before = snapshot(engine)
            with pytest.raises(DuplicateRequestError) as info:
                engine.stream("p", params(seed=2), request_id="dup")
            assert info.value.request_id == "dup"
            assert info.value.param == "request_id"
            assert snapshot(engine) == before
            # A waiting duplicate is rejected as well.
            queued = engine.stream("p", params(), request_id="queued")
            with pytest.raises(DuplicateRequestError):
                engine.stream("p", params(), request_id="queued")
            executor.hold = False
            executor.release()
            async with first:
                assert [o.ok async for o in first] == [True]
            await queued.aclose()
            again = await engine.generate("p", params(seed=3), request_id="dup")
    assert again.ok and again.seed == 3


async def test_statistics_count_every_outcome() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            stats = engine.statistics()
            counts = (stats.admitted, stats.waiting, stats.running, stats.open_streams)
            assert counts == (0, 0, 0, 0)
            assert not stats.dead and not stats.closed
            executor.hold = True
            running = engine.stream("p", params(), request_id="running")
            waiting1 = engine.stream("p", params(height=64), request_id="w1")
            waiting2 = engine.stream("p", params(), request_id="w2")
            await executor.wait_for_forward("running")
            stats = engine.statistics()
            counts = (stats.admitted, stats.waiting, stats.running, stats.open_streams)
            assert counts == (3, 2, 1, 3)
            engine.abort("w1")
            executor.release()
            async with running, waiting2:
                assert [o.status async for o in running] == [S.FINISHED_COMPLETED]
                await executor.wait_for_forward("w2")
                executor.release()
                assert [o.status async for o in waiting2] == [S.FINISHED_COMPLETED]
            async with waiting1:
                assert [o.status async for o in waiting1] == [S.FINISHED_ABORTED]
            executor.hold = False
            executor.fail_forward = ValueError("bad input")
            with pytest.raises(RequestFailedError):
                await engine.generate("p", params(), request_id="failing")
            stats = engine.statistics()
    assert stats.admitted == 4
    assert (stats.finished_completed, stats.finished_aborted, stats.finished_error) == (2, 1, 1)
    assert (stats.waiting, stats.running, stats.open_streams) == (0, 0, 0)
    assert stats.execution.count == 2 and stats.end_to_end.count == 2
    after = engine.statistics()
    assert after.closed and not after.dead


async def test_a_fused_wave_keeps_fifo_order_and_capacity() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine(max_num_seqs=4) as (engine, executor):
            # Admitted without a checkpoint in between: the loop sees all six at once.
            streams = [engine.stream("p", params(seed=i), request_id=f"r{i}") for i in range(6)]
            for stream in streams:
                async with stream:
                    assert [o.ok async for o in stream] == [True]
    assert executor.batches == [("r0", "r1", "r2", "r3"), ("r4", "r5")]


async def test_an_incompatible_head_blocks_the_wave() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine(max_num_seqs=4) as (engine, executor):
            executor.hold = True
            streams = [
                engine.stream("p", params(), request_id="a"),
                engine.stream("p", params(height=64), request_id="big"),
                engine.stream("p", params(), request_id="b"),
            ]
            await executor.wait_for_forward("a")
            executor.hold = False
            executor.release()
            for stream in streams:
                async with stream:
                    async for _ in stream:
                        pass
    # "b" is compatible with "a" but is not moved ahead of the incompatible "big".
    assert executor.batches == [("a",), ("big",), ("b",)]


async def test_results_are_delivered_by_id_whatever_the_order() -> None:
    class Reversed(ScriptedExecutor):
        async def execute_batch(self, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
            out = await super().execute_batch(scheduler_output)
            return BatchRunnerOutput.from_list(list(reversed(list(out))))

    with trio.fail_after(CAP_S):
        async with scripted_engine(backend=Reversed, max_num_seqs=4) as (engine, _):
            results: dict[str, Any] = {}

            async def run(rid: str, seed: int) -> None:
                results[rid] = await engine.generate("p", params(seed=seed), request_id=rid)

            async with trio.open_nursery() as nursery:
                for i in range(4):
                    nursery.start_soon(run, f"id{i}", 100 + i)
    for i in range(4):
        assert results[f"id{i}"].images == (FakeImage(f"id{i}", 100 + i),)


async def test_abort_of_a_waiting_request_is_terminal_at_once_and_it_never_runs() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            executor.hold = True
            running = engine.stream("p", params(), request_id="running")
            waiting = engine.stream("p", params(), request_id="waiting")
            await executor.wait_for_forward("running")
            engine.abort("waiting")
            # Terminal at once: no engine turn is needed to deliver it.
            assert engine.statistics().finished_aborted == 1
            out = await waiting.__anext__()
            assert out.status is S.FINISHED_ABORTED and out.finished
            assert out.error_type == "RequestAbortedError"
            assert executor.aborted == []  # nothing to stop in the workers
            executor.hold = False
            executor.release()
            async with running:
                async for _ in running:
                    pass
            await trio.testing.wait_all_tasks_blocked()
    assert executor.batches == [("running",)]
    with pytest.raises(RequestAbortedError):
        raise_for_status(out)


async def test_abort_of_a_running_request_is_terminal_at_once_and_stops_the_forward() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            executor.hold = True
            stream = engine.stream("p", params(), request_id="r")
            await executor.wait_for_forward("r")
            engine.abort("r")
            assert executor.aborted == ["r"]
            out = await stream.__anext__()
            assert out.status is S.FINISHED_ABORTED
            # The fake forward stops at its next "step" once all its requests are aborted.
            await executor.wait_until(lambda: executor.in_forward is None)
            executor.hold = False
            nxt = await engine.generate("p", params(seed=1), request_id="next")
    assert nxt.ok
    # The late (aborted) result of "r" was never delivered: the stream ended with one output.
    with pytest.raises(StopAsyncIteration):
        await stream.__anext__()


async def test_generate_raises_request_aborted_when_aborted() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            executor.hold = True
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    partial(
                        expect_raises,
                        RequestAbortedError,
                        engine.generate,
                        "p",
                        params(),
                        request_id="x",
                    )
                )
                await executor.wait_for_forward("x")
                engine.abort("x")


async def test_abort_ignores_unknown_and_finished_ids() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            done = await engine.generate("p", params(seed=1), request_id="done")
            before = snapshot(engine)
            engine.abort()
            engine.abort("done", "never-existed")
            assert snapshot(engine) == before
            assert executor.aborted == []
    assert done.ok


async def test_cancelling_the_consumer_aborts_and_frees_the_slot() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            executor.hold = True
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(engine.generate, "p", params(), request_id="victim"))
                await executor.wait_for_forward("victim")
                nursery.cancel_scope.cancel()
            assert executor.aborted == ["victim"]
            stats = engine.statistics()
            assert (stats.finished_aborted, stats.running, stats.open_streams) == (1, 0, 0)
            executor.hold = False
            nxt = await engine.generate("p", params(seed=1), request_id="next")
    assert nxt.ok
    assert executor.batches == [("victim",), ("next",)]


async def test_breaking_out_of_a_stream_aborts() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            executor.hold = True
            for _ in range(1):
                async with engine.stream("p", params(), request_id="broken"):
                    await executor.wait_for_forward("broken")
                    break  # out of the loop and the ``async with``, terminal output unread
            assert executor.aborted == ["broken"]
            assert engine.statistics().finished_aborted == 1


async def test_aclose_of_an_unread_stream_aborts_a_waiting_request() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            executor.hold = True
            first = engine.stream("p", params(), request_id="first")
            second = engine.stream("p", params(), request_id="second")
            await executor.wait_for_forward("first")
            await second.aclose()
            stats = engine.statistics()
            assert (stats.waiting, stats.finished_aborted, stats.open_streams) == (0, 1, 1)
            assert executor.aborted == []  # it never ran, nothing to stop
            await first.aclose()


async def test_a_dropped_stream_aborts_its_request() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            executor.hold = True
            stream = engine.stream("p", params(), request_id="dropped")
            await executor.wait_for_forward("dropped")
            del stream
            gc.collect()
            await executor.wait_until(lambda: executor.aborted == ["dropped"])
            assert engine.statistics().finished_aborted == 1


async def test_execution_error_becomes_a_request_error_and_the_loop_lives_on() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine(max_num_seqs=2) as (engine, executor):
            executor.fail_forward = ValueError("bad batch")
            with pytest.raises(RequestFailedError) as info:
                await engine.generate("p", params(), request_id="f")
            assert info.value.error_type == "ValueError"
            assert info.value.error == "bad batch"
            executor.fail_forward = None
            ok = await engine.generate("p", params(seed=1), request_id="ok")
            engine.check_health()
    assert ok.ok


async def test_a_missing_runner_output_fails_only_that_request() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine(max_num_seqs=2) as (engine, executor):
            executor.missing_outputs = {"lost"}
            results: dict[str, Any] = {}

            async def run(rid: str) -> None:
                try:
                    results[rid] = await engine.generate("p", params(seed=1), request_id=rid)
                except RequestFailedError as exc:
                    results[rid] = exc

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "lost")
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(run, "kept")
    assert isinstance(results["lost"], RequestFailedError)
    assert results["lost"].error_type == "MissingOutputError"
    assert results["kept"].ok


async def test_progress_comes_from_the_executor() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            executor.progress_map["r"] = (3, 10)
            assert engine.progress("r") == (3, 10)
            assert engine.progress("other") is None


async def test_rpc_issued_during_a_forward_runs_after_it_and_before_the_next_batch() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            executor.hold = True
            first = engine.stream("p", params(), request_id="first")
            await executor.wait_for_forward("first")
            replies: list[Any] = []

            async def rpc() -> None:
                replies.append(await engine.collective_rpc("ping"))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(rpc)
                await trio.testing.wait_all_tasks_blocked()
                second = engine.stream("p", params(), request_id="second")
                await trio.testing.wait_all_tasks_blocked()
                # Never concurrent with a batch: nothing ran while "first" is in flight.
                assert [kind for kind, _, _ in executor.log] == ["batch"]
                executor.hold = False
                executor.release()
            for stream in (first, second):
                async with stream:
                    async for _ in stream:
                        pass
    assert replies == ["pong"]
    assert [(kind, ids) for kind, _, ids in executor.log] == [
        ("batch", ("first",)),
        ("rpc", ("ping",)),
        ("batch", ("second",)),
    ]


async def test_queued_rpcs_go_before_queued_requests() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            executor.hold = True
            running = engine.stream("p", params(), request_id="a")
            await executor.wait_for_forward("a")
            waiting = engine.stream("p", params(), request_id="b")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.collective_rpc, "ping")
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(engine.collective_rpc, "ping")
                await trio.testing.wait_all_tasks_blocked()
                executor.hold = False
                executor.release()
            for stream in (running, waiting):
                async with stream:
                    async for _ in stream:
                        pass
    assert [kind for kind, _, _ in executor.log] == ["batch", "rpc", "rpc", "batch"]


async def test_rpc_replies_errors_and_all_ranks() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, _):
            assert await engine.collective_rpc("ping") == "pong"
            assert await engine.collective_rpc("ping", unique_reply_rank=None) == ["pong"]
            with pytest.raises(ValueError, match="on purpose"):
                await engine.collective_rpc("fail")
            with pytest.raises(AttributeError):
                await engine.collective_rpc("no_such_method")
            assert await engine.collective_rpc("ping") == "pong"


async def test_rpc_timeout_while_queued_raises_stall_and_skips_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            executor.hold = True
            stream = engine.stream("p", params(), request_id="long")
            await executor.wait_for_forward("long")
            start = trio.current_time()
            with pytest.raises(StallError) as info:
                await engine.collective_rpc("ping", timeout=2.0)
            assert info.value.phase == "rpc"
            assert trio.current_time() - start == pytest.approx(2.0)
            executor.hold = False
            executor.release()
            async with stream:
                async for _ in stream:
                    pass
            assert await engine.collective_rpc("ping") == "pong"
    # The timed-out RPC was skipped, never run after its caller gave up.
    assert [kind for kind, _, _ in executor.log] == ["batch", "rpc"]


async def test_rpc_timeout_defaults_to_the_configured_one(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine(rpc_timeout_s=1.5) as (engine, executor):
            executor.hold = True
            stream = engine.stream("p", params(), request_id="long")
            await executor.wait_for_forward("long")
            start = trio.current_time()
            with pytest.raises(StallError):
                await engine.collective_rpc("ping")
            assert trio.current_time() - start == pytest.approx(1.5)
            # An explicit timeout wins over the configured one.
            start = trio.current_time()
            with pytest.raises(StallError):
                await engine.collective_rpc("ping", timeout=4.0)
            assert trio.current_time() - start == pytest.approx(4.0)
            await stream.aclose()


async def test_an_rpc_cancelled_while_queued_never_runs() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            executor.hold = True
            stream = engine.stream("p", params(), request_id="a")
            await executor.wait_for_forward("a")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.collective_rpc, "ping")
                await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel()
            executor.hold = False
            executor.release()
            async with stream:
                async for _ in stream:
                    pass
            await trio.testing.wait_all_tasks_blocked()
    assert [kind for kind, _, _ in executor.log] == ["batch"]


async def test_close_with_pending_requests_ends_them_with_engine_closed() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            executor.hold = True
            errors: dict[str, BaseException] = {}

            async def run(rid: str) -> None:
                with pytest.raises(EngineClosedError) as info:
                    await engine.generate("p", params(), request_id=rid)
                errors[rid] = info.value

            async def rpc() -> None:
                with pytest.raises(EngineClosedError):
                    await engine.collective_rpc("ping")
                errors["rpc"] = EngineClosedError()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "running")
                await executor.wait_for_forward("running")
                nursery.start_soon(run, "waiting")
                nursery.start_soon(rpc)
                await trio.testing.wait_all_tasks_blocked()
                await engine.aclose()
            assert set(errors) == {"running", "waiting", "rpc"}
            assert "running" in executor.aborted  # the forward in flight was told to stop
            assert executor.closed
            assert engine.is_closed and not engine.is_dead
            stats = engine.statistics()
            assert stats.closed and (stats.waiting, stats.running, stats.open_streams) == (0, 0, 0)
            assert stats.finished_aborted == 2
            # Later calls: closed, not dead.
            with pytest.raises(EngineClosedError):
                engine.stream("p", params())
            with pytest.raises(EngineClosedError):
                await engine.generate("p", params())
            with pytest.raises(EngineClosedError):
                await engine.collective_rpc("ping")
            with pytest.raises(EngineClosedError):
                engine.check_health()
            await engine.aclose()  # idempotent
    assert executor.batches == [("running",)]


async def test_close_is_shielded_from_the_callers_cancellation() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            executor.hold = True
            stream = engine.stream("p", params(), request_id="r")
            await executor.wait_for_forward("r")
            with trio.CancelScope() as scope:
                scope.cancel()
                await engine.aclose()
            assert engine.is_closed
            assert executor.closed
            out = await stream.__anext__()
            assert out.error_type == "EngineClosedError"


async def test_leaving_open_engine_closes_everything() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            executor.hold = True
            stream = engine.stream("p", params(), request_id="r")
            await executor.wait_for_forward("r")
    assert engine.is_closed
    assert executor.serve_exited and executor.closed
    out = await stream.__anext__()
    assert out.status is S.FINISHED_ABORTED and out.error_type == "EngineClosedError"
    with pytest.raises(EngineClosedError):
        raise_for_status(out)


async def test_executor_death_past_the_restart_limit_kills_the_engine() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine(max_num_seqs=1, max_worker_restarts=0) as (engine, executor):
            executor.hold = True
            first = engine.stream("p", params(), request_id="first")
            await executor.wait_for_forward("first")
            second = engine.stream("p", params(), request_id="second")
            # The next forward finds the worker group gone.
            executor.die_in_forward = RuntimeError("gpu fell off the bus")
            executor.release()
            outs = []
            for stream in (first, second):
                async with stream:
                    outs.extend([o async for o in stream])
            # "first" had completed before the group died; "second" was waiting.
            assert outs[0].ok
            assert outs[1].status is S.FINISHED_ERROR
            assert outs[1].error_type == "EngineDeadError"
            assert "gpu fell off the bus" in (outs[1].error or "")
            with pytest.raises(EngineDeadError):
                raise_for_status(outs[1])
            assert engine.is_dead
            stats = engine.statistics()
            assert stats.dead and stats.finished_error == 1 and stats.open_streams == 0
            with pytest.raises(EngineDeadError, match="gpu fell off the bus"):
                engine.check_health()
            with pytest.raises(EngineDeadError):
                await engine.generate("p", params())
            with pytest.raises(EngineDeadError):
                engine.stream("p", params())
            with pytest.raises(EngineDeadError):
                await engine.collective_rpc("ping")
    # Leaving the block after death is clean and still closes the executor.
    assert executor.closed and executor.serve_exited


async def test_executor_death_mid_forward_fails_running_waiting_and_queued_rpcs() -> None:
    class DiesWhenReleased(ScriptedExecutor):
        async def execute_batch(self, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
            out = await super().execute_batch(scheduler_output)
            if self.die_in_forward is not None:
                self.fail(self.die_in_forward)
                raise EngineDeadError("worker 0 failed")
            return out

    with trio.fail_after(CAP_S):
        async with scripted_engine(backend=DiesWhenReleased, max_worker_restarts=0) as (
            engine,
            executor,
        ):
            executor.hold = True
            errors: dict[str, BaseException] = {}

            async def run(rid: str) -> None:
                try:
                    await engine.generate("p", params(), request_id=rid)
                except EngineDeadError as exc:
                    errors[rid] = exc

            async def rpc() -> None:
                try:
                    await engine.collective_rpc("ping")
                except EngineDeadError as exc:
                    errors["rpc"] = exc

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "running")
                await executor.wait_for_forward("running")
                nursery.start_soon(run, "waiting")
                nursery.start_soon(rpc)
                await trio.testing.wait_all_tasks_blocked()
                executor.die_in_forward = OSError("worker exited")
                executor.release()
            assert set(errors) == {"running", "waiting", "rpc"}
            assert engine.is_dead
            with pytest.raises(EngineDeadError):
                engine.check_health()
    assert [kind for kind, _, _ in executor.log] == ["batch"]  # the RPC never ran


async def test_health_reports_a_failed_group_before_the_loop_notices() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine(worker_restart_backoff_s=0.0) as (engine, executor):
            engine.check_health()
            assert engine.health().healthy
            executor.fail(RuntimeError("heartbeat lost"))
            # Not healthy from the moment the group failed, before anything else ran.
            with pytest.raises(WorkerError, match="heartbeat lost"):
                engine.check_health()
            health = engine.health()
            assert not health.healthy and health.state == "restarting"
            assert [w.state for w in health.workers] == ["restarting"]
            await trio.testing.wait_all_tasks_blocked()
            # The supervisor restarted the group: healthy again, with a new executor.
            engine.check_health()
            health = engine.health()
            assert health.healthy and health.restarts == 1
            assert health.last_failure == "RuntimeError: heartbeat lost"
            assert engine.executor is not executor and executor.closed
            assert engine.statistics().restarts == 1


class WarmupFails(ScriptedExecutor):
    instances: ClassVar[list[ScriptedExecutor]] = []

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        WarmupFails.instances.append(self)

    async def execute_batch(self, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
        self.log.append(("batch", trio.current_time(), scheduler_output.scheduled_request_ids))
        return BatchRunnerOutput.from_list(
            [
                RunnerOutput(rid, error="weights are garbage", error_type="ValueError")
                for rid in scheduler_output.scheduled_request_ids
            ]
        )


async def test_warmup_failure_closes_the_engine_and_raises() -> None:
    WarmupFails.instances.clear()
    with trio.fail_after(CAP_S):
        with pytest.raises(RuntimeError, match="warmup failed") as info:
            async with open_engine(EngineConfig(backend=WarmupFails, warmup=True)):
                pytest.fail("the body must not run")  # pragma: no cover
    assert isinstance(info.value.__cause__, RequestFailedError)
    assert "weights are garbage" in str(info.value)
    (executor,) = WarmupFails.instances
    assert executor.batches == [(WARMUP_REQUEST_ID,)]
    assert executor.closed and executor.serve_exited


async def test_warmup_runs_one_small_seeded_request() -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine(warmup=True) as (engine, executor):
            assert executor.batches == [(WARMUP_REQUEST_ID,)]
            warm = executor.requests[WARMUP_REQUEST_ID].sampling
            assert (warm.height, warm.width, warm.num_inference_steps, warm.seed) == (64, 64, 2, 0)
            # The warmup id is free again once the engine is ready.
            assert engine.statistics().open_streams == 0


async def test_open_engine_applies_overrides() -> None:
    with trio.fail_after(CAP_S):
        base = EngineConfig(backend=ScriptedExecutor, warmup=False)
        async with open_engine(base, max_num_seqs=3) as engine:
            assert engine.config.max_num_seqs == 3
            assert engine.scheduler.capacity == 3


# ---------------------------------------------------------------------------------------
# Admission coalescing: exact virtual times under MockClock (scripted backend, no threads).
# ---------------------------------------------------------------------------------------


@asynccontextmanager
async def coalescing_engine(
    max_num_seqs: int, wait_ms: float = 100.0, forward_s: float = 0.0
) -> AsyncIterator[tuple[AsyncEngine, ScriptedExecutor]]:
    async with scripted_engine(max_num_seqs=max_num_seqs, request_batch_max_wait_ms=wait_ms) as (
        engine,
        executor,
    ):
        executor.forward_s = forward_s
        yield engine, executor


async def submit_at(
    engine: AsyncEngine, nursery: trio.Nursery, t0: float, schedule: list[tuple[float, str]]
) -> None:
    """Start ``generate`` for each ``(offset, request_id)`` at virtual time ``t0 + offset``."""

    async def generate(rid: str) -> None:
        try:
            await engine.generate("p", params(seed=1), request_id=rid)
        except RequestAbortedError:
            pass

    for offset, rid in schedule:
        await trio.sleep_until(t0 + offset)
        nursery.start_soon(generate, rid)


def waves(executor: ScriptedExecutor, t0: float) -> list[tuple[float, tuple[str, ...]]]:
    return [(round(t - t0, 9), ids) for kind, t, ids in executor.log if kind == "batch"]


async def test_coalescing_waits_for_a_quiet_window(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # wait 100 ms -> quiet window min(50 ms, 100 ms / 5) = 20 ms.
    with trio.fail_after(CAP_S):
        async with coalescing_engine(4) as (engine, executor), trio.open_nursery() as nursery:
            t0 = trio.current_time()
            await submit_at(engine, nursery, t0, [(0.0, "a"), (0.0, "b")])
    assert waves(executor, t0) == [(0.02, ("a", "b"))]


async def test_coalescing_window_restarts_when_the_queue_grows(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(CAP_S):
        async with coalescing_engine(4) as (engine, executor), trio.open_nursery() as nursery:
            t0 = trio.current_time()
            await submit_at(engine, nursery, t0, [(0.0, "a"), (0.015, "b"), (0.03, "c")])
    assert waves(executor, t0) == [(0.05, ("a", "b", "c"))]


async def test_coalescing_ends_at_the_deadline(autojump_clock: trio.testing.MockClock) -> None:
    arrivals = [(0.015 * i, f"r{i}") for i in range(7)]  # 0 .. 90 ms, never quiet for 20 ms
    with trio.fail_after(CAP_S):
        async with coalescing_engine(8) as (engine, executor), trio.open_nursery() as nursery:
            t0 = trio.current_time()
            await submit_at(engine, nursery, t0, arrivals)
    assert waves(executor, t0) == [(0.1, tuple(rid for _, rid in arrivals))]


async def test_a_full_wave_does_not_wait(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(CAP_S):
        async with coalescing_engine(3) as (engine, executor), trio.open_nursery() as nursery:
            t0 = trio.current_time()
            await submit_at(engine, nursery, t0, [(0.0, "a"), (0.01, "b"), (0.012, "c")])
    assert waves(executor, t0) == [(0.012, ("a", "b", "c"))]


async def test_waves_form_after_a_busy_forward(autojump_clock: trio.testing.MockClock) -> None:
    schedule = [(0.0, "a"), (0.1, "b"), (0.1, "c"), (0.1, "d"), (0.1, "e"), (0.6, "f")]
    with trio.fail_after(CAP_S):
        async with (
            coalescing_engine(4, forward_s=0.5) as (engine, executor),
            trio.open_nursery() as nursery,
        ):
            t0 = trio.current_time()
            await submit_at(engine, nursery, t0, schedule)
    assert waves(executor, t0) == [
        (0.02, ("a",)),  # alone after the quiet window
        (0.52, ("b", "c", "d", "e")),  # full as soon as "a" finished
        (1.02, ("f",)),  # queued long enough ago: no further wait
    ]


async def test_no_coalescing_by_default(autojump_clock: trio.testing.MockClock) -> None:
    with trio.fail_after(CAP_S):
        async with (
            coalescing_engine(4, wait_ms=0.0) as (engine, executor),
            trio.open_nursery() as nursery,
        ):
            t0 = trio.current_time()
            await submit_at(engine, nursery, t0, [(0.0, "a"), (0.01, "b")])
    assert waves(executor, t0) == [(0.0, ("a",)), (0.01, ("b",))]


async def test_a_request_aborted_while_coalescing_is_left_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(CAP_S):
        async with coalescing_engine(4) as (engine, executor), trio.open_nursery() as nursery:
            t0 = trio.current_time()
            await submit_at(engine, nursery, t0, [(0.0, "a"), (0.0, "b"), (0.0, "c")])
            await trio.sleep_until(t0 + 0.01)
            engine.abort("b")
    assert waves(executor, t0) == [(0.02, ("a", "c"))]


async def test_metrics_report_queue_wait_execution_and_end_to_end(
    autojump_clock: trio.testing.MockClock,
) -> None:
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            executor.forward_s = 0.5
            results: dict[str, Any] = {}

            async def run(rid: str) -> None:
                results[rid] = await engine.generate("p", params(seed=1), request_id=rid)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "first")
                await trio.testing.wait_all_tasks_blocked(cushion=0.0)
                nursery.start_soon(run, "second")
            stats = engine.statistics()
    first, second = results["first"].metrics, results["second"].metrics
    assert first.queue_wait_ms == pytest.approx(0.0, abs=1e-6)
    assert first.execution_ms == pytest.approx(500.0)
    assert first.e2e_ms == pytest.approx(500.0)
    assert second.queue_wait_ms == pytest.approx(500.0)
    assert second.execution_ms == pytest.approx(500.0)
    assert second.e2e_ms == pytest.approx(1000.0)
    assert stats.end_to_end.count == 2
    assert stats.end_to_end.max_ms == pytest.approx(1000.0)
    assert stats.queue_wait.mean_ms == pytest.approx(250.0)


# ---------------------------------------------------------------------------------------
# The real inproc backend on builtin:echo.
# ---------------------------------------------------------------------------------------


async def test_concurrent_requests_each_get_their_own_result(cache_dir: Path) -> None:
    results: dict[str, Any] = {}
    with trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, max_num_seqs=4) as engine:

            async def run(i: int) -> None:
                results[f"req-{i}"] = await engine.generate(
                    f"prompt {i}", params(seed=1000 + i), request_id=f"req-{i}"
                )

            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(run, i)
            stats = engine.statistics()
    assert len(results) == 20
    for i in range(20):
        out = results[f"req-{i}"]
        assert out.ok and out.seed == 1000 + i
        assert decode_echo_image(out.images[0]) == (f"req-{i}", 1000 + i, 0)
    assert stats.finished_completed == 20 and stats.open_streams == 0


async def test_concurrent_requests_run_in_fused_waves_of_max_num_seqs(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    forwards: list[tuple[str, ...]] = []

    class RecordingEcho(EchoModel):
        def generate(self, requests: Any, generators: Any, **kw: Any) -> Any:
            forwards.append(tuple(r.request_id for r in requests))
            return super().generate(requests, generators, **kw)

    register_models(monkeypatch, {"fake:recording-echo": lambda options: RecordingEcho()})
    results: dict[str, Any] = {}
    with trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, model="fake:recording-echo", max_num_seqs=4) as engine:

            async def run(i: int) -> None:
                rid = f"req-{i}"
                results[rid] = await engine.generate("p", params(seed=i), request_id=rid)

            async with trio.open_nursery() as nursery:
                for i in range(20):
                    nursery.start_soon(run, i)
    # All twenty were admitted before the first wave: five full fused forwards.
    assert [len(ids) for ids in forwards] == [4, 4, 4, 4, 4]
    assert sorted(rid for ids in forwards for rid in ids) == sorted(results)
    for i in range(20):
        assert decode_echo_image(results[f"req-{i}"].images[0]) == (f"req-{i}", i, 0)


async def test_same_seed_gives_identical_pixels(cache_dir: Path) -> None:
    with trio.fail_after(CAP_S):
        async with echo_engine(cache_dir) as engine:
            a = await engine.generate("p", params(seed=77, output_type="np"), request_id="x")
            b = await engine.generate("p", params(seed=77, output_type="np"), request_id="x")
            c = await engine.generate("p", params(seed=78, output_type="np"), request_id="x")
    assert np.array_equal(a.images[0], b.images[0])
    assert not np.array_equal(a.images[0], c.images[0])


async def test_the_seed_chosen_at_admission_reproduces_the_output(cache_dir: Path) -> None:
    with trio.fail_after(CAP_S):
        async with echo_engine(cache_dir) as engine:
            first = await engine.generate("p", params(output_type="np"), request_id="x")
            assert first.seed is not None
            again = await engine.generate(
                "p", params(seed=first.seed, output_type="np"), request_id="x"
            )
    assert decode_echo_image(first.images[0]) == ("x", first.seed, 0)
    assert np.array_equal(first.images[0], again.images[0])


async def test_echo_warmup_then_generate(cache_dir: Path) -> None:
    with trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, warmup=True) as engine:
            engine.check_health()
            out = await engine.generate("p", params(seed=3), request_id="after-warmup")
    assert decode_echo_image(out.images[0]) == ("after-warmup", 3, 0)


async def test_abort_of_a_waiting_echo_request_never_runs_it(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    with trio.fail_after(CAP_S):
        async with gated_engine(monkeypatch, cache_dir) as (engine, gate):
            running = engine.stream("p", params(num_inference_steps=2), request_id="running")
            waiting = engine.stream("p", params(), request_id="waiting")
            await gate.wait_for_step(("running",), 1)
            engine.abort("waiting")
            out = await waiting.__anext__()
            assert out.status is S.FINISHED_ABORTED
            gate.open()
            async with running:
                assert [o.ok async for o in running] == [True]
            # One more request proves the loop moved past where "waiting" would have run.
            assert (await engine.generate("p", params(seed=1), request_id="later")).ok
    assert gate.forwards == [("running",), ("later",)]


async def test_abort_of_a_running_echo_request_stops_within_one_step(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    rid = ("victim",)
    with trio.fail_after(CAP_S):
        async with gated_engine(monkeypatch, cache_dir) as (engine, gate):
            stream = engine.stream("p", params(num_inference_steps=50), request_id="victim")
            for step in range(3):
                await gate.wait_for_step(rid, step + 1)
                assert engine.progress("victim") == (step, 50)
                if step < 2:
                    gate.release()
            # Held after step 2.  Abort: the stream is terminal at once...
            engine.abort("victim")
            out = await stream.__anext__()
            assert out.status is S.FINISHED_ABORTED
            assert gate.ended(rid) is None  # ...while the forward is still in its step.
            gate.release()
            # ...and the forward stops at the very next step boundary.
            assert await gate.wait_for_end(rid) == "ForwardStopped"
            assert gate.steps_of(rid) == 3
            gate.open()
            assert (await engine.generate("p", params(seed=1), request_id="next")).ok
            assert engine.progress("victim") is None


async def test_cancelling_an_echo_consumer_aborts_and_frees_the_slot(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    rid = ("victim",)
    with trio.fail_after(CAP_S):
        async with gated_engine(monkeypatch, cache_dir) as (engine, gate):
            async with trio.open_nursery() as nursery:
                long_request = params(num_inference_steps=50)
                nursery.start_soon(partial(engine.generate, "p", long_request, request_id="victim"))
                await gate.wait_for_step(rid, 1)
                nursery.cancel_scope.cancel()
            stats = engine.statistics()
            assert (stats.finished_aborted, stats.running, stats.open_streams) == (1, 0, 0)
            gate.release()
            assert await gate.wait_for_end(rid) == "ForwardStopped"
            assert gate.steps_of(rid) == 1
            gate.open()
            nxt = await engine.generate("p", params(seed=2), request_id="next")
    assert decode_echo_image(nxt.images[0]) == ("next", 2, 0)


@pytest.mark.parametrize("how", ["break", "aclose"])
async def test_leaving_an_echo_stream_early_aborts(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path, how: str
) -> None:
    rid = ("left",)
    with trio.fail_after(CAP_S):
        async with gated_engine(monkeypatch, cache_dir) as (engine, gate):
            stream = engine.stream("p", params(num_inference_steps=50), request_id="left")
            await gate.wait_for_step(rid, 1)
            if how == "aclose":
                await stream.aclose()
            else:
                async with stream:
                    pass  # leave without reading the terminal output
            assert engine.statistics().finished_aborted == 1
            gate.release()
            assert await gate.wait_for_end(rid) == "ForwardStopped"
            assert gate.steps_of(rid) == 1


async def test_close_with_pending_echo_requests(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    rid = ("running",)
    errors: list[str] = []
    with trio.fail_after(CAP_S):
        async with gated_engine(monkeypatch, cache_dir) as (engine, gate):

            async def run(name: str) -> None:
                with pytest.raises(EngineClosedError):
                    await engine.generate("p", params(num_inference_steps=50), request_id=name)
                errors.append(name)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "running")
                await gate.wait_for_step(rid, 1)
                nursery.start_soon(run, "waiting")
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(engine.aclose)
                await trio.testing.wait_all_tasks_blocked()
                gate.release()
            assert sorted(errors) == ["running", "waiting"]
            assert gate.ended(rid) == "ForwardStopped"
            assert gate.steps_of(rid) == 1
            assert gate.forwards == [rid]
            assert engine.is_closed
    assert WORKER_THREAD not in {t.name for t in threading.enumerate()}


async def test_rpc_during_an_echo_forward_runs_between_batches(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    gate_box: list[StepGate] = []

    class RecordingWorker(Worker):
        def ping(self) -> dict[str, Any]:
            gate_box[0]._record("rpc", (), "ping")
            return super().ping()

    monkeypatch.setattr(inproc, "Worker", RecordingWorker)
    with trio.fail_after(CAP_S):
        async with gated_engine(monkeypatch, cache_dir) as (engine, gate):
            gate_box.append(gate)
            first = engine.stream("p", params(num_inference_steps=3), request_id="first")
            await gate.wait_for_step(("first",), 1)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.collective_rpc, "ping")
                await trio.testing.wait_all_tasks_blocked()
                second = engine.stream("p", params(num_inference_steps=3), request_id="second")
                await trio.testing.wait_all_tasks_blocked()
                gate.open()
            for stream in (first, second):
                async with stream:
                    assert [o.ok async for o in stream] == [True]
    order = [(kind, ids) for kind, ids, _ in gate.events if kind != "step"]
    assert order == [
        ("start", ("first",)),
        ("end", ("first",)),
        ("rpc", ()),
        ("start", ("second",)),
        ("end", ("second",)),
    ]


async def test_a_failing_echo_request_does_not_hurt_the_others(cache_dir: Path) -> None:
    with trio.fail_after(CAP_S):
        async with echo_engine(cache_dir) as engine:
            with pytest.raises(RequestFailedError) as info:
                await engine.generate(
                    "p", params(extra_args={"echo_fail_at_step": 1}), request_id="bad"
                )
            ok = await engine.generate("p", params(seed=4), request_id="good")
            engine.check_health()
    assert info.value.error_type == "EchoInjectedError"
    assert decode_echo_image(ok.images[0]) == ("good", 4, 0)


async def test_a_dead_inproc_worker_kills_the_engine(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    class BrokenWorker(Worker):
        def execute_scheduler_output(self, scheduler_output: SchedulerOutput) -> Any:
            raise OSError("device lost")

    monkeypatch.setattr(inproc, "Worker", BrokenWorker)
    with trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, max_worker_restarts=0) as engine:
            stream = engine.stream("p", params(), request_id="r")
            async with stream:
                outs = [o async for o in stream]
            assert [o.error_type for o in outs] == ["EngineDeadError"]
            assert "device lost" in (outs[0].error or "")
            with pytest.raises(EngineDeadError, match="device lost"):
                engine.check_health()
            with pytest.raises(EngineDeadError):
                await engine.generate("p", params())
    assert WORKER_THREAD not in {t.name for t in threading.enumerate()}


async def test_echo_warmup_failure_closes_the_engine(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    loaded = register_models(
        monkeypatch, {"fake:broken": lambda options: ScriptedModel(fail_with=ValueError("nan"))}
    )
    with trio.fail_after(CAP_S):
        with pytest.raises(RuntimeError, match="warmup failed") as info:
            async with echo_engine(cache_dir, model="fake:broken", warmup=True):
                pytest.fail("the body must not run")  # pragma: no cover
    assert isinstance(info.value.__cause__, RequestFailedError)
    assert info.value.__cause__.error_type == "ValueError"
    (model,) = loaded
    assert isinstance(model, ScriptedModel) and model.closed
    assert model.calls == [(WARMUP_REQUEST_ID,)]


async def test_a_stream_collected_inside_an_engine_step_does_not_reenter_it() -> None:
    """A cyclic-GC pass can finalize a dropped stream at any allocation, even in the middle of
    the engine's own scheduler update; the abort it causes must not run there."""
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            executor.hold = True
            stream = engine.stream("p", params(), request_id="cyclic")
            await executor.wait_for_forward("cyclic")
            cycle: list[Any] = [stream]
            cycle.append(cycle)  # only the cyclic collector can free it
            del stream, cycle
            judge = engine.scheduler._judge

            def judge_with_gc(*args: Any) -> Any:
                gc.collect()  # a collection that happens to run mid-update
                return judge(*args)

            engine.scheduler._judge = judge_with_gc  # type: ignore[method-assign]
            executor.release()
            await executor.wait_until(lambda: executor.in_forward is None)
            await trio.testing.wait_all_tasks_blocked()
            assert not engine.is_dead
            engine.check_health()
            stats = engine.statistics()
            assert stats.finished_completed + stats.finished_aborted == 1
            assert (stats.running, stats.open_streams) == (0, 0)
            executor.hold = False
            assert (await engine.generate("p", params(seed=1), request_id="after")).ok


async def test_close_is_bounded_when_a_forward_hangs(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    token = trio.lowlevel.current_trio_token()
    entered = trio.Event()
    models: list[BlockingModel] = []

    def make(options: Any) -> BlockingModel:
        model = BlockingModel(on_enter=lambda: token.run_sync_soon(entered.set))
        models.append(model)
        return model

    register_models(monkeypatch, {"fake:blocking": make})
    close_timeout = 0.2
    with trio.fail_after(CAP_S):
        async with echo_engine(
            cache_dir, model="fake:blocking", close_timeout_s=close_timeout
        ) as engine:
            stream = engine.stream("p", params(), request_id="hung")
            await entered.wait()
            started = trio.current_time()
            await engine.aclose()
            elapsed = trio.current_time() - started
            assert elapsed < GATE_S / 2  # the hung forward itself only gives up after GATE_S
            out = await stream.__anext__()
            assert out.error_type == "EngineClosedError"
            assert engine.is_closed
            assert engine.executor.is_dead  # the stall is reported, not hidden
            models[0].release.set()  # let the hung thread finish so nothing leaks


async def test_warmup_runs_but_is_not_counted_in_statistics(cache_dir: Path) -> None:
    with trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, warmup=True) as engine:
            before = engine.statistics()
            await engine.generate("counted", params(seed=1))
            after = engine.statistics()
    assert (before.admitted, before.finished_completed) == (0, 0)
    assert (after.admitted, after.finished_completed, after.end_to_end.count) == (1, 1, 1)


async def test_default_size_is_resolved_at_admission_so_such_requests_fuse(
    cache_dir: Path,
) -> None:
    # echo's default size is 64x64: an unset size and an explicit 64x64 share one wave.
    with trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, max_num_seqs=2) as engine:
            unset = engine.stream("a", SamplingParams(num_inference_steps=1, seed=1))
            explicit = engine.stream(
                "b", SamplingParams(height=64, width=64, num_inference_steps=1, seed=2)
            )
            sched_out = engine.scheduler.schedule(trio.current_time())
            assert [r.request_id for r in sched_out.scheduled_new_reqs] == [
                unset.request_id,
                explicit.request_id,
            ]
            engine.abort(unset.request_id, explicit.request_id)


async def test_unconditional_model_rejects_other_sizes_before_admission(
    cache_dir: Path,
) -> None:
    with trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, model="builtin:tiny-ddim") as engine:
            with pytest.raises(InvalidRequestError) as info:
                engine.stream("x", SamplingParams(height=64, width=64))
            assert info.value.param == "size"
            assert engine.statistics().admitted == 0
            out = await engine.generate("x", SamplingParams(num_inference_steps=2, seed=3))
            assert out.images[0].size == (32, 32)


class _UnpackableModel(ScriptedModel):
    """Forwards fine, but its outputs cannot be converted to an image (fails in the packer)."""

    def generate(self, requests: Any, generators: Any, **kw: Any) -> Any:
        super().generate(requests, generators, **kw)
        return [[object()] for _ in requests]


async def test_async_output_delivers_packed_images_with_timings(cache_dir: Path) -> None:
    with trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, async_output=True, max_num_seqs=2) as engine:
            assert engine.config.async_output
            async with trio.open_nursery() as nursery:
                results: dict[str, Any] = {}

                async def run(rid: str, seed: int) -> None:
                    results[rid] = await engine.generate("p", params(seed=seed), request_id=rid)

                nursery.start_soon(run, "a", 1)
                nursery.start_soon(run, "b", 2)
            pump = engine.executor._pump  # type: ignore[attr-defined]
            assert pump is not None
            stats = pump.statistics()
    assert decode_echo_image(results["a"].images[0]) == ("a", 1, 0)
    assert decode_echo_image(results["b"].images[0]) == ("b", 2, 0)
    assert results["a"].metrics.postprocess_ms > 0
    assert (stats.waiting_outputs, stats.cached_outputs, stats.unsplit_batches) == (0, 0, 0)


async def test_a_packing_failure_ends_the_request_with_an_error(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    register_models(monkeypatch, {"fake:unpackable": lambda options: _UnpackableModel()})
    with trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, model="fake:unpackable", async_output=True) as engine:
            with pytest.raises(RequestFailedError) as info:
                await engine.generate("p", params(seed=1), request_id="bad")
            # The engine lives on and counts the failure.
            assert engine.statistics().finished_error == 1
            engine.check_health()
    assert info.value.request_id == "bad"


async def _until(predicate: Any) -> None:
    """Wait for something another thread does (the worker's packer): it is no trio event."""
    while True:
        if predicate():
            return
        await trio.sleep(0.005)


async def test_an_output_announced_for_a_request_aborted_meanwhile_is_released(
    cache_dir: Path,
) -> None:
    """The INV-3 leak of issue #13: a request aborted after its forward finished but before
    the forward's answer was applied (a client leaving as its image completes).  Its packed
    output used to stay cached in the result pump until the worker group ended."""
    from omni_trio.testing import Fault, FaultSpec, with_faults

    # The worker sleeps after its forward, with the output already handed to the packer: the
    # packed output reaches the pump while the forward's answer (its COMPUTE_DONE) is late.
    late_answer = with_faults(
        params(seed=3), FaultSpec(Fault.DELAY_COMPUTE_DONE, delay_s=GATE_S / 10)
    )
    with trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, async_output=True, fault_injection=True) as engine:
            pump = engine.executor._pump  # type: ignore[attr-defined]
            stream = engine.stream("p", late_answer, request_id="leaver")
            # The whole batch's output is in the pump: the forward is done, its answer not.
            await _until(lambda: pump.statistics().cached_outputs == 1)
            assert engine.core.in_flight_ids() == {"leaver"}
            engine.abort("leaver")
            final = await stream.__anext__()
            assert final.status is S.FINISHED_ABORTED
            await engine.wait_idle()
            stats = pump.statistics()
            assert (stats.cached_outputs, stats.waiting_outputs, stats.dropped_outputs) == (0, 0, 0)
            assert stats.discarded >= 1  # released, not just forgotten
            held = engine.leftovers()
            assert not any("leaver" in ids for ids in held.values()), held
            # The engine goes on as before.
            assert (await engine.generate("p", params(seed=4), request_id="next")).ok


@pytest.mark.parametrize("step_execution", [False, True], ids=["request", "step"])
async def test_once_idle_nothing_anywhere_holds_a_finished_request(
    cache_dir: Path, step_execution: bool
) -> None:
    with trio.fail_after(CAP_S):
        async with echo_engine(
            cache_dir, async_output=True, max_num_seqs=2, step_execution=step_execution
        ) as engine:
            kept = engine.stream("p", params(seed=1, num_inference_steps=3), request_id="kept")
            dropped = engine.stream("p", params(seed=2, num_inference_steps=3), request_id="left")
            first = await kept.__anext__() if step_execution else None
            await dropped.aclose()  # its consumer leaves mid-way
            async for out in kept:
                first = out
            assert first is not None and first.ok
            await engine.wait_idle()
            assert engine.is_idle()
            held = engine.leftovers()
            workers = await engine.worker_leftovers()
            assert {k: v for k, v in {**held, **workers}.items() if v} == {}
            assert sorted(workers) == (
                ["abort_marks", "runner_progress", "step_states", "stop_flags"]
                if step_execution
                else ["abort_marks", "packer_queue", "runner_progress", "stop_flags"]
            )
            assert engine.statistics().packing == 0


@pytest.mark.parametrize("how", ["closed", "collected"])
async def test_a_stale_stream_of_a_reused_id_never_touches_its_next_incarnation(how: str) -> None:
    """The old stream of an id, closed or garbage-collected after the id was admitted again,
    must not abort the new request: its callbacks carry its own channel."""
    with trio.fail_after(CAP_S):
        async with scripted_engine() as (engine, executor):
            old = engine.stream("a", params(seed=1), request_id="X")
            await engine.wait_idle()  # X completed; its terminal output sits unread in `old`
            executor.hold = True
            new = engine.stream("b", params(seed=2), request_id="X")
            await executor.wait_for_forward("X")
            if how == "closed":
                await old.aclose()  # the old consumer leaves now
            else:
                del old
                gc.collect()  # its finalizer defers a consumer-gone for its own channel
            await trio.testing.wait_all_tasks_blocked()
            assert engine.core.status_of("X") is S.RUNNING
            executor.release()
            outputs = [o async for o in new]
    assert [(o.status, o.seed) for o in outputs] == [(S.FINISHED_COMPLETED, 2)]


async def wait_for(predicate: Callable[[], bool]) -> None:
    """Poll a condition of the engine (a statistics snapshot has no event to wait on)."""
    while not predicate():  # noqa: ASYNC110
        await trio.sleep(0.005)


@pytest.mark.parametrize("step_execution", [False, True])
async def test_a_deadline_stops_a_running_and_a_queued_request_with_a_timeout_error(
    cache_dir: Path, step_execution: bool
) -> None:
    """``deadline_s`` on the real inproc echo (1000 steps of 50 ms, far past the test's cap
    if it ran on): the running request stops at its next step and the one queued behind it
    ends at its own deadline, both with RequestTimeoutError (an abort, not a failure);
    the engine then serves the next request."""
    with trio.fail_after(CAP_S):
        async with echo_engine(
            cache_dir,
            model_options={"step_delay_s": 0.05},
            step_execution=step_execution,
            max_num_seqs=1,
        ) as engine:
            errors: dict[str, Exception] = {}

            async def run(rid: str, deadline: float) -> None:
                long = params(num_inference_steps=1000, deadline_s=deadline)
                try:
                    await engine.generate("p", long, request_id=rid)
                except RequestAbortedError as exc:
                    errors[rid] = exc

            async with trio.open_nursery() as nursery:
                nursery.start_soon(run, "running", 0.5)
                await wait_for(lambda: engine.statistics().running == 1)
                nursery.start_soon(run, "queued", 0.2)
            assert sorted(errors) == ["queued", "running"]
            for error in errors.values():
                assert isinstance(error, RequestTimeoutError), error
                assert "deadline" in str(error) and isinstance(error, TimeoutError)
            assert (await engine.generate("p", params(), request_id="next")).ok
            stats = engine.statistics()
            assert (stats.finished_aborted, stats.finished_completed) == (2, 1)


# -- starting from a picture ------------------------------------------------------------------


def _noise_picture(width: int, height: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


async def test_pictures_render_alike_in_both_modes_at_their_own_size(cache_dir: Path) -> None:
    """builtin:shapes from a 40x48 picture: the size is the picture's, request and step mode
    give the same image bit for bit (alone), an abort stops it, the same seed gives the same
    image again, and a model that cannot start from a picture refuses it before admission."""
    picture = _noise_picture(40, 48)
    sampling = SamplingParams(
        image=picture, strength=1.0, num_inference_steps=6, seed=4, output_type="np"
    )
    images = []
    with trio.fail_after(CAP_S * 2):
        for step in (False, True):
            async with open_engine(
                model="builtin:shapes",
                cache_dir=str(cache_dir),
                torch_threads=1,
                warmup=False,
                step_execution=step,
            ) as engine:
                out = await engine.generate("a green triangle", sampling)
                assert out.images[0].shape == (48, 40, 3)
                images.append(out.images[0])
                if step:
                    again = await engine.generate("a green triangle", sampling)
                    np.testing.assert_array_equal(again.images[0], out.images[0])
                    slow = sampling.replace(num_inference_steps=400)
                    stream = engine.stream("a green triangle", slow, request_id="slow")
                    while (engine.progress("slow") or (0, 0))[0] < 2:  # noqa: ASYNC110
                        await trio.sleep(0.005)
                    engine.abort("slow")
                    async with stream:
                        outs = [o async for o in stream]
                    assert outs[-1].status is RequestStatus.FINISHED_ABORTED
                    # Its step state goes at the next tick (an idle one here).
                    while any(ids for ids in (await engine.worker_leftovers()).values()):  # noqa: ASYNC110
                        await trio.sleep(0.01)
        async with open_engine(
            model="builtin:tiny-ddim", cache_dir=str(cache_dir), torch_threads=1, warmup=False
        ) as engine:
            with pytest.raises(InvalidRequestError, match="does not take an image") as info:
                engine.stream("p", SamplingParams(image=_noise_picture(32, 32)))
            assert info.value.param == "image"
    np.testing.assert_array_equal(images[0], images[1])


# -- promptness, as the worker measures it -----------------------------------------------------


@pytest.mark.parametrize("stop_flags_work", [True, False], ids=["runtime", "planted-bug"])
async def test_an_aborted_forward_stops_within_a_step_of_the_abort_reaching_its_worker(
    monkeypatch: pytest.MonkeyPatch, stop_flags_work: bool
) -> None:
    """The worker notes how far a forward was when each abort reached it and reports the
    steps it started after the last of its requests was aborted; the checker allows one
    (INV-7).  With a planted bug (the abort sets no stop flag, so the forward runs to its
    end) the trace says so, though every request still ends FINISHED_ABORTED at once."""
    from omni_trio._core.trace import TraceKind, TraceRecorder
    from omni_trio.testing.invariants import check_trace
    from omni_trio.worker.stop_flags import StopFlags

    if not stop_flags_work:
        monkeypatch.setattr(StopFlags, "abort", lambda self, request_ids: None)
    trace = TraceRecorder()
    with trio.fail_after(CAP_S):
        async with open_engine(
            model="builtin:echo",
            warmup=False,
            model_options={"step_delay_s": 0.01},
            trace=trace,
        ) as engine:
            sampling = SamplingParams(num_inference_steps=30, seed=1, height=32, width=32)
            stream = engine.stream("p", sampling, request_id="a")
            while (engine.progress("a") or (0, 0))[0] < 2:  # noqa: ASYNC110
                await trio.sleep(0.005)
            engine.abort("a")
            async with stream:
                outs = [out async for out in stream]
            assert outs[-1].status is RequestStatus.FINISHED_ABORTED
            await engine.wait_idle()
    [result] = [e for e in trace.events if e.kind is TraceKind.EXEC_RESULT]
    after = result.detail["steps_after_abort"]
    prompt = [v for v in check_trace(trace.events) if v.invariant == "INV-7"]
    if stop_flags_work:
        assert after <= 1 and prompt == []
    else:
        assert after >= 20 and prompt, result.detail  # ran on to its end
        assert "more denoising steps after the abort" in prompt[0].message
