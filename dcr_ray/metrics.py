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
    return {
        "refit_seconds": Histogram("dcr_coordinator_refit_seconds", "Wall time of committed refits",
                                   boundaries=secs),
        "refit_wire": Counter("dcr_coordinator_wire_bytes", "Payload bytes produced by owners"),
        "refit_changed": Counter("dcr_coordinator_changed_elements", "Canonical elements changed"),
        "refit_retries": Counter("dcr_coordinator_retries_total", "Refit attempts that were retried"),
        "version": Gauge("dcr_coordinator_version", "Committed version"),
        "relay_bytes": Counter("dcr_relay_bytes_in_bytes", "Bytes entering a relay", tag_keys=("cluster",)),
        "engine_applied": Counter("dcr_engine_applied_payloads_total", "Payloads applied", tag_keys=("engine",)),
        "engine_rejected": Counter("dcr_engine_rejected_payloads_total", "Payloads rejected",
                                   tag_keys=("engine",)),
    }


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
