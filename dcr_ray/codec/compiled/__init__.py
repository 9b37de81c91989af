"""The codec's compiled kernels and what runs them (numba on CPU; ``DCR_RAY_JIT=0`` selects numpy): whether
they are used and building each set once per process (``jit``), the worker threads the codec shares
(``threads``), kernels over one tensor's flat bits (``kernels``) and over many small tensors by data pointer
(``ptrkernels``), with their numba definitions (``kernels_numba``, ``ptrkernels_numba``) imported on first
use."""
