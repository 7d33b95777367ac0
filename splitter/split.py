"""`split_model`: HF causal LM -> `SplitModel` (n+1 slices + n attention specs).

Data in: a transformers causal LM in eval mode.
Data out: `SplitModel`, used by the engine's compute workers (slices), the memory side
(`attention_specs`) and tests (`run_local`, `forward_cached` are the in-process
reference path: slices chained with `reference_attention`).
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import sympy
import torch

from .attention_op import reference_attention
from .graph import DataflowGraph, build_graph
from .partition import Partition, decide_partition
from .slices import Slice, build_slices
from .trace import trace


@dataclass(frozen=True)
class AttentionSpec:
    """Everything a memory worker needs to compute one layer's attention."""

    index: int  # attention operator index (0..n-1); sits after slice `index`
    num_q_heads: int
    num_kv_heads: int
    head_dim: int  # q/k head dim
    v_head_dim: int
    scale: float
    sliding_window: int | None  # keys with q_pos - window < k_pos <= q_pos
    softcap: float | None  # scores -> softcap * tanh(scores / softcap)
    sinks: tuple | None  # per-q-head sink logits (denominator only)
    dtype: torch.dtype

    def __post_init__(self):
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_q_heads} q heads not divisible by {self.num_kv_heads}")
        if self.sinks is not None and len(self.sinks) != self.num_q_heads:
            raise ValueError("one sink logit per query head expected")

    @property
    def gqa_ratio(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def kv_bytes_per_token(self) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        return self.num_kv_heads * (self.head_dim + self.v_head_dim) * item

    def attend(self, q, k, v) -> torch.Tensor:
        """Reference causal attention. q: [B,Hq,Tq,D], k/v: [B,Hkv,Tk,*] -> [B,Tq,Hq,Dv]."""
        sinks = torch.tensor(self.sinks, dtype=torch.float32) if self.sinks else None
        return reference_attention(q, k, v, self.scale, self.sliding_window or -1,
                                   self.softcap or 0.0, sinks)


def _spec_from_node(gm: torch.fx.GraphModule, node: torch.fx.Node, index: int) -> AttentionSpec:
    q, k, v, scale, window, cap, sinks = node.args
    qv, kv, vv = q.meta["val"], k.meta["val"], v.meta["val"]
    sink_vals = None
    if sinks is not None:
        if sinks.op != "get_attr":
            raise ValueError(f"attention {index}: sinks must be a parameter, got {sinks.op}")
        t = functools.reduce(getattr, sinks.target.split("."), gm)
        sink_vals = tuple(float(x) for x in t.detach().float().flatten())
    return AttentionSpec(index=index, num_q_heads=int(qv.shape[1]), num_kv_heads=int(kv.shape[1]),
                         head_dim=int(qv.shape[-1]), v_head_dim=int(vv.shape[-1]),
                         scale=float(scale), sliding_window=int(window) if window > 0 else None,
                         softcap=float(cap) if cap > 0 else None, sinks=sink_vals,
                         dtype=qv.dtype)


class LocalKVCache:
    """Contiguous per-layer K/V for the in-process reference path. k: [B, Hkv, T, D]."""

    def __init__(self, n_layers: int):
        self.k: list = [None] * n_layers
        self.v: list = [None] * n_layers

    @property
    def length(self) -> int:
        return 0 if self.k[0] is None else int(self.k[0].shape[2])

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor):
        self.k[i] = k if self.k[i] is None else torch.cat([self.k[i], k], dim=2)
        self.v[i] = v if self.v[i] is None else torch.cat([self.v[i], v], dim=2)
        return self.k[i], self.v[i]


@dataclass
class SplitModel:
    model_name: str
    slices: list[Slice]
    attention_specs: list[AttentionSpec]
    context_bytes_per_token: list[int]
    context_bytes_expr: list[str]  # symbolic size of each cut, in batch/tokens
    partition: Partition
    graph: DataflowGraph
    timings: dict = field(default_factory=dict)

    @property
    def num_slices(self) -> int:
        return len(self.slices)

    @torch.no_grad()
    def forward_cached(self, input_ids: torch.Tensor, cache: LocalKVCache,
                       position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run new tokens through all slices, attending over `cache` + themselves.

        input_ids: [B, T] -> logits [B, T, V]; appends each layer's new K/V to `cache`.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(cache.length, cache.length + T).expand(B, T)
        out = self.slices[0](input_ids, position_ids)
        for i, spec in enumerate(self.attention_specs):
            q, k, v, ctx = out[0], out[1], out[2], out[3:]
            k_all, v_all = cache.append(i, k, v)
            attn = spec.attend(q, k_all, v_all)  # [B, T, Hq, Dv]
            out = self.slices[i + 1](position_ids, attn, *ctx)
        return out[0]

    def run_local(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: LongTensor [B, T] -> logits [B, T, V], causal, no padding."""
        return self.forward_cached(input_ids, LocalKVCache(len(self.attention_specs)))

    def report(self) -> str:
        lines = [f"Lamina split of '{self.model_name}': {len(self.attention_specs)} attention "
                 f"operators -> {self.num_slices} slices"]
        if self.timings:
            t = self.timings
            lines.append(f"split time {t['total_s']:.2f}s (trace {t['trace_s']:.2f}s, "
                         f"cuts {t['cut_s']:.2f}s, slices {t['build_s']:.2f}s)")
        hdr = f"{'slice':>5} {'nodes':>6}  {'cut after':>9} {'context B/token':>15}  " \
              f"{'context tensors':<28} attention (Hq/Hkv x D, scale, window, softcap, sinks)"
        lines += [hdr, "-" * len(hdr)]
        for s in self.slices:
            i = s.index
            if i < len(self.attention_specs):
                a = self.attention_specs[i]
                names = ",".join(self.partition.context[i])
                names = names if len(names) <= 28 else names[:25] + "..."
                feat = (f"{a.num_q_heads}/{a.num_kv_heads}x{a.head_dim}, {a.scale:.4g}, "
                        f"{a.sliding_window or '-'}, {a.softcap or '-'}, "
                        f"{'yes' if a.sinks else '-'}")
                lines.append(f"{i:>5} {s.num_nodes:>6}  {'attn ' + str(i):>9} "
                             f"{self.context_bytes_per_token[i]:>15}  {names:<28} {feat}")
            else:
                lines.append(f"{i:>5} {s.num_nodes:>6}  {'(logits)':>9}")
        return "\n".join(lines)


def split_model(model: torch.nn.Module, reuse: bool = True) -> SplitModel:
    """Trace `model`, cut it at every attention operator, and build the slices. `reuse`:
    take the graph of a model traced alike before (`trace`), else export afresh."""
    t0 = time.perf_counter()
    traced = trace(model, reuse=reuse)
    t1 = time.perf_counter()
    dg = build_graph(traced.gm)
    part = decide_partition(dg)
    t2 = time.perf_counter()
    slices = build_slices(traced.gm, dg, part)
    nodes = {n.name: n for n in traced.gm.graph.nodes}
    specs = [_spec_from_node(traced.gm, nodes[a], i) for i, a in enumerate(part.attention)]
    t3 = time.perf_counter()
    exprs = [sympy.expand(sympy.Add(*[dg.bytes(u) for u in ctx])) if ctx else sympy.Integer(0)
             for ctx in part.context]
    names = {v: sympy.Symbol(k) for k, v in dg.symbols.items()}
    return SplitModel(
        model_name=traced.model_name, slices=slices, attention_specs=specs,
        context_bytes_per_token=[dg.per_token(e) for e in exprs],
        context_bytes_expr=[str(e.subs(names)) for e in exprs], partition=part, graph=dg,
        timings={"trace_s": t1 - t0, "cut_s": t2 - t1, "build_s": t3 - t2, "total_s": t3 - t0})
