"""What a coordinator is built from, kept beside its commit record so that every incarnation reads it.

``launch`` writes the topology's settings, clusters, engine factory, owner handles and transport into
``coordinator.pkl`` in the commit directory (:data:`INPUTS_FILE`), and starts the coordinator actor with
that directory as its only argument. Ray restarts a coordinator that crashed by re-running its
constructor with the same arguments; here that is one string, so nothing the restart needs lives in
Ray's object store (actor handles passed as constructor arguments do, and a restart fails once they
go out of scope: ray-project/ray#53727). Each incarnation reads the file again; owner handles replaced
later are kept beside it by :mod:`~dcr_ray.actors.recovery.restarts`.

Whether an incarnation is the first of its launch or a restart is told by :data:`UP_FILE`, which the
first incarnation writes with the launch's id: a restart finds its own id there and resumes from the
record.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any

#: The coordinator's inputs, written by ``launch`` (cloudpickle: actor handles pickle out of band).
INPUTS_FILE = "coordinator.pkl"
#: The launch id of the coordinator incarnation that started first (a later one is a restart).
UP_FILE = "coordinator.up"


@dataclass
class CoordinatorInputs:
    config: Any
    clusters: list
    backend_factory: Any
    owners: dict
    transport: Any
    launch_id: str


def write_inputs(commit_dir: str, *, config, clusters, backend_factory, owners, transport) -> CoordinatorInputs:
    """Write what the coordinator of a new launch is built from (atomically: a temporary file renamed)."""
    import ray

    inputs = CoordinatorInputs(config=config, clusters=list(clusters), backend_factory=backend_factory,
                               owners=dict(owners), transport=transport, launch_id=uuid.uuid4().hex)
    os.makedirs(commit_dir, exist_ok=True)
    path = os.path.join(commit_dir, INPUTS_FILE)
    with open(path + ".tmp", "wb") as f:
        f.write(ray.cloudpickle.dumps(inputs))
    os.replace(path + ".tmp", path)
    return inputs


def read_inputs(commit_dir: str) -> CoordinatorInputs:
    import ray

    with open(os.path.join(commit_dir, INPUTS_FILE), "rb") as f:
        return ray.cloudpickle.loads(f.read())


def is_restart(commit_dir: str, launch_id: str) -> bool:
    """Whether an incarnation of this launch's coordinator ran before this one (else this one is marked
    as the first)."""
    path = os.path.join(commit_dir, UP_FILE)
    try:
        with open(path) as f:
            if f.read().strip() == launch_id:
                return True
    except FileNotFoundError:
        pass
    with open(path + ".tmp", "w") as f:
        f.write(launch_id)
    os.replace(path + ".tmp", path)
    return False
