"""Every example in README.md and docs/*.md runs as written, or says why it cannot run here.

An *example* is a fenced block in ``python``, ``console``, ``sh``, ``shell`` or ``bash``
(``text`` blocks show output and are not examples).  :data:`EXAMPLES` says, for each one, how
the suite covers it: :class:`Run` (a test of this module executes it), :class:`Covered` (the
named test elsewhere executes exactly this block) or :class:`NotRun` (why it cannot run here:
a GPU, a Ray cluster, a 20-minute training run...).  ``tests/test_docs.py`` checks that this
table and the docs agree both ways, so a new example that nobody runs fails the suite.

How they run: the Python examples of :data:`RUN_PYTHON` one after the other in one fresh
interpreter (each in its own directory, as ``__main__``: one torch import for all), the
console examples of :data:`RUN_CONSOLE` as bash scripts (their ``$`` lines, in a temporary
directory, with this interpreter's ``bin`` first on ``PATH``).  The only change made to an
example is its TCP port, replaced by a free one.  Background jobs an example starts are
waited for, and killed if it fails.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts processes (see tests/spawn_guard.py)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))
EXAMPLE_LANGS = frozenset({"python", "console", "sh", "shell", "bash"})
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.DOTALL | re.MULTILINE)
_TIMEOUT_S = 240.0


@dataclass(frozen=True)
class Example:
    doc: str  # the path relative to the repository root
    line: int  # of the opening fence
    lang: str
    body: str

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def examples(doc: str) -> list[Example]:
    """The example blocks of ``doc``, in order."""
    text = (ROOT / doc).read_text("utf-8")
    return [
        Example(doc, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2))
        for m in _FENCE.finditer(text)
        if m.group(1) in EXAMPLE_LANGS
    ]


def all_examples() -> list[Example]:
    return [example for doc in DOCS for example in examples(doc)]


@dataclass(frozen=True)
class Run:
    """Executed by this module (``test`` names the test that does)."""

    test: str


@dataclass(frozen=True)
class Covered:
    """Executed, exactly as written, by another test (``path::name``)."""

    test: str


@dataclass(frozen=True)
class NotRun:
    """Not executed; ``reason`` says why (and what covers it instead)."""

    reason: str


Coverage = Run | Covered | NotRun

_PY = Run("test_docs_python_examples_run")
_CLI = Run("test_readme_command_line_example_runs")
_SERVE = Run("test_readme_serve_example_runs")
_MAKE = "`make -n` of every target a docs command names: test_the_make_targets_exist"

# (doc, a text that occurs in exactly one of its examples) -> how that example is covered.
EXAMPLES: dict[tuple[str, str], Coverage] = {
    # README.md
    ("README.md", "make demo\nmake test"): NotRun(
        "installs into .venv and runs the whole suite, this test included; "
        "`make demo`'s command is run by the command-line example; " + _MAKE
    ),
    ("README.md", "async def main"): Covered(
        "tests/test_readme.py::test_readme_python_examples_run"
    ),
    ("README.md", "with Engine(config) as engine"): Covered(
        "tests/test_readme.py::test_readme_python_examples_run"
    ),
    ("README.md", "omni-trio generate"): _CLI,
    ("README.md", "omni-trio serve"): _SERVE,
    ("README.md", "make test-fast"): NotRun(
        "runs the test suite itself (make test-fast, make test); " + _MAKE
    ),
    # docs/backends.md
    ("docs/backends.md", 'open_engine(config, stage="process")'): _PY,
    ("docs/backends.md", "class PipeTransport"): Covered(
        "tests/executors/test_custom_transport.py::test_a_custom_transport_serves_and_is_supervised"
    ),
    # docs/benchmarks.md
    ("docs/benchmarks.md", "--mode request --duration 1800 --seed 12"): NotRun(
        "four 30-minute fuzzing campaigns (two hours of machine time)"
    ),
    ("docs/benchmarks.md", "omni-trio bench overhead"): NotRun(
        "the list of experiments; each runs for minutes (tests/bench/test_experiments.py runs "
        "every one with --quick)"
    ),
    ("docs/benchmarks.md", "omni-trio bench quality --img2img --no-progress"): NotRun(
        "a full measurement (about 4 minutes); tests/bench/test_quality.py runs it small"
    ),
    ("docs/benchmarks.md", "--model /tmp/shapes-ft-k2"): NotRun(
        "four full measurements (about 15 minutes) of a fine-tune's output directory, which "
        "only the 5-minute training run makes; tests/bench/test_quality.py runs the bench small"
    ),
    ("docs/benchmarks.md", "omni-trio bench quality --lora"): NotRun(
        "a full measurement (about 3 minutes); tests/bench/test_quality.py runs "
        "`bench quality --lora --quick`"
    ),
    ("docs/benchmarks.md", "omni-trio bench executors"): NotRun(
        "a full measurement (minutes, a local Ray); tests/bench/test_executors.py runs the "
        "experiment small"
    ),
    ("docs/benchmarks.md", "omni-trio bench serve --parts jobs"): NotRun(
        "two measurements of one to two minutes; tests/bench/test_experiments.py runs "
        "`bench serve --quick` with every part"
    ),
    # docs/execution-modes.md
    ("docs/execution-modes.md", "streaming_output=True"): Covered(
        "tests/test_execution_modes_doc.py::test_execution_modes_examples_run"
    ),
    ("docs/execution-modes.md", "class ToyAdapter"): Covered(
        "tests/test_execution_modes_doc.py::test_execution_modes_examples_run"
    ),
    # docs/extending.md (each block is a verbatim part of tests/extension_examples.py)
    ("docs/extending.md", "class RecordingScheduler"): Covered(
        "tests/test_extensions.py::test_the_scheduler_example_runs"
    ),
    ("docs/extending.md", "class CountingRunner"): Covered(
        "tests/test_extensions.py::test_the_runner_and_extension_example_runs"
    ),
    ("docs/extending.md", "class InspectExtension"): Covered(
        "tests/test_extensions.py::test_the_runner_and_extension_example_runs"
    ),
    ("docs/extending.md", "def echo_factory"): Covered(
        "tests/test_extensions.py::test_the_factory_example_runs"
    ),
    ("docs/benchmarks.md", "omni-trio bench sleep"): NotRun(
        "a minute of a worker process sleeping and waking; tests/bench/test_sleep.py runs "
        "`bench sleep --quick`"
    ),
    # docs/fuzzing.md
    ("docs/fuzzing.md", "with_faults"): Covered("tests/test_fuzz.py::test_the_worked_example_runs"),
    ("docs/fuzzing.md", "omni-trio fuzz --duration 600"): NotRun(
        "campaigns of 10 to 60 minutes; tests/test_fuzz.py runs short ones of each kind"
    ),
    ("docs/benchmarks.md", "omni-trio bench fuzz-power --json fuzz-power.json"): NotRun(
        "half an hour (a campaign per mutant); tests/bench/test_fuzz_power.py runs a short one"
    ),
    ("docs/benchmarks.md", "omni-trio bench fuzz-power --no-progress --json"): NotRun(
        "half an hour (a campaign per mutant); tests/bench/test_fuzz_power.py runs a short one"
    ),
    ("docs/benchmarks.md", "omni-trio bench fuzz-power --mutant heartbeat"): NotRun(
        "minutes (a campaign per mutant); tests/bench/test_fuzz_power.py runs a short one"
    ),
    ("docs/fuzzing.md", "omni-trio fuzz --mutant fused-survivors-by-position"): NotRun(
        "a minute per campaign; tests/bench/test_fuzz_power.py scores a shipped and a "
        "researcher's mutant with a short budget, and --list"
    ),
    ("docs/fuzzing.md", "omni-trio fuzz --replay"): NotRun(
        "replays the reproducer a failing campaign wrote; "
        "tests/test_fuzz.py::test_a_planted_bug_is_found_written_and_replayed does that"
    ),
    # docs/invariants.md
    ("docs/invariants.md", "assert_trace_ok(recorder"): _PY,
    # docs/multi-node.md
    ("docs/multi-node.md", "pip install 'omni-trio[ray]'"): NotRun(
        "installs from a package index into /opt"
    ),
    ("docs/multi-node.md", "ray start --head"): NotRun("starts a Ray head on 10.0.0.1, a GPU node"),
    ("docs/multi-node.md", "ray start --address"): NotRun("joins a Ray cluster from a GPU node"),
    ("docs/multi-node.md", 'ray_address="10.0.0.1:6379"'): NotRun(
        "needs that Ray cluster, two GPUs and /models/my-sd; tests/executors/test_ray_executor.py "
        "runs the ray backend on a local Ray"
    ),
    # docs/operations.md
    ("docs/operations.md", "--config /etc/omni-trio/serve.toml"): NotRun(
        "daemons that run until stopped, on the reader's files (/etc/omni-trio/serve.toml, "
        "/models/sd15); the README's serve example runs the daemon and waits for /ready"
    ),
    ("docs/operations.md", "-F image=@red-circle.png"): NotRun(
        "needs a running daemon and the reader's pictures; tests/serve/test_edits.py sends the "
        "same multipart request (httpx and the openai SDK) to a real server"
    ),
    ("docs/operations.md", "stream=True, partial_images=2"): NotRun(
        "needs a running daemon in step mode; tests/serve/test_app.py::"
        "test_the_sdk_parses_every_stream_event_with_its_own_types makes the same SDK call"
    ),
    ("docs/operations.md", "localhost:8000/v1/jobs"): NotRun(
        "needs a running daemon, and job ids differ per run; tests/serve/test_jobs.py makes "
        "each of these calls to a real server"
    ),
    ("docs/operations.md", "hmac.compare_digest(expected"): NotRun(
        "a receiver's fragment (secret, raw_body and request are the reader's); "
        "tests/serve/test_webhooks.py checks every delivery's signature the same way"
    ),
    ("docs/operations.md", "--lora outline=builtin:shapes-outline --lora mine"): NotRun(
        "a daemon on the reader's /models/my-lora; tests/serve/test_lora.py serves adapters "
        "and sends the same requests (httpx and the openai SDK)"
    ),
    ("docs/operations.md", "localhost:8000/v1/admin/sleep"): NotRun(
        "needs a running daemon; tests/serve/test_sleeping.py makes each of these calls to a "
        "real server"
    ),
    ("docs/operations.md", "localhost:8000/v1/admin/start_profile"): NotRun(
        "needs a running daemon with an API key, and the trace names differ per run; "
        "tests/serve/test_profiling.py makes these calls to a real server and reads the traces"
    ),
    ("docs/operations.md", "until curl -sf"): NotRun(
        "the README's serve example: the same start, wait for /ready and SIGTERM, run there"
    ),
    # docs/supervision.md
    ("docs/supervision.md", "health = engine.health()"): _PY,
    # docs/user-guide.md
    ("docs/user-guide.md", "scripts/train_shapes.py"): NotRun(
        "trains builtin:shapes for about 27 minutes (a base, then a fine-tune that overwrites "
        "the shipped weights) and its outline adapter for 10 more; "
        "tests/scripts/test_train_shapes.py and tests/scripts/test_train_shapes_lora.py train "
        "short runs, tests/bench/test_quality.py runs `bench quality --quick` (and --lora)"
    ),
    ("docs/user-guide.md", 'out.images[0].save("fox.png")'): _PY,
    ("docs/user-guide.md", 'await engine.start_profile("profiles")'): _PY,
    ("docs/user-guide.md", 'with Engine(model="builtin:tiny-sd")'): _PY,
    ("docs/user-guide.md", 'engine.stream("a cat", params)'): _PY,
    ("docs/user-guide.md", "mask.paste(255, (0, 0, source.width // 2"): _PY,
    ("docs/user-guide.md", "reports = await engine.sleep(1)"): _PY,
    ("docs/user-guide.md", 'loras = {"outline": "builtin:shapes-outline"}'): _PY,
    ("docs/user-guide.md", "--image red-circle.png"): NotRun(
        "needs the reader's red-circle.png; tests/test_cli.py::"
        "test_generate_from_a_picture_and_a_mask runs the same flags on a picture it writes"
    ),
    ("docs/user-guide.md", 'omni-trio generate "a prompt" ['): NotRun(
        "a synopsis (brackets mark optional flags); tests/test_docs.py checks that each flag "
        "it names exists"
    ),
}


def find(doc: str, needle: str) -> list[Example]:
    return [e for e in examples(doc) if needle in e.body]


def example(key: tuple[str, str]) -> Example:
    (found,) = find(*key)
    return found


RUN_PYTHON = [key for key, how in EXAMPLES.items() if how == _PY]


# -- running ----------------------------------------------------------------------------------

_PY_RUNNER = textwrap.dedent(
    """
    import os, runpy, sys, traceback
    failed = []
    for directory in sys.argv[1:]:
        os.chdir(directory)
        print(f"== {directory}", flush=True)
        try:
            runpy.run_path(os.path.join(directory, "example.py"), run_name="__main__")
        except BaseException:
            traceback.print_exc()
            failed.append(directory)
    print("failed:", failed, flush=True)
    sys.exit(1 if failed else 0)
    """
)


def _env(cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMNI_TRIO_CACHE=str(cache_dir),
        OMP_WAIT_POLICY="PASSIVE",
        OMP_NUM_THREADS="1",
        TRANSFORMERS_VERBOSITY="error",
        PYTHONUNBUFFERED="1",
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
    )
    return env


def console_script(body: str) -> str:
    """The ``$`` commands of a console block (with their ``\\`` continuation lines), as a
    bash script; the other lines are the output the docs show."""
    commands: list[str] = []
    continued = False
    for line in body.splitlines():
        if continued:
            commands.append(line)
        elif line.startswith("$ "):
            commands.append(line[2:])
        else:
            continue
        continued = line.endswith("\\")
    return "\n".join(commands) + "\n"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Launched:
    """One run started in the background: a process group, read to its end by
    :meth:`result` (bounded; killed on timeout)."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.cwd = cwd
        self.proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self._output: str | None = None

    def result(self) -> tuple[int, str]:
        if self._output is None:
            try:
                self._output, _ = self.proc.communicate(timeout=_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                out, _ = self.proc.communicate()
                self._output = f"timed out after {_TIMEOUT_S} s\n{out}"
        return self.proc.returncode, self._output

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.result()


def bash(script: str, cwd: Path, env: dict[str, str]) -> Launched:
    """Run ``script`` under ``bash -eu``; its background jobs are waited for, and killed if a
    command fails."""
    full = (
        "set -eu\n"
        "trap 'status=$?; if [ $status -ne 0 ]; then kill $(jobs -p) 2>/dev/null || true; fi; "
        "wait; exit $status' EXIT\n" + script
    )
    return Launched(["bash", "-c", full], cwd, env)


@dataclass
class Runs:
    python: Launched
    cli: Launched
    serve: Launched
    port: int


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, cache_dir: Path) -> Iterator[Runs]:
    """The examples of this module, all started at once (they mostly wait on one another's
    CPU: together they take about as long as the longest)."""
    env = _env(cache_dir)
    root = tmp_path_factory.mktemp("docs-examples")
    directories = []
    for index, key in enumerate(RUN_PYTHON):
        directory = root / f"python-{index}"
        directory.mkdir()
        (directory / "example.py").write_text(example(key).body, "utf-8")
        directories.append(str(directory))
    cli_dir, serve_dir = root / "cli", root / "serve"
    cli_dir.mkdir()
    serve_dir.mkdir()
    port = _free_port()
    serve_body = example(("README.md", "omni-trio serve")).body
    assert "8000" in serve_body
    launched = Runs(
        python=Launched([sys.executable, "-c", _PY_RUNNER, *directories], root, env),
        cli=bash(console_script(example(("README.md", "omni-trio generate")).body), cli_dir, env),
        serve=bash(console_script(serve_body.replace("8000", str(port))), serve_dir, env),
        port=port,
    )
    try:
        yield launched
    finally:
        for run in (launched.python, launched.cli, launched.serve):
            run.kill()


def test_console_script_keeps_commands_and_drops_output() -> None:
    body = "$ a \\\n    --b\nsome output\n$ c &\nmore\n"
    assert console_script(body) == "a \\\n    --b\nc &\n"


def test_docs_python_examples_run(runs: Runs) -> None:
    code, output = runs.python.result()
    assert code == 0, f"{[example(k).where for k in RUN_PYTHON]}\n{output}"
    assert "failed: []" in output
    fox = RUN_PYTHON.index(("docs/user-guide.md", 'out.images[0].save("fox.png")'))
    assert (runs.python.cwd / f"python-{fox}" / "fox.png").is_file()  # the async example's


def test_readme_command_line_example_runs(runs: Runs) -> None:
    code, output = runs.cli.result()
    assert code == 0, output
    written = {p.name for p in runs.cli.cwd.iterdir()}
    assert {"out.png", "demo-grid.png", "demo-grid-previews.png"} <= written, output
    assert "wrote out.png" in output
    assert re.search(r"^omni-trio \d", output, re.MULTILINE), output  # version


def test_readme_serve_example_runs(runs: Runs) -> None:
    code, output = runs.serve.result()
    assert code == 0, output
    # The listening line; the generation (its first 120 bytes) came once /ready said 200.
    assert f"listening on http://127.0.0.1:{runs.port}" in output
    assert f"ready: serving 1 replica(s) on http://127.0.0.1:{runs.port}" in output
    assert '{"created":' in output.replace(" ", ""), output
    assert "stopped" in output  # kill %1: SIGTERM, drained, exit 0 (waited for)


def test_the_make_targets_exist() -> None:
    """Every ``make TARGET`` a docs command names is a Makefile target (``make -n``)."""
    targets = sorted(
        {
            target
            for e in all_examples()
            for line in e.body.splitlines()
            for target in re.findall(r"^(?:\$ )?make ([\w-]+)", line.strip())
        }
    )
    assert {"demo", "test", "test-fast", "bench"} <= set(targets)
    for target in targets:
        proc = subprocess.run(
            ["make", "-n", target], cwd=ROOT, capture_output=True, text=True, timeout=30
        )
        assert proc.returncode == 0, f"make {target}: {proc.stderr}"


def _make_n(target: str, venv: Path) -> str:
    proc = subprocess.run(
        ["make", "-n", target, f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_make_demo_installs_the_runtime_only_and_make_test_adds_the_extras(
    tmp_path: Path,
) -> None:
    """The README's install story: one venv, `make demo` = `pip install -e .`, `make test` =
    that plus the dev and ray extras; each marker made after its install."""
    demo = _make_n("demo", tmp_path / "venv")
    assert "pip install" in demo and "-e ." in demo and "[dev" not in demo
    assert demo.index("-e .") < demo.index(".installed-runtime-") < demo.index("omni-trio demo")
    for target in ("test", "test-fast", "lint", "typecheck"):
        out = _make_n(target, tmp_path / "venv")
        assert "-e '.[dev,ray]'" in out, target
        assert out.index(".installed-runtime-") < out.index("[dev,ray]")
        assert out.index("[dev,ray]") < out.index(".installed-dev-"), target
    assert "HYPOTHESIS_PROFILE=fast" in _make_n("test-fast", tmp_path / "venv")
    assert '-m "not slow"' in _make_n("test-fast", tmp_path / "venv")
