"""pipeline="auto" (engine/auto_pipeline.py): per step size class, both schedules are
tried alternately, the one with the lower median seconds per token is kept and logged,
re-tried after `recheck` steps; the engine runs it exactly (greedy tokens equal HF's
whatever the schedules chosen)."""
import logging
from types import SimpleNamespace

import pytest

from lamina import SamplingParams
from lamina.engine.auto_pipeline import AutoPipeline, Decision
from lamina.engine.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.executor.local import LocalExecutor
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig
from tests.conftest import HF_NEW


def plan(seqs: int, tokens_each: int = 1):
    """What AutoPipeline reads of a StepPlan: its sequences' tokens and their count."""
    return SimpleNamespace(seqs=[SimpleNamespace(token_ids=[0] * tokens_each)] * seqs,
                           num_tokens=seqs * tokens_each)


def run(auto, p, cost):
    """One step of `p`: the schedule auto picks, timed by cost(schedule)."""
    s = auto.schedule(p)
    auto.observe(p, s, cost[s] * p.num_tokens)
    return s


def test_trials_alternate_then_the_faster_schedule_stays(caplog):
    auto = AutoPipeline(batches=2, trials=2, recheck=3)
    big, small = plan(40), plan(5)
    # big decode steps: rotational 2 ms/token vs none 3; small ones the other way
    fast_rot, fast_none = {"none": 3e-3, "rotational": 2e-3}, {"none": 1e-3, "rotational": 4e-3}
    with caplog.at_level(logging.INFO, logger="lamina.engine"):
        ran = [run(auto, big, fast_rot) for _ in range(6)]
        assert [run(auto, small, fast_none) for _ in range(5)] == [
            "none", "rotational", "none", "rotational", "none"]
    assert ran == ["none", "rotational", "none", "rotational", "rotational", "rotational"]
    assert auto.micro_batches(big) == 2 and auto.micro_batches(small) == 1
    assert auto.decisions == {(True, 5): Decision("rotational", {"none": 3e-3, "rotational": 2e-3}),
                              (True, 2): Decision("none", {"none": 1e-3, "rotational": 4e-3})}
    logs = [r.getMessage() for r in caplog.records]
    assert logs == [
        "pipeline auto: decode steps of 32-63 tokens run rotational (median none 3.000 "
        "ms/token, rotational 2.000 ms/token)",
        "pipeline auto: decode steps of 4-7 tokens run none (median none 1.000 ms/token, "
        "rotational 4.000 ms/token)"]
    # recheck: 3 steps on the choice (2 ran above), then both again; the machine
    # changed, so the choice flips and is logged once
    assert run(auto, big, fast_rot) == "rotational"
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lamina.engine"):
        ran = [run(auto, big, fast_none) for _ in range(6)]
    assert ran == ["none", "rotational", "none", "rotational", "none", "none"]
    assert auto.decisions[True, 5].schedule == "none"
    assert len(caplog.records) == 1 and "32-63 tokens run none" in caplog.records[0].getMessage()


def test_one_sequence_and_prompt_steps():
    auto = AutoPipeline(batches=2, trials=1)
    assert auto.schedule(plan(1)) == "none" and auto.micro_batches(plan(1)) == 1
    auto.observe(plan(1), "none", 1.0)
    assert auto.decisions == {}
    # a step with prompt tokens is a class of its own
    assert AutoPipeline.size_class(plan(3, 100)) == (False, 8)
    assert AutoPipeline.size_class(plan(300)) == (True, 8)
    with pytest.raises(ValueError, match="batches >= 2"):
        AutoPipeline(batches=1)


def test_auto_engine_greedy_identical_to_hf(smol, smol_packed, prompts, hf_greedy):
    pool = KVPool(KVPoolConfig.for_specs(smol_packed.attention_specs, 8192))
    ex = LocalExecutor(smol_packed, [MemorySide(pool)])
    eng = LLMEngine(EngineConfig(num_kv_slots=8192, pipeline="auto"), ex, smol.tokenizer,
                    smol.config)
    greedy = SamplingParams(max_tokens=HF_NEW, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request(p, greedy) for p in prompts]
    done = {}
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert [done[i].token_ids for i in ids] == hf_greedy
    # 16 decoding sequences: their class tried both schedules and settled
    assert eng.auto is not None and (True, 4) in eng.auto.decisions
    assert set(eng.auto.decisions[True, 4].medians) == {"none", "rotational"}
