"""Communication-attention overlap over a rate-limited link (paper 5.2, Fig. 16):
`python benchmarks/overlap_link.py [--rate-mbit 1000] [--batches 8 32 128]
[--context 512] [--groups 1 4] [--steps 4] [--out benchmarks/results]` (root).

`lamina bench overlap` runs the Ray executor on one host, where the data plane is a Unix
socket and shared memory: a layer's exchange takes a few hundred microseconds and there
is little to hide. Here the memory worker sits on an emulated host behind a slow link:
- a network namespace joined to this one by a veth pair, both ends shaped by `tc tbf`
  to --rate-mbit (netem is not available on these machines; tbf is);
- the memory worker (a `MemoryServer` over its own KV pool, the C++ memory end) serves
  on a thread of this process, over a TCP socket made inside the namespace;
- the compute side (`ComputeSide` + `SocketLink`, the C++ compute end) drives SmolLM2's
  decode steps through `LLMEngine`, as `lamina bench overlap` does (`decode_case`).
Per batch and stream width (`stream_groups`): decode tok/s and, from the trace, the
data-plane time a step and the share of it spent while the memory worker attends.
Needs root and iproute2; the namespace and link are removed on exit.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

CLONE_NEWNET = 0x40000000


def sh(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise OSError(f"{' '.join(cmd)}: {r.stderr.strip()}")


class ShapedLink:
    """A namespace joined to this one by a veth pair, each end shaped to `rate_mbit`."""

    def __init__(self, rate_mbit: int):
        tag = os.getpid() % 100000
        self.ns, self.dev = f"lmol{tag}", f"lmol{tag}v"
        self.host_ip, self.ns_ip = "10.214.0.1", "10.214.0.2"
        shape = ("tc", "qdisc", "add", "dev")
        tbf = ("root", "tbf", "rate", f"{rate_mbit}mbit", "burst", "256kb", "latency", "100ms")
        try:
            sh("ip", "netns", "add", self.ns)
            sh("ip", "link", "add", self.dev, "type", "veth", "peer", "name", self.dev + "p")
            sh("ip", "link", "set", self.dev + "p", "netns", self.ns)
            sh("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.dev)
            sh("ip", "link", "set", self.dev, "up")
            sh(*shape, self.dev, *tbf)
            for cmd in (("ip", "addr", "add", f"{self.ns_ip}/24", "dev", self.dev + "p"),
                        ("ip", "link", "set", self.dev + "p", "up"),
                        ("ip", "link", "set", "lo", "up"), (*shape, self.dev + "p", *tbf)):
                sh("ip", "netns", "exec", self.ns, *cmd)
        except OSError:
            self.remove()
            raise

    def listen(self) -> socket.socket:
        """A listening TCP socket inside the namespace (made on a thread that joins it:
        a socket keeps the namespace it was made in)."""
        out: list = []

        def make():
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/var/run/netns/{self.ns}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET):
                    out.append(OSError(ctypes.get_errno(), "setns"))
                    return
            finally:
                os.close(fd)
            out.append(socket.create_server((self.ns_ip, 0)))

        t = threading.Thread(target=make)
        t.start()
        t.join()
        if isinstance(out[0], Exception):
            raise out[0]
        return out[0]

    def remove(self) -> None:
        subprocess.run(["ip", "link", "del", self.dev], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=30)


def link_executor(split, pool, stream: int, link: ShapedLink):
    """One memory worker behind `link`, the compute side here (an `Executor`)."""
    from lamina.compute.compute_side import ComputeSide
    from lamina.dataplane.protocol import MemoryServer, SocketLink
    from lamina.dataplane.transport import SocketChannel
    from lamina.executor.base import Executor
    from lamina.memory.memory_side import MemorySide

    class LinkExecutor(Executor):
        def __init__(self):
            self.compute = ComputeSide(split, 1)
            with link.listen() as srv:
                a = socket.create_connection(srv.getsockname())
                b, _ = srv.accept()
            for s in (a, b):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.server = MemoryServer(MemorySide(pool), self.compute.params,
                                       SocketChannel(b), "memory worker 0")
            threading.Thread(target=self.server.serve, daemon=True).start()
            self.link = SocketLink([SocketChannel(a)], stream=stream)
            self.tracers = [*self.compute.lanes, self.server.tracer, self.server.send_tracer]

        def execute(self, plan):
            return self.compute.run(plan, self.link)

        def start_trace(self):
            for tr in self.tracers:
                tr.start()

        def stop_trace(self):
            return [s for tr in self.tracers for s in tr.stop()]

        def shutdown(self):
            for ch in self.link.channels:
                ch.close()

    return LinkExecutor()


def run(rate_mbit: int, batches, context: int, groups, steps: int, out: str) -> dict:
    from lamina.bench.common import _write, cpu_name
    from lamina.bench.pipeline import _spare, decode_case
    from lamina.engine.config import EngineConfig
    from lamina.engine.engine import LLMEngine
    from lamina.memory.pool import KVPool, KVPoolConfig
    from lamina.model.loader import load
    from lamina.splitter import split_model
    from lamina.trace import hidden_fraction, transfer_seconds

    loaded = load()
    split = split_model(loaded.model)
    slots = max(batches) * (context + _spare(batches, context, steps)) + 64
    link, rows = ShapedLink(rate_mbit), []
    try:
        for g in groups:
            pool = KVPool(KVPoolConfig.for_specs(split.attention_specs, slots))
            ex = link_executor(split, pool, g, link)
            cfg = EngineConfig(num_kv_slots=slots, num_memory_workers=1, prefix_caching=False,
                               max_batch=max(batches), max_step_tokens=4096, stream_groups=g)
            llm = SimpleNamespace(engine=LLMEngine(cfg, ex, loaded.tokenizer, loaded.config),
                                  executor=ex)
            try:
                for b in batches:
                    r = decode_case(llm, b, context, "none", steps)
                    spans = r.pop("spans")
                    r.update(groups=g, hidden=hidden_fraction(spans),
                             data_plane_ms=1e3 * transfer_seconds(spans) / steps,
                             native_steps=ex.server.native_steps, steps_served=ex.server.steps)
                    rows.append(r)
                    print(f"B={b} groups={g}: {r['tok_s']:.1f} tok/s, data plane "
                          f"{r['data_plane_ms']:.1f} ms/step, hidden {r['hidden'] or 0:.0%}",
                          flush=True)
            finally:
                ex.shutdown()
    finally:
        link.remove()
    rows.sort(key=lambda r: (r["batch"], r["groups"]))
    base = {r["batch"]: r["tok_s"] for r in rows if r["groups"] == groups[0]}
    table = [["B", "context", "groups", "tok/s", f"x groups {groups[0]}",
              "data plane ms/step", "hidden behind attention"]]
    for r in rows:
        table.append([str(r["batch"]), str(context), str(r["groups"]), f"{r['tok_s']:.1f}",
                      f"{r['tok_s'] / base[r['batch']]:.2f}", f"{r['data_plane_ms']:.1f}",
                      f"{(r['hidden'] or 0):.0%}"])
    res = {"cpu": cpu_name(), "rate_mbit": rate_mbit, "rows": rows}
    jp, mp = _write(Path(out), f"overlap_link_{rate_mbit}mbit", res, table)
    print("\n".join(" | ".join(r) for r in table))
    print(f"wrote {jp} and {mp}")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate-mbit", type=int, default=1000)
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("overlap_link: needs root (network namespaces and tc)", file=sys.stderr)
        return 2
    run(args.rate_mbit, args.batches, args.context, args.groups, args.steps, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
