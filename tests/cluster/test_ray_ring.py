"""Rotational staggered pipelining over compute worker processes on Ray (paper 5.1):
n batches over R = n - 1 compute workers in a ring (`lamina.compute.ring`), each
micro-batch's context migrating to the next worker over the data plane and the memory
workers sending each layer's output to the worker that runs the next slice. Greedy
tokens equal HF's on the 16 mixed-length prompts at n = 3 (2 memory workers) and n = 4
(1 memory worker; 8 of the prompts, the first 8 tokens); from one decode step's trace,
slice k of micro-batch j ran on compute worker (j + k) mod R and its context came from
the worker of slice k - 1; a request poisoning a compute worker, and one poisoning a
memory worker mid-ring, each fail alone; sessions' later turns load their KV from the
memory workers' host tiers; a killed compute worker is replaced and the requests end
with HF's tokens."""
from dataclasses import replace

import pytest
import ray

from lamina import LLM, SamplingParams
from lamina.faults import FaultPlan
from tests.cluster import keep_ray_for_the_next_module
from tests.conftest import SHORT_NEW

from ..lamina.test_isolation import unused_token
from ..lamina.test_ring import check_ring
from ..lamina.test_rotational import traced_decode
from .test_ray_isolation import MEM_POS, faults_fail_alone
from .test_ray_replicas import HOST_BYTES, killed_replica_recovers, sessions_load_from_the_tiers

GREEDY = SamplingParams(max_tokens=SHORT_NEW, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(prompts, hf_greedy):
    tok = unused_token(prompts, hf_greedy)
    llm = LLM(executor="ray", num_memory_workers=2, num_kv_slots=4096, max_step_tokens=2048,
              num_compute_workers=2, pipeline="rotational",
              faults=FaultPlan(compute_token=tok, memory_pos=MEM_POS), kv_host_bytes=HOST_BYTES)
    yield llm, tok
    llm.shutdown()
    keep_ray_for_the_next_module()


def test_ring_of_three_replicas_over_one_memory_worker_identical(smol, prompts, hf_greedy):
    """n = 4: three compute workers in a ring, one memory worker serving all three
    (first in this file: the other tests' deployment would hold the cores it needs).
    HF's first 8 tokens of 8 prompts (5 to 450 tokens): four processes share two cores
    here, and the two-replica ring below runs all 16 prompts."""
    pick = [0, 1, 3, 5, 7, 9, 12, 14]
    llm = LLM(executor="ray", num_memory_workers=1, num_kv_slots=8192, max_step_tokens=2048,
              num_compute_workers=3, pipeline="rotational")
    try:
        assert llm.executor.ring and llm.engine.config.batches == 4
        tokens, spans = traced_decode(llm.engine, llm.executor, [prompts[i] for i in pick],
                                      replace(GREEDY, max_tokens=8))
        assert tokens == [hf_greedy[i][:8] for i in pick]
        check_ring(spans, 3, 4, len(llm.executor.params), smol.config.hidden_size, 1,
                   rows=len(pick))
    finally:
        llm.shutdown()


def test_ring_of_two_replicas_greedy_identical_to_hf(setup, smol, prompts, hf_greedy):
    llm, _ = setup
    ex, eng = llm.executor, llm.engine
    assert ex.ring and ex.replica_split is None and len(ex.computes) == 2
    tokens, spans = traced_decode(eng, ex, prompts, GREEDY)
    assert tokens == [r[:SHORT_NEW] for r in hf_greedy]
    check_ring(spans, 2, 3, len(ex.params), smol.config.hidden_size, 2)
    assert all(h["error"] is None for h in ray.get([w.health.remote() for w in ex.memory]))
    assert eng.free_slots() == [a.config.num_slots for a in eng.allocs]


def test_compute_and_memory_faults_in_a_ring_fail_alone(setup, prompts, hf_greedy):
    """The compute fault: every compute worker refuses the request before anything is
    sent (a clean fault, the same on each). The memory fault: a memory worker fails
    mid-step on one worker's connection; that worker fails, the other is interrupted
    rather than left waiting out its timeout."""
    faults_fail_alone(*setup, prompts, hf_greedy)


def test_sessions_over_a_ring_load_from_the_tiers(setup, smol):
    sessions_load_from_the_tiers(setup[0], smol)


def test_killed_ring_replica_replaced_and_requests_recomputed(setup, prompts, hf_greedy):
    """The next step fails on the dead worker, the other is interrupted, the dead one
    alone is replaced and the ring rewired."""
    killed_replica_recovers(setup[0], prompts, hf_greedy)


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
