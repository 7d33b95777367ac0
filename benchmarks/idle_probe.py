"""Does this machine slow down reads of memory the process has not touched for a while?

    python benchmarks/idle_probe.py

One thread. After sleeping 0, 0.5, 2 and 5 s: the first pass over 30 bf16 weight
matrices of SmolLM2's MLP shape (53 MB: a model's worth of reads), the pass after it,
the page faults of the first (getrusage), and, after the same sleep again, a pure-Python
loop (no memory traffic). The second "idle 0" row follows a 5 s sleep and the Python
loop: what counts is the time since the weights were last read. On the 2-vCPU VMs here
that first pass was up to tens of times slower while the Python loop was not, with no
page faults in the guest: the slowness is in reaching memory left untouched, below the
process (the hypervisor), and any server's first request after idle pays it. Nothing is
written.
"""
from __future__ import annotations

import resource
import time

import torch


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(576, 1536, generator=g).to(torch.bfloat16) for _ in range(30)]
    x = torch.randn(1, 576).to(torch.bfloat16)

    def matmuls() -> float:
        t = time.perf_counter()
        for w in weights:
            x @ w
        return (time.perf_counter() - t) * 1e3

    def python_loop() -> float:
        t, acc = time.perf_counter(), 0
        for i in range(300_000):
            acc += i
        return (time.perf_counter() - t) * 1e3

    for _ in range(100):
        matmuls()
    for idle in (0, 0.5, 2, 5, 0, 5):
        time.sleep(idle)
        r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        first = matmuls()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0
        second = matmuls()
        time.sleep(idle)
        py = python_loop()
        print(f"idle {idle:>3} s: first pass {first:6.1f} ms ({faults} page faults), next "
              f"{second:5.1f} ms; Python loop after the same idle {py:5.1f} ms", flush=True)


if __name__ == "__main__":
    main()
