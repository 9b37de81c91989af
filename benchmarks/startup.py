"""``dcr-ray bench startup``: where a topology's start-up goes, and what the first refits cost.

It starts the quickstart's topology (a tiny Qwen2-style model, two data-parallel trainer replicas that are
the owners, two clusters of two ``transformers`` engines behind relays) in a fresh local Ray and reports,
measured:

- ``ray_init_s``, ``owners_s`` (the trainer actors built) and ``launch_s`` (``dcr_ray.launch`` until every
  engine holds version 0), and ``topology_up_s`` (from ``ray.init`` until the topology is up: what the
  quickstart prints);
- per actor, from :mod:`dcr_ray.start_clock` (``status(detail=True)["startup"]``): ``worker`` (the Ray
  worker process, its imports and unpickling its arguments), ``backend`` (the engine's model built),
  ``kernels`` (numba kernels loaded, on a thread beside), and the coordinator's phases (spawn, attach
  owners, engines up, bootstrap);
- the CPU seconds each kind of actor spent starting (its process's user + system time when it answered:
  the floor a machine with this many cores puts under ``topology_up_s``);
- ``refit_s``: the driver's wall time of the first five refits (``ray.get(refit.remote())``);
- ``recreate_s``: an engine killed and re-created: from its re-creation until it answers (ready to heal),
  and the whole heal.

It runs the topology twice in one run, each in a fresh Python process of its own (as a user runs the
quickstart: nothing Ray or dcr_ray load lazily is loaded yet) with a fresh Ray: ``ordinary`` (every worker
imports torch and transformers itself) and ``prefork`` (workers forked from a :mod:`dcr_ray.prefork` server
that imported them once, as the quickstart runs). ``topology_up_s`` of the prefork run includes the server's
start, which overlaps ``ray.init``. The targets are judged on the prefork run; the ordinary one is its
reference, and their ratios are reported.
"""

from __future__ import annotations

import argparse
import os
import time


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("startup", help="where a topology's start-up goes; first refits; engine re-creation",
                              description=__doc__.split("\n\n")[1])
    p.add_argument("--json", default=None, help="write the run here")
    p.set_defaults(func=_run)
    return p


def _cpu(_actor) -> float:
    """(Run in an actor.) CPU seconds its process has spent (user + system)."""
    t = os.times()
    return t.user + t.system


MODES = ("ordinary", "prefork")


def run() -> dict:
    from benchmarks.provenance import git_commit, loadavg

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    t0 = time.perf_counter()
    out = {"bench": "startup", "git": git_commit(), "loadavg_start": loadavg(), "cores": os.cpu_count()}
    out["runs"] = {mode: _in_fresh_process(mode == "prefork") for mode in MODES}
    out["loadavg_end"] = loadavg()
    out["seconds"] = time.perf_counter() - t0
    out["targets"] = targets(out)
    return out


def _in_fresh_process(prefork: bool) -> dict:
    """:func:`run_topology` in a new interpreter: a driver that ran a topology before has loaded what
    ``ray.init`` and ``launch`` import on first use, and started a second one about 0.3 s sooner."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_topology, prefork).result()


def run_topology(prefork: bool) -> dict:
    """One start of the quickstart's topology in a fresh Ray, its five refits and one engine re-created."""
    import ray

    import dcr_ray
    import dcr_ray.prefork
    from dcr_ray.testing.models import MODELING_MODULES, ModelSpec
    from dcr_ray.testing.trainer import TinyTrainer

    out = {"cores": os.cpu_count(), "prefork": prefork}
    t0 = time.perf_counter()
    server = dcr_ray.prefork.start(extra=(MODELING_MODULES["qwen2"],)) if prefork else None  # beside ray.init
    ray.init(**(server.ray_init_kwargs(address="local") if server else {"address": "local"}), num_cpus=2,
             include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    if server:
        server.wait_ready()
    t_ray = time.perf_counter()
    spec = ModelSpec(arch="qwen2", size="tiny", seed=0)
    Trainer = ray.remote(num_cpus=0)(TinyTrainer)
    trainers = [Trainer.remote(spec, lr=1e-5, rank=r, world=2) for r in range(2)]
    ray.get([t.__ray_call__.remote(_cpu) for t in trainers])
    t_owners = time.perf_counter()
    refit = dcr_ray.launch(owners=trainers, engine=dcr_ray.HFEngine(spec.with_seed(123)),
                           clusters=[dcr_ray.ClusterSpec(name="us-east", engines=2),
                                     dcr_ray.ClusterSpec(name="eu-west", engines=2)])
    t_up = time.perf_counter()
    try:
        st = refit.status(detail=True)
        handles = ray.get(refit.actor.handles.remote())
        cpu = {"owners": ray.get([t.__ray_call__.remote(_cpu) for t in trainers]),
               "engines": ray.get([h.__ray_call__.remote(_cpu) for h in handles["engines"].values()]),
               "relays": ray.get([h.__ray_call__.remote(_cpu) for h in handles["relays"].values()]),
               "coordinator": [ray.get(refit.actor.__ray_call__.remote(_cpu))]}
        out.update(ray_init_s=t_ray - t0, owners_s=t_owners - t_ray, launch_s=t_up - t_owners,
                   topology_up_s=t_up - t0, startup=st["startup"],
                   cpu_seconds={k: {"sum": sum(v), "each": v} for k, v in cpu.items()})
        walls = []
        for step in range(5):
            ray.get([t.step.remote(seed=step) for t in trainers])
            a = time.perf_counter()
            report = ray.get(refit.remote())
            walls.append({"driver_s": time.perf_counter() - a, "coordinator_s": report.seconds["total"],
                          "phases": dict(report.seconds)})
        out["refit_s"] = walls
        victim = "us-east/e1"
        ray.kill(refit.engines()[victim])
        ray.get([t.step.remote(seed=9) for t in trainers])
        refit.run()
        healed = [h for h in refit.wait_healed(timeout=300)["healed"] if h["engine"] == victim][-1]
        out["recreate_s"] = {"ready_to_heal_s": healed["start_seconds"], "heal_s": healed["seconds"],
                             "source": healed["source"]}
    finally:
        refit.shutdown()
        ray.shutdown()
        if server:
            server.stop()
    return out


def _cpu_floor(r: dict) -> float:
    return sum(v["sum"] for v in r["cpu_seconds"].values()) / r["cores"]


def targets(out: dict) -> list[dict]:
    """Issue 32's start-up targets on the prefork run (the quickstart's), each met or unmet with its number,
    and the ordinary run's figures against it."""
    r, base = out["runs"]["prefork"], out["runs"]["ordinary"]
    first, fifth = r["refit_s"][0]["driver_s"], r["refit_s"][-1]["driver_s"]
    ready, base_ready = r["recreate_s"]["ready_to_heal_s"], base["recreate_s"]["ready_to_heal_s"]
    return [{"target": "quickstart topology up <= 8 s", "value": r["topology_up_s"],
             "met": r["topology_up_s"] <= 8.0},
            {"target": "engine re-created -> ready to heal <= 3 s", "value": ready, "met": ready <= 3.0},
            {"target": "(reported) topology up, ordinary / prefork", "value": base["topology_up_s"] / r["topology_up_s"],
             "met": None},
            {"target": "(reported) re-created -> ready to heal, ordinary / prefork", "value": base_ready / ready,
             "met": None},
            {"target": "(reported) first refit / fifth refit (driver seconds)", "value": first / fifth, "met": None},
            {"target": "(reported) CPU seconds all actors spent starting / cores, prefork: the floor under "
                       "topology up", "value": _cpu_floor(r), "met": None},
            {"target": "(reported) the same, ordinary", "value": _cpu_floor(base), "met": None}]


def format_table(r: dict) -> str:
    init = "ray.init beside the prefork server's start" if r.get("prefork") else "ray.init"
    lines = [f"topology up {r['topology_up_s']:.1f} s ({init} {r['ray_init_s']:.1f}, trainers {r['owners_s']:.1f}, "
             f"launch {r['launch_s']:.1f}) on {r['cores']} cores", "",
             "| actor | worker start + imports (s) | backend (s) | kernels (s) |", "|---|---|---|---|"]
    su = r["startup"]
    for kind in ("engines", "relays"):
        for name, v in sorted((su.get(kind) or {}).items()):
            sec = (v or {}).get("seconds", {})
            cells = [f"{sec[k]:.2f}" if k in sec else "-" for k in ("worker", "backend", "kernels")]
            lines.append(f"| {kind[:-1]} {name} | " + " | ".join(cells) + " |")
    coord = su.get("coordinator", {}).get("seconds", {})
    lines += ["", "coordinator: " + ", ".join(f"{k} {v:.2f} s" for k, v in coord.items()), "",
              "CPU seconds spent starting, per kind of actor: " + ", ".join(
                  f"{k} {v['sum']:.1f}" for k, v in r["cpu_seconds"].items()),
              "", "refits (driver / coordinator s): " + ", ".join(
                  f"{w['driver_s']:.3f}/{w['coordinator_s']:.3f}" for w in r["refit_s"]),
              f"engine re-created -> ready to heal {r['recreate_s']['ready_to_heal_s']:.2f} s, healed in "
              f"{r['recreate_s']['heal_s']:.2f} s from {r['recreate_s']['source']}"]
    return "\n".join(lines)


def markdown(out: dict) -> str:
    """Both runs' tables and the targets (BENCHMARKS.md)."""
    lines = []
    for mode in MODES:
        lines += [f"**{mode}**", "", format_table(out["runs"][mode]), ""]
    for t in out.get("targets", []):
        met = {True: "met", False: "unmet", None: "reported"}[t["met"]]
        lines.append(f"- {t['target']}: {t['value']:.2f} ({met})")
    return "\n".join(lines) + "\n"


def plot(out: dict, path: str) -> None:
    """Each run's actors' start-up on one time axis (from the coordinator's birth): their phases as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(mode, out["runs"][mode]) for mode in MODES]
    heights = [len(r["startup"].get("engines", {})) + len(r["startup"].get("relays", {})) + 1 for _, r in runs]
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 0.45 * sum(heights) + 2.0), sharex=True,
                             gridspec_kw={"height_ratios": heights})
    for ax, (mode, r) in zip(axes, runs):
        _plot_run(ax, mode, r)
    axes[-1].set_xlabel("seconds since the coordinator's process started")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_run(ax, mode: str, r: dict) -> None:
    su = r["startup"]
    t0 = su["coordinator"]["born"]
    rows = [("coordinator", su["coordinator"])] + [
        (f"{kind[:-1]} {name}", v) for kind in ("engines", "relays") for name, v in sorted(su.get(kind, {}).items())]
    colors = {"worker": "tab:gray", "backend": "tab:blue", "kernels": "tab:purple", "spawn": "tab:olive",
              "attach owners": "tab:cyan", "engines up": "tab:orange", "bootstrap": "tab:green"}
    seen = set()
    for y, (label, v) in enumerate(rows):
        at = v["born"] - t0
        for phase, sec in v["seconds"].items():
            if phase == "kernels":  # on a thread beside the backend: drawn from the worker's end
                start = v["born"] - t0 + v["seconds"].get("worker", 0.0)
            else:
                start, at = at, at + sec
            ax.barh(y, sec, left=start, color=colors.get(phase, "tab:red"), height=0.6 if phase != "kernels" else 0.25,
                    label=None if phase in seen else phase)
            seen.add(phase)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_title(f"{mode}: the quickstart's topology on {r['cores']} cores, up {r['topology_up_s']:.1f} s "
                 f"after ray.init began", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _run(args) -> int:
    from benchmarks import write_json_and_plot

    r = run()
    print(markdown(r))
    if args.json:
        write_json_and_plot(r, args.json, plot)
    return 0
