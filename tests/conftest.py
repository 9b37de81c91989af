"""Shared pytest configuration (keep it small and free of component-specific helpers).

Hypothesis: the ``dcr`` profile turns off per-example deadlines (CI machines and the first call into
torch/numpy are slow in ways that say nothing about correctness) and is loaded by default; each test
chooses its own ``max_examples`` so the suite's runtime stays predictable.
"""

from __future__ import annotations

import os

# Real Ray in tests stays on loopback: with this set, Ray 2.60 binds 127.0.0.1 for ray.init() and
# ray.cluster_utils.Cluster. Set before anything imports ray.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis is a test extra; tests that need it import it themselves
    pass
else:
    settings.register_profile(
        "dcr", deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
    )
    settings.load_profile("dcr")
