"""Discrete-event simulator: exact timelines on hand-made costs, the staggered-pipeline
period, KV admission, Poisson arrivals, and measured-cost interpolation."""
import pytest

from lamina.costmodel.simulator import (
    MeasuredCosts,
    Request,
    SimConfig,
    poisson_workload,
    simulate,
    step_time,
)
from lamina.costmodel.workload import sharegpt_like


class FlatCosts:
    """dense 1 ms per layer per token, head 2 ms, attention 0.5 ms + 1 us per key, network
    0.1 ms per layer round trip; 2 layers."""

    layers = 2

    def dense_layer(self, tokens):
        return 1e-3 * tokens

    def head(self, rows):
        return 2e-3

    def attention(self, queries, keys):
        return 0.5e-3 + 1e-6 * keys

    def network(self, tokens, workers):
        return 0.1e-3

    def step_overhead(self, rows):
        return 0.0

    def exchange_host(self, tokens):
        return 0.0


def test_single_request_timeline_exact():
    cfg = SimConfig(replicas=1, memory_per_replica=1)
    r = simulate(FlatCosts(), cfg, [Request(1.0, 4, 3)])
    # prefill: 4 tokens, causal keys 10; then 2 decode steps over 5 and 6 keys
    prefill = 2 * (4e-3 + 0.5e-3 + 10e-6 + 0.1e-3) + 2e-3
    dec = [2 * (1e-3 + 0.5e-3 + k * 1e-6 + 0.1e-3) + 2e-3 for k in (5, 6)]
    assert r.ttft_s["p50"] == pytest.approx(prefill)
    assert r.tpot_s["p50"] == pytest.approx(sum(dec) / 2)
    assert r.makespan_s == pytest.approx(1.0 + prefill + sum(dec))
    assert r.output_tokens == 3 and r.steps == 3
    assert r.decode_tok_s == pytest.approx(2 / sum(dec))
    busy = 2 * (4e-3 + 1e-3 + 1e-3) + 3 * 2e-3  # dense per layer x 2 layers + heads
    assert r.compute_util_by_replica == pytest.approx((busy / r.makespan_s,))
    attn = 2 * (0.5e-3 + 10e-6 + 0.5e-3 + 5e-6 + 0.5e-3 + 6e-6)
    assert r.memory_util_by_device == pytest.approx((attn / r.makespan_s,))


def test_a_prompt_longer_than_the_step_budget_is_fed_in_chunks_exact():
    """A 10-token prompt, 4 tokens a step: chunks of 4, 4, 2 (the last draws the first
    token), each attending the keys fed before it, then one decode step over 11 keys."""
    cfg = SimConfig(replicas=1, memory_per_replica=1, max_step_tokens=4)
    r = simulate(FlatCosts(), cfg, [Request(0.0, 10, 2)])
    # keys read: chunk 0..3: 1+2+3+4; chunk 4..7: 5+6+7+8; chunk 8..9: 9+10
    chunks = [2 * (n * 1e-3 + 0.5e-3 + k * 1e-6 + 0.1e-3) for n, k in ((4, 10), (4, 26),
                                                                       (2, 19))]
    ttft = sum(chunks) + 2e-3  # the head runs on the last chunk's row only
    dec = 2 * (1e-3 + 0.5e-3 + 11e-6 + 0.1e-3) + 2e-3
    assert r.ttft_s["p50"] == pytest.approx(ttft)
    assert r.makespan_s == pytest.approx(ttft + dec)
    assert r.steps == 4 and r.output_tokens == 2


def test_rotational_period_is_the_busier_side():
    cfg = SimConfig(memory_per_replica=1, pipeline="rotational")
    t, dense, attn = step_time(FlatCosts(), cfg, [], [[10, 10, 10, 10]], [], 4)
    d, a = 2e-3, 0.5e-3 + 20e-6 + 0.1e-3  # per half: 2 tokens, 20 keys
    assert t == pytest.approx(2 * max(2 * d, 2 * a, d + a) + 2 * 2e-3)
    slow = FlatCosts()
    slow.exchange_host = lambda tokens: 0.05e-3  # compute-thread part of the exchange
    t2 = step_time(slow, cfg, [], [[10, 10, 10, 10]], [], 4)[0]
    assert t2 == pytest.approx(2 * 2 * (d + 0.05e-3) + 2 * 2e-3)
    assert dense == pytest.approx(2 * 2 * d + 2 * 2e-3)
    none = step_time(FlatCosts(), SimConfig(memory_per_replica=1), [], [[10] * 4], [], 4)[0]
    assert none == pytest.approx(2 * (4e-3 + 0.5e-3 + 40e-6 + 0.1e-3) + 2e-3)


@pytest.mark.parametrize("keys", [10, 1000])
def test_fixed_period_is_one_replicas_chain_or_the_shared_memory(keys):
    """Fixed: 2 replicas on their own devices, 2 requests each; the memory device serves
    them one at a time. Short contexts: one replica's chain (dense, then attention)
    sets the period; long ones: the memory device's two attentions (the bubbles)."""
    cfg = SimConfig(memory_per_replica=1, pipeline="fixed", batches=2)
    t, dense, attn = step_time(FlatCosts(), cfg, [], [[keys] * 4], [], 4)
    d, a = 2e-3, 0.5e-3 + 2 * keys * 1e-6 + 0.1e-3  # per replica: 2 tokens, 2 x keys
    period = d + a if keys == 10 else 2 * a
    assert max(d + a, 2 * a) == period
    assert t == pytest.approx(2 * period + 2e-3)  # the replicas' heads run at once
    assert dense == pytest.approx(2 * 2 * d + 2 * 2e-3)
    assert attn == pytest.approx([2 * 2 * (0.5e-3 + 2 * keys * 1e-6)])


def test_kv_capacity_queues_requests_and_loses_none():
    reqs = [Request(0.0, 10, 5), Request(0.0, 10, 5), Request(0.0, 10, 5)]
    cfg = SimConfig(memory_per_replica=1, kv_tokens_per_device=30)  # room for two at a time
    r = simulate(FlatCosts(), cfg, reqs)
    assert r.output_tokens == 15 and r.requests == 3
    solo = simulate(FlatCosts(), cfg, reqs[:2])
    assert r.ttft_s["p99"] > solo.makespan_s * 0.99  # the third waits for a slot to free
    with pytest.raises(ValueError, match="needs 40 KV tokens"):
        simulate(FlatCosts(), cfg, [Request(0.0, 30, 10)])


def test_replicas_share_load():
    reqs = [Request(0.0, 8, 20)] * 8
    one = simulate(FlatCosts(), SimConfig(replicas=1, max_batch=4), reqs)
    four = simulate(FlatCosts(), SimConfig(replicas=4, max_batch=4), reqs)
    assert four.makespan_s < one.makespan_s / 2
    assert four.output_tokens == one.output_tokens == 160


def test_poisson_workload():
    reqs = poisson_workload(4000, rate_per_s=50.0, seed=3)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:])]
    assert all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.05)
    assert [(r.prompt, r.output) for r in reqs] == sharegpt_like(4000, 3)
    assert poisson_workload(10, 5.0, seed=1) == poisson_workload(10, 5.0, seed=1)


def test_measured_costs_interpolate():
    calib = {"layers": 30, "dense_layer_s": {"1": 1.0, "4": 2.5, "8": 4.5},
             "head_s": {"1": 0.1, "8": 0.8}, "attention_s0": 1e-5,
             "attention_s_per_key": 1e-9, "net_s0": 1e-4, "net_s_per_byte": 1e-10,
             "net_bytes_per_token_layer": 1000}
    c = MeasuredCosts(calib)
    assert c.dense_layer(4) == 2.5 and c.dense_layer(2) == pytest.approx(1.5)
    assert c.dense_layer(16) == pytest.approx(8.5)  # extrapolates the last segment
    assert c.head(4) == pytest.approx(0.4)
    assert c.attention(1, 1000) == pytest.approx(1e-5 + 1e-6)
    assert c.network(10, 2) == pytest.approx(1e-4 + 1e-10 * 5000)
    assert c.step_overhead(8) == 0.0
    c = MeasuredCosts({**calib, "exchange_s": {"1": 1e-3, "9": 2e-3},
                       "call_s": {"1": 1e-3, "8": 2e-3}, "sample_s": {"1": 0.0, "8": 1e-3}})
    assert c.network(5, 2) == pytest.approx(1.5e-3) and c.step_overhead(8) == 3e-3
    with pytest.raises(ValueError, match="bad calibration"):
        MeasuredCosts({"layers": 30})


def test_config_errors():
    with pytest.raises(ValueError, match="pipeline"):
        SimConfig(pipeline="zigzag")
    with pytest.raises(ValueError, match="replicas"):
        SimConfig(replicas=0)


class _HandCosts:
    """Per-layer costs set by hand: dense 1 ms a token, attention 10 us a key read."""

    layers = 1

    def dense_layer(self, tokens):
        return 1e-3 * tokens

    def attention(self, queries, keys):
        return 1e-5 * keys

    def network(self, tokens, workers):
        return 0.0


def test_balance_rule_picks_the_fewest_memory_devices_that_keep_up():
    """Paper 5.1: t_a <= t_m / (n - 1). B = 16, n = 2: sub-batches of 8 (t_m 8 ms).
    300 keys each: one device 24 ms, two 12 ms, three (3 requests on the busiest)
    9 ms, four 6 ms -> 4. n = 3: sub-batches of 5 (t_m 5 ms, budget 2.5 ms): 5 devices
    (one request each, 3 ms) are too slow, so the cap; at 200 keys 5 devices (2 ms)."""
    from lamina.costmodel.simulator import balance_memory_devices

    c = _HandCosts()
    assert balance_memory_devices(c, 16, 300, 2) == 4
    assert balance_memory_devices(c, 16, 100, 2) == 1  # 8 ms: exactly t_m
    assert balance_memory_devices(c, 16, 300, 3, most=9) == 9
    assert balance_memory_devices(c, 16, 200, 3) == 5


def test_paper_predictions_cover_table_3_and_pipelining_pays_at_large_batches(tmp_path):
    """`lamina bench pipeline --paper`: a row per Table 3 setting, context and batch;
    none and rotational n = 2 on the same (balanced) memory devices, which hold the
    batch's KV; rotational's gain grows with the batch (the small sub-batches' MFU
    costs less), and the Markdown table is written."""
    import math

    from lamina.bench.pipeline import paper_predictions
    from lamina.costmodel.catalog import load_catalog, model_shape

    res = paper_predictions(batches=(16, 1024), contexts=(1024,), out_dir=tmp_path)
    rows = {(r["model"], r["batch"]): r for r in res["rows"]}
    assert sorted(rows) == [(m, b) for m in ("llama-13b", "llama-33b", "llama-65b")
                            for b in (16, 1024)]
    gb = load_catalog()["a100-80g"].memory_gb * 1e9 * 0.9
    for (m, b), r in rows.items():
        kv = model_shape(m).kv_bytes_per_token() * 1024 * b
        assert r["memory_devices"] >= math.ceil(kv / gb)
        assert r["gain"] == r["rotational_tok_s"] / r["none_tok_s"]
    for m in ("llama-13b", "llama-33b", "llama-65b"):
        assert rows[m, 1024]["gain"] > rows[m, 16]["gain"]
        assert rows[m, 1024]["gain"] > 1.0
    assert "| llama-65b | 4 | 1024 | 1024 |" in (tmp_path / "pipeline_paper.md").read_text()
