"""``omni_trio._core`` is the pure core: no trio, no I/O, nothing outside the stdlib."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import omni_trio._core

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

CORE_DIR = Path(omni_trio._core.__file__).parent
CORE_MODULES = sorted(p.stem for p in CORE_DIR.glob("*.py") if p.stem != "__init__")
# Relative imports the core may make: its own modules and the error tree.
ALLOWED_RELATIVE = {(1, m) for m in CORE_MODULES} | {(2, "errors")}


def test_core_modules_are_found() -> None:
    assert {"keys", "lifecycle", "messages", "request", "scheduler"} <= set(CORE_MODULES)


# The package ``__init__`` re-exports the trio runtime, so importing ``omni_trio._core.x`` the
# ordinary way always imports trio.  These checks bypass ``omni_trio/__init__.py`` with a bare
# package module, so that what is measured is the import closure of the core module itself.
_IMPORT_WITHOUT_PACKAGE_INIT = """
import sys, types
pkg = types.ModuleType("omni_trio")
pkg.__path__ = [{pkg_dir!r}]
sys.modules["omni_trio"] = pkg
import {module}
leaked = sorted(m for m in ("trio", "tractor", "torch", "diffusers") if m in sys.modules)
assert not leaked, leaked
"""


@pytest.mark.parametrize(
    "module",
    [*(f"omni_trio._core.{m}" for m in CORE_MODULES), "omni_trio.errors", "omni_trio.config"],
)
def test_importing_the_core_does_not_import_trio(module: str) -> None:
    code = _IMPORT_WITHOUT_PACKAGE_INIT.format(pkg_dir=str(CORE_DIR.parent), module=module)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_imports_only_stdlib_and_itself(module: str) -> None:
    tree = ast.parse((CORE_DIR / f"{module}.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                assert top in sys.stdlib_module_names, f"{module} imports {alias.name}"
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                assert (node.level, node.module) in ALLOWED_RELATIVE, (
                    f"{module} imports {'.' * node.level}{node.module}"
                )
            else:
                top = (node.module or "").split(".")[0]
                assert top in sys.stdlib_module_names or top == "__future__", (
                    f"{module} imports {node.module}"
                )
