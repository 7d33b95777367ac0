"""The sampler's time for a step's drawn rows, on SmolLM2's own bf16 logits; with
--stability, how often a draw changes when its logits move by float rounding.

    python benchmarks/sampler_probe.py [--rows 16]
    python benchmarks/sampler_probe.py --stability [--seeds 40]

Builds R rows of last-position logits from R short prompts, then times `sample_rows`
(median of 20 after 5 warm-ups, 2 torch threads) for each kind of row a client sends:
temperature only, top_k + top_p, top_p alone, top_k alone.
--stability: SmolLM2 (fp32) reads a 300-token context of random words twice, whole and
as 100 + 200 tokens over its KV cache (the logits then differ by float rounding, as a
sequence's do in batches of other sizes or recomputed after a preemption), and each kind
of row draws at positions 100-299 with `--seeds` seeds from both: the draws that differ.
Run it at two commits to compare them.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from lamina.bench.draws import changed_draws, whole_and_chunked
from lamina.model.loader import load
from lamina.sampling.params import SamplingParams
from lamina.sampling.sampler import sample_rows

KINDS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
         SamplingParams(temperature=1.0, top_p=0.95), SamplingParams(temperature=1.0, top_p=0.9),
         SamplingParams(temperature=1.0, top_k=20)]


def stability(seeds: int) -> None:
    whole, chunked = whole_and_chunked(load())
    d = (whole - chunked)[100:].abs()
    print(f"logits whole vs chunked, positions 100-299: max |diff| {float(d.max()):.2e}, "
          f"median {float(d.median()):.2e}; {platform.processor() or 'cpu'}")
    for p in KINDS:
        t = time.perf_counter()
        changed = len(changed_draws(whole, chunked, p, tuple(range(seeds)), range(100, 300)))
        n = 200 * seeds
        ms = (time.perf_counter() - t) / (2 * n) * 1e3
        print(f"temperature {p.temperature} top_k {p.top_k} top_p {p.top_p}: {changed} of "
              f"{n} draws differ ({changed / n:.3%}); {ms:.3f} ms a draw")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--stability", action="store_true")
    ap.add_argument("--seeds", type=int, default=40)
    args = ap.parse_args()
    R = args.rows
    torch.set_num_threads(2)
    if args.stability:
        return stability(args.seeds)
    lm = load(dtype=torch.bfloat16)
    with torch.no_grad():
        logits = torch.stack([lm.model(torch.tensor([lm.tokenizer(
            f"Request {i}: tell me about the number {i} and why").input_ids])).logits[0, -1]
            for i in range(R)])  # [R, V] bf16
    seeds, pos = [(i,) for i in range(R)], [5] * R
    print(f"{R} drawn rows, vocabulary {logits.shape[1]}, {platform.processor() or 'cpu'}")
    for p in KINDS:
        for _ in range(5):
            sample_rows(logits, [p] * R, seeds, pos)
        ts = []
        for _ in range(20):
            t = time.perf_counter()
            sample_rows(logits, [p] * R, seeds, pos)
            ts.append(time.perf_counter() - t)
        print(f"temperature {p.temperature} top_k {p.top_k} top_p {p.top_p}: "
              f"{statistics.median(ts) * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
