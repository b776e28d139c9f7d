"""Hypothesis state machines that drive a real engine and check its lifecycle invariants.

:func:`make_engine_machine` builds a ``RuleBasedStateMachine`` for one backend and mode.
Each example opens a real engine on ``builtin:echo`` (whose images name their request and
seed) and applies rules -- submit (random steps, seed and an optional fault), abort, drop a
consumer, let time pass, crash a worker, RPC, wait for everything, close and reopen --
checking after every rule the invariant checker over the trace and
:func:`~omni_trio.testing.check_leftovers` over what every engine-side component holds (no
violation may ever appear, even mid-flight; ``wait_for_everything`` lets the engine settle
and then checks the workers' state too), and, when an engine closes, its whole trace plus a
small reference model of what each request must have ended as:

* a request with no fault, not aborted, not dropped, not caught by a close and not exposed
  to a fault (another request's fault or a crash while it was live) completes;
* a request whose own fault fires (raise, fail packing, crash, hang) does not complete;
* nothing of the engine is left after close (threads, shared memory, worker processes).

:func:`run_engine_machine` runs one machine as a test (inside :func:`run_driven`, so the
engine lives in a real trio loop in the calling thread) and returns campaign counters.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import hypothesis.strategies as st
from hypothesis import note
from hypothesis import settings as Settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from .._core.lifecycle import RequestStatus
from .._core.messages import DiffusionOutput
from .._core.request import MAX_SEED, SamplingParams
from .._core.trace import TraceEvent, TraceKind, TraceRecorder
from ..config import EngineConfig
from ..errors import OmniTrioError
from .driver import EngineDriver, leftover_resources, run_driven
from .faults import Fault, FaultSpec, with_faults
from .invariants import InvariantViolation, Violation, check_leftovers, check_trace

__all__ = [
    "BENIGN_FAULTS",
    "FAILING_FAULTS",
    "EDGE_SEEDS",
    "CampaignStats",
    "MachineOptions",
    "backend_unavailable",
    "engine_config_for",
    "identity_violations",
    "make_engine_machine",
    "run_engine_machine",
]

log = logging.getLogger(__name__)
_K = TraceKind

# Faults after which the request must not complete (when they fire), and faults that only
# slow it down.
FAILING_FAULTS = (
    Fault.RAISE_AT_STEP,
    Fault.FAIL_PACKING,
    Fault.CRASH_AT_STEP,
    Fault.SIGKILL_AT_STEP,
    Fault.HANG_AT_STEP,
    Fault.KILL_PACKER,
    Fault.POISON_DEVICE,
)
BENIGN_FAULTS = (Fault.SLOW_PACKING, Fault.DELAY_COMPUTE_DONE, Fault.DELAY_OUTPUT_READY)
_STEP_FAULTS = frozenset(
    {
        Fault.RAISE_AT_STEP,
        Fault.CRASH_AT_STEP,
        Fault.SIGKILL_AT_STEP,
        Fault.HANG_AT_STEP,
        Fault.POISON_DEVICE,
    }
)
# Faults that fire only where request-mode outputs go through the async output packer.
_PACKER_FAULTS = frozenset({Fault.KILL_PACKER})


@dataclass(frozen=True)
class MachineOptions:
    """What a campaign fuzzes: backend, mode, batch size and which faults to inject."""

    backend: str = "inproc"
    mode: str = "request"  # "request" or "step"
    max_num_seqs: int = 2
    # tractor, ray: data-parallel ranks (each runs different requests).
    data_parallel_size: int = 1
    # The engine's scheduling policy; under "priority" each request draws a priority in
    # -3..3 (so better arrivals pass waiting ones and, in step mode, may preempt running ones).
    scheduling_policy: str = "fifo"
    # Requests may start from a picture (image-to-image, inpainting; echo carries it and does
    # not look at it), some over the shared-memory threshold, so that every lifecycle rule
    # runs with pictures on the wire too.
    pictures: bool = False
    step_delay_s: float = 0.005
    faults: tuple[Fault, ...] = FAILING_FAULTS + BENIGN_FAULTS
    crash_rule: bool = True
    close_rule: bool = True
    cache_dir: str | None = None
    # tractor: how worker processes start ("trio" or "forkserver", see EngineConfig).
    worker_start_method: str = "trio"
    # Every consumer must be done this long after its engine closed (INV-6).
    settle_timeout_s: float = 60.0

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["faults"] = [f.value for f in self.faults]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MachineOptions:
        data = dict(data)
        data["faults"] = tuple(Fault(f) for f in data.get("faults", ()))
        return cls(**data)


def backend_unavailable(backend: str) -> str | None:
    """Why ``backend`` cannot run here (its optional extra is missing), or None."""
    if backend != "ray":
        return None
    from ..errors import InvalidConfigError
    from ..executors.ray_executor import import_ray

    try:
        import_ray()
    except InvalidConfigError as exc:
        return str(exc)
    return None


def engine_config_for(options: MachineOptions) -> EngineConfig:
    """The engine configuration a machine runs: echo, fault injection on, quick restarts,
    a short stall deadline (so a hang is caught in about a second)."""
    step = options.mode == "step"
    return EngineConfig(
        model="builtin:echo",
        model_options={"step_delay_s": options.step_delay_s},
        backend=options.backend,
        worker_start_method=options.worker_start_method,
        cache_dir=options.cache_dir,
        torch_threads=1,
        step_execution=step,
        streaming_output=step,
        max_num_seqs=options.max_num_seqs,
        data_parallel_size=options.data_parallel_size,
        scheduling_policy=options.scheduling_policy,
        warmup=False,
        fault_injection=True,
        max_worker_restarts=10_000,
        worker_restart_backoff_s=0.01,
        worker_restart_backoff_max_s=0.05,
        max_retries_on_worker_failure=1,
        worker_stall_timeout_s=1.0,
        worker_heartbeat_timeout_s=10.0,
        close_timeout_s=5.0,
    )


@dataclass
class CampaignStats:
    """Counters of a campaign (updated as it runs; read them from another thread)."""

    examples: int = 0
    rules: int = 0
    requests: int = 0
    faults_injected: int = 0
    crashes: int = 0
    restarts: int = 0
    # Step-boundary preemptions (scheduling_policy "priority"), from each engine's trace.
    preemptions: int = 0
    # Requests that started from a picture (MachineOptions.pictures).
    pictures: int = 0
    invariant_checks: int = 0
    engines: int = 0
    started_at: float = field(default_factory=time.monotonic)
    last_trace: list[TraceEvent] = field(default_factory=list)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started_at

    def rate(self, count: int) -> float:
        return count / max(self.elapsed_s, 1e-9)


@dataclass
class _Submitted:
    request_id: str
    steps: int
    fault: FaultSpec | None
    # What it asked for, as the reference model knows it (not as the engine reports it).
    seed: int = 0
    outputs: int = 1
    # How many of its consumer's outputs the identity oracle has compared so far.
    checked: int = 0


# Seeds every campaign draws often besides random ones: the edges of the range (0 is the one
# a falsy check mistakes for "no seed") and a few small ones that repeat across requests.
EDGE_SEEDS = (0, 1, 2, MAX_SEED)


def identity_violations(
    request_id: str,
    seed: int,
    outputs_per_prompt: int,
    outputs: Sequence[DiffusionOutput],
    history: Sequence[TraceEvent] = (),
) -> list[Violation]:
    """The identity oracle (INV-5): every output a request's consumer received carries that
    request's own images, drawn from the seed *it asked for* (not the one the engine
    reports), image k the k-th of its ``outputs_per_prompt``; every output that reports a
    seed (an aborted or failed one too) reports that one; a completed terminal output has
    all of its images.  ``builtin:echo`` writes request id, generator seed
    and index into each image, so a swapped, mis-seeded, mis-ordered or stale result is seen
    whatever the trace says."""
    from ..models.echo import decode_echo_image

    found: list[Violation] = []

    def bad(message: str) -> None:
        found.append(Violation("INV-5", f"{request_id}: {message}", request_id, tuple(history)))

    for output in outputs:
        where = f"output {output.chunk_index + 1}/{output.total_chunks}"
        completed = output.finished and output.status is RequestStatus.FINISHED_COMPLETED
        if output.seed is not None and output.seed != seed:  # any chunk that says one
            bad(f"{where} ({output.status.name}) reports seed {output.seed}; it asked for {seed}")
        if completed:
            if output.seed is None:
                bad(f"the terminal output reports no seed; it asked for {seed}")
            if len(output.images) != outputs_per_prompt:
                bad(f"{len(output.images)} images delivered; it asked for {outputs_per_prompt}")
        for index, image in enumerate(output.images):
            try:
                owner, drawn, position = decode_echo_image(image)
            except Exception:  # a preview that is not an echo image (latents): nothing to read
                if completed:
                    bad(f"{where}: image {index} is not the echo image of any request")
                continue
            if owner != request_id:
                bad(f"{where}: image {index} is the image of request {owner!r}")
            if drawn != seed:
                bad(f"{where}: image {index} was drawn from seed {drawn}; it asked for {seed}")
            if position != index:
                bad(f"{where}: image {index} is output {position} of its request")
    return found


def _fault_fires(spec: FaultSpec | None, steps: int, mode: str = "request") -> bool:
    """Whether ``spec`` (on a request of ``steps`` steps, in ``mode``) makes it fail."""
    if spec is None or spec.kind not in FAILING_FAULTS:
        return False
    if spec.kind in _PACKER_FAULTS and mode != "request":
        return False
    if spec.kind in _STEP_FAULTS:
        return spec.step is not None and spec.step < steps
    return True


# What a submitted request starts from (MachineOptions.pictures): noise, a small picture, one
# over the shared-memory threshold (640 x 640 x 3 bytes), a small picture and a mask.
PICTURES = ("none", "small", "large", "inpaint")


def _picture_fields(picture: str, seed: int, steps: int) -> dict[str, Any]:
    """``image``/``mask_image``/``strength`` for ``picture``; strength halves the steps when
    there are at least two (so the cut schedule is exercised), else keeps the one."""
    if picture == "none":
        return {}
    import numpy as np

    side = 640 if picture == "large" else 40
    fields: dict[str, Any] = {
        "image": np.full((side, side, 3), seed % 256, dtype=np.uint8),
        "strength": 0.5 if steps >= 2 else 1.0,
    }
    if picture == "inpaint":
        fields["mask_image"] = np.full((side, side), 255, dtype=np.uint8)
    return fields


def make_engine_machine(
    options: MachineOptions, driver_ref: Callable[[], EngineDriver], stats: CampaignStats
) -> type[RuleBasedStateMachine]:
    """A state machine class for ``options``; ``driver_ref()`` gives the running driver."""
    config = engine_config_for(options)
    fault_kinds = tuple(sorted(options.faults, key=lambda f: f.value))
    fault_strategy = st.sampled_from(fault_kinds) if fault_kinds else st.nothing()
    prioritised = options.scheduling_policy == "priority"

    class EngineMachine(RuleBasedStateMachine):
        requests = Bundle("requests")
        description: ClassVar[str] = f"{options.backend}/{options.mode}"

        def __init__(self) -> None:
            super().__init__()
            self.driver = driver_ref()
            self.submitted: dict[str, _Submitted] = {}
            # Trace positions (index in the current recorder) where a fault was injected.
            self.fault_marks: list[int] = []
            self.asleep = False  # the engine was put to sleep and not woken yet
            self._open_engine()
            stats.examples += 1

        # -- engine lifecycle ------------------------------------------------------------

        def _open_engine(self) -> None:
            self.driver.trace = TraceRecorder()
            self.driver.consumers.clear()
            self.submitted.clear()
            self.fault_marks.clear()
            self.asleep = False
            self.driver.open(config)
            stats.engines += 1

        def _close_engine_and_check(self) -> None:
            driver = self.driver
            driver.close()
            trace = driver.trace
            last = trace.events[-1].time if len(trace) else 0.0
            trace.record(last, _K.CLOSED, detail={"leftovers": leftover_resources()})
            events = trace.events
            stats.last_trace = events
            stats.restarts += sum(1 for e in events if e.kind is _K.RESTART)
            stats.preemptions += sum(1 for e in events if e.kind is _K.PREEMPT)
            stats.invariant_checks += 1
            violations = check_trace(events, closed=True) + self._identity_violations(events)
            if violations:
                raise InvariantViolation(violations)
            self._check_outcomes(events)

        def _check_outcomes(self, events: list[TraceEvent]) -> None:
            """The reference model: what each request must have ended as."""
            first: dict[tuple[str, TraceKind], int] = {}
            terminal_status: dict[str, str] = {}
            for index, event in enumerate(events):
                if event.request_id is not None:
                    first.setdefault((event.request_id, event.kind), index)
                    if event.kind is _K.TERMINAL:
                        terminal_status[event.request_id] = str(event.detail.get("status"))
                elif event.kind is _K.CLOSE:
                    first.setdefault(("", _K.CLOSE), index)
            close_at = first.get(("", _K.CLOSE), len(events))
            crashes = [i for i, event in enumerate(events) if event.kind is _K.CRASH]
            for rid, sub in self.submitted.items():
                admit = first.get((rid, _K.ADMIT))
                end = first.get((rid, _K.TERMINAL))
                assert admit is not None and end is not None, f"{rid}: no admit/terminal"
                status = terminal_status[rid]
                stopped = min(
                    first.get((rid, _K.ABORT), len(events)),
                    first.get((rid, _K.CONSUMER_DROP), len(events)),
                    close_at,
                )
                if stopped < end:
                    continue  # aborted, dropped or closed while live: any terminal status
                if _fault_fires(sub.fault, sub.steps, options.mode):
                    assert status != "FINISHED_COMPLETED", (
                        f"{rid}: its fault {sub.fault} fired but it completed"
                    )
                    continue
                # Exposed: a failing fault was submitted while it lived (it may share its
                # batch), or its worker group failed while it lived (a neighbour's crash
                # retried it, perhaps beside the same neighbour again: retries run out).
                exposed = any(admit <= mark <= end for mark in self.fault_marks) or any(
                    admit <= at <= end for at in crashes
                )
                if not exposed:
                    assert status == "FINISHED_COMPLETED", (
                        f"{rid}: no fault, no abort, no crash while it ran, yet it ended {status}"
                    )

        # -- rules -------------------------------------------------------------------------

        @precondition(lambda self: self.driver.is_open)
        @rule(
            target=requests,
            steps=st.integers(1, 4),
            seed=st.one_of(st.sampled_from(EDGE_SEEDS), st.integers(0, MAX_SEED)),
            fault=st.one_of(st.none(), st.none(), fault_strategy),
            fault_step=st.integers(0, 3),
            delay=st.sampled_from([0.0, 0.02, 0.1]),
            # Drawn only under "priority" (st.just draws nothing: other campaigns' examples
            # and reproducers are unchanged).
            priority=st.integers(-3, 3) if prioritised else st.just(0),
            picture=st.sampled_from(PICTURES) if options.pictures else st.just("none"),
        )
        def submit(
            self,
            steps: int,
            seed: int,
            fault: Fault | None,
            fault_step: int,
            delay: float,
            priority: int,
            picture: str,
        ) -> str:
            params = SamplingParams(
                num_inference_steps=steps,
                seed=seed,
                height=32,
                width=32,
                priority=priority,
                **_picture_fields(picture, seed, steps),
            )
            steps = params.total_steps
            spec: FaultSpec | None = None
            if fault is not None:
                if fault in _STEP_FAULTS:
                    spec = FaultSpec(fault, step=fault_step)
                elif fault in BENIGN_FAULTS:
                    spec = FaultSpec(fault, delay_s=delay)
                else:
                    spec = FaultSpec(fault)
                params = with_faults(params, spec)
            mark = len(self.driver.trace)
            try:
                rid = self.driver.submit("fuzz", params)
            except OmniTrioError as exc:  # dead engine: acceptable only if it says so
                assert self.driver.engine is not None and self.driver.engine.is_dead, exc
                return "none"
            if spec is not None:
                stats.faults_injected += 1
                if spec.kind in FAILING_FAULTS:
                    self.fault_marks.append(mark)
            self.submitted[rid] = _Submitted(rid, steps, spec, seed=seed)
            stats.requests += 1
            if picture != "none":
                stats.pictures += 1
            stats.rules += 1
            return rid

        @precondition(lambda self: self.driver.is_open)
        @rule(rid=requests)
        def abort(self, rid: str) -> None:
            self.driver.abort(rid)
            stats.rules += 1

        @precondition(lambda self: self.driver.is_open)
        @rule(rid=requests)
        def drop_consumer(self, rid: str) -> None:
            self.driver.drop(rid)
            stats.rules += 1

        @precondition(lambda self: self.driver.is_open)
        @rule(seconds=st.sampled_from([0.0, 0.01, 0.05, 0.2]))
        def let_time_pass(self, seconds: float) -> None:
            self.driver.sleep(seconds)
            stats.rules += 1

        @precondition(lambda self: self.driver.is_open and options.crash_rule)
        @rule()
        def crash_worker(self) -> None:
            self.fault_marks.append(len(self.driver.trace))
            self.driver.crash_worker()
            stats.crashes += 1
            stats.faults_injected += 1
            stats.rules += 1

        @precondition(lambda self: self.driver.is_open)
        @rule()
        def rpc(self) -> None:
            try:
                reply = self.driver.rpc("ping", timeout=10.0)
            except OmniTrioError:
                pass  # the group failed under it, or the engine died: a typed error is fine
            else:
                assert isinstance(reply, dict), reply
            stats.rules += 1

        @precondition(lambda self: self.driver.is_open and not self.asleep)
        @rule(level=st.sampled_from([1, 2]))
        def sleep(self, level: int) -> None:
            """Put the workers to sleep (weights released) between waves: requests
            submitted meanwhile wait; the ones running finish first (or the sleep fails,
            typed, and the engine stays awake)."""
            self.asleep = self.driver.sleep_engine(level)
            note(f"sleep({level}) -> {'asleep' if self.asleep else 'failed'}")
            stats.rules += 1

        @precondition(lambda self: self.driver.is_open and self.asleep)
        @rule()
        def wake_up(self) -> None:
            """Give the weights back: every waiting request runs, with its own image."""
            self.driver.wake_engine()
            self.asleep = False
            stats.rules += 1

        @precondition(lambda self: self.driver.is_open)
        @rule()
        def wait_for_everything(self) -> None:
            """Every consumer is done, the engine settles, and then nothing anywhere (core,
            streams, pump, runner and step state, stop flags, packer) holds a request."""
            driver = self.driver
            if self.asleep:  # nothing waiting would ever finish
                self.wake_up()
            assert driver.wait_finished(timeout=options.settle_timeout_s), (
                "requests did not finish within the settle timeout (INV-6)"
            )
            held = driver.settle(timeout=options.settle_timeout_s)
            assert held is not None, "the engine did not settle within the timeout (INV-6)"
            events = driver.call(lambda: driver.trace.events)
            stats.invariant_checks += 1
            violations = check_leftovers(held, events, settled=True)
            if violations:
                stats.last_trace = events
                raise InvariantViolation(violations)
            stats.rules += 1

        @precondition(lambda self: self.driver.is_open and options.close_rule)
        @rule()
        def close_and_reopen(self) -> None:
            self._close_engine_and_check()
            self._open_engine()
            stats.rules += 1

        @invariant()
        def no_violation_so_far(self) -> None:
            """The trace so far, and what every component holds now, break no invariant."""
            driver = self.driver
            if not driver.is_open:
                return
            stats.invariant_checks += 1
            engine = driver.engine
            assert engine is not None
            events, held, flying = driver.call(
                lambda: (driver.trace.events, engine.leftovers(), engine.core.in_flight_ids())
            )
            violations = check_trace(events) + check_leftovers(held, events, in_flight=flying)
            violations += self._identity_violations(events)
            if violations:
                stats.last_trace = events
                raise InvariantViolation(violations)

        def _identity_violations(self, events: list[TraceEvent]) -> list[Violation]:
            """The identity oracle over what each consumer received since the last check."""
            driver = self.driver
            received = driver.call(
                lambda: {rid: list(rec.outputs) for rid, rec in driver.consumers.items()}
            )
            found: list[Violation] = []
            for rid, sub in self.submitted.items():
                outputs = received.get(rid, [])
                if len(outputs) <= sub.checked:
                    continue
                new, sub.checked = outputs[sub.checked :], len(outputs)
                history = [e for e in events if e.request_id == rid]
                found += identity_violations(rid, sub.seed, sub.outputs, new, history)
            return found

        def teardown(self) -> None:
            if self.driver.is_open:
                self._close_engine_and_check()

    EngineMachine.__name__ = EngineMachine.__qualname__ = (
        f"EngineMachine_{options.backend}_{options.mode}"
    )
    return EngineMachine


def run_engine_machine(
    options: MachineOptions,
    settings: Settings,
    *,
    stats: CampaignStats | None = None,
) -> CampaignStats:
    """Run the machine for ``options`` under ``settings`` as a test; raise on the first
    failure (Hypothesis shrinks it first).  Returns the campaign counters."""
    stats = stats if stats is not None else CampaignStats()
    if options.cache_dir is None:
        options = dataclasses.replace(options, cache_dir=tempfile.gettempdir() + "/omni-trio-fuzz")

    def scenario(driver: EngineDriver) -> None:
        machine = make_engine_machine(options, lambda: driver, stats)
        run_state_machine_as_test(machine, settings=settings)

    run_driven(scenario)
    return stats
