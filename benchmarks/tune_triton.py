"""Sweep the Triton decode kernels' launch settings on one GPU, for SmolLM2's shape:
`python benchmarks/tune_triton.py [--kernel heads|head] [--dtype bf16|fp32] [--out F]
[B L ...]`.

`head`: the one-kv-head broadcasting kernel (BLOCK_N, warps, stages, splits).
`heads`: the head-group kernel (kv heads a program, BLOCK_N, warps, stages, key splits;
the fused split merge, and the best setting again with a second merge kernel).
Device times from CUDA-graph replays (lamina.bench.gpu), KV flushed from L2 each run;
each case also times contiguous SDPA (flash for bf16) and a streaming read of the same
bytes. Prints the best settings a case and writes all rows
as JSON to --out."""
import argparse
import itertools
import json

import torch
import torch.nn.functional as F

from lamina.bench.gpu import HKV, HQ, D, _graph_ms
from lamina.costmodel.workload import scattered_tables
from lamina.kernels import AttentionParams, SlotBatch, TritonBackend, validate

HEAD_GRID = dict(block_n=(32, 64, 128), num_warps=(1, 2, 4), num_stages=(2, 3),
                 splits=(None, 4, 16))
HEADS_GRID = dict(kv_heads_per_program=(1, 3), block_n=(32, 64), num_warps=(2, 4),
                  num_stages=(2, 3), splits=(1, 2, 4, 8, 16, 32))


def _configs(kernel):
    grid = HEADS_GRID if kernel == "heads" else HEAD_GRID
    for vals in itertools.product(*grid.values()):
        yield dict(zip(grid.keys(), vals))


def _baselines(q, kp, vp, batch, p, B, L, nbytes):
    idx = batch.slots.long().view(B, L)
    qd = q.to(kp.dtype)[:, :, None]
    kc = kp[idx].permute(0, 2, 1, 3).contiguous()
    vc = vp[idx].permute(0, 2, 1, 3).contiguous()
    sdpa = _graph_ms(lambda: F.scaled_dot_product_attention(
        qd, kc, vc, scale=p.scale, enable_gqa=True), 50)
    flat = torch.ones(nbytes // 4, device=q.device)
    read = _graph_ms(lambda: flat.sum(), 50)
    return sdpa, read


def case(B, L, dt, kernel, rows):
    dev = torch.device("cuda")
    p = AttentionParams(D ** -0.5)
    S = int(B * L * 1.25)
    batch = SlotBatch.decode(scattered_tables([L] * B, S, seed=1)).to(dev)
    q = torch.randn(B, HQ, D, device=dev)
    kp = torch.randn(S, HKV, D, device=dev).to(dt)
    vp = torch.randn(S, HKV, D, device=dev).to(dt)
    validate(q, kp, vp, batch, p)
    nbytes = 2 * B * L * HKV * D * kp.element_size()
    ref, _ = TritonBackend(bf16_tensor_cores=False).attend(q, kp, vp, batch, p)
    sdpa, read = _baselines(q, kp, vp, batch, p, B, L, nbytes)
    res = []
    for cfg in _configs(kernel):
        extra = {} if kernel == "head" else {"fuse_merge": True}
        tri = TritonBackend(**cfg, **extra)
        try:
            o, _ = tri.attend(q, kp, vp, batch, p)
            err = float((o.float() - ref.float()).abs().max())
            t = _graph_ms(lambda: tri.attend(q, kp, vp, batch, p), 50)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory
            print(f"  skip {cfg}: {type(e).__name__}: {str(e)[:120]}")
            continue
        res.append((t, cfg, err))
    res.sort(key=lambda r: r[0])
    name = "bf16" if dt == torch.bfloat16 else "fp32"
    default = TritonBackend()
    try:
        t_def = _graph_ms(lambda: default.attend(q, kp, vp, batch, p), 50)
    except Exception as e:  # noqa: BLE001 - report and go on to the sweep's rows
        print(f"  defaults failed: {type(e).__name__}: {str(e)[:300]}")
        t_def = float("nan")
    print(f"B={B} L={L} {name} {kernel}: sdpa {sdpa:.4f} ms, same-size read {read:.4f} ms"
          f" ({nbytes / read / 1e6:.0f} GB/s), defaults {t_def:.4f} ms"
          f" ({nbytes / t_def / 1e6:.0f} GB/s, x{sdpa / t_def:.2f} sdpa); best 8:", flush=True)
    for t, cfg, err in res[:8]:
        print(f"   {t:.4f} ms {nbytes / t / 1e6:6.0f} GB/s x{sdpa / t:.2f} sdpa "
              f"err {err:.1e} {cfg}", flush=True)
    if kernel == "heads" and res:  # the best setting with the merge as a second kernel
        cfg = res[0][1]
        tri = TritonBackend(**cfg, fuse_merge=False)
        t = _graph_ms(lambda: tri.attend(q, kp, vp, batch, p), 50)
        print(f"   same without the fused merge: {t:.4f} ms", flush=True)
    rows.append({"B": B, "L": L, "dtype": name, "kernel": kernel, "bytes": nbytes,
                 "sdpa_ms": sdpa, "read_same_size_ms": read, "defaults_ms": t_def,
                 "results": [{"ms": t, "err": e, **c} for t, c, e in res]})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", default="heads", choices=["heads", "head"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--out", default=None)
    ap.add_argument("sizes", nargs="*", type=int)
    a = ap.parse_args()
    sizes = a.sizes or [32, 2048, 128, 2048, 32, 8192, 128, 8192]
    dt = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    rows = []
    for B, L in zip(sizes[::2], sizes[1::2]):
        case(B, L, dt, a.kernel, rows)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
