"""CFG parallelism: two real processes split every guided UNet call of ``builtin:tiny-sd``.

The slow tests spawn two ranks (``tests/worker/_cfg_child.py``) that meet over gloo on a free
loopback port and run the same waves (request mode, step mode, no guidance, a one-sided stop)
as one worker alone in this process; each rank reports its images and what its UNet hook saw.

Tolerance: rank 0's images differ from the single worker's by at most 1.7e-6 (measured: a
UNet half-batch vs the doubled batch changes the last bits), asserted as 1e-4.  The two ranks'
own images are bit-identical (both hold the gathered full batch).
"""

from __future__ import annotations

import multiprocessing
import queue
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_trio.worker.cfg_parallel import (
    CfgParallel,
    CfgStatistics,
    CollectiveError,
    init_cfg_group,
)
from tests.worker import _cfg_child as child

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

TOL = 1e-4
# Both ranks: spawn + import torch/diffusers + load + every wave; about 20 s on 2 vCPUs.
RANKS_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def max_diff(a: list[Any], b: list[Any]) -> float:
    assert len(a) == len(b)
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def alone(cache_dir: Path) -> dict[str, Any]:
    """The reference: one worker, world size 1 (also materialises the built-in once)."""
    started = time.perf_counter()
    results = child.run_alone(cache_dir)
    results["total_s"] = time.perf_counter() - started
    return results


@pytest.fixture(scope="module")
def ranks(alone: dict[str, Any], cache_dir: Path) -> Iterator[dict[int, dict[str, Any]]]:
    """Run both ranks to the end; kill them on any failure so nothing outlives the module."""
    ctx = multiprocessing.get_context("spawn")
    results: Any = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(
            target=child.run_rank,
            args=(rank, init_method, str(cache_dir), results),
            name=f"cfg-rank-{rank}",
            daemon=True,
        )
        for rank in (0, 1)
    ]
    started = time.perf_counter()
    for proc in procs:
        proc.start()
    reports: dict[int, dict[str, Any]] = {}
    try:
        deadline = time.monotonic() + RANKS_TIMEOUT_S
        while len(reports) < 2:
            try:
                rank, ok, payload = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"ranks {sorted({0, 1} - set(reports))} did not report in time")
            if not ok:
                pytest.fail(f"rank {rank} failed:\n{payload}")
            reports[rank] = payload
        for proc in procs:
            proc.join(30)
            assert proc.exitcode == 0, (proc.name, proc.exitcode)
        reports[0]["total_s"] = time.perf_counter() - started
        yield reports
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        results.close()
        results.join_thread()


# -- two processes -----------------------------------------------------------------------


@pytest.mark.slow
def test_both_ranks_run_cfg_parallel(alone: dict[str, Any], ranks: dict[int, Any]) -> None:
    assert alone["cfg_parallel"] is False
    for rank in (0, 1):
        assert ranks[rank]["rank"] == rank
        assert ranks[rank]["cfg_parallel"] is True
        assert ranks[rank]["describe"]["cfg_parallel"] is True
    assert ranks[0]["pid"] != ranks[1]["pid"]


# 127.0.0.1 and ::1 as /proc/net/tcp{,6} write them.
LOOPBACK_HEX = {"0100007F", "00000000000000000000000001000000"}


@pytest.mark.slow
def test_every_port_of_the_group_listens_on_loopback_only(ranks: dict[int, Any]) -> None:
    """Rank 0's torch.distributed store included (torch's own tcp:// init binds it to every
    interface)."""
    for rank, report in ranks.items():
        assert report["listening"], rank  # rank 0's store, gloo's pairs
        assert set(report["listening"]) <= LOOPBACK_HEX, (rank, report["listening"])


@pytest.mark.slow
def test_request_mode_matches_one_worker(alone: dict[str, Any], ranks: dict[int, Any]) -> None:
    assert set(ranks[0]["request"]) == {"ra", "rb"}
    for rid, images in alone["request"].items():
        assert max_diff(ranks[0]["request"][rid], images) <= TOL, rid
    # Only the output rank returns images in request mode.
    assert ranks[1]["request"] == {}


@pytest.mark.slow
def test_step_mode_matches_one_worker(alone: dict[str, Any], ranks: dict[int, Any]) -> None:
    """Rows at different steps in one fused call; rank 1 held a stop flag for ``sb`` (the
    engine would never schedule it then) and still stepped it, in lockstep with rank 0."""
    for rid, images in alone["step"].items():
        assert len(images) == 2
        assert max_diff(ranks[0]["step"][rid], images) <= TOL, rid
        for mine, theirs in zip(ranks[0]["step"][rid], ranks[1]["step"][rid], strict=True):
            assert np.array_equal(mine, theirs), rid


@pytest.mark.slow
def test_each_rank_computes_half_of_every_guided_call(ranks: dict[int, Any]) -> None:
    steps = child.STEPS
    for rank in (0, 1):
        # Request mode: 2 requests -> 4 rows per call, 2 computed here.
        assert ranks[rank]["request_stats"] == (steps, steps, 4 * steps, 2 * steps)
        # Step mode: sa alone (4 rows), sa + sb (8 rows) for steps - 1 ticks, sb alone (4).
        rows = 4 + 8 * (steps - 1) + 4
        assert ranks[rank]["step_stats"] == (steps + 1, steps + 1, rows, rows // 2)


@pytest.mark.slow
def test_without_guidance_every_rank_computes_everything(
    alone: dict[str, Any], ranks: dict[int, Any]
) -> None:
    steps = child.STEPS
    for rank in (0, 1):
        assert ranks[rank]["unguided_stats"] == (steps, 0, steps, steps)
    assert max_diff(ranks[0]["unguided"]["ug"], alone["unguided"]["ug"]) <= TOL


@pytest.mark.slow
def test_one_ranks_stop_flag_stops_both_at_the_same_step(
    alone: dict[str, Any], ranks: dict[int, Any]
) -> None:
    """Only rank 1's flag went up (before step STOP_AT); both stopped there, neither hung."""
    assert alone["stop"] == {"st": "aborted"}
    assert alone["stop_steps"] == child.STOP_AT
    for rank in (0, 1):
        assert ranks[rank]["stop"] == {"st": "aborted"}, rank
        assert ranks[rank]["stop_steps"] == child.STOP_AT, rank


@pytest.mark.slow
def test_report_timings(alone: dict[str, Any], ranks: dict[int, Any]) -> None:
    """Not a benchmark: prints what one run cost, for the record (``-s`` shows it)."""
    for key in ("request_s", "step_s"):
        assert alone[key] > 0 and ranks[0][key] > 0
    print(
        f"\nrequest wave (2 images): alone {alone['request_s']:.3f} s, "
        f"cfg-parallel {ranks[0]['request_s']:.3f} s; step run (4 images): alone "
        f"{alone['step_s']:.3f} s, cfg-parallel {ranks[0]['step_s']:.3f} s; "
        f"two ranks end to end {ranks[0]['total_s']:.1f} s"
    )


# -- one process: what needs no group ----------------------------------------------------


def test_only_two_ranks_are_accepted() -> None:
    with pytest.raises(ValueError, match="exactly 2 ranks"):
        init_cfg_group(0, 3, "tcp://127.0.0.1:1", timeout_s=1)
    with pytest.raises(ValueError, match="rank must be 0 or 1"):
        init_cfg_group(2, 2, "tcp://127.0.0.1:1", timeout_s=1)
    with pytest.raises(ValueError, match="exactly 2 ranks"):
        CfgParallel(0, 1, backend="gloo")


def test_outside_guided_the_hooks_only_count() -> None:
    cfg = CfgParallel(1, 2, backend="gloo")  # no group: nothing may be collective here
    unet = torch.nn.Linear(3, 3)
    hooks = cfg.install(unet)
    x = torch.randn(4, 3)
    expected = unet(x)
    assert cfg.statistics() == CfgStatistics(1, 0, 4, 4)
    with cfg.guided():
        assert cfg.active
    assert not cfg.active
    assert torch.equal(unet(x), expected)
    hooks.remove()
    hooks.remove()
    unet(x)
    assert cfg.statistics() == CfgStatistics(2, 0, 8, 8)
    cfg.close()
    cfg.close()


def test_a_guided_call_needs_an_even_batch() -> None:
    cfg = CfgParallel(0, 2, backend="gloo")
    unet = torch.nn.Linear(3, 3)
    cfg.install(unet)
    with cfg.guided(), pytest.raises(ValueError, match="even batch"):
        unet(torch.randn(3, 3))


def test_a_failed_collective_breaks_the_group_for_good() -> None:
    cfg = CfgParallel(0, 2, backend="gloo")  # no process group: every collective fails
    with pytest.raises(CollectiveError, match="all_reduce failed"):
        cfg.agree_stop(False)
    with pytest.raises(CollectiveError, match="broke earlier"):
        cfg.agree_stop(True)
    cfg.close()
    with pytest.raises(CollectiveError, match="closed"):
        cfg.agree_stop(False)
