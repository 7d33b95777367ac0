"""One layer's prompt attention on a CPU pool: the slot kernel against torch's flash
kernel over the gathered keys and, for bf16 pools on CPUs with AVX512-BF16, our bf16
prompt kernel (`lamina.kernels.prompt_sdpa`: what `CpuBackend` runs for requests with
many queries, `bf16_kernel` says which of the two for bf16).

    python benchmarks/prompt_attention_probe.py [--repeat 7]

SmolLM2's heads (9 query, 3 kv, D = 64), one request on scattered slots of an 8192-slot
pool: a whole 3072-token prompt, then chunks (queries after `start` keys). Median of
`repeat` calls each; prints ms and the ratio. Nothing is written.
"""
from __future__ import annotations

import argparse

import torch

from lamina.bench.common import cpu_name, median_ms
from lamina.kernels import AttentionParams, CpuBackend, SlotBatch, prompt_sdpa
from lamina.kernels.cpu_build import load_cpu_kernel

HQ, HKV, D, SLOTS = 9, 3, 64, 8192


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads")
    ours_built = load_cpu_kernel().prompt_flash_compiled()
    print(f"bf16 prompt kernel built in: {ours_built}; used for bf16 pools: "
          f"{prompt_sdpa.bf16_kernel() is not None}")
    backend, params = CpuBackend(), AttentionParams(D ** -0.5)
    g = torch.Generator().manual_seed(0)
    for queries, start in ((3072, 0), (1024, 2048), (256, 2816)):
        table = torch.randperm(SLOTS, generator=g)[:start + queries].tolist()
        batch = SlotBatch.build([table], [queries])
        for dtype in (torch.float32, torch.bfloat16):
            k = torch.randn(SLOTS, HKV, D, generator=g).to(dtype)
            v = torch.randn(SLOTS, HKV, D, generator=g).to(dtype)
            q = torch.randn(queries, HQ, D, generator=g).to(dtype)
            slot = median_ms(lambda: backend._slots(q, k, v, batch, params), args.repeat)
            def taken(ours):
                return prompt_sdpa.attend_taken(q, k, v, batch, params, 0, queries, ours=ours)

            flash = median_ms(lambda: taken(False), args.repeat)
            line = (f"{queries} queries after {start} keys, {str(dtype)[6:]} pool: slot kernel "
                    f"{slot:.1f} ms, torch flash {flash:.1f} ms ({slot / flash:.2f}x)")
            if dtype == torch.bfloat16 and ours_built:
                ours = median_ms(lambda: taken(True), args.repeat)
                line += f", ours {ours:.1f} ms ({slot / ours:.2f}x; {flash / ours:.2f}x torch's)"
            print(line, flush=True)


if __name__ == "__main__":
    main()
