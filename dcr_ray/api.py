"""The driver-facing API: the :class:`Refit` handle of a running topology (:func:`~dcr_ray.launcher.launch`
starts one and returns it).

::

    import ray, dcr_ray
    refit = dcr_ray.launch(
        owners=[trainer0, trainer1],                     # actors with dcr_ray.OwnerMixin
        clusters=[dcr_ray.ClusterSpec(name="us-east", engines=2),
                  dcr_ray.ClusterSpec(name="eu-west", engines=2)],
        engine=dcr_ray.HFEngine("/path/to/hf_checkpoint"),
    )
    ...                                                  # optimizer step on the trainers
    report = ray.get(refit.remote())                    # every engine now holds the new bits
    print(report)

``Refit`` is a thin public class over the private coordinator actor (named
:data:`~dcr_ray.options.COORDINATOR_NAME` in the topology's namespace, :attr:`RefitConfig.namespace
<dcr_ray.config.RefitConfig.namespace>`, :data:`~dcr_ray.options.NAMESPACE` by default), so
``Refit.get(namespace=...)`` finds it from any driver, and the Ray dashboard shows it with its owners,
relays and engines. Two topologies share one Ray cluster under two namespaces
(``RefitConfig(namespace="reward")``).
"""

from __future__ import annotations

import logging
import time
import uuid

import ray

from dcr_ray import progress
from dcr_ray.errors import ConfigError, RefitError, RefitTimeoutError
from dcr_ray.named_actors import TOPOLOGY_PREFIXES, kill_named, remove_placement_groups
from dcr_ray.options import COORDINATOR_NAME, NAMESPACE, OWNER_PREFIX
from dcr_ray.refit_call import answer_refit, coordinator_gone, forget_topology, topology_commit_dir
from dcr_ray.report import RefitReport

log = logging.getLogger(__name__)

#: How often Ray re-sends a ``refit`` call to a coordinator restarted after its process died.
REFIT_CALL_RETRIES = 10
#: How long ``Refit.run`` and the reading calls wait before asking a restarting coordinator again.
_RESTART_POLL_S = 1.0
#: How long the reading calls (``status``, ``engines``, ``wait_healed``...) wait for a restarting coordinator.
_RESTART_WAIT_S = 120.0
#: How long shutdown waits for the coordinator to tear down before killing actors by name.
_SHUTDOWN_TIMEOUT_S = 120


class Refit:
    """Handle of a running dcr_ray topology.

    ``refit.remote()`` starts a refit and returns an ObjectRef of its :class:`RefitReport` (it
    resolves only after the commit record is written; otherwise ``ray.get`` raises ``RefitError``).
    :meth:`run` is the blocking shortcut.
    """

    def __init__(self, actor, namespace: str = NAMESPACE, commit_dir: str | None = None):
        self._actor = actor
        self.namespace = namespace
        self._commit_dir = commit_dir

    @classmethod
    def get(cls, namespace: str = NAMESPACE) -> "Refit":
        """The topology launched earlier in this Ray cluster (by any driver) in ``namespace``.

        When no coordinator answers there: :class:`~dcr_ray.errors.CoordinatorGoneError` if a topology
        was launched there and not shut down (its coordinator died for good; the error names the version
        the commit record holds and the ``launch(..., resume=True)`` call that carries on), else
        :class:`~dcr_ray.errors.ConfigError`. Both are ``ValueError``\ s."""
        commit_dir = topology_commit_dir(namespace)
        try:
            actor = ray.get_actor(COORDINATOR_NAME, namespace=namespace)
        except ValueError:
            if commit_dir is not None:
                raise coordinator_gone(namespace, commit_dir) from None
            raise ConfigError(f"no dcr_ray topology runs in namespace {namespace!r} of this Ray cluster: start one "
                              f"with dcr_ray.launch(..., config=RefitConfig(namespace={namespace!r}))") from None
        return cls(actor, namespace, commit_dir)

    def remote(self) -> ray.ObjectRef:
        """Start a refit; returns the ObjectRef of its :class:`RefitReport` (``ray.get`` it).

        The call carries a fresh request id. If the coordinator's process dies during the refit, Ray
        restarts it and retries the call: a refit whose commit record was already written is answered
        from the record (with a warning), one that had not committed runs again on the resumed
        coordinator. Either way the answer is a report or a :class:`~dcr_ray.errors.RefitError`; a
        coordinator gone for good answers :class:`~dcr_ray.errors.CoordinatorGoneError`, naming the
        version its record holds and how to resume (:mod:`~dcr_ray.refit_call`).
        """
        return self._call(uuid.uuid4().hex)

    def _call(self, request: str) -> ray.ObjectRef:
        return answer_refit.remote(self.namespace, request, REFIT_CALL_RETRIES, self._commit_dir)

    @property
    def actor(self):
        """The coordinator actor handle."""
        return self._actor

    def run(self, timeout: float | None = None) -> RefitReport:
        """Refit now and wait for the report (with a progress bar on a terminal, see :mod:`dcr_ray.progress`).

        If the coordinator stays unavailable past Ray's retries of the call (it is restarting), the same
        request is sent again once it answers: answered from the record if it committed, run if not."""
        request = uuid.uuid4().hex
        deadline = None if timeout is None else time.monotonic() + timeout
        for _ in range(REFIT_CALL_RETRIES):
            try:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                return progress.wait(self._call(request), self._actor, desc="dcr_ray refit", timeout=left)
            except ray.exceptions.ActorUnavailableError:
                time.sleep(_RESTART_POLL_S)  # restarting: the record still says whether the request committed
        return progress.wait(self._call(request), self._actor, desc="dcr_ray refit", timeout=timeout)

    def status(self, detail: bool = False) -> dict:
        """The committed version and record, required engines and the refit in flight (``phase``); with
        ``detail``, also each engine's version and state, relays per cluster and the last refits (what
        ``dcr-ray status`` prints). While the coordinator restarts, it waits for the resumed one."""
        return self._read("status", detail)

    def engines(self) -> dict:
        """Engine id -> engine actor handle."""
        return self._read("handles")["engines"]

    def owners(self) -> dict:
        return self._read("handles")["owners"]

    def relay_stats(self) -> list[dict]:
        return self._read("relay_stats")

    def _read(self, method: str, *args):
        """A call that only reads the coordinator's state. While Ray restarts the coordinator (it answers
        "temporarily unavailable") the call is made again, for up to :data:`_RESTART_WAIT_S`: reading twice
        changes nothing. Calls that change the topology are not repeated (the first may have run)."""
        deadline = time.monotonic() + _RESTART_WAIT_S
        while True:
            try:
                return ray.get(getattr(self._actor, method).remote(*args))
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(_RESTART_POLL_S)

    def rejoin(self, engine_id: str) -> dict:
        """Bring ``engine_id`` to the committed version now (by the deltas it missed, else from a peer, else
        densely from the owners: see :mod:`~dcr_ray.actors.recovery.healing`) and add it to the required set;
        re-created first if its actor died."""
        return ray.get(self._actor.rejoin.remote(engine_id))

    def drain(self, engine_id: str) -> dict:
        """Take ``engine_id`` out of the refits between two of them, with nothing scheduled (maintenance, a
        user's engine lent elsewhere for a while): it keeps serving the version it holds and misses every
        refit until :meth:`rejoin` brings it to the committed version (by the deltas it missed, where its
        cluster's window still holds them). Returns ``status()``; ``ConfigError`` for an engine that is not
        required now."""
        return ray.get(self._actor.drain.remote(engine_id))

    def invalidate(self, engine_id: str, why: str = "changed outside dcr_ray") -> dict:
        """Tell dcr_ray that ``engine_id``'s weights changed outside it (a vLLM sleep at level 2 discarded
        them, a reload from disk, a manual edit): no delta may build on them. The engine leaves the
        required set, holds no version, and heals now: it rejoins without frames if its served bits still
        have the committed digests, else from a peer, else densely from the owners. Returns ``status()``."""
        return ray.get(self._actor.invalidate.remote(engine_id, why))

    def wait_healed(self, timeout: float = 600.0, poll_s: float = 0.5) -> dict:
        """Wait until no engine is healing in the background (dead, evicted or joining engines heal while
        refits go on); returns the final ``status()``. Raises :class:`~dcr_ray.errors.RefitError` naming
        the engines whose healing failed (``rejoin`` retries one), and
        :class:`~dcr_ray.errors.RefitTimeoutError` past ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            failed = {e: r["error"] for e, r in st["healing"].items() if r["standing"] == "failed"}
            if failed:
                raise RefitError(f"healing failed for {sorted(failed)}: {failed}; Refit.rejoin(engine_id) retries")
            if not st["healing"]:
                return st
            if time.monotonic() > deadline:
                raise RefitTimeoutError(f"engines {sorted(st['healing'])} still heal after {timeout:.0f} s: "
                                        f"{st['healing']}")
            time.sleep(poll_s)

    def replace_owner(self, owner_id: str, handle) -> dict:
        """Attach ``handle`` in place of owner ``owner_id`` (e.g. one that died), without relaunching.

        It must cover what ``owner_id`` covered and hold the committed version's bits (checked by digest
        against an engine); otherwise ``ConfigError`` and nothing changes.
        """
        return ray.get(self._actor.replace_owner.remote(owner_id, handle))

    def shutdown(self, force: bool = False) -> None:
        """Kill the coordinator, engines and relays and remove their placement groups; also the owners
        ``launch(owner_tensors=...)`` made (owners given by the caller are left alone). Ray keeps an actor
        alive while any handle to it may be in use, and the handles of owners given to ``launch`` reached
        the detached coordinator: Ray keeps them alive for as long as this driver runs. A driver that
        launches again with new trainer actors should ``ray.kill`` the old ones.

        Engines and relays outlive the coordinator (they are detached), so this also works when the
        coordinator already died: it then finds them (and their placement groups) by name.
        ``force=True`` does not ask the coordinator first (it may be stuck in a long call): the
        topology's actors and placement groups are removed by name at once.
        """
        self._shutdown(force=force)

    def _shutdown(self, keep: set[str] = frozenset(), force: bool = False) -> None:
        """:meth:`shutdown`, sparing the engine and relay names in ``keep`` (those of another topology)."""
        ns = self.namespace
        try:
            if force:
                raise ray.exceptions.GetTimeoutError("shutdown(force=True)")
            ray.get(self._actor.teardown.remote(), timeout=_SHUTDOWN_TIMEOUT_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            kill_named(TOPOLOGY_PREFIXES, keep=keep, namespace=ns)
            remove_placement_groups(ns)
        kill_named((OWNER_PREFIX,), namespace=ns)  # the owners launch(owner_tensors=...) made (detached)
        ray.kill(self._actor, no_restart=True)
        forget_topology(ns)
