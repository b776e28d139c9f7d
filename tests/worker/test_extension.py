"""``omni_trio.worker.extension`` and the worker that uses it: the runner class the worker
builds, and a worker extension's methods served as RPCs beside the built-in ones."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from omni_trio.config import EngineConfig
from omni_trio.errors import InvalidConfigError
from omni_trio.worker.extension import (
    WorkerExtension,
    extension_class,
    public_methods,
    runner_class,
)
from omni_trio.worker.runner import ModelRunner
from omni_trio.worker.worker import RPC_METHODS, Worker
from tests.extension_examples import CountingRunner, InspectExtension
from tests.worker.test_worker import request, wave


class Methods:
    value = 3

    def public(self) -> int:
        return 1

    @staticmethod
    def static() -> int:
        return 2

    @property
    def prop(self) -> int:
        return 4

    def _private(self) -> None:
        pass


class Clashing:
    def __init__(self, worker: Any) -> None:
        pass

    def ping(self) -> str:
        return "mine"

    def describe(self) -> str:
        return "mine"


def test_public_methods_are_the_callables_not_starting_with_an_underscore() -> None:
    assert public_methods(Methods) == {"public", "static"}
    assert public_methods(InspectExtension) == {"inspect", "fail"}


def test_runner_class_defaults_to_model_runner() -> None:
    assert runner_class(None) is ModelRunner
    assert runner_class(CountingRunner) is CountingRunner
    assert runner_class("tests.extension_examples:CountingRunner") is CountingRunner


@pytest.mark.parametrize(
    "value", [Methods, "tests.extension_examples:InspectExtension", "no_such_xyz:R"]
)
def test_runner_class_refuses_what_is_not_a_model_runner(value: object) -> None:
    with pytest.raises(InvalidConfigError) as failed:
        runner_class(value)
    assert failed.value.field == "runner_cls"


def test_extension_class_resolves_and_checks_names() -> None:
    assert extension_class(None, reserved=RPC_METHODS) is None
    assert extension_class(InspectExtension, reserved=RPC_METHODS) is InspectExtension
    path = "tests.extension_examples:InspectExtension"
    assert extension_class(path, reserved=RPC_METHODS) is InspectExtension
    with pytest.raises(InvalidConfigError, match="may not override") as failed:
        extension_class(Clashing, reserved=RPC_METHODS)
    assert failed.value.field == "worker_extension_cls"
    assert "built-in RPC method(s) describe, ping: rename them" in str(failed.value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("tests.extension_examples:echo_factory", "must be a class"),
        ("tests.extension_examples:Nope", "has no 'Nope'"),
        (len, "must be a class"),
    ],
)
def test_extension_class_refuses_non_classes(value: object, message: str) -> None:
    with pytest.raises(InvalidConfigError, match=message) as failed:
        extension_class(value, reserved=RPC_METHODS)
    assert failed.value.field == "worker_extension_cls"


def test_worker_extension_serves_its_public_methods_only() -> None:
    ext = WorkerExtension(InspectExtension, worker="the worker")
    assert ext.instance.worker == "the worker"
    assert ext.method("fail") is not None
    assert ext.method("_helper") is None and ext.method("__init__") is None
    assert ext.method("worker") is None  # an attribute, not a method


def _worker(cache_dir: Path, **overrides: Any) -> Worker:
    overrides.setdefault("torch_threads", 1)
    return Worker(EngineConfig(cache_dir=str(cache_dir), **overrides))


@pytest.fixture
def worker(cache_dir: Path) -> Iterator[Worker]:
    w = _worker(cache_dir, runner_cls=CountingRunner, worker_extension_cls=InspectExtension)
    w.init_device()
    w.load_model()
    yield w
    w.shutdown()


def test_the_worker_builds_the_configured_runner(worker: Worker) -> None:
    runner = worker.runner
    assert isinstance(runner, CountingRunner)
    worker.execute_scheduler_output(wave(request("a"), request("b")))
    assert (runner.forwards, runner.requests) == (1, 2)


def test_extension_methods_are_rpcs_beside_the_builtins(worker: Worker) -> None:
    assert worker.execute_method("ping")["loaded"] is True  # built-ins still answer
    first = worker.execute_method("inspect")
    assert first == {
        "rank": 0,
        "pid": os.getpid(),
        "model": "builtin:echo",
        "runner": "CountingRunner",
        "forwards": 0,
        "calls": 1,
    }
    assert worker.execute_method("inspect")["calls"] == 2  # one instance per worker
    with pytest.raises(RuntimeError, match="boom"):
        worker.execute_method("fail", "boom")
    with pytest.raises(TypeError):
        worker.execute_method("fail")  # its own signature holds


@pytest.mark.parametrize("method", ["_helper", "__init__", "worker", "calls", "nope", "shutdown"])
def test_names_the_extension_does_not_serve_are_refused_as_before(
    worker: Worker, method: str
) -> None:
    with pytest.raises(AttributeError, match=f"worker has no RPC method '{method}'"):
        worker.execute_method(method)


def test_without_an_extension_unknown_names_are_refused(cache_dir: Path) -> None:
    w = _worker(cache_dir)
    try:
        with pytest.raises(AttributeError, match="no RPC method 'inspect'"):
            w.execute_method("inspect")  # not loaded yet
        w.load_model()
        assert w.extension is None and type(w.runner) is ModelRunner
        with pytest.raises(AttributeError, match="no RPC method 'inspect'"):
            w.execute_method("inspect")
    finally:
        w.shutdown()


def test_a_clashing_extension_is_refused_before_the_model_loads(cache_dir: Path) -> None:
    w = _worker(cache_dir, worker_extension_cls=Clashing)
    try:
        with pytest.raises(InvalidConfigError, match="may not override") as failed:
            w.load_model()
        assert failed.value.field == "worker_extension_cls"
        assert w.runner is None and w.extension is None
    finally:
        w.shutdown()


def test_a_bad_runner_is_refused_at_load(cache_dir: Path) -> None:
    w = _worker(cache_dir, runner_cls="tests.extension_examples:InspectExtension")
    try:
        with pytest.raises(InvalidConfigError, match="ModelRunner") as failed:
            w.load_model()
        assert failed.value.field == "runner_cls" and w.runner is None
    finally:
        w.shutdown()


def test_shutdown_drops_the_extension(worker: Worker) -> None:
    assert worker.extension is not None
    worker.shutdown()
    assert worker.extension is None
    with pytest.raises(AttributeError):
        worker.execute_method("inspect")
