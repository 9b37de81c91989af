"""How payloads travel from owners to engines: one protocol, two implementations, chosen once.

- :mod:`~dcr_ray.relay.transport`    the :class:`~dcr_ray.relay.transport.Transport` protocol (owner-side sinks,
  engine-side readers) and ``make_transport``, which builds the one ``TransportConfig.kind`` names
- :mod:`~dcr_ray.relay.relay_tree`   relay trees: payloads through the Ray object store, across each cluster
  boundary once
- :mod:`~dcr_ray.relay.relay`        the relay actors: a cluster's head pulls each payload once and fans it out
- :mod:`~dcr_ray.relay.tree`         which relay forwards to which engines and sub-relays inside one cluster
- :mod:`~dcr_ray.relay.object_store` object storage: one object per payload in a directory or an fsspec store
- :mod:`~dcr_ray.relay.window`       the catch-up window: the committed payloads of the last few versions, kept
  inside a cluster for engines that fell behind
- :mod:`~dcr_ray.relay.backpressure` bounded waiting on first-hop acknowledgements, shared by owner-side sinks
"""
