"""``bench quality``: does ``builtin:shapes`` draw what it is asked for?

For every named colour and shape of the procedural dataset (:mod:`omni_trio.models.shapes`;
``--colours`` / ``--shapes`` pick a subset)
the prompt ``"a <colour> <shape>"`` ("an orange circle") is rendered ``--samples`` times
(seeds ``--seed``, ``--seed + 1``, ...; the same seeds for every prompt) through a real engine
at the request defaults (20 steps, guidance 7.5, the model's size), and each image is judged
by :func:`omni_trio.models.shapes.judge`: the hue of the largest non-white blob against the
named colours (nearest hue), and the share of its bounding box it fills against the shapes
(square ~1, circle ~pi/4, triangle ~1/2).  An image without such a blob is wrong on both.

Reported: per prompt the share of images with the right colour and the right shape, and the
totals over all prompts -- *colour adherence* and *shape adherence* -- against the targets
(colour >= 90 %, shape >= 70 %).  A missed target is a note, not an error.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from .._core.request import SamplingParams
from ..config import EngineConfig
from ..runtime.engine import AsyncEngine, open_engine
from .harness import Progress, Report, run_in_trio

__all__ = ["COLOUR_TARGET", "SHAPE_TARGET", "add_arguments", "prompt_for", "run"]

COLOUR_TARGET = 0.90
SHAPE_TARGET = 0.70
SEED = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-dir", default=None, help="model cache (default $OMNI_TRIO_CACHE or ~/.cache)"
    )
    parser.add_argument("--model", default="builtin:shapes", help="default builtin:shapes")
    parser.add_argument(
        "--samples", type=int, default=None, help="images per prompt (default 10; --quick: 1)"
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="denoising steps (default 20; --quick: 4)"
    )
    parser.add_argument("--guidance", type=float, default=7.5, help="guidance scale (7.5)")
    parser.add_argument("--seed", type=int, default=SEED, help=f"first seed (default {SEED})")
    parser.add_argument(
        "--colours", type=_names, default=None, help="comma-separated subset (default: all six)"
    )
    parser.add_argument(
        "--shapes", type=_names, default=None, help="comma-separated subset (default: all three)"
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=8, help="requests per fused batch (default 8)"
    )
    parser.add_argument("--backend", default="inproc", help="executor backend (default inproc)")
    parser.add_argument(
        "--torch-threads", type=int, default=1, help="torch threads per worker (default 1)"
    )


def _names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated names")
    return names


def _subset(chosen: tuple[str, ...] | None, known: tuple[str, ...], what: str) -> tuple[str, ...]:
    if chosen is None:
        return known
    unknown = [name for name in chosen if name not in known]
    if unknown:
        raise ValueError(f"unknown {what} {', '.join(unknown)}; known: {', '.join(known)}")
    return chosen


def prompt_for(colour: str, shape: str) -> str:
    """The benchmark's prompt for ``colour`` and ``shape``: ``"an orange circle"``."""
    from ..models.shapes import article

    return f"{article(colour)} {colour} {shape}"


async def _render_all(
    engine: AsyncEngine,
    jobs: list[tuple[str, str, int]],
    params: SamplingParams,
    bar: Progress,
) -> list[Any]:
    """Render every ``(colour, shape, seed)`` job; returns the images (HWC arrays) in order.

    All requests are admitted at once, so the engine fuses them into batches."""
    import trio

    images: list[Any] = [None] * len(jobs)

    async def one(index: int, colour: str, shape: str, seed: int) -> None:
        output = await engine.generate(
            prompt_for(colour, shape),
            params.replace(seed=seed),
            request_id=f"quality-{colour}-{shape}-{seed}",
        )
        images[index] = output.images[0]
        bar.advance()

    async with trio.open_nursery() as nursery:
        for index, (colour, shape, seed) in enumerate(jobs):
            nursery.start_soon(one, index, colour, shape, seed)
    return images


async def _main(args: argparse.Namespace, report: Report) -> None:
    from ..models.shapes import COLOURS, SHAPES, judge

    samples = args.samples or (1 if args.quick else 10)
    steps = args.steps or (4 if args.quick else 20)
    if samples < 1 or steps < 1 or args.max_num_seqs < 1:
        raise ValueError("--samples, --steps and --max-num-seqs must be >= 1")
    report.params.update(
        {
            "model": args.model,
            "backend": args.backend,
            "samples_per_prompt": samples,
            "steps": steps,
            "guidance": args.guidance,
            "first_seed": args.seed,
            "colours": list(args.colours or COLOURS),
            "shapes": list(args.shapes or SHAPES),
            "max_num_seqs": args.max_num_seqs,
            "torch_threads": args.torch_threads,
            "quick": args.quick,
        }
    )
    config = EngineConfig(
        model=args.model,
        backend=args.backend,
        max_num_seqs=args.max_num_seqs,
        torch_threads=args.torch_threads,
        cache_dir=args.cache_dir,
        warmup=False,
    )
    params = SamplingParams(
        num_inference_steps=steps, guidance_scale=args.guidance, output_type="np"
    )
    colours = _subset(args.colours, tuple(COLOURS), "colour")
    shapes = _subset(args.shapes, tuple(SHAPES), "shape")
    cells = [(colour, shape) for colour in colours for shape in shapes]
    jobs = [(c, s, args.seed + i) for c, s in cells for i in range(samples)]
    async with open_engine(config) as engine:
        with Progress(len(jobs), "quality", enabled=not args.no_progress) as bar:
            images = await _render_all(engine, jobs, params, bar)
    verdicts = [judge(image) for image in images]
    per_cell: dict[tuple[str, str], list[Any]] = {cell: [] for cell in cells}
    for (colour, shape, _), verdict in zip(jobs, verdicts, strict=True):
        per_cell[(colour, shape)].append(verdict)
    colour_ok = shape_ok = both_ok = 0
    for (colour, shape), cell_verdicts in per_cell.items():
        c = sum(v.colour == colour for v in cell_verdicts)
        s = sum(v.shape == shape for v in cell_verdicts)
        b = sum(v.colour == colour and v.shape == shape for v in cell_verdicts)
        colour_ok, shape_ok, both_ok = colour_ok + c, shape_ok + s, both_ok + b
        seen = Counter(f"{v.colour or '-'} {v.shape or '-'}" for v in cell_verdicts)
        report.rows.append(
            {
                "prompt": prompt_for(colour, shape),
                "n": len(cell_verdicts),
                "colour %": f"{100.0 * c / len(cell_verdicts):.0f}",
                "shape %": f"{100.0 * s / len(cell_verdicts):.0f}",
                "both %": f"{100.0 * b / len(cell_verdicts):.0f}",
                "most often seen": ", ".join(f"{k} x{n}" for k, n in seen.most_common(2)),
            }
        )
    total = len(jobs)
    colour_rate, shape_rate, both_rate = colour_ok / total, shape_ok / total, both_ok / total
    report.rows.append(
        {
            "prompt": "total",
            "n": total,
            "colour %": f"{100.0 * colour_rate:.1f}",
            "shape %": f"{100.0 * shape_rate:.1f}",
            "both %": f"{100.0 * both_rate:.1f}",
            "most often seen": "",
        }
    )
    report.results = {
        "images": total,
        "colour_adherence": colour_rate,
        "shape_adherence": shape_rate,
        "both_adherence": both_rate,
        "colour_target": COLOUR_TARGET,
        "shape_target": SHAPE_TARGET,
        "colour_target_met": colour_rate >= COLOUR_TARGET,
        "shape_target_met": shape_rate >= SHAPE_TARGET,
        "per_prompt": {
            prompt_for(c, s): {
                "colour": sum(v.colour == c for v in vs) / len(vs),
                "shape": sum(v.shape == s for v in vs) / len(vs),
            }
            for (c, s), vs in per_cell.items()
        },
    }
    report.notes.append(
        f"colour adherence {100.0 * colour_rate:.1f} % (target >= {100 * COLOUR_TARGET:.0f} %), "
        f"shape adherence {100.0 * shape_rate:.1f} % (target >= {100 * SHAPE_TARGET:.0f} %)"
    )
    if colour_rate < COLOUR_TARGET:
        report.notes.append("colour adherence is below its target")
    if shape_rate < SHAPE_TARGET:
        report.notes.append("shape adherence is below its target")


def run(args: argparse.Namespace, command: str) -> Report:
    report = Report(experiment="quality", command=command)
    return run_in_trio(report, _main, args, torch_threads=args.torch_threads)
