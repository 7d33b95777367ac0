"""The engine on a local Ray cluster: 1 compute worker, 2 memory workers, data plane over
Unix sockets. Greedy tokens identical to HF; a dead memory worker fails loudly."""
from dataclasses import replace

import pytest
import ray

from lamina import LLM, SamplingParams
from lamina.cluster.executor import WorkerFailure

GREEDY = SamplingParams(max_tokens=64, temperature=0)


@pytest.fixture(scope="module")
def llm():
    llm = LLM(executor="ray", num_memory_workers=2, num_kv_slots=4096, max_step_tokens=1024)
    yield llm
    llm.shutdown()
    ray.shutdown()


def test_ray_greedy_identical_to_hf(llm, prompts, hf_greedy):
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy
    info = llm.executor.memory_info
    assert len(info) == 2 and info[0]["pid"] != info[1]["pid"]
    assert [a[0] for a in llm.executor.addresses] == ["unix", "unix"]
    assert all(len(a) == 5 for a in llm.executor.addresses)  # payloads via shm rings


def test_ray_rotational_pipeline_identical(llm, prompts, hf_greedy):
    """Two micro-batches per step: one's slices overlap the other's remote attention."""
    eng = llm.engine
    eng.config = replace(eng.config, pipeline="rotational")
    eng.step_timings.clear()
    try:
        outs = llm.generate(prompts[:6], GREEDY, use_tqdm=False)
    finally:
        eng.config = replace(eng.config, pipeline="none")
    assert [o.token_ids for o in outs] == hf_greedy[:6]
    assert max(t["micro_batches"] for t in eng.step_timings) == 2


def test_ray_kv_split_over_workers_identical(llm, prompts, hf_greedy):
    """Hold most slots so the 600-token prompt spans both memory workers' pools; the
    partial attentions come back with their LSE and merge exactly."""
    eng = llm.engine
    for w, held in enumerate((3700, 3800)):
        eng.allocs[w].allocate(("held", w), held)
    try:
        rid = eng.add_request(prompts[8], GREEDY)
        seq = eng.scheduler.waiting[0]
        eng.add_request(prompts[0], GREEDY)
        out, spans = {}, set()
        while eng.has_unfinished():
            for o in eng.step():
                out[o.request_id] = o
            spans.add(tuple(seq.workers))
    finally:
        for w in range(2):
            eng.allocs[w].free(("held", w))
    assert (0, 1) in spans
    assert out[rid].token_ids == hf_greedy[8] and out[rid + 1].token_ids == hf_greedy[0]


def test_dead_memory_worker_fails_the_step_loudly(llm, prompts):
    eng = llm.engine
    eng.add_request(prompts[0], GREEDY)
    eng.add_request(prompts[1], GREEDY)
    eng.step()
    ray.kill(llm.executor.memory[1])
    with pytest.raises(WorkerFailure, match="step .* failed"):
        for _ in range(3):
            eng.step()
