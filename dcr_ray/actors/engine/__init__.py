"""An engine actor (:mod:`~dcr_ray.actors.engine.actor`) and the parts it is composed of, over one shared
:mod:`~dcr_ray.actors.engine.context`: the refit protocol on the engine side
(:mod:`~dcr_ray.actors.engine.receive`), its phase (:mod:`~dcr_ray.actors.engine.state`) and the attempt it
is in (:mod:`~dcr_ray.actors.engine.attempt`), serving (:mod:`~dcr_ray.actors.engine.serving`) and the step gate of its in-flight version switches
(:mod:`~dcr_ray.actors.engine.switch`), parking
(:mod:`~dcr_ray.actors.engine.park`), its pause clock (:mod:`~dcr_ray.actors.engine.pause`), catching up by
deltas (:mod:`~dcr_ray.actors.engine.catchup`), copying the committed bits from a peer to heal
(:mod:`~dcr_ray.actors.engine.peer_copy`) and proving them by digest (:mod:`~dcr_ray.actors.engine.digests`)."""
