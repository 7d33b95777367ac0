"""Per-device traces (`lamina.trace`): the span arithmetic on hand-built spans, and the
spans a local run records: every layer's tasks once per micro-batch, attention inside
the compute side's submit, no device running two tasks at once, and rotational's
staggered order (one micro-batch's slice runs while the other's attention is out)."""
import pytest

from lamina import SamplingParams
from lamina.engine.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.executor.local import LocalExecutor
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.trace import Span, Tracer, busy_fractions, lanes, overlapping


def sp(lane, kind, t0, t1, layer=0, mb=0, step=0):
    return Span(lane, kind, step, layer, mb, t0, t1)


def test_busy_fractions_and_overlaps_on_hand_built_spans():
    spans = [sp("compute0", "slice", 0.0, 2.0), sp("compute0", "wait", 2.0, 5.0),
             sp("compute0", "slice", 5.0, 6.0), sp("memory0", "attend", 2.5, 4.0),
             sp("memory0", "attend", 3.5, 4.5), sp("memory1", "attend", 9.0, 10.0)]
    assert lanes(spans) == ["compute0", "memory0", "memory1"]
    # the trace spans 0..10 s; waits are not busy; memory0's two overlap (union 2.0 s)
    assert busy_fractions(spans) == {"compute0": 0.3, "memory0": 0.2, "memory1": 0.1}
    assert overlapping(spans) == [(spans[3], spans[4])]
    assert overlapping(spans, slack=0.5) == []
    assert lanes([sp("memory10", "attend", 0, 1), sp("memory2", "attend", 0, 1),
                  sp("compute1", "slice", 0, 1)]) == ["compute1", "memory2", "memory10"]


def test_a_tracer_records_only_while_on_and_within_its_limit():
    tr = Tracer("compute0", limit=2)
    tr.record("slice", 0, 0.0, 1.0)
    assert tr.spans == []
    tr.start()
    tr.step, tr.mb = 5, 1
    for i in range(3):
        tr.record("slice", i, 0.0, 1.0)
    assert tr.dropped == 1
    assert tr.stop() == [sp("compute0", "slice", 0.0, 1.0, 0, 1, 5),
                         sp("compute0", "slice", 0.0, 1.0, 1, 1, 5)]
    assert not tr.enabled and tr.spans == []


@pytest.fixture(scope="module")
def traced(smol, smol_packed, prompts):
    """Two decode steps of 6 prompts traced, per pipeline mode."""
    out = {}
    for mode in ("none", "rotational"):
        pool = KVPool(KVPoolConfig.for_specs(smol_packed.attention_specs, 4096))
        ex = LocalExecutor(smol_packed, [MemorySide(pool)])
        eng = LLMEngine(EngineConfig(num_kv_slots=4096, pipeline=mode), ex, smol.tokenizer,
                        smol.config)
        for p in prompts[:6]:
            eng.add_request(p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        eng.step()  # the prompts
        ex.start_trace()
        steps = []
        for _ in range(2):
            steps.append(eng.scheduler.step)  # the number the next plan takes
            eng.step()
        out[mode] = (ex.stop_trace(), len(ex.params), steps)
    return out


@pytest.mark.parametrize("mode", ["none", "rotational"])
def test_each_layer_runs_once_per_micro_batch_and_attention_inside_its_submit(traced, mode):
    spans, L, steps = traced[mode]
    mbs = 2 if mode == "rotational" else 1
    assert sorted({s.step for s in spans}) == steps
    assert lanes(spans) == ["compute0", "memory0"] and overlapping(spans) == []
    for step in steps:
        mine = [s for s in spans if s.step == step]
        tasks = {(s.lane, s.kind, s.layer, s.mb) for s in mine}
        assert len(tasks) == len(mine)  # each task once
        want = ({("compute0", "slice", i, j) for i in range(L + 1) for j in range(mbs)}
                | {("compute0", k, i, j) for k in ("submit", "wait") for i in range(L)
                   for j in range(mbs)}
                | {("memory0", "attend", i, j) for i in range(L) for j in range(mbs)}
                | {("compute0", "sample", -1, 0)})
        assert tasks == want
        at = {(s.lane, s.kind, s.layer, s.mb): s for s in mine}
        for i in range(L):
            for j in range(mbs):
                sub, att = at["compute0", "submit", i, j], at["memory0", "attend", i, j]
                wait, nxt = at["compute0", "wait", i, j], at["compute0", "slice", i + 1, j]
                # in process the memory side attends inside the submit; then the wait,
                # then the next slice on its output
                assert sub.t0 <= att.t0 <= att.t1 <= sub.t1 <= wait.t0 <= wait.t1 <= nxt.t0


def test_rotational_runs_one_micro_batch_while_the_other_attends(traced):
    """Paper 5.1 with n = 2 on one replica: slice i of micro-batch 1 runs after
    micro-batch 0's layer-i q/k/v went out and before its layer-i output is collected."""
    spans, L, steps = traced["rotational"]
    at = {(s.kind, s.layer, s.mb): s for s in spans if s.step == steps[-1]
          and s.lane == "compute0"}
    for i in range(L):
        assert at["submit", i, 0].t1 <= at["slice", i, 1].t0
        assert at["slice", i, 1].t1 <= at["wait", i, 0].t0


def test_bench_pipeline_writes_its_table_and_gantt(tmp_path):
    """`lamina bench pipeline` at its smallest: a row per mode asked (fixed: two
    replicas; rotational3, also two, is test_rotational's) with tokens/s and busy
    fractions read from the trace, JSON, Markdown and a Gantt PNG."""
    import json

    from lamina.bench.pipeline import bench_pipeline

    res = bench_pipeline(batches=(2,), contexts=(16,), modes=("none", "rotational", "fixed"),
                         steps=2, plot=tmp_path / "g.png", out_dir=tmp_path)
    assert [(r["batch"], r["context"], r["mode"]) for r in res["rows"]] == [
        (2, 16, "none"), (2, 16, "rotational"), (2, 16, "fixed")]
    for r in res["rows"]:
        two = r["mode"] == "fixed"
        replicas = {"compute0", "compute1"} if two else {"compute0"}
        assert r["tok_s"] > 0 and set(r["busy"]) == replicas | {"memory0"}
        assert all(0 < r["busy"]["memory0"] < r["busy"][c] <= 1 for c in replicas)
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "pipeline.json").read_text())["rows"][2]["mode"] == "fixed"
    assert "| 2 | 16 | fixed |" in (tmp_path / "pipeline.md").read_text()


def test_predicted_decode_rate_follows_the_simulators_step():
    """`predicted_tok_s` on hand-set per-op costs (2 layers): none runs dense, exchange
    and attention in series; rotational two half-batches staggered; fixed two replicas
    sharing the memory side (numbers by hand)."""
    from lamina.bench.pipeline import predicted_tok_s

    class Costs:
        layers = 2

        def dense_layer(self, tokens):
            return 1e-3 * tokens

        def head(self, rows):
            return 0.01

        def attention(self, queries, keys):
            return 1e-5 * keys

        def network(self, tokens, workers):
            return 0.002

        def step_overhead(self, rows):
            return 0.005

        def exchange_host(self, tokens):
            return 0.001

    # none: 2 x (dense 0.004 + host 0.001 + attention 0.004 + exchange 0.002 - host
    # 0.001) + head 0.01 + overhead 0.005 = 0.035 s for 4 tokens
    assert predicted_tok_s(Costs(), 4, 100, "none", 1) == pytest.approx(4 / 0.035)
    # rotational: halves of 2; period max(2 x 0.003, 2 x 0.003, 0.006) = 0.006 a layer,
    # a head per half: 2 x 0.006 + 0.02 + 0.005 = 0.037 s
    assert predicted_tok_s(Costs(), 4, 100, "rotational", 1) == pytest.approx(4 / 0.037)
    # rotational3: 3 parts of 2 over 2 replicas; a part's compute side 0.002 + 0.001,
    # remote 2 x 100 x 1e-5 + 0.001 = 0.003: the memory side binds, period 3 x 0.003
    # = 0.009; 2 x 0.009 + 3 heads 0.03 + 0.005 = 0.053 s for 6 tokens
    assert predicted_tok_s(Costs(), 6, 100, "rotational3", 1) == pytest.approx(6 / 0.053)
    # context 10: remote 0.0012 a part; the replicas bind: 3 x 0.003 / 2 = 0.0045 (one
    # part's chain 0.0042, the memory side 0.0036): 2 x 0.0045 + 0.035 = 0.044 s
    assert predicted_tok_s(Costs(), 6, 10, "rotational3", 1) == pytest.approx(6 / 0.044)
    # fixed: 2 replicas with 2 each; a replica's chain 0.002 + 0.001 + remote (2 x 100 x
    # 1e-5 + 0.001 = 0.003) = 0.006, the memory side 2 x 0.003: period 0.006; the heads
    # at once: 2 x 0.006 + 0.01 + 0.005 = 0.027 s
    assert predicted_tok_s(Costs(), 4, 100, "fixed", 1) == pytest.approx(4 / 0.027)
    # context 1000: remote 0.021 a replica, the memory side 0.042 binds (the chain
    # 0.024): 2 x 0.042 + 0.015 = 0.099 s
    assert predicted_tok_s(Costs(), 4, 1000, "fixed", 1) == pytest.approx(4 / 0.099)


def test_decode_case_times_full_batches_when_prefill_takes_many_steps():
    """4 prompts of 300 tokens at 512 tokens a step: the first sequences decode while
    the last are prefilled; every timed step must still decode all 4 (decode_case
    raises otherwise)."""
    from lamina import LLM
    from lamina.bench.pipeline import decode_case

    llm = LLM(num_kv_slots=4 * 400, prefix_caching=False, max_step_tokens=512)
    try:
        r = decode_case(llm, 4, 300, "none", steps=4)
        assert [t["seqs"] for t in list(llm.engine.step_timings)[-5:-1]] == [4] * 4
        assert r["tok_s"] > 0
    finally:
        llm.shutdown()
