"""CPU seconds per role of the benchmark's relay refit: medians over several refits, per bucket size.

The stress topology of ``dcr-ray bench refit`` (two synthetic owners of ``--size``'s canonical tensors, a
head relay behind an emulated ``--link-mbps`` link, ``--engines`` light engines with their undo record),
one warm-up refit, then ``--refits`` refits each changing ``--rate`` of the elements. Per refit: the
process CPU seconds of every owner, relay and engine (the report's ``cpu_seconds``) and the refit's wall
seconds, printed as medians per role (sum over its actors) and for its slowest actor; CPU seconds, not
wall seconds, are what to compare on a loaded machine. Beside them, to find where the CPU goes: each
engine's thread CPU seconds in its payload path (validate-and-apply, and its open / decode / apply; the
codec threads' share is outside these), the garbage collector's collections and CPU seconds in every
actor, and with ``--threads`` the CPU seconds of every actor thread (``/proc``, from just before the
refit until every owner's promote is done; ``Dummy`` threads run Ray calls, ``dcr-codec`` the codec
pool, ``native`` Ray's own threads).

``--bucket-mib default,4,8`` measures each bucket size on a topology of its own (diff chunk = bucket / 8,
as ``--bucket-mib`` of the benchmark; ``default``: the library's ``CodecConfig``); ``--py-spy DIR``
records one extra refit per topology with py-spy (every actor process; samples of running threads, so
on a loaded machine they follow wall time more than CPU time) into ``DIR/<bucket>-<actor>.txt``.

    python -m benchmarks.tools.refit_cpu --size large --refits 7 [--bucket-mib default,4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time


ROLES = ("owners", "relays", "engines")


def _settings(size: str, link_mbps: float, engines: int, bucket_mib):
    from benchmarks.refit.settings import Settings

    return Settings(quick=False, size=size, link_mbps=link_mbps, latency_s=0.025, engines=engines, owners=2,
                    rates=(0.03,), transports=("relay",), real_steps=0, real_lr=0.0,
                    bucket_bytes=None if bucket_mib is None else int(bucket_mib * (1 << 20)), seed=0,
                    sweep=False, reference_check=False)


def _pids(topo) -> dict:
    import ray

    from benchmarks.refit.actors import actor_pid

    pids = {f"owner:{k}": p for k, p in zip(topo.owners, topo.owner_pids)}
    pids.update({f"engine:{k}": p for k, p in topo.engine_pid_of.items()})
    for i, h in enumerate(topo.heads):
        pids[f"relay:head{i}"] = ray.get(h.__ray_call__.remote(actor_pid))
    return pids


def _stat_fields(path: str) -> list[str] | None:
    """The fields of a ``/proc/.../stat`` file after the command name (``[7]`` minor faults, ``[11]`` user
    and ``[12]`` system clock ticks), or None when it is gone."""
    try:
        with open(path) as f:
            st = f.read()
    except OSError:
        return None
    return st[st.rindex(")") + 2:].split()


def _thread_ticks(pids: dict) -> dict:
    """``{(actor, thread id): CPU clock ticks so far}`` of every thread of the actors' processes."""
    out: dict = {}
    for actor, pid in pids.items():
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
            if fields is None:
                continue
            key = (actor, tid)
            out[key] = out.get(key, 0) + int(fields[11]) + int(fields[12])  # utime + stime
    return out


def _proc_counters(pids: dict) -> dict:
    """``{actor: (minor page faults, system clock ticks)}`` of each actor's process so far."""
    out = {}
    for actor, pid in pids.items():
        fields = _stat_fields(f"/proc/{pid}/stat")
        if fields is not None:
            out[actor] = (int(fields[7]), int(fields[12]))
    return out


def _py_threads(_actor=None) -> dict:
    """Native thread id -> Python thread name, in an actor (its codec threads, Ray's Python threads)."""
    import threading

    return {str(t.native_id): t.name.rstrip("0123456789_") or t.name for t in threading.enumerate()}


def _gc_watch(_actor=None) -> dict:
    """Install (once) a garbage-collector callback in an actor that adds up each collection's CPU seconds
    per generation; returns the totals so far and the objects the collector tracks now."""
    import gc
    import time as _t

    st = getattr(gc, "_dcr_bench_gc", None)
    if st is None:
        st = gc._dcr_bench_gc = {"s": [0.0, 0.0, 0.0], "n": [0, 0, 0], "t0": 0.0}

        def cb(phase, info):
            if phase == "start":
                st["t0"] = _t.thread_time()
            else:
                g = info["generation"]
                st["s"][g] += _t.thread_time() - st["t0"]
                st["n"][g] += 1

        gc.callbacks.append(cb)
    return {"s": list(st["s"]), "n": list(st["n"]), "objects": len(gc.get_objects())}


def _gc_all(handles) -> dict:
    import ray

    return dict(zip(handles, ray.get([h.__ray_call__.remote(_gc_watch) for h in handles.values()])))


def _handles(topo) -> dict:
    handles = {f"owner:{k}": h for k, h in topo.owners.items()}
    handles.update({f"engine:{k}": h for k, h in topo.engines.items()})
    handles.update({f"relay:head{i}": h for i, h in enumerate(topo.heads)})
    return handles


def _thread_names(topo, pids) -> dict:
    import ray

    handles = {f"owner:{k}": h for k, h in topo.owners.items()}
    handles.update({f"engine:{k}": h for k, h in topo.engines.items()})
    handles.update({f"relay:head{i}": h for i, h in enumerate(topo.heads)})
    out = {}
    for a, names in zip(handles, ray.get([h.__ray_call__.remote(_py_threads) for h in handles.values()])):
        out.update({(a, tid): n for tid, n in names.items()})
    return out


def _one(topo, perturb, rate, pids=None) -> dict:
    import ray

    perturb(rate)
    ray.get([h.bench_before_refit.remote() for h in topo.owners.values()])
    t0 = _thread_ticks(pids) if pids else {}
    c0 = _proc_counters(pids) if pids else {}
    g0 = _gc_all(_handles(topo))
    e0 = ray.get([h.cpu_parts.remote() for h in topo.engines.values()])
    rep = topo.refit.run()
    ray.get([h.dcr_version.remote() for h in topo.owners.values()])  # every background promote done
    g1 = _gc_all(_handles(topo))
    e1 = ray.get([h.cpu_parts.remote() for h in topo.engines.values()])
    parts = {e: {k: b[k] - a[k] for k in a} for e, a, b in zip(topo.engines, e0, e1)}
    gcs = {a: {"s": [y - x for x, y in zip(g0[a]["s"], g1[a]["s"])], "n": [y - x for x, y in zip(g0[a]["n"], g1[a]["n"])],
               "objects": g1[a]["objects"]} for a in g1}
    threads, kernel = {}, {}
    if pids:
        hz = os.sysconf("SC_CLK_TCK")
        c1 = _proc_counters(pids)
        kernel = {a: {"minor_faults": c1[a][0] - c0[a][0], "sys_s": (c1[a][1] - c0[a][1]) / hz}
                  for a in c1 if a in c0}
        t1 = _thread_ticks(pids)
        names = _thread_names(topo, pids)
        threads = {}
        for (a, tid), v in t1.items():
            if v > t0.get((a, tid), 0):
                k = f"{a}|{names.get((a, tid), 'native')}"
                threads[k] = threads.get(k, 0.0) + (v - t0.get((a, tid), 0)) / hz
    cpu = rep.cpu_seconds
    return {"wall_s": rep.seconds["total"], "payloads": rep.payloads, "changed": rep.changed,
            "wire_bytes": rep.wire_bytes,
            "role": {r: sum(cpu.get(r, {}).values()) for r in ROLES},
            "slowest": {r: max(cpu.get(r, {}).values(), default=0.0) for r in ROLES},
            "cpu_seconds": cpu, "threads": threads, "gc": gcs, "engine_parts": parts, "kernel": kernel}


def measure(size, link_mbps, engines, bucket_mib, refits, rate, spy_dir) -> dict:
    import ray

    from benchmarks.refit.measure import check_exact
    from benchmarks.refit.topology import launch_stress

    topo = launch_stress(_settings(size, link_mbps, engines, bucket_mib), "relay")
    seed = [100]

    def perturb(r):
        seed[0] += 1
        ray.get([h.perturb.remote(r, seed[0]) for h in topo.owners.values()])

    try:
        _one(topo, perturb, 0.01)  # warm-up: the engines' first apply compiles their kernels
        pids = _pids(topo)
        runs = [_one(topo, perturb, rate, pids) for _ in range(refits)]
        exact = check_exact(topo)
        if spy_dir:
            _spy(topo, perturb, rate, spy_dir, f"{bucket_mib or 'default'}")
    finally:
        topo.shutdown()
    med = {k: {r: statistics.median(x[k][r] for x in runs) for r in ROLES} for k in ("role", "slowest")}
    return {"bucket_mib": bucket_mib, "runs": runs, "median_role_cpu_s": med["role"],
            "median_slowest_cpu_s": med["slowest"],
            "median_total_cpu_s": statistics.median(sum(x["role"].values()) for x in runs),
            "min_role_cpu_s": {r: min(x["role"][r] for x in runs) for r in ROLES},
            "median_wall_s": statistics.median(x["wall_s"] for x in runs),
            "median_thread_cpu_s": {k: statistics.median(x["threads"].get(k, 0.0) for x in runs)
                                    for k in sorted({k for x in runs for k in x["threads"]})},
            "payloads": runs[0]["payloads"], "changed": runs[0]["changed"], "bit_exact": exact}


def _spy(topo, perturb, rate, out_dir, tag) -> None:
    """One refit recorded by py-spy in every actor process (collapsed stacks, idle frames left out)."""
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    os.makedirs(out_dir, exist_ok=True)
    procs = []
    for name, pid in _pids(topo).items():
        path = os.path.join(out_dir, f"{tag}-{name.replace(':', '-').replace('/', '-')}.txt")
        procs.append(subprocess.Popen([exe, "record", "--pid", str(pid), "--format", "raw", "--rate", "250",
                                       "--threads", "--output", path, "--nonblocking"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(2.0)  # py-spy attached
    _one(topo, perturb, rate)
    time.sleep(0.5)
    for p in procs:
        p.send_signal(signal.SIGINT)
    for p in procs:
        p.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="large")
    ap.add_argument("--refits", type=int, default=5)
    ap.add_argument("--rate", type=float, default=0.03)
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--link-mbps", type=float, default=1000.0)
    ap.add_argument("--bucket-mib", default=None, help="comma-separated MiB, 'default' for the library's (default: the library's bucket)")
    ap.add_argument("--py-spy", default=None, metavar="DIR", help="record one more refit per topology with py-spy")
    ap.add_argument("--threads", action="store_true", help="print each actor thread's median CPU seconds")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from benchmarks.refit.runner import _init_ray

    _init_ray()
    buckets = [None] if a.bucket_mib is None else [None if x == "default" else float(x) for x in a.bucket_mib.split(",")]
    out = []
    for b in buckets:
        r = measure(a.size, a.link_mbps, a.engines, b, a.refits, a.rate, a.py_spy)
        out.append(r)
        role, slow = r["median_role_cpu_s"], r["median_slowest_cpu_s"]
        print(f"bucket {b or 'default'} MiB: {r['payloads']} payloads, {r['changed']} changes, medians of "
              f"{a.refits}: wall {r['median_wall_s']:.3f} s, CPU total {r['median_total_cpu_s']:.3f} s; "
              + ", ".join(f"{k} {role[k]:.3f} (slowest {slow[k]:.3f})" for k in ROLES)
              + f"; bit-exact {r['bit_exact']}", flush=True)
        print("  per refit (wall; owners, relays, engines CPU s): " + "; ".join(
            f"{x['wall_s']:.2f}: " + "/".join(f"{x['role'][k]:.2f}" for k in ROLES) for x in r["runs"]), flush=True)
        print("  kernel per refit (actor: minor page faults in thousands / system CPU s): " + "; ".join(
            f"{k}: " + ",".join(f"{x['kernel'][k]['minor_faults'] / 1e3:.0f}k/{x['kernel'][k]['sys_s']:.2f}"
                                for x in r["runs"]) for k in r["runs"][0]["kernel"]), flush=True)
        print("  garbage collector per refit (actor: gen2 collections, CPU s in all collections; objects): " + "; ".join(
            f"{k}: " + ",".join(f"{x['gc'][k]['n'][2]}/{sum(x['gc'][k]['s']):.3f}" for x in r["runs"])
            + f" ({r['runs'][-1]['gc'][k]['objects']})" for k in r["runs"][0]["gc"]), flush=True)
        print("  engine payload path, thread CPU s per refit (deliver = open + decode + apply + the rest): " + "; ".join(
            f"{e}: " + ", ".join(f"{k} {statistics.median(x['engine_parts'][e][k] for x in r['runs']):.3f}"
                                 for k in ("deliver", "open", "decode", "apply", "calls"))
            for e in r["runs"][0]["engine_parts"]), flush=True)
        if a.threads:
            for k, v in sorted(r["median_thread_cpu_s"].items(), key=lambda kv: -kv[1]):
                if v >= 0.005:
                    print(f"    {k:50s} {v:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": out, "loadavg": os.getloadavg()}, f, indent=1)


if __name__ == "__main__":
    main()
