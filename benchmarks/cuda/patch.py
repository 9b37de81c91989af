"""Apply throughput of one sparse patch: dcr_ray's sparse write vs vLLM ``sparse_nccl``'s NaN-masked load.

Same GPU, same tensor, same patch (``--elems`` BF16 elements, ``--density`` of them changed, one of the
new values a real NaN):

* ``dcr``: what the capture path ends with once the loader plan is known: a scatter of the changed
  positions' new bits into live storage (``cuda_ext.scatter_overwrite``, integer views, no staging).
* ``sparse_nccl``: vLLM's own ``load_checkpoint_weight_patches`` (run, not modelled) through a module
  whose ``load_weights`` makes the one final ``copy_`` it requires; it builds a full-size staging
  tensor with NaN for unchanged elements and keeps the destination where the source is NaN. It refuses
  a patch whose new values contain a NaN (the sentinel), so it is timed on the patch without the NaN
  and the refusal is reported.

Prints GB/s (tensor bytes / apply seconds, best of ``--repeat``) and whether each result equals the
expected bits exactly.
Runs on CPU too (a smoke test of the same code; figures then are not GPU figures).
"""

from __future__ import annotations

import argparse
import time

import torch


class _Holder(torch.nn.Module):
    """One parameter and the loader contract ``load_checkpoint_weight_patches`` needs."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = torch.nn.Parameter(w, requires_grad=False)

    def load_weights(self, weights):
        names = set()
        for name, t in weights:
            self.w.copy_(t.view(self.w.shape))
            names.add(name)
        return names


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _best(fn, reset, device, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        reset()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elems", type=int, default=1 << 26)
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (CheckpointWeightPatch,
                                                                            load_checkpoint_weight_patches)

    import cuda_ext

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    base = torch.randn(args.elems, generator=g).to(torch.bfloat16)
    n = max(2, int(args.elems * args.density))
    pos = torch.randperm(args.elems, generator=g)[:n].sort().values
    vals = (base[pos].float() * 1.01 + 1e-3).to(torch.bfloat16)
    vals[n // 2] = float("nan")  # a weight that really is NaN must survive
    expect = base.clone()
    expect[pos] = vals
    base_d, pos_d, vals_d = base.to(device), pos.to(device), vals.to(device)
    nbytes = args.elems * 2

    dst = base_d.clone()
    if device.type == "cuda":
        bits = vals_d.view(torch.int16)
        dcr_apply = lambda: cuda_ext.scatter_overwrite(dst.view(torch.int16), pos_d, bits)  # noqa: E731
    else:
        dcr_apply = lambda: dst.view(torch.int16).index_put_((pos_d,), vals_d.view(torch.int16))  # noqa: E731
    t_dcr = _best(dcr_apply, lambda: dst.copy_(base_d), device, args.repeat)
    dcr_exact = torch.equal(dst.cpu().view(torch.int16), expect.view(torch.int16))

    holder = _Holder(base_d.clone())
    try:
        load_checkpoint_weight_patches(holder, [CheckpointWeightPatch("w", (args.elems,), torch.bfloat16, vals_d, pos_d)])
        refused = "no"
    except ValueError as e:
        refused = f"yes ({e})"
    keep = torch.ones(n, dtype=torch.bool)
    keep[n // 2] = False  # without the NaN, which it cannot carry
    expect_nan = base.clone()
    expect_nan[pos[keep]] = vals[keep]
    patch = [CheckpointWeightPatch("w", (args.elems,), torch.bfloat16, vals_d[keep.to(device)], pos_d[keep.to(device)])]
    t_nan = _best(lambda: load_checkpoint_weight_patches(holder, patch), lambda: holder.w.copy_(base_d),
                  device, args.repeat)
    nan_exact = torch.equal(holder.w.detach().cpu().view(torch.int16), expect_nan.view(torch.int16))

    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), "
          f"{args.elems} BF16 elements, {n} changed ({100 * args.density:.2f}%), one of them NaN")
    print(f"dcr sparse write      {nbytes / t_dcr / 1e9:8.2f} GB/s  ({1e3 * t_dcr:.2f} ms)  exact: {dcr_exact}")
    print(f"sparse_nccl NaN mask  {nbytes / t_nan / 1e9:8.2f} GB/s  ({1e3 * t_nan:.2f} ms)  exact: {nan_exact} "
          f"(patch without the NaN; with it, refused: {refused})")
    print(f"speedup {t_nan / t_dcr:.1f}x")
    return 0 if dcr_exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
