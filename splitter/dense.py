"""Dense kernels for the slices: linears on weights prepacked once for oneDNN.

Data in: a `SplitModel` whose slices are aten-level FX graphs; each linear reads its
weight from the model by `get_attr`. Data out: a new `SplitModel` (`pack_dense`) whose
slices call `mkldnn._linear_pointwise` on weights reordered once into oneDNN's blocked
layout, or the same model when the eager backend is chosen. The compute side runs them.

Why: on CPU, `aten.linear` goes to MKL sgemm, which re-packs the weight on every call,
barely scales past one thread, and loses most on the skinny decode shapes. Measured on
this 2-core AVX2 VM (fp32, M=32 rows): SmolLM2's lm_head (576 -> 49152) 53 ms eager vs
33 ms packed on 1 thread, 41 vs 20 ms on 2; the MLP's 576 -> 1536 0.96 vs 0.71 ms.
Packed weights are extra memory (one more copy of every packed weight): the model's own
stay, since the embedding table and the HF module keep using them.

bf16 (or fp16) weights on a CPU without that GEMM in hardware (AVX512-BF16 or AMX) are
packed as fp32 copies: each linear casts its input up, multiplies in fp32 and rounds its
output back to the model's dtype. bf16 x bf16 products are exact in fp32, so this differs
from an eager bf16 linear (also fp32 sums, rounded once) only in summation order: measured
here, 99.99% of outputs bitwise equal, the rest 1 ulp, at 1/6.6 of the time (32 x 576 ->
1536, 1 thread). The packed copies then take twice the bf16 weight bytes.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace

import torch
import torch.fx

from .slices import Slice

log = logging.getLogger("lamina.dense")

DENSE_BACKENDS = ("auto", "eager", "onednn")
_LINEAR = torch.ops.aten.linear.default


class DenseBackendError(RuntimeError):
    """The requested dense backend cannot run here."""


_TO = torch.ops.aten._to_copy.default
# Half dtypes oneDNN packs as they are where the CPU has their GEMM in hardware.
_NATIVE = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
           torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}
_NEEDS = {torch.bfloat16: "AVX512-BF16 or AMX", torch.float16: "AVX512-FP16 or AMX-FP16"}


@dataclass(frozen=True)
class DenseChoice:
    backend: str  # "eager" | "onednn"
    reason: str


def math_dtype(dtype: torch.dtype) -> tuple[torch.dtype | None, str]:
    """(dtype oneDNN multiplies weights of `dtype` in on this CPU, why); None: it cannot."""
    if not torch.backends.mkldnn.is_available():
        return None, "this torch build has no oneDNN (mkldnn)"
    name = str(dtype).removeprefix("torch.")
    if dtype == torch.float32:
        return dtype, "float32 CPU weights prepacked for oneDNN"
    if dtype not in _NATIVE:
        return None, f"oneDNN packs no {name} weights"
    if _NATIVE[dtype]():
        return dtype, f"{name} CPU weights prepacked for oneDNN"
    return torch.float32, (f"{name} weights prepacked for oneDNN as float32 copies (this "
                           f"CPU has no {name} GEMM in hardware, {_NEEDS[dtype]}, so eager "
                           f"{name} linears run several times slower); outputs are rounded "
                           f"back to {name}")


def select_dense_backend(name: str, dtype: torch.dtype, device: torch.device | str) -> DenseChoice:
    """`auto`: oneDNN for CPU weights it packs fast, else eager; `onednn` demands it."""
    if name not in DENSE_BACKENDS:
        raise ValueError(f"dense backend must be one of {DENSE_BACKENDS}, got {name!r}")
    if name == "eager":
        return DenseChoice("eager", "requested")
    math, why = (None, f"the weights are on {device}") if torch.device(device).type != "cpu" \
        else math_dtype(dtype)
    if math is not None:
        return DenseChoice("onednn", why)
    if name == "onednn":
        raise DenseBackendError(f"dense backend 'onednn' cannot run: {why}")
    return DenseChoice("eager", why)


def _weight_of(gm: torch.fx.GraphModule, node) -> torch.Tensor | None:
    if not isinstance(node, torch.fx.Node) or node.op != "get_attr":
        return None
    obj = functools.reduce(getattr, node.target.split("."), gm)  # as split.py reads sinks
    return obj if isinstance(obj, torch.Tensor) else None


def _cast(g: torch.fx.Graph, x, dtype: torch.dtype):
    return g.call_function(_TO, (x,), {"dtype": dtype})


def _bias_of(node):
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")


def _groups(gm: torch.fx.GraphModule) -> list[list]:
    """Packable linears as groups: those reading the same input with weights of one
    dtype, all with parameter biases or none (q/k/v, gate/up), become one group each
    (fused: one GEMM over the concatenated weights); every other linear is alone."""
    by_input: dict = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not _LINEAR:
            continue
        w = _weight_of(gm, node.args[1])
        if w is None or w.dim() != 2 or w.device.type != "cpu" or math_dtype(w.dtype)[0] is None:
            continue
        b = _bias_of(node)
        kind = "none" if b is None else "param" if _weight_of(gm, b) is not None else node
        by_input.setdefault((node.args[0], w.dtype, kind), []).append((node, w))
    return list(by_input.values())


def _pack_slice(s: Slice, packed: dict, batch_hint: int,
                fuse: bool = True) -> tuple[Slice, int]:
    """A copy of slice `s` with its packable linears rewritten; (slice, linears packed).

    Where the math dtype differs from the weight's: linear(x, w, b) becomes
    to(linear_pointwise(to(x, math), packed(w as math), b as math), w.dtype). Linears on
    one input (`_groups`) become one linear_pointwise over the concatenated weights whose
    output is sliced per original linear: each output column is the same dot product
    (outputs bitwise equal to separate packed linears, measured on SmolLM2's q/k/v and
    gate/up at 32 rows), with one call and one weight stream instead of several."""
    g = torch.fx.Graph()
    g.output(g.graph_copy(s.module.graph, {}))
    gm = torch.fx.GraphModule(s.module, g, class_name=type(s.module).__name__)
    n = count = 0
    groups = _groups(gm)
    for group in groups if fuse else [[m] for grp in groups for m in grp]:
        first, w0 = group[0]
        math = math_dtype(w0.dtype)[0]
        upcast = math != w0.dtype
        ws = [w for _, w in group]
        key = tuple((w.data_ptr(), tuple(w.shape), w.dtype) for w in ws)
        if key not in packed:  # a weight read by several slices is packed once
            packed[key] = torch.ops.mkldnn._reorder_linear_weight(
                torch.cat([w.detach().to(math) for w in ws]), batch_hint)
        gm.register_buffer(f"_lamina_packed_{n}", packed[key], persistent=False)
        x, bias = first.args[0], _bias_of(first)
        with gm.graph.inserting_before(first):
            attr = gm.graph.get_attr(f"_lamina_packed_{n}")
            if upcast:
                x = _cast(gm.graph, x, math)
            if len(group) > 1 and bias is not None:  # parameter biases, concatenated
                gm.register_buffer(f"_lamina_bias_{n}", torch.cat(
                    [_weight_of(gm, _bias_of(nd)).detach().to(math) for nd, _ in group]),
                    persistent=False)
                bias = gm.graph.get_attr(f"_lamina_bias_{n}")
            elif upcast and bias is not None:
                b = _weight_of(gm, bias)
                if b is not None:  # a parameter bias: one cast copy, kept like the weight
                    gm.register_buffer(f"_lamina_bias_{n}", b.detach().to(math),
                                       persistent=False)
                    bias = gm.graph.get_attr(f"_lamina_bias_{n}")
                else:
                    bias = _cast(gm.graph, bias, math)
            out = gm.graph.call_function(torch.ops.mkldnn._linear_pointwise.default,
                                         (x, attr, bias, "none", [], ""))
            if upcast:
                out = _cast(gm.graph, out, w0.dtype)
            col = 0
            for node, w in group:
                y = out if len(group) == 1 else gm.graph.call_function(
                    torch.ops.aten.slice.Tensor, (out, -1, col, col + w.shape[0]))
                col += w.shape[0]
                node.replace_all_uses_with(y)
        for node, _ in group:
            gm.graph.erase_node(node)
        n += 1
        count += len(group)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return replace(s, module=gm), count


def pack_dense(split, backend: str = "auto", batch_hint: int = 32, fuse: bool = True):
    """Return (split with packed linears or `split` itself, DenseChoice).

    `batch_hint` is the row count oneDNN tunes the blocked layout for (any count runs);
    `fuse=False` packs every linear alone (no shared calls for linears on one input)."""
    if not isinstance(batch_hint, int) or batch_hint < 1:
        raise ValueError(f"batch_hint must be a positive int, got {batch_hint!r}")
    first = next((p for s in split.slices for p in s.module.parameters()), None)
    dtype = first.dtype if first is not None else torch.float32
    device = first.device if first is not None else torch.device("cpu")
    choice = select_dense_backend(backend, dtype, device)
    log.info("dense backend: %s (%s)", choice.backend, choice.reason)
    if choice.backend == "eager":
        return split, choice
    packed: dict = {}
    slices, count = [], 0
    for s in split.slices:
        ps, n = _pack_slice(s, packed, batch_hint, fuse)
        slices.append(ps)
        count += n
    if count == 0:
        return split, DenseChoice("eager", "no linear reads a packable weight")
    return replace(split, slices=slices), DenseChoice(
        "onednn", f"{choice.reason}: {count} linears, {len(packed)} packed weights")
