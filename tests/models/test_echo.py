from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from omni_trio.errors import InvalidConfigError
from omni_trio.models.echo import EchoInjectedError, EchoModel, decode_echo_image

from .support import StepRecorder, Stop, generators, no_steps, request


def test_image_round_trip_through_float_uint8_pil_and_tensor() -> None:
    (image,) = EchoModel().generate(
        [request("req-1")], generators(42), output_type="np", on_step=no_steps
    )[0]
    assert image.dtype == np.float32 and image.shape == (64, 64, 3)
    assert image.min() >= 0.0 and image.max() <= 1.0
    expected = ("req-1", 42, 0)
    assert decode_echo_image(image) == expected
    rounded = (image * 255).round().astype(np.uint8)
    floored = (image * 255).astype(np.uint8)
    assert decode_echo_image(rounded) == expected
    assert decode_echo_image(floored) == expected
    assert decode_echo_image(Image.fromarray(rounded)) == expected
    assert decode_echo_image(torch.from_numpy(image).permute(2, 0, 1)) == expected
    assert decode_echo_image(torch.from_numpy(floored).permute(2, 0, 1).float() / 255) == expected


def test_unicode_ids_round_trip() -> None:
    rid = "café|☃|日本"
    (image,) = EchoModel().generate(
        [request(rid)], generators(7), output_type="np", on_step=no_steps
    )[0]
    assert decode_echo_image(image) == (rid, 7, 0)


def test_latent_is_small_and_decodable() -> None:
    (latent,) = EchoModel().generate(
        [request("lat", height=64, width=128)],
        generators(3),
        output_type="latent",
        on_step=no_steps,
    )[0]
    assert isinstance(latent, torch.Tensor)
    assert latent.shape == (4, 8, 16)
    assert decode_echo_image(latent) == ("lat", 3, 0)


def test_size_is_honoured() -> None:
    (image,) = EchoModel().generate(
        [request(height=32, width=96)], generators(0), output_type="np", on_step=no_steps
    )[0]
    assert image.shape == (32, 96, 3)


def test_batch_keeps_identity_and_each_seed() -> None:
    reqs = [request("a", num_outputs_per_prompt=2), request("b", num_outputs_per_prompt=2)]
    outputs = EchoModel().generate(reqs, generators(10, 20), output_type="np", on_step=no_steps)
    decoded = [[decode_echo_image(image) for image in outs] for outs in outputs]
    assert decoded == [[("a", 10, 0), ("a", 10, 1)], [("b", 20, 0), ("b", 20, 1)]]
    assert not np.array_equal(outputs[0][0], outputs[0][1])


def test_same_seed_is_bit_identical_and_other_seeds_differ() -> None:
    model = EchoModel()
    first = model.generate([request()], generators(5), output_type="np", on_step=no_steps)
    again = model.generate([request()], generators(5), output_type="np", on_step=no_steps)
    other = model.generate([request()], generators(6), output_type="np", on_step=no_steps)
    assert np.array_equal(first[0][0], again[0][0])
    assert not np.array_equal(first[0][0][1:], other[0][0][1:])


def test_on_step_precedes_every_step_and_can_stop_the_forward() -> None:
    model = EchoModel()
    steps = StepRecorder()
    model.generate([request(num_inference_steps=4)], generators(0), output_type="np", on_step=steps)
    assert steps.calls == [(0, 4), (1, 4), (2, 4), (3, 4)]
    stopping = StepRecorder(stop_at=1)
    with pytest.raises(Stop):
        model.generate(
            [request(num_inference_steps=4)], generators(0), output_type="np", on_step=stopping
        )
    assert stopping.calls == [(0, 4), (1, 4)]


def test_fails_at_the_requested_step() -> None:
    steps = StepRecorder()
    reqs = [
        request("ok"),
        request("bad", num_inference_steps=3, extra_args={"echo_fail_at_step": 2}),
    ]
    with pytest.raises(EchoInjectedError) as info:
        EchoModel().generate(reqs, generators(0, 1), output_type="np", on_step=steps)
    assert isinstance(info.value, RuntimeError)
    assert (info.value.request_id, info.value.step) == ("bad", 2)
    assert [step for step, _ in steps.calls] == [0, 1, 2]


def test_a_failure_step_past_the_end_never_fires() -> None:
    req = request(num_inference_steps=3, extra_args={"echo_fail_at_step": 3})
    EchoModel().generate([req], generators(0), output_type="np", on_step=no_steps)


def test_step_delay_from_options_and_per_request_override() -> None:
    slept: list[float] = []
    model = EchoModel(step_delay_s=0.01, sleep=slept.append)
    model.generate(
        [request(num_inference_steps=2)], generators(0), output_type="np", on_step=no_steps
    )
    assert slept == [0.01, 0.01]
    slept.clear()
    reqs = [request("a"), request("b", extra_args={"echo_step_delay_s": 0.5})]
    model.generate(reqs, generators(0, 1), output_type="np", on_step=no_steps)
    assert slept == [0.5, 0.5, 0.5]


def test_from_options_validates() -> None:
    assert EchoModel.from_options({"step_delay_s": 0.25}).step_delay_s == 0.25
    with pytest.raises(InvalidConfigError, match="colour"):
        EchoModel.from_options({"colour": 1})
    with pytest.raises(InvalidConfigError, match="step_delay_s"):
        EchoModel.from_options({"step_delay_s": -1})


def test_info() -> None:
    info = EchoModel().info
    assert (info.family, info.supports_batch, info.default_height, info.default_width) == (
        "echo",
        True,
        64,
        64,
    )


def test_a_header_that_does_not_fit_is_an_error() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        EchoModel().generate(
            [request("x" * 200, height=8, width=8)],
            generators(0),
            output_type="np",
            on_step=no_steps,
        )


def test_non_echo_images_are_rejected() -> None:
    with pytest.raises(ValueError, match="not an echo output"):
        decode_echo_image(np.zeros((8, 8, 3), dtype=np.float32))


def test_closed_model_refuses_work() -> None:
    model = EchoModel()
    model.close()
    model.close()
    with pytest.raises(RuntimeError, match="closed"):
        model.generate([request()], generators(0), output_type="np", on_step=no_steps)


def step_to_end(adapter: Any, states: list[Any]) -> None:
    while states:
        for state, pred in zip(states, adapter.denoise_step(states), strict=True):
            adapter.step_scheduler(state, pred)
        states = [state for state in states if not state.denoise_completed]


def test_step_mode_outputs_decode_to_their_request() -> None:
    adapter = EchoModel().step_adapter()
    states = [
        adapter.prepare_encode(request("a", num_inference_steps=2), generators(7)[0]),
        adapter.prepare_encode(
            request("b", num_inference_steps=4, num_outputs_per_prompt=1), generators(8)[0]
        ),
    ]
    step_to_end(adapter, states)
    assert [s.step_index for s in states] == [2, 4]
    for state, expected in zip(states, [("a", 7, 0), ("b", 8, 0)], strict=True):
        (image,) = adapter.post_decode(state, output_type="np")
        assert decode_echo_image(image) == expected
        (latent,) = adapter.post_decode(state, output_type="latent")
        assert decode_echo_image(latent) == expected


def test_step_mode_previews_are_the_final_images_and_spend_no_randomness() -> None:
    model = EchoModel()
    adapter = model.step_adapter()
    req = request("p", num_inference_steps=3, num_outputs_per_prompt=2)
    (expected,) = model.generate([req], generators(5), output_type="np", on_step=no_steps)
    generator = generators(5)[0]
    untouched = generator.get_state()
    state = adapter.prepare_encode(req, generator)
    preview = adapter.post_decode(state, output_type="np")
    step_to_end(adapter, [state])
    final = adapter.post_decode(state, output_type="np")
    for a, b, c in zip(preview, final, expected, strict=True):
        assert np.array_equal(a, b) and np.array_equal(b, c)
    assert [decode_echo_image(image) for image in final] == [("p", 5, 0), ("p", 5, 1)]
    assert torch.equal(generator.get_state(), untouched)


def test_step_mode_failure_hits_only_its_request() -> None:
    adapter = EchoModel().step_adapter()
    ok = adapter.prepare_encode(request("ok", num_inference_steps=4), generators(0)[0])
    bad = adapter.prepare_encode(
        request("bad", num_inference_steps=4, extra_args={"echo_fail_at_step": 2}),
        generators(1)[0],
    )
    for _ in range(2):
        for state, pred in zip([ok, bad], adapter.denoise_step([ok, bad]), strict=True):
            adapter.step_scheduler(state, pred)
    preds = adapter.denoise_step([ok, bad])  # the fused call itself does not fail
    adapter.step_scheduler(ok, preds[0])
    with pytest.raises(EchoInjectedError) as info:
        adapter.step_scheduler(bad, preds[1])
    assert (info.value.request_id, info.value.step) == ("bad", 2)
    assert bad.step_index == 2  # the failed step did not happen
    step_to_end(adapter, [ok])
    (image,) = adapter.post_decode(ok, output_type="np")
    assert decode_echo_image(image) == ("ok", 0, 0)


def test_step_mode_failure_past_the_end_never_fires() -> None:
    adapter = EchoModel().step_adapter()
    req = request(num_inference_steps=2, extra_args={"echo_fail_at_step": 2})
    state = adapter.prepare_encode(req, generators(0)[0])
    step_to_end(adapter, [state])
    assert state.denoise_completed


def test_step_mode_sleeps_the_largest_delay_once_per_fused_step() -> None:
    slept: list[float] = []
    adapter = EchoModel(step_delay_s=0.01, sleep=slept.append).step_adapter()
    a = adapter.prepare_encode(request("a"), generators(0)[0])
    b = adapter.prepare_encode(
        request("b", extra_args={"echo_step_delay_s": 0.5}), generators(1)[0]
    )
    adapter.denoise_step([a])
    adapter.denoise_step([a, b])
    assert slept == [0.01, 0.5]


@pytest.mark.parametrize(
    "extra", [{"echo_step_delay_s": -1}, {"echo_fail_at_step": "2"}, {"echo_fail_at_step": True}]
)
def test_step_mode_rejects_bad_extra_args_at_prepare(extra: dict[str, Any]) -> None:
    adapter = EchoModel().step_adapter()
    with pytest.raises(ValueError, match="extra_args"):
        adapter.prepare_encode(request(extra_args=extra), generators(0)[0])


def test_step_mode_rejects_incompatible_states() -> None:
    adapter = EchoModel().step_adapter()
    a = adapter.prepare_encode(request("a"), generators(0)[0])
    b = adapter.prepare_encode(request("b", height=32, width=32), generators(1)[0])
    c = adapter.prepare_encode(request("c", guidance_scale=2.0), generators(2)[0])
    with pytest.raises(ValueError, match=r"'a' and 'b'.*height"):
        adapter.denoise_step([a, b])
    with pytest.raises(ValueError, match=r"'a' and 'c'.*guidance_scale"):
        adapter.denoise_step([a, c])
