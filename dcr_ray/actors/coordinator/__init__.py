"""The commit coordinator (:mod:`~dcr_ray.actors.coordinator.actor`, the refit's state machine) and what it
decides and reports: which engines take part in a refit (:mod:`~dcr_ray.actors.coordinator.membership`),
``status()`` and ``progress()`` (:mod:`~dcr_ray.actors.coordinator.inspection`), which coding a refit uses
(:mod:`~dcr_ray.actors.coordinator.coding`), the CPU seconds every actor
spent on a refit (:mod:`~dcr_ray.actors.coordinator.cpu_clock`), and how a topology starts: the first launch,
or a restarted coordinator's resume from the commit record (:mod:`~dcr_ray.actors.coordinator.startup`)."""
