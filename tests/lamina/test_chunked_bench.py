"""`lamina bench chunked`'s measurement on a real engine: a long prompt arriving among
decoding requests is fed over exactly as many steps as the budget left by the decodes
allows, and the engine is left as it was (every slot free)."""
from types import SimpleNamespace

from lamina.bench.chunked import stall
from tests.lamina.test_engine import engine


def test_stall_feeds_the_prompt_in_budget_sized_chunks(smol, smol_packed):
    for budget, steps in ((64, 5), (258, 1)):  # 64 - 2 decodes = 62 a step: 256 in 5
        eng = engine(smol, smol_packed, max_step_tokens=budget, prefix_caching=False)
        got = stall(SimpleNamespace(engine=eng), streams=2, prompt_tokens=256, warm_steps=2)
        assert got["steps"] == steps
        assert 0 < got["decode_step_s"] and got["worst_step_s"] <= got["ttft_s"]
        assert not eng.has_unfinished() and eng.free_slots() == [eng.config.num_kv_slots]
        fed = [t["tokens"] for t in eng.step_timings][-steps:]
        assert fed == [2 + min(budget - 2, 256 - (budget - 2) * i) for i in range(steps)]
