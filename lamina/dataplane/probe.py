"""The per-layer exchange cost of a live link, for the simulator's calibration
(`Executor.probe`, `lamina bench ops`): it must run where the link lives (the compute
worker), so it is here, not in `lamina.bench`.

Data in: a `SocketLink` to idle memory workers, the attention shape, token counts.
Data out: {"exchange_s": {n: s}, "submit_s": {n: s}}: seconds per layer for n tokens'
q/k/v out and o back, and for the sending part alone (medians over `repeat`).
"""
from __future__ import annotations

import statistics
import time

import torch

from lamina.compute.packing import WorkerPart
from lamina.kernels import SlotBatch


def probe_parts(n: int, workers: int) -> list[WorkerPart]:
    """n tokens dealt in slices to the workers, each attending to its own slot only (so
    the kernel's share is tiny), slots 0.. of an idle pool."""
    parts = []
    for i in range(workers):
        r = list(range(i * n // workers, (i + 1) * n // workers))
        span = (r[0], r[-1] + 1) if r else None
        parts.append(WorkerPart(torch.tensor(r, dtype=torch.int64),
                                torch.arange(len(r), dtype=torch.int32),
                                SlotBatch.build([[j] for j in range(len(r))], [1] * len(r)),
                                span=span, whole=span == (0, n)))
    return parts


def probe_exchange(link, spec, layers: int, tokens, repeat: int) -> dict:
    """Time `layers` layers' exchanges per token count, as steps run them (in one call
    where the link can). `spec`: the model's `AttentionSpec` (head counts and dims)."""
    hq, hkv, d, dv = spec.num_q_heads, spec.num_kv_heads, spec.head_dim, spec.v_head_dim
    res = {"exchange_s": {}, "submit_s": {}}
    for n in tokens:
        parts = probe_parts(n, len(link.channels))
        # strided as the slices give them: [1, H, N, D] -> [N, H, D]
        q, k, v = (torch.randn(1, h, n, e)[0].transpose(0, 1)
                   for h, e in ((hq, d), (hkv, d), (hkv, dv)))
        whole, sends = [], []
        for rep in range(repeat):
            link.begin(-2 - rep, [parts])
            t = time.perf_counter()
            for layer in range(layers):
                t1 = time.perf_counter()
                r = link.exchange(layer, 0, q, k, v, parts, (n, hq, dv), q.dtype)
                if r is None:
                    link.submit(layer, 0, q, k, v, parts)
                    sends.append(time.perf_counter() - t1)
                    link.collect(layer, 0, parts, (n, hq, dv), q.dtype)
                else:
                    sends.append(r[1])
            whole.append((time.perf_counter() - t) / layers)
        res["exchange_s"][n] = statistics.median(whole)
        res["submit_s"][n] = statistics.median(sends)
    return res
