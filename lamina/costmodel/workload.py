"""Synthetic serving workloads over the KV allocator (plain Python over slot ids).

Data in: a seed and sizes. Data out: request length samples, slot tables scattered by a
realistic allocation history (for kernel tests and benchmarks), and step-by-step
occupancy of token slabs vs fixed-size pages (for the fragmentation report).

ShareGPT-like lengths (generated, not the real data set): prompt tokens
~ LogNormal(ln 245, 1.0) clipped to [4, 4096]; output tokens ~ LogNormal(ln 200, 0.9)
clipped to [1, 2048]. Heavy right tails and medians of a few hundred tokens, as
conversation logs have.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from lamina.memory.allocator import KVAllocator, KVAllocatorConfig

PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_CLIP = 245, 1.0, (4, 4096)
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_CLIP = 200, 0.9, (1, 2048)


def sharegpt_like(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """n (prompt_len, output_len) pairs."""
    rng = random.Random(seed)

    def draw(median, sigma, clip):
        return int(min(max(round(rng.lognormvariate(math.log(median), sigma)), clip[0]), clip[1]))

    return [(draw(PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_CLIP),
             draw(OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_CLIP)) for _ in range(n)]


def scattered_tables(lengths: list[int], num_slots: int, seed: int = 0) -> list[list[int]]:
    """Slot tables for requests of `lengths` after allocator churn: neighbours come and
    go while ours grow (a prompt chunk, then one token per step, round robin), so slots
    interleave across requests and LIFO reuse scatters them."""
    rng = random.Random(seed)
    alloc = KVAllocator(KVAllocatorConfig(num_slots))
    spare = num_slots - sum(lengths)
    if spare <= 0:
        raise ValueError(f"{num_slots} slots cannot hold {sum(lengths)} tokens plus churn")
    others = []
    for i in range(40):  # neighbours, at most the spare slots in all
        n = rng.randint(1, max(1, spare // 40))
        if alloc.can_allocate(n):
            alloc.allocate(("o", i), n)
            others.append(("o", i))
    for r in rng.sample(others, len(others) // 2):
        alloc.free(r)
        others.remove(r)
    ours = [("r", b) for b in range(len(lengths))]
    remaining = list(lengths)
    for b, r in enumerate(ours):  # prompt: a chunk of up to half the length
        n = rng.randint(0, remaining[b] // 2)
        alloc.allocate(r, n)
        remaining[b] -= n
    step = 0
    while any(remaining):
        for b, r in enumerate(ours):
            if remaining[b]:
                alloc.append(r)
                remaining[b] -= 1
        step += 1
        if step % 50 == 0 and others:  # a neighbour finishes; its slots get reused
            alloc.free(others.pop(rng.randrange(len(others))))
    return [alloc.slots(r) for r in ours]


@dataclass(frozen=True)
class OccupancySample:
    step: int
    live_tokens: int  # tokens whose KV is needed
    slab_slots: int  # slots the token-slab allocator holds
    page_slots: int  # slots held by a page allocator (pages * page_size)


def simulate_occupancy(requests: list[tuple[int, int]], max_batch: int, page_size: int = 16,
                       n_samples: int = 1) -> list[OccupancySample]:
    """Continuous batching: up to `max_batch` running requests; each step admits waiting
    requests (their prompt KV), then every running request decodes one token; a request
    leaves when its output is done. With n_samples > 1 each request forks into that many
    sequences sharing the prompt (parallel sampling). Slabs are the real `KVAllocator`;
    pages are counted as vLLM does: a sequence holds ceil(len / page_size) pages, the
    prompt's full pages are shared by the forks and the partial last page is copied."""
    total = sum((p + o * n_samples) for p, o in requests)
    alloc = KVAllocator(KVAllocatorConfig(total))
    waiting = list(enumerate(requests))[::-1]
    running: dict[int, list] = {}  # rid -> [prompt, out_target, generated]
    samples, step = [], 0
    while waiting or running:
        while waiting and len(running) < max_batch:
            rid, (p, o) = waiting.pop()
            alloc.allocate((rid, 0), p)
            for s in range(1, n_samples):
                alloc.fork((rid, 0), (rid, s))
            running[rid] = [p, o, 0]
        for rid, st in list(running.items()):
            for s in range(n_samples):
                alloc.append((rid, s))
            st[2] += 1
        live = pages = 0
        for p, _, g in running.values():
            live += p + n_samples * g
            full, part = divmod(p, page_size)
            pages += full  # shared prompt pages
            per_seq = -(-(part + g) // page_size)  # copied partial page + own output
            pages += n_samples * per_seq
        slab = alloc.stats().used
        samples.append(OccupancySample(step, live, slab, pages * page_size))
        for rid, st in list(running.items()):
            if st[2] >= st[1]:
                for s in range(n_samples):
                    alloc.free((rid, s))
                del running[rid]
        step += 1
    return samples
