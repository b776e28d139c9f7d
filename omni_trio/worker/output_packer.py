"""The output packer: the worker's background stage between a forward and its reply.

Why it exists: moving a finished output off the device and packing it (conversion to the
requested output type, shared memory for large arrays) takes time the device could spend on
the next forward.  So the worker hands each finished output to the packer, which answers
``COMPUTE_DONE`` at once (the device is free, the next forward may start) and ``OUTPUT_READY``
from its own thread once the payload is packed.  The executor's result pump correlates the two
by ``async_output_id`` and accepts them in either order.

The packer is synchronous (the worker runs in its own thread or process, not in trio) and owns
one thread, started on the first ``submit`` and joined by ``close``.  It is the worker's single
reply writer: every reply goes through :meth:`OutputPacker.send`, serialised by one lock, so a
reply transport that allows one writer at a time (a ring buffer, a channel) needs no locking
of its own.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, Protocol

from .._core.messages import AsyncOutput, AsyncOutputKind
from ..errors import EngineClosedError

__all__ = ["OutputPacker", "ReadyEvent", "record_ready_event"]

log = logging.getLogger(__name__)


class ReadyEvent(Protocol):
    """A device event: ``synchronize()`` blocks until the work recorded before it is done.

    ``torch.cuda.Event`` (and ``torch.cuda.Stream``) satisfy it.
    """

    def synchronize(self) -> None: ...


def record_ready_event(device: Any) -> ReadyEvent | None:
    """Record an event on ``device``'s current stream after a forward; ``None`` off CUDA.

    The worker passes it to :meth:`OutputPacker.submit` so the packer waits for the forward's
    kernels in its own thread, never in the worker's.
    """
    if getattr(device, "type", device) != "cuda":
        return None
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


_Job = tuple[str, Any, "ReadyEvent | None"]


def _identity(output: Any) -> Any:
    return output


class OutputPacker:
    """Packs finished outputs in one owned background thread, in submission order.

    ``reply`` is the worker's reply transport (called from the submitting thread for
    ``COMPUTE_DONE`` and from the packer thread for ``OUTPUT_READY``, never concurrently).
    ``pack(output)`` turns the submitted output (e.g. a runner's forwarded batch) into the
    payload sent with
    ``OUTPUT_READY`` (identity by default); it runs in the packer thread.  On CUDA it should
    copy on a side stream of its own (``with torch.cuda.stream(side):``) so it does not queue
    behind the next forward on the default stream.  If ``reply`` raises for an
    ``OUTPUT_READY`` the error is logged and the message is lost: a transport that can fail
    should release the payload itself.
    """

    def __init__(
        self,
        reply: Callable[[AsyncOutput], None],
        pack: Callable[[Any], Any] | None = None,
        *,
        name: str = "omni-trio-output-packer",
        new_id: Callable[[], str] | None = None,
    ) -> None:
        self.name = name
        self._reply = reply
        self._pack = pack if pack is not None else _identity
        self._new_id = new_id if new_id is not None else (lambda: uuid.uuid4().hex)
        # One writer at a time on the reply transport.
        self._send_lock = threading.Lock()
        # Guards _pending, _closed, _thread and _stop_queued; notified when _pending drops.
        self._state = threading.Condition()
        self._pending = 0  # submitted, OUTPUT_READY not yet handed to reply
        self._closed = False  # no more submits
        self._stop_queued = False
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        # output id -> the request ids of a submitted output (when it names them), until its
        # OUTPUT_READY was sent.  Guarded by _state.
        self._owners: dict[str, tuple[str, ...]] = {}
        # Set when an OUTPUT_READY could not be sent: the outputs after it may never come.
        self._send_failed = False

    @property
    def pending(self) -> int:
        """Outputs submitted whose ``OUTPUT_READY`` has not been sent yet."""
        with self._state:
            return self._pending

    @property
    def closed(self) -> bool:
        with self._state:
            return self._closed

    @property
    def alive(self) -> bool:
        """False once the packer thread died while it had work, or a send failed: the
        outputs it holds will never come (liveness: the group must fail).  Any thread."""
        with self._state:
            thread = self._thread
            died = thread is not None and not thread.is_alive() and not self._stop_queued
            return not (died or self._send_failed)

    def leftovers(self) -> dict[str, set[str]]:
        """``packer_queue``: the requests whose outputs are submitted and not sent yet (for
        outputs with ``request_ids``, like a runner's forwarded batch).  Any thread."""
        with self._state:
            return {"packer_queue": {rid for ids in self._owners.values() for rid in ids}}

    def send(self, message: AsyncOutput) -> None:
        """Send any reply through the worker's single writer (e.g. an ``RPC_RESULT``)."""
        with self._send_lock:
            self._reply(message)

    def submit(
        self,
        rpc_id: str | None,
        output: Any,
        *,
        ready_event: ReadyEvent | None = None,
    ) -> str:
        """Answer ``rpc_id`` with ``COMPUTE_DONE`` now and pack ``output`` in the background.

        Returns the new ``async_output_id``.  The ``COMPUTE_DONE`` has been handed to ``reply``
        when this returns; the ``OUTPUT_READY`` follows from the packer thread, after
        ``ready_event.synchronize()`` if an event is given, carrying ``pack(output)`` or, if
        waiting or packing raised, ``error="Background output packing failed: ..."`` and
        ``error_type``.  Raises :class:`EngineClosedError` after :meth:`close`, and whatever
        ``reply`` raises for the ``COMPUTE_DONE`` (nothing is queued then).
        """
        with self._state:
            if self._closed:
                raise EngineClosedError(f"{self.name} is closed")
            output_id = self._new_id()
            # Sending and queueing under the state lock: close() never puts its stop marker
            # between a COMPUTE_DONE and its job.
            self.send(
                AsyncOutput(AsyncOutputKind.COMPUTE_DONE, rpc_id=rpc_id, async_output_id=output_id)
            )
            self._pending += 1
            owners = getattr(output, "request_ids", None)
            if isinstance(owners, tuple):
                self._owners[output_id] = owners
            if self._thread is None:
                self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
                self._thread.start()
            self._jobs.put((output_id, output, ready_event))
        return output_id

    def drain(self, timeout: float | None = None) -> bool:
        """Block until every submitted output's ``OUTPUT_READY`` was sent, or ``timeout``
        seconds passed (``None``: no limit).  Returns whether nothing is pending.

        Use it before a call that releases device memory (sleep, offload, unload).  Raises
        ``RuntimeError`` if called from the packer thread (it would wait for itself).
        """
        self._check_not_packer_thread("drain")
        with self._state:
            return self._state.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Refuse new submits, drain, stop the thread and join it, all within ``timeout``.

        Returns True if everything was sent and the thread has exited; False if the time ran
        out (the thread is a daemon and exits once its queued work is done).  Idempotent.
        """
        self._check_not_packer_thread("close")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._state:
            self._closed = True
        drained = self.drain(timeout)
        with self._state:
            thread = self._thread
            if thread is not None and not self._stop_queued:
                self._stop_queued = True
                self._jobs.put(None)
        if thread is None:
            return drained
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            log.error("%s did not stop within %s s", self.name, timeout)
            return False
        return drained

    def __enter__(self) -> OutputPacker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_not_packer_thread(self, what: str) -> None:
        if self._thread is not None and threading.current_thread() is self._thread:
            raise RuntimeError(f"{self.name}.{what}() called from the packer thread")

    def _main(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            output_id = job[0]
            try:
                self._finish(*job)
            except BaseException:
                # Not a packing error (those become error outputs): the thread itself ends
                # here, with outputs that will never come.  ``alive`` turns False, so the
                # worker's liveness fails its group; say why once, here.
                log.critical(
                    "%s: the packer thread died packing %s", self.name, output_id, exc_info=True
                )
                return
            finally:
                del job  # drop the output (device memory) before waiting for the next one
                with self._state:
                    self._pending -= 1
                    self._owners.pop(output_id, None)  # if _finish did not get that far
                    self._state.notify_all()

    def _finish(self, output_id: str, output: Any, ready: ReadyEvent | None) -> None:
        try:
            if ready is not None:
                ready.synchronize()
            packed = self._pack(output)
        except Exception as exc:
            log.debug("%s: packing %s failed", self.name, output_id, exc_info=True)
            message = AsyncOutput(
                AsyncOutputKind.OUTPUT_READY,
                async_output_id=output_id,
                error=f"Background output packing failed: {type(exc).__name__}: {exc}",
                error_type=type(exc).__name__,
            )
        else:
            message = AsyncOutput(
                AsyncOutputKind.OUTPUT_READY, async_output_id=output_id, result=packed
            )
        del output
        with self._state:  # before the send: whoever receives it sees nothing held here
            self._owners.pop(output_id, None)
        try:
            self.send(message)
        except Exception:
            log.exception("%s: could not send OUTPUT_READY for %s", self.name, output_id)
            with self._state:
                self._send_failed = True
