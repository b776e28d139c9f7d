"""The worker side of the Ray backend: one Ray actor (a process Ray starts) per worker.

:class:`RayWorker` is a plain class; the executor turns it into an actor class with
``ray.remote`` when a Ray engine starts, so importing this module never imports Ray (or
torch: the model is loaded by :meth:`RayWorker.start`).  It puts Ray's actor calls around
one :class:`~omni_trio.worker.host.WorkerHost`, which says what each message does; the
messages are the typed ones of :mod:`omni_trio._core.messages` (Ray pickles them).

The actor has two concurrency groups:

- the default group runs one call at a time, in order, in the actor's single executor
  thread: :meth:`rendezvous_address`, :meth:`start`, :meth:`call` (every
  :class:`~omni_trio._core.messages.WorkerCall`, forwards included; its return value is the
  rank's one reply) and :meth:`shutdown`;
- ``"control"`` (:data:`CONTROL_GROUP`) runs beside it, so a control call is never stuck
  behind a forward: :meth:`abort` sets the stop flags the running forward checks at its
  next step, :meth:`poll` long-polls what the rank volunteers (the output packer's
  ``OUTPUT_READY`` messages, then a fresh heartbeat), and :meth:`watch` never returns while
  the actor lives (the executor learns of the actor's death, idle or busy, from that call
  failing with ``ActorDiedError``).

A call that raises :class:`~omni_trio.worker.faults.WorkerFatalError` gets a ``fatal``
reply (see :mod:`omni_trio.worker.host`).  Everything leaves the actor on the CPU
(:func:`to_cpu`; Ray ships it through its object store).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import fields, is_dataclass, replace
from typing import Any

from .faults import mark_worker_process

__all__ = ["CONTROL_GROUP", "CONTROL_CONCURRENCY", "RayWorker", "to_cpu"]

log = logging.getLogger(__name__)

CONTROL_GROUP = "control"
# abort and stop calls, the one long poll, and the one watch call that parks a thread.
CONTROL_CONCURRENCY = 6


def to_cpu(value: Any) -> Any:
    """``value`` with every torch tensor inside it (dataclasses, dicts, lists, tuples) moved
    to the CPU, so nothing that leaves the actor holds device memory."""
    import torch

    if isinstance(value, torch.Tensor):
        return value if value.device.type == "cpu" else value.cpu()
    if is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for f in fields(value):
            if not f.init:
                continue
            old = getattr(value, f.name)
            new = to_cpu(old)
            if new is not old:
                changes[f.name] = new
        return replace(value, **changes) if changes else value
    if isinstance(value, Mapping):
        items = {k: to_cpu(v) for k, v in value.items()}
        if any(items[k] is not v for k, v in value.items()):
            return type(value)(items) if isinstance(value, dict) else items
        return value
    if isinstance(value, list | tuple):
        moved = [to_cpu(v) for v in value]
        if any(a is not b for a, b in zip(moved, value, strict=True)):
            return type(value)(moved) if isinstance(value, list) else tuple(moved)
        return value
    return value


class RayWorker:
    """One worker rank inside a Ray actor; see the module docstring."""

    def __init__(self, config: dict[str, Any], rank: int, world_size: int) -> None:
        from ..config import EngineConfig

        mark_worker_process()  # injected crash faults end this process, not just a call
        self.config = EngineConfig.from_dict(config)
        self.rank = rank
        self.world_size = world_size
        self._host: Any = None  # a WorkerHost once started
        # What the rank volunteers (OUTPUT_READY), until the executor's next poll.
        self._outbox: list[Any] = []
        self._outbox_ready = threading.Condition()
        self._never = threading.Event()

    # -- default group: one call at a time --------------------------------------------

    def rendezvous_address(self) -> str:
        """``tcp://HOST:PORT`` on this actor's node for a CFG-parallel group's
        torch.distributed rendezvous (rank 0 hosts it): a port free now on this node's
        address as Ray knows it."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        return f"tcp://{host}:{port}"

    def start(
        self, dist_init_method: str | None = None, data_parallel_size: int = 1
    ) -> dict[str, Any]:
        """Select the device, join the CFG group (two ranks), load the model, start the
        output packer; report the pid, node address and model info."""
        import ray

        from .host import WorkerHost
        from .worker import Worker

        worker = Worker(
            self.config,
            rank=self.rank,
            world_size=self.world_size,
            dist_init_method=dist_init_method,
            data_parallel_size=data_parallel_size,
        )
        host = WorkerHost(worker, self._post)
        self._host = host
        info = host.start()
        return {
            "pid": os.getpid(),
            "node_ip": ray.util.get_node_ip_address(),
            "model_info": info.to_dict(),
        }

    def call(self, call: Any) -> Any:
        """Run one :class:`~omni_trio._core.messages.WorkerCall`; its reply."""
        from .host import failure_reply

        host = self._host
        if host is None:
            return failure_reply(
                call, RuntimeError("the worker is not started"), rank=self.rank, steps=0
            )
        host.received(call)
        return to_cpu(host.call(call))

    def shutdown(self) -> bool:
        """Stop every forward and shut the worker down (packer, runner, CFG group)."""
        host, self._host = self._host, None
        if host is not None:
            host.shutdown()
        return True

    # -- control group: never behind a forward ----------------------------------------

    def _post(self, message: Any) -> None:
        """An ``OUTPUT_READY`` from the packer's thread: queued for the next poll."""
        message = to_cpu(message)
        with self._outbox_ready:
            self._outbox.append(message)
            self._outbox_ready.notify_all()

    def abort(self, abort: Any) -> None:
        """Apply a :class:`~omni_trio._core.messages.WorkerAbort` now."""
        host = self._host
        if host is not None:
            host.abort(abort)

    def poll(self, timeout: float) -> list[Any]:
        """What the rank volunteered since the last poll, then a fresh
        :class:`~omni_trio._core.messages.Heartbeat`: waits until there is something, or a
        heartbeat is due (:meth:`~omni_trio.worker.host.WorkerHost.heartbeat_due`), at most
        ``timeout`` seconds."""
        from .._core.messages import Heartbeat
        from .host import HEARTBEAT_CHECK_S

        deadline = time.monotonic() + timeout
        with self._outbox_ready:
            while not self._outbox:
                now = time.monotonic()
                host = self._host
                if now >= deadline or (host is not None and host.heartbeat_due(now)):
                    break
                self._outbox_ready.wait(min(HEARTBEAT_CHECK_S, deadline - now))
            messages, self._outbox = self._outbox, []
        host = self._host
        messages.append(host.heartbeat() if host is not None else Heartbeat(self.rank, 0))
        return messages

    def watch(self) -> None:
        """Never returns: fails (``ActorDiedError``) when the actor dies."""
        self._never.wait()
