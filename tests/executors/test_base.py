"""The executor contract: backend resolution, ``open_executor`` and fail-closed health."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from omni_trio.config import EngineConfig
from omni_trio.errors import EngineClosedError, EngineDeadError, InvalidConfigError
from omni_trio.executors.base import Executor, open_executor, resolve_executor_class
from omni_trio.executors.inproc import InprocExecutor
from tests.fakes import FakeImage, ScriptedExecutor

CAP_S = 10.0


class FailingToStart(ScriptedExecutor):
    async def serve(
        self, *, task_status: trio.TaskStatus[Executor] = trio.TASK_STATUS_IGNORED
    ) -> None:
        self.serve_started = True
        raise InvalidConfigError("cannot load", field="model")


def test_resolve_builtin_name() -> None:
    assert resolve_executor_class("inproc") is InprocExecutor


def test_resolve_executor_subclass() -> None:
    assert resolve_executor_class(ScriptedExecutor) is ScriptedExecutor


def test_resolve_import_path() -> None:
    assert resolve_executor_class("tests.fakes:ScriptedExecutor") is ScriptedExecutor
    assert resolve_executor_class("omni_trio.executors.inproc:InprocExecutor") is InprocExecutor


def test_unknown_backends_are_named() -> None:
    with pytest.raises(InvalidConfigError, match="'rya'") as info:
        resolve_executor_class("rya")
    assert info.value.field == "backend"


def test_resolve_ray_backend_without_importing_ray() -> None:
    from omni_trio.executors.ray_executor import RayExecutor

    assert resolve_executor_class("ray") is RayExecutor


def test_resolve_tractor_backend() -> None:
    from omni_trio.executors.tractor_executor import TractorExecutor

    assert resolve_executor_class("tractor") is TractorExecutor


@pytest.mark.parametrize(
    ("backend", "match"),
    [
        ("nope", "unknown backend"),
        ("", "unknown backend"),
        (42, "unknown backend"),
        (None, "unknown backend"),
        ("no_such_module_xyz:Executor", "cannot import"),
        ("tests.fakes:NoSuchClass", "cannot import"),
        ("tests.fakes:FakeImage", "not an omni_trio Executor subclass"),
        ("tests.fakes:GATE_S", "not an omni_trio Executor subclass"),
        (FakeImage, "not an omni_trio Executor subclass"),
        (Executor, None),
    ],
)
def test_bad_backends_raise_invalid_config(backend: Any, match: str | None) -> None:
    if backend is Executor:
        # The abstract base resolves; instantiating it is what fails.
        assert resolve_executor_class(backend) is Executor
        with pytest.raises(TypeError):
            Executor(EngineConfig())  # type: ignore[abstract]
        return
    with pytest.raises(InvalidConfigError, match=match) as info:
        resolve_executor_class(backend)
    assert info.value.field == "backend"


def test_config_rejects_an_unknown_backend_name_up_front() -> None:
    with pytest.raises(InvalidConfigError) as info:
        EngineConfig(backend="nope")
    assert info.value.field == "backend"


async def test_open_executor_yields_a_started_executor_and_closes_it_on_exit() -> None:
    with trio.fail_after(CAP_S):
        async with open_executor(EngineConfig(backend=ScriptedExecutor)) as executor:
            assert isinstance(executor, ScriptedExecutor)
            assert executor.serve_started
            assert not executor.serve_exited
            executor.check_health()
        assert executor.aclose_calls == 1
        assert executor.serve_exited  # its task was cancelled and joined
        with pytest.raises(EngineClosedError):
            executor.check_health()


async def test_open_executor_closes_when_the_body_raises() -> None:
    with trio.fail_after(CAP_S):
        with pytest.raises(KeyError, match="body"):
            async with open_executor(EngineConfig(backend=ScriptedExecutor)) as executor:
                raise KeyError("body")
    assert isinstance(executor, ScriptedExecutor)
    assert executor.aclose_calls == 1
    assert executor.serve_exited


async def test_open_executor_closes_when_the_body_is_cancelled() -> None:
    with trio.fail_after(CAP_S):
        with trio.CancelScope() as scope:
            async with open_executor(EngineConfig(backend=ScriptedExecutor)) as executor:
                scope.cancel()
                await trio.sleep_forever()
    assert scope.cancelled_caught
    assert isinstance(executor, ScriptedExecutor)
    assert executor.aclose_calls == 1
    assert executor.serve_exited


async def test_open_executor_raises_what_serve_raised_before_ready() -> None:
    with trio.fail_after(CAP_S):
        with pytest.raises(InvalidConfigError, match="cannot load"):
            async with open_executor(EngineConfig(backend=FailingToStart)):
                pytest.fail("the body must not run")  # pragma: no cover


async def test_open_executor_resolves_import_paths() -> None:
    with trio.fail_after(CAP_S):
        async with open_executor(EngineConfig(backend="tests.fakes:ScriptedExecutor")) as ex:
            assert type(ex) is ScriptedExecutor


def test_fail_keeps_the_first_reason_and_health_raises_dead() -> None:
    executor = ScriptedExecutor(EngineConfig())
    assert not executor.is_dead
    assert executor.dead_reason is None
    executor.check_health()
    first = RuntimeError("first")
    executor.fail(first)
    executor.fail(ValueError("second"))
    assert executor.is_dead
    assert executor.dead_reason is first
    with pytest.raises(EngineDeadError, match="RuntimeError: first") as info:
        executor.check_health()
    assert info.value.__cause__ is first


def test_dead_wins_over_closed_in_health() -> None:
    executor = ScriptedExecutor(EngineConfig())
    executor._closed = True
    executor.fail(RuntimeError("boom"))
    with pytest.raises(EngineDeadError):
        executor.check_health()


async def test_default_step_execution_and_progress() -> None:
    executor = ScriptedExecutor(EngineConfig())
    assert Executor.progress(executor, "any") is None
    with pytest.raises(NotImplementedError, match="ScriptedExecutor"):
        await executor.execute_step(None)  # type: ignore[arg-type]
