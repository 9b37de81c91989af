"""One point of the sweep: launch its topology, refit it, and read every role's time, CPU, memory, the object
store and the links; then take it down and wait until its processes are gone.

The topology is the refit benchmark's stress topology (:mod:`benchmarks.refit.topology`) widened to several
clusters: two synthetic owners (:class:`~benchmarks.scale.actors.ScaleOwner`) of the point's model, ``clusters``
clusters of ``engines`` light engines (:class:`~benchmarks.scale.probes.ScaleEngine`), each cluster behind a
relay tree (``ClusterSpec.fanout`` children per relay, the library's default) whose head counts the bytes
crossing its boundary (:class:`~dcr_ray.testing.links.EmulatedLinks`, no delay unless ``link_mbps``). Codec and
commit settings are the library's defaults (16 MiB buckets).

Per measured refit (after the warm-ups), each owner changes a uniform 1% of its elements
(``BenchOwner.perturb``), then around ``refit.run()`` and the wait for every owner's background promote:

- wall seconds: the coordinator's ``total`` (the call's arrival to activate) and the driver's;
- CPU seconds of every owner, relay, engine and the coordinator process, and of Ray's raylet + GCS (``ray``),
  user + system from ``/proc`` (psutil), before and after;
- memory: every role process's RSS sampled every 20 ms (``MemorySampler``) with ``VmHWM`` reset through
  ``clear_refs`` before the refit; *above start* is the peak minus the RSS at the process's start
  (:mod:`.probes`), *added by the refit* the peak minus the RSS as the refit began; ``launch_hwm`` is each
  process's ``VmHWM`` read once the topology is up (its build and the dense bootstrap, before any reset);
- object store: bytes in use sampled every 100 ms (peak, and peak above the level before the refit) and bytes
  created during the refit (Ray's cumulative counter);
- links: bytes into each cluster across its boundary (the head relay's emulated link), into each relay, and
  the payload bytes each engine received.

A point's figures are the median over its measured refits (time, CPU, bytes) and the largest (memory);
``derived_streamed_s`` (derived, not measured) is the busiest actor's CPU seconds: what a refit would take
with a core per actor and its stages streaming, where these 2 cores are shared by every actor. After the
last refit every engine's tensors are compared with the owners' by SHA-256 of their integer views.
"""

from __future__ import annotations

import math
import statistics
import threading
import time

from benchmarks.refit.progress import log
from benchmarks.scale import actors, plan, probes

#: Refits before the measured ones (the kernels are loaded before them): the first ones fault in working memory.
WARMUP_REFITS = 2
QUICK_WARMUP_REFITS = 2
MEASURED_REFITS = 3
QUICK_MEASURED_REFITS = 2
#: How long to wait for a taken-down topology's processes to exit (their memory is the next point's).
EXIT_WAIT_S = 60.0


class StoreSampler:
    """Samples Ray's object store (bytes in use) every ``interval_s`` on a thread, between ``with`` and its end."""

    def __init__(self, interval_s: float = 0.1):
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.peak = 0

    def _sample(self) -> dict:
        s = probes.store_stats()
        self.peak = max(self.peak, s["used"])
        return s

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._sample()
            except Exception:  # noqa: BLE001 - a missed sample only lowers the peak's resolution
                pass

    def __enter__(self) -> "StoreSampler":
        try:
            self.before = self._sample()
        except Exception as e:  # noqa: BLE001 - no store figures for this refit, the rest is measured
            self.before, self.error = None, f"{type(e).__name__}: {e}"
            log(f"  object-store counters unavailable: {self.error}")
            return self
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.before is None:
            self.after = None
            return
        self._stop.set()
        self._thread.join()
        self.after = self._sample()

    def figures(self) -> dict | None:
        """Bytes in use before and at the peak, created and spilled between ``with`` and its end (None when
        Ray's counters could not be read)."""
        if self.before is None:
            return None
        return {"before": self.before["used"], "peak": max(self.peak, self.after["used"]),
                "created": self.after["created"] - self.before["created"],
                "spilled": self.after["spilled"] - self.before["spilled"]}


def launch(point: plan.Point, seed: int = 0, link_mbps: float | None = None, latency_s: float = 0.0):
    """Start ``point``'s topology (owners built, dense bootstrap done); returns ``(topology, roles)``:
    :class:`benchmarks.refit.topology.Topology` and ``{role: {actor id: (pid, handle)}}``."""
    import ray

    import dcr_ray
    from benchmarks.refit.topology import Topology
    from dcr_ray.actors.owner.delta import owned_names
    from dcr_ray.config import CommitConfig, RefitConfig, TransportConfig, validate
    from dcr_ray.options import actor_options
    from dcr_ray.testing.links import EmulatedLinks

    shapes = plan.shapes(point.size)
    numel = sum(math.prod(s) for s in shapes.values())
    Owner = ray.remote(actors.ScaleOwner)
    owners, share = {}, 0
    names = list(shapes)
    for r in range(plan.OWNERS):
        mine = {n: shapes[n] for n in owned_names(names, r, plan.OWNERS)}
        share = max(share, 2 * sum(math.prod(v) for v in mine.values()))
        name = f"dcr_scale_owner{r}_{point.key.replace('/', '_')}"  # a name of its own: the last point's may linger
        owners[f"owner{r}"] = Owner.options(**actor_options("owner", name)).remote(mine, seed)
    clusters = [dcr_ray.ClusterSpec(name=f"c{i}", engines=point.engines) for i in range(point.clusters)]
    config = RefitConfig(transport=TransportConfig(kind="relay"), commit=CommitConfig(timeout_s=900.0))
    engine = probes.ScaleEngine(shapes)
    try:
        config = validate(config, clusters, owners, engine)
        refit = dcr_ray.launch(clusters=clusters, config=config, owners=owners, engine=engine,
                               transport=EmulatedLinks(config, {c.name: (None, 0.0) for c in clusters}))
    except BaseException:
        for h in owners.values():
            ray.kill(h)
        raise
    try:
        handles = ray.get(refit.actor.handles.remote())
        engines = refit.engines()
        heads = [h for rid, h in handles["relays"].items() if rid.endswith("/head")]

        def pids(hs):
            return dict(zip(hs, ray.get([h.__ray_call__.remote(probes.pid_of) for h in hs.values()])))

        op, ep, rp = pids(owners), pids(engines), pids(handles["relays"])
        cp = ray.get(refit.actor.__ray_call__.remote(probes.pid_of))
    except BaseException:  # up, but not measurable: take it down before the next point
        refit.shutdown()
        for h in owners.values():
            ray.kill(h)
        raise
    topo = Topology("stress", "relay", refit, owners, engines, heads, list(op.values()), list(ep.values()), 2 * numel,
                    numel, point.size, owner_share_bytes=share)
    topo.tensors = len(shapes)
    topo.set_link(link_mbps, latency_s)
    roles = {"owner": {k: (op[k], h) for k, h in owners.items()},
             "relay": {k: (rp[k], h) for k, h in handles["relays"].items()},
             "coordinator": {"coordinator": (cp, refit.actor)},
             "engine": {k: (ep[k], h) for k, h in engines.items()}}
    return topo, roles


def run_point(point: plan.Point, *, quick: bool, idle: dict, seed: int = 0, link_mbps: float | None = None,
              latency_s: float = 0.0) -> dict:
    """Launch, warm up, measure and take down one point; returns its record (``ok`` False with ``error`` when
    it failed: the sweep goes on)."""
    import ray

    t0 = time.perf_counter()
    out = {"key": point.key, "size": point.size, "clusters": point.clusters, "engines_per_cluster": point.engines,
           "engines": point.clusters * point.engines, "owners": plan.OWNERS, "ok": False}
    topo, roles = None, {}
    try:
        topo, roles = launch(point, seed, link_mbps, latency_s)
        out["launch_s"] = time.perf_counter() - t0
        log(f"  {point.key}: up in {out['launch_s']:.1f}s ({topo.numel / 1e6:.0f} M elements, "
            f"{len(roles['relay'])} relays)")
        start = _starts(roles, idle)
        # the peak of each process through its build and the dense bootstrap, before the refits reset it
        launch_hwm = {f"{role}/{a}": probes.hwm(pid) for role, acts in roles.items() for a, (pid, _) in acts.items()}
        children = dict(zip(roles["relay"], ray.get([h.__ray_call__.remote(probes.relay_children)
                                                     for _, h in roles["relay"].values()])))
        _ready(topo, out)
        step = [seed * 1000]

        def perturb():
            step[0] += 1
            r = ray.get([h.perturb.remote(plan.CHANGE_RATE, step[0]) for h in topo.owners.values()])
            return sum(x["changed"] for x in r)

        t_refits = time.perf_counter()
        warm = []
        for _ in range(QUICK_WARMUP_REFITS if quick else WARMUP_REFITS):
            perturb()
            warm.append(topo.refit.run().seconds["total"])
        refits = []
        for _ in range(QUICK_MEASURED_REFITS if quick else MEASURED_REFITS):
            perturb()
            refits.append(measure_refit(topo, roles))
        out.update(_summarise(refits, roles, start, children, topo, launch_hwm))
        out["loaded"] = _loaded(roles)
        out["warmup_s"] = warm
        t_check = time.perf_counter()
        out["refits_phase_s"] = t_check - t_refits  # perturbs, warm-ups and measured refits
        out["bit_exact"] = check_exact(topo)
        out["check_s"] = time.perf_counter() - t_check
        out["ok"] = out["bit_exact"]
        if not out["ok"]:
            out["error"] = "an engine's tensors differ from the owners' after the last refit"
    except Exception as e:  # noqa: BLE001 - recorded; the sweep measures the other points
        out["error"] = f"{type(e).__name__}: {e}"
        log(f"  {point.key}: FAILED: {out['error']}")
    finally:
        if topo is not None:
            t_down = time.perf_counter()
            _take_down(topo, roles)
            out["take_down_s"] = time.perf_counter() - t_down
    out["seconds"] = time.perf_counter() - t0  # the whole point: launch, refits, check, take-down
    return out


def _ready(topo, out: dict) -> None:
    """Every owner and engine with its codec kernels loaded before the first refit (a failure is noted, not
    fatal: the warm-up refits load them too, at the first refits' cost)."""
    import ray

    try:
        ray.get([h.__ray_call__.remote(probes.load_kernels)
                 for h in (*topo.owners.values(), *topo.engines.values())])
    except Exception as e:  # noqa: BLE001
        out["kernels_error"] = f"{type(e).__name__}: {e}"
        log(f"  loading the kernels up front failed ({out['kernels_error']}); the warm-up refits load them")


def _loaded(roles: dict) -> dict | None:
    """``{role: which of probes.HEAVY its processes imported}`` after the refits (None when not readable)."""
    import ray

    try:
        return {role: sorted({m for got in ray.get([h.__ray_call__.remote(probes.loaded) for _, h in acts.values()])
                              for m in got}, key=probes.HEAVY.index) for role, acts in roles.items()}
    except Exception:  # noqa: BLE001 - a diagnostic only
        return None


def measure_refit(topo, roles: dict) -> dict:
    """One refit of the owners' pending change, measured (see the module docstring)."""
    import ray

    from benchmarks.refit.memory import MemorySampler

    every = {(role, a): pid for role, acts in roles.items() for a, (pid, _) in acts.items()}
    system = probes.ray_system_pids()
    cpu0 = probes.cpu_seconds([*every.values(), *system])
    links0 = topo.link_busy()
    with StoreSampler() as store, MemorySampler(list(every.values())) as mem:
        t = time.perf_counter()
        rep = topo.refit.run()
        driver_s = time.perf_counter() - t
        ray.get([h.dcr_version.remote() for h in topo.owners.values()])  # every owner's promote done
        ready_s = time.perf_counter() - t
    cpu1 = probes.cpu_seconds([*every.values(), *system])
    links1 = topo.link_busy()
    received = dict(zip(topo.engines, ray.get([e.stats.remote() for e in topo.engines.values()])))
    relay_in = _relay_in(topo, rep.transfer)
    return {
        "refit_s": rep.seconds["total"], "driver_s": driver_s, "ready_s": ready_s, "phases": dict(rep.seconds),
        "changed": rep.changed, "numel": rep.numel, "wire_bytes": rep.wire_bytes, "payloads": rep.payloads,
        "cpu": {f"{role}/{a}": cpu1.get(pid, 0.0) - cpu0.get(pid, 0.0) for (role, a), pid in every.items()},
        "ray_cpu": sum(cpu1.get(p, 0.0) - cpu0.get(p, 0.0) for p in system),
        "peak": {f"{role}/{a}": mem.peak[pid] for (role, a), pid in every.items()},
        "before": {f"{role}/{a}": mem.start[pid] for (role, a), pid in every.items()},
        "hwm": {f"{role}/{a}": mem.hwm.get(pid, 0) for (role, a), pid in every.items()},
        "store": store.figures(),
        "boundary": {k: links1[k][1] - links0[k][1] for k in links1},
        "engine_bytes": {e: s.get("bytes", 0) for e, s in received.items()},
        "relay_in": relay_in,
    }


def check_exact(topo) -> bool:
    """Every engine's SHA-256 of every tensor's integer view equals the owners' (:mod:`.probes`)."""
    import ray

    want = {}
    for d in ray.get([h.bench_digests.remote() for h in topo.owners.values()]):
        want.update(d)
    got = ray.get([e.__ray_call__.remote(probes.engine_digests) for e in topo.engines.values()])
    return bool(want) and all(g == want for g in got)


def _relay_in(topo, transfer: str) -> dict:
    """Bytes of ``transfer`` that entered each relay (heads: across the cluster boundary)."""
    import ray

    return {s["relay"]: s["bytes_in"].get(transfer, 0) for s in ray.get(topo.refit.actor.relay_stats.remote())}


def _starts(roles: dict, idle: dict) -> dict:
    """``{"role/actor": RSS at start}``: owners and engines as they noted it, relays and the coordinator an idle
    worker's (:func:`probes.idle_rss`)."""
    import ray

    out = {}
    for role, acts in roles.items():
        if role in ("owner", "engine"):
            got = ray.get([h.__ray_call__.remote(probes.start_rss) for _, h in acts.values()])
            out.update({f"{role}/{a}": v for a, v in zip(acts, got)})
        else:
            out.update({f"{role}/{a}": idle.get(role) for a in acts})
    return out


def _med(xs):
    return statistics.median(xs) if xs else None


def _summarise(refits: list[dict], roles: dict, start: dict, children: dict, topo, launch_hwm: dict) -> dict:
    """A point's figures from its measured refits: medians of time, CPU and bytes, the largest memory."""
    cpu = {}
    memory = {}
    for role, acts in roles.items():
        ids = [f"{role}/{a}" for a in acts]
        sums = [sum(r["cpu"][i] for i in ids) for r in refits]
        maxs = [max(r["cpu"][i] for i in ids) for r in refits]
        each_cpu = {i.split("/", 1)[1]: _med([r["cpu"][i] for r in refits]) for i in ids}
        cpu[role] = {"sum": _med(sums), "max": _med(maxs), "each": each_cpu}
        each = {}
        for a in acts:
            i = f"{role}/{a}"
            peak = max(r["peak"][i] for r in refits)
            s = start.get(i)
            each[a] = {"start": s, "before_refit": min(r["before"][i] for r in refits), "peak": peak,
                       "hwm": max(r["hwm"][i] for r in refits), "launch_hwm": launch_hwm.get(i),
                       "peak_above_start": None if s is None else peak - s,
                       "added_by_refit": max(r["peak"][i] - r["before"][i] for r in refits)}
            if role == "relay":
                each[a]["children"] = children.get(a, 0)
        memory[role] = {"each": each, "peak_max": max(v["peak"] for v in each.values()),
                        "peak_above_start_max": max((v["peak_above_start"] for v in each.values()
                                                     if v["peak_above_start"] is not None), default=None),
                        "added_by_refit_max": max(v["added_by_refit"] for v in each.values())}
    changed = _med([r["changed"] for r in refits])
    st = [r["store"] for r in refits if r["store"] is not None]
    store = {"before_bytes": _med([x["before"] for x in st]),
             "peak_bytes": max((x["peak"] for x in st), default=None),
             "peak_above_before_bytes": max((x["peak"] - x["before"] for x in st), default=None),
             "created_bytes": _med([x["created"] for x in st]),
             "spilled_bytes": max((x["spilled"] for x in st), default=None), "refits_read": len(st)}
    return {
        "numel": topo.numel, "model_bytes": 2 * topo.numel, "owner_share_bytes": topo.owner_share_bytes,
        "changed": changed, "changed_bytes": 2 * changed, "change_rate": changed / topo.numel,
        "wire_bytes": _med([r["wire_bytes"] for r in refits]), "payloads": _med([r["payloads"] for r in refits]),
        "refit_s": _med([r["refit_s"] for r in refits]), "refit_s_each": [r["refit_s"] for r in refits],
        "driver_s": _med([r["driver_s"] for r in refits]), "ready_s": _med([r["ready_s"] for r in refits]),
        "phases": {k: _med([r["phases"][k] for r in refits]) for k in refits[0]["phases"]
                   if all(k in r["phases"] for r in refits)},
        "cpu_s": {**cpu, "ray": {"sum": _med([r["ray_cpu"] for r in refits])}},
        # derived, not measured: with a core per actor the stages stream, and the busiest actor decides
        "derived_streamed_s": _med([max(r["cpu"].values()) for r in refits]),
        "memory": memory, "store": store,
        "links": {"boundary": {k: _med([r["boundary"][k] for r in refits]) for k in refits[0]["boundary"]},
                  "relays_in": {k: _med([r["relay_in"].get(k, 0) for r in refits]) for k in refits[0]["relay_in"]},
                  "engines": {k: _med([r["engine_bytes"][k] for r in refits]) for k in refits[0]["engine_bytes"]}},
        "refits": refits,
    }


def _take_down(topo, roles: dict) -> None:
    """Shut the topology down and wait (at most :data:`EXIT_WAIT_S`) until its processes have exited."""
    import psutil

    pids = [pid for acts in roles.values() for pid, _ in acts.values()] if roles else []
    try:
        topo.shutdown()
    except Exception as e:  # noqa: BLE001 - the processes are waited for below either way
        log(f"  shutdown: {type(e).__name__}: {e}")
    deadline = time.monotonic() + EXIT_WAIT_S
    while time.monotonic() < deadline and any(psutil.pid_exists(p) and _alive(p) for p in pids):
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
