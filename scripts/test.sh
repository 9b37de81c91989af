#!/usr/bin/env bash
# The README's test command, and exactly what CI runs (.ci/run): set up .venv, then every test stage in order.
# A stage that fails stops the run with its status.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The core Ray modules run with ordinary Ray workers: the start dcr_ray.launch gives every user.
ORDINARY=(tests/test_pipeline.py tests/test_multinode.py tests/test_recovery.py tests/test_examples.py
          tests/test_vllm_engine.py)
# The suite: every other test, its Ray workers forked from a prefork server (tests/conftest.py; the opt-in).
.venv/bin/python -m pytest -q tests "${ORDINARY[@]/#/--ignore=}"
DCR_TEST_PREFORK=0 .venv/bin/python -m pytest -q "${ORDINARY[@]}"
# The compatibility matrix: each stack users run (TRL, OpenRLHF and veRL pins; pyproject's floors; the newest
# releases; vLLM 0.33 and 0.34's modules), pinned in its own environment under .compat (scripts/compat.sh).
bash scripts/compat.sh
