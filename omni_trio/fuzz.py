"""``omni-trio fuzz``: fuzzing campaigns over a real engine, reproducers, and their replay.

A *campaign* runs the Hypothesis state machine of :mod:`omni_trio.testing.machine` (a real
engine on ``builtin:echo``; random submits with injected faults, aborts, consumer drops,
worker crashes, RPCs, close and reopen; the invariant checker after every rule and over each
engine's whole trace) until ``--examples`` examples ran, ``--duration`` seconds passed, or the
first failure.  Hypothesis shrinks a failure, and the campaign writes it as a *reproducer
directory*::

    <out>/<backend>-<mode>-<YYYYmmdd-HHMMSS>/
        reproducer.json   schema, versions, MachineOptions, settings and seed, the failure
                          (type, message, @reproduce_failure blob) and the shrunk steps
        steps.txt         Hypothesis' notes on the failure, verbatim (the rule sequence)
        trace.jsonl       the failing engine's lifecycle trace, one TraceEvent.to_dict a line
        violations.txt    the formatted violations (only for an InvariantViolation)
        db/               the Hypothesis example database holding the failing example

``omni-trio fuzz --replay <dir>/reproducer.json`` runs that example again: first from the
example database (phases explicit and reuse, read-only, so the reproducer is never changed),
then, if that did not fail, from the ``@reproduce_failure`` blob (same Hypothesis version
only).  The database key of a machine is stable across processes: Hypothesis hashes the
machine class, which it cannot find in the source (it is made at run time), so it hashes the
class name ``EngineMachine_<backend>_<mode>``, which is deterministic.

Time budget.  Hypothesis cannot stop a run on a deadline, so a campaign runs in *chunks*: one
Hypothesis run of a few examples at a time, sized from the measured example rate to end by the
deadline (and to last at most :data:`CHUNK_TARGET_S`), until the time is up.  The chunks share
the counters and the example database.  Each chunk starts with Hypothesis' simplest example
(``--steps`` rules of ``close_and_reopen``), which is why chunks are as large as the budget
allows: the first is two examples (to measure the rate), and a later one of fewer than two is
not run.  ``--examples`` alone is one chunk.  Shrinking a failure is not bounded by
``--duration`` (Hypothesis gives up shrinking after five minutes); ``--no-shrink`` skips it.
The explain phase is always skipped (see :func:`_phases`).

The failing trace.  The machine checks the *live* recorder after every rule without keeping
it, and keeps only the events of the engine it last closed.  So the machine class is wrapped
(:func:`_keeping_trace`, same name) to remember each example's recorder at teardown: the
failing example is the last one Hypothesis runs (its final replay), so that recorder is the
failing engine's, and teardown's close completes it up to CLOSED.

Seeds.  A chunk runs under ``@seed(...)`` (``hypothesis.seed`` applied to the machine class,
which ``run_state_machine_as_test`` honours; ``settings`` has no seed).  ``--seed S`` gives
chunk ``k`` the seed ``S + k``; without it each chunk draws a random one.  The failing chunk's
seed is saved in the reproducer.  ``settings.derandomize`` is never used: it seeds from the
test's digest, so every chunk would replay the same examples.  The same seed and flags draw
the same examples as long as the chunks are the same (always with ``--examples`` alone); the
engine's timing is real, so a timing-dependent outcome may still differ.

Exit status: 0 no failure (or the replay did not reproduce), 1 a failure found (or
reproduced), 2 bad flags, an unreadable reproducer or Hypothesis missing, 130 interrupted.

Hypothesis is imported only when a campaign or a replay runs, so the CLI works without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import logging
import math
import random
import re
import shutil
import sys
import tempfile
import threading
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, cast

from ._cli_args import nonneg_int, positive_int
from ._cli_exit import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    CliError,
    run_command,
    walk_exceptions,
)
from ._core.trace import TraceRecorder

if TYPE_CHECKING:
    from hypothesis import Phase
    from hypothesis import settings as Settings
    from hypothesis.stateful import RuleBasedStateMachine

    from ._core.faults import Fault
    from .testing.driver import EngineDriver
    from .testing.machine import CampaignStats, MachineOptions
    from .testing.mutants import Mutant

__all__ = [
    "CHUNK_TARGET_S",
    "DEFAULT_DURATION_S",
    "DEFAULT_OUT",
    "DEFAULT_SHRINK_LIMIT_S",
    "DEFAULT_STEPS",
    "SCHEMA_VERSION",
    "CampaignPlan",
    "CampaignResult",
    "ReplayResult",
    "add_fuzz_parser",
    "cmd_fuzz",
    "fuzzable_faults",
    "replay",
    "run_campaign",
    "stats_line",
]

# 2: the machine draws more per rule (sizes, outputs, deadlines, waves): a reproducer of
# schema 1 would replay other choices, so it is refused rather than "not reproduced".
SCHEMA_VERSION = 2
DEFAULT_STEPS = 30
#: How long a found failure is shrunk at most (Hypothesis' own bound is 5 minutes).
DEFAULT_SHRINK_LIMIT_S = 120.0
DEFAULT_DURATION_S = 60.0  # when neither --duration nor --examples is given
DEFAULT_OUT = "fuzz-failures"
PROGRESS_INTERVAL_S = 2.0
#: The longest a chunk of a timed campaign is planned to run.
CHUNK_TARGET_S = 30.0
_UNBOUNDED_EXAMPLES = 1_000_000_000
# Where run_engine_machine puts built-in models when no cache dir is given.
_DEFAULT_CACHE = tempfile.gettempdir() + "/omni-trio-fuzz"
_INSTALL_HINT = "pip install 'omni-trio[testing]'"
_BLOB = re.compile(r"@reproduce_failure\('([^']+)', b'([^']*)'\)")
# A step as Hypothesis prints it: ``state = M()``, ``state.rule(...)``, ``r_0 = state.rule(...)``.
_STEP = re.compile(r"^(?:\w+(?:, \w+)* = )?state\b")
# Flags that describe a campaign: --replay takes all of them from the reproducer instead.
_CAMPAIGN_FLAGS = {
    "backend": "--backend",
    "mode": "--mode",
    "start_method": "--start-method",
    "duration": "--duration",
    "examples": "--examples",
    "steps": "--steps",
    "max_num_seqs": "--max-num-seqs",
    "data_parallel": "--data-parallel",
    "scheduling_policy": "--scheduling-policy",
    "pictures": "--pictures",
    "faults": "--faults",
    "no_faults": "--no-faults",
    "no_crash_rule": "--no-crash-rule",
    "no_close_rule": "--no-close-rule",
    "no_shrink": "--no-shrink",
    "shrink_limit": "--shrink-limit",
    "seed": "--seed",
    "mutant": "--mutant",
}


def fuzzable_faults() -> tuple[Fault, ...]:
    """Every per-request fault kind (``fail_warmup`` is an engine option, not a request's)."""
    from ._core.faults import Fault

    return tuple(f for f in Fault if f is not Fault.FAIL_WARMUP)


# -- the command line ------------------------------------------------------------------------


def _fault_list(text: str) -> tuple[Fault, ...]:
    known = {f.value: f for f in fuzzable_faults()}
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError("no fault named; use --no-faults for none")
    unknown = [name for name in names if name not in known]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown fault {', '.join(map(repr, unknown))} (choose from {', '.join(known)})"
        )
    return tuple(dict.fromkeys(known[name] for name in names))


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}")
    return value


def add_fuzz_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``omni-trio fuzz`` on the CLI's subparsers (imports nothing heavy)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "fuzz",
        help="fuzz the engine's lifecycle invariants with a Hypothesis state machine",
        description="Run a fuzzing campaign: a Hypothesis state machine drives a real engine "
        "(builtin:echo) with random requests, injected faults, aborts, consumer drops, "
        "crashes, RPCs and restarts, checking the lifecycle invariants after every rule.  "
        "The first failure is shrunk and written as a reproducer directory.  See "
        "docs/fuzzing.md.",
        epilog="exit status: 0 no failure (--replay: did not reproduce), 1 a failure found "
        "(--replay: reproduced), 2 bad flags or Hypothesis missing, 130 interrupted",
    )
    campaign = parser.add_argument_group("campaign")
    campaign.add_argument(
        "--backend",
        choices=("inproc", "tractor", "ray"),
        default=None,
        help="executor (inproc); tractor and ray run worker processes (ray: a local Ray "
        "unless $RAY_ADDRESS names a cluster; needs the ray extra)",
    )
    campaign.add_argument(
        "--mode", choices=("request", "step"), default=None, help="execution mode (request)"
    )
    campaign.add_argument(
        "--start-method",
        choices=("trio", "forkserver"),
        default=None,
        help="tractor: how worker processes start (trio); forkserver restarts crashed "
        "workers in ~0.2 s instead of seconds, so more examples fit in a budget",
    )
    campaign.add_argument(
        "--duration",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help=f"stop after this long (default {DEFAULT_DURATION_S:g} s when --examples is not "
        "given either); a failure found is still shrunk",
    )
    campaign.add_argument(
        "--examples",
        type=positive_int,
        default=None,
        metavar="N",
        help="stop after this many examples",
    )
    campaign.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"rules per example (stateful_step_count, default {DEFAULT_STEPS})",
    )
    campaign.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=None,
        metavar="N",
        help="engine batch size (4: the wave rule fuses 2-4 requests into one forward)",
    )
    campaign.add_argument(
        "--data-parallel",
        type=positive_int,
        default=None,
        metavar="N",
        help="tractor, ray: N data-parallel worker processes, each running different requests (1)",
    )
    campaign.add_argument(
        "--scheduling-policy",
        choices=("fifo", "priority", "fair"),
        default=None,
        help="the engine's scheduling policy (fifo); under priority every request draws a "
        "priority in -3..3, so later, better ones pass earlier ones (in step mode they may "
        "preempt running ones; the preemptions counter says how often)",
    )
    campaign.add_argument(
        "--pictures",
        action="store_true",
        default=None,
        help="requests may start from a picture (image-to-image, inpainting; some over the "
        "shared-memory threshold), so every rule also runs with pictures on the wire",
    )
    faults = campaign.add_mutually_exclusive_group()
    faults.add_argument(
        "--faults",
        type=_fault_list,
        default=None,
        metavar="KIND,...",
        help="faults submit may inject (default: every per-request kind: "
        "raise_at_step, crash_at_step, sigkill_at_step, hang_at_step, slow_packing, "
        "fail_packing, delay_compute_done, delay_output_ready)",
    )
    faults.add_argument("--no-faults", action="store_true", help="inject no request faults")
    campaign.add_argument(
        "--no-crash-rule", action="store_true", help="never crash a worker from outside"
    )
    campaign.add_argument(
        "--no-close-rule", action="store_true", help="never close and reopen mid-example"
    )
    campaign.add_argument(
        "--no-shrink",
        action="store_true",
        help="report the first failing example as found (no shrink phase: much faster with "
        "slow examples, e.g. on tractor, but the steps are not minimal)",
    )
    campaign.add_argument(
        "--shrink-limit",
        type=_positive_seconds,
        default=None,
        metavar="SECONDS",
        help=f"stop shrinking a failure after this long (default {DEFAULT_SHRINK_LIMIT_S:g} s); "
        "the smallest failing example found by then is the reproducer",
    )
    campaign.add_argument(
        "--mutant",
        default=None,
        metavar="NAME|MODULE:ATTR",
        help="plant a bug in the runtime for this campaign: a shipped mutant's name (see "
        "omni-trio bench fuzz-power --list) or your own omni_trio.testing.mutants.Mutant as "
        "package.module:attribute; its options (mode, batch size...) apply unless given "
        "here.  In-process: it reaches the worker processes of --backend tractor/ray only "
        "where it patches the engine's side",
    )
    campaign.add_argument(
        "--seed",
        type=nonneg_int,
        default=None,
        metavar="N",
        help="seed the campaign: chunk k runs under @seed(SEED + k) (default: random)",
    )
    parser.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help=f"where reproducer directories go (default ./{DEFAULT_OUT}; with --replay: "
        "write one only when given)",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        metavar="DIR",
        help=f"where built-in models are created (default {_DEFAULT_CACHE})",
    )
    parser.add_argument(
        "--replay",
        default=None,
        metavar="FILE",
        help="rerun a reproducer (its reproducer.json, or its directory) instead of a campaign",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="print only the summary (no progress lines)"
    )
    parser.set_defaults(handler=cmd_fuzz)
    return parser


def cmd_fuzz(args: argparse.Namespace) -> int:
    """``omni-trio fuzz``: a campaign, or ``--replay`` of a reproducer."""
    return run_command(lambda: _fuzz_main(args))


def _fuzz_main(args: argparse.Namespace) -> int:
    _require_hypothesis()
    with _quiet_runtime_logs(args.verbose):
        if args.replay is not None:
            given = [
                flag
                for name, flag in _CAMPAIGN_FLAGS.items()
                if getattr(args, name) is not None and getattr(args, name) is not False
            ]
            if given:
                raise CliError(
                    "--replay reruns a reproducer with its own options; drop " + ", ".join(given),
                    EXIT_USAGE,
                )
            result = replay(
                Path(args.replay),
                out=None if args.out is None else Path(args.out),
                cache_dir=args.cache_dir,
                stdout=sys.stdout,
            )
            return EXIT_FAILED if result.reproduced else EXIT_OK
        plan = _plan_from_args(args)
        if plan.options.backend == "ray":
            _require_ray()
        campaign = run_campaign(plan, stdout=sys.stdout)
        return EXIT_OK if campaign.failure is None else EXIT_FAILED


def _require_ray() -> None:
    from .testing.machine import backend_unavailable

    reason = backend_unavailable("ray")
    if reason is not None:
        raise CliError(f"omni-trio fuzz --backend ray: {reason}", EXIT_USAGE)


def _require_hypothesis() -> None:
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        raise CliError(
            f"omni-trio fuzz needs Hypothesis, which is not installed: {_INSTALL_HINT}",
            EXIT_USAGE,
        ) from None


@contextmanager
def _quiet_runtime_logs(verbosity: int) -> Iterator[None]:
    """Injected faults make the runtime log a warning per crash and restart, by design; a
    campaign hides them unless ``-v`` is given (the level is restored afterwards)."""
    logger = logging.getLogger("omni_trio")
    before = logger.level
    if verbosity <= 0:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(before)


def _load_mutant(spec: str) -> Mutant:
    from .testing.mutants import find_mutant

    try:
        return find_mutant(spec)
    except (KeyError, ValueError) as exc:
        message = exc.args[0] if exc.args else str(exc)
        raise CliError(f"--mutant {spec}: {message}", EXIT_USAGE) from None


def _plan_from_args(args: argparse.Namespace) -> CampaignPlan:
    from .testing.machine import MachineOptions

    mutant = None if args.mutant is None else _load_mutant(args.mutant)
    fields: dict[str, Any] = dict(mutant.options) if mutant is not None else {}
    if args.no_crash_rule:
        fields["crash_rule"] = False
    if args.no_close_rule:
        fields["close_rule"] = False
    if args.cache_dir is not None:
        fields["cache_dir"] = args.cache_dir
    fields.setdefault("backend", "inproc")
    fields.setdefault("mode", "request")
    if args.backend is not None:
        fields["backend"] = args.backend
    if args.mode is not None:
        fields["mode"] = args.mode
    if args.max_num_seqs is not None:
        fields["max_num_seqs"] = args.max_num_seqs
    if args.data_parallel is not None:
        if fields["backend"] == "inproc" and args.data_parallel > 1:
            raise CliError(
                f"{PROG} fuzz --data-parallel {args.data_parallel} runs worker processes: "
                "use --backend tractor or ray",
                EXIT_USAGE,
            )
        fields["data_parallel_size"] = args.data_parallel
    if args.scheduling_policy is not None:
        fields["scheduling_policy"] = args.scheduling_policy
    if args.pictures:
        fields["pictures"] = True
    if args.start_method is not None:
        fields["worker_start_method"] = args.start_method
    if args.no_faults:
        fields["faults"] = ()
    elif args.faults is not None:
        fields["faults"] = args.faults
    duration = args.duration
    if duration is None and args.examples is None:
        duration = DEFAULT_DURATION_S
    return CampaignPlan(
        options=MachineOptions(**fields),
        steps=args.steps or DEFAULT_STEPS,
        examples=args.examples,
        duration_s=duration,
        seed=args.seed,
        shrink=not args.no_shrink,
        shrink_limit_s=args.shrink_limit or DEFAULT_SHRINK_LIMIT_S,
        out=Path(args.out if args.out is not None else DEFAULT_OUT),
        quiet=args.quiet,
        mutant=args.mutant,
    )


# -- campaigns -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CampaignPlan:
    """What to fuzz and for how long.  ``examples`` and ``duration_s`` both bound the
    campaign (whichever comes first); at least one must be given."""

    options: MachineOptions
    steps: int = DEFAULT_STEPS
    examples: int | None = None
    duration_s: float | None = None
    seed: int | None = None
    shrink: bool = True
    shrink_limit_s: float = DEFAULT_SHRINK_LIMIT_S
    out: Path = Path(DEFAULT_OUT)
    quiet: bool = False
    # A planted bug applied for the campaign (omni_trio.testing.mutants): a shipped name or
    # "module:attribute"; recorded in the reproducer, and applied again by its replay.
    mutant: str | None = None


@dataclass
class CampaignResult:
    """A finished campaign: its counters, and the failure and its reproducer if one was found."""

    stats: CampaignStats
    failure: BaseException | None = None
    reproducer: Path | None = None


@dataclass
class _LastEngine:
    """The trace recorder of the engine the last example ran (set by the wrapped machine).

    The machine's per-rule invariant checks the *live* recorder and does not store it, and its
    close check stores only the events; the failing example is the last one Hypothesis runs
    (its final replay), so its recorder is the one to save.
    """

    recorder: TraceRecorder | None = None
    # Events recorded when the example ended, before teardown closed the engine.
    events_at_failure: int | None = None


def stats_line(stats: CampaignStats) -> str:
    """The progress line: counters, rates and elapsed time of a campaign."""
    s = stats
    return (
        f"examples {s.examples}  rules {s.rules} ({s.rate(s.rules):.1f}/s)  "
        f"requests {s.requests} ({s.rate(s.requests):.1f}/s)  faults {s.faults_injected}  "
        f"crashes {s.crashes}  restarts {s.restarts}  preemptions {s.preemptions}  "
        f"pictures {s.pictures}  invariant checks {s.invariant_checks}  "
        f"elapsed {s.elapsed_s:.1f} s"
    )


class _ProgressReporter:
    """Prints :func:`stats_line` every ``interval`` seconds from a thread that only reads the
    counters.  A context manager: leaving it stops and joins the thread (no line is printed
    after that).  Its name must not start with ``omni-trio``: the machine counts those
    threads as the engine's leftovers (INV-3)."""

    def __init__(self, stats: CampaignStats, out: TextIO, interval: float) -> None:
        self._stats = stats
        self._out = out
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fuzz-progress", daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            print(stats_line(self._stats), file=self._out, flush=True)

    def __enter__(self) -> _ProgressReporter:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


@contextmanager
def _progress(stats: CampaignStats, out: TextIO, *, enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    with _ProgressReporter(stats, out, PROGRESS_INTERVAL_S):
        yield


def _chunk_size(left: int, remaining_s: float | None, stats: CampaignStats, chunk: int) -> int:
    """How many examples the next Hypothesis run gets; 0 means stop.

    Without a deadline: all that are left (one run).  With one: two for the first chunk (which
    measures the example rate), then what the rate fits in the time left, at most
    CHUNK_TARGET_S.  Every chunk starts with Hypothesis' simplest example, which the first
    chunk already ran, so a later chunk of fewer than two examples would only repeat it: the
    campaign stops instead.
    """
    if remaining_s is None:
        return left
    if chunk == 0:
        return min(left, 2)
    rate = stats.examples / max(stats.elapsed_s, 1e-9)
    size = min(left, int(rate * min(remaining_s, CHUNK_TARGET_S)))
    return size if size >= 2 else 0


@contextmanager
def _planted(spec: str | None) -> Iterator[None]:
    """The mutant ``spec`` applied for the duration (nothing when None)."""
    if spec is None:
        yield
        return
    from .testing.mutants import applied

    with applied(_load_mutant(spec)):
        yield


@contextmanager
def _shrink_limit(seconds: float) -> Iterator[None]:
    """Bound Hypothesis' shrinking to ``seconds`` (its own bound, MAX_SHRINKING_SECONDS, is
    5 minutes and has no setting; the module attribute is set for the campaign and restored).
    With a Hypothesis that lacks it, nothing changes."""
    from hypothesis.internal.conjecture import engine

    before = getattr(engine, "MAX_SHRINKING_SECONDS", None)
    if before is None:
        yield
        return
    engine.MAX_SHRINKING_SECONDS = max(1, math.ceil(seconds))
    try:
        yield
    finally:
        engine.MAX_SHRINKING_SECONDS = before


def hits_line(stats: CampaignStats) -> str:
    """How often the campaign reached each hard path (``paths`` in the summary)."""
    from .testing.machine import PATHS

    return "paths  " + "  ".join(f"{path} {stats.hits.get(path, 0)}" for path in PATHS)


def _reserve_dir(out: Path, backend: str, mode: str) -> Path:
    """Create and return ``out/<backend>-<mode>-<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``... when
    taken: two campaigns started in the same second never share a directory)."""
    name = f"{backend}-{mode}-{time.strftime('%Y%m%d-%H%M%S')}"
    out.mkdir(parents=True, exist_ok=True)
    for suffix in itertools.count(1):
        path = out / (name if suffix == 1 else f"{name}-{suffix}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise AssertionError("unreachable")


def _remove_if_empty(*paths: Path) -> None:
    for path in paths:
        try:
            path.rmdir()
        except OSError:
            return  # not empty (or already gone): keep it, and its parents


def _phases(shrink: bool) -> list[Phase]:
    """Every phase but explain (and shrink unless ``shrink``).  Explain reruns the failing
    example many times over (a real engine each) to list the source lines only failing runs
    reached, which a lifecycle failure's steps, trace and violations already say better."""
    from hypothesis import Phase

    skip = {Phase.explain} if shrink else {Phase.explain, Phase.shrink}
    return [p for p in Phase if p not in skip]


def _settings(
    steps: int, max_examples: int, database: Any, phases: list[Phase] | None = None
) -> Settings:
    from hypothesis import HealthCheck
    from hypothesis import settings as Settings

    return Settings(
        phases=phases if phases is not None else _phases(shrink=True),
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,  # a real engine: wall-clock deadlines would only be noise
        suppress_health_check=list(HealthCheck),
        database=database,
        derandomize=False,  # see the module docstring: seeds come from @seed
        print_blob=True,  # the @reproduce_failure blob, in the exception's notes
        report_multiple_bugs=False,  # one failure, one exception, one reproducer
    )


def run_campaign(plan: CampaignPlan, *, stdout: TextIO | None = None) -> CampaignResult:
    """Fuzz ``plan.options`` until ``plan.examples`` examples ran, ``plan.duration_s`` passed
    or an example failed; write a reproducer directory under ``plan.out`` for a failure.

    Prints the progress line every PROGRESS_INTERVAL_S (unless ``plan.quiet``) and a summary
    on ``stdout``.  Blocks (it runs its own trio loop in this thread, like ``run_driven``).
    A KeyboardInterrupt prints the summary and propagates.
    """
    from hypothesis.database import DirectoryBasedExampleDatabase

    from .testing.machine import CampaignStats

    if plan.examples is None and plan.duration_s is None:
        raise ValueError("a campaign needs examples or duration_s")
    out = stdout if stdout is not None else sys.stdout
    options = plan.options
    stats = CampaignStats()
    last = _LastEngine()
    created_out = not plan.out.exists()
    directory = _reserve_dir(plan.out, options.backend, options.mode)
    database = DirectoryBasedExampleDatabase(str(directory / "db"))
    cap = plan.examples if plan.examples is not None else _UNBOUNDED_EXAMPLES
    deadline = None if plan.duration_s is None else stats.started_at + plan.duration_s
    seeds = random.SystemRandom()
    faults = ",".join(f.value for f in options.faults) or "none"
    if not plan.quiet:
        limits = [f"{plan.examples} examples"] if plan.examples is not None else []
        if plan.duration_s is not None:
            limits.append(f"{plan.duration_s:g} s")
        print(
            f"{PROG} fuzz: {options.backend}/{options.mode}, {plan.steps} steps per example, "
            f"max_num_seqs {options.max_num_seqs}, "
            f"data parallel {options.data_parallel_size}, "
            f"policy {options.scheduling_policy}, faults {faults}, "
            f"pictures {'on' if options.pictures else 'off'}, "
            f"crash rule {'on' if options.crash_rule else 'off'}, "
            f"close rule {'on' if options.close_rule else 'off'}, "
            f"seed {plan.seed if plan.seed is not None else 'random'}, "
            f"until {' or '.join(limits)} or the first failure",
            file=out,
            flush=True,
        )
    planned = 0
    chunk = 0
    failure: BaseException | None = None
    used: dict[str, Any] = {}
    try:
        with (
            _planted(plan.mutant),
            _shrink_limit(plan.shrink_limit_s),
            _progress(stats, out, enabled=not plan.quiet),
        ):
            while planned < cap:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    break
                size = _chunk_size(cap - planned, remaining, stats, chunk)
                if size == 0:
                    break
                chunk_seed = plan.seed + chunk if plan.seed is not None else seeds.getrandbits(64)
                used = {"chunk": chunk, "seed": chunk_seed, "max_examples": size}
                try:
                    _run_machine(
                        options,
                        _settings(plan.steps, size, database, _phases(plan.shrink)),
                        stats,
                        last,
                        seed=chunk_seed,
                    )
                except Exception as exc:
                    if _refused_by_hypothesis(exc):
                        raise  # a broken machine or settings: our bug, not a finding
                    failure = exc
                    break
                planned += size
                chunk += 1
    except KeyboardInterrupt:
        print(f"summary  {stats_line(stats)}", file=out)
        print(hits_line(stats), file=out, flush=True)
        raise
    finally:
        if failure is None:  # an interrupted shrink leaves the failing example in db/: kept
            _remove_if_empty(directory, *([plan.out] if created_out else []))
    result = CampaignResult(stats, failure)
    print(f"summary  {stats_line(stats)}", file=out)
    print(hits_line(stats), file=out)
    if failure is None:
        print(f"no failure in {stats.examples} examples", file=out, flush=True)
        return result
    settings_info = {
        **_settings_record(plan.steps, used["max_examples"], _phases(plan.shrink)),
        "seed": used["seed"],
        "campaign_seed": plan.seed,
        "chunk": used["chunk"],
        "shrink_limit_s": plan.shrink_limit_s,
        "mutant": plan.mutant,
    }
    result.reproducer = _write_reproducer(directory, options, settings_info, failure, last, stats)
    if stats.first_failure_s is not None:
        print(f"first failure after {stats.first_failure_s:.1f} s", file=out)
    print(f"FAILURE: {_headline(failure)}", file=out)
    print(f"reproducer written to {directory}", file=out)
    print(
        f"replay it with: {PROG} fuzz --replay {directory / 'reproducer.json'}",
        file=out,
        flush=True,
    )
    return result


def _settings_record(steps: int, max_examples: int, phases: list[Phase]) -> dict[str, Any]:
    return {
        "max_examples": max_examples,
        "stateful_step_count": steps,
        "deadline": None,
        "derandomize": False,
        "phases": [p.name for p in phases],
        "suppress_health_check": "all",
        "print_blob": True,
        "report_multiple_bugs": False,
        "database": "db",
    }


def _run_machine(
    options: MachineOptions,
    settings: Settings,
    stats: CampaignStats,
    last: _LastEngine,
    *,
    seed: int | None = None,
    blob: tuple[str, bytes] | None = None,
) -> None:
    """:func:`~omni_trio.testing.machine.run_engine_machine`, with the machine class wrapped to
    keep the last example's trace recorder, and decorated with ``@seed`` / ``@reproduce_failure``
    (which must go on the class, so this builds it itself).  Raises the machine's failure."""
    from hypothesis import reproduce_failure
    from hypothesis import seed as seed_machine
    from hypothesis.stateful import run_state_machine_as_test

    from .testing.driver import run_driven
    from .testing.machine import make_engine_machine

    if options.cache_dir is None:
        options = dataclasses.replace(options, cache_dir=_DEFAULT_CACHE)

    def scenario(driver: EngineDriver) -> None:
        machine = _keeping_trace(make_engine_machine(options, lambda: driver, stats), last)
        if seed is not None:
            machine = seed_machine(seed)(machine)
        if blob is not None:
            machine = reproduce_failure(*blob)(machine)
        run_state_machine_as_test(machine, settings=settings)

    run_driven(scenario)


def _keeping_trace(
    base: type[RuleBasedStateMachine], last: _LastEngine
) -> type[RuleBasedStateMachine]:
    """A subclass of ``base`` (same name, so the same database key) that records in ``last``
    the trace recorder of each example's engine: the one a failure happened on."""

    def __init__(self: Any) -> None:
        last.recorder = None
        last.events_at_failure = None
        try:
            base.__init__(self)
        except BaseException:
            driver = getattr(self, "driver", None)
            if driver is not None:  # the engine failed to open: keep what it recorded
                last.recorder = driver.trace
            raise

    def teardown(self: Any) -> None:
        # The example is over (passed or failed); the recorder is that of the engine it ran
        # on, even when a rule failed mid-flight.  teardown then closes the engine, which
        # records the rest of its story (and CLOSED) into the same recorder.
        last.recorder = self.driver.trace
        last.events_at_failure = len(self.driver.trace)
        base.teardown(self)

    namespace = {
        "__init__": __init__,
        "teardown": teardown,
        "__module__": base.__module__,
        "__qualname__": base.__qualname__,
        "__doc__": base.__doc__,
    }
    machine = types.new_class(base.__name__, (base,), exec_body=lambda ns: ns.update(namespace))
    return cast("type[RuleBasedStateMachine]", machine)


# -- failures and reproducers ------------------------------------------------------------------


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc``, the members of groups in it, and its causes and contexts, depth first."""
    return walk_exceptions(exc, contexts=True)


def _notes(exc: BaseException) -> list[str]:
    """Hypothesis' notes on the failure: the first exception in the chain that has steps."""
    found: list[str] = []
    for item in _chain(exc):
        notes = [str(n) for n in getattr(item, "__notes__", ())]
        if any(_STEP.match(n) for n in notes):
            return notes
        found = found or notes
    return found


def _refused_by_hypothesis(exc: BaseException) -> bool:
    """Whether Hypothesis refused to run (a bad blob or definition, no valid example) rather
    than an example failing; a flaky failure (failed, then passed) is a failure."""
    from hypothesis.errors import Flaky, HypothesisException

    return isinstance(exc, HypothesisException) and not isinstance(exc, Flaky)


def _headline(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def _write_reproducer(
    directory: Path,
    options: MachineOptions,
    settings_info: dict[str, Any],
    failure: BaseException,
    last: _LastEngine,
    stats: CampaignStats,
    *,
    database_from: Path | None = None,
) -> Path:
    """Write the reproducer files into ``directory`` (created; its ``db/`` may already hold
    the example database, or is copied from ``database_from``).  Returns ``directory``."""
    import hypothesis
    from hypothesis.errors import Flaky

    from . import __version__
    from .testing.invariants import InvariantViolation

    directory.mkdir(parents=True, exist_ok=True)
    if database_from is not None and database_from.is_dir():
        shutil.copytree(database_from, directory / "db", dirs_exist_ok=True)
    notes = _notes(failure)
    steps = [n for n in notes if _STEP.match(n)]
    blob_match = next((m for n in notes if (m := _BLOB.search(n))), None)

    if last.recorder is not None:
        trace_text = last.recorder.to_json_lines()
        events = len(last.recorder)
    else:  # no example got as far as its teardown: the last trace the machine checked
        trace_text = "".join(json.dumps(e.to_dict(), default=str) + "\n" for e in stats.last_trace)
        events = len(stats.last_trace)
    (directory / "trace.jsonl").write_text(trace_text, "utf-8")
    (directory / "steps.txt").write_text("".join(n + "\n" for n in notes), "utf-8")

    # Earliest first: a violation in a rule may be followed by another when teardown closed
    # the engine (the later one masks the first; both are in the chain).
    violations = [e for e in reversed(_chain(failure)) if isinstance(e, InvariantViolation)]
    if violations:
        parts = []
        for index, error in enumerate(violations, 1):
            parts.append(f"# failure {index} of {len(violations)}\n{error}\n")
        (directory / "violations.txt").write_text("\n".join(parts), "utf-8")

    record = {
        "schema": SCHEMA_VERSION,
        "omni_trio_version": __version__,
        "hypothesis_version": hypothesis.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "options": options.to_dict(),
        "settings": settings_info,
        "failure": {
            "type": type(failure).__name__,
            "message": str(failure),
            # Failed, then passed on Hypothesis' final replay: trace.jsonl is that replay's.
            "flaky": isinstance(failure, Flaky),
            "chain": [_headline(e) for e in _chain(failure)[1:]],
            "reproduce_failure": blob_match.group(0) if blob_match else None,
            "blob": (
                {"version": blob_match.group(1), "data": blob_match.group(2)}
                if blob_match
                else None
            ),
        },
        "steps": steps,
        "trace": {
            "file": "trace.jsonl",
            "events": events,
            "events_at_failure": last.events_at_failure,
        },
        "files": {
            "steps": "steps.txt",
            "violations": "violations.txt" if violations else None,
            "database": "db",
        },
        "campaign": {
            "examples": stats.examples,
            "rules": stats.rules,
            "requests": stats.requests,
            "elapsed_s": round(stats.elapsed_s, 3),
            "first_failure_s": (
                None if stats.first_failure_s is None else round(stats.first_failure_s, 3)
            ),
            "hits": dict(stats.hits),
        },
        "mutant": settings_info.get("mutant"),
    }
    (directory / "reproducer.json").write_text(json.dumps(record, indent=2) + "\n", "utf-8")
    return directory


# -- replay ------------------------------------------------------------------------------------


@dataclass
class ReplayResult:
    """What a replay found: ``how`` is "example database" or "reproduce_failure blob" when
    it reproduced a failure."""

    reproduced: bool
    how: str | None = None
    failure: BaseException | None = None
    reproducer: Path | None = None
    notes: list[str] = field(default_factory=list)


def _load_reproducer(path: Path) -> tuple[Path, dict[str, Any]]:
    file = path / "reproducer.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text("utf-8"))
    except OSError as exc:
        raise CliError(f"cannot read reproducer {str(file)!r}: {exc.strerror}", EXIT_USAGE)
    except ValueError as exc:
        raise CliError(f"{str(file)!r} is not a reproducer (bad JSON: {exc})", EXIT_USAGE)
    if not isinstance(data, dict) or data.get("schema") != SCHEMA_VERSION:
        raise CliError(f"{str(file)!r} is not a reproducer of schema {SCHEMA_VERSION}", EXIT_USAGE)
    return file, data


def replay(
    path: Path,
    *,
    out: Path | None = None,
    cache_dir: str | None = None,
    stdout: TextIO | None = None,
) -> ReplayResult:
    """Run a reproducer's failing example again; see the module docstring.  Never changes the
    reproducer; writes a new one under ``out`` (when given) for a reproduced failure."""

    from .testing.machine import CampaignStats, MachineOptions

    stream = stdout if stdout is not None else sys.stdout
    file, data = _load_reproducer(path)
    try:
        options = MachineOptions.from_dict(data["options"])
        saved = data["settings"]
        steps = int(saved["stateful_step_count"])
        max_examples = int(saved.get("max_examples", 1))
    except (KeyError, TypeError, ValueError) as exc:
        raise CliError(f"{str(file)!r} has bad options or settings: {exc}", EXIT_USAGE)
    if cache_dir is not None:
        options = dataclasses.replace(options, cache_dir=cache_dir)
    db_dir = file.parent / str(saved.get("database") or "db")
    print(
        f"replaying {file} ({options.backend}/{options.mode}, {steps} steps per example)",
        file=stream,
        flush=True,
    )
    stats = CampaignStats()
    last = _LastEngine()
    with _planted(data.get("mutant")):
        result = _replay_runs(
            data, options, saved, steps, max_examples, db_dir, stats, last, stream
        )
    if result.failure is None:
        print(f"did not reproduce  ({stats_line(stats)})", file=stream, flush=True)
        return result

    result.notes = _notes(result.failure)
    original = (data.get("failure") or {}).get("type")
    print(f"reproduced ({result.how}): {_headline(result.failure)}", file=stream)
    for step in (n for n in result.notes if _STEP.match(n)):
        print(f"  {step}", file=stream)
    if original and original != type(result.failure).__name__:
        print(f"note: the reproducer recorded a {original}", file=stream)
    if out is not None:
        directory = _reserve_dir(out, options.backend, options.mode)
        info = {**saved, "replayed_from": str(file)}
        result.reproducer = _write_reproducer(
            directory, options, info, result.failure, last, stats, database_from=db_dir
        )
        print(f"reproducer written to {directory}", file=stream)
    print(f"summary  {stats_line(stats)}", file=stream, flush=True)
    return result


def _replay_runs(
    data: dict[str, Any],
    options: MachineOptions,
    saved: dict[str, Any],
    steps: int,
    max_examples: int,
    db_dir: Path,
    stats: CampaignStats,
    last: _LastEngine,
    stream: TextIO,
) -> ReplayResult:
    """Replay from the example database, then (if that did not reproduce) the blob."""
    import unittest

    import hypothesis
    from hypothesis import Phase
    from hypothesis.database import DirectoryBasedExampleDatabase, ReadOnlyDatabase
    from hypothesis.errors import DidNotReproduce

    result = ReplayResult(False)

    if db_dir.is_dir():
        database = ReadOnlyDatabase(DirectoryBasedExampleDatabase(db_dir))
        settings = _settings(steps, max_examples, database, [Phase.explicit, Phase.reuse])
        try:
            _run_machine(options, settings, stats, last)
        except Exception as exc:
            if any(isinstance(e, unittest.SkipTest) for e in _chain(exc)):
                print("example database: no saved example for this machine", file=stream)
            elif _refused_by_hypothesis(exc):
                print(f"example database: could not replay: {_headline(exc)}", file=stream)
            else:
                result = ReplayResult(True, "example database", exc)
        else:
            print("example database: the saved example passed", file=stream)
    else:
        print(f"example database: none at {db_dir}", file=stream)

    blob = (data.get("failure") or {}).get("blob")
    if not result.reproduced and blob:
        if blob.get("version") != hypothesis.__version__:
            print(
                f"@reproduce_failure blob: made by Hypothesis {blob.get('version')}, "
                f"this is {hypothesis.__version__}: not tried",
                file=stream,
            )
        else:
            print("@reproduce_failure blob: trying it", file=stream, flush=True)
            try:
                _run_machine(
                    options,
                    _settings(steps, max_examples, None),
                    stats,
                    last,
                    blob=(str(blob["version"]), str(blob["data"]).encode("ascii")),
                )
            except Exception as exc:
                if any(isinstance(e, DidNotReproduce) for e in _chain(exc)):
                    print("@reproduce_failure blob: the example passed", file=stream)
                elif _refused_by_hypothesis(exc):
                    print(
                        f"@reproduce_failure blob: could not replay: {_headline(exc)}", file=stream
                    )
                else:
                    result = ReplayResult(True, "reproduce_failure blob", exc)

    return result
