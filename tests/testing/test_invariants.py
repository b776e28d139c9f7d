"""The invariant checker over hand-made traces: every normal path is clean, every kind of
violation is caught with the right label and the request's history."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from omni_trio._core.lifecycle import RequestStatus
from omni_trio._core.trace import TraceEvent, TraceKind, TraceRecorder
from omni_trio.testing.invariants import (
    INVARIANTS,
    STALL_PHASES,
    STRICT_KINDS,
    InvariantViolation,
    Violation,
    assert_trace_ok,
    check_inv1_single_owner,
    check_inv2_execution_follows_schedule,
    check_inv3_terminal_cleanup,
    check_inv4_no_second_lifecycle,
    check_inv5_identity,
    check_inv6_bounded_waits,
    check_inv7_prompt_cancellation,
    check_leftovers,
    check_trace,
)

K = TraceKind
DONE = "FINISHED_COMPLETED"
ABORTED = "FINISHED_ABORTED"
ERROR = "FINISHED_ERROR"
CLEAN_LEFTOVERS: dict[str, Any] = {
    "open_streams": 0,
    "scheduler_states": 0,
    "pending_outputs": 0,
    "threads": [],
    "shm_segments": [],
    "processes": [],
}


class Trace:
    """A tiny trace builder: each call records one event ``dt`` seconds after the previous."""

    def __init__(self) -> None:
        self.rec = TraceRecorder()
        self.now = 0.0
        self.seeds: dict[str, int] = {}
        self._step = 0

    @property
    def events(self) -> list[TraceEvent]:
        return self.rec.events

    def ev(
        self,
        kind: TraceKind,
        rid: str | None = None,
        *,
        dt: float = 0.01,
        step_id: int | None = None,
        worker: int | None = None,
        **detail: Any,
    ) -> Trace:
        self.now += dt
        self.rec.record(self.now, kind, rid, step_id=step_id, worker=worker, detail=detail)
        return self

    def next_step(self) -> int:
        self._step += 1
        return self._step

    # request events
    def admit(self, rid: str, *, seed: int | None = None, mode: str = "request") -> Trace:
        seed = seed if seed is not None else 1000 + len(self.seeds)
        self.seeds[rid] = seed
        return self.ev(K.ADMIT, rid, seed=seed, steps=4, mode=mode)

    def schedule(self, rid: str, step: int) -> Trace:
        return self.ev(K.SCHEDULE, rid, step_id=step)

    def start(self, rid: str, step: int) -> Trace:
        return self.ev(K.EXEC_START, rid, step_id=step, worker=0)

    def result(self, rid: str, step: int, outcome: str = "ok", *, dt: float = 0.01) -> Trace:
        return self.ev(K.EXEC_RESULT, rid, dt=dt, step_id=step, worker=0, outcome=outcome)

    def run(self, rid: str, outcome: str = "ok") -> int:
        """SCHEDULE, EXEC_START, EXEC_RESULT in a fresh step; returns the step id."""
        step = self.next_step()
        self.schedule(rid, step).start(rid, step).result(rid, step, outcome)
        return step

    def chunk(self, rid: str, index: int) -> Trace:
        return self.ev(K.CHUNK, rid, chunk_index=index)

    def abort(self, rid: str, reason: str = "api", *, dt: float = 0.01) -> Trace:
        return self.ev(K.ABORT, rid, dt=dt, reason=reason)

    def drop(self, rid: str) -> Trace:
        return self.ev(K.CONSUMER_DROP, rid)

    def requeue(self, rid: str, retry: int = 1) -> Trace:
        return self.ev(K.REQUEUE, rid, retry=retry)

    def terminal(
        self, rid: str, status: str = DONE, error_type: str | None = None, *, dt: float = 0.01
    ) -> Trace:
        return self.ev(K.TERMINAL, rid, dt=dt, status=status, error_type=error_type)

    def output(self, rid: str, status: str = DONE, delivered: bool = True) -> Trace:
        return self.ev(K.OUTPUT, rid, status=status, delivered=delivered)

    def cleanup(self, rid: str) -> Trace:
        return self.ev(K.CLEANUP, rid)

    def end(self, rid: str, status: str = DONE, delivered: bool = True) -> Trace:
        """TERMINAL, OUTPUT, CLEANUP."""
        return self.terminal(rid, status).output(rid, status, delivered).cleanup(rid)

    def received(
        self,
        rid: str,
        *,
        finished: bool = True,
        chunk_index: int | None = None,
        status: str = DONE,
        identity: Any = "auto",
        seed: Any = "auto",
    ) -> Trace:
        s = self.seeds.get(rid, 0)
        if identity == "auto":
            identity = {"request_id": rid, "seed": s}
        if seed == "auto":
            seed = s
        return self.ev(
            K.RECEIVED,
            rid,
            finished=finished,
            chunk_index=chunk_index,
            status=status,
            identity=identity,
            seed=seed,
        )

    # engine events
    def crash(self) -> Trace:
        return self.ev(K.CRASH, worker=0, generation=1, error_type="WorkerError", error="boom")

    def restart(self) -> Trace:
        return self.ev(K.RESTART, generation=2, backoff_s=0.1)

    def stall(self, phase: Any) -> Trace:
        return self.ev(K.STALL, phase=phase, error="no progress")

    def close(self, leftovers: Any = None) -> Trace:
        self.ev(K.CLOSE)
        return self.ev(K.CLOSED, leftovers=CLEAN_LEFTOVERS if leftovers is None else leftovers)


def verdict(violations: list[Violation]) -> list[tuple[str, str | None, str]]:
    return [(v.invariant, v.request_id, v.message) for v in violations]


# --------------------------------------------------------------------------------------------
# Clean traces


def clean_request_mode_pending_output() -> Trace:
    t = Trace()
    t.admit("r1")
    t.run("r1", "pending")  # compute done, output being packed
    t.end("r1").received("r1")
    return t.close()


def clean_step_mode_with_chunks() -> Trace:
    t = Trace()
    t.admit("s1", mode="step")
    for i in range(3):
        t.run("s1")
        t.chunk("s1", i).received("s1", finished=False, chunk_index=i, status="RUNNING")
    t.run("s1")
    t.end("s1").received("s1", chunk_index=3)
    return t.close()


def clean_abort_while_waiting() -> Trace:
    t = Trace()
    t.admit("r1").admit("r2")
    t.run("r1")
    t.abort("r2").end("r2", ABORTED).received("r2", status=ABORTED, identity=None)
    t.end("r1").received("r1")
    return t.close()


def clean_abort_while_running() -> Trace:
    t = Trace()
    t.admit("r1")
    step = t.next_step()
    t.schedule("r1", step).start("r1", step)
    t.abort("r1").result("r1", step, "aborted")
    t.terminal("r1", ABORTED)
    t.abort("r1", "close")  # a late abort of a finished request is harmless
    t.output("r1", ABORTED).cleanup("r1").received("r1", status=ABORTED, identity=None)
    return t.close()


def clean_abort_ends_running_request_at_once() -> Trace:
    """The engine ends a running request at the abort; its forward's result comes after the
    CLEANUP and is dropped.  Meanwhile the id is admitted again: the late result is still the
    first incarnation's."""
    t = Trace()
    t.admit("r1", seed=1, mode="step")
    t.run("r1")
    step = t.next_step()
    t.schedule("r1", step).start("r1", step)
    t.abort("r1").end("r1", ABORTED)
    t.admit("r1", seed=2, mode="step")
    t.result("r1", step, "aborted")
    t.received("r1", status=ABORTED, identity=None, seed=1)
    t.run("r1")
    t.end("r1").received("r1")
    return t.close()


def clean_abort_after_compute_finished() -> Trace:
    """The abort raced the compute: the TERMINAL after it may be COMPLETED."""
    t = Trace()
    t.admit("r1")
    t.run("r1", "pending")
    t.abort("r1")
    t.end("r1", DONE).received("r1")
    return t.close()


def clean_consumer_drop() -> Trace:
    t = Trace()
    t.admit("s1", mode="step")
    t.run("s1")
    t.chunk("s1", 0).received("s1", finished=False, chunk_index=0, status="RUNNING")
    step = t.next_step()
    t.schedule("s1", step).start("s1", step)
    t.drop("s1").abort("s1", "consumer")
    t.result("s1", step, "ok")
    t.end("s1", ABORTED, delivered=False)
    return t.close()


def clean_crash_requeue_rerun() -> Trace:
    t = Trace()
    t.admit("r1").admit("r2")
    s1 = t.next_step()
    t.schedule("r1", s1).schedule("r2", s1).start("r1", s1).start("r2", s1)
    t.crash().restart()
    t.requeue("r1", 1).requeue("r2", 1)
    t.run("r1")
    t.run("r2", "pending")
    t.crash()  # r2's output was still being packed
    t.requeue("r2", 2).restart()
    t.run("r2")
    t.end("r1").end("r2").received("r2").received("r1")
    return t.close()


def clean_id_reuse_after_cleanup() -> Trace:
    t = Trace()
    t.admit("r1", seed=1)
    t.run("r1")
    t.end("r1")
    t.admit("r1", seed=2)  # a new incarnation; the consumer of the first reads late
    t.received("r1", identity={"request_id": "r1", "seed": 1}, seed=1)
    t.run("r1")
    t.end("r1").received("r1")
    return t.close()


def clean_error_and_concurrent_requests() -> Trace:
    t = Trace()
    for rid in ("a", "b", "c"):
        t.admit(rid)
    step = t.next_step()
    for rid in ("a", "b"):
        t.schedule(rid, step)
    for rid in ("a", "b"):
        t.start(rid, step)
    t.result("a", step, "ok").result("b", step, "error")
    t.end("b", ERROR).end("a")
    t.run("c")
    t.end("c")
    t.received("a").received("b", status=ERROR, identity=None).received("c")
    t.stall("rpc")
    return t.close()


def clean_closed_with_empty_leftovers() -> Trace:
    t = Trace()
    t.admit("r1").run("r1")
    t.end("r1").received("r1")
    return t.close(leftovers=dict(CLEAN_LEFTOVERS, extra=None, flag=False))


CLEAN: dict[str, Callable[[], Trace]] = {
    "request-mode-pending-output": clean_request_mode_pending_output,
    "step-mode-chunks": clean_step_mode_with_chunks,
    "abort-while-waiting": clean_abort_while_waiting,
    "abort-while-running": clean_abort_while_running,
    "abort-ends-running-at-once": clean_abort_ends_running_request_at_once,
    "abort-after-compute-finished": clean_abort_after_compute_finished,
    "consumer-drop": clean_consumer_drop,
    "crash-requeue-rerun": clean_crash_requeue_rerun,
    "id-reuse-after-cleanup": clean_id_reuse_after_cleanup,
    "error-and-concurrent": clean_error_and_concurrent_requests,
    "closed-empty-leftovers": clean_closed_with_empty_leftovers,
}


@pytest.mark.parametrize("build", CLEAN.values(), ids=CLEAN.keys())
def test_clean_trace_has_no_violation(build: Callable[[], Trace]) -> None:
    events = build().events
    assert check_trace(events) == []
    assert check_trace(events, abort_latency_s=1.0, max_idle_s=1.0) == []
    assert check_trace(events, closed=True) == []
    assert_trace_ok(events)


def test_statuses_as_enum_members_or_ints_compare_by_name() -> None:
    t = Trace()
    t.admit("r1").run("r1")
    t.terminal("r1", RequestStatus.FINISHED_COMPLETED)  # type: ignore[arg-type]
    t.output("r1", int(RequestStatus.FINISHED_COMPLETED))  # type: ignore[arg-type]
    t.cleanup("r1").received("r1", status="RequestStatus.FINISHED_COMPLETED")
    assert check_trace(t.close().events) == []


def test_gap_with_a_crash_in_between_is_not_idle() -> None:
    t = Trace()
    t.admit("r1")
    step = t.next_step()
    t.schedule("r1", step).start("r1", step)
    t.crash()
    t.ev(K.RESTART, dt=50.0, generation=2, backoff_s=50.0)
    t.requeue("r1")
    t.run("r1")
    t.end("r1")
    assert check_trace(t.close().events, max_idle_s=5.0) == []


# --------------------------------------------------------------------------------------------
# Bad traces: (invariant, request id or None for engine-wide, builder, check kwargs)


def _one(rid: str = "r1") -> Trace:
    t = Trace()
    t.admit(rid)
    return t


def bad_two_terminals() -> Trace:
    t = _one()
    t.run("r1")
    t.terminal("r1").terminal("r1", ERROR).output("r1").cleanup("r1")
    return t


def bad_two_outputs() -> Trace:
    t = _one()
    t.run("r1")
    return t.terminal("r1").output("r1").output("r1").cleanup("r1")


def bad_output_before_terminal() -> Trace:
    t = _one()
    t.run("r1")
    return t.output("r1").terminal("r1").cleanup("r1")


def bad_output_status_differs() -> Trace:
    t = _one()
    t.run("r1")
    return t.terminal("r1", ERROR).output("r1", DONE).cleanup("r1")


def bad_cleanup_before_output() -> Trace:
    t = _one()
    t.run("r1")
    return t.terminal("r1").cleanup("r1").output("r1")


def bad_admit_twice_before_cleanup() -> Trace:
    t = _one()
    t.run("r1")
    t.admit("r1")
    return t


def bad_closed_without_output_and_cleanup() -> Trace:
    t = _one()
    t.run("r1")
    t.terminal("r1")
    return t.close()


def bad_exec_start_without_schedule() -> Trace:
    t = _one()
    return t.start("r1", 7).result("r1", 7)


def bad_exec_start_other_step() -> Trace:
    t = _one()
    return t.schedule("r1", 1).start("r1", 2)


def bad_exec_result_without_start() -> Trace:
    t = _one()
    return t.schedule("r1", 1).result("r1", 1)


def bad_schedule_after_terminal() -> Trace:
    t = _one()
    t.abort("r1").terminal("r1", ABORTED)
    return t.schedule("r1", 1)


def bad_exec_start_after_terminal() -> Trace:
    t = _one()
    return t.schedule("r1", 1).terminal("r1", ERROR).start("r1", 1)


def bad_schedule_never_admitted() -> Trace:
    t = Trace()
    t.admit("other")
    return t.schedule("ghost", 1)


def bad_schedule_after_cleanup() -> Trace:
    t = _one()
    t.run("r1")
    t.end("r1")
    return t.schedule("r1", 9)


def bad_terminal_without_cleanup_closed() -> Trace:
    t = _one()
    t.run("r1")
    t.terminal("r1")
    return t.close()


def bad_live_at_closed() -> Trace:
    t = _one()
    t.schedule("r1", 1).start("r1", 1)
    return t.close()


def bad_leftovers() -> Trace:
    t = _one()
    t.run("r1")
    t.end("r1")
    return t.close(leftovers=dict(CLEAN_LEFTOVERS, threads=["omni-trio-worker-0"]))


def bad_leftover_count() -> Trace:
    return Trace().close(leftovers=dict(CLEAN_LEFTOVERS, open_streams=2))


def bad_event_after_cleanup() -> Trace:
    t = _one()
    t.run("r1")
    t.end("r1")
    return t.abort("r1")


def bad_second_result_after_cleanup() -> Trace:
    t = _one()
    step = t.run("r1")
    t.end("r1")
    return t.result("r1", step)


def bad_cleanup_after_closed() -> Trace:
    t = _one()
    t.run("r1")
    t.terminal("r1").output("r1")
    t.close()
    return t.cleanup("r1")


def bad_abort_never_admitted() -> Trace:
    t = Trace()
    t.admit("r1").run("r1")
    t.end("r1")
    return t.abort("ghost")


def bad_received_never_admitted() -> Trace:
    t = Trace()
    return t.received("ghost")


def bad_scheduled_twice_same_step() -> Trace:
    t = _one()
    return t.schedule("r1", 3).schedule("r1", 3)


def bad_started_twice_same_step() -> Trace:
    t = _one()
    return t.schedule("r1", 3).start("r1", 3).start("r1", 3)


def bad_identity_swapped() -> Trace:
    t = Trace()
    t.admit("r1").admit("r2")
    t.run("r1")
    t.run("r2")
    t.end("r1").end("r2")
    t.received("r1", identity={"request_id": "r2", "seed": t.seeds["r1"]})
    return t


def bad_identity_seed() -> Trace:
    t = _one()
    t.run("r1")
    t.end("r1")
    return t.received("r1", identity={"request_id": "r1", "seed": -5})


def bad_received_seed() -> Trace:
    t = _one()
    t.run("r1")
    t.end("r1")
    return t.received("r1", identity=None, seed=424242)


def bad_chunk_order() -> Trace:
    t = _one()
    t.run("r1")
    t.chunk("r1", 0).chunk("r1", 1)
    t.received("r1", finished=False, chunk_index=1, status="RUNNING")
    return t.received("r1", finished=False, chunk_index=0, status="RUNNING")


def bad_received_after_finished() -> Trace:
    t = _one()
    t.run("r1")
    t.end("r1")
    return t.received("r1").received("r1", finished=False, chunk_index=None, status="RUNNING")


def bad_received_status() -> Trace:
    t = _one()
    t.run("r1")
    t.end("r1", ERROR)
    return t.received("r1", status=DONE)


def bad_finished_received_before_terminal() -> Trace:
    t = _one()
    t.run("r1")
    return t.received("r1")


def bad_chunk_after_terminal() -> Trace:
    t = _one()
    t.run("r1")
    return t.terminal("r1").chunk("r1", 0)


def bad_chunk_never_admitted() -> Trace:
    t = Trace()
    return t.chunk("ghost", 0)


def bad_output_after_cleanup() -> Trace:
    t = _one()
    t.run("r1")
    t.end("r1")
    return t.output("r1")


def bad_never_terminal_closed() -> Trace:
    t = _one()
    t.run("r1", "pending")
    return t.close()


def bad_stall_unknown_phase() -> Trace:
    return Trace().stall("somewhere")


def bad_stall_no_phase() -> Trace:
    return Trace().stall(None)


def bad_idle_gap() -> Trace:
    t = _one()
    step = t.next_step()
    t.schedule("r1", step).start("r1", step)
    return t.result("r1", step, dt=30.0)


def bad_schedule_after_abort() -> Trace:
    t = _one()
    t.abort("r1")
    return t.schedule("r1", 1)


def bad_exec_start_after_abort() -> Trace:
    t = _one()
    t.schedule("r1", 1).abort("r1")
    return t.start("r1", 1)


def bad_chunk_after_drop() -> Trace:
    t = _one()
    t.run("r1")
    t.drop("r1")
    return t.chunk("r1", 0)


def bad_abort_never_terminal_closed() -> Trace:
    t = _one()
    t.abort("r1")
    return t.close()


def bad_abort_then_cleanup_without_terminal() -> Trace:
    t = _one()
    return t.abort("r1").cleanup("r1")


def bad_abort_then_result_without_terminal() -> Trace:
    t = _one()
    t.schedule("r1", 1).start("r1", 1).abort("r1")
    return t.result("r1", 1, "aborted")


def bad_abort_latency() -> Trace:
    t = _one()
    t.schedule("r1", 1).start("r1", 1).abort("r1")
    t.result("r1", 1, "aborted", dt=5.0)
    return t.terminal("r1", ABORTED)


def bad_forward_runs_on_after_its_abort() -> Trace:
    # The worker measured it: its forward started 17 more steps after the abort reached it.
    t = _one()
    t.schedule("r1", 1).start("r1", 1).abort("r1").terminal("r1", ABORTED)
    return t.ev(K.EXEC_RESULT, "r1", step_id=1, worker=0, outcome="ok", steps_after_abort=17)


BadCase = tuple[str, str | None, Callable[[], Trace], dict[str, Any]]
BAD: dict[str, BadCase] = {
    # INV-1
    "two-terminals": ("INV-1", "r1", bad_two_terminals, {}),
    "two-outputs": ("INV-1", "r1", bad_two_outputs, {}),
    "output-before-terminal": ("INV-1", "r1", bad_output_before_terminal, {}),
    "output-status-differs": ("INV-1", "r1", bad_output_status_differs, {}),
    "cleanup-before-output": ("INV-1", "r1", bad_cleanup_before_output, {}),
    "admit-twice-before-cleanup": ("INV-1", "r1", bad_admit_twice_before_cleanup, {}),
    "closed-missing-output-cleanup": ("INV-1", "r1", bad_closed_without_output_and_cleanup, {}),
    # INV-2
    "exec-start-without-schedule": ("INV-2", "r1", bad_exec_start_without_schedule, {}),
    "exec-start-other-step": ("INV-2", "r1", bad_exec_start_other_step, {}),
    "exec-result-without-start": ("INV-2", "r1", bad_exec_result_without_start, {}),
    "schedule-after-terminal": ("INV-2", "r1", bad_schedule_after_terminal, {}),
    "exec-start-after-terminal": ("INV-2", "r1", bad_exec_start_after_terminal, {}),
    "schedule-never-admitted": ("INV-2", "ghost", bad_schedule_never_admitted, {}),
    "schedule-after-cleanup": ("INV-2", "r1", bad_schedule_after_cleanup, {}),
    # INV-3
    "terminal-without-cleanup": ("INV-3", "r1", bad_terminal_without_cleanup_closed, {}),
    "live-at-closed": ("INV-3", "r1", bad_live_at_closed, {}),
    "leftover-thread": ("INV-3", None, bad_leftovers, {}),
    "leftover-count": ("INV-3", None, bad_leftover_count, {}),
    "event-after-cleanup": ("INV-3", "r1", bad_event_after_cleanup, {}),
    "cleanup-after-closed": ("INV-3", "r1", bad_cleanup_after_closed, {}),
    "second-result-after-cleanup": ("INV-3", "r1", bad_second_result_after_cleanup, {}),
    # INV-4
    "abort-never-admitted": ("INV-4", "ghost", bad_abort_never_admitted, {}),
    "received-never-admitted": ("INV-4", "ghost", bad_received_never_admitted, {}),
    "scheduled-twice-same-step": ("INV-4", "r1", bad_scheduled_twice_same_step, {}),
    "started-twice-same-step": ("INV-4", "r1", bad_started_twice_same_step, {}),
    # INV-5
    "identity-swapped": ("INV-5", "r1", bad_identity_swapped, {}),
    "identity-seed": ("INV-5", "r1", bad_identity_seed, {}),
    "received-seed": ("INV-5", "r1", bad_received_seed, {}),
    "chunk-order": ("INV-5", "r1", bad_chunk_order, {}),
    "received-after-finished": ("INV-5", "r1", bad_received_after_finished, {}),
    "received-status": ("INV-5", "r1", bad_received_status, {}),
    "finished-before-terminal": ("INV-5", "r1", bad_finished_received_before_terminal, {}),
    "chunk-after-terminal": ("INV-5", "r1", bad_chunk_after_terminal, {}),
    "chunk-never-admitted": ("INV-5", "ghost", bad_chunk_never_admitted, {}),
    "output-after-cleanup": ("INV-5", "r1", bad_output_after_cleanup, {}),
    # INV-6
    "never-terminal-closed": ("INV-6", "r1", bad_never_terminal_closed, {}),
    "stall-unknown-phase": ("INV-6", None, bad_stall_unknown_phase, {}),
    "stall-no-phase": ("INV-6", None, bad_stall_no_phase, {}),
    "idle-gap": ("INV-6", "r1", bad_idle_gap, {"max_idle_s": 10.0}),
    # INV-7
    "schedule-after-abort": ("INV-7", "r1", bad_schedule_after_abort, {}),
    "exec-start-after-abort": ("INV-7", "r1", bad_exec_start_after_abort, {}),
    "chunk-after-drop": ("INV-7", "r1", bad_chunk_after_drop, {}),
    "abort-never-terminal-closed": ("INV-7", "r1", bad_abort_never_terminal_closed, {}),
    "abort-then-cleanup": ("INV-7", "r1", bad_abort_then_cleanup_without_terminal, {}),
    "abort-then-result": ("INV-7", "r1", bad_abort_then_result_without_terminal, {}),
    "abort-latency": ("INV-7", "r1", bad_abort_latency, {"abort_latency_s": 1.0}),
    "steps-after-abort": ("INV-7", "r1", bad_forward_runs_on_after_its_abort, {}),
}

PER_INVARIANT: dict[str, Callable[..., list[Violation]]] = {
    "INV-1": check_inv1_single_owner,
    "INV-2": check_inv2_execution_follows_schedule,
    "INV-3": check_inv3_terminal_cleanup,
    "INV-4": check_inv4_no_second_lifecycle,
    "INV-5": check_inv5_identity,
    "INV-6": check_inv6_bounded_waits,
    "INV-7": check_inv7_prompt_cancellation,
}


def _kwargs_for(invariant: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    allowed = {"INV-6": {"max_idle_s"}, "INV-7": {"abort_latency_s"}}.get(invariant, set())
    return {k: v for k, v in kwargs.items() if k in allowed}


@pytest.mark.parametrize(("invariant", "rid", "build", "kwargs"), BAD.values(), ids=BAD.keys())
def test_bad_trace_is_caught(
    invariant: str, rid: str | None, build: Callable[[], Trace], kwargs: dict[str, Any]
) -> None:
    events = build().events
    found = [v for v in check_trace(events, **kwargs) if v.invariant == invariant]
    assert found, f"{invariant} not caught"
    mine = [v for v in found if v.request_id == rid]
    assert mine, verdict(found)
    for v in mine:
        if rid is None:
            assert v.history, v
            assert all(e.request_id is None for e in v.history)
        else:
            # The history is the request's: all its events, in order, and only its.
            assert [e for e in events if e.request_id == rid] == list(v.history)
        if v.seq is not None:
            assert v.seq in {e.seq for e in v.history} or rid is None
    # The per-invariant function finds the same ones.
    alone = PER_INVARIANT[invariant](events, **_kwargs_for(invariant, kwargs))
    assert verdict(alone) == verdict(found)
    with pytest.raises(InvariantViolation) as info:
        assert_trace_ok(events, **kwargs)
    assert invariant in str(info.value)


def test_there_are_enough_bad_cases_for_every_invariant() -> None:
    labels = [case[0] for case in BAD.values()]
    assert len(BAD) >= 25
    assert set(labels) == set(INVARIANTS)


def test_one_step_after_an_abort_is_prompt_enough() -> None:
    t = _one()
    t.schedule("r1", 1).start("r1", 1).abort("r1").terminal("r1", ABORTED)
    t.ev(K.EXEC_RESULT, "r1", step_id=1, worker=0, outcome="aborted", steps_after_abort=1)
    t.output("r1", ABORTED).cleanup("r1")
    assert [v for v in check_trace(t.events) if v.invariant == "INV-7"] == []


def test_idle_gap_needs_max_idle_s_and_abort_latency_needs_abort_latency_s() -> None:
    assert check_trace(bad_idle_gap().events) == []
    assert check_trace(bad_abort_latency().events) == []


# --------------------------------------------------------------------------------------------
# Partial traces, ordering, reports, round trips, size


def partial_running_engine() -> Trace:
    """A snapshot mid-run: requests in every live position, no CLOSED."""
    t = Trace()
    for rid in ("waiting", "running", "packing", "aborting", "terminal", "done", "streaming"):
        t.admit(rid, mode="step" if rid == "streaming" else "request")
    step = t.next_step()
    t.schedule("running", step).start("running", step)
    t.run("packing", "pending")
    s2 = t.next_step()
    t.schedule("aborting", s2).start("aborting", s2).abort("aborting")
    t.drop("aborting")
    t.run("terminal")
    t.terminal("terminal")
    t.run("done")
    t.end("done")
    t.run("streaming")
    t.chunk("streaming", 0).received("streaming", finished=False, chunk_index=0, status="RUNNING")
    t.crash()
    t.requeue("running")
    return t


def test_partial_trace_with_live_requests_is_clean() -> None:
    events = partial_running_engine().events
    assert check_trace(events, abort_latency_s=1.0, max_idle_s=1.0) == []
    assert check_trace(events, closed=False) == []


def test_same_partial_trace_closed_reports_every_live_request() -> None:
    events = partial_running_engine().events
    violations = check_trace(events, closed=True)
    live = {"waiting", "running", "packing", "aborting", "terminal", "streaming"}
    assert {v.request_id for v in violations if v.invariant == "INV-1"} == live
    assert {v.request_id for v in violations if v.invariant == "INV-3"} == live
    assert {v.request_id for v in violations if v.invariant == "INV-6"} == live - {"terminal"}
    assert {v.request_id for v in violations if v.invariant == "INV-7"} == {"aborting"}


def test_truncated_trace_does_not_report_ids_whose_admit_was_dropped() -> None:
    t = Trace()
    t.rec = TraceRecorder(limit=6)
    t.admit("old")
    t.run("old")
    t.end("old")  # ADMIT, SCHEDULE, EXEC_START fall off the front
    t.admit("new").run("new")
    assert t.rec.dropped > 0
    assert check_trace(t.events) == []


def test_violations_are_sorted_by_invariant_then_seq() -> None:
    t = Trace()
    t.admit("a").admit("b")
    t.schedule("b", 1).schedule("b", 1)  # INV-4 at seq 3
    t.start("a", 5)  # INV-2 at seq 4
    t.schedule("a", 2).schedule("a", 2)  # INV-4 at seq 6
    violations = check_trace(t.events)
    keys = [(v.invariant, v.seq) for v in violations]
    assert keys == sorted(keys, key=lambda k: (k[0], k[1] if k[1] is not None else -1))
    assert [v.invariant for v in violations] == ["INV-2", "INV-4", "INV-4"]
    assert [v.request_id for v in violations] == ["a", "b", "a"]


def test_unsorted_input_is_checked_in_seq_order() -> None:
    events = clean_step_mode_with_chunks().events
    assert check_trace(list(reversed(events))) == []


def test_format_names_the_invariant_and_lists_the_history() -> None:
    events = bad_output_status_differs().events
    (v,) = check_inv1_single_owner(events)
    text = v.format()
    lines = text.splitlines()
    assert lines[0].startswith("INV-1 (One lifecycle owner) request 'r1': ")
    assert "FINISHED_COMPLETED" in lines[0] and "FINISHED_ERROR" in lines[0]
    history_lines = lines[2:]
    assert len(history_lines) == len(v.history) == len(events)
    for line, e in zip(history_lines, v.history, strict=True):
        assert f"seq={e.seq}" in line and e.kind.value in line
    marked = [line for line in history_lines if line.lstrip().startswith(">")]
    assert len(marked) == 1 and "output" in marked[0] and "'status'" in marked[0]
    assert "step=1" in text and "worker=0" in text


def test_invariant_violation_str_contains_every_violation_and_history() -> None:
    events = bad_identity_swapped().events
    with pytest.raises(InvariantViolation) as info:
        assert_trace_ok(events)
    exc = info.value
    assert isinstance(exc, AssertionError)
    assert exc.violations and all(isinstance(v, Violation) for v in exc.violations)
    text = str(exc)
    assert text.startswith(f"{len(exc.violations)} invariant violation(s):")
    for v in exc.violations:
        assert v.format() in text
    assert "'request_id': 'r2'" in text  # the swapped identity, from the history's detail


def test_engine_violation_format_says_engine() -> None:
    (v,) = check_inv6_bounded_waits(bad_stall_unknown_phase().events)
    assert v.request_id is None
    assert "INV-6 (Bounded waits) engine:" in v.format()
    assert "somewhere" in v.format()


@pytest.mark.parametrize(
    "build",
    [
        clean_crash_requeue_rerun,
        clean_id_reuse_after_cleanup,
        bad_identity_swapped,
        bad_leftovers,
        *[case[2] for case in BAD.values()][::5],
    ],
)
def test_json_lines_round_trip_keeps_the_verdict(build: Callable[[], Trace]) -> None:
    t = build()
    text = t.rec.to_json_lines()
    back = TraceRecorder.from_json_lines(text)
    assert back == t.events
    options: list[dict[str, Any]] = [{}, {"max_idle_s": 0.5, "abort_latency_s": 0.5}]
    for kwargs in options:
        assert verdict(check_trace(back, **kwargs)) == verdict(check_trace(t.events, **kwargs))


def test_invariants_table_and_stall_phases() -> None:
    assert list(INVARIANTS) == [f"INV-{i}" for i in range(1, 8)]
    assert all(isinstance(name, str) and name for name in INVARIANTS.values())
    assert set(PER_INVARIANT) == set(INVARIANTS)
    assert {
        "admission",
        "forward",
        "output",
        "packing",
        "rpc",
        "worker",
        "close",
        "restart",
    } == STALL_PHASES
    for phase in sorted(STALL_PHASES):
        assert check_trace(Trace().stall(phase).events) == []


def test_a_recorder_can_be_passed_directly() -> None:
    t = clean_abort_while_running()
    assert check_trace(t.rec) == []
    assert check_trace(bad_two_outputs().rec) != []


def test_hundred_thousand_events() -> None:
    """Linear: 100k events of interleaved requests, with chunks, reuse and crashes."""
    rec = TraceRecorder()
    now = 0.0
    step = 0
    live: list[str] = []
    n = 0
    while len(rec) < 100_000:
        rid = f"r{n % 3000}"  # ids are reused once their incarnation is cleaned up
        n += 1
        now += 0.001
        rec.record(now, K.ADMIT, rid, detail={"seed": n, "steps": 3, "mode": "step"})
        live.append(rid)
        if len(live) < 8:
            continue
        for i in range(3):
            step += 1
            for r in live:
                rec.record(now, K.SCHEDULE, r, step_id=step)
            for r in live:
                rec.record(now, K.EXEC_START, r, step_id=step, worker=0)
            now += 0.001
            for r in live:
                rec.record(now, K.EXEC_RESULT, r, step_id=step, worker=0, detail={"outcome": "ok"})
            for r in live:
                rec.record(now, K.CHUNK, r, detail={"chunk_index": i})
        if n % 97 == 0:
            rec.record(now, K.CRASH, worker=0, detail={"generation": n})
        for r in live:
            rec.record(now, K.TERMINAL, r, detail={"status": DONE, "error_type": None})
            rec.record(now, K.OUTPUT, r, detail={"status": DONE, "delivered": True})
            rec.record(now, K.CLEANUP, r)
            rec.record(now, K.RECEIVED, r, detail={"finished": True, "status": DONE})
        live.clear()
    rec.record(now, K.CLOSED, detail={"leftovers": CLEAN_LEFTOVERS})
    assert check_trace(rec, max_idle_s=1.0, abort_latency_s=1.0) == []


# -- leftovers ------------------------------------------------------------------------------


def _two_requests() -> Trace:
    """``live`` is still running; ``done`` has been cleaned up."""
    t = Trace().admit("live").admit("done")
    t.run("done")
    t.end("done")
    step = t.next_step()
    t.schedule("live", step).start("live", step)
    return t


def test_leftovers_of_live_requests_only_are_clean() -> None:
    t = _two_requests()
    held = {
        "requests": {"live"},
        "streams": {"live"},
        "engine_streams": {"live"},
        "awaited_outputs": set(),
        "pump_claims": set(),
        "stop_flags": {"live"},
    }
    assert check_leftovers(held, t.events) == []
    assert check_leftovers(held, t.events, settled=True) == []


def test_a_strict_kind_holding_a_cleaned_up_request_names_it() -> None:
    t = _two_requests()
    held = {"requests": {"live"}, "pump_cached": {"done"}}
    [v] = check_leftovers(held, t.events)
    assert (v.invariant, v.request_id) == ("INV-3", "done")
    assert "pump_cached still holds request 'done'" in v.message and "cleaned up" in v.message
    assert [e.kind for e in v.history][-1] is K.CLEANUP
    # A whole batch whose forward's answer is not applied yet may wait for it.
    assert check_leftovers(held, t.events, in_flight={"done"}) == []


def test_settling_kinds_are_judged_only_once_the_engine_settled() -> None:
    t = _two_requests()
    held = {"requests": {"live"}, "packer_queue": {"done"}, "stop_flags": {"ghost"}}
    assert check_leftovers(held, t.events) == []
    found = check_leftovers(held, t.events, settled=True)
    assert [(v.request_id, "never admitted" in v.message) for v in found] == [
        ("done", False),
        ("ghost", True),
    ]


def test_a_live_request_the_core_does_not_hold_is_lost() -> None:
    t = _two_requests()
    [v] = check_leftovers({"requests": set()}, t.events)
    assert v.request_id == "live" and "holds nothing" in v.message


@pytest.mark.parametrize(
    ("core_kind", "shell_kind"),
    [("streams", "engine_streams"), ("awaited_outputs", "pump_claims")],
)
def test_the_core_and_its_shell_must_agree(core_kind: str, shell_kind: str) -> None:
    t = _two_requests()
    held = {"requests": {"live"}, core_kind: {"live"}, shell_kind: set()}
    [v] = check_leftovers(held, t.events)
    assert v.request_id == "live"
    assert f"{core_kind} holds request 'live' but {shell_kind} does not" in v.message


def test_every_engine_side_kind_is_strict() -> None:
    assert {"requests", "streams", "engine_streams", "pump_claims", "pump_cached"} <= STRICT_KINDS


def test_shared_memory_left_once_settled_is_reported() -> None:
    t = _two_requests()
    held = {"requests": {"live"}, "shm_segments": {"omni_trio_ab_" + "0" * 32}}
    assert check_leftovers(held, t.events) == []
    [v] = check_leftovers(held, t.events, settled=True)
    assert v.request_id is None and "shm_segments still holds 'omni_trio_ab_" in v.message


# --------------------------------------------------------------------------------------------
# The liveness oracle


def _liveness(trace: Trace, after: float, **kwargs: Any) -> list[Violation]:
    from omni_trio.testing.invariants import check_liveness

    kwargs.setdefault("bound_s", 1.0)
    return check_liveness(trace.events, trace.now + after, **kwargs)


def test_liveness_a_request_moving_within_its_bound_is_fine() -> None:
    t = Trace().admit("a").ev(K.SCHEDULE, "a", step_id=1).ev(K.EXEC_START, "a", step_id=1)
    assert _liveness(t, 0.9) == []


@pytest.mark.parametrize(
    ("build", "phase"),
    [
        (lambda t: t.ev(K.SCHEDULE, "a", step_id=1).ev(K.EXEC_START, "a", step_id=1), "forward"),
        (
            lambda t: t.ev(K.EXEC_START, "a", step_id=1).ev(
                K.EXEC_RESULT, "a", step_id=1, outcome="pending"
            ),
            "packing",
        ),
        (lambda t: t.ev(K.ABORT, "a", reason="api"), "being aborted"),
        (lambda t: t.ev(K.CHUNK, "a", chunk_index=0), "streaming"),
    ],
)
def test_liveness_a_request_stuck_in_a_phase_is_named(
    build: Callable[[Trace], Trace], phase: str
) -> None:
    t = build(Trace().admit("a"))
    found = _liveness(t, 1.5)
    assert [v.invariant for v in found] == ["INV-6"]
    assert phase in found[0].message and found[0].request_id == "a"


def test_liveness_a_queued_request_waits_for_the_engine_not_for_itself() -> None:
    t = Trace().admit("a").admit("b").ev(K.EXEC_START, "a", step_id=1)
    t.ev(K.EXEC_RESULT, "a", step_id=1, outcome="ok", dt=0.9)
    t.ev(K.EXEC_START, "a", step_id=2, dt=0.9)  # b has not moved for 1.8 s, but a has
    assert _liveness(t, 0.5) == []
    found = _liveness(t, 1.5)  # now nobody has moved for 1.5 s
    assert {v.request_id for v in found} == {"a", "b"}
    assert any("queued" in v.message for v in found if v.request_id == "b")


def test_liveness_a_starved_request_is_caught_by_the_queue_bound() -> None:
    t = Trace().admit("low").admit("a")
    for step in range(1, 30):
        t.ev(K.EXEC_START, "a", step_id=step, dt=0.2)
    assert _liveness(t, 0.1) == []  # no queue bound: waiting while others run is fine
    found = _liveness(t, 0.1, queue_bound_s=5.0)
    assert [v.request_id for v in found] == ["low"] and "starved" in found[0].message


def test_liveness_a_restart_gets_its_own_bound() -> None:
    t = Trace().admit("a").ev(K.EXEC_START, "a", step_id=1).ev(K.CRASH, worker=0, generation=1)
    assert _liveness(t, 3.0, restart_bound_s=5.0) == []
    assert _liveness(t, 6.0, restart_bound_s=5.0)
    t.ev(K.RESTART, generation=2, dt=4.0).ev(K.REQUEUE, "a", retry=1)
    assert _liveness(t, 0.5, restart_bound_s=5.0) == []


def test_liveness_a_terminal_output_must_reach_its_consumer() -> None:
    t = Trace().admit("a").ev(K.EXEC_START, "a", step_id=1)
    t.ev(K.EXEC_RESULT, "a", step_id=1, outcome="ok").ev(K.TERMINAL, "a", status=DONE)
    found = _liveness(t, 1.5)
    assert found and "no OUTPUT" in found[0].message
    t.ev(K.OUTPUT, "a", status=DONE, delivered=True)
    found = _liveness(t, 1.5)
    assert found and "consumer has not received it" in found[0].message
    assert _liveness(t, 1.5, dropped={"a"}) == []  # its consumer was stopped
    t.ev(K.RECEIVED, "a", finished=True, chunk_index=0)
    assert _liveness(t, 5.0) == []
