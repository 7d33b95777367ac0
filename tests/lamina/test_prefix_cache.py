"""Automatic prefix caching: the radix tree's exact slots and refcounts, and the engine's
greedy output with caching on equal to HF's and to caching off (multi-turn prompts,
branching, n > 1, preemption, KV split over workers), with no slot leaked."""
from __future__ import annotations

import pytest

from lamina import SamplingParams
from lamina.engine.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.engine.prefix_cache import RadixCache
from lamina.executor.local import LocalExecutor
from lamina.memory.allocator import KVAllocator, KVAllocatorConfig
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig
from tests.conftest import HF_NEW
from tests.lamina.test_engine import engine, run

GREEDY = SamplingParams(max_tokens=HF_NEW, temperature=0)


def test_radix_tree_shares_splits_and_evicts_exact_slots():
    a = KVAllocator(KVAllocatorConfig(16))
    c = RadixCache(a)
    assert a.allocate("r1", 5) == [0, 1, 2, 3, 4]
    assert c.insert([1, 2, 3, 4, 5], [0, 1, 2, 3, 4]) == 5
    assert a.free("r1") == []  # the tree still holds them
    assert a.num_free() == 11 and c.size == 5
    assert c.match([1, 2, 3, 9]) == [0, 1, 2]  # any length, not whole blocks
    assert c.match([1, 2, 3, 4, 5, 6], limit=5) == [0, 1, 2, 3, 4]
    assert c.match([7]) == []
    # a request reusing 3 tokens, then 2 of its own; its finish caches the branch
    assert a.adopt("r2", [0, 1, 2], 2) == [0, 1, 2, 5, 6]
    assert c.insert([1, 2, 3, 7, 8], [0, 1, 2, 5, 6]) == 2  # the edge splits after 3
    assert [a.refcount(s) for s in range(7)] == [2, 2, 2, 1, 1, 2, 2]
    # eviction: least recently used leaf first, from its end; slots r2 holds stay
    assert c.evict(3) == 2 and a.free_list()[:2] == [3, 4]
    assert c.match([1, 2, 3, 4]) == [0, 1, 2]
    assert a.free("r2") == []
    assert c.evict(100) == 5  # the branch, then the shared stem once it is a leaf
    assert a.num_free() == 16 and all(a.refcount(s) == 0 for s in range(16))
    assert c.size == 0 and c.match([1, 2]) == []


def test_clear_returns_every_slot():
    a = KVAllocator(KVAllocatorConfig(8))
    c = RadixCache(a)
    a.allocate("r", 4)
    c.insert([5, 6, 7, 8], a.slots("r"))
    c.insert([5, 6, 9], a.slots("r")[:2] + a.extend("r", 1))
    a.free("r")
    assert c.clear() == 5 and a.num_free() == 8 and c.size == 0


def test_evictable_counts_what_eviction_frees_past_a_sequences_holes():
    """A running sequence shares a cached prefix and gives back positions 1-3 inside it
    (`streaming`): the tree alone holds those slots, but eviction goes from the leaf's
    end, which the sequence still holds, so it can free none, and `evictable` says so
    (a plan counting them took slots that were never freed). A branch the tree alone
    holds is evicted whole, its parent's slots only once the sequence ends."""
    a = KVAllocator(KVAllocatorConfig(8))
    c = RadixCache(a)
    a.allocate("r", 6)
    c.insert([1, 2, 3, 4, 5, 6], a.slots("r"))  # slots 0-5
    a.allocate("b", 1)
    c.insert([1, 2, 3, 4, 5, 6, 7], a.slots("r") + a.slots("b"))  # a branch: slot 6
    a.free("b")
    a.drop("r", 1, 4)  # slots 1-3: the tree's alone now
    assert c.evictable() == 1 and c.evict(4) == 1 and a.num_free() == 2
    assert c.evictable() == 0 and c.evict(4) == 0
    a.free("r")
    assert c.evictable() == 6 and c.evict(6) == 6 and a.num_free() == 8


@pytest.fixture(scope="module")
def cached(smol, smol_packed):
    """An engine with prefix caching over the session's split (as `LLM` builds one)."""
    return engine(smol, smol_packed, num_kv_slots=6000, max_step_tokens=1024)


def free_after_clear(eng) -> list[int]:
    eng.clear_prefix_cache()
    assert all(a.stats().shared == 0 for a in eng.allocs)
    return [a.num_free() for a in eng.allocs]


def test_cached_prefixes_give_hf_greedy_and_compute_only_the_rest(cached, prompts,
                                                                  hf_greedy):
    """The 16 prompts are prefixes of one text: each reuses the longest one before it;
    run again, every prompt but its last token comes from the cache."""
    first = run(cached, prompts, GREEDY)
    assert [o.token_ids for o in first] == hf_greedy
    fed = sum(s["tokens"] for s in cached.step_timings)
    cached.step_timings.clear()
    again = run(cached, prompts, GREEDY)
    assert [o.token_ids for o in again] == hf_greedy
    assert [o.metrics["cached_tokens"] for o in again] == [len(p) - 1 for p in prompts]
    assert sum(s["tokens"] for s in cached.step_timings) < fed
    assert free_after_clear(cached) == [6000]


def test_multi_turn_and_branches_equal_caching_off(cached, smol, smol_packed):
    tok = smol.tokenizer

    def chat(eng, convs):
        return run(eng, [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
                         for c in convs], params)

    system = {"role": "system", "content": "You are a concise assistant for travellers."}
    turn1 = [system, {"role": "user", "content": "Name a city in France."}]
    params = SamplingParams(max_tokens=24, temperature=0)
    plain = engine(smol, smol_packed, num_kv_slots=6000, prefix_caching=False)
    a1 = tok.decode(chat(plain, [turn1])[0].token_ids, skip_special_tokens=True)
    convs = [turn1 + [{"role": "assistant", "content": a1}, {"role": "user", "content": q}]
             for q in ("What is it famous for?", "How far is it from Paris?")]
    want = [o.token_ids for o in chat(plain, convs)]
    assert tok.decode(chat(cached, [turn1])[0].token_ids, skip_special_tokens=True) == a1
    outs = chat(cached, convs)
    assert [o.token_ids for o in outs] == want
    history = len(tok.apply_chat_template(turn1, add_generation_prompt=True))
    assert all(o.metrics["cached_tokens"] >= history for o in outs)  # turn 1 reused
    assert free_after_clear(cached) == [6000]


def test_n_preemption_and_kv_split_equal_caching_off(smol, smol_packed, prompts):
    """A pool too small for all (preemptions), 2 workers with KV split, n = 3 samples."""
    batch = [prompts[i] for i in (4, 5, 6, 11, 12, 13)] * 2
    params = [SamplingParams(max_tokens=24, temperature=0.8, seed=i, n=3 if i % 4 == 0
                             else 1) for i in range(len(batch))]
    outs = {}
    for caching in (False, True):
        cfg = EngineConfig(num_memory_workers=2, num_kv_slots=520, max_step_tokens=1024,
                           prefix_caching=caching)
        pools = [KVPool(KVPoolConfig.for_specs(smol_packed.attention_specs, 520))
                 for _ in range(2)]
        eng = LLMEngine(cfg, LocalExecutor(smol_packed, [MemorySide(p) for p in pools]),
                        smol.tokenizer, smol.config)
        ids = [eng.add_request(p, sp) for p, sp in zip(batch, params)]
        done = {}
        while eng.has_unfinished():
            done.update((o.request_id, o) for o in eng.step())
        res = [done[i] for i in ids]
        outs[caching] = [[c.token_ids for c in o.outputs] for o in res]
        if caching:
            assert sum(o.metrics["preemptions"] for o in res) > 0
            assert any(o.metrics["cached_tokens"] for o in res)
            eng.clear_prefix_cache()
            assert all(a.stats().shared == 0 for a in eng.allocs)
            assert [a.num_free() for a in eng.allocs] == [520, 520]
    assert outs[True] == outs[False]


def test_scheduler_feeds_only_the_uncached_rest_with_exact_slots():
    from lamina.engine.scheduler import Scheduler, SchedulerConfig, Sequence

    alloc = KVAllocator(KVAllocatorConfig(32))
    sch = Scheduler(SchedulerConfig(), alloc, prefix_caching=True)
    a = Sequence(0, list(range(1, 11)), SamplingParams(max_tokens=1))
    sch.add(a)
    plan = sch.schedule()
    assert plan.seqs[0].slots == tuple(range(10)) and plan.seqs[0].start_pos == 0
    a.output.append(99)
    sch.cache(a, len(a.prompt))  # prefilled
    sch.finish(a, "length")  # caches all 10 positions with KV; frees nothing
    assert alloc.num_free() == 22 and sch.caches[0].size == 10
    b = Sequence(1, [1, 2, 3, 4, 5, 6, 20, 21], SamplingParams(max_tokens=1))
    sch.add(b)
    work = sch.schedule().seqs[0]
    assert (work.start_pos, work.token_ids) == (6, (20, 21)) and b.cached == 6
    assert work.slots == (0, 1, 2, 3, 4, 5, 10, 11)
    b.output.append(77)
    sch.finish(b, "length")  # its branch [20, 21] joins the tree (slots 10, 11)
    # the same prompt again: all but its last token reused (the step draws from it)
    c = Sequence(2, list(range(1, 11)), SamplingParams(max_tokens=1))
    sch.add(c)
    work = sch.schedule().seqs[0]
    assert (work.start_pos, work.token_ids, c.cached) == (9, (10,), 9)
    assert work.slots == tuple(range(9)) + (12,)
    c.output.append(88)
    sch.finish(c, "length")  # nothing new to cache: slot 12 is freed
    assert alloc.num_free() == 20 and sch.caches[0].size == 12
    # a prompt needing more than is free evicts the least recently used cached slots
    # no sequence holds (b's branch, from its end): a running sequence wins
    d = Sequence(3, list(range(50, 72)), SamplingParams(max_tokens=1))
    sch.add(d)
    work = sch.schedule().seqs[0]
    assert work.slots[:3] == (10, 11, 12) and len(work.slots) == 22
    assert alloc.num_free() == 0 and sch.caches[0].size == 10
    assert sch.caches[0].match([1, 2, 3, 4, 5, 6, 20, 21]) == [0, 1, 2, 3, 4, 5]


def test_a_prompt_its_policy_scores_is_computed_not_reused():
    """A sequence whose KV policy scores its prompt where it is stored (h2o, snapkv,
    swa: the engine's `scores_prompt`) is prefilled whole even when its prefix is cached;
    the others reuse it."""
    from lamina.engine.scheduler import Scheduler, SchedulerConfig, Sequence

    alloc = KVAllocator(KVAllocatorConfig(32))
    sch = Scheduler(SchedulerConfig(), alloc, prefix_caching=True,
                    scores_prompt=lambda s: s.params.kv_sparsity == "h2o")
    a = Sequence(0, list(range(1, 11)), SamplingParams(max_tokens=1))
    sch.add(a)
    sch.schedule()
    a.output.append(99)
    sch.finish(a, "length")  # caches positions 0..9
    b = Sequence(1, list(range(1, 11)), SamplingParams(max_tokens=1, kv_sparsity="h2o"))
    sch.add(b)
    work = sch.schedule().seqs[0]
    assert (work.start_pos, len(work.token_ids), b.cached) == (0, 10, 0)
    b.output.append(5)
    sch.finish(b, "length")
    c = Sequence(2, list(range(1, 11)), SamplingParams(max_tokens=1, kv_sparsity="topk"))
    sch.add(c)
    assert sch.schedule().seqs[0].start_pos == 9 and c.cached == 9
