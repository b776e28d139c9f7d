"""The ``omni-trio`` command line.

::

    omni-trio generate "a prompt" [--model M] [--steps N] [--seed S] [--size WxH] [-n K] [-o F]
    omni-trio demo [--model M] [--prompts N] [--steps N] [--out demo-grid.png] [--no-previews]
    omni-trio version
    omni-trio fuzz [--backend B] [--mode M] [--duration S] [--examples N] ... [--replay FILE]
    omni-trio serve --model M [--replicas K] [--host H] [--port P] [--config FILE] ...
    omni-trio bench ...        (registered when omni_trio.bench is installed)

Exit codes: 0 success, 1 the run failed (a request failed or was aborted, the engine died,
an output could not be written), 2 bad input (:class:`InvalidRequestError`,
:class:`InvalidConfigError`, a bad flag), 130 interrupted.  Expected failures print one line
``omni-trio: error: ...`` on stderr, never a traceback; a traceback means a bug.

Each subcommand registers ``handler(args) -> int`` with ``set_defaults``; :func:`main`
dispatches to it.  A plug-in subcommand (``bench``) may use ``func`` instead.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from ._cli_args import finite_float, nonneg_int, positive_int, size_arg
from ._cli_exit import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    CliError,
    run_command,
    walk_exceptions,
    warn,
)
from ._cli_render import (
    RequestView,
    build_grid,
    format_ms,
    format_statistics,
    format_table,
    output_paths,
    progress_line,
    redraw_block,
    status_label,
    truncate,
)

if TYPE_CHECKING:
    from ._core.messages import DiffusionOutput
    from ._core.request import SamplingParams
    from .config import EngineConfig
    from .runtime.engine import AsyncEngine, EngineStatistics
    from .runtime.request_stream import RequestStream

__all__ = ["DEMO_PROMPTS", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "main"]

log = logging.getLogger("omni_trio.cli")

DEFAULT_MODEL = "builtin:tiny-sd"
# The demo's model draws what its prompts ask for (trained here; see omni_trio.models.shapes).
DEMO_MODEL = "builtin:shapes"
POLL_INTERVAL_S = 0.1
PLAIN_INTERVAL_S = 2.0

DEMO_PROMPTS = (
    "a red circle",
    "a small blue square",
    "a large green triangle",
    "an orange square on a white background",
    "a purple circle",
    "a yellow triangle",
    "a red square",
    "a large blue circle",
)
DEMO_PREVIEW_FRAMES = 8  # previews in the strip (at most; the final image is added)
DEMO_BASE_SEED = 1234


# -- argument parsing ------------------------------------------------------------------------


def _add_engine_options(
    parser: argparse.ArgumentParser,
    *,
    max_num_seqs_default: int,
    model_default: str = DEFAULT_MODEL,
) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=model_default,
        help="built-in model name (builtin:tiny-sd, builtin:tiny-ddim, builtin:shapes, "
        f"builtin:echo) or a local diffusers directory (default: {model_default})",
    )
    group.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=None,
        help=f"requests fused into one forward (default: {max_num_seqs_default})",
    )
    group.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="torch threads of the worker (default: cores / workers)",
    )
    group.add_argument(
        "--cache-dir",
        default=None,
        help="where built-in models are created (default: $OMNI_TRIO_CACHE or ~/.cache/omni_trio)",
    )
    group.add_argument("--device", default=None, help="torch device (default: cuda if present)")


def build_parser() -> argparse.ArgumentParser:
    """The full parser, with the optional ``bench`` subcommand when it is installed."""
    from . import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Serve diffusers pipelines as a tree of supervised trio actors.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (-v info, -vv debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    gen = sub.add_parser(
        "generate",
        help="render one prompt to PNG with a live progress bar",
        description="Render one prompt and write the image(s) as PNG.",
    )
    gen.add_argument("prompt", help="the text prompt")
    gen.add_argument("--steps", type=positive_int, default=20, help="denoising steps (20)")
    gen.add_argument(
        "--seed", type=nonneg_int, default=None, help="random seed (default: random, printed)"
    )
    gen.add_argument("--guidance", type=finite_float, default=7.5, help="guidance scale (7.5)")
    gen.add_argument("--negative-prompt", default=None, help="what the image should not show")
    gen.add_argument(
        "--size",
        type=size_arg,
        default=None,
        metavar="WxH",
        help="output size, multiples of 8 (default: the model's size)",
    )
    gen.add_argument(
        "-n", "--num-outputs", type=positive_int, default=1, help="images for the prompt (1)"
    )
    gen.add_argument(
        "-o",
        "--out",
        default="out.png",
        help="output file (default out.png); several images go to out-0.png, out-1.png, ...",
    )
    gen.add_argument(
        "--warmup",
        action="store_true",
        help="run the engine's warmup request first (off for one-shot generation)",
    )
    gen.add_argument(
        "--no-progress", action="store_true", help="do not draw the progress bar on stderr"
    )
    _add_engine_options(gen, max_num_seqs_default=1)
    gen.set_defaults(handler=cmd_generate)

    demo = sub.add_parser(
        "demo",
        help="render a handful of prompts concurrently and write a captioned grid",
        description="Start an engine, submit several prompts at once (fixed seeds), show "
        "live per-request progress, write a captioned PNG grid and print a per-request table "
        "and the engine statistics; then stream the first prompt once more in step mode and "
        "write a strip of its previews forming (OUT with -previews before the suffix).",
    )
    demo.add_argument("--out", default="demo-grid.png", help="grid image to write (demo-grid.png)")
    demo.add_argument(
        "--prompts",
        type=positive_int,
        default=8,
        help=f"how many prompts to submit (default 8; the {len(DEMO_PROMPTS)} built-in "
        "prompts repeat past that)",
    )
    demo.add_argument("--steps", type=positive_int, default=20, help="denoising steps (20)")
    demo.add_argument(
        "--seed",
        type=nonneg_int,
        default=DEMO_BASE_SEED,
        help=f"seed of the first prompt; prompt i uses seed+i (default {DEMO_BASE_SEED})",
    )
    demo.add_argument("--guidance", type=finite_float, default=7.5, help="guidance scale (7.5)")
    demo.add_argument(
        "--size", type=size_arg, default=None, metavar="WxH", help="output size (model default)"
    )
    demo.add_argument(
        "--cell", type=positive_int, default=160, help="grid tile size in pixels (160)"
    )
    demo.add_argument("--no-warmup", action="store_true", help="skip the engine warmup")
    demo.add_argument(
        "--no-previews", action="store_true", help="do not write the streaming-previews strip"
    )
    demo.add_argument(
        "--progress",
        choices=("auto", "live", "plain", "none"),
        default="auto",
        help="progress display: live (redrawn, needs a terminal), plain (periodic lines), "
        "none; auto picks live on a terminal (default)",
    )
    _add_engine_options(demo, max_num_seqs_default=4, model_default=DEMO_MODEL)
    demo.set_defaults(handler=cmd_demo)

    version = sub.add_parser("version", help="print the version and the key dependencies")
    version.set_defaults(handler=cmd_version)

    from .fuzz import add_fuzz_parser  # imports Hypothesis only when it runs

    add_fuzz_parser(sub)
    from .serve.daemon import add_serve_parser  # hypercorn is imported only when it runs

    add_serve_parser(sub)
    _add_plugin_commands(sub)
    return parser


def _add_plugin_commands(subparsers: Any) -> None:
    """Register ``bench`` if ``omni_trio.bench`` provides ``add_bench_parser(subparsers)``.

    Imported here, not at module top, so the CLI works without it.  A broken bench module
    is reported as a one-line warning and every other command keeps working.
    """
    try:
        from .bench import add_bench_parser
    except ModuleNotFoundError as exc:
        if exc.name == "omni_trio.bench":
            return
        warn(f"bench command unavailable: {exc}")
        return
    except ImportError as exc:
        warn(f"bench command unavailable: {exc}")
        return
    try:
        add_bench_parser(subparsers)
    except Exception as exc:
        warn(f"bench command unavailable: {type(exc).__name__}: {exc}")


# -- progress display ------------------------------------------------------------------------


@dataclass(eq=False)
class _Tracked:
    """The CLI's view of one submitted request (written by its consumer and the poller)."""

    request_id: str
    label: str
    total: int
    submitted_at: float
    state: str = "queued"
    done: int = 0
    finished_at: float | None = None
    output: DiffusionOutput | None = None

    def view(self, now: float) -> RequestView:
        end = self.finished_at if self.finished_at is not None else now
        return RequestView(self.label, self.state, self.done, self.total, end - self.submitted_at)


def _refresh(engine: AsyncEngine, tracked: Sequence[_Tracked]) -> None:
    """Pull step progress from the engine for every live request (no checkpoint)."""
    for item in tracked:
        if item.finished_at is not None:
            continue
        progress = engine.progress(item.request_id)
        if progress is not None:
            item.state = "running"
            item.done, item.total = progress


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


class _Display:
    """Draws the progress of a set of requests on ``out``.

    ``live``: one line redrawn with ``\\r`` for a single request, a block redrawn in place
    (ANSI cursor moves) for several.  ``plain``: a line for each request whose progress
    changed, at most every ``PLAIN_INTERVAL_S`` seconds and whenever one finishes, so logs
    stay readable.  ``none``: nothing.
    """

    def __init__(self, out: TextIO, mode: str, tracked: Sequence[_Tracked]) -> None:
        self.out = out
        self.mode = mode
        self.tracked = tracked
        self.label_width = max((len(t.label) for t in tracked), default=0)
        self._drawn = 0
        self._last_plain: dict[str, tuple[str, int]] = {}
        self._last_plain_at = -math.inf

    def _lines(self, now: float) -> list[str]:
        return [progress_line(t.view(now), label_width=self.label_width) for t in self.tracked]

    def render(self, now: float, *, final: bool = False) -> None:
        if self.mode == "live":
            lines = self._lines(now)
            if len(lines) == 1:
                self.out.write("\r" + lines[0] + "\x1b[K")
                self._drawn = 1
                if final:
                    self.out.write("\n")
            else:
                self.out.write(redraw_block(lines, self._drawn))
                self._drawn = len(lines)
            self.out.flush()
        elif self.mode == "plain":
            finished_now = any(
                t.finished_at is not None
                and self._last_plain.get(t.request_id, ("",))[0] != t.state
                for t in self.tracked
            )
            if not (final or finished_now or now - self._last_plain_at >= PLAIN_INTERVAL_S):
                return
            self._last_plain_at = now
            for t in self.tracked:
                key = (t.state, t.done)
                if self._last_plain.get(t.request_id) == key:
                    continue
                self._last_plain[t.request_id] = key
                print(progress_line(t.view(now), label_width=self.label_width), file=self.out)
            self.out.flush()


async def _poll_progress(engine: AsyncEngine, display: _Display) -> None:
    """Refresh and redraw every ``POLL_INTERVAL_S`` until cancelled."""
    import trio

    while True:
        _refresh(engine, display.tracked)
        display.render(trio.current_time())
        await trio.sleep(POLL_INTERVAL_S)


async def _collect(stream: RequestStream, item: _Tracked) -> None:
    """Read ``stream`` to its terminal output and record it on ``item``.  If cancelled, the
    request is aborted (leaving the stream aborts it)."""
    import trio

    async with stream:
        async for output in stream:
            if output.finished:
                item.output = output
                item.state = status_label(output.status)
                item.finished_at = trio.current_time()
                if output.ok:
                    item.done = item.total


async def _run_with_progress(
    engine: AsyncEngine,
    streams: Sequence[RequestStream],
    tracked: Sequence[_Tracked],
    display: _Display,
) -> None:
    """Consume every stream concurrently while a poller draws their progress."""
    import trio

    async with trio.open_nursery() as outer:
        if display.mode != "none":
            outer.start_soon(_poll_progress, engine, display)
        async with trio.open_nursery() as inner:
            for stream, item in zip(streams, tracked, strict=True):
                inner.start_soon(_collect, stream, item)
        outer.cancel_scope.cancel()
    display.render(trio.current_time(), final=True)


# -- shared engine helpers ---------------------------------------------------------------------


def _engine_config(args: argparse.Namespace, *, max_num_seqs: int, warmup: bool) -> EngineConfig:
    from .config import EngineConfig

    fields: dict[str, Any] = {
        "model": args.model,
        "max_num_seqs": max_num_seqs,
        "warmup": warmup,
    }
    if args.threads is not None:
        fields["torch_threads"] = args.threads
    if args.cache_dir is not None:
        fields["cache_dir"] = args.cache_dir
    if args.device is not None:
        fields["device"] = args.device
    return EngineConfig(**fields)


def _check_output_dir(path: Path) -> None:
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise CliError(f"output directory {str(parent)!r} does not exist", EXIT_USAGE)


def _save_png(image: Any, path: Path) -> None:
    image.save(path, format=None if path.suffix else "PNG")


# -- generate ----------------------------------------------------------------------------------


def _generate_params(args: argparse.Namespace) -> SamplingParams:
    from ._core.request import SamplingParams

    width, height = args.size if args.size is not None else (None, None)
    return SamplingParams(
        height=height,
        width=width,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        negative_prompt=args.negative_prompt,
        seed=args.seed,
        num_outputs_per_prompt=args.num_outputs,
        output_type="pil",
    )


def cmd_generate(args: argparse.Namespace) -> int:
    """``omni-trio generate``: one request, a progress bar on stderr, PNG(s) on disk."""
    return run_command(lambda: _generate_main(args))


def _generate_main(args: argparse.Namespace) -> int:
    import trio

    from ._core.request import DiffusionRequest, validate_request

    config = _engine_config(args, max_num_seqs=args.max_num_seqs or 1, warmup=args.warmup)
    params = _generate_params(args)
    # Reject bad input before loading a model: the engine would raise the same error later.
    validate_request(DiffusionRequest(args.prompt, params, "cli"), config.request_limits)
    out = Path(args.out)
    _check_output_dir(out)
    mode = "none" if args.no_progress else ("live" if _is_tty(sys.stderr) else "plain")

    output = trio.run(_generate_async, config, args.prompt, params, mode)
    width, height = output.images[0].size if output.images else (0, 0)
    paths = output_paths(out, len(output.images))
    for image, path in zip(output.images, paths, strict=True):
        _save_png(image, path)
    m = output.metrics
    for path in paths:
        print(f"wrote {path} ({width}x{height})")
    print(
        f"seed {output.seed}  latency {format_ms(m.e2e_ms)} ms  "
        f"queue wait {format_ms(m.queue_wait_ms)} ms  forward {format_ms(m.execution_ms)} ms"
    )
    return EXIT_OK


async def _generate_async(
    config: EngineConfig, prompt: str, params: SamplingParams, mode: str
) -> DiffusionOutput:
    import trio

    from .runtime.engine import open_engine, raise_for_status

    async with open_engine(config) as engine:
        stream = engine.stream(prompt, params)
        item = _Tracked(stream.request_id, "generate", params.total_steps, trio.current_time())
        await _run_with_progress(engine, [stream], [item], _Display(sys.stderr, mode, [item]))
        assert item.output is not None
        return raise_for_status(item.output)


# -- demo --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _DemoRun:
    tracked: list[_Tracked]
    prompts: list[str]
    stats: EngineStatistics
    warmup: bool
    ready_s: float
    wall_s: float
    model_note: str


def cmd_demo(args: argparse.Namespace) -> int:
    """``omni-trio demo``: several prompts at once, live progress, a grid, a table, stats."""
    return run_command(lambda: _demo_main(args))


def _demo_main(args: argparse.Namespace) -> int:
    import trio

    from ._core.request import SamplingParams, validate_request
    from .errors import InvalidConfigError

    explicit_seqs = args.max_num_seqs is not None
    config = _engine_config(args, max_num_seqs=args.max_num_seqs or 4, warmup=not args.no_warmup)
    width, height = args.size if args.size is not None else (None, None)
    params = SamplingParams(
        height=height,
        width=width,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        output_type="pil",
    )
    prompts = [DEMO_PROMPTS[i % len(DEMO_PROMPTS)] for i in range(args.prompts)]
    from ._core.request import DiffusionRequest

    validate_request(DiffusionRequest(prompts[0], params, "demo-0"), config.request_limits)
    out = Path(args.out)
    _check_output_dir(out)
    mode = args.progress
    if mode == "auto":
        mode = "live" if _is_tty(sys.stdout) else "plain"

    print(
        f"{PROG} demo: model {config.model}, {len(prompts)} prompts, {args.steps} steps, "
        f"max_num_seqs {config.max_num_seqs}, backend {config.backend}, "
        f"torch threads {config.resolved_torch_threads}"
    )
    sys.stdout.flush()
    try:
        run = trio.run(_demo_async, config, prompts, params, args.seed, mode)
    except Exception as exc:
        # A model that cannot fuse requests refuses max_num_seqs > 1: fall back to 1
        # unless the user asked for it explicitly.
        error = next((e for e in walk_exceptions(exc) if isinstance(e, InvalidConfigError)), None)
        if explicit_seqs or error is None or error.field != "max_num_seqs":
            raise
        print(f"note: {error}; running with max_num_seqs 1")
        config = config.replace(max_num_seqs=1)
        run = trio.run(_demo_async, config, prompts, params, args.seed, mode)

    _print_demo_report(run, out, args.cell)
    failed = [t for t in run.tracked if t.output is None or not t.output.ok]
    if not args.no_previews and not failed:
        _write_preview_strip(config, prompts[0], params, args.seed, out, args.cell)
    return EXIT_FAILED if failed else EXIT_OK


def _previews_path(out: Path) -> Path:
    """Where the demo writes its previews strip: ``demo-grid.png`` -> ``demo-grid-previews.png``."""
    return out.with_name(f"{out.stem}-previews{out.suffix}")


def _write_preview_strip(
    config: EngineConfig,
    prompt: str,
    params: SamplingParams,
    seed: int,
    out: Path,
    cell: int,
) -> None:
    """Stream ``prompt`` (seed ``seed``, as in the grid) in step mode with previews and write
    them, left to right, with the final image last, as one strip next to ``out``.

    A model without step mode gets a note instead of a strip."""
    import trio

    from .errors import InvalidConfigError

    steps = params.total_steps
    interval = max(1, math.ceil(steps / (DEMO_PREVIEW_FRAMES + 1)))
    streaming = config.replace(
        streaming_output=True,
        step_execution=True,
        preview_interval=interval,
        max_num_seqs=1,
        warmup=False,
    )
    try:
        frames = trio.run(_stream_previews, streaming, prompt, params.replace(seed=seed))
    except Exception as exc:
        error = next((e for e in walk_exceptions(exc) if isinstance(e, InvalidConfigError)), None)
        if error is None or error.field != "step_execution":
            raise
        print(f"note: no previews strip: {error}")
        return
    captions = [
        f"step {min(steps, (i + 1) * interval)}/{steps}" if i < len(frames) - 1 else "final"
        for i in range(len(frames))
    ]
    strip = build_grid(frames, captions, cell=max(32, cell // 2), columns=len(frames))
    path = _previews_path(out)
    _save_png(strip, path)
    print(f"wrote {path} ({strip.width}x{strip.height}): {prompt!r} forming, streamed")


async def _stream_previews(config: EngineConfig, prompt: str, params: SamplingParams) -> list[Any]:
    """Every image the request's stream yields: the previews, then the final image."""
    from .runtime.engine import open_engine, raise_for_status

    frames: list[Any] = []
    async with (
        open_engine(config) as engine,
        engine.stream(prompt, params, request_id="demo-previews") as stream,
    ):
        async for chunk in stream:
            if chunk.finished:
                raise_for_status(chunk)
            frames.extend(chunk.images[:1])
    return frames


async def _demo_async(
    config: EngineConfig,
    prompts: Sequence[str],
    params: SamplingParams,
    base_seed: int,
    mode: str,
) -> _DemoRun:
    import trio

    started = trio.current_time()
    from .runtime.engine import open_engine

    async with open_engine(config) as engine:
        ready_s = trio.current_time() - started
        info = engine.executor.model_info
        model_note = (
            f"{info.name}: {info.family}, default size "
            f"{info.default_width}x{info.default_height}, "
            f"batching {'on' if info.supports_batch else 'off'}"
            if info is not None
            else config.model
        )
        print(f"engine ready in {ready_s:.1f} s ({model_note})")
        sys.stdout.flush()
        t0 = trio.current_time()
        # Admit every request before any runs: admission is synchronous, so FIFO order (and
        # therefore batch composition and outputs) is the same on every run.
        streams = [
            engine.stream(prompt, params.replace(seed=base_seed + i), request_id=f"demo-{i}")
            for i, prompt in enumerate(prompts)
        ]
        tracked = [_Tracked(s.request_id, s.request_id, params.total_steps, t0) for s in streams]
        await _run_with_progress(engine, streams, tracked, _Display(sys.stdout, mode, tracked))
        wall_s = trio.current_time() - t0
        stats = engine.statistics()
    return _DemoRun(tracked, list(prompts), stats, config.warmup, ready_s, wall_s, model_note)


def _print_demo_report(run: _DemoRun, out: Path, cell: int) -> None:
    rows = []
    images: list[Any] = []
    captions = []
    for item, prompt in zip(run.tracked, run.prompts, strict=True):
        output = item.output
        m = output.metrics if output is not None else None
        seed = output.seed if output is not None else None
        rows.append(
            [
                item.request_id,
                truncate(prompt, 40),
                seed if seed is not None else "-",
                item.state,
                format_ms(m.queue_wait_ms if m else None),
                format_ms(m.e2e_ms if m else None),
            ]
        )
        images.append(output.images[0] if output is not None and output.images else None)
        detail = (
            f"{format_ms(m.e2e_ms)} ms" if m is not None and output and output.ok else item.state
        )
        captions.append(f"{prompt}\nseed {seed}, {detail}")
    grid = build_grid(images, captions, cell=cell)
    _save_png(grid, out)
    print()
    print(
        format_table(
            ["request", "prompt", "seed", "status", "queue wait ms", "latency ms"],
            rows,
            align="llrlrr",
        )
    )
    completed = sum(1 for t in run.tracked if t.output is not None and t.output.ok)
    rate = completed / run.wall_s if run.wall_s > 0 else float("nan")
    print()
    print(f"{completed}/{len(run.tracked)} completed in {run.wall_s:.2f} s ({rate:.2f} images/s)")
    print()
    print("engine statistics (warmup excluded):")
    print(format_statistics(run.stats))
    print()
    print(f"wrote {out} ({grid.width}x{grid.height})")


# -- version -----------------------------------------------------------------------------------


def cmd_version(args: argparse.Namespace) -> int:
    """``omni-trio version``: our version and the versions of the stack (no torch import)."""
    from . import __version__

    parts = [f"python {platform.python_version()}"]
    for dist in ("trio", "torch", "diffusers", "tractor"):
        try:
            parts.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dist} (not installed)")
    print(f"{PROG} {__version__}")
    print(", ".join(parts))
    return EXIT_OK


# -- entry point -------------------------------------------------------------------------------


def _configure_logging(verbosity: int) -> None:
    if verbosity <= 0:
        # transformers prints advisory warnings while loading pipelines (e.g. that
        # torchvision is absent); a CLI user cannot act on them.  -v shows them again.
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(
        level=level, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("omni_trio").setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``omni-trio`` command line; returns the exit status (also for ``--help`` and
    usage errors, which argparse reports with status 2)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return (
            exc.code if isinstance(exc.code, int) else (EXIT_OK if exc.code is None else EXIT_USAGE)
        )
    _configure_logging(args.verbose)
    handler = getattr(args, "handler", None) or getattr(args, "func", None)
    if handler is None:  # pragma: no cover - every subcommand sets one
        parser.print_usage(sys.stderr)
        return EXIT_USAGE
    started = time.perf_counter()
    result = handler(args)
    log.debug("%s finished in %.2f s", args.command, time.perf_counter() - started)
    return int(result or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
