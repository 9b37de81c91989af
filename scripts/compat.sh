#!/usr/bin/env bash
# The compatibility matrix: `bash scripts/compat.sh [STACK...]` (default: every stack; --build-only builds
# the environments and runs nothing). Each stack is a pinned set of versions in its own environment,
# .compat/STACK, built by uv (installed into .compat/uv), and the tests run there; each writes
# compat/STACK.json, and `python3 scripts/works_with.py` turns those into the README's "Works with" table.
# The stacks, their pins and their tests: scripts/compat.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
exec "$PY" scripts/compat.py "$@"
