"""``bench sleep``: what sleep and wake free and cost, on real worker processes.

One tractor worker (fork server) serves the model.  For each level, each round: render one
picture awake, put the worker to sleep, read its memory, wake it, read it again, render the
same picture.  Reported per level: the bytes the worker released (its own count), the
worker's **RSS** and **PSS** awake, asleep and after the wake (``/proc/<pid>/status`` and
``smaps_rollup``), how long falling asleep and waking took (``AsyncEngine.sleep`` /
``wake_up`` as the caller sees them), and whether the picture after the wake is the one
before, bit for bit.  Nothing is asserted: the numbers are the result.

Level 1 on a CPU writes the weights to a private file (``--sleep-dir``, default the system's
temporary directory), so RSS falls by about the weights' size and the wake reads them back;
level 2 keeps nothing and reloads the model directory.  On a small model (``builtin:shapes``
holds 9 MB of weights) the change is small next to torch's own memory: pass a larger local
diffusers directory as ``--model`` to see more.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from .harness import Report, run_in_trio

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="builtin:shapes")
    parser.add_argument("--levels", default="1,2", help="comma-separated sleep levels")
    parser.add_argument("--steps", type=int, default=10, help="denoising steps per picture")
    parser.add_argument("--sleep-dir", default=None, help="where level 1 keeps the weights")
    parser.add_argument(
        "--backend", choices=("tractor", "inproc"), default="tractor", help="where the worker runs"
    )
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--cache-dir", default=None)


def run(args: argparse.Namespace, command: str) -> Report:
    report = Report(experiment="sleep", command=command)
    return run_in_trio(report, _main, args, torch_threads=args.torch_threads)


def memory_mib(pid: int) -> tuple[float | None, float | None]:
    """``(RSS, PSS)`` of process ``pid`` in MiB (None where ``/proc`` cannot tell)."""
    rss = pss = None
    try:
        with open(f"/proc/{pid}/status") as file:
            for line in file:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) / 1024
    except OSError:
        pass
    try:
        with open(f"/proc/{pid}/smaps_rollup") as file:
            for line in file:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1]) / 1024
    except OSError:
        pass
    return rss, pss


async def _main(args: argparse.Namespace, report: Report) -> None:
    import os

    import numpy as np

    from .._core.request import SamplingParams
    from ..config import EngineConfig
    from ..runtime.engine import open_engine

    levels = [int(x) for x in str(args.levels).split(",") if x.strip()]
    repeats = 1 if args.quick else (args.repeats or 3)
    settings: dict[str, Any] = {
        "model": args.model,
        "backend": args.backend,
        "torch_threads": args.torch_threads,
        "warmup": False,
        "sleep_dir": args.sleep_dir,
    }
    if args.cache_dir:
        settings["cache_dir"] = args.cache_dir
    if args.backend == "tractor":
        settings["worker_start_method"] = "forkserver"
    report.params = {**settings, "levels": levels, "repeats": repeats, "steps": args.steps}
    ask = SamplingParams(num_inference_steps=args.steps, seed=3)
    async with open_engine(EngineConfig(**settings)) as engine:
        pids = getattr(engine.executor, "worker_pids", None)
        pid = pids()[0] if callable(pids) else os.getpid()
        for level in levels:
            for round_ in range(repeats):
                before = await engine.generate("a red circle", ask)
                rss_awake, pss_awake = memory_mib(pid)
                started = time.perf_counter()
                reports = await engine.sleep(level)
                sleep_s = time.perf_counter() - started
                rss_asleep, pss_asleep = memory_mib(pid)
                started = time.perf_counter()
                await engine.wake_up()
                wake_s = time.perf_counter() - started
                rss_woken, pss_woken = memory_mib(pid)
                after = await engine.generate("a red circle", ask)
                same = np.array_equal(np.asarray(before.images[0]), np.asarray(after.images[0]))
                report.rows.append(
                    {
                        "level": level,
                        "round": round_,
                        "released_mib": sum(r["released_bytes"] for r in reports) / 2**20,
                        "rss_awake_mib": rss_awake,
                        "rss_asleep_mib": rss_asleep,
                        "rss_woken_mib": rss_woken,
                        "pss_awake_mib": pss_awake,
                        "pss_asleep_mib": pss_asleep,
                        "pss_woken_mib": pss_woken,
                        "sleep_s": sleep_s,
                        "wake_s": wake_s,
                        "same_image": same,
                    }
                )
    for level in levels:
        rows = [r for r in report.rows if r["level"] == level]
        if not rows:
            continue
        mid = sorted(rows, key=lambda r: r["wake_s"])[len(rows) // 2]
        freed = [
            r["rss_awake_mib"] - r["rss_asleep_mib"]
            for r in rows
            if r["rss_awake_mib"] is not None and r["rss_asleep_mib"] is not None
        ]
        report.results[f"level{level}"] = {
            "released_mib": mid["released_mib"],
            "rss_freed_mib_median": sorted(freed)[len(freed) // 2] if freed else None,
            "wake_s_median": mid["wake_s"],
            "all_same_image": all(r["same_image"] for r in rows),
        }
    report.columns = [
        "level",
        "round",
        "released_mib",
        "rss_awake_mib",
        "rss_asleep_mib",
        "rss_woken_mib",
        "pss_awake_mib",
        "pss_asleep_mib",
        "sleep_s",
        "wake_s",
        "same_image",
    ]
