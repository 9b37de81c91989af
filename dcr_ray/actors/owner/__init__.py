"""The owner side: a delta owner diffs a trainer shard against its committed baseline and streams frames
(:mod:`~dcr_ray.actors.owner.delta`); a trainer holds one or mixes one in
(:mod:`~dcr_ray.actors.owner.held`), and the coordinator reaches it through an endpoint either way
(:mod:`~dcr_ray.actors.owner.endpoint`); every canonical element has exactly one owner
(:mod:`~dcr_ray.actors.owner.coverage`); the coding a stream uses
(:mod:`~dcr_ray.actors.owner.coding`)."""
