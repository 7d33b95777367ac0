"""The engine: scheduler -> step plan -> executor -> step result -> sampler -> outputs.

Data in: prompts (text, token ids, or a `TokensPrompt`: a chat's ids with their text) with
`SamplingParams`, from `LLM` or a server.
Data out: `RequestOutput`s when requests finish, and for streamed requests a partial one
(`finished=False`) every step they draw a token. Bad requests are rejected in
`add_request` before anything is scheduled; other requests keep running. `abort` drops a
request (a client went away) and frees its KV. A failed step (a dead worker) is
recovered when the executor can replace its workers: the running sequences keep the KV
their workers' kept pools hold and recompute the rest, and nothing is lost (up to
`EngineConfig.max_recoveries` failed steps in a row);
otherwise the error propagates. A step that fails because of particular sequences (a
`SequenceFault` naming them) fails only their requests: each ends with finish reason
"error" and `RequestOutput.error` saying why, its KV is freed, and the step runs again
for the others (after `recover` when the fault left the workers mid-step). Steps that
keep failing with no sequence named (past `max_recoveries` in a row) are narrowed to the
one request behind them (`engine/culprit.py`), which then fails alone the same way.
"""
from __future__ import annotations

import itertools
import logging
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from lamina.engine.auto_pipeline import AutoPipeline
from lamina.engine.config import EngineConfig
from lamina.engine.culprit import CulpritSearch
from lamina.engine.detokenizer import IncrementalDetokenizer
from lamina.engine.inputs import TokensPrompt, check_unicode
from lamina.engine.messages import StartedMemory, StepPlan, StepResult
from lamina.engine.outputs import (
    CompletionOutput,
    MemoryScale,
    RequestOutput,
    TokenLogprob,
    WorkersWait,
)
from lamina.engine.scheduler import Scheduler, Sequence
from lamina.engine.sessions import SessionIndex, check_session_id
from lamina.engine.speculative import NgramIndex
from lamina.errors import EngineDead, SequenceFault
from lamina.memory.allocator import KVAllocator, KVAllocatorConfig
from lamina.memory.sparsity_config import (
    FOR_GOOD,
    MEASURED,
    SCORED,
    SparsityConfig,
    evictable,
    layer_shares,
)
from lamina.memory.tier_orders import SlotMove, TierMiss, TierMove
from lamina.sampling.params import SamplingParams
from lamina.sampling.structured import Guide, Guides
from lamina.sampling.token_rules import TokenRules, fit_width, restrict

log = logging.getLogger(__name__)


STEP_HISTORY = 4096  # step timings kept (a long-running server must not grow forever)
ERROR_HISTORY = 100  # recovered step errors kept (their count is `num_recoveries`)
SHORT_POLL_S = 0.05  # a step's wait while only a sequence waiting for more workers is left
PROBE_TOKEN = 0  # the engine's own probe request's prompt (`_probe`): any id will do


@dataclass
class _Request:
    rid: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival: float
    scheduled: float | None = None  # when a step first fed it (its queue time ends)
    first_token: float | None = None
    texts: list[str | None] = field(default_factory=list)  # set when cut at a stop string
    detok: list[IncrementalDetokenizer | None] = field(default_factory=list)  # per sample
    prompt_logprobs: list[TokenLogprob | None] | None = None  # from its (first) prefill
    stream: bool = False
    session: str | None = None  # the conversation it continues
    guides: list[Guide] | None = None  # structured output: per sample, its matcher
    rules: TokenRules | None = None  # allowed_token_ids, bad_words


@dataclass(frozen=True)
class _Draw:
    """One token a step drew for one sequence."""
    seq: Sequence
    token: int
    logprob: tuple | None  # (logprob, top ids, top logprobs) with SamplingParams.logprobs


class LLMEngine:
    def __init__(self, config: EngineConfig, executor, tokenizer, model_config):
        self.config, self.executor, self.tokenizer = config, executor, tokenizer
        self.max_len = int(getattr(model_config, "max_position_embeddings", 0) or 1 << 30)
        self.vocab_size = int(getattr(model_config, "vocab_size", 0) or 1 << 30)
        eos = getattr(model_config, "eos_token_id", None)
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
        self.allocs = [KVAllocator(KVAllocatorConfig(config.num_kv_slots))
                       for _ in range(config.num_memory_workers)]
        self.alloc = self.allocs[0]
        self.sessions = self._session_index(config, executor)
        self.guides = Guides(tokenizer, self.vocab_size)  # structured output's matchers
        layers = self._freeing_layers()  # None: no slot is ever given back
        self.scheduler = Scheduler(config.scheduling, self.allocs,
                                   prefix_caching=config.prefix_caching,
                                   sessions=self.sessions, evict=self._evict_rule(layers),
                                   scores_prompt=lambda seq: self._scores_prompt(seq.params),
                                   drops=self._drop_rule(layers), admits=self._admits,
                                   propose=self._propose if config.speculative_tokens
                                   else None,
                                   sparse=lambda seq: self._kv_policy(seq.params).enabled,
                                   swap=config.preemption_mode != "recompute")
        self._rng = random.Random(config.seed)
        self._rid = itertools.count()
        self._sid = itertools.count()
        self._by_seq: dict[int, tuple[_Request, int]] = {}
        self._reqs: dict[int, _Request] = {}
        self.step_timings: deque[dict] = deque(maxlen=STEP_HISTORY)  # the latest steps
        self.auto: AutoPipeline | None = None  # pipeline "auto"'s trials and choices
        # the errors of the latest failed steps recovered from, and how many in all
        self.recoveries: deque[str] = deque(maxlen=ERROR_HISTORY)
        self.num_recoveries = 0
        self.last_recovery_s: float | None = None  # how long the latest recover took
        self.kv_kept_tokens = 0  # positions whose KV recoveries kept (not recomputed)
        self.memory_workers_lost = 0  # dropped by recoveries that could not replace them
        self.num_failed_requests = 0  # requests failed alone by a SequenceFault
        self._failed_in_row = 0  # failed steps since the last one that ran
        # the sequence waiting for the pools to grow (`Scheduler.short`; None: none),
        # since when, and how long one may (`allow_growth`)
        self._short_seq: int | None = None
        self._short_since = 0.0
        self._grow_wait_s = 0.0
        # request id -> failed steps (no sequence named) it was in since it last drew a
        # token: a request whose prompt trips a fault in its last chunk fails one step
        # in every few (its earlier chunks run), never past max_recoveries in a row
        self._fails: dict[int, int] = {}
        # the search for the request behind steps that keep failing (`_narrow`), or None
        self._search: CulpritSearch | None = None
        self._named: int | None = None  # the last culprit named, while no step ran since
        self._probes: set[int] = set()  # the engine's own requests (`_probe`): no output
        self.culprits: deque[str] = deque(maxlen=ERROR_HISTORY)  # why each was named
        self.num_culprits = 0
        # what cut the last step part-way, until the engine has been reset after it
        self._cut: BaseException | None = None
        # whether the last step raised (unrecovered): the KV it was writing is not known
        self._step_failed = False
        # speculative decoding: tokens guessed, and of them the ones kept
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self._shut: str | None = None  # why `shutdown` closed the engine, once it has
        # what keeps its memory workers' count (a `KeepSize`, set by an `LLM` over Ray;
        # an `EngineLoop` that takes over the steps takes it over), or None
        self.keeper: Any = None

    def _kv_policy(self, params: SamplingParams) -> SparsityConfig:
        """A request's KV sparsity: its own (`SamplingParams.kv_sparsity` / `kv_budget`)
        resolved against the deployment's, or the deployment's."""
        ov = params.kv_override
        return self.config.sparsity if ov is None else ov.resolve(self.config.sparsity)

    def _scores_prompt(self, params: SamplingParams) -> bool:
        """Whether a request's KV policy scores its prompt on the memory workers (h2o,
        snapkv, swa): a cached prefix would skip that scoring, chunks would split it."""
        cfg = self._kv_policy(params)
        return cfg.enabled and cfg.policy in SCORED

    def _freeing_layers(self) -> list | None:
        """The executor's layers when slots may be given back at all; None: `kv_evict`
        off, a layer with a sliding window (it attends its window, not the policy's
        selection), or an executor that does not say its layers."""
        layers = getattr(self.executor, "params", None)
        if not self.config.kv_evict or not layers:
            return None
        if any((p.sliding_window or -1) > 0 for p in layers):
            log.info("kv_evict: layers with a sliding window attend their window; no "
                     "slots are given back")
            return None
        return layers

    def _evict_rule(self, layers: list | None):
        """The scheduler's eviction rule: a decoding sequence whose KV policy (its own or
        the deployment's) is streaming gives back the positions no layer will select
        again (`evictable`). None where nothing may be evicted (`layers` None:
        `_freeing_layers`)."""
        if layers is None:
            return None
        shares: dict = {}

        def rule(seq: Sequence) -> tuple[int, int] | None:
            cfg = self._kv_policy(seq.params)
            if cfg.policy != "streaming" or not cfg.enabled or cfg.layer_budgets in MEASURED:
                return None  # (measured layer weights are known on the workers, not here)
            if cfg not in shares:
                shares[cfg] = layer_shares(cfg, len(layers))
            return evictable(cfg, shares[cfg], seq.num_tokens)

        return rule

    def _drop_rule(self, layers: list | None):
        """The scheduler's rule for reported drops: whether a sequence's KV policy (its
        own or the deployment's) is one that drops keys for good on its memory worker
        (h2o, snapkv), whose slots then go back. None where nothing may be given back
        (`layers` None: `_freeing_layers`)."""
        if layers is None:
            return None

        def rule(seq: Sequence) -> bool:
            cfg = self._kv_policy(seq.params)
            return cfg.enabled and cfg.policy in FOR_GOOD

        return rule

    def _propose(self, seq: Sequence, spare: int) -> tuple[int, ...]:
        """seq's draft this step (`engine/speculative.py`): at most `spare` tokens, none
        past its max_tokens or the context. With structured output: the tokens its
        grammar forces (keys, punctuation), else an n-gram draft as far as the grammar
        takes it. None for a sequence with a KV policy other than dense (it scores or
        drops keys per decode row) or forks still to come."""
        spec, p = self.config.speculative, seq.params
        req, i = self._by_seq[seq.seq_id]
        room = min(spec.num_tokens, spare, self.max_len - seq.num_tokens - 1,
                   (p.max_tokens - len(seq.output) - 1) if p.max_tokens is not None
                   else spec.num_tokens)
        if len(seq.output) < p.min_tokens:  # every draw of it masked alike, or none
            room = min(room, p.min_tokens - len(seq.output) - 1)
        if room <= 0 or seq.forks or self._kv_policy(p).enabled:
            return ()
        if seq.ngrams is None:
            seq.ngrams = NgramIndex(spec)
        room = min(room, seq.ngrams.allowance())
        if not room:
            return ()
        if req.guides:  # what its grammar forces, else an n-gram draft it takes
            guess = req.guides[i].forced()[:room] or seq.ngrams.draft(seq.prompt,
                                                                      seq.output, room)
            return guess[:req.guides[i].valid_prefix(guess)]
        return seq.ngrams.draft(seq.prompt, seq.output, room)

    @staticmethod
    def _session_index(config: EngineConfig, executor) -> SessionIndex | None:
        """The sessions' tier index when the config asks for tiers and the executor's
        memory workers have them."""
        if not config.tiers.enabled:
            return None
        per_token = getattr(executor, "tier_bytes_per_token", lambda: None)()
        if not per_token:
            raise ValueError(f"KV tiers (kv_host_bytes) need memory workers that keep "
                             f"them: the {type(executor).__name__} does not (use the "
                             f"local executor)")
        if config.truncation_reuse and not executor.tier_rotary():
            raise ValueError("truncation_reuse re-rotates saved keys to new positions: the "
                             "model's position encoding is not rotary (e.g. learned "
                             "absolute positions), so kept turns cannot move")
        return SessionIndex(config.tiers, per_token, config.truncation_reuse)

    def tier_stats(self) -> dict:
        """Sessions' KV beyond the pools: occupancy (bytes), traffic and hit counts."""
        if self.sessions is None:
            return {}
        out = {"sessions": len(self.sessions.sessions),
               "host_bytes": self.sessions.host_bytes(),
               "disk_bytes": self.sessions.disk_bytes(), **self.sessions.metrics,
               "parked_tokens": self.scheduler.parked_tokens}
        out.update(getattr(self.executor, "tier_traffic", dict)())
        return out

    # -- requests --
    def validate(self, prompt, params, session_id: str | None = None,
                 priority: int = 0) -> list[int]:
        """Every check a request must pass before it is queued, against the loaded model
        (vocabulary, context) and the engine's limits -> its prompt token ids. Raises
        ValueError / TypeError naming the problem; nothing is changed."""
        check_session_id(session_id)
        self.check_priority(priority)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self._prompt_ids(prompt)
        if params.truncate_prompt_tokens is not None:
            ids = ids[-params.truncate_prompt_tokens:]  # its last tokens (vLLM's)
        if len(ids) >= self.max_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the model's context is "
                             f"{self.max_len}")
        if (params.max_tokens is not None and len(ids) + params.max_tokens > self.max_len
                and not self.config.clamp_max_tokens):
            raise ValueError(f"max_tokens {params.max_tokens} + the prompt's {len(ids)} "
                             f"tokens = {len(ids) + params.max_tokens} exceed the model's "
                             f"context of {self.max_len} tokens; ask for at most "
                             f"{self.max_len - len(ids)} tokens")
        if len(ids) + params.min_tokens > self.max_len:
            raise ValueError(f"min_tokens {params.min_tokens} + the prompt's {len(ids)} "
                             f"tokens exceed the model's context of {self.max_len} tokens")
        for name, toks in (("logit_bias", [t for t, _ in params.logit_bias]),
                           ("stop_token_ids", params.stop_token_ids)):
            if toks and max(toks) >= self.vocab_size:
                raise ValueError(f"{name} names token {max(toks)}; the vocabulary has "
                                 f"{self.vocab_size}")
        if params.n > self.config.max_batch:
            raise ValueError(f"n={params.n} parallel samples exceed max_batch "
                             f"{self.config.max_batch}")
        cap = self.scheduler.capacity()
        if len(ids) + params.n > cap:
            most = self.scheduler.ceiling  # (0: none set)
            raise ValueError(f"prompt has {len(ids)} tokens; the KV pools hold {cap}" + (
                f" at the most memory workers they may grow to ({most})"
                if most >= len(self.allocs) else ""))
        self._check_kv_override(params)
        self._check_whole_prompt(params, len(ids))
        if params.structured_outputs is not None:
            self.guides.check(params.structured_outputs)
        TokenRules.of(params, self.tokenizer, self.vocab_size)
        return ids

    def _check_kv_override(self, params: SamplingParams) -> None:
        """A request's own KV sparsity must mean something against this deployment's."""
        ov = params.kv_override
        if ov is None:
            return
        base = self.config.sparsity
        try:
            cfg = ov.resolve(base)
        except ValueError as e:
            raise ValueError(f"kv_budget={ov.budget!r} on this deployment: {e}") from None
        if ov.policy is None and not cfg.enabled:
            raise ValueError(f"kv_budget={ov.budget!r} without kv_sparsity changes nothing: "
                             f"this deployment's policy is {base.policy!r}; name a policy "
                             f"too (kv_sparsity='topk', ...)")

    def _check_whole_prompt(self, params: SamplingParams, n: int) -> None:
        """A prompt fed in one step (not in chunks: `Scheduler.chunks`) must fit a step."""
        budget = self.config.max_step_tokens
        if n <= budget:
            return
        if params.prompt_logprobs is not None:
            raise ValueError(f"prompt_logprobs needs the prompt in one step: it has {n} "
                             f"tokens, a step takes {budget} (max_step_tokens)")
        if self._scores_prompt(params):
            raise ValueError(f"kv_sparsity {self._kv_policy(params).policy!r} scores the "
                             f"prompt in one step: it has {n} tokens, a step takes {budget} "
                             f"(max_step_tokens)")

    def check_priority(self, priority) -> None:
        """A request's priority: an int; other than 0 only under scheduling_policy
        "priority" (first come, first served has no order to give it)."""
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TypeError(f"priority must be an int, got {type(priority).__name__}")
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} needs scheduling_policy='priority' "
                             f"(this engine serves first come, first served)")

    def _prompt_ids(self, prompt) -> list[int]:
        """A text prompt's token ids, or token ids (a list, or a `TokensPrompt`) checked
        against the vocabulary."""
        if isinstance(prompt, TokensPrompt):
            prompt = list(prompt.prompt_token_ids)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt")
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
            check_unicode(prompt, "prompt")
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            if isinstance(prompt, (bytes, dict)) or not hasattr(prompt, "__iter__"):
                raise TypeError(f"a prompt is text or a list of token ids, got "
                                f"{type(prompt).__name__}")
            ids = list(prompt)
            if not ids:
                raise ValueError("empty prompt")
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                       for t in ids):
                raise ValueError("prompt token ids must be non-negative ints")
            if max(ids) >= self.vocab_size:
                raise ValueError(f"prompt token id {max(ids)} is outside the vocabulary "
                                 f"of {self.vocab_size} tokens")
        if not ids:
            raise ValueError("prompt tokenizes to nothing")
        return ids

    def add_request(self, prompt, params: SamplingParams, stream: bool = False,
                    session_id: str | None = None, priority: int = 0) -> int:
        """`stream`: `step` also returns this request's progress each step it draws.
        `session_id`: the conversation this turn continues; with KV tiers its KV is saved
        when it finishes and brought back for the next turn (any string of 1-128 letters,
        digits, . _ : @ -; a new one starts a session). `priority`: under
        scheduling_policy "priority", lower is served first (may be negative)."""
        self.check_open()
        check_session_id(session_id)
        self.check_priority(priority)
        ids = self.validate(prompt, params)
        # None, or past the context with clamp_max_tokens (validated): what it leaves
        if params.max_tokens is None or len(ids) + params.max_tokens > self.max_len:
            params = replace(params, max_tokens=self.max_len - len(ids))
        rid = next(self._rid)
        seed = params.seed if params.seed is not None else self._rng.randrange(2 ** 62)
        text = prompt.prompt if isinstance(prompt, TokensPrompt) else \
            prompt if isinstance(prompt, str) else None
        req = _Request(rid, text, ids, params, [],
                       time.perf_counter(), stream=stream, session=session_id)
        if params.prompt_logprobs is not None and len(ids) == 1:
            req.prompt_logprobs = [None]  # a one-token prompt: nothing to score
        so = params.structured_outputs
        if so is not None:  # the matchers stay here; the workers get masks
            grammar = self.guides.check(so)
            req.guides = [self.guides.guide(grammar) for _ in range(params.n)]
            params = replace(params, structured_outputs=None)
        req.rules = TokenRules.of(params, self.tokenizer, self.vocab_size)
        if req.rules is not None:  # the engine applies them: they need not cross
            params = replace(params, allowed_token_ids=None, bad_words=())
        for i in range(params.n):
            req.seqs.append(Sequence(next(self._sid), list(ids), params, seed=seed + i,
                                     session=session_id, priority=priority))
            req.texts.append(None)
            req.detok.append(IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
                             if self.tokenizer is not None else None)
        # n > 1: one prefill; the siblings fork the parent's KV after it (scheduler.fork).
        req.seqs[0].forks = req.seqs[1:]
        # registered once whole (a Ctrl-C in between leaves no half request behind);
        # a request known but not queued is one `abort` and `Scheduler.reset` handle
        self._by_seq.update((s.seq_id, (req, i)) for i, s in enumerate(req.seqs))
        self._reqs[rid] = req
        self.scheduler.add(req.seqs[0])
        if session_id is not None and self.sessions is not None:
            self.sessions.queued(session_id)  # pinned; its KV on disk is read back now
        return rid

    def free_slots(self) -> list[int]:
        """Per memory worker: KV slots free now or held only by the prefix cache (freed
        the moment they are needed). With no request running, every slot is one of
        these: anything less is a leak."""
        caches = self.scheduler.caches
        if caches is None:
            return [a.num_free() for a in self.allocs]
        return [a.num_free() + c.evictable() for a, c in zip(self.allocs, caches)]

    def clear_prefix_cache(self) -> int:
        """Drop every cached prefix (the KV no running request holds); -> slots freed."""
        return self.scheduler.clear_cache()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def request_ids(self) -> set[int]:
        """The ids of the requests added and not yet finished or aborted (not the
        engine's own: a culprit search's probes)."""
        return set(self._reqs) - self._probes

    def abort(self, request_id: int) -> RequestOutput | None:
        """Stop a request now and free its KV; its output so far, finish reason "abort"
        for the unfinished samples. None if it is not (or no longer) running."""
        req = self._reqs.get(request_id)
        if req is None:
            return None
        self._settle()
        for seq in req.seqs:  # what it wrote is cached, unless the last step failed
            self.scheduler.abort(seq, keep_kv=not self._step_failed)
        return self._output(req, time.perf_counter())

    def shutdown(self, why: str = "the engine was shut down (LLMEngine.shutdown())") -> None:
        """Stop the executor's workers; later `add_request`s and `step`s raise
        `EngineDead(why)` (whatever the executor: a local one keeps no state of its own
        to refuse with). A second call does nothing."""
        if self._shut is None:
            self._shut = why
            self.executor.shutdown()

    def check_open(self) -> None:
        """Raises `EngineDead`, saying why, once `shutdown` has run."""
        if self._shut is not None:
            raise EngineDead(self._shut)

    # -- the step loop --
    def step(self) -> list[RequestOutput]:
        """Schedule, execute (failing faulty requests alone, recovering dead workers),
        then apply the drawn tokens: -> the outputs of requests that finished, failed or
        (streamed) progressed. A step cut part-way from outside (KeyboardInterrupt,
        SystemExit) re-raises once the engine is reset (`_reset_after_cut`); after a
        step's own error (not recovered) an abort caches none of the aborted KV."""
        self.check_open()
        self._settle()
        try:
            outs = self._step()
        except BaseException as e:
            self._step_failed = True
            if not isinstance(e, Exception):  # not the step's own error: it was cut
                self._cut = e
                self._settle()
            raise
        self._step_failed = False
        if not self._probes:
            return outs
        keep = [o for o in outs if o.request_id not in self._probes]
        self._probes -= {o.request_id for o in outs if o.finished}
        return keep

    def _step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        self._search_can_go_on()
        failed: list[RequestOutput] = []  # requests failed alone this step
        plan = self._pipelined(self._guided(self.scheduler.schedule(), failed))
        for fault in self.scheduler.unplaceable:  # each fails alone, by name
            failed += self._fail(fault, plan.step)
        self.scheduler.unplaceable.clear()
        failed += self._waited_for_workers(plan.step)
        if not (plan.seqs or plan.released or plan.tier_orders) and self.scheduler.short:
            time.sleep(SHORT_POLL_S)  # nothing to run before the pools grow
            return failed
        if failed and not plan.seqs:  # nothing left to run (a step all the same: timed)
            self.step_timings.append({"tokens": 0, "seqs": 0, "drawn": 0,
                                      "step_s": time.perf_counter() - t0})
            return failed
        self._note_scheduled(plan, t0)
        t_run = time.perf_counter()
        result = self._execute(plan, failed)
        if (self.auto is not None and self.config.pipeline == "auto" and result is not None
                and not failed):
            self.auto.observe(plan, "none" if plan.micro_batches == 1 else "rotational",
                              time.perf_counter() - t_run)
        if result is None:
            self.step_timings.append({"tokens": plan.num_tokens, "seqs": len(plan.seqs),
                                      "step_s": time.perf_counter() - t0, "failed": True,
                                      "drawn": 0})
            return failed  # nothing drawn; any lost KV is recomputed from the next step on
        self._failed_in_row, self._named = 0, None
        self._check_result(plan, result)
        if result.dropped:
            self.scheduler.note_dropped(result.dropped)
        now = time.perf_counter()
        self.step_timings.append({"tokens": plan.num_tokens, "seqs": len(plan.seqs),
                                  "step_s": now - t0, **(result.timings or {})})
        drawn = self._drawn(plan, result)
        if self._fails:  # requests that drew have run past whatever failed before
            for d in drawn:
                self._fails.pop(self._rid_of(d.seq.seq_id), None)
        if self._search is not None:
            failed += self._searched(drawn, plan.step)
        return failed + self._apply(drawn, now, plan.step)

    def allow_growth(self, max_workers: int | None, wait_s: float = 120.0) -> None:
        """The memory workers may be grown to `max_workers` by whoever scales them (an
        autoscaler: `lamina.entrypoints.autoscale`), so requests are admitted that fit
        that many pools (with `split_kv`), and a sequence that needs more pools than
        there are waits for them (`Scheduler.short`, which the autoscaler reads) up to
        `wait_s`, then fails alone, by name. None: no growth (the default). It sets
        two fields that each step reads, so any thread may call it."""
        if max_workers is not None and (isinstance(max_workers, bool)
                                        or not isinstance(max_workers, int) or max_workers < 1):
            raise ValueError(f"max_workers must be None or an int >= 1, got {max_workers!r}")
        if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not (
                0 <= wait_s < math.inf):
            raise ValueError(f"wait_s must be a number of seconds >= 0, got {wait_s!r}")
        self.scheduler.ceiling, self._grow_wait_s = max_workers or 0, wait_s

    def waiting_for_workers(self) -> WorkersWait | None:
        """The sequence waiting for more memory workers (`allow_growth`), and how long it
        has waited; None: none waits. Any thread may ask (`lamina status`)."""
        short, seq, since = self.scheduler.short, self._short_seq, self._short_since
        if short is None or short.workers <= len(self.allocs):
            return None  # (grown since the last step: the next one admits it)
        waited = time.monotonic() - since if seq == short.seq_id else 0.0
        return WorkersWait(short.seq_id, short.tokens, short.workers, round(waited, 1),
                           self._grow_wait_s)

    def _waited_for_workers(self, step: int) -> list[RequestOutput]:
        """The sequence waiting for more memory workers (`Scheduler.short`) fails alone
        once it has waited `allow_growth`'s `wait_s`."""
        short, now = self.scheduler.short, time.monotonic()
        if short is None or self._short_seq != short.seq_id:
            if short is not None:
                log.info("sequence %d needs %d KV positions: it waits for %d memory workers "
                         "(there are %d)", short.seq_id, short.tokens, short.workers,
                         len(self.allocs))
            self._short_seq = None if short is None else short.seq_id
            self._short_since = now
            return []
        if now - self._short_since < self._grow_wait_s:
            return []
        self._short_seq, self.scheduler.short = None, None
        return self._fail(SequenceFault([short.seq_id], (
            f"sequence {short.seq_id} needs {short.tokens} KV positions, {short.workers} "
            f"memory workers' pools of {self.config.num_kv_slots} slots; they stayed "
            f"{len(self.allocs)} for {self._grow_wait_s:g} s (the autoscaler's last "
            "failure: `lamina status`)")), step)

    def _note_scheduled(self, plan: StepPlan, now: float) -> None:
        """Requests this step feeds for the first time: their queue time ends now."""
        for work in plan.seqs:
            entry = self._by_seq.get(work.seq_id)
            if entry is not None and entry[0].scheduled is None:
                entry[0].scheduled = now

    def _pipelined(self, plan: StepPlan) -> StepPlan:
        """The plan cut into the pipeline's batches (micro-batches of the step)."""
        if len(plan.seqs) < 2:
            return plan
        if self.config.pipeline == "auto":
            if self.auto is None:
                self.auto = AutoPipeline(self.config.batches)
            return replace(plan, micro_batches=self.auto.micro_batches(plan))
        if self.config.pipeline == "rotational":
            return replace(plan, micro_batches=min(self.config.batches, len(plan.seqs)))
        return plan

    def _guided(self, plan: StepPlan, failed: list[RequestOutput]) -> StepPlan:
        """Each draw of a sequence with structured output carries the tokens its matcher
        allows next (a fork's n first draws share the prompt's: every matcher starts
        alike), less those its `TokenRules` leave out; a draw before its sequence's
        min_tokens leaves out the tokens that would end it (`_unstoppable`). A draft: a
        mask per draw (`SeqWork.allowed`). A request whose rules leave a draw no token
        fails alone (into `failed`); -> the plan without it."""
        if not any(r.guides or r.rules or r.params.min_tokens for r in self._reqs.values()):
            return plan
        seqs, empty = list(plan.seqs), {}
        for k, w in enumerate(seqs):
            req, i = self._by_seq[w.seq_id]
            seq = req.seqs[i]
            ban = self._unstoppable(seq) if w.sample else ()
            if not w.sample or not (req.guides or req.rules or ban):
                continue
            g, rows = req.guides[i] if req.guides else None, w.draft + 1
            masks = (fit_width(g.draft_masks(w.guess) if w.draft else g.allowed(), rows,
                               len(self._any_token)) if g is not None
                     else self._any_token * rows)  # each the vocabulary's width
            tail = (seq.output[max(0, len(seq.output) - req.rules.context):] if req.rules
                    else [])  # what bad words read
            bans = [ban + (req.rules.banned([*tail, *w.guess[:j]]) if req.rules else ())
                    for j in range(rows)]
            allowed = restrict(masks, req.rules.allowed if req.rules else None, bans)
            seqs[k] = replace(w, allowed=allowed)
            width = len(allowed) // rows
            if any(allowed.count(0, r * width, (r + 1) * width) == width
                   for r in range(rows)):
                empty[w.seq_id] = (f"no token may come next: its allowed_token_ids, "
                                   f"bad_words, min_tokens and structured output leave none "
                                   f"(after {len(seq.output)} drawn tokens)")
        for sid, why in empty.items():
            failed += self._fail(SequenceFault([sid], why), plan.step)
        return replace(plan, seqs=tuple(w for w in seqs if w.seq_id in self._by_seq))

    def _unstoppable(self, seq: Sequence) -> tuple[int, ...]:
        """The tokens seq's next draw may not take: while it has fewer than min_tokens,
        those that would end it (EOS unless ignore_eos, its stop_token_ids)."""
        p = seq.params
        if len(seq.output) >= p.min_tokens:
            return ()
        return tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(self.eos_ids))

    @cached_property
    def _any_token(self) -> bytes:
        """The bitmask that allows every token of the vocabulary."""
        return b"\xff" * -(-self.vocab_size // 8)

    def _execute(self, plan: StepPlan, failed: list[RequestOutput]) -> StepResult | None:
        """The executor's result for `plan`, or None when the step failed and the workers
        were recovered. A `SequenceFault` fails its requests alone (into `failed`) and
        the rest of the step runs again; any other error is recovered or raised."""
        while True:
            try:
                return self.executor.execute(plan)
            except TierMiss as e:  # before anything ran: recompute those, run the rest
                plan = self._tier_miss(plan, e)
                if plan.seqs:
                    continue
                return None
            except SequenceFault as e:
                if not any(s.seq_id in e.seq_ids for s in plan.seqs):
                    raise RuntimeError(f"step {plan.step}: a fault blamed sequences "
                                       f"{list(e.seq_ids)}, none of them in the step") from e
                failed += self._fail(e, plan.step)
                if not e.clean and not self._recover(plan, e):
                    raise
                plan = replace(plan, seqs=tuple(s for s in plan.seqs
                                                if s.seq_id in self._by_seq))
                if e.clean and plan.seqs:
                    continue  # the workers kept their state: run the rest of the step
                return None
            except Exception as e:
                if not self._recover(plan, e, failed):
                    raise
                return None

    def _tier_miss(self, plan: StepPlan, miss: TierMiss) -> StepPlan:
        """Loads whose saved KV was missing or corrupt: forget those entries, queue
        the sequences to be computed instead; -> the plan without them."""
        assert self.sessions is not None
        gone = set(miss.seq_ids)
        lost = self.sessions.forget(miss.entries, [o for o in plan.tier_orders
                                                   if o.op == "load" and o.seq_id in gone])
        log.warning("saved KV of sessions %s could not be loaded (%s): their turns are "
                    "computed instead", lost, miss)
        for sid in miss.seq_ids:
            req, i = self._by_seq[sid]
            self.scheduler.requeue(req.seqs[i])
        return replace(plan, seqs=tuple(s for s in plan.seqs if s.seq_id not in gone),
                       tier_orders=tuple(o for o in plan.tier_orders if o.seq_id not in gone))

    def _check_result(self, plan: StepPlan, result: StepResult) -> None:
        if (result.step != plan.step or len(result.seq_ids) != len(result.token_ids)
                or any(s not in self._by_seq for s in result.seq_ids)):
            raise RuntimeError(f"executor answered step {result.step} with "
                               f"{len(result.seq_ids)} ids / {len(result.token_ids)} token "
                               f"rows for plan step {plan.step}")

    def _drawn(self, plan: StepPlan, result: StepResult) -> list[_Draw]:
        """Each drawn token with its sequence (a fork's siblings get theirs here; a
        drafted sequence's tokens in order) and its logprob entry; prompt logprobs are
        stored on their request."""
        none = (None,) * len(result.seq_ids)
        drafts = {w.seq_id: w.draft for w in plan.seqs if w.draft}
        drawn: list[_Draw] = []
        for sid, toks, lp, plp in zip(result.seq_ids, result.token_ids,
                                      result.logprobs or none, result.prompt_logprobs or none):
            req, i = self._by_seq[sid]
            seq = req.seqs[i]
            if plp is not None and req.prompt_logprobs is None:  # a recompute repeats it
                n = len(req.prompt_ids) - 1
                req.prompt_logprobs = [None] + [
                    TokenLogprob(t, v, tuple(zip(ti, tv))) for t, v, ti, tv in
                    zip(req.prompt_ids[1:], plp[0][:n], plp[1][:n], plp[2][:n])]
            if sid in drafts:
                if not 1 <= len(toks) <= drafts[sid] + 1 or (lp is not None
                                                            and len(lp) != len(toks)):
                    raise RuntimeError(f"executor kept {len(toks)} tokens of seq {sid}'s "
                                       f"draft of {drafts[sid]}")
                self.num_draft_tokens += drafts[sid]
                self.num_accepted_tokens += len(toks) - 1
                if seq.ngrams is not None:
                    seq.ngrams.observe(drafts[sid], len(toks) - 1)
                drawn += [_Draw(seq, t, x) for t, x in zip(toks, lp or (None,) * len(toks))]
                continue
            kids = self.scheduler.fork(seq) if seq.forks else []
            if len(toks) != 1 + len(kids) or (lp is not None and len(lp) != len(toks)):
                raise RuntimeError(f"executor drew {len(toks)} tokens for seq {sid}, "
                                   f"expected {1 + len(kids)}")
            drawn += [_Draw(s, t, x) for s, t, x in zip([seq, *kids], toks,
                                                        lp or (None,) * len(toks))]
        return drawn

    def _apply(self, drawn: list[_Draw], now: float, step: int) -> list[RequestOutput]:
        """Append the drawn tokens; -> outputs of finished requests, then of streamed
        requests that progressed, then of requests whose structured output refused a
        token (failed alone)."""
        done: list[RequestOutput] = []
        progressed: dict[int, _Request] = {}
        refused: dict[int, str] = {}  # seq id -> why
        self.step_timings[-1]["drawn"] = 0  # tokens appended (not a draft's past a finish)
        for d in drawn:
            seq = d.seq
            if seq.status == "finished":
                continue  # a drafted sequence that ended at an earlier token of its draft
            req, i = self._by_seq[seq.seq_id]
            if req.guides and not req.guides[i].accept(d.token):
                refused[seq.seq_id] = (f"structured output refused token {d.token}: "
                                       f"{req.guides[i].error or 'not allowed here'}")
                continue
            req.first_token = req.first_token or now
            self.step_timings[-1]["drawn"] += 1
            seq.output.append(d.token)
            if len(seq.output) == 1:  # prefilled: its prompt's KV may serve others now
                self.scheduler.cache(seq, len(seq.prompt))
            detok = req.detok[i]
            if detok is not None and (req.stream or seq.params.stop):
                detok.update(seq.output)  # else: one decode when it finishes
            if d.logprob is not None:
                lp = d.logprob
                seq.logprobs.append(TokenLogprob(d.token, lp[0], tuple(zip(lp[1], lp[2]))))
            reason = self._finish_reason(seq, req, i)
            if reason:
                if i == 0 and req.session is not None and self.sessions is not None:
                    self._save_session(seq)
                self.scheduler.finish(seq, reason)
                if all(s.status == "finished" for s in req.seqs):
                    done.append(self._output(req, now))
                    progressed.pop(req.rid, None)
                    continue
            if req.stream:
                progressed[req.rid] = req
        for seq in ({d.seq.seq_id: d.seq for d in drawn}.values()
                    if self.scheduler.propose is not None else ()):
            if seq.status == "running" and seq.sent > seq.num_tokens - 1:
                self.scheduler.trim(seq)  # a draft's positions past the kept tokens
        failed = []
        for sid, why in refused.items():
            if sid in self._by_seq:  # a sibling's refusal may have failed it already
                progressed.pop(self._by_seq[sid][0].rid, None)
                failed += self._fail(SequenceFault([sid], why), step)
        return (done + [self._output(req, now, final=False) for req in progressed.values()]
                + failed)

    def _save_session(self, seq: Sequence) -> None:
        """A session's turn finished: its KV (every position but the last drawn token's)
        goes to its worker's host tier, from the first position not saved yet; of a KV
        split over workers, the part on its first worker (the next turn computes the
        rest)."""
        assert seq.session is not None
        self.scheduler.save(seq, seq.session, seq.num_tokens - 1)

    def _fail(self, fault: SequenceFault, step: int) -> list[RequestOutput]:
        """Fail the requests owning the faulty sequences alone: every sample of each is
        dropped from the scheduler (its KV freed) and ends with finish reason "error"."""
        reqs = {self._by_seq[s][0].rid: self._by_seq[s][0] for s in fault.seq_ids
                if s in self._by_seq}
        outs = []
        for req in reqs.values():
            for seq in req.seqs:
                self.scheduler.abort(seq, "error")
            msg = f"request {req.rid} failed in step {step}: {fault}"
            log.error("%s; the other requests go on", msg)
            outs.append(self._output(req, time.perf_counter(), error=msg))
        self.num_failed_requests += len(outs)
        return outs

    def _recover(self, plan, error: BaseException,
                 failed: list[RequestOutput] | None = None) -> bool:
        """A failed step (a dead worker, a broken data plane): if the executor can bring
        its workers back, every running sequence is preempted (its KV is gone) and will be
        recomputed from its prompt and the tokens it already drew, so no request is lost
        and no drawn token changes. `failed` is given when no sequence was named: steps
        failing past max_recoveries in a row are then narrowed to one request (`_narrow`),
        failed alone into it. False (the caller re-raises) when recovery is off, the
        steps keep failing and no one request is behind them, or recovery fails."""
        what = f"step {plan.step} failed: {type(error).__name__}: {error}"
        self._failed_in_row += 1
        stuck = self._count_failure(plan) if failed is not None else None
        if failed is not None and (self._search is not None or stuck is not None
                                   or self._failed_in_row > self.config.max_recoveries):
            if not self._narrow(plan, what, failed, stuck):
                return False
        elif self._search is None and self._failed_in_row > self.config.max_recoveries:
            # it keeps failing: give up (a search's narrowing failures are its own count)
            log.error("%s; %d failed steps in a row (max_recoveries=%d)", what,
                      self._failed_in_row, self.config.max_recoveries)
            return False
        n, total = len(self.scheduler.running), sum(s.num_tokens for s in self.scheduler.running)
        kept_tokens = self._bring_back(error, what, plan)
        if kept_tokens is None:
            return False
        search = self._search
        row = (f"{self._failed_in_row} in a row, at most {self.config.max_recoveries}"
               if search is None else f"searching: {len(search.probe)} of the "
               f"{len(search.suspects)} requests still suspected run next")
        log.warning("%s; workers recovered in %.2f s (%s); %d sequences back to the queue, "
                    "the KV of %d of their %d positions kept, the rest to be recomputed",
                    what, self.last_recovery_s, row, n, kept_tokens, total)
        return True

    def _bring_back(self, error: BaseException, what: str,
                    plan: StepPlan | None = None) -> int | None:
        """The executor's workers back (`Executor.recover`), the KV of lost pools dropped
        from the prefix cache and the sessions' index, every running sequence requeued
        (what a kept pool holds of it kept for it) -> the positions kept, or None when
        the workers cannot be brought back."""
        t = time.perf_counter()
        try:
            ok = self.executor.recover(error)
        except Exception as e:  # noqa: BLE001 - the original error is what gets raised
            log.error("%s; recovery failed: %s: %s", what, type(e).__name__, e)
            return None
        if not ok:
            return None
        lost = self.executor.memory_lost()  # (dropped in `_recovered`, after the requeue)
        now = [w for w in range(len(self.allocs)) if w not in lost]
        kept = frozenset(now[w] for w in self.executor.kv_kept())  # by today's indices
        self.scheduler.clear_cache(set(range(len(self.allocs))) - kept)  # pools gone
        # the failed step's tier loads may not have finished: nothing of them counts
        loading = {o.seq_id for o in plan.tier_orders if o.op == "load"} if plan else set()
        intact = self._intact(plan, kept, loading) if plan is not None else {}
        self._loads_undone(loading)
        kept_tokens = self.scheduler.preempt_all(intact)
        self.kv_kept_tokens += kept_tokens
        self._recovered(what, t)
        return kept_tokens

    def _recovered(self, what: str, since: float) -> None:
        """After the workers were reset or replaced and every running sequence requeued:
        the sessions' saved KV went with the workers' tiers, no slot may be left held
        (`_check_released`), and the recovery is counted."""
        if self.sessions is not None:
            for w in range(len(self.allocs)):
                self.sessions.lost_worker(w)
        self._forget_workers(self.executor.memory_lost(), what)
        self._check_released()
        self.recoveries.append(what)
        self.num_recoveries += 1
        self.last_recovery_s = time.perf_counter() - since

    def _forget_workers(self, lost: tuple[int, ...], what: str) -> None:
        """The memory workers `lost` (a recovery could not replace them) go from the
        scheduler; the others are numbered 0.. again, as the executor numbers them."""
        if not lost:
            return
        self.scheduler.drop_workers(lost)
        self.alloc = self.allocs[0]
        self.config = replace(self.config, num_memory_workers=len(self.allocs))
        self.memory_workers_lost += len(lost)
        log.warning("%s; memory workers %s could not be replaced: the engine goes on with "
                    "%d (min_live_memory_workers=%d), their sequences' KV computed again",
                    what, ", ".join(map(str, lost)), len(self.allocs),
                    self.config.min_live_memory_workers)

    def _settle(self) -> None:
        """If a step was cut part-way and the engine not yet reset after it (the cut
        came during the reset itself), reset it now."""
        if self._cut is not None:
            self._reset_after_cut(self._cut)
            self._cut = None

    def _reset_after_cut(self, cause: BaseException) -> None:
        """A step cut wherever it was (a second Ctrl-C: `LLM.generate`): the scheduler's
        tables, the allocators, the workers' per-sequence state and any KV the step
        half wrote cannot be trusted. The workers are reset (`Executor.recover`, as
        after a failed step), the scheduler starts again from the unfinished sequences
        (`Scheduler.reset`: each computed again from its tokens so far; the prefix
        cache emptied), the sessions' saved KV is forgotten. Raises when the workers
        cannot be brought back."""
        what = f"a step cut part-way ({type(cause).__name__})"
        t = time.perf_counter()
        if not self.executor.recover(cause):
            raise RuntimeError(f"{what}; its workers could not be brought back")
        requeued = self.scheduler.reset([s for r in self._reqs.values() for s in r.seqs])
        self._recovered(what, t)
        log.warning("%s; workers reset in %.2f s, prefix cache emptied, %d sequences back "
                    "to the queue to be computed again", what, self.last_recovery_s,
                    requeued)

    def flush(self) -> bool:
        """While no request is in the engine: send the workers what the last steps left
        for the next plan (the tables of sequences that ended, to drop; tier orders: a
        finished turn's save, the drop of a preempted sequence's saved KV), in a step
        with no rows, so an idle engine's workers hold nothing it no longer needs and
        a session's KV is in its tier at once. The serving loop calls it when it goes
        idle, `LLM.generate` when it returns. -> whether a step was sent."""
        self.check_open()
        self._settle()
        if self.has_unfinished() or not self.scheduler.owes_workers():
            return False
        plan = self.scheduler.schedule()
        assert not plan.seqs, plan.seqs
        self._execute(plan, [])
        return True

    def check_workers(self) -> str | None:
        """While no request is in the engine: whether every worker answers
        (`Executor.check_workers`); a dead or silent one is replaced now, not found by
        the next request's step (after `worker_timeout_s` or `step_timeout_s` when it
        hangs). -> what was found and done, or None (all well, or requests to serve:
        their steps find failures). Raises when the workers cannot be brought back."""
        if self.has_unfinished():
            return None
        found = self.executor.check_workers()
        if not found:
            return None
        what = f"idle check: {'; '.join(found)}"
        if self._bring_back(RuntimeError(what), what) is None:
            raise RuntimeError(f"{what}; the workers could not be brought back")
        log.warning("%s; workers recovered in %.2f s", what, self.last_recovery_s)
        return what

    def scale_memory_workers(self, n: int, started: StartedMemory | None = None
                             ) -> MemoryScale:
        """Change the number of memory workers to `n`, between steps (the caller's
        thread is the one that steps), requests running or not. More: the executor
        starts them (`Executor.start_memory_workers`; their pools have this one's
        slots), unless `started` holds them already (started beside the steps, so
        only their wiring holds the engine), and adds them; new sequences are placed
        on them from the next step, split KV spills onto them. Fewer: the last ones
        leave (`_shrink`). Refused (ValueError, nothing changed, `started` stopped)
        when a request in the engine would no longer fit the pools. -> what was done."""
        try:
            self.check_open()
            self._settle()
            if n < 1:
                raise ValueError(f"memory workers must be >= 1, not {n}")
            if started is not None and (started.first, started.count) != (
                    len(self.allocs), n - len(self.allocs)):
                raise ValueError(f"memory workers {started.first}.."
                                 f"{started.first + started.count - 1} were started, but "
                                 f"{len(self.allocs)} -> {n} needs others")
        except BaseException:
            if started is not None:
                self.executor.discard_memory_workers(started)
            raise
        before, t = len(self.allocs), time.perf_counter()
        done = MemoryScale(before, n, 0, 0, 0, 0.0)
        if n > before:  # (each call raises having stopped what it started: nothing changed)
            self.executor.add_memory_workers(
                started or self.executor.start_memory_workers(before, n - before))
            self.scheduler.add_workers([KVAllocator(KVAllocatorConfig(self.config.num_kv_slots))
                                        for _ in range(n - before)])
        elif n < before:
            self._check_fits(n)
            done = self._shrink(n)
        self.config = replace(self.config, num_memory_workers=n)
        done = replace(done, seconds=time.perf_counter() - t)
        log.info("memory workers %d -> %d in %.2f s: %d running sequences moved (%d KV "
                 "positions), %d preempted, %d positions to compute again, %d saved "
                 "positions moved to the workers kept", before, n, done.seconds,
                 done.relocated, done.relocated_tokens, done.preempted,
                 done.recompute_tokens, done.moved_tokens)
        return done

    def _shrink(self, n: int) -> MemoryScale:
        """Workers n.. leave. Each running sequence with KV on one moves it into kept
        pools that have room (`Scheduler.retire_workers`, `Executor.move_kv`) and goes
        on; the others are preempted: with swap their parts are saved to their
        workers' tiers, and the saved entries on the leaving workers (those parts,
        sessions' KV) are moved into kept workers' host tiers first
        (`Scheduler.relocations`, `Executor.move_tiers`, in a step with no rows that
        carries the saves), so a readmission loads them rather than computing them
        again; what cannot move (no tiers, no kept worker free for a part, a source
        that fails) is computed again. Their cached prefixes go."""
        before = len(self.allocs)
        if self.sessions is not None and self.scheduler.owes_workers():
            # saves still queued read slots that a move may be given (evicted prefixes)
            self._execute(self.scheduler.orders_plan(), [])
        done = self.scheduler.retire_workers(n)
        kv_moved, kv_moves, hit = done.moved, done.moves, done.preempted
        if kv_moves and not self._move_kv(kv_moves):
            self.scheduler.unmove(kv_moved)
            kv_moved, kv_moves, hit = [], (), kv_moved + hit
        moved: dict[str, int] = {}
        if self.sessions is not None:
            wanted = {k: w for k, w in self.scheduler.relocations(n).items()
                      if k in self.sessions.sessions}
            if self._execute(self.scheduler.orders_plan(), []) is not None and wanted:
                moved = self._move_tiers(wanted)
            for w in range(n, before):
                self.sessions.lost_worker(w)
        self.executor.remove_memory_workers(n)
        index = self.sessions.sessions if self.sessions is not None else {}
        tokens = sum(len(index[k].tokens) for k in moved if k in index)  # (`_balance`)
        return MemoryScale(before, n, len(hit), self._lost(hit, n), tokens, 0.0,
                           relocated=len(kv_moved),
                           relocated_tokens=sum(len(m.src_slots) for m in kv_moves))

    def _lost(self, hit: list[Sequence], n: int) -> int:
        """Positions of the preempted sequences `hit` that neither a kept pool nor a
        kept tier holds (computed again)."""
        again = 0
        for seq in hit:
            saved = 0
            for p in seq.parts:
                e = self.sessions.sessions.get(self.scheduler.part_key(seq, p)) \
                    if self.sessions is not None else None
                if e is None or e.worker >= n:
                    break
                saved = p.end
            again += seq.lost - max(seq.kept, saved)
        return again

    def _move_kv(self, moves: tuple[SlotMove, ...]) -> bool:
        """Copy running sequences' KV off the leaving workers (`Executor.move_kv`) ->
        whether it was done; a failure is logged (those sequences are preempted)."""
        try:
            self.executor.move_kv(moves)
            return True
        except Exception as e:  # noqa: BLE001 - the scale-down goes on without them
            log.warning("moving running sequences' KV off the leaving memory workers failed "
                        "(%s: %s): they are preempted", type(e).__name__, e)
            return False

    def _move_tiers(self, wanted: dict[str, int]) -> dict[str, int]:
        """Entries {key: kept worker} moved there (`Executor.move_tiers`) -> those that
        were; a failed move is logged and moves none (their KV is computed again)."""
        assert self.sessions is not None
        index = self.sessions.sessions
        moves = tuple(TierMove(index[k].id, index[k].worker, w) for k, w in wanted.items())
        try:
            ids = self.executor.move_tiers(moves)
        except Exception as e:  # noqa: BLE001 - the scale-down goes on without them
            log.warning("moving saved KV off the leaving memory workers failed (%s: %s): "
                        "it is computed again", type(e).__name__, e)
            return {}
        moved = {k: w for k, w in wanted.items() if index[k].id in ids}
        self.sessions.relocated(moved)
        return moved

    def _check_fits(self, n: int) -> None:
        """Refuse `n` memory workers when a request in the engine would not fit them (one
        sequence's pool, or with `split_kv` all n)."""
        cap = self.scheduler.capacity(n)
        live = [(len(s.tokens), s.seq_id, r.rid) for r in self._reqs.values() for s in r.seqs
                if s.status != "finished"]
        size, sid, rid = max(live, default=(0, -1, -1))
        if size + 1 > cap:
            raise ValueError(f"{n} memory workers hold {cap} KV positions a sequence; "
                             f"sequence {sid} of request {rid} has {size} tokens")

    def _intact(self, plan: StepPlan, kept: frozenset[int],
                loading: set[int]) -> dict[int, int]:
        """{sequence id: positions whose KV is written} for each running sequence held
        whole by a pool the recovery kept: the positions before its work in the failed
        step (that step may have written some of its own, not all), or before its
        unfed prompt. Not a sequence in `loading` (the step carried its tier load)."""
        start = {w.seq_id: w.start_pos for w in plan.seqs}
        return {s.seq_id: start.get(s.seq_id, s.written)
                for s in self.scheduler.running
                if len(s.segments) == 1 and s.worker in kept and s.seq_id not in loading}

    def _loads_undone(self, loading: set[int]) -> None:
        """The running sequences in `loading`, whose first admission's tier load the
        failed step carried, reused nothing from the tiers (their KV is computed again):
        their metrics say so (`tier_cached_tokens` 0, `cached_tokens` the pool's part
        only). A readmission's figures are its first admission's: they stand."""
        for s in self.scheduler.running:
            if s.seq_id in loading and not s.num_preemptions:
                s.cached, s.tier_cached = s.cached - s.tier_cached, 0

    def _check_released(self) -> None:
        """After a recovery every slot is free but those the prefix cache holds: a slot
        held by no one would leak for good."""
        caches = self.scheduler.caches
        held = [a.config.num_slots - a.num_free() - (caches[w].size if caches else 0)
                for w, a in enumerate(self.allocs)]
        if any(held):
            raise RuntimeError(f"KV slots still held after recovery: {held}")

    # -- the request behind steps that keep failing (engine/culprit.py) --
    @property
    def searching(self) -> bool:
        """Whether a culprit search runs (only some waiting requests are admitted)."""
        return self._search is not None

    def _rid_of(self, seq_id: int) -> int:
        """The id of the request a sequence belongs to."""
        return self._by_seq[seq_id][0].rid

    def _admits(self, seq: Sequence) -> bool:
        """The scheduler's gate: while a culprit search runs, only its probe and the
        requests it cleared are admitted."""
        return self._search is None or self._search.admits(self._rid_of(seq.seq_id))

    def _count_failure(self, plan: StepPlan) -> tuple[int, int] | None:
        """A step failed with no sequence named: each of its requests was in one more.
        -> (request, its count) for one past max_recoveries since it last drew, or None."""
        stuck = None
        for rid in {self._rid_of(s.seq_id) for s in plan.seqs if s.seq_id in self._by_seq}:
            n = self._fails[rid] = self._fails.get(rid, 0) + 1
            if n > self.config.max_recoveries and (stuck is None or n > stuck[1]):
                stuck = (rid, n)
        return stuck

    def _narrow(self, plan: StepPlan, what: str, failed: list[RequestOutput],
                stuck: tuple[int, int] | None = None) -> bool:
        """A step failed with no sequence named, past max_recoveries in a row, with a
        request that was in more than max_recoveries failed steps since it last drew
        (`stuck`), or while a search runs: start the search, narrow it, or name the
        request behind the failures (it fails alone, into `failed`). False: give up (the
        engine stops)."""
        cfg, search = self.config, self._search
        gave_up = (f"{what}; {self._failed_in_row} failed steps in a row"
                   if stuck is None or self._failed_in_row > cfg.max_recoveries else
                   f"{what}; request {stuck[0]} was in {stuck[1]} failed steps since it "
                   f"last drew a token")
        rids = {self._rid_of(s.seq_id) for s in plan.seqs if s.seq_id in self._by_seq}
        if cfg.max_recoveries == 0 or not cfg.find_culprits or not rids:  # nobody to look for
            self._search = None
            log.error("%s (max_recoveries=%d)", gave_up, cfg.max_recoveries)
            return False
        if search is None:
            self._search = CulpritSearch(rids)
            self._search.error = what
            log.warning("%s: looking for the request behind them among the %d in the step",
                        gave_up, len(rids))
            return True
        search.error = what
        if search.accused is not None and not search.confirmed(rids):
            return True  # the others alone run again
        if search.accused is not None:
            log.error("%s: they fail whatever runs (request %d was named just before, and "
                      "the engine's own one-token request failed without it)", gave_up,
                      search.accused)
            self._search = None
            return False
        culprit = search.failed(rids)
        if culprit is None:
            if search.done:
                self._search = None
                log.warning("%s, without the requests being tried: not one request's "
                            "doing; the search ends", what)
                return self._failed_in_row <= cfg.max_recoveries
            return True
        if self._named is not None:  # no step ran since the last one named
            # its alibi is a request of the engine's own, alone: the others could hold a
            # culprit too, and their step failing would stop the engine for everyone
            search.alibi(culprit, [self._probe()])
            return True
        failed += self._convict(culprit, plan.step)
        return True

    def _probe(self) -> int:
        """A request of the engine's own, one token in and one out, run alone: the alibi
        of a request named right after another, with no step run since. If steps fail
        with it too, they fail whatever runs. Its output is nobody's: `step` leaves it
        out."""
        rid = self.add_request([PROBE_TOKEN], SamplingParams(max_tokens=1, temperature=0))
        self._probes.add(rid)
        return rid

    def _searched(self, drawn: list[_Draw], step: int) -> list[RequestOutput]:
        """A step ran while a search goes on: its drawers are cleared, or, when it was
        an accused request's alibi, that request is named."""
        search = self._search
        assert search is not None
        if search.accused is not None:  # the others ran without it
            return self._convict(search.accused, step)
        search.drew({self._rid_of(d.seq.seq_id) for d in drawn})
        if search.done:
            self._search = None
            log.warning("every request the failed steps held ran again: not one request's "
                        "doing; the search ends")
        return []

    def _search_can_go_on(self) -> None:
        """Before a step: end a search that cannot go on (its requests left)."""
        search = self._search
        if search is None:
            return
        if search.accused is not None and search.accused not in self._reqs:
            self._search = None  # the accused request left (aborted) before its alibi
        elif search.done or not (self.scheduler.running or any(
                self._admits(q) for q in self.scheduler.waiting)):
            self._search = None

    def _convict(self, rid: int, step: int) -> list[RequestOutput]:
        """Name `rid` as the request behind the failed steps: it fails alone; the search
        ends and failures are counted afresh."""
        search = self._search
        assert search is not None
        self._search, self._named, self._failed_in_row = None, rid, 0
        why = (f"every step it ran in failed ({self.config.max_recoveries + 1 + search.failures}"
               f" failed steps, narrowed to this request by running parts of the batch "
               f"alone); the last: {search.error}")
        self.culprits.append(f"request {rid}: {why}")
        self.num_culprits += 1
        req = self._reqs[rid]
        return self._fail(SequenceFault([s.seq_id for s in req.seqs], why), step)

    def _finish_reason(self, seq: Sequence, req: _Request, i: int) -> str | None:
        p, tok, d = seq.params, seq.output[-1], req.detok[i]
        early = len(seq.output) < p.min_tokens  # only the length may end it yet
        if not early and ((tok in self.eos_ids and not p.ignore_eos)
                          or tok in p.stop_token_ids):
            if d is not None and not p.include_stop_str_in_output:  # vLLM's: the text
                # leaves the stop token out (one decode, when the sample ends)
                req.texts[i] = self.tokenizer.decode(seq.output[:-1],
                                                     skip_special_tokens=p.skip_special_tokens)
            return "stop"
        if req.guides and req.guides[i].done:  # the structure is complete
            return "stop"
        # max_tokens None (resolved when the request came) would end at the context;
        # the pools are a context too: a sequence that gives no slot back and holds
        # every one of them has no room for its next position, even alone
        length = ((p.max_tokens is not None and len(seq.output) >= p.max_tokens)
                  or seq.num_tokens >= self.max_len
                  or (seq.num_tokens > self.scheduler.capacity() and seq.holes_from is None))
        if length and d is not None:
            d.flush(seq.output)  # a stop string may sit in a held-back tail
        if p.stop and d is not None:
            hit = d.find_stop(p.stop)  # (searched early too: the text after is searched)
            if hit is not None and not early:
                kept = (next(len(x) for x in p.stop if d.text.startswith(x, hit))
                        if p.include_stop_str_in_output else 0)
                req.texts[i] = d.text[:hit + kept]
                return "stop"
        return "length" if length else None

    def _text(self, seq: Sequence, req: _Request, i: int) -> str:
        """The sample's text; while it runs, only the part that cannot change: no
        trailing half character, nothing that may be the start of a stop string."""
        d = req.detok[i]
        if req.texts[i] is not None or d is None:
            return req.texts[i] or ""
        if seq.status == "finished":
            d.flush(seq.output)
            return d.text
        text = d.text  # never ends in half a character: the detokenizer holds it back
        hold = max((k for s in seq.params.stop for k in range(1, len(s))
                    if text.endswith(s[:k])), default=0)
        return text[:len(text) - hold]

    def _output(self, req: _Request, now: float, final: bool = True,
                error: str | None = None) -> RequestOutput:
        outs = [CompletionOutput(i, self._text(seq, req, i), list(seq.output),
                                 seq.finish_reason,
                                 list(seq.logprobs) if seq.params.logprobs is not None
                                 else None)
                for i, seq in enumerate(req.seqs)]
        plp = req.prompt_logprobs
        if final and req.session is not None and self.sessions is not None:
            self.sessions.done(req.session)
        if not final:
            return RequestOutput(req.rid, req.prompt, req.prompt_ids, outs, finished=False,
                                 prompt_logprobs=plp)
        if self._search is not None:
            self._search.forget(req.rid)
        self._fails.pop(req.rid, None)
        n_out = sum(len(s.output) for s in req.seqs)
        ttft = None if req.first_token is None else req.first_token - req.arrival
        longest = max(len(s.output) for s in req.seqs)  # its samples decode side by side
        metrics = {"ttft_s": ttft, "e2e_s": now - req.arrival,
                   "queue_s": None if req.scheduled is None else req.scheduled - req.arrival,
                   # after the first token, seconds per token of its longest sample
                   "tpot_s": (now - req.first_token) / (longest - 1)
                   if req.first_token is not None and longest > 1 else None,
                   "output_tokens": n_out,
                   "preemptions": sum(s.num_preemptions for s in req.seqs),
                   "cached_tokens": req.seqs[0].cached,  # prompt tokens reused
                   "tier_cached_tokens": req.seqs[0].tier_cached,  # of them, from tiers
                   # positions readmissions after preemptions computed again, all samples
                   "recomputed_tokens": sum(s.recomputed for s in req.seqs)}
        for s in req.seqs:  # (pop: one cut part-way here is finished by its abort)
            self._by_seq.pop(s.seq_id, None)
        self._reqs.pop(req.rid, None)
        return RequestOutput(req.rid, req.prompt, req.prompt_ids, outs, metrics,
                             prompt_logprobs=plp, error=error)
