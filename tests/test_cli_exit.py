"""How a command ends: expected failures become one-line errors with the right exit code."""

from __future__ import annotations

import argparse

import pytest

from omni_trio._cli_args import finite_float, nonneg_int, positive_int, size_arg
from omni_trio._cli_exit import (
    EXIT_FAILED,
    EXIT_USAGE,
    CliError,
    classify,
    run_command,
    walk_exceptions,
)
from omni_trio.errors import EngineDeadError, InvalidConfigError, RequestFailedError


def test_classify_maps_errors_to_exit_codes() -> None:
    usage = classify(InvalidConfigError("bad", field="model"))
    assert usage is not None and usage.code == EXIT_USAGE
    failed = classify(RequestFailedError("r", "boom", "ValueError"))
    assert failed is not None and failed.code == EXIT_FAILED
    # found inside exception groups and cause chains too
    group = BaseExceptionGroup("wrapped", [RuntimeError("x"), EngineDeadError("gone")])
    dead = classify(group)
    assert dead is not None and (dead.code, str(dead)) == (EXIT_FAILED, "gone")
    warmup = RuntimeError("engine warmup failed: oops")
    warmup.__cause__ = InvalidConfigError("cannot batch", field="max_num_seqs")
    caused = classify(warmup)
    assert caused is not None and caused.code == EXIT_USAGE
    assert classify(KeyError("a bug")) is None


def test_run_command_prints_one_line_and_reraises_bugs(capsys: pytest.CaptureFixture[str]) -> None:
    def refused() -> int:
        raise CliError("no such file", EXIT_USAGE)

    assert run_command(refused) == EXIT_USAGE
    assert capsys.readouterr().err == "omni-trio: error: no such file\n"

    def bug() -> int:
        raise KeyError("a bug")

    with pytest.raises(KeyError):
        run_command(bug)


def test_walk_exceptions_sees_groups_causes_and_optionally_contexts() -> None:
    inner = ValueError("inner")
    outer = RuntimeError("outer")
    outer.__context__ = inner
    group = BaseExceptionGroup("g", [outer])
    assert walk_exceptions(group) == [group, outer]
    assert walk_exceptions(group, contexts=True) == [group, outer, inner]


def test_argument_types_name_what_they_expected() -> None:
    assert (positive_int("3"), nonneg_int("0"), finite_float("1.5")) == (3, 0, 1.5)
    assert size_arg("64x32") == (64, 32)
    for parse, text in [(positive_int, "0"), (nonneg_int, "-1"), (finite_float, "inf")]:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)
