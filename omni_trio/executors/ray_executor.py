"""The Ray backend: one Ray actor per worker, for users who outgrow one machine, behind a
:class:`~omni_trio.executors.group.Transport` (the group's rules are the
:class:`~omni_trio.executors.group.GroupExecutor`'s: docs/backends.md).

Shape (docs/multi-node.md says more):

- ``open`` joins Ray (:func:`ensure_ray`: an initialised Ray is reused; otherwise
  ``ray.init(address=ray_address)``, which honours ``$RAY_ADDRESS``; with neither, a local
  Ray on 127.0.0.1), reserves one placement-group bundle per worker (``{"GPU": 1}`` on GPU
  clusters, else ``{"CPU": 1}``, strategy ``PACK``; the caller's current placement group is
  reused when it has enough fitting bundles, otherwise one is created, and removed when the
  group ends) and creates one :class:`~omni_trio.worker.ray_actor.RayWorker` actor per rank.
  A placement group that is not ready within ``ray_placement_timeout_s`` fails the start
  with a :class:`WorkerError` (``PlacementError``) naming how many bundles were needed and
  what the cluster has.  A CFG-parallel group meets on the rank-0 actor's host.
- ``serve_rank`` loads the model in its actor, then long-polls the actor's outbox (the
  output packer's ``OUTPUT_READY`` messages and a fresh heartbeat at least every
  :data:`~omni_trio._core.liveness.HEARTBEAT_INTERVAL_S`) through the actor's ``control``
  concurrency group, which is never queued behind a forward.
- ``send``: a :class:`~omni_trio._core.messages.WorkerCall` is an actor call in the default
  group (one at a time, in order) whose return value is the rank's reply; a
  :class:`~omni_trio._core.messages.WorkerAbort` goes through the control group.
- Ray's object refs are awaited from trio through ``ObjectRef.future()``: Ray's own thread
  completes the future, whose callback hands the result to the trio loop
  (``run_sync_soon``).  No thread of ours blocks in ``ray.get`` and the event loop never does.
- ``kill`` is ``ray.kill``; ``wait_exited`` returns when the actor's ``watch`` call fails
  (Ray says the actor died: within milliseconds of its process exiting, busy or idle) and,
  for an actor on this node, its process is gone.  Ray does not report exit statuses.
- ``stop`` sets every stop flag through the control group and runs each actor's
  ``shutdown`` behind its current call, then kills the (now idle) actors.

Ray is an optional dependency (``pip install 'omni-trio[ray]'``): this module imports it
only inside :func:`ensure_ray`, so importing omni_trio never imports Ray.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from .._core.liveness import HEARTBEAT_INTERVAL_S
from .._core.messages import AsyncOutput, AsyncOutputKind, WorkerAbort, WorkerCall
from ..config import EngineConfig
from ..errors import InvalidConfigError, WorkerError
from ._process import wait_exited as _wait_pid_exited
from .group import (
    KILL_WAIT_S,
    STARTED,
    Deliver,
    GroupExecutor,
    RankInit,
    RankStarted,
    RankStatus,
    Transport,
    WireMessage,
    is_secret_env_name,
    secrets_hidden,
    wire_config,
)

__all__ = [
    "RAY_OWNER_THREAD",
    "RayExecutor",
    "RayTransport",
    "actor_env",
    "ensure_ray",
    "import_ray",
]

log = logging.getLogger(__name__)


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
# Secrets are never copied into an actor (Ray keeps runtime_env in its GCS and shows it in its
# dashboard): the daemon's API key, hub tokens, anything named like a credential
# (is_secret_env_name).
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
    :data:`_FORWARDED_PREFIXES`), with its thread count (``OMP_NUM_THREADS``) set.  Never a
    secret (``OMNI_TRIO_API_KEY``, ``HF_TOKEN``, any name with TOKEN, KEY, SECRET,
    PASSWORD, CREDENTIAL or AUTH in it)."""
    env = {
        key: value
        for key, value in environ.items()
        if key.startswith(_FORWARDED_PREFIXES)
        and key not in _NEVER_FORWARDED
        and not key.startswith(_NEVER_FORWARDED_PREFIXES)
        and not is_secret_env_name(key)
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


# An explicit cluster address must accept a connection within this long, and ray.init must
# return within RAY_INIT_TIMEOUT_S; otherwise the start fails with one line naming it.
RAY_CONNECT_TIMEOUT_S = 10.0
RAY_INIT_TIMEOUT_S = 120.0


def _host_port(address: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``host:port`` / ``ray://host:port``; None for ``auto`` and the like."""
    rest = address.split("://", 1)[-1]
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "127.0.0.1", int(port)


def check_reachable(address: str, timeout_s: float = RAY_CONNECT_TIMEOUT_S) -> None:
    """Raise :class:`InvalidConfigError` (``field="ray_address"``) unless ``address`` accepts
    a TCP connection within ``timeout_s`` (``ray.init`` would retry for minutes)."""
    import socket

    target = _host_port(address)
    if target is None:
        return
    try:
        socket.create_connection(target, timeout=timeout_s).close()
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise InvalidConfigError(
            f"cannot reach the Ray cluster at {address!r}: {why} (start one with "
            "`ray start --head`, or leave ray_address unset for a local Ray)",
            field="ray_address",
        ) from None


# The thread that starts a local Ray and lives as long as it (see _init_in_owner_thread).
RAY_OWNER_THREAD = "omni-trio-ray-owner"
# How often the thread that started Ray checks whether Ray is still initialised.
_OWNER_POLL_S = 1.0
_init_lock = threading.Lock()


def _init_in_owner_thread(
    init: Any, ray: Any, *, what: str = "a local Ray", timeout_s: float = RAY_INIT_TIMEOUT_S
) -> None:
    """Run ``init()`` (a ``ray.init`` call) in a thread that stays alive as long as Ray does.

    Ray ties the processes a local start spawns (GCS, raylet) to the *thread* that started
    them (``PR_SET_PDEATHSIG``): started from a short-lived thread, such as one of trio's
    cached worker threads (retired after ~10 s idle), the whole local Ray dies with that
    thread.  So the start happens in ``omni-trio-ray-owner``, a daemon thread that parks until
    Ray is shut down (it checks once a second) and then ends.  Blocks until ``init()``
    returned, at most ``timeout_s`` (then :class:`InvalidConfigError` naming ``what``; the
    thread is left to finish on its own); re-raises what it raised."""
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

    threading.Thread(target=own, name=RAY_OWNER_THREAD, daemon=True).start()
    if not started.wait(timeout_s):
        raise InvalidConfigError(
            f"ray.init did not finish within {timeout_s:g} s ({what})", field="ray_address"
        )
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
            check_reachable(target)
            options["address"] = target
            if _is_loopback_address(target):
                # A cluster on this machine's loopback: this driver stays on loopback too.
                options["_node_ip_address"] = "127.0.0.1"
        else:
            options.update(_node_ip_address="127.0.0.1", include_dashboard=False)
        what = f"joining {target!r}" if target is not None else "starting a local Ray"
        _init_in_owner_thread(lambda: ray.init(**options), ray, what=what)
    return ray


@dataclass(eq=False)
class _ActorLink:
    """The transport's side of one worker actor."""

    rank: int
    actor: Any
    pid: int | None = None
    node_ip: str | None = None
    # Where the rank's messages go (set by serve_rank once the actor started).
    deliver: Callable[[WireMessage], None] | None = None
    # The actor's ``watch`` call: fails when the actor dies.
    watch_ref: Any = None


class RayTransport(Transport):
    """Worker actors in one placement group; see the module docstring.

    ``placement_group`` is the group the workers run in and ``owns_placement_group`` says
    whether this transport created it (and removes it when the group ends).
    """

    def __init__(self) -> None:
        self._links: dict[int, _ActorLink] = {}
        self._tag = secrets.token_hex(3)
        self._ray: Any = None
        self._token: trio.lowlevel.TrioToken | None = None
        self.placement_group: Any = None
        self.owns_placement_group = False
        self._bundle_indexes: list[int] = []
        # What a rank's actor is made from (``replace_ranks`` makes a new one), and how
        # many times each rank's actor was replaced (a new actor needs a new name).
        self._make_actor: Callable[[int], Any] | None = None
        self._replaced: dict[int, int] = {}

    # -- awaiting Ray from trio ---------------------------------------------------------

    def _on_done(self, ref: Any, fn: Callable[[Any], None]) -> None:
        """``fn(future)`` runs in the trio loop once ``ref`` completes (Ray's thread
        completes the future and hands the call over with ``run_sync_soon``)."""
        token = self._token
        assert token is not None
        future = ref.future()

        def wake(_: Any) -> None:
            try:
                token.run_sync_soon(fn, future)
            except trio.RunFinishedError:
                pass

        future.add_done_callback(wake)

    async def _await_ref(self, ref: Any) -> Any:
        """The value of ``ref``; raises what Ray raises for it.  Cancellable (the call goes
        on in the actor)."""
        done = trio.Event()
        box: list[Any] = []

        def settle(future: Any) -> None:
            box.append(future)
            done.set()

        self._on_done(ref, settle)
        await done.wait()
        return box[0].result()

    # -- the group's environment --------------------------------------------------------

    @asynccontextmanager
    async def open(
        self, config: EngineConfig, fail: Callable[[BaseException], None]
    ) -> AsyncIterator[None]:
        from ..worker.ray_actor import CONTROL_CONCURRENCY, CONTROL_GROUP, RayWorker

        self._token = trio.lowlevel.current_trio_token()
        # A local Ray started here passes its environment to every worker it spawns.
        with secrets_hidden():
            ray = self._ray = await trio.to_thread.run_sync(ensure_ray, config.ray_address)
        actor_class = ray.remote(concurrency_groups={CONTROL_GROUP: CONTROL_CONCURRENCY})(RayWorker)
        n = config.num_workers
        bundle = self._bundle(ray, config)
        try:
            await self._reserve(ray, config, bundle)
            wire = wire_config(config)

            def make_actor(rank: int) -> Any:
                options = self._actor_options(config, rank, bundle)
                return actor_class.options(**options).remote(wire, rank, n)

            self._make_actor = make_actor
            for rank in range(n):
                self._links[rank] = _ActorLink(rank, make_actor(rank))
            yield
        finally:
            # The executor stopped or killed every started rank; an actor that never
            # started (a failed startup) is killed here, and waited for (bounded).
            for link in self._links.values():
                self._kill_link(link)
            with trio.CancelScope(shield=True), trio.move_on_after(KILL_WAIT_S):
                for rank in self._links:
                    await self.wait_exited(rank)
            if self.owns_placement_group and self.placement_group is not None:
                from ray.util.placement_group import remove_placement_group

                try:
                    remove_placement_group(self.placement_group)
                except Exception:
                    log.exception("could not remove placement group")
                self.owns_placement_group = False

    async def rendezvous(self, leader: int = 0) -> str:
        """torch.distributed meets on the host of the group's first actor (``leader``)."""
        try:
            address = await self._await_ref(self._links[leader].actor.rendezvous_address.remote())
        except Exception as exc:
            raise self._boxed(leader, exc, "the CFG rendezvous") from None
        return str(address)

    @staticmethod
    def _bundle(ray: Any, config: EngineConfig) -> dict[str, float]:
        device = config.device
        if device is not None:
            gpu = device.startswith("cuda")
        else:
            gpu = ray.cluster_resources().get("GPU", 0) >= 1
        return {"GPU": 1.0} if gpu else {"CPU": 1.0}

    async def _reserve(self, ray: Any, config: EngineConfig, bundle: dict[str, float]) -> None:
        """The caller's current placement group if it has enough bundles that fit, else a
        new one (owned: removed when the group ends) that must be ready within the timeout."""
        from ray.util import get_current_placement_group
        from ray.util.placement_group import placement_group, remove_placement_group

        n = config.num_workers
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
        timeout = config.ray_placement_timeout_s
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

    def _actor_options(
        self, config: EngineConfig, rank: int, bundle: dict[str, float]
    ) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = "GPU" in bundle
        replaced = self._replaced.get(rank, 0)
        name = f"omni-trio-worker-{rank}-{self._tag}" + (f"-{replaced}" if replaced else "")
        return {
            "name": name,
            "num_cpus": 0 if gpu else 1,
            "num_gpus": 1 if gpu else 0,
            "max_restarts": 0,
            "max_task_retries": 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group,
                placement_group_bundle_index=self._bundle_indexes[rank],
            ),
            "runtime_env": {"env_vars": actor_env(os.environ, config.resolved_torch_threads)},
        }

    async def replace_ranks(self, ranks: Sequence[int]) -> None:
        """A new actor for each of ``ranks`` (whose actors are gone), in the same bundle."""
        assert self._make_actor is not None
        for rank in ranks:
            self._kill_link(self._links[rank])
            self._replaced[rank] = self._replaced.get(rank, 0) + 1
            with secrets_hidden():
                self._links[rank] = _ActorLink(rank, self._make_actor(rank))

    # -- one rank -----------------------------------------------------------------------

    async def serve_rank(
        self, init: RankInit, deliver: Deliver, *, task_status: RankStatus = STARTED
    ) -> None:
        from ..worker.ray_actor import CONTROL_GROUP

        rank = init.rank
        link = self._links[rank]
        actor = link.actor
        # Watch from the start: an actor that dies while loading is seen too.
        link.watch_ref = actor.watch.options(concurrency_group=CONTROL_GROUP).remote()
        try:
            started = await self._await_ref(
                actor.start.remote(init.dist_init_method, init.data_parallel_size)
            )
        except Exception as exc:
            raise self._boxed(rank, exc, "startup") from None
        link.pid, link.node_ip = int(started["pid"]), str(started["node_ip"])
        link.deliver = deliver
        task_status.started(RankStarted(link.pid, started["model_info"], node=link.node_ip))
        poll = actor.poll.options(concurrency_group=CONTROL_GROUP)
        while True:
            try:
                messages = await self._await_ref(poll.remote(HEARTBEAT_INTERVAL_S))
            except Exception as exc:
                raise self._boxed(rank, exc, "a poll") from None
            for message in messages:
                deliver(message)

    def send(self, rank: int, message: WorkerCall | WorkerAbort) -> None:
        from ..worker.ray_actor import CONTROL_GROUP

        link = self._links.get(rank)
        if link is None:
            return
        if isinstance(message, WorkerAbort):
            link.actor.abort.options(concurrency_group=CONTROL_GROUP).remote(message)
            return
        ref = link.actor.call.remote(message)
        self._on_done(ref, lambda future: self._replied(link, message, future))

    def _replied(self, link: _ActorLink, call: WorkerCall, future: Any) -> None:
        """An actor call finished: its value is the rank's reply; a Ray failure of a live
        actor becomes a failure reply (a dead actor is the exit watch's to report)."""
        deliver = link.deliver
        if deliver is None:
            return
        try:
            reply = future.result()
        except Exception as exc:
            ray = self._ray
            if ray is not None and isinstance(exc, ray.exceptions.RayActorError):
                return
            error = self._boxed(link.rank, exc, repr(call.method))
            reply = AsyncOutput(
                AsyncOutputKind.RPC_RESULT,
                rpc_id=call.rpc_id,
                error=str(error),
                error_type=getattr(error, "error_type", None) or type(error).__name__,
                traceback=getattr(error, "traceback_text", None),
                rank=link.rank,
            )
        deliver(reply)

    def kill(self, rank: int) -> None:
        link = self._links.get(rank)
        if link is not None:
            self._kill_link(link)

    def _kill_link(self, link: _ActorLink) -> None:
        try:
            self._ray.kill(link.actor, no_restart=True)
        except Exception:  # already gone
            pass

    async def wait_exited(self, rank: int) -> int | None:
        link = self._links[rank]
        if link.watch_ref is not None:
            try:
                await self._await_ref(link.watch_ref)
            except Exception:  # the actor died: watch only ever ends that way
                pass
        if link.pid is not None and link.node_ip == self._ray.util.get_node_ip_address():
            await _wait_pid_exited(link.pid)
        return None

    async def stop(self, ranks: Sequence[int]) -> None:
        """Stop every forward (control group), shut each worker down behind its current
        call, then kill the idle actors (the executor bounds the wait)."""
        from ..worker.ray_actor import CONTROL_GROUP

        links = [self._links[rank] for rank in ranks]
        for link in links:
            link.actor.abort.options(concurrency_group=CONTROL_GROUP).remote(
                WorkerAbort(everything=True)
            )
        refs = [link.actor.shutdown.remote() for link in links]
        for ref in refs:
            try:
                await self._await_ref(ref)
            except Exception:  # an actor dying now is not a failure
                pass
        for link in links:
            self._kill_link(link)

    def _boxed(self, rank: int, exc: BaseException, what: str) -> Exception:
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


class RayExecutor(GroupExecutor):
    """Backend ``"ray"``: ``num_workers`` Ray actors in one placement group (see
    :class:`RayTransport`)."""

    transport: RayTransport

    def make_transport(self) -> RayTransport:
        return RayTransport()

    @property
    def placement_group(self) -> Any:
        """The placement group the workers run in."""
        return self.transport.placement_group

    @property
    def owns_placement_group(self) -> bool:
        """Whether this executor created its placement group (and removes it at the end)."""
        return self.transport.owns_placement_group
