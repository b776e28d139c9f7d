"""``bench backends``: what the multi-process backend costs and what its mechanisms buy.

Issue #4's measurement, four parts printed side by side by one command (``--parts``, default
all of ``overhead,async,transfer,cfg``):

overhead  per-request cost of ``tractor`` (one worker process) over ``inproc`` on
          ``builtin:echo`` with 0-delay steps at concurrency 1: blocks of ``--echo-block``
          sequential requests alternate between the two engines (both open at once); cost =
          tractor block median - inproc block median, pair by pair.  Target: < 2 ms.
async     request-mode throughput with ``async_output`` on vs off where packing the output is
          heavy next to the forward: ``builtin:echo`` at ``--async-size`` (1024) px,
          ``output_type="pil"``, ``--async-steps`` (1) step of ``--async-step-delay-ms`` (5)
          ms, ``max_num_seqs=1``, ``--async-concurrency`` (4) clients; on ``inproc`` and on
          ``tractor`` (one worker).  The forward and pack times come from the async-off
          engine's metrics (``execution_ms``, ``postprocess_ms``); ideal speed-up = (forward +
          pack) / max(forward, pack); reported: on / off requests/s pair by pair, and the
          fraction of the ideal gain achieved, (ratio - 1) / (ideal - 1).  Target: >= 90 %.
          The same fraction is also given against a wall-time ideal, where "pack" is all of a
          request's serial time (1 / requests/s, async off) that is not its forward (on
          tractor that includes encoding, shared memory and the reply).  How many outputs
          really came through the executor's ``claim_output`` (the async path) is counted, so
          a backend without async output shows as such.
transfer  a payload of 1, 16 and 64 MiB (``--transfer-sizes-mb``) sent by a child process over
          a real tractor context stream, encoded by :mod:`omni_trio.ipc` with the default
          shared-memory threshold (the bytes go through shared memory, only a handle on the
          channel) vs ``shm_threshold=None`` (the bytes inline on tractor's channel), decoded
          here; timed from the request to the decoded array.  tractor moves inline bytes at
          ~10 MB/s, so big sizes get few repetitions.
cfg       CFG-parallel latency: ``tractor`` with 2 workers and ``cfg_parallel=True`` vs 1
          worker, ``builtin:tiny-sd``, guidance 7.5, 64 px, 20 steps, one request at a time.

All engines of a part are open at once and run interleaved (A B A B).  The tractor engines
run as children of one tractor runtime this command opens itself (so several may be open at
once).  ``--torch-threads`` (default 1) applies to every worker.
"""

from __future__ import annotations

import argparse
import math
import socket
import statistics
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import trio

from .._core.request import SamplingParams
from ..config import EngineConfig
from ..runtime.engine import AsyncEngine, open_engine
from ._clients import PROMPT, RunResult, drive, sequential_block
from .harness import (
    Progress,
    Report,
    Summary,
    csv_arg,
    machine_info,
    pair_differences,
    pair_ratios,
    positive_ints_arg,
    run_in_trio,
    run_interleaved_async,
)

__all__ = ["PARTS", "add_arguments", "ideal_overlap_speedup", "overlap_gain_fraction", "run"]

PARTS = ("overhead", "async", "transfer", "cfg")
OVERHEAD_TARGET_MS = 2.0
ASYNC_GAIN_TARGET = 0.9
SEED = 1234
MIB = 1 << 20


def _parts(text: str) -> tuple[str, ...]:
    parts = csv_arg(text)
    bad = [p for p in parts if p not in PARTS]
    if not parts or bad:
        raise argparse.ArgumentTypeError(f"parts are {', '.join(PARTS)}; got {text!r}")
    return parts


def _backends(text: str) -> tuple[str, ...]:
    names = csv_arg(text)
    if not names or any(n not in ("inproc", "tractor") for n in names):
        raise argparse.ArgumentTypeError(f"backends are inproc and tractor; got {text!r}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-dir", default=None, help="model cache (default $OMNI_TRIO_CACHE or ~/.cache)"
    )
    parser.add_argument(
        "--parts", type=_parts, default=PARTS, help="default overhead,async,transfer,cfg"
    )
    parser.add_argument(
        "--torch-threads", type=int, default=1, help="torch threads per worker (default 1)"
    )
    g = parser.add_argument_group("overhead part")
    g.add_argument("--echo-steps", type=int, default=20, help="echo steps (default 20)")
    g.add_argument("--echo-size", type=int, default=64, help="echo height = width (default 64)")
    g.add_argument("--echo-block", type=int, default=None, help="requests per block (default 200)")
    g = parser.add_argument_group("async part")
    g.add_argument(
        "--async-backends",
        type=_backends,
        default=("inproc", "tractor"),
        help="default inproc,tractor",
    )
    g.add_argument("--async-size", type=int, default=1024, help="height = width (default 1024)")
    g.add_argument("--async-steps", type=int, default=1, help="echo steps (default 1)")
    g.add_argument(
        "--async-step-delay-ms",
        type=float,
        default=5.0,
        help="echo sleep per step, ms (default 5)",
    )
    g.add_argument(
        "--async-requests", type=int, default=None, help="requests per round (default 48)"
    )
    g.add_argument("--async-concurrency", type=int, default=4, help="clients (default 4)")
    g = parser.add_argument_group("transfer part")
    g.add_argument(
        "--transfer-sizes-mb",
        type=positive_ints_arg,
        default=None,
        help="payload sizes in MiB (default 1,16,64; --quick: 1)",
    )
    g = parser.add_argument_group("cfg part")
    g.add_argument("--cfg-model", default="builtin:tiny-sd", help="default builtin:tiny-sd")
    g.add_argument("--cfg-steps", type=int, default=None, help="steps (default 20)")
    g.add_argument("--cfg-size", type=int, default=64, help="height = width (default 64)")
    g.add_argument("--cfg-guidance", type=float, default=7.5, help="guidance scale (default 7.5)")


# -- helpers -----------------------------------------------------------------------------


def ideal_overlap_speedup(forward_ms: float, pack_ms: float) -> float:
    """Throughput gain of overlapping packing with the next forward, at best:
    ``(forward + pack) / max(forward, pack)`` (1.0 when both are zero)."""
    longest = max(forward_ms, pack_ms)
    return (forward_ms + pack_ms) / longest if longest > 0 else 1.0


def overlap_gain_fraction(ratio: float, ideal: float) -> float:
    """The share of the ideal gain achieved: ``(ratio - 1) / (ideal - 1)`` (NaN if there is
    no gain to be had)."""
    return (ratio - 1.0) / (ideal - 1.0) if ideal > 1.0 else float("nan")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _silence_tractor() -> None:
    """tractor's deprecation noise off, here and in the workers (what the executor does)."""
    from ..executors import tractor_executor

    silence = getattr(tractor_executor, "_silence_tractor_warnings", None)
    if silence is not None:
        silence()


@asynccontextmanager
async def _tractor_runtime(needed: bool) -> Any:
    """This process's tractor runtime, on a private registry port, if ``needed``: the
    tractor engines become its children, so several can be open at once."""
    if not needed:
        yield None
        return
    _silence_tractor()
    import tractor

    async with tractor.open_root_actor(
        arbiter_addr=("127.0.0.1", _free_port()), loglevel="critical", name="omni-trio-bench"
    ) as actor:
        yield actor


def count_async_outputs(engine: AsyncEngine) -> list[int]:
    """Count the outputs the engine claims through ``executor.claim_output`` (the
    async-output path) from now on; returns a one-element list holding the count."""
    executor = engine.executor
    original = executor.claim_output
    counter = [0]

    def counted(async_output_id: str, callback: Any) -> None:
        counter[0] += 1
        original(async_output_id, callback)

    executor.claim_output = counted  # type: ignore[method-assign]
    return counter


def _ms(samples_s: list[float]) -> Summary:
    return Summary.of(samples_s).scaled(1000.0)


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _row(
    part: str,
    variant: str,
    figure: str,
    spread: str,
    tail: str = "-",
    versus: str = "-",
    target: str = "-",
) -> dict[str, str]:
    return {
        "part": part,
        "variant": variant,
        "figure": figure,
        "min / median / max": spread,
        "p50 / p90 / p99": tail,
        "vs baseline (min / med / max)": versus,
        "target": target,
    }


COLUMNS = [
    "part",
    "variant",
    "figure",
    "min / median / max",
    "p50 / p90 / p99",
    "vs baseline (min / med / max)",
    "target",
]


# -- (a) per-request overhead ------------------------------------------------------------


async def _overhead_part(
    args: argparse.Namespace, report: Report, bar: Progress, repeats: int, warmup: int
) -> dict[str, Any]:
    block = args.echo_block or (10 if args.quick else 200)
    params = SamplingParams(
        height=args.echo_size,
        width=args.echo_size,
        num_inference_steps=args.echo_steps,
        seed=SEED,
        output_type="pil",
    )
    base = EngineConfig(
        model="builtin:echo",
        model_options={"step_delay_s": 0.0},
        max_num_seqs=1,
        torch_threads=args.torch_threads,
        cache_dir=args.cache_dir,
    )
    backends = ("inproc", "tractor")
    latencies: dict[str, list[float]] = {b: [] for b in backends}
    async with AsyncExitStack() as stack:
        engines = [
            await stack.enter_async_context(open_engine(base.replace(backend=b))) for b in backends
        ]

        rounds = await run_interleaved_async(
            [
                sequential_block(e, params, block, latencies[b])
                for b, e in zip(backends, engines, strict=True)
            ],
            repeats,
            warmup=warmup,
            on_round=bar.advance,
        )
    for name in backends:
        del latencies[name][: warmup * block]
    medians = {b: [r[i] for r in rounds] for i, b in enumerate(backends)}
    cost = _ms(pair_differences(medians["tractor"], medians["inproc"]))
    ratio = Summary.of(pair_ratios(medians["tractor"], medians["inproc"]))
    met = cost.median < OVERHEAD_TARGET_MS
    part = f"overhead: echo {args.echo_size}px {args.echo_steps} steps, concurrency 1"
    out: dict[str, Any] = {
        "model": "builtin:echo",
        "steps": args.echo_steps,
        "size": args.echo_size,
        "step_delay_s": 0.0,
        "block": block,
        "block_median_latency_ms": {b: _ms(medians[b]) for b in backends},
        "latency_ms": {b: _ms(latencies[b]) for b in backends},
        "tractor_minus_inproc_ms": cost,
        "tractor_over_inproc": ratio,
        "target_ms_below": OVERHEAD_TARGET_MS,
        "target_met": met,
    }
    for b in backends:
        report.rows.append(
            _row(
                part if b == "inproc" else "",
                b,
                "latency ms (block medians)",
                _ms(medians[b]).spread("{:.3f}"),
                _ms(latencies[b]).tail("{:.3f}"),
                f"+{cost.spread('{:.3f}')} ms" if b == "tractor" else "-",
                f"< {OVERHEAD_TARGET_MS:g} ms: {_met(met)}" if b == "tractor" else "-",
            )
        )
    if not met:
        report.notes.append(
            f"overhead: tractor adds {cost.median:.3f} ms per request (median), missing the "
            f"< {OVERHEAD_TARGET_MS:g} ms target by {cost.median - OVERHEAD_TARGET_MS:.3f} ms"
        )
    return out


# -- (b) async output --------------------------------------------------------------------


async def _async_part(
    args: argparse.Namespace, report: Report, bar: Progress, repeats: int, warmup: int
) -> dict[str, Any]:
    requests = args.async_requests or (4 if args.quick else 48)
    size = args.async_size
    delay_s = args.async_step_delay_ms / 1000.0
    params = SamplingParams(
        height=size,
        width=size,
        num_inference_steps=args.async_steps,
        seed=SEED,
        output_type="pil",
    )
    base = EngineConfig(
        model="builtin:echo",
        model_options={"step_delay_s": delay_s},
        max_num_seqs=1,
        torch_threads=args.torch_threads,
        cache_dir=args.cache_dir,
        max_pixels=max(1024 * 1024, size * size),
    )
    variants = [(b, on) for b in args.async_backends for on in (False, True)]
    async with AsyncExitStack() as stack:
        engines: list[AsyncEngine] = []
        counters: list[list[int]] = []
        for backend, async_on in variants:
            config = base.replace(backend=backend, async_output=async_on)
            engine = await stack.enter_async_context(open_engine(config))
            engines.append(engine)
            counters.append(count_async_outputs(engine))

        # Per call: how many of its outputs came through claim_output.
        via: list[list[int]] = [[] for _ in engines]

        def runner(i: int) -> Callable[[], Awaitable[RunResult]]:
            async def call() -> RunResult:
                before = counters[i][0]
                result = await drive(
                    engines[i], params, requests=requests, concurrency=args.async_concurrency
                )
                via[i].append(counters[i][0] - before)
                return result

            return call

        rounds = await run_interleaved_async(
            [runner(i) for i in range(len(engines))], repeats, warmup=warmup, on_round=bar.advance
        )
        async_counts = [sum(v[len(v) - repeats :]) for v in via]
    out: dict[str, Any] = {
        "model": "builtin:echo",
        "size": size,
        "steps": args.async_steps,
        "step_delay_ms": args.async_step_delay_ms,
        "output_type": "pil",
        "max_num_seqs": 1,
        "concurrency": args.async_concurrency,
        "requests_per_round": requests,
        "target_gain_fraction_at_least": ASYNC_GAIN_TARGET,
        "backends": {},
    }
    for backend in args.async_backends:
        i_off = variants.index((backend, False))
        i_on = variants.index((backend, True))
        off = [r[i_off] for r in rounds]
        on = [r[i_on] for r in rounds]
        rps_off = [x.requests_per_s for x in off]
        rps_on = [x.requests_per_s for x in on]
        ratio = Summary.of(pair_ratios(rps_on, rps_off))
        forward = Summary.of([v for x in off for v in x.execution_ms])
        pack = Summary.of([v for x in off for v in x.postprocess_ms])
        ideal = ideal_overlap_speedup(forward.median, pack.median)
        gain = overlap_gain_fraction(ratio.median, ideal)
        # The same from wall time: everything serial to a request besides its forward (pack,
        # and on tractor also encoding, shared memory and delivery) could overlap.
        serial_ms = 1000.0 / statistics.median(rps_off)
        rest_ms = max(0.0, serial_ms - forward.median)
        ideal_serial = ideal_overlap_speedup(forward.median, rest_ms)
        gain_serial = overlap_gain_fraction(ratio.median, ideal_serial)
        completed_on = sum(x.completed for x in on)
        via_async = async_counts[i_on]
        async_path = via_async > 0
        met = gain >= ASYNC_GAIN_TARGET if math.isfinite(gain) else False
        entry: dict[str, Any] = {
            "requests_per_s_off": Summary.of(rps_off),
            "requests_per_s_on": Summary.of(rps_on),
            "images_per_s_off": Summary.of([x.images_per_s for x in off]),
            "images_per_s_on": Summary.of([x.images_per_s for x in on]),
            "latency_ms_off": _ms([v for x in off for v in x.latencies_s]),
            "latency_ms_on": _ms([v for x in on for v in x.latencies_s]),
            "forward_ms_off": forward,
            "pack_ms_off": pack,
            "forward_ms_on": Summary.of([v for x in on for v in x.execution_ms]),
            "pack_ms_on": Summary.of([v for x in on for v in x.postprocess_ms]),
            "ratio_on_over_off": ratio,
            "ideal_speedup": ideal,
            "gain_fraction": gain,
            "ratio_over_ideal": ratio.median / ideal,
            "serial_ms_per_request_off": serial_ms,
            "non_forward_ms_per_request_off": rest_ms,
            "ideal_speedup_from_wall_time": ideal_serial,
            "gain_fraction_from_wall_time": gain_serial,
            "outputs_via_wait_output": via_async,
            "outputs_completed_async_on": completed_on,
            "async_output_path_used": async_path,
            "failed": sum(x.failed for x in (*off, *on)),
            "target_met": met,
        }
        out["backends"][backend] = entry
        part = (
            f"async: echo {size}px pil, {args.async_steps} steps x "
            f"{args.async_step_delay_ms:g} ms, {backend}"
        )
        report.rows.append(
            _row(
                part,
                "forward | pack ms",
                "median off (on)",
                f"{forward.median:.1f} | {pack.median:.1f} "
                f"({entry['forward_ms_on'].median:.1f} | {entry['pack_ms_on'].median:.1f})",
                "-",
                f"wall {serial_ms:.1f} ms/request off: {rest_ms:.1f} ms not forward",
                f"ideal x{ideal:.2f} (wall time: x{ideal_serial:.2f})",
            )
        )
        report.rows.append(
            _row(
                "",
                "async_output off",
                "requests/s",
                entry["requests_per_s_off"].spread("{:.1f}"),
                entry["latency_ms_off"].tail("{:.0f}") + " ms",
            )
        )
        report.rows.append(
            _row(
                "",
                "async_output on" + ("" if async_path else " (inline: no async path)"),
                "requests/s",
                entry["requests_per_s_on"].spread("{:.1f}"),
                entry["latency_ms_on"].tail("{:.0f}") + " ms",
                f"x{ratio.spread('{:.2f}')}",
                f"gain {gain * 100:.0f} % of ideal (>= {ASYNC_GAIN_TARGET * 100:.0f} %): "
                f"{_met(met)}; wall-time ideal: {gain_serial * 100:.0f} %",
            )
        )
        if not async_path:
            report.notes.append(
                f"async ({backend}): no output came through claim_output: this backend has no "
                f"async output yet, so async_output=True ran the same inline path as False "
                f"(ratio x{ratio.median:.2f} is noise)"
            )
        elif not met:
            report.notes.append(
                f"async ({backend}): on / off x{ratio.median:.2f} of an ideal x{ideal:.2f} "
                f"(forward {forward.median:.1f} ms, pack {pack.median:.1f} ms): "
                f"{gain * 100:.0f} % of the ideal gain, target >= "
                f"{ASYNC_GAIN_TARGET * 100:.0f} % (missed by "
                f"{(ASYNC_GAIN_TARGET - gain) * 100:.0f} points)"
            )
    return out


# -- (c) large-output transfer -----------------------------------------------------------


def _transfer_reps(size_mib: int, quick: bool, repeats: int | None) -> int:
    if repeats is not None:
        return repeats
    if quick:
        return 2
    return 10 if size_mib <= 1 else 3 if size_mib <= 16 else 2


async def _transfer_part(
    args: argparse.Namespace, report: Report, bar: Progress, warmup: int
) -> dict[str, Any]:
    import tractor

    from ..ipc import DEFAULT_SHM_THRESHOLD, Decoder, encode
    from ._transfer_actor import TRANSFER_MODULE, serve_payloads

    sizes: tuple[int, ...] = args.transfer_sizes_mb or ((1,) if args.quick else (1, 16, 64))
    decoder = Decoder()
    out: dict[str, Any] = {
        "shm_threshold_default": DEFAULT_SHM_THRESHOLD,
        "payload": "numpy uint8 array in a dict, encoded by omni_trio.ipc.Encoder in the child",
        "timed": "request sent -> reply received and decoded in the parent",
        "sizes_mib": list(sizes),
        "sizes": {},
    }
    async with tractor.open_nursery() as actors:
        try:
            portal = await actors.start_actor(
                f"omni-trio-bench-transfer-{_free_port()}", enable_modules=[TRANSFER_MODULE]
            )
            async with (
                portal.open_context(serve_payloads) as (ctx, _),
                ctx.open_stream() as stream,
            ):

                def fetch(nbytes: int, threshold: int | None) -> Callable[[], Awaitable[float]]:
                    request = encode({"nbytes": nbytes, "shm_threshold": threshold})

                    async def call() -> float:
                        started = time.perf_counter()
                        await stream.send(request)
                        reply = decoder.decode(await stream.receive())
                        elapsed = time.perf_counter() - started
                        if reply["payload"].nbytes != nbytes:  # pragma: no cover - a bug
                            raise RuntimeError("transfer returned the wrong payload size")
                        return elapsed

                    return call

                for size in sizes:
                    nbytes = size * MIB
                    reps = _transfer_reps(size, args.quick, args.repeats)
                    # Untimed: the child builds the payload once; warm both paths at 1 MiB.
                    await fetch(nbytes, DEFAULT_SHM_THRESHOLD)()
                    rounds = await run_interleaved_async(
                        [fetch(nbytes, DEFAULT_SHM_THRESHOLD), fetch(nbytes, None)],
                        reps,
                        warmup=warmup if size <= 1 else 0,
                    )
                    bar.advance()
                    shm = [r[0] for r in rounds]
                    inline = [r[1] for r in rounds]
                    ratio = Summary.of(pair_ratios(inline, shm))
                    mb = nbytes / 1e6
                    entry = {
                        "nbytes": nbytes,
                        "reps": reps,
                        "shm_ms": _ms(shm),
                        "inline_ms": _ms(inline),
                        "shm_mb_per_s": mb / statistics.median(shm),
                        "inline_mb_per_s": mb / statistics.median(inline),
                        "inline_over_shm": ratio,
                    }
                    out["sizes"][str(size)] = entry
                    for name, series in (("shared memory", shm), ("inline (tractor)", inline)):
                        report.rows.append(
                            _row(
                                f"transfer: {size} MiB, {reps} reps"
                                if name == "shared memory"
                                else "",
                                name,
                                f"ms ({mb / statistics.median(series):.0f} MB/s)",
                                _ms(series).spread("{:.1f}"),
                                "-",
                                f"x{ratio.spread('{:.1f}')} slower"
                                if name.startswith("inline")
                                else "-",
                            )
                        )
                await stream.send(encode({}))
        finally:
            with trio.CancelScope(shield=True):
                await actors.cancel()
    return out


# -- (d) CFG-parallel --------------------------------------------------------------------


async def _cfg_part(
    args: argparse.Namespace, report: Report, bar: Progress, repeats: int, warmup: int
) -> dict[str, Any]:
    steps = args.cfg_steps or (2 if args.quick else 20)
    params = SamplingParams(
        height=args.cfg_size,
        width=args.cfg_size,
        num_inference_steps=steps,
        guidance_scale=args.cfg_guidance,
        seed=SEED,
        output_type="pil",
    )
    base = EngineConfig(
        model=args.cfg_model,
        backend="tractor",
        torch_threads=args.torch_threads,
        cache_dir=args.cache_dir,
    )
    names = ("1 worker", "2 workers cfg-parallel")
    configs = (
        base.replace(num_workers=1),
        base.replace(num_workers=2, cfg_parallel=True),
    )
    async with AsyncExitStack() as stack:
        engines = [await stack.enter_async_context(open_engine(c)) for c in configs]
        described = await engines[1].collective_rpc("describe", unique_reply_rank=None)
        split = all(bool(d.get("cfg_parallel")) for d in described)

        def one(engine: AsyncEngine) -> Callable[[], Awaitable[float]]:
            async def call() -> float:
                started = time.perf_counter()
                await engine.generate(PROMPT, params)
                return time.perf_counter() - started

            return call

        rounds = await run_interleaved_async(
            [one(e) for e in engines], repeats, warmup=warmup, on_round=bar.advance
        )
    single = [r[0] for r in rounds]
    double = [r[1] for r in rounds]
    ratio = Summary.of(pair_ratios(double, single))
    speedup = Summary.of(pair_ratios(single, double))
    out: dict[str, Any] = {
        "model": args.cfg_model,
        "size": args.cfg_size,
        "steps": steps,
        "guidance_scale": args.cfg_guidance,
        "torch_threads_per_worker": args.torch_threads,
        "latency_ms": {names[0]: _ms(single), names[1]: _ms(double)},
        "two_over_one": ratio,
        "speedup": speedup,
        "cfg_parallel_active_on_both_ranks": split,
    }
    part = f"cfg: {args.cfg_model} {args.cfg_size}px {steps} steps, guidance {args.cfg_guidance:g}"
    for name, series in zip(names, (single, double), strict=True):
        report.rows.append(
            _row(
                part if name == names[0] else "",
                name,
                "latency ms",
                _ms(series).spread("{:.0f}"),
                _ms(series).tail("{:.0f}"),
                f"x{ratio.spread('{:.2f}')} (speed-up x{speedup.median:.2f})"
                if name == names[1]
                else "-",
            )
        )
    if not split:
        report.notes.append("cfg: the 2-worker engine did not report cfg_parallel on both ranks")
    cores = machine_info(device="cpu").get("cores") or 0
    if cores < 4:
        report.notes.append(
            f"cfg: {cores} cores shared by 2 worker processes and the engine: the workers slow "
            f"each other down, so this machine cannot show what CFG-parallel gains (speed-up "
            f"here x{speedup.median:.2f}); re-measure on a GPU"
        )
    return out


# -- the experiment ----------------------------------------------------------------------


async def _main(args: argparse.Namespace, report: Report) -> None:
    parts: tuple[str, ...] = args.parts
    quick = args.quick
    repeats = args.repeats or (2 if quick else 5)
    cfg_repeats = args.repeats or (2 if quick else 10)
    warmup = 1 if args.warmup is None else args.warmup
    report.params.update(
        {
            "parts": list(parts),
            "torch_threads": args.torch_threads,
            "repeats": repeats,
            "cfg_repeats": cfg_repeats,
            "warmup_rounds": warmup,
            "quick": quick,
        }
    )
    needs_tractor = any(p in parts for p in ("overhead", "transfer", "cfg")) or (
        "async" in parts and "tractor" in args.async_backends
    )
    sizes = args.transfer_sizes_mb or ((1,) if quick else (1, 16, 64))
    total = (
        repeats * sum(p in parts for p in ("overhead", "async"))
        + (len(sizes) if "transfer" in parts else 0)
        + (cfg_repeats if "cfg" in parts else 0)
    )
    with Progress(total, "backends", enabled=not args.no_progress) as bar:
        async with _tractor_runtime(needs_tractor):
            if "overhead" in parts:
                report.results["overhead"] = await _overhead_part(
                    args, report, bar, repeats, warmup
                )
            if "async" in parts:
                report.results["async"] = await _async_part(args, report, bar, repeats, warmup)
            if "transfer" in parts:
                report.results["transfer"] = await _transfer_part(args, report, bar, warmup)
            if "cfg" in parts:
                report.results["cfg"] = await _cfg_part(args, report, bar, cfg_repeats, warmup)


def run(args: argparse.Namespace, command: str) -> Report:
    report = Report(experiment="backends", command=command, columns=COLUMNS)
    return run_in_trio(report, _main, args, torch_threads=args.torch_threads)
