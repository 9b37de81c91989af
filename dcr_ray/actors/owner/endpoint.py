"""How the coordinator reaches an owner: one :class:`OwnerEndpoint` per owner, whichever way its trainer
holds it.

A trainer is an owner in one of two ways (:mod:`~dcr_ray.actors.owner.held`): its class mixes in
:class:`~dcr_ray.actors.owner.held.OwnerMixin`, whose ``dcr_<call>`` methods are Ray methods of the actor
(:class:`MixinEndpoint` calls them), or it keeps a :class:`~dcr_ray.actors.owner.held.Owner` in an
attribute, which the actor's own class knows nothing about (:class:`HeldEndpoint` runs the
:class:`~dcr_ray.actors.owner.held.Owner` method on it through Ray's ``__ray_call__``). Each method of an
endpoint starts one call of the owner protocol (:mod:`~dcr_ray.actors.owner.delta`) and returns its
``ObjectRef``; the caller waits. Endpoints pickle with their actor handle.
"""

from __future__ import annotations

from typing import Any, Protocol

from dcr_ray.actors.owner.held import Owner, held_owner


class OwnerEndpoint(Protocol):
    """The owner protocol as the coordinator calls it; every method returns the call's ``ObjectRef``."""

    handle: Any  #: the owner's actor handle

    def attach(self, owner_id: str, config, baseline_dir: str | None = None, in_memory: bool = False,
               version: int = 0): ...

    def state(self): ...

    def digests(self): ...

    def stream(self, transfer: str, attempt: int, base: int, target: int, sink, base_id: str = "",
               coding: str | None = None): ...

    def bootstrap(self, transfer: str, sink): ...

    def promote(self, version: int): ...

    def discard(self): ...

    def version(self): ...


class MixinEndpoint:
    """An owner whose actor class mixes in :class:`~dcr_ray.actors.owner.held.OwnerMixin`: its own
    ``dcr_<call>`` Ray methods."""

    def __init__(self, handle):
        self.handle = handle

    def attach(self, *args, **kwargs):
        return self.handle.dcr_attach.remote(*args, **kwargs)

    def state(self):
        return self.handle.dcr_state.remote()

    def digests(self):
        return self.handle.dcr_digests.remote()

    def stream(self, *args, **kwargs):
        return self.handle.dcr_stream.remote(*args, **kwargs)

    def bootstrap(self, *args, **kwargs):
        return self.handle.dcr_bootstrap.remote(*args, **kwargs)

    def promote(self, version: int):
        return self.handle.dcr_promote.remote(version)

    def discard(self):
        return self.handle.dcr_discard.remote()

    def version(self):
        return self.handle.dcr_version.remote()


def _on_held(actor, method, *args, **kwargs):
    """(Run inside the owner's actor by ``__ray_call__``.) ``method`` of the :class:`Owner` it holds."""
    return method(held_owner(actor), *args, **kwargs)


class HeldEndpoint:
    """An owner kept in an attribute of an actor whose class knows nothing of dcr_ray: each call runs the
    :class:`~dcr_ray.actors.owner.held.Owner` method on it, inside the actor, through ``__ray_call__``."""

    def __init__(self, handle):
        self.handle = handle

    def _run(self, method, *args, **kwargs):
        return self.handle.__ray_call__.remote(_on_held, method, *args, **kwargs)

    def attach(self, *args, **kwargs):
        return self._run(Owner.attach, *args, **kwargs)

    def state(self):
        return self._run(Owner.state)

    def digests(self):
        return self._run(Owner.digests)

    def stream(self, *args, **kwargs):
        return self._run(Owner.stream, *args, **kwargs)

    def bootstrap(self, *args, **kwargs):
        return self._run(Owner.bootstrap, *args, **kwargs)

    def promote(self, version: int):
        return self._run(Owner.promote, version)

    def discard(self):
        return self._run(Owner.discard)

    def version(self):
        return self._run(Owner.version)


def owner_endpoint(handle) -> OwnerEndpoint:
    """The endpoint of an ``owners`` entry: an endpoint as it is, a mixin actor's handle (it has
    ``dcr_attach``) as a :class:`MixinEndpoint`, any other actor's as a :class:`HeldEndpoint`."""
    if isinstance(handle, (MixinEndpoint, HeldEndpoint)):
        return handle
    return MixinEndpoint(handle) if hasattr(handle, "dcr_attach") else HeldEndpoint(handle)
