"""The engine state machine's configuration and reference model (the machine itself runs in
property_tests/test_engine_machine.py)."""

from __future__ import annotations

import pytest

from omni_trio.testing.faults import Fault, FaultSpec
from omni_trio.testing.machine import (
    BENIGN_FAULTS,
    FAILING_FAULTS,
    MachineOptions,
    _fault_fires,
    engine_config_for,
)


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
    ],
)
def test_which_faults_must_make_a_request_fail(
    spec: FaultSpec | None, steps: int, fires: bool
) -> None:
    assert _fault_fires(spec, steps) is fires


def test_fault_sets_cover_every_request_fault() -> None:
    request_faults = set(Fault) - {Fault.FAIL_WARMUP}
    assert set(FAILING_FAULTS) | set(BENIGN_FAULTS) == request_faults
    assert not set(FAILING_FAULTS) & set(BENIGN_FAULTS)


def test_options_round_trip_through_a_dict() -> None:
    options = MachineOptions(
        backend="tractor", mode="step", max_num_seqs=3, faults=(Fault.RAISE_AT_STEP,)
    )
    assert MachineOptions.from_dict(options.to_dict()) == options
