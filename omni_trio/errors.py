"""The omni_trio error tree.

Every error the runtime raises on purpose is one of these::

    OmniTrioError
    ├── InvalidRequestError (ValueError)     bad input, rejected before admission
    │   ├── DuplicateRequestError            request id already active
    │   ├── PayloadError                     a payload the workers cannot be sent (after admission)
    │   ├── RequestTooCostlyError            over the compute budget (max_request_s, max_step_s)
    │   └── InvalidLoraError                 a LoRA adapter a worker cannot apply (after admission)
    ├── InvalidConfigError (ValueError)      bad EngineConfig field or model/config mismatch
    ├── RequestAbortedError                  the request was aborted (API, consumer drop, close)
    ├── RequestFailedError                   the request ran and failed; carries the error text/type
    ├── EngineClosedError                    you closed the engine ("closed")
    ├── EngineDeadError                      something outside failed; the engine is dead ("broken")
    ├── EngineAsleepError                    refused: the engine sleeps (reject_while_asleep)
    ├── InvalidTransition                    an illegal lifecycle move (a bug, never user input)
    ├── WorkerError                          a worker failed; boxed type name, worker id, traceback
    ├── StallError                           a bounded wait ran out; names the phase that stalled
    └── RestartLimitError                    a supervisor gave up: too many restarts in its window

Keep *closed* ("you closed it") apart from *dead* ("something outside broke"), as trio keeps
``ClosedResourceError`` apart from ``BrokenResourceError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "DuplicateRequestError",
    "EngineAsleepError",
    "EngineClosedError",
    "EngineDeadError",
    "InvalidConfigError",
    "InvalidLoraError",
    "InvalidRequestError",
    "InvalidTransition",
    "OmniTrioError",
    "PayloadError",
    "RequestAbortedError",
    "RequestFailedError",
    "RequestTimeoutError",
    "RequestTooCostlyError",
    "RestartLimitError",
    "StallError",
    "WorkerError",
]


# error_type of a request that failed because its worker group failed (retries used up):
# the request itself was fine.
RETRYABLE_ERROR_TYPES = frozenset({"WorkerFailedError", "StallError"})
# error_type of a request failed for good because its worker group failed under it twice
# (after the first time it ran alone): the likely cause, never run again, not retryable.
QUARANTINED_ERROR_TYPE = "RequestQuarantinedError"
# error_type of a request aborted at its deadline_s.
TIMEOUT_ERROR_TYPE = "RequestTimeoutError"


class OmniTrioError(Exception):
    """Base of every error omni_trio raises on purpose."""


class InvalidRequestError(OmniTrioError, ValueError):
    """A request was rejected before admission; ``param`` names the offending field."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class DuplicateRequestError(InvalidRequestError):
    """A request id is already active in this engine."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request_id {request_id!r} is already active", param="request_id")
        self.request_id = request_id


class PayloadError(InvalidRequestError):
    """An executor could not send a call to its workers: the wire codec cannot carry a value
    it holds (say, an object in ``extra_args`` with no encoding).  Nothing reached a worker;
    the group is fine.  Raised by ``execute_*`` it fails the request that holds the value,
    never the group (see ``EngineCore.payload_rejected``)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="payload")


class RequestTooCostlyError(InvalidRequestError):
    """A request whose estimated time on this machine (from the model's step time measured
    at warmup) is over ``EngineConfig.max_request_s``, or whose longest uninterruptible part
    is over ``max_step_s``.  ``estimate_s`` and ``limit_s`` carry the two figures."""

    code = "request_too_costly"

    def __init__(self, message: str, *, estimate_s: float, limit_s: float) -> None:
        super().__init__(message, param="size")
        self.estimate_s = estimate_s
        self.limit_s = limit_s


class InvalidLoraError(InvalidRequestError):
    """A LoRA adapter a request named cannot be applied: a directory that is no adapter, or
    one made for modules this model does not have.  Found by the worker that loads it: the
    requests that asked for it fail with this error type (HTTP 400 ``invalid_lora``); the
    worker serves on."""

    code = "invalid_lora"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="lora")


class InvalidConfigError(OmniTrioError, ValueError):
    """An ``EngineConfig`` field is invalid, or the model cannot serve the configuration."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class RequestAbortedError(OmniTrioError):
    """The request was aborted before it produced its output."""

    def __init__(self, request_id: str, message: str | None = None) -> None:
        super().__init__(message or f"Request {request_id} aborted.")
        self.request_id = request_id


class RequestTimeoutError(RequestAbortedError, TimeoutError):
    """The request reached its ``deadline_s`` before it finished: it was aborted then
    (within one denoising step in step mode, at the next step callback in request mode) and
    its resources released as for any abort."""

    code = "deadline_exceeded"


class RequestFailedError(OmniTrioError):
    """The request ran and failed; ``error_type`` is the name of the original exception type."""

    def __init__(self, request_id: str, message: str, error_type: str | None = None) -> None:
        super().__init__(f"Request {request_id} failed: {error_type or 'Error'}: {message}")
        self.request_id = request_id
        self.error = message
        self.error_type = error_type

    @property
    def retryable(self) -> bool:
        """True when the failure was the runtime's, not the request's (its worker group
        failed or stalled and the retry budget ran out): the same request may succeed if
        submitted again."""
        return self.error_type in RETRYABLE_ERROR_TYPES

    @property
    def quarantined(self) -> bool:
        """True when the request was quarantined: its worker group failed each time it ran
        (twice, the second time alone), so it is taken for the cause and not run again.
        Submitting it again would most likely crash the workers again."""
        return self.error_type == QUARANTINED_ERROR_TYPE


class EngineClosedError(OmniTrioError):
    """The engine was closed by its owner; no new work is accepted."""


class EngineDeadError(OmniTrioError):
    """The engine died (scheduler failure, dead worker group); nothing more will run."""


class EngineAsleepError(OmniTrioError):
    """The engine is asleep (or falling asleep, or waking up) and was configured to refuse
    requests meanwhile (``EngineConfig.reject_while_asleep``); nothing was admitted."""


class InvalidTransition(OmniTrioError):
    """An illegal lifecycle move; names the request, both states and its recent history."""

    def __init__(
        self, request_id: str, start: Any, finish: Any, history: Sequence[Any] = ()
    ) -> None:
        names = [getattr(s, "name", str(s)) for s in history]
        super().__init__(
            f"illegal transition for request {request_id!r}: "
            f"{getattr(start, 'name', start)} -> {getattr(finish, 'name', finish)} "
            f"(history: {' -> '.join(names) or 'none'})"
        )
        self.request_id = request_id
        self.start = start
        self.finish = finish
        self.history = tuple(history)


class WorkerError(OmniTrioError):
    """A worker failed.  The remote error is boxed: its type name, the worker and traceback
    text; ``fatal`` when the worker itself is broken, not just the call."""

    def __init__(
        self,
        message: str,
        *,
        worker: str | int | None = None,
        error_type: str | None = None,
        traceback_text: str | None = None,
        fatal: bool = False,
    ) -> None:
        where = f"worker {worker}: " if worker is not None else ""
        kind = f"{error_type}: " if error_type else ""
        super().__init__(f"{where}{kind}{message}")
        self.worker = worker
        self.error_type = error_type
        self.traceback_text = traceback_text
        # The worker itself is broken (a device fault, a torn collective), not just the
        # call: its group must be replaced.
        self.fatal = fatal


class StallError(OmniTrioError, TimeoutError):
    """A bounded wait ran out; ``phase`` names what stalled (admission, forward, output, rpc,
    start)."""

    def __init__(self, phase: str, message: str) -> None:
        super().__init__(f"{phase} stalled: {message}")
        self.phase = phase


class RestartLimitError(OmniTrioError):
    """A supervisor gave up: ``child`` failed more than ``max_restarts`` times within
    ``window_s`` seconds.  ``last_error`` is the failure that crossed the limit (also the
    ``__cause__``); ``restarts`` is how many restarts the supervisor had made."""

    def __init__(
        self,
        child: str,
        *,
        restarts: int,
        max_restarts: int,
        window_s: float,
        last_error: BaseException | None = None,
    ) -> None:
        last = f": {type(last_error).__name__}: {last_error}" if last_error is not None else ""
        super().__init__(
            f"{child} failed more than {max_restarts} time(s) in {window_s:g} s "
            f"(restarts made: {restarts}){last}"
        )
        self.child = child
        self.restarts = restarts
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.last_error = last_error
