"""``bench sleep``: a complete ``--quick`` report on a real tractor worker (builtin:shapes),
and the memory reading.  No figure is asserted but what the run must show: weights released,
the picture after the wake the one before."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from omni_trio.bench import add_bench_parser, run_bench
from omni_trio.bench.sleep import memory_mib

pytestmark = pytest.mark.slow  # starts a worker process


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-trio")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser


def test_memory_of_this_process_and_of_none() -> None:
    rss, pss = memory_mib(os.getpid())
    assert rss is not None and pss is not None and rss > 1 and pss > 1
    assert memory_mib(2**22 + 7) == (None, None)  # no such process


def test_a_quick_run_gives_a_complete_report(tmp_path: Path, cache_dir: Path) -> None:
    target = tmp_path / "sleep.json"
    argv = [
        "bench", "sleep", "--quick", "--no-progress", "--json", str(target),
        "--steps", "2", "--cache-dir", str(cache_dir), "--sleep-dir", str(tmp_path / "s"),
    ]  # fmt: skip
    lines: list[str] = []
    assert run_bench(_parser().parse_args(argv), out=lines.append) == 0
    data = json.loads(target.read_text())
    assert [(row["level"], row["same_image"]) for row in data["rows"]] == [(1, True), (2, True)]
    for level in (1, 2):
        result = data["results"][f"level{level}"]
        assert result["released_mib"] > 5  # the UNet and the text encoder of builtin:shapes
        assert result["all_same_image"] is True
        assert result["wake_s_median"] > 0
    assert list((tmp_path / "s").iterdir()) == []  # level 1's private file is gone
