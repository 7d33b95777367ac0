"""The sampler: logit rows -> tokens (and logprobs), on the compute side.

Data in: logits [S, V] with each row's `SamplingParams`, seeds, position and history.
Data out: one token id per row, optional per-row logprobs, and prompt logprobs.
Draws are keyed by (seed, position), so a sequence recomputed after a recovery draws the
same tokens. Greedy rows use the compiled argmax kernel.
"""
from __future__ import annotations

import torch

from lamina.kernels import argmax_rows
from lamina.sampling.params import SamplingParams

_MASK64 = (1 << 64) - 1

PROMPT_CHUNK = 256  # prompt rows per log-softmax


def apply_penalties(logits: torch.Tensor, params: SamplingParams, history: tuple[int, ...],
                    prompt_len: int) -> torch.Tensor:
    """logits: [V] -> a penalized copy. history: the sequence so far (prompt, then drawn
    tokens). Repetition (HF): every token seen, prompt included, has its logit divided
    by the penalty if positive, multiplied if not. Presence / frequency (OpenAI): on
    drawn tokens only. Then `logit_bias` is added."""
    x = logits.clone()
    if params.repetition_penalty != 1 and history:
        seen = torch.unique(torch.tensor(history))
        v = x[seen]
        x[seen] = torch.where(v > 0, v / params.repetition_penalty,
                              v * params.repetition_penalty)
    drawn = history[prompt_len:]
    if drawn and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(drawn), minlength=x.numel())[:x.numel()]
        x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        x.index_add_(0, torch.tensor(ids), torch.tensor(bias, dtype=x.dtype))
    return x


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy row is drawn from. logits: [V] -> probs [V] fp32."""
    x = logits.float() / params.temperature
    V = x.numel()
    if 0 < params.top_k < V:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        p_sorted, idx = torch.sort(probs, descending=True)
        before = torch.cumsum(p_sorted, 0) - p_sorted  # mass strictly above each token
        drop = before >= params.top_p  # keep the smallest prefix reaching top_p
        drop[0] = False
        probs = probs.scatter(0, idx[drop], 0.0)
        probs = probs / probs.sum()
    return probs


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits: [R, V]; one token per row."""
    out = torch.argmax(logits, dim=-1).tolist()  # greedy for every row first
    for r, p in enumerate(params):
        if not p.greedy:
            probs = sampling_probs(logits[r], p)
            out[r] = int(torch.multinomial(probs, 1, generator=generators[r]))
    return out


def draw_seed(seed: int, position: int) -> int:
    """Seed of the draw at `position` of a sequence seeded `seed` (splitmix64 mix)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # torch seeds are < 2**63


def _history(histories, r: int, p: SamplingParams) -> tuple[tuple[int, ...], int]:
    """Row r's (tokens so far, prompt length); a penalized row must bring them."""
    if not p.penalized:
        return (), 0
    h = histories[r] if histories is not None else None
    if h is None:
        raise ValueError(f"row {r} has penalties but no token history")
    return h


def sample_rows(logits: torch.Tensor, params: list[SamplingParams],
                seeds: list[tuple[int, ...]], positions: list[int],
                histories: list[tuple[tuple[int, ...], int] | None] | None = None
                ) -> list[tuple[int, ...]]:
    """logits: [R, V] (the model's dtype: greedy rows read them as they are; a row
    that is penalized or drawn from works in fp32, as HF's logits processors do). Row r
    draws len(seeds[r]) tokens (n > 1 forks draw several from one prompt), each with its
    own seed, at `positions[r]`. histories[r]: (tokens so far, prompt length) for a row
    with penalties. -> per row, its tokens."""
    greedy = argmax_rows(logits).tolist()
    out = []
    for r, (p, ss) in enumerate(zip(params, seeds)):
        row = logits[r]  # [V]; cast to fp32 below only where it is needed
        if not p.greedy or p.penalized or p.logit_bias:
            row = row.cpu()  # drawn with a CPU generator: the same tokens on any device
        if p.penalized or p.logit_bias:
            row = apply_penalties(row.float(), p, *_history(histories, r, p))
            greedy[r] = int(torch.argmax(row))
        if p.greedy:
            out.append((greedy[r],) * len(ss))
            continue
        probs = sampling_probs(row, p)
        out.append(tuple(int(torch.multinomial(
            probs, 1, generator=torch.Generator().manual_seed(draw_seed(s, positions[r]))))
            for s in ss))
    return out


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], k: int) -> tuple:
    """logits: [P, V] at prompt positions 0..P-1; next_ids: the P tokens they predict
    (prompt tokens 1..P). -> (logprob of each, top-k ids per row, top-k logprobs per row)."""
    chosen, top_i, top_v = [], [], []
    for a in range(0, len(next_ids), PROMPT_CHUNK):  # no second [P, V] buffer at once
        lp = torch.log_softmax(logits[a:a + PROMPT_CHUNK].float(), dim=-1)  # [c, V]
        nxt = torch.tensor(next_ids[a:a + PROMPT_CHUNK])
        chosen += lp[torch.arange(len(nxt)), nxt].tolist()
        if k:
            v, i = torch.topk(lp, k, dim=-1)  # [c, k]
            top_i += [tuple(r) for r in i.tolist()]
            top_v += [tuple(r) for r in v.tolist()]
    if not k:
        top_i = top_v = [()] * len(chosen)
    return chosen, top_i, top_v


def row_logprobs(logits: torch.Tensor, params: list[SamplingParams],
                 tokens: list[tuple[int, ...]]) -> list[tuple | None]:
    """logits: [R, V]; tokens: per row, its drawn tokens. -> per row: None (not asked),
    or per drawn token (logprob, top ids, top logprobs), top-`params.logprobs` first."""
    out: list[tuple | None] = [None] * len(params)
    want = [r for r, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return out
    lp = torch.log_softmax(logits[want].float(), dim=-1)  # [W, V]
    k = max(p.logprobs for p in params if p.logprobs is not None)
    top_v, top_i = torch.topk(lp, k, dim=-1)  # [W, k]
    pairs = [(j, t) for j, r in enumerate(want) for t in tokens[r]]
    chosen = lp[[j for j, _ in pairs], [t for _, t in pairs]].tolist()  # one gather
    at = 0
    for j, r in enumerate(want):
        kk, n = params[r].logprobs, len(tokens[r])
        ids, vals = tuple(top_i[j, :kk].tolist()), tuple(top_v[j, :kk].tolist())
        out[r] = tuple((v, ids, vals) for v in chosen[at:at + n])
        at += n
    return out
