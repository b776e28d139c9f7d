"""The shared-memory transport: threshold, exact round trips, permissions, unlink-once."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys

import msgpack
import numpy as np
import pytest
import torch
from PIL import Image

from omni_trio.ipc import (
    DEFAULT_SHM_THRESHOLD,
    SHM_PREFIX,
    SegmentRegistry,
    ShmHandle,
    discard,
    list_our_segments,
    owner_of,
    owner_tag,
    pack_array,
    pack_image,
    pack_tensor,
    payload_nbytes,
    segments_of_this_process,
    sweep_orphans,
    sweep_segments,
    unlink_segment,
    unpack,
)

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)


def segment_mode(name: str) -> int:
    return stat.S_IMODE(os.stat(f"/dev/shm/{name}").st_mode)


def to_shm(t: torch.Tensor, **kw: object) -> ShmHandle:
    handle = pack_tensor(t, threshold=0, **kw)  # type: ignore[arg-type]
    assert isinstance(handle, ShmHandle)
    return handle


def assert_tensor_identical(a: torch.Tensor, b: torch.Tensor) -> None:
    """Same dtype, shape and bits (NaN payloads included)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    assert b.device.type == "cpu" and b.is_contiguous()
    a = a.detach().cpu().contiguous()
    assert a.reshape(-1).view(torch.uint8).tolist() == b.reshape(-1).view(torch.uint8).tolist()


# --- round trips --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.randn(3, 5, 7), id="float32"),
        pytest.param(lambda: torch.randn(8, 9).to(torch.float16), id="float16"),
        pytest.param(lambda: torch.randint(0, 256, (32, 24, 3), dtype=torch.uint8), id="uint8"),
        pytest.param(lambda: torch.randint(-(2**62), 2**62, (17,)), id="int64"),
        pytest.param(lambda: torch.rand(6, 6) > 0.5, id="bool"),
        pytest.param(lambda: torch.randn(4, 4, dtype=torch.complex64), id="complex64"),
        pytest.param(lambda: torch.tensor(3.25, dtype=torch.float64), id="scalar"),
    ],
)
def test_tensor_round_trips_through_shm(make: object) -> None:
    t = make()  # type: ignore[operator]
    handle = to_shm(t)
    assert handle.kind == "tensor" and handle.shape == tuple(t.shape)
    assert handle.nbytes == t.numel() * t.element_size()
    out = unpack(handle)
    assert isinstance(out, torch.Tensor)
    assert_tensor_identical(t, out)


def test_bf16_round_trips_bit_exact() -> None:
    # Every 16-bit pattern once: NaN payloads, infinities, subnormals, -0.0.
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    t = bits.view(torch.bfloat16).reshape(256, 256)
    out = unpack(to_shm(t))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    assert torch.equal(out.view(torch.int16), t.view(torch.int16))


def test_non_contiguous_tensor_arrives_contiguous() -> None:
    base = torch.randn(6, 8, 10)
    for view in (base.transpose(0, 2), base[:, ::2, 1::3], base.permute(1, 2, 0)[2]):
        assert not view.is_contiguous()
        handle = to_shm(view)
        assert handle.nbytes == view.numel() * 4
        out = unpack(handle)
        assert isinstance(out, torch.Tensor)
        assert out.is_contiguous() and torch.equal(out, view)


def test_conj_and_grad_tensors_are_resolved() -> None:
    z = torch.randn(3, 3, dtype=torch.complex64).conj()
    out = unpack(to_shm(z))
    assert isinstance(out, torch.Tensor) and not out.is_conj() and torch.equal(out, z)
    g = torch.randn(4, requires_grad=True)
    out = unpack(to_shm(g))
    assert isinstance(out, torch.Tensor) and not out.requires_grad and torch.equal(out, g)


def test_small_view_of_large_batch_goes_to_shm_with_only_its_data() -> None:
    batch = torch.randn(4, 4, 128, 128)  # 1 MiB of float32 > threshold
    row = batch[2, 1, :3]  # 1.5 KB view
    assert payload_nbytes(row) == batch.numel() * 4
    handle = pack_tensor(row)
    assert isinstance(handle, ShmHandle)
    assert handle.nbytes == row.numel() * 4 and handle.shape == (3, 128)
    assert os.stat(f"/dev/shm/{handle.name}").st_size == handle.nbytes
    out = unpack(handle)
    assert isinstance(out, torch.Tensor) and torch.equal(out, row)
    assert out.untyped_storage().nbytes() == row.numel() * 4


def test_small_view_of_large_numpy_array_goes_to_shm() -> None:
    batch = np.random.default_rng(0).random((4, 300, 300))  # 2.9 MB
    part = batch[1, :2, ::3]
    assert payload_nbytes(part) == batch.nbytes
    handle = pack_array(part)
    assert isinstance(handle, ShmHandle) and handle.nbytes == part.nbytes
    out = unpack(handle)
    assert isinstance(out, np.ndarray)
    assert out.flags.c_contiguous and out.flags.owndata and np.array_equal(out, part)


@pytest.mark.parametrize(
    "array",
    [
        np.linspace(0, 1, 60, dtype=np.float32).reshape(3, 4, 5),
        np.arange(24, dtype=np.float64).reshape(4, 6).T,  # non-contiguous
        np.random.default_rng(1).integers(0, 256, (16, 16, 3), dtype=np.uint8),
        np.arange(-50, 50, dtype=np.int16),
        np.arange(10, dtype=">i4"),  # big-endian stays big-endian
        np.array([True, False, True]),
        np.array([1 + 2j, -3.5j], dtype=np.complex128),
        np.array(["2024-01-01", "2025-06-30"], dtype="datetime64[ns]"),
        np.array(["a", "bcd"], dtype="U3"),
        np.array(7.5, dtype=np.float16),
    ],
    ids=lambda a: f"{a.dtype.str}{list(a.shape)}",
)
def test_numpy_array_round_trips_through_shm(array: np.ndarray) -> None:
    handle = pack_array(array, threshold=0)
    assert isinstance(handle, ShmHandle) and handle.kind == "ndarray"
    assert handle.dtype == array.dtype.str
    out = unpack(handle)
    assert isinstance(out, np.ndarray)
    assert out.dtype == array.dtype and out.shape == array.shape
    assert out.tobytes() == array.tobytes()


def test_object_and_structured_arrays_are_rejected() -> None:
    with pytest.raises(TypeError, match="object"):
        pack_array(np.array([{"a": 1}, None], dtype=object), threshold=0)
    with pytest.raises(TypeError, match="structured"):
        pack_array(np.zeros(3, dtype=[("x", "f4"), ("y", "i2")]), threshold=0)


def test_image_round_trips_through_shm() -> None:
    rng = np.random.default_rng(2)
    image = Image.fromarray(rng.integers(0, 256, (600, 700, 3), dtype=np.uint8))
    handle = pack_image(image)
    assert isinstance(handle, ShmHandle)
    assert (handle.kind, handle.dtype, handle.shape) == ("image", "RGB", (700, 600))
    out = unpack(handle)
    assert isinstance(out, Image.Image)
    assert out.mode == "RGB" and out.size == image.size and out.tobytes() == image.tobytes()


def test_unsupported_tensors_are_rejected_clearly() -> None:
    with pytest.raises(TypeError, match="meta"):
        pack_tensor(torch.empty(4, device="meta"), threshold=0)
    with pytest.raises(TypeError, match="sparse"):
        pack_tensor(torch.eye(3).to_sparse(), threshold=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensor_is_moved_to_cpu() -> None:
    t = torch.randn(64, 64, device="cuda").to(torch.bfloat16)
    out = unpack(to_shm(t))
    assert isinstance(out, torch.Tensor)
    assert_tensor_identical(t, out)


# --- threshold ----------------------------------------------------------------------------


def test_exactly_at_threshold_stays_inline_one_more_byte_goes_to_shm() -> None:
    assert DEFAULT_SHM_THRESHOLD == 1_000_000
    at = torch.zeros(DEFAULT_SHM_THRESHOLD // 4, dtype=torch.float32)
    assert isinstance(pack_tensor(at), torch.Tensor)
    over = torch.zeros(DEFAULT_SHM_THRESHOLD + 1, dtype=torch.uint8)
    handle = pack_tensor(over)
    assert isinstance(handle, ShmHandle) and handle.nbytes == DEFAULT_SHM_THRESHOLD + 1
    discard(handle)

    a_at = np.zeros(DEFAULT_SHM_THRESHOLD, dtype=np.uint8)
    assert pack_array(a_at) is a_at
    a_over = np.zeros(DEFAULT_SHM_THRESHOLD + 1, dtype=np.uint8)
    handle = pack_array(a_over)
    assert isinstance(handle, ShmHandle)
    discard(handle)


def test_inline_tensor_is_returned_detached_on_cpu() -> None:
    t = torch.randn(3, requires_grad=True)
    inline = pack_tensor(t, threshold=100)
    assert isinstance(inline, torch.Tensor) and not inline.requires_grad
    assert inline.data_ptr() == t.data_ptr()  # no copy on the inline path


def test_empty_view_of_big_storage_stays_inline() -> None:
    # Nothing to copy, so no zero-byte segment.
    empty = torch.zeros(DEFAULT_SHM_THRESHOLD)[:0]
    assert isinstance(pack_tensor(empty), torch.Tensor)


def test_bad_threshold_is_rejected() -> None:
    with pytest.raises(ValueError, match="threshold"):
        pack_tensor(torch.zeros(1), threshold=-1)


# --- segment lifecycle --------------------------------------------------------------------


def test_segment_is_owner_only_while_it_exists() -> None:
    old = os.umask(0)  # a permissive umask must not widen the mode
    try:
        handle = to_shm(torch.ones(4))
    finally:
        os.umask(old)
    assert handle.name.startswith(SHM_PREFIX) and handle.name in list_our_segments()
    assert segment_mode(handle.name) == 0o600
    assert os.stat(f"/dev/shm/{handle.name}").st_uid == os.getuid()
    unpack(handle)


def test_unpack_unlinks_and_second_unpack_fails_cleanly() -> None:
    handle = to_shm(torch.ones(4))
    unpack(handle)
    assert handle.name not in list_our_segments()
    with pytest.raises(FileNotFoundError, match="already consumed"):
        unpack(handle)
    assert discard(handle) is False


def test_discard_unlinks_without_reading_and_twice_is_harmless() -> None:
    handle = to_shm(torch.ones(4))
    assert discard(handle) is True
    assert handle.name not in list_our_segments()
    assert discard(handle) is False
    assert unlink_segment(handle.name) is False


def test_forged_handle_is_rejected_and_segment_still_unlinked() -> None:
    handle = to_shm(torch.ones(4))
    forged = ShmHandle(handle.name, "tensor", "float32", (5,), 20)  # claims more than exists
    with pytest.raises(ValueError, match="holds 16 bytes"):
        unpack(forged)
    assert handle.name not in list_our_segments()
    handle = to_shm(torch.ones(4))
    with pytest.raises(ValueError, match="dtype"):
        unpack(ShmHandle(handle.name, "tensor", "no_such_dtype", (4,), 16))
    assert handle.name not in list_our_segments()


def test_handle_is_plain_msgpack_data_and_validates_names() -> None:
    handle = ShmHandle(f"{SHM_PREFIX}w0_{'a' * 32}", "tensor", "bfloat16", (2, 3), 12)
    wire = msgpack.unpackb(msgpack.packb(handle.to_wire()))
    assert ShmHandle.from_wire(wire) == handle
    for bad in ("../etc/passwd", "omni_trio_", f"other_{'a' * 32}", f"{SHM_PREFIX}{'a' * 31}"):
        with pytest.raises(ValueError, match="segment name"):
            ShmHandle(bad, "tensor", "float32", (1,), 4)
    with pytest.raises(ValueError, match="malformed"):
        ShmHandle.from_wire(["x"])
    with pytest.raises(ValueError, match="kind"):
        ShmHandle(handle.name, "pickle", "float32", (1,), 4)  # type: ignore[arg-type]


# --- registry -----------------------------------------------------------------------------


def test_registry_tracks_created_until_consumed() -> None:
    registry = SegmentRegistry("w0")
    handle = to_shm(torch.ones(4), registry=registry)
    assert handle.name.startswith(f"{SHM_PREFIX}w0_")
    assert handle.name in registry and len(registry) == 1
    unpack(handle, registry=registry)
    assert len(registry) == 0


def test_registry_unlink_all_cleans_up_after_a_crashed_peer() -> None:
    registry = SegmentRegistry()
    handles = [to_shm(torch.full((8,), float(i)), registry=registry) for i in range(3)]
    unpack(handles[0])  # consumed by the peer; the registry does not know
    removed = registry.unlink_all()
    assert sorted(removed) == sorted(h.name for h in handles[1:])
    assert len(registry) == 0 and not set(list_our_segments()) & {h.name for h in handles}
    assert registry.unlink_all() == []


def test_registry_sweep_unlinks_segments_the_dead_peer_created() -> None:
    worker_side = SegmentRegistry("w1")
    bystander = to_shm(torch.ones(2), registry=SegmentRegistry("w2"))
    names = {to_shm(torch.ones(2), registry=worker_side).name for _ in range(2)}
    executor_side = SegmentRegistry("w1")  # same tag, other process in real life
    assert set(executor_side.sweep()) == names
    assert bystander.name in list_our_segments()
    discard(bystander)
    with pytest.raises(ValueError, match="tagged"):
        SegmentRegistry().sweep()
    with pytest.raises(ValueError, match="outside"):
        sweep_segments("/")
    with pytest.raises(ValueError, match="tag"):
        SegmentRegistry("Bad-Tag")
    worker_side.unlink_all()


def test_sweep_orphans_unlinks_the_segments_of_dead_owners_only() -> None:
    """A SIGKILLed engine cleans nothing up; its segments carry its owner tag (pid and start
    time), so the next start removes them, and never a live owner's or an untagged one."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_tag = owner_tag(dead.pid)
    dead.wait()
    mine = to_shm(torch.ones(2), registry=SegmentRegistry(f"{owner_tag()}w0ab"))
    # A live pid whose start time differs: the pid was reused by another process.
    reused = to_shm(torch.ones(2), registry=SegmentRegistry(f"o{os.getpid()}x1w0ab"))
    orphans = {
        to_shm(torch.ones(2), registry=SegmentRegistry(f"{dead_tag}w{rank}ab")).name
        for rank in range(2)
    }
    untagged = to_shm(torch.ones(2))
    try:
        assert owner_tag() == owner_tag(os.getpid()) and owner_tag().startswith(f"o{os.getpid()}x")
        removed = set(sweep_orphans())
        assert removed == orphans | {reused.name}
        left = set(list_our_segments())
        assert mine.name in left and untagged.name in left
        assert sweep_orphans() == []
    finally:
        for handle in (mine, untagged):
            discard(handle)


def test_a_leak_check_counts_this_processs_segments_and_untagged_ones_only() -> None:
    """Another engine on the machine (another owner tag, live or dead) never counts as ours;
    a segment nothing can attribute (no owner tag) does."""
    mine = to_shm(torch.ones(2), registry=SegmentRegistry(f"{owner_tag()}e0ab"))
    other = to_shm(torch.ones(2), registry=SegmentRegistry(f"{owner_tag(os.getppid())}w0ab"))
    untagged = to_shm(torch.ones(2))
    try:
        ours = set(segments_of_this_process())
        assert {mine.name, untagged.name} <= ours
        assert other.name not in ours and other.name in set(list_our_segments())
    finally:
        for handle in (mine, other, untagged):
            discard(handle)


def test_owner_of_names_a_live_owner_only() -> None:
    """``owner_of``: the pid of a segment's live owner; None untagged, or when the tag's
    process is gone or its pid now names a process started at another time."""
    mine = to_shm(torch.ones(2), registry=SegmentRegistry(f"{owner_tag()}e0ab"))
    parent = to_shm(torch.ones(2), registry=SegmentRegistry(f"{owner_tag(os.getppid())}w0ab"))
    reused = to_shm(torch.ones(2), registry=SegmentRegistry(f"o{os.getpid()}x1e0ab"))
    untagged = to_shm(torch.ones(2))
    try:
        assert owner_of(mine.name) == os.getpid()
        assert owner_of(parent.name) == os.getppid()
        assert owner_of(reused.name) is None  # same pid, another start time
        assert owner_of(untagged.name) is None
    finally:
        for handle in (mine, parent, reused, untagged):
            discard(handle)


def test_registry_prunes_consumed_names() -> None:
    registry = SegmentRegistry()
    handles = [to_shm(torch.ones(1), registry=registry) for _ in range(10)]
    for handle in handles:
        unpack(handle)  # the receiver never tells the creator's registry
    assert len(registry) == 10
    assert registry.prune() == 10 and len(registry) == 0
    for _ in range(200):  # register() prunes on its own as the registry grows
        unpack(to_shm(torch.ones(1), registry=registry))
    assert len(registry) <= 64
    assert registry.forget("omni_trio_gone") is False


def test_full_dev_shm_raises_oserror_and_leaves_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    registry = SegmentRegistry()
    with pytest.raises(OSError, match="cannot reserve 16 bytes") as info:
        to_shm(torch.ones(4), registry=registry)
    assert info.value.errno == errno.ENOSPC
    assert len(registry) == 0
