"""How a trainer becomes a dcr_ray owner: it holds an :class:`Owner`, or mixes in :class:`OwnerMixin`.

Composition is the plain way: any Ray actor that keeps one :class:`Owner` in an attribute is an owner;
nothing about its class changes::

    @ray.remote
    class MyTrainer:
        def __init__(self):
            self.dcr = dcr_ray.Owner(lambda: bf16_share(self.model))   # canonical name -> tensor

The coordinator reaches a held owner through Ray's ``__ray_call__``
(:class:`~dcr_ray.actors.owner.endpoint.OwnerEndpoint`), so a trainer class keeps its own method names.
:class:`OwnerMixin` is the thin shim for classes that prefer ``dcr_*`` methods of their own (and may
override one, e.g. to observe ``dcr_promote``); :class:`StandaloneOwner` is an owner actor that is handed
its tensors. All three run :class:`~dcr_ray.actors.owner.delta.DeltaOwner`. A trainer must not take an
optimizer step between a transfer's ``stream`` and its ``promote``/``discard``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

from dcr_ray.actors.owner.delta import DeltaOwner
from dcr_ray.config import RefitConfig
from dcr_ray.errors import BaselineError, ConfigError
from dcr_ray.relay.transport import Sink
from dcr_ray.sharding import Shard

if TYPE_CHECKING:  # annotations only: torch is imported where it runs
    import torch


class Owner:
    """The owner a trainer holds: ``tensors()`` gives this rank's share, CPU (or GPU), in the dtype the
    engines hold: canonical name -> tensor, a DTensor (FSDP2 / tensor-parallel shard, mapped by its
    placements), or local name -> :class:`dcr_ray.sharding.Shard`. See :mod:`dcr_ray.sharding`.

    Its methods are the owner protocol (:mod:`dcr_ray.actors.owner.delta`) without the ``dcr_`` prefix."""

    def __init__(self, tensors: Callable[[], Mapping[str, object]]):
        if not callable(tensors):
            raise ConfigError("dcr_ray.Owner(tensors) takes a function returning this rank's share "
                              "({name: tensor}), e.g. Owner(lambda: bf16_state(self.model))")
        self._tensors = tensors
        self._delta: DeltaOwner | None = None

    @property
    def delta(self) -> DeltaOwner:
        """The logic underneath (baseline, pending set); attached by the coordinator first."""
        if self._delta is None:
            raise BaselineError("this owner was not attached: the coordinator calls attach() first")
        return self._delta

    def attach(self, owner_id: str, config: RefitConfig, baseline_dir: str | None = None,
               in_memory: bool = False, version: int = 0) -> dict[str, tuple]:
        """Take the current tensors as the committed baseline of ``version``, as owner ``owner_id`` (a repeated
        call checks the layout). An owner attached under another id that never streamed (a replacement
        the coordinator refused, e.g. named with the wrong id) is attached afresh; one that streamed keeps
        its id: ``ConfigError`` (its frames would collide with the other owner's)."""
        if self._delta is not None and self._delta.owner_id != owner_id:
            if self._delta.used:
                raise ConfigError(f"this owner streams as {self._delta.owner_id!r}; it cannot become "
                                  f"{owner_id!r} (give Refit.replace_owner a fresh actor for {owner_id!r})")
            self._delta = None
        if self._delta is None:
            self._delta = DeltaOwner(owner_id, config, baseline_dir=baseline_dir, in_memory=in_memory)
        return self._delta.attach(self._tensors(), version)

    def state(self) -> dict:
        """``{"version": committed baseline version, "pending": version of the pending set or None}``."""
        return {"version": self.delta.version, "pending": self.delta.store.pending_version}

    def digests(self) -> dict:
        return self.delta.digests()

    def stream(self, transfer: str, attempt: int, base: int, target: int, sink: Sink, base_id: str = "",
               coding: str | None = None) -> dict:
        return self.delta.stream(self._tensors(), transfer=transfer, attempt=attempt, base=base, target=target,
                                 sink=sink, base_id=base_id, coding=coding)

    def bootstrap(self, transfer: str, sink: Sink) -> dict:
        return self.delta.bootstrap(transfer=transfer, sink=sink)

    def promote(self, version: int) -> int:
        return self.delta.promote(version)

    def discard(self) -> None:
        self.delta.discard()

    def version(self) -> int:
        return self.delta.version


class OwnerMixin:
    """Mix into a trainer actor class to make it a dcr_ray owner: implement :meth:`dcr_tensors`. Each
    ``dcr_<call>`` method is the held :class:`Owner`'s ``<call>``."""

    _dcr: Owner | None = None

    def dcr_tensors(self) -> Mapping[str, object]:
        """This owner's share (see :class:`Owner`)."""
        raise NotImplementedError("implement dcr_tensors() to return this owner's canonical tensors")

    def _dcr_held(self) -> Owner:
        if self._dcr is None:
            self._dcr = Owner(self.dcr_tensors)
        return self._dcr

    def dcr_delta_owner(self) -> DeltaOwner:
        """The :class:`~dcr_ray.actors.owner.delta.DeltaOwner` behind this actor (its committed store, its config), for
        inspection from inside the actor by tests and benchmarks; only the coordinator's calls change it."""
        return self._dcr_held().delta

    def dcr_attach(self, owner_id: str, config: RefitConfig, baseline_dir: str | None = None,
                   in_memory: bool = False, version: int = 0):
        return self._dcr_held().attach(owner_id, config, baseline_dir, in_memory, version)

    def dcr_state(self) -> dict:
        return self._dcr_held().state()

    def dcr_digests(self) -> dict:
        return self._dcr_held().digests()

    def dcr_stream(self, transfer: str, attempt: int, base: int, target: int, sink: Sink,
                   base_id: str = "", coding: str | None = None) -> dict:
        return self._dcr_held().stream(transfer, attempt, base, target, sink, base_id=base_id, coding=coding)

    def dcr_bootstrap(self, transfer: str, sink: Sink) -> dict:
        return self._dcr_held().bootstrap(transfer, sink)

    def dcr_promote(self, version: int) -> int:
        return self._dcr_held().promote(version)

    def dcr_discard(self) -> None:
        self._dcr_held().discard()

    def dcr_version(self) -> int:
        return self._dcr_held().version()


def _copy(t):
    """A private copy of a tensor, or of a :class:`~dcr_ray.sharding.Shard`'s local tensor."""
    if isinstance(t, Shard):
        return Shard(t.tensor.detach().contiguous().clone(), t.spec)
    return t.detach().contiguous().clone()


class StandaloneOwner(OwnerMixin):
    """An owner actor that is handed its tensors (``set_tensors``) instead of living in a trainer:
    canonical name -> tensor, or local name -> :class:`~dcr_ray.sharding.Shard`."""

    def __init__(self, tensors: Mapping[str, object] | None = None):
        self._tensors = {n: _copy(t) for n, t in (tensors or {}).items()}

    def set_tensors(self, tensors: Mapping[str, object]) -> None:
        """Replace the current tensors with ``tensors`` (names not in it are gone; the next refit diffs
        them against the baseline, which refuses names it does not cover)."""
        self._tensors = {n: _copy(t) for n, t in tensors.items()}

    def dcr_tensors(self) -> Mapping[str, torch.Tensor]:
        return self._tensors


# -- reaching an owner -----------------------------------------------------------------------------------
def _owners_in(actor: Any) -> list[Owner]:
    """The :class:`Owner` s an actor instance keeps in its attributes."""
    return [v for v in vars(actor).values() if isinstance(v, Owner)]


def held_owner(actor: Any) -> Owner:
    """The one :class:`Owner` an actor instance keeps in an attribute (run inside the actor)."""
    found = _owners_in(actor)
    if len(found) != 1:
        raise ConfigError(f"{type(actor).__name__} holds {len(found)} dcr_ray.Owner attributes: an owner actor "
                          f"keeps exactly one (self.dcr = dcr_ray.Owner(...)) or mixes in dcr_ray.OwnerMixin")
    return found[0]


def _holds_owner(actor: Any) -> bool:
    return isinstance(actor, OwnerMixin) or len(_owners_in(actor)) == 1


def check_owner(oid: str, handle, timeout_s: float) -> None:
    """Refuse, before anything is spawned, an ``owners`` entry that is no owner actor: neither a mixin
    class's handle nor an actor holding one :class:`Owner` (asked through ``__ray_call__``)."""
    import ray

    if hasattr(handle, "dcr_attach"):
        return
    ok = False
    if hasattr(handle, "__ray_call__"):
        try:
            ok = ray.get(handle.__ray_call__.remote(_holds_owner), timeout=timeout_s)
        except Exception:  # dead, or not answering: no owner to attach
            ok = False
    if not ok:
        raise ConfigError(f"owner {oid!r} ({type(handle).__name__}) is not an owner actor: keep one "
                          f"dcr_ray.Owner in an attribute of the actor (self.dcr = dcr_ray.Owner(...)), or mix "
                          f"in dcr_ray.OwnerMixin and implement dcr_tensors()")
