"""Step plans carry slot-table diffs: a decode plan is O(batch), not O(batch x context),
and the compute side's `SlotTables` rebuild every sequence's whole table exactly
(checked against the allocators' own tables) through preemption, KV split over
workers, forks (n > 1), finishes and a re-applied plan."""
import random

import msgspec
import pytest

from lamina.compute.compute_side import SlotTables
from lamina.engine.messages import SeqWork, StepPlan
from lamina.engine.scheduler import Scheduler, SchedulerConfig, Sequence
from lamina.memory.allocator import KVAllocator, KVAllocatorConfig
from lamina.sampling.params import SamplingParams


def _decode_plan(B: int, L: int) -> StepPlan:
    """The first decode step of B sequences with L-token prompts."""
    s = Scheduler(SchedulerConfig(B, B * L, True), KVAllocator(KVAllocatorConfig(B * (L + 4))))
    for i in range(B):
        s.add(Sequence(i, [7] * L, SamplingParams(max_tokens=4)))
    prefill = s.schedule()
    assert [len(w.slots) for w in prefill.seqs] == [L] * B  # the whole table, once
    for q in s.running:
        q.output.append(3)
    return s.schedule()


def test_a_decode_plan_does_not_grow_with_the_context():
    B = 8
    small, large = _decode_plan(B, 128), _decode_plan(B, 8192)
    for plan, L in ((small, 128), (large, 8192)):
        assert [(w.start_pos, w.slots_from, len(w.slots)) for w in plan.seqs] == [(L, L, 1)] * B
    enc = msgspec.msgpack.Encoder()
    n_small, n_large = len(enc.encode(small)), len(enc.encode(large))
    # only the integers' widths differ (a position or slot id < 2^7 takes 1 byte, < 2^16
    # 3 bytes): a few bytes a sequence, never the 8064 more slots each
    assert n_large - n_small <= 8 * B, (n_small, n_large)


def _whole_table(s: Scheduler, seq: Sequence) -> list[int]:
    return [x for w in seq.workers for x in s.allocs[w].slots(seq.seq_id)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_slot_tables_rebuild_every_whole_table_exactly(seed):
    """Random prompts, n = 1 or 2, small pools on 2 workers (KV split and preemption
    happen), random finishes; each plan goes through SlotTables (every other one twice,
    as a step re-run after a clean fault): each sequence's rebuilt table equals the
    allocators' table, and the tables of gone sequences are dropped."""
    rng = random.Random(seed)
    allocs = [KVAllocator(KVAllocatorConfig(40)) for _ in range(2)]
    s = Scheduler(SchedulerConfig(6, 64, True), allocs)
    tables, live, seen = SlotTables(), {}, {"split": 0, "preempted": 0, "diffs": 0}
    for i in range(14):
        n = 2 if i % 5 == 0 else 1
        seq = Sequence(i, [rng.randrange(5, 90) for _ in range(rng.randrange(2, 30))],
                       SamplingParams(max_tokens=rng.randrange(3, 25), n=n))
        seq.forks = [Sequence(100 + i, list(seq.prompt), seq.params)] if n == 2 else []
        s.add(seq)
        live[i] = seq
    for step in range(400):
        if not s.has_work():
            break
        plan = s.schedule()
        whole = tables.apply(plan)
        if step % 2:
            whole = tables.apply(plan)  # idempotent
        seen["diffs"] += sum(w.slots_from > 0 for w in plan.seqs)
        for w, full in zip(plan.seqs, whole.seqs):
            seq = live[w.seq_id]
            assert full.slots_from == 0 and list(full.slots) == _whole_table(s, seq)
            seen["split"] += len(seq.segments) > 1
        seen["preempted"] = sum(q.num_preemptions for q in live.values())
        for w in plan.seqs:
            seq = live[w.seq_id]
            if seq.status != "running":
                continue
            seq.output.append(rng.randrange(5, 90))
            for kid in s.fork(seq) if seq.forks else []:
                live[kid.seq_id] = kid
                kid.output.append(rng.randrange(5, 90))
            for q in [seq, *[k for k in live.values() if k.seq_id == 100 + seq.seq_id]]:
                if q.status == "running" and len(q.output) >= q.params.max_tokens:
                    s.finish(q, "length")
    assert not s.has_work()
    assert seen["split"] and seen["preempted"] and seen["diffs"], seen
    tables.apply(StepPlan(10**6, (), released=tuple(s._released)))
    assert len(tables) == 0  # every finished sequence's table was dropped


def test_a_diff_for_a_table_the_compute_side_lacks_is_a_clear_error():
    with pytest.raises(RuntimeError, match="seq 5: the plan sends its KV slots from "
                                           "position 3, but the compute side holds none"):
        SlotTables().apply(StepPlan(0, (SeqWork(5, (1,), 3, (9,), slots_from=3),)))
    with pytest.raises(ValueError, match="1 slots from position 2 for positions 0..3"):
        SeqWork(5, (1,), 3, (9,), slots_from=2)
