"""SmolLM2-135M (real weights): split equivalence against HF transformers."""
import torch

from tests.splitter.cached import assert_cached_decode_matches


def _prompts(tok):
    a = tok("The capital of France is", return_tensors="pt").input_ids[0]
    b = tok("Write a short poem about the sea, the wind and the old lighthouse keeper.",
            return_tensors="pt").input_ids[0]
    assert len(a) != len(b)
    return a, b


def test_slice_count_and_context(smol_split, smol):
    n_layers = smol.config.num_hidden_layers
    assert n_layers == 30
    assert smol_split.num_slices == 31
    assert len(smol_split.attention_specs) == 30
    d_model = smol.config.hidden_size
    assert smol_split.context_bytes_per_token == [d_model * 4] * 30 == [2304] * 30
    assert set(smol_split.context_bytes_expr) == {"2304*batch*tokens"}


def test_attention_specs(smol_split):
    for i, s in enumerate(smol_split.attention_specs):
        assert (s.index, s.num_q_heads, s.num_kv_heads, s.head_dim,
                s.v_head_dim) == (i, 9, 3, 64, 64)
        assert s.gqa_ratio == 3
        assert s.scale == 64 ** -0.5
        assert s.sliding_window is None and s.softcap is None and s.sinks is None
        assert s.dtype == torch.float32
        assert s.kv_bytes_per_token() == 3 * 128 * 4


def test_run_local_matches_hf_on_ragged_batch(smol_split, smol, ):
    a, b = _prompts(smol.tokenizer)
    T = max(len(a), len(b))
    batch = torch.zeros(2, T, dtype=torch.long)  # right padding: causal rows never see it
    batch[0, :len(a)], batch[1, :len(b)] = a, b
    with torch.no_grad():
        ref = smol.model(batch).logits
    out = smol_split.run_local(batch)
    assert out.shape == ref.shape == (2, T, smol.config.vocab_size)
    assert (out[0, :len(a)] - ref[0, :len(a)]).abs().max().item() <= 1e-5
    assert (out[1, :len(b)] - ref[1, :len(b)]).abs().max().item() <= 1e-5


def test_kv_cached_decode_matches_hf_cache(smol_split, smol):
    _, b = _prompts(smol.tokenizer)
    ids = b[None]
    cache = assert_cached_decode_matches(smol.model, smol_split, ids, ids.shape[1] - 3, 1e-5)
    assert cache.length == ids.shape[1]


def test_weights_are_shared_not_copied(smol_split, smol):
    model_ptrs = {p.data_ptr() for p in smol.model.parameters()}
    for s in smol_split.slices:
        for p in s.module.parameters():
            assert p.data_ptr() in model_ptrs


def test_report_lists_every_cut(smol_split):
    rep = smol_split.report()
    assert "30 attention operators -> 31 slices" in rep
    assert rep.count("2304") == 30
    assert "split time" in rep
