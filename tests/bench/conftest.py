"""Shared fixtures of the bench tests."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from omni_trio.bench.load import LoadResult, Outcome

# load_result(latencies_ms, wall_s, e429=2, ...): a LoadResult of those completions (server
# time half the latency, queue wait 1 ms) and those errors (keyword eNNN: NNN errors).
LoadRun = Callable[..., LoadResult]


@pytest.fixture
def load_result() -> LoadRun:
    """A factory of :class:`LoadResult` runs with given latencies, wall time and errors."""

    def make(latencies_ms: list[float], wall_s: float, **errors: int) -> LoadResult:
        result = LoadResult(requests=len(latencies_ms) + sum(errors.values()), wall_s=wall_s)
        for ms in latencies_ms:
            result.record(Outcome(server_ms=ms / 2, queue_wait_ms=1.0), ms / 1000.0)
        for key, n in errors.items():
            for _ in range(n):
                result.record(Outcome(key.removeprefix("e")), 0.0)
        return result

    return make
