"""A relay's routing: a relay answers calls concurrently (a threaded Ray actor), so two routings the coordinator
sent one after the other may run in the other order. The later one always wins: a cluster's relays are never
routed back to an engine's dead incarnation, whose frames would then reach no one (its successor's flush
waits out the stage timeout and the engine is evicted). In process: the relay is a plain class."""

from __future__ import annotations

from dcr_ray.relay.relay import RelayActor


def test_a_routing_older_than_the_one_in_force_is_ignored_whichever_arrives_first():
    relay = RelayActor("a/head", "a", head=True)
    assert relay.set_children([("engine", "a/e1 incarnation 2", ["a/e1"])], generation=20) is True
    assert relay.set_children([("engine", "a/e1 incarnation 1", ["a/e1"])], generation=10) is False
    assert [h for _, h, _ in relay.children] == ["a/e1 incarnation 2"]
    assert relay.set_children([("engine", "a/e1 incarnation 3", ["a/e1"])], generation=30) is True
    assert [h for _, h, _ in relay.children] == ["a/e1 incarnation 3"]

