from __future__ import annotations

import pytest

from omni_trio._core.data_parallel import DataParallelRouter
from omni_trio._core.messages import NewRequestData, SchedulerOutput
from omni_trio._core.request import DiffusionRequest, SamplingParams


def new(*ids: str) -> tuple[NewRequestData, ...]:
    return tuple(NewRequestData(rid, DiffusionRequest("p", SamplingParams(), rid)) for rid in ids)


def out(
    step: int, news: tuple[str, ...] = (), cached: tuple[str, ...] = (), done: tuple[str, ...] = ()
) -> SchedulerOutput:
    return SchedulerOutput(
        step, new(*news), tuple(cached), frozenset(done), num_running_reqs=7, num_waiting_reqs=3
    )


def rows(shares: dict[int, SchedulerOutput]) -> dict[int, tuple[str, ...]]:
    return {rank: share.scheduled_request_ids for rank, share in shares.items()}


def test_a_request_mode_wave_is_dealt_round_robin_one_request_per_rank() -> None:
    router = DataParallelRouter(2, step_mode=False)
    shares = router.split(out(1, ("a", "b", "c")))
    assert rows(shares) == {0: ("a", "c"), 1: ("b",)}
    for share in shares.values():  # step id and counts kept, payloads carried
        assert (share.step_id, share.num_running_reqs, share.num_waiting_reqs) == (1, 7, 3)
    assert [n.request.request_id for n in shares[0].scheduled_new_reqs] == ["a", "c"]
    # Each is held by the rank it went to until it finishes (its abort goes there alone).
    assert router.pinned == {"a": 0, "b": 1, "c": 0}
    # A wave smaller than the group leaves the idle rank out of the call.
    assert rows(router.split(out(2, ("d",), done=("a", "c")))) == {0: ("d",)}
    assert router.holder("a") is None and router.holder("d") == 0


def test_a_finished_id_goes_to_its_holder_alone_once_even_when_it_is_idle() -> None:
    router = DataParallelRouter(3, step_mode=False)
    router.split(out(1, ("a", "b", "c")))
    shares = router.split(out(2, ("d",), done=("a", "b", "c", "never-sent")))
    # Ranks 1 and 2 run nothing now but must hear of what they ran; nobody hears of an id
    # that never reached a rank.
    assert rows(shares) == {0: ("d",), 1: (), 2: ()}
    assert {r: s.finished_req_ids for r, s in shares.items()} == {0: {"a"}, 1: {"b"}, 2: {"c"}}
    assert all(router.undelivered(rank) == frozenset() for rank in range(3))
    # Told once: the next call carries nothing more.
    assert router.split(out(3, ("e",))) == {0: out(3, ("e",))}
    assert router.split(out(4)) == {}  # nothing to run, nothing to tell


def test_a_call_that_did_not_run_delivers_its_finished_ids_again() -> None:
    router = DataParallelRouter(2, step_mode=False)
    router.split(out(1, ("a", "b")))
    failed = router.split(out(2, ("c",), done=("a", "b")))
    assert {r: s.finished_req_ids for r, s in failed.items()} == {0: {"a"}, 1: {"b"}}
    router.redeliver(failed)  # e.g. a payload that could not be sent
    again = router.split(out(3, ("d",)))
    assert {r: s.finished_req_ids for r, s in again.items()} == {0: {"a"}, 1: {"b"}}


def test_step_mode_pins_each_request_to_the_rank_holding_its_state() -> None:
    router = DataParallelRouter(2, step_mode=True)
    assert rows(router.split(out(1, ("a", "b")))) == {0: ("a",), 1: ("b",)}
    assert router.pinned == {"a": 0, "b": 1}
    # Cached rows go to their owner whatever their order; a new one to the lighter rank.
    assert rows(router.split(out(2, ("c",), cached=("b", "a")))) == {0: ("c", "a"), 1: ("b",)}
    assert router.holder("c") == 0
    # "a" finishes: its owner is freed and told (no other rank is); the ranks tie on rows
    # and on pinned requests, so the next new request goes to the lower rank.
    shares = router.split(out(3, ("d",), cached=("b", "c"), done=("a",)))
    assert rows(shares) == {0: ("d", "c"), 1: ("b",)}
    assert (shares[0].finished_req_ids, shares[1].finished_req_ids) == ({"a"}, set())
    assert router.holder("a") is None and router.pinned == {"b": 1, "c": 0, "d": 0}


def test_a_new_row_goes_to_the_rank_with_fewest_rows_then_fewest_pinned() -> None:
    router = DataParallelRouter(2, step_mode=True)
    router.split(out(1, ("a", "b", "c")))  # a->0, b->1, c->0
    assert router.pinned == {"a": 0, "b": 1, "c": 0}
    # "a" preempted (pinned, not scheduled): this tick rank 0 runs c, rank 1 runs b; a new
    # one ties on rows (1 each) and goes to the rank with fewer pinned requests (rank 1).
    shares = router.split(out(2, ("d",), cached=("c", "b")))
    assert rows(shares) == {0: ("c",), 1: ("d", "b")}
    # The preempted one resumes on its own rank.
    assert rows(router.split(out(3, cached=("a",)))) == {0: ("a",)}


def test_a_request_restarted_from_step_0_is_placed_anew_and_its_old_rank_told() -> None:
    """A preempted request whose state was dropped comes back as new in the same output
    that reports its id finished (the workers evict before they prepare)."""
    router = DataParallelRouter(2, step_mode=True)
    router.split(out(1, ("a", "b")))
    router.split(out(2, ("c",), cached=("a", "b")))  # a full tie: c goes to rank 0
    assert router.pinned == {"a": 0, "b": 1, "c": 0}
    # b is preempted this tick; a restarts: rank 0 already runs c, so a goes to rank 1.
    shares = router.split(out(3, ("a",), cached=("c",), done=("a",)))
    assert router.holder("a") == 1
    assert shares[0].finished_req_ids == {"a"}  # rank 0 drops its old state
    assert rows(shares) == {0: ("c",), 1: ("a",)}


def test_forget_unpins() -> None:
    router = DataParallelRouter(2, step_mode=True)
    router.split(out(1, ("a", "b")))
    router.forget(("a",))
    assert router.pinned == {"b": 1}


def test_a_rank_down_gets_no_share_and_what_it_held_is_handed_back() -> None:
    """Request mode: a wave is dealt round-robin over the ranks up; a rank that goes down
    hands back the ids it held (their state died with it) and hears of no finished id."""
    router = DataParallelRouter(3, step_mode=False)
    router.split(out(1, ("a", "b", "c")))  # a->0, b->1, c->2
    assert router.down(2) == {"c"} and router.holder("c") is None
    assert router.down(2) == frozenset()  # already down: nothing more
    assert router.ranks_up == (0, 1)
    shares = router.split(out(5, ("e", "f", "g")))
    assert rows(shares) == {0: ("e", "g"), 1: ("f",)}
    router.up(2)
    assert router.ranks_up == (0, 1, 2)
    assert rows(router.split(out(6, ("h", "i", "j")))) == {0: ("h",), 1: ("i",), 2: ("j",)}


def test_a_rank_down_drops_its_undelivered_finished_ids_and_redelivery_skips_it() -> None:
    router = DataParallelRouter(2, step_mode=False)
    router.split(out(1, ("a", "b")))
    failed = router.split(out(2, ("c",), done=("a", "b")))  # not run: to be redelivered
    router.down(1)
    router.redeliver(failed)
    assert router.undelivered(1) == frozenset()  # the restarted rank never held "b"
    assert router.undelivered(0) == {"a"}


def test_step_mode_places_new_rows_only_on_ranks_up() -> None:
    router = DataParallelRouter(2, step_mode=True)
    router.split(out(1, ("a", "b")))  # a->0, b->1
    assert router.down(1) == {"b"}
    # Rank 1 would be the lighter one; it is down.
    assert rows(router.split(out(2, ("c",), cached=("a",)))) == {0: ("c", "a")}
    router.up(1)
    assert rows(router.split(out(3, ("d",), cached=("a", "c")))) == {0: ("a", "c"), 1: ("d",)}


def test_the_last_rank_up_cannot_go_down() -> None:
    router = DataParallelRouter(2, step_mode=True)
    router.down(0)
    with pytest.raises(ValueError, match="last"):
        router.down(1)
    assert router.ranks_up == (1,)


@pytest.mark.parametrize("size", [0, -1, True, 1.5])
def test_a_bad_size_is_refused(size: object) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        DataParallelRouter(size, step_mode=False)  # type: ignore[arg-type]
