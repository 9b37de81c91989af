# Sourced by .ci/run (and by tests/test_ci_run.py): `stage NAME LIMIT_S COMMAND...` runs one CI stage under
# its own time limit and prints its wall time; `stages_summary` prints every stage's time at the end.
#
# A stage that outlives LIMIT_S is sent SIGINT, as Ctrl-C (its whole process group: pytest, which then names the
# test it was in, prints its summary and slowest tests, and the Ray processes it started), then SIGKILL 60 s
# later, and fails with status 124 (137 if killed) and a line that names the stage and its limit. A test that hangs inside a stage is caught earlier by pytest-timeout (pyproject.toml's `timeout`),
# which fails that test by name and lets the stage go on.

_STAGES=()

stage() {
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS rc=0
  echo "[ci] ===== stage ${name} (limit ${limit} s): $*"
  timeout --signal=INT --kill-after=60 "${limit}" "$@" || rc=$?
  local took=$((SECONDS - t0))
  if ((rc == 124 || rc == 137)); then
    echo "[ci] stage ${name} TIMED OUT after ${took} s (its limit is ${limit} s): the slowest tests above, or" \
         "the last test pytest named, is where it hung"
  fi
  echo "[ci] ===== stage ${name}: ${took} s, exit status ${rc}"
  _STAGES+=("${name}|${took}|${limit}|${rc}")
  return "${rc}"
}

stages_summary() {
  local total=0 row name took limit rc
  echo "[ci] stage wall times:"
  for row in "${_STAGES[@]}"; do
    IFS='|' read -r name took limit rc <<<"${row}"
    total=$((total + took))
    printf '[ci]   %-16s %6d s  (limit %5d s)  exit %s\n' "${name}" "${took}" "${limit}" "${rc}"
  done
  printf '[ci]   %-16s %6d s  (%d min)\n' "total" "${total}" $(((total + 59) / 60))
}
