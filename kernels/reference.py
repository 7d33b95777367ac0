"""Pure-torch attention over a token-slot KV pool: the reference every kernel is tested
against, and the fallback backend on any device.

Data in: q [Nq, Hq, D], pools k [S, Hkv, D] / v [S, Hkv, Dv] (or int8 rows, dequantized
here: kernels/quant.py), a `SlotBatch`, and
`AttentionParams`. Data out: o [Nq, Hq, Dv] (q's dtype) and lse [Nq, Hq] fp32.
Per request it gathers the request's K/V by slot (a copy, unlike the compiled kernel)
and computes a masked fp32 softmax; a Python loop over requests, not over tokens.
"""
from __future__ import annotations

import torch

from .quant import dequantize_rows, head_dim, is_quantized
from .slots import AttentionParams, SlotBatch


def _rows(pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """pool rows at idx as fp32 [L, Hkv, D] (int8 rows dequantized; keys' channel
    scales are folded into q by the caller)."""
    rows = pool.index_select(0, idx)
    return dequantize_rows(rows) if is_quantized(pool) else rows.float()


def reference_slot_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                             batch: SlotBatch, params: AttentionParams):
    Nq, Hq, _ = q.shape
    Hkv, Dv = k_pool.shape[1], head_dim(v_pool)
    rep = Hq // Hkv
    out = torch.zeros(Nq, Hq, Dv, dtype=torch.float32, device=q.device)
    lse = torch.full((Nq, Hq), float("-inf"), dtype=torch.float32, device=q.device)
    sinks = params.sinks_tensor(q.device)
    cu_q, cu_k = batch.cu_q.tolist(), batch.cu_k.tolist()
    k_pos0 = batch.k_pos0.tolist()
    for b in range(batch.num_requests):
        q0, q1, s0, s1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        if q0 == q1:
            continue
        idx = batch.slots[s0:s1].long().to(k_pool.device)
        k = _rows(k_pool, idx).repeat_interleave(rep, dim=1)  # [L, Hq, D]
        v = _rows(v_pool, idx).repeat_interleave(rep, dim=1)  # [L, Hq, Dv]
        qb = q[q0:q1].float()  # [n, Hq, D]
        s = torch.einsum("nhd,lhd->hnl", qb, k) * params.scale  # [Hq, n, L]
        if params.softcap > 0:
            s = torch.tanh(s / params.softcap) * params.softcap
        qp = batch.q_pos[q0:q1].long().to(q.device)[:, None]  # [n, 1]
        kp = k_pos0[b] + torch.arange(s1 - s0, device=q.device)[None, :]  # [1, L]
        keep = kp <= qp
        if params.sliding_window > 0:
            keep &= kp > qp - params.sliding_window
        s = s.masked_fill(~keep, float("-inf"))
        if sinks is not None:
            s = torch.cat([s, sinks[:, None, None].expand(Hq, q1 - q0, 1)], dim=-1)
        m = s.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
        e = torch.exp(s - m)  # masked -> 0
        den = e.sum(dim=-1, keepdim=True)
        p = (e / den.clamp_min(torch.finfo(torch.float32).tiny))[..., : s1 - s0]
        out[q0:q1] = torch.einsum("hnl,lhd->nhd", p, v)
        lse[q0:q1] = torch.where(den > 0, m + torch.log(den), float("-inf"))[..., 0].T
    return out.to(q.dtype), lse
