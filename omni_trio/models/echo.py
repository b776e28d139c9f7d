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
``extra_args["echo_fail_at_step"] = k`` raises :class:`EchoInjectedError` at step ``k``, right
after ``on_step(k, total)`` (so ``on_step`` has run ``k + 1`` times); a ``k`` past the last
step never fires.  The failure ends the whole fused forward, as a real crash would.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import InvalidConfigError
from .base import BatchParams, DiffusionModel, ModelInfo, ModelOutputType, StepHook

if TYPE_CHECKING:
    import numpy as np
    import torch

    from .._core.request import DiffusionRequest

__all__ = [
    "ECHO_FAIL_AT_STEP",
    "ECHO_STEP_DELAY_S",
    "EchoInjectedError",
    "EchoModel",
    "decode_echo_image",
    "encode_echo_header",
]

ECHO_STEP_DELAY_S = "echo_step_delay_s"
ECHO_FAIL_AT_STEP = "echo_fail_at_step"
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


class EchoModel(DiffusionModel):
    """A FAKE, fast pipeline for tests and fuzzing; see the module docstring for its outputs.

    Batches any compatible requests (``supports_batch``), honours height/width (default 64x64),
    ignores the prompt, guidance and dtype.  ``step_delay_s`` is slept after every step with
    ``sleep`` (blocking; tests pass a recorder instead).
    """

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
        )
        self.step_delay_s = _delay(step_delay_s, "step_delay_s")
        self._sleep = sleep
        self._device: torch.device | str = device
        self._closed = False
        self._lock = threading.Lock()

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
            if self._closed:
                raise RuntimeError("model builtin:echo is closed")
            params = BatchParams.from_requests(requests, generators, self.info, output_type)
            delay = self.step_delay_s
            fail_at: list[tuple[int, str]] = []
            for request in requests:
                extra = request.sampling.extra_args
                if ECHO_STEP_DELAY_S in extra:
                    where = f"extra_args[{ECHO_STEP_DELAY_S!r}] of {request.request_id!r}"
                    delay = max(delay, _delay(extra[ECHO_STEP_DELAY_S], where))
                if ECHO_FAIL_AT_STEP in extra:
                    step = extra[ECHO_FAIL_AT_STEP]
                    if isinstance(step, bool) or not isinstance(step, int):
                        raise ValueError(
                            f"extra_args[{ECHO_FAIL_AT_STEP!r}] of {request.request_id!r} must "
                            f"be an int, got {step!r}"
                        )
                    fail_at.append((step, request.request_id))
            total = params.steps
            for step in range(total):
                on_step(step, total)
                for fail_step, request_id in fail_at:
                    if fail_step == step:
                        raise EchoInjectedError(request_id, step)
                if delay:
                    self._sleep(delay)
            return [
                [
                    self._output(request, generator, index, params, output_type)
                    for index in range(params.num_outputs)
                ]
                for request, generator in zip(requests, generators, strict=True)
            ]

    def _output(
        self,
        request: DiffusionRequest,
        generator: torch.Generator,
        index: int,
        params: BatchParams,
        output_type: ModelOutputType,
    ) -> Any:
        import torch

        if output_type == "np":
            shape: tuple[int, ...] = (params.height, params.width, 3)
        else:
            shape = (
                max(1, params.height // LATENT_SCALE),
                max(1, params.width // LATENT_SCALE),
                LATENT_CHANNELS,
            )
        noise = torch.rand(shape, generator=generator, device=generator.device)
        values = noise.to("cpu", torch.float32).numpy()
        encode_echo_header(values, request.request_id, generator.initial_seed(), index)
        if output_type == "np":
            return values
        return torch.from_numpy(values).permute(2, 0, 1).contiguous().to(self._device)

    def to(self, device: torch.device | str) -> None:
        self._device = device

    def close(self) -> None:
        self._closed = True
