"""Recovery from a failed step (a dead worker): the engine preempts every running
sequence, the executor brings fresh workers with empty pools, and the lost KV is
recomputed, so every request still ends with HF's greedy tokens; the KV in pools the
recovery kept is reused, not recomputed. Without recovery (off, used up, or refused)
the step's error propagates. Local executor with injected faults; the Ray path (a killed
memory worker) is in tests/cluster."""
import logging
import time

import pytest

from lamina.cluster.cli import _recoveries_line
from lamina.engine.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.entrypoints.metrics import EngineMetrics
from lamina.executor.local import LocalExecutor
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.sampling.params import SamplingParams

from .test_engine import GREEDY

PICK = [1, 4, 9, 12]  # 12..140-token prompts


class WorkerGone(ConnectionError):
    pass


class FlakyExecutor(LocalExecutor):
    """Raises on the listed `execute` calls, as a dead worker would. `recover` poisons
    every pool but those it says it `keep`s with NaN (a replacement worker knows
    nothing), so an output equal to HF's proves the KV was recomputed, not reused, and
    that the kept pools' KV was read only where it was written. `plans`: every plan."""

    def __init__(self, split, memory, fail_on: set[int], recoverable: bool = True,
                 keep: frozenset[int] = frozenset()):
        super().__init__(split, memory)
        self.fail_on, self.recoverable, self.calls, self.recovered = fail_on, recoverable, 0, 0
        self.keep, self.plans = keep, []

    def execute(self, plan):
        self.calls += 1
        self.plans.append(plan)
        if self.calls in self.fail_on:
            raise WorkerGone(f"memory worker 1 gone at call {self.calls}")
        return super().execute(plan)

    def recover(self, error):
        assert isinstance(error, WorkerGone) or str(error).startswith("idle check: ")
        if not self.recoverable:
            return False
        super().recover(error)  # the kept pools' workers are reset, as the Ray ones are
        for w, mem in enumerate(self.memory):
            if w not in self.keep:
                mem.pool.k.fill_(float("nan"))
                mem.pool.v.fill_(float("nan"))
        self.recovered += 1
        return True

    def kv_kept(self):
        return self.keep

    def workers_replaced(self):
        return {"memory": self.recovered, "compute": 0}  # as if memory worker 1 came back


def flaky_engine(smol, smol_packed, fail_on, workers=2, slots=2000, keep=frozenset(), **kw):
    cfg = EngineConfig(num_kv_slots=slots, num_memory_workers=workers, **kw)
    pools = [KVPool(KVPoolConfig.for_specs(smol_packed.attention_specs, slots))
             for _ in range(workers)]
    ex = FlakyExecutor(smol_packed, [MemorySide(p) for p in pools], set(fail_on), keep=keep)
    return LLMEngine(cfg, ex, smol.tokenizer, smol.config)


def drain(eng, ids):
    out = {}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] = o
    return [out[i] for i in ids]


def test_failed_steps_are_recovered_with_hf_tokens(smol, smol_packed, prompts, hf_greedy,
                                                   caplog):
    # call 1 is the admission (prefill) step, call 20 is mid-decode with 4 running
    eng = flaky_engine(smol, smol_packed, fail_on={1, 20})
    ids = [eng.add_request(prompts[i], GREEDY) for i in PICK]
    with caplog.at_level(logging.WARNING, logger="lamina.engine.engine"):
        outs = drain(eng, ids)
    assert [o.token_ids for o in outs] == [hf_greedy[i] for i in PICK]
    assert eng.executor.recovered == 2 and len(eng.recoveries) == 2
    assert "step 0 failed: WorkerGone" in eng.recoveries[0]
    assert "step 19 failed" in eng.recoveries[1]  # 19 plans before it ran fine
    assert sum("workers recovered" in r.message for r in caplog.records) == 2
    # Each failure preempted all 4 running sequences: 2 recomputations each.
    assert [o.metrics["preemptions"] for o in outs] == [2, 2, 2, 2]
    assert eng.free_slots() == [2000] * len(eng.allocs)
    assert all(a.stats().shared == 0 for a in eng.allocs)


def _run_to_call(eng, call: int) -> None:
    while eng.executor.calls < call:
        eng.step()


def test_a_kept_pool_keeps_its_kv_through_a_recovery(smol, smol_packed, prompts, hf_greedy,
                                                     caplog):
    """Worker 1 is replaced (its pool poisoned) and worker 0 kept, mid-decode: worker 0's
    sequences are readmitted onto their own KV and compute only the position the failed
    step was computing, worker 1's cached prefixes are dropped; every output is HF's."""
    eng = flaky_engine(smol, smol_packed, fail_on={20}, keep=frozenset({0}))
    ids = [eng.add_request(prompts[i], GREEDY) for i in PICK]
    with caplog.at_level(logging.WARNING, logger="lamina.engine.engine"):
        _run_to_call(eng, 20)
    failed = eng.executor.plans[19]
    kept = {w.seq_id: w.start_pos for w in failed.seqs if w.worker == 0}
    lost = {w.seq_id for w in failed.seqs if w.worker == 1}
    assert kept and lost and all(len(w.token_ids) == 1 for w in failed.seqs)  # decodes
    assert eng.kv_kept_tokens == sum(kept.values())
    assert eng.scheduler.caches[1].size == 0 and eng.scheduler.caches[0].size >= max(
        kept.values())
    assert f"the KV of {sum(kept.values())} of their" in caplog.records[-1].message
    outs = drain(eng, ids)
    assert [o.token_ids for o in outs] == [hf_greedy[i] for i in PICK]
    again = {w.seq_id: w for w in eng.executor.plans[20].seqs}
    for sid, start in kept.items():  # fed from the failed step's position on
        assert (again[sid].start_pos, len(again[sid].token_ids)) == (start, 1)
    assert [o.metrics["cached_tokens"] for o in outs] == [0] * len(PICK)  # first admission
    assert eng.free_slots() == [2000] * len(eng.allocs)


class LosingExecutor(FlakyExecutor):
    """Its recovery cannot replace memory worker `gone` (as a Ray one whose node is gone
    with no room left for its bundle): it drops it and numbers the others 0.. again;
    the pools it keeps are every other one (named by their new index), the dropped
    one is poisoned first (its KV must never be read again)."""

    def __init__(self, split, memory, fail_on, gone: int):
        super().__init__(split, memory, fail_on, keep=frozenset(range(len(memory) - 1)))
        self.gone, self.lost = gone, ()

    def recover(self, error):
        gone = self.memory[self.gone].pool
        gone.k.fill_(float("nan"))
        gone.v.fill_(float("nan"))
        shared = self.link.shared
        for lst in (self.memory, shared.locks, shared.tracers):
            del lst[self.gone]
        for c in self.replicas:
            c.num_workers = len(self.memory)
        self.lost = (self.gone,)
        return super().recover(error)  # (it poisons no other pool: all kept)

    def memory_lost(self):
        return self.lost


def test_a_memory_worker_that_cannot_be_replaced_is_dropped_and_the_rest_go_on(
        smol, smol_packed, prompts, hf_greedy, caplog):
    """3 memory workers, mid-decode the middle one dies for good: the engine goes on
    with 2, numbered 0 and 1; the sequences on old workers 0 and 2 take back their own
    KV there (fed from the failed step's position on: old worker 2's pool is the new
    worker 1's), old worker 1's are computed again (its pool poisoned); every output is
    HF's."""
    slots = 2000
    cfg = EngineConfig(num_kv_slots=slots, num_memory_workers=3)
    sides = [MemorySide(KVPool(KVPoolConfig.for_specs(smol_packed.attention_specs, slots)))
             for _ in range(3)]
    eng = LLMEngine(cfg, LosingExecutor(smol_packed, sides, {20}, gone=1), smol.tokenizer,
                    smol.config)
    picks = [*PICK, 2, 6]
    ids = [eng.add_request(prompts[i], GREEDY) for i in picks]
    with caplog.at_level(logging.WARNING, logger="lamina.engine.engine"):
        _run_to_call(eng, 20)
    failed = eng.executor.plans[19]
    on = {w: {s.seq_id: s.start_pos for s in failed.seqs if s.worker == w} for w in range(3)}
    assert all(on.values()) and all(len(s.token_ids) == 1 for s in failed.seqs), on
    assert len(eng.allocs) == 2 and eng.config.num_memory_workers == 2
    assert eng.memory_workers_lost == 1 and eng.alloc is eng.allocs[0]
    assert eng.kv_kept_tokens == sum(on[0].values()) + sum(on[2].values())
    assert any("memory workers 1 could not be replaced: the engine goes on with 2"
               in r.message for r in caplog.records)
    outs = drain(eng, ids)
    assert [o.token_ids for o in outs] == [hf_greedy[i] for i in picks]
    again = {s.seq_id: s for s in eng.executor.plans[20].seqs}
    for sid, start in {**on[0], **on[2]}.items():  # fed from the failed step's position
        assert (again[sid].start_pos, len(again[sid].token_ids)) == (start, 1)
    # (a prompt here may be another's prefix: a tie goes to the lower worker, so only
    # some of old worker 2's take their own KV, at its pool's new index)
    assert any(again[sid].worker == 1 for sid in on[2])
    assert eng.free_slots() == [slots] * 2
    metrics = EngineMetrics()
    metrics.refresh(eng)
    assert metrics.registry.get_sample_value("lamina_memory_workers_lost_total") == 1
    status = {"recoveries": eng.num_recoveries, "kv_kept_tokens": eng.kv_kept_tokens,
              "workers_replaced": {"compute": 0, "memory": 0},
              "memory_workers_lost": eng.memory_workers_lost}  # (as the service's)
    assert _recoveries_line(status).endswith(
        "; memory workers lost (dead, no replacement could start): 1, the engine went on "
        "without them")


def test_a_prompt_fed_in_chunks_keeps_its_fed_chunks(smol, smol_packed, prompts, hf_greedy):
    """A 300-token prompt fed 64 tokens a step: the step feeding its third chunk fails
    with both pools kept; its readmission feeds from position 128 on (the first two
    chunks' KV kept), and its output is HF's."""
    eng = flaky_engine(smol, smol_packed, fail_on={3}, keep=frozenset({0, 1}),
                       max_step_tokens=64)
    rid = eng.add_request(prompts[6], GREEDY)
    _run_to_call(eng, 3)
    assert [w.start_pos for w in eng.executor.plans[2].seqs] == [128]
    assert eng.kv_kept_tokens == 128
    out = drain(eng, [rid])[0]
    assert out.token_ids == hf_greedy[6]
    assert [(w.start_pos, len(w.token_ids)) for w in eng.executor.plans[3].seqs] == [(128, 64)]
    assert out.metrics["preemptions"] == 1


def test_parallel_samples_recovered_after_fork(smol, smol_packed, prompts):
    """n=3 forks share the prompt's slots; a failure after the fork frees every
    reference, and the recomputed siblings draw the same tokens as an undisturbed run."""
    p = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7, n=3)
    calm = flaky_engine(smol, smol_packed, fail_on=set())
    want = [[c.token_ids for c in o.outputs] for o in drain(calm, [calm.add_request(
        prompts[3], p)])]
    eng = flaky_engine(smol, smol_packed, fail_on={4})
    got = [[c.token_ids for c in o.outputs] for o in drain(eng, [eng.add_request(
        prompts[3], p)])]
    assert got == want and len(eng.recoveries) == 1
    assert eng.free_slots() == [2000] * len(eng.allocs)
    assert all(a.stats().shared == 0 for a in eng.allocs)


def test_recovery_used_up_or_refused_raises_the_step_error(smol, smol_packed, prompts):
    # max_recoveries counts failed steps in a row: a step that runs resets it (no
    # culprit search: past max_recoveries the engine stops)
    eng = flaky_engine(smol, smol_packed, fail_on={2, 4, 5}, max_recoveries=1,
                       find_culprits=False)
    eng.add_request(prompts[1], GREEDY)
    eng.step()
    assert eng.step() == [] and len(eng.recoveries) == 1  # call 2: recovered
    eng.step()  # call 3 runs (the recompute)
    assert eng.step() == [] and len(eng.recoveries) == 2  # call 4: recovered again
    with pytest.raises(WorkerGone, match="call 5"):  # call 5: a second failure in a row
        eng.step()

    eng = flaky_engine(smol, smol_packed, fail_on={1}, max_recoveries=0)
    eng.add_request(prompts[1], GREEDY)
    with pytest.raises(WorkerGone):
        eng.step()
    assert eng.executor.recovered == 0

    eng = flaky_engine(smol, smol_packed, fail_on={1})
    eng.executor.recoverable = False  # e.g. the local executor: a failure is a bug
    eng.add_request(prompts[1], GREEDY)
    with pytest.raises(WorkerGone):
        eng.step()
    assert not eng.recoveries


def test_a_burst_past_max_recoveries_that_no_request_explains_runs_on(
        smol, smol_packed, prompts, hf_greedy, caplog):
    """Calls 2-5 fail (max_recoveries 3), whatever they hold: the culprit search starts
    at the fourth, sees each half of the requests run again, names no one, and the
    engine runs on with HF's tokens."""
    eng = flaky_engine(smol, smol_packed, fail_on={2, 3, 4, 5})
    ids = [eng.add_request(prompts[i], GREEDY) for i in PICK]
    with caplog.at_level(logging.WARNING, logger="lamina.engine.engine"):
        outs = drain(eng, ids)
    assert [o.token_ids for o in outs] == [hf_greedy[i] for i in PICK]
    assert eng.executor.recovered == 4 and eng.num_failed_requests == 0
    assert not eng.culprits and eng._search is None
    msgs = [r.message for r in caplog.records]
    assert sum("looking for the request behind them among the 4 in the step" in m
               for m in msgs) == 1
    assert sum("not one request's doing; the search ends" in m for m in msgs) == 1


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_max_recoveries_validated(bad):
    with pytest.raises(ValueError, match="max_recoveries"):
        EngineConfig(max_recoveries=bad)


@pytest.mark.parametrize("name", ["worker_timeout_s", "step_timeout_s", "idle_check_s"])
@pytest.mark.parametrize("bad", [0, -2.0, float("nan"), float("inf"), True, "60"])
def test_timeouts_validated(bad, name):
    with pytest.raises(ValueError, match=f"EngineConfig.{name} must be a positive number"):
        EngineConfig(**{name: bad})
    assert getattr(EngineConfig(**{name: None}), name) is None
    assert getattr(EngineConfig(**{name: 2}), name) == 2


def test_engine_loop_keeps_serving_through_a_recovery(smol, smol_packed, prompts, hf_greedy):
    """The serving loop: a step fails mid-flight, every future still resolves with HF's
    tokens, the loop stays alive, and the metrics count the recovery once and no token
    twice."""
    from lamina.entrypoints.engine_loop import EngineLoop
    from lamina.entrypoints.metrics import EngineMetrics

    eng = flaky_engine(smol, smol_packed, fail_on={3}, keep=frozenset({0}))
    metrics = EngineMetrics()
    loop = EngineLoop(eng, metrics=metrics)
    try:
        p = SamplingParams(max_tokens=16, temperature=0)
        futs = [loop.submit(prompts[i], p) for i in PICK]
        outs = [f.result(timeout=300) for f in futs]
        assert [o.token_ids for o in outs] == [hf_greedy[i][:16] for i in PICK]
        assert loop.alive and loop.stats["finished"] == len(PICK)
        value = metrics.registry.get_sample_value
        assert value("lamina_recoveries_total") == 1
        assert value("lamina_workers_replaced_total", {"role": "memory"}) == 1
        assert value("lamina_workers_replaced_total", {"role": "compute"}) == 0
        assert value("lamina_generation_tokens_total") == 16 * len(PICK)
        assert value("lamina_recovery_kv_kept_tokens_total") == eng.kv_kept_tokens > 0
        # nothing running: every live slot is a cached prefix
        assert value("lamina_kv_slots_used", {"memory_worker": "0"}) == value(
            "lamina_kv_slots_cached", {"memory_worker": "0"}) > 0
    finally:
        loop.shutdown()


def test_the_serving_loop_replaces_a_worker_its_idle_check_finds(smol, smol_packed, prompts,
                                                                 hf_greedy):
    """While no request is in it, the loop checks the workers every `idle_check_s`: one
    found dead is replaced then, its pool's cached prefixes dropped (its pool is NaN
    now), and the requests after give HF's tokens with no step failing. When the
    workers cannot be brought back, the loop stops, loudly: new requests get
    `EngineDead` naming the check."""
    from lamina.entrypoints.engine_loop import EngineLoop
    from lamina.entrypoints.metrics import EngineMetrics
    from lamina.errors import EngineDead

    eng = flaky_engine(smol, smol_packed, fail_on=set(), keep=frozenset({0}),
                       idle_check_s=0.2)
    found: list[list[str]] = []
    eng.executor.check_workers = lambda: found.pop() if found else []
    metrics = EngineMetrics()
    loop = EngineLoop(eng, metrics=metrics)
    value = metrics.registry.get_sample_value
    try:
        p = SamplingParams(max_tokens=16, temperature=0)
        assert [loop.generate(prompts[i], p, 300).token_ids for i in PICK] == \
            [hf_greedy[i][:16] for i in PICK]
        assert eng.scheduler.caches[1].size > 0 and eng.num_recoveries == 0
        found.append(["memory worker 1: ActorDiedError"])
        deadline = time.monotonic() + 30
        while not value("lamina_recoveries_total") and time.monotonic() < deadline:
            time.sleep(0.05)  # /metrics shows the recovery before any step follows it
        assert value("lamina_recoveries_total") == 1
        assert eng.recoveries[-1] == "idle check: memory worker 1: ActorDiedError"
        assert eng.scheduler.caches[1].size == 0 and eng.scheduler.caches[0].size > 0
        assert value("lamina_kv_slots_cached", {"memory_worker": "1"}) == 0
        assert [loop.generate(prompts[i], p, 300).token_ids for i in PICK] == \
            [hf_greedy[i][:16] for i in PICK]
        assert eng.num_recoveries == 1 and loop.alive  # no step failed
        eng.executor.recoverable = False
        found.append(["compute worker 0: no answer within 10 s"])
        deadline = time.monotonic() + 30
        while loop.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not loop.alive and "could not be brought back" in str(loop.error)
        with pytest.raises(EngineDead, match="compute worker 0: no answer"):
            loop.submit(prompts[0], p)
    finally:
        loop.shutdown()
