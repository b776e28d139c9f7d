"""The synchronous engine driver: a real engine in a trio loop, driven from another thread."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_trio import EngineConfig, RequestStatus, SamplingParams
from omni_trio.testing import (
    EngineDriver,
    TraceKind,
    assert_trace_ok,
    check_leftovers,
    leftover_resources,
    run_driven,
)

S = RequestStatus


def config(cache_dir: Path, **kw: object) -> EngineConfig:
    kw.setdefault("warmup", False)
    return EngineConfig(
        model="builtin:echo",
        model_options={"step_delay_s": 0.02},
        cache_dir=str(cache_dir),
        torch_threads=1,
        **kw,  # type: ignore[arg-type]
    )


def params(seed: int, steps: int = 3) -> SamplingParams:
    return SamplingParams(num_inference_steps=steps, seed=seed, height=32, width=32)


def test_a_driven_engine_serves_aborts_and_drops_and_records_what_clients_saw(
    cache_dir: Path,
) -> None:
    def scenario(driver: EngineDriver) -> dict[str, object]:
        driver.open(config(cache_dir))
        done = driver.submit("a", params(1))
        aborted = driver.submit("b", params(2, steps=50))
        dropped = driver.submit("c", params(3, steps=50))
        driver.abort(aborted)
        assert driver.drop(dropped)
        assert driver.wait_finished(timeout=30)
        assert driver.rpc("ping")["rank"] == 0
        driver.close()
        return {
            "done": driver.consumers[done].final,
            "aborted": driver.consumers[aborted].final,
            "dropped": driver.consumers[dropped],
        }

    trace_holder: list[object] = []

    def run(driver: EngineDriver) -> dict[str, object]:
        trace_holder.append(driver.trace)
        return scenario(driver)

    seen = run_driven(run)
    done, aborted, dropped = seen["done"], seen["aborted"], seen["dropped"]
    assert done is not None and done.status is S.FINISHED_COMPLETED  # type: ignore[attr-defined]
    assert aborted is not None and aborted.status is S.FINISHED_ABORTED  # type: ignore[attr-defined]
    assert dropped.dropped and dropped.final is None  # type: ignore[attr-defined]
    (trace,) = trace_holder
    assert_trace_ok(trace)  # type: ignore[arg-type]
    received = [e for e in trace if e.kind is TraceKind.RECEIVED and e.detail["finished"]]  # type: ignore[attr-defined]
    identities = {e.request_id: e.detail["identity"] for e in received}
    assert identities["fuzz-1"] == {"request_id": "fuzz-1", "seed": 1}
    assert leftover_resources() == {"threads": [], "shm_segments": [], "processes": []}


def test_an_in_process_crash_is_survived(cache_dir: Path) -> None:
    def scenario(driver: EngineDriver) -> str:
        engine = driver.open(config(cache_dir, worker_restart_backoff_s=0.0))
        first = driver.submit("a", params(1, steps=40))
        driver.sleep(0.1)
        assert driver.crash_worker() == "failed in-process group"
        assert driver.wait_finished(timeout=30)
        later = driver.submit("b", params(2))
        assert driver.wait_finished([later], timeout=30)
        stats = driver.call(engine.statistics)
        assert stats.restarts == 1
        final = driver.consumers[first].final
        assert final is not None
        driver.close()
        assert_trace_ok(driver.trace)
        return final.status.name

    assert run_driven(scenario) == "FINISHED_COMPLETED"  # retried on the new group


def test_an_error_in_the_scenario_propagates_and_the_engine_is_closed(cache_dir: Path) -> None:
    def scenario(driver: EngineDriver) -> None:
        driver.open(config(cache_dir))
        driver.submit("a", params(1, steps=100))
        raise KeyError("scenario bug")

    with pytest.raises(KeyError, match="scenario bug"):
        run_driven(scenario)
    assert leftover_resources()["threads"] == []


def test_driver_misuse_is_refused(cache_dir: Path) -> None:
    def scenario(driver: EngineDriver) -> None:
        with pytest.raises(RuntimeError, match="no engine"):
            driver.submit("a", params(1))
        driver.open(config(cache_dir))
        with pytest.raises(RuntimeError, match="already open"):
            driver.open(config(cache_dir))
        driver.close()
        driver.close()  # idempotent

    run_driven(scenario)


def test_leftovers_mid_flight_and_once_settled(cache_dir: Path) -> None:
    def scenario(driver: EngineDriver) -> None:
        driver.open(config(cache_dir, max_num_seqs=2))
        running = driver.submit("a", params(1, steps=40))
        held, flying = driver.leftovers()
        assert running in held["requests"] and running in held["engine_streams"]
        assert check_leftovers(held, driver.trace.events, in_flight=flying) == []
        driver.abort(running)
        settled = driver.settle(timeout=30)
        assert settled is not None
        assert {kind: ids for kind, ids in settled.items() if ids} == {}
        assert "stop_flags" in settled  # the workers' part was asked for too
        assert check_leftovers(settled, driver.trace.events, settled=True) == []
        driver.close()

    run_driven(scenario)


def test_a_close_that_outlasts_the_call_bound_cancels_the_engine(cache_dir: Path) -> None:
    """A close with no answer within ``call_timeout_s`` raises ``trio.TooSlowError`` after
    cancelling the engine's task and its consumers: nothing of the engine (worker thread,
    consumer) outlives the call, and the driver can open another engine."""
    import trio

    def scenario(driver: EngineDriver) -> dict[str, object]:
        driver.open(config(cache_dir))
        running = driver.submit("a", params(1, steps=200))
        driver.call_timeout_s = 0.0  # every call times out at its first checkpoint
        with pytest.raises(trio.TooSlowError):
            driver.close()
        driver.call_timeout_s = 60.0
        assert not driver.is_open
        left = leftover_resources()
        consumer_done = driver.consumers[running].done
        driver.open(config(cache_dir))  # the driver is usable again
        served = driver.submit("b", params(2))
        assert driver.wait_finished([served], timeout=30)
        driver.close()
        return {"left": left, "consumer_done": consumer_done}

    result = run_driven(scenario)
    assert result["left"] == {"threads": [], "shm_segments": [], "processes": []}
    assert result["consumer_done"]
