"""The data plane's q/k/v layout, old against new, paired:
`python benchmarks/bench_link.py [--tokens 1 8 32] [--repeat 30] [--batch 32] [--rounds 6]`.

Baseline "gathered": rows in plan order, gathered per memory worker, q/k/v as three
frames (the protocol before one-frame slices). Ours "slices": rows grouped by worker so
each worker's share is one slice of the packed order, q|k|v as one frame. On a local Ray
cluster (1 compute + 2 memory workers, SmolLM2, bf16 KV) two measurements, each taking
the layouts in turn (paired: the machine's drift hits both alike):
- exchange: the compute worker's `probe_exchange`, one layer's q/k/v out and outputs
  back for n tokens through the real link and memory-worker loop (each token attends to
  one slot: the kernel's share is tiny), warm in a loop;
- steps: `--batch` requests of 128 prompt tokens decoding greedily, `--rounds` rounds of
  32 new tokens per layout in turn; the median decode step (total, dense, attention:
  the compute side's submit + wait, i.e. data plane plus the kernels).
Writes JSON and Markdown (benchmarks/results/link.*).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from lamina import LLM, SamplingParams
from lamina.bench.common import _write
from lamina.bench.e2e import _prompts

LAYOUTS = ("gathered", "slices")
KEYS = ("step_s", "dense_s", "attention_s")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeat", type=int, default=30, help="passes over all layers")
    ap.add_argument("--runs", type=int, default=3, help="probe calls (medians of runs)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6, help="step rounds per layout")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    llm = LLM(None, dtype="bfloat16", kv_dtype="bfloat16", executor="ray",
              num_memory_workers=2, num_kv_slots=args.batch * 200 + 64,
              max_step_tokens=args.batch * 128)
    compute = llm.executor.compute
    import ray  # only to reach the compute worker's probe and layout switch

    runs, steps = [], {lay: [] for lay in LAYOUTS}
    prompts = _prompts(llm.loaded.tokenizer, args.batch, 128)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    try:
        ray.get(compute.probe_exchange.remote(args.tokens, 3, LAYOUTS))  # warm up
        for _ in range(args.runs):
            runs.append(ray.get(compute.probe_exchange.remote(args.tokens, args.repeat,
                                                              LAYOUTS)))
        llm.generate(prompts, params, use_tqdm=False)  # warm up
        for _ in range(args.rounds):
            for lay in LAYOUTS:
                ray.get(compute.set_layout.remote(lay))
                llm.engine.step_timings.clear()
                llm.generate(prompts, params, use_tqdm=False)
                steps[lay] += [s for s in llm.engine.step_timings
                               if s["tokens"] == args.batch and not s.get("failed")]
    finally:
        llm.shutdown()
    med = statistics.median
    res = {"tokens": args.tokens, "repeat": args.repeat, "runs": args.runs,
           "batch": args.batch, "rounds": args.rounds, "rows": []}
    table = [["case", "what", "gathered ms", "slices ms", "gathered / slices", "detail"]]
    for n in args.tokens:
        for key, what in (("exchange_s", "exchange / layer"), ("submit_s", "submit / layer")):
            per = {lay: [r[lay][key][n] * 1e3 for r in runs] for lay in LAYOUTS}
            g, s = med(per["gathered"]), med(per["slices"])
            res["rows"].append({"case": f"probe n={n}", "what": what, "gathered_ms": g,
                                "slices_ms": s, "ratio": g / s, "all": per})
            table.append([f"probe n={n}", what, f"{g:.3f}", f"{s:.3f}", f"{g / s:.2f}x",
                          "runs: " + ", ".join(f"{x:.3f}" for x in per["gathered"]) + "; " +
                          ", ".join(f"{x:.3f}" for x in per["slices"])])
    for key in KEYS:
        g, s = (med(t[key] for t in steps[lay]) * 1e3 for lay in LAYOUTS)
        res["rows"].append({"case": f"decode B={args.batch}", "what": key, "gathered_ms": g,
                            "slices_ms": s, "ratio": g / s})
        table.append([f"decode B={args.batch}", key, f"{g:.2f}", f"{s:.2f}", f"{g / s:.2f}x",
                      f"{len(steps['gathered'])} / {len(steps['slices'])} steps"])
    jp, mp = _write(Path(args.out), "link", res, table)
    print("\n".join(" | ".join(r) for r in table))
    print(f"wrote {jp} and {mp}")
    return res


if __name__ == "__main__":
    main(sys.argv[1:])
    sys.exit(0)
