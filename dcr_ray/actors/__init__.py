"""The Ray actors of a refit, by role; each subpackage imports only the ones listed after it.

- :mod:`~dcr_ray.actors.coordinator`: the commit coordinator's actor and what it decides each refit:
  which engines are required (:mod:`~dcr_ray.actors.coordinator.membership`), its status and progress, the
  CPU seconds each actor spent.
- :mod:`~dcr_ray.actors.recovery`: how the fleet returns to the committed version and its configured
  size: the dense bootstrap, an engine that heals in the background
  (:mod:`~dcr_ray.actors.recovery.healing`), lost nodes and capacity, a restarted coordinator, a dead owner.
- :mod:`~dcr_ray.actors.fleet`: what the coordinator knows and shares with its parts: the topology and
  where it runs, every engine's standing, the durable commit record, waiting on many actor calls.
- :mod:`~dcr_ray.actors.engine`: the engine actor and its parts: the refit protocol on the engine side,
  serving, its phase, parking, pauses, catching up, and the copy from a peer that heals it.
- :mod:`~dcr_ray.actors.owner`: the owner side: diffing a trainer shard and streaming its frames, how a
  trainer holds an owner, ownership coverage, and the coding a stream uses.
"""
