"""Prompt attention on CPU pools through a flash attention kernel: torch's, or on CPUs
with AVX512-BF16 but no AMX, for bf16 pools, our own (`csrc/prompt_flash.cpp`).

Data in: what `CpuBackend.attend` gets: q [Nq, Hq, D], the pool k [S, Hkv, D] /
v [S, Hkv, Dv], a `SlotBatch`, `AttentionParams`. Data out: which requests were taken
(`take`), and for those (`attend_taken`) o [n, Hq, Dv] fp32 and lse [n, Hq] per request;
the slot kernel does the rest of the batch.

Why: the slot kernel scores a prompt row by row with vector FMAs; a request with
hundreds of queries is a matrix product, which torch's CPU flash kernel runs in GEMM
blocks (on AMX for bf16). One layer of a 3072-token prompt, SmolLM2's heads,
on a 2-vCPU Xeon (`python benchmarks/prompt_attention_probe.py`): the slot kernel
118 / 154 ms (fp32 / bf16 pool), this 70 / 25 ms. The request's keys are gathered from
their slots first (one copy of its K/V per layer).

A request is taken when it has at least `MIN_QUERIES` queries at consecutive positions,
its pool is fp32 or bf16 (int8 rows stay with the kernel that reads their codes), the
layer has no softcap, sinks or sliding window, and its queries are either its last keys'
positions (a prompt or a chunk of one: the keys before them seen whole, their own
causally; two calls merged by LSE) or all past its keys (one KV range of a sequence
split over workers: every key seen). Math in the pool's dtype, as the model computes:
fp32, or bf16 products and probabilities with fp32 sums.

Which kernel for bf16 pools (`bf16_kernel`): torch's runs bf16 on AMX tiles where the CPU
has them (the Xeon above), but at its fp32 speed where it has only AVX512-BF16. There
ours, which keeps the products in bf16 (vdpbf16ps), is 2.4x faster on a 2-vCPU AMD
EPYC (3072-token prompt 37 against 90 ms, a 1024-token chunk after 2048 keys 21 / 50;
`python benchmarks/prompt_attention_probe.py`), and takes the keys before the queries
and their own in one call. Below `MIN_QUERIES` it is no faster than the slot kernel
(a scratch probe: 8-32 queries 0.5-1.5x).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cpu_build import KernelBuildError, cpu_flags, load_cpu_kernel
from .merge import merge_attention
from .slots import AttentionParams, SlotBatch

MIN_QUERIES = 64


_BF16_HEAD_SIZES = (32, 64, 128, 256)


def bf16_kernel():
    """Our compiled bf16 prompt kernel where it is the faster one on this CPU (built
    with AVX512-BF16, and the CPU has no AMX), else None."""
    try:
        ext = load_cpu_kernel()
    except KernelBuildError:
        return None
    if not ext.prompt_flash_compiled() or "amx_bf16" in cpu_flags():
        return None
    return ext


def takes_layer(k_pool: torch.Tensor, v_pool: torch.Tensor, params: AttentionParams) -> bool:
    """Whether this layer's pool and softmax can go through the flash kernel at all."""
    return (k_pool.dtype in (torch.float32, torch.bfloat16) and k_pool.device.type == "cpu"
            and k_pool.shape[-1] == v_pool.shape[-1] and params.softcap == 0
            and params.sinks is None and params.sliding_window == -1)


def take(batch: SlotBatch) -> dict[int, int]:
    """The requests this module attends -> how many of their last keys are their own
    queries' positions (0: every key lies before the queries)."""
    if batch.most_queries < MIN_QUERIES:
        return {}  # a decode step: no loop over its requests, layer after layer
    cu_q, cu_k, k0 = batch.cu_q.tolist(), batch.cu_k.tolist(), batch.k_pos0.tolist()
    out = {}
    for b in range(len(cu_q) - 1):
        a, e = cu_q[b], cu_q[b + 1]
        n, nk = e - a, cu_k[b + 1] - cu_k[b]
        if n < MIN_QUERIES or nk == 0:
            continue
        first, last = int(batch.q_pos[a]), int(batch.q_pos[e - 1])
        end = k0[b] + nk  # one past its last key's position
        if last - first != n - 1:
            continue
        if end == last + 1 and nk >= n:
            own = n
        elif end <= first:
            own = 0
        else:
            continue
        out[b] = own
    return out


@dataclass(frozen=True)
class Split:
    """A batch cut once for all its layers: what `take` takes, and the other requests
    as a batch of their own for the slot kernel, with their query rows (None: none)."""
    taken: dict[int, int]
    rest: SlotBatch | None = None
    rows: torch.Tensor | None = None  # [n] int64


def split(batch: SlotBatch) -> Split:
    taken = take(batch)
    rest = [b for b in range(batch.num_requests) if b not in taken]
    if not taken or not rest:
        return Split(taken)
    sub, rows = batch.only(rest)
    return Split(taken, sub, rows)


def attend_taken(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 batch: SlotBatch, params: AttentionParams, b: int, own: int,
                 ours: bool | None = None):
    """Request b's (o [n, Hq, Dv] fp32, lse [n, Hq] fp32); `own` from `take`. `ours`:
    bf16 pools through our kernel (None: where `bf16_kernel` says it is the faster)."""
    a, e = int(batch.cu_q[b]), int(batch.cu_q[b + 1])
    idx = batch.slots[int(batch.cu_k[b]):int(batch.cu_k[b + 1])].long()
    k, v = k_pool.index_select(0, idx), v_pool.index_select(0, idx)  # [nk, Hkv, D]
    qq = q[a:e].to(k_pool.dtype)  # [n, Hq, D]
    nk = idx.numel()
    if k_pool.dtype == torch.bfloat16 and k.shape[-1] in _BF16_HEAD_SIZES:
        ext = bf16_kernel() if ours is None else load_cpu_kernel() if ours else None
        if ext is not None:  # one call: causal over its own keys, all keys before them
            return tuple(ext.prompt_flash_bf16(qq, k, v, own > 0, float(params.scale)))
    parts = []
    if nk > own:  # keys before the queries: all seen
        parts.append(_flash(qq, k[:nk - own], v[:nk - own], False, params.scale))
    if own:  # the queries' own positions: causal
        parts.append(_flash(qq, k[nk - own:], v[nk - own:], True, params.scale))
    if len(parts) == 1:
        return parts[0]
    o, lse = merge_attention([p[0] for p in parts], [p[1] for p in parts])
    return o, lse


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """q [n, Hq, D] over k / v [m, Hkv, D] (causal: n == m, top-left aligned) -> o
    [n, Hq, Dv] fp32, lse [n, Hq] fp32 (natural log)."""
    rep = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    kh = k.transpose(0, 1).repeat_interleave(rep, 0).unsqueeze(0)  # [1, Hq, m, D]
    vh = v.transpose(0, 1).repeat_interleave(rep, 0).unsqueeze(0)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qh, kh, vh, 0.0, causal, scale=float(scale))
    return o[0].transpose(0, 1).float(), lse[0].transpose(0, 1).float()
