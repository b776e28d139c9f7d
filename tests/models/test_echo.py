from __future__ import annotations

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
