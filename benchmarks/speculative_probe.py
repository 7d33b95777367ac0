"""What n-gram speculative decoding buys and costs (`lamina/engine/speculative.py`).

    python benchmarks/speculative_probe.py [--batch 1 8 32] [--tokens 4] [--repeat 3]
        [--dtype bfloat16] [--out DIR]

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
step and decoding sequence; the tokens of both runs must be equal (asserted). Writes
speculative_probe.json and .md into --out.
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
                        "tokens/step/seq"]]
    for kind in ("copy", "code", "chat", "json"):
        params = held if kind == "json" else free
        for b in args.batch:
            texts = [chat.apply_chat_template([{"role": "user", "content": p}],
                                              tokenize=False, add_generation_prompt=True)
                     for p in prompts(kind, b)]
            times: dict[bool, list[float]] = {False: [], True: []}
            toks: dict[bool, list] = {}
            drafted = kept = steps = drawn = 0
            llm.generate(texts, SamplingParams(max_tokens=1), use_tqdm=False)  # cache KV
            for _ in range(args.repeat):
                for on in (False, True):
                    eng.scheduler.propose = propose if on else None
                    d0, a0, s0 = eng.num_draft_tokens, eng.num_accepted_tokens, \
                        eng.scheduler.step
                    t = time.perf_counter()
                    outs = llm.generate(texts, params, use_tqdm=False)
                    times[on].append(time.perf_counter() - t)
                    toks[on] = [o.token_ids for o in outs]
                    if on:
                        drafted += eng.num_draft_tokens - d0
                        kept += eng.num_accepted_tokens - a0
                        steps += eng.scheduler.step - s0
                        drawn += sum(len(t) for t in toks[on])
            assert toks[True] == toks[False], f"{kind} B={b}: drafts changed the tokens"
            plain, spec = statistics.median(times[False]), statistics.median(times[True])
            per_step = drawn / max(steps, 1) / b
            rows.append({"workload": kind, "batch": b, "plain_s": plain, "drafts_s": spec,
                         "speedup": plain / spec, "drafted": drafted, "kept": kept,
                         "tokens_per_step_per_seq": per_step})
            table.append([kind, str(b), f"{plain:.2f}", f"{spec:.2f}", f"{plain / spec:.2f}",
                          f"{100 * kept / max(drafted, 1):.0f}", f"{per_step:.2f}"])
            print(" | ".join(table[-1]), flush=True)
    result = {"cpu": cpu_name(), "dtype": args.dtype, "speculative_tokens": args.tokens,
              "new_tokens": args.new, "repeat": args.repeat, "rows": rows}
    for path in _write(Path(args.out), "speculative_probe", result, table):
        print("wrote", path)
    llm.shutdown()


if __name__ == "__main__":
    main()
