"""``omni_trio.extensions`` and each extension point on a real in-process engine, through the
worked examples of docs/extending.md (``tests/extension_examples.py``, run here; every Python
block of the doc is a verbatim part of that module).  The same hooks with worker processes:
``tests/test_extensions_workers.py``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import trio

from omni_trio import EngineConfig, InvalidConfigError, SamplingParams, WorkerError, open_engine
from omni_trio._core.messages import BatchRunnerOutput, SchedulerOutput
from omni_trio.extensions import (
    PROCESS_BACKENDS,
    WORKER_EXTENSION_FIELDS,
    RequestScheduler,
    StepScheduler,
    check_extensions,
    scheduler_class,
    wire_extensions,
)
from tests import extension_examples
from tests.extension_examples import CountingRunner, InspectExtension, RecordingScheduler

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "extending.md"
CAP_S = 30.0


# -- the module ------------------------------------------------------------------------------


def test_the_scheduler_bases_are_the_cores() -> None:
    from omni_trio._core import scheduler

    assert RequestScheduler is scheduler.RequestScheduler
    assert StepScheduler is scheduler.StepScheduler


def test_scheduler_class_by_mode() -> None:
    assert scheduler_class(None, step_execution=False) is None
    assert scheduler_class(RecordingScheduler, step_execution=False) is RecordingScheduler
    path = "tests.extension_examples:RecordingScheduler"
    assert scheduler_class(path, step_execution=False) is RecordingScheduler
    assert scheduler_class(StepScheduler, step_execution=True) is StepScheduler
    with pytest.raises(InvalidConfigError, match="in step mode"):
        scheduler_class(RecordingScheduler, step_execution=True)


def test_check_extensions_checks_portability_for_process_backends_only() -> None:
    local = type("Local", (), {"__qualname__": "f.<locals>.Local", "__module__": __name__})
    fields: dict[str, Any] = {"scheduler_cls": None, "step_execution": False}
    for name in WORKER_EXTENSION_FIELDS:
        others = {n: None for n in WORKER_EXTENSION_FIELDS if n != name}
        check_extensions(**fields, **others, **{name: local}, backend="inproc")
        check_extensions(**fields, **others, **{name: local}, backend="tests.fakes:X")
        for backend in PROCESS_BACKENDS:
            with pytest.raises(InvalidConfigError, match="inside a function"):
                check_extensions(**fields, **others, **{name: local}, backend=backend)


def test_wire_extensions_sends_paths_and_no_scheduler() -> None:
    data = {
        "runner_cls": CountingRunner,
        "worker_extension_cls": None,
        "scheduler_cls": RecordingScheduler,
        "model": "m",
    }
    assert wire_extensions(data) == {
        "runner_cls": "tests.extension_examples:CountingRunner",
        "worker_extension_cls": None,
        "scheduler_cls": None,
        "model": "m",
    }
    local = type("Local", (), {"__qualname__": "f.<locals>.Local"})
    with pytest.raises(InvalidConfigError, match="inside a function") as failed:
        wire_extensions({"worker_extension_cls": local})  # a custom process backend's case
    assert failed.value.field == "worker_extension_cls"


# -- the docs' examples ----------------------------------------------------------------------


def doc_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", DOC.read_text("utf-8"), flags=re.S | re.M)


def test_every_python_block_of_the_doc_is_in_the_examples_module() -> None:
    source = Path(extension_examples.__file__).read_text("utf-8")
    blocks = doc_blocks()
    assert len(blocks) == 4, "one worked example per extension point"
    for block in blocks:
        assert block in source, f"docs/extending.md block not in the examples module:\n{block}"


async def test_the_scheduler_example_runs() -> None:
    with trio.fail_after(CAP_S):
        waves = await extension_examples.scheduler_example()
    assert waves == [("a", "b")]  # both admitted before the loop ran: one wave


async def test_the_runner_and_extension_example_runs() -> None:
    with trio.fail_after(CAP_S):
        replies = await extension_examples.runner_and_extension_example()
    [reply] = replies  # one per rank: the inproc backend has one
    assert reply["rank"] == 0 and reply["runner"] == "CountingRunner"
    assert reply["forwards"] == 1 and reply["calls"] == 1
    assert reply["model"] == "builtin:echo"


async def test_the_factory_example_runs() -> None:
    with trio.fail_after(CAP_S):
        assert await extension_examples.factory_example() == "echo-by-factory"


# -- each hook on an in-process engine -------------------------------------------------------

SMALL = SamplingParams(height=32, width=32, num_inference_steps=3, seed=5)


class TickCounter(StepScheduler):
    """A step-mode scheduler that counts its ticks and what each reported back."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ticks = 0
        self.updates: list[tuple[str, ...]] = []

    def schedule(self, now: float) -> SchedulerOutput:
        out = super().schedule(now)
        self.ticks += 1
        return out

    def update_from_output(
        self, scheduler_output: SchedulerOutput, result: BatchRunnerOutput, now: float
    ) -> list[str]:
        self.updates.append(tuple(sorted(result.outputs)))
        return super().update_from_output(scheduler_output, result, now)


async def test_a_step_scheduler_subclass_runs_every_tick() -> None:
    config = EngineConfig(step_execution=True, warmup=False, scheduler_cls=TickCounter)
    with trio.fail_after(CAP_S):
        async with open_engine(config) as engine:
            out = await engine.generate("p", SMALL, request_id="r")
            scheduler = engine.scheduler
    assert out.ok
    assert isinstance(scheduler, TickCounter)
    assert scheduler.updates == [("r",)] * 3  # one step per tick, 3 steps
    assert scheduler.ticks >= 3


async def test_the_engine_uses_the_configured_classes_by_path_too() -> None:
    config = EngineConfig(
        model="tests.extension_examples:echo_factory",
        warmup=False,
        scheduler_cls="tests.extension_examples:RecordingScheduler",
        runner_cls="tests.extension_examples:CountingRunner",
        worker_extension_cls=InspectExtension,
    )
    with trio.fail_after(CAP_S):
        async with open_engine(config) as engine:
            await engine.generate("p", SMALL, request_id="x")
            one = await engine.collective_rpc("inspect")  # unique_reply_rank=0: the value
            every = await engine.collective_rpc("inspect", unique_reply_rank=None)
            scheduler = engine.scheduler
    assert isinstance(scheduler, RecordingScheduler) and list(scheduler.waves) == [("x",)]
    assert one["model"] == "echo-by-factory" and one["runner"] == "CountingRunner"
    assert one["forwards"] == 1 and one["calls"] == 1
    assert [r["calls"] for r in every] == [2]


async def test_extension_errors_are_boxed_like_builtin_calls() -> None:
    config = EngineConfig(warmup=False, worker_extension_cls=InspectExtension)
    with trio.fail_after(CAP_S):
        async with open_engine(config) as engine:
            with pytest.raises(WorkerError, match="boom") as failed:
                await engine.collective_rpc("fail", "boom")
            with pytest.raises(AttributeError, match="no RPC method '_helper'"):
                await engine.collective_rpc("_helper")
            with pytest.raises(AttributeError, match="no RPC method 'nope'"):
                await engine.collective_rpc("nope")  # unknown names raise as before
            engine.check_health()  # a failed RPC is the caller's, not the group's
            assert (await engine.generate("p", SMALL)).ok
    assert failed.value.error_type == "RuntimeError" and failed.value.worker == 0


async def test_an_extension_overriding_a_builtin_is_refused_at_open() -> None:
    class Clashing:
        def __init__(self, worker: Any) -> None:
            pass

        def leftovers(self) -> dict[str, Any]:
            return {}

    config = EngineConfig(warmup=False, worker_extension_cls=Clashing)
    with trio.fail_after(CAP_S), pytest.raises(InvalidConfigError, match="may not override"):
        async with open_engine(config):
            pass


async def test_a_bad_factory_fails_the_open_naming_the_model() -> None:
    config = EngineConfig(model="tests.extension_examples:SMALL", warmup=False)
    with trio.fail_after(CAP_S), pytest.raises(InvalidConfigError, match="not a callable"):
        async with open_engine(config):
            pass
