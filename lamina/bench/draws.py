"""How a sampled draw holds up when its logits move by float rounding.

Data in: a loaded model (`lamina.model.loader.load`, fp32). Data out: its logits over one
context of random words computed twice, whole and in two chunks over its KV cache (they
differ by rounding alone, as a sequence's do in batches of other sizes, with its prompt
in other chunks, or recomputed after a preemption), and, for a kind of row, how many
draws over seeds and positions differ between the two. Used by
`benchmarks/sampler_probe.py --stability` and the sampler's tests.
"""
from __future__ import annotations

import inspect
import random

import torch

from lamina.sampling.params import SamplingParams
from lamina.sampling.sampler import sample_rows

WORDS = ("river stone lamp quietly seven orange because market theory sudden winter gold "
         "music cheap bright window argue count between dance").split()


def whole_and_chunked(lm, tokens: int = 300, first: int = 100
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> the model's logits [tokens, V] over the context read whole, and read as `first`
    tokens then the rest over HF's KV cache."""
    r = random.Random(0)
    text = "Once upon a time " + " ".join(r.choice(WORDS) for _ in range(tokens * 2))
    ids = torch.tensor([lm.tokenizer(text).input_ids[:tokens]])
    # transformers >= 5.25 names HF's cache `cache` (`past_key_values` goes in 5.40)
    kw = "cache" if "cache" in inspect.signature(lm.model.forward).parameters \
        else "past_key_values"
    with torch.no_grad():
        whole = lm.model(ids).logits[0]
        head = lm.model(ids[:, :first], use_cache=True)
        cache = getattr(head, "cache", None) or head.past_key_values
        rest = lm.model(ids[:, first:], **{kw: cache}, use_cache=True).logits[0]
    return whole, torch.cat([head.logits[0], rest])


def changed_draws(a: torch.Tensor, b: torch.Tensor, params: SamplingParams,
                  seeds: tuple[int, ...], positions: range) -> list[tuple[int, int]]:
    """a, b: [T, V] logits -> the (position, seed) pairs whose draws differ."""
    out = []
    for pos in positions:
        x, y = sample_rows(torch.stack([a[pos], b[pos]]), [params] * 2, [seeds] * 2,
                           [pos] * 2)
        out += [(pos, s) for s, u, v in zip(seeds, x, y) if u != v]
    return out
