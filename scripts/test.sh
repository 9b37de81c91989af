#!/usr/bin/env bash
# The README's test command, and exactly what CI runs (.ci/run): set up .venv, then every test stage in order.
# A stage that fails stops the run with its status.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The suite: every test, its Ray workers forked from a prefork server (tests/conftest.py).
.venv/bin/python -m pytest -q tests
# The core Ray modules again, with ordinary Ray workers: the start dcr_ray.launch gives every user (prefork is
# the opt-in the suite above runs under).
DCR_TEST_PREFORK=0 .venv/bin/python -m pytest -q tests/test_pipeline.py tests/test_multinode.py \
    tests/test_recovery.py tests/test_examples.py tests/test_vllm_engine.py
