"""One case of the live benchmark: engines serve a closed loop of requests while the trainer steps and the
new policy reaches them, refit after refit, by one method. Every figure is measured, per refit:

- ``pause_s``: the longest serving pause of any engine, on the engine's own clock (the window in which it
  could not admit a generate call: :mod:`dcr_ray.actors.engine_pause`), and ``gap_s``: the longest time
  any engine's load saw no answer during the refit window;
- ``trainer_stall_s``: from the call until the trainer's tensors are free again (dcr_ray: the owners'
  streams returned, the report's ``release``; the peers: the full tensors were copied out of the trainer);
- ``construct_s``: the owners' diff and encode (dcr_ray), or the copy out of the trainer (peers);
- ``freshness_s``: from the end of the optimizer step until the last engine serves the new bits;
- ``refit_s``: the call's wall time;
- tokens per second during the refit windows against the quiet window before them.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.live import load


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _pauses(engines, since: float) -> list[dict]:
    import ray

    return [p for ps in ray.get([e.pauses.remote(since) for e in engines]) for p in ps]


def _exact(topo) -> bool:
    """Every engine's canonical tensors equal the owners' current bits (integer views)."""
    import ray
    import torch

    want = {}
    for h in topo.owners.values():
        want.update(ray.get(h.bench_tensors.remote(ray.get(h.bench_names.remote()))))
    for e in topo.engines.values():
        got = ray.get(e.tensors.remote())
        if sorted(got) != sorted(want):
            return False
        if not all(torch.equal(got[n].view(torch.int16), t.view(torch.int16)) for n, t in want.items()):
            return False
    return True


def _full_state(topo) -> tuple[object, int]:
    """The owners' current tensors, copied out of the trainer into the object store: (ref, bytes)."""
    import ray

    state = {}
    for h in topo.owners.values():
        state.update(ray.get(h.bench_tensors.remote(ray.get(h.bench_names.remote()))))
    return ray.put(state), sum(t.numel() * t.element_size() for t in state.values())


def run_case(topo, s, receiver: str, mode: str, data: str, methods: tuple, step) -> list[dict]:
    """Measure ``methods`` on one launched topology; ``step(i)`` makes the i-th change (a real optimizer
    step or a stress change) and returns when it is done. Returns one case dict per method."""
    import ray

    from benchmarks.live.peers import dense_sync, fetch_reload

    engines = list(topo.engines.values())
    Loop = ray.remote(num_cpus=0, max_concurrency=2)(load.GenerationLoop)
    loops = [Loop.remote(e, [1, 7, 42, 99, 5], s.tokens) for e in engines]
    running = [lp.run.remote() for lp in loops]
    deadline = time.time() + 120
    while time.time() < deadline and min(len(r) for r in ray.get([lp.snapshot.remote() for lp in loops])) < 3:
        time.sleep(0.2)  # every loop answered a few times (an engine's first requests warm it up)
    t_q0 = time.time()
    time.sleep(s.quiet_s)
    t_q1 = time.time()
    cases, windows, i = [], [], 0
    for method in methods:
        if method != "dcr" and mode != "in_place":
            continue  # the peers' ways do not depend on dcr_ray's apply mode: measured once per receiver
        samples = []
        for _ in range(s.refits):
            step(i)
            i += 1
            t_step = time.time()
            t_call = time.time()
            if method == "dcr":
                report = topo.refit.run()
                t_done = time.time()
                stall, construct = report.seconds.get("release"), report.seconds.get("construct")
            else:
                ref, nbytes = _full_state(topo)
                t_copied = time.time()
                fn = dense_sync if method == "dense_sync" else fetch_reload
                fn(topo, ref, nbytes)
                t_done = time.time()
                stall = construct = t_copied - t_call
            pauses = [p for p in _pauses(engines, t_call - 0.05) if p["outcome"] in ("activated", "resumed")]
            served_at = max((p["at"] + p["pause_s"] for p in pauses), default=t_done)
            snap = [r for lp in loops for r in ray.get(lp.snapshot.remote())]
            per_engine = ray.get([lp.snapshot.remote() for lp in loops])
            samples.append({
                "refit_s": t_done - t_call, "pause_s": max((p["pause_s"] for p in pauses), default=0.0),
                "pause_apply_s": max((p["apply_s"] for p in pauses), default=0.0),
                "blocked_s": max((p["blocked_s"] for p in pauses), default=0.0),
                "gap_s": max(load.longest_gap(r, t_call, t_done) for r in per_engine),
                "trainer_stall_s": stall, "construct_s": construct, "freshness_s": served_at - t_step,
                "tokens_per_second": load.tokens_per_second(snap, t_call, t_done), "t_call": t_call,
                "t_done": t_done, "pauses": pauses})
            windows.append((method, t_call, t_done))
        exact = _exact(topo)
        quiet = [r for lp in loops for r in ray.get(lp.snapshot.remote())]
        cases.append({
            "method": method, "mode": mode if method == "dcr" else "n/a", "receiver": receiver, "data": data,
            "size": s.vllm_size if receiver == "vllm" else s.size,
            "pause_seconds": _median(x["pause_s"] for x in samples),
            "pause_apply_seconds": _median(x["pause_apply_s"] for x in samples),
            "gap_seconds": _median(x["gap_s"] for x in samples),
            "trainer_stall_seconds": _median(x["trainer_stall_s"] for x in samples),
            "construct_seconds": _median(x["construct_s"] for x in samples),
            "freshness_seconds": _median(x["freshness_s"] for x in samples),
            "refit_seconds": _median(x["refit_s"] for x in samples),
            "tokens_per_second_quiet": load.tokens_per_second(quiet, t_q0, t_q1),
            "tokens_per_second_refit": _median(x["tokens_per_second"] for x in samples),
            "bit_exact": exact, "samples": samples})
    records = ray.get([lp.stop.remote() for lp in loops])
    ray.get(running)
    for c in cases:
        c["timeline"] = {"t0": t_q0, "engines": records, "windows": windows}
    return cases
