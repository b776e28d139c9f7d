"""The engine state machine's configuration and reference model, and the machine on the Ray
backend (which needs this suite's local Ray; the inproc and tractor machines run in
property_tests/test_engine_machine.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from omni_trio.testing.faults import Fault, FaultSpec
from omni_trio.testing.machine import (
    BENIGN_FAULTS,
    FAILING_FAULTS,
    CampaignStats,
    MachineOptions,
    _fault_fires,
    engine_config_for,
    run_engine_machine,
)

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)


def test_the_machine_engine_allows_faults_restarts_quickly_and_catches_hangs() -> None:
    config = engine_config_for(MachineOptions(backend="tractor", mode="step"))
    assert config.fault_injection and config.backend == "tractor"
    assert config.step_execution and config.streaming_output
    assert config.worker_stall_timeout_s is not None and config.worker_stall_timeout_s <= 2
    assert config.max_worker_restarts >= 1000 and config.max_retries_on_worker_failure == 1
    assert not engine_config_for(MachineOptions(mode="request")).step_execution


@pytest.mark.parametrize(
    ("spec", "steps", "fires"),
    [
        (None, 3, False),
        (FaultSpec(Fault.RAISE_AT_STEP, step=2), 3, True),
        (FaultSpec(Fault.RAISE_AT_STEP, step=3), 3, False),  # past the last step
        (FaultSpec(Fault.CRASH_AT_STEP, step=0), 1, True),
        (FaultSpec(Fault.HANG_AT_STEP, step=1), 1, False),
        (FaultSpec(Fault.FAIL_PACKING), 1, True),
        (FaultSpec(Fault.SLOW_PACKING, delay_s=0.1), 4, False),
        (FaultSpec(Fault.KILL_PACKER), 1, True),
        (FaultSpec(Fault.POISON_DEVICE, step=1), 2, True),
        (FaultSpec(Fault.POISON_DEVICE, step=2), 2, False),
    ],
)
def test_which_faults_must_make_a_request_fail(
    spec: FaultSpec | None, steps: int, fires: bool
) -> None:
    assert _fault_fires(spec, steps) is fires


def test_a_packer_fault_does_not_fire_in_step_mode() -> None:
    spec = FaultSpec(Fault.KILL_PACKER)
    assert _fault_fires(spec, 2, "request") and not _fault_fires(spec, 2, "step")


def test_fault_sets_cover_every_request_fault() -> None:
    request_faults = set(Fault) - {Fault.FAIL_WARMUP}
    assert set(FAILING_FAULTS) | set(BENIGN_FAULTS) == request_faults
    assert not set(FAILING_FAULTS) & set(BENIGN_FAULTS)


def test_options_round_trip_through_a_dict() -> None:
    options = MachineOptions(
        backend="tractor", mode="step", max_num_seqs=3, faults=(Fault.RAISE_AT_STEP,)
    )
    assert MachineOptions.from_dict(options.to_dict()) == options


# (examples, steps per example): a Ray example starts actors (about 2 s per engine start or
# restart on 2 vCPUs), so make test runs a small budget; HYPOTHESIS_PROFILE=long more.
_RAY_BUDGETS = {"long": (20, 30)}
_RAY_DEFAULT_BUDGET = (2, 8)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["request", "step"])
def test_ray_engine_keeps_its_invariants(mode: str, ray_cluster: Any, cache_dir: Path) -> None:
    examples, steps = _RAY_BUDGETS.get(
        os.environ.get("HYPOTHESIS_PROFILE", ""), _RAY_DEFAULT_BUDGET
    )
    budget = settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    options = MachineOptions(backend="ray", mode=mode, cache_dir=str(cache_dir))
    stats = run_engine_machine(options, budget)
    assert stats.examples >= 1 and stats.rules >= 1 and stats.engines >= 1
    assert stats.invariant_checks >= stats.examples


# -- the identity oracle ------------------------------------------------------------------------


def _echo_output(
    rid: str,
    drawn: int,
    *,
    images: list[tuple[str, int, int]] | None = None,
    reported: Any = ...,  # the seed the output reports (default: the one drawn)
) -> Any:
    """A completed output whose images are echo images of ``(request id, seed, index)``."""
    import numpy as np

    from omni_trio._core.lifecycle import RequestStatus
    from omni_trio._core.messages import DiffusionOutput
    from omni_trio.models.echo import encode_echo_header

    pictures = []
    for owner, seed, index in images if images is not None else [(rid, drawn, 0)]:
        values = np.zeros((32, 32, 3), np.float32)
        encode_echo_header(values, owner, seed, index)
        pictures.append(values)
    seed = drawn if reported is ... else reported
    return DiffusionOutput(rid, RequestStatus.FINISHED_COMPLETED, images=tuple(pictures), seed=seed)


@pytest.mark.parametrize(
    ("output", "message"),
    [
        (_echo_output("a", 0, images=[("b", 0, 0)]), "is the image of request 'b'"),
        (_echo_output("a", 0, images=[("a", 7, 0)]), "drawn from seed 7; it asked for 0"),
        (_echo_output("a", 0, reported=7), "reports seed 7; it asked for 0"),
        (_echo_output("a", 0, reported=None), "reports no seed"),
        (_echo_output("a", 0, images=[("a", 0, 1), ("a", 0, 0)]), "is output 1 of its request"),
        (_echo_output("a", 0, images=[]), "0 images delivered; it asked for 1"),
    ],
)
def test_the_identity_oracle_reads_each_image_against_what_was_asked(
    output: Any, message: str
) -> None:
    from omni_trio.testing.machine import identity_violations

    assert identity_violations("a", 0, 1, [_echo_output("a", 0)]) == []
    found = identity_violations(
        "a", 0, 1 if message != "is output 1 of its request" else 2, [output]
    )
    assert found and all(v.invariant == "INV-5" for v in found)
    assert any(message in v.message for v in found), [v.message for v in found]


def test_the_machine_catches_an_explicit_seed_0_replaced_at_admission(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    """A planted bug the trace-only checker missed (the trace records the replaced seed):
    admission treats seed 0 as "no seed".  The identity oracle compares with the seed the
    machine asked for."""
    from hypothesis import Phase

    from omni_trio._core import engine_core
    from omni_trio.testing.invariants import InvariantViolation

    real = engine_core._resolve_defaults

    def falsy_seed(request: Any, *args: Any) -> Any:  # the mutant
        if request.sampling.seed == 0:
            request = request.replace(sampling=request.sampling.replace(seed=None))
        return real(request, *args)

    monkeypatch.setattr(engine_core, "_resolve_defaults", falsy_seed)
    options = MachineOptions(
        backend="inproc", cache_dir=str(cache_dir), faults=(), crash_rule=False, close_rule=False
    )
    budget = settings(
        max_examples=40,
        stateful_step_count=10,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],  # found, not shrunk: bounded
        suppress_health_check=list(HealthCheck),
    )
    stats = CampaignStats()
    with pytest.raises(InvariantViolation, match="it asked for 0"):
        run_engine_machine(options, budget, stats=stats)
    assert stats.requests, stats


def test_path_hits_reads_the_hard_paths_off_a_trace() -> None:
    from omni_trio._core.trace import TraceKind as K
    from omni_trio._core.trace import TraceRecorder
    from omni_trio.testing.machine import PATHS, path_hits

    rec = TraceRecorder()
    now = iter(range(1, 100))

    def ev(kind: K, rid: str | None = None, step: int | None = None, **detail: Any) -> None:
        rec.record(float(next(now)), kind, rid, step_id=step, detail=detail)

    ev(K.ADMIT, "a", steps=2)
    ev(K.ADMIT, "b", steps=2)
    ev(K.ADMIT, "c", steps=3)  # another step count while a and b live
    ev(K.EXEC_START, "a", 1)
    ev(K.EXEC_START, "b", 1)  # a fused wave of two
    ev(K.ABORT, "a", reason="api")  # mid-forward, in the fused wave
    ev(K.EXEC_RESULT, "b", 1, outcome="pending")
    ev(K.ABORT, "b", reason="api")  # mid-packing
    ev(K.CRASH)  # while b's output is packed (and a's forward has not answered)
    ev(K.ABORT, "a", reason="api")  # after the crash: its forward is gone, not mid-forward
    ev(K.REQUEUE, "c", retry=1)
    ev(K.CLOSE)  # c still queued
    hits = path_hits(rec.events)
    assert set(hits) == set(PATHS)
    assert hits["fused_wave"] == 1 and hits["mixed_steps"] == 1
    assert hits["abort_mid_forward"] == 1 and hits["abort_in_fused_wave"] == 1
    assert hits["abort_mid_packing"] == 1
    assert hits["crash_mid_forward"] == 1 and hits["crash_while_packing"] == 1
    assert hits["requeue"] == 1 and hits["close_with_queued"] == 1
    assert hits["preemption"] == 0
    assert path_hits([]) == dict.fromkeys(PATHS, 0)


def test_liveness_bounds_come_from_the_fault_plan() -> None:
    from omni_trio.testing.machine import liveness_bounds

    bound, restart, queue = liveness_bounds(MachineOptions())
    stall = engine_config_for(MachineOptions()).worker_stall_timeout_s
    assert stall is not None and bound > 2 * stall  # a hang is caught by the stall first
    assert restart > bound and queue > restart
    slow, _, _ = liveness_bounds(MachineOptions(step_delay_s=0.05))
    assert slow > bound  # slower steps, longer bounds
    _, forked, _ = liveness_bounds(
        MachineOptions(backend="tractor", worker_start_method="forkserver")
    )
    _, spawned, _ = liveness_bounds(MachineOptions(backend="tractor"))
    assert forked < spawned


@pytest.mark.parametrize(
    ("mutant", "oracle", "faults"),
    [
        ("fused-survivors-by-position", "is the image of request", ()),  # identity
        ("abort-sets-no-stop-flag", "more denoising steps after the abort", ()),  # promptness
        ("consumer-drop-leaks-stream", "engine_streams", ()),  # leftovers
        ("heartbeat-resets-stall-clock", "without progress", (Fault.HANG_AT_STEP,)),  # liveness
        ("deadline-never-fires", "deadline_s=", ()),  # deadlines
        ("idle-loop-ignores-rpc", "RPC got no answer", ()),  # RPC answers
    ],
)
def test_each_oracle_finds_its_class_of_planted_bug(
    mutant: str, oracle: str, faults: tuple[Fault, ...], cache_dir: Path
) -> None:
    """A short campaign against one shipped mutant per oracle ends in an InvariantViolation
    from that oracle (found, not shrunk: bounded; only the faults the bug needs, no crash or
    close rule, so a fixed seed reaches it in a few examples)."""
    from hypothesis import Phase
    from hypothesis.errors import FlakyFailure

    from omni_trio.testing.invariants import InvariantViolation
    from omni_trio.testing.mutants import applied, find_mutant

    planted = find_mutant(mutant)
    options = MachineOptions(
        cache_dir=str(cache_dir),
        faults=faults,
        crash_rule=False,
        close_rule=False,
        **dict(planted.options),
    )
    budget = settings(
        max_examples=200,
        stateful_step_count=20,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    stats = CampaignStats()
    # Hypothesis replays a failing example once; when the engine's timing does not fail it
    # again, the violation comes wrapped in a FlakyFailure: found all the same.
    with applied(planted), pytest.raises((InvariantViolation, FlakyFailure)) as caught:
        run_engine_machine(options, budget, stats=stats)
    found = [caught.value]
    if isinstance(caught.value, FlakyFailure):
        found = list(caught.value.exceptions)
    text = "\n".join(str(e) for e in found if isinstance(e, InvariantViolation))
    assert oracle in text, str(caught.value)[:2000]
    assert planted.invariant in text
    assert stats.first_failure_s is not None and stats.first_failure_s <= stats.elapsed_s


class _FakeDriver:
    call_timeout_s = 2.5


class _FakeMachine:
    """Just what ``_answered`` touches: the driver's call bound and ``_found``."""

    def __init__(self) -> None:
        self.driver = _FakeDriver()
        self.found: list[Any] = []

    def _found(self, violations: list[Any]) -> bool:
        self.found.extend(violations)
        return bool(violations)


def test_a_driver_call_with_no_answer_is_a_finding_naming_the_rule() -> None:
    """A rule whose driver call times out records an INV-6 finding naming the rule and its
    bound, returns what keeps later draws the same, and does not raise."""
    import trio

    from omni_trio.testing.machine import _answered

    @_answered(lambda size, **_: ["none"] * size)
    def submit_some(self: _FakeMachine, size: int) -> list[str]:
        raise trio.TooSlowError

    @_answered()
    def ping(self: _FakeMachine) -> str:
        return "pong"

    machine = _FakeMachine()
    assert ping(machine) == "pong" and not machine.found
    assert submit_some(machine, size=3) == ["none"] * 3
    (finding,) = machine.found
    assert finding.invariant == "INV-6"
    assert "submit_some" in finding.message and "2.5 s" in finding.message


def _bare_machine(options: MachineOptions) -> Any:
    """An engine machine object with no engine (its reference model and deadline oracle
    read only the trace and what was submitted)."""
    from omni_trio.testing.machine import make_engine_machine

    cls = make_engine_machine(options, lambda: None, CampaignStats())  # type: ignore[arg-type,return-value]
    machine: Any = cls.__new__(cls)
    machine.submitted, machine.fault_marks, machine.asleep = {}, [], False
    return machine


def _events(*rows: tuple[float, str, str | None, int | None, dict[str, Any]]) -> list[Any]:
    from omni_trio._core.trace import TraceEvent, TraceKind

    return [
        TraceEvent(seq, time, TraceKind(kind), rid, step, None, detail)
        for seq, (time, kind, rid, step, detail) in enumerate(rows)
    ]


def test_a_request_fused_with_an_earlier_faulty_one_may_fail_with_it() -> None:
    """The reference model: a request that shared a forward with a request carrying a
    failing fault (admitted before it, still waiting when it came) may end in error; one
    that shared none with it must complete."""
    from omni_trio.testing.machine import _Submitted

    machine = _bare_machine(MachineOptions())
    fault = FaultSpec(Fault.RAISE_AT_STEP, step=0)
    machine.submitted = {
        "faulty": _Submitted("faulty", 3, fault),
        "fused": _Submitted("fused", 3, None),
        "apart": _Submitted("apart", 3, None),
    }
    error = {"status": "FINISHED_ERROR"}
    events = _events(
        (0.0, "admit", "faulty", None, {}),
        (0.1, "admit", "fused", None, {}),
        (0.1, "admit", "apart", None, {}),
        (0.2, "exec_start", "faulty", 7, {}),
        (0.2, "exec_start", "fused", 7, {}),
        (0.3, "terminal", "faulty", None, error),
        (0.3, "terminal", "fused", None, error),
        (0.4, "exec_start", "apart", 8, {}),
        (0.5, "terminal", "apart", None, error),
    )
    found = machine._check_outcomes(events)
    assert [v.request_id for v in found] == ["apart"]


def test_a_deadline_ended_late_is_a_finding_only_if_the_engine_worked_meanwhile() -> None:
    """A request ended by its deadline 0.3 s late: a finding when the engine scheduled
    work past the deadline (+ slack) meanwhile, not when the whole loop was held up; one
    that completed late ran past its deadline either way."""
    from omni_trio.testing.machine import _Submitted

    machine = _bare_machine(MachineOptions(mode="step"))
    machine.submitted = {"r": _Submitted("r", 120, None, deadline_s=0.1)}
    aborted = {"status": "FINISHED_ABORTED"}
    frozen = _events(
        (0.0, "admit", "r", None, {}),
        (0.05, "exec_start", "r", 1, {}),
        (0.6, "terminal", "r", None, aborted),
    )
    assert machine._deadline_violations(frozen, None) == []
    worked = _events(
        (0.0, "admit", "r", None, {}),
        (0.05, "exec_start", "r", 1, {}),
        (0.45, "exec_start", "r", 2, {}),
        (0.6, "terminal", "r", None, aborted),
    )
    (late,) = machine._deadline_violations(worked, None)
    assert late.invariant == "INV-6" and "deadline_s=0.1" in late.message
    completed = _events(
        (0.0, "admit", "r", None, {}),
        (0.05, "exec_start", "r", 1, {}),
        (0.6, "terminal", "r", None, {"status": "FINISHED_COMPLETED"}),
    )
    assert len(machine._deadline_violations(completed, None)) == 1
    live = frozen[:2]
    assert machine._deadline_violations(live, 0.6) == []  # nothing worked: not yet
    assert len(machine._deadline_violations(worked[:3], 0.6)) == 1
