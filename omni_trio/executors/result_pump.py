"""The result pump: the only reader of one worker's replies.

A worker answers with :class:`AsyncOutput` messages.  ``RPC_RESULT`` answers an ``rpc_id``;
a request-mode forward answers ``COMPUTE_DONE`` at once (the device is free) and its payload
follows as ``OUTPUT_READY`` when the worker's output packer has finished with it.  The two are
correlated by ``async_output_id`` and may arrive in either order, and either may arrive before
or after anybody waits for it.  The pump resolves every reply by id, never by position (INV-5):

- an ``OUTPUT_READY`` nobody waits for yet is cached until ``wait_output`` takes it;
- a batch's ``OUTPUT_READY`` is split into per-request entries ``{batch_id}/{request_id}``
  once the batch's request ids are known (:meth:`ResultPump.register_batch_split`), whichever of
  the two comes first;
- a result for an output that was dropped (its request aborted) or whose waiter gave up
  (cancelled or timed out) is released through ``on_discard`` instead of cached, so shared
  memory is unlinked and nothing is kept forever (INV-3);
- every wait is bounded (INV-6) and names what is still pending when it runs out;
- a waiter that is cancelled never disturbs the pump.

All methods run in the trio thread of the run that owns the pump; it holds no locks.  A
foreign thread (the in-process worker and its output packer) reaches it through
:class:`ThreadReplySender` and a memory channel.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import AsyncIterable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import trio
from trio_typing import TaskStatus

from .._core.messages import AsyncOutput, AsyncOutputKind, BatchRunnerOutput, RunnerOutput
from ..errors import EngineClosedError, EngineDeadError, StallError, WorkerError

__all__ = [
    "ASYNC_OUTPUT_TIMEOUT_ENV",
    "DEFAULT_ASYNC_OUTPUT_TIMEOUT_S",
    "MISSING_BATCH_OUTPUT",
    "ResultPump",
    "ResultPumpStatistics",
    "ThreadReplySender",
    "async_output_timeout_s",
    "batch_output_key",
]

log = logging.getLogger(__name__)

ASYNC_OUTPUT_TIMEOUT_ENV = "OMNI_TRIO_ASYNC_OUTPUT_TIMEOUT"
DEFAULT_ASYNC_OUTPUT_TIMEOUT_S = 600.0
# The error text of a per-request entry that a batch output did not contain.
MISSING_BATCH_OUTPUT = "No output result for batch request"
# How many ids of each kind describe_pending() names.
_DESCRIBE_FIRST = 5

# A bad OMNI_TRIO_ASYNC_OUTPUT_TIMEOUT is reported once per process, not once per pump.
_warned_bad_timeout = False


def async_output_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """The default bound of a pump wait: ``$OMNI_TRIO_ASYNC_OUTPUT_TIMEOUT`` seconds, or 600.

    ``inf`` is accepted (no bound).  A value that is not a positive number is ignored with a
    warning, logged once per process.
    """
    global _warned_bad_timeout
    raw = (os.environ if environ is None else environ).get(ASYNC_OUTPUT_TIMEOUT_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_ASYNC_OUTPUT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if value > 0:  # False for NaN as well
        return value
    if not _warned_bad_timeout:
        _warned_bad_timeout = True
        log.warning(
            "ignoring %s=%r: not a positive number of seconds; using %g s",
            ASYNC_OUTPUT_TIMEOUT_ENV,
            raw,
            DEFAULT_ASYNC_OUTPUT_TIMEOUT_S,
        )
    return DEFAULT_ASYNC_OUTPUT_TIMEOUT_S


def batch_output_key(batch_id: str, request_id: str) -> str:
    """The key under which one request's part of a split batch output is awaited."""
    return f"{batch_id}/{request_id}"


@dataclass(frozen=True, slots=True)
class ResultPumpStatistics:
    """A snapshot of a pump's bookkeeping (``ResultPump.statistics()``)."""

    pending_rpcs: int  # registered and not answered yet
    waiting_outputs: int  # a wait_output is blocked on them
    cached_outputs: int  # arrived, nobody has taken them yet
    dropped_outputs: int  # tombstones: a late arrival is released, not cached
    unsplit_batches: int  # split registered, batch output not arrived yet
    discarded: int  # payloads released through on_discard so far
    failed: bool


@dataclass(frozen=True, slots=True)
class _Result:
    """What a waiter receives: a value, a worker's error text, or the pump's failure."""

    value: Any = None
    error: str | None = None
    error_type: str | None = None
    failure: BaseException | None = None
    traceback: str | None = None
    fatal: bool = False


# What a claim's callback is given: (payload, None) or (None, the error).
OutputCallback = Callable[[Any, "BaseException | None"], None]


class _Waiter:
    """One wait.  ``result`` is written once, by the pump, then ``event`` is set (and a
    claim's ``callback`` called; ``worker`` names the pump's worker in its errors)."""

    __slots__ = ("awaited", "callback", "event", "result", "worker")

    def __init__(
        self, callback: OutputCallback | None = None, worker: int | str | None = None
    ) -> None:
        self.event = trio.Event()
        self.result: _Result | None = None
        self.awaited = False  # a wait_* call has claimed it (one waiter per id)
        self.callback = callback
        self.worker = worker

    def resolve(self, result: _Result) -> None:
        self.result = result
        self.event.set()
        callback = self.callback
        if callback is None:
            return
        self.callback = None
        try:
            if result.failure is not None:
                callback(None, result.failure)
            elif result.error is not None:
                error = WorkerError(result.error, worker=self.worker, error_type=result.error_type)
                callback(None, error)
            else:
                callback(result.value, None)
        except Exception:  # the claimant's bug must not take the pump down
            log.exception("output callback failed")


class ResultPump:
    """Resolves a worker's replies by ``rpc_id`` and ``async_output_id``.

    Start it with ``await nursery.start(pump.serve, replies)``; it reads until the replies end.
    ``on_discard(payload)`` is called for every payload nobody will ever take (dropped,
    abandoned, unexpected, duplicate, or left when the pump fails), so the owner can release
    what the payload holds (shared memory).  ``default_timeout_s`` bounds every wait that is
    not given its own ``timeout``; it defaults to :func:`async_output_timeout_s`.
    """

    def __init__(
        self,
        *,
        worker: int | str | None = None,
        on_discard: Callable[[Any], None] | None = None,
        default_timeout_s: float | None = None,
    ) -> None:
        self.worker = worker
        self.default_timeout_s = (
            async_output_timeout_s() if default_timeout_s is None else default_timeout_s
        )
        self._on_discard = on_discard
        self._serving = False
        # Set once by fail(); from then on every wait raises it and every arrival is released.
        self._failure: BaseException | None = None
        # rpc id -> waiter; registered before the request is sent, removed when the wait ends.
        self._rpcs: dict[str, _Waiter] = {}
        # output key -> the one task blocked on it; removed when resolved or abandoned.
        self._waiting: dict[str, _Waiter] = {}
        # output key -> a result that arrived first; disjoint from _waiting.
        self._cached: dict[str, _Result] = {}
        # Tombstones: a later arrival under these keys is released.  Disjoint from _waiting
        # and _cached; holds only keys whose arrival is still expected or that a waiter gave up.
        self._dropped: set[str] = set()
        # batch id -> its request ids, until the batch output arrives (then it is split).
        self._splits: dict[str, tuple[str, ...]] = {}
        # Keys announced (COMPUTE_DONE or a split) that have not arrived: drop() may leave a
        # tombstone only for these, so an unknown key never leaves one forever.
        self._expected: set[str] = set()
        self._discarded = 0
        # Pulsed whenever something outstanding may have gone (an arrival, a drop, failure).
        self._changed = trio.Event()

    @property
    def _name(self) -> str:
        return "worker" if self.worker is None else f"worker {self.worker}"

    # ------------------------------------------------------------------ the reader

    async def serve(
        self,
        replies: AsyncIterable[AsyncOutput],
        *,
        task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Read ``replies`` until they end, resolving waiters; the pump's only reader task.

        The pump owns ``replies`` from now on: a trio memory channel is drained (its payloads
        released) and closed when ``serve`` returns.  However ``serve`` ends, the pump then
        fails closed: if nobody called :meth:`fail` first, pending and later waits raise
        :class:`EngineDeadError` (the replies ended or broke) or :class:`EngineClosedError`
        (``serve`` was cancelled).  An error reading ``replies`` propagates after that.
        """
        if self._serving:
            raise RuntimeError("ResultPump.serve is already running (it is the only reader)")
        self._serving = True
        reason: BaseException = EngineClosedError(f"result pump of {self._name} stopped")
        try:
            task_status.started()
            async for reply in replies:
                self.deliver(reply)
            reason = EngineDeadError(f"replies from {self._name} ended")
        except Exception as exc:
            reason = EngineDeadError(f"replies from {self._name} broke: {exc!r}")
            reason.__cause__ = exc
            raise
        finally:
            self.fail(reason)
            if isinstance(replies, trio.MemoryReceiveChannel):
                self._close_channel(replies)

    def _close_channel(self, replies: trio.MemoryReceiveChannel[AsyncOutput]) -> None:
        # Closing a memory channel drops what it buffers; release those payloads first.
        while True:
            try:
                self.deliver(replies.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
        replies.close()

    def deliver(self, reply: AsyncOutput) -> None:
        """Handle one reply now (what ``serve`` does with each).  Never raises; no checkpoint."""
        try:
            if self._failure is not None:
                self._release_reply(reply)
            elif reply.kind is AsyncOutputKind.OUTPUT_READY:
                self._on_output_ready(reply)
            else:
                self._on_rpc_reply(reply)
        except Exception:  # a bug here must not take the reader down with it
            log.exception("result pump of %s could not handle %r", self._name, reply)
        self._pulse()

    def _on_rpc_reply(self, reply: AsyncOutput) -> None:
        waiter = self._rpcs.get(reply.rpc_id) if reply.rpc_id is not None else None
        if waiter is None or waiter.result is not None:
            # Its waiter gave up (cancelled, timed out) or this is a duplicate.
            log.debug("%s: discarding reply to rpc %r nobody waits for", self._name, reply.rpc_id)
            self._release_reply(reply)
            return
        if reply.kind is AsyncOutputKind.COMPUTE_DONE and reply.async_output_id is not None:
            if reply.error is None:
                self._expect(reply.async_output_id)
            else:
                self._forsake_output(reply.async_output_id)
        waiter.resolve(
            _Result(
                value=reply,
                error=reply.error,
                error_type=reply.error_type,
                traceback=reply.traceback,
                fatal=reply.fatal,
            )
        )

    def _on_output_ready(self, reply: AsyncOutput) -> None:
        key = reply.async_output_id
        if key is None:
            log.warning("%s: OUTPUT_READY without async_output_id; discarded", self._name)
            self._release(reply.result)
            return
        self._expected.discard(key)
        request_ids = self._splits.pop(key, None)
        result = _Result(value=reply.result, error=reply.error, error_type=reply.error_type)
        if request_ids is None:
            self._resolve_output(key, result)
        else:
            self._split(key, request_ids, result)

    def _resolve_output(self, key: str, result: _Result) -> None:
        waiter = self._waiting.pop(key, None)
        if waiter is not None:
            waiter.resolve(result)
        elif key in self._dropped:
            self._dropped.discard(key)
            self._release_result(result)
        elif key in self._cached:
            log.warning("%s: duplicate output %r; the second one is discarded", self._name, key)
            self._release_result(result)
        else:
            self._cached[key] = result

    def _split(self, batch_id: str, request_ids: tuple[str, ...], result: _Result) -> None:
        parts: dict[str, RunnerOutput] = {}
        if result.error is not None:
            for rid in request_ids:
                parts[rid] = RunnerOutput(rid, error=result.error, error_type=result.error_type)
            self._release(result.value)
        else:
            payload = result.value
            table: Mapping[str, Any]
            if isinstance(payload, BatchRunnerOutput):
                table = payload.outputs
            elif isinstance(payload, Mapping):
                table = payload
            else:
                log.error(
                    "%s: batch output %r is a %s, not a BatchRunnerOutput; cannot split it",
                    self._name,
                    batch_id,
                    type(payload).__name__,
                )
                table = {}
                self._release(payload)
            wanted = set(request_ids)
            for rid, part in table.items():
                if rid not in wanted:
                    log.warning(
                        "%s: batch %r has an output for unknown request %r",
                        self._name,
                        batch_id,
                        rid,
                    )
                    self._release(part)
            for rid in request_ids:
                part = table.get(rid)
                if part is None:
                    part = RunnerOutput(rid, error=MISSING_BATCH_OUTPUT, error_type="RuntimeError")
                parts[rid] = part
        for rid, part in parts.items():
            key = batch_output_key(batch_id, rid)
            self._expected.discard(key)
            self._resolve_output(key, _Result(value=part))

    # ------------------------------------------------------------------ rpc waits

    def register_rpc(self, rpc_id: str) -> None:
        """Expect a reply to ``rpc_id``; call it *before* sending the request.

        A reply to an id nobody registered is discarded, so registering after sending can lose
        a fast reply.  Raises the pump's failure if it has failed, ``ValueError`` if the id is
        already registered.  No checkpoint.
        """
        self._raise_if_failed()
        if rpc_id in self._rpcs:
            raise ValueError(f"rpc {rpc_id!r} is already registered")
        self._rpcs[rpc_id] = _Waiter()

    def forget_rpc(self, rpc_id: str) -> None:
        """Give up on a registered rpc (e.g. sending it failed).  A late reply is discarded;
        an output it announces is dropped.  Idempotent; no checkpoint."""
        waiter = self._rpcs.get(rpc_id)
        if waiter is not None and not waiter.awaited:
            self._abandon_rpc(rpc_id, waiter)

    async def wait_rpc(self, rpc_id: str, timeout: float | None = None) -> AsyncOutput:
        """Wait for the reply to a registered rpc and return it.

        The reply is an ``RPC_RESULT`` (its ``result`` is the answer) or a ``COMPUTE_DONE``
        (its ``async_output_id`` names the output to :meth:`wait_output` for).  Always
        checkpoints.  Raises :class:`WorkerError` (with the remote ``error_type``) if the reply
        carries an error; the pump's failure if it failed; :class:`StallError` ``"rpc"`` after
        ``timeout`` seconds (default ``default_timeout_s``); ``LookupError`` if ``rpc_id`` was
        never registered.  If cancelled or timed out, the rpc is forgotten: a late reply is
        discarded and the output a late ``COMPUTE_DONE`` announces is dropped.
        """
        self._raise_if_failed()
        waiter = self._rpcs.get(rpc_id)
        if waiter is None:
            raise LookupError(f"rpc {rpc_id!r} is not registered with the pump of {self._name}")
        if waiter.awaited:
            raise RuntimeError(f"rpc {rpc_id!r} is already awaited")
        waiter.awaited = True
        result = await self._wait(
            waiter,
            timeout,
            phase="rpc",
            what=f"reply to rpc {rpc_id!r}",
            abandon=lambda: self._abandon_rpc(rpc_id, waiter),
        )
        if self._rpcs.get(rpc_id) is waiter:
            del self._rpcs[rpc_id]
        reply: AsyncOutput = self._unwrap(result)
        return reply

    def _abandon_rpc(self, rpc_id: str, waiter: _Waiter) -> None:
        if self._rpcs.get(rpc_id) is waiter:
            del self._rpcs[rpc_id]
        result = waiter.result
        if result is not None and result.failure is None:
            self._release_reply(result.value)
        self._pulse()

    # ------------------------------------------------------------------ output waits

    async def wait_output(self, key: str, timeout: float | None = None) -> Any:
        """Wait for the payload of an async output (an ``async_output_id`` or a split key).

        Returns at once if it already arrived.  For a split key the payload is that request's
        :class:`RunnerOutput` (an error one if packing failed or the batch lacked it); for any
        other key it is the ``OUTPUT_READY`` result, and an ``OUTPUT_READY`` error raises
        :class:`WorkerError`.  Always checkpoints.  Raises the pump's failure if it failed,
        :class:`StallError` ``"output"`` after ``timeout`` seconds (default
        ``default_timeout_s``), ``ValueError`` for a batch id that is registered to be split
        and ``RuntimeError`` if another task already waits for ``key``.  If cancelled or timed
        out the output is abandoned: released now if it had arrived, else on arrival.  Waiting
        for a dropped key revives it.
        """
        self._raise_if_failed()
        if key in self._waiting:
            raise RuntimeError(f"output {key!r} is already awaited")
        if key in self._splits:
            raise ValueError(f"output {key!r} is split; wait for its per-request keys")
        waiter = _Waiter()
        waiter.awaited = True
        cached = self._cached.pop(key, None)
        if cached is not None:
            waiter.resolve(cached)
        else:
            self._dropped.discard(key)
            self._waiting[key] = waiter
        result = await self._wait(
            waiter,
            timeout,
            phase="output",
            what=f"output {key!r}",
            abandon=lambda: self._abandon_output(key, waiter),
        )
        return self._unwrap(result)

    def claim(self, key: str, callback: OutputCallback) -> None:
        """Take the payload of an async output without waiting for it: ``callback(payload,
        None)`` is called, on the pump's thread, when it arrives (at once, before this
        returns, if it already has), or ``callback(None, error)`` if it cannot come (an
        ``OUTPUT_READY`` error: :class:`WorkerError`; the pump failed: its failure).  A claim
        is not bounded in time: its owner keeps the deadline.  :meth:`drop` withdraws it.

        Raises as :meth:`wait_output` does for a failed pump, a key already awaited or
        claimed, or a split batch id.  No checkpoint.
        """
        self._raise_if_failed()
        if key in self._waiting:
            raise RuntimeError(f"output {key!r} is already awaited")
        if key in self._splits:
            raise ValueError(f"output {key!r} is split; claim its per-request keys")
        waiter = _Waiter(callback, self.worker)
        waiter.awaited = True
        cached = self._cached.pop(key, None)
        if cached is not None:
            waiter.resolve(cached)
            self._pulse()
        else:
            self._dropped.discard(key)
            self._waiting[key] = waiter

    def _abandon_output(self, key: str, waiter: _Waiter) -> None:
        if self._waiting.get(key) is waiter:
            del self._waiting[key]
            if self._failure is None:
                self._dropped.add(key)
        elif waiter.result is not None:
            self._release_result(waiter.result)

    def register_batch_split(self, batch_id: str, request_ids: Iterable[str]) -> None:
        """Split the output ``batch_id`` into one entry per request, keyed
        :func:`batch_output_key`, whether it already arrived (split now) or not (split on
        arrival).  A request the batch has no output for gets an error :class:`RunnerOutput`
        (:data:`MISSING_BATCH_OUTPUT`).  Raises the pump's failure if it failed, ``ValueError``
        if the batch is already registered or awaited as a whole.  No checkpoint.
        """
        self._raise_if_failed()
        ids = tuple(dict.fromkeys(request_ids))
        if batch_id in self._splits:
            raise ValueError(f"batch {batch_id!r} is already registered for splitting")
        if batch_id in self._waiting:
            raise ValueError(f"batch {batch_id!r} is already awaited as a whole")
        keys = [batch_output_key(batch_id, rid) for rid in ids]
        cached = self._cached.pop(batch_id, None)
        if cached is not None:
            self._split(batch_id, ids, cached)
            return
        self._splits[batch_id] = ids
        self._expected.update(keys)
        if batch_id in self._dropped:  # the batch was dropped whole: drop every part instead
            self._dropped.discard(batch_id)
            self._dropped.update(keys)

    def drop(self, key: str) -> bool:
        """Nobody will wait for ``key`` (its request was aborted): release it.

        A cached result is evicted and released; an output still expected (announced by a
        ``COMPUTE_DONE`` or a split) is released when it arrives instead of being cached; a
        batch registered for splitting drops all its parts; a key some task is waiting for is
        left alone.  Returns whether anything was dropped.  Idempotent; no checkpoint.
        """
        if self._failure is not None:
            return False
        waiter = self._waiting.get(key)
        if waiter is not None:
            if waiter.callback is None:
                return False  # a task waits for it: it decides
            del self._waiting[key]  # a claim: withdrawn, the arrival is released
            self._dropped.add(key)
            self._pulse()
            return True
        request_ids = self._splits.get(key)
        if request_ids is not None:
            for rid in request_ids:
                self.drop(batch_output_key(key, rid))
            return True
        cached = self._cached.pop(key, None)
        if cached is not None:
            self._release_result(cached)
            self._pulse()
            return True
        if key in self._expected or key in self._dropped:
            self._dropped.add(key)
            return True
        return False

    # ------------------------------------------------------------------ failure

    def fail(self, exc: BaseException) -> None:
        """Fail closed: every pending and every later wait raises ``exc``.

        Cached payloads and payloads that arrive from now on are released.  The first failure
        wins; later calls do nothing.  No checkpoint.
        """
        if self._failure is not None:
            return
        self._failure = exc
        failed = _Result(failure=exc)
        for waiter in self._waiting.values():
            waiter.resolve(failed)
        for rpc_id, waiter in list(self._rpcs.items()):
            if waiter.result is None:
                waiter.resolve(failed)
            elif not waiter.awaited:  # answered, but nobody will take the answer now
                self._abandon_rpc(rpc_id, waiter)
        cached = list(self._cached.values())
        self._waiting.clear()
        self._rpcs.clear()
        self._cached.clear()
        self._dropped.clear()
        self._splits.clear()
        self._expected.clear()
        for result in cached:
            self._release_result(result)
        self._pulse()

    @property
    def failed(self) -> bool:
        return self._failure is not None

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure.with_traceback(None)

    # ------------------------------------------------------------------ introspection

    def is_settled(self) -> bool:
        """Nothing is outstanding: no output expected, awaited, claimed, tombstoned (its late
        arrival still to be released), unsplit or cached, and no rpc unanswered."""
        return not (
            self._expected
            or self._waiting
            or self._dropped
            or self._splits
            or self._cached
            or any(w.result is None for w in self._rpcs.values())
        )

    async def wait_settled(self) -> None:
        """Return once :meth:`is_settled` (at once if it is).  Unbounded: callers bound it;
        cancelling it is harmless."""
        while not self.is_settled():
            await self._changed.wait()

    def leftovers(self) -> dict[str, set[str]]:
        """The per-request resources the pump holds, by kind, as owning request ids (see
        :func:`omni_trio.testing.check_leftovers`).  A whole-batch entry that is not split
        yet is owned by every request its payload (when it has arrived) names."""
        return {
            "pump_claims": {_owner(k) for k in self._waiting},
            "pump_cached": {rid for k, r in self._cached.items() for rid in _owners(k, r.value)},
            "pump_tombstones": {_owner(k) for k in self._dropped},
            "pump_unsplit": {rid for ids in self._splits.values() for rid in ids},
        }

    def _pulse(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def statistics(self) -> ResultPumpStatistics:
        return ResultPumpStatistics(
            pending_rpcs=sum(1 for w in self._rpcs.values() if w.result is None),
            waiting_outputs=len(self._waiting),
            cached_outputs=len(self._cached),
            dropped_outputs=len(self._dropped),
            unsplit_batches=len(self._splits),
            discarded=self._discarded,
            failed=self._failure is not None,
        )

    def describe_pending(self) -> str:
        """What the pump is waiting on, for stall messages (first five ids of each kind)."""
        pending_rpcs = [rid for rid, w in self._rpcs.items() if w.result is None]
        parts = [
            f"waiting outputs {_first(self._waiting)}",
            f"cached outputs {_first(self._cached)}",
            f"unsplit batches {_first(self._splits)}",
            f"pending rpcs {_first(pending_rpcs)}",
        ]
        return "; ".join(parts)

    # ------------------------------------------------------------------ helpers

    async def _wait(
        self,
        waiter: _Waiter,
        timeout: float | None,
        *,
        phase: str,
        what: str,
        abandon: Callable[[], None],
    ) -> _Result:
        budget = self.default_timeout_s if timeout is None else timeout
        try:
            with trio.move_on_after(budget):
                await waiter.event.wait()
        except BaseException:  # cancelled from outside: nobody takes the result
            abandon()
            raise
        if waiter.result is None:
            # Described before abandoning, so the message still lists what stalled.
            message = (
                f"{what} from {self._name} not ready after {budget:g} s; "
                f"pending: {self.describe_pending()}"
            )
            abandon()
            raise StallError(phase, message)
        return waiter.result

    def _unwrap(self, result: _Result) -> Any:
        if result.failure is not None:
            raise result.failure.with_traceback(None)
        if result.error is not None:
            raise WorkerError(
                result.error,
                worker=self.worker,
                error_type=result.error_type,
                traceback_text=result.traceback,
                fatal=result.fatal,
            )
        return result.value

    def _expect(self, key: str) -> None:
        if key not in self._cached:
            self._expected.add(key)

    def _forsake_output(self, key: str) -> None:
        # An announced output nobody will wait for: evict it or tombstone it.
        self._expect(key)
        self.drop(key)

    def _release_reply(self, reply: AsyncOutput) -> None:
        # Nobody takes this COMPUTE_DONE, so nobody will wait for the output it announces.
        announced = reply.async_output_id
        done = reply.kind is AsyncOutputKind.COMPUTE_DONE
        if done and announced is not None and self._failure is None:
            self._forsake_output(announced)
        self._release(reply.result)

    def _release_result(self, result: _Result) -> None:
        if result.failure is None:
            self._release(result.value)

    def _release(self, payload: Any) -> None:
        if payload is None:
            return
        self._discarded += 1
        if self._on_discard is None:
            return
        try:
            self._on_discard(payload)
        except Exception:
            log.exception("%s: on_discard failed for a discarded payload", self._name)


def _owner(key: str) -> str:
    """The request a per-request key ``{batch_id}/{request_id}`` belongs to (ids may hold
    "/"), or the key itself for a whole output."""
    _, sep, rid = key.partition("/")
    return rid if sep else key


def _owners(key: str, payload: Any) -> list[str]:
    if "/" not in key and isinstance(payload, BatchRunnerOutput):
        return list(payload.outputs) or [key]
    return [_owner(key)]


def _first(ids: Iterable[str]) -> str:
    ids = list(ids)
    shown = ", ".join(repr(i) for i in ids[:_DESCRIBE_FIRST])
    more = f", +{len(ids) - _DESCRIBE_FIRST} more" if len(ids) > _DESCRIBE_FIRST else ""
    return f"[{shown}{more}]"


class ThreadReplySender:
    """The in-process reply transport: a ``reply`` callable any thread may call.

    Each call schedules ``send_channel.send_nowait(reply)`` on the trio run (FIFO, never
    blocking the caller), so the in-process worker and its output packer feed the same
    :class:`ResultPump` a remote worker would.  ``send_channel`` must be unbounded
    (``trio.open_memory_channel(math.inf)``).  A reply that cannot be delivered (the pump's end
    is closed, the run is over, or this sender is closed) has its payload released through
    ``on_discard``.  Construct it in the trio thread or pass ``trio_token``.
    """

    def __init__(
        self,
        send_channel: trio.MemorySendChannel[AsyncOutput],
        *,
        trio_token: trio.lowlevel.TrioToken | None = None,
        on_discard: Callable[[Any], None] | None = None,
    ) -> None:
        self._send = send_channel
        self._token = trio_token if trio_token is not None else trio.lowlevel.current_trio_token()
        self._on_discard = on_discard
        # Guards _closed and orders every call's scheduling before close's.
        self._lock = threading.Lock()
        self._closed = False

    def __call__(self, reply: AsyncOutput) -> None:
        with self._lock:
            if not self._closed:
                try:
                    self._token.run_sync_soon(self._put, reply)
                    return
                except trio.RunFinishedError:
                    pass
        log.debug(
            "reply %s %r not delivered: sender closed", reply.kind.value, reply.async_output_id
        )
        self._discard(reply)

    def close(self) -> None:
        """Close the channel after every reply already sent; idempotent, any thread.

        The pump's ``serve`` then sees the replies end.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._token.run_sync_soon(self._send.close)
            except trio.RunFinishedError:
                pass

    def _put(self, reply: AsyncOutput) -> None:
        try:
            self._send.send_nowait(reply)
        except trio.WouldBlock:
            log.error("reply channel is full (it must be unbounded); reply discarded")
            self._discard(reply)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._discard(reply)

    def _discard(self, reply: AsyncOutput) -> None:
        if reply.result is None or self._on_discard is None:
            return
        try:
            self._on_discard(reply.result)
        except Exception:
            log.exception("on_discard failed for an undelivered reply")


def register_async_outputs(pump: ResultPump, result: BatchRunnerOutput) -> None:
    """Register the batch splits announced by a request-mode result: every runner output with
    an ``async_output_id`` of the form ``{batch_id}/{request_id}``."""
    batches: dict[str, list[str]] = {}
    for output in result:
        if output.async_output_id:
            batch_id, _, rid = output.async_output_id.partition("/")  # ids may hold "/"
            batches.setdefault(batch_id, []).append(rid)
    for batch_id, request_ids in batches.items():
        pump.register_batch_split(batch_id, request_ids)
