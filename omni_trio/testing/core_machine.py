"""A Hypothesis state machine over the pure engine core: the whole lifecycle in milliseconds.

:func:`make_core_machine` builds a ``RuleBasedStateMachine`` that plays the engine shell, the
executor, the result pump and every consumer around one :class:`EngineCore`, with a rule for
every event the core takes: admit (fresh and reused ids), schedule, a forward's result (ok,
announced output, error, aborted, missing, stray results for unscheduled ids), an execution
error, an output arriving, failing or being lost, a late arrival for something dropped,
time passing past output and request deadlines, abort, consumer drop, step-boundary
preemption (asked for, or the "priority" policy's own), group
failure and restart, a late answer to a forward that was written off, close and death (each
followed by a fresh core, so an example goes on).  Time is a number it advances; nothing
sleeps.

After every rule it checks

* INV-1..7 on the core's own trace (:func:`check_trace`, with ``abort_latency_s=0``: the core
  ends an aborted request in the same event), plus what the consumers received (identity,
  seed, chunk order: every output is recorded as ``RECEIVED``);
* what the core holds against its trace (:func:`check_leftovers`);
* the instructions' bookkeeping, the core's side of INV-3 and INV-7: every output a result
  announces is awaited or dropped at once; every awaited output belongs to a live PACKING
  request; nothing is delivered to a consumer that left or to a closed stream; an abort of a
  running request stops its forward; no request is retried past its budget; no PACKING
  request outlives its deadline once time has passed it; a worker group is never asked to
  go on with step state it does not hold (a cached id needs state the *current* group got);
  a written-off forward's late answer changes nothing but to drop what it announced; no
  request outlives its ``deadline_s`` once time has passed it, and one that ends by it ends
  ``FINISHED_ABORTED`` with ``RequestTimeoutError``; a request preempted for priority keeps
  its progress.

Requests get random priorities and deadlines; ``CoreMachineOptions.scheduling_policy`` picks
the policy the core schedules with.

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
from .._core.health import EngineState, GroupState, SleepState
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
    scheduling_policy: str = "fifo"  # "fifo", "priority" or "fair"
    max_preempted_states: int = 1  # "priority", step mode: past it a preemption drops state


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
            self.counter = 0
            self.cores = 0
            self._fresh()

        def _fresh(self) -> None:
            """A new core (and a new fake world around it): after close or death the
            example goes on with the next engine."""
            self.trace = TraceRecorder()
            self.core = EngineCore(
                CoreConfig(
                    step_execution=step_mode,
                    max_num_seqs=opts.max_num_seqs,
                    streaming_output=step_mode and opts.streaming_output,
                    max_retries_on_worker_failure=opts.max_retries,
                    fault_injection=False,
                    output_timeout_s=_OUTPUT_TIMEOUT_S,
                    scheduling_policy=opts.scheduling_policy,
                    priority_aging_ticks=8,
                    max_preempted_states=opts.max_preempted_states,
                ),
                trace=self.trace,
                seed=7 + self.cores,
            )
            self.cores += 1
            self.now = 0.0
            self.dispatch: SchedulerOutput | None = None
            # Forwards the core wrote off (group failure, close) whose answer may still come.
            self.stale: list[SchedulerOutput] = []
            # The fake pump: claimed output key -> owner; keys released.
            self.claimed: dict[str, str] = {}
            self.released: set[str] = set()
            self.consumers: dict[str, _Consumer] = {}
            self.stopped: set[str] = set()  # ids whose forward was told to stop
            # The current group's step state: request id -> steps it has run.
            self.worker_holds: dict[str, int] = {}
            self.strays: set[str] = set()  # ids of the stray results the fake executor sent
            # Live incarnations with a deadline_s: request id -> (absolute deadline, state).
            self.deadlines: dict[str, tuple[float, Any]] = {}
            self.sleep_asked = 1  # the level of the sleep under way
            self.core.group_started(_INFO, self.now)

        @property
        def ended(self) -> bool:
            return not self.core.accepting

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

        @precondition(lambda self: not self.ended)
        @rule(
            target=ids,
            data=st.data(),
            steps=st.integers(1, 3),
            seed=st.one_of(st.none(), st.integers(0, 5)),
            size=st.sampled_from([None, 32, 64]),
            dt=st.sampled_from([0.0, 0.0, 0.1]),
            then_run=st.integers(0, 3),
            priority=st.sampled_from([0, 1, 2, -1, -2]),
            deadline=st.sampled_from([None, None, None, 0.3, 1.0]),
        )
        def admit(
            self,
            data: st.DataObject,
            steps: int,
            seed: int | None,
            size: int | None,
            dt: float,
            then_run: int,
            priority: int,
            deadline: float | None,
        ) -> str:
            """Admit a request, and maybe let the loop turn a few times right away."""
            self.advance(dt)
            self.counter += 1
            rid = self._admit(f"r{self.counter}", steps, seed, size, priority, deadline)
            if then_run and self.dispatch is None and self.core.has_work():
                self.run_ticks(data, then_run)
            return rid

        def _admit(
            self,
            rid: str,
            steps: int,
            seed: int | None,
            size: int | None,
            priority: int = 0,
            deadline: float | None = None,
        ) -> str:
            params = SamplingParams(
                num_inference_steps=steps,
                seed=seed,
                height=size,
                width=size,
                priority=priority,
                deadline_s=deadline,
            )
            request = self.core.build_request(DiffusionRequest("p", params, rid))
            admitted = self.core.admit(request, self.now)
            note(
                f"admit {rid} steps={steps} seed={admitted.sampling.seed} "
                f"priority={priority} deadline={deadline}"
            )
            self.deadlines.pop(rid, None)
            if deadline is not None:
                state = self.core.scheduler.get_request_state(rid)
                self.deadlines[rid] = (self.now + deadline, state)
            if seed is not None:
                assert admitted.sampling.seed == seed, "an explicit seed was replaced"
            assert (admitted.sampling.height, admitted.sampling.width) == (
                size or _INFO.default_height,
                size or _INFO.default_width,
            )
            self.consumers[rid] = _Consumer(
                rid, admitted.sampling.seed, total_steps=admitted.sampling.total_steps
            )
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

        @precondition(
            lambda self: (
                opts.scheduling_policy == "priority"
                and not self.ended
                and self.dispatch is None
                and self.core.scheduler.num_running > 0
            )
        )
        @rule(target=ids, steps=st.integers(1, 3), other_shape=st.booleans())
        def urgent_arrival(self, steps: int, other_shape: bool) -> str:
            """A request better than anything running arrives and the loop turns once: in
            step mode it preempts a running one at this boundary (progress kept, or past the
            state budget dropped), and the preempted request later resumes or restarts."""
            running = set(self.core.scheduler.running_request_ids())
            first = self.core.scheduler.get_request_state(next(iter(running)))
            assert first is not None
            height = first.request.sampling.height
            size = (32 if height != 32 else 64) if other_shape else height
            self.counter += 1
            rid = self._admit(f"r{self.counter}", steps, None, size, priority=-5)
            progress = {
                r: s.num_computed_steps
                for r in running
                if (s := self.core.scheduler.get_request_state(r)) is not None
            }
            self.schedule(0.0)
            for r in running:
                state = self.core.scheduler.get_request_state(r)
                if state is not None and state.status is _S.PREEMPTED and state.sent_to_worker:
                    assert state.num_computed_steps == progress[r], (
                        f"{r} lost its progress when preempted"
                    )
            return rid

        # -- rules: execution ------------------------------------------------------------

        @precondition(lambda self: self.dispatch is None and self.core.has_work())
        @rule(dt=st.sampled_from([0.0, 0.05]))
        def schedule(self, dt: float) -> None:
            self.advance(dt)
            out = self.core.schedule(self.now, worker=0)
            note(f"schedule -> {out.scheduled_request_ids if out else None}")
            if out is None:
                return
            if self.core.sleep_state is not SleepState.AWAKE:
                # A sleep is a control call between waves: nothing starts meanwhile (INV-4).
                assert not out.scheduled_new_reqs, (
                    f"{[n.request_id for n in out.scheduled_new_reqs]} started while the "
                    f"engine was {self.core.sleep_state.value}"
                )
            for rid in out.scheduled_request_ids:
                assert self.core.status_of(rid) is _S.RUNNING
                self.stopped.discard(rid)
            if step_mode:
                for rid in out.finished_req_ids:  # the worker evicts them first
                    self.worker_holds.pop(rid, None)
                for new in out.scheduled_new_reqs:
                    self.worker_holds[new.request_id] = 0
                for rid in out.scheduled_cached_reqs:
                    assert rid in self.worker_holds, (
                        f"{rid!r} scheduled as a cached id, but the current worker group holds "
                        "no step state for it"
                    )
            self.dispatch = out

        @precondition(lambda self: self.dispatch is None and self.core.has_work())
        @rule(data=st.data(), ticks=st.integers(1, 4))
        def run_ticks(self, data: st.DataObject, ticks: int) -> None:
            """The common path, a few loop turns at once: schedule, and the forward answers."""
            for _ in range(ticks):
                if self.dispatch is not None or not self.core.has_work():
                    return
                self.schedule(0.0)
                if self.dispatch is not None:
                    self.forward_returns(data, 0.05)

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
                    done = min(self.worker_holds.get(rid, 0) + 1, total)
                    self.worker_holds[rid] = done
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
                    st.sampled_from(
                        ["ok", "async", "async", "error", "aborted", "missing", "failed_announcing"]
                    ),
                    label=f"outcome of {rid}",
                )
                if kind == "ok":
                    return RunnerOutput(rid, images=(_image(rid, seed),))
                if kind == "async":
                    return RunnerOutput(rid, async_output_id=f"b{step_id}/{rid}")
                if kind == "failed_announcing":  # an odd executor: an error *and* an output id
                    return RunnerOutput(
                        rid, async_output_id=f"b{step_id}/{rid}", error="boom", error_type="E"
                    )
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
            for rid, (at, state) in list(self.deadlines.items()):
                if self.core.scheduler.get_request_state(rid) is not state:
                    del self.deadlines[rid]  # ended (and popped), or a new incarnation
                    continue
                assert at > self.now or not self.core.is_live(rid), (
                    f"{rid} outlived its deadline ({at:.2f} <= now {self.now:.2f})"
                )
            timed_out = [
                i
                for i in instructions
                if isinstance(i, DeliverTerminal) and i.output.error_type == "RequestTimeoutError"
            ]
            for ins in timed_out:
                assert ins.output.status is _S.FINISHED_ABORTED, ins.output

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

        @precondition(lambda self: self.stale)
        @rule(data=st.data())
        def late_answer(self, data: st.DataObject) -> None:
            """The forward a failure or a close wrote off answers after all: only what it
            announces is dropped; nothing is applied or delivered."""
            out = self.stale.pop(data.draw(st.integers(0, len(self.stale) - 1), label="stale"))
            results = {
                rid: RunnerOutput(rid, async_output_id=f"late{out.step_id}/{rid}")
                if data.draw(st.booleans(), label=f"late {rid} announced")
                else RunnerOutput(rid, images=(_image(rid, None, "late"),))
                for rid in out.scheduled_request_ids
            }
            note(f"late answer to forward {out.step_id}")
            instructions = self.core.runner_output(out, BatchRunnerOutput(results), self.now)
            announced = {r.async_output_id for r in results.values() if r.async_output_id}
            assert {i.key for i in instructions if isinstance(i, DropOutput)} == announced
            assert all(isinstance(i, DropOutput) for i in instructions), instructions
            self.apply(instructions)

        def _write_off(self) -> None:
            if self.dispatch is not None:
                self.stale.append(self.dispatch)
                self.dispatch = None

        @precondition(lambda self: self.core.group is GroupState.RUNNING)
        @rule(rank=st.sampled_from([None, 0, 1]), now=st.integers(0, 2))
        def group_fails(self, rank: int | None, now: int) -> None:
            if now:  # one time in three
                return
            note("the worker group fails")
            self._write_off()  # its results are not trusted
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
            self.core.group_started(_INFO, self.now)
            self.worker_holds = {}  # the new group holds no step state
            # (The shell puts a new group of a sleeping engine to sleep again.)
            assert self.core.health().healthy == (self.core.sleep_state is SleepState.AWAKE)

        # -- rules: sleep and wake ------------------------------------------------------

        @precondition(
            lambda self: (
                not self.ended and self.core.sleep_state in (SleepState.AWAKE, SleepState.ASLEEP)
            )
        )
        @rule(level=st.sampled_from([1, 2]))
        def begin_sleep(self, level: int) -> None:
            """The operator asks for sleep: from now on no waiting request starts."""
            note(f"begin_sleep({level})")
            self.core.begin_sleep(level, self.now)
            self.sleep_asked = level

        @precondition(
            lambda self: (
                self.core.sleep_state is SleepState.FALLING_ASLEEP and not self.core.busy_ids()
            )
        )
        @rule(ok=st.booleans())
        def workers_fall_asleep(self, ok: bool) -> None:
            """Nothing runs or packs: the workers release their weights (or one fails)."""
            note(f"fell_asleep ok={ok}")
            if ok:
                self.core.fell_asleep(self.sleep_asked, self.now)
            else:
                self.core.sleep_failed(self.now, "WorkerError: could not release")

        @precondition(lambda self: self.core.sleep_state is SleepState.FALLING_ASLEEP)
        @rule()
        def sleep_times_out(self) -> None:
            note("sleep_failed (timeout)")
            self.core.sleep_failed(self.now, "StallError: still running")

        @precondition(lambda self: self.core.sleep_state is SleepState.ASLEEP)
        @rule(ok=st.booleans())
        def wake(self, ok: bool) -> None:
            note(f"wake ok={ok}")
            assert self.core.begin_wake(self.now)
            if ok:
                self.core.woke(self.now)
            else:
                self.core.wake_failed(self.now, "OSError: weights gone")
                assert self.core.sleep_state is SleepState.ASLEEP

        @invariant()
        def health_says_sleeping(self) -> None:
            """Falling asleep, asleep or waking, a running group is reported sleeping (never
            healthy)."""
            if self.ended or self.core.group is not GroupState.RUNNING:
                return
            sleeping = self.core.sleep_state is not SleepState.AWAKE
            assert (self.core.health().state is EngineState.SLEEPING) == sleeping

        # -- rules: the end -----------------------------------------------------------

        @precondition(lambda self: not self.ended)
        @rule(die=st.booleans(), now=st.integers(0, 3))
        def end_and_reopen(self, die: bool, now: int) -> None:
            """Close the engine (or it dies): every live request ends, the whole trace must
            be clean; a late answer may still come.  Then the next engine.  Drawn to happen
            one time in four, so an engine usually lives long enough to do something."""
            if now:
                return
            note("die" if die else "close")
            self._write_off()
            if die:
                self.apply(self.core.die(RuntimeError("supervisor gave up"), self.now))
            else:
                self.apply(self.core.close(self.now))
            for out in self.stale:  # answered late: changes nothing
                late = BatchRunnerOutput(
                    {rid: RunnerOutput(rid, images=("late",)) for rid in out.scheduled_request_ids}
                )
                assert self.core.runner_output(out, late, self.now) == []
            self._check(closed=True)
            with_error = EngineDeadError if die else EngineClosedError
            try:
                self.core.admit(DiffusionRequest("p", SamplingParams(), "after"), self.now)
            except with_error:
                pass
            else:
                raise AssertionError("admitted after the end")
            self._fresh()

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
            awake = self.core.sleep_state is SleepState.AWAKE
            assert health.healthy == (
                self.core.group is GroupState.RUNNING and not self.ended and awake
            )

        def teardown(self) -> None:
            self.apply(self.core.close(self.now))
            self._check(closed=True)

    CoreMachine.__name__ = CoreMachine.__qualname__ = f"CoreMachine_{opts.mode}"
    return CoreMachine
