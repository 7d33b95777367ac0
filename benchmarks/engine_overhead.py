"""What a decode step spends outside the executor: the engine's own Python (scheduling,
step plans, output processing) at a large batch, which on a GPU compute device runs
while the GPU waits. Local executor, default model, B prompts of ~16 tokens, greedy.

    python benchmarks/engine_overhead.py --batch 256 --steps 12 --rounds 3

Prints, per round, the median over the decode steps of the whole `LLMEngine.step`, of
the engine side (the step less `executor.execute`), of the compute side's per-step
bookkeeping inside `execute` (slot tables, packing, the link's step start) and the
step's own breakdown (`engine.step_timings`: dense, attention, sample), and the median
over the rounds.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time


def _timed_pieces(llm) -> dict[str, list[float]]:
    """Wrap the compute side's per-step bookkeeping (slot tables, packing, the link's
    step start) with timers; -> their times by piece."""
    from lamina.bench.common import clocked

    compute = llm.executor.compute
    pieces = {"tables": (compute.tables, "apply"), "pack": (compute, "_pack"),
              "begin": (llm.executor.link, "begin")}
    return {name: clocked(obj, method) for name, (obj, method) in pieces.items()}


def one_round(llm, B: int, steps: int, pieces: dict[str, list[float]]) -> dict:
    from lamina import SamplingParams

    eng, ex = llm.engine, llm.executor
    from lamina.bench.common import clocked

    inner = ex.execute  # put back after this round (rounds repeat)
    spent = clocked(ex, "execute")
    tok = llm.loaded.tokenizer
    sp = SamplingParams(max_tokens=steps + 1, ignore_eos=True, temperature=0.0)
    for i in range(B):
        eng.add_request(tok(f"Request {i}: tell me about the number {i}.")["input_ids"], sp)
    eng.step()  # the prefill
    spent.clear()
    eng.step_timings.clear()
    for v in pieces.values():
        v.clear()
    total = []
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        total.append(time.perf_counter() - t)
    ex.execute = inner
    eng.clear_prefix_cache()
    decode = [s for s in eng.step_timings if s["tokens"] == B]
    ms = {k: 1e3 * statistics.median(s.get(f"{k}_s", 0.0) for s in decode)
          for k in ("dense", "attention", "sample")}
    ms |= {k: 1e3 * statistics.median(v) for k, v in pieces.items() if v}
    return {"step_ms": 1e3 * statistics.median(total),
            "engine_ms": 1e3 * statistics.median(a - b for a, b in zip(total, spent)), **ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=12, help="decode steps a round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from lamina import LLM
    from lamina.bench.common import cpu_name

    B = args.batch
    llm = LLM(num_kv_slots=B * (args.steps + 40), max_batch=B, max_step_tokens=B * 64)
    pieces = _timed_pieces(llm)
    one_round(llm, min(B, 8), 2, pieces)  # warm-up
    rows = [one_round(llm, B, args.steps, pieces) for _ in range(args.rounds)]
    for r in rows:
        print(" ".join(f"{k}={v:.2f}" for k, v in r.items()))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"B={B}, {args.steps} decode steps x {args.rounds} rounds, {cpu_name()} "
          f"({platform.machine()}): median step {med['step_ms']:.1f} ms, engine side "
          f"{med['engine_ms']:.2f} ms; in execute: slot tables {med['tables']:.2f} ms, "
          f"packing {med['pack']:.2f} ms, the link's step start {med['begin']:.2f} ms")


if __name__ == "__main__":
    main()
