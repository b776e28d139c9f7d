"""Every ipc test must leave no ``omni_trio_`` segment in /dev/shm (each one is unlinked
exactly once, DESIGN §3).  A leaked segment fails the test and is removed, so one leak does
not fail the tests after it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from omni_trio.ipc import list_our_segments, unlink_segment


@pytest.fixture(autouse=True)
def _no_segment_left() -> Iterator[None]:
    before = set(list_our_segments())
    yield
    leaked = sorted(set(list_our_segments()) - before)
    for name in leaked:
        unlink_segment(name)
    assert not leaked, f"test left omni_trio_ segments in /dev/shm: {leaked}"
