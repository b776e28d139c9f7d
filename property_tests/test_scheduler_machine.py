"""Stateful property tests of the pure schedulers against a tiny reference model.

Each machine drives one scheduler the way the engine loop does (add, schedule, deliver the
runner output of the in-flight schedule, abort, preempt, pop) and compares every answer and,
after every step, the whole lifecycle with a list-based reference model:

* each live request is in exactly one place: the waiting queue, the running set or (compute
  done, output still packing) the packing set, in order;
* no more than ``capacity`` run, and everything running shares one compatibility key;
* each terminal request is reported in ``finished_req_ids`` exactly once, in the next schedule;
* no finished request is ever scheduled again;
* statuses, times, errors and step progress match the model.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, ClassVar

import hypothesis.strategies as st
from hypothesis import note
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from omni_trio._core.lifecycle import RequestState, RequestStatus
from omni_trio._core.messages import BatchRunnerOutput, RunnerOutput, SchedulerOutput
from omni_trio._core.request import DiffusionRequest, SamplingParams
from omni_trio._core.scheduler import (
    MISSING_OUTPUT_ERROR,
    MISSING_STEP_INDEX_ERROR,
    NO_RESULT_ERROR,
    RequestScheduler,
    Scheduler,
    StepScheduler,
)
from omni_trio.errors import DuplicateRequestError

S = RequestStatus


@dataclass(frozen=True)
class Spec:
    """The knobs of a generated request that matter to scheduling."""

    height: int
    guidance: float
    steps: int
    use_timesteps: bool

    def build(self, rid: str) -> DiffusionRequest:
        if self.use_timesteps:
            sampling = SamplingParams(
                height=self.height,
                width=64,
                guidance_scale=self.guidance,
                num_inference_steps=20,
                timesteps=tuple(float(999 - i) for i in range(self.steps)),
            )
        else:
            sampling = SamplingParams(
                height=self.height,
                width=64,
                guidance_scale=self.guidance,
                num_inference_steps=self.steps,
            )
        return DiffusionRequest(f"prompt {rid}", sampling, request_id=rid)


# Half the requests share one spec, so waves of compatible requests are common; the rest vary
# every field that the compatibility keys look at.
SPECS = st.one_of(
    st.just(Spec(height=64, guidance=7.5, steps=2, use_timesteps=False)),
    st.builds(
        Spec,
        height=st.sampled_from([64, 128]),
        guidance=st.sampled_from([7.5, 1.0]),
        steps=st.integers(1, 3),
        use_timesteps=st.booleans(),
    ),
)


# Time passing before an action (seconds); windows are 20-50 ms, waits 100-250 ms.
DELAYS = st.sampled_from([0.0, 0.01, 0.02, 0.05, 0.1, 1.0])


@dataclass
class Ref:
    """The model's view of one request incarnation."""

    spec: Spec
    key: tuple[Any, ...]
    incarnation: int
    state: RequestState  # the scheduler's object for this incarnation (identity is checked)
    queued_at: float
    status: RequestStatus = S.WAITING
    first_scheduled_at: float | None = None
    finished_at: float | None = None
    error: str | None = None
    error_type: str | None = None
    progress: int = 0
    sent: bool = False
    preemptions: int = 0


class SchedulerMachine(RuleBasedStateMachine):
    """Rules shared by both modes; subclasses say how runner outputs look and are judged."""

    mode: ClassVar[str] = "base"
    ids = Bundle("ids")
    popped = Bundle("popped")

    def __init__(self) -> None:
        super().__init__()
        self.sched: Scheduler
        self.capacity = 1
        self.wait_ms = 0.0
        self.now = 0.0
        self.model: dict[str, Ref] = {}
        self.queue: list[str] = []
        self.running: list[str] = []
        self.packing: list[str] = []
        self.pending_finished: set[str] = set()
        self.inflight: SchedulerOutput | None = None
        self.gone: set[str] = set()  # popped and not re-added
        self.counter = 0
        self.incarnations: collections.Counter[str] = collections.Counter()
        self.terminal: set[tuple[str, int]] = set()
        self.unreported: set[tuple[str, int]] = set()
        self.reports: collections.Counter[tuple[str, int]] = collections.Counter()
        self.steps_scheduled = 0
        self.last_growth_at = 0.0

    # -- mode hooks -------------------------------------------------------------------------

    def make_scheduler(self, capacity: int, wait_ms: float) -> Scheduler:
        raise NotImplementedError

    def model_key(self, spec: Spec) -> tuple[Any, ...]:
        raise NotImplementedError

    def runner_output(self, rid: str, data: st.DataObject) -> RunnerOutput | None:
        """Draw this tick's output for running ``rid`` and apply it to the model.

        Returns the output (None: missing); finishing is recorded with :meth:`model_finish`.
        """
        raise NotImplementedError

    def progress_reset(self, rid: str) -> None:
        """``rid`` was preempted with ``reset_progress=True`` (its progress may drop to 0)."""

    # -- model helpers ----------------------------------------------------------------------

    def live(self) -> list[str]:
        return self.packing + self.running + self.queue

    def model_packing(self, rid: str) -> None:
        """Compute done, output announced: out of the batch, not terminal."""
        self.model[rid].status = S.PACKING
        self.running.remove(rid)
        self.packing.append(rid)

    def model_finish(
        self, rid: str, status: RequestStatus, error: str | None, error_type: str | None
    ) -> None:
        ref = self.model[rid]
        ref.status = status
        ref.finished_at = self.now
        ref.error, ref.error_type = error, error_type
        for place in (self.running, self.queue, self.packing):
            if rid in place:
                place.remove(rid)
        self.pending_finished.add(rid)
        self.terminal.add((rid, ref.incarnation))
        self.unreported.add((rid, ref.incarnation))

    def model_admit(self) -> tuple[list[str], list[str]]:
        new: list[str] = []
        cached: list[str] = list(self.running) if self.mode == "step" else []
        if self.mode == "request" and self.running:
            return new, cached
        while len(self.running) < self.capacity and self.queue:
            head = self.model[self.queue[0]]
            if self.running and head.key != self.model[self.running[0]].key:
                break
            rid = self.queue.pop(0)
            self.running.append(rid)
            head.status = S.RUNNING
            if head.first_scheduled_at is None:
                head.first_scheduled_at = self.now
            if self.mode == "step" and head.sent:
                cached.append(rid)
            else:
                new.append(rid)
                head.sent = True
        return new, cached

    def _add(self, rid: str, spec: Spec) -> None:
        state = self.sched.add_request(spec.build(rid), self.now)
        self.incarnations[rid] += 1
        self.model[rid] = Ref(
            spec=spec,
            key=self.model_key(spec),
            incarnation=self.incarnations[rid],
            state=state,
            queued_at=self.now,
        )
        self.queue.append(rid)
        self.gone.discard(rid)
        self.last_growth_at = self.now

    # -- rules ------------------------------------------------------------------------------

    @initialize(capacity=st.integers(1, 3), wait_ms=st.sampled_from([0.0, 100.0, 250.0]))
    def init(self, capacity: int, wait_ms: float) -> None:
        note(f"{self.mode} scheduler, capacity={capacity}, wait_ms={wait_ms} (request mode only)")
        self.capacity = capacity
        self.wait_ms = wait_ms
        self.sched = self.make_scheduler(capacity, wait_ms)

    def advance(self, dt: float) -> None:
        if dt:
            self.now += dt
            note(f"now = {self.now:.3f}")

    @rule(target=ids, specs=st.lists(SPECS, min_size=1, max_size=3), dt=DELAYS)
    def add(self, specs: list[Spec], dt: float) -> Any:
        self.advance(dt)
        rids = []
        for spec in specs:
            self.counter += 1
            rid = f"r{self.counter}"
            note(f"add {rid} {spec}")
            self._add(rid, spec)
            rids.append(rid)
        return multiple(*rids)

    @rule(target=ids, rid=consumes(popped), spec=SPECS)
    def readd(self, rid: str, spec: Spec) -> str:
        note(f"re-add popped id {rid} {spec}")
        assert rid not in self.model
        self._add(rid, spec)
        return rid

    @precondition(lambda self: self.model)
    @rule(data=st.data(), spec=SPECS)
    def add_duplicate(self, data: st.DataObject, spec: Spec) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model)), label="duplicate id")
        note(f"add duplicate {rid} (model status {self.model[rid].status.name})")
        try:
            self.sched.add_request(spec.build(rid), self.now)
        except DuplicateRequestError as exc:
            assert exc.request_id == rid
        else:
            raise AssertionError(f"duplicate {rid} was admitted")

    def has_work(self) -> bool:
        return bool(self.queue or self.running or self.pending_finished)

    # Engine discipline, as in the busy loop: one execute in flight; its result is applied
    # before the next schedule.  Aborts, preemptions, adds and pops may come in between.
    @precondition(lambda self: self.inflight is not None or self.has_work())
    @rule(data=st.data(), dt=DELAYS)
    def tick(self, data: st.DataObject, dt: float) -> None:
        """One engine loop iteration: apply the in-flight result (if any), then schedule."""
        self.advance(dt)
        if self.inflight is not None:
            self.deliver(data)
        if self.has_work():
            self.schedule()

    def schedule(self) -> None:
        in_flight = self.inflight is not None
        out = self.sched.schedule(self.now)
        self.steps_scheduled += 1
        new, cached = self.model_admit()
        note(
            f"schedule -> new={[r.request_id for r in out.scheduled_new_reqs]} "
            f"cached={list(out.scheduled_cached_reqs)} finished={sorted(out.finished_req_ids)}"
        )
        assert out.step_id == self.steps_scheduled
        assert [r.request_id for r in out.scheduled_new_reqs] == new
        for data in out.scheduled_new_reqs:
            assert data.request is self.model[data.request_id].state.request
        assert list(out.scheduled_cached_reqs) == cached
        assert out.finished_req_ids == self.pending_finished
        assert out.num_running_reqs == len(self.running)
        assert out.num_waiting_reqs == len(self.queue)
        for rid in out.scheduled_request_ids:
            ref = self.model[rid]
            assert (rid, ref.incarnation) not in self.terminal, f"finished {rid} scheduled again"
        for item in [i for i in self.unreported if i[0] in out.finished_req_ids]:
            self.reports[item] += 1
            self.unreported.discard(item)
        assert not self.unreported
        self.pending_finished.clear()
        if in_flight:
            assert out.is_empty, "request mode admitted a wave while one was in flight"
        elif not out.is_empty:
            self.inflight = out

    def deliver(self, data: st.DataObject) -> None:
        out = self.inflight
        assert out is not None
        self.inflight = None
        outputs: list[RunnerOutput] = []
        expected: list[str] = []
        for rid in out.scheduled_request_ids:
            if rid in self.running:
                output = self.runner_output(rid, data)
                if output is not None:
                    outputs.append(output)
                if self.model[rid].status.finished:
                    expected.append(rid)
            elif data.draw(st.booleans(), label=f"late result for {rid}"):
                # Aborted, errored or preempted meanwhile: a late result must be ignored.
                outputs.append(RunnerOutput(rid, images=("late",), step_index=99, finished=True))
        stray = [r for r in self.queue if r not in out.scheduled_request_ids]
        if stray and data.draw(st.booleans(), label="stray result"):
            rid = data.draw(st.sampled_from(sorted(stray)), label="stray id")
            outputs.append(RunnerOutput(rid, images=("stray",), step_index=99, finished=True))
        note(f"deliver {outputs} -> expect finished {expected}")
        got = self.sched.update_from_output(out, BatchRunnerOutput.from_list(outputs), self.now)
        assert got == expected

    def _finish(self, rids: list[str], status: RequestStatus) -> None:
        error, error_type = (None, None) if status is S.FINISHED_ABORTED else ("killed", "Kill")
        expected = [
            r for r in dict.fromkeys(rids) if r in self.model and not self.model[r].status.finished
        ]
        note(f"finish_requests({rids}, {status.name}) -> expect {expected}")
        got = self.sched.finish_requests(rids, status, self.now, error=error, error_type=error_type)
        assert got == expected
        for rid in expected:
            if status is S.FINISHED_ABORTED:
                self.model_finish(rid, status, f"Request {rid} aborted.", "RequestAbortedError")
            else:
                self.model_finish(rid, status, "killed", "Kill")

    @precondition(lambda self: self.queue)
    @rule(data=st.data(), status=st.sampled_from([S.FINISHED_ABORTED, S.FINISHED_ERROR]))
    def abort_waiting(self, data: st.DataObject, status: RequestStatus) -> None:
        self._finish([data.draw(st.sampled_from(sorted(self.queue)), label="waiting id")], status)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), status=st.sampled_from([S.FINISHED_ABORTED, S.FINISHED_ERROR]))
    def abort_running(self, data: st.DataObject, status: RequestStatus) -> None:
        self._finish([data.draw(st.sampled_from(sorted(self.running)), label="running id")], status)

    @precondition(lambda self: self.packing)
    @rule(data=st.data())
    def abort_packing(self, data: st.DataObject) -> None:
        self._finish(
            [data.draw(st.sampled_from(sorted(self.packing)), label="packing id")],
            S.FINISHED_ABORTED,
        )

    @precondition(lambda self: self.counter > 0)  # the ids bundle is never empty after an add
    @rule(rids=st.lists(st.one_of(ids, st.just("ghost")), min_size=1, max_size=3))
    def abort_any(self, rids: list[str]) -> None:
        # Ids may be live, finished, popped or never seen: only live ones finish.
        self._finish(rids, S.FINISHED_ABORTED)

    @precondition(lambda self: self.packing)
    @rule(data=st.data(), outcome=st.sampled_from(["ready", "failed", "lost"]))
    def settle_packing(self, data: st.DataObject, outcome: str) -> None:
        """A PACKING request's output arrives, fails to pack, or is lost with its group
        (then it runs again from the start, at the front of the queue)."""
        rid = data.draw(st.sampled_from(sorted(self.packing)), label="packing id")
        ref = self.model[rid]
        note(f"output of {rid}: {outcome}")
        if outcome == "lost":
            assert self.sched.preempt_request(rid) is True
            self.packing.remove(rid)
            self.queue.insert(0, rid)
            ref.status = S.PREEMPTED
            ref.preemptions += 1
            ref.progress = 0
            ref.sent = False
            return
        if outcome == "ready":
            got = self.sched.finish_requests(rid, S.FINISHED_COMPLETED, self.now)
            self.model_finish(rid, S.FINISHED_COMPLETED, None, None)
        else:
            got = self.sched.finish_requests(
                rid, S.FINISHED_ERROR, self.now, error="pack", error_type="PackError"
            )
            self.model_finish(rid, S.FINISHED_ERROR, "pack", "PackError")
        assert got == [rid]

    @precondition(lambda self: self.running)
    @rule(data=st.data(), reset=st.booleans())
    def preempt_running(self, data: st.DataObject, reset: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)), label="running id")
        note(f"preempt {rid} reset_progress={reset}")
        assert self.sched.preempt_request(rid, reset_progress=reset) is True
        ref = self.model[rid]
        self.running.remove(rid)
        self.queue.insert(0, rid)
        ref.status = S.PREEMPTED
        ref.preemptions += 1
        if reset:
            ref.progress = 0
            ref.sent = False
            self.progress_reset(rid)

    @precondition(lambda self: self.counter > 0)
    @rule(rid=ids)
    def preempt_not_running(self, rid: str) -> None:
        if rid in self.running or rid in self.packing:
            return
        note(f"preempt {rid} (not running) -> False")
        assert self.sched.preempt_request(rid) is False

    @precondition(lambda self: any(r.status.finished for r in self.model.values()))
    @rule(target=popped, data=st.data())
    def pop_finished(self, data: st.DataObject) -> str:
        done = sorted(rid for rid, ref in self.model.items() if ref.status.finished)
        rid = data.draw(st.sampled_from(done), label="finished id")
        note(f"pop {rid}")
        state = self.sched.pop_request_state(rid)
        ref = self.model.pop(rid)
        assert state is ref.state
        assert state.status is ref.status
        self.gone.add(rid)
        return rid

    @precondition(lambda self: self.running or self.queue or self.packing)
    @rule(data=st.data())
    def pop_live(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live())), label="live id")
        note(f"pop live {rid} -> ValueError")
        try:
            self.sched.pop_request_state(rid)
        except ValueError:
            pass
        else:
            raise AssertionError(f"live request {rid} was popped")

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def each_live_request_is_in_exactly_one_place(self) -> None:
        assert list(self.sched.running_request_ids()) == self.running
        assert list(self.sched.packing_request_ids()) == self.packing
        assert self.sched.live_request_ids() == self.packing + self.running + self.queue
        assert len(set(self.live())) == len(self.live())
        assert self.sched.num_running == len(self.running)
        assert self.sched.num_packing == len(self.packing)
        assert self.sched.num_waiting == len(self.queue)
        assert self.sched.has_unfinished_requests() == bool(self.running or self.queue)

    @invariant()
    def running_fits_capacity(self) -> None:
        assert self.sched.num_running <= self.capacity

    @invariant()
    def running_wave_is_compatible(self) -> None:
        keys = set()
        for rid in self.sched.running_request_ids():
            state = self.sched.get_request_state(rid)
            assert state is not None
            keys.add(self.sched._key_fn(state.request))
        assert len(keys) <= 1
        assert len({self.model[r].key for r in self.running}) <= 1

    @invariant()
    def finished_ids_are_reported_exactly_once(self) -> None:
        assert self.sched.has_finished_to_report() == bool(self.pending_finished)
        assert all(count <= 1 for count in self.reports.values())
        for item in self.terminal:
            assert self.reports[item] == (0 if item in self.unreported else 1), item

    @invariant()
    def states_match_the_model(self) -> None:
        for rid, ref in self.model.items():
            state = self.sched.get_request_state(rid)
            assert state is ref.state, rid
            assert state.status is ref.status, (rid, state.status, ref.status)
            assert state.queued_at == ref.queued_at
            assert state.first_scheduled_at == ref.first_scheduled_at
            assert state.finished_at == ref.finished_at
            assert (state.error, state.error_type) == (ref.error, ref.error_type), rid
            assert state.num_preemptions == ref.preemptions
        for rid in self.gone:
            assert self.sched.get_request_state(rid) is None
        done = sorted(rid for rid, ref in self.model.items() if ref.status.finished)
        assert sorted(self.sched.pending_finished_request_ids()) == done


class RequestSchedulerMachine(SchedulerMachine):
    mode = "request"

    def make_scheduler(self, capacity: int, wait_ms: float) -> Scheduler:
        return RequestScheduler(capacity, wait_ms)

    def model_key(self, spec: Spec) -> tuple[Any, ...]:
        return (spec.height, spec.guidance, spec.steps, spec.use_timesteps)

    @precondition(lambda self: self.inflight is not None and self.running)
    @rule()
    def schedule_while_in_flight(self) -> None:
        """The loop may look again while a wave runs: nothing new is admitted."""
        self.schedule()

    @precondition(lambda self: self.queue)
    @rule(dt=DELAYS)
    def check_admission_wait(self, dt: float) -> None:
        self.advance(dt)
        result = self.sched.admission_wait(self.now)
        note(f"admission_wait({self.now:.3f}) -> {result}")
        max_wait_s = self.wait_ms / 1000
        window = min(0.05, max_wait_s / 5)
        must_not_wait = (
            max_wait_s == 0
            or self.capacity == 1
            or bool(self.running)
            or not self.queue
            or len(self.queue) >= self.capacity
            or self.now >= self.last_growth_at + window
        )
        if must_not_wait:
            assert result is None
        if result is not None:
            assert self.now < result <= self.now + max_wait_s
            assert result <= self.last_growth_at + window

    def runner_output(self, rid: str, data: st.DataObject) -> RunnerOutput | None:
        kind = data.draw(
            st.sampled_from(["ok", "ok", "async", "error", "missing", "aborted", "empty"]),
            label=f"outcome of {rid}",
        )
        if kind == "ok":
            self.model_finish(rid, S.FINISHED_COMPLETED, None, None)
            return RunnerOutput(rid, images=(f"image {rid}",))
        if kind == "async":
            self.model_packing(rid)
            return RunnerOutput(rid, async_output_id=f"b/{rid}")
        if kind == "error":
            self.model_finish(rid, S.FINISHED_ERROR, f"boom {rid}", "RuntimeError")
            return RunnerOutput(rid, error=f"boom {rid}", error_type="RuntimeError")
        if kind == "aborted":
            self.model_finish(
                rid, S.FINISHED_ABORTED, f"Request {rid} aborted.", "RequestAbortedError"
            )
            return RunnerOutput(rid, aborted=True)
        if kind == "empty":
            self.model_finish(rid, S.FINISHED_ERROR, NO_RESULT_ERROR, "MissingOutputError")
            return RunnerOutput(rid)
        self.model_finish(rid, S.FINISHED_ERROR, MISSING_OUTPUT_ERROR, "MissingOutputError")
        return None


class StepSchedulerMachine(SchedulerMachine):
    """Step mode, plus the continuous-batching rules: progress only grows (unless a preemption
    resets it), a finished request's progress is frozen, and requests join the running batch
    only when a tick is scheduled, every running request being in that tick."""

    mode = "step"

    def __init__(self) -> None:
        super().__init__()
        # Highest progress seen per incarnation; lowered only by preempt(reset_progress=True).
        self.high_water: dict[tuple[str, int], int] = {}
        # Progress of each terminal incarnation when it finished.
        self.frozen: dict[tuple[str, int], int] = {}
        # Ids of the last scheduled tick.
        self.last_tick: set[str] = set()

    def make_scheduler(self, capacity: int, wait_ms: float) -> Scheduler:
        return StepScheduler(capacity)

    def schedule(self) -> None:
        super().schedule()
        tick = set(self.inflight.scheduled_request_ids) if self.inflight is not None else set()
        # Every running request takes part in the tick: one step each, nobody left out.
        assert tick == set(self.sched.running_request_ids())
        self.last_tick = tick

    def progress_reset(self, rid: str) -> None:
        self.high_water[(rid, self.model[rid].incarnation)] = 0

    @invariant()
    def step_progress_never_goes_backwards(self) -> None:
        for rid, ref in self.model.items():
            state = self.sched.get_request_state(rid)
            assert state is not None
            key = (rid, ref.incarnation)
            assert state.num_computed_steps >= self.high_water.get(key, 0), rid
            self.high_water[key] = state.num_computed_steps

    @invariant()
    def a_finished_request_never_advances(self) -> None:
        for rid, ref in self.model.items():
            if not ref.status.finished:
                continue
            state = self.sched.get_request_state(rid)
            assert state is not None
            frozen = self.frozen.setdefault((rid, ref.incarnation), state.num_computed_steps)
            assert state.num_computed_steps == frozen, rid

    @invariant()
    def requests_join_only_at_tick_boundaries(self) -> None:
        # Nothing starts running between ticks: whatever runs was in the last tick (a request
        # may leave between ticks, by abort or preemption, and is then simply absent).
        assert set(self.sched.running_request_ids()) <= self.last_tick

    def model_key(self, spec: Spec) -> tuple[Any, ...]:
        return (spec.height, spec.guidance)

    def runner_output(self, rid: str, data: st.DataObject) -> RunnerOutput | None:
        ref = self.model[rid]
        kind = data.draw(
            st.sampled_from(["step", "step", "step", "error", "missing", "aborted", "no_index"]),
            label=f"outcome of {rid}",
        )
        if kind == "step":
            ref.progress = min(ref.progress + 1, ref.spec.steps)
            # After the last step the runner may need one more tick (decode) to finish; only
            # its ``finished`` flag completes the request.
            finished = ref.progress >= ref.spec.steps and data.draw(
                st.booleans(), label=f"{rid} decoded"
            )
            if finished:
                self.model_finish(rid, S.FINISHED_COMPLETED, None, None)
            images = (f"image {rid}",) if finished else None
            return RunnerOutput(rid, images=images, step_index=ref.progress, finished=finished)
        if kind == "error":
            self.model_finish(rid, S.FINISHED_ERROR, f"boom {rid}", "RuntimeError")
            return RunnerOutput(rid, error=f"boom {rid}", error_type="RuntimeError")
        if kind == "aborted":
            self.model_finish(
                rid, S.FINISHED_ABORTED, f"Request {rid} aborted.", "RequestAbortedError"
            )
            return RunnerOutput(rid, aborted=True, step_index=ref.progress)
        if kind == "no_index":
            self.model_finish(rid, S.FINISHED_ERROR, MISSING_STEP_INDEX_ERROR, "MissingOutputError")
            return RunnerOutput(rid, images=("x",), finished=True)
        self.model_finish(rid, S.FINISHED_ERROR, MISSING_OUTPUT_ERROR, "MissingOutputError")
        return None

    @invariant()
    def progress_matches_the_model(self) -> None:
        for rid, ref in self.model.items():
            state = self.sched.get_request_state(rid)
            assert state is not None
            assert state.total_steps == ref.spec.steps
            assert state.num_computed_steps == ref.progress, rid
            assert state.sent_to_worker == ref.sent, rid


TestRequestScheduler = RequestSchedulerMachine.TestCase
TestStepScheduler = StepSchedulerMachine.TestCase
