"""The data plane's per-layer exchange, C++ ends against Python ends, without Ray:
`python benchmarks/bench_dataplane.py [--repeat 5] [--batch 32] [--context 1 256]
[--kv-dtype int8] [--paths python c++ gloo]`.

Two memory-server processes (`lamina.dataplane.protocol.MemoryServer`, forked, one torch
thread each)
hold SmolLM2-shaped pools (30 layers, 3 KV heads, head_dim 64); this process is the
compute end (`SocketLink`). Per layer it spins `--gap-ms` (a stand-in for the dense
slice, so the workers sleep between layers as in a real step), then sends the layer's
q|k|v for B decode rows (half per worker) and waits for the outputs. Timed: that
exchange, median over the steps of a round. Rounds alternate the two paths, fresh
servers each: "python" (both ends' Python per-layer code, `native=False`) and "c++"
(`serve_step` on the memory end, `submit_qkv` / `collect_o` on the compute end). The
context length sets the kernel's share (1: almost none, the exchange is pure overhead).
`--kv-dtype int8`: the pools hold int8 rows (q/k/v still in `--dtype`; the memory end
quantizes each new row and folds the keys' channel scales into q). `--paths ... gloo`
adds a round of the Python ends with every q|k|v and output on a gloo collective path
(`lamina.dataplane.collective`; what NCCL carries between GPUs), the sockets carrying
the headers and metadata.
Writes JSON and Markdown (benchmarks/results/dataplane.*).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch

LAYERS, HQ, HKV, D, WORKERS = 30, 9, 3, 64, 2


def serve(sock, pool_cfg, params, fast: bool, rdv=None) -> None:
    from lamina.dataplane.collective import open_path
    from lamina.dataplane.protocol import MemoryServer
    from lamina.dataplane.transport import SocketChannel
    from lamina.memory.memory_side import MemorySide
    from lamina.memory.pool import KVPool

    torch.set_num_threads(1)
    peer = open_path(rdv, 1, "cpu", rdv.host) if rdv else None
    MemoryServer(MemorySide(KVPool(pool_cfg)), params, SocketChannel(sock, peer=peer),
                 native=fast).serve()


def one_round(path: str, batch: int, ctx: int, dtype: str, steps: int, gap_s: float,
              kv_dtype: str | None = None):
    """Median seconds of one layer's exchange over `steps` steps (after 2 warm-up);
    `path`: "python", "c++" or "gloo"."""
    from lamina.compute.packing import WorkerPart
    from lamina.dataplane.collective import LOOPBACK, Rendezvous, host_store, open_path
    from lamina.dataplane.protocol import SocketLink
    from lamina.dataplane.transport import SocketChannel
    from lamina.kernels import AttentionParams, SlotBatch
    from lamina.memory.pool import KVPoolConfig

    fast = path == "c++"
    # a gloo round's stores, made before the fork (this end joins as their host)
    stores = [host_store(LOOPBACK) for _ in range(WORKERS)] if path == "gloo" else []
    rdvs = [Rendezvous("gloo", LOOPBACK, port) for _, port in stores]

    per = batch // WORKERS
    scales = (tuple((torch.rand(LAYERS * HKV * D, generator=torch.Generator().manual_seed(0))
                     + 0.5).tolist()) if kv_dtype == "int8" else None)
    cfg = KVPoolConfig(LAYERS, per * (ctx + 1) + 8, HKV, D, dtype=kv_dtype or dtype,
                       key_scales=scales)
    params = [AttentionParams(D ** -0.5)] * LAYERS
    chans, pids = [], []
    for w in range(WORKERS):
        a, b = socket.socketpair()
        pid = os.fork()
        if pid == 0:  # the memory worker
            a.close()
            code = 0
            try:
                serve(b, cfg, params, fast, rdvs[w] if rdvs else None)
            except BaseException:  # noqa: BLE001
                code = 1
            os._exit(code)
        b.close()
        chans.append(a)
        pids.append(pid)
    chans = [SocketChannel(a, peer=open_path(rdvs[w], 0, "cpu", LOOPBACK,
                                             store=stores[w][0]) if rdvs else None)
             for w, a in enumerate(chans)]
    link = SocketLink(chans, native=fast)
    parts = []
    for w in range(WORKERS):  # request i of worker w owns slots i*(ctx+1) .. +ctx
        tables = [list(range(i * (ctx + 1), (i + 1) * (ctx + 1))) for i in range(per)]
        rows = torch.arange(w * per, (w + 1) * per)
        parts.append(WorkerPart(rows, torch.tensor([t[-1] for t in tables], dtype=torch.int32),
                                SlotBatch.build(tables, [1] * per), rows,
                                (w * per, (w + 1) * per)))
    t = getattr(torch, dtype)
    q, k, v = (torch.randn(batch, h, D, dtype=t) for h in (HQ, HKV, HKV))
    times = []
    try:
        for step in range(steps + 2):
            link.begin(step, [parts])
            for layer in range(LAYERS):
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < gap_s:
                    pass
                t0 = time.perf_counter()
                link.submit(layer, 0, q, k, v, parts)
                link.collect(layer, 0, parts, (batch, HQ, D), t)
                if step >= 2:
                    times.append(time.perf_counter() - t0)
    finally:
        for ch in chans:
            ch.close()
        for pid in pids:
            os.waitpid(pid, 0)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5, help="rounds per path (alternating)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, nargs="+", default=[1, 256])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--kv-dtype", default=None, choices=["int8"],
                    help="the pools' dtype (default: --dtype)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--gap-ms", type=float, default=2.0)
    ap.add_argument("--paths", nargs="+", default=["python", "c++"],
                    choices=["python", "c++", "gloo"])
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    from lamina.bench.common import _write
    from lamina.dataplane.paths import native_ext

    if native_ext() is None:
        print("the compiled data plane is unavailable (see lamina.kernels.load_cpu_kernel)")
        return 1
    torch.set_num_threads(1)
    rows, paths = [], args.paths
    for ctx in args.context:
        got: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.repeat):  # the paths alternate within each repeat
            for name in paths:
                got[name].append(one_round(name, args.batch, ctx, args.dtype, args.steps,
                                           args.gap_ms * 1e-3, args.kv_dtype))
        med = {n: statistics.median(got[n]) * 1e6 for n in paths}
        kv = args.kv_dtype or args.dtype
        rows.append({"batch": args.batch, "context": ctx, "dtype": args.dtype, "kv_dtype": kv,
                     "us": med, "rounds_us": {n: [x * 1e6 for x in got[n]] for n in paths},
                     "vs_first": {n: med[paths[0]] / med[n] for n in paths}})
        print(f"B={args.batch} context={ctx} {args.dtype}, {kv} pools: one layer's exchange "
              + ", ".join(f"{n} {med[n]:.0f} us (x{med[paths[0]] / med[n]:.2f})"
                          for n in paths), flush=True)
    table = [["B", "context", "dtype", "KV", *(f"{n} ends, us/layer" for n in paths),
              *(f"{paths[0]} / {n}" for n in paths[1:])]]
    table += [[str(r["batch"]), str(r["context"]), r["dtype"], r["kv_dtype"],
               *(f"{r['us'][n]:.0f}" for n in paths),
               *(f"{r['vs_first'][n]:.2f}" for n in paths[1:])] for r in rows]
    jp, mp = _write(Path(args.out), "dataplane", {"args": vars(args), "rows": rows}, table)
    print(f"wrote {jp} and {mp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
