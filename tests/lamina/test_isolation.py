"""One bad request fails alone (local executor, SmolLM2): for each way a request can
fail inside a step (bad token data past validation, an exception in the compute side's
handling of one sequence, in the sampler, in a memory side's), that request ends with
finish reason "error" and a message naming the problem, every other request gives HF's
greedy tokens, and the allocators' free counts return to their start. The Ray path is
in tests/cluster/test_ray_isolation.py, HTTP in test_server_limits.py."""
import math
from dataclasses import replace

import pytest

import lamina.compute.compute_side as executor_mod
from lamina.engine.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.entrypoints.engine_loop import EngineLoop
from lamina.errors import RequestFailed, SequenceFault
from lamina.executor.local import LocalExecutor
from lamina.faults import FaultPlan, InjectedFault
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.sampling.params import SamplingParams
from tests.conftest import SHORT_NEW, hf_greedy_of

NEW = SHORT_NEW  # tokens drawn per good request (a prefix of HF's reference)
GOOD = SamplingParams(max_tokens=NEW, temperature=0)
SLOTS = 3000
MEM_POS = 700  # past every good request's last position (600 + 12)


def engine(smol, split, faults=None, workers=2, slots=SLOTS, caching=True, replicas=1,
           step_tokens=2048):
    """`replicas` > 1: that many compute replicas under the fixed schedule."""
    rep = dict(num_compute_workers=replicas, pipeline="fixed") if replicas > 1 else {}
    cfg = EngineConfig(num_kv_slots=slots, num_memory_workers=workers,
                       max_step_tokens=step_tokens,
                       faults=faults, prefix_caching=caching, **rep)
    mems = [MemorySide(KVPool(KVPoolConfig.for_specs(split.attention_specs, slots)))
            for _ in range(workers)]
    ex = LocalExecutor(split, mems, vocab_size=smol.config.vocab_size, faults=faults,
                       num_compute_workers=replicas)
    return LLMEngine(cfg, ex, smol.tokenizer, smol.config)


def unused_token(prompts, hf_greedy, nth: int = 0) -> int:
    """A token id no good request feeds (prompt or drawn); `nth` > 0: another one."""
    seen = {t for p in prompts for t in p} | {t for r in hf_greedy for t in r}
    return sorted(set(range(1000, 2000)) - seen)[-1 - nth]


# the good requests around a poison one: 4 of 5-600 tokens before it, 4 short ones after
# (the mechanism needs requests in flight on both sides, not all 16 prompts' prefill)
BEFORE, AFTER = (0, 3, 5, 8), (9, 10, 11, 12)
AROUND = BEFORE + AFTER


def around(refs: list) -> list:
    """`refs` (one per prompt) of the requests `poison_run` sends, in its order."""
    return [refs[i] for i in AROUND]


def poison_run(eng, prompts, add_poison):
    """4 good requests, a few steps, the poison one, 4 more good ones (`AROUND`); ->
    (outputs by request id, good ids in `AROUND`'s order, poison id)."""
    free0 = eng.free_slots()
    ids = [eng.add_request(prompts[i], GOOD) for i in BEFORE]
    outs = {}
    for _ in range(2):
        outs.update({o.request_id: o for o in eng.step()})
    bad = add_poison(eng)
    ids += [eng.add_request(prompts[i], GOOD) for i in AFTER]
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    assert eng.free_slots() == free0  # every slot back
    assert all(a.stats().shared == 0 for a in eng.allocs)
    assert not eng.scheduler.running and not eng.scheduler.waiting
    return outs, ids, bad


def check(outs, ids, bad, want, words):
    """`want`: HF's tokens for `ids`, in their order."""
    assert [outs[i].token_ids for i in ids] == [r[:NEW] for r in want]
    assert all(outs[i].error is None for i in ids)
    b = outs[bad]
    assert b.finish_reason == "error" and b.error is not None
    assert f"request {bad} failed" in b.error and words in b.error, b.error


def test_bad_token_past_validation_fails_alone(smol, smol_packed, prompts, hf_greedy):
    eng = engine(smol, smol_packed)
    vocab = smol.config.vocab_size

    def poison(e):  # the test hook: skip the boundary check for this one request
        real = e.validate
        e.validate = lambda p, params: list(p)
        try:
            return e.add_request([5, 6, vocab + 7], GOOD)
        finally:
            e.validate = real

    outs, ids, bad = poison_run(eng, prompts, poison)
    check(outs, ids, bad, around(hf_greedy), f"outside the vocabulary of {vocab}")
    assert eng.num_failed_requests == 1 and not eng.recoveries


def test_compute_fault_on_one_sequence_fails_alone(smol, smol_packed, prompts, hf_greedy):
    tok = unused_token(prompts, hf_greedy)
    eng = engine(smol, smol_packed, FaultPlan(compute_token=tok))
    outs, ids, bad = poison_run(eng, prompts,
                                lambda e: e.add_request([1, 2, tok, 3], GOOD))
    check(outs, ids, bad, around(hf_greedy), f"injected compute fault on token {tok}")


def test_memory_fault_on_one_sequence_fails_alone(smol, smol_packed, prompts, hf_greedy):
    eng = engine(smol, smol_packed, FaultPlan(memory_pos=MEM_POS))
    long = (prompts[8] * 2)[:MEM_POS + 20]  # a query at MEM_POS in its prefill
    outs, ids, bad = poison_run(eng, prompts, lambda e: e.add_request(long, GOOD))
    check(outs, ids, bad, around(hf_greedy), f"injected memory fault at position {MEM_POS}")


def test_a_request_every_step_fails_on_is_found_and_fails_alone(smol, smol_packed, prompts,
                                                                hf_greedy):
    """A fault no sequence is blamed for: layer 2's dense slice raises in every step
    that feeds the poison token. After max_recoveries recoveries the engine bisects the
    failed step's 12 requests (6 decoding, the poison one and 5 more prompts): the
    poison one fails alone, naming the search and the fault; the others give HF's tokens
    (recomputed after each recovery); every slot is back and the engine runs on."""
    tok = unused_token(prompts, hf_greedy)
    eng = engine(smol, smol_packed, FaultPlan(compute_layer=2, layer_token=tok))
    first, then = [0, 1, 2, 3, 4, 5], [9, 10, 11, 12, 13]  # the prompts of <= 200 tokens
    ids = [eng.add_request(prompts[i], GOOD) for i in first]
    outs = {}
    for _ in range(2):
        outs.update({o.request_id: o for o in eng.step()})
    bad = eng.add_request(prompts[3] + [tok], GOOD)
    ids += [eng.add_request(prompts[i], GOOD) for i in then]
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    check(outs, ids, bad, [hf_greedy[i] for i in first + then], "every step it ran in failed")
    assert "injected fault in layer 2 (no sequence named)" in outs[bad].error
    assert eng.free_slots() == [SLOTS, SLOTS] and not eng.scheduler.waiting
    assert eng.num_failed_requests == 1 and len(eng.culprits) == 1
    # 4 failures in a row start the search; it takes at most log2(12) + 3 more
    assert 5 <= len(eng.recoveries) <= 4 + math.ceil(math.log2(12)) + 3
    assert all("injected fault in layer 2" in r for r in eng.recoveries)
    rid = eng.add_request(prompts[0], GOOD)  # and after it
    while eng.has_unfinished():
        done = {o.request_id: o for o in eng.step()}
    assert done[rid].token_ids == hf_greedy[0][:NEW]


def test_a_request_failing_in_its_last_chunk_is_found_though_steps_between_run(
        smol, smol_packed, prompts, hf_greedy):
    """A 301-token prompt fed 64 tokens a step whose last chunk trips a fault no sequence
    is blamed for, with no KV kept (prefix caching off, as after a worker replaced):
    each recovery recomputes it from its start, so its first chunks run between its
    failures and the steps never fail past max_recoveries in a row (the engine looped on
    it for good). A request in more than max_recoveries failed steps since it last drew
    starts the search: it fails alone, within a bounded number of steps, and the
    requests decoding beside it give HF's tokens."""
    tok = unused_token(prompts, hf_greedy)
    eng = engine(smol, smol_packed, FaultPlan(compute_layer=2, layer_token=tok),
                 caching=False, step_tokens=64)
    good = [0, 1, 9]  # 5, 12 and 9 tokens
    ids = [eng.add_request(prompts[i], GOOD) for i in good]
    bad = eng.add_request(prompts[6] + [tok], GOOD)  # 300 tokens, then the poison
    outs = {}
    for _ in range(100):
        outs.update({o.request_id: o for o in eng.step()})
        if not eng.has_unfinished():
            break
    assert not eng.has_unfinished(), eng.recoveries[-1]
    check(outs, ids, bad, [hf_greedy[i] for i in good], "every step it ran in failed")
    assert "injected fault in layer 2" in outs[bad].error
    assert eng.free_slots() == [SLOTS, SLOTS] and eng.num_failed_requests == 1
    # in 4 failed steps, then alone in the search's first probe, twice: named
    assert len(eng.recoveries) == 6


def test_a_request_whose_lone_step_loses_a_worker_once_is_not_named(
        smol, smol_packed, prompts, hf_greedy):
    """A good request and a poison one fail two steps (max_recoveries=1): the search
    tries the good one alone first, and that step fails too, once, for a reason of its
    own (a worker killed: a failure of the executor, no sequence named). Before, that
    named the good request; now it runs alone again and draws, and the poison one is
    named after failing alone twice. The good one gives HF's tokens."""
    tok = unused_token(prompts, hf_greedy)
    eng = engine(smol, smol_packed, FaultPlan(compute_layer=2, layer_token=tok))
    eng.config = replace(eng.config, max_recoveries=1)
    good = eng.add_request(prompts[0], GOOD)
    bad = eng.add_request(prompts[1] + [tok], GOOD)
    execute, lost = eng.executor.execute, []

    def losing_a_worker_once(plan):
        if eng.searching and not lost and {s.seq_id for s in plan.seqs} == {0}:
            lost.append(plan.step)
            raise RuntimeError("memory worker 1 died (killed)")
        return execute(plan)

    eng.executor.execute = losing_a_worker_once
    outs = {}
    for _ in range(40):
        outs.update({o.request_id: o for o in eng.step()})
        if not eng.has_unfinished():
            break
    assert lost  # the good request (seq 0) ran alone, and that step failed
    check(outs, [good], bad, [hf_greedy[0]], "every step it ran in failed")
    assert "injected fault in layer 2" in outs[bad].error
    assert eng.num_failed_requests == 1 and eng.free_slots() == [SLOTS, SLOTS]
    assert sum("memory worker 1 died" in r for r in eng.recoveries) == 1


def test_two_such_requests_each_fail_alone(smol, smol_packed, prompts, hf_greedy):
    """Two poison requests ahead of four good ones: the first is named; the second is
    found with no step run since, so its alibi is checked (the engine's own one-token
    request runs a step without it) before it is named too. The good ones give HF's
    tokens."""
    tok = unused_token(prompts, hf_greedy)
    eng = engine(smol, smol_packed, FaultPlan(compute_layer=2, layer_token=tok), workers=1)
    bad = [eng.add_request(prompts[i] + [tok], GOOD) for i in (0, 1)]
    good = [eng.add_request(prompts[i], GOOD) for i in (2, 3, 4, 5)]
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    assert [outs[i].token_ids for i in good] == [hf_greedy[i][:NEW] for i in (2, 3, 4, 5)]
    assert all(outs[i].error is None for i in good)
    for i in bad:
        assert outs[i].finish_reason == "error"
        assert "every step it ran in failed" in outs[i].error
    assert eng.num_failed_requests == 2 and eng.free_slots() == [SLOTS]


def test_three_such_requests_each_fail_alone(smol, smol_packed, prompts, hf_greedy):
    """Three poison requests ahead of three good ones: the second is found with no step
    run since the first, and the requests left beside it hold the third, so its alibi
    is the engine's own one-token request alone (the others as its alibi failed too, and
    the engine stopped for everyone: a random workload's seed 188). All three fail
    alone; the good ones give HF's tokens."""
    tok = unused_token(prompts, hf_greedy)
    eng = engine(smol, smol_packed, FaultPlan(compute_layer=2, layer_token=tok), workers=1)
    bad = [eng.add_request(prompts[i] + [tok], GOOD) for i in (0, 1, 2)]
    good = [eng.add_request(prompts[i], GOOD) for i in (3, 4, 5)]
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    assert [outs[i].token_ids for i in good] == [hf_greedy[i][:NEW] for i in (3, 4, 5)]
    assert all(outs[i].error is None for i in good)
    for i in bad:
        assert outs[i].finish_reason == "error"
        assert "every step it ran in failed" in outs[i].error
    assert len(eng.culprits) == 3 and eng.num_failed_requests == 3
    assert eng.free_slots() == [SLOTS] and not eng._reqs and not eng._probes


def test_two_such_requests_alone_each_fail_and_the_engine_goes_on(smol, smol_packed,
                                                                  prompts, hf_greedy):
    """Two poison requests with no other request in the engine: the second is found with
    no step run since and nobody else to show the steps run without it, so the engine's
    own one-token request is its alibi (it was stopped before: two bad requests from a
    client took the engine down for everyone). Both fail alone, the probe's output is
    nobody's, every slot is back, and the next request gives HF's tokens."""
    tok = unused_token(prompts, hf_greedy)
    eng = engine(smol, smol_packed, FaultPlan(compute_layer=2, layer_token=tok), workers=1)
    real, probes = eng._probe, []
    eng._probe = lambda: probes.append(real()) or probes[-1]
    bad = [eng.add_request(prompts[i] + [tok], GOOD) for i in (0, 1)]
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    assert sorted(outs) == bad and len(eng.culprits) == 2 and len(probes) == 1
    for i in bad:
        assert outs[i].finish_reason == "error"
        assert "every step it ran in failed" in outs[i].error
    assert eng.free_slots() == [SLOTS] and not eng._reqs and not eng._probes
    good = eng.add_request(prompts[2], GOOD)
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    assert outs[good].token_ids == hf_greedy[2][:NEW]


def test_a_named_fault_during_a_search_fails_its_request_and_the_search_goes_on(
        smol, smol_packed, prompts, hf_greedy):
    """While the search runs (past max_recoveries failed steps in a row), a fault that
    names a good request and leaves the workers mid-step (as a Ray memory worker's does)
    fails that request alone and is recovered; it does not stop the engine, and the
    search still names the poison request."""
    tok = unused_token(prompts, hf_greedy)
    eng = engine(smol, smol_packed, FaultPlan(compute_layer=2, layer_token=tok), workers=1)
    real, hit = eng.executor.execute, []

    def execute(plan):
        good = [x.seq_id for x in plan.seqs if x.seq_id != bad_seq]
        if eng._search is not None and not hit and good:
            hit.append(good[0])
            raise SequenceFault(good[:1], "memory worker 0: bad slots", clean=False)
        return real(plan)

    eng.executor.execute = execute
    bad = eng.add_request(prompts[0] + [tok], GOOD)
    bad_seq = eng._reqs[bad].seqs[0].seq_id
    good = [eng.add_request(prompts[i], GOOD) for i in (1, 2, 3)]
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    failed = [r for r in good if outs[r].error is not None]
    assert len(hit) == 1 and len(failed) == 1 and "bad slots" in outs[failed[0]].error
    assert [outs[r].token_ids for r in good if r not in failed] == [
        hf_greedy[i][:NEW] for i, r in zip((1, 2, 3), good) if r not in failed]
    assert "every step it ran in failed" in outs[bad].error
    assert eng.num_failed_requests == 2 and eng.free_slots() == [SLOTS]


def test_aborting_the_poison_request_mid_search_ends_it_naming_no_one(
        smol, smol_packed, prompts, hf_greedy):
    """The client of the poison request goes away while the search runs: it leaves the
    suspects, the others each run again, the search ends with no one named, and every
    slot is back."""
    tok = unused_token(prompts, hf_greedy)
    eng = engine(smol, smol_packed, FaultPlan(compute_layer=2, layer_token=tok), workers=1)
    bad = eng.add_request(prompts[0] + [tok], GOOD)
    good = [eng.add_request(prompts[i], GOOD) for i in (1, 2, 3)]
    outs = {}
    while not eng.searching:
        outs.update({o.request_id: o for o in eng.step()})
    assert eng.abort(bad).finish_reason == "abort"
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    assert [outs[r].token_ids for r in good] == [hf_greedy[i][:NEW] for i in (1, 2, 3)]
    assert not eng.searching and not eng.culprits and eng.num_failed_requests == 0
    assert len(eng.recoveries) == 4 and eng.free_slots() == [SLOTS]


def test_a_poison_request_with_parallel_samples_is_found_and_all_end(smol, smol_packed,
                                                                     prompts, hf_greedy):
    """n=3: the poison request's samples are forked after its prefill (the test then
    makes the token each drew the poison one) and preempted one by one at each recovery;
    the search admits and names them as one request, all three end with "error", every
    reference is freed, and the good ones give HF's tokens."""
    tok = unused_token(prompts, hf_greedy)
    eng = engine(smol, smol_packed, FaultPlan(compute_layer=2, layer_token=tok), workers=1)
    good = [eng.add_request(prompts[i], GOOD) for i in (1, 2)]
    p = SamplingParams(max_tokens=6, temperature=0.8, seed=3, n=3)
    bad = eng.add_request(prompts[3], p)
    outs = {}
    outs.update({o.request_id: o for o in eng.step()})  # prefilled: forked
    assert len(eng._reqs[bad].seqs) == 3 and all(s.status == "running"
                                                 for s in eng._reqs[bad].seqs)
    for s in eng._reqs[bad].seqs:  # its samples draw the poison token next
        s.output[-1] = tok
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    assert [c.finish_reason for c in outs[bad].outputs] == ["error"] * 3
    assert "every step it ran in failed" in outs[bad].error and len(eng.culprits) == 1
    assert [outs[r].token_ids for r in good] == [hf_greedy[i][:NEW] for i in (1, 2)]
    assert eng.free_slots() == [SLOTS] and all(a.stats().shared == 0 for a in eng.allocs)


def test_steps_failing_whatever_runs_stop_the_engine(smol, smol_packed, prompts, caplog):
    """Every step fails with no sequence named (a broken worker): not one request's
    doing. The first request the search finds fails alone (nothing shows otherwise
    yet); the second is found with no step run since and nobody else in the engine, so
    the engine's own one-token request runs without it: that fails too (twice), and the
    engine stops with the step's error, as it did before searching."""
    eng = engine(smol, smol_packed, workers=1)

    def execute(plan):
        raise InjectedFault("injected fault in layer 2 (no sequence named)")

    eng.executor.execute = execute
    a, b = (eng.add_request(prompts[i], GOOD) for i in (1, 2))
    outs = {}
    with caplog.at_level("ERROR", logger="lamina.engine.engine"):
        with pytest.raises(InjectedFault, match="injected fault in layer 2"):
            for _ in range(50):
                outs.update({o.request_id: o for o in eng.step()})
    assert list(outs) == [a] and "every step it ran in failed" in outs[a].error
    assert any(f"they fail whatever runs (request {b} was named just before" in r.message
               for r in caplog.records)


def test_the_errors_a_client_gets_pickle_with_their_fields():
    """The Lamina service raises these at its clients in other processes: Ray pickles
    them. Each comes back with its fields and message (a `RequestFailed` reached an HTTP
    front of the service as Ray's "failed to deserialize", a 503 instead of a 500)."""
    import pickle

    from lamina.errors import EngineDead, EngineOverloaded

    for e, fields in [(RequestFailed(7, "seq 3: bad"), ("request_id",)),
                      (SequenceFault([3, 4], "bad slots", clean=False), ("seq_ids", "clean")),
                      (EngineOverloaded(9, 8, 2.5), ("waiting", "limit", "retry_after_s")),
                      (EngineDead("stopped"), ())]:
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == str(e)
        assert [getattr(back, f) for f in fields] == [getattr(e, f) for f in fields]


def test_culprit_search_off_stops_the_engine(smol, smol_packed, prompts, hf_greedy):
    tok = unused_token(prompts, hf_greedy)
    cfg = EngineConfig(num_kv_slots=SLOTS, find_culprits=False,
                       faults=FaultPlan(compute_layer=2, layer_token=tok))
    mem = MemorySide(KVPool(KVPoolConfig.for_specs(smol_packed.attention_specs, SLOTS)))
    ex = LocalExecutor(smol_packed, [mem], faults=cfg.faults)
    eng = LLMEngine(cfg, ex, smol.tokenizer, smol.config)
    eng.add_request(prompts[0] + [tok], GOOD)
    with pytest.raises(InjectedFault):
        for _ in range(5):
            eng.step()
    assert len(eng.recoveries) == 3  # max_recoveries, then it stops


@pytest.mark.parametrize("where", ["compute", "memory"])
def test_a_fault_on_one_compute_replica_fails_alone(smol, smol_packed, prompts, hf_greedy,
                                                    where):
    """Two replicas (fixed): the poison request's replica fails the step cleanly, the
    other's part succeeded; the rerun without it must not run that part twice."""
    tok = unused_token(prompts, hf_greedy)
    long = (prompts[8] * 2)[:MEM_POS + 20]
    faults, poison, words = ((FaultPlan(compute_token=tok), [1, 2, tok, 3],
                              f"injected compute fault on token {tok}") if where == "compute"
                             else (FaultPlan(memory_pos=MEM_POS), long,
                                   f"injected memory fault at position {MEM_POS}"))
    eng = engine(smol, smol_packed, faults, replicas=2)
    runs = []  # (replica, step, its sequences) per replica run
    for r, c in enumerate(eng.executor.replicas):
        def run(plan, link, r=r, real=c.run):
            runs.append((r, plan.step, tuple(s.seq_id for s in plan.seqs)))
            return real(plan, link)
        c.run = run
    outs, ids, bad = poison_run(eng, prompts, lambda e: e.add_request(poison, GOOD))
    check(outs, ids, bad, around(hf_greedy), words)
    assert eng.num_failed_requests == 1 and not eng.recoveries
    steps = [(r, step) for r, step, _ in runs]
    again = {x for x in steps if steps.count(x) > 1}
    assert len(again) == 1  # the poison's replica ran that step again, without it
    assert len(set(runs)) == len(runs)  # no replica ran the same part twice


def test_sampler_exception_is_put_on_its_row(smol, smol_packed, prompts, hf_greedy,
                                             monkeypatch):
    """The sampler raises for one row with nothing naming it: the compute side retries
    row by row and blames that sequence only."""
    real = executor_mod.sample_rows

    def flaky(logits, params, seeds, *a):
        if any(s == (666,) for s in seeds):
            raise FloatingPointError("bad row")
        return real(logits, params, seeds, *a)

    monkeypatch.setattr(executor_mod, "sample_rows", flaky)
    eng = engine(smol, smol_packed)
    poison = SamplingParams(max_tokens=4, temperature=0.7, seed=666)
    outs, ids, bad = poison_run(eng, prompts, lambda e: e.add_request(prompts[3], poison))
    check(outs, ids, bad, around(hf_greedy), "sampling failed: FloatingPointError: bad row")


def test_parallel_samples_of_a_failed_request_all_end(smol, smol_packed, prompts, hf_greedy):
    """n=3: the poison request's forks share its KV; all three end with "error" and
    every reference is freed."""
    tok = unused_token(prompts, hf_greedy)
    eng = engine(smol, smol_packed, FaultPlan(compute_token=tok), workers=1)
    p = SamplingParams(max_tokens=6, temperature=0.8, seed=3, n=3)
    outs, ids, bad = poison_run(eng, prompts,
                                lambda e: e.add_request(prompts[2] + [tok], p))
    check(outs, ids, bad, around(hf_greedy), "injected compute fault")
    assert [c.finish_reason for c in outs[bad].outputs] == ["error"] * 3


def test_engine_loop_raises_request_failed_and_serves_on(smol, smol_packed, prompts,
                                                        hf_greedy):
    """Through the threaded loop (what the HTTP server uses): 8 good requests in flight
    around a poison one; its future raises RequestFailed, the loop stays alive."""
    tok = unused_token(prompts, hf_greedy)
    loop = EngineLoop(engine(smol, smol_packed, FaultPlan(compute_token=tok)))
    try:
        futs = [loop.submit(prompts[i], GOOD) for i in BEFORE]
        bad = loop.submit([tok, 9, 9], GOOD)
        futs += [loop.submit(prompts[i], GOOD) for i in AFTER]
        with pytest.raises(RequestFailed, match="injected compute fault"):
            bad.result(300)
        assert [f.result(300).token_ids for f in futs] == [
            r[:NEW] for r in around(hf_greedy)]
        assert loop.alive and loop.stats["failed"] == 1
        after = loop.submit(prompts[0], GOOD).result(300)  # and after it
        assert after.token_ids == hf_greedy[0][:NEW]
        assert all(f == SLOTS for f in loop.engine.free_slots())
    finally:
        loop.shutdown()


def test_engine_loop_serves_on_past_a_request_every_step_fails_on(smol, smol_packed, prompts,
                                                                  hf_greedy):
    """Through the threaded loop (the HTTP server's): a request that sets off a fault no
    sequence is blamed for raises RequestFailed naming the search, the loop stays alive,
    the good requests give HF's tokens, and /metrics counts it."""
    from prometheus_client.parser import text_string_to_metric_families

    from lamina.entrypoints.metrics import EngineMetrics

    tok = unused_token(prompts, hf_greedy)
    metrics = EngineMetrics()
    loop = EngineLoop(engine(smol, smol_packed, FaultPlan(compute_layer=2, layer_token=tok)),
                      metrics)
    try:
        futs = [loop.submit(prompts[i], GOOD) for i in range(4)]
        bad = loop.submit([tok, 9, 9], GOOD)
        with pytest.raises(RequestFailed, match="every step it ran in failed"):
            bad.result(300)
        assert [f.result(300).token_ids for f in futs] == [r[:NEW] for r in hf_greedy[:4]]
        assert loop.alive and loop.stats["failed"] == 1
        assert loop.submit(prompts[0], GOOD).result(300).token_ids == hf_greedy[0][:NEW]
        got = {(x.name, tuple(x.labels.items())): x.value for fam in
               text_string_to_metric_families(metrics.render().decode()) for x in fam.samples}
        assert got[("lamina_culprits_total", ())] == 1
        assert got[("lamina_culprit_search", ())] == 0
        assert got[("lamina_requests_total", (("finish", "error"),))] == 1
        assert got[("lamina_recoveries_total", ())] >= 5
    finally:
        loop.shutdown()


def test_a_fault_naming_no_sequence_of_the_step_is_an_engine_error(smol, smol_packed,
                                                                  prompts):
    """An executor that blames sequences outside the step is a bug: loud, not a loop."""
    eng = engine(smol, smol_packed)

    def bogus(plan):
        raise SequenceFault([10 ** 6], "nobody")

    eng.executor.execute = bogus
    eng.add_request(prompts[0], GOOD)
    with pytest.raises(RuntimeError, match="none of them in the step"):
        eng.step()


def test_abort_running_waiting_and_preempted_frees_every_slot(smol, smol_packed, prompts):
    """A 260-slot pool and three 100-token prompts: the third waits, and growth preempts
    the second; aborting each (preempted, waiting, running) returns every slot. (No
    prefix cache: with it the preempted copy of the same prompt is re-admitted at once.)"""
    eng = engine(smol, smol_packed, workers=1, slots=260, caching=False)
    p = SamplingParams(max_tokens=100, ignore_eos=True, temperature=0)
    rids = [eng.add_request(prompts[4][:100], p) for _ in range(3)]
    seqs = [eng._reqs[r].seqs[0] for r in rids]
    for _ in range(40):
        eng.step()
        if seqs[1].num_preemptions:
            break
    assert seqs[1].num_preemptions == 1 and seqs[1].status == "waiting"
    assert seqs[2].status == "waiting" and seqs[0].status == "running"
    outs = [eng.abort(r) for r in (rids[1], rids[2], rids[0])]
    assert [o.finish_reason for o in outs] == ["abort"] * 3
    assert eng.free_slots()[0] == 260 and not eng.has_unfinished()
    assert eng.abort(rids[0]) is None  # gone: a second abort is a no-op


@pytest.mark.parametrize("kw,words", [
    ({"compute_token": -1}, "compute_token"),
    ({"memory_pos": 1.5}, "memory_pos"),
    ({"compute_layer": 2}, "compute_layer and layer_token go together"),
    ({"layer_token": 5}, "compute_layer and layer_token go together"),
])
def test_fault_plan_validated(kw, words):
    with pytest.raises(ValueError, match=words):
        FaultPlan(**kw)


def test_a_failing_metrics_update_is_logged_and_serving_goes_on(smol, smol_packed, prompts,
                                                                caplog):
    """A bug in /metrics' bookkeeping after a step is logged; the requests are answered."""
    from lamina.entrypoints.metrics import EngineMetrics

    class Broken(EngineMetrics):
        def step(self, engine, drawn):
            raise RuntimeError("a metrics bug")

    loop = EngineLoop(engine(smol, smol_packed, workers=1), Broken())
    try:
        out = loop.submit(prompts[0], GOOD).result(timeout=120)
        assert len(out.token_ids) == NEW and loop.alive
        assert "updating the metrics after a step failed" in caplog.text
    finally:
        loop.shutdown()


def test_a_bug_outside_the_step_fails_the_loops_requests_loudly(smol, smol_packed, prompts):
    """An exception anywhere in the loop thread (here: admitting requests) fails every
    request it holds with that error, within a bound, instead of leaving them waiting."""
    loop = EngineLoop(engine(smol, smol_packed, workers=1))

    def admit():
        raise RuntimeError("an admission bug")

    loop._admit = admit
    try:
        fut = loop.submit(prompts[0], GOOD)
        with pytest.raises(RuntimeError, match="an admission bug"):
            fut.result(timeout=30)
        assert not loop.alive
    finally:
        loop.shutdown()


def test_a_sequence_that_outgrows_every_pool_ends_at_their_size_and_the_others_go_on(
        smol, smol_packed, prompts, hf_greedy):
    """The pools are a context limit too: a request allowed more tokens than every
    memory worker's slots hold together (split KV) ends with finish reason "length"
    when it fills them, alone, its tokens HF's up to there; the engine goes on (before,
    the scheduler raised for it and the step, and every request with it, failed)."""
    eng = engine(smol, smol_packed, workers=2, slots=40)
    ids = [eng.add_request(prompts[1], GOOD)]  # 12 + 12: fits beside it
    p = prompts[2]  # 40 tokens
    big = eng.add_request(p, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    got = outs[big].outputs[0]
    # 80 slots hold positions 0..79: the token drawn at position 79 (the 81st) ends it
    assert got.finish_reason == "length" and len(p) + len(got.token_ids) == 81
    want = hf_greedy_of(smol, [p], 41)[0]  # (HF's stops at an EOS; ours ignores it)
    assert got.token_ids[:len(want)] == want
    assert outs[ids[0]].outputs[0].token_ids == hf_greedy[1][:NEW]
    assert eng.free_slots() == [40, 40]


def test_a_sequence_no_pool_can_take_ever_fails_alone_by_name(smol, smol_packed, prompts,
                                                              hf_greedy):
    """A waiting sequence that cannot be placed while nothing else runs never will: it
    fails alone, with an error naming it and the room there is, and the engine goes on
    (before, the scheduler raised and the step failed with every request in it). Here
    slots held outside the engine make the pool too small for it; in serving, a sparse
    sequence computed again whole after its slots were given back gets here."""
    eng = engine(smol, smol_packed, workers=1, slots=300)
    eng.allocs[0].allocate("held", 100)  # 200 free
    bad = eng.add_request(prompts[6][:250], GOOD)
    outs = {o.request_id: o for o in eng.step()}
    assert outs[bad].finish_reason == "error" and not eng.has_unfinished()
    assert (f"request {bad} failed in step 0: sequence 0 (250 tokens) cannot be placed: "
            "[200] free KV slots, 0 more the prefix cache can give") in outs[bad].error
    eng.allocs[0].free("held")
    good = eng.add_request(prompts[1], GOOD)
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert outs[good].outputs[0].token_ids == hf_greedy[1][:NEW]
    assert eng.free_slots() == [300]
