"""Waiting for an OS process of a worker to exit (tractor and Ray backends)."""

from __future__ import annotations

import os

import trio

__all__ = ["wait_exited"]


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
