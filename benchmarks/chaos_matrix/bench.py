"""The topology the enumerator fires its faults into, the trainer as the oracle, and the checks.

One multi-node Ray cluster on this machine (:class:`~dcr_ray.testing.clusters.LocalClusters`): the head node
(the coordinator, the node-fault harness), a training node (two data-parallel
:class:`~dcr_ray.testing.trainer.TinyTrainer` owners taking real AdamW steps), and one node per rollout
cluster: ``a`` (two engines behind its head relay) and ``b`` (three engines, fanout 2: its head relay
forwards to one engine and a sub-relay). One topology per (apply mode, transport) runs on it in turn; the
scenarios of that combination reuse it, and the harness puts it back together between them (nodes added
back, dead owners replaced, engines healed, every plan disarmed), or relaunches it when it cannot.

The model streams small buckets (8 KiB raw) at a large learning rate, so after a few warm-up refits every owner
sends 16+ frames per refit (the JSON's ``hits`` keeps the counts) and a fault at a middle hit lands mid-stream.

The oracle is the trainer: before every operation the harness reads owner0's own tensors (BF16, canonical),
and the version that operation commits is bound to them. :meth:`Bench.check` compares every engine that
serves a version with the trainer's tensors of that version (integer views), checks that the commit record
names the version the coordinator and its required engines hold, and that every ready engine generates.
"""

from __future__ import annotations

import os
import re
import tempfile
import time

import ray
import torch

import dcr_ray
from dcr_ray import failpoints
from dcr_ray.actors.fleet.topology import engine_name
from dcr_ray.errors import DcrError, RefitError, RefitTimeoutError
from dcr_ray.failpoints import remote as fp_remote
from dcr_ray.testing.clusters import LocalClusters
from dcr_ray.testing.models import ModelSpec
from dcr_ray.testing.trainer import TinyTrainer

NAMESPACE = "dcr_chaos_matrix"
KEY = b"dcr-chaos-matrix"
#: Stage timeout of the topology, and how much longer than it a stall sleeps.
STAGE_TIMEOUT_S = 6.0
STALL_PAST_S = 2.0
MAX_ATTEMPTS = 3
LR = 1e-3
#: Quiet refits after launch, before the first scenario (see :data:`BUCKET_BYTES`).
WARMUP_REFITS = 3
#: 8 KiB buckets (raw), and the tiny model's tensors split between the two owners (:func:`balanced_shares`):
#: after the warm-up refits each streams 16+ frames per refit (measured: 38 and 12 at the first refit, 38 and 18
#: at the third, 38 and 31 at the twelfth: the embedding's rows change more as AdamW's moments fill; the JSON's
#: ``hits`` keeps the counts of every run).
BUCKET_BYTES = 8 << 10
CHUNK_ELEMS = 1 << 10
#: How long healing may take after a scenario before it counts as a hang.
HEAL_BOUND_S = 240.0
#: Extra seconds an operation may take when the coordinator restarts or a node is lost during it.
RESTART_ALLOWANCE_S = 60.0
#: A DcrError's message names its fix when it names a call or a setting to use.
FIX = re.compile(r"Refit\.\w+\(|launch\(|resume=True|replace_owner|rejoin|relaunch|[A-Z][A-Za-z]+Config\.\w+")


def root(err: BaseException) -> BaseException:
    """The error an application raised, out of Ray's wrappers (``RayTaskError(...).cause``)."""
    while getattr(err, "cause", None) is not None and err.cause is not err:
        err = err.cause
    return err


def message(err: BaseException) -> str:
    e = root(err)
    return f"{type(e).__name__}: {e}"


def names_fix(err: BaseException) -> bool:
    return isinstance(root(err), DcrError) and FIX.search(str(root(err))) is not None


def op_bound_s(restarts: bool) -> float:
    """The longest one refit call may take: every attempt's stages at their timeout, the sweeps and aborts
    between them, and (when the coordinator restarts or a node goes) the restart itself."""
    return MAX_ATTEMPTS * 5 * STAGE_TIMEOUT_S + 2 * STAGE_TIMEOUT_S + (RESTART_ALLOWANCE_S if restarts else 0.0)


def alive(handle) -> bool:
    """Whether an actor answers (a call to it fails with a dead actor's error only when it is dead)."""
    try:
        ray.get(handle.__ray_call__.remote(lambda self: True), timeout=30)
        return True
    except ray.exceptions.RayActorError:
        return False
    except Exception:  # noqa: BLE001 - slow, not dead
        return True


def balanced_shares(spec: ModelSpec, world: int, steps: int = 4) -> list[list[str]]:
    """The model's tensor names split between ``world`` owners so that each streams a like number of frames:
    each tensor weighs the frames the real codec makes of its change in one AdamW step at :data:`LR` (after a
    few: the lm head changes densely, the embedding only in the rows a batch used), the heaviest first, each
    to the owner with the lightest load so far. (A stable hash of the names, ``owned_names``, gives one owner
    3x the frames of the other.)"""
    from dcr_ray.codec import FrameMeta, bits_view, diff_tensor, encode_frames

    trainer = TinyTrainer(spec, lr=LR)
    for seed in range(1, steps):
        trainer.step(seed=10_000 + seed)
    before = {n: t.clone() for n, t in trainer.rollout_state().items()}
    trainer.step(seed=10_000 + steps)
    after = trainer.rollout_state()
    meta = FrameMeta(transfer="t", attempt=0, producer="o", payload=0, base=0, target=1)
    weight = {}
    for n in after:
        delta = diff_tensor(n, bits_view(before[n]), after[n], chunk_elems=CHUNK_ELEMS)
        frames = list(encode_frames([delta], meta, bucket_bytes=BUCKET_BYTES)) if delta.chunks else []
        weight[n] = sum(len(f) for f in frames) + 1
    shares: list[list[str]] = [[] for _ in range(world)]
    load = [0] * world
    for name in sorted(weight, key=lambda n: (-weight[n], n)):
        i = load.index(min(load))
        shares[i].append(name)
        load[i] += weight[name]
    return shares


class Fleet:
    """The Ray cluster all combinations run on."""

    def __init__(self):
        self.nodes = LocalClusters(("a", "b"), head_train=False)
        self.nodes.add_train()
        self.nodes.serve_node_faults(NAMESPACE)

    def restore_nodes(self) -> list[str]:
        """Add back a node for every one the faults removed; returns their clusters."""
        back = []
        while self.nodes.killed:
            cluster, _ = self.nodes.killed.pop(0)
            if cluster == "train":
                self.nodes.add_train()
            else:
                self.nodes.add(cluster)
            back.append(cluster)
        return back

    def shutdown(self, refit=None) -> None:
        self.nodes.shutdown(refit)


class Bench:
    """One topology (an apply mode, a transport) on the fleet, with its trainers and their oracle."""

    def __init__(self, fleet: Fleet, mode: str, transport: str, spec: ModelSpec = ModelSpec(size="tiny")):
        self.fleet, self.mode, self.transport, self.spec = fleet, mode, transport, spec
        self.seed = 0
        self.oracle: dict[int, dict[str, torch.Tensor]] = {}
        #: the last scenario's final check found something: the next one checks and repairs first
        self.dirty = False
        #: scenarios run on this topology (its hits per refit are counted again every so many)
        self.scenarios = 0
        self._launch()

    # -- the topology ---------------------------------------------------------------------------------
    def _launch(self) -> None:
        self.Trainer = ray.remote(num_cpus=0, resources={"train": 0.01})(TinyTrainer)
        self.shares = balanced_shares(self.spec, 2)
        self.owners = {f"owner{r}": self.Trainer.remote(self.spec, lr=LR, owns=self.shares[r]) for r in range(2)}
        self.work = tempfile.mkdtemp(prefix="dcr_matrix_")
        env = {"runtime_env": {"env_vars": {failpoints.ENV: ""}}}  # each start looks for a plan left for it
        self.config = dcr_ray.RefitConfig(
            namespace=NAMESPACE,
            codec=dcr_ray.CodecConfig(key=KEY, bucket_bytes=BUCKET_BYTES, chunk_elems=CHUNK_ELEMS),
            transport=dcr_ray.TransportConfig(kind=self.transport),
            commit=dcr_ray.CommitConfig(dir=os.path.join(self.work, "commit"), timeout_s=STAGE_TIMEOUT_S,
                                        max_attempts=MAX_ATTEMPTS, start_timeout_s=600.0),
            engines=dcr_ray.EngineConfig(apply=self.mode, hold_s=0.0 if self.mode == "in_place" else None),
            actor_options={"coordinator": {"resources": LocalClusters.HEAD, **env}, "engine": dict(env)})
        self.clusters = [dcr_ray.ClusterSpec(name="a", engines=2, resources=LocalClusters.resources("a")),
                         dcr_ray.ClusterSpec(name="b", engines=3, fanout=2, resources=LocalClusters.resources("b"))]
        self.refit = dcr_ray.launch(owners=dict(self.owners), clusters=self.clusters, config=self.config,
                                    engine=dcr_ray.HFEngine(self.spec))
        self.oracle = {0: ray.get(self.owners["owner0"].rollout_state.remote())}
        #: the trainer's whole state (weights, AdamW) at the committed version and now, kept only while a
        #: scenario may lose an owner (a replacement is restored from them): :meth:`keep_owner_state`
        self.ckpt: dict = {"committed": None, "now": None}
        self.snapshot = self.oracle[0]
        for _ in range(WARMUP_REFITS):
            self.step()
            self.refit.run(timeout=300)
            self.bind()

    def relaunch(self) -> None:
        """Tear the topology down and start it again (what a ``relaunch`` fix means)."""
        self.shutdown()
        self.fleet.restore_nodes()
        self._launch()

    def shutdown(self) -> None:
        try:
            self.refit.shutdown(force=True)
        except Exception:
            pass
        for h in self.owners.values():
            try:
                ray.kill(h)
            except Exception:
                pass

    def resume(self) -> None:
        """``launch(..., resume=True)`` with what the topology was launched with (a fix errors name)."""
        self.refit = dcr_ray.launch(owners=dict(self.owners), clusters=self.clusters, config=self.config,
                                    engine=dcr_ray.HFEngine(self.spec), resume=True)

    def handles(self) -> dict:
        h = self._ask("handles")
        return {"owners": dict(self.owners), "engines": h["engines"], "relays": h["relays"],
                "coordinator": self.refit.actor}

    def process(self, target: str):
        """The actor handle of ``target`` (``owner0``, a relay id, an engine id, ``coordinator``)."""
        h = self.handles()
        if target == "coordinator":
            return h["coordinator"]
        for kind in ("owners", "engines", "relays"):
            if target in h[kind]:
                return h[kind][target]
        raise KeyError(f"no process {target!r} in this topology ({self.transport})")

    # -- the trainer: steps and the oracle -----------------------------------------------------------
    def step(self) -> None:
        """One real AdamW step on both replicas; the trainer's tensors are what the next refit must deliver."""
        self.seed += 1
        ray.get([o.step.remote(seed=self.seed) for o in self.owners.values()], timeout=120)
        self.snapshot = ray.get(self.owners["owner0"].rollout_state.remote(), timeout=60)
        if self.ckpt["committed"] is not None:
            self.ckpt["now"] = ray.get(self.owners["owner0"].train_state.remote(), timeout=60)

    def keep_owner_state(self, keep: bool) -> None:
        """Before a scenario that may lose an owner (``keep``): the trainer's state now is the committed
        version's (:meth:`ensure` saw to it), kept so that a replacement can be restored to it."""
        state = ray.get(self.owners["owner0"].train_state.remote(), timeout=60) if keep else None
        self.ckpt = {"committed": state, "now": state}

    def bind(self) -> int:
        """After an operation: a version the record newly holds is the trainer's tensors read before it."""
        v = self.status()["version"]
        if v not in self.oracle:
            self.oracle[v] = self.snapshot
            self.ckpt["committed"] = self.ckpt["now"]
        return v

    def status(self, detail: bool = False) -> dict:
        return self._ask("status", detail)

    def _ask(self, method: str, *args):
        """A call of the coordinator's; while it restarts (Ray answers "temporarily unavailable"), made again
        for up to :data:`RESTART_ALLOWANCE_S`."""
        deadline = time.monotonic() + RESTART_ALLOWANCE_S
        while True:
            try:
                return ray.get(getattr(self.refit.actor, method).remote(*args), timeout=60)
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    # -- recovery (the fixes errors name) ---------------------------------------------------------------
    def dead_owners(self) -> list[str]:
        dead = []
        for oid, h in self.owners.items():
            try:
                ray.get(h.dcr_version.remote(), timeout=30)
            except ray.exceptions.RayActorError:
                dead.append(oid)
            except Exception:
                pass  # alive (a sticky promote error answers with it)
        return dead

    def replace_owners(self, oids: list[str]) -> None:
        """Each owner in ``oids`` replaced by a new replica restored to the committed version (its digests then
        match the engines'), which then catches up with the trainer's current step."""
        if self.ckpt["committed"] is None:
            raise RefitError(f"owners {oids} died in a scenario that was not expected to lose one")
        for oid in oids:
            rank = int(oid.removeprefix("owner"))
            new = self.Trainer.remote(self.spec, lr=LR, owns=self.shares[rank])
            ray.get(new.load_train_state.remote(self.ckpt["committed"]), timeout=120)
            self.refit.replace_owner(oid, new)
            ray.get(new.load_train_state.remote(self.ckpt["now"]), timeout=120)
            old, self.owners[oid] = self.owners[oid], new
            ray.kill(old)  # dead already, or alive with a baseline the record no longer matches

    def heal(self, bound_s: float = HEAL_BOUND_S) -> list[str]:
        """Wait until no engine heals (rejoining each whose heal failed: the fix its error names); returns
        what it did. Raises :class:`RefitTimeoutError` past ``bound_s`` (a hung heal)."""
        did, deadline = [], time.monotonic() + bound_s
        for _ in range(3):
            try:
                self.refit.wait_healed(timeout=max(1.0, deadline - time.monotonic()))
                return did
            except RefitTimeoutError:
                raise
            except RefitError as e:
                failed = sorted(e for e, r in self.status()["healing"].items() if r["standing"] == "failed")
                for eid in failed:
                    did.append(f"rejoin {eid}")
                    try:
                        self.refit.rejoin(eid)
                    except DcrError as err:
                        did.append(f"rejoin {eid} failed: {type(err).__name__}: {str(err)[:200]}")
        self.refit.wait_healed(timeout=max(1.0, deadline - time.monotonic()))
        return did

    def fix(self, err: BaseException | None, warnings: list[str] = ()) -> list[str]:
        """Apply what ``err``, or a committed report's ``warnings``, name (replace dead owners or owners that did
        not promote, resume, relaunch) and what the faults left (nodes removed); returns what it did."""
        did = [f"node of {c} added back" for c in self.fleet.restore_nodes()]
        msg = "" if err is None else message(err)
        if err is not None and ("relaunch the topology" in msg):
            self.relaunch()
            return [*did, "relaunched"]
        if err is not None and ("could not resume" in msg or "resume=True" in msg):
            # launch() refuses while a coordinator runs in the namespace, even one that could not resume
            ray.kill(self.refit.actor, no_restart=True)
            self.resume()
            did.append("coordinator killed, launch(resume=True)")
        dead = self.dead_owners()
        stale = sorted({o for w in warnings if "did not promote" in w for o in re.findall(r"'(owner\d+)'", w)})
        if dead or stale:
            self.replace_owners(sorted({*dead, *stale}))
            why = " (as the report's warning says)" if stale else ""
            did.append(f"replace_owner {sorted({*dead, *stale})}{why}")
        return did

    def ensure(self) -> list[str]:
        """Before a scenario: the fleet whole (every node, every owner, every engine required at the committed
        version); what is not is repaired (rejoin, else a relaunch). Returns what it did."""
        did = self.fix(None)
        try:
            self.heal()
            if self.dirty:  # engines whose bits differ from the trainer's heal again (the user's repair)
                for w in self.check(generate=False)["wrong_bits"]:
                    did.append(f"invalidate {w['engine']} (bits differ from the trainer's before the scenario)")
                    self.refit.invalidate(w["engine"], "its bits differ from the trainer's")
                self.heal()
                if self.check(generate=False)["wrong_bits"]:
                    raise RefitError("engines still differ from the trainer after a heal")
                self.dirty = False
            dead = [r for r, h in self.handles()["relays"].items() if not alive(h)]
            if dead:  # the refit's retry re-creates them (what the next refit would do anyway)
                did.append(f"relays {dead} dead before the scenario: a quiet refit")
                self.refit.run(timeout=120)
                self.bind()
                if any(not alive(h) for h in self.handles()["relays"].values()):
                    raise RefitError(f"relays {dead} stay dead")
            if self.oracle.get(self.status()["version"]) is not self.snapshot:  # the trainer is ahead
                self.refit.run(timeout=120)
                self.bind()
                did.append("a quiet refit (the trainer was ahead of the record)")
            st = self.status()
            missing = sorted(set(st["engines"]) - set(st["required"]))
            for eid in missing:
                did.append(f"rejoin {eid} (not required before the scenario)")
                self.refit.rejoin(eid)
            st = self.status()
            if set(st["required"]) != set(st["engines"]):
                raise RefitError(f"engines {sorted(set(st['engines']) - set(st['required']))} stay out")
        except Exception as e:  # noqa: BLE001 - start from a clean topology
            did.append(f"relaunched ({type(e).__name__}: {str(e)[:160]})")
            self.relaunch()
        return did

    # -- the checks ------------------------------------------------------------------------------------
    def check(self, generate: bool = True) -> dict:
        """``{"wrong_bits": [...], "problems": [...], "notes": [...]}`` of the topology as it stands (see the
        module doc). An engine evicted as hung is a note: it rejoins at a later refit, once it answered."""
        st = self.status(detail=True)
        v, rec = st["version"], st["commit_record"]
        wrong, problems, notes = [], [], []
        if rec is None or rec["version"] != v:
            problems.append(f"the record holds {rec and rec['version']}, the coordinator {v}")
        engines = self.handles()["engines"]
        for es in st["engine_states"]:
            e = es["engine"]
            if not es.get("required"):
                (notes if es.get("standing") == "evicted" else problems).append(
                    f"engine {e} is not required after the heals ({es.get('standing')})")
            if es.get("required") and es.get("version") != v:
                problems.append(f"required engine {e} holds {es.get('version')}, the record {v}")
            if es.get("phase") not in ("ready", "parked", "staging") or es.get("version") is None:
                if es.get("required"):
                    problems.append(f"required engine {e} is {es.get('phase')}")
                continue
            want = self.oracle.get(es["version"])
            if want is None:
                problems.append(f"engine {e} serves v{es['version']}, which no operation of this run committed")
                continue
            got = ray.get(engines[e].tensors.remote(), timeout=60)
            bad = [n for n in want if not torch.equal(got[n].view(torch.int16), want[n].view(torch.int16))]
            if bad:
                elems = sum(int((got[n].view(torch.int16) != want[n].view(torch.int16)).sum()) for n in bad)
                wrong.append({"engine": e, "version": es["version"], "phase": es["phase"], "tensors": len(bad),
                              "elements": elems, "required": bool(es.get("required"))})
            if not generate:
                continue
            try:
                ans = ray.get(engines[e].generate.remote([[1, 2, 3]], 1, timeout_s=STAGE_TIMEOUT_S), timeout=60)
                if ans["version"] != es["version"]:
                    problems.append(f"engine {e} generated with v{ans['version']}, it serves v{es['version']}")
            except Exception as err:
                problems.append(f"ready engine {e} did not generate: {type(err).__name__}: {str(err)[:160]}")
        return {"version": v, "wrong_bits": wrong, "problems": problems, "notes": notes}

    # -- failpoints in every process -------------------------------------------------------------------
    def disarm_all(self) -> dict:
        """Disarm every process of the topology; returns each one's report (hits counted, faults fired)."""
        out = {}
        for kind, procs in self.handles().items():
            if kind == "coordinator":
                procs = {"coordinator": procs}
            for name, h in procs.items():
                try:
                    out[name] = fp_remote.report_of(h, disarm=True, timeout_s=30)
                except Exception:
                    pass  # dead: nothing armed there any more
        from dcr_ray.options import COORDINATOR_NAME

        fp_remote.clear_next_start(COORDINATOR_NAME)
        for eid in self.handles()["engines"]:
            fp_remote.clear_next_start(engine_name(eid))
        return out
