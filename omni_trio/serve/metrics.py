"""Prometheus metrics of one server (``GET /metrics``), in a registry of its own.

Counted by the app as requests end::

    omni_trio_requests_total{route,status}      every HTTP request, by route template and status
                                                (route="protocol_error": refused by the HTTP
                                                server itself, 400/431/501/505)
    omni_trio_images_generated_total            images returned to clients
    omni_trio_aborts_total{reason}              generations aborted: cancelled (DELETE),
                                                disconnect, timeout, drain
    omni_trio_queue_wait_seconds                histograms of completed generations' phases
    omni_trio_execution_seconds                 (engine queue wait, engine execution, and the
    omni_trio_end_to_end_seconds                server's total from request to response)
    omni_trio_step_seconds                      the median denoising step of each (request mode;
                                                step mode: omni_trio_tick_seconds)
    omni_trio_packing_seconds                   its output packing (postprocess, D2H, shm)
    omni_trio_encode_seconds                    the server encoding its images (PNG/JPEG/WebP)
    omni_trio_admission_seconds{route}          an admitted generation's, edit's or job's
                                                arrival to its admission by the engine (body
                                                read, parsing, auth, validation, admit)

Set by the HTTP server and the app as they go::

    omni_trio_connections                       open client connections (max_connections)
    omni_trio_connections_refused_total         connections refused at the connection cap
    omni_trio_slow_clients_total{reason}        clients dropped or answered 408 for being slow,
                                                once each: send_timeout, body_timeout
    omni_trio_response_bytes_in_flight          response bytes held for clients: reserved
                                                answers of generations, answers being written
                                                (max_response_bytes_in_flight)

Read from the pool at scrape time (a custom collector, so nothing polls)::

    omni_trio_queue_depth                       requests waiting in the engines
    omni_trio_running                           requests running in the engines
    omni_trio_in_flight                         requests in flight through the pool
    omni_trio_replicas_ready                    replicas open and healthy
    omni_trio_draining                          1 while the server drains
    omni_trio_engine_state{replica}             0 dead/failed, 1 starting/restarting/sleeping,
                                                2 ready
    omni_trio_sleep_state{replica,state}        1 for the replica's sleep state (awake,
                                                falling_asleep, asleep, waking), 0 for others
    omni_trio_sleep_level{replica}              the level it sleeps at (0: awake)
    omni_trio_sleeps_total{replica}             sleeps completed by the replica's engine
    omni_trio_worker_restarts_total{replica}    worker-group restarts inside the replica
    omni_trio_replica_restarts_total{replica}   replica reopens by the pool supervisor
    omni_trio_requests_requeued_total{replica}  requests run again after a worker-group failure
    omni_trio_requests_finished_total{replica,status}  requests ended: completed, aborted, error
    omni_trio_packing{replica}                  requests computed and still being packed
    omni_trio_worker_state{replica,worker,state}  1 for each worker's current state (starting,
                                                running, restarting, failed, stopped, ...)
    omni_trio_batch_size{replica}               histogram: requests per wave / tick dispatched
    omni_trio_cancel_latency_seconds{replica}   histogram: abort of a request whose compute was
                                                in flight to the end of that compute
    omni_trio_wasted_steps_total{replica}       steps computed for requests that then ended
                                                aborted or failed
    omni_trio_tick_seconds{replica}             histogram: step mode's ticks (one denoising
                                                step of every request in it), dispatch to
                                                result; none in request mode
    omni_trio_rank_restarts_total{replica}      data-parallel rank groups restarted on their own
                                                while the others served
    omni_trio_step_time_seconds{replica,pixels} one denoising step of one image at that size
                                                (pixels per image), as the replica's engine
                                                measured it (a moving average): what the
                                                admission estimates weigh a step by
    omni_trio_requests_moved_total{reason}      requests moved to another replica before any
                                                chunk reached the client: replica_died, or
                                                workers_restarting (its worker group failed)

``supervisors/grafana-dashboard.json`` charts these; a test checks that each of its queries
names a metric this module exports.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .._core.health import CANCEL_LATENCY_BUCKETS_S, TICK_BUCKETS_S
from .._core.messages import RequestMetrics

if TYPE_CHECKING:
    from .pool import EnginePool

__all__ = ["CONTENT_TYPE", "ENGINE_STATE_VALUES", "ServeMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Anything else (dead, failed, closed): 0.  Sleeping is alive and not ready, like a restart.
ENGINE_STATE_VALUES = {"ready": 2, "starting": 1, "restarting": 1, "sleeping": 1}
SLEEP_STATES = ("awake", "falling_asleep", "asleep", "waking")
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Admission is the server's own work (and the upload): finer at the bottom.
_ADMISSION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 10, 30)


def _add_batch_sizes(
    family: HistogramMetricFamily, label: list[str], sizes: Iterable[Iterable[int]]
) -> None:
    """One histogram of dispatch sizes from (size, dispatches) pairs."""
    counts = [0] * (len(BATCH_SIZE_BUCKETS) + 1)
    total = 0
    for size, dispatches in (tuple(pair) for pair in sizes):
        index = next(
            (i for i, bound in enumerate(BATCH_SIZE_BUCKETS) if size <= bound),
            len(BATCH_SIZE_BUCKETS),
        )
        counts[index] += dispatches
        total += size * dispatches
    family.add_metric(label, _cumulative(BATCH_SIZE_BUCKETS, counts), total)


def _add_cancel_latency(
    family: HistogramMetricFamily, label: list[str], stats: dict[str, object]
) -> None:
    counts = list(stats.get("cancel_latency_counts") or ())  # type: ignore[call-overload]
    if len(counts) != len(CANCEL_LATENCY_BUCKETS_S) + 1:
        counts = [0] * (len(CANCEL_LATENCY_BUCKETS_S) + 1)
    total = float(stats.get("cancel_latency_sum_s") or 0.0)  # type: ignore[arg-type]
    family.add_metric(label, _cumulative(CANCEL_LATENCY_BUCKETS_S, counts), total)


def _add_ticks(family: HistogramMetricFamily, label: list[str], stats: dict[str, object]) -> None:
    counts = list(stats.get("tick_counts") or ())  # type: ignore[call-overload]
    if len(counts) != len(TICK_BUCKETS_S) + 1:
        counts = [0] * (len(TICK_BUCKETS_S) + 1)
    total = float(stats.get("tick_sum_s") or 0.0)  # type: ignore[arg-type]
    family.add_metric(label, _cumulative(TICK_BUCKETS_S, counts), total)


def _cumulative(bounds: Iterable[float], counts: list[int]) -> list[tuple[str, float]]:
    buckets: list[tuple[str, float]] = []
    running = 0
    for bound, count in zip((*bounds, float("inf")), counts, strict=True):
        running += count
        buckets.append((floatToGoString(bound), running))
    return buckets


class _PoolCollector(Collector):
    """Gauges and counters read from the pool when Prometheus scrapes."""

    def __init__(self, pool: EnginePool) -> None:
        self._pool = pool

    def describe(self) -> Iterable[Metric]:
        return []  # registering must not call collect() (the pool may not serve yet)

    def collect(self) -> Iterable[Metric]:
        pool = self._pool
        info = pool.replicas_info()
        waiting = running = ready = 0
        state = GaugeMetricFamily(
            "omni_trio_engine_state",
            "Engine state per replica: 0 dead or failed, 1 starting or restarting, 2 ready",
            labels=["replica"],
        )
        worker_restarts = CounterMetricFamily(
            "omni_trio_worker_restarts",
            "Worker-group restarts inside each replica's engines",
            labels=["replica"],
        )
        replica_restarts = CounterMetricFamily(
            "omni_trio_replica_restarts",
            "Replica reopens by the pool supervisor",
            labels=["replica"],
        )
        requeued = CounterMetricFamily(
            "omni_trio_requests_requeued",
            "Requests run again after a worker-group failure, per replica engine",
            labels=["replica"],
        )
        finished = CounterMetricFamily(
            "omni_trio_requests_finished",
            "Requests ended in each replica's engine, by status",
            labels=["replica", "status"],
        )
        packing = GaugeMetricFamily(
            "omni_trio_packing",
            "Requests computed whose outputs are still being packed",
            labels=["replica"],
        )
        workers = GaugeMetricFamily(
            "omni_trio_worker_state",
            "1 for each worker's current state",
            labels=["replica", "worker", "state"],
        )
        batch = HistogramMetricFamily(
            "omni_trio_batch_size",
            "Requests per dispatched wave (request mode) or tick (step mode)",
            labels=["replica"],
        )
        cancel = HistogramMetricFamily(
            "omni_trio_cancel_latency_seconds",
            "Abort of a request whose compute was in flight to the end of that compute",
            labels=["replica"],
        )
        wasted = CounterMetricFamily(
            "omni_trio_wasted_steps",
            "Denoising steps computed for requests that then ended aborted or failed",
            labels=["replica"],
        )
        ticks = HistogramMetricFamily(
            "omni_trio_tick_seconds",
            "Step mode: each tick (one denoising step of every request in it), dispatch to result",
            labels=["replica"],
        )
        rank_restarts = CounterMetricFamily(
            "omni_trio_rank_restarts",
            "Data-parallel rank groups restarted on their own while the others served",
            labels=["replica"],
        )
        step_seconds = GaugeMetricFamily(
            "omni_trio_step_time_seconds",
            "One denoising step of one image, by pixels per image, as measured (moving average)",
            labels=["replica", "pixels"],
        )
        sleep_state = GaugeMetricFamily(
            "omni_trio_sleep_state",
            "1 for each replica's sleep state (awake, falling_asleep, asleep, waking)",
            labels=["replica", "state"],
        )
        sleep_level = GaugeMetricFamily(
            "omni_trio_sleep_level",
            "The level each replica's workers sleep at (0: awake)",
            labels=["replica"],
        )
        sleeps = CounterMetricFamily(
            "omni_trio_sleeps",
            "Sleeps completed by each replica's engine",
            labels=["replica"],
        )
        for replica in info:
            label = [str(replica["index"])]
            stats = replica["statistics"]
            if stats is not None:
                current = str(stats.get("sleep_state", "awake"))
                for name in SLEEP_STATES:
                    sleep_state.add_metric([*label, name], int(name == current))
                sleep_level.add_metric(label, stats.get("sleep_level", 0))
                sleeps.add_metric(label, stats.get("sleeps", 0))
                _add_batch_sizes(batch, label, stats.get("batch_sizes", ()))
                _add_cancel_latency(cancel, label, stats)
                _add_ticks(ticks, label, stats)
                wasted.add_metric(label, stats.get("wasted_steps", 0))
                rank_restarts.add_metric(label, stats.get("rank_restarts", 0))
                for pixels, seconds in stats.get("step_time_s", ()):
                    step_seconds.add_metric([*label, str(pixels)], seconds)
                waiting += stats["waiting"]
                running += stats["running"]
                requeued.add_metric(label, stats.get("requeued", 0))
                packing.add_metric(label, stats.get("packing", 0))
                for status in ("completed", "aborted", "error"):
                    finished.add_metric([*label, status], stats.get(f"finished_{status}", 0))
                for worker in stats.get("workers", ()):
                    status = str(worker["state"])
                    workers.add_metric([*label, str(worker["rank"]), status], 1)
            ready += bool(replica["healthy"])
            state.add_metric(label, ENGINE_STATE_VALUES.get(replica["state"], 0))
            worker_restarts.add_metric(label, replica["worker_restarts"])
            replica_restarts.add_metric(label, replica["restarts"])
        yield GaugeMetricFamily(
            "omni_trio_queue_depth", "Requests waiting in the engines", value=waiting
        )
        yield GaugeMetricFamily(
            "omni_trio_running", "Requests running in the engines", value=running
        )
        yield GaugeMetricFamily(
            "omni_trio_in_flight", "Requests in flight through the pool", value=pool.in_flight
        )
        yield GaugeMetricFamily(
            "omni_trio_replicas_ready", "Replicas open and healthy", value=ready
        )
        yield GaugeMetricFamily(
            "omni_trio_draining", "1 while the server drains", value=int(pool.draining)
        )
        moved = CounterMetricFamily(
            "omni_trio_requests_moved",
            "Requests moved to another replica (before any chunk reached the client), by why",
            labels=["reason"],
        )
        for reason, count in getattr(pool, "moved", {}).items():
            moved.add_metric([reason], count)
        yield moved
        yield state
        yield worker_restarts
        yield replica_restarts
        yield requeued
        yield finished
        yield batch
        yield cancel
        yield wasted
        yield ticks
        yield step_seconds
        yield rank_restarts
        yield packing
        yield workers
        yield sleep_state
        yield sleep_level
        yield sleeps


class ServeMetrics:
    """The server's metrics in their own :class:`CollectorRegistry` (several servers in one
    process never share one).  ``pool``, if given, is read at every scrape."""

    def __init__(self, pool: EnginePool | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "omni_trio_requests",
            "HTTP requests by route template and status",
            ["route", "status"],
            registry=r,
        )
        self.images_generated = Counter(
            "omni_trio_images_generated", "Images returned to clients", registry=r
        )
        self.aborts = Counter(
            "omni_trio_aborts", "Generations aborted, by reason", ["reason"], registry=r
        )
        self.queue_wait = Histogram(
            "omni_trio_queue_wait_seconds",
            "Engine queue wait of completed generations",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.execution = Histogram(
            "omni_trio_execution_seconds",
            "Engine execution time of completed generations",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.end_to_end = Histogram(
            "omni_trio_end_to_end_seconds",
            "Server time from request to response of completed generations",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.step = Histogram(
            "omni_trio_step_seconds",
            "Median denoising step time of completed generations (request mode)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.packing = Histogram(
            "omni_trio_packing_seconds",
            "Output packing time of completed generations (postprocess, D2H, shared memory)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.encode = Histogram(
            "omni_trio_encode_seconds",
            "Time the server spent encoding a generation's images (PNG, JPEG, WebP)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.admission = Histogram(
            "omni_trio_admission_seconds",
            "A generation's, edit's or job's arrival to its admission by the engine (body "
            "read, parsing, auth, validation, admit), by route",
            ["route"],
            buckets=_ADMISSION_BUCKETS,
            registry=r,
        )
        self.connections = Gauge("omni_trio_connections", "Open client connections", registry=r)
        self.connections_refused = Counter(
            "omni_trio_connections_refused",
            "Connections refused at the connection cap (max_connections)",
            registry=r,
        )
        self.slow_clients = Counter(
            "omni_trio_slow_clients",
            "Clients dropped (send_timeout) or answered 408 (body_timeout) for being slow",
            ["reason"],
            registry=r,
        )
        self.response_bytes_in_flight = Gauge(
            "omni_trio_response_bytes_in_flight",
            "Response bytes held for clients: generations' reserved answers and answers being "
            "written (max_response_bytes_in_flight)",
            registry=r,
        )
        self.jobs = Counter(
            "omni_trio_jobs",
            "Jobs (POST /v1/jobs) that ended, by status (completed, failed, cancelled)",
            ["status"],
            registry=r,
        )
        self.webhooks = Counter(
            "omni_trio_webhook_calls",
            "Webhook calls of jobs by event and outcome (delivered, retry, failed)",
            ["event", "outcome"],
            registry=r,
        )
        if pool is not None:
            r.register(_PoolCollector(pool))

    def observe_request(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def observe_abort(self, reason: str) -> None:
        self.aborts.labels(reason=reason).inc()

    def observe_job(self, status: str) -> None:
        self.jobs.labels(status=status).inc()

    def observe_webhook(self, event: str, outcome: str) -> None:
        self.webhooks.labels(event=event, outcome=outcome).inc()

    def observe_connection_refused(self) -> None:
        self.connections_refused.inc()

    def observe_slow_client(self, reason: str) -> None:
        self.slow_clients.labels(reason=reason).inc()

    def observe_generation(self, metrics: RequestMetrics, total_ms: float, images: int) -> None:
        """A completed generation: its phases and the images it returned."""
        self.images_generated.inc(images)
        self.queue_wait.observe(metrics.queue_wait_ms / 1000.0)
        self.execution.observe(metrics.execution_ms / 1000.0)
        self.end_to_end.observe(total_ms / 1000.0)
        if metrics.step_ms is not None:
            self.step.observe(metrics.step_ms / 1000.0)
        self.packing.observe(metrics.postprocess_ms / 1000.0)

    def observe_encode(self, seconds: float) -> None:
        """A generation's images encoded for its answer."""
        self.encode.observe(seconds)

    def observe_admission(self, route: str, seconds: float) -> None:
        """A generation, edit or job admitted by the engine ``seconds`` after it arrived."""
        self.admission.labels(route=route).observe(seconds)

    def render(self) -> bytes:
        """The text exposition of every metric (content type :data:`CONTENT_TYPE`)."""
        return generate_latest(self.registry)
