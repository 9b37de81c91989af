"""The peers' ways of putting a new policy into the same engines, over the same emulated link.

``dense_sync`` (the shape of OpenRLHF's and veRL's weight broadcast): every engine stops generating, the
whole model crosses the cluster link (once, as a broadcast tree would carry it), every tensor goes
through the engine's own load path, and generation resumes. The pause spans the transfer and the load.

``fetch_reload`` (SkyRL 0.4's shape): while the engines serve, the new model crosses the link and is
written to a local checkpoint beside each engine (safetensors); then each engine stops, reloads that
checkpoint through its own load path, and resumes. The pause spans the reload only.

Both use the engine's own pause (:func:`dcr_ray.testing.probes.hold` / :func:`~dcr_ray.testing.probes.release`),
so their pauses are measured on the engine's clock exactly as dcr_ray's are.
"""

from __future__ import annotations

import shutil
import tempfile


def _link_cross(relay, nbytes: int) -> None:
    """(Run in a relay head.) ``nbytes`` cross its emulated link (its link model sleeps them out)."""
    from dcr_ray.testing.links import link_of

    link_of(relay).cross(nbytes)


def _cross(topo, nbytes: int) -> None:
    """The bytes cross the cluster's emulated link once, as a broadcast tree would carry them."""
    import ray

    ray.get([h.__ray_call__.remote(_link_cross, nbytes) for h in topo.heads[:1]])


def dense_sync(topo, ref, nbytes: int) -> None:
    import ray

    from dcr_ray.testing import probes

    engines = list(topo.engines.values())
    ray.get([e.__ray_call__.remote(probes.hold, "dense_sync") for e in engines])
    try:
        _cross(topo, nbytes)
        ray.get([e.__ray_call__.remote(probes.load_dense, ref) for e in engines])
    finally:
        ray.get([e.__ray_call__.remote(probes.release, "dense_sync") for e in engines])


def fetch_reload(topo, ref, nbytes: int) -> None:
    import ray

    from dcr_ray.testing import probes

    engines = list(topo.engines.values())
    _cross(topo, nbytes)  # while the engines serve
    dirs = [tempfile.mkdtemp(prefix="dcr_bench_fetch_") for _ in engines]
    try:
        ray.get([e.__ray_call__.remote(probes.write_checkpoint, ref, d) for e, d in zip(engines, dirs)])
        # each engine pauses only for its own reload
        ray.get([e.__ray_call__.remote(probes.reload_checkpoint, d) for e, d in zip(engines, dirs)])
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
