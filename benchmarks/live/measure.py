"""One topology of the live benchmark: clients stream generations from the engines while the trainer steps and
the new policy reaches them, refit after refit, by every method at every link of the sweep. Each engine
serves short requests and long (agentic-length) ones side by side. Every figure is measured, per refit:

- ``pause_s``: the longest admission-closed window of any engine, on the engine's own clock
  (:mod:`dcr_ray.actors.engine.pause`: generation could not be admitted), ``drain_s``: how long that
  engine waited before it for what was already running (admission closed, the old version still
  answering): every running request to finish (a drain), or the decoding step in progress only (a switch
  in flight), ``apply_s``: what the pause spent writing;
- ``client_gap_s``: the longest gap any client saw between two of its tokens, over the gaps that overlap
  the refit window (:func:`~benchmarks.live.load.client_gaps`), and every such gap for the case's p99;
  ``client_gap_parts``: where that longest gap went against its engine's pauses (:func:`gap_parts`);
- ``trainer_stall_s``: from the call until the trainer's tensors are free again (dcr_ray: the owners'
  streams returned, the report's ``release``; the peers: see :mod:`.peers`); ``construct_s``;
- ``freshness_s``: from the end of the optimizer step until the last engine serves the new bits;
- ``refit_s``: the call's wall time; ``link_bytes``: what crossed the emulated link (its own counter);
- tokens per second during the refit windows against the quiet window before them, and ``token_step_s``,
  the median gap between two tokens of one request in the quiet window (a decoding step as a client sees
  it): the unit of the in-flight targets.

Methods run one after another, each after one untimed refit of its own (imports, compiled kernels, first
files) and then at every link (dcr_ray first: its owners' baseline is then what the engines hold); after
each (method, link) the engines' bits are checked (:func:`.engine_side.exact`).
"""

from __future__ import annotations

import statistics
import time

from benchmarks.live import engine_side, load, peers
from benchmarks.live.settings import MAX_POSITIONS, PROMPT_TOKENS, parse_mode
from benchmarks.refit.progress import log

#: Gaps kept per refit in the JSON (the longest; the p99 is computed over all of them).
KEPT_GAPS = 20


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _pauses(engines, since: float) -> list[dict]:
    """Every engine's pauses since ``since`` that ended serving again, each tagged with its engine's index."""
    import ray

    return [{**p, "engine": i} for i, ps in enumerate(ray.get([e.pauses.remote(since) for e in engines]))
            for p in ps if p["outcome"] in ("activated", "resumed")]


def _link_bytes(topo) -> int:
    import ray

    from dcr_ray.testing.links import link_busy

    return sum(b for _, b in ray.get([h.__ray_call__.remote(link_busy) for h in topo.heads]))


def _exact(topo) -> bool:
    """Every engine serves exactly the owners' current bits (:func:`.engine_side.exact`)."""
    import ray

    refs, _ = peers._put(topo)
    return all(ray.get([e.__ray_call__.remote(engine_side.exact, refs) for e in topo.engines.values()]))


#: Methods whose engines drain before a switch (every running request finishes first); the others hold the
#: running requests at a step boundary (dcr_ray's own follows its topology's ``EngineConfig.switch``).
DRAINING = ("dense_sync", "full_fetch_reload")


def _prompt(client: int) -> list[int]:
    """A prompt of its own per client of an engine (the vLLM token clock finds a request by its prompt)."""
    return [1 + (7 * k + 13 * client) % 97 for k in range(PROMPT_TOKENS)]


def _tokens(client: int, s) -> int:
    """Tokens per request of short client ``client``: from 0.625x to 1.375x ``s.tokens`` across an engine's
    short clients (mean ``s.tokens``), so their requests do not start and end in lockstep."""
    return max(1, round(s.tokens * (0.5 + (client + 0.5) / s.clients)))


def _long_tokens(client: int, s) -> int:
    """Tokens per request of long client ``client``: 0.75x to 1.25x ``s.long_tokens``, within the positions."""
    return max(1, min(MAX_POSITIONS - PROMPT_TOKENS, round(s.long_tokens * (0.75 + 0.5 * (client + 0.5) /
                                                                              s.long_clients))))


def _start_clients(engines, s):
    """Every engine's clients: ``s.clients`` short closed loops and ``s.long_clients`` long ones. Returns the
    loops (short ones first per engine), their runs, and which loops are long."""
    import ray

    Loop = ray.remote(num_cpus=0, max_concurrency=2)(load.GenerationLoop)
    loops, long = [], []
    for e in engines:
        for c in range(s.clients):
            loops.append(Loop.remote(e, _prompt(c), _tokens(c, s)))
            long.append(False)
        for c in range(s.long_clients):
            loops.append(Loop.remote(e, _prompt(s.clients + c), _long_tokens(c, s)))
            long.append(True)
    running = [lp.run.remote() for lp in loops]
    deadline = time.time() + 600
    # every short client answered twice, every long one once (an engine's first requests warm it up)
    while time.time() < deadline and not all(
            len(r) >= (1 if is_long else 2) for r, is_long in zip(ray.get([lp.snapshot.remote() for lp in loops]), long)):
        time.sleep(0.2)
    return loops, running, long


def _settle(loops, t_last: float, timeout_s: float = 600.0) -> None:
    """Wait until every client has a request sent after ``t_last`` answered: every gap that overlaps the last
    refit window has both its ends recorded."""
    import ray

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if all(any(r[0] > t_last for r in recs) for recs in ray.get([lp.snapshot.remote() for lp in loops])):
            return
        time.sleep(0.2)


def _refit(topo, method: str, skyrl) -> dict:
    if method == "dcr":
        t_call = time.time()
        report = topo.refit.run()
        return {"t_call": t_call, "t_done": time.time(), "trainer_stall_s": report.seconds.get("release"),
                "construct_s": report.seconds.get("construct")}
    if method == "skyrl_delta":
        return skyrl.refit(topo)  # SkyRL as it ships: keep mode, no drain
    if method == "pipelinerl_dense":
        return peers.dense_sync(topo, switch="in_flight", label=method)
    return {"dense_sync": peers.dense_sync, "full_fetch_reload": peers.full_fetch_reload}[method](topo)


def run_case(topo, s, receiver: str, mode: str, data: str, methods: tuple, step, set_link) -> list[dict]:
    """Measure ``methods`` at every link of ``s.links`` on one launched topology (``mode``: its apply mode,
    ``:drain`` for a draining switch, :func:`~benchmarks.live.settings.parse_mode`); ``step(i)`` makes the
    i-th change (a real optimizer step or a stress change); ``set_link(mbps)`` sets the emulated link.
    Returns one case dict per (method, link)."""
    import ray

    apply, switch = parse_mode(mode)
    engines = list(topo.engines.values())
    loops, running, long = _start_clients(engines, s)
    t_q0 = time.time()
    time.sleep(s.quiet_s)
    t_q1 = time.time()
    skyrl = peers.SkyrlDelta(s.skyrl_own)
    cases, i = [], 0
    for method in methods:
        if method != "dcr" and mode != "in_place":
            continue  # the peers' ways do not depend on dcr_ray's modes: measured once per receiver
        if method == "skyrl_delta":
            skyrl.start(topo)
        set_link(max(s.links, key=lambda x: float("inf") if x is None else x))  # the fastest: it costs least
        step(i)  # one untimed refit per method first: imports, compiled kernels, first files
        i += 1
        _refit(topo, method, skyrl)
        for link in s.links:
            set_link(link)
            samples = []
            for _ in range(s.refits):
                b0 = _link_bytes(topo)
                step(i)
                i += 1
                t_step = time.time()
                smp = _refit(topo, method, skyrl)
                smp["link_bytes"] = _link_bytes(topo) - b0
                pauses = _pauses(engines, smp["t_call"] - 0.05)
                served_at = max((p["at"] + p["pause_s"] for p in pauses), default=smp["t_done"])
                smp.update({
                    "refit_s": smp["t_done"] - smp["t_call"], "freshness_s": served_at - t_step, "pauses": pauses,
                    "pause_s": max((p["pause_s"] for p in pauses), default=0.0),
                    "pause_apply_s": max((p["apply_s"] for p in pauses), default=0.0),
                    "drain_s": max((p["inflight_s"] for p in pauses), default=0.0),
                    "blocked_s": max((p["blocked_s"] for p in pauses), default=0.0)})
                samples.append(smp)
                log(f"    {method} {mode} at {link or 'no'} Mbit/s: drain {smp['drain_s']:.3f}s window "
                    f"{smp['pause_s']:.3f}s refit {smp['refit_s']:.2f}s")
            cases.append({"method": method, "mode": apply if method == "dcr" else "n/a",
                          "switch": switch if method == "dcr" else "drain" if method in DRAINING else "in_flight",
                          "receiver": receiver,
                          "data": data, "size": s.vllm_size if receiver.startswith("vllm") else s.size, "link_mbps": link,
                          "peer_code": skyrl.peer_code if method == "skyrl_delta" else None,
                          "bit_exact": _exact(topo), "samples": samples})
    _settle(loops, max((x["t_done"] for c in cases for x in c["samples"]), default=time.time()))
    records = ray.get([lp.stop.remote() for lp in loops])
    ray.get(running)
    quiet = _gap_stats(records, [(t_q0, t_q1)])
    per_engine = s.clients + s.long_clients
    for c in cases:
        _summarise(c, records, quiet, t_q0, t_q1, per_engine, long)
    return cases


def _gap_stats(records: list[list[tuple]], windows: list[tuple[float, float]]) -> dict:
    """Per window, the longest client gap overlapping it (seconds, client index, its ends); and every such gap,
    pooled."""
    per_client = [load.client_gaps(r) for r in records]
    longest, where, pooled = [], [], []
    for t0, t1 in windows:
        gaps = [(b - a, c, a, b) for c, gs in enumerate(per_client) for a, b in gs if a < t1 and b > t0]
        top = max(gaps, default=(t1 - t0, None, t0, t1))
        longest.append(top[0])
        where.append(top[1:])
        pooled += [g[0] for g in gaps]
    return {"longest": longest, "where": where, "pooled": pooled}


def _overlap(a: float, b: float, lo: float, hi: float) -> float:
    return max(0.0, min(b, hi) - max(a, lo))


def gap_parts(a: float, b: float, pauses: list[dict]) -> dict:
    """Where a client's gap ``(a, b)`` went, against its engine's pauses: ``drain`` (admission closed while the
    requests already running finished), ``window`` (the admission window: writes, flush, commit), ``before``
    (from its previous token until the drain began: decode slowed by what else ran on the engine's cores,
    or the request's own prefill) and ``after`` (from the window's end until its next token: its prefill and
    first decode step, after waiting its turn)."""
    drain = sum(_overlap(a, b, p["at"] - p["inflight_s"], p["at"]) for p in pauses)
    window = sum(_overlap(a, b, p["at"], p["at"] + p["pause_s"]) for p in pauses)
    starts = [p["at"] - p["inflight_s"] for p in pauses if p["at"] + p["pause_s"] > a and p["at"] - p["inflight_s"] < b]
    ends = [p["at"] + p["pause_s"] for p in pauses if p["at"] + p["pause_s"] > a and p["at"] - p["inflight_s"] < b]
    before = max(0.0, min(starts) - a) if starts else b - a
    after = max(0.0, b - max(ends)) if ends else 0.0
    return {"drain_s": drain, "window_s": window, "before_s": before, "after_s": after}


def switch_gap(per_client: list[list[tuple[float, float]]], pauses: list[dict], clients: int) -> float | None:
    """The longest gap a client saw across its engine's switch: of the gaps that overlap the engine's drain or
    admission window (``[at - inflight_s, at + pause_s]``), the longest; None when no engine paused. Gaps of
    the refit's other moments (decoding slowed by the refit's own work on the same cores) are left out.
    ``per_client``: every client's gaps, ``clients``: clients per engine (client ``i`` is on engine ``i //
    clients``)."""
    out = None
    for i, gaps in enumerate(per_client):
        for p in (p for p in pauses if p["engine"] == i // clients):
            lo, hi = p["at"] - p["inflight_s"], p["at"] + p["pause_s"]
            for a, b in gaps:
                if a < hi and b > lo and (out is None or b - a > out):
                    out = b - a
    return out


def _summarise(c: dict, records: list, quiet: dict, t_q0: float, t_q1: float, clients: int, long: list) -> None:
    """The case's medians over its refits, its client gaps (all clients, and the long ones alone), its tokens
    per second and the quiet token step. ``clients``: loops per engine; ``long``: which loops are long."""
    samples = c["samples"]
    g = _gap_stats(records, [(x["t_call"], x["t_done"]) for x in samples])
    long_records = [r for r, is_long in zip(records, long) if is_long]
    g_long = _gap_stats(long_records, [(x["t_call"], x["t_done"]) for x in samples]) if long_records else None
    per_client = [load.client_gaps(r) for r in records]
    flat = [r for recs in records for r in recs]
    for k, (x, longest, (client, a, b)) in enumerate(zip(samples, g["longest"], g["where"])):
        x["client_gap_s"] = longest
        x["client_gap_long_s"] = g_long["longest"][k] if g_long else None
        engine = None if client is None else client // clients
        x["client_gap_parts"] = gap_parts(a, b, [p for p in x["pauses"] if p["engine"] == engine])
        x["client_gaps_s"] = sorted(gap for gaps in per_client
                                    for gap in load.gaps_within(gaps, x["t_call"], x["t_done"]))[-KEPT_GAPS:]
        x["tokens_per_second"] = load.tokens_per_second(flat, x["t_call"], x["t_done"])
        x["client_gap_switch_s"] = switch_gap(per_client, x["pauses"], clients)
    med = lambda k: _median(x.get(k) for x in samples)  # noqa: E731
    c.update({
        "pause_seconds": med("pause_s"), "pause_apply_seconds": med("pause_apply_s"), "drain_seconds": med("drain_s"),
        "client_gap_seconds": med("client_gap_s"), "client_gap_p99_seconds": load.percentile(g["pooled"], 99),
        "client_gap_parts": {k: _median(x["client_gap_parts"][k] for x in samples)
                             for k in ("before_s", "drain_s", "window_s", "after_s")},
        "client_gap_undrained_seconds": _median(x["client_gap_s"] - x["client_gap_parts"]["drain_s"] for x in samples),
        "client_gap_quiet_seconds": max(quiet["longest"]), "client_gap_quiet_p99_seconds":
            load.percentile(quiet["pooled"], 99),
        "trainer_stall_seconds": med("trainer_stall_s"), "construct_seconds": med("construct_s"),
        "freshness_seconds": med("freshness_s"), "refit_seconds": med("refit_s"), "link_bytes": med("link_bytes"),
        "client_gap_long_seconds": med("client_gap_long_s"), "client_gap_switch_seconds": med("client_gap_switch_s"),
        "token_step_seconds": _median(load.token_steps(flat, t_q0, t_q1)),
        "tokens_per_second_quiet": load.tokens_per_second(flat, t_q0, t_q1),
        "tokens_per_second_refit": med("tokens_per_second")})
