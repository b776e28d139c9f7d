"""``WorkerProfiler`` with the real ``torch.profiler`` on a tiny forward: the trace it writes,
where, its refusals, and the thread rule the worker backends rely on (a session records,
and can be stopped by, only the thread that started it)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from omni_trio.worker.profiler import WorkerProfiler, check_prefix, profile_span, trace_name

CPU = torch.device("cpu")
T = TypeVar("T")


def forward() -> torch.Tensor:
    """A tiny model forward: one convolution inside the runner's span."""
    with profile_span("omni_trio.forward"):
        return torch.nn.functional.conv2d(torch.ones(1, 3, 8, 8), torch.ones(4, 3, 3, 3))


def event_names(path: str | Path) -> set[str]:
    with open(path, encoding="utf-8") as trace:
        return {event.get("name", "") for event in json.load(trace)["traceEvents"]}


def in_thread(fn: Callable[[], T]) -> T:
    """``fn()`` run in a new thread (joined); its result, or its exception raised here."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append(("ok", fn()))
        except BaseException as exc:
            box.append(("error", exc))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    kind, value = box[0]
    if kind == "error":
        raise value
    return value  # type: ignore[no-any-return]


@pytest.fixture
def profiler() -> Iterator[WorkerProfiler]:
    p = WorkerProfiler(rank=3)
    yield p
    p.close()  # never leave this thread recording


def test_a_trace_of_a_forward_names_its_ops_and_the_span(
    profiler: WorkerProfiler, tmp_path: Path
) -> None:
    planned = profiler.start(tmp_path / "a" / "b", "run", device=CPU)
    assert planned == str(tmp_path / "a" / "b" / "run-rank3.json")
    assert profiler.active and profiler.trace_path == planned
    forward()
    path = profiler.stop()
    assert path == planned and not profiler.active and profiler.trace_path is None
    names = event_names(path)
    assert {"aten::conv2d", "omni_trio.forward"} <= names


def test_refusals_starting_twice_and_stopping_when_idle(
    profiler: WorkerProfiler, tmp_path: Path
) -> None:
    with pytest.raises(RuntimeError, match="not profiling"):
        profiler.stop()
    assert profiler.discard() is False
    profiler.start(tmp_path, "p", device=CPU)
    with pytest.raises(RuntimeError, match="already profiling"):
        profiler.start(tmp_path, "q", device=CPU)
    assert profiler.discard() is True
    assert not profiler.active and list(tmp_path.iterdir()) == []  # discarded: nothing written
    with pytest.raises(RuntimeError, match="not profiling"):
        profiler.stop()


def test_bad_directories_and_prefixes_start_nothing(
    profiler: WorkerProfiler, tmp_path: Path
) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(FileExistsError):
        profiler.start(a_file, "p", device=CPU)
    with pytest.raises(NotADirectoryError):
        profiler.start(a_file / "below", "p", device=CPU)
    (tmp_path / trace_name("taken", 3)).write_text("{}")
    with pytest.raises(FileExistsError, match="another prefix"):
        profiler.start(tmp_path, "taken", device=CPU)
    for bad in ("", ".hidden", "a/b", "a\0b"):
        with pytest.raises(ValueError, match="prefix"):
            profiler.start(tmp_path, bad, device=CPU)
    with pytest.raises(TypeError):
        check_prefix(3)  # type: ignore[arg-type]
    assert not profiler.active and not torch.autograd._profiler_enabled()


def test_one_session_per_process(profiler: WorkerProfiler, tmp_path: Path) -> None:
    """Two at once crash torch's profiler: another worker of this process is refused."""
    other = WorkerProfiler(rank=7)
    profiler.start(tmp_path, "first", device=CPU)
    with pytest.raises(RuntimeError, match=r"rank 3\) is profiling.*one session per process"):
        other.start(tmp_path, "second", device=CPU)
    assert not other.active and not (tmp_path / "second-rank7.json").exists()
    profiler.stop()
    other.start(tmp_path, "second", device=CPU)
    assert Path(other.stop()).is_file()


def test_a_relative_directory_is_this_process_s(
    profiler: WorkerProfiler, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    path = profiler.start("traces", "rel", device=CPU)
    assert path == os.path.join(tmp_path, "traces", "rel-rank3.json")
    assert Path(profiler.stop()).is_file()


def test_only_the_starting_thread_is_recorded_and_may_stop(
    profiler: WorkerProfiler, tmp_path: Path
) -> None:
    """Why every backend runs a worker's forwards and its profile calls in one thread."""
    profiler.start(tmp_path, "threads", device=CPU)
    in_thread(forward)  # another thread: not recorded
    with pytest.raises(RuntimeError, match="another thread"):
        in_thread(profiler.stop)
    with pytest.raises(RuntimeError, match="another thread"):
        in_thread(profiler.discard)
    assert profiler.active
    names = event_names(profiler.stop())
    assert "aten::conv2d" not in names and "omni_trio.forward" not in names


def test_a_session_started_in_a_thread_records_that_thread(tmp_path: Path) -> None:
    """A worker thread starts, runs and stops its own session."""
    profiler = WorkerProfiler(rank=0)

    def session() -> str:
        profiler.start(tmp_path, "worker", device=CPU)
        forward()
        return profiler.stop()

    assert "aten::conv2d" in event_names(in_thread(session))
    assert not torch.autograd._profiler_enabled()  # this thread never recorded


def test_close_ends_a_running_session_without_writing(tmp_path: Path) -> None:
    profiler = WorkerProfiler(rank=0)
    profiler.close()  # idle: nothing to do
    profiler.start(tmp_path, "closed", device=CPU)
    forward()
    profiler.close()
    assert not profiler.active and list(tmp_path.iterdir()) == []
    assert not torch.autograd._profiler_enabled()


def test_the_span_is_free_when_nothing_records() -> None:
    assert not torch.autograd._profiler_enabled()
    assert forward().shape == (1, 4, 6, 6)
