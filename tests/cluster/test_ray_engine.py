"""The engine on a local Ray cluster: 1 compute worker, 2 memory workers, data plane over
Unix sockets. Greedy tokens identical to HF; a dead memory worker is replaced and its
requests recomputed, or (recovery off) the step fails loudly."""
import json
import logging
import os
import signal
import threading
import time
from dataclasses import replace

import jsonschema
import pytest
import ray
import torch

import lamina.cluster.executor
from lamina import LLM, SamplingParams
from lamina.cluster.executor import WorkerFailure
from lamina.cluster.memory_worker import MemoryWorker
from lamina.errors import EngineDead
from lamina.model import quick_load
from lamina.sampling.structured import StructuredOutputs
from tests.cluster import keep_ray_for_the_next_module
from tests.conftest import HF_NEW, hf_greedy_of
from tests.lamina.test_interrupt import generate_in, wait_until
from tests.lamina.test_structured import PROMPT, SCHEMA, _hf_guided

GREEDY = SamplingParams(max_tokens=HF_NEW, temperature=0)


# session KV tiers on: a host tier of 30 tokens' KV (SmolLM2 fp32) and a disk tier
HOST_TOKENS = 30


@pytest.fixture(scope="module")
def llm(tmp_path_factory, smol, smol_split):
    # what a first compute worker on this machine writes (its trace is in the store):
    # every compute worker here then starts from the weights alone
    assert quick_load.remember(smol, torch.float32) is not None
    disk = tmp_path_factory.mktemp("kv-tiers")
    # the tests step its engine themselves: its keeper only where one turns it on
    llm = LLM(executor="ray", num_memory_workers=2, num_kv_slots=4096, max_step_tokens=1024,
              kv_host_bytes=HOST_TOKENS * 46080, kv_disk_dir=str(disk), kv_disk_bytes=1 << 30,
              regrow_interval_s=0)
    llm.disk_dir = disk
    yield llm
    llm.shutdown()
    keep_ray_for_the_next_module()


def test_step_threads_rule():
    from lamina.cluster.compute_worker import PREFILL_TOKENS, WIDE_ROWS, step_threads

    rows = WIDE_ROWS["eager"]
    assert step_threads(rows - 1, 1, 1, 2) == 1  # too few rows to pay a thread (MKL)
    assert step_threads(rows, 1, 1, 2) == 2  # sides take turns: every core
    assert step_threads(rows, 2, 1, 2) == 1  # pipelined: memory workers busy
    assert step_threads(PREFILL_TOKENS, 2, 1, 2) == 2  # prefill-heavy: they are near idle
    assert step_threads(1, 1, 1, 2, WIDE_ROWS["onednn"]) == 2  # oneDNN scales from 1 row
    assert step_threads(1, 2, 1, 2, WIDE_ROWS["onednn"]) == 1


def test_ray_greedy_identical_to_hf(llm, prompts, hf_greedy):
    llm.engine.step_timings.clear()
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == hf_greedy
    # 3446 prompt tokens against 1024 a step: the 8th prompt (450 tokens) is fed in
    # chunks, the first from the 262 tokens the 7 before it leave
    assert llm.engine.step_timings[0]["tokens"] == 1024
    assert llm.dense.backend == "onednn"  # the compute worker's linears run prepacked
    # the memory workers' pools on the pages the config asks for (the suite: ordinary
    # ones, tests/conftest.py; a pool config's own default is huge pages)
    assert llm.executor.pool_config.huge_pages is llm.engine.config.kv_huge_pages is False
    assert not hasattr(llm.loaded, "model")  # the weights live in the workers only
    # the compute worker read its weights alone and bound them to the stored trace,
    # with no transformers in its process
    assert [(s.weights_only, s.transformers_imported)
            for s in llm.executor.compute_starts()] == [(True, False)]
    # one micro-batch per step and oneDNN linears: the compute worker took every core
    used = {s["threads"] for s in llm.engine.step_timings}
    assert used == {llm.executor.wide_threads}, used
    info = llm.executor.memory_info
    assert len(info) == 2 and info[0]["pid"] != info[1]["pid"]
    assert [a[0] for a in llm.executor.addresses] == ["unix", "unix"]
    assert all(len(a) == 5 for a in llm.executor.addresses)  # payloads via shm rings
    # the memory workers' data-plane threads run under SCHED_BATCH (no wake-up preemption)
    health = ray.get([w.health.remote() for w in llm.executor.memory])
    assert [h["sched_batch"] for h in health] == [True, True]
    # decode steps sent and collected each layer in one C++ call (`exchange_qkv`)
    assert llm.engine.step_timings and all(
        s["exchanges"] == 30 for s in llm.engine.step_timings if s["tokens"] == len(prompts))


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-GPU message")
def test_gpu_pool_on_a_cluster_without_gpus_is_a_clear_error(llm):
    """kv_device='cuda' gives each memory worker a GPU of its own; a cluster with fewer
    GPUs is refused before any worker starts (Ray would otherwise wait forever)."""
    from lamina.cluster.executor import RayExecutor
    from lamina.engine.config import EngineConfig

    with pytest.raises(ValueError, match="the Ray cluster has 0 GPU"):
        RayExecutor(None, "float32", EngineConfig(num_memory_workers=2, kv_device="cuda"))
    # compute_device='cuda': the compute worker asks for a GPU of its own, refused alike
    with pytest.raises(ValueError, match="1 compute worker.*GPU: needs 1, the cluster has 0"):
        RayExecutor(None, "float32", EngineConfig(compute_device="cuda"))


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


def test_ray_speculative_drafts_answer_as_hf(llm, prompts, hf_greedy):
    """n-gram drafts over Ray (the draft crosses the control channel in `SeqWork`, its
    rows go to the memory workers as a prompt chunk, the misses' slots come back):
    HF's greedy tokens, with guesses kept, also under rotational pipelining."""
    eng = llm.engine
    eng.config = replace(eng.config, speculative_tokens=4)
    eng.scheduler.propose = eng._propose
    try:
        outs = llm.generate(prompts[:6], GREEDY, use_tqdm=False)
        eng.config = replace(eng.config, pipeline="rotational")
        rot = llm.generate(prompts[6:10], GREEDY, use_tqdm=False)
    finally:
        eng.config = replace(eng.config, speculative_tokens=0, pipeline="none")
        eng.scheduler.propose = None
    assert [o.token_ids for o in outs + rot] == hf_greedy[:10]
    assert eng.num_accepted_tokens > 0


def test_ray_exchange_probe(llm, prompts, hf_greedy):
    """The exchange probe (simulator calibration) times a layer's round trip through the
    real workers, and the engine's steps still give HF's tokens after it (the probe
    writes into the pools' first slots: the prefix cache is cleared first)."""
    llm.engine.clear_prefix_cache()
    res = ray.get(llm.executor.compute.probe_exchange.remote([1, 8], 2))
    assert set(res["exchange_s"]) == {1, 8}
    assert 0 < res["submit_s"][8] < res["exchange_s"][8]
    outs = llm.generate(prompts[:4], replace(GREEDY, max_tokens=8), use_tqdm=False)
    assert [o.token_ids for o in outs] == [r[:8] for r in hf_greedy[:4]]


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


def test_ray_request_overrides_answer_as_local(llm, prompts, hf_greedy):
    """Requests choosing their own KV sparsity on the dense Ray deployment (2 memory
    workers, local prefill on), in one batch: h2o at 48 tokens (its prompt attends on
    its memory worker, where h2o scores it, not on the compute side; the keys it left
    out at every layer come back in the steps' DROPPED frames), topk at 25%,
    streaming at 48 (its slots past the window given back: the memory worker's held
    table is re-sent from the hole), and one without: the first three answer as the
    local executor with that policy deployment-wide keeping every slot, the last as
    HF. (Requests' own policies equal deployment-wide ones: test_sparsity.py.)"""
    batch = [prompts[i] for i in (4, 8, 14, 6)]  # 128, 600, 250, 300 tokens
    own = [SamplingParams(max_tokens=12, temperature=0, **kw) for kw in (
        dict(kv_sparsity="h2o", kv_budget=48), dict(kv_sparsity="topk", kv_budget=0.25),
        dict(kv_sparsity="streaming", kv_budget=48), {})]
    local = LLM(num_kv_slots=2048, kv_evict=False)
    want = [o.token_ids for o in local.generate(batch[:3], own[:3], use_tqdm=False)]
    local.shutdown()
    eng = llm.engine
    ids = [eng.add_request(p, sp) for p, sp in zip(batch, own)]
    done, evicted, holes = {}, None, 0
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
        seq = next((q for q in eng.scheduler.running if q.prompt == batch[2]), None)
        evicted = evicted or (seq.evicted if seq and seq.evicted[1] else None)
        seq = next((q for q in eng.scheduler.running if q.prompt == batch[0]), None)
        holes = max(holes, len(seq.pending_drop) if seq else 0)
    assert [done[i].token_ids for i in ids] == [*want, hf_greedy[6][:12]]
    assert want[0] != hf_greedy[4][:12]  # h2o's 48 tokens changed the answer
    assert evicted == (4, 250 + 1 - 44)  # given back at its first decode step
    assert holes > 0  # reported (too few to give back: fewer than 64)


def test_ray_structured_output_equals_hf_masked_by_llguidance(llm, smol):
    """The masks cross the control channel: a JSON schema's greedy answer on Ray equals
    HF's under llguidance's own mask (tests/lamina/test_structured.py), up to where the
    structure is complete (HF's next token: EOS)."""
    spec = StructuredOutputs(json=SCHEMA)
    ids = smol.tokenizer(PROMPT)["input_ids"]
    out = llm.generate([ids], SamplingParams(max_tokens=80, temperature=0,
                                             structured_outputs=spec), use_tqdm=False)[0]
    ref = _hf_guided(smol, ids, spec, 80)
    assert out.finish_reason == "stop"
    assert ref[:len(out.token_ids) + 1] == out.token_ids + [smol.tokenizer.eos_token_id]
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_ray_trace_lines_up_the_processes_lanes(llm, prompts, hf_greedy):
    """Two decode steps traced on Ray (a compute worker and 2 memory workers, three
    processes): each memory worker's attention of a layer lies inside the compute
    side's submit-to-collect of that layer (the processes share one clock), no lane
    runs two tasks at once, and the answers are still HF's."""
    from lamina.trace import lanes, overlapping

    eng = llm.engine
    eng.clear_prefix_cache()
    ids = [eng.add_request(prompts[i], SamplingParams(max_tokens=4, temperature=0))
           for i in (0, 3, 5, 9)]
    done = {o.request_id: o for o in eng.step() if o.finished}  # the prompts
    llm.executor.start_trace()
    steps = []
    for _ in range(2):
        steps.append(eng.scheduler.step)
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    spans = llm.executor.stop_trace()
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert [done[i].token_ids for i in ids] == [hf_greedy[i][:4] for i in (0, 3, 5, 9)]
    assert lanes(spans) == ["compute0", "memory0", "memory1"]
    assert overlapping(spans) == []
    out = {(s.step, s.layer, s.mb): s for s in spans
           if s.lane == "compute0" and s.kind == "submit"}
    back = {(s.step, s.layer, s.mb): s for s in spans
            if s.lane == "compute0" and s.kind == "wait"}
    attends = [s for s in spans if s.kind == "attend"]
    assert {s.step for s in attends} == set(steps)
    assert {(s.lane, s.step) for s in attends} == {(f"memory{w}", t) for w in (0, 1)
                                                   for t in steps}
    for a in attends:
        key = (a.step, a.layer, a.mb)
        assert out[key].t0 <= a.t0 <= a.t1 <= back[key].t1, (a, out[key], back[key])


def test_dead_memory_worker_replaced_and_requests_recomputed(llm, prompts, hf_greedy):
    """A memory worker killed mid-decode: the step fails, the executor starts a fresh
    memory worker in its place and resets the live one (same process, its sequences'
    state dropped, its pool's bytes kept), the engine recomputes the lost KV and keeps
    the live worker's, and every request still ends with HF's greedy tokens."""
    eng, pick = llm.engine, [0, 3, 5, 9]
    eng.clear_prefix_cache()  # placement by free slots alone: both workers get some
    ids = [eng.add_request(prompts[i], GREEDY) for i in pick]
    for _ in range(5):
        eng.step()
    assert {s.worker for s in eng.scheduler.running} == {0, 1}  # both hold KV
    old = [w._actor_id for w in llm.executor.memory]
    old_pids = [i["pid"] for i in llm.executor.memory_info]
    replaced = llm.executor.workers_replaced()
    kept_before = eng.kv_kept_tokens
    on_0 = sum(s.num_tokens - 1 for s in eng.scheduler.running if s.worker == 0)
    ray.kill(llm.executor.memory[1])
    out = {}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] = o
    assert [out[i].token_ids for i in ids] == [hf_greedy[i] for i in pick]
    assert len(eng.recoveries) == 1 and "WorkerFailure" in eng.recoveries[0]
    assert all(out[i].metrics["preemptions"] == 1 for i in ids)
    assert llm.executor.kv_kept() == frozenset({0})
    assert eng.kv_kept_tokens - kept_before >= on_0 > 0  # (a step may run before it dies)
    new = [w._actor_id for w in llm.executor.memory]
    assert new[0] == old[0] and new[1] != old[1]
    assert llm.executor.workers_replaced() == {"compute": replaced["compute"],
                                               "memory": replaced["memory"] + 1}
    pids = [i["pid"] for i in llm.executor.memory_info]
    assert pids[0] == old_pids[0] and pids[1] != old_pids[1]
    assert pids == [ray.get(w.__ray_call__.remote(lambda _: os.getpid()))
                    for w in llm.executor.memory]
    assert eng.free_slots() == [a.config.num_slots for a in eng.allocs]
    # and it keeps serving
    assert llm.generate([prompts[2]], GREEDY, use_tqdm=False)[0].token_ids == hf_greedy[2]


def test_a_memory_worker_whose_replacement_cannot_start_is_dropped_and_the_engine_goes_on(
        llm, prompts, hf_greedy, monkeypatch, caplog):
    """Memory worker 0 killed mid-decode, and the cluster has no room for its
    replacement (it asks for a resource no node has, as when its node is gone and no
    other has room): after the start's bound the recovery drops it, worker 1 becomes
    worker 0 (its pool, its process, its KV kept), and every request ends with HF's
    greedy tokens; the lost worker's group is removed (its room given back). Then the
    LLM's keeper (turned on: every 0.2 s) grows the pools back to 2 in a new group; the
    size (the LLM's 2) unchanged."""
    eng, ex, pick = llm.engine, llm.executor, [0, 3, 5, 9]
    eng.clear_prefix_cache()  # placement by free slots alone: both workers get some
    ids = [eng.add_request(prompts[i], GREEDY) for i in pick]
    for _ in range(5):
        eng.step()
    assert {s.worker for s in eng.scheduler.running} == {0, 1}
    on_1 = sum(s.num_tokens - 1 for s in eng.scheduler.running if s.worker == 1)
    survivor, pid, kept_before = ex.memory[1]._actor_id, ex.memory_info[1]["pid"], \
        eng.kv_kept_tokens
    groups = [h.group.id.hex() for h in ex._homes]
    bound = ex.config.placement_timeout_s
    ex.config = replace(ex.config, placement_timeout_s=2.0)
    monkeypatch.setattr(lamina.cluster.executor, "START_TIMEOUT_S", 1)
    monkeypatch.setattr(ex, "_new_memory", lambda i: MemoryWorker.options(
        resources={"lamina_nowhere": 1}).remote(i))
    ray.kill(ex.memory[0])
    out = {}
    with caplog.at_level(logging.WARNING):
        while eng.has_unfinished():
            for o in eng.step():
                out[o.request_id] = o
    monkeypatch.undo()
    ex.config = replace(ex.config, placement_timeout_s=bound)
    assert [out[i].token_ids for i in ids] == [hf_greedy[i] for i in pick]
    assert ex.memory_lost() == (0,) and ex.kv_kept() == frozenset({0})
    assert [w._actor_id for w in ex.memory] == [survivor]
    assert [i["pid"] for i in ex.memory_info] == [pid]
    assert ray.get(ex.memory[0].__ray_call__.remote(lambda w: w.index)) == 0
    assert len(eng.allocs) == 1 and eng.memory_workers_lost == 1
    assert eng.kv_kept_tokens - kept_before >= on_1 > 0
    assert any("memory worker 0's replacement did not start within 3 s" in r.message
               for r in caplog.records)
    assert eng.free_slots() == [a.config.num_slots for a in eng.allocs]
    assert ray.util.placement_group_table()[groups[0]]["state"] == "REMOVED"
    # its room free again: the keeper's grow takes it
    assert llm.keeper.missing() == 1 and ex.memory_workers_room(2) == 2
    llm.engine.keeper = llm.keeper.through(every=0.2)
    try:
        deadline = time.monotonic() + 60
        while len(eng.allocs) < 2:
            assert time.monotonic() < deadline, llm.keeper.failed
            time.sleep(0.1)
    finally:
        llm.engine.keeper = llm.keeper.through(every=0)
    now = [h.group.id.hex() for h in ex._homes]
    assert now[0] == groups[1] and now[1] not in groups and len(ex.nodes["memory"]) == 2
    assert llm.keeper.missing() == 0 and llm.keeper.failed is None
    assert llm.config.num_memory_workers == 2
    outs = llm.generate([prompts[i] for i in pick], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy[i] for i in pick]


def test_a_replacement_whose_start_raises_is_given_up_unless_too_few_would_stay(llm):
    """A replacement memory worker whose start raises (its threads not a number) is
    given up at once, naming the error; were it dropped with fewer than
    `min_live_memory_workers` left, the recovery fails instead (the engine stops)."""
    ex, bound = llm.executor, llm.executor.config
    try:
        broken = MemoryWorker.remote(0, "no threads")
        why = ex._not_started({0: broken.ping.remote()})
        assert why == {0: "could not start: RuntimeError: set_num_threads expects an int, "
                          "but got str"}
        ex.config = replace(bound, min_live_memory_workers=2)
        with pytest.raises(WorkerFailure, match=(
                r"memory worker 0's replacement could not start: .*; without it 1 memory "
                r"workers would stay, fewer than min_live_memory_workers=2")):
            ex._not_started({0: MemoryWorker.remote(0, "no threads").ping.remote()})
    finally:
        ex.config = bound


def test_dead_compute_worker_replaced_and_requests_recomputed(llm, prompts, hf_greedy):
    """The compute worker killed mid-decode: its control channel closes, the step fails
    naming it, a new compute worker (and fresh memory workers) take over, and the
    requests still end with HF's greedy tokens."""
    eng, pick = llm.engine, [2, 7]
    before = len(eng.recoveries)
    ids = [eng.add_request(prompts[i], GREEDY) for i in pick]
    for _ in range(3):
        eng.step()
    old = llm.executor.compute._actor_id
    memory = [w._actor_id for w in llm.executor.memory]
    replaced, kept = llm.executor.workers_replaced(), eng.kv_kept_tokens
    ray.kill(llm.executor.compute)
    out = {}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] = o
    assert [out[i].token_ids for i in ids] == [hf_greedy[i] for i in pick]
    assert len(eng.recoveries) == before + 1 and "WorkerFailure" in eng.recoveries[-1]
    assert "compute worker hung up" in eng.recoveries[-1]
    assert llm.executor.compute._actor_id != old
    assert [s.weights_only for s in llm.executor.compute_starts()] == [True]
    assert [w._actor_id for w in llm.executor.memory] == memory  # alive: reset, kept
    assert llm.executor.kv_kept() == frozenset({0, 1}) and eng.kv_kept_tokens > kept
    assert llm.executor.workers_replaced() == {"compute": replaced["compute"] + 1,
                                               "memory": replaced["memory"]}


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_worker_lost_while_the_recovery_runs_is_replaced_by_its_next_attempt(
        llm, prompts, hf_greedy, monkeypatch, fault):
    """The compute worker killed mid-decode, then memory worker 1 lost while the
    recovery runs (reset and kept, not yet wired): killed, or stopped (SIGSTOP: the
    wiring's call to it times out after a live worker's bound, `ping_timeout_s`, 5 s
    here, not a worker's start, 150 s). The recovery's first attempt fails on it, the
    next one replaces it, its pool's KV is not counted as kept, and the requests still
    end with HF's greedy tokens. Before, the engine stopped ("recovery failed"): a
    second failure during a recovery took the deployment down (a stopped worker after
    150 s, said to be "no room")."""
    eng, ex, pick = llm.engine, llm.executor, [2, 7]
    real, starts, stopped = ex._start_memory, [], []
    monkeypatch.setattr(ex, "health_timeout_s", 3.0)  # the stopped worker's reset wait
    monkeypatch.setattr(ex, "ping_timeout_s", 5.0)

    def start(kept=frozenset()):
        starts.append(kept)
        if len(starts) > 1:
            return real(kept)
        if fault == "kill":  # the first attempt: memory worker 1 dies now
            ray.kill(ex.memory[1])
            with pytest.raises(ray.exceptions.RayActorError):
                while True:  # the kill is asynchronous: until it no longer answers
                    ray.get(ex.memory[1].ping.remote(), timeout=30)
            return real(kept)
        stopped.append(ex.memory_info[1]["pid"])
        os.kill(stopped[0], signal.SIGSTOP)
        return real(kept)

    monkeypatch.setattr(ex, "_start_memory", start)
    before, replaced = len(eng.recoveries), ex.workers_replaced()
    ids = [eng.add_request(prompts[i], GREEDY) for i in pick]
    for _ in range(3):
        eng.step()
    ray.kill(ex.compute)
    out, t = {}, time.monotonic()
    try:
        while eng.has_unfinished():
            for o in eng.step():
                out[o.request_id] = o
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass  # replaced: killed
    assert [out[i].token_ids for i in ids] == [hf_greedy[i] for i in pick]
    assert time.monotonic() - t < 5 + 3 + 40  # the two waits, the new workers' start
    assert len(eng.recoveries) == before + 1
    assert starts == [frozenset({0, 1}), frozenset({0})] and ex.kv_kept() == frozenset({0})
    assert ex.workers_replaced() == {"compute": replaced["compute"] + 1,
                                     "memory": replaced["memory"] + 1}


def _stuck(worker) -> None:
    """A serving thread that does not end (as one stuck inside a step would)."""
    def plant(w):
        w.unstick = threading.Event()
        t = threading.Thread(target=w.unstick.wait, args=(60,), daemon=True)
        t.start()
        w._threads.append(t)
    ray.get(worker.__ray_call__.remote(plant))


def test_a_memory_worker_resets_for_reuse_unless_a_connection_is_stuck(llm):
    """`MemoryWorker.reset`: endpoints nobody connected to are closed at once (their
    socket files and shared-memory rings gone) and it answers ready; a serving thread
    still running past the timeout makes it answer False (recovery then replaces it)."""
    from lamina.cluster.memory_worker import MemoryWorker
    from lamina.dataplane.transport import connect_stream
    from lamina.kernels import AttentionParams
    from lamina.memory.pool import KVPoolConfig

    w = MemoryWorker.options(num_cpus=0).remote(7)
    ray.get(w.setup.remote(KVPoolConfig(2, 16, 2, 4), [AttentionParams(0.5)] * 2))
    unix, tcp, shm = ray.get([w.listen.remote(k) for k in ("unix", "tcp", "unix+shm")])
    rings = shm[2:4] if len(shm) == 5 else ()  # (none where shared memory is off)
    assert all(os.path.exists(r) for r in rings)
    t = time.monotonic()
    assert ray.get(w.reset.remote(5.0)) is True
    assert time.monotonic() - t < 2  # the waiting accepts woke at once
    assert not any(os.path.exists(p) for p in (unix[1], shm[1], *rings))
    for kind, where in (("unix", unix[1]), ("tcp", tcp[1:])):
        with pytest.raises(OSError):
            connect_stream(kind, where).recv(1)  # refused, or closed at once
    assert ray.get(w.__ray_call__.remote(
        lambda s: (s._threads, s._listening, s._connections, s.servers))) == ([], [], 0, [])
    _stuck(w)
    assert ray.get(w.reset.remote(0.3)) is False
    ray.get(w.__ray_call__.remote(lambda s: s.unstick.set()))
    assert ray.get(w.reset.remote(5.0)) is True
    ray.kill(w)


def test_recovery_replaces_only_a_memory_worker_stuck_in_its_step(llm, prompts, hf_greedy,
                                                                  monkeypatch):
    ex, eng = llm.executor, llm.engine
    monkeypatch.setattr(ex, "health_timeout_s", 1.0)  # the stuck one's reset: 0.5 s
    pids = [i["pid"] for i in ex.memory_info]
    _stuck(ex.memory[0])
    assert ex.recover(RuntimeError("a drill")) is True
    now = [i["pid"] for i in ex.memory_info]
    assert now[0] != pids[0] and now[1] == pids[1]
    eng.clear_prefix_cache()  # (what the engine's own recovery does)
    out = llm.generate([prompts[3], prompts[8]], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in out] == [hf_greedy[3], hf_greedy[8]]


def run_with_stopped(eng, pid: int) -> dict:
    """SIGSTOP a worker process (alive, silent), run the engine to the end, SIGCONT it
    (if its replacement did not kill it). -> {request id: output}."""
    os.kill(pid, signal.SIGSTOP)
    try:
        out = {}
        while eng.has_unfinished():
            for o in eng.step():
                out[o.request_id] = o
        return out
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_hung_compute_worker_times_out_and_is_replaced(llm, prompts, hf_greedy):
    """A compute worker that stops answering (SIGSTOP) fails the step after the step
    timeout; the engine replaces it and the requests still end with HF's tokens."""
    eng, pick = llm.engine, [4, 11]
    ex = llm.executor
    ex.control.channel.set_timeout(3.0)  # EngineConfig.step_timeout_s for this one step
    ex.ping_timeout_s = 3.0  # then recovery's ping finds it hung (default 30 s)
    before = len(eng.recoveries)
    ids = [eng.add_request(prompts[i], GREEDY) for i in pick]
    eng.step()
    pid = ray.get(ex.compute.__ray_call__.remote(lambda _: os.getpid()))
    out = run_with_stopped(eng, pid)
    assert [out[i].token_ids for i in ids] == [hf_greedy[i] for i in pick]
    assert len(eng.recoveries) == before + 1
    assert "PeerTimeout" in eng.recoveries[-1] and "within 3 s" in eng.recoveries[-1]
    assert ray.get(ex.compute.__ray_call__.remote(lambda _: os.getpid())) != pid
    assert ex.control.channel.sock.gettimeout() == eng.config.step_timeout_s  # reopened


def test_hung_memory_worker_times_out_and_is_replaced(llm, prompts, hf_greedy, monkeypatch,
                                                     caplog):
    """A memory worker that stops answering (SIGSTOP: alive, silent) fails the step after
    the worker timeout instead of blocking forever; it is then replaced like a dead one,
    without the recovery waiting on it again (it gave no health answer)."""
    eng, pick = llm.engine, [1, 6]
    llm.executor.set_worker_timeout(3.0)
    # how long the stopped worker's health answer is awaited (default 10 s)
    monkeypatch.setattr(llm.executor, "health_timeout_s", 2.0)
    before = len(eng.recoveries)
    ids = [eng.add_request(prompts[i], GREEDY) for i in pick]
    eng.step()
    hung, live = (i["pid"] for i in llm.executor.memory_info)
    out = run_with_stopped(eng, hung)
    assert [out[i].token_ids for i in ids] == [hf_greedy[i] for i in pick]
    assert len(eng.recoveries) == before + 1
    assert "PeerTimeout" in eng.recoveries[-1] and "within 3 s" in eng.recoveries[-1]
    assert "memory worker 0 unreachable: no health answer" in eng.recoveries[-1]
    assert "memory worker 0 not reusable (no health answer after the failed step)" \
        in caplog.text
    assert [i["pid"] for i in llm.executor.memory_info][1:] == [live]  # only it replaced
    assert hung not in {i["pid"] for i in llm.executor.memory_info}


def test_a_second_ctrl_c_mid_step_resets_the_workers_and_the_engine_serves_on(
        llm, prompts, hf_greedy, monkeypatch):
    """Two Ctrl-Cs while the compute worker runs a prefill: the first is held to the
    step's end (`StepBoundary`), the second cuts the driver's wait on the worker. The
    engine resets the workers and itself (tests/lamina/test_interrupt.py): no request
    is left, every slot is free, and the next call gives HF's tokens."""
    assert threading.current_thread() is threading.main_thread()
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's own
    eng, ex = llm.engine, llm.executor
    eng.clear_prefix_cache()
    recoveries, call = eng.num_recoveries, ex._call

    def calling(r, plan):
        if plan.step == first:  # two Ctrl-Cs, apart (a second one pending is no second)
            for at in (0.05, 0.1):
                threading.Timer(at, os.kill, (os.getpid(), signal.SIGINT)).start()
        return call(r, plan)

    first = eng.scheduler.step
    monkeypatch.setattr(ex, "_call", calling)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate([prompts[8], prompts[7], prompts[6]], GREEDY, use_tqdm=False)
    finally:
        monkeypatch.undo()
        signal.signal(signal.SIGINT, handler)
    assert eng.num_recoveries == recoveries + 1
    assert eng.recoveries[-1] == "a step cut part-way (KeyboardInterrupt)"
    assert eng.request_ids() == set() and not eng.has_unfinished()
    assert eng.free_slots() == [4096, 4096]
    outs = llm.generate([prompts[8], prompts[5]], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy[8], hf_greedy[5]]


def test_ray_sessions_come_back_from_the_tiers_and_a_bad_file_is_recomputed(llm, smol):
    """Two sessions' first turns: A is demoted to a disk file on its memory worker when B
    is saved (the host tier holds one). The file is corrupted; with the prefix cache
    cleared, B's second turn loads from the host tier, A's misses (asked before the step
    is sent) and is computed; both equal HF greedy."""
    import glob
    import time

    tok, eng = smol.tokenizer, llm.engine
    eng.clear_prefix_cache()
    first = [tok(f"Session {s}: tell me something about the number {s}.")["input_ids"]
             for s in "AB"]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = [llm.generate([p], params, use_tqdm=False, session_id=s)[0]
            for p, s in zip(first, "AB")]
    llm.generate([[1, 2, 3]], params, use_tqdm=False)  # a step carries B's save, A's demotion
    deadline = time.monotonic() + 20
    while not (files := glob.glob(str(llm.disk_dir / "lamina-kv-*" / "w*" / "e*.kv"))):
        assert time.monotonic() < deadline, "A's KV never reached the disk tier"
        time.sleep(0.1)
    assert len(files) == 1
    data = bytearray(open(files[0], "rb").read())
    data[-10] ^= 0xFF
    open(files[0], "wb").write(bytes(data))
    eng.clear_prefix_cache()
    second = [p + o.token_ids + tok(" Why?", add_special_tokens=False)["input_ids"]
              for p, o in zip(first, outs)]
    before = dict(eng.tier_stats())
    got = llm.generate(second, params, use_tqdm=False, session_id=["A", "B"])
    after = eng.tier_stats()
    assert [o.token_ids for o in got] == hf_greedy_of(smol, second, 8)
    # B: its first turn but the last answer token (whose KV no step wrote)
    assert [o.metrics["tier_cached_tokens"] for o in got] == [0, len(first[1]) + 7]
    assert after["tier_misses"] - before["tier_misses"] == 1


def test_dead_memory_worker_fails_the_step_loudly(llm, prompts):
    """With recovery off (the last test here: it leaves the engine without workers)."""
    eng = llm.engine
    eng.config = replace(eng.config, max_recoveries=0)
    eng.clear_prefix_cache()  # placement by free slots alone: one request on each worker
    eng.add_request(prompts[0], GREEDY)
    eng.add_request(prompts[1], GREEDY)
    eng.step()
    ray.kill(llm.executor.memory[1])
    with pytest.raises(WorkerFailure, match="step .* failed"):
        for _ in range(3):
            eng.step()


def test_ray_int8_pools_and_sparsity_answer_as_local(llm, prompts, hf_greedy):
    """kv_dtype='int8' with an h2o budget of 48 tokens on Ray: the compute worker
    calibrates the key channel scales (on the text the local executor uses), the memory
    workers store int8 rows; prompts attend on the memory workers (local_prefill is
    turned off: h2o scores a prompt's keys where they are stored) and decode rows attend
    to h2o's selection there, and the slots of the keys it left out at every layer are
    given back: greedy answers equal the local executor's keeping every slot. Last
    here on the module's deployment: it goes first, to free its CPUs."""
    llm.shutdown()
    batch = [prompts[i] for i in (1, 4, 8)]  # 12, 200, 600 tokens: one under the budget
    params = SamplingParams(max_tokens=12, temperature=0)
    kw = dict(num_kv_slots=2048, kv_dtype="int8", kv_sparsity="h2o", kv_budget=48)
    local = LLM(kv_evict=False, **kw)
    want = [o.token_ids for o in local.generate(batch, params, use_tqdm=False)]
    local.shutdown()
    hf = [hf_greedy[i][:12] for i in (1, 4, 8)]
    assert want[0] == hf[0] and want[1] != hf[1] and want[2] != hf[2]  # the long ones cut
    ray_llm = LLM(executor="ray", num_memory_workers=1, **kw)
    try:
        assert ray_llm.executor.pool_config.dtype == "int8"
        assert ray_llm.executor.pool_config.key_scales == local.executor.memory[0].pool \
            .config.key_scales
        eng = ray_llm.engine
        ids = [eng.add_request(p, params) for p in batch]
        done, holes = {}, 0
        while eng.has_unfinished():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
            holes = max([holes] + [eng.alloc.slots(q.seq_id).count(-1)
                                   for q in eng.scheduler.running])
        got = [done[i].token_ids for i in ids]
    finally:
        ray_llm.shutdown()
    assert got == want
    assert holes >= 64  # the 600-token prompt's keys gone at every layer: given back


def test_shutdown_fails_the_call_in_flight_and_later_calls_at_once(prompts):
    """`LLM.shutdown()` while another thread's `generate` runs: that call raises within
    seconds, its request aborted; later calls, the engine's own `add_request` and `step`,
    and its executor's `recover` raise `EngineDead` at once. Before, a step after the
    shutdown went on to recover the workers, to start new ones on the removed placement
    group: still waiting after 300 s. A deployment of its own (the module's is shut by
    the test before)."""
    llm = LLM(executor="ray", num_memory_workers=1, num_kv_slots=2048)
    eng, got = llm.engine, {}
    thread = generate_in(llm, [prompts[8]], got, "call",
                         params=SamplingParams(max_tokens=400, ignore_eos=True))
    wait_until(lambda: eng.scheduler.step >= 4, thread, got)  # its prompt in, decoding
    t = time.monotonic()
    llm.shutdown()
    thread.join(60)
    assert not thread.is_alive() and time.monotonic() - t < 30
    assert isinstance(got["call"], (EngineDead, WorkerFailure)), got
    assert eng.request_ids() == set()
    with pytest.raises(EngineDead, match=r"this LLM was shut down \(LLM.shutdown\(\)\)"):
        llm.generate([prompts[1]], GREEDY, use_tqdm=False)
    with pytest.raises(EngineDead, match=r"this LLM was shut down \(LLM.shutdown\(\)\)"):
        eng.add_request(prompts[1], GREEDY)
    with pytest.raises(EngineDead, match=r"this LLM was shut down \(LLM.shutdown\(\)\)"):
        eng.step()
    with pytest.raises(EngineDead, match="the Ray executor was shut down"):
        llm.executor.recover(RuntimeError("a step after the shutdown"))  # nothing started
    assert time.monotonic() - t < 30
