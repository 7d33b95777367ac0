"""The KV pool's autoscaler: its rule over exact samples, its configuration, and a
serving loop whose pool it grows under pressure and shrinks once idle (HF's tokens)."""
import threading
import time

import pytest

from lamina.engine.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.entrypoints.autoscale import (
    AutoscaleConfig,
    Autoscaler,
    AutoscaleRunner,
    KeepSize,
    KVSample,
    sample,
)
from lamina.entrypoints.deploy_config import LaminaConfig
from lamina.entrypoints.engine_loop import EngineLoop
from lamina.entrypoints.metrics import EngineMetrics
from lamina.executor.local import LocalExecutor
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.sampling.params import SamplingParams

CFG = AutoscaleConfig(max_memory_workers=3, min_memory_workers=1, interval_s=1,
                      up_utilization=0.9, up_after_s=3, down_utilization=0.5,
                      down_after_s=5, cooldown_s=4)


def at(t, workers=1, used=0, waiting=0, preemptions=0, slots=100, needed=0) -> KVSample:
    return KVSample(float(t), workers, slots, used, waiting, preemptions, needed)


def test_one_more_worker_only_after_a_whole_window_of_full_pools_with_demand_unmet():
    a = Autoscaler(CFG)
    assert [a.observe(at(t, used=95, waiting=1)) for t in range(3)] == [None] * 3
    assert a.observe(at(3, used=95, waiting=1)) == 2  # 3 s of >= 90% with one waiting
    assert "waiting or preempted" in a.why
    # the new count's samples from 4 s: their window covers 3 s at 7 s, when the
    # cooldown (4 s from 3 s) ends too
    assert [a.observe(at(t, 2, used=190, waiting=2)) for t in range(4, 8)] == [None] * 3 + [3]
    assert [a.observe(at(t, 3, used=290, waiting=5)) for t in range(8, 30)] == [None] * 22


def test_full_pools_alone_are_no_reason_and_a_dip_restarts_the_window():
    a = Autoscaler(CFG)
    # full, but nobody waits or is preempted: the pool is just well used
    assert [a.observe(at(t, used=99)) for t in range(6)] == [None] * 6
    a = Autoscaler(CFG)
    seen = [a.observe(at(t, used=95 if t != 2 else 80, waiting=1)) for t in range(7)]
    assert seen == [None] * 6 + [2]  # the dip at 2 s is in each 3 s window until 6 s
    a = Autoscaler(CFG)  # a preemption in the window is unmet demand too
    assert [a.observe(at(t, used=95, preemptions=t // 2)) for t in range(4)] == \
        [None, None, None, 2]


def test_one_fewer_when_a_whole_window_would_fit_one_fewer_at_half():
    a = Autoscaler(CFG)
    seen = [a.observe(at(t, 3, used=100)) for t in range(6)]  # 100 <= 0.5 * 2 * 100
    assert seen == [None] * 5 + [2] and "fit 2 workers" in a.why
    a = Autoscaler(CFG)
    assert [a.observe(at(t, 3, used=101)) for t in range(8)] == [None] * 8
    a = Autoscaler(CFG)  # anyone waiting in the window keeps it
    assert [a.observe(at(t, 3, used=10, waiting=t == 4)) for t in range(8)] == [None] * 8
    a = Autoscaler(CFG)  # never below the minimum
    assert [a.observe(at(t, 1)) for t in range(10)] == [None] * 10


def test_a_sequence_waiting_for_more_workers_gets_them_at_once():
    """A sample naming the workers a waiting sequence needs (`Scheduler.short`): the
    pool grows to them at that sample, in a cooldown too and by more than one; a need
    past the maximum (not admitted: cannot happen) changes nothing by itself."""
    a = Autoscaler(CFG)
    assert a.observe(at(0, 1, waiting=1, needed=3)) == 3
    assert a.why == "a waiting sequence needs 3 memory workers' pools"
    a = Autoscaler(CFG)
    assert [a.observe(at(t, used=95, waiting=1)) for t in range(4)] == [None] * 3 + [2]
    assert a.observe(at(4, 2, waiting=1, needed=3)) == 3  # 1 s into a 4 s cooldown
    assert Autoscaler(CFG).observe(at(0, 1, waiting=1, needed=4)) is None


def test_outside_the_bounds_it_comes_back_to_them():
    a = Autoscaler(AutoscaleConfig(max_memory_workers=4, min_memory_workers=2))
    assert a.observe(at(0, 1)) == 2 and a.why == "outside the bounds"
    assert Autoscaler(AutoscaleConfig(max_memory_workers=4)).observe(at(0, 6)) == 4


@pytest.mark.parametrize("kw,match", [
    (dict(max_memory_workers=2, min_memory_workers=3), "min_memory_workers <= max"),
    (dict(max_memory_workers=2, min_memory_workers=0), "1 <= min_memory_workers"),
    (dict(max_memory_workers=2, interval_s=0), "interval_s must be > 0"),
    (dict(max_memory_workers=2, up_after_s=-1), "up_after_s must be a number"),
    (dict(max_memory_workers=2, grow_wait_s=float("inf")), "grow_wait_s must be a number"),
    (dict(max_memory_workers=2, up_utilization=1.5), r"up_utilization must be in \(0, 1\]"),
    (dict(max_memory_workers=2, down_utilization=0.95), "would grow and shrink in turn"),
])
def test_bad_settings_are_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        AutoscaleConfig(**kw)


def test_the_deployment_file_has_an_autoscale_section():
    cfg = LaminaConfig.from_dict({"autoscale": {"max_memory_workers": 6, "cooldown_s": 30}})
    assert cfg.autoscale == AutoscaleConfig(max_memory_workers=6, cooldown_s=30)
    assert cfg.autoscale.enabled and not LaminaConfig().autoscale.enabled
    with pytest.raises(ValueError, match="unknown key 'autoscale.max_workers'"):
        LaminaConfig.from_dict({"autoscale": {"max_workers": 6}})


def _engine(smol, split, slots: int) -> LLMEngine:
    cfg = EngineConfig(num_memory_workers=1, num_kv_slots=slots, max_step_tokens=2048)
    pool = KVPool(KVPoolConfig.for_specs(split.attention_specs, slots))
    return LLMEngine(cfg, LocalExecutor(split, [MemorySide(pool)]), smol.tokenizer,
                     smol.config)


def test_a_serving_loop_grows_its_pool_under_pressure_and_shrinks_it_idle(
        smol, smol_packed, prompts, hf_greedy):
    """One worker of 150 slots and eight prompts of 9-128 tokens (starts of one text,
    which the prefix cache shares) growing by 32: sequences wait and are preempted, so
    the autoscaler adds workers (up to 3) while they run; once they are done and the
    pools idle, it takes them away again, one at a time, down to 1. Every request
    gives HF's greedy tokens."""
    eng = _engine(smol, smol_packed, 150)
    loop = EngineLoop(eng)
    cfg = AutoscaleConfig(max_memory_workers=3, min_memory_workers=1, interval_s=0.05,
                          up_utilization=0.6, up_after_s=0.1, down_utilization=0.3,
                          down_after_s=0.3, cooldown_s=0.2)
    runner = AutoscaleRunner(loop, cfg)
    try:
        pick = [1, 3, 4, 10, 11, 12, 2, 9]  # 9-128 tokens
        futs = [loop.submit(prompts[i], SamplingParams(max_tokens=32, temperature=0))
                for i in pick]
        outs = [f.result(300) for f in futs]
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy[i] for i in pick]
        deadline = time.monotonic() + 60
        while len(eng.allocs) > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        steps = [(c.done.before, c.done.after) for c in runner.changes]
        assert steps[0] == (1, 2) and (2, 3) in steps and steps[-2:] == [(3, 2), (2, 1)]
        assert all(abs(b - a) == 1 for a, b in steps) and runner.error is None
        assert len(eng.allocs) == len(eng.executor.memory) == 1
        assert loop.call(sample).result(10).used == 0
    finally:
        runner.stop()
        loop.shutdown()


def test_a_prompt_larger_than_the_pool_grows_it_to_its_size(smol, smol_packed, prompts,
                                                            hf_greedy):
    """One worker of 100 slots, autoscaled up to 3 (split KV): a 200-token prompt is
    taken, as it fits three pools; the next sample grows the pool to 3 at once, and the
    request gives HF's greedy tokens. With the runner stopped, a prompt larger than the
    pools there are is refused again."""
    eng = _engine(smol, smol_packed, 100)
    loop = EngineLoop(eng)
    cfg = AutoscaleConfig(max_memory_workers=3, interval_s=0.05, down_after_s=600,
                          cooldown_s=600)
    runner = AutoscaleRunner(loop, cfg)
    try:
        greedy = SamplingParams(max_tokens=32, temperature=0)
        assert loop.submit(prompts[5], greedy).result(300).outputs[0].token_ids == hf_greedy[5]
        assert [(c.done.before, c.done.after) for c in runner.changes] == [(1, 3)]
        assert runner.changes[0].why == "a waiting sequence needs 3 memory workers' pools"
    finally:
        runner.stop()
    try:
        with pytest.raises(ValueError, match=r"prompt has 300 tokens; the KV pools hold 300$"):
            loop.submit(prompts[6], SamplingParams(max_tokens=4))
    finally:
        loop.shutdown()


def _until(cond, what, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what()
        time.sleep(0.02)


def test_a_keeper_grows_the_engine_back_to_its_size_as_the_cluster_makes_room(
        smol, smol_packed, prompts, hf_greedy):
    """An engine of one memory worker whose size is 3 (as after a recovery dropped two);
    what its executor says the cluster holds (`memory_workers_room`, asked with the
    size) decides, every 0.05 s. A serving loop over it takes the keeper over (its
    grows go between the loop's steps). Room for 1: nothing. Room for 2 with the
    start failing: the reason, the wait doubling; then started: 2 while requests
    stream, the reason now the room. Room for 3: the size, no reason left; the size
    itself unchanged throughout. HF's greedy tokens for every request. An executor
    that cannot tell (None) ends its thread; the loop's shutdown stops it."""
    eng = _engine(smol, smol_packed, 400)
    ex, room, asked = eng.executor, [1], []
    start = ex.start_memory_workers

    def broken(first, k):
        raise RuntimeError(f"no room for {k} on node-x")
    ex.memory_workers_room = lambda size: asked.append(size) or room[0]
    eng.keeper = mine = KeepSize(lambda: eng, lambda: 3, lambda fn: fn(eng), threading.Lock(),
                                 0.05, "the test engine", why="two lost")
    loop = EngineLoop(eng)
    keeper = eng.keeper
    try:
        assert keeper is not mine and not mine.running and keeper.running
        _until(lambda: len(asked) >= 3, lambda: asked)
        assert set(asked) == {3} and len(eng.allocs) == 1
        assert (keeper.missing(), keeper.why, keeper.failed) == (2, "two lost", None)
        metrics = EngineMetrics()  # `lamina serve`'s and the service's gauge
        metrics.keep_size(keeper)
        assert "\nlamina_memory_workers_missing 2.0\n" in metrics.render().decode()
        ex.start_memory_workers = broken
        room[0] = 2
        _until(lambda: (keeper.failed or "").endswith("next try in 0.2 s"),
               lambda: keeper.failed)
        assert keeper.failed == "RuntimeError: no room for 1 on node-x; next try in 0.2 s"
        assert keeper.why == "two lost"
        futs = [loop.submit(prompts[i], SamplingParams(max_tokens=32, temperature=0))
                for i in (1, 3, 4)]
        ex.start_memory_workers = start
        _until(lambda: len(eng.allocs) == 2, lambda: keeper.failed)
        _until(lambda: keeper.failed is None, lambda: keeper.failed)
        assert keeper.why == ("grew back to 2: the cluster's resources hold no more now")
        assert keeper.missing() == 1
        room[0] = 3
        outs = [f.result(300) for f in futs]
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy[i] for i in (1, 3, 4)]
        _until(lambda: len(eng.allocs) == 3, lambda: keeper.failed)
        assert (keeper.why, keeper.failed, keeper.missing()) == (None, None, 0)
        assert len(ex.memory) == 3 and eng.config.num_memory_workers == 3
        assert loop.submit(prompts[2], SamplingParams(max_tokens=32, temperature=0)).result(
            300).outputs[0].token_ids == hf_greedy[2]
        keeper.size = lambda: 4  # one more than there is room for: it asks, unanswered
        ex.memory_workers_room = lambda size: None
        _until(lambda: not keeper.running, lambda: keeper.failed)
        assert len(eng.allocs) == 3 and keeper.missing() == 1
        keeper.size = lambda: 3
        eng.keeper = keeper.through()  # (its size and between; running again)
        assert eng.keeper.running and eng.keeper.between is keeper.between
    finally:
        loop.shutdown()
    assert not eng.keeper.running
