"""Two topologies share one Ray cluster under two namespaces (a policy and a reward model).

Each has its own coordinator, engines, relays, placement group and commit record under the same names,
in its own Ray namespace; ``Refit.get(namespace=...)`` reaches each, refits stay exact in both, and shutting one
down (also by force) leaves the other serving.
"""

from __future__ import annotations

import time

import raytools  # noqa: F401
from raytools import check_engines, local_ray  # noqa: F401  (local_ray: module-scoped Ray fixture)

import pytest
import ray

import dcr_ray
from dcr_ray.errors import ConfigError
from dcr_ray.testing.models import ModelSpec
from dcr_ray.testing.trainer import TinyTrainer

SPEC = ModelSpec(size="tiny")


def test_a_namespace_that_is_not_a_name_is_refused_and_it_has_one_home_the_config(local_ray):
    with pytest.raises(ConfigError, match="RefitConfig.namespace"):
        dcr_ray.RefitConfig(namespace="a b")
    with pytest.raises(TypeError, match="namespace"):  # one home per setting: no launch(namespace=...) beside it
        dcr_ray.launch(owner_tensors=[{}], clusters=[dcr_ray.ClusterSpec(name="a", engines=1)],
                       engine=dcr_ray.HFEngine(SPEC), config=dcr_ray.RefitConfig(namespace="x"), namespace="y")
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] in ("x", "y")]


@pytest.mark.slow
def test_two_topologies_in_two_namespaces_refit_exactly_side_by_side_and_shut_down_apart(local_ray):
    Trainer = ray.remote(num_cpus=0)(TinyTrainer)
    policy, reward = Trainer.remote(SPEC, lr=1e-3), Trainer.remote(SPEC.with_seed(7), lr=1e-3)
    # the same cluster name and a placement group each: names stay apart by namespace
    clusters = [dcr_ray.ClusterSpec(name="a", engines=1, cpus_per_engine=0.1, placement="PACK")]
    one = dcr_ray.launch(owners=[policy], clusters=clusters, engine=dcr_ray.HFEngine(SPEC))
    two = None
    try:
        with pytest.raises(ConfigError, match="already runs in namespace 'dcr_ray'"):
            dcr_ray.launch(owners=[reward], clusters=clusters, engine=dcr_ray.HFEngine(SPEC.with_seed(7)))
        two = dcr_ray.launch(owners=[reward], clusters=clusters, engine=dcr_ray.HFEngine(SPEC.with_seed(7)),
                             config=dcr_ray.RefitConfig(namespace="reward"))
        assert dcr_ray.Refit.get(namespace="reward").status()["version"] == 0
        for seed in (0, 1):
            ray.get([policy.step.remote(seed=seed), reward.step.remote(seed=seed + 10)])
            assert one.run().version == two.run().version == seed + 1
        check_engines(one, policy)
        check_engines(two, reward)
        two.shutdown(force=True)
        two = None
        deadline = time.monotonic() + 30
        while [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "reward"]:
            assert time.monotonic() < deadline, ray.util.list_named_actors(all_namespaces=True)
            time.sleep(0.2)
        ray.get(policy.step.remote(seed=2))
        assert dcr_ray.Refit.get().run().version == 3
        check_engines(one, policy)
    finally:
        one.shutdown()
        if two is not None:
            two.shutdown()
