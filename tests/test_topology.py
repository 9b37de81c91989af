"""Relay-tree planning and configuration checks (no Ray needed)."""

from __future__ import annotations

import pytest

from dcr_ray.config import ClusterSpec, CodecConfig, EngineConfig, OwnerConfig, RefitConfig, TransportConfig
from dcr_ray.errors import ConfigError
from dcr_ray.testing.links import LinkModel
from dcr_ray.relay.tree import plan_tree


@pytest.mark.parametrize("n,fanout", [(1, 2), (2, 2), (3, 2), (7, 2), (16, 4), (17, 4), (100, 8)])
def test_a_relay_tree_serves_every_engine_once_and_no_relay_exceeds_its_fanout(n, fanout):
    ids = [f"c/e{i}" for i in range(n)]
    tree = plan_tree("c", ids, fanout)
    assert sorted(tree.all_engines()) == sorted(ids)
    assert len(tree.all_engines()) == len(ids)
    for node in tree.walk():
        assert len(node.engines) + len(node.subrelays) <= fanout
    assert tree.relay_id == "c/head"
    assert len({n.relay_id for n in tree.walk()}) == len(list(tree.walk()))


def test_configuration_errors_say_which_field_and_how_to_fix_it():
    with pytest.raises(ConfigError, match=r"TransportConfig.kind must be one of \('relay', 'object_store'\)"):
        TransportConfig(kind="nccl")
    with pytest.raises(ConfigError, match="lower chunk_elems or raise bucket_bytes"):
        CodecConfig(chunk_elems=1 << 24, bucket_bytes=1 << 20)
    with pytest.raises(ConfigError, match="RefitConfig.transport must be a dcr_ray.TransportConfig"):
        RefitConfig(transport="relay")
    with pytest.raises(ConfigError, match="EngineConfig.apply must be one of"):
        EngineConfig(apply="later")
    with pytest.raises(ConfigError, match="staging_budget_bytes must be a positive integer"):
        EngineConfig(staging_budget_bytes=0)
    with pytest.raises(ConfigError, match="OwnerConfig.promote must be one of"):
        OwnerConfig(promote=True)
    with pytest.raises(ConfigError, match="fanout must be >= 2"):
        ClusterSpec(name="a", fanout=1)
    with pytest.raises(ConfigError, match=r"ClusterSpec\(a\) has no engine: set engines >= 1 or adopt"):
        ClusterSpec(name="a", engines=0)
    with pytest.raises(ConfigError, match="engines must be >= 0"):
        ClusterSpec(name="a", engines=-1)
    with pytest.raises(ConfigError, match="adopt must be a list of engine factories"):
        ClusterSpec(name="a", adopt=["http://not-a-factory"])
    with pytest.raises(ConfigError, match="BLAKE2b key"):
        CodecConfig(key="not-bytes")


def test_the_link_model_charges_bandwidth_and_latency_per_crossing():
    link = LinkModel(mbps=8.0, latency_s=0.5)
    assert link.seconds(1_000_000) == pytest.approx(1.5)
    assert LinkModel().seconds(10**9) == 0.0
