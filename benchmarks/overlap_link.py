"""Communication-attention overlap over a rate-limited link (paper 5.2, Fig. 16):
`python benchmarks/overlap_link.py [--rate-mbit 1000] [--batches 8 32 128]
[--context 512] [--groups 1 4] [--steps 4] [--out benchmarks/results]` (root).

`lamina bench overlap` runs the Ray executor on one host, where the data plane is a Unix
socket and shared memory: a layer's exchange takes a few hundred microseconds and there
is little to hide. Here the memory worker sits on an emulated host behind a slow link:
- a network namespace joined to this one by a veth pair, both ends shaped by `tc tbf`
  to --rate-mbit (`lamina.bench.netns`; netem is not available on these machines);
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
import os
import socket
import sys
import threading
from types import SimpleNamespace


def link_executor(split, pool, stream: int, link):
    """One memory worker behind host 1 of `link` (`Namespaces`), the compute side here
    (an `Executor`)."""
    from lamina.compute.compute_side import ComputeSide
    from lamina.dataplane.protocol import MemoryServer, SocketLink
    from lamina.dataplane.transport import SocketChannel
    from lamina.executor.base import Executor
    from lamina.memory.memory_side import MemorySide

    class LinkExecutor(Executor):
        def __init__(self):
            self.compute = ComputeSide(split, 1)
            with link.listen(1) as srv:
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
    from lamina.bench.common import cpu_name
    from lamina.bench.netns import Namespaces
    from lamina.bench.pipeline import _spare, overlap_case, overlap_report
    from lamina.engine.config import EngineConfig
    from lamina.engine.engine import LLMEngine
    from lamina.memory.pool import KVPool, KVPoolConfig
    from lamina.model.loader import load
    from lamina.splitter import split_model

    loaded = load()
    split = split_model(loaded.model)
    slots = max(batches) * (context + _spare(batches, context, steps)) + 64
    link, rows = Namespaces(1, subnet="10.214", rate_mbit=rate_mbit), []
    try:
        for g in groups:
            pool = KVPool(KVPoolConfig.for_specs(split.attention_specs, slots))
            ex = link_executor(split, pool, g, link)
            cfg = EngineConfig(num_kv_slots=slots, num_memory_workers=1, prefix_caching=False,
                               max_batch=max(batches), max_step_tokens=4096, stream_groups=g)
            llm = SimpleNamespace(engine=LLMEngine(cfg, ex, loaded.tokenizer, loaded.config),
                                  executor=ex)
            try:
                rows += [overlap_case(llm, b, context, g, steps) for b in batches]
                if ex.server.native_steps != ex.server.steps:  # what this measures
                    raise RuntimeError(f"the C++ memory end served {ex.server.native_steps} "
                                       f"of {ex.server.steps} steps")
            finally:
                ex.shutdown()
    finally:
        link.remove()
    res = {"cpu": cpu_name(), "rate_mbit": rate_mbit, "rows": rows}
    return overlap_report(res, groups, context, f"overlap_link_{rate_mbit}mbit", out)


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
