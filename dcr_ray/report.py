"""What a refit returns: the committed version and where the time and bytes went."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(kw_only=True, slots=True)
class RefitReport:
    version: int
    """The version every required engine now holds (the commit record's version)."""
    transfer: str
    """Transfer id (names objects, payload keys and the commit record)."""
    attempts: int
    """Attempts used; ``attempts - 1`` retries (each retry sends OVERWRITE payloads)."""
    seconds: dict = field(default_factory=dict)
    """``construct`` (max owner diff+encode), ``apply`` (max engine validate+apply+flush),
    ``stream`` (wall: first diff to last engine ACK; construct, transport and apply overlap in it),
    ``transport`` (``stream`` minus the non-overlapped construct tail, an upper bound on link time),
    ``commit`` (record + promote + activate, also split as ``commit_record``, ``promote`` and
    ``activate``), ``prepare``, ``release`` (from the call's arrival until every owner's diff had read
    the last of the trainer's tensors: from then on the owners hold the changes themselves, so its next
    optimizer step may start while frames still travel) and ``total``
    (from the call's arrival: it includes waiting for a refit or a heal step that held the coordinator)."""
    payloads: int = 0
    """Payload frames sent (per attempt that committed)."""
    wire_bytes: int = 0
    """Bytes of all frames produced by owners (what a single cross-cluster copy carries)."""
    link_bytes: dict = field(default_factory=dict)
    """Cluster -> bytes that entered the cluster (relay heads / object-storage reads)."""
    changed: int = 0
    """Canonical elements whose bits changed."""
    numel: int = 0
    """Canonical elements in the model."""
    engine_versions: dict = field(default_factory=dict)
    """Engine id -> version it holds after the refit."""
    dropped_engines: list = field(default_factory=list)
    """Engines that died and left the required set during this refit (re-join by dense bootstrap)."""
    mode: str = "mixed"
    """Encoding of the committed attempt: ``mixed`` (XOR + OVERWRITE) or ``overwrite``."""
    warnings: list = field(default_factory=list)
    """Failures after the commit record was written (the refit still committed): an owner that did
    not promote, an engine that did not activate and left the required set."""
    coding: str = "plain"
    """Coding of the first attempt's relative items: ``plain`` or ``context`` (``CodecConfig.coding``;
    with ``"auto"``, what the coordinator chose for this refit)."""
    coding_reason: str = ""
    """Why that coding: configured, or ``"auto"``'s comparison of link and codec throughput, with its
    figures (:mod:`dcr_ray.actors.coordinator.coding`)."""
    coding_inputs: dict = field(default_factory=dict)
    """The figures ``"auto"`` compared: the slowest fed link's bytes/s and where that figure comes from,
    the changed elements it planned for, and per coding the predicted link and codec seconds."""
    cpu_seconds: dict = field(default_factory=dict)
    """Process CPU seconds per role and actor, from before ``prepare`` to after ``activate``:
    ``{"owners": {id: s}, "relays": {id: s}, "engines": {id: s}}`` (:mod:`dcr_ray.actors.coordinator.cpu_clock`;
    an actor that did not answer its reading is missing)."""
    from_record: bool = False
    """The refit committed, but the coordinator that ran it restarted before answering: this report was
    rebuilt from the commit record (version, transfer, the engines that hold it). Its per-stage seconds,
    bytes, change counts and CPU readings were lost with that coordinator and are not zeros to read."""

    @classmethod
    def of_record(cls, record, warning: str) -> "RefitReport":
        """What is known of a committed refit from its commit record alone (see :attr:`from_record`)."""
        return cls(version=record.version, transfer=record.transfer, attempts=1, from_record=True,
                   engine_versions={e: record.version for e in record.members}, warnings=[warning])

    @classmethod
    def from_stages(cls, *, version: int, transfer: str, attempts: int, sums: dict, acks: dict, link_bytes: dict,
                    engine_versions: dict, warnings: list, marks: dict, coding=None,
                    cpu_seconds: dict | None = None) -> "RefitReport":
        """Assemble the report of a committed attempt.

        ``sums``: owner id -> stream summary; ``acks``: engine id -> flush reply; ``marks``: clock
        readings (``perf_counter``) at ``start``, ``prepare``, ``stream``, ``flushed``, ``record``,
        ``promoted``, ``activated`` and ``end``; ``coding``: the refit's
        :class:`~dcr_ray.actors.coordinator.coding.CodingChoice`; ``cpu_seconds``: what
        :meth:`~dcr_ray.actors.coordinator.cpu_clock.CpuClock.stop` read.
        """
        m = marks
        construct = max(s["construct_s"] for s in sums.values())
        send_wait = max(s["send_wait_s"] for s in sums.values())
        stream = m["flushed"] - m["stream"]
        seconds = {"prepare": m["stream"] - m["prepare"], "construct": construct, "stream": stream,
                   "transport": max(0.0, stream - max(0.0, construct - send_wait)),
                   "apply": max(a["apply_s"] for a in acks.values()), "commit": m["end"] - m["flushed"],
                   "commit_record": m["record"] - m["flushed"], "promote": m["promoted"] - m["record"],
                   "activate": m["activated"] - m["promoted"], "total": m["end"] - m["start"]}
        if "released" in m:
            seconds["release"] = m["released"] - m["start"]
        return cls(version=version, transfer=transfer, attempts=attempts, seconds=seconds,
                   payloads=sum(len(s["payloads"]) for s in sums.values()),
                   wire_bytes=sum(s["wire_bytes"] for s in sums.values()), link_bytes=link_bytes,
                   changed=sum(s["changed"] for s in sums.values()), numel=sum(s["numel"] for s in sums.values()),
                   engine_versions=engine_versions, mode=next(iter(sums.values()))["mode"], warnings=warnings,
                   coding=next(iter(sums.values())).get("coding", "plain"),
                   coding_reason=getattr(coding, "reason", ""),
                   coding_inputs=dict(getattr(coding, "inputs", {})),
                   cpu_seconds=dict(cpu_seconds or {}))

    @property
    def change_rate(self) -> float:
        return self.changed / self.numel if self.numel else 0.0

    @property
    def retries(self) -> int:
        return self.attempts - 1

    def to_dict(self) -> dict:
        d = asdict(self)
        d["change_rate"] = self.change_rate
        return d

    def __str__(self) -> str:
        if self.from_record:
            return (f"v{self.version} committed (transfer {self.transfer}; engines {sorted(self.engine_versions)} "
                    f"hold it) | answered from the commit record: the coordinator restarted before answering, "
                    f"and this refit's seconds, bytes and change counts were lost with it"
                    + "".join(f"\n  warning: {w}" for w in self.warnings))
        s = self.seconds
        links = ", ".join(f"{c}: {b / 1e6:.2f} MB" for c, b in self.link_bytes.items())
        return (
            f"v{self.version} committed in {s.get('total', 0):.2f}s "
            f"(construct {s.get('construct', 0):.2f}s, stream {s.get('stream', 0):.2f}s, "
            f"apply {s.get('apply', 0):.2f}s, commit {s.get('commit', 0):.2f}s) | "
            f"{self.changed:,}/{self.numel:,} elements changed ({100 * self.change_rate:.2f}%) | "
            f"{self.payloads} payloads, {self.wire_bytes / 1e6:.2f} MB [{links}] | "
            f"{self.mode} ({self.coding}), retries {self.retries} | "
            f"engines {sorted(set(self.engine_versions.values()))}"
            + "".join(f"\n  warning: {w}" for w in self.warnings)
        )
