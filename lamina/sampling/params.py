"""Sampling parameters and the sampler.

Data in: one row of next-token logits per sequence (fp32 [R, V]) from the last slice,
on the compute worker, with each sequence's `SamplingParams` and seeds. Data out: token
ids (only these go back to the engine). Greedy rows (temperature 0) take the argmax; the
rest apply temperature, then top-k, then top-p (nucleus), then draw.

Logprobs, where asked for, are of the model's own distribution (log-softmax of the
logits, before temperature, top-k and top-p), as vLLM reports them.

Draws are stateless: the generator of a draw is seeded from (sequence seed, position of
the token drawn), so a sequence recomputed after preemption, or moved to another
compute worker, draws the tokens it would have drawn, and a draw keeps its token when
its logits differ by float rounding (`sampler.draw_tokens`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from lamina.memory.sparsity_config import KVOverride
from lamina.sampling.structured import StructuredOutputs

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = 16  # None: as many as the model's context leaves
    # vLLM's: no EOS, stop token or stop string ends the output before this many tokens
    # (EOS and stop_token_ids are masked out of those draws)
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0  # (0, 1]; 1 = off
    # vLLM's: after temperature, tokens less likely than min_p x the likeliest are out
    # (before top_k and top_p, as vLLM orders them); 0 = off
    min_p: float = 0.0
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
    # vLLM's: the only tokens a draw may take (None: any)
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's: words never drawn. Each is tokenized as written and after a space; a draw
    # may not take a word's last token where the output so far ends in the rest of it
    # (`lamina.sampling.token_rules`)
    bad_words: tuple[str, ...] = ()
    # vLLM's: the stop string or stop token that ended the output stays in its text
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # the text leaves special tokens out
    # vLLM's: only the prompt's last this many tokens are used (None: all of it)
    truncate_prompt_tokens: int | None = None
    # this request's own KV sparsity on the memory workers (lamina.memory.sparsity): a
    # policy name and/or a budget (a fraction in (0, 1] or a token count); None takes
    # the deployment's (`EngineConfig.kv_sparsity` / `kv_budget`)
    kv_sparsity: str | None = None
    kv_budget: float | int | None = None
    # the output held to a JSON schema, regex, choice or grammar (a dict is taken as
    # StructuredOutputs' fields); the engine keeps it: it never crosses to the workers
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self):
        def bad(field, why):
            raise ValueError(f"SamplingParams.{field} {why}, got {getattr(self, field)!r}")

        if self.max_tokens is not None and (not isinstance(self.max_tokens, int)
                                            or isinstance(self.max_tokens, bool)
                                            or self.max_tokens <= 0):
            bad("max_tokens", "must be a positive int or None (up to the model's context)")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or \
                self.min_tokens < 0:
            bad("min_tokens", "must be an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens ({self.max_tokens})")
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or math.isinf(t):
            bad("temperature", "must be a finite number >= 0")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", "must be -1 (off), 0 (off) or a positive int")
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
            bad("top_p", "must be in (0, 1]")
        m = self.min_p
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 <= m <= 1:
            bad("min_p", "must be a number in [0, 1]")
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
        self._check_restrictions(bad)
        lb = self.logit_bias
        lb = tuple(sorted(lb.items())) if isinstance(lb, dict) else tuple(map(tuple, lb))
        object.__setattr__(self, "logit_bias", lb)
        if any(len(e) != 2 or isinstance(e[0], bool) or not isinstance(e[0], int) or e[0] < 0
               or isinstance(e[1], bool) or not isinstance(e[1], (int, float))
               or not -100 <= e[1] <= 100 for e in lb):
            bad("logit_bias", "must map token ids (ints >= 0) to numbers in [-100, 100]")
        for name, ov in (("kv_sparsity", lambda: KVOverride(self.kv_sparsity)),
                         ("kv_budget", lambda: KVOverride(budget=self.kv_budget))):
            try:
                ov()
            except ValueError as e:
                raise ValueError(f"SamplingParams.{name}: {e}") from None
        so = self.structured_outputs
        if isinstance(so, dict):
            try:
                so = StructuredOutputs(**so)
            except TypeError as e:
                raise ValueError(f"SamplingParams.structured_outputs: {e}") from None
            object.__setattr__(self, "structured_outputs", so)
        if so is not None and not isinstance(so, StructuredOutputs):
            bad("structured_outputs", "must be StructuredOutputs, a dict of its fields or None")
        for name in ("logprobs", "prompt_logprobs"):
            lp = getattr(self, name)
            if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool)
                                   or not 0 <= lp <= MAX_LOGPROBS):
                bad(name, f"must be None or an int in [0, {MAX_LOGPROBS}]")

    def _check_restrictions(self, bad) -> None:
        """allowed_token_ids, bad_words, truncate_prompt_tokens (tuples made of lists)."""
        if self.allowed_token_ids is not None:
            ids = tuple(self.allowed_token_ids)
            object.__setattr__(self, "allowed_token_ids", ids)
            if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0
                              for i in ids):
                bad("allowed_token_ids", "must be None or a non-empty list of token ids "
                                         "(ints >= 0)")
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            bad("bad_words", "must be non-blank strings")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 1):
            bad("truncate_prompt_tokens", "must be None or an int >= 1")

    @property
    def kv_override(self) -> KVOverride | None:
        """This request's own KV sparsity, or None (the deployment's)."""
        if self.kv_sparsity is None and self.kv_budget is None:
            return None
        return KVOverride(self.kv_sparsity, self.kv_budget)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Draws depend on the tokens before (the compute side needs the history)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1)




