"""What a vLLM-CPU engine dcr_ray starts holds in memory, per receiver path: the capture path keeps no host mirror.

For each model (``--sizes``) and each kind of engine (``vllm``: weights packed, dcr_ray's mirror path;
``vllm_capture``: weights unpacked, the capture path), a fresh process starts a
:class:`~dcr_ray.engines.vllm.VllmBackend` on the model's checkpoint, serves a few tokens, takes ``--refits``
refits (frames of a 1% change of every tensor's elements, built beforehand in the parent and read one at a
time) and serves again. It reports the process's resident memory then (``rss``, after ``malloc_trim``) and
its peak (``hwm``, the start-up checks included), beside the checkpoint's bytes. vLLM's own baseline is the
same engine of the ``tiny`` model (about a megabyte of weights): Python, torch, vLLM and dcr_ray loaded, the
KV cache allocated. The target (issue 51): capture-path RSS <= model bytes x 1.1 + that baseline.

    python -m benchmarks.tools.vllm_memory --sizes small,medium --json docs/bench_vllm_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile

KINDS = ("vllm", "vllm_capture")
#: Issue 51: an engine on the capture path holds at most the served model + this share + vLLM's baseline.
RSS_MARGIN = 0.10


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _one(ckpt: str, kind: str, frames_path: str) -> dict:
    """(In the child process.) Start the engine, serve, refit, serve; the process's memory."""
    import gc

    from dcr_ray.engines.vllm import VllmBackend
    from dcr_ray.heap import return_free_heap

    engine = VllmBackend(ckpt, cpu_weights="unpacked" if kind == "vllm_capture" else "packed")
    try:
        prompts = [[1, 2, 3, 4, 5, 6, 7, 8]] * 4
        engine.generate(prompts, 8)
        with open(frames_path, "rb") as f:
            refits = pickle.load(f)
        for frames in refits:
            for data in frames:
                engine.apply_bytes(data)
            engine.flush()
            engine.activate(engine.version)
        del refits
        engine.generate(prompts, 8)
        gc.collect()
        return_free_heap()
        return {"rss": _status("VmRSS"), "hwm": _status("VmHWM"), "placement": engine.placement,
                "version": engine.version}
    finally:
        engine.close()


def _frames(ckpt: str, refits: int, rate: float, seed: int) -> list[list[bytes]]:
    """Frames of ``refits`` updates, each flipping low mantissa bits of ``rate`` of every tensor's elements."""
    import numpy as np
    import torch

    from dcr_ray.codec import BaselineStore, FrameMeta, encode_frames
    from dcr_ray.engines.vllm.checkpoint import checkpoint_files, iter_checkpoint

    state = {n: t.contiguous() for n, t in iter_checkpoint(checkpoint_files(ckpt))}
    store = BaselineStore(in_memory=True)
    for n, t in state.items():
        store.add(n, t)
    rng = np.random.default_rng(seed)
    out = []
    for v in range(refits):
        deltas = []
        for n, t in state.items():
            t = t.clone()
            bits = t.view(-1).view(torch.int16).numpy()
            idx = rng.choice(len(bits), size=max(1, int(len(bits) * rate)), replace=False)
            bits[idx] ^= rng.integers(1, 8, size=len(idx)).astype(np.int16)
            state[n] = t
            deltas.append(store.diff(n, t))
        meta = FrameMeta(transfer=f"mem-{v}", attempt=0, producer="bench", payload=0, base=v, target=v + 1)
        out.append(list(encode_frames(deltas, meta)))
        store.begin(v + 1)
        for d in deltas:
            store.add_pending(d)
        store.promote(v + 1)
    return out


def run(sizes: list[str], refits: int, rate: float, seed: int) -> dict:
    from dcr_ray.testing.models import ModelSpec, build_model, save_checkpoint

    result = {"tool": "vllm_memory", "refits": refits, "rate": rate, "margin": RSS_MARGIN, "models": {}}
    with tempfile.TemporaryDirectory(prefix="dcr_vllm_memory_") as tmp:
        for size in ["tiny", *sizes]:
            ckpt = save_checkpoint(build_model(ModelSpec(size=size, seed=seed)), os.path.join(tmp, size))
            model_bytes = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt)
                              if f.endswith(".safetensors"))
            frames = os.path.join(tmp, f"{size}.frames")
            with open(frames, "wb") as f:
                pickle.dump(_frames(ckpt, refits, rate, seed), f)
            got = {"model_bytes": model_bytes}
            for kind in KINDS:
                out = subprocess.run([sys.executable, "-m", "benchmarks.tools.vllm_memory", "--child", ckpt, kind,
                                      frames], capture_output=True, text=True, check=True)
                got[kind] = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"{size} {kind}: rss {got[kind]['rss'] / 2**20:.0f} MiB, peak {got[kind]['hwm'] / 2**20:.0f} "
                      f"MiB ({got[kind]['placement']})", file=sys.stderr)
            result["models"][size] = got
    base = result["models"]["tiny"]
    result["checks"] = {}
    for size in sizes:
        m = result["models"][size]
        for kind in KINDS:
            limit = m["model_bytes"] * (1 + RSS_MARGIN) + base[kind]["rss"]
            result["checks"][f"{size} {kind}"] = {"rss": m[kind]["rss"], "limit": limit, "ok": m[kind]["rss"] <= limit,
                                                  "over_baseline_per_model_byte":
                                                      (m[kind]["rss"] - base[kind]["rss"]) / m["model_bytes"]}
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="small,medium")
    p.add_argument("--refits", type=int, default=3)
    p.add_argument("--rate", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--child", nargs=3, metavar=("CKPT", "KIND", "FRAMES"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(_one(*a.child)))
        return 0
    result = run(a.sizes.split(","), a.refits, a.rate, a.seed)
    for name, c in result["checks"].items():
        print(f"{name}: RSS {c['rss'] / 2**20:.0f} MiB, limit {c['limit'] / 2**20:.0f} MiB "
              f"({'met' if c['ok'] else 'UNMET'}); {c['over_baseline_per_model_byte']:.2f} bytes per model byte "
              f"over the tiny engine")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
