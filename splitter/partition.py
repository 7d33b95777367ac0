"""Decide the split: one directed, precedence-closed minimum s-t cut per attention node.

Data in: a `DataflowGraph` (node sizes in bytes, free nodes, attention nodes).
Data out: `Partition`, a pure description: node name -> slice index, plus the context
(the cut tensors) saved across each attention. Building slices is `slices.py`'s job.

Cut i separates S_i ("computed by slices 0..i") from the rest:
- every ancestor of attention i, and S_{i-1}, is forced into S_i (runnable prefix);
- attention i and its descendants are forced out;
- the cost is the bytes of each S_i tensor read outside S_i, paid once however many
  readers it has (a tensor node u gets an edge u -> u' of its size, then u' -> readers
  at infinite capacity); reverse infinite edges make S_i closed under predecessors;
- free nodes are not in the network at all: slices recompute them;
- attention i's own q/k/v inputs cost nothing: they travel to the memory side.
"""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from .graph import DataflowGraph

_SRC, _SNK = ("__s__",), ("__t__",)


@dataclass(frozen=True)
class Partition:
    assign: dict  # non-free, non-attention node name -> slice index (0..n)
    attention: tuple  # attention node names; attention i sits between slice i and i+1
    context: tuple  # context[i]: node names saved across attention i, in FX order
    context_capacity: tuple  # context[i]'s total capacity (bytes at tokens=1024)

    @property
    def num_slices(self) -> int:
        return len(self.attention) + 1


def _cut(dg: DataflowGraph, live: list[str], readers: dict, forced_s: set, forced_t: set,
         skip_edge: tuple) -> set:
    """Source side of the min cut over `live` nodes. Nodes outside both forced sets are free."""
    net = nx.DiGraph()
    net.add_node(_SRC)
    net.add_node(_SNK)
    region = [u for u in live if u not in forced_s and u not in forced_t]
    region_set = set(region)
    for u in live:
        if u in forced_t:
            continue
        outside = [v for v in readers[u] if v not in forced_s and (u, v) not in skip_edge]
        if not outside:
            continue
        aux = (u, "'")
        tail = _SRC if u in forced_s else u
        net.add_edge(tail, aux, capacity=dg.capacity(u))
        for v in outside:
            net.add_edge(aux, v if v in region_set else _SNK)  # no capacity: infinite
    for v in region:
        for u in dg.graph.predecessors(v):
            if u in region_set:
                net.add_edge(v, u)  # precedence: v in S forces u in S
    if not region and net.number_of_edges() == 0:
        return set()
    _, (s_side, _) = nx.minimum_cut(net, _SRC, _SNK)
    return {u for u in region if u in s_side}


def decide_partition(dg: DataflowGraph) -> Partition:
    """Pure function of the graph: which slice computes each node, and each cut's context."""
    g = dg.graph
    live = [u for u in dg.order if u not in dg.free]
    readers = {u: [v for v in g.successors(u) if v not in dg.free] for u in live}
    s_prev: set = set()
    cuts, context, caps = [], [], []
    for i, a in enumerate(dg.attention):
        anc = {u for u in nx.ancestors(g, a) if u not in dg.free}
        desc = nx.descendants(g, a) | {a}
        forced_s = s_prev | anc
        if i > 0:
            forced_s.add(dg.attention[i - 1])
        clash = forced_s & desc
        if clash:
            raise ValueError(f"attention {a} depends on its own output via {sorted(clash)[:3]}")
        skip = {(u, a) for u in g.predecessors(a)}
        s_i = forced_s | _cut(dg, live, readers, forced_s, desc, skip)
        ctx = [u for u in live if u in s_i and any(
            v not in s_i and (u, v) not in skip for v in readers[u])]
        cuts.append(s_i)
        context.append(tuple(ctx))
        caps.append(sum(dg.capacity(u) for u in ctx))
        s_prev = s_i
    attn = set(dg.attention)
    assign = {}
    for u in live:
        if u in attn:
            continue
        assign[u] = next((i for i, s in enumerate(cuts) if u in s), len(cuts))
    return Partition(assign=assign, attention=tuple(dg.attention), context=tuple(context),
                     context_capacity=tuple(caps))
