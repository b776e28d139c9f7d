"""``bench recovery``: how fast a supervised engine serves again after a worker is killed,
and whether it loses anything when workers are killed again and again under load.

Issue #5's measurement, two parts (``--parts``, default both):

recovery  ``--repeats`` times: ``--clients`` (3) clients keep requests coming to a ``tractor``
          engine (one worker, ``--model``, default ``builtin:echo`` with ``--steps`` (4) steps
          of ``--step-delay-ms`` (20) ms); the worker process is SIGKILLed mid-forward.  From
          the engine's lifecycle trace: kill -> the group failure noticed (CRASH), -> the new
          group serving (RESTART), -> the first request that ran on the new group completed
          (the recovery time).  Target: recovery < 3 s with the tiny model.
soak      ``--soak-s`` (60) seconds of the same load, the worker SIGKILLed every
          ``--kill-every-s`` (4) seconds.  Every request must complete or end with an
          explicit, retryable error (``RequestFailedError.retryable``); any other outcome, a
          request that never ends, a shared-memory segment or a worker process left behind
          counts as lost.  Reported: requests completed / retried / failed / lost, restarts.

``--start-method`` (``trio`` default, or ``forkserver``) is the engine's
``worker_start_method``: how a restarted worker process is started.

Both parts use ``max_retries_on_worker_failure=1`` and the default restart backoff
(``worker_restart_backoff_s``, 0.05 s doubling per restart in the window) with an intensity
limit high enough for the soak.  The recovery part uses a 1 s restart window and waits 1 s
before each kill, so every measured kill is an isolated crash (backoff 0.05 s), not one whose
backoff grew with the kills before it; the soak keeps the default 60 s window.  The lifecycle
trace is also checked with the invariant checker (violations reported).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

import trio

from .._core.request import SamplingParams
from .._core.trace import TraceKind, TraceRecorder
from ..config import WORKER_START_METHODS, EngineConfig
from ..errors import EngineDeadError, RequestFailedError
from ..runtime.engine import AsyncEngine, open_engine
from .harness import Progress, Report, Summary, run_in_trio

__all__ = ["add_arguments", "recovery_times", "run"]

TARGET_RECOVERY_S = 3.0
COLUMNS = ["part", "figure", "n", "median", "min", "max", "target", "met"]
_K = TraceKind


def _parts(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in parts if p not in ("recovery", "soak")]
    if bad or not parts:
        raise argparse.ArgumentTypeError(f"parts are recovery and soak, got {text!r}")
    return parts


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", type=_parts, default=("recovery", "soak"))
    parser.add_argument("--model", default="builtin:echo")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--step-delay-ms", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--soak-s", type=_positive_float, default=60.0)
    parser.add_argument("--kill-every-s", type=_positive_float, default=4.0)
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument(
        "--start-method",
        choices=WORKER_START_METHODS,
        default="trio",
        help="how worker processes are started (EngineConfig.worker_start_method)",
    )


def _config(args: argparse.Namespace, *, window_s: float = 60.0) -> EngineConfig:
    options: dict[str, Any] = {}
    if args.model == "builtin:echo":
        options["step_delay_s"] = args.step_delay_ms / 1000.0
    return EngineConfig(
        model=args.model,
        model_options=options,
        backend="tractor",
        cache_dir=args.cache_dir,
        torch_threads=args.torch_threads,
        warmup=True,
        max_num_seqs=2,
        max_worker_restarts=1000,
        worker_restart_window_s=window_s,
        max_retries_on_worker_failure=1,
        worker_start_method=args.start_method,
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
    with trio.fail_after(timeout):
        while not engine.health().healthy:  # noqa: ASYNC110 - health is a snapshot, no event
            await trio.sleep(0.01)


async def _recovery_part(args: argparse.Namespace, report: Report, bar: Progress) -> None:
    repeats = args.repeats or (2 if args.quick else 10)
    trace = TraceRecorder()
    noticed: list[float] = []
    serving: list[float] = []
    recovered: list[float] = []
    # A 1 s restart window: each measured kill is an isolated crash that pays the first
    # restart's backoff (worker_restart_backoff_s), not a backoff grown by the kills before it.
    async with open_engine(_config(args, window_s=1.0), trace=trace) as engine:
        load = _Load(engine, args)
        async with trio.open_nursery() as nursery:
            for c in range(args.clients):
                nursery.start_soon(load.client, c)
            for _ in range(repeats):
                await _wait_healthy(engine, 60.0)
                await trio.sleep(1.0)  # past the restart window of the previous kill
                while engine.statistics().running == 0:  # noqa: ASYNC110
                    await trio.sleep(0.005)
                await trio.sleep(args.step_delay_ms / 1000.0)  # inside a forward
                killed_at = trio.current_time()
                _kill_worker(engine)
                with trio.fail_after(60.0):
                    while True:
                        times = recovery_times(trace.events, killed_at)
                        if times[2] is not None:
                            break
                        await trio.sleep(0.05)
                noticed.append(times[0] or 0.0)
                serving.append(times[1] or 0.0)
                recovered.append(times[2])
                bar.advance()
            nursery.cancel_scope.cancel()
    _add_rows(report, "recovery", noticed, serving, recovered)
    report.results["recovery"] = {
        "noticed_s": Summary.of(noticed),
        "serving_s": Summary.of(serving),
        "recovered_s": Summary.of(recovered),
        "target_s": TARGET_RECOVERY_S,
    }
    _check_trace(report, trace, "recovery")


def _add_rows(
    report: Report,
    part: str,
    noticed: list[float],
    serving: list[float],
    recovered: list[float],
) -> None:
    for name, samples, target in (
        ("kill -> failure noticed (s)", noticed, None),
        ("kill -> new group serving (s)", serving, None),
        ("kill -> first request of the new group done (s)", recovered, TARGET_RECOVERY_S),
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
                "met": "-" if target is None else ("yes" if s.median < target else "NO"),
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
        "lost": lost,
    }
    report.results["soak"] = soak
    for figure, value in (
        ("kills", kills),
        ("restarts", stats.restarts),
        ("requests completed", load.completed),
        ("requests retried after a kill", stats.requeued),
        ("requests failed (retryable, budget used)", load.failed_retryable),
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
            "torch_threads": args.torch_threads,
            "start_method": args.start_method,
            "quick": args.quick,
        }
    )
    repeats = args.repeats or (2 if args.quick else 10)
    soak_kills = int((6.0 if args.quick else args.soak_s) // args.kill_every_s)
    total = (repeats if "recovery" in args.parts else 0) + (
        soak_kills if "soak" in args.parts else 0
    )
    with Progress(total, "recovery", enabled=not args.no_progress) as bar:
        if "recovery" in args.parts:
            await _recovery_part(args, report, bar)
        if "soak" in args.parts:
            await _soak_part(args, report, bar)


def run(args: argparse.Namespace, command: str) -> Report:
    report = Report(experiment="recovery", command=command, columns=COLUMNS)
    return run_in_trio(report, _main, args, torch_threads=args.torch_threads)
