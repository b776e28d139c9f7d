"""docs/architecture.md describes what is built: every module path, core event, instruction,
state, leftover kind and layering rule it names exists in the code, and its tables match it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from omni_trio._core import engine_core, health, lifecycle
from omni_trio._core.engine_core import EngineCore
from omni_trio._core.lifecycle import RequestStatus
from omni_trio.testing.invariants import ENGINE_WIDE_KINDS, SETTLING_KINDS, STRICT_KINDS
from tests.test_layering import ALLOWED

REPO = Path(__file__).resolve().parent.parent
DOC = (REPO / "docs" / "architecture.md").read_text("utf-8")


def section(title: str) -> str:
    start = DOC.index(f"\n## {title}\n")
    end = DOC.find("\n## ", start + 1)
    return DOC[start : end if end != -1 else None]


def table_rows(text: str) -> list[list[str]]:
    rows = []
    for line in text.splitlines():
        if line.startswith("|") and not set(line) <= set("|-: "):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows[1:] if rows else rows  # without the header


def ticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))


def test_every_module_path_exists() -> None:
    paths = sorted(
        {p for p in ticked(DOC) if re.fullmatch(r"(omni_trio|tests|property_tests)/[\w/]+\.py", p)}
    )
    assert len(paths) > 15
    missing = [p for p in paths if not (REPO / p).is_file()]
    assert not missing, missing


def test_every_core_event_in_the_table_is_a_method_of_the_core() -> None:
    first_column = [row[0] for row in table_rows(section("The core and its shell"))]
    names = [name for cell in first_column for name in re.findall(r"`(\w+)\(", cell)]
    assert {"admit", "schedule", "runner_output", "output_ready", "abort", "close", "die"} <= set(
        names
    )
    missing = [n for n in names if not callable(getattr(EngineCore, n, None))]
    assert not missing, missing


def test_the_instructions_are_the_cores() -> None:
    text = section("The core and its shell")
    listed = {
        row[0].strip("`")
        for row in table_rows(text)
        if row[0].startswith("`") and "(" not in row[0]
    }
    assert listed == {t.__name__ for t in engine_core.Instruction.__args__}


def test_the_transition_table_is_the_one_in_the_code() -> None:
    rows = table_rows(section("Lifecycle"))
    documented = {
        RequestStatus[row[0].strip("`")]: {
            RequestStatus[name] for name in re.findall(r"`(\w+)`", row[1])
        }
        for row in rows
    }
    assert documented == {k: set(v) for k, v in lifecycle._ALLOWED.items()}


def test_every_state_named_exists() -> None:
    caps = {w for w in ticked(DOC) if re.fullmatch(r"[A-Z][A-Z_]+", w)}
    known = set(RequestStatus.__members__) | {"COMPUTE_DONE", "OUTPUT_READY", "RPC_RESULT"}
    known |= {"STRICT_KINDS", "SETTLING_KINDS", "ENGINE_WIDE_KINDS", "BUILTIN_BACKENDS"}
    assert caps <= known, caps - known
    for enum, values in [
        (health.GroupState, ("starting", "running", "restarting", "failed", "stopped")),
    ]:
        assert {m.value for m in enum} == set(values)
        assert all(f"`{v}`" in DOC for v in values)


def test_the_leftover_kinds_are_the_checkers() -> None:
    text = section("Leftovers: what every component holds")
    named = {w for w in ticked(text) if re.fullmatch(r"[a-z_]+", w)}
    kinds = STRICT_KINDS | SETTLING_KINDS | ENGINE_WIDE_KINDS
    assert kinds <= named, kinds - named


@pytest.mark.parametrize("unit", sorted(ALLOWED))
def test_the_layering_table_is_the_tests(unit: str) -> None:
    rows = {row[0].strip("`"): row[1] for row in table_rows(section("Layering"))}
    documented = set(re.findall(r"`(\w+)`", rows[unit]))
    assert documented == ALLOWED[unit]
