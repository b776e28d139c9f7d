"""What every experiment shares: timing summaries, interleaved comparisons, the machine, output.

An experiment measures with :func:`time.perf_counter` and reports each figure as
:class:`Summary` (min / median / max, and p50 / p90 / p99 for latencies).  A comparison of two
variants runs them side by side in one process, interleaved ``A B A B ...``
(:func:`run_interleaved`), and reports the ratio pair by pair (:func:`pair_ratios`): on a noisy
machine a slow patch then hits both members of a pair, not one variant's whole series.

Results become a :class:`Report`: printed as a table (:func:`format_table`) and written as
JSON (:meth:`Report.write_json`) with the machine (:func:`machine_info`), the exact command,
the parameters and the rows.  Nothing here imports torch unless :func:`machine_info` is asked
for the torch figures.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import shlex
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

__all__ = [
    "JSON_SCHEMA_VERSION",
    "Progress",
    "Report",
    "Summary",
    "command_line",
    "format_table",
    "load_average",
    "machine_info",
    "pair_differences",
    "pair_ratios",
    "percentile",
    "run_in_trio",
    "run_interleaved",
    "run_interleaved_async",
]

JSON_SCHEMA_VERSION = 1
T = TypeVar("T")


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks.

    Matches ``numpy.percentile``'s default.  Raises :class:`ValueError` on an empty sequence
    or a ``q`` outside 0..100.
    """
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q must be in 0..100, got {q!r}")
    data = sorted(samples)
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    frac = pos - lo
    return data[lo] + (data[hi] - data[lo]) * frac


@dataclass(frozen=True, slots=True)
class Summary:
    """One figure over repeated measurements (all in the unit the samples had)."""

    n: int
    min: float
    median: float
    max: float
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, samples: Iterable[float]) -> Summary:
        """Summarise ``samples``; raises :class:`ValueError` if there are none."""
        data = sorted(float(s) for s in samples)
        if not data:
            raise ValueError("cannot summarise zero samples")
        return cls(
            n=len(data),
            min=data[0],
            median=percentile(data, 50),
            max=data[-1],
            mean=math.fsum(data) / len(data),
            p50=percentile(data, 50),
            p90=percentile(data, 90),
            p99=percentile(data, 99),
        )

    def scaled(self, factor: float) -> Summary:
        """The same summary in another unit (e.g. ``1000.0`` for seconds -> ms)."""
        return Summary(
            n=self.n,
            min=self.min * factor,
            median=self.median * factor,
            max=self.max * factor,
            mean=self.mean * factor,
            p50=self.p50 * factor,
            p90=self.p90 * factor,
            p99=self.p99 * factor,
        )

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    def spread(self, fmt: str = "{:.3g}") -> str:
        """``"min / median / max"`` for a table cell."""
        return " / ".join(fmt.format(v) for v in (self.min, self.median, self.max))

    def tail(self, fmt: str = "{:.3g}") -> str:
        """``"p50 / p90 / p99"`` for a latency table cell."""
        return " / ".join(fmt.format(v) for v in (self.p50, self.p90, self.p99))


def run_interleaved(
    variants: Sequence[Callable[[], T]],
    repeats: int,
    *,
    warmup: int = 0,
    on_round: Callable[[], None] | None = None,
) -> list[list[T]]:
    """Run ``variants`` side by side: ``warmup`` unrecorded rounds, then ``repeats`` rounds.

    Each round calls every variant once, in order (``A B A B ...``).  Returns one list per
    round with each variant's result.  ``on_round`` is called after every recorded round (a
    progress bar).  Exceptions from a variant propagate at once.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(max(0, warmup)):
        for variant in variants:
            variant()
    rounds: list[list[T]] = []
    for _ in range(repeats):
        rounds.append([variant() for variant in variants])
        if on_round is not None:
            on_round()
    return rounds


async def run_interleaved_async(
    variants: Sequence[Callable[[], Awaitable[T]]],
    repeats: int,
    *,
    warmup: int = 0,
    on_round: Callable[[], None] | None = None,
) -> list[list[T]]:
    """:func:`run_interleaved` for coroutine functions: each variant is awaited in turn."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(max(0, warmup)):
        for variant in variants:
            await variant()
    rounds: list[list[T]] = []
    for _ in range(repeats):
        rounds.append([await variant() for variant in variants])
        if on_round is not None:
            on_round()
    return rounds


def pair_ratios(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """``a[i] / b[i]`` pair by pair (pairs with ``b[i] == 0`` are skipped)."""
    if len(a) != len(b):
        raise ValueError(f"unpaired series: {len(a)} != {len(b)}")
    return [x / y for x, y in zip(a, b, strict=True) if y != 0]


def pair_differences(a: Sequence[float], b: Sequence[float]) -> list[float]:
    """``a[i] - b[i]`` pair by pair."""
    if len(a) != len(b):
        raise ValueError(f"unpaired series: {len(a)} != {len(b)}")
    return [x - y for x, y in zip(a, b, strict=True)]


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 1024 / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none).

    Other processes skew every figure; a reader of the numbers should see how busy the
    machine was.  Experiments record it before they start (their own load is not in it yet).
    """
    if not hasattr(os, "getloadavg"):
        return None
    return round(os.getloadavg()[0], 2)


def machine_info(*, torch_threads: int | None = None, device: str | None = None) -> dict[str, Any]:
    """The machine a result was measured on.

    ``torch_threads``/``device`` are what the experiment ran with; when ``None`` they are read
    from torch (which is imported then).  ``cores`` is the CPUs this process may run on.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info: dict[str, Any] = {
        "cores": cores,
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = (
            torch_threads if torch_threads is not None else torch.get_num_threads()
        )
        info["device"] = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if info["device"].startswith("cuda") and torch.cuda.is_available():
            info["device_name"] = torch.cuda.get_device_name()
    except ImportError:  # pragma: no cover - torch is a dependency
        info["torch"] = None
        info["torch_threads"] = torch_threads
        info["device"] = device
    try:
        import trio

        info["trio"] = getattr(trio, "__version__", None)
    except ImportError:  # pragma: no cover
        pass
    info["load_average_1m"] = load_average()
    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY") if k in os.environ}
    if env:
        info["env"] = env
    return info


def run_in_trio(
    report: Report,
    main: Callable[[Any, Report], Awaitable[None]],
    args: Any,
    *,
    torch_threads: int | None = None,
) -> Report:
    """Run ``main(args, report)`` in a fresh ``trio.run`` and complete ``report`` with the
    machine (read *after* the run: torch's thread count is the worker's by then), the 1-minute
    load average from *before* it, and the duration."""
    import trio

    started = time.perf_counter()
    load_before = load_average()
    trio.run(main, args, report)
    report.machine = machine_info(torch_threads=torch_threads)
    report.machine["load_average_1m"] = load_before
    report.duration_s = time.perf_counter() - started
    return report


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command as the user would retype it (``omni-trio bench ...``)."""
    args = list(sys.argv if argv is None else argv)
    if not args:
        return ""
    head = os.path.basename(args[0])
    if head == "__main__.py":
        head = "python -m omni_trio.bench"
    elif head.startswith("python") or head == "-c":
        head = "python"
    return " ".join([head, *(shlex.quote(a) for a in args[1:])])


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A plain-text table (GitHub-markdown compatible) of ``rows`` in ``columns`` order."""
    if not rows:
        return "(no results)"
    cols = list(columns) if columns is not None else list(dict.fromkeys(k for r in rows for k in r))
    cells = [[_cell(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]

    def line(values: Sequence[str]) -> str:
        return "| " + " | ".join(v.ljust(w) for v, w in zip(values, widths, strict=True)) + " |"

    out = [line(cols), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out.extend(line(row) for row in cells)
    return "\n".join(out)


def _jsonable(value: Any) -> Any:
    if isinstance(value, Summary):
        return value.to_dict()
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


@dataclass
class Report:
    """The result of one experiment run: what ran, where, and what it measured.

    ``params`` holds the model, sizes, steps, repeats...; ``results`` the measured figures
    (``Summary`` values are written as dicts); ``rows`` the printed table; ``notes`` anything
    a reader of the numbers must know (a missed target, a fallback that was taken).
    """

    experiment: str
    command: str
    params: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    columns: list[str] | None = None
    notes: list[str] = field(default_factory=list)
    started_at: str = field(
        default_factory=lambda: _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    )
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(
            {
                "schema": JSON_SCHEMA_VERSION,
                "experiment": self.experiment,
                "command": self.command,
                "started_at": self.started_at,
                "duration_s": round(self.duration_s, 3),
                "machine": self.machine,
                "params": self.params,
                "results": self.results,
                "rows": self.rows,
                "notes": self.notes,
            }
        )

    def write_json(self, path: str | os.PathLike[str]) -> None:
        target = Path(path)
        if target.parent and not target.parent.exists():
            target.parent.mkdir(parents=True)
        target.write_text(json.dumps(self.to_dict(), indent=2) + "\n", "utf-8")

    def render(self) -> str:
        machine = self.machine
        head = (
            f"{self.experiment}: {machine.get('cores')} cores, torch {machine.get('torch')} "
            f"({machine.get('torch_threads')} threads, {machine.get('device')}), "
            f"load {machine.get('load_average_1m')} before, {self.duration_s:.1f} s"
        )
        scalars = {
            k: v
            for k, v in self.params.items()
            if isinstance(v, str | int | float | bool | list) and v not in ([], None)
        }
        params = ", ".join(f"{k}={_cell(v)}" for k, v in scalars.items())
        parts = [
            head,
            f"$ {self.command}",
            f"params: {params}",
            format_table(self.rows, self.columns),
        ]
        parts.extend(f"note: {n}" for n in self.notes)
        return "\n".join(parts)


class Progress:
    """A one-line progress bar on stderr for long runs.

    Draws only when ``enabled`` and the stream is a terminal, at most ten times a second, so
    it never floods logs or test output.  Use as a context manager; :meth:`advance` after each
    unit of work.
    """

    def __init__(
        self,
        total: int,
        label: str,
        *,
        enabled: bool = True,
        stream: IO[str] | None = None,
        width: int = 30,
    ) -> None:
        self.total = max(1, total)
        self.label = label
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self.width = width
        self._started = time.perf_counter()
        self._last_draw = 0.0

    def advance(self, n: int = 1) -> None:
        self.done = min(self.total, self.done + n)
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._last_draw >= 0.1 or self.done == self.total:
            self._last_draw = now
            self.stream.write("\r" + self.line(now))
            self.stream.flush()

    def line(self, now: float | None = None) -> str:
        elapsed = (time.perf_counter() if now is None else now) - self._started
        filled = int(self.width * self.done / self.total)
        bar = "#" * filled + "-" * (self.width - filled)
        return f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:.1f}s"

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * (len(self.line()) + 2) + "\r")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def csv_arg(text: str) -> tuple[str, ...]:
    """argparse type: comma-separated names (blanks dropped)."""
    return tuple(v.strip() for v in text.split(",") if v.strip())


def positive_ints_arg(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated positive integers."""
    import argparse

    try:
        values = tuple(int(v) for v in csv_arg(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values
