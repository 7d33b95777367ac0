"""`LLM.generate` called from several threads at once: do their requests batch together?

    python benchmarks/threads_probe.py [--threads 4] [--prompts 4] [--new 64]
        [--repeat 3] [--dtype bfloat16] [--out DIR]

SmolLM2 on the local executor (CPU). --threads callers, each with --prompts chat
prompts (--new tokens each, greedy, `ignore_eos`), five ways on one engine: "at once"
(each caller a thread calling `generate` at the same time: one engine stepped in turn,
`lamina/entrypoints/calls.py`), "at once, main too" (the same, one of the callers the
main thread), "in turn" (the same calls one after another, the batches a single caller
gets), "one call" (every prompt in one `generate` on the main thread: the batch a
server would form) and "one call, threads parked" (the same beside --threads - 1 idle
threads that each ran one 512x512 matmul: each has an OpenMP team of its own, and
libgomp's threads spin between regions only while the process has no more of them than
cores). Reported (medians of --repeat): wall time, the callers'
median and last finish, and steps run. The tokens are asserted equal between the ways
in float32 (in bfloat16 a CPU GEMM may round differently for another row count). Writes
threads_probe.json and .md into --out.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time
from pathlib import Path

from lamina import LLM, SamplingParams
from lamina.bench.common import _write, cpu_name

TOPICS = ["the history of Rome", "how bees make honey", "why the sky is blue",
          "the rules of chess", "how volcanoes form", "the life of Mozart",
          "how a bicycle works", "the water cycle"]


@contextlib.contextmanager
def parked(n: int):
    """`n` threads that ran one torch matmul (an OpenMP team each), idle while inside."""
    import torch

    started, done = threading.Barrier(n + 1), threading.Event()

    def park():
        a = torch.randn(512, 512)
        (a @ a).sum()
        started.wait()
        done.wait()

    threads = [threading.Thread(target=park) for _ in range(n)]
    for t in threads:
        t.start()
    started.wait()
    try:
        yield
    finally:
        done.set()
        for t in threads:
            t.join()


def one_run(llm: LLM, calls: list[list[str]], params: SamplingParams, way: str) -> dict:
    eng, t0 = llm.engine, time.perf_counter()
    step0, ends, tokens = eng.scheduler.step, [0.0] * len(calls), [None] * len(calls)

    def call(k: int) -> None:
        tokens[k] = [o.token_ids for o in llm.generate(calls[k], params, use_tqdm=False)]
        ends[k] = time.perf_counter() - t0

    if way.startswith("at once"):
        main = way == "at once, main too"  # the main thread makes call 0
        threads = [threading.Thread(target=call, args=(k,)) for k in range(main, len(calls))]
        for t in threads:
            t.start()
        if main:
            call(0)
        for t in threads:
            t.join()
    elif way == "in turn":
        for k in range(len(calls)):
            call(k)
    else:
        with parked(len(calls) - 1 if way == "one call, threads parked" else 0):
            t0 = time.perf_counter()
            outs = llm.generate([p for c in calls for p in c], params, use_tqdm=False)
        n = len(calls[0])
        tokens = [[o.token_ids for o in outs[k * n:(k + 1) * n]] for k in range(len(calls))]
        ends = [time.perf_counter() - t0] * len(calls)
    return {"wall_s": time.perf_counter() - t0, "median_end_s": statistics.median(ends),
            "last_end_s": max(ends), "steps": eng.scheduler.step - step0, "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype)
    tok = llm.loaded.tokenizer
    calls = [[tok.apply_chat_template(
        [{"role": "user", "content": f"Tell me about {TOPICS[(k + i) % 8]} ({k}.{i})."}],
        tokenize=False, add_generation_prompt=True) for i in range(args.prompts)]
        for k in range(args.threads)]
    params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    llm.generate([p for c in calls for p in c], SamplingParams(max_tokens=1),
                 use_tqdm=False)  # warm: kernels, and every prompt in the prefix cache
    ways = ("at once", "at once, main too", "in turn", "one call", "one call, threads parked")
    runs: dict[str, list[dict]] = {w: [] for w in ways}
    for _ in range(args.repeat):
        for w in ways:
            runs[w].append(one_run(llm, calls, params, w))
    if args.dtype == "float32":
        assert all(r[0]["tokens"] == runs["one call"][0]["tokens"] for r in runs.values()), \
            "tokens changed"
    keys = ("wall_s", "median_end_s", "last_end_s", "steps")
    med = {w: {k: statistics.median(r[k] for r in rs) for k in keys} for w, rs in runs.items()}
    table = [["way", "wall s", "callers' median end s", "last end s", "steps",
              "wall / at once"]]
    for w in ways:
        table.append([w, *(f"{med[w][k]:.2f}" for k in keys[:3]), f"{med[w]['steps']:.0f}",
                      f"{med[w]['wall_s'] / med['at once']['wall_s']:.2f}x"])
    for row in table:
        print(" | ".join(row), flush=True)
    result = {"cpu": cpu_name(), "dtype": args.dtype, "threads": args.threads,
              "prompts": args.prompts, "new": args.new, "repeat": args.repeat,
              "medians": med}
    for path in _write(Path(args.out), "threads_probe", result, table):
        print("wrote", path)
    llm.shutdown()


if __name__ == "__main__":
    main()
