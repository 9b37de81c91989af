"""Tools for tests, benchmarks and failure drills; never imported by the library itself.

- :mod:`~dcr_ray.testing.links`  emulated cross-cluster links (a link model, a transport wrapper, and the calls
  that set and read the link inside a relay or engine)
- :mod:`~dcr_ray.testing.faults` fault injection (an engine whose apply fails once, an owner whose
  promote fails once)
- :mod:`~dcr_ray.testing.prefork_faults` preloads that leave a prefork server unsafe to fork from
- :mod:`~dcr_ray.testing.payload_faults` a transport whose owner-side sinks drop, duplicate, reorder or
  delay frames (``dcr-ray chaos``)
- :mod:`~dcr_ray.testing.clusters` a multi-node Ray cluster on this machine with real node faults
  (:class:`~dcr_ray.testing.clusters.LocalClusters`)
- :mod:`~dcr_ray.testing.models` small ``transformers`` causal LMs built locally with random init (``ModelSpec``)
- :mod:`~dcr_ray.testing.trainer` ``TinyTrainer``: a small real trainer (FP32 AdamW) that is also an owner
- :mod:`~dcr_ray.testing.sharded_trainer` Ray actors as the ranks of a gloo group training a tiny HF model
  with FSDP2 x tensor parallelism, whose ``dcr_tensors()`` are their DTensor shards
- :mod:`~dcr_ray.testing.openrlhf_policy` a CPU stand-in for OpenRLHF's ``PolicyModelActor``
"""
