"""The argparse pieces every ``omni-trio`` parser is made of: unknown arguments reported by
the parser that met them, defaults and no docstring markup in ``--help``, ``-v`` after any
subcommand."""

from __future__ import annotations

import argparse

import pytest

from omni_trio._cli_args import CliParser, HelpFormatter, accept_verbose_everywhere


def _tree() -> CliParser:
    parser = CliParser(prog="tool")
    parser.add_argument("-v", "--verbose", action="count", default=0)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", description="Run ``it``; see :class:`~pkg.mod.Thing`.")
    run.add_argument("--steps", type=int, default=20, help="denoising steps")
    run.add_argument("--seed", type=int, default=None, help="random seed")
    run.add_argument("--fast", action="store_true", help="go fast")
    run.add_argument("--model", default="m", help="the model (default: m, or the file's)")
    run.add_argument("--mode", default="a", help="the mode (%(default)s)")
    nested = sub.add_parser("bench").add_subparsers(dest="experiment", required=True)
    nested.add_parser("overhead").add_argument("--repeats", type=int, default=3, help="rounds")
    own = sub.add_parser("own")
    own.add_argument("-v", dest="value", help="its own -v")
    accept_verbose_everywhere(parser)
    return parser


def test_subparsers_are_cli_parsers_with_the_help_formatter() -> None:
    parser = _tree()
    run = parser._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    assert isinstance(run, CliParser)
    assert run.formatter_class is HelpFormatter


def test_an_unknown_flag_gets_the_usage_of_its_subcommand_and_a_suggestion(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        _tree().parse_args(["run", "--stepz", "3"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: tool run ")
    assert err.endswith(
        "tool run: error: unrecognized arguments: --stepz 3 (did you mean --steps?)\n"
    )
    with pytest.raises(SystemExit):
        _tree().parse_args(["bench", "overhead", "--repeatz=2"])
    err = capsys.readouterr().err
    assert err.startswith("usage: tool bench overhead ")
    assert "(did you mean --repeats?)" in err
    with pytest.raises(SystemExit):
        _tree().parse_args(["--bogus", "run"])
    assert capsys.readouterr().err.startswith("usage: tool [-h]")


def test_help_shows_defaults_and_no_markup() -> None:
    parser = _tree()
    run = parser._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    text = " ".join(run.format_help().split())
    assert "Run it; see Thing." in text
    assert "denoising steps (default: 20)" in text
    assert "random seed --fast" in text  # None: nothing to show
    assert "go fast --model" in text  # a flag: nothing to show
    assert "the model (default: m, or the file's)" in text  # it names its default already
    assert "the mode (a)" in text


def test_verbose_counts_after_any_subcommand_without_replacing_its_own() -> None:
    parser = _tree()
    assert parser.parse_args(["run"]).verbose == 0
    assert parser.parse_args(["-vv", "run"]).verbose == 2
    assert parser.parse_args(["run", "-v"]).verbose == 1
    assert parser.parse_args(["bench", "overhead", "-vv"]).verbose == 2
    own = parser.parse_args(["own", "-v", "x"])
    assert (own.value, own.verbose) == ("x", 0)


def test_the_formatter_works_on_a_plain_parser_too() -> None:
    parser = argparse.ArgumentParser(prog="p", formatter_class=HelpFormatter)
    parser.add_argument("--n", type=int, default=5, help="``n`` things")
    assert "n things (default: 5)" in " ".join(parser.format_help().split())


def test_an_output_path_pillow_cannot_write_is_refused_before_anything_renders() -> None:
    import argparse

    import pytest

    from omni_trio._cli_args import image_path

    assert image_path("out.png") == "out.png"
    assert image_path("pic.JPG") == "pic.JPG"
    assert image_path("noext") == "noext"  # PNG
    with pytest.raises(argparse.ArgumentTypeError, match=r"cannot write images as '\.xyz'"):
        image_path("out.xyz")
