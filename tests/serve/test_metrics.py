"""ServeMetrics: its own registry, the counters the app feeds, the pool read at scrape time."""

from __future__ import annotations

from typing import Any, cast

from prometheus_client.parser import text_string_to_metric_families

from omni_trio._core.messages import RequestMetrics
from omni_trio.config import EngineConfig
from omni_trio.serve.metrics import CONTENT_TYPE, ServeMetrics
from omni_trio.serve.pool import EnginePool


def samples(metrics: ServeMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


class FakePool:
    """What the scrape-time collector reads from an EnginePool."""

    def __init__(self, replicas: list[dict[str, Any]], in_flight: int, draining: bool) -> None:
        self._replicas = replicas
        self.in_flight = in_flight
        self.draining = draining
        self.moved = {"replica_died": 0, "workers_restarting": 0}

    def replicas_info(self) -> list[dict[str, Any]]:
        return self._replicas


def replica(index: int, state: str, **kw: Any) -> dict[str, Any]:
    stats = kw.pop("statistics", None)
    return {
        "index": index,
        "state": state,
        "healthy": state == "ready",
        "reason": None,
        "restarts": kw.get("restarts", 0),
        "worker_restarts": kw.get("worker_restarts", 0),
        "in_flight": 0,
        "statistics": stats,
    }


def test_counters_and_histograms() -> None:
    m = ServeMetrics()
    m.observe_request("/v1/images/generations", 200)
    m.observe_request("/v1/images/generations", 200)
    m.observe_request("/health", 404)
    m.observe_abort("timeout")
    m.observe_generation(
        RequestMetrics(queue_wait_ms=10.0, execution_ms=200.0, e2e_ms=220.0), 250.0, 2
    )
    s = samples(m)
    assert (
        s[("omni_trio_requests_total", (("route", "/v1/images/generations"), ("status", "200")))]
        == 2
    )
    assert s[("omni_trio_requests_total", (("route", "/health"), ("status", "404")))] == 1
    assert s[("omni_trio_aborts_total", (("reason", "timeout"),))] == 1
    assert s[("omni_trio_images_generated_total", ())] == 2
    assert s[("omni_trio_queue_wait_seconds_count", ())] == 1
    assert s[("omni_trio_queue_wait_seconds_sum", ())] == 0.01
    assert s[("omni_trio_execution_seconds_bucket", (("le", "0.25"),))] == 1
    assert s[("omni_trio_end_to_end_seconds_bucket", (("le", "0.1"),))] == 0
    assert s[("omni_trio_end_to_end_seconds_sum", ())] == 0.25
    assert CONTENT_TYPE.startswith("text/plain")


def test_slow_client_and_connection_metrics() -> None:
    m = ServeMetrics()
    m.connections.set(3)
    m.observe_connection_refused()
    m.observe_slow_client("send_timeout")
    m.observe_slow_client("body_timeout")
    m.observe_slow_client("body_timeout")
    m.response_bytes_in_flight.set_function(lambda: 12345)
    s = samples(m)
    assert s[("omni_trio_connections", ())] == 3
    assert s[("omni_trio_connections_refused_total", ())] == 1
    assert s[("omni_trio_slow_clients_total", (("reason", "send_timeout"),))] == 1
    assert s[("omni_trio_slow_clients_total", (("reason", "body_timeout"),))] == 2
    assert s[("omni_trio_response_bytes_in_flight", ())] == 12345


def test_each_server_has_its_own_registry() -> None:
    a, b = ServeMetrics(), ServeMetrics()
    a.observe_request("/health", 200)
    assert ("omni_trio_requests_total", (("route", "/health"), ("status", "200"))) in samples(a)
    assert ("omni_trio_requests_total", (("route", "/health"), ("status", "200"))) not in samples(b)


def test_pool_gauges_are_read_at_scrape_time() -> None:
    stats = {"waiting": 3, "running": 1}
    pool = FakePool(
        [
            replica(0, "ready", statistics=stats, worker_restarts=2),
            replica(1, "restarting", restarts=1),
            replica(2, "failed", restarts=5),
        ],
        in_flight=4,
        draining=True,
    )
    m = ServeMetrics(cast(EnginePool, pool))
    s = samples(m)
    assert s[("omni_trio_queue_depth", ())] == 3
    assert s[("omni_trio_running", ())] == 1
    assert s[("omni_trio_in_flight", ())] == 4
    assert s[("omni_trio_replicas_ready", ())] == 1
    assert s[("omni_trio_draining", ())] == 1
    assert [s[("omni_trio_engine_state", (("replica", str(i)),))] for i in range(3)] == [2, 1, 0]
    assert s[("omni_trio_worker_restarts_total", (("replica", "0"),))] == 2
    assert s[("omni_trio_replica_restarts_total", (("replica", "2"),))] == 5
    assert s[("omni_trio_requests_moved_total", (("reason", "workers_restarting"),))] == 0
    pool.moved["workers_restarting"] = 2
    moved = samples(m)[("omni_trio_requests_moved_total", (("reason", "workers_restarting"),))]
    assert moved == 2
    pool.in_flight = 0
    pool._replicas[1] = replica(1, "ready", statistics={"waiting": 0, "running": 2})
    s = samples(m)
    assert s[("omni_trio_in_flight", ())] == 0
    assert s[("omni_trio_running", ())] == 3
    assert s[("omni_trio_replicas_ready", ())] == 2


def test_a_pool_that_is_not_serving_yet_scrapes_as_starting() -> None:
    m = ServeMetrics(EnginePool(EngineConfig(model="builtin:echo"), replicas=2))
    s = samples(m)
    assert s[("omni_trio_replicas_ready", ())] == 0
    assert s[("omni_trio_engine_state", (("replica", "1"),))] == 1


def test_phase_histograms_and_encoding() -> None:
    m = ServeMetrics()
    m.observe_generation(
        RequestMetrics(execution_ms=100.0, postprocess_ms=4.0, step_ms=20.0), 120.0, 1
    )
    m.observe_generation(RequestMetrics(execution_ms=100.0, postprocess_ms=6.0), 120.0, 1)
    m.observe_encode(0.003)
    s = samples(m)
    assert s[("omni_trio_step_seconds_count", ())] == 1  # step mode times no steps: skipped
    assert s[("omni_trio_step_seconds_sum", ())] == 0.02
    assert s[("omni_trio_packing_seconds_count", ())] == 2
    assert abs(s[("omni_trio_packing_seconds_sum", ())] - 0.01) < 1e-12
    assert s[("omni_trio_encode_seconds_bucket", (("le", "0.005"),))] == 1


def test_requeues_endings_packing_and_worker_states_per_replica() -> None:
    stats = {
        "waiting": 0,
        "running": 1,
        "requeued": 3,
        "packing": 1,
        "finished_completed": 7,
        "finished_aborted": 2,
        "finished_error": 1,
        "workers": [{"rank": 0, "state": "running"}, {"rank": 1, "state": "restarting"}],
    }
    pool = FakePool([replica(0, "ready", statistics=stats)], in_flight=1, draining=False)
    s = samples(ServeMetrics(cast(EnginePool, pool)))
    assert s[("omni_trio_requests_requeued_total", (("replica", "0"),))] == 3
    assert s[("omni_trio_packing", (("replica", "0"),))] == 1
    finished = {
        status: s[("omni_trio_requests_finished_total", (("replica", "0"), ("status", status)))]
        for status in ("completed", "aborted", "error")
    }
    assert finished == {"completed": 7, "aborted": 2, "error": 1}
    assert s[("omni_trio_worker_state", (("replica", "0"), ("state", "running"), ("worker", "0")))]
    key = ("omni_trio_worker_state", (("replica", "0"), ("state", "restarting"), ("worker", "1")))
    assert s[key] == 1


def test_batch_sizes_cancel_latency_wasted_steps_and_step_times_per_replica() -> None:
    stats = {
        "waiting": 0,
        "running": 0,
        "batch_sizes": [[1, 5], [2, 3], [9, 1]],
        "cancel_latency_counts": [0, 1, 2, 0, 0, 0, 0, 0, 0, 0, 0, 1],
        "cancel_latency_sum_s": 20.05,
        "wasted_steps": 17,
        "step_time_s": [[1024, 0.02], [4096, 0.07]],
        "rank_restarts": 3,
    }
    pool = FakePool([replica(0, "ready", statistics=stats)], in_flight=0, draining=False)
    s = samples(ServeMetrics(cast(EnginePool, pool)))
    r0 = ("replica", "0")

    def bucket(name: str, le: str) -> float:
        return s[(name, (("le", le), r0))]

    assert [bucket("omni_trio_batch_size_bucket", le) for le in ("1.0", "2.0", "8.0", "16.0")] == [
        5,
        8,
        8,
        9,
    ]
    assert s[("omni_trio_batch_size_count", (r0,))] == 9
    assert s[("omni_trio_batch_size_sum", (r0,))] == 5 + 6 + 9
    assert bucket("omni_trio_cancel_latency_seconds_bucket", "0.025") == 3
    assert bucket("omni_trio_cancel_latency_seconds_bucket", "+Inf") == 4
    assert s[("omni_trio_cancel_latency_seconds_sum", (r0,))] == 20.05
    assert s[("omni_trio_wasted_steps_total", (r0,))] == 17
    assert s[("omni_trio_step_time_seconds", (("pixels", "1024"), r0))] == 0.02
    assert s[("omni_trio_step_time_seconds", (("pixels", "4096"), r0))] == 0.07
    assert s[("omni_trio_rank_restarts_total", (r0,))] == 3


def test_the_exposition_names_each_metric_once() -> None:
    """Every family (the pool's, read at each scrape, and the server's own) has one TYPE
    line: a name used twice makes Prometheus reject the whole scrape."""
    from prometheus_client import generate_latest

    stats = {"waiting": 0, "running": 0, "step_time_s": [[1024, 0.02]], "tick_counts": [1]}
    pool = FakePool([replica(0, "ready", statistics=stats)], in_flight=0, draining=False)
    text = generate_latest(ServeMetrics(cast(EnginePool, pool)).registry).decode()
    types = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types)), sorted(t for t in types if types.count(t) > 1)
    assert "omni_trio_step_time_seconds" in types and "omni_trio_step_seconds" in types


def test_admission_times_by_route_and_step_mode_ticks_per_replica() -> None:
    from omni_trio._core.health import TICK_BUCKETS_S

    counts = [0] * (len(TICK_BUCKETS_S) + 1)
    counts[2], counts[4] = 3, 1  # (2.5 ms, 5 ms] and (10 ms, 25 ms]
    stats = {"waiting": 0, "running": 0, "tick_counts": counts, "tick_sum_s": 0.032}
    pool = FakePool([replica(0, "ready", statistics=stats)], in_flight=0, draining=False)
    m = ServeMetrics(cast(EnginePool, pool))
    m.observe_admission("/v1/images/generations", 0.0008)
    m.observe_admission("/v1/images/generations", 0.003)
    m.observe_admission("/v1/jobs", 0.2)
    s = samples(m)
    gen = ("route", "/v1/images/generations")
    assert s[("omni_trio_admission_seconds_count", (gen,))] == 2
    assert s[("omni_trio_admission_seconds_bucket", (("le", "0.001"), gen))] == 1
    assert s[("omni_trio_admission_seconds_count", (("route", "/v1/jobs"),))] == 1
    r0 = ("replica", "0")
    assert s[("omni_trio_tick_seconds_bucket", (("le", "0.005"), r0))] == 3
    assert s[("omni_trio_tick_seconds_bucket", (("le", "0.025"), r0))] == 4
    assert s[("omni_trio_tick_seconds_count", (r0,))] == 4
    assert s[("omni_trio_tick_seconds_sum", (r0,))] == 0.032


async def test_a_step_mode_server_times_admissions_and_ticks() -> None:
    """A real step-mode server: a generation, an edit and a job each observe their
    admission under their route; the engine's ticks show up per replica."""
    import trio

    from .conftest import CAP_S, run_server, wait_until
    from .test_edits import png

    body = {"prompt": "p", "size": "64x64", "num_inference_steps": 3}
    with trio.fail_after(CAP_S):
        async with run_server(step_execution=True) as server, server.client() as client:
            assert (await client.post("/v1/images/generations", json=body)).status_code == 200
            edit = await client.post(
                "/v1/images/edits",
                files={"image": ("in.png", png(32, 32), "image/png")},
                data={"prompt": "p", "num_inference_steps": "3"},
            )
            assert edit.status_code == 200, edit.text
            job = await client.post("/v1/jobs", json=body)
            assert job.status_code == 202, job.text
            await wait_until(lambda: server.engine().statistics().finished_completed == 3)
            s = samples(server.metrics)
    for route in ("/v1/images/generations", "/v1/images/edits", "/v1/jobs"):
        assert s[("omni_trio_admission_seconds_count", (("route", route),))] == 1, route
        assert s[("omni_trio_admission_seconds_sum", (("route", route),))] > 0
    # A tick per step: 3 steps each (an edit's strength runs fewer), batched or not.
    assert 3 <= s[("omni_trio_tick_seconds_count", (("replica", "0"),))] <= 9
    assert s[("omni_trio_tick_seconds_sum", (("replica", "0"),))] > 0


async def test_a_cancelled_generation_counts_its_wasted_steps_and_cancel_latency() -> None:
    """A real server: a long generation cancelled mid-run shows up as wasted steps and one
    cancel latency; the completed one before it as a wave of one."""
    import trio

    from .conftest import CAP_S, run_server, wait_until

    with trio.fail_after(CAP_S):
        async with run_server() as server, server.client() as client:
            body = {"prompt": "p", "size": "64x64", "num_inference_steps": 2}
            assert (await client.post("/v1/images/generations", json=body)).status_code == 200
            long = {**body, "num_inference_steps": 200}
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    lambda: client.post(
                        "/v1/images/generations", json=long, headers={"X-Request-Id": "w"}
                    )
                )
                await wait_until(lambda: (server.pool.progress("w") or (0, 0))[0] >= 3)
                assert (await client.delete("/v1/requests/w")).status_code == 200
            await wait_until(lambda: server.engine().statistics().wasted_steps > 0)
            s = samples(server.metrics)
    r0 = (("replica", "0"),)
    assert s[("omni_trio_wasted_steps_total", r0)] >= 3
    assert s[("omni_trio_cancel_latency_seconds_count", r0)] == 1
    assert s[("omni_trio_batch_size_count", r0)] >= 2


_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count")}


async def test_every_dashboard_query_names_a_metric_the_server_exports() -> None:
    """supervisors/grafana-dashboard.json, read against a real server's /metrics after a
    generation: each metric name in each query is one the exposition has."""
    import json
    import re
    from pathlib import Path

    import trio

    from .conftest import CAP_S, run_server

    dashboard = json.loads(
        (Path(__file__).parents[2] / "supervisors" / "grafana-dashboard.json").read_text()
    )
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(queries) >= 20
    with trio.fail_after(CAP_S):
        async with run_server() as server, server.client() as client:
            r = await client.post(
                "/v1/images/generations",
                json={"prompt": "p", "size": "64x64", "num_inference_steps": 3},
            )
            assert r.status_code == 200, r.text
            text = (await client.get("/metrics")).text
    exported: set[str] = set()
    for family in text_string_to_metric_families(text):
        exported.add(family.name)
        exported.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ()))
    for query in queries:
        names = set(re.findall(r"\bomni_trio_[a-z_]+", query))
        assert names, query
        assert names <= exported, (query, sorted(names - exported))


def test_sleep_state_level_and_sleeps_per_replica() -> None:
    stats = {"waiting": 1, "running": 0, "sleep_state": "asleep", "sleep_level": 2, "sleeps": 3}
    pool = FakePool([replica(0, "sleeping", statistics=stats)], in_flight=1, draining=False)
    s = samples(ServeMetrics(cast(EnginePool, pool)))
    states = {
        state: s[("omni_trio_sleep_state", (("replica", "0"), ("state", state)))]
        for state in ("awake", "falling_asleep", "asleep", "waking")
    }
    assert states == {"awake": 0, "falling_asleep": 0, "asleep": 1, "waking": 0}
    assert s[("omni_trio_sleep_level", (("replica", "0"),))] == 2
    assert s[("omni_trio_sleeps_total", (("replica", "0"),))] == 3
    # Sleeping is alive and not ready: 1, as a restart (0 is dead or failed).
    assert s[("omni_trio_engine_state", (("replica", "0"),))] == 1
