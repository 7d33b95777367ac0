"""Multi-turn chat with and without KV reuse: `lamina bench multiturn`.

Data in: a generated multi-turn workload (below). Data out: per mode and turn index,
time to first token (p50 / p90), prompt tokens computed (prefill) and cached, decode
tok/s; JSON, Markdown and a PNG of TTFT by turn.

Workload (seeded, the same token ids in every mode): `sessions` conversations run
concurrently; each turn of every session is submitted together once the previous turn
of all of them finished (think time 0, in one process); a turn's prompt is the whole
history so far (a shared system prompt of `system` tokens, then each earlier turn's user
message and answer) plus a new user message of `user` tokens (uniform in
[user/2, 3*user/2]); answers are `answer` tokens, greedy, EOS ignored, so every mode
sees the same histories. Token ids are drawn uniformly from [1000, 20000).

Modes, each a fresh `LLM` in this process (the local executor): `no reuse` (prefix
caching off: every turn recomputes its whole history) and `pool` (automatic prefix
caching in the memory workers' pool, sized to hold every session). Not yet here: the
host / disk tiers with a working set beyond the pool, and vLLM's prefix cache.
"""
from __future__ import annotations

import platform
import random
import statistics
import time
from pathlib import Path

from lamina.bench.common import _write, pct

MODES = {"no reuse": False, "pool": True}


def workload(sessions: int, turns: int, system: int, user: int, seed: int = 0):
    """-> (system prompt ids, per session the user message ids of each turn)."""
    rng = random.Random(seed)

    def ids(n):
        return [rng.randrange(1000, 20000) for _ in range(n)]

    sys_ids = ids(system)
    msgs = [[ids(rng.randint(max(1, user // 2), max(1, 3 * user // 2)))
             for _ in range(turns)] for _ in range(sessions)]
    return sys_ids, msgs


def run_mode(llm, sys_ids, msgs, answer: int) -> list[list[dict]]:
    """Every session's turns through `llm`: -> per turn, one record per session."""
    from lamina import SamplingParams

    params = SamplingParams(max_tokens=answer, temperature=0, ignore_eos=True)
    history = [list(sys_ids) for _ in msgs]
    turns = []
    for t in range(len(msgs[0])):
        prompts = [h + m[t] for h, m in zip(history, msgs)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        recs = []
        for i, (p, o) in enumerate(zip(prompts, outs)):
            m = o.metrics
            decode_s = max(m["e2e_s"] - m["ttft_s"], 1e-9)
            recs.append({"session": i, "history": len(p), "cached": m["cached_tokens"],
                         "computed": len(p) - m["cached_tokens"], "ttft_s": m["ttft_s"],
                         "decode_tok_s": (len(o.token_ids) - 1) / decode_s,
                         "answer": list(o.token_ids), "turn_wall_s": wall})
            history[i] = p + list(o.token_ids)
        turns.append(recs)
    return turns


def summarize(turns: list[list[dict]]) -> list[dict]:
    return [{"turn": t + 1,
             "history_median": statistics.median(r["history"] for r in recs),
             "ttft_p50_s": pct([r["ttft_s"] for r in recs], 0.5),
             "ttft_p90_s": pct([r["ttft_s"] for r in recs], 0.9),
             "computed": sum(r["computed"] for r in recs),
             "cached": sum(r["cached"] for r in recs),
             "decode_tok_s": statistics.median(r["decode_tok_s"] for r in recs)}
            for t, recs in enumerate(turns)]


def bench_multiturn(model: str | None = None, sessions: int = 8, turns: int = 6,
                    system: int = 256, user: int = 400, answer: int = 32,
                    out_dir: str | Path = "benchmarks/results", plot: bool = True) -> dict:
    from lamina import LLM

    sys_ids, msgs = workload(sessions, turns, system, user)
    longest = system + sum(max(len(m[t]) for m in msgs) + answer for t in range(turns))
    slots = max(4096, sessions * (longest + 64))  # the pool holds every session (pool mode)
    res: dict = {"cpu": platform.processor() or platform.machine(),
                 "workload": {"sessions": sessions, "turns": turns, "system": system,
                              "user": user, "answer": answer, "think_time_s": 0,
                              "concurrency": sessions, "pool_slots": slots},
                 "modes": {}}
    answers = {}
    for mode, caching in MODES.items():
        llm = LLM(model, num_kv_slots=slots, prefix_caching=caching, max_step_tokens=4096)
        try:
            run_mode(llm, sys_ids, [msgs[0][:1]], 2)  # warm-up: first calls off the clock
            llm.engine.clear_prefix_cache()
            recs = run_mode(llm, sys_ids, msgs, answer)
        finally:
            llm.shutdown()
        answers[mode] = [[r["answer"] for r in t] for t in recs]
        res["modes"][mode] = summarize(recs)
        for row in res["modes"][mode]:
            print(mode, row, flush=True)
    res["same_answers"] = len({repr(a) for a in answers.values()}) == 1
    base, pool = res["modes"]["no reuse"], res["modes"]["pool"]
    later = range(1, turns)
    res["turns_2_plus"] = {
        "computed_ratio": (sum(pool[t]["computed"] for t in later)
                           / max(1, sum(base[t]["computed"] for t in later))),
        "ttft_p50_speedup": [base[t]["ttft_p50_s"] / pool[t]["ttft_p50_s"] for t in later]}
    table = [["mode", "turn", "history (median)", "TTFT p50 ms", "TTFT p90 ms",
              "prefill computed", "cached", "decode tok/s"]]
    table += [[mode, str(r["turn"]), f"{r['history_median']:.0f}",
               f"{1e3 * r['ttft_p50_s']:.1f}", f"{1e3 * r['ttft_p90_s']:.1f}",
               str(r["computed"]), str(r["cached"]), f"{r['decode_tok_s']:.1f}"]
              for mode, rows in res["modes"].items() for r in rows]
    jp, mp = _write(Path(out_dir), "multiturn", res, table)
    print("\n".join(" | ".join(r) for r in table))
    later2 = res["turns_2_plus"]
    print(f"turns >= 2: prefill computed with the pool cache = "
          f"{100 * later2['computed_ratio']:.1f}% of no reuse; TTFT p50 speedup by turn: "
          f"{', '.join(f'{x:.1f}x' for x in later2['ttft_p50_speedup'])}")
    if plot:
        _plot(res, Path(out_dir) / "multiturn.png")
    print(f"wrote {jp} and {mp}")
    return res


def _plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, rows in res["modes"].items():
        ax.plot([r["turn"] for r in rows], [1e3 * r["ttft_p50_s"] for r in rows], marker="o",
                label=mode)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_yscale("log")
    w = res["workload"]
    ax.set_title(f"{w['sessions']} sessions, {w['user']}-token turns, {res['cpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
