"""Fused pointwise ops for the dense slices, and the eager op chains they replace.

Data in: tensors from the compute side's slice graphs (residual rows, rotary q/k, the MLP's
gate/up). Data out: one tensor each. `lamina.splitter.fuse` rewrites each matched chain
into one call of these; `pointwise_ops()` hands out the compiled ones (or None and why).
`argmax_rows` is the sampler's greedy argmax over the last slice's logits,
`masked_argmax_rows` the same over the tokens a structured output allows.

The references are the chains exactly as HF's LLaMA-family modules run them eagerly, so
tests compare the fused ops against them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .cpu_build import KernelBuildError, load_cpu_kernel

log = logging.getLogger("lamina.kernels")


@dataclass(frozen=True)
class PointwiseOps:
    rms_norm: Callable  # (x [..., D], weight [D], eps) -> [..., D]
    rope: Callable  # (x [..., D], cos, sin broadcast to x) -> [..., D]
    silu_mul: Callable  # (gate, up) -> silu(gate) * up


def rms_norm_reference(x, weight, eps: float):
    xf = x.to(torch.float32)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def rope_reference(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin


def silu_mul_reference(gate, up):
    return torch.nn.functional.silu(gate) * up


REFERENCE = PointwiseOps(rms_norm_reference, rope_reference, silu_mul_reference)


def pointwise_ops() -> tuple[PointwiseOps | None, str]:
    """(the compiled fused ops, why) or (None, why not)."""
    try:
        ext = load_cpu_kernel()
    except KernelBuildError as e:
        return None, f"the CPU extension is not available ({e})"
    return PointwiseOps(ext.rms_norm, ext.rope, ext.silu_mul), "compiled CPU pointwise ops"


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Greedy sampling's argmax: x [R, V] logits (fp32 or bf16) -> [R] int64, the first
    index of each row's maximum, a NaN counting as the maximum: `torch.argmax(x.float(),
    -1)` exactly. The compiled op reads bf16 rows as they are (torch's bf16 argmax is not
    vectorized, and its fp32 one takes ~1.3 ms at 32 x 49152 here); elsewhere torch's."""
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16):
        try:
            return load_cpu_kernel().argmax_rows(x)
        except KernelBuildError:
            pass
    return torch.argmax(x if x.dtype == torch.float32 else x.float(), dim=-1)


def masked_argmax_rows(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Structured output's greedy argmax: x [R, V] logits (fp32 or bf16), bits uint8
    [R, >= V / 8] (bit t & 7 of byte t >> 3 = token t allowed) -> [R] int64, the first
    index of each row's maximum among its allowed tokens, an allowed NaN counting as the
    maximum; -1 for a row with none allowed. The compiled op reads only the 16-token
    blocks with an allowed token; elsewhere torch's (a masked fp32 copy)."""
    if x.device.type == "cpu" and x.dim() == 2 and x.dtype in (torch.float32, torch.bfloat16):
        try:
            return load_cpu_kernel().masked_argmax_rows(x, bits.contiguous())
        except KernelBuildError:
            pass
    R, V = x.shape
    keep = torch.from_numpy(np.unpackbits(bits.cpu().numpy(), axis=1, count=V,
                                          bitorder="little")).bool().to(x.device)
    out = torch.argmax(torch.where(keep, x.float(), float("-inf")), dim=-1)
    # every allowed logit -inf: the argmax may land on a token left out; the first allowed
    out = torch.where(keep.gather(1, out[:, None])[:, 0], out, keep.int().argmax(dim=-1))
    return torch.where(keep.any(dim=1), out, -1)
