"""The script every rank of ``test_cfg_parallel.py`` runs (and the single-process reference).

Importable by a ``spawn`` child: nothing runs at import time.  :func:`run_scenarios` drives a
:class:`Worker` through the same waves whatever the world size, so the parent can compare a
two-rank CFG-parallel group with one worker alone.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omni_trio._core.messages import BatchRunnerOutput, NewRequestData, SchedulerOutput
from omni_trio._core.request import DiffusionRequest, SamplingParams
from omni_trio.config import EngineConfig
from omni_trio.worker.stop_flags import StopFlags
from omni_trio.worker.worker import Worker

STEPS = 8
SIZE = 32
# Rank 1 (only) raises its stop flag right before this step of the "stop" wave.
STOP_AT = 3


def make_config(cache_dir: str) -> EngineConfig:
    return EngineConfig(
        model="builtin:tiny-sd",
        torch_threads=1,
        cache_dir=cache_dir,
        max_num_seqs=2,
        step_execution=True,
        warmup=False,
        # Bounds every collective: a broken peer frees this rank within a minute.
        worker_stall_timeout_s=60.0,
    )


def request(
    rid: str, seed: int, *, guidance: float = 7.5, negative: str | None = "blurry", n: int = 1
) -> DiffusionRequest:
    return DiffusionRequest(
        f"a prompt for {rid}",
        SamplingParams(
            height=SIZE,
            width=SIZE,
            num_inference_steps=STEPS,
            guidance_scale=guidance,
            negative_prompt=negative,
            num_outputs_per_prompt=n,
            seed=seed,
            output_type="np",
        ),
        request_id=rid,
    )


class TripProgress(dict[str, tuple[int, int]]):
    """A progress map that aborts ``ids`` once a forward reports step ``at - 1`` done, i.e.
    right before step ``at`` is checked (armed on one rank only)."""

    def __init__(self) -> None:
        super().__init__()
        self.flags: StopFlags | None = None
        self.ids: frozenset[str] = frozenset()
        self.at = -1

    def __setitem__(self, rid: str, value: tuple[int, int]) -> None:
        super().__setitem__(rid, value)
        if self.flags is not None and rid in self.ids and value[0] == self.at - 1:
            self.flags.abort(self.ids)


def _wave(step_id: int, new: Iterable[DiffusionRequest] = (), cached: Iterable[str] = ()) -> Any:
    return SchedulerOutput(
        step_id=step_id,
        scheduled_new_reqs=tuple(NewRequestData(r.request_id, r) for r in new),
        scheduled_cached_reqs=tuple(cached),
    )


def _images(out: BatchRunnerOutput) -> dict[str, Any]:
    return {
        rid: list(o.images) if o.images is not None else ("aborted" if o.aborted else o.error)
        for rid, o in out.outputs.items()
    }


def _stats(worker: Worker) -> tuple[int, int, int, int]:
    cfg = worker.runner.cfg if worker.runner is not None else None
    if cfg is None:
        return (0, 0, 0, 0)
    s = cfg.statistics()
    return (s.unet_calls, s.split_calls, s.rows_requested, s.rows_computed)


def _delta(before: tuple[int, ...], after: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(b - a for a, b in zip(before, after, strict=True))


def run_scenarios(worker: Worker, progress: TripProgress) -> dict[str, Any]:
    """Every wave of the test, in order; returns what each produced on this rank."""
    results: dict[str, Any] = {"rank": worker.rank, "cfg_parallel": worker.cfg_parallel}

    # Request mode, CFG on: a fused wave of two requests (one without negative prompt, one
    # (4 UNet rows), once to warm up and once timed.
    worker.execute_scheduler_output(_wave(1, [request("warm", 1)]))
    wave = [request("ra", 11), request("rb", 12, negative=None)]
    before = _stats(worker)
    started = time.perf_counter()
    out = worker.execute_scheduler_output(_wave(2, wave))
    results["request_s"] = time.perf_counter() - started
    results["request"] = _images(out)
    results["request_stats"] = _delta(before, _stats(worker))

    # Step mode, CFG on: sa starts alone, sb joins a tick later, so the fused calls mix rows
    # at different steps (4 UNet rows, then 8, then 4).
    # This rank's stop flag for sb is up, yet it is stepped (ranks must not act on it).
    if worker.rank == 1:
        worker.stop_flags.abort(["sb"])
    before = _stats(worker)
    started = time.perf_counter()
    finals: dict[str, Any] = {}
    step_id = 10
    new = [request("sa", 21, n=2)]
    live: list[str] = []
    pending = [request("sb", 22, negative=None, n=2)]
    while new or live:
        tick = worker.execute_stepwise(_wave(step_id, new, live))
        step_id += 1
        live += [r.request_id for r in new]
        for rid, o in tick.outputs.items():
            if o.finished or o.error is not None or o.aborted:
                finals[rid] = list(o.images) if o.images is not None else (o.error, o.aborted)
                live.remove(rid)
        new, pending = pending, []
    results["step_s"] = time.perf_counter() - started
    results["step"] = finals
    results["step_stats"] = _delta(before, _stats(worker))
    worker.stop_flags.forget(["sb"])

    # Guidance <= 1: no CFG doubling, so no split; every rank computes every row.
    before = _stats(worker)
    out = worker.execute_scheduler_output(_wave(30, [request("ug", 31, guidance=1.0)]))
    results["unguided"] = _images(out)
    results["unguided_stats"] = _delta(before, _stats(worker))

    # Stop agreement: only rank 1 raises its flag (before step STOP_AT); both must stop there.
    if worker.rank == 1 or worker.world_size == 1:
        progress.flags, progress.ids, progress.at = worker.stop_flags, frozenset({"st"}), STOP_AT
    steps_before = worker.steps_done
    started = time.perf_counter()
    out = worker.execute_scheduler_output(_wave(40, [request("st", 41)]))
    results["stop_s"] = time.perf_counter() - started
    results["stop"] = _images(out)
    results["stop_steps"] = worker.steps_done - steps_before
    progress.flags = None
    worker.stop_flags.forget(["st"])
    return results


def make_worker(cache_dir: str, rank: int, world_size: int, init_method: str | None) -> Any:
    progress = TripProgress()
    worker = Worker(
        make_config(cache_dir),
        rank=rank,
        world_size=world_size,
        progress=progress,
        dist_init_method=init_method,
    )
    return worker, progress


def listening_addresses() -> list[str]:
    """The local addresses this process's TCP sockets listen on, from /proc (hex, as the
    kernel writes them: ``0100007F`` is 127.0.0.1, ``00000000`` every interface)."""
    fds = Path("/proc/self/fd")
    inodes = set()
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1].rsplit(":", 1)[0])
    return found


def run_rank(rank: int, init_method: str, cache_dir: str, queue: Any) -> None:
    """Child entry point: one rank of the two-rank group; reports ``(rank, ok, payload)``."""
    try:
        worker, progress = make_worker(cache_dir, rank, 2, init_method)
        try:
            started = time.perf_counter()
            worker.init_device()
            worker.load_model()
            setup_s = time.perf_counter() - started
            results = run_scenarios(worker, progress)
            results.update(
                pid=os.getpid(),
                setup_s=setup_s,
                describe=worker.describe(),
                listening=listening_addresses(),
            )
        finally:
            worker.shutdown()
        queue.put((rank, True, results))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))


def run_alone(cache_dir: Path | str) -> dict[str, Any]:
    """The single-process reference: the same waves on one worker."""
    worker, progress = make_worker(str(cache_dir), 0, 1, None)
    try:
        worker.init_device()
        worker.load_model()
        return run_scenarios(worker, progress)
    finally:
        worker.shutdown()
