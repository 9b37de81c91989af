"""A refit call's answer when the coordinator is gone for good, and where to find the commit record then.

``Refit.remote()`` returns the ObjectRef of a small Ray task (no CPU reserved) that makes the
coordinator's ``refit`` call and passes its answer through: the report, or the coordinator's own
:class:`~dcr_ray.errors.RefitError`. Ray retries the call on a coordinator it restarts; only when the
coordinator is dead for good (``ray.kill(..., no_restart=True)``, its node lost) does the task answer
instead, with :class:`~dcr_ray.errors.CoordinatorGoneError`: the version the commit record holds
(and whether this very call committed it) and the call that resumes the topology. Without the task,
``ray.get`` would raise Ray's ``ActorDiedError`` although the version may have committed.

The commit directory of each namespace's topology is kept in Ray's key-value store (the GCS, which
outlives every actor): ``launch`` writes it, ``Refit.shutdown`` removes it, and ``Refit.get`` reads it
to say what is committed when no coordinator answers. This module imports only Ray and the commit
record, so the task starts in a fresh worker in milliseconds.
"""

from __future__ import annotations

import time

import ray

from dcr_ray.actors.fleet.commit import CommitLog
from dcr_ray.errors import CoordinatorGoneError

#: Key of a namespace's commit directory in Ray's key-value store.
_KV_KEY = "dcr_ray/{namespace}/commit_dir"


def remember_topology(namespace: str, commit_dir: str) -> None:
    """Record the commit directory of the topology launched in ``namespace``."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(_KV_KEY.format(namespace=namespace), commit_dir.encode(), overwrite=True)


def forget_topology(namespace: str) -> None:
    """The topology of ``namespace`` was shut down: nothing to resume there."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(_KV_KEY.format(namespace=namespace))


def topology_commit_dir(namespace: str) -> str | None:
    """The commit directory recorded for ``namespace`` (None: no topology was launched there, or it was
    shut down)."""
    from ray.experimental import internal_kv

    value = internal_kv._internal_kv_get(_KV_KEY.format(namespace=namespace))
    return value.decode() if value else None


def coordinator_gone(namespace: str, commit_dir: str | None, request: str | None = None) -> CoordinatorGoneError:
    """The error to raise when the coordinator of ``namespace`` is gone for good: what the commit record in
    ``commit_dir`` holds (``request``: the refit call being answered) and how to resume."""
    rec = None
    if commit_dir:
        try:
            rec = CommitLog(commit_dir).read()
        except (OSError, ValueError, TypeError):
            rec = None
    resume = (f"dcr_ray.launch(owners=..., clusters=..., engine=..., resume=True, config=RefitConfig("
              f"namespace={namespace!r}, commit=CommitConfig(dir={commit_dir!r}), ...)) with the clusters, "
              f"engine and owners it was launched with")
    if rec is None:
        known = (f"its commit record in {commit_dir!r} cannot be read" if commit_dir
                 else "no commit directory is known for it")
        return CoordinatorGoneError(f"the dcr_ray coordinator of namespace {namespace!r} is gone for good and "
                                    f"{known}; its engines and relays may still run: resume with {resume}")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rec.time)) if rec.time else "?"
    if request is not None and rec.request == request:
        what = f"this refit committed version {rec.version} (transfer {rec.transfer}) before it died"
    elif request is not None:
        what = (f"this refit did not commit: the commit record still holds version {rec.version} "
                f"(transfer {rec.transfer}, written {when})")
    else:
        what = f"the commit record holds version {rec.version} (transfer {rec.transfer}, written {when})"
    return CoordinatorGoneError(
        f"the dcr_ray coordinator of namespace {namespace!r} is gone for good; {what}, held by engines "
        f"{rec.members} (record in {commit_dir}). Its engines and relays are detached and keep serving that "
        f"version: resume with {resume}")


@ray.remote(num_cpus=0, max_retries=0)
def warm(namespace: str) -> bool:
    """Make a handle to the coordinator of ``namespace`` where :func:`answer_refit` will run: ``launch``
    submits it while the topology starts, so the first refit does not wait for a Ray worker to start
    and load the coordinator's class (Ray imports its module to make a handle; that module imports neither
    torch nor transformers, ``tests/test_import_rules.py``)."""
    from dcr_ray.options import COORDINATOR_NAME

    for _ in range(100):
        try:
            ray.get_actor(COORDINATOR_NAME, namespace=namespace)
            return True
        except ValueError:  # not registered yet
            time.sleep(0.05)
    return False


@ray.remote(num_cpus=0, max_retries=0)
def answer_refit(namespace: str, request: str, retries: int, commit_dir: str | None):
    """Make the coordinator's ``refit(request)`` call and return its report (see the module docstring).

    The coordinator is looked up by name here rather than passed as a handle, in the worker that
    :func:`warm` prepared: Ray imports the actor's class to make either, which a fresh worker would pay in
    its first refit."""
    from dcr_ray.options import COORDINATOR_NAME

    try:
        coordinator = ray.get_actor(COORDINATOR_NAME, namespace=namespace)
    except ValueError:
        raise coordinator_gone(namespace, commit_dir, request) from None
    try:
        return ray.get(coordinator.refit.options(max_task_retries=retries).remote(request))
    except ray.exceptions.RayTaskError as e:
        raise e.as_instanceof_cause() from None  # the coordinator's own error, as if it were called directly
    except ray.exceptions.ActorDiedError:
        raise coordinator_gone(namespace, commit_dir, request) from None
