"""Timing trace of one delta refit: does an engine apply payload k while owners still build and send
later ones?

Two standalone owners (``--mib`` MiB of BF16 each, ``--rate`` of the elements changed) feed ``--engines``
engines of one cluster through the relay tree. Owners record when each frame went into the sink; each
engine's backend records when each payload's apply started and ended (with its undo record, one pass).
All stamps are ``time.perf_counter()`` (CLOCK_MONOTONIC, one clock for every process on a Linux host)
and are printed relative to the coordinator's ``prepare`` mark, beside its ``stream`` (every owner
done, drained) and ``flushed`` marks. Streaming holds when most applies end before the last send.

    python -m benchmarks.tools.trace_streaming --mib 64 --rate 0.03 [--bucket-mib 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import ray
import torch

import dcr_ray
from dcr_ray.codec import apply_decoded
from dcr_ray.codec.bits import bits_view
from dcr_ray.engines.base import TensorBackend


class TracingOwner(dcr_ray.StandaloneOwner):
    """A standalone owner that stamps every frame it hands to the sink."""

    def __init__(self, tensors):
        super().__init__(tensors)
        self.sends: list = []
        self.streams: list = []

    def dcr_stream(self, transfer, attempt, base, target, sink, base_id="", coding=None):
        owner = self
        t_in = time.perf_counter()

        class Stamped:
            def send(self, frame, key):
                t0 = time.perf_counter()
                sink.send(frame, key)
                owner.sends.append((tuple(key), t0, time.perf_counter(), len(frame)))

            def drain(self):
                sink.drain()

        out = super().dcr_stream(transfer, attempt, base, target, Stamped(), base_id=base_id, coding=coding)
        self.streams.append((t_in, time.perf_counter()))
        return out

    def trace(self):
        return self.sends

    def stream_marks(self):
        return self.streams


def _trace(engine) -> list:
    """(Run in an engine actor.) Its :class:`TracingBackend`'s apply trace."""
    return engine.backend.trace()


class TracingBackend(TensorBackend):
    """BF16 tensors applied in place like the transformers backend (undo in the same pass), stamped."""

    applies_packs = True

    def __init__(self, shapes):
        self._tensors = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()}
        self.applies: list = []

    def tensors(self):
        return self._tensors

    def undo_tensors(self):
        return self._tensors

    def apply(self, frame):
        t0 = time.perf_counter()
        apply_decoded(frame, self._tensors)
        self.applies.append((tuple(frame.meta.key), t0, time.perf_counter(), "apply"))

    def apply_with_undo(self, frame, undo):
        t0 = time.perf_counter()
        apply_decoded(frame, self._tensors, undo=undo)
        self.applies.append((tuple(frame.meta.key), t0, time.perf_counter(), "apply_with_undo"))

    def flush(self):
        self.applies.append((None, time.perf_counter(), time.perf_counter(), "flush"))

    def load_dense(self, tensors):
        for name, t in tensors:
            bits_view(self._tensors[name])[:] = bits_view(t.contiguous())

    def trace(self):
        return self.applies


class TracingEngine:
    def __init__(self, shapes):
        self.shapes = shapes

    def __call__(self):
        return TracingBackend(self.shapes)


def tensors_of(owner: int, mib: int, n: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    per = (mib << 20) // 2 // n
    return {f"o{owner}.layers.{i}.weight": (torch.randn(per, generator=g) * 0.02).to(torch.bfloat16) for i in range(n)}


def changed(ts: dict, rate: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for name, t in ts.items():
        w = t.clone()
        b = bits_view(w)
        pos = rng.choice(len(b), int(len(b) * rate), replace=False)
        b[pos] = (b[pos].astype(np.int64) + rng.choice([-2, -1, 1, 2], len(pos))).astype(np.uint16)
        out[name] = w
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="MiB of BF16 per owner")
    ap.add_argument("--tensors", type=int, default=16, help="tensors per owner")
    ap.add_argument("--rate", type=float, default=0.03)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--refits", type=int, default=2)
    ap.add_argument("--bucket-mib", type=float, default=None, help="payload bucket (default: the library's)")
    a = ap.parse_args()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    if a.bucket_mib is None:
        codec = dcr_ray.CodecConfig(coding="plain")
    else:
        bucket = int(a.bucket_mib * (1 << 20))
        codec = dcr_ray.CodecConfig(coding="plain", bucket_bytes=bucket, chunk_elems=min(1 << 20, bucket // 8))
    ts = [tensors_of(o, a.mib, a.tensors, seed=o) for o in range(2)]
    shapes = {n: tuple(t.shape) for d in ts for n, t in d.items()}
    owners = [ray.remote(num_cpus=0)(TracingOwner).remote(d) for d in ts]
    refit = dcr_ray.launch(owners=owners, clusters=[dcr_ray.ClusterSpec(name="a", engines=a.engines)],
                           engine=TracingEngine(shapes), config=dcr_ray.RefitConfig(codec=codec))
    try:
        for r in range(a.refits):
            ts = [changed(d, a.rate, seed=100 * r + o) for o, d in enumerate(ts)]
            ray.get([o.set_tensors.remote(d) for o, d in zip(owners, ts)])
            n_sends = [len(ray.get(o.trace.remote())) for o in owners]
            n_applies = {e: len(ray.get(h.__ray_call__.remote(_trace))) for e, h in refit.engines().items()}
            report = refit.run()
            streams = [ray.get(o.stream_marks.remote())[-1] for o in owners]
            p = min(t for t, _ in streams)  # the first owner's stream call began
            print(f"\nrefit v{report.version}: {report.payloads} payloads, {report.changed} changes, wall "
                  f"{report.seconds['total']:.3f} s (construct {report.seconds['construct']:.3f}, stream "
                  f"{report.seconds['stream']:.3f}, apply {report.seconds['apply']:.3f}); times in s after the "
                  f"first owner's stream call began")
            for o, (t0, t1) in zip(owners, streams):
                mine = [s for s in ray.get(o.trace.remote()) if t0 <= s[1] <= t1]
                print(f"  owner: stream call {t0 - p:.3f} .. {t1 - p:.3f}; {len(mine)} frames sent, first "
                      f"{min(s[1] for s in mine) - p:.3f}, last {max(s[2] for s in mine) - p:.3f}")
            sends = [s for o, k in zip(owners, n_sends) for s in ray.get(o.trace.remote())[k:]]
            last_send = max(s[2] for s in sends)
            for e, h in refit.engines().items():
                got = ray.get(h.__ray_call__.remote(_trace))[n_applies[e]:]
                fl = [x for x in got if x[3] == "flush"]
                ap_ = [x for x in got if x[3] != "flush"]
                before = sum(1 for x in ap_ if x[2] <= last_send)
                kinds = sorted({x[3] for x in ap_})
                busy = sum(x[2] - x[1] for x in ap_)
                print(f"  {e}: {len(ap_)} applies ({', '.join(kinds)}) from {min(x[1] for x in ap_) - p:.3f} to "
                      f"{max(x[2] for x in ap_) - p:.3f}, {busy:.3f} s busy; {before} of {len(ap_)} ended "
                      f"before the owners' last send ({last_send - p:.3f}); backend flush at "
                      f"{fl[-1][1] - p:.3f}" if fl else "")
                order = sorted(ap_, key=lambda x: x[1])
                for key, t0, t1, _ in order[:3] + order[-2:]:
                    print(f"    {key[2]}/{key[3]:<4} applied {t0 - p:7.3f} .. {t1 - p:7.3f}")
            cpu = report.cpu_seconds
            print("  CPU seconds per role: " + ", ".join(
                f"{role} {sum(v.values()):.3f} (slowest {max(v.values()):.3f})" for role, v in cpu.items() if v))
    finally:
        refit.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
