"""omni_trio: serve diffusers pipelines as a tree of supervised trio actors.

Public API only; the implementation lives in private modules.
"""

from ._core.lifecycle import RequestStatus as RequestStatus
from ._core.messages import DiffusionOutput as DiffusionOutput
from ._core.messages import RequestMetrics as RequestMetrics
from ._core.request import DiffusionRequest as DiffusionRequest
from ._core.request import SamplingParams as SamplingParams
from .config import EngineConfig as EngineConfig
from .errors import DuplicateRequestError as DuplicateRequestError
from .errors import EngineAsleepError as EngineAsleepError
from .errors import EngineClosedError as EngineClosedError
from .errors import EngineDeadError as EngineDeadError
from .errors import InvalidConfigError as InvalidConfigError
from .errors import InvalidLoraError as InvalidLoraError
from .errors import InvalidRequestError as InvalidRequestError
from .errors import InvalidTransition as InvalidTransition
from .errors import OmniTrioError as OmniTrioError
from .errors import RequestAbortedError as RequestAbortedError
from .errors import RequestFailedError as RequestFailedError
from .errors import RequestTimeoutError as RequestTimeoutError
from .errors import RequestTooCostlyError as RequestTooCostlyError
from .errors import RestartLimitError as RestartLimitError
from .errors import StallError as StallError
from .errors import WorkerError as WorkerError
from .executors.base import Executor as Executor
from .executors.base import WorkerState as WorkerState
from .runtime.engine import AsyncEngine as AsyncEngine
from .runtime.engine import EngineHealth as EngineHealth
from .runtime.engine import EngineStatistics as EngineStatistics
from .runtime.engine import open_engine as open_engine
from .runtime.request_stream import RequestStream as RequestStream
from .runtime.sync_engine import Engine as Engine

__version__ = "0.1.0"

__all__ = [
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
    "RequestMetrics",
    "RequestStatus",
    "RequestStream",
    "RequestTimeoutError",
    "RequestTooCostlyError",
    "RestartLimitError",
    "SamplingParams",
    "StallError",
    "WorkerError",
    "WorkerState",
    "open_engine",
]
