"""How the coordinator reaches an owner: one :class:`OwnerEndpoint` per owner, whichever way its trainer
holds it.

A trainer is an owner in one of two ways (:mod:`~dcr_ray.actors.owner.held`): its class mixes in
:class:`~dcr_ray.actors.owner.held.OwnerMixin`, whose ``dcr_<call>`` methods are Ray methods of the actor,
or it keeps a :class:`~dcr_ray.actors.owner.held.Owner` in an attribute, which the actor's own class knows
nothing about (the call then runs the :class:`~dcr_ray.actors.owner.held.Owner` method on it through Ray's
``__ray_call__``). The endpoint's methods carry the owner protocol's signatures
(:mod:`~dcr_ray.actors.owner.delta`); each starts one call and returns its ``ObjectRef``; the caller waits.
Endpoints pickle with their actor handle.
"""

from __future__ import annotations

from typing import Any

from dcr_ray.actors.owner.held import held_owner


def _on_held(actor, call: str, *args, **kwargs):
    """(Run inside the owner's actor by ``__ray_call__``.) The :class:`Owner` method ``call`` of the owner
    it holds."""
    return getattr(held_owner(actor), call)(*args, **kwargs)


class OwnerEndpoint:
    """The owner protocol as the coordinator calls it, on a mixin actor (``mixin``: its ``dcr_<call>``
    methods) or on an actor that holds an :class:`~dcr_ray.actors.owner.held.Owner`; every method returns
    the call's ``ObjectRef``."""

    def __init__(self, handle: Any, *, mixin: bool):
        self.handle = handle  #: the owner's actor handle
        self.mixin = mixin

    def __repr__(self) -> str:
        return f"OwnerEndpoint({self.handle!r}, {'mixin' if self.mixin else 'held Owner'})"

    def _call(self, call: str, *args, **kwargs):
        if self.mixin:
            return getattr(self.handle, f"dcr_{call}").remote(*args, **kwargs)
        return self.handle.__ray_call__.remote(_on_held, call, *args, **kwargs)

    def attach(self, owner_id: str, config, baseline_dir: str | None = None, in_memory: bool = False,
               version: int = 0):
        # optional arguments travel only when given: a mixin class that overrides dcr_attach with fewer
        # parameters keeps working where it does not need them
        return self._call("attach", owner_id, config, **_given(baseline_dir=(baseline_dir, None),
                                                                in_memory=(in_memory, False), version=(version, 0)))

    def state(self):
        return self._call("state")

    def digests(self):
        return self._call("digests")

    def stream(self, transfer: str, attempt: int, base: int, target: int, sink, base_id: str = "",
               coding: str | None = None):
        return self._call("stream", transfer, attempt, base, target, sink,
                          **_given(base_id=(base_id, ""), coding=(coding, None)))

    def bootstrap(self, transfer: str, sink):
        return self._call("bootstrap", transfer, sink)

    def promote(self, version: int):
        return self._call("promote", version)

    def discard(self):
        return self._call("discard")

    def version(self):
        return self._call("version")


def _given(**args: tuple) -> dict:
    """``{name: value}`` of the optional arguments whose value is not their default (``name=(value, default)``)."""
    return {k: v for k, (v, default) in args.items() if v != default}


def owner_endpoint(handle) -> OwnerEndpoint:
    """The endpoint of an ``owners`` entry: an endpoint as it is, a mixin actor's handle (it has
    ``dcr_attach``) or any other actor's (one that holds an :class:`~dcr_ray.actors.owner.held.Owner`)."""
    if isinstance(handle, OwnerEndpoint):
        return handle
    return OwnerEndpoint(handle, mixin=hasattr(handle, "dcr_attach"))
