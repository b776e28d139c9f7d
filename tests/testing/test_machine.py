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
