"""Per-actor CPU seconds of a refit, and the critical path they imply with one core per actor (derived).

Each refit's report carries the process CPU seconds of every owner, relay and engine from before
``prepare`` to after ``activate`` (:mod:`dcr_ray.actors.coordinator.cpu_clock`). On this machine those actors share
two cores, so a CPU-bound refit takes at least their sum over the cores (``cpu_total_over_cores_s``).
With a core per actor, as a deployment gives them, what follows from the same measurements is
**derived, not measured**:

- ``derived_streamed_s``: the busiest stage, ``max(slowest owner, slowest relay, slowest engine, link
  lower bound)``: owners, relays, link and engines working at once on a stream of payloads.
- ``derived_serial_s``: the stages one after another, ``slowest owner + slowest relay + slowest engine +
  link lower bound``: no overlap at all.

The measured refit time sits beside them in the tables.
"""

from __future__ import annotations

import os

#: Roles of a report's ``cpu_seconds`` (:data:`dcr_ray.actors.coordinator.cpu_clock.ROLES`; not imported: it imports
#: Ray).
ROLES = ("owners", "relays", "engines")


def critical_path(cpu_seconds: dict, link_lower_bound_s: float) -> dict:
    """The CPU fields of one measured refit (see the module docstring)."""
    slowest = {role: max(cpu_seconds.get(role, {}).values(), default=0.0) for role in ROLES}
    total = sum(sum(cpu_seconds.get(role, {}).values()) for role in ROLES)
    return {"cpu_seconds": cpu_seconds,
            "cpu_role_seconds": {role: sum(cpu_seconds.get(role, {}).values()) for role in ROLES},
            "cpu_slowest_actor_seconds": slowest, "cpu_total_seconds": total,
            "cpu_total_over_cores_s": total / (os.cpu_count() or 1),
            "derived_streamed_s": max(link_lower_bound_s, *slowest.values()),
            "derived_serial_s": link_lower_bound_s + sum(slowest.values())}


def markdown(cases: list[dict]) -> str:
    """Per case: measured refit seconds beside the CPU seconds per role and the derived critical paths."""
    out = ["| case | transport | link Mbit/s | coding | refit s (measured) | owners CPU s (slowest) | relays CPU s "
           "(slowest) | engines CPU s (slowest) | CPU s all actors / cores | link LB s | derived, one core per actor: "
           "streamed s | serial s |", "|" + "---|" * 12]
    for c in cases:
        if "cpu_role_seconds" not in c:
            continue
        role, slow = c["cpu_role_seconds"], c["cpu_slowest_actor_seconds"]
        cell = {r: f"{role[r]:.2f} ({slow[r]:.2f})" for r in ROLES}
        link = "none" if not c.get("link_mbps") else f"{c['link_mbps']:g}"
        out.append(f"| {c.get('case', c['name'])} | {c['transport']} | {link} | {c.get('coding', '-')} | "
                   f"{c['dcr_seconds']:.2f} | {cell['owners']} | {cell['relays']} | {cell['engines']} | "
                   f"{c['cpu_total_over_cores_s']:.2f} | {c['lower_bound_s']:.2f} | "
                   f"*{c['derived_streamed_s']:.2f}* | *{c['derived_serial_s']:.2f}* |")
    return "\n".join(out) + "\n"
