"""``StopFlags``: which forwards must stop at their next step boundary."""

from __future__ import annotations

from omni_trio.worker.stop_flags import ForwardStopped, StopFlags


def test_fresh_flags_stop_nothing() -> None:
    flags = StopFlags()
    assert len(flags) == 0
    assert not flags.is_aborted("a")
    assert not flags.should_stop(["a", "b"])


def test_abort_marks_only_the_named_requests() -> None:
    flags = StopFlags()
    flags.abort(["a"])
    assert flags.is_aborted("a")
    assert not flags.is_aborted("b")
    assert len(flags) == 1


def test_a_forward_stops_only_when_all_its_requests_are_aborted() -> None:
    flags = StopFlags()
    flags.abort(["a"])
    assert flags.should_stop(["a"])
    # A fused batch with one live member runs on.
    assert not flags.should_stop(["a", "b"])
    flags.abort(iter(["b"]))  # any iterable
    assert flags.should_stop(["a", "b"])
    assert flags.should_stop(("b", "a"))


def test_an_empty_forward_is_not_stopped_by_request_flags() -> None:
    flags = StopFlags()
    flags.abort(["a"])
    assert not flags.should_stop([])


def test_should_stop_accepts_a_one_shot_iterator() -> None:
    flags = StopFlags()
    flags.abort(["a", "b"])
    assert flags.should_stop(iter(["a", "b"]))
    assert not flags.should_stop(iter(["a", "c"]))


def test_stop_everything_stops_every_forward_and_request() -> None:
    flags = StopFlags()
    flags.stop_everything()
    assert flags.should_stop(["x"])
    assert flags.should_stop([])
    assert flags.is_aborted("anything")


def test_forget_drops_flags_so_a_reused_id_runs_again() -> None:
    flags = StopFlags()
    flags.abort(["a", "b", "c"])
    flags.forget(["a", "c", "never-flagged"])
    assert len(flags) == 1
    assert not flags.is_aborted("a")
    assert flags.is_aborted("b")
    assert not flags.should_stop(["a"])


def test_forget_does_not_undo_stop_everything() -> None:
    flags = StopFlags()
    flags.stop_everything()
    flags.forget(["a"])
    assert flags.is_aborted("a")


def test_forward_stopped_names_requests_and_step() -> None:
    exc = ForwardStopped(iter(["a", "b"]), 3)
    assert exc.request_ids == ("a", "b")
    assert exc.step == 3
    assert "a, b" in str(exc)
    assert "step 3" in str(exc)
