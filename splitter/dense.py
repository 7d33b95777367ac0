"""Dense kernels for the slices: linears on weights prepacked once for oneDNN, or for
a given bf16 linear kernel (`lamina.kernels.linear`: AVX512-BF16 pair dot products).

Data in: a `SplitModel` whose slices are aten-level FX graphs; each linear reads its
weight from the model by `get_attr`; optionally the bf16 linear kernel's ops
(`LinearOps`-like: `pack(w)`, `linear(x, packed, out_features, bias)`). Data out: a new
`SplitModel` (`pack_dense`) whose slices call `mkldnn._linear_pointwise` on weights
reordered once into oneDNN's blocked layout, or the kernel's `linear` on weights it
packed, or the same model when the eager backend is chosen. The compute side runs them.

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

bf16 weights on a CPU with AVX512-BF16 but no AMX go, under "auto", to the given bf16
kernel (backend "avx512bf16") where one is given: there oneDNN's bf16 GEMM streamed
SmolLM2's weights at 15 GB/s at 1-8 rows and reached 365-386 GFLOP/s at 256-3072 rows,
the kernel 18-28 GB/s and 405 (2-vCPU AMD EPYC, `python benchmarks/linear_probe.py`).
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace

import torch
import torch.fx

from .slices import Slice
from .trace_store import graph_module

log = logging.getLogger("lamina.dense")

DENSE_BACKENDS = ("auto", "eager", "onednn", "avx512bf16")
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
    backend: str  # "eager" | "onednn" | "avx512bf16"
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


def select_dense_backend(name: str, dtype: torch.dtype, device: torch.device | str,
                         linear_ops=None, linear_why: str = "no bf16 linear kernel given"
                         ) -> DenseChoice:
    """`auto`: the bf16 linear kernel for bf16 CPU weights where `linear_ops` is given
    (None: `linear_why` says why not), else oneDNN for CPU weights it packs fast, else
    eager; `onednn` and `avx512bf16` demand theirs."""
    if name not in DENSE_BACKENDS:
        raise ValueError(f"dense backend must be one of {DENSE_BACKENDS}, got {name!r}")
    if name == "eager":
        return DenseChoice("eager", "requested")
    on_cpu = torch.device(device).type == "cpu"
    if name in ("auto", "avx512bf16"):
        why = (f"the weights are on {device}" if not on_cpu else
               f"the weights are {str(dtype).removeprefix('torch.')}, not bfloat16"
               if dtype != torch.bfloat16 else linear_why)
        if on_cpu and dtype == torch.bfloat16 and linear_ops is not None:
            return DenseChoice("avx512bf16", "bfloat16 CPU weights packed for Lamina's "
                                             "AVX512-BF16 linear kernel")
        if name == "avx512bf16":
            raise DenseBackendError(f"dense backend 'avx512bf16' cannot run: {why}")
    math, why = (None, f"the weights are on {device}") if not on_cpu else math_dtype(dtype)
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


@dataclass(frozen=True)
class _OneDnn:
    """Packs for `mkldnn._linear_pointwise` (weights in oneDNN's math dtype)."""
    batch_hint: int

    def math(self, w: torch.Tensor) -> torch.dtype | None:
        return math_dtype(w.dtype)[0]

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(w, self.batch_hint)

    def call(self, g: torch.fx.Graph, x, attr, bias, out_features: int):
        return g.call_function(torch.ops.mkldnn._linear_pointwise.default,
                               (x, attr, bias, "none", [], ""))


@dataclass(frozen=True)
class _Kernel:
    """Packs for the given bf16 linear kernel (bf16 weights of even in-features only)."""
    ops: object  # LinearOps-like: pack(w), linear(x, packed, out_features, bias)

    def math(self, w: torch.Tensor) -> torch.dtype | None:
        return w.dtype if w.dtype == torch.bfloat16 and w.shape[1] % 2 == 0 else None

    def pack(self, w: torch.Tensor) -> torch.Tensor:
        return self.ops.pack(w)

    def call(self, g: torch.fx.Graph, x, attr, bias, out_features: int):
        return g.call_function(self.ops.linear, (x, attr, out_features, bias))


def _pack_slice(s: Slice, packed: dict, packer, fuse: bool = True) -> tuple[Slice, int]:
    """A copy of slice `s` with its packable linears rewritten; (slice, linears packed).

    Where the math dtype differs from the weight's: linear(x, w, b) becomes
    to(linear_pointwise(to(x, math), packed(w as math), b as math), w.dtype). Linears on
    one input (`_groups`) become one packed linear over the concatenated weights whose
    output is sliced per original linear: each output column is the same dot product
    (outputs bitwise equal to separate packed linears, measured on SmolLM2's q/k/v and
    gate/up at 32 rows), with one call and one weight stream instead of several."""
    g = torch.fx.Graph()
    g.output(g.graph_copy(s.module.graph, {}))
    gm = graph_module(s.module, g, class_name=type(s.module).__name__)
    n = count = 0
    groups = [grp for grp in _groups(gm) if packer.math(grp[0][1]) is not None]
    for group in groups if fuse else [[m] for grp in groups for m in grp]:
        _rewrite_group(gm, group, n, packed, packer)
        n += 1
        count += len(group)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return replace(s, module=gm), count


def _rewrite_group(gm: torch.fx.GraphModule, group: list, n: int, packed: dict,
                   packer) -> None:
    """Linears of `group` ((node, weight) pairs on one input) -> one packed call."""
    first, w0 = group[0]
    math = packer.math(w0)
    upcast = math != w0.dtype
    ws = [w for _, w in group]
    key = tuple((w.data_ptr(), tuple(w.shape), w.dtype) for w in ws)
    if key not in packed:  # a weight read by several slices is packed once
        packed[key] = packer.pack(torch.cat([w.detach().to(math) for w in ws]))
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
                gm.register_buffer(f"_lamina_bias_{n}", b.detach().to(math), persistent=False)
                bias = gm.graph.get_attr(f"_lamina_bias_{n}")
            else:
                bias = _cast(gm.graph, bias, math)
        out = packer.call(gm.graph, x, attr, bias, sum(w.shape[0] for w in ws))
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


def pack_dense(split, backend: str = "auto", batch_hint: int = 32, fuse: bool = True,
               linear_ops=None, linear_why: str = "no bf16 linear kernel given"):
    """Return (split with packed linears or `split` itself, DenseChoice).

    `batch_hint` is the row count oneDNN tunes the blocked layout for (any count runs);
    `fuse=False` packs every linear alone (no shared calls for linears on one input);
    `linear_ops` / `linear_why`: the bf16 linear kernel, or why there is none."""
    if not isinstance(batch_hint, int) or batch_hint < 1:
        raise ValueError(f"batch_hint must be a positive int, got {batch_hint!r}")
    first = next((p for s in split.slices for p in s.module.parameters()), None)
    dtype = first.dtype if first is not None else torch.float32
    device = first.device if first is not None else torch.device("cpu")
    choice = select_dense_backend(backend, dtype, device, linear_ops, linear_why)
    log.info("dense backend: %s (%s)", choice.backend, choice.reason)
    if choice.backend == "eager":
        return split, choice
    packer = _Kernel(linear_ops) if choice.backend == "avx512bf16" else _OneDnn(batch_hint)
    packed: dict = {}
    slices, count = [], 0
    for s in split.slices:
        ps, n = _pack_slice(s, packed, packer, fuse)
        slices.append(ps)
        count += n
    if count == 0:
        return split, DenseChoice("eager", "no linear reads a packable weight")
    return replace(split, slices=slices), DenseChoice(
        choice.backend, f"{choice.reason}: {count} linears, {len(packed)} packed weights")
