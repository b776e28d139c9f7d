"""``bench fuzz-power``: a real campaign per mutant in a fresh process, scored from the
reproducer it writes; a researcher's own mutant by ``module:attribute``; the listing; bad
names are usage errors before any campaign runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from omni_trio._core.request import MAX_SEED
from omni_trio.bench import add_bench_parser, run_bench
from omni_trio.bench.fuzz_power import _rule_count
from omni_trio.testing.mutants import MUTANTS, Mutant, Patcher

pytestmark = pytest.mark.slow  # starts campaign processes


def _max_seed_off_by_one(patcher: Patcher) -> None:
    """A researcher's own planted bug: admission clamps seeds to ``MAX_SEED - 1``."""
    from omni_trio._core import engine_core

    real = engine_core._resolve_defaults

    def clamped(request: Any, *args: Any) -> Any:
        if request.sampling.seed == MAX_SEED:
            request = request.replace(sampling=request.sampling.replace(seed=MAX_SEED - 1))
        return real(request, *args)

    patcher.setattr(engine_core, "_resolve_defaults", clamped)


#: Found by module path: ``tests.bench.test_fuzz_power:CLAMPED_SEED``.
CLAMPED_SEED = Mutant(
    name="max-seed-clamped",
    invariant="INV-5",
    summary="admission clamps an explicit seed of 2**63-1 to one less",
    patch=_max_seed_off_by_one,
)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-trio")
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser


def _run(argv: list[str], tmp_path: Path) -> tuple[int, dict[str, Any]]:
    target = tmp_path / "power.json"
    lines: list[str] = []
    code = run_bench(_parser().parse_args([*argv, "--json", str(target)]), out=lines.append)
    data = json.loads(target.read_text()) if target.exists() else {}
    return code, data


def test_the_listing_names_every_shipped_mutant(tmp_path: Path) -> None:
    code, data = _run(["bench", "fuzz-power", "--list"], tmp_path)
    assert code == 0
    assert [row["mutant"] for row in data["rows"]] == [m.name for m in MUTANTS]
    assert all(row["invariant"].startswith("INV-") for row in data["rows"])


def test_a_shipped_and_a_researchers_mutant_are_found_and_the_control_is_clean(
    tmp_path: Path, cache_dir: Path
) -> None:
    argv = [
        "bench", "fuzz-power", "--no-progress",
        "--mutant", "seed-zero-random",
        "--mutant", "tests.bench.test_fuzz_power:CLAMPED_SEED",
        "--budget", "20", "--shrink-limit", "5", "--seed", "1",
        "--cache-dir", str(cache_dir), "--out", str(tmp_path / "runs"),
    ]  # fmt: skip
    code, data = _run(argv, tmp_path)
    assert code == 0
    rows = {row["mutant"]: row for row in data["rows"]}
    control = rows.pop("(control: no mutant)")  # both mutants run with the defaults
    assert control["found"] == "no"  # the real runtime: no false alarm
    assert set(rows) == {"seed-zero-random", "max-seed-clamped"}
    for row in rows.values():
        assert row["found"] == "yes", row
        assert 0 < row["first failure s"] <= 20
        assert row["rules"] >= 1 and "INV-5" in row["caught as"]
        assert row["as planted"] == "yes"
    assert data["results"]["found"] == 2 and data["results"]["mutants"] == 2
    assert data["results"]["control_clean"] is True
    # Each campaign left its reproducer, which names the mutant it ran against.
    for name in ("seed-zero-random", "tests.bench.test_fuzz_power_CLAMPED_SEED"):
        (record,) = (tmp_path / "runs" / name).glob("*/reproducer.json")
        assert json.loads(record.read_text())["mutant"] is not None


def test_an_unknown_mutant_is_a_usage_error_before_any_campaign(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, data = _run(["bench", "fuzz-power", "--mutant", "no-such-bug"], tmp_path)
    assert code == 2 and data == {}
    err = capsys.readouterr().err
    assert "no-such-bug" in err and len(err.strip().splitlines()) == 1


def test_the_rule_count_leaves_out_the_machine_and_its_checks() -> None:
    steps = [
        "state = EngineMachine_inproc_request()",
        "state.no_violation_so_far()",
        "requests_0 = state.submit(seed=0)",
        "state.no_violation_so_far()",
        "state.abort(rid=requests_0)",
        "state.teardown()",
    ]
    assert _rule_count(steps) == 2
