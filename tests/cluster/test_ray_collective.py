"""Ray workers wired with collective paths (`LAMINA_COLLECTIVE=gloo`: the code NCCL runs
between GPUs, on CPU): every pair's tensors go as point-to-point sends, the sockets carry
the rest; greedy tokens equal HF's, and a memory worker killed mid-decode is replaced,
with a new path, and its requests recomputed."""
import pytest
import ray

from lamina import LLM, SamplingParams
from lamina.dataplane.collective import Rendezvous
from tests.cluster import keep_ray_for_the_next_module

GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def llm():
    with pytest.MonkeyPatch.context() as mp:  # read when the executor wires its workers
        mp.setenv("LAMINA_COLLECTIVE", "gloo")
        llm = LLM(executor="ray", num_memory_workers=2, num_kv_slots=4096,
                  max_step_tokens=1024)
        yield llm
        llm.shutdown()
        keep_ray_for_the_next_module()


def test_ray_over_gloo_paths_gives_hf_greedy_and_recovers_a_dead_memory_worker(
        llm, prompts, hf_greedy):
    ex = llm.executor
    assert [c.kind for c in ex.transport_choices] == ["unix+gloo", "unix+gloo"]
    assert all(isinstance(a[-1], Rendezvous) and a[-1].backend == "gloo"
               for a in ex.addresses)
    assert ex.transports == ["unix socket + gloo"] * 2
    pick = [0, 3, 8, 9]  # the 600-token prompt among them
    outs = llm.generate([prompts[i] for i in pick], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy[i][:12] for i in pick]
    eng = llm.engine
    eng.clear_prefix_cache()
    ids = [eng.add_request(prompts[i], GREEDY) for i in pick]
    for _ in range(4):
        eng.step()
    assert {s.worker for s in eng.scheduler.running} == {0, 1}  # both hold KV
    ray.kill(ex.memory[1])
    out = {}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] = o
    assert [out[i].token_ids for i in ids] == [hf_greedy[i][:12] for i in pick]
    assert len(eng.recoveries) == 1 and "WorkerFailure" in eng.recoveries[0]
    # the new memory workers were wired with paths of their own
    assert all(isinstance(a[-1], Rendezvous) for a in ex.addresses)
    health = ray.get([w.health.remote() for w in ex.memory])
    assert all(h["error"] is None and h["steps"] > 0 for h in health), health
    # every layer's q/k/v came on the path: at least one payload a layer and step
    assert all(h["path_payloads"] >= 30 * h["steps"] for h in health), health


def test_nccl_forced_on_cpu_devices_is_refused_before_any_worker_starts(monkeypatch):
    from lamina.cluster.executor import RayExecutor
    from lamina.engine.config import EngineConfig

    monkeypatch.setenv("LAMINA_COLLECTIVE", "nccl")
    with pytest.raises(ValueError, match="needs compute_device and kv_device on CUDA, not "
                                         "'cpu' and 'cpu'"):
        RayExecutor.check(EngineConfig())
