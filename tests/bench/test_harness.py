"""The bench harness's pure helpers: summaries, interleaving, output, the command line."""

from __future__ import annotations

import argparse
import io
import json
import math
from pathlib import Path

import pytest

from omni_trio.bench import add_bench_parser, configure_parser
from omni_trio.bench.__main__ import main as bench_main
from omni_trio.bench.harness import (
    Progress,
    Report,
    Summary,
    command_line,
    format_table,
    machine_info,
    pair_differences,
    pair_ratios,
    percentile,
    run_in_trio,
    run_interleaved,
    run_interleaved_async,
)

# -- summaries ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("samples", "q", "expected"),
    [
        ([5.0], 0, 5.0),
        ([5.0], 99, 5.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([4.0, 1.0, 3.0, 2.0], 0, 1.0),
        ([4.0, 1.0, 3.0, 2.0], 100, 4.0),
        (list(map(float, range(1, 11))), 90, 9.1),
    ],
)
def test_percentile_interpolates_linearly(samples: list[float], q: float, expected: float) -> None:
    assert percentile(samples, q) == pytest.approx(expected)


def test_percentile_matches_numpy() -> None:
    np = pytest.importorskip("numpy")
    data = [0.3, 7.1, 2.2, 9.9, 4.4, 4.4, 1.0, 8.5, 6.0]
    for q in (0, 10, 25, 50, 90, 99, 100):
        assert percentile(data, q) == pytest.approx(float(np.percentile(data, q)))


def test_percentile_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="no samples"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"0\.\.100"):
        percentile([1.0], 101)


def test_summary_of_samples() -> None:
    s = Summary.of([3.0, 1.0, 2.0, 10.0])
    assert (s.n, s.min, s.median, s.max, s.mean) == (4, 1.0, 2.5, 10.0, 4.0)
    assert s.p50 == s.median
    assert s.min <= s.p90 <= s.p99 <= s.max
    ms = s.scaled(1000.0)
    assert (ms.min, ms.max, ms.n) == (1000.0, 10000.0, 4)
    assert s.spread("{:.1f}") == "1.0 / 2.5 / 10.0"
    assert s.tail("{:.0f}").count(" / ") == 2
    assert set(s.to_dict()) == {"n", "min", "median", "max", "mean", "p50", "p90", "p99"}


def test_summary_of_nothing_raises() -> None:
    with pytest.raises(ValueError, match="zero samples"):
        Summary.of([])


def test_pairwise_ratios_and_differences() -> None:
    assert pair_ratios([2.0, 3.0, 1.0], [1.0, 2.0, 0.0]) == [2.0, 1.5]  # b == 0 skipped
    assert pair_differences([2.0, 3.0], [1.5, 1.0]) == [0.5, 2.0]
    with pytest.raises(ValueError, match="unpaired"):
        pair_ratios([1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="unpaired"):
        pair_differences([1.0, 2.0], [1.0])


# -- interleaving ------------------------------------------------------------------------


def test_run_interleaved_alternates_variants_after_warmup() -> None:
    calls: list[str] = []
    rounds_done: list[int] = []

    def variant(name: str) -> object:
        def call() -> str:
            calls.append(name)
            return f"{name}{len(calls)}"

        return call

    rounds = run_interleaved(
        [variant("A"), variant("B")],  # type: ignore[list-item]
        repeats=3,
        warmup=1,
        on_round=lambda: rounds_done.append(len(calls)),
    )
    assert calls == ["A", "B"] * 4
    assert rounds == [["A3", "B4"], ["A5", "B6"], ["A7", "B8"]]  # warmup results dropped
    assert rounds_done == [4, 6, 8]
    with pytest.raises(ValueError, match="repeats"):
        run_interleaved([lambda: 1], repeats=0)


async def test_run_interleaved_async_alternates_variants() -> None:
    calls: list[str] = []

    async def a() -> str:
        calls.append("A")
        return "a"

    async def b() -> str:
        calls.append("B")
        return "b"

    rounds = await run_interleaved_async([a, b], repeats=2, warmup=2)
    assert calls == ["A", "B"] * 4
    assert rounds == [["a", "b"], ["a", "b"]]


# -- output ------------------------------------------------------------------------------


def test_format_table_aligns_columns_in_order() -> None:
    text = format_table([{"b": 1, "a": 2.123456}, {"a": "x", "b": 22}], columns=["a", "b"])
    lines = text.splitlines()
    assert lines[0].split("|")[1].strip() == "a"
    assert lines[2].split("|")[1].strip() == "2.123"  # floats get 4 significant digits
    assert len({len(line) for line in lines}) == 1
    assert format_table([]) == "(no results)"


def test_report_json_has_the_machine_command_and_figures(tmp_path: Path) -> None:
    report = Report(
        experiment="demo",
        command="omni-trio bench demo --quick",
        params={"model": "builtin:echo", "steps": 2},
        machine={"cores": 2, "torch_threads": 1, "device": "cpu"},
        results={"latency": Summary.of([1.0, 2.0]), "bad": math.inf, "tuple": (1, 2)},
        rows=[{"x": 1}],
        notes=["a note"],
    )
    target = tmp_path / "sub" / "out.json"
    report.write_json(target)
    data = json.loads(target.read_text())
    assert data["experiment"] == "demo"
    assert data["command"] == "omni-trio bench demo --quick"
    assert data["machine"] == {"cores": 2, "torch_threads": 1, "device": "cpu"}
    assert data["params"]["steps"] == 2
    assert data["results"]["latency"]["median"] == 1.5
    assert data["results"]["bad"] is None
    assert data["results"]["tuple"] == [1, 2]
    assert data["notes"] == ["a note"]
    assert {"schema", "started_at", "duration_s", "rows"} <= set(data)
    rendered = report.render()
    assert "$ omni-trio bench demo --quick" in rendered
    assert "note: a note" in rendered


def test_machine_info_names_cores_threads_and_device() -> None:
    info = machine_info(torch_threads=3, device="cpu")
    assert info["cores"] >= 1
    assert info["torch_threads"] == 3
    assert info["device"] == "cpu"
    assert info["torch"]
    json.dumps(info)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["/venv/bin/omni-trio", "bench", "overhead"], "omni-trio bench overhead"),
        (
            ["/src/omni_trio/bench/__main__.py", "scheduler", "--json", "a b.json"],
            "python -m omni_trio.bench scheduler --json 'a b.json'",
        ),
        ([], ""),
    ],
)
def test_command_line_is_retypeable(argv: list[str], expected: str) -> None:
    assert command_line(argv) == expected


def test_progress_draws_only_on_a_terminal() -> None:
    quiet = io.StringIO()
    with Progress(3, "x", stream=quiet) as bar:
        bar.advance()
    assert quiet.getvalue() == ""

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    with Progress(2, "work", stream=tty) as bar:
        bar.advance()
        bar.advance()
        assert bar.done == 2
        assert "2/2" in bar.line()
    assert "work [" in tty.getvalue()
    disabled = Tty()
    with Progress(2, "work", stream=disabled, enabled=False) as bar:
        bar.advance()
    assert disabled.getvalue() == ""


# -- command line ------------------------------------------------------------------------


def test_add_bench_parser_registers_every_experiment_with_func() -> None:
    parser = argparse.ArgumentParser(prog="omni-trio")
    sub = parser.add_subparsers(dest="command")
    add_bench_parser(sub)
    for experiment in ("overhead", "throughput", "scheduler"):
        args = parser.parse_args(["bench", experiment, "--quick", "--json", "x.json"])
        assert args.experiment == experiment
        assert args.quick and args.json == "x.json"
        assert callable(args.func)
    args = parser.parse_args(["bench", "throughput", "--max-num-seqs", "1,16", "--mode", "step"])
    assert args.max_num_seqs == (1, 16)
    assert args.mode == ("step",)
    args = parser.parse_args(["bench", "scheduler", "--queue-lengths", "10,100_000"])
    assert args.queue_lengths == (10, 100_000)


@pytest.mark.parametrize(
    "argv",
    [
        ["bench"],
        ["bench", "nope"],
        ["bench", "throughput", "--max-num-seqs", "0"],
        ["bench", "scheduler", "--modes", "fast"],
        ["bench", "overhead", "--echo-max-num-seqs", "a"],
    ],
)
def test_bad_bench_arguments_are_usage_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser(prog="omni-trio")
    add_bench_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit) as info:
        parser.parse_args(argv)
    assert info.value.code == 2
    capsys.readouterr()


def test_python_dash_m_entry_has_the_same_experiments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        bench_main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for experiment in ("overhead", "throughput", "scheduler"):
        assert experiment in out
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    assert parser.parse_args(["scheduler"]).experiment == "scheduler"


def test_run_in_trio_runs_the_experiment_and_records_machine_load_and_duration() -> None:
    import trio

    async def main(args: dict[str, int], report: Report) -> None:
        await trio.lowlevel.checkpoint()
        report.results["seen"] = args["x"]

    report = Report(experiment="probe", command="omni-trio bench probe")
    assert run_in_trio(report, main, {"x": 7}, torch_threads=3) is report
    assert report.results == {"seen": 7}
    assert report.machine["torch_threads"] == 3 and "load_average_1m" in report.machine
    assert report.duration_s > 0
