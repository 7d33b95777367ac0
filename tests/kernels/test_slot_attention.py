"""Compiled CPU kernel vs the pure-torch reference, and the reference vs independent
math (the splitter's SDPA-based causal attention, NumPy log-sum-exp)."""
import numpy as np
import pytest
import torch

from lamina.costmodel.workload import scattered_tables
from lamina.kernels import (
    AttentionParams,
    ReferenceBackend,
    SlotBatch,
    attend,
    merge_attention,
    prefill_attention,
    write_kv,
)
from lamina.splitter.attention_op import reference_attention

REF = ReferenceBackend()
D = 64


def pools(S, Hkv, dtype=torch.float32, seed=0, Dv=D):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(S, Hkv, D, generator=g).to(dtype)
    v = torch.randn(S, Hkv, Dv, generator=g).to(dtype)
    return k, v


def queries(n, Hq, seed=1, dtype=torch.float32):
    return torch.randn(n, Hq, D, generator=torch.Generator().manual_seed(seed)).to(dtype)


PARAMS = {
    "plain": AttentionParams(D ** -0.5),
    "window": AttentionParams(D ** -0.5, sliding_window=37),
    "softcap": AttentionParams(D ** -0.5, softcap=1.5),  # small cap: tanh is far from linear
    "sinks": None,  # filled per head count
}


GQA = pytest.mark.parametrize("Hq,Hkv", [(4, 4), (9, 3), (16, 2)], ids=["gqa1", "gqa3", "gqa8"])


def decode_case(Hq, Hkv):
    """Ragged lengths 1..4096 on slots scattered by an allocator history."""
    tables = scattered_tables([1, 2, 7, 64, 65, 333, 1024, 4096], 8000, seed=Hq)
    return tables, *pools(8000, Hkv)


def params_for(name, Hq):
    if name == "sinks":
        return AttentionParams(D ** -0.5, sinks=tuple(np.linspace(-2, 3, Hq)))
    return PARAMS[name]


@GQA
@pytest.mark.parametrize("pname", ["plain", "window", "softcap", "sinks"])
def test_decode_matches_reference(cpu, Hq, Hkv, pname):
    tables, k, v = decode_case(Hq, Hkv)
    assert any(np.diff(t).tolist() != [1] * (len(t) - 1) for t in tables)  # really scattered
    batch = SlotBatch.decode(tables)
    q = queries(len(tables), Hq)
    p = params_for(pname, Hq)
    o_ref, lse_ref = attend(q, k, v, batch, p, REF)
    o, lse = attend(q, k, v, batch, p, cpu)
    assert (o - o_ref).abs().max() <= 1e-5
    assert (lse - lse_ref).abs().max() <= 1e-5


@GQA
@pytest.mark.parametrize("pname", ["plain", "window", "softcap"])
def test_prefill_matches_reference(cpu, Hq, Hkv, pname):
    # Requests with cached context (multi-turn) plus new prompt tokens; ragged.
    lengths, new = [5, 40, 300, 700], [5, 17, 300, 129]
    S = 2000
    tables = scattered_tables(lengths, S, seed=3)
    k, v = pools(S, Hkv)
    batch = SlotBatch.build(tables, new)
    q = queries(batch.num_queries, Hq)
    p = params_for(pname, Hq)
    o_ref, lse_ref = attend(q, k, v, batch, p, REF)
    o, lse = attend(q, k, v, batch, p, cpu)
    assert (o - o_ref).abs().max() <= 1e-5
    assert (lse - lse_ref).abs().max() <= 1e-5


def test_prefill_then_decode_equals_contiguous_causal_attention(cpu):
    """Pool + kernels reproduce the splitter's SDPA causal attention over a sequence:
    prefill 50 tokens into scattered slots, then decode 3 more one at a time."""
    Hq, Hkv, T0, steps = 9, 3, 50, 3
    T = T0 + steps
    g = torch.Generator().manual_seed(7)
    q_all = torch.randn(1, Hq, T, D, generator=g)
    k_all = torch.randn(1, Hkv, T, D, generator=g)
    v_all = torch.randn(1, Hkv, T, D, generator=g)
    expected = reference_attention(q_all, k_all, v_all, D ** -0.5)[0]  # [T, Hq, D]
    S = 500
    slots = scattered_tables([T], S, seed=5)[0]
    for backend in (REF, cpu):
        kp, vp = torch.zeros(S, Hkv, D), torch.zeros(S, Hkv, D)
        p = AttentionParams(D ** -0.5)
        batch = SlotBatch.build([slots[:T0]], [T0])
        o, _ = prefill_attention(q_all[0, :, :T0].transpose(0, 1), k_all[0, :, :T0].transpose(0, 1),
                                 v_all[0, :, :T0].transpose(0, 1), kp, vp,
                                 torch.tensor(slots[:T0], dtype=torch.int32), batch, p, backend)
        outs = [o]
        for t in range(T0, T):
            write_kv(kp, vp, torch.tensor([slots[t]]), k_all[0, :, t][None], v_all[0, :, t][None])
            o, _ = attend(q_all[0, :, t][None], kp, vp, SlotBatch.decode([slots[: t + 1]]), p,
                          backend)
            outs.append(o)
        assert (torch.cat(outs) - expected).abs().max() <= 1e-5


def test_reference_lse_matches_numpy():
    Hq, Hkv, S = 4, 2, 50
    k, v = pools(S, Hkv)
    tables = [[3, 9, 1, 40, 22], [7]]
    q = queries(2, Hq)
    p = AttentionParams(0.3, softcap=2.0, sinks=(0.5, -1.0, 2.0, 0.0))
    o, lse = attend(q, k, v, SlotBatch.decode(tables), p, REF)
    kn, vn, qn = k.double().numpy(), v.double().numpy(), q.double().numpy()
    for b, t in enumerate(tables):
        for h in range(Hq):
            s = kn[t, h // 2] @ qn[b, h] * 0.3
            s = 2.0 * np.tanh(s / 2.0)
            z = np.append(s, p.sinks[h])
            ref_lse = np.log(np.exp(z - z.max()).sum()) + z.max()
            w = np.exp(s - ref_lse)
            assert abs(lse[b, h].item() - ref_lse) < 1e-5
            np.testing.assert_allclose(o[b, h].numpy(), w @ vn[t, h // 2], atol=1e-5)


@pytest.mark.parametrize("kv_dtype,q_dtype", [(torch.bfloat16, torch.float32),
                                              (torch.bfloat16, torch.bfloat16)])
def test_bf16(cpu, kv_dtype, q_dtype):
    """bf16 KV: kernel and reference read the same bf16 values and both compute in fp32,
    so with fp32 q they agree to the fp32 bound (1e-5). With bf16 q the output is rounded
    to bf16 once; two fp32 results within 1e-5 can round to neighbouring bf16 values,
    so the bound is one bf16 ulp: 2^-7 * |o| (8 significant bits)."""
    Hq, Hkv, S = 9, 3, 6000
    tables = scattered_tables([1, 100, 2048, 3000], S, seed=11)
    k32, v32 = pools(S, Hkv)
    k, v = k32.to(kv_dtype), v32.to(kv_dtype)
    batch = SlotBatch.decode(tables)
    q = queries(len(tables), Hq, dtype=q_dtype)
    p = AttentionParams(D ** -0.5, softcap=30.0)
    o_ref, lse_ref = attend(q, k, v, batch, p, REF)
    o, lse = attend(q, k, v, batch, p, cpu)
    assert o.dtype == q_dtype and lse.dtype == torch.float32
    assert (lse - lse_ref).abs().max() <= 1e-5
    if q_dtype == torch.float32:
        assert (o - o_ref).abs().max() <= 1e-5
    else:
        ulp = o_ref.float().abs().clamp_min(2.0 ** -126) * 2.0 ** -7
        assert ((o.float() - o_ref.float()).abs() <= ulp).all()
    # Storing KV in bf16 (vs fp32) moves outputs by bf16 quantisation only: each
    # element has relative error <= 2^-9, so softmax-averaged unit-scale values move by
    # well under 1e-2.
    o32, _ = attend(q.float(), k32, v32, batch, p, cpu)
    assert (o.float() - o32).abs().max() < 1e-2


@pytest.mark.parametrize("parts", [2, 3])
def test_lse_merge_of_split_kv_ranges_is_exact(cpu, parts):
    """Split each request's keys into disjoint ranges (as two workers would hold them),
    attend over each with its absolute start position, merge by LSE == whole."""
    Hq, Hkv, S = 9, 3, 5000
    tables = scattered_tables([3, 500, 1500, 2500], S, seed=2)
    k, v = pools(S, Hkv)
    q = queries(len(tables), Hq)
    p = AttentionParams(D ** -0.5, sliding_window=1200, sinks=tuple(np.linspace(-1, 1, Hq)))
    whole, whole_lse = attend(q, k, v, SlotBatch.decode(tables), p, cpu)
    rng = np.random.default_rng(parts)
    cuts = [sorted(rng.choice(np.arange(1, len(t)), parts - 1, replace=False).tolist())
            if len(t) > parts else [len(t)] * (parts - 1) for t in tables]
    outs, lses = [], []
    for i in range(parts):
        sub, start = [], []
        for t, c in zip(tables, cuts):
            a, b = ([0] + c)[i], (c + [len(t)])[i]
            sub.append(t[a:b])
            start.append(a)
        q_pos = [len(t) - 1 for t in tables]  # the query stays at the end of the whole
        batch = SlotBatch.build(sub, [0] * len(sub), start)
        batch = SlotBatch(torch.arange(len(sub) + 1, dtype=torch.int32),
                          torch.tensor(q_pos, dtype=torch.int32), batch.slots, batch.cu_k,
                          batch.k_pos0)
        # The sink joins one partial only.
        pi = p if i == 0 else AttentionParams(p.scale, p.sliding_window)
        o, lse = attend(q, k, v, batch, pi, cpu)
        outs.append(o)
        lses.append(lse)
    merged, merged_lse = merge_attention(outs, lses)
    assert (merged - whole).abs().max() <= 1e-5
    assert (merged_lse - whole_lse).abs().max() <= 1e-5


def test_merge_handles_empty_partials():
    o = torch.randn(3, 2, 4)
    lse = torch.randn(3, 2)
    empty_o, empty_lse = torch.zeros(3, 2, 4), torch.full((3, 2), float("-inf"))
    m, ml = merge_attention([empty_o, o], [empty_lse, lse])
    assert torch.equal(ml, lse) and (m - o).abs().max() < 1e-7
    m, ml = merge_attention([empty_o, empty_o], [empty_lse, empty_lse])
    assert torch.isneginf(ml).all() and torch.equal(m, empty_o)


def test_query_with_no_visible_key_gives_zero_and_neg_inf_lse(cpu):
    # Keys start at position 10 but the query sits at 5: nothing is causal-visible.
    k, v = pools(20, 1)
    batch = SlotBatch(torch.tensor([0, 1], dtype=torch.int32),
                      torch.tensor([5], dtype=torch.int32),
                      torch.tensor([1, 2, 3], dtype=torch.int32),
                      torch.tensor([0, 3], dtype=torch.int32),
                      torch.tensor([10], dtype=torch.int32))
    for backend in (REF, cpu):
        o, lse = attend(queries(1, 2), k, v, batch, AttentionParams(0.1), backend)
        assert torch.equal(o, torch.zeros_like(o)) and torch.isneginf(lse).all()


def test_threads_do_not_change_results(cpu):
    Hq, Hkv, S = 9, 3, 3000
    tables = scattered_tables([10, 700, 1200, 5, 900], S, seed=4)
    k, v = pools(S, Hkv)
    batch, q, p = SlotBatch.decode(tables), queries(5, Hq), AttentionParams(D ** -0.5)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        o1, l1 = attend(q, k, v, batch, p, cpu)
        torch.set_num_threads(2)
        o2, l2 = attend(q, k, v, batch, p, cpu)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


@pytest.mark.parametrize("rep", [1, 3, 8])
@pytest.mark.parametrize("softcap,window", [(0.0, -1), (30.0, -1), (0.0, 700)])
def test_bf16_queries_on_bf16_pools(cpu, rep, softcap, window):
    """bf16 q over bf16 pools: on AVX512-BF16 builds the scores are bf16 pair dot
    products (`simd_paths` has "avx512bf16"): the same exact products as fp32 math, summed
    in another order, so lse stays within the fp32 bound and o within one bf16 ulp; GQA
    groups of 3, 2 and 1 rows, scale folded in (no softcap) or not, a window."""
    Hkv, S = 2, 7000
    tables = scattered_tables([1, 5, 64, 333, 2048, 3000], S, seed=rep)
    k, v = (t.to(torch.bfloat16) for t in pools(S, Hkv))
    batch = SlotBatch.decode(tables)
    q = queries(len(tables), Hkv * rep, dtype=torch.bfloat16)
    p = AttentionParams(D ** -0.5, sliding_window=window, softcap=softcap)
    o_ref, lse_ref = attend(q, k, v, batch, p, REF)
    o, lse = attend(q, k, v, batch, p, cpu)
    assert (lse - lse_ref).abs().max() <= 1e-5
    ulp = o_ref.float().abs().clamp_min(2.0 ** -126) * 2.0 ** -7
    assert ((o.float() - o_ref.float()).abs() <= ulp).all()
    assert set(cpu._ext.simd_paths()) <= {"avx2", "avx512", "avx512bf16", "avx512vnni"}


def _prompt_batch(S=4000, seed=0):
    """A decode row; a 300-token prompt; a 100-token chunk after 500 tokens; one KV
    range of 200 keys before its 80 queries (a sequence split over workers); a 40-token
    prompt (too few queries); 70 queries at every other position."""
    perm = torch.randperm(S, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = [perm[:50], perm[50:350], perm[350:950], perm[950:1150], perm[1150:1190],
              perm[1190:1330]]
    q_pos = [[49], list(range(300)), list(range(500, 600)), list(range(200, 280)),
             list(range(40)), list(range(1, 140, 2))]
    return SlotBatch.build(tables, [len(p) for p in q_pos], q_pos=q_pos)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 1.6e-2)])
def test_prompts_through_flash_attention_match_reference(cpu, dtype, tol):
    """Requests with many queries go through torch's flash kernel (`prompt_sdpa`), the
    rest through the slot kernel, in one call; both against the reference."""
    from lamina.kernels import prompt_sdpa

    b = _prompt_batch()
    assert prompt_sdpa.take(b) == {1: 300, 2: 100, 3: 0}
    k, v = pools(4000, 3, dtype)
    q = queries(b.num_queries, 9, dtype=dtype)
    o, lse = cpu.attend(q, k, v, b, PARAMS["plain"])
    o_ref, lse_ref = REF.attend(q, k, v, b, PARAMS["plain"])
    assert o.dtype == dtype
    torch.testing.assert_close(o.float(), o_ref.float(), atol=tol, rtol=0)
    torch.testing.assert_close(lse, lse_ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("pname", ["window", "softcap", "sinks"])
def test_layers_flash_cannot_express_stay_with_the_slot_kernel(cpu, pname):
    from lamina.kernels import prompt_sdpa

    k, v = pools(4000, 3)
    params = params_for(pname, 9)
    assert not prompt_sdpa.takes_layer(k, v, params)
    assert prompt_sdpa.takes_layer(k, v, PARAMS["plain"])
    assert not prompt_sdpa.takes_layer(k.to(torch.int8), v.to(torch.int8), PARAMS["plain"])
    b = _prompt_batch()
    q = queries(b.num_queries, 9)
    o, lse = cpu.attend(q, k, v, b, params)
    o_ref, lse_ref = REF.attend(q, k, v, b, params)
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=0)
