"""What the coordinator knows of the fleet, shared by its parts: the one state object
(:mod:`~dcr_ray.actors.fleet.state`), the topology and its placement (:mod:`~dcr_ray.actors.fleet.topology`,
:mod:`~dcr_ray.actors.fleet.placement`), the live nodes (:mod:`~dcr_ray.actors.fleet.nodes`), every engine's
standing (:mod:`~dcr_ray.actors.fleet.standings`), the durable commit record and the settings kept beside it
(:mod:`~dcr_ray.actors.fleet.commit`, :mod:`~dcr_ray.actors.fleet.inputs`), and waiting on many actor calls
(:mod:`~dcr_ray.actors.fleet.calls`)."""
