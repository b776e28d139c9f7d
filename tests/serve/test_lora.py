"""The ``lora`` field and ``/v1/models`` on the real app under hypercorn, with
``builtin:shapes`` and random test adapters (httpx and the openai SDK as clients)."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import openai
import pytest
import trio
from PIL import Image

from tests.lora_support import make_foreign_lora, make_lora
from tests.serve.conftest import CAP_S, assert_envelope, run_server

pytestmark = pytest.mark.slow  # (the same servers as test_app.py)

GEN = "/v1/images/generations"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loras")
    return {
        "a": str(make_lora(root / "a", seed=1)),
        "foreign": str(make_foreign_lora(root / "foreign")),
    }


def picture(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))))


async def test_lora_field_models_list_and_errors(adapters: dict[str, str], cache_dir: Path) -> None:
    body = {"prompt": "a red circle", "size": "32x32", "seed": 4, "num_inference_steps": 4}
    with trio.fail_after(CAP_S * 2):
        async with (
            run_server(model="builtin:shapes", loras=adapters, cache_dir=str(cache_dir)) as server,
            server.client() as client,
        ):
            models = (await client.get("/v1/models")).json()["data"]
            assert [(m["id"], m.get("parent")) for m in models] == [
                ("builtin:shapes", None),
                ("a", "builtin:shapes"),
                ("foreign", "builtin:shapes"),
            ]
            plain = await client.post(GEN, json=body)
            assert plain.status_code == 200, plain.text
            adapted = await client.post(GEN, json={**body, "lora": "a"})
            listed = await client.post(GEN, json={**body, "lora": [{"name": "a", "scale": 1}]})
            assert adapted.status_code == listed.status_code == 200
            a = picture(adapted.json()["data"][0]["b64_json"])
            assert np.array_equal(a, picture(listed.json()["data"][0]["b64_json"]))
            assert not np.array_equal(a, picture(plain.json()["data"][0]["b64_json"]))

            # An adapter listed as a model can be asked for as the model (as with vLLM).
            as_model = await client.post(GEN, json={**body, "model": "a"})
            assert as_model.status_code == 200, as_model.text
            assert np.array_equal(picture(as_model.json()["data"][0]["b64_json"]), a)
            r = await client.post(GEN, json={**body, "model": "a", "lora": "a"})
            assert assert_envelope(r, 400, code="invalid_value")["param"] == "model"
            assert_envelope(await client.post(GEN, json={**body, "model": "x"}), 404)

            r = await client.post(GEN, json={**body, "lora": "nope"})
            error = assert_envelope(r, 400, code="invalid_value")
            assert error["param"] == "lora" and "unknown LoRA adapter" in error["message"]
            for bad, code in ((5, "invalid_type"), ([{"name": "a", "scale": 99}], "invalid_value")):
                r = await client.post(GEN, json={**body, "lora": bad})
                assert assert_envelope(r, 400, code=code)["param"] == "lora"
            r = await client.post(GEN, json={**body, "lora": "foreign"})
            error = assert_envelope(r, 400, code="invalid_lora")
            assert error["param"] == "lora" and r.headers["x-should-retry"] == "false"
            # The worker serves on, with the good adapter too.
            again = await client.post(GEN, json={**body, "lora": "a"})
            assert np.array_equal(picture(again.json()["data"][0]["b64_json"]), a)

            sdk = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused")
            result = await sdk.images.generate(
                prompt="a red circle",
                size="32x32",  # type: ignore[arg-type]
                extra_body={"seed": 4, "num_inference_steps": 4, "lora": "a"},
            )
            assert result.data is not None and result.data[0].b64_json is not None
            assert np.array_equal(picture(result.data[0].b64_json), a)
            await sdk.close()
