"""What priority scheduling buys urgent requests, and what it costs the rest.

    python benchmarks/priority_probe.py [--batch 16] [--low 32] [--high 8] [--repeat 3]
        [--dtype bfloat16] [--out DIR]

SmolLM2 on the local executor (`LLM(scheduling_policy="priority")`, CPU). A batch of
--batch is saturated by --low requests (chat prompts, 128 new tokens, `ignore_eos`);
after 8 steps --high requests arrive (32 new tokens each). Two runs, interleaved,
on one engine: "fcfs" (every request priority 0: with equal priorities the policy is
arrival order, exactly FCFS) and "priority" (the late ones priority 0, the rest 1: they
preempt running ones and go first). Reported per run (medians of --repeat): the late
requests' time to first token and to their last token, the others' end-to-end time,
the whole workload's wall time, and preemptions. The tokens are asserted equal between
the runs in float32 (greedy; in bfloat16 a CPU GEMM may round differently for another
row count, see speculative_probe.py). Writes priority_probe.json and .md into --out.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from lamina import LLM, SamplingParams
from lamina.bench.common import _write, cpu_name

TOPICS = ["the history of Rome", "how bees make honey", "why the sky is blue",
          "the rules of chess", "how volcanoes form", "the life of Mozart",
          "how a bicycle works", "the water cycle"]


def one_run(llm: LLM, low: list[str], high: list[str], urgent: bool) -> dict:
    eng = llm.engine
    long_ = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    lows = [eng.add_request(p, long_, priority=1 if urgent else 0) for p in low]
    outs: dict = {}
    for _ in range(8):
        outs.update((o.request_id, o) for o in eng.step() if o.finished)
    highs = [eng.add_request(p, short, priority=0) for p in high]
    while eng.has_unfinished():
        outs.update((o.request_id, o) for o in eng.step() if o.finished)
    wall = time.perf_counter() - t0
    med = statistics.median
    return {"high_ttft_s": med(outs[r].metrics["ttft_s"] for r in highs),
            "high_e2e_s": med(outs[r].metrics["e2e_s"] for r in highs),
            "low_e2e_s": med(outs[r].metrics["e2e_s"] for r in lows),
            "wall_s": wall,
            "preemptions": sum(outs[r].metrics["preemptions"] for r in lows + highs),
            "tokens": [outs[r].token_ids for r in lows + highs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--low", type=int, default=32)
    ap.add_argument("--high", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, max_batch=args.batch, scheduling_policy="priority")
    tok = llm.loaded.tokenizer

    def chat(text):
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)

    low = [chat(f"Tell me about {TOPICS[i % 8]} (question {i}).") for i in range(args.low)]
    high = [chat(f"Urgent {i}: name a colour.") for i in range(args.high)]
    llm.generate(low + high, SamplingParams(max_tokens=1), use_tqdm=False)  # warm, cache
    runs: dict[str, list[dict]] = {"fcfs": [], "priority": []}
    for _ in range(args.repeat):
        for mode in runs:
            runs[mode].append(one_run(llm, low, high, mode == "priority"))
    if args.dtype == "float32":
        assert runs["fcfs"][0]["tokens"] == runs["priority"][0]["tokens"], "tokens changed"
    keys = ("high_ttft_s", "high_e2e_s", "low_e2e_s", "wall_s", "preemptions")
    med = {m: {k: statistics.median(r[k] for r in rs) for k in keys} for m, rs in runs.items()}
    table = [["run", "late TTFT s", "late e2e s", "others' e2e s", "wall s", "preemptions"]]
    for m in runs:
        table.append([m, *(f"{med[m][k]:.2f}" for k in keys[:4]), f"{med[m]['preemptions']:.0f}"])
    table.append(["fcfs / priority", *(f"{med['fcfs'][k] / med['priority'][k]:.2f}x"
                                       for k in keys[:4]), ""])
    for row in table:
        print(" | ".join(row), flush=True)
    result = {"cpu": cpu_name(), "dtype": args.dtype, "batch": args.batch, "low": args.low,
              "high": args.high, "repeat": args.repeat, "medians": med}
    for path in _write(Path(args.out), "priority_probe", result, table):
        print("wrote", path)
    llm.shutdown()


if __name__ == "__main__":
    main()
