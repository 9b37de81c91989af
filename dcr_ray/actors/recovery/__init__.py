"""How the fleet gets back to the committed version and its configured size, off the trainer's clock where
it can: the dense bootstrap from the owners (:mod:`~dcr_ray.actors.recovery.bootstrap`), engines that heal
in the background from a peer (:mod:`~dcr_ray.actors.recovery.healing`, its sources chosen by
:mod:`~dcr_ray.actors.recovery.sources`; the engine's side of the copy is
:mod:`~dcr_ray.actors.engine.peer_copy`), lost nodes and lost capacity
(:mod:`~dcr_ray.actors.recovery.outages`), and a restarted coordinator, a retried call, dead relays and a dead
owner (:mod:`~dcr_ray.actors.recovery.restarts`). A heal's waits on other processes (an engine's start, a
copy, a catch-up) are each bounded and watch the nodes they depend on (:mod:`~dcr_ray.actors.recovery.waits`)."""
