"""Workload generators and the slab-vs-page occupancy simulation (exact small cases)."""
import json
import statistics

import pytest

from lamina.costmodel.workload import (
    OccupancySample,
    scattered_tables,
    sharegpt_like,
    simulate_occupancy,
)
from lamina.entrypoints.cli import main


def test_sharegpt_like_is_deterministic_and_in_range():
    a, b = sharegpt_like(500, seed=1), sharegpt_like(500, seed=1)
    assert a == b and a != sharegpt_like(500, seed=2)
    assert all(4 <= p <= 4096 and 1 <= o <= 2048 for p, o in a)
    assert 150 < statistics.median(p for p, _ in a) < 400  # median ln-normal ~245


def test_scattered_tables_are_disjoint_scattered_and_sized():
    tables = scattered_tables([5, 300, 1000], 2000, seed=0)
    assert [len(t) for t in tables] == [5, 300, 1000]
    flat = [s for t in tables for s in t]
    assert len(set(flat)) == len(flat) and all(0 <= s < 2000 for s in flat)
    jumps = sum(1 for t in tables for x, y in zip(t, t[1:]) if y != x + 1)
    assert jumps > 200  # interleaved decode steps leave many non-adjacent neighbours


def test_occupancy_single_request_exact():
    s = simulate_occupancy([(3, 2)], max_batch=1, page_size=16)
    assert s == [OccupancySample(0, 4, 4, 16), OccupancySample(1, 5, 5, 16)]


def test_occupancy_parallel_sampling_shares_full_pages_and_copies_the_partial():
    s = simulate_occupancy([(20, 1)], max_batch=1, page_size=16, n_samples=2)
    # 20 prompt tokens shared + 1 own token per sample; slabs hold exactly that.
    # Pages: 1 shared full prompt page + per sample ceil((4 + 1) / 16) = 1 page.
    assert s == [OccupancySample(0, 22, 22, 48)]


def test_occupancy_batches_and_queues():
    s = simulate_occupancy([(1, 1), (1, 3), (2, 1)], max_batch=2, page_size=4)
    assert [x.live_tokens for x in s] == [4, 6, 4]  # third request waits for a seat
    assert all(x.slab_slots == x.live_tokens for x in s)


def test_bench_cli_quick_runs_write_json_and_markdown(tmp_path):
    assert main(["bench", "fragmentation", "--quick", "--out", str(tmp_path)]) == 0
    frag = json.loads((tmp_path / "fragmentation.json").read_text())
    assert [sc["n_samples"] for sc in frag["scenarios"]] == [1, 4]
    assert all(sc["mean_slab_waste_tokens"] == 0 for sc in frag["scenarios"])
    assert all(sc["mean_page_waste_tokens"] > 0 for sc in frag["scenarios"])
    assert main(["bench", "attention", "--quick", "--repeat", "2", "--out", str(tmp_path)]) == 0
    att = json.loads((tmp_path / "attention_t1.json").read_text())
    (row,) = att["rows"]
    assert (row["B"], row["L"]) == (8, 512) and att["threads"] == 1
    assert row["read_GBps"] >= att["bandwidth"]["read_GBps"]  # the stricter baseline
    assert 0 < row["ours_frac_of_read_bw"] < 1.5 and row["speedup_vs_sdpa"] > 0
    assert "| B | L |" in (tmp_path / "attention_t1.md").read_text()
    kv = json.loads((tmp_path / "kv_dtypes_t1.json").read_text())  # the KV dtype rows
    assert [r["kv"] for r in kv["rows"]] == ["float32", "bfloat16", "int8",
                                             "float32 topk 20%", "float32 topk 10%",
                                             "int8 topk 20%", "int8 topk 10%",
                                             "float32 topk 20% rescore 3",
                                             "int8 topk 20% rescore 3"]
    # SmolLM2's bytes per token: 30 layers x 3 kv heads x (K + V) x (64 x 4 B | 64 x 2 B |
    # 64 + a 4-byte scale); lines: aligned float rows, int8 K|V spans of 408 B; topk adds
    # its page bounds per 16 tokens: 30 layers x (min, max) x 3 x 64 fp32 = 2880 B, or
    # over int8 pools 30 x (2 x 3 x 64 codes + 3 x 4 B of scale) / 16 = 742.5 B
    assert [r["bytes_per_token"] for r in kv["rows"]] == [46080, 23040, 12240, 48960,
                                                          48960, 12982.5, 12982.5, 48960,
                                                          12982.5]
    assert [r["lines_per_key"] for r in kv["rows"]] == [24, 12, 7.25, 24, 24, 7.25, 7.25, 24,
                                                        7.25]
    assert kv["rows"][4]["read_per_token_vs_fp32"] == pytest.approx(0.1 + 2880 / 46080)
    # rescored: the selected 20% and the candidates' keys (3 x 20% of the K halves)
    assert kv["rows"][7]["read_per_token_vs_fp32"] == pytest.approx(
        0.2 + 2880 / 46080 + 0.3)
    assert all(r["ms"] > 0 for r in kv["rows"])
