"""Triton kernels (the GPU backend) vs the pure-torch reference.

On a machine with a CUDA GPU they run compiled on it; elsewhere in Triton's interpreter
on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1), so CI checks the same kernel
code, indexing and masks without a GPU. Key splits (flash-decoding) are forced in some
cases so the split/merge path runs whatever the device's SM count."""
import numpy as np
import pytest
import torch

from lamina.costmodel.workload import scattered_tables
from lamina.kernels import (
    AttentionParams,
    BackendUnavailable,
    ReferenceBackend,
    SlotBatch,
    TritonBackend,
    attend,
    merge_attention,
    prefill_attention,
    select_backend,
)

from .test_slot_attention import GQA, D, decode_case, params_for, pools, queries

REF = ReferenceBackend()
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEV.type == "cpu":  # an interpreter that cannot run here says why (on a GPU: a failure)
    try:
        TritonBackend(interpret=True)
    except BackendUnavailable as e:
        pytest.skip(f"Triton's interpreter: {e}", allow_module_level=True)


def backend(splits=None):
    return TritonBackend(interpret=DEV.type == "cpu", splits=splits)


@pytest.fixture(scope="module")
def tri():
    return backend()  # splits chosen per batch (1 in the interpreter, which has "4 SMs")


@pytest.fixture(scope="module", params=[None, 3], ids=["auto-splits", "3-splits"])
def tri_splits(request):
    return backend(request.param)


def on_dev(*ts):
    return [t.to(DEV) for t in ts]


def check(q, k, v, batch, p, backend, tol=1e-5):
    o_ref, lse_ref = attend(q, k, v, batch, p, REF)
    qd, kd, vd = on_dev(q, k, v)
    o, lse = attend(qd, kd, vd, batch.to(DEV), p, backend)
    assert o.dtype == q.dtype and lse.dtype == torch.float32 and o.device.type == DEV.type
    o, lse = o.cpu(), lse.cpu()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(lse_ref))
    fin = torch.isfinite(lse_ref)
    assert (lse[fin] - lse_ref[fin]).abs().max() <= tol
    assert (o.float() - o_ref.float()).abs().max() <= tol
    return o, lse


@GQA
@pytest.mark.parametrize("pname", ["plain", "window", "softcap", "sinks"])
def test_decode_matches_reference(tri_splits, Hq, Hkv, pname, request):
    one_split = request.node.callspec.params["tri_splits"] is None
    if DEV.type == "cpu" and Hq // Hkv != 3 and (pname != "plain" or not one_split):
        pytest.skip("Triton's interpreter (~4 s a case) runs every feature at GQA 3 and "
                    "the other group sizes plain in one split only; a GPU runs them all")
    if DEV.type == "cpu" and pname != "plain" and one_split:
        pytest.skip("Triton's interpreter runs the features with forced key splits (the "
                    "split and merge path; one split is the plain cases'); a GPU runs both")
    tables, k, v = decode_case(Hq, Hkv)
    check(queries(len(tables), Hq), k, v, SlotBatch.decode(tables), params_for(pname, Hq),
          tri_splits)


@GQA
@pytest.mark.parametrize("pname", ["plain", "window", "softcap"])
def test_prefill_matches_reference(tri, Hq, Hkv, pname):
    prefill_case(tri, Hq, Hkv, pname)


def test_prefill_with_key_splits():
    prefill_case(backend(3), 9, 3, "plain")


def prefill_case(tri, Hq, Hkv, pname):
    # cached context (earlier turns) plus new prompt tokens, ragged; tiles straddle
    # request boundaries and the causal diagonal (smaller in the slow interpreter)
    lengths, new = ([5, 40, 300, 700], [5, 17, 300, 129]) if DEV.type == "cuda" else \
        ([5, 40, 150, 300], [5, 17, 150, 41])
    tables = scattered_tables(lengths, 2000, seed=3)
    k, v = pools(2000, Hkv)
    batch = SlotBatch.build(tables, new)
    check(queries(batch.num_queries, Hq), k, v, batch, params_for(pname, Hq), tri)


def test_prefill_writes_pool_then_attends(tri):
    """prefill_attention stores the new k/v at their slots on the device, then attends."""
    Hq, Hkv, S, T = 9, 3, 600, 150
    slots = scattered_tables([T], S, seed=8)[0]
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(T, h, D, generator=g) for h in (Hq, Hkv, Hkv))
    p, batch = AttentionParams(D ** -0.5), SlotBatch.build([slots], [T])
    idx = torch.tensor(slots, dtype=torch.int32)
    kp, vp = torch.zeros(S, Hkv, D), torch.zeros(S, Hkv, D)
    o_ref, _ = prefill_attention(q, k, v, kp, vp, idx, batch, p, REF)
    kd, vd = on_dev(torch.zeros(S, Hkv, D), torch.zeros(S, Hkv, D))
    o, _ = prefill_attention(*on_dev(q, k, v), kd, vd, idx.to(DEV), batch.to(DEV), p, tri)
    assert torch.equal(kd.cpu(), kp) and torch.equal(vd.cpu(), vp)
    assert (o.cpu() - o_ref).abs().max() <= 1e-5


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_bf16_pool_fp32_math(q_dtype):
    """With tensor cores off: same bounds as the CPU kernel's bf16 test. Both read the
    same bf16 values and compute in fp32 (1e-5); a bf16 q rounds the output once (one
    bf16 ulp, 2^-7 |o|)."""
    tri = TritonBackend(interpret=DEV.type == "cpu", bf16_tensor_cores=False)
    Hq, Hkv, S = 9, 3, 6000
    tables = scattered_tables([1, 100, 2048, 3000], S, seed=11)
    k, v = (t.bfloat16() for t in pools(S, Hkv))
    batch, q = SlotBatch.decode(tables), queries(len(tables), Hq, dtype=q_dtype)
    p = AttentionParams(D ** -0.5, softcap=30.0)
    if q_dtype == torch.float32:
        check(q, k, v, batch, p, tri)
        return
    o_ref, lse_ref = attend(q, k, v, batch, p, REF)
    o, lse = attend(*on_dev(q, k, v), batch.to(DEV), p, tri)
    assert o.dtype == torch.bfloat16 and (lse.cpu() - lse_ref).abs().max() <= 1e-5
    ulp = o_ref.float().abs().clamp_min(2.0 ** -126) * 2.0 ** -7
    assert ((o.cpu().float() - o_ref.float()).abs() <= ulp).all()


@pytest.mark.skipif(DEV.type != "cuda", reason="Triton's interpreter computes bf16 dots "
                    "wrongly, so it keeps fp32 math: the tensor-core path needs a GPU")
@pytest.mark.parametrize("pname", ["plain", "window", "sinks"])
def test_bf16_pool_tensor_cores(tri, pname):
    """The default for bf16 pools: bf16 tensor-core dots with fp32 accumulation, decode
    and prefill. q and p are rounded to bf16 (relative 2^-9 each): with unit-scale data
    and scale 1/8 a score moves by about 2^-9 * |s| and an output by about 2^-9 of the
    values it averages, so 1e-2 bounds o and lse with a wide margin (the H100 measured
    2e-4 to 9e-4 on decode up to L=8192). fp32 pools never take this path."""
    Hq, Hkv, S = 9, 3, 6000
    tables = scattered_tables([1, 100, 700, 2048], S, seed=12)
    k, v = (t.bfloat16() for t in pools(S, Hkv))
    p = params_for(pname, Hq)
    for batch in (SlotBatch.decode(tables), SlotBatch.build(tables, [1, 37, 90, 5])):
        q = queries(batch.num_queries, Hq)
        o_ref, lse_ref = attend(q, k, v, batch, p, REF)
        o, lse = attend(*on_dev(q, k, v), batch.to(DEV), p, tri)
        assert (o.cpu() - o_ref).abs().max() <= 1e-2
        assert (lse.cpu() - lse_ref).abs().max() <= 1e-2
        exact, _ = attend(*on_dev(q, k, v), batch.to(DEV), p,
                          TritonBackend(interpret=DEV.type == "cpu", bf16_tensor_cores=False))
        assert (o.cpu() - exact.cpu()).abs().max() > 0  # the fast path really ran


def test_lse_merge_of_split_kv_ranges_is_exact(tri_splits):
    """Keys split into disjoint ranges (two workers), each attended with its absolute
    start, merged by LSE == whole; a range the query cannot see gives 0 and -inf."""
    Hq, Hkv, S = 9, 3, 5000
    tables = scattered_tables([3, 500, 1500, 2500], S, seed=2)
    k, v = pools(S, Hkv)
    q = queries(len(tables), Hq)
    p = AttentionParams(D ** -0.5, sliding_window=1200, sinks=tuple(np.linspace(-1, 1, Hq)))
    kd, vd, qd = on_dev(k, v, q)
    tri = tri_splits
    whole, whole_lse = attend(qd, kd, vd, SlotBatch.decode(tables).to(DEV), p, tri)
    outs, lses = [], []
    for i, pi in enumerate((p, AttentionParams(p.scale, p.sliding_window))):  # sink once
        sub = [t[: len(t) // 2] if i == 0 else t[len(t) // 2:] for t in tables]
        start = [0 if i == 0 else len(t) // 2 for t in tables]
        b = SlotBatch.build(sub, [1] * len(sub), start, q_pos=[[len(t) - 1] for t in tables])
        o, lse = attend(qd, kd, vd, b.to(DEV), pi, tri)
        outs.append(o)
        lses.append(lse)
    merged, merged_lse = merge_attention(outs, lses)
    assert (merged - whole).abs().max().item() <= 1e-5
    assert (merged_lse - whole_lse).abs().max().item() <= 1e-5
    # a range entirely before the window start: nothing visible
    b = SlotBatch.build([tables[3][:100]], [1], [0], q_pos=[[2499]])
    o, lse = attend(qd[3:], kd, vd, b.to(DEV), AttentionParams(p.scale, 1200), tri)
    assert torch.isneginf(lse).all() and not o.any()


HEAD_GROUP_CASES = [(9, 3, "plain", "all"), (9, 3, "window", "all"), (9, 3, "softcap", "all"),
                    (9, 3, "sinks", "all"), (4, 4, "plain", "all"), (16, 2, "sinks", "all"),
                    (9, 3, "sinks", 1), (16, 2, "window", 1)]


@pytest.mark.parametrize("Hq,Hkv,pname,group", HEAD_GROUP_CASES)
def test_head_group_decode_matches_reference(Hq, Hkv, pname, group):
    """The head-group kernel (all kv heads, or one, a program; block-diagonal q, one dot
    for the group's query heads), its key splits merged by its last program, fp32 pools
    with IEEE dots: equal to the reference; a second call (the split counters back at 0)
    gives the same bits."""
    tri = TritonBackend(interpret=DEV.type == "cpu", splits=3, fuse_merge=True,
                        kv_heads_per_program=Hkv if group == "all" else 1)
    tables, k, v = decode_case(Hq, Hkv)
    batch, q = SlotBatch.decode(tables), queries(len(tables), Hq)
    o, lse = check(q, k, v, batch, params_for(pname, Hq), tri)
    assert tri.plan(batch.to(DEV), Hq // Hkv, Hkv, DEV, tri.head_group(k)).group == \
        (Hkv if group == "all" else 1)
    o2, lse2 = attend(*on_dev(q, k, v), batch.to(DEV), params_for(pname, Hq), tri)
    assert torch.equal(o2.cpu(), o) and torch.equal(lse2.cpu(), lse)


@pytest.mark.parametrize("splits,fuse", [(1, True), (3, False)])
def test_head_group_one_split_and_merge_kernel(splits, fuse):
    """One split writes the answer directly (sinks still merged); the second-kernel merge
    equals the fused one."""
    tri = TritonBackend(interpret=DEV.type == "cpu", splits=splits, kv_heads_per_program=3,
                        fuse_merge=fuse)
    tables, k, v = decode_case(9, 3)
    for pname in ("plain", "sinks"):
        check(queries(len(tables), 9), k, v, SlotBatch.decode(tables), params_for(pname, 9),
              tri)


def test_head_group_choice():
    """Which decode kernel a pool gets: bf16 on tensor cores the largest group within 256
    columns, fp32 and int8 the broadcasting kernel; a forced group must divide the kv
    heads; prefill batches never take the group kernel."""
    from lamina.kernels.triton_slot import SlotAttentionPlan

    tri = backend()
    tri.tensor_cores = True  # as on a GPU (the interpreter keeps fp32 math)
    bf16 = torch.zeros(10, 3, 64, dtype=torch.bfloat16)
    assert tri.head_group(bf16) == 1
    assert tri.head_group(torch.zeros(10, 3, 64)) == 0
    assert tri.head_group(torch.zeros(10, 3, 68, dtype=torch.int8)) == 0
    tri.tensor_cores = False
    assert tri.head_group(bf16) == 0
    assert TritonBackend(interpret=DEV.type == "cpu", kv_heads_per_program=3).head_group(
        torch.zeros(10, 3, 64)) == 3
    with pytest.raises(BackendUnavailable, match="does not divide the pool's 3 kv heads"):
        TritonBackend(interpret=DEV.type == "cpu", kv_heads_per_program=2).head_group(bf16)
    with pytest.raises(ValueError, match="kv_heads_per_program must be a positive int"):
        TritonBackend(interpret=DEV.type == "cpu", kv_heads_per_program=0)
    dec = SlotAttentionPlan(SlotBatch.decode([list(range(1000))] * 4), 3, 3, 132 * 6, None, 64,
                            group=1)
    assert (dec.group, dec.block_m, dec.block_n, dec.num_warps) == (1, 16, 64, 2)
    assert dec.splits == 8  # 1000 keys / (2 blocks of 64) caps the 66 programs wanted
    assert SlotAttentionPlan(SlotBatch.decode([list(range(2048))] * 32), 3, 3, 132 * 6, None,
                             64, group=1).splits == 8  # 792 programs wanted / 96
    pre = SlotAttentionPlan(SlotBatch.build([list(range(100))], [40]), 3, 3, 2112, None, 64,
                            group=3)
    assert pre.group == 0 and pre.use_dot


def test_plan_is_made_once_per_batch(tri):
    """Layers of one step share the batch: the host-side plan (one sync) is reused."""
    Hq, Hkv = 9, 3
    tables = scattered_tables([10, 700], 2000, seed=1)
    k, v = on_dev(*pools(2000, Hkv))
    batch = SlotBatch.decode(tables).to(DEV)
    q = queries(2, Hq).to(DEV)
    p = AttentionParams(D ** -0.5)
    attend(q, k, v, batch, p, tri)
    plan = tri.plan(batch, 3, Hkv, DEV)
    attend(q, k, v, batch, p, tri)
    assert tri.plan(batch, 3, Hkv, DEV) is plan
    assert tri.plan(SlotBatch.decode(tables).to(DEV), 3, Hkv, DEV) is not plan


def test_split_plan_covers_every_key():
    """Forced and chosen split counts: the splits tile [0, longest) in BLOCK_N multiples."""
    from lamina.kernels.triton_slot import SlotAttentionPlan

    batch = SlotBatch.decode([list(range(1000)), list(range(1000, 1003))])
    for forced in (None, 1, 3, 7, 50):
        plan = SlotAttentionPlan(batch, 3, 3, 2112, None, 64, forced)
        assert plan.keys_per_split % 32 == 0
        assert (plan.splits - 1) * plan.keys_per_split < 1000 <= plan.splits * plan.keys_per_split
        assert (plan.num_items, plan.block_q, plan.block_m, plan.use_dot) == (2, 1, 4, False)
        assert (plan.block_n, plan.num_warps) == (32, 1)
    assert SlotAttentionPlan(batch, 3, 3, 2112, None, 64).splits == 8  # 1000 / (4 * 32) caps
    assert SlotAttentionPlan(batch, 3, 3, 36, None, 64).splits == 6  # 36 programs wanted
    pre = SlotAttentionPlan(SlotBatch.build([list(range(100))], [40]), 3, 3, 2112, None, 64)
    assert (pre.block_q, pre.block_m, pre.num_items, pre.use_dot) == (16, 64, 3, True)
    assert (pre.block_n, pre.num_warps) == (64, 4)
    assert pre.item_q0.tolist() == [0, 16, 32]


def test_backend_choice_and_errors(monkeypatch):
    with pytest.raises(BackendUnavailable, match="serves GPU pools"):
        select_backend("triton", device="cpu")
    with pytest.raises(ValueError, match="splits must be a positive int"):
        TritonBackend(interpret=DEV.type == "cpu", splits=0)
    if DEV.type == "cpu":  # the interpreter is on here; the GPU path says what is wrong
        with pytest.raises(BackendUnavailable, match="unset it to run the triton backend"):
            TritonBackend()
        with pytest.raises(BackendUnavailable, match="interpreter is on"):
            select_backend("triton", device="cuda")
        b = select_backend("auto", device="cuda")
        assert b.name == "reference" and "interpreter is on" in b.reason
    else:
        assert select_backend("auto", device=DEV).name == "triton"
        with pytest.raises(BackendUnavailable, match="set TRITON_INTERPRET=1"):
            TritonBackend(interpret=True)


@pytest.mark.parametrize("case", ["decode", "prefill"])
def test_int8_pools_match_reference(tri, case):
    """int8 rows (kernels/quant.py): codes read as floats, each row's scale applied to
    its scores and its value weights; keys' channel scales folded into q beforehand.
    Decode on scattered slots (GQA 3, a window) and prefill tiles over cached context."""
    from lamina.kernels.quant import fold_channels, quantize_rows

    tables, k, v = decode_case(9, 3)
    c = torch.rand(3, D, generator=torch.Generator().manual_seed(7)) + 0.5
    kq, vq = quantize_rows(k, c), quantize_rows(v)
    if case == "decode":
        batch, p = SlotBatch.decode(tables), AttentionParams(D ** -0.5, sliding_window=300)
    else:
        tables = [t[:200] for t in tables[3:6]]
        batch, p = SlotBatch.build(tables, [17, 40, 64]), AttentionParams(D ** -0.5)
    q = fold_channels(queries(batch.num_queries, 9), c)
    check(q, kq, vq, batch, p, tri, tol=1e-4)
