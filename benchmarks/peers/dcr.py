"""dcr_ray's three rows: the plain coding, class order (the ``context`` coding) and the library default.

Bytes, sender seconds and the bounds are what ``dcr-ray bench codec`` measures on the same step
(:func:`benchmarks.codec.measure_step`: the owner's encode, diff included, both codings, best of the
repeats, every decode checked on integer views against a numpy diff), and the default is the library's own
:func:`~dcr_ray.actors.coordinator.coding.choose_coding` asked about those measurements at the run's link
(:func:`benchmarks.codec.default.library_default`). The receiver (:func:`receive_into_params`) is an
engine's in-place apply (``read_frame`` + ``apply_decoded``) into the ``transformers`` model's own
parameters, with the class counts a live engine keeps from its previous apply; on vLLM, see
:mod:`.vllm_receivers`.

The corruption trials are run here: the largest frame of the step, corrupted, through the engine's
decode + apply after the frames before it; then the retry the coordinator sends after a failed attempt,
OVERWRITE frames of the whole changed set, applied and checked.
"""

from __future__ import annotations

from benchmarks.peers.corrupt import KINDS, corrupt, largest, verdict

#: dcr_ray's rows and the coding each one is.
CODINGS = {"dcr_plain": "plain", "dcr_class_order": "context"}
RECOVERY = "the next attempt: OVERWRITE frames of the whole changed set (what the coordinator sends)"


def corruption(step, coding: str) -> dict:
    """Each corruption of the largest frame of ``coding``, run through the receiver and judged on its bits."""
    import numpy as np

    from benchmarks.codec.timing import decode_apply, encode, exact, fresh_targets, meta
    from dcr_ray.codec import bits_view, encode_frames
    from dcr_ray.codec.decoding import classcounts

    deltas, frames = encode(step, coding=coding)
    retry = list(encode_frames(deltas, meta(), mode="overwrite"))
    k = largest(frames)
    out = {}
    for kind in KINDS:
        classcounts.forget()  # a receiver whose bits were just written some other way keeps no counts
        targets = fresh_targets(step)
        decode_apply(frames[:k], targets)
        before = {n: bits_view(t).copy() for n, t in targets.items()} if k else step.old
        bad, offset = corrupt(kind, frames[k])
        error = None
        try:
            decode_apply([bad], targets)
        except Exception as e:  # noqa: BLE001 - whatever the receiver raises is what it does
            error = e
        wrote = not all(np.array_equal(bits_view(t), before[n]) for n, t in targets.items())
        old = all(np.array_equal(bits_view(t), step.old[n]) for n, t in targets.items())
        new = exact(targets, step)
        decode_apply(retry, targets)
        out[kind] = verdict(payload=f"frame {k + 1} of {len(frames)}", payload_bytes=len(frames[k]), offset=offset,
                            error=error, wrote=wrote, served_old=old, served_new=new, recovery=RECOVERY,
                            recovered=exact(targets, step), refetched_bytes=sum(map(len, retry)))
        del targets
    return out


def receive_into_params(step, engine, repeats: int) -> dict:
    """dcr_ray's receiver into the engine's parameters, per coding: ``{coding: (Timed, bit_exact)}``. Before
    each timed apply the parameters hold the committed bits and the class counts are those a live engine
    keeps from its previous apply (primed by resolving the step's class-order items once), untimed."""
    from benchmarks.codec.timing import decode_apply, encode, timed
    from dcr_ray.codec import read_frame
    from dcr_ray.codec.decoding import classcounts, context

    targets = {n: engine.params[n] for n in step.new}
    out = {}
    for coding in CODINGS.values():
        _, frames = encode(step, coding=coding)
        classcounts.forget()
        engine.hold(step.old)
        for f in frames:
            context.resolve(read_frame(f, targets).items, targets)
        kept = classcounts.snapshot()

        def reset():
            engine.hold(step.old)
            classcounts.restore(kept)
            return targets

        got = timed(lambda tg, frames=frames: decode_apply(frames, tg), repeats, setup=reset)
        out[coding] = (got, engine.holds(step.new))
    classcounts.forget()
    return out


def rows(case: dict, acc, corrupt_by_coding: dict | None, received: dict) -> list[dict]:
    """The three dcr_ray rows of a step measured by the codec bench (``case`` carries ``default_*``) and
    :func:`receive_into_params` (``received``)."""
    def row(peer: str, coding: str, note: str) -> dict:
        wire = case["wire_bytes"] if coding == "context" else case["today_wire_bytes"]
        got, exact = received[coding]
        return {"peer": peer, "peer_code": "own", "note": note, "coding": coding, "wire_bytes": wire,
                "sender_seconds": acc.cpu[f"{coding}_encode"], "sender_wall_seconds": acc.secs[f"{coding}_encode"],
                "receiver_seconds": got.best_cpu, "receiver_wall_seconds": got.best,
                "bit_exact": case["bit_exact"] and exact,
                "corrupt": corrupt_by_coding[coding] if corrupt_by_coding else None,
                "samples": {"sender_wall_s": acc.samples[f"{coding}_encode"],
                            "receiver_cpu_s": [round(x, 6) for x in got.cpu],
                            "receiver_wall_s": [round(x, 6) for x in got.wall]}}

    chosen = case["default_coding"]
    return [row("dcr_default", chosen, f"the library's choice at {case['default_link_mbps']:g} Mbit/s: {chosen} "
                                       f"({case['default_reason']})"),
            row("dcr_plain", "plain", "dcr_ray's codec, coding='plain'"),
            row("dcr_class_order", "context", "dcr_ray's codec, coding='context' (class-order positions, ADD values)")]
