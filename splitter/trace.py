"""Trace an HF causal LM into one aten-level FX graph with one attention node per layer.

Data in: a transformers `PreTrainedModel` (decoder-only, causal LM head).
Data out: `Traced` — an unlifted `GraphModule` `(input_ids, position_ids) -> logits`
whose parameters are the model's own tensors, with dynamic batch and token dims. Each
node's `meta["val"]` is what the splitter reads of its value: a `TensorMeta` (shape of
ints and sympy expressions in the batch and token symbols, dtype), a sympy expression
for a symbolic size, or a plain scalar.

Why torch.export(strict=False): plain `torch.fx.symbolic_trace` fails on transformers
5.x decoder layers and transformers' own fx tracer is gone. Non-strict export runs the
real Python forward under fake tensors, so every model that runs eagerly traces, and
the attention core (routed to `torch.ops.lamina.attention` through AttentionInterface)
stays a single opaque node with symbolic shapes.
"""
from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import sympy
import torch
from torch.export import Dim, export

from . import trace_store
from .attention_op import ATTN_IMPL, UnsupportedAttentionError, register_with_transformers
from .trace_store import CachedTrace, attr_of, copy_graph, graph_module
from .weights_only import WeightsOnlyModel

log = logging.getLogger("lamina.splitter")

ATTENTION_OP = torch.ops.lamina.attention.default

# Side-effect-only nodes export inserts; they check metadata and compute nothing.
_ASSERT_OPS = {torch.ops.aten._assert_tensor_metadata.default,
               torch.ops.aten._assert_scalar.default,
               torch.ops.aten.sym_constrain_range_for_size.default}


class SplitError(RuntimeError):
    """The model cannot be split (no attention node, tracing failed, ...)."""


@dataclass
class Traced:
    gm: torch.fx.GraphModule  # (input_ids, position_ids) -> logits
    model_name: str


@dataclass(frozen=True)
class TensorMeta:
    """A traced tensor as the splitter sees it. shape: ints, and sympy expressions in the
    batch and token symbols for the dynamic dims.

    Why not export's own fake tensors: a fresh process rebuilding them over a shape
    environment was most of its read of the trace store (docs/splitter.md), and nothing
    after the trace needs more than this."""

    shape: tuple
    dtype: torch.dtype

    def dim(self) -> int:
        return len(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize


def _light(val):
    """export's `meta["val"]` -> TensorMeta / sympy expression / scalar / tuple of them;
    None for anything else (opaque objects nothing here reads)."""
    if isinstance(val, torch.Tensor):
        return TensorMeta(tuple(_light(s) for s in val.shape), val.dtype)
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return val.node.expr
    if isinstance(val, (list, tuple)):
        return tuple(_light(v) for v in val)
    return val if isinstance(val, (int, float, bool, sympy.Basic)) else None


def _keep_light_meta(g: torch.fx.Graph) -> None:
    """Every node's metadata down to its light `val` (export's other entries, the
    fake-tensor `tensor_meta`, module stacks and source links, are read by nothing here
    and would only make the stored trace slow to load)."""
    for n in g.nodes:
        n.meta = {"val": _light(n.meta["val"])} if "val" in n.meta else {}


class _LogitsWrapper(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.m = model

    def forward(self, input_ids, position_ids):
        return self.m(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


@contextlib.contextmanager
def _lamina_attention(model: torch.nn.Module):
    """Route the model's attention through lamina.attention for the duration."""
    register_with_transformers()
    configs = [model.config] + [getattr(model.config, a) for a in ("text_config", "decoder")
                                if getattr(model.config, a, None) is not None]
    saved = [c._attn_implementation for c in configs]
    try:
        for c in configs:
            c._attn_implementation = ATTN_IMPL
        yield
    finally:
        for c, s in zip(configs, saved):
            c._attn_implementation = s


@contextlib.contextmanager
def _no_stack_traces():
    """Skip per-node stack-trace capture during export (~12% of SmolLM2's trace time)."""
    import torch.fx.config as fx_config

    if not hasattr(fx_config, "do_not_emit_stack_traces"):  # older torch: nothing to skip
        yield
        return
    saved = fx_config.do_not_emit_stack_traces
    fx_config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx_config.do_not_emit_stack_traces = saved


def _canonicalize(gm: torch.fx.GraphModule) -> None:
    """Drop asserts/guards, and read every symbolic size from `position_ids`.

    After this every shape symbol is derivable from position_ids, which every slice
    receives, so shape nodes can be recomputed in any slice for free.
    """
    g = gm.graph
    pos = next(n for n in g.nodes if n.op == "placeholder" and n.target == "position_ids")
    sym_of_dim = {}
    for d, s in enumerate(pos.meta["val"].shape):
        if isinstance(s, torch.SymInt):
            sym_of_dim[s.node.expr] = d
    for n in list(g.nodes):
        if n.op == "call_module" and n.target == "_guards_fn":
            g.erase_node(n)
        elif n.op == "call_function" and n.target in _ASSERT_OPS:
            g.erase_node(n)
        elif n.op == "call_function" and n.target == torch.ops.aten.sym_size.int:
            val = n.meta.get("val")
            d = sym_of_dim.get(val.node.expr) if isinstance(val, torch.SymInt) else None
            if d is not None and n.args[0] is not pos:
                with g.inserting_after(pos):
                    new = g.call_function(torch.ops.aten.sym_size.int, (pos, d))
                new.meta = dict(n.meta)
                n.replace_all_uses_with(new)
                g.erase_node(n)
    g.eliminate_dead_code()
    g.lint()
    gm.recompile()


def _check_config(name: str, config) -> None:
    """Reject features known from the config before tracing (clearer than a trace error)."""
    attn_cfg = getattr(config, "attn_config", None)
    alibi = (getattr(config, "alibi", False) or getattr(config, "use_alibi", False)
             or getattr(config, "position_embedding_type", None) == "alibi"
             or (isinstance(attn_cfg, dict) and attn_cfg.get("alibi"))
             or getattr(attn_cfg, "alibi", False))
    if alibi:
        raise UnsupportedAttentionError(
            f"model '{name}' uses an unsupported attention feature: ALiBi position bias")


# Traces kept in this process, by `_trace_key` (oldest dropped past TRACE_CACHE_SIZE). A
# second engine of the same model (a bench's modes, a service's deployments, the tests)
# then takes a copy of the graph rebound to its model's tensors (its whole split ~0.3 s)
# instead of tracing again (SmolLM2: ~5 s).
TRACE_CACHE_SIZE = 8
_TRACES: OrderedDict[str, CachedTrace] = OrderedDict()
trace_stats = {"traced": 0, "reused": 0, "loaded": 0}  # exported; from _TRACES; from the store


def _trace_key(model: torch.nn.Module) -> str:
    """What makes two models trace alike; "" (never reused) for a model with a module whose
    `forward` was replaced on the instance, which its class and config do not show."""
    if any("forward" in vars(m) for m in model.modules()):
        return ""
    tensors = [*model.parameters(), *model.buffers()]
    return "|".join([f"{type(model).__module__}.{type(model).__qualname__}",
                     model.config.to_json_string(use_diff=False),
                     ",".join(sorted({f"{t.dtype}@{t.device}" for t in tensors})),
                     str(len(tensors))])


def stored_trace(model: torch.nn.Module) -> tuple[str, Path] | None:
    """`model`'s trace key and the trace store's file of it, where the store holds one."""
    key = _trace_key(model)
    path = trace_store.file_for(key, type(model)) if key else None
    return (key, path) if path is not None and path.exists() else None


def forget_traces() -> None:
    """Drop this process's trace copies (the store keeps its files): the next split of
    each model reads the store, as a fresh process's does."""
    _TRACES.clear()


def _remember(key: str, cached: CachedTrace) -> None:
    _TRACES[key] = cached
    while len(_TRACES) > TRACE_CACHE_SIZE:
        _TRACES.popitem(last=False)


def _cache_trace(key: str, gm: torch.fx.GraphModule, model: torch.nn.Module) -> CachedTrace:
    own = _LogitsWrapper(model)
    consts = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            t = attr_of(gm, n.target)
            if attr_of(own, n.target) is not t:
                consts[n.target] = t
    cached = CachedTrace(copy_graph(gm.graph), consts)
    _remember(key, cached)
    return cached


def _rebound(cached: CachedTrace, model: torch.nn.Module) -> torch.fx.GraphModule | None:
    """The cached graph over `model`'s own tensors; None if a target is not found."""
    own, root = _LogitsWrapper(model), {}
    for n in cached.graph.nodes:
        if n.op == "get_attr" and n.target not in root:
            t = cached.constants.get(n.target)
            t = attr_of(own, n.target) if t is None else t
            if t is None:
                return None
            root[n.target] = t
    return graph_module(root, copy_graph(cached.graph))


def _reused(key: str, model: torch.nn.Module) -> torch.fx.GraphModule | None:
    """The graph traced for `key` before, in this process or in the store, over `model`'s
    tensors; None when there is none (or it names a tensor `model` lacks)."""
    source = "reused"
    if key not in _TRACES:
        stored = trace_store.load(key, type(model))
        if stored is None:
            return None
        _remember(key, stored)
        source = "loaded"
    gm = _rebound(_TRACES[key], model)
    if gm is not None:
        _TRACES.move_to_end(key)
        trace_stats[source] += 1
    return gm


def trace(model: torch.nn.Module, reuse: bool = True) -> Traced:
    """Export `model` as `(input_ids[B,T], position_ids[B,T]) -> logits[B,T,V]`; with
    `reuse`, a model like one traced before, in this process or on this machine
    (`trace_store`), takes that graph, rebound to its own tensors. A `WeightsOnlyModel`
    brings its graph with it."""
    name = getattr(model.config, "model_type", None) or type(model).__name__
    if isinstance(model, WeightsOnlyModel):  # its graph came with it, from the store
        gm = _rebound(model.cached_trace, model)
        if gm is None:
            raise SplitError(f"model '{name}': its stored trace names a tensor the "
                             "weights-only model lacks")
        trace_stats["loaded"] += 1
        return Traced(gm=gm, model_name=name)
    _check_config(name, model.config)
    if model.training:
        raise SplitError(f"model '{name}' is in training mode; call model.eval() first")
    key = _trace_key(model) if reuse else ""
    gm = _reused(key, model) if key else None
    if gm is None:
        log.info("tracing model '%s' with torch.export: 10-30 s; %s", name,
                 "once on this machine, then from the trace store" if key
                 and trace_store.store_dir() else "not stored (no reuse, or the store is off)")
        gm = _export(model, name)
        trace_stats["traced"] += 1
        if key:
            trace_store.save(key, type(model), _cache_trace(key, gm, model))
    return Traced(gm=gm, model_name=name)


def _export(model: torch.nn.Module, name: str) -> torch.fx.GraphModule:
    """torch.export's graph of `model`, canonical (`_canonicalize`), checked to hold an
    attention node."""
    vocab = int(getattr(model.config, "vocab_size", 2) or 2)
    ids = torch.randint(0, min(vocab, 100), (2, 7))
    pos = torch.arange(7).expand(2, 7).contiguous()
    batch, tokens = Dim("batch", min=1, max=1 << 20), Dim("tokens", min=1, max=1 << 20)
    dyn = ({0: batch, 1: tokens}, {0: batch, 1: tokens})
    with _lamina_attention(model), _no_stack_traces(), torch.no_grad():
        try:
            ep = export(_LogitsWrapper(model), (ids, pos), dynamic_shapes=dyn, strict=False)
        except UnsupportedAttentionError:
            raise
        except Exception as e:  # re-raised with the model named
            raise SplitError(f"tracing model '{name}' with torch.export failed: "
                             f"{type(e).__name__}: {e}") from e
    gm = ep.module()
    _canonicalize(gm)
    _keep_light_meta(gm.graph)
    n_attn = sum(1 for n in gm.graph.nodes if n.target is ATTENTION_OP)
    if n_attn == 0:
        raise SplitError(
            f"model '{name}' has no attention node to cut: its attention does not go "
            "through transformers' AttentionInterface (attn_implementation), so Lamina "
            "cannot offload it")
    return gm
