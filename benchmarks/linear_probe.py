"""A step's bf16 linears on SmolLM2's shapes: oneDNN's packed bf16 GEMM (what the
"onednn" dense backend runs) against our AVX512-BF16 kernel ("avx512bf16",
`lamina.kernels.linear`), both on weights packed once.

    python benchmarks/linear_probe.py [--rows 1 8 32 256 3072] [--repeat 7]

One step's linears: 30 layers x (q|k|v 576->960, o 576->576, gate|up 576->3072, down
1536->576) and the lm_head (576->49152), random weights; rows = the step's tokens.
Median of `repeat` passes each; prints ms, GB/s of weights, GFLOP/s and the ratio, and
writes benchmarks/results/linear_probe.{json,md}.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from lamina.bench.common import _write, cpu_name, median_ms
from lamina.kernels.linear import linear_ops

LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in)
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 256, 3072])
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    ops, why = linear_ops()
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; our kernel: {why}")
    if ops is None:
        return
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(o, i, generator=g) * 0.02).bfloat16() for _ in range(LAYERS)
          for o, i in LAYER] + [(torch.randn(VOCAB, HIDDEN, generator=g) * 0.02).bfloat16()]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 32) for w in ws]
    ours = [ops.pack(w) for w in ws]
    nbytes = sum(w.numel() for w in ws) * 2
    rows_out, table = [], [["rows", "oneDNN ms", "ours ms", "oneDNN GB/s", "ours GB/s",
                            "oneDNN GFLOP/s", "ours GFLOP/s", "ours x oneDNN"]]
    for m in args.rows:
        xs = {i: torch.randn(1, m, i, generator=g).bfloat16() for i in (576, 1536)}
        a = median_ms(lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none",
                                                            [], "") for w, p in zip(ws, onednn)],
                args.repeat)
        b = median_ms(lambda: [ops.linear(xs[w.shape[1]], p, w.shape[0], None)
                         for w, p in zip(ws, ours)], args.repeat)
        flops = 2 * m * nbytes / 2
        row = {"rows": m, "onednn_ms": a, "ours_ms": b, "ratio": a / b}
        rows_out.append(row)
        table.append([str(m), f"{a:.2f}", f"{b:.2f}", f"{nbytes / a / 1e6:.1f}",
                      f"{nbytes / b / 1e6:.1f}", f"{flops / a / 1e6:.0f}",
                      f"{flops / b / 1e6:.0f}", f"{a / b:.2f}x"])
        print(" | ".join(table[-1]), flush=True)
    _write(Path("benchmarks/results"), "linear_probe",
           {"cpu": cpu_name(), "threads": torch.get_num_threads(), "rows": rows_out}, table)


if __name__ == "__main__":
    main()
