"""Priority scheduling: exact plans and slot ids in the scheduler; the engine's answers
equal HF greedy whatever preempts whom; the priority reaches the engine from `LLM`,
the engine loop and the HTTP server (the `openai` client's `extra_body`)."""
import time

import openai
import pytest

from lamina.engine.config import EngineConfig
from lamina.engine.messages import SeqWork
from lamina.engine.scheduler import Scheduler, SchedulerConfig, Sequence
from lamina.entrypoints.engine_loop import EngineLoop
from lamina.entrypoints.llm import LLM
from lamina.memory.allocator import KVAllocator, KVAllocatorConfig
from lamina.sampling.params import SamplingParams

from .test_engine import GREEDY, engine
from .test_server import _Server

P = SamplingParams(max_tokens=8)


def make(num_slots=8, max_batch=4, budget=100, policy="priority", caching=False):
    return Scheduler(SchedulerConfig(max_batch, budget, policy=policy),
                     KVAllocator(KVAllocatorConfig(num_slots)), prefix_caching=caching)


def seq(i, tokens, priority=0):
    return Sequence(i, list(tokens), P, priority=priority)


def test_waiting_sequences_are_admitted_by_priority_ties_in_arrival_order():
    s = make(num_slots=20, max_batch=3)
    for q in (seq(0, [1, 2], 5), seq(1, [3], 0), seq(2, [4, 5], -1), seq(3, [6], 0)):
        s.add(q)
    plan = s.schedule()  # room for three: -1, then the two 0s in arrival order
    assert plan.seqs == (SeqWork(2, (4, 5), 0, (0, 1), params=P),
                         SeqWork(1, (3,), 0, (2,), params=P),
                         SeqWork(3, (6,), 0, (3,), params=P))
    assert [q.seq_id for q in s.waiting] == [0]


def test_fcfs_ignores_priorities():
    s = make(num_slots=20, max_batch=2, policy="fcfs")
    for q in (seq(0, [1], 5), seq(1, [2], 0), seq(2, [3], -1)):
        s.add(q)
    assert [w.seq_id for w in s.schedule().seqs] == [0, 1]


def test_a_full_pool_preempts_the_lowest_priority_not_the_newest():
    """Three decode into a pool with one free slot: the oldest (priority 0) takes it;
    the next needs one and the lowest priority (an older sequence than it) goes, so
    its slots serve; the newest (priority 1) decodes on. FCFS would take the newest."""
    s = make(num_slots=8)
    a, b, c = seq(0, [10, 11], 0), seq(1, [20, 21], 2), seq(2, [30, 31, 32], 1)
    for q in (a, b, c):
        s.add(q)
    s.schedule()  # admitted by priority: a: 0-1, c: 2-4, b: 5-6
    for q, t in ((a, 12), (b, 22), (c, 33)):
        q.output.append(t)
    plan = s.schedule()  # decode order a, c, b; a takes 7, c preempts b and takes its 5
    assert plan.seqs == (SeqWork(0, (12,), 2, (7,), params=P, slots_from=2),
                         SeqWork(2, (33,), 3, (5,), params=P, slots_from=3))
    assert b.status == "waiting" and b.num_preemptions == 1 and list(s.waiting) == [b]
    assert s.alloc.free_list() == [6]


def test_a_waiting_sequence_preempts_lower_priorities_until_it_fits():
    """The batch is full (priorities 2, 1, 2) and so is the pool; a priority-0 arrival
    of four tokens preempts the newest priority-2 sequence (which frees the batch's room,
    not enough KV), then the other priority-2 one, never the priority-1 one. Their
    planned decodes leave the step; only their written positions were cached, and the
    arrival's slots come from the cache's oldest entry, then the free list."""
    s = make(num_slots=9, max_batch=3, caching=True)
    lo1, mid, lo2 = seq(0, [10, 11], 2), seq(1, [20, 21], 1), seq(2, [30, 31], 2)
    for q in (lo1, mid, lo2):
        s.add(q)
    s.schedule()  # by priority: mid 0-1, lo1 2-3, lo2 4-5
    for q, t in ((lo1, 12), (mid, 22), (lo2, 32)):
        q.output.append(t)
    new = seq(3, [40, 41, 42, 43], 0)
    s.add(new)
    plan = s.schedule()  # decodes: mid 6, lo1 7, lo2 8; then the arrival
    assert plan.seqs == (SeqWork(1, (22,), 2, (6,), params=P, slots_from=2),
                         SeqWork(3, (40, 41, 42, 43), 0, (4, 5, 7, 8), params=P))
    assert plan.released == (2, 0)  # the executor drops their tables
    assert [q.seq_id for q in s.waiting] == [0, 2] and lo1.kept == lo2.kept == 2
    assert mid.status == new.status == "running"
    # lo2, cached first, was evicted first (whole); lo1's two positions stay cached
    assert s.caches[0].match([10, 11, 12]) == [2, 3] and s.caches[0].match([30, 31]) == []
    assert s.alloc.num_free() == 0


def test_equal_priorities_and_the_token_budget_preempt_nothing():
    s = make(num_slots=20, max_batch=2, budget=4)
    a, b = seq(0, [1], 1), seq(1, [2], 1)
    s.add(a)
    s.add(b)
    s.schedule()
    a.output.append(3)
    b.output.append(4)
    s.add(seq(2, [5], 1))  # equal priority, batch full: it waits
    assert [w.seq_id for w in s.schedule().seqs] == [0, 1]
    for q in (a, b):
        q.output.append(6)
    whole = Sequence(3, [7] * 5, SamplingParams(max_tokens=2, prompt_logprobs=1),
                     priority=0)  # fed whole: 5 tokens > the budget left; waits
    s.add(whole)
    assert [w.seq_id for w in s.schedule().seqs] == [0, 1]
    assert a.status == b.status == "running"


def test_a_chunked_prompt_preempted_mid_step_caches_only_what_was_written():
    """A low-priority prompt is fed in chunks of 4; after its first chunk a high-
    priority arrival preempts it in the step that was to feed its second: only the
    first chunk's positions are cached, the second chunk leaves the plan."""
    s = make(num_slots=12, max_batch=1, budget=4, caching=True)
    low = seq(0, range(100, 110), 3)
    s.add(low)
    assert s.schedule().seqs == (SeqWork(0, (100, 101, 102, 103), 0, (0, 1, 2, 3),
                                         params=P, sample=False),)
    s.add(seq(1, [7, 8], 0))
    plan = s.schedule()
    assert [(w.seq_id, w.token_ids) for w in plan.seqs] == [(1, (7, 8))]
    assert low.status == "waiting" and low.kept == 4
    assert s.caches[0].match(list(range(100, 110))) == [0, 1, 2, 3]


def test_config_refuses_an_unknown_policy():
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="lifo")


def _drain(eng, outs):
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o


def test_the_engine_serves_priorities_first_and_answers_as_hf(smol, smol_packed, prompts,
                                                              hf_greedy):
    """Six priority-1 requests run in a batch of four; four priority-0 ones arrive: the
    next step runs those four alone (the running ones preempted, the waiting ones held),
    and every answer equals HF greedy all the same (the preempted resume on their cached
    KV)."""
    eng = engine(smol, smol_packed, max_batch=4, scheduling_policy="priority",
                 num_kv_slots=4096)
    low_i, high_i = [0, 1, 2, 3, 9, 10], [4, 11, 12, 13]
    low = {eng.add_request(prompts[i], GREEDY, priority=1): i for i in low_i}
    outs: dict = {}
    for _ in range(3):
        for o in eng.step():
            outs[o.request_id] = o
    assert not outs and len(eng.scheduler.running) == 4
    high = {eng.add_request(prompts[i], GREEDY, priority=0): i for i in high_i}
    eng.step()
    assert sorted(s.seq_id for s in eng.scheduler.running) == sorted(
        eng._reqs[r].seqs[0].seq_id for r in high)
    _drain(eng, outs)
    for rid, i in {**low, **high}.items():
        assert outs[rid].token_ids == hf_greedy[i], i
    assert sum(outs[r].metrics["preemptions"] for r in low) == 4
    assert max(outs[r].metrics["e2e_s"] for r in high) < min(
        outs[r].metrics["e2e_s"] for r in low if outs[r].metrics["preemptions"])


def test_a_priority_needs_the_priority_policy(smol, smol_packed):
    eng = engine(smol, smol_packed)
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        eng.add_request([1, 2, 3], GREEDY, priority=2)
    with pytest.raises(TypeError, match="priority must be an int"):
        eng.add_request([1, 2, 3], GREEDY, priority=0.5)
    assert not eng.has_unfinished() and not eng._reqs
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        EngineConfig(scheduling_policy="lifo")


def _served(smol, smol_packed, **kw):
    eng = engine(smol, smol_packed, num_kv_slots=4096, **kw)
    loop = EngineLoop(eng)
    return loop, _Server(loop, smol.tokenizer)


def test_priority_over_the_openai_client(smol, smol_packed, prompts, hf_greedy):
    """A batch of one runs a long priority-5 stream; a priority-0 request (vLLM's
    `priority` field, through `extra_body`) preempts it, is answered with HF's tokens
    while the stream is still running, and the stream then goes on. Under FCFS the
    field is refused naming it."""
    loop, s = _served(smol, smol_packed, max_batch=1, scheduling_policy="priority")
    try:
        cl = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        stream = cl.completions.create(model="smollm2", prompt=prompts[1], max_tokens=2000,
                                       temperature=0, stream=True,
                                       extra_body={"priority": 5, "ignore_eos": True})
        it = iter(stream)
        next(it)
        (low,) = loop.engine._reqs.values()
        r = cl.completions.create(model="smollm2", prompt=prompts[2], max_tokens=8,
                                  temperature=0, extra_body={"priority": 0})
        assert r.choices[0].model_extra["token_ids"] == hf_greedy[2][:8]
        assert low.seqs[0].num_preemptions == 1 and low.seqs[0].status != "finished"
        next(it)  # the stream goes on after it
        stream.close()
        deadline = time.monotonic() + 60
        while loop.engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert loop.engine.free_slots() == [4096]
    finally:
        s.stop()
        loop.shutdown()
    loop, s = _served(smol, smol_packed)
    try:
        status, body = s.post("/v1/completions", {"model": "smollm2", "prompt": "Hi",
                                                  "max_tokens": 2, "priority": 1})
        assert status == 400 and body["error"]["param"] == "priority"
        assert "scheduling_policy='priority'" in body["error"]["message"]
        status, body = s.post("/v1/chat/completions", {
            "model": "smollm2", "max_tokens": 2, "priority": 0,
            "messages": [{"role": "user", "content": "Hi"}]})
        assert status == 200
    finally:
        s.stop()
        loop.shutdown()


def test_llm_generate_takes_a_priority_per_prompt(smol, smol_packed, prompts, hf_greedy):
    """`LLM.generate(priority=[...])`: all four in one batch of two, priority order."""
    eng = engine(smol, smol_packed, max_batch=2, scheduling_policy="priority")
    llm = LLM.__new__(LLM)  # the engine under test, without loading the model again
    llm.engine = eng
    outs = llm.generate([prompts[i] for i in range(4)], GREEDY, use_tqdm=False,
                        priority=[3, 0, 2, 1])
    assert [o.token_ids for o in outs] == hf_greedy[:4]
    e2e = [o.metrics["e2e_s"] for o in outs]
    assert e2e[1] < e2e[2] and e2e[3] < e2e[0]  # priority 0 before 2, 1 before 3
    with pytest.raises(ValueError, match="4 prompts but 3 priorities"):
        llm.generate([prompts[i] for i in range(4)], GREEDY, priority=[0, 1, 2])
