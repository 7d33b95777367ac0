"""`lamina serve`'s RSS over many requests, with and without handing freed memory back.

    python benchmarks/server_rss_probe.py [--requests 2000] [--concurrency 8]
        [--every 250] [--max-tokens 16] [--executor local|ray] [--ways baseline trimmed]
        [--out DIR]

Two servers (SmolLM2, the default engine, on --executor), one after the other: the
baseline with `LAMINA_MALLOC_TRIM=0` (the engine loop never calls glibc's
`malloc_trim`), then as shipped (it calls it each time the loop goes idle, and every
`TRIM_BUSY_S` under load: `engine_loop.release_freed_memory`). Each gets the same
--requests completions (seeded sampling, --max-tokens each, half streamed) from
--concurrency client threads, each sending its next as soon as its last ended; its RSS
is read each time another --every requests have ended, under load. With the Ray
executor the RSS of each process is read: the server (driver), its compute worker and
each memory worker (Ray's worker processes are not trimmed). Reported per process: RSS
after the first --every (warm) and at the end, and the growth between.
Writes server_rss_probe.json and .md into --out.
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lamina.bench.common import _write, cpu_name
from lamina.bench.load import Server, _free_port, lamina_serve_cmd, rss, snapshot


def request(url: str, i: int, max_tokens: int) -> None:
    body = {"prompt": f"Request {i}: tell me about the number {i * 7}",
            "max_tokens": max_tokens, "temperature": 0.8, "seed": i, "stream": i % 2 == 0}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def ray_workers(server: Server) -> dict[str, int]:
    """{"ComputeWorker 0" / "MemoryWorker k": pid} of the Ray workers under `server`,
    numbered in pid order."""
    out, n = {}, {}
    for pid, (cmd, _) in sorted(snapshot(server).items()):
        role = cmd.split()[0].split(".")[0]  # "ray::MemoryWorker.ping" in a call
        if role in ("ray::ComputeWorker", "ray::MemoryWorker"):
            k = n[role] = n.get(role, -1) + 1
            out[f"{role[5:]} {k}"] = pid
    return out


def reading(server: Server) -> dict[str, int]:
    """{process: RSS MB}: the server, and under Ray its workers."""
    procs = {"server": server.proc.pid, **ray_workers(server)}
    return {name: r[1] // 1024 for name, pid in procs.items() if (r := rss(pid)) is not None}


def one_server(trim: bool, args) -> list[dict[str, int]]:
    """RSS readings each time another --every requests have ended, read while the load
    goes on: --concurrency clients each send their next request as soon as their last
    ends, so the loop is never idle for long (the last requests' tail aside)."""
    port = _free_port()
    server = Server(port, [], cmd=lamina_serve_cmd(args.executor, 2, "--port", str(port)),
                    env={**os.environ, "LAMINA_MALLOC_TRIM": "1" if trim else "0"})
    ended, lock, seen = [0], threading.Lock(), []

    def one(i: int) -> None:
        try:
            request(server.url, i, args.max_tokens)
        finally:  # a failed request ends too (its error shows below), the reads go on
            with lock:
                ended[0] += 1

    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            running = pool.map(one, range(args.requests))
            while len(seen) < args.requests // args.every:
                time.sleep(0.05)
                if ended[0] >= (len(seen) + 1) * args.every:
                    seen.append(reading(server))
                    print(f"  trim={trim} {ended[0]} requests: RSS MB {seen[-1]}",
                          flush=True)
            list(running)  # a client's error shows here
        return seen
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--every", type=int, default=250)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--executor", choices=("local", "ray"), default="local")
    ap.add_argument("--ways", nargs="+", choices=("baseline", "trimmed"),
                    default=["baseline", "trimmed"])
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    args = ap.parse_args()
    runs = {way: one_server(way == "trimmed", args) for way in args.ways}
    rows = [["server", "process", f"RSS after {args.every} (MB)",
             f"RSS after {args.requests} (MB)", "growth (MB)"]]
    result = {"cpu": cpu_name(), "args": {k: str(v) for k, v in vars(args).items()}}
    for way, seen in runs.items():
        result[way] = {"rss_mb": seen}
        for proc in seen[0]:
            first, last = seen[0][proc], seen[-1].get(proc, 0)
            rows.append([way, proc, str(first), str(last), str(last - first)])
    for r in rows:
        print(" | ".join(r))
    print("paths:", *_write(args.out, "server_rss_probe", result, rows))


if __name__ == "__main__":
    main()
