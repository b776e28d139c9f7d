"""docs/execution-modes.md's Python examples run as written (streaming on echo, the toy step
adapter served in both modes), each as its own script in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_readme import python_blocks

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

DOC = Path(__file__).resolve().parent.parent / "docs" / "execution-modes.md"
_TIMEOUT_S = 180.0


@pytest.mark.slow
def test_execution_modes_examples_run(tmp_path: Path, cache_dir: Path) -> None:
    blocks = python_blocks(DOC.read_text("utf-8"))
    assert len(blocks) == 2, "the streaming example and the worked step adapter example"
    env = dict(os.environ)
    env.update(
        OMNI_TRIO_CACHE=str(cache_dir),
        OMP_WAIT_POLICY="PASSIVE",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    procs = []
    for index, code in enumerate(blocks):
        script = tmp_path / f"example_{index}.py"
        script.write_text(code, "utf-8")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    failures = []
    for index, proc in enumerate(procs):
        try:
            output, _ = proc.communicate(timeout=_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            failures.append(f"block {index} timed out after {_TIMEOUT_S} s:\n{output}")
            continue
        if proc.returncode != 0:
            failures.append(f"block {index} exited {proc.returncode}:\n{output}")
    assert not failures, "\n\n".join(failures)
