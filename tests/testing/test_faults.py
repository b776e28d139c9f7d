"""The public fault toolkit: ``with_faults``, the docs table, and faults through an engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

import omni_trio.testing.faults as toolkit
from omni_trio import EngineConfig, RequestFailedError, SamplingParams, open_engine
from omni_trio.models.echo import decode_echo_image
from omni_trio.testing.faults import (
    FAULT_DOCS,
    PROCESS_ONLY_FAULTS,
    Fault,
    FaultSpec,
    parse_faults,
    with_faults,
)

CAP_S = 30.0


def test_with_faults_appends_plain_dicts_and_leaves_the_params_alone() -> None:
    params = SamplingParams(seed=1, extra_args={"echo_step_delay_s": 0.0})
    one = with_faults(params, FaultSpec(Fault.RAISE_AT_STEP, step=2))
    two = with_faults(
        one,
        Fault.FAIL_PACKING,
        "fail_packing",
        {"kind": "slow_packing", "delay_s": 1, "rank": 0},
    )
    assert params.extra_args == {"echo_step_delay_s": 0.0}
    assert one.extra_args == {
        "echo_step_delay_s": 0.0,
        "faults": [{"kind": "raise_at_step", "step": 2}],
    }
    assert two.extra_args["faults"] == [
        {"kind": "raise_at_step", "step": 2},
        {"kind": "fail_packing"},
        {"kind": "fail_packing"},
        {"kind": "slow_packing", "delay_s": 1.0, "rank": 0},
    ]
    assert all(type(entry["kind"]) is str for entry in two.extra_args["faults"])
    assert parse_faults(two.extra_args)[3] == FaultSpec(Fault.SLOW_PACKING, delay_s=1.0, rank=0)
    assert two.seed == 1
    assert with_faults(params).extra_args == {"echo_step_delay_s": 0.0, "faults": []}


@pytest.mark.parametrize(
    ("fault", "match"),
    [
        (Fault.RAISE_AT_STEP, "needs a 'step'"),
        (Fault.FAIL_WARMUP, "not a per-request fault"),
        ("explode", "unknown fault kind 'explode'"),
        ({"kind": "slow_packing", "delay_s": -1}, "delay_s must be"),
    ],
)
def test_with_faults_rejects_bad_faults(fault: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        with_faults(SamplingParams(), fault)  # type: ignore[arg-type]


def test_with_faults_revalidates_existing_entries() -> None:
    params = SamplingParams(extra_args={"faults": [{"kind": "nope"}]})
    with pytest.raises(ValueError, match=r"\[0\].*unknown fault kind 'nope'"):
        with_faults(params, Fault.FAIL_PACKING)


def test_docs_cover_every_fault() -> None:
    assert set(FAULT_DOCS) == set(Fault)
    assert all(doc and "\n" not in doc for doc in FAULT_DOCS.values())
    table = toolkit.__doc__ or ""
    for fault in Fault:
        assert f"\n{fault.value} " in table, fault
    assert set(PROCESS_ONLY_FAULTS) == {
        Fault.CRASH_AT_STEP,
        Fault.SIGKILL_AT_STEP,
        Fault.HANG_AT_STEP,
    }


def test_the_toolkit_exports_what_it_lists() -> None:
    for name in toolkit.__all__:
        assert getattr(toolkit, name) is not None, name
    assert toolkit.WorkerCrashInjected.__mro__[1] is toolkit.WorkerFatalError


async def test_an_engine_fails_only_the_faulted_request(cache_dir: Path) -> None:
    config = EngineConfig(
        model="builtin:echo",
        cache_dir=str(cache_dir),
        torch_threads=1,
        fault_injection=True,
        warmup=False,
    )
    base = SamplingParams(height=32, width=32, num_inference_steps=3, seed=5, output_type="np")
    with trio.fail_after(CAP_S):
        async with open_engine(config) as engine:
            faulted = with_faults(base, FaultSpec(Fault.RAISE_AT_STEP, step=1))
            with pytest.raises(RequestFailedError) as info:
                await engine.generate("p", faulted, request_id="faulted")
            assert info.value.error_type == "FaultInjectedError"
            assert "raise_at_step at step 1" in str(info.value)
            output = await engine.generate("p", base, request_id="normal")
            assert decode_echo_image(output.images[0]) == ("normal", 5, 0)
