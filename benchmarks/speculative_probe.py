"""What n-gram speculative decoding buys and costs (`lamina/engine/speculative.py`).

    python benchmarks/speculative_probe.py [--batch 1 8 32] [--tokens 4] [--repeat 3]
        [--dtype bfloat16] [--workloads copy code chat json] [--out DIR]

SmolLM2 on the local executor (`LLM`, CPU, one memory worker). Four workloads of B
requests each, greedy, 128 new tokens (`ignore_eos`, so both runs draw as many):
"copy" (repeat a given passage: answers that copy their context), "code" (write out a
given function with one change), "chat" (open questions: little to copy, what drafts
cost when they miss), and "json" (a record's fields extracted under a JSON schema, to
its end: drafts of the tokens the grammar forces, or n-gram drafts it takes). One
engine, its drafts switched on and off between runs (`Scheduler.propose`), the runs
interleaved; the prompts' KV comes from the prefix cache after the first run, so the
times are decode's. Reported per workload and B: wall time without and with drafts
(medians of --repeat), their ratio, guessed tokens kept (%), and the tokens drawn per
step and decoding sequence. In float32 the tokens of both runs must be equal
(asserted); in bfloat16 a CPU's GEMM may round differently for another number of rows
(AMX's does), so a near-tie can go the other way: the answers equal to no drafts' are
counted ("same %"). Writes speculative_probe.json and .md into --out.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from lamina import LLM, SamplingParams, StructuredOutputs
from lamina.bench.common import _write, cpu_name

PASSAGE = ("The printing press changed how knowledge spread across Europe. Before it, books "
           "were copied by hand, slowly and at great cost, and few people could own one. "
           "Movable type let printers set a page once and print it many times, so the "
           "price of books fell and more people learned to read. ")
CODE = ('def parse_config(path):\n    """Read a key = value file into a dict."""\n'
        '    result = {}\n    with open(path) as f:\n        for line in f:\n'
        '            line = line.strip()\n            if not line or line.startswith("#"):\n'
        '                continue\n            key, _, value = line.partition("=")\n'
        '            result[key.strip()] = value.strip()\n    return result\n')
RECORD = {"type": "object", "properties": {
    "name": {"type": "string"}, "email": {"type": "string"}, "city": {"type": "string"},
    "plan": {"enum": ["free", "pro", "team"]}},
    "required": ["name", "email", "city", "plan"], "additionalProperties": False}
NAMES = ["Alice Johnson", "Bob Lee", "Carla Diaz", "Dan Moore", "Eve Adams", "Fay Wong",
         "Gus Hill", "Hana Sato"]
TOPICS = ["the history of Rome", "how bees make honey", "why the sky is blue",
          "the rules of chess", "how volcanoes form", "the life of Mozart",
          "how a bicycle works", "the water cycle"]


def prompts(kind: str, n: int) -> list[str]:
    if kind == "copy":
        return [f"Passage {i}: {PASSAGE}\nRepeat passage {i} above exactly, word for word."
                for i in range(n)]
    if kind == "json":
        return [f"Customer record {i}: name {NAMES[i % 8]}, email "
                f"{NAMES[i % 8].lower().replace(' ', '.')}{i}@example.com, city Springfield, "
                f"plan pro. The record as JSON:" for i in range(n)]
    if kind == "code":
        return [f"Here is a function:\n\n{CODE}\nWrite it out again, with the variable "
                f"`result` renamed to `config_{i}`, and nothing else changed." for i in range(n)]
    return [f"Tell me about {TOPICS[i % len(TOPICS)]} (question {i})." for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--workloads", nargs="+", default=["copy", "code", "chat", "json"],
                    choices=["copy", "code", "chat", "json"])
    ap.add_argument("--tokens", type=int, default=4, help="speculative_tokens (K)")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, max_batch=max(args.batch), speculative_tokens=args.tokens)
    eng = llm.engine
    propose = eng.scheduler.propose
    chat = llm.loaded.tokenizer
    free = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    held = SamplingParams(max_tokens=args.new, temperature=0,
                          structured_outputs=StructuredOutputs(json=RECORD))
    rows, table = [], [["workload", "B", "plain s", "drafts s", "x", "kept %",
                        "tokens/step/seq", "same %"]]
    modes = ("plain", "drafts")
    for kind in args.workloads:
        params = held if kind == "json" else free
        for b in args.batch:
            texts = [chat.apply_chat_template([{"role": "user", "content": p}],
                                              tokenize=False, add_generation_prompt=True)
                     for p in prompts(kind, b)]
            times: dict[str, list[float]] = {m: [] for m in modes}
            toks: dict[str, list] = {}
            drafted = kept = steps = drawn = 0
            llm.generate(texts, SamplingParams(max_tokens=1), use_tqdm=False)  # cache KV
            for _ in range(args.repeat):
                for mode in modes:
                    eng.scheduler.propose = None if mode == "plain" else propose
                    d0, a0, s0 = eng.num_draft_tokens, eng.num_accepted_tokens, \
                        eng.scheduler.step
                    t = time.perf_counter()
                    outs = llm.generate(texts, params, use_tqdm=False)
                    times[mode].append(time.perf_counter() - t)
                    toks[mode] = [o.token_ids for o in outs]
                    if mode == "drafts":
                        drafted += eng.num_draft_tokens - d0
                        kept += eng.num_accepted_tokens - a0
                        steps += eng.scheduler.step - s0
                        drawn += sum(len(t) for t in toks[mode])
            same = sum(x == y for x, y in zip(toks["drafts"], toks["plain"])) / b
            assert same == 1 or args.dtype != "float32", f"{kind} B={b}: tokens changed"
            med = {m: statistics.median(times[m]) for m in modes}
            per_step = drawn / max(steps, 1) / b
            rows.append({"workload": kind, "batch": b, "plain_s": med["plain"],
                         "drafts_s": med["drafts"], "speedup": med["plain"] / med["drafts"],
                         "drafted": drafted, "kept": kept,
                         "tokens_per_step_per_seq": per_step, "same": same})
            table.append([kind, str(b), f"{med['plain']:.2f}", f"{med['drafts']:.2f}",
                          f"{med['plain'] / med['drafts']:.2f}",
                          f"{100 * kept / max(drafted, 1):.0f}", f"{per_step:.2f}",
                          f"{100 * same:.0f}"])
            print(" | ".join(table[-1]), flush=True)
    result = {"cpu": cpu_name(), "dtype": args.dtype, "speculative_tokens": args.tokens,
              "new_tokens": args.new, "repeat": args.repeat, "rows": rows}
    for path in _write(Path(args.out), "speculative_probe", result, table):
        print("wrote", path)
    llm.shutdown()


if __name__ == "__main__":
    main()
