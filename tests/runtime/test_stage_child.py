"""The stage process's side (``serve_stage``), run in this process over a socketpair: the
test speaks the wire protocol as the caller would (``builtin:echo``, inproc backend)."""

from __future__ import annotations

import pickle
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from omni_trio import (
    DiffusionRequest,
    EngineConfig,
    InvalidConfigError,
    InvalidRequestError,
    SamplingParams,
)
from omni_trio._core.lifecycle import RequestStatus
from omni_trio.errors import PayloadError
from omni_trio.models import decode_echo_image
from omni_trio.runtime.stage_child import serve_stage
from omni_trio.runtime.stage_wire import FrameReader, decode_error, frame

CAP_S = 30.0


class Caller:
    """The caller's end: send messages, read them (skipping ``state`` unless asked)."""

    def __init__(self, sock: socket.socket) -> None:
        self.stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        self.reader = FrameReader(self.stream)
        self.states: list[dict[str, Any]] = []

    async def send(self, *message: Any) -> None:
        await self.stream.send_all(frame(message))

    async def submit(self, key: int, rid: str, params: SamplingParams) -> None:
        request = DiffusionRequest("a prompt", params, rid)
        await self.send("submit", key, rid, pickle.dumps(request))

    async def call(self, call_id: int, method: str, *args: Any) -> tuple[bool, Any]:
        await self.send("call", call_id, method, pickle.dumps((args, {})))
        _, got, ok, payload = await self.next("reply")
        assert got == call_id
        value = pickle.loads(payload)
        return ok, value if ok else decode_error(value)

    async def output(self) -> tuple[int, Any]:
        _, key, payload = await self.next("out")
        return key, pickle.loads(payload)

    async def rejected(self) -> tuple[int, BaseException]:
        _, key, payload = await self.next("rejected")
        return key, decode_error(pickle.loads(payload))

    async def next(self, *kinds: str) -> tuple[Any, ...]:
        """The next message of one of ``kinds``; ``state`` messages on the way are kept."""
        while True:
            message = await self.reader.receive()
            assert message is not None, "the stage closed its end"
            if message[0] == "state":
                self.states.append(message[1])
            if message[0] in kinds:
                return message

    async def until_state(self, predicate: Any) -> dict[str, Any]:
        while True:
            _, state = await self.next("state")
            if predicate(state):
                return state


@asynccontextmanager
async def stage(cache_dir: Path, **overrides: Any) -> AsyncIterator[tuple[Caller, trio.Event]]:
    ours, theirs = socket.socketpair()
    done = trio.Event()

    async def child() -> None:
        try:
            await serve_stage(theirs)
        finally:
            done.set()

    config = EngineConfig(
        model="builtin:echo", cache_dir=str(cache_dir), torch_threads=1, **overrides
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(child)
        caller = Caller(ours)
        await caller.send("open", config)
        try:
            yield caller, done
        finally:
            await caller.stream.aclose()
            with trio.fail_after(CAP_S):
                await done.wait()


def params(**kw: Any) -> SamplingParams:
    kw.setdefault("height", 32)
    kw.setdefault("width", 32)
    kw.setdefault("num_inference_steps", 3)
    return SamplingParams(**kw)


async def test_ready_then_outputs_then_closed(cache_dir: Path) -> None:
    with trio.fail_after(CAP_S):
        async with stage(cache_dir, warmup=False) as (caller, done):
            _, info, state = await caller.next("ready", "failed")
            assert info.name == "builtin:echo"
            assert state["health"].healthy and state["requests"] == {}
            await caller.submit(1, "r1", params(seed=7))
            key, out = await caller.output()
            assert key == 1
            assert out.finished and out.status is RequestStatus.FINISHED_COMPLETED
            assert decode_echo_image(out.images[0]) == ("r1", 7, 0)
            # The snapshot before a terminal output already counts it.
            assert caller.states[-1]["statistics"].finished_completed == 1
            await caller.send("close")
            _, final = await caller.next("closed")
            assert final["closed"]
            await done.wait()


async def test_an_engine_that_cannot_open_says_failed_with_its_error(cache_dir: Path) -> None:
    with trio.fail_after(CAP_S):
        async with stage(cache_dir, warmup=False, model_options={"nope": 1}) as (caller, done):
            _, error = await caller.next("ready", "failed")
            assert isinstance(decode_error(error), InvalidConfigError)
            await done.wait()


async def test_a_refused_request_is_rejected_with_its_typed_error(cache_dir: Path) -> None:
    with trio.fail_after(CAP_S):
        async with stage(cache_dir, warmup=False) as (caller, _):
            await caller.next("ready")
            # builtin:echo takes no LoRA adapter: only the engine can tell.
            await caller.submit(1, "r1", params(lora=(("style", 1.0),)))
            key, error = await caller.rejected()
            assert key == 1 and isinstance(error, InvalidRequestError)
            # Something that is not a request: refused, typed, that submission alone.
            await caller.send("submit", 2, "r2", pickle.dumps("not a request"))
            key, error = await caller.rejected()
            assert key == 2 and isinstance(error, PayloadError)
            await caller.send("submit", 3, "r3", b"\x80\x05garbage")
            key, error = await caller.rejected()
            assert key == 3 and isinstance(error, PayloadError)
            # The same id is free again, and the stage still serves.
            await caller.submit(4, "r1", params(seed=1))
            key, out = await caller.output()
            assert key == 4 and out.ok


async def test_gone_aborts_the_request_as_a_consumer_that_left(cache_dir: Path) -> None:
    with trio.fail_after(CAP_S):
        async with stage(cache_dir, warmup=False, model_options={"step_delay_s": 0.05}) as (
            caller,
            _,
        ):
            await caller.next("ready")
            await caller.submit(1, "slow", params(num_inference_steps=200))
            await caller.until_state(
                lambda s: s["requests"].get("slow", (None,))[0] is RequestStatus.RUNNING
            )
            await caller.send("gone", 1)
            state = await caller.until_state(lambda s: s["statistics"].finished_aborted == 1)
            assert "slow" not in state["requests"]
            assert state["statistics"].running == 0


async def test_calls_run_on_the_engine_and_unknown_ones_are_refused(cache_dir: Path) -> None:
    with trio.fail_after(CAP_S):
        async with stage(cache_dir, warmup=False) as (caller, _):
            await caller.next("ready")
            ok, value = await caller.call(1, "sleep", 1)
            assert ok and isinstance(value, list)
            # The snapshot sent before the answer already says so.
            assert caller.states[-1]["sleeping"]
            ok, _ = await caller.call(2, "wake_up")
            assert ok
            ok, error = await caller.call(3, "aclose")
            assert not ok and isinstance(error, InvalidConfigError)
            ok, error = await caller.call(4, "collective_rpc", "no_such_method")
            assert not ok and isinstance(error, AttributeError)  # as the engine raised it
            assert "no_such_method" in str(error)


async def test_a_caller_that_goes_away_closes_the_engine(cache_dir: Path) -> None:
    with trio.fail_after(CAP_S):
        async with stage(cache_dir, warmup=False, model_options={"step_delay_s": 0.05}) as (
            caller,
            done,
        ):
            await caller.next("ready")
            await caller.submit(1, "slow", params(num_inference_steps=200))
            await caller.until_state(lambda s: "slow" in s["requests"])
            await caller.stream.aclose()  # as if the caller died: the socket closes
            await done.wait()  # the engine closed and serve_stage returned


@pytest.mark.parametrize("kind", ["nonsense"])
async def test_an_unknown_message_ends_the_stage(cache_dir: Path, kind: str) -> None:
    with trio.fail_after(CAP_S), pytest.raises(ValueError, match="unknown stage message"):
        async with stage(cache_dir, warmup=False) as (caller, _):
            await caller.next("ready")
            await caller.send(kind)
