"""Exact merge of partial attentions over disjoint key sets, by log-sum-exp.

Data in: outputs o_i [..., Dv] and their lse_i [...] (fp32) from attention over disjoint
key subsets of the same queries (different workers, or streamed mini-batches).
Data out: the attention over the union and its lse. A sink logit must be passed to
exactly one of the partials.
"""
from __future__ import annotations

from typing import Sequence

import torch


def merge_attention(outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]):
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(f"need matching non-empty lists, got {len(outs)} outs and "
                         f"{len(lses)} lses")
    lse = torch.stack([x.float() for x in lses])  # [P, ...]
    total = torch.logsumexp(lse, dim=0)  # -inf where every partial is empty
    w = torch.exp(lse - total.clamp_min(torch.finfo(torch.float32).min))  # [P, ...]
    w = torch.nan_to_num(w, nan=0.0)
    o = sum(wi.unsqueeze(-1) * oi.float() for wi, oi in zip(w, outs))
    return o.to(outs[0].dtype), total
