"""Load and fault benchmark: `lamina bench load`.

Data in: a `lamina serve --executor ray` subprocess on loopback, driven by the official
`openai` client from `concurrency` threads, `requests` streamed completions (token-id
prompts of 16-256 tokens cut from a fixed text, 8-48 new tokens, greedy). Data out, per
phase, in JSON and Markdown: requests ok / 429 / 5xx / lost, p50 and p99 latency and
time to first token, tok/s, and the RSS of every server process (the server, Ray's and
the workers') before and after, with the largest growth.

Phases:
- `load`: the default queue bound; the goal is 0 lost, 0 5xx, RSS growth <= 10% from
  after a warm-up of 2 x `concurrency` requests to the end (the start is reported too).
- `queue`: `--max-waiting 4`, so some requests get 429; every request either succeeds or
  gets 429, none is lost silently.
- `faults`: a memory worker is SIGKILLed a third of the way through, the compute worker
  two thirds of the way; every request must still complete, and a fixed subset of 16
  must equal HF's greedy tokens. Detection + recovery time (kill to the recovery counter
  on /metrics moving) and the recovery itself (`lamina_last_recovery_seconds`) are
  reported.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lamina.bench.common import _write, pct

TEXT = ("Attention offloading keeps the key-value cache on cheap memory devices while the "
        "dense layers run on accelerators, so decode batches can grow far beyond what one "
        "device holds. ") * 60
SUBSET = 16  # requests whose greedy tokens are checked against HF in the fault phase


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lamina_serve_cmd(executor: str = "ray", memory_workers: int = 2,
                     *extra: str) -> list[str]:
    """`lamina serve` as a command line (this python), the model served as "smol"."""
    return [sys.executable, "-m", "lamina.entrypoints.cli", "serve", "--executor", executor,
            "--memory-workers", str(memory_workers), "--served-model-name", "smol", *extra]


class Server:
    """`lamina serve --executor ray` (or `cmd`, any HTTP server with /health; `env`
    its environment) in its own session; `stop` ends it and every process under it.
    Its output goes to a temporary log, removed by `stop` unless the server had exited
    on its own by then (the log is named on stderr) or failed to start (named in the
    error)."""

    def __init__(self, port: int, extra: list[str], timeout_s: float = 300,
                 cmd: list[str] | None = None, env: dict | None = None):
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        cmd = cmd or lamina_serve_cmd("ray", 2, "--port", str(port))
        self.log = tempfile.NamedTemporaryFile("w", prefix=f"lamina-serve-{port}-",
                                               suffix=".log", delete=False)
        self.proc = subprocess.Popen([*cmd, *extra], stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self.log.flush()
                raise RuntimeError(f"{' '.join(cmd[:4])} ... exited with "
                                   f"{self.proc.returncode}; see {self.log.name}: "
                                   f"{Path(self.log.name).read_text()[-1500:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1)
        self.stop(keep_log=True)
        raise TimeoutError(f"the server ({self.log.name}) not healthy after {timeout_s} s")

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " ") or line.startswith(name + "_total "):
                    return float(line.split()[-1])
        return 0.0

    def stop(self, keep_log: bool = False) -> None:
        """SIGTERM to its process group (a graceful stop for `lamina serve`, uvicorn and
        vLLM alike; SIGINT would be ignored by a server started from a background job
        of a non-interactive shell, which ignores it and passes that on), then SIGKILL
        to whatever is left after 60 s."""
        exited = self.proc.poll()  # before stop: the server died during the run
        tree = descendants(self.proc.pid)
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        for pid in [self.proc.pid, *tree]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(30)
        self.log.close()
        if exited is not None:
            print(f"the server exited with {exited} before it was stopped; its log: "
                  f"{self.log.name}", file=sys.stderr)
        elif not keep_log:
            Path(self.log.name).unlink(missing_ok=True)


def descendants(pid: int) -> list[int]:
    """Every process under `pid` (from /proc), children first found first."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def rss(pid: int) -> tuple[str, int] | None:
    """(command name, resident KiB) of a live process, else None."""
    try:
        status = open(f"/proc/{pid}/status").read()
        cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ").strip()[:80]
    except OSError:
        return None
    kib = [int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS")]
    return (cmd, kib[0]) if kib else None


def snapshot(server: Server) -> dict[int, tuple[str, int]]:
    return {p: r for p in [server.proc.pid, *descendants(server.proc.pid)]
            if (r := rss(p)) is not None}


def workload(n: int, tok, seed: int = 0) -> list[tuple[list[int], int]]:
    """n (prompt token ids, max_tokens): 16-256 prompt tokens, 8-48 new ones."""
    ids, rng = tok(TEXT)["input_ids"], random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(16, 256)
        start = rng.randrange(len(ids) - length)
        out.append((ids[start:start + length], rng.randint(8, 48)))
    return out


def _one(client, prompt, max_tokens) -> dict:
    """One streamed completion -> {status, ttft_s, e2e_s, tokens, token_ids}."""
    import openai

    t0 = time.perf_counter()
    ttft, ids = None, []
    try:
        for ch in client.completions.create(model="smol", prompt=prompt, temperature=0,
                                            max_tokens=max_tokens, stream=True):
            got = (ch.choices[0].model_extra or {}).get("token_ids") or [] if ch.choices else []
            if got and ttft is None:
                ttft = time.perf_counter() - t0
            ids += got
        status = 200
    except openai.APIStatusError as e:
        status = e.status_code
    except openai.APIError as e:  # a connection lost, a stream cut off
        status = f"{type(e).__name__}: {e}"
    return {"status": status, "ttft_s": ttft, "e2e_s": time.perf_counter() - t0,
            "tokens": len(ids), "token_ids": ids}


def run_phase(server: Server, work, concurrency: int, kills=(), warmup=()) -> dict:
    """Drive `work` through the server; `kills`: (fraction of requests done, process
    name) -> SIGKILL that worker then, timing detection + recovery from /metrics. RSS
    growth is measured from after `warmup` (run first: the compute worker's scratch pool
    and oneDNN's per-shape caches settle in the first steps) to the end."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                           timeout=900)
    done, lock, faults = [0], threading.Lock(), []

    def task(item):
        r = _one(client, *item)
        with lock:
            done[0] += 1
        return r

    watcher = threading.Thread(target=_killer, args=(server, kills, done, len(work), faults),
                               daemon=True)
    rss_start = snapshot(server)
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda item: _one(client, *item), warmup))
    rss0 = snapshot(server)
    t0 = time.perf_counter()
    watcher.start()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(task, work))
    wall = time.perf_counter() - t0
    watcher.join(120)
    time.sleep(1)
    res = _summary(results, wall, rss0, snapshot(server), faults)
    res["rss_start_kib"] = {f"{p} {c}": k for p, (c, k) in rss_start.items()}
    return res


def _killer(server: Server, kills, done, total: int, faults: list) -> None:
    for frac, name in kills:
        while done[0] < frac * total:
            time.sleep(0.05)
        pids = [p for p in descendants(server.proc.pid)
                if (r := rss(p)) and name in r[0]]
        if not pids:
            faults.append({"worker": name, "error": "process not found"})
            continue
        before = server.metric("lamina_recoveries")
        t = time.perf_counter()
        os.kill(pids[0], signal.SIGKILL)
        while server.metric("lamina_recoveries") <= before and time.perf_counter() - t < 300:
            time.sleep(0.1)
        faults.append({"worker": name, "pid": pids[0],
                       "detected_and_recovered_s": time.perf_counter() - t,
                       "recovery_s": server.metric("lamina_last_recovery_seconds")})


def _summary(results, wall, rss0, rss1, faults) -> dict:
    ok = [r for r in results if r["status"] == 200]
    codes = [r["status"] for r in results]
    growth = {}
    for pid, (cmd, kib) in rss0.items():
        if pid in rss1:
            growth[f"{pid} {cmd}"] = rss1[pid][1] / kib - 1
    return {"requests": len(results), "ok": len(ok),
            "429": codes.count(429), "5xx": sum(isinstance(c, int) and c >= 500 for c in codes),
            "other": [c for c in codes if c not in (200, 429) and not
                      (isinstance(c, int) and c >= 500)][:10],
            "lost": len(results) - len(ok) - codes.count(429),
            "wall_s": wall, "tok_s": sum(r["tokens"] for r in ok) / wall,
            "p50_s": pct([r["e2e_s"] for r in ok], 0.5),
            "p99_s": pct([r["e2e_s"] for r in ok], 0.99),
            "ttft_p50_s": pct([r["ttft_s"] for r in ok], 0.5),
            "ttft_p99_s": pct([r["ttft_s"] for r in ok], 0.99),
            "rss_before_kib": {f"{p} {c}": k for p, (c, k) in rss0.items()},
            "rss_after_kib": {f"{p} {c}": k for p, (c, k) in rss1.items()},
            "rss_max_growth": max(growth.values(), default=0.0),
            "faults": faults, "token_ids": [r["token_ids"] for r in results]}


def _hf_refs(work) -> list[list[int]]:
    """HF generate's greedy tokens for the first SUBSET requests."""
    import torch

    from lamina.model.loader import load

    m = load()
    refs = []
    with torch.no_grad():
        for prompt, new in work[:SUBSET]:
            ids = torch.tensor([prompt])
            out = m.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=new, pad_token_id=m.tokenizer.eos_token_id)
            refs.append(out[0, len(prompt):].tolist())
    return refs


def bench_load(requests: int = 1000, concurrency: int = 32, phases=("load", "queue",
               "faults"), out_dir: str | Path = "benchmarks/results") -> dict:
    from lamina.model.loader import load

    tok = load(with_tokenizer=True).tokenizer
    work, warmup = workload(requests, tok), workload(2 * concurrency, tok, seed=1)
    res: dict = {"requests": requests, "concurrency": concurrency, "cpu": _cpu(),
                 "phases": {}}
    for phase in phases:
        extra = ["--max-waiting", "4"] if phase == "queue" else []
        kills = ((1 / 3, "MemoryWorker"), (2 / 3, "ComputeWorker")) if phase == "faults" else ()
        refs = _hf_refs(work) if phase == "faults" else None
        srv = Server(_free_port(), extra)
        try:
            r = run_phase(srv, work, concurrency, kills, warmup if phase == "load" else ())
        finally:
            srv.stop()
        if refs is not None:
            r["subset_equal_hf"] = sum(a == b for a, b in zip(r["token_ids"], refs))
        r.pop("token_ids")
        res["phases"][phase] = r
        print(f"{phase}: {_line(r)}", flush=True)
    rows = [["phase", "ok", "429", "5xx", "lost", "tok/s", "p50 / p99 s", "TTFT p50 / p99 s",
             "max RSS growth", "faults: kill to recovered s (recovery s)", "subset = HF"]]
    for phase, r in res["phases"].items():
        rows.append([phase, str(r["ok"]), str(r["429"]), str(r["5xx"]), str(r["lost"]),
                     f"{r['tok_s']:.0f}", f"{r['p50_s']:.2f} / {r['p99_s']:.2f}",
                     f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f}",
                     f"{100 * r['rss_max_growth']:.1f}%",
                     ", ".join(f"{f['worker']} {f.get('detected_and_recovered_s', 0):.1f} "
                               f"({f.get('recovery_s', 0):.1f})" for f in r["faults"]) or "-",
                     f"{r.get('subset_equal_hf', '-')}"
                     + (f"/{SUBSET}" if "subset_equal_hf" in r else "")])
    jp, mp = _write(Path(out_dir), "load", res, rows)
    print(f"wrote {jp} and {mp}")
    return res


def _line(r: dict) -> str:
    return (f"{r['ok']} ok, {r['429']} x 429, {r['5xx']} x 5xx, {r['lost']} lost, "
            f"{r['tok_s']:.0f} tok/s, p50 {r['p50_s']:.2f} s, p99 {r['p99_s']:.2f} s, "
            f"RSS growth {100 * r['rss_max_growth']:.1f}%, faults {r['faults']}")


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x {os.cpu_count()}"
    except OSError:
        pass
    return "unknown"

