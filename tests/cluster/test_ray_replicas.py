"""Compute replicas on Ray under the fixed schedule (`num_compute_workers` = 2, pipeline
"fixed"): two compute worker processes, each a model replica with its own sequences,
both connected to the same 2 memory workers, which serve the two connections over one
pool each. Greedy tokens equal HF's on the 16 mixed-length prompts; from the trace, each
replica's lane runs its own steps' slices at once with the other's, each sequence stays
on its replica, and a memory worker attends for one replica at a time; a bad request on
one replica fails alone without the other replica's part running twice; sessions'
later turns load their KV from the memory workers' host tiers; a killed replica is
replaced and its requests recomputed. Three replicas over one memory worker
run locally (tests/lamina/test_replicas.py) and, as a ring, on Ray
(tests/cluster/test_ray_ring.py) only: four processes take tens of seconds to start on
two cores."""
import pytest
import ray

from lamina import LLM, SamplingParams
from lamina.faults import FaultPlan
from lamina.trace import lanes, overlapping
from tests.cluster import keep_ray_for_the_next_module
from tests.conftest import SHORT_NEW, hf_greedy_of

from ..lamina.test_isolation import unused_token
from ..lamina.test_replicas import traced_fixed_run

GREEDY = SamplingParams(max_tokens=SHORT_NEW, temperature=0)
HOST_BYTES = 16 << 20  # each memory worker's session tier: ~340 tokens of SmolLM2's KV


@pytest.fixture(scope="module")
def setup(prompts, hf_greedy):
    tok = unused_token(prompts, hf_greedy)
    llm = LLM(executor="ray", num_memory_workers=2, num_kv_slots=4096, max_step_tokens=2048,
              num_compute_workers=2, pipeline="fixed", faults=FaultPlan(compute_token=tok),
              kv_host_bytes=HOST_BYTES)
    yield llm, tok
    llm.shutdown()
    keep_ray_for_the_next_module()


def drain(eng, outs):
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step() if o.finished})


def test_fixed_replicas_on_ray_greedy_identical_to_hf(setup, prompts, hf_greedy):
    llm, _ = setup
    ex, eng = llm.executor, llm.engine
    assert len(ex.computes) == 2 and len(set(ex.nodes["computes"])) == 1  # one local node
    tokens, homes, spans = traced_fixed_run(eng, ex, prompts, GREEDY)
    assert tokens == [r[:SHORT_NEW] for r in hf_greedy]
    assert sorted(homes.values()) == [0] * 8 + [1] * 8  # balanced at admission
    assert lanes(spans) == ["compute0", "compute1", "memory0", "memory1"]
    assert overlapping(spans) == []  # a memory worker attends for one replica at a time
    # both replicas' steps reached both memory workers: each one served two connections
    attends = {(s.lane, s.step) for s in spans if s.kind == "attend"}
    steps = {s.step for s in spans if s.lane == "compute0"}
    assert steps == {s.step for s in spans if s.lane == "compute1"} and len(steps) == 3
    assert len([s for s in spans if s.kind == "attend"]) == 2 * 2 * 3 * 30  # 30 layers
    assert {lane for lane, _ in attends} == {"memory0", "memory1"}
    health = ray.get([w.health.remote() for w in ex.memory])
    assert all(h["error"] is None for h in health)
    assert eng.free_slots() == [a.config.num_slots for a in eng.allocs]


def test_bad_request_on_one_replica_fails_alone(setup, prompts, hf_greedy):
    """The compute worker holding the poison request refuses it (a clean fault); the
    other replica's part of that step succeeded and is not run again."""
    llm, tok = setup
    eng = llm.engine
    recovered = eng.num_recoveries
    ids = [eng.add_request(p, SamplingParams(max_tokens=SHORT_NEW, temperature=0))
           for p in prompts[:6]]
    outs = {}
    eng.step()
    bad = eng.add_request([7, tok, 8], SamplingParams(max_tokens=SHORT_NEW, temperature=0))
    drain(eng, outs)
    assert [outs[i].token_ids for i in ids] == [r[:SHORT_NEW] for r in hf_greedy[:6]]
    assert outs[bad].finish_reason == "error"
    assert f"injected compute fault on token {tok}" in outs[bad].error
    assert "compute replica" in outs[bad].error  # the replica that refused it
    assert eng.num_recoveries == recovered  # nothing replaced
    assert eng.free_slots() == [a.config.num_slots for a in eng.allocs]


def sessions_load_from_the_tiers(llm, smol):
    """4 sessions' first turns, then (the prefix cache cleared) their second turns: each
    loads its history from its memory worker's host tier (the orders go to the memory
    workers before the step, not in the replicas' frames) and answers as HF greedy over
    the whole history; no load misses, every slot comes back."""
    tok, eng = smol.tokenizer, llm.engine
    eng.clear_prefix_cache()
    names = ["A", "B", "C", "D"]
    first = [tok(f"Session {s}: tell me something about the number {s}.")["input_ids"]
             for s in names]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = llm.generate(first, params, use_tqdm=False, session_id=names)
    llm.generate([[1, 2, 3]], params, use_tqdm=False)  # a step carries the saves
    eng.clear_prefix_cache()
    second = [p + o.token_ids + tok(" Why?", add_special_tokens=False)["input_ids"]
              for p, o in zip(first, outs)]
    misses = eng.tier_stats()["tier_misses"]
    got = llm.generate(second, params, use_tqdm=False, session_id=names)
    # each: its first turn but the last answer token (whose KV no step wrote)
    assert [o.metrics["tier_cached_tokens"] for o in got] == [len(p) + 7 for p in first]
    assert eng.tier_stats()["tier_misses"] == misses
    assert [o.token_ids for o in got] == hf_greedy_of(smol, second, 8)
    eng.clear_prefix_cache()
    assert eng.free_slots() == [a.config.num_slots for a in eng.allocs]


def test_sessions_over_fixed_replicas_load_from_the_tiers(setup, smol):
    sessions_load_from_the_tiers(setup[0], smol)


def killed_replica_recovers(llm, prompts, hf_greedy, before_kill=lambda ex: None):
    """Compute worker 1 killed after a few steps of 4 requests (`before_kill(executor)`
    checks the state then): the dead one alone is replaced, the requests end with HF's
    tokens, every slot comes back."""
    ex, eng = llm.executor, llm.engine
    before = eng.num_recoveries
    pick = [1, 4, 6, 11]
    ids = [eng.add_request(prompts[i], GREEDY) for i in pick]
    for _ in range(3):
        eng.step()
    before_kill(ex)
    old = [c._actor_id for c in ex.computes]
    ray.kill(ex.computes[1])
    outs = {}
    drain(eng, outs)
    assert [outs[i].token_ids for i in ids] == [hf_greedy[i][:SHORT_NEW] for i in pick]
    assert eng.num_recoveries == before + 1
    assert "compute worker 1" in eng.recoveries[-1]
    new = [c._actor_id for c in ex.computes]
    assert new[0] == old[0] and new[1] != old[1]  # only the dead one was replaced
    assert eng.free_slots() == [a.config.num_slots for a in eng.allocs]


def test_killed_replica_replaced_and_requests_recomputed(setup, prompts, hf_greedy):
    def both_hold_some(ex):
        assert set(ex.replica_split.home.values()) == {0, 1}

    killed_replica_recovers(setup[0], prompts, hf_greedy, both_hold_some)
