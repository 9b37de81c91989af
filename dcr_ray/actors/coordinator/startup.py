"""Start-up: the first launch of a topology, or a restarted coordinator's resume.

A launch creates the engines and the transport, attaches the owners, writes record v0 and bootstraps
every engine densely (:meth:`Startup.start`); a coordinator that Ray restarted, or
``launch(..., resume=True)``, carries on from the durable record instead
(:meth:`~dcr_ray.actors.recovery.restarts.Recovery.resume`). A restart that cannot resume keeps its error
for the next call to report (raising in the constructor would make Ray restart the actor in a loop).

A part of :class:`~dcr_ray.actors.coordinator.actor.CoordinatorActor`, handed the shared state, the dense
bootstrap and recovery.
"""

from __future__ import annotations

import logging
import math

from dcr_ray.actors.fleet.calls import get_all
from dcr_ray.actors.fleet.commit import CommitRecord
from dcr_ray.actors.fleet.state import CoordinatorState
from dcr_ray.actors.owner.coverage import check_coverage
from dcr_ray.actors.recovery.bootstrap import Bootstrap
from dcr_ray.actors.recovery.restarts import Recovery
from dcr_ray.codec.bits import dtype_of, itemsize
from dcr_ray.errors import ConfigError, RefitError

log = logging.getLogger("dcr_ray")


class Startup:
    """Whether the topology started, and how it starts (see the module doc)."""

    def __init__(self, state: CoordinatorState, bootstrap: Bootstrap, recovery: Recovery):
        self._shared = state
        self._boot = bootstrap
        self._recovery = recovery
        self.started = False
        self._resume_error: Exception | None = None

    def restarted(self) -> None:
        """Ray restarted this actor: carry on from the record, or keep why it could not."""
        try:
            self.start(resume=True)
        except Exception as e:  # kept for refit() to report; raising here would restart us in a loop
            self._resume_error = e
            log.error("dcr_ray: the restarted coordinator could not resume: %r", e)

    def require_started(self) -> None:
        """Raise ``RefitError`` (saying why) unless the topology started."""
        if self.started:
            return
        if self._resume_error is not None:
            raise RefitError(f"the restarted coordinator could not resume from the commit record: "
                             f"{self._resume_error!r}; relaunch with launch(..., resume=True)")
        raise RefitError("the coordinator was not started; use dcr_ray.launch(...)")

    def start(self, resume: bool) -> None:
        """Launch the topology, or with ``resume`` carry on from the record (a no-op once started)."""
        s = self._shared
        with s.lock:
            if self.started:
                return
            if resume:
                self._recovery.resume()
            else:
                self._launch()
            self.started = True

    def _launch(self) -> None:
        s = self._shared
        cfg = s.config
        rec = s.commits.read()
        if rec is not None and rec.version != 0:  # checked before anything is spawned
            raise ConfigError(
                f"the commit record in {cfg.commit.dir} already holds version {rec.version}; owners start "
                f"at version 0: use a fresh CommitConfig.dir, or launch(..., resume=True) to carry on "
                f"with the running topology"
            )
        s.start.mark("construct")
        s.set_phase("start engines")
        s.topology.start(s.backend_factory, cfg)
        s.start.mark("spawn")
        t = cfg.commit.start_timeout_s
        s.set_phase("attach")
        specs = get_all({o: h.attach(o, cfg) for o, h in s.owners.items()}, t, "attach")
        s.start.mark("attach owners")
        s.set_phase("engines up")  # the engines' actors start and load the model
        engine_specs = s.topology.engine_specs(t)
        s.start.mark("engines up")
        check_coverage(specs, engine_specs)
        s.model_bytes = sum(math.prod(shape) * itemsize(dtype_of(dt)) for dt, shape in engine_specs.values())
        self._recovery.attached(specs)  # a restarted coordinator checks replacements against these specs
        if rec is None:
            s.commits.compare_and_set(None, CommitRecord(version=0, transfer="attach", baseline="",
                                                         members=sorted(s.engines)))
        s.version = 0
        self._boot.dense(list(s.engines))
        s.start.mark("bootstrap")
