"""The step contract: :class:`StepAdapter` runs a model one denoising step at a time.

Request mode (:meth:`~omni_trio.models.base.DiffusionModel.generate`) runs a whole batch from
noise to image in one call.  Step mode splits that call so a runner can batch requests that are
at *different* steps (continuous batching) and stream previews:

1. :meth:`StepAdapter.prepare_encode` once per request: prompt embeddings, the request's own
   scheduler copy and timesteps, the initial latents drawn from its generator;
2. :meth:`StepAdapter.denoise_step` once per tick: ONE fused model call over every live
   request, each at its own timestep;
3. :meth:`StepAdapter.step_scheduler` per request: advance its latents with its own scheduler;
4. :meth:`StepAdapter.post_decode` when :attr:`StepState.denoise_completed` (or for a preview);
5. :meth:`StepAdapter.release` when the runner drops the state.

All per-request state lives in a :class:`StepState` the runner owns; an adapter keeps none
between calls, so any subset of live states may form the next fused call.  Stepping one request
alone from ``prepare_encode`` to ``post_decode`` gives exactly what ``generate`` gives for it
alone with the same seed.

Importing this module does not import torch.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from .._core.request import DiffusionRequest

if TYPE_CHECKING:
    import torch

__all__ = [
    "MODEL_OUTPUT_TYPES",
    "ModelOutputType",
    "StepAdapter",
    "StepState",
    "check_step_batch",
    "check_step_left",
]

# What a model hands the runner: HWC float arrays in [0, 1] ("np") or latent tensors.
ModelOutputType = Literal["np", "latent"]
MODEL_OUTPUT_TYPES: tuple[str, ...] = ("np", "latent")


@dataclass(eq=False)
class StepState:
    """Per-request denoising state, owned by the runner (never by the scheduler).

    Created by :meth:`StepAdapter.prepare_encode`; only the adapter that made it changes it.
    Compared and hashed by identity.
    """

    request: DiffusionRequest
    # The request's own generator, seeded from its seed; all of its randomness comes from it.
    generator: torch.Generator
    # Denoising steps done so far: 0 <= step_index <= total_steps.
    step_index: int = 0
    # The number of denoising steps this request runs (set by prepare_encode).  It is what the
    # scheduler decided, e.g. len(sigmas) - 1 for Euler given explicit sigmas.
    total_steps: int = 0
    # (n, C, h, w) with n = num_outputs_per_prompt; None for models without tensors (echo).
    latents: Any = None
    # The request's OWN deep copy of the diffusers scheduler, with set_timesteps applied, so
    # stateful schedulers (Euler's step index, multistep histories) never leak across requests.
    scheduler: Any = None
    # 1-D; timesteps[step_index] is the timestep of the next step.
    timesteps: Any = None
    # Adapter-private values (prompt embeddings, scheduler step kwargs, ...).
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def denoise_completed(self) -> bool:
        """Every denoising step has run; the state is ready for the final ``post_decode``."""
        return self.step_index >= self.total_steps


class StepAdapter(abc.ABC):
    """Runs one model step-wise; see the module docstring for the call order.

    Every call blocks (run it in a worker thread), checkpoints nowhere and serialises with the
    model's other calls (``generate``, ``to``).  After the model is closed every call raises
    ``RuntimeError``.  An exception from a call concerns only the states passed to it; other
    states are untouched and may continue.
    """

    @abc.abstractmethod
    def prepare_encode(self, request: DiffusionRequest, generator: torch.Generator) -> StepState:
        """Encode ``request``'s prompt, set up its own scheduler and draw its initial latents.

        ``generator`` is the request's own, already seeded generator; the initial latents are
        drawn from it exactly as ``generate`` draws them for a batch of one request.  Raises
        :class:`~omni_trio.errors.InvalidRequestError` for a request the model cannot serve
        (as ``generate`` would) and ``ValueError`` for malformed model-specific ``extra_args``.
        """

    @abc.abstractmethod
    def denoise_step(self, states: Sequence[StepState]) -> list[Any]:
        """ONE fused model call for all ``states``, each at its own current timestep.

        Returns each state's model prediction (classifier-free guidance applied), in the order
        of ``states``, to pass to :meth:`step_scheduler`.  The states may be at different steps
        and have different step counts.  Advances no state (a scheduler copy may note that its
        input was scaled; calling again is harmless, so a failed fused call may be retried
        state by state).  Raises ``ValueError`` for
        an empty list, a state with no step left, or states that cannot share a call (size,
        output count, guidance; the message names both request ids and the field).
        """

    @abc.abstractmethod
    def step_scheduler(self, state: StepState, noise_pred: Any) -> None:
        """Advance ``state`` by one step with its own scheduler; ``step_index`` grows by one.

        ``noise_pred`` is ``state``'s entry of :meth:`denoise_step`'s result.  If it raises,
        ``state`` is unchanged (``step_index`` included) and must not be stepped further.
        Raises ``ValueError`` if ``state`` has no step left.
        """

    @abc.abstractmethod
    def post_decode(self, state: StepState, *, output_type: ModelOutputType) -> list[Any]:
        """Decode the CURRENT latents into ``num_outputs_per_prompt`` outputs.

        The outputs are what :meth:`~omni_trio.models.base.DiffusionModel.generate` returns for
        the request (float32 HWC numpy arrays in [0, 1] for ``"np"``, ``(C, h, w)`` tensors for
        ``"latent"``), sharing no memory with the state or each other.  Before the last step it
        is a preview of the partly denoised latents.  Does not change ``state``.
        """

    def release(self, state: StepState) -> None:  # noqa: B027 - an optional hook
        """Drop what ``state`` holds (tensors, the scheduler copy).  The default does nothing;
        ``state`` must not be used afterwards."""


def check_step_batch(
    states: Sequence[StepState], key: Callable[[StepState], Mapping[str, Any]]
) -> None:
    """Raise ``ValueError`` unless ``states`` may share one :meth:`StepAdapter.denoise_step`.

    ``key(state)`` gives the values that must be equal across the call; the message names the
    first mismatching pair of request ids and the field.  Also rejects an empty batch, a state
    passed twice and a state with no step left.
    """
    if not states:
        raise ValueError("denoise_step() needs at least one state")
    seen: set[int] = set()
    for state in states:
        if id(state) in seen:
            raise ValueError(f"the state of request {state.request_id!r} is passed twice")
        seen.add(id(state))
        check_step_left(state)
    first = key(states[0])
    for state in states[1:]:
        other = key(state)
        for name, value in first.items():
            if other[name] != value:
                raise ValueError(
                    f"requests {states[0].request_id!r} and {state.request_id!r} cannot share a "
                    f"step: {name} {value!r} != {other[name]!r}"
                )


def check_step_left(state: StepState) -> None:
    """Raise ``ValueError`` if ``state`` has no step left (for :meth:`step_scheduler`)."""
    if state.denoise_completed:
        raise ValueError(
            f"request {state.request_id!r} has no step left "
            f"({state.step_index} of {state.total_steps} done)"
        )
