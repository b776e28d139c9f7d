"""The error tree in ``omni_trio.errors``: shape, attributes and messages."""

from __future__ import annotations

import inspect

import pytest

from omni_trio import errors
from omni_trio._core.lifecycle import RequestStatus
from omni_trio.errors import (
    DuplicateRequestError,
    EngineClosedError,
    EngineDeadError,
    InvalidConfigError,
    InvalidRequestError,
    InvalidTransition,
    OmniTrioError,
    RequestAbortedError,
    RequestFailedError,
    RestartLimitError,
    StallError,
    WorkerError,
)

ALL_ERRORS = [
    DuplicateRequestError,
    EngineClosedError,
    EngineDeadError,
    InvalidConfigError,
    InvalidRequestError,
    InvalidTransition,
    RequestAbortedError,
    RequestFailedError,
    RestartLimitError,
    StallError,
    WorkerError,
]


def test_all_lists_every_exception_class_in_the_module() -> None:
    defined = {
        name
        for name, obj in vars(errors).items()
        if inspect.isclass(obj)
        and issubclass(obj, BaseException)
        and obj.__module__ == errors.__name__
    }
    assert set(errors.__all__) == defined
    assert "OmniTrioError" in defined


@pytest.mark.parametrize("cls", ALL_ERRORS, ids=lambda c: c.__name__)
def test_every_error_derives_from_the_base(cls: type[Exception]) -> None:
    assert issubclass(cls, OmniTrioError)


@pytest.mark.parametrize(
    ("cls", "parent"),
    [
        (InvalidRequestError, OmniTrioError),
        (DuplicateRequestError, InvalidRequestError),
        (InvalidConfigError, OmniTrioError),
        (RequestAbortedError, OmniTrioError),
        (RequestFailedError, OmniTrioError),
        (EngineClosedError, OmniTrioError),
        (EngineDeadError, OmniTrioError),
        (InvalidTransition, OmniTrioError),
        (WorkerError, OmniTrioError),
        (StallError, OmniTrioError),
        (RestartLimitError, OmniTrioError),
    ],
    ids=lambda c: c.__name__,
)
def test_tree_is_flat_as_drawn(cls: type[Exception], parent: type[Exception]) -> None:
    # The closest omni_trio ancestor is the one drawn in the module docstring.
    nearest = next(b for b in cls.__mro__[1:] if issubclass(b, OmniTrioError))
    assert nearest is parent


def test_input_errors_are_value_errors() -> None:
    assert issubclass(InvalidRequestError, ValueError)
    assert issubclass(DuplicateRequestError, ValueError)
    assert issubclass(InvalidConfigError, ValueError)


def test_stall_error_is_a_timeout_error() -> None:
    assert issubclass(StallError, TimeoutError)


def test_closed_and_dead_are_kept_apart() -> None:
    assert not issubclass(EngineClosedError, EngineDeadError)
    assert not issubclass(EngineDeadError, EngineClosedError)


@pytest.mark.parametrize("cls", [RequestAbortedError, RequestFailedError, WorkerError])
def test_runtime_failures_are_not_value_errors(cls: type[Exception]) -> None:
    assert not issubclass(cls, ValueError)


def test_invalid_request_error_carries_param() -> None:
    exc = InvalidRequestError("height must be positive", param="height")
    assert exc.param == "height"
    assert str(exc) == "height must be positive"
    assert InvalidRequestError("x").param is None


def test_duplicate_request_error_names_the_id() -> None:
    exc = DuplicateRequestError("req-7")
    assert exc.request_id == "req-7"
    assert exc.param == "request_id"
    assert "'req-7'" in str(exc)
    assert "already active" in str(exc)


def test_invalid_config_error_carries_field() -> None:
    exc = InvalidConfigError("bad", field="num_workers")
    assert exc.field == "num_workers"
    assert str(exc) == "bad"
    assert InvalidConfigError("bad").field is None


def test_request_aborted_error_default_and_custom_message() -> None:
    exc = RequestAbortedError("r1")
    assert exc.request_id == "r1"
    assert str(exc) == "Request r1 aborted."
    assert str(RequestAbortedError("r1", "consumer gone")) == "consumer gone"


def test_request_failed_error_keeps_text_and_type() -> None:
    exc = RequestFailedError("r1", "CUDA out of memory", "OutOfMemoryError")
    assert exc.request_id == "r1"
    assert exc.error == "CUDA out of memory"
    assert exc.error_type == "OutOfMemoryError"
    assert str(exc) == "Request r1 failed: OutOfMemoryError: CUDA out of memory"


def test_request_failed_error_without_type() -> None:
    exc = RequestFailedError("r1", "boom")
    assert exc.error_type is None
    assert str(exc) == "Request r1 failed: Error: boom"


def test_invalid_transition_names_request_states_and_history() -> None:
    history = [RequestStatus.WAITING, RequestStatus.RUNNING]
    exc = InvalidTransition("r1", RequestStatus.RUNNING, RequestStatus.WAITING, history)
    assert exc.request_id == "r1"
    assert exc.start is RequestStatus.RUNNING
    assert exc.finish is RequestStatus.WAITING
    assert exc.history == (RequestStatus.WAITING, RequestStatus.RUNNING)
    assert str(exc) == (
        "illegal transition for request 'r1': RUNNING -> WAITING (history: WAITING -> RUNNING)"
    )


def test_invalid_transition_history_is_a_snapshot() -> None:
    history = [RequestStatus.WAITING]
    exc = InvalidTransition("r1", RequestStatus.WAITING, RequestStatus.WAITING, history)
    history.append(RequestStatus.RUNNING)
    assert exc.history == (RequestStatus.WAITING,)


def test_invalid_transition_without_history_or_enum_states() -> None:
    exc = InvalidTransition("r1", "a", "b")
    assert exc.history == ()
    assert str(exc) == "illegal transition for request 'r1': a -> b (history: none)"


def test_worker_error_boxes_remote_failure() -> None:
    exc = WorkerError("boom", worker=2, error_type="RuntimeError", traceback_text="Traceback...")
    assert exc.worker == 2
    assert exc.error_type == "RuntimeError"
    assert exc.traceback_text == "Traceback..."
    assert str(exc) == "worker 2: RuntimeError: boom"


def test_worker_error_minimal() -> None:
    exc = WorkerError("boom")
    assert exc.worker is None
    assert exc.error_type is None
    assert exc.traceback_text is None
    assert str(exc) == "boom"


def test_worker_error_worker_zero_is_named() -> None:
    assert str(WorkerError("boom", worker=0)) == "worker 0: boom"


def test_stall_error_names_the_phase() -> None:
    exc = StallError("forward", "no step for 30 s")
    assert exc.phase == "forward"
    assert str(exc) == "forward stalled: no step for 30 s"


@pytest.mark.parametrize(
    ("error_type", "retryable"),
    [("WorkerFailedError", True), ("StallError", True), ("ValueError", False), (None, False)],
)
def test_request_failed_error_says_whether_a_retry_may_help(
    error_type: str | None, retryable: bool
) -> None:
    exc = RequestFailedError("r", "boom", error_type)
    assert exc.retryable is retryable


def test_restart_limit_error_carries_its_numbers() -> None:
    cause = StallError("worker", "silent")
    exc = RestartLimitError("workers", restarts=3, max_restarts=3, window_s=60, last_error=cause)
    assert (exc.child, exc.restarts, exc.max_restarts, exc.window_s) == ("workers", 3, 3, 60)
    assert exc.last_error is cause
    assert "more than 3 time(s) in 60 s" in str(exc) and "silent" in str(exc)
