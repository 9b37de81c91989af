"""All dcr_ray metrics, created in one place (names ``dcr_<component>_<what>_<unit>``).

They are exported through Ray's metrics agent (``ray[default]``) and show on the Ray dashboard's
metrics view / Prometheus endpoint. Creation is lazy and per process; outside a Ray worker (plain
unit tests) every recorder is a no-op.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def _metrics():
    try:
        import ray
        from ray.util.metrics import Counter, Gauge, Histogram

        if not ray.is_initialized():
            return None
    except Exception:  # pragma: no cover - ray missing or metrics unavailable
        return None
    secs = [0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300]
    eng = ("cluster", "engine")
    return {
        # coordinator: one refit
        "refit_seconds": Histogram("dcr_coordinator_refit_seconds", "Wall time of committed refits",
                                   boundaries=secs),
        "refit_wire": Counter("dcr_coordinator_wire_bytes", "Payload bytes produced by owners"),
        "refit_changed": Counter("dcr_coordinator_changed_elements", "Canonical elements changed"),
        "refit_retries": Counter("dcr_coordinator_retries_total", "Refit attempts that were retried"),
        "version": Gauge("dcr_coordinator_version", "Committed version"),
        "link_bytes": Counter("dcr_coordinator_link_bytes", "Payload bytes that crossed each cluster's boundary",
                              tag_keys=("cluster",)),
        "required_engines": Gauge("dcr_coordinator_required_engines", "Engines in the required set"),
        "heal_seconds": Histogram("dcr_coordinator_heal_seconds", "Wall time of healing one engine (background)",
                                  boundaries=secs),
        "healing_engines": Gauge("dcr_coordinator_healing_engines", "Engines healing in the background"),
        # owners
        "owner_wire": Counter("dcr_owner_wire_bytes", "Payload bytes an owner produced", tag_keys=("owner",)),
        "owner_seconds": Histogram("dcr_owner_stream_seconds", "Diff + encode time of one owner stream",
                                   boundaries=secs, tag_keys=("owner",)),
        # relays
        "relay_bytes": Counter("dcr_relay_bytes_in_bytes", "Bytes entering a relay", tag_keys=("cluster", "relay")),
        # engines
        "engine_applied": Counter("dcr_engine_applied_payloads_total", "Payloads applied", tag_keys=eng),
        "engine_rejected": Counter("dcr_engine_rejected_payloads_total", "Payloads rejected", tag_keys=eng),
        "engine_apply_seconds": Histogram("dcr_engine_apply_seconds", "Validate + apply time of one engine's attempt",
                                          boundaries=secs, tag_keys=eng),
        "engine_version": Gauge("dcr_engine_version", "Version an engine serves", tag_keys=eng),
    }


#: Every metric name Ray exports (Prometheus adds a ``ray_`` prefix), for dashboards and tests.
NAMES = ("dcr_coordinator_refit_seconds", "dcr_coordinator_wire_bytes", "dcr_coordinator_changed_elements",
         "dcr_coordinator_retries_total", "dcr_coordinator_version", "dcr_coordinator_link_bytes",
         "dcr_coordinator_required_engines", "dcr_coordinator_heal_seconds", "dcr_coordinator_healing_engines",
         "dcr_owner_wire_bytes", "dcr_owner_stream_seconds",
         "dcr_relay_bytes_in_bytes", "dcr_engine_applied_payloads_total", "dcr_engine_rejected_payloads_total",
         "dcr_engine_apply_seconds", "dcr_engine_version")


def record(name: str, value: float = 1.0, tags: dict | None = None) -> None:
    """Add ``value`` to counter/histogram/gauge ``name`` (a key of the table above); never raises."""
    try:
        m = _metrics()
        if m is None:
            return
        metric = m[name]
        if hasattr(metric, "inc"):
            metric.inc(value, tags=tags)
        elif hasattr(metric, "observe"):
            metric.observe(value, tags=tags)
        else:
            metric.set(value, tags=tags)
    except Exception:
        pass
