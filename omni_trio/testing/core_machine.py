"""A Hypothesis state machine over the pure engine core: the whole lifecycle in milliseconds.

:func:`make_core_machine` builds a ``RuleBasedStateMachine`` that plays the engine shell, the
executor, the result pump and every consumer around one :class:`EngineCore`, with a rule for
every event the core takes: admit (fresh and reused ids), schedule, a forward's result (ok,
announced output, error, aborted, missing, stray results for unscheduled ids), an execution
error, an output arriving, failing or being lost, a late arrival for something dropped,
time passing past output deadlines, abort, consumer drop, step-boundary preemption, group
failure and restart, close and death.  Time is a number it advances; nothing sleeps.

After every rule it checks

* INV-1..7 on the core's own trace (:func:`check_trace`, with ``abort_latency_s=0``: the core
  ends an aborted request in the same event), plus what the consumers received (identity,
  seed, chunk order: every output is recorded as ``RECEIVED``);
* what the core holds against its trace (:func:`check_leftovers`);
* the instructions' bookkeeping, the core's side of INV-3 and INV-7: every output a result
  announces is awaited or dropped at once; every awaited output belongs to a live PACKING
  request; nothing is delivered to a consumer that left or to a closed stream; an abort of a
  running request stops its forward; no request is retried past its budget; no PACKING
  request outlives its deadline once time has passed it.

The fakes encode identity into everything they produce (an image is ``("img", request_id,
seed)``), so a result handed to the wrong request is caught by INV-5.  Extend the machine
by subclassing the class this returns and adding rules; ``self.core``, ``self.now`` and
``self.apply(instructions)`` are the hooks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import hypothesis.strategies as st
from hypothesis import note
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from .._core.engine_core import (
    AwaitOutput,
    CoreConfig,
    DeliverChunk,
    DeliverTerminal,
    DropOutput,
    EngineCore,
    Instruction,
    StopForwards,
)
from .._core.health import GroupState
from .._core.lifecycle import RequestStatus
from .._core.messages import BatchRunnerOutput, DiffusionOutput, RunnerOutput, SchedulerOutput
from .._core.model_info import ModelInfo
from .._core.request import DiffusionRequest, SamplingParams
from .._core.trace import TraceKind, TraceRecorder
from ..errors import DuplicateRequestError, EngineClosedError, EngineDeadError
from .invariants import InvariantViolation, check_leftovers, check_trace

__all__ = ["CoreMachineOptions", "make_core_machine"]

_S = RequestStatus
_INFO = ModelInfo("fake:core", "echo", True, 64, 64, False, supports_steps=True)
_OUTPUT_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class CoreMachineOptions:
    """What the machine exercises: the mode, the batch size and the retry budget."""

    mode: str = "request"  # "request" or "step"
    max_num_seqs: int = 2
    max_retries: int = 1
    streaming_output: bool = True


@dataclass
class _Consumer:
    """One incarnation's reader: what it received, and whether it is still reading."""

    request_id: str
    seed: int | None
    total_steps: int = 1
    reading: bool = True
    closed: bool = False  # the stream delivered its terminal output
    outputs: list[DiffusionOutput] = field(default_factory=list)


def _image(request_id: str, seed: int | None, tag: str = "final") -> tuple[str, str, Any]:
    return (tag, request_id, seed)


def make_core_machine(options: CoreMachineOptions | None = None) -> type[RuleBasedStateMachine]:
    """A state machine class over a fresh :class:`EngineCore` per example."""
    opts = options if options is not None else CoreMachineOptions()
    step_mode = opts.mode == "step"

    class CoreMachine(RuleBasedStateMachine):
        ids = Bundle("ids")
        description: ClassVar[str] = f"core/{opts.mode}"

        def __init__(self) -> None:
            super().__init__()
            self.trace = TraceRecorder()
            self.core = EngineCore(
                CoreConfig(
                    step_execution=step_mode,
                    max_num_seqs=opts.max_num_seqs,
                    streaming_output=step_mode and opts.streaming_output,
                    max_retries_on_worker_failure=opts.max_retries,
                    fault_injection=False,
                    output_timeout_s=_OUTPUT_TIMEOUT_S,
                ),
                trace=self.trace,
                seed=7,
            )
            self.now = 0.0
            self.counter = 0
            self.dispatch: SchedulerOutput | None = None
            # The fake pump: announced output key -> owner; claimed keys -> owner.
            self.claimed: dict[str, str] = {}
            self.released: set[str] = set()
            self.consumers: dict[str, _Consumer] = {}
            self.stopped: set[str] = set()  # ids whose forward was told to stop
            self.steps_done: dict[str, int] = {}  # step mode: progress the fake worker made
            self.ended = False  # closed or dead
            self.strays: set[str] = set()  # ids of the stray results the fake executor sent

        # -- the shell's side ------------------------------------------------------------

        def apply(self, instructions: Iterable[Instruction]) -> None:
            """Carry the core's instructions out, checking each against the fake world."""
            for ins in instructions:
                note(f"  -> {ins!r}"[:200])
                if isinstance(ins, DeliverTerminal | DeliverChunk):
                    consumer = self.consumers.get(ins.request_id)
                    assert consumer is not None and consumer.reading and not consumer.closed, (
                        f"{type(ins).__name__} for {ins.request_id!r}, whose consumer is "
                        f"{'gone' if consumer is not None else 'unknown'}"
                    )
                    assert ins.output.request_id == ins.request_id
                    assert ins.output.finished is isinstance(ins, DeliverTerminal)
                    consumer.outputs.append(ins.output)
                    self.trace.record(
                        self.now,
                        TraceKind.RECEIVED,
                        ins.request_id,
                        detail={
                            "finished": ins.output.finished,
                            "chunk_index": ins.output.chunk_index,
                            "status": ins.output.status.name,
                            "seed": ins.output.seed,
                            "identity": self._identity(ins.output),
                        },
                    )
                    if ins.output.finished:
                        consumer.closed = True
                elif isinstance(ins, AwaitOutput):
                    assert ins.key not in self.claimed, f"{ins.key} claimed twice"
                    assert self.core.status_of(ins.request_id) is _S.PACKING
                    self.claimed[ins.key] = ins.request_id
                elif isinstance(ins, DropOutput):
                    self.claimed.pop(ins.key, None)
                    self.released.add(ins.key)
                elif isinstance(ins, StopForwards):
                    self.stopped.update(ins.request_ids)

        @staticmethod
        def _identity(output: DiffusionOutput) -> dict[str, Any] | None:
            if not output.images:
                return None
            image = output.images[0]
            return {"request_id": image[1], "seed": image[2]}

        def advance(self, dt: float) -> None:
            if dt:
                self.now += dt

        # -- rules: admission ------------------------------------------------------------

        @initialize()
        def start_group(self) -> None:
            self.core.group_started(_INFO, self.now)

        @precondition(lambda self: not self.ended)
        @rule(
            target=ids,
            steps=st.integers(1, 3),
            seed=st.one_of(st.none(), st.integers(0, 5)),
            size=st.sampled_from([None, 32, 64]),
            dt=st.sampled_from([0.0, 0.0, 0.1]),
        )
        def admit(self, steps: int, seed: int | None, size: int | None, dt: float) -> str:
            self.advance(dt)
            self.counter += 1
            rid = f"r{self.counter}"
            return self._admit(rid, steps, seed, size)

        def _admit(self, rid: str, steps: int, seed: int | None, size: int | None) -> str:
            params = SamplingParams(num_inference_steps=steps, seed=seed, height=size, width=size)
            request = self.core.build_request(DiffusionRequest("p", params, rid))
            admitted = self.core.admit(request, self.now)
            note(f"admit {rid} steps={steps} seed={admitted.sampling.seed}")
            if seed is not None:
                assert admitted.sampling.seed == seed, "an explicit seed was replaced"
            assert (admitted.sampling.height, admitted.sampling.width) == (
                size or _INFO.default_height,
                size or _INFO.default_width,
            )
            self.consumers[rid] = _Consumer(
                rid, admitted.sampling.seed, total_steps=admitted.sampling.total_steps
            )
            self.steps_done[rid] = 0
            return rid

        @precondition(lambda self: not self.ended)
        @rule(rid=ids, steps=st.integers(1, 3))
        def admit_again(self, rid: str, steps: int) -> None:
            """Reuse an id: refused while it is live, a new incarnation once it ended."""
            if self.core.is_live(rid):
                try:
                    self._admit(rid, steps, 1, None)
                except DuplicateRequestError:
                    return
                raise AssertionError(f"live {rid} admitted twice")
            self._admit(rid, steps, 1, None)

        @precondition(lambda self: self.ended)
        @rule()
        def admit_after_the_end(self) -> None:
            try:
                self.core.admit(DiffusionRequest("p", SamplingParams(), "late"), self.now)
            except (EngineClosedError, EngineDeadError):
                return
            raise AssertionError("admitted after close/death")

        # -- rules: execution ------------------------------------------------------------

        @precondition(lambda self: self.dispatch is None and self.core.has_work())
        @rule(dt=st.sampled_from([0.0, 0.05]))
        def schedule(self, dt: float) -> None:
            self.advance(dt)
            out = self.core.schedule(self.now, worker=0)
            note(f"schedule -> {out.scheduled_request_ids if out else None}")
            if out is None:
                return
            for rid in out.scheduled_request_ids:
                assert self.core.status_of(rid) is _S.RUNNING
                self.stopped.discard(rid)
            self.dispatch = out

        @precondition(lambda self: self.dispatch is not None)
        @rule(data=st.data(), dt=st.sampled_from([0.0, 0.1, 0.3]))
        def forward_returns(self, data: st.DataObject, dt: float) -> None:
            """The executor answers the dispatch: one drawn outcome per scheduled id, and
            maybe a stray result for an id it was not given."""
            self.advance(dt)
            out = self.dispatch
            assert out is not None
            self.dispatch = None
            results: dict[str, RunnerOutput] = {}
            for rid in out.scheduled_request_ids:
                made = self._outcome(rid, out.step_id, data)
                if made is not None:
                    results[rid] = made
            if data.draw(st.booleans(), label="stray result"):
                # A misbehaving executor: the core must not apply it, and the trace shows
                # it (an INV-2 violation of the executor's, expected here).
                stray = f"stray{out.step_id}"
                self.strays.add(stray)
                results[stray] = RunnerOutput(stray, async_output_id=f"b{out.step_id}/{stray}")
            note(f"forward {out.step_id} -> {sorted(results)}")
            announced = {r.async_output_id for r in results.values() if r.async_output_id}
            instructions = self.core.runner_output(
                out, BatchRunnerOutput(results), self.now, worker=0
            )
            self.apply(instructions)
            for key in announced:
                assert key in self.claimed or key in self.released, (
                    f"output {key} was announced but neither awaited nor dropped (INV-3)"
                )

        def _outcome(self, rid: str, step_id: int, data: st.DataObject) -> RunnerOutput | None:
            consumer = self.consumers[rid]
            seed = consumer.seed
            if step_mode:
                kind = data.draw(
                    st.sampled_from(["step", "step", "step", "error", "aborted", "missing"]),
                    label=f"outcome of {rid}",
                )
                if kind == "step":
                    total = consumer.total_steps
                    done = min(self.steps_done[rid] + 1, total)
                    self.steps_done[rid] = done
                    finished = done >= total
                    return RunnerOutput(
                        rid,
                        images=(_image(rid, seed, "final" if finished else "preview"),),
                        finished=finished,
                        step_index=done,
                        total_steps=total,
                    )
            else:
                kind = data.draw(
                    st.sampled_from(["ok", "async", "async", "error", "aborted", "missing"]),
                    label=f"outcome of {rid}",
                )
                if kind == "ok":
                    return RunnerOutput(rid, images=(_image(rid, seed),))
                if kind == "async":
                    return RunnerOutput(rid, async_output_id=f"b{step_id}/{rid}")
            if kind == "error":
                return RunnerOutput(rid, error="boom", error_type="RuntimeError")
            if kind == "aborted":
                return RunnerOutput(rid, aborted=True)
            return None

        @precondition(lambda self: self.dispatch is not None)
        @rule()
        def execution_fails(self) -> None:
            out = self.dispatch
            assert out is not None
            self.dispatch = None
            note(f"forward {out.step_id} raised")
            self.apply(self.core.execution_failed(out, "bad call", "RuntimeError", self.now))

        # -- rules: outputs --------------------------------------------------------------

        @precondition(lambda self: self.claimed)
        @rule(data=st.data(), ok=st.booleans(), dt=st.sampled_from([0.0, 0.2]))
        def output_arrives(self, data: st.DataObject, ok: bool, dt: float) -> None:
            self.advance(dt)
            key = data.draw(st.sampled_from(sorted(self.claimed)), label="claimed key")
            rid = self.claimed.pop(key)
            seed = self.consumers[rid].seed
            packed = (
                RunnerOutput(rid, images=(_image(rid, seed),), timings={"postprocess_ms": 1.0})
                if ok
                else RunnerOutput(rid, error="pack failed", error_type="FaultInjectedError")
            )
            note(f"output {key} arrives ok={ok}")
            self.apply(self.core.output_ready(rid, key, packed, self.now))

        @precondition(lambda self: self.claimed)
        @rule(data=st.data(), group_lost=st.booleans())
        def output_is_lost(self, data: st.DataObject, group_lost: bool) -> None:
            key = data.draw(st.sampled_from(sorted(self.claimed)), label="claimed key")
            rid = self.claimed.pop(key)
            note(f"output {key} lost (group_lost={group_lost})")
            self.apply(
                self.core.output_lost(
                    rid, key, "gone", "EngineDeadError", self.now, group_lost=group_lost
                )
            )

        @precondition(lambda self: self.released)
        @rule(data=st.data())
        def late_arrival(self, data: st.DataObject) -> None:
            """An output that was dropped arrives after all: the pump would release it; if
            it reaches the core it must change nothing."""
            key = data.draw(st.sampled_from(sorted(self.released)), label="released key")
            rid = key.partition("/")[2]
            note(f"late arrival of {key}")
            instructions = self.core.output_ready(
                rid, key, RunnerOutput(rid, images=(_image(rid, None, "late"),)), self.now
            )
            assert instructions == [], f"a dropped output changed something: {instructions}"

        @rule(dt=st.sampled_from([0.1, 0.5, 1.5]))
        def time_passes(self, dt: float) -> None:
            self.advance(dt)
            note(f"now = {self.now:.2f}")
            instructions = self.core.expire(self.now)
            for ins in instructions:
                if isinstance(ins, DropOutput):
                    assert self.claimed.get(ins.key) == ins.request_id
            self.apply(instructions)
            deadline = self.core.next_deadline()
            assert deadline is None or deadline > self.now, "a deadline passed unexpired"

        # -- rules: aborts and consumers -------------------------------------------------

        @rule(rid=ids)
        def abort(self, rid: str) -> None:
            status = self.core.status_of(rid)
            note(f"abort {rid} ({status.name if status else 'not live'})")
            self.apply(self.core.abort([rid], self.now))
            if status is _S.RUNNING:
                assert rid in self.stopped, "an aborted forward was not told to stop (INV-7)"
            assert not self.core.is_live(rid)

        @rule(rid=ids)
        def consumer_leaves(self, rid: str) -> None:
            consumer = self.consumers.get(rid)
            if consumer is None or not consumer.reading or consumer.closed:
                return
            note(f"consumer of {rid} leaves")
            consumer.reading = False
            self.apply(self.core.consumer_gone(rid, self.now))
            assert not self.core.is_live(rid)

        @precondition(lambda self: step_mode and self.dispatch is None)
        @rule(rid=ids)
        def preempt(self, rid: str) -> None:
            running = self.core.status_of(rid) is _S.RUNNING
            note(f"preempt {rid} (running={running})")
            assert self.core.preempt(rid, self.now) is running

        # -- rules: the worker group -----------------------------------------------------

        @precondition(lambda self: self.core.group is GroupState.RUNNING)
        @rule(rank=st.sampled_from([None, 0, 1]))
        def group_fails(self, rank: int | None) -> None:
            note("the worker group fails")
            self.dispatch = None  # its results are not trusted
            before = {rid: self._retries(rid) for rid in self.consumers if self.core.is_live(rid)}
            self.apply(self.core.group_failed("died", "WorkerError", self.now, rank=rank))
            # The pump failed with the group: nothing may still be awaited from it.
            assert not self.claimed, f"outputs {sorted(self.claimed)} awaited from a dead group"
            for rid, retries in before.items():
                if self.core.is_live(rid):
                    assert self._retries(rid) <= opts.max_retries, rid
                    assert retries <= self._retries(rid)
            assert not self.core.health().healthy

        def _retries(self, rid: str) -> int:
            state = self.core.scheduler.get_request_state(rid)
            return state.num_retries if state is not None else 0

        @precondition(lambda self: self.core.group is GroupState.RESTARTING)
        @rule()
        def group_restarts(self) -> None:
            note("a new worker group starts")
            self.core.group_restarting()
            self.core.group_started(_INFO, self.now)
            self.steps_done = dict.fromkeys(self.steps_done, 0)
            assert self.core.health().healthy

        # -- rules: the end --------------------------------------------------------------

        @precondition(lambda self: not self.ended)
        @rule()
        def close(self) -> None:
            note("close")
            self.dispatch = None
            self.apply(self.core.close(self.now))
            self.ended = True
            self._check(closed=True)

        @precondition(lambda self: not self.ended)
        @rule()
        def die(self) -> None:
            note("die")
            self.dispatch = None
            self.apply(self.core.die(RuntimeError("supervisor gave up"), self.now))
            self.ended = True
            self._check(closed=True)

        # -- checks ----------------------------------------------------------------------

        def _check(self, *, closed: bool | None = None) -> None:
            events = self.trace.events
            violations = check_trace(events, closed=closed, abort_latency_s=0.0)
            violations += check_leftovers(
                self.core.leftovers(), events, in_flight=self.core.in_flight_ids()
            )
            violations = [v for v in violations if v.request_id not in self.strays]
            if violations:
                raise InvariantViolation(violations)

        @invariant()
        def no_violation(self) -> None:
            self._check()

        @invariant()
        def awaited_outputs_belong_to_live_packing_requests(self) -> None:
            for key, rid in self.claimed.items():
                assert self.core.status_of(rid) is _S.PACKING, (
                    f"output {key} is awaited for {rid!r}, which is not PACKING (INV-3)"
                )
            assert set(self.core.awaited_outputs()) == set(self.claimed)

        @invariant()
        def consumers_see_one_story(self) -> None:
            for consumer in self.consumers.values():
                finals = [o for o in consumer.outputs if o.finished]
                assert len(finals) <= 1, consumer.request_id
                if finals:
                    assert consumer.outputs[-1] is finals[0], "output after the terminal one"
                    final = finals[0]
                    if final.ok:
                        assert final.images and final.images[0][1] == consumer.request_id
                        assert final.images[0][0] == "final"
                if not self.core.is_live(consumer.request_id) and consumer.reading:
                    # Ended while its consumer read: it got its terminal output.
                    assert finals, f"{consumer.request_id} ended without a terminal output"

        @invariant()
        def health_follows_the_group(self) -> None:
            health = self.core.health()
            assert health.healthy == (self.core.group is GroupState.RUNNING and not self.ended)

        def teardown(self) -> None:
            if not self.ended:
                self.close()

    CoreMachine.__name__ = CoreMachine.__qualname__ = f"CoreMachine_{opts.mode}"
    return CoreMachine
