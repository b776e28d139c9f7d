"""The ``omni-trio`` command line, run in-process through ``main([...])``.

Most tests use ``builtin:echo`` (no weights; its images encode request id, seed and output
index, so a PNG on disk proves which request produced it).  One test renders a real PNG with
``builtin:tiny-sd``, one runs the demo on ``builtin:shapes``.  Every test uses a temporary
model cache and output directory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from omni_trio import cli
from omni_trio.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from omni_trio.errors import InvalidConfigError
from omni_trio.models import decode_echo_image
from omni_trio.models.shapes import SHAPES
from tests.fakes import ScriptedModel, register_models

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)


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
    # The recipe names the real pipeline's noise scheduler.
    text = image.text  # type: ignore[attr-defined]
    assert (text["model"], text["seed"], text["negative_prompt"]) == (
        "builtin:tiny-sd",
        "1",
        "blurry",
    )
    assert text["scheduler"].endswith("Scheduler")
    assert f"Sampler: {text['scheduler']}" in text["parameters"]


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


def test_generate_from_a_picture_and_a_mask(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """builtin:shapes inpaints the masked square of a 40x48 picture; the rest comes back (its
    VAE is the identity) and the size is the picture's."""
    import numpy as np

    pixels = np.random.default_rng(0).integers(0, 256, (48, 40, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "in.png")
    mask = np.zeros((48, 40), np.uint8)
    mask[8:32, 8:32] = 255
    Image.fromarray(mask).save(tmp_path / "mask.png")
    out = tmp_path / "edit.png"
    argv = ["generate", "a blue circle", "--image", str(tmp_path / "in.png"), "--mask",
            str(tmp_path / "mask.png"), "--strength", "0.9", "--steps", "6", "--seed", "2",
            "--threads", "1", "--cache-dir", str(cache_dir), "-o", str(out), "-q"]  # fmt: skip
    assert main(argv) == EXIT_OK
    assert "wrote " in capsys.readouterr().out
    image = Image.open(out)
    image.load()
    result = np.asarray(image).astype(int)
    keep = mask == 0
    assert image.size == (40, 48)
    assert np.abs(result[keep] - pixels[keep]).max() <= 1
    assert np.abs(result[~keep] - pixels[~keep]).mean() > 20
    text = image.text  # type: ignore[attr-defined]
    assert (text["strength"], text["conditioning"], text["steps"]) == ("0.9", "inpaint", "6")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--mask", "m.png"], "--mask needs --image"),
        (["--strength", "0.5"], "--strength needs --image"),
        (["--image", "missing.png"], "cannot read --image"),
        (["--image", "notes.txt"], "is not an image (PNG, JPEG or WebP)"),
        (["--image", "in.png", "--mask", "small.png"], "mask is 16x16 but the image is 32x32"),
        (["--image", "in.png", "--strength", "1.5"], "strength must be a number in (0, 1]"),
    ],
)
def test_generate_bad_pictures_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    Image.new("RGB", (32, 32)).save(tmp_path / "in.png")
    Image.new("L", (16, 16), 255).save(tmp_path / "small.png")
    (tmp_path / "notes.txt").write_text("not a picture")
    argv = ["generate", "x", "--cache-dir", str(tmp_path / "none"), "-o", str(tmp_path / "o.png")]
    argv += [str(tmp_path / a) if a.endswith((".png", ".txt")) else a for a in extra]
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
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


def test_generate_profile_writes_a_trace_and_names_it_on_one_line(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profiles = tmp_path / "profiles" / "run"  # made, parents and all
    out = tmp_path / "o.png"
    argv = _echo(
        "generate",
        "x",
        "--steps",
        "2",
        "-o",
        str(out),
        "--profile",
        str(profiles),
        "--warmup",
        cache_dir=cache_dir,
    )
    assert main(argv) == EXIT_OK  # the profile starts after the warmup, ends with the image
    captured = capsys.readouterr()
    (line,) = [line for line in captured.out.splitlines() if line.startswith("profile")]
    (trace,) = profiles.iterdir()
    assert line == f"profile traces in {profiles}: {trace.name}"
    assert trace.name.endswith("-rank0.json") and out.is_file()
    with open(trace, encoding="utf-8") as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    assert "omni_trio.forward" in names
    assert "Traceback" not in captured.err


def test_generate_a_bad_profile_directory_is_one_line_and_exit_2(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for bad in (a_file, a_file / "below"):
        argv = _echo(
            "generate",
            "x",
            "-o",
            str(tmp_path / "o.png"),
            "--profile",
            str(bad),
            cache_dir=cache_dir / "none",
        )
        assert main(argv) == EXIT_USAGE
        err = capsys.readouterr().err
        assert err.startswith(f"omni-trio: error: --profile {str(bad)!r}: cannot make")
        assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "o.png").exists()


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


def test_demo_and_generate_draw_with_builtin_shapes() -> None:
    parser = cli.build_parser()
    assert parser.parse_args(["demo"]).model == "builtin:shapes"
    assert parser.parse_args(["generate", "x"]).model == "builtin:shapes"
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


# -- bad input is one line, before anything starts (#21) ----------------------------------------


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _one_error_line(err: str) -> str:
    """The only line of ``err``: ``omni-trio: error: ...`` (no warning, no traceback)."""
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("omni-trio: error: ")
    return lines[0].removeprefix("omni-trio: error: ")


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting an engine fails the test: what is checked must be checked before it."""
    from omni_trio.runtime import engine

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("an engine was started")

    monkeypatch.setattr(engine.AsyncEngine, "__init__", refuse)


_COMMANDS = {
    "generate": ["generate", "x"],
    "demo": ["demo", "--progress", "none"],
    "serve": ["serve", "--model", "builtin:echo", "--port", "0"],
}


@pytest.mark.parametrize("command", sorted(_COMMANDS))
@pytest.mark.parametrize("device", ["cuda", "tpu", "cuda:7"])
def test_a_bad_device_is_one_line_and_exit_2_before_anything_starts(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_engine: None,
    command: str,
    device: str,
) -> None:
    if device.startswith("cuda") and _cuda_available() and device == "cuda":
        pytest.skip("this machine has CUDA")
    argv = [*_COMMANDS[command], "--device", device, "--cache-dir", str(tmp_path / "cache")]
    if command != "serve":
        argv += ["--out" if command == "demo" else "-o", str(tmp_path / "o.png")]
    assert main(argv) == EXIT_USAGE
    captured = capsys.readouterr()
    message = _one_error_line(captured.err)
    assert f"device {device!r}" in message
    assert captured.out == ""
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("command", ["generate", "demo"])
@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("nosuch", "model 'nosuch' is neither a built-in"),
        ("builtin:nosuch", "unknown built-in model 'builtin:nosuch'"),
        ("MISSING", "is neither a built-in"),
        ("EMPTY", "is not a diffusers pipeline (no model_index.json)"),
        ("no_such_pkg_xyz.models:make", "cannot import module 'no_such_pkg_xyz.models'"),
        ("no_such_pkg_xyz:make", "cannot import module 'no_such_pkg_xyz'"),
        ("tests.extension_examples:SMALL", "not a callable model factory"),
    ],
)
def test_an_unknown_model_is_one_line_before_the_engine_starts(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_engine: None,
    command: str,
    model: str,
    expected: str,
) -> None:
    if model == "MISSING":
        model = str(tmp_path / "no" / "such" / "dir")
    elif model == "EMPTY":
        (tmp_path / "empty").mkdir()
        model = str(tmp_path / "empty")
    argv = [*_COMMANDS[command], "--model", model, "--cache-dir", str(tmp_path / "cache")]
    argv += ["--out" if command == "demo" else "-o", str(tmp_path / "o.png")]
    assert main(argv) == EXIT_USAGE
    captured = capsys.readouterr()
    assert expected in _one_error_line(captured.err)  # no "WARNING ... failed" line first
    assert captured.out == ""


def test_a_model_factory_path_passes_the_early_check_and_serves(
    tmp_path: Path, cache_dir: Path
) -> None:
    out = tmp_path / "f.png"
    model = "tests.extension_examples:echo_factory"
    argv = ["generate", "x", "--model", model, "--steps", "2", "--size", "32x32", "-o", str(out)]
    assert main([*argv, "--cache-dir", str(cache_dir)]) == EXIT_OK
    assert decode_echo_image(Image.open(out))[2] == 0


def test_a_hub_id_says_how_to_make_a_local_copy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_engine: None
) -> None:
    argv = ["generate", "x", "--model", "stabilityai/sd-turbo", "-o", str(tmp_path / "o.png")]
    assert main(argv) == EXIT_USAGE
    message = _one_error_line(capsys.readouterr().err)
    assert "looks like a Hugging Face Hub id" in message
    assert "huggingface-cli download stabilityai/sd-turbo --local-dir DIR" in message
    assert "snapshot_download('stabilityai/sd-turbo', local_dir=DIR)" in message
    assert message.endswith("(--model DIR)")


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--workers", "3"], "cfg_parallel splits each guidance step between exactly 2 workers"),
        (["--backend", "inproc", "--workers", "2"], "the inproc backend runs exactly one worker"),
        (["--backend", "inproc", "--data-parallel", "2"], "data_parallel_size=2 runs 2 worker"),
        (["--data-parallel", "2", "--workers", "3"], "num_workers must be 2 (or left unset)"),
    ],
)
def test_cross_field_errors_are_one_line_before_anything_starts(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_engine: None,
    flags: list[str],
    expected: str,
) -> None:
    argv = ["generate", "x", "--model", "builtin:echo", *flags, "-o", str(tmp_path / "o.png")]
    assert main(argv) == EXIT_USAGE
    assert expected in _one_error_line(capsys.readouterr().err)


# -- argparse: subcommand usage, -v anywhere, defaults, no markup (#21) --------------------------


@pytest.mark.parametrize(
    ("argv", "usage", "error"),
    [
        (
            ["generate", "x", "--stepz", "3"],
            "usage: omni-trio generate ",
            "omni-trio generate: error: unrecognized arguments: --stepz 3 (did you mean --steps?)",
        ),
        (
            ["serve", "--model", "builtin:echo", "--portt", "1"],
            "usage: omni-trio serve ",
            "omni-trio serve: error: unrecognized arguments: --portt 1 (did you mean --port?)",
        ),
        (
            ["demo", "--promptz", "a"],
            "usage: omni-trio demo ",
            "omni-trio demo: error: unrecognized arguments: --promptz a",
        ),
        (["--bogus", "version"], "usage: omni-trio ", "omni-trio: error: unrecognized arguments"),
    ],
)
def test_a_typo_shows_the_usage_of_the_command_it_was_given_to(
    capsys: pytest.CaptureFixture[str], argv: list[str], usage: str, error: str
) -> None:
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(usage)
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1
    assert errors[0].startswith(error)
    assert "Traceback" not in err


def test_verbose_is_accepted_after_the_subcommand_too(tmp_path: Path, cache_dir: Path) -> None:
    import logging

    parser = cli.build_parser()
    assert parser.parse_args(["generate", "x"]).verbose == 0
    assert parser.parse_args(["-v", "generate", "x"]).verbose == 1
    assert parser.parse_args(["generate", "x", "-v"]).verbose == 1
    assert parser.parse_args(["generate", "-vv", "x"]).verbose == 2
    assert parser.parse_args(["-vv", "demo"]).verbose == 2  # not reset by the subcommand
    for argv in (["demo", "-v"], ["serve", "-v"], ["fuzz", "-v"], ["version", "--verbose"]):
        assert parser.parse_args(argv).verbose == 1, argv
    logger = logging.getLogger("omni_trio")
    level = logger.level
    try:
        argv = _echo("generate", "x", "--steps", "1", "-q", "-vv", cache_dir=cache_dir)
        assert main([*argv, "-o", str(tmp_path / "o.png")]) == EXIT_OK
        assert logger.level == logging.DEBUG
    finally:
        logger.setLevel(level)


def _every_parser(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                found.extend(_every_parser(sub))
    return found


def test_no_help_shows_docstring_markup() -> None:
    import re

    parsers = _every_parser(cli.build_parser())
    names = {p.prog for p in parsers}
    assert {"omni-trio bench overhead", "omni-trio serve", "omni-trio fuzz"} <= names
    for parser in parsers:
        text = parser.format_help()
        assert "``" not in text, parser.prog
        assert not re.search(r":[a-z]+:`", text), parser.prog
    from omni_trio.bench.__main__ import main as bench_main

    for name in ("overhead", "scheduler", "quality"):
        with pytest.raises(SystemExit):
            bench_main([name, "--help"])


def test_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    def help_of(*argv: str) -> str:
        assert main([*argv, "--help"]) == EXIT_OK
        return " ".join(capsys.readouterr().out.split())  # unwrapped

    serve = help_of("serve")
    for text in (
        "independent engines behind the router (default: 1)",
        "(default: 30.0)",  # --drain-timeout
        "most images per request (n) (default: 4)",
        "(required, here or in --config)",  # --model
        "(default: inproc for one worker, tractor for more)",  # --backend
        "warm every replica up before ready (default: on)",
    ):
        assert text in serve
    generate = help_of("generate")
    for text in ("denoising steps (default: 20)", "guidance scale (default: 7.5)"):
        assert text in generate
    assert "directory (default: builtin:shapes)" in generate
    assert "(default: None)" not in generate + serve
    demo = help_of("demo")
    assert f"(default: {cli.DEMO_BASE_SEED})" in demo
    assert "grid tile size in pixels (default: 160)" in demo


# -- generate: loading phases, --backend, --workers, --config (#21) -----------------------------


def test_generate_shows_the_loading_phases_on_stderr_only(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o.png"
    argv = _echo("generate", "x", "--steps", "1", "-o", str(out), cache_dir=cache_dir)
    assert main([*argv, "--warmup"]) == EXIT_OK
    captured = capsys.readouterr()
    first = captured.err.splitlines()[0]
    assert first.startswith("loading builtin:echo: import… load… warmup… ready (")
    assert first.endswith(" s)")
    assert "loading" not in captured.out  # stdout stays the result lines
    assert captured.out.startswith(f"wrote {out}")
    assert main(argv) == EXIT_OK
    assert capsys.readouterr().err.startswith("loading builtin:echo: import… load… ready (")


def test_generate_redraws_the_loading_line_on_a_terminal(
    tmp_path: Path,
    cache_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(cli, "_is_tty", lambda stream: True)
    argv = _echo(
        "generate", "x", "--steps", "1", "-o", str(tmp_path / "o.png"), cache_dir=cache_dir
    )
    assert main(argv) == EXIT_OK
    err = capsys.readouterr().err
    assert err.startswith(
        "\rloading builtin:echo: import…\x1b[K\rloading builtin:echo: import… load…"
    )
    assert "ready (" in err.split("\n", 1)[0]


def test_generate_quiet_draws_nothing(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _echo(
        "generate", "x", "--steps", "1", "-q", "-o", str(tmp_path / "o.png"), cache_dir=cache_dir
    )
    assert main(argv) == EXIT_OK
    assert capsys.readouterr().err == ""


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_generate_reads_the_engine_table_of_a_serve_config(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The daemon's keys are allowed (the same file serves both); flags beat the file.
    config = _write(
        tmp_path / "serve.toml",
        f'port = 9000\nreplicas = 2\n[engine]\nmodel = "builtin:echo"\n'
        f'cache_dir = "{cache_dir}"\nwarmup = true\n',
    )
    out = tmp_path / "o.png"
    argv = ["generate", "x", "--config", str(config), "--steps", "2", "--seed", "4"]
    assert main([*argv, "-o", str(out)]) == EXIT_OK
    _, seed, _ = decode_echo_image(Image.open(out))  # the file's model drew it
    assert seed == 4
    assert "loading builtin:echo: import… load… warmup… ready" in capsys.readouterr().err
    assert main([*argv, "--no-warmup", "-o", str(out)]) == EXIT_OK
    assert "warmup" not in capsys.readouterr().err
    # A flag beats the file's model.
    bad = _write(tmp_path / "bad-model.toml", '[engine]\nmodel = "builtin:nosuch"\n')
    argv = _echo("generate", "x", "--config", str(bad), "--steps", "1", cache_dir=cache_dir)
    assert main([*argv, "-o", str(out)]) == EXIT_OK
    capsys.readouterr()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('[engine]\nmodle = "builtin:echo"\n', "unknown EngineConfig field(s): modle"),
        ("prot = 1\n", "unknown setting(s): prot"),
        ("[engine]\nnum_workers = 0\n", "[engine] num_workers must be a positive integer"),
        ("[engine\n", "is not valid TOML"),
    ],
)
def test_generate_a_bad_config_file_is_one_line_naming_it(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_engine: None,
    text: str,
    expected: str,
) -> None:
    config = _write(tmp_path / "bad.toml", text)
    argv = ["generate", "x", "--config", str(config), "-o", str(tmp_path / "o.png")]
    assert main(argv) == EXIT_USAGE
    message = _one_error_line(capsys.readouterr().err)
    assert expected in message
    assert "bad.toml" in message
    assert main(["generate", "x", "--config", str(tmp_path / "none.toml")]) == EXIT_USAGE
    assert "not found" in _one_error_line(capsys.readouterr().err)


def test_generate_runs_on_the_tractor_backend(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The one real run of --backend/--workers: a worker process is started and used."""
    out = tmp_path / "o.png"
    argv = _echo("generate", "x", "--backend", "tractor", "--workers", "1", cache_dir=cache_dir)
    assert main([*argv, "--steps", "1", "--seed", "3", "--threads", "1", "-o", str(out)]) == 0
    assert decode_echo_image(Image.open(out))[1] == 3
    err = capsys.readouterr().err
    assert err.startswith("loading builtin:echo: start 1 tractor worker(s)… ready (")


def test_demo_runs_on_data_parallel_workers(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--data-parallel 2 reaches the engine (two tractor worker processes, said in the
    header) and the demo runs to its grid (the split itself: tests/executors/)."""
    from omni_trio.cli import _engine_config

    args = cli.build_parser().parse_args(["demo", "--data-parallel", "2"])
    config = _engine_config(args, defaults={})
    assert (config.data_parallel_size, config.num_workers, config.backend) == (2, 2, "tractor")
    grid = tmp_path / "grid.png"
    argv = _echo(
        "demo", "--prompts", "4", "--steps", "2", "--no-warmup", "--no-previews",
        "--progress", "none", "--data-parallel", "2", "--threads", "1", "--out", str(grid),
        cache_dir=cache_dir,
    )  # fmt: skip
    assert main(argv) == EXIT_OK
    assert Image.open(grid).size[0] > 0
    assert "backend tractor x 2 data-parallel workers" in capsys.readouterr().out


# -- demo: the user's prompts (#21) ---------------------------------------------------------------


def test_demo_takes_the_users_prompts(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = _write(tmp_path / "prompts.txt", "# mine\na green frog\n\n  a tall tower  \n")
    argv = _echo(
        "demo",
        "--prompt",
        "a red kite",
        "--prompts-file",
        str(prompts),
        "--steps",
        "1",
        "--no-warmup",
        "--no-previews",
        "--progress",
        "none",
        "--out",
        str(tmp_path / "g.png"),
        cache_dir=cache_dir,
    )
    assert main(argv) == EXIT_OK
    out = capsys.readouterr().out
    assert "3 prompts" in out
    rows = [line for line in out.splitlines() if line.startswith("demo-")]
    assert [row.split("  ")[1].strip() for row in rows] == [
        "a red kite",
        "a green frog",
        "a tall tower",
    ]
    # --prompts repeats them
    assert main([*argv, "--prompts", "5"]) == EXIT_OK
    assert "5/5 completed" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text", "expected"), [(None, "cannot read prompts file"), ("\n# x\n", "holds no prompt")]
)
def test_demo_a_bad_prompts_file_is_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    no_engine: None,
    text: str | None,
    expected: str,
) -> None:
    path = tmp_path / "prompts.txt"
    if text is not None:
        path.write_text(text)
    argv = ["demo", "--model", "builtin:echo", "--prompts-file", str(path)]
    assert main([*argv, "--out", str(tmp_path / "g.png")]) == EXIT_USAGE
    assert expected in _one_error_line(capsys.readouterr().err)


def test_the_demo_prompts_are_drawn_as_asked(cache_dir: Path) -> None:
    """Each default demo prompt, at its seed, is one shape of the asked colour and kind
    (the first is also the previews strip's subject)."""
    import numpy as np
    import trio

    from omni_trio import SamplingParams, open_engine
    from omni_trio.models.shapes import COLOURS, judge

    async def render() -> dict[int, Any]:
        outputs: dict[int, Any] = {}
        config = {"torch_threads": 1, "warmup": False, "max_num_seqs": 4}
        with trio.fail_after(300):
            async with (
                open_engine(model="builtin:shapes", cache_dir=str(cache_dir), **config) as e,
                trio.open_nursery() as nursery,
            ):
                for i, prompt in enumerate(cli.DEMO_PROMPTS):

                    async def one(i: int = i, prompt: str = prompt) -> None:
                        params = SamplingParams(seed=cli.DEMO_BASE_SEED + i, output_type="pil")
                        outputs[i] = await e.generate(prompt, params)

                    nursery.start_soon(one)
        return outputs

    outputs = trio.run(render)
    for i, prompt in enumerate(cli.DEMO_PROMPTS):
        verdict = judge(np.asarray(outputs[i].images[0], dtype=np.float64) / 255.0)
        colour = next(word for word in prompt.split() if word in COLOURS)
        shape = next(word for word in prompt.split() if word in SHAPES)
        assert (verdict.colour, verdict.shape) == (colour, shape), (prompt, verdict)
        assert verdict.fit >= 0.88, (prompt, verdict)  # the old "red circle" blob: 0.87


def test_serve_with_an_unknown_model_is_one_line_before_anything_listens(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from omni_trio.serve import daemon

    def must_not_start(*args: object, **kwargs: object) -> int:
        raise AssertionError("the daemon started")

    monkeypatch.setattr(daemon, "serve_daemon", must_not_start)
    for model, says in (("nosuch", "neither a built-in"), ("org/model", "huggingface-cli")):
        assert main(["serve", "--model", model]) == EXIT_USAGE
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err, err


def test_no_cfg_parallel_lets_more_than_two_workers_be_replicas() -> None:
    args = cli.build_parser().parse_args(
        ["generate", "x", "--workers", "3", "--backend", "tractor", "--no-cfg-parallel"]
    )
    config = cli._engine_config(args, defaults={})
    assert (config.num_workers, config.cfg_parallel) == (3, False)
    args = cli.build_parser().parse_args(["generate", "x", "--workers", "3"])
    with pytest.raises(InvalidConfigError, match="cfg_parallel"):
        cli._engine_config(args, defaults={})
    default = cli.build_parser().parse_args(["generate", "x"])
    assert cli._engine_config(default, defaults={}).cfg_parallel is True


# -- the recipe in the image (#20) -------------------------------------------------------------


def test_generate_writes_the_recipe_into_each_image(tmp_path: Path, cache_dir: Path) -> None:
    out = tmp_path / "fox.png"
    prompt = "a red fox, 狐 🦊 " + "very " * 1000  # unicode and long: written, cut
    argv = _echo(
        "generate", prompt, "--steps", "3", "--seed", "5", "--size", "64x48", "-n", "2",
        "--guidance", "4.5", "--negative-prompt", "blurry", "-o", str(out), cache_dir=cache_dir,
    )  # fmt: skip
    assert main(argv) == EXIT_OK
    for index in range(2):
        image = Image.open(tmp_path / f"fox-{index}.png")
        assert decode_echo_image(image)[1:] == (5, index)  # the pixels are still the echo's
        text = image.text  # type: ignore[attr-defined]
        assert {k: v for k, v in text.items() if k not in ("prompt", "parameters")} == {
            "negative_prompt": "blurry",
            "seed": "5",  # both images come from the request's one seed...
            "steps": "3",
            "guidance_scale": "4.5",
            "size": "64x48",
            "model": "builtin:echo",
            "n": "2",
            "image_index": str(index),  # ...as its draws 0 and 1
        }
        assert text["prompt"] == prompt[:4095] + "…"  # cut at 4096 characters
        assert text["parameters"].endswith(
            "\nNegative prompt: blurry\nSteps: 3, CFG scale: 4.5, Seed: 5, Size: 64x48, "
            f'Model: "builtin:echo", Batch size: 2, Batch pos: {index}'
        )


def test_generate_no_metadata_writes_bare_images_and_jpeg_gets_a_user_comment(
    tmp_path: Path, cache_dir: Path
) -> None:
    from PIL import ExifTags

    bare = tmp_path / "bare.png"
    argv = _echo(
        "generate", "x", "--steps", "1", "--no-metadata", "-o", str(bare), cache_dir=cache_dir
    )
    assert main(argv) == EXIT_OK
    assert Image.open(bare).text == {}  # type: ignore[attr-defined]
    jpeg = tmp_path / "x.jpg"
    argv = _echo(
        "generate", "x", "--steps", "1", "--seed", "3", "-o", str(jpeg), cache_dir=cache_dir
    )
    assert main(argv) == EXIT_OK
    image = Image.open(jpeg)
    assert image.format == "JPEG"
    comment = image.getexif().get_ifd(ExifTags.IFD.Exif)[ExifTags.Base.UserComment]
    assert comment.startswith(b"UNICODE\x00")
    assert comment[8:].decode("utf-16-be").startswith("x\nSteps: 1, CFG scale: 7.5, Seed: 3, ")


def test_generate_with_a_registered_lora_writes_it_into_the_recipe(
    tmp_path: Path, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.lora_support import make_lora

    adapter = make_lora(tmp_path / "a", seed=1)
    out = tmp_path / "lora.png"
    argv = ["generate", "a red circle", "--lora", f"a={adapter}", "--use-lora", "a:0.5",
            "--steps", "4", "--seed", "2", "--threads", "1", "--cache-dir", str(cache_dir),
            "-o", str(out), "-q"]  # fmt: skip
    assert main(argv) == EXIT_OK
    capsys.readouterr()
    image = Image.open(out)
    image.load()
    text = image.text  # type: ignore[attr-defined]
    assert text["lora"] == "a:0.5"
    assert text["parameters"].startswith("a red circle <lora:a:0.5>")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora", "a=/no/such/dir"], "is not a LoRA adapter directory"),
        (["--lora", "nameonly"], "expected NAME=PATH"),
        (["--use-lora", "a:x"], "expected NAME[:SCALE]"),
        (["--use-lora", "nope"], "unknown LoRA adapter 'nope'"),
    ],
)
def test_bad_lora_flags_are_one_line(
    flags: list[str], message: str, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["generate", "x", "--steps", "2", "--threads", "1", "--cache-dir", str(cache_dir),
            "-q", *flags]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "\n".join(err)
