"""Step mode for diffusers pipelines: the :class:`~omni_trio.models.step.StepAdapter` of a
:class:`~omni_trio.models.pipeline.DiffusersModel`.

Each adapter re-does, one step at a time, the math of the pipeline ``__call__`` that request
mode runs, so a request stepped alone gives bit-identical outputs to ``generate`` for it alone:

- ``text2image`` (``StableDiffusionPipeline.__call__``): ``encode_prompt``; a deep copy of the
  scheduler with ``retrieve_timesteps`` applied; latents ``randn_tensor((n, C, h, w),
  [generator] * n) * init_noise_sigma``; per step ``scale_model_input`` with the request's own
  scheduler, the UNet, ``uncond + g * (cond - uncond)`` and ``scheduler.step(..., **extra step
  kwargs)``; then ``vae.decode``, the safety checker (if any) and ``image_processor``.
  From a picture (``SamplingParams.image``, and ``mask_image`` for inpainting) the schedule
  and first latents are those of diffusers' image-to-image and inpainting pipelines, and an
  inpainting step ends with their blend (:mod:`omni_trio.models.pipeline_image`).
- ``unconditional`` (``DDIMPipeline``/``DDPMPipeline.__call__``): latents
  ``randn_tensor((n, C, H, W), [generator] * n)``; per step the UNet and ``scheduler.step``;
  then ``(x / 2 + 0.5).clamp(0, 1)``.

A fused :meth:`denoise_step` is ONE UNet call with a per-row timestep tensor (each request's
rows carry its own current timestep).  With classifier-free guidance the rows are all
unconditional rows (request by request, n rows each) followed by all conditional rows in the
same order -- for a batch of one exactly the layout of the pipeline, and the layout CFG
parallelism splits (:meth:`~omni_trio.models.pipeline.DiffusersModel.enable_cfg_parallel`).
Batching changes the UNet's numerics in the last bits only (measured in
``tests/models/test_pipeline_step.py``).

Other pipelines of the supported families (ones that override ``__call__``, UNets with a
guidance embedding) have no step adapter: their ``__call__`` may do math this module does not.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from .base import MODEL_OUTPUT_TYPES, BatchParams, Family, ModelInfo, ModelOutputType
from .pipeline_checks import check_text2image_schedule, check_unconditional_params
from .pipeline_image import keep_unmasked, start_from_picture
from .step import StepAdapter, StepState, check_step_batch, check_step_left

if TYPE_CHECKING:
    import torch

    from .._core.request import DiffusionRequest

__all__ = [
    "PipelineHost",
    "Text2ImageStepAdapter",
    "UnconditionalStepAdapter",
    "make_step_adapter",
]


class PipelineHost(Protocol):
    """What a step adapter needs of its model (a ``DiffusersModel`` is one): what it is,
    its pipeline, the lock every use of the pipeline holds, the CFG-parallel block, and the
    LoRA adapters (made active while holding the lock)."""

    info: ModelInfo

    @property
    def pipeline(self) -> Any: ...

    @property
    def lock(self) -> AbstractContextManager[Any]: ...

    def cfg_guided(self, doubled: bool) -> AbstractContextManager[None]: ...

    def use_lora(self, spec: Any) -> None: ...


def make_step_adapter(model: PipelineHost, pipe: Any, family: Family) -> StepAdapter | None:
    """The step adapter for ``model`` (wrapping ``pipe`` of ``family``), or ``None`` when
    ``pipe``'s ``__call__`` is not one whose math the adapters reproduce."""
    from diffusers import DDIMPipeline, DDPMPipeline, StableDiffusionPipeline

    call = type(pipe).__call__
    if family == "text2image":
        if call is StableDiffusionPipeline.__call__ and pipe.unet.config.time_cond_proj_dim is None:
            return Text2ImageStepAdapter(model)
        return None
    if family == "unconditional" and call in (DDIMPipeline.__call__, DDPMPipeline.__call__):
        return UnconditionalStepAdapter(model)
    return None


def _check_output_type(output_type: str) -> None:
    if output_type not in MODEL_OUTPUT_TYPES:
        raise ValueError(
            f"output_type must be one of {', '.join(MODEL_OUTPUT_TYPES)}, got {output_type!r}"
        )


def _row_timesteps(states: Sequence[StepState], device: torch.device) -> torch.Tensor:
    """One timestep per latent row: each state's current timestep, repeated for its n rows."""
    import torch

    current = [state.timesteps[state.step_index] for state in states]
    dtype = functools.reduce(torch.promote_types, (t.dtype for t in current))
    return torch.cat(
        [
            t.to(device=device, dtype=dtype).reshape(1).expand(state.latents.shape[0])
            for t, state in zip(current, states, strict=True)
        ]
    )


class _DiffusersStepAdapter(StepAdapter):
    """What both families share: the model lock, scheduler stepping and cleanup."""

    def __init__(self, model: PipelineHost) -> None:
        self._model = model

    def _params(self, request: DiffusionRequest, generator: torch.Generator) -> BatchParams:
        return BatchParams.from_requests([request], [generator], self._model.info, "np")

    def _batch_key(self, state: StepState) -> Mapping[str, Any]:
        latents = state.latents
        return {
            "latent shape": tuple(latents.shape),
            "dtype": latents.dtype,
            "device": latents.device,
        }

    def step_scheduler(self, state: StepState, noise_pred: Any) -> None:
        """See :meth:`StepAdapter.step_scheduler`."""
        import torch

        with self._model.lock, torch.no_grad():
            self._model.pipeline  # noqa: B018 - raises RuntimeError once the model is closed
            check_step_left(state)
            t = state.timesteps[state.step_index]
            state.latents = state.scheduler.step(
                noise_pred, t, state.latents, **state.extra["step_kwargs"], return_dict=False
            )[0]
            state.step_index += 1
            inpaint = state.extra.get("inpaint")
            if inpaint is not None:  # outside the mask: the picture, noised to the next step
                state.latents = keep_unmasked(
                    state.scheduler, state.latents, inpaint, state.step_index
                )

    def release(self, state: StepState) -> None:
        state.latents = None
        state.scheduler = None
        state.timesteps = None
        state.extra.clear()


class Text2ImageStepAdapter(_DiffusersStepAdapter):
    """Step mode for ``StableDiffusionPipeline`` (see the module docstring).

    ``state.extra`` holds ``prompt_embeds`` and ``negative_prompt_embeds`` (``None`` without
    guidance), each ``(n, seq, dim)``, ``guidance_scale`` and the scheduler ``step_kwargs``.
    """

    def prepare_encode(self, request: DiffusionRequest, generator: torch.Generator) -> StepState:
        """See :meth:`StepAdapter.prepare_encode`.  Raises
        :class:`~omni_trio.errors.InvalidRequestError` for explicit timesteps/sigmas the
        scheduler does not take."""
        import torch
        from diffusers.pipelines.stable_diffusion.pipeline_stable_diffusion import (
            retrieve_timesteps,
        )
        from diffusers.utils.torch_utils import randn_tensor

        with self._model.lock, torch.no_grad():
            pipe = self._model.pipeline
            self._model.use_lora(request.sampling.lora)  # the text encoder may be adapted
            params = self._params(request, generator)
            check_text2image_schedule(self._model.info, pipe.scheduler, params, request.request_id)
            n = params.num_outputs
            generators = [generator] * n  # what generate passes for a batch of one request
            device = pipe._execution_device
            guided = params.guidance_scale > 1
            negative = request.sampling.negative_prompt
            prompt_embeds, negative_embeds = pipe.encode_prompt(
                [request.prompt],
                device,
                n,
                guided,
                None if negative is None else [negative],
            )
            scheduler = copy.deepcopy(pipe.scheduler)
            # Explicit timesteps win over sigmas, as in generate.
            timesteps_arg: Any = list(params.timesteps) if params.timesteps is not None else None
            sigmas_arg = (
                list(params.sigmas) if params.sigmas is not None and timesteps_arg is None else None
            )
            # ``steps``: the step count asked for (PNDM's and second-order schedulers'
            # timesteps are more than that); a picture's strength cuts it, as in diffusers.
            timesteps, steps = retrieve_timesteps(
                scheduler, params.num_inference_steps, device, timesteps_arg, sigmas_arg
            )
            extra: dict[str, Any] = {
                "prompt_embeds": prompt_embeds,
                "negative_prompt_embeds": negative_embeds,
                "guidance_scale": params.guidance_scale,
                # prepare_extra_step_kwargs only inspects the scheduler's class.
                "step_kwargs": pipe.prepare_extra_step_kwargs(generators, 0.0),
            }
            sp = request.sampling
            if sp.image is not None:
                start = start_from_picture(
                    pipe,
                    scheduler,
                    image=sp.image,
                    mask_image=sp.mask_image,
                    strength=sp.effective_strength,
                    num_inference_steps=int(steps),
                    height=int(params.height),
                    width=int(params.width),
                    generators=generators,
                    device=device,
                    dtype=prompt_embeds.dtype,
                )
                timesteps, latents = start.timesteps, start.latents
                if start.mask is not None:
                    extra["inpaint"] = start
            else:
                scale = pipe.vae_scale_factor
                shape = (
                    n,
                    pipe.unet.config.in_channels,
                    int(params.height) // scale,
                    int(params.width) // scale,
                )
                latents = randn_tensor(
                    shape, generator=generators, device=device, dtype=prompt_embeds.dtype
                )
                latents = latents * scheduler.init_noise_sigma
            return StepState(
                request=request,
                generator=generator,
                total_steps=len(timesteps),
                latents=latents,
                scheduler=scheduler,
                timesteps=timesteps,
                extra=extra,
            )

    def _batch_key(self, state: StepState) -> Mapping[str, Any]:
        return {
            **super()._batch_key(state),
            "guidance_scale": state.extra["guidance_scale"],
            "lora": tuple(tuple(pair) for pair in state.request.sampling.lora),
        }

    def denoise_step(self, states: Sequence[StepState]) -> list[Any]:
        """See :meth:`StepAdapter.denoise_step`.  Negative prompts may be mixed (a missing one
        is the empty prompt), as in ``generate``."""
        import torch

        with self._model.lock, torch.no_grad():
            pipe = self._model.pipeline
            check_step_batch(states, self._batch_key)
            if states:
                self._model.use_lora(states[0].request.sampling.lora)
            device = pipe._execution_device
            # Each request is scaled by its own scheduler (Euler: by its own current sigma).
            latents = torch.cat(
                [
                    state.scheduler.scale_model_input(
                        state.latents, state.timesteps[state.step_index]
                    )
                    for state in states
                ]
            )
            timestep = _row_timesteps(states, device)
            embeds = torch.cat([state.extra["prompt_embeds"] for state in states])
            guidance = states[0].extra["guidance_scale"]
            guided = states[0].extra["negative_prompt_embeds"] is not None
            if guided:
                latents = torch.cat([latents, latents])
                timestep = torch.cat([timestep, timestep])
                negatives = torch.cat([state.extra["negative_prompt_embeds"] for state in states])
                embeds = torch.cat([negatives, embeds])
            with self._model.cfg_guided(guided):
                noise = pipe.unet(
                    latents,
                    timestep,
                    encoder_hidden_states=embeds,
                    timestep_cond=None,
                    cross_attention_kwargs=None,
                    added_cond_kwargs=None,
                    return_dict=False,
                )[0]
            if guided:
                uncond, cond = noise.chunk(2)
                noise = uncond + guidance * (cond - uncond)
            return list(noise.split([state.latents.shape[0] for state in states]))

    def post_decode(self, state: StepState, *, output_type: ModelOutputType) -> list[Any]:
        """See :meth:`StepAdapter.post_decode`: ``"latent"`` gives the current latents
        ``(4, h, w)``; ``"np"`` runs the VAE (and the safety checker, if the pipeline has
        one)."""
        import torch

        _check_output_type(output_type)
        with self._model.lock, torch.no_grad():
            pipe = self._model.pipeline
            latents = state.latents
            n = latents.shape[0]
            if output_type == "latent":
                return [latents[j].clone() for j in range(n)]
            image = pipe.vae.decode(
                latents / pipe.vae.config.scaling_factor,
                return_dict=False,
                generator=[state.generator] * n,
            )[0]
            image, nsfw = pipe.run_safety_checker(
                image, pipe._execution_device, state.extra["prompt_embeds"].dtype
            )
            denormalize = [True] * n if nsfw is None else [not flagged for flagged in nsfw]
            images = pipe.image_processor.postprocess(
                image, output_type="np", do_denormalize=denormalize
            ).astype("float32", copy=False)
            return [images[j].copy() for j in range(n)]


class UnconditionalStepAdapter(_DiffusersStepAdapter):
    """Step mode for ``DDIMPipeline``/``DDPMPipeline`` (see the module docstring).

    The prompt and guidance are ignored; the size is the UNet's.  ``state.latents`` is the
    pixel-space sample ``(n, 3, H, W)``.
    """

    def prepare_encode(self, request: DiffusionRequest, generator: torch.Generator) -> StepState:
        """See :meth:`StepAdapter.prepare_encode`.  Raises
        :class:`~omni_trio.errors.InvalidRequestError` for explicit timesteps/sigmas or a size
        other than the model's."""
        import torch
        from diffusers import DDIMPipeline
        from diffusers.utils.torch_utils import randn_tensor

        with self._model.lock, torch.no_grad():
            pipe = self._model.pipeline
            params = self._params(request, generator)
            check_unconditional_params(self._model.info, params, request.request_id)
            n = params.num_outputs
            generators = [generator] * n
            unet = pipe.unet
            shape = (
                n,
                unet.config.in_channels,
                self._model.info.default_height,
                self._model.info.default_width,
            )
            latents = randn_tensor(
                shape, generator=generators, device=pipe._execution_device, dtype=unet.dtype
            )
            scheduler = copy.deepcopy(pipe.scheduler)
            scheduler.set_timesteps(params.num_inference_steps)
            # The keyword arguments each pipeline passes to scheduler.step (its defaults).
            step_kwargs: dict[str, Any] = {"generator": generators}
            if type(pipe).__call__ is DDIMPipeline.__call__:
                step_kwargs.update(eta=0.0, use_clipped_model_output=None)
            return StepState(
                request=request,
                generator=generator,
                total_steps=len(scheduler.timesteps),
                latents=latents,
                scheduler=scheduler,
                timesteps=scheduler.timesteps,
                extra={"step_kwargs": step_kwargs},
            )

    def denoise_step(self, states: Sequence[StepState]) -> list[Any]:
        """See :meth:`StepAdapter.denoise_step` (no guidance: one row per output)."""
        import torch

        with self._model.lock, torch.no_grad():
            pipe = self._model.pipeline
            check_step_batch(states, self._batch_key)
            sample = torch.cat([state.latents for state in states])
            timestep = _row_timesteps(states, sample.device)
            noise = pipe.unet(sample, timestep).sample
            return list(noise.split([state.latents.shape[0] for state in states]))

    def post_decode(self, state: StepState, *, output_type: ModelOutputType) -> list[Any]:
        """See :meth:`StepAdapter.post_decode`: ``"latent"`` gives the sample ``(3, H, W)`` in
        [0, 1] on the model's device, ``"np"`` the same as HWC float32 arrays."""
        import torch

        _check_output_type(output_type)
        with self._model.lock, torch.no_grad():
            self._model.pipeline  # noqa: B018 - raises RuntimeError once the model is closed
            image = (state.latents / 2 + 0.5).clamp(0, 1)
            n = image.shape[0]
            if output_type == "latent":
                return [image[j].clone() for j in range(n)]
            array = image.cpu().permute(0, 2, 3, 1).numpy().astype("float32", copy=False)
            return [array[j].copy() for j in range(n)]
