"""End-to-end decode on a GPU compute device: `lamina bench e2e --device cuda`.

Data in: the default model (or --model), B prompts of 128 tokens, 128 new tokens, greedy
with ignore_eos, bf16 (or --dtype). Data out: decode tok/s (median of `repeat` runs) for
HF `generate` on the GPU and for ours in three setups, all in one process on one GPU:
`gpu-kv` (slices and KV on the GPU, Triton attention), `host-kv-1` / `host-kv-2` (slices
on the GPU, KV in host DRAM in 1 or 2 memory workers, the compiled CPU kernel; q/k/v and
o through pinned buffers). Ratios to HF, tokens against HF's, and the per-step breakdown
of a median decode step: dense (the slices, GPU time: the run that measures it waits
for the GPU after each slice), attention (the memory side's calls, their kernels and
metadata), transfer (GPU <-> pinned host copies), sample, and the transfer share of the
step. JSON and Markdown.

The breakdown comes from one extra run with `sync_timers` on (for the host setups the
copies wait for the GPU anyway, so that run is the same as the timed ones); tok/s come
from the runs without it.
"""
from __future__ import annotations

import os
import platform
import statistics
import time
from pathlib import Path

import torch

from lamina.bench.common import _write
from lamina.bench.e2e import _prefix, _prompts

SETUPS = {"gpu-kv": dict(kv_device="cuda", num_memory_workers=1),
          "host-kv-1": dict(kv_device="cpu", num_memory_workers=1),
          "host-kv-2": dict(kv_device="cpu", num_memory_workers=2)}
_KEYS = ("step_s", "dense_s", "attention_s", "transfer_s", "sample_s")


def _decode_steps(eng, B: int) -> list[dict]:
    return [s for s in eng.step_timings if s["tokens"] == B and not s.get("failed")]


def _ours(llm, prompts, new, repeat) -> tuple[float, dict, list]:
    from lamina import SamplingParams

    eng, runs, toks = llm.engine, [], None
    sp = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up: captures this size's graphs
    eng.step_timings.clear()
    for _ in range(repeat):
        eng.clear_prefix_cache()  # every run prefills its prompts afresh
        torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        torch.cuda.synchronize()
        runs.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t))
        toks = [o.token_ids for o in outs]
    timed = statistics.median(s["step_s"] for s in _decode_steps(eng, len(prompts)))
    eng.step_timings.clear()
    eng.clear_prefix_cache()
    llm.executor.compute.sync_timers = True
    llm.generate(prompts, sp, use_tqdm=False)
    llm.executor.compute.sync_timers = False
    steps = _decode_steps(eng, len(prompts))
    step = {k[:-2]: 1e3 * statistics.median(s.get(k, 0.0) for s in steps) for k in _KEYS}
    step["transfer_share"] = step["transfer"] / step["step"]
    step["decode_tok_s"] = len(prompts) / timed  # from the timed runs' decode steps
    return statistics.median(runs), step, toks


def bench_e2e_gpu(model=None, batches=(1, 32, 256), prompt_len=128, new_tokens=128,
                  dtype="bfloat16", repeat=3, setups=tuple(SETUPS), threads=None,
                  out_dir: str | Path = "benchmarks/results") -> dict:
    from lamina import LLM

    if not torch.cuda.is_available():
        raise RuntimeError("lamina bench e2e --device cuda needs a CUDA GPU (torch sees none)")
    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)  # the host memory workers' attention
    rows, hf_rows = [], {}
    for name in setups:
        llm = LLM(model, dtype=dtype, kv_dtype=dtype, compute_device="cuda",
                  num_kv_slots=max(batches) * (prompt_len + new_tokens) + 64,
                  max_step_tokens=max(batches) * prompt_len, max_batch=max(batches),
                  **SETUPS[name])
        hf = llm.loaded.model  # the same weights, on the same GPU
        prompts = {B: _prompts(llm.loaded.tokenizer, B, prompt_len) for B in batches}
        for B in batches:
            if B not in hf_rows:
                hf_rows[B] = _hf_gpu(hf, prompts[B], new_tokens, repeat)
            hf_tps, ref = hf_rows[B]
            tps, step, toks = _ours(llm, prompts[B], new_tokens, repeat)
            same = sum(a == b for a, b in zip(toks, ref))
            row = {"setup": name, "B": B, "hf_tok_s": hf_tps, "tok_s": tps,
                   "x_hf": tps / hf_tps, "step_ms": step, "identical_seqs": f"{same}/{B}",
                   "common_prefix_min": min(_prefix(a, b) for a, b in zip(toks, ref)),
                   "graph_buckets": len(llm.executor.compute.graphs._buckets)}
            rows.append(row)
            print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in row.items() if k != "step_ms"), step, flush=True)
        llm.shutdown()
        del llm, hf
        torch.cuda.empty_cache()
    res = {"device": torch.cuda.get_device_name(), "host_cpu": platform.processor() or
           platform.machine(), "host_threads": threads, "dtype": dtype,
           "prompt_len": prompt_len, "new_tokens": new_tokens, "repeat": repeat,
           "torch": torch.__version__, "rows": rows}
    table = [["setup", "B", "HF tok/s", "ours tok/s", "x HF", "ours decode tok/s", "step ms",
              "dense", "attention", "transfer", "sample", "transfer %", "same seqs as HF"]]
    for r in rows:
        s = r["step_ms"]
        table.append([r["setup"], str(r["B"]), f"{r['hf_tok_s']:.0f}", f"{r['tok_s']:.0f}",
                      f"{r['x_hf']:.2f}", f"{s['decode_tok_s']:.0f}", f"{s['step']:.2f}",
                      f"{s['dense']:.2f}",
                      f"{s['attention']:.2f}", f"{s['transfer']:.2f}", f"{s['sample']:.2f}",
                      f"{100 * s['transfer_share']:.0f}", r["identical_seqs"]])
    jp, mp = _write(Path(out_dir), "e2e_gpu", res, table)
    print("\n".join(" | ".join(r) for r in table))
    print(f"wrote {jp} and {mp}")
    return res


def _hf_gpu(hf, prompts, new, repeat):
    """HF `generate` on the GPU: (tok/s median, its tokens); a warm-up run first."""
    dev = next(hf.parameters()).device
    _hf_on(hf, prompts[:1], 2, dev)
    torch.cuda.synchronize()
    return _hf_on(hf, prompts, new, dev, repeat)


def _hf_on(hf, prompts, new, dev, repeat=1):
    ids = torch.tensor(prompts, device=dev)
    runs, ref = [], None
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
        torch.cuda.synchronize()
        runs.append(len(prompts) * new / (time.perf_counter() - t))
    return statistics.median(runs), ref[:, ids.shape[1]:].tolist()
