"""How far can compute hide behind scattered-row reads on this core? `python
benchmarks/overlap_probe.py [--repeat N]`.

A synthetic stand-in for the decode kernel at B=32 L=2048 on SmolLM2's shape: per token it
reads the K and V rows (768 B each) at the benchmark's scattered slots, then runs `work`
rounds of 12 independent FMAs (12 rounds = 144 FMAs, the kernel's minimum for 9 q heads x
64 dims, QK plus PV), with and without a software prefetch a few tokens ahead, into L1
(T0) or L2 (T1). Also the same with the rows in cache. Whatever the kernel does, it cannot
beat the best of these rows, so this bounds the fraction of read bandwidth an fp32 kernel
can reach here.
Writes JSON and Markdown (benchmarks/results/overlap_probe.*)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils import cpp_extension

SRC = r"""
#include <torch/extension.h>
#include <immintrin.h>
// Per token: load its K and V rows, then `work` rounds of 12 independent FMA chains that
// depend on the loaded data; optionally prefetch the rows `pf` tokens ahead, into L2 if l2.
template <int HINT>
inline void pf_row(const char* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(p + o, (_mm_hint)HINT);
}
double probe(at::Tensor k, at::Tensor v, at::Tensor slots, int64_t work, int64_t pf, bool l2) {
  const float* K = k.data_ptr<float>(); const float* V = v.data_ptr<float>();
  const int32_t* s = slots.data_ptr<int32_t>(); const int64_t n = slots.numel(), rs = k.stride(0);
  __m256 acc[12]; for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(0.001f * i);
  const __m256 x = _mm256_set1_ps(0.999f); __m256 sum = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    if (pf > 0 && j + pf < n) {
      const char* pk = (const char*)(K + int64_t(s[j + pf]) * rs);
      const char* pv = (const char*)(V + int64_t(s[j + pf]) * rs);
      if (l2) { pf_row<_MM_HINT_T1>(pk, rs * 4); pf_row<_MM_HINT_T1>(pv, rs * 4); }
      else { pf_row<_MM_HINT_T0>(pk, rs * 4); pf_row<_MM_HINT_T0>(pv, rs * 4); }
    }
    const float* kr = K + int64_t(s[j]) * rs; const float* vr = V + int64_t(s[j]) * rs;
    for (int64_t c = 0; c < rs; c += 8)
      sum = _mm256_add_ps(sum, _mm256_add_ps(_mm256_loadu_ps(kr + c), _mm256_loadu_ps(vr + c)));
    for (int64_t w = 0; w < work; ++w)
      for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(acc[i], x, sum);
  }
  for (int i = 0; i < 12; ++i) sum = _mm256_add_ps(sum, acc[i]);
  float t[8]; _mm256_storeu_ps(t, sum); return t[0];
}
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    from lamina.bench.common import _write
    from lamina.bench.memory import HKV, D, _interleaved_medians
    from lamina.costmodel.workload import scattered_tables
    from lamina.kernels import SlotBatch, load_cpu_kernel
    from lamina.memory.pool import host_zeros

    torch.set_num_threads(1)
    ext = cpp_extension.load_inline("lamina_overlap_probe", SRC, functions=["probe"],
                                    extra_cflags=["-O3", "-march=native"])
    B, L = 32, 2048
    S = int(B * L * 1.25)
    slots = SlotBatch.decode(scattered_tables([L] * B, S, seed=B * 7 + L)).slots
    kp, vp = host_zeros((S, HKV, D), torch.float32), host_zeros((S, HKV, D), torch.float32)
    kp.normal_(), vp.normal_()
    hot = (torch.arange(B * L, dtype=torch.int32) % 256).contiguous()  # rows stay in cache
    x = torch.ones(512 * 2 ** 18)
    read = load_cpu_kernel().read_sum
    cases = [(w, pf, l2) for w in (0, 12) for pf in (0, 2, 4, 8, 16)
             for l2 in ((False, True) if pf else (False,))]
    fns = {"read": lambda: read(x)}
    for w, pf, l2 in cases:
        fns[(w, pf, l2, "dram")] = lambda w=w, pf=pf, l2=l2: ext.probe(kp, vp, slots, w, pf, l2)
        fns[(w, pf, l2, "cache")] = lambda w=w, pf=pf, l2=l2: ext.probe(kp, vp, hot, w, pf, l2)
    t = _interleaved_medians(fns, args.repeat)
    read_gbs = x.nbytes / t["read"] / 1e9
    n, row_bytes = B * L, 2 * HKV * D * 4
    rows, table = [], [["FMAs/token", "prefetch ahead", "into", "ns/token (DRAM)",
                        "ns/token (cache)", "GB/s", "% of read BW"]]
    for w, pf, l2 in cases:
        ns, nc = t[(w, pf, l2, "dram")] * 1e9 / n, t[(w, pf, l2, "cache")] * 1e9 / n
        gbs = row_bytes / ns
        into = ("L2" if l2 else "L1") if pf else "-"
        rows.append({"fmas": 12 * w, "prefetch": pf, "into": into, "ns_dram": ns,
                     "ns_cache": nc, "GBps": gbs, "frac_of_read": gbs / read_gbs})
        table.append([str(12 * w), str(pf), into, f"{ns:.1f}", f"{nc:.1f}", f"{gbs:.1f}",
                      f"{gbs / read_gbs:.0%}"])
    best = max((r for r in rows if r["fmas"] == 144), key=lambda r: r["GBps"])
    res = {"B": B, "L": L, "read_GBps": read_gbs, "rows": rows, "best_with_144_fmas": best}
    print("\n".join(" | ".join(r) for r in table))
    jp, mp = _write(Path(args.out), "overlap_probe", res, table)
    print(f"read bandwidth {read_gbs:.1f} GB/s; with the kernel's 144 FMAs/token the best "
          f"overlap reaches {best['frac_of_read']:.0%} of it; wrote {jp} and {mp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
