"""``GroupExecutor`` over a fake transport: real workers (echo) in threads of this process, so
the executor's own rules can be driven exactly (held replies, a payload one rank refuses)
without starting processes.  The process backends run the same executor (tests/executors/
test_data_parallel.py, test_group_conformance.py).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from omni_trio import AsyncEngine, EngineConfig, SamplingParams, open_engine
from omni_trio._core.health import WorkerStatus
from omni_trio._core.lifecycle import RequestStatus
from omni_trio._core.messages import (
    AsyncOutput,
    NewRequestData,
    SchedulerOutput,
    WorkerAbort,
    WorkerCall,
)
from omni_trio._core.request import DiffusionRequest
from omni_trio.config import EngineConfig as _Config
from omni_trio.executors.base import open_executor
from omni_trio.executors.group import (
    STARTED,
    Deliver,
    GroupExecutor,
    RankInit,
    RankStarted,
    RankStatus,
    Transport,
)
from omni_trio.models.echo import ECHO_STEP_DELAY_S, decode_echo_image
from omni_trio.testing.faults import Fault, FaultSpec, with_faults
from omni_trio.worker.host import WorkerHost
from omni_trio.worker.worker import Worker

CAP_S = 30.0
S = RequestStatus
UNSENDABLE = "cannot be encoded"


class FakeThreadTransport(Transport):
    """A fake transport: each rank a real :class:`Worker` behind a :class:`WorkerHost` in a
    thread of this process.  ``hold`` keeps replies back until released; a call whose
    payload names :data:`UNSENDABLE` raises on send, as a codec would; ``gate``, when set to
    an event, holds every rank that starts from then on until it is set."""

    heartbeats = False

    def __init__(self) -> None:
        self.hosts: dict[int, WorkerHost] = {}
        self.inboxes: dict[int, trio.MemorySendChannel[WorkerCall]] = {}
        self.gone: dict[int, trio.Event] = {}
        self.hold = trio.Event()
        self.hold.set()  # replies flow unless a test clears it
        self.gate: trio.Event | None = None
        self.starts = 0
        self.killed: set[int] = set()  # a killed rank sends nothing more
        self.held: dict[int, trio.Event] = {}  # rank -> its replies wait for this event
        self.sent: list[tuple[int, str, int]] = []  # (rank, method, starts so far)

    @asynccontextmanager
    async def open(self, config: _Config, fail: Callable[[BaseException], None]) -> Any:
        yield

    async def serve_rank(
        self, init: RankInit, deliver: Deliver, *, task_status: RankStatus = STARTED
    ) -> None:
        if self.gate is not None:
            await self.gate.wait()
        self.starts += 1
        self.killed.discard(init.rank)
        token = trio.lowlevel.current_trio_token()
        worker = Worker(
            _Config.from_dict(init.config),
            rank=init.rank,
            world_size=init.world_size,
            data_parallel_size=init.data_parallel_size,
        )
        host = WorkerHost(worker, lambda m: token.run_sync_soon(deliver, m))
        info = await trio.to_thread.run_sync(host.start)
        send, receive = trio.open_memory_channel[WorkerCall](math.inf)
        self.hosts[init.rank], self.inboxes[init.rank] = host, send
        self.gone[init.rank] = trio.Event()
        task_status.started(RankStarted(pid=None, model_info=info.to_dict()))
        try:
            async with receive:
                async for call in receive:
                    reply: AsyncOutput = await trio.to_thread.run_sync(host.call, call)
                    await self.hold.wait()
                    held = self.held.get(init.rank)
                    if held is not None:
                        await held.wait()
                    if init.rank in self.killed:
                        break
                    deliver(reply)
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(host.shutdown)
            self.gone[init.rank].set()

    def send(self, rank: int, message: WorkerCall | WorkerAbort) -> None:
        if isinstance(message, WorkerAbort):
            self.hosts[rank].abort(message)
            return
        if UNSENDABLE in repr(message.args):
            raise TypeError("a payload this codec cannot carry")
        self.sent.append((rank, message.method, self.starts))
        self.inboxes[rank].send_nowait(message)

    def kill(self, rank: int) -> None:
        self.killed.add(rank)
        self.inboxes[rank].close()

    async def wait_exited(self, rank: int) -> int | None:
        await self.gone[rank].wait()
        return 0

    async def stop(self, ranks: Sequence[int]) -> None:
        for rank in ranks:
            self.inboxes[rank].close()


class FakeThreadExecutor(GroupExecutor):
    """A fake process backend: :class:`FakeThreadTransport`."""

    def make_transport(self) -> Transport:
        return FakeThreadTransport()


def config(cache_dir: Path, **overrides: Any) -> EngineConfig:
    settings: dict[str, Any] = {
        "backend": FakeThreadExecutor,
        "data_parallel_size": 2,
        "cache_dir": str(cache_dir),
        "torch_threads": 1,
        "warmup": False,
        "fault_injection": True,
    }
    settings.update(overrides)
    return EngineConfig(**settings)


def params(steps: int = 2, *, seed: int, **kw: Any) -> SamplingParams:
    return SamplingParams(num_inference_steps=steps, seed=seed, height=32, width=32, **kw)


@asynccontextmanager
async def engine_on(cache_dir: Path, **overrides: Any) -> AsyncIterator[AsyncEngine]:
    async with open_engine(config(cache_dir, **overrides)) as engine:
        yield engine


async def assert_nothing_left(engine: AsyncEngine) -> None:
    await engine.wait_idle()
    with trio.fail_after(5):
        await engine.executor.wait_settled()
    held = {**engine.leftovers(), **await engine.worker_leftovers()}
    assert {kind: ids for kind, ids in held.items() if ids} == {}


async def test_a_dropped_output_of_rank_1_reaches_the_pump_that_holds_its_claim(
    cache_dir: Path,
) -> None:
    """A request packed on rank 1 is aborted while the core waits for its output (claimed):
    the drop must reach rank 1's pump, so no claim is left and the executor settles."""
    # One fault for both (one wave: one compatibility key); it fires on rank 1 only.
    delay = FaultSpec(Fault.DELAY_OUTPUT_READY, delay_s=2.0, rank=1)
    with trio.fail_after(CAP_S):
        async with engine_on(cache_dir) as engine:
            first = engine.stream("p", with_faults(params(seed=1), delay), request_id="on-0")
            second = engine.stream("p", with_faults(params(seed=2), delay), request_id="on-1")
            async with first:
                [done] = [o async for o in first]
            assert decode_echo_image(done.images[0]) == ("on-0", 1, 0)
            while engine.statistics().packing == 0:  # noqa: ASYNC110 - another thread packs
                await trio.sleep(0.005)
            engine.abort("on-1")
            async with second:
                [last] = [o async for o in second]
            assert last.status is S.FINISHED_ABORTED
            # At once, long before rank 1's output comes: its claim was withdrawn there
            # (dropped on rank 0's pump, it would wait for the output and be handed it).
            claims = engine.executor.leftovers().get("pump_claims", set())
            assert "on-1" not in claims
            await assert_nothing_left(engine)


async def test_cancelling_a_call_to_several_ranks_raises_one_cancelled(cache_dir: Path) -> None:
    """Replies of both ranks held back, the caller cancelled: it sees trio's Cancelled (one
    exception, as with one rank), not a group of them, and the group still serves."""
    two = config(cache_dir, data_parallel_size=1, num_workers=2, cfg_parallel=False)
    async with open_executor(two) as ex:
        assert isinstance(ex, FakeThreadExecutor)
        transport = ex.transport
        assert isinstance(transport, FakeThreadTransport)
        transport.hold = trio.Event()
        with trio.fail_after(CAP_S):
            with trio.CancelScope() as scope:
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(ex.collective_rpc, "ping")
                        await trio.sleep(0.2)
                        scope.cancel()
                except BaseExceptionGroup as group:  # pragma: no cover - the failure
                    raise AssertionError(f"a group escaped: {group!r}") from None
            assert scope.cancelled_caught
            transport.hold.set()
            replies = await ex.collective_rpc("ping", unique_reply_rank=None)
            assert [r["rank"] for r in replies] == [0, 1]


async def test_a_share_one_rank_cannot_be_sent_refuses_the_wave_and_keeps_the_group(
    cache_dir: Path,
) -> None:
    """The payload for rank 1 cannot be encoded after rank 0's share was sent: rank 0's share
    is withdrawn and the wave refused as a bad payload, not a broken group; the engine runs
    its two requests alone, so the bad one fails by itself (InvalidRequestError) and the
    other gets its image; nothing is left behind and the same group serves on."""
    slow = params(40, seed=1, extra_args={ECHO_STEP_DELAY_S: 0.01})
    bad = params(40, seed=2, extra_args={ECHO_STEP_DELAY_S: 0.01})
    with trio.fail_after(CAP_S):
        async with engine_on(cache_dir) as engine:
            a = engine.stream("p", slow, request_id="a")
            b = engine.stream(UNSENDABLE, bad, request_id="b")
            finals = {}
            for rid, stream in (("a", a), ("b", b)):
                async with stream:
                    finals[rid] = [o async for o in stream][-1]
            assert finals["a"].status is S.FINISHED_COMPLETED, finals["a"]
            assert decode_echo_image(finals["a"].images[0]) == ("a", 1, 0)
            assert finals["b"].status is S.FINISHED_ERROR, finals["b"]
            assert finals["b"].error_type == "InvalidRequestError", finals["b"]
            assert engine.health().restarts == 0 and engine.health().healthy
            ok = await engine.generate("fine", params(seed=3), request_id="c")
            assert decode_echo_image(ok.images[0]) == ("c", 3, 0)
            await assert_nothing_left(engine)


def fake_of(engine: AsyncEngine) -> tuple[FakeThreadExecutor, FakeThreadTransport]:
    executor = engine.executor
    assert isinstance(executor, FakeThreadExecutor)
    transport = executor.transport
    assert isinstance(transport, FakeThreadTransport)
    return executor, transport


async def ping_every_rank(engine: AsyncEngine, replies: list[Any]) -> None:
    """Ping every rank; the replies go into ``replies`` (empty while the call waits)."""
    replies.extend(await engine.collective_rpc("ping", unique_reply_rank=None))


async def wait_for(predicate: Callable[[], bool]) -> None:
    while not predicate():  # noqa: ASYNC110 - another thread starts the workers: polled
        await trio.sleep(0.005)


async def test_a_lost_rank_group_restarts_alone_until_its_limit_then_the_group_fails(
    cache_dir: Path,
) -> None:
    """Rank 1 dies: its group alone is restarted (the engine's worker group stays up, no
    restart counted there) and serves again; dying again within ``worker_restart_window_s``
    past ``max_worker_restarts`` fails the whole group, which the engine restarts."""
    with trio.fail_after(CAP_S):
        async with engine_on(
            cache_dir, max_worker_restarts=1, worker_restart_window_s=600.0
        ) as engine:
            executor, transport = fake_of(engine)
            transport.kill(1)
            await wait_for(lambda: executor.rank_restarts == 1)
            assert engine.executor is executor and transport.starts == 3
            health = engine.health()
            assert health.healthy and health.restarts == 0, health
            for seed in (1, 2):
                final = await engine.generate("p", params(seed=seed), request_id=f"r{seed}")
                assert decode_echo_image(final.images[0]) == (f"r{seed}", seed, 0)
            transport.kill(1)  # the second time in the window: past the limit
            await wait_for(lambda: engine.executor is not executor and engine.health().healthy)
            assert engine.health().restarts == 1 and executor.rank_restarts == 1
            # (The failed group's rank restart still counts in the engine's statistics.)
            assert engine.statistics().rank_restarts == 1
            ok = await engine.generate("p", params(seed=3), request_id="r3")
            assert decode_echo_image(ok.images[0]) == ("r3", 3, 0)
            await assert_nothing_left(engine)


async def test_a_call_to_every_rank_waits_for_a_rank_group_that_restarts(cache_dir: Path) -> None:
    """While rank 1's group restarts its worker states say so and the engine stays healthy;
    an RPC to every rank waits for it (it would reach a dead rank) and then gets both
    replies."""
    with trio.fail_after(CAP_S):
        async with engine_on(cache_dir) as engine:
            executor, transport = fake_of(engine)
            gate = transport.gate = trio.Event()
            transport.kill(1)
            await wait_for(lambda: executor.worker_states()[1].state is WorkerStatus.RESTARTING)
            assert engine.health().healthy
            assert [w.state for w in engine.health().workers] == ["running", "restarting"]
            replies: list[Any] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ping_every_rank, engine, replies)
                await trio.testing.wait_all_tasks_blocked()
                assert replies == []  # held until the group is back
                gate.set()
            assert [r["rank"] for r in replies] == [0, 1]
            assert executor.rank_restarts == 1
            await assert_nothing_left(engine)


def test_a_row_whose_state_died_with_its_group_is_taken_out_once(cache_dir: Path) -> None:
    """Step mode: a request pinned to a lost group and scheduled again as a cached row is
    taken out of the call, to be reported lost (once); scheduled as new (from step 0) or
    finished, it is simply forgotten."""
    executor = FakeThreadExecutor(config(cache_dir, step_execution=True))
    executor._lost_ids.update({"cached": "died", "new": "died", "done": "died"})
    fresh = NewRequestData("new", DiffusionRequest("p", params(seed=1), "new"))
    out = SchedulerOutput(3, (fresh,), ("cached", "other"), frozenset({"done"}))
    kept, lost = executor._take_lost(out)
    assert lost == {"cached": "died"}
    assert kept.scheduled_request_ids == ("new", "other")
    assert kept.finished_req_ids == {"done"}
    assert executor._lost_ids == {}
    assert executor._take_lost(out) == (out, {})


async def test_a_call_to_every_rank_a_lost_rank_never_answered_goes_to_its_replacement(
    cache_dir: Path,
) -> None:
    """Rank 1 dies with a ping to every rank unanswered: the call is not failed; the rank
    started in its place (which never ran it) is called, and both replies come back."""
    with trio.fail_after(CAP_S):
        async with engine_on(cache_dir) as engine:
            executor, transport = fake_of(engine)
            transport.hold = trio.Event()
            replies: list[Any] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ping_every_rank, engine, replies)
                await trio.testing.wait_all_tasks_blocked()
                transport.kill(1)  # its reply, when computed, is never sent
                transport.hold.set()
            assert [r["rank"] for r in replies] == [0, 1]
            assert executor.rank_restarts == 1 and transport.starts == 3
            assert engine.health().restarts == 0
            await assert_nothing_left(engine)


async def test_overlapping_losses_of_two_rank_groups_keep_one_wait_for_both(
    cache_dir: Path,
) -> None:
    """Three data-parallel ranks; ranks 1 and 2 die one after the other while neither is
    back: an RPC to every rank made between the two losses waits for both restarts (not
    for ever on the first) and gets three replies."""
    with trio.fail_after(CAP_S):
        async with engine_on(cache_dir, data_parallel_size=3) as engine:
            executor, transport = fake_of(engine)
            gate = transport.gate = trio.Event()
            transport.kill(1)
            await wait_for(lambda: executor.worker_states()[1].state is WorkerStatus.RESTARTING)
            replies: list[Any] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(ping_every_rank, engine, replies)
                await trio.testing.wait_all_tasks_blocked()
                transport.kill(2)
                await wait_for(lambda: executor.worker_states()[2].state is WorkerStatus.RESTARTING)
                gate.set()
            assert [r["rank"] for r in replies] == [0, 1, 2]
            assert executor.rank_restarts == 2 and engine.health().restarts == 0
            await assert_nothing_left(engine)


async def test_a_rank_group_restarted_while_the_engine_sleeps_is_put_to_sleep_first(
    cache_dir: Path,
) -> None:
    """The engine sleeps; rank 1 dies: its replacement is sent the same sleep before its
    group takes work again (it starts awake, with its weights), and the engine's wake then
    reaches every rank."""
    with trio.fail_after(CAP_S):
        async with engine_on(cache_dir) as engine:
            executor, transport = fake_of(engine)
            await engine.sleep(1)
            transport.kill(1)
            await wait_for(lambda: executor.rank_restarts == 1)
            assert (1, "sleep", 3) in transport.sent  # to the replacement (the 3rd start)
            restarted = transport.sent.index((1, "sleep", 3))
            assert all(method != "wake_up" for _, method, _ in transport.sent[:restarted])
            await engine.wake_up()
            assert {(r, m) for r, m, n in transport.sent if n == 3} >= {
                (1, "sleep"),
                (0, "wake_up"),
                (1, "wake_up"),
            }
            final = await engine.generate("p", params(seed=4), request_id="after")
            assert decode_echo_image(final.images[0]) == ("after", 4, 0)
            await assert_nothing_left(engine)


async def test_a_rank_that_makes_no_progress_restarts_alone_and_its_request_reruns(
    cache_dir: Path,
) -> None:
    """Rank 1 stops answering in a forward (no step progress past
    ``worker_stall_timeout_s``): its group alone is written off and restarted while rank 0
    serves, and the request it held runs again and completes with its own image."""
    with trio.fail_after(CAP_S):
        async with engine_on(
            cache_dir, worker_stall_timeout_s=0.5, max_retries_on_worker_failure=1
        ) as engine:
            executor, transport = fake_of(engine)
            stuck = transport.held[1] = trio.Event()
            streams = {
                rid: engine.stream("p", params(seed=seed), request_id=rid)
                for rid, seed in (("a", 1), ("b", 2))
            }
            await wait_for(lambda: executor.worker_states()[1].state is WorkerStatus.RESTARTING)
            del transport.held[1]
            stuck.set()  # the old rank's loop ends (its reply, killed, is never sent)
            for rid, seed in (("a", 1), ("b", 2)):
                async with streams[rid] as stream:
                    final = [o async for o in stream][-1]
                assert decode_echo_image(final.images[0]) == (rid, seed, 0)
            await wait_for(lambda: executor.rank_restarts == 1)
            assert engine.health().restarts == 0
            assert engine.statistics().requeued == 1
            await assert_nothing_left(engine)
