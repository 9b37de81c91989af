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

- per kind of actor, which of torch, transformers, numba and vLLM its processes had loaded when they answered
  (a relay or the coordinator that holds no model should need neither torch nor transformers);
- ``processes`` (ordinary run): the CPU seconds of every process the raylet started, by title, at topology up:
  the actors above, Ray's agents, and the idle worker ``launch`` prepares for ``refit.remote()`` (``ray::IDLE``).

It runs the topology once per mode, each in a fresh Python process of its own (as a user runs the
quickstart: nothing Ray or dcr_ray load lazily is loaded yet) with a fresh Ray: ``ordinary`` (every worker
imports what it needs itself: what ``dcr_ray.launch`` gives every user, and what the quickstart runs) and
``prefork`` (workers forked from a :mod:`dcr_ray.prefork` server that imported torch, transformers and the
model's module once: the opt-in, ``quickstart.py --prefork``). ``topology_up_s`` of the prefork run includes
the server's start, which overlaps ``ray.init``. The target is judged on the ordinary run; prefork is reported
beside it. ``--before PATH`` reports an earlier run's ordinary topology (the code before a change, run by
this same script on the same machine, just before) beside this one's, per phase and per kind of actor.
"""

from __future__ import annotations

import argparse
import os
import time


MODES = ("ordinary", "prefork")
#: Issue 42's reference: the ordinary topology's start at 73e2993 on this project's 2-core machine.
ORDINARY_BEFORE_S = 18.6
#: The modules whose presence in an actor's process says what its start paid for.
HEAVY = ("torch", "transformers", "numba", "vllm")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("startup", help="where a topology's start-up goes; first refits; engine re-creation",
                              description=__doc__.split("\n\n")[1])
    p.add_argument("--json", default=None, help="write the run here")
    p.add_argument("--modes", default=",".join(MODES), help=f"which worker starts to run (default: {','.join(MODES)})")
    p.add_argument("--before", default=None, help="an earlier run's JSON whose ordinary run is reported beside this one's")
    p.set_defaults(func=_run)
    return p


def _facts(_actor) -> dict:
    """(Run in an actor.) CPU seconds its process has spent (user + system), and which :data:`HEAVY` modules
    it has loaded."""
    import sys

    t = os.times()
    return {"cpu": t.user + t.system, "loaded": [m for m in HEAVY if m in sys.modules]}


def run(modes=MODES, before: dict | None = None) -> dict:
    from benchmarks.provenance import git_commit, loadavg

    unknown = set(modes) - set(MODES)
    if unknown or not modes:
        raise ValueError(f"--modes takes some of {','.join(MODES)}, got {','.join(modes)}")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    t0 = time.perf_counter()
    out = {"bench": "startup", "git": git_commit(), "loadavg_start": loadavg(), "cores": os.cpu_count()}
    out["runs"] = {mode: _in_fresh_process(mode == "prefork") for mode in MODES if mode in modes}
    out["loadavg_end"] = loadavg()
    out["seconds"] = time.perf_counter() - t0
    if before is not None:
        out["before"] = {k: before[k] for k in ("git", "loadavg_start", "loadavg_end")}
        out["before"]["ordinary"] = before["runs"]["ordinary"]
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
    from dcr_ray.testing.models import ModelSpec
    from dcr_ray.testing.trainer import TinyTrainer

    out = {"cores": os.cpu_count(), "prefork": prefork}
    if not prefork:
        _leave_inherited_prefork()
    t0 = time.perf_counter()
    server = _start_server() if prefork else None  # its imports overlap ray.init
    ray.init(**(server.ray_init_kwargs(address="local") if server else {"address": "local"}), num_cpus=2,
             include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    if server:
        server.wait_ready()
    t_ray = time.perf_counter()
    spec = ModelSpec(arch="qwen2", size="tiny", seed=0)
    Trainer = ray.remote(num_cpus=0)(TinyTrainer)
    trainers = [Trainer.remote(spec, lr=1e-5, rank=r, world=2) for r in range(2)]
    ray.get([t.__ray_ready__.remote() for t in trainers])
    t_owners = time.perf_counter()
    refit = dcr_ray.launch(owners=trainers, engine=dcr_ray.HFEngine(spec.with_seed(123)),
                           clusters=[dcr_ray.ClusterSpec(name="us-east", engines=2),
                                     dcr_ray.ClusterSpec(name="eu-west", engines=2)])
    t_up = time.perf_counter()
    try:
        st = refit.status(detail=True)
        handles = ray.get(refit.actor.handles.remote())
        facts = {"owners": ray.get([t.__ray_call__.remote(_facts) for t in trainers]),
                 "engines": ray.get([h.__ray_call__.remote(_facts) for h in handles["engines"].values()]),
                 "relays": ray.get([h.__ray_call__.remote(_facts) for h in handles["relays"].values()]),
                 "coordinator": [ray.get(refit.actor.__ray_call__.remote(_facts))]}
        out.update(ray_init_s=t_ray - t0, owners_s=t_owners - t_ray, launch_s=t_up - t_owners,
                   topology_up_s=t_up - t0, startup=st["startup"],
                   cpu_seconds={k: {"sum": sum(f["cpu"] for f in v), "each": [f["cpu"] for f in v]}
                                for k, v in facts.items()},
                   imports={k: sorted({m for f in v for m in f["loaded"]}, key=HEAVY.index)
                            for k, v in facts.items()})
        if not prefork:  # forked workers are the prefork server's children, not the raylet's
            out["processes"] = _processes_under_raylet()
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


def _processes_under_raylet() -> dict:
    """``{title: {"n", "cpu"}}`` over the processes this driver's raylet started (their CPU seconds so far)."""
    import psutil
    import ray

    node = f"--node_id={ray.get_runtime_context().get_node_id()}"
    out: dict = {}
    for raylet in (p for p in psutil.Process().children(recursive=True) if p.name() == "raylet"):
        try:
            if node not in raylet.cmdline():
                continue
            children = raylet.children()
        except psutil.Error:
            continue
        for p in children:
            try:
                title, t = (p.cmdline() or [p.name()])[0].split(" ")[0], p.cpu_times()
            except psutil.Error:
                continue
            entry = out.setdefault(title, {"n": 0, "cpu": 0.0})
            entry["n"] += 1
            entry["cpu"] += t.user + t.system
    return out


def _leave_inherited_prefork() -> None:
    """Make the ordinary run ordinary where this process inherited a prefork server's ``environ()`` (the test
    suite's, say): without this, every ``ray.init`` here would fork its workers from that server."""
    import dcr_ray.prefork

    if os.environ.get("RAY_RUNTIME_ENV_HOOK") == dcr_ray.prefork.HOOK:
        for key in (dcr_ray.prefork.SOCKET_ENV, "RAY_RUNTIME_ENV_HOOK",
                    *(f"RAY_{k}" for k in dcr_ray.prefork.ray_system_config())):
            os.environ.pop(key, None)


def _start_server():
    """The opt-in: a prefork server with the library's preloads and the tiny model's module."""
    import dcr_ray.prefork
    from dcr_ray.testing.models import MODELING_MODULES

    return dcr_ray.prefork.start(extra=(MODELING_MODULES["qwen2"],))


def _cpu_floor(r: dict) -> float:
    return sum(v["sum"] for v in r["cpu_seconds"].values()) / r["cores"]


def targets(out: dict) -> list[dict]:
    """Issue 42's target on the ordinary run (what ``launch`` gives every user), met or unmet with its number;
    the prefork run (the opt-in) and an earlier run's ordinary topology (``--before``) reported beside it."""
    runs, out_t = out["runs"], []
    if "ordinary" in runs:
        up = runs["ordinary"]["topology_up_s"]
        out_t.append({"target": f"ordinary topology up < {ORDINARY_BEFORE_S} s (issue 42; its figure at 73e2993)",
                      "value": up, "met": up < ORDINARY_BEFORE_S})
    if "before" in out:
        out_t.append({"target": "(reported) ordinary topology up, before / this run",
                      "value": out["before"]["ordinary"]["topology_up_s"] / runs["ordinary"]["topology_up_s"],
                      "met": None})
    if "prefork" in runs:
        out_t.append({"target": "(reported) prefork topology up (the opt-in)", "value": runs["prefork"]["topology_up_s"],
                      "met": None})
    if len(runs) == 2:
        o, p = runs["ordinary"], runs["prefork"]
        out_t += [{"target": "(reported) topology up, ordinary / prefork",
                   "value": o["topology_up_s"] / p["topology_up_s"], "met": None},
                  {"target": "(reported) re-created -> ready to heal, ordinary / prefork",
                   "value": o["recreate_s"]["ready_to_heal_s"] / p["recreate_s"]["ready_to_heal_s"], "met": None}]
    for mode, r in runs.items():
        out_t += [{"target": f"(reported) first refit / fifth refit (driver seconds), {mode}",
                   "value": r["refit_s"][0]["driver_s"] / r["refit_s"][-1]["driver_s"], "met": None},
                  {"target": f"(reported) CPU seconds all actors spent starting / cores, {mode}: the floor under "
                             "topology up", "value": _cpu_floor(r), "met": None}]
    return out_t


def _commit(run: dict) -> str:
    """A run's commit, short, and whether its tree differed from it."""
    git = run.get("git") or {}
    return f"{(git.get('commit') or 'unknown')[:10]}{' + changes' if git.get('dirty') else ''}"


def before_and_after(before: dict, after: dict) -> str:
    """The ordinary topology of an earlier run (``--before``) beside this run's: phases, CPU seconds and the
    heavy modules per kind of actor."""
    def phases(r):
        return [r["topology_up_s"], r["ray_init_s"], r["owners_s"], r["launch_s"]]

    lines = ["| ordinary topology | before | after |", "|---|---|---|"]
    for label, b, a in zip(("topology up (s)", "ray.init (s)", "trainers (s)", "launch (s)"), phases(before),
                           phases(after)):
        lines.append(f"| {label} | {b:.1f} | {a:.1f} |")
    for kind in after["cpu_seconds"]:
        lines.append(f"| CPU s starting, {kind} | {before['cpu_seconds'][kind]['sum']:.1f} | "
                     f"{after['cpu_seconds'][kind]['sum']:.1f} |")
    idle = [r.get("processes", {}).get("ray::IDLE") for r in (before, after)]
    if all(idle):
        lines.append(f"| CPU s, idle workers (refit.remote()'s) | {idle[0]['cpu']:.1f} ({idle[0]['n']}) | "
                     f"{idle[1]['cpu']:.1f} ({idle[1]['n']}) |")
    for kind in after.get("imports", {}):
        b = ", ".join(before.get("imports", {}).get(kind, [])) or "none of them"
        lines.append(f"| {kind} loaded | {b} | {', '.join(after['imports'][kind]) or 'none of them'} |")
    return "\n".join(lines)


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
              "", "loaded, per kind of actor (of " + ", ".join(HEAVY) + "): " + "; ".join(
                  f"{k} {', '.join(v) or 'none'}" for k, v in r.get("imports", {}).items()),
              *(["", "CPU seconds of the processes the raylet started, by title: " + ", ".join(
                  f"{k} {v['cpu']:.1f}" + (f" ({v['n']})" if v["n"] > 1 else "")
                  for k, v in sorted(r["processes"].items(), key=lambda kv: -kv[1]["cpu"]))]
                if r.get("processes") else []),
              "", "refits (driver / coordinator s): " + ", ".join(
                  f"{w['driver_s']:.3f}/{w['coordinator_s']:.3f}" for w in r["refit_s"]),
              f"engine re-created -> ready to heal {r['recreate_s']['ready_to_heal_s']:.2f} s, healed in "
              f"{r['recreate_s']['heal_s']:.2f} s from {r['recreate_s']['source']}"]
    return "\n".join(lines)


def markdown(out: dict) -> str:
    """Both runs' tables and the targets (BENCHMARKS.md)."""
    lines = []
    if "before" in out and "ordinary" in out["runs"]:
        b = out["before"]
        lines += [f"**ordinary, before (at {_commit(b)}) and after (at {_commit(out)})**, run back to back", "",
                  before_and_after(b["ordinary"], out["runs"]["ordinary"]), ""]
    for mode in out["runs"]:
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

    runs = [(mode, r) for mode, r in out["runs"].items()]
    if "before" in out:
        runs.insert(0, (f"ordinary before (at {_commit(out['before'])})", out["before"]["ordinary"]))
    heights = [len(r["startup"].get("engines", {})) + len(r["startup"].get("relays", {})) + 1 for _, r in runs]
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 0.45 * sum(heights) + 2.0), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    axes = axes[:, 0]
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

    before = None
    if args.before:
        import json

        with open(args.before) as f:
            before = json.load(f)
    r = run([m for m in args.modes.split(",") if m], before)
    print(markdown(r))
    if args.json:
        write_json_and_plot(r, args.json, plot)
    return 0
