"""``dcr-ray chaos [--refits N] [--seed S] [--model stream|tiny] [--json PATH]``: seeded faults against a
running topology.

A multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a training node and two rollout
"clusters" of nodes marked by custom resources), two data-parallel :class:`~dcr_ray.testing.trainer.
TinyTrainer` owners taking real AdamW steps, and two clusters of engines behind relay trees. Each refit
draws a fault (the first refits cover every kind once, in a seeded order) and injects it before or
during the refit:

* ``kill_engine`` / ``kill_relay``: ``ray.kill`` of a random engine or relay, during the refit;
* ``kill_coordinator``: the coordinator's process dies (Ray restarts it; it resumes from the record);
* ``kill_owner``: an owner dies; the refit fails cleanly, then a replacement that replays the same
  steps (so it holds the committed bits) takes its place through ``Refit.replace_owner``;
* ``flip_bytes`` / ``wrong_key`` / ``truncate`` / ``stale_replay``: a hostile frame delivered straight to
  a random engine during the refit (one bit flipped, signed with another key, cut short, or a validly
  signed frame of another transfer);
* ``drop`` / ``duplicate`` / ``reorder`` / ``delay``: a random owner's first frame of the refit's first
  attempt is lost, sent twice, sent after the next one, or held :data:`~dcr_ray.testing.payload_faults.
  DELAY_S` (:class:`~dcr_ray.testing.payload_faults.PayloadFaults` wraps the real relay transport);
* ``stall_engine``: a random engine's flush hangs past the stage timeout (it is evicted, the others
  commit, and it rejoins when it answers);
* node faults, real ones (``Cluster.remove_node(node, allow_graceful=False)``: the raylet, the object
  store and every worker of the node at once): ``kill_node_mid_refit`` (a random rollout node, during
  the refit), ``kill_node_between_refits`` (before it) and ``lose_cluster`` (every node of a random
  rollout cluster, before it). After the refit a node of that cluster is added again (``add_node``:
  capacity returns), and its engines heal in the background.

The last refit of a run longer than one pass over the kinds is quiet, so the fleet shows whether it
healed. Cluster ``a`` starts on two nodes and ``b`` on one.

Models (``--model``): ``stream`` (the default) codes the ``mini`` model's changes (its MLP tensors are
split into chunks) into 32 KiB buckets, so that each owner streams at least :data:`MIN_FRAMES_PER_OWNER`
frames a refit (``frames_per_owner`` in the JSON
is measured with the owners' own code on the run's first step), and actor and node kills are drawn
across the last committed refit's duration: they land mid-stream. ``tiny`` is the earlier set-up (a few
frames per owner, kills in the first 0.2 s), where a kill rarely lands mid-stream.

After every committed version every required engine is compared bit for bit (integer views) with the
owners. The JSON has the fields of the issue's chaos suite: refits, committed, faults_injected,
faults_by_kind, faults_survived, mismatched_engines, bad_frames_rejected, bad_frames_applied,
hung_waits (refit calls that took longer than twice every attempt's stage timeouts; ``hung`` names them,
``refit_seconds`` has each refit's longest call), engines_at_end, engines_configured (counted after the engines healing in the background
are done), dense_rebootstraps (engines the owners sent the whole model to: heals with no peer left in
the cluster, and restores after abandoned refits), recreated_engines (re-created after a death),
healed_from_peer / healed_from_window / healed_from_owners (where healing engines got their bits first;
``owners`` if the owners sent anything), in_place_rollbacks, node_faults (each node fault and each
``add_node`` counted), generation_refused (required engines that refused a generate call after a
committed refit: a cluster that is fine must serve, whatever happened to the others).
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter

from benchmarks.chaos_matrix.cli import add_arguments as add_enumerate_arguments, run_enumerate

FAULT_KINDS = ("kill_engine", "kill_relay", "kill_coordinator", "kill_owner", "flip_bytes", "wrong_key",
               "truncate", "stale_replay", "drop", "duplicate", "reorder", "delay", "stall_engine",
               "kill_node_mid_refit", "kill_node_between_refits", "lose_cluster")
NODE_KINDS = ("kill_node_mid_refit", "kill_node_between_refits", "lose_cluster")
PAYLOAD_KINDS = ("drop", "duplicate", "reorder", "delay")
#: Stage timeout of the chaos topology (``run_chaos(stage_timeout_s=...)``), and how much longer than it a
#: stalled engine hangs.
STAGE_TIMEOUT_S = 10.0
STALL_PAST_TIMEOUT_S = 4.0
#: Probability of a refit without a fault, after every kind ran once.
QUIET_P = 0.3
#: The frame key of the chaos topology (hostile frames sign with another one).
KEY = b"dcr-chaos-key"
#: How long the end of a run waits for engines still healing in the background.
HEAL_WAIT_S = 300.0
TARGETS = {"committed_min_fraction": 28 / 30, "mismatched_engines": 0, "bad_frames_applied": 0, "hung_waits": 0}
#: What each model codes its frames with; ``stream`` makes every owner send at least MIN_FRAMES_PER_OWNER.
MODELS = {"stream": {"size": "mini", "bucket_bytes": 1 << 15, "chunk_elems": 1 << 12},
          "tiny": {"size": "tiny", "bucket_bytes": 1 << 17, "chunk_elems": 1 << 13}}
MIN_FRAMES_PER_OWNER = 16


def add_parser(groups) -> None:
    """Register ``chaos`` on the ``dcr-ray`` command's subparsers."""
    p = groups.add_parser("chaos", help="seeded faults against a multi-node topology; checks every refit",
                          description=__doc__.split("\n\n")[1])
    p.add_argument("--refits", type=int, default=30,
                   help=f"refits to run (default 30; CI runs {len(FAULT_KINDS) + 1}: every kind once, then a quiet one)")
    p.add_argument("--seed", type=int, default=20137, help="fault schedule seed")
    p.add_argument("--model", choices=sorted(MODELS), default="stream",
                   help=f"stream (default): every owner streams >= {MIN_FRAMES_PER_OWNER} frames a refit, kills "
                        f"land mid-stream; tiny: a few frames per owner")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    add_enumerate_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    if args.enumerate:
        return run_enumerate(args)
    if args.refits < 1:
        print("dcr-ray chaos: --refits must be >= 1", file=sys.stderr)
        return 2
    out = run_chaos(args.refits, args.seed, progress=sys.stderr, model=args.model)
    print(json.dumps(out, indent=2))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0 if out["mismatched_engines"] == 0 and out["bad_frames_applied"] == 0 else 1


def schedule(refits: int, seed: int) -> list[str | None]:
    """The fault of each refit: every kind once (seeded order), then random kinds or none; the last
    refit of a run longer than one pass is quiet."""
    rng = random.Random(seed)
    first = list(FAULT_KINDS)
    rng.shuffle(first)
    rest = [None if rng.random() < QUIET_P else rng.choice(FAULT_KINDS) for _ in range(max(0, refits - len(first)))]
    out = (first + rest)[:refits]
    if refits > len(FAULT_KINDS):
        out[-1] = None
    return out


def _hostile_frame(kind: str, name: str, shape: tuple, base: int) -> bytes:
    import torch

    from dcr_ray.codec import FrameMeta, encode_frames, full_delta

    t = torch.zeros(shape, dtype=torch.bfloat16)
    meta = FrameMeta(transfer=f"chaos-{kind}", attempt=0, producer="chaos", payload=0, base=base, target=base + 1)
    frame = next(iter(encode_frames([full_delta(name, t)], meta, key=b"not-the-key" if kind == "wrong_key" else KEY)))
    if kind == "flip_bytes":
        b = bytearray(frame)
        b[len(b) // 2] ^= 0x10
        return bytes(b)
    if kind == "truncate":
        return frame[: len(frame) // 2]
    return frame  # wrong_key, stale_replay (a validly signed frame of another transfer)


def frames_per_owner(spec, lr: float, model: str, world: int = 2) -> int:
    """The fewest frames one of ``world`` owners streams for one real optimizer step of ``spec`` (the owners'
    own code: attach, one AdamW step, one stream into a list), with ``model``'s coding."""
    import dcr_ray
    from dcr_ray.actors.owner.delta import DeltaOwner
    from dcr_ray.testing.trainer import TinyTrainer

    coding = {k: v for k, v in MODELS[model].items() if k != "size"}
    config = dcr_ray.RefitConfig(codec=dcr_ray.CodecConfig(key=KEY, **coding))

    class Frames:
        def __init__(self):
            self.n = 0

        def send(self, frame, key):
            self.n += 1

        def drain(self):
            pass

    counts = []
    for rank in range(world):
        trainer = TinyTrainer(spec, lr=lr, rank=rank, world=world)
        owner = DeltaOwner(f"owner{rank}", config, in_memory=True)
        owner.attach(trainer.dcr_tensors())
        trainer.step(seed=0)
        sink = Frames()
        owner.stream(trainer.dcr_tensors(), transfer="count", attempt=0, base=0, target=1, sink=sink)
        counts.append(sink.n)
    return min(counts)


def run_chaos(refits: int, seed: int, *, progress=None, stage_timeout_s: float = STAGE_TIMEOUT_S,
              model: str = "stream") -> dict:
    """Run the chaos suite (see the module docstring); returns the results dict. ``stage_timeout_s`` is
    what a stalled engine or a dropped payload costs a refit (a short run may take less than the soak's);
    ``model``: a key of :data:`MODELS`."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    from dcr_ray.testing.clusters import LocalClusters

    import dcr_ray
    from dcr_ray.testing import payload_faults
    from dcr_ray.testing.faults import StallOnSignal
    from dcr_ray.testing.models import ModelSpec
    from dcr_ray.testing.trainer import TinyTrainer

    from tqdm.auto import tqdm

    from dcr_ray import progress as bars

    say = (lambda m: tqdm.write(f"[chaos] {m}", file=progress)) if progress else (lambda m: None)
    nodes = LocalClusters(("a", "b"))
    nodes.add("a")  # a on two nodes: a node fault there leaves the cluster capacity; b on one
    spec = ModelSpec(size=MODELS[model]["size"])
    frames = frames_per_owner(spec, 1e-3, model)
    Trainer = ray.remote(num_cpus=0, resources={"train": 0.01})(TinyTrainer)
    steps: list[int] = []
    committed_steps = 0  # steps reflected in the committed version

    def trainer(rank: int, upto: int):
        t = Trainer.remote(spec, lr=1e-3, rank=rank, world=2)
        for s in steps[:upto]:  # replay: a replacement holds exactly the bits of the one it replaces
            ray.get(t.step.remote(seed=s))
        return t

    owners = [trainer(r, 0) for r in range(2)]
    clusters = [dcr_ray.ClusterSpec(name="a", engines=2, resources={"cluster-a": 0.01}),
                dcr_ray.ClusterSpec(name="b", engines=2, fanout=2, resources={"cluster-b": 0.01})]
    work = tempfile.mkdtemp(prefix="dcr_chaos_")
    config = dcr_ray.RefitConfig(codec=dcr_ray.CodecConfig(key=KEY, **{k: v for k, v in MODELS[model].items()
                                                                        if k != "size"}),
                                 commit=dcr_ray.CommitConfig(dir=os.path.join(work, "commit"),
                                                             timeout_s=stage_timeout_s),
                                 actor_options={"coordinator": {"resources": LocalClusters.HEAD}})
    # signal files armed per refit: all "nodes" of this cluster share this machine's file system
    payload_signal, stall_signal = os.path.join(work, "payload_fault"), os.path.join(work, "stall")
    refit = dcr_ray.launch(owners=owners, clusters=clusters, config=config,
                           engine=StallOnSignal(dcr_ray.HFEngine(spec), stall_signal,
                                                stage_timeout_s + STALL_PAST_TIMEOUT_S),
                           transport=payload_faults.PayloadFaults(config, payload_signal))
    configured = sum(c.engines for c in clusters)
    rng = random.Random(seed + 1)
    stats = Counter()
    by_kind, survived = Counter(), Counter()
    mismatched, recreated, refused, t0 = 0, 0, 0, time.monotonic()
    node_faults = Counter()
    healed: dict[tuple, list] = {}  # (engine, when) -> where its bits came from, round by round
    failures: list[str] = []  # messages of refits that failed (they name engines restored densely)
    span = 0.2  # kills are drawn in [0, span] s after the refit starts: the last committed refit's duration
    hung: list[dict] = []  # the refits counted in hung_waits
    refit_seconds: list[float] = []  # each refit's longest call
    try:
        plan = schedule(refits, seed)
        for i, kind in enumerate(tqdm(plan, desc="chaos", unit="refit", disable=not (progress and bars.enabled()),
                                      file=progress or sys.stderr)):
            s = len(steps)
            steps.append(s)
            ray.get([o.step.remote(seed=s) for o in owners])
            threads, bad = [], []
            if kind is not None:
                by_kind[kind] += 1
                stats["faults_injected"] += 1
            handles = ray.get(refit.actor.handles.remote())
            if kind == "kill_coordinator":
                epoch = refit.status()["epoch"]
                ray.kill(refit.actor, no_restart=False)
                _wait(lambda: refit.status()["epoch"] > epoch)
            elif kind == "kill_owner":
                ray.kill(owners[1])
            elif kind in PAYLOAD_KINDS:
                payload_faults.arm(payload_signal, kind, rng.choice(["owner0", "owner1"]))
            elif kind == "stall_engine":
                with open(stall_signal, "w") as f:
                    f.write(rng.choice(sorted(handles["engines"])))
            elif kind in NODE_KINDS:
                lost = _node_fault(kind, nodes, rng, threads, span)
                node_faults[kind] += 1
            elif kind in ("kill_engine", "kill_relay"):
                pool = handles["engines"] if kind == "kill_engine" else handles["relays"]
                victim = pool[rng.choice(sorted(pool))]
                threads.append(threading.Timer(rng.uniform(0.0, span), lambda v=victim: ray.kill(v)))
            elif kind is not None:
                target = _live_engine(rng, sorted(handles["engines"]))
                if target is not None:  # else every engine is down: nothing to aim a frame at this refit
                    eng, name, shape = target
                    frame = _hostile_frame(kind, name, shape, refit.status()["version"])
                    threads.append(threading.Timer(rng.uniform(0.0, 0.1), lambda e=eng, f=frame:
                                                   bad.append(_deliver(e, f))))
            for th in threads:
                th.start()
            waits = []  # each refit call's seconds: none may outlast every attempt's stage timeouts twice
            ok = _try_refit(refit, say, failures, waits)
            if not ok and kind == "kill_owner":
                owners[1] = trainer(1, committed_steps)  # restored to the committed version...
                refit.replace_owner("owner1", owners[1])
                for s in steps[committed_steps:]:  # ...then it catches up with the other rank
                    ray.get(owners[1].step.remote(seed=s))
                ok = _try_refit(refit, say, failures, waits)
            for th in threads:
                th.join()
            if kind in NODE_KINDS:  # capacity returns: a node of the cluster that lost one joins again
                nodes.add(lost)
                node_faults["add_node"] += 1
            payload_faults.disarm(payload_signal)
            if os.path.exists(stall_signal):
                os.remove(stall_signal)
            if max(waits) > 2 * config.commit.timeout_s * config.commit.max_attempts:
                stats["hung_waits"] += 1
                hung.append({"refit": i + 1, "fault": kind, "seconds": round(max(waits), 1)})
            refit_seconds.append(round(max(waits), 2))
            stats["bad_frames_rejected"] += sum(b in ("rejected", "stale") for b in bad)
            stats["bad_frames_applied"] += sum(b == "applied" for b in bad)
            if ok:
                stats["committed"] += 1
                committed_steps = len(steps)
                if model == "stream" and kind is None:  # a quiet refit: how long the next kills may land in
                    span = max(0.2, ok.seconds.get("total", 0.2))
                recreated += sum("died; it is re-created" in w or "node is gone" in w for w in ok.warnings)
                bad_engines = _check(refit, owners[0])
                refused += _refusing(refit, ok.version)
                mismatched += len(bad_engines)
                if kind is not None and not bad_engines:
                    survived[kind] += 1
            say(f"refit {i + 1}/{refits}: fault {kind or '-'}: {'committed v%d' % ok.version if ok else 'failed'}")
            healed.update({(h["engine"], h["at"]): h["sources"] for h in refit.status()["healed"]})
        refit.wait_healed(timeout=HEAL_WAIT_S)  # engines heal in the background: the fleet at its size again
        healed.update({(h["engine"], h["at"]): h["sources"] for h in refit.status()["healed"]})
        dense = sum("owners" in src for src in healed.values())
        window = sum(src[:1] == ["window"] for src in healed.values())
        st = refit.status(detail=True)
        at_end = sum(e.get("phase") == "ready" and e.get("version") == st["version"] for e in st["engine_states"])
        rollbacks = sum(ray.get(h.info.remote()).get("rollbacks", 0) for h in refit.engines().values())
    finally:
        nodes.shutdown(refit)
    return {"refits": refits, "seed": seed, "model": model, "model_size": spec.size, "frames_per_owner": frames,
            "kill_span_s": round(span, 3), "committed": stats["committed"],
            "faults_injected": stats["faults_injected"], "faults_by_kind": dict(by_kind),
            "faults_survived": sum(survived.values()), "mismatched_engines": mismatched,
            "bad_frames_rejected": stats["bad_frames_rejected"], "bad_frames_applied": stats["bad_frames_applied"],
            "hung_waits": stats["hung_waits"], "hung": hung, "refit_seconds": refit_seconds, "engines_at_end": at_end, "engines_configured": configured,
            "dense_rebootstraps": dense + sum(_restored(m) for m in failures),
            "recreated_engines": recreated, "healed_from_peer": len(healed) - dense - window,
            "healed_from_window": window, "healed_from_owners": dense,
            "in_place_rollbacks": rollbacks, "node_faults": dict(node_faults), "generation_refused": refused,
            "seconds": round(time.monotonic() - t0, 1)}


def _node_fault(kind: str, nodes, rng, threads: list, span: float = 0.2) -> str:
    """Kill a random rollout node (during the refit: a timer in ``threads``; or now), or every node of a
    random cluster; returns the cluster that lost capacity (a node is added to it after the refit)."""
    if kind == "lose_cluster":
        cluster = rng.choice(sorted(c for c, ns in nodes.nodes.items() if ns))
        nodes.lose(cluster)
        return cluster
    cluster, node = rng.choice(sorted(((c, n) for c, ns in nodes.nodes.items() for n in ns),
                                      key=lambda cn: (cn[0], cn[1].node_id)))
    if kind == "kill_node_mid_refit":
        threads.append(threading.Timer(rng.uniform(0.0, span), lambda: nodes.kill(node)))
    else:
        nodes.kill(node)
    return cluster


def _refusing(refit, version: int) -> int:
    """Required engines that do not answer a short generate call with ``version`` (they must serve)."""
    import ray

    st = refit.status()
    calls = {e: h.generate.remote([[1, 2, 3]], 1) for e, h in refit.engines().items() if e in st["required"]}
    bad = 0
    for e, ref in calls.items():
        try:
            bad += ray.get(ref, timeout=30)["version"] < version
        except Exception:  # noqa: BLE001 - refused, dead or hung: it did not serve
            bad += 1
    return bad


def _try_refit(refit, say, failures: list[str], waits: list[float]):
    import dcr_ray

    t0 = time.monotonic()
    try:
        return refit.run()
    except dcr_ray.DcrError as e:
        failures.append(str(e))
        say(f"  refit failed: {str(e)[-400:]}")
        return None
    finally:
        waits.append(time.monotonic() - t0)


def _restored(message: str) -> int:
    """Engines a failed refit's message says were re-bootstrapped densely."""
    import re

    return sum(len(re.findall(r"'[^']+'", m)) for m in re.findall(r"(\[[^\]]*\]) were re-bootstrapped densely", message))


def _deliver(engine, frame: bytes) -> str:
    import ray

    try:
        return ray.get(engine.deliver.remote(frame), timeout=30)
    except Exception as e:  # a killed engine, or an error: not an application of the frame
        return f"error: {type(e).__name__}"


def _live_engine(rng, engine_ids: list[str]):
    """``(handle, tensor name, shape)`` of a live engine picked at random, its handle found by name now:
    a handle taken before the engine was killed and re-created reaches the dead actor. None if none answers."""
    import ray

    from dcr_ray.actors.fleet.topology import engine_name
    from dcr_ray.options import NAMESPACE

    for eid in rng.sample(engine_ids, len(engine_ids)):
        try:
            eng = ray.get_actor(engine_name(eid), namespace=NAMESPACE)
            return (eng, *_some_tensor(eng))
        except (ValueError, ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            continue  # killed (not yet re-created), or its name not registered again yet
    return None


def _some_tensor(engine) -> tuple[str, tuple]:
    import ray

    specs = ray.get(engine.tensor_specs.remote(), timeout=30)
    name = sorted(specs)[0]
    return name, tuple(specs[name][1])


def _check(refit, owner) -> list[str]:
    """Engines whose bits differ from the trainer's (integer views): every required engine, and every other one
    that says it holds the committed version (one healing, evicted or waiting: it must not claim bits it lacks).
    Engines at an older version are not compared: the trainer's tensors of that version are gone."""
    import ray
    import torch

    want = ray.get(owner.rollout_state.remote())
    st = refit.status()
    bad = []
    for eid, eng in refit.engines().items():
        try:
            if eid not in st["required"] and ray.get(eng.get_version.remote(), timeout=60) != st["version"]:
                continue
            got = ray.get(eng.tensors.remote(), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            continue  # killed after the commit (a late fault, its node gone): the next refit re-creates it
        if any(not torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)) for n in want):
            bad.append(eid)
    return bad


def _wait(cond, timeout: float = 120.0) -> None:
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():
                return
        except ray.exceptions.RayActorError:
            pass
        time.sleep(0.5)
    raise TimeoutError("the condition did not hold in time")


__all__ = ["FAULT_KINDS", "MIN_FRAMES_PER_OWNER", "MODELS", "NODE_KINDS", "add_parser", "frames_per_owner",
           "run", "run_chaos", "schedule"]
