"""The whole run: every case, every peer on the same steps, the corruption trials, the checks, the machine.

Two passes: first every step of every case into the ``transformers`` engine (``receiver="hf"``), the AdamW
steps kept on disk; then those steps into a vLLM engine per model and kind (``receiver="vllm"``: weights packed;
``"vllm_capture"``: unpacked, the capture path), started only now because vLLM binds this process's threads when
it starts and would change every timing after it.
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass, field

from benchmarks import provenance
from benchmarks.codec.settings import _log
from benchmarks.peers.settings import PEER_ROWS, TARGETS, Settings


@dataclass
class PeerAcc:
    """One peer's measurement of a step (sums, should it hold several), and every sample."""

    wire: int = 0
    exact: bool = True
    sums: dict = field(default_factory=lambda: dict.fromkeys(
        ("sender_seconds", "sender_wall_seconds", "receiver_seconds", "receiver_wall_seconds"), 0.0))
    samples: dict = field(default_factory=lambda: {k: [] for k in (
        "sender_cpu_s", "sender_wall_s", "receiver_cpu_s", "receiver_wall_s")})
    extra: dict = field(default_factory=dict)

    def add(self, m: dict) -> None:
        """Add one step's measurement (wire bytes, sender and receiver ``Timed``, bit-exactness)."""
        self.wire += m["wire_bytes"]
        self.exact &= bool(m["bit_exact"])
        for side in ("sender", "receiver"):
            t = m[side]
            self.sums[f"{side}_seconds"] += t.best_cpu
            self.sums[f"{side}_wall_seconds"] += t.best
            self.samples[f"{side}_cpu_s"].append([round(x, 6) for x in t.cpu])
            self.samples[f"{side}_wall_s"].append([round(x, 6) for x in t.wall])
        if "files" in m:  # SkyRL: the files of each step's first version, and its reload's share of the receiver
            self.extra.setdefault("files_per_step", []).append(m["files"])
            self.samples.setdefault("reload_cpu_s", []).append(m["reload_cpu_s"])

    def row(self, peer, corrupt: dict | None) -> dict:
        return {"peer": peer.name, "peer_code": peer.peer_code, "note": peer.note, "wire_bytes": self.wire,
                **self.sums, "bit_exact": self.exact, "corrupt": corrupt, "samples": self.samples, **self.extra}


def _data_fields(case, k, codec_case: dict) -> dict:
    """What every row of a step shares: the data, the optimizer step, its changes and bounds (codec bench's)."""
    n = max(codec_case["changed"], 1)
    return {"data": case.name, "source": case.source, **case.info, "step": k, "steps": 1,
            "elements": codec_case["elements"], "canonical_bytes": codec_case["canonical_bytes"],
            "changed": codec_case["changed"], "change_rate": codec_case["change_rate"],
            "bound_bytes_per_change": codec_case["per_tensor_bound_bytes"] / n,
            "class_bound_bytes_per_change": codec_case["class_bound_bytes"] / n}


def _ratios(rows: list[dict]) -> None:
    """Each row's wire bytes and receiver seconds over SkyRL's (same step, same receiver)."""
    sky = next(r for r in rows if r["peer"] == "skyrl")
    for r in rows:
        r["bytes_per_change"] = r["wire_bytes"] / max(r["changed"], 1)
        r["wire_over_skyrl"] = r["wire_bytes"] / sky["wire_bytes"] if sky["wire_bytes"] else None
        ok = r["receiver_seconds"] is not None and sky["receiver_seconds"]
        r["receiver_over_skyrl"] = r["receiver_seconds"] / sky["receiver_seconds"] if ok else None


def run_step(case, k, step, s: Settings, sky, msg_peers, engine, last: bool) -> tuple[dict, list[dict]]:
    """Every peer on one step into the ``transformers`` engine; the codec bench's case and the rows (table
    order). The corruption trials run on the case's ``last`` step."""
    from benchmarks.codec.default import library_default
    from benchmarks.codec.measure import Acc, case_result, measure_step
    from benchmarks.peers import dcr

    acc, accs, corrupt = Acc(), {p.name: PeerAcc() for p in (*msg_peers, sky)}, {}
    sky.start(f"{case.name}-{k}", step, engine)  # its base checkpoint: the step's committed bits
    _log(f"  step {k}: dcr_ray (codec bench, both codings)")
    measure_step(step, acc, s.repeats, "plain")
    received = dcr.receive_into_params(step, engine, s.repeats)
    for p in msg_peers:
        _log(f"  step {k}: {p.name}")
        m = p.measure(step, engine, s.repeats)
        accs[p.name].add(m)
        if last:
            corrupt[p.name] = p.corruption(step, engine, m["message"])
        del m
    _log(f"  step {k}: skyrl ({sky.peer_code})")
    accs[sky.name].add(sky.measure(step, s.repeats))
    if last:
        _log("  corruption trials: skyrl, dcr_ray")
        corrupt[sky.name] = sky.corruption(step)
        corrupt["dcr"] = {c: dcr.corruption(step, c) for c in ("plain", "context")}
    sky.close()
    codec_case = case_result(case.name, case.source, acc, step_change_rates=acc.rates)
    codec_case.update(library_default(codec_case, s.link_mbps))
    rows = dcr.rows(codec_case, acc, corrupt.get("dcr"), received) + [
        accs[p.name].row(p, corrupt.get(p.name)) for p in (sky, *msg_peers)]
    shared = _data_fields(case, k, codec_case)
    for r in rows:
        r.update(shared, receiver="hf")
    _ratios(rows)
    order = [p for p, _ in PEER_ROWS]
    rows.sort(key=lambda r: order.index(r["peer"]))
    return codec_case, rows


def _save_step(step, path: str) -> None:
    from safetensors.torch import save_file

    from benchmarks.peers.vllm_receivers import versions

    v = versions(step)
    save_file({f"{side}/{n}": t.contiguous() for side, ts in v.items() for n, t in ts.items()}, path)


def _load_step(path: str):
    from safetensors.torch import load_file

    from benchmarks.codec.measure import Step
    from dcr_ray.codec import bits_view

    got = load_file(path)
    old = {n[4:]: bits_view(t).copy() for n, t in got.items() if n.startswith("old/")}
    return Step(old=old, new={n[4:]: t for n, t in got.items() if n.startswith("new/")})


def vllm_rows(pending: list, s: Settings, code, workdir: str) -> tuple[list[dict], dict]:
    """Pass 2: every saved AdamW step received by dcr_ray, SkyRL and ``sparse_nccl`` inside a vLLM engine of
    its model, of each vLLM receiver kind asked for (:mod:`.vllm_receivers`); the rows copy the ``hf`` rows'
    bytes and senders. Also returns each engine's placement and quiet decoding throughput."""
    from benchmarks.peers import vllm_receivers as vr

    out, engines = [], {}
    kinds = [k for k in ("vllm", "vllm_capture") if k in s.receivers]
    for size in dict.fromkeys(p["model"] for p in pending):
        for kind in kinds:
            _log(f"{kind} receivers: starting a vLLM engine of the {size} model")
            engine = vr.VllmEngine(size, s.seed, workdir, kind)
            try:
                engines[f"{kind}/{size}"] = {"model": size, "receiver": kind, "placement": engine.placement,
                                             "serving": engine.tokens_per_s()}
                for p in (p for p in pending if p["model"] == size):
                    out += _vllm_step(engine, p, s, code, workdir, kind)
            finally:
                engine.close()
        for p in (p for p in pending if p["model"] == size):
            os.remove(p["path"])
    return out, engines


def _vllm_step(engine, p: dict, s: Settings, code, workdir: str, kind: str) -> list[dict]:
    """One saved step on one vLLM engine: every receiver's rows."""
    from benchmarks.peers import vllm_receivers as vr

    step = _load_step(p["path"])
    vers = vr.versions(step)
    fps = engine.fingerprints(vers)
    hf = {r["peer"]: r for r in p["rows"]}
    got = {}
    for coding in ("plain", "context"):
        _log(f"  {p['data']} step {p['step']}: dcr_ray {coding} on {kind}")
        got[coding] = vr.dcr(engine, step, vers, fps, coding, s.repeats)
    _log(f"  {p['data']} step {p['step']}: skyrl, vllm_sparse_nccl on {kind}")
    got["skyrl"] = vr.skyrl(engine, code, vers, fps, s.repeats, workdir)
    got["vllm_sparse_nccl"] = vr.sparse(engine, step, vers, fps, s.repeats)
    rows = []
    for peer in ("dcr_default", "dcr_plain", "dcr_class_order", "skyrl", "vllm_sparse_nccl"):
        m = got[hf[peer]["coding"]] if peer.startswith("dcr") else got[peer]
        t = m["receiver"]
        rows.append({**hf[peer], "receiver": kind, "receiver_seconds": t.best_cpu if t.cpu else None,
                     "receiver_wall_seconds": t.best if t.wall else None, "bit_exact": m["bit_exact"],
                     "error": m["error"], "corrupt": None,
                     "samples": {**hf[peer]["samples"], "receiver_cpu_s": [round(x, 6) for x in t.cpu],
                                 "receiver_wall_s": [round(x, 6) for x in t.wall]}})
    _ratios(rows)
    return rows


def run(s: Settings, workdir: str | None = None, skyrl_own: bool = True) -> dict:
    """Run every case; returns the JSON-able result."""
    import numpy as np
    import torch
    import zstandard

    from benchmarks.peers import skyrl_code
    from benchmarks.peers.data import cases
    from benchmarks.peers.engine import Engine
    from benchmarks.peers.message_peers import message_peers
    from benchmarks.peers.report import checks
    from benchmarks.peers.skyrl_peer import SkyrlPeer

    t_start, load0 = time.perf_counter(), provenance.loadavg()
    code = skyrl_code.load(prefer_own=skyrl_own)
    _log(f"dcr-ray bench peers ({s.mode}): skyrl peer_code={code.peer_code}: {code.note}")
    tmp = workdir or tempfile.mkdtemp(prefix="dcr-bench-peers-")
    sky, msg_peers = SkyrlPeer(code, tmp), message_peers()
    rows, data, pending = [], [], []
    try:
        for case in cases(s):
            _log(f"case {case.name}")
            engine = Engine(case.engine())
            for i, (k, step) in enumerate(case.steps()):
                codec_case, step_rows = run_step(case, k, step, s, sky, msg_peers, engine, i == case.n_steps - 1)
                rows += step_rows
                data.append({"step": k, **{x: codec_case[x] for x in (
                    "name", "source", "change_rate", "elements", "changed", "canonical_bytes",
                    "per_tensor_bound_bytes", "class_bound_bytes", "entropy_bound_bytes", "frames", "default_coding",
                    "default_reason", "step_change_rates")}})
                _log("  " + ", ".join(f"{r['peer']} {r['bytes_per_change']:.2f} B/chg {r['receiver_seconds']:.3f}s"
                                      for r in step_rows))
                if any(r.startswith("vllm") for r in s.receivers) and case.source == "adamw":
                    path = os.path.join(tmp, f"step-{case.name}-{k}.safetensors")
                    _save_step(step, path)
                    pending.append({"model": case.info["model"], "data": case.name, "step": k, "path": path,
                                    "rows": step_rows})
                del step
            del engine
        if "hf" not in s.receivers:
            rows = []
        vllm, engines = vllm_rows(pending, s, code, tmp)
        rows += vllm
    finally:
        if workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "bench": "peers", "git": provenance.git_commit(), "mode": s.mode, "quick": s.quick,
        "skyrl": {"peer_code": code.peer_code, "note": code.note, "version": skyrl_code.VERSION,
                  "install": skyrl_code.INSTALL},
        "peers": dict(PEER_ROWS), "cases": rows, "data": data, "vllm_engines": engines, "targets": TARGETS,
        "checks": checks(rows),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "numpy": np.__version__, "torch": torch.__version__, "zstandard": zstandard.__version__,
                    "loadavg_start": load0, "loadavg_end": provenance.loadavg()},
        "settings": {"mode": s.mode, "seed": s.seed, "repeats": s.repeats, "models": list(s.models),
                     "lrs": list(s.lrs), "steps": list(s.steps), "batch": list(s.batch),
                     "stress_rates": list(s.stress_rates), "stress_elems": s.stress_elems, "link_mbps": s.link_mbps,
                     "receivers": list(s.receivers)},
    }
    result["elapsed_s"] = time.perf_counter() - t_start
    _log(f"finished in {result['elapsed_s']:.1f}s")
    return result
