"""INT8 KV rows: quantization against a NumPy reference, the compiled kernel on int8
pools against the reference backend, and both against NumPy attention over the
dequantized values (independent math)."""
import numpy as np
import pytest
import torch

from lamina.costmodel.workload import scattered_tables
from lamina.kernels import (
    AttentionInputError,
    AttentionParams,
    ReferenceBackend,
    SlotBatch,
    attend,
    prefill_attention,
    write_kv,
)
from lamina.kernels.quant import (
    SCALE_BYTES,
    dequantize_rows,
    fold_channels,
    head_dim,
    quantize_rows,
    row_scales,
)

REF = ReferenceBackend()
D = 64


def np_quantize(x: np.ndarray, c: np.ndarray | None):
    """x [N, H, D] -> (codes int8 [N, H, D], scales fp32 [N, H]), written from the
    grouping's definition: per (token, head), after dividing channels by c."""
    y = x.astype(np.float32) / (1.0 if c is None else c.astype(np.float32))
    s = np.abs(y).max(axis=-1) / np.float32(127.0)
    codes = np.rint(y / np.where(s > 0, s, 1)[..., None]).clip(-127, 127).astype(np.int8)
    return codes, s.astype(np.float32)


@pytest.mark.parametrize("with_channels", [False, True])
def test_quantize_rows_match_numpy_and_round_trip_within_half_a_step(with_channels):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, D, generator=g) * torch.linspace(0.1, 8, D)  # outlier channels
    x[7] = 0  # an all-zero token: scale 0, codes 0, back to exact zeros
    c = torch.rand(3, D, generator=g) * 4 + 0.25 if with_channels else None
    rows = quantize_rows(x, c)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, D + SCALE_BYTES)
    assert head_dim(rows) == D
    codes, s = np_quantize(x.numpy(), None if c is None else c.numpy())
    assert np.array_equal(rows[..., :D].numpy(), codes)
    assert np.allclose(row_scales(rows).numpy(), s, rtol=1e-7, atol=0)
    back = dequantize_rows(rows, c).numpy()
    cc = 1.0 if c is None else c.numpy()
    step = s[..., None] * cc  # one code's worth, per element
    assert np.all(np.abs(back - x.numpy()) <= step / 2 * (1 + 1e-5) + 1e-12)
    assert np.all(back[7] == 0)
    # the largest |x / c| of each row is exact up to float rounding (code +-127)
    assert np.array_equal(np.abs(codes).max(-1)[np.arange(50) != 7], np.full((49, 3), 127))


def test_channel_scales_cut_the_error_of_outlier_channels():
    """Keys with a few large channels: dividing by the channel scales first brings the
    small channels' error down by far more than the large ones lose."""
    g = torch.Generator().manual_seed(1)
    mag = torch.ones(D)
    mag[[3, 40]] = 30.0
    k = torch.randn(400, 2, D, generator=g) * mag
    c = mag.expand(2, D)
    small = mag == 1

    def err(back):  # relative error of the ordinary channels
        return ((back - k)[..., small].norm() / k[..., small].norm()).item()

    plain, smooth = err(dequantize_rows(quantize_rows(k))), err(dequantize_rows(
        quantize_rows(k, c), c))
    assert smooth < plain / 10


def int8_case(Hq, Hkv, lengths, S=6000, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(S, Hkv, D, generator=g) * torch.linspace(0.2, 3, D)
    v = torch.randn(S, Hkv, D, generator=g)
    c = torch.rand(Hkv, D, generator=g) + 0.5
    tables = scattered_tables(lengths, S, seed=seed)
    return tables, k, v, c


def np_attention(q, k, v, scale, q_pos, k_pos):
    """q [n, Hq, D], k/v [L, Hq, D] float64 -> o [n, Hq, D]: causal softmax."""
    s = np.einsum("nhd,lhd->hnl", q, k) * scale
    s = np.where(k_pos[None, None, :] <= q_pos[None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hnl,lhd->nhd", p, v)


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (9, 3), (16, 2)], ids=["gqa1", "gqa3", "gqa8"])
def test_cpu_kernel_on_int8_pools_matches_the_reference_and_numpy(cpu, Hq, Hkv):
    """Decode over scattered slots of ragged lengths (1..2000) and GQA: the compiled
    kernel (int16 query dot products where the CPU has VNNI) equals the reference
    backend, and both equal NumPy attention over the dequantized keys and values."""
    tables, k, v, c = int8_case(Hq, Hkv, [1, 2, 7, 64, 65, 333, 2000])
    kq, vq = quantize_rows(k, c), quantize_rows(v)
    q = torch.randn(len(tables), Hq, D, generator=torch.Generator().manual_seed(2))
    batch = SlotBatch.decode(tables)
    params = AttentionParams(D ** -0.5)
    qf = fold_channels(q, c)
    o, lse = attend(qf, kq, vq, batch, params, cpu)
    o_ref, lse_ref = attend(qf, kq, vq, batch, params, REF)
    assert torch.allclose(o, o_ref, atol=2e-4) and torch.allclose(lse, lse_ref, atol=2e-4)
    kd = dequantize_rows(kq, c).double().numpy()
    vd = dequantize_rows(vq).double().numpy()
    rep = Hq // Hkv
    for b, t in enumerate(tables):
        kb = np.repeat(kd[t], rep, axis=1)
        vb = np.repeat(vd[t], rep, axis=1)
        want = np_attention(q[b:b + 1].double().numpy(), kb, vb, D ** -0.5,
                            np.array([len(t) - 1]), np.arange(len(t)))
        assert np.allclose(o_ref[b:b + 1].numpy(), want, atol=2e-5)
        assert np.allclose(o[b:b + 1].numpy(), want, atol=2e-4)


@pytest.mark.parametrize("pname", ["window", "softcap", "sinks"])
def test_cpu_kernel_int8_features_match_the_reference(cpu, pname):
    """Window, softcap and sinks on int8 pools, decode and prefill tiles."""
    Hq, Hkv = 9, 3
    tables, k, v, c = int8_case(Hq, Hkv, [5, 90, 700], seed=3)
    params = {"window": AttentionParams(D ** -0.5, sliding_window=37),
              "softcap": AttentionParams(D ** -0.5, softcap=1.5),
              "sinks": AttentionParams(D ** -0.5, sinks=tuple(np.linspace(-2, 3, Hq)))}[pname]
    kq, vq = quantize_rows(k, c), quantize_rows(v)
    g = torch.Generator().manual_seed(4)
    for batch in (SlotBatch.decode(tables), SlotBatch.build(tables, [5, 20, 33])):  # + prefill
        q = fold_channels(torch.randn(batch.num_queries, Hq, D, generator=g), c)
        o, lse = attend(q, kq, vq, batch, params, cpu)
        o_ref, lse_ref = attend(q, kq, vq, batch, params, REF)
        assert torch.allclose(o, o_ref, atol=3e-4) and torch.allclose(lse, lse_ref, atol=3e-4)


def test_prefill_writes_quantized_rows_and_attends_as_over_dequantized_kv(cpu):
    """prefill_attention on an int8 pool: the rows it stores are quantize_rows' (keys
    over the channel scales), and the causal prefill over them (two requests, queries
    attending their own new keys and earlier ones) equals float attention over the
    dequantized pool with the unfolded q."""
    Hq, Hkv, S = 9, 3, 300
    g = torch.Generator().manual_seed(5)
    c = torch.rand(Hkv, D, generator=g) + 0.5
    kq = torch.zeros(S, Hkv, D + SCALE_BYTES, dtype=torch.int8)
    vq = torch.zeros_like(kq)
    old = torch.arange(0, 40)  # request 0's cached prefix, written earlier
    k_old, v_old = torch.randn(40, Hkv, D, generator=g), torch.randn(40, Hkv, D, generator=g)
    write_kv(kq, vq, old, k_old, v_old, key_scales=c)
    new = torch.arange(100, 130)  # request 0: 10 new tokens; request 1: 20 fresh
    k, v = torch.randn(30, Hkv, D, generator=g), torch.randn(30, Hkv, D, generator=g)
    q = torch.randn(30, Hq, D, generator=g)
    tables = [list(range(40)) + list(range(100, 110)), list(range(110, 130))]
    batch = SlotBatch.build(tables, [10, 20])
    params = AttentionParams(D ** -0.5)
    o, _ = prefill_attention(q, k, v, kq, vq, new, batch, params, cpu, key_scales=c)
    assert torch.equal(kq[new], quantize_rows(k, c)) and torch.equal(vq[new], quantize_rows(v))
    kd, vd = dequantize_rows(kq, c), dequantize_rows(vq)
    o_ref, _ = attend(q, kd, vd, batch, params, REF)
    assert torch.allclose(o, o_ref, atol=2e-4)


def test_int8_writes_are_checked():
    kq = torch.zeros(10, 2, D + SCALE_BYTES, dtype=torch.int8)
    vq = torch.zeros_like(kq)
    with pytest.raises(AttentionInputError, match=r"k must be \[3, 2, 64\]"):
        write_kv(kq, vq, torch.arange(3), torch.randn(3, 2, D + SCALE_BYTES),
                 torch.randn(3, 2, D))
    with pytest.raises(AttentionInputError, match="slot ids out of range"):
        write_kv(kq, vq, torch.tensor([10]), torch.randn(1, 2, D), torch.randn(1, 2, D))
    with pytest.raises(AttentionInputError, match="k_pool/v_pool dtypes"):
        attend(torch.randn(1, 2, D), kq, vq.float(), SlotBatch.decode([[0]]),
               AttentionParams(D ** -0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_memory_ends_quantizer_writes_quantize_rows_bytes(cpu, dtype):
    """The C++ data plane's quantizer (a memory worker's step loop stores int8 rows
    with it) gives `quantize_rows`' bytes, keys over channel scales and values without,
    on 12k rows of outliers, an all-zero row and values of every magnitude."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(4096, 3, D, generator=g) * torch.logspace(-3, 3, 4096)[:, None, None]
    x[5] = 0.0
    x = x.to(dtype)
    c = torch.rand(3, D, generator=g) + 0.5
    for channel in (c, None):
        assert torch.equal(cpu._ext.quantize_rows(x, channel), quantize_rows(x, channel))
