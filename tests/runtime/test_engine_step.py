"""The step-mode paths of the engine (``runtime/engine.py``): continuous batching, streaming.

Engines here are real ``inproc`` engines with ``step_execution=True`` on ``builtin:echo``
(its outputs name request id and seed), on a gated echo whose every tick the test holds with a
:class:`StepGate`, or on ``builtin:tiny-sd`` for the equivalence checks.  A :class:`TickSpy`
records every :class:`SchedulerOutput` the engine executes and can run a hook on the engine's
own trio thread right before a ``schedule()``, i.e. exactly between two ticks.

Equivalence tolerances (tiny-sd, CPU, float32, ``output_type="np"``): a request stepped alone
equals request mode bit for bit; in a continuous batch with others at different steps it stays
within 1e-4 of itself alone (measured <= 2e-6, see tests/models/test_pipeline_step.py); the
same seeds with the same batch history are bit-identical.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from omni_trio import (
    AsyncEngine,
    DiffusionOutput,
    EngineConfig,
    InvalidConfigError,
    RequestStatus,
    SamplingParams,
    open_engine,
)
from omni_trio._core.messages import BatchRunnerOutput, SchedulerOutput
from omni_trio._core.trace import TraceKind, TraceRecorder
from omni_trio.models import StepState, load_model
from omni_trio.models.echo import EchoModel, EchoStepAdapter, decode_echo_image
from omni_trio.runtime.request_stream import RequestStream
from omni_trio.worker.step_runner import StepRunner
from tests.fakes import ScriptedModel, StepGate, register_models

S = RequestStatus
CAP_S = 30.0
WORKER_THREAD = "omni-trio-worker-0"
SD_NP_ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_sd(cache_dir: Path) -> str:
    """``builtin:tiny-sd``, built in the session cache and loaded once before the tests that
    use it, so neither the build nor diffusers' first import (which may start tqdm's monitor
    thread) happens inside a test's time cap and leak check."""
    import torch

    model = load_model(
        "builtin:tiny-sd",
        device=torch.device("cpu"),
        dtype=torch.float32,
        cache_dir=cache_dir,
        options={},
    )
    model.close()
    return "builtin:tiny-sd"


def params(steps: int = 3, **kw: Any) -> SamplingParams:
    kw.setdefault("height", 32)
    kw.setdefault("width", 32)
    kw.setdefault("seed", 1)
    return SamplingParams(num_inference_steps=steps, **kw)


class _Changes:
    def __init__(self) -> None:
        self._event = trio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._event.wait()


class TickSpy:
    """Records the engine's step-mode ticks; runs hooks between ticks.

    ``outputs[i]`` is the i-th SchedulerOutput executed, ``results[i]`` its runner output
    (once it returned).  ``before_schedule(n, fn)`` runs ``fn()`` on the engine's thread right
    before its n-th ``schedule()`` from now: after the previous tick's results were applied
    and emitted, before the next tick is decided.
    """

    def __init__(self, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.outputs: list[SchedulerOutput] = []
        self.results: list[BatchRunnerOutput] = []
        self.schedules = 0
        self._hooks: dict[int, Callable[[], None]] = {}
        self._changes = _Changes()
        real_execute = engine.executor.execute_step
        real_schedule = engine.scheduler.schedule

        async def execute_step(scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
            self.outputs.append(scheduler_output)
            try:
                result = await real_execute(scheduler_output)
                self.results.append(result)
                return result
            finally:
                self._changes.notify()

        def schedule(now: float) -> SchedulerOutput:
            self.schedules += 1
            hook = self._hooks.pop(self.schedules, None)
            if hook is not None:
                hook()
            return real_schedule(now)

        monkeypatch.setattr(engine.executor, "execute_step", execute_step)
        monkeypatch.setattr(engine.scheduler, "schedule", schedule)

    def before_schedule(self, n: int, hook: Callable[[], None]) -> None:
        self._hooks[self.schedules + n] = hook

    @property
    def ticks(self) -> list[tuple[str, ...]]:
        """The request ids of every executed tick (eviction-only ticks included, as ())."""
        return [out.scheduled_request_ids for out in self.outputs]

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        await self._changes.wait_until(predicate)

    def evicted(self, rid: str, since: int = 0) -> bool:
        """A tick (from ``outputs[since]`` on) that reported ``rid`` finished has returned, so
        the worker dropped its state."""
        done = self.outputs[since : len(self.results)]
        return any(rid in out.finished_req_ids for out in done)

    async def wait_for_eviction(self, *rids: str, since: int = 0) -> None:
        await self.wait_until(lambda: all(self.evicted(rid, since) for rid in rids))


def step_runner(engine: AsyncEngine) -> StepRunner:
    """The inproc worker's StepRunner (private objects: read only between or during ticks)."""
    worker = engine.executor._worker  # type: ignore[attr-defined]
    runner = worker.runner._step_runner
    assert isinstance(runner, StepRunner)
    return runner


def step_states(engine: AsyncEngine) -> dict[str, StepState]:
    return dict(step_runner(engine).states)


class _GatedStepAdapter(EchoStepAdapter):
    """Echo's adapter whose fused denoise call (one per tick) the gate holds."""

    def __init__(self, model: GatedStepEcho) -> None:
        super().__init__(model)
        self.gate = model.gate

    def denoise_step(self, states: Sequence[StepState]) -> list[Any]:
        ids = tuple(state.request_id for state in states)
        self.gate.forward_started(ids)
        try:
            result = super().denoise_step(states)
        except BaseException as exc:
            self.gate.forward_ended(ids, type(exc).__name__)
            raise
        self.gate.forward_ended(ids, "returned")
        return result


class GatedStepEcho(EchoModel):
    """``builtin:echo`` whose every step-mode tick blocks in the gate (one gate step a tick).

    ``gate.forwards`` lists every tick's ids in batch order; ``gate.wait_for_step(ids, n)``
    waits until the n-th tick over exactly ``ids`` is held.
    """

    def __init__(self, gate: StepGate) -> None:
        super().__init__(step_delay_s=1.0, sleep=gate.step, name="fake:gated-step-echo")
        self.gate = gate
        self._step_adapter = _GatedStepAdapter(self)


@asynccontextmanager
async def step_engine(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path, **overrides: Any
) -> AsyncIterator[tuple[AsyncEngine, TickSpy]]:
    overrides.setdefault("model", "builtin:echo")
    overrides.setdefault("step_execution", True)
    overrides.setdefault("torch_threads", 1)
    overrides.setdefault("warmup", False)
    async with open_engine(EngineConfig(cache_dir=str(cache_dir), **overrides)) as engine:
        yield engine, TickSpy(engine, monkeypatch)


@asynccontextmanager
async def gated_step_engine(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path, **overrides: Any
) -> AsyncIterator[tuple[AsyncEngine, TickSpy, StepGate]]:
    gate = StepGate()
    register_models(monkeypatch, {"fake:gated-step-echo": lambda options: GatedStepEcho(gate)})
    async with step_engine(monkeypatch, cache_dir, model="fake:gated-step-echo", **overrides) as (
        engine,
        spy,
    ):
        try:
            yield engine, spy, gate
        finally:
            gate.open()  # a held tick must not stall the close


async def collect(stream: RequestStream) -> list[DiffusionOutput]:
    async with stream:
        return [out async for out in stream]


def echo_of(out: DiffusionOutput) -> tuple[str, int, int]:
    return decode_echo_image(out.images[0])


# ---------------------------------------------------------------------------------------
# Lifecycle and continuous batching on echo.
# ---------------------------------------------------------------------------------------


async def test_a_three_step_request_runs_three_ticks_then_its_state_is_evicted(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    with trio.fail_after(CAP_S):
        async with step_engine(monkeypatch, cache_dir) as (engine, spy):
            out = await engine.generate("p", params(3, seed=5), request_id="r")
            await spy.wait_for_eviction("r")
            assert out.ok and out.finished and out.status is S.FINISHED_COMPLETED
            assert echo_of(out) == ("r", 5, 0)
            assert (out.chunk_index, out.total_chunks) == (0, 1)
            assert out.metrics.execution_ms > 0
            # New once, then cached, then an idle tick that only reports it finished.
            assert [r.request_id for r in spy.outputs[0].scheduled_new_reqs] == ["r"]
            assert [o.scheduled_cached_reqs for o in spy.outputs] == [(), ("r",), ("r",), ()]
            assert [o.finished_req_ids for o in spy.outputs] == [frozenset()] * 3 + [{"r"}]
            assert [r.get("r").step_index for r in spy.results[:3]] == [1, 2, 3]  # type: ignore[union-attr]
            assert step_states(engine) == {}
            assert engine.progress("r") is None
            stats = engine.statistics()
            assert (stats.running, stats.waiting, stats.finished_completed) == (0, 0, 1)
            assert stats.open_streams == 0


async def test_requests_with_different_step_counts_share_ticks(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    steps = {"a": 3, "b": 10, "c": 5}
    with trio.fail_after(CAP_S):
        async with step_engine(monkeypatch, cache_dir, max_num_seqs=3) as (engine, spy):
            # Admitted together (no checkpoint between): they share the first tick.
            streams = {
                rid: engine.stream("p", params(n, seed=i), request_id=rid)
                for i, (rid, n) in enumerate(steps.items())
            }
            outs = {rid: await collect(stream) for rid, stream in streams.items()}
            await spy.wait_for_eviction("a", "b", "c")
    assert spy.ticks == [("a", "b", "c")] * 3 + [("b", "c")] * 2 + [("b",)] * 5 + [()]
    for i, (rid, chunks) in enumerate(outs.items()):
        assert [o.status for o in chunks] == [S.FINISHED_COMPLETED]
        assert echo_of(chunks[0]) == (rid, i, 0)


async def test_a_request_added_mid_flight_joins_at_the_next_step_boundary(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    with trio.fail_after(CAP_S):
        async with gated_step_engine(monkeypatch, cache_dir, max_num_seqs=4) as (
            engine,
            spy,
            gate,
        ):
            first = engine.stream("p", params(6, seed=1), request_id="first")
            await gate.wait_for_step(("first",), 1)
            gate.release()
            await gate.wait_for_step(("first",), 2)  # the second tick is held
            joiner = engine.stream("p", params(3, seed=2), request_id="joiner")
            assert engine.progress("first") == (1, 6)
            gate.release()
            # The very next tick has the joiner (new rows first) at its own step 0.
            await gate.wait_for_step(("joiner", "first"), 1)
            assert gate.forwards == [("first",), ("first",), ("joiner", "first")]
            assert engine.progress("first") == (2, 6)
            assert engine.progress("joiner") is None
            third = spy.outputs[2]
            assert [r.request_id for r in third.scheduled_new_reqs] == ["joiner"]
            assert third.scheduled_cached_reqs == ("first",)
            gate.open()
            first_out, joiner_out = await collect(first), await collect(joiner)
    assert echo_of(first_out[-1]) == ("first", 1, 0)
    assert echo_of(joiner_out[-1]) == ("joiner", 2, 0)
    # The joiner ran its 3 steps beside "first", which finished alone.
    assert gate.forwards == [("first",)] * 2 + [("joiner", "first")] + [("first", "joiner")] * 2 + [
        ("first",)
    ]


# ---------------------------------------------------------------------------------------
# Aborts.
# ---------------------------------------------------------------------------------------


async def test_abort_of_a_waiting_step_request_never_reaches_the_worker(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    with trio.fail_after(CAP_S):
        async with gated_step_engine(monkeypatch, cache_dir) as (engine, spy, gate):
            running = engine.stream("p", params(2), request_id="running")
            waiting = engine.stream("p", params(2), request_id="waiting")
            await gate.wait_for_step(("running",), 1)
            engine.abort("waiting")
            out = await waiting.__anext__()
            assert (out.status, out.error_type) == (S.FINISHED_ABORTED, "RequestAbortedError")
            gate.open()
            assert [o.ok for o in await collect(running)] == [True]
            await spy.wait_for_eviction("running", "waiting")
            assert all("waiting" not in ids for ids in spy.ticks)
            assert spy.outputs[1].finished_req_ids == {"waiting"}
            assert step_states(engine) == {}


async def test_abort_of_a_running_step_request_is_evicted_by_an_idle_tick(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    with trio.fail_after(CAP_S):
        async with gated_step_engine(monkeypatch, cache_dir) as (engine, spy, gate):
            stream = engine.stream("p", params(10), request_id="victim")
            await gate.wait_for_step(("victim",), 1)
            gate.release()
            await gate.wait_for_step(("victim",), 2)
            held = step_states(engine)["victim"]
            engine.abort("victim")
            # Terminal at once, while the tick is still held in the worker.
            out = await stream.__anext__()
            assert out.status is S.FINISHED_ABORTED and out.finished
            assert [kind for kind, _, _ in gate.events].count("end") == 1  # tick 2 is held
            gate.release()
            # The engine is idle now; an eviction tick tells the worker.
            await spy.wait_for_eviction("victim")
            assert spy.ticks == [("victim",), ("victim",), ()]
            assert step_states(engine) == {}
            assert held.extra == {}  # released by the adapter
            assert engine.progress("victim") is None
            assert gate.steps_of(("victim",)) == 2  # no step after the abort's tick
            assert engine.statistics().finished_aborted == 1


async def test_abort_mid_batch_lets_the_others_finish(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    ids = ("a", "b", "c")
    with trio.fail_after(CAP_S):
        async with gated_step_engine(monkeypatch, cache_dir, max_num_seqs=3) as (
            engine,
            spy,
            gate,
        ):
            streams = {
                rid: engine.stream("p", params(5, seed=i), request_id=rid)
                for i, rid in enumerate(ids)
            }
            await gate.wait_for_step(ids, 1)
            gate.release()
            await gate.wait_for_step(ids, 2)
            b_state = step_states(engine)["b"]
            engine.abort("b")
            out = await streams["b"].__anext__()
            assert out.status is S.FINISHED_ABORTED
            gate.release()
            # The next tick leaves "b" out, and its state was evicted before it ran.
            await gate.wait_for_step(("a", "c"), 1)
            assert sorted(step_states(engine)) == ["a", "c"]
            assert b_state.extra == {}
            assert spy.outputs[2].finished_req_ids == {"b"}
            assert engine.progress("a") == (2, 5) and engine.progress("b") is None
            gate.open()
            a_out, c_out = await collect(streams["a"]), await collect(streams["c"])
    assert echo_of(a_out[-1]) == ("a", 0, 0) and a_out[-1].ok
    assert echo_of(c_out[-1]) == ("c", 2, 0) and c_out[-1].ok
    assert gate.forwards == [ids, ids] + [("a", "c")] * 3


async def test_an_id_reused_while_its_old_tick_runs_gets_only_its_own_chunks(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    with trio.fail_after(CAP_S):
        async with gated_step_engine(monkeypatch, cache_dir, streaming_output=True) as (
            engine,
            spy,
            gate,
        ):
            old = engine.stream("p", params(5, seed=1), request_id="x")
            await gate.wait_for_step(("x",), 1)  # the old request's tick is held
            engine.abort("x")
            assert [o.status async for o in old] == [S.FINISHED_ABORTED]
            new = engine.stream("p", params(2, seed=2), request_id="x")
            gate.open()  # the old tick returns a preview for the old "x"
            chunks = await collect(new)
            await spy.wait_for_eviction("x")
    assert [(c.chunk_index, c.total_chunks, c.finished) for c in chunks] == [
        (0, 2, False),
        (1, 2, True),
    ]
    assert all(c.status in (S.RUNNING, S.FINISHED_COMPLETED) for c in chunks)
    assert [echo_of(c) for c in chunks] == [("x", 2, 0)] * 2
    assert spy.outputs[1].finished_req_ids == {"x"}
    assert [r.request_id for r in spy.outputs[1].scheduled_new_reqs] == ["x"]


# ---------------------------------------------------------------------------------------
# Preemption.
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_preempted_request_resumes_from_its_progress_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path, tiny_sd: str
) -> None:
    seen: dict[str, Any] = {}
    with trio.fail_after(CAP_S):
        async with step_engine(
            monkeypatch, cache_dir, model=tiny_sd, device="cpu", max_num_seqs=2
        ) as (engine, spy):
            reference = await engine.generate("a fox", params(5, output_type="np"), request_id="x")
            await spy.wait_for_eviction("x")
            base = len(spy.outputs)

            def preempt() -> None:  # between tick 2 and tick 3 of "x"
                state = engine.scheduler.get_request_state("x")
                assert state is not None
                seen["progress"] = state.num_computed_steps
                seen["request_state"] = state
                seen["state"] = step_states(engine)["x"]
                assert engine.scheduler.preempt_request("x") is True
                assert state.status is S.PREEMPTED

            spy.before_schedule(3, preempt)
            out = await engine.generate("a fox", params(5, output_type="np"), request_id="x")
            await spy.wait_for_eviction("x", since=base)
            state_ids = spy.outputs[base:]
    assert seen["progress"] == 2
    assert seen["request_state"].num_preemptions == 1
    assert seen["request_state"].status is S.FINISHED_COMPLETED
    # It came back as a cached id (the worker kept its state and progress), not as new.
    assert [[r.request_id for r in o.scheduled_new_reqs] for o in state_ids] == [["x"]] + [[]] * 5
    assert [o.scheduled_cached_reqs for o in state_ids] == [()] + [("x",)] * 4 + [()]
    assert [r.get("x").step_index for r in spy.results[base : base + 5]] == [1, 2, 3, 4, 5]  # type: ignore[union-attr]
    assert seen["state"].step_index == 5  # the same StepState object ran to the end
    np.testing.assert_array_equal(out.images[0], reference.images[0])


# ---------------------------------------------------------------------------------------
# Streaming previews.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "interval", "chunks"),
    [(5, 2, 3), (3, 1, 3), (4, 2, 2), (3, 3, 1), (2, 5, 1)],
)
async def test_streamed_chunks_are_ordered_counted_and_flagged(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path, steps: int, interval: int, chunks: int
) -> None:
    with trio.fail_after(CAP_S):
        async with step_engine(
            monkeypatch,
            cache_dir,
            streaming_output=True,
            preview_interval=interval,
            max_num_seqs=2,
        ) as (engine, _):
            main = engine.stream("p", params(steps, seed=3), request_id="main")
            other = engine.stream("p", params(7, seed=4), request_id="other")  # same batch
            outs = await collect(main)
            other_outs = await collect(other)
    assert chunks == (steps - 1) // interval + 1
    assert [o.chunk_index for o in outs] == list(range(chunks))
    assert {o.total_chunks for o in outs} == {chunks}
    assert [o.finished for o in outs] == [False] * (chunks - 1) + [True]
    assert [o.status for o in outs] == [S.RUNNING] * (chunks - 1) + [S.FINISHED_COMPLETED]
    # Every chunk, previews included, is this request's own (PIL, decodable) image.
    assert all(echo_of(o) == ("main", 3, 0) for o in outs)
    assert all(o.seed == 3 for o in outs)
    assert all(echo_of(o) == ("other", 4, 0) for o in other_outs)
    assert other_outs[-1].total_chunks == len(other_outs) == (7 - 1) // interval + 1


@pytest.mark.slow
async def test_chunk_counts_follow_the_steps_the_model_really_runs(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path, tiny_sd: str
) -> None:
    """Euler given 4 explicit sigmas runs 3 steps, though ``total_steps`` says 4."""
    sampling = params(seed=1, output_type="np", sigmas=(14.0, 5.0, 1.0, 0.0))
    assert sampling.total_steps == 4
    with trio.fail_after(CAP_S):
        async with step_engine(
            monkeypatch, cache_dir, model=tiny_sd, device="cpu", streaming_output=True
        ) as (engine, _):
            outs = await collect(engine.stream("a fox", sampling, request_id="s"))
    assert [(o.chunk_index, o.total_chunks, o.finished) for o in outs] == [
        (0, 3, False),
        (1, 3, False),
        (2, 3, True),
    ]
    assert all(o.images[0].shape == (32, 32, 3) for o in outs)
    assert outs[-1].ok


async def test_a_failure_mid_stream_ends_it_after_the_chunks_already_sent(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    with trio.fail_after(CAP_S):
        async with step_engine(monkeypatch, cache_dir, streaming_output=True, max_num_seqs=2) as (
            engine,
            _,
        ):
            bad = engine.stream(
                "p", params(6, extra_args={"echo_fail_at_step": 3}), request_id="bad"
            )
            good = engine.stream("p", params(6, seed=2), request_id="good")
            bad_outs, good_outs = await collect(bad), await collect(good)
    assert [(o.chunk_index, o.finished, o.status) for o in bad_outs] == [
        (0, False, S.RUNNING),
        (1, False, S.RUNNING),
        (2, False, S.RUNNING),
        (3, True, S.FINISHED_ERROR),
    ]
    assert [o.total_chunks for o in bad_outs] == [6, 6, 6, 4]  # previews announce, end tells
    last = bad_outs[-1]
    assert last.error_type == "EchoInjectedError" and "step 3" in (last.error or "")
    assert last.images == ()
    assert [o.chunk_index for o in good_outs] == list(range(6))
    assert good_outs[-1].ok and echo_of(good_outs[-1]) == ("good", 2, 0)


async def test_dropping_a_stream_mid_way_aborts_it_and_evicts_its_state(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    with trio.fail_after(CAP_S):
        async with gated_step_engine(monkeypatch, cache_dir, streaming_output=True) as (
            engine,
            spy,
            gate,
        ):
            stream = engine.stream("p", params(10), request_id="left")
            await gate.wait_for_step(("left",), 1)
            gate.release()
            async with stream:
                first = await stream.__anext__()
                assert (first.chunk_index, first.total_chunks, first.finished) == (0, 10, False)
            # Leaving the stream aborted the request at once.
            stats = engine.statistics()
            assert (stats.finished_aborted, stats.running, stats.open_streams) == (1, 0, 0)
            gate.open()
            await spy.wait_for_eviction("left")
            assert step_states(engine) == {}
            assert engine.progress("left") is None
            assert gate.steps_of(("left",)) <= 2  # at most the tick already scheduled
            # The engine goes on serving.
            nxt = await engine.generate("p", params(2, seed=9), request_id="next")
    assert echo_of(nxt) == ("next", 9, 0)


async def test_close_with_step_requests_in_flight(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    ends: dict[str, DiffusionOutput] = {}
    with trio.fail_after(CAP_S):
        async with gated_step_engine(monkeypatch, cache_dir, max_num_seqs=2) as (
            engine,
            _,
            gate,
        ):

            async def run(stream: RequestStream) -> None:
                outs = await collect(stream)
                ends[stream.request_id] = outs[-1]

            async with trio.open_nursery() as nursery:
                # Admitted together (no checkpoint between): "a" and "b" share every tick.
                nursery.start_soon(run, engine.stream("p", params(50), request_id="a"))
                nursery.start_soon(run, engine.stream("p", params(50), request_id="b"))
                await gate.wait_for_step(("a", "b"), 1)
                nursery.start_soon(run, engine.stream("p", params(50), request_id="waiting"))
                await trio.testing.wait_all_tasks_blocked()
                runner = step_runner(engine)
                held = list(runner.states.values())
                nursery.start_soon(engine.aclose)
                await trio.testing.wait_all_tasks_blocked()
                gate.release()
            assert sorted(ends) == ["a", "b", "waiting"]
            for out in ends.values():
                assert (out.status, out.error_type) == (S.FINISHED_ABORTED, "EngineClosedError")
            assert engine.is_closed
            assert runner.states == {} and len(held) == 2
            assert all(state.extra == {} for state in held)
            assert gate.forwards == [("a", "b")]  # no tick after the close
    assert WORKER_THREAD not in {t.name for t in threading.enumerate()}


@pytest.mark.parametrize("flag", ["step_execution", "streaming_output"])
async def test_a_model_without_a_step_adapter_fails_at_open(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path, flag: str
) -> None:
    loaded = register_models(
        monkeypatch, {"fake:no-steps": lambda options: ScriptedModel(name="fake:no-steps")}
    )
    with trio.fail_after(CAP_S):
        with pytest.raises(InvalidConfigError, match="'fake:no-steps' has no step adapter") as info:
            async with open_engine(
                model="fake:no-steps", cache_dir=str(cache_dir), warmup=False, **{flag: True}
            ):
                raise AssertionError("the engine opened")  # pragma: no cover
    assert info.value.field == "step_execution"
    assert [m.closed for m in loaded] == [True]  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------
# Equivalence with request mode on builtin:tiny-sd (CPU, float32, "np").
# ---------------------------------------------------------------------------------------


def sd(steps: int, seed: int) -> SamplingParams:
    return params(steps, seed=seed, output_type="np")


PROMPTS = {"x": "a red fox", "y": "a blue car", "z": "a green hill"}


async def request_mode_images(
    cache_dir: Path, tiny_sd: str, jobs: dict[str, SamplingParams]
) -> dict[str, Any]:
    """Each job alone in request mode (the reference)."""
    images = {}
    async with open_engine(
        model=tiny_sd,
        device="cpu",
        cache_dir=str(cache_dir),
        torch_threads=1,
        warmup=False,
    ) as engine:
        for rid, sampling in jobs.items():
            images[rid] = (await engine.generate(PROMPTS[rid], sampling, request_id=rid)).images[0]
    return images


async def continuous_scenario(
    engine: AsyncEngine, spy: TickSpy, jobs: dict[str, SamplingParams]
) -> dict[str, Any]:
    """y and z start together; x joins right before the 3rd tick (y at step 2 of 3, z at 2 of
    8).  Returns every image; the batch history is the same on every run."""
    streams: dict[str, RequestStream] = {}
    images: dict[str, Any] = {}
    base = len(spy.outputs)
    async with trio.open_nursery() as nursery:

        async def consume(rid: str) -> None:
            outs = await collect(streams[rid])
            assert outs[-1].ok, outs[-1].error
            images[rid] = outs[-1].images[0]

        def admit(rid: str) -> None:
            streams[rid] = engine.stream(PROMPTS[rid], jobs[rid], request_id=rid)
            nursery.start_soon(consume, rid)

        admit("y")
        admit("z")
        spy.before_schedule(3, lambda: admit("x"))
    await spy.wait_for_eviction(*jobs, since=base)
    ticks = spy.ticks[base:]
    assert ticks[:2] == [("y", "z")] * 2
    assert ticks[2] == ("x", "y", "z")  # x joined mid-flight, at its own step 0
    assert ticks[3:] == [("z", "x")] * 5 + [()]  # y left after 3 steps; x and z end together
    return images


@pytest.mark.slow
async def test_step_mode_alone_is_bit_identical_to_request_mode(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path, tiny_sd: str
) -> None:
    with trio.fail_after(CAP_S):
        reference = await request_mode_images(cache_dir, tiny_sd, {"x": sd(6, 0)})
        async with step_engine(monkeypatch, cache_dir, model=tiny_sd, device="cpu") as (
            engine,
            _,
        ):
            out = await engine.generate(PROMPTS["x"], sd(6, 0), request_id="x")
    np.testing.assert_array_equal(out.images[0], reference["x"])


@pytest.mark.slow
async def test_continuous_batching_matches_request_mode_and_repeats_bit_for_bit(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path, tiny_sd: str
) -> None:
    jobs = {"x": sd(6, 0), "y": sd(3, 1), "z": sd(8, 2)}
    with trio.fail_after(CAP_S):
        reference = await request_mode_images(cache_dir, tiny_sd, jobs)
        async with step_engine(
            monkeypatch, cache_dir, model=tiny_sd, device="cpu", max_num_seqs=3
        ) as (engine, spy):
            first = await continuous_scenario(engine, spy, jobs)
            second = await continuous_scenario(engine, spy, jobs)
    for rid in jobs:
        # Within 1e-4 of each request alone in request mode (measured <= 2e-6)...
        np.testing.assert_allclose(first[rid], reference[rid], atol=SD_NP_ATOL, rtol=0)
        # ...and the same seeds with the same batch history are bit-identical.
        np.testing.assert_array_equal(first[rid], second[rid])
    # Batching really changed the numerics somewhere (or this test proves nothing new).
    assert any(not np.array_equal(first[rid], reference[rid]) for rid in jobs)


# ---------------------------------------------------------------------------------------
# Priority: step-boundary preemption.
# ---------------------------------------------------------------------------------------


async def test_a_better_priority_preempts_at_the_next_step_and_the_worse_one_resumes(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    """``scheduling_policy="priority"``, one slot: a request of better priority arriving
    while a worse one runs takes the slot at the next step boundary; the worse one keeps its
    progress (its step state stays on the worker) and resumes where it stopped, ending with
    its own image after the better one finished."""
    with trio.fail_after(CAP_S):
        async with gated_step_engine(
            monkeypatch, cache_dir, max_num_seqs=1, scheduling_policy="priority"
        ) as (engine, spy, gate):
            low = engine.stream("p", params(5, seed=1, priority=5), request_id="low")
            await gate.wait_for_step(("low",), 1)
            gate.release()
            await gate.wait_for_step(("low",), 2)  # the second tick is held
            high = engine.stream("p", params(2, seed=2, priority=-5), request_id="high")
            gate.release()
            await gate.wait_for_step(("high",), 1)
            assert engine.status("low") is S.PREEMPTED
            assert engine.progress("low") == (2, 5)  # kept while it waits
            gate.open()
            high_out, low_out = await collect(high), await collect(low)
    assert echo_of(high_out[-1]) == ("high", 2, 0)
    assert echo_of(low_out[-1]) == ("low", 1, 0)
    assert gate.forwards == [("low",)] * 2 + [("high",)] * 2 + [("low",)] * 3
    # It resumed as a cached id (its state was kept), never sent again.
    sent = [r.request_id for out in spy.outputs for r in out.scheduled_new_reqs]
    assert sent == ["low", "high"]


async def test_past_the_preempted_state_budget_a_preempted_request_restarts_from_step_0(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    """``max_preempted_states=0``: the preempted request gives its step state up (the
    workers evict it at the next tick) and runs all its steps again, from its payload."""
    with trio.fail_after(CAP_S):
        async with gated_step_engine(
            monkeypatch,
            cache_dir,
            max_num_seqs=1,
            scheduling_policy="priority",
            max_preempted_states=0,
        ) as (engine, spy, gate):
            low = engine.stream("p", params(5, seed=1, priority=5), request_id="low")
            await gate.wait_for_step(("low",), 1)
            gate.release()
            await gate.wait_for_step(("low",), 2)
            high = engine.stream("p", params(2, seed=2, priority=-5), request_id="high")
            gate.release()
            await gate.wait_for_step(("high",), 1)
            assert engine.status("low") is S.PREEMPTED
            gate.open()
            high_out, low_out = await collect(high), await collect(low)
    assert echo_of(high_out[-1]) == ("high", 2, 0)
    assert echo_of(low_out[-1]) == ("low", 1, 0)
    assert gate.forwards == [("low",)] * 2 + [("high",)] * 2 + [("low",)] * 5
    sent = [r.request_id for out in spy.outputs for r in out.scheduled_new_reqs]
    assert sent == ["low", "high", "low"]
    assert "low" in spy.outputs[2].finished_req_ids  # evicted at the tick after the preemption


@pytest.mark.parametrize(
    ("kept", "picture"),
    [(True, False), (False, False), (True, True)],
    ids=["state-kept", "state-dropped", "inpaint-state-kept"],
)
async def test_a_preempted_request_gives_exactly_the_image_it_gives_uninterrupted(
    cache_dir: Path, kept: bool, picture: bool
) -> None:
    """The real ``builtin:shapes`` pipeline in step mode: a 12-step request preempted for
    a better one mid-way resumes from its kept latents and scheduler state (or, past the
    state budget, starts again from step 0), and its image is bit for bit the one the same
    seed gives uninterrupted.  An inpainting request keeps its picture, mask and noise with
    its state."""
    prompt = "a red circle"
    steps, seed = 12, 3
    extra: dict[str, Any] = {}
    if picture:
        pixels = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
        mask = np.zeros((32, 32), np.uint8)
        mask[4:20, 8:28] = 255
        extra = {"image": pixels, "mask_image": mask, "strength": 1.0}

    async def uninterrupted() -> np.ndarray:
        async with open_engine(
            EngineConfig(
                model="builtin:shapes",
                cache_dir=str(cache_dir),
                step_execution=True,
                torch_threads=1,
                warmup=False,
            )
        ) as engine:
            out = await engine.generate(
                prompt, params(steps, seed=seed, **extra), request_id="alone"
            )
        return np.asarray(out.images[0])

    with trio.fail_after(CAP_S * 4):
        expected = await uninterrupted()
        trace = TraceRecorder()
        async with open_engine(
            EngineConfig(
                model="builtin:shapes",
                cache_dir=str(cache_dir),
                step_execution=True,
                torch_threads=1,
                warmup=False,
                max_num_seqs=1,
                scheduling_policy="priority",
                max_preempted_states=16 if kept else 0,
            ),
            trace=trace,
        ) as engine:
            low = engine.stream(
                prompt, params(steps, seed=seed, priority=3, **extra), request_id="low"
            )
            while (engine.progress("low") or (0, 0))[0] < 3:  # noqa: ASYNC110
                await trio.sleep(0.005)
            high = await engine.generate("a blue square", params(4, seed=9, priority=-3))
            async with low:
                outs = [o async for o in low]
    assert high.ok and outs[-1].ok
    preempted = [e for e in trace if e.kind is TraceKind.PREEMPT and e.request_id == "low"]
    assert preempted and preempted[0].detail["reason"] == "priority"
    assert preempted[0].detail["progress"] >= 3
    assert preempted[0].detail.get("state_dropped", False) is not kept
    np.testing.assert_array_equal(np.asarray(outs[-1].images[0]), expected)
