"""State machines that drive a real engine (echo pipeline, real worker threads and
processes) with random requests, aborts, consumer drops, crashes, hangs, RPCs and restarts,
and check the lifecycle invariants INV-1..INV-7 after every rule and over each engine's
whole trace (see omni_trio/testing/machine.py and docs/fuzzing.md).

Each example opens a real engine, so the budgets here are far below the pure scheduler
machines': the ``ci`` profile runs a few short examples per backend and mode on every
``make test``; ``HYPOTHESIS_PROFILE=long`` (or ``omni-trio fuzz``) runs campaigns.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from omni_trio.testing.machine import CampaignStats, MachineOptions, run_engine_machine

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

# (examples, steps per example) per profile and backend: a tractor example spawns worker
# processes (about 2 s per engine start or restart on 2 vCPUs).
_BUDGETS = {
    "dev": {"inproc": (6, 20), "tractor": (2, 12)},
    "ci": {"inproc": (8, 25), "tractor": (2, 12)},
    "long": {"inproc": (300, 50), "tractor": (40, 30)},
}


def engine_settings(backend: str) -> settings:
    profile = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
    examples, steps = _BUDGETS.get(profile, _BUDGETS["dev"])[backend]
    return settings(
        settings.default,
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


@pytest.mark.parametrize("mode", ["request", "step"])
def test_inproc_engine_keeps_its_invariants(mode: str, cache_dir: Path) -> None:
    options = MachineOptions(backend="inproc", mode=mode, cache_dir=str(cache_dir), pictures=True)
    stats = run_engine_machine(options, engine_settings("inproc"))
    _check_campaign(stats)
    # Three of four submissions start from a picture: over a campaign some always do.
    assert stats.pictures >= 1, stats


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["request", "step"])
def test_tractor_engine_keeps_its_invariants(mode: str, cache_dir: Path) -> None:
    # Forked from the preloaded fork server: a restart after an injected crash takes ~0.2 s
    # instead of ~3 s, so the same budget runs in a fraction of the time (the "trio" start
    # method has its own crash and restart tests in tests/executors/).
    options = MachineOptions(
        backend="tractor",
        mode=mode,
        cache_dir=str(cache_dir),
        worker_start_method="forkserver",
        pictures=True,  # some over the shared-memory threshold: segments must not leak
    )
    stats = run_engine_machine(options, engine_settings("tractor"))
    _check_campaign(stats)


@pytest.mark.parametrize(("mode", "policy"), [("step", "priority"), ("request", "fair")])
def test_inproc_engine_keeps_its_invariants_under_other_policies(
    mode: str, policy: str, cache_dir: Path
) -> None:
    """A real engine under "priority" (random priorities: later, better arrivals pass
    waiting ones; step-boundary preemption is reached rarely at this pace, and is covered by
    the core machine) and "fair" (rotation across the step-count classes), with every fault
    and rule of the default campaign."""
    options = MachineOptions(
        backend="inproc", mode=mode, cache_dir=str(cache_dir), scheduling_policy=policy
    )
    stats = run_engine_machine(options, engine_settings("inproc"))
    _check_campaign(stats)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["request", "step"])
def test_data_parallel_engine_keeps_its_invariants(mode: str, cache_dir: Path) -> None:
    """Two data-parallel ranks, each running its own share of every wave or tick: faults
    fire on the rank that runs the faulty request, and a crash of either fails the group."""
    options = MachineOptions(
        backend="tractor",
        mode=mode,
        cache_dir=str(cache_dir),
        worker_start_method="forkserver",
        data_parallel_size=2,
    )
    stats = run_engine_machine(options, engine_settings("tractor"))
    _check_campaign(stats)


def test_machine_options_round_trip() -> None:
    options = MachineOptions(
        backend="tractor", mode="step", max_num_seqs=3, data_parallel_size=2, pictures=True
    )
    assert MachineOptions.from_dict(options.to_dict()) == options
    assert dataclasses.asdict(options)["faults"]


def _check_campaign(stats: CampaignStats) -> None:
    # The machine really ran: examples, rules, invariant checks.
    assert stats.examples >= 1 and stats.rules >= 1
    assert stats.invariant_checks >= stats.examples
