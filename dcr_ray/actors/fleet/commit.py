"""The durable commit record: the one authoritative binding of a version to its source baseline.

``commit.json`` in the commit directory holds the latest record. A commit is a compare-and-set on the
version: under an exclusive file lock, the current record must still say ``version == expected``; the
new record is written to a temporary file, fsynced and renamed over ``commit.json`` (atomic on POSIX),
so a reader sees the old or the new record, never a torn one. That rename is the one durable step:
only after it do owners promote their baselines and engines activate.

A write that fails (read-only or full disk, an immutable directory) raises :class:`CommitError`, a
failed attempt like any other, unless re-reading the record shows the new record in place after all
(the rename landed and only what followed it failed): then the commit stands. ``history.jsonl``
appends every record as a log for people; it is written after the record and a failure to append it
is logged, never a failed commit (the record, not the log, says what is committed).

Each coordinator incarnation has a fencing ``epoch``: one that resumes from the record first rewrites
it with ``epoch + 1``, and a compare-and-set from an older epoch is refused, so a stale coordinator
(a partitioned or zombie incarnation) can never move the record again.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field

from dcr_ray.errors import CommitConflictError, CommitError

log = logging.getLogger("dcr_ray")


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
    request: str = ""
    """Id of the ``Refit.remote()`` call that committed it: a call Ray retries on a restarted
    coordinator is answered from the record instead of refitting twice."""


class CommitLog:
    def __init__(self, directory: str):
        self.directory = directory
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, "commit.json")
        self._lock_path = os.path.join(directory, ".lock")
        #: what went wrong after the last durable record (history.jsonl not appended): for its report
        self.warnings: list[str] = []

    def read(self) -> CommitRecord | None:
        try:
            with open(self.path) as f:
                return CommitRecord(**json.load(f))
        except FileNotFoundError:
            return None

    def compare_and_set(self, expected_version: int | None, record: CommitRecord) -> CommitRecord:
        """Write ``record`` iff the current version is ``expected_version`` (None: no record yet).

        Raises :class:`CommitConflictError` when another writer moved the record or fenced this one, and
        :class:`CommitError` when the record could not be written (the committed version is unchanged).
        """
        record.time = record.time or time.time()
        self.warnings = []
        try:
            with open(self._lock_path, "a+") as lk:
                fcntl.flock(lk, fcntl.LOCK_EX)
                try:
                    self._check(expected_version, record)
                    self._replace(record)
                finally:
                    fcntl.flock(lk, fcntl.LOCK_UN)
        except OSError as e:
            if self._holds(record):  # the rename landed; what failed came after it
                log.warning("dcr_ray: the commit record v%d is in place although writing it reported %r",
                            record.version, e)
                return record
            raise CommitError(
                f"the commit record in {self.directory} could not be written ({type(e).__name__}: {e}); the "
                f"committed version stays {expected_version}. Make the directory writable again (disk space, "
                f"permissions, an immutable flag); the next refit then commits") from e
        self._append_history(record)
        return record

    def _check(self, expected_version: int | None, record: CommitRecord) -> None:
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

    def _replace(self, record: CommitRecord) -> None:
        """The durable step: the new record in a fsynced temporary file, renamed over ``commit.json``."""
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(asdict(record), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself survives a power loss
        finally:
            os.close(fd)

    def _holds(self, record: CommitRecord) -> bool:
        try:
            cur = self.read()
        except (OSError, ValueError, TypeError):
            return False
        return cur is not None and asdict(cur) == asdict(record)

    def _append_history(self, record: CommitRecord) -> None:
        try:
            with open(os.path.join(self.directory, "history.jsonl"), "a") as f:
                f.write(json.dumps(asdict(record)) + "\n")
        except OSError as e:
            warning = (f"version {record.version} is committed, but {self.directory}/history.jsonl could not be "
                       f"appended ({type(e).__name__}: {e}); commit.json holds the record, the log lacks this line")
            log.warning("dcr_ray: %s", warning)
            self.warnings.append(warning)
