"""Beam search: HF's algorithm (`generate(num_beams=W, do_sample=False)`), run as rounds
of one-token requests, as vLLM runs its own.

Data in: a prompt's token ids, `BeamSearchParams`, the model's EOS ids; then, once a
round, each running beam's top K next-token logprobs (the engine's answer to the beam's
tokens sent as a prompt with `max_tokens=1, logprobs=K`: `round_params`). Data out: a
`RequestOutput` whose outputs are the W best finished beams, best first
(`BeamSearch.result`).

A round (`advance`), as HF's `_beam_search` does it:
  1. candidates: every running beam's top K tokens, scored by the beam's cumulative
     logprob plus the token's; the K best of all (K = 2W with one EOS id: enough that W
     go on when W of them end);
  2. the W best that did not end (EOS, or the last of `max_tokens`) run the next round;
  3. those of the W best that ended are scored `cum_logprob / generated ** length_penalty`
     and join the finished, of which the W best are kept;
  4. the search stops at `max_tokens`, or once W are finished and the best running beam
     can no longer beat the worst of them (HF's `early_stopping` rules: False, a
     heuristic at the current length; True, as soon as W are finished; "never", at the
     longest length when the penalty favours length).
A beam's top K of its own holds every candidate of it that can be in the round's best
K, so asking each beam for K logprobs selects exactly what HF's top-k over W x V does.

Why rounds of requests and not forks inside the engine: a beam's next round is its
tokens as a new request, and the prefix cache (token-granular) hands that request the
slots of every token but the last, so a round computes one token a beam, as a decode
step would; beams with a common history share its slots. Everything a request has
(failure isolation, recovery, placement by cached prefix, KV tiers, the Ray executor)
then holds for beams unchanged. The cost over forks is a prefix-cache lookup and one
scheduler admission a beam a round.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lamina.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from lamina.sampling.params import MAX_LOGPROBS, SamplingParams


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's `BeamSearchParams` fields (temperature 0 only) plus HF's `early_stopping`."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # vLLM's field; this search is deterministic (HF's)
    length_penalty: float = 1.0  # score = cum_logprob / generated_tokens ** length_penalty
    early_stopping: bool | str = False  # HF's: False, True or "never"
    include_stop_str_in_output: bool = False  # the EOS's text stays in the text
    skip_special_tokens: bool = True

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"BeamSearchParams.{name} {why}, got {getattr(self, name)!r}")

        w, t = self.beam_width, self.max_tokens
        if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= MAX_LOGPROBS // 2:
            bad("beam_width", f"must be an int in [1, {MAX_LOGPROBS // 2}] (each beam asks "
                f"for 2 x beam_width logprobs, at most {MAX_LOGPROBS})")
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            bad("max_tokens", "must be an int >= 1")
        if self.temperature not in (0, 0.0):
            bad("temperature", "must be 0: beam search here is deterministic, as HF's "
                "num_beams with do_sample=False (beam sampling is not offered)")
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or lp != lp:
            bad("length_penalty", "must be a number")
        if self.early_stopping not in (False, True, "never"):
            bad("early_stopping", "must be False, True or 'never'")

    def keep(self, n_eos: int) -> int:
        """K, the candidates a round keeps (HF's `beams_to_keep`)."""
        return max(2, 1 + n_eos) * self.beam_width


@dataclass(frozen=True)
class Beam:
    tokens: tuple[int, ...] = ()  # generated so far
    steps: tuple[TokenLogprob, ...] = ()  # each token's logprob and the round's top K
    cum_logprob: float = 0.0


@dataclass(frozen=True)
class Finished:
    beam: Beam
    score: float  # cum_logprob / len(tokens) ** length_penalty
    reason: str  # "stop" (an EOS) | "length"


class BeamSearch:
    """One prompt's search. `contexts()` -> the token ids each running beam asks about
    this round; `advance(tops)` with each one's top K; `done`; then `result()`."""

    def __init__(self, prompt_ids: list[int], params: BeamSearchParams, eos_ids,
                 prompt=None, logprobs: int = 0):
        """`prompt`: as given (text, a `TokensPrompt` or ids), for the output's text;
        `logprobs`: alternatives each output token shows, if more than K."""
        self.prompt_ids, self.params = list(prompt_ids), params
        self.prompt: str | None = prompt if isinstance(prompt, str) \
            else getattr(prompt, "prompt", None)
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_ids)
        self.k = params.keep(len(self.eos))
        self.shown = max(self.k, logprobs)
        if self.k > MAX_LOGPROBS:
            raise ValueError(f"beam_width {params.beam_width} with {len(self.eos)} EOS ids "
                             f"needs {self.k} logprobs a beam; at most {MAX_LOGPROBS}")
        self.running: list[Beam] = [Beam()]
        self.finished: list[Finished] = []  # the best W, best first
        self.rounds = 0
        self.cached_tokens = 0  # of the prompt, found in the prefix cache
        self.computed_tokens = 0  # tokens the rounds' requests computed (not cached)
        self.error: str | None = None

    @property
    def done(self) -> bool:
        return not self.running

    def round_params(self) -> SamplingParams:
        # ignore_eos: the one token drawn is not used, only the logprobs; an EOS drawn
        # must not make the engine treat the round differently
        return SamplingParams(max_tokens=1, temperature=0, logprobs=self.shown,
                              ignore_eos=True)

    def contexts(self) -> list[list[int]]:
        return [self.prompt_ids + list(b.tokens) for b in self.running]

    def take(self, outs: list[RequestOutput]) -> None:
        """This round's answers, one per running beam (in `contexts()` order). One that
        failed fails the search, naming its error; no other search is touched."""
        tops = []
        for o in outs:
            lps = o.outputs[0].logprobs
            if o.error is not None or not lps:  # failed, or aborted
                why = o.error or f"a beam's request ended {o.outputs[0].finish_reason!r}"
                self.error, self.running = f"beam search round {self.rounds + 1}: {why}", []
                return
            tops.append(lps[0].top)
        if self.rounds == 0:
            self.cached_tokens = outs[0].metrics.get("cached_tokens", 0)
        self.computed_tokens += sum(len(o.prompt_token_ids) - o.metrics.get("cached_tokens", 0)
                                    for o in outs)
        self.advance(tops)

    def advance(self, tops: list[tuple[tuple[int, float], ...]]) -> None:
        """tops[i]: running beam i's K likeliest next tokens (token id, logprob)."""
        p, w = self.params, self.params.beam_width
        if len(tops) != len(self.running):
            raise ValueError(f"{len(tops)} answers for {len(self.running)} beams")
        generated = self.rounds + 1  # tokens each candidate holds
        last = generated >= p.max_tokens
        cands = sorted(((b.cum_logprob + lp, i, tok, lp) for i, b in enumerate(self.running)
                        for tok, lp in tops[i][:self.k]),
                       key=lambda c: (-c[0], c[1], c[2]))[:self.k]
        grown = [(self._grow(self.running[i], tok, lp, tops[i]), last or tok in self.eos)
                 for _, i, tok, lp in cands]
        full = len(self.finished) == w
        if not (full and p.early_stopping is True):
            ended = [Finished(b, b.cum_logprob / generated ** p.length_penalty,
                              "length" if b.tokens[-1] not in self.eos else "stop")
                     for b, stops in grown[:w] if stops]
            # stable: an earlier finished beam stays ahead of a new one of equal score
            self.finished = sorted(self.finished + ended, key=lambda f: -f.score)[:w]
        self.running = [] if last else [b for b, stops in grown if not stops][:w]
        self.rounds = generated
        if self.running and len(self.finished) == w and not self._improvable():
            self.running = []

    def _improvable(self) -> bool:
        """HF's `_check_early_stop_heuristic` (W finished): may the best running beam
        still beat the worst finished one?"""
        p = self.params
        if p.early_stopping is True:
            return False
        n = p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 \
            else self.rounds
        best = self.running[0].cum_logprob / n ** p.length_penalty
        return best > self.finished[-1].score

    @staticmethod
    def _grow(beam: Beam, tok: int, lp: float, top) -> Beam:
        step = TokenLogprob(tok, lp, tuple((int(t), float(v)) for t, v in top))
        return Beam(beam.tokens + (tok,), beam.steps + (step,), beam.cum_logprob + lp)

    def result(self, request_id, decode) -> RequestOutput:
        """The W best finished beams (best first) as one request's outputs.
        `decode(ids, skip_special_tokens)` -> text."""
        p, outs = self.params, []
        metrics = {"cached_tokens": self.cached_tokens, "rounds": self.rounds,
                   "computed_tokens": self.computed_tokens}
        if self.error is not None:
            return RequestOutput(request_id, self.prompt, list(self.prompt_ids),
                                 [CompletionOutput(0, "", [], "error")], metrics,
                                 error=self.error)
        for i, f in enumerate(self.finished):
            ids = list(f.beam.tokens)
            shown = ids if f.reason != "stop" or p.include_stop_str_in_output else ids[:-1]
            outs.append(CompletionOutput(i, decode(shown, p.skip_special_tokens), ids,
                                         f.reason, list(f.beam.steps), score=f.score))
        return RequestOutput(request_id, self.prompt, list(self.prompt_ids), outs, metrics)


def next_round(searches: list[BeamSearch]) -> list[tuple[BeamSearch, list[int]]]:
    """(search, token ids) for every running beam of every search not done."""
    return [(s, ctx) for s in searches if not s.done for ctx in s.contexts()]


def finish_round(asked: list[tuple[BeamSearch, list[int]]], outs: list[RequestOutput]
                 ) -> None:
    """Each search takes its beams' answers (`outs[i]` answers `asked[i]`)."""
    by: dict[int, tuple[BeamSearch, list[RequestOutput]]] = {}
    for (s, _), out in zip(asked, outs, strict=True):
        by.setdefault(id(s), (s, []))[1].append(out)
    for s, got in by.values():
        s.take(got)


def beam_search(prompts: Sequence, params: BeamSearchParams, eos_ids,
                validate: Callable, generate: Callable, decode: Callable,
                concurrency_limit: int | None = None, on_round: Callable | None = None
                ) -> list[RequestOutput]:
    """Every prompt's search run to its end (`LLM.beam_search`, the service client's).
    `validate(prompt, SamplingParams)` -> its token ids (raises naming the problem; all
    prompts are checked before any runs); `generate(token id lists, SamplingParams
    list)` -> their outputs; `decode(ids, skip_special_tokens)` -> text.
    `concurrency_limit` (vLLM's): prompts searched at once (None: all); `on_round()`:
    called after each round (a progress bar)."""
    if concurrency_limit is not None and (isinstance(concurrency_limit, bool) or not
                                          isinstance(concurrency_limit, int)
                                          or concurrency_limit < 1):
        raise ValueError(f"concurrency_limit must be None or an int >= 1, got "
                         f"{concurrency_limit!r}")
    searches = []
    check = SamplingParams(max_tokens=params.max_tokens, temperature=0, n=params.beam_width)
    for i, p in enumerate(prompts):
        try:
            ids = validate(p, check)
        except (ValueError, TypeError) as e:
            raise type(e)(f"prompt {i}: {e}") from None
        searches.append(BeamSearch(ids, params, eos_ids, p))
    step = concurrency_limit or max(1, len(searches))
    for start in range(0, len(searches), step):
        while asked := next_round(searches[start:start + step]):
            finish_round(asked, generate([ctx for _, ctx in asked],
                                         [s.round_params() for s, _ in asked]))
            if on_round is not None:
                on_round()
    return [s.result(i, decode) for i, s in enumerate(searches)]
