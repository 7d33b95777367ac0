"""Scheduler: exact plans, slot ids, admission order, preemption and recompute."""
import pytest

from lamina.engine.messages import SeqWork
from lamina.engine.scheduler import Part, Scheduler, SchedulerConfig, Sequence, Skip
from lamina.engine.sessions import SessionIndex
from lamina.memory.allocator import KVAllocator, KVAllocatorConfig
from lamina.memory.tier_orders import TierConfig, TierOrder
from lamina.sampling.params import SamplingParams

P = SamplingParams(max_tokens=8)


def make(num_slots=8, max_batch=4, budget=100, workers=1, split_kv=True):
    allocs = [KVAllocator(KVAllocatorConfig(num_slots)) for _ in range(workers)]
    return Scheduler(SchedulerConfig(max_batch, budget, split_kv),
                     allocs[0] if workers == 1 else allocs)


def test_admission_decode_preemption_and_recompute_exact():
    s = make()
    a, b = Sequence(0, [10, 11, 12], P), Sequence(1, [20, 21, 22, 23], P)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    assert plan.seqs == (SeqWork(0, (10, 11, 12), 0, (0, 1, 2), params=P),
                         SeqWork(1, (20, 21, 22, 23), 0, (3, 4, 5, 6), params=P))
    a.output.append(13)
    b.output.append(24)
    # a decodes into the last free slot; b then has none: b (newest) is preempted.
    plan = s.schedule()  # a decode step sends only the new position's slot
    assert plan.seqs == (SeqWork(0, (13,), 3, (7,), params=P, slots_from=3),)
    assert b.status == "waiting" and b.num_preemptions == 1 and list(s.waiting) == [b]
    assert s.alloc.free_list() == [3, 4, 5, 6]  # b's slots back, first position first
    a.output.append(14)
    s.finish(a, "length")
    # b comes back and recomputes prompt + its generated token.
    plan = s.schedule()
    # LIFO reuse
    assert plan.seqs == (SeqWork(1, (20, 21, 22, 23, 24), 0, (0, 1, 2, 7, 3), params=P),)


def test_fifo_no_overtaking_and_batch_and_budget_limits():
    s = make(num_slots=100, max_batch=2, budget=10)
    seqs = [Sequence(i, [1] * n, P) for i, n in enumerate([4, 8, 2, 1])]
    for q in seqs:
        s.add(q)
    plan = s.schedule()
    # seq 1 (8) gets the 6 tokens left of the budget, drawing nothing yet; the batch is
    # full (2), so seq 2 waits behind it
    assert [(w.seq_id, len(w.token_ids), w.sample) for w in plan.seqs] == [
        (0, 4, True), (1, 6, False)]
    seqs[0].output.append(5)
    plan = s.schedule()
    assert [(w.seq_id, len(w.token_ids), w.sample) for w in plan.seqs] == [
        (0, 1, True), (1, 2, True)]  # decode 0; the rest of 1's prompt, then it draws
    for q in s.running:
        q.output.append(5)
    plan = s.schedule()
    assert [w.seq_id for w in plan.seqs] == [0, 1]  # batch full (2)


def test_held_sequences_keep_their_place_while_others_are_admitted():
    """`admits` (the engine's culprit search) passes over held sequences; they wait in
    place and are admitted once let through. All held: an empty plan, not an error."""
    s = make(num_slots=100)
    seqs = [Sequence(i, [i + 1] * 2, P) for i in range(3)]
    for q in seqs:
        s.add(q)
    held = {1}
    s.admits = lambda q: q.seq_id not in held
    plan = s.schedule()
    assert plan.seqs == (SeqWork(0, (1, 1), 0, (0, 1), params=P),
                         SeqWork(2, (3, 3), 0, (2, 3), params=P))
    assert list(s.waiting) == [seqs[1]]
    held.clear()
    seqs[0].output.append(5)
    seqs[2].output.append(6)
    plan = s.schedule()
    assert plan.seqs == (SeqWork(0, (5,), 2, (4,), params=P, slots_from=2),
                         SeqWork(2, (6,), 2, (5,), params=P, slots_from=2),
                         SeqWork(1, (2, 2), 0, (6, 7), params=P))
    s = make()
    s.add(Sequence(0, [1], P))
    s.admits = lambda q: False
    assert s.schedule().seqs == () and len(s.waiting) == 1


def test_long_prompt_fed_in_chunks_exact_slots():
    s = make(num_slots=20, budget=4)
    a, b = Sequence(0, [1, 2, 3], P), Sequence(1, list(range(10, 20)), P)
    s.add(a)
    s.add(b)
    plan = s.schedule()  # b: all 10 slots at admission (3..12), 1 token of budget left
    assert plan.seqs == (SeqWork(0, (1, 2, 3), 0, (0, 1, 2), params=P),
                         SeqWork(1, (10,), 0, (3,), sample=False, params=P))
    assert s.alloc.slots(1) == list(range(3, 13)) and b.pending == 9
    a.output.append(4)
    plan = s.schedule()  # a decodes into slot 13; b's next 3 positions, their slots only
    assert plan.seqs == (SeqWork(0, (4,), 3, (13,), params=P, slots_from=3),
                         SeqWork(1, (11, 12, 13), 1, (4, 5, 6), sample=False, params=P,
                                 slots_from=1))
    a.output.append(5)
    s.schedule()
    a.output.append(6)
    plan = s.schedule()
    assert plan.seqs[1] == SeqWork(1, (17, 18, 19), 7, (10, 11, 12), params=P, slots_from=7)
    assert b.pending == 0
    a.output.append(7)
    b.output.append(20)
    plan = s.schedule()  # both decode now
    assert plan.seqs == (SeqWork(0, (7,), 6, (16,), params=P, slots_from=6),
                         SeqWork(1, (20,), 10, (17,), params=P, slots_from=10))


def test_chunks_of_a_prompt_split_over_workers_name_the_ranges_they_reach():
    s = make(num_slots=6, budget=4, workers=2)
    q = Sequence(0, list(range(10)), P)
    s.add(q)
    assert s.schedule().seqs == (SeqWork(0, (0, 1, 2, 3), 0, (0, 1, 2, 3), sample=False,
                                         params=P),)
    assert q.segments == [(0, 0), (1, 6)]
    assert s.schedule().seqs == (SeqWork(0, (4, 5, 6, 7), 4, (4, 5, 0, 1), sample=False,
                                         params=P, segments=((0, 0), (1, 6)), slots_from=4),)
    assert s.schedule().seqs == (SeqWork(0, (8, 9), 8, (2, 3), params=P,
                                         segments=((0, 0), (1, 6)), slots_from=8),)


def test_a_prompt_that_may_not_be_chunked_waits_for_a_whole_step():
    s = make(num_slots=20, budget=4)
    whole = SamplingParams(max_tokens=8, prompt_logprobs=1)  # its rows come from one step
    s.add(Sequence(0, [1, 2], P))
    s.add(Sequence(1, [1] * 3, whole))
    plan = s.schedule()  # 2 left after seq 0: seq 1 (3) waits for a step with room
    assert [(w.seq_id, len(w.token_ids)) for w in plan.seqs] == [(0, 2)]
    s.running[0].output.append(5)
    plan = s.schedule()
    assert [(w.seq_id, len(w.token_ids), w.sample) for w in plan.seqs] == [(0, 1, True),
                                                                           (1, 3, True)]


def test_aborting_a_prompt_midway_caches_only_the_positions_fed():
    s = Scheduler(SchedulerConfig(4, 4), KVAllocator(KVAllocatorConfig(12)),
                  prefix_caching=True)
    q = Sequence(0, list(range(10)), P)
    s.add(q)
    s.schedule()
    s.schedule()  # positions 0..7 fed, 8..9 not yet
    s.abort(q)
    assert not s.running and s.schedule().released == (0,)
    assert s.caches[0].match(list(range(10))) == list(range(8))
    assert s.alloc.num_free() == 4  # the other 8 held by the cache alone


def test_a_sparse_sequence_never_feeds_its_prompts_last_position_alone():
    """A sequence whose KV policy cuts one-query rows (`sparse`, here ids >= 10): a
    cached prefix leaves its last two tokens to feed, where a dense one's leaves one;
    chunks never leave it a one-token tail (a budget of 1 then feeds the last two)."""
    def sched(budget):
        return Scheduler(SchedulerConfig(4, budget), KVAllocator(KVAllocatorConfig(32)),
                         prefix_caching=True, sparse=lambda seq: seq.seq_id >= 10)

    def fed(s):
        return [(w.seq_id, w.start_pos, w.token_ids) for w in s.schedule().seqs]

    s = sched(100)
    s.add(Sequence(0, [10, 11, 12, 13], P))
    assert fed(s) == [(0, 0, (10, 11, 12, 13))]
    s.running[0].output.append(99)
    s.finish(s.running[0], "length")  # its 4 prompt positions cached
    s.add(Sequence(10, [10, 11, 12, 13, 14], P))
    s.add(Sequence(1, [10, 11, 12, 13, 15], P))
    assert fed(s) == [(10, 3, (13, 14)), (1, 4, (15,))]
    for budget, want in [(3, [(0, (30, 31)), (2, (32, 33))]),
                         (1, [(0, (30,)), (1, (31,)), (2, (32, 33))])]:
        s = sched(budget)
        s.add(Sequence(11, [30, 31, 32, 33], P))
        assert [fed(s)[0][1:] for _ in want] == want
    s = sched(3)
    s.add(Sequence(2, [30, 31, 32, 33], P))  # dense: 3, then its last alone
    assert [fed(s)[0][1:] for _ in range(2)] == [(0, (30, 31, 32)), (3, (33,))]


def test_a_whole_prompt_past_the_budget_goes_alone_and_kv_shortage_is_reported():
    """A prompt that may not be chunked and is longer than the budget (a recompute: the
    engine refuses such a new request) is fed whole in a step of its own, not never."""
    s = make(num_slots=8, budget=3)
    whole = SamplingParams(max_tokens=2, prompt_logprobs=1)
    s.add(Sequence(0, [1] * 2, P))
    s.add(Sequence(1, [1] * 5, whole))
    assert [(w.seq_id, len(w.token_ids)) for w in s.schedule().seqs] == [(0, 2)]
    s.running[0].output.append(5)
    s.finish(s.running[0], "length")
    assert [(w.seq_id, len(w.token_ids)) for w in s.schedule().seqs] == [(1, 5)]
    s.running[0].output.append(5)
    s.add(Sequence(2, [1] * 4, P))  # 2 slots left: it cannot be placed, nothing runs it
    s.finish(s.running[0], "length")
    s.allocs[0].allocate("held", 6)
    assert s.schedule().seqs == () and len(s.waiting) == 1  # named, for the engine to fail
    assert [(f.seq_ids, str(f)) for f in s.unplaceable] == [((2,), (
        "sequence 2 (4 tokens) cannot be placed: [2] free KV slots, 0 more the prefix "
        "cache can give, step token budget 3"))]
    with pytest.raises(ValueError, match="needs 9 KV slots"):
        s.add(Sequence(3, [1] * 9, P))


def test_config_validation():
    with pytest.raises(ValueError, match="max_batch"):
        SchedulerConfig(max_batch=0)


def test_parallel_sampling_prefills_once_then_forks_the_kv():
    s = make(num_slots=10, max_batch=4)
    kids = [Sequence(1, [7, 8, 9], P, seed=6), Sequence(2, [7, 8, 9], P, seed=7)]
    parent = Sequence(0, [7, 8, 9], P, seed=5, forks=list(kids))
    s.add(parent)
    plan = s.schedule()
    # one prefill, three draws (one seed per sibling)
    assert plan.seqs == (SeqWork(0, (7, 8, 9), 0, (0, 1, 2), params=P, seeds=(5, 6, 7)),)
    assert s.fork(parent) == kids and parent.forks == []
    assert [s.alloc.refcount(i) for i in (0, 1, 2)] == [3, 3, 3]
    assert s.alloc.slots(1) == s.alloc.slots(2) == [0, 1, 2]
    for q, tok in zip([parent, *kids], (10, 20, 30)):
        q.output.append(tok)
    plan = s.schedule()  # each appends its own slot after the shared prompt
    # the parent's table goes as a diff; each fork's first step sends its whole table
    assert plan.seqs == (SeqWork(0, (10,), 3, (3,), params=P, seeds=(5,), slots_from=3),
                         SeqWork(1, (20,), 3, (0, 1, 2, 4), params=P, seeds=(6,)),
                         SeqWork(2, (30,), 3, (0, 1, 2, 5), params=P, seeds=(7,)))
    s.finish(parent, "length")
    assert [s.alloc.refcount(i) for i in (0, 1, 2, 3)] == [2, 2, 2, 0]
    assert s.alloc.free_list()[0] == 3  # only the parent's own slot came back
    s.finish(kids[0], "length")
    s.finish(kids[1], "length")
    assert s.alloc.stats().used == 0


def test_forks_need_batch_room_for_all_siblings():
    s = make(num_slots=20, max_batch=2)
    parent = Sequence(0, [1, 2], P, forks=[Sequence(1, [1, 2], P), Sequence(2, [1, 2], P)])
    s.add(parent)
    assert s.schedule().seqs == ()  # 3 siblings never fit a batch of 2: reported, not dropped
    assert [f.seq_ids for f in s.unplaceable] == [(0,)] and list(s.waiting) == [parent]


def test_kv_split_prefill_and_decode_spill_exact():
    s = make(num_slots=4, workers=2)
    a = Sequence(0, [1, 2, 3, 4, 5, 6], P)
    s.add(a)
    plan = s.schedule()  # 6 tokens > 4 free on either worker: 4 on worker 0, 2 on worker 1
    assert plan.seqs == (SeqWork(0, (1, 2, 3, 4, 5, 6), 0, (0, 1, 2, 3, 0, 1), worker=0,
                                 params=P, segments=((0, 0), (1, 4))),)
    a.output.append(7)
    plan = s.schedule()  # decode appends on its last range's worker
    assert plan.seqs[0].slots == (2,) and plan.seqs[0].slots_from == 6 and a.worker == 1
    assert s.allocs[0].slots(0) + s.allocs[1].slots(0) == [0, 1, 2, 3, 0, 1, 2]
    b = Sequence(1, [9], P)
    s.add(b)
    a.output.append(8)
    plan = s.schedule()  # a takes w1's last slot; b has no room anywhere and waits
    assert [w.seq_id for w in plan.seqs] == [0] and list(s.waiting) == [b]
    assert [x.num_free() for x in s.allocs] == [0, 0]
    s.finish(a, "length")
    assert [x.free_list() for x in s.allocs] == [[0, 1, 2, 3], [0, 1, 2, 3]]


def test_decode_spills_to_another_worker_instead_of_preempting():
    s = make(num_slots=4, workers=2)
    a, b = Sequence(0, [1, 2, 3], P), Sequence(1, [5, 6], P)
    s.add(a)
    s.add(b)
    s.schedule()  # a on worker 0 (tie: lowest id), then b on worker 1 (most free)
    assert (a.segments, b.segments) == ([(0, 0)], [(1, 0)])
    for q in (a, b):
        q.output.append(9)
    s.schedule()  # both append in place: w0 full, w1 has 1 free
    for q in (a, b):
        q.output.append(9)
    plan = s.schedule()
    # a spills its 5th position onto worker 1's last slot (3) rather than being preempted;
    # b then finds w1 full and nowhere to spill: it is the newest on w1, so it yields
    assert plan.seqs == (SeqWork(0, (9,), 4, (3,), worker=0, params=P,
                                 segments=((0, 0), (1, 4)), slots_from=4),)
    assert s.allocs[0].slots(0) == [0, 1, 2, 3]
    assert b.status == "waiting" and b.num_preemptions == 1 and a.num_preemptions == 0
    assert s.allocs[1].slots(0) == [3] and s.allocs[1].free_list() == [0, 1, 2]


def test_split_kv_off_keeps_one_worker_per_sequence():
    s = make(num_slots=4, workers=2, split_kv=False)
    with pytest.raises(ValueError, match="needs 6 KV slots"):
        s.add(Sequence(0, [1] * 6, P))
    with pytest.raises(ValueError, match="split_kv"):
        SchedulerConfig(split_kv="yes")


def test_eviction_gives_back_slots_in_chunks_exact():
    """An eviction rule keeping positions 0-1 and the last 3: the slots of the positions
    between are given back once 2 or more can go (evict_chunk), the plans say which, the
    freed slots serve the next admission, and a preemption restores a whole table."""
    allocs = [KVAllocator(KVAllocatorConfig(12))]
    s = Scheduler(SchedulerConfig(4, 100, evict_chunk=2), allocs[0],
                  evict=lambda q: (2, q.num_tokens - 3) if q.num_tokens - 3 > 2 else None)
    a = Sequence(0, [1] * 6, P)
    s.add(a)
    assert s.schedule().seqs == (SeqWork(0, (1,) * 6, 0, (0, 1, 2, 3, 4, 5), params=P),)
    a.output.append(7)
    # decode at position 6: positions 2, 3 (of 0..6) can go: 2 >= the chunk
    assert s.schedule().seqs == (SeqWork(0, (7,), 6, (6,), params=P, slots_from=6,
                                         evicted=(2, 4)),)
    assert s.alloc.slots(0) == [0, 1, -1, -1, 4, 5, 6] and s.alloc.free_list()[:2] == [2, 3]
    a.output.append(8)
    # position 4 alone could go: under the chunk, kept for now
    assert s.schedule().seqs[0].evicted == (2, 4) and s.alloc.slots(0)[4] == 4
    a.output.append(9)
    assert s.schedule().seqs[0].evicted == (2, 6)  # 4 and 5 go together
    assert s.alloc.slots(0) == [0, 1, -1, -1, -1, -1, 6, 2, 3]
    b = Sequence(1, [5] * 4, P)
    s.add(b)
    a.output.append(10)
    plan = s.schedule()
    # a's position 9 and b's first take the slots of positions 4 and 5 given back
    assert plan.seqs[0].slots == (4,) and plan.seqs[0].evicted == (2, 6)
    assert plan.seqs[1] == SeqWork(1, (5,) * 4, 0, (5, 7, 8, 9), params=P)
    s.preempt_all()
    assert a.evicted == (0, 0) and s.alloc.stats().used == 0
    s.cache(a, 9)  # no cache: a no-op, and never of positions past a hole


def _fill_then_preempt(s: Scheduler):
    """a (3 tokens) and b (4) take slots 0-2 and 3-6 of 8; each draws a token; a then
    takes the last free slot (7) and b, with none, is preempted. -> (a, b, that plan)"""
    a, b = Sequence(0, [10, 11, 12], P), Sequence(1, [20, 21, 22, 23], P)
    s.add(a)
    s.add(b)
    s.schedule()
    a.output.append(13)
    b.output.append(24)
    return a, b, s.schedule()


def test_a_preempted_sequence_keeps_its_kv_in_the_cache_exact():
    """With prefix caching, a preempted sequence's written positions stay cached: their
    slots are evictable, taken from its end one at a time as others need them; readmitted,
    it takes back what is left (on its worker, whatever the balance) and computes only
    the rest."""
    s = Scheduler(SchedulerConfig(4, 100), KVAllocator(KVAllocatorConfig(8)),
                  prefix_caching=True)
    a, b, plan = _fill_then_preempt(s)
    assert plan.seqs == (SeqWork(0, (13,), 3, (7,), params=P, slots_from=3),)
    assert b.status == "waiting" and b.num_preemptions == 1 and b.kept == 4
    assert s.caches[0].match([20, 21, 22, 23]) == [3, 4, 5, 6]  # its 4 written positions
    assert s.alloc.num_free() == 0 and s.caches[0].evictable() == 4
    a.output.append(14)
    plan = s.schedule()  # a's next slot is b's last cached one (its end goes first)
    assert plan.seqs == (SeqWork(0, (14,), 4, (6,), params=P, slots_from=4),)
    assert s.caches[0].match([20, 21, 22, 23]) == [3, 4, 5] and list(s.waiting) == [b]
    a.output.append(15)
    s.finish(a, "length")
    plan = s.schedule()  # b comes back onto slots 3-5 and computes positions 3 and 4
    (work,) = plan.seqs
    assert (work.seq_id, work.token_ids, work.start_pos) == (1, (23, 24), 3)
    assert work.slots[:3] == (3, 4, 5) and b.kept == 0 and b.cached == 0
    assert len(set(work.slots)) == 5


@pytest.mark.parametrize("swap", [True, False])
def test_a_preempted_sequence_is_saved_to_the_tier_and_loaded_back_exact(swap):
    """With the session tiers and `swap`, a sequence preempted for room has its written
    positions saved to its worker's host tier, in the plan of the step that frees their
    slots; readmitted after the pool's cache lost part of them, it takes back what the
    pool kept, loads the rest into fresh slots and feeds only its last drawn token (also
    under a KV policy that cuts one-query rows: the token was drawn, so fed alone as
    then). Its entry is dropped once it ends. Without swap the lost positions are
    computed again (`Sequence.recomputed`)."""
    tiers = SessionIndex(TierConfig(host_bytes=100), bytes_per_token=1)
    s = Scheduler(SchedulerConfig(4, 100, split_kv=False), [KVAllocator(KVAllocatorConfig(8))],
                  prefix_caching=True, sessions=tiers, swap=swap, sparse=lambda seq: True)
    a, b, plan = _fill_then_preempt(s)
    assert b.status == "waiting" and b.parked == ("#preempted:1" if swap else None)
    assert plan.tier_orders == ((TierOrder("save", 0, 0, 0, (3, 4, 5, 6)),) if swap else ())
    for t in (14, 15):  # a's next two slots are b's cached 6, then 5
        a.output.append(t)
        assert s.schedule().seqs[0].slots == ((6,) if t == 14 else (5,))
    a.output.append(16)
    s.finish(a, "length")
    plan = s.schedule()
    (work,) = plan.seqs
    assert work.slots[:2] == (3, 4)  # what the pool kept of b
    if swap:  # positions 2-3 loaded from the tier into fresh slots; only 24 is fed
        assert plan.tier_orders == (TierOrder("load", 0, 0, 2, (7, 6), seq_id=1),)
        assert (work.token_ids, work.start_pos, work.slots) == ((24,), 4, (3, 4, 7, 6, 5))
    else:
        assert (plan.tier_orders, work.token_ids, work.start_pos) == ((), (22, 23, 24), 2)
    assert (b.recomputed, s.parked_tokens) == ((0, 4) if swap else (2, 0))
    b.output.append(25)
    s.finish(b, "length")
    assert s.schedule().tier_orders == ((TierOrder("drop", 0, 0),) if swap else ())
    assert tiers.sessions == {} and tiers.host_bytes() == 0


def _split_b_preempted_and_c_done():
    """KV split over two workers of 4 slots ("priority", swap): b (3 tokens, priority
    1) grows from worker 0 onto worker 1; c (priority 0) displaces it. Each worker's
    part of b's KV (positions 0-3 on worker 0, 4-5 on worker 1) is saved to that
    worker's tier, the first also cached; c, growing past worker 1, evicts b's cached
    slots on worker 0 from their end rather than preempting itself, and finishes."""
    tiers = SessionIndex(TierConfig(host_bytes=100), bytes_per_token=1)
    s = Scheduler(SchedulerConfig(4, 100, split_kv=True, policy="priority"),
                  [KVAllocator(KVAllocatorConfig(4)), KVAllocator(KVAllocatorConfig(4))],
                  prefix_caching=True, sessions=tiers, swap=True)
    b = Sequence(0, [20, 21, 22], P, priority=1)
    s.add(b)
    for t in (100, 101, 102, 103):
        s.schedule()
        b.output.append(t)
    assert b.segments == [(0, 0), (1, 4)] and s.allocs[1].slots(0) == [0, 1]
    c = Sequence(1, [30, 31, 32, 33], P, priority=0)
    s.add(c)
    plan = s.schedule()
    assert plan.seqs == (SeqWork(1, (30, 31, 32, 33), 0, (0, 1, 2, 3), params=P, worker=1),)
    assert plan.tier_orders == (TierOrder("save", 0, 0, 0, (0, 1, 2, 3)),
                                TierOrder("save", 1, 1, 0, (0, 1)))
    assert (b.status, b.parked, b.kept, s.parked_tokens) == ("waiting", "#preempted:0", 4, 6)
    assert b.parts == (Part(0, 0, 4), Part(1, 4, 6))
    assert set(tiers.sessions) == {"#preempted:0", "#preempted:0@4"}
    for t, slot in ((114, 3), (115, 2), (116, 1)):  # onto worker 0, b's cache from its end
        c.output.append(t)
        assert s.schedule().seqs[0].slots == (slot,)
    assert c.segments == [(1, 0), (0, 4)] and c.num_preemptions == 0
    c.output.append(117)
    s.finish(c, "length")
    return s, tiers, b


def test_a_split_sequence_parks_each_workers_part_and_comes_back_split_exact():
    """Readmitted, b takes back what worker 0's pool kept (position 0), loads positions
    1-3 from worker 0's tier and 4-5 from worker 1's onto worker 1 (evicting c's cached
    prefix there from its end), which also takes position 6: only that last drawn token
    is computed, split as before. Its end drops both entries."""
    s, tiers, b = _split_b_preempted_and_c_done()
    plan = s.schedule()
    assert plan.tier_orders == (TierOrder("load", 1, 1, 0, (1, 2), seq_id=0),
                                TierOrder("load", 0, 0, 1, (3, 2, 1), seq_id=0))
    (work,) = plan.seqs
    assert (work.token_ids, work.start_pos, work.slots) == ((103,), 6,
                                                            (0, 3, 2, 1, 1, 2, 3))
    assert work.segments == ((0, 0), (1, 4)) and b.recomputed == 0
    assert s.caches[1].match([30, 31, 32, 33]) == [0] and [a.num_free() for a in s.allocs] == [0, 0]
    b.output.append(104)
    s.finish(b, "length")
    assert s.schedule().tier_orders == (TierOrder("drop", 0, 0), TierOrder("drop", 1, 1))
    assert tiers.sessions == {} and (b.parked, b.parts) == (None, ())


def test_a_split_sequence_whose_later_part_is_gone_loads_its_first_part_exact():
    """As above, but worker 1's tier lost b's part (its worker replaced): b loads
    positions 1-3 on worker 0 and computes 4-6 on worker 1, split as before."""
    s, tiers, b = _split_b_preempted_and_c_done()
    tiers.lost_worker(1)
    plan = s.schedule()
    assert plan.tier_orders == (TierOrder("load", 0, 0, 1, (3, 2, 1), seq_id=0),)
    (work,) = plan.seqs
    assert (work.token_ids, work.start_pos, work.slots) == ((101, 102, 103), 4,
                                                            (0, 3, 2, 1, 1, 2, 3))
    assert work.segments == ((0, 0), (1, 4)) and b.recomputed == 2
    b.output.append(104)
    s.finish(b, "length")
    assert s.schedule().tier_orders == (TierOrder("drop", 0, 0),)
    assert tiers.sessions == {}


def test_a_first_worker_without_room_for_its_part_computes_the_gap_then_loads_exact():
    """Workers of 4 and 8 slots ("priority", swap). z (5 tokens, priority 0) fills
    worker 1; b (3 tokens, priority 1) grows from worker 0 onto worker 1, where z's
    growth then preempts it: its parts (positions 0-3 on worker 0, 4 on worker 1) go
    to their workers' tiers. z spills onto worker 0, evicting b's cached positions 3
    and 2, and finishes; y (priority 0) takes worker 0's free slots before b comes
    back. Worker 0 holds b's positions 0-1 and has no room for 2-3: b computes them
    on worker 1 (no draw), then, the next step, loads position 4 there from its tier
    and feeds its last token (the executor's table grows from position 4): 2
    positions computed again of 5."""
    tiers = SessionIndex(TierConfig(host_bytes=100), bytes_per_token=1)
    s = Scheduler(SchedulerConfig(4, 100, split_kv=True, policy="priority"),
                  [KVAllocator(KVAllocatorConfig(4)), KVAllocator(KVAllocatorConfig(8))],
                  prefix_caching=True, sessions=tiers, swap=True)
    z, b = Sequence(0, [9] * 5, P, priority=0), Sequence(1, [20, 21, 22], P, priority=1)
    s.add(z)
    s.add(b)
    for zt, bt in ((100, 101), (102, 103), (104, 105)):
        s.schedule()
        z.output.append(zt)
        b.output.append(bt)
    assert (z.segments, b.segments) == ([(1, 0)], [(0, 0), (1, 4)])
    plan = s.schedule()  # z's next slot: b, the lowest on worker 1, is preempted
    assert plan.tier_orders == (TierOrder("save", 0, 0, 0, (0, 1, 2, 3)),
                                TierOrder("save", 1, 1, 0, (7,)))
    assert (b.status, b.parts) == ("waiting", (Part(0, 0, 4), Part(1, 4, 5)))
    z.output.append(106)
    for t, slot in ((107, 3), (108, 2)):  # onto worker 0, b's cache from its end
        assert s.schedule().seqs[0].slots == (slot,)
        z.output.append(t)
    s.finish(z, "length")
    y = Sequence(2, [50, 51], P, priority=0)
    s.add(y)
    plan = s.schedule()
    assert [(w.seq_id, w.slots) for w in plan.seqs[:1]] == [(2, (3, 2))]
    gap = plan.seqs[1]
    assert (gap.seq_id, gap.token_ids, gap.start_pos, gap.slots, gap.sample,
            gap.segments) == (1, (22, 101), 2, (0, 1, 4, 5), False, ((0, 0), (1, 2)))
    assert plan.tier_orders == () and b.recomputed == 2
    assert b.skip == Skip(4, 5, (("#preempted:1@4", (6,)),))
    y.output.append(110)
    plan = s.schedule()
    last = plan.seqs[1]
    assert (last.seq_id, last.token_ids, last.start_pos, last.slots_from, last.slots,
            last.sample) == (1, (105,), 5, 4, (6, 7), True)
    assert plan.tier_orders == (TierOrder("load", 1, 1, 0, (6,), seq_id=1),)
    assert b.skip is None and s.allocs[1].slots(1) == [4, 5, 6, 7]
    b.output.append(111)
    y.output.append(112)
    s.finish(b, "length")
    assert s.schedule().tier_orders == (TierOrder("drop", 0, 0), TierOrder("drop", 1, 1))


def test_a_cached_prefix_no_worker_can_finish_is_reused_and_the_rest_split_exact():
    """Three workers of 6 slots: x's prompt (5 tokens) is cached on worker 0, y's (4)
    on worker 1, z runs on worker 2. A 12-token prompt starting with x's takes its
    cached slots and worker 0's last free slot (positions 0-5); the rest goes to the
    other workers' free slots, the most free first (worker 2's three, worker 1's two),
    and only then to a slot y's cached prefix held (the end of that prefix): worker 2
    holds positions 6-8, worker 1 9-11. Only positions 5-11 are computed (not all 12,
    split, with every cache emptied)."""
    s = Scheduler(SchedulerConfig(4, 100, split_kv=True),
                  [KVAllocator(KVAllocatorConfig(6)) for _ in range(3)], prefix_caching=True)
    x, y, z = Sequence(0, [1, 2, 3, 4, 5], P), Sequence(1, [9, 9, 9, 9], P), Sequence(2, [7, 7], P)
    for seq in (x, y, z):
        s.add(seq)
    assert [(w.worker, w.slots) for w in s.schedule().seqs] == [
        (0, (0, 1, 2, 3, 4)), (1, (0, 1, 2, 3)), (2, (0, 1))]
    for seq in (x, y):
        seq.output.append(50)
        s.finish(seq, "length")
    z.output.append(70)
    q = Sequence(3, list(range(1, 13)), P)
    s.add(q)
    work = s.schedule().seqs
    assert work[1] == SeqWork(3, (6, 7, 8, 9, 10, 11, 12), 5,
                              (0, 1, 2, 3, 4, 5, 3, 4, 5, 3, 4, 5), params=P,
                              segments=((0, 0), (2, 6), (1, 9)))
    assert [a.num_free() for a in s.allocs] == [0, 0, 0]
    assert s.caches[1].match([9, 9, 9, 9]) == [0, 1, 2] and s.caches[0].evictable() == 0


def test_a_fresh_prompt_goes_whole_where_it_fits_rather_than_split_for_a_prefix():
    """Two workers of 10 slots: x's prompt (5 tokens) cached on worker 0, which has 2
    free slots beside it; y's (6) cached on worker 1. An 8-token prompt starting with
    x's would have to split to reuse it; worker 1 holds it whole (evicting y's prefix
    from its end), so it goes there and computes its 8 positions. (A readmission's own
    KV is reused split: the test above.)"""
    s = Scheduler(SchedulerConfig(4, 100, split_kv=True),
                  [KVAllocator(KVAllocatorConfig(10)) for _ in range(2)], prefix_caching=True)
    x, y = Sequence(0, [1, 2, 3, 4, 5], P), Sequence(1, [9] * 6, P)
    for seq in (x, y):
        s.add(seq)
    s.schedule()
    for seq in (x, y):
        seq.output.append(50)
        s.finish(seq, "length")
    s.allocs[0].allocate("held", 3)
    q = Sequence(2, list(range(1, 9)), P)
    s.add(q)
    assert s.schedule().seqs == (SeqWork(2, tuple(range(1, 9)), 0, (2, 3, 4, 5, 6, 7, 8, 9),
                                         params=P, worker=1),)
    assert q.segments == [(1, 0)] and s.caches[1].match([9] * 6) == [0, 1]


def test_reset_after_a_cut_starts_again_from_the_sequences_alone():
    """A step cut part-way (`LLMEngine.step`) may leave a sequence half admitted (out of
    the queue, slots taken, not running) and tables half sent: `reset` empties the
    allocator and the prefix cache and queues every unfinished sequence, those that ran
    first; the next plan is a fresh scheduler's, slot for slot."""
    allocs = [KVAllocator(KVAllocatorConfig(16))]
    s = Scheduler(SchedulerConfig(4, 100), allocs, prefix_caching=True)
    a, b = Sequence(0, [10, 11, 12], P), Sequence(1, [20, 21], SamplingParams(n=2))
    kid, c, gone = Sequence(2, [20, 21], P), Sequence(3, [30], P), Sequence(4, [40, 41], P)
    b.forks = [kid]
    for q in (gone, a):
        s.add(q)
    s.schedule()
    gone.output.append(42)
    s.finish(gone, "length")  # its prompt cached: slots 0 1 held by the tree
    a.output.append(13)
    s.add(b)
    s.add(c)
    s.waiting.remove(b)  # b cut half admitted: its slots taken, in neither queue
    allocs[0].allocate(b.seq_id, 2)
    b.status = "running"
    assert allocs[0].num_free() == 16 - 2 - 3 - 2 and s.caches[0].size == 2
    assert s.reset([a, b, kid, c, gone]) == 2
    assert allocs[0].free_list() == list(range(16)) and allocs[0].requests() == []
    assert s.caches[0].size == 0 and s.running == []
    assert list(s.waiting) == [a, b, c]  # kid rides with b, gone is finished
    assert [(q.status, q.segments, q.sent, q.num_preemptions) for q in (a, b, c)] == [
        ("waiting", [], 0, 1), ("waiting", [], 0, 0), ("waiting", [], 0, 0)]
    plan = s.schedule()
    pb = SamplingParams(n=2)
    assert plan.seqs == (SeqWork(0, (10, 11, 12, 13), 0, (0, 1, 2, 3), params=P),
                         SeqWork(1, (20, 21), 0, (4, 5), params=pb, seeds=(0, 0)),
                         SeqWork(3, (30,), 0, (6,), params=P))
