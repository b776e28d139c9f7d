"""The Idempotency-Key store: decisions by key, owner and body; expiry; the memory bound."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from omni_trio.serve.idempotency import (
    MAX_KEY_LENGTH,
    IdempotencyStore,
    StoredResponse,
    body_digest,
    check_key,
)


def answer(size: int = 10, status: int = 200) -> StoredResponse:
    return StoredResponse(status, (), b"x" * size)


def test_keys_must_be_short_printable_ascii() -> None:
    assert check_key("abc-123_XYZ") is None
    for bad in ("", "x" * (MAX_KEY_LENGTH + 1), "a\nb", "ünï"):
        assert check_key(bad) is not None, bad


def test_the_digest_ignores_key_order_and_spacing_but_not_values() -> None:
    assert body_digest({"a": 1, "b": [1, 2]}) == body_digest({"b": [1, 2], "a": 1})
    assert body_digest({"a": 1}) != body_digest({"a": 2})


async def test_a_key_is_per_owner_and_replays_until_its_ttl_after_the_end() -> None:
    store = IdempotencyStore(ttl_s=10.0)
    entry = store.begin("alice", "k", "d1", "req-1")
    assert store.lookup("alice", "k", 0.0) is entry and not entry.done.is_set()
    assert store.lookup("bob", "k", 0.0) is None  # another owner's key of the same name
    store.finish("alice", "k", entry, answer(), now=5.0)
    assert entry.done.is_set() and entry.response == answer()
    assert store.lookup("alice", "k", 14.9) is entry
    assert store.lookup("alice", "k", 15.0) is None  # expired 10 s after its end
    assert len(store) == 0 and store.stored_bytes == 0


async def test_an_in_flight_key_never_expires_and_a_forgotten_one_is_free() -> None:
    store = IdempotencyStore(ttl_s=1.0)
    running = store.begin("", "k", "d", "req-1")
    assert store.lookup("", "k", 1000.0) is running
    store.forget("", "k", running)
    assert running.done.is_set()  # its waiters wake and run their own request
    assert store.lookup("", "k", 1000.0) is None
    again = store.begin("", "k", "d", "req-2")
    store.finish("", "k", running, answer(), now=1000.0)  # a stale entry changes nothing
    assert store.lookup("", "k", 1000.0) is again and again.response is None


async def test_past_the_memory_bound_the_oldest_answers_are_dropped_but_their_keys_kept() -> None:
    store = IdempotencyStore(ttl_s=100.0, max_bytes=25)
    entries = []
    for index in range(3):
        entry = store.begin("", f"k{index}", "d", f"req-{index}")
        store.finish("", f"k{index}", entry, answer(10), now=float(index))
        entries.append(entry)
    assert store.stored_bytes == 20  # the first answer's body was dropped for the third
    first = store.lookup("", "k0", 3.0)
    assert first is not None and first.response is not None and first.response.body is None
    assert [e.response.body for e in entries[1:] if e.response] == [b"x" * 10] * 2


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        IdempotencyStore(ttl_s=0)
    with pytest.raises(ValueError, match="max_bytes"):
        IdempotencyStore(max_bytes=-1)


async def test_finish_wakes_every_waiter() -> None:
    store = IdempotencyStore()
    entry = store.begin("", "k", "d", "req-1")
    woken: list[int] = []

    async def waiter(index: int) -> None:
        await entry.done.wait()
        woken.append(index)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            for index in range(3):
                nursery.start_soon(waiter, index)
            await trio.testing.wait_all_tasks_blocked()
            store.finish("", "k", entry, answer(), now=0.0)
    assert sorted(woken) == [0, 1, 2]
