"""The ipc package namespace is its public API, and importing it stays cheap."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

import omni_trio.ipc as ipc

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)


def test_all_is_exactly_what_the_package_exports() -> None:
    public = {
        name
        for name, value in vars(ipc).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == set(ipc.__all__)
    for name in ipc.__all__:
        assert getattr(ipc, name) is not None


def test_import_does_not_pull_in_torch_numpy_or_pil() -> None:
    code = (
        "import sys, omni_trio.ipc; "
        "print(sorted(m for m in ('torch', 'numpy', 'PIL') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
