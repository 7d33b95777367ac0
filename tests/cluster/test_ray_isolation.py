"""One bad request fails alone on the Ray executor (1 compute worker, 2 memory workers):
a fault in the compute worker's handling of one sequence comes back over the control
channel naming it (the step re-runs without it, no worker replaced); a fault in a memory
worker's handling of one sequence closes that worker's channel, its health names the
sequence, the engine fails that request, recovers the workers (reset: the same processes
serve on) and recomputes the rest.
Every other request keeps HF's greedy tokens; every KV slot comes back. Through the
Python API and through HTTP (the openai client)."""
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import openai
import pytest
import ray

from lamina import LLM, SamplingParams
from lamina.entrypoints.engine_loop import EngineLoop
from lamina.entrypoints.metrics import EngineMetrics
from lamina.faults import FaultPlan
from tests.cluster import keep_ray_for_the_next_module
from tests.conftest import SHORT_NEW

from ..lamina.test_isolation import unused_token
from ..lamina.test_server_limits import _KeyServer

NEW = SHORT_NEW
GOOD = SamplingParams(max_tokens=NEW, temperature=0)
MEM_POS = 700  # a decode query of the 695-token poison prompt; no good request gets there
SLOTS = 3000


@pytest.fixture(scope="module")
def setup(prompts, hf_greedy):
    tok = unused_token(prompts, hf_greedy)
    layer_tok = unused_token(prompts, hf_greedy, 1)
    llm = LLM(executor="ray", num_memory_workers=2, num_kv_slots=SLOTS, max_step_tokens=2048,
              faults=FaultPlan(compute_token=tok, memory_pos=MEM_POS, compute_layer=2,
                               layer_token=layer_tok))
    yield llm, tok, layer_tok
    llm.shutdown()
    keep_ray_for_the_next_module()


def drain(eng, outs):
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})


def faults_fail_alone(llm, tok, prompts, hf_greedy):
    """A request poisoning the compute side (refused cleanly, nothing recovered) and one
    poisoning a memory worker (the workers reset, the other requests recomputed) among
    the 16 good ones: each fails alone, naming its fault."""
    eng = llm.engine
    workers = [w._actor_id for w in [*llm.executor.computes, *llm.executor.memory]]
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
    assert "memory worker" in outs[bad_m].error
    assert eng.num_recoveries == recovered + 1  # only the memory fault recovered workers
    assert eng.free_slots() == [a.config.num_slots for a in eng.allocs]
    health = ray.get([w.health.remote() for w in llm.executor.memory])
    assert all(h["error"] is None for h in health)  # reset: the fault's error is gone
    assert [w._actor_id for w in [*llm.executor.computes, *llm.executor.memory]] == workers


def test_compute_and_memory_faults_fail_alone(setup, prompts, hf_greedy):
    faults_fail_alone(*setup[:2], prompts, hf_greedy)


def test_a_request_every_step_fails_on_is_found_on_ray(setup, prompts, hf_greedy):
    """A fault no sequence is blamed for: layer 2 raises in the compute worker in every
    step feeding the poison token. The engine recovers the workers max_recoveries times
    (1 here, to keep the test short), then bisects: the poison request fails alone, the
    others keep HF's tokens (recomputed on the reset workers), every slot comes back."""
    llm, _, layer_tok = setup
    eng = llm.engine
    recovered, config = eng.num_recoveries, eng.config
    eng.config = replace(config, max_recoveries=1)
    try:
        good = [eng.add_request(prompts[i], GOOD) for i in (0, 1, 2)]
        bad = eng.add_request(prompts[3] + [layer_tok], GOOD)
        outs = {}
        drain(eng, outs)
    finally:
        eng.config = config
    assert [outs[i].token_ids for i in good] == [hf_greedy[i][:NEW] for i in (0, 1, 2)]
    assert outs[bad].finish_reason == "error"
    assert "every step it ran in failed" in outs[bad].error
    assert "injected fault in layer 2 (no sequence named)" in outs[bad].error
    assert 3 <= eng.num_recoveries - recovered <= 2 + 2 + 3  # 2 in a row, log2(4) + 3
    assert eng.free_slots() == [a.config.num_slots for a in eng.allocs]


def test_poison_over_http_on_ray(setup, smol, prompts, hf_greedy):
    llm, tok, _ = setup
    loop = EngineLoop(llm.engine, EngineMetrics())
    srv = _KeyServer(loop, smol.tokenizer, None)
    try:
        cl = srv.client()

        def good(i):
            return cl.completions.create(model="smollm2", prompt=prompts[i], max_tokens=NEW,
                                         temperature=0).choices[0].model_extra["token_ids"]

        with ThreadPoolExecutor(9) as pool:
            futs = [pool.submit(good, i) for i in range(0, 16, 2)]
            bad = pool.submit(cl.completions.create, model="smollm2", max_tokens=NEW,
                              prompt=[tok, 5])
            with pytest.raises(openai.InternalServerError, match="injected compute fault"):
                bad.result(300)
            assert [f.result(300) for f in futs] == [hf_greedy[i][:NEW] for i in range(0, 16, 2)]
        deadline = time.time() + 30
        while llm.engine.has_unfinished() and time.time() < deadline:
            time.sleep(0.05)
        assert loop.alive and all(f == SLOTS for f in llm.engine.free_slots())
        assert good(0) == hf_greedy[0][:NEW]
    finally:
        srv.stop()
        loop.shutdown()
