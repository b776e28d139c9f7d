"""``Engine``: the synchronous front door runs an AsyncEngine in its own, owned thread."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from omni_trio import (
    Engine,
    EngineClosedError,
    EngineConfig,
    InvalidConfigError,
    RequestAbortedError,
    SamplingParams,
)
from omni_trio.models.echo import decode_echo_image
from tests.fakes import GATE_S, GatedEchoModel, ScriptedModel, StepGate, register_models

ENGINE_THREAD = "omni-trio-engine"
WORKER_THREAD = "omni-trio-worker-0"


def params(**kw: Any) -> SamplingParams:
    kw.setdefault("height", 32)
    kw.setdefault("width", 32)
    kw.setdefault("num_inference_steps", 2)
    return SamplingParams(**kw)


def config(cache_dir: Path, **overrides: Any) -> EngineConfig:
    overrides.setdefault("torch_threads", 1)
    overrides.setdefault("warmup", False)
    return EngineConfig(cache_dir=str(cache_dir), **overrides)


def thread_names() -> set[str]:
    return {t.name for t in threading.enumerate()}


class Background:
    """Run a blocking call in a test-owned thread; ``result()`` joins it (bounded)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._box: list[tuple[bool, Any]] = []
        self._thread = threading.Thread(target=self._run, args=(fn,), name="test-caller")
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._box.append((True, fn()))
        except BaseException as exc:
            self._box.append((False, exc))

    def result(self) -> Any:
        self._thread.join(GATE_S)
        assert not self._thread.is_alive(), "the background call did not return"
        ok, value = self._box[0]
        if not ok:
            raise value
        return value


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> Iterator[tuple[Engine, StepGate]]:
    gate = StepGate()
    register_models(monkeypatch, {"fake:gated-echo": lambda options: GatedEchoModel(gate)})
    engine = Engine(config(cache_dir, model="fake:gated-echo"))
    try:
        yield engine, gate
    finally:
        gate.open()
        engine.close()


def test_generate_in_a_with_block(cache_dir: Path) -> None:
    with Engine(config(cache_dir)) as engine:
        assert ENGINE_THREAD in thread_names()
        out = engine.generate("a cat", params(seed=21), request_id="sync-1")
        engine.check_health()
        assert engine.collective_rpc("ping")["loaded"] is True
        stats = engine.statistics()
    assert out.ok and out.seed == 21
    assert decode_echo_image(out.images[0]) == ("sync-1", 21, 0)
    assert stats.finished_completed == 1
    assert ENGINE_THREAD not in thread_names()
    assert WORKER_THREAD not in thread_names()


def test_overrides_apply_on_top_of_the_config(cache_dir: Path) -> None:
    with Engine(config(cache_dir), max_num_seqs=2) as engine:
        assert engine.config.max_num_seqs == 2


def test_generate_from_several_threads(cache_dir: Path) -> None:
    with Engine(config(cache_dir, max_num_seqs=4)) as engine:
        calls = [
            Background(lambda i=i: engine.generate("p", params(seed=i), request_id=f"t{i}"))
            for i in range(6)
        ]
        outs = [call.result() for call in calls]
    for i, out in enumerate(outs):
        assert decode_echo_image(out.images[0]) == (f"t{i}", i, 0)


def test_abort_from_another_thread(gated: tuple[Engine, StepGate]) -> None:
    engine, gate = gated
    call = Background(
        lambda: engine.generate("p", params(num_inference_steps=50), request_id="victim")
    )
    gate.wait_for_step_sync(("victim",), 1)
    engine.abort("victim")
    with pytest.raises(RequestAbortedError):
        call.result()
    gate.release()
    assert gate.wait_for_end_sync(("victim",)) == "ForwardStopped"
    assert gate.steps_of(("victim",)) == 1
    gate.open()
    assert engine.generate("p", params(seed=1), request_id="after").ok


def test_close_ends_a_pending_generate_and_joins_the_thread(
    gated: tuple[Engine, StepGate],
) -> None:
    engine, gate = gated
    call = Background(
        lambda: engine.generate("p", params(num_inference_steps=50), request_id="pending")
    )
    gate.wait_for_step_sync(("pending",), 1)
    closer = Background(engine.close)
    with pytest.raises(EngineClosedError):
        call.result()
    gate.release()
    closer.result()
    assert gate.wait_for_end_sync(("pending",)) == "ForwardStopped"
    assert ENGINE_THREAD not in thread_names()
    assert WORKER_THREAD not in thread_names()


def test_calls_after_close_raise_engine_closed(cache_dir: Path) -> None:
    engine = Engine(config(cache_dir))
    engine.close()
    engine.close()  # idempotent
    assert ENGINE_THREAD not in thread_names()
    with pytest.raises(EngineClosedError):
        engine.generate("p", params())
    with pytest.raises(EngineClosedError):
        engine.abort("x")
    with pytest.raises(EngineClosedError):
        engine.statistics()
    with pytest.raises(EngineClosedError):
        engine.check_health()
    with pytest.raises(EngineClosedError):
        engine.collective_rpc("ping")
    with engine:  # leaving the block closes again, harmlessly
        pass


def test_a_construction_error_propagates_and_leaves_no_thread(cache_dir: Path) -> None:
    with pytest.raises(InvalidConfigError) as info:
        Engine(config(cache_dir, model="builtin:no-such-model"))
    assert info.value.field == "model"
    assert ENGINE_THREAD not in thread_names()
    assert WORKER_THREAD not in thread_names()


def test_a_warmup_failure_propagates_from_the_constructor(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    loaded = register_models(
        monkeypatch, {"fake:broken": lambda options: ScriptedModel(fail_with=ValueError("nan"))}
    )
    with pytest.raises(RuntimeError, match="warmup failed"):
        Engine(config(cache_dir, model="fake:broken", warmup=True))
    (model,) = loaded
    assert isinstance(model, ScriptedModel) and model.closed
    assert ENGINE_THREAD not in thread_names()
