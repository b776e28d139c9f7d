"""The daemon's sleep endpoints: release the model's weights while the server idles.

::

    POST /v1/admin/sleep     {"level": 1 | 2}  (default 1)  -> 200 {"sleeping": true, ...}
    POST /v1/admin/wake_up                                   -> 200 {"sleeping": false, ...}
    GET  /v1/admin/sleep                                     -> 200 {"sleeping", "level", ...}

They are ``/v1/*`` routes, so they need the API key when one is set (see
:mod:`omni_trio.serve.app`).  Every open replica sleeps (:meth:`EnginePool.sleep
<omni_trio.serve.pool.EnginePool.sleep>`; a replica reopened meanwhile sleeps too) and wakes
together; the answers carry each replica's per-worker reports (``released_bytes``,
``restored_bytes``, ``rss_bytes``).  While asleep ``/ready`` is a 503 whose reason says
``sleeping``, generations wait in the queue and run after the wake (with
``reject_while_asleep``: 503 ``engine_asleep`` at once).  Errors are the OpenAI envelope:
400 for a bad body or level, 503 ``not_ready`` with no replica open, 503 ``sleep_timeout``
when the requests running did not finish within ``sleep_drain_timeout_s`` (the pool stays
awake; try again), 500 ``sleep_failed`` / ``wake_failed`` when a worker could not release or
take back its weights (after a failed wake the pool is still asleep; try again).
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import (
    EngineClosedError,
    EngineDeadError,
    InvalidRequestError,
    OmniTrioError,
    StallError,
)
from .api_spec import SLEEP_FIELDS, field_named
from .images import ApiError
from .pool import EnginePool, NotReadyError

__all__ = ["SLEEP_PATH", "SLEEP_PATHS", "WAKE_UP_PATH", "SleepAdmin", "json_object"]

SLEEP_PATH = "/v1/admin/sleep"
WAKE_UP_PATH = "/v1/admin/wake_up"
SLEEP_PATHS = (SLEEP_PATH, WAKE_UP_PATH)
_NO_RETRY = (("x-should-retry", "false"),)


def json_object(content_type: str | None, body: bytes, allowed: frozenset[str]) -> dict[str, Any]:
    """A request body that is empty (``{}``) or a JSON object of ``allowed`` keys.  Raises
    :class:`ApiError` 415 for a non-empty body that is not ``application/json``, 400 for
    invalid JSON, another type or an unknown key."""
    if not body.strip():
        return {}
    if (content_type or "").split(";", 1)[0].strip().lower() != "application/json":
        raise ApiError(
            415,
            "Content-Type must be application/json",
            param="Content-Type",
            code="unsupported_media_type",
        )
    try:
        decoded = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise ApiError(
            400, f"the request body is not valid JSON ({type(exc).__name__})", code="invalid_json"
        ) from None
    if not isinstance(decoded, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_type")
    unknown = sorted(set(decoded) - allowed)
    if unknown:
        raise ApiError(
            400, f"Unknown parameter: {unknown[0]!r}", param=unknown[0], code="unknown_parameter"
        )
    return decoded


class SleepAdmin:
    """Answers the sleep endpoints for ``pool`` (module docstring)."""

    def __init__(self, pool: EnginePool) -> None:
        self.pool = pool

    def _not_ready(self, exc: Exception) -> ApiError:
        return ApiError(
            503,
            f"not ready: {exc}",
            type="server_error",
            code="not_ready",
            headers=(("Retry-After", str(self.pool.unavailable_retry_after_s())),),
        )

    def state(self) -> dict[str, Any]:
        """The ``GET /v1/admin/sleep`` body: ``sleeping`` (any replica not awake),
        ``level`` (the pool's), ``replicas`` (each one's state and level)."""
        replicas = self.pool.sleep_states()
        return {
            "sleeping": any(r["state"] != "awake" for r in replicas),
            "level": self.pool.sleep_level,
            "replicas": replicas,
        }

    async def sleep(self, content_type: str | None, body: bytes) -> dict[str, Any]:
        """``POST /v1/admin/sleep``; raises :class:`ApiError` (module docstring)."""
        spec = field_named("level", SLEEP_FIELDS)  # (the API reference's definition)
        allowed = frozenset(f.name for f in SLEEP_FIELDS)
        level = json_object(content_type, body, allowed).get("level", spec.default)
        if (
            isinstance(level, bool)
            or not isinstance(level, int)
            or not spec.minimum <= level <= spec.maximum  # type: ignore[operator]
        ):
            raise ApiError(
                400, f"level must be 1 or 2, got {level!r}", param="level", code="invalid_value"
            )
        try:
            reports = await self.pool.sleep(level)
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc), param="level", code="invalid_value") from None
        except StallError as exc:
            raise ApiError(
                503,
                f"could not fall asleep: {exc}",
                type="server_error",
                code="sleep_timeout",
                headers=(("Retry-After", str(self.pool.retry_after_s())),),
            ) from None
        except (NotReadyError, EngineClosedError, EngineDeadError) as exc:
            raise self._not_ready(exc) from None
        except OmniTrioError as exc:
            raise ApiError(
                500,
                f"could not fall asleep: {exc}",
                type="server_error",
                code="sleep_failed",
                headers=_NO_RETRY,
            ) from None
        return {"sleeping": True, "level": self.pool.sleep_level, "replicas": reports}

    async def wake_up(self, content_type: str | None, body: bytes) -> dict[str, Any]:
        """``POST /v1/admin/wake_up``; raises :class:`ApiError` (module docstring)."""
        json_object(content_type, body, frozenset())
        try:
            reports = await self.pool.wake_up()
        except (EngineClosedError, EngineDeadError) as exc:
            raise self._not_ready(exc) from None
        except OmniTrioError as exc:
            raise ApiError(
                500,
                f"could not wake up: {exc}",
                type="server_error",
                code="wake_failed",
                headers=_NO_RETRY,
            ) from None
        return {"sleeping": False, "level": 0, "replicas": reports}
