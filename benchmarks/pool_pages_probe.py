"""Host KV pools on transparent huge pages or on 4 KiB pages: what each costs to allocate
and what each gives decode attention, measured side by side.

    python benchmarks/pool_pages_probe.py [--slots 16384] [--rounds 5] [--idle 3]

Allocation: a `KVPool` of SmolLM2's shape (30 layers, 3 KV heads, 64 dims, fp32) with
`--slots` slots, made after `--idle` seconds with nothing else allocated (as at a memory
worker's start), huge pages and 4 KiB pages in turns, `--rounds` of each; the process's
AnonHugePages after each says whether the kernel gave huge pages. Attention: the compiled
CPU kernel, one thread, B=32 sequences of 2048 keys at scattered slots (the allocator's
churn, `scattered_tables`) in one layer's pool of each kind, timed round-robin, median
of `--repeat`. On a VM that hands freed memory back to its host (free page reporting),
fresh memory is backed again page by page on first touch, and huge pages take the
freshest. Nothing is written.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import replace

import torch

from lamina.bench.memory import HKV, HQ, D, _interleaved_medians  # SmolLM2's heads


def anon_huge_mib() -> float:
    with open("/proc/self/smaps_rollup") as f:
        line = next(x for x in f if x.startswith("AnonHugePages:"))
    return int(line.split()[1]) / 1024


def allocation(slots: int, rounds: int, idle: float) -> dict[bool, list[float]]:
    from lamina.memory.pool import KVPool, KVPoolConfig

    base = KVPoolConfig(30, slots, HKV, D, D, "float32")
    times: dict[bool, list[float]] = {True: [], False: []}
    for r in range(rounds):
        for huge in (True, False):
            gc.collect()
            time.sleep(idle)
            t = time.perf_counter()
            pool = KVPool(replace(base, huge_pages=huge))
            times[huge].append(time.perf_counter() - t)
            print(f"round {r} {'huge' if huge else '4 KiB'} pages: {times[huge][-1]:.2f} s "
                  f"for {2 * pool.k.nbytes / 2**20:.0f} MiB (AnonHugePages "
                  f"{anon_huge_mib():.0f} MiB)", flush=True)
            del pool
    return times


def attention(repeat: int, B: int = 32, L: int = 2048) -> dict[bool, float]:
    from lamina.costmodel.workload import scattered_tables
    from lamina.kernels import AttentionParams, SlotBatch, attend, select_backend
    from lamina.memory.pool import host_zeros

    S = int(B * L * 1.25)
    batch = SlotBatch.decode(scattered_tables([L] * B, S, seed=B * 7 + L))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, HQ, D, generator=g)
    k, v = torch.randn(S, HKV, D, generator=g), torch.randn(S, HKV, D, generator=g)
    pools = {}
    for huge in (True, False):
        kp, vp = host_zeros((S, HKV, D), torch.float32, huge), \
            host_zeros((S, HKV, D), torch.float32, huge)
        kp.copy_(k)
        vp.copy_(v)
        pools[huge] = (kp, vp)
    backend, params = select_backend("cpu"), AttentionParams(D ** -0.5)
    outs = {h: attend(q, *pools[h], batch, params, backend)[0] for h in pools}
    assert torch.equal(outs[True], outs[False])  # same bytes, same answer
    return _interleaved_medians({h: lambda h=h: attend(q, *pools[h], batch, params, backend)
                                 for h in pools}, repeat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--idle", type=float, default=3.0)
    ap.add_argument("--repeat", type=int, default=21)
    a = ap.parse_args()
    torch.set_num_threads(1)
    alloc = allocation(a.slots, a.rounds, a.idle)
    med = {h: statistics.median(x) for h, x in alloc.items()}
    att = attention(a.repeat)
    print(f"allocation, median of {a.rounds}: huge pages {med[True]:.2f} s, 4 KiB pages "
          f"{med[False]:.2f} s ({med[True] / med[False]:.2f}x)")
    print(f"decode attention B=32 L=2048 fp32, median of {a.repeat}: huge pages "
          f"{att[True] * 1e3:.2f} ms, 4 KiB pages {att[False] * 1e3:.2f} ms (4 KiB pages "
          f"{att[False] / att[True]:.2f}x the time)")


if __name__ == "__main__":
    main()
