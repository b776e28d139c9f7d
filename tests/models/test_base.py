from __future__ import annotations

import pytest

from omni_trio.models.base import BatchParams, ModelInfo

from .support import generators, request

INFO = ModelInfo(
    name="m",
    family="text2image",
    supports_batch=True,
    default_height=64,
    default_width=48,
    text_conditioned=True,
)


def test_defaults_are_resolved_from_the_model() -> None:
    params = BatchParams.from_requests([request()], generators(0), INFO, "np")
    assert (params.height, params.width) == (64, 48)
    assert params.steps == params.num_inference_steps == 3
    assert params.num_outputs == 1


def test_explicit_schedule_sets_the_step_count() -> None:
    req = request(timesteps=(999.0, 500.0))
    params = BatchParams.from_requests([req], generators(0), INFO, "latent")
    assert params.steps == 2
    assert params.timesteps == (999.0, 500.0)


def test_mismatched_requests_are_rejected_naming_both_ids_and_the_field() -> None:
    a, b = request("a", height=64), request("b", height=128)
    with pytest.raises(ValueError, match=r"'a' and 'b'.*height"):
        BatchParams.from_requests([a, b], generators(0, 1), INFO, "np")


def test_a_default_size_equals_the_same_explicit_size() -> None:
    a, b = request("a"), request("b", height=64, width=48)
    BatchParams.from_requests([a, b], generators(0, 1), INFO, "np")


def test_negative_prompts_may_be_mixed() -> None:
    a, b = request("a", negative_prompt="blurry"), request("b")
    BatchParams.from_requests([a, b], generators(0, 1), INFO, "np")


@pytest.mark.parametrize("steps", [4, 5])
def test_steps_must_match(steps: int) -> None:
    a, b = request("a", num_inference_steps=3), request("b", num_inference_steps=steps)
    with pytest.raises(ValueError, match="num_inference_steps"):
        BatchParams.from_requests([a, b], generators(0, 1), INFO, "np")


def test_one_generator_per_request() -> None:
    with pytest.raises(ValueError, match="generators"):
        BatchParams.from_requests([request("a"), request("b")], generators(0), INFO, "np")


def test_empty_batch_and_unknown_output_type_are_rejected() -> None:
    with pytest.raises(ValueError, match="at least one"):
        BatchParams.from_requests([], [], INFO, "np")
    with pytest.raises(ValueError, match="output_type"):
        BatchParams.from_requests([request()], generators(0), INFO, "pil")


def test_a_model_without_batching_takes_one_request() -> None:
    single = ModelInfo("m", "text2image", False, 64, 64, True)
    BatchParams.from_requests([request()], generators(0), single, "np")
    with pytest.raises(ValueError, match="cannot run 2 requests"):
        BatchParams.from_requests([request("a"), request("b")], generators(0, 1), single, "np")
