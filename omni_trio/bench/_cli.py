"""The ``bench`` command line: common options, one sub-command per experiment, dispatch."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import Any

from .._cli_args import HelpFormatter
from .._cli_render import strip_rest
from ..errors import OmniTrioError
from .harness import Report, command_line

__all__ = ["EXPERIMENTS", "add_bench_parser", "configure_parser", "run_bench"]

EXPERIMENTS = (
    "overhead",
    "throughput",
    "scheduler",
    "steps",
    "backends",
    "recovery",
    "serve",
    "quality",
    "executors",
    "policy",
    "dataparallel",
    "sleep",
    "fuzz-power",
)

_HELP = {
    "overhead": "engine latency vs a direct call of the same loaded model; echo runtime cost",
    "throughput": "N requests at a concurrency: requests/s, images/s, latency, queue wait",
    "scheduler": "schedule() + update_from_output() cost per tick as the queue grows",
    "steps": "step mode (continuous batching) vs request mode on a mixed-step workload",
    "backends": "tractor vs inproc: per-request cost, async output, shm transfer, CFG-parallel",
    "recovery": "worker SIGKILL: time until the engine serves again; a kill-every-few-s soak",
    "serve": "the HTTP daemon under closed- and open-loop load vs the same model in-process",
    "quality": "builtin:shapes prompt adherence: colour and shape of seeded generations",
    "executors": "ray vs tractor vs inproc: per-request latency, throughput, startup",
    "policy": "fifo vs priority vs fair under a seeded open-loop mixed trace at 0.7x-2x capacity",
    "dataparallel": "serve --data-parallel vs replicas, workers and the two-process limit",
    "sleep": "sleep and wake of a worker process: memory awake / asleep / woken, wake latency",
    "fuzz-power": "the fuzzer's mutation score: a bounded campaign per shipped planted bug",
}


def _experiment_module(name: str) -> Any:
    """The module of experiment ``name``: ``add_arguments(parser)`` and ``run(args, command)``.

    Experiment modules import no torch at import time: the CLI builds this parser always.
    """
    if name not in EXPERIMENTS:  # pragma: no cover - argparse restricts the choices
        raise ValueError(f"unknown experiment {name!r}")
    return importlib.import_module(f"{__package__}.{name.replace('-', '_')}")


def _add_common(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("common options")
    group.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    group.add_argument(
        "--quick", action="store_true", help="a smoke run (seconds); the numbers mean nothing"
    )
    group.add_argument("--repeats", type=int, default=None, help="measured rounds")
    group.add_argument("--warmup", type=int, default=None, help="unmeasured rounds first")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the experiments as sub-commands of ``parser`` and set ``func`` to :func:`run_bench`."""
    parser.set_defaults(func=run_bench)
    sub = parser.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    for name in EXPERIMENTS:
        p = sub.add_parser(
            name,
            help=_HELP[name],
            description=_experiment_module_doc(name),
            formatter_class=HelpFormatter,  # defaults shown, no docstring markup
        )
        _add_common(p)
        _experiment_module(name).add_arguments(p)
        p.set_defaults(func=run_bench, experiment=name)


def _experiment_module_doc(name: str) -> str | None:
    """The first paragraph of the experiment's docstring, without its reST markup."""
    doc: str | None = _experiment_module(name).__doc__
    return strip_rest(doc.split("\n\n")[0]) if doc else None


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on the CLI's ``subparsers`` (from ``add_subparsers()``).

    The parsed namespace's ``func(args) -> int`` runs the chosen experiment and returns the
    exit code.
    """
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="run a benchmark: overhead, throughput, scheduler, steps, backends, recovery, serve, "
        "quality, executors or policy",
        description="Benchmarks: warmup, interleaved repeated measurement, a table and JSON.",
    )
    configure_parser(parser)
    return parser


def run_bench(
    args: argparse.Namespace,
    *,
    argv: list[str] | None = None,
    out: Callable[[str], None] | None = None,
) -> int:
    """Run ``args.experiment``: print its table, write ``--json``; return the exit code.

    0 when the experiment ran (a missed target is reported, never an error); 2 for bad input
    (a bad option or config, a model that does not exist); 1 when the run failed (the engine
    died, a file could not be written).  Failures print one line on stderr.
    """
    write = out or print
    module = _experiment_module(args.experiment)
    command = command_line(argv)
    try:
        report: Report = module.run(args, command)
        write(report.render())
        if args.json:
            report.write_json(args.json)
            write(f"wrote {args.json}")
    except ValueError as exc:  # InvalidConfigError and InvalidRequestError are ValueErrors
        print(f"omni-trio bench {args.experiment}: error: {exc}", file=sys.stderr)
        return 2
    except (OmniTrioError, RuntimeError, OSError) as exc:
        print(
            f"omni-trio bench {args.experiment}: error: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )
        return 1
    return 0
