"""The package namespace is the public API: ``__all__`` lists it and nothing else leaks."""

from __future__ import annotations

import types

import omni_trio

EXPECTED = {
    "AsyncEngine",
    "DiffusionOutput",
    "DiffusionRequest",
    "DuplicateRequestError",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineAsleepError",
    "EngineDeadError",
    "EngineHealth",
    "EngineStatistics",
    "Executor",
    "InvalidConfigError",
    "InvalidLoraError",
    "InvalidRequestError",
    "InvalidTransition",
    "OmniTrioError",
    "RequestAbortedError",
    "RequestFailedError",
    "RequestTimeoutError",
    "RequestTooCostlyError",
    "RequestMetrics",
    "RequestStatus",
    "RequestStream",
    "RestartLimitError",
    "SamplingParams",
    "StallError",
    "WorkerError",
    "WorkerState",
    "open_engine",
}


def public_names() -> set[str]:
    """Every public attribute of the package that is not a submodule."""
    return {
        name
        for name, value in vars(omni_trio).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }


def test_all_is_exactly_the_public_api() -> None:
    assert set(omni_trio.__all__) == EXPECTED
    assert len(omni_trio.__all__) == len(set(omni_trio.__all__))


def test_nothing_public_leaks_outside_all() -> None:
    assert public_names() == set(omni_trio.__all__)


def test_every_name_in_all_resolves() -> None:
    for name in omni_trio.__all__:
        assert getattr(omni_trio, name) is not None, name


def test_public_objects_are_defined_in_implementation_modules() -> None:
    for name in omni_trio.__all__:
        module = getattr(omni_trio, name).__module__
        assert module.startswith("omni_trio."), (name, module)
        assert module != "omni_trio", name


def test_version_is_a_string() -> None:
    assert isinstance(omni_trio.__version__, str) and omni_trio.__version__
