"""What preemption costs when a preempted sequence's KV stays cached, or is swapped.

    python benchmarks/preemption_probe.py [--batch 32] [--slots 3072] [--prompt 64]
                                          [--new 128] [--repeat 3] [--executor ray]
                                          [--memory-workers 2] [--out DIR]

SmolLM2 through `LLM` (local executor or --executor ray, one memory worker or
--memory-workers sharing --slots evenly, their KV split over them as it grows, CPU, one
torch thread). B requests of --prompt tokens (each "Request <b>:", then `lamina bench
e2e`'s text, so two share at most the few tokens before their numbers differ) and --new
tokens each (greedy, ignore_eos), in a pool of --slots token slots: too few for every
sequence at once, so
the scheduler preempts the newest sequences as the others grow. Side by side in one
process: `prefix_caching=False` (a preempted sequence recomputes its prompt and every
token it drew) and `prefix_caching=True` (its KV stays cached, evictable from its end
first; its readmission takes back what is left: `lamina/engine/scheduler.py`), then
the same with a host tier and `preemption_mode="swap"` (its KV is also saved to the
memory worker's host tier and loaded back at readmission: nothing recomputed). With
distinct prompts the cache has nothing else to reuse, so the difference is the
preempted sequences' own KV. Per setting: the wall time (median of --repeat), the
positions the steps fed (prompts + draws + recomputes), the positions readmissions
computed again, the preemptions, and whether the tokens equal the first setting's.
Nothing here is a target. Writes preemption_probe.json and .md into --out.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from lamina import LLM, SamplingParams
from lamina.bench.common import _write, cpu_name
from lamina.bench.e2e import TEXT


def distinct_prompts(tok, batch: int, n: int) -> list[list[int]]:
    """`batch` prompts of n tokens that differ within their first few (the text repeats
    every 16 tokens, so windows of it at offsets b and b + 16 would be equal)."""
    text = tok(TEXT)["input_ids"]
    return [(tok(f"Request {b}:")["input_ids"] + text)[:n] for b in range(batch)]


def run(llm: LLM, prompts: list[list[int]], new: int) -> dict:
    eng = llm.engine
    eng.step_timings.clear()
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0,
                                                ignore_eos=True), use_tqdm=False)
    return {"s": time.perf_counter() - t,
            "fed": sum(s["tokens"] for s in eng.step_timings),
            "preemptions": sum(o.metrics["preemptions"] for o in outs),
            "recomputed": sum(o.metrics["recomputed_tokens"] for o in outs),
            "tokens": [o.token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--slots", type=int, default=3072)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--executor", default="local", choices=["local", "ray"])
    ap.add_argument("--memory-workers", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows, table, want = [], [["setting", "s", "x", "positions fed", "recomputed",
                              "preemptions", "same tokens"]], None
    need = args.batch * (args.prompt + args.new)
    settings = {"caching off": {"prefix_caching": False},
                "caching on": {"preemption_mode": "recompute"},
                "caching on + swap to the host tier": {  # room for twice every sequence's KV
                    "preemption_mode": "swap", "kv_host_bytes": 2 * need * 48 * 1024}}
    for name, kw in settings.items():
        llm = LLM(executor=args.executor, num_memory_workers=args.memory_workers,
                  num_kv_slots=args.slots // args.memory_workers, max_batch=args.batch, **kw)
        prompts = distinct_prompts(llm.loaded.tokenizer, args.batch, args.prompt)
        runs = [run(llm, prompts, args.new) for _ in range(args.repeat)]
        llm.shutdown()
        want = want or runs[0]["tokens"]
        s = statistics.median(r["s"] for r in runs)
        row = {"setting": name, **kw, "s": s, "fed": runs[0]["fed"],
               "recomputed": runs[0]["recomputed"], "preemptions": runs[0]["preemptions"],
               "same_tokens": all(r["tokens"] == want for r in runs)}
        rows.append(row)
        table.append([name, f"{s:.2f}", f"{s / rows[0]['s']:.2f}", str(row["fed"]),
                      str(row["recomputed"]), str(row["preemptions"]),
                      "yes" if row["same_tokens"] else "NO"])
        print(" | ".join(table[-1]), flush=True)
    result = {"cpu": cpu_name(), "threads": 1, "executor": args.executor,
              "memory_workers": args.memory_workers, "batch": args.batch, "slots": args.slots,
              "kv_need": need, "prompt_tokens": args.prompt, "new_tokens": args.new,
              "repeat": args.repeat, "rows": rows}
    for path in _write(Path(args.out), "preemption_probe", result, table):
        print("wrote", path)


if __name__ == "__main__":
    main()
