"""CodecConfig.coding="auto": each refit's coding is chosen from what recent refits measured, and says why."""

from __future__ import annotations

import pytest

from dcr_ray.actors.coordinator.coding import LINK_BOUND, PRIOR, WINDOW, choose_coding
from dcr_ray.actors.owner.coding import stream_coding
from dcr_ray.config import CodecConfig
from dcr_ray.errors import ConfigError

MB = 1e6


def refit(coding="plain", *, stream=1.0, construct=0.1, apply=0.1, wire=10 * MB, changed=1_000_000,
          links=None, attempts=1, mode="mixed"):
    """A committed refit's report, as the coordinator keeps it (``RefitReport.to_dict()``)."""
    return {"coding": coding, "attempts": attempts, "mode": mode, "changed": changed, "wire_bytes": wire,
            "link_bytes": {"c0": wire} if links is None else links,
            "seconds": {"stream": stream, "construct": construct, "apply": apply}}


AUTO = CodecConfig()


def test_the_library_default_is_auto():
    assert CodecConfig().coding == "auto"


@pytest.mark.parametrize("coding", ["plain", "context"])
def test_a_configured_coding_is_used_as_it_is_and_says_so(coding):
    got = choose_coding(CodecConfig(coding=coding), [refit(stream=100.0)], {"c0"})
    assert got.coding == coding and "configured" in got.reason


def test_auto_codes_plainly_until_a_refit_has_been_measured():
    got = choose_coding(AUTO, [], {"c0"})
    assert got.coding == "plain" and "no refit measured" in got.reason


def test_auto_picks_context_where_the_measured_link_bounds_the_refit():
    # 10 MB took 10 s on the link (1 MB/s) while the codec needed 0.2 s
    got = choose_coding(AUTO, [refit(stream=10.0)], {"c0"})
    assert got.coding == "context" and "the link bounds the refit" in got.reason
    assert got.inputs["link_source"] == "measured" and got.inputs["link_bytes_per_s"] == 1 * MB
    assert got.inputs["predicted"]["context"]["source"] == "plain x prior ratio"


def test_auto_picks_plain_where_the_cpu_bounds_the_refit():
    # the stream took no longer than its codec stages: the link kept up
    got = choose_coding(AUTO, [refit(stream=0.5, construct=0.3, apply=0.2)], {"c0"})
    assert got.coding == "plain" and "the CPU bounds the refit" in got.reason
    assert got.inputs["link_source"] == "lower bound" and "at least" in got.reason


def test_measured_context_costs_replace_the_prior_ratios():
    slow_link = [refit("plain", stream=10.0), refit("context", stream=7.0, wire=7 * MB, construct=9.0, apply=3.0)]
    got = choose_coding(AUTO, slow_link, {"c0"})
    # context measured at 12 s of codec against 7 s on the link: the CPU would bound it, plain is faster
    assert got.coding == "plain"
    assert got.inputs["predicted"]["context"]["source"] == "measured"
    assert got.inputs["predicted"]["context"]["codec_s"] == 12.0


def test_a_plain_estimate_from_a_context_refit_uses_the_inverse_prior():
    got = choose_coding(AUTO, [refit("context", stream=10.0, wire=7.2 * MB, construct=0.4, apply=0.6)], {"c0"})
    plain = got.inputs["predicted"]["plain"]
    assert plain["source"] == "context / prior ratio"
    assert plain["codec_s"] == 0.4 / PRIOR["construct"] + 0.6 / PRIOR["apply"]


def test_a_cpu_bound_refit_only_raises_the_link_estimate():
    history = [refit(stream=10.0),  # link-bound: 1 MB/s measured
               refit(stream=0.2, construct=0.2, apply=0.2)]  # 50 MB/s seen while the CPU bounded it
    got = choose_coding(AUTO, history, {"c0"})
    assert got.inputs["link_bytes_per_s"] == 50 * MB and got.inputs["link_source"] == "lower bound"
    assert got.coding == "plain"


def test_a_later_link_bound_refit_replaces_an_earlier_measurement():
    history = [refit(stream=0.2, construct=0.1, apply=0.05), refit(stream=20.0)]  # the link got slower
    got = choose_coding(AUTO, history, {"c0"})
    assert got.inputs["link_bytes_per_s"] == 0.5 * MB and got.inputs["link_source"] == "measured"
    assert got.coding == "context"


def test_a_refit_is_link_bound_only_past_the_stated_share_of_its_codec_time():
    at = refit(stream=LINK_BOUND * 0.2, construct=0.1, apply=0.1)
    assert choose_coding(AUTO, [at], {"c0"}).inputs["link_source"] == "lower bound"
    past = refit(stream=LINK_BOUND * 0.2 * 1.01, construct=0.1, apply=0.1)
    assert choose_coding(AUTO, [past], {"c0"}).inputs["link_source"] == "measured"


def test_auto_judges_the_slowest_link_the_refit_feeds():
    two = refit(stream=10.0, links={"fast": 10 * MB, "slow": 10 * MB})
    two["seconds"]["stream"] = 10.0
    fast_only = refit(stream=0.25, construct=0.2, apply=0.1, links={"fast": 10 * MB})
    got = choose_coding(AUTO, [two, fast_only], {"fast", "slow"})
    assert got.inputs["cluster"] == "slow" and got.coding == "context"
    # a refit that feeds only the fast cluster is judged on it
    assert choose_coding(AUTO, [two, fast_only], {"fast"}).inputs["cluster"] == "fast"


def test_object_storage_links_count_each_engines_copy():
    # two engines each read the 10 MB frame set: 20 MB entered the cluster in 10 s
    got = choose_coding(AUTO, [refit(stream=10.0, links={"c0": 20 * MB})], {"c0"})
    assert got.inputs["predicted"]["plain"]["link_s"] == 10.0


def test_a_configured_link_figure_replaces_the_measurement():
    cpu_bound = [refit(stream=0.2, construct=0.15, apply=0.05)]
    got = choose_coding(CodecConfig(link_mbps=8.0), cpu_bound, {"c0"})  # 1 MB/s
    assert got.inputs["link_source"] == "configured" and got.inputs["link_bytes_per_s"] == 1 * MB
    assert got.coding == "context"
    per_cluster = choose_coding(CodecConfig(link_mbps={"c0": 80_000.0}), cpu_bound, {"c0"})
    assert per_cluster.coding == "plain"


def test_auto_turns_back_to_plain_after_a_context_refit_needed_a_retry_until_it_leaves_the_window():
    retried = refit("context", stream=10.0, attempts=2, mode="overwrite")
    history = [refit(stream=10.0), retried]
    got = choose_coding(AUTO, history, {"c0"})
    assert got.coding == "plain" and "needed a retry" in got.reason
    later = history + [refit(stream=10.0) for _ in range(WINDOW - 1)]
    assert choose_coding(AUTO, later, {"c0"}).coding == "plain"
    assert choose_coding(AUTO, later + [refit(stream=10.0)], {"c0"}).coding == "context"


def test_refits_with_nothing_changed_or_only_retries_teach_nothing():
    got = choose_coding(AUTO, [refit(changed=0), refit(attempts=2, mode="overwrite")], {"c0"})
    assert got.coding == "plain" and "no refit measured" in got.reason


def test_without_bytes_on_a_fed_link_auto_codes_plainly():
    got = choose_coding(AUTO, [refit(stream=10.0, links={"other": 10 * MB})], {"c0"})
    assert got.coding == "plain" and "no bytes seen" in got.reason


def test_an_owner_streaming_on_its_own_codes_auto_plainly_and_takes_the_coordinators_choice():
    assert stream_coding("auto", None) == "plain"
    assert stream_coding("context", None) == "context"
    assert stream_coding("auto", "context") == "context"
    with pytest.raises(ConfigError, match="coding must be one of"):
        stream_coding("auto", "auto", "o0")


def test_one_refit_slowed_by_other_work_does_not_decide_the_codec_costs_alone():
    steady = [refit("plain", stream=0.5, construct=0.3, apply=0.2) for _ in range(2)]
    slowed = refit("plain", stream=1.2, construct=0.9, apply=0.3)
    got = choose_coding(AUTO, [steady[0], slowed, steady[1]], {"c0"})
    plain = got.inputs["predicted"]["plain"]
    assert plain["codec_s"] == 0.3 + 0.2 and plain["source"] == "median of 3 measured"
    two = choose_coding(AUTO, [steady[0], slowed], {"c0"}).inputs["predicted"]["plain"]
    assert two["codec_s"] == (0.3 + 0.9) / 2 + (0.2 + 0.3) / 2  # the mean of the middle two
