"""The whole run: every case, every peer on the same steps, the corruption trials, the checks, the machine."""

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
    """One peer's sums over the steps of a case, and every sample."""

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

    def row(self, peer, corrupt: dict) -> dict:
        return {"peer": peer.name, "peer_code": peer.peer_code, "note": peer.note, "wire_bytes": self.wire,
                **self.sums, "bit_exact": self.exact, "corrupt": corrupt, "samples": self.samples, **self.extra}


def _data_fields(case, codec_case: dict) -> dict:
    """What every row of a case shares: the data, its changes and its bounds (from the codec bench)."""
    n = max(codec_case["changed"], 1)
    return {"data": case.name, "source": case.source, **case.info, "steps": case.n_steps,
            "elements": codec_case["elements"], "canonical_bytes": codec_case["canonical_bytes"],
            "changed": codec_case["changed"], "change_rate": codec_case["change_rate"],
            "bound_bytes_per_change": codec_case["per_tensor_bound_bytes"] / n,
            "class_bound_bytes_per_change": codec_case["class_bound_bytes"] / n}


def run_case(case, s: Settings, sky, msg_peers) -> tuple[dict, list[dict]]:
    """Every peer on every step of ``case``; the codec bench's case and the rows, in table order."""
    from benchmarks.codec.default import library_default
    from benchmarks.codec.measure import Acc, case_result, measure_step
    from benchmarks.peers import dcr
    from benchmarks.peers.engine import Engine

    engine = Engine(case.engine())
    acc, accs, corrupt = Acc(), {p.name: PeerAcc() for p in (*msg_peers, sky)}, {}
    for i, step in enumerate(case.steps()):
        if i == 0:
            sky.start(case.name, step, engine)
        _log(f"  step {i + 1}/{case.n_steps}: dcr_ray (codec bench, both codings)")
        measure_step(step, acc, s.repeats, "plain")
        last = i == case.n_steps - 1
        for p in msg_peers:
            _log(f"  step {i + 1}/{case.n_steps}: {p.name}")
            m = p.measure(step, engine, s.repeats)
            accs[p.name].add(m)
            if last:
                corrupt[p.name] = p.corruption(step, engine, m["message"])
            del m
        _log(f"  step {i + 1}/{case.n_steps}: skyrl ({sky.peer_code})")
        accs[sky.name].add(sky.measure(step, s.repeats))
        if last:
            _log("  corruption trials: skyrl, dcr_ray")
            corrupt[sky.name] = sky.corruption(step)
            corrupt["dcr"] = {c: dcr.corruption(step, c) for c in ("plain", "context")}
        del step
    sky.close()
    codec_case = case_result(case.name, case.source, acc, step_change_rates=acc.rates)
    codec_case.update(library_default(codec_case, s.link_mbps))
    rows = dcr.rows(codec_case, acc, corrupt["dcr"]) + [accs[p.name].row(p, corrupt[p.name]) for p in (sky, *msg_peers)]
    shared = _data_fields(case, codec_case)
    sky_row = next(r for r in rows if r["peer"] == "skyrl")
    for r in rows:
        r.update(shared)
        r["bytes_per_change"] = r["wire_bytes"] / max(r["changed"], 1)
        r["wire_over_skyrl"] = r["wire_bytes"] / sky_row["wire_bytes"] if sky_row["wire_bytes"] else None
        r["receiver_over_skyrl"] = r["receiver_seconds"] / sky_row["receiver_seconds"]
    order = [p for p, _ in PEER_ROWS]
    rows.sort(key=lambda r: order.index(r["peer"]))
    return codec_case, rows


def run(s: Settings, workdir: str | None = None, skyrl_own: bool = True) -> dict:
    """Run every case; returns the JSON-able result."""
    import numpy as np
    import torch
    import zstandard

    from benchmarks.peers import skyrl_code
    from benchmarks.peers.data import cases
    from benchmarks.peers.message_peers import message_peers
    from benchmarks.peers.report import checks
    from benchmarks.peers.skyrl_peer import SkyrlPeer

    t_start, load0 = time.perf_counter(), provenance.loadavg()
    code = skyrl_code.load(prefer_own=skyrl_own)
    _log(f"dcr-ray bench peers ({s.mode}): skyrl peer_code={code.peer_code}: {code.note}")
    tmp = workdir or tempfile.mkdtemp(prefix="dcr-bench-peers-")
    sky, msg_peers = SkyrlPeer(code, tmp), message_peers()
    rows, data = [], []
    try:
        for case in cases(s):
            _log(f"case {case.name}")
            codec_case, case_rows = run_case(case, s, sky, msg_peers)
            rows += case_rows
            data.append({k: codec_case[k] for k in (
                "name", "source", "change_rate", "elements", "changed", "canonical_bytes", "per_tensor_bound_bytes",
                "class_bound_bytes", "entropy_bound_bytes", "frames", "default_coding", "default_reason",
                "step_change_rates")})
            _log("  " + ", ".join(f"{r['peer']} {r['bytes_per_change']:.2f} B/chg {r['receiver_seconds']:.3f}s"
                                  for r in case_rows))
    finally:
        if workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "bench": "peers", "git": provenance.git_commit(), "mode": s.mode, "quick": s.quick,
        "skyrl": {"peer_code": code.peer_code, "note": code.note, "version": skyrl_code.VERSION,
                  "install": skyrl_code.INSTALL},
        "peers": dict(PEER_ROWS), "cases": rows, "data": data, "targets": TARGETS, "checks": checks(rows),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "numpy": np.__version__, "torch": torch.__version__, "zstandard": zstandard.__version__,
                    "loadavg_start": load0, "loadavg_end": provenance.loadavg()},
        "settings": {"mode": s.mode, "seed": s.seed, "repeats": s.repeats, "models": list(s.models),
                     "lrs": list(s.lrs), "warm_steps": s.warm_steps, "steps": s.steps, "batch": list(s.batch),
                     "stress_rates": list(s.stress_rates), "stress_elems": s.stress_elems, "link_mbps": s.link_mbps},
    }
    result["elapsed_s"] = time.perf_counter() - t_start
    _log(f"finished in {result['elapsed_s']:.1f}s")
    return result
