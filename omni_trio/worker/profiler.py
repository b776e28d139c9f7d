"""One worker's ``torch.profiler`` session, started and stopped by control calls.

:class:`WorkerProfiler` owns at most one ``torch.profiler.profile`` at a time (CPU activity,
plus CUDA when the worker's device is a GPU).  :meth:`WorkerProfiler.stop` writes the
session's Chrome trace to ``<directory>/<prefix>-rank<N>.json`` (chrome://tracing and
Perfetto open it) and returns its absolute path.

Why the thread matters: torch's profiler records the ops of the thread that started it (and
of threads that thread starts afterwards), not of threads that already run; and stopping it
from another thread is a silent no-op that leaves it recording.  So a session must start,
stop and see the forwards in one thread.  Every backend runs all of a worker's calls (the
forwards and these control calls) in one thread: the owned
:class:`~omni_trio.worker.worker_thread.WorkerThread` in-process and in each tractor worker
process, the actor's single default-group thread on Ray.  :meth:`stop` and :meth:`discard`
refuse any other thread (``RuntimeError``) rather than leave a session recording unseen.

One session per process: two at once (two in-process workers, say the replicas of one
daemon) crash torch's profiler, so a second :meth:`~WorkerProfiler.start` in a process whose
other worker profiles raises ``RuntimeError``.  Worker processes (tractor, Ray) each have
their own.
The output packer's thread is not recorded (with ``async_output``, the default, the
conversion of outputs to images runs there).

:func:`profile_span` names a stretch of work in the trace (the runner wraps every forward in
``omni_trio.forward`` and every step-mode tick in ``omni_trio.step``); it costs nothing while
this thread records nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["WorkerProfiler", "check_prefix", "profile_span", "trace_name"]

log = logging.getLogger(__name__)

# The worker profiling in this process, if any (torch's profiler runs one session per
# process); changed under the lock.
_process_lock = threading.Lock()
_process_owner: WorkerProfiler | None = None


def check_prefix(prefix: str) -> str:
    """``prefix`` if it can start a trace's file name (a non-empty name with no directory
    part, not starting with a dot); else ``ValueError``."""
    if not isinstance(prefix, str):
        raise TypeError(f"a profile prefix is a str, not {type(prefix).__name__}")
    if not prefix or prefix.startswith(".") or "/" in prefix or os.sep in prefix or "\0" in prefix:
        raise ValueError(
            f"a profile prefix is a file name without a directory part or a leading dot, "
            f"not {prefix!r}"
        )
    return prefix


def trace_name(prefix: str, rank: int) -> str:
    """The file name of rank ``rank``'s trace."""
    return f"{prefix}-rank{rank}.json"


@contextlib.contextmanager
def profile_span(name: str) -> Iterator[None]:
    """A ``record_function`` span called ``name`` around the block while a profiler
    records this thread; nothing otherwise."""
    import torch

    if not torch.autograd._profiler_enabled():
        yield
        return
    with torch.profiler.record_function(name):
        yield


class WorkerProfiler:
    """The profiler session of worker ``rank`` (see the module docstring).

    Invariant: ``_profile``, ``_path`` and ``_thread`` are all set exactly while a session
    runs (from a :meth:`start` that returned to the :meth:`stop` or :meth:`discard` that
    ends it), ``_thread`` being the thread that started it.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._profile: Any = None  # a torch.profiler.profile while a session runs
        self._path: Path | None = None
        self._thread: int | None = None
        self._started_at = 0.0

    @property
    def active(self) -> bool:
        """A session runs."""
        return self._profile is not None

    @property
    def trace_path(self) -> str | None:
        """Where the running session's trace will be written (None: none runs)."""
        return None if self._path is None else str(self._path)

    def start(self, directory: str | os.PathLike[str], prefix: str, *, device: torch.device) -> str:
        """Start recording this thread; returns the absolute path the trace will get.

        ``directory`` is made if missing (a relative one is taken from this process's
        working directory).  Raises ``RuntimeError`` while a session runs (this worker's, or
        another's in this process), ``ValueError`` for a bad ``prefix``, ``FileExistsError``
        when the trace file already exists (choose another prefix) or ``directory`` is a
        file, and ``OSError`` when the directory cannot be made or written; nothing is
        recording then.
        """
        if self._profile is not None:
            raise RuntimeError(
                f"worker {self.rank} is already profiling (into {self._path}); stop_profile() first"
            )
        path = Path(os.path.abspath(Path(directory).expanduser())) / trace_name(
            check_prefix(prefix), self.rank
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        if not os.access(path.parent, os.W_OK | os.X_OK):
            raise PermissionError(f"profile directory {str(path.parent)!r} is not writable")
        if path.exists():
            raise FileExistsError(f"profile trace {str(path)!r} exists; use another prefix")
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        global _process_owner
        with _process_lock:
            if _process_owner is not None:
                raise RuntimeError(
                    f"another worker in this process (pid {os.getpid()}, rank "
                    f"{_process_owner.rank}) is profiling: torch.profiler runs one session "
                    "per process"
                )
            session = profile(activities=activities)
            session.start()
            _process_owner = self
        self._profile, self._path = session, path
        self._thread, self._started_at = threading.get_ident(), time.monotonic()
        log.info("worker %d: profiling into %s", self.rank, path)
        return str(path)

    def _end(self) -> tuple[Any, Path]:
        """Stop the session (from the thread that started it) and forget it."""
        if self._profile is None or self._path is None:
            raise RuntimeError(f"worker {self.rank} is not profiling; start_profile() first")
        if self._thread != threading.get_ident():
            raise RuntimeError(
                f"worker {self.rank}'s profiler was started by another thread and can only "
                "be stopped there"
            )
        session, path = self._profile, self._path
        self._forget()
        session.stop()
        return session, path

    def _forget(self) -> None:
        global _process_owner
        self._profile = self._path = self._thread = None
        with _process_lock:
            if _process_owner is self:
                _process_owner = None

    def stop(self) -> str:
        """End the session and write its Chrome trace; returns the trace's absolute path.
        Raises ``RuntimeError`` when no session runs (or this is not the thread that started
        it), ``OSError`` if the trace cannot be written (the session is over either way)."""
        session, path = self._end()
        session.export_chrome_trace(str(path))
        log.info(
            "worker %d: wrote the profile of %.1f s to %s",
            self.rank,
            time.monotonic() - self._started_at,
            path,
        )
        return str(path)

    def discard(self) -> bool:
        """End the session without writing anything; False (and nothing done) when none
        runs.  Raises ``RuntimeError`` from any thread but the one that started it."""
        if self._profile is None:
            return False
        self._end()
        return True

    def close(self) -> None:
        """At shutdown: end a running session without writing its trace (nobody asked for
        it), with a warning; never raises."""
        if self._profile is None:
            return
        log.warning("worker %d: shut down while profiling; no trace written", self.rank)
        try:
            self._end()
        except Exception:  # another thread's session, or torch failed: drop it
            log.exception("worker %d: could not stop the profiler", self.rank)
            self._forget()
