"""Which data-parallel rank runs which request: the pure half of data-parallel execution.

With ``EngineConfig.data_parallel_size = N`` one scheduler emits waves (request mode) or
ticks (step mode) of up to ``N x max_num_seqs`` compatible requests, and the executor gives
each of its N ranks a different share.  :class:`DataParallelRouter` decides the shares; the
executor carries them out (one call per rank) and merges the replies **by request id**, never
by rank order.

Rules:

- **request mode**: a wave's rows are dealt round-robin (row ``i`` to rank ``i % N``), so a
  wave of up to N requests runs one request per rank and no rank gets more than
  ``ceil(len / N)`` (at most ``max_num_seqs``, since the scheduler caps the wave at
  ``N x max_num_seqs``);
- **step mode**: a request's step state (latents, scheduler) lives in the rank that prepared
  it, so a request is **pinned** to a rank from its first tick until it is finished: cached
  rows go to their owner; a new row (a first tick, or a restart from step 0 after its state
  was dropped) goes to the rank with the fewest rows in this tick, then the fewest pinned
  requests, then the lowest rank;
- a request is **held** by the rank it was last given to (request mode: until it finishes;
  step mode: its pin): only that rank can hold a stop flag or step state for it (the executor
  sends an abort only to the holder, :meth:`DataParallelRouter.holder`);
- a rank may be **down** (:meth:`DataParallelRouter.down`: its process died and restarts
  while the others serve): it gets no share until :meth:`DataParallelRouter.up`; the
  requests it held are forgotten (their state died with it) and the finished ids it was
  still to hear of are dropped (the restarted rank never held them);
- a **finished id** is queued for its holder alone and delivered with that rank's next call;
  a rank with no rows but undelivered finished ids still gets a call (an empty one), so
  nothing is left behind; an id never given to a rank goes nowhere.  The holder is forgotten
  then.  A call that did not run (:meth:`DataParallelRouter.redeliver`) delivers its finished
  ids again with the next one.

Pure: no trio, no I/O.  A router belongs to one worker group (a restarted group starts with
a new, empty one).
"""

from __future__ import annotations

from collections.abc import Mapping

from .messages import NewRequestData, SchedulerOutput

__all__ = ["DataParallelRouter"]


class DataParallelRouter:
    """The shares of ``size`` data-parallel ranks; see the module docstring."""

    def __init__(self, size: int, *, step_mode: bool) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be a positive integer, got {size!r}")
        self.size = size
        self.step_mode = step_mode
        # The rank each live request was given to (step mode: its pin).
        self._owners: dict[str, int] = {}
        # Finished ids not yet delivered, per rank.
        self._undelivered: dict[int, set[str]] = {rank: set() for rank in range(size)}
        # Ranks that get no share now (restarting), and the ranks that do.
        self._down: set[int] = set()
        self._up: list[int] = list(range(size))

    def down(self, rank: int) -> frozenset[str]:
        """``rank`` is gone until :meth:`up`: the ids of the live requests it held (their
        state died with it; no longer held by anyone), its undelivered finished ids dropped.
        ``ValueError`` for the last rank up (a router with no rank cannot split)."""
        if rank in self._down:
            return frozenset()
        if self._up == [rank]:
            raise ValueError("the last data-parallel rank up cannot go down")
        self._down.add(rank)
        self._up = [r for r in range(self.size) if r not in self._down]
        held = frozenset(rid for rid, owner in self._owners.items() if owner == rank)
        for rid in held:
            del self._owners[rid]
        self._undelivered[rank] = set()
        return held

    def up(self, rank: int) -> None:
        """``rank`` (restarted, holding nothing) gets shares again."""
        self._down.discard(rank)
        self._up = [r for r in range(self.size) if r not in self._down]

    @property
    def ranks_up(self) -> tuple[int, ...]:
        """The ranks that get shares now, ascending."""
        return tuple(self._up)

    def holder(self, request_id: str) -> int | None:
        """The rank a live request was given to (step mode: pinned to); None if none."""
        return self._owners.get(request_id)

    @property
    def pinned(self) -> Mapping[str, int]:
        """Every held request and its rank (a copy)."""
        return dict(self._owners)

    def undelivered(self, rank: int) -> frozenset[str]:
        """Finished ids ``rank`` has not been told of yet."""
        return frozenset(self._undelivered[rank])

    def split(self, output: SchedulerOutput) -> dict[int, SchedulerOutput]:
        """Each rank's share of ``output``: only ranks with rows or undelivered finished ids
        appear (ascending).  Every share keeps ``output``'s step id and counts."""
        for rid in output.finished_req_ids:
            holder = self._owners.pop(rid, None)
            if holder is not None:
                self._undelivered[holder].add(rid)
        new_rows: dict[int, list[NewRequestData]] = {r: [] for r in range(self.size)}
        cached_rows: dict[int, list[str]] = {r: [] for r in range(self.size)}
        up = self._up
        if self.step_mode:
            for rid in output.scheduled_cached_reqs:
                cached_rows[self._owners.get(rid, up[0])].append(rid)
            for new in output.scheduled_new_reqs:
                rank = self._least_loaded(new_rows, cached_rows)
                self._owners[new.request_id] = rank
                new_rows[rank].append(new)
        else:
            for index, new in enumerate(output.scheduled_new_reqs):
                rank = up[index % len(up)]
                new_rows[rank].append(new)
                self._owners[new.request_id] = rank
            for index, rid in enumerate(output.scheduled_cached_reqs):
                rank = up[index % len(up)]
                cached_rows[rank].append(rid)
                self._owners[rid] = rank
        shares: dict[int, SchedulerOutput] = {}
        for rank in range(self.size):
            news, cached, done = new_rows[rank], cached_rows[rank], self._undelivered[rank]
            if not news and not cached and not done:
                continue
            shares[rank] = SchedulerOutput(
                step_id=output.step_id,
                scheduled_new_reqs=tuple(news),
                scheduled_cached_reqs=tuple(cached),
                finished_req_ids=frozenset(done),
                num_running_reqs=output.num_running_reqs,
                num_waiting_reqs=output.num_waiting_reqs,
            )
            self._undelivered[rank] = set()
        return shares

    def _least_loaded(
        self, new_rows: Mapping[int, list[NewRequestData]], cached_rows: Mapping[int, list[str]]
    ) -> int:
        pinned = [0] * self.size
        for rank in self._owners.values():
            pinned[rank] += 1
        return min(
            self._up,
            key=lambda r: (len(new_rows[r]) + len(cached_rows[r]), pinned[r], r),
        )

    def redeliver(self, shares: Mapping[int, SchedulerOutput]) -> None:
        """``shares`` were not run (the call failed before it ran): their finished ids are
        delivered again with each rank's next call."""
        for rank, share in shares.items():
            if rank not in self._down:
                self._undelivered[rank].update(share.finished_req_ids)

    def forget(self, request_ids: frozenset[str] | set[str] | tuple[str, ...]) -> None:
        """Unpin ``request_ids`` now (their state was dropped on every rank)."""
        for rid in request_ids:
            self._owners.pop(rid, None)
