"""README.md and docs/*.md agree with the code: every example is accounted for (see
tests/test_docs_examples.py, which runs them), and the facts the docs state in several places
(the torch thread default, the models with a step adapter, the CLI flags, what the warmup
counts) say what the code does.  Nothing here starts a process."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from omni_trio import open_engine
from omni_trio.config import default_torch_threads
from omni_trio.models.builtin import BUILTIN_MODELS
from tests.test_docs_examples import (
    DOCS,
    EXAMPLES,
    ROOT,
    Covered,
    NotRun,
    Run,
    all_examples,
    find,
)

TEST_MODULE = Path(__file__).resolve().parent / "test_docs_examples.py"


def _read(doc: str) -> str:
    return (ROOT / doc).read_text("utf-8")


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text("utf-8"))
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
    }


# -- every example is accounted for ------------------------------------------------------------


def test_every_example_has_exactly_one_entry() -> None:
    claimed: dict[str, list[tuple[str, str]]] = {}
    for key in EXAMPLES:
        found = find(*key)
        assert len(found) == 1, f"{key} matches {len(found)} examples: {[e.where for e in found]}"
        claimed.setdefault(found[0].where, []).append(key)
    unaccounted = [e.where for e in all_examples() if e.where not in claimed]
    assert not unaccounted, (
        f"examples nobody runs: {unaccounted}; run them in tests/test_docs_examples.py "
        "(Run), name the test that does (Covered), or say why they cannot run here (NotRun)"
    )
    doubled = {where: keys for where, keys in claimed.items() if len(keys) > 1}
    assert not doubled, doubled


def test_the_examples_found_are_the_fenced_runnable_blocks() -> None:
    langs = {e.lang for e in all_examples()}
    assert langs <= {"python", "console", "sh", "shell", "bash"}
    assert {"README.md", "docs/user-guide.md", "docs/operations.md"} <= set(DOCS)
    assert len(all_examples()) >= 25


def test_covered_and_run_name_tests_that_exist() -> None:
    here = _test_names(TEST_MODULE)
    for key, how in EXAMPLES.items():
        if isinstance(how, Run):
            assert how.test in here, (key, how)
        elif isinstance(how, Covered):
            path, name = how.test.split("::")
            assert name in _test_names(ROOT / path), (key, how)
        else:
            assert isinstance(how, NotRun) and len(how.reason) > 20, (key, how)


# -- facts stated in several places ------------------------------------------------------------


def test_the_torch_thread_default_is_described_as_the_code_computes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for cores, workers, threads in ((2, 1, 1), (16, 1, 15), (16, 2, 7), (1, 1, 1), (4, 8, 1)):
        monkeypatch.setattr("os.sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert default_torch_threads(workers) == threads
    wrong = re.compile(r"\bcores ?/ ?(workers|`num_workers`)")
    for doc in DOCS:
        text = _read(doc)
        assert not wrong.search(text), f"{doc} describes the default torch threads as cores / N"
    assert "(cores - 1) / `num_workers`, at least 1" in _read("README.md")
    assert "(cores - 1) / workers, at least 1" in _read("docs/operations.md")
    assert "**1 on a 2-core machine**" in _read("docs/benchmarks.md")


def test_the_cli_help_states_the_same_torch_thread_default() -> None:
    from omni_trio.cli import build_parser

    parser = build_parser()
    subcommands = next(
        a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"
    ).choices
    for command in ("generate", "demo", "serve"):
        text = " ".join(subcommands[command].format_help().split())
        assert "(cores - 1) / workers, at least 1" in text, command


def test_every_builtin_model_is_in_the_step_adapter_table() -> None:
    text = _read("docs/execution-modes.md")
    table = text.split("| model | step adapter |", 1)[1].split("\n\n", 1)[0]
    first_column = " ".join(line.split("|")[1] for line in table.splitlines()[2:])
    missing = [name for name in BUILTIN_MODELS if f"`{name}`" not in first_column]
    assert not missing, missing


def test_every_flag_of_the_cli_synopsis_exists() -> None:
    from omni_trio.cli import build_parser

    parser = build_parser()
    subcommands = next(
        a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"
    ).choices
    (synopsis,) = find("docs/user-guide.md", 'omni-trio generate "a prompt" [')
    commands = re.split(r"^\$ omni-trio ", synopsis.body, flags=re.MULTILINE)[1:]
    checked = 0
    for text in commands:
        name = text.split()[0]
        if name.startswith("-"):
            continue  # the top-level options line
        known = {opt for action in subcommands[name]._actions for opt in action.option_strings}
        for flag in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", text):
            assert flag in known, f"omni-trio {name} has no {flag}"
            checked += 1
    assert checked > 20


async def test_the_warmup_is_not_counted_in_the_statistics(cache_dir: Path) -> None:
    """docs/user-guide.md: the warmup request is never counted."""
    assert "The warmup request (`warmup=True`) is never counted" in _read("docs/user-guide.md")
    async with open_engine(model="builtin:echo", cache_dir=str(cache_dir), warmup=True) as engine:
        stats = engine.statistics()
    assert stats.admitted == 0 and stats.finished_completed == 0
    assert stats.end_to_end.count == 0


def test_the_docs_say_how_to_scale_throughput() -> None:
    readme = " ".join(_read("README.md").split())
    assert "grows with `--data-parallel N`" in readme and "not with `--workers`" in readme
    assert "with `--replicas K`" in readme
    operations = " ".join(_read("docs/operations.md").split())
    assert "### Scaling throughput" in _read("docs/operations.md")
    assert "(`--replicas K`)" in operations and "(`--data-parallel N`)" in operations
    assert "(`--workers N`) alone does **not**" in operations


def test_the_readme_serve_example_waits_for_ready() -> None:
    (serve,) = find("README.md", "omni-trio serve")
    lines = [line for line in serve.body.splitlines() if line.startswith("$ ")]
    assert lines[0].endswith("&")
    assert "/ready" in lines[1] and lines[1].startswith("$ until curl")
    assert "/v1/images/generations" in lines[2]


def test_every_serve_setting_is_in_the_configuration_table_with_its_default() -> None:
    """docs/operations.md's configuration table names every ServeConfig field (the
    ``[engine]`` table is EngineConfig's, documented apart), each flag, and for the number
    settings the default the code has."""
    import dataclasses

    from omni_trio.serve.config import FLAGS, ServeConfig

    text = _read("docs/operations.md")
    section = text[text.index("## Configuration") : text.index("### Scaling throughput")]
    rows = {m[1]: m[0] for m in re.finditer(r"^\| `\[?([a-z_]+)\]?`[^\n]*", section, re.M)}
    defaults = ServeConfig()
    for field in dataclasses.fields(ServeConfig):
        if field.name == "engine":
            continue
        assert field.name in rows, f"{field.name} is not in the configuration table"
        value = getattr(defaults, field.name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            cell = rows[field.name].split("|")[3].strip().strip("`")
            assert float(cell) == value, (field.name, cell, value)
    assert [flag.option for flag in FLAGS if flag.option not in section] == []
