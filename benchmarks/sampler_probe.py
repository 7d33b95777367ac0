"""The sampler's time for a step's drawn rows, on SmolLM2's own bf16 logits.

    python benchmarks/sampler_probe.py [--rows 16]

Builds R rows of last-position logits from R short prompts, then times `sample_rows`
(median of 20 after 5 warm-ups, 2 torch threads) for each kind of row a client sends:
temperature only, top_k + top_p, top_p alone, top_k alone. Run it at two commits to
compare them.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from lamina.model.loader import load
from lamina.sampling.params import SamplingParams
from lamina.sampling.sampler import sample_rows

KINDS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=50, top_p=0.9),
         SamplingParams(temperature=1.0, top_p=0.95), SamplingParams(temperature=1.0, top_p=0.9),
         SamplingParams(temperature=1.0, top_k=20)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    R = ap.parse_args().rows
    torch.set_num_threads(2)
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
