"""``RefitConfig(actor_options=...)``: Ray actor options a user adds per kind of actor (runtime_env, resources...).

Options dcr_ray sets itself (names, lifetime, concurrency, restarts, an engine's CPUs/GPUs/placement) are
refused with the setting to use instead, before anything is spawned; the rest reach every actor of the kind,
including engines and relays the coordinator creates.
"""

from __future__ import annotations

import os

import raytools  # noqa: F401
from raytools import check_engines, local_ray  # noqa: F401  (local_ray: module-scoped Ray fixture)

import pytest
import ray

import dcr_ray
from dcr_ray.errors import ConfigError
from dcr_ray.options import actor_options
from dcr_ray.testing.models import ModelSpec
from dcr_ray.testing.trainer import TinyTrainer

SPEC = ModelSpec(size="tiny")
MARK = "DCR_TEST_ACTOR_KIND"


@pytest.mark.parametrize("bad, fix", [
    ({"engine": {"name": "x"}}, "restarted coordinator finds it"),
    ({"relay": {"lifetime": None}}, "detached"),
    ({"coordinator": {"max_concurrency": 1}}, "answer while a long call runs"),
    ({"engine": {"num_cpus": 1}}, "ClusterSpec.cpus_per_engine"),
    ({"engine": {"num_gpus": 1}}, "ClusterSpec.gpus_per_engine"),
    ({"engine": {"placement_group": None}}, "ClusterSpec.placement"),
    ({"trainer": {}}, "actor kinds"),
    ({"owner": {"runtime_env": 5}}, "runtime_env"),
    ({"relay": {"num_cpus": -1}}, "negative"),
])
def test_an_option_dcr_ray_sets_or_ray_would_refuse_is_refused_with_the_fix(bad, fix):
    with pytest.raises(ConfigError, match=fix):
        dcr_ray.RefitConfig(actor_options=bad)


def test_user_options_are_added_last_and_their_resources_merged_with_the_pinned_ones():
    user = dcr_ray.RefitConfig(actor_options={"relay": {"resources": {"relay-node": 0.5},
                                                        "runtime_env": {"env_vars": {"A": "1"}}}}).actor_options
    opts = actor_options("relay", "dcr_relay:x", resources={"cluster-a": 0.001}, detached=True, user=user)
    assert opts["resources"] == {"cluster-a": 0.001, "relay-node": 0.5}
    assert opts["runtime_env"] == {"env_vars": {"A": "1"}} and opts["lifetime"] == "detached"
    assert actor_options("engine", "e", user=user) == actor_options("engine", "e")  # other kinds: unchanged


def test_a_resource_set_both_by_the_cluster_and_by_actor_options_is_refused_before_anything_starts(local_ray):
    with pytest.raises(ConfigError, match="set each resource in one place"):
        dcr_ray.launch(owner_tensors=[{}], engine=dcr_ray.HFEngine(SPEC),
                       clusters=[dcr_ray.ClusterSpec(name="a", engines=1, resources={"cluster-a": 0.01})],
                       config=dcr_ray.RefitConfig(actor_options={"engine": {"resources": {"cluster-a": 0.01}}}))
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "dcr_ray"]


def test_every_kind_of_actor_runs_with_the_options_given_for_it_and_refits_exactly(local_ray):
    trainer = ray.remote(num_cpus=0)(TinyTrainer).remote(SPEC, lr=1e-3)
    kinds = ("coordinator", "relay", "engine")
    refit = dcr_ray.launch(owners=[trainer], clusters=[dcr_ray.ClusterSpec(name="a", engines=1)],
                           engine=dcr_ray.HFEngine(SPEC),
                           config=dcr_ray.RefitConfig(
                               actor_options={k: {"runtime_env": {"env_vars": {MARK: k}}} for k in kinds}))
    try:
        ns = refit.namespace
        seen = {}
        for a in ray.util.list_named_actors(all_namespaces=True):
            if a["namespace"] == ns:
                h = ray.get_actor(a["name"], namespace=ns)
                seen[a["name"].split(":")[0]] = ray.get(h.__ray_call__.remote(lambda self: os.environ.get(MARK)))
        assert seen == {"dcr_coordinator": "coordinator", "dcr_relay": "relay", "dcr_engine": "engine"}
        ray.get(trainer.step.remote(seed=0))
        assert refit.run().version == 1
        check_engines(refit, trainer)
    finally:
        refit.shutdown()
