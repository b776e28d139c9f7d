"""Fault specs: the pure half of fault injection (what a request may ask for, validated)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from omni_trio._core.faults import (
    DELAY_FAULTS,
    STEP_FAULTS,
    WARMUP_REQUEST_ID,
    Fault,
    FaultSpec,
    parse_faults,
)
from omni_trio.runtime.engine import WARMUP_REQUEST_ID as ENGINE_WARMUP_REQUEST_ID

# -- parsing --------------------------------------------------------------------------------


def test_no_faults_key_means_no_faults() -> None:
    assert parse_faults({}) == ()
    assert parse_faults({"echo_fail_at_step": 1}) == ()


def test_parse_every_kind_and_round_trip() -> None:
    entries: list[dict[str, Any]] = [
        {"kind": "raise_at_step", "step": 0},
        {"kind": "crash_at_step", "step": 3, "rank": 1},
        {"kind": "sigkill_at_step", "step": 2},
        {"kind": "hang_at_step", "step": 1},
        {"kind": "slow_packing", "delay_s": 1},
        {"kind": "fail_packing"},
        {"kind": "delay_compute_done", "delay_s": 0.25},
        {"kind": "delay_output_ready", "delay_s": 0.0},
    ]
    specs = parse_faults({"faults": entries})
    assert [s.kind for s in specs] == [Fault(e["kind"]) for e in entries]
    assert specs[1] == FaultSpec(Fault.CRASH_AT_STEP, step=3, rank=1)
    assert specs[4].delay_s == 1.0 and isinstance(specs[4].delay_s, float)
    assert [s.to_dict() for s in specs][:4] == entries[:4]
    assert all(FaultSpec.from_dict(s.to_dict()) == s for s in specs)
    # FaultSpecs and tuples are accepted too; kinds may be given as values.
    assert parse_faults({"faults": (specs[0], {"kind": Fault.FAIL_PACKING})}) == (
        specs[0],
        FaultSpec(Fault.FAIL_PACKING),
    )
    assert FaultSpec("fail_packing") == FaultSpec(Fault.FAIL_PACKING)  # type: ignore[arg-type]


def test_every_kind_is_classified() -> None:
    takes_nothing = {Fault.FAIL_PACKING, Fault.KILL_PACKER, Fault.FAIL_WARMUP}
    assert set(Fault) == STEP_FAULTS | DELAY_FAULTS | takes_nothing
    assert not STEP_FAULTS & DELAY_FAULTS


@pytest.mark.parametrize(
    ("faults", "match"),
    [
        ({"kind": "raise_at_step", "step": 1}, "must be a list of fault dicts, got dict"),
        ("raise_at_step", "must be a list of fault dicts, got str"),
        ([3], r"\[0\] \(3\): a fault must be a dict, got int"),
        ([{"step": 1}], r"\[0\].*needs a 'kind'"),
        ([{"kind": "explode"}], r"\[0\].*unknown fault kind 'explode' \(known: raise_at_step"),
        ([{"kind": "fail_packing"}, {"kind": 7}], r"\[1\].*unknown fault kind 7"),
        ([{"kind": "raise_at_step"}], r"raise_at_step needs a 'step'"),
        ([{"kind": "crash_at_step"}], r"crash_at_step needs a 'step'"),
        ([{"kind": "sigkill_at_step"}], r"sigkill_at_step needs a 'step'"),
        ([{"kind": "hang_at_step"}], r"hang_at_step needs a 'step'"),
        ([{"kind": "raise_at_step", "step": -1}], "step must be an integer >= 0, got -1"),
        ([{"kind": "raise_at_step", "step": 1.0}], "step must be an integer >= 0, got 1.0"),
        ([{"kind": "raise_at_step", "step": True}], "step must be an integer >= 0, got True"),
        ([{"kind": "raise_at_step", "step": "2"}], "step must be an integer >= 0, got '2'"),
        ([{"kind": "fail_packing", "step": 1}], "fail_packing takes no 'step'"),
        ([{"kind": "slow_packing", "step": 1, "delay_s": 1}], "slow_packing takes no 'step'"),
        ([{"kind": "slow_packing"}], "slow_packing needs a 'delay_s'"),
        ([{"kind": "delay_compute_done"}], "delay_compute_done needs a 'delay_s'"),
        ([{"kind": "delay_output_ready"}], "delay_output_ready needs a 'delay_s'"),
        ([{"kind": "slow_packing", "delay_s": -0.5}], "delay_s must be a finite number >= 0"),
        ([{"kind": "slow_packing", "delay_s": math.inf}], "delay_s must be a finite number"),
        ([{"kind": "slow_packing", "delay_s": math.nan}], "delay_s must be a finite number"),
        ([{"kind": "slow_packing", "delay_s": "1"}], "delay_s must be a finite number"),
        ([{"kind": "slow_packing", "delay_s": False}], "delay_s must be a finite number"),
        ([{"kind": "raise_at_step", "step": 1, "delay_s": 1}], "raise_at_step takes no 'delay_s'"),
        ([{"kind": "fail_packing", "rank": -1}], "rank must be an integer >= 0, got -1"),
        ([{"kind": "fail_packing", "rank": "0"}], "rank must be an integer >= 0, got '0'"),
        ([{"kind": "fail_packing", "when": 1}], r"unknown fault field\(s\) when"),
        ([{"kind": "fail_warmup"}], "fail_warmup is not a per-request fault.*fault_fail_warmup"),
    ],
)
def test_bad_faults_raise_value_error_naming_the_entry(faults: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        parse_faults({"faults": faults})
    assert "extra_args['faults']" in str(info.value)


def test_warmup_id_is_the_engines() -> None:
    assert WARMUP_REQUEST_ID == ENGINE_WARMUP_REQUEST_ID
