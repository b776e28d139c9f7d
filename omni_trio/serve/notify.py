"""The systemd notify protocol (``sd_notify(3)``), without a dependency.

systemd (``Type=notify``) passes the path of a datagram socket in ``NOTIFY_SOCKET`` (a file
path, or ``@name`` for an abstract socket) and, with ``WatchdogSec=``, the watchdog period in
``WATCHDOG_USEC`` (and the process meant to feed it in ``WATCHDOG_PID``).  The service sends
newline-separated ``KEY=VALUE`` lines: ``READY=1`` when it serves, ``STATUS=...`` for
``systemctl status``, ``WATCHDOG=1`` at least once per period, ``STOPPING=1`` when it begins
to shut down.

Everything here is a no-op when ``NOTIFY_SOCKET`` is unset (not under systemd), and a failed
send is logged, never raised: a notification is advice to the supervisor, and the daemon
must not die because its supervisor went away.

:func:`serve_watchdog` feeds the watchdog *from the event loop*: if the loop hangs, the pings
stop and systemd kills and restarts the process, which is the point of ``WatchdogSec``.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

import trio
from trio_typing import TaskStatus

__all__ = ["SystemdNotifier", "serve_watchdog", "watchdog_interval"]

log = logging.getLogger("omni_trio.serve.notify")

NOTIFY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class SystemdNotifier:
    """Sends notifications to ``NOTIFY_SOCKET``; every method is a no-op without one.

    The socket is an ``AF_UNIX``/``SOCK_DGRAM`` socket opened on the first send,
    non-blocking and close-on-exec.  No method checkpoints or blocks: a datagram that cannot
    be sent at once (full buffer, supervisor gone) is dropped and logged.
    """

    def __init__(self, address: str | None) -> None:
        # address: a path, or "@name" for a Linux abstract socket; None disables.
        self._address: str | bytes | None = None
        self._sock: socket.socket | None = None
        self._failures = 0
        if not address:
            return
        if address.startswith("@"):
            self._address = b"\0" + address[1:].encode()
        elif address.startswith("/"):
            self._address = address
        else:
            # vsock:... and other transports newer systemd versions can pass.
            log.warning("NOTIFY_SOCKET %r is not supported; notifications disabled", address)

    @classmethod
    def from_environ(
        cls, environ: Mapping[str, str] | None = None, *, unset: bool = False
    ) -> SystemdNotifier:
        """The notifier ``NOTIFY_SOCKET`` asks for.  ``unset=True`` removes ``NOTIFY_SOCKET``
        (and the watchdog variables) from ``os.environ`` so that child processes (engine
        workers) do not inherit them, as ``sd_notify(unset_environment=1)`` does; read
        :func:`watchdog_interval` first."""
        env = os.environ if environ is None else environ
        notifier = cls(env.get("NOTIFY_SOCKET"))
        if unset:
            for name in NOTIFY_ENV:
                os.environ.pop(name, None)
        return notifier

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def send(self, **fields: object) -> bool:
        """Send ``KEY=value`` lines (keys upper-cased, ``send(ready=1, status="x")``); True
        if the datagram left.  Newlines in values become spaces (they would end the line)."""
        if self._address is None or not fields:
            return False
        lines = []
        for key, value in fields.items():
            text = str(value).replace("\r", " ").replace("\n", " ")
            lines.append(f"{key.upper()}={text}")
        payload = "\n".join(lines).encode("utf-8", "replace")
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            self._sock.sendto(payload, self._address)
        except OSError as exc:
            self._failures += 1
            # Once loudly, then quietly: a dead supervisor would otherwise flood the log.
            level = logging.WARNING if self._failures == 1 else logging.DEBUG
            log.log(level, "systemd notification %r not sent: %s", lines[0], exc)
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """``READY=1``: startup finished, the service serves."""
        return self.send(ready=1, **({"status": status} if status is not None else {}))

    def stopping(self, status: str | None = None) -> bool:
        """``STOPPING=1``: the service is shutting down (draining)."""
        return self.send(stopping=1, **({"status": status} if status is not None else {}))

    def status(self, text: str) -> bool:
        """``STATUS=text``: a one-line state shown by ``systemctl status``."""
        return self.send(status=text)

    def watchdog(self) -> bool:
        """``WATCHDOG=1``: the service is alive; must come at least once per period."""
        return self.send(watchdog=1)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between watchdog pings: half of ``WATCHDOG_USEC`` (as ``sd_watchdog_enabled``
    advises), or None when there is no watchdog: ``WATCHDOG_USEC`` unset or not a positive
    integer, or ``WATCHDOG_PID`` set to another process."""
    env = os.environ if environ is None else environ
    usec_text = env.get("WATCHDOG_USEC")
    if not usec_text:
        return None
    try:
        usec = int(usec_text)
    except ValueError:
        log.warning("WATCHDOG_USEC=%r is not an integer; watchdog disabled", usec_text)
        return None
    if usec <= 0:
        return None
    pid_text = env.get("WATCHDOG_PID")
    if pid_text:
        try:
            pid = int(pid_text)
        except ValueError:
            log.warning("WATCHDOG_PID=%r is not an integer; watchdog disabled", pid_text)
            return None
        if pid != os.getpid():
            return None
    return usec / 1e6 / 2


async def serve_watchdog(
    notifier: SystemdNotifier,
    *,
    interval: float | None = None,
    task_status: TaskStatus[float | None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Send ``WATCHDOG=1`` now and every ``interval`` seconds (default
    :func:`watchdog_interval`) until cancelled.  ``task_status.started`` gets the interval;
    with no watchdog or no notifier it is None and the task returns at once.

    The pings come from this trio task, so they stop when the event loop stops running tasks.
    The schedule does not drift (pings aim at ``start + k * interval``); after a stall longer
    than an interval it restarts from now instead of sending a burst.
    """
    if interval is None:
        interval = watchdog_interval()
    if interval is None or not notifier.enabled:
        task_status.started(None)
        return
    if not (interval > 0):
        raise ValueError(f"watchdog interval must be > 0, got {interval!r}")
    task_status.started(interval)
    next_at = trio.current_time()
    while True:
        notifier.watchdog()
        next_at += interval
        now = trio.current_time()
        if next_at <= now:
            next_at = now + interval
        await trio.sleep_until(next_at)
