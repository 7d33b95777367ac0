"""Sampling parameters and the sampler.

Data in: one row of next-token logits per sequence (fp32 [R, V]) from the last slice,
on the compute worker, with each sequence's `SamplingParams` and seeds. Data out: token
ids (only these go back to the engine). Greedy rows (temperature 0) take the argmax; the
rest apply temperature, then top-k, then top-p (nucleus), then draw.

Logprobs, where asked for, are of the model's own distribution (log-softmax of the
logits, before temperature, top-k and top-p), as vLLM reports them.

Draws are stateless: the generator of a draw is seeded from (sequence seed, position of
the token drawn), so a sequence recomputed after preemption, or moved to another
compute worker, draws exactly the tokens it would have drawn.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lamina.kernels import argmax_rows

MAX_LOGPROBS = 20
PROMPT_CHUNK = 256  # prompt rows per log-softmax


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0  # (0, 1]; 1 = off
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # per drawn token: its logprob and this many top ones
    prompt_logprobs: int | None = None  # per prompt token (after the first): the same
    # OpenAI's: subtract presence * [t drawn before] + frequency * (times t was drawn)
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # HF's (> 0): prompt and drawn tokens' logits / it
    logit_bias: tuple[tuple[int, float], ...] = ()  # OpenAI's: (token id, added to logit)

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"SamplingParams.{field} {why}, got {getattr(self, field)!r}")

        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            bad("max_tokens", "must be a positive int")
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            bad("temperature", "must be a finite number >= 0")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be -1 (off), 0 (off) or a positive int")
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            bad("seed", "must be a non-negative int or None")
        if not isinstance(self.n, int) or self.n < 1:
            bad("n", "must be an int >= 1")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "must be non-empty strings")
        if any(not isinstance(i, int) or i < 0 for i in self.stop_token_ids):
            bad("stop_token_ids", "must be non-negative ints")
        for name in ("presence_penalty", "frequency_penalty"):
            x = getattr(self, name)
            if (isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x)
                    or not -2 <= x <= 2):
                bad(name, "must be a number in [-2, 2]")
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r < math.inf:
            bad("repetition_penalty", "must be a finite number > 0")
        lb = self.logit_bias
        lb = tuple(sorted(lb.items())) if isinstance(lb, dict) else tuple(map(tuple, lb))
        object.__setattr__(self, "logit_bias", lb)
        if any(len(e) != 2 or isinstance(e[0], bool) or not isinstance(e[0], int) or e[0] < 0
               or isinstance(e[1], bool) or not isinstance(e[1], (int, float))
               or not -100 <= e[1] <= 100 for e in lb):
            bad("logit_bias", "must map token ids (ints >= 0) to numbers in [-100, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            lp = getattr(self, name)
            if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool)
                                   or not 0 <= lp <= MAX_LOGPROBS):
                bad(name, f"must be None or an int in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Draws depend on the tokens before (the compute side needs the history)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1)


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


_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, position: int) -> int:
    """Seed of the draw at `position` of a sequence seeded `seed` (splitmix64 mix)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # torch seeds are < 2**63


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
        if p.penalized or p.logit_bias:
            row = apply_penalties(row.float(), p, *(histories[r] if p.penalized else ((), 0)))
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
    k = max(params[r].logprobs for r in want)
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
