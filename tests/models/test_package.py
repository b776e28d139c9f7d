from __future__ import annotations

import types

import omni_trio.models as models

PUBLIC = {
    "BUILTIN_MODELS",
    "DiffusionModel",
    "EchoInjectedError",
    "ModelInfo",
    "StepAdapter",
    "StepHook",
    "StepState",
    "decode_echo_image",
    "load_model",
}


def test_public_names() -> None:
    assert set(models.__all__) == PUBLIC
    assert models.BUILTIN_MODELS == (
        "builtin:tiny-sd",
        "builtin:tiny-ddim",
        "builtin:shapes",
        "builtin:echo",
    )


def test_nothing_else_leaks() -> None:
    leaked = {
        name
        for name, value in vars(models).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert leaked == PUBLIC
