"""``ModelRunner`` on ``builtin:echo``: outputs by id, output types, early stop, failures."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from omni_trio._core.request import DiffusionRequest, SamplingParams
from omni_trio.config import EngineConfig
from omni_trio.errors import InvalidConfigError
from omni_trio.models.echo import EchoModel, decode_echo_image
from omni_trio.worker.cfg_parallel import CfgParallel, CollectiveError
from omni_trio.worker.runner import ModelRunner, StepProgress, convert_output
from omni_trio.worker.stop_flags import StopFlags
from tests.fakes import ScriptedModel, register_models

CPU = torch.device("cpu")


def request(rid: str, *, seed: int | None = 7, steps: int = 4, **sampling: Any) -> DiffusionRequest:
    sampling.setdefault("height", 32)
    sampling.setdefault("width", 32)
    return DiffusionRequest(
        "a prompt",
        SamplingParams(num_inference_steps=steps, seed=seed, **sampling),
        request_id=rid,
    )


def make_runner(
    cache_dir: Path, model: str = "builtin:echo", **config: Any
) -> tuple[ModelRunner, StopFlags, StepProgress]:
    flags = StopFlags()
    progress: StepProgress = {}
    cfg = EngineConfig(model=model, cache_dir=str(cache_dir), torch_threads=1, **config)
    runner = ModelRunner(cfg, CPU, torch.float32, flags, progress)
    runner.load_model()
    return runner, flags, progress


@pytest.fixture
def echo_runner(cache_dir: Path) -> Iterator[tuple[ModelRunner, StopFlags, StepProgress]]:
    runner, flags, progress = make_runner(cache_dir)
    yield runner, flags, progress
    runner.close()


class StepHooks:
    """An echo whose per-step sleep calls the test's hook with the step count so far."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps = 0
        self.hook: Callable[[int], None] = lambda steps: None
        register_models(
            monkeypatch,
            {"fake:hooked-echo": lambda options: EchoModel(step_delay_s=1.0, sleep=self._sleep)},
        )

    def _sleep(self, delay: float) -> None:
        self.steps += 1
        self.hook(self.steps)


@pytest.fixture
def hooked(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> Iterator[tuple[ModelRunner, StopFlags, StepProgress, StepHooks]]:
    hooks = StepHooks(monkeypatch)
    runner, flags, progress = make_runner(cache_dir, "fake:hooked-echo", max_num_seqs=4)
    yield runner, flags, progress, hooks
    runner.close()


def test_load_model_reports_model_info(echo_runner: Any) -> None:
    runner, _, _ = echo_runner
    assert runner.model_info.name == "builtin:echo"
    assert runner.model_info.supports_batch


def test_model_info_before_load_raises(cache_dir: Path) -> None:
    cfg = EngineConfig(cache_dir=str(cache_dir))
    runner = ModelRunner(cfg, CPU, torch.float32, StopFlags())
    with pytest.raises(RuntimeError, match="not loaded"):
        runner.model_info  # noqa: B018
    with pytest.raises(RuntimeError, match="not loaded"):
        runner.execute_model(request("a"))


def test_single_request_output_is_keyed_by_id_and_carries_its_seed(echo_runner: Any) -> None:
    runner, _, _ = echo_runner
    out = runner.execute_model(request("only", seed=1234))
    assert out.request_ids == ("only",)
    result = out.get("only")
    assert result is not None
    assert result.error is None and not result.aborted
    assert result.images is not None and len(result.images) == 1
    assert decode_echo_image(result.images[0]) == ("only", 1234, 0)
    assert result.timings["forward_ms"] >= 0.0
    assert result.timings["postprocess_ms"] >= 0.0


def test_fused_batch_outputs_are_keyed_by_id_not_position(echo_runner: Any) -> None:
    runner, _, _ = echo_runner
    reqs = [request("first", seed=1), request("second", seed=2), request("third", seed=3)]
    out = runner.execute_model_batch(reqs)
    assert set(out.request_ids) == {"first", "second", "third"}
    for rid, seed in (("first", 1), ("second", 2), ("third", 3)):
        result = out.get(rid)
        assert result is not None and result.images is not None
        assert decode_echo_image(result.images[0]) == (rid, seed, 0)


def test_several_outputs_per_prompt_come_in_order(echo_runner: Any) -> None:
    runner, _, _ = echo_runner
    out = runner.execute_model(request("multi", seed=5, num_outputs_per_prompt=3))
    result = out.get("multi")
    assert result is not None and result.images is not None
    assert [decode_echo_image(img) for img in result.images] == [
        ("multi", 5, 0),
        ("multi", 5, 1),
        ("multi", 5, 2),
    ]


def test_output_type_pil(echo_runner: Any) -> None:
    runner, _, _ = echo_runner
    result = runner.execute_model(request("pil", height=32, width=48, output_type="pil")).get("pil")
    assert result is not None and result.images is not None
    (image,) = result.images
    assert isinstance(image, Image.Image)
    assert image.size == (48, 32)
    assert image.mode == "RGB"
    assert decode_echo_image(image) == ("pil", 7, 0)


def test_output_type_np(echo_runner: Any) -> None:
    runner, _, _ = echo_runner
    result = runner.execute_model(request("np", height=32, width=48, output_type="np")).get("np")
    assert result is not None and result.images is not None
    (image,) = result.images
    assert isinstance(image, np.ndarray)
    assert image.dtype == np.float32
    assert image.shape == (32, 48, 3)
    assert decode_echo_image(image) == ("np", 7, 0)


def test_output_type_pt(echo_runner: Any) -> None:
    runner, _, _ = echo_runner
    result = runner.execute_model(request("pt", height=32, width=48, output_type="pt")).get("pt")
    assert result is not None and result.images is not None
    (image,) = result.images
    assert isinstance(image, torch.Tensor)
    assert image.shape == (3, 32, 48)
    assert image.dtype == torch.float32
    assert decode_echo_image(image) == ("pt", 7, 0)


def test_output_type_latent(echo_runner: Any) -> None:
    runner, _, _ = echo_runner
    result = runner.execute_model(request("lat", height=64, width=128, output_type="latent")).get(
        "lat"
    )
    assert result is not None and result.images is not None
    (latent,) = result.images
    assert isinstance(latent, torch.Tensor)
    assert latent.shape == (4, 8, 16)
    assert latent.device.type == "cpu"
    assert decode_echo_image(latent) == ("lat", 7, 0)


def test_same_seed_gives_identical_pixels_and_another_seed_differs(echo_runner: Any) -> None:
    runner, _, _ = echo_runner

    def pixels(rid: str, seed: int) -> np.ndarray:
        result = runner.execute_model(request(rid, seed=seed, output_type="np")).get(rid)
        assert result is not None and result.images is not None
        return np.asarray(result.images[0])

    a, b, c = pixels("x", 99), pixels("x", 99), pixels("x", 100)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_abort_before_start_runs_no_step(hooked: Any) -> None:
    runner, flags, progress, hooks = hooked
    flags.abort(["early"])
    out = runner.execute_model(request("early"))
    result = out.get("early")
    assert result is not None and result.aborted
    assert result.images is None and result.error is None
    assert hooks.steps == 0
    assert not progress


def test_abort_mid_forward_stops_at_the_next_step(hooked: Any) -> None:
    runner, flags, progress, hooks = hooked

    def abort_after_two(steps: int) -> None:
        if steps == 2:
            flags.abort(["mid"])

    hooks.hook = abort_after_two
    out = runner.execute_model(request("mid", steps=10))
    result = out.get("mid")
    assert result is not None and result.aborted and result.images is None
    # Steps 0 and 1 ran; the check before step 2 stopped the forward.
    assert hooks.steps == 2
    assert not progress


def test_stop_everything_stops_a_running_forward(hooked: Any) -> None:
    runner, flags, _, hooks = hooked

    def stop_after_one(steps: int) -> None:
        if steps == 1:
            flags.stop_everything()

    hooks.hook = stop_after_one
    result = runner.execute_model(request("any", steps=10)).get("any")
    assert result is not None and result.aborted
    assert hooks.steps == 1


def test_fused_batch_with_one_aborted_runs_on_and_drops_only_that_result(hooked: Any) -> None:
    runner, flags, _, hooks = hooked

    def abort_a(steps: int) -> None:
        if steps == 1:
            flags.abort(["a"])

    hooks.hook = abort_a
    out = runner.execute_model_batch([request("a", seed=1, steps=5), request("b", seed=2, steps=5)])
    assert hooks.steps == 5  # the live member kept the forward going
    a, b = out.get("a"), out.get("b")
    assert a is not None and a.aborted and a.images is None
    assert b is not None and not b.aborted and b.images is not None
    assert decode_echo_image(b.images[0]) == ("b", 2, 0)


def test_fused_batch_stops_when_every_member_is_aborted(hooked: Any) -> None:
    runner, flags, _, hooks = hooked

    def abort(steps: int) -> None:
        if steps == 1:
            flags.abort(["a"])
        if steps == 3:
            flags.abort(["b"])

    hooks.hook = abort
    out = runner.execute_model_batch([request("a", steps=8), request("b", steps=8)])
    assert hooks.steps == 3
    assert all(r.aborted for r in out)


def test_injected_step_failure_becomes_a_per_request_error(echo_runner: Any) -> None:
    runner, _, progress = echo_runner
    bad = request("bad", extra_args={"echo_fail_at_step": 1})
    result = runner.execute_model(bad).get("bad")
    assert result is not None
    assert result.error_type == "EchoInjectedError"
    assert result.error is not None and "step 1" in result.error
    assert result.images is None and not result.aborted
    assert not progress
    # The runner is still usable.
    ok = runner.execute_model(request("ok")).get("ok")
    assert ok is not None and ok.images is not None


def test_a_failing_member_fails_its_whole_fused_forward(echo_runner: Any) -> None:
    runner, _, _ = echo_runner
    out = runner.execute_model_batch(
        [request("good"), request("bad", extra_args={"echo_fail_at_step": 0})]
    )
    assert {r.request_id: r.error_type for r in out} == {
        "good": "EchoInjectedError",
        "bad": "EchoInjectedError",
    }


def test_request_without_a_seed_is_refused_per_request(echo_runner: Any) -> None:
    runner, _, _ = echo_runner
    out = runner.execute_model_batch([request("s1", seed=None), request("s2")])
    assert {r.request_id: r.error_type for r in out} == {"s1": "ValueError", "s2": "ValueError"}


def test_progress_is_updated_during_the_forward_and_cleared_after(hooked: Any) -> None:
    runner, _, progress, hooks = hooked
    seen: list[dict[str, tuple[int, int]]] = []
    hooks.hook = lambda steps: seen.append(dict(progress))
    runner.execute_model_batch([request("p", steps=3), request("q", steps=3)])
    assert seen == [
        {"p": (0, 3), "q": (0, 3)},
        {"p": (1, 3), "q": (1, 3)},
        {"p": (2, 3), "q": (2, 3)},
    ]
    assert progress == {}


def test_progress_is_cleared_after_a_failed_forward(hooked: Any) -> None:
    runner, _, progress, hooks = hooked
    seen: list[dict[str, tuple[int, int]]] = []
    hooks.hook = lambda steps: seen.append(dict(progress))
    result = runner.execute_model(request("f", steps=5, extra_args={"echo_fail_at_step": 2})).get(
        "f"
    )
    assert result is not None and result.error_type == "EchoInjectedError"
    assert seen == [{"f": (0, 5)}, {"f": (1, 5)}]
    assert progress == {}


def test_non_batching_model_with_max_num_seqs_above_one_is_rejected(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    loaded = register_models(
        monkeypatch, {"fake:single": lambda options: ScriptedModel(supports_batch=False)}
    )
    with pytest.raises(InvalidConfigError, match="max_num_seqs") as info:
        make_runner(cache_dir, "fake:single", max_num_seqs=2)
    assert info.value.field == "max_num_seqs"
    (model,) = loaded
    assert isinstance(model, ScriptedModel) and model.closed


def test_non_batching_model_with_max_num_seqs_one_loads(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    register_models(
        monkeypatch, {"fake:single": lambda options: ScriptedModel(supports_batch=False)}
    )
    runner, _, _ = make_runner(cache_dir, "fake:single", max_num_seqs=1)
    try:
        assert not runner.model_info.supports_batch
        result = runner.execute_model(request("one")).get("one")
        assert result is not None and result.images is not None
    finally:
        runner.close()


def test_model_returning_the_wrong_number_of_outputs_fails_every_request(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    register_models(monkeypatch, {"fake:short": lambda options: ScriptedModel(outputs_per_call=1)})
    runner, _, _ = make_runner(cache_dir, "fake:short", max_num_seqs=2)
    try:
        out = runner.execute_model_batch([request("a"), request("b")])
        assert {r.request_id for r in out} == {"a", "b"}
        assert all(r.error_type == "RuntimeError" for r in out)
    finally:
        runner.close()


def test_bad_model_options_are_a_config_error(cache_dir: Path) -> None:
    with pytest.raises(InvalidConfigError):
        make_runner(cache_dir, model_options={"no_such_option": 1})


def test_close_is_idempotent_and_releases_the_model(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    loaded = register_models(monkeypatch, {"fake:m": lambda options: ScriptedModel()})
    runner, _, _ = make_runner(cache_dir, "fake:m")
    runner.close()
    runner.close()
    (model,) = loaded
    assert isinstance(model, ScriptedModel) and model.closed
    with pytest.raises(RuntimeError, match="not loaded"):
        runner.execute_model(request("after"))


def test_convert_output_types() -> None:
    raw = np.full((8, 16, 3), 0.5, dtype=np.float32)
    pil = convert_output(raw, "pil")
    assert isinstance(pil, Image.Image) and pil.size == (16, 8)
    assert np.asarray(pil)[0, 0, 0] == 128
    assert convert_output(raw, "np").shape == (8, 16, 3)
    pt = convert_output(raw, "pt")
    assert isinstance(pt, torch.Tensor) and pt.shape == (3, 8, 16)
    gray = convert_output(np.zeros((4, 4, 1), dtype=np.float32), "pil")
    assert gray.mode == "L"
    latent = torch.ones(4, 2, 2, requires_grad=True)
    converted = convert_output(latent, "latent")
    assert not converted.requires_grad and converted.device.type == "cpu"


# ---------------------------------------------------------------------------------------
# CFG parallelism: collective stops.
# ---------------------------------------------------------------------------------------


class PeerGroup(CfgParallel):
    """Rank 0 of a CFG group whose peer is scripted: it wants to stop from the
    ``peer_stops_at``-th :meth:`agree_stop` on; the ``fail_at``-th fails as a lost peer."""

    def __init__(self, *, peer_stops_at: int | None = None, fail_at: int | None = None) -> None:
        super().__init__(0, 2, backend="gloo")
        self.asked: list[bool] = []
        self.peer_stops_at = peer_stops_at
        self.fail_at = fail_at

    def agree_stop(self, local: bool) -> bool:
        n = len(self.asked)
        self.asked.append(local)
        if n == self.fail_at:
            raise CollectiveError("the peer is gone")
        return local or (self.peer_stops_at is not None and n >= self.peer_stops_at)


class CfgEcho(EchoModel):
    def enable_cfg_parallel(self, cfg: CfgParallel) -> bool:
        return True


def cfg_runner(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path, group: CfgParallel | None
) -> ModelRunner:
    register_models(monkeypatch, {"fake:cfg-echo": lambda options: CfgEcho()})
    cfg = EngineConfig(model="fake:cfg-echo", cache_dir=str(cache_dir), torch_threads=1)
    runner = ModelRunner(cfg, CPU, torch.float32, StopFlags(), cfg=group, world_size=2)
    runner.load_model()
    return runner


def test_a_model_that_declines_cfg_parallel_keeps_per_rank_stops(cache_dir: Path) -> None:
    cfg = EngineConfig(cache_dir=str(cache_dir), torch_threads=1)
    group = PeerGroup(fail_at=0)  # any collective would fail
    runner = ModelRunner(cfg, CPU, torch.float32, StopFlags(), cfg=group, world_size=2)
    try:
        runner.load_model()  # builtin:echo declines
        assert runner.cfg is None
        assert runner.execute_model(request("a")).get("a").images is not None  # type: ignore[union-attr]
        assert group.asked == []
    finally:
        runner.close()


def test_the_peers_stop_stops_this_rank_at_the_same_step(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    # Asked once before the forward, then before each step: the 4th ask is before step 2.
    group = PeerGroup(peer_stops_at=3)
    runner = cfg_runner(monkeypatch, cache_dir, group)
    try:
        assert runner.cfg is group
        out = runner.execute_model(request("a", steps=6)).get("a")
        assert out is not None and out.aborted
        assert group.asked == [False] * 4  # this rank never wanted to stop
        assert runner.steps_done == 2
    finally:
        runner.close()


def test_this_ranks_stop_is_agreed_before_the_forward(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path
) -> None:
    group = PeerGroup()
    runner = cfg_runner(monkeypatch, cache_dir, group)
    try:
        runner.stop_flags.abort(["a"])
        out = runner.execute_model(request("a")).get("a")
        assert out is not None and out.aborted
        assert group.asked == [True] and runner.steps_done == 0
    finally:
        runner.close()


@pytest.mark.parametrize("fail_at", [0, 2])
def test_a_broken_group_is_raised_not_reported_as_the_requests_error(
    monkeypatch: pytest.MonkeyPatch, cache_dir: Path, fail_at: int
) -> None:
    runner = cfg_runner(monkeypatch, cache_dir, PeerGroup(fail_at=fail_at))
    try:
        with pytest.raises(CollectiveError, match="the peer is gone"):
            runner.execute_model(request("a"))
        assert runner.progress == {}
    finally:
        runner.close()


def _mark(runner: ModelRunner, progress: StepProgress, ids: list[str]) -> None:
    """What the worker does when an abort arrives: note the steps each forward started."""
    runner.abort_marks.mark(ids, {rid: step + 1 for rid, (step, _) in dict(progress).items()})


def test_a_forward_reports_the_steps_it_started_after_its_abort(hooked: Any) -> None:
    runner, flags, progress, hooks = hooked

    def abort_after_two(steps: int) -> None:
        if steps == 2:
            _mark(runner, progress, ["mid"])
            flags.abort(["mid"])

    hooks.hook = abort_after_two
    result = runner.execute_model(request("mid", steps=10)).get("mid")
    assert result is not None and result.aborted and result.steps_after_abort == 0
    # Stop flags that are never set: the forward runs on, and says by how much.
    hooks.hook = lambda steps: _mark(runner, progress, ["late"]) if steps == 2 else None
    hooks.steps = 0
    late = runner.execute_model(request("late", steps=10)).get("late")
    assert late is not None and late.images is not None and late.steps_after_abort == 8
    # A fused forward with a live member reports nothing; nor does an unaborted one.
    hooks.hook = lambda steps: _mark(runner, progress, ["a"]) if steps == 1 else None
    out = runner.execute_model_batch([request("a", steps=4), request("b", steps=4)])
    assert [r.steps_after_abort for r in out] == [None, None]


def test_an_abort_noted_as_the_forward_ends_is_not_counted_late(hooked: Any) -> None:
    # An abort that arrives while the forward is being wound up (its progress already
    # cleared) sees no step started; that must not read as "every step after the abort".
    runner, _, _, _ = hooked

    class AbortWhileClearing(dict[str, tuple[int, int]]):
        def pop(self, key: str, *default: Any) -> Any:
            value = super().pop(key, *default)
            _mark(runner, self, [key])  # the abort lands right after the progress went
            return value

    runner.progress = AbortWhileClearing()
    result = runner.execute_model(request("r", steps=5)).get("r")
    assert result is not None and result.images is not None
    assert result.steps_after_abort is None  # the forward was over before the abort came
