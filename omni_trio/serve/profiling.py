"""The daemon's profiling endpoints: ``torch.profiler`` on every worker of every replica.

::

    POST /v1/admin/start_profile  {"directory": optional str}
                                  -> 200 {"directory", "replicas": [K...], "skipped": [K...]}
    POST /v1/admin/stop_profile   -> 200 {"traces": [path, ...]}

Both are ``/v1/*`` routes, so they need the API key when one is set (see
:mod:`omni_trio.serve.app`).  ``directory`` is a path on the server, made if missing; a
relative one (the default, :data:`DEFAULT_PROFILE_DIR`) is the daemon's working directory's.
Every open replica profiles (:meth:`AsyncEngine.start_profile
<omni_trio.runtime.engine.AsyncEngine.start_profile>`), each worker writing
``<directory>/<prefix>[-replica<K>]-rank<N>.json`` at the stop; one start or stop runs at a
time.  But torch's profiler runs one session per process: of the replicas whose worker runs
in the daemon's own process (``inproc``), only the first profiles and the others are
``skipped`` (Ray replicas' workers are processes of their own).

Errors are the OpenAI envelope: 400 for a bad body or a directory that cannot be made
(``invalid_profile_directory``), 409 ``already_profiling`` / ``not_profiling``, 503
``not_ready`` with no replica open, 500 ``profile_failed`` when a worker could not start or
write (the message says which).  A replica restarted while profiling lost its workers'
sessions: its traces are not written (and with no replica profiling any more, a stop is a
409).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import trio

from ..errors import EngineClosedError, EngineDeadError, OmniTrioError
from ..runtime.engine import AsyncEngine
from ..runtime.profiling import default_prefix
from ..runtime.stage import StageEngine
from .images import ApiError
from .pool import EnginePool

__all__ = [
    "DEFAULT_PROFILE_DIR",
    "PROFILE_PATHS",
    "START_PROFILE_PATH",
    "STOP_PROFILE_PATH",
    "ProfileAdmin",
    "runs_here",
]

START_PROFILE_PATH = "/v1/admin/start_profile"
STOP_PROFILE_PATH = "/v1/admin/stop_profile"
PROFILE_PATHS = (START_PROFILE_PATH, STOP_PROFILE_PATH)
DEFAULT_PROFILE_DIR = "profiles"


def _failed(message: str) -> ApiError:
    return ApiError(
        500,
        message,
        type="server_error",
        code="profile_failed",
        headers=(("x-should-retry", "false"),),
    )


def runs_here(engine: AsyncEngine | StageEngine) -> bool:
    """Some worker of ``engine`` runs in this process (the ``inproc`` backend)."""
    here = os.getpid()
    return any(worker.pid == here for worker in engine.health().workers)


class ProfileAdmin:
    """Starts and stops profiling on every open replica of ``pool``, one call at a time.
    ``default_dir``: where traces go when a start names no directory (relative: to the
    working directory of the daemon when the start comes)."""

    def __init__(self, pool: EnginePool, *, default_dir: str = DEFAULT_PROFILE_DIR) -> None:
        self.pool = pool
        self.default_dir = default_dir
        self._lock = trio.Lock()

    def _open_engines(self) -> list[tuple[int, AsyncEngine | StageEngine]]:
        engines = []
        for index in range(self.pool.replicas):
            engine = self.pool.replica_engine(index)
            if engine is not None and not (engine.is_closed or engine.is_dead):
                engines.append((index, engine))
        return engines

    async def answer(self, path: str, content_type: str | None, body: bytes) -> dict[str, Any]:
        """The 200 body of ``POST path`` (one of :data:`PROFILE_PATHS`); raises
        :class:`ApiError` for every failure (module docstring)."""
        if path == START_PROFILE_PATH:
            directory = self.directory_of(content_type, body)
            async with self._lock:
                return await self._start(directory)
        async with self._lock:
            return {"traces": await self._stop()}

    def directory_of(self, content_type: str | None, body: bytes) -> str:
        """The absolute directory a start body names (the default when it names none),
        made if missing.  Raises :class:`ApiError` 415 / 400."""
        if (content_type or "").split(";", 1)[0].strip().lower() != "application/json":
            raise ApiError(
                415,
                "Content-Type must be application/json",
                param="Content-Type",
                code="unsupported_media_type",
            )
        try:
            decoded = json.loads(body) if body.strip() else {}
        except (ValueError, RecursionError) as exc:
            raise ApiError(
                400,
                f"the request body is not valid JSON ({type(exc).__name__})",
                code="invalid_json",
            ) from None
        if not isinstance(decoded, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_type")
        unknown = sorted(set(decoded) - {"directory"})
        if unknown:
            raise ApiError(
                400,
                f"Unknown parameter: {unknown[0]!r}",
                param=unknown[0],
                code="unknown_parameter",
            )
        directory = decoded.get("directory")
        if directory is None:
            directory = self.default_dir
        elif not isinstance(directory, str) or not directory or "\0" in directory:
            raise ApiError(
                400,
                "directory must be a non-empty string (a path on the server)",
                param="directory",
                code="invalid_type" if not isinstance(directory, str) else "invalid_value",
            )
        path = Path(directory).expanduser().absolute()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ApiError(
                400,
                f"cannot make the profile directory {directory!r}: {exc.strerror or exc}",
                param="directory",
                code="invalid_profile_directory",
            ) from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise ApiError(
                400,
                f"the profile directory {directory!r} is not writable",
                param="directory",
                code="invalid_profile_directory",
            )
        return str(path)

    async def _start(self, directory: str) -> dict[str, Any]:
        engines = self._open_engines()
        if not engines:
            raise ApiError(503, "no replica is open", type="server_error", code="not_ready")
        if any(engine.profiling for _, engine in engines):
            raise ApiError(
                409,
                "already profiling: POST /v1/admin/stop_profile first",
                code="already_profiling",
            )
        base = default_prefix()
        started: list[AsyncEngine | StageEngine] = []
        profiled: list[int] = []
        skipped: list[int] = []
        local_taken = False
        try:
            for index, engine in engines:
                local = runs_here(engine)
                if local and local_taken:  # one torch.profiler session per process
                    skipped.append(index)
                    continue
                local_taken |= local
                prefix = base if self.pool.replicas == 1 else f"{base}-replica{index}"
                await engine.start_profile(directory, prefix)
                started.append(engine)
                profiled.append(index)
        except (EngineClosedError, EngineDeadError) as exc:
            await self._undo(started)
            raise ApiError(
                503, f"a replica closed: {exc}", type="server_error", code="not_ready"
            ) from None
        except OmniTrioError as exc:
            await self._undo(started)
            raise _failed(f"could not start profiling: {exc}") from None
        return {"directory": directory, "replicas": profiled, "skipped": skipped}

    @staticmethod
    async def _undo(started: list[AsyncEngine | StageEngine]) -> None:
        """Stop the replicas a failed start had started, and drop their traces."""
        for engine in started:
            with contextlib.suppress(Exception):
                for trace in await engine.stop_profile():
                    with contextlib.suppress(OSError):
                        os.remove(trace)

    async def _stop(self) -> list[str]:
        engines = [engine for _, engine in self._open_engines() if engine.profiling]
        if not engines:
            raise ApiError(
                409,
                "not profiling: POST /v1/admin/start_profile first",
                code="not_profiling",
            )
        traces: list[str] = []
        errors: list[str] = []
        for engine in engines:
            try:
                traces += await engine.stop_profile()
            except OmniTrioError as exc:
                errors.append(str(exc))
        if errors:
            written = f"; written: {', '.join(traces)}" if traces else ""
            raise _failed(f"could not write every trace: {'; '.join(errors)}{written}")
        return traces
