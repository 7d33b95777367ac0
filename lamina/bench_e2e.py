"""End-to-end decode benchmark: `lamina bench e2e`.

Data in: the default model (or --model), B prompts of 128 tokens, 128 new tokens,
greedy with ignore_eos. Data out: tok/s for HF `generate`, ours with the local executor
and ours with attention in Ray memory-worker processes, their ratios, and the per-step
breakdown (dense / attention incl. data plane), as JSON and Markdown.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from .bench import _write

TEXT = "The quick brown fox jumps over the lazy dog while the river keeps flowing. " * 200


def _prompts(tok, B: int, n: int) -> list[list[int]]:
    ids = tok(TEXT)["input_ids"]
    return [ids[b: b + n] for b in range(B)]  # distinct, equal length: HF needs no padding


def _ours(llm, prompts, new):
    from lamina import SamplingParams

    eng = llm.engine
    eng.step_timings.clear()
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    dt = time.perf_counter() - t
    decode = [s for s in eng.step_timings if s["tokens"] == len(prompts)]  # pure decode steps
    step = {k: statistics.median(s[k] for s in decode) for k in ("dense_s", "attention_s")}
    n = sum(len(o.token_ids) for o in outs)
    return n / dt, step, [o.token_ids for o in outs]


def bench_e2e(model=None, batches=(1, 8, 32), prompt_len=128, new_tokens=128, threads=2,
              out_dir: str | Path = "benchmarks/results", executors=("local", "ray")) -> dict:
    from lamina import LLM

    torch.set_num_threads(threads)
    rows, llms = [], {}
    for ex in executors:
        kw = dict(executor="ray", num_memory_workers=2) if ex == "ray" else {}
        llms[ex] = LLM(model, num_kv_slots=max(batches) * (prompt_len + new_tokens) + 64,
                       max_step_tokens=max(batches) * prompt_len, **kw)
    any_llm = next(iter(llms.values()))
    tok, hf = any_llm.loaded.tokenizer, any_llm.loaded.model
    for B in batches:
        prompts = _prompts(tok, B, prompt_len)
        ids = torch.tensor(prompts)
        t = time.perf_counter()
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              pad_token_id=tok.eos_token_id)
        hf_tps = B * new_tokens / (time.perf_counter() - t)
        row = {"B": B, "hf_tok_s": hf_tps}
        for ex, llm in llms.items():
            tps, step, toks = _ours(llm, prompts, new_tokens)
            row[f"{ex}_tok_s"] = tps
            row[f"{ex}_x_hf"] = tps / hf_tps
            row[f"{ex}_step_dense_ms"] = step["dense_s"] * 1e3
            row[f"{ex}_step_attention_ms"] = step["attention_s"] * 1e3
            row[f"{ex}_same_tokens_as_hf"] = toks == ref[:, prompt_len:].tolist()
        rows.append(row)
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items()), flush=True)
    for llm in llms.values():
        llm.shutdown()
    res = {"model": any_llm.loaded.source, "prompt_len": prompt_len, "new_tokens": new_tokens,
           "threads_driver": threads, "ray_workers": "1 compute + 2 memory, 1 thread each",
           "dtype": "float32", "rows": rows}
    hdr = ["B", "HF tok/s"]
    for ex in llms:
        hdr += [f"{ex} tok/s", f"{ex} x HF", f"{ex} dense ms/step", f"{ex} attention ms/step"]
    table = [hdr]
    for r in rows:
        line = [str(r["B"]), f"{r['hf_tok_s']:.1f}"]
        for ex in llms:
            line += [f"{r[f'{ex}_tok_s']:.1f}", f"{r[f'{ex}_x_hf']:.2f}",
                     f"{r[f'{ex}_step_dense_ms']:.1f}", f"{r[f'{ex}_step_attention_ms']:.1f}"]
        table.append(line)
    jp, mp = _write(Path(out_dir), "e2e", res, table)
    print("\n".join(" | ".join(r) for r in table))
    print(f"wrote {jp} and {mp}")
    return res
