"""The worked examples of docs/extending.md, one per extension point.

Each ```` ```python ```` block of docs/extending.md is a verbatim part of this module
(``tests/test_extensions.py`` checks it and runs every example).  They live in a module, not
only in the docs, so that their import paths (``"tests.extension_examples:CountingRunner"``)
resolve in worker processes too.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from omni_trio import EngineConfig, SamplingParams, open_engine
from omni_trio.errors import InvalidConfigError
from omni_trio.extensions import RequestScheduler
from omni_trio.models import DiffusionModel
from omni_trio.models.echo import EchoModel
from omni_trio.worker.runner import ModelRunner

if TYPE_CHECKING:
    import torch

    from omni_trio._core.messages import BatchRunnerOutput, SchedulerOutput
    from omni_trio._core.request import DiffusionRequest
    from omni_trio.worker.runner import ForwardedBatch
    from omni_trio.worker.worker import Worker

SMALL = SamplingParams(height=32, width=32, num_inference_steps=2, seed=1)


# -- scheduler ------------------------------------------------------------------------------


class RecordingScheduler(RequestScheduler):
    """Schedules exactly as the built-in request scheduler and records the last waves."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waves: deque[tuple[str, ...]] = deque(maxlen=100)  # ids only, bounded

    def schedule(self, now: float) -> SchedulerOutput:
        out = super().schedule(now)
        if out.scheduled_new_reqs:
            self.waves.append(out.scheduled_request_ids)
        return out


async def scheduler_example() -> list[tuple[str, ...]]:
    config = EngineConfig(
        model="builtin:echo", max_num_seqs=2, warmup=False, scheduler_cls=RecordingScheduler
    )
    async with open_engine(config) as engine:
        streams = [engine.stream("p", SMALL, request_id=rid) for rid in ("a", "b")]
        for stream in streams:
            async with stream:
                async for out in stream:
                    assert out.ok
        scheduler = engine.scheduler
        assert isinstance(scheduler, RecordingScheduler)
        return list(scheduler.waves)  # [("a", "b")]: both in one wave


# -- runner ---------------------------------------------------------------------------------


class CountingRunner(ModelRunner):
    """The built-in runner, counting request-mode forwards and the requests they ran."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.forwards = 0
        self.requests = 0

    def forward_batch(
        self, requests: Sequence[DiffusionRequest]
    ) -> tuple[BatchRunnerOutput, ForwardedBatch]:
        self.forwards += 1
        self.requests += len(requests)
        return super().forward_batch(requests)


# -- worker extension -----------------------------------------------------------------------


class InspectExtension:
    """Worker RPCs: engine.collective_rpc("inspect") and ("fail", message)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.calls = 0

    def inspect(self) -> dict[str, Any]:
        self.calls += 1
        worker = self.worker
        assert worker.model_info is not None
        return {
            "rank": worker.rank,
            "pid": os.getpid(),
            "model": worker.model_info.name,
            "runner": type(worker.runner).__name__,
            "forwards": getattr(worker.runner, "forwards", None),
            "calls": self.calls,
        }

    def fail(self, message: str) -> None:
        raise RuntimeError(message)

    def _helper(self) -> None:
        """Not an RPC: its name starts with "_"."""


async def runner_and_extension_example() -> list[dict[str, Any]]:
    config = EngineConfig(
        model="builtin:echo",
        warmup=False,
        runner_cls=CountingRunner,
        worker_extension_cls="tests.extension_examples:InspectExtension",
    )
    async with open_engine(config) as engine:
        await engine.generate("p", SMALL, request_id="one")
        # One reply per rank (unique_reply_rank=None): [{"rank": 0, ...}]
        replies: list[dict[str, Any]] = await engine.collective_rpc(
            "inspect", unique_reply_rank=None
        )
    return replies


# -- model factory --------------------------------------------------------------------------


def echo_factory(
    *, device: torch.device, dtype: torch.dtype, options: Mapping[str, Any]
) -> DiffusionModel:
    """A model factory: builtin:echo's model, under a name of its own."""
    unknown = sorted(set(options) - {"step_delay_s"})
    if unknown:
        raise InvalidConfigError(
            f"echo_factory takes step_delay_s only, got {unknown}", field="model_options"
        )
    return EchoModel(
        step_delay_s=options.get("step_delay_s", 0.0), device=device, name="echo-by-factory"
    )


async def factory_example() -> str:
    config = EngineConfig(model="tests.extension_examples:echo_factory", warmup=False)
    async with open_engine(config) as engine:
        out = await engine.generate("p", SMALL)
        assert out.ok
        described = await engine.collective_rpc("describe")
    return str(described["model"])  # "echo-by-factory"
