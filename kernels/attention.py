"""The attention entry points of `lamina.kernels`: validate, write a step's k/v into a
pool, attend with a backend (the compiled C++ kernel, Triton, or the reference).

Data in: q [Nq, Hq, D], the pool tensors k/v [num_slots, Hkv, D] and a `SlotBatch`.
Data out: o [Nq, Hq, Dv] and the per-row log-sum-exp lse [Nq, Hq] (fp32).
"""
from __future__ import annotations

import torch

from .backends import AttentionBackend, AttentionInputError, select_backend, validate
from .quant import fold_channels, head_dim, is_quantized, quantize_rows
from .slots import AttentionParams, SlotBatch


def attend(q, k_pool, v_pool, batch: SlotBatch, params: AttentionParams,
           backend: AttentionBackend | None = None):
    """q [Nq, Hq, D] -> (o [Nq, Hq, Dv], lse [Nq, Hq] fp32); validates first."""
    validate(q, k_pool, v_pool, batch, params)
    return (backend or select_backend(device=q.device)).attend(q, k_pool, v_pool, batch,
                                                                params)


def decode_attention(q, k_pool, v_pool, batch: SlotBatch, params: AttentionParams,
                     backend: AttentionBackend | None = None):
    """One query per request: q [B, Hq, D] attends to its request's slots."""
    if batch.num_queries != batch.num_requests:
        raise AttentionInputError(f"decode needs one query per request, got "
                                  f"{batch.num_queries} queries for {batch.num_requests}")
    return attend(q, k_pool, v_pool, batch, params, backend)


def write_kv(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor, slots_checked: bool = False,
             key_scales: torch.Tensor | None = None) -> None:
    """Store new k [N, Hkv, D] / v [N, Hkv, Dv] at `slots` [N]: one batched op each.
    `slots_checked`: the caller already checked the slot ids' range (once per step).
    An int8 pool stores quantized rows (`quant.quantize_rows`; keys divided by the
    layer's channel scales `key_scales` [Hkv, D] first)."""
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise AttentionInputError(f"slots must be a 1-D int tensor, got {slots.dtype} "
                                  f"{tuple(slots.shape)}")
    n = slots.numel()
    for name, t, pool in (("k", k, k_pool), ("v", v, v_pool)):
        want = (*pool.shape[1:-1], head_dim(pool))
        if t.dim() != 3 or t.shape[0] != n or tuple(t.shape[1:]) != want:
            raise AttentionInputError(f"{name} must be [{n}, {', '.join(map(str, want))}]"
                                      f" for {n} slots, got {tuple(t.shape)}")
        if t.device != pool.device:
            raise AttentionInputError(f"{name} on {t.device} but its pool is on {pool.device}")
        if not t.is_floating_point():
            raise AttentionInputError(f"{name} must be floating point, got {t.dtype}")
    if n and not slots_checked and (int(slots.min()) < 0 or int(slots.max()) >= k_pool.shape[0]):
        raise AttentionInputError(f"slot ids out of range [0, {k_pool.shape[0]}): "
                                  f"min {int(slots.min())}, max {int(slots.max())}")
    idx = slots if slots.dtype == torch.int64 else slots.to(device=k_pool.device,
                                                              dtype=torch.int64)
    if is_quantized(k_pool):
        k, v = quantize_rows(k, key_scales), quantize_rows(v)
    k_pool.index_copy_(0, idx, k if k.dtype == k_pool.dtype else k.to(k_pool.dtype))
    v_pool.index_copy_(0, idx, v if v.dtype == v_pool.dtype else v.to(v_pool.dtype))


def prefill_attention(q, k, v, k_pool, v_pool, new_slots: torch.Tensor, batch: SlotBatch,
                      params: AttentionParams, backend: AttentionBackend | None = None,
                      batch_checked: bool = False, key_scales: torch.Tensor | None = None):
    """Write the prompt tokens' k/v at `new_slots`, then causal attention for q [T, Hq, D]
    over each request's whole slot table (earlier turns' cached tokens included).
    `batch_checked`: `validate_batch` already passed for this batch and `new_slots`.
    `key_scales` [Hkv, D]: an int8 pool's key channel scales (folded into q here)."""
    validate(q, k_pool, v_pool, batch, params, batch_checked)
    write_kv(k_pool, v_pool, new_slots, k, v, batch_checked, key_scales)
    backend = backend or select_backend(device=q.device)
    if is_quantized(k_pool) and key_scales is not None:  # fp32 q * c, o back in q's dtype
        o, lse = backend.attend(fold_channels(q, key_scales), k_pool, v_pool, batch, params)
        return o.to(q.dtype), lse
    return backend.attend(q, k_pool, v_pool, batch, params)
