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

``--img2img`` measures image-to-image and inpainting instead, through the same engine and
options.  Each of those renders is a *source* (rendered first, all at once); from each source,
with seed ``+ 1000`` and another colour ``c2`` and shape ``s2`` of the whole palette (rotated
by cell and sample, so every pair occurs):

- *recolour*: ``"a <c2> <shape>"`` from the source (``--strength``, 0.6), judged for colour
  ``c2`` (*colour adherence*, target >= 90 %) and the source's shape (*shape kept*, no target);
- *inpaint*: ``"a <c2> <s2>"`` with the mask of the source's foreground bounding box dilated
  by :data:`INPAINT_DILATION_PX` (clipped to the picture; ``--inpaint-strength``, 1.0), judged
  for ``c2`` (same colour target) and ``s2`` (reported), and for the region outside the mask:
  its largest absolute deviation from the source as sent (uint8 / 255, over every image;
  target <= 2/255).  A source without a foreground has no mask: it is skipped and counted.

``--lora`` measures a LoRA adapter's style instead: the engine registers ``--lora-path``
(default ``builtin:shapes-outline``, the shipped ``outline`` adapter) as ``outline``, and the
same prompt/seed grid is rendered twice through it, with ``lora=("outline", --lora-scale)``
and without, all requests at once.  Each image is judged for its style too (the judge's
``style``: ``"outline"`` when a share of the shape has no ink inside its border).  Reported
per prompt and in total: the *style rate* with the adapter (target >= 90 %) and without it
(target <= 5 %: the base model does not draw the style by itself), and colour and shape
adherence with the adapter (targets >= 90 % each: the style must not cost the content).
``--grid PNG`` also writes the first seed's pictures of every prompt, without and with the
adapter, as one picture (docs/images/shapes-outline-grid.png is one).
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence
from typing import Any

from .._core.request import SamplingParams
from ..config import EngineConfig
from ..runtime.engine import AsyncEngine, open_engine
from .harness import Progress, Report, run_in_trio

__all__ = [
    "COLOUR_TARGET",
    "IMAGE_SEED_OFFSET",
    "INPAINT_DILATION_PX",
    "INPAINT_STRENGTH",
    "LORA_ADHERENCE_TARGET",
    "LORA_NAME",
    "LORA_PATH",
    "SHAPE_TARGET",
    "STRENGTH",
    "STYLE_WITHOUT_TARGET",
    "STYLE_WITH_TARGET",
    "UNMASKED_TARGET",
    "add_arguments",
    "inpaint_mask",
    "other",
    "prompt_for",
    "run",
    "write_grid",
]

COLOUR_TARGET = 0.90
SHAPE_TARGET = 0.70
SEED = 0
# --img2img: the default strengths, the seed offset of the edits, the mask's margin, and the
# largest deviation outside the mask that still counts as "unchanged" (2 uint8 levels).
STRENGTH = 0.6
INPAINT_STRENGTH = 1.0
IMAGE_SEED_OFFSET = 1000
INPAINT_DILATION_PX = 3
UNMASKED_TARGET = 2 / 255
# --lora: the adapter (registered under LORA_NAME), the style it draws, and its targets: the
# style in >= 90 % of pictures with it and <= 5 % without, colour and shape >= 90 % with it.
LORA_NAME = "outline"
LORA_PATH = "builtin:shapes-outline"
LORA_STYLE = "outline"
STYLE_WITH_TARGET = 0.90
STYLE_WITHOUT_TARGET = 0.05
LORA_ADHERENCE_TARGET = 0.90


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
    parser.add_argument(
        "--img2img",
        action="store_true",
        help="measure recolouring (image-to-image) and inpainting of the renders instead",
    )
    parser.add_argument(
        "--strength",
        type=float,
        default=None,
        help=f"--img2img: recolouring strength in (0, 1] (default {STRENGTH})",
    )
    parser.add_argument(
        "--inpaint-strength",
        type=float,
        default=None,
        help=f"--img2img: inpainting strength in (0, 1] (default {INPAINT_STRENGTH})",
    )
    parser.add_argument(
        "--lora",
        action="store_true",
        help="measure the outline LoRA adapter: style with and without it, adherence with it",
    )
    parser.add_argument(
        "--lora-path",
        default=None,
        help=f"--lora: the adapter to measure (default {LORA_PATH}, the shipped one)",
    )
    parser.add_argument(
        "--lora-scale", type=float, default=None, help="--lora: the adapter's scale (default 1)"
    )
    parser.add_argument(
        "--grid",
        default=None,
        metavar="PNG",
        help="--lora: write the first seed's pictures, without and with the adapter, here",
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


def other(name: str, names: Sequence[str], turn: int) -> str:
    """The ``turn``-th (cyclically) of ``names`` other than ``name``: a deterministic "some
    other colour/shape" that visits every other one as ``turn`` counts up."""
    others = [n for n in names if n != name]
    if not others:
        raise ValueError(f"no other name than {name!r} in {list(names)}")
    return others[turn % len(others)]


def inpaint_mask(image: Any, dilation: int = INPAINT_DILATION_PX) -> Any:
    """The repaint mask of ``image`` (``(H, W, 3)`` floats in [0, 1]): its foreground's
    bounding box grown by ``dilation`` pixels on every side, clipped to the picture, as a
    boolean ``(H, W)`` array; None where the picture has no foreground."""
    import numpy as np

    from ..models.shapes import foreground_mask

    fg = foreground_mask(image)
    rows = np.nonzero(fg.any(axis=1))[0]
    cols = np.nonzero(fg.any(axis=0))[0]
    if rows.size == 0:
        return None
    h, w = fg.shape
    mask = np.zeros((h, w), dtype=bool)
    y0, y1 = max(0, int(rows[0]) - dilation), min(h, int(rows[-1]) + dilation + 1)
    x0, x1 = max(0, int(cols[0]) - dilation), min(w, int(cols[-1]) + dilation + 1)
    mask[y0:y1, x0:x1] = True
    return mask


async def _generate_all(
    engine: AsyncEngine, requests: list[tuple[str, SamplingParams, str]], bar: Progress
) -> list[Any]:
    """Run every ``(prompt, params, request_id)``; returns the first image of each, in order.

    All requests are admitted at once, so the engine fuses them into batches."""
    import trio

    images: list[Any] = [None] * len(requests)

    async def one(index: int, prompt: str, params: SamplingParams, request_id: str) -> None:
        output = await engine.generate(prompt, params, request_id=request_id)
        images[index] = output.images[0]
        bar.advance()

    async with trio.open_nursery() as nursery:
        for index, (prompt, params, request_id) in enumerate(requests):
            nursery.start_soon(one, index, prompt, params, request_id)
    return images


async def _render_all(
    engine: AsyncEngine,
    jobs: list[tuple[str, str, int]],
    params: SamplingParams,
    bar: Progress,
    tag: str = "",
) -> list[Any]:
    """Render every ``(colour, shape, seed)`` job; returns the images (HWC arrays) in order.
    ``tag`` goes into the request ids (two renders of the same grid in one engine)."""
    requests = [
        (prompt_for(c, s), params.replace(seed=seed), f"quality{tag}-{c}-{s}-{seed}")
        for c, s, seed in jobs
    ]
    return await _generate_all(engine, requests, bar)


def _strength(value: float | None, default: float, option: str, steps: int) -> float:
    strength = default if value is None else value
    if not 0.0 < strength <= 1.0:
        raise ValueError(f"{option} must be in (0, 1], got {strength}")
    if int(steps * strength) < 1:
        raise ValueError(f"{option} {strength} of {steps} steps runs no step: raise either")
    return strength


async def _main(args: argparse.Namespace, report: Report) -> None:
    import trio

    from ..models.shapes import COLOURS, SHAPES

    samples = args.samples or (1 if args.quick else 10)
    steps = args.steps or (4 if args.quick else 20)
    if samples < 1 or steps < 1 or args.max_num_seqs < 1:
        raise ValueError("--samples, --steps and --max-num-seqs must be >= 1")
    if not args.img2img and (args.strength is not None or args.inpaint_strength is not None):
        raise ValueError("--strength and --inpaint-strength need --img2img")
    if not args.lora and (
        args.lora_path is not None or args.lora_scale is not None or args.grid is not None
    ):
        raise ValueError("--lora-path, --lora-scale and --grid need --lora")
    if args.lora and args.img2img:
        raise ValueError("--lora and --img2img measure different things: choose one")
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
    lora_path = args.lora_path or LORA_PATH
    lora_scale = 1.0 if args.lora_scale is None else args.lora_scale
    config = EngineConfig(
        model=args.model,
        backend=args.backend,
        max_num_seqs=args.max_num_seqs,
        torch_threads=args.torch_threads,
        cache_dir=args.cache_dir,
        warmup=False,
        loras={LORA_NAME: lora_path} if args.lora else {},
    )
    params = SamplingParams(
        num_inference_steps=steps, guidance_scale=args.guidance, output_type="np"
    )
    colours = _subset(args.colours, tuple(COLOURS), "colour")
    shapes = _subset(args.shapes, tuple(SHAPES), "shape")
    cells = [(colour, shape) for colour in colours for shape in shapes]
    jobs = [(c, s, args.seed + i) for c, s in cells for i in range(samples)]
    if args.img2img:
        strength = _strength(args.strength, STRENGTH, "--strength", steps)
        inpaint_strength = _strength(
            args.inpaint_strength, INPAINT_STRENGTH, "--inpaint-strength", steps
        )
        report.params.update(
            {
                "img2img": True,
                "strength": strength,
                "inpaint_strength": inpaint_strength,
                "inpaint_dilation_px": INPAINT_DILATION_PX,
                "image_seed_offset": IMAGE_SEED_OFFSET,
            }
        )
        async with open_engine(config) as engine:
            await _measure_img2img(
                engine, jobs, samples, params, strength, inpaint_strength, args, report
            )
        return
    if args.lora:
        report.params.update({"lora": True, "lora_path": lora_path, "lora_scale": lora_scale})
        adapted = params.replace(lora=((LORA_NAME, lora_scale),))
        async with open_engine(config) as engine:
            with Progress(2 * len(jobs), "quality", enabled=not args.no_progress) as bar:
                async with trio.open_nursery() as nursery:
                    # Both grids at once: the engine batches each (the adapter is part of
                    # the compatibility key, so the two never share a forward).
                    rendered: dict[str, list[Any]] = {}

                    async def grid(key: str, grid_params: SamplingParams) -> None:
                        rendered[key] = await _render_all(
                            engine, jobs, grid_params, bar, tag=f"-{key}"
                        )

                    nursery.start_soon(grid, "lora", adapted)
                    nursery.start_soon(grid, "base", params)
        _report_lora(cells, jobs, rendered["lora"], rendered["base"], report)
        if args.grid is not None:
            write_grid(args.grid, jobs, rendered["base"], rendered["lora"])
            report.notes.append(f"grid (first seed of each prompt, without / with) -> {args.grid}")
        return
    async with open_engine(config) as engine:
        with Progress(len(jobs), "quality", enabled=not args.no_progress) as bar:
            images = await _render_all(engine, jobs, params, bar)
    _report_text2image(cells, jobs, images, report)


def _report_text2image(
    cells: list[tuple[str, str]],
    jobs: list[tuple[str, str, int]],
    images: list[Any],
    report: Report,
) -> None:
    from ..models.shapes import judge

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


def write_grid(
    path: str, jobs: list[tuple[str, str, int]], without: list[Any], with_lora: list[Any]
) -> None:
    """Write the first seed's picture of each prompt as a PNG: per shape a row without the
    adapter and one with it, a column per colour, each picture scaled 4x (nearest)."""
    import numpy as np
    from PIL import Image, ImageDraw

    first: dict[tuple[str, str], tuple[Any, Any]] = {}
    for (colour, shape, _), plain, adapted in zip(jobs, without, with_lora, strict=True):
        first.setdefault((colour, shape), (plain, adapted))
    colours = list(dict.fromkeys(c for c, _ in first))
    shapes = list(dict.fromkeys(s for _, s in first))
    scale, gap, label_w = 4, 4, 70
    side = scale * max(np.asarray(p).shape[0] for p, _ in first.values())
    width = label_w + len(colours) * (side + gap)
    height = 2 * len(shapes) * (side + gap) + gap
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    for row, (shape, adapted) in enumerate((s, a) for s in shapes for a in (False, True)):
        top = gap + row * (side + gap)
        label = f"{shape}\n{'outline' if adapted else 'base'}"
        draw.multiline_text((4, top + side // 2 - 12), label, fill=(0, 0, 0))
        for column, colour in enumerate(colours):
            picture = first.get((colour, shape))
            if picture is None:
                continue
            pixels = np.clip(np.rint(np.asarray(picture[adapted]) * 255.0), 0, 255)
            tile = Image.fromarray(pixels.astype(np.uint8)).resize(
                (side, side), Image.Resampling.NEAREST
            )
            canvas.paste(tile, (label_w + column * (side + gap), top))
    canvas.save(path)


def _report_lora(
    cells: list[tuple[str, str]],
    jobs: list[tuple[str, str, int]],
    with_lora: list[Any],
    without: list[Any],
    report: Report,
) -> None:
    """``--lora``: the style rate with and without the adapter and adherence with it."""
    from ..models.shapes import judge

    adapted = [judge(image) for image in with_lora]
    plain = [judge(image) for image in without]
    per_cell: dict[tuple[str, str], list[tuple[Any, Any]]] = {cell: [] for cell in cells}
    for (colour, shape, _), a, p in zip(jobs, adapted, plain, strict=True):
        per_cell[(colour, shape)].append((a, p))

    def rates(pairs: list[tuple[Any, Any]], colour: str, shape: str) -> dict[str, float]:
        n = len(pairs)
        return {
            "style_with": sum(a.style == LORA_STYLE for a, _ in pairs) / n,
            "style_without": sum(p.style == LORA_STYLE for _, p in pairs) / n,
            "colour_with": sum(a.colour == colour for a, _ in pairs) / n,
            "shape_with": sum(a.shape == shape for a, _ in pairs) / n,
            "colour_without": sum(p.colour == colour for _, p in pairs) / n,
            "shape_without": sum(p.shape == shape for _, p in pairs) / n,
        }

    def row(prompt: str, n: int, r: dict[str, float], digits: int, seen: str) -> dict[str, Any]:
        def pct(key: str) -> str:
            return f"{100.0 * r[key]:.{digits}f}"

        return {
            "prompt": prompt,
            "n": n,
            "style % with": pct("style_with"),
            "style % without": pct("style_without"),
            "colour % with": pct("colour_with"),
            "shape % with": pct("shape_with"),
            "most often seen with": seen,
        }

    per_prompt: dict[str, dict[str, float]] = {}
    for (colour, shape), pairs in per_cell.items():
        r = rates(pairs, colour, shape)
        per_prompt[prompt_for(colour, shape)] = r
        counts = Counter(f"{a.colour or '-'} {a.shape or '-'} {a.style or '-'}" for a, _ in pairs)
        seen = ", ".join(f"{k} x{n}" for k, n in counts.most_common(2))
        report.rows.append(row(prompt_for(colour, shape), len(pairs), r, 0, seen))
    total = len(jobs)
    totals = {
        key: sum(per_prompt[prompt_for(c, s)][key] * len(per_cell[(c, s)]) for c, s in cells)
        / total
        for key in next(iter(per_prompt.values()))
    }
    report.rows.append(row("total", total, totals, 1, ""))
    met = {
        "style_with_target_met": totals["style_with"] >= STYLE_WITH_TARGET,
        "style_without_target_met": totals["style_without"] <= STYLE_WITHOUT_TARGET,
        "colour_target_met": totals["colour_with"] >= LORA_ADHERENCE_TARGET,
        "shape_target_met": totals["shape_with"] >= LORA_ADHERENCE_TARGET,
    }
    report.results = {
        "images": 2 * total,
        "style": LORA_STYLE,
        "style_rate_with_lora": totals["style_with"],
        "style_rate_without_lora": totals["style_without"],
        "colour_adherence_with_lora": totals["colour_with"],
        "shape_adherence_with_lora": totals["shape_with"],
        "colour_adherence_without_lora": totals["colour_without"],
        "shape_adherence_without_lora": totals["shape_without"],
        "style_with_target": STYLE_WITH_TARGET,
        "style_without_target": STYLE_WITHOUT_TARGET,
        "adherence_target": LORA_ADHERENCE_TARGET,
        **met,
        "per_prompt": per_prompt,
    }

    def pct(rate: float) -> str:
        return f"{100.0 * rate:.1f} %"

    def verdict(ok: bool) -> str:
        return "met" if ok else "missed"

    report.notes.append(
        f"{LORA_STYLE} style with the adapter {pct(totals['style_with'])} "
        f"(target >= {100 * STYLE_WITH_TARGET:.0f} %): {verdict(met['style_with_target_met'])}; "
        f"without it {pct(totals['style_without'])} "
        f"(target <= {100 * STYLE_WITHOUT_TARGET:.0f} %): "
        f"{verdict(met['style_without_target_met'])}"
    )
    target = f"target >= {100 * LORA_ADHERENCE_TARGET:.0f} %"
    report.notes.append(
        f"with the adapter: colour adherence {pct(totals['colour_with'])} ({target}): "
        f"{verdict(met['colour_target_met'])}; shape adherence {pct(totals['shape_with'])} "
        f"({target}): {verdict(met['shape_target_met'])}"
    )
    report.notes.append(
        f"without it: colour {pct(totals['colour_without'])}, shape {pct(totals['shape_without'])}"
    )


async def _measure_img2img(
    engine: AsyncEngine,
    jobs: list[tuple[str, str, int]],
    samples: int,
    params: SamplingParams,
    strength: float,
    inpaint_strength: float,
    args: argparse.Namespace,
    report: Report,
) -> None:
    """``--img2img``: the sources, then every recolouring and inpainting of them at once."""
    import numpy as np
    from PIL import Image

    from ..models.shapes import COLOURS, SHAPES, judge

    with Progress(len(jobs), "sources", enabled=not args.no_progress) as bar:
        sources = await _render_all(engine, jobs, params, bar)
    recolours: list[tuple[str, str]] = []  # (asked colour, kept shape) per recolour request
    inpaints: list[tuple[str, str, Any, Any]] = []  # (colour, shape, source/255, mask)
    requests: list[tuple[str, SamplingParams, str]] = []
    kinds: list[bool] = []  # per request: inpainting (else recolouring)
    skipped = 0
    for index, ((colour, shape, seed), source) in enumerate(zip(jobs, sources, strict=True)):
        turn = index // samples + index % samples  # cell index + sample
        c2, s2 = other(colour, tuple(COLOURS), turn), other(shape, tuple(SHAPES), turn)
        picture = np.clip(np.rint(np.asarray(source) * 255.0), 0, 255).astype(np.uint8)
        edit = params.replace(seed=seed + IMAGE_SEED_OFFSET, image=picture)
        tag = f"{colour}-{shape}-{seed}"
        requests.append(
            (prompt_for(c2, shape), edit.replace(strength=strength), f"quality-recolour-{tag}")
        )
        recolours.append((c2, shape))
        kinds.append(False)
        mask = inpaint_mask(source)
        if mask is None:
            skipped += 1
            continue
        mask_image = Image.fromarray(np.where(mask, 255, 0).astype(np.uint8))  # mode "L"
        requests.append(
            (
                prompt_for(c2, s2),
                edit.replace(mask_image=mask_image, strength=inpaint_strength),
                f"quality-inpaint-{tag}",
            )
        )
        inpaints.append((c2, s2, picture.astype(np.float64) / 255.0, mask))
        kinds.append(True)
    with Progress(len(requests), "img2img", enabled=not args.no_progress) as bar:
        outputs = await _generate_all(engine, requests, bar)
    recolour_out = [out for out, inpaint in zip(outputs, kinds, strict=True) if not inpaint]
    inpaint_out = [out for out, inpaint in zip(outputs, kinds, strict=True) if inpaint]

    def seen(verdicts: list[Any]) -> str:
        counts = Counter(f"{v.colour or '-'} {v.shape or '-'}" for v in verdicts)
        return ", ".join(f"{k} x{n}" for k, n in counts.most_common(2))

    rv = [judge(image) for image in recolour_out]
    r_colour = sum(v.colour == c for v, (c, _) in zip(rv, recolours, strict=True))
    # Which recolourings missed, as "source colour -> asked: seen colour".
    recolour_misses = Counter(
        f"{source} -> {c}: {v.colour or '-'}"
        for v, (c, _), (source, _, _) in zip(rv, recolours, jobs, strict=True)
        if v.colour != c
    )
    r_shape = sum(v.shape == s for v, (_, s) in zip(rv, recolours, strict=True))
    iv = [judge(image) for image in inpaint_out]
    i_colour = sum(v.colour == c for v, (c, _, _, _) in zip(iv, inpaints, strict=True))
    i_shape = sum(v.shape == s for v, (_, s, _, _) in zip(iv, inpaints, strict=True))
    deviations = [
        float(np.abs(np.asarray(out, dtype=np.float64) - picture)[~mask].max(initial=0.0))
        for out, (_, _, picture, mask) in zip(inpaint_out, inpaints, strict=True)
    ]
    n_r, n_i = len(rv), len(iv)
    r_colour_rate, r_shape_rate = r_colour / n_r, r_shape / n_r
    i_colour_rate = i_colour / n_i if n_i else None
    i_shape_rate = i_shape / n_i if n_i else None
    max_dev = max(deviations) if deviations else None

    def pct(rate: float | None) -> str:
        return "-" if rate is None else f"{100.0 * rate:.1f}"

    report.rows.extend(
        [
            {
                "mode": f"recolour (strength {strength:g})",
                "n": n_r,
                "colour %": pct(r_colour_rate),
                "shape %": f"{pct(r_shape_rate)} (kept)",
                "unmasked max dev": "-",
                "skipped": 0,
                "most often seen": seen(rv),
            },
            {
                "mode": f"inpaint (strength {inpaint_strength:g})",
                "n": n_i,
                "colour %": pct(i_colour_rate),
                "shape %": f"{pct(i_shape_rate)} (new)",
                "unmasked max dev": "-" if max_dev is None else f"{max_dev * 255:.2f}/255",
                "skipped": skipped,
                "most often seen": seen(iv),
            },
            {
                "mode": "total",
                "n": n_r + n_i,
                "colour %": pct((r_colour + i_colour) / (n_r + n_i)),
                "shape %": pct((r_shape + i_shape) / (n_r + n_i)),
                "unmasked max dev": "",
                "skipped": skipped,
                "most often seen": "",
            },
        ]
    )
    recolour_met = r_colour_rate >= COLOUR_TARGET
    inpaint_met = i_colour_rate is not None and i_colour_rate >= COLOUR_TARGET
    unmasked_met = max_dev is not None and max_dev <= UNMASKED_TARGET
    report.results = {
        "images": n_r + n_i,
        "sources": len(sources),
        "inpaint_skipped": skipped,
        "recolour_colour_misses": dict(recolour_misses.most_common()),
        "strength": strength,
        "inpaint_strength": inpaint_strength,
        "recolour_colour_adherence": r_colour_rate,
        "recolour_shape_kept": r_shape_rate,
        "inpaint_colour_adherence": i_colour_rate,
        "inpaint_shape_adherence": i_shape_rate,
        "inpaint_unmasked_max_dev": max_dev,
        "colour_target": COLOUR_TARGET,
        "unmasked_target": UNMASKED_TARGET,
        "recolour_colour_target_met": recolour_met,
        "inpaint_colour_target_met": inpaint_met,
        "unmasked_target_met": unmasked_met,
    }
    target = f"target >= {100 * COLOUR_TARGET:.0f} %"
    report.notes.append(
        f"recolour colour adherence {pct(r_colour_rate)} % ({target}): "
        f"{'met' if recolour_met else 'missed'}; shape kept {pct(r_shape_rate)} %"
    )
    if recolour_misses:
        report.notes.append(
            "recolour misses (source -> asked: seen): "
            + ", ".join(f"{k} x{n}" for k, n in recolour_misses.most_common(6))
        )
    report.notes.append(
        f"inpaint colour adherence {pct(i_colour_rate)} % ({target}): "
        f"{'met' if inpaint_met else 'missed'}; shape adherence {pct(i_shape_rate)} %"
    )
    dev_text = "-" if max_dev is None else f"{max_dev * 255:.2f}/255"
    report.notes.append(
        f"inpaint unmasked max deviation {dev_text} (target <= 2/255): "
        f"{'met' if unmasked_met else 'missed'}"
    )
    if skipped:
        report.notes.append(f"{skipped} source(s) without a foreground were not inpainted")


def run(args: argparse.Namespace, command: str) -> Report:
    report = Report(experiment="quality", command=command)
    return run_in_trio(report, _main, args, torch_threads=args.torch_threads)
