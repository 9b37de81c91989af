"""Tools for tests, benchmarks and failure drills; never imported by the library itself.

- :mod:`~dcr_ray.testing.links`  emulated cross-cluster links (a link model and a transport wrapper)
- :mod:`~dcr_ray.testing.faults` fault injection (an engine whose apply fails once, an owner whose
  promote fails once)
"""
