"""Decode throughput by KV dtype over Ray, end to end: `python
benchmarks/kv_dtype_e2e_probe.py [--kv-dtypes float32 int8] [--rounds 2]`.

SmolLM2 on the Ray executor (one memory worker, the C++ data plane), 32 greedy
requests of ~12 prompt tokens and 64 new tokens each, timed three times per process
(median); each KV dtype runs in a fresh process, the dtypes alternating over the rounds.
Short contexts: what it shows is the per-step cost of the memory end (an int8 pool
quantizes each new row and folds the keys' channel scales into q), not the kernel's
read savings, which grow with the context (`lamina bench attention`).
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def one(kv_dtype: str) -> float:
    from lamina import LLM, SamplingParams

    llm = LLM(executor="ray", num_memory_workers=1, kv_dtype=kv_dtype, max_batch=32)
    prompts = [f"Write a short story about a robot number {i} who" for i in range(32)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0))  # warm-up
    rates = []
    for _ in range(3):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs)
                     / (time.perf_counter() - t0))
    return statistics.median(rates)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv-dtypes", nargs="+", default=["float32", "int8"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child process's dtype
    args = ap.parse_args(argv)
    if args.one:
        print(f"RATE {one(args.one)}")
        return 0
    got = {d: [] for d in args.kv_dtypes}
    for _ in range(args.rounds):
        for d in args.kv_dtypes:
            out = subprocess.run([sys.executable, __file__, "--one", d], capture_output=True,
                                 text=True, check=True).stdout
            got[d].append(float(out.split("RATE ")[-1]))
            print(f"{d}: {got[d][-1]:.1f} tok/s", flush=True)
    base = statistics.median(got[args.kv_dtypes[0]])
    for d, r in got.items():
        print(f"{d}: median {statistics.median(r):.1f} tok/s, "
              f"x{statistics.median(r) / base:.3f} {args.kv_dtypes[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
