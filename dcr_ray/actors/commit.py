"""The durable commit record: the one authoritative binding of a version to its source baseline.

``commit.json`` in the commit directory holds the latest record; ``history.jsonl`` appends every
record. A commit is a compare-and-set on the version: under an exclusive file lock, the current
record must still say ``version == expected``; the new record is written to a temporary file, fsynced
and renamed over ``commit.json`` (atomic on POSIX), so a reader sees the old or the new record,
never a torn one. Only after this write do owners promote their baselines and engines activate.

Each coordinator incarnation has a fencing ``epoch``: one that resumes from the record first rewrites
it with ``epoch + 1``, and a compare-and-set from an older epoch is refused, so a stale coordinator
(a partitioned or zombie incarnation) can never move the record again.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import asdict, dataclass, field

from dcr_ray.errors import CommitConflictError


@dataclass(kw_only=True, slots=True)
class CommitRecord:
    version: int
    """Committed version (0: the state every component was attached or bootstrapped with)."""
    transfer: str
    """Transfer id that produced it."""
    baseline: str
    """Id of the owners' baseline this version was diffed from (the previous record's transfer)."""
    members: list[str] = field(default_factory=list)
    """Engines that hold this version (the required set that acknowledged it)."""
    time: float = 0.0
    epoch: int = 0
    """Fencing epoch of the coordinator incarnation that wrote it."""


class CommitLog:
    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "commit.json")
        self._lock_path = os.path.join(directory, ".lock")

    def read(self) -> CommitRecord | None:
        try:
            with open(self.path) as f:
                return CommitRecord(**json.load(f))
        except FileNotFoundError:
            return None

    def compare_and_set(self, expected_version: int | None, record: CommitRecord) -> CommitRecord:
        """Write ``record`` iff the current version is ``expected_version`` (None: no record yet)."""
        record.time = record.time or time.time()
        with open(self._lock_path, "a+") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)
            try:
                cur = self.read()
                have = None if cur is None else cur.version
                if have != expected_version:
                    raise CommitConflictError(
                        f"commit record is at version {have}, expected {expected_version}: another "
                        f"coordinator moved it; refusing to overwrite"
                    )
                if cur is not None and cur.epoch > record.epoch:
                    raise CommitConflictError(
                        f"commit record was written by coordinator epoch {cur.epoch}; this coordinator is "
                        f"epoch {record.epoch} (fenced: a newer coordinator resumed from the record)")
                tmp = self.path + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(asdict(record), f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
                with open(os.path.join(self.directory, "history.jsonl"), "a") as f:
                    f.write(json.dumps(asdict(record)) + "\n")
            finally:
                fcntl.flock(lk, fcntl.LOCK_UN)
        return record
