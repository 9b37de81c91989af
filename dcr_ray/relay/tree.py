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
    counter = iter(range(1 << 30))

    def build(ids: list[str], rid: str) -> TreeNode:
        if len(ids) <= fanout or fanout == 1 and len(ids) == 1:
            return TreeNode(rid, engines=list(ids))
        k = max(2, fanout) if fanout > 1 else 1
        if k == 1:  # a chain: one engine here, the rest below
            return TreeNode(rid, engines=ids[:1], subrelays=[build(ids[1:], f"{cluster}/r{next(counter)}")])
        size = -(-len(ids) // k)
        groups = [ids[i:i + size] for i in range(0, len(ids), size)]
        node = TreeNode(rid)
        for g in groups:
            if len(g) == 1:
                node.engines.append(g[0])
            else:
                node.subrelays.append(build(g, f"{cluster}/r{next(counter)}"))
        return node

    return build(list(engine_ids), f"{cluster}/head")
