"""`fuse_pointwise`: the slices' RMSNorm / rotary / SiLU x up chains as one call each.
With the eager reference ops in place of the compiled ones the fused split must be
bitwise the plain split on every tiny architecture (so the matcher only rewrites what it
claims to); with the compiled ops it must match HF, and SmolLM2's packed decode too."""
import pytest
import torch

from lamina.kernels.pointwise import REFERENCE, pointwise_ops
from lamina.splitter import split_model
from lamina.splitter.dense import pack_dense
from lamina.splitter.fuse import fuse_pointwise
from tests.splitter.cached import assert_cached_decode_matches
from tests.tiny_models import TINY, tiny_model

OPS, WHY = pointwise_ops()
needs_ops = pytest.mark.skipif(OPS is None, reason=f"no compiled ops: {WHY}")
# 3 layers: 2 norms each + the final one; rotary on q and k; one gated MLP each
LLAMA_LIKE = {"rms_norm": 7, "rope": 6, "silu_mul": 3}
EXPECTED = {"llama": LLAMA_LIKE, "mistral": LLAMA_LIKE, "qwen2": LLAMA_LIKE,
            "phi3": LLAMA_LIKE,
            "qwen3": {"rms_norm": 13, "rope": 6, "silu_mul": 3},  # + q/k norms
            "gpt2": {"rms_norm": 0, "rope": 0, "silu_mul": 0},  # LayerNorm, GELU, learned pos
            "gemma2": {"rms_norm": 0, "rope": 6, "silu_mul": 0}}  # (1 + w) norm, GELU


def _ids():
    return torch.randint(3, 90, (2, 11), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("mt", sorted(TINY))
def test_reference_fusion_is_bitwise_the_plain_split(mt):
    plain = split_model(tiny_model(mt))
    fused, counts = fuse_pointwise(plain, REFERENCE)
    if mt in EXPECTED:
        assert counts == EXPECTED[mt]
    with torch.no_grad():
        assert torch.equal(fused.run_local(_ids()), plain.run_local(_ids()))
    if any(counts.values()):  # the input split is left as it was
        assert fused is not plain and all(
            n.target not in (REFERENCE.rms_norm, REFERENCE.rope, REFERENCE.silu_mul)
            for s in plain.slices for n in s.module.graph.nodes)


@needs_ops
@pytest.mark.parametrize("mt", sorted(TINY))
def test_compiled_fusion_matches_hf(mt):
    model = tiny_model(mt)
    fused, _ = fuse_pointwise(split_model(model), OPS)
    with torch.no_grad():
        assert (fused.run_local(_ids()) - model(_ids()).logits).abs().max().item() <= 1e-5


@needs_ops
@pytest.mark.parametrize("mt", ["llama", "qwen3"])
def test_compiled_fusion_bf16_within_a_bf16_step_of_the_plain_split(mt):
    model = tiny_model(mt).to(torch.bfloat16)
    plain = split_model(model)
    fused, counts = fuse_pointwise(plain, OPS)
    assert counts == EXPECTED[mt]
    with torch.no_grad():
        a, b = fused.run_local(_ids()).float(), plain.run_local(_ids()).float()
    assert (a - b).abs().max().item() <= 0.05 * b.abs().max().item()
    assert torch.equal(a.argmax(-1), b.argmax(-1))


@needs_ops
def test_smollm2_fused_packed_decode_matches_hf_cache(smol, smol_packed):
    fused, counts = fuse_pointwise(smol_packed, OPS)
    assert counts == {"rms_norm": 61, "rope": 60, "silu_mul": 30}
    ids = smol.tokenizer("The printing press changed how knowledge spread",
                         return_tensors="pt")["input_ids"]
    assert_cached_decode_matches(smol.model, fused, ids, ids.shape[1] - 3, 1e-3,
                                 same_argmax=True)


@needs_ops
def test_smollm2_bf16_fused_slice_on_a_decode_batch():
    """A bf16 layer slice at 32 rows, fused vs plain packed: every chain but the norms'
    sums and silu's exp rounds as eager does, so outputs agree but for rare last-bit
    (one bf16 step) differences."""
    from lamina.model.loader import load

    model = load(dtype=torch.bfloat16, with_tokenizer=False).model
    plain, _ = pack_dense(split_model(model), "auto", 32)
    fused, _ = fuse_pointwise(plain, OPS)
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(100, 132)[None]
    attn = torch.randn(1, 32, 9, 64, generator=g).bfloat16()
    resid = (torch.randn(1, 32, 576, generator=g) * 3).bfloat16()
    with torch.no_grad():
        outs_p, outs_f = plain.slices[5](pos, attn, resid), fused.slices[5](pos, attn, resid)
    for a, b in zip(outs_f, outs_p):
        assert ((a.float() - b.float()).abs() <= 2 ** -7 * b.float().abs()).all()
        assert (a == b).float().mean() > 0.999
