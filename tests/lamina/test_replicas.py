"""Compute replicas with the fixed schedule (`num_compute_workers`, pipeline "fixed",
local executor; two replicas over two memory sides, three over one): greedy tokens
equal HF's on the 16 mixed-length prompts (8 of them over three), each sequence stays
on one replica, the replicas run at once while a memory side serves one at a time (from
the trace), and bad configurations are refused by name."""
from dataclasses import replace

import pytest

from lamina import SamplingParams
from lamina.engine.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.engine.messages import SeqWork, StepPlan, StepResult
from lamina.errors import SequenceFault
from lamina.executor.local import LocalExecutor
from lamina.executor.replicas import ReplicaSplit
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.trace import lanes, overlapping
from tests.conftest import SHORT_NEW


def traced_fixed_run(eng, ex, prompts, params):
    """The prompts to the end, 3 decode steps after the prefill traced; checks that
    each sequence stays on its replica. -> (token ids in prompt order, {sequence: its
    replica}, the spans)."""
    ids = [eng.add_request(p, params) for p in prompts]
    done, homes = {}, {}
    eng.step()  # the prompts
    ex.start_trace()
    for _ in range(3):
        done.update((o.request_id, o) for o in eng.step() if o.finished)
        for sid, r in ex.replica_split.home.items():
            assert homes.setdefault(sid, r) == r  # a sequence stays on its replica
    spans = ex.stop_trace()
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    return [done[i].token_ids for i in ids], homes, spans


@pytest.mark.parametrize("replicas,memory", [(2, 2), (3, 1)])
def test_fixed_replicas_greedy_identical_to_hf(smol, smol_packed, prompts, hf_greedy,
                                              replicas, memory):
    """Two replicas over two memory sides (the 16 prompts), and three over one (which
    then serves three replicas, one at a time; 8 of the prompts, 5 to 450 tokens): HF's
    first SHORT_NEW tokens."""
    pick = list(range(16)) if replicas == 2 else [0, 1, 3, 5, 7, 9, 12, 14]
    pools = [KVPool(KVPoolConfig.for_specs(smol_packed.attention_specs, 8192))
             for _ in range(memory)]
    ex = LocalExecutor(smol_packed, [MemorySide(p) for p in pools],
                       num_compute_workers=replicas)
    eng = LLMEngine(EngineConfig(num_kv_slots=8192, num_memory_workers=memory,
                                 pipeline="fixed", num_compute_workers=replicas),
                    ex, smol.tokenizer, smol.config)
    greedy = SamplingParams(max_tokens=SHORT_NEW, temperature=0.0, ignore_eos=True)
    tokens, homes, spans = traced_fixed_run(eng, ex, [prompts[i] for i in pick], greedy)
    assert tokens == [hf_greedy[i][:SHORT_NEW] for i in pick]
    # balanced at admission: each in turn to the least loaded (ties: the lowest)
    assert sorted(homes.values()) == sorted(i % replicas for i in range(len(pick)))
    assert lanes(spans) == ([f"compute{r}" for r in range(replicas)]
                            + [f"memory{w}" for w in range(memory)])
    assert overlapping(spans) == []  # a memory side serves one replica at a time
    slices = {r: [(s.t0, s.t1) for s in spans if s.lane == f"compute{r}" and s.kind == "slice"]
              for r in (0, 1)}
    # the replicas ran at once: some slice of one overlaps some slice of the other
    assert any(a0 < b1 and b0 < a1 for a0, a1 in slices[0] for b0, b1 in slices[1])
    ex.execute(StepPlan(10 ** 6, (), released=tuple(eng.scheduler._released)))
    # the next plan releases every finished sequence from its replica
    assert not ex.replica_split.home and all(len(c.tables) == 0 for c in ex.replicas)


@pytest.mark.parametrize("kw,msg", [
    (dict(num_compute_workers=2), "2 compute workers need a pipeline"),
    (dict(pipeline="fixed"), "pipeline 'fixed' runs num_compute_workers >= 2"),
    (dict(num_compute_workers=0, pipeline="fixed"), "num_compute_workers must be an int >= 1"),
    (dict(pipeline="rotational", num_batches=4), "rotational runs n batches over n - 1 "
     "replicas: num_batches=4 does not fit num_compute_workers=1 .it needs num_batches=2."),
    (dict(pipeline="fixed", num_compute_workers=2, num_batches=3),
     "fixed runs one batch per replica"),
    (dict(num_batches=2), "no pipeline runs 1 batch"),
    (dict(pipeline="auto", num_compute_workers=2), "'auto' chooses between none and rotational"),
    (dict(pipeline="rotational", num_batches=0), "num_batches must be an int >= 1 or None"),
])
def test_bad_replica_configs_refused_by_name(kw, msg):
    with pytest.raises(ValueError, match=msg):
        EngineConfig(**kw)


def test_num_batches_is_derived_from_the_replicas():
    assert EngineConfig().batches == 1
    assert EngineConfig(pipeline="rotational").batches == 2
    assert EngineConfig(pipeline="rotational", num_compute_workers=3).batches == 4
    assert EngineConfig(pipeline="fixed", num_compute_workers=3).batches == 3
    # the pipeline replaced: the batches follow (nothing derived is kept)
    assert replace(EngineConfig(), pipeline="rotational").batches == 2


def _work(*sids):
    return tuple(SeqWork(s, (s,), 0, (s,)) for s in sids)


def _echo(r, sub):
    """A replica that draws its replica index for every sequence."""
    return StepResult(sub.step, tuple(s.seq_id for s in sub.seqs),
                      tuple((r,) for _ in sub.seqs), {"dense": 0.1 * (r + 1)})


def test_replica_split_places_by_load_and_keeps_homes():
    split = ReplicaSplit(3)
    subs = split.split(StepPlan(0, _work(10, 11, 12, 13)))
    assert [[s.seq_id for s in p.seqs] for p in subs] == [[10, 13], [11], [12]]
    # 10 and 11 leave: 14 goes to the emptiest (replica 1), 15 to the lowest of a tie
    subs = split.split(StepPlan(1, _work(12, 13, 14, 15), released=(10, 11)))
    assert split.home == {12: 2, 13: 0, 14: 1, 15: 0}
    assert [[s.seq_id for s in p.seqs] for p in subs] == [[13, 15], [14], [12]]
    assert all(p.released == (10, 11) for p in subs)  # every replica drops them
    out = split.run(StepPlan(2, _work(15, 12, 13)), _echo)
    assert out.seq_ids == (15, 12, 13) and out.token_ids == ((0,), (2,), (0,))
    assert out.timings == {"dense": pytest.approx(0.3)}  # the slowest replica's
    split.shutdown()


def test_replica_split_rerun_after_a_clean_fault_reuses_the_others():
    """Replica 1 refuses sequence 11 cleanly; the engine reruns the step without it:
    replica 0's part is not run twice (its KV is written, its samplers advanced)."""
    split, calls = ReplicaSplit(2), []

    def run(r, sub):
        calls.append((r, sub.step, tuple(s.seq_id for s in sub.seqs)))
        if any(s.seq_id == 11 for s in sub.seqs):
            raise SequenceFault([11], "bad sequence 11")
        return _echo(r, sub)

    with pytest.raises(SequenceFault, match="compute replica 1: bad sequence 11") as e:
        split.run(StepPlan(5, _work(10, 11, 12, 13)), run)
    assert e.value.seq_ids == (11,) and e.value.clean
    out = split.run(StepPlan(5, _work(10, 12, 13)), run)
    assert out.seq_ids == (10, 12, 13) and out.token_ids == ((0,), (0,), (1,))
    assert sorted(calls) == [(0, 5, (10, 12)), (1, 5, (11, 13)), (1, 5, (13,))]
    # a hard error keeps nothing: every replica runs the next step afresh
    calls.clear()

    def broken(r, sub):
        calls.append(r)
        if r == 1:
            raise ConnectionError("replica 1 hung up")
        return _echo(r, sub)

    with pytest.raises(ConnectionError, match="replica 1 hung up"):
        split.run(StepPlan(6, _work(10, 12, 13)), broken)
    split.run(StepPlan(6, _work(10, 12, 13)), _echo)
    assert sorted(calls) == [0, 1] and split._kept == {}
    split.shutdown()


@pytest.mark.parametrize("bad", [0, 1, "x"])
def test_replica_split_needs_two_replicas(bad):
    with pytest.raises(ValueError, match="ReplicaSplit needs >= 2 replicas"):
        ReplicaSplit(bad)
