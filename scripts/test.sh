#!/usr/bin/env bash
# The README's test command, and exactly what CI runs (.ci/run): set up .venv, then every test stage in order.
# A stage that fails stops the run with its status.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The suite: every test, its Ray workers forked from a prefork server (tests/conftest.py).
.venv/bin/python -m pytest -q tests
# The compatibility matrix: each stack users run (TRL, OpenRLHF and veRL pins; pyproject's floors; the newest
# releases; vLLM 0.33 and 0.34's modules), pinned in its own environment under .compat (scripts/compat.sh).
bash scripts/compat.sh
