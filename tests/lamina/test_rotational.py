"""Rotational staggered pipelining over several compute replicas (paper 5.1, local
executor: replicas are threads over the same slices, each memory side a thread of its
own). n batches over n - 1 replicas: greedy tokens equal HF's on the 16 mixed-length
prompts (n = 3; 8 of them at n = 4); from the trace, slice k of micro-batch j ran on
replica (j + k) mod (n - 1), every context moved as that rule implies (to the replica of
slice k, from that of slice k - 1, the residual stream's bytes), no device ran two tasks
at once, and the replicas and the memory sides worked at once. A failure on a memory
side's thread fails its request alone; one in a replica's slice fails the step with its
error, never a hang, and is recovered."""
import pytest

from lamina import SamplingParams
from lamina.engine.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.executor.local import LocalExecutor
from lamina.faults import FaultPlan
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.trace import lanes, overlapping
from tests.conftest import HF_NEW, SHORT_NEW
from tests.lamina.test_isolation import GOOD, MEM_POS, around, check, poison_run

SLOTS = 8192


def engine(smol, split, n: int, faults=None, workers: int = 2):
    """An engine with rotational pipelining over n batches (n - 1 replicas)."""
    mems = [MemorySide(KVPool(KVPoolConfig.for_specs(split.attention_specs, SLOTS)))
            for _ in range(workers)]
    ex = LocalExecutor(split, mems, vocab_size=smol.config.vocab_size, faults=faults,
                       num_compute_workers=n - 1, pipeline="rotational")
    cfg = EngineConfig(num_kv_slots=SLOTS, num_memory_workers=workers, pipeline="rotational",
                       num_batches=n, num_compute_workers=n - 1, max_step_tokens=2048,
                       faults=faults)
    return LLMEngine(cfg, ex, smol.tokenizer, smol.config), ex


def traced_decode(eng, ex, prompts, params):
    """The prompts to the end, the first step in which all of them decode traced.
    -> (token ids in prompt order, that step's spans)."""
    ids = [eng.add_request(p, params) for p in prompts]
    done = {}
    while any(not s.output for s in eng.scheduler.running) or eng.scheduler.waiting:
        done.update((o.request_id, o) for o in eng.step() if o.finished)  # the prompts
    ex.start_trace()
    step = eng.scheduler.step
    done.update((o.request_id, o) for o in eng.step() if o.finished)
    spans = [s for s in ex.stop_trace() if s.step == step]
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    return [done[i].token_ids for i in ids], spans


def check_rotation(spans, r_n: int, n: int, layers: int, row_bytes: int, rows: int = 16):
    """From one decode step's trace: slice k of micro-batch j ran on replica
    (j + k) mod r_n; every slice after the first got its micro-batch's context from the
    replica of the slice before, after that slice and before this one, the bytes of
    `rows` rows of the residual stream (`row_bytes` each) a layer; no lane ran two tasks
    at once. -> the slice spans by (slice, micro-batch)."""
    work = [s for s in spans if s.kind != "send"]  # output senders: a thread a connection
    assert overlapping(work) == []
    slices = {(s.layer, s.mb): s for s in spans if s.kind == "slice"}
    assert sorted(slices) == [(k, j) for k in range(layers + 1) for j in range(n)]
    for (k, j), s in slices.items():
        assert s.lane == f"compute{(j + k) % r_n}"
    migrated = {(s.layer, s.mb): s for s in spans if s.kind == "migrate"}
    assert sorted(migrated) == [(k, j) for k in range(1, layers + 1) for j in range(n)]
    for (k, j), s in migrated.items():
        assert s.lane == f"compute{(j + k) % r_n}" and s.peer == f"compute{(j + k - 1) % r_n}"
        assert slices[k - 1, j].t0 <= s.t1 <= slices[k, j].t0
        assert s.nbytes > 0 and s.nbytes % row_bytes == 0
    for k in range(1, layers + 1):
        assert sum(migrated[k, j].nbytes for j in range(n)) == rows * row_bytes
    return slices


# n = 4 runs 8 of the prompts (5 to 450 tokens): the rotation rule and the context moves
# are what it adds to n = 3, which runs all 16
PICKS = {3: list(range(16)), 4: [0, 1, 3, 5, 7, 9, 12, 14]}
NEW = {3: HF_NEW, 4: SHORT_NEW}  # new tokens checked at n batches


@pytest.fixture(scope="module", params=[3, 4])
def traced_run(request, smol, smol_packed, prompts):
    """PICKS[n] of the prompts greedy to NEW[n] tokens at n batches; one decode step
    traced."""
    n = request.param
    eng, ex = engine(smol, smol_packed, n)
    greedy = SamplingParams(max_tokens=NEW[n], temperature=0.0, ignore_eos=True)
    tokens, spans = traced_decode(eng, ex, [prompts[i] for i in PICKS[n]], greedy)
    ex.shutdown()
    return n, tokens, spans, len(ex.params)


def test_rotational_greedy_identical_to_hf(traced_run, hf_greedy):
    n, tokens, _, _ = traced_run
    assert tokens == [hf_greedy[i][:NEW[n]] for i in PICKS[n]]


def test_trace_follows_the_papers_replica_rule(traced_run, smol):
    n, _, spans, L = traced_run
    assert lanes(spans) == [*(f"compute{r}" for r in range(n - 1)), "memory0", "memory1"]
    # with 2+ replicas consecutive slices never share one: every context moved
    slices = check_rotation(spans, n - 1, n, L, smol.config.hidden_size * 4,
                            len(PICKS[n]))
    for s in spans:  # one process: a move is recorded when the slice before has ended
        if s.kind == "migrate":
            assert slices[s.layer - 1, s.mb].t1 <= s.t0
    # staggered: the replicas' slices overlap in time, and the memory sides attend
    # while some replica runs a slice
    work = [s for s in spans if s.kind == "slice"]
    assert any(a.lane != b.lane and a.t0 < b.t1 and b.t0 < a.t1 for a in work for b in work)
    attends = [s for s in spans if s.kind == "attend"]
    assert any(a.t0 < b.t1 and b.t0 < a.t1 for a in attends for b in work)


def test_a_memory_fault_on_a_memory_thread_fails_its_request_alone(smol, smol_packed,
                                                                   prompts, hf_greedy):
    """The fault raises on a memory side's thread, reaches the replica collecting it,
    which stops the step's other replicas; the engine fails that request alone."""
    eng, ex = engine(smol, smol_packed, 3, FaultPlan(memory_pos=MEM_POS))
    long = (prompts[8] * 2)[:MEM_POS + 20]  # a query at MEM_POS in its prefill
    outs, ids, bad = poison_run(eng, prompts, lambda e: e.add_request(long, GOOD))
    check(outs, ids, bad, around(hf_greedy), f"injected memory fault at position {MEM_POS}")
    ex.shutdown()


def test_a_slice_failing_on_one_replica_is_recovered_without_a_hang(smol, smol_packed,
                                                                     prompts, hf_greedy,
                                                                     monkeypatch):
    """An error no sequence is blamed for, raised in a slice on replica 1's thread: the
    step fails with it, no replica waits forever, no attention is left running, and the
    local executor recovers (per-sequence state dropped); the requests then end with HF's
    tokens, recomputed."""
    eng, ex = engine(smol, smol_packed, 3)
    ids = [eng.add_request(p, GOOD) for p in prompts[:6]]
    eng.step()
    real, slices = ex.compute._slice, []

    def flaky(i, j, mb, step):
        slices.append((i, j, step.tracer.lane))
        if i == 5 and step.tracer.lane == "compute1":
            raise RuntimeError("slice 5 broke")
        return real(i, j, mb, step)

    monkeypatch.setattr(ex.compute, "_slice", flaky)
    assert eng.step() == []  # failed, recovered
    assert (5, 0, "compute1") in slices  # (0 + 5) mod 2 = 1
    assert "slice 5 broke" in eng.recoveries[-1]
    assert not ex.link.ready and len(ex.compute.tables) == 0
    monkeypatch.setattr(ex.compute, "_slice", real)
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    assert [outs[i].token_ids for i in ids] == [r[:GOOD.max_tokens] for r in hf_greedy[:6]]
    ex.shutdown()
