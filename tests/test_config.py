"""Settings are checked where they are made: a bad value raises ConfigError naming the field and a fix."""

from __future__ import annotations

import pytest

import dcr_ray
from dcr_ray.engines.vllm import AdoptedVllmEngine
from dcr_ray.errors import ConfigError

BAD = [
    (lambda: dcr_ray.ClusterSpec(name="a:b"), r"ClusterSpec.name 'a:b' must be letters"),
    (lambda: dcr_ray.ClusterSpec(name="a/b"), "ClusterSpec.name"),
    (lambda: dcr_ray.ClusterSpec(name=""), "ClusterSpec.name"),
    (lambda: dcr_ray.ClusterSpec(name="a", resources={"x": -1}), r"resources must map .* amounts > 0"),
    (lambda: dcr_ray.ClusterSpec(name="a", resources={"x": float("nan")}), "resources"),
    (lambda: dcr_ray.ClusterSpec(name="a", resources={"x": True}), "resources"),
    (lambda: dcr_ray.ClusterSpec(name="a", resources=[("x", 1)]), "resources"),
    (lambda: dcr_ray.CommitConfig(dir=""), "CommitConfig.dir must be a directory path"),
    (lambda: dcr_ray.CommitConfig(dir=3), "CommitConfig.dir"),
    (lambda: dcr_ray.CodecConfig(chunk_elems=2.5), r"chunk_elems must be an integer in 1\.\."),
    (lambda: dcr_ray.CodecConfig(bucket_bytes=float(1 << 20)), "bucket_bytes must be an integer"),
    (lambda: dcr_ray.CodecConfig(chunk_elems=True), "chunk_elems"),
    (lambda: dcr_ray.TransportConfig(max_inflight_payloads=2.5), r"max_inflight_payloads must be an integer in 1\.\.1024"),
    (lambda: dcr_ray.TransportConfig(max_inflight_payloads=0), "max_inflight_payloads"),
    (lambda: dcr_ray.CodecConfig(coding="fast"), r"CodecConfig.coding must be one of \('auto', 'context', 'plain'\)"),
    (lambda: dcr_ray.CodecConfig(link_mbps=0), r"link_mbps must be a finite number of Mbit/s > 0"),
    (lambda: dcr_ray.CodecConfig(link_mbps=float("inf")), "link_mbps"),
    (lambda: dcr_ray.CodecConfig(link_mbps="1000"), "link_mbps"),
    (lambda: dcr_ray.CodecConfig(link_mbps={"us-east": -5}), r"cluster name -> such a number"),
    (lambda: dcr_ray.CodecConfig(link_mbps={}), "name every cluster"),
    (lambda: dcr_ray.CodecConfig(coding="plain", link_mbps=100), r"informs coding='auto' only; .* drop link_mbps"),
    (lambda: dcr_ray.EngineConfig(hold_s=-1), r"EngineConfig.hold_s must be a number of seconds >= 0, or None"),
    (lambda: dcr_ray.EngineConfig(hold_s=True), "hold_s"),
    (lambda: dcr_ray.EngineConfig(hold_s=float("nan")), "hold_s"),
    (lambda: dcr_ray.EngineConfig(switch="keep"), r"EngineConfig.switch must be one of \('in_flight', 'drain'\)"),
    (lambda: AdoptedVllmEngine("http://h:1", checkpoint="/c", held_requests="drop"), r"held_requests must be one of \('recompute', 'keep'\)"),
]


@pytest.mark.parametrize("make,msg", BAD, ids=[m for _, m in BAD])
def test_a_bad_setting_is_refused_where_it_is_made_with_the_field_named(make, msg):
    with pytest.raises(ConfigError, match=msg):
        make()


def test_good_settings_still_pass():
    dcr_ray.ClusterSpec(name="us-east.1_b", resources={"cluster-us-east": 0.001})
    dcr_ray.CommitConfig(dir="/tmp/x")
    dcr_ray.CodecConfig(chunk_elems=1 << 16, bucket_bytes=1 << 20)
    dcr_ray.TransportConfig(max_inflight_payloads=2)
    dcr_ray.CodecConfig(link_mbps=100)
    dcr_ray.CodecConfig(link_mbps={"us-east": 1000, "eu": 250.5})
    dcr_ray.EngineConfig(hold_s=None)
    dcr_ray.EngineConfig(hold_s=0)
    assert dcr_ray.EngineConfig().switch == "in_flight" and dcr_ray.EngineConfig(switch="drain").switch == "drain"


def test_a_link_figure_per_cluster_must_name_exactly_the_clusters():
    from dcr_ray.config import validate

    config = dcr_ray.RefitConfig(codec=dcr_ray.CodecConfig(link_mbps={"us-east": 1000}))
    clusters = [dcr_ray.ClusterSpec(name="us-east"), dcr_ray.ClusterSpec(name="eu")]
    with pytest.raises(ConfigError, match=r"names clusters \['us-east'\], the clusters are \['eu', 'us-east'\]"):
        validate(config, clusters, {"o": object()}, engine=lambda: None)
