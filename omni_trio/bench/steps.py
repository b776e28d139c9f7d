"""``bench steps``: step mode with continuous batching vs request mode on a mixed workload.

Issue #3's measurement.  Every round sends ``--requests`` requests whose step counts are drawn
(seeded, ``--mix-seed``) from ``--steps-mix`` (default 4, 10, 30), all of one size, from
``--concurrency`` (8) closed-loop clients, to two engines on ``--model`` (default
``builtin:tiny-sd``), both ``max_num_seqs=8``, both open at once and run in turn, round after
round (A B A B), each round with the same draw for both::

    step      step_execution=True: one denoising step per tick for every running request;
              requests with different step counts share ticks (continuous batching)
    request   request mode: a wave runs from noise to image in one call; only requests with
              equal step counts fuse, and a 4-step request queued behind a 30-step wave waits

Reported per mode: requests/s and images/s (min / median / max over rounds), latency p50 / p90
/ p99 over every request and over the *short* requests (the fewest steps of the mix) alone,
and, pair by pair (round by round), step / request requests/s and request / step p99 latency
of the short requests.  Expected: step mode has the higher throughput and a much lower p99 for
short requests (no head-of-line blocking behind long waves).  ``--torch-threads`` defaults to 1.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from typing import Any

from .._core.request import SamplingParams
from ..config import EngineConfig
from ..runtime.engine import AsyncEngine, open_engine
from ._clients import RunResult, drive_mixed
from .harness import (
    Progress,
    Report,
    Summary,
    pair_ratios,
    percentile,
    positive_ints_arg,
    run_in_trio,
    run_interleaved_async,
)

__all__ = ["add_arguments", "run"]

DEFAULT_MIX = (4, 10, 30)
QUICK_MIX = (1, 2, 3)
MODES = ("step", "request")
SEED = 1234


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-dir", default=None, help="model cache (default $OMNI_TRIO_CACHE or ~/.cache)"
    )
    parser.add_argument("--model", default="builtin:tiny-sd", help="default builtin:tiny-sd")
    parser.add_argument(
        "--steps-mix",
        type=positive_ints_arg,
        default=None,
        help="step counts to draw from, uniformly (default 4,10,30; --quick: 1,2,3)",
    )
    parser.add_argument("--mix-seed", type=int, default=0, help="seed of the step-count draw")
    parser.add_argument(
        "--requests", type=int, default=None, help="requests per round (default 48)"
    )
    parser.add_argument("--concurrency", type=int, default=8, help="client tasks (default 8)")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="both engines (default 8)")
    parser.add_argument(
        "--size", type=int, default=None, help="height = width (default: the model's own)"
    )
    parser.add_argument(
        "--output-type", default="pil", choices=("pil", "np", "pt", "latent"), help="default pil"
    )
    parser.add_argument("--backend", default="inproc", help="executor backend (default inproc)")
    parser.add_argument(
        "--torch-threads", type=int, default=1, help="torch threads per worker (default 1)"
    )


def draw_steps(mix: Sequence[int], requests: int, rounds: int, seed: int) -> list[list[int]]:
    """``rounds`` lists of ``requests`` step counts drawn uniformly from ``mix``, seeded."""
    rng = random.Random(seed)
    return [[rng.choice(mix) for _ in range(requests)] for _ in range(rounds)]


def _subset(run: RunResult, steps: int | None) -> list[float]:
    """Latencies (s) of the completed requests with ``steps`` steps (all when None)."""
    if steps is None:
        return list(run.latencies_s)
    return [lat for lat, s in zip(run.latencies_s, run.steps, strict=True) if s == steps]


def _p99_ms(samples_s: list[float]) -> float:
    return percentile(samples_s, 99) * 1000.0 if samples_s else float("nan")


async def _main(args: argparse.Namespace, report: Report) -> None:
    quick = args.quick
    mix: tuple[int, ...] = args.steps_mix or (QUICK_MIX if quick else DEFAULT_MIX)
    requests = args.requests or (8 if quick else 48)
    repeats = args.repeats or (2 if quick else 5)
    warmup = 1 if args.warmup is None else args.warmup
    if requests < 1 or args.concurrency < 1 or args.max_num_seqs < 1:
        raise ValueError("--requests, --concurrency and --max-num-seqs must be >= 1")
    short, long = min(mix), max(mix)
    draws = draw_steps(mix, requests, warmup + repeats, args.mix_seed)
    report.params.update(
        {
            "model": args.model,
            "backend": args.backend,
            "steps_mix": list(mix),
            "mix_seed": args.mix_seed,
            "short_steps": short,
            "long_steps": long,
            "requests_per_round": requests,
            "concurrency": args.concurrency,
            "max_num_seqs": args.max_num_seqs,
            "size": args.size,
            "output_type": args.output_type,
            "torch_threads": args.torch_threads,
            "repeats": repeats,
            "warmup_rounds": warmup,
            "quick": quick,
        }
    )
    base = EngineConfig(
        model=args.model,
        backend=args.backend,
        max_num_seqs=args.max_num_seqs,
        torch_threads=args.torch_threads,
        cache_dir=args.cache_dir,
    )
    async with AsyncExitStack() as stack:
        engines: list[AsyncEngine] = []
        for mode in MODES:
            config = base.replace(step_execution=mode == "step")
            engines.append(await stack.enter_async_context(open_engine(config)))
        info = engines[0].executor.model_info
        height = args.size or (info.default_height if info else None)
        width = args.size or (info.default_width if info else None)
        report.params["height"], report.params["width"] = height, width

        def params_of(round_index: int) -> list[SamplingParams]:
            return [
                SamplingParams(
                    height=height,
                    width=width,
                    num_inference_steps=steps,
                    seed=SEED + i,
                    output_type=args.output_type,
                )
                for i, steps in enumerate(draws[round_index])
            ]

        def runner(engine: AsyncEngine) -> Callable[[], Awaitable[RunResult]]:
            calls = iter(range(len(draws)))  # call k (warmup included) runs draw k

            async def call() -> RunResult:
                return await drive_mixed(
                    engine, params_of(next(calls)), concurrency=args.concurrency
                )

            return call

        with Progress(repeats, "steps", enabled=not args.no_progress) as bar:
            rounds = await run_interleaved_async(
                [runner(e) for e in engines], repeats, warmup=warmup, on_round=bar.advance
            )
    _summarise(report, rounds, mix, short, long)


def _summarise(
    report: Report, rounds: list[list[RunResult]], mix: Sequence[int], short: int, long: int
) -> None:
    by_mode = {mode: [r[i] for r in rounds] for i, mode in enumerate(MODES)}
    request_rps = [x.requests_per_s for x in by_mode["request"]]
    request_p99_short = [_p99_ms(_subset(x, short)) for x in by_mode["request"]]
    results: dict[str, Any] = {}
    for mode, runs in by_mode.items():
        rps = [x.requests_per_s for x in runs]
        everything = [s for x in runs for s in x.latencies_s]
        shorts = [s for x in runs for s in _subset(x, short)]
        longs = [s for x in runs for s in _subset(x, long)]
        short_wait = [
            w for x in runs for w, s in zip(x.queue_wait_ms, x.steps, strict=True) if s == short
        ]
        failed = sum(x.failed for x in runs)
        entry: dict[str, Any] = {
            "mode": mode,
            "requests_per_s": Summary.of(rps),
            "images_per_s": Summary.of([x.images_per_s for x in runs]),
            "latency_ms": Summary.of(everything).scaled(1000.0) if everything else None,
            "latency_ms_short": Summary.of(shorts).scaled(1000.0) if shorts else None,
            "latency_ms_long": Summary.of(longs).scaled(1000.0) if longs else None,
            "queue_wait_ms_short": Summary.of(short_wait) if short_wait else None,
            "short_requests": len(shorts),
            "completed": sum(x.completed for x in runs),
            "failed": failed,
        }
        if mode == "step":
            p99_short = [_p99_ms(_subset(x, short)) for x in runs]
            entry["ratio_requests_per_s_vs_request"] = Summary.of(pair_ratios(rps, request_rps))
            pairs = [
                (a, b)
                for a, b in zip(request_p99_short, p99_short, strict=True)
                if a == a and b == b  # rounds without a short request have NaN
            ]
            entry["ratio_short_p99_request_over_step"] = (
                Summary.of(pair_ratios([a for a, _ in pairs], [b for _, b in pairs]))
                if pairs
                else None
            )
        results[mode] = entry
        lat, lat_short, lat_long = (
            entry["latency_ms"],
            entry["latency_ms_short"],
            entry["latency_ms_long"],
        )
        ratio = entry.get("ratio_requests_per_s_vs_request")
        p99_ratio = entry.get("ratio_short_p99_request_over_step")
        report.rows.append(
            {
                "mode": mode,
                "requests/s min / med / max": entry["requests_per_s"].spread("{:.2f}"),
                "images/s med": f"{entry['images_per_s'].median:.2f}",
                "latency ms p50 / p90 / p99": lat.tail("{:.0f}") if lat else "-",
                f"{short}-step latency ms p50 / p90 / p99": (
                    lat_short.tail("{:.0f}") if lat_short else "-"
                ),
                f"{long}-step latency ms p50 / p99": (
                    f"{lat_long.p50:.0f} / {lat_long.p99:.0f}" if lat_long else "-"
                ),
                "step / request req/s (min / med / max)": ratio.spread("{:.2f}") if ratio else "-",
                f"{short}-step p99 request / step (min / med / max)": (
                    p99_ratio.spread("{:.2f}") if p99_ratio else "-"
                ),
                "failed": failed,
            }
        )
        if failed:
            report.notes.append(f"{mode} mode: {failed} requests failed")
    step = results["step"]
    rps_ratio = step["ratio_requests_per_s_vs_request"].median
    step_short, request_short = step["latency_ms_short"], results["request"]["latency_ms_short"]
    short_p99_ratio = (
        request_short.p99 / step_short.p99 if step_short and request_short else float("nan")
    )
    results["comparison"] = {
        "throughput_ratio_step_over_request_median": rps_ratio,
        "short_p99_ratio_request_over_step_pooled": short_p99_ratio,
        "step_throughput_higher": rps_ratio > 1.0,
        "step_short_p99_lower": short_p99_ratio > 1.0,
    }
    report.results = {"modes": results, "steps_mix": list(mix), "short_steps": short}
    if rps_ratio <= 1.0:
        report.notes.append(
            f"expected step mode to have the higher throughput: step / request requests/s "
            f"median {rps_ratio:.3f} ({(1.0 - rps_ratio) * 100:.1f} % lower)"
        )
    if not short_p99_ratio > 1.0:
        report.notes.append(
            f"expected a lower p99 for {short}-step requests in step mode: request / step "
            f"p99 = {short_p99_ratio:.2f}"
        )


def run(args: argparse.Namespace, command: str) -> Report:
    report = Report(experiment="steps", command=command)
    return run_in_trio(report, _main, args, torch_threads=args.torch_threads)
