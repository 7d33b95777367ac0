"""The compute side's model: split, linears packed, pointwise chains fused, position
tables memoized. One recipe for the local executor (`lamina.entrypoints.llm`) and the Ray compute
worker (`lamina.cluster.compute_worker`).

Data in: a loaded HF model (`lamina.model.loader.load`). Data out: a `SplitModel` ready for
`ComputeSide`, the `DenseChoice` made for its linears, and what was fused (with why not,
where nothing was).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from lamina.compute.device import check_device, move_split
from lamina.kernels.linear import linear_ops
from lamina.kernels.pointwise import pointwise_ops
from lamina.memory.sparsity_config import MEASURED
from lamina.splitter import split_model
from lamina.splitter.dense import DenseChoice, pack_dense, select_dense_backend
from lamina.splitter.fuse import fuse_pointwise
from lamina.splitter.memo import memo_positions
from lamina.splitter.split import SplitModel
from lamina.splitter.trace_store import compile_now
from lamina.splitter.weights_only import WeightsOnlyModel

log = logging.getLogger("lamina.model.prepare")


@dataclass(frozen=True)
class Prepared:
    split: SplitModel
    dense: DenseChoice
    fused: dict  # {"rms_norm": n, "rope": n, "silu_mul": n}; empty if not fused
    fuse_reason: str


def prepare_split(model: torch.nn.Module, dense_backend: str = "auto", batch_hint: int = 32,
                  fuse: bool = True, device: str = "cpu") -> Prepared:
    """Split on the CPU (where the model was loaded), then, for a GPU `device`, move
    the model and the slices there: eager linears (cuBLAS), no CPU-fused chains."""
    dev = check_device(device)
    if dev.type == "cpu":
        ops, why = linear_ops() if dense_backend in ("auto", "avx512bf16") else (None, "")
        split, dense = pack_dense(split_model(model), dense_backend, batch_hint,
                                  linear_ops=ops, linear_why=why)
    else:  # "auto" -> eager there; "onednn" / "avx512bf16" are refused naming the device
        dtype = next(model.parameters()).dtype
        split, dense = split_model(model), select_dense_backend(dense_backend, dtype, dev)
    fused, why = {}, "fuse_pointwise=False"
    if fuse:
        ops, why = (None, f"the slices run on {dev}") if dev.type != "cpu" \
            else pointwise_ops()
        if ops is not None:
            split, fused = fuse_pointwise(split, ops)
    log.info("pointwise chains fused: %s (%s)", fused or "none", why)
    split = memo_positions(split)[0]  # position tables once a step
    if dev.type != "cpu":
        model.to(dev)  # its buffers; the parameters are the slices' own, moved below
        move_split(split, dev)
    for s in split.slices:  # the modules above were built lazily: their code, once
        compile_now(s.module)
    return Prepared(split, dense, fused, why)


def rotary_frequencies(model) -> tuple[float, ...] | None:
    """The model's rotary inverse frequencies (HF's `rotary_emb.inv_freq`, scaling
    applied), or None when its positions are not rotary or depend on the length
    (dynamic scaling: a key's rotation then changes with the context). A weights-only
    model gives what was read off the full model."""
    if isinstance(model, WeightsOnlyModel):
        return model.facts.get("rotary")
    for mod in model.modules():
        inv = getattr(mod, "inv_freq", None)
        if inv is not None and "Rotary" in type(mod).__name__:
            if "dynamic" in str(getattr(mod, "rope_type", "")):
                return None
            return tuple(float(x) for x in inv.flatten())
    return None


# What int8 pools' key channel scales are measured on: mixed prose, code, numbers and a
# chat turn, so channels that only some kinds of text excite are seen.
CALIBRATION_TEXT = (
    "The history of printing begins long before movable type: carved wooden blocks "
    "printed cloth and paper in China by the third century. In 1450 Gutenberg's press "
    "changed how knowledge spread across Europe, and by 1500 some twenty million books "
    "had been printed.\n"
    "def mean(xs):\n    return sum(xs) / len(xs) if xs else 0.0\n\n"
    "Q3 revenue rose 12.5% to $4,210 million; margins: 31.2% (2023), 28.9% (2022).\n"
    "User: What is the boiling point of water at sea level?\n"
    "Assistant: Water boils at 100 degrees Celsius (212 F) at sea level.\n"
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. "
    "Les chats dorment beaucoup; die Katze schläft auf dem Sofa. "
) * 3


@torch.no_grad()
def calibration_ids(model, tokenizer=None, max_tokens: int = 512) -> torch.Tensor:
    """The calibration text's first `max_tokens` ids [1, T] on the model's device; without
    a tokenizer (tiny test models), fixed pseudo-random ids."""
    if tokenizer is not None:
        ids = tokenizer(CALIBRATION_TEXT)["input_ids"][:max_tokens]
    else:
        ids = torch.randint(0, int(model.config.vocab_size), (max_tokens,),
                            generator=torch.Generator().manual_seed(0)).tolist()
    return torch.tensor([ids], device=next(model.parameters()).device)


@torch.no_grad()  # a forward over the calibration text: no autograd graph to keep
def key_channel_scales(model, tokenizer=None, num_layers: int | None = None,
                       max_tokens: int = 512) -> torch.Tensor | None:
    """Per-(layer, kv head, channel) scales for int8 keys [L, Hkv, D]: each channel's
    largest |key| over a calibration text (positions >= 1: the first token's keys are
    outliers of their own), rotary channel pairs (i, i + D/2) given their common max
    (the rotation moves a key's mass between them as positions grow), normalized to
    mean 1. Keys then quantize per token after dividing by these (`kernels/quant.py`).
    None (with a log line) when the model's cache does not show one key tensor per
    attention layer; the pool then quantizes keys per token and head only."""
    ids = calibration_ids(model, tokenizer, max_tokens)
    try:
        out = model(ids, use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        keys = [layer.keys for layer in cache.layers]  # each [1, Hkv, T, D]
    except (AttributeError, TypeError, RuntimeError) as e:
        log.warning("int8 key channel scales: no per-layer keys from the model (%s); keys "
                    "quantize per token and head only", e)
        return None
    if num_layers is not None and len(keys) != num_layers:
        log.warning("int8 key channel scales: the model's cache has %d layers, the split "
                    "%d; keys quantize per token and head only", len(keys), num_layers)
        return None
    c = torch.stack([k[0, :, 1:].float().abs().amax(dim=1) for k in keys]).cpu()  # [L,Hkv,D]
    inv = rotary_frequencies(model)
    D = c.shape[-1]
    if inv is not None and 2 * len(inv) == D:  # rotate-half pairs
        pair = torch.maximum(c[..., :D // 2], c[..., D // 2:])
        c = torch.cat([pair, pair], dim=-1)
    c = torch.where(c > 0, c, c.amax().clamp(min=1e-6))
    return c / c.mean()


def attention_entropy(model, tokenizer=None, num_layers: int | None = None,
                      max_tokens: int = 512) -> tuple[float, ...] | None:
    """Each layer's mean attention entropy on the calibration text, normalized per query
    by the entropy of uniform attention over its keys (log of their count), averaged over
    heads and queries with at least 16 keys: the `entropy` layer budgets of
    `lamina.memory.sparsity` (a layer that spreads its attention gets more keys).
    None (with a log line) when the model does not give per-layer attentions."""
    ids = calibration_ids(model, tokenizer, max_tokens)
    before = getattr(model.config, "_attn_implementation", None)
    try:
        model.set_attn_implementation("eager")  # the fused kernels return no attentions
        with torch.no_grad():
            att = model(ids, output_attentions=True).attentions  # L x [1, Hq, T, T]
    except (AttributeError, TypeError, ValueError, RuntimeError) as e:
        log.warning("entropy layer budgets: no per-layer attentions from the model (%s)", e)
        return None
    finally:
        if before is not None:
            model.set_attn_implementation(before)
    if not att or (num_layers is not None and len(att) != num_layers):
        log.warning("entropy layer budgets: %d attention layers, the split has %s",
                    len(att or ()), num_layers)
        return None
    T = ids.shape[1]
    seen = torch.arange(1, T + 1, dtype=torch.float32)  # keys visible to each query
    rows = seen >= 16
    out = []
    for a in att:
        p = a[0].float().clamp_min(1e-12)  # [Hq, T, T], causal rows sum to 1
        h = -(p * p.log()).sum(-1)  # [Hq, T]
        out.append(float((h[:, rows] / seen[rows].log()).mean()))
    return tuple(out)


def sparsity_for(config, model, tokenizer, num_layers: int):
    """A deployment's `SparsityConfig` with the layer entropies its `entropy` or
    `concentration` layer budgets need measured (once, at start-up); `config` as it is
    for the other layer budgets."""
    if not config.enabled or config.layer_budgets not in MEASURED or config.layer_weights:
        return config
    weights = attention_entropy(model, tokenizer, num_layers)
    if weights is None:
        raise ValueError(f"kv_layer_budgets={config.layer_budgets!r}: the model gives no "
                         f"per-layer attentions to measure; use 'uniform' or 'pyramid'")
    config = replace(config, layer_weights=weights)
    log.info("%s layer budgets: weights %s", config.layer_budgets,
             [round(float(w), 3) for w in config.weights(num_layers)])
    return config
