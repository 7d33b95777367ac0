"""Structured output: a request's text held to a JSON schema, a regex, a choice or a
grammar, by masking at each draw the tokens that could not continue it.

Data in: a request's `StructuredOutputs` (in its `SamplingParams`), the engine's
tokenizer. Data out: before each step, per constrained sequence, the tokens it may draw
as a bitmask (`Guide.allowed`: bytes, bit t & 7 of byte t >> 3 = token t, little-endian
as llguidance writes it), sent in the step's `SeqWork.allowed`; on the compute side a
greedy row takes the argmax over its allowed tokens (`lamina.kernels.masked_argmax_rows`,
compiled: it reads only the 16-token blocks that hold an allowed token), and a drawn or
penalized row has the others' logits set to -inf (`sampler.mask_rows`) before its draw,
whatever penalties and `logit_bias` add. This module holds no tensor code: the engine
(plain Python over ids) imports it. After the step the engine feeds each drawn
token to its guide (`Guide.accept`); a guide that has ended (`done`: the text is
complete and nothing may follow) finishes its sequence with reason "stop".

The grammar engine is llguidance (Rust; the guidance backend of vLLM and SGLang): a JSON
schema, regex, choice or Lark / GBNF grammar is checked and its matcher made in about a
millisecond, and a step's masks take ~2 ms at B=64 over SmolLM2's 49k vocabulary
(`benchmarks/structured_probe.py`; the first request also builds the tokenizer's tables,
~0.3 s), so it runs on the engine's thread, as vLLM's scheduler process does. The
engine keeps the state (a matcher per sequence, advanced only by tokens the engine
applied): a failed step, a recovery, a preemption or a move to another compute worker
leaves it as it was, and the compute side stays stateless.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, cast

log = logging.getLogger(__name__)

CHECKED = 256  # grammars kept by `Guides.check`
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: `json` (a JSON schema, dict or text), `json_object=True` (any
    JSON object), `regex` (the whole output matches it; Rust regex syntax), `choice`
    (the output is one of these strings), `grammar` (Lark or GBNF). JSON is compact
    (no whitespace between tokens) unless `whitespace_flexible`."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False

    def __post_init__(self):
        set_ = [k for k in KINDS if self._given(k)]
        if len(set_) != 1:
            raise ValueError(f"StructuredOutputs takes exactly one of {', '.join(KINDS)}; "
                             f"got {', '.join(set_) or 'none'}")
        if isinstance(self.json, str):
            try:
                object.__setattr__(self, "json", json.loads(self.json))
            except ValueError as e:
                raise ValueError(f"StructuredOutputs.json is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"StructuredOutputs.json must be a JSON schema (an object), "
                             f"got {type(self.json).__name__}")
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(
                    isinstance(c, str) and c for c in self.choice) or not self.choice:
                raise ValueError("StructuredOutputs.choice must be a list of non-empty "
                                 "strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"StructuredOutputs.{name} must be a non-empty string")

    def _given(self, name: str) -> bool:
        v = getattr(self, name)
        return v is True if name == "json_object" else v is not None

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if self._given(k))

    def grammar_text(self) -> str:
        """-> the llguidance grammar of this constraint (ValueError naming a bad one)."""
        import llguidance

        ws = cast(Any, {"whitespace_flexible": self.whitespace_flexible})
        try:
            if self.json is not None or self.json_object:
                schema = {"type": "object"} if self.json_object else self.json
                return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                     defaults=ws)
            if self.regex is not None:
                return llguidance.grammar_from("regex", self.regex)
            if self.choice is not None:
                return llguidance.grammar_from("choice", json.dumps(list(self.choice)))
            return llguidance.grammar_from("grammar", cast(str, self.grammar))
        except ValueError as e:
            raise ValueError(f"StructuredOutputs.{self.kind}: {e}") from None


class Guides:
    """The engine's guide factory: one llguidance tokenizer for the model (built on the
    first constrained request, ~0.3 s for SmolLM2), a matcher per sequence."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ll = None
        self._lock = threading.Lock()  # servers check requests on their own threads
        self._checked: OrderedDict[str, str] = OrderedDict()  # spec -> grammar, LRU

    def _ll_tokenizer(self):
        with self._lock:
            if self._ll is None:
                if self._tokenizer is None:
                    raise ValueError("structured output needs the model's tokenizer; this "
                                     "engine has none")
                import llguidance

                t = time.perf_counter()
                n = len(self._tokenizer)  # the logits may be wider (padding): never drawn
                if self.vocab_size < 1 << 30:  # the engine's "unknown" is 1 << 30
                    n = max(n, self.vocab_size)
                ll = llguidance.LLTokenizer(_tokenizer_json(self._tokenizer), n_vocab=n,
                                            eos_token=self._tokenizer.eos_token_id)
                self._ll = ll
                log.info("structured output: llguidance's tables for the tokenizer built "
                         "in %.1f s (once per engine)", time.perf_counter() - t)
            return self._ll

    def check(self, spec: StructuredOutputs) -> str:
        """-> the compiled grammar; ValueError naming the field if it cannot be used.
        The last CHECKED grammars are kept: a server checks each request before it
        queues it and the engine again when it adds it, and clients tend to send one
        schema many times."""
        import llguidance

        key = json.dumps([spec.kind, getattr(spec, spec.kind), spec.whitespace_flexible],
                         sort_keys=True)
        with self._lock:
            text = self._checked.get(key)
            if text is not None:
                self._checked.move_to_end(key)
                return text
        text = spec.grammar_text()
        err = llguidance.LLMatcher.validate_grammar(text, self._ll_tokenizer())
        if err:
            raise ValueError(f"StructuredOutputs.{spec.kind}: {_one_line(err)}")
        with self._lock:
            self._checked[key] = text
            if len(self._checked) > CHECKED:
                self._checked.popitem(last=False)
        return text

    def guide(self, grammar: str) -> Guide:
        import llguidance

        return Guide(llguidance.LLMatcher(self._ll_tokenizer(), grammar))


def _tokenizer_json(tokenizer) -> str:
    """The fast tokenizer's JSON as llguidance reads it (`llguidance.hf.from_tokenizer`
    passes it whole). llguidance takes a vocabulary for byte-level (GPT-2's bytes spelled
    as characters: "Ġ" is a space) only where the decoder is `ByteLevel` itself; the
    tokenizer transformers 5.17 makes from a GGUF has the same vocabulary and
    pre-tokenizer but wraps that decoder in a `Sequence` (ByteFallback, Fuse, Replace,
    ByteLevel), and llguidance then took "Ġ" for the bytes of its UTF-8 and refused every
    token with a space (seen on the H200 machine, 2026-12-04). A byte-level
    pre-tokenizer says how the vocabulary is spelled, so there the decoder is its
    `ByteLevel` step alone."""
    from copy import copy

    if not hasattr(tokenizer, "backend_tokenizer"):
        raise ValueError("structured output needs a fast (Rust-backed) tokenizer; this "
                         f"model's is a {type(tokenizer).__name__}")
    backend = copy(tokenizer.backend_tokenizer)  # not the engine's: padding is changed
    backend.no_padding()
    backend.no_truncation()
    text = backend.to_str()
    spec = json.loads(text)
    steps = _steps(spec.get("decoder"))
    byte_level = [d for d in steps if d.get("type") == "ByteLevel"]
    if byte_level and len(steps) > 1 and any(
            p.get("type") == "ByteLevel" for p in _steps(spec.get("pre_tokenizer"))):
        spec["decoder"] = byte_level[0]
        return json.dumps(spec)
    return text


def _steps(part: dict | None) -> list[dict]:
    """A tokenizer part's steps: those of a `Sequence`, else the part itself."""
    if not part:
        return []
    if part.get("type") == "Sequence":
        return list(part.get("decoders") or part.get("pretokenizers") or [])
    return [part]


def _one_line(err: str) -> str:
    """llguidance's multi-line error without its source excerpts ("   1 | ...", "  ^")."""
    keep = [x.strip() for x in err.splitlines()]
    return " ".join(x for x in keep if x.strip("^ ") and not re.match(r"\d+ \|", x))


class Guide:
    """One sequence's matcher: the tokens it may draw next, advanced by each drawn one."""

    def __init__(self, matcher):
        self._m = matcher

    def allowed(self) -> bytes:
        """The bitmask of the tokens that may come next (only EOS once it has ended).
        (Not llguidance.torch's helpers: importing them imports torch._dynamo, 1.3 s.)"""
        return self._m.compute_bitmask()

    def forced(self) -> tuple[int, ...]:
        """The tokens the grammar forces next (a schema's keys, punctuation), as its
        tokenizer writes them; a draft the model's draws keep unless it would spell
        them in other tokens."""
        return () if self._m.is_stopped() else tuple(self._m.compute_ff_tokens())

    def valid_prefix(self, tokens: tuple[int, ...]) -> int:
        """How many of `tokens` the grammar takes in a row from here (a draft's)."""
        return 0 if self._m.is_stopped() else int(self._m.validate_tokens(list(tokens)))

    def draft_masks(self, guess: tuple[int, ...]) -> bytes:
        """For a draft the grammar takes whole: the bitmasks of the draws after the
        current token and after each guessed one, concatenated (the matcher is moved
        along the guess and back)."""
        masks = [self._m.compute_bitmask()]
        for t in guess:
            self._m.consume_token(t)
            masks.append(self._m.compute_bitmask())
        if guess:
            self._m.rollback(len(guess))
        return b"".join(masks)

    def accept(self, token: int) -> bool:
        """Feed a drawn token; False if the grammar refuses it (then `error` says why)."""
        if self._m.is_stopped():
            return True  # the EOS after the end: nothing more to check
        return bool(self._m.consume_token(token)) and not self._m.is_error()

    @property
    def done(self) -> bool:
        """The output is complete: nothing but EOS may follow."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error() or ""
