"""Which coding a refit's first attempt uses: ``CodecConfig.coding="auto"`` decides per refit, here (a
coordinator policy; each owner's stream takes the choice through :mod:`dcr_ray.actors.owner.coding`).

The two codings trade CPU for bytes (:mod:`dcr_ray.codec.encoding.encode`): ``"context"`` sends fewer bytes than
``"plain"`` on real optimizer steps, and costs the owners and every engine a walk over the old bits of
each class-ordered item. Which one finishes a refit sooner depends on what bounds it: the cluster link
or the CPU. :func:`choose_coding` answers from what the coordinator already has, the reports of recent
committed refits (``CoordinatorActor.history``), and keeps no state of its own, so a restarted
coordinator decides the same way once it has refitted again.

What it reads, per refit of the window (the last :data:`WINDOW` reports):

- **link throughput** of each cluster: the bytes that entered it (``link_bytes``: the head relay's
  counter, or the engines' object-storage reads) over the refit's ``stream`` seconds. That is a measured
  rate only when the link bounded that refit (its stream took more than :data:`LINK_BOUND` times its
  codec stages); otherwise it is a lower bound on the link's throughput, which only raises the estimate.
  ``CodecConfig.link_mbps`` replaces the measurement with a configured figure.
- **codec throughput** of each coding: the slowest owner's ``construct`` plus the slowest engine's
  ``apply`` seconds, the median over the last :data:`CODEC_SAMPLES` clean refits (one attempt, mixed
  frames) that used it (one refit slowed by other work on the machine does not decide alone), and the
  wire bytes per changed element of the latest. A coding no refit in the window used is estimated from
  the other with the ratios :data:`PRIOR` (measured by ``dcr-ray bench codec``; BENCHMARKS.md).

The model of one refit: ``T(c) = max(link seconds, codec seconds)`` with link seconds = the wire bytes
coding ``c`` would send over the slowest link the refit feeds (owners encode once for every cluster, so
the slowest link decides) and codec seconds = construct + apply (a sum: on machines where owners and
engines share cores they do not overlap; with a core per actor this over-counts the CPU side, which
only favours plain). ``"context"`` is chosen when it promises at least :data:`MARGIN` less time, so the
link is the bottleneck; otherwise ``"plain"``. Before any refit measured a link, the first refits code
plainly (the cheaper CPU), and so does the refit after a context refit that needed a retry (a receiver
that cannot read its old bits, e.g. vLLM's capture mode under tensor parallelism) until that retry
leaves the window. The choice, its reason and its inputs go into the report
(:class:`~dcr_ray.report.RefitReport` ``coding``, ``coding_reason``, ``coding_inputs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dcr_ray.actors.owner.coding import CODINGS

#: Recent committed refits the choice reads.
WINDOW = 16
#: Refits per coding whose codec seconds are taken together (their median).
CODEC_SAMPLES = 3
#: A refit whose stream took longer than this times its codec stages (construct + apply) waited on its link.
LINK_BOUND = 1.25
#: ``"context"`` must promise at least this share less refit time than ``"plain"`` (below the 5% by which
#: ``dcr-ray bench refit`` lets ``"auto"`` trail the better coding: a larger margin would keep plain where
#: context is measurably faster).
MARGIN = 0.03
#: Context / plain ratios for a coding no refit in the window measured: wire bytes per changed element,
#: the slowest owner's construct seconds, the slowest engine's apply seconds. Each is the less favourable
#: ratio of ``dcr-ray bench codec``'s two AdamW cases (BENCHMARKS.md, codec section): bytes 0.54 at
#: lr 1e-6 and 0.72 at lr 1e-5; encode 3.0x and 4.4x the seconds; decode+apply 3.8x and 4.2x.
PRIOR = {"wire": 0.72, "construct": 4.4, "apply": 4.2}


@dataclass(frozen=True)
class CodingChoice:
    """What one refit's first attempt codes with, and why."""

    coding: str
    """``"plain"`` or ``"context"``."""
    reason: str
    """Why, in words, with the figures it compared."""
    inputs: dict = field(default_factory=dict)
    """The figures themselves (link bytes/s and their source, predicted seconds per coding)."""


def choose_coding(codec, history: list[dict], clusters) -> CodingChoice:
    """The coding of the next refit under ``codec`` (a :class:`~dcr_ray.config.CodecConfig`), given the
    reports of earlier refits (``history``, oldest first, :meth:`~dcr_ray.report.RefitReport.to_dict`
    form) and the clusters this refit feeds (the required engines' clusters)."""
    if codec.coding != "auto":
        return CodingChoice(codec.coding, f"configured: CodecConfig.coding={codec.coding!r}")
    recent = [h for h in history[-WINDOW:] if h.get("coding") in CODINGS]
    if any(h["coding"] == "context" and h.get("attempts", 1) > 1 for h in recent):
        return CodingChoice("plain", f"a context refit in the last {WINDOW} needed a retry (a receiver may not "
                                     f"read the old bits class order needs): plain until it leaves the window")
    clean = [h for h in recent if h.get("attempts") == 1 and h.get("mode") == "mixed" and h.get("changed", 0) > 0]
    if not clean:
        return CodingChoice("plain", "no refit measured yet: plain (the cheaper CPU) until one has")
    costs = _costs(clean)
    links = _links(codec.link_mbps, clean, set(clusters))
    if not links:
        return CodingChoice("plain", "no bytes seen on the links this refit feeds yet: plain (the cheaper CPU)",
                            {"costs": costs})
    changed = clean[-1]["changed"]
    slowest = max(links, key=lambda k: changed * costs["plain"]["wire"] * links[k]["copies"] / links[k]["rate"])
    link = links[slowest]
    pred = {}
    for c, cost in costs.items():
        link_s = changed * cost["wire"] * link["copies"] / link["rate"]
        codec_s = cost["construct"] + cost["apply"]
        pred[c] = {"link_s": link_s, "codec_s": codec_s, "seconds": max(link_s, codec_s), "source": cost["source"]}
    inputs = {"cluster": slowest, "link_bytes_per_s": link["rate"], "link_source": link["source"],
              "changed": changed, "predicted": pred}
    p, x = pred["plain"], pred["context"]
    rate = f"{'at least ' if link['source'] == 'lower bound' else ''}{link['rate'] / 1e6:.3g} MB/s ({link['source']})"
    figures = (f"{slowest}'s link {rate}; plain: {p['link_s']:.3g} s on the link, {p['codec_s']:.3g} s of codec "
               f"({p['source']}); context: {x['link_s']:.3g} s on the link, {x['codec_s']:.3g} s of codec "
               f"({x['source']})")
    if x["seconds"] < (1 - MARGIN) * p["seconds"]:
        return CodingChoice("context", f"the link bounds the refit: {figures}", inputs)
    bound = "the CPU bounds the refit" if p["codec_s"] >= p["link_s"] else \
        f"class order would not save {MARGIN:.0%} of the refit"
    return CodingChoice("plain", f"{bound}: {figures}", inputs)


def _costs(clean: list[dict]) -> dict:
    """Per coding: wire bytes per changed element, construct and apply seconds, and whether they were
    measured (the latest clean refit that used it) or derived from the other coding by :data:`PRIOR`."""
    out = {}
    for c in CODINGS:
        mine = [h for h in clean if h["coding"] == c][-CODEC_SAMPLES:]
        if mine:
            by = sorted(mine, key=_codec_seconds)
            mid = by[(len(by) - 1) // 2:len(by) // 2 + 1]  # the median refit, or the middle two
            construct, apply = (sum(_seconds(h, k) for h in mid) / len(mid) for k in ("construct", "apply"))
            out[c] = {"wire": mine[-1]["wire_bytes"] / mine[-1]["changed"], "construct": construct, "apply": apply,
                      "source": "measured" if len(mine) == 1 else f"median of {len(mine)} measured"}
    if "context" not in out:
        out["context"] = {k: out["plain"][k] * PRIOR[k] for k in PRIOR}
        out["context"]["source"] = "plain x prior ratio"
    if "plain" not in out:
        out["plain"] = {k: out["context"][k] / PRIOR[k] for k in PRIOR}
        out["plain"]["source"] = "context / prior ratio"
    return out


def _seconds(h: dict, key: str) -> float:
    return h.get("seconds", {}).get(key, 0.0)


def _codec_seconds(h: dict) -> float:
    return _seconds(h, "construct") + _seconds(h, "apply")


def _links(link_mbps, clean: list[dict], fed: set) -> dict:
    """Per fed cluster with bytes seen: its throughput (bytes/s), where that figure comes from, and how
    many copies of the wire bytes cross it (1 through a relay head; one per engine from object storage)."""
    out: dict = {}
    for h in clean:  # oldest first: a later link-bound refit replaces what earlier ones measured
        stream, codec_s = _seconds(h, "stream"), _codec_seconds(h)
        for k, nbytes in h.get("link_bytes", {}).items():
            if k not in fed or nbytes <= 0 or stream <= 0:
                continue
            seen = nbytes / stream
            cur = out.setdefault(k, {"rate": seen, "source": "lower bound"})
            if stream > LINK_BOUND * codec_s:
                cur.update(rate=seen, source="measured")
            elif seen > cur["rate"]:
                cur.update(rate=seen, source="lower bound")  # the link carried more than thought: at least this
            cur["copies"] = nbytes / h["wire_bytes"] if h.get("wire_bytes") else 1.0
    if link_mbps is not None:
        for k in fed:
            mbps = link_mbps.get(k) if isinstance(link_mbps, dict) else link_mbps
            if mbps is not None:
                out[k] = {"rate": mbps * 1e6 / 8, "source": "configured",
                          "copies": out.get(k, {}).get("copies", 1.0)}
    return out
