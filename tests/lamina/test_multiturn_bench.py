"""`lamina bench multiturn`'s workload and accounting on the real model: the same answers
with and without prefix caching, and with it each later turn computes exactly its new
user message (plus the last answer token, whose KV no step wrote) while the rest of the
history comes from the pool."""
import json

from lamina.bench.multiturn import _plot, run_mode, summarize, workload

from .test_engine import engine, run


class _Engine:
    """What `run_mode` needs of an `LLM`: generate over an engine on the test split."""

    def __init__(self, eng):
        self.engine = eng

    def generate(self, prompts, params, use_tqdm=False):
        return run(self.engine, prompts, params)


def test_later_turns_compute_only_the_new_message(smol, smol_packed, tmp_path):
    sys_ids, msgs = workload(sessions=3, turns=3, system=24, user=16, seed=1)
    answer = 3
    modes = {}
    for caching in (False, True):
        eng = engine(smol, smol_packed, num_kv_slots=4096, prefix_caching=caching)
        modes[caching] = run_mode(_Engine(eng), sys_ids, msgs, answer)
    off, on = modes[False], modes[True]
    assert [[r["answer"] for r in t] for t in off] == [[r["answer"] for r in t] for t in on]
    assert all(r["cached"] == 0 for t in off for r in t)
    for t in range(1, 3):
        for s in range(3):
            before, now = on[t - 1][s], on[t][s]
            assert now["history"] == before["history"] + answer + len(msgs[s][t])
            assert now["cached"] == before["history"] + answer - 1
            assert now["computed"] == len(msgs[s][t]) + 1
    rows = summarize(on)
    assert [r["computed"] for r in rows] == [sum(r["computed"] for r in t) for t in on]
    _plot({"modes": {"no reuse": summarize(off), "pool": rows}, "cpu": "x",
           "workload": {"sessions": 3, "user": 30}}, tmp_path / "m.png")
    assert (tmp_path / "m.png").stat().st_size > 1000
    json.dumps(rows)  # the summary is what the JSON file holds
