"""The pure engine core under a Hypothesis state machine (see omni_trio/testing/core_machine.py):
every event and the awkward interleavings, INV-1..7 on the core's own trace after every rule.

No trio, no threads, no processes: each example is a fresh ``EngineCore`` driven by numbers,
so hundreds of examples run in seconds and every ``make test`` runs at least 200 per mode
(``make test-fast``, with the ``fast`` Hypothesis profile, runs that profile's few).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from omni_trio.testing.core_machine import CoreMachineOptions, make_core_machine

CORE_SETTINGS = settings(
    settings.default,
    max_examples=(
        settings.default.max_examples
        if os.environ.get("HYPOTHESIS_PROFILE") == "fast"
        else max(200, settings.default.max_examples)
    ),
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("mode", ["request", "step"])
def test_the_core_keeps_its_invariants(mode: str) -> None:
    machine = make_core_machine(CoreMachineOptions(mode=mode))
    run_state_machine_as_test(machine, settings=CORE_SETTINGS)


@pytest.mark.parametrize("policy", ["priority", "fair"])
@pytest.mark.parametrize("mode", ["request", "step"])
def test_the_core_keeps_its_invariants_under_every_scheduling_policy(
    mode: str, policy: str
) -> None:
    """Priorities with aging and step-boundary preemption, or fair rotation across
    compatibility classes: the same invariants, deadlines included."""
    machine = make_core_machine(CoreMachineOptions(mode=mode, scheduling_policy=policy))
    run_state_machine_as_test(machine, settings=CORE_SETTINGS)


def test_the_core_keeps_its_invariants_with_single_request_batches_and_no_retries() -> None:
    options = CoreMachineOptions(mode="request", max_num_seqs=1, max_retries=0)
    run_state_machine_as_test(make_core_machine(options), settings=CORE_SETTINGS)


def test_the_core_keeps_its_invariants_when_every_preemption_drops_its_state() -> None:
    """Step mode, "priority", ``max_preempted_states=0``: each preempted request gives its
    step state up and starts again from step 0 (the workers evict it first)."""
    options = CoreMachineOptions(mode="step", scheduling_policy="priority", max_preempted_states=0)
    run_state_machine_as_test(make_core_machine(options), settings=CORE_SETTINGS)
