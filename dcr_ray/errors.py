"""One error tree for dcr_ray.

Every failure that dcr_ray detects is a :class:`DcrError` subclass whose message says what was wrong
and, where there is one, how to fix it. A dead Ray actor surfaces as Ray's own ``RayActorError`` and is
handled apart from these application errors (see ``dcr_ray.actors``).

Frame errors (:class:`FrameError` and below) are raised *before* any byte of a target is written: a
receiver that catches one holds exactly the bits it held before the call.
"""

from __future__ import annotations


class DcrError(Exception):
    """Base class of every error dcr_ray raises on purpose."""


class ConfigError(DcrError, ValueError):
    """A configuration value is invalid; the message names the field and a valid setting."""


# --- frames / codec ---------------------------------------------------------------------------------
class FrameError(DcrError):
    """A payload frame was rejected during validation; nothing was written."""


class TruncatedFrameError(FrameError):
    """The frame ends before the sizes its header declares."""


class BadMagicError(FrameError):
    """The bytes do not start with the dcr_ray frame magic (not a dcr_ray payload)."""


class UnsupportedVersionError(FrameError):
    """The frame was written by an unknown wire-format version."""


class DigestMismatchError(FrameError):
    """The BLAKE2b digest does not match: corrupted bytes, or signed with a different key."""


class MalformedHeaderError(FrameError):
    """The msgpack header is not a valid dcr_ray header (bad types, extension types, missing fields)."""


class UnknownEncodingError(MalformedHeaderError):
    """An item or section names an encoding this version does not know."""


class SizeLimitError(FrameError):
    """A declared or decompressed size exceeds its bound (protects against decompression bombs)."""


class TargetMismatchError(FrameError):
    """An item names a tensor the receiver does not have, or with another dtype or shape."""


class IndexOutOfRangeError(FrameError):
    """A decoded location lies outside the item's declared range or the tensor."""


class DuplicateIndexError(FrameError):
    """Two items of one frame write overlapping element ranges of the same tensor."""


class InvalidValueError(FrameError):
    """Decoded values are not valid for the tensor's dtype (e.g. a bool byte other than 0 or 1)."""


class BaseVersionMismatchError(FrameError):
    """The payload was built on a base version the receiver does not hold."""


# --- baselines ---------------------------------------------------------------------------------------
class BaselineError(DcrError):
    """Baseline store misuse: unknown tensor, pending state already open, promote without pending, ..."""


# --- protocol / actors ------------------------------------------------------------------------------
class RefitError(DcrError):
    """A refit did not commit. The message says which stage failed and why."""


class CoordinatorGoneError(RefitError, ValueError):
    """The topology's coordinator is gone for good (killed, or its node lost, past Ray's restarts). The
    message names the version the commit record holds and the call that resumes the topology
    (``dcr_ray.launch(..., resume=True)`` with the same ``CommitConfig.dir``). A ``ValueError`` too,
    as ``Refit.get`` raised when no coordinator answered."""


class OwnerLostError(RefitError):
    """An owner's actor or its node is gone, and its committed bits with it: the refit cannot continue
    until ``Refit.replace_owner(owner_id, handle)`` puts an actor that holds the committed bits in its place."""


class RefitTimeoutError(RefitError, TimeoutError):
    """A stage of a refit did not finish within its configured timeout."""


class StagingBudgetError(RefitError, ConfigError):
    """A staging engine would hold more payload bytes than ``EngineConfig.staging_budget_bytes``;
    retrying cannot help, so the refit fails at once (nothing was written)."""


class CommitConflictError(RefitError):
    """The commit record's compare-and-set failed: another writer moved the version."""


class CommitError(RefitError):
    """The commit record could not be written (a read-only or full disk): the attempt failed and the
    committed version is unchanged."""


class EngineStateError(RefitError):
    """An engine is not in the state the protocol step needs (e.g. prepare for a version it does not hold)."""


# --- engine backends ---------------------------------------------------------------------------------
class BackendError(DcrError):
    """An engine backend cannot start, place or apply as asked; the message says which tensor or setting."""


class BackendUnavailableError(BackendError):
    """The serving runtime a backend wraps is not installed (the message says what to install)."""


class UnsupportedRuntimeError(BackendUnavailableError):
    """The installed serving runtime is a release dcr_ray does not support (the message names the range)."""


class LoaderCaptureError(BackendError):
    """The runtime's own loader wrote parameter storage in a way dcr_ray cannot follow bit-exactly.

    Raised while classifying loader paths (before any write); the message names the tensors. Use the
    host-mirror mode of the backend for such a model.
    """
