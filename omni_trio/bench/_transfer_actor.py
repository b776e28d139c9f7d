"""The child side of ``bench backends``' transfer part: a tractor actor that sends payloads.

tractor imports this module in the parent too (``enable_modules``), so its top level stays
light: numpy and the codec are imported inside :func:`serve_payloads`.

Protocol over one ``open_context`` stream: the parent sends ``{"nbytes": n, "shm_threshold":
t}`` (``t`` None: inline) encoded by :func:`omni_trio.ipc.encode`; the child answers with a
``uint8`` array of ``n`` bytes encoded by ``Encoder(shm_threshold=t)``: through shared memory
when ``n > t``, else inside the message on tractor's own channel.  An empty request ends it.
"""

from __future__ import annotations

from typing import Any

import tractor

__all__ = ["TRANSFER_MODULE", "serve_payloads"]

TRANSFER_MODULE = __name__


@tractor.context
async def serve_payloads(ctx: tractor.Context) -> None:
    import numpy as np

    from ..ipc import Encoder, decode

    payloads: dict[int, Any] = {}
    encoders: dict[int | None, Encoder] = {}
    await ctx.started(None)
    async with ctx.open_stream() as stream:
        async for raw in stream:
            request = decode(raw)
            if not request:
                break
            nbytes = int(request["nbytes"])
            threshold = request["shm_threshold"]
            payload = payloads.get(nbytes)
            if payload is None:  # built once per size (an untimed warmup request)
                payload = payloads[nbytes] = np.full(nbytes, 7, dtype=np.uint8)
            encoder = encoders.get(threshold)
            if encoder is None:
                encoder = encoders[threshold] = Encoder(shm_threshold=threshold)
            await stream.send(encoder.encode({"payload": payload}))
