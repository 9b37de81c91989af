"""``dcr-ray bench heal [--quick] [--json PATH]``: what healing an engine costs, and who pays.

What runs (real Ray on this machine, loopback only): a multi-node ``ray.cluster_utils.Cluster`` (a
training node and one node per rollout "cluster", marked by custom resources), one
:class:`~dcr_ray.testing.trainer.TinyTrainer` owner taking real AdamW steps (``small`` model, ``tiny``
with ``--quick``), two clusters of two ``transformers`` engines behind relay trees. After quiet refits
(their median is the reference), three cases run one after another on the same topology:

* ``recreated_with_peer``: engine ``a/e1`` is killed; the next refit drops it, and it is re-created
  and heals while refits go on;
* ``lagging_3_versions``: ``a/e1``'s flush hangs past the stage timeout, so it is evicted; two more
  refits commit without it, and when it answers it is three versions behind; then it heals;
* ``whole_cluster_lost``: both engines of cluster ``b`` are killed; the first heals from a peer of
  cluster ``a`` (across the link once, off the trainer's clock), the second from the first.

After the fault, refits run back to back until nothing heals any more (at least two). Per case:
``cross_cluster_bytes`` (bytes that entered the healing engine's cluster through its head relay for
anything but those refits, measured by the relays' own counters, plus what peers of other clusters
handed over, from the heal records), ``owner_bytes`` (payload bytes the
owners produced for the heal: their bootstrap summaries), ``copy_bytes`` (what a peer handed over
inside the cluster), ``window_bytes`` (the missed deltas replayed from the cluster's catch-up window,
inside the cluster), ``union_delta_bytes`` (wire bytes of the versions a lagging engine missed),
``heal_seconds`` (the coordinator's healing record, re-creation included), ``refit_blocked_ratio``
(the slowest refit that started while an engine healed, over the quiet median; also
``refit_blocked_ratio_copying``: only refits that started while a copy or an owners' send ran, not
while a re-created engine was still starting; the refit that met the fault is reported apart as
``fault_refit_seconds``: it includes detecting a death or a stage timeout), ``coordinator_lock_seconds``
(how long the heals held the coordinator's lock: the only wait the design puts on a refit; the rest of a
refit's slowdown during a heal is the machine's CPU shared with the healing engine),
and ``bit_exact`` (every engine's tensors vs the trainer's on integer views after the case).

Then real node faults on a cluster of their own, behind 10 Mbit/s emulated links (``node_cases``,
:mod:`benchmarks.heal_nodes`): a node killed mid-refit, and a whole cluster lost and regained.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from benchmarks import write_json_and_plot
from benchmarks.heal_nodes import format_lines as node_lines
from benchmarks.heal_nodes import markdown as node_markdown
from benchmarks.heal_nodes import run_node_cases
import tempfile
import time

#: Stage timeout of the bench topology; the lagging engine's flush hangs longer than this.
STAGE_TIMEOUT_S = 8.0
#: A case that has not healed this long after its fault is an error (the run stops with the status).
CASE_LIMIT_S = 600.0
#: Refits run and not timed before the quiet ones.
WARM_UP_REFITS = 2
#: Quiet refits before the cases (their median is what a blocked ratio divides by).
QUIET_REFITS = 5
#: Targets from the healing issue.
TARGETS = {"recreated_with_peer": {"cross_cluster_bytes": 0, "owner_bytes": 0},
           "lagging_cross_over_union_max": 1.05, "refit_blocked_ratio_max": 1.5, "heal_lock_s_max": 0.25}


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``heal`` to the ``bench`` subcommands."""
    p = subparsers.add_parser("heal", help="healing a dead, lagging or lost engine: bytes, seconds, refit stall",
                              description=__doc__.split("\n\n")[1])
    p.add_argument("--quick", action="store_true", help="tiny model (seconds instead of minutes)")
    p.add_argument("--json", metavar="PATH", help="write results as JSON here and a PNG plot beside it")
    p.set_defaults(func=_run_from_args)
    return p


def _run_from_args(args) -> int:
    result = run(quick=args.quick, progress=sys.stderr)
    print(format_table(result))
    if args.json:
        write_json_and_plot(result, args.json, plot)
    return 0


def run(quick: bool = False, progress=None) -> dict:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from dcr_ray.testing.clusters import start_local_clusters, stop_local_clusters

    import dcr_ray
    from dcr_ray.testing.faults import StallOnSignal
    from dcr_ray.testing.models import ModelSpec
    from dcr_ray.testing.trainer import TinyTrainer

    say = (lambda m: print(f"[bench heal] {m}", file=progress, flush=True)) if progress else (lambda m: None)
    cluster = start_local_clusters(("a", "b"))
    spec = ModelSpec(size="tiny" if quick else "small")
    work = tempfile.mkdtemp(prefix="dcr_bench_heal_")
    stall = os.path.join(work, "stall")
    trainer = ray.remote(num_cpus=0, resources={"train": 0.01})(TinyTrainer).remote(spec, lr=1e-3)
    clusters = [dcr_ray.ClusterSpec(name=c, engines=2, fanout=2, resources={f"cluster-{c}": 0.01}) for c in "ab"]
    config = dcr_ray.RefitConfig(commit=dcr_ray.CommitConfig(dir=os.path.join(work, "commit"),
                                                             timeout_s=STAGE_TIMEOUT_S),
                                 actor_options={"coordinator": {"resources": {"train": 0.01}}})
    release = os.path.join(work, "release")  # the lagging engine hangs through the eviction and two refits
    refit = dcr_ray.launch(owners=[trainer], clusters=clusters, config=config,
                           engine=StallOnSignal(dcr_ray.HFEngine(spec), stall, CASE_LIMIT_S, release=release))
    steps = [0]

    def one() -> object:
        ray.get(trainer.step.remote(seed=steps[0]))
        steps[0] += 1
        t0 = time.perf_counter()
        report = refit.run()
        report.seconds["driver"] = time.perf_counter() - t0  # what the RL loop waited, measured by the caller
        return report

    try:
        for _ in range(WARM_UP_REFITS):  # the first refits after launch still load kernels and caches
            one()
        quiet = [one().seconds["driver"] for _ in range(QUIET_REFITS)]
        base = statistics.median(quiet)
        say(f"quiet refits: {', '.join(f'{q:.2f}' for q in quiet)} s")
        out = {"model": spec.size, "quiet_refit_seconds": quiet, "targets": TARGETS, "cases": {}}
        cases = out["cases"]

        cases["recreated_with_peer"] = _case(refit, one, base, "a", lambda: ray.kill(refit.engines()["a/e1"]))
        say(f"recreated_with_peer: {cases['recreated_with_peer']}")

        def hang():
            with open(stall, "w") as f:
                f.write("a/e1")
        cases["lagging_3_versions"] = _case(refit, one, base, "a", hang, release=release)
        say(f"lagging_3_versions: {cases['lagging_3_versions']}")

        def lose_b():
            for e in ("b/e0", "b/e1"):
                ray.kill(refit.engines()[e])
        cases["whole_cluster_lost"] = _case(refit, one, base, "b", lose_b, expect=2)
        say(f"whole_cluster_lost: {cases['whole_cluster_lost']}")
        out["targets_met"] = _targets_met(cases)
    finally:
        stop_local_clusters(cluster, refit)
    out["node_cases"] = run_node_cases(spec, say)  # real node faults, on a cluster of their own
    return out


def _head_bytes(refit, cluster: str) -> dict[str, int]:
    """Bytes per transfer that entered ``cluster`` through its head relay (the relay's own counter)."""
    for s in refit.relay_stats():
        if s["cluster"] == cluster and s["head"]:
            return dict(s["bytes_in"])
    return {}


def _case(refit, one, base: float, cluster: str, fault, expect: int = 1, release: str | None = None) -> dict:
    """Inject ``fault``, refit back to back until ``expect`` engines healed (and at least two refits ran
    after the fault), and measure (see the module doc). With ``release``, the fault is a hung engine that
    answers again once three versions were committed without it."""
    import ray
    import torch

    from dcr_ray.testing.faults import release_stall

    before = _head_bytes(refit, cluster)
    healed_before = {(h["engine"], h["at"]) for h in refit.status()["healed"]}
    t_fault = time.monotonic()
    fault()
    first = one()  # meets the fault: drops the dead engines, or evicts the hung one at the stage timeout
    reports, missed_from = [first], None
    if release is not None:  # the evicted engine hangs on: refits go on without it until it answers
        missed_from = first.version  # it applied this version's frames but never activated it
        while len(reports) < 3:  # three versions committed without it...
            reports.append(one())
        release_stall(release)  # ...then it answers again
    during = []  # (report, healing phases when it started)
    while True:
        st = refit.status()
        phases = {h["standing"] for h in st["healing"].values()}
        done = sum((h["engine"], h["at"]) not in healed_before for h in st["healed"])
        if not phases and done >= expect and len(during) >= 2:
            break
        if "failed" in phases:
            raise RuntimeError(f"healing failed: {st['healing']}")
        if time.monotonic() - t_fault > CASE_LIMIT_S:
            raise RuntimeError(f"nothing healed within {CASE_LIMIT_S:.0f} s of the fault: {st}")
        during.append((time.time(), one(), phases))
    heals = [h for h in refit.status()["healed"] if (h["engine"], h["at"]) not in healed_before]
    refits = {r.transfer for r in [*reports, *(r for _, r, _ in during)]}
    after = _head_bytes(refit, cluster)
    cross = sum(b for t, b in after.items() if t not in refits) - sum(b for t, b in before.items() if t not in refits)
    cross += sum(h.get("cross_bytes") or 0 for h in heals)  # copies from a peer of another cluster
    union = sum(r.wire_bytes for r in reports if missed_from is not None and r.version >= missed_from)
    want = ray.get(refit.owners()["owner0"].rollout_state.remote())
    exact = True
    for eng in refit.engines().values():
        got = ray.get(eng.tensors.remote())
        exact &= all(torch.equal(got[n].view(-1).view(torch.int16), t.view(-1).view(torch.int16))
                     for n, t in want.items())
    # a refit ran "while healing" if it started before the last heal completed (one that waited for a heal
    # step holding the coordinator started while it ran, whatever the phase its start saw)
    heal_end = max((h["at"] for h in heals), default=0.0)
    healing = [(r.seconds["driver"], p) for t, r, p in during if t < heal_end]
    slowest = max((t for t, _ in healing), default=0.0)
    # refits that met a copy or an owners' send (or waited for one): all but those that started while a
    # re-created engine was still being created or started (and nothing else healed)
    copying = max((t for t, p in healing if not (p and p <= {"re-creating", "starting"})), default=0.0)
    return {"heals": [{k: h.get(k) for k in ("engine", "sources", "version", "seconds", "owner_bytes", "copy_bytes",
                                             "cross_bytes", "delta_bytes", "steps", "lock_seconds")}
                      for h in heals],
            "cross_cluster_bytes": int(cross), "owner_bytes": int(sum(h.get("owner_bytes") or 0 for h in heals)),
            "copy_bytes": int(sum(h.get("copy_bytes") or 0 for h in heals)),
            "window_bytes": int(sum(h.get("delta_bytes") or 0 for h in heals)),
            "coordinator_lock_seconds": sum(h.get("lock_seconds") or 0.0 for h in heals),
            "heal_lock_seconds_max": max((h.get("lock_seconds") or 0.0 for h in heals), default=0.0),
            "union_delta_bytes": int(union) if missed_from is not None else None,
            "missed_versions": len(reports) if missed_from is not None else None,
            "heal_seconds": max((h["seconds"] for h in heals), default=None),
            "fault_refit_seconds": first.seconds["driver"], "refits_while_healing": len(healing),
            "refits_while_evicted": len(reports) - 1,
            "slowest_refit_while_evicted_seconds": max((r.seconds["driver"] for r in reports[1:]), default=None),
            "slowest_refit_while_healing_seconds": slowest, "refit_blocked_ratio": slowest / base if base else None,
            "refit_blocked_ratio_copying": copying / base if base else None,
            "wall_seconds": time.monotonic() - t_fault, "bit_exact": bool(exact)}


def _targets_met(cases: dict) -> dict:
    rp, lag = cases["recreated_with_peer"], cases["lagging_3_versions"]
    out = {"recreated_with_peer_cross_cluster_bytes_zero": rp["cross_cluster_bytes"] == 0,
           "recreated_with_peer_owner_bytes_zero": rp["owner_bytes"] == 0,
           "lagging_cross_le_1.05x_union": lag["cross_cluster_bytes"] <= 1.05 * (lag["union_delta_bytes"] or 0)}
    for name, c in cases.items():
        out[f"{name}_refit_blocked_ratio_le_1.5"] = c["refit_blocked_ratio"] <= TARGETS["refit_blocked_ratio_max"]
        out[f"{name}_heal_lock_le_0.25s"] = c["heal_lock_seconds_max"] <= TARGETS["heal_lock_s_max"]
        out[f"{name}_bit_exact"] = c["bit_exact"]
    return out


def format_table(result: dict) -> str:
    lines = [f"model {result['model']}, quiet refit median {statistics.median(result['quiet_refit_seconds']):.2f} s",
             f"{'case':<22} {'cross MB':>9} {'owner MB':>9} {'copy MB':>8} {'window MB':>9} {'union MB':>9} {'heal s':>7} "
             f"{'blocked':>8} {'copying':>8} {'lock s':>7} {'fault s':>8}  sources"]
    for name, c in result["cases"].items():
        mb = lambda b: "-" if b is None else f"{b / 1e6:.2f}"  # noqa: E731
        lines.append(f"{name:<22} {mb(c['cross_cluster_bytes']):>9} {mb(c['owner_bytes']):>9} {mb(c['copy_bytes']):>8} "
                     f"{mb(c.get('window_bytes')):>9} {mb(c['union_delta_bytes']):>9} {c['heal_seconds'] or 0:>7.2f} {c['refit_blocked_ratio']:>7.2f}x "
                     f"{c['refit_blocked_ratio_copying']:>7.2f}x {c.get('coordinator_lock_seconds') or 0:>7.2f} "
                     f"{c['fault_refit_seconds']:>8.2f}  "
                     + ", ".join(f"{h['engine']}<-{'+'.join(h['sources'])}" for h in c["heals"]))
    lines.append("targets: " + ", ".join(f"{k}={'met' if v else 'UNMET'}" for k, v in result["targets_met"].items()))
    if "node_cases" in result:
        lines += node_lines(result["node_cases"])
    return "\n".join(lines)


def markdown(result: dict) -> str:
    """The BENCHMARKS.md table of one run (generated from its JSON, never typed)."""
    mb = lambda b: "-" if b is None else f"{b / 1e6:.2f}"  # noqa: E731
    rows = ["| case | heals (engine <- source) | cross-cluster MB | owner MB | peer copy MB | replayed from the window MB "
            "| union of missed deltas MB | heal s | slowest refit while healing / quiet | same, copy phase only "
            "| coordinator lock held by the heal s | refit that met the fault s | bit-exact |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in result["cases"].items():
        rows.append(f"| {name} | {', '.join(h['engine'] + ' <- ' + ' + '.join(h['sources']) for h in c['heals'])} "
                    f"| {mb(c['cross_cluster_bytes'])} | {mb(c['owner_bytes'])} | {mb(c['copy_bytes'])} "
                    f"| {mb(c.get('window_bytes'))} | {mb(c['union_delta_bytes'])} | {c['heal_seconds']:.2f} | {c['refit_blocked_ratio']:.2f}x "
                    f"| {c['refit_blocked_ratio_copying']:.2f}x | {c.get('coordinator_lock_seconds') or 0:.2f} "
                    f"| {c['fault_refit_seconds']:.2f} "
                    f"| {'yes' if c['bit_exact'] else 'NO'} |")
    if "node_cases" in result:
        rows += ["", node_markdown(result["node_cases"])]
    return "\n".join(rows)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["cases"])
    nodes = result.get("node_cases")
    fig, axes = plt.subplots(1, 3 if nodes else 2, figsize=(16 if nodes else 11, 4))
    a1, a2 = axes[0], axes[1]
    w = 0.2
    for i, (key, label) in enumerate([("cross_cluster_bytes", "crossed the cluster link"),
                                      ("owner_bytes", "sent by the owners"), ("copy_bytes", "copied from a peer"),
                                      ("window_bytes", "replayed from the window")]):
        a1.bar([x + (i - 1.5) * w for x in range(len(names))], [result["cases"][n][key] / 1e6 for n in names], w,
               label=label)
    a1.set_xticks(range(len(names)), names, fontsize=8)
    a1.set_ylabel("MB for the heal")
    a1.legend(fontsize=8)
    a2.bar(names, [result["cases"][n]["refit_blocked_ratio"] for n in names], color="tab:gray")
    a2.axhline(TARGETS["refit_blocked_ratio_max"], color="tab:red", ls="--", label="target 1.5x")
    a2.set_ylabel("slowest refit while healing / quiet refit")
    a2.tick_params(axis="x", labelsize=8)
    a2.legend(fontsize=8)
    if nodes:
        _plot_nodes(axes[2], nodes)
    fig.suptitle(f"dcr-ray bench heal ({result['model']} model, measured on this machine)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_nodes(ax, nodes: dict) -> None:
    """The node cases: each measured figure over its target (1.0 = at the target; below is met)."""
    from benchmarks.heal_nodes import TARGETS

    nd, cl = nodes["node_death_mid_refit"], nodes["cluster_lost"]
    base = statistics.median(nodes["quiet_refit_seconds"])
    bars = {"node death:\nrefit / 3x quiet": nd["ratio"] / TARGETS["node_death_ratio_max"],
            "node death:\nfleet back / 30 s": nd["fleet_back_seconds"] / TARGETS["fleet_back_s_max"],
            "cluster lost:\nnext refit / bound": cl["next_refit_seconds"] / max(3 * base, 10.0),
            "cluster lost:\nlater / 1.5x quiet": cl["later_ratio"] / TARGETS["lost_later_ratio_max"],
            "survivors paused\nafter apply / 1 s": cl["paused_after_apply_s"] / TARGETS["paused_after_apply_s_max"],
            "capacity back:\nserving / 60 s": cl["capacity_back_seconds"] / TARGETS["capacity_back_s_max"]}
    ax.bar(range(len(bars)), list(bars.values()), color="tab:blue")
    ax.axhline(1.0, color="tab:red", ls="--", label="target")
    ax.set_xticks(range(len(bars)), list(bars), fontsize=7)
    ax.set_ylabel("measured / target")
    ax.set_title(f"node faults ({nodes['link_mbps']:g} Mbit/s links)", fontsize=9)
    ax.legend(fontsize=8)
