"""What a request will cost, estimated from the model's measured step time (pure).

Shape limits alone (pixels, steps, n) do not bound work: on a CPU, ``builtin:tiny-sd`` at
1024x1024 with n=4 takes minutes per denoising step, and a step cannot be interrupted.  At
warmup the engine measures the model on the machine at hand (:func:`probe_sides`: one short
request per size, growing until a step takes long enough to be compute bound) and fits a
:class:`CostModel`; admission then refuses, with :class:`~omni_trio.errors.RequestTooCostlyError`,
a request whose estimated wall time is over ``max_request_s`` or whose longest
uninterruptible part (one denoising step of all its images, or their decode) is over
``max_step_s``.  Bounding the step bounds how long a cancel or a drain waits for the CPU.

The estimate is deliberately conservative above the largest measured size: the time per step
grows with the square of the pixel count there (self-attention over the latent tokens; on CPU
the measured exponent approaches 2 from ~256x256 up), linearly below it, and linearly with
the number of images and of steps.  Measured against real runs in docs/benchmarks.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import RequestTooCostlyError

__all__ = ["CostEstimate", "CostModel", "CostProbe", "probe_sides"]

# A probe step this long is compute bound: larger probes would only cost warmup time.
PROBE_ENOUGH_S = 0.1
# Probes stop here (pixels per side) even if every step is fast (a GPU).
PROBE_MAX_SIDE = 1024
# And once the probes together took this long.
PROBE_BUDGET_S = 3.0
# Steps per probe: the middle interval is a pure denoising step.
PROBE_STEPS = 3


@dataclass(frozen=True, slots=True)
class CostProbe:
    """One measured request: ``side`` x ``side`` pixels, one image; ``step_s`` the time of one
    denoising step, ``rest_s`` what the request took beside its steps (encode, decode)."""

    side: int
    step_s: float
    rest_s: float

    @property
    def pixels(self) -> int:
        return self.side * self.side


@dataclass(frozen=True, slots=True)
class CostEstimate:
    """A request's estimated cost in seconds: ``step_s`` per denoising step (all its
    images), ``rest_s`` for encode and decode, ``total_s`` the whole request."""

    step_s: float
    rest_s: float
    steps: int

    @property
    def total_s(self) -> float:
        return self.step_s * self.steps + self.rest_s

    @property
    def longest_part_s(self) -> float:
        """The longest part nothing can interrupt (a step, or the decode)."""
        return max(self.step_s, self.rest_s)


@dataclass(frozen=True, slots=True)
class CostModel:
    """Estimated time of a request, fitted from the largest probe (see the module doc).

    ``fixed_size``: the model renders one size only, so only steps and images scale.
    """

    probe: CostProbe
    fixed_size: bool = False

    @classmethod
    def fit(cls, probes: Sequence[CostProbe], *, fixed_size: bool = False) -> CostModel:
        """The model from the largest probe (the most compute bound); ``ValueError`` if none."""
        if not probes:
            raise ValueError("a cost model needs at least one probe")
        return cls(max(probes, key=lambda p: (p.pixels, p.step_s)), fixed_size=fixed_size)

    def _scale(self, pixels: int) -> float:
        if self.fixed_size:
            return 1.0
        ratio = pixels / self.probe.pixels
        return ratio if ratio <= 1.0 else ratio * ratio

    def estimate(self, height: int, width: int, steps: int, n: int = 1) -> CostEstimate:
        """The estimated cost of ``n`` images of ``height`` x ``width`` over ``steps`` steps."""
        scale = self._scale(height * width) * n
        return CostEstimate(self.probe.step_s * scale, self.probe.rest_s * scale, steps)

    def check(
        self,
        height: int,
        width: int,
        steps: int,
        n: int,
        *,
        max_request_s: float | None,
        max_step_s: float | None,
    ) -> CostEstimate:
        """The estimate, or :class:`RequestTooCostlyError` (``param="size"``) naming it and the
        limit it is over."""
        est = self.estimate(height, width, steps, n)
        what = f"{width}x{height}, n={n}, {steps} steps"
        if max_step_s is not None and est.longest_part_s > max_step_s:
            raise RequestTooCostlyError(
                f"request too costly for this machine: {what} is estimated at "
                f"{est.longest_part_s:.1f} s per uninterruptible step, over the limit of "
                f"{max_step_s:g} s (max_step_s); ask for fewer pixels or images",
                estimate_s=est.longest_part_s,
                limit_s=max_step_s,
            )
        if max_request_s is not None and est.total_s > max_request_s:
            raise RequestTooCostlyError(
                f"request too costly for this machine: {what} is estimated at "
                f"{est.total_s:.1f} s, over the limit of {max_request_s:g} s (max_request_s); "
                "ask for fewer pixels, steps or images",
                estimate_s=est.total_s,
                limit_s=max_request_s,
            )
        return est


def probe_sides(start: int, stop: int) -> list[int]:
    """Probe sizes from ``start`` doubling up to ``stop``, then ``stop`` itself (both as
    given); the caller stops early once a step is compute bound (:data:`PROBE_ENOUGH_S`)."""
    sides = []
    side = max(8, start)
    stop = max(side, min(stop, PROBE_MAX_SIDE))
    while side <= stop:
        sides.append(side)
        side *= 2
    if sides[-1] < stop:
        sides.append(stop)
    return sides


def probe_from_timings(
    side: int, steps: int, step_ms: float | None, forward_ms: float
) -> CostProbe:
    """A probe from a worker's timings: ``step_ms`` (a pure step) when reported, else the
    forward time spread over its steps (an over-estimate, which is the safe side)."""
    forward_s = max(0.0, forward_ms / 1000.0)
    if step_ms is None or not math.isfinite(step_ms) or step_ms <= 0:
        per_step = forward_s / max(1, steps)
        return CostProbe(side, per_step, per_step)
    step_s = step_ms / 1000.0
    return CostProbe(side, step_s, max(0.0, forward_s - step_s * steps))
