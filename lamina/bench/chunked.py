"""How long a prompt arriving among decoding requests stalls them: `lamina bench chunked`.

Data in: a model, `streams` decoding requests, one long prompt of `prompt_tokens`, step
budgets (`max_step_tokens`). Data out: per budget, the decoding requests' median step
before the prompt came, their longest step while it was fed (their worst gap between
two tokens), the steps that fed it and its time to first token; JSON and Markdown.

Baseline: a budget that takes the whole prompt in one step (every prompt that fits the
budget is fed so). Ours: smaller budgets, the prompt fed in chunks over several steps.
One local engine per budget (prefix caching off; random token ids), `repeat` rounds,
medians.
"""
from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

from lamina.bench.common import _write, cpu_name


def stall(llm, streams: int, prompt_tokens: int, seed: int = 0, warm_steps: int = 6) -> dict:
    """`streams` requests decoding, then one `prompt_tokens` prompt added: -> the decode
    step before it (median, s), the longest step while it was fed (s), the steps that
    fed it, and its time to first token (s)."""
    from lamina import SamplingParams

    rng = random.Random(seed)
    eng = llm.engine
    ids = lambda n: [rng.randrange(1000, 20000) for _ in range(n)]  # noqa: E731
    keep = SamplingParams(max_tokens=4 * warm_steps + prompt_tokens, temperature=0,
                          ignore_eos=True)
    decoding = [eng.add_request(ids(16), keep) for _ in range(streams)]
    for _ in range(1 + warm_steps):  # their prefill, then decode steps
        eng.step()
    before = statistics.median(t["step_s"] for t in list(eng.step_timings)[-warm_steps:])
    t0, n0 = time.perf_counter(), len(eng.step_timings)
    long = eng.add_request(ids(prompt_tokens),
                           SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    done = False
    while not done:
        done = any(o.request_id == long for o in eng.step())
    ttft = time.perf_counter() - t0
    fed = [t["step_s"] for t in list(eng.step_timings)[n0:]]
    for rid in decoding:
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    return {"decode_step_s": before, "worst_step_s": max(fed), "steps": len(fed),
            "ttft_s": ttft}


def bench_chunked(model: str | None = None, streams: int = 8, prompt_tokens: int = 3072,
                  budgets: tuple[int, ...] = (1024, 512, 256), repeat: int = 3,
                  dtype: str = "bfloat16", out_dir: str | Path = "benchmarks/results") -> dict:
    """The baseline budget (the whole prompt in one step) and each of `budgets`."""
    from lamina import LLM

    rows = []
    for budget in (prompt_tokens + streams, *budgets):
        llm = LLM(model, executor="local", dtype=dtype, max_step_tokens=budget,
                  prefix_caching=False)
        try:
            runs = [stall(llm, streams, prompt_tokens, seed=r) for r in range(repeat)]
        finally:
            llm.shutdown()
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append({"max_step_tokens": budget, **med, "runs": runs})
        print(f"budget {budget}: decode step {med['decode_step_s'] * 1e3:.1f} ms, worst "
              f"{med['worst_step_s'] * 1e3:.1f} ms over {med['steps']:.0f} steps, prompt TTFT "
              f"{med['ttft_s'] * 1e3:.0f} ms", flush=True)
    base = rows[0]
    for r in rows:
        r["worst_vs_one_step"] = r["worst_step_s"] / base["worst_step_s"]
        r["ttft_vs_one_step"] = r["ttft_s"] / base["ttft_s"]
    res = {"cpu": cpu_name(), "dtype": dtype, "streams": streams,
           "prompt_tokens": prompt_tokens, "repeat": repeat, "rows": rows}
    table = [["max_step_tokens", "steps feeding the prompt", "decode step ms (before)",
              "worst step ms (while fed)", "worst x one step", "prompt TTFT ms",
              "TTFT x one step"]]
    for r in rows:
        table.append([f"{r['max_step_tokens']}" + (" (one step)" if r is base else ""),
                      f"{r['steps']:.0f}", f"{r['decode_step_s'] * 1e3:.1f}",
                      f"{r['worst_step_s'] * 1e3:.1f}", f"{r['worst_vs_one_step']:.2f}",
                      f"{r['ttft_s'] * 1e3:.0f}", f"{r['ttft_vs_one_step']:.2f}"])
    _write(Path(out_dir), "chunked", res, table)
    return res
