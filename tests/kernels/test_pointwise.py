"""The compiled fused pointwise ops against the eager op chains they replace
(`lamina.kernels.pointwise`): values, layouts and bad input."""
import pytest
import torch

from lamina.kernels.pointwise import REFERENCE, pointwise_ops

OPS, WHY = pointwise_ops()
pytestmark = pytest.mark.skipif(OPS is None, reason=f"no compiled ops: {WHY}")
DTYPES = (torch.float32, torch.bfloat16)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _bf16_ulp(x):
    return torch.exp2(torch.floor(torch.log2(x.abs().float().clamp_min(1e-30))) - 7)


def _qk(dt, n, heads=9, d=64, seed=0):
    """q as the slices make it: a slice of the fused q|k|v output, viewed, transposed."""
    lin = torch.randn(1, n, heads * d + 2 * 3 * d, generator=_gen(seed)).to(dt)
    q = lin[..., :heads * d].view(1, n, heads, d).transpose(1, 2)  # [1, H, N, D]
    cos = torch.randn(1, n, d, generator=_gen(seed + 1)).to(dt)[:, None]  # [1, 1, N, D]
    sin = torch.randn(1, n, d, generator=_gen(seed + 2)).to(dt)[:, None]
    return q, cos, sin


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 32, 300])
def test_rope_is_bitwise_the_eager_chain_with_its_layout(dt, n):
    q, cos, sin = _qk(dt, n)
    out, ref = OPS.rope(q, cos, sin), REFERENCE.rope(q, cos, sin)
    assert torch.equal(out, ref)
    assert out.stride() == ref.stride()  # [1, N, H, D] in memory, as eager lays it out
    # partial rotary (a slice of the head dim), and a non-contiguous last dim
    part = q[..., :32]
    assert torch.equal(OPS.rope(part, cos[..., :32], sin[..., :32]),
                       REFERENCE.rope(part, cos[..., :32], sin[..., :32]))
    odd = q[..., ::2]  # last dim strided: copied first, same values
    c2, s2 = cos[..., 1::2], sin[..., ::2]
    assert torch.equal(OPS.rope(odd, c2, s2), REFERENCE.rope(odd, c2, s2))


@pytest.mark.parametrize("dt", DTYPES)
def test_rms_norm_against_the_eager_chain(dt):
    x = (torch.randn(3, 50, 576, generator=_gen(3)) * 30).to(dt)
    w = torch.randn(576, generator=_gen(4)).to(dt)
    out, ref = OPS.rms_norm(x, w, 1e-5), REFERENCE.rms_norm(x, w, 1e-5)
    assert out.dtype == dt and out.shape == x.shape and out.stride() == ref.stride()
    if dt == torch.float32:  # squares summed in another order: last-bit differences
        assert torch.allclose(out, ref, rtol=2e-6, atol=1e-6)
    else:  # the fp32 row scale may differ in its last bit: at most one bf16 step
        assert ((out.float() - ref.float()).abs() <= _bf16_ulp(ref)).all()
        assert (out == ref).float().mean() > 0.999
    # a row whose length is not a multiple of 16 and a strided row set (q/k norms)
    y = torch.randn(2, 7, 4, 33, generator=_gen(5)).to(dt)[:, ::2]
    wy = torch.randn(33, generator=_gen(6)).to(dt)
    assert torch.allclose(OPS.rms_norm(y, wy, 1e-6).float(),
                          REFERENCE.rms_norm(y, wy, 1e-6).float(), rtol=1e-2, atol=1e-5)


@pytest.mark.parametrize("dt", DTYPES)
def test_silu_mul_against_the_eager_chain(dt):
    gu = (torch.randn(1, 40, 2 * 1536, generator=_gen(7)) * 4).to(dt)
    gate, up = gu[..., :1536], gu[..., 1536:]  # the fused gate|up output's halves
    out, ref = OPS.silu_mul(gate, up), REFERENCE.silu_mul(gate, up)
    assert out.stride() == ref.stride()
    if dt == torch.float32:  # exp within 2 ulp of ATen's
        assert torch.allclose(out, ref, rtol=1e-6, atol=1e-7)
    else:
        assert ((out.float() - ref.float()).abs() <= _bf16_ulp(ref)).all()
        assert (out == ref).float().mean() > 0.999
    big = torch.tensor([-200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0])  # saturates
    assert torch.allclose(OPS.silu_mul(big, torch.ones(7)), REFERENCE.silu_mul(big, torch.ones(7)),
                          rtol=1e-6, atol=1e-30)


def test_bad_input_is_refused_by_name():
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="rms_norm: weight must be \\[8\\]"):
        OPS.rms_norm(x, torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        OPS.rms_norm(x.double(), torch.randn(8).double(), 1e-5)
    with pytest.raises(RuntimeError, match="rope: the rotated dim must be even"):
        OPS.rope(torch.randn(2, 5), torch.randn(2, 5), torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="rope: cos/sin must have x's dtype"):
        OPS.rope(x, torch.randn(4, 8).bfloat16(), torch.randn(4, 8).bfloat16())
    with pytest.raises(RuntimeError, match="silu_mul: gate and up must match"):
        OPS.silu_mul(x, torch.randn(4, 9))
    assert OPS.silu_mul(torch.empty(0, 8), torch.empty(0, 8)).shape == (0, 8)


def _argmax_ref(x):
    return torch.argmax(x.float(), dim=-1)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("V", [1, 5, 16, 31, 32, 33, 100, 49152])
def test_argmax_rows_is_torch_argmax(dt, V):
    from lamina.kernels import argmax_rows, load_cpu_kernel
    ext = load_cpu_kernel()
    g = _gen(V)
    x = torch.randn(7, V, generator=g).to(dt)
    assert torch.equal(ext.argmax_rows(x), _argmax_ref(x))
    # many ties (small integers): the first maximum wins, in every lane and the tail
    ties = torch.randint(-3, 4, (9, V), generator=g).to(dt)
    assert torch.equal(ext.argmax_rows(ties), _argmax_ref(ties))
    # a row of -inf, a row of -0.0 / 0.0, the maximum last, a NaN (the first NaN wins)
    special = torch.randn(5, V, generator=g).to(dt)
    special[0] = float("-inf")
    special[1] = torch.where(torch.arange(V) % 2 == 0, -0.0, 0.0).to(dt)
    special[2, -1] = 1e4
    special[3, V // 2] = float("nan")
    special[3, -1] = float("nan")
    special[4, 0] = float("inf")
    special[4, -1] = float("inf")
    assert torch.equal(ext.argmax_rows(special), _argmax_ref(special))
    # strided rows (a slice of a wider buffer) and a non-contiguous last dim
    wide = torch.randn(4, V + 40, generator=g).to(dt)
    assert torch.equal(ext.argmax_rows(wide[:, 3:V + 3]), _argmax_ref(wide[:, 3:V + 3]))
    assert torch.equal(ext.argmax_rows(wide.t()[:V].t()), _argmax_ref(wide.t()[:V].t()))
    assert torch.equal(argmax_rows(x), _argmax_ref(x))  # the public entry takes this path


def test_argmax_rows_bad_input_and_fallback():
    from lamina.kernels import argmax_rows, load_cpu_kernel
    ext = load_cpu_kernel()
    with pytest.raises(RuntimeError, match=r"argmax_rows: x must be \[rows, vocab\]"):
        ext.argmax_rows(torch.zeros(2, 3, 4))
    with pytest.raises(RuntimeError, match="argmax_rows: float32 or bfloat16"):
        ext.argmax_rows(torch.zeros(2, 3, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="empty rows"):
        ext.argmax_rows(torch.zeros(2, 0))
    assert ext.argmax_rows(torch.zeros(0, 5)).shape == (0,)
    half = torch.randn(3, 50, generator=_gen(1)).half()  # other dtypes: torch's argmax
    assert torch.equal(argmax_rows(half), _argmax_ref(half))


def _masked_ref(x, keep):
    """NumPy: the first index of the maximum among the kept tokens (the first kept NaN
    if any), -1 for a row with none kept."""
    import numpy as np

    out = []
    for row, k in zip(x.float().numpy(), keep.numpy()):
        idx = np.flatnonzero(k)
        if not idx.size:
            out.append(-1)
            continue
        vals = row[idx]
        nan = np.flatnonzero(np.isnan(vals))
        out.append(int(idx[nan[0]] if nan.size else idx[np.argmax(vals)]))
    return torch.tensor(out)


def _pack(keep, extra_bytes=0):
    import numpy as np

    bits = np.packbits(keep.numpy().astype(np.uint8), axis=1, bitorder="little")
    pad = np.full((bits.shape[0], extra_bytes), 0xFF, dtype=np.uint8)  # bits past V set
    return torch.from_numpy(np.concatenate([bits, pad], axis=1))


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("V", [1, 5, 16, 31, 32, 33, 100, 49152])
def test_masked_argmax_rows_is_the_argmax_over_allowed_tokens(dt, V):
    """Structured output's greedy argmax (`masked_argmax_rows`) against NumPy over the
    allowed tokens: dense, sparse (whole 16-token blocks skipped) and single-token
    masks, ties, NaN allowed and not, only -inf allowed, none allowed (-1), set bits
    past V ignored; the public entry and its torch fallback agree."""
    from lamina.kernels import load_cpu_kernel, masked_argmax_rows
    from lamina.kernels.pointwise import KernelBuildError

    ext = load_cpu_kernel()
    g = _gen(V + 1)
    x = torch.randn(8, V, generator=g).to(dt)
    x[1] = torch.randint(-2, 3, (V,), generator=g).to(dt)  # ties
    keep = torch.rand(8, V, generator=g) < 0.5
    keep[2] = torch.rand(V, generator=g) < 0.01  # sparse
    keep[3] = False
    keep[3, V // 3] = True  # one token
    keep[4] = False  # none: -1
    x[5, V // 2] = float("nan")  # an allowed NaN wins...
    keep[5, V // 2] = True
    x[6, 0] = float("nan")  # ...a disallowed one does not
    keep[6, 0] = False
    keep[6, -1] = True
    x[7] = float("-inf")  # only -inf allowed: the first allowed index
    keep[7] = torch.arange(V) >= V // 2
    want = _masked_ref(x, keep)
    bits = _pack(keep, extra_bytes=3)
    assert torch.equal(ext.masked_argmax_rows(x, bits), want)
    assert torch.equal(masked_argmax_rows(x, bits), want)
    strided = torch.randn(8, V + 24, generator=g).to(dt)[:, 5:V + 5]
    assert torch.equal(ext.masked_argmax_rows(strided, bits), _masked_ref(strided, keep))
    import lamina.kernels.pointwise as pw

    def no_kernel():
        raise KernelBuildError("off")

    real = pw.load_cpu_kernel
    try:  # the torch fallback gives the same answers
        pw.load_cpu_kernel = no_kernel
        assert torch.equal(masked_argmax_rows(x, bits), want)
    finally:
        pw.load_cpu_kernel = real
    with pytest.raises(RuntimeError, match="masked_argmax_rows: bits must be"):
        ext.masked_argmax_rows(x, bits[:, :(V + 7) // 8 - 1] if V > 8 else bits[:1])
