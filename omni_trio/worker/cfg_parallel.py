"""Classifier-free-guidance parallelism: two ranks split every guided UNet call.

With classifier-free guidance each denoising step runs the UNet on a doubled batch: first all
unconditional rows, then all conditional rows, in the same request order (the layout of the
diffusers ``StableDiffusionPipeline`` and of our ``Text2ImageStepAdapter``).  With CFG
parallelism both ranks run the *same* model code on the *same* requests with the *same* seeds,
so text encoding, latents, schedulers and the VAE are computed redundantly and stay
bit-identical across ranks; only the UNet call is split::

    rows   [0 : B/2]  unconditional  -> rank 1
    rows [B/2 : B]    conditional    -> rank 0
    all_gather(half outputs) -> [rank 1's | rank 0's] == the full-batch output, on both ranks

The split is done by hooks on the UNet (:meth:`CfgParallel.install`), active only inside
:meth:`CfgParallel.guided`, which the model enters around a CFG-doubled call; any other call
(no guidance, ``guidance_scale <= 1``) runs whole on every rank.

Invariant: both ranks make the same sequence of collective calls (one ``all_gather`` per
guided UNet call, one ``all_reduce`` per :meth:`CfgParallel.agree_stop`), so every call that
runs a forward must reach both ranks.  The runner keeps it by deciding early stops
collectively (:meth:`CfgParallel.agree_stop`) and never acting on per-rank stop flags alone.

Failure: if a rank fails inside a split call, or dies, its peer blocks in the collective until
``timeout_s`` and then raises :class:`CollectiveError` (gloo; NCCL's watchdog aborts the process
instead).  The group is then unusable (the ranks are out of step): every later collective
raises :class:`CollectiveError` at once, and the runner lets it escape as a worker failure,
never as one request's error.  The executor fails the group closed long before the timeout
when a worker process dies.

Importing this module does not import torch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["CFG_WORLD_SIZE", "CfgParallel", "CfgStatistics", "CollectiveError", "init_cfg_group"]

# The conditional and the unconditional branch: one rank each.
CFG_WORLD_SIZE = 2


class CollectiveError(RuntimeError):
    """A collective of the CFG-parallel group failed (peer gone, timeout); the group is
    broken for good, so this worker cannot run forwards any more."""


@dataclass(frozen=True, slots=True)
class CfgStatistics:
    """What the UNet hook of one rank has seen since :meth:`CfgParallel.install`.

    ``unet_calls``: UNet forwards; ``split_calls``: of those, the ones split across ranks;
    ``rows_requested``: batch rows the callers passed; ``rows_computed``: rows this rank's UNet
    actually ran (half of every split call's rows, all of the others').
    """

    unet_calls: int = 0
    split_calls: int = 0
    rows_requested: int = 0
    rows_computed: int = 0


class _Hooks:
    """The removable pair of hooks :meth:`CfgParallel.install` put on one UNet."""

    def __init__(self, *handles: Any) -> None:
        self._handles = handles

    def remove(self) -> None:
        """Take both hooks off the UNet; idempotent."""
        for handle in self._handles:
            handle.remove()


def _slice_batch(value: Any, batch: int, rows: slice) -> Any:
    """``value`` with every tensor whose first dimension is ``batch`` cut to ``rows``,
    looking into tuples, lists and dicts; everything else (0-d timesteps, scalars) as is."""
    import torch

    if isinstance(value, torch.Tensor):
        if value.dim() >= 1 and value.shape[0] == batch:
            return value[rows]
        return value
    if isinstance(value, tuple):
        return tuple(_slice_batch(v, batch, rows) for v in value)
    if isinstance(value, list):
        return [_slice_batch(v, batch, rows) for v in value]
    if isinstance(value, dict):
        return {k: _slice_batch(v, batch, rows) for k, v in value.items()}
    return value


class CfgParallel:
    """This rank's member of a two-rank CFG-parallel group (see the module docstring).

    Thread use: the model calls (``guided``, the hooks, ``agree_stop``) run on the worker's
    forward thread, one at a time; :meth:`close` must not run concurrently with them.
    """

    def __init__(self, rank: int, world_size: int, *, backend: str) -> None:
        if world_size != CFG_WORLD_SIZE:
            raise ValueError(f"CFG parallelism needs exactly 2 ranks, got {world_size}")
        if rank not in (0, 1):
            raise ValueError(f"rank must be 0 or 1, got {rank}")
        import torch

        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        # Small tensors of collectives live here: NCCL needs them on the GPU.
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if backend == "nccl"
            else torch.device("cpu")
        )
        # True only inside ``guided()``: the UNet call is CFG-doubled and will be split.
        self.active = False
        # Rows of the split call in flight (set by the pre-hook, taken by the forward hook).
        self._pending_batch: int | None = None
        self._stats = CfgStatistics()
        self._stats_lock = threading.Lock()
        self._closed = False
        # The first collective failure; once set, every collective raises at once.
        self._broken: BaseException | None = None

    # -- the model's side -----------------------------------------------------------------

    @contextmanager
    def guided(self) -> Iterator[None]:
        """Split every UNet call inside the block: the model promises each is CFG-doubled
        (all unconditional rows, then all conditional rows).  Not reentrant."""
        self.active = True
        try:
            yield
        finally:
            self.active = False
            self._pending_batch = None

    def install(self, unet: torch.nn.Module) -> _Hooks:
        """Hook ``unet`` so calls inside :meth:`guided` run half on each rank.

        Outside :meth:`guided` the hooks only count (:meth:`statistics`).  Returns a handle
        whose ``remove()`` takes the hooks off.
        """
        pre = unet.register_forward_pre_hook(self._pre_hook, with_kwargs=True)
        post = unet.register_forward_hook(self._post_hook, with_kwargs=True)
        return _Hooks(pre, post)

    def _pre_hook(
        self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        sample = args[0] if args else kwargs["sample"]
        batch = int(sample.shape[0])
        if not self.active:
            self._pending_batch = None
            self._count(batch, batch, split=False)
            return None
        if batch % 2:
            raise ValueError(f"a CFG-doubled UNet call has an even batch, got {batch} rows")
        half = batch // 2
        # Rank 0 takes the conditional (second) half, rank 1 the unconditional (first) half.
        rows = slice(half, batch) if self.rank == 0 else slice(0, half)
        self._pending_batch = batch
        self._count(batch, half, split=True)
        return _slice_batch(args, batch, rows), _slice_batch(kwargs, batch, rows)

    def _post_hook(
        self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        import torch

        batch, self._pending_batch = self._pending_batch, None
        if batch is None:
            return None
        if isinstance(output, torch.Tensor):
            return self._gather(output, batch)
        if isinstance(output, tuple):
            return (self._gather(output[0], batch), *output[1:])
        # A diffusers BaseOutput (UNet2DConditionOutput): setting the field updates the dict.
        output.sample = self._gather(output.sample, batch)
        return output

    def _gather(self, half: torch.Tensor, batch: int) -> torch.Tensor:
        """Both halves, in the caller's layout: unconditional (rank 1's) then conditional."""
        import torch
        import torch.distributed as dist

        if half.shape[0] * 2 != batch:
            raise RuntimeError(f"the UNet returned {half.shape[0]} rows for {batch // 2}")
        home = half.device
        send = half.contiguous()
        if self.backend == "gloo" and send.device.type != "cpu":
            send = send.cpu()  # gloo's CUDA paths are not relied on
        parts = [torch.empty_like(send) for _ in range(self.world_size)]
        self._collective("all_gather", dist.all_gather, parts, send)
        return torch.cat([parts[1], parts[0]]).to(home)

    def _count(self, requested: int, computed: int, *, split: bool) -> None:
        with self._stats_lock:
            s = self._stats
            self._stats = CfgStatistics(
                unet_calls=s.unet_calls + 1,
                split_calls=s.split_calls + int(split),
                rows_requested=s.rows_requested + requested,
                rows_computed=s.rows_computed + computed,
            )

    def statistics(self) -> CfgStatistics:
        """A snapshot of what the hooks have seen (cumulative)."""
        with self._stats_lock:
            return self._stats

    # -- the runner's side ----------------------------------------------------------------

    def agree_stop(self, local: bool) -> bool:
        """True if ANY rank wants to stop (``local`` is this rank's wish).

        A collective: every rank must call it at the same point of the same forward.  Blocks
        until the peer calls it (at most ``timeout_s``, then ``RuntimeError``).
        """
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if local else 0], dtype=torch.int32, device=self.device)
        self._collective("all_reduce", dist.all_reduce, flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _collective(self, name: str, run: Any, *args: Any, **kwargs: Any) -> None:
        """Run one collective; any failure breaks the group for good (:class:`CollectiveError`)."""
        if self._closed:
            raise CollectiveError(f"rank {self.rank}: the CFG-parallel group is closed")
        if self._broken is not None:
            raise CollectiveError(
                f"rank {self.rank}: the CFG-parallel group broke earlier: {self._broken!r}"
            )
        try:
            run(*args, **kwargs)
        except Exception as exc:
            self._broken = exc
            raise CollectiveError(
                f"rank {self.rank}: CFG-parallel {name} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def close(self) -> None:
        """Destroy the process group; idempotent."""
        import torch.distributed as dist

        if self._closed:
            return
        self._closed = True
        if dist.is_initialized():
            dist.destroy_process_group()


def init_cfg_group(
    rank: int,
    world_size: int,
    init_method: str,
    *,
    timeout_s: float,
    device: torch.device | str = "cpu",
    backend: str | None = None,
) -> CfgParallel:
    """Join this process to the two-rank group at ``init_method`` (``tcp://127.0.0.1:PORT``).

    Blocks until both ranks have joined, at most ``timeout_s`` (then ``RuntimeError`` or
    ``DistStoreError``, a ``RuntimeError`` subclass); ``timeout_s`` also bounds every later
    collective.  ``backend`` defaults to ``"nccl"`` for a CUDA ``device`` (each rank on its own
    GPU: NCCL refuses two ranks on one) and ``"gloo"`` otherwise.  Raises ``ValueError``
    unless ``world_size`` is 2 and ``rank`` 0 or 1, and ``RuntimeError`` if this process
    already has a default process group (torch keeps one per process).
    """
    import torch
    import torch.distributed as dist

    if world_size != CFG_WORLD_SIZE:
        raise ValueError(f"CFG parallelism needs exactly 2 ranks, got {world_size}")
    if rank not in (0, 1):
        raise ValueError(f"rank must be 0 or 1, got {rank}")
    if dist.is_initialized():
        raise RuntimeError("this process already has a torch.distributed process group")
    device = torch.device(device)
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if backend == "nccl":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    timeout = timedelta(seconds=timeout_s)
    store = _loopback_store(init_method, rank, world_size, timeout)
    if store is not None:
        kwargs["store"] = store
    else:
        kwargs["init_method"] = init_method
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    return CfgParallel(rank, world_size, backend=backend)


def _loopback_store(init_method: str, rank: int, world_size: int, timeout: timedelta) -> Any | None:
    """For a loopback ``tcp://`` rendezvous, the group's store, listening on loopback only.

    torch's own ``tcp://`` init makes rank 0's store listen on every interface; here rank 0
    binds the port on the loopback host itself and hands the socket to the store.  None for
    any other init method (a multi-node rendezvous binds as torch does, see
    docs/multi-node.md).  Rank 0's store owns the listening socket from then on (it closes
    it when the group is destroyed)."""
    import ipaddress
    import socket
    from urllib.parse import urlsplit

    import torch.distributed as dist

    parts = urlsplit(init_method)
    if parts.scheme != "tcp" or parts.hostname is None or parts.port is None:
        return None
    try:
        if not ipaddress.ip_address(parts.hostname).is_loopback:
            return None
    except ValueError:
        return None
    host, port = parts.hostname, parts.port
    if rank != 0:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
        store = dist.TCPStore(
            host,
            port,
            world_size,
            True,
            timeout,
            wait_for_workers=False,
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        with contextlib.suppress(OSError):  # the store may have taken the descriptor
            listener.close()
        raise
    listener.detach()  # the store's now
    return store
