#!/usr/bin/env bash
# GPU checks for cuda_ext (run from anywhere on a machine with a CUDA GPU and CuPy; < 5 minutes):
#   1. the `gpu`-marked tests: GPU kernels vs the numpy path, bit for bit, all element widths;
#      and the vLLM dcr weight-transfer backend on CUDA (loader capture), outputs == a fresh engine;
#   2. a codec micro-benchmark (64 Mi BF16-sized elements, 1% changed), which re-checks equality;
#   3. apply GB/s of one 1% patch: dcr's sparse write vs vLLM sparse_nccl's NaN-masked load, same GPU;
#   4. the serving pause of dcr_ray-started vLLM engines on CUDA (loader capture: captured tensors are written
#      sparsely into live storage at activate, no fused-group reload) beside a dense sync, a full
#      fetch-then-reload and SkyRL's delta sync on the same engines, each through vLLM's own reload
#      (`bench live`, small model, staged and in place, at 1 Gbit/s and without an emulated link).
#   5. vLLM 0.34 (no CPU wheel; on CPU its shims run only against its modules, `scripts/compat.sh vllm-0.34`):
#      the shim tests and the vLLM GPU test of step 1 with vLLM 0.34.0 itself: the reload through its own
#      start_reload/finish_reload (post-load hooks on every reload), the session end through its worker, outputs
#      == a fresh engine. It runs in VLLM_034_PYTHON's environment, else .compat/gpu-vllm-0.34 (built here by
#      uv: dcr_ray[test] and vllm==0.34.0 with its CUDA torch; needs PyPI), and says so when it has neither.
# Without CuPy or a GPU the tests skip and the benchmark prints the numpy figures only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
"$PY" -c "import cupy, sys; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())" \
  || echo "CuPy is not importable: pip install 'dcr_ray[cuda]' (cupy-cuda12x)"
timeout 180 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_cuda_ext.py
timeout 300 "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_vllm_adopted.py
timeout 90 "$PY" -m benchmarks.cuda.kernels --elems $((1 << 26)) --density 0.01
timeout 30 "$PY" -m benchmarks.cuda.kernels --elems $((1 << 24)) --density 0.01 --width 1
timeout 120 "$PY" -m benchmarks.cuda.patch --elems $((1 << 26)) --density 0.01
timeout 420 "$PY" -m benchmarks live --quick --receivers vllm --data adamw --engines 1 --gpus-per-engine 1 \
  --links 1000,none --json /tmp/dcr_live_gpu.json
V034="${VLLM_034_PYTHON:-.compat/gpu-vllm-0.34/bin/python}"
if [ ! -x "$V034" ] && [ -z "${VLLM_034_PYTHON:-}" ]; then
  (python3 -m venv .compat/uv && .compat/uv/bin/pip install -q uv==0.13.9 \
    && .compat/uv/bin/uv venv -q .compat/gpu-vllm-0.34 \
    && .compat/uv/bin/uv pip install -q --python .compat/gpu-vllm-0.34/bin/python -e ".[test]" vllm==0.34.0) \
    || echo "vLLM 0.34: no environment (set VLLM_034_PYTHON, or run where PyPI is reachable): step 5 skipped"
fi
if [ -x "$V034" ]; then
  "$V034" -c "import vllm; print('vLLM', vllm.__version__)"
  timeout 120 "$V034" -m pytest -q -p no:cacheprovider -rs tests/test_vllm_compat.py
  timeout 300 "$V034" -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_vllm_adopted.py
fi
