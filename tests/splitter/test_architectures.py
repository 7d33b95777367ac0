"""Split equivalence on tiny random-weight configs of many HF decoder architectures."""
import pytest
import torch

from lamina.splitter import split_model
from tests.splitter.cached import assert_cached_decode_matches
from tests.tiny_models import TINY, tiny_model

# Context the min cut finds, bytes per token (d_model = 64, fp32 -> 256).
# phi and cohere run attention and MLP in parallel off one shared LayerNorm: the LN output
# feeds both q/k/v (before the cut) and the MLP, so the cut keeps residual + LN output.
EXPECTED_CONTEXT = {mt: 256 for mt in TINY} | {"phi": 512, "cohere": 512}


@pytest.fixture(scope="module", params=sorted(TINY))
def arch(request):
    model = tiny_model(request.param)
    return request.param, model, split_model(model)


def test_slice_count_and_context(arch):
    mt, model, sm = arch
    n = model.config.num_hidden_layers
    assert sm.num_slices == n + 1 == len(sm.attention_specs) + 1
    assert sm.context_bytes_per_token == [EXPECTED_CONTEXT[mt]] * n


def test_run_local_matches_hf(arch):
    _, model, sm = arch
    ids = torch.randint(3, 90, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    out = sm.run_local(ids)
    assert out.shape == ref.shape
    assert (out - ref).abs().max().item() <= 1e-5


def test_cached_decode_matches_hf_cache(arch):
    _, model, sm = arch
    ids = torch.randint(3, 90, (2, 11), generator=torch.Generator().manual_seed(2))
    P = 8  # longer than every sliding window in TINY, so windows are exercised
    assert_cached_decode_matches(model, sm, ids, P, 1e-5)


def test_slices_individually_invokable(arch):
    _, model, sm = arch
    ids = torch.randint(3, 90, (1, 5))
    pos = torch.arange(5)[None]
    out = sm.slices[0](ids, pos)
    assert len(out) == 3 + len(sm.partition.context[0])
    q, k, v = out[:3]
    spec = sm.attention_specs[0]
    assert q.shape == (1, spec.num_q_heads, 5, spec.head_dim)
    assert k.shape == (1, spec.num_kv_heads, 5, spec.head_dim)
    assert v.shape == (1, spec.num_kv_heads, 5, spec.v_head_dim)
    # a middle slice alone, fed synthetic inputs of the right shapes
    attn = torch.randn(1, 5, spec.num_q_heads, spec.v_head_dim)
    mid = sm.slices[1](pos, attn, *out[3:])
    assert len(mid) == 3 + len(sm.partition.context[1])
    model_ptrs = ({p.data_ptr() for p in model.parameters()}
                  | {b.data_ptr() for b in model.buffers()})
    for s in sm.slices:
        for p in s.module.parameters():
            assert p.data_ptr() in model_ptrs


def test_partition_is_precedence_closed(arch):
    """Every data edge runs forward: producer's slice <= consumer's slice; attention i
    reads only slices <= i and is read only by slices > i."""
    _, _, sm = arch
    part, dg = sm.partition, sm.graph
    rank = dict(part.assign)
    rank.update({a: i + 0.5 for i, a in enumerate(part.attention)})
    for u, v in dg.graph.edges:
        if u in rank and v in rank:
            assert rank[u] <= rank[v], (u, v)
    for i, ctx in enumerate(part.context):
        for u in ctx:  # context of cut i is produced at or before slice i, read after it
            assert rank[u] <= i


def test_feature_specs():
    sm = split_model(tiny_model("gemma2"))
    windows = [s.sliding_window for s in sm.attention_specs]
    assert windows == [4, None, 4]  # gemma2 alternates sliding / global layers
    assert {s.softcap for s in sm.attention_specs} == {30.0}
    assert {s.scale for s in sm.attention_specs} == {16 ** -0.5}
    m = tiny_model("gpt_oss")
    sm = split_model(m)
    for layer, s in zip(m.model.layers, sm.attention_specs):
        assert s.sinks == tuple(float(x) for x in layer.self_attn.sinks.detach())
    assert split_model(tiny_model("mistral")).attention_specs[0].sliding_window == 5
