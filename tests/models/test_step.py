"""The step contract, checked on every built-in: each adapter's calls and request-mode parity.

Tolerances (measured on CPU, float32, one torch thread; see test_pipeline_step.py for fused
batches): a request stepped ALONE is bit-identical to ``generate`` for it alone, for every
family and both output types, so these tests compare with ``np.array_equal``/``torch.equal``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from omni_trio.models import DiffusionModel, ModelInfo, StepAdapter, StepState
from omni_trio.models.echo import EchoModel
from omni_trio.models.pipeline import DiffusersModel
from omni_trio.models.step import check_step_batch

from .support import generators, no_steps, request, step_alone


@pytest.fixture(params=["echo", "tiny_sd", "tiny_ddim"])
def model(request: pytest.FixtureRequest) -> Any:
    if request.param == "echo":
        return EchoModel()
    return request.getfixturevalue(request.param)


def adapter_of(model: DiffusionModel) -> StepAdapter:
    adapter = model.step_adapter()
    assert adapter is not None
    return adapter


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def test_every_builtin_supports_steps(model: Any) -> None:
    assert model.info.supports_steps
    assert isinstance(model.step_adapter(), StepAdapter)
    assert model.step_adapter() is model.step_adapter()


def test_the_four_calls(model: Any) -> None:
    adapter = adapter_of(model)
    req = request("r", num_inference_steps=3, num_outputs_per_prompt=2)
    generator = torch.Generator().manual_seed(3)
    state = adapter.prepare_encode(req, generator)
    assert isinstance(state, StepState)
    assert state.request is req and state.generator is generator and state.request_id == "r"
    assert (state.step_index, state.total_steps, state.denoise_completed) == (0, 3, False)
    for step in range(3):
        preds = adapter.denoise_step([state])
        assert len(preds) == 1 and state.step_index == step  # denoise_step does not advance
        adapter.step_scheduler(state, preds[0])
        assert state.step_index == step + 1
    assert state.denoise_completed
    images = adapter.post_decode(state, output_type="np")
    size = model.info.default_height
    assert [(i.shape, i.dtype) for i in images] == [((size, size, 3), np.float32)] * 2
    assert all(i.min() >= 0.0 and i.max() <= 1.0 for i in images)
    latents = adapter.post_decode(state, output_type="latent")
    assert len(latents) == 2 and all(isinstance(x, torch.Tensor) for x in latents)
    adapter.release(state)


@pytest.mark.parametrize("output_type", ["np", "latent"])
@pytest.mark.parametrize(
    "sampling",
    [
        {},
        {"num_outputs_per_prompt": 2},
        {"negative_prompt": "blurry, dark", "guidance_scale": 5.0},
        {"guidance_scale": 1.0},  # no classifier-free guidance
    ],
    ids=["default", "n2", "cfg-negative", "no-cfg"],
)
def test_stepping_alone_is_bit_identical_to_generate(
    model: Any, sampling: dict[str, Any], output_type: str
) -> None:
    req = request("r", prompt="a cat", num_inference_steps=4, **sampling)
    expected = model.generate([req], generators(11), output_type=output_type, on_step=no_steps)
    got = step_alone(adapter_of(model), req, 11, output_type)
    assert len(got) == len(expected[0])
    for a, b in zip(got, expected[0], strict=True):
        assert same(a, b)


def test_outputs_share_no_memory(model: Any) -> None:
    adapter = adapter_of(model)
    state = adapter.prepare_encode(request(num_outputs_per_prompt=2), generators(0)[0])
    for output_type in ("np", "latent"):
        first, second = adapter.post_decode(state, output_type=output_type)
        if isinstance(first, np.ndarray):
            assert not np.shares_memory(first, second)
        else:
            assert first.untyped_storage().data_ptr() != second.untyped_storage().data_ptr()
            if state.latents is not None:
                assert first.untyped_storage().data_ptr() != state.latents.data_ptr()


def test_a_preview_mid_denoise_leaves_the_result_alone(model: Any) -> None:
    adapter = adapter_of(model)
    req = request("r", num_inference_steps=4)
    expected = step_alone(adapter, req, 5)
    state = adapter.prepare_encode(req, generators(5)[0])
    previews = []
    while not state.denoise_completed:
        (pred,) = adapter.denoise_step([state])
        adapter.step_scheduler(state, pred)
        previews.append(adapter.post_decode(state, output_type="np"))
        adapter.post_decode(state, output_type="latent")
    assert state.step_index == 4
    (preview,) = previews[1]
    assert preview.shape == expected[0].shape and preview.dtype == np.float32
    assert same(previews[-1][0], expected[0])  # the last "preview" is the result


def test_incompatible_states_are_rejected(model: Any) -> None:
    adapter = adapter_of(model)
    one = adapter.prepare_encode(request("one"), generators(0)[0])
    two = adapter.prepare_encode(request("two", num_outputs_per_prompt=2), generators(1)[0])
    with pytest.raises(ValueError, match=r"'one' and 'two'"):
        adapter.denoise_step([one, two])
    with pytest.raises(ValueError, match="at least one"):
        adapter.denoise_step([])
    with pytest.raises(ValueError, match="twice"):
        adapter.denoise_step([one, one])


def test_a_finished_state_takes_no_more_steps(model: Any) -> None:
    adapter = adapter_of(model)
    state = adapter.prepare_encode(request(num_inference_steps=1), generators(0)[0])
    (pred,) = adapter.denoise_step([state])
    adapter.step_scheduler(state, pred)
    assert state.denoise_completed
    with pytest.raises(ValueError, match="no step left"):
        adapter.denoise_step([state])
    with pytest.raises(ValueError, match="no step left"):
        adapter.step_scheduler(state, pred)
    assert state.step_index == 1


def test_unknown_output_type_is_rejected(model: Any) -> None:
    adapter = adapter_of(model)
    state = adapter.prepare_encode(request(), generators(0)[0])
    with pytest.raises(ValueError, match="output_type"):
        adapter.post_decode(state, output_type="pil")  # type: ignore[arg-type]


def test_a_closed_model_refuses_step_calls(model: Any) -> None:
    fresh: DiffusionModel = (
        EchoModel() if isinstance(model, EchoModel) else DiffusersModel(model.pipeline, name="copy")
    )
    adapter = adapter_of(fresh)
    state = adapter.prepare_encode(request(), generators(0)[0])
    (pred,) = adapter.denoise_step([state])
    fresh.close()
    for call in (
        lambda: adapter.prepare_encode(request(), generators(0)[0]),
        lambda: adapter.denoise_step([state]),
        lambda: adapter.step_scheduler(state, pred),
        lambda: adapter.post_decode(state, output_type="np"),
    ):
        with pytest.raises(RuntimeError, match="closed"):
            call()


def test_release_drops_the_tensors(model: Any) -> None:
    adapter = adapter_of(model)
    state = adapter.prepare_encode(request(), generators(0)[0])
    adapter.release(state)
    assert state.latents is None and state.scheduler is None and not state.extra


class _NoSteps(DiffusionModel):
    info = ModelInfo("m", "echo", True, 64, 64, False)

    def generate(
        self,
        requests: Sequence[Any],
        generators: Sequence[torch.Generator],
        *,
        output_type: Any,
        on_step: Any,
    ) -> list[list[Any]]:
        return []

    def to(self, device: torch.device | str) -> None:
        pass

    def close(self) -> None:
        pass


def test_by_default_a_model_has_no_step_adapter() -> None:
    model = _NoSteps()
    assert not model.info.supports_steps
    assert model.step_adapter() is None


def test_state_properties_and_identity() -> None:
    req = request("abc", num_inference_steps=2)
    state = StepState(req, torch.Generator(), total_steps=2)
    assert state.request_id == "abc" and not state.denoise_completed
    state.step_index = 2
    assert state.denoise_completed
    twin = StepState(req, state.generator, step_index=2, total_steps=2)
    assert state != twin and len({state, twin}) == 2


def test_check_step_batch_names_the_pair_and_the_field() -> None:
    a = StepState(request("a"), torch.Generator(), total_steps=2, extra={"size": 64})
    b = StepState(request("b"), torch.Generator(), total_steps=2, extra={"size": 64})
    c = StepState(request("c"), torch.Generator(), total_steps=2, extra={"size": 32})
    check_step_batch([a, b], lambda s: {"size": s.extra["size"]})
    with pytest.raises(ValueError, match=r"'a' and 'c'.*size 64 != 32"):
        check_step_batch([a, b, c], lambda s: {"size": s.extra["size"]})
