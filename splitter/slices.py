"""Build the n+1 slice GraphModules from a decided `Partition`.

Data in: the canonical traced GraphModule and its Partition.
Data out: `Slice`s. Calling conventions (all tensors):
- slice 0:      (input_ids, position_ids)                      -> (q0, k0, v0, *ctx0)
- slice i<n:    (position_ids, attn_out[i-1], *ctx[i-1])        -> (qi, ki, vi, *ctx_i)
- slice n:      (position_ids, attn_out[n-1], *ctx[n-1])        -> (logits,)
q: [B, Hq, T, D], k: [B, Hkv, T, D], v: [B, Hkv, T, Dv], attn_out: [B, T, Hq, Dv].
Free nodes (weights, shapes, position-only values) are copied into each slice that
reads them; get_attr targets resolve to the original model's parameters (shared).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx

from .graph import DataflowGraph
from .partition import Partition
from .trace_store import graph_module


@dataclass
class Slice:
    index: int
    module: torch.fx.GraphModule
    inputs: tuple  # original node names bound to the placeholders, in order
    outputs: tuple  # original node names returned, in order
    num_nodes: int  # compute nodes (call_function) in this slice

    def __call__(self, *args):
        return self.module(*args)


def build_slices(gm: torch.fx.GraphModule, dg: DataflowGraph, part: Partition) -> list[Slice]:
    nodes = {n.name: n for n in gm.graph.nodes}
    out_node = nodes[dg.output]
    n_attn = len(part.attention)
    slices = []
    for k in range(n_attn + 1):
        if k == 0:
            inputs = ("input_ids", "position_ids")
        else:
            inputs = ("position_ids", part.attention[k - 1]) + part.context[k - 1]
        if k < n_attn:
            a = nodes[part.attention[k]]
            outputs = tuple(x.name for x in a.args[:3]) + part.context[k]
        else:
            outputs = None  # the model's own output structure
        body = [u for u in dg.order if part.assign.get(u) == k and u not in inputs]
        slices.append(_build_one(gm, nodes, dg, k, inputs, body, outputs, out_node))
    return slices


def _build_one(gm, nodes, dg, k, inputs, body, outputs, out_node) -> Slice:
    g = torch.fx.Graph()
    env: dict = {}
    for name in inputs:
        src = nodes[name]
        ph = g.placeholder("attn_out" if k > 0 and name == inputs[1] else name)
        ph.meta = dict(src.meta)
        env[name] = ph

    def value(n: torch.fx.Node):
        if n.name in env:
            return env[n.name]
        if n.name not in dg.free:
            raise RuntimeError(f"slice {k} reads {n.name}, which is neither its own, "
                               "an input, nor recomputable")
        env[n.name] = g.node_copy(n, value)  # free: recompute here (recursively)
        return env[n.name]

    for name in body:
        env[name] = g.node_copy(nodes[name], value)
    if outputs is None:
        res = torch.fx.graph.map_arg(out_node.args[0], value)
        g.output(res)
        out_names = tuple(a.name for a in out_node.all_input_nodes)
    else:
        g.output(tuple(value(nodes[o]) for o in outputs))
        out_names = outputs
    g.eliminate_dead_code()
    module = graph_module(gm, g, class_name=f"Slice{k}")
    n_compute = sum(1 for n in g.nodes if n.op == "call_function")
    return Slice(index=k, module=module, inputs=tuple(inputs), outputs=out_names,
                 num_nodes=n_compute)

