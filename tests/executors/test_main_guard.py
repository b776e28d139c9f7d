"""A script that opens a tractor engine without ``if __name__ == "__main__":`` gets one
clear error, before any worker is spawned (it used to get ~340 lines ending in tractor's
``IndexError``, after every worker had died re-running the script).

The scripts are real, run as subprocesses in a temporary directory, each bounded by a
timeout; a marker in their environment (inherited by anything they start) shows that no
process of theirs outlives them.
"""

from __future__ import annotations

import ast
import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from omni_trio.errors import InvalidConfigError
from omni_trio.executors._main_guard import GUARD_HINT, _compares_name, main_rerun_failure

pytestmark = pytest.mark.slow  # runs scripts as processes (see tests/spawn_guard.py)

TIMEOUT_S = 120
ROOT = Path(__file__).resolve().parents[2]


def _processes_with(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker.encode() in environ:
            found.append(int(entry.name))
    return found


def _run(tmp_path: Path, source: str, name: str = "script.py") -> subprocess.CompletedProcess[str]:
    script = tmp_path / name
    script.write_text(textwrap.dedent(source))
    marker = f"omni-trio-guard-test-{secrets.token_hex(8)}"
    env = {
        **os.environ,
        "OMNI_TRIO_GUARD_TEST": marker,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1",
        "OMNI_TRIO_CACHE": str(tmp_path / "cache"),
    }
    try:
        proc = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    finally:
        assert _processes_with(f"OMNI_TRIO_GUARD_TEST={marker}") == []
    return proc


def _assert_one_clear_error(proc: subprocess.CompletedProcess[str], line: int) -> None:
    assert proc.returncode == 1
    assert proc.stdout == ""
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("omni_trio.errors.InvalidConfigError: ")
    assert f"script.py, line {line}, opens a tractor engine outside" in last
    assert last.endswith(GUARD_HINT)
    assert "IndexError" not in proc.stderr
    assert "RemoteActorError" not in proc.stderr
    assert "WorkerDied" not in proc.stderr
    assert "Exception Group" not in proc.stderr
    assert len(proc.stderr.splitlines()) < 100  # the traceback of one error, no worker's


def test_a_sync_engine_outside_the_guard_is_refused_before_any_worker(tmp_path: Path) -> None:
    proc = _run(
        tmp_path,
        """\
        from omni_trio import Engine, EngineConfig

        config = EngineConfig(model="builtin:echo", backend="tractor", warmup=False)
        with Engine(config) as engine:
            print("opened")
        """,
    )
    _assert_one_clear_error(proc, line=4)


def test_an_async_engine_outside_the_guard_is_refused_before_any_worker(tmp_path: Path) -> None:
    proc = _run(
        tmp_path,
        """\
        import trio

        from omni_trio import open_engine


        async def main() -> None:
            async with open_engine(model="builtin:echo", backend="tractor", warmup=False):
                print("opened")


        trio.run(main)
        """,
    )
    _assert_one_clear_error(proc, line=11)


def test_the_verdict_follows_the_statement_that_runs(tmp_path: Path) -> None:
    """Where the check stands at each point of a script (``unguarded_statement`` reads the
    main module's frame): unguarded top-level code is flagged, ``__name__`` used elsewhere
    (a logger) is no guard, every form of a ``__name__`` check is."""
    proc = _run(
        tmp_path,
        """\
        import logging
        import threading

        from omni_trio.executors._main_guard import unguarded_statement

        log = logging.getLogger(__name__)
        print("top", unguarded_statement())


        def in_a_function():
            return unguarded_statement()


        print("function", in_a_function())
        thread_result = []
        worker = threading.Thread(target=lambda: thread_result.append(unguarded_statement()))
        worker.start(); worker.join()  # one line: the thread may run before start() returns
        print("thread", thread_result[0])
        if __name__ == "__main__":
            print("guarded", unguarded_statement())
        print("after", unguarded_statement())
        """,
    )
    assert proc.returncode == 0, proc.stderr
    path = str(tmp_path / "script.py")
    assert proc.stdout.splitlines() == [
        f"top ('{path}', 7)",
        f"function ('{path}', 14)",
        f"thread ('{path}', 17)",  # the sync Engine opens its engine in a thread
        "guarded None",
        "after None",  # a __name__ check came before: it may have ended the script
    ]


def test_a_guarded_script_opens_its_tractor_engine(tmp_path: Path) -> None:
    """No false alarm on the usual layout (a logger named by ``__name__`` at the top): the
    worker process really starts and serves."""
    proc = _run(
        tmp_path,
        """\
        import logging

        from omni_trio import Engine, EngineConfig, SamplingParams

        log = logging.getLogger(__name__)


        def main() -> None:
            config = EngineConfig(model="builtin:echo", backend="tractor", warmup=False)
            with Engine(config) as engine:
                output = engine.generate("x", SamplingParams(num_inference_steps=1, seed=1))
                print("ok", output.ok)


        if __name__ == "__main__":
            main()
        """,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "ok True\n"


@pytest.mark.parametrize(
    ("source", "guards"),
    [
        ('if __name__ == "__main__":\n    main()', True),
        ('if "__main__" == __name__:\n    main()', True),
        ('if __name__ != "__main__":\n    raise SystemExit', True),
        ('main() if __name__ == "__main__" else None', True),
        ('match __name__:\n    case "__main__":\n        main()', True),
        ("log = logging.getLogger(__name__)", False),
        ("main()", False),
    ],
)
def test_what_counts_as_a_name_guard(source: str, guards: bool) -> None:
    assert _compares_name(ast.parse(source).body[0]) is guards


class _RemoteError(Exception):
    """What tractor raises for a worker's failure: the remote traceback in ``msgdata``."""

    def __init__(self, tb: str, type_str: str) -> None:
        super().__init__(type_str)
        self.msgdata = {"tb_str": tb, "type_str": type_str}


def test_a_worker_that_failed_re_running_the_main_module_is_one_line() -> None:
    rerun = _RemoteError(
        'Traceback (most recent call last):\n  File "tractor/_actor.py", line 508, in '
        'load_modules\n    _mp_fixup_main._fixup_main_from_path(\n  File "/x/s.py", line 6\n'
        "RuntimeError: Attempted to call run() from inside a run()\n",
        "RuntimeError",
    )
    other = _RemoteError("Traceback ...\nValueError: boom\n", "ValueError")
    for exc in (rerun, BaseExceptionGroup("start failed", [ValueError("died"), rerun])):
        guard = main_rerun_failure(exc)
        assert isinstance(guard, InvalidConfigError)
        message = str(guard)
        assert "\n" not in message
        assert "RuntimeError: Attempted to call run() from inside a run()" in message
        assert message.endswith(GUARD_HINT)
    assert main_rerun_failure(other) is None
    assert main_rerun_failure(ValueError("plain")) is None
