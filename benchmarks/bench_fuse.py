"""Fused pointwise chains against the plain slices, in the local engine's decode:
`python benchmarks/bench_fuse.py [--batch 1 32] [--rounds 6] [--steps 25]`.

One local `LLM` (SmolLM2, bf16, 2 torch threads) decodes B requests with 128-token
prompts; rounds of `--steps` steps alternate the compute side's split between the one
`LLM` builds (pointwise chains fused, `lamina.splitter.fuse`) and the same recipe with
`fuse=False`. Reported: the median over rounds of each round's median dense time and
step time. Writes JSON and Markdown (benchmarks/results/fuse.*).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

PROMPT = 128


def one_batch(B: int, rounds: int, steps: int, dtype: str) -> dict:
    from lamina import LLM, SamplingParams
    from lamina.bench.e2e import _prompts
    from lamina.model.prepare import prepare_split

    llm = LLM(None, dtype=dtype, kv_dtype=dtype, max_step_tokens=B * PROMPT,
              num_kv_slots=B * (PROMPT + rounds * 2 * steps + 16) + 64)
    comp = llm.engine.executor.compute
    splits = {"fused": comp.split,
              "plain": prepare_split(llm.loaded.model, "auto", llm.config.max_batch,
                                     fuse=False).split}
    eng = llm.engine
    for p in _prompts(llm.loaded.tokenizer, B, PROMPT):
        eng.add_request(p, SamplingParams(max_tokens=rounds * 2 * steps + 8,
                                          temperature=0, ignore_eos=True))
    for _ in range(4):  # prefill, warm-up
        eng.step()
    got = {k: {"dense": [], "step": []} for k in splits}
    for _ in range(rounds):
        for name, sp in splits.items():
            comp.split = sp
            eng.step_timings.clear()
            for _ in range(steps):
                eng.step()
            got[name]["dense"].append(statistics.median(s["dense_s"] for s in eng.step_timings))
            got[name]["step"].append(statistics.median(s["step_s"] for s in eng.step_timings))
    llm.shutdown()
    row = {"batch": B, "dtype": dtype}
    for name, g in got.items():
        row[f"{name}_dense_ms"] = statistics.median(g["dense"]) * 1e3
        row[f"{name}_step_ms"] = statistics.median(g["step"]) * 1e3
        row[f"{name}_dense_rounds_ms"] = [x * 1e3 for x in g["dense"]]
    row["dense_speedup"] = row["plain_dense_ms"] / row["fused_dense_ms"]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--rounds", type=int, default=6, help="rounds per split (alternating)")
    ap.add_argument("--steps", type=int, default=25, help="decode steps per round")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    from lamina.bench.common import _write

    torch.set_num_threads(2)
    rows = []
    for B in args.batch:
        r = one_batch(B, args.rounds, args.steps, args.dtype)
        rows.append(r)
        print(f"B={B} {args.dtype}: dense {r['plain_dense_ms']:.1f} ms plain, "
              f"{r['fused_dense_ms']:.1f} ms fused (x{r['dense_speedup']:.2f}); step "
              f"{r['plain_step_ms']:.1f} vs {r['fused_step_ms']:.1f} ms", flush=True)
    table = [["B", "dtype", "dense ms plain", "dense ms fused", "x", "step ms plain",
              "step ms fused"]]
    table += [[str(r["batch"]), r["dtype"], f"{r['plain_dense_ms']:.1f}",
               f"{r['fused_dense_ms']:.1f}", f"{r['dense_speedup']:.2f}",
               f"{r['plain_step_ms']:.1f}", f"{r['fused_step_ms']:.1f}"] for r in rows]
    jp, mp = _write(Path(args.out), "fuse", {"args": vars(args), "rows": rows}, table)
    print(f"wrote {jp} and {mp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
