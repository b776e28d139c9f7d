"""Simulated clients for the engine experiments, and the direct (engine-less) calls they race.

:func:`drive` sends ``n`` requests through an engine from ``concurrency`` client tasks, each
sending its next request as soon as its previous one finished (a closed loop), and records
what a client sees: latency from the call to the terminal output, plus the engine's own
per-request metrics; :func:`drive_mixed` does the same with one ``SamplingParams`` per request (a
mixed workload).  :class:`DirectCall` runs the same request on the same loaded model
without the engine, in the calling thread: the physical limit the engine is compared with.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from .._core.request import DiffusionRequest, SamplingParams
from ..errors import OmniTrioError, RequestAbortedError, RequestFailedError
from ..runtime.engine import AsyncEngine
from ..worker.runner import convert_output
from ..worker.worker_thread import WorkerThread

if TYPE_CHECKING:
    from ..models import DiffusionModel

__all__ = [
    "PROMPT",
    "DirectCall",
    "RunResult",
    "drive",
    "drive_mixed",
    "engine_model",
    "load_like",
    "run_direct",
    "same_model",
    "sequential_block",
    "sync_torch_threads",
]

T = TypeVar("T")
PROMPT = "a photograph of an astronaut riding a horse"


@dataclass
class RunResult:
    """What one closed-loop run measured.  Times in seconds unless the name says ms."""

    requests: int
    concurrency: int
    wall_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    queue_wait_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    # Per completed request, in the order of ``latencies_s``: its denoising steps and the
    # engine's worker-side timings (forward and output packing, ms).
    steps: list[int] = field(default_factory=list)
    execution_ms: list[float] = field(default_factory=list)
    postprocess_ms: list[float] = field(default_factory=list)
    images: int = 0
    failed: int = 0
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def completed(self) -> int:
        return len(self.latencies_s)

    @property
    def requests_per_s(self) -> float:
        return self.completed / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def images_per_s(self) -> float:
        return self.images / self.wall_s if self.wall_s > 0 else 0.0


def sequential_block(
    engine: AsyncEngine, params: SamplingParams, block: int, sink: list[float]
) -> Callable[[], Awaitable[float]]:
    """One measurement for ``run_interleaved_async``: ``block`` requests one after another
    (concurrency 1); every latency (s) is appended to ``sink``; returns the block's median."""

    async def call() -> float:
        latencies: list[float] = []
        for _ in range(block):
            started = time.perf_counter()
            await engine.generate(PROMPT, params)
            latencies.append(time.perf_counter() - started)
        sink.extend(latencies)
        return statistics.median(latencies)

    return call


async def drive(
    engine: AsyncEngine,
    params: SamplingParams,
    *,
    requests: int,
    concurrency: int,
    prompt: str = PROMPT,
) -> RunResult:
    """Send ``requests`` copies of ``(prompt, params)`` from ``concurrency`` client tasks.

    A failed or aborted request is counted (by error type), never raised; an engine that is
    closed or dead raises (its first error, once every client stopped).
    """
    return await drive_mixed(engine, [params] * requests, concurrency=concurrency, prompt=prompt)


async def drive_mixed(
    engine: AsyncEngine,
    params: Sequence[SamplingParams],
    *,
    concurrency: int,
    prompt: str = PROMPT,
) -> RunResult:
    """Send one request per entry of ``params``, in that order, from ``concurrency`` client
    tasks (a closed loop: each client sends the next request as soon as its previous one
    finished).  Failures are counted as in :func:`drive`."""
    result = RunResult(requests=len(params), concurrency=concurrency)
    remaining = iter(params)
    clock = time.perf_counter
    fatal: list[OmniTrioError] = []

    async def client() -> None:
        for sampling in remaining:  # shared: each client takes the next request
            started = clock()
            try:
                output = await engine.generate(prompt, sampling)
            except (RequestFailedError, RequestAbortedError) as exc:
                result.failed += 1
                result.errors[getattr(exc, "error_type", None) or type(exc).__name__] += 1
                continue
            except OmniTrioError as exc:  # the engine died or closed: stop every client
                fatal.append(exc)
                nursery.cancel_scope.cancel()
                return
            result.latencies_s.append(clock() - started)
            result.images += len(output.images)
            metrics = output.metrics
            result.queue_wait_ms.append(metrics.queue_wait_ms)
            result.e2e_ms.append(metrics.e2e_ms)
            result.steps.append(sampling.total_steps)
            result.execution_ms.append(metrics.execution_ms)
            result.postprocess_ms.append(metrics.postprocess_ms)

    started = clock()
    async with trio.open_nursery() as nursery:
        for _ in range(max(1, min(concurrency, len(params)))):
            nursery.start_soon(client)
    result.wall_s = clock() - started
    if fatal:
        raise fatal[0]
    return result


def engine_model(engine: AsyncEngine) -> DiffusionModel | None:
    """The model object the engine's in-process worker loaded, or None if not reachable.

    Reaches into the inproc executor (there is no public accessor); other backends hold
    their model in another process, and the caller then loads an identical copy.
    """
    worker = getattr(engine.executor, "_worker", None)
    runner = getattr(worker, "runner", None)
    model = getattr(runner, "_model", None)
    return model


async def run_direct(engine: AsyncEngine, fn: Callable[[], T]) -> tuple[T, str]:
    """Run ``fn()`` where the engine runs its forwards, without the engine; return its result
    and where it ran.

    With the inproc backend that is the worker's own thread (same OpenMP team, same malloc
    arena, same torch thread setting), reached through the executor's private handle; ``fn``
    must time itself, so the hop into that thread is not counted.  Otherwise ``fn`` runs in
    the calling thread.
    """
    thread = getattr(engine.executor, "_thread", None)
    if isinstance(thread, WorkerThread) and thread.alive:
        return await thread.run(fn), "engine worker thread"
    return fn(), "calling thread"


@contextmanager
def same_model(engine: AsyncEngine) -> Iterator[tuple[DiffusionModel, bool]]:
    """Yield ``(model, shared)``: the engine's own loaded model (``shared``) or, where it cannot
    be reached, an identically loaded copy that is closed on exit."""
    model = engine_model(engine)
    if model is not None:
        yield model, True
        return
    copy = load_like(engine)
    try:
        yield copy, False
    finally:
        copy.close()


def load_like(engine: AsyncEngine) -> DiffusionModel:
    """Load a second copy of the engine's model exactly as its worker did."""
    from ..models import load_model
    from ..worker.worker import resolve_device, resolve_dtype

    config = engine.config
    device = resolve_device(config.device)
    return load_model(
        config.model,
        device=device,
        dtype=resolve_dtype(config.dtype, device),
        cache_dir=config.resolved_cache_dir,
        options=config.model_options,
    )


async def sync_torch_threads(engine: AsyncEngine) -> tuple[int, int]:
    """Give this thread the torch thread count the engine's worker uses.

    Returns ``(worker's count, this thread's count)``; they are equal unless torch refused.
    """
    import torch

    wanted = engine.config.resolved_torch_threads
    worker_threads = int(await engine.collective_rpc("set_torch_threads", wanted))
    if torch.get_num_threads() != worker_threads:
        torch.set_num_threads(worker_threads)
    return worker_threads, torch.get_num_threads()


def _noop_step(step: int, total: int) -> None:
    pass


class DirectCall:
    """One request run on a loaded model without the engine, in the thread that calls it.

    ``adapter()`` calls :meth:`DiffusionModel.generate` and converts the output as the
    runner does (the same work minus the runtime).  ``pipeline()`` calls the diffusers
    pipeline itself with ``output_type="pil"`` (the physical limit; diffusers models only).
    Both return their wall time in seconds.
    """

    def __init__(self, model: DiffusionModel, params: SamplingParams, prompt: str = PROMPT) -> None:
        if params.seed is None:
            raise ValueError("a direct call needs a fixed seed to match the engine's request")
        self.model = model
        self.params = params
        self.prompt = prompt
        self.request = DiffusionRequest(prompt, params, "direct-call")
        self.has_pipeline = hasattr(model, "pipeline")

    def _generator(self) -> Any:
        import torch

        return torch.Generator(device="cpu").manual_seed(int(self.params.seed or 0))

    def adapter(self) -> float:
        import torch

        output_type = self.params.output_type
        started = time.perf_counter()
        with torch.inference_mode():
            raw = self.model.generate(
                [self.request],
                [self._generator()],
                output_type="latent" if output_type == "latent" else "np",
                on_step=_noop_step,
            )
        images = tuple(convert_output(img, output_type) for img in raw[0])
        elapsed = time.perf_counter() - started
        if not images:  # pragma: no cover - the model broke its contract
            raise RuntimeError("direct call returned no image")
        return elapsed

    def pipeline(self) -> float:
        pipe: Any = getattr(self.model, "pipeline", None)
        if pipe is None:
            raise OmniTrioError(f"model {self.model.info.name} has no diffusers pipeline")
        sp = self.params
        started = time.perf_counter()
        if self.model.info.family == "text2image":
            images = pipe(
                prompt=[self.prompt],
                height=sp.height or self.model.info.default_height,
                width=sp.width or self.model.info.default_width,
                num_inference_steps=sp.num_inference_steps,
                guidance_scale=sp.guidance_scale,
                num_images_per_prompt=sp.num_outputs_per_prompt,
                generator=[self._generator()],
                output_type="pil",
                return_dict=False,
            )[0]
        else:
            images = pipe(
                batch_size=sp.num_outputs_per_prompt,
                generator=[self._generator()],
                num_inference_steps=sp.num_inference_steps,
                output_type="pil",
                return_dict=False,
            )[0]
        elapsed = time.perf_counter() - started
        if not images:  # pragma: no cover
            raise RuntimeError("pipeline returned no image")
        return elapsed
