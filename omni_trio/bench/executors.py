"""``bench executors``: what each executor backend costs per request, side by side.

Issue #8's measurement: ``ray`` vs ``tractor`` vs ``inproc`` on ``builtin:echo`` (0-delay
steps: nothing but the runtime) and ``builtin:tiny-sd`` (a real, tiny UNet), with 1 and 2
workers (``--models``, ``--workers``, ``--backends``).  A *cell* is one model and one worker
count; ``inproc`` has one worker only, so it is left out of 2-worker cells.  With 2 workers,
``builtin:tiny-sd`` runs ``cfg_parallel=True`` (the two ranks split each guided UNet call);
``builtin:echo`` has no guidance to split, so it runs ``cfg_parallel=False``: every rank is a
full replica and the output rank ships the result.

In each cell every engine is open at once (``max_num_seqs`` = ``--max-num-seqs``, warmed up
by one request) and the engines take turns, ``A B C A B C ...`` (one unrecorded round first,
``--warmup``), so machine noise hits all of them alike:

latency     ``--blocks`` rounds of a block of ``--requests`` sequential requests per engine
            (concurrency 1): per backend the block medians (min / median / max) and every
            request's p50 / p90 / p99; the cost of a backend is its block median minus the
            baseline's of the same round, pair by pair (``- inproc``, ``- tractor``).
throughput  ``--blocks`` rounds of ``--throughput-requests`` requests from ``--concurrency``
            closed-loop clients per engine: requests/s, and the ratio to ``inproc`` (and to
            ``tractor``) of the same round, pair by pair.
startup     ``open_engine`` until it is ready (workers started, model loaded, warmup
            request served), once per engine.

``ray``: a Ray that is already initialised in this process is reused and left running;
otherwise this command starts a local one on 127.0.0.1
(:func:`omni_trio.executors.ray_executor.ensure_ray`; its start time is reported apart) and
stops it at the end.  Without Ray installed its rows say "not installed".  The ``tractor``
engines run as children of one tractor runtime this command opens itself, so several can
be open at once.  ``--torch-threads`` (default 1) applies to every worker.
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from .._core.request import SamplingParams
from ..config import EngineConfig
from ..runtime.engine import AsyncEngine, open_engine
from ._clients import RunResult, drive, sequential_block
from .backends import _tractor_runtime
from .harness import (
    Progress,
    Report,
    Summary,
    csv_arg,
    load_average,
    machine_info,
    pair_differences,
    pair_ratios,
    positive_ints_arg,
    run_in_trio,
    run_interleaved_async,
)

__all__ = [
    "BACKENDS",
    "COLUMNS",
    "MODELS",
    "Cell",
    "add_arguments",
    "paired",
    "plan_cells",
    "run",
    "sampling_for",
]

BACKENDS = ("inproc", "tractor", "ray")
MODELS = ("builtin:echo", "builtin:tiny-sd")
SEED = 1234
NOT_INSTALLED = "not installed"


# -- the plan (pure) ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Cell:
    """One model at one worker count: the backends that run it side by side.

    ``baselines`` are the backends the others are compared with, in order (``inproc`` then
    ``tractor``, as far as they are in ``backends``); ``cfg_parallel`` is what the engines
    are configured with.
    """

    model: str
    workers: int
    backends: tuple[str, ...]
    baselines: tuple[str, ...]
    cfg_parallel: bool

    @property
    def label(self) -> str:
        worker_s = "worker" if self.workers == 1 else "workers"
        mode = ""
        if self.workers > 1:
            mode = ", cfg-parallel" if self.cfg_parallel else ", replicas (no CFG to split)"
        return f"{self.model}, {self.workers} {worker_s}{mode}"


def splits_guidance(model: str) -> bool:
    """Whether ``model`` has classifier-free guidance that CFG-parallel can split (the
    built-in echo model has none)."""
    return model != "builtin:echo"


def plan_cells(
    models: Sequence[str], workers: Sequence[int], backends: Sequence[str]
) -> list[Cell]:
    """The cells to run, models outermost: ``inproc`` only in 1-worker cells; a cell left
    with no backend is dropped.  2-worker cells of a model with guidance use
    ``cfg_parallel``."""
    cells: list[Cell] = []
    for model in models:
        for n in workers:
            names = tuple(b for b in BACKENDS if b in backends and (b != "inproc" or n == 1))
            if not names:
                continue
            baselines = tuple(b for b in ("inproc", "tractor") if b in names)
            cells.append(
                Cell(
                    model=model,
                    workers=n,
                    backends=names,
                    baselines=baselines,
                    cfg_parallel=n == 2 and splits_guidance(model),
                )
            )
    return cells


def paired(
    series: Mapping[str, Sequence[float]],
    baselines: Sequence[str],
    compare: Callable[[Sequence[float], Sequence[float]], list[float]],
) -> dict[str, dict[str, Summary]]:
    """``compare(series[b], series[base])`` summarised, for every backend ``b`` and every
    baseline ``base`` other than ``b`` (``{b: {base: Summary}}``); a backend without
    samples, or a comparison with no pairs left, is left out."""
    out: dict[str, dict[str, Summary]] = {}
    for name, values in series.items():
        for base in baselines:
            if base == name or not values or not series.get(base):
                continue
            pairs = compare(values, series[base])
            if pairs:
                out.setdefault(name, {})[base] = Summary.of(pairs)
    return out


def sampling_for(model: str, args: argparse.Namespace) -> SamplingParams:
    """The request a cell of ``model`` sends: echo small and short, tiny-sd with guidance."""
    if model == "builtin:echo":
        return SamplingParams(
            height=args.echo_size,
            width=args.echo_size,
            num_inference_steps=args.echo_steps,
            seed=SEED,
            output_type="pil",
        )
    steps = args.sd_steps or (2 if args.quick else 10)
    return SamplingParams(
        height=args.sd_size,
        width=args.sd_size,
        num_inference_steps=steps,
        guidance_scale=args.guidance,
        seed=SEED,
        output_type="pil",
    )


def counts_for(model: str, args: argparse.Namespace) -> tuple[int, int]:
    """``(requests per latency block, requests per throughput round)`` for ``model``."""
    echo = model == "builtin:echo"
    block = args.requests or (3 if args.quick else 100 if echo else 8)
    burst = args.throughput_requests or (
        2 * args.concurrency if args.quick else (25 if echo else 4) * args.concurrency
    )
    return block, burst


# -- arguments ---------------------------------------------------------------------------


def _backends(text: str) -> tuple[str, ...]:
    names = csv_arg(text)
    if not names or any(n not in BACKENDS for n in names):
        raise argparse.ArgumentTypeError(f"backends are {', '.join(BACKENDS)}; got {text!r}")
    return names


def _workers(text: str) -> tuple[int, ...]:
    counts = positive_ints_arg(text)
    if any(n > 2 for n in counts):
        raise argparse.ArgumentTypeError(f"worker counts are 1 and 2; got {text!r}")
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-dir", default=None, help="model cache (default $OMNI_TRIO_CACHE or ~/.cache)"
    )
    parser.add_argument(
        "--models",
        type=csv_arg,
        default=MODELS,
        help="default builtin:echo,builtin:tiny-sd",
    )
    parser.add_argument("--workers", type=_workers, default=(1, 2), help="default 1,2")
    parser.add_argument(
        "--backends", type=_backends, default=BACKENDS, help="default inproc,tractor,ray"
    )
    parser.add_argument(
        "--blocks",
        type=int,
        default=None,
        help="interleaved rounds per part (default 8; --quick: 2; --repeats is the same)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        help="sequential requests per latency block (default echo 100, tiny-sd 8; --quick: 3)",
    )
    parser.add_argument(
        "--throughput-requests",
        type=int,
        default=None,
        help="requests per throughput round (default echo 25, tiny-sd 4 x --concurrency)",
    )
    parser.add_argument(
        "--concurrency", type=int, default=4, help="clients in the throughput part (default 4)"
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=4, help="requests per fused batch (default 4)"
    )
    parser.add_argument(
        "--torch-threads", type=int, default=1, help="torch threads per worker (default 1)"
    )
    g = parser.add_argument_group("requests")
    g.add_argument("--echo-size", type=int, default=32, help="echo height = width (default 32)")
    g.add_argument("--echo-steps", type=int, default=4, help="echo steps, 0 ms each (default 4)")
    g.add_argument("--sd-size", type=int, default=64, help="tiny-sd height = width (default 64)")
    g.add_argument(
        "--sd-steps", type=int, default=None, help="tiny-sd steps (default 10; --quick: 2)"
    )
    g.add_argument("--guidance", type=float, default=7.5, help="tiny-sd guidance (default 7.5)")
    g.add_argument(
        "--async-output",
        choices=("on", "off"),
        default="on",
        help="request-mode async output packing on every engine (EngineConfig.async_output; "
        "default on)",
    )


# -- Ray -----------------------------------------------------------------------------------


def ray_installed() -> bool:
    """Whether the ``ray`` package can be imported (without importing it)."""
    return importlib.util.find_spec("ray") is not None


@dataclass
class _RaySession:
    """The Ray this run uses: ``owned`` when this command started it (and stops it)."""

    ray: Any
    owned: bool
    start_s: float
    node_ip: str | None


@asynccontextmanager
async def _ray_session(needed: bool) -> AsyncIterator[_RaySession | None]:
    """Ray for the ``ray`` engines if ``needed`` and installed (else ``None``): an
    initialised Ray is reused and left running; otherwise a local one is started on
    127.0.0.1 and shut down on exit."""
    if not needed or not ray_installed():
        yield None
        return
    from ..executors.ray_executor import ensure_ray, import_ray

    ray = import_ray()
    reused = ray.is_initialized()
    started = time.perf_counter()
    if not reused:
        # ensure_ray starts Ray in a thread of its own that lives as long as Ray does.
        await trio.to_thread.run_sync(ensure_ray)
    session = _RaySession(
        ray=ray,
        owned=not reused,
        start_s=0.0 if reused else time.perf_counter() - started,
        node_ip=ray.util.get_node_ip_address(),
    )
    try:
        yield session
    finally:
        if session.owned:
            ray.shutdown()  # blocking (about a second), at the very end of the run


# -- one cell ------------------------------------------------------------------------------


def _ms(samples_s: Sequence[float]) -> Summary:
    return Summary.of(samples_s).scaled(1000.0)


def _signed(summary: Summary, fmt: str = "{:+.2f}") -> str:
    return summary.spread(fmt)


COLUMNS = [
    "cell",
    "backend",
    "startup s",
    "latency ms c=1 (block medians min / med / max)",
    "p50 / p90 / p99 ms",
    "- inproc ms (min / med / max)",
    "- tractor ms (min / med / max)",
    "req/s (min / med / max)",
    "x inproc (min / med / max)",
    "x tractor (min / med / max)",
]


def _config(cell: Cell, backend: str, args: argparse.Namespace) -> EngineConfig:
    options = {"step_delay_s": 0.0} if cell.model == "builtin:echo" else {}
    return EngineConfig(
        model=cell.model,
        model_options=options,
        backend=backend,
        num_workers=cell.workers,
        cfg_parallel=cell.cfg_parallel,
        max_num_seqs=args.max_num_seqs,
        torch_threads=args.torch_threads,
        cache_dir=args.cache_dir,
        warmup=True,
        async_output=getattr(args, "async_output", "on") == "on",
    )


async def _run_cell(
    cell: Cell,
    args: argparse.Namespace,
    bar: Progress,
    blocks: int,
    warmup: int,
    ray: _RaySession | None,
) -> dict[str, Any]:
    """Open the cell's engines, run both parts interleaved, close them; the cell's figures."""
    params = sampling_for(cell.model, args)
    block, burst = counts_for(cell.model, args)
    running = tuple(b for b in cell.backends if b != "ray" or ray is not None)
    missing = {b: NOT_INSTALLED for b in cell.backends if b not in running}
    startup_s: dict[str, float] = {}
    cfg_active: dict[str, list[bool]] = {}
    latencies: dict[str, list[float]] = {b: [] for b in running}
    async with AsyncExitStack() as stack:
        engines: list[AsyncEngine] = []
        for backend in running:
            started = time.perf_counter()
            engine = await stack.enter_async_context(open_engine(_config(cell, backend, args)))
            startup_s[backend] = time.perf_counter() - started
            engines.append(engine)
            described = await engine.collective_rpc("describe", unique_reply_rank=None)
            replies = described if isinstance(described, list) else [described]
            cfg_active[backend] = [bool(d.get("cfg_parallel")) for d in replies]

        def throughput_round(engine: AsyncEngine) -> Callable[[], Awaitable[RunResult]]:
            async def call() -> RunResult:
                return await drive(engine, params, requests=burst, concurrency=args.concurrency)

            return call

        lat_rounds = await run_interleaved_async(
            [
                sequential_block(e, params, block, latencies[b])
                for b, e in zip(running, engines, strict=True)
            ],
            blocks,
            warmup=warmup,
            on_round=bar.advance,
        )
        tput_rounds = await run_interleaved_async(
            [throughput_round(e) for e in engines], blocks, warmup=warmup, on_round=bar.advance
        )
    for name in running:
        del latencies[name][: warmup * block]
    medians = {b: [r[i] for r in lat_rounds] for i, b in enumerate(running)}
    runs = {b: [r[i] for r in tput_rounds] for i, b in enumerate(running)}
    rps = {b: [x.requests_per_s for x in runs[b]] for b in running}
    minus = paired(medians, cell.baselines, pair_differences)
    ratio = paired(rps, cell.baselines, pair_ratios)
    entries: dict[str, Any] = {}
    for name in running:
        entries[name] = {
            "status": "ran",
            "startup_s": startup_s[name],
            "cfg_parallel_per_rank": cfg_active[name],
            "block_median_latency_ms": _ms(medians[name]),
            "latency_ms": _ms(latencies[name]),
            "minus_ms": {base: s.scaled(1000.0) for base, s in minus.get(name, {}).items()},
            "requests_per_s": Summary.of(rps[name]),
            "ratio": ratio.get(name, {}),
            "failed": sum(x.failed for x in runs[name]),
        }
    for name, status in missing.items():
        entries[name] = {"status": status}
    return {
        "model": cell.model,
        "workers": cell.workers,
        "label": cell.label,
        "cfg_parallel": cell.cfg_parallel,
        "baselines": list(cell.baselines),
        "request": {
            "height": params.height,
            "width": params.width,
            "steps": params.num_inference_steps,
            "guidance_scale": params.guidance_scale if cell.model != "builtin:echo" else None,
            "output_type": params.output_type,
        },
        "requests_per_block": block,
        "requests_per_throughput_round": burst,
        "backends": {b: entries[b] for b in cell.backends},
    }


def cell_rows(result: Mapping[str, Any]) -> list[dict[str, str]]:
    """The table rows of one cell's result (as :func:`_run_cell` returns it)."""
    rows: list[dict[str, str]] = []
    for i, (name, entry) in enumerate(result["backends"].items()):
        row = dict.fromkeys(COLUMNS, "-")
        row["cell"] = result["label"] if i == 0 else ""
        row["backend"] = name
        if entry["status"] != "ran":
            for col in COLUMNS[2:]:
                row[col] = entry["status"]
            rows.append(row)
            continue
        row["startup s"] = f"{entry['startup_s']:.1f}"
        row[COLUMNS[3]] = entry["block_median_latency_ms"].spread("{:.2f}")
        row[COLUMNS[4]] = entry["latency_ms"].tail("{:.2f}")
        for base, col in (("inproc", COLUMNS[5]), ("tractor", COLUMNS[6])):
            if base in entry["minus_ms"]:
                row[col] = _signed(entry["minus_ms"][base])
        row[COLUMNS[7]] = entry["requests_per_s"].spread("{:.1f}")
        for base, col in (("inproc", COLUMNS[8]), ("tractor", COLUMNS[9])):
            if base in entry["ratio"]:
                row[col] = entry["ratio"][base].spread("{:.2f}")
        rows.append(row)
    return rows


# -- the experiment ----------------------------------------------------------------------


async def _main(args: argparse.Namespace, report: Report) -> None:
    quick = args.quick
    blocks = args.blocks or args.repeats or (2 if quick else 8)
    warmup = 1 if args.warmup is None else args.warmup
    cells = plan_cells(args.models, args.workers, args.backends)
    if not cells:
        raise ValueError("no cell to run: check --models, --workers and --backends")
    wants_ray = any("ray" in c.backends for c in cells)
    report.params.update(
        {
            "models": list(args.models),
            "workers": list(args.workers),
            "backends": list(args.backends),
            "blocks": blocks,
            "warmup_rounds": warmup,
            "concurrency": args.concurrency,
            "max_num_seqs": args.max_num_seqs,
            "torch_threads": args.torch_threads,
            "async_output": args.async_output,
            "quick": quick,
        }
    )
    report.results["cells"] = []
    needs_tractor = any("tractor" in c.backends for c in cells)
    with Progress(2 * blocks * len(cells), "executors", enabled=not args.no_progress) as bar:
        async with _ray_session(wants_ray) as ray, _tractor_runtime(needs_tractor):
            if wants_ray:
                report.results["ray"] = (
                    {"installed": False}
                    if ray is None
                    else {
                        "installed": True,
                        "version": getattr(ray.ray, "__version__", None),
                        "started_here": ray.owned,
                        "start_s": ray.start_s,
                        "node_ip": ray.node_ip,
                    }
                )
            for cell in cells:
                result = await _run_cell(cell, args, bar, blocks, warmup, ray)
                report.results["cells"].append(result)
                report.rows.extend(cell_rows(result))
    _add_notes(report, cells)


def _add_notes(report: Report, cells: Sequence[Cell]) -> None:
    results = report.results
    params = report.params
    counts = {
        c["model"]: (c["requests_per_block"], c["requests_per_throughput_round"])
        for c in results["cells"]
    }
    report.notes.append(
        f"latency: {params['blocks']} interleaved blocks per backend of "
        + ", ".join(f"{m} {n[0]}" for m, n in counts.items())
        + " sequential requests; '- inproc' / '- tractor': block median minus the baseline's "
        f"of the same round; throughput: {params['blocks']} rounds of "
        + ", ".join(f"{m} {n[1]}" for m, n in counts.items())
        + f" requests from {params['concurrency']} closed-loop clients, max_num_seqs="
        f"{params['max_num_seqs']}; 'x inproc' / 'x tractor': requests/s ratio to the "
        "baseline's of the same round"
    )
    cores = machine_info(device="cpu").get("cores") or 0
    if cores < 4 and any(c.workers > 1 for c in cells):
        report.notes.append(
            f"2 workers: {cores} cores shared by 2 worker processes, the engine (and Ray's "
            "daemons): the ranks slow each other down, so CFG-parallel cannot gain here; "
            "the 2-worker rows show the backends' relative cost, not a speed-up"
        )
    if any(c.workers > 1 and not c.cfg_parallel for c in cells):
        report.notes.append(
            "2 workers on builtin:echo: cfg_parallel does not apply (no guidance to split); "
            "every rank runs each request whole and only the output rank ships the result"
        )
    for cell in results["cells"]:
        for name, entry in cell["backends"].items():
            if entry.get("status") != "ran":
                continue
            want = cell["cfg_parallel"]
            if want and not all(entry["cfg_parallel_per_rank"]):
                report.notes.append(
                    f"{cell['label']}: {name} did not report cfg_parallel on every rank "
                    f"({entry['cfg_parallel_per_rank']})"
                )
            if entry["failed"]:
                report.notes.append(f"{cell['label']}: {name}: {entry['failed']} requests failed")
    ray = results.get("ray")
    if ray is not None:
        if not ray["installed"]:
            report.notes.append("ray: not installed (pip install 'omni-trio[ray]'): not measured")
        elif ray["started_here"]:
            report.notes.append(
                f"ray: Ray {ray['version']} was initialised for this run (a local Ray unless "
                f"$RAY_ADDRESS is set; this node {ray['node_ip']}) in {ray['start_s']:.1f} s, "
                "not counted in the engines' startup, and shut down at the end"
            )
        else:
            report.notes.append(
                f"ray: reused the Ray already initialised in this process (node {ray['node_ip']})"
            )
    after = load_average()
    results["load_average_1m_after"] = after
    report.notes.append(
        f"load average (1 min) after the run: {after}; the engines, worker processes and "
        "Ray's own daemons share this machine's cores"
    )


def run(args: argparse.Namespace, command: str) -> Report:
    report = Report(experiment="executors", command=command, columns=COLUMNS)
    return run_in_trio(report, _main, args, torch_threads=args.torch_threads)
