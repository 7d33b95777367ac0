"""Scheduler: exact plans, slot ids, admission order, preemption and recompute."""
import pytest

from lamina.kv_allocator import KVAllocator, KVAllocatorConfig
from lamina.messages import SeqWork
from lamina.sampling import SamplingParams
from lamina.scheduler import Scheduler, SchedulerConfig, Sequence

P = SamplingParams(max_tokens=8)


def make(num_slots=8, max_batch=4, budget=100):
    return Scheduler(SchedulerConfig(max_batch, budget), KVAllocator(KVAllocatorConfig(num_slots)))


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
    plan = s.schedule()
    assert plan.seqs == (SeqWork(0, (13,), 3, (0, 1, 2, 7), params=P),)
    assert b.status == "waiting" and b.num_preemptions == 1 and list(s.waiting) == [b]
    assert s.alloc.free_list() == [3, 4, 5, 6]  # b's slots back, first position first
    a.output.append(14)
    s.finish(a, "length")
    # b comes back and recomputes prompt + its generated token.
    plan = s.schedule()
    assert plan.seqs == (SeqWork(1, (20, 21, 22, 23, 24), 0, (0, 1, 2, 7, 3), params=P),)  # LIFO reuse


def test_fifo_no_overtaking_and_batch_and_budget_limits():
    s = make(num_slots=100, max_batch=2, budget=10)
    seqs = [Sequence(i, [1] * n, P) for i, n in enumerate([4, 8, 2, 1])]
    for q in seqs:
        s.add(q)
    plan = s.schedule()
    assert [w.seq_id for w in plan.seqs] == [0]  # seq 1 (8) exceeds the 6 left; 2 waits behind it
    for q in s.running:
        q.output.append(5)
    plan = s.schedule()
    assert [w.seq_id for w in plan.seqs] == [0, 1]  # decode 0, admit 1 (1 + 8 <= 10)
    for q in s.running:
        q.output.append(5)
    plan = s.schedule()
    assert [w.seq_id for w in plan.seqs] == [0, 1]  # batch full (2)


def test_unschedulable_sequence_is_reported_not_dropped():
    s = make(num_slots=8, budget=3)
    s.add(Sequence(0, [1] * 5, P))
    with pytest.raises(RuntimeError, match="cannot be scheduled"):
        s.schedule()
    assert len(s.waiting) == 1
    with pytest.raises(ValueError, match="needs 9 KV slots"):
        s.add(Sequence(1, [1] * 9, P))


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
    assert plan.seqs == (SeqWork(0, (10,), 3, (0, 1, 2, 3), params=P, seeds=(5,)),
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
    with pytest.raises(RuntimeError, match="cannot be scheduled"):
        s.schedule()  # 3 siblings never fit a batch of 2: reported, not dropped
    assert list(s.waiting) == [parent]
