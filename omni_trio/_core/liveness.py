"""Worker liveness, decided purely (no trio, no clock: ``now`` is passed in).

Every backend's executor feeds one :class:`LivenessTracker` what it hears from its ranks and
asks it, every :attr:`~LivenessTracker.poll_s`, whether the group is still alive:

- **silence**: a rank that sends nothing (no heartbeat, no reply) for ``heartbeat_timeout_s``
  is hung, whatever it is doing (``StallError("worker")``);
- **no progress**: while a call is in flight, a rank whose denoising-step count does not move
  for ``stall_timeout_s`` is hung (``StallError("forward")``).  The clock starts when the call
  starts, so time spent idle never counts, and a slow but healthy render keeps moving;
- **a dead output packer**: a rank that reports its packer thread gone
  (``WorkerError("PackerDied")``): its outputs would never come.

Either timeout may be None (that check is off).  The first verdict is final: once the tracker
has judged the group dead it says so on every later check.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ..errors import StallError, WorkerError

__all__ = ["HEARTBEAT_INTERVAL_S", "MAX_POLL_S", "LivenessTracker", "RankLiveness"]

# How often every worker of a process backend sends its executor a heartbeat.
HEARTBEAT_INTERVAL_S = 1.0
# The longest the executor waits between two checks (shorter when a timeout is shorter).
MAX_POLL_S = 1.0
_MIN_POLL_S = 0.01


@dataclass(slots=True)
class RankLiveness:
    """What the tracker knows of one rank."""

    last_heard: float
    steps: int = 0
    last_progress: float = 0.0
    calls: int = 0  # calls in flight on this rank
    packer_alive: bool = True


@dataclass
class LivenessTracker:
    """Liveness of ``ranks`` workers; see the module docstring."""

    ranks: int
    heartbeat_timeout_s: float | None
    stall_timeout_s: float | None
    _state: dict[int, RankLiveness] = field(default_factory=dict, init=False)
    _verdict: BaseException | None = field(default=None, init=False)
    #: The rank the verdict is about (None before one).
    verdict_rank: int | None = field(default=None, init=False)

    @property
    def poll_s(self) -> float:
        """How often to :meth:`check`: a quarter of the shortest timeout, at most
        :data:`MAX_POLL_S` (so a verdict comes at most a quarter late)."""
        timeouts = [t for t in (self.heartbeat_timeout_s, self.stall_timeout_s) if t is not None]
        if not timeouts:
            return MAX_POLL_S
        return max(_MIN_POLL_S, min(MAX_POLL_S, min(timeouts) / 4))

    def start(self, now: float) -> None:
        """Every rank is up (just started) at ``now``."""
        self._state = {
            rank: RankLiveness(last_heard=now, last_progress=now) for rank in range(self.ranks)
        }

    def pardon(self, ranks: Iterable[int]) -> None:
        """``ranks`` are written off on their own (a data-parallel rank group restarting
        while the others serve): a verdict about one of them is withdrawn and they are no
        longer watched until :meth:`resume`."""
        ranks = set(ranks)
        for rank in ranks:
            self._state.pop(rank, None)
        if self.verdict_rank in ranks:
            self._verdict, self.verdict_rank = None, None

    def resume(self, ranks: Iterable[int], now: float) -> None:
        """``ranks`` are up again (just restarted) at ``now``."""
        for rank in ranks:
            self._state[rank] = RankLiveness(last_heard=now, last_progress=now)

    def rank(self, rank: int) -> RankLiveness:
        return self._state[rank]

    def steps_of(self, rank: int) -> int | None:
        """The steps ``rank`` has run, as last heard (None before :meth:`start`)."""
        state = self._state.get(rank)
        return state.steps if state is not None else None

    def heard(
        self,
        rank: int,
        now: float,
        *,
        steps: int | None = None,
        packer_alive: bool | None = None,
    ) -> None:
        """Something came from ``rank`` (a heartbeat or a reply), with its step count and
        whether its output packer lives, when it said."""
        state = self._state.get(rank)
        if state is None:
            return
        state.last_heard = now
        if steps is not None and steps != state.steps:
            state.steps = steps
            state.last_progress = now
        if packer_alive is not None:
            state.packer_alive = packer_alive

    def call_started(self, now: float, ranks: Iterable[int] | None = None) -> None:
        """A call was sent to ``ranks`` (None: every rank): the progress clock of an idle
        one starts now."""
        for state in self._states(ranks):
            if state.calls == 0:
                state.last_progress = now
            state.calls += 1

    def call_ended(self, ranks: Iterable[int] | None = None) -> None:
        """A call sent to ``ranks`` (None: every rank) has come back from them (or was
        given up).  A rank that has answered is no longer in the call, however long the
        others take."""
        for state in self._states(ranks):
            state.calls = max(0, state.calls - 1)

    def _states(self, ranks: Iterable[int] | None) -> list[RankLiveness]:
        if ranks is None:
            return list(self._state.values())
        return [self._state[r] for r in ranks if r in self._state]

    @property
    def busy(self) -> bool:
        return any(state.calls for state in self._state.values())

    def check(self, now: float) -> BaseException | None:
        """The group's death sentence, or None while every rank lives."""
        if self._verdict is not None:
            return self._verdict
        beat, stall = self.heartbeat_timeout_s, self.stall_timeout_s
        for rank, state in sorted(self._state.items()):
            if not state.packer_alive:
                self._verdict = WorkerError(
                    "its output packer died or could not send: its outputs would never come",
                    worker=rank,
                    error_type="PackerDied",
                )
            elif beat is not None and now - state.last_heard > beat:
                silent = now - state.last_heard
                self._verdict = StallError("worker", f"worker {rank} silent for {silent:.3f} s")
            elif stall is not None and state.calls and now - state.last_progress > stall:
                idle = now - state.last_progress
                self._verdict = StallError(
                    "forward", f"worker {rank}: no step progress in {idle:.3f} s"
                )
            if self._verdict is not None:
                self.verdict_rank = rank
                return self._verdict
        return None
