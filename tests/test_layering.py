"""The package's layering, held by a test so it cannot erode silently.

Every import counts (module level, inside functions, under ``TYPE_CHECKING``): a type-only
import couples two modules as surely as any other.  Two rules:

* no cycle between modules;
* a package imports only the packages below it in :data:`ALLOWED` (the engine's shell never
  reaches past its executors, executors never past their workers, the model layer never up
  into the workers that run it).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import omni_trio

ROOT = Path(omni_trio.__file__).parent

# Which units each unit may import.  Reading down the table is reading down the house:
#   serve, testing, bench, cli, fuzz   (on top)
#   runtime      the engine shell       -> executors, supervisor, _core
#   executors    backends               -> worker, ipc, _core
#   worker       worker, runner, packer -> models, ipc, _core
#   models       diffusers and built-ins -> _core
#   ipc          codec, shared memory   -> _core
#   _core        pure core              -> errors
# with config, errors and the generic supervisor at the ground floor (beside config: the
# import-path resolver and the extension points' checks it makes).
_GROUND = {"_core", "errors", "config", "import_path", "extensions"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "_core": {"errors"},
    "import_path": {"errors"},
    "extensions": {"_core", "errors", "import_path"},
    "config": {"_core", "errors", "import_path", "extensions"},
    "supervisor": {"errors"},
    "cli_support": {"errors"},
    "ipc": _GROUND,
    "models": _GROUND,
    "worker": {"models", "ipc"} | _GROUND,
    "executors": {"worker", "ipc"} | _GROUND,
    "runtime": {"executors", "supervisor"} | _GROUND,
    "package": {"runtime", "executors"} | _GROUND,
    "serve": {"runtime", "executors", "supervisor"} | _GROUND,
    "testing": {"runtime", "executors", "worker", "models", "ipc"} | _GROUND,
    "bench": {"serve", "testing", "runtime", "executors", "worker", "models", "ipc", "supervisor"}
    | {"cli_support"}
    | _GROUND,
    "fuzz": {"testing", "runtime", "cli_support", "package"} | _GROUND,
    "cli": {"fuzz", "bench", "serve", "testing", "runtime", "models", "package", "cli_support"}
    | _GROUND,
}


def _module_name(path: Path) -> str:
    parts = ["omni_trio", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def unit_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "package"
    top = parts[1]
    if top in ("_cli_exit", "_cli_args", "_cli_render"):
        return "cli_support"
    return top


def _imports(module: str) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import of ``module`` inside the package."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "omni_trio":
                    yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] != "omni_trio":
                continue
            for alias in node.names:  # "from . import cli" imports a module
                sub = f"{target}.{alias.name}"
                yield (sub if sub in MODULES else target), node.lineno


def _resolve(target: str) -> str | None:
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module in MODULES:
        resolved = {_resolve(target) for target, _ in _imports(module)}
        graph[module] = {t for t in resolved if t is not None and t != module}
    return graph


GRAPH = _graph()


def test_every_module_has_a_unit_in_the_table() -> None:
    assert {unit_of(m) for m in MODULES} <= set(ALLOWED)
    assert len(MODULES) > 60  # the whole package was read


def test_no_module_imports_a_unit_it_must_not() -> None:
    bad = []
    for module in sorted(MODULES):
        source = unit_of(module)
        for target, line in _imports(module):
            resolved = _resolve(target)
            if resolved is None:
                continue
            dest = unit_of(resolved)
            if dest != source and dest not in ALLOWED[source]:
                bad.append(f"{module}:{line} -> {resolved} ({source} -> {dest})")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles() -> None:
    assert _cycles(GRAPH) == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ],
)
def test_the_cycle_finder_finds_cycles(
    graph: dict[str, set[str]], expected: list[list[str]]
) -> None:
    assert _cycles(graph) == expected
