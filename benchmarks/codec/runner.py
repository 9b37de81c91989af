"""The whole run: every case, the extras, the checks, and the machine it ran on."""

from __future__ import annotations

import os
import platform
import time

from benchmarks import provenance
from benchmarks.codec.data import MOE_RATE, MOE_SHAPE, MOE_TENSORS, moe_step, real_steps, stress_step
from benchmarks.codec.extras import measure_fixed_cost, memcpy_gbps, zstd_sweep
from benchmarks.codec.default import library_default
from benchmarks.codec.measure import Acc, case_result, measure_step
from benchmarks.codec.report import _short, checks, fixed_cost_checks
from benchmarks.codec.settings import REAL_LRS, STRESS_RATES, TARGETS, Settings, _log


def run(s: Settings) -> dict:
    """Run every case; returns the JSON-able result."""
    import numpy as np
    import torch
    import zstandard

    from dcr_ray.codec.compiled import threads as threads_mod
    from dcr_ray.codec.encoding.encode import DEFAULT_ZSTD_LEVEL, ZSTD_HASH_LOG

    t_start = time.perf_counter()
    load0 = provenance.loadavg()
    _log(f"dcr-ray bench codec ({'quick' if s.quick else 'full'}): memcpy reference")
    mem = memcpy_gbps(s.memcpy_bytes, s.repeats)
    _log(f"  numpy copy {mem:.2f} GB/s")
    cases = []
    for lr in REAL_LRS:
        _log(f"real updates: AdamW lr={lr:g}, small model, {s.warm_steps} warm-up + {s.steps} measured steps")
        acc = Acc()
        for step in real_steps(s, lr):
            measure_step(step, acc, s.repeats, s.coding)
            _log(f"    change rate {acc.rates[-1]:.3%}")
        cases.append(case_result(f"adamw-lr{lr:g}", "adamw", acc, lr=lr, steps=s.steps,
                                 step_change_rates=acc.rates))
        cases[-1].update(library_default(cases[-1], s.link_mbps))
        _log(f"  done: {_short(cases[-1])}")
    sweep = None
    for rate in STRESS_RATES:
        _log(f"stress: {rate:.0%} uniform changes in {s.stress_elems / 2**20:.0f} Mi BF16 elements")
        step = stress_step(s.stress_elems, rate, s.seed)
        acc = Acc()
        measure_step(step, acc, s.repeats, s.coding)
        cases.append(case_result(f"stress-{rate:.0%}", "stress", acc))
        cases[-1].update(library_default(cases[-1], s.link_mbps))
        _log(f"  done: {_short(cases[-1])}")
        if rate == 0.03:
            _log("  zstd level sweep on stress-3%")
            sweep = zstd_sweep(step, s.repeats)
        del step
    _log(f"many tensors: {MOE_TENSORS:,} MoE-shaped BF16 tensors of {MOE_SHAPE}, {MOE_RATE:.0%} changed")
    step = moe_step(MOE_TENSORS, MOE_SHAPE, MOE_RATE, s.seed)
    moe = measure_fixed_cost(step, s.coding)
    del step
    _log(f"  encode {moe['encode_s']:.2f}s, decode+apply {moe['decode_apply_s']:.2f}s, "
         f"{moe['bytes_per_change']:.2f} B/change (today {moe['today_bytes_per_change']:.2f})")
    result = {
        "bench": "codec",
        "git": provenance.git_commit(),
        "quick": s.quick,
        "memcpy_gbps": mem,
        "cases": cases,
        "many_tensors": moe,
        "zstd_sweep": {"case": "stress-3%", "default_level": DEFAULT_ZSTD_LEVEL, "hash_log": ZSTD_HASH_LOG,
                       "levels": sweep},
        "targets": TARGETS,
        "checks": {**checks(cases), **fixed_cost_checks(moe)},
        "machine": {
            "cpus": os.cpu_count(), "codec_threads": threads_mod.codec_threads(), "platform": platform.platform(),
            "python": platform.python_version(), "numpy": np.__version__, "torch": torch.__version__,
            "zstandard": zstandard.__version__, "loadavg_start": load0,
            "loadavg_end": provenance.loadavg(),
        },
        "settings": {"seed": s.seed, "repeats": s.repeats, "coding": s.coding, "link_mbps": s.link_mbps,
                     "stress_elems": s.stress_elems,
                     "warm_steps": s.warm_steps, "steps": s.steps, "batch": list(s.batch)},
        "elapsed_s": time.perf_counter() - t_start,
    }
    _log(f"finished in {result['elapsed_s']:.1f}s")
    return result
