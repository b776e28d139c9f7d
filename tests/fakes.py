"""Fakes shared by the runtime, executor and worker tests (fakes, not mocks).

- :class:`ScriptedExecutor`: a backend with no threads and no model.  Forwards are trio waits
  the test controls, so it runs under ``MockClock`` autojump and its order is deterministic.
- :class:`StepGate` + :class:`GatedEchoModel`: ``builtin:echo`` whose every denoising step
  blocks until the test lets it go on, reporting each step back to the trio loop; this makes
  "abort stops the forward within one step" checkable without wall-clock sleeps.
- :class:`ScriptedModel`: a minimal :class:`DiffusionModel` with chosen ``ModelInfo`` and
  failures (no batching, failing forwards).
- :func:`register_models`: serve fake models under ``fake:*`` names through the real
  ``omni_trio.models.load_model`` entry point the runner uses.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import trio

from omni_trio._core.messages import BatchRunnerOutput, RunnerOutput, SchedulerOutput
from omni_trio._core.request import DiffusionRequest
from omni_trio.config import EngineConfig
from omni_trio.errors import EngineDeadError, StallError
from omni_trio.executors.base import Executor
from omni_trio.models import DiffusionModel, ModelInfo, StepHook
from omni_trio.models.echo import EchoModel

# Every real-thread wait in a fake is bounded by this, so a broken test fails, never hangs.
GATE_S = 10.0

FAKE_INFO = ModelInfo(
    name="fake:scripted",
    family="echo",
    supports_batch=True,
    default_height=64,
    default_width=64,
    text_conditioned=False,
)


@dataclass(frozen=True)
class FakeImage:
    """What :class:`ScriptedExecutor` returns as an image: it names its request and seed."""

    request_id: str
    seed: int | None


class _Notifier:
    """Wake trio waiters whenever something changed; ``wait_until`` re-checks a predicate."""

    def __init__(self) -> None:
        self._changed = trio.Event()

    def notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._changed.wait()


class ScriptedExecutor(Executor):
    """An async backend for engine tests: no threads, every forward is a trio wait.

    A forward sleeps ``forward_s`` (virtual time under MockClock), then, while ``hold`` is
    True, waits until :meth:`release` is called or all its requests are aborted (the fake's
    "next step boundary").  ``log`` records ``("batch", time, ids)`` and
    ``("rpc", time, (method,))`` in the order they ran.
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.model_info = FAKE_INFO
        self.log: list[tuple[str, float, tuple[str, ...]]] = []
        self.scheduled: list[SchedulerOutput] = []
        self.requests: dict[str, DiffusionRequest] = {}
        self.aborted: list[str] = []
        self.results: list[BatchRunnerOutput] = []
        self.forward_s = 0.0
        self.hold = False
        self.fail_forward: Exception | None = None
        self.die_in_forward: Exception | None = None
        self.missing_outputs: set[str] = set()
        self.progress_map: dict[str, tuple[int, int]] = {}
        self.in_forward: tuple[str, ...] | None = None
        self.serve_started = False
        self.serve_exited = False
        self.aclose_calls = 0
        self._released = 0
        self._changes = _Notifier()

    # -- test controls ------------------------------------------------------------------

    def release(self) -> None:
        """Let the forward that is held now (or the next one) finish."""
        self._released += 1
        self._changes.notify()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        await self._changes.wait_until(predicate)

    async def wait_for_forward(self, *ids: str) -> None:
        """Wait until a forward of exactly ``ids`` is running."""
        await self.wait_until(lambda: self.in_forward == ids)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def batches(self) -> list[tuple[str, ...]]:
        return [ids for kind, _, ids in self.log if kind == "batch"]

    # -- the Executor contract ----------------------------------------------------------

    async def serve(
        self, *, task_status: trio.TaskStatus[Executor] = trio.TASK_STATUS_IGNORED
    ) -> None:
        self.serve_started = True
        try:
            task_status.started(self)
            await trio.sleep_forever()
        finally:
            self.serve_exited = True

    async def aclose(self) -> None:
        self.aclose_calls += 1
        self._closed = True

    async def execute_batch(self, scheduler_output: SchedulerOutput) -> BatchRunnerOutput:
        self.check_health()
        ids = scheduler_output.scheduled_request_ids
        self.log.append(("batch", trio.current_time(), ids))
        self.scheduled.append(scheduler_output)
        for new in scheduler_output.scheduled_new_reqs:
            self.requests[new.request_id] = new.request
        if self.die_in_forward is not None:
            self.fail(self.die_in_forward)
            raise EngineDeadError(f"worker 0 failed: {self.die_in_forward}")
        if self.fail_forward is not None:
            raise self.fail_forward
        self.in_forward = ids
        self._changes.notify()
        try:
            if self.forward_s:
                await trio.sleep(self.forward_s)
            released = self._released
            while self.hold and self._released == released and not self._all_aborted(ids):
                await self._changes.wait_until(
                    lambda: self._released != released or self._all_aborted(ids)
                )
        finally:
            self.in_forward = None
            self._changes.notify()
        outputs = []
        for rid in ids:
            if rid in self.missing_outputs:
                continue
            if rid in self.aborted:
                outputs.append(RunnerOutput(rid, aborted=True))
            else:
                seed = self.requests[rid].sampling.seed
                outputs.append(RunnerOutput(rid, images=(FakeImage(rid, seed),)))
        result = BatchRunnerOutput.from_list(outputs)
        self.results.append(result)
        return result

    def _all_aborted(self, ids: Iterable[str]) -> bool:
        return all(rid in self.aborted for rid in ids)

    async def collective_rpc(
        self,
        method: str,
        *args: Any,
        timeout: float | None = None,
        unique_reply_rank: int | None = 0,
        **kwargs: Any,
    ) -> Any:
        self.check_health()
        self.log.append(("rpc", trio.current_time(), (method,)))
        self._changes.notify()
        with trio.move_on_after(float("inf") if timeout is None else timeout) as scope:
            if method == "ping":
                result: Any = "pong"
            elif method == "sleep":
                await trio.sleep(args[0])
                result = "slept"
            elif method == "fail":
                raise ValueError("rpc failed on purpose")
            else:
                raise AttributeError(f"worker has no RPC method {method!r}")
        if scope.cancelled_caught:
            raise StallError("rpc", f"RPC {method!r} did not finish within {timeout} s")
        return result if unique_reply_rank is not None else [result]

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.aborted.extend(request_ids)
        self._changes.notify()

    def progress(self, request_id: str) -> tuple[int, int] | None:
        return self.progress_map.get(request_id)


class StepGate:
    """Holds an echo forward after every step until the test releases it.

    Create it inside the trio run of the test.  The worker thread calls :meth:`step` after each
    computed step (as echo's step sleep); it records the step, tells the trio loop, and blocks
    until :meth:`release` (one step) or :meth:`open` (all).  Forward starts and ends are
    recorded too (see :class:`GatedEchoModel`), so a test can await "the forward stopped".
    """

    def __init__(self) -> None:
        # Outside a trio run (tests of the synchronous Engine), waiters use the *_sync methods.
        try:
            self._token: trio.lowlevel.TrioToken | None = trio.lowlevel.current_trio_token()
        except RuntimeError:
            self._token = None
        self._permits = threading.Semaphore(0)
        self._open = threading.Event()
        self._changes = _Notifier()
        self._changed_sync = threading.Condition()
        # Appended in the worker thread before the loop is told, read in the loop after.
        self.events: list[tuple[str, tuple[str, ...], Any]] = []
        self._current: tuple[str, ...] = ()

    # -- worker-thread side -------------------------------------------------------------

    def _record(self, kind: str, ids: tuple[str, ...], detail: Any) -> None:
        with self._changed_sync:
            self.events.append((kind, ids, detail))
            self._changed_sync.notify_all()
        if self._token is not None:
            try:
                self._token.run_sync_soon(self._changes.notify)
            except trio.RunFinishedError:
                pass

    def forward_started(self, ids: tuple[str, ...]) -> None:
        self._current = ids
        self._record("start", ids, None)

    def forward_ended(self, ids: tuple[str, ...], outcome: str) -> None:
        self._record("end", ids, outcome)

    def step(self, delay: float) -> None:
        self._record("step", self._current, self.steps_of(self._current))
        if self._open.is_set():
            return
        if not self._permits.acquire(timeout=GATE_S):
            raise RuntimeError("StepGate: the test never released this step")

    # -- trio side ----------------------------------------------------------------------

    def release(self, steps: int = 1) -> None:
        for _ in range(steps):
            self._permits.release()

    def open(self) -> None:
        """Let every forward run freely from now on (also used in teardown)."""
        self._open.set()
        self._permits.release(1000)

    def steps_of(self, ids: tuple[str, ...]) -> int:
        return sum(1 for kind, i, _ in self.events if kind == "step" and i == ids)

    def ended(self, ids: tuple[str, ...]) -> str | None:
        for kind, i, detail in self.events:
            if kind == "end" and i == ids:
                return str(detail)
        return None

    @property
    def forwards(self) -> list[tuple[str, ...]]:
        return [ids for kind, ids, _ in self.events if kind == "start"]

    async def wait_for_step(self, ids: tuple[str, ...], steps: int) -> None:
        """Wait until the forward of ``ids`` has computed ``steps`` steps (and is held)."""
        await self._changes.wait_until(lambda: self.steps_of(ids) >= steps)

    def wait_for_step_sync(self, ids: tuple[str, ...], steps: int) -> None:
        """Blocking :meth:`wait_for_step` for tests without a trio run."""
        with self._changed_sync:
            if not self._changed_sync.wait_for(lambda: self.steps_of(ids) >= steps, GATE_S):
                raise TimeoutError(f"forward {ids} did not reach step {steps}")

    def wait_for_end_sync(self, ids: tuple[str, ...]) -> str:
        with self._changed_sync:
            if not self._changed_sync.wait_for(lambda: self.ended(ids) is not None, GATE_S):
                raise TimeoutError(f"forward {ids} did not end")
        return str(self.ended(ids))

    async def wait_for_end(self, ids: tuple[str, ...]) -> str:
        """Wait until the forward of ``ids`` returned or raised; return how it ended."""
        await self._changes.wait_until(lambda: self.ended(ids) is not None)
        ended = self.ended(ids)
        assert ended is not None
        return ended


class GatedEchoModel(EchoModel):
    """``builtin:echo`` whose steps are held by a :class:`StepGate`."""

    def __init__(self, gate: StepGate, *, name: str = "fake:gated-echo") -> None:
        super().__init__(step_delay_s=1.0, sleep=gate.step, name=name)
        self.gate = gate

    def generate(
        self,
        requests: Sequence[DiffusionRequest],
        generators: Sequence[Any],
        *,
        output_type: Any,
        on_step: StepHook,
    ) -> list[list[Any]]:
        ids = tuple(r.request_id for r in requests)
        self.gate.forward_started(ids)
        try:
            result = super().generate(
                requests, generators, output_type=output_type, on_step=on_step
            )
        except BaseException as exc:
            self.gate.forward_ended(ids, type(exc).__name__)
            raise
        self.gate.forward_ended(ids, "returned")
        return result


class ScriptedModel(DiffusionModel):
    """A minimal model: ``steps`` calls of ``on_step``, then tiny arrays; optional failures."""

    def __init__(
        self,
        *,
        supports_batch: bool = True,
        fail_with: Exception | None = None,
        name: str = "fake:scripted",
        outputs_per_call: int | None = None,
    ) -> None:
        self.info = ModelInfo(
            name=name,
            family="echo",
            supports_batch=supports_batch,
            default_height=64,
            default_width=64,
            text_conditioned=False,
        )
        self.fail_with = fail_with
        self.outputs_per_call = outputs_per_call
        self.calls: list[tuple[str, ...]] = []
        self.closed = False

    def generate(
        self,
        requests: Sequence[DiffusionRequest],
        generators: Sequence[Any],
        *,
        output_type: Any,
        on_step: StepHook,
    ) -> list[list[Any]]:
        self.calls.append(tuple(r.request_id for r in requests))
        total = requests[0].sampling.total_steps
        for step in range(total):
            on_step(step, total)
        if self.fail_with is not None:
            raise self.fail_with
        count = len(requests) if self.outputs_per_call is None else self.outputs_per_call
        return [[np.zeros((8, 8, 3), dtype=np.float32)] for _ in range(count)]

    def to(self, device: Any) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class BlockingModel(ScriptedModel):
    """A forward that never reaches a step boundary until :attr:`release` is set (a hung
    kernel): it ignores ``on_step`` and stop flags.  ``on_enter`` runs when it starts."""

    def __init__(self, on_enter: Callable[[], None]) -> None:
        super().__init__(name="fake:blocking")
        self.on_enter = on_enter
        self.release = threading.Event()

    def generate(
        self,
        requests: Sequence[DiffusionRequest],
        generators: Sequence[Any],
        *,
        output_type: Any,
        on_step: StepHook,
    ) -> list[list[Any]]:
        self.calls.append(tuple(r.request_id for r in requests))
        self.on_enter()
        if not self.release.wait(GATE_S):
            raise RuntimeError("BlockingModel: the test never released the forward")
        return [[np.zeros((8, 8, 3), dtype=np.float32)] for _ in requests]


ModelFactory = Callable[[Mapping[str, Any]], DiffusionModel]


def register_models(
    monkeypatch: pytest.MonkeyPatch, factories: Mapping[str, ModelFactory]
) -> list[DiffusionModel]:
    """Serve ``factories`` (name -> factory(options)) through ``omni_trio.models.load_model``.

    Other names load as usual.  Returns the list every loaded fake is appended to.
    """
    import omni_trio.models

    real_load = omni_trio.models.load_model
    loaded: list[DiffusionModel] = []

    def load_model(model: str, **kwargs: Any) -> DiffusionModel:
        factory = factories.get(model)
        if factory is None:
            return real_load(model, **kwargs)
        instance = factory(kwargs.get("options", {}))
        loaded.append(instance)
        return instance

    monkeypatch.setattr(omni_trio.models, "load_model", load_model)

    # The early check (command line, daemon) knows the registered names as this loader does:
    # "fake:x" would otherwise be read as a model factory in a module "fake".
    import omni_trio.models.loading as loading

    real_check = loading.check_model_early

    def check_model_early(model: str, backend: object) -> None:
        if model not in factories:
            real_check(model, backend)

    monkeypatch.setattr(loading, "check_model_early", check_model_early)
    return loaded


@dataclass
class Recorder:
    """Collects items from any thread (list.append is atomic under the GIL)."""

    items: list[Any] = field(default_factory=list)

    def __call__(self, item: Any) -> None:
        self.items.append(item)
