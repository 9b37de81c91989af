"""``dcr-ray bench codec``: wire bytes against the entropy bound and peers, and codec throughput.

Cases (all measured in one run, on the same data for every encoder):

- ``adamw-lr1e-06`` / ``adamw-lr1e-05``: real updates. A small ``transformers`` causal LM
  (:func:`dcr_ray.testing.models.build_model`, ``size="small"``, ~40 M parameters) with FP32 master weights
  trained by ``torch.optim.AdamW`` at a constant LR on random token batches (real ``loss.backward()``);
  each measured step compares the BF16 copy of the master weights before the step (baseline) with the
  BF16 copy after it.
- ``stress-1%`` / ``3%`` / ``5%``: a BF16 tensor of ``randn * 0.02`` in which exactly that fraction of
  elements, chosen uniformly, changes by a relative ``1e-2 * randn`` (an element that rounding leaves
  unchanged is nudged by one ulp, so exactly that fraction changes its bits).

For every case: changed elements, dcr_ray wire bytes (mixed mode in the ``context`` coding: XOR or ADD
values, flat or class-order positions), the same changed set in *today's* coding (``plain``: XOR masks at
flat positions, the library's default, what the codec wrote before ADD and the class modes) and
overwrite-only bytes, all in the same run; three zero-order bounds: the *global* entropy bound
(positions: ``n * H(p)`` bits with ``p`` the change rate of the whole step; masks: the empirical
entropy of the 16-bit XOR values times their count), the *per-tensor* bound (each tensor's
``n_t * H(p_t)``, and the empirical entropy of the zigzagged integer differences instead of the XOR
masks) and the *class* bound (the per-tensor bound with each tensor's rate taken per exponent class of
the old values, what class-order positions aim at); encode GB/s (diff + frame encoding, per canonical
byte scanned) and decode+apply GB/s (``read_frame`` + ``apply_decoded``, per canonical byte) of both
codings (``--coding``, by default the library's, fills the main columns; the other coding's go under
``other_``), the bytes of two peer encodings (:mod:`benchmarks.peers`), and a bit-exactness check of
every decode (integer views).
A memory-bandwidth reference (numpy copy) and a zstd level sweep on the 3% stress case come from the
same run. Throughputs are the best of several repeats (the machine may be shared).

Modules, one idea each: :mod:`.settings` (settings, targets, progress), :mod:`.cli` (the subcommand),
:mod:`.data` (the cases' data), :mod:`.measure` (one measured step), :mod:`.extras` (many small tensors,
memory bandwidth, zstd sweep), :mod:`.runner` (the whole run), :mod:`.report` (checks, table, plot).
"""

from __future__ import annotations

from benchmarks.codec.cli import add_parser
from benchmarks.codec.data import (FIXED_COST_MAX_S, MOE_RATE, MOE_SHAPE, MOE_TENSORS, expert_shapes, moe_step,
                                      real_steps, stress_step)
from benchmarks.codec.extras import measure_fixed_cost, memcpy_gbps, zstd_sweep
from benchmarks.codec.measure import Acc, Step, case_result, measure_step
from benchmarks.codec.report import checks, fixed_cost_checks, format_table, plot
from benchmarks.codec.runner import run
from benchmarks.codec.settings import LINK_GBITPS, REAL_LRS, STRESS_RATES, TARGETS, ZSTD_LEVELS, Settings

__all__ = [
    "Acc", "FIXED_COST_MAX_S", "LINK_GBITPS", "MOE_RATE", "MOE_SHAPE", "MOE_TENSORS", "REAL_LRS", "STRESS_RATES",
    "Settings", "Step", "TARGETS", "ZSTD_LEVELS", "add_parser", "case_result", "checks", "expert_shapes",
    "fixed_cost_checks", "format_table", "measure_fixed_cost", "measure_step", "memcpy_gbps", "moe_step", "plot",
    "real_steps", "run", "stress_step", "zstd_sweep",
]
