"""topk's page selection for a step's rows in one C++ call (`page_pick`, through
`page_picks` and `Sparsifier.select`) and the int8 page bounds of int8 pools
(`quantize_bounds`): the picks against the row-by-row NumPy rule (`pick_pages`) on
random rows of every shape the rule has, ties to the earlier page on hand-built bounds,
and the int8 bounds still bounding q.k from above (NumPy)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lamina.kernels import SlotBatch, load_cpu_kernel
from lamina.memory import sparsity
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.memory.sparsity import (
    Sparsifier,
    SparsityConfig,
    dequantize_bounds,
    page_bounds,
    page_scores,
    pick_pages,
    quantize_bounds,
    signed_queries,
    split_budget,
)

HKV = 3


def random_rows(rng, hd: int, count: int):
    """`count` rows: bounds [pages, 2, Hkv, hd] of random keys, a signed query, and
    params (n, c, sinks, recent, P) drawn over every case of the rule (c >= n, no
    pages, recent beyond the tail, no room left, ...)."""
    rows = []
    for _ in range(count):
        P = int(rng.choice([1, 4, 16]))
        n = int(rng.integers(1, 400))
        pages = (n - 1) // P
        keys = torch.from_numpy(rng.standard_normal((pages * P, HKV, hd)).astype(np.float32))
        b = page_bounds(keys, P) if pages else torch.zeros(0, 2, HKV, hd)
        q = torch.from_numpy(rng.standard_normal((2 * HKV, hd)).astype(np.float32))
        params = (n, int(rng.integers(0, n + 8)), int(rng.integers(0, 5)),
                  int(rng.integers(0, 48)), P)
        rows.append((b, signed_queries(q[None], HKV)[0], params, q))
    return rows


@pytest.mark.parametrize("hd", [8, 64])  # 64: the int8 VNNI path where compiled in
@pytest.mark.parametrize("int8", [False, True])
def test_page_pick_equals_the_numpy_rule_row_by_row(hd, int8):
    ext = load_cpu_kernel()
    rng = np.random.default_rng(hd + int8)
    rows = random_rows(rng, hd, 120)
    bounds = [quantize_bounds(b) if int8 else b.flatten(1) for b, _, _, _ in rows]
    # each row's slots, one after another in the step's table: the picks' come back too
    tables = [rng.permutation(1 << 16)[:p[0]].astype(np.int32) for _, _, p, _ in rows]
    offsets = np.cumsum([0] + [len(t) for t in tables])[:-1].tolist()
    params = torch.tensor([(*p, o) for (_, _, p, _), o in zip(rows, offsets)])
    table = torch.from_numpy(np.concatenate(tables))
    idx, cu, slots, stale = ext.page_pick(torch.stack([s for _, s, _, _ in rows]), bounds,
                                          params, table)
    assert stale.tolist() == [-1] * len(rows)  # nothing to check
    # from the queries themselves (summed into signed queries in C++): the same picks
    from_q = ext.page_pick(torch.stack([q for _, _, _, q in rows]), bounds, params, table)
    assert from_q[0].tolist() == idx.tolist() and from_q[1].tolist() == cu.tolist()
    ends = cu.tolist()
    for i, ((b, s, (n, c, sinks, recent, P), _), rb) in enumerate(zip(rows, bounds)):
        scored = dequantize_bounds(rb, HKV) if int8 else b
        want = pick_pages(n, c, sinks, P, page_scores(s, scored), recent)
        assert idx[ends[i]:ends[i + 1]].tolist() == want.tolist(), (i, n, c, sinks, recent, P)
        assert slots[ends[i]:ends[i + 1]].tolist() == tables[i][want.numpy()].tolist()


def test_page_pick_ties_go_to_the_earlier_page():
    ext = load_cpu_kernel()
    b = torch.zeros(6, 2, 1, 16)
    b[[1, 3, 4], 1] = 1.0  # pages 1, 3 and 4 tie on the best bound; 2 pages fit
    s = torch.ones(1, 32)
    for rows in (b.flatten(1), quantize_bounds(b)):
        idx, _, _, _ = ext.page_pick(s, [rows],
                                     torch.tensor([[4 * 6 + 2, 2 * 4 + 2, 0, 0, 4, 0]]))
        assert idx.tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 24, 25]


def test_page_pick_refuses_bad_rows_by_name():
    ext = load_cpu_kernel()
    s = torch.zeros(1, 12)
    with pytest.raises(RuntimeError, match="bounds must be \\[pages, 12\\] fp32"):
        ext.page_pick(s, [torch.zeros(2, 10)], torch.tensor([[40, 8, 0, 0, 16, 0]]))
    with pytest.raises(RuntimeError, match="row 0 has bad params .* for 3 pages"):
        ext.page_pick(s, [torch.zeros(3, 12)], torch.tensor([[40, 8, 0, 0, 16, 0]]))
    with pytest.raises(RuntimeError, match="row 0 has bad params .* a table of 45"):
        ext.page_pick(s, [torch.zeros(2, 12)], torch.tensor([[40, 8, 0, 0, 16, 6]]),
                      torch.zeros(45, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="params \\[R, 6\\] int64"):
        ext.page_pick(s, [torch.zeros(2, 12)], torch.tensor([[40, 8, 0, 0, 16]]))
    table = torch.arange(40, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="row 0's page_slots must be int32 \\[32\\]"):
        ext.page_pick(s, [torch.zeros(2, 12)], torch.tensor([[40, 8, 0, 0, 16, 0]]), table,
                      [torch.arange(16, dtype=torch.int32)])
    with pytest.raises(RuntimeError, match="page_slots needs the step's table"):
        ext.page_pick(s, [torch.zeros(2, 12)], torch.tensor([[40, 8, 0, 0, 16, 0]]), None,
                      [torch.arange(32, dtype=torch.int32)])
    with pytest.raises(RuntimeError, match="do not group over the bounds' 2 kv heads"):
        ext.page_pick(torch.zeros(1, 3, 3), [torch.zeros(2, 12)],
                      torch.tensor([[40, 8, 0, 0, 16, 0]]))


def test_page_pick_names_the_first_page_whose_slots_changed():
    """Each row's page_slots are compared with its table in the call: -1 where equal,
    else the first page that differs (an empty entry: not checked)."""
    ext = load_cpu_kernel()
    table = torch.randperm(400, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    params = torch.tensor([[100, 40, 0, 0, 8, 0], [100, 40, 0, 0, 8, 100],
                           [100, 40, 0, 0, 8, 200], [100, 40, 0, 0, 8, 300]])
    bounds = [torch.zeros(12, 12) for _ in range(4)]  # 12 full pages of 8 in 100 keys
    same = [table[o:o + 96].clone() for o in (0, 100, 200, 300)]
    moved = same[1].clone()
    moved[5 * 8 + 3] = 999  # page 5 holds another slot now
    moved[9 * 8] = 998
    _, _, _, stale = ext.page_pick(torch.zeros(4, 12), bounds, params, table,
                                   [same[0], moved, torch.zeros(0, dtype=torch.int32),
                                    same[3]])
    assert stale.tolist() == [-1, 5, -1, -1]


def test_int8_bounds_still_bound_every_key_from_above():
    """For each page and kv head, q- . min + q+ . max over the dequantized int8 bounds
    is >= q . k for every key of the page (NumPy, fp64), and the codes are outward
    by less than two scale steps."""
    rng = np.random.default_rng(3)
    keys = (rng.standard_normal((40 * 8, HKV, 64)) * rng.uniform(0.1, 9, (1, HKV, 64)))
    b = page_bounds(torch.from_numpy(keys.astype(np.float32)), 8)  # [40, 2, Hkv, 64]
    rows = quantize_bounds(b)
    assert rows.dtype == torch.int8 and rows.shape == (40, 2 * HKV * 64 + 4 * HKV)
    dq = dequantize_bounds(rows, HKV).double().numpy()
    scale = rows[:, -4 * HKV:].contiguous().view(torch.float32).double().numpy()  # [40, Hkv]
    bn = b.double().numpy()
    assert (dq[:, 0] <= bn[:, 0]).all() and (dq[:, 1] >= bn[:, 1]).all()
    assert (np.abs(dq - bn) < 2 * scale[:, None, :, None]).all()
    q = rng.standard_normal((200, 64))
    kp = keys.reshape(40, 8, HKV, 64)
    for h in range(HKV):
        true = np.einsum("qd,pkd->qpk", q, kp[:, :, h]).max(-1)  # [200, 40]
        bound = np.minimum(q, 0) @ dq[:, 0, h].T + np.maximum(q, 0) @ dq[:, 1, h].T
        assert (bound >= true - 1e-9).all()


def test_select_over_an_int8_pool_keeps_int8_bounds_and_picks_by_the_rule():
    """Sparsifier.select on an int8 pool: 5 decode rows of different lengths (one under
    its budget) cut in one call; each row's keys equal `pick_pages` over its own
    dequantized bounds, and its state holds int8 rows."""
    g = torch.Generator().manual_seed(2)
    pool = KVPool(KVPoolConfig(1, 2048, HKV, 64, dtype="int8",
                               key_scales=tuple((torch.rand(HKV * 64, generator=g) + 0.5)
                                                .tolist())))
    pool.write(0, torch.arange(2048), torch.randn(2048, HKV, 64, generator=g),
               torch.randn(2048, HKV, 64, generator=g))
    kp, _ = pool.layer(0)
    perm = torch.randperm(2048, generator=g).to(torch.int32)
    lens = [300, 177, 40, 401, 256]
    tables, at = [], 0
    for n in lens:
        tables.append(perm[at:at + n].tolist())
        at += n
    batch = SlotBatch.decode(tables)
    q = torch.randn(len(lens), 2 * HKV, 64, generator=g)
    cfg = SparsityConfig("topk", 64, sinks=4, page_size=16, window=16)
    sinks, recent = split_budget(64, cfg.sinks, cfg.recent)
    sp = Sparsifier(cfg, 1)
    ids = tuple(range(10, 10 + len(lens)))
    sel = sp.select(0, q, batch, ids, kp, pool.key_scales[0])
    cu = sel.cu_k.tolist()
    signed = signed_queries(q, HKV)
    for i, n in enumerate(lens):
        got = sel.slots[cu[i]:cu[i + 1]].tolist()
        st = sp.state[ids[i]][0]
        if n <= 64:
            assert got == tables[i] and st.picked is None
            continue
        assert st.bounds.dtype == torch.int8 and st.bounds.shape[0] == (n - 1) // 16
        want = pick_pages(n, 64, sinks, 16, page_scores(signed[i], dequantize_bounds(
            st.bounds, HKV)), recent)
        assert got == [tables[i][j] for j in want.tolist()]
        assert st.picked.tolist() == want.tolist()


@pytest.mark.parametrize("cpp", [True, False])  # False: the torch / NumPy path (GPU pools)
def test_select_rebuilds_the_pages_of_a_row_whose_slots_moved(cpp, monkeypatch):
    """Steps after the first compare each row's summarized pages with its table (in the
    C++ call, or in NumPy); a row whose slots moved (a fork, a recomputation) is rebuilt
    from the page that changed and picked again: every step equals a fresh Sparsifier's
    selection, and the rows that did not move keep their bounds tensors."""
    if not cpp:
        monkeypatch.setattr(sparsity, "_cpu_ext", lambda: None)
    g = torch.Generator().manual_seed(4)
    pool = KVPool(KVPoolConfig(1, 4096, HKV, 64))
    pool.write(0, torch.arange(4096), torch.randn(4096, HKV, 64, generator=g),
               torch.randn(4096, HKV, 64, generator=g))
    kp, _ = pool.layer(0)
    perm = torch.randperm(4096, generator=g).to(torch.int32).tolist()
    tables = [perm[:300], perm[300:700], perm[700:1000]]
    cfg = SparsityConfig("topk", 64, sinks=4, page_size=16, window=16)
    sp, ids = Sparsifier(cfg, 1), (7, 8, 9)
    spare = iter(perm[2000:])
    for step in range(4):
        if step == 2:  # row 1's keys 100-131 now live in other slots (pages 6-8)
            tables[1] = tables[1][:100] + [next(spare) for _ in range(32)] + tables[1][132:]
        tables = [t + [next(spare)] for t in tables]  # each row grows by a key a step
        batch = SlotBatch.decode(tables)
        q = torch.randn(3, 2 * HKV, 64, generator=g)
        before = [sp.state[i][0].bounds if i in sp.state else None for i in ids]
        sel = sp.select(0, q, batch, ids, kp, None)
        want = Sparsifier(cfg, 1).select(0, q, batch, ids, kp, None)
        assert sel.slots.tolist() == want.slots.tolist(), step
        assert sel.cu_k.tolist() == want.cu_k.tolist() and sel.k_pos0.tolist() == \
            want.k_pos0.tolist()
        if step == 2:
            assert before[0] is sp.state[7][0].bounds and before[2] is sp.state[9][0].bounds
            assert before[1] is not sp.state[8][0].bounds
            assert sp.state[8][0].page_slots.tolist() == tables[1][:(len(tables[1]) - 1)
                                                                    // 16 * 16]
