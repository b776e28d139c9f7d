"""``builtin:echo``: a FAKE pipeline for tests and fuzzing (no weights, no diffusers).

Every output carries, in its first pixels, the utf-8 header ``f"{request_id}|{seed}|{index}"``
so a result delivered to the wrong request, with the wrong seed or in the wrong order is
detectable with :func:`decode_echo_image`.  ``seed`` is the request generator's
``initial_seed()``, i.e. the seed the runner really used.

Encoding: the output, read in HWC order and flattened, starts with the bytes
``MAGIC + len(payload) (2 bytes, big endian) + payload``; each byte ``k`` is stored as the value
``min(k + 0.25, 255) / 255`` so that float32 round trips, ``round(x * 255)`` and
``floor(x * 255)`` uint8 conversions (PIL, PNG) all decode to ``k``.  The remaining values are
``torch.rand`` draws from the request's generator (deterministic from the seed).  An image of
``H x W`` holds ``3 * H * W - 6`` payload bytes; a latent ``(4, H // 8, W // 8)`` holds
``4 * (H // 8) * (W // 8) - 6``.  A header that does not fit raises :class:`ValueError`.

Steps: ``generate`` runs ``total_steps`` steps for the whole batch, calling ``on_step`` before
each and sleeping the step delay after it: ``options["step_delay_s"]`` (default 0), overridden
per request by ``sampling.extra_args["echo_step_delay_s"]`` (the batch sleeps the largest).
``extra_args["echo_exit_at_step"] = k`` ends the whole worker process with ``os._exit(3)`` at
step ``k`` (a crash injection for multi-process tests; never use it in-process).
``extra_args["echo_fail_at_step"] = k`` raises :class:`EchoInjectedError` at step ``k``, right
after ``on_step(k, total)`` (so ``on_step`` has run ``k + 1`` times); a ``k`` past the last
step never fires.  The failure ends the whole fused forward, as a real crash would.

A request with a picture (``SamplingParams.image``, ``mask_image``) is accepted so that
lifecycle tests can carry pictures through every backend; the picture is not used (the
output is what it would be without it, with the request's ``total_steps``, which its
``strength`` shortens).

Step mode (:class:`EchoStepAdapter`) gives the same outputs; there a failure at step ``k``
ends only its own request (``step_scheduler`` raises for it alone).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import InvalidConfigError
from .base import (
    MODEL_OUTPUT_TYPES,
    BatchParams,
    DiffusionModel,
    ModelInfo,
    ModelOutputType,
    StepHook,
)
from .step import StepAdapter, StepState, check_step_batch, check_step_left

if TYPE_CHECKING:
    import numpy as np
    import torch

    from .._core.request import DiffusionRequest

__all__ = [
    "ECHO_EXIT_AT_STEP",
    "ECHO_EXIT_CODE",
    "ECHO_FAIL_AT_STEP",
    "ECHO_STEP_DELAY_S",
    "EchoInjectedError",
    "EchoModel",
    "EchoStepAdapter",
    "decode_echo_image",
    "encode_echo_header",
]

ECHO_STEP_DELAY_S = "echo_step_delay_s"
ECHO_FAIL_AT_STEP = "echo_fail_at_step"
ECHO_EXIT_AT_STEP = "echo_exit_at_step"
ECHO_EXIT_CODE = 3
MAGIC = b"\xecH"
_PREFIX = len(MAGIC) + 2
LATENT_CHANNELS = 4
LATENT_SCALE = 8


class EchoInjectedError(RuntimeError):
    """The failure ``extra_args["echo_fail_at_step"]`` asked for (a fault injection, not a bug)."""

    def __init__(self, request_id: str, step: int) -> None:
        super().__init__(f"echo: injected failure at step {step} for request {request_id!r}")
        self.request_id = request_id
        self.step = step


def _header_bytes(request_id: str, seed: int, output_index: int) -> bytes:
    payload = f"{request_id}|{seed}|{output_index}".encode()
    if len(payload) > 0xFFFF:
        raise ValueError(f"echo header of {len(payload)} bytes is too long")
    return MAGIC + len(payload).to_bytes(2, "big") + payload


def encode_echo_header(values: np.ndarray, request_id: str, seed: int, output_index: int) -> None:
    """Write the echo header into ``values`` (any shape, float, read in C order) in place.

    Raises :class:`ValueError` if ``values`` has too few elements for the header.
    """
    import numpy as np

    header = _header_bytes(request_id, seed, output_index)
    flat = values.reshape(-1)
    if len(header) > flat.size:
        raise ValueError(
            f"echo output of {flat.size} values cannot hold the {len(header)}-byte header for "
            f"request {request_id!r}; use a larger height/width or a shorter request id"
        )
    codes = np.frombuffer(header, dtype=np.uint8).astype(np.float32)
    flat[: len(header)] = np.minimum(codes + 0.25, 255.0) / 255.0


def _to_hwc_bytes(image: Any) -> np.ndarray:
    import numpy as np

    if hasattr(image, "convert") and hasattr(image, "size"):  # PIL image
        array = np.asarray(image.convert("RGB"))
    elif hasattr(image, "detach") and hasattr(image, "permute"):  # torch tensor, CHW
        tensor = image.detach().to("cpu")
        if tensor.ndim != 3:
            raise ValueError(f"expected a CHW tensor, got shape {tuple(tensor.shape)}")
        array = tensor.permute(1, 2, 0).float().numpy()
    else:
        array = np.asarray(image)
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3:
        raise ValueError(f"expected an HWC image, got shape {array.shape}")
    if array.dtype == np.uint8:
        return array
    if np.issubdtype(array.dtype, np.integer):
        return np.clip(array, 0, 255).astype(np.uint8)
    return np.clip(np.rint(array.astype(np.float64) * 255.0), 0, 255).astype(np.uint8)


def decode_echo_image(image: Any) -> tuple[str, int, int]:
    """Return ``(request_id, seed, output_index)`` encoded in an echo output.

    Accepts a PIL image, an HWC numpy array (float in [0, 1] or uint8) or a CHW torch tensor in
    [0, 1] (echo images and echo latents).  Raises :class:`ValueError` if it is not an echo
    output.
    """
    data = _to_hwc_bytes(image).reshape(-1).tobytes()
    if len(data) < _PREFIX or not data.startswith(MAGIC):
        raise ValueError("not an echo output (magic bytes missing)")
    length = int.from_bytes(data[len(MAGIC) : _PREFIX], "big")
    payload = data[_PREFIX : _PREFIX + length]
    if len(payload) != length:
        raise ValueError("not an echo output (header truncated)")
    try:
        request_id, seed, index = payload.decode().rsplit("|", 2)
        return request_id, int(seed), int(index)
    except ValueError as exc:
        raise ValueError(f"not an echo output (bad header {payload!r})") from exc


def _delay(value: Any, where: str) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"{where} must be a finite number >= 0, got {value!r}")
    return float(value)


def _request_delay(request: DiffusionRequest) -> float:
    """``request``'s own step delay (0 when it sets none); ``ValueError`` if malformed."""
    extra = request.sampling.extra_args
    if ECHO_STEP_DELAY_S not in extra:
        return 0.0
    where = f"extra_args[{ECHO_STEP_DELAY_S!r}] of {request.request_id!r}"
    return _delay(extra[ECHO_STEP_DELAY_S], where)


def _fail_step(request: DiffusionRequest, key: str = ECHO_FAIL_AT_STEP) -> int | None:
    """The step ``request`` asks to fail (or exit) at, or ``None``; ``ValueError`` if
    malformed."""
    extra = request.sampling.extra_args
    if key not in extra:
        return None
    step = extra[key]
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(
            f"extra_args[{key!r}] of {request.request_id!r} must be an int, got {step!r}"
        )
    return step


def _exit_if_asked(requests: Sequence[DiffusionRequest], step: int) -> None:
    for request in requests:
        if _fail_step(request, ECHO_EXIT_AT_STEP) == step:
            os._exit(ECHO_EXIT_CODE)  # the injected crash: no cleanup, like a segfault


class EchoModel(DiffusionModel):
    """A FAKE, fast pipeline for tests and fuzzing; see the module docstring for its outputs.

    Batches any compatible requests (``supports_batch``), honours height/width (default 64x64),
    ignores the prompt, guidance and dtype.  ``step_delay_s`` is slept after every step with
    ``sleep`` (blocking; tests pass a recorder instead).
    """

    holds_weights = False  # nothing to collect when it closes or sleeps

    def __init__(
        self,
        *,
        step_delay_s: float = 0.0,
        device: torch.device | str = "cpu",
        name: str = "builtin:echo",
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.info = ModelInfo(
            name=name,
            family="echo",
            supports_batch=True,
            default_height=64,
            default_width=64,
            text_conditioned=False,
            supports_steps=True,
            extra_args=frozenset({ECHO_STEP_DELAY_S, ECHO_FAIL_AT_STEP, ECHO_EXIT_AT_STEP}),
            # A picture to start from is carried to it like any payload, and not looked at.
            image_input=True,
        )
        self.step_delay_s = _delay(step_delay_s, "step_delay_s")
        self._sleep = sleep
        self._device: torch.device | str = device
        self._closed = False
        # Held for generate and every step adapter call.
        self._lock = threading.Lock()
        self._step_adapter = EchoStepAdapter(self)

    @classmethod
    def from_options(
        cls, options: Mapping[str, Any], *, device: torch.device | str = "cpu"
    ) -> EchoModel:
        """Build from ``EngineConfig.model_options``; unknown keys or bad values raise
        :class:`InvalidConfigError`."""
        unknown = sorted(set(options) - {"step_delay_s"})
        if unknown:
            raise InvalidConfigError(
                f"unknown model option(s) for builtin:echo: {', '.join(unknown)} "
                "(known: step_delay_s)",
                field="model_options",
            )
        try:
            return cls(step_delay_s=options.get("step_delay_s", 0.0), device=device)
        except ValueError as exc:
            raise InvalidConfigError(str(exc), field="model_options") from exc

    def generate(
        self,
        requests: Sequence[DiffusionRequest],
        generators: Sequence[torch.Generator],
        *,
        output_type: ModelOutputType,
        on_step: StepHook,
    ) -> list[list[Any]]:
        """See :meth:`DiffusionModel.generate`.  Sleeps (blocking) the step delay per step."""
        with self._lock:
            self._check_open()
            params = BatchParams.from_requests(requests, generators, self.info, output_type)
            delay = max([self.step_delay_s, *(_request_delay(request) for request in requests)])
            fail_at: list[tuple[int, str]] = []
            for request in requests:
                step = _fail_step(request)
                if step is not None:
                    fail_at.append((step, request.request_id))
            total = params.steps
            for step in range(total):
                on_step(step, total)
                _exit_if_asked(requests, step)
                for fail_step, request_id in fail_at:
                    if fail_step == step:
                        raise EchoInjectedError(request_id, step)
                if delay:
                    self._sleep(delay)
            return [
                self._outputs(request, generator, generator.initial_seed(), params, output_type)
                for request, generator in zip(requests, generators, strict=True)
            ]

    def _outputs(
        self,
        request: DiffusionRequest,
        generator: torch.Generator,
        seed: int,
        params: BatchParams,
        output_type: ModelOutputType,
    ) -> list[Any]:
        """``request``'s outputs, drawn in order from ``generator``; ``seed`` goes in the
        header."""
        import torch

        if output_type == "np":
            shape: tuple[int, ...] = (params.height, params.width, 3)
        else:
            shape = (
                max(1, params.height // LATENT_SCALE),
                max(1, params.width // LATENT_SCALE),
                LATENT_CHANNELS,
            )
        outputs: list[Any] = []
        for index in range(params.num_outputs):
            noise = torch.rand(shape, generator=generator, device=generator.device)
            values = noise.to("cpu", torch.float32).numpy()
            encode_echo_header(values, request.request_id, seed, index)
            if output_type == "np":
                outputs.append(values)
            else:
                outputs.append(
                    torch.from_numpy(values).permute(2, 0, 1).contiguous().to(self._device)
                )
        return outputs

    def step_adapter(self) -> EchoStepAdapter:
        """See :meth:`DiffusionModel.step_adapter` and :class:`EchoStepAdapter`."""
        return self._step_adapter

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"model {self.info.name} is closed")

    def to(self, device: torch.device | str) -> None:
        self._device = device

    def close(self) -> None:
        self._closed = True


class EchoStepAdapter(StepAdapter):
    """Step mode for :class:`EchoModel`: the same outputs as ``generate``, one step at a time.

    ``prepare_encode`` parses the echo ``extra_args`` and remembers the generator's state;
    ``denoise_step`` sleeps once for the whole batch (the largest delay of the model and its
    states) and returns ``None`` per state; ``step_scheduler`` raises
    :class:`EchoInjectedError` at the request's ``echo_fail_at_step`` (for that request only,
    leaving its ``step_index`` at the failed step); ``post_decode`` draws the outputs from a
    copy of the remembered generator state, so every decode (previews included) gives exactly
    what ``generate`` gives for the request, and ``state.generator`` is never advanced.
    """

    def __init__(self, model: EchoModel) -> None:
        self._model = model

    def prepare_encode(self, request: DiffusionRequest, generator: torch.Generator) -> StepState:
        """See :meth:`StepAdapter.prepare_encode`.  ``ValueError`` for malformed echo
        ``extra_args``; a header too long for the output is only found by ``post_decode``."""
        with self._model._lock:
            self._model._check_open()
            params = BatchParams.from_requests([request], [generator], self._model.info, "np")
            return StepState(
                request=request,
                generator=generator,
                total_steps=params.steps,
                extra={
                    "params": params,
                    "delay": _request_delay(request),
                    "fail_at": _fail_step(request),
                    "seed": generator.initial_seed(),
                    "rng_state": generator.get_state(),
                },
            )

    @staticmethod
    def _batch_key(state: StepState) -> Mapping[str, Any]:
        params: BatchParams = state.extra["params"]
        return {
            "height": params.height,
            "width": params.width,
            "guidance_scale": params.guidance_scale,
            "num_outputs": params.num_outputs,
        }

    def denoise_step(self, states: Sequence[StepState]) -> list[Any]:
        """See :meth:`StepAdapter.denoise_step`.  Sleeps (blocking) the batch's step delay."""
        with self._model._lock:
            self._model._check_open()
            check_step_batch(states, self._batch_key)
            delay = max([self._model.step_delay_s, *(state.extra["delay"] for state in states)])
            if delay:
                self._model._sleep(delay)
            return [None] * len(states)

    def step_scheduler(self, state: StepState, noise_pred: Any) -> None:
        """See :meth:`StepAdapter.step_scheduler`."""
        with self._model._lock:
            self._model._check_open()
            check_step_left(state)
            _exit_if_asked([state.request], state.step_index)
            if state.extra["fail_at"] == state.step_index:
                raise EchoInjectedError(state.request_id, state.step_index)
            state.step_index += 1

    def post_decode(self, state: StepState, *, output_type: ModelOutputType) -> list[Any]:
        """See :meth:`StepAdapter.post_decode`.  ``ValueError`` if the header does not fit."""
        import torch

        if output_type not in MODEL_OUTPUT_TYPES:
            raise ValueError(
                f"output_type must be one of {', '.join(MODEL_OUTPUT_TYPES)}, got {output_type!r}"
            )
        with self._model._lock:
            self._model._check_open()
            generator = torch.Generator(device=state.generator.device)
            generator.set_state(state.extra["rng_state"])
            return self._model._outputs(
                state.request, generator, state.extra["seed"], state.extra["params"], output_type
            )

    def release(self, state: StepState) -> None:
        state.extra.clear()
