"""The liveness tracker: silence, no progress, a dead packer; exact times (``now`` is passed in)."""

from __future__ import annotations

import pytest

from omni_trio._core.liveness import MAX_POLL_S, LivenessTracker
from omni_trio.errors import StallError, WorkerError


def tracker(
    beat: float | None = 10.0, stall: float | None = 5.0, ranks: int = 2
) -> LivenessTracker:
    t = LivenessTracker(ranks=ranks, heartbeat_timeout_s=beat, stall_timeout_s=stall)
    t.start(100.0)
    return t


def test_a_rank_silent_past_the_heartbeat_timeout_is_hung() -> None:
    t = tracker()
    t.heard(0, 105.0)
    assert t.check(110.0) is None  # rank 1: exactly 10 s of silence is still alive
    verdict = t.check(110.001)
    assert isinstance(verdict, StallError) and verdict.phase == "worker"
    assert "worker 1 silent for 10.001 s" in str(verdict)
    # The verdict is final.
    t.heard(1, 111.0)
    assert t.check(111.0) is verdict


def test_no_progress_counts_only_while_a_call_is_in_flight() -> None:
    t = tracker(beat=None)
    assert t.check(1000.0) is None  # idle for 900 s: never a stall
    t.call_started(1000.0)  # the progress clock starts with the call, not at the last step
    t.heard(0, 1003.0, steps=1)
    t.heard(1, 1003.0, steps=1)
    assert t.check(1005.0) is None
    t.heard(0, 1007.0, steps=2)  # rank 0 moves on, rank 1 does not
    assert t.check(1008.0) is None
    verdict = t.check(1008.5)
    assert isinstance(verdict, StallError) and verdict.phase == "forward"
    assert "worker 1: no step progress in 5.500 s" in str(verdict)


def test_a_call_that_ends_stops_the_stall_clock() -> None:
    t = tracker(beat=None)
    t.call_started(100.0)
    t.call_ended()
    assert not t.busy
    assert t.check(200.0) is None
    t.call_started(200.0)
    t.call_started(201.0)  # a second call in flight does not restart the clock
    assert t.check(205.0) is None
    assert t.check(205.5) is not None


def test_a_rank_that_answered_leaves_the_call_while_the_others_run_on() -> None:
    """Data-parallel ranks run shares of different length: a rank that answered (or got no
    share) must not be judged stalled while another still computes."""
    t = tracker(beat=None)
    t.call_started(100.0, ranks=[0, 1])
    t.call_ended([1])  # rank 1's share was short
    t.heard(0, 104.0, steps=1)
    t.heard(0, 108.0, steps=2)
    assert t.check(109.5) is None and t.busy
    t.call_started(110.0, ranks=[0])  # a call for rank 0 alone: rank 1 stays idle
    t.heard(0, 114.0, steps=3)
    assert t.check(118.0) is None
    assert t.check(119.5) is not None  # rank 0 itself does stall
    t.call_ended([0, 5])  # an unknown rank is ignored


def test_a_dead_packer_fails_the_group_at_the_next_check() -> None:
    t = tracker()
    t.heard(0, 101.0, packer_alive=False)
    verdict = t.check(101.0)
    assert isinstance(verdict, WorkerError) and verdict.error_type == "PackerDied"
    assert verdict.worker == 0


def test_messages_from_unknown_ranks_are_ignored() -> None:
    t = tracker(ranks=1)
    t.heard(7, 101.0, steps=3)
    assert t.check(101.0) is None


@pytest.mark.parametrize(
    ("beat", "stall", "poll"),
    [(30.0, 300.0, MAX_POLL_S), (2.0, 1.0, 0.25), (None, None, MAX_POLL_S), (0.0, None, 0.01)],
)
def test_one_poll_period_a_quarter_of_the_shortest_timeout(
    beat: float | None, stall: float | None, poll: float
) -> None:
    assert tracker(beat, stall).poll_s == poll


def test_a_pardoned_rank_is_no_longer_watched_and_its_verdict_is_withdrawn() -> None:
    """A data-parallel rank group restarting on its own: the verdict about its rank is
    withdrawn, the others are still judged, and the restarted rank is watched anew."""
    t = tracker(ranks=3)
    t.heard(0, 109.0)
    t.heard(2, 109.0)
    verdict = t.check(110.5)
    assert isinstance(verdict, StallError) and t.verdict_rank == 1
    t.pardon((1,))
    assert t.check(110.5) is None and t.verdict_rank is None
    assert t.steps_of(1) is None
    t.heard(1, 111.0)  # what the written-off rank still sends changes nothing
    assert t.steps_of(1) is None
    t.resume((1,), 115.0)
    assert t.check(119.0) is None  # ranks 0 and 2: silent 10 s at 119.0 exactly
    verdict = t.check(125.001)
    assert isinstance(verdict, StallError) and t.verdict_rank == 0
    t.pardon((2,))  # a pardon of another rank keeps the verdict
    assert t.check(125.001) is verdict and t.verdict_rank == 0
