"""Speculative decoding by n-gram prompt lookup: the drafts equal a brute-force search's;
the scheduler feeds them with exact slot ids and gives back the slots of the guesses
not kept; the engine's tokens equal HF's greedy ones and, sampled, the tokens drawing
one a step gives (seeds, penalties, logprobs, stop strings, max_tokens), with fewer
steps; recoveries and preemption keep the tokens; no slot leaks."""
import random

import pytest

from lamina.engine.config import EngineConfig
from lamina.engine.messages import SeqWork
from lamina.engine.scheduler import Scheduler, SchedulerConfig, Sequence
from lamina.engine.speculative import NgramIndex, SpeculativeConfig
from lamina.entrypoints.metrics import EngineMetrics
from lamina.memory.allocator import KVAllocator, KVAllocatorConfig
from lamina.sampling.params import SamplingParams

from .test_engine import GREEDY, engine, run
from .test_recovery import FlakyExecutor

P = SamplingParams(max_tokens=8)


def _brute(tokens, k, lo, hi):
    """The latest earlier occurrence of the longest suffix (n = hi..lo) -> what followed."""
    for n in range(min(hi, len(tokens)), lo - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # occurrence tokens[end-n:end]
            if tokens[end - n:end] == suffix:
                return tuple(tokens[end:end + k])
    return ()


@pytest.mark.parametrize("lo, hi", [(1, 1), (1, 3), (2, 4)])
def test_drafts_equal_a_brute_force_search(lo, hi):
    """Random sequences over a small vocabulary, grown a few tokens at a time (the
    index is extended, never rebuilt): every draft is the brute-force search's."""
    rng = random.Random(lo * 10 + hi)
    cfg = SpeculativeConfig(5, hi, lo)
    for _ in range(30):
        prompt = [rng.randrange(6) for _ in range(rng.randint(1, 20))]
        output: list[int] = []
        ix = NgramIndex(cfg)
        while len(output) < 40:
            assert ix.draft(prompt, output, 5) == _brute(prompt + output, 5, lo, hi)
            output += [rng.randrange(6) for _ in range(rng.randint(1, 3))]


def test_config_validated():
    with pytest.raises(ValueError, match="speculative_tokens must be an int in 0..64"):
        EngineConfig(speculative_tokens=-1)
    with pytest.raises(ValueError, match="speculative_ngram_min .3. must not exceed"):
        EngineConfig(speculative_ngram_min=3, speculative_ngram_max=2)


def test_a_draft_is_fed_with_exact_slots_and_the_misses_go_back():
    """A decoding sequence with a draft of 3: its last token and the guess at positions
    3..6 over four fresh slots; keeping 1 of the guesses (2 tokens drawn) gives back the
    slots of positions 5..6, the first of them handed out next, and the next plan sends
    the table from position 5."""
    alloc = KVAllocator(KVAllocatorConfig(16))
    s = Scheduler(SchedulerConfig(4, 100), alloc,
                  propose=lambda seq, spare: (7, 8, 9) if seq.output else ())
    a = Sequence(0, [5, 6, 7], P)
    s.add(a)
    assert s.schedule().seqs == (SeqWork(0, (5, 6, 7), 0, (0, 1, 2), params=P),)
    a.output.append(6)
    plan = s.schedule()
    assert plan.seqs == (SeqWork(0, (6, 7, 8, 9), 3, (3, 4, 5, 6), params=P, slots_from=3,
                                 draft=3),)
    assert plan.seqs[0].guess == (7, 8, 9) and plan.seqs[0].next_pos == 7
    a.output += [7, 1]  # the draw after 6 matched the guess 7; after 7 came 1, not 8
    s.trim(a)
    assert alloc.slots(0) == [0, 1, 2, 3, 4] and alloc.free_list()[:2] == [5, 6]
    s.propose = None
    assert s.schedule().seqs == (SeqWork(0, (1,), 5, (5,), params=P, slots_from=5),)


def test_a_draft_never_preempts_and_respects_the_step_budget():
    """Drafts take only free slots and the tokens the step budget leaves: with 2 free
    slots a draft of 2 (3 slots) is not fed, the sequence decodes plainly; nor one that
    would take the slot a newer sequence's next token needs; with a budget of 3 tokens
    for 2 decoding sequences, 1 guessed token in all."""
    alloc = KVAllocator(KVAllocatorConfig(5))
    s = Scheduler(SchedulerConfig(4, 100), alloc, propose=lambda seq, spare: (1, 2)[:spare])
    a = Sequence(0, [5, 6, 7], P)
    s.add(a)
    s.schedule()
    a.output.append(4)
    assert s.schedule().seqs == (SeqWork(0, (4,), 3, (3,), params=P, slots_from=3),)
    # 2 free slots, two decoding sequences: the older one's draft of 1 (2 slots) would
    # leave none for the newer one's next token, so neither drafts, none is preempted
    s = Scheduler(SchedulerConfig(4, 100), KVAllocator(KVAllocatorConfig(8)),
                  propose=lambda seq, spare: (1,) if seq.seq_id == 0 else ())
    for i in (0, 1):
        s.add(Sequence(i, [5, 6, 7], P))
    s.schedule()
    for q in s.running:
        q.output.append(4)
    plan = s.schedule()
    assert [(w.seq_id, w.draft, w.slots) for w in plan.seqs] == [(0, 0, (6,)), (1, 0, (7,))]
    assert not s.waiting
    s2 = Scheduler(SchedulerConfig(4, 3), KVAllocator(KVAllocatorConfig(20)),
                   propose=lambda seq, spare: (1, 2)[:spare])
    for i in (0, 1):
        s2.add(Sequence(i, [5, 6], P))
    s2.schedule()  # 2 + 2 tokens > 3: seq 1's prompt goes in chunks
    for _ in range(3):
        for q in s2.running:
            if not q.pending:
                q.output.append(3)  # the draw after the last token: no guess kept
                if q.sent > q.num_tokens - 1:
                    s2.trim(q)
        plan = s2.schedule()
        assert sum(len(w.token_ids) for w in plan.seqs) <= 3
    assert [w.draft for w in plan.seqs] == [1, 0]


REPEAT = SamplingParams(max_tokens=48, temperature=0)


def test_greedy_equals_hf_with_fewer_steps(smol, smol_packed, prompts, hf_greedy):
    """The 16 mixed-length prompts (a repeated text: its continuations recur) with 4
    guessed tokens a step: HF's greedy tokens, most guesses kept, every slot back but
    the prefix cache's; one of them alone takes under 60% of the steps."""
    eng = engine(smol, smol_packed, max_step_tokens=1024, speculative_tokens=4)
    spec = run(eng, prompts, GREEDY)
    assert [o.token_ids for o in spec] == hf_greedy
    assert eng.num_accepted_tokens > 0.5 * eng.num_draft_tokens > 0
    assert eng.free_slots()[0] == eng.config.num_kv_slots  # no slot leaked
    metrics = EngineMetrics()
    metrics.step(eng, 0)
    value = metrics.registry.get_sample_value
    assert (value("lamina_spec_draft_tokens_total"), value("lamina_spec_accepted_tokens_total")
            ) == (eng.num_draft_tokens, eng.num_accepted_tokens)
    alone = engine(smol, smol_packed, speculative_tokens=4)  # a batch waits for its slowest
    assert run(alone, prompts[15:], GREEDY)[0].token_ids == hf_greedy[15]
    assert len(alone.step_timings) < 0.6 * (1 + len(hf_greedy[15]))


# 24 tokens: ~60 drafted, half kept (sampled); the stops end each prompt in 3-14
@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7, logprobs=2),
    SamplingParams(max_tokens=24, temperature=0.7, top_k=20, seed=11,
                   repetition_penalty=1.2, presence_penalty=0.3),
    SamplingParams(max_tokens=24, temperature=0, stop=["printing"], stop_token_ids=[13]),
    SamplingParams(max_tokens=7, temperature=0, logprobs=1),  # max_tokens inside a draft
], ids=["sampled-logprobs", "penalized", "stops", "short"])
def test_the_tokens_drawing_one_a_step_gives(smol, smol_packed, prompts, params):
    """Sampled (draws keyed by seed and position), penalized (each guessed row sees the
    guesses before it), cut by a stop string or token or by max_tokens inside a draft:
    the same tokens, texts, finish reasons and logprobs as without drafts."""
    pick = [prompts[i] for i in (0, 2, 5, 9, 13)]
    base = run(engine(smol, smol_packed), pick, params)
    eng = engine(smol, smol_packed, speculative_tokens=5, speculative_ngram_min=1)
    spec = run(eng, pick, params)
    assert eng.num_draft_tokens > 0
    # the tokens counted as drawn are the ones kept (none of a draft's past a finish)
    assert sum(t["drawn"] for t in eng.step_timings) == sum(len(o.token_ids) for o in spec)
    if params.stop:  # the cut is exercised: some end at a stop before max_tokens
        assert any(o.outputs[0].finish_reason == "stop" and len(o.token_ids) <
                   params.max_tokens for o in spec)
    for a, b in zip(base, spec):
        assert (a.token_ids, a.text, a.outputs[0].finish_reason) == (
            b.token_ids, b.text, b.outputs[0].finish_reason)
        if params.logprobs is not None:
            la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
            assert [(x.token_id, [t for t, _ in x.top]) for x in la] == \
                [(x.token_id, [t for t, _ in x.top]) for x in lb]
            assert [x.logprob for x in la] == pytest.approx([x.logprob for x in lb],
                                                            abs=1e-4)
    assert eng.free_slots()[0] == eng.config.num_kv_slots  # no slot leaked


def test_sparse_and_forked_requests_run_without_drafts(smol, smol_packed, prompts):
    """Requests a draft would not serve (a KV policy of their own, n > 1) decode one
    token a step beside drafted ones (one with structured output among them), with
    their usual tokens."""
    from lamina.sampling.structured import StructuredOutputs

    kinds = [SamplingParams(max_tokens=20, temperature=0,
                            structured_outputs=StructuredOutputs(regex="[a-z ]{5,30}")),
             SamplingParams(max_tokens=20, temperature=0, kv_sparsity="streaming",
                            kv_budget=0.5),
             SamplingParams(max_tokens=20, temperature=0.8, seed=3, n=2),
             REPEAT]
    base = [run(engine(smol, smol_packed), [prompts[4]], p)[0] for p in kinds]
    eng = engine(smol, smol_packed, speculative_tokens=4)
    ids = [eng.add_request(prompts[4], p) for p in kinds]
    got = {}
    while eng.has_unfinished():
        got.update((o.request_id, o) for o in eng.step())
    for b, i in zip(base, ids):
        assert [c.token_ids for c in got[i].outputs] == [c.token_ids for c in b.outputs]
    assert eng.num_draft_tokens > 0


EXTRACT = ("Customer record: name Alice Johnson, email alice.johnson@example.com, city "
           "Springfield, plan pro.\nThe same record as JSON with the keys name, email, "
           "city and plan: ")
RECORD = {"type": "object", "properties": {
    "name": {"type": "string"}, "email": {"type": "string"}, "city": {"type": "string"},
    "plan": {"enum": ["free", "pro", "team"]}},
    "required": ["name", "email", "city", "plan"], "additionalProperties": False}


def test_structured_output_drafts_within_its_grammar(smol, smol_packed):
    """A JSON extraction (its values copied from the prompt) under a schema: drafts of
    the tokens the grammar forces (keys, punctuation) or n-gram drafts cut to what the
    grammar takes, each draw under its own mask (the matcher moved along the guess and
    back): the tokens of one a step, valid JSON, guesses kept, in fewer steps; greedy
    and sampled."""
    import json

    import jsonschema

    from lamina.sampling.structured import StructuredOutputs

    spec = StructuredOutputs(json=RECORD)
    for params in (SamplingParams(max_tokens=80, temperature=0, structured_outputs=spec),
                   SamplingParams(max_tokens=80, temperature=0.7, seed=5,
                                  structured_outputs=spec)):
        plain = engine(smol, smol_packed)
        base = run(plain, [EXTRACT], params)[0]
        eng = engine(smol, smol_packed, speculative_tokens=4, speculative_ngram_min=1)
        out = run(eng, [EXTRACT], params)[0]
        assert out.token_ids == base.token_ids and out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), RECORD)
        assert eng.num_accepted_tokens > 0
        assert len(eng.step_timings) < len(plain.step_timings)


def test_recovered_and_preempted_drafts_keep_the_tokens(smol, smol_packed, prompts,
                                                        hf_greedy):
    """A worker lost in steps 6 and 11 (drafts in flight) and a pool too small for the
    batch (preemptions): HF's tokens, and every slot back."""
    from lamina.memory.memory_side import MemorySide
    from lamina.memory.pool import KVPool, KVPoolConfig

    pick = [1, 4, 9, 12]
    cfg = EngineConfig(speculative_tokens=4, num_kv_slots=4096)
    pool = KVPool(KVPoolConfig.for_specs(smol_packed.attention_specs, 4096))
    ex = FlakyExecutor(smol_packed, [MemorySide(pool)], fail_on={6, 11}, keep=frozenset({0}))
    from lamina.engine.engine import LLMEngine
    eng = LLMEngine(cfg, ex, smol.tokenizer, smol.config)
    outs = run(eng, [prompts[i] for i in pick], GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy[i] for i in pick]
    assert ex.recovered == 2 and any(w.draft for p in ex.plans[5:11:5] for w in p.seqs)
    small = engine(smol, smol_packed, num_kv_slots=400, speculative_tokens=4)
    outs = run(small, [prompts[i] for i in [1, 3, 4, 10, 11, 12]], GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy[i] for i in [1, 3, 4, 10, 11, 12]]
    assert sum(o.metrics["preemptions"] for o in outs) > 0
    assert small.free_slots()[0] == 400


@pytest.mark.parametrize("pipeline, replicas, batches", [("fixed", 2, 2),
                                                          ("rotational", 2, 3)])
def test_drafts_over_compute_replicas(smol, smol_packed, prompts, hf_greedy, pipeline,
                                      replicas, batches):
    """The step split over two compute replicas, each its own batch (fixed) or slices
    rotating over them with the contexts moving (rotational, 3 batches): a drafted
    sequence's rows travel with it; HF's greedy tokens, guesses kept."""
    from lamina.engine.engine import LLMEngine
    from lamina.executor.local import LocalExecutor
    from lamina.memory.memory_side import MemorySide
    from lamina.memory.pool import KVPool, KVPoolConfig

    mems = [MemorySide(KVPool(KVPoolConfig.for_specs(smol_packed.attention_specs, 4096)))
            for _ in range(2)]
    ex = LocalExecutor(smol_packed, mems, vocab_size=smol.config.vocab_size,
                       num_compute_workers=replicas, pipeline=pipeline)
    cfg = EngineConfig(num_kv_slots=4096, num_memory_workers=2, pipeline=pipeline,
                       num_compute_workers=replicas, num_batches=batches,
                       speculative_tokens=4)
    eng = LLMEngine(cfg, ex, smol.tokenizer, smol.config)
    outs = run(eng, prompts[:8], GREEDY)
    assert [o.token_ids for o in outs] == hf_greedy[:8]
    assert eng.num_accepted_tokens > 0
