"""The sampler: logit rows -> tokens (and logprobs), on the compute side.

Data in: logits [S, V] with each row's `SamplingParams`, seeds, position and history.
Data out: one token id per row, optional per-row logprobs, and prompt logprobs.
Draws are keyed by (seed, position), so a sequence recomputed after a recovery draws the
same tokens; each is an exponential race keyed by token id (`draw_tokens`), which keeps
its token when the logits move by float rounding (a batch of other sizes, a prompt fed in
other chunks, a recomputed context). Greedy rows use the compiled argmax kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lamina.kernels import argmax_rows, masked_argmax_rows
from lamina.sampling.params import SamplingParams
from lamina.sampling.token_rules import fit_width

_MASK64 = (1 << 64) - 1
BLOCK = 256  # tokens a block of draw_tokens' two-level race
_TINY = 1e-300  # the least exponential a race takes (-log1p(-0) is 0)

PROMPT_CHUNK = 256  # prompt rows per log-softmax
# drawn rows worked on together: their [G, V] temporaries stay small enough (~0.8 MB
# at a 49k vocabulary) for malloc to reuse them; larger ones went back to the OS at
# each free and came back as page faults (2.5x slower at 16 rows)
ROWS_AT_ONCE = 4


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
    """The distribution a non-greedy row is drawn from. logits: [V] -> probs [V] fp32.
    min_p keeps the tokens at least min_p times as likely as the likeliest; top_k then
    keeps every token at or above the k-th logit (ties too); top_p then keeps the
    smallest set of most likely tokens whose mass reaches it."""
    c = candidates(logits.float()[None] / params.temperature, params)[0]
    probs = c.probs if c.ids is None else \
        torch.zeros(logits.numel()).index_copy_(0, c.ids, c.probs)
    return probs / probs.sum()


@dataclass(frozen=True)
class Candidates:
    """What one row may draw: `probs` [m] fp32 (not normalized; a zero is never drawn)
    over token `ids` [m] (None: every token, in id order) of a `vocab`-token vocabulary."""

    probs: torch.Tensor
    ids: torch.Tensor | None
    vocab: int


def candidates(x: torch.Tensor, params: SamplingParams) -> list[Candidates]:
    """x: [G, V] fp32 logits already divided by the temperature, rows sharing `params`
    -> each row's `Candidates`. The work is batched over rows, but what a row gets
    depends on that row alone (so a draw does not depend on the rest of the batch)."""
    G, V = x.shape
    if params.min_p > 0:
        x = _min_p(x, params.min_p)
    if not 0 < params.top_k < V:
        return _nucleus(torch.softmax(x, dim=-1), params.top_p)
    k = params.top_k
    vals, idx = torch.topk(x, k, dim=-1)  # [G, k], descending
    probs = _nucleus_prefix(torch.softmax(vals, dim=-1), params.top_p)  # the rest are 0
    out = [Candidates(probs[g], idx[g], V) for g in range(G)]
    # tokens tied with the k-th logit; a row with fewer than k tokens left (min_p, a
    # structured output's mask) has its -inf in the top k: no tie to look for
    tied = (x >= vals[:, -1:]).logical_and_(vals[:, -1:] > float("-inf"))
    for g, n in enumerate(tied.sum(-1).tolist()):
        if n > k:  # the k-th logit is shared past k: every tied token is kept too
            v, i = torch.topk(x[g], n)
            out[g] = Candidates(_nucleus_prefix(torch.softmax(v, -1)[None],
                                                params.top_p)[0], i, V)
    return out


def _min_p(x: torch.Tensor, min_p: float) -> torch.Tensor:
    """x: [G, V] logits (over the temperature) -> the same with every token less likely
    than min_p x its row's likeliest at -inf (as HF's MinPLogitsWarper decides it)."""
    probs = torch.softmax(x, dim=-1)  # [G, V]
    keep = probs >= min_p * probs.amax(-1, keepdim=True)
    return torch.where(keep, x, float("-inf"))


NUCLEUS_FIRST = 256  # the most likely tokens sorted first for top_p (4x more as needed)


def _nucleus(probs: torch.Tensor, top_p: float) -> list[Candidates]:
    """probs: [G, V] -> each row's smallest set of most likely tokens whose mass
    reaches top_p (all of them at 1). Sorting a whole 49k vocabulary takes ~3 ms a row;
    the set usually lies among the few hundred most likely, so a row's first
    NUCLEUS_FIRST are sorted (topk), 4x more while their mass falls short of top_p."""
    G, V = probs.shape
    if top_p >= 1.0:
        return [Candidates(probs[g], None, V) for g in range(G)]
    out: list = [None] * G
    left, m = list(range(G)), NUCLEUS_FIRST
    while left:
        m = min(m, V)
        p_sorted, idx = torch.topk(probs[left], m, dim=-1)  # [L, m], descending
        enough = (p_sorted.sum(-1) >= top_p).tolist()  # tokens past these: dropped
        kept = _nucleus_prefix(p_sorted, top_p)
        for j, g in enumerate(left):
            if enough[j] or m == V:
                out[g] = Candidates(kept[j], idx[j], V)
        left, m = [g for j, g in enumerate(left) if not (enough[j] or m == V)], m * 4
    return out


def _nucleus_prefix(p_sorted: torch.Tensor, top_p: float) -> torch.Tensor:
    """p_sorted [G, m], each row descending -> the same with every token past a row's
    smallest prefix reaching top_p set to 0."""
    if top_p >= 1.0:
        return p_sorted
    before = torch.cumsum(p_sorted, -1) - p_sorted  # mass strictly above each token
    keep = before < top_p
    keep[:, 0] = True
    return p_sorted * keep


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
                histories: list[tuple[tuple[int, ...], int] | None] | None = None,
                masks: list[bytes] | None = None) -> list[tuple[int, ...]]:
    """logits: [R, V] (the model's dtype: greedy rows read them as they are; a row
    that is penalized or drawn from works in fp32, as HF's logits processors do). Row r
    draws len(seeds[r]) tokens (n > 1 forks draw several from one prompt), each with its
    own seed, at `positions[r]`. histories[r]: (tokens so far, prompt length) for a row
    with penalties. masks[r]: the bitmask of the tokens row r may draw (b"": any; the
    engine's, from structured output, min_tokens, allowed_token_ids and bad_words); the
    others stay at -inf whatever penalties and logit_bias add. -> per row, its tokens.
    Drawn rows sharing temperature, min_p, top_k and top_p are worked on together, on
    the CPU (a CPU generator: the same tokens on any device)."""
    out: list = [None] * len(params)
    groups: dict[tuple, list[int]] = {}
    width = -(-logits.shape[1] // 8)  # every mask read at the logits' width
    masks = [fit_width(m, 1, width) if m else m for m in masks or [b""] * len(params)]
    plain = {r for r, m in enumerate(masks) if m and params[r].greedy
             and not (params[r].penalized or params[r].logit_bias)}
    if plain:  # greedy under a structured output: the argmax over its allowed tokens,
        # in one pass over every row, read in place (the others under an all-ones mask:
        # the same answer as argmax_rows)
        every = b"\xff" * len(masks[min(plain)])
        greedy = masked_argmax_rows(logits.cpu(), mask_bits(
            [masks[r] if r in plain else every for r in range(len(masks))])).tolist()
        if any(greedy[r] < 0 for r in plain):
            raise ValueError("structured output: no token of the vocabulary may come next")
    else:
        greedy = argmax_rows(logits).tolist()
    held = sorted({r for r, m in enumerate(masks) if m} - plain)
    masked: dict[int, torch.Tensor] = {}  # drawn or penalized row -> fp32 logits, masked
    for at in range(0, len(held), ROWS_AT_ONCE):  # small temporaries, as below
        chunk = held[at:at + ROWS_AT_ONCE]
        x = mask_rows(logits[chunk].cpu(), [masks[r] for r in chunk])  # [G, V]
        masked.update((r, x[j]) for j, r in enumerate(chunk))
    for r, (p, ss) in enumerate(zip(params, seeds)):
        if p.penalized or p.logit_bias or (r in masked and not p.greedy):
            row = masked[r] if r in masked else logits[r].cpu().float()
            if p.penalized or p.logit_bias:  # a masked token stays at -inf
                row = apply_penalties(row, p, *_history(histories, r, p))
            out[r] = ((int(torch.argmax(row)),) * len(ss) if p.greedy else draw_tokens(
                candidates(row[None] / p.temperature, p)[0], ss, positions[r]))
        elif p.greedy:
            out[r] = (greedy[r],) * len(ss)
        else:
            groups.setdefault((p.temperature, p.min_p, p.top_k, p.top_p), []).append(r)
    for rows in groups.values():
        p = params[rows[0]]
        for at in range(0, len(rows), ROWS_AT_ONCE):
            chunk = rows[at:at + ROWS_AT_ONCE]
            x = logits[chunk].cpu().float().div_(p.temperature)  # [G, V]
            for r, c in zip(chunk, candidates(x, p)):
                out[r] = draw_tokens(c, seeds[r], positions[r])
    return out


def mask_bits(masks: list[bytes]) -> torch.Tensor:
    """Rows' bitmasks (equal lengths) -> uint8 [rows, bytes], for masked_argmax_rows."""
    return torch.frombuffer(bytearray(b"".join(masks)), dtype=torch.uint8).view(
        len(masks), -1)


def mask_rows(rows: torch.Tensor, masks: list[bytes]) -> torch.Tensor:
    """rows: [M, V] logits -> an fp32 copy with every token row m's bitmask `masks[m]`
    leaves out at -inf (tokens past a mask's width are left out too)."""
    M, V = rows.shape
    packed = np.frombuffer(b"".join(masks), dtype=np.uint8).reshape(M, -1)  # [M, V/8]
    bits = np.unpackbits(packed, axis=1, count=V, bitorder="little")  # [M, V] 0/1
    empty = np.flatnonzero(~bits.any(axis=1))
    if empty.size:
        raise ValueError(f"structured output: no token of the vocabulary may come next "
                         f"(row {int(empty[0])})")
    keep = torch.from_numpy(bits).view(torch.bool)
    # torch.where, not masked_fill: both branch per element, where is the faster here
    return torch.where(keep, rows.float(), float("-inf"))


def draw_tokens(c: Candidates, seeds: tuple[int, ...], position: int) -> tuple[int, ...]:
    """One token per seed by an exponential race: token t with probability p_t scores
    p_t / E_t, E_t ~ Exp(1), and the highest score wins, which draws t with probability
    p_t / sum(p) (vLLM's sampler draws the same way). E_t comes from a generator seeded by
    (seed, position) and is keyed by the token's id, not by where it sits among the
    candidates, so a draw changes only if the two best scores are within the logits'
    rounding of each other: none of 8000 draws on SmolLM2's logits of one context fed
    whole or in two chunks (`benchmarks/sampler_probe.py --stability`), where placing one
    uniform among the running sums (inverse CDF, this function before) changed 0.1-0.2%,
    whenever the sums' rounding crossed a token's edge anywhere below.
    The race runs in two levels, exactly: blocks of BLOCK tokens race by their mass, then
    the winning block's tokens by theirs, so a draw takes vocab / BLOCK + BLOCK
    exponentials, not one a token (~0.02-0.04 ms a draw over SmolLM2's 49k vocabulary)."""
    nb = -(-c.vocab // BLOCK)
    p = c.probs.float()
    if c.ids is None:  # every token, in id order: [nb, BLOCK] blocks (padded with 0s)
        blocks = torch.nn.functional.pad(p, (0, nb * BLOCK - p.numel())).view(nb, BLOCK)
        mass = blocks.sum(1).numpy()  # [nb]

        def within(b: int, e: np.ndarray) -> int:  # e: [BLOCK], one a token of block b
            return b * BLOCK + int(np.argmax(blocks[b].numpy() / e))
    else:  # candidates: their blocks by id
        ids, probs = c.ids.numpy(), p.numpy()  # [m]
        blk = ids // BLOCK
        mass = np.bincount(blk, weights=probs, minlength=nb)  # [nb]

        def within(b: int, e: np.ndarray) -> int:
            at = np.flatnonzero(blk == b)  # the block's candidates
            tok = ids[at]
            return int(tok[np.argmax(probs[at] / e[tok - b * BLOCK])])
    out = []
    for s in seeds:  # NumPy for the small arrays: a third of torch's per-call time
        g = torch.Generator().manual_seed(draw_seed(s, position))
        u = torch.rand(nb + BLOCK, generator=g, dtype=torch.float64).numpy()
        # Exp(1) draws, > 0 so that a zero probability scores 0 and never wins
        e = np.maximum(-np.log1p(-u), _TINY)  # [nb blocks, BLOCK in-block]
        out.append(within(int(np.argmax(mass / e[:nb])), e[nb:]))
    return tuple(out)


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
