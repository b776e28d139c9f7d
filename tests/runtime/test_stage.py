"""The process-backed stage (``open_engine(config, stage="process")``): the whole engine in
a child process, the same API here.  Real stage processes running ``builtin:echo`` (inproc
and tractor backends inside the stage)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from omni_trio import (
    DuplicateRequestError,
    Engine,
    EngineClosedError,
    EngineConfig,
    EngineDeadError,
    InvalidConfigError,
    InvalidRequestError,
    RequestAbortedError,
    SamplingParams,
    open_engine,
)
from omni_trio._core.health import EngineState, SleepState
from omni_trio._core.lifecycle import RequestStatus
from omni_trio._core.messages import DiffusionOutput
from omni_trio.errors import PayloadError
from omni_trio.models import decode_echo_image
from omni_trio.runtime import stage as stage_module
from omni_trio.runtime.stage import StageEngine
from omni_trio.runtime.stage_child import PROCESS_NAME
from tests.executors.test_tractor_executor import poll_until

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

CAP_S = 60.0
ROOT = Path(__file__).resolve().parents[2]


def config(cache_dir: Path, **overrides: Any) -> EngineConfig:
    overrides.setdefault("warmup", False)
    overrides.setdefault("model", "builtin:echo")
    return EngineConfig(cache_dir=str(cache_dir), torch_threads=1, **overrides)


def params(**kw: Any) -> SamplingParams:
    kw.setdefault("height", 32)
    kw.setdefault("width", 32)
    kw.setdefault("num_inference_steps", 3)
    return SamplingParams(**kw)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            stat = file.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 :][:1] != b"Z"


def group_members(pgid: int) -> list[int]:
    """Live processes in process group ``pgid``."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as file:
                stat = file.read()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != b"Z":
            members.append(int(entry))
    return members


async def until(predicate: Any, what: str) -> None:
    """Poll (bounded by the caller's cap): the stage's process state has no event here."""
    del what  # (says what is awaited, where it is called)
    await poll_until(predicate)


async def test_outputs_previews_and_seeds_cross_as_the_inline_engine_gives_them(
    cache_dir: Path,
) -> None:
    cfg = config(cache_dir, streaming_output=True)
    with trio.fail_after(CAP_S):
        async with open_engine(cfg) as inline:
            expected = await inline.generate("p", params(seed=11), request_id="same")
        async with open_engine(cfg, stage="process") as engine:
            assert isinstance(engine, StageEngine)
            assert engine.pid != os.getpid()
            assert engine.model_info is not None and engine.model_info.name == "builtin:echo"
            assert engine.health().healthy
            out = await engine.generate("p", params(seed=11), request_id="same")
            assert out.ok
            assert decode_echo_image(out.images[0]) == ("same", 11, 0)
            assert out.images[0].tobytes() == expected.images[0].tobytes()
            # A seed is chosen at once when none is given; the stream reports it.
            async with engine.stream("p", params(num_inference_steps=4)) as stream:
                seed = stream.seed
                assert seed is not None
                chunks = [o async for o in stream]
            assert [c.finished for c in chunks][-1] and not chunks[0].finished  # previews
            assert decode_echo_image(chunks[-1].images[0])[1] == seed
            stats = engine.statistics()
            assert stats.finished_completed == 2 and stats.running == 0
            # The step time it measured crosses too (what a pool's estimates weigh by).
            assert set(engine.step_times()) == {params().height * params().width}
    assert engine.health().state is EngineState.CLOSED
    assert not alive(engine.pid)


async def test_bad_input_is_refused_typed_here_or_on_the_first_read(cache_dir: Path) -> None:
    with trio.fail_after(CAP_S):
        async with open_engine(config(cache_dir), stage="process") as engine:
            with pytest.raises(InvalidRequestError, match="prompt"):
                engine.stream(42, params())  # type: ignore[arg-type]
            with pytest.raises(InvalidRequestError):
                engine.stream("p", params(height=10**6, width=10**6))
            slow = engine.stream("p", params(num_inference_steps=50), request_id="dup")
            with pytest.raises(DuplicateRequestError):
                engine.stream("p", params(), request_id="dup")
            await slow.aclose()
            # Only the engine knows builtin:echo takes no adapter: typed, on the first read.
            with pytest.raises(InvalidRequestError, match=r"LoRA|lora"):
                await engine.generate("p", params(lora=(("style", 1.0),)))
            assert engine.health().healthy
            assert (await engine.generate("p", params())).ok


async def test_abort_and_consumer_drop_cross_over(cache_dir: Path) -> None:
    cfg = config(cache_dir, model_options={"step_delay_s": 0.05})
    with trio.fail_after(CAP_S):
        async with open_engine(cfg, stage="process") as engine:
            stream = engine.stream("p", params(num_inference_steps=400), request_id="a")
            await until(lambda: engine.status("a") is RequestStatus.RUNNING, "running")
            engine.abort("a")
            async with stream:
                last = [o async for o in stream][-1]
            assert last.status is RequestStatus.FINISHED_ABORTED
            with pytest.raises(RequestAbortedError):
                last.raise_for_status()
            # A consumer that leaves: the request is aborted in the stage.
            async with engine.stream("p", params(num_inference_steps=400)) as dropped:
                rid = dropped.request_id
                await until(lambda: engine.status(rid) is RequestStatus.RUNNING, "running")
            await until(lambda: engine.statistics().finished_aborted == 2, "aborted")
            await until(engine.is_idle, "idle")
            assert engine.statistics().running == 0
            assert engine.leftovers()["stage_streams"] == set()


async def kill_mid_request(engine: StageEngine) -> DiffusionOutput:
    """SIGKILL the stage while a long request runs there: its stream ends with an
    EngineDeadError output within a second (the issue's bound); that output."""
    stream = engine.stream("p", params(num_inference_steps=500), request_id="long")
    await until(lambda: engine.status("long") is RequestStatus.RUNNING, "running")
    os.kill(engine.pid, signal.SIGKILL)
    with trio.fail_after(1.0):
        async with stream:
            last = [o async for o in stream][-1]
    assert last.error_type == "EngineDeadError"
    return last


async def test_a_killed_stage_is_engine_dead_here_at_once_and_leaves_nothing(
    cache_dir: Path,
) -> None:
    cfg = config(
        cache_dir,
        backend="tractor",
        worker_start_method="forkserver",
        model_options={"step_delay_s": 0.05},
    )
    with trio.fail_after(CAP_S):
        async with open_engine(cfg, stage="process") as engine:
            assert (await engine.generate("p", params())).ok
            workers = [w.pid for w in engine.health().workers]
            assert workers and all(pid != engine.pid for pid in workers)
            last = await kill_mid_request(engine)
            with pytest.raises(EngineDeadError):
                last.raise_for_status()
            assert engine.is_dead and engine.health().state is EngineState.DEAD
            with pytest.raises(EngineDeadError):
                engine.stream("p", params())
            with pytest.raises(EngineDeadError):
                await engine.sleep(1)
            await engine.wait_ended()
            await engine.wait_idle()  # an ended engine is idle, as the inline one is
            assert engine.is_idle()
        # The stage's own workers went with its process group.
        await until(lambda: not any(alive(pid) for pid in workers), "workers gone")
        await until(lambda: group_members(engine.pid) == [], "the process group gone")


async def test_an_engine_that_dies_in_a_live_stage_ends_the_stage(cache_dir: Path) -> None:
    """The stage's own engine dies (its worker group failed past max_worker_restarts): the
    caller sees EngineDeadError at once, wait_ended returns (a supervisor reopens), and the
    stage process ends by itself."""
    cfg = config(
        cache_dir,
        backend="tractor",
        worker_start_method="forkserver",
        max_worker_restarts=0,
    )
    with trio.fail_after(CAP_S):
        async with open_engine(cfg, stage="process") as engine:
            crash = params(num_inference_steps=4, extra_args={"echo_exit_at_step": 1})
            with pytest.raises(EngineDeadError):
                await engine.generate("p", crash)
            await engine.wait_ended()
            assert engine.is_dead and engine.health().state is EngineState.DEAD
            with pytest.raises(EngineDeadError):
                engine.stream("p", params())
            await until(lambda: not alive(engine.pid), "the stage process ended")
        await until(lambda: group_members(engine.pid) == [], "the process group gone")


async def test_what_cannot_cross_is_refused_to_its_own_request(cache_dir: Path) -> None:
    with trio.fail_after(CAP_S):
        async with open_engine(config(cache_dir), stage="process") as engine:
            unpicklable = params(extra_args={"echo_step_delay_s": lambda: 0.0})
            with pytest.raises(PayloadError, match="cannot be sent to the stage"):
                engine.stream("p", unpicklable)
            with pytest.raises(PayloadError, match="cannot be sent to the stage"):
                await engine.collective_rpc("ping", lambda: None)
            assert engine.leftovers()["stage_streams"] == set()
            assert (await engine.generate("p", params())).ok


async def test_a_reused_request_id_never_gets_the_old_submissions_outputs(
    cache_dir: Path,
) -> None:
    cfg = config(cache_dir, model_options={"step_delay_s": 0.02})
    with trio.fail_after(CAP_S):
        async with open_engine(cfg, stage="process") as engine:
            completed = 0
            for round_ in range(5):
                old = engine.stream("p", params(num_inference_steps=50, seed=1), request_id="x")
                await until(lambda: engine.status("x") is not None, "admitted there")
                await old.aclose()  # the consumer leaves: aborted there
                new = engine.stream("p", params(seed=2), request_id="x")
                try:
                    async with new:
                        last = [o async for o in new][-1]
                except DuplicateRequestError:
                    continue  # the old one was still being stopped there: refused, typed
                # Its own output, never the old submission's (aborted, seed 1).
                assert last.ok, (round_, last)
                assert decode_echo_image(last.images[0]) == ("x", 2, 0)
                completed += 1
            assert completed, "every reuse was refused: nothing checked"


async def test_sleep_wake_and_control_calls_run_in_the_stage(cache_dir: Path) -> None:
    with trio.fail_after(CAP_S):
        async with open_engine(config(cache_dir), stage="process") as engine:
            waiting_for = await engine.sleep(1)
            assert isinstance(waiting_for, list)
            assert engine.is_sleeping
            assert engine.statistics().sleep_state is SleepState.ASLEEP
            stream = engine.stream("p", params(seed=3))
            await engine.wake_up()
            async with stream:
                assert [o async for o in stream][-1].ok
            assert await engine.collective_rpc("ping") is not None
            held = await engine.worker_leftovers()
            assert all(not ids for ids in held.values())
            await engine.wait_idle()
            assert engine.is_idle()


# How a stage process starts: a new interpreter, or forked from the fork server (see the
# end of this module).
START_METHODS = pytest.mark.parametrize("start_method", ["trio", "forkserver"])


@START_METHODS
async def test_a_stage_that_does_not_close_is_terminated_then_killed(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch, start_method: str
) -> None:
    monkeypatch.setattr(stage_module, "CLOSE_MARGIN_S", 0.2)
    monkeypatch.setattr(stage_module, "TERM_GRACE_S", 0.2)
    cfg = config(cache_dir, close_timeout_s=0.2, worker_start_method=start_method)
    with trio.fail_after(CAP_S):
        async with open_engine(cfg, stage="process") as engine:
            # Stopped, the stage neither reads the close nor acts on SIGTERM: only the
            # process group's SIGKILL ends it.
            os.kill(engine.pid, signal.SIGSTOP)
            began = trio.current_time()
        took = trio.current_time() - began
    assert not alive(engine.pid)
    assert group_members(engine.pid) == []
    assert took < stage_module.engine_close_bound_s(cfg, "process")


@START_METHODS
async def test_an_engine_that_cannot_open_raises_its_own_error_here(
    cache_dir: Path, start_method: str
) -> None:
    bad = config(cache_dir, model_options={"nope": 1}, worker_start_method=start_method)
    with trio.fail_after(CAP_S):
        with pytest.raises(InvalidConfigError, match="nope"):
            async with open_engine(bad, stage="process"):
                pass  # pragma: no cover
        with pytest.raises(InvalidConfigError, match="stage"):
            async with open_engine(config(cache_dir), stage="thread"):
                pass  # pragma: no cover


def test_the_sync_engine_runs_a_stage_too(cache_dir: Path) -> None:
    with Engine(config(cache_dir), stage="process") as engine:
        out = engine.generate("p", params(seed=5), request_id="s")
        assert decode_echo_image(out.images[0]) == ("s", 5, 0)
    with pytest.raises(EngineClosedError):
        engine.generate("p", params())


_CALLER_SCRIPT = """
import sys, trio
from omni_trio import Engine, EngineConfig, open_engine

config = EngineConfig(model="builtin:echo", cache_dir=sys.argv[1], torch_threads=1,
                      warmup=False, worker_start_method=sys.argv[2])

async def main():
    async with open_engine(config, stage="process") as engine:
        print(engine.pid, flush=True)
        await trio.sleep_forever()

if __name__ == "__main__":
    if sys.argv[3] == "dies":
        trio.run(main)
    else:  # "exits": a sync engine it never closes, then the interpreter's own exit
        engine = Engine(config, stage="process")
        print(engine.health().workers[0].pid, flush=True)  # inproc: the stage's own
        assert engine.generate("p").ok
"""


@START_METHODS
@pytest.mark.parametrize("how", ["dies", "exits"])
def test_a_caller_that_dies_or_exits_takes_its_stage_with_it(
    cache_dir: Path, tmp_path: Path, start_method: str, how: str
) -> None:
    """SIGKILLed, or exiting with its stage still open: the caller's end of the stage's
    socket closes and the stage closes its engine and ends (the caller's exit never waits
    for a stage it did not close)."""
    script = tmp_path / "caller.py"
    script.write_text(_CALLER_SCRIPT)
    caller = subprocess.Popen(
        [sys.executable, str(script), str(cache_dir), start_method, how],
        cwd=ROOT,
        stdout=subprocess.PIPE,
    )
    try:
        assert caller.stdout is not None
        stage_pid = int(caller.stdout.readline())
        if how == "dies":
            assert alive(stage_pid)
            caller.kill()
        assert caller.wait(timeout=30) == (-signal.SIGKILL if how == "dies" else 0)
        # Polled, bounded: the stage notices its socket closed and closes its engine.
        deadline = time.monotonic() + 30.0
        while alive(stage_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(stage_pid)
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()
        if caller.stdout is not None:
            caller.stdout.close()


# ---------------------------------------------------------------------------------------
# Stage processes forked from the fork server (worker_start_method "auto"/"forkserver", an
# inproc engine): what ``omni-trio serve --replicas K --stage process`` runs by default.
# ---------------------------------------------------------------------------------------


def forked(cache_dir: Path, **overrides: Any) -> EngineConfig:
    return config(cache_dir, worker_start_method="forkserver", device="cpu", **overrides)


def comm_of(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as file:
        return file.read().strip()


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as file:
        stat = file.read()
    return int(stat[stat.rindex(b")") + 2 :].split()[1])


async def test_a_forked_stage_serves_and_dies_as_a_new_interpreter_would(
    cache_dir: Path,
) -> None:
    """Forked by the fork server (its parent), named, in a process group of its own; it
    serves streams with previews; SIGKILLed mid-request, the caller sees EngineDeadError
    within a second and nothing of it is left.  A second stage forks from the same warm
    server."""
    from omni_trio.executors import tractor_executor

    cfg = forked(cache_dir, streaming_output=True, model_options={"step_delay_s": 0.05})
    assert tractor_executor.stage_forks(cfg)
    with trio.fail_after(CAP_S):
        async with open_engine(cfg, stage="process") as first:
            server = tractor_executor._forkserver_pid()
            assert server is not None and parent_of(first.pid) == server
            assert comm_of(first.pid) == PROCESS_NAME
            assert os.getpgid(first.pid) == first.pid  # its own group: the close kills it
            async with first.stream("p", params(num_inference_steps=4, seed=7)) as stream:
                chunks = [o async for o in stream]
            assert not chunks[0].finished and chunks[-1].ok
            assert decode_echo_image(chunks[-1].images[0])[1] == 7
        assert not alive(first.pid)
        async with open_engine(cfg, stage="process") as engine:
            assert parent_of(engine.pid) == server
            await kill_mid_request(engine)
            assert engine.is_dead and "killed by SIGKILL" in (engine.health().reason or "")
            with pytest.raises(EngineDeadError):
                engine.stream("p", params())
        await until(lambda: group_members(engine.pid) == [], "the process group gone")


_PROBE = """
import json, os
from omni_trio.models.echo import EchoModel

def factory(*, device, dtype, options):
    with open(options["report"], "w") as file:
        json.dump({"env": dict(os.environ), "cwd": os.getcwd(), "pid": os.getpid()}, file)
    return EchoModel(device=device, name="stage-probe")
"""


async def test_a_forked_stage_has_the_callers_environment_of_now_without_secrets(
    cache_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fork server's environment is the one of when it started; a stage forked later
    gets the caller's of when it is opened (as a new interpreter would), secrets left out,
    its working directory, and a module found only through the ``PYTHONPATH`` set since."""
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "omni_trio_stage_probe.py").write_text(_PROBE)
    report = tmp_path / "report.json"
    with trio.fail_after(CAP_S):
        async with open_engine(forked(cache_dir), stage="process"):
            pass  # the fork server runs from here on, with the environment of before
        path = os.environ.get("PYTHONPATH")
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(modules), *filter(None, [path])]))
        monkeypatch.setenv("OMNI_TRIO_STAGE_PROBE", "set since")
        monkeypatch.setenv("OMNI_TRIO_API_KEY", "sk-not-for-stages")
        workdir = tmp_path / "work"
        workdir.mkdir()
        monkeypatch.chdir(workdir)
        cfg = forked(
            cache_dir,
            model="omni_trio_stage_probe:factory",
            model_options={"report": str(report)},
        )
        async with open_engine(cfg, stage="process") as engine:
            assert (await engine.generate("p", params())).ok
    seen = json.loads(report.read_text())
    assert seen["pid"] == engine.pid
    assert seen["env"]["OMNI_TRIO_STAGE_PROBE"] == "set since"
    assert "OMNI_TRIO_API_KEY" not in seen["env"]
    assert seen["cwd"] == str(workdir)


async def test_a_fork_server_that_fails_leaves_the_stage_to_a_new_interpreter(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("the fork server is gone")

    monkeypatch.setattr(stage_module, "start_forked", broken)
    with trio.fail_after(CAP_S):
        async with open_engine(forked(cache_dir), stage="process") as engine:
            assert parent_of(engine.pid) == os.getpid()
            assert (await engine.generate("p", params())).ok


def children_of(pid: int) -> set[int]:
    """The live (not zombie) children of process ``pid``."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and alive(int(entry)):
            try:
                if parent_of(int(entry)) == pid:
                    found.add(int(entry))
            except (OSError, ValueError):
                continue
    return found


async def test_an_open_cancelled_at_any_point_leaves_no_forked_stage(cache_dir: Path) -> None:
    cfg = forked(cache_dir)
    with trio.fail_after(CAP_S):
        async with open_engine(cfg, stage="process") as warm:
            server = parent_of(warm.pid)
        await until(lambda: not alive(warm.pid), "the warm stage ended")
        before = children_of(server)
        for delay in (0.0, 0.002, 0.01, 0.03, 0.1, 0.3):
            with trio.move_on_after(delay):
                async with open_engine(cfg, stage="process"):
                    await trio.sleep_forever()
            await until(lambda: children_of(server) == before, "no stage left")


def _exit_at_once(*args: object) -> None:
    """A forked stage's entry that ends before it connects (a fake, for the test below)."""
    os._exit(3)


async def test_a_forked_stage_that_ends_before_it_connects_is_engine_dead(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(stage_module, "SERVE_FORKED", f"{__name__}:_exit_at_once")
    with trio.fail_after(CAP_S):
        with pytest.raises(EngineDeadError, match=r"ended while starting \(exit code 3\)"):
            async with open_engine(forked(cache_dir), stage="process"):
                pass  # pragma: no cover


_SERVER_DIES_SCRIPT = """
import os, signal, sys, time, trio
from omni_trio import EngineConfig, SamplingParams, open_engine

def fields(pid):
    with open(f"/proc/{pid}/stat", "rb") as file:
        stat = file.read()
    return stat[stat.rindex(b")") + 2 :].split()

def parent_of(pid):
    return int(fields(pid)[1])

def alive(pid):  # a zombie is not (the fork server is this process's child)
    try:
        return fields(pid)[0] != b"Z"
    except OSError:
        return False

async def main():
    config = EngineConfig(model="builtin:echo", cache_dir=sys.argv[1], torch_threads=1,
                          warmup=False, worker_start_method="forkserver", device="cpu")
    params = SamplingParams(height=32, width=32, num_inference_steps=2)
    async with open_engine(config, stage="process") as engine:
        server = parent_of(engine.pid)
        os.kill(server, signal.SIGKILL)
        while alive(server):
            await trio.sleep(0.01)
        await trio.sleep(0.2)  # what the stage's watcher would see by now
        assert engine.health().healthy, engine.health()
        assert (await engine.generate("p", params)).ok
        async with open_engine(config, stage="process") as again:  # from a new server
            assert parent_of(again.pid) != server
            assert (await again.generate("p", params)).ok
        os.kill(engine.pid, signal.SIGKILL)  # orphaned: watched by its pid
        with trio.fail_after(5):
            await engine.wait_ended()
        assert "exit code 255" in (engine.health().reason or ""), engine.health()
    print("ok", flush=True)

if __name__ == "__main__":
    trio.run(main)
"""


def test_a_fork_server_that_dies_leaves_its_stages_serving(cache_dir: Path, tmp_path: Path) -> None:
    """The fork server killed under an open stage: the stage goes on serving (its status
    is then unknown, 255, and it is watched by its pid), and the next stage is forked from
    a new server.  (In a process of its own: the tests' fork server stays.)"""
    script = tmp_path / "server_dies.py"
    script.write_text(_SERVER_DIES_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(cache_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


async def test_only_the_forked_stage_itself_may_connect_back(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection to the stage's socket from another process (here: this one, first) is
    closed; the stage's own is the one served."""
    real = stage_module.start_forked
    strangers: list[socket.socket] = []

    def stranger_first(target: str, args: tuple[Any, ...], *, name: str) -> Any:
        stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stranger.connect(args[0])  # the socket's path
        strangers.append(stranger)
        return real(target, args, name=name)

    monkeypatch.setattr(stage_module, "start_forked", stranger_first)
    with trio.fail_after(CAP_S):
        async with open_engine(forked(cache_dir), stage="process") as engine:
            assert (await engine.generate("p", params(seed=4))).ok
    [stranger] = strangers
    stranger.settimeout(10.0)
    assert stranger.recv(1) == b""  # closed by the caller, never spoken to
    stranger.close()
