"""Speculative decoding's drafts: n-gram prompt lookup (vLLM's "ngram", "prompt lookup
decoding"); for structured output, the engine drafts the tokens the grammar forces
first (`LLMEngine._propose`).

Data in: a running sequence's tokens (prompt + output so far), the config's
`SpeculativeConfig`. Data out: a draft, the tokens that followed the latest earlier
occurrence of the sequence's last n tokens (n from `ngram_max` down to `ngram_min`), at
most `num_tokens` of them; empty when nothing matches.

Why here and in this form: a draft costs no model of its own, and answers that copy
from their context (code edits, quotes, extraction, JSON of given fields, a chat's
repeated phrasing) continue earlier n-grams often. The scheduler feeds the draft after
the sequence's last token in the same step (`SeqWork.draft`): the compute side's dense
part takes draft + 1 rows of that sequence instead of one, which on a memory-bound
decode step costs little, and its memory worker attends them as a prompt chunk over
the context. The compute side draws after every fed token and keeps the draws up to
the first that differs from the draft; the KV slots of the positions past it are given
back (`Scheduler.trim`). A token is kept only where the draw equals the guess, and the
draws are keyed by (seed, position), so the tokens are the ones drawing one a step
gives, greedy or sampled (for a one-token guess this is the exact rejection test).

Each sequence keeps an index of its n-grams (`NgramIndex`), extended by the tokens
appended since its last draft, so a draft costs O(ngram_max) dict lookups, not a scan
of the context.

Drafts that miss are not free: their rows go through the dense part and attention, which
at a large batch is compute the step pays for. So each sequence drafts by its record:
a draft is at most one token longer than the previous one kept (up to `num_tokens`),
and after a draft of which nothing was kept the sequence waits 1, 2, 4, ... (at most
`MAX_BACKOFF`) steps before drafting again. An answer that copies keeps long drafts; an
answer with little to copy soon drafts rarely and briefly.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculativeConfig:
    num_tokens: int = 0  # tokens drafted per sequence and step (0: off)
    ngram_max: int = 3  # the longest suffix looked up
    ngram_min: int = 2  # the shortest (1: a single token may start a draft)

    def __post_init__(self):
        for name, low in (("num_tokens", 0), ("ngram_max", 1), ("ngram_min", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= 64:
                raise ValueError(f"EngineConfig.speculative_{name.removeprefix('num_')} "
                                 f"must be an int in {low}..64, got {v!r}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"EngineConfig.speculative_ngram_min ({self.ngram_min}) must "
                             f"not exceed speculative_ngram_max ({self.ngram_max})")


MAX_BACKOFF = 16  # steps a sequence whose drafts keep missing waits at most


class NgramIndex:
    """One sequence's n-grams (n in ngram_min..ngram_max) -> the position just after
    their latest occurrence that has a token after it; and its drafts' record."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.after: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # tokens[:indexed] are indexed (each n-gram ending before it)
        self.longest = config.num_tokens  # the next draft's length at most
        self.misses = 0  # drafts in a row of which nothing was kept
        self.wait = 0  # steps still to wait before the next draft

    def allowance(self) -> int:
        """How many tokens this step's draft may have (0: none this step)."""
        if self.wait:
            self.wait -= 1
            return 0
        return self.longest

    def observe(self, drafted: int, kept: int) -> None:
        """A draft's outcome: the next may be one token longer than what was kept;
        nothing kept: wait twice as long as after the last miss."""
        self.longest = min(self.config.num_tokens, kept + 1)
        self.misses = 0 if kept else self.misses + 1
        self.wait = min(MAX_BACKOFF, 2 ** (self.misses - 1)) if self.misses else 0

    def update(self, prompt: list[int], output: list[int]) -> None:
        """Index the n-grams that gained a next token since the last update."""
        lo, hi, total = self.config.ngram_min, self.config.ngram_max, len(prompt) + len(output)
        if total <= self.indexed:
            return
        start = max(self.indexed, 1)
        window = _span(prompt, output, max(0, start - hi), total)  # what the grams read
        base = max(0, start - hi)
        for end in range(start, total):  # a gram ends at end - 1, `end` follows it
            for n in range(lo, min(hi, end) + 1):
                self.after[tuple(window[end - n - base:end - base])] = end
        self.indexed = total

    def draft(self, prompt: list[int], output: list[int], k: int) -> tuple[int, ...]:
        """Up to k tokens that followed the longest suffix of prompt + output seen
        before (its latest occurrence)."""
        self.update(prompt, output)
        total = len(prompt) + len(output)
        tail = _span(prompt, output, max(0, total - self.config.ngram_max), total)
        for n in range(min(self.config.ngram_max, total), self.config.ngram_min - 1, -1):
            at = self.after.get(tuple(tail[len(tail) - n:]))
            if at is not None:
                return tuple(_span(prompt, output, at, min(at + k, total)))
        return ()


def _span(prompt: list[int], output: list[int], a: int, b: int) -> list[int]:
    """(prompt + output)[a:b] without joining the lists."""
    p = len(prompt)
    if b <= p:
        return prompt[a:b]
    if a >= p:
        return output[a - p:b - p]
    return prompt[a:] + output[:b - p]
