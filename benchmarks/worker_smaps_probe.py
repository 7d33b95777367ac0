"""Which mappings of the Ray workers grow under load (`/proc/PID/smaps`, diffed).

    python benchmarks/worker_smaps_probe.py [--requests 2000] [--concurrency 8]

`lamina serve --executor ray` (2 memory workers), the load of `server_rss_probe.py`
(completions of 16 tokens, seeded sampling, half streamed, --concurrency clients
without a pause); each worker's resident KB per mapping read after the first 250
requests and after --requests. Printed: each worker's growth, and the mappings that
grew most (a shared-memory ring, `/dev/shm/lamina-*`, counts in both processes that
map it; an anonymous mapping over 64 MB is named with its size).
"""
from __future__ import annotations

import argparse
import collections
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lamina.bench.load import Server, _free_port, lamina_serve_cmd

sys.path.insert(0, str(Path(__file__).parent))
from server_rss_probe import ray_workers, request  # a sibling script, not a package

WARM = 250


def mappings(pid: int) -> collections.Counter:
    """{mapping: resident KB} of one process."""
    out: collections.Counter = collections.Counter()
    name = None
    for line in open(f"/proc/{pid}/smaps"):
        f = line.split()
        if not f[0].endswith(":"):  # a mapping's header: range perms offset dev inode path
            lo, hi = (int(x, 16) for x in f[0].split("-"))
            name = f[5] if len(f) > 5 else "[anon]"
            if name == "[anon]" and hi - lo > (64 << 20):
                name = f"[anon] ({(hi - lo) >> 20} MB)"
        elif f[0] == "Rss:":
            out[name] += int(f[1])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    port = _free_port()
    server = Server(port, [], cmd=lamina_serve_cmd("ray", 2, "--port", str(port)))
    try:
        with ThreadPoolExecutor(args.concurrency) as pool:
            list(pool.map(lambda i: request(server.url, i, 16), range(WARM)))
            workers = ray_workers(server)
            before = {k: mappings(p) for k, p in workers.items()}
            list(pool.map(lambda i: request(server.url, i, 16), range(WARM, args.requests)))
            after = {k: mappings(p) for k, p in workers.items()}
        for k in workers:
            grew = sum(after[k].values()) - sum(before[k].values())
            print(f"{k}: +{grew >> 10} MB from {WARM} to {args.requests} requests")
            for name, kib in (after[k] - before[k]).most_common(5):
                print(f"  +{kib:7d} KB  {name}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
