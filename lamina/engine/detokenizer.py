"""Incremental detokenization: a sample's text grown by each drawn token at O(1) cost
per token, instead of decoding the whole output every step (O(n^2) over a generation).

Data in: the sample's output token ids after each step (from the engine). Data out: the
text delta those tokens add, and the text so far (for stop strings and outputs).

The scheme is vLLM's: decode only a short window [prefix, end) and [prefix, read), and
emit what the newer tokens add after the window's earlier part. Starting the window a
few tokens back keeps merges across token boundaries (leading spaces, multi-byte
characters) right. While the window ends in an incomplete UTF-8 character (U+FFFD), it
emits nothing and waits for the next token; `flush` emits the rest as is at the end.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.text = ""  # everything emitted so far
        self._prefix = 0  # window start (tokens already emitted before read)
        self._read = 0  # tokens whose text is in self.text
        self._searched = 0  # text length already searched for stop strings

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def update(self, ids: list[int]) -> str:
        """`ids`: the whole output so far (a prefix of every later call). Returns the new
        text, '' while the window ends mid-character."""
        before = self._decode(ids[self._prefix:self._read])
        after = self._decode(ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(ids)
        self.text += delta
        return delta

    def flush(self, ids: list[int]) -> str:
        """At the end: whatever is left, a trailing incomplete character included."""
        before = self._decode(ids[self._prefix:self._read])
        after = self._decode(ids[self._prefix:])
        delta = after[len(before):] if after.startswith(before) else ""
        self._prefix = self._read = len(ids)
        self.text += delta
        return delta

    def find_stop(self, stops) -> int | None:
        """Where the earliest stop string starts in `text`, or None. Each call searches
        only the text added since the previous one (plus the overlap a stop string could
        straddle), so checking every step costs O(new text)."""
        start = max(0, self._searched - max((len(x) for x in stops), default=1) + 1)
        self._searched = len(self.text)
        hits = [h for h in (self.text.find(x, start) for x in stops) if h >= 0]
        return min(hits) if hits else None
