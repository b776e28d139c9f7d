"""The planted bugs of :mod:`omni_trio.testing.mutants` are real bugs.

Every shipped mutant has one targeted scenario here (a real ``builtin:echo`` engine on the
inproc backend, or the shared-memory codec), run twice: on the runtime as it is, where the
scenario must come out right, and with the mutant applied, where it must come out wrong in
the way the mutant's summary says.  ``@demonstrates(name)`` runs a test both ways (``mutant``
is None, then the name) and records the name, so a shipped mutant without a scenario fails
:func:`test_every_shipped_mutant_is_demonstrated`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import sys
import types
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from omni_trio import (
    AsyncEngine,
    EngineConfig,
    RequestStatus,
    SamplingParams,
    WorkerError,
    open_engine,
)
from omni_trio._core.messages import DiffusionOutput
from omni_trio._core.trace import TraceKind, TraceRecorder
from omni_trio.models.echo import decode_echo_image
from omni_trio.runtime.request_stream import RequestStream
from omni_trio.testing import Fault, FaultSpec, check_leftovers, check_trace, with_faults
from omni_trio.testing.mutants import MUTANTS, Mutant, Patcher, applied, find_mutant

S = RequestStatus
CAP_S = 20.0
_DEMONSTRATED: set[str] = set()


def demonstrates(name: str) -> Callable[[Callable[..., Any]], Any]:
    """Run the test on the runtime (``mutant=None``) and with mutant ``name``."""

    def decorate(test: Callable[..., Any]) -> Any:
        _DEMONSTRATED.add(name)
        return pytest.mark.parametrize("mutant", [None, name], ids=["runtime", name])(test)

    return decorate


@contextlib.contextmanager
def maybe(mutant: str | None) -> Iterator[None]:
    if mutant is None:
        yield
        return
    with applied(find_mutant(mutant)):
        yield


def params(**kw: Any) -> SamplingParams:
    kw.setdefault("height", 32)
    kw.setdefault("width", 32)
    kw.setdefault("num_inference_steps", 2)
    kw.setdefault("seed", 1)
    return SamplingParams(**kw)


@asynccontextmanager
async def echo_engine(
    cache_dir: Path, *, delay: float = 0.0, trace: TraceRecorder | None = None, **overrides: Any
) -> AsyncIterator[AsyncEngine]:
    overrides.setdefault("torch_threads", 1)
    overrides.setdefault("warmup", False)
    if overrides.get("step_execution"):
        overrides.setdefault("streaming_output", True)
    config = EngineConfig(
        model="builtin:echo",
        model_options={"step_delay_s": delay},
        cache_dir=str(cache_dir),
        **overrides,
    )
    async with open_engine(config, trace=trace) as engine:
        yield engine


async def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` passes (False)."""
    with trio.move_on_after(timeout):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(0.005)
        return True
    return False


async def started(engine: AsyncEngine, rid: str, steps: int = 2) -> None:
    """Wait until ``rid``'s forward has run ``steps`` steps."""
    assert await wait_for(lambda: (engine.progress(rid) or (0, 0))[0] >= steps), rid


async def collect(stream: RequestStream) -> list[DiffusionOutput]:
    async with stream:
        return [output async for output in stream]


def drawn(output: DiffusionOutput) -> tuple[str, int, int]:
    """(request id, seed, index) written into the output's first image by echo."""
    return decode_echo_image(output.images[0])


def invariants(violations: list[Any]) -> set[str]:
    return {v.invariant for v in violations}


# -- the catalogue ----------------------------------------------------------------------


def test_the_catalogue_is_well_formed() -> None:
    from omni_trio.testing.machine import MachineOptions

    fields = {f.name for f in dataclasses.fields(MachineOptions)}
    names = [m.name for m in MUTANTS]
    assert len(MUTANTS) >= 16 and len(set(names)) == len(names)
    assert {m.invariant for m in MUTANTS} <= {f"INV-{i}" for i in range(1, 8)}
    for mutant in MUTANTS:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)+", mutant.name), mutant.name
        assert mutant.summary and "\n" not in mutant.summary, mutant.name
        assert set(mutant.options) <= fields, (mutant.name, mutant.options)
        options = MachineOptions(**mutant.options)  # a campaign can be configured with them
        assert options.mode in ("request", "step")


def test_every_shipped_mutant_is_demonstrated() -> None:
    assert {m.name for m in MUTANTS} == _DEMONSTRATED


def test_every_mutant_patches_and_restores_what_it_names() -> None:
    from omni_trio._core import engine_core, keys, liveness, scheduler
    from omni_trio.executors import inproc, result_pump
    from omni_trio.ipc import codec, shm
    from omni_trio.runtime import engine, request_stream
    from omni_trio.worker import runner, step_runner, stop_flags

    modules = [engine_core, keys, liveness, scheduler, inproc, result_pump, codec, shm]
    modules += [engine, request_stream, runner, step_runner, stop_flags]
    owners: list[Any] = list(modules)
    for module in modules:
        owners += [v for v in vars(module).values() if isinstance(v, type)]

    # Every attribute of these modules and of their classes (a mutant that patches
    # something elsewhere needs its module added here).
    def snapshot() -> dict[tuple[int, str], Any]:
        return {(id(o), k): v for o in owners for k, v in list(vars(o).items())}

    before = snapshot()
    for mutant in MUTANTS:
        patcher = Patcher()
        mutant.patch(patcher)
        assert len(patcher) >= 1, mutant.name
        assert snapshot() != before, mutant.name
        patcher.undo()
        assert snapshot() == before, mutant.name


def test_patcher_restores_in_reverse_and_removes_what_it_added() -> None:
    class Base:
        def who(self) -> str:
            return "base"

    class Child(Base):
        pass

    module = types.ModuleType("scratch")
    module.value = 1
    patcher = Patcher()
    patcher.setattr(module, "value", 2)
    patcher.setattr(module, "value", 3)
    patcher.setattr(Child, "who", lambda self: "child")
    assert module.value == 3 and Child().who() == "child" and len(patcher) == 3
    patcher.undo()
    assert module.value == 1 and len(patcher) == 0
    assert "who" not in vars(Child) and Child().who() == "base"
    patcher.undo()  # idempotent
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        patcher.setattr(module, "missing", 0)


def test_applied_restores_even_when_the_block_or_the_patch_raises() -> None:
    from omni_trio._core import engine_core

    real = engine_core._resolve_defaults
    with pytest.raises(RuntimeError, match="boom"), applied(find_mutant("seed-zero-random")):
        assert engine_core._resolve_defaults is not real
        raise RuntimeError("boom")
    assert engine_core._resolve_defaults is real

    def half_way(patcher: Patcher) -> None:
        patcher.setattr(engine_core, "_resolve_defaults", None)
        raise ValueError("bad patch")

    broken = Mutant("broken", "INV-5", "raises while patching", half_way)
    with pytest.raises(ValueError, match="bad patch"), applied(broken):
        pass  # pragma: no cover - never entered
    assert engine_core._resolve_defaults is real


def test_find_mutant_by_name_and_by_import_path() -> None:
    for mutant in MUTANTS:
        assert find_mutant(mutant.name) is mutant
    module = types.ModuleType("omni_trio_test_my_mutants")
    mine = Mutant("mine", "INV-3", "a researcher's own", lambda patcher: None, {"mode": "step"})
    module.MINE = mine
    module.NOT_ONE = 42
    sys.modules[module.__name__] = module
    try:
        assert find_mutant("omni_trio_test_my_mutants:MINE") is mine
        assert mine.options == {"mode": "step"}
        with pytest.raises(ValueError, match=r"type int, not an .*seed-zero-random"):
            find_mutant("omni_trio_test_my_mutants:NOT_ONE")
        with pytest.raises(ValueError, match=r"has no 'NOPE'.*seed-zero-random"):
            find_mutant("omni_trio_test_my_mutants:NOPE")
    finally:
        del sys.modules[module.__name__]
    with pytest.raises(ValueError, match="cannot import"):
        find_mutant("omni_trio_no_such_module:X")


def test_an_unknown_name_lists_the_shipped_ones() -> None:
    with pytest.raises(KeyError) as info:
        find_mutant("no-such-bug")
    message = info.value.args[0]
    assert "no-such-bug" in message and "\n" not in message
    assert all(m.name in message for m in MUTANTS)


# -- identity (INV-5) ----------------------------------------------------------------------


@demonstrates("seed-zero-random")
async def test_an_explicit_seed_0_is_used(mutant: str | None, cache_dir: Path) -> None:
    with maybe(mutant), trio.fail_after(CAP_S):
        async with echo_engine(cache_dir) as engine:
            out = await engine.generate("p", params(seed=0), request_id="a")
    assert out.ok and drawn(out)[1] == out.seed  # the seed used is the one reported
    assert (out.seed != 0) is (mutant is not None), out.seed


@demonstrates("fused-row-seed-offset")
async def test_each_row_of_a_fused_wave_draws_from_its_own_seed(
    mutant: str | None, cache_dir: Path
) -> None:
    with maybe(mutant), trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, max_num_seqs=2) as engine:
            a = engine.stream("p", params(seed=5), request_id="a")
            b = engine.stream("p", params(seed=9), request_id="b")
            outs = [(await collect(a))[-1], (await collect(b))[-1]]
            assert dict(engine.statistics().batch_sizes) == {2: 1}  # one fused wave
    assert [o.seed for o in outs] == [5, 9]
    seeds = [drawn(o)[1] for o in outs]
    assert seeds == ([5, 10] if mutant else [5, 9])


async def _abort_a_in_a_fused_wave_with_b(
    mutant: str | None, cache_dir: Path
) -> tuple[list[Any], list[Any]]:
    """Requests a and b fused into one 60-step forward; a aborted once it started: what
    each stream delivered."""
    with maybe(mutant), trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, delay=0.01, max_num_seqs=2) as engine:
            a = engine.stream("p", params(num_inference_steps=60), request_id="a")
            b = engine.stream("p", params(num_inference_steps=60), request_id="b")
            await started(engine, "a")
            engine.abort("a")
            outs_a, outs_b = await collect(a), await collect(b)
            assert dict(engine.statistics().batch_sizes) == {2: 1}
    return outs_a, outs_b


@demonstrates("fused-survivors-by-position")
async def test_survivors_of_a_fused_wave_keep_their_own_images(
    mutant: str | None, cache_dir: Path
) -> None:
    outs_a, outs_b = await _abort_a_in_a_fused_wave_with_b(mutant, cache_dir)
    assert outs_a[-1].status is S.FINISHED_ABORTED
    assert outs_b[-1].status is S.FINISHED_COMPLETED
    assert drawn(outs_b[-1])[0] == ("a" if mutant else "b")


@demonstrates("step-seed-truncated-32bit")
async def test_step_mode_draws_from_a_seed_beyond_32_bits(
    mutant: str | None, cache_dir: Path
) -> None:
    seed = 2**40 + 7
    with maybe(mutant), trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, step_execution=True) as engine:
            out = await engine.generate("p", params(seed=seed))
    assert out.seed == seed
    assert drawn(out)[1] == (7 if mutant else seed)


@demonstrates("preview-index-never-advances")
async def test_a_step_mode_stream_counts_its_chunks(mutant: str | None, cache_dir: Path) -> None:
    with maybe(mutant), trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, step_execution=True) as engine:
            outs = await collect(engine.stream("p", params(num_inference_steps=4)))
    assert len(outs) == 4 and outs[-1].finished  # three previews and the final output
    indexes = [o.chunk_index for o in outs]
    assert (indexes == [0, 1, 2, 3]) is (mutant is None), indexes
    assert all(drawn(o)[0] == outs[0].request_id for o in outs)


@demonstrates("preempted-payload-resent")
async def test_a_preempted_request_resumes_where_it_stopped(
    mutant: str | None, cache_dir: Path
) -> None:
    trace = TraceRecorder()
    with maybe(mutant), trio.fail_after(CAP_S):
        async with echo_engine(
            cache_dir,
            delay=0.005,
            trace=trace,
            step_execution=True,
            scheduling_policy="priority",
            max_num_seqs=1,
        ) as engine:
            low = engine.stream("p", params(num_inference_steps=100, priority=3), request_id="low")
            await started(engine, "low")
            high = engine.stream("p", params(priority=-3), request_id="high")
            outs_high, outs_low = await collect(high), await collect(low)
    preempted = [e for e in trace.events if e.kind is TraceKind.PREEMPT]
    assert [e.request_id for e in preempted] == ["low"]
    assert outs_high[-1].status is S.FINISHED_COMPLETED
    final = outs_low[-1]
    if mutant:
        assert final.status is S.FINISHED_ERROR and "already has step state" in str(final.error)
    else:
        assert final.status is S.FINISHED_COMPLETED and drawn(final)[0] == "low"


# -- prompt cancellation (INV-7) ---------------------------------------------------------


@demonstrates("abort-sets-no-stop-flag")
async def test_an_aborted_forward_stops_within_a_step(mutant: str | None, cache_dir: Path) -> None:
    trace = TraceRecorder()
    with maybe(mutant), trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, delay=0.01, trace=trace) as engine:
            stream = engine.stream("p", params(num_inference_steps=50), request_id="a")
            await started(engine, "a")
            engine.abort("a")
            outs = await collect(stream)
            await engine.wait_idle()
    assert outs[-1].status is S.FINISHED_ABORTED  # at once, either way
    [result] = [e for e in trace.events if e.kind is TraceKind.EXEC_RESULT]
    late = result.detail["steps_after_abort"]
    assert late >= 10 if mutant else late <= 1, late  # with the mutant it ran on
    assert ("INV-7" in invariants(check_trace(trace.events))) is (mutant is not None)


@demonstrates("any-abort-stops-fused-forward")
async def test_aborting_one_member_of_a_fused_wave_spares_the_other(
    mutant: str | None, cache_dir: Path
) -> None:
    outs_a, outs_b = await _abort_a_in_a_fused_wave_with_b(mutant, cache_dir)
    assert outs_a[-1].status is S.FINISHED_ABORTED
    expected = S.FINISHED_ABORTED if mutant else S.FINISHED_COMPLETED
    assert outs_b[-1].status is expected


@demonstrates("consumer-drop-not-aborted")
async def test_a_dropped_consumer_aborts_its_request(mutant: str | None, cache_dir: Path) -> None:
    trace = TraceRecorder()
    with maybe(mutant), trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, delay=0.005, trace=trace, step_execution=True) as engine:
            stream = engine.stream("p", params(num_inference_steps=60), request_id="a")
            await started(engine, "a")
            await stream.aclose()  # the consumer leaves
            assert await wait_for(lambda: engine.status("a") is None)
            stats = engine.statistics()
    assert (stats.finished_completed, stats.finished_aborted) == ((1, 0) if mutant else (0, 1))
    late = [v for v in check_trace(trace.events) if v.invariant == "INV-7"]
    assert bool(late) is (mutant is not None), late


# -- bounded waits (INV-6) -----------------------------------------------------------------


@demonstrates("early-output-ready-never-split")
async def test_an_output_ready_before_its_compute_done_is_delivered(
    mutant: str | None, cache_dir: Path
) -> None:
    late_return = with_faults(params(), FaultSpec(Fault.DELAY_COMPUTE_DONE, delay_s=0.3))
    with maybe(mutant), trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, fault_injection=True) as engine:
            stream = engine.stream("p", late_return, request_id="a")
            # OUTPUT_READY came first: the pump holds the whole batch, unsplit.
            assert await wait_for(lambda: "a" in engine.leftovers()["pump_cached"])
            ended = await wait_for(lambda: engine.status("a") is None, timeout=2.0)
            status = engine.status("a")
        final = (await collect(stream))[-1]  # with the mutant, the close ended it
    assert ended is (mutant is None)
    assert status is (S.PACKING if mutant else None)
    if mutant:
        assert final.status is S.FINISHED_ABORTED and final.error_type == "EngineClosedError"
    else:
        assert final.status is S.FINISHED_COMPLETED and drawn(final)[0] == "a"


@demonstrates("packing-lost-with-group-not-requeued")
async def test_a_request_whose_output_is_lost_with_its_group_runs_again(
    mutant: str | None, cache_dir: Path
) -> None:
    trace = TraceRecorder()
    slow = with_faults(params(), FaultSpec(Fault.SLOW_PACKING, delay_s=0.4))
    with maybe(mutant), trio.fail_after(CAP_S):
        async with echo_engine(
            cache_dir, trace=trace, fault_injection=True, worker_restart_backoff_s=0.01
        ) as engine:
            stream = engine.stream("p", slow, request_id="a")
            assert await wait_for(lambda: engine.status("a") is S.PACKING)
            # What omni_trio.testing.EngineDriver.crash_worker does in-process.
            executor = engine.executor
            executor.fail(WorkerError("injected crash", worker=0, error_type="WorkerDied"))
            executor.stop_flags.stop_everything()
            # Seen now (the loop is idle: it would see it once the old group has closed,
            # and closing drains the packer, so the output would come first).
            assert not engine.health().healthy
            ended = await wait_for(lambda: engine.status("a") is None, timeout=3.0)
            status = engine.status("a")
        final = (await collect(stream))[-1]  # with the mutant, the close ended it
    requeued = [e.request_id for e in trace.events if e.kind is TraceKind.REQUEUE]
    assert any(e.kind is TraceKind.CRASH for e in trace.events)
    if mutant:
        assert not ended and status is S.PACKING and requeued == []
        assert final.error_type == "EngineClosedError", final
    else:
        assert ended and requeued == ["a"]
        assert final.status is S.FINISHED_COMPLETED and drawn(final)[0] == "a"


@demonstrates("heartbeat-resets-stall-clock")
async def test_a_hung_forward_is_judged_stalled(mutant: str | None, cache_dir: Path) -> None:
    hang = with_faults(params(), FaultSpec(Fault.HANG_AT_STEP, step=0))
    with maybe(mutant), trio.fail_after(CAP_S):
        async with echo_engine(
            cache_dir,
            fault_injection=True,
            worker_stall_timeout_s=0.3,
            worker_restart_backoff_s=0.01,
            max_retries_on_worker_failure=0,
        ) as engine:
            stream = engine.stream("p", hang, request_id="a")
            ended = await wait_for(lambda: engine.status("a") is None, timeout=2.5)
            status = engine.status("a")
        final = (await collect(stream))[-1]  # with the mutant, the close ended it
    assert ended is (mutant is None)
    assert status is (S.RUNNING if mutant else None)
    if mutant:
        assert final.error_type == "EngineClosedError", final
    else:
        assert final.status is S.FINISHED_ERROR and final.error_type == "WorkerFailedError"
        assert "no step progress" in str(final.error), final.error


@demonstrates("idle-loop-ignores-rpc")
async def test_an_rpc_on_an_idle_engine_runs(mutant: str | None, cache_dir: Path) -> None:
    reply: Any = None
    with maybe(mutant), trio.fail_after(CAP_S):
        async with echo_engine(cache_dir) as engine:
            await engine.generate("p", params())
            await engine.wait_idle()
            await trio.testing.wait_all_tasks_blocked(0.05)  # the loop is parked
            with trio.move_on_after(1.0):
                reply = await engine.collective_rpc("ping")
    assert (reply is None) is (mutant is not None), reply


# -- complete cleanup (INV-3) --------------------------------------------------------------


@demonstrates("aborted-output-stays-cached")
async def test_the_output_of_a_request_aborted_during_its_forward_is_released(
    mutant: str | None, cache_dir: Path
) -> None:
    trace = TraceRecorder()
    late_return = with_faults(params(), FaultSpec(Fault.DELAY_COMPUTE_DONE, delay_s=0.3))
    with maybe(mutant), trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, trace=trace, fault_injection=True) as engine:
            stream = engine.stream("p", late_return, request_id="a")
            # Packed and sent; the forward has not returned yet: abort now.
            assert await wait_for(lambda: "a" in engine.leftovers()["pump_cached"])
            assert engine.core.in_flight_ids() == {"a"}
            engine.abort("a")
            outs = await collect(stream)
            assert await wait_for(lambda: engine.core.dispatch is None)
            released = await wait_for(lambda: not engine.leftovers()["pump_cached"], 1.0)
            held = engine.leftovers()
    assert outs[-1].status is S.FINISHED_ABORTED
    assert released is (mutant is None)
    leaks = check_leftovers(held, trace.events)
    assert invariants(leaks) == ({"INV-3"} if mutant else set()), leaks


@demonstrates("abort-while-packing-keeps-claim")
async def test_aborting_a_packing_request_withdraws_its_output(
    mutant: str | None, cache_dir: Path
) -> None:
    trace = TraceRecorder()
    slow = with_faults(params(), FaultSpec(Fault.SLOW_PACKING, delay_s=0.5))
    with maybe(mutant), trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, trace=trace, fault_injection=True) as engine:
            stream = engine.stream("p", slow, request_id="a")
            assert await wait_for(lambda: engine.status("a") is S.PACKING)
            engine.abort("a")
            held = engine.leftovers()
            outs = await collect(stream)
            await engine.wait_idle()
    assert outs[-1].status is S.FINISHED_ABORTED
    assert ("a" in held["pump_claims"]) is (mutant is not None)
    leaks = check_leftovers(held, trace.events)
    assert invariants(leaks) == ({"INV-3"} if mutant else set()), leaks


@demonstrates("aborted-step-state-kept")
async def test_the_step_state_of_an_aborted_request_is_evicted(
    mutant: str | None, cache_dir: Path
) -> None:
    with maybe(mutant), trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, delay=0.005, step_execution=True) as engine:
            stream = engine.stream("p", params(num_inference_steps=200), request_id="a")
            await started(engine, "a")
            engine.abort("a")
            await collect(stream)
            evicted = False
            for _ in range(20):  # the eviction rides on the next tick
                await engine.wait_idle()
                held = await engine.worker_leftovers()
                if not any(held.values()):
                    evicted = True
                    break
                await trio.sleep(0.05)
    assert evicted is (mutant is None), held
    if mutant:
        assert held["step_states"] == {"a"}


@demonstrates("consumer-drop-leaks-stream")
async def test_a_dropped_consumer_leaves_no_stream_behind(
    mutant: str | None, cache_dir: Path
) -> None:
    trace = TraceRecorder()
    with maybe(mutant), trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, delay=0.005, trace=trace) as engine:
            stream = engine.stream("p", params(num_inference_steps=200), request_id="a")
            await started(engine, "a")
            await stream.aclose()
            assert await wait_for(lambda: engine.status("a") is None)
            held = engine.leftovers()
            await engine.wait_idle()
    assert ("a" in held["engine_streams"]) is (mutant is not None)
    leaks = check_leftovers(held, trace.events)
    assert invariants(leaks) == ({"INV-3"} if mutant else set()), leaks


@demonstrates("shm-read-never-unlinks")
def test_a_received_payload_leaves_no_shared_memory(mutant: str | None) -> None:
    """A process backend's engine decodes what its workers send; a payload over the
    threshold comes through a segment the receiver must unlink once it has copied it."""
    from omni_trio.ipc import list_our_segments, unlink_segment
    from omni_trio.ipc.codec import Encoder, decode
    from omni_trio.ipc.shm import SegmentRegistry

    before = set(list_our_segments())
    image = np.arange(700 * 700 * 3, dtype=np.uint32).astype(np.uint8).reshape(700, 700, 3)
    data = Encoder(registry=SegmentRegistry("mutanttest")).encode({"image": image})
    created = set(list_our_segments()) - before  # over the 1 MB threshold: one segment
    try:
        assert len(created) == 1
        with maybe(mutant):
            received = decode(data)
        left = set(list_our_segments()) & created
    finally:
        for name in created:
            unlink_segment(name)
    np.testing.assert_array_equal(received["image"], image)  # copied out either way
    assert bool(left) is (mutant is not None)


# -- one owner (INV-1) ---------------------------------------------------------------------


@demonstrates("close-ends-only-running")
async def test_close_ends_every_request_waiting_ones_too(
    mutant: str | None, cache_dir: Path
) -> None:
    trace = TraceRecorder()
    with maybe(mutant), trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, delay=0.01, trace=trace, max_num_seqs=1) as engine:
            running = engine.stream("p", params(num_inference_steps=200), request_id="running")
            waiting = engine.stream("p", params(), request_id="waiting")
            await started(engine, "running")
            assert engine.status("waiting") is S.WAITING
        outs = {rid: await collect(s) for rid, s in (("running", running), ("waiting", waiting))}
    # The consumers get an end either way (the shell's safety net) ...
    assert all(o[-1].status is S.FINISHED_ABORTED for o in outs.values())
    # ... but with the mutant the core never ended the waiting request.
    violations = check_trace(trace.events)
    assert trace.events[-1].kind is TraceKind.CLOSED
    if mutant:  # about that request, and what the engine still held when it closed
        assert {v.request_id for v in violations} == {"waiting", None}, violations
        assert "INV-1" in invariants(violations)
    else:
        assert violations == []


# -- execution follows the schedule (INV-2) -----------------------------------------------


@demonstrates("different-steps-share-a-wave")
async def test_requests_with_different_step_counts_run_in_separate_waves(
    mutant: str | None, cache_dir: Path
) -> None:
    with maybe(mutant), trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, max_num_seqs=2) as engine:
            a = engine.stream("p", params(num_inference_steps=2), request_id="a")
            b = engine.stream("p", params(num_inference_steps=3), request_id="b")
            finals = [(await collect(a))[-1], (await collect(b))[-1]]
            sizes = dict(engine.statistics().batch_sizes)
    assert sizes == ({2: 1} if mutant else {1: 2})
    expected = S.FINISHED_ERROR if mutant else S.FINISHED_COMPLETED
    assert [f.status for f in finals] == [expected, expected], [f.error for f in finals]


@demonstrates("conditioning-not-in-batch-key")
async def test_a_text_request_and_a_picture_request_run_apart(
    mutant: str | None, cache_dir: Path
) -> None:
    picture = np.full((40, 40, 3), 7, dtype=np.uint8)
    with maybe(mutant), trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, max_num_seqs=2) as engine:
            a = engine.stream("p", params(num_inference_steps=1), request_id="a")
            b = engine.stream(
                "p", params(num_inference_steps=1, image=picture, strength=1.0), request_id="b"
            )
            finals = [(await collect(a))[-1], (await collect(b))[-1]]
            sizes = dict(engine.statistics().batch_sizes)
    assert sizes == ({2: 1} if mutant else {1: 2})
    expected = S.FINISHED_ERROR if mutant else S.FINISHED_COMPLETED
    assert [f.status for f in finals] == [expected, expected], [f.error for f in finals]


@demonstrates("deadline-never-fires")
async def test_a_request_past_its_deadline_is_aborted(mutant: str | None, cache_dir: Path) -> None:
    with maybe(mutant), trio.fail_after(CAP_S):
        async with echo_engine(cache_dir, delay=0.01) as engine:
            stream = engine.stream("p", params(num_inference_steps=60, deadline_s=0.05))
            final = (await collect(stream))[-1]
    if mutant:
        assert final.status is S.FINISHED_COMPLETED  # ran all 60 steps, 0.6 s, for nobody
    else:
        assert final.status is S.FINISHED_ABORTED
        assert final.error_type == "RequestTimeoutError"
