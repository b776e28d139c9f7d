"""The wire codec: every message type round-trips, tuples stay tuples, big payloads use shm."""

from __future__ import annotations

import dataclasses
import enum
import multiprocessing
import statistics
import struct
import threading
import time
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from omni_trio._core.lifecycle import RequestStatus
from omni_trio._core.messages import (
    AsyncOutput,
    AsyncOutputKind,
    BatchRunnerOutput,
    DiffusionOutput,
    Heartbeat,
    NewRequestData,
    RequestMetrics,
    RunnerOutput,
    SchedulerOutput,
    WorkerAbort,
    WorkerCall,
)
from omni_trio._core.request import DiffusionRequest, SamplingParams
from omni_trio.ipc import (
    MESSAGE_TYPES,
    Decoder,
    Encoder,
    SegmentRegistry,
    ShmHandle,
    decode,
    discard,
    discard_message,
    encode,
    list_our_segments,
)

from ._child import child_latents, encode_in_child

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)


def assert_same(a: Any, b: Any) -> None:
    """Deep equality that also checks container types and compares images by pixels."""
    assert type(a) is type(b) or (isinstance(a, torch.Tensor) and type(b) is torch.Tensor), (
        f"{type(a)} != {type(b)}"
    )
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    elif isinstance(a, Image.Image):
        assert (a.mode, a.size, a.tobytes()) == (b.mode, b.size, b.tobytes())
        assert a.getpalette() == b.getpalette()
    elif dataclasses.is_dataclass(a):
        for field in dataclasses.fields(a):
            assert_same(getattr(a, field.name), getattr(b, field.name))
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    else:
        assert a == b


def round_trip(obj: Any, **encoder_kw: Any) -> Any:
    return Decoder().decode(Encoder(**encoder_kw).encode(obj))


def rgb(width: int = 64, height: int = 64, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


REQUEST = DiffusionRequest(
    "a red fox in snow",
    SamplingParams(
        height=512,
        width=768,
        num_inference_steps=4,
        guidance_scale=3.5,
        negative_prompt="blurry",
        seed=2**63 - 1,
        num_outputs_per_prompt=2,
        output_type="np",
        timesteps=(999.0, 750.5, 500.0, 1.0),
        sigmas=(1.0, 0.5),
        extra_args={"strength": 0.8, "ids": [1, 2], "pair": (1, "a"), "none": None},
    ),
    request_id="req-1",
    condition_key=("canny", 512, (1, 2)),
)

PLAIN_MESSAGES = [
    REQUEST,
    DiffusionRequest("defaults", request_id="r0"),
    REQUEST.sampling,
    NewRequestData("req-1", REQUEST),
    SchedulerOutput(
        step_id=7,
        scheduled_new_reqs=(NewRequestData("req-1", REQUEST),),
        scheduled_cached_reqs=("r2", "r3"),
        finished_req_ids=frozenset({"r4", "r5"}),
        num_running_reqs=3,
        num_waiting_reqs=1,
    ),
    SchedulerOutput(step_id=0),
    RunnerOutput.from_exception("r9", RuntimeError("boom"), finished=True),
    RunnerOutput("r8", aborted=True, finished=False, step_index=3),
    RunnerOutput("r7", async_output_id="out-1", timings={"forward_ms": 12.5}),
    AsyncOutput(AsyncOutputKind.COMPUTE_DONE, rpc_id="rpc-1", async_output_id="out-1"),
    AsyncOutput(AsyncOutputKind.RPC_RESULT, rpc_id="rpc-2", result={"loras": ["a", "b"]}),
    AsyncOutput(AsyncOutputKind.RPC_RESULT, rpc_id="rpc-3", error="no", error_type="KeyError"),
    # The process-group wire protocol: a call, an abort, a reply, a heartbeat.
    WorkerCall("g-1", "execute_scheduler_output", (SchedulerOutput(step_id=1),), {"rpc_id": "g-1"}),
    WorkerCall("g-2", "describe", reply_rank=None),
    WorkerAbort(("r1", "r2")),
    WorkerAbort(everything=True),
    AsyncOutput(
        AsyncOutputKind.RPC_RESULT,
        rpc_id="g-3",
        error="device broke",
        error_type="DeviceFaultError",
        traceback="Traceback ...",
        rank=1,
        steps=40,
        fatal=True,
    ),
    Heartbeat(rank=0, steps=12, progress={"r1": (3, 20)}, packer_alive=False),
    RequestMetrics(1.0, 2.0, 3.0, 6.5),
    *RequestStatus,
    *AsyncOutputKind,
]


def test_every_message_type_is_registered() -> None:
    assert set(MESSAGE_TYPES) == {
        AsyncOutput,
        AsyncOutputKind,
        BatchRunnerOutput,
        DiffusionOutput,
        DiffusionRequest,
        Heartbeat,
        NewRequestData,
        RequestMetrics,
        RequestStatus,
        RunnerOutput,
        SamplingParams,
        SchedulerOutput,
        WorkerAbort,
        WorkerCall,
    }


@pytest.mark.parametrize("message", PLAIN_MESSAGES, ids=lambda m: type(m).__name__)
def test_plain_message_round_trips_equal(message: Any) -> None:
    out = round_trip(message)
    assert out == message
    assert_same(message, out)


def test_tuples_stay_tuples_where_dataclasses_need_them() -> None:
    out = round_trip(REQUEST)
    assert type(out.sampling.timesteps) is tuple and type(out.sampling.sigmas) is tuple
    assert type(out.condition_key) is tuple and type(out.condition_key[2]) is tuple
    assert type(out.sampling.extra_args["ids"]) is list
    assert type(out.sampling.extra_args["pair"]) is tuple
    hash(out.condition_key)  # still usable in a compatibility key
    sched = round_trip(PLAIN_MESSAGES[4])
    assert type(sched.finished_req_ids) is frozenset
    assert type(sched.scheduled_new_reqs) is tuple and type(sched.scheduled_cached_reqs) is tuple
    assert type(round_trip(RequestStatus.RUNNING)) is RequestStatus


def test_generic_containers_pass_through() -> None:
    value = {
        "none": None,
        "flags": [True, False],
        "ints": [0, -1, 2**64 - 1, -(2**63)],
        "floats": [0.5, float("inf")],
        "text": "ünïcode",
        "blob": b"\x00\xff",
        "nested": [(), ((1,),), {"t": (1, [2, (3,)])}, [[]]],
        "empty": {},
        "sets": [{1, 2}, frozenset({"a"})],
    }
    assert_same(value, round_trip(value))


def test_images_of_every_kind_round_trip_in_a_runner_output() -> None:
    palette = Image.new("P", (8, 8))
    palette.putpalette([i % 256 for i in range(768)])
    palette.putpixel((1, 1), 200)
    images = (
        rgb(),
        rgb().convert("L"),
        rgb().convert("RGBA"),
        rgb().convert("1"),
        palette,
        np.random.default_rng(3).random((2, 64, 64, 3)).astype(np.float32),
        torch.randn(1, 3, 64, 64).to(torch.bfloat16),
        torch.randint(0, 255, (3, 8, 8), dtype=torch.uint8).permute(1, 2, 0),
        np.float32(0.25),
        np.int64(-3),
    )
    message = RunnerOutput("r1", images=images, timings={"forward_ms": 1.0})
    out = round_trip(message)
    assert_same(message, out)
    assert type(out.images[-1]) is np.int64


def test_batch_and_async_outputs_round_trip_by_id() -> None:
    batch = BatchRunnerOutput.from_list(
        [
            RunnerOutput("b", images=(rgb(seed=1),)),
            RunnerOutput("a", images=(rgb(seed=2),), step_index=2, finished=False),
            RunnerOutput.from_exception("c", ValueError("bad")),
        ]
    )
    message = AsyncOutput(AsyncOutputKind.OUTPUT_READY, async_output_id="x", result=batch)
    out = round_trip(message)
    assert_same(message, out)
    assert out.result.request_ids == ("b", "a", "c")


def test_diffusion_output_round_trips() -> None:
    message = DiffusionOutput(
        "req-1",
        RequestStatus.FINISHED_COMPLETED,
        images=(rgb(), np.zeros((4, 4), dtype=np.uint8)),
        seed=42,
        chunk_index=1,
        total_chunks=2,
        metrics=RequestMetrics(queue_wait_ms=1.5, e2e_ms=9.0),
    )
    out = round_trip(message)
    assert_same(message, out)
    assert out.ok and out.status is RequestStatus.FINISHED_COMPLETED


# --- shared memory through the codec ------------------------------------------------------


def handles_in(data: bytes) -> list[ShmHandle]:
    """The shm handles ``data`` names, in order, without touching the segments."""
    found: list[ShmHandle] = []

    def hook(code: int, raw: memoryview) -> None:
        if code == 5:
            found.append(ShmHandle.from_wire(msgspec.msgpack.decode(raw)))

    msgspec.msgpack.Decoder(ext_hook=hook).decode(data)
    return found


def test_large_payloads_travel_by_shm_and_are_unlinked_on_decode() -> None:
    registry = SegmentRegistry("t")
    latents = torch.randn(2, 4, 32, 32)  # 32 KiB
    image = rgb(64, 64)  # 12 KiB raw
    message = RunnerOutput("r1", images=(latents[1], image, np.ones((64, 64))))
    data = Encoder(shm_threshold=10_000, registry=registry).encode(message)
    assert len(data) < 2_000  # only handles travel
    assert len(registry) == 3 and set(list_our_segments()) >= registry.names()
    out = Decoder(registry=registry).decode(data)
    assert_same(message, out)
    assert len(registry) == 0 and not set(list_our_segments()) & registry.names()


def test_a_request_carries_its_picture_and_mask_inline_or_by_shm() -> None:
    # A picture and a mask are part of the request that goes to every worker (image-to-image,
    # inpainting); big ones take shared memory like any payload, and the segments are gone
    # once the worker decoded the message.
    picture = rgb(32, 24)
    mask = np.zeros((24, 32), np.uint8)
    sampling = SamplingParams(image=picture, mask_image=mask, strength=0.6)
    message = NewRequestData("req-1", DiffusionRequest("p", sampling, "req-1"))
    out = round_trip(message)
    assert_same(message, out)
    assert out.request.sampling.conditioning == "inpaint"
    registry = SegmentRegistry("t")
    big = SamplingParams(image=rgb(256, 256), mask_image=np.zeros((256, 256), np.uint8))
    data = Encoder(shm_threshold=10_000, registry=registry).encode(big)
    assert len(registry) == 2 and len(data) < 2_000  # only handles travel
    decoded = Decoder(registry=registry).decode(data)
    assert_same(big, decoded)
    assert len(registry) == 0 and not set(list_our_segments()) & registry.names()


def test_encoder_threshold_is_exclusive_and_none_disables_shm() -> None:
    registry = SegmentRegistry()
    encoder = Encoder(shm_threshold=4096, registry=registry)
    at = encoder.encode(torch.zeros(1024))  # exactly 4096 bytes: inline
    assert len(registry) == 0 and handles_in(at) == []
    over = encoder.encode(np.zeros(4097, dtype=np.uint8))
    assert len(registry) == 1 and len(handles_in(over)) == 1
    Decoder().decode(over)
    big = torch.randn(600, 600)
    inline = Encoder(shm_threshold=None).encode(big)
    assert handles_in(inline) == [] and len(inline) > big.numel() * 4
    assert_same(big, Decoder().decode(inline))
    registry.unlink_all()


def test_cross_process_child_creates_parent_consumes() -> None:
    ctx = multiprocessing.get_context("spawn")
    parent_end, child_end = ctx.Pipe(duplex=False)
    child = ctx.Process(target=encode_in_child, args=(child_end, 1000))
    child.start()
    child_end.close()
    try:
        data = parent_end.recv_bytes()
        names = parent_end.recv()
    finally:
        child.join(30)
    assert child.exitcode == 0
    # The child has exited; its segment survived (no resource tracker unlinked it).
    assert len(names) == 1 and names[0].startswith("omni_trio_child_")
    assert names[0] in list_our_segments()
    out = Decoder().decode(data)
    assert names[0] not in list_our_segments()
    expected = RunnerOutput("r1", images=(child_latents(),), timings={"forward_ms": 2.0})
    assert_same(expected, out)


def test_discard_message_unlinks_every_segment_once() -> None:
    encoder = Encoder(shm_threshold=100)
    data = encoder.encode([torch.ones(100), {"x": (np.ones(50),)}, rgb(16, 16), rgb(2, 2)])
    assert len(handles_in(data)) == 2
    assert discard_message(data) == 3
    assert discard_message(data) == 0
    with pytest.raises(FileNotFoundError):
        Decoder().decode(data)


def test_failed_encode_unlinks_what_it_created() -> None:
    registry = SegmentRegistry()
    encoder = Encoder(shm_threshold=100, registry=registry)
    with pytest.raises(TypeError, match=r"builtins\.object"):
        encoder.encode([torch.ones(100), torch.ones(100), object()])
    assert len(registry) == 0


def test_failed_decode_still_unlinks_every_segment() -> None:
    data = Encoder(shm_threshold=100).encode([torch.ones(100), torch.ones(100), torch.ones(100)])
    first, second, third = handles_in(data)
    discard(second)  # as if consumed already
    with pytest.raises(FileNotFoundError):
        Decoder().decode(data)
    assert not {first.name, third.name} & set(list_our_segments())


# --- errors -------------------------------------------------------------------------------


class Color(enum.Enum):
    RED = 1


@dataclasses.dataclass(frozen=True)
class Ping:
    payload: tuple[int, ...]


def test_unknown_types_raise_type_error_naming_the_type() -> None:
    encoder = Encoder()
    for value, name in [
        (object(), "builtins.object"),
        ({"c": Color.RED}, "Color"),
        (Ping((1,)), "Ping"),
        (bytearray(b"x"), "bytearray"),
        (np.array([None], dtype=object), "object"),
    ]:
        with pytest.raises(TypeError, match=name):
            encoder.encode(value)
    with pytest.raises(TypeError, match="keys must be str"):
        encoder.encode({1: "a"})


def test_extra_types_round_trip_when_both_sides_know_them() -> None:
    data = Encoder(extra_types=[Ping, Color]).encode([Ping((1, 2)), Color.RED])
    assert Decoder(extra_types=[Ping, Color]).decode(data) == [Ping((1, 2)), Color.RED]
    with pytest.raises(ValueError, match="unknown message type 'Ping'"):
        Decoder().decode(data)
    with pytest.raises(TypeError, match="neither"):
        Encoder(extra_types=[int])


def test_malformed_data_raises_value_error() -> None:
    encoder = msgspec.msgpack.Encoder()
    huge = encoder.encode(["float32", [2**40, 2**20]])
    bad_messages = [
        b"\xc1",  # never used in msgpack
        encoder.encode({7: []}),  # unknown tag
        encoder.encode({3: ["RequestMetrics", {"nope": 1}]}),  # unknown field
        encoder.encode({3: ["NewRequestData", {"request_id": "a", "request": None}]}),
        encoder.encode(msgspec.msgpack.Ext(1, b"\x00")),  # truncated array ext
        encoder.encode(msgspec.msgpack.Ext(5, encoder.encode(["/etc/x", "tensor", "u8", [], 1]))),
        encoder.encode(msgspec.msgpack.Ext(99, b"")),
        encoder.encode({4: ["RequestMetrics", 1.0]}),  # a dataclass is not an enum
        encoder.encode({3: ["RequestStatus", {}]}),
        # A header asking for a huge tensor is refused before anything is allocated.
        encoder.encode(msgspec.msgpack.Ext(2, struct.pack("<I", len(huge)) + huge + bytes(8))),
    ]
    for data in bad_messages:
        with pytest.raises(ValueError):
            Decoder().decode(data)


# --- speed --------------------------------------------------------------------------------


def test_a_64x64_image_message_codes_well_under_a_millisecond() -> None:
    message = AsyncOutput(
        AsyncOutputKind.OUTPUT_READY,
        async_output_id="x",
        result=BatchRunnerOutput.from_list([RunnerOutput("r1", images=(rgb(),))]),
    )
    encoder, decoder = Encoder(), Decoder()
    samples = []
    for _ in range(200):
        start = time.perf_counter()
        decoder.decode(encoder.encode(message))
        samples.append(time.perf_counter() - start)
    assert statistics.median(samples) < 1e-3


def test_module_level_encode_decode_use_one_codec_per_thread() -> None:
    message = {"op": "call", "id": 3, "args": (1, "x"), "kwargs": {"seed": 2}}
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(decode(encode(message))))
    thread.start()
    thread.join()
    assert_same(message, decode(encode(message)))
    assert_same(message, results[0])
    big = decode(encode(torch.zeros(300_000)))  # 1.2 MB: default threshold, via shm
    assert big.shape == (300_000,)
