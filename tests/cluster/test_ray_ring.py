"""Rotational staggered pipelining over compute worker processes on Ray (paper 5.1):
n batches over R = n - 1 compute workers in a ring (`lamina.compute.ring`), each
micro-batch's context migrating to the next worker over the data plane and the memory
workers sending each layer's output to the worker that runs the next slice. Greedy
tokens equal HF's on the 16 mixed-length prompts at n = 3 (2 memory workers) and n = 4
(1 memory worker); from one decode step's trace, slice k of micro-batch j ran on
compute worker (j + k) mod R and its context came from the worker of slice k - 1; a
request poisoning a compute worker, and one poisoning a memory worker mid-ring, each
fail alone; a killed compute worker is replaced and the requests end with HF's tokens."""
import pytest
import ray

from lamina import LLM, SamplingParams
from lamina.faults import FaultPlan
from lamina.trace import lanes, overlapping
from tests.conftest import HF_NEW

from ..lamina.test_isolation import unused_token

GREEDY = SamplingParams(max_tokens=HF_NEW, temperature=0, ignore_eos=True)
NEW = 12
GOOD = SamplingParams(max_tokens=NEW, temperature=0)
MEM_POS = 700  # a decode query of the 695-token poison prompt; no good request gets there


def traced_ring_run(llm, prompts):
    """The prompts to the end, one all-decode step traced. -> (tokens in prompt order,
    that step's spans)."""
    eng, ex = llm.engine, llm.executor
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    done = {}
    while any(not s.output for s in eng.scheduler.running) or eng.scheduler.waiting:
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    ex.start_trace()
    step = eng.scheduler.step
    done.update((o.request_id, o) for o in eng.step() if o.finished)
    spans = [s for s in ex.stop_trace() if s.step == step]
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    return [done[i].token_ids for i in ids], spans


def check_rule(spans, r_n: int, n: int, layers: int, hidden: int, workers: int):
    """The paper's rotation, read off the trace of one decode step of 16 sequences."""
    work = [s for s in spans if s.kind != "send"]  # output senders: a thread a connection
    assert lanes(work) == [*(f"compute{r}" for r in range(r_n)),
                           *(f"memory{w}" for w in range(workers))]
    assert overlapping(work) == []
    slices = {(s.layer, s.mb): s for s in spans if s.kind == "slice"}
    assert sorted(slices) == [(k, j) for k in range(layers + 1) for j in range(n)]
    for (k, j), s in slices.items():
        assert s.lane == f"compute{(j + k) % r_n}"
    migrated = {(s.layer, s.mb): s for s in spans if s.kind == "migrate"}
    assert sorted(migrated) == [(k, j) for k in range(1, layers + 1) for j in range(n)]
    for (k, j), s in migrated.items():
        assert s.lane == f"compute{(j + k) % r_n}" and s.peer == f"compute{(j + k - 1) % r_n}"
    for k in range(1, layers + 1):  # the residual stream of the 16 rows, once a layer
        assert sum(migrated[k, j].nbytes for j in range(n)) == 16 * hidden * 4
    attends = [(s.lane, s.layer, s.mb) for s in spans if s.kind == "attend"]
    assert len(attends) == len(set(attends))  # each (layer, micro-batch) attended once
    assert {(a[1], a[2]) for a in attends} == {(k, j) for k in range(layers) for j in range(n)}


@pytest.fixture(scope="module")
def setup(prompts, hf_greedy):
    tok = unused_token(prompts, hf_greedy)
    llm = LLM(executor="ray", num_memory_workers=2, num_kv_slots=4096, max_step_tokens=2048,
              num_compute_workers=2, pipeline="rotational",
              faults=FaultPlan(compute_token=tok, memory_pos=MEM_POS))
    yield llm, tok
    llm.shutdown()
    ray.shutdown()


def test_ring_of_three_replicas_over_one_memory_worker_identical(smol, prompts, hf_greedy):
    """n = 4: three compute workers in a ring, one memory worker serving all three
    (first in this file: the other tests' deployment would hold the cores it needs)."""
    llm = LLM(executor="ray", num_memory_workers=1, num_kv_slots=8192, max_step_tokens=2048,
              num_compute_workers=3, pipeline="rotational")
    try:
        assert llm.executor.ring and llm.engine.config.batches == 4
        tokens, spans = traced_ring_run(llm, prompts)
        assert tokens == hf_greedy
        check_rule(spans, 3, 4, len(llm.executor.params), smol.config.hidden_size, 1)
    finally:
        llm.shutdown()


def test_ring_of_two_replicas_greedy_identical_to_hf(setup, smol, prompts, hf_greedy):
    llm, _ = setup
    ex, eng = llm.executor, llm.engine
    assert ex.ring and ex.replica_split is None and len(ex.computes) == 2
    tokens, spans = traced_ring_run(llm, prompts)
    assert tokens == hf_greedy
    check_rule(spans, 2, 3, len(ex.params), smol.config.hidden_size, 2)
    assert all(h["error"] is None for h in ray.get([w.health.remote() for w in ex.memory]))
    assert eng.free_slots() == [a.config.num_slots for a in eng.allocs]


def drain(eng, outs):
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step() if o.finished})


def test_compute_and_memory_faults_in_a_ring_fail_alone(setup, prompts, hf_greedy):
    """The compute fault: every compute worker refuses the request before anything is
    sent (a clean fault, the same on each), nothing is replaced. The memory fault: a
    memory worker fails mid-step on one replica's connection; that replica fails, the
    other is interrupted, the worker blames the request, the workers are replaced and
    the other requests recomputed."""
    llm, tok = setup
    eng = llm.engine
    ids = [eng.add_request(p, GOOD) for p in prompts[:8]]
    outs = {}
    for _ in range(2):
        outs.update({o.request_id: o for o in eng.step()})
    recovered = eng.num_recoveries
    bad_c = eng.add_request([7, tok, 8], GOOD)
    bad_m = eng.add_request((prompts[8] * 2)[:MEM_POS - 5], GOOD)
    ids += [eng.add_request(p, GOOD) for p in prompts[8:]]
    drain(eng, outs)
    assert [outs[i].token_ids for i in ids] == [r[:NEW] for r in hf_greedy]
    assert all(outs[i].error is None for i in ids)
    assert outs[bad_c].finish_reason == "error"
    assert f"injected compute fault on token {tok}" in outs[bad_c].error
    assert outs[bad_m].finish_reason == "error"
    assert f"injected memory fault at position {MEM_POS}" in outs[bad_m].error
    assert eng.num_recoveries == recovered + 1  # only the memory fault replaced workers
    assert eng.free_slots() == [a.config.num_slots for a in eng.allocs]
    health = ray.get([w.health.remote() for w in llm.executor.memory])
    assert all(h["error"] is None for h in health)


def test_killed_ring_replica_replaced_and_requests_recomputed(setup, prompts, hf_greedy):
    """Compute worker 1 dies between steps: the next step fails on it, the other is
    interrupted rather than left waiting, the dead one alone is replaced, the ring is
    rewired, and the requests end with HF's tokens."""
    llm, _ = setup
    ex, eng = llm.executor, llm.engine
    before = eng.num_recoveries
    pick = [1, 4, 6, 11]
    ids = [eng.add_request(prompts[i], GREEDY) for i in pick]
    for _ in range(3):
        eng.step()
    old = [c._actor_id for c in ex.computes]
    ray.kill(ex.computes[1])
    outs = {}
    drain(eng, outs)
    assert [outs[i].token_ids for i in ids] == [hf_greedy[i] for i in pick]
    assert eng.num_recoveries == before + 1
    assert "compute worker 1" in eng.recoveries[-1]
    new = [c._actor_id for c in ex.computes]
    assert new[0] == old[0] and new[1] != old[1]
    assert eng.free_slots() == [a.config.num_slots for a in eng.allocs]


def test_a_ring_with_cuda_graphs_refused_by_name():
    """Graphs replay a slice on the replica that captured it; a ring moves every slice to
    the next replica. Refused before Ray starts (the config alone, no GPU needed)."""
    from lamina.cluster.executor import RayExecutor
    from lamina.engine.config import EngineConfig

    cfg = EngineConfig(num_compute_workers=2, pipeline="rotational", compute_device="cuda",
                       cuda_graphs=True)
    with pytest.raises(ValueError, match="pipeline 'rotational' over compute workers runs "
                                         "without CUDA graphs"):
        RayExecutor.check(cfg)
    RayExecutor.check(EngineConfig(num_compute_workers=2, pipeline="rotational"))  # allowed
