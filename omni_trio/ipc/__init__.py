"""The wire layer for multi-process executors: a msgpack codec and a shared-memory transport.

:mod:`omni_trio.ipc.codec` turns our messages into ``bytes`` (tractor's channel carries
msgpack only); :mod:`omni_trio.ipc.shm` moves payloads above 1 MB through POSIX shared memory,
each segment unlinked exactly once by its receiver.  Importing this package does not import
torch, numpy or PIL.
"""

from .codec import MESSAGE_TYPES as MESSAGE_TYPES
from .codec import Decoder as Decoder
from .codec import Encoder as Encoder
from .codec import decode as decode
from .codec import discard_message as discard_message
from .codec import encode as encode
from .shm import DEFAULT_SHM_THRESHOLD as DEFAULT_SHM_THRESHOLD
from .shm import SHM_PREFIX as SHM_PREFIX
from .shm import SegmentRegistry as SegmentRegistry
from .shm import ShmHandle as ShmHandle
from .shm import ShmKind as ShmKind
from .shm import discard as discard
from .shm import list_our_segments as list_our_segments
from .shm import owner_of as owner_of
from .shm import owner_tag as owner_tag
from .shm import pack_array as pack_array
from .shm import pack_image as pack_image
from .shm import pack_tensor as pack_tensor
from .shm import payload_nbytes as payload_nbytes
from .shm import segments_of_this_process as segments_of_this_process
from .shm import sweep_orphans as sweep_orphans
from .shm import sweep_segments as sweep_segments
from .shm import unlink_segment as unlink_segment
from .shm import unpack as unpack

__all__ = [
    "DEFAULT_SHM_THRESHOLD",
    "MESSAGE_TYPES",
    "SHM_PREFIX",
    "Decoder",
    "Encoder",
    "SegmentRegistry",
    "ShmHandle",
    "ShmKind",
    "decode",
    "discard",
    "discard_message",
    "encode",
    "list_our_segments",
    "pack_array",
    "pack_image",
    "pack_tensor",
    "payload_nbytes",
    "owner_of",
    "owner_tag",
    "segments_of_this_process",
    "sweep_orphans",
    "sweep_segments",
    "unlink_segment",
    "unpack",
]
