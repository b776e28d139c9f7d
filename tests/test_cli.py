"""The ``omni-trio`` command line, run in-process through ``main([...])``.

Most tests use ``builtin:echo`` (no weights; its images encode request id, seed and output
index, so a PNG on disk proves which request produced it).  One test renders a real PNG with
``builtin:tiny-sd``, one runs the demo on ``builtin:shapes``.  Every test uses a temporary
model cache and output directory.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path

import pytest
from PIL import Image

from omni_trio import cli
from omni_trio.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from omni_trio.models import decode_echo_image
from omni_trio.models.shapes import SHAPES
from tests.fakes import ScriptedModel, register_models


def _echo(*args: str, cache_dir: Path) -> list[str]:
    return [*args, "--model", "builtin:echo", "--cache-dir", str(cache_dir)]


# -- version, help, plug-ins -------------------------------------------------------------------


def test_version_prints_ours_and_the_stack(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("omni-trio 0.1.0\n")
    assert "trio 0.23.2" in out
    assert "torch" in out


def test_help_and_missing_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == EXIT_OK
    assert "generate" in capsys.readouterr().out
    assert main([]) == EXIT_USAGE
    assert "required" in capsys.readouterr().err


def _fake_bench(add: object) -> types.ModuleType:
    module = types.ModuleType("omni_trio.bench")
    module.add_bench_parser = add  # type: ignore[attr-defined]
    return module


def test_bench_plugin_registers_and_dispatches_through_func(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
        parser = subparsers.add_parser("bench")
        parser.add_argument("experiment")
        parser.set_defaults(func=lambda args: print(f"ran {args.experiment}") or 3)

    monkeypatch.setitem(sys.modules, "omni_trio.bench", _fake_bench(add_bench_parser))
    assert main(["bench", "overhead"]) == 3
    assert capsys.readouterr().out == "ran overhead\n"


def test_a_broken_bench_plugin_only_warns(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def add_bench_parser(subparsers: object) -> None:
        raise ImportError("cannot import name 'overhead'")

    monkeypatch.setitem(sys.modules, "omni_trio.bench", _fake_bench(add_bench_parser))
    assert main(["version"]) == EXIT_OK
    captured = capsys.readouterr()
    assert "omni-trio 0.1.0" in captured.out
    assert "warning: bench command unavailable" in captured.err


# -- generate ----------------------------------------------------------------------------------


def test_generate_echo_writes_the_png_of_its_own_request(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "fox.png"
    argv = _echo(
        "generate",
        "a red fox",
        "--steps",
        "3",
        "--seed",
        "5",
        "--size",
        "64x48",
        "-o",
        str(out),
        cache_dir=cache_dir,
    )
    assert main(argv) == EXIT_OK
    captured = capsys.readouterr()
    image = Image.open(out)
    assert image.format == "PNG"
    assert image.size == (64, 48)  # --size is WIDTHxHEIGHT
    _, seed, index = decode_echo_image(image)
    assert (seed, index) == (5, 0)
    assert f"wrote {out} (64x48)" in captured.out
    assert "seed 5" in captured.out
    assert "latency" in captured.out and "queue wait" in captured.out
    # stderr is not a terminal here: plain progress lines, no carriage returns
    assert "3/3 100% completed" in captured.err
    assert "\r" not in captured.err
    assert "Traceback" not in captured.err


def test_generate_several_outputs_are_numbered(tmp_path: Path, cache_dir: Path) -> None:
    out = tmp_path / "out.png"
    argv = _echo(
        "generate",
        "x",
        "--steps",
        "1",
        "--seed",
        "9",
        "-n",
        "3",
        "-o",
        str(out),
        cache_dir=cache_dir,
    )
    assert main(argv) == EXIT_OK
    assert not out.exists()
    indices = [decode_echo_image(Image.open(tmp_path / f"out-{i}.png"))[1:] for i in range(3)]
    assert indices == [(9, 0), (9, 1), (9, 2)]


def test_generate_draws_a_live_bar_on_a_terminal(
    tmp_path: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(cli, "_is_tty", lambda stream: True)
    argv = _echo(
        "generate", "x", "--steps", "2", "-o", str(tmp_path / "o.png"), cache_dir=cache_dir
    )
    assert main(argv) == EXIT_OK
    err = capsys.readouterr().err
    assert err.startswith("\r")
    assert err.endswith("\n")
    assert "2/2 100% completed" in err


def test_generate_no_progress_is_silent_on_stderr(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _echo(
        "generate",
        "x",
        "--steps",
        "2",
        "--no-progress",
        "-o",
        str(tmp_path / "o.png"),
        cache_dir=cache_dir,
    )
    assert main(argv) == EXIT_OK
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_generate_tiny_sd_writes_a_real_png(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "real.png"
    argv = [
        "generate",
        "a lighthouse at dusk",
        "--model",
        "builtin:tiny-sd",
        "--steps",
        "3",
        "--seed",
        "1",
        "--guidance",
        "5",
        "--negative-prompt",
        "blurry",
        "--size",
        "64x64",
        "--threads",
        "1",
        "--cache-dir",
        str(cache_dir),
        "-o",
        str(out),
    ]
    assert main(argv) == EXIT_OK
    image = Image.open(out)
    image.load()
    assert (image.format, image.mode, image.size) == ("PNG", "RGB", (64, 64))
    # a rendered image, not a blank one
    assert any(low < high for low, high in image.getextrema())
    assert "seed 1" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--size", "65x64"], "width must be a multiple of 8"),
        (["--size", "4096x4096"], "pixels"),
        (["--steps", "5000"], "num_inference_steps"),
        (["-n", "99"], "num_outputs_per_prompt"),
        (["--max-num-seqs", "2", "--threads", "0"], "positive integer"),
    ],
)
def test_generate_bad_input_is_one_line_and_exit_2(
    tmp_path: Path,
    cache_dir: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    # tiny-sd would take seconds to load: these must be rejected before any model loads.
    argv = [
        "generate",
        "x",
        "--model",
        "builtin:tiny-sd",
        "--cache-dir",
        str(cache_dir / "none"),
        "-o",
        str(tmp_path / "o.png"),
        *extra,
    ]
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    assert not (cache_dir / "none").exists()
    assert not (tmp_path / "o.png").exists()


def test_generate_unparseable_size_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "x", "--size", "big"]) == EXIT_USAGE
    assert "WIDTHxHEIGHT" in capsys.readouterr().err


def test_generate_unknown_model_exits_2(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "generate",
        "x",
        "--model",
        "builtin:nope",
        "--cache-dir",
        str(cache_dir),
        "-o",
        str(tmp_path / "o.png"),
    ]
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("omni-trio: error: unknown built-in model 'builtin:nope'")
    assert err.count("\n") == 1


def test_generate_missing_output_directory_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "missing" / "o.png"
    assert main(["generate", "x", "--model", "builtin:echo", "-o", str(out)]) == EXIT_USAGE
    assert "does not exist" in capsys.readouterr().err


def test_bad_input_exit_code_from_the_console_script(tmp_path: Path) -> None:
    """The real process: exit status 2, one line on stderr, no traceback."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "omni_trio.cli",
            "generate",
            "x",
            "--size",
            "60x64",
            "-o",
            str(tmp_path / "o.png"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == EXIT_USAGE
    assert "width must be a multiple of 8" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_generate_a_failed_request_exits_1_with_one_line(
    tmp_path: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    register_models(
        monkeypatch, {"fake:broken": lambda options: ScriptedModel(fail_with=ValueError("boom"))}
    )
    argv = [
        "generate",
        "x",
        "--model",
        "fake:broken",
        "--steps",
        "2",
        "--cache-dir",
        str(cache_dir),
        "-o",
        str(tmp_path / "o.png"),
    ]
    assert main(argv) == EXIT_FAILED
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("omni-trio: error: Request ")
    assert last.endswith("failed: ValueError: boom")
    assert "Traceback" not in err
    assert not (tmp_path / "o.png").exists()


# -- demo --------------------------------------------------------------------------------------


def test_demo_echo_writes_a_grid_and_prints_the_table(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    grid_path = tmp_path / "grid.png"
    argv = _echo(
        "demo",
        "--prompts",
        "6",
        "--steps",
        "2",
        "--out",
        str(grid_path),
        "--cell",
        "96",
        "--progress",
        "plain",
        cache_dir=cache_dir,
    )
    assert main(argv) == EXIT_OK
    out = capsys.readouterr().out
    grid = Image.open(grid_path)
    assert grid.format == "PNG"
    assert grid.width == 3 * (96 + 12)  # 6 tiles: 3 columns x 2 rows
    table = out[out.index("request  prompt") :]
    for i in range(6):
        row = next(line for line in table.splitlines() if line.startswith(f"demo-{i} "))
        assert "completed" in row
        assert str(cli.DEMO_BASE_SEED + i) in row
    assert "queue wait ms" in out and "latency ms" in out
    assert "6/6 completed" in out
    assert "engine statistics (warmup excluded):" in out
    assert "admitted 6  completed 6" in out  # the warmup request is not counted
    assert f"wrote {grid_path}" in out
    assert "\x1b[" not in out  # plain mode: no cursor movement in logs
    # Then the first prompt streamed in step mode: one preview after step 1, then the final.
    strip = Image.open(tmp_path / "grid-previews.png")
    assert strip.format == "PNG" and strip.width == 2 * (48 + 12)
    assert f"wrote {tmp_path / 'grid-previews.png'}" in out


def test_demo_live_mode_redraws_a_block(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _echo(
        "demo",
        "--prompts",
        "3",
        "--steps",
        "1",
        "--no-warmup",
        "--progress",
        "live",
        "--out",
        str(tmp_path / "g.png"),
        cache_dir=cache_dir,
    )
    assert main(argv) == EXIT_OK
    out = capsys.readouterr().out
    assert "\x1b[3F" in out  # moved back up over the 3-line block
    assert "engine statistics (warmup excluded):" in out
    assert "admitted 3  completed 3" in out


def test_demo_bad_size_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--size", "63x63", "--out", str(tmp_path / "g.png")]) == EXIT_USAGE
    assert "multiple of 8" in capsys.readouterr().err


def test_demo_falls_back_to_one_sequence_for_a_model_that_cannot_batch(
    tmp_path: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    register_models(
        monkeypatch, {"fake:single": lambda options: ScriptedModel(supports_batch=False)}
    )
    base = [
        "demo",
        "--model",
        "fake:single",
        "--prompts",
        "2",
        "--steps",
        "1",
        "--no-warmup",
        "--progress",
        "none",
        "--cache-dir",
        str(cache_dir),
        "--out",
        str(tmp_path / "g.png"),
    ]
    assert main(base) == EXIT_OK
    out = capsys.readouterr().out
    assert "running with max_num_seqs 1" in out
    assert "2/2 completed" in out
    assert "note: no previews strip" in out  # the fake has no step mode
    assert not (tmp_path / "g-previews.png").exists()
    # asked for explicitly, it is the user's error: no fallback
    assert main([*base, "--max-num-seqs", "2"]) == EXIT_USAGE
    assert "max_num_seqs=1" in capsys.readouterr().err


def test_the_demo_draws_with_builtin_shapes_and_generate_keeps_tiny_sd() -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["demo"]).model == "builtin:shapes"
    assert parser.parse_args(["generate", "x"]).model == "builtin:tiny-sd"
    assert all(any(shape in prompt for shape in SHAPES) for prompt in cli.DEMO_PROMPTS)


@pytest.mark.slow
def test_demo_on_builtin_shapes_writes_the_grid_and_the_previews(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    grid = tmp_path / "demo.png"
    argv = ["demo", "--prompts", "2", "--steps", "4", "--no-warmup", "--progress", "none"]
    argv += ["--cache-dir", str(cache_dir), "--threads", "1", "--out", str(grid)]
    assert main(argv) == EXIT_OK
    out = capsys.readouterr().out
    assert "model builtin:shapes" in out and "2/2 completed" in out
    assert Image.open(grid).width == 2 * (160 + 12)
    strip = Image.open(tmp_path / "demo-previews.png")
    assert strip.width == 4 * (80 + 12)  # previews after steps 1, 2, 3, then the final image
