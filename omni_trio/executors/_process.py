"""Waiting for an OS process of a worker to exit (tractor and Ray backends), and a process
forked by the fork server seen as a :class:`trio.Process` (stage processes)."""

from __future__ import annotations

import importlib
import os
import signal
import struct
from typing import Any

import trio

__all__ = ["ForkedProcess", "call_import_path", "runs", "wait_exited"]


async def wait_exited(pid: int) -> None:
    """Return once process ``pid`` has exited (reaped or not); at once if it is gone.

    Linux: a pidfd turns readable when the process exits.  Elsewhere: poll."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # pragma: no cover - no pidfd on this platform
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            await trio.sleep(0.05)
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)


def call_import_path(target: str, *args: Any) -> None:
    """Call the function at ``target`` (``"package.module:function"``) with ``args``: the
    entry of a forked process, named by path so that its caller need not import it."""
    module, _, name = target.partition(":")
    getattr(importlib.import_module(module), name)(*args)


class ForkedProcess:
    """A process forked by the fork server (a ``multiprocessing`` forkserver ``Process``),
    with the part of :class:`trio.Process`'s interface a caller that is not its parent
    needs: ``pid``, ``returncode`` (negative: killed by that signal), ``wait``, ``kill``
    and ``terminate``.  The fork server reaps it and writes its exit status to a pipe,
    read here alone.  A fork server that dies first leaves the process running (orphaned:
    init reaps it): it is then watched by pid, and its status, once it ended, is unknown
    (255)."""

    UNKNOWN = 255

    def __init__(self, process: Any) -> None:
        self._process: Any = process  # (holds the status pipe open until it is dropped)
        self._pid: int = process.pid
        self._status: int | None = os.dup(process.sentinel)  # ours to read and close
        os.set_blocking(self._status, False)
        self._code: int | None = None
        self._orphaned = False  # the fork server ended without reporting it
        self._lock = trio.Lock()  # one task at a time waits on the pipe

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        """The exit status once known, else None (never blocks)."""
        if self._code is None:
            self._read_status()
        if self._code is None and self._orphaned and not runs(self._pid):
            self._code = self.UNKNOWN
        return self._code

    def _read_status(self) -> None:
        if self._status is None or self._orphaned:
            return
        try:
            data = os.read(self._status, _STATUS.size)
        except BlockingIOError:
            return
        if len(data) == _STATUS.size:
            self._code = _STATUS.unpack(data)[0]
        else:  # EOF (or a torn report): the fork server is gone
            self._orphaned = True

    async def wait(self) -> int:
        """The exit status, once the process has exited.  Cancelling the wait is harmless;
        several tasks may wait at once."""
        async with self._lock:
            while self.returncode is None:
                if self._orphaned:
                    await wait_exited(self._pid)
                else:
                    assert self._status is not None
                    await trio.lowlevel.wait_readable(self._status)
            if self._status is not None:  # nobody waits on it (the lock)
                os.close(self._status)
                self._status = None
                self._process = None
        assert self._code is not None
        return self._code

    def _signal(self, signum: int) -> None:
        if self.returncode is not None:
            return  # it ended: the pid may be another process's by now
        try:
            os.kill(self._pid, signum)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL, unless it ended already."""
        self._signal(signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM, unless it ended already."""
        self._signal(signal.SIGTERM)


# The fork server's report of an exit status (multiprocessing.forkserver.write_signed).
_STATUS = struct.Struct("q")


def runs(pid: int) -> bool:
    """Process ``pid`` exists and has not ended (a zombie has: it waits to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            return True
        return True
