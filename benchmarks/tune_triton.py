"""Sweep the Triton decode kernel's launch settings (BLOCK_N, warps, stages, splits) on
one GPU, for SmolLM2's shape: `python benchmarks/tune_triton.py [B L ...]`.
Device times from CUDA-graph replays (lamina.bench.gpu), KV flushed from L2 each run."""
import itertools
import sys

import torch

from lamina.bench.gpu import HKV, HQ, D, _graph_ms
from lamina.costmodel.workload import scattered_tables
from lamina.kernels import AttentionParams, SlotBatch, TritonBackend, validate


def main(cases):
    dev = torch.device("cuda")
    p = AttentionParams(D ** -0.5)
    for B, L in cases:
        S = int(B * L * 1.25)
        batch = SlotBatch.decode(scattered_tables([L] * B, S, seed=1)).to(dev)
        q = torch.randn(B, HQ, D, device=dev)
        for dt in (torch.float32, torch.bfloat16):
            kp = torch.randn(S, HKV, D, device=dev).to(dt)
            vp = torch.randn(S, HKV, D, device=dev).to(dt)
            validate(q, kp, vp, batch, p)
            nbytes = 2 * B * L * HKV * D * kp.element_size()
            res = []
            for bn, nw, ns, sp in itertools.product((32, 64, 128), (1, 2, 4), (2, 3),
                                                    (None, 4, 16)):
                tri = TritonBackend(splits=sp, block_n=bn, num_warps=nw, num_stages=ns)
                try:
                    t = _graph_ms(lambda: tri.attend(q, kp, vp, batch, p), 50)
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
                    print(f"  skip bn={bn} nw={nw} ns={ns}: {type(e).__name__}")
                    continue
                res.append((t, bn, nw, ns, sp))
            res.sort(key=lambda r: r[0])
            print(f"B={B} L={L} {dt}: best 6 (ms, GB/s, block_n, warps, stages, splits):")
            for t, bn, nw, ns, sp in res[:6]:
                print(f"   {t:.4f} {nbytes / t / 1e6:7.0f}  {bn:4d} {nw} {ns} {sp}")
            t = _graph_ms(lambda: TritonBackend().attend(q, kp, vp, batch, p), 50)
            print(f"   defaults: {t:.4f} ms")


if __name__ == "__main__":
    a = [int(x) for x in sys.argv[1:]] or [32, 2048, 8, 8192, 128, 2048]
    main(list(zip(a[::2], a[1::2])))
