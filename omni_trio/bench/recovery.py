"""``bench recovery``: how fast a supervised engine serves again after a worker fails, and
whether it loses anything when workers are killed again and again under load.

Issues #5, #19 and #22's measurements, four parts (``--parts``, default recovery,soak):

recovery  For each backend of ``--backends`` (``tractor``; ``tractor,ray`` side by side) and
          each fault of ``--faults`` (default all three), ``--repeats`` times: ``--clients``
          (3) clients keep requests coming to an engine (one worker, ``--model``, default
          ``builtin:echo`` with ``--steps`` (4) steps of ``--step-delay-ms`` (20) ms), then:

          - ``kill``: the worker process is SIGKILLed mid-forward;
          - ``hang``: a request hangs the worker at its first step (``HANG_AT_STEP``), with
            ``worker_stall_timeout_s=1`` (the hanging request is aborted once the failure is
            noticed, so its retry does not hang the next group);
          - ``rpc-timeout``: an RPC that hangs in the worker, called with ``timeout=1``.

          From the engine's lifecycle trace: the fault (the kill; the hanging forward's
          start; the RPC's call) -> the group failure noticed (CRASH), -> the new group
          serving (RESTART), -> the first request that ran on the new group completed (the
          recovery time).  Target: recovery <= 3 s for every fault kind with the tiny model.
soak      ``--soak-s`` (60) seconds of the same load on ``tractor``, the worker SIGKILLed
          every ``--kill-every-s`` (4) seconds.  Every request must complete or end with an
          explicit error: retryable (``RequestFailedError.retryable``) or, killed on both
          attempts, quarantined (``RequestFailedError.quarantined``); any other outcome, a
          request that never ends, a shared-memory segment or a worker process left behind
          counts as lost.  Reported: requests completed / retried / failed / lost, restarts.
poison    ``--poison-s`` (60) seconds of bystander load while one request every
          ``--poison-every-s`` (1) seconds crashes the worker it runs on (model option
          ``fault_crash_on_prompt``).  Target: every poison request quarantined, bystander
          success rate >= 0.99, the engine alive at the end.
slow-clients
          A real ``omni-trio serve`` process (``builtin:echo``, inproc) and ``--slow-clients``
          (500) connections that each POST a 256x256 ``b64_json`` generation with a 4 KiB
          receive buffer and never read; after ``--slow-s`` (15) seconds a SIGTERM with them
          still connected.  The daemon runs with ``--max-response-bytes-in-flight`` 64 MiB
          (each answer reserves 260 KiB at admission: ~252 fit), ``--max-queue-len`` = the
          clients (the queue never refuses first), ``--send-timeout`` 60 s (longer than the
          hold: nobody is dropped before the SIGTERM) and ``--drain-timeout`` 5 s.  Each
          reader's answer is peeked, never read: 200 started, 429 ``response_memory_full``,
          429 ``queue_full``, other, none yet.  Targets: the bound fires (>0
          ``response_memory_full``); the daemon's RSS growth <= the response bound + 192 KiB
          per connected client (docs/operations.md); readers still stalled at the SIGTERM;
          SIGTERM to exit <= ``shutdown_bound_s`` (drain + engine close + grace), exit code 0;
          no process of the daemon left.  ``--quick``: 30 readers, a 2 MiB bound (7 answers),
          a 2 s drain, a 3 s hold.

``--start-method`` (``trio`` default, or ``forkserver``) is the tractor engine's
``worker_start_method``: how a restarted worker process is started.

The engine parts (recovery, soak, poison) use ``max_retries_on_worker_failure=1`` and the
default restart backoff (``worker_restart_backoff_s``, 0.05 s doubling per restart in the
window) with an intensity limit high enough for the soak; every other setting is the default
(``close_timeout_s`` 30 s included: a failed group is killed, never waited for).  The recovery
part uses a 1 s restart window and waits 1 s before each fault, so every measured fault is an
isolated failure (backoff 0.05 s), not one whose backoff grew with the faults before it; the
soak keeps the default 60 s window.  The lifecycle traces are also checked with the invariant
checker (violations reported).  ``results["recovery"]`` keeps the first backend's ``kill`` figures;
``results["recovery_by_fault"]`` has every backend and fault.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from .._core.request import DiffusionRequest, SamplingParams
from .._core.trace import TraceKind, TraceRecorder
from ..config import WORKER_START_METHODS, EngineConfig
from ..errors import EngineDeadError, OmniTrioError, RequestFailedError
from ..runtime.engine import AsyncEngine, open_engine
from ..testing.faults import Fault, FaultSpec, with_faults
from .harness import Progress, Report, Summary, run_in_trio

__all__ = ["BACKENDS", "FAULTS", "add_arguments", "recovery_times", "run"]

TARGET_RECOVERY_S = 3.0
BACKENDS = ("tractor", "ray")
FAULTS = ("kill", "hang", "rpc-timeout")
# The hang's stall deadline and the hung RPC's timeout (the measurement settings).
HANG_STALL_S = 1.0
RPC_TIMEOUT_S = 1.0
COLUMNS = ["part", "figure", "n", "median", "min", "max", "target", "met"]
PARTS = ("recovery", "soak", "poison", "slow-clients")
# The slow-client part (issue #22: "500 stalled readers: RSS growth bounded by the configured
# buffer limit, SIGTERM exits within drain + grace").  Each reader asks for one SLOW_SIZE
# square echo image as base64 PNG, whose answer the daemon reserves at admission
# (n * w * h * 4 + 4 KiB: serve.app's estimate, 260 KiB here), so the response bound admits
# about SLOW_RESPONSE_BYTES // 260 KiB of them (~252) and answers the rest 429
# response_memory_full; max_queue_len is the number of clients, so the queue never refuses
# first.  The send timeout is longer than the hold, so the admitted readers are still
# stalled, their answers unsent, when the SIGTERM comes.
SLOW_DRAIN_S = 5.0
SLOW_SEND_TIMEOUT_S = 60.0
SLOW_RESPONSE_BYTES = 64 * 2**20
SLOW_SIZE = 256
# --quick: 30 readers against a bound of 7 answers, a 2 s drain, a 3 s hold.
SLOW_QUICK_CLIENTS = 30
SLOW_QUICK_RESPONSE_BYTES = 2 * 2**20
SLOW_QUICK_DRAIN_S = 2.0
SLOW_QUICK_HOLD_S = 3.0
# What each open connection may hold beyond the response bound (hypercorn's protocol state,
# the request, the decoded images before they are encoded): docs/operations.md states it.
SLOW_PER_CONNECTION_BYTES = 192 * 2**10
# The poison part: the prompt that crashes the worker (model option fault_crash_on_prompt)
# and the bystanders' success rate it must keep.
POISON_PROMPT = "poison"
TARGET_BYSTANDER_SUCCESS = 0.99
_K = TraceKind


def _parts(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"parts are {', '.join(PARTS)}, got {text!r}")
    return parts


def _choices(allowed: tuple[str, ...], what: str) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        items = tuple(p.strip() for p in text.split(",") if p.strip())
        bad = [p for p in items if p not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"{what} are {', '.join(allowed)} (comma-separated), got {text!r}"
            )
        return items

    return parse


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--parts",
        type=_parts,
        default=("recovery", "soak"),
        help="recovery, soak, poison and/or slow-clients (default recovery,soak)",
    )
    parser.add_argument(
        "--backends",
        type=_choices(BACKENDS, "backends"),
        default=("tractor",),
        help="recovery part: the process backends to measure side by side (default tractor; "
        "tractor,ray for both; ray needs the ray extra)",
    )
    parser.add_argument(
        "--faults",
        type=_choices(FAULTS, "faults"),
        default=FAULTS,
        help="recovery part: the faults to measure (default kill,hang,rpc-timeout)",
    )
    parser.add_argument("--model", default="builtin:echo")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--step-delay-ms", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--soak-s", type=_positive_float, default=60.0)
    parser.add_argument("--kill-every-s", type=_positive_float, default=4.0)
    parser.add_argument(
        "--poison-s",
        type=_positive_float,
        default=60.0,
        help="poison part: how long poison requests keep coming",
    )
    parser.add_argument(
        "--slow-clients",
        type=int,
        default=500,
        help="slow-clients part: connections that each send a generation and never read "
        "the answer; max_queue_len is set to this, so the response bound is what refuses "
        f"(--quick: {SLOW_QUICK_CLIENTS})",
    )
    parser.add_argument(
        "--slow-s",
        type=_positive_float,
        default=15.0,
        help="slow-clients part: how long the stalled readers hold on before the SIGTERM; "
        f"the daemon's send timeout is the larger of {SLOW_SEND_TIMEOUT_S:g} s and 4x this, "
        f"so they are still stalled then (--quick: {SLOW_QUICK_HOLD_S:g})",
    )
    parser.add_argument(
        "--poison-every-s",
        type=_positive_float,
        default=1.0,
        help="poison part: one poison request this often",
    )
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument(
        "--start-method",
        choices=WORKER_START_METHODS,
        default="trio",
        help="how worker processes are started (EngineConfig.worker_start_method)",
    )


def _config(
    args: argparse.Namespace,
    *,
    window_s: float = 60.0,
    backend: str = "tractor",
    **overrides: Any,
) -> EngineConfig:
    options: dict[str, Any] = {}
    if args.model == "builtin:echo":
        options["step_delay_s"] = args.step_delay_ms / 1000.0
    return EngineConfig(
        model=args.model,
        model_options=options,
        backend=backend,
        cache_dir=args.cache_dir,
        torch_threads=args.torch_threads,
        warmup=True,
        max_num_seqs=2,
        max_worker_restarts=1000,
        worker_restart_window_s=window_s,
        max_retries_on_worker_failure=1,
        worker_start_method=args.start_method,
        **overrides,
    )


def _params(args: argparse.Namespace, seed: int) -> SamplingParams:
    size = 32 if args.model == "builtin:echo" else None
    return SamplingParams(num_inference_steps=args.steps, seed=seed, height=size, width=size)


def recovery_times(
    events: list[Any], killed_at: float
) -> tuple[float | None, float | None, float | None]:
    """(failure noticed, new group serving, first request of the new group completed), each
    in seconds after ``killed_at``, from a lifecycle trace (None when it did not happen)."""
    crash = next((e for e in events if e.kind is _K.CRASH and e.time >= killed_at), None)
    restart = next(
        (e for e in events if e.kind is _K.RESTART and crash is not None and e.seq > crash.seq),
        None,
    )
    if restart is None:
        return (crash.time - killed_at if crash else None), None, None
    started_after: set[str] = set()
    for e in events:
        if e.seq <= restart.seq or e.request_id is None:
            continue
        if e.kind is _K.EXEC_START:
            started_after.add(e.request_id)
        elif (
            e.kind is _K.TERMINAL
            and e.request_id in started_after
            and e.detail.get("status") == "FINISHED_COMPLETED"
        ):
            assert crash is not None
            return crash.time - killed_at, restart.time - killed_at, e.time - killed_at
    assert crash is not None
    return crash.time - killed_at, restart.time - killed_at, None


class _Load:
    """Clients that keep requests coming and count how each one ended."""

    def __init__(self, engine: AsyncEngine, args: argparse.Namespace) -> None:
        self.engine = engine
        self.args = args
        self.completed = 0
        self.retried_ok = 0
        self.failed_retryable = 0
        self.quarantined = 0
        self.lost: list[str] = []
        self.stopping = False
        self._seq = 0

    async def client(self, index: int) -> None:
        """Submit requests one after another until ``stopping``; the one in flight ends
        on its own (completed or failed), never cancelled."""
        while not self.stopping:
            self._seq += 1
            rid = f"load-{index}-{self._seq}"
            try:
                await self.engine.generate("p", _params(self.args, self._seq), request_id=rid)
                self.completed += 1
            except RequestFailedError as exc:
                if exc.retryable:
                    self.failed_retryable += 1
                elif exc.quarantined:  # its group failed under it on both attempts
                    self.quarantined += 1
                else:
                    self.lost.append(f"{rid}: {exc}")
            except EngineDeadError as exc:
                self.lost.append(f"{rid}: {exc}")
                return


def _kill_worker(engine: AsyncEngine) -> int:
    pids = getattr(engine.executor, "worker_pids", None)
    if not callable(pids):
        raise RuntimeError("bench recovery needs a process backend")
    pid = int(pids()[0])
    os.kill(pid, signal.SIGKILL)
    return pid


async def _wait_healthy(engine: AsyncEngine, timeout: float) -> None:
    """Until ``engine`` is healthy; raises EngineDeadError at once if it is dead (past its
    restart limit, it never will be) and trio.TooSlowError after ``timeout``."""
    with trio.fail_after(timeout):
        while not engine.health().healthy:  # health is a snapshot, no event to wait on
            if engine.is_dead:
                engine.check_health()  # raises EngineDeadError, with the reason
            await trio.sleep(0.01)


async def _recovery_part(args: argparse.Namespace, report: Report, bar: Progress) -> None:
    repeats = args.repeats or (1 if args.quick else 10)
    by_fault: dict[str, dict[str, Any]] = {}
    for backend in args.backends:
        if backend == "ray" and not _ray_installed():
            report.notes.append("ray: not measured (the ray extra is not installed)")
            continue
        trace = TraceRecorder()
        # A 1 s restart window: each measured fault is an isolated failure that pays the
        # first restart's backoff, not a backoff grown by the faults before it.
        config = _config(
            args,
            window_s=1.0,
            backend=backend,
            fault_injection=True,
            worker_stall_timeout_s=HANG_STALL_S,
        )
        async with open_engine(config, trace=trace) as engine:
            load = _Load(engine, args)
            async with trio.open_nursery() as nursery:
                for c in range(args.clients):
                    nursery.start_soon(load.client, c)
                for fault in args.faults:
                    samples: tuple[list[float], list[float], list[float]] = ([], [], [])
                    for n in range(repeats):
                        await _wait_healthy(engine, 60.0)
                        await trio.sleep(1.0)  # past the restart window of the previous one
                        times = await _inject(engine, trace, args, fault, f"{fault}-{n}")
                        for column, value in zip(samples, times, strict=True):
                            column.append(value)
                        bar.advance()
                    by_fault.setdefault(backend, {})[fault] = {
                        "noticed_s": Summary.of(samples[0]),
                        "serving_s": Summary.of(samples[1]),
                        "recovered_s": Summary.of(samples[2]),
                        "target_s": TARGET_RECOVERY_S,
                    }
                    _add_rows(report, f"recovery {backend}", fault, *samples)
                nursery.cancel_scope.cancel()
        _check_trace(
            report, trace, "recovery" if backend == args.backends[0] else f"recovery {backend}"
        )
    report.results["recovery_by_fault"] = by_fault
    first = next(iter(by_fault.values()), {})
    if "kill" in first:
        report.results["recovery"] = first["kill"]


def _ray_installed() -> bool:
    from ..errors import InvalidConfigError
    from ..executors.ray_executor import import_ray

    try:
        import_ray()
    except InvalidConfigError:
        return False
    return True


async def _inject(
    engine: AsyncEngine, trace: TraceRecorder, args: argparse.Namespace, fault: str, rid: str
) -> tuple[float, float, float]:
    """Inject ``fault`` under load; (noticed, serving, recovered) seconds after it."""
    step_s = args.step_delay_ms / 1000.0
    async with trio.open_nursery() as nursery:
        if fault == "kill":
            while engine.statistics().running == 0:  # noqa: ASYNC110 - a snapshot, no event
                await trio.sleep(0.005)
            await trio.sleep(step_s)  # inside a forward
            fault_at = trio.current_time()
            _kill_worker(engine)
        elif fault == "hang":
            hang = with_faults(_params(args, 0), FaultSpec(Fault.HANG_AT_STEP, step=0))
            mark = len(trace)
            nursery.start_soon(_expect_failure, engine.generate("p", hang, request_id=rid))
            fault_at = await _started_at(trace, rid, mark)
        else:
            hang = with_faults(_params(args, 0), FaultSpec(Fault.HANG_AT_STEP, step=0))
            request = DiffusionRequest("p", hang, request_id=rid)
            fault_at = trio.current_time()
            rpc = engine.collective_rpc("execute_model", request, timeout=RPC_TIMEOUT_S)
            nursery.start_soon(_expect_failure, rpc)
        with trio.fail_after(120.0):
            aborted = False
            while True:
                times = recovery_times(trace.events, fault_at)
                if times[0] is not None and fault == "hang" and not aborted:
                    engine.abort(rid)  # its retry would hang the next group too
                    aborted = True
                if times[2] is not None:
                    break
                await trio.sleep(0.005)
    noticed, serving, recovered = times
    assert noticed is not None and serving is not None and recovered is not None
    return noticed, serving, recovered


async def _expect_failure(call: Any) -> None:
    """Await a call that the fault makes fail (or that its abort ends)."""
    try:
        await call
    except OmniTrioError:
        pass


async def _started_at(trace: TraceRecorder, rid: str, mark: int) -> float:
    """When ``rid``'s forward started (its EXEC_START after ``mark``)."""
    with trio.fail_after(60.0):
        while True:
            for event in trace.events[mark:]:
                if event.kind is _K.EXEC_START and event.request_id == rid:
                    return event.time
            await trio.sleep(0.002)


def _add_rows(
    report: Report,
    part: str,
    fault: str,
    noticed: list[float],
    serving: list[float],
    recovered: list[float],
) -> None:
    for name, samples, target in (
        (f"{fault} -> failure noticed (s)", noticed, None),
        (f"{fault} -> new group serving (s)", serving, None),
        (f"{fault} -> first request of the new group done (s)", recovered, TARGET_RECOVERY_S),
    ):
        s = Summary.of(samples)
        report.rows.append(
            {
                "part": part,
                "figure": name,
                "n": s.n,
                "median": f"{s.median:.3f}",
                "min": f"{s.min:.3f}",
                "max": f"{s.max:.3f}",
                "target": "-" if target is None else f"< {target:g}",
                "met": "-" if target is None else ("yes" if s.median <= target else "NO"),
            }
        )


async def _soak_part(args: argparse.Namespace, report: Report, bar: Progress) -> None:
    duration = 6.0 if args.quick else args.soak_s
    trace = TraceRecorder()
    kills = 0
    started = time.perf_counter()
    async with open_engine(_config(args), trace=trace) as engine:
        load = _Load(engine, args)
        async with trio.open_nursery() as nursery:
            for c in range(args.clients):
                nursery.start_soon(load.client, c)
            end = trio.current_time() + duration
            while trio.current_time() < end:
                await trio.sleep(min(args.kill_every_s, max(0.0, end - trio.current_time())))
                if trio.current_time() >= end:
                    break
                await _wait_healthy(engine, 60.0)
                _kill_worker(engine)
                kills += 1
                bar.advance()
            # No new requests; every request in flight must end by itself.
            load.stopping = True
            with trio.fail_after(120.0):
                await _wait_healthy(engine, 60.0)
        stats = engine.statistics()
    from ..ipc import list_our_segments

    leaked_shm = list(list_our_segments())
    lost = list(load.lost)
    if leaked_shm:
        lost.append(f"shared memory left: {leaked_shm}")
    soak = {
        "duration_s": round(time.perf_counter() - started, 1),
        "kills": kills,
        "restarts": stats.restarts,
        "requests_completed": load.completed,
        "requeued": stats.requeued,
        "failed_retryable": load.failed_retryable,
        "quarantined": load.quarantined,
        "lost": lost,
    }
    report.results["soak"] = soak
    for figure, value in (
        ("kills", kills),
        ("restarts", stats.restarts),
        ("requests completed", load.completed),
        ("requests retried after a kill", stats.requeued),
        ("requests failed (retryable, budget used)", load.failed_retryable),
        ("requests quarantined (killed on both attempts)", load.quarantined),
        ("requests lost / leaks", len(lost)),
    ):
        report.rows.append(
            {
                "part": "soak",
                "figure": figure,
                "n": 1,
                "median": value,
                "min": "-",
                "max": "-",
                "target": "0" if figure.startswith("requests lost") else "-",
                "met": ("yes" if value == 0 else "NO")
                if figure.startswith("requests lost")
                else "-",
            }
        )
    for line in lost[:10]:
        report.notes.append(f"lost: {line}")
    _check_trace(report, trace, "soak")


@dataclass
class _Poisons:
    sent: int = 0
    quarantined: int = 0
    other: list[str] = field(default_factory=list)


async def _poison_part(args: argparse.Namespace, report: Report, bar: Progress) -> None:
    """Bystanders keep requests coming while one request every ``--poison-every-s`` crashes
    the worker process it runs in; each must end quarantined, the bystanders must succeed."""
    duration = 6.0 if args.quick else args.poison_s
    trace = TraceRecorder()
    config = _config(args).replace(
        model_options={
            **_config(args).model_options,
            "fault_crash_on_prompt": POISON_PROMPT,
        },
        fault_injection=True,
        # The shipped restart limits, not the bench's: a storm must not use them up.
        max_worker_restarts=EngineConfig().max_worker_restarts,
        worker_restart_window_s=EngineConfig().worker_restart_window_s,
    )
    poisons = _Poisons()
    started = time.perf_counter()

    async def poison(seq: int) -> None:
        try:
            await engine.generate(POISON_PROMPT, _params(args, seq), request_id=f"poison-{seq}")
            poisons.other.append(f"poison-{seq}: completed")
        except RequestFailedError as exc:
            if exc.quarantined:
                poisons.quarantined += 1
            else:
                poisons.other.append(f"poison-{seq}: {exc}")
        except OmniTrioError as exc:
            poisons.other.append(f"poison-{seq}: {exc}")

    async with open_engine(config, trace=trace) as engine:
        load = _Load(engine, args)
        async with trio.open_nursery() as nursery:
            for c in range(args.clients):
                nursery.start_soon(load.client, c)
            async with trio.open_nursery() as senders:
                end = trio.current_time() + duration
                seq = 0
                while trio.current_time() < end:
                    seq += 1
                    poisons.sent = seq
                    senders.start_soon(poison, seq)
                    bar.advance()
                    await trio.sleep(args.poison_every_s)
                load.stopping = True  # the poisons in flight still end on their own
            try:
                await _wait_healthy(engine, 600.0)
            except EngineDeadError:
                pass  # reported below
        stats = engine.statistics()
        survived = not engine.is_dead
    alive = "yes" if survived else "no"
    bystanders = load.completed + load.failed_retryable + load.quarantined + len(load.lost)
    rate = load.completed / bystanders if bystanders else 0.0
    report.results["poison"] = {
        "duration_s": round(time.perf_counter() - started, 1),
        "poison_sent": poisons.sent,
        "poison_quarantined": poisons.quarantined,
        "poison_other": poisons.other,
        "bystanders": bystanders,
        "bystanders_completed": load.completed,
        "bystander_success_rate": round(rate, 4),
        "restarts": stats.restarts,
        "engine_survived": survived,
    }
    rows = [
        ("poison requests sent", poisons.sent, "-", "-"),
        (
            "poison requests quarantined",
            poisons.quarantined,
            "all",
            "yes" if poisons.quarantined == poisons.sent else "NO",
        ),
        ("bystander requests", bystanders, "-", "-"),
        (
            "bystander success rate",
            round(rate, 4),
            f">= {TARGET_BYSTANDER_SUCCESS}",
            "yes" if rate >= TARGET_BYSTANDER_SUCCESS else "NO",
        ),
        ("worker restarts", stats.restarts, "-", "-"),
        ("engine alive at the end", alive, "yes", "yes" if survived else "NO"),
    ]
    for figure, value, target, met in rows:
        report.rows.append(
            {
                "part": "poison",
                "figure": figure,
                "n": 1,
                "median": value,
                "min": "-",
                "max": "-",
                "target": target,
                "met": met,
            }
        )
    for line in poisons.other[:5] + load.lost[:5]:
        report.notes.append(f"poison: {line}")
    _check_trace(report, trace, "poison")


def _rss_bytes(pid: int) -> int:
    """The resident memory of ``pid`` and its descendants (Linux ``/proc``), in bytes."""
    from ..serve.daemon import descendant_pids

    total = 0
    for p in (pid, *descendant_pids(pid)):
        try:
            text = Path(f"/proc/{p}/status").read_text(encoding="ascii")
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (Linux ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :].split()[:1] != [b"Z"]


def _metric(text: str, name: str) -> float | None:
    """The value of sample ``name`` (labels included, as written) in a Prometheus text
    exposition, or None when it is absent."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            try:
                return float(line.split()[-1])
            except ValueError:
                return None
    return None


@dataclass
class _Readers:
    """What each stalled reader has seen of its answer, by reader index (``states``):
    ``connecting``; ``refused`` (no connection, or the request could not be sent);
    ``waiting`` (sent, no answer yet: admitted and not finished, or not yet admitted);
    ``started`` (a 200's head arrived: its answer is being sent and is never read);
    ``response_memory_full`` or ``queue_full`` (a 429 with that code); ``other <status>``;
    ``closed`` (the server closed the connection without an answer)."""

    states: list[str]

    def count(self, *states: str) -> int:
        return sum(1 for s in self.states if s in states)

    @property
    def connected(self) -> int:
        return len(self.states) - self.count("connecting", "refused")


async def _peek_answer(sock: trio.socket.SocketType) -> str:
    """The kind of the answer arriving on ``sock`` (a :class:`_Readers` state), read with
    ``MSG_PEEK`` so that nothing is taken from the receive buffer: a 200 stays unread and
    the server keeps what does not fit.  Waits for the answer's first bytes."""
    status = b""
    for _ in range(40):  # an error's body: at most 2 s for its code to arrive
        try:
            seen = await sock.recv(4096, trio.socket.MSG_PEEK)
        except OSError:
            return "closed"
        if not seen:
            return "closed"
        if len(seen) >= 12:
            status = seen[9:12]
            if status == b"200":
                return "started"
            for code in ("response_memory_full", "queue_full"):
                if code.encode() in seen:
                    return code
            if len(seen) >= 4096:
                break
        await trio.sleep(0.05)  # the peeked bytes are still there: wait for more
    return f"other {status.decode('ascii', 'replace') or '?'}"


async def _stalled_reader(port: int, body: bytes, readers: _Readers, index: int) -> None:
    """One connection that sends a generation and never reads its answer (a 4 KiB receive
    buffer, so the answer stays on the server's side); records in ``readers`` what it got
    (peeked, never read) and holds the connection until cancelled."""
    sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)
    sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)
    try:
        await sock.connect(("127.0.0.1", port))
        stream = trio.SocketStream(sock)
    except OSError:
        sock.close()
        readers.states[index] = "refused"
        return
    async with stream:
        head = (
            "POST /v1/images/generations HTTP/1.1\r\nHost: bench\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        try:
            await stream.send_all(head + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            readers.states[index] = "refused"
            return
        readers.states[index] = "waiting"
        readers.states[index] = await _peek_answer(sock)
        await trio.sleep_forever()


@dataclass
class _DaemonWatch:
    """What is sampled of the daemon while the stalled readers hold on: its RSS (with its
    descendants'), every descendant seen, and from ``/metrics`` the response bytes in
    flight, the open connections and the clients dropped by the send deadline."""

    rss_peak: int = 0
    descendants: set[int] = field(default_factory=set)
    in_flight_peak: float = 0.0
    connections: float | None = None
    send_timeouts: float | None = None
    scrapes_failed: int = 0

    def sample_process(self, pid: int) -> None:
        from ..serve.daemon import descendant_pids

        self.rss_peak = max(self.rss_peak, _rss_bytes(pid))
        self.descendants.update(descendant_pids(pid))

    async def scrape(self, client: Any) -> None:
        import httpx

        try:
            text = (await client.get("/metrics", timeout=2.0)).text
        except httpx.HTTPError:
            self.scrapes_failed += 1
            return
        held = _metric(text, "omni_trio_response_bytes_in_flight")
        self.in_flight_peak = max(self.in_flight_peak, held or 0.0)
        self.connections = _metric(text, "omni_trio_connections")
        dropped = _metric(text, 'omni_trio_slow_clients_total{reason="send_timeout"}')
        self.send_timeouts = dropped or 0.0


async def _slow_clients_part(args: argparse.Namespace, report: Report, bar: Progress) -> None:
    """A real ``omni-trio serve`` process; ``--slow-clients`` connections each ask for an
    image and never read it, for ``--slow-s``; then SIGTERM with them still connected and
    their answers unsent (the send timeout is longer than the hold).

    The daemon admits as many generations as its response bound holds (``max_queue_len`` is
    the number of clients, so the queue is not what refuses); each reader's answer is
    classified by peeking at it (200 started, 429 ``response_memory_full``, 429
    ``queue_full``, other, none yet).  Measured: the daemon's RSS growth against the
    response bound + :data:`SLOW_PER_CONNECTION_BYTES` per connected client
    (docs/operations.md), the peak of ``omni_trio_response_bytes_in_flight``, how long the
    SIGTERM took against the daemon's own :func:`~omni_trio.serve.daemon.shutdown_bound_s`,
    the exit code, and whether any process of the daemon is left."""
    import json
    import socket
    import sys
    import tempfile

    import httpx

    from ..serve.app import RESPONSE_BYTES_PER_IMAGE, RESPONSE_BYTES_PER_PIXEL
    from ..serve.config import ServeConfig
    from ..serve.daemon import shutdown_bound_s

    clients = SLOW_QUICK_CLIENTS if args.quick else args.slow_clients
    hold = SLOW_QUICK_HOLD_S if args.quick else args.slow_s
    drain = SLOW_QUICK_DRAIN_S if args.quick else SLOW_DRAIN_S
    response_bytes = SLOW_QUICK_RESPONSE_BYTES if args.quick else SLOW_RESPONSE_BYTES
    # Longer than the hold, so that every admitted reader is still stalled at the SIGTERM.
    send_timeout = max(SLOW_SEND_TIMEOUT_S, 4 * hold)
    queue_len = max(clients, 1)
    estimate = SLOW_SIZE * SLOW_SIZE * RESPONSE_BYTES_PER_PIXEL + RESPONSE_BYTES_PER_IMAGE
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    flags = [
        "serve", "--port", str(port), "--model", "builtin:echo",
        "--drain-timeout", str(drain), "--send-timeout", str(send_timeout),
        "--max-response-bytes-in-flight", str(response_bytes),
        "--max-queue-len", str(queue_len), "--threads", str(args.torch_threads),
    ]  # fmt: skip
    if args.cache_dir:
        flags += ["--cache-dir", str(args.cache_dir)]
    config = ServeConfig(
        drain_timeout_s=drain,
        send_timeout_s=send_timeout,
        max_response_bytes_in_flight=response_bytes,
        max_queue_len=queue_len,
    )
    bound = shutdown_bound_s(config)
    code = "import sys; from omni_trio.cli import main; sys.exit(main(sys.argv[1:]))"
    with tempfile.TemporaryFile() as log:  # the daemon's log, shown when it fails
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-c", code, *flags], stdout=subprocess.DEVNULL, stderr=log
        )
        body = json.dumps(
            {
                "prompt": "x",
                "size": f"{SLOW_SIZE}x{SLOW_SIZE}",
                "response_format": "b64_json",
                "num_inference_steps": 2,
            }
        ).encode()
        readers = _Readers(["connecting"] * clients)
        watch = _DaemonWatch()
        at_sigterm: dict[str, int] = {}
        took = float("nan")
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                with trio.fail_after(120):
                    while True:
                        if proc.poll() is not None:
                            raise RuntimeError(f"the daemon exited at start ({proc.returncode})")
                        try:
                            if (await client.get("/ready")).status_code == 200:
                                break
                        except httpx.TransportError:
                            pass
                        await trio.sleep(0.2)
                ok = await client.post(
                    "/v1/images/generations",
                    content=body,
                    headers={"content-type": "application/json"},
                )
                ok.raise_for_status()
                answer_bytes = len(ok.content)
                baseline = _rss_bytes(proc.pid)
                watch.rss_peak = baseline
                async with trio.open_nursery() as nursery:
                    for index in range(clients):
                        nursery.start_soon(_stalled_reader, port, body, readers, index)
                    end = trio.current_time() + hold
                    while trio.current_time() < end:
                        watch.sample_process(proc.pid)
                        await watch.scrape(client)
                        bar.advance()
                        await trio.sleep(0.25)
                    await watch.scrape(client)
                    watch.sample_process(proc.pid)
                    at_sigterm = {s: readers.count(s) for s in set(readers.states)}
                    signalled = time.perf_counter()
                    proc.send_signal(signal.SIGTERM)
                    with trio.move_on_after(bound + 30):
                        while proc.poll() is None:
                            watch.sample_process(proc.pid)
                            await trio.sleep(0.05)
                    took = time.perf_counter() - signalled
                    nursery.cancel_scope.cancel()
        finally:
            if proc.poll() is None:
                proc.kill()
            await proc.wait()
        await trio.sleep(0.2)  # an orphan's exit, if one is still on its way out
        left = sorted(p for p in watch.descendants if _alive(p))
        for p in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p, signal.SIGKILL)
        log.seek(0)
        log_tail = log.read().decode("utf-8", "replace").splitlines()[-5:]

    growth = watch.rss_peak - baseline
    connected = readers.connected
    allowance = SLOW_PER_CONNECTION_BYTES * max(connected, 1)
    limit = response_bytes + allowance
    started = at_sigterm.get("started", 0)
    waiting = at_sigterm.get("waiting", 0)
    memory_full = at_sigterm.get("response_memory_full", 0)
    queue_full = at_sigterm.get("queue_full", 0)
    other = sum(n for s, n in at_sigterm.items() if s.startswith("other") or s == "closed")
    send_timeouts = int(watch.send_timeouts or 0)
    exit_code = proc.returncode
    targets = {
        "response_bound_fired": memory_full > 0,
        "rss_growth_within_bound": growth <= limit,
        "stalled_at_sigterm": started + waiting > 0 and send_timeouts == 0,
        "sigterm_within_bound": took <= bound and exit_code == 0,
        "exit_code_0": exit_code == 0,
        "no_process_left": not left,
    }
    report.results["slow_clients"] = {
        "clients": clients, "connected": connected, "hold_s": hold,
        "rss_baseline_mib": round(baseline / 2**20, 1),
        "rss_peak_mib": round(watch.rss_peak / 2**20, 1),
        "rss_growth_mib": round(growth / 2**20, 1), "sigterm_s": round(took, 2),
        "shutdown_bound_s": bound, "exit_code": exit_code,
        # The daemon's settings, and what each answer reserves.
        "size": f"{SLOW_SIZE}x{SLOW_SIZE}", "drain_timeout_s": drain,
        "send_timeout_s": send_timeout, "max_queue_len": queue_len,
        "response_bound_mib": round(response_bytes / 2**20, 1),
        "reserved_per_answer_bytes": estimate, "answer_bytes": answer_bytes,
        # How the readers were answered (peeked, never read), as of the SIGTERM.
        "started_200": started, "response_memory_full": memory_full,
        "queue_full": queue_full, "other": other, "waiting_at_sigterm": waiting,
        "stalled_at_sigterm": started + waiting, "send_timeouts_at_sigterm": send_timeouts,
        "connections_at_sigterm": watch.connections,
        "response_bytes_in_flight_peak_mib": round(watch.in_flight_peak / 2**20, 1),
        "rss_limit_mib": round(limit / 2**20, 1),
        "per_connection_kib": SLOW_PER_CONNECTION_BYTES // 2**10,
        "rss_growth_per_connection_kib": round(
            max(0, growth - response_bytes) / max(connected, 1) / 2**10, 1
        ),
        "daemon_descendants": len(watch.descendants), "processes_left": left,
        "metrics_scrapes_failed": watch.scrapes_failed, "targets": targets,
    }  # fmt: skip
    yes = {True: "yes", False: "NO"}
    mib = 2**20
    rows = [
        ("stalled readers connected", connected, f"{clients}", "-"),
        ("answers: 200 started (never read)", started, "-", "-"),
        ("answers: 429 response_memory_full", memory_full, "> 0 (the bound fires)",
         yes[targets["response_bound_fired"]]),
        ("answers: 429 queue_full", queue_full, f"- (max_queue_len {queue_len})", "-"),
        ("answers: other / none yet", f"{other} / {waiting}", "-", "-"),
        ("response bytes in flight, peak MiB", round(watch.in_flight_peak / mib, 1),
         f"~ {response_bytes // mib} (the bound)", "-"),
        ("readers stalled at the SIGTERM (send timeouts)", f"{started + waiting} "
         f"({send_timeouts})", "> 0 (0)", yes[targets["stalled_at_sigterm"]]),
        ("RSS growth, MiB", round(growth / mib, 1),
         f"<= {limit / mib:.1f} (response bound {response_bytes / mib:g} "
         f"+ {SLOW_PER_CONNECTION_BYTES // 2**10} KiB x connections)",
         yes[targets["rss_growth_within_bound"]]),
        ("SIGTERM to exit, s", round(took, 2), f"<= {bound:g} (drain + close + grace)",
         yes[targets["sigterm_within_bound"]]),
        ("exit code", exit_code, "0", yes[targets["exit_code_0"]]),
        ("daemon processes left", len(left), "0", yes[targets["no_process_left"]]),
    ]  # fmt: skip
    for figure, value, target, met in rows:
        report.rows.append(
            {"part": "slow-clients", "figure": figure, "n": 1, "median": value, "min": "-",
             "max": "-", "target": target, "met": met}
        )  # fmt: skip
    if exit_code != 0 or left:
        report.notes.extend(f"slow-clients: daemon log: {line}" for line in log_tail)
    if left:
        report.notes.append(f"slow-clients: processes left (killed now): {left}")


def _check_trace(report: Report, trace: TraceRecorder, part: str) -> None:
    from ..testing.invariants import check_trace

    violations = check_trace(trace.events)
    report.results.setdefault("invariant_violations", {})[part] = len(violations)
    for violation in violations[:5]:
        report.notes.append(f"{part}: {violation.invariant}: {violation.message}")
    if not violations:
        report.notes.append(f"{part}: lifecycle trace of {len(trace)} events: no violation")


async def _main(args: argparse.Namespace, report: Report) -> None:
    report.params.update(
        {
            "parts": list(args.parts),
            "model": args.model,
            "steps": args.steps,
            "step_delay_ms": args.step_delay_ms,
            "clients": args.clients,
            "soak_s": args.soak_s,
            "kill_every_s": args.kill_every_s,
            "poison_s": args.poison_s,
            "poison_every_s": args.poison_every_s,
            "slow_clients": args.slow_clients,
            "slow_s": args.slow_s,
            "torch_threads": args.torch_threads,
            "start_method": args.start_method,
            "backends": list(args.backends),
            "faults": list(args.faults),
            "quick": args.quick,
        }
    )
    repeats = args.repeats or (1 if args.quick else 10)
    soak_kills = int((6.0 if args.quick else args.soak_s) // args.kill_every_s)
    poison_sent = int((6.0 if args.quick else args.poison_s) // args.poison_every_s) + 1
    measured = repeats * len(args.backends) * len(args.faults)
    slow = "slow-clients" in args.parts
    total = (
        (measured if "recovery" in args.parts else 0)
        + (soak_kills if "soak" in args.parts else 0)
        + (poison_sent if "poison" in args.parts else 0)
        + (int((SLOW_QUICK_HOLD_S if args.quick else args.slow_s) * 4) if slow else 0)
    )
    with Progress(total, "recovery", enabled=not args.no_progress) as bar:
        if "recovery" in args.parts:
            await _recovery_part(args, report, bar)
        if "soak" in args.parts:
            await _soak_part(args, report, bar)
        if "poison" in args.parts:
            await _poison_part(args, report, bar)
        if "slow-clients" in args.parts:
            await _slow_clients_part(args, report, bar)


def run(args: argparse.Namespace, command: str) -> Report:
    report = Report(experiment="recovery", command=command, columns=COLUMNS)
    return run_in_trio(report, _main, args, torch_threads=args.torch_threads)
