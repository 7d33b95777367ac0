"""Analytic model and optimizer: hand-computed estimates, exhaustive-search agreement,
the TPOT bound, MFU calibration, and the paper's Figure 1 comparison (printed)."""
import itertools
import math

import pytest

from lamina.costmodel.analytic import (
    Cell,
    Efficiency,
    alpha_device,
    best,
    estimate,
    fraction_grid,
    max_batch,
    net_bytes_per_token,
)
from lamina.costmodel.catalog import MODELS, default_mfu, load_catalog

CAT = load_catalog()
A100, RTX = CAT["a100-80g"], CAT["rtx3090"]
M13 = MODELS["llama-13b"]


def test_homogeneous_estimate_by_hand():
    e = estimate(M13, Cell(A100, 1), 64, 512)
    kv_tok = 2 * 40 * 40 * 128 * 2  # K and V, layers, heads, head_dim, bf16
    dense = 2 * 13.0e9 * 64 / (0.6 * 64 / (64 + 180) * 312e12)
    attn = 64 * 512 * kv_tok / (1935e9 * 0.8)
    assert e.dense_s == pytest.approx(dense, rel=1e-12)
    assert e.attention_s == pytest.approx(attn, rel=1e-12)
    assert e.network_s == 0 and e.iteration_s == pytest.approx(dense + attn, rel=1e-12)
    assert e.tokens_per_s_per_kusd == pytest.approx(64 / (dense + attn) / 17.5, rel=1e-12)
    # capacity: 90% of 80 GB minus 26 GB of weights, in 512-token requests
    assert e.max_batch == math.floor((0.9 * 80e9 - 26.0e9) / (kv_tok * 512)) == 109
    assert estimate(M13, Cell(A100, 1), 110, 512) is None


def test_offloaded_estimate_by_hand():
    cell = Cell(A100, 1, RTX, 4)
    e = estimate(M13, cell, 128, 512)
    dense = 2 * 13.0e9 * 128 / (0.6 * 128 / 308 * 312e12)
    attn = 128 * 512 * M13.kv_bytes_per_token() / (4 * 936.2e9 * 0.8)
    net = 128 * 40 * 4 * 5120 * 2 / (min(25, 4 * 12.5) * 1e9 * 0.9)
    assert net_bytes_per_token(M13) == 40 * 4 * 5120 * 2  # the paper's 4edL for MHA
    assert e.iteration_s == pytest.approx(dense + max(attn, net) + 40 * 33e-6, rel=1e-12)
    assert max_batch(M13, cell, 512, Efficiency()) == int(4 * 24e9 * 0.9 // (819200 * 512))
    assert estimate(M13, cell, 206, 512) is None  # 205 requests fit in 4 x 24 GB
    rot = estimate(M13, Cell(A100, 1, RTX, 4, "rotational"), 128, 512)
    d, a, n = (dense_of(64), 64 * 512 * 819200 / (4 * 936.2e9 * 0.8),
               64 * 409600 / (25e9 * 0.9))
    assert rot.iteration_s == pytest.approx(max(2 * d, 2 * (max(a, n) + 40 * 33e-6)), rel=1e-12)
    # paper 6.1: staggering pays only when attention is comparable to the dense part;
    # here the halves' lower MFU costs more than the overlap saves
    assert rot.tokens_per_s < e.tokens_per_s
    long = [estimate(M13, Cell(A100, 1, RTX, 8, p), 50, 4096) for p in ("none", "rotational")]
    assert long[1].tokens_per_s > 1.05 * long[0].tokens_per_s


def dense_of(b):
    return 2 * 13.0e9 * b / (0.6 * b / (b + 180) * 312e12)


def test_default_mfu_matches_cost_module():
    assert Efficiency().mfu(256, 4) == pytest.approx(default_mfu(256, 4))


def test_fit_mfu_recovers_constants():
    truth = Efficiency(mfu_max=0.42, b_half=37.0)
    fit = Efficiency.fit_mfu([(b, truth.mfu(b)) for b in (1, 4, 16, 64)])
    assert fit.mfu_max == pytest.approx(0.42) and fit.b_half == pytest.approx(37.0)
    with pytest.raises(ValueError, match=">= 2 batch sizes"):
        Efficiency.fit_mfu([(8, 0.1)])
    with pytest.raises(ValueError, match="mbu"):
        Efficiency(mbu=1.5)


def test_optimizer_equals_exhaustive_search_and_respects_slo():
    ms, tps, batches = (1, 2, 3, 6, 12), (1, 2, 4), (16, 64, 128, 256, 512, 1024, 2048)
    for slo in (None, 0.06):
        got = best(M13, A100, 2048, RTX, ms, tps=tps, tpot_slo_s=slo, batches=batches)
        cands = [estimate(M13, Cell(A100, tp, RTX, m, p), b, 2048)
                 for tp, m, p, b in itertools.product(tps, ms, ("none", "rotational"), batches)]
        cands = [c for c in cands if c and (slo is None or c.iteration_s <= slo)]
        want = max(cands, key=lambda c: c.tokens_per_s_per_kusd)
        assert got.tokens_per_s_per_kusd == want.tokens_per_s_per_kusd
        assert slo is None or got.iteration_s <= slo
    assert best(M13, A100, 512, RTX, ms, tpot_slo_s=1e-4) is None  # nothing that fast


def test_figure1_offloading_gain(capsys):
    """Paper Figure 1: A100s vs A100s + memory units with alpha = 3.27 (same price as an
    A100, 3.27x its capacity and bandwidth). Paper: 2.1-2.8x at context 512, more at 4096.
    Our model's gains are printed; see the issue note for why 512 comes out lower."""
    unit = alpha_device(A100, 3.27)
    assert unit.memory_gb == pytest.approx(261.6) and unit.price_usd == A100.price_usd
    lines, gains = [], {}
    for m, ctx in itertools.product(("llama-13b", "llama-33b", "llama-65b"), (512, 4096)):
        h = best(MODELS[m], A100, ctx)
        o = best(MODELS[m], A100, ctx, unit, fraction_grid())
        gains[m, ctx] = o.tokens_per_s_per_kusd / h.tokens_per_s_per_kusd
        lines.append(f"{m} context {ctx}: {gains[m, ctx]:.2f}x (homogeneous {h.cell.tp} x A100 "
                     f"B={h.batch}; offloaded {o.cell.tp} x A100 + {o.cell.m:.2f} units, "
                     f"{o.cell.pipeline}, B={o.batch})")
    with capsys.disabled():
        print("\nFigure 1 (paper: 2.1-2.8x at 512):\n" + "\n".join(lines))
    for m in ("llama-13b", "llama-33b", "llama-65b"):
        assert gains[m, 4096] > gains[m, 512]  # wider at long context, as in the paper
        assert gains[m, 4096] > 1.5
    assert fraction_grid(1, 4, 1) == (1, 2, 4)


def test_efficiency_from_bench_ops_timings():
    """`lamina bench ops` timings generated from a known MFU curve give it back."""
    truth, params, peak, L = Efficiency(mfu_max=0.3, b_half=20.0), 1.0e8, 0.08, 30
    calib = {"layers": L, "dense_layer_s": {}, "head_s": {}}
    for b in (1, 4, 16, 64):
        total = 2 * params * b / (truth.mfu(b) * peak * 1e12)
        calib["dense_layer_s"][str(b)] = 0.8 * total / L
        calib["head_s"][str(b)] = 0.2 * total
    fit = Efficiency.from_ops(calib, params, peak, mbu=0.5)
    assert fit.mfu_max == pytest.approx(0.3) and fit.b_half == pytest.approx(20.0)
    assert fit.mbu == 0.5
