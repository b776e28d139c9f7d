"""Hypothesis profiles: ``dev`` (fast, local default), ``ci`` (reproducible, more examples),
``fast`` (``make test-fast``: a few examples, a smoke run) and ``long`` (fuzzing campaigns).
The engine state machines scale these down: they run a real engine per example (see
property_tests/test_engine_machine.py).

``CI`` in the environment selects ``ci``; ``HYPOTHESIS_PROFILE`` overrides either.  As in
``tests/``, a test that starts a process must be in a module marked ``slow``
(:mod:`tests.spawn_guard`).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tests.spawn_guard import spawns_are_marked_slow as spawns_are_marked_slow

settings.register_profile(
    "dev",
    max_examples=50,
    stateful_step_count=40,
    deadline=None,  # wall-clock deadlines make a loaded machine flaky
)
settings.register_profile(
    "ci",
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    print_blob=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# ``make test-fast`` (HYPOTHESIS_PROFILE=fast): the inner loop; ``make test`` runs the rest.
settings.register_profile(
    "fast",
    max_examples=10,
    stateful_step_count=20,
    deadline=None,
)
# Campaigns (``omni-trio fuzz`` and HYPOTHESIS_PROFILE=long): many examples, long sequences.
settings.register_profile(
    "long",
    max_examples=2000,
    stateful_step_count=60,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model cache for the whole session (built-in models materialise here once)."""
    return tmp_path_factory.mktemp("omni-trio-cache")
