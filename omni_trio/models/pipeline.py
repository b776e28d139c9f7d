"""A diffusers pipeline behind the :class:`~omni_trio.models.base.DiffusionModel` contract.

Every fused batch is one call to the pipeline's own ``__call__``.  Progress and early stop are
generic: for the duration of the call a forward pre-hook on the pipeline's ``unet`` calls
``on_step`` before every UNet call (one per denoising step; classifier-free guidance runs both
halves in one call), so pipelines without a step callback (``DDIMPipeline``) can be stopped too.
``total`` is ``len(pipe.scheduler.timesteps)`` once the pipeline has set its schedule, which
equals ``num_inference_steps`` for the DDIM/Euler-style schedulers of the built-ins.

Families:

- ``text2image``: a ``UNet2DConditionModel`` with a text encoder and tokenizer whose
  ``__call__`` takes prompt, negative_prompt, height, width, num_images_per_prompt, ... and no
  conditioning image (``StableDiffusionPipeline`` and look-alikes).
  The same pipeline starts from a picture (image-to-image) or repaints a masked region
  (inpainting) when its UNet takes the latent alone (:mod:`omni_trio.models.pipeline_image`).
- ``unconditional``: a pipeline of only a ``UNet2DModel`` and a scheduler (``DDIMPipeline``,
  ``DDPMPipeline``); the prompt is ignored and the size is fixed by the UNet.

Step mode (:meth:`DiffusersModel.step_adapter`) lives in :mod:`omni_trio.models.pipeline_step`.

CFG parallelism (:meth:`DiffusersModel.enable_cfg_parallel`, see
:mod:`omni_trio.worker.cfg_parallel`): for the text2image pipelines that have a step adapter
(``StableDiffusionPipeline.__call__``, no guidance-embedding UNet), every CFG-doubled UNet call
of ``generate`` and of the step adapter runs inside ``cfg.guided()``, so two ranks each compute
one half.  The progress hook runs before the split, so an agreed early stop happens before
any half is computed.
"""

from __future__ import annotations

import gc
import inspect
import json
import math
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import InvalidConfigError, InvalidRequestError
from .base import (
    BatchParams,
    CfgSplit,
    DiffusionModel,
    Family,
    ModelInfo,
    ModelOutputType,
    StepHook,
)
from .builtin import MARKER
from .lora import InvalidLoraError, LoraSlots
from .offload import WeightSleeper
from .pipeline_checks import check_text2image_schedule, check_unconditional_params

if TYPE_CHECKING:
    import torch

    from .._core.request import DiffusionRequest
    from .step import StepAdapter

__all__ = [
    "DiffusersModel",
    "detect_family",
    "unet_step_hook",
]

_TEXT2IMAGE_PARAMS = frozenset(
    {
        "prompt",
        "negative_prompt",
        "height",
        "width",
        "num_inference_steps",
        "guidance_scale",
        "num_images_per_prompt",
        "generator",
        "output_type",
        "return_dict",
    }
)
_CONDITIONING_IMAGE_PARAMS = frozenset({"image", "mask_image", "control_image"})
_UNCONDITIONAL_PARAMS = frozenset(
    {"batch_size", "generator", "num_inference_steps", "output_type", "return_dict"}
)


def _call_params(pipe: Any) -> frozenset[str]:
    return frozenset(inspect.signature(pipe.__call__).parameters)


def detect_family(pipe: Any) -> Family | None:
    """The family of a loaded diffusers pipeline, or ``None`` if omni_trio cannot drive it."""
    from diffusers import UNet2DConditionModel, UNet2DModel

    unet = getattr(pipe, "unet", None)
    params = _call_params(pipe)
    if (
        isinstance(unet, UNet2DConditionModel)
        and getattr(pipe, "text_encoder", None) is not None
        and getattr(pipe, "tokenizer", None) is not None
        and getattr(pipe, "vae", None) is not None
        and params >= _TEXT2IMAGE_PARAMS
        and not _CONDITIONING_IMAGE_PARAMS & params
    ):
        return "text2image"
    components = {k for k, v in getattr(pipe, "components", {}).items() if v is not None}
    if (
        isinstance(unet, UNet2DModel)
        and components <= {"unet", "scheduler"}
        and params >= _UNCONDITIONAL_PARAMS
    ):
        return "unconditional"
    return None


def _sample_size(unet: Any) -> tuple[int, int]:
    size = unet.config.sample_size
    if isinstance(size, int):
        return size, size
    return int(size[0]), int(size[1])


def _norm_ok(channels: int, groups: int, side: int) -> bool:
    """A GroupNorm over ``channels`` in ``groups`` works on a batch of one at ``side`` x
    ``side``: torch refuses one value per group ("Expected more than 1 value per channel")."""
    if channels < groups:  # no GroupNorm can be built so: the module has none there
        return True
    return (channels // max(1, groups)) * side * side > 1


def min_latent_side(unet_config: Any, vae_config: Any | None = None) -> int:
    """The smallest latent side every GroupNorm of the UNet (each level's input and output
    channels, at that level's downsampled side) and of the VAE decoder (at the latent's
    side) can normalise for a batch of one (no CFG, or one CFG-parallel half)."""
    channels = [int(c) for c in getattr(unet_config, "block_out_channels", ()) or ()]
    groups = int(getattr(unet_config, "norm_num_groups", None) or 32)
    vae_channels = vae_groups = None
    if vae_config is not None and getattr(vae_config, "block_out_channels", None):
        vae_channels = int(vae_config.block_out_channels[-1])
        vae_groups = int(getattr(vae_config, "norm_num_groups", None) or 32)
    for latent in range(1, 65):
        ok = all(
            _norm_ok(ch, groups, math.ceil(latent / 2**level))
            for level, out_ch in enumerate(channels)
            for ch in (channels[max(0, level - 1)], out_ch)
        )
        if vae_channels is not None and vae_groups is not None:
            ok = ok and _norm_ok(vae_channels, vae_groups, latent)
        if ok:
            return latent
    return 64  # pragma: no cover - no real configuration gets here


@contextmanager
def unet_step_hook(pipe: Any, on_step: StepHook) -> Iterator[None]:
    """Call ``on_step(step, total)`` before every forward of ``pipe.unet`` inside the block.

    The hook is removed on exit, whatever happens.  Whatever ``on_step`` raises propagates out
    of the UNet call, and so out of the pipeline call.  It runs before every other pre-hook
    (a CFG split included), so a stop it raises costs no UNet work.
    """
    calls = 0

    def hook(module: Any, args: Any) -> None:
        nonlocal calls
        # The pipeline has set its schedule before the first UNet call.
        total = max(len(pipe.scheduler.timesteps), calls + 1)
        on_step(calls, total)
        calls += 1

    handle = pipe.unet.register_forward_pre_hook(hook, prepend=True)
    try:
        yield
    finally:
        handle.remove()


# What an unconditional pipeline accepts but does not use.
_UNCONDITIONAL_IGNORES = frozenset({"prompt", "negative_prompt", "guidance_scale"})
# A model directory may describe itself in this file (builtin:shapes does):
# {"min_side": 24, "max_side": 64} are the sizes it renders well.
DECLARATION_FILE = MARKER


def declared(path: Path) -> dict[str, Any]:
    """What ``path``'s :data:`DECLARATION_FILE` says (``{}`` without one); raises
    :class:`InvalidConfigError` if it is not a JSON object."""
    file = Path(path) / DECLARATION_FILE
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidConfigError(f"cannot read {str(file)!r}: {exc}", field="model") from exc
    if not isinstance(data, dict):
        raise InvalidConfigError(f"{str(file)!r} must hold a JSON object", field="model")
    return data


def _scheduler_name(pipe: Any) -> str | None:
    """The class name of the pipeline's noise scheduler (None if it has none)."""
    scheduler = getattr(pipe, "scheduler", None)
    return None if scheduler is None else type(scheduler).__name__


def _declared_side(data: Mapping[str, Any], key: str, name: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 8 or value % 8:
        raise InvalidConfigError(
            f"model {name!r} declares {key}={value!r}: expected a multiple of 8, at least 8",
            field="model",
        )
    return value


class DiffusersModel(DiffusionModel):
    """A loaded diffusers pipeline of a supported family (see the module docstring)."""

    def __init__(self, pipe: Any, *, name: str, declared: Mapping[str, Any] | None = None) -> None:
        """Wrap ``pipe``; raises :class:`InvalidConfigError` naming ``name`` and the pipeline
        class if its family is not supported.  ``declared``: what the model directory says of
        itself (``min_side``/``max_side``: the sizes it renders well; see :func:`declared`)."""
        family = detect_family(pipe)
        if family is None:
            raise InvalidConfigError(
                f"model {name!r} is a {type(pipe).__name__}, which omni_trio cannot serve: "
                "expected a text-to-image pipeline (UNet2DConditionModel + text encoder, like "
                "StableDiffusionPipeline) or an unconditional one (UNet2DModel + scheduler, "
                "like DDIMPipeline)",
                field="model",
            )
        pipe.set_progress_bar_config(disable=True)
        height, width = _sample_size(pipe.unet)
        text_conditioned = family == "text2image"
        if text_conditioned:
            scale = int(pipe.vae_scale_factor)
            height, width = height * scale, width * scale
        from .pipeline_step import make_step_adapter

        adapter = make_step_adapter(self, pipe, family)
        min_side = 8
        if text_conditioned:
            vae: Any = getattr(pipe, "vae", None)
            # Only diffusers' AutoencoderKL is known to norm its latent at full channels.
            vae_config = vae.config if type(vae).__name__ == "AutoencoderKL" else None
            latent = min_latent_side(pipe.unet.config, vae_config)
            min_side = max(8, math.ceil(latent * int(pipe.vae_scale_factor) / 8) * 8)
        declared = declared or {}
        min_side = max(min_side, _declared_side(declared, "min_side", name) or 0)
        max_side = _declared_side(declared, "max_side", name)
        if max_side is not None and max_side < min_side:
            raise InvalidConfigError(
                f"model {name!r} declares max_side {max_side} below its min_side {min_side}",
                field="model",
            )
        self.info = ModelInfo(
            name=name,
            family=family,
            supports_batch=True,
            default_height=height,
            default_width=width,
            text_conditioned=text_conditioned,
            supports_steps=adapter is not None,
            # An unconditional UNet renders the one size it was trained at.
            fixed_size=family == "unconditional",
            min_side=min_side,
            max_side=max_side,
            # A diffusers pipeline call takes no extra_args.
            extra_args=frozenset(),
            ignored_params=(frozenset() if text_conditioned else _UNCONDITIONAL_IGNORES),
            calibrate=True,
            scheduler=_scheduler_name(pipe),
            image_input=_takes_pictures(pipe, adapter),
            lora_input=text_conditioned and hasattr(pipe, "load_lora_weights"),
        )
        self._pipe: Any = pipe
        # Held for every use of the pipeline: generate, to, and the step adapter's calls.
        self._lock = threading.Lock()
        self._step_adapter = adapter
        # Set once by enable_cfg_parallel; the hooks stay on the UNet until close.
        self._cfg: CfgSplit | None = None
        self._cfg_hooks: Any = None
        # Where the weights come from again (level-2 sleep): set by from_pretrained.
        self._source: tuple[Path, torch.dtype] | None = None
        self._sleeper: WeightSleeper | None = None
        # The LoRA adapters (configure_loras); None: the model applies none.
        self._loras: LoraSlots | None = None

    @classmethod
    def from_pretrained(
        cls, path: Path, *, name: str, device: torch.device | str, dtype: torch.dtype
    ) -> DiffusersModel:
        """Load a local diffusers directory (never the network) onto ``device`` as ``dtype``.

        Raises :class:`InvalidConfigError` if diffusers cannot load it or cannot serve it.
        """
        try:
            pipe = _load_pipeline(path, dtype)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, ImportError) as exc:
            raise InvalidConfigError(
                f"cannot load model {name!r} from {str(path)!r}: {type(exc).__name__}: {exc}",
                field="model",
            ) from exc
        model = cls(pipe, name=name, declared=declared(path))
        model._source = (Path(path), dtype)
        model.to(device)
        return model

    @property
    def lock(self) -> threading.Lock:
        """Held for every use of the pipeline (its step adapter's calls too)."""
        return self._lock

    @property
    def pipeline(self) -> Any:
        """The wrapped diffusers pipeline (raises ``RuntimeError`` once closed, and while
        asleep)."""
        if self._pipe is None:
            raise RuntimeError(f"model {self.info.name} is closed")
        if self._sleeper is not None and self._sleeper.asleep:
            raise RuntimeError(
                f"model {self.info.name} is asleep (level {self._sleeper.level}): wake it up first"
            )
        return self._pipe

    def _weights(self) -> WeightSleeper:
        """The sleeper of this pipeline's torch modules (made on first use)."""
        if self._sleeper is None:
            import torch

            pipe = self.pipeline
            modules = {
                name: component
                for name, component in pipe.components.items()
                if isinstance(component, torch.nn.Module)
            }
            self._sleeper = WeightSleeper(
                modules,
                torch.device(pipe.device),
                reload=self._reload if self._source is not None else None,
            )
        return self._sleeper

    def _reload(self) -> dict[str, dict[str, Any]]:
        """The parameters of every torch module, read again from the model's directory."""
        assert self._source is not None
        import torch

        path, dtype = self._source
        fresh = _load_pipeline(path, dtype)
        return {
            name: dict(component.named_parameters())
            for name, component in fresh.components.items()
            if isinstance(component, torch.nn.Module)
        }

    def sleep(self, level: int, directory: str | None = None) -> int:
        """See :meth:`DiffusionModel.sleep`: every torch module of the pipeline releases its
        parameters (:class:`~omni_trio.models.offload.WeightSleeper`); level 2 reloads them
        from the model's directory at wake.  Loaded LoRA adapters are unloaded first (they
        load again on their next use)."""
        with self._lock:
            if self._pipe is None:
                raise RuntimeError(f"model {self.info.name} is closed")
            if self._loras is not None:
                self._loras.close()
            return self._weights().sleep(level, directory)

    def configure_loras(self, registry: Mapping[str, str], max_loaded: int) -> None:
        """See :meth:`DiffusionModel.configure_loras`: adapters load on first use into a
        :class:`~omni_trio.models.lora.LoraSlots`."""
        if self.info.lora_input and registry:
            self._loras = LoraSlots(self.pipeline, registry, max_loaded)

    def use_lora(self, spec: Any) -> None:
        """Make the adapters of ``spec`` active (call it holding the lock).  Raises
        :class:`~omni_trio.models.lora.InvalidLoraError`."""
        if self._loras is None:
            if spec:
                raise InvalidLoraError(f"model {self.info.name} has no LoRA adapters registered")
            return
        self._loras.apply(spec)

    def wake_up(self) -> int:
        """See :meth:`DiffusionModel.wake_up`."""
        with self._lock:
            sleeper = self._sleeper
            if self._pipe is None or sleeper is None:
                return 0
            return sleeper.wake_up()

    def step_adapter(self) -> StepAdapter | None:
        """See :meth:`DiffusionModel.step_adapter`.

        Available for ``StableDiffusionPipeline`` (and subclasses that keep its ``__call__``)
        without a guidance-embedding UNet, and for ``DDIMPipeline``/``DDPMPipeline``; other
        pipelines of a supported family run in request mode only.
        """
        return self._step_adapter

    def enable_cfg_parallel(self, cfg: CfgSplit) -> bool:
        """See :meth:`DiffusionModel.enable_cfg_parallel`.

        Done for text2image pipelines with a step adapter (whose CFG layout, all
        unconditional rows then all conditional rows, is known); ``False`` for the others.
        Raises ``RuntimeError`` if called twice.
        """
        from .pipeline_step import Text2ImageStepAdapter

        if not isinstance(self._step_adapter, Text2ImageStepAdapter):
            return False
        with self._lock:
            if self._cfg is not None:
                raise RuntimeError(f"model {self.info.name} already runs CFG-parallel")
            self._cfg_hooks = cfg.install(self.pipeline.unet)
            self._cfg = cfg
        return True

    def cfg_guided(self, doubled: bool) -> AbstractContextManager[Any]:
        """The block to run a UNet call in: ``cfg.guided()`` when CFG parallelism is on and
        the call is CFG-doubled (``doubled``), else a no-op.  Call it holding the lock."""
        if self._cfg is None or not doubled:
            return nullcontext()
        return self._cfg.guided()

    def generate(
        self,
        requests: Sequence[DiffusionRequest],
        generators: Sequence[torch.Generator],
        *,
        output_type: ModelOutputType,
        on_step: StepHook,
    ) -> list[list[Any]]:
        """See :meth:`DiffusionModel.generate`.

        ``"latent"`` outputs are the final latents ``(4, H/8, W/8)`` for text2image and the
        final sample ``(3, H, W)`` in [0, 1] for unconditional models, on the model's device.
        Explicit ``timesteps``/``sigmas`` go to the scheduler as they are; how many steps they
        make is the scheduler's business (Euler: ``len(sigmas) - 1``), and ``on_step``'s
        ``total`` says what it decided.  :class:`InvalidRequestError` is raised for explicit
        ``timesteps``/``sigmas`` the scheduler does not take, and, on an unconditional model,
        for a size other than its own.
        """
        if requests and requests[0].sampling.image is not None:
            return self._generate_from_pictures(requests, generators, output_type, on_step)
        with self._lock:
            pipe = self.pipeline
            self.use_lora(requests[0].sampling.lora if requests else ())
            params = BatchParams.from_requests(requests, generators, self.info, output_type)
            n = params.num_outputs
            # Output k of request i draws from request i's generator, in order.
            repeated = [generator for generator in generators for _ in range(n)]
            call: Callable[[], Any]
            if self.info.family == "text2image":
                call = self._text2image_call(pipe, requests, repeated, params, output_type)
            else:
                call = self._unconditional_call(pipe, requests, repeated, params, output_type)
            # Exactly StableDiffusionPipeline.do_classifier_free_guidance.
            doubled = (
                self.info.family == "text2image"
                and params.guidance_scale > 1
                and pipe.unet.config.time_cond_proj_dim is None
            )
            with unet_step_hook(pipe, on_step), self.cfg_guided(doubled):
                images = call()
            return [[_own(images[i * n + j]) for j in range(n)] for i in range(len(requests))]

    def _generate_from_pictures(
        self,
        requests: Sequence[DiffusionRequest],
        generators: Sequence[torch.Generator],
        output_type: ModelOutputType,
        on_step: StepHook,
    ) -> list[list[Any]]:
        """Image-to-image and inpainting in request mode: the step adapter's math run to
        the end in one call, every request of the wave a row of each UNet call (their
        compatibility key gives them one size, conditioning, strength and schedule), so a
        request renders as it does in step mode.  ``on_step`` runs before every UNet call.
        The model lock is taken by each adapter call, not for the whole call."""
        adapter = self._step_adapter
        if adapter is None or not self.info.image_input:
            raise InvalidRequestError(
                f"model {self.info.name} does not take an image to start from", param="image"
            )
        BatchParams.from_requests(requests, generators, self.info, output_type)
        states = []
        try:
            for request, generator in zip(requests, generators, strict=True):
                states.append(adapter.prepare_encode(request, generator))
            total = states[0].total_steps
            for step in range(total):
                on_step(step, total)
                noise = adapter.denoise_step(states)
                for state, prediction in zip(states, noise, strict=True):
                    adapter.step_scheduler(state, prediction)
            return [adapter.post_decode(state, output_type=output_type) for state in states]
        finally:
            for state in states:
                adapter.release(state)

    def _text2image_call(
        self,
        pipe: Any,
        requests: Sequence[DiffusionRequest],
        generators: list[torch.Generator],
        params: BatchParams,
        output_type: ModelOutputType,
    ) -> Callable[[], Any]:
        check_text2image_schedule(self.info, pipe.scheduler, params, requests[0].request_id)
        negatives = [request.sampling.negative_prompt for request in requests]
        kwargs: dict[str, Any] = {
            "prompt": [request.prompt for request in requests],
            # A missing negative prompt is the empty prompt, which is what diffusers uses for
            # None, so mixed batches render exactly as separate ones would.
            "negative_prompt": (
                None if all(neg is None for neg in negatives) else [neg or "" for neg in negatives]
            ),
            "height": params.height,
            "width": params.width,
            "num_inference_steps": params.num_inference_steps,
            "guidance_scale": params.guidance_scale,
            "num_images_per_prompt": params.num_outputs,
            "generator": generators,
            "output_type": output_type,
            "return_dict": False,
        }
        if params.timesteps is not None:
            kwargs["timesteps"] = list(params.timesteps)
        elif params.sigmas is not None:
            kwargs["sigmas"] = list(params.sigmas)

        def call() -> Any:
            images = pipe(**kwargs)[0]
            return images if output_type == "latent" else images.astype("float32", copy=False)

        return call

    def _unconditional_call(
        self,
        pipe: Any,
        requests: Sequence[DiffusionRequest],
        generators: list[torch.Generator],
        params: BatchParams,
        output_type: ModelOutputType,
    ) -> Callable[[], Any]:
        check_unconditional_params(self.info, params, requests[0].request_id)

        def call() -> Any:
            images = pipe(
                batch_size=len(generators),
                generator=generators,
                num_inference_steps=params.num_inference_steps,
                output_type="pt" if output_type == "latent" else "np",
                return_dict=False,
            )[0]
            return images if output_type == "latent" else images.astype("float32", copy=False)

        return call

    def to(self, device: torch.device | str) -> None:
        with self._lock:
            self.pipeline.to(device)

    def close(self) -> None:
        if self._pipe is None:
            return
        with self._lock:
            hooks, self._cfg_hooks, self._cfg = self._cfg_hooks, None, None
            if hooks is not None:
                hooks.remove()
            sleeper, self._sleeper = self._sleeper, None
            if sleeper is not None:
                sleeper.close()
            self._loras = None
            self._pipe = None
            gc.collect()
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def _load_pipeline(path: Path, dtype: torch.dtype) -> Any:
    """A local diffusers directory's pipeline on the CPU as ``dtype`` (never the network)."""
    import importlib.util

    from diffusers import DiffusionPipeline

    from .progress_bars import quiet_hf
    from .shapes import _vae  # noqa: F401 - diffusers resolves PixelSpaceVAE via sys.modules

    kwargs: dict[str, Any] = {"dtype": dtype, "local_files_only": True}
    if importlib.util.find_spec("accelerate") is None:
        kwargs["low_cpu_mem_usage"] = False  # what diffusers falls back to, minus a warning
    with quiet_hf():
        return DiffusionPipeline.from_pretrained(str(path), **kwargs)


def _takes_pictures(pipe: Any, adapter: StepAdapter | None) -> bool:
    """Image-to-image and inpainting run through the text-to-image step adapter, on a UNet
    that takes the latent alone (see :mod:`omni_trio.models.pipeline_image`)."""
    from .pipeline_image import takes_pictures
    from .pipeline_step import Text2ImageStepAdapter

    return isinstance(adapter, Text2ImageStepAdapter) and takes_pictures(pipe)


def _own(item: Any) -> Any:
    """A copy of one batch row that does not keep the whole batch's storage alive."""
    if hasattr(item, "clone"):
        return item.clone()
    return item.copy()
