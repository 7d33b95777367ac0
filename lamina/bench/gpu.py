"""GPU attention benchmark: `lamina bench attention --device cuda`.

Data in: synthetic KV pools on the GPU, shaped like SmolLM2's attention (9 q heads, 3 kv
heads, head_dim 64), slots scattered by `lamina.costmodel.workload` (an allocator history). Data
out: a printed table plus JSON and Markdown (via `lamina.bench.common._write`).

In one run it measures the GPU's read bandwidth (a reduction over 1 GiB) and copy
bandwidth, a reduction over each case's own KV bytes (what one launch of that size can
read: the ceiling for a kernel of that size), contiguous SDPA (torch picks its kernel),
gather + SDPA, and our Triton kernel on the scattered slots (fp32 and bf16 pools), each
the median of `triton.testing.do_bench` runs, which flushes the L2 cache before every
run so the KV comes from HBM. Device times come from CUDA-graph replays (the kernels
alone); ours is also timed per Python call, which adds Triton's launch cost. The split
sweep times the same decode with fixed key-split counts next to the automatic choice.
"""
from __future__ import annotations

import platform
from pathlib import Path

import torch
import torch.nn.functional as F

from lamina.bench.common import _write

HQ, HKV, D = 9, 3, 64


def _ms(fn, rep_ms: int) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median"))


def _graph_ms(fn, rep_ms: int) -> float:
    """Device time of fn alone: captured once in a CUDA graph, replays timed (no Python
    launch cost, which `_ms` on fn itself includes)."""
    fn()  # warm-up: compiles, and makes any host-side plan before the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return _ms(g.replay, rep_ms)


def gpu_bandwidth(rep_ms: int) -> dict:
    x = torch.ones(2 ** 28, device="cuda")  # 1 GiB fp32
    y = torch.empty_like(x)
    t_read = _ms(lambda: x.sum(), rep_ms)
    t_copy = _ms(lambda: y.copy_(x), rep_ms)
    return {"read_GBps": x.nbytes / t_read / 1e6,
            "copy_GBps_read_plus_write": 2 * x.nbytes / t_copy / 1e6}


def _gpu_case(row: dict, dt, q, idx, batch, S: int, g, tri, splits_sweep, rep_ms: int) -> None:
    """One dtype's pools for a (B, L) case: ours (graph-replayed and per call), SDPA on
    contiguous KV, gather + SDPA, and (fp32) the key-split sweep, into `row`."""
    from lamina.kernels import AttentionParams, TritonBackend, validate

    params, dev = AttentionParams(D ** -0.5), q.device
    B, L = row["B"], row["L"]
    name = "fp32" if dt == torch.float32 else "bf16"
    kp = torch.randn(S, HKV, D, device=dev, generator=g).to(dt)
    vp = torch.randn(S, HKV, D, device=dev, generator=g).to(dt)
    nbytes = 2 * B * L * HKV * D * kp.element_size()
    # the same number of bytes read by a plain streaming reduction: the ceiling a kernel
    # of this size reaches (launch and ramp-up included), beside the 1 GiB bandwidth
    flat = torch.ones(nbytes // 4, device=dev)
    row[f"read_{name}_GBps"] = nbytes / _graph_ms(lambda: flat.sum(), rep_ms) / 1e6
    # a memory worker validates a step's batch once, then attends per layer
    validate(q, kp, vp, batch, params)
    t = _graph_ms(lambda: tri.attend(q, kp, vp, batch, params), rep_ms)
    t_call = _ms(lambda: tri.attend(q, kp, vp, batch, params), rep_ms)
    plan = tri.plan(batch, HQ // HKV, HKV, dev, tri.head_group(kp))
    row[f"ours_{name}_ms"], row[f"ours_{name}_GBps"] = t, nbytes / t / 1e6
    row[f"ours_{name}_call_ms"] = t_call  # with Python's launch cost
    row[f"ours_{name}_splits"] = plan.splits
    qd = q.to(dt)[:, :, None]  # [B, Hq, 1, D]
    kc = kp[idx].permute(0, 2, 1, 3).contiguous()  # [B, Hkv, L, D]
    vc = vp[idx].permute(0, 2, 1, 3).contiguous()
    t_sdpa = _graph_ms(lambda: F.scaled_dot_product_attention(
        qd, kc, vc, scale=params.scale, enable_gqa=True), rep_ms)

    def gather_sdpa():
        k = kp[idx].permute(0, 2, 1, 3)
        v = vp[idx].permute(0, 2, 1, 3)
        return F.scaled_dot_product_attention(qd, k, v, scale=params.scale,
                                              enable_gqa=True)

    t_gather = _graph_ms(gather_sdpa, rep_ms)
    row.update({f"sdpa_{name}_ms": t_sdpa, f"sdpa_{name}_GBps": nbytes / t_sdpa / 1e6,
                f"gather_sdpa_{name}_ms": t_gather,
                f"gather_sdpa_{name}_GBps": nbytes / t_gather / 1e6})
    if dt == torch.float32:
        sweep = {}
        for s in splits_sweep:
            fixed = TritonBackend(splits=s)
            sweep[s] = _graph_ms(lambda: fixed.attend(q, kp, vp, batch, params),
                                 rep_ms)
        row["splits_sweep_ms"] = sweep


def _gpu_table(rows: list[dict]) -> list[list[str]]:
    table = [["B", "L", "ours fp32 ms", "ours fp32 ms per call", "ours fp32 GB/s",
              "% of read BW", "splits", "SDPA fp32 GB/s", "gather+SDPA fp32 GB/s",
              "x vs SDPA fp32", "x vs gather+SDPA", "ours bf16 ms", "ours bf16 GB/s",
              "bf16 % of read BW", "bf16 % of same-size read", "bf16 splits",
              "SDPA bf16 GB/s", "x vs SDPA bf16"]]
    for r in rows:
        table.append([str(r["B"]), str(r["L"]), f"{r['ours_fp32_ms']:.3f}",
                      f"{r['ours_fp32_call_ms']:.3f}",
                      f"{r['ours_fp32_GBps']:.0f}", f"{r['ours_frac_of_read_bw']:.0%}",
                      str(r["ours_fp32_splits"]),
                      f"{r['sdpa_fp32_GBps']:.0f}", f"{r['gather_sdpa_fp32_GBps']:.0f}",
                      f"{r['speedup_vs_sdpa']:.2f}", f"{r['speedup_vs_gather_sdpa']:.2f}",
                      f"{r['ours_bf16_ms']:.3f}", f"{r['ours_bf16_GBps']:.0f}",
                      f"{r['ours_bf16_frac_of_read_bw']:.0%}",
                      f"{r['ours_bf16_GBps'] / r['read_bf16_GBps']:.0%}",
                      str(r["ours_bf16_splits"]),
                      f"{r['sdpa_bf16_GBps']:.0f}", f"{r['bf16_speedup_vs_sdpa']:.2f}"])
    return table


def bench_attention_gpu(batches=(8, 32, 128), lengths=(512, 2048, 8192), rep_ms: int = 200,
                        splits_sweep=(4, 16, 32),
                        out_dir: str | Path = "benchmarks/results") -> dict:
    from lamina.costmodel.workload import scattered_tables
    from lamina.kernels import SlotBatch, TritonBackend

    if not torch.cuda.is_available():
        raise RuntimeError("the GPU attention benchmark needs a CUDA GPU; torch sees none")
    tri = TritonBackend()
    bw = gpu_bandwidth(rep_ms)
    dev = torch.device("cuda")
    rows = []
    for L in lengths:
        for B in batches:
            if B * L > 2 ** 20:  # keep the scattered-table setup (plain Python) short
                continue
            S = int(B * L * 1.25)
            tables = scattered_tables([L] * B, S, seed=B * 7 + L)
            batch = SlotBatch.decode(tables).to(dev)
            idx = batch.slots.long().view(B, L)
            g = torch.Generator(device=dev).manual_seed(0)
            q = torch.randn(B, HQ, D, device=dev, generator=g)
            row = {"B": B, "L": L}
            for dt in (torch.float32, torch.bfloat16):
                _gpu_case(row, dt, q, idx, batch, S, g, tri, splits_sweep, rep_ms)
            row["ours_frac_of_read_bw"] = row["ours_fp32_GBps"] / bw["read_GBps"]
            row["ours_bf16_frac_of_read_bw"] = row["ours_bf16_GBps"] / bw["read_GBps"]
            row["speedup_vs_sdpa"] = row["sdpa_fp32_ms"] / row["ours_fp32_ms"]
            row["speedup_vs_gather_sdpa"] = row["gather_sdpa_fp32_ms"] / row["ours_fp32_ms"]
            row["bf16_speedup_vs_sdpa"] = row["sdpa_bf16_ms"] / row["ours_bf16_ms"]
            rows.append(row)
            best = min(row["splits_sweep_ms"].items(), key=lambda kv: kv[1])
            print(f"B={B:4d} L={L:5d}  ours fp32 {row['ours_fp32_GBps']:7.1f} GB/s "
                  f"({row['ours_frac_of_read_bw']:.0%} of read, {row['ours_fp32_splits']} splits;"
                  f" best fixed {best[0]}: {row['ours_fp32_ms'] / best[1]:.2f}x of auto time)"
                  f"  bf16 {row['ours_bf16_GBps']:7.1f} ({row['ours_bf16_frac_of_read_bw']:.0%},"
                  f" x{row['bf16_speedup_vs_sdpa']:.2f} sdpa bf16)"
                  f"  sdpa {row['sdpa_fp32_GBps']:7.1f}"
                  f"  gather+sdpa {row['gather_sdpa_fp32_GBps']:7.1f}"
                  f"  x{row['speedup_vs_sdpa']:.2f}"
                  f" vs sdpa", flush=True)
    props = torch.cuda.get_device_properties(0)
    res = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
           "host": platform.machine(), "rep_ms": rep_ms, "bandwidth": bw,
           "shape": {"Hq": HQ, "Hkv": HKV, "D": D}, "rows": rows}
    table = _gpu_table(rows)
    jp, mp = _write(Path(out_dir), "attention_cuda", res, table)
    print(f"{props.name}: read bandwidth {bw['read_GBps']:.0f} GB/s, copy "
          f"{bw['copy_GBps_read_plus_write']:.0f} GB/s (read+write); wrote {jp} and {mp}")
    return res
