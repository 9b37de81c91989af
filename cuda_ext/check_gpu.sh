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
