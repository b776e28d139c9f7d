"""``bench recovery``: the recovery times read from a lifecycle trace (hand-made traces)."""

from __future__ import annotations

from omni_trio._core.trace import TraceKind, TraceRecorder
from omni_trio.bench.recovery import recovery_times

K = TraceKind


def _trace(*rows: tuple[float, TraceKind, str | None, dict[str, str] | None]) -> TraceRecorder:
    trace = TraceRecorder()
    for time, kind, rid, detail in rows:
        trace.record(time, kind, rid, detail=detail)
    return trace


def test_recovery_counts_only_a_request_that_ran_on_the_new_group() -> None:
    done = {"status": "FINISHED_COMPLETED"}
    trace = _trace(
        (10.0, K.EXEC_START, "old", None),
        (10.1, K.CRASH, None, None),
        # "old" was already computed before the kill: its completion is not a recovery.
        (10.2, K.TERMINAL, "old", done),
        (11.5, K.RESTART, None, None),
        (11.6, K.EXEC_START, "new", None),
        (12.0, K.TERMINAL, "new", done),
    )
    noticed, serving, recovered = recovery_times(trace.events, killed_at=10.0)
    assert (round(noticed or 0, 3), round(serving or 0, 3), round(recovered or 0, 3)) == (
        0.1,
        1.5,
        2.0,
    )


def test_no_restart_yet_means_no_recovery() -> None:
    trace = _trace((5.0, K.CRASH, None, None))
    assert recovery_times(trace.events, killed_at=4.5) == (0.5, None, None)
    assert recovery_times([], killed_at=0.0) == (None, None, None)


def test_a_failed_request_after_the_restart_is_not_a_recovery() -> None:
    trace = _trace(
        (1.0, K.CRASH, None, None),
        (2.0, K.RESTART, None, None),
        (2.1, K.EXEC_START, "r", None),
        (2.5, K.TERMINAL, "r", {"status": "FINISHED_ERROR"}),
    )
    assert recovery_times(trace.events, killed_at=1.0)[2] is None


def test_the_poison_part_is_a_part_of_its_own() -> None:
    import argparse

    import pytest

    from omni_trio.bench.recovery import PARTS, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--parts", "poison", "--poison-every-s", "0.5"])
    assert args.parts == ("poison",) and args.poison_every_s == 0.5 and args.poison_s == 60.0
    assert parser.parse_args([]).parts == ("recovery", "soak")  # the default is unchanged
    assert "poison" in PARTS
    with pytest.raises(SystemExit):
        parser.parse_args(["--parts", "poisson"])
