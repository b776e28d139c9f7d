"""Who may talk to a worker group's tractor ports: only the processes of that group.

Every tractor actor (the engine's root actor and each worker) listens on a loopback TCP port.
tractor 0.1.0a5 answers any connection by sending its own id and decoding whatever comes
back; bytes that are not its protocol raise out of its connection handler and take the whole
actor down (measured: a few null bytes on a worker's port restarted the group, an HTTP
request line on the engine's port failed it).  :func:`guard_tractor_handshake` replaces the
handshake, in every process of ours that runs an actor, for **inbound** connections only:

* the peer must speak first, within :data:`HANDSHAKE_TIMEOUT_S`, and what it sends must be an
  actor id (two strings);
* that id must be one this actor expects: a worker it has just spawned and is waiting for,
  or a peer already connected (a worker's second channel, to the registry).  An actor's id
  carries a random UUID made for that run by the process that spawned it, so the id is the
  per-run shared secret: a process that does not know it cannot join;
* otherwise the connection is dropped (logged, one line) and nothing of ours is sent.

Connections an actor makes itself (a worker dialling its parent) keep tractor's handshake.
Limitation, documented in docs/backends.md: with the ``trio`` start method a worker's id is
on its command line, which other users of the same machine can read (``ps``); run the
daemon in its own container or user where that matters.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

__all__ = ["HANDSHAKE_TIMEOUT_S", "guard_tractor_handshake"]

log = logging.getLogger(__name__)

# How long an inbound peer has to say who it is.
HANDSHAKE_TIMEOUT_S = 10.0
_MARK = "_omni_trio_guarded"


def _listening_ports(actor: Any) -> set[int]:
    ports = set()
    for listener in getattr(actor, "_listeners", ()):
        sock = getattr(listener, "socket", None)
        if sock is not None:
            try:
                ports.add(int(sock.getsockname()[1]))
            except OSError:
                continue
    return ports


def _is_inbound(actor: Any, chan: Any) -> bool:
    laddr = chan.laddr
    return laddr is not None and int(laddr[1]) in _listening_ports(actor)


def _as_uid(value: Any) -> tuple[str, str] | None:
    if isinstance(value, list | tuple) and len(value) == 2:
        name, uuid = value
        if isinstance(name, str) and isinstance(uuid, str) and name and uuid:
            return name, uuid
    return None


def guard_tractor_handshake() -> None:
    """Install the guarded handshake for this process's tractor actors; idempotent.

    Call before the process's actor accepts connections (the engine: before opening the
    root actor; a worker: when its module is imported, right after it dialled its parent).
    """
    from tractor._actor import Actor
    from tractor._exceptions import TransportClosed

    if getattr(Actor._do_handshake, _MARK, False):
        return
    original = Actor._do_handshake

    async def _do_handshake(self: Any, chan: Any) -> tuple[str, str]:
        if not _is_inbound(self, chan):
            return await original(self, chan)
        raddr = chan.raddr
        uid: tuple[str, str] | None = None
        reason = "it sent nothing"
        with trio.move_on_after(HANDSHAKE_TIMEOUT_S):
            try:
                uid = _as_uid(await chan.recv())
                reason = "what it sent is not an actor id"
            except (trio.Cancelled, KeyboardInterrupt):
                raise
            except BaseException as exc:
                reason = f"it does not speak the protocol ({type(exc).__name__})"
        if uid is not None and uid not in self._peer_connected and uid not in self._peers:
            reason, uid = "it is not a process of this worker group", None
        if uid is None:
            log.warning("dropped a connection from %s to %s: %s", raddr, self.uid[0], reason)
            raise TransportClosed(f"handshake refused: {reason}")
        await chan.send(self.uid)
        chan.uid = uid
        return uid

    setattr(_do_handshake, _MARK, True)
    Actor._do_handshake = _do_handshake
