"""The dense transform (`pack_dense`): linears on oneDNN-prepacked weights or on a given
bf16 linear kernel, checked against the unsplit HF model on tiny architectures and on
SmolLM2's real weights."""
from dataclasses import dataclass

import pytest
import torch

from lamina.splitter import split_model
from lamina.splitter.dense import DenseBackendError, pack_dense, select_dense_backend
from lamina.splitter.slices import Slice
from tests.splitter.cached import assert_cached_decode_matches
from tests.tiny_models import TINY, tiny_model

LINEAR = torch.ops.aten.linear.default
PACKED = torch.ops.mkldnn._linear_pointwise.default


def _count(sm, target):
    return sum(1 for s in sm.slices for n in s.module.graph.nodes if n.target is target)


@pytest.mark.parametrize("mt", sorted(TINY))
def test_packed_split_matches_hf(mt):
    model = tiny_model(mt)
    sm = split_model(model)
    n_linear = _count(sm, LINEAR)
    packed, choice = pack_dense(sm, "onednn", batch_hint=4)
    assert choice.backend == "onednn" and f": {n_linear} linears" in choice.reason
    # linears on one input (q/k/v, gate/up) share one packed call
    assert _count(packed, LINEAR) == 0 and 0 < _count(packed, PACKED) <= n_linear
    assert _count(sm, LINEAR) == n_linear  # the input split is left as it was
    ids = torch.randint(3, 90, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    assert (packed.run_local(ids) - ref).abs().max().item() <= 1e-5


def test_smollm2_packed_decode_matches_hf_cache(smol, smol_packed):
    # 30 x 7 projections + lm_head in 30 x 4 + 1 calls: q|k|v, o, gate|up, down; lm_head
    assert _count(smol_packed, PACKED) == 121 and _count(smol_packed, LINEAR) == 0
    ids = smol.tokenizer("The printing press changed how knowledge spread",
                         return_tensors="pt")["input_ids"]
    # fp32 sums in another order: logits of magnitude ~20 agree to ~1e-4
    assert_cached_decode_matches(smol.model, smol_packed, ids, ids.shape[1] - 3, 1e-3,
                                 same_argmax=True)


def test_backend_selection_and_errors():
    ops = _standin_ops()
    assert select_dense_backend("auto", torch.bfloat16, "cpu", ops).backend == "avx512bf16"
    assert select_dense_backend("auto", torch.float32, "cpu", ops).backend == "onednn"
    assert select_dense_backend("auto", torch.bfloat16, "cpu").backend == "onednn"
    with pytest.raises(DenseBackendError, match="avx512bf16' cannot run: this CPU has AMX"):
        select_dense_backend("avx512bf16", torch.bfloat16, "cpu", None, "this CPU has AMX")
    with pytest.raises(DenseBackendError, match="float32, not bfloat16"):
        select_dense_backend("avx512bf16", torch.float32, "cpu", ops)
    with pytest.raises(DenseBackendError, match="on cuda"):
        select_dense_backend("avx512bf16", torch.bfloat16, "cuda", ops)
    assert select_dense_backend("eager", torch.float32, "cpu").backend == "eager"
    assert select_dense_backend("auto", torch.float32, "cpu").backend == "onednn"
    gpu = select_dense_backend("auto", torch.float32, "cuda")
    assert gpu.backend == "eager" and "cuda" in gpu.reason
    with pytest.raises(DenseBackendError, match="cuda"):
        select_dense_backend("onednn", torch.float32, "cuda")
    with pytest.raises(ValueError, match="dense backend must be one of"):
        select_dense_backend("mkl", torch.float32, "cpu")
    with pytest.raises(ValueError, match="batch_hint"):
        pack_dense(None, "auto", batch_hint=0)


NATIVE_BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()
TO = torch.ops.aten._to_copy.default


def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """bf16's spacing at |x| (8 significant bits)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(1e-30))) - 7)


def _assert_near_hf_bf16(model, packed):
    """packed's logits within 4 bf16 ulps (at the largest logit) of HF's bf16 forward."""
    ids = torch.randint(3, 90, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    out = packed.run_local(ids)
    assert out.dtype == torch.bfloat16
    assert ((out.float() - ref.float()).abs() <= 4 * _bf16_ulp(ref.float().abs().max())).all()


@pytest.mark.parametrize("mt", ["llama", "gpt2", "opt"])  # no bias, fused bias, bias
def test_bf16_packed_split_matches_hf_bf16(mt):
    """Packed natively where the CPU has a bf16 GEMM, else as fp32 copies with casts
    around each linear; either way within a few bf16 ulps of HF's own bf16 forward."""
    model = tiny_model(mt).to(torch.bfloat16)
    sm = split_model(model)
    n_linear = _count(sm, LINEAR)
    packed, choice = pack_dense(sm, "auto", batch_hint=4)
    calls = _count(packed, PACKED)
    assert choice.backend == "onednn" and f": {n_linear} linears" in choice.reason
    assert 0 < calls <= n_linear
    # upcast path: one cast in and one out per call (biases are cast once, as buffers)
    assert _count(packed, TO) - _count(sm, TO) == (0 if NATIVE_BF16 else 2 * calls)
    if not NATIVE_BF16:
        assert "float32 copies" in choice.reason and "AVX512-BF16" in choice.reason
    _assert_near_hf_bf16(model, packed)


def _standin_linear(x, packed, out_features, bias):
    """A stand-in bf16 linear kernel in plain torch (any CPU), on weights packed by
    copying."""
    assert packed.shape[0] == out_features
    return torch.nn.functional.linear(x, packed, bias)


def _standin_ops():
    from lamina.kernels.linear import LinearOps

    return LinearOps(torch.clone, _standin_linear)


def _kernel_ops():
    from lamina.kernels.linear import linear_ops

    ops, why = linear_ops()
    if ops is None:
        pytest.skip(f"no bf16 linear kernel here: {why}")
    return ops


@pytest.mark.parametrize("kernel", ["stand-in", "compiled"])
@pytest.mark.parametrize("mt", ["llama", "gpt2", "opt"])  # no bias, fused bias, bias
def test_bf16_kernel_split_matches_hf_bf16(mt, kernel):
    """Every linear onto the given kernel's calls (q/k/v, gate/up fused as with oneDNN),
    biases carried; within a few bf16 ulps of HF's own bf16 forward."""
    ops = _standin_ops() if kernel == "stand-in" else _kernel_ops()
    model = tiny_model(mt).to(torch.bfloat16)
    sm = split_model(model)
    n_linear = _count(sm, LINEAR)
    packed, choice = pack_dense(sm, "avx512bf16", linear_ops=ops)
    assert choice.backend == "avx512bf16" and f": {n_linear} linears" in choice.reason
    assert _count(packed, LINEAR) == 0 and 0 < _count(packed, ops.linear) <= n_linear
    assert _count(packed, PACKED) == 0 and _count(packed, TO) == _count(sm, TO)
    _assert_near_hf_bf16(model, packed)


def test_upcast_linear_rounds_like_a_bf16_linear(monkeypatch):
    """The fp32-copy path (forced, whatever this CPU has): one linear's outputs are fp32
    math rounded once to bf16 (bf16 products are exact in fp32), so they equal an eager
    bf16 linear's almost everywhere and lie within half a bf16 ulp of the float64 result
    plus fp32 accumulation's error bound (K * 2^-24 * sum |x_i w_i|: where terms cancel,
    fp32 sums in any order may cross a bf16 rounding boundary)."""
    import lamina.splitter.dense as dense

    monkeypatch.setitem(dense._NATIVE, torch.bfloat16, lambda: False)
    torch.manual_seed(0)
    lin = torch.nn.Linear(576, 1536).to(torch.bfloat16)
    torch.nn.init.normal_(lin.weight, std=0.05)
    g = torch.fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(LINEAR, (x, g.get_attr("weight"), g.get_attr("bias"))))
    split = _OneSlice([Slice(0, torch.fx.GraphModule(lin, g), ("x",), ("y",), 1)])
    packed, choice = dense.pack_dense(split, "onednn", batch_hint=32)
    assert "float32 copies" in choice.reason
    xb = torch.randn(32, 576, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        ref = torch.nn.functional.linear(xb, lin.weight, lin.bias)
        out = packed.slices[0](xb)
        w, b, x64 = lin.weight.double(), lin.bias.double(), xb.double()
        exact = x64 @ w.T + b  # [32, 1536]
        terms = x64.abs() @ w.abs().T + b.abs()  # sum of |x_i w_i| (and |bias|)
    assert out.dtype == torch.bfloat16
    assert (out == ref).float().mean().item() > 0.999
    bound = 0.5 * _bf16_ulp(exact.float()).double() + 577 * 2.0 ** -24 * terms
    assert ((out.double() - exact).abs() <= bound).all()


@dataclass
class _OneSlice:  # the one field of a SplitModel that pack_dense reads
    slices: list


def test_unpackable_dtype_is_refused_or_left_eager():
    model = tiny_model("llama").to(torch.float64)
    sm = split_model(model)
    same, choice = pack_dense(sm, "auto")
    assert same is sm and choice.backend == "eager" and "float64" in choice.reason
    with pytest.raises(DenseBackendError, match="float64"):
        pack_dense(sm, "onednn")


def test_eager_returns_the_split_itself(smol_split):
    same, choice = pack_dense(smol_split, "eager")
    assert same is smol_split and choice.backend == "eager"
