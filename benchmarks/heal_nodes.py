"""``dcr-ray bench heal``'s node cases: a node killed mid-refit, and a whole cluster lost and regained.

Real node faults (``Cluster.remove_node(node, allow_graceful=False)``: the node's raylet, object store and
workers at once) on a multi-node Ray cluster on this machine: owners and coordinator on the head node,
cluster ``a`` on two nodes (both its engines and its head relay on the first), ``b`` on one, two
``transformers`` engines each, every cluster behind a 10 Mbit/s emulated link
(:class:`~dcr_ray.testing.links.EmulatedLinks`), a trainer taking AdamW steps at :data:`LR`. After warm-up
and quiet refits (their median is the reference), two cases run on the same topology:

* ``node_death_mid_refit``: ``a``'s first node dies while the owners stream. Measured: the refit's
  ``attempts`` and ``seconds`` (driver wall time) and their ratio to the quiet median, and
  ``fleet_back_seconds``: from the kill until every engine holds the committed version again (re-created
  on ``a``'s other node and healed), checked bit for bit;
* ``cluster_lost``: every node of ``b`` dies between refits. Measured: the next refit's seconds and
  attempts, the slowest of the three after it (over the quiet median), ``paused_after_apply_s``: the
  longest a surviving engine stayed paused after its own apply (its pause clock's ``after_apply_s``: from
  its flush, every payload written, until it served again), and whether each survivor answered a
  generate call after the refits.
  Then a node of ``b`` joins: ``capacity_back_seconds`` (from the join until both of ``b``'s engines hold
  the committed version, required again), ``cross_copies`` (heals that crossed ``b``'s link: copies from
  a peer of another cluster), and the bit-exact check of every engine.

In both, ``heal_lock_seconds``: the longest a heal held the coordinator's lock (its record's
``lock_seconds``: the lock guards decisions, never a copy or a wait for a relay or engine to start).
"""

from __future__ import annotations

import statistics
import time

#: The emulated link of each cluster (Mbit/s, one-way latency s).
LINK = (10.0, 0.0)
#: The trainer's AdamW learning rate: RL-sized steps (about 1-2% of BF16 elements change per step), so a
#: refit moves its delta across the 10 Mbit/s link in about a second, as in the issue's set-up. (The heal
#: cases above use lr 1e-3, where nearly every element changes: over this link each refit would move a
#: dense model, ~35 s for the small model.)
LR = 1e-6
#: Targets from the outage issue.
TARGETS = {"node_death_attempts_max": 2, "node_death_ratio_max": 3.0, "fleet_back_s_max": 30.0,
           "lost_next_refit_s_floor": 10.0, "lost_next_refit_ratio_max": 3.0, "lost_later_ratio_max": 1.5,
           "paused_after_apply_s_max": 1.0, "capacity_back_s_max": 60.0, "cross_copies_max": 1,
           "heal_lock_s_max": 0.25}
QUIET_REFITS = 5
WARM_UP_REFITS = 2


def run_node_cases(spec, say, limit_s: float = 600.0) -> dict:
    """Both node cases on a fresh multi-node cluster (see the module doc); the result's ``node_cases``."""
    import ray

    import dcr_ray
    from dcr_ray.config import validate
    from dcr_ray.testing.clusters import LocalClusters
    from dcr_ray.testing.links import EmulatedLinks
    from dcr_ray.testing.trainer import TinyTrainer

    nodes = LocalClusters(("a", "b"))
    refit = None
    try:
        trainer = ray.remote(num_cpus=0, resources={"train": 0.01})(TinyTrainer).remote(spec, lr=LR)
        clusters = [dcr_ray.ClusterSpec(name=c, engines=2, resources=nodes.resources(c)) for c in "ab"]
        engine = dcr_ray.HFEngine(spec.with_seed(9))
        config = validate(dcr_ray.RefitConfig(commit=dcr_ray.CommitConfig(timeout_s=60.0),
                                              actor_options={"coordinator": {"resources": LocalClusters.HEAD}}),
                          clusters, [trainer], engine)
        refit = dcr_ray.launch(owners=[trainer], clusters=clusters, engine=engine, config=config,
                               transport=EmulatedLinks(config, {"a": LINK, "b": LINK}))
        nodes.add("a")  # a's second node, empty until a node of a dies
        steps = [0]

        def step():
            ray.get(trainer.step.remote(seed=steps[0]))
            steps[0] += 1

        def one():
            step()
            t0 = time.perf_counter()
            report = refit.run(timeout=limit_s)
            report.seconds["driver"] = time.perf_counter() - t0
            return report

        for _ in range(WARM_UP_REFITS):
            one()
        quiet = [one().seconds["driver"] for _ in range(QUIET_REFITS)]
        base = statistics.median(quiet)
        say(f"node cases: quiet refits {', '.join(f'{q:.2f}' for q in quiet)} s")
        out = {"quiet_refit_seconds": quiet, "link_mbps": LINK[0], "lr": LR, "targets": TARGETS}
        out["node_death_mid_refit"] = _node_death(refit, nodes, trainer, step, base, limit_s)
        say(f"node_death_mid_refit: {out['node_death_mid_refit']}")
        out["cluster_lost"] = _cluster_lost(refit, nodes, trainer, one, base, limit_s)
        say(f"cluster_lost: {out['cluster_lost']}")
        out["targets_met"] = targets_met(out)
        return out
    finally:
        nodes.shutdown(refit)


def _exact(refit, trainer) -> bool:
    """Every engine's tensors equal the trainer's committed bits (integer views)."""
    import ray
    import torch

    want = ray.get(trainer.rollout_state.remote())
    ok = True
    for eng in refit.engines().values():
        got = ray.get(eng.tensors.remote(), timeout=60)
        ok &= all(torch.equal(got[n].view(torch.int16), t.view(torch.int16)) for n, t in want.items())
    return bool(ok)


def _wait_phase(refit, phases, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while refit.status()["phase"]["phase"] not in phases:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the refit never reached {phases}")
        time.sleep(0.01)


def _node_death(refit, nodes, trainer, step, base: float, limit_s: float) -> dict:
    import ray

    step()
    healed_before = {(h["engine"], h["at"]) for h in refit.status()["healed"]}
    t0 = time.perf_counter()
    pending = refit.remote()
    _wait_phase(refit, ("stream", "flush"), limit_s)
    t_kill = time.perf_counter()
    nodes.kill(nodes.nodes["a"][0])
    report = ray.get(pending, timeout=limit_s)
    seconds = time.perf_counter() - t0
    refit.wait_healed(timeout=limit_s)
    back = time.perf_counter() - t_kill
    heals = [h for h in refit.status()["healed"] if (h["engine"], h["at"]) not in healed_before]
    return {"attempts": report.attempts, "seconds": seconds, "ratio": seconds / base,
            "fleet_back_seconds": back, "required": len(refit.status()["required"]),
            "heal_lock_seconds": max((h.get("lock_seconds") or 0.0 for h in heals), default=0.0),
            "bit_exact": _exact(refit, trainer)}


def _cluster_lost(refit, nodes, trainer, one, base: float, limit_s: float) -> dict:
    import ray

    nodes.lose("b")
    since = time.time()
    reports = [one() for _ in range(4)]  # the one that meets the outage, and three after it
    survivors = sorted(e for e in refit.status()["required"] if e.startswith("a/"))
    last = reports[-1].version
    served = all(ray.get(refit.engines()[e].generate.remote([[1, 2, 3]], 1), timeout=30)["version"] == last
                 for e in survivors)
    paused = [p for e in survivors for p in ray.get(refit.engines()[e].pauses.remote(since))]
    waiting = refit.status()["capacity"]
    healed_before = {(h["engine"], h["at"]) for h in refit.status()["healed"]}  # (the heal may end before add returns)
    t_join = time.perf_counter()
    nodes.add("b")
    deadline = time.monotonic() + limit_s
    while True:
        st = refit.status()
        if {"b/e0", "b/e1"} <= set(st["required"]):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"cluster b did not heal within {limit_s:.0f} s of its node joining: {st}")
        time.sleep(0.2)
    back = time.perf_counter() - t_join
    heals = [h for h in refit.status()["healed"] if (h["engine"], h["at"]) not in healed_before]
    return {"next_refit_seconds": reports[0].seconds["driver"], "next_refit_attempts": reports[0].attempts,
            "next_refit_ratio": reports[0].seconds["driver"] / base,
            "later_refit_seconds": [r.seconds["driver"] for r in reports[1:]],
            "later_ratio": max(r.seconds["driver"] for r in reports[1:]) / base,
            "paused_after_apply_s": max((p["after_apply_s"] or 0.0 for p in paused), default=0.0),
            "survivors_served": bool(served), "waiting_for_capacity": sorted(waiting),
            "capacity_back_seconds": back,
            "heals": [{k: h.get(k) for k in ("engine", "sources", "seconds", "cross_bytes", "copy_bytes",
                                             "lock_seconds")} for h in heals],
            "heal_lock_seconds": max((h.get("lock_seconds") or 0.0 for h in heals), default=0.0),
            "cross_copies": sum(1 for h in heals if h.get("cross_bytes")), "bit_exact": _exact(refit, trainer)}


def targets_met(out: dict) -> dict:
    """Each target of the outage issue, met or not, from a run's node cases."""
    t, nd, cl = TARGETS, out["node_death_mid_refit"], out["cluster_lost"]
    base = statistics.median(out["quiet_refit_seconds"])
    return {"node_death_attempts_le_2": nd["attempts"] <= t["node_death_attempts_max"],
            "node_death_le_3x_quiet": nd["ratio"] <= t["node_death_ratio_max"],
            "node_death_fleet_back_le_30s": nd["fleet_back_seconds"] <= t["fleet_back_s_max"] and nd["bit_exact"],
            "cluster_lost_next_refit_le_max_3x_10s":
                cl["next_refit_seconds"] <= max(t["lost_next_refit_ratio_max"] * base, t["lost_next_refit_s_floor"]),
            "cluster_lost_later_refits_le_1.5x": cl["later_ratio"] <= t["lost_later_ratio_max"],
            "survivors_paused_after_apply_le_1s": cl["paused_after_apply_s"] <= t["paused_after_apply_s_max"]
                                                  and cl["survivors_served"],
            "capacity_back_le_60s": cl["capacity_back_seconds"] <= t["capacity_back_s_max"] and cl["bit_exact"],
            "capacity_back_le_1_cross_copy": cl["cross_copies"] <= t["cross_copies_max"],
            "heal_lock_le_0.25s": max(nd.get("heal_lock_seconds", 0.0), cl.get("heal_lock_seconds", 0.0))
                                  <= t["heal_lock_s_max"]}


def format_lines(out: dict) -> list[str]:
    """The node cases as lines of ``bench heal``'s table."""
    nd, cl = out["node_death_mid_refit"], out["cluster_lost"]
    base = statistics.median(out["quiet_refit_seconds"])
    return [f"node cases ({out['link_mbps']:g} Mbit/s links), quiet refit median {base:.2f} s",
            f"  node_death_mid_refit: {nd['attempts']} attempt(s), {nd['seconds']:.2f} s ({nd['ratio']:.1f}x quiet); "
            f"fleet back in {nd['fleet_back_seconds']:.1f} s, exact={nd['bit_exact']}",
            f"  cluster_lost: next refit {cl['next_refit_seconds']:.2f} s ({cl['next_refit_attempts']} attempt(s)), "
            f"later ones <= {cl['later_ratio']:.2f}x quiet; survivors paused <= {cl['paused_after_apply_s']:.2f} s "
            f"after their apply, served={cl['survivors_served']}; capacity back -> b serving in "
            f"{cl['capacity_back_seconds']:.1f} s with {cl['cross_copies']} copy across its link, "
            f"exact={cl['bit_exact']}",
            f"  coordinator lock held by a heal: <= {nd.get('heal_lock_seconds', 0.0):.3f} s (node death), "
            f"<= {cl.get('heal_lock_seconds', 0.0):.3f} s (cluster back, across its link)",
            "  targets: " + ", ".join(f"{k}={'met' if v else 'UNMET'}" for k, v in out["targets_met"].items())]


def markdown(out: dict) -> str:
    """BENCHMARKS.md rows of the node cases (generated from the JSON)."""
    nd, cl = out["node_death_mid_refit"], out["cluster_lost"]
    base = statistics.median(out["quiet_refit_seconds"])
    rows = ["| node case | measured | target | met |", "|---|---|---|---|"]
    met = out["targets_met"]
    death_ok = met["node_death_attempts_le_2"] and met["node_death_le_3x_quiet"]
    rows += [f"| node dies mid-refit | {nd['attempts']} attempt(s), {nd['seconds']:.2f} s = {nd['ratio']:.1f}x the "
             f"quiet {base:.2f} s | <= 2 attempts, <= 3x | {_yes(death_ok)} |",
             f"| ... fleet back, bit-exact | {nd['fleet_back_seconds']:.1f} s | <= 30 s | "
             f"{_yes(met['node_death_fleet_back_le_30s'])} |",
             f"| cluster lost: next refit | {cl['next_refit_seconds']:.2f} s, {cl['next_refit_attempts']} attempt(s) | "
             f"<= max(3x quiet, 10 s) | {_yes(met['cluster_lost_next_refit_le_max_3x_10s'])} |",
             f"| ... the refits after it | <= {cl['later_ratio']:.2f}x quiet | <= 1.5x | "
             f"{_yes(met['cluster_lost_later_refits_le_1.5x'])} |",
             f"| ... survivors paused after their own apply | {cl['paused_after_apply_s']:.2f} s | <= 1 s | "
             f"{_yes(met['survivors_paused_after_apply_le_1s'])} |",
             f"| capacity back: lost cluster serving, bit-exact | {cl['capacity_back_seconds']:.1f} s, "
             f"{cl['cross_copies']} copy across its link | <= 60 s, <= 1 copy | "
             f"{_yes(met['capacity_back_le_60s'] and met['capacity_back_le_1_cross_copy'])} |"]
    if "heal_lock_le_0.25s" in met:
        rows.append(f"| coordinator lock held by one heal | {nd['heal_lock_seconds']:.3f} s (node death), "
                    f"{cl['heal_lock_seconds']:.3f} s (across the link) | <= 0.25 s | {_yes(met['heal_lock_le_0.25s'])} |")
    return "\n".join(rows)


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"
