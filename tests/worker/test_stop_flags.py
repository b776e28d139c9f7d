"""``StopFlags``: which forwards must stop at their next step boundary."""

from __future__ import annotations

from omni_trio.worker.stop_flags import AbortMarks, ForwardStopped, StopFlags


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


def test_abort_marks_say_how_many_steps_a_forward_started_after_its_last_abort() -> None:
    marks = AbortMarks()
    assert marks.steps_after(["a", "b"], 5) is None  # nobody aborted: nothing to measure
    marks.mark(["a"], {"a": 2, "b": 2})
    assert marks.steps_after(["a", "b"], 5) is None  # b still live: the forward runs on
    assert marks.steps_after(["a"], 2) == 0  # stopped at the next boundary
    marks.mark(["b"], {"a": 3, "b": 3})
    assert marks.steps_after(["a", "b"], 4) == 1  # from the last member's abort
    marks.mark(["b"], {"b": 9})  # a second abort does not move the first mark
    assert marks.steps_after(["b"], 20) == 17
    marks.mark(["c"], {})  # not started yet
    assert marks.steps_after(["c"], 0) == 0
    marks.forget(["a", "b", "c"])
    assert len(marks) == 0 and marks.steps_after(["a"], 1) is None
