"""``Engine``: the synchronous front door runs an AsyncEngine in its own, owned thread, with
the async engine's surface (``stream`` as a blocking iterator, ``progress``, ``health``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from omni_trio import (
    DuplicateRequestError,
    Engine,
    EngineClosedError,
    EngineConfig,
    InvalidConfigError,
    InvalidRequestError,
    RequestAbortedError,
    RequestStatus,
    SamplingParams,
)
from omni_trio._core.health import EngineState
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


def gated_engine(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path, **overrides: Any
) -> Iterator[tuple[Engine, StepGate]]:
    gate = StepGate()
    register_models(monkeypatch, {"fake:gated-echo": lambda options: GatedEchoModel(gate)})
    engine = Engine(config(cache_dir, model="fake:gated-echo", **overrides))
    try:
        yield engine, gate
    finally:
        gate.open()
        engine.close()


@pytest.fixture
def gated(monkeypatch: pytest.MonkeyPatch, cache_dir: Path) -> Iterator[tuple[Engine, StepGate]]:
    yield from gated_engine(monkeypatch, cache_dir)


@pytest.fixture
def gated_streaming(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> Iterator[tuple[Engine, StepGate]]:
    """Step mode with a preview after every step; each step waits for the gate."""
    yield from gated_engine(monkeypatch, cache_dir, streaming_output=True, preview_interval=1)


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


def test_sleep_and_wake_up_from_plain_python(cache_dir: Path) -> None:
    with Engine(config(cache_dir)) as engine:
        assert [r["level"] for r in engine.sleep(2)] == [2]
        assert engine.health().state is EngineState.SLEEPING
        assert [r["rank"] for r in engine.wake_up()] == [0]
        assert engine.health().healthy
        assert engine.generate("a cat", params(seed=3)).ok


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
    with pytest.raises(EngineClosedError):
        engine.stream("p", params())
    with pytest.raises(EngineClosedError):
        engine.progress("x")
    health = engine.health()  # never raises: the engine's last snapshot
    assert health.state is EngineState.CLOSED and not health.healthy
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


# -- stream(): a blocking iterator ----------------------------------------------------------


def test_stream_in_request_mode_yields_the_terminal_output(cache_dir: Path) -> None:
    with Engine(config(cache_dir)) as engine:
        stream = engine.stream("a cat", params(seed=5), request_id="s-1")
        assert (stream.request_id, stream.seed) == ("s-1", 5)  # known at admission
        chunks = list(stream)
        assert list(stream) == []  # exhausted
        stats = engine.statistics()
    (final,) = chunks
    assert final.finished and final.status is RequestStatus.FINISHED_COMPLETED
    assert decode_echo_image(final.images[0]) == ("s-1", 5, 0)
    assert stats.finished_completed == 1 and stats.finished_aborted == 0


def test_stream_yields_previews_then_the_final_output(cache_dir: Path) -> None:
    with Engine(config(cache_dir, streaming_output=True, preview_interval=2)) as engine:
        seed_known = engine.stream("a cat", params(num_inference_steps=5))
        chunks = list(seed_known)
    assert seed_known.seed is not None  # chosen at admission when none was given
    assert [c.chunk_index for c in chunks] == [0, 1, 2]
    assert [c.finished for c in chunks] == [False, False, True]
    assert chunks[-1].status is RequestStatus.FINISHED_COMPLETED
    assert all(c.request_id == seed_known.request_id for c in chunks)


def test_stream_rejects_bad_input_before_admission(cache_dir: Path) -> None:
    with Engine(config(cache_dir)) as engine:
        with pytest.raises(InvalidRequestError) as info:
            engine.stream("a cat", params(height=33))
        assert info.value.param == "height"
        held = engine.stream("a cat", params(), request_id="dup")
        with pytest.raises(DuplicateRequestError):
            engine.stream("a dog", params(), request_id="dup")
        assert list(held)[-1].ok
        assert engine.statistics().admitted == 1


def test_breaking_out_of_a_stream_aborts_the_request(
    gated_streaming: tuple[Engine, StepGate],
) -> None:
    engine, gate = gated_streaming
    gate.release()  # step 0 runs and is previewed; step 1 waits at the gate
    seen = []
    for chunk in engine.stream("p", params(num_inference_steps=5), request_id="quitter"):
        seen.append(chunk)
        break
    # The dropped stream's abort is queued to the engine's thread before this call.
    stats = engine.statistics()
    assert [(c.chunk_index, c.finished) for c in seen] == [(0, False)]
    assert stats.finished_aborted == 1 and stats.finished_completed == 0
    assert stats.running == 0 and stats.waiting == 0
    gate.open()
    assert engine.generate("p", params(seed=2), request_id="after").ok
    assert engine.progress("quitter") is None  # its last step ran out; it never ran again


def test_leaving_a_stream_block_or_closing_it_aborts_the_request(
    gated: tuple[Engine, StepGate],
) -> None:
    engine, gate = gated
    with engine.stream("p", params(num_inference_steps=50), request_id="left") as stream:
        gate.wait_for_step_sync(("left",), 1)
    gate.release()
    assert gate.wait_for_end_sync(("left",)) == "ForwardStopped"
    assert list(stream) == []  # closed: nothing more to read
    closed = engine.stream("p", params(num_inference_steps=50), request_id="closed")
    gate.wait_for_step_sync(("closed",), 1)
    closed.close()
    closed.close()  # idempotent
    gate.release()
    assert gate.wait_for_end_sync(("closed",)) == "ForwardStopped"
    assert engine.statistics().finished_aborted == 2
    gate.open()
    with engine.stream("p", params(seed=3), request_id="read") as stream:
        (final,) = stream
    assert final.ok  # leaving after the terminal output aborts nothing
    assert engine.statistics().finished_aborted == 2


def test_dropping_an_unread_stream_aborts_the_request(gated: tuple[Engine, StepGate]) -> None:
    engine, gate = gated
    stream = engine.stream("p", params(num_inference_steps=50), request_id="dropped")
    gate.wait_for_step_sync(("dropped",), 1)
    del stream  # its abort is queued to the engine's thread, ahead of the next call
    assert engine.statistics().finished_aborted == 1
    gate.release()
    assert gate.wait_for_end_sync(("dropped",)) == "ForwardStopped"


def test_closing_the_engine_ends_a_stream_being_read(gated: tuple[Engine, StepGate]) -> None:
    engine, gate = gated
    stream = engine.stream("p", params(num_inference_steps=50), request_id="reading")
    reader = Background(lambda: list(stream))
    gate.wait_for_step_sync(("reading",), 1)
    closer = Background(engine.close)
    (final,) = reader.result()
    gate.release()
    closer.result()
    assert final.status is RequestStatus.FINISHED_ABORTED
    assert final.error_type == "EngineClosedError"
    assert ENGINE_THREAD not in thread_names()


# -- progress() and health() ----------------------------------------------------------------


def test_progress_of_a_running_request(gated: tuple[Engine, StepGate]) -> None:
    engine, gate = gated
    assert engine.progress("running") is None  # unknown
    call = Background(
        lambda: engine.generate("p", params(num_inference_steps=4), request_id="running")
    )
    gate.wait_for_step_sync(("running",), 1)
    first = engine.progress("running")
    gate.release()
    gate.wait_for_step_sync(("running",), 2)
    assert (first, engine.progress("running")) == ((0, 4), (1, 4))  # steps done
    gate.open()
    assert call.result().ok
    assert engine.progress("running") is None  # done


def test_health_is_the_async_engines_snapshot(cache_dir: Path) -> None:
    engine = Engine(config(cache_dir))
    try:
        health = engine.health()
        assert health.healthy and health.state is EngineState.READY
        assert health.restarts == 0 and health.last_failure is None
        assert [w.rank for w in health.workers] == [0]
    finally:
        engine.close()
    after = engine.health()
    assert not after.healthy and after.state is EngineState.CLOSED


def test_profiling_forwards_to_the_async_engine(cache_dir: Path, tmp_path: Path) -> None:
    """``start_profile`` / ``stop_profile`` block and raise as the async engine's do."""
    with Engine(config(cache_dir)) as engine:
        with pytest.raises(RuntimeError, match="not profiling"):
            engine.stop_profile()
        engine.start_profile(tmp_path, prefix="sync")
        assert engine.generate("traced", params(seed=2)).ok
        assert engine.stop_profile() == [str(tmp_path / "sync-rank0.json")]
    assert (tmp_path / "sync-rank0.json").stat().st_size > 0
    with pytest.raises(EngineClosedError):
        engine.start_profile(tmp_path)
