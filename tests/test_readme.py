"""The README's Python examples run as written, so the README cannot rot.

Every fenced ```` ```python ```` block in README.md is run, unchanged, as its own script in a
fresh interpreter, in a temporary directory, with a temporary model cache.  The blocks run
concurrently (each pays the torch/diffusers import once).  Blocks that are not meant to run
must use another fence language (``console``, ``text``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

README = Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.DOTALL | re.MULTILINE)
_TIMEOUT_S = 180.0


def python_blocks(text: str) -> list[str]:
    """The bodies of the ```python fenced blocks of ``text``, in order."""
    return [m.group(1) for m in _BLOCK.finditer(text)]


def test_python_blocks_are_found() -> None:
    sample = "intro\n```python\nprint(1)\n```\n```console\n$ x\n```\n```python\nprint(2)\n```\n"
    assert python_blocks(sample) == ["print(1)\n", "print(2)\n"]


def test_readme_has_the_quick_start_commands_first() -> None:
    text = README.read_text("utf-8")
    quick = text[text.index("## Quick start") :]
    commands = [
        line.strip()
        for line in quick.split("```console\n", 1)[1].split("```", 1)[0].splitlines()
        if line.strip()
    ]
    assert commands[:2] == ["make demo", "make test"]


@pytest.mark.slow
def test_readme_python_examples_run(tmp_path: Path, cache_dir: Path) -> None:
    blocks = python_blocks(README.read_text("utf-8"))
    assert len(blocks) >= 2, "README.md should show the async and the sync library examples"
    env = dict(os.environ)
    env.update(
        OMNI_TRIO_CACHE=str(cache_dir),
        OMP_WAIT_POLICY="PASSIVE",
        OMP_NUM_THREADS="1",
        TRANSFORMERS_VERBOSITY="error",
        PYTHONUNBUFFERED="1",
    )
    procs = []
    for index, code in enumerate(blocks):
        workdir = tmp_path / f"block-{index}"
        workdir.mkdir()
        script = workdir / "example.py"
        script.write_text(code, "utf-8")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                cwd=workdir,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    deadline = time.monotonic() + _TIMEOUT_S
    failures = []
    for index, proc in enumerate(procs):
        try:
            output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
            failures.append(f"block {index} timed out after {_TIMEOUT_S} s:\n{output}")
            continue
        if proc.returncode != 0:
            failures.append(f"block {index} exited {proc.returncode}:\n{output}")
    assert not failures, "\n\n".join(failures)
    # The examples save what they render; check that they did.
    written = sorted(p.name for p in tmp_path.glob("block-*/*.png"))
    assert "lighthouse.png" in written
    assert "ramen.png" in written
