"""The Ray backend (one Ray actor per worker) beyond the core behaviours.

The engine's core behaviours run on ``ray`` in ``test_tractor_executor.py`` (its ``backend``
fixture).  Here: what only Ray has (loopback-only local Ray, placement groups, the
too-small-cluster error, the environment actors get) and the failure paths on real actor
processes: SIGKILL mid-forward and while idle (restart and retry through the engine's
supervisor), retries exhausted, a hung actor, an RPC past its timeout, and shutdown leaving no
actor, placement group or process.  CFG-parallel on two actors is checked beside tractor's in
``test_tractor_executor.py``.  Every test runs against the session's local Ray
(``ray_cluster`` in ``tests/conftest.py``: 4 logical CPUs, loopback) and is capped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from omni_trio import (
    EngineConfig,
    InvalidConfigError,
    RequestFailedError,
    RequestStatus,
    StallError,
    WorkerError,
    open_engine,
)
from omni_trio._core.trace import TraceRecorder
from omni_trio.executors import ray_executor as ray_module
from omni_trio.executors.base import open_executor
from omni_trio.executors.group import is_secret_env_name, secrets_hidden
from omni_trio.executors.ray_executor import RayExecutor, _is_loopback_address, actor_env
from omni_trio.models.echo import decode_echo_image
from omni_trio.testing import Fault, FaultSpec, assert_trace_ok, with_faults

from .test_tractor_executor import (
    CAP_S,
    _exists,
    _no_worker_processes,  # noqa: F401 - the autouse leak check, for this module too
    engine_on,
    long_params,
    params,
    poll_until,
    wait_running,
    wait_until_gone,
)

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

S = RequestStatus


def ray_executor(engine: Any) -> RayExecutor:
    executor = engine.executor
    assert isinstance(executor, RayExecutor)
    return executor


def actor_states(ray: Any, names: set[str]) -> list[str]:
    """The GCS's state of every actor whose name is in ``names``."""
    from ray._private.state import actors

    return [a["State"] for a in actors().values() if a.get("Name") in names]


def group_state(ray: Any, group: Any) -> str:
    return str(ray.util.placement_group_table(group)["state"])


# -- no Ray needed ---------------------------------------------------------------------------


def test_actor_env_forwards_our_settings_never_device_visibility_or_ranks() -> None:
    environ = {
        "OMNI_TRIO_CACHE": "/c",
        "HF_HUB_OFFLINE": "1",
        "NCCL_DEBUG": "INFO",
        "TORCH_CUDNN_V8_API_ENABLED": "1",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "MKL_NUM_THREADS": "3",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "8",
        "MASTER_ADDR": "10.0.0.1",
        "TORCHELASTIC_RUN_ID": "x",
        "HOME": "/root",
        "PATH": "/bin",
    }
    env = actor_env(environ, torch_threads=2)
    assert env == {
        "OMNI_TRIO_CACHE": "/c",
        "HF_HUB_OFFLINE": "1",
        "NCCL_DEBUG": "INFO",
        "TORCH_CUDNN_V8_API_ENABLED": "1",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "MKL_NUM_THREADS": "3",
        "OMP_NUM_THREADS": "2",
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    assert actor_env({"OMP_WAIT_POLICY": "ACTIVE"}, 1)["OMP_WAIT_POLICY"] == "ACTIVE"


def test_secrets_are_hidden_only_for_the_block() -> None:
    env = {"HF_TOKEN": "t", "OMNI_TRIO_API_KEY": "k", "PATH": "/bin"}
    with secrets_hidden(env):
        assert env == {"PATH": "/bin"}
    assert env == {"HF_TOKEN": "t", "OMNI_TRIO_API_KEY": "k", "PATH": "/bin"}
    assert is_secret_env_name("hf_token") and not is_secret_env_name("HF_HUB_OFFLINE")
    assert not is_secret_env_name("RAY_AUTH_TOKEN")  # Ray's processes need it
    # Overlapping blocks (two groups starting at once): back only when the last one ends.
    outer = secrets_hidden(env)
    outer.__enter__()
    with secrets_hidden(env):
        pass
    assert "HF_TOKEN" not in env  # the outer block still spawns
    outer.__exit__(None, None, None)
    assert env["HF_TOKEN"] == "t"


def test_actor_env_never_carries_a_secret() -> None:
    secrets = {
        "OMNI_TRIO_API_KEY": "sk-daemon",
        "HF_TOKEN": "hf_x",
        "HUGGING_FACE_HUB_TOKEN": "hf_y",
        "HF_API_TOKEN": "hf_z",
        "OMNI_TRIO_DB_PASSWORD": "p",
        "HF_HUB_AUTH": "a",
        "TORCH_SECRET_THING": "s",
    }
    env = actor_env({**secrets, "OMNI_TRIO_CACHE": "/c"}, torch_threads=1)
    assert not set(secrets) & set(env), env
    assert env["OMNI_TRIO_CACHE"] == "/c"


@pytest.mark.slow
async def test_a_real_actors_environment_holds_no_secret(
    ray_cluster: Any, cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver's API key and hub token never reach a worker actor started through the
    engine: its process environment, as the kernel shows it, has neither, though it has
    the engine's harmless settings (forwarded through the actor's runtime_env)."""
    secrets_env = {"OMNI_TRIO_API_KEY": "sk-daemon", "HF_TOKEN": "hf_x"}
    for name, value in secrets_env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OMNI_TRIO_HARMLESS", "1")
    with trio.fail_after(CAP_S):
        async with engine_on("ray", cache_dir) as engine:
            (pid,) = ray_executor(engine).worker_pids().values()
            assert (await engine.collective_rpc("ping"))["pid"] == pid  # the actor's own
            raw = await trio.Path(f"/proc/{pid}/environ").read_bytes()
    env = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    leaked = set(secrets_env) & {name.decode() for name in env}
    assert not leaked, leaked
    assert not any(value.encode() in raw for value in secrets_env.values())
    assert env.get(b"OMNI_TRIO_HARMLESS") == b"1"
    assert {name: os.environ[name] for name in secrets_env} == secrets_env  # the driver's own


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1:6379", True),
        ("ray://127.0.0.1:10001", True),
        ("localhost:6379", True),
        ("[::1]:6379", True),
        ("10.0.0.1:6379", False),
        ("ray://head.example:10001", False),
        ("auto", False),
    ],
)
def test_a_loopback_cluster_address_is_recognised(address: str, loopback: bool) -> None:
    assert _is_loopback_address(address) is loopback


def test_importing_omni_trio_never_imports_ray() -> None:
    code = (
        "import sys, omni_trio, omni_trio.executors.ray_executor, omni_trio.worker.ray_actor\n"
        "from omni_trio.executors.base import resolve_executor_class\n"
        "resolve_executor_class('ray')\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


async def test_without_ray_the_backend_says_how_to_install_it(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now fails
    with trio.fail_after(CAP_S), pytest.raises(InvalidConfigError, match=r"omni-trio\[ray\]"):
        async with open_engine(EngineConfig(backend="ray", cache_dir=str(cache_dir))):
            pass


# -- a local Ray ------------------------------------------------------------------------------

_LOCAL_RAY = """
import json, os, sys, threading
import trio
import trio._core._thread_cache
from omni_trio import EngineConfig, SamplingParams, open_engine

# trio retires an idle worker thread after 10 s; Ray's processes die with the thread that
# started them.  Retire idle threads at once, so a Ray started from one would die right here.
trio._core._thread_cache.IDLE_TIMEOUT = 0.05

async def main():
    config = EngineConfig(backend="ray", warmup=False, torch_threads=1, cache_dir=sys.argv[1])
    async with open_engine(config) as engine:
        import ray
        await trio.sleep(1.0)  # every trio worker thread is retired by now
        out = await engine.generate("p", SamplingParams(num_inference_steps=2, seed=5))
        context = ray.get_runtime_context()
        owner = [t.name for t in threading.enumerate() if t.name == "omni-trio-ray-owner"]
        # The local Ray started with this process's environment, secrets included: none
        # may reach a worker actor (through Ray's own processes or the actor's runtime_env).
        (pid,) = engine.executor.worker_pids().values()
        with open(f"/proc/{pid}/environ", "rb") as f:
            actor_env = {item.split(b"=", 1)[0].decode() for item in f.read().split(b"\\0")}
        secrets = sorted({"OMNI_TRIO_API_KEY", "HF_TOKEN"} & actor_env)
        print(json.dumps({
            "ok": out.ok,
            "nodes": [n["NodeManagerAddress"] for n in ray.nodes()],
            "driver": ray.util.get_node_ip_address(),
            "gcs": context.gcs_address,
            "workers": list(engine.executor.worker_nodes().values()),
            "env": os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"),
            "owner": owner,
            "actor_secrets": secrets,
            "inherited": "ZZ_OMNI_PLAIN" in actor_env,  # through Ray's processes, not ours
            "driver_secrets": sorted({"OMNI_TRIO_API_KEY", "HF_TOKEN"} & set(os.environ)),
            "alive": ray.is_initialized() and all(n["Alive"] for n in ray.nodes()),
        }))
    ray.shutdown()

if __name__ == "__main__":
    trio.run(main)
"""


@pytest.mark.slow
def test_a_local_ray_started_by_the_engine_stays_on_loopback(
    cache_dir: Path, tmp_path: Path
) -> None:
    """No Ray initialised, no address: the executor starts a local Ray whose node, GCS and
    workers all report 127.0.0.1 (Ray would otherwise use the machine's network address).
    It is started from a thread that lives as long as Ray (Ray's processes die with the
    thread that started them): it outlives every trio worker thread and serves after.  The
    process's API key and hub token, in its environment when Ray starts, reach no actor."""
    script = tmp_path / "local_ray.py"
    script.write_text(textwrap.dedent(_LOCAL_RAY))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_TMPDIR"] = "/tmp"
    env.update(OMNI_TRIO_API_KEY="sk-daemon", HF_TOKEN="hf_x")  # the daemon's secrets
    env["ZZ_OMNI_PLAIN"] = "1"  # not forwarded by actor_env: only Ray's processes pass it on
    done = subprocess.run(
        [sys.executable, str(script), str(cache_dir)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ok"] is True
    assert report["nodes"] == ["127.0.0.1"]
    assert report["driver"] == "127.0.0.1"
    assert report["gcs"].startswith("127.0.0.1:")
    assert report["workers"] == ["127.0.0.1"]
    assert report["env"] == "0"
    assert report["owner"] == ["omni-trio-ray-owner"] and report["alive"] is True
    assert report["actor_secrets"] == [] and report["inherited"] is True
    assert report["driver_secrets"] == ["HF_TOKEN", "OMNI_TRIO_API_KEY"]  # put back after
    assert "still exist" not in done.stderr  # close found every actor process gone


@pytest.mark.slow
async def test_the_session_ray_and_its_workers_are_on_loopback(
    ray_cluster: Any, cache_dir: Path
) -> None:
    with trio.fail_after(CAP_S):
        async with engine_on("ray", cache_dir) as engine:
            assert ray_executor(engine).worker_nodes() == {0: "127.0.0.1"}
    assert [n["NodeManagerAddress"] for n in ray_cluster.nodes()] == ["127.0.0.1"]


# -- rank-aware replies, placement groups ----------------------------------------------------


@pytest.mark.slow
async def test_rpc_replies_per_rank_and_boxes_each_ranks_error(
    ray_cluster: Any, cache_dir: Path
) -> None:
    with trio.fail_after(CAP_S):
        async with engine_on("ray", cache_dir, num_workers=2, max_num_seqs=2) as engine:
            executor = ray_executor(engine)
            pids = executor.worker_pids()
            every = await engine.collective_rpc("ping", unique_reply_rank=None)
            assert [(r["rank"], r["pid"]) for r in every] == [(0, pids[0]), (1, pids[1])]
            assert (await engine.collective_rpc("describe", unique_reply_rank=1))["rank"] == 1
            assert (await engine.collective_rpc("ping"))["rank"] == 0  # the output rank

            with pytest.raises(WorkerError) as failed:
                await engine.collective_rpc("set_torch_threads", "x", unique_reply_rank=None)
            error = failed.value
            assert error.error_type == "RuntimeError"
            assert "rank 0: RuntimeError" in str(error) and "rank 1: RuntimeError" in str(error)
            assert error.traceback_text is not None
            assert "set_torch_threads" in error.traceback_text
            with pytest.raises(WorkerError, match="no RPC method 'nope'"):
                await engine.collective_rpc("nope")

            # A failed RPC is the caller's problem, not the group's.
            engine.check_health()
            outs = [
                await engine.generate("p", params(seed=i), request_id=f"r{i}") for i in range(2)
            ]
            assert [decode_echo_image(o.images[0]) for o in outs] == [("r0", 0, 0), ("r1", 1, 0)]
            assert [w.pid for w in engine.health().workers] == [pids[0], pids[1]]


@pytest.mark.slow
async def test_shutdown_leaves_no_actor_placement_group_or_process(
    ray_cluster: Any, cache_dir: Path
) -> None:
    with trio.fail_after(CAP_S):
        async with engine_on("ray", cache_dir, num_workers=2) as engine:
            executor = ray_executor(engine)
            group = executor.placement_group
            assert executor.owns_placement_group
            assert group_state(ray_cluster, group) == "CREATED"
            assert len(group.bundle_specs) == 2
            assert all(spec == {"CPU": 1.0} for spec in group.bundle_specs)
            names = {f"omni-trio-worker-{rank}-{executor.transport._tag}" for rank in range(2)}
            assert actor_states(ray_cluster, names) == ["ALIVE", "ALIVE"]
            pids = executor.worker_pids()
        await executor.aclose()  # idempotent
        assert actor_states(ray_cluster, names) == ["DEAD", "DEAD"]
        assert not any(_exists(pid) for pid in pids.values())
        assert not executor.owns_placement_group
        await poll_until(lambda: group_state(ray_cluster, group) == "REMOVED")


# Sent to a Ray task by value (cloudpickle): imports inside, no module globals to pickle.
_IN_A_PLACEMENT_GROUP = """
def run_engine(cache_dir):
    import trio
    from omni_trio import EngineConfig, SamplingParams, open_engine

    async def main():
        config = EngineConfig(
            backend="ray", num_workers=2, cfg_parallel=False, warmup=False,
            torch_threads=1, cache_dir=cache_dir,
        )
        async with open_engine(config) as engine:
            executor = engine.executor
            out = await engine.generate("p", SamplingParams(num_inference_steps=2, seed=1))
            return executor.placement_group.id.hex(), executor.owns_placement_group, out.ok
    return trio.run(main)
"""


@pytest.mark.slow
async def test_the_callers_placement_group_is_reused_when_big_enough(
    ray_cluster: Any, cache_dir: Path, tmp_path: Path
) -> None:
    """An engine started inside a task of the caller's placement group (capturing child
    tasks) puts its workers in that group's bundles and leaves the group alone."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    namespace: dict[str, Any] = {}
    exec(compile(textwrap.dedent(_IN_A_PLACEMENT_GROUP), "<engine task>", "exec"), namespace)
    task = ray_cluster.remote(num_cpus=0)(namespace["run_engine"])
    group = placement_group([{"CPU": 1.0}] * 2, strategy="PACK")
    try:
        with trio.fail_after(CAP_S):
            await trio.to_thread.run_sync(ray_cluster.get, group.ready())
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=group, placement_group_capture_child_tasks=True
            )
            ref = task.options(scheduling_strategy=strategy).remote(str(cache_dir))
            used, owned, ok = await trio.to_thread.run_sync(ray_cluster.get, ref)
        assert (used, owned, ok) == (group.id.hex(), False, True)
        assert group_state(ray_cluster, group) == "CREATED"  # the engine did not remove it
    finally:
        remove_placement_group(group)


@pytest.mark.slow
async def test_a_cluster_too_small_is_a_clear_error_within_the_wait(
    ray_cluster: Any, cache_dir: Path
) -> None:
    config = EngineConfig(
        backend="ray",
        num_workers=5,
        cfg_parallel=False,
        warmup=False,
        cache_dir=str(cache_dir),
        ray_placement_timeout_s=0.5,
    )
    before = set(ray_cluster.util.placement_group_table())
    with trio.fail_after(CAP_S), pytest.raises(WorkerError) as failed:
        async with open_engine(config):
            pass
    error = failed.value
    assert error.error_type == "PlacementError"
    assert "cannot place 5 worker(s): needed 5 bundle(s) of {'CPU': 1}" in str(error)
    assert "the cluster has 4 CPU in all" in str(error)
    assert "waited 0.5 s" in str(error)
    table = ray_cluster.util.placement_group_table()
    assert all(table[key]["state"] == "REMOVED" for key in set(table) - before)


# -- failures --------------------------------------------------------------------------------


@pytest.mark.slow
async def test_an_actor_sigkilled_mid_forward_is_replaced_and_its_request_rerun(
    ray_cluster: Any, cache_dir: Path
) -> None:
    """With a retry left, the request reruns on the new actor with the same seed: the same
    image an undisturbed run gives.  The group's failure names the rank and the death."""
    with trio.fail_after(CAP_S):
        async with engine_on("ray", cache_dir, max_retries_on_worker_failure=1) as engine:
            undisturbed = await engine.generate("p", params(30, delay=0.02, seed=9), request_id="a")
            (old_pid,) = ray_executor(engine).worker_pids().values()
            stream = engine.stream("p", params(30, delay=0.02, seed=9), request_id="a")
            await wait_running(engine, "a")
            os.kill(old_pid, signal.SIGKILL)
            async with stream:
                outs = [out async for out in stream]
            health = engine.health()
            (new_pid,) = ray_executor(engine).worker_pids().values()
    final = outs[-1]
    assert final.status is S.FINISHED_COMPLETED
    assert decode_echo_image(final.images[0]) == decode_echo_image(undisturbed.images[0])
    assert np.array_equal(np.asarray(final.images[0]), np.asarray(undisturbed.images[0]))
    assert health.restarts == 1 and health.state == "ready"
    assert health.last_failure is not None
    assert "WorkerDied" in health.last_failure and f"process {old_pid}" in health.last_failure
    assert new_pid != old_pid and not _exists(old_pid)


@pytest.mark.slow
async def test_an_idle_actor_killed_is_noticed_and_replaced(
    ray_cluster: Any, cache_dir: Path
) -> None:
    with trio.fail_after(CAP_S):
        async with engine_on("ray", cache_dir) as engine:
            (old_pid,) = ray_executor(engine).worker_pids().values()
            os.kill(old_pid, signal.SIGKILL)
            await poll_until(lambda: engine.health().restarts == 1)
            await poll_until(lambda: engine.health().state == "ready")
            out = await engine.generate("p", params(seed=2), request_id="after")
            (new_pid,) = ray_executor(engine).worker_pids().values()
    assert decode_echo_image(out.images[0]) == ("after", 2, 0)
    assert new_pid != old_pid
    await wait_until_gone([old_pid], timeout=5.0)


@pytest.mark.slow
async def test_with_no_retry_left_a_killed_forward_ends_with_a_retryable_error(
    ray_cluster: Any, cache_dir: Path
) -> None:
    with trio.fail_after(CAP_S):
        async with engine_on("ray", cache_dir, max_retries_on_worker_failure=0) as engine:
            (pid,) = ray_executor(engine).worker_pids().values()
            errors: list[RequestFailedError] = []

            async def doomed() -> None:
                with pytest.raises(RequestFailedError) as failed:
                    await engine.generate("p", long_params(seed=1), request_id="doomed")
                errors.append(failed.value)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(doomed)
                await wait_running(engine, "doomed")
                os.kill(pid, signal.SIGKILL)
            # The engine lives on, with a new actor.
            out = await engine.generate("p", params(seed=3), request_id="next")
    [error] = errors
    assert error.error_type == "WorkerFailedError" and error.retryable
    assert f"process {pid} died" in str(error)
    assert out.ok


@pytest.mark.slow
async def test_a_hung_actor_is_caught_by_the_stall_check_and_replaced(
    ray_cluster: Any, cache_dir: Path
) -> None:
    """A forward stuck in the actor (an injected hang) makes no step progress: the heartbeat
    (answered by the control group while the forward hangs) shows it, the group fails
    closed with a StallError, the hung actor is killed and a new one serves.  The whole run
    keeps the lifecycle invariants."""
    trace = TraceRecorder()
    hang = with_faults(params(4, seed=1), FaultSpec(Fault.HANG_AT_STEP, step=1))
    config = EngineConfig(
        backend="ray",
        cache_dir=str(cache_dir),
        warmup=False,
        torch_threads=1,
        fault_injection=True,
        worker_stall_timeout_s=1.0,
        max_retries_on_worker_failure=0,
        worker_restart_backoff_s=0.0,
    )
    with trio.fail_after(CAP_S):
        async with open_engine(config, trace=trace) as engine:
            (pid,) = ray_executor(engine).worker_pids().values()
            with pytest.raises(RequestFailedError, match="stalled") as info:
                await engine.generate("p", hang, request_id="hung")
            assert info.value.retryable
            await poll_until(lambda: engine.health().healthy)
            assert list(ray_executor(engine).worker_pids().values()) != [pid]
            assert (await engine.generate("p", params(2, seed=3), request_id="next")).ok
        await wait_until_gone([pid], timeout=10.0)
    assert_trace_ok(trace.events)


@pytest.mark.slow
async def test_an_rpc_past_its_timeout_fails_the_group_closed(
    ray_cluster: Any, cache_dir: Path
) -> None:
    config = EngineConfig(backend="ray", warmup=False, torch_threads=1, cache_dir=str(cache_dir))
    with trio.fail_after(CAP_S):
        async with open_executor(config) as executor:
            assert isinstance(executor, RayExecutor)
            (pid,) = executor.worker_pids().values()
            assert (await executor.collective_rpc("ping"))["pid"] == pid
            with pytest.raises(StallError, match="'ping' got no reply within"):
                await executor.collective_rpc("ping", timeout=1e-9)
            assert executor.is_dead
            await executor.wait_failed()
        await wait_until_gone([pid], timeout=10.0)


# -- reaching a cluster: a one-line error, never a wait of minutes ------------------------


def test_an_address_nothing_listens_on_is_refused_at_once() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again below: nothing listens there
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        started = time.monotonic()
        with pytest.raises(InvalidConfigError) as info:
            ray_module.check_reachable(address, timeout_s=5.0)
        assert time.monotonic() - started < 5.0
        message = str(info.value)
        assert "\n" not in message and address in message and "ray start --head" in message
        assert info.value.field == "ray_address"


def test_a_listening_address_and_auto_pass_the_check() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        ray_module.check_reachable(f"127.0.0.1:{sock.getsockname()[1]}", timeout_s=5.0)
    ray_module.check_reachable("auto")  # resolved by Ray itself, not a host:port


def test_a_ray_init_that_never_returns_is_bounded() -> None:
    """A fake init that blocks (an address that accepts but never answers like Ray)."""
    release = threading.Event()

    class FakeRay:
        @staticmethod
        def is_initialized() -> bool:
            return False

    try:
        with pytest.raises(InvalidConfigError, match=r"did not finish within 0.2 s \(joining"):
            ray_module._init_in_owner_thread(
                release.wait, FakeRay, what="joining 'x:1'", timeout_s=0.2
            )
    finally:
        release.set()
