"""Memory workers added to and removed from a running engine (`scale_memory_workers`):
exact scheduler states, HF greedy tokens across the changes, refusals, the serving
loop's and `LLM`'s ways in."""
import threading
import time
from dataclasses import asdict

import pytest
import torch

from lamina.engine.config import EngineConfig
from lamina.engine.engine import SHORT_POLL_S, LLMEngine
from lamina.engine.scheduler import Scheduler, SchedulerConfig, Sequence, Shortfall
from lamina.entrypoints.engine_loop import EngineLoop
from lamina.executor.local import LocalExecutor
from lamina.memory.allocator import KVAllocator, KVAllocatorConfig
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.memory.tier_orders import SlotMove, TierConfig
from lamina.sampling.params import SamplingParams

P = SamplingParams(max_tokens=8)
GREEDY = SamplingParams(max_tokens=32, temperature=0)


def _plan(s: Scheduler) -> list[tuple]:
    return [(w.seq_id, w.token_ids, w.start_pos, w.slots, w.worker, w.segments)
            for w in s.schedule().seqs]


def test_retiring_a_worker_preempts_exactly_the_sequences_on_it_and_adding_one_places_exact():
    """Two workers of 6 slots, split KV: a on worker 0, b on worker 1, c on worker 0
    then spilled onto worker 1. Keeping worker 0 alone preempts b and c (oldest in
    front), a runs on; c's part on worker 0 is cached for it, b's KV is gone: worker 1's
    allocator and tree leave. A worker added later takes b back, computed whole."""
    allocs = [KVAllocator(KVAllocatorConfig(6)) for _ in range(2)]
    s = Scheduler(SchedulerConfig(4, 100, True), allocs, prefix_caching=True)
    a, b, c = Sequence(0, [10, 11, 12], P), Sequence(1, [20, 21, 22], P), Sequence(2, [30, 31], P)
    for q in (a, b, c):
        s.add(q)
    assert _plan(s) == [(0, (10, 11, 12), 0, (0, 1, 2), 0, ()),
                        (1, (20, 21, 22), 0, (0, 1, 2), 1, ()),
                        (2, (30, 31), 0, (3, 4), 0, ())]
    for q in (a, b, c):
        q.output.append(40 + q.seq_id)
    assert _plan(s) == [(0, (40,), 3, (5,), 0, ()), (1, (41,), 3, (3,), 1, ()),
                        (2, (42,), 2, (4,), 0, ((0, 0), (1, 2)))]  # c spills
    for q in (a, b, c):
        q.output.append(50 + q.seq_id)
    done = s.retire_workers(1)  # worker 0 is full: nothing can move there
    hit = done.preempted
    assert (done.moved, done.moves) == ([], ())
    assert hit == [b, c] and list(s.waiting) == [b, c] and s.running == [a]
    assert [(q.lost, q.kept, q.segments, q.num_preemptions) for q in (b, c)] == [
        (4, 0, [], 1), (3, 2, [], 1)]  # c's first part (2 positions) cached on worker 0
    assert s.allocs is allocs and len(allocs) == 1 and len(s.caches) == 1
    assert allocs[0].requests() == [0] and allocs[0].slots(0) == [0, 1, 2, 5]
    assert s.caches[0].match([30, 31, 42]) == [3, 4] and allocs[0].num_free() == 0
    plan = s.schedule()
    assert plan.released == (2, 1)  # the executor drops their tables
    # a's growth evicts c's cached prefix (a running sequence wins over the cache)
    assert [(w.seq_id, w.slots, w.worker) for w in plan.seqs] == [(0, (4,), 0)]
    s.add_workers([KVAllocator(KVAllocatorConfig(6))])
    assert len(s.caches) == 2
    a.output.append(60)
    assert _plan(s) == [(0, (60,), 5, (3,), 0, ()),
                        (1, (20, 21, 22, 41, 51), 0, (0, 1, 2, 3, 4), 1, ())]
    assert list(s.waiting) == [c]  # worker 1 has 1 slot left, worker 0 none
    with pytest.raises(ValueError, match="keep 1..2 memory workers, not 0"):
        s.retire_workers(0)


def test_retiring_a_worker_moves_the_parts_that_find_room_and_preempts_the_rest():
    """Three workers of 4 slots. Of the sequences with a part on worker 2 when it
    leaves: a's part there (one position) moves to worker 1, the kept worker it does not
    use, whose cached prefix yields the slot, and a runs on, its tables sent whole once;
    c's only other kept worker (0) is full, so c is preempted, and keeps nothing: its
    first part was on worker 2 (what it cached went with that worker's tree); its
    later part on kept worker 1 is freed, not cached (a cached prefix starts at 0)."""
    allocs = [KVAllocator(KVAllocatorConfig(4)) for _ in range(3)]
    s = Scheduler(SchedulerConfig(4, 100, True), allocs, prefix_caching=True)
    a = Sequence(0, [1, 2, 3, 4], P)
    b = Sequence(1, [5, 6, 7, 8], P)
    c = Sequence(2, [9, 10, 11], P)
    for q in (a, b, c):
        s.add(q)
    s.schedule()
    assert [q.segments for q in (a, b, c)] == [[(0, 0)], [(1, 0)], [(2, 0)]]
    for q in (a, b, c):
        q.output.append(20)
    s.schedule()  # a spills onto worker 2; b gives way, c spills onto its slots
    assert [q.segments for q in (a, b, c)] == [[(0, 0), (2, 4)], [], [(2, 0), (1, 3)]]
    assert (allocs[2].slots(0), allocs[1].slots(2)) == ([3], [3])
    for q in (a, c):  # the step drew their next tokens
        q.output.append(21)
    done = s.retire_workers(2)
    assert done.moves == (SlotMove(2, 1, (3,), (2,)),)  # b's cached position 7 yields slot 2
    assert (done.moved, done.preempted) == ([a], [c])
    assert a.segments == [(0, 0), (1, 4)] and (a.sent, a.num_preemptions) == (0, 0)
    assert (c.lost, c.kept, c.segments) == (4, 0, [])
    assert list(s.waiting) == [c, b] and s.running == [a]
    assert [x.requests() for x in allocs] == [[0], [0]]
    assert (allocs[0].slots(0), allocs[1].slots(0)) == ([0, 1, 2, 3], [2])
    assert [cache.size for cache in s.caches] == [0, 2]  # b's first two positions
    assert s.caches[1].match([5, 6, 7, 8]) == [0, 1] and allocs[1].num_free() == 1
    plan = s.schedule()  # a's old tables dropped, then sent whole with its next slot
    assert plan.released == (0, 2)
    assert [(w.seq_id, w.slots, w.slots_from, w.segments) for w in plan.seqs] == [
        (0, (0, 1, 2, 3, 2, 3), 0, ((0, 0), (1, 4)))]


def test_a_leaving_last_part_continues_the_range_before_it_where_that_worker_has_room():
    """Two workers of 6 slots: c (3 tokens) on worker 0, d (4) on worker 1, a (5) split
    over worker 0's 3 free slots and worker 1's 2. Once c has finished, keeping worker
    0 alone: a (the newer) moves its last part after its range on worker 0 (its table
    there extended: one range again), while d, older but with no room, is preempted."""
    allocs = [KVAllocator(KVAllocatorConfig(6)) for _ in range(2)]
    s = Scheduler(SchedulerConfig(4, 100, True), allocs)
    c, d, a = (Sequence(0, [60, 61, 62], P), Sequence(1, [70, 71, 72, 73], P),
               Sequence(2, [1, 2, 3, 4, 5], P))
    for q in (c, d, a):
        s.add(q)
    assert _plan(s) == [(0, (60, 61, 62), 0, (0, 1, 2), 0, ()),
                        (1, (70, 71, 72, 73), 0, (0, 1, 2, 3), 1, ()),
                        (2, (1, 2, 3, 4, 5), 0, (3, 4, 5, 4, 5), 0, ((0, 0), (1, 3)))]
    for q in (c, d, a):
        q.output.append(20)
    s.finish(c, "stop")
    done = s.retire_workers(1)
    assert done.moves == (SlotMove(1, 0, (4, 5), (0, 1)),)
    assert (done.moved, done.preempted) == ([a], [d]) and s.running == [a]
    assert a.segments == [(0, 0)] and allocs[0].slots(2) == [3, 4, 5, 0, 1]
    assert (d.lost, d.kept, list(s.waiting)) == (4, 0, [d])
    plan = s.schedule()  # c's, a's (sent whole again) and d's tables dropped
    assert plan.released == (0, 2, 1)
    assert [(w.seq_id, w.slots, w.slots_from, w.segments) for w in plan.seqs] == [
        (2, (3, 4, 5, 0, 1, 2), 0, ())]


def test_a_worker_dropped_from_the_middle_renumbers_the_others_and_their_kv_comes_back():
    """Three workers of 10 slots: a on 0, b on 1, c on 2, one decode step each. A
    recovery that kept pools 0 and 2 requeues them (a's 4 positions and c's 3 cached,
    b's worker gone) and then drops worker 1: worker 2's allocator and tree become
    worker 1's, and readmission puts a and c back onto their own KV there, b computed
    whole beside c."""
    allocs = [KVAllocator(KVAllocatorConfig(10)) for _ in range(3)]
    first, _, last = allocs
    s = Scheduler(SchedulerConfig(4, 100, True), allocs, prefix_caching=True)
    a, b, c = Sequence(0, [10, 11, 12], P), Sequence(1, [20, 21, 22], P), Sequence(2, [30, 31], P)
    for q in (a, b, c):
        s.add(q)
    assert [w.worker for w in s.schedule().seqs] == [0, 1, 2]
    for q in (a, b, c):
        q.output.append(40 + q.seq_id)
    assert _plan(s) == [(0, (40,), 3, (3,), 0, ()), (1, (41,), 3, (3,), 1, ()),
                        (2, (42,), 2, (2,), 2, ())]
    for q in (a, b, c):
        q.output.append(50 + q.seq_id)
    s.clear_cache({1})  # (as `LLMEngine._bring_back`: the pools not kept)
    assert s.preempt_all({0: 4, 2: 3}) == 7
    s.drop_workers([1])
    assert s.allocs is allocs and allocs == [first, last] and len(s.caches) == 2
    assert [x.requests() for x in allocs] == [[], []] and [x.num_free() for x in allocs] == [
        6, 7]
    assert s.caches[0].match([10, 11, 12, 40, 50]) == [0, 1, 2, 3]
    assert s.caches[1].match([30, 31, 42, 52]) == [0, 1, 2]
    assert list(s.waiting) == [a, b, c]
    with pytest.raises(ValueError, match=r"drop some of memory workers 0..1, not \[0, 1\]"):
        s.drop_workers([0, 1])
    assert _plan(s) == [(0, (50,), 4, (0, 1, 2, 3, 4), 0, ()),
                        (1, (20, 21, 22, 41, 51), 0, (3, 4, 5, 6, 7), 1, ()),
                        (2, (52,), 3, (0, 1, 2, 8), 1, ())]


def _engine(smol, split, slots: int, workers: int, **kw) -> LLMEngine:
    cfg = EngineConfig(num_memory_workers=workers, num_kv_slots=slots, max_step_tokens=2048,
                       **kw)
    t = cfg.tiers
    pools = [KVPool(KVPoolConfig.for_specs(split.attention_specs, slots))
             for _ in range(workers)]
    ex = LocalExecutor(split, [MemorySide(p, tiers=t, worker=w) for w, p in enumerate(pools)])
    return LLMEngine(cfg, ex, smol.tokenizer, smol.config)


PICK = [1, 3, 4, 10, 11, 12]  # prompts of 12-128 tokens


class Stepper:
    """An engine's requests, added at once and stepped on: `steps(n)` runs n steps,
    `done` holds each request's final output by id, `run_out` steps until none is left."""

    def __init__(self, eng: LLMEngine, prompts, params: SamplingParams):
        self.eng, self.done = eng, {}
        self.ids = [eng.add_request(p, params) for p in prompts]

    def steps(self, n: int = 1) -> None:
        for _ in range(n):
            self.done.update((o.request_id, o) for o in self.eng.step() if o.finished)

    def run_out(self) -> list[list[int]]:
        """-> each request's tokens, in the order they were added."""
        while self.eng.has_unfinished():
            self.steps()
        return [self.done[i].outputs[0].token_ids for i in self.ids]


def test_an_engine_grows_and_shrinks_its_pool_while_it_generates_exact(
        smol, smol_packed, prompts, hf_greedy):
    """Six prompts (sharing prefixes) in one pool of 160 slots (split KV): too small
    for them all as they grow, so sequences are preempted. After 8 steps two workers
    join: the waiting ones
    are admitted onto them and the growing ones spill; after 12 more the pool shrinks to
    one again, preempting every sequence with KV on a leaving worker (its KV there
    computed again on readmission). Every request gives HF's greedy tokens, and at the
    end every slot of the one worker left is free."""
    eng = _engine(smol, smol_packed, 160, 1)
    run = Stepper(eng, [prompts[i] for i in PICK], GREEDY)
    steps = run.steps

    steps(8)
    assert len(eng.scheduler.waiting) > 0  # the one pool holds only some of them
    grown = eng.scale_memory_workers(3)
    assert (grown.before, grown.after, grown.preempted, grown.recompute_tokens) == (1, 3, 0, 0)
    assert len(eng.executor.memory) == len(eng.allocs) == 3
    assert eng.config.num_memory_workers == 3
    steps(1)
    assert {w for s in eng.scheduler.running for w in s.workers} == {0, 1, 2}
    steps(11)
    on_leaving = [s for s in eng.scheduler.running if any(w > 0 for w in s.workers)]
    lost = sum(s.written for s in on_leaving)
    assert on_leaving
    shrunk = eng.scale_memory_workers(1)
    assert (shrunk.before, shrunk.after, shrunk.preempted) == (3, 1, len(on_leaving))
    assert 0 < shrunk.recompute_tokens <= lost
    assert len(eng.executor.memory) == len(eng.allocs) == 1
    assert eng.executor.compute.num_workers == 1
    assert run.run_out() == [hf_greedy[i] for i in PICK]
    assert sum(run.done[i].metrics["preemptions"] for i in run.ids) >= len(on_leaving)
    assert eng.free_slots() == [160]


def _kv_of(eng: LLMEngine, seq) -> tuple[torch.Tensor, torch.Tensor]:
    """seq's KV as its pools hold it, in position order: k [L, n, Hkv, D], v alike."""
    parts = [eng.executor.memory[w].pool.read(eng.allocs[w].slots(seq.seq_id))
             for w in seq.workers]
    return torch.cat([k for k, _ in parts], 1), torch.cat([v for _, v in parts], 1)


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_a_shrink_moves_running_sequences_into_the_kept_pool_and_they_go_on_exact(
        smol, smol_packed, prompts, hf_greedy, kv_dtype):
    """Three workers of 600 slots, six prompts spread over them; after 6 steps the pool
    shrinks to one, which has room for them all: every sequence with KV on a leaving
    worker moves it (the same bytes, int8 codes and scales too, at its new slots),
    none is preempted or computes anything again, and each gives HF's greedy tokens
    (int8: the tokens of the same engine never shrunk). Every slot free at the end."""
    def engine(workers):
        return _engine(smol, smol_packed, 600, workers, kv_dtype=kv_dtype,
                       prefix_caching=False)

    if kv_dtype == "int8":  # the reference: the same KV codes, never moved
        ref = Stepper(engine(1), [prompts[i] for i in PICK], GREEDY).run_out()
    else:
        ref = [hf_greedy[i] for i in PICK]
    eng = engine(3)
    run = Stepper(eng, [prompts[i] for i in PICK], GREEDY)
    run.steps(6)
    leaving = [s for s in eng.scheduler.running if any(w > 0 for w in s.workers)]
    assert len(leaving) >= 2
    held = {s.seq_id: _kv_of(eng, s) for s in leaving}
    slots = sum(len(eng.allocs[w].slots(s.seq_id)) for s in leaving for w in s.workers if w)
    shrunk = eng.scale_memory_workers(1)
    assert (shrunk.preempted, shrunk.recompute_tokens) == (0, 0)
    assert (shrunk.relocated, shrunk.relocated_tokens) == (len(leaving), slots)
    for s in leaving:
        assert s.workers == [0] and s.status == "running"
        k, v = _kv_of(eng, s)
        assert torch.equal(k, held[s.seq_id][0]) and torch.equal(v, held[s.seq_id][1])
    assert run.run_out() == ref
    assert all(run.done[i].metrics["preemptions"] == 0 for i in run.ids)
    assert eng.free_slots() == [600]


def test_a_shrink_whose_move_fails_preempts_those_sequences_and_they_are_computed_again(
        smol, smol_packed, prompts, hf_greedy, monkeypatch, caplog):
    """The executor fails to move the KV (a worker gone): the sequences it would have
    moved are preempted instead, nothing of theirs cached (their new slots hold no KV),
    the failure logged by name; each computes its KV again and gives HF's tokens, and
    every slot is free at the end."""
    eng = _engine(smol, smol_packed, 600, 3)
    run = Stepper(eng, [prompts[i] for i in PICK], GREEDY)
    run.steps(6)
    leaving = [s for s in eng.scheduler.running if any(w > 0 for w in s.workers)]
    lost = sum(s.written for s in leaving)

    def fail(moves):
        raise ConnectionError("memory worker 2 is gone")

    monkeypatch.setattr(eng.executor, "move_kv", fail)
    with caplog.at_level("WARNING"):
        shrunk = eng.scale_memory_workers(1)
    assert "ConnectionError: memory worker 2 is gone): they are preempted" in caplog.text
    assert (shrunk.relocated, shrunk.relocated_tokens) == (0, 0)
    assert shrunk.preempted == len(leaving) and shrunk.recompute_tokens == lost
    assert [s.seq_id for s in eng.scheduler.waiting][:len(leaving)] == [
        s.seq_id for s in leaving]
    assert all(s.kept == 0 for s in leaving)
    assert run.run_out() == [hf_greedy[i] for i in PICK]
    assert eng.free_slots() == [600]


def test_workers_started_beside_the_steps_join_between_two_and_stale_ones_are_refused(
        smol, smol_packed, prompts, hf_greedy):
    """`Executor.start_memory_workers` while steps run: the started worker is in no
    step until `scale_memory_workers(n, started)` adds it. Workers started for other
    indices than the change needs are refused by name (and stopped), the engine as
    before. The requests give HF's greedy tokens."""
    eng = _engine(smol, smol_packed, 160, 1)
    run = Stepper(eng, [prompts[i] for i in PICK], GREEDY)
    steps = run.steps

    steps(3)
    started = eng.executor.start_memory_workers(1, 1)
    steps(3)  # beside it
    assert len(eng.executor.memory) == len(eng.allocs) == 1
    stale = eng.executor.start_memory_workers(1, 2)
    with pytest.raises(ValueError, match=r"memory workers 1\.\.2 were started, but 1 -> 2 "
                                         "needs others"):
        eng.scale_memory_workers(2, stale)
    assert len(eng.executor.memory) == 1
    eng.scale_memory_workers(2, started)
    assert eng.executor.memory[1] is started.workers[0]
    assert run.run_out() == [hf_greedy[i] for i in PICK]


def test_scaling_refuses_what_would_not_fit_and_changes_nothing(smol, smol_packed, prompts):
    """Fewer workers than a request in the engine needs (its KV split over them), or
    none: ValueError naming it, the engine as before; the request then finishes."""
    eng = _engine(smol, smol_packed, 100, 3)
    rid = eng.add_request(prompts[5], SamplingParams(max_tokens=3, temperature=0))  # 200
    eng.step()  # its prompt, split over the three workers, and its first token
    held = [a.num_free() for a in eng.allocs]
    with pytest.raises(ValueError, match=f"1 memory workers hold 100 KV positions a "
                                         f"sequence; sequence 0 of request {rid} has 201 "
                                         "tokens"):
        eng.scale_memory_workers(1)
    with pytest.raises(ValueError, match="memory workers must be >= 1, not 0"):
        eng.scale_memory_workers(0)
    assert [a.num_free() for a in eng.allocs] == held and len(eng.executor.memory) == 3
    while eng.has_unfinished():
        eng.step()
    assert eng.free_slots() == [100] * 3


def test_a_leaving_workers_sessions_move_to_a_kept_worker_and_their_next_turn_loads_them(
        smol, smol_packed):
    """Sessions' KV saved in a leaving worker's tier is moved into a kept worker's host
    tier before the worker goes: the next turn loads it from there (nothing
    computed again) and answers as HF."""
    from tests.conftest import hf_greedy_of

    eng = _engine(smol, smol_packed, 200, 2, kv_host_bytes=1 << 26)
    tok, four = smol.tokenizer, SamplingParams(max_tokens=4, temperature=0)
    first = {s: tok(f"Tell me about city number {s}.")["input_ids"] for s in ("a", "b")}
    rids = {s: eng.add_request(p, four, session_id=s) for s, p in first.items()}
    outs = {}
    while eng.has_unfinished():
        outs.update((o.request_id, o) for o in eng.step() if o.finished)
    eng.flush()  # the saves reach the tiers
    where = {s: e.worker for s, e in eng.sessions.sessions.items()}
    assert sorted(where.values()) == [0, 1]
    gone = next(s for s, w in where.items() if w == 1)
    hist = first[gone] + outs[rids[gone]].outputs[0].token_ids
    done = eng.scale_memory_workers(1)
    assert (done.preempted, done.recompute_tokens) == (0, 0)
    assert done.moved_tokens == len(hist) - 1  # every position fed has its KV saved
    assert {s: e.worker for s, e in eng.sessions.sessions.items()} == {"a": 0, "b": 0}
    assert eng.executor.memory[0].tiers.host.keys() == {
        e.id for e in eng.sessions.sessions.values()}
    nxt = hist + tok(" And its river?")["input_ids"]
    eng.clear_prefix_cache()  # (the other session's prompt shares a start with it)
    rid = eng.add_request(nxt, four, session_id=gone)
    while eng.has_unfinished():
        outs.update((o.request_id, o) for o in eng.step() if o.finished)
    assert outs[rid].metrics["tier_cached_tokens"] == len(hist) - 1
    assert outs[rid].outputs[0].token_ids == hf_greedy_of(smol, [nxt], 4)[0]


@pytest.mark.parametrize("mode", ["auto", "recompute"])
def test_a_shrink_with_swap_moves_the_leaving_parts_and_loads_them_back_exact(
        smol, smol_packed, prompts, hf_greedy, mode):
    """Three workers of 110 slots with a host tier, six prompts split over them as they
    grow; after 14 steps the pool shrinks to two. With swap ("auto") each preempted
    sequence's parts are saved, those on the leaving worker moved to a kept worker
    its other parts do not use, and its readmission loads them: far fewer positions
    computed again than with "recompute". HF's greedy tokens either way; every slot
    free and the tiers empty at the end."""
    eng = _engine(smol, smol_packed, 110, 3, kv_host_bytes=1 << 26, preemption_mode=mode)
    run = Stepper(eng, [prompts[i] for i in PICK], GREEDY)
    steps = run.steps

    steps(14)
    assert any(2 in s.workers and len(s.workers) > 1 for s in eng.scheduler.running)
    shrunk = eng.scale_memory_workers(2)
    assert shrunk.preempted > 0
    if mode == "auto":
        assert shrunk.moved_tokens > 0 and shrunk.recompute_tokens == 0
        assert all(e.worker < 2 for e in eng.sessions.sessions.values())
    else:
        assert shrunk.moved_tokens == 0 and shrunk.recompute_tokens > 0
    assert run.run_out() == [hf_greedy[i] for i in PICK]
    eng.flush()
    assert eng.free_slots() == [110, 110] and eng.sessions.sessions == {}
    if mode == "auto":
        assert eng.tier_stats()["tier_hit_tokens"] > 0


def test_the_serving_loop_scales_between_steps_and_its_requests_go_on(
        smol, smol_packed, prompts, hf_greedy):
    """`EngineLoop.call`: the change runs on the loop thread between two steps while
    requests stream; each gives HF's greedy tokens. A call that raises fails its own
    future only. /metrics follows the count: `lamina_memory_workers`, and a leaving
    worker's KV series removed."""
    from prometheus_client.parser import text_string_to_metric_families

    from lamina.entrypoints.metrics import EngineMetrics

    def series(name):
        return {tuple(x.labels.values()): x.value
                for fam in text_string_to_metric_families(metrics.render().decode())
                for x in fam.samples if x.name == name}

    eng, metrics = _engine(smol, smol_packed, 160, 1), EngineMetrics()
    loop = EngineLoop(eng, metrics)
    try:
        seen = threading.Event()
        futs = [loop.submit(prompts[i], GREEDY, on_update=lambda out: seen.set())
                for i in PICK]
        assert seen.wait(60)
        grown = loop.call(lambda e: e.scale_memory_workers(2)).result(60)
        assert (grown.before, grown.after) == (1, 2)
        assert series("lamina_memory_workers") == {(): 2}
        assert set(series("lamina_kv_slots_used")) == {("0",), ("1",)}
        bad = loop.call(lambda e: e.scale_memory_workers(0))
        with pytest.raises(ValueError, match="not 0"):
            bad.result(60)
        shrunk = loop.call(lambda e: e.scale_memory_workers(1)).result(60)
        assert (shrunk.before, shrunk.after) == (2, 1)
        assert series("lamina_memory_workers") == {(): 1}  # worker 1's series gone
        assert set(series("lamina_kv_slots_used")) == set(series("lamina_kv_slots_cached")) \
            == {("0",)}
        outs = [f.result(120) for f in futs]
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy[i] for i in PICK]
        assert loop.alive
    finally:
        loop.shutdown()


def test_tiers_of_added_workers_are_set_up_as_the_first_ones(smol, smol_packed):
    eng = _engine(smol, smol_packed, 64, 1, kv_host_bytes=1 << 20)
    eng.scale_memory_workers(2)
    new = eng.executor.memory[1]
    assert new.tiers is not None and new.tiers.worker == 1
    assert new.pool.config == eng.executor.memory[0].pool.config
    assert new.pool.k.data_ptr() != eng.executor.memory[0].pool.k.data_ptr()
    assert TierConfig(1 << 20).host_bytes == new.tiers.config.host_bytes


def test_a_sequence_larger_than_the_pools_waits_for_the_workers_the_ceiling_allows_exact():
    """Two workers of 4 slots, split KV. A sequence of 9 tokens is refused while the
    pools may not grow; with `ceiling` 3 it is taken and waits, `short` of 3 workers
    (its 9 positions and the next one's), beside a small one that runs and after it,
    never named unplaceable; a third worker added, it is placed over the three. A
    ceiling lowered under a waiting one names it unplaceable."""
    allocs = [KVAllocator(KVAllocatorConfig(4)) for _ in range(2)]
    s = Scheduler(SchedulerConfig(4, 100, True), allocs)
    big, small = Sequence(0, list(range(1, 10)), P), Sequence(1, [20, 21], P)
    with pytest.raises(ValueError, match="needs 9 KV slots; the memory workers hold 8"):
        s.add(big)
    s.ceiling = 3
    assert s.capacity() == 12 and s.workers_for(10) == 3 and s.workers_for(13) is None
    s.add(small)
    s.add(big)
    assert _plan(s) == [(1, (20, 21), 0, (0, 1), 0, ())]
    assert s.short == Shortfall(0, 10, 3) and s.unplaceable == [] and list(s.waiting) == [big]
    small.output.append(22)
    s.finish(small, "length")
    assert _plan(s) == [] and s.short == Shortfall(0, 10, 3) and s.unplaceable == []
    s.add_workers([KVAllocator(KVAllocatorConfig(4))])
    assert _plan(s) == [(0, tuple(range(1, 10)), 0, (0, 1, 2, 3, 0, 1, 2, 3, 0), 0,
                         ((0, 0), (1, 4), (2, 8)))]
    assert s.short is None and [a.num_free() for a in s.allocs] == [0, 0, 3]
    s.finish(big, "length")
    t = Scheduler(SchedulerConfig(4, 100, True), [KVAllocator(KVAllocatorConfig(4))])
    t.ceiling = 4
    t.add(Sequence(5, [1] * 6, P))
    assert _plan(t) == [] and t.short == Shortfall(5, 7, 2)
    t.ceiling = 0  # (the autoscaler stopped)
    assert _plan(t) == [] and t.short is None
    assert [f.seq_ids for f in t.unplaceable] == [(5,)]


def test_a_prompt_larger_than_the_pools_waits_for_the_growth_allowed_then_runs_exact(
        smol, smol_packed, prompts, hf_greedy):
    """One worker of 100 slots. A 200-token prompt is refused by name; once the pools
    may grow to 3 workers (`allow_growth`, as an autoscaler sets) it is taken and waits
    beside a small request, short of 3 workers; while it alone is left and nothing is
    owed to the workers, a step sends them nothing (it waits `SHORT_POLL_S`). Grown to
    3, it runs. A 300-token prompt is refused naming the ceiling. Both give HF's greedy
    tokens."""
    eng = _engine(smol, smol_packed, 100, 1)
    with pytest.raises(ValueError, match=r"prompt has 200 tokens; the KV pools hold 100$"):
        eng.add_request(prompts[5], GREEDY)
    eng.allow_growth(3, wait_s=60)
    with pytest.raises(ValueError, match=r"prompt has 300 tokens; the KV pools hold 300 "
                                         r"at the most memory workers they may grow to \(3\)"):
        eng.add_request(prompts[6], GREEDY)
    run = Stepper(eng, [prompts[1], prompts[5]], GREEDY)  # 12 and 200 tokens
    t0 = time.monotonic()
    run.steps(1)
    short = eng.scheduler.short
    assert (short.tokens, short.workers) == (201, 3) and len(eng.scheduler.running) == 1
    while eng.scheduler.running:
        run.steps()
    run.steps()  # it sends the small one's table to drop
    calls, execute = [], eng.executor.execute
    eng.executor.execute = lambda plan: (calls.append(plan), execute(plan))[1]
    t = time.monotonic()
    run.steps(3)
    assert calls == [] and time.monotonic() - t >= 3 * SHORT_POLL_S
    assert eng.has_unfinished() and eng.num_failed_requests == 0
    wait = eng.waiting_for_workers()  # what `lamina status` shows
    assert (wait.seq_id, wait.tokens, wait.workers, wait.wait_s) == (short.seq_id, 201, 3, 60)
    assert 0.1 <= wait.waited_s <= time.monotonic() - t0 + 0.05
    from lamina.cluster.cli import _waiting_line

    assert _waiting_line(asdict(wait)) == (
        f"  waiting for memory workers: sequence {short.seq_id} needs 201 KV positions, the "
        f"pools of 3; waited {wait.waited_s:.0f} s of at most 60")
    eng.scale_memory_workers(3)
    assert eng.waiting_for_workers() is None
    assert run.run_out() == [hf_greedy[1], hf_greedy[5]]
    assert eng.scheduler.short is None and eng.free_slots() == [100] * 3


def test_a_sequence_waiting_longer_than_allowed_for_workers_fails_alone(
        smol, smol_packed, prompts, hf_greedy):
    """The pools may grow to 3, but nobody grows them: the 200-token prompt fails alone
    after `wait_s`, by name; the small request beside it gives HF's tokens, and the
    engine is left as if the big one had never come."""
    eng = _engine(smol, smol_packed, 100, 1)
    eng.allow_growth(3, wait_s=0.3)
    run = Stepper(eng, [prompts[1], prompts[5]], GREEDY)
    t = time.monotonic()
    while eng.has_unfinished():
        run.steps()
    assert time.monotonic() - t >= 0.3
    small, big = (run.done[i] for i in run.ids)
    assert small.outputs[0].token_ids == hf_greedy[1]
    assert big.outputs[0].finish_reason == "error" and big.outputs[0].token_ids == []
    assert ("needs 201 KV positions, 3 memory workers' pools of 100 slots; they stayed 1 "
            "for 0.3 s") in big.error
    assert eng.num_failed_requests == 1 and eng.free_slots() == [100]
    assert not eng.scheduler.waiting and eng.scheduler.short is None


def test_a_sequence_outgrowing_the_pools_waits_for_more_rather_than_ending(
        smol, smol_packed, prompts, hf_greedy):
    """One worker of 100 slots that may grow to 2: a 90-token prompt decoding 32 tokens
    fills the pool at 100 positions. Without a ceiling it would end there ("length");
    here it is preempted, waits short of 2 workers, and once the second joins it goes
    on to HF's 32 greedy tokens."""
    eng = _engine(smol, smol_packed, 100, 1)
    eng.allow_growth(2, wait_s=60)
    run = Stepper(eng, [prompts[12]], GREEDY)
    while eng.scheduler.short is None:
        run.steps()
    assert eng.scheduler.short.workers == 2 and eng.scheduler.num_preemptions == 1
    eng.scale_memory_workers(2)
    assert run.run_out() == [hf_greedy[12]] and len(hf_greedy[12]) == 32
    assert run.done[run.ids[0]].outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_workers must be None or an int >= 1"):
        eng.allow_growth(0)
    with pytest.raises(ValueError, match="wait_s must be a number of seconds >= 0"):
        eng.allow_growth(2, wait_s=-1)


def test_under_priority_the_sequence_that_ends_admission_is_the_one_short_of_workers():
    """By priority, a 9-token sequence (priority 0) goes before a 2-token one that came
    first (priority 1): with one worker of 4 slots that may grow to 3, it ends the
    step's admission (no overtaking), so it is the one `short` of workers, and the small
    one, which would fit, is not named unplaceable. Two workers added, both are placed."""
    s = Scheduler(SchedulerConfig(4, 100, True, policy="priority"),
                  [KVAllocator(KVAllocatorConfig(4))])
    s.ceiling = 3
    small = Sequence(0, [20, 21], P, priority=1)
    big = Sequence(1, list(range(1, 10)), P, priority=0)
    s.add(small)
    s.add(big)
    assert _plan(s) == [] and s.short == Shortfall(1, 10, 3) and s.unplaceable == []
    s.add_workers([KVAllocator(KVAllocatorConfig(4)) for _ in range(2)])
    assert _plan(s) == [(1, tuple(range(1, 10)), 0, (0, 1, 2, 3, 0, 1, 2, 3, 0), 0,
                         ((0, 0), (1, 4), (2, 8))),
                        (0, (20, 21), 0, (1, 2), 2, ())]
    assert s.short is None and [a.num_free() for a in s.allocs] == [0, 0, 1]
