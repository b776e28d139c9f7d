"""``bench serve``: the HTTP daemon under load, against the same model served in-process.

Issue #6's measurement.  In one trio run the command starts what ``omni-trio serve`` runs (an
:class:`~omni_trio.serve.pool.EnginePool` of one replica and the
:class:`~omni_trio.serve.app.ImagesApp`, built by the daemon's own code, under hypercorn's trio
worker on a free loopback port) and, next to it, a plain engine (``open_engine``) with the same
:class:`~omni_trio.config.EngineConfig`.  Both are open at once and measured in turn (http,
direct, http, direct ...), round after round, so a noisy patch of the machine hits both.

Two modes send the same request (``--model``, default ``builtin:echo`` with ``--steps`` (4)
steps of ``--step-delay-ms`` (5) ms; ``--size`` 64x64; fixed seed):

``http``    ``POST /v1/images/generations`` with ``response_format=b64_json`` through one shared
            ``httpx.AsyncClient`` (connection limits sized to the clients); the JSON answer is
            decoded.
``direct``  ``engine.generate`` on the second engine, then the image encoded as the app
            encodes it: PNG in a worker thread (``trio.to_thread``), then base64.  Both modes
            pay the PNG encoding, so the difference is what HTTP, JSON, ASGI, the pool and the
            client cost, not the image encoding.

Two parts:

closed loop  at each ``--concurrency`` (1, 4, 16), C clients send ``--requests`` (64)
             requests back to back per round; ``--warmup`` unmeasured rounds first.
open loop    Poisson arrivals at ``--rate`` requests/s (default: 70 % of the http closed-loop
             throughput at the highest concurrency) for ``--duration-s`` (20) seconds, each
             request in its own task; in a round both modes get the same seeded arrival times.
             Latency counts from the scheduled arrival, so a late sender cannot hide queueing.
             Achieved requests/s = completed / max(duration, last completion).

Three more parts (issue #20, :mod:`.serve_api`), on the same server: ``jobs`` (the jobs API
against the synchronous endpoint), ``replay`` (resuming a job's events after a forced
disconnect: events lost must be 0) and ``metrics`` (the server with and without its metrics,
a second server whose metrics record nothing; the first is scraped once a second
meanwhile).  ``--parts`` picks what runs (default all).

Reported per part, load and mode: requests/s (min / median / max over rounds), latency p50 /
p90 / p99 over every completed request, errors by HTTP status (http) or error type (direct);
pair by pair, http / direct requests/s, and the latency the HTTP path adds per request (http
p50 - direct p50 over all requests; per round in the JSON).  The JSON also has the server's own
time per request (``metrics.total_ms`` of the answer: from the ASGI call to the body built), so
the added latency splits into the app's part and hypercorn's + the client's.

What the http figures include that a deployment would not: the client (httpx, JSON encoding
and decoding) runs in this process, on the same trio thread as the server, sharing the CPU and
the GIL with it.  The access log is formatted as the daemon's text log and written to
/dev/null (the daemon writes it to stderr).  ``--torch-threads`` defaults to 1: the HTTP side
wants a core while a forward runs.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from .._core.request import SamplingParams
from ..config import EngineConfig
from ..errors import RequestAbortedError, RequestFailedError
from .harness import (
    Progress,
    Report,
    Summary,
    pair_differences,
    pair_ratios,
    positive_ints_arg,
    run_in_trio,
    run_interleaved_async,
)
from .load import (
    Call,
    LoadResult,
    Outcome,
    closed_loop,
    mode_summary,
    open_loop,
    poisson_arrivals,
)

if TYPE_CHECKING:
    import httpx

    from ..runtime.engine import AsyncEngine
    from ..serve.config import ServeConfig

__all__ = [
    "add_arguments",
    "compare_modes",
    "format_errors",
    "generation_body",
    "open_loop_rate",
    "run",
]

PROMPT = "a photograph of an astronaut riding a horse"
SEED = 1234  # every request's sampling seed (the same work in both modes)
ARRIVAL_SEED = 6  # the open loop's arrival times in round i use ARRIVAL_SEED + i
RATE_FRACTION = 0.7  # default open-loop rate: this fraction of the http closed-loop capacity
HTTP_TIMEOUT_S = 300.0  # per request, for the slowest model at the deepest queue
GENERATIONS = "/v1/images/generations"
MODES = ("http", "direct")
PARTS = ("closed", "open", "jobs", "replay", "metrics")
COLUMNS = [
    "part",
    "load",
    "mode",
    "requests/s min / med / max",
    "latency ms p50 / p90 / p99",
    "errors",
    "http / direct req/s min / med / max",
    "added ms (p50)",
]


# -- pure helpers ------------------------------------------------------------------------------


def generation_body(
    *, steps: int, size: int, seed: int = SEED, prompt: str = PROMPT
) -> dict[str, Any]:
    """The JSON body both modes run: the http mode posts it, the direct mode runs the
    ``SamplingParams`` the app parses from it."""
    return {
        "prompt": prompt,
        "size": f"{size}x{size}",
        "num_inference_steps": steps,
        "seed": seed,
        "response_format": "b64_json",
        "output_format": "png",
    }


def open_loop_rate(given: float | None, closed_rps: Sequence[float]) -> tuple[float, str]:
    """The open loop's rate and where it came from: ``given``, else :data:`RATE_FRACTION` of
    the median of ``closed_rps`` (the http closed-loop requests/s at the highest concurrency,
    one per round).  Raises ``ValueError`` when there is nothing to derive it from."""
    if given is not None:
        return given, "given"
    measured = [r for r in closed_rps if r > 0]
    if not measured:
        raise ValueError("no closed-loop throughput to derive the open-loop rate from")
    median = Summary.of(measured).median
    return RATE_FRACTION * median, f"{RATE_FRACTION:.0%} of {median:.4g} req/s"


def format_errors(errors: Counter[str] | dict[str, int], unfinished: int = 0) -> str:
    """``"0"``, or ``"429 x3, ReadTimeout x1"`` (most frequent first), for a table cell."""
    counts = Counter(errors)
    if unfinished:
        counts["unfinished"] += unfinished
    if not counts:
        return "0"
    return ", ".join(f"{key} x{n}" for key, n in counts.most_common())


def compare_modes(http: Sequence[LoadResult], direct: Sequence[LoadResult]) -> dict[str, Any]:
    """http against direct, round by round: the requests/s ratio per pair; the latency the
    HTTP path adds, as the difference of the p50s over all requests and per round."""
    ratios = pair_ratios([r.requests_per_s for r in http], [r.requests_per_s for r in direct])
    pairs = [(h, d) for h, d in zip(http, direct, strict=True) if h.completed and d.completed]
    added_rounds = pair_differences(
        [Summary.of(h.latencies_s).p50 * 1000.0 for h, _ in pairs],
        [Summary.of(d.latencies_s).p50 * 1000.0 for _, d in pairs],
    )
    http_lat = [s for r in http for s in r.latencies_s]
    direct_lat = [s for r in direct for s in r.latencies_s]
    added = (
        (Summary.of(http_lat).p50 - Summary.of(direct_lat).p50) * 1000.0
        if http_lat and direct_lat
        else None
    )
    return {
        "http_over_direct_requests_per_s": Summary.of(ratios) if ratios else None,
        "added_latency_ms_p50": added,
        "added_latency_ms_p50_per_round": Summary.of(added_rounds) if added_rounds else None,
    }


# -- the two modes -----------------------------------------------------------------------------


def _http_call(client: httpx.AsyncClient, body: dict[str, Any]) -> Call:
    import httpx

    async def call() -> Outcome:
        try:
            response = await client.post(GENERATIONS, json=body)
        except httpx.HTTPError as exc:
            return Outcome(type(exc).__name__)
        if response.status_code != 200:
            return Outcome(str(response.status_code))
        answer = response.json()
        data = answer.get("data") or [{}]
        if not isinstance(data[0].get("b64_json"), str):
            return Outcome("200 without b64_json")
        metrics = answer.get("metrics") or {}
        return Outcome(
            None, _number(metrics.get("total_ms")), _number(metrics.get("queue_wait_ms"))
        )

    return call


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _direct_call(engine: AsyncEngine, prompt: str, params: SamplingParams) -> Call:
    from ..serve.images import encode_b64, encode_image

    def encode(images: Sequence[Any]) -> list[bytes]:
        return [encode_image(image, "png") for image in images]

    async def call() -> Outcome:
        try:
            output = await engine.generate(prompt, params)
        except (RequestFailedError, RequestAbortedError) as exc:
            return Outcome(getattr(exc, "error_type", None) or type(exc).__name__)
        # As ImagesApp._encode_all and _generate_json: PNG in a thread, base64 on this one.
        blobs = await trio.to_thread.run_sync(encode, output.images)
        if not [encode_b64(blob) for blob in blobs]:
            return Outcome("no image")
        return Outcome(queue_wait_ms=output.metrics.queue_wait_ms)

    return call


def _http_client(url: str, connections: int | None) -> httpx.AsyncClient:
    import httpx

    keepalive = connections if connections is not None else 256
    return httpx.AsyncClient(
        base_url=url,
        timeout=HTTP_TIMEOUT_S,
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=keepalive),
    )


# -- the server --------------------------------------------------------------------------------


@asynccontextmanager
async def _open_http_server(config: ServeConfig, *, metrics: bool = True) -> AsyncIterator[str]:
    """The daemon's pool, app and hypercorn (built by the daemon's own code) serving on
    ``config.bind``; yields the bound URL once the replica is warm.  On exit the HTTP server
    is stopped through its shutdown trigger (open connections get hypercorn's graceful
    timeout), then the pool is cancelled, which closes its engine."""
    # The daemon's private builders, so that limits, store, metrics, access log and
    # hypercorn settings are exactly what ``omni-trio serve`` runs.  Constructing _Daemon has
    # no side effect (no signal handler, no notifier socket: both belong to its run()).
    from ..serve.daemon import GRACEFUL_TIMEOUT_S, _Daemon
    from ..serve.notify import SystemdNotifier
    from ..serve.pool import EnginePool

    daemon = _Daemon(config, SystemdNotifier(None), None, sys.stderr)
    pool = EnginePool(config.engine, replicas=config.replicas, max_queue_len=config.max_queue_len)
    app = daemon._build_app(pool)
    if not metrics:  # the "without" side of the metrics part: nothing is recorded
        from .serve_api import NullMetrics

        app.metrics = NullMetrics()
    hc = daemon._hypercorn_config()
    async with trio.open_nursery() as nursery:
        await nursery.start(pool.serve)
        await nursery.start(app.serve)  # the jobs
        binds = await nursery.start(daemon._serve_http, app, hc)
        try:
            yield binds[0] if binds else f"http://{config.bind}"
        finally:
            daemon.stop_http.set()
            try:
                with trio.move_on_after(GRACEFUL_TIMEOUT_S + 5.0):
                    await daemon.http_stopped.wait()
            finally:
                nursery.cancel_scope.cancel()  # the pool: closes its engine (shielded)


@contextmanager
def _access_log_to_devnull() -> Iterator[None]:
    """The daemon's access log as it runs it (one text line per request at INFO, through its
    formatter) but written to /dev/null: its cost is in the http figures, its output not."""
    from ..serve.daemon import TextFormatter

    logger = logging.getLogger("omni_trio.serve.access")
    saved = (logger.level, logger.propagate)
    with open(os.devnull, "w", encoding="utf-8") as sink:
        handler = logging.StreamHandler(sink)
        handler.setFormatter(TextFormatter())
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.setLevel(saved[0])
            logger.propagate = saved[1]


# -- the experiment ----------------------------------------------------------------------------


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="builtin:echo", help="default builtin:echo")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps (default 4)")
    parser.add_argument(
        "--step-delay-ms",
        type=float,
        default=None,
        help="builtin:echo only: ms slept per step (default 5)",
    )
    parser.add_argument("--size", type=int, default=64, help="height = width (default 64)")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="engine batch (default 4)")
    parser.add_argument(
        "--concurrency",
        type=positive_ints_arg,
        default=None,
        help="closed-loop clients, comma-separated (default 1,4,16; quick 4)",
    )
    parser.add_argument(
        "--requests", type=int, default=None, help="closed-loop requests per round (default 64)"
    )
    parser.add_argument(
        "--rate",
        type=_positive_float,
        default=None,
        help="open-loop requests/s (default 70%% of the http closed-loop throughput at the "
        "highest concurrency)",
    )
    parser.add_argument(
        "--duration-s",
        type=_positive_float,
        default=None,
        help="open-loop seconds per mode and round (default 20; quick 3)",
    )
    parser.add_argument(
        "--max-queue-len",
        type=int,
        default=None,
        help="the daemon's in-flight limit (then 429); default the daemon's own (64)",
    )
    parser.add_argument(
        "--torch-threads", type=int, default=1, help="per engine worker (default 1)"
    )
    parser.add_argument(
        "--parts",
        type=_parts_arg,
        default=PARTS,
        help=f"comma-separated parts to run (default {','.join(PARTS)})",
    )
    parser.add_argument(
        "--replay-jobs", type=int, default=None, help="jobs of the replay part (default 16)"
    )
    parser.add_argument("--cache-dir", default=None)


def _parts_arg(text: str) -> tuple[str, ...]:
    parts = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"parts are {', '.join(PARTS)}; got {text!r}")
    return parts


@dataclass(frozen=True, slots=True)
class _Plan:
    requests: int
    concurrency: tuple[int, ...]
    repeats: int
    warmup: int
    duration_s: float
    body: dict[str, Any]
    engine: EngineConfig
    options: dict[str, Any]


def _plan(args: argparse.Namespace) -> _Plan:
    quick = args.quick
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.size < 8 or args.size % 8:
        raise ValueError(f"--size must be a positive multiple of 8, got {args.size}")
    if args.requests is not None and args.requests < 1:
        raise ValueError(f"--requests must be >= 1, got {args.requests}")
    options: dict[str, Any] = {}
    if args.model == "builtin:echo":
        delay_ms = 5.0 if args.step_delay_ms is None else args.step_delay_ms
        if not (math.isfinite(delay_ms) and delay_ms >= 0):
            raise ValueError(f"--step-delay-ms must be >= 0, got {delay_ms}")
        options["step_delay_s"] = delay_ms / 1000.0
    elif args.step_delay_ms is not None:
        raise ValueError("--step-delay-ms applies to builtin:echo only")
    engine = EngineConfig(
        model=args.model,
        model_options=options,
        backend="inproc",
        max_num_seqs=args.max_num_seqs,
        torch_threads=args.torch_threads,
        cache_dir=args.cache_dir,
    )
    return _Plan(
        requests=args.requests or (8 if quick else 64),
        concurrency=args.concurrency or ((4,) if quick else (1, 4, 16)),
        repeats=args.repeats or (1 if quick else 3),
        warmup=1 if args.warmup is None else args.warmup,
        duration_s=args.duration_s or (3.0 if quick else 20.0),
        body=generation_body(steps=args.steps, size=args.size),
        engine=engine,
        options=options,
    )


def _serve_config(plan: _Plan, args: argparse.Namespace) -> ServeConfig:
    from ..serve.config import ServeConfig

    config = ServeConfig(port=0, engine=plan.engine)  # 127.0.0.1, a free port
    if args.max_queue_len is not None:
        config = config.replace(max_queue_len=args.max_queue_len)
    return config


def _add_rows(
    report: Report, part: str, load: str, http: list[LoadResult], direct: list[LoadResult]
) -> dict[str, Any]:
    entry: dict[str, Any] = {"http": mode_summary(http), "direct": mode_summary(direct)}
    entry.update(compare_modes(http, direct))
    ratio = entry["http_over_direct_requests_per_s"]
    added = entry["added_latency_ms_p50"]
    for mode in MODES:
        figures = entry[mode]
        latency = figures["latency_ms"]
        report.rows.append(
            {
                "part": part,
                "load": load,
                "mode": mode,
                "requests/s min / med / max": figures["requests_per_s"].spread("{:.1f}"),
                "latency ms p50 / p90 / p99": latency.tail("{:.1f}") if latency else "-",
                "errors": format_errors(figures["errors"], figures["unfinished"]),
                "http / direct req/s min / med / max": (
                    ratio.spread("{:.3f}") if mode == "http" and ratio else "-"
                ),
                "added ms (p50)": f"{added:.2f}" if mode == "http" and added is not None else "-",
            }
        )
        failed = figures["failed"] + figures["unfinished"]
        if failed:
            report.notes.append(
                f"{part} {load} {mode}: {failed} of {figures['requests']} requests did not "
                f"complete ({format_errors(figures['errors'], figures['unfinished'])})"
            )
    return entry


async def _main(args: argparse.Namespace, report: Report) -> None:
    from ..runtime.engine import open_engine
    from ..serve.images import ServeLimits, parse_generation_request

    plan = _plan(args)
    config = _serve_config(plan, args)
    limits = ServeLimits(
        max_body_bytes=config.max_body_bytes,
        max_prompt_chars=config.max_prompt_chars,
        max_n=config.max_n,
        max_pixels=config.max_pixels,
        max_steps=config.max_steps,
        max_upload_bytes=config.max_upload_bytes,
        max_upload_pixels=config.max_upload_pixels,
    )
    parsed = parse_generation_request(
        plan.body, limits=limits, default_model=config.served_model_name
    )
    report.params.update(
        {
            "model": args.model,
            "model_options": plan.options,
            "backend": "inproc",
            "max_num_seqs": args.max_num_seqs,
            "torch_threads": config.engine.resolved_torch_threads,
            "steps": args.steps,
            "size": f"{args.size}x{args.size}",
            "body": plan.body,
            "concurrency": list(plan.concurrency),
            "requests_per_round": plan.requests,
            "duration_s": plan.duration_s,
            "max_queue_len": config.max_queue_len,
            "repeats": plan.repeats,
            "warmup_rounds": plan.warmup,
            "access_log": "text, to /dev/null",
            "quick": args.quick,
        }
    )
    parts = args.parts
    if "open" in parts and "closed" not in parts and args.rate is None:
        raise ValueError("--parts open without closed needs --rate")
    replay_jobs = args.replay_jobs or (3 if args.quick else 16)
    report.params.update({"parts": list(parts), "replay_jobs": replay_jobs})
    total = (
        (len(plan.concurrency) * plan.repeats if "closed" in parts else 0)
        + (plan.repeats if "open" in parts else 0)
        + len({"jobs", "replay", "metrics"} & set(parts))
    )
    results: dict[str, Any] = {}
    closed: dict[int, Rounds] = {}
    opened: Rounds | None = None
    rate, source = 0.0, ""
    # The plain engine first: a bad model fails here with its own error, before the server.
    async with open_engine(plan.engine) as engine, _open_http_server(config) as url:
        report.params["url"] = url
        direct = _direct_call(engine, parsed.prompt, parsed.params)
        with (
            _access_log_to_devnull(),
            Progress(total, "serve", enabled=not args.no_progress) as bar,
        ):
            if "closed" in parts:
                closed = await _closed_part(plan, url, direct, bar)
            if "open" in parts:
                top_http = closed[plan.concurrency[-1]][0] if closed else []
                rate, source = open_loop_rate(args.rate, [r.requests_per_s for r in top_http])
                if source != "given":
                    source += f" (http, C={plan.concurrency[-1]})"
                opened = await _open_part(plan, url, direct, rate, bar)
            api = await _api_parts(plan, parts, url, config, replay_jobs, bar)
    if closed:
        results["closed_loop"] = {
            str(c): _add_rows(report, "closed", f"C={c}", *rounds) for c, rounds in closed.items()
        }
    if opened is not None:
        entry = _add_rows(report, "open", f"{rate:.3g}/s Poisson", *opened)
        entry.update(
            {
                "rate_per_s": rate,
                "rate_source": source,
                "duration_s": plan.duration_s,
                "offered_per_round": [h.requests for h in opened[0]],
            }
        )
        results["open_loop"] = entry
        report.notes.append(
            f"open loop at {rate:.4g} requests/s ({source}), {plan.duration_s:g} s per mode "
            "and round"
        )
    results.update(_api_rows(report, api, plan))
    report.results = results
    for c, closed_entry in results.get("closed_loop", {}).items():
        _note_breakdown(report, f"closed C={c}", closed_entry)
    if "open_loop" in results:
        _note_breakdown(report, "open", results["open_loop"])


async def _api_parts(
    plan: _Plan,
    parts: Sequence[str],
    url: str,
    config: ServeConfig,
    replay_jobs: int,
    bar: Progress,
) -> dict[str, Any]:
    """The jobs, replay and metrics parts (:mod:`.serve_api`) that ``parts`` names."""
    from . import serve_api

    concurrency = plan.concurrency[-1]
    rounds: dict[str, Any] = {
        "requests": plan.requests,
        "concurrency": concurrency,
        "repeats": plan.repeats,
    }
    out: dict[str, Any] = {}
    async with _http_client(url, concurrency) as client:
        if "jobs" in parts:
            out["jobs"] = await serve_api.compare(
                {
                    "sync": _http_call(client, plan.body),
                    "job": serve_api.job_call(client, plan.body),
                },
                warmup=plan.warmup,
                **rounds,
            )
            bar.advance()
        if "replay" in parts:
            # Long enough for several progress ticks (0.25 s apart) per job.
            steps = min(config.max_steps, plan.body["num_inference_steps"] * 50)
            body = {**plan.body, "num_inference_steps": steps}
            out["replay"] = await serve_api.replay_probe(client, body, replay_jobs)
            bar.advance()
        if "metrics" in parts:
            async with (
                _open_http_server(config, metrics=False) as bare_url,
                _http_client(bare_url, concurrency) as bare,
            ):
                scraper = serve_api.Scraper(client)
                out["metrics"] = await serve_api.compare(
                    {
                        "with": _http_call(client, plan.body),
                        "without": _http_call(bare, plan.body),
                    },
                    warmup=plan.warmup,
                    alongside={"with": scraper.serve},
                    **rounds,
                )
                out["metrics_scrapes"] = {"ok": scraper.scrapes, "failed": scraper.failed}
            bar.advance()
    return out


def _api_rows(report: Report, api: dict[str, Any], plan: _Plan) -> dict[str, Any]:
    from .serve_api import SCRAPE_INTERVAL_S, summaries

    results: dict[str, Any] = {}
    load = f"C={plan.concurrency[-1]}"
    for part in ("jobs", "metrics"):
        if part not in api:
            continue
        entry = summaries(api[part])
        results[part] = entry
        first, second = list(api[part])
        for mode in (first, second):
            figures = entry[mode]
            latency = figures["latency_ms"]
            is_second = mode == second
            ratio = entry.get("requests_per_s_ratio")
            difference = entry.get("p50_difference_ms")
            report.rows.append(
                {
                    "part": part,
                    "load": load,
                    "mode": mode,
                    "requests/s min / med / max": figures["requests_per_s"].spread("{:.1f}"),
                    "latency ms p50 / p90 / p99": latency.tail("{:.1f}") if latency else "-",
                    "errors": format_errors(figures["errors"], figures["unfinished"]),
                    "http / direct req/s min / med / max": (
                        f"{ratio:.3f} (/ {first})" if is_second and ratio is not None else "-"
                    ),
                    "added ms (p50)": (
                        f"{difference:.2f}" if is_second and difference is not None else "-"
                    ),
                }
            )
            if figures["failed"]:
                report.notes.append(
                    f"{part} {mode}: {figures['failed']} requests failed "
                    f"({format_errors(figures['errors'], 0)})"
                )
    scrapes = api.get("metrics_scrapes")
    if scrapes is not None and "metrics" in results:
        results["metrics"]["scrapes"] = scrapes
        report.notes.append(
            f"metrics: /metrics scraped every {SCRAPE_INTERVAL_S:g} s during the with rounds "
            f"({scrapes['ok']} scrapes, {scrapes['failed']} failed)"
        )
    if "replay" in api:
        replay = results["replay"] = api["replay"]
        report.notes.append(
            f"replay: {replay['jobs']} jobs, {replay['events']} events, one forced disconnect "
            f"each; events lost {replay['events_lost']} (target 0), seen twice "
            f"{replay['events_seen_twice']}, jobs not completed {len(replay['failed'])}"
        )
    return results


Rounds = tuple[list[LoadResult], list[LoadResult]]  # (http runs, direct runs), round by round


async def _closed_part(plan: _Plan, url: str, direct: Call, bar: Progress) -> dict[int, Rounds]:
    """Per concurrency: ``plan.warmup`` then ``plan.repeats`` rounds, http and direct in
    turn; one http client per concurrency, its connections kept across the rounds."""
    measured: dict[int, Rounds] = {}
    for concurrency in plan.concurrency:
        async with _http_client(url, concurrency) as client:
            http = _http_call(client, plan.body)
            variants: list[Callable[[], Awaitable[LoadResult]]] = [
                partial(closed_loop, call, requests=plan.requests, concurrency=concurrency)
                for call in (http, direct)
            ]
            rounds = await run_interleaved_async(
                variants, plan.repeats, warmup=plan.warmup, on_round=bar.advance
            )
        measured[concurrency] = ([r[0] for r in rounds], [r[1] for r in rounds])
    return measured


async def _open_part(plan: _Plan, url: str, direct: Call, rate: float, bar: Progress) -> Rounds:
    """``plan.repeats`` rounds of http then direct on the same seeded arrivals per round."""
    http_runs: list[LoadResult] = []
    direct_runs: list[LoadResult] = []
    async with _http_client(url, None) as client:
        http = _http_call(client, plan.body)
        for i in range(plan.repeats):
            arrivals = poisson_arrivals(rate, plan.duration_s, seed=ARRIVAL_SEED + i)
            http_runs.append(await open_loop(http, arrivals, duration_s=plan.duration_s))
            direct_runs.append(await open_loop(direct, arrivals, duration_s=plan.duration_s))
            bar.advance()
    return http_runs, direct_runs


def _note_breakdown(report: Report, load: str, entry: dict[str, Any]) -> None:
    """One note per load: the http p50 split into the server's own time (ASGI call to body
    built) and the rest (hypercorn, transport, client), next to the direct p50, with both
    engines' queue wait p50 (requests that arrive together share a batch; apart, they wait)."""
    http, direct = entry["http"], entry["direct"]
    if not (http["latency_ms"] and direct["latency_ms"] and http["server_ms"]):
        return
    server = http["server_ms"].p50
    waits = [entry[m]["queue_wait_ms"] for m in MODES]
    wait_text = (
        f"; engine queue wait p50 http {waits[0].p50:.2f} ms, direct {waits[1].p50:.2f} ms"
        if all(waits)
        else ""
    )
    report.notes.append(
        f"{load}: http p50 {http['latency_ms'].p50:.2f} ms = server p50 {server:.2f} ms + "
        f"{http['latency_ms'].p50 - server:.2f} ms hypercorn, transport and client; direct p50 "
        f"{direct['latency_ms'].p50:.2f} ms{wait_text}"
    )


def run(args: argparse.Namespace, command: str) -> Report:
    report = Report(experiment="serve", command=command, columns=COLUMNS)
    run_in_trio(report, _main, args)
    # The workers' thread count, as _main resolved it (the bench process's own may differ).
    report.machine["torch_threads"] = report.params.get("torch_threads")
    return report
