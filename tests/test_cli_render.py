"""The CLI's pure rendering helpers: sizes, paths, bars, redraws, tables, statistics, grids."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image

from omni_trio import RequestStatus
from omni_trio._cli_render import (
    RequestView,
    build_grid,
    format_ms,
    format_statistics,
    format_table,
    loading_line,
    output_paths,
    parse_size,
    progress_line,
    redraw_block,
    render_bar,
    status_label,
    strip_rest,
    truncate,
)
from omni_trio.runtime.engine import EngineStatistics, PhaseSummary


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64x64", (64, 64)),
        ("64x48", (64, 48)),
        (" 128X96 ", (128, 96)),
        ("32", (32, 32)),
        ("65x64", (65, 64)),  # range checks belong to request validation
    ],
)
def test_parse_size_accepts_width_by_height(text: str, expected: tuple[int, int]) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "64x", "x64", "64x64x3", "-8x8", "0x64", "6.4x8"])
def test_parse_size_rejects_garbage_with_one_line(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(text)
    assert "\n" not in str(info.value)


def test_output_paths_one_file_keeps_the_name() -> None:
    assert output_paths("out.png", 1) == [Path("out.png")]


def test_output_paths_several_files_are_numbered(tmp_path: Path) -> None:
    assert output_paths(tmp_path / "img.png", 3) == [
        tmp_path / "img-0.png",
        tmp_path / "img-1.png",
        tmp_path / "img-2.png",
    ]
    assert output_paths("noext", 2) == [Path("noext-0.png"), Path("noext-1.png")]


def test_truncate_flattens_and_cuts_with_an_ellipsis() -> None:
    assert truncate("a  red\nfox", 20) == "a red fox"
    assert truncate("abcdefghij", 5) == "abcd…"
    assert len(truncate("x" * 100, 40)) == 40
    assert truncate("abc", 0) == ""


def test_format_ms() -> None:
    assert format_ms(None) == "-"
    assert format_ms(float("nan")) == "-"
    assert format_ms(0.25) == "0.2"
    assert format_ms(9.96) == "10.0"
    assert format_ms(1234.4) == "1234"


def test_render_bar_fills_in_proportion() -> None:
    assert render_bar(0, 20, width=10) == "[..........]  0/20   0%"
    assert render_bar(10, 20, width=10) == "[#####.....] 10/20  50%"
    assert render_bar(20, 20, width=10) == "[##########] 20/20 100%"


def test_render_bar_clamps_and_handles_zero_total() -> None:
    assert render_bar(25, 20, width=4) == "[####] 20/20 100%"
    assert render_bar(-3, 20, width=4) == "[....]  0/20   0%"
    assert render_bar(3, 0, width=4) == "[....] 0/0   0%"


def test_status_label() -> None:
    assert status_label(RequestStatus.FINISHED_COMPLETED) == "completed"
    assert status_label(RequestStatus.FINISHED_ABORTED) == "aborted"
    assert status_label(RequestStatus.RUNNING) == "running"


def test_progress_line_states() -> None:
    queued = progress_line(RequestView("demo-0", "queued", 0, 20, 0.0), bar_width=10)
    assert queued.startswith("demo-0 [..........]  0/20   0% queued")
    running = progress_line(RequestView("demo-0", "running", 5, 20, 1.25), bar_width=10)
    assert "[##........]  5/20  25% running" in running
    assert running.endswith("1.2s") or running.endswith("1.3s")
    done = progress_line(RequestView("demo-0", "completed", 19, 20, 2.0), bar_width=10)
    assert "[##########] 20/20 100% completed" in done
    unknown_total = progress_line(RequestView("r", "queued"), bar_width=4)
    assert "[    ]" in unknown_total


def test_progress_line_pads_labels_to_align_bars() -> None:
    a = progress_line(RequestView("a", "queued", 0, 4), label_width=6, bar_width=4)
    b = progress_line(RequestView("abcdef", "queued", 0, 4), label_width=6, bar_width=4)
    assert a.index("[") == b.index("[") == 7


def test_redraw_block_first_frame_just_prints() -> None:
    assert redraw_block(["a", "b"], 0) == "\x1b[2Ka\n\x1b[2Kb\n"


def test_redraw_block_moves_back_up_over_the_previous_frame() -> None:
    frame = redraw_block(["a", "b", "c"], 3)
    assert frame.startswith("\x1b[3F")
    assert frame.count("\n") == 3


def test_redraw_block_clears_leftover_lines_when_shrinking() -> None:
    frame = redraw_block(["a"], 3)
    assert frame.startswith("\x1b[3F")
    assert frame.count("\x1b[2K") == 3
    assert frame.count("\n") == 3


def test_format_table_aligns_numbers_right_and_text_left() -> None:
    table = format_table(["id", "ms"], [["a", 5], ["long-id", 1234]])
    lines = table.splitlines()
    assert lines[0] == "id         ms"
    assert lines[1] == "-------  ----"
    assert lines[2] == "a           5"
    assert lines[3] == "long-id  1234"


def test_format_table_explicit_alignment_and_errors() -> None:
    assert format_table(["n"], [[1]], align="l").splitlines()[2] == "1"
    with pytest.raises(ValueError, match="cells"):
        format_table(["a", "b"], [[1]])
    with pytest.raises(ValueError, match="align"):
        format_table(["a"], [[1]], align="x")


def test_format_statistics_lists_counters_and_phases() -> None:
    stats = EngineStatistics(
        waiting=0,
        running=0,
        admitted=3,
        finished_completed=2,
        finished_aborted=1,
        finished_error=0,
        open_streams=0,
        dead=False,
        closed=False,
        end_to_end=PhaseSummary(count=2, mean_ms=150.0, p50_ms=100.0, p90_ms=200.0, max_ms=200.0),
    )
    text = format_statistics(stats)
    assert "admitted 3  completed 2  aborted 1  errors 0" in text
    e2e = next(line for line in text.splitlines() if line.startswith("end to end"))
    assert e2e.split() == ["end", "to", "end", "2", "150", "100", "200", "200"]


def _solid(color: tuple[int, int, int], size: int = 8) -> Image.Image:
    return Image.new("RGB", (size, size), color)


def test_build_grid_upscales_with_nearest_into_square_tiles() -> None:
    images = [_solid((255, 0, 0)), _solid((0, 0, 255))]
    grid = build_grid(images, cell=64, padding=4)
    # two tiles side by side, no captions
    assert grid.size == (2 * (64 + 8), 64 + 8)
    # NEAREST keeps the tile a single solid colour (no blending at its centre or corners)
    assert grid.getpixel((4, 4)) == (255, 0, 0)
    assert grid.getpixel((4 + 63, 4 + 63)) == (255, 0, 0)
    assert grid.getpixel((72 + 4 + 32, 4 + 32)) == (0, 0, 255)


@pytest.mark.parametrize(("count", "columns"), [(1, 1), (4, 4), (5, 3), (6, 3), (8, 4), (9, 3)])
def test_build_grid_layout(count: int, columns: int) -> None:
    grid = build_grid([_solid((1, 2, 3))] * count, cell=16, padding=0)
    rows = -(-count // columns)
    assert grid.size == (columns * 16, rows * 16)


def test_build_grid_draws_captions_and_placeholders() -> None:
    images = [_solid((0, 0, 0)), None]
    captions = ["a very long prompt that will certainly need wrapping\nseed 1, 10 ms", "failed"]
    grid = build_grid(images, captions, cell=64, padding=4)
    assert grid.height > 64 + 8  # room for the captions
    # the failed request's tile is grey, not black
    assert grid.getpixel((72 + 10, 4 + 30)) == (200, 200, 200)
    # caption text was drawn under the first tile (some dark pixels in the caption band)
    band = grid.crop((4, 4 + 64 + 2, 4 + 64, grid.height))
    assert band.convert("L").getextrema()[0] < 100


def test_build_grid_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one"):
        build_grid([])
    with pytest.raises(ValueError, match="captions"):
        build_grid([_solid((0, 0, 0))], ["a", "b"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "``bench quality``: does ``builtin:shapes`` draw?",
            "bench quality: does builtin:shapes draw?",
        ),
        ("see :class:`~omni_trio.config.EngineConfig`", "see EngineConfig"),
        ("see :class:`omni_trio.config.EngineConfig`", "see omni_trio.config.EngineConfig"),
        ("the :func:`engine <omni_trio.open_engine>` opens", "the engine opens"),
        (":py:meth:`AsyncEngine.stream` and :data:`FLAGS`", "AsyncEngine.stream and FLAGS"),
        ("Example::", "Example:"),
        ("a `single` backtick and a time 10:30 stay", "a `single` backtick and a time 10:30 stay"),
    ],
)
def test_strip_rest_leaves_plain_text_for_a_terminal(text: str, expected: str) -> None:
    assert strip_rest(text) == expected


def test_loading_line_lists_the_phases_then_the_time() -> None:
    assert loading_line("builtin:shapes", []) == "loading builtin:shapes:"
    assert loading_line("m", ["import"]) == "loading m: import…"
    assert (
        loading_line("builtin:shapes", ["import", "load", "warmup"], 3.94)
        == "loading builtin:shapes: import… load… warmup… ready (3.9 s)"
    )
