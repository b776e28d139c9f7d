"""``bench throughput``: N requests at a concurrency through the engine.

Each variant (every combination of ``--max-num-seqs`` and ``--mode``) gets its own engine; all
are open at once and run in turn, round after round, so a noisy patch of the machine hits every
variant.  A round sends ``--requests`` requests from ``--concurrency`` closed-loop clients.
Reported per variant: requests/s and images/s (min / median / max over rounds), latency and
queue wait (p50 / p90 / p99 over every request), failures by error type, and requests/s
relative to the first variant, round by round.
"""

from __future__ import annotations

import argparse
import itertools
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

from .._core.request import SamplingParams
from ..config import EngineConfig
from ..runtime.engine import AsyncEngine, open_engine
from ._clients import RunResult, drive, sync_torch_threads
from .harness import (
    Progress,
    Report,
    Summary,
    pair_ratios,
    positive_ints_arg,
    run_in_trio,
    run_interleaved_async,
)

__all__ = ["add_arguments", "run"]

SEED = 1234


def _modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    if not modes or any(m not in ("request", "step") for m in modes):
        raise argparse.ArgumentTypeError(f"modes are 'request' and 'step', got {text!r}")
    return modes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-dir", default=None, help="model cache (default $OMNI_TRIO_CACHE or ~/.cache)"
    )
    parser.add_argument("--model", default="builtin:echo", help="default builtin:echo")
    parser.add_argument("--requests", type=int, default=None, help="per round (default 256)")
    parser.add_argument("--concurrency", type=int, default=16, help="client tasks (default 16)")
    parser.add_argument(
        "--max-num-seqs",
        type=positive_ints_arg,
        default=(1,),
        help="comma-separated; one engine per value (default 1)",
    )
    parser.add_argument(
        "--mode", type=_modes, default=("request",), help="request and/or step (default request)"
    )
    parser.add_argument("--backend", default="inproc", help="executor backend (default inproc)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default 20)")
    parser.add_argument(
        "--size", type=int, default=None, help="height = width (default: the model's own)"
    )
    parser.add_argument("--num-outputs", type=int, default=1, help="images per request")
    parser.add_argument(
        "--output-type", default="pil", choices=("pil", "np", "pt", "latent"), help="default pil"
    )
    parser.add_argument(
        "--step-delay-s",
        type=float,
        default=None,
        help="builtin:echo only: seconds slept per step (default 0)",
    )
    parser.add_argument(
        "--batch-wait-ms", type=float, default=0.0, help="request_batch_max_wait_ms (default 0)"
    )
    parser.add_argument("--torch-threads", type=int, default=None)


def _variant_name(seqs: int, mode: str) -> str:
    return f"{mode} max_num_seqs={seqs}"


async def _main(args: argparse.Namespace, report: Report) -> None:
    quick = args.quick
    requests = args.requests or (16 if quick else 256)
    repeats = args.repeats or (2 if quick else 5)
    warmup = 1 if args.warmup is None else args.warmup
    steps = args.steps or (2 if quick else 20)
    options: dict[str, Any] = {}
    if args.model == "builtin:echo":
        options["step_delay_s"] = args.step_delay_s or 0.0
    elif args.step_delay_s is not None:
        raise ValueError("--step-delay-s applies to builtin:echo only")
    variants = list(itertools.product(args.max_num_seqs, args.mode))
    params = SamplingParams(
        height=args.size,
        width=args.size,
        num_inference_steps=steps,
        num_outputs_per_prompt=args.num_outputs,
        seed=SEED,
        output_type=args.output_type,
    )
    report.params.update(
        {
            "model": args.model,
            "model_options": options,
            "backend": args.backend,
            "requests_per_round": requests,
            "concurrency": args.concurrency,
            "max_num_seqs": list(args.max_num_seqs),
            "modes": list(args.mode),
            "steps": steps,
            "size": args.size,
            "num_outputs": args.num_outputs,
            "output_type": args.output_type,
            "request_batch_max_wait_ms": args.batch_wait_ms,
            "repeats": repeats,
            "warmup_rounds": warmup,
            "quick": quick,
        }
    )
    async with AsyncExitStack() as stack:
        engines: list[AsyncEngine] = []
        for seqs, mode in variants:
            config = EngineConfig(
                model=args.model,
                model_options=options,
                backend=args.backend,
                max_num_seqs=seqs,
                step_execution=mode == "step",
                request_batch_max_wait_ms=args.batch_wait_ms,
                torch_threads=args.torch_threads,
                cache_dir=args.cache_dir,
            )
            engines.append(await stack.enter_async_context(open_engine(config)))
        threads, _ = await sync_torch_threads(engines[0])
        info = engines[0].executor.model_info
        if info is not None:
            report.params["height"] = args.size or info.default_height
            report.params["width"] = args.size or info.default_width

        def runner(engine: AsyncEngine) -> Callable[[], Awaitable[RunResult]]:
            async def call() -> RunResult:
                return await drive(engine, params, requests=requests, concurrency=args.concurrency)

            return call

        with Progress(repeats, "throughput", enabled=not args.no_progress) as bar:
            rounds = await run_interleaved_async(
                [runner(e) for e in engines], repeats, warmup=warmup, on_round=bar.advance
            )
    report.params["torch_threads"] = threads
    first = [r[0].requests_per_s for r in rounds]
    results: dict[str, Any] = {}
    for i, (seqs, mode) in enumerate(variants):
        runs = [r[i] for r in rounds]
        rps = [x.requests_per_s for x in runs]
        latencies = [s for x in runs for s in x.latencies_s]
        queue_wait = [s for x in runs for s in x.queue_wait_ms]
        errors: Counter[str] = Counter()
        for x in runs:
            errors.update(x.errors)
        failed = sum(x.failed for x in runs)
        entry: dict[str, Any] = {
            "max_num_seqs": seqs,
            "mode": mode,
            "requests_per_s": Summary.of(rps),
            "images_per_s": Summary.of([x.images_per_s for x in runs]),
            "ratio_vs_first": Summary.of(pair_ratios(rps, first)) if all(first) else None,
            "latency_ms": Summary.of(latencies).scaled(1000.0) if latencies else None,
            "queue_wait_ms": Summary.of(queue_wait) if queue_wait else None,
            "completed": sum(x.completed for x in runs),
            "failed": failed,
            "errors": dict(errors),
        }
        results[_variant_name(seqs, mode)] = entry
        lat = entry["latency_ms"]
        qw = entry["queue_wait_ms"]
        ratio = entry["ratio_vs_first"]
        report.rows.append(
            {
                "variant": _variant_name(seqs, mode),
                "requests/s min / med / max": entry["requests_per_s"].spread("{:.1f}"),
                "images/s median": f"{entry['images_per_s'].median:.1f}",
                "latency ms p50 / p90 / p99": lat.tail("{:.1f}") if lat else "-",
                "queue wait ms p50 / p90 / p99": qw.tail("{:.1f}") if qw else "-",
                "vs first (min / med / max)": ratio.spread("{:.2f}") if ratio else "-",
                "failed": failed,
            }
        )
        if failed:
            kinds = ", ".join(f"{k} x{v}" for k, v in errors.most_common())
            report.notes.append(f"{_variant_name(seqs, mode)}: {failed} requests failed ({kinds})")
    report.results = {"variants": results}


def run(args: argparse.Namespace, command: str) -> Report:
    report = Report(
        experiment="throughput",
        command=command,
        columns=[
            "variant",
            "requests/s min / med / max",
            "images/s median",
            "latency ms p50 / p90 / p99",
            "queue wait ms p50 / p90 / p99",
            "vs first (min / med / max)",
            "failed",
        ],
    )
    return run_in_trio(report, _main, args)
