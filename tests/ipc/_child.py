"""Run in a spawned child process by test_codec.py: encode a message whose array goes to
shared memory and send the bytes back.  Kept apart from the test module, and free of torch,
so the child starts fast."""

from __future__ import annotations

from multiprocessing.connection import Connection

import numpy as np


def child_latents() -> np.ndarray:
    return np.arange(4 * 64 * 64, dtype=np.float32).reshape(1, 4, 64, 64)


def encode_in_child(conn: Connection, threshold: int) -> None:
    from omni_trio._core.messages import RunnerOutput
    from omni_trio.ipc import Encoder, SegmentRegistry

    registry = SegmentRegistry("child")
    out = RunnerOutput("r1", images=(child_latents(),), timings={"forward_ms": 2.0})
    data = Encoder(shm_threshold=threshold, registry=registry).encode(out)
    conn.send_bytes(data)
    conn.send(sorted(registry.names()))
    conn.close()
