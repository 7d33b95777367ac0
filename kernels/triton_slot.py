"""Triton attention over a token-slot KV pool: the GPU backend's kernels.

Data in: q [Nq, Hq, D], the pool k [S, Hkv, D] / v [S, Hkv, Dv] (fp32/bf16, on a GPU;
or int8 rows [S, Hkv, D + 4] of `kernels/quant.py`, whose codes are read as floats and
scaled per row, keys' channel scales already folded into q),
and a `SlotBatch` (CSR slot tables, query positions) on the same device, already
validated by `lamina.kernels.validate`. Data out: o [Nq, Hq, Dv] in q's dtype and
lse [Nq, Hq] fp32 (natural log), the same contract as the CPU kernel and the reference.

Two attention kernels. `_slot_attn_fwd`: one program = (query tile of one request, kv
head, key split); its rows are the tile's queries x the GQA group of that kv head, so
every K/V row gathered by slot id is loaded once for all the query heads that share it
(prefill tiles, and decode over fp32 and int8 pools). `_slot_decode_heads`: decode only,
one program = (request, group of kv heads, key split), the group's query heads as the
rows of one tensor-core dot (bf16 pools; see its docstring). Keys are read in place (a
gather by slot id: each row is Hkv*D contiguous elements), in blocks of BLOCK_N with an
online softmax in base 2. Math is fp32 (`tl.dot` in IEEE mode) for fp32 pools; a bf16
pool's dots run on bf16 tensor cores with fp32 accumulation (as flash attention does),
or in fp32 on request (`tensor_cores=False`, the reference's numerics). Decode with few
(request, head) programs splits each request's keys over several programs
(flash-decoding); a second kernel merges the splits' partial outputs exactly by their
log-sum-exp and adds the sink logits, which join the denominator only.

The kernels are plain functions jitted on first use. With TRITON_INTERPRET=1 set before
triton is imported, Triton's interpreter runs them on CPU tensors (numpy, slow): that is
how the tests check them on a machine with no GPU.
"""
from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the backend reports it; nothing here runs without triton
    triton = tl = None


def _slot_attn_fwd(Q, K, V, KS, VS, O, LSE, ITEM_B, ITEM_Q0, CU_Q, Q_POS, SLOTS, CU_K,
                   K_POS0, qk_scale, softcap, window, keys_per_split,
                   s_qn, s_qh, s_ks, s_kh, s_vs, s_vh, s_osp, s_on, s_oh, s_lsp, s_ln,
                   REP: tl.constexpr, REP_P: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   DV: tl.constexpr, BLOCK_DV: tl.constexpr, SOFTCAP: tl.constexpr,
                   WINDOW: tl.constexpr, USE_DOT: tl.constexpr, TC: tl.constexpr,
                   QUANT: tl.constexpr):
    item = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    b = tl.load(ITEM_B + item)
    q0 = tl.load(ITEM_Q0 + item)
    q_end = tl.load(CU_Q + b + 1)
    k_beg = tl.load(CU_K + b)
    nk = tl.load(CU_K + b + 1) - k_beg
    pos0 = tl.load(K_POS0 + b)

    # rows: query (r // REP_P) of the tile x head (r % REP_P) of kv head h's group
    r = tl.arange(0, BLOCK_M)
    qn = q0 + r // REP_P
    g = r % REP_P
    row_ok = (qn < q_end) & (g < REP)
    qpos = tl.load(Q_POS + qn, mask=row_ok, other=0)  # [BLOCK_M]
    head = h * REP + g
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + qn[:, None].to(tl.int64) * s_qn + head[:, None] * s_qh + d[None, :],
                mask=row_ok[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)

    # keys [lo, hi) (relative to the request's table) that some row of the tile sees
    hi = tl.minimum(nk, tl.max(tl.where(row_ok, qpos, -1)) - pos0 + 1)
    lo = 0
    if WINDOW:
        lo = tl.maximum(tl.min(tl.where(row_ok, qpos, 2147483647)) - window + 1 - pos0, 0)
    j_lo = lo + split * keys_per_split
    j_hi = tl.minimum(hi, j_lo + keys_per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for j0 in range(j_lo, j_hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < j_hi
        slot = tl.load(SLOTS + k_beg + j, mask=j_ok, other=0).to(tl.int64)  # [BLOCK_N]
        k = tl.load(K + slot[:, None] * s_ks + h * s_kh + d[None, :],
                    mask=j_ok[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
        if TC:  # bf16 pool: bf16 tensor cores, fp32 accumulate (q rounded to bf16)
            s = tl.dot(q.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16)))
        elif USE_DOT:  # prefill tiles: full rows
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_M, BLOCK_N]
        else:  # decode: a few rows (the GQA group); padding them to 16 for a dot costs more
            s = tl.sum(q[:, None, :] * k[None, :, :], 2)
        if QUANT:  # int8 rows: codes times each row's scale (KS: the pool's bytes as fp32,
            # the scale right after the head's D codes)
            s = s * tl.load(KS + slot * (s_ks // 4) + h * (s_kh // 4) + D // 4, mask=j_ok,
                            other=0.0)[None, :]
        if SOFTCAP:  # softcap * tanh(s * scale / softcap), tanh from one exp
            x = s * qk_scale
            e = tl.exp(-2.0 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            s = softcap * tl.where(x < 0, -t, t) * 1.4426950408889634
        else:
            s = s * (qk_scale * 1.4426950408889634)
        kpos = pos0 + j
        keep = j_ok[None, :] & (kpos[None, :] <= qpos[:, None]) & row_ok[:, None]
        if WINDOW:
            keep = keep & (kpos[None, :] > qpos[:, None] - window)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * s_vs + h * s_vh + dv[None, :],
                    mask=j_ok[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
        if QUANT:  # p times each value row's scale (l_i keeps the plain sum)
            p = p * tl.load(VS + slot * (s_vs // 4) + h * (s_vh // 4) + DV // 4, mask=j_ok,
                            other=0.0)[None, :]
        if TC:  # p rounded to bf16, as flash attention does
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v.to(tl.bfloat16))
        elif USE_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
        m_i = m_new

    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    qn64 = qn.to(tl.int64)
    tl.store(O + split * s_osp + qn64[:, None] * s_on + head[:, None] * s_oh + dv[None, :],
             o.to(O.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))
    tl.store(LSE + split * s_lsp + qn64 * s_ln + head, lse, mask=row_ok)



def _slot_decode_heads(Q, K, V, OP, LP, O, LSE, SINKS, COUNT, SLOTS, CU_K, Q_POS, K_POS0,
                       qk_scale, softcap, window, keys_per_split, num_splits,
                       s_qn, s_qh, s_ks, s_kh, s_vs, s_vh, s_osp, s_on, s_oh, s_lsp, s_ln,
                       s_fn, s_fh, s_gn,
                       G: tl.constexpr, REP: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK_N: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                       BLOCK_C: tl.constexpr, BLOCK_CV: tl.constexpr, BLOCK_DV: tl.constexpr,
                       SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, TC: tl.constexpr,
                       FUSE: tl.constexpr, HAS_SINKS: tl.constexpr):
    """Decode (request b's one query is query b), one program = (request, group of G kv
    heads, key split). A key block is read as whole rows of the group's G kv heads
    ([BLOCK_N, G*D], contiguous per slot) and scored for all G*REP query heads in one dot:
    q is laid out block-diagonally [ROWS, G*D] (row r holds its head's q in the columns
    of its kv head, zeros elsewhere), so s = q_bd @ k^T is each head's score against its
    own kv head. p @ v gives [ROWS, G*DV], of which row r keeps its kv head's columns.
    FUSE: the last split of (request, group) to finish (an atomic count) merges the
    partials by LSE and adds the sinks, so no second kernel runs."""
    b = tl.program_id(0)
    grp = tl.program_id(1)
    split = tl.program_id(2)
    k_beg = tl.load(CU_K + b)
    nk = tl.load(CU_K + b + 1) - k_beg
    pos0 = tl.load(K_POS0 + b)
    qpos = tl.load(Q_POS + b)
    b64 = b.to(tl.int64)

    r = tl.arange(0, ROWS)  # query head grp*G*REP + r, of the group's kv head r // REP
    row_ok = r < G * REP
    head = grp * (G * REP) + r
    c = tl.arange(0, BLOCK_C)  # key column: kv head c // D of the group, channel c % D
    c_ok = c < G * D
    q = tl.load(Q + b64 * s_qn + head[:, None] * s_qh + (c % D)[None, :],
                mask=row_ok[:, None] & c_ok[None, :] & ((c // D)[None, :] == (r // REP)[:, None]),
                other=0.0).to(tl.float32)  # [ROWS, BLOCK_C], block-diagonal
    k_col = (grp * G + c // D) * s_kh + c % D
    cv = tl.arange(0, BLOCK_CV)
    cv_ok = cv < G * DV
    v_col = (grp * G + cv // DV) * s_vh + cv % DV

    hi = tl.minimum(nk, qpos - pos0 + 1)  # every key in [lo, hi) is visible to the query
    lo = 0
    if WINDOW:
        lo = tl.maximum(qpos - window + 1 - pos0, 0)
    j_lo = lo + split * keys_per_split
    j_hi = tl.minimum(hi, j_lo + keys_per_split)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_CV], tl.float32)
    for j0 in range(j_lo, j_hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < j_hi
        slot = tl.load(SLOTS + k_beg + j, mask=j_ok, other=0).to(tl.int64)  # [BLOCK_N]
        k = tl.load(K + slot[:, None] * s_ks + k_col[None, :],
                    mask=j_ok[:, None] & c_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_C]
        if TC:
            s = tl.dot(q.to(tl.bfloat16), tl.trans(k.to(tl.bfloat16)))
        else:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        if SOFTCAP:
            x = s * qk_scale
            e = tl.exp(-2.0 * tl.abs(x))
            t = (1.0 - e) / (1.0 + e)
            s = softcap * tl.where(x < 0, -t, t) * 1.4426950408889634
        else:
            s = s * (qk_scale * 1.4426950408889634)
        s = tl.where(j_ok[None, :] & row_ok[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + slot[:, None] * s_vs + v_col[None, :],
                    mask=j_ok[:, None] & cv_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_CV]
        if TC:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v.to(tl.bfloat16))
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        m_i = m_new

    seen = l_i > 0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))
    own = row_ok[:, None] & cv_ok[None, :] & ((cv // DV)[None, :] == (r // REP)[:, None])
    tl.store(OP + split * s_osp + b64 * s_on + head[:, None] * s_oh + (cv % DV)[None, :],
             o.to(OP.dtype.element_ty), mask=own)
    tl.store(LP + split * s_lsp + b64 * s_ln + head, lse, mask=row_ok)
    if FUSE:
        tl.debug_barrier()  # every thread's partial is written before the count says so
        done = tl.atomic_add(COUNT + b * tl.num_programs(1) + grp, 1, sem="acq_rel")
        if done == num_splits - 1:  # the last split of this (request, group) merges
            dv = tl.arange(0, BLOCK_DV)
            dv_ok = row_ok[:, None] & (dv[None, :] < DV)
            m = tl.full([ROWS], float("-inf"), tl.float32)
            tot = tl.zeros([ROWS], tl.float32)
            acc2 = tl.zeros([ROWS, BLOCK_DV], tl.float32)
            for sp in range(0, num_splits):
                lp = tl.load(LP + sp * s_lsp + b64 * s_ln + head, mask=row_ok,
                             other=float("-inf"), cache_modifier=".cg")
                op = tl.load(OP + sp * s_osp + b64 * s_on + head[:, None] * s_oh + dv[None, :],
                             mask=dv_ok, other=0.0, cache_modifier=".cg")
                m_new = tl.maximum(m, lp)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                a = tl.exp(m - m_safe)
                w = tl.exp(lp - m_safe)
                tot = tot * a + w
                acc2 = acc2 * a[:, None] + op * w[:, None]
                m = m_new
            if HAS_SINKS:  # the sink logit joins the denominator only
                sink = tl.load(SINKS + head, mask=row_ok, other=float("-inf"))
                m_new = tl.maximum(m, sink)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                a = tl.exp(m - m_safe)
                tot = tot * a + tl.exp(sink - m_safe)
                acc2 = acc2 * a[:, None]
                m = m_new
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            ok = tot > 0
            out = acc2 / tl.where(ok, tot, 1.0)[:, None]
            tl.store(O + b64 * s_fn + head[:, None] * s_fh + dv[None, :],
                     out.to(O.dtype.element_ty), mask=dv_ok)
            tl.store(LSE + b64 * s_gn + head,
                     tl.where(ok, m_safe + tl.log(tl.where(ok, tot, 1.0)), float("-inf")),
                     mask=row_ok)
            tl.atomic_xchg(COUNT + b * tl.num_programs(1) + grp, 0)  # ready for the next call

def _merge_splits(OP, LP, O, LSE, SINKS, num_splits, Hq, s_osp, s_lsp,
                  SPLITS_P: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                  HAS_SINKS: tl.constexpr):
    """One program per (query, head): partials OP [S, Nq, Hq, DV] fp32 / LP [S, Nq, Hq]
    -> O [Nq, Hq, DV] (its dtype), LSE [Nq, Hq]; the sink logit joins the total only."""
    row = tl.program_id(0).to(tl.int64)  # = n * Hq + hq (partials are contiguous)
    sp = tl.arange(0, SPLITS_P)
    dv = tl.arange(0, BLOCK_DV)
    lp = tl.load(LP + sp * s_lsp + row, mask=sp < num_splits, other=float("-inf"))
    m = tl.max(lp, 0)
    if HAS_SINKS:
        sink = tl.load(SINKS + row % Hq)
        m = tl.maximum(m, sink)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lp - m_safe)  # [SPLITS_P], 0 for empty partials
    tot = tl.sum(w, 0)
    if HAS_SINKS:
        tot += tl.exp(sink - m_safe)
    op = tl.load(OP + sp[:, None] * s_osp + row * DV + dv[None, :],
                 mask=(sp[:, None] < num_splits) & (dv[None, :] < DV), other=0.0)
    o = tl.sum(op * w[:, None], 0) / tl.where(tot > 0, tot, 1.0)
    tl.store(O + row * DV + dv, o.to(O.dtype.element_ty), mask=dv < DV)
    tl.store(LSE + row, tl.where(tot > 0, m_safe + tl.log(tl.where(tot > 0, tot, 1.0)),
                                 float("-inf")))


_JITTED: list = []


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter: TRITON_INTERPRET=1 was set
    before triton was imported (its own library functions are jitted at import)."""
    from triton import knobs

    return bool(knobs.runtime.interpret)


def _kernels():
    """(attention kernel, merge kernel), jitted on first use."""
    if triton is None:
        raise ImportError("triton is not installed")
    if not _JITTED:
        _JITTED.extend((triton.jit(_slot_attn_fwd), triton.jit(_merge_splits),
                        triton.jit(_slot_decode_heads)))
    return _JITTED


def _p2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class SlotAttentionPlan:
    """Host-side launch plan for one SlotBatch (its work items and split count), made
    once and reused by every layer of a step."""

    def __init__(self, batch, rep: int, num_kv_heads: int, target_programs: int,
                 block_n: int | None, max_splits: int, splits: int | None = None,
                 block_m: int = 64, num_warps: int | None = None, group: int = 0):
        cu_q = batch.cu_q.tolist()  # the one host sync per batch
        cu_k = batch.cu_k.tolist()
        nq = [b - a for a, b in zip(cu_q, cu_q[1:])]
        nk = [b - a for a, b in zip(cu_k, cu_k[1:])]
        self.rep_p = _p2(rep)
        most_q = max(nq, default=0)
        self.block_q = 1 if most_q <= 1 else max(1, block_m // self.rep_p)
        # `group` > 0: a decode batch (exactly one query a request) runs
        # _slot_decode_heads with `group` kv heads a program
        self.group = group if nq and min(nq) == most_q == 1 else 0
        # decode (one query a request): rows are just the GQA group, math by broadcasting,
        # small key blocks and one warp (measured best on an H100); prefill tiles use
        # tl.dot, which needs >= 16 rows
        self.use_dot = self.block_q > 1
        self.block_m = max(16, _p2(self.block_q * self.rep_p)) if self.use_dot else self.rep_p
        if self.group:
            self.block_m = max(16, _p2(self.group * rep))
        self.block_n = block_n or (64 if self.use_dot or self.group else 32)
        self.num_warps = num_warps or (4 if self.use_dot else 2 if self.group else 1)
        item_b, item_q0 = [], []
        for b, (a, n) in enumerate(zip(cu_q, nq)):
            for i in range(0, n, self.block_q):
                item_b.append(b)
                item_q0.append(a + i)
        self.num_items = len(item_b)
        dev = batch.cu_q.device
        self.item_b = torch.tensor(item_b, dtype=torch.int32, device=dev)
        self.item_q0 = torch.tensor(item_q0, dtype=torch.int32, device=dev)
        longest, bn = max(nk, default=0), self.block_n
        if splits is None:  # split keys where (item, head) programs are too few to fill
            heads = num_kv_heads // self.group if self.group else num_kv_heads
            progs = max(1, self.num_items * heads)  # the GPU; >= 4 blocks a split
            blocks = 2 if self.group else 4  # key blocks a split at least
            splits = min(max_splits, max(1, target_programs // progs),
                         max(1, math.ceil(longest / (blocks * bn))))
        self.keys_per_split = max(bn, math.ceil(longest / max(1, splits) / bn) * bn)
        self.splits = max(1, math.ceil(longest / self.keys_per_split))


_COUNTS: dict = {}


def _split_counts(device, stream: int, n: int) -> torch.Tensor:
    """Zeroed int32 counters, one a (request, head group), for the fused split merge;
    each call's last program sets its counter back to 0. One buffer a device and stream,
    so two streams' calls never share a counter."""
    key = (str(device), stream)
    buf = _COUNTS.get(key)
    if buf is None or buf.numel() < n:
        buf = _COUNTS[key] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


def _decode_heads(q, k_pool, v_pool, batch, params, plan, interpret, num_stages, tc,
                  fuse_merge):
    """A decode batch through _slot_decode_heads (plan.group kv heads a program)."""
    _, merge, heads = _kernels()
    Nq, Hq, D = q.shape
    Hkv, Dv = k_pool.shape[1], v_pool.shape[2]
    G, rep, S = plan.group, Hq // Hkv, plan.splits
    sinks = params.sinks_tensor(q.device)
    o = torch.empty(Nq, Hq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(Nq, Hq, dtype=torch.float32, device=q.device)
    if Nq == 0:
        return o, lse
    direct = S == 1 and sinks is None
    fuse = fuse_merge and not direct
    if direct:
        op, lp = o, lse
    else:
        op = torch.empty(S, Nq, Hq, Dv, dtype=torch.float32, device=q.device)
        lp = torch.empty(S, Nq, Hq, dtype=torch.float32, device=q.device)
    stream = 0 if interpret else torch.cuda.current_stream(q.device).cuda_stream
    count = _split_counts(q.device, stream, Nq * (Hkv // G)) if fuse else lp
    kw = {} if interpret else {"num_warps": plan.num_warps, "num_stages": num_stages or 2}
    heads[(Nq, Hkv // G, S)](
        q, k_pool, v_pool, op, lp, o, lse, sinks if sinks is not None else lp, count,
        batch.slots, batch.cu_k, batch.q_pos, batch.k_pos0,
        float(params.scale if params.softcap <= 0 else params.scale / params.softcap),
        float(params.softcap), int(params.sliding_window), plan.keys_per_split, S,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
        v_pool.stride(0), v_pool.stride(1), op.stride(0) if not direct else 0,
        op.stride(-3), op.stride(-2), lp.stride(0) if not direct else 0, lp.stride(-2),
        o.stride(0), o.stride(1), lse.stride(0),
        G=G, REP=rep, ROWS=plan.block_m, BLOCK_N=plan.block_n, D=D, DV=Dv,
        BLOCK_C=max(16, _p2(G * D)), BLOCK_CV=max(16, _p2(G * Dv)), BLOCK_DV=max(16, _p2(Dv)),
        SOFTCAP=params.softcap > 0, WINDOW=params.sliding_window > 0, TC=tc, FUSE=fuse,
        HAS_SINKS=sinks is not None, **kw)
    if not direct and not fuse:
        merge[(Nq * Hq,)](op, lp, o, lse, sinks if sinks is not None else lp, S, Hq,
                          op.stride(0), lp.stride(0), SPLITS_P=max(2, _p2(S)), DV=Dv,
                          BLOCK_DV=max(16, _p2(Dv)), HAS_SINKS=sinks is not None)
    return o, lse


def slot_attention(q, k_pool, v_pool, batch, params, plan: SlotAttentionPlan,
                   interpret: bool = False, num_stages: int | None = None,
                   tensor_cores: bool = True, fuse_merge: bool = False):
    """Validated inputs -> (o [Nq, Hq, Dv] in q.dtype, lse [Nq, Hq] fp32). `tensor_cores`:
    a bf16 pool's dots run on bf16 tensor cores (q and p rounded to bf16, fp32
    accumulation); else all math is fp32 (the reference's numerics, about 2x slower).
    A plan with a head group (decode) runs _slot_decode_heads; `fuse_merge`: its key
    splits are merged by the kernel's last program rather than a second kernel."""
    attn, merge, _ = _kernels()
    Nq, Hq, D = q.shape
    quant = k_pool.dtype == torch.int8  # rows of kernels/quant.py: D codes, a 4-byte scale
    Hkv, Dv = k_pool.shape[1], v_pool.shape[2] - (4 if quant else 0)
    rep = Hq // Hkv
    q = q if q.stride(2) == 1 else q.contiguous()
    if plan.group and not quant:
        return _decode_heads(q, k_pool, v_pool, batch, params, plan, interpret, num_stages,
                             tensor_cores and k_pool.dtype == torch.bfloat16, fuse_merge)
    S = plan.splits
    sinks = params.sinks_tensor(q.device)
    direct = S == 1 and sinks is None  # the kernel writes the answer itself
    o = torch.empty(Nq, Hq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(Nq, Hq, dtype=torch.float32, device=q.device)
    if Nq == 0:
        return o, lse
    if direct:
        op, lp = o, lse
    else:
        op = torch.empty(S, Nq, Hq, Dv, dtype=torch.float32, device=q.device)
        lp = torch.empty(S, Nq, Hq, dtype=torch.float32, device=q.device)
    tc = tensor_cores and k_pool.dtype == torch.bfloat16
    block_m = plan.block_m if plan.use_dot or not tc else 16  # a dot needs >= 16 rows
    if plan.num_items:
        grid = (plan.num_items, Hkv, S)
        kw = {} if interpret else {"num_warps": plan.num_warps,
                                   **({"num_stages": num_stages} if num_stages else {})}
        # int8: the pools' bytes again as fp32, for the scales (D, Dv and strides % 4 == 0)
        ks, vs = (k_pool.view(torch.float32), v_pool.view(torch.float32)) if quant \
            else (k_pool, v_pool)
        attn[grid](q, k_pool, v_pool, ks, vs, op, lp, plan.item_b, plan.item_q0, batch.cu_q,
                   batch.q_pos, batch.slots, batch.cu_k, batch.k_pos0,
                   float(params.scale if params.softcap <= 0 else params.scale / params.softcap),
                   float(params.softcap), int(params.sliding_window), plan.keys_per_split,
                   q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
                   v_pool.stride(0), v_pool.stride(1),
                   op.stride(0) if not direct else 0, op.stride(-3), op.stride(-2),
                   lp.stride(0) if not direct else 0, lp.stride(-2),
                   REP=rep, REP_P=plan.rep_p, BLOCK_M=block_m, BLOCK_N=plan.block_n, D=D,
                   BLOCK_D=max(16, _p2(D)), DV=Dv, BLOCK_DV=max(16, _p2(Dv)),
                   SOFTCAP=params.softcap > 0, WINDOW=params.sliding_window > 0,
                   USE_DOT=plan.use_dot, TC=tc, QUANT=quant, **kw)
    if not direct:
        merge[(Nq * Hq,)](op, lp, o, lse, sinks if sinks is not None else lp, S, Hq,
                          op.stride(0), lp.stride(0), SPLITS_P=max(2, _p2(S)), DV=Dv,
                          BLOCK_DV=max(16, _p2(Dv)), HAS_SINKS=sinks is not None)
    return o, lse
