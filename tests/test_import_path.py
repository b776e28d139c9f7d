"""``omni_trio.import_path``: resolving ``"package.module:Name"`` and making classes travel."""

from __future__ import annotations

import collections
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_trio.errors import InvalidConfigError
from omni_trio.import_path import (
    import_path_of,
    is_import_path,
    portable_path,
    resolve_class,
    resolve_import_path,
)
from tests.extension_examples import CountingRunner, RecordingScheduler


class Outer:
    class Inner:
        pass


def make_local() -> type:
    class Local:
        pass

    return Local


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("pkg.mod:Name", True),
        ("mod:Name", True),
        ("a.b.c:Outer.Inner", True),
        ("_private._mod:_name", True),
        ("builtin:echo", True),  # shaped like one: callers rule built-ins out first
        ("pkg.mod", False),
        (":Name", False),
        ("pkg.mod:", False),
        ("pkg mod:Name", False),
        ("pkg.mod:Na-me", False),
        ("org/repo:rev", False),
        ("1pkg:Name", False),
        ("a:b:c", False),
        ("", False),
    ],
)
def test_is_import_path_checks_the_shape_only(text: str, expected: bool) -> None:
    assert is_import_path(text) is expected


def test_is_import_path_is_false_for_non_strings() -> None:
    assert not is_import_path(None)
    assert not is_import_path(Outer)


def test_resolve_finds_modules_attributes_and_nested_names() -> None:
    assert resolve_import_path("collections:OrderedDict", field="f") is collections.OrderedDict
    found = resolve_import_path("tests.test_import_path:Outer.Inner", field="f")
    assert found is Outer.Inner
    assert resolve_import_path("os.path:join", field="f") is sys.modules["os.path"].join


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_such_module_xyz:Name", "cannot import module 'no_such_module_xyz' (ModuleNotFound"),
        ("collections:NoSuchName", "module 'collections' has no 'NoSuchName'"),
        ("tests.test_import_path:Outer.Missing", "has no 'Outer.Missing'"),
        ("not a path", "must be an import path 'package.module:Name'"),
    ],
)
def test_resolve_failures_name_the_field_in_one_line(path: str, message: str) -> None:
    with pytest.raises(InvalidConfigError, match=r"^my_field") as failed:
        resolve_import_path(path, field="my_field")
    assert failed.value.field == "my_field"
    assert message in str(failed.value)
    assert "\n" not in str(failed.value)


@pytest.fixture
def broken_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module whose import raises (not an ImportError), with a two-line message."""
    name = "omni_trio_test_broken_module"
    (tmp_path / f"{name}.py").write_text('raise ZeroDivisionError("division by zero\\nsecond")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_module_whose_import_raises_is_one_line(broken_module: str) -> None:
    with pytest.raises(InvalidConfigError) as failed:
        resolve_import_path(f"{broken_module}:x", field="model")
    text = str(failed.value)
    assert "ZeroDivisionError: division by zero second" in text
    assert "\n" not in text and failed.value.field == "model"


def test_resolve_class_accepts_a_class_or_a_path_of_a_subclass() -> None:
    path = "tests.extension_examples:RecordingScheduler"
    assert resolve_class(path, field="f", base=object) is RecordingScheduler
    assert resolve_class(RecordingScheduler, field="f", base=RecordingScheduler) is (
        RecordingScheduler
    )


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("tests.extension_examples:CountingRunner", "'tests.extension_examples:CountingRunner'"),
        (CountingRunner, "class tests.extension_examples.CountingRunner"),
        ("tests.extension_examples:SMALL", "SMALL"),
        (42, "42"),
    ],
)
def test_resolve_class_refuses_what_is_not_a_subclass(value: object, shown: str) -> None:
    with pytest.raises(InvalidConfigError, match="must be a sub") as failed:
        resolve_class(value, field="scheduler_cls", base=RecordingScheduler)
    assert failed.value.field == "scheduler_cls" and shown in str(failed.value)


def test_import_path_of_names_module_and_qualname() -> None:
    assert import_path_of(Outer.Inner) == "tests.test_import_path:Outer.Inner"
    assert import_path_of(collections.OrderedDict) == "collections:OrderedDict"


def test_portable_path_turns_importable_classes_into_paths() -> None:
    assert portable_path(CountingRunner, field="f") == "tests.extension_examples:CountingRunner"
    assert portable_path(Outer.Inner, field="f") == "tests.test_import_path:Outer.Inner"
    assert portable_path("any.module:Name", field="f") == "any.module:Name"  # not imported


def test_portable_path_refuses_local_classes() -> None:
    with pytest.raises(InvalidConfigError, match="inside a function") as failed:
        portable_path(make_local(), field="runner_cls")
    assert failed.value.field == "runner_cls"
    assert "define it at the top level of an importable module" in str(failed.value)


def test_portable_path_refuses_classes_of_main() -> None:
    main_class = type("FromScript", (), {"__module__": "__main__"})
    with pytest.raises(InvalidConfigError, match="defined in __main__") as failed:
        portable_path(main_class, field="worker_extension_cls")
    assert failed.value.field == "worker_extension_cls"


def test_portable_path_refuses_a_class_its_path_does_not_lead_back_to() -> None:
    impostor = type("CountingRunner", (), {"__module__": "tests.extension_examples"})
    with pytest.raises(InvalidConfigError, match="cannot be imported back"):
        portable_path(impostor, field="runner_cls")
    ghost = type("Ghost", (), {"__module__": "no_such_module_xyz"})
    with pytest.raises(InvalidConfigError, match="cannot be imported back"):
        portable_path(ghost, field="runner_cls")


@pytest.mark.parametrize("value", ["not a path", 42, None])
def test_portable_path_refuses_what_is_neither_a_class_nor_a_path(value: object) -> None:
    with pytest.raises(InvalidConfigError) as failed:
        portable_path(value, field="runner_cls")
    assert failed.value.field == "runner_cls"
