"""Incremental detokenization against the tokenizer's full decode (SmolLM2's real
tokenizer): the text grown token by token is always a prefix of the full decode, equals
it after `flush`, never shows half a character, and costs O(1) decoded tokens per step."""
import random

import pytest

from lamina.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello, world! The café serves crème brûlée.",
         "数学是研究数量、结构以及空间等概念的一门学科。",
         "Emoji: 🦙🚀👩‍👩‍👧 and Ωmega ∑ ≠ ∞, done.",
         "def f(x):\n    return x ** 2  # squares\n\n\nprint(f(3))"]


@pytest.fixture(scope="module")
def tok(smol):
    return smol.tokenizer


def _cases(tok):
    rng = random.Random(0)
    for t in TEXTS:
        yield tok(t, add_special_tokens=False)["input_ids"]
    for _ in range(30):  # random ids: byte tokens that never complete a character, too
        yield [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 60))]
    yield tok(TEXTS[2])["input_ids"] + [tok.eos_token_id] + tok(TEXTS[0])["input_ids"]


def test_grown_text_is_a_prefix_and_flush_equals_full_decode(tok):
    for ids in _cases(tok):
        d = IncrementalDetokenizer(tok)
        deltas = []
        for n in range(1, len(ids) + 1):
            deltas.append(d.update(ids[:n]))
            full = tok.decode(ids[:n], skip_special_tokens=True)
            assert full.startswith(d.text), (ids[:n], d.text, full)
            assert not d.text.endswith("\ufffd")  # never half a character
        assert "".join(deltas) == d.text
        d.flush(ids)
        assert d.text == tok.decode(ids, skip_special_tokens=True)


def test_multibyte_character_is_held_back_until_complete(tok):
    ids = tok("🦙", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1  # byte-level BPE splits the emoji
    d = IncrementalDetokenizer(tok)
    assert [d.update(ids[:n]) for n in range(1, len(ids))] == [""] * (len(ids) - 1)
    assert d.update(ids) == "🦙" and d.text == "🦙"


def test_work_per_token_is_bounded(tok):
    """Decoded ids per update stay small however long the output grows."""
    calls = []

    class Counting:
        def decode(self, ids, skip_special_tokens):
            calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok(" ".join(TEXTS) * 8, add_special_tokens=False)["input_ids"]
    assert len(ids) > 500
    d = IncrementalDetokenizer(Counting())
    for n in range(1, len(ids) + 1):
        d.update(ids[:n])
    assert max(calls) <= 12 and sum(calls) <= 12 * len(ids)  # full decodes: ~n^2 / 2
    assert d.text == tok.decode(ids, skip_special_tokens=True)


def test_find_stop_searches_only_new_text_and_finds_straddling_stops(tok):
    d = IncrementalDetokenizer(tok)
    ids = tok("one two three four five", add_special_tokens=False)["input_ids"]
    stops = ["three f", "zzz"]
    found = []
    for n in range(1, len(ids) + 1):
        d.update(ids[:n])
        found.append(d.find_stop(stops))
    first = next(i for i, h in enumerate(found) if h is not None)
    assert d.text[:found[first]] == "one two "  # the earliest hit, where it starts
    assert tok.decode(ids[:first + 1]).find("three f") == 8  # found on the step it completed
    assert "three f" not in tok.decode(ids[:first])
    assert all(h is None for h in found[:first])
    # already-searched text is not searched again: a stop there is not reported twice
    assert found[first + 1:] == [None] * (len(found) - first - 1)
