"""Weighted dataflow graph of a traced model, for the min cuts.

Data in: the canonical `GraphModule` from `trace`.
Data out: `DataflowGraph` — a networkx DiGraph over node names whose node attribute
`bytes` is the (symbolic, sympy) size of the tensor the node produces, plus the set of
*free* nodes (weights, shapes, anything computed only from positions and weights),
which every slice recomputes instead of receiving as context.
"""
from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import sympy
import torch
import torch.fx

from .trace import ATTENTION_OP, TensorMeta

# Every input the engine hands to every slice. input_ids only reaches slice 0.
ALWAYS_AVAILABLE = ("position_ids",)


def value_bytes(val) -> sympy.Expr:
    """Bytes of a traced value (`TensorMeta`, symbolic size, scalar, tuple of them);
    symbolic in B, T."""
    if isinstance(val, TensorMeta):
        n = sympy.Integer(1)
        for s in val.shape:
            n = n * sympy.sympify(s)
        return sympy.expand(n * val.element_size())
    if isinstance(val, (list, tuple)):
        return sympy.Add(*[value_bytes(v) for v in val]) if val else sympy.Integer(0)
    if isinstance(val, (sympy.Basic, int, float, bool)):
        return sympy.Integer(8)
    return sympy.Integer(0)


@dataclass
class DataflowGraph:
    graph: nx.DiGraph  # node name -> node name, data edges
    order: list[str]  # topological order (FX order)
    attention: list[str]  # attention node names, in order
    free: frozenset[str]  # recomputable for free in any slice
    output: str  # the FX output node's name
    symbols: dict[str, sympy.Symbol]  # "batch"/"tokens" -> symbol

    def bytes(self, name: str) -> sympy.Expr:
        return self.graph.nodes[name]["bytes"]

    def per_token(self, expr: sympy.Expr) -> int:
        """Bytes for one token (batch=1, tokens=1) of a size expression."""
        subs = {s: 1 for s in self.symbols.values()}
        return int(sympy.sympify(expr).subs(subs))

    def capacity(self, name: str, tokens: int = 1024) -> int:
        """Integer edge capacity: bytes at batch=1 and a long sequence (quadratic terms show)."""
        subs = {self.symbols["batch"]: 1, self.symbols["tokens"]: tokens} if self.symbols else {}
        return int(sympy.sympify(self.bytes(name)).subs(subs))


def _free_nodes(gm: torch.fx.GraphModule) -> frozenset[str]:
    free: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            free.add(n.name)
        elif n.op == "placeholder":
            if n.target in ALWAYS_AVAILABLE:
                free.add(n.name)
        elif n.op == "call_function" and n.target is not ATTENTION_OP:
            if all(a.name in free for a in n.all_input_nodes):
                free.add(n.name)
    return frozenset(free)


def build_graph(gm: torch.fx.GraphModule) -> DataflowGraph:
    g = nx.DiGraph()
    order, attention, output = [], [], None
    for n in gm.graph.nodes:
        if n.op == "output":
            output = n.name
            g.add_node(n.name, bytes=sympy.Integer(0))
        else:
            g.add_node(n.name, bytes=value_bytes(n.meta.get("val")))
        order.append(n.name)
        for a in n.all_input_nodes:
            g.add_edge(a.name, n.name)
        if n.op == "call_function" and n.target is ATTENTION_OP:
            attention.append(n.name)
    pos = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.target == "position_ids")
    shape = pos.meta["val"].shape
    symbols = {}
    for key, s in zip(("batch", "tokens"), shape):
        if isinstance(s, sympy.Symbol):
            symbols[key] = s
    return DataflowGraph(graph=g, order=order, attention=attention, free=_free_nodes(gm),
                         output=output, symbols=symbols)
