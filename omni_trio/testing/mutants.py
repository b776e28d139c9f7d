"""Planted bugs ("mutants"): how strong is the fuzzer?

A *mutant* is a plausible one-line mistake in the runtime, the kind a contributor makes and
a reviewer may miss: a falsy check where ``is None`` was meant, a forgotten line, a loop that
pairs by position instead of by id.  Each :class:`Mutant` names the invariant it breaks
(``"INV-1"`` .. ``"INV-7"``, see docs/invariants.md), says in one line what the bug is, and
installs it with its ``patch`` function, which monkeypatches a module attribute or a class
method (a wrapper or a small replacement) through a :class:`Patcher`.  No source file is
ever edited: :func:`applied` installs the bug for the length of a ``with`` block and puts
every original back on the way out, even on an error::

    from omni_trio.testing.mutants import applied, find_mutant

    with applied(find_mutant("seed-zero-random")):
        ...  # every engine opened here treats an explicit seed=0 as "no seed"

A mutant is applied in the calling process only: it reaches what runs there (the engine
core, its trio shell, the executors and the result pump, the in-process worker with its
runner, step runner and output packer), not worker processes.  ``options`` holds the
:class:`~omni_trio.testing.machine.MachineOptions` fields a campaign needs to reach the bug
(step mode, a batch size, pictures, a scheduling policy); empty means the defaults (a
request-mode campaign on the inproc backend, whose batches fuse several requests).
:data:`MUTANTS` is the shipped catalogue; ``tests/testing/test_mutants.py`` shows, for every
one of them, a targeted scenario that the runtime passes and the mutant fails.

**Adding one.**  Write a patch function and a :class:`Mutant` in a module of your own::

    # my_mutants.py
    from omni_trio._core import engine_core
    from omni_trio.testing.mutants import Mutant, Patcher

    def _no_output_timeout(patcher: Patcher) -> None:
        patcher.setattr(engine_core.EngineCore, "expire", lambda self, now: [])

    NO_OUTPUT_TIMEOUT = Mutant(
        name="expire-does-nothing",
        invariant="INV-6",
        summary="expire() returns at once: no output deadline and no deadline_s ever fires",
        patch=_no_output_timeout,
    )

and pass ``my_mutants:NO_OUTPUT_TIMEOUT`` wherever a mutant is named
(``omni-trio fuzz --mutant my_mutants:NO_OUTPUT_TIMEOUT``, ``omni-trio bench fuzz-power
--mutant ...``); :func:`find_mutant` resolves a shipped name or such a path.  Keep a patch
to what one wrong line would do, wrap rather than copy where you can (a copy goes stale as
the runtime changes), and prove the bug is real with a direct scenario that passes without
it and fails with it before asking whether a campaign finds it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = ["MUTANTS", "Mutant", "Patcher", "applied", "find_mutant"]

_NOTSET: Any = object()


class Patcher:
    """Sets attributes and remembers what was there, so that :meth:`undo` restores it.

    A class attribute is recorded from the class's own ``__dict__`` (a method it inherits
    is removed again on undo, never copied onto the subclass); a module's or an instance's
    likewise from its ``__dict__``.  Setting an attribute that does not exist raises
    ``AttributeError``: a mutant that names something the runtime no longer has is stale.
    """

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []

    def setattr(self, target: Any, name: str, value: Any) -> None:
        """Set ``target.name = value``, recording the original for :meth:`undo`."""
        if not hasattr(target, name):
            raise AttributeError(f"{target!r} has no attribute {name!r} to patch")
        own = getattr(target, "__dict__", None)
        original = own.get(name, _NOTSET) if own is not None else getattr(target, name)
        setattr(target, name, value)
        self._saved.append((target, name, original))

    def undo(self) -> None:
        """Restore every original, last first (idempotent: each is restored once)."""
        while self._saved:
            target, name, original = self._saved.pop()
            if original is _NOTSET:
                delattr(target, name)
            else:
                setattr(target, name, original)

    def __len__(self) -> int:
        """How many attributes are patched now."""
        return len(self._saved)


@dataclass(frozen=True)
class Mutant:
    """One planted bug: see the module docstring."""

    name: str  # kebab-case, stable
    invariant: str  # the invariant it breaks: "INV-1" .. "INV-7"
    summary: str  # one line: what the bug is, as a code reviewer would describe it
    patch: Callable[[Patcher], None] = field(compare=False)  # installs the bug
    # MachineOptions field overrides a campaign needs to reach the bug; empty = defaults.
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        # Read-only, and never shared with the caller's dict.
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))


@contextmanager
def applied(mutant: Mutant) -> Iterator[None]:
    """Install ``mutant`` for the block; every original is restored on the way out, even
    when the block (or the patch itself, part way) raises."""
    patcher = Patcher()
    try:
        mutant.patch(patcher)
        yield
    finally:
        patcher.undo()


def _wrap(patcher: Patcher, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
    """Replace ``owner.name`` by ``make(original)`` (a wrapper calling the original)."""
    original = getattr(owner, name)
    patcher.setattr(owner, name, functools.wraps(original)(make(original)))


# -- the engine core ----------------------------------------------------------------------


def _seed_zero_random(patcher: Patcher) -> None:
    from .._core import engine_core

    def make(real: Any) -> Any:
        def resolve(request: Any, *args: Any) -> Any:
            sp = request.sampling
            if not sp.seed:  # the bug: `if not sp.seed` where `if sp.seed is None` was meant
                request = request.replace(sampling=sp.replace(seed=None))
            return real(request, *args)

        return resolve

    _wrap(patcher, engine_core, "_resolve_defaults", make)


def _deadline_never_fires(patcher: Patcher) -> None:
    from .._core.engine_core import EngineCore

    def times_out(self: Any, request_id: str, admission: int) -> bool:
        entry = self._entries.get(request_id)
        # the bug: `!=` where `==` was meant: only a stale entry (the id admitted again)
        # counts, so a request's own deadline_s never fires
        return entry is not None and entry.admission != admission

    patcher.setattr(EngineCore, "_times_out", times_out)


def _close_ends_only_running(patcher: Patcher) -> None:
    from .._core.engine_core import EngineCore

    def make(real: Any) -> Any:
        def terminate_all(self: Any, *args: Any) -> Any:
            scheduler = self.scheduler

            def started() -> list[str]:  # the bug: the waiting queue is not listed
                return [*scheduler.packing_request_ids(), *scheduler.running_request_ids()]

            vars(scheduler)["live_request_ids"] = started
            try:
                return real(self, *args)
            finally:
                del vars(scheduler)["live_request_ids"]

        return terminate_all

    _wrap(patcher, EngineCore, "_terminate_all", make)


def _aborted_output_stays_cached(patcher: Patcher) -> None:
    from .._core.engine_core import EngineCore

    # The bug: runner_output never drops the outputs a result announces for requests that
    # ended meanwhile (the `self._drop_announced(result, out)` calls are gone).
    patcher.setattr(EngineCore, "_drop_announced", lambda self, result, out: None)


def _abort_while_packing_keeps_claim(patcher: Patcher) -> None:
    from .._core.engine_core import DropOutput, EngineCore

    def make(real: Any) -> Any:
        def abort(self: Any, *args: Any, **kwargs: Any) -> Any:
            # The bug: a PACKING request is ended, but its DropOutput is never issued.
            return [i for i in real(self, *args, **kwargs) if not isinstance(i, DropOutput)]

        return abort

    _wrap(patcher, EngineCore, "abort", make)


def _consumer_drop_not_aborted(patcher: Patcher) -> None:
    from .._core.engine_core import EngineCore
    from .._core.trace import TraceKind

    def consumer_gone(self: Any, request_id: str, now: float) -> list[Any]:
        entry = self._entries.get(request_id)
        if entry is None or not entry.consumer:
            return []
        entry.consumer = False
        self._record(now, TraceKind.CONSUMER_DROP, request_id)
        return []  # the bug: `return self.abort((request_id,), now, reason="consumer")`

    patcher.setattr(EngineCore, "consumer_gone", consumer_gone)


def _packing_lost_with_group_not_requeued(patcher: Patcher) -> None:
    from .._core.engine_core import EngineCore
    from .._core.lifecycle import RequestStatus

    def make(real: Any) -> Any:
        def group_failed(self: Any, *args: Any, **kwargs: Any) -> Any:
            requeue = self._requeue_or_fail
            scheduler = self.scheduler

            def running_only(ids: Any, *rest: Any) -> None:
                # The bug: the `_requeue_or_fail(packing, ...)` line is gone, so a request
                # whose output was being packed has it dropped and is neither run again
                # nor ended.
                kept = [
                    rid
                    for rid in ids
                    if scheduler.get_request_state(rid).status is not RequestStatus.PACKING
                ]
                requeue(kept, *rest)

            vars(self)["_requeue_or_fail"] = running_only
            try:
                return real(self, *args, **kwargs)
            finally:
                del vars(self)["_requeue_or_fail"]

        return group_failed

    _wrap(patcher, EngineCore, "group_failed", make)


def _preview_index_never_advances(patcher: Patcher) -> None:
    from .._core.engine_core import EngineCore

    def make(real: Any) -> Any:
        def emit_chunks(self: Any, *args: Any) -> Any:
            before = {rid: entry.chunks_sent for rid, entry in self._entries.items()}
            try:
                return real(self, *args)
            finally:  # the bug: `entry.chunks_sent += 1` is missing
                for rid, sent in before.items():
                    entry = self._entries.get(rid)
                    if entry is not None:
                        entry.chunks_sent = sent

        return emit_chunks

    _wrap(patcher, EngineCore, "_emit_chunks", make)


# -- the scheduler and its keys -----------------------------------------------------------


def _different_steps_share_a_wave(patcher: Patcher) -> None:
    from .._core import keys, scheduler

    # The bug: RequestScheduler is built with the step-mode key (copy-paste), which leaves
    # the step count and schedule out.
    patcher.setattr(scheduler, "request_batch_key", keys.step_batch_key)


def _conditioning_not_in_batch_key(patcher: Patcher) -> None:
    from .._core import keys

    def make(real: Any) -> Any:
        def shape_and_guidance(request: Any) -> Any:
            # The bug: the conditioning (text, image, inpaint) is left out of the key.
            text = request.sampling.replace(image=None, mask_image=None)
            return real(request.replace(sampling=text))

        return shape_and_guidance

    _wrap(patcher, keys, "_shape_and_guidance", make)


def _aborted_step_state_kept(patcher: Patcher) -> None:
    from .._core.lifecycle import RequestStatus
    from .._core.scheduler import Scheduler

    def make(real: Any) -> Any:
        def finish(self: Any, state: Any, status: Any, *args: Any) -> None:
            real(self, state, status, *args)
            if status is RequestStatus.FINISHED_ABORTED:  # the bug: aborts are not reported
                self._finished_pending.discard(state.request_id)

        return finish

    _wrap(patcher, Scheduler, "_finish", make)


def _preempted_payload_resent(patcher: Patcher) -> None:
    from .._core.scheduler import StepScheduler

    # The bug: StepScheduler lost its `_sends_payload` override, so a preempted request
    # resumes as a new one although its workers still hold its step state.
    patcher.setattr(StepScheduler, "_sends_payload", lambda self, state: True)


# -- the runtime shell --------------------------------------------------------------------


def _consumer_drop_leaks_stream(patcher: Patcher) -> None:
    from ..runtime.request_stream import OutputStreams

    def make(real: Any) -> Any:
        def gone(self: Any, send: Any, request_id: str) -> None:
            ours = self._sends.get(request_id) is send
            real(self, send, request_id)
            if ours:  # the bug: `del self._sends[request_id]` is missing
                self._sends[request_id] = send

        return gone

    _wrap(patcher, OutputStreams, "_gone", make)


def _idle_loop_ignores_rpc(patcher: Patcher) -> None:
    from ..runtime.engine import AsyncEngine

    # The bug: the RPC queue's on_queued hook does not wake the loop, so an RPC queued on an
    # idle engine waits until some request happens to arrive.
    patcher.setattr(AsyncEngine, "_wake_loop", lambda self: None)


# -- executors, result pump, liveness -----------------------------------------------------


def _abort_sets_no_stop_flag(patcher: Patcher) -> None:
    from ..executors.inproc import InprocExecutor

    def abort_requests(self: Any, request_ids: Any) -> None:
        ids = tuple(request_ids)
        if self._worker is not None:
            self._worker.mark_aborted(ids)
        # the bug: `self.stop_flags.abort(ids)` is missing

    patcher.setattr(InprocExecutor, "abort_requests", abort_requests)


def _early_output_ready_never_split(patcher: Patcher) -> None:
    from ..executors.result_pump import ResultPump

    def make(real: Any) -> Any:
        def register_batch_split(self: Any, batch_id: str, request_ids: Any) -> None:
            # The bug: a batch output that arrived before its split was registered is not
            # looked for; the split waits for an arrival that already happened.
            early = self._cached.pop(batch_id, _NOTSET)
            try:
                real(self, batch_id, request_ids)
            finally:
                if early is not _NOTSET:
                    self._cached[batch_id] = early

        return register_batch_split

    _wrap(patcher, ResultPump, "register_batch_split", make)


def _heartbeat_resets_stall_clock(patcher: Patcher) -> None:
    from .._core.liveness import LivenessTracker

    def make(real: Any) -> Any:
        def heard(self: Any, rank: int, now: float, **kwargs: Any) -> None:
            real(self, rank, now, **kwargs)
            state = self._state.get(rank)
            if state is not None:  # the bug: dedented out of `if steps != state.steps:`
                state.last_progress = now

        return heard

    _wrap(patcher, LivenessTracker, "heard", make)


# -- the worker: runner, step runner, stop flags ------------------------------------------


def _fused_row_seed_offset(patcher: Patcher) -> None:
    from ..worker.runner import ModelRunner

    def make(real: Any) -> Any:
        def forward(self: Any, requests: Any, plan: Any) -> Any:
            if len(requests) > 1 and all(r.sampling.seed is not None for r in requests):
                # the bug: manual_seed(seed + i) in the enumerate over the fused rows
                requests = [
                    r.replace(sampling=r.sampling.replace(seed=r.sampling.seed + i))
                    for i, r in enumerate(requests)
                ]
            return real(self, requests, plan)

        return forward

    _wrap(patcher, ModelRunner, "_forward", make)


def _fused_survivors_by_position(patcher: Patcher) -> None:
    import dataclasses

    from ..worker.runner import ModelRunner

    def make(real: Any) -> Any:
        def forward(self: Any, requests: Any, plan: Any) -> Any:
            model = self._model
            raw: list[Any] = []
            generate = model.generate

            def capture(*args: Any, **kwargs: Any) -> Any:
                result = generate(*args, **kwargs)
                raw.append(result)
                return result

            vars(model)["generate"] = capture
            try:
                done, forwarded = real(self, requests, plan)
            finally:
                del vars(model)["generate"]
            if raw and 0 < len(forwarded.items) < len(requests):
                # the bug: `zip(survivors, raw)` where `zip(requests, raw)` and a skip of
                # the aborted rows was meant
                survivors = [request for request, _ in forwarded.items]
                pairs = tuple(zip(survivors, raw[0], strict=False))
                forwarded = dataclasses.replace(forwarded, items=pairs)
            return done, forwarded

        return forward

    _wrap(patcher, ModelRunner, "_forward", make)


def _any_abort_stops_fused_forward(patcher: Patcher) -> None:
    from ..worker.stop_flags import StopFlags

    def should_stop(self: Any, request_ids: Any) -> bool:
        if self._everything:
            return True
        # the bug: `any` where `all` was meant
        return any(rid in self._aborted for rid in request_ids)

    patcher.setattr(StopFlags, "should_stop", should_stop)


def _step_seed_truncated_32bit(patcher: Patcher) -> None:
    from ..worker.step_runner import StepRunner

    def make(real: Any) -> Any:
        def prepare(self: Any, request: Any) -> Any:
            seed = request.sampling.seed
            if seed is None:
                return real(self, request)
            # the bug: manual_seed(seed % 2**32), numpy's seed range, in the step runner
            truncated = request.replace(sampling=request.sampling.replace(seed=seed % 2**32))
            state = real(self, truncated)
            state.request = request
            return state

        return prepare

    _wrap(patcher, StepRunner, "_prepare", make)


# -- shared memory ------------------------------------------------------------------------


def _shm_read_never_unlinks(patcher: Patcher) -> None:
    from ..ipc import shm

    def make(real: Any) -> Any:
        def read_segment(*args: Any) -> Any:
            # The bug: the receiver's `unlink_segment(handle.name)` line is gone (for the
            # length of the read, unlinking is a no-op).
            own = vars(shm)
            unlink = own["unlink_segment"]
            own["unlink_segment"] = lambda name: False
            try:
                return real(*args)
            finally:
                own["unlink_segment"] = unlink

        return read_segment

    _wrap(patcher, shm, "_read_segment", make)


_STEP = {"mode": "step"}

MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "seed-zero-random",
        "INV-5",
        "admission tests `if not seed` instead of `seed is None`: an explicit seed=0 is "
        "replaced by a random one",
        _seed_zero_random,
    ),
    Mutant(
        "fused-row-seed-offset",
        "INV-5",
        "the request-mode runner seeds fused row i with `seed + i`: every request after "
        "the first of a wave is drawn from the wrong seed",
        _fused_row_seed_offset,
    ),
    Mutant(
        "fused-survivors-by-position",
        "INV-5",
        "after a member of a fused wave is aborted mid-forward, the survivors are paired "
        "with the raw outputs by position: a survivor gets the aborted member's image",
        _fused_survivors_by_position,
    ),
    Mutant(
        "abort-sets-no-stop-flag",
        "INV-7",
        "the in-process executor's abort_requests notes the abort but never sets the stop "
        "flags: an aborted forward runs to its end",
        _abort_sets_no_stop_flag,
    ),
    Mutant(
        "any-abort-stops-fused-forward",
        "INV-7",
        "StopFlags.should_stop uses `any` for `all`: aborting one member of a fused wave "
        "stops the whole forward and aborts members nobody aborted",
        _any_abort_stops_fused_forward,
    ),
    Mutant(
        "consumer-drop-not-aborted",
        "INV-7",
        "consumer_gone records the drop but does not abort the request: it keeps being "
        "scheduled and runs to its end for nobody",
        _consumer_drop_not_aborted,
        _STEP,
    ),
    Mutant(
        "early-output-ready-never-split",
        "INV-6",
        "register_batch_split ignores a batch output that arrived before its split was "
        "registered (OUTPUT_READY before COMPUTE_DONE): its requests wait for it forever",
        _early_output_ready_never_split,
    ),
    Mutant(
        "packing-lost-with-group-not-requeued",
        "INV-6",
        "group_failed drops the outputs of PACKING requests but does not requeue them: a "
        "request whose output was lost with its worker group is neither retried nor ended",
        _packing_lost_with_group_not_requeued,
    ),
    Mutant(
        "heartbeat-resets-stall-clock",
        "INV-6",
        "LivenessTracker.heard restarts the stall clock on every report, not only when the "
        "step count moved: a hung forward is never judged stalled",
        _heartbeat_resets_stall_clock,
    ),
    Mutant(
        "idle-loop-ignores-rpc",
        "INV-6",
        "a queued RPC does not wake the engine loop: on an idle engine it waits until its "
        "timeout (forever without one) unless some request arrives",
        _idle_loop_ignores_rpc,
    ),
    Mutant(
        "aborted-output-stays-cached",
        "INV-3",
        "runner_output never drops an output the forward announced for a request that was "
        "aborted meanwhile: the packed output stays cached in the result pump for good",
        _aborted_output_stays_cached,
    ),
    Mutant(
        "abort-while-packing-keeps-claim",
        "INV-3",
        "abort ends a PACKING request without a DropOutput: its output stays claimed in the "
        "result pump for a request that no longer exists",
        _abort_while_packing_keeps_claim,
    ),
    Mutant(
        "aborted-step-state-kept",
        "INV-3",
        "the scheduler does not report aborted ids in finished_req_ids: in step mode the "
        "runner keeps their step state (and stop flags) for good",
        _aborted_step_state_kept,
        _STEP,
    ),
    Mutant(
        "consumer-drop-leaks-stream",
        "INV-3",
        "OutputStreams._gone closes a dropped consumer's channel but keeps it in the table: "
        "the engine holds a stream for a request that ended",
        _consumer_drop_leaks_stream,
    ),
    Mutant(
        "shm-read-never-unlinks",
        "INV-3",
        "the shared-memory receiver copies a payload out but never unlinks its segment: "
        "every payload over 1 MB received stays in /dev/shm (process backends)",
        _shm_read_never_unlinks,
        # Forked workers restart in a fraction of a second: more examples in a budget.
        {"backend": "tractor", "worker_start_method": "forkserver"},
    ),
    Mutant(
        "deadline-never-fires",
        "INV-6",
        "the deadline heap's staleness check is inverted (`!=` for `==`): a request's own "
        "deadline_s never fires, it runs to its end",
        _deadline_never_fires,
    ),
    Mutant(
        "close-ends-only-running",
        "INV-1",
        "close ends the running and packing requests only: waiting ones never get their "
        "terminal output from the core (no TERMINAL, OUTPUT or CLEANUP)",
        _close_ends_only_running,
        {"max_num_seqs": 1},
    ),
    Mutant(
        "different-steps-share-a-wave",
        "INV-2",
        "the request scheduler is built with the step-mode key, which leaves the schedule "
        "out: requests with different step counts share a wave (and its forward fails)",
        _different_steps_share_a_wave,
    ),
    Mutant(
        "conditioning-not-in-batch-key",
        "INV-2",
        "the compatibility key leaves the conditioning out: a text request and a picture "
        "request of one size share a fused forward (which fails both)",
        _conditioning_not_in_batch_key,
        {"pictures": True},
    ),
    Mutant(
        "step-seed-truncated-32bit",
        "INV-5",
        "the step runner seeds each request's generator with `seed % 2**32`: a seed of 2**32 "
        "or more is drawn from another seed than the one it asked for",
        _step_seed_truncated_32bit,
        _STEP,
    ),
    Mutant(
        "preview-index-never-advances",
        "INV-5",
        "_emit_chunks never increments chunks_sent: every preview and the final output of a "
        "step-mode stream carry chunk_index 0",
        _preview_index_never_advances,
        _STEP,
    ),
    Mutant(
        "preempted-payload-resent",
        "INV-5",
        "the step scheduler sends a preempted request's payload again when it resumes: its "
        "workers already hold its step state, refuse it, and the request fails",
        _preempted_payload_resent,
        {"mode": "step", "scheduling_policy": "priority", "max_num_seqs": 1},
    ),
)

_BY_NAME: dict[str, Mutant] = {m.name: m for m in MUTANTS}
assert len(_BY_NAME) == len(MUTANTS), "mutant names must be unique"


def find_mutant(spec: str) -> Mutant:
    """A shipped mutant by name, or a researcher's own as ``"package.module:attribute"``
    (naming a :class:`Mutant` object).

    Raises ``KeyError`` for an unknown name and ``ValueError`` for a path that cannot be
    imported or does not name a :class:`Mutant`; each message is one line and lists the
    shipped names.
    """
    shipped = ", ".join(sorted(_BY_NAME))
    if ":" not in spec:
        try:
            return _BY_NAME[spec]
        except KeyError:
            raise KeyError(
                f"no shipped mutant {spec!r} (shipped: {shipped}; or give "
                "'package.module:attribute' naming a Mutant)"
            ) from None
    from ..errors import InvalidConfigError
    from ..import_path import resolve_import_path

    try:
        found = resolve_import_path(spec, field="mutant", what="Mutant")
    except InvalidConfigError as exc:
        raise ValueError(f"{exc} (shipped mutants: {shipped})") from None
    if not isinstance(found, Mutant):
        raise ValueError(
            f"mutant {spec!r} names an object of type {type(found).__name__}, not an "
            f"omni_trio.testing.mutants.Mutant (shipped mutants: {shipped})"
        )
    return found
