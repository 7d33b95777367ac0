"""Attention sparsity on the memory side (`lamina.memory.sparsity`): each policy's
selected keys on hand-built attention patterns (exact positions), the attention output
over them against NumPy attention over the same keys, budgets at or above the context
equal to dense (HF greedy tokens), layer budgets, and bad configuration refused by name."""
from __future__ import annotations

import math
from dataclasses import replace
from unittest.mock import patch

import numpy as np
import pytest
import torch

from lamina import SamplingParams
from lamina.engine.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.executor.local import LocalExecutor
from lamina.kernels import AttentionParams, SlotBatch
from lamina.kernels.quant import dequantize_rows
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.memory.sparsity import (
    SparsityConfig,
    layer_fractions,
    layer_shares,
    page_bounds,
    page_scores,
    pick,
    snap_scores,
)
from tests.conftest import HF_NEW
from tests.lamina.test_engine import SLOTS

D = 4
SID = 7


def np_attention(q, keys, vals, scale=1.0):
    """q [Hq, D], keys/vals [n, Hkv, D] -> o [Hq, D] (NumPy, fp64)."""
    q, keys, vals = (np.asarray(x, np.float64) for x in (q, keys, vals))
    rep = q.shape[0] // keys.shape[1]
    k, v = np.repeat(keys, rep, axis=1), np.repeat(vals, rep, axis=1)  # [n, Hq, D]
    s = np.einsum("hd,nhd->hn", q, k) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hn,nhd->hd", p, v)


class Row:
    """One sequence on a one-layer pool (Hq = Hkv = 1), its position p at slot 60 - p
    (slots not in position order), driven through `MemorySide.attend`."""

    def __init__(self, config: SparsityConfig, keys: np.ndarray, num_slots: int = 64):
        self.keys = torch.tensor(keys, dtype=torch.float32)[:, None, :]  # [T, 1, D]
        g = torch.Generator().manual_seed(1)
        self.vals = torch.randn(self.keys.shape[0], 1, D, generator=g)
        self.mem = MemorySide(KVPool(KVPoolConfig(1, num_slots, 1, D)), sparsity=config)
        self.params = AttentionParams(1.0)
        self.n = 0

    def slots(self, a, b):
        return torch.tensor([60 - p for p in range(a, b)], dtype=torch.int32)

    def step(self, q, new: int = 1):
        """Feed the next `new` positions (a prompt when new > 1) with queries q [new, D]."""
        a, b = self.n, self.n + new
        batch = SlotBatch.build([self.slots(0, b).tolist()], [new])
        q = torch.as_tensor(np.asarray(q, np.float32)).reshape(new, 1, D)
        o, _ = self.mem.attend(0, self.params, q, self.keys[a:b], self.vals[a:b],
                               self.slots(a, b), batch, seq_ids=(SID,))
        self.n = b
        return o

    def picked(self) -> list[int]:
        st = self.mem.sparsity.state[SID][0]
        return list(range(self.n)) if st.picked is None else st.picked.tolist()

    def check_output(self, o, q, picked):
        want = np_attention(np.asarray(q, np.float32).reshape(1, D),
                            self.keys[picked].numpy(), self.vals[picked].numpy())
        np.testing.assert_allclose(o[-1].numpy(), want, rtol=1e-5, atol=1e-6)


def e(i, a=1.0):
    x = np.zeros(D, np.float32)
    x[i] = a
    return x


def heavy_keys(T=20):
    """Keys along e0 with distinct weights: positions 5, 9, 3, 7 draw the most attention
    from q = e0, in that order, then the later ones (0.01 * position)."""
    keys = np.stack([e(0, 0.01 * p) for p in range(T)])
    for p, a in ((5, 4.0), (9, 3.0), (3, 2.0), (7, 1.8)):
        keys[p] = e(0, a)
    return keys


def test_streaming_keeps_sinks_and_the_recent_window():
    cfg = SparsityConfig("streaming", 6, sinks=2)
    r = Row(cfg, heavy_keys())
    r.step(np.stack([e(0)] * 19), new=19)
    o = r.step(e(0))
    st = r.mem.sparsity.state.get(SID)  # streaming keeps no state: check the output
    assert st is None
    r.check_output(o, e(0), [0, 1, 16, 17, 18, 19])


def test_h2o_keeps_heavy_hitters_and_evicts_for_good():
    cfg = SparsityConfig("h2o", 0.4, sinks=1, window=2, observe=4)
    r = Row(cfg, heavy_keys())
    r.step(np.stack([e(0)] * 12), new=12)  # prompt queries 8..11 score keys 0..11
    o = r.step(e(0))  # n = 13, t = ceil(0.4 * 13) = 6: sink, 3 heavy, 2 recent
    assert r.picked() == [0, 3, 5, 9, 11, 12]
    r.check_output(o, e(0), r.picked())
    for _ in range(3):  # n = 14..16, t = 6, 6, 7: the budget grows, but only new keys
        o = r.step(e(0))  # can use it: everything left out before is gone
    assert r.picked() == [0, 3, 5, 9, 13, 14, 15]
    r.check_output(o, e(0), r.picked())


def test_swa_may_select_a_dropped_key_again():
    cfg = SparsityConfig("swa", 0.4, sinks=1, window=2, observe=4)
    r = Row(cfg, heavy_keys())
    r.step(np.stack([e(0)] * 12), new=12)
    r.step(e(0))
    assert r.picked() == [0, 3, 5, 9, 11, 12]
    for _ in range(3):
        o = r.step(e(0))
    # t = 7 at n = 16: unlike h2o, key 7, left out since the prompt, is selected again
    # (its prompt mass, halved each step, still beats what 13 gathered as a recent key)
    assert r.picked() == [0, 3, 5, 7, 9, 14, 15]
    r.check_output(o, e(0), r.picked())


def np_snap(q, keys, kernel):
    """SnapKV's scores, NumPy: causal softmax of the window's queries over the prompt,
    summed, then the max over each position's `kernel` neighbours."""
    w, n = q.shape[0], keys.shape[0]
    s = q @ keys.T  # [w, n]
    for i in range(w):
        s[i, n - w + i + 1:] = -np.inf
    p = np.exp(s - s.max(1, keepdims=True))
    p = (p / p.sum(1, keepdims=True)).sum(0)
    h = kernel // 2
    return np.array([p[max(0, j - h):j + h + 1].max() for j in range(n)])


def test_snapkv_chooses_at_prefill_from_the_observation_window():
    g = np.random.default_rng(3)
    keys = g.standard_normal((16, D)).astype(np.float32)
    q = g.standard_normal((12, D)).astype(np.float32)
    cfg = SparsityConfig("snapkv", 7, sinks=1, window=2, observe=4, pool_kernel=3)
    r = Row(cfg, keys)
    r.step(q, new=12)  # the last 4 queries score keys 0..11
    st = r.mem.sparsity.state[SID][0]
    ref = np_snap(q[-4:].astype(np.float64), keys[:12].astype(np.float64), 3)
    np.testing.assert_allclose(st.score.numpy(), ref, rtol=1e-5)
    o = r.step(g.standard_normal(D))  # n = 13, t = 7: sink, 4 best prompt keys, 2 recent
    got = r.picked()
    # max-pooling makes plateaus: the 4 selected hold the 4 best scores of keys 1..10
    assert got[0] == 0 and got[-2:] == [11, 12] and len(got) == 7
    np.testing.assert_allclose(sorted(ref[got[1:5]]), sorted(ref[1:11])[-4:])
    for _ in range(3):  # decode keys beyond the recent window are not kept
        o = r.step(e(1))
    assert r.picked() == [*got[:5], 14, 15]
    r.check_output(o, e(1), r.picked())


class Layers:
    """One sequence on a two-layer pool (Hq = Hkv = 1), its position p at slot 60 - p;
    positions in `holes` are left out of its key list (their slots given back)."""

    def __init__(self, config: SparsityConfig, keys: list[np.ndarray]):
        self.keys = [torch.tensor(k, dtype=torch.float32)[:, None, :] for k in keys]
        g = torch.Generator().manual_seed(1)
        self.vals = [torch.randn(k.shape[0], 1, D, generator=g) for k in self.keys]
        self.mem = MemorySide(KVPool(KVPoolConfig(2, 64, 1, D)), sparsity=config)
        self.n, self.holes = 0, set()

    def step(self, q, new: int = 1) -> list[torch.Tensor]:
        a, b = self.n, self.n + new
        live = [p for p in range(b) if p not in self.holes]
        batch = SlotBatch.build([[60 - p for p in live]], [new],
                                [0] if self.holes else None, q_pos=[range(a, b)])
        q = torch.as_tensor(np.asarray(q, np.float32)).reshape(new, 1, D)
        new_slots = torch.tensor([60 - p for p in range(a, b)], dtype=torch.int32)
        outs = [self.mem.attend(i, AttentionParams(1.0), q, self.keys[i][a:b],
                                self.vals[i][a:b], new_slots, batch, seq_ids=(SID,))[0]
                for i in range(2)]
        self.n = b
        return outs

    def picked(self, layer: int) -> list[int]:
        """The positions the last step's row at `layer` attended."""
        live = [p for p in range(self.n) if p not in self.holes]
        st = self.mem.sparsity.state[SID][layer]
        return live if st.picked is None else [live[i] for i in st.picked.tolist()]


@pytest.mark.parametrize("policy", ["h2o", "snapkv"])
def test_keys_left_out_at_every_layer_are_reported_once_and_can_go(policy):
    """h2o / snapkv on two layers whose heavy keys differ: `take_dropped` reports the
    slots of the keys both layers left out (once each); with those positions then left
    out of the key list (as the engine does once it gives their slots back), every
    later step selects the same positions, and attends the same, as a copy of the row
    that keeps them."""
    k0 = heavy_keys()  # heavy at 5, 9, 3, 7
    k1 = heavy_keys()
    k1[3], k1[2], k1[7], k1[8] = e(0, 0.03), e(0, 2.0), e(0, 0.07), e(0, 1.8)  # 5, 9, 2, 8
    cfg = SparsityConfig(policy, 0.4, sinks=1, window=2, observe=4, pool_kernel=1)
    rows = [Layers(cfg, [k0, k1]) for _ in range(2)]
    for r in rows:
        r.step(np.stack([e(0)] * 12), new=12)
        r.step(e(0))  # n = 13, t = 6
    assert [rows[0].picked(i) for i in (0, 1)] == [[0, 3, 5, 9, 11, 12], [0, 2, 5, 9, 11, 12]]
    got = rows[0].mem.take_dropped()
    assert list(got) == [SID] and got[SID].tolist() == [60 - p for p in (1, 4, 6, 7, 8, 10)]
    assert rows[0].mem.take_dropped() == {}  # each key is reported once
    rows[1].holes = {1, 4, 6, 7, 8, 10}
    for q in (e(0), e(0), e(1), e(0)):  # n = 14..17, t = 6, 6, 7, 7
        outs = [r.step(q) for r in rows]
        for i in range(2):
            assert rows[1].picked(i) == rows[0].picked(i)
            torch.testing.assert_close(outs[1][i], outs[0][i])
    assert rows[1].mem.sparsity._keys[SID].gone == 6
    later = rows[0].mem.take_dropped()[SID].tolist()  # what the new steps dropped
    assert later and not set(later) & set(got[SID].tolist())
    assert rows[1].mem.take_dropped()[SID].tolist() == later


def test_topk_takes_the_pages_whose_bound_is_highest():
    g = np.random.default_rng(4)
    keys = 0.1 * g.standard_normal((17, D)).astype(np.float32)
    keys[9] = e(2, 5.0)  # page 2 (keys 8..11) holds the key q = e2 wants
    cfg = SparsityConfig("topk", 13, sinks=1, page_size=4, window=3)
    r = Row(cfg, keys)
    r.step(np.stack([e(0)] * 16), new=16)
    o = r.step(e(2))  # n = 17: page 0 (sinks), the best of pages 1-2, page 3 + the new key
    assert r.picked() == [0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    r.check_output(o, e(2), r.picked())


def test_topk_rescore_takes_the_best_keys_of_the_best_pages():
    """rescore 3 at a budget of 8: pages covering 24 keys are the candidates (the first
    page, the best 3 of pages 1-6 by their bounds, the tail 28-32); of those the best 4
    keys by exact attention join the sink and the 3 recent keys. Key 25 (page 6, the
    4th best page) outscores key 29 but is not a candidate."""
    g = np.random.default_rng(6)
    keys = 0.01 * g.standard_normal((34, D)).astype(np.float32)
    for p, a in ((9, 5.0), (13, 4.0), (22, 3.0), (25, 2.0), (29, 1.0)):
        keys[p] = e(2, a)
    r = Row(SparsityConfig("topk", 8, sinks=1, page_size=4, window=3, rescore=3.0), keys)
    r.step(np.stack([e(0)] * 32), new=32)
    o = r.step(e(2))  # n = 33
    assert r.picked() == [0, 9, 13, 22, 29, 30, 31, 32]
    r.check_output(o, e(2), r.picked())


def test_rescored_ranks_by_the_heads_summed_softmax():
    """Every key a candidate: the selection is the top keys by each head's softmax over
    them, summed over heads (NumPy), with the sinks and the recent window."""
    from lamina.memory.sparsity import RowQuery, rescored

    g = np.random.default_rng(7)
    n, t = 40, 10
    keys = g.standard_normal((n, 1, D)).astype(np.float32)
    q = 2 * g.standard_normal((3, D)).astype(np.float32)  # 3 query heads on one kv head
    s = np.einsum("hd,nd->hn", q, keys[:, 0]) * 0.5
    p = np.exp(s - s.max(-1, keepdims=True))
    score = (p / p.sum(-1, keepdims=True)).sum(0)
    score[:2] = score[-3:] = -np.inf  # the sinks and the recent keys are kept anyway
    want = sorted([0, 1, n - 3, n - 2, n - 1, *np.argsort(-score)[:t - 5].tolist()])
    got = rescored(RowQuery(torch.tensor(q), 0.5), np.arange(n, dtype=np.int32), n,
                   t, 2, 3, torch.arange(n), torch.tensor(keys), None)
    assert got.tolist() == want


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_candidate_logits_match_numpy(softcap):
    """topk rescoring's logits over scattered slots of a pool (3 query heads a kv head),
    read in place by the C++ kernel: an fp32 pool against NumPy, an int8 pool (codes,
    head scales, channel-smoothed keys) against NumPy over its dequantized keys, and
    near the true keys."""
    from lamina.memory.sparsity import RowQuery, candidate_logits

    g = np.random.default_rng(8)
    hkv, d = 2, 64
    pool = KVPool(KVPoolConfig(1, 300, hkv, d))
    keys = torch.tensor(g.standard_normal((300, hkv, d)), dtype=torch.float32)
    pool.write(0, torch.arange(300), keys, torch.zeros(300, hkv, d))
    q = g.standard_normal((3 * hkv, d)).astype(np.float32)
    slots = torch.tensor(g.permutation(300)[:77], dtype=torch.int32)
    want = np.einsum("hd,chd->hc", q.astype(np.float64),
                     np.repeat(keys[slots.long()].numpy(), 3, axis=1)) * 0.3
    if softcap:
        want = softcap * np.tanh(want / softcap)
    query = RowQuery(torch.tensor(q), 0.3, softcap)
    got = candidate_logits(query, pool.layer(0)[0], slots, None)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)
    channel = tuple(g.uniform(0.5, 2.0, hkv * d).tolist())  # keys' channel scales
    quant = KVPool(KVPoolConfig(1, 300, hkv, d, dtype="int8", key_scales=channel))
    quant.write(0, torch.arange(300), keys, torch.zeros(300, hkv, d))
    kq, scales = quant.layer(0)[0], quant.key_scales[0]
    deq = dequantize_rows(kq[slots.long()], scales).numpy().astype(np.float64)
    want_q = np.einsum("hd,chd->hc", q.astype(np.float64), np.repeat(deq, 3, axis=1)) * 0.3
    if softcap:
        want_q = softcap * np.tanh(want_q / softcap)
    got = candidate_logits(query, kq, slots, scales)
    np.testing.assert_allclose(got.numpy(), want_q, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got.numpy(), want, rtol=0.05, atol=0.15)  # int8 keys


def test_topk_page_bounds_match_numpy_and_follow_changed_slots():
    g = np.random.default_rng(5)
    keys = g.standard_normal((32, 3, D)).astype(np.float32)
    b = page_bounds(torch.tensor(keys), 8)  # [4, 2, Hkv, D]
    np.testing.assert_array_equal(b[:, 0].numpy(), keys.reshape(4, 8, 3, D).min(1))
    np.testing.assert_array_equal(b[:, 1].numpy(), keys.reshape(4, 8, 3, D).max(1))
    q = g.standard_normal((6, D)).astype(np.float32)  # 2 query heads per kv head
    mn, mx = keys.reshape(4, 8, 3, D).min(1), keys.reshape(4, 8, 3, D).max(1)
    qh = q.reshape(3, 2, D)
    ref = np.array([sum(np.maximum(qh[h, j] * mn[p, h], qh[h, j] * mx[p, h]).sum()
                        for h in range(3) for j in range(2)) for p in range(4)])
    np.testing.assert_allclose(page_scores(torch.tensor(q), b).numpy(), ref, rtol=1e-5)
    # a table whose page 1 moved to other slots (a fork's copy): rebuilt from there
    from lamina.memory.sparsity import Sparsifier

    sp = Sparsifier(SparsityConfig("topk", 8, page_size=8), 1)
    pool = KVPool(KVPoolConfig(1, 64, 3, D))
    pool.write(0, torch.arange(64), torch.randn(64, 3, D), torch.randn(64, 3, D))
    kp, _ = pool.layer(0)
    st = sp._layer(0, 0)
    first = np.arange(33, dtype=np.int32)
    sp._pages(st, first, 33, kp, None)
    moved = first.copy()
    moved[8:16] = np.arange(40, 48)
    got = sp._pages(st, moved, 33, kp, None)
    want = page_bounds(kp[torch.from_numpy(moved[:32]).long()], 8).flatten(1)  # as rows
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_pick_and_snap_scores_on_hand_built_scores():
    score = torch.tensor([9.0, 0, 0, 0, 0, 5, 0, 0, 0, 4, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0])
    assert pick(20, 8, 2, 3, score).tolist() == [0, 1, 5, 9, 12, 17, 18, 19]
    assert pick(20, 6, 2, 4).tolist() == [0, 1, 16, 17, 18, 19]  # streaming
    assert pick(5, 9, 2, 3, score).tolist() == [0, 1, 2, 3, 4]  # budget >= context
    probs = torch.zeros(1, 1, 10)
    probs[0, 0, 4] = 1.0
    assert snap_scores(probs, 3).tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0]


def test_layer_budgets():
    f = layer_fractions(0.5, np.array([3.0, 1.0]))
    np.testing.assert_allclose(f, [0.75, 0.25])
    f = layer_fractions(0.8, np.array([3.0, 1.0]))  # 1.2 capped at 1: the rest goes on
    np.testing.assert_allclose(f, [1.0, 0.6])
    assert SparsityConfig("h2o", 0.2, "pyramid").weights(3).tolist() == [1.5, 1.0, 0.5]
    w = SparsityConfig("h2o", 0.2, "entropy", layer_weights=(2.0, 1.0, 3.0)).weights(3)
    np.testing.assert_allclose(w, [1.0, 0.5, 1.5])
    with pytest.raises(ValueError, match="'entropy' needs the measured layer_weights"):
        SparsityConfig("h2o", 0.2, "entropy").weights(3)
    # concentration: the inverse entropies' square roots (0.70711, 1, 0.57735), mean
    # 0.76149; at power 1 they would be (1/2, 1, 1/3), mean 11/18
    w = SparsityConfig("h2o", 0.2, "concentration", layer_weights=(2.0, 1.0, 3.0)).weights(3)
    np.testing.assert_allclose(w, [0.928588, 1.313222, 0.758189], rtol=1e-5)
    with patch("lamina.memory.sparsity_config.CONCENTRATION_POWER", 1.0):
        w = SparsityConfig("h2o", 0.2, "concentration", layer_weights=(2.0, 1.0, 3.0))
        np.testing.assert_allclose(w.weights(3), [9 / 11, 18 / 11, 6 / 11])
    with pytest.raises(ValueError, match="'concentration' needs the measured layer_weights"):
        SparsityConfig("h2o", 0.2, "concentration").weights(3)


def test_concentration_budgets_follow_the_inverse_of_each_layers_attention_entropy(smol):
    """`sparsity_for` measures each layer's attention entropy once (SmolLM2, HF eager
    attentions) for `concentration`: the layer whose attention is most concentrated gets
    the largest share, the shares are the inverse entropies scaled to the budget's
    mean, and a uniform config comes back as it was."""
    from lamina.model.prepare import attention_entropy, sparsity_for

    L = smol.config.num_hidden_layers
    ent = np.asarray(attention_entropy(smol.model, smol.tokenizer, L))
    assert ent.shape == (L,) and ((ent > 0) & (ent <= 1)).all()
    cfg = sparsity_for(SparsityConfig("topk", 0.2, "concentration"), smol.model,
                       smol.tokenizer, L)
    np.testing.assert_allclose(cfg.layer_weights, ent)
    f = layer_shares(cfg, L)
    assert abs(f.mean() - 0.2) < 1e-9 and int(np.argmax(f)) == int(np.argmin(ent))
    root = 1 / np.sqrt(ent)  # CONCENTRATION_POWER 0.5
    np.testing.assert_allclose(f, 0.2 * root / root.mean())
    plain = SparsityConfig("topk", 0.2)
    assert sparsity_for(plain, smol.model, smol.tokenizer, L) is plain


@pytest.mark.parametrize("kw, match", [
    (dict(policy="sparse"), "unknown KV sparsity policy 'sparse'"),
    (dict(policy="h2o", budget=0), "budget must be > 0 tokens"),
    (dict(policy="h2o", budget=-0.5), r"fraction must be in \(0, 1\]"),
    (dict(policy="h2o", budget=1), r"budget of 1 tokens does not cover the 4 sinks.*1.0, "
                                   r"not 1"),
    (dict(policy="h2o", budget=1.5), r"fraction must be in \(0, 1\]"),
    (dict(policy="h2o", budget="half"), "budget must be a fraction"),
    (dict(policy="streaming", budget=64, window=64), r"window \(64\) \+ sinks \(4\) is "
                                                      r"larger than the budget \(64"),
    (dict(policy="topk", budget=0.2, layer_budgets="cubic"), "unknown KV sparsity "
                                                             "layer_budgets 'cubic'"),
    (dict(policy="topk", budget=0.2, page_size=0), "page_size must be an int >= 1"),
    (dict(policy="topk", budget=0.2, rescore=0.5), r"rescore must be 0 \(off\) or a "
                                                   r"multiple >= 1"),
])
def test_bad_configuration_is_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        SparsityConfig(**kw)


def test_engine_config_names_the_sparsity_fields():
    with pytest.raises(ValueError, match="EngineConfig.kv_sparsity.*unknown KV sparsity "
                                         "policy 'quest'"):
        EngineConfig(kv_sparsity="quest")
    with pytest.raises(ValueError, match="EngineConfig.*budget must be > 0 tokens"):
        EngineConfig(kv_sparsity="topk", kv_budget=0)
    assert not EngineConfig(kv_sparsity="topk", kv_budget=1.0).sparsity.enabled
    assert EngineConfig(kv_sparsity="topk", kv_budget=0.2,
                        kv_topk_rescore=3).sparsity.rescore == 3
    with pytest.raises(ValueError, match="EngineConfig.*kv_topk_rescore.*rescore must be"):
        EngineConfig(kv_sparsity="topk", kv_budget=0.2, kv_topk_rescore=-1)


def sparse_engine(smol, split, config: SparsityConfig, slots=SLOTS, **engine):
    """An engine whose memory side runs `config`; `engine`: EngineConfig fields (its own
    kv_sparsity / kv_budget, which the scheduler's eviction follows, default dense)."""
    cfg = EngineConfig(num_kv_slots=slots, **engine)
    pool = KVPool(KVPoolConfig.for_specs(split.attention_specs, slots))
    return LLMEngine(cfg, LocalExecutor(split, [MemorySide(pool, sparsity=config)]),
                     smol.tokenizer, smol.config)


GREEDY = SamplingParams(max_tokens=HF_NEW, temperature=0.0, ignore_eos=True)


def run(eng, prompts, params=GREEDY):
    """All prompts at once; their finished outputs in prompt order."""
    ids = [eng.add_request(p, params) for p in prompts]
    done = {}
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    return [done[i] for i in ids]


def test_budget_at_or_above_the_context_is_dense(smol, smol_packed, prompts, hf_greedy):
    """Every policy, active (a token budget) but never below a row's context: HF's greedy
    tokens on 10 of the mixed-length prompts (5 to 300 tokens; the whole set's exactness
    is the dense tests'), each policy on two of them (the deployment's h2o, the others a
    request's own), in one batch."""
    policies = ("streaming", "h2o", "snapkv", "topk", "swa")
    pick = [0, 1, 2, 3, 4, 5, 6, 9, 10, 11]
    eng = sparse_engine(smol, smol_packed, SparsityConfig("h2o", 4096))
    ids = [eng.add_request(prompts[i], SamplingParams(
        max_tokens=HF_NEW, temperature=0.0, ignore_eos=True, kv_budget=4096,
        kv_sparsity=policies[k % 5])) for k, i in enumerate(pick)]
    done, seen = {}, set()  # seen: the requests' own policies, active on the worker
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
        seen |= {p.config.policy for p in eng.executor.memory[0].sparsity._own.values()}
    assert seen == set(policies) - {"h2o"}
    for k, (i, rid) in enumerate(zip(pick, ids)):
        assert done[rid].token_ids == hf_greedy[i], policies[k % 5]


@pytest.fixture(scope="module")
def streaming96(smol, smol_packed, prompts):
    """Every prompt's greedy tokens on a deployment whose policy is streaming at 96
    tokens keeping every slot (the reference three tests compare with)."""
    return [o.token_ids for o in run(sparse_engine(smol, smol_packed,
                                                   SparsityConfig("streaming", 96)), prompts)]


def test_rows_under_budget_stay_exact_beside_cut_ones(streaming96, prompts, hf_greedy):
    """A budget of 96 tokens: the prompts whose context never exceeds it decode exactly
    as HF while the long ones, in the same batches, attend to a selection (and their
    tokens change)."""
    outs = streaming96
    short = [i for i, p in enumerate(prompts) if len(p) + HF_NEW <= 96]
    assert short and all(outs[i] == hf_greedy[i] for i in short)
    long = [i for i, p in enumerate(prompts) if len(p) >= 300]
    assert sum(outs[i] != hf_greedy[i] for i in long) >= len(long) // 2


def test_released_sequences_drop_their_state():
    cfg = SparsityConfig("h2o", 4, sinks=1, window=1)
    r = Row(cfg, heavy_keys())
    r.step(np.stack([e(0)] * 6), new=6)
    r.step(e(0))
    assert SID in r.mem.sparsity.state
    r.mem.release([SID])
    assert SID not in r.mem.sparsity.state


def test_decode_perplexity_equals_prompt_logprobs_when_dense(smol, smol_packed):
    """The kv-quality harness's teacher-forced decode NLL equals the prompt
    log-probabilities of the same tokens (dense: both attend to everything)."""
    from lamina.bench.kv_quality import decode_perplexity

    class _LLM:  # what decode_perplexity reads of an LLM
        executor = LocalExecutor(smol_packed, [MemorySide(KVPool(KVPoolConfig.for_specs(
            smol_packed.attention_specs, 4096)))])

    ids = smol.tokenizer("The history of the printing press begins in the fifteenth "
                         "century, when movable type changed how knowledge spread. " * 6
                         )["input_ids"][:120]
    wins = [ids[:100], ids[10:110]]
    got = decode_perplexity(_LLM, wins, 60, batch=2)
    eng = sparse_engine(smol, smol_packed, SparsityConfig())
    outs = run(eng, wins, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    ref = [-lp.logprob for o in outs for lp in o.prompt_logprobs[60:]]
    assert got["tokens"] == len(ref) == 80
    assert got["nll"] == pytest.approx(sum(ref) / len(ref), rel=1e-4)
    assert got["ppl"] == pytest.approx(math.exp(sum(ref) / len(ref)), rel=1e-4)


def test_request_override_on_its_own_sequence():
    """A request's own policy (`KVOverride`) on a worker whose deployment is dense: the
    worker makes a dense Sparsifier to hold it, the sequence follows the override's
    selection (h2o's heavy hitters, as in the deployment-wide test), a sequence without
    one stays dense, and releasing the sequence drops both."""
    from lamina.memory.sparsity_config import KVOverride

    r = Row(SparsityConfig(sinks=1), heavy_keys())
    assert r.mem.sparsity is None
    r.mem.override({SID: KVOverride("h2o", 4)})
    st = r.mem.sparsity
    assert st.active and not st.config.enabled and st.policy(SID).config.policy == "h2o"
    assert st.policy(SID + 1).config.policy == "dense"
    assert st.policy(SID).config.sinks == 1 and st.policy(SID).config.window == 0.5
    r.mem.override({SID: KVOverride("h2o", 4)})  # the same again: nothing changes
    r.mem.sparsity.override(SID, KVOverride("h2o", 4))
    ref = Row(SparsityConfig("h2o", 4, sinks=1), heavy_keys())
    for row in (r, ref):
        row.step(np.stack([e(0)] * 6), new=6)
        for _ in range(3):
            o = row.step(e(0))
    assert r.picked() == ref.picked() and r.picked() != list(range(r.n))
    r.check_output(o, e(0), r.picked())
    r.mem.release([SID])
    assert not st.active and SID not in st.state


def test_kv_override_wire_rows_and_checks():
    from lamina.memory.sparsity_config import FRACTION_UNIT, KVOverride

    for ov in (KVOverride("topk", 0.2), KVOverride(None, 64), KVOverride("streaming"),
               KVOverride(budget=1.0)):
        sid, back = KVOverride.decode(ov.encode(12345))
        assert (sid, back) == (12345, ov)
    assert KVOverride("topk", 0.2).encode(3) == (3, 4, 0, FRACTION_UNIT // 5)
    with pytest.raises(ValueError, match="bad KV sparsity override row"):
        KVOverride.decode((1, 99, 0, 0))
    with pytest.raises(ValueError, match="unknown KV sparsity policy 'sparse'"):
        KVOverride("sparse")
    with pytest.raises(ValueError, match=r"SamplingParams.kv_budget: .*must be > 0 tokens"):
        SamplingParams(kv_sparsity="topk", kv_budget=0)
    with pytest.raises(ValueError, match=r"SamplingParams.kv_sparsity: unknown KV sparsity"):
        SamplingParams(kv_sparsity="quest")
    base = SparsityConfig("h2o", 0.5, layer_budgets="pyramid")
    got = KVOverride("topk").resolve(base)
    assert (got.policy, got.budget, got.layer_budgets, got.window) == ("topk", 0.5,
                                                                       "pyramid", 0.25)


def test_request_override_in_a_mixed_batch(smol, smol_packed, prompts, hf_greedy,
                                          streaming96):
    """On a dense deployment, the even prompts ask for streaming at 96 tokens and the odd
    ones take the default, all in the same batches: the even ones decode exactly as on a
    deployment whose policy is streaming at 96, the odd ones as HF. A budget without a
    policy on a dense deployment is refused by name."""
    want = streaming96
    eng = sparse_engine(smol, smol_packed, SparsityConfig())
    own = SamplingParams(max_tokens=HF_NEW, temperature=0.0, ignore_eos=True,
                         kv_sparsity="streaming", kv_budget=96)
    ids = [eng.add_request(p, own if i % 2 == 0 else GREEDY) for i, p in enumerate(prompts)]
    done = {}
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    got = [done[i].token_ids for i in ids]
    assert got[0::2] == want[0::2] and got[1::2] == hf_greedy[1::2]
    assert any(got[i] != hf_greedy[i] for i in range(0, 16, 2))  # the override cut rows
    with pytest.raises(ValueError, match="kv_budget=0.2 without kv_sparsity changes nothing"):
        eng.add_request(prompts[0], SamplingParams(kv_budget=0.2))


@pytest.mark.parametrize("policy,budget", [("streaming", 16), ("topk", 0.3)])
def test_a_prompt_answers_alike_from_a_cached_prefix_or_in_chunks(smol, smol_packed,
                                                                   prompts, policy, budget):
    """Memory workers cut one-query rows (decode rows). A prompt's last position fed
    alone, after a cached prefix or as a chunk's one-token tail, was cut like one, and
    the request answered otherwise than fed whole. Now such a prompt feeds its last two
    positions: the same tokens from a prefix cached by a dense request (all but 2 of its
    40 tokens reused) and chunked 39 + 1 (fed 38 + 2), and not the dense answer."""
    from tests.lamina.test_engine import engine, run

    p = prompts[2]  # 40 tokens
    own = SamplingParams(max_tokens=12, temperature=0, kv_sparsity=policy, kv_budget=budget)
    whole = run(engine(smol, smol_packed), [p], own)[0].token_ids
    eng = engine(smol, smol_packed)
    dense = run(eng, [p], SamplingParams(max_tokens=12, temperature=0))[0].token_ids
    cached = run(eng, [p], own)[0]
    assert cached.token_ids == whole and cached.metrics["cached_tokens"] == len(p) - 2
    assert run(engine(smol, smol_packed, max_step_tokens=len(p) - 1), [p],
               own)[0].token_ids == whole
    assert whole != dense  # the policy cut the decode rows


def test_a_dense_request_does_not_reuse_the_kv_a_sparse_decode_wrote(smol, smol_packed,
                                                                     prompts):
    """A sparse request's decode rows attend to a selection of keys, so the KV they write
    (every layer past the first) is not what a whole prompt writes. The prefix cache
    kept it with the request's tokens, and a dense request whose prompt went on from
    them reused it: its logprobs moved by up to 5% from its run alone (the local random
    workload's seed 433). Only a sparse request's prompt is cached: the dense request
    reuses that and answers as alone."""
    from tests.lamina.test_engine import engine, run

    p = prompts[2]  # 40 tokens
    eng = engine(smol, smol_packed)
    sparse = run(eng, [p], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                          kv_sparsity="topk", kv_budget=0.25))[0]
    q = p + sparse.token_ids[:20]  # its prompt, then 20 tokens its decode rows wrote
    dense = SamplingParams(max_tokens=8, temperature=0, logprobs=1)
    got = run(eng, [q], dense)[0]
    alone = run(engine(smol, smol_packed), [q], dense)[0]
    lp = [[t.logprob for t in o.outputs[0].logprobs] for o in (got, alone)]
    assert max(abs(a - b) for a, b in zip(*lp)) < 1e-4, lp
    assert got.token_ids == alone.token_ids
    assert got.metrics["cached_tokens"] == len(p)


def test_overrides_cross_a_connection_once():
    """The compute end sends a sequence's override to a memory worker once (and again
    after the sequence was released there)."""
    from lamina.dataplane.tables import SentTables
    from lamina.memory.sparsity_config import KVOverride

    t, ov = SentTables(), {1: KVOverride("topk", 0.2), 2: KVOverride("h2o")}
    assert t.new_overrides(ov, [1, 2, 3]) == [ov[1].encode(1), ov[2].encode(2)]
    assert t.new_overrides(ov, [1, 2, 3]) == []
    t.release([1])
    assert t.new_overrides(ov, [2, 1]) == [ov[1].encode(1)]


def test_streaming_gives_back_slots_and_answers_as_keeping_them(smol, smol_packed, prompts,
                                                                streaming96):
    """streaming at 96 tokens: the scheduler gives back the slots of positions 4 up to
    the window (92 keys before the newest) once 64 or more can go, and the answers equal
    those of the same policy keeping every slot (the freed slots are reused for new
    tokens at once, so attending to one would change them). Prefix caching off: it
    would hold the prompts' slots until the pool needs them."""
    cfg = SparsityConfig("streaming", 96)
    kw = dict(kv_sparsity="streaming", kv_budget=96, prefix_caching=False)
    keep = streaming96
    eng = sparse_engine(smol, smol_packed, cfg, **kw)
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    done = {}
    eng.step()  # every prompt prefilled in one step
    eng.step()  # the first decode step gives back what streaming will never read
    live, gone = 0, 0
    for seq in eng.scheduler.running:
        n = seq.num_tokens - 1  # the positions with KV after that step
        want = (4, n - 92) if n - 92 - 4 >= 64 else (0, 0)
        assert seq.evicted == want, (len(seq.prompt), seq.evicted)
        table = eng.alloc.slots(seq.seq_id)
        assert table.count(-1) == want[1] - want[0] and -1 not in table[:4] + table[want[1]:]
        live, gone = live + n, gone + want[1] - want[0]
    assert eng.alloc.stats().used == live - gone and gone > live // 2
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert [done[i].token_ids for i in ids] == keep
    assert eng.alloc.stats().used == 0


def test_h2o_and_snapkv_give_back_slots_and_answer_as_keeping_them(smol, smol_packed, prompts):
    """h2o at 25% deployment-wide, snapkv at 25% as the odd prompts' own policy: the
    memory worker reports the keys every layer left out for good, the scheduler gives
    their slots back (64 or more at a time: holes in the tables, the slots free), and
    the answers equal those of the same policies keeping every slot. Six prompts of 9 to
    250 tokens, each policy on three (the whole set's exactness is the dense tests')."""
    cfg = SparsityConfig("h2o", 0.25)
    kw = dict(kv_sparsity="h2o", kv_budget=0.25, prefix_caching=False)
    snap = replace(GREEDY, kv_sparsity="snapkv", kv_budget=0.25)
    prompts = [prompts[i] for i in (1, 4, 5, 9, 13, 14)]  # 12, 128, 200, 9, 150, 250
    params = [snap if i % 2 else GREEDY for i in range(len(prompts))]

    def answers(eng, check=None):
        ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        done = {}
        while eng.has_unfinished():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
            if check:
                check(eng)
        return [done[i].token_ids for i in ids]

    keep = answers(sparse_engine(smol, smol_packed, cfg, kv_evict=False, **kw))
    seen = {"h2o": 0, "snapkv": 0}

    def check(eng):  # each running sequence's table: holes exactly where given back
        live = 0
        for seq in eng.scheduler.running:
            table = eng.alloc.slots(seq.seq_id)
            holes = [p for p, x in enumerate(table) if x < 0]
            assert (holes[0] if holes else -1) == seq.first_dropped and seq.evicted == (0, 0)
            live += len(table) - len(holes)
            seen[seq.params.kv_sparsity or "h2o"] = max(seen[seq.params.kv_sparsity or "h2o"],
                                                        len(holes))
        assert eng.alloc.stats().used == live

    eng = sparse_engine(smol, smol_packed, cfg, **kw)
    assert answers(eng, check) == keep
    assert seen["h2o"] >= 64 and seen["snapkv"] >= 64, seen
    assert eng.alloc.stats().used == 0
