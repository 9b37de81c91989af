"""Measurement hooks that reach inside an engine actor, for benchmarks (kept here, beside the library they
read, so benchmarks and tests touch only public names).

:func:`engine_cpu_parts` (run in an engine actor with ``handle.__ray_call__.remote(engine_cpu_parts)``)
installs, once, thread-CPU accounting of the engine's payload path and returns the totals so far:
``deliver`` (a payload's whole validate-and-apply once its bytes arrived), and its parts ``open`` (digest
and header), ``decode`` and ``apply`` (the writes), with ``calls``.

The peers' ways of loading a policy on the same engine (``dcr-ray bench live``, whose
``benchmarks/live/engine_side.py`` runs their loaders): :func:`hold` and :func:`release` stop and resume its
generation (its own pause, measured like a refit's).

:func:`dense_refit` (run in the coordinator actor) sends every engine the committed version densely: the
dense reference ``dcr-ray bench refit`` measures.
"""

from __future__ import annotations

import time


def _timed(totals: dict, label: str, fn):
    def timed(*args, **kwargs):
        t = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.thread_time() - t
    return timed


def engine_cpu_parts(engine) -> dict:
    """Install (once) CPU accounting of ``engine``'s payload path; the totals so far (see the module doc)."""
    from dcr_ray.actors.engine import context as engine_context, receive as engine_receive

    totals = getattr(engine, "probe_cpu_parts", None)
    if totals is None:
        totals = engine.probe_cpu_parts = {"deliver": 0.0, "open": 0.0, "decode": 0.0, "apply": 0.0, "calls": 0}
        engine_receive.open_frame = _timed(totals, "open", engine_receive.open_frame)
        engine_context.decode_frame = _timed(totals, "decode", engine_context.decode_frame)
        ctx, receiver = engine._c, engine._receiver
        ctx.write = _timed(totals, "apply", ctx.write)
        inner = _timed(totals, "deliver", receiver.deliver)

        def deliver(*args, **kwargs):
            totals["calls"] += 1
            return inner(*args, **kwargs)

        receiver.deliver = deliver  # the actor's deliver calls its receiver's
    return dict(totals)


def hold(engine, label: str) -> None:
    """(Run in an engine actor.) Stop its generation for ``label`` (the calls in flight finish first)."""
    engine._serving.hold(label)


def release(engine, label: str) -> None:
    """(Run in an engine actor.) Resume its generation after :func:`hold`."""
    engine._serving.release(label)


def dense_refit(coordinator) -> int:
    """Run in the coordinator (``refit.actor.__ray_call__.remote(dense_refit)``): a dense bootstrap of every
    engine to the committed version, through the same path a joining engine takes; returns frames sent."""
    return coordinator._bootstrap(sorted(coordinator.engines))
