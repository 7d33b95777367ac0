"""Fuse the slices' pointwise op chains (RMSNorm, rotary embedding, SiLU x up) into one
call each.

Data in: a `SplitModel` whose slices are aten-level FX graphs (packed or not), and the
fused ops to call (`PointwiseOps`-like: `rms_norm(x, w, eps)`, `rope(x, cos, sin)`,
`silu_mul(gate, up)`; `lamina.kernels.pointwise` has compiled ones). Data out: a new
`SplitModel` whose slices call them where a chain matched (`fuse_pointwise`).

Why: a decode step's slices run ~50 small eager ops a layer (SmolLM2, bf16, B=32: 0.5 ms
of each 1.15 ms slice besides the GEMMs, on 2 threads), each one dispatch, one
allocation and one pass over a few KiB. The chains matched are those of the LLaMA family
as HF writes them:
- RMSNorm: `w * to(xf * rsqrt(mean(xf ** 2, -1, keepdim) + eps), x.dtype)`, `xf = to(x, f32)`
- rotary: `x * cos + cat([-x[..., h:], x[..., :h]], -1) * sin` (either operand order)
- gated MLP: `silu(gate) * up` (either order)
Deciding what to fuse only reads the graph; nothing else in it changes, and the chain's
nodes other users still get them (dead ones are dropped).
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.fx

from .trace import TensorMeta
from .trace_store import graph_module

A = torch.ops.aten
_TO = (A.to.dtype, A._to_copy.default)
_DTYPES = (torch.float32, torch.bfloat16)
_BIG = 2 ** 62  # a slice end this large means "to the end"


def _call(n, *targets) -> bool:
    return isinstance(n, torch.fx.Node) and n.op == "call_function" and n.target in targets


def _val(n):
    v = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
    return v if isinstance(v, TensorMeta) else None


def _dtype_of(n):
    v = _val(n)
    return None if v is None else v.dtype


def _to_dtype(n):
    """The dtype a to/_to_copy node converts to (None if n is not one)."""
    if not _call(n, *_TO):
        return None
    return n.args[1] if n.target is A.to.dtype and len(n.args) > 1 else n.kwargs.get("dtype")


def _operands(n, pred):
    """(a, b) of a binary node with pred(a), trying both orders; None if neither."""
    a, b = n.args[0], n.args[1]
    if pred(a):
        return a, b
    if pred(b):
        return b, a
    return None


def _last_dim(d, ndim) -> bool:
    return d == -1 or (ndim is not None and d == ndim - 1)


def match_rms_norm(n):
    """n = w * to(xf * rsqrt(mean(xf^2) + eps)) -> (x, w, eps) or None."""
    if not _call(n, A.mul.Tensor) or len(n.args) != 2:
        return None
    out_dt = _dtype_of(n)
    got = _operands(n, lambda a: isinstance(a, torch.fx.Node) and a.op == "get_attr")
    if got is None or out_dt not in _DTYPES:
        return None
    w, yc = got
    y = yc.args[0] if _to_dtype(yc) is not None else yc
    if _to_dtype(yc) not in (None, out_dt) or not _call(y, A.mul.Tensor):
        return None
    ops = _operands(y, lambda a: _call(a, A.rsqrt.default))
    if ops is None:
        return None
    r, xf = ops
    add = r.args[0]
    if not _call(add, A.add.Tensor, A.add.Scalar) or not isinstance(add.args[1], float):
        return None
    mean, eps = add.args[0], add.args[1]
    if not _call(mean, A.mean.dim) or len(mean.args) < 3 or mean.args[2] is not True:
        return None
    pw = mean.args[0]
    if not _call(pw, A.pow.Tensor_Scalar) or pw.args[0] is not xf or pw.args[1] != 2:
        return None
    v = _val(xf)
    if list(mean.args[1]) != [-1] and not (v is not None and list(mean.args[1]) == [v.dim() - 1]):
        return None
    x = xf.args[0] if _to_dtype(xf) is torch.float32 else xf
    if _dtype_of(x) != out_dt or _dtype_of(w) not in (None, out_dt):
        return None
    return x, w, eps


def match_rope(n):
    """n = x * cos + cat([-x2, x1], -1) * sin -> (x, cos, sin) or None."""
    if not _call(n, A.add.Tensor) or len(n.args) != 2 or _dtype_of(n) not in _DTYPES:
        return None
    a, b = n.args
    if not (_call(a, A.mul.Tensor) and _call(b, A.mul.Tensor)):
        return None
    for m1, m2 in ((a, b), (b, a)):
        rot = _operands(m2, lambda t: _call(t, A.cat.default))
        if rot is None:
            continue
        cat, sin = rot
        parts = cat.args[0]
        v = _val(n)
        ndim = None if v is None else v.dim()
        if len(parts) != 2 or not _last_dim(cat.args[1] if len(cat.args) > 1 else 0, ndim):
            continue
        neg, x1 = parts
        if not (_call(neg, A.neg.default) and _call(neg.args[0], A.slice.Tensor)
                and _call(x1, A.slice.Tensor)):
            continue
        x2 = neg.args[0]
        x = x1.args[0]
        if x2.args[0] is not x or not _call(m1, A.mul.Tensor):
            continue
        got = _operands(m1, lambda t: t is x)
        if got is None:
            continue
        cos = got[1]
        (d1, s1, e1), (d2, s2, e2) = x1.args[1:4], x2.args[1:4]
        xv = _val(x)
        if xv is None or not isinstance(xv.shape[-1], int):
            continue
        h = xv.shape[-1] // 2
        if (xv.shape[-1] % 2 or not (_last_dim(d1, xv.dim()) and _last_dim(d2, xv.dim()))
                or (s1, e1, s2) != (0, h, h) or e2 not in (xv.shape[-1],) and e2 < _BIG
                or xv.dtype != _dtype_of(n) or v is None or v.dim() != xv.dim()
                or any(_dtype_of(t) not in (None, xv.dtype) for t in (cos, sin))):
            continue
        if list(v.shape) != list(xv.shape):  # x must not itself be broadcast
            continue
        return x, cos, sin
    return None


def match_silu_mul(n):
    """n = silu(gate) * up -> (gate, up) or None."""
    if not _call(n, A.mul.Tensor) or len(n.args) != 2 or _dtype_of(n) not in _DTYPES:
        return None
    got = _operands(n, lambda t: _call(t, A.silu.default))
    if got is None:
        return None
    act, up = got
    gate = act.args[0]
    gv, uv, ov = _val(act), _val(up), _val(n)
    if gv is None or ov is None or list(gv.shape) != list(ov.shape):
        return None
    if uv is not None and (list(uv.shape) != list(ov.shape) or uv.dtype != ov.dtype):
        return None
    if gv.dtype != ov.dtype or not isinstance(up, torch.fx.Node):
        return None
    return gate, up


def fuse_graph(gm: torch.fx.GraphModule, ops) -> dict:
    """Rewrite gm's matching chains in place; -> {"rms_norm": n, "rope": n, "silu_mul": n}."""
    counts = {"rms_norm": 0, "rope": 0, "silu_mul": 0}
    for node in list(gm.graph.nodes):
        for name, match in (("rms_norm", match_rms_norm), ("rope", match_rope),
                            ("silu_mul", match_silu_mul)):
            args = match(node)
            if args is None:
                continue
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(getattr(ops, name), tuple(args))
            new.meta.update(node.meta)
            node.replace_all_uses_with(new)
            counts[name] += 1
            break
    if any(counts.values()):
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return counts


def fuse_pointwise(split, ops):
    """-> (split whose slices call `ops` for the chains they match, {op: count})."""
    total = {"rms_norm": 0, "rope": 0, "silu_mul": 0}
    slices = []
    for s in split.slices:
        g = torch.fx.Graph()
        g.output(g.graph_copy(s.module.graph, {}))
        gm = graph_module(s.module, g, class_name=type(s.module).__name__)
        counts = fuse_graph(gm, ops)
        for k, v in counts.items():
            total[k] += v
        slices.append(replace(s, module=gm) if any(counts.values()) else s)
    return (replace(split, slices=slices) if any(total.values()) else split), total
