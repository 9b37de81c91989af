"""Shared pytest configuration (keep it small and free of component-specific helpers).

Hypothesis: the ``dcr`` profile turns off per-example deadlines (CI machines and the first call into
torch/numpy are slow in ways that say nothing about correctness) and is loaded by default; each test
chooses its own ``max_examples`` so the suite's runtime stays predictable.
"""

from __future__ import annotations

import os

import pytest

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


# Ray workers in tests are forked from one prefork server (dcr_ray.prefork) that imported torch,
# transformers and the codec kernels once, so each engine or trainer a test starts skips about 3.4 CPU-s of
# imports (DCR_TEST_PREFORK=0 starts every worker the ordinary way). It reaches every ray.init of the run,
# examples run as subprocesses included, through Ray's runtime-env hook. It starts once collection is done:
# importing the test modules imports vLLM and veRL, which set environment variables (TORCH_CUDA_ARCH_LIST,
# LD_LIBRARY_PATH, ...) that every later Ray worker inherits, and the server refuses workers whose
# environment differs from its own there. The summary says how many workers were forked and how many refused.
def pytest_collection_finish(session):
    import dcr_ray.prefork
    from dcr_ray.cli import find_benchmarks

    # This checkout on PYTHONPATH (dcr_ray.cli.find_benchmarks, as the benchmark tests do for their Ray
    # workers), whichever way workers start: Ray workers and the examples' subprocesses then import this
    # checkout's dcr_ray, not an installed one. Done first, so that the server starts with it too and the
    # benchmark tests' workers are forked, not refused.
    find_benchmarks()
    if os.environ.get("DCR_TEST_PREFORK", "1") != "1" or not dcr_ray.prefork.available():
        return
    from dcr_ray.testing.models import MODELING_MODULES

    # the library's preloads and the two architectures most tests build
    server = dcr_ray.prefork.start(extra=(MODELING_MODULES["qwen2"], MODELING_MODULES["llama"]))  # beside the tests
    os.environ.update(server.environ())
    session.config._dcr_prefork = server


@pytest.fixture(scope="module", autouse=True)
def _environment_restored_after_each_module():
    """Each test module leaves the process environment as it found it. An in-process vLLM engine sets
    variables every later child inherits (LD_PRELOAD of its OpenMP and allocator, among others): left in
    place, every Ray started by a later module passes them to its workers, which the prefork server then
    refuses (their environment differs from its own), and which start with another OpenMP."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def pytest_terminal_summary(terminalreporter, config):
    server = getattr(config, "_dcr_prefork", None)
    if server is not None:
        c = server.counts()
        terminalreporter.write_line(f"dcr_ray.prefork: {c['forked']} Ray workers forked pre-imported, "
                                    f"{c['refused']} refused (started the ordinary way)")


# The suite's process leaves with pytest's own status once every plugin has finished (summary printed,
# reports written), without the interpreter's teardown: a full run once died there with SIGSEGV after
# its summary (native threads of the in-process vLLM/torch/Ray libraries), which turned a passing run
# into a failing exit status. Set DCR_TEST_TEARDOWN=1 to run the teardown as usual.
def pytest_sessionfinish(session, exitstatus):
    session.config._dcr_exitstatus = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    server = getattr(config, "_dcr_prefork", None)
    if server is not None:
        server.stop()
    status = getattr(config, "_dcr_exitstatus", None)
    if status is None or os.environ.get("DCR_TEST_TEARDOWN") == "1":
        return
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()  # what the skipped teardown would do: stop a local Ray this process started
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
