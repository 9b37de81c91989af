"""Configuration of a refit topology. Every field is documented; invalid settings fail fast with a
message that says how to fix them. Constructors only check; :func:`validate` (run by
:func:`dcr_ray.launch` before anything is spawned) checks the objects together and fills defaults
that need the file system (temporary directories).

Two environment variables exist: ``DCR_RAY_JIT=0`` selects the codec's numpy apply path instead of the
numba kernels (both write the same bits; see :mod:`dcr_ray.codec.compiled.kernels`), and
``DCR_RAY_FAILPOINTS`` arms a fault plan for failure drills (:mod:`dcr_ray.failpoints`; set it per kind of
actor through ``RefitConfig.actor_options``).
"""

from __future__ import annotations

import dataclasses
import math
import re
import tempfile
from dataclasses import dataclass, field
from typing import Literal, Mapping, get_args

from dcr_ray.codec.format import MAX_BUCKET_BYTES
from dcr_ray.errors import ConfigError
from dcr_ray.options import NAMESPACE, check_user_options

__all__ = ["ApplyMode", "ClusterSpec", "CodecConfig", "Coding", "CommitConfig", "EngineConfig", "Encodings",
           "OwnerConfig", "PlacementStrategy", "PromoteMode", "RefitConfig", "SwitchMode", "TransportConfig",
           "TransportKind", "validate"]

TransportKind = Literal["relay", "object_store"]
TRANSPORTS: tuple[str, ...] = get_args(TransportKind)
Encodings = Literal["mixed", "overwrite"]
ApplyMode = Literal["in_place", "staged"]
SwitchMode = Literal["in_flight", "drain"]
RollbackMode = Literal["in_place", "dense"]
PromoteMode = Literal["background", "inline"]
GpuBaseline = Literal["device", "host"]
Coding = Literal["auto", "context", "plain"]
CODINGS: tuple[str, ...] = get_args(Coding)
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


@dataclass(kw_only=True, slots=True)
class ClusterSpec:
    """A group of rollout engines behind one cluster boundary (e.g. one region)."""

    name: str
    """Cluster name, e.g. ``"us-east"``; appears in reports (wire bytes per cluster link) and actor names."""
    engines: int | None = None
    """Engines dcr_ray starts in this cluster with ``launch(engine=...)`` (default: 1, or 0 when
    ``adopt`` is given). Their ids are ``<cluster>/e<i>``."""
    adopt: list = field(default_factory=list)
    """Engines dcr_ray did not start, as engine factories, e.g.
    ``dcr_ray.engines.vllm.AdoptedVllmEngine(handle, checkpoint=...)`` (a vLLM Ray actor) or
    ``dcr_ray.engines.vllm.AdoptedVllmServer("http://host:8000", checkpoint=...)`` (a ``vllm serve``
    process): dcr_ray starts a light proxy engine actor for each (ids ``<cluster>/a<i>``) that drives the
    engine through its own API. Joining, an adopted engine that already serves the committed version
    (checked by digest) is not bootstrapped densely."""
    resources: dict[str, float] = field(default_factory=dict)
    """Ray custom resources that pin this cluster's relays and engines to its nodes, e.g.
    ``{"cluster-us-east": 0.001}`` when nodes were started with ``--resources='{"cluster-us-east": 100}'``.
    Empty: no pinning (a single-machine run)."""
    fanout: int = 4
    """How many children (engines or sub-relays) one relay forwards to inside the cluster."""
    gpus_per_engine: float = 0
    """GPUs Ray reserves for each engine dcr_ray starts (a vLLM engine with ``tensor_parallel_size=N``
    on GPUs: ``N``, with ``placement`` set so its workers land in the engine's bundle)."""
    cpus_per_engine: float = 0
    """CPUs Ray reserves for each engine dcr_ray starts (0: engines share the node's CPUs)."""
    placement: PlacementStrategy | None = None
    """``None``: Ray schedules each engine on its own. Otherwise one Ray placement group per cluster
    with a bundle per started engine (its GPUs, CPUs and the cluster's ``resources``), placed with
    this strategy (``"PACK"``, ``"SPREAD"``, ``"STRICT_PACK"``, ``"STRICT_SPREAD"``); each engine runs
    in its bundle and so do the workers it starts. ``launch()`` fails with ``ConfigError`` when the
    group cannot be placed within ``CommitConfig.timeout_s``."""

    def __post_init__(self):
        if not isinstance(self.name, str) or not _CLUSTER_NAME.fullmatch(self.name):
            raise ConfigError(f"ClusterSpec.name {self.name!r} must be letters, digits, '.', '_' or '-' (it "
                              f"becomes part of actor names such as 'dcr_engine:<name>/e0'), e.g. 'us-east'")
        if not isinstance(self.resources, dict) or not all(
                isinstance(k, str) and k and not isinstance(v, bool) and isinstance(v, (int, float))
                and math.isfinite(v) and v > 0 for k, v in self.resources.items()):
            raise ConfigError(f"ClusterSpec({self.name}).resources must map Ray resource names to amounts > 0, "
                              f"e.g. {{'cluster-{self.name}': 0.001}}; got {self.resources!r}")
        for f in ("engines", "fanout"):
            v = getattr(self, f)
            if (v is not None or f == "fanout") and (isinstance(v, bool) or not isinstance(v, int)):
                raise ConfigError(f"ClusterSpec({self.name}).{f} must be an integer, got {v!r}")
        if not isinstance(self.adopt, list) or not all(callable(a) for a in self.adopt):
            raise ConfigError(f"ClusterSpec({self.name}).adopt must be a list of engine factories "
                              f"(e.g. AdoptedVllmEngine(handle, checkpoint=...) or "
                              f"AdoptedVllmServer('http://host:8000', checkpoint=...))")
        if self.engines is not None and self.engines < 0:
            raise ConfigError(f"ClusterSpec({self.name}).engines must be >= 0, got {self.engines}")
        if self.started + len(self.adopt) < 1:
            raise ConfigError(f"ClusterSpec({self.name}) has no engine: set engines >= 1 or adopt=[...]")
        if self.fanout < 2:
            raise ConfigError(f"ClusterSpec({self.name}).fanout must be >= 2, got {self.fanout}")
        for f in ("gpus_per_engine", "cpus_per_engine"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ConfigError(f"ClusterSpec({self.name}).{f} must be a finite number >= 0, got {v!r}")
        if self.placement is not None:
            _choice(f"ClusterSpec({self.name})", "placement", self.placement, get_args(PlacementStrategy))
            if not (self.gpus_per_engine or self.cpus_per_engine or self.resources):
                raise ConfigError(f"ClusterSpec({self.name}).placement needs something to reserve per engine: "
                                  f"set gpus_per_engine, cpus_per_engine or resources")

    @property
    def started(self) -> int:
        """How many engines dcr_ray starts here."""
        if self.engines is not None:
            return self.engines
        return 0 if self.adopt else 1


def _choice(owner: str, name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ConfigError(f"{owner}.{name} must be one of {allowed}, got {value!r}")


def _int_in(owner: str, name: str, value, lo: int, hi: int, why: str = "") -> None:
    """``value`` is an integer (not a bool, not a float) in ``lo..hi``."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"{owner}.{name} must be an integer in {lo}..{hi}{why}, got {value!r}")


#: What a cluster name may hold: it becomes part of actor names (``dcr_engine:<cluster>/e0``) and metric tags.
_CLUSTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(kw_only=True, slots=True)
class CodecConfig:
    """How owners encode payload frames."""

    bucket_bytes: int = 16 << 20
    """Upper bound (raw, before compression) of one payload frame. 16 MiB by default: at a 3% change
    rate one BF16 frame then covers ~0.25 B elements, so payloads of models from ~1 B parameters up
    stream while the owner still diffs."""
    chunk_elems: int = 1 << 20
    """Elements per diff chunk (and per frame item); a chunk is DENSE or sparse as a whole. Must satisfy
    ``chunk_elems * 8 <= bucket_bytes``."""
    zstd_level: int = 1
    """zstd level of frame sections, 1..22 (see ``dcr-ray bench codec`` for the measured trade-off);
    0 stores sections raw (no compression: for links fast enough that zstd costs more than it saves,
    and for benchmarks that must move the canonical bytes themselves)."""
    encodings: Encodings = "mixed"
    """``"mixed"``: XOR masks where allowed, absolute bits elsewhere (every retry sends ``"overwrite"``
    anyway). ``"overwrite"``: absolute new bits only."""
    coding: Coding = "auto"
    """How ``"mixed"`` first attempts code their relative chunks. ``"plain"``: XOR masks at flat
    positions; receivers write only the changed elements. ``"context"``: XOR masks or integer differences
    and flat or class-order positions, picked per item; 0.54-0.72x the bytes of ``"plain"`` on AdamW
    refits (``dcr-ray bench codec``), for more CPU on both sides: each class-ordered item's whole range
    of old bits is walked by the sender and by every receiver. ``"auto"`` (default): the coordinator
    decides per refit from what recent refits measured, context where the link bounds the refit and plain
    where the CPU does, and records the choice and why in the report (``RefitReport.coding`` /
    ``coding_reason``; :mod:`dcr_ray.actors.coordinator.coding`). Owners encode once for every cluster, so
    ``"auto"`` judges the slowest cluster link the refit feeds. An owner streaming without a coordinator
    (vLLM's trainer-side weight transfer) codes ``"auto"`` plainly. Not ``"context"`` with vLLM's capture
    mode under tensor parallelism: a rank holds only its shard, cannot read the old bits class order
    needs, and fails the attempt (the overwrite retry repairs it, at the cost of a second send); ``"auto"``
    turns back to plain for a while after a context refit that needed a retry."""
    link_mbps: float | dict[str, float] | None = None
    """The cluster links' throughput in Mbit/s for ``coding="auto"``: one figure for every cluster, or a
    figure per cluster name (every cluster named). ``None`` (default): measured, from the bytes the
    relays (or object-storage reads) counted into each cluster over recent refits' stream time."""
    key: bytes | None = None
    """Shared secret for keyed BLAKE2b frame digests; receivers reject frames not signed with it."""

    def __post_init__(self):
        _int_in("CodecConfig", "chunk_elems", self.chunk_elems, 1, 1 << 31)
        _int_in("CodecConfig", "bucket_bytes", self.bucket_bytes, 1 << 12, MAX_BUCKET_BYTES,
                " (4 KiB up to the largest bucket: receivers refuse to inflate frames over two buckets of it)")
        if self.chunk_elems * 8 > self.bucket_bytes:
            raise ConfigError(
                f"CodecConfig.chunk_elems * 8 ({self.chunk_elems * 8}) must not exceed bucket_bytes "
                f"({self.bucket_bytes}): lower chunk_elems or raise bucket_bytes"
            )
        if not (isinstance(self.zstd_level, int) and 0 <= self.zstd_level <= 22):
            raise ConfigError(f"CodecConfig.zstd_level must be an integer in 0..22 (0: no compression, 1 is the "
                              f"fastest zstd), got {self.zstd_level!r}")
        _choice("CodecConfig", "encodings", self.encodings, get_args(Encodings))
        _choice("CodecConfig", "coding", self.coding, CODINGS)
        self._check_link_mbps()
        if self.key is not None and not (isinstance(self.key, bytes) and 1 <= len(self.key) <= 64):
            raise ConfigError("CodecConfig.key must be bytes of length 1..64 (a BLAKE2b key) or None")

    def _check_link_mbps(self) -> None:
        v = self.link_mbps
        if v is None:
            return
        if self.coding != "auto":
            raise ConfigError(f"CodecConfig.link_mbps informs coding='auto' only; with coding={self.coding!r} "
                              f"drop link_mbps (or set coding='auto')")
        figures = v.items() if isinstance(v, dict) else [("", v)]
        for name, mbps in figures:
            if not isinstance(name, str) or isinstance(mbps, bool) or not isinstance(mbps, (int, float)) \
                    or not math.isfinite(mbps) or mbps <= 0:
                raise ConfigError(f"CodecConfig.link_mbps must be a finite number of Mbit/s > 0, or a dict "
                                  f"cluster name -> such a number (e.g. {{'us-east': 1000}}); got {v!r}")
        if isinstance(v, dict) and not v:
            raise ConfigError("CodecConfig.link_mbps is an empty dict: name every cluster, or use None (measured)")


@dataclass(kw_only=True, slots=True)
class TransportConfig:
    """How payloads travel from owners to engines."""

    kind: TransportKind = "relay"
    """``"relay"`` (Ray object store through a relay tree per cluster; each payload crosses each cluster
    boundary once) or ``"object_store"`` (one object per payload; each engine reads its copy)."""
    storage_url: str | None = None
    """Object-storage root for ``kind="object_store"``: a local directory (default: a fresh temp
    directory, made by :func:`validate`) or an fsspec URL such as ``s3://bucket/prefix``."""
    storage_options: dict[str, object] = field(default_factory=dict)
    """Extra fsspec options for ``storage_url`` (e.g. ``{"client_kwargs": {"endpoint_url": ...}}``)."""
    max_inflight_payloads: int = 8
    """Payloads an owner may have sent but not yet had acknowledged by the first hop (backpressure)."""
    catchup_window_bytes: int = 1 << 30
    """Wire bytes of committed payloads each cluster keeps after their commit (the relay tree in its head
    relay's object store, object storage under the transfer's prefix), so an engine a few versions
    behind catches up with the deltas it missed instead of a dense copy (:mod:`dcr_ray.relay.window`).
    Size it to cover the versions an engine may lag by (e.g. 3 x a refit's ``wire_bytes``); 0 keeps
    none (lagging engines then copy from a peer of their cluster)."""

    def __post_init__(self):
        _choice("TransportConfig", "kind", self.kind, TRANSPORTS)
        _int_in("TransportConfig", "max_inflight_payloads", self.max_inflight_payloads, 1, 1024)
        _int_in("TransportConfig", "catchup_window_bytes", self.catchup_window_bytes, 0, 1 << 50)


@dataclass(kw_only=True, slots=True)
class CommitConfig:
    """How refits are committed and retried."""

    dir: str | None = None
    """Directory of the durable commit record (default: a fresh temp directory, made by :func:`validate`)."""
    max_attempts: int = 3
    """Attempts per refit; every retry sends OVERWRITE payloads of the complete changed set."""
    timeout_s: float = 300.0
    """Timeout of every wait in a refit (prepare, stream, flush, commit); exceeded -> RefitTimeoutError.
    An engine that is alive but does not answer prepare or flush within it is evicted (hung) and rejoins
    when it answers again."""
    start_timeout_s: float = 1800.0
    """Timeout of the waits of start-up and dense bootstrap (owners attaching, engines loading the
    model, dense frames of the whole model): these move the whole model, not a delta."""

    def __post_init__(self):
        if self.dir is not None and not (isinstance(self.dir, str) and self.dir.strip()):
            raise ConfigError(f"CommitConfig.dir must be a directory path (or None for a fresh temporary "
                              f"directory), got {self.dir!r}")
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ConfigError(f"CommitConfig.max_attempts must be an integer >= 1, got {self.max_attempts!r}")
        for name in ("timeout_s", "start_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(f"CommitConfig.{name} must be a finite number of seconds > 0, got {v!r}")


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """How engines take a new version."""

    apply: ApplyMode = "in_place"
    """``"in_place"`` (synchronous RL, the default): payloads are applied as they arrive and generation
    pauses from the refit's start until the new version is active. ``"staged"`` (async RL): engines
    validate and decode arriving payloads while they serve the current version, and write them all once
    the commit record is durable: generation pauses only for those writes (``EngineActor.pauses()``,
    ``dcr-ray bench live``)."""
    staging_budget_bytes: int = 4 << 30
    """Most bytes one engine holds staged (``apply="staged"``) for one attempt: the decoded positions and
    values of its frames; a refit that needs more fails at once with ``StagingBudgetError`` and changes
    nothing. In-place engines keep no payload after applying it."""
    rollback: RollbackMode = "in_place"
    """An engine that applied part of an abandoned transfer: ``"in_place"`` returns it to the committed
    version from its own undo record (the bits each write replaced; memory proportional to the changes,
    dropped at commit), so it keeps serving without owners; ``"dense"`` (and backends that cannot read
    their bits, such as adopted engines) marks it dirty and the coordinator re-bootstraps it densely."""

    switch: SwitchMode = "in_flight"
    """Where a version switch may fall in a running request. ``"in_flight"`` (the default): between two of
    its decoding steps. The engine stops decoding at the next step boundary (it waits for the step in
    progress only, never for a request to finish), writes the committed version, and the same requests
    resume on it with the KV cache they hold; each answer's ``versions`` says which version produced which
    tokens, and no request admitted after the switch reuses a prefix cached under an older version.
    ``"drain"``: the engine stops admitting, waits until every running request has finished on the old
    version, then writes (one version per answer). With ``apply="staged"`` the decoding stops only for the
    writes at activation; in place it stops from the refit's ``prepare`` until the version is active, or
    until the engine sets its writes aside (``hold_s``) and serves the old version meanwhile. Backends that cannot stop between steps (adopted vLLM
    engines, whose framework pauses them itself; custom backends) drain."""

    hold_s: float | None = 0.5
    """How long an in-place engine holds the writes of a refit it has applied (flushed) while the refit
    waits for others (slower clusters, a retry, a lost node). Past it the engine sets its writes aside
    (swaps them with the bits they replaced, from its undo record) and serves its committed version again;
    activation writes them back (a short second pause). ``None`` holds them, paused, until the commit.
    Needs an undo record (``rollback="in_place"`` and a backend that reads its tensors); staged engines
    serve throughout anyway."""

    def __post_init__(self):
        _choice("EngineConfig", "apply", self.apply, get_args(ApplyMode))
        _choice("EngineConfig", "rollback", self.rollback, get_args(RollbackMode))
        _choice("EngineConfig", "switch", self.switch, get_args(SwitchMode))
        if self.hold_s is not None and (isinstance(self.hold_s, bool) or not isinstance(self.hold_s, (int, float))
                                        or not self.hold_s >= 0):
            raise ConfigError(f"EngineConfig.hold_s must be a number of seconds >= 0, or None to hold applied "
                              f"writes until the commit, got {self.hold_s!r}")
        if isinstance(self.staging_budget_bytes, bool) or not isinstance(self.staging_budget_bytes, int) \
                or self.staging_budget_bytes < 1:
            raise ConfigError(f"EngineConfig.staging_budget_bytes must be a positive integer, got "
                              f"{self.staging_budget_bytes!r}")


@dataclass(kw_only=True, slots=True)
class OwnerConfig:
    """How owners fold a committed version into their baselines."""

    promote: PromoteMode = "background"
    """``"background"``: a thread folds the committed changed set into the baseline, so the refit
    returns without waiting; the owner's next diff, bootstrap or version read waits for it (and a failed
    promote fails that call with ``BaselineError``). ``"inline"``: inside the commit stage."""
    gpu_baseline: GpuBaseline = "device"
    """Where the committed bits of an owner's GPU shards live. ``"device"``: a copy on the GPU (the
    shards' size again in GPU memory); each step is diffed there and only the changes cross to the
    host. ``"host"``: host memory only; each step copies the whole shard to the host and diffs it there
    (no extra GPU memory). CPU shards always use the host."""
    baseline_dir: str | None = None
    """Where an owner keeps the committed bits it holds on the host. ``None``: in the owner's memory,
    nothing written to disk. A directory (on the owner's node): memory-mapped files under it, so the
    kernel may evict clean pages when the host cannot hold a second copy of the shards; every page a
    promote changes is then written back to that disk after each commit (at 1% of the elements changed
    or more, every page of a BF16 shard), and the next promote faults on each page again."""

    def __post_init__(self):
        _choice("OwnerConfig", "promote", self.promote, get_args(PromoteMode))
        _choice("OwnerConfig", "gpu_baseline", self.gpu_baseline, get_args(GpuBaseline))
        if self.baseline_dir is not None and not (isinstance(self.baseline_dir, str) and self.baseline_dir.strip()):
            raise ConfigError(f"OwnerConfig.baseline_dir must be a directory path on the owners' nodes (or None to "
                              f"keep baselines in memory), got {self.baseline_dir!r}")


@dataclass(kw_only=True, slots=True)
class RefitConfig:
    """Everything about how refits run, grouped by concern; every group has working defaults.

    ::

        RefitConfig(transport=TransportConfig(kind="object_store", storage_url="s3://bucket/refits"),
                    codec=CodecConfig(key=b"shared-secret"), commit=CommitConfig(dir="/shared/dcr"))
    """

    codec: CodecConfig = field(default_factory=CodecConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    commit: CommitConfig = field(default_factory=CommitConfig)
    engines: EngineConfig = field(default_factory=EngineConfig)
    owners: OwnerConfig = field(default_factory=OwnerConfig)
    namespace: str = NAMESPACE
    """The Ray namespace of every actor of this topology (coordinator, engines, relays, the owners
    ``launch(owner_tensors=...)`` makes): two topologies (a policy and a reward model, two experiments)
    share one Ray cluster under two namespaces; ``Refit.get(namespace=...)`` reaches each."""
    actor_options: dict[str, dict] = field(default_factory=dict)
    """Ray actor options added per kind of actor, e.g. ``{"engine": {"runtime_env": {...}}, "relay":
    {"resources": {"relay-node": 0.01}}}``; kinds are ``coordinator``, ``owner`` (the owners
    ``launch(owner_tensors=...)`` makes), ``relay`` and ``engine``. Options dcr_ray sets itself (names,
    lifetime, concurrency, restarts; an engine's CPUs, GPUs and placement, which its ``ClusterSpec`` sets)
    are refused with the setting to use instead."""

    def __post_init__(self):
        self.actor_options = check_user_options(self.actor_options)
        if not isinstance(self.namespace, str) or not _CLUSTER_NAME.fullmatch(self.namespace):
            raise ConfigError(f"RefitConfig.namespace must be a non-empty name of letters, digits, '.', '_' "
                              f"or '-' (a Ray namespace), got {self.namespace!r}")
        for name, cls in (("codec", CodecConfig), ("transport", TransportConfig), ("commit", CommitConfig),
                          ("engines", EngineConfig), ("owners", OwnerConfig)):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"RefitConfig.{name} must be a dcr_ray.{cls.__name__}, got "
                                  f"{type(getattr(self, name)).__name__}")


def validate(config: RefitConfig, clusters: list[ClusterSpec], owners: Mapping[str, object],
             engine: object = None) -> RefitConfig:
    """Check a set-up as a whole before anything is spawned; returns ``config`` with defaults filled.

    Cluster names must be unique and at least one cluster given; at least one owner (``launch`` asks each
    whether it is one: :func:`~dcr_ray.actors.owner.held.check_owner`). Missing ``commit.dir`` /
    ``transport.storage_url`` become fresh temporary directories (on the driver's machine: set both for a
    multi-machine cluster).
    """
    if not isinstance(config, RefitConfig):
        raise ConfigError(f"config must be a dcr_ray.RefitConfig, got {type(config).__name__}")
    if not clusters or not all(isinstance(c, ClusterSpec) for c in clusters):
        raise ConfigError("give clusters=[dcr_ray.ClusterSpec(name=..., engines=...), ...] (at least one)")
    names = [c.name for c in clusters]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"cluster names must be unique; {dup} appear more than once")
    links = config.codec.link_mbps
    if isinstance(links, dict) and set(links) != set(names):
        raise ConfigError(f"CodecConfig.link_mbps names clusters {sorted(links)}, the clusters are {sorted(names)}: "
                          f"give a figure for each cluster (or one number for all)")
    for c in clusters:
        for kind in ("relay", "engine"):
            clash = sorted(set(config.actor_options.get(kind, {}).get("resources", {})) & set(c.resources))
            if clash:
                raise ConfigError(f"actor_options[{kind!r}]['resources'] sets {clash}, which ClusterSpec({c.name}) "
                                  f".resources already pins: set each resource in one place")
    if not owners:
        raise ConfigError("at least one owner is needed: owners=[trainer actors] or owner_tensors=[...]")
    starts = [c.name for c in clusters if c.started]
    if starts and not callable(engine):
        raise ConfigError(f"clusters {starts} start engines: give launch(engine=...) an engine factory, e.g. "
                          f"dcr_ray.HFEngine('/path/to/checkpoint'), or adopt engines instead")
    if config.commit.dir is None:
        config = dataclasses.replace(config, commit=dataclasses.replace(
            config.commit, dir=tempfile.mkdtemp(prefix="dcr_commit_")))
    if config.transport.kind == "object_store" and config.transport.storage_url is None:
        config = dataclasses.replace(config, transport=dataclasses.replace(
            config.transport, storage_url=tempfile.mkdtemp(prefix="dcr_objstore_")))
    return config
