"""``bench dataparallel``: ``omni-trio serve`` configurations against the two-process limit.

Issue #15's measurement, side by side in one run.  Every system is a real ``omni-trio serve``
subprocess on a free loopback port, loaded with the same model (``--model``, default
``builtin:tiny-ddim``: a 32x32 DDIM pipeline, ``--steps`` 20), and driven by closed-loop HTTP
clients in this process (``httpx``, ``response_format=b64_json``: a base64 PNG per answer, fixed
seeds):

``limit``       two processes (``--torch-threads`` each) calling the loaded pipeline directly
                in a loop and encoding each image as PNG + base64, as the daemon answers: what
                two cores can do at most;
``inproc``      ``serve`` with one in-process worker (the default);
``replicas2``   ``serve --replicas 2``: two in-process engines behind the router (one process,
                two worker threads, one GIL);
``workers2``    ``serve --backend tractor --workers 2``: two worker processes that both run
                every wave (a replica group: no extra throughput, the baseline issue #15 names);
``dp2``         ``serve --data-parallel 2``: two worker processes, each running its own share
                of every wave;
``stages2``     ``serve --replicas 2 --stage process``: two engines, each in a stage process of
                its own (its worker a thread there), behind the daemon's router;
``tractor2``    ``serve --backend tractor --replicas 2``: two engines, each in a stage process
                with one tractor worker process;
``ray2``        ``serve --backend ray --replicas 2``: two inline engines, each with one Ray
                worker actor (a local Ray instance the daemon starts).

``--systems`` picks some (default: all but ``tractor2`` and ``ray2``).  At each
``--concurrency`` (4, 16) every system runs ``--requests`` (64) requests per round, round after
round in turn (limit, inproc, ... limit, inproc ...), so a noisy patch of the machine hits
them all; ``--warmup`` unmeasured rounds first.  Reported per
system and concurrency: requests/s (min / median / max over rounds), its ratio to the limit
(round by round), latency p50 / p90 / p99 over every request, errors.  Once per system, before
the rounds and alone on the machine: **cold start** (spawn to the first answer) and, after
the rounds, **memory** (PSS of the whole process tree, from ``/proc/*/smaps_rollup``).

``--kill-probe S`` (``dp2``, ``workers2``, ``stages2``, ``tractor2``, ``ray2``): at concurrency
4 for S seconds, SIGKILL one worker process 1/4 of the way in; reported: requests failed, the
first answer after the kill, the longest gap between answers, and the longest a request in
flight at the kill took after it (``in_flight_done_after_kill_s``: a request the dead worker
held waits for its restart, or moves to a live one).  Which process is a worker: a descendant
of the daemon whose command line names tractor's child entry point (``--worker-start-method
forkserver`` starts them from a fork server, also a descendant) or Ray's worker actor
(``ray::RayWorker``); for ``stages2``, a stage process (named ``omni-trio-stage``; one
started as a new interpreter also by its command line, ``omni_trio.runtime.stage_child``).
"""

from __future__ import annotations

import argparse
import base64
import itertools
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from ..runtime.stage_child import PROCESS_NAME
from .harness import (
    Progress,
    Report,
    Summary,
    csv_arg,
    pair_ratios,
    positive_ints_arg,
    run_in_trio,
)

if TYPE_CHECKING:
    import httpx

SYSTEMS = ("limit", "inproc", "replicas2", "workers2", "dp2", "stages2", "tractor2", "ray2")
# What runs without --systems (tractor2 and ray2 on request: the kill probe's replicas).
DEFAULT_SYSTEMS = SYSTEMS[:6]
# The daemon flags of each system (beyond model, cache, threads and port).
SYSTEM_FLAGS: dict[str, tuple[str, ...]] = {
    "inproc": (),
    "replicas2": ("--replicas", "2"),
    "workers2": ("--backend", "tractor", "--workers", "2"),
    "dp2": ("--data-parallel", "2"),
    "stages2": ("--replicas", "2", "--stage", "process"),
    "tractor2": ("--backend", "tractor", "--replicas", "2"),
    "ray2": ("--backend", "ray", "--replicas", "2"),
}
KILLABLE = ("dp2", "workers2", "stages2", "tractor2", "ray2")
# The systems whose --worker-start-method applies (tractor worker processes).
TRACTOR_SYSTEMS = ("dp2", "workers2", "tractor2")
START_TIMEOUT_S = 180.0
REQUEST_TIMEOUT_S = 120.0
PROMPT = "a red circle"
# Targets issue #15 sets (reported, never asserted).
TARGET_RATIO = 0.95
TARGET_COLD_START_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="builtin:tiny-ddim")
    parser.add_argument("--steps", type=int, default=20, help="denoising steps")
    parser.add_argument("--size", type=int, default=32, help="height = width")
    parser.add_argument(
        "--systems",
        type=csv_arg,
        default=DEFAULT_SYSTEMS,
        help=f"comma-separated, from {', '.join(SYSTEMS)} (default {','.join(DEFAULT_SYSTEMS)})",
    )
    parser.add_argument(
        "--concurrency",
        type=positive_ints_arg,
        default=None,
        help="closed-loop clients, comma-separated (default 4,16; quick 4)",
    )
    parser.add_argument(
        "--requests", type=int, default=None, help="requests per round (default 64; quick 8)"
    )
    parser.add_argument(
        "--kill-probe",
        type=float,
        default=None,
        metavar="S",
        help="seconds of the SIGKILL probe on the killable systems (default 20; quick 0: off)",
    )
    parser.add_argument(
        "--worker-start-method",
        choices=("trio", "forkserver"),
        default=None,
        help="tractor systems: how worker processes start (default: the daemon's)",
    )
    parser.add_argument("--torch-threads", type=int, default=1, help="per worker / process")
    parser.add_argument("--cache-dir", default=None)


def run(args: argparse.Namespace, command: str) -> Report:
    report = Report(experiment="dataparallel", command=command)
    return run_in_trio(report, _main, args, torch_threads=args.torch_threads)


# -- the systems ------------------------------------------------------------------------------


@dataclass
class Daemon:
    """One ``omni-trio serve`` subprocess."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str = ""
    cold_start_s: float | None = None
    log: Path | None = None

    def pids(self) -> list[int]:
        from ..serve.daemon import descendant_pids

        return [self.proc.pid, *descendant_pids(self.proc.pid)]

    def worker_pids(self) -> list[int]:
        """The processes the kill probe may kill.  ``stages2``: the stage processes (each
        runs its engine's worker thread; forked from the fork server by default).
        Otherwise the descendants that are worker processes: tractor's (started as
        tractor's child entry point, or forked by a fork server, whose own command line
        names it) or Ray's worker actors."""
        from ..serve.daemon import descendant_pids

        found = []
        for pid in descendant_pids(self.proc.pid):
            cmdline = _cmdline(pid)
            if self.name == "stages2":
                if "omni_trio.runtime.stage_child" in cmdline or _comm(pid) == PROCESS_NAME:
                    found.append(pid)
                continue
            forked = "forkserver" in _cmdline(_parent(pid))
            tractor = "tractor" in cmdline and "forkserver" not in cmdline
            if forked or tractor or cmdline.startswith("ray::RayWorker"):
                found.append(pid)
        return found


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as file:
            return int(file.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _comm(pid: int) -> str:
    """The process's name (``/proc/PID/comm``), "" if it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as file:
            return file.read().strip()
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return file.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pss_mib(pids: Sequence[int]) -> float | None:
    """The proportional set size of ``pids`` together, in MiB (None without /proc)."""
    total = 0
    seen = False
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as file:
                for line in file:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1])
                        seen = True
                        break
        except OSError:
            continue
    return total / 1024 if seen else None


async def _start_daemon(name: str, args: argparse.Namespace, log_dir: Path) -> Daemon:
    argv = [
        sys.executable,
        "-m",
        "omni_trio.cli",
        "serve",
        "--port",
        "0",
        "--model",
        args.model,
        "--threads",
        str(args.torch_threads),
        "--max-queue-len",
        "1024",
        *SYSTEM_FLAGS[name],
    ]
    if args.cache_dir:
        argv += ["--cache-dir", args.cache_dir]
    if args.worker_start_method and name in TRACTOR_SYSTEMS:
        argv += ["--config", str(_start_method_toml(args.worker_start_method, log_dir))]
    env = {k: v for k, v in os.environ.items() if k != "OMNI_TRIO_API_KEY"}
    env.pop("NOTIFY_SOCKET", None)
    log = log_dir / f"{name}.log"
    started = time.perf_counter()
    proc = _spawn(argv, env, log)
    daemon = Daemon(name, proc, log=log)
    line = await trio.to_thread.run_sync(_read_line, proc, START_TIMEOUT_S)
    prefix = "omni-trio serve: listening on "
    if line is None or not line.startswith(prefix):
        proc.kill()
        raise RuntimeError(f"{name}: the daemon did not start ({line!r}); see {log}")
    daemon.url = line[len(prefix) :].split(" ", 1)[0]
    import httpx

    async with httpx.AsyncClient(base_url=daemon.url, trust_env=False, timeout=30) as client:
        with trio.fail_after(START_TIMEOUT_S):
            while (await client.get("/ready")).status_code != 200:  # noqa: ASYNC110
                await trio.sleep(0.05)
            response = await _post(client, 0, args)
            if response.status_code != 200:
                raise RuntimeError(f"{name}: first request answered {response.status_code}")
    daemon.cold_start_s = time.perf_counter() - started
    return daemon


def _spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as stderr:
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=stderr)


def _start_method_toml(method: str, log_dir: Path) -> Path:
    path = log_dir / f"start-{method}.toml"
    path.write_text(f'[engine]\nworker_start_method = "{method}"\n')
    return path


def _read_line(proc: subprocess.Popen[bytes], timeout: float) -> str | None:
    import select

    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout
    buffer = b""
    while not buffer.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            return None
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if ready:
            chunk = os.read(fd, 1)
            if not chunk:
                return None
            buffer += chunk
    return buffer.decode(errors="replace").rstrip("\n")


async def _stop_daemon(daemon: Daemon) -> None:
    proc = daemon.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await trio.to_thread.run_sync(proc.wait, 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            await trio.to_thread.run_sync(proc.wait)
    if proc.stdout is not None:
        proc.stdout.close()


async def _post(client: httpx.AsyncClient, seed: int, args: argparse.Namespace) -> httpx.Response:
    body = {
        "prompt": PROMPT,
        "size": f"{args.size}x{args.size}",
        "num_inference_steps": args.steps,
        "response_format": "b64_json",
        "seed": seed,
    }
    response = await client.post("/v1/images/generations", json=body)
    if response.status_code == 200:
        base64.b64decode(response.json()["data"][0]["b64_json"])  # the client's share of work
    return response


@dataclass
class Round:
    """One closed-loop round of one system."""

    rps: float
    latencies_s: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)


async def _closed_loop(daemon: Daemon, concurrency: int, requests: int, args: Any) -> Round:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    left = iter(range(requests))
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    async with httpx.AsyncClient(
        base_url=daemon.url, trust_env=False, timeout=REQUEST_TIMEOUT_S, limits=limits
    ) as client:

        async def one_client() -> None:
            for seed in left:
                sent = time.perf_counter()
                try:
                    response = await _post(client, seed, args)
                except httpx.HTTPError as exc:
                    errors[type(exc).__name__] += 1
                    continue
                if response.status_code == 200:
                    latencies.append(time.perf_counter() - sent)
                else:
                    errors[str(response.status_code)] += 1

        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(one_client)
        wall = time.perf_counter() - started
    return Round(len(latencies) / wall, latencies, errors)


# -- the limit: two processes calling the pipeline ----------------------------------------------


def _limit_process(conn: Any, model: str, cache_dir: str | None, threads: int) -> None:
    """A child process: load the model, then for each ``(n, steps, size, first_seed)`` asked,
    render ``n`` images one by one (PNG + base64 each) and answer the seconds it took."""
    import torch

    torch.set_num_threads(threads)
    from .._core.request import DiffusionRequest, SamplingParams
    from ..config import EngineConfig
    from ..models.loading import load_model
    from ..serve.images import encode_b64, encode_image

    config = EngineConfig(model=model, cache_dir=cache_dir)
    loaded = load_model(
        model,
        device=torch.device("cpu"),
        dtype=torch.float32,
        cache_dir=config.resolved_cache_dir,
        options={},
    )
    conn.send("ready")
    while True:
        job = conn.recv()
        if job is None:
            return
        n, steps, size, first = job
        started = time.perf_counter()
        for seed in range(first, first + n):
            sampling = SamplingParams(num_inference_steps=steps, height=size, width=size, seed=seed)
            request = DiffusionRequest(PROMPT, sampling, f"limit-{seed}")
            generator = torch.Generator().manual_seed(seed)
            [images] = loaded.generate(
                [request], [generator], output_type="np", on_step=lambda *_: None
            )
            encode_b64(encode_image(images[0], "png"))
        conn.send(time.perf_counter() - started)


@dataclass
class Limit:
    """Two limit processes, driven together."""

    conns: list[Any]
    procs: list[Any]
    cold_start_s: float

    async def round(self, requests: int, args: argparse.Namespace) -> Round:
        half = [requests // 2, requests - requests // 2]
        started = time.perf_counter()
        for index, conn in enumerate(self.conns):
            conn.send((half[index], args.steps, args.size, index * half[0]))
        await trio.to_thread.run_sync(lambda: [conn.recv() for conn in self.conns])
        wall = time.perf_counter() - started
        return Round(requests / wall)

    async def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            await trio.to_thread.run_sync(proc.join, 30)
            if proc.is_alive():
                proc.kill()

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]


async def _start_limit(args: argparse.Namespace) -> Limit:
    context = multiprocessing.get_context("spawn")
    started = time.perf_counter()
    conns, procs = [], []
    for _ in range(2):
        parent, child = context.Pipe()
        proc = context.Process(
            target=_limit_process,
            args=(child, args.model, args.cache_dir, args.torch_threads),
            daemon=True,
        )
        proc.start()
        conns.append(parent)
        procs.append(proc)
    for conn in conns:
        assert await trio.to_thread.run_sync(conn.recv) == "ready"
    limit = Limit(conns, procs, 0.0)
    await limit.round(2, args)  # first images
    limit.cold_start_s = time.perf_counter() - started
    return limit


# -- the kill probe -----------------------------------------------------------------------------


async def _kill_probe(daemon: Daemon, seconds: float, args: argparse.Namespace) -> dict[str, Any]:
    """Closed loop at concurrency 4 for ``seconds``; one worker SIGKILLed a quarter in."""
    import httpx

    answers: list[float] = []
    spans: list[tuple[float, float]] = []  # (sent, answered) of every answered request
    failed: Counter[str] = Counter()
    killed_at: list[float] = []
    workers = daemon.worker_pids()
    if not workers:
        return {"error": "no worker process found"}
    started = time.perf_counter()
    deadline = started + seconds
    seeds = iter(range(10**9))
    async with httpx.AsyncClient(
        base_url=daemon.url, trust_env=False, timeout=REQUEST_TIMEOUT_S
    ) as client:

        async def one_client() -> None:
            while time.perf_counter() < deadline:
                sent = time.perf_counter()
                try:
                    response = await _post(client, next(seeds), args)
                except httpx.HTTPError as exc:
                    failed[type(exc).__name__] += 1
                    continue
                if response.status_code == 200:
                    answers.append(time.perf_counter())
                    spans.append((sent, answers[-1]))
                else:
                    failed[str(response.status_code)] += 1

        async def kill() -> None:
            await trio.sleep(seconds / 4)
            os.kill(workers[-1], signal.SIGKILL)
            killed_at.append(time.perf_counter())

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(one_client)
            nursery.start_soon(kill)
    kill_t = killed_at[0]
    after = [t for t in answers if t > kill_t]
    times = [started, *sorted(answers)]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    held = [done - kill_t for sent, done in spans if sent < kill_t < done]
    return {
        "requests_ok": len(answers),
        "requests_failed": dict(failed),
        "first_answer_after_kill_s": (after[0] - kill_t) if after else None,
        "longest_gap_s": max(gaps) if gaps else None,
        "in_flight_done_after_kill_s": max(held) if held else None,
        "killed_pid": workers[-1],
    }


# -- the run ------------------------------------------------------------------------------------


async def _main(args: argparse.Namespace, report: Report) -> None:
    import tempfile

    quick = args.quick
    systems = [s for s in SYSTEMS if s in args.systems]
    unknown = sorted(set(args.systems) - set(SYSTEMS))
    if unknown:
        raise ValueError(f"unknown system(s) {', '.join(unknown)}; choose from {SYSTEMS}")
    concurrencies = args.concurrency or ((4,) if quick else (4, 16))
    requests = args.requests or (8 if quick else 64)
    repeats = args.repeats or (1 if quick else 3)
    warmup = args.warmup if args.warmup is not None else (0 if quick else 1)
    probe_s = args.kill_probe if args.kill_probe is not None else (0.0 if quick else 20.0)
    report.params.update(
        model=args.model,
        steps=args.steps,
        size=args.size,
        systems=systems,
        concurrency=list(concurrencies),
        requests=requests,
        repeats=repeats,
        warmup=warmup,
        torch_threads=args.torch_threads,
        kill_probe_s=probe_s,
        worker_start_method=args.worker_start_method or "the daemon's default",
    )
    log_dir = Path(tempfile.mkdtemp(prefix="omni-trio-bench-dp-"))
    report.params["logs"] = str(log_dir)
    limit: Limit | None = None
    daemons: dict[str, Daemon] = {}
    try:
        # Started one at a time, each alone: its cold start is its own.
        if "limit" in systems:
            limit = await _start_limit(args)
        for name in systems:
            if name != "limit":
                daemons[name] = await _start_daemon(name, args, log_dir)
        bar = Progress(
            len(concurrencies) * (repeats + warmup), "dataparallel", enabled=not args.no_progress
        )
        rounds: dict[tuple[str, int], list[Round]] = {}
        for concurrency in concurrencies:
            for index in range(warmup + repeats):
                for name in systems:
                    if name == "limit":
                        assert limit is not None
                        result = await limit.round(requests, args)
                    else:
                        result = await _closed_loop(daemons[name], concurrency, requests, args)
                    if index >= warmup:
                        rounds.setdefault((name, concurrency), []).append(result)
                bar.advance()
        bar.close()
        memory = {name: pss_mib(d.pids()) for name, d in daemons.items()}
        if limit is not None:
            memory["limit"] = pss_mib(limit.pids())
        probes: dict[str, Any] = {}
        if probe_s > 0:
            for name in KILLABLE:
                if name in daemons:
                    probes[name] = await _kill_probe(daemons[name], probe_s, args)
    finally:
        with trio.CancelScope(shield=True):
            for daemon in daemons.values():
                await _stop_daemon(daemon)
            if limit is not None:
                await limit.close()
    _report(report, systems, concurrencies, rounds, daemons, limit, memory, probes)


def _report(
    report: Report,
    systems: Sequence[str],
    concurrencies: Sequence[int],
    rounds: dict[tuple[str, int], list[Round]],
    daemons: dict[str, Daemon],
    limit: Limit | None,
    memory: dict[str, float | None],
    probes: dict[str, Any],
) -> None:
    results: dict[str, Any] = {}
    for name in systems:
        cold = limit.cold_start_s if name == "limit" and limit else daemons[name].cold_start_s
        entry: dict[str, Any] = {"cold_start_s": cold, "pss_mib": memory.get(name)}
        for concurrency in concurrencies:
            series = rounds[(name, concurrency)]
            rps = [r.rps for r in series]
            latencies = [x for r in series for x in r.latencies_s]
            errors: Counter[str] = Counter()
            for r in series:
                errors.update(r.errors)
            cell: dict[str, Any] = {
                "rps": Summary.of(rps),
                "latency_ms": Summary.of(latencies).scaled(1000.0) if latencies else None,
                "errors": dict(errors),
            }
            if ("limit", concurrency) in rounds and name != "limit":
                limit_rps = [r.rps for r in rounds[("limit", concurrency)]]
                cell["ratio_to_limit"] = Summary.of(pair_ratios(rps, limit_rps))
            entry[f"c{concurrency}"] = cell
            ratio = cell.get("ratio_to_limit")
            latency = cell["latency_ms"]
            report.rows.append(
                {
                    "system": name,
                    "c": concurrency,
                    "req/s min / med / max": cell["rps"].spread("{:.2f}"),
                    "/ limit (min / med / max)": ratio.spread("{:.2f}") if ratio else "-",
                    "latency ms p50 / p90 / p99": latency.tail("{:.0f}") if latency else "-",
                    "errors": sum(errors.values()),
                    "cold start s": f"{cold:.1f}" if cold is not None else "-",
                    "PSS MiB": f"{memory[name]:.0f}" if memory.get(name) else "-",
                }
            )
        results[name] = entry
    results["kill_probe"] = probes
    report.results = results
    for name in ("dp2", "stages2"):
        for concurrency in concurrencies:
            cell = results.get(name, {}).get(f"c{concurrency}", {})
            ratio = cell.get("ratio_to_limit")
            if ratio is not None:
                verdict = "meets" if ratio.median >= TARGET_RATIO else "misses"
                report.notes.append(
                    f"{name} at c={concurrency}: {ratio.median:.2f} x the limit ({verdict} "
                    f"the {TARGET_RATIO} target)"
                )
    for name, probe in probes.items():
        report.notes.append(
            f"kill probe {name}: {probe.get('requests_ok')} answered, failed "
            f"{probe.get('requests_failed')}, first answer "
            f"{_fmt_s(probe.get('first_answer_after_kill_s'))} after the kill, longest gap "
            f"{_fmt_s(probe.get('longest_gap_s'))}, in flight at the kill done within "
            f"{_fmt_s(probe.get('in_flight_done_after_kill_s'))}"
        )


def _fmt_s(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.2f} s"
