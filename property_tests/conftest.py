"""Hypothesis profiles: ``dev`` (fast, local default) and ``ci`` (reproducible, more examples).

``CI`` in the environment selects ``ci``; ``HYPOTHESIS_PROFILE`` overrides either.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

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
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)
