"""``EngineConfig`` validation: every bad field raises ``InvalidConfigError`` naming it."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import pytest

from omni_trio._core.request import RequestLimits
from omni_trio.config import (
    BACKENDS,
    EngineConfig,
    check_device_available,
    default_cache_dir,
    default_torch_threads,
)
from omni_trio.errors import InvalidConfigError


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


class _CustomExecutor:
    """Stands in for an Executor subclass (config only checks that it is a class)."""


def test_defaults_are_valid() -> None:
    cfg = EngineConfig()
    assert cfg.model == "builtin:echo"
    assert cfg.backend == "inproc"
    assert cfg.max_num_seqs == 1
    assert cfg.request_batch_max_wait_ms == 0.0
    assert cfg.step_execution is False
    assert cfg.streaming_output is False
    assert cfg.cfg_parallel is True
    assert cfg.rpc_timeout_s is None


def test_the_backend_is_chosen_by_worker_count_unless_set() -> None:
    assert EngineConfig(num_workers=1).backend == "inproc"
    assert EngineConfig(num_workers=2).backend == "tractor"
    assert EngineConfig(backend="auto", num_workers=3, cfg_parallel=False).backend == "tractor"
    assert EngineConfig(backend="ray", num_workers=2).backend == "ray"
    assert EngineConfig(backend="tractor").backend == "tractor"
    # The resolved choice is what the config says from then on.
    chosen = EngineConfig(num_workers=2)
    assert EngineConfig.from_dict({"backend": chosen.backend, "num_workers": 2}) == chosen


def test_replace_chooses_a_counted_backend_again() -> None:
    # open_engine(num_workers=2) is EngineConfig().replace(num_workers=2): it must not keep
    # the inproc backend that one worker chose (that config would be refused).
    auto = EngineConfig()
    assert auto.backend_by_count
    assert auto.replace(num_workers=2).backend == "tractor"
    assert auto.replace(num_workers=2).replace(num_workers=1).backend == "inproc"
    assert auto.replace(max_num_seqs=2).backend == "inproc"
    # A backend that was named stays named.
    named = EngineConfig(backend="tractor")
    assert not named.backend_by_count
    assert named.replace(num_workers=1).backend == "tractor"
    with pytest.raises(InvalidConfigError) as info:
        EngineConfig(backend="inproc").replace(num_workers=2)
    assert info.value.field == "num_workers"
    assert EngineConfig(num_workers=2).replace(backend="ray").backend == "ray"


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        (
            {"backend": "inproc", "num_workers": 2},
            "num_workers",
            "the inproc backend runs exactly one worker, not num_workers=2",
        ),
        (
            {"num_workers": 3},
            "cfg_parallel",
            "cfg_parallel splits each guidance step between exactly 2 workers, so it cannot "
            "use num_workers=3; use num_workers=2, or cfg_parallel=False",
        ),
        ({"backend": "ray", "num_workers": 4}, "cfg_parallel", "num_workers=4"),
    ],
)
def test_cross_field_rules_are_checked_when_the_config_is_made(
    fields: dict[str, Any], field: str, message: str
) -> None:
    # These used to fail only when the engine opened, after seconds of starting workers.
    with pytest.raises(InvalidConfigError, match=message) as info:
        EngineConfig(**fields)
    assert info.value.field == field
    assert "\n" not in str(info.value)
    with pytest.raises(InvalidConfigError) as replaced:
        EngineConfig(cfg_parallel=fields.get("cfg_parallel", True)).replace(**fields)
    assert replaced.value.field == field


def test_cross_field_rules_accept_what_the_workers_can_run() -> None:
    assert EngineConfig(num_workers=3, cfg_parallel=False).num_workers == 3
    assert EngineConfig(num_workers=2, cfg_parallel=True).backend == "tractor"
    assert EngineConfig(backend="tractor", num_workers=1, cfg_parallel=True).num_workers == 1
    # A custom executor is given the config as it is.
    assert EngineConfig(backend=_CustomExecutor, num_workers=2).num_workers == 2


def test_data_parallel_ranks_may_be_cfg_parallel_pairs() -> None:
    """``num_workers = 2 x data_parallel_size`` with ``cfg_parallel``: a CFG pair per rank;
    the same count without ``cfg_parallel``, or any other count, is refused."""
    pairs = EngineConfig(data_parallel_size=2, num_workers=4, cfg_parallel=True)
    assert (pairs.num_workers, pairs.backend) == (4, "tractor")
    assert pairs.core_config().max_num_seqs == 2  # capacity: per rank (pair), not per worker
    for workers, cfg in ((4, False), (3, True), (6, True)):
        with pytest.raises(InvalidConfigError, match="or 4 with cfg_parallel") as info:
            EngineConfig(data_parallel_size=2, num_workers=workers, cfg_parallel=cfg)
        assert info.value.field == "num_workers"


def test_data_parallel_implies_its_workers_and_a_process_backend() -> None:
    config = EngineConfig(data_parallel_size=3, max_num_seqs=2)
    assert (config.num_workers, config.backend) == (3, "tractor")
    # One scheduler for every rank: its capacity is every rank's max_num_seqs.
    assert config.core_config().max_num_seqs == 6
    assert EngineConfig(max_num_seqs=2).core_config().max_num_seqs == 2
    # The ranks are not CFG pairs: cfg_parallel (on by default) does not apply to them.
    assert EngineConfig(data_parallel_size=4, cfg_parallel=True).num_workers == 4
    assert EngineConfig(backend="ray", data_parallel_size=2, num_workers=2).backend == "ray"
    # replace: an implied worker count follows the size; a named one is kept (and checked).
    assert config.replace(data_parallel_size=2).num_workers == 2
    back = config.replace(data_parallel_size=1)
    assert (back.num_workers, back.backend) == (1, "inproc")
    assert EngineConfig().replace(data_parallel_size=2).backend == "tractor"
    # ...through unrelated replaces and a dict round trip too (the fields alone say it).
    assert config.replace(max_num_seqs=1).replace(data_parallel_size=4).num_workers == 4
    fields = {f: getattr(config, f) for f in ("data_parallel_size", "num_workers", "backend")}
    round_trip = EngineConfig.from_dict(fields).replace(data_parallel_size=1)
    assert (round_trip.num_workers, round_trip.backend) == (1, "tractor")  # a named backend
    with pytest.raises(InvalidConfigError) as info:
        EngineConfig(num_workers=2, cfg_parallel=False).replace(data_parallel_size=3)
    assert info.value.field == "num_workers"
    # A worker process runs one in-process worker of the group: no data parallelism of its own.
    from omni_trio.executors.group import wire_config

    wired = EngineConfig.from_dict(wire_config(config))
    assert (wired.num_workers, wired.data_parallel_size, wired.backend) == (1, 1, "inproc")


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"data_parallel_size": 2, "backend": "inproc"}, "data_parallel_size", "inproc backend"),
        (
            {"data_parallel_size": 2, "num_workers": 4, "cfg_parallel": False},
            "num_workers",
            "num_workers must be 2",
        ),
        ({"data_parallel_size": 2, "num_workers": 3}, "num_workers", "not 3"),
        ({"data_parallel_size": 0}, "data_parallel_size", "positive integer"),
        ({"data_parallel_size": True}, "data_parallel_size", "positive integer"),
    ],
)
def test_bad_data_parallel_configs_are_refused_naming_the_field(
    fields: dict[str, Any], field: str, message: str
) -> None:
    with pytest.raises(InvalidConfigError, match=message) as info:
        EngineConfig(**fields)
    assert info.value.field == field and "\n" not in str(info.value)


@pytest.mark.parametrize("device", ["tpu", "gpu", "cuda:", "cuda:x", "CUDA", "cuda:0:1", "", 0])
def test_an_unknown_device_is_refused_naming_the_types(device: Any) -> None:
    with pytest.raises(InvalidConfigError) as info:
        EngineConfig(device=device)
    assert info.value.field == "device"
    assert "expected one of cpu, cuda, mps, xpu" in str(info.value)


@pytest.mark.parametrize("device", ["cpu", "cpu:0"])
def test_cpu_is_always_available(device: str) -> None:
    assert EngineConfig(device=device).device == device


@pytest.mark.skipif(_cuda_available(), reason="this machine has a GPU")
@pytest.mark.parametrize("backend", ["inproc", "tractor"])
def test_cuda_on_a_cpu_only_torch_is_refused_when_the_config_is_made(backend: str) -> None:
    with pytest.raises(InvalidConfigError) as info:
        EngineConfig(device="cuda", backend=backend)
    assert info.value.field == "device"
    message = str(info.value)
    assert message.startswith("device 'cuda' is not available: ")
    assert "\n" not in message
    with pytest.raises(InvalidConfigError):
        check_device_available("cuda:1")
    with pytest.raises(InvalidConfigError, match="'mps' is not available"):
        EngineConfig(device="mps")


def test_a_device_is_left_to_remote_workers_on_ray() -> None:
    # Ray workers may run on other machines: only the name is checked here.
    assert EngineConfig(device="cuda:3", backend="ray").device == "cuda:3"
    with pytest.raises(InvalidConfigError):
        EngineConfig(device="tpu", backend="ray")


@pytest.mark.skipif(not _cuda_available(), reason="needs a GPU")
def test_cuda_is_accepted_where_torch_sees_a_gpu() -> None:
    import torch

    count = torch.cuda.device_count()
    assert EngineConfig(device="cuda").device == "cuda"
    assert EngineConfig(device=f"cuda:{count - 1}").device == f"cuda:{count - 1}"
    with pytest.raises(InvalidConfigError, match=f"torch sees {count} CUDA device"):
        EngineConfig(device=f"cuda:{count}")


def test_is_frozen_and_keyword_only() -> None:
    cfg = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        EngineConfig("builtin:echo")  # type: ignore[misc]


BAD_FIELDS: list[tuple[str, Any]] = [
    ("model", ""),
    ("model", None),
    ("model", 3),
    ("model_options", ["step_delay_s", 1]),
    ("model_options", None),
    ("backend", "nope"),
    ("ray_address", ""),
    ("ray_address", "  "),
    ("ray_address", 6379),
    ("ray_placement_timeout_s", -1),
    ("ray_placement_timeout_s", float("nan")),
    ("ray_placement_timeout_s", None),
    ("backend", ""),
    ("backend", 3),
    ("backend", None),
    ("backend", _CustomExecutor()),
    ("dtype", "float64"),
    ("dtype", "fp16"),
    ("dtype", None),
    ("step_execution", 1),
    ("step_execution", "yes"),
    ("streaming_output", 1),
    ("streaming_output", None),
    ("warmup", "true"),
    ("warmup", 0),
    ("cfg_parallel", "no"),
    ("cfg_parallel", 1),
    ("torch_threads", 0),
    ("torch_threads", -2),
    ("torch_threads", 1.5),
    ("torch_threads", True),
    ("request_batch_max_wait_ms", -1),
    ("request_batch_max_wait_ms", -0.001),
    ("request_batch_max_wait_ms", math.nan),
    ("request_batch_max_wait_ms", math.inf),
    ("request_batch_max_wait_ms", "5"),
    ("request_batch_max_wait_ms", None),
    ("request_batch_max_wait_ms", True),
    ("rpc_timeout_s", -1.0),
    ("rpc_timeout_s", math.nan),
    ("rpc_timeout_s", math.inf),
    ("rpc_timeout_s", "10"),
    ("close_timeout_s", -1),
    ("close_timeout_s", math.inf),
    ("close_timeout_s", None),
    ("close_timeout_s", False),
]

POSITIVE_INT_FIELDS = [
    "num_workers",
    "max_num_seqs",
    "preview_interval",
    "max_pixels",
    "max_prompt_chars",
    "max_steps",
    "max_outputs_per_prompt",
]
for _name in POSITIVE_INT_FIELDS:
    BAD_FIELDS += [
        (_name, 0),
        (_name, -1),
        (_name, 2.0),
        (_name, "3"),
        (_name, True),
        (_name, None),
    ]


@pytest.mark.parametrize(("field", "value"), BAD_FIELDS, ids=[f"{f}={v!r}" for f, v in BAD_FIELDS])
def test_bad_field_raises_naming_it(field: str, value: Any) -> None:
    with pytest.raises(InvalidConfigError) as info:
        EngineConfig(**{field: value})
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


GOOD_FIELDS: list[tuple[str, Any]] = [
    ("model", "/models/sd-turbo"),
    ("model", "builtin:tiny-sd"),
    ("model_options", {"step_delay_s": 0.01}),
    ("backend", "tractor"),
    ("backend", "ray"),
    ("backend", "my_pkg.executors:MyExecutor"),
    ("backend", _CustomExecutor),
    ("dtype", "float32"),
    ("dtype", "float16"),
    ("dtype", "bfloat16"),
    ("torch_threads", None),
    ("torch_threads", 4),
    ("request_batch_max_wait_ms", 0),
    ("request_batch_max_wait_ms", 12.5),
    ("rpc_timeout_s", 0.0),
    ("rpc_timeout_s", 5),
    ("close_timeout_s", 0),
    ("max_num_seqs", 8),
    ("warmup", False),
    ("cfg_parallel", False),
]


@pytest.mark.parametrize(
    ("field", "value"), GOOD_FIELDS, ids=[f"{f}={v!r}" for f, v in GOOD_FIELDS]
)
def test_good_field_is_accepted(field: str, value: Any) -> None:
    cfg = EngineConfig(**{field: value})
    assert getattr(cfg, field) == value


def test_known_backends() -> None:
    assert BACKENDS == ("inproc", "tractor", "ray")
    for name in BACKENDS:
        assert EngineConfig(backend=name).backend == name


def test_unknown_backend_message_lists_choices() -> None:
    with pytest.raises(InvalidConfigError, match="inproc, tractor, ray"):
        EngineConfig(backend="cuda")


def test_streaming_output_turns_step_execution_on() -> None:
    cfg = EngineConfig(streaming_output=True)
    assert cfg.streaming_output is True
    assert cfg.step_execution is True


def test_step_execution_alone_does_not_stream() -> None:
    cfg = EngineConfig(step_execution=True)
    assert cfg.step_execution is True
    assert cfg.streaming_output is False


def test_streaming_output_via_replace_turns_step_execution_on() -> None:
    cfg = EngineConfig().replace(streaming_output=True)
    assert cfg.step_execution is True


def test_from_dict_builds_a_config() -> None:
    cfg = EngineConfig.from_dict({"max_num_seqs": 4, "request_batch_max_wait_ms": 20})
    assert cfg == EngineConfig(max_num_seqs=4, request_batch_max_wait_ms=20)


def test_from_dict_rejects_unknown_fields_naming_the_first_sorted() -> None:
    with pytest.raises(InvalidConfigError) as info:
        EngineConfig.from_dict({"max_num_seqs": 2, "zeta": 1, "alpha": 2})
    assert info.value.field == "alpha"
    assert "alpha, zeta" in str(info.value)


def test_from_dict_validates_values() -> None:
    with pytest.raises(InvalidConfigError) as info:
        EngineConfig.from_dict({"max_num_seqs": 0})
    assert info.value.field == "max_num_seqs"


def test_replace_returns_a_new_validated_config() -> None:
    cfg = EngineConfig()
    other = cfg.replace(max_num_seqs=3)
    assert other.max_num_seqs == 3
    assert cfg.max_num_seqs == 1
    with pytest.raises(InvalidConfigError) as info:
        cfg.replace(num_workers=0)
    assert info.value.field == "num_workers"


def test_replace_rejects_unknown_fields() -> None:
    with pytest.raises(InvalidConfigError) as info:
        EngineConfig().replace(max_batch_size=4)
    assert info.value.field == "max_batch_size"
    assert "max_batch_size" in str(info.value)


def test_request_limits_come_from_the_config() -> None:
    cfg = EngineConfig(max_pixels=4096, max_prompt_chars=7, max_steps=9, max_outputs_per_prompt=2)
    assert cfg.request_limits == RequestLimits(
        max_pixels=4096, max_prompt_chars=7, max_steps=9, max_outputs=2
    )


def test_cache_dir_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OMNI_TRIO_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    assert EngineConfig().resolved_cache_dir == tmp_path / "c"


def test_cache_dir_from_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("OMNI_TRIO_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "omni_trio"


def test_explicit_cache_dir_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("OMNI_TRIO_CACHE", str(tmp_path / "env"))
    cfg = EngineConfig(cache_dir=str(tmp_path / "explicit"))
    assert cfg.resolved_cache_dir == tmp_path / "explicit"


def test_torch_threads_divides_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    # One core is kept for the engine's own process: 7 left for the workers.
    assert default_torch_threads(1) == 7
    assert default_torch_threads(3) == 2
    assert default_torch_threads(16) == 1
    assert default_torch_threads(0) == 7
    assert EngineConfig(num_workers=4, cfg_parallel=False).resolved_torch_threads == 1
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert default_torch_threads(1) == 1
    assert (
        EngineConfig(num_workers=4, torch_threads=3, cfg_parallel=False).resolved_torch_threads == 3
    )


def test_from_dict_with_a_non_string_key_names_it() -> None:
    with pytest.raises(InvalidConfigError) as info:
        EngineConfig.from_dict({1: "x", "model": "builtin:echo"})
    assert info.value.field == "1"


# -- extension points (omni_trio.extensions, docs/extending.md) ------------------------------


def test_extension_fields_default_to_the_builtins() -> None:
    config = EngineConfig()
    assert (config.scheduler_cls, config.runner_cls, config.worker_extension_cls) == (
        None,
        None,
        None,
    )
    assert config.core_config().scheduler_cls is None


def test_a_scheduler_class_or_path_reaches_the_core_config() -> None:
    from omni_trio.extensions import StepScheduler
    from tests.extension_examples import RecordingScheduler

    for value in (RecordingScheduler, "tests.extension_examples:RecordingScheduler"):
        config = EngineConfig(scheduler_cls=value)
        assert config.scheduler_cls == value  # kept as given (a dict round trip keeps it)
        assert config.core_config().scheduler_cls is RecordingScheduler
    step = type("StepOnly", (StepScheduler,), {})
    assert EngineConfig(step_execution=True, scheduler_cls=step).core_config().scheduler_cls is (
        step
    )
    # streaming_output implies step mode before the scheduler is checked
    assert EngineConfig(streaming_output=True, scheduler_cls=step).step_execution


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"scheduler_cls": "tests.extension_examples:NoSuch"}, "has no 'NoSuch'"),
        ({"scheduler_cls": "no_such_pkg_xyz.mod:S"}, "cannot import module 'no_such_pkg_xyz.mod'"),
        ({"scheduler_cls": "not a path"}, "must be an import path"),
        ({"scheduler_cls": 3}, "must be a subclass of omni_trio._core.scheduler.Scheduler"),
        ({"scheduler_cls": dict}, "must be a subclass of omni_trio._core.scheduler.Scheduler"),
        (
            {"scheduler_cls": "tests.extension_examples:CountingRunner"},
            "must be a subclass of omni_trio._core.scheduler.Scheduler",
        ),
        (
            {
                "scheduler_cls": "tests.extension_examples:RecordingScheduler",
                "step_execution": True,
            },
            "must subclass omni_trio.extensions.StepScheduler in step mode (step_execution=True)"
            ", which the engine core builds and drives; it is a RequestScheduler",
        ),
    ],
)
def test_a_bad_scheduler_is_refused_when_the_config_is_made(
    fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidConfigError) as failed:
        EngineConfig(**fields)
    assert failed.value.field == "scheduler_cls"
    assert message in str(failed.value) and "\n" not in str(failed.value)


def test_a_scheduler_of_the_shared_base_only_is_refused_in_either_mode() -> None:
    from omni_trio.extensions import Scheduler, StepScheduler

    base_only = type("BaseOnly", (Scheduler,), {})
    for step in (False, True):
        with pytest.raises(InvalidConfigError, match="subclasses only the shared base"):
            EngineConfig(step_execution=step, scheduler_cls=base_only)
    step_only = type("StepOnly", (StepScheduler,), {})
    with pytest.raises(InvalidConfigError, match=r"in request mode, .* it is a StepScheduler"):
        EngineConfig(scheduler_cls=step_only)


@pytest.mark.parametrize("name", ["runner_cls", "worker_extension_cls"])
@pytest.mark.parametrize("value", [3, "not a path", "pkg.mod", object()])
def test_worker_side_fields_must_be_a_class_or_a_path(name: str, value: object) -> None:
    with pytest.raises(InvalidConfigError) as failed:
        EngineConfig(**{name: value})
    assert failed.value.field == name
    assert "must be a class, an import path 'package.module:Name' or None" in str(failed.value)


@pytest.mark.parametrize("name", ["runner_cls", "worker_extension_cls"])
def test_worker_side_paths_are_not_imported_when_the_config_is_made(name: str) -> None:
    """A worker resolves them (a Ray worker may be another machine, with other modules)."""
    assert getattr(EngineConfig(**{name: "no_such_pkg_xyz.mod:Name"}), name) == (
        "no_such_pkg_xyz.mod:Name"
    )


def _local_class() -> type:
    class Local:
        pass

    return Local


@pytest.mark.parametrize("name", ["runner_cls", "worker_extension_cls"])
def test_process_backends_refuse_classes_other_processes_cannot_import(name: str) -> None:
    local = _local_class()
    main = type("FromScript", (), {"__module__": "__main__"})
    assert getattr(EngineConfig(**{name: local}), name) is local  # inproc: used as it is
    for backend, extra in (("tractor", {}), ("ray", {}), ("auto", {"num_workers": 2})):
        for value, why in ((local, "inside a function"), (main, "defined in __main__")):
            with pytest.raises(InvalidConfigError, match=why) as failed:
                EngineConfig(backend=backend, cfg_parallel=False, **extra, **{name: value})
            assert failed.value.field == name


def test_a_scheduler_class_need_not_travel() -> None:
    """The scheduler runs in the engine's process: any class will do, on any backend."""
    from omni_trio.extensions import RequestScheduler

    local = type("Local", (RequestScheduler,), {"__qualname__": "f.<locals>.Local"})
    assert EngineConfig(backend="tractor", scheduler_cls=local).scheduler_cls is local


def test_extension_classes_travel_to_workers_as_import_paths() -> None:
    from omni_trio.executors.group import wire_config
    from tests.extension_examples import CountingRunner, RecordingScheduler

    config = EngineConfig(
        backend="tractor",
        runner_cls=CountingRunner,
        worker_extension_cls="tests.extension_examples:InspectExtension",
        scheduler_cls=RecordingScheduler,
    )
    wired = wire_config(config)
    assert wired["runner_cls"] == "tests.extension_examples:CountingRunner"
    assert wired["worker_extension_cls"] == "tests.extension_examples:InspectExtension"
    assert wired["scheduler_cls"] is None  # workers have no scheduler
    worker_config = EngineConfig.from_dict(wired)
    assert worker_config.runner_cls == "tests.extension_examples:CountingRunner"


def test_loras_map_names_to_paths_and_max_loras_is_positive() -> None:
    config = EngineConfig(loras={"outline": "builtin:shapes-outline", "my.style-2": "/x"})
    assert config.core_config().lora_names == frozenset({"outline", "my.style-2"})
    assert config.core_config().max_loras == 4
    assert EngineConfig.from_dict(dataclasses.asdict(config)).loras == config.loras
    for bad in ({"": "/x"}, {"a b": "/x"}, {"a": ""}, {"a": 3}, ["a"]):
        with pytest.raises(InvalidConfigError) as info:
            EngineConfig(loras=bad)  # type: ignore[arg-type]
        assert info.value.field == "loras"
    for bad_max in (0, -1, True, 1.5):
        with pytest.raises(InvalidConfigError) as info:
            EngineConfig(max_loras=bad_max)  # type: ignore[arg-type]
        assert info.value.field == "max_loras"
