"""``StepRunner``: per-request step state, one fused denoising step per tick.

The runner is driven with hand-made :class:`SchedulerOutput` s (what the step scheduler would
send), on ``builtin:echo``'s adapter (outputs name request id and seed) wrapped in a recording
adapter, and on ``builtin:tiny-sd`` for real tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from omni_trio._core.messages import BatchRunnerOutput, NewRequestData, SchedulerOutput
from omni_trio._core.request import DiffusionRequest, SamplingParams
from omni_trio.config import EngineConfig
from omni_trio.models import DiffusionModel, StepAdapter, StepState, load_model
from omni_trio.models.echo import EchoModel, decode_echo_image
from omni_trio.worker.cfg_parallel import CollectiveError
from omni_trio.worker.runner import StepProgress, convert_output
from omni_trio.worker.step_runner import StepRunner
from omni_trio.worker.stop_flags import StopFlags

CPU = torch.device("cpu")
# Continuous batching vs alone on tiny-sd, "np" images: measured <= 2e-6 (see
# tests/models/test_pipeline_step.py); asserted with headroom.
SD_NP_ATOL = 1e-4


def request(
    rid: str, *, seed: int = 7, steps: int = 3, size: int = 32, **sampling: Any
) -> DiffusionRequest:
    sampling.setdefault("output_type", "np")
    return DiffusionRequest(
        "a prompt",
        SamplingParams(height=size, width=size, num_inference_steps=steps, seed=seed, **sampling),
        request_id=rid,
    )


class RecordingAdapter(StepAdapter):
    """Wraps a real adapter: records every call; ``fail_denoise(ids)`` makes a call raise."""

    def __init__(self, inner: StepAdapter) -> None:
        self.inner = inner
        self.calls: list[tuple[str, tuple[str, ...]]] = []
        self.released: list[str] = []
        self.fail_denoise: Callable[[tuple[str, ...]], bool] = lambda ids: False
        self.denoise_error: type[Exception] = RuntimeError

    def prepare_encode(self, request: DiffusionRequest, generator: torch.Generator) -> StepState:
        self.calls.append(("prepare", (request.request_id,)))
        return self.inner.prepare_encode(request, generator)

    def denoise_step(self, states: Sequence[StepState]) -> list[Any]:
        ids = tuple(s.request_id for s in states)
        self.calls.append(("denoise", ids))
        if self.fail_denoise(ids):
            raise self.denoise_error(f"denoise of {ids} failed on purpose")
        return self.inner.denoise_step(states)

    def step_scheduler(self, state: StepState, noise_pred: Any) -> None:
        self.calls.append(("step", (state.request_id,)))
        self.inner.step_scheduler(state, noise_pred)

    def post_decode(self, state: StepState, *, output_type: Any) -> list[Any]:
        self.calls.append(("decode", (state.request_id,)))
        return self.inner.post_decode(state, output_type=output_type)

    def release(self, state: StepState) -> None:
        self.released.append(state.request_id)
        self.inner.release(state)

    def of(self, kind: str) -> list[tuple[str, ...]]:
        return [ids for k, ids in self.calls if k == kind]


class Driver:
    """A StepRunner plus the scheduler's side of the conversation, written by hand."""

    def __init__(self, model: DiffusionModel, *, world_size: int = 1, **config: Any) -> None:
        inner = model.step_adapter()
        assert inner is not None
        self.adapter = RecordingAdapter(inner)
        self.flags = StopFlags()
        self.progress: StepProgress = {}
        cfg = EngineConfig(step_execution=True, **config)
        self.runner = StepRunner(
            cfg,
            self.adapter,
            CPU,
            self.flags,
            self.progress,
            convert_output,
            world_size=world_size,
        )
        self.step_id = 0

    @property
    def states(self) -> dict[str, StepState]:
        return self.runner.states

    def tick(
        self,
        new: Iterable[DiffusionRequest] = (),
        cached: Iterable[str] = (),
        finished: Iterable[str] = (),
    ) -> BatchRunnerOutput:
        self.step_id += 1
        out = SchedulerOutput(
            step_id=self.step_id,
            scheduled_new_reqs=tuple(NewRequestData(r.request_id, r) for r in new),
            scheduled_cached_reqs=tuple(cached),
            finished_req_ids=frozenset(finished),
        )
        result = self.runner.execute(out)
        # One output per scheduled request, never one for anything else.
        assert sorted(result.request_ids) == sorted(out.scheduled_request_ids)
        return result

    def run_to_end(self, *requests: DiffusionRequest) -> dict[str, BatchRunnerOutput]:
        """Tick ``requests`` together until each is finished; return each one's last tick."""
        last: dict[str, BatchRunnerOutput] = {}
        live = [r.request_id for r in requests]
        result = self.tick(new=requests)
        while True:
            for rid in list(live):
                out = result.get(rid)
                assert out is not None
                if out.finished or out.error is not None or out.aborted:
                    last[rid] = result
                    live.remove(rid)
            if not live:
                return last
            result = self.tick(cached=live)


@pytest.fixture
def echo() -> Iterator[EchoModel]:
    model = EchoModel()
    yield model
    model.close()


@pytest.fixture(scope="module")
def tiny_sd(cache_dir: Path) -> Iterator[DiffusionModel]:
    model = load_model(
        "builtin:tiny-sd", device=CPU, dtype=torch.float32, cache_dir=cache_dir, options={}
    )
    yield model
    model.close()


# ---------------------------------------------------------------------------------------
# State, ticks, completion.
# ---------------------------------------------------------------------------------------


def test_a_new_request_gets_state_and_its_first_step_in_the_same_tick(echo: EchoModel) -> None:
    d = Driver(echo)
    out = d.tick(new=[request("a", steps=3)]).get("a")
    assert out is not None
    assert (out.finished, out.step_index, out.images, out.error) == (False, 1, None, None)
    assert list(d.states) == ["a"]
    assert (d.states["a"].step_index, d.states["a"].total_steps) == (1, 3)
    assert d.adapter.of("prepare") == [("a",)]
    assert d.adapter.of("denoise") == [("a",)]


def test_each_tick_advances_every_live_request_by_one_step_in_one_fused_call(
    echo: EchoModel,
) -> None:
    d = Driver(echo)
    d.tick(new=[request("a", steps=5), request("b", steps=5)])
    out = d.tick(cached=["a", "b"])
    assert [(o.request_id, o.step_index, o.finished) for o in out] == [
        ("a", 2, False),
        ("b", 2, False),
    ]
    out = d.tick(new=[request("c", steps=5)], cached=["a", "b"])
    assert {o.request_id: o.step_index for o in out} == {"a": 3, "b": 3, "c": 1}
    # prepare_encode only once per request; ONE denoise call per tick, in scheduled order.
    assert d.adapter.of("prepare") == [("a",), ("b",), ("c",)]
    assert d.adapter.of("denoise") == [("a", "b"), ("a", "b"), ("c", "a", "b")]


def test_completion_returns_decoded_images_and_timings_and_drops_the_state(
    echo: EchoModel,
) -> None:
    d = Driver(echo)
    d.tick(new=[request("a", seed=11, steps=3)])
    d.tick(cached=["a"])
    out = d.tick(cached=["a"]).get("a")
    assert out is not None and out.finished and out.error is None
    assert out.step_index == 3
    assert out.images is not None and len(out.images) == 1
    assert isinstance(out.images[0], np.ndarray) and out.images[0].shape == (32, 32, 3)
    assert decode_echo_image(out.images[0]) == ("a", 11, 0)
    assert set(out.timings) == {"forward_ms", "postprocess_ms"}
    assert out.timings["forward_ms"] > 0 and out.timings["postprocess_ms"] >= 0
    assert d.states == {} and d.adapter.released == ["a"]
    assert "a" not in d.progress


def test_completed_outputs_equal_what_generate_gives(echo: EchoModel) -> None:
    d = Driver(echo)
    reqs = [request("a", seed=1, steps=2), request("b", seed=2, steps=4)]
    last = d.run_to_end(*reqs)
    for req in reqs:
        out = last[req.request_id].get(req.request_id)
        assert out is not None and out.images is not None
        gen = torch.Generator().manual_seed(int(req.sampling.seed or 0))
        (expected,) = echo.generate([req], [gen], output_type="np", on_step=lambda s, t: None)
        np.testing.assert_array_equal(out.images[0], expected[0])


@pytest.mark.parametrize("output_type", ["pil", "pt", "latent"])
def test_outputs_are_converted_to_the_requested_type(echo: EchoModel, output_type: str) -> None:
    d = Driver(echo)
    out = d.run_to_end(request("a", steps=1, output_type=output_type))["a"].get("a")
    assert out is not None and out.images is not None
    image = out.images[0]
    if output_type == "pil":
        assert isinstance(image, Image.Image) and image.size == (32, 32)
    elif output_type == "pt":
        assert isinstance(image, torch.Tensor) and image.shape == (3, 32, 32)
    else:
        assert isinstance(image, torch.Tensor) and image.shape == (4, 4, 4)
    assert decode_echo_image(image)[0] == "a"


# ---------------------------------------------------------------------------------------
# Eviction, bad scheduler outputs, aborts.
# ---------------------------------------------------------------------------------------


def test_finished_ids_are_evicted_and_released_before_the_tick_runs(echo: EchoModel) -> None:
    d = Driver(echo)
    d.tick(new=[request("a", steps=5), request("b", steps=5)])
    d.progress["a"] = (1, 5)
    d.flags.abort(["a"])
    out = d.tick(cached=["b"], finished=["a", "never-seen"])
    assert list(d.states) == ["b"]
    assert d.adapter.released == ["a"]
    assert "a" not in d.progress
    assert len(d.flags) == 0  # the finished id's stop flag is forgotten too
    assert d.adapter.of("denoise")[-1] == ("b",)
    assert out.request_ids == ("b",)


def test_an_evicted_id_may_come_back_as_a_new_request(echo: EchoModel) -> None:
    d = Driver(echo)
    d.tick(new=[request("a", steps=5, seed=1)])
    d.flags.abort(["a"])  # aborted, then re-admitted under the same id
    out = d.tick(new=[request("a", steps=2, seed=2)], finished=["a"])
    assert out.get("a") is not None and out.get("a").step_index == 1  # type: ignore[union-attr]
    assert d.states["a"].request.sampling.seed == 2
    done = d.tick(cached=["a"]).get("a")
    assert done is not None and done.images is not None
    assert decode_echo_image(done.images[0]) == ("a", 2, 0)


def test_a_duplicate_new_id_is_an_error_and_leaves_the_existing_state_alone(
    echo: EchoModel,
) -> None:
    d = Driver(echo)
    d.tick(new=[request("a", steps=5)])
    state = d.states["a"]
    out = d.tick(new=[request("a", steps=5)]).get("a")
    assert out is not None
    assert out.error_type == "ValueError" and "already has step state" in (out.error or "")
    assert d.states["a"] is state and state.step_index == 1
    assert d.adapter.of("prepare") == [("a",)]


def test_a_cached_id_without_state_is_an_error(echo: EchoModel) -> None:
    d = Driver(echo)
    d.tick(new=[request("a", steps=5)])
    out = d.tick(cached=["a", "ghost"])
    ghost = out.get("ghost")
    assert ghost is not None
    assert ghost.error_type == "LookupError" and "ghost" in (ghost.error or "")
    assert out.get("a") is not None and out.get("a").step_index == 2  # type: ignore[union-attr]
    assert d.adapter.of("denoise")[-1] == ("a",)


def test_a_failing_prepare_encode_fails_only_that_request(echo: EchoModel) -> None:
    d = Driver(echo)
    bad = request("bad", extra_args={"echo_fail_at_step": "soon"})  # malformed: ValueError
    out = d.tick(new=[request("a"), bad])
    assert out.get("bad").error_type == "ValueError"  # type: ignore[union-attr]
    assert out.get("a").step_index == 1  # type: ignore[union-attr]
    assert list(d.states) == ["a"]


def test_an_aborted_id_comes_back_aborted_and_its_state_is_dropped(echo: EchoModel) -> None:
    d = Driver(echo)
    d.tick(new=[request("a", steps=5), request("b", steps=5)])
    d.flags.abort(["a"])
    out = d.tick(cached=["a", "b"])
    a = out.get("a")
    assert a is not None and a.aborted and a.images is None
    assert out.get("b").step_index == 2  # type: ignore[union-attr]
    assert list(d.states) == ["b"]
    assert d.adapter.released == ["a"]
    assert "a" not in d.progress
    assert d.adapter.of("denoise")[-1] == ("b",)


def test_with_several_ranks_stop_flags_are_not_consulted(echo: EchoModel) -> None:
    """Ranks in lockstep see an abort at different moments, so none acts on its own flags: the
    engine never schedules an aborted request and reports it finished, which evicts it."""
    d = Driver(echo, world_size=2)
    d.tick(new=[request("a", steps=5)])
    d.flags.abort(["a"])
    d.flags.stop_everything()
    out = d.tick(cached=["a"]).get("a")
    assert out is not None and not out.aborted and out.step_index == 2
    d.tick(finished=["a"])
    assert d.states == {} and d.adapter.released == ["a"]


def test_a_broken_collective_fails_the_tick_not_the_requests(echo: EchoModel) -> None:
    """No state-by-state retry either: every retry would wait on the broken group again."""
    d = Driver(echo)
    d.tick(new=[request("a", steps=5), request("b", steps=5)])
    d.adapter.denoise_error = CollectiveError
    d.adapter.fail_denoise = lambda ids: True
    with pytest.raises(CollectiveError, match="on purpose"):
        d.runner.execute(SchedulerOutput(step_id=9, scheduled_cached_reqs=("a", "b")))
    assert d.adapter.of("denoise")[-1] == ("a", "b")  # the fused call only


def test_stop_everything_aborts_every_scheduled_request(echo: EchoModel) -> None:
    d = Driver(echo)
    d.tick(new=[request("a", steps=5), request("b", steps=5)])
    d.flags.stop_everything()
    out = d.tick(cached=["a", "b"])
    assert all(o.aborted for o in out)
    assert d.states == {}
    assert d.adapter.of("denoise") == [("a", "b")]  # no step ran after the stop


# ---------------------------------------------------------------------------------------
# Failure isolation.
# ---------------------------------------------------------------------------------------


def test_an_error_in_one_request_finishes_only_that_request(echo: EchoModel) -> None:
    d = Driver(echo)
    reqs = [
        request("a", seed=1, steps=3),
        request("b", seed=2, steps=3, extra_args={"echo_fail_at_step": 1}),
        request("c", seed=3, steps=3),
    ]
    d.tick(new=reqs)
    out = d.tick(cached=["a", "b", "c"])
    b = out.get("b")
    assert b is not None and b.error_type == "EchoInjectedError" and b.step_index == 1
    assert sorted(d.states) == ["a", "c"] and d.adapter.released == ["b"]
    assert "b" not in d.progress
    done = d.tick(cached=["a", "c"])
    for rid, seed in (("a", 1), ("c", 3)):
        out_rid = done.get(rid)
        assert out_rid is not None and out_rid.finished and out_rid.images is not None
        assert decode_echo_image(out_rid.images[0]) == (rid, seed, 0)


def test_a_failed_fused_denoise_falls_back_to_one_call_per_request(echo: EchoModel) -> None:
    d = Driver(echo)
    d.adapter.fail_denoise = lambda ids: "bad" in ids  # fails whenever "bad" takes part
    d.tick(new=[request("a", steps=2)])
    out = d.tick(new=[request("bad", steps=2), request("c", steps=2)], cached=["a"])
    bad = out.get("bad")
    assert bad is not None and bad.error_type == "RuntimeError"
    assert "failed on purpose" in (bad.error or "")
    a, c = out.get("a"), out.get("c")
    assert a is not None and a.finished and a.images is not None
    assert c is not None and (c.finished, c.step_index) == (False, 1)
    assert d.adapter.of("denoise") == [("a",), ("bad", "c", "a"), ("bad",), ("c",), ("a",)]
    assert sorted(d.states) == ["c"]
    assert "bad" in d.adapter.released


def test_a_fused_call_that_fails_only_when_fused_still_steps_everyone(echo: EchoModel) -> None:
    d = Driver(echo)
    d.adapter.fail_denoise = lambda ids: len(ids) > 1
    out = d.tick(new=[request("a"), request("b")])
    assert [(o.request_id, o.step_index, o.error) for o in out] == [
        ("a", 1, None),
        ("b", 1, None),
    ]


def test_a_failing_single_request_denoise_is_not_retried(echo: EchoModel) -> None:
    d = Driver(echo)
    d.adapter.fail_denoise = lambda ids: True
    out = d.tick(new=[request("a")]).get("a")
    assert out is not None and out.error_type == "RuntimeError"
    assert d.adapter.of("denoise") == [("a",)]
    assert d.states == {}


# ---------------------------------------------------------------------------------------
# Previews and progress.
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "interval", "preview_steps"),
    [(5, 1, [1, 2, 3, 4]), (5, 2, [2, 4]), (4, 2, [2]), (3, 3, []), (3, 5, [])],
)
def test_previews_come_every_preview_interval_steps_before_the_last(
    echo: EchoModel, steps: int, interval: int, preview_steps: list[int]
) -> None:
    d = Driver(echo, streaming_output=True, preview_interval=interval)
    seen: list[int] = []
    out = d.tick(new=[request("a", steps=steps, seed=4)]).get("a")
    while out is not None and not out.finished:
        if out.images is not None:
            assert decode_echo_image(out.images[0]) == ("a", 4, 0)
            assert out.step_index is not None
            seen.append(out.step_index)
        out = d.tick(cached=["a"]).get("a")
    assert seen == preview_steps
    assert out is not None and out.finished and out.images is not None


def test_no_previews_without_streaming(echo: EchoModel) -> None:
    d = Driver(echo, preview_interval=1)
    out = d.tick(new=[request("a", steps=3)]).get("a")
    assert out is not None and out.images is None
    assert d.adapter.of("decode") == []


def test_progress_is_updated_every_tick_and_cleared_at_the_end(echo: EchoModel) -> None:
    d = Driver(echo)
    d.tick(new=[request("a", steps=3), request("b", steps=9)])
    assert d.progress == {"a": (1, 3), "b": (1, 9)}
    d.tick(cached=["a", "b"])
    assert d.progress == {"a": (2, 3), "b": (2, 9)}
    d.tick(cached=["a", "b"])  # "a" completes
    assert d.progress == {"b": (3, 9)}
    d.tick(cached=["b"], finished=["a"])
    assert d.progress == {"b": (4, 9)}
    d.runner.close()
    assert d.progress == {}


def test_close_evicts_and_releases_every_state(echo: EchoModel) -> None:
    d = Driver(echo)
    d.tick(new=[request("a"), request("b"), request("c")])
    states = list(d.states.values())
    d.runner.close()
    assert d.states == {}
    assert sorted(d.adapter.released) == ["a", "b", "c"]
    assert all(state.extra == {} for state in states)  # echo's release clears its state
    d.runner.close()  # idempotent
    assert sorted(d.adapter.released) == ["a", "b", "c"]


# ---------------------------------------------------------------------------------------
# A real model: builtin:tiny-sd.
# ---------------------------------------------------------------------------------------


def sd_alone(model: DiffusionModel, req: DiffusionRequest) -> np.ndarray:
    """What request mode gives for ``req`` alone (generate is the reference)."""
    gen = torch.Generator().manual_seed(int(req.sampling.seed or 0))
    (images,) = model.generate([req], [gen], output_type="np", on_step=lambda s, t: None)
    return np.asarray(images[0])


@pytest.mark.slow
def test_tiny_sd_requests_with_different_step_counts_complete_in_one_batch(
    tiny_sd: DiffusionModel,
) -> None:
    d = Driver(tiny_sd)
    a = request("a", seed=1, steps=2)
    b = request("b", seed=2, steps=4, negative_prompt="blurry")
    last = d.run_to_end(a, b)
    assert d.adapter.of("denoise") == [("a", "b"), ("a", "b"), ("b",), ("b",)]
    for req in (a, b):
        out = last[req.request_id].get(req.request_id)
        assert out is not None and out.finished and out.images is not None
        image = out.images[0]
        assert image.shape == (32, 32, 3) and image.dtype == np.float32
        assert image.min() >= 0.0 and image.max() <= 1.0
        np.testing.assert_allclose(image, sd_alone(tiny_sd, req), atol=SD_NP_ATOL, rtol=0)
    assert d.states == {} and sorted(d.adapter.released) == ["a", "b"]


@pytest.mark.slow
def test_tiny_sd_alone_is_bit_identical_to_generate_and_previews_do_not_perturb_it(
    tiny_sd: DiffusionModel,
) -> None:
    req = request("a", seed=3, steps=4)
    plain = Driver(tiny_sd).run_to_end(req)["a"].get("a")
    streaming = Driver(tiny_sd, streaming_output=True, preview_interval=1)
    previews: list[np.ndarray] = []
    out = streaming.tick(new=[req]).get("a")
    while out is not None and not out.finished:
        assert out.images is not None
        previews.append(out.images[0])
        out = streaming.tick(cached=["a"]).get("a")
    assert plain is not None and plain.images is not None
    assert out is not None and out.images is not None
    np.testing.assert_array_equal(plain.images[0], sd_alone(tiny_sd, req))
    np.testing.assert_array_equal(out.images[0], plain.images[0])
    assert len(previews) == 3
    assert all(p.shape == (32, 32, 3) for p in previews)
    # A preview is the partly denoised image, not the final one.
    assert not np.array_equal(previews[0], out.images[0])
