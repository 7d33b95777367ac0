"""Shared check: a split model's KV-cached decode against HF's own cache."""
import inspect

import torch

from lamina.splitter import LocalKVCache


def assert_cached_decode_matches(model, sm, ids: torch.Tensor, P: int, tol: float,
                                 same_argmax: bool = False) -> LocalKVCache:
    """Prefill ids[:, :P], then decode the rest one token at a time, each step's logits
    within `tol` of HF's (and, if asked, the same greedy token). ids: [B, T]."""
    cache = LocalKVCache(len(sm.attention_specs))
    # transformers >= 5.25 names HF's cache `cache` (`past_key_values` goes in 5.40)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"
    with torch.no_grad():
        hf = model(ids[:, :P], use_cache=True)
        pkv = getattr(hf, "cache", None) or hf.past_key_values
        ours = sm.forward_cached(ids[:, :P], cache)
        assert (ours - hf.logits).abs().max().item() <= tol
        for t in range(P, ids.shape[1]):
            hf = model(ids[:, t:t + 1], **{kw: pkv}, use_cache=True)
            pkv = getattr(hf, "cache", None) or hf.past_key_values
            ours = sm.forward_cached(ids[:, t:t + 1], cache)
            assert ours.shape == hf.logits.shape
            assert (ours - hf.logits).abs().max().item() <= tol
            if same_argmax:
                assert torch.equal(ours.argmax(-1), hf.logits.argmax(-1))
    return cache
