"""Health and statistics snapshots: typed states that read as their names, phase summaries."""

from __future__ import annotations

import json

from omni_trio._core.health import (
    EngineState,
    GroupState,
    PhaseSummary,
    WorkerState,
    WorkerStatus,
)


def test_states_are_enums_that_compare_and_serialise_as_their_names() -> None:
    assert GroupState.RUNNING == "running"
    assert WorkerStatus.RESTARTING == "restarting"
    assert EngineState.READY == "ready"
    assert json.dumps({"state": EngineState.DEAD}) == '{"state": "dead"}'
    assert {s.value for s in GroupState} == {
        "starting",
        "running",
        "restarting",
        "failed",
        "stopped",
    }
    assert WorkerState(0, WorkerStatus.RUNNING, pid=1).state is WorkerStatus.RUNNING


def test_phase_summary_of_samples() -> None:
    assert PhaseSummary.of([]) == PhaseSummary()
    summary = PhaseSummary.of([5.0, 1.0, 3.0, 2.0, 4.0, 6.0, 7.0, 8.0, 9.0, 10.0])
    assert (summary.count, summary.mean_ms, summary.max_ms) == (10, 5.5, 10.0)
    assert (summary.p50_ms, summary.p90_ms) == (6.0, 9.0)
