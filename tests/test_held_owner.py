"""A trainer actor becomes an owner by holding a ``dcr_ray.Owner`` (composition), no mixin needed.

The coordinator reaches the held owner through Ray's ``__ray_call__`` with the same protocol a mixin
actor's ``dcr_*`` methods serve; an actor that holds none (or two) is refused before anything starts.
"""

from __future__ import annotations

import pickle

import raytools  # noqa: F401
from raytools import check_engines, local_ray  # noqa: F401  (local_ray: module-scoped Ray fixture)

import pytest
import ray

import dcr_ray
from dcr_ray.actors.owner.endpoint import OwnerEndpoint, owner_endpoint
from dcr_ray.errors import ConfigError
from dcr_ray.testing.models import ModelSpec
from dcr_ray.testing.trainer import TinyTrainer

SPEC = ModelSpec(size="tiny")


def test_owner_takes_a_function_and_says_so_when_given_tensors():
    with pytest.raises(ConfigError, match="takes a function"):
        dcr_ray.Owner({"w": None})


def test_a_mixin_actor_and_an_actor_that_holds_an_owner_each_get_an_endpoint_that_pickles(local_ray):
    mixin = ray.remote(num_cpus=0)(TinyTrainer).remote(SPEC)

    @ray.remote(num_cpus=0)
    class Plain:
        def ping(self):
            return 1

    plain = Plain.remote()
    mine = owner_endpoint(mixin)
    assert isinstance(mine, OwnerEndpoint) and mine.mixin and mine.handle is mixin and owner_endpoint(mine) is mine
    ep = owner_endpoint(plain)
    assert isinstance(ep, OwnerEndpoint) and not ep.mixin and ep.handle is plain
    again = pickle.loads(pickle.dumps(ep))
    assert ray.get(again.handle.ping.remote()) == 1  # the endpoint pickles with its actor handle


def test_the_endpoint_the_owner_and_the_mixin_name_the_same_calls_with_the_same_parameters():
    """One owner protocol: each call the coordinator makes is an :class:`Owner` method and a ``dcr_`` method
    of :class:`OwnerMixin`, with the same parameters."""
    import inspect

    from dcr_ray.actors.owner.held import Owner, OwnerMixin

    def params(f) -> list[str]:  # a class made a Ray actor gets a tracing parameter on its methods
        return [p for p in inspect.signature(f).parameters if p != "_ray_trace_ctx"]

    calls = [n for n, f in vars(OwnerEndpoint).items() if callable(f) and not n.startswith("_")]
    assert sorted(calls) == ["attach", "bootstrap", "digests", "discard", "promote", "state", "stream", "version"]
    for call in calls:
        want = params(getattr(OwnerEndpoint, call))
        assert params(getattr(Owner, call)) == want, call
        assert params(getattr(OwnerMixin, f"dcr_{call}")) == want, call


def test_an_actor_that_holds_no_owner_is_refused_before_anything_starts(local_ray):
    @ray.remote(num_cpus=0)
    class NotAnOwner:
        def __init__(self):
            self.model = None

    with pytest.raises(ConfigError, match=r"keep one dcr_ray.Owner in an attribute"):
        dcr_ray.launch(owners=[NotAnOwner.remote()], clusters=[dcr_ray.ClusterSpec(name="a", engines=1)],
                       engine=dcr_ray.HFEngine(SPEC))
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "dcr_ray"]


def test_a_trainer_that_holds_an_owner_refits_exactly_and_is_reported_by_its_own_handle(local_ray):
    @ray.remote(num_cpus=0)
    class ComposedTrainer:
        """A trainer class of its own (no dcr_ray base class) that holds an owner."""

        def __init__(self):
            self.trainer = TinyTrainer(SPEC, lr=1e-3)  # the model and optimizer, used as a plain object
            self.dcr = dcr_ray.Owner(self.trainer.dcr_tensors)

        def step(self, seed):
            return self.trainer.step(seed=seed)

        def rollout_state(self):
            return self.trainer.rollout_state()

    trainer = ComposedTrainer.remote()
    refit = dcr_ray.launch(owners={"composed": trainer}, clusters=[dcr_ray.ClusterSpec(name="a", engines=1)],
                           engine=dcr_ray.HFEngine(SPEC))
    try:
        for seed in (0, 1):
            ray.get(trainer.step.remote(seed))
            assert refit.run().version == seed + 1
        check_engines(refit, trainer)
        assert refit.owners()["composed"] == trainer  # the actor handle, not dcr_ray's endpoint
        state = ray.get(trainer.__ray_call__.remote(lambda self: self.dcr.state()))
        assert state == {"version": 2, "pending": None}
    finally:
        refit.shutdown()


def test_optional_arguments_reach_an_owner_only_when_given_so_narrower_overrides_keep_working():
    """A trainer class that overrides ``dcr_attach`` or ``dcr_stream`` with the parameters it knows (an older
    signature) still gets the calls that do not need the others."""
    class Method:
        def __init__(self, params):
            self.params, self.calls = params, []

        def remote(self, *args, **kwargs):
            assert len(args) + len(kwargs) <= len(self.params) and set(kwargs) <= set(self.params)
            self.calls.append((args, kwargs))

    class Narrow:  # a handle whose dcr_ methods take fewer parameters than the protocol's
        dcr_attach = Method(["owner_id", "config"])
        dcr_stream = Method(["transfer", "attempt", "base", "target", "sink"])

    ep = OwnerEndpoint(Narrow(), mixin=True)
    ep.attach("o0", "cfg")
    ep.stream("t1", 0, 0, 1, "sink")
    assert Narrow.dcr_attach.calls == [(("o0", "cfg"), {})]
    assert Narrow.dcr_stream.calls == [(("t1", 0, 0, 1, "sink"), {})]
    wide = Method(["owner_id", "config", "baseline_dir", "in_memory", "version"])
    OwnerEndpoint(type("Wide", (), {"dcr_attach": wide})(), mixin=True).attach("o0", "cfg", version=3)
    assert wide.calls == [(("o0", "cfg"), {"version": 3})]
