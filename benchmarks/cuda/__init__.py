"""GPU scripts run by ``cuda_ext/check_gpu.sh``: ``python -m benchmarks.cuda.kernels`` (the CuPy kernels of
``cuda_ext`` vs the numpy path, bit for bit) and ``python -m benchmarks.cuda.patch`` (one sparse patch's
apply: dcr's sparse write vs vLLM ``sparse_nccl``'s NaN-masked load). Neither is a ``dcr-ray bench``
subcommand."""
