"""Random workloads on a Ray deployment (`tests/cluster/ray_workload.py`), its workers
killed and hung mid-run: every request that completed answers as it does alone on a
local engine, each one carrying a fault fails alone, every KV slot is free after, and
the deployment answers on. The seeds were chosen from those `python -m
tests.cluster.ray_workload 0 180` runs to cover what the generator draws; each must
still fire the worker events it is kept for (while requests ran). Workers that die or
hang while the engine is idle are found by its idle check; one that hangs before a step
is sent (asked whether it holds a session's saved KV) fails that step in bounded time."""
import os
import signal
import time
from dataclasses import replace

import pytest
import ray

from lamina import SamplingParams
from lamina.engine.engine import LLMEngine
from lamina.entrypoints.engine_loop import EngineLoop
from tests.cluster import keep_ray_for_the_next_module
from tests.cluster.ray_workload import check, deployment, features, workload
from tests.conftest import HF_NEW, hf_greedy_of
from tests.lamina.random_workload import Ask, run
from tests.lamina.test_scaling import Stepper

GREEDY = SamplingParams(max_tokens=HF_NEW, temperature=0)

SEEDS = {  # seed: (what it draws at least, the worker events that must fire); the note
    23: ({"layer-poison", "memory-poison", "poison", "session", "structured"},
         {"kill-compute"}, "failed before 126cdac: the culprit search named a request "
                           "whose step alone lost the compute worker to the kill"),
    81: ({"preempts", "session", "tiers"}, {"kill-compute", "kill-memory"}, ""),
    87: ({"layer-poison", "memory-poison", "poison", "drafts", "chunks", "session"},
         {"stop-memory"}, ""),
}


@pytest.fixture(scope="module")
def llm():
    llm = deployment()
    yield llm
    llm.shutdown()
    keep_ray_for_the_next_module()


def killed(worker) -> None:
    """`ray.kill` the worker, and wait until it is gone (the kill is asynchronous: a call
    sent right after may still be answered)."""
    ray.kill(worker)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(worker.ping.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError("a killed worker still answers after 30 s")


@pytest.mark.parametrize("seed", sorted(SEEDS))
def test_random_workload_on_ray_answers_as_each_request_alone(llm, smol, smol_packed, seed):
    drawn, fire, _ = SEEDS[seed]
    assert drawn <= features(workload(seed, smol))
    got = check(seed, llm, smol, smol_packed)
    assert got.problems == ()
    assert fire <= set(got.fired) and got.recoveries > 0


def test_idle_workers_dead_or_hung_are_replaced_before_a_request_needs_them(
        llm, prompts, hf_greedy):
    """With no request in the engine: a killed memory worker and a stopped (SIGSTOP)
    compute worker are found by `check_workers` and replaced then (the stopped one
    without a second wait on it); the next requests run with no step failing. Through
    the serving loop too: a killed worker is replaced within its idle check."""
    ex = llm.executor
    ex.recover(RuntimeError("a new test"))
    eng = LLMEngine(replace(llm.config, idle_check_s=0.5), ex, llm.loaded.tokenizer,
                    llm.loaded.config)
    ex.health_timeout_s, ex.ping_timeout_s = 3.0, 30.0
    assert eng.check_workers() is None and eng.num_recoveries == 0
    pids, replaced = [i["pid"] for i in ex.memory_info], ex.workers_replaced()
    killed(ex.memory[1])
    assert "memory worker 1: ActorDiedError" in eng.check_workers()
    assert ex.workers_replaced()["memory"] == replaced["memory"] + 1
    now = [i["pid"] for i in ex.memory_info]
    assert now[0] == pids[0] and now[1] != pids[1]
    pid = ray.get(ex.compute.ping.remote())
    os.kill(pid, signal.SIGSTOP)
    try:
        t = time.monotonic()
        assert "compute worker 0: no answer within 3 s" in eng.check_workers()
        assert time.monotonic() - t < 3.0 + 20  # its start, not the 30 s reset wait
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert ray.get(ex.compute.ping.remote()) != pid and eng.num_recoveries == 2
    outs, _ = run(eng, [Ask(0, prompts[i], GREEDY, 0, None, None, False) for i in (2, 5)])
    assert [outs[k].outputs[0].token_ids for k in (0, 1)] == [hf_greedy[2], hf_greedy[5]]
    assert eng.num_recoveries == 2  # no step failed
    loop = EngineLoop(eng)
    try:
        ray.kill(ex.memory[0])
        deadline = time.monotonic() + 30
        while eng.num_recoveries == 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert eng.num_recoveries == 3 and "memory worker 0" in eng.recoveries[-1]
        assert loop.generate(prompts[3], GREEDY, timeout=120).token_ids == hf_greedy[3]
        assert eng.num_recoveries == 3
    finally:
        loop.shutdown()


def test_a_memory_worker_hung_at_the_tier_check_fails_the_step_in_bounded_time(
        llm, smol, monkeypatch):
    """A session's second turn needs its saved KV from a memory worker that hangs
    (SIGSTOP) before the step: the check asked before the step is sent gets no answer
    within `worker_timeout_s` (the allowance for a disk read, 60 s, set to 0 here), the
    step fails naming the worker, which is replaced without a second wait, and the turn
    is computed instead: HF's greedy tokens."""
    monkeypatch.setattr("lamina.cluster.executor.PREFETCH_WAIT_S", 0.0, raising=False)
    ex, tok = llm.executor, smol.tokenizer
    ex.recover(RuntimeError("a new test"))
    eng = LLMEngine(replace(llm.config, idle_check_s=None), ex, llm.loaded.tokenizer,
                    llm.loaded.config)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = tok("Session S: tell me something about the number seven.")["input_ids"]
    outs, _ = run(eng, [Ask(0, first, params, 0, None, "s", False)])
    run(eng, [Ask(0, [1, 2, 3], params, 0, None, None, False)])  # a step carries the save
    eng.clear_prefix_cache()
    w = eng.sessions.sessions["s"].worker
    second = first + outs[0].outputs[0].token_ids + tok(" Why?", add_special_tokens=False)[
        "input_ids"]
    pid = ex.memory_info[w]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        t = time.monotonic()
        got, _ = run(eng, [Ask(0, second, params, 0, None, "s", False)])
        took = time.monotonic() - t
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # replaced: killed
    assert (f"memory workers [{w}] gave no answer to the tier check within 8 s"
            in eng.recoveries[-1]) and eng.num_recoveries == 1
    assert took < 8 + 30  # the check's timeout and a new worker's start
    assert ex.memory_info[w]["pid"] != pid
    assert got[0].metrics["tier_cached_tokens"] == 0
    assert [got[0].outputs[0].token_ids] == hf_greedy_of(smol, [second], 8)


def _slow_tiers(worker, delay_s: float) -> None:
    """On a memory worker (`__ray_call__`): its data plane waits `delay_s` before it
    carries out a step's tier orders, as a loaded machine's thread may (0: as it was)."""
    for server in worker.servers:
        server.__dict__.pop("_apply_tiers", None)
        if delay_s:
            plain = server._apply_tiers
            server._apply_tiers = lambda step, plain=plain: (time.sleep(delay_s), plain(step))


def test_a_save_sent_to_a_worker_with_no_rows_is_done_when_the_step_returns(llm, smol):
    """A finished turn's save goes to its memory worker with the next step; in a step
    where that worker has no rows its frames get no answer, so the step could return
    before the worker saved, and a call right after (a scale-down's move, the next
    turn's tier check) find nothing (CI saw a shrink move no session so, once in four
    runs). With the workers' data planes made slow to carry out tier orders (0.5 s),
    the entry is in the worker's tier, whole, once a step with no rows carrying the
    save has returned."""
    ex, tok = llm.executor, smol.tokenizer
    ex.recover(RuntimeError("a new test"))
    eng = LLMEngine(replace(llm.config, idle_check_s=None), ex, llm.loaded.tokenizer,
                    llm.loaded.config)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ray.get([w.__ray_call__.remote(_slow_tiers, 0.5) for w in ex.memory])
    try:
        run(eng, [Ask(0, tok("Name a river.")["input_ids"], params, 0, None, "s", False)])
        entry = eng.sessions.sessions["s"]
        assert eng.scheduler.owes_workers()  # the save rides the next step
        assert eng.flush()
        got = ray.get(ex.memory[entry.worker].export_tiers.remote([entry.id]))
    finally:
        ray.get([w.__ray_call__.remote(_slow_tiers, 0) for w in ex.memory])
    assert list(got) == [entry.id] and got[entry.id].n == len(entry.tokens)
    assert eng.num_recoveries == 0


def test_preempted_sequences_swap_to_the_workers_host_tiers(llm, prompts, hf_greedy):
    """Six prompts (12-128 tokens, 32 new each) in 125 slots on each of the two memory
    workers, their KV split over both as they grow: growth preempts sequences. With
    swap (the default with a host tier) each preempted one's KV is saved, each
    worker's part to that worker's host tier, in the step's frames, and loaded back
    onto its workers at its readmission: later workers' parts among them, once after a
    gap computed first (`Skip`: the data plane's held tables then grow from before the
    positions fed). The tokens are HF's greedy ones either way, swap computes fewer
    positions again than recompute, the bytes the workers saved and loaded are the
    positions parked and loaded, and no slot or entry is left."""
    ex, pick, recomputed = llm.executor, [1, 3, 4, 10, 11, 12], {}
    per_token = ex.tier_bytes_per_token()
    for mode in ("recompute", "auto"):
        ex.recover(RuntimeError("a new test"))
        eng = LLMEngine(replace(llm.config, num_kv_slots=125, idle_check_s=None,
                                preemption_mode=mode), ex, llm.loaded.tokenizer,
                        llm.loaded.config)
        time.sleep(1.1)  # the executor asks the workers' traffic at most once a second
        before = ex.tier_traffic()
        loaded, plans = [], []
        load, schedule = eng.sessions.load, eng.scheduler.schedule
        eng.sessions.load = lambda key, *a: (loaded.append(key), load(key, *a))[1]
        eng.scheduler.schedule = lambda: (plans.append(schedule()), plans[-1])[1]
        outs, _ = run(eng, [Ask(0, prompts[i], GREEDY, 0, None, None, False) for i in pick])
        skips = [w for p in plans for w in p.seqs if 0 < w.slots_from < w.start_pos]
        assert bool(skips) is any("@" in key for key in loaded) is (mode == "auto")
        assert [outs[k].outputs[0].token_ids for k in range(len(pick))] == [
            hf_greedy[i] for i in pick]
        assert sum(o.metrics["preemptions"] for o in outs.values()) >= 3
        recomputed[mode] = sum(o.metrics["recomputed_tokens"] for o in outs.values())
        assert eng.flush()  # idle: a step with no rows carries the drops
        time.sleep(1.1)
        st = eng.tier_stats()
        assert st["saved_bytes"] - before["saved_bytes"] == st["parked_tokens"] * per_token
        assert st["loaded_bytes"] - before["loaded_bytes"] == \
            st["tier_hit_tokens"] * per_token
        assert (st["parked_tokens"] > 50 and st["tier_hit_tokens"] > 0) is (mode == "auto")
        assert eng.free_slots() == [125, 125] and eng.sessions.sessions == {}
        assert eng.num_recoveries == 0
    assert recomputed["auto"] < recomputed["recompute"], recomputed


def test_memory_workers_join_and_leave_a_deployment_while_it_generates(llm, smol, prompts,
                                                                      hf_greedy):
    """Six prompts in 125 slots on each of the deployment's two memory workers. After
    6 steps a third joins (a placement group of its own; wired while the others stay
    connected: their processes and pools are the same), new and growing sequences take
    its slots; 10 steps later it leaves, the sequences with KV on it preempted and
    computed again where the kept pools lack room; its group is removed; with pools of
    room, they move their KV and go on. Then through `LLM`: down to one worker (the
    other's group removed: its room given back) and up to two again (a new group), a
    session's saved KV moved off a leaving worker and loaded by its next turn. Every
    request gives HF's greedy tokens, no step fails, every slot ends free."""
    ex, pick = llm.executor, [1, 3, 4, 10, 11, 12]
    ex.recover(RuntimeError("a new test"))
    eng = LLMEngine(replace(llm.config, num_kv_slots=125, idle_check_s=None), ex,
                    llm.loaded.tokenizer, llm.loaded.config)
    pids = [i["pid"] for i in ex.memory_info]
    batch = Stepper(eng, [prompts[i] for i in pick], GREEDY)
    steps = batch.steps
    steps(6)
    grown = eng.scale_memory_workers(3)
    assert (grown.before, grown.after) == (2, 3) and len(ex.memory) == 3
    homes = [h.group.id.hex() for h in ex._homes[:2]]
    assert [i["pid"] for i in ex.memory_info[:2]] == pids
    group = ex._homes[2].group.id.hex()
    assert ray.util.placement_group_table()[group]["state"] == "CREATED"
    steps(10)
    on_leaving = [s for s in eng.scheduler.running if 2 in s.workers]
    assert on_leaving
    shrunk = eng.scale_memory_workers(2)
    assert shrunk.preempted > 0 and len(ex.memory) == len(ex.transports) == 2
    assert shrunk.preempted + shrunk.relocated == len(on_leaving)
    assert [h.group.id.hex() for h in ex._homes] == homes
    assert ray.util.placement_group_table()[group]["state"] == "REMOVED"
    assert batch.run_out() == [hf_greedy[i] for i in pick]
    assert eng.num_recoveries == 0 and eng.free_slots() == [125, 125]
    assert [i["pid"] for i in ex.memory_info] == pids
    # through LLM, whose engine takes its turn between generate's steps: a session's KV
    # saved on a worker that then leaves is moved to a kept one (worker to worker, by
    # Ray's object store) and its next turn loads it from there
    four = SamplingParams(max_tokens=4, temperature=0)
    assert llm.scale_memory_workers(3).after == 3
    llm.engine.clear_prefix_cache()
    tok = llm.loaded.tokenizer
    asks = [tok(t)["input_ids"] for t in ("Name three rivers.", "What is a prime number?",
                                          "Describe the moon briefly.")]
    firsts = llm.generate(asks, four, session_id=["s0", "s1", "moving"], use_tqdm=False)
    # admitted in one step, each on the worker with the most free slots then
    assert [llm.engine.sessions.sessions[s].worker for s in ("s0", "s1", "moving")] == [0, 1, 2]
    hist = asks[2] + firsts[2].outputs[0].token_ids
    moved = llm.scale_memory_workers(2)
    assert (moved.preempted, moved.moved_tokens) == (0, len(hist) - 1)
    assert llm.engine.sessions.sessions["moving"].worker in (0, 1)
    nxt = hist + tok(" And the sun?")["input_ids"]
    llm.engine.clear_prefix_cache()
    again = llm.generate([nxt], four, session_id="moving", use_tqdm=False)[0]
    assert again.metrics["tier_cached_tokens"] == len(hist) - 1
    assert again.outputs[0].token_ids == hf_greedy_of(smol, [nxt], 4)[0]
    assert llm.scale_memory_workers(1).after == 1 and llm.config.num_memory_workers == 1
    assert ray.util.placement_group_table()[homes[1]]["state"] == "REMOVED"
    outs = llm.generate([prompts[1]], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == hf_greedy[1]
    assert llm.scale_memory_workers(2).after == 2
    assert [h.group.id.hex() in homes for h in ex._homes] == [True, False]
    assert ex.memory_info[1]["pid"] != pids[1]
    outs = llm.generate([prompts[i] for i in pick], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy[i] for i in pick]
    assert llm.engine.num_recoveries == 0
    # pools with room: the running sequences on the leaving worker move their KV into
    # the kept ones (worker to worker, by Ray's object store) and go on, none preempted
    # (an engine of its own on the workers, made as new first, as `eng` above)
    ex.recover(RuntimeError("another engine"))
    roomy = LLMEngine(replace(llm.config, num_kv_slots=600, idle_check_s=None), ex,
                      llm.loaded.tokenizer, llm.loaded.config)
    assert roomy.scale_memory_workers(3).after == 3
    batch = Stepper(roomy, [prompts[i] for i in pick], GREEDY)
    batch.steps(6)
    on_leaving = [s for s in roomy.scheduler.running if 2 in s.workers]
    assert on_leaving
    moved = roomy.scale_memory_workers(2)
    assert (moved.preempted, moved.recompute_tokens, moved.relocated) == (0, 0, len(on_leaving))
    assert batch.run_out() == [hf_greedy[i] for i in pick]
    assert all(batch.done[i].metrics["preemptions"] == 0 for i in batch.ids)
    assert roomy.num_recoveries == 0 and roomy.free_slots() == [600, 600]


def _busy(worker, seconds: float) -> None:
    """On a memory worker (`__ray_call__`): its actor thread busy for `seconds` (the
    calls sent to it after wait; its data plane serves steps all the same)."""
    time.sleep(seconds)


def test_a_kv_move_a_kept_worker_takes_too_late_preempts_and_is_not_written(
        llm, prompts, hf_greedy):
    """A shrink whose KV moves the kept workers take too late (their actor threads busy
    past the move's bound: `worker_timeout_s`, 1 s here, + `MOVE_MARGIN_S`): the move is
    given up, the sequences it held preempted and computed again, those workers marked
    silent; when they get to the writes they refuse them (past their deadline: the
    slots are others' by then). Every request gives HF's greedy tokens."""
    from lamina.cluster.executor import MOVE_MARGIN_S

    ex, pick = llm.executor, [1, 3, 4, 10, 11, 12]
    ex.recover(RuntimeError("a new test"))
    eng = LLMEngine(replace(llm.config, num_kv_slots=600, idle_check_s=None, kv_host_bytes=0),
                    ex, llm.loaded.tokenizer, llm.loaded.config)
    assert eng.scale_memory_workers(3).after == 3
    batch = Stepper(eng, [prompts[i] for i in pick], GREEDY)
    batch.steps(6)
    on_leaving = [s for s in eng.scheduler.running if 2 in s.workers]
    assert on_leaving
    before = ray.get([w.health.remote() for w in ex.memory[:2]])
    timeout = ex.config.worker_timeout_s
    ex.set_worker_timeout(1.0)
    try:
        busy = [w.__ray_call__.remote(_busy, 1.0 + MOVE_MARGIN_S + 2.0) for w in ex.memory[:2]]
        t = time.monotonic()
        shrunk = eng.scale_memory_workers(2)
        assert time.monotonic() - t >= 1.0 + MOVE_MARGIN_S
    finally:
        ex.set_worker_timeout(timeout)
    assert (shrunk.relocated, shrunk.preempted) == (0, len(on_leaving))
    assert ex._silent and ex._silent <= {0, 1}
    ray.get(busy)
    after = ray.get([w.health.remote() for w in ex.memory[:2]])
    refused = [a["moves_refused"] - b["moves_refused"] for a, b in zip(after, before)]
    assert [w for w in (0, 1) if refused[w]] == sorted(ex._silent)
    ex._silent = frozenset()
    assert batch.run_out() == [hf_greedy[i] for i in pick]
    assert eng.num_recoveries == 0 and eng.free_slots() == [600, 600]
