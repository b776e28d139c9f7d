"""The contract the runner drives: :class:`DiffusionModel`, :class:`ModelInfo`, :class:`StepHook`.

A model turns one *fused batch* of compatible requests into outputs in a single forward.  It
knows nothing about scheduling, lifecycles or trio: the runner calls :meth:`DiffusionModel.generate`
from a worker thread and stops it early by raising from the step hook (there is no other way in;
a forward has no checkpoint but the hook).

A model may also run step-wise through :meth:`DiffusionModel.step_adapter` (see
:mod:`omni_trio.models.step`), which lets requests at different steps share a forward.

Importing this module does not import torch.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from .._core.model_info import FAMILIES as FAMILIES
from .._core.model_info import Family as Family
from .._core.model_info import ModelInfo as ModelInfo
from .._core.request import DiffusionRequest
from .step import MODEL_OUTPUT_TYPES as MODEL_OUTPUT_TYPES
from .step import ModelOutputType as ModelOutputType
from .step import StepAdapter

if TYPE_CHECKING:
    import torch

__all__ = [
    "FAMILIES",
    "MODEL_OUTPUT_TYPES",
    "BatchParams",
    "CfgSplit",
    "DiffusionModel",
    "Family",
    "ModelInfo",
    "ModelOutputType",
    "StepHook",
]


class StepHook(Protocol):
    """Called *before* each denoising step with the 0-based ``step`` and the step ``total``.

    It runs on the thread that runs :meth:`DiffusionModel.generate`.  Raising from it stops the
    forward at once: the exception propagates out of ``generate`` unchanged and no output is
    produced for any request of the batch.
    """

    def __call__(self, step: int, total: int) -> None: ...


@dataclass(frozen=True, slots=True)
class BatchParams:
    """The sampling values every request of a fused batch shares, with defaults resolved.

    ``steps`` is the request's ``total_steps`` (timesteps > sigmas > num_inference_steps).
    """

    height: int
    width: int
    num_inference_steps: int
    steps: int
    guidance_scale: float
    num_outputs: int
    timesteps: tuple[float, ...] | None
    sigmas: tuple[float, ...] | None
    conditioning: str = "text"
    strength: float = 1.0

    @classmethod
    def from_requests(
        cls,
        requests: Sequence[DiffusionRequest],
        generators: Sequence[torch.Generator],
        info: ModelInfo,
        output_type: str,
    ) -> BatchParams:
        """Check that ``requests`` may run as one fused call and return what they share.

        Raises :class:`ValueError` (a runner bug, not user input) for an empty batch, a
        generator count that differs from the request count, an unknown ``output_type``, a
        batch of several requests on a model without batching, or two requests that differ in
        size, schedule, guidance, output count, conditioning or strength (naming both request
        ids and the field).
        Negative prompts may be mixed: a missing one means the empty prompt.
        """
        if not requests:
            raise ValueError("generate() needs at least one request")
        if len(generators) != len(requests):
            raise ValueError(
                f"got {len(generators)} generators for {len(requests)} requests; "
                "every request needs its own generator"
            )
        if output_type not in MODEL_OUTPUT_TYPES:
            raise ValueError(
                f"output_type must be one of {', '.join(MODEL_OUTPUT_TYPES)}, got {output_type!r}"
            )
        if len(requests) > 1 and not info.supports_batch:
            raise ValueError(f"model {info.name} cannot run {len(requests)} requests in one call")

        def values(request: DiffusionRequest) -> dict[str, Any]:
            sp = request.sampling
            return {
                "height": sp.height or info.default_height,
                "width": sp.width or info.default_width,
                "num_inference_steps": sp.num_inference_steps,
                "steps": sp.total_steps,
                "guidance_scale": float(sp.guidance_scale),
                "num_outputs": sp.num_outputs_per_prompt,
                "timesteps": tuple(sp.timesteps) if sp.timesteps is not None else None,
                "sigmas": tuple(sp.sigmas) if sp.sigmas is not None else None,
                "conditioning": sp.conditioning,
                "strength": sp.effective_strength,
            }

        first = values(requests[0])
        for request in requests[1:]:
            other = values(request)
            for key, value in first.items():
                if other[key] != value:
                    raise ValueError(
                        f"requests {requests[0].request_id!r} and {request.request_id!r} cannot "
                        f"share a fused call: {key} {value!r} != {other[key]!r}"
                    )
        return cls(**first)


class CfgSplit(Protocol):
    """What a model needs of a classifier-free-guidance parallel group: hooks on its UNet and
    a block inside which every UNet call is CFG-doubled and runs half on each rank.  The
    worker's :class:`~omni_trio.worker.cfg_parallel.CfgParallel` is one."""

    def install(self, unet: Any) -> Any:
        """Hook ``unet``; returns a handle whose ``remove()`` takes the hooks off."""
        ...

    def guided(self) -> AbstractContextManager[None]:
        """Split every UNet call inside the block (each is CFG-doubled)."""
        ...


class DiffusionModel(abc.ABC):
    """A loaded model.  One :meth:`generate` runs at a time (calls are serialised).

    Thread use: :meth:`generate` blocks and is meant to run in a worker thread; :meth:`to` and
    :meth:`close` must not run concurrently with it.
    """

    info: ModelInfo
    #: Whether the model holds weights worth a full garbage collection when it closes or
    #: sleeps (the runner then collects at once, so their memory is back before it returns).
    #: A model without weights (``builtin:echo``) says False: a full collection of a process
    #: that imported torch takes tens of milliseconds, and a fuzzing campaign closes engines
    #: all the time.
    holds_weights: ClassVar[bool] = True

    @abc.abstractmethod
    def generate(
        self,
        requests: Sequence[DiffusionRequest],
        generators: Sequence[torch.Generator],
        *,
        output_type: ModelOutputType,
        on_step: StepHook,
    ) -> list[list[Any]]:
        """One fused forward for compatible requests (same size, steps, guidance, n).

        Returns, per request and in the same order, a list of
        ``sampling.num_outputs_per_prompt`` outputs: float32 numpy HWC arrays in [0, 1] for
        ``"np"``, torch tensors ``(C, h, w)`` for ``"latent"``.  No output shares memory with
        another output.  ``generators[i]`` is request *i*'s own, already seeded generator; all
        of request *i*'s randomness comes from it (its *n* outputs draw from it in order), so
        the same seeds in the same batch composition give bit-identical outputs.  Batch
        composition matters: the same request in a different batch may differ numerically.

        ``on_step(step, total)`` is called before every denoising step; whatever it raises
        propagates unchanged and ends the forward.  Raises :class:`ValueError` for an
        incompatible batch (see :meth:`BatchParams.from_requests`) and
        :class:`~omni_trio.errors.InvalidRequestError` for a request the model cannot serve.
        """

    def step_adapter(self) -> StepAdapter | None:
        """The adapter that runs this model one step at a time, or ``None`` if it cannot.

        Not ``None`` exactly when ``info.supports_steps``.  The adapter is bound to this model
        (the same object on every call) and keeps no per-request state of its own.
        """
        return None

    def enable_cfg_parallel(self, cfg: CfgSplit) -> bool:
        """Split this model's classifier-free-guidance UNet calls across ``cfg``'s two ranks.

        Returns ``True`` if the model did (from now on every CFG-doubled call of
        :meth:`generate` and of its step adapter runs half on each rank, with the same
        result), ``False`` if it cannot (then every rank computes everything, as before).
        Call it once, right after loading, on every rank alike.  The default cannot.
        """
        return False

    def sleep(self, level: int, directory: str | None = None) -> int:
        """Release the weights' memory at ``level`` (see :mod:`omni_trio.models.offload`:
        1 keeps a copy off the device, on a CPU in a file under ``directory``; 2 keeps
        nothing and :meth:`wake_up` reloads them); returns the bytes released.  Never called
        during :meth:`generate`; until :meth:`wake_up`, :meth:`generate` and the step
        adapter raise ``RuntimeError``.  Raises ``ValueError`` for a level other than 1 or
        2 (or 2 where the model cannot reload).  The default holds no weights: it releases
        nothing."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        return 0

    def wake_up(self) -> int:
        """Take the weights back after :meth:`sleep`; returns the bytes restored (0 when
        awake).  If it raises, the model is still asleep and waking may be tried again."""
        return 0

    def configure_loras(self, registry: Mapping[str, str], max_loaded: int) -> None:
        """Register the LoRA adapters requests may name (name -> directory or shipped
        ``builtin:`` name; :mod:`omni_trio.models.lora`), at most ``max_loaded`` loaded at
        once.  Called once after loading.  A model with ``info.lora_input`` applies each
        request's ``sampling.lora`` in :meth:`generate` (and its step adapter); the default
        applies none, and the engine refuses requests naming one at admission."""
        return None

    @abc.abstractmethod
    def to(self, device: torch.device | str) -> None:
        """Move the weights to ``device`` (later outputs are produced there)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the weights.  Idempotent; :meth:`generate` raises ``RuntimeError`` after it."""
