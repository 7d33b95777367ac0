"""Step plans carry slot-table diffs: a decode plan is O(batch), not O(batch x context),
and the compute side's `SlotTables` rebuild every sequence's whole table exactly
(checked against the allocators' own tables) through preemption, KV split over
workers, forks (n > 1), finishes and a re-applied plan."""
import random
from dataclasses import replace

import msgspec
import pytest
import torch

from lamina.compute.compute_side import SlotTables
from lamina.compute.packing import pack
from lamina.dataplane.tables import HeldTables, SentTables, TableError
from lamina.engine.messages import DroppedKeys, SeqWork, StepPlan
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
    """seq's table as far as it was fed (a prompt fed in chunks has later slots too)."""
    fed = seq.num_tokens - seq.pending
    return [x for w in seq.workers for x in s.allocs[w].slots(seq.seq_id)][:fed]


def _held_ranges(s: Scheduler, seq: Sequence, w: int) -> dict[int, list[int]]:
    """seq's KV ranges on worker w, as far as they were fed, less their holes."""
    fed = seq.num_tokens - seq.pending
    return {a: [x for x in s.allocs[w].slots(seq.seq_id)[:fed - a] if x >= 0]
            for ww, a in seq.segments if ww == w and a < fed}


def _random_run(seed: int, drops: bool = False):
    """Random prompts, n = 1 or 2, small pools on 2 workers (KV split, preemption and
    prompts fed in chunks happen), random finishes: yields (scheduler, plan, live
    sequences by id) per step; the step's tokens are drawn after each yield. `drops`:
    after each step, random keys of the decoding sequences are reported dropped for good
    (as h2o's memory workers would), given back 2 or more at a time."""
    rng = random.Random(seed)
    allocs = [KVAllocator(KVAllocatorConfig(40)) for _ in range(2)]
    s = Scheduler(SchedulerConfig(6, 64, True, evict_chunk=2), allocs,
                  drops=(lambda seq: True) if drops else None)
    live = {}
    for i in range(14):
        n = 2 if i % 5 == 0 else 1
        seq = Sequence(i, [rng.randrange(5, 90) for _ in range(rng.randrange(2, 30))],
                       SamplingParams(max_tokens=rng.randrange(3, 25), n=n))
        seq.forks = [Sequence(100 + i, list(seq.prompt), seq.params)] if n == 2 else []
        s.add(seq)
        live[i] = seq
    for _ in range(400):
        if not s.has_work():
            break
        plan = s.schedule()
        yield s, plan, live
        if drops and plan.report_dropped:
            s.note_dropped(_report(rng, s, plan))
        for w in plan.seqs:
            seq = live[w.seq_id]
            if seq.status != "running" or not w.sample:
                continue
            seq.output.append(rng.randrange(5, 90))
            for kid in s.fork(seq) if seq.forks else []:
                live[kid.seq_id] = kid
                kid.output.append(rng.randrange(5, 90))
            for q in [seq, *[k for k in live.values() if k.seq_id == 100 + seq.seq_id]]:
                if q.status == "running" and len(q.output) >= q.params.max_tokens:
                    s.finish(q, "length")
    assert not s.has_work()


def _report(rng, s: Scheduler, plan: StepPlan) -> list[DroppedKeys]:
    """Random keys of the plan's one-worker decoding sequences, none of their last 3,
    none reported before: what a memory worker's h2o could report."""
    out = []
    for w in plan.seqs:
        seq = next((q for q in s.running if q.seq_id == w.seq_id), None)
        if seq is None or len(seq.segments) != 1 or len(w.token_ids) != 1:
            continue
        table = s.allocs[seq.worker].slots(seq.seq_id)[:-3]
        cand = [x for x in table if x >= 0 and x not in seq.pending_drop]
        out.append(DroppedKeys(seq.seq_id, seq.worker, tuple(rng.sample(cand, min(
            len(cand), rng.randrange(0, 3))))))
    return out


@pytest.mark.parametrize("seed,drops", [(0, False), (1, False), (2, False), (0, True)])
def test_slot_tables_rebuild_every_whole_table_exactly(seed, drops):
    """Each plan of a random run goes through SlotTables (every other one twice, as a
    step re-run after a clean fault): each sequence's rebuilt table equals the
    allocators' table (holes included, with `drops`), and the tables of gone sequences
    are dropped."""
    tables, seen = SlotTables(), {"split": 0, "preempted": 0, "diffs": 0, "chunks": 0}
    for step, (s, plan, live) in enumerate(_random_run(seed, drops)):
        tables.apply(plan)
        if step % 2:
            tables.apply(plan)  # idempotent
        seen["diffs"] += sum(w.slots_from > 0 for w in plan.seqs)
        for w in plan.seqs:
            seq = live[w.seq_id]
            assert tables.table(w.seq_id).tolist() == _whole_table(s, seq)
            seen["split"] += len(seq.segments) > 1
            seen["chunks"] += not w.sample
        seen["preempted"] = sum(q.num_preemptions for q in live.values())
    assert seen["split"] and seen["preempted"] and seen["diffs"] and seen["chunks"], seen
    tables.apply(StepPlan(10**6, (), released=tuple(s._released)))
    assert len(tables) == 0  # every finished sequence's table was dropped


@pytest.mark.parametrize("seed,drops", [(0, False), (1, False), (2, False), (0, True),
                                        (1, True)])
def test_memory_ends_hold_the_allocators_tables(seed, drops):
    """The data plane's held tables (`lamina.dataplane.tables`), both ends of two
    connections, through a random run (KV split, preemption, forks, finishes; with
    `drops`, keys given back at random too): every part's slots the memory end rebuilds
    equal the part's own, each held range equals the allocator's table of that sequence
    on that worker less its holes, most steps send only new slots, and a replaced
    connection (both ends new) starts over whole."""
    sent, held = [SentTables(), SentTables()], [HeldTables(), HeldTables()]
    tables, stats = SlotTables(), {"sent": 0, "whole": 0, "replaced": 0, "holes": 0}
    for step, (s, plan, live) in enumerate(_random_run(seed, drops)):
        if step % 37 == 36:  # worker 1's connection replaced
            sent[1], held[1] = SentTables(), HeldTables()
            stats["replaced"] += 1
        for end in sent:
            end.release(plan.released)
        tables.apply(plan)
        packed = pack(plan, 2, tables=tables)
        for w, part in enumerate(packed.parts):
            if not part.active:
                continue
            b = part.batch
            held[w].release(sent[w].take_released())
            keep, tail = sent[w].diff(part.seq_ids, b.slots, b.cu_k, b.k_pos0,
                                      part.unchanged)
            slots = held[w].apply(part.seq_ids, keep, tail, b.cu_k, b.k_pos0)
            assert slots.tolist() == b.slots.tolist()
            stats["sent"] += tail.numel()
            stats["whole"] += b.slots.numel()
            for sid in part.seq_ids:
                seq = live[sid]
                got = held[w].slots(sid)
                assert {a: x for a, x in got.items()} == _held_ranges(s, seq, w)
                stats["holes"] += s.allocs[w].slots(sid).count(-1)
    # (keys given back every few steps, anywhere: the tables are re-sent from the hole)
    assert stats["replaced"] and stats["sent"] < stats["whole"] / (2 if drops else 3), stats
    assert bool(stats["holes"]) == drops, stats
    for w in range(2):  # the finished sequences' tables go with the next metadata
        sent[w].release(s._released)
        held[w].release(sent[w].take_released())
        assert len(held[w]) == 0 and not sent[w].sent


def test_decode_metadata_does_not_grow_with_the_context():
    """After a sequence's first step, a decode step sends one slot per sequence and the
    memory end keeps the other L."""
    B = 8
    for L in (128, 8192):
        plan = _decode_plan(B, L)
        tables, end, mem = SlotTables(), SentTables(), HeldTables()
        whole = replace(plan, seqs=tuple(
            replace(w, slots=tuple(range(i * (L + 4), i * (L + 4) + L + 1)), slots_from=0)
            for i, w in enumerate(plan.seqs)))
        tables.apply(whole)
        first = pack(whole, 1, tables=tables).parts[0]  # everything sent whole once
        k, t = end.diff(first.seq_ids, first.batch.slots, first.batch.cu_k,
                        first.batch.k_pos0, first.unchanged)
        mem.apply(first.seq_ids, k, t, first.batch.cu_k, first.batch.k_pos0)
        assert t.numel() == B * (L + 1) and not k.any()
        tables.apply(plan)  # the same step as a diff: its last slot again
        nxt = pack(plan, 1, tables=tables).parts[0]
        k, t = end.diff(nxt.seq_ids, nxt.batch.slots, nxt.batch.cu_k, nxt.batch.k_pos0,
                        nxt.unchanged)
        assert k.tolist() == [L] * B and t.numel() == B
        assert mem.apply(nxt.seq_ids, k, t, nxt.batch.cu_k,
                         nxt.batch.k_pos0).tolist() == nxt.batch.slots.tolist()


def test_a_keep_the_memory_end_cannot_honour_changes_nothing():
    mem = HeldTables()
    cu, k0 = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    assert mem.apply([7], i32([0]), i32([4, 5, 6]), cu, k0).tolist() == [4, 5, 6]
    cu4 = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(TableError, match=r"seq 7, KV from position 0\) keeps 4 slots, but "
                                         r"this end holds 3 \(the ends are out of step\)"):
        mem.apply([7], i32([4]), i32([]), cu4, k0)
    with pytest.raises(TableError, match="keeps 1 slots, but this end holds 0"):
        mem.apply([8], i32([1]), i32([1, 2, 3]), torch.tensor([0, 4], dtype=torch.int32), k0)
    with pytest.raises(TableError, match="tail of 2 slots, expected 1"):
        mem.apply([7], i32([3]), i32([1, 2]), cu4, k0)
    assert mem.slots(7) == {0: [4, 5, 6]} and mem.slots(8) == {}  # nothing changed
    assert mem.apply([7], i32([2]), i32([9, 8]), cu4, k0).tolist() == [4, 5, 9, 8]


def test_a_diff_for_a_table_the_compute_side_lacks_is_a_clear_error():
    with pytest.raises(RuntimeError, match="seq 5: the plan sends its KV slots from "
                                           "position 3, but the compute side holds none"):
        SlotTables().apply(StepPlan(0, (SeqWork(5, (1,), 3, (9,), slots_from=3),)))
    with pytest.raises(ValueError, match="1 slots from position 2 for positions 0..3"):
        SeqWork(5, (1,), 3, (9,), slots_from=2)
