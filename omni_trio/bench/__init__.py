"""``omni-trio bench <experiment>``: the benchmark harness (issue #7).

Experiments: ``overhead`` (engine vs a direct call of the same loaded model), ``throughput``
(N requests at a concurrency), ``scheduler`` (per-tick cost vs queue length), ``steps`` (step
mode vs request mode on a mixed workload, issue #3), ``backends`` (tractor vs inproc,
async output, shared-memory transfer, CFG-parallel; issue #4), ``recovery`` (a worker SIGKILL
until the engine serves again, and a kill-every-few-seconds soak; issue #5), ``serve`` (the
HTTP daemon vs the same model in-process; issue #6), ``executors`` (ray vs tractor vs inproc
per request, throughput and startup, 1 and 2 workers; issue #8) and ``quality``
(``builtin:shapes`` prompt adherence: colour and shape of seeded generations; issue #9).
Each prints a table and, with ``--json FILE``, writes the figures with the machine and the
command.
``--quick`` is a smoke run (seconds); its numbers mean nothing.

The CLI registers the subcommand with :func:`add_bench_parser`; ``python -m omni_trio.bench``
runs the same parser standalone.
"""

from ._cli import add_bench_parser as add_bench_parser
from ._cli import configure_parser as configure_parser
from ._cli import run_bench as run_bench

__all__ = ["add_bench_parser", "configure_parser", "run_bench"]
