"""Profiling an engine's workers: the engine side of ``start_profile`` / ``stop_profile``.

:class:`EngineProfile` holds whether one engine is profiling and asks every worker through
the engine's control RPCs (``collective_rpc(..., unique_reply_rank=None)``), so a profile
starts and stops between batches, never during a forward.  Each worker runs its own
``torch.profiler`` session (:mod:`omni_trio.worker.profiler`) and writes one Chrome trace,
``<directory>/<prefix>-rank<N>.json``.

The engine is profiling from the moment :meth:`EngineProfile.start` is called until
:meth:`EngineProfile.stop` is: a second ``start`` meanwhile, or a ``stop`` outside, raises
``RuntimeError`` at once, before any worker is asked.  A worker group that restarts while
the engine profiles (see ``docs/supervision.md``) loses its sessions: the dead workers'
traces are never written and ``stop`` then raises the new workers' :class:`WorkerError`
(not profiling), ending the engine's profile all the same.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

__all__ = ["EngineProfile", "check_prefix", "default_prefix"]

Rpc = Callable[..., Awaitable[Any]]


def check_prefix(prefix: str) -> str:
    """``prefix`` if it can start a trace's file name: a non-empty name without a directory
    part or a leading dot (the workers check the same); else ``ValueError``."""
    if not isinstance(prefix, str):
        raise TypeError(f"a profile prefix is a str, not {type(prefix).__name__}")
    if not prefix or prefix.startswith(".") or "/" in prefix or os.sep in prefix or "\0" in prefix:
        raise ValueError(
            f"a profile prefix is a file name without a directory part or a leading dot, "
            f"not {prefix!r}"
        )
    return prefix


def default_prefix() -> str:
    """A new trace prefix: ``omni-trio-<local date and time>-<4 random hex digits>``."""
    return f"omni-trio-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


class EngineProfile:
    """Whether one engine profiles its workers, and the calls that change it.

    Invariant: ``directory`` and ``prefix`` are set exactly while the engine profiles
    (from a :meth:`start` that did not fail to the next :meth:`stop`).
    """

    def __init__(self) -> None:
        self.directory: str | None = None
        self.prefix: str | None = None

    @property
    def active(self) -> bool:
        return self.directory is not None

    async def start(
        self, rpc: Rpc, directory: str | os.PathLike[str], prefix: str | None = None
    ) -> None:
        """Start profiling on every worker through ``rpc`` (the engine's
        ``collective_rpc``).

        ``directory`` is made by each worker if missing; a relative one is taken from each
        worker process's working directory.  ``prefix`` (default :func:`default_prefix`)
        names the traces.  Raises ``RuntimeError`` while profiling, ``TypeError`` /
        ``ValueError`` for a bad argument (nothing is asked), and what the workers raised
        (a :class:`WorkerError`: say, the directory cannot be made, or a trace of that name
        exists); then no worker is left profiling.  Once the workers were asked, cancelling
        waits for their answer.
        """
        if self.directory is not None:
            raise RuntimeError(f"already profiling (into {self.directory!r}); stop_profile() first")
        path = os.fspath(directory)
        if not isinstance(path, str) or not path:
            raise ValueError(f"a profile directory is a non-empty str path, not {directory!r}")
        prefix = check_prefix(default_prefix() if prefix is None else prefix)
        # Taken before the first checkpoint: a concurrent start is refused from here on.
        self.directory, self.prefix = path, prefix
        try:
            with trio.CancelScope(shield=True):
                await rpc("start_profile", path, prefix, unique_reply_rank=None)
        except BaseException:
            self.directory = self.prefix = None
            with trio.CancelScope(shield=True):
                try:  # the workers that did start: nobody will stop them
                    await rpc("discard_profile", unique_reply_rank=None)
                except Exception:
                    pass  # the start's own error says what went wrong
            raise

    async def stop(self, rpc: Rpc) -> list[str]:
        """Stop profiling on every worker; each writes its trace.  Returns the traces'
        absolute paths, one per rank, in rank order.

        Raises ``RuntimeError`` when not profiling, and what the workers raised (a
        :class:`WorkerError`: a worker that was not profiling, after a group restart; a
        trace that could not be written).  Either way the engine profiles no more.  Once
        the workers were asked, cancelling waits for their answer.
        """
        if self.directory is None:
            raise RuntimeError("not profiling; start_profile() first")
        self.directory = self.prefix = None
        with trio.CancelScope(shield=True):
            paths = await rpc("stop_profile", unique_reply_rank=None)
        return [str(p) for p in paths]
