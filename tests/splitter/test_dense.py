"""The dense transform (`pack_dense`): linears on oneDNN-prepacked weights, checked
against the unsplit HF model on tiny architectures and on SmolLM2's real weights."""
import pytest
import torch

from lamina.splitter import split_model
from lamina.splitter.dense import DenseBackendError, pack_dense, select_dense_backend
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
    assert choice.backend == "onednn"
    assert _count(packed, LINEAR) == 0 and _count(packed, PACKED) == n_linear > 0
    assert _count(sm, LINEAR) == n_linear  # the input split is left as it was
    ids = torch.randint(3, 90, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    assert (packed.run_local(ids) - ref).abs().max().item() <= 1e-5


def test_smollm2_packed_decode_matches_hf_cache(smol, smol_packed):
    # 30 x 7 projections + lm_head, each packed once
    assert _count(smol_packed, PACKED) == 211 and _count(smol_packed, LINEAR) == 0
    ids = smol.tokenizer("The printing press changed how knowledge spread",
                         return_tensors="pt")["input_ids"]
    # fp32 sums in another order: logits of magnitude ~20 agree to ~1e-4
    assert_cached_decode_matches(smol.model, smol_packed, ids, ids.shape[1] - 3, 1e-3,
                                 same_argmax=True)


def test_backend_selection_and_errors():
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


@pytest.mark.skipif(torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="this CPU has a fast oneDNN bf16 path")
def test_bf16_without_cpu_support_stays_eager_with_reason():
    model = tiny_model("llama").to(torch.bfloat16)
    sm = split_model(model)
    same, choice = pack_dense(sm, "auto")
    assert same is sm and choice.backend == "eager" and "AVX512-BF16" in choice.reason
    with pytest.raises(DenseBackendError, match="bfloat16"):
        pack_dense(sm, "onednn")


def test_eager_returns_the_split_itself(smol_split):
    same, choice = pack_dense(smol_split, "eager")
    assert same is smol_split and choice.backend == "eager"
