"""The Ray executor: one Ray actor per worker, for users who outgrow one machine.

Shape (docs/backends.md and docs/multi-node.md say more):

- ``serve`` joins Ray (:func:`ensure_ray`: an initialised Ray is reused; otherwise
  ``ray.init(address=ray_address)``, which honours ``$RAY_ADDRESS``; with neither, a local
  Ray on 127.0.0.1), reserves one placement-group bundle per worker (``{"GPU": 1}`` on GPU
  clusters, else ``{"CPU": 1}``, strategy ``PACK``; the caller's current placement group is
  reused when it has enough fitting bundles, otherwise one is created, and removed at
  shutdown), starts one :class:`~omni_trio.worker.ray_actor.RayWorker` actor per rank and
  loads the model in each, concurrently.  A placement group that is not ready within
  ``ray_placement_timeout_s`` fails the start with a :class:`WorkerError` naming how many
  bundles were needed and what the cluster has.
- Ray's object refs are awaited from trio through ``ObjectRef.future()``: Ray's own thread
  completes the future, whose callback wakes the trio task (``run_sync_soon``).  No thread of
  ours blocks in ``ray.get`` and the event loop never does.  Cancelling a wait leaves the
  actor call to finish on its own; a cancelled forward is stopped at its next step by
  :meth:`abort_requests`, sent through the actor's ``control`` concurrency group, which is
  never queued behind a forward.
- Every call goes to every rank; only the output rank ships its result (moved to the CPU in
  the actor), the others reply with an acknowledgement, so a failure on any rank is seen
  with its traceback (:func:`~omni_trio.executors.base.raise_rank_failures`).
- Failure: an actor's death (its ``watch`` call fails with ``ActorDiedError``, busy or idle,
  within milliseconds of the process exiting), a task error, a heartbeat not answered within
  ``worker_heartbeat_timeout_s``, a call making no step progress for
  ``worker_stall_timeout_s``, or an RPC past its timeout *fails the group closed*: every
  pending call fails with a :class:`WorkerError` (or :class:`StallError`) naming the rank,
  every actor is killed and an owned placement group removed, so the engine's supervisor
  can start a new group.
- Shutdown: stop flags through the control group, then each actor's ``shutdown`` call
  (behind its current call) with at most ``close_timeout_s`` in all, then ``ray.kill``;
  waits (bounded) until every actor process is gone.  Idempotent; an actor dying during
  shutdown is not a failure.

Ray is an optional dependency (``pip install 'omni-trio[ray]'``): this module imports it
only inside :func:`ensure_ray`, so importing omni_trio never imports Ray.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import trio
from trio_typing import TaskStatus

from .._core.health import WorkerStatus
from ..config import EngineConfig
from ..errors import EngineClosedError, EngineDeadError, InvalidConfigError, StallError, WorkerError
from ._process import wait_exited
from .base import Executor, GroupExecutor, WorkerState

__all__ = [
    "HEARTBEAT_INTERVAL_S",
    "RayExecutor",
    "actor_env",
    "ensure_ray",
    "import_ray",
]

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
# After ray.kill: how long to wait for every actor's process to be gone.
_KILL_WAIT_S = 10.0

# Environment variables an actor inherits from the engine process: our own settings and the
# torch / NCCL / Hugging Face / threading ones.  Never what says which devices a process
# sees or which rank it is: Ray assigns each actor its own device, and ranks are ours.
_FORWARDED_PREFIXES = (
    "OMNI_TRIO_",
    "TORCH_",
    "PYTORCH_",
    "NCCL_",
    "HF_",
    "HUGGINGFACE_",
    "TRANSFORMERS_",
    "DIFFUSERS_",
    "TOKENIZERS_",
    "OMP_",
    "MKL_",
)
_NEVER_FORWARDED_PREFIXES = ("TORCHELASTIC_",)
_NEVER_FORWARDED = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "NODE_RANK",
        "ROLE_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    }
)


def actor_env(environ: Mapping[str, str], torch_threads: int) -> dict[str, str]:
    """The environment variables a worker actor gets from the engine process (see
    :data:`_FORWARDED_PREFIXES`), with its thread count (``OMP_NUM_THREADS``) set."""
    env = {
        key: value
        for key, value in environ.items()
        if key.startswith(_FORWARDED_PREFIXES)
        and key not in _NEVER_FORWARDED
        and not key.startswith(_NEVER_FORWARDED_PREFIXES)
    }
    env["OMP_NUM_THREADS"] = str(torch_threads)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def import_ray() -> Any:
    """Import Ray, keeping a local Ray on loopback: ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
    must be in the environment before ``import ray`` (see :func:`ensure_ray`).  Raises
    :class:`InvalidConfigError` when Ray is not installed."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError as exc:
        raise InvalidConfigError(
            "backend='ray' needs Ray: pip install 'omni-trio[ray]'", field="backend"
        ) from exc
    return ray


def _is_loopback_address(address: str) -> bool:
    """Whether a Ray address (``host:port``, ``ray://host:port``) names a loopback host."""
    import ipaddress

    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# How often the thread that started Ray checks whether Ray is still initialised.
_OWNER_POLL_S = 1.0
_init_lock = threading.Lock()


def _init_in_owner_thread(init: Any, ray: Any) -> None:
    """Run ``init()`` (a ``ray.init`` call) in a thread that stays alive as long as Ray does.

    Ray ties the processes a local start spawns (GCS, raylet) to the *thread* that started
    them (``PR_SET_PDEATHSIG``): started from a short-lived thread, such as one of trio's
    cached worker threads (retired after ~10 s idle), the whole local Ray dies with that
    thread.  So the start happens in ``omni-trio-ray-owner``, a daemon thread that parks until
    Ray is shut down (it checks once a second) and then ends.  Blocks until ``init()``
    returned; re-raises what it raised."""
    started = threading.Event()
    failure: list[BaseException] = []

    def own() -> None:
        try:
            init()
        except BaseException as exc:
            failure.append(exc)
            return
        finally:
            started.set()
        while ray.is_initialized():
            time.sleep(_OWNER_POLL_S)

    threading.Thread(target=own, name="omni-trio-ray-owner", daemon=True).start()
    started.wait()
    if failure:
        raise failure[0]


def ensure_ray(address: str | None = None) -> Any:
    """Return the ``ray`` module with Ray initialised (blocking: seconds for a new local Ray;
    call it from a thread, e.g. ``trio.to_thread.run_sync``).

    An initialised Ray is reused as it is.  Otherwise ``address`` (or ``$RAY_ADDRESS``) is
    joined with ``ray.init(address=...)`` (on loopback when that address is a loopback one).
    With neither, a local single-node Ray is started on 127.0.0.1 (``_node_ip_address``; Ray
    would otherwise pick the machine's network address for its own traffic), without a
    dashboard.  ``ray.init`` runs in a thread that lives as long as Ray does (see
    :func:`_init_in_owner_thread`).  A Ray started here lives until this process exits (Ray
    stops it then) or ``ray.shutdown()``.
    """
    ray = import_ray()
    with _init_lock:
        if ray.is_initialized():
            return ray
        target = address or os.environ.get("RAY_ADDRESS") or None
        options: dict[str, Any] = {"logging_level": logging.WARNING}
        if target is not None:
            options["address"] = target
            if _is_loopback_address(target):
                # A cluster on this machine's loopback: this driver stays on loopback too.
                options["_node_ip_address"] = "127.0.0.1"
        else:
            options.update(_node_ip_address="127.0.0.1", include_dashboard=False)
        _init_in_owner_thread(lambda: ray.init(**options), ray)
    return ray


@dataclass(eq=False)
class _ActorLink:
    """The executor's side of one worker actor."""

    rank: int
    actor: Any
    pid: int | None = None
    node_ip: str | None = None
    steps: int = 0
    last_progress_at: float = 0.0
    progress: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Calls sent to this actor and not answered yet (stall detection).
    busy: int = 0
    # The actor's ``watch`` call: fails when the actor dies.
    watch_ref: Any = None
    dead: bool = False


class RayExecutor(GroupExecutor):
    """Backend ``"ray"``: ``num_workers`` Ray actors in one placement group.

    ``placement_group`` is the group the workers run in and ``owns_placement_group`` says
    whether this executor created it (and removes it at shutdown).
    """

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._links: dict[int, _ActorLink] = {}
        self._tag = secrets.token_hex(3)
        self._group_scope: trio.CancelScope | None = None
        self._serve_done = trio.Event()
        self._closing = False
        # Events of calls in flight: a group failure wakes them all.
        self._wakeups: set[trio.Event] = set()
        self._ray: Any = None
        self.placement_group: Any = None
        self.owns_placement_group = False
        self._bundle_indexes: list[int] = []
        self._token: trio.lowlevel.TrioToken | None = None

    # -- awaiting Ray from trio -----------------------------------------------------------

    def _on_done(self, ref: Any, fn: Any, *args: Any) -> Any:
        """A future for ``ref``; ``fn(*args)`` runs in the trio loop once it completes
        (Ray's thread completes it and hands the call over with ``run_sync_soon``)."""
        token = self._token
        assert token is not None

        def wake(_: Any) -> None:
            try:
                token.run_sync_soon(fn, *args)
            except trio.RunFinishedError:
                pass

        future = ref.future()
        future.add_done_callback(wake)
        return future

    async def _await_ref(self, ref: Any) -> Any:
        """The value of ``ref``; raises what Ray raises for it.  Cancellable (the call goes
        on in the actor)."""
        done = trio.Event()
        future = self._on_done(ref, done.set)
        await done.wait()
        return future.result()

    async def _await_all(self, refs: dict[int, Any], what: str) -> dict[int, Any]:
        """Every rank's value, or the group's failure: returns when all are done, raises as
        soon as one fails (that fails the group) or the group failed meanwhile."""
        done = trio.Event()
        self._wakeups.add(done)
        futures: dict[int, Any] = {}
        remaining = len(refs)
        failed: list[int] = []

        def one_done(rank: int) -> None:
            nonlocal remaining
            remaining -= 1
            if futures[rank].exception() is not None:
                failed.append(rank)
            if remaining == 0 or failed:
                done.set()

        try:
            for rank, ref in refs.items():
                futures[rank] = self._on_done(ref, one_done, rank)
            await done.wait()
        finally:
            self._wakeups.discard(done)
        if failed:
            rank = failed[0]
            error = self._boxed(rank, futures[rank].exception(), what)
            self._fail_group(error)
            raise error
        if remaining:
            # Woken by the group failing or closing, not by the calls: never block on them.
            self.check_health()
            raise EngineClosedError("executor is closed")
        return {rank: future.result() for rank, future in futures.items()}

    def _boxed(self, rank: int, exc: BaseException | None, what: str) -> Exception:
        """A Ray failure of ``rank`` as our error."""
        ray = self._ray
        link = self._links.get(rank)
        pid = f" (pid {link.pid})" if link is not None and link.pid else ""
        if ray is not None and isinstance(exc, ray.exceptions.RayActorError):
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return WorkerError(
                f"actor{pid} died during {what}: {first}", worker=rank, error_type="WorkerDied"
            )
        if ray is not None and isinstance(exc, ray.exceptions.RayTaskError):
            cause = getattr(exc, "cause", None) or exc
            if isinstance(cause, InvalidConfigError):
                return InvalidConfigError(str(cause), field=cause.field)
            return WorkerError(
                str(cause) or repr(cause),
                worker=rank,
                error_type=type(cause).__name__,
                traceback_text=str(exc),
            )
        return WorkerError(
            f"{what} failed{pid}: {type(exc).__name__}: {exc}",
            worker=rank,
            error_type=type(exc).__name__,
        )

    # -- lifecycle ------------------------------------------------------------------------

    def _wire_config(self) -> dict[str, Any]:
        data = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config)}
        data["backend"] = "inproc"  # inside the actor there is no executor
        data["num_workers"] = 1
        data["torch_threads"] = self.config.resolved_torch_threads
        data["model_options"] = dict(self.config.model_options)
        # Ray ships each actor its results through the object store: no packer thread.
        data["async_output"] = False
        return data

    def _bundle(self, ray: Any) -> dict[str, float]:
        device = self.config.device
        if device is not None:
            gpu = device.startswith("cuda")
        else:
            gpu = ray.cluster_resources().get("GPU", 0) >= 1
        return {"GPU": 1.0} if gpu else {"CPU": 1.0}

    async def _reserve(self, ray: Any, bundle: dict[str, float]) -> None:
        """The caller's current placement group if it has enough bundles that fit, else a
        new one (owned: removed at shutdown) that must be ready within the timeout."""
        from ray.util import get_current_placement_group
        from ray.util.placement_group import placement_group, remove_placement_group

        n = self.config.num_workers
        current = get_current_placement_group()
        if current is not None:
            fitting = [
                i
                for i, spec in enumerate(current.bundle_specs)
                if all(spec.get(key, 0) >= amount for key, amount in bundle.items())
            ]
            if len(fitting) >= n:
                self.placement_group = current
                self._bundle_indexes = fitting[:n]
                return
            log.warning(
                "the current placement group has %d bundle(s) of %s, %d needed: creating one",
                len(fitting),
                bundle,
                n,
            )
        group = placement_group([dict(bundle)] * n, strategy="PACK", name=f"omni-trio-{self._tag}")
        self.placement_group = group
        self.owns_placement_group = True
        self._bundle_indexes = list(range(n))
        timeout = self.config.ray_placement_timeout_s
        with trio.move_on_after(timeout) as scope:
            await self._await_ref(group.ready())
        if scope.cancelled_caught:
            remove_placement_group(group)
            self.placement_group = None
            self.owns_placement_group = False
            (key,) = bundle
            total = ray.cluster_resources().get(key, 0)
            available = ray.available_resources().get(key, 0)
            raise WorkerError(
                f"the Ray cluster cannot place {n} worker(s): needed {n} bundle(s) of "
                f"{{{key!r}: {bundle[key]:g}}}, the cluster has {total:g} {key} in all and "
                f"{available:g} available (waited {timeout:g} s for the placement group); add "
                "nodes, free resources or lower num_workers",
                error_type="PlacementError",
            )

    def _actor_options(self, ray: Any, rank: int, bundle: dict[str, float]) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = "GPU" in bundle
        return {
            "name": f"omni-trio-worker-{rank}-{self._tag}",
            "num_cpus": 0 if gpu else 1,
            "num_gpus": 1 if gpu else 0,
            "max_restarts": 0,
            "max_task_retries": 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=self._bundle_indexes[rank],
            ),
            "runtime_env": {"env_vars": actor_env(os.environ, self.config.resolved_torch_threads)},
        }

    async def serve(self, *, task_status: TaskStatus[Executor] = trio.TASK_STATUS_IGNORED) -> None:
        """Join Ray, reserve the placement group, start every actor and load the model in
        each (concurrently), report ready, then run until cancelled or until the group
        fails.  Teardown: see :meth:`_stop_actors`."""
        from .._core.model_info import ModelInfo
        from ..worker.ray_actor import CONTROL_CONCURRENCY, CONTROL_GROUP, RayWorker

        self._token = trio.lowlevel.current_trio_token()
        address = self.config.ray_address
        ray = self._ray = await trio.to_thread.run_sync(ensure_ray, address)
        actor_class = ray.remote(concurrency_groups={CONTROL_GROUP: CONTROL_CONCURRENCY})(RayWorker)
        n = self.config.num_workers
        try:
            with trio.CancelScope() as group_scope:
                self._group_scope = group_scope
                bundle = self._bundle(ray)
                await self._reserve(ray, bundle)
                for rank in range(n):
                    actor = actor_class.options(**self._actor_options(ray, rank, bundle)).remote(
                        self._wire_config(), rank, n
                    )
                    self._links[rank] = _ActorLink(rank, actor)
                dist_init_method = None
                if n > 1 and self.config.cfg_parallel:
                    # torch.distributed meets on the rank-0 actor's host.
                    (dist_init_method,) = (
                        await self._await_all(
                            {0: self._links[0].actor.rendezvous_address.remote()},
                            "the CFG rendezvous",
                        )
                    ).values()
                starts = {
                    rank: link.actor.start.remote(dist_init_method)
                    for rank, link in self._links.items()
                }
                started = await self._await_all(starts, "startup")
                now = trio.current_time()
                for rank, info in started.items():
                    link = self._links[rank]
                    link.pid, link.node_ip = int(info["pid"]), str(info["node_ip"])
                    link.last_progress_at = now
                self.model_info = ModelInfo(**started[0]["model_info"])
                async with trio.open_nursery() as nursery:
                    for link in self._links.values():
                        link.watch_ref = link.actor.watch.options(
                            concurrency_group=CONTROL_GROUP
                        ).remote()
                        nursery.start_soon(self._watch_actor, link)
                    nursery.start_soon(self._monitor_liveness)
                    task_status.started(self)
                    await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                self._closed = True
                for event in list(self._wakeups):
                    event.set()  # a pending call raises EngineDeadError / EngineClosedError
                await self._stop_actors()
                self._serve_done.set()

    async def _watch_actor(self, link: _ActorLink) -> None:
        """Fail the group the moment ``link``'s actor dies, busy or idle."""
        try:
            await self._await_ref(link.watch_ref)
        except Exception as exc:
            link.dead = True
            if not self._closing:
                self._fail_group(self._boxed(link.rank, exc, "its lifetime"))

    async def _monitor_liveness(self) -> None:
        """Every second, each actor's heartbeat (through the control group): an actor that
        does not answer within ``worker_heartbeat_timeout_s`` is hung; a call in flight
        with no denoising-step progress for ``worker_stall_timeout_s`` is hung.  Either
        way: fail closed."""
        from ..worker.ray_actor import CONTROL_GROUP

        beat_timeout = self.config.worker_heartbeat_timeout_s
        stall_timeout = self.config.worker_stall_timeout_s
        while True:
            await trio.sleep(HEARTBEAT_INTERVAL_S)
            refs = {
                rank: link.actor.heartbeat.options(concurrency_group=CONTROL_GROUP).remote()
                for rank, link in self._links.items()
            }
            with trio.move_on_after(beat_timeout) as scope:
                try:
                    beats = await self._await_all(refs, "a heartbeat")
                except (WorkerError, InvalidConfigError, EngineDeadError, EngineClosedError):
                    return  # the group failed (or closed); _await_all said why
            if scope.cancelled_caught:
                self._fail_group(
                    StallError("worker", f"no heartbeat answered within {beat_timeout} s")
                )
                return
            now = trio.current_time()
            for rank, beat in beats.items():
                link = self._links[rank]
                self._note_steps(link, int(beat["steps"]), now)
                link.progress = {k: (int(v[0]), int(v[1])) for k, v in beat["progress"].items()}
                if (
                    stall_timeout is not None
                    and link.busy
                    and now - link.last_progress_at > stall_timeout
                ):
                    idle = now - link.last_progress_at
                    self._fail_group(
                        StallError("forward", f"worker {rank}: no progress in {idle:.1f} s")
                    )
                    return

    @staticmethod
    def _note_steps(link: _ActorLink, steps: int, now: float) -> None:
        if steps != link.steps:
            link.steps = steps
            link.last_progress_at = now

    def _fail_group(self, error: BaseException) -> None:
        """Fail closed: remember why, wake every pending call, tear the group down (the
        actors are killed by ``serve``'s teardown)."""
        if self._closing and self._dead_reason is None:
            return
        self.fail(error)
        for event in list(self._wakeups):
            event.set()
        if self._group_scope is not None:
            self._group_scope.cancel()

    async def _stop_actors(self) -> None:
        """Ask every live actor to stop (stop flags at once, then ``shutdown`` behind its
        current call), at most ``close_timeout_s`` in all; then kill them all and wait
        (bounded) until their processes are gone; remove an owned placement group.  A
        failed group skips the asking."""
        ray = self._ray
        if ray is None:
            return
        from ray.util.placement_group import remove_placement_group

        from ..worker.ray_actor import CONTROL_GROUP

        links = [link for link in self._links.values() if not link.dead]
        if self._dead_reason is None and links:
            for link in links:
                link.actor.stop_everything.options(concurrency_group=CONTROL_GROUP).remote()
            refs = {link.rank: link.actor.shutdown.remote() for link in links}
            with trio.move_on_after(self.config.close_timeout_s) as scope:
                for ref in refs.values():
                    try:
                        await self._await_ref(ref)
                    except Exception:  # an actor dying now is not a failure
                        pass
            if scope.cancelled_caught:
                log.warning(
                    "ray workers did not stop in %s s; killing them", self.config.close_timeout_s
                )
        for link in self._links.values():
            try:
                ray.kill(link.actor, no_restart=True)
            except Exception:  # already gone
                pass
        with trio.move_on_after(_KILL_WAIT_S) as scope:
            for link in self._links.values():
                if link.watch_ref is not None:
                    try:
                        await self._await_ref(link.watch_ref)
                    except Exception:
                        pass
                if link.pid is not None and link.node_ip == ray.util.get_node_ip_address():
                    await wait_exited(link.pid)
        if scope.cancelled_caught:
            log.warning("ray worker processes still exist %s s after the kill", _KILL_WAIT_S)
        if self.owns_placement_group and self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception:
                log.exception("could not remove placement group")
            self.owns_placement_group = False

    async def aclose(self) -> None:
        if self._closing:
            with trio.CancelScope(shield=True):
                await self._serve_done.wait()
            return
        self._closing = True
        with trio.CancelScope(shield=True):
            if self._group_scope is not None:
                self._group_scope.cancel()
                await self._serve_done.wait()
            self._closed = True

    # -- calls ----------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._dead_reason is not None or self._closed:
            self.check_health()
        if not self._links or self.model_info is None:
            raise EngineClosedError("executor is not started")

    async def _call(
        self,
        method: str,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        *,
        reply_rank: int | None = 0,
        timeout: float | None = None,
        abort_ids: Iterable[str] = (),
    ) -> dict[int, dict[str, Any]]:
        """Send one call to every rank; return each rank's reply.  A timeout, a dead actor
        or a task error fails the group closed."""
        self._check_usable()
        refs = {
            rank: link.actor.call.remote(method, args, kwargs or {}, reply_rank)
            for rank, link in self._links.items()
        }
        for link in self._links.values():
            link.busy += 1
        try:
            with trio.fail_after(math.inf if timeout is None else timeout):
                replies: dict[int, dict[str, Any]] = await self._await_all(refs, repr(method))
        except trio.TooSlowError:
            error = StallError("rpc", f"{method!r} got no reply within {timeout} s")
            self._fail_group(error)
            raise error from None
        except trio.Cancelled:
            ids = list(abort_ids)
            if ids:
                self.abort_requests(ids)
            raise
        finally:
            for link in self._links.values():
                link.busy -= 1
        now = trio.current_time()
        for rank, reply in replies.items():
            self._note_steps(self._links[rank], int(reply.get("steps", 0)), now)
        return replies

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Set the stop flags in every actor through its control group: a call submitted,
        not awaited (never blocks, never queued behind a forward)."""
        from ..worker.ray_actor import CONTROL_GROUP

        ids = list(request_ids)
        if not ids or self._closed:
            return
        for link in self._links.values():
            if not link.dead:
                link.actor.abort.options(concurrency_group=CONTROL_GROUP).remote(ids)

    def progress(self, request_id: str) -> tuple[int, int] | None:
        link = self._links.get(0)
        return link.progress.get(request_id) if link is not None else None

    def worker_states(self) -> list[WorkerState]:
        out = []
        for entry in super().worker_states():
            link = self._links.get(entry.rank)
            if link is None:
                out.append(entry)
                continue
            state = (
                WorkerStatus.FAILED
                if link.dead and entry.state is WorkerStatus.RUNNING
                else entry.state
            )
            out.append(WorkerState(entry.rank, state, pid=link.pid, steps=link.steps))
        return out

    def worker_pids(self) -> dict[int, int]:
        """rank -> pid of every worker actor's process."""
        return {rank: link.pid for rank, link in self._links.items() if link.pid is not None}

    def worker_nodes(self) -> dict[int, str]:
        """rank -> address of the Ray node each worker actor runs on."""
        return {r: link.node_ip for r, link in self._links.items() if link.node_ip is not None}

    def worker_steps(self) -> dict[int, int]:
        """rank -> denoising steps that worker has run, as of its latest reply or heartbeat."""
        return {rank: link.steps for rank, link in self._links.items()}
