"""Position tables once a step: the work each slice does on `position_ids` alone.

Data in: a `SplitModel` whose slices each rebuild the same tables from their
`position_ids` input (rotary cos/sin: ~13 ops a slice, 30 slices a step for SmolLM2).
Data out (`memo_positions`): a new `SplitModel` whose slices get those tables from one
cache shared by all slices. A slice's position-only subgraph (tensor nodes depending on
`position_ids` and parameters/buffers only) becomes a small module; slices whose
subgraphs are the same code over the same tensors share a cache entry, valid for the
`position_ids` tensor it was computed from (held by weak reference, compared by
identity: the compute side passes one tensor to every slice of a step). The ops and
their inputs are unchanged, so outputs are bitwise equal to the unmemoized split.
"""
from __future__ import annotations

import operator
import weakref
from dataclasses import replace

import torch
import torch.fx

from .trace import TensorMeta
from .trace_store import graph_module

POS = "position_ids"


class PositionTables(torch.nn.Module):
    """One slice's position-only subgraph behind the shared cache."""

    def __init__(self, fn: torch.fx.GraphModule, key: str, cache: dict):
        super().__init__()
        self.fn, self.key, self.cache = fn, key, cache
        self.computed = 0  # how often this slice's tables were computed, not reused

    def forward(self, pos):
        hit = self.cache.get(self.key)
        if hit is not None and hit[0]() is pos:
            return hit[1]
        out = self.fn(pos)
        self.cache[self.key] = (weakref.ref(pos), out)
        self.computed += 1
        return out


def _is_tensor(node) -> bool:
    return isinstance(node.meta.get("val"), TensorMeta)


def _memo_slice(s, cache: dict):
    gm = s.module
    pos = next((n for n in gm.graph.nodes if n.op == "placeholder" and n.name == POS), None)
    if pos is None:
        return s, False
    # inside: tensor ops reading position_ids (directly or not) and constants only;
    # const: tensor ops on parameters/buffers only (copied in where inside ones read them)
    inside, const = set(), set()
    for n in gm.graph.nodes:  # topological order
        if n.op == "get_attr":
            const.add(n)
        elif (n.op == "call_function" and _is_tensor(n)
              and isinstance(n.target, torch._ops.OpOverload)
              and not n.target._schema.is_mutable and n.all_input_nodes
              and all(x is pos or x in inside or x in const for x in n.all_input_nodes)):
            (inside if any(x is pos or x in inside for x in n.all_input_nodes)
             else const).add(n)
    frontier = [n for n in gm.graph.nodes if n in inside
                and any(u not in inside for u in n.users)]
    if not frontier:
        return s, False
    needed = set(inside)  # and the constants they read, transitively
    for n in reversed(list(gm.graph.nodes)):
        if n in needed:
            needed.update(x for x in n.all_input_nodes if x in const)
    g = torch.fx.Graph()
    env = {pos: g.placeholder(POS)}
    for n in gm.graph.nodes:
        if n in needed:
            env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[n] for n in frontier))
    fn = graph_module(gm, g)
    key = _signature(fn)
    out = torch.fx.Graph()
    out.output(out.graph_copy(gm.graph, {}))
    new = graph_module(gm, out, class_name=type(gm).__name__)
    new.add_submodule("_lamina_pos_tables", PositionTables(fn, key, cache))
    nodes = {n.name: n for n in new.graph.nodes}
    last_ph = [n for n in new.graph.nodes if n.op == "placeholder"][-1]
    with new.graph.inserting_after(last_ph):
        call = new.graph.call_module("_lamina_pos_tables", (nodes[POS],))
    at = call
    for i, n in enumerate(frontier):
        with new.graph.inserting_after(at):
            at = new.graph.call_function(operator.getitem, (call, i))
        nodes[n.name].replace_all_uses_with(at)
    new.graph.eliminate_dead_code()
    new.recompile()
    return replace(s, module=new), True


def _signature(fn: torch.fx.GraphModule) -> str:
    """The subgraph's ops and wiring, node names left out, and the tensors it reads by
    address: equal for slices computing the same tables (their node names differ)."""
    index = {n: i for i, n in enumerate(fn.graph.nodes)}
    rows = []
    for n in fn.graph.nodes:
        args = torch.fx.node.map_arg((n.args, n.kwargs), lambda x: f"%{index[x]}")
        what = _attr(fn, n.target).data_ptr() if n.op == "get_attr" else str(n.target)
        rows.append(f"{n.op} {what} {args}")
    return "\n".join(rows)


def _attr(m, target: str):
    for part in target.split("."):
        m = getattr(m, part)
    return m


def memo_positions(split):
    """-> (split whose slices share their position tables, number of slices changed)."""
    cache: dict = {}
    slices, n = [], 0
    for s in split.slices:
        ms, changed = _memo_slice(s, cache)
        slices.append(ms)
        n += changed
    return (replace(split, slices=slices) if n else split), n
