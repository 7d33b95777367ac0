"""kv_pool_bytes buys as many slots as its bytes hold at the pool's dtype, and `lamina
bench kv-capacity` counts the sequences the engine actually admits at once: exactly
slots // length."""
import json

import pytest

from lamina.bench.kv_capacity import bench_kv_capacity
from lamina.engine.config import EngineConfig
from lamina.memory.pool import KVPoolConfig


def test_pool_bytes_set_the_slot_count():
    specs = [type("S", (), {"num_kv_heads": 3, "head_dim": 64, "v_head_dim": 64})()] * 30
    assert KVPoolConfig.for_specs(specs, 1, pool_bytes=46080 * 10 + 5).num_slots == 10
    assert KVPoolConfig.for_specs(specs, 1, "int8", pool_bytes=46080 * 10).num_slots == 37
    with pytest.raises(ValueError, match="kv_pool_bytes 100 holds no token: one takes 46080"):
        KVPoolConfig.for_specs(specs, 1, pool_bytes=100)
    with pytest.raises(ValueError, match="EngineConfig.kv_pool_bytes must be a positive int"):
        EngineConfig(kv_pool_bytes=0)


def test_kv_capacity_counts_admitted_sequences(tmp_path):
    """int8 (the counting is the same for every dtype; fp32's slot count is the
    for_specs check above): the engine holds exactly slots // length at once. With
    streaming at 20% the same pool holds several times as many: each sequence gives
    back the slots its window has passed at its first decode step."""
    budget, length = 6 << 20, 200
    res = bench_kv_capacity(pool_bytes=budget, length=length,
                            modes=("int8", "int8:streaming:0.2"), extra=2, out_dir=tmp_path)
    i8, sparse = res["rows"]
    assert (sparse["kv_sparsity"], sparse["kv_budget"], sparse["slots"]) == (
        "streaming", 0.2, i8["slots"])
    assert sparse["most_at_once"] >= 3 * i8["most_at_once"]
    # SmolLM2: 30 layers x 3 kv heads x (64 + 64) int8 codes + a 4-byte scale per row
    assert i8["bytes_per_token"] == 30 * 3 * 2 * 68 and i8["slots"] == budget // 12240
    assert i8["most_at_once"] == i8["slots"] // length == i8["expected"] == 2
    assert i8["preemptions"] == 0
    saved = json.loads((tmp_path / "kv_capacity.json").read_text())
    assert [r["most_at_once"] for r in saved["rows"]] == [2, sparse["most_at_once"]]
