"""Relay tree topology: which relay forwards to which engines and sub-relays inside one cluster."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TreeNode:
    """A relay: its direct engine children and its sub-relays."""

    relay_id: str
    engines: list[str] = field(default_factory=list)
    subrelays: list["TreeNode"] = field(default_factory=list)

    def all_engines(self) -> list[str]:
        out = list(self.engines)
        for s in self.subrelays:
            out += s.all_engines()
        return out

    def walk(self):
        yield self
        for s in self.subrelays:
            yield from s.walk()


def plan_tree(cluster: str, engine_ids: list[str], fanout: int) -> TreeNode:
    """A relay tree for ``engine_ids`` where no relay has more than ``fanout`` children.

    With ``len(engine_ids) <= fanout`` the head serves every engine itself; otherwise the engines are
    split into ``fanout`` contiguous groups, each served by a sub-relay planned the same way.
    """
    if fanout < 2:
        raise ValueError(f"fanout must be >= 2, got {fanout}")
    counter = iter(range(1 << 30))

    def build(ids: list[str], rid: str) -> TreeNode:
        if len(ids) <= fanout:
            return TreeNode(rid, engines=list(ids))
        size = -(-len(ids) // fanout)
        node = TreeNode(rid)
        for g in (ids[i:i + size] for i in range(0, len(ids), size)):
            if len(g) == 1:
                node.engines.append(g[0])
            else:
                node.subrelays.append(build(g, f"{cluster}/r{next(counter)}"))
        return node

    return build(list(engine_ids), f"{cluster}/head")
