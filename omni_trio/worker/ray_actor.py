"""The worker side of the Ray backend: one Ray actor (a process Ray starts) per worker.

:class:`RayWorker` is a plain class; the executor turns it into an actor class with
``ray.remote`` when a Ray engine starts, so importing this module never imports Ray (or
torch: the model is loaded by :meth:`RayWorker.start`).

The actor has two concurrency groups:

- the default group runs one call at a time, in order, in the actor's single executor
  thread: :meth:`start`, :meth:`call` (every worker RPC, forwards included) and
  :meth:`shutdown`;
- ``"control"`` (:data:`CONTROL_GROUP`) runs beside it, so a control call is never stuck
  behind a forward: :meth:`abort` and :meth:`stop_everything` set the stop flags the running
  forward checks at its next step, :meth:`heartbeat` reports the steps run so far and the
  progress of running requests (progress-aware liveness), and :meth:`watch` never returns
  while the actor lives (the executor learns of the actor's death, idle or busy, from that
  call failing with ``ActorDiedError``).

A call never raises for the worker's own errors: it returns a reply dict, ``{"rank",
"steps", "ok", "result" | "error", "error_type", "traceback"}``, the same shape the tractor
backend uses, and only the output rank ships its result.  A call that raises
:class:`~omni_trio.worker.faults.WorkerFatalError` gets no reply: the actor process ends
with :data:`~omni_trio.worker.faults.EXIT_CODE`, so the executor sees a dead actor, as for
any crash.  Results leave the actor on the CPU (Ray ships them through its object store).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Iterable, Mapping
from dataclasses import asdict, fields, is_dataclass, replace
from typing import Any

from .faults import EXIT_CODE, WorkerFatalError, mark_worker_process
from .replies import failure_fields

__all__ = ["CONTROL_GROUP", "CONTROL_CONCURRENCY", "RayWorker", "to_cpu"]

log = logging.getLogger(__name__)

CONTROL_GROUP = "control"
# abort / stop_everything / heartbeat, plus the one watch call that parks a thread for good.
CONTROL_CONCURRENCY = 4


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
        self._worker: Any = None
        self._stopped = threading.Event()
        self._dist_socket: socket.socket | None = None

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

    def start(self, dist_init_method: str | None = None) -> dict[str, Any]:
        """Select the device, join the CFG group (two ranks), load the model; report the
        pid, rank, node address and model info."""
        import ray

        from .worker import Worker

        worker = Worker(
            self.config,
            rank=self.rank,
            world_size=self.world_size,
            dist_init_method=dist_init_method,
        )
        self._worker = worker
        worker.init_device()
        info = worker.load_model()
        return {
            "pid": os.getpid(),
            "rank": self.rank,
            "node_ip": ray.util.get_node_ip_address(),
            "model_info": asdict(info),
        }

    def call(
        self,
        method: str,
        args: Iterable[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        reply_rank: int | None = 0,
    ) -> dict[str, Any]:
        """Run one worker method; a reply dict (never raises for the method's own error)."""
        worker = self._worker
        reply: dict[str, Any] = {"rank": self.rank}
        try:
            if worker is None:
                raise RuntimeError("the worker is not started")
            result = worker.execute_method(method, *args, **dict(kwargs or {}))
            if reply_rank in (None, self.rank):
                reply.update(ok=True, result=to_cpu(result))
            else:
                reply.update(ok=True, result=None)
        except WorkerFatalError:
            log.critical("worker %d: fatal error in %r; ending the process", self.rank, method)
            os._exit(EXIT_CODE)
        except Exception as exc:
            reply.update(failure_fields(exc))
        reply["steps"] = worker.steps_done if worker is not None else 0
        return reply

    def shutdown(self) -> bool:
        """Shut the worker down (packer, runner, CFG group); ends :meth:`watch`."""
        worker, self._worker = self._worker, None
        try:
            if worker is not None:
                worker.stop_flags.stop_everything()
                worker.shutdown()
        finally:
            self._stopped.set()
        return True

    # -- control group: never behind a forward ----------------------------------------

    def abort(self, request_ids: list[str]) -> None:
        worker = self._worker
        if worker is not None:
            worker.stop_flags.abort(request_ids)

    def stop_everything(self) -> None:
        worker = self._worker
        if worker is not None:
            worker.stop_flags.stop_everything()

    def heartbeat(self) -> dict[str, Any]:
        worker = self._worker
        if worker is None:
            return {"rank": self.rank, "steps": 0, "progress": {}}
        return {
            "rank": self.rank,
            "steps": worker.steps_done,
            "progress": {k: tuple(v) for k, v in dict(worker.progress).items()},
        }

    def watch(self) -> int:
        """Returns only when the worker was shut down; fails when the actor dies."""
        self._stopped.wait()
        return os.getpid()
