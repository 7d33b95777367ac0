"""bf16 linears for the dense slices on CPUs with AVX512-BF16 but no AMX
(`csrc/linear_bf16.cpp`), handed to the splitter's `pack_dense` as its "avx512bf16"
backend.

Data in: bf16 weights [out, in] (once, `pack`), then per call x [..., in] bf16 and an
optional bias [out]. Data out: y [..., out] bf16, x w^T + bias summed in fp32 and rounded
once to bf16, as an eager bf16 linear (summation order aside). `linear_ops()` hands out
the compiled ops, or None and why not.

Why only without AMX: with AMX, oneDNN runs bf16 GEMMs on its tiles, far past what
AVX512-BF16 dot products reach; without it, oneDNN's bf16 GEMM was the slower one here
(module docstring of `lamina.splitter.dense`, `benchmarks/linear_probe.py`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .cpu_build import KernelBuildError, cpu_flags, load_cpu_kernel


@dataclass(frozen=True)
class LinearOps:
    pack: Callable  # (w [out, in] bf16) -> packed weight
    linear: Callable  # (x [..., in] bf16, packed, out_features, bias [out] | None) -> [..., out]


def linear_ops() -> tuple[LinearOps | None, str]:
    """(the compiled bf16 linear ops, why) or (None, why not)."""
    try:
        ext = load_cpu_kernel()
    except KernelBuildError as e:
        return None, f"the CPU extension is not available ({e})"
    if not ext.linear_bf16_compiled():
        return None, "this CPU has no AVX512-BF16"
    if "amx_bf16" in cpu_flags():
        return None, "this CPU has AMX, which oneDNN's bf16 GEMM uses"
    return LinearOps(ext.pack_linear_bf16, ext.linear_bf16), "AVX512-BF16, no AMX"
