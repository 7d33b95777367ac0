"""A request's rules on the tokens its draws may take, beside structured output: vLLM's
`allowed_token_ids` and `bad_words`. The engine keeps them and sends each draw a bitmask
(`SeqWork.allowed`, with structured output's and min_tokens' restrictions); the workers
never see the rules themselves.

Data in: a request's `SamplingParams`, the tokenizer and the vocabulary size; each step,
a sample's output so far (and its draft). Data out: the tokens a draw may not take
(`TokenRules.banned`) and the draws' bitmasks (`restrict`).

Bad words follow vLLM: each is tokenized as written (leading spaces stripped) and after a
space (a word in mid-text); a draw may not take a word's last token where the output so
far ends in its other tokens. Only the output is looked at, not the prompt. Unlike vLLM,
the spaced spelling counts whatever its length: vLLM keeps it only with as many tokens as
the plain one, so SmolLM2 wrote " movable type" (2 tokens; "movable type" is 3) with the
word banned.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lamina.sampling.params import SamplingParams


@dataclass(frozen=True)
class TokenRules:
    """`allowed`: the bitmask of allowed_token_ids (None: any token); `bad_words`: each
    bad word's token ids."""

    allowed: bytes | None
    bad_words: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, params: SamplingParams, tokenizer, vocab_size: int) -> TokenRules | None:
        """The request's rules, or None where it has none. Raises ValueError for a token
        past the vocabulary, bad words without a tokenizer, or rules that leave no token."""
        ids = params.allowed_token_ids
        if ids is None and not params.bad_words:
            return None
        if ids is not None and max(ids) >= vocab_size:
            raise ValueError(f"allowed_token_ids names token {max(ids)}; the vocabulary "
                             f"has {vocab_size}")
        if params.bad_words and tokenizer is None:
            raise ValueError("bad_words need a tokenizer (this engine has none)")
        words = bad_word_ids(params.bad_words, tokenizer) if params.bad_words else ()
        allowed = None if ids is None else bitmask(ids, vocab_size)
        if ids is not None and set(ids) <= {w[0] for w in words if len(w) == 1}:
            raise ValueError(f"bad_words {list(params.bad_words)} ban every one of "
                             f"allowed_token_ids {sorted(set(ids))}")
        return cls(allowed, words)

    @property
    def context(self) -> int:
        """How many of the output's last tokens `banned` reads."""
        return max((len(w) - 1 for w in self.bad_words), default=0)

    def banned(self, output: Sequence[int]) -> tuple[int, ...]:
        """The tokens the draw after `output` may not take: each bad word's last token
        where `output` ends in the word's other tokens."""
        out = []
        for w in self.bad_words:
            k = len(w) - 1
            if k == 0 or (len(output) >= k and tuple(output[len(output) - k:]) == w[:k]):
                out.append(w[-1])
        return tuple(out)


def bad_word_ids(words: Sequence[str], tokenizer) -> tuple[tuple[int, ...], ...]:
    """Each word's token ids as written and after a space (one entry where the two are
    spelt alike)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            out.append(tuple(tokenizer.encode(text, add_special_tokens=False)))
    return tuple(dict.fromkeys(w for w in out if w))


def bitmask(ids: Sequence[int], vocab_size: int) -> bytes:
    """Token ids -> the bitmask allowing only them (bit t & 7 of byte t >> 3 = token t)."""
    bits = np.zeros(-(-vocab_size // 8) * 8, dtype=np.uint8)
    bits[list(ids)] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def fit_width(masks: bytes, rows: int, width: int) -> bytes:
    """`rows` bitmasks of one width, joined -> each cut or padded with zeros (tokens left
    out) to `width` bytes. Masks of one step must share a width: they are read as one
    [rows, width] array, and llguidance's come in 32-bit words (6148 bytes for SmolLM2's
    49152 tokens, where `bitmask` writes 6144)."""
    if len(masks) == rows * width:
        return masks
    m = np.frombuffer(masks, dtype=np.uint8).reshape(rows, -1)[:, :width]  # [rows, <= w]
    return np.pad(m, ((0, 0), (0, width - m.shape[1]))).tobytes()


def restrict(masks: bytes, allowed: bytes | None, bans: Sequence[Sequence[int]]) -> bytes:
    """`len(bans)` bitmasks of one width, joined -> the same with each row ANDed with
    `allowed` (None: unchanged; bits past its width cleared) and row r's `bans[r]`
    cleared."""
    rows = len(bans)
    m = np.frombuffer(masks, dtype=np.uint8).reshape(rows, -1).copy()  # [rows, width]
    if allowed is not None:
        a = np.frombuffer(allowed, dtype=np.uint8)[:m.shape[1]]
        m[:, :a.size] &= a
        m[:, a.size:] = 0
    for r, ban in enumerate(bans):
        for t in ban:
            if t < 8 * m.shape[1]:
                m[r, t >> 3] &= 0xFF ^ (1 << (t & 7))
    return m.tobytes()
