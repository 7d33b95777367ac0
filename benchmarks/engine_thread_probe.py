"""One engine stepped from the thread that built it, then from a second thread.

    python benchmarks/engine_thread_probe.py

Local executor, SmolLM2 in bf16, B=16 prompts, 30 drawn tokens each (temperature 1);
prints the median step and its parts (`engine.step_timings`) for each thread. With
libgomp, torch's intra-op threads spin between parallel regions only while the process
holds no more OpenMP threads than cores; the second thread's steps show what losing
that costs (why `lamina serve` runs its engine on the main thread).
"""
from __future__ import annotations

import statistics
import threading

from lamina import LLM, SamplingParams

PARTS = ("step_s", "dense_s", "attention_s", "sample_s")


def run(llm, where: str) -> None:
    eng, tok = llm.engine, llm.loaded.tokenizer
    sp = SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0)
    for i in range(16):
        eng.add_request(tok(f"Request {i}: tell me about the number {i}.")["input_ids"], sp)
    eng.step_timings.clear()
    while eng.has_unfinished():
        eng.step()
    steps = list(eng.step_timings)[3:]  # decode steps
    print(where, {k: round(statistics.median(s[k] for s in steps) * 1e3, 2) for k in PARTS},
          flush=True)


def main() -> None:
    llm = LLM(dtype="bfloat16")
    run(llm, "building thread (ms):")
    t = threading.Thread(target=run, args=(llm, "second thread (ms):  "))
    t.start()
    t.join()
    run(llm, "building thread (ms):")


if __name__ == "__main__":
    main()
