"""Pure rendering helpers for the ``omni-trio`` command line (no trio, no engine, no I/O).

Everything here turns values into strings or images, so it is unit-tested directly:
``parse_size`` (``"64x48"`` -> ``(64, 48)``), ``output_paths`` (one file, or numbered files),
``render_bar`` / ``progress_line`` (the live progress bar), ``redraw_block`` (multi-line redraw
on a terminal), ``format_table`` (aligned text tables), ``format_statistics`` (an
``EngineStatistics`` summary), ``build_grid`` (a captioned PNG contact sheet),
``strip_rest`` (docstring markup out of ``--help`` text) and ``loading_line`` (the phases of
an engine start).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image

__all__ = [
    "RequestView",
    "build_grid",
    "format_ms",
    "format_statistics",
    "format_table",
    "loading_line",
    "output_paths",
    "parse_size",
    "progress_line",
    "redraw_block",
    "render_bar",
    "status_label",
    "strip_rest",
    "truncate",
]

# Cursor control used to redraw a block of lines in place on a terminal.
_CURSOR_PREV_LINE = "\x1b[{n}F"  # move to the start of the n-th previous line
_CLEAR_LINE = "\x1b[2K"


# reST roles (:class:`~pkg.Name`, :func:`text <target>`) and inline literals (``x``).
_REST_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(?P<body>[^`]+)`")
_REST_LITERAL = re.compile(r"``(?P<body>[^`]+)``")


def _role_text(match: re.Match[str]) -> str:
    body = match["body"]
    if "<" in body and body.endswith(">"):
        return body[: body.index("<")].strip()
    if body.startswith("~"):
        return body[1:].rsplit(".", 1)[-1]
    return body


def strip_rest(text: str) -> str:
    """Docstring markup out of text meant for a terminal (``--help``): ``:class:`~a.B``` ->
    ``B``, ``:func:`name <target>``` -> ``name``, double-backtick literals -> their text, and a
    paragraph-ending ``::`` -> ``:``."""
    text = _REST_ROLE.sub(_role_text, text)
    text = _REST_LITERAL.sub(lambda m: m["body"], text)
    return re.sub(r"(?<=\S)::(?=\s|$)", ":", text)


def loading_line(model: str, phases: Sequence[str], ready_s: float | None = None) -> str:
    """The engine-start line: ``loading builtin:shapes: import… load… ready (3.9 s)``.

    ``phases`` are the phases started so far; ``ready_s`` (once ready) ends the line."""
    parts = [f"{phase}…" for phase in phases]
    if ready_s is not None:
        parts.append(f"ready ({ready_s:.1f} s)")
    return f"loading {model}: {' '.join(parts)}".rstrip()


def parse_size(text: str) -> tuple[int, int]:
    """Parse ``"WIDTHxHEIGHT"`` (or a single number for a square) into ``(width, height)``.

    Raises :class:`ValueError` with a one-line message for anything else.  Range checks
    (multiple of 8, pixel limit) are the engine's request validation, not this function's.
    """
    cleaned = text.strip().lower().replace("\N{MULTIPLICATION SIGN}", "x")
    parts = cleaned.split("x")
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"size must look like WIDTHxHEIGHT (e.g. 64x64), got {text!r}")
    width, height = (int(p) for p in parts)
    if width <= 0 or height <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return width, height


def output_paths(path: str | Path, count: int) -> list[Path]:
    """Where ``count`` images go: ``path`` itself for one, ``stem-0.suffix ...`` for several."""
    path = Path(path)
    if count <= 1:
        return [path]
    suffix = path.suffix or ".png"
    return [path.with_name(f"{path.stem}-{i}{suffix}") for i in range(count)]


def truncate(text: str, width: int) -> str:
    """``text`` on one line, cut to ``width`` characters with an ellipsis if longer."""
    flat = " ".join(text.split())
    if width <= 0:
        return ""
    if len(flat) <= width:
        return flat
    if width == 1:
        return "…"
    return flat[: width - 1].rstrip() + "…"


def format_ms(value: float | None) -> str:
    """Milliseconds for a table cell: ``-`` for missing, 1 decimal under 10 ms, else integer."""
    if value is None or not math.isfinite(value):
        return "-"
    if abs(value) < 10:
        return f"{value:.1f}"
    return f"{value:.0f}"


def render_bar(done: int, total: int, width: int = 30) -> str:
    """A plain-text bar: ``[##########··········]  10/20  50%``.

    ``done`` is clamped to ``0..total``; a ``total`` of 0 renders an empty bar at 0%.
    """
    width = max(1, width)
    if total <= 0:
        filled, pct, done, total = 0, 0, 0, 0
    else:
        done = min(max(done, 0), total)
        filled = (done * width) // total
        pct = (done * 100) // total
    bar = "#" * filled + "." * (width - filled)
    digits = len(str(total))
    return f"[{bar}] {done:>{digits}}/{total} {pct:3d}%"


def status_label(status: Any) -> str:
    """A short lower-case label for a status: ``FINISHED_COMPLETED`` -> ``completed``."""
    name = getattr(status, "name", str(status))
    return name.removeprefix("FINISHED_").lower()


@dataclass(frozen=True, slots=True)
class RequestView:
    """What a progress line shows about one request.

    ``state`` is ``"queued"`` (admitted, not running yet), ``"running"`` (``done``/``total``
    steps from the engine's progress), or a terminal label (``completed``, ``aborted``,
    ``error``).
    """

    label: str
    state: str
    done: int = 0
    total: int = 0
    elapsed_s: float = 0.0


def progress_line(view: RequestView, *, label_width: int = 0, bar_width: int = 24) -> str:
    """One request's line: label, bar (while it has a step total), state and elapsed time."""
    label = view.label.ljust(label_width) if label_width else view.label
    elapsed = f"{view.elapsed_s:6.1f}s"
    if view.state == "completed":
        done = view.total or 1
        bar = render_bar(done, done, bar_width)
    elif view.total > 0:
        bar = render_bar(view.done, view.total, bar_width)
    else:
        bar = "[" + " " * bar_width + "]"
    return f"{label} {bar} {view.state:<9} {elapsed}"


def redraw_block(lines: Sequence[str], previous: int) -> str:
    """The text that replaces the ``previous`` lines drawn last time with ``lines`` (ANSI).

    The first frame (``previous == 0``) just prints the lines; later frames move the cursor
    back up and clear each line before writing it, so the block updates in place.
    """
    out = []
    if previous > 0:
        out.append(_CURSOR_PREV_LINE.format(n=previous))
    for line in lines:
        out.append(f"{_CLEAR_LINE}{line}\n")
    # If the block shrank, clear what is left of the old one.
    for _ in range(max(0, previous - len(lines))):
        out.append(f"{_CLEAR_LINE}\n")
    return "".join(out)


def format_table(
    headers: Sequence[str],
    rows: Iterable[Sequence[Any]],
    *,
    align: str | None = None,
) -> str:
    """An aligned plain-text table with a dashed rule under the header.

    ``align`` has one character per column, ``l`` or ``r``; by default a column is
    right-aligned when every non-empty cell in it looks like a number.
    """
    cells = [[str(c) for c in row] for row in rows]
    ncols = len(headers)
    for row in cells:
        if len(row) != ncols:
            raise ValueError(f"row has {len(row)} cells, the header {ncols}: {row!r}")
    if align is None:

        def numeric(value: str) -> bool:
            try:
                float(value)
            except ValueError:
                return value in ("", "-")
            return True

        align = "".join(
            "r" if cells and all(numeric(row[i]) for row in cells) else "l" for i in range(ncols)
        )
    if len(align) != ncols or set(align) - {"l", "r"}:
        raise ValueError(f"align must be {ncols} characters of 'l'/'r', got {align!r}")
    widths = [max([len(headers[i])] + [len(row[i]) for row in cells]) for i in range(ncols)]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if a == "r" else v.ljust(w)
            for v, w, a in zip(values, widths, align, strict=True)
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(list(headers)), rule, *(line(row) for row in cells)])


def format_statistics(stats: Any) -> str:
    """Summarise an ``EngineStatistics`` snapshot: counters, then a per-phase timing table."""
    counters = (
        f"admitted {stats.admitted}  completed {stats.finished_completed}  "
        f"aborted {stats.finished_aborted}  errors {stats.finished_error}  "
        f"waiting {stats.waiting}  running {stats.running}  open streams {stats.open_streams}"
    )
    rows = []
    for name in ("queue_wait", "execution", "postprocess", "end_to_end"):
        phase = getattr(stats, name)
        rows.append(
            [
                name.replace("_", " "),
                phase.count,
                format_ms(phase.mean_ms),
                format_ms(phase.p50_ms),
                format_ms(phase.p90_ms),
                format_ms(phase.max_ms),
            ]
        )
    table = format_table(["phase (ms)", "count", "mean", "p50", "p90", "max"], rows, align="lrrrrr")
    return f"{counters}\n{table}"


def _wrap_to_width(text: str, font: Any, draw: Any, width: int, max_lines: int) -> list[str]:
    """Greedy word wrap measured in pixels; the last line is cut with an ellipsis if needed."""

    def fits(candidate: str) -> bool:
        return bool(draw.textlength(candidate, font=font) <= width)

    def cut(line: str) -> str:
        if fits(line):
            return line
        while line and not fits(line + "…"):
            line = line[:-1]
        return line.rstrip() + "…"

    words = text.split()
    lines: list[str] = []
    current = ""
    for i, word in enumerate(words):
        candidate = f"{current} {word}".strip()
        if fits(candidate) or not current:
            current = candidate
            continue
        lines.append(current)
        if len(lines) == max_lines:
            lines[-1] = cut(lines[-1] + " " + " ".join(words[i:]))
            return lines
        current = word
    if current:
        lines.append(current)
    if len(lines) > max_lines:  # pragma: no cover - guarded above
        lines = lines[:max_lines]
    return [cut(line) for line in lines]


def build_grid(
    images: Sequence[Image.Image | None],
    captions: Sequence[str] = (),
    *,
    cell: int = 160,
    columns: int | None = None,
    caption_lines: int = 3,
    padding: int = 6,
) -> Image.Image:
    """A contact sheet: each image scaled to a ``cell``-pixel square tile with NEAREST
    (so tiny model outputs stay crisp), its caption wrapped underneath.

    ``None`` stands for a request without an image (it failed or was aborted): its tile is
    a grey box with a cross.  ``captions[i]`` may contain ``\\n`` to force line breaks; each
    part is wrapped to the tile width (keeping a line for every later part) and the whole
    caption is cut to ``caption_lines`` lines.
    ``columns`` defaults to at most 4 per row with rows as even as possible.
    """
    from PIL import Image as PILImage
    from PIL import ImageDraw, ImageFont

    count = len(images)
    if count == 0:
        raise ValueError("build_grid needs at least one image")
    if captions and len(captions) != count:
        raise ValueError(f"{len(captions)} captions for {count} images")
    if columns is None:
        # At most 4 wide, rows as even as possible: 6 -> 3x2, 8 -> 4x2, 9 -> 3x3.
        columns = math.ceil(count / math.ceil(count / 4))
    cols = max(1, columns)
    rows = math.ceil(count / cols)
    font = ImageFont.load_default()
    probe = ImageDraw.Draw(PILImage.new("RGB", (1, 1)))
    bbox = probe.textbbox((0, 0), "Ag", font=font)
    line_height = int(bbox[3] - bbox[1]) + 4
    caption_h = (line_height * caption_lines + padding) if captions else 0
    tile_w, tile_h = cell + 2 * padding, cell + caption_h + 2 * padding
    sheet = PILImage.new("RGB", (cols * tile_w, rows * tile_h), (250, 250, 250))
    draw = ImageDraw.Draw(sheet)
    for index, image in enumerate(images):
        x0 = (index % cols) * tile_w + padding
        y0 = (index // cols) * tile_h + padding
        if image is None:
            draw.rectangle([x0, y0, x0 + cell - 1, y0 + cell - 1], fill=(200, 200, 200))
            draw.line([x0, y0, x0 + cell - 1, y0 + cell - 1], fill=(150, 150, 150), width=2)
            draw.line([x0, y0 + cell - 1, x0 + cell - 1, y0], fill=(150, 150, 150), width=2)
        else:
            tile = image.convert("RGB")
            scale = cell / max(tile.width, tile.height)
            size = (max(1, round(tile.width * scale)), max(1, round(tile.height * scale)))
            tile = tile.resize(size, PILImage.Resampling.NEAREST)
            sheet.paste(tile, (x0 + (cell - size[0]) // 2, y0 + (cell - size[1]) // 2))
        if captions:
            lines: list[str] = []
            parts = captions[index].split("\n")
            for j, part in enumerate(parts):
                # Leave one line for each part still to come (a seed line under a long prompt).
                room = caption_lines - len(lines) - (len(parts) - j - 1)
                if room <= 0:
                    room = caption_lines - len(lines)
                if room <= 0:
                    break
                lines.extend(_wrap_to_width(part, font, draw, cell, room))
            ty = y0 + cell + padding // 2
            for line in lines[:caption_lines]:
                draw.text((x0, ty), line, fill=(20, 20, 20), font=font)
                ty += line_height
    return sheet
