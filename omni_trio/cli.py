"""The ``omni-trio`` command line.

::

    omni-trio generate "a prompt" [--model M] [--steps N] [--seed S] [--size WxH] [-n K] [-o F]
                       [--backend B] [--workers N] [--config FILE] ...
    omni-trio demo [--model M] [--prompt TEXT ...] [--prompts-file FILE] [--prompts N] ...
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
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from ._cli_args import (
    CliParser,
    accept_verbose_everywhere,
    finite_float,
    image_path,
    lora_use_arg,
    nonneg_int,
    positive_float,
    positive_int,
    size_arg,
)
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
    loading_line,
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

# Both draw with the model trained here, which draws what its prompts ask for (coloured
# circles, squares and triangles; see omni_trio.models.shapes).
DEFAULT_MODEL = "builtin:shapes"
DEMO_MODEL = "builtin:shapes"
POLL_INTERVAL_S = 0.1
PLAIN_INTERVAL_S = 2.0

# The demo's prompts and seeds (prompt i draws with DEMO_BASE_SEED + i): every colour and
# shape, picked by rendering candidates with builtin:shapes and looking at them, so that each
# picture is one clean shape.  The first is also what the previews strip streams.
DEMO_PROMPTS = (
    "a large green triangle",
    "a small blue square",
    "a purple circle",
    "a red circle",
    "an orange square on a white background",
    "a red square",
    "a blue circle",
    "a large yellow triangle",
)
DEMO_PREVIEW_FRAMES = 8  # previews in the strip (at most; the final image is added)
DEMO_BASE_SEED = 2


# -- argument parsing ------------------------------------------------------------------------


class _CommandDefault(str):
    """A flag's default that the user did not type (``args.model`` still compares equal to
    ``"builtin:shapes"``): a ``--config`` file may override it, a typed value not."""


def _add_engine_options(
    parser: argparse.ArgumentParser,
    *,
    max_num_seqs_default: int,
    model_default: str = DEFAULT_MODEL,
) -> None:
    """The engine's flags.  Each defaults to None ("not given") or, for ``--model``, to a
    :class:`_CommandDefault`, so that a ``--config`` file can set what no flag does
    (flags > file > the command's default)."""
    from .serve.config import lora_arg

    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=_CommandDefault(model_default),
        metavar="M",
        help="built-in model name (builtin:shapes, builtin:tiny-sd, builtin:tiny-ddim, "
        "builtin:echo) or a local diffusers directory",
    )
    group.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="a TOML file in the format of serve --config; its [engine] table sets any "
        "EngineConfig field, and these flags override it",
    )
    group.add_argument(
        "--backend",
        choices=("inproc", "tractor", "ray"),
        default=None,
        help="executor: inproc (a worker thread in this process), tractor (a process per "
        "worker) or ray (default: inproc for one worker, tractor for more)",
    )
    group.add_argument(
        "--workers",
        type=positive_int,
        default=None,
        metavar="N",
        help="workers in the group; 2 split each guidance step between them (cfg_parallel) "
        "(default: 1)",
    )
    group.add_argument(
        "--data-parallel",
        type=positive_int,
        default=None,
        metavar="N",
        help="N worker processes, each running different requests of a wave "
        "(data_parallel_size; implies --workers N; default: 1)",
    )
    group.add_argument(
        "--lora",
        dest="loras",
        action="append",
        type=lora_arg,
        default=None,
        metavar="NAME=PATH",
        help="register a LoRA adapter: NAME=PATH, PATH a diffusers LoRA directory or "
        "builtin:shapes-outline (repeatable; loras)",
    )
    group.add_argument(
        "--cfg-parallel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with 2 workers, split each guidance step between them; --no-cfg-parallel makes "
        "every worker run the whole wave (any worker count) (default: on)",
    )
    group.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"requests fused into one forward (default: {max_num_seqs_default})",
    )
    group.add_argument(
        "--scheduling-policy",
        choices=("fifo", "priority", "fair"),
        default=None,
        help="who runs next: fifo (arrival order), priority (SamplingParams.priority, lower "
        "first; preempts in step mode) or fair (round-robin across image shapes) "
        "(default: fifo)",
    )
    group.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="torch threads per worker (default: (cores - 1) / workers, at least 1)",
    )
    group.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help="where built-in models are created (default: $OMNI_TRIO_CACHE or ~/.cache/omni_trio)",
    )
    group.add_argument(
        "--device",
        default=None,
        metavar="DEV",
        help="torch device: cpu, cuda, cuda:N, mps or xpu; checked before anything starts "
        "(default: cuda if present, else cpu)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The full parser, with the optional ``bench`` subcommand when it is installed.

    Every parser is a :class:`~omni_trio._cli_args.CliParser`: an unknown flag is reported
    with the usage of the subcommand it was given to, ``--help`` shows defaults and no
    docstring markup, and ``-v`` is accepted after the subcommand too."""
    from . import __version__

    parser = CliParser(
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
        help="render one prompt to an image file with a live progress bar",
        description="Render one prompt and write the image(s): PNG, or JPEG/WebP by the "
        "file's extension.  While the engine starts, a line on stderr shows its phases; "
        "then a progress bar.  stdout gets only the result lines.",
    )
    gen.add_argument("prompt", help="the text prompt")
    gen.add_argument("--steps", type=positive_int, default=20, help="denoising steps")
    gen.add_argument(
        "--seed", type=nonneg_int, default=None, help="random seed (default: random, printed)"
    )
    gen.add_argument("--guidance", type=finite_float, default=7.5, help="guidance scale")
    gen.add_argument("--negative-prompt", default=None, help="what the image should not show")
    gen.add_argument(
        "--deadline",
        type=positive_float,
        default=None,
        metavar="S",
        help="give up after S seconds: the request is stopped within one step and the "
        "command fails with RequestTimeoutError (default: no deadline)",
    )
    gen.add_argument(
        "--priority",
        type=int,
        default=0,
        help="the request's priority (lower runs first under --scheduling-policy priority)",
    )
    gen.add_argument(
        "--size",
        type=size_arg,
        default=None,
        metavar="WxH",
        help="output size, multiples of 8 (default: the model's size)",
    )
    gen.add_argument(
        "-n", "--num-outputs", type=positive_int, default=1, help="images for the prompt"
    )
    gen.add_argument(
        "--image",
        default=None,
        metavar="FILE",
        help="start from this picture (PNG, JPEG or WebP): image-to-image; the output size "
        "defaults to the picture's (rounded down to multiples of 8)",
    )
    gen.add_argument(
        "--mask",
        default=None,
        metavar="FILE",
        help="repaint only where this mask is white (or fully transparent), same size as "
        "--image: inpainting",
    )
    gen.add_argument(
        "--strength",
        type=finite_float,
        default=None,
        metavar="S",
        help="how much of --image to repaint, in (0, 1]: the last S x --steps steps run "
        "(default 0.8; with --mask 1.0)",
    )
    gen.add_argument(
        "--use-lora",
        dest="use_lora",
        action="append",
        type=lora_use_arg,
        default=None,
        metavar="NAME[:SCALE]",
        help="apply the LoRA adapter registered as NAME (--lora NAME=PATH) at SCALE "
        "(default 1.0; repeatable)",
    )
    gen.add_argument(
        "-o",
        "--out",
        type=image_path,
        default="out.png",
        help="output file (default: out.png); several images go to out-0.png, out-1.png, ...",
    )
    gen.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the engine's warmup request first (default: off for one-shot generation, "
        "or what --config says)",
    )
    gen.add_argument(
        "--metadata",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write the recipe (prompt, negative prompt, seed, steps, guidance, size, model) "
        "into each image: PNG text chunks, JPEG/WebP EXIF UserComment (default: on)",
    )
    gen.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="run torch.profiler on every worker while the image renders (after the warmup) "
        "and write one Chrome trace per worker into DIR (made if missing), for "
        "chrome://tracing or Perfetto",
    )
    gen.add_argument(
        "-q",
        "--quiet",
        "--no-progress",
        dest="no_progress",
        action="store_true",
        help="draw nothing on stderr: no loading line, no progress bar",
    )
    _add_engine_options(gen, max_num_seqs_default=1)
    gen.set_defaults(handler=cmd_generate)

    demo = sub.add_parser(
        "demo",
        help="render a handful of prompts concurrently and write a captioned grid",
        description="Start an engine, submit several prompts at once (fixed seeds), show "
        "live per-request progress, write a captioned PNG grid and print a per-request table "
        "and the engine statistics; then stream the first prompt once more in step mode and "
        "write a strip of its previews forming (OUT with -previews before the suffix).  The "
        "prompts are the built-in ones unless --prompt or --prompts-file give yours.",
    )
    demo.add_argument("--out", type=image_path, default="demo-grid.png", help="grid image to write")
    demo.add_argument(
        "--prompt",
        action="append",
        dest="prompt_texts",
        default=None,
        metavar="TEXT",
        help="a prompt of yours (repeatable; with --prompts-file, these come first)",
    )
    demo.add_argument(
        "--prompts-file",
        default=None,
        metavar="FILE",
        help="a text file of prompts, one per line (blank lines and lines starting with # "
        "are skipped)",
    )
    demo.add_argument(
        "--prompts",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"how many prompts to submit; the prompts repeat past their number (default: "
        f"as many as --prompt/--prompts-file give, else the {len(DEMO_PROMPTS)} built-in ones)",
    )
    demo.add_argument("--steps", type=positive_int, default=20, help="denoising steps")
    demo.add_argument(
        "--seed",
        type=nonneg_int,
        default=DEMO_BASE_SEED,
        help=f"seed of the first prompt; prompt i uses seed+i (default: {DEMO_BASE_SEED})",
    )
    demo.add_argument("--guidance", type=finite_float, default=7.5, help="guidance scale")
    demo.add_argument(
        "--size",
        type=size_arg,
        default=None,
        metavar="WxH",
        help="output size (default: the model's size)",
    )
    demo.add_argument("--cell", type=positive_int, default=160, help="grid tile size in pixels")
    demo.add_argument("--no-warmup", action="store_true", help="skip the engine warmup")
    demo.add_argument(
        "--no-previews", action="store_true", help="do not write the streaming-previews strip"
    )
    demo.add_argument(
        "--progress",
        choices=("auto", "live", "plain", "none"),
        default="auto",
        help="progress display: live (redrawn, needs a terminal), plain (periodic lines), "
        "none; auto picks live on a terminal",
    )
    _add_engine_options(demo, max_num_seqs_default=4, model_default=DEMO_MODEL)
    demo.set_defaults(handler=cmd_demo)

    version = sub.add_parser("version", help="print the version and the key dependencies")
    version.set_defaults(handler=cmd_version)

    from .fuzz import add_fuzz_parser  # imports Hypothesis only when it runs

    add_fuzz_parser(sub)
    from .serve.daemon import add_serve_parser  # hypercorn is imported only when it runs

    serve = add_serve_parser(sub)
    # The models layer is below serve's reach: the command line hands it the model check.
    serve.set_defaults(check_engine_config=_check_model)
    _show_serve_defaults(serve)
    _add_plugin_commands(sub)
    accept_verbose_everywhere(parser)
    return parser


# serve defaults that are decided later (by worker count, by the machine).
_SERVE_DEFAULT_TEXT = {
    ("engine", "backend"): "inproc for one worker, tractor for more",
    ("engine", "torch_threads"): "(cores - 1) / workers, at least 1",
    ("engine", "cache_dir"): "$OMNI_TRIO_CACHE or ~/.cache/omni_trio",
}


def _show_serve_defaults(parser: argparse.ArgumentParser) -> None:
    """``serve``'s flags default to None ("not given", so a --config file can set them):
    append the value each one gets when neither the flag nor the file sets it."""
    from .serve.config import FLAGS, ServeConfig

    defaults: Any = ServeConfig()
    by_dest = {flag.dest: flag for flag in FLAGS}
    for action in parser._actions:
        flag = by_dest.get(action.dest)
        if flag is None or action.help is None or "default" in action.help.lower():
            continue
        value = defaults
        for part in flag.path:
            value = getattr(value, part)
        if flag.path == ("engine", "model"):
            action.help += " (required, here or in --config)"
        elif flag.path in _SERVE_DEFAULT_TEXT:
            action.help += f" (default: {_SERVE_DEFAULT_TEXT[flag.path]})"
        elif value is None or value == {} or value == ():
            continue
        elif isinstance(value, bool):
            action.help += f" (default: {'on' if value else 'off'})"
        else:
            action.help += f" (default: {value})"


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


def _engine_config(
    args: argparse.Namespace, *, defaults: dict[str, Any], flags: dict[str, Any] | None = None
) -> EngineConfig:
    """The engine's config: the command's ``defaults`` < the ``--config`` file's ``[engine]``
    table < the engine flags given (and ``flags``, the command's own that were given).
    Checked at once (EngineConfig validates every field and the rules between them, the
    device included), and so is the model (:func:`_check_model`): bad input fails here,
    before anything starts."""
    from .config import EngineConfig

    flags = dict(flags or {})
    for dest, field_name in (
        ("model", "model"),
        ("backend", "backend"),
        ("workers", "num_workers"),
        ("data_parallel", "data_parallel_size"),
        ("max_num_seqs", "max_num_seqs"),
        ("threads", "torch_threads"),
        ("cache_dir", "cache_dir"),
        ("device", "device"),
        ("cfg_parallel", "cfg_parallel"),
        ("scheduling_policy", "scheduling_policy"),
        ("loras", "loras"),
    ):
        value = getattr(args, dest, None)
        if dest == "loras" and value is not None:
            value = dict(value)
        if isinstance(value, _CommandDefault):
            defaults = {**defaults, field_name: str(value)}
        elif value is not None:
            flags[field_name] = value
    if args.config is not None:
        from .serve.config import engine_config_from_toml

        config = engine_config_from_toml(args.config, defaults=defaults, overrides=flags)
    else:
        config = EngineConfig(**{**defaults, **flags})
    _check_model(config)
    return config


def _check_model(config: EngineConfig) -> None:
    """Reject an unknown built-in, a missing directory or a Hub id (with how to download it)
    before an engine starts (see :func:`~omni_trio.models.loading.check_model_early`)."""
    from .models.loading import check_model_early
    from .models.lora import check_loras

    check_model_early(config.model, config.backend)
    if config.backend != "ray":  # (Ray workers may be other machines, with other files)
        check_loras(config.loras)


def _check_output_dir(path: Path) -> None:
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise CliError(f"output directory {str(parent)!r} does not exist", EXIT_USAGE)


def _profile_dir(text: str) -> str:
    """``--profile DIR`` as an absolute path, the directory made if missing (so every worker
    process writes where the user meant); one that cannot be made or written is a usage
    error (exit 2), before anything starts."""
    path = Path(text).expanduser().absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CliError(
            f"--profile {text!r}: cannot make the directory: {exc.strerror or exc}", EXIT_USAGE
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CliError(f"--profile {text!r}: the directory is not writable", EXIT_USAGE)
    return str(path)


def _save_png(image: Any, path: Path, recipe: Mapping[str, str] | None = None) -> None:
    """Write ``image`` as its suffix says (none: PNG), with ``recipe`` in it where the format
    carries one (PNG text chunks, JPEG/WebP EXIF UserComment; see
    :func:`~omni_trio.serve.images.pil_save_options`)."""
    from PIL import Image

    from .serve.images import pil_save_options

    fmt = Image.registered_extensions().get(path.suffix.lower(), "PNG") if path.suffix else "PNG"
    image.save(path, format=fmt, **pil_save_options(fmt, recipe))


class _LoadingLine:
    """What the engine is doing while it starts, on ``out`` (stderr), as
    :func:`~omni_trio._cli_render.loading_line` draws it.

    ``live`` (a terminal): redrawn in place as each phase begins, ended with a newline when
    ready (erased if the start fails, so an error is the only line).  ``plain``: written
    once, when ready.  ``none``: nothing.
    """

    def __init__(self, out: TextIO, mode: str, model: str) -> None:
        self.out = out
        self.mode = mode
        self.model = model
        self.phases: list[str] = []

    def phase(self, name: str) -> None:
        self.phases.append(name)
        if self.mode == "live":
            self.out.write("\r" + loading_line(self.model, self.phases) + "\x1b[K")
            self.out.flush()

    def ready(self, seconds: float) -> None:
        line = loading_line(self.model, self.phases, seconds)
        if self.mode == "live":
            self.out.write("\r" + line + "\x1b[K\n")
        elif self.mode == "plain":
            self.out.write(line + "\n")
        self.out.flush()

    def abandon(self) -> None:
        if self.mode == "live" and self.phases:
            self.out.write("\r\x1b[K")
            self.out.flush()


def _import_model_stack(model: str) -> None:
    """Import what loading ``model`` in this process needs (torch; diffusers and its
    pipelines unless it is the weightless echo), so that the import is a phase of its own."""
    import torch  # noqa: F401

    if model != "builtin:echo":
        from .models.loading import quiet_import_advice

        quiet_import_advice()
        import diffusers  # noqa: F401
        from diffusers import DiffusionPipeline, StableDiffusionPipeline  # noqa: F401


@asynccontextmanager
async def _open_engine_showing(
    config: EngineConfig, line: _LoadingLine
) -> AsyncIterator[AsyncEngine]:
    """``open_engine(config)`` with its phases on ``line``: import (inproc: in this process)
    and load, or start (the worker processes import and load), then warmup if configured."""
    import trio

    from .runtime.engine import _warmup, open_engine

    started = trio.current_time()
    shown = False
    try:
        if config.backend == "inproc":
            line.phase("import")
            await trio.to_thread.run_sync(_import_model_stack, config.model)
            line.phase("load")
        else:
            line.phase(f"start {config.num_workers} {config.backend} worker(s)")
        async with open_engine(config.replace(warmup=False)) as engine:
            if config.warmup:
                line.phase("warmup")
                await _warmup(engine)  # the same warmup open_engine runs, as its own phase
            line.ready(trio.current_time() - started)
            shown = True
            yield engine
    finally:
        if not shown:
            line.abandon()


# -- generate ----------------------------------------------------------------------------------


def _read_picture(path: str, what: str, max_pixels: int) -> Any:
    """The picture (``what``: ``--image`` or ``--mask``) in file ``path``, decoded as the
    edits endpoint decodes uploads; a file that cannot be read or is no image is a usage
    error (exit 2)."""
    from .serve.uploads import UploadError, decode_upload

    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise CliError(f"cannot read {what} {path!r}: {exc.strerror or exc}", EXIT_USAGE) from None
    try:
        return decode_upload(data, param=what, max_pixels=max_pixels)
    except UploadError as exc:
        raise CliError(f"{what} {path!r}: {exc.message}", EXIT_USAGE) from None


def _generate_pictures(args: argparse.Namespace, max_pixels: int) -> dict[str, Any]:
    """``image``/``mask_image``/``strength`` from ``--image``, ``--mask``, ``--strength``."""
    from .serve.uploads import UploadError, as_mask, as_rgb

    if args.image is None:
        for flag, value in (("--mask", args.mask), ("--strength", args.strength)):
            if value is not None:
                raise CliError(f"{flag} needs --image (the picture to start from)", EXIT_USAGE)
        return {}
    picture = as_rgb(_read_picture(args.image, "--image", max_pixels))
    mask = None
    if args.mask is not None:
        try:
            mask = as_mask(_read_picture(args.mask, "--mask", max_pixels), size=picture.size)
        except UploadError as exc:
            raise CliError(f"--mask {args.mask!r}: {exc.message}", EXIT_USAGE) from None
    return {"image": picture, "mask_image": mask, "strength": args.strength}


def _generate_params(args: argparse.Namespace, max_pixels: int = 4096 * 4096) -> SamplingParams:
    from ._core.request import SamplingParams

    width, height = args.size if args.size is not None else (None, None)
    return SamplingParams(
        **_generate_pictures(args, max_pixels),
        height=height,
        width=width,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        negative_prompt=args.negative_prompt,
        seed=args.seed,
        num_outputs_per_prompt=args.num_outputs,
        output_type="pil",
        priority=args.priority,
        deadline_s=args.deadline,
        lora=tuple(args.use_lora or ()),
    )


def cmd_generate(args: argparse.Namespace) -> int:
    """``omni-trio generate``: one request, a progress bar on stderr, PNG(s) on disk."""
    return run_command(lambda: _generate_main(args))


def _generate_main(args: argparse.Namespace) -> int:
    import trio

    from ._core.request import DiffusionRequest, validate_request
    from .serve.images import image_metadata

    config = _engine_config(
        args,
        defaults={"model": DEFAULT_MODEL, "max_num_seqs": 1, "warmup": False},
        flags={} if args.warmup is None else {"warmup": args.warmup},
    )
    params = _generate_params(args, config.request_limits.max_image_pixels)
    # Reject bad input before loading a model: the engine would raise the same error later.
    validate_request(DiffusionRequest(args.prompt, params, "cli"), config.request_limits)
    out = Path(args.out)
    _check_output_dir(out)
    profile = _profile_dir(args.profile) if args.profile is not None else None
    mode = "none" if args.no_progress else ("live" if _is_tty(sys.stderr) else "plain")

    output, scheduler, traces = trio.run(
        _generate_async, config, args.prompt, params, mode, profile
    )
    width, height = output.images[0].size if output.images else (0, 0)
    paths = output_paths(out, len(output.images))
    recipe_params = params.replace(seed=output.seed)
    for index, (image, path) in enumerate(zip(output.images, paths, strict=True)):
        recipe = (
            image_metadata(
                args.prompt,
                recipe_params,
                model=config.model,
                scheduler=scheduler,
                size=f"{image.width}x{image.height}",
                image_index=index,
            )
            if args.metadata
            else None
        )
        _save_png(image, path, recipe)
    m = output.metrics
    for path in paths:
        print(f"wrote {path} ({width}x{height})")
    print(
        f"seed {output.seed}  latency {format_ms(m.e2e_ms)} ms  "
        f"queue wait {format_ms(m.queue_wait_ms)} ms  forward {format_ms(m.execution_ms)} ms"
    )
    if profile is not None:
        names = ", ".join(Path(trace).name for trace in traces)
        print(f"profile traces in {profile}: {names}")
    return EXIT_OK


async def _generate_async(
    config: EngineConfig,
    prompt: str,
    params: SamplingParams,
    mode: str,
    profile: str | None = None,
) -> tuple[DiffusionOutput, str | None, list[str]]:
    """Generate one request; its output, the model's scheduler name (for the recipe) and,
    with ``profile`` (a directory), the workers' traces of the generation."""
    import trio

    from .runtime.engine import raise_for_status

    line = _LoadingLine(sys.stderr, mode, config.model)
    traces: list[str] = []
    async with _open_engine_showing(config, line) as engine:
        if profile is not None:
            await engine.start_profile(profile)
        stream = engine.stream(prompt, params)
        item = _Tracked(stream.request_id, "generate", params.total_steps, trio.current_time())
        await _run_with_progress(engine, [stream], [item], _Display(sys.stderr, mode, [item]))
        assert item.output is not None
        if profile is not None:
            traces = await engine.stop_profile()
        info = engine.executor.model_info
        scheduler = None if info is None else info.scheduler
        return raise_for_status(item.output), scheduler, traces


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

    from ._core.request import DiffusionRequest, SamplingParams, validate_request
    from .errors import InvalidConfigError

    explicit_seqs = args.max_num_seqs is not None
    config = _engine_config(
        args,
        defaults={"model": DEMO_MODEL, "max_num_seqs": 4, "warmup": True},
        flags={"warmup": False} if args.no_warmup else {},
    )
    width, height = args.size if args.size is not None else (None, None)
    params = SamplingParams(
        height=height,
        width=width,
        num_inference_steps=args.steps,
        guidance_scale=args.guidance,
        output_type="pil",
    )
    prompts = _demo_prompts(args)
    for i, prompt in enumerate(prompts):
        validate_request(DiffusionRequest(prompt, params, f"demo-{i}"), config.request_limits)
    out = Path(args.out)
    _check_output_dir(out)
    mode = args.progress
    if mode == "auto":
        mode = "live" if _is_tty(sys.stdout) else "plain"

    dp = config.data_parallel_size
    print(
        f"{PROG} demo: model {config.model}, {len(prompts)} prompts, {args.steps} steps, "
        f"max_num_seqs {config.max_num_seqs}, backend {config.backend}"
        + (f" x {dp} data-parallel workers" if dp > 1 else "")
        + f", torch threads {config.resolved_torch_threads}"
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


def _demo_prompts(args: argparse.Namespace) -> list[str]:
    """The prompts to submit: the user's (``--prompt``, then ``--prompts-file``) or the
    built-in ones, repeated to ``--prompts`` if given."""
    pool = list(args.prompt_texts or [])
    if args.prompts_file is not None:
        pool.extend(_read_prompts_file(Path(args.prompts_file)))
    if not pool:
        pool = list(DEMO_PROMPTS)
    count = args.prompts if args.prompts is not None else len(pool)
    return [pool[i % len(pool)] for i in range(count)]


def _read_prompts_file(path: Path) -> list[str]:
    """One prompt per line; blank lines and lines starting with ``#`` are skipped.  A file
    that cannot be read, or holds no prompt, is a usage error (exit 2)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CliError(
            f"cannot read prompts file {str(path)!r}: {exc.strerror or exc}", EXIT_USAGE
        ) from None
    except UnicodeDecodeError as exc:
        raise CliError(f"prompts file {str(path)!r} is not UTF-8 text: {exc}", EXIT_USAGE) from None
    prompts = [
        line.strip()
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    if not prompts:
        raise CliError(f"prompts file {str(path)!r} holds no prompt", EXIT_USAGE)
    return prompts


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
