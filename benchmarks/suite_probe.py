"""What one exactness check of the test suite costs on this CPU, and why.

    python benchmarks/suite_probe.py [--repeat 3] [--out DIR]

Most of the suite's time is its checks against HF greedy output: the 16 mixed-length
prompts of `tests/conftest.py` (2746 tokens) run to `HF_NEW` new tokens on a fresh
local engine (prefix caching off, so every run computes what a test's fresh engine
does), one torch thread, as each of the two xdist workers runs. This times the prompts'
prefill and the decode steps apart, and reads from torch's profiler how much of the
prefill is the dense linears and the rate they reach (FLOPs: 2 x in x out per row, from
the linears' shapes). Medians of --repeat. Nothing here is a target: it says whether
the suite's time on a machine is model math (then only fewer or smaller checks
shorten it) or overhead. Writes suite_probe.json and .md into --out.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lamina import LLM, SamplingParams
from lamina.bench.common import _write, cpu_name
from tests.conftest import HF_NEW, LENGTHS, TEXT


def linear_flops(model: torch.nn.Module, rows: int) -> float:
    """FLOPs of every decoder linear (not the LM head, which runs on last rows only) for
    `rows` tokens."""
    return sum(2.0 * m.in_features * m.out_features * rows
               for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and "lm_head" not in name)


def one_run(prompts, hf) -> dict:
    llm = LLM(num_memory_workers=2, prefix_caching=False)
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    acts = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=acts) as prof:
        t = time.perf_counter()
        llm.generate(prompts, first, use_tqdm=False)
        prefill = time.perf_counter() - t
    linear = sum(e.self_cpu_time_total for e in prof.key_averages()
                 if "linear" in e.key or e.key in ("aten::addmm", "aten::mm")) / 1e6
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=HF_NEW, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    whole = time.perf_counter() - t
    llm.shutdown()
    return {"prefill_s": prefill, "of which linears_s": linear,
            "linear_gflops": linear_flops(hf, sum(LENGTHS)) / linear / 1e9,
            f"prefill + {HF_NEW} tokens_s": whole}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from lamina.model.loader import load

    lm = load(None)
    ids = lm.tokenizer(TEXT)["input_ids"]
    prompts = [ids[:n] for n in LENGTHS]
    runs = [one_run(prompts, lm.model) for _ in range(args.repeat)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    result = {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": 1,
              "repeat": args.repeat, "prompt_tokens": sum(LENGTHS), "median": med}
    table = [["what", "median"]] + [[k, f"{v:.2f}"] for k, v in med.items()]
    for row in table[1:]:
        print(" | ".join(row), flush=True)
    for path in _write(Path(args.out), "suite_probe", result, table):
        print("wrote", path)


if __name__ == "__main__":
    main()
