"""The attention operator the splitter cuts at, and how HF models are routed to it.

Data in: HF attention modules call `hf_attention` through transformers'
`AttentionInterface` (registered under `ATTN_IMPL`) with q/k/v in HF layout.
Data out: one `torch.ops.lamina.attention` node per layer in the exported graph,
whose arguments carry everything the memory side needs (scale, window, softcap,
sinks; head counts and dims come from the tensor shapes). Unsupported features
raise `UnsupportedAttentionError` at trace time, never compute silently wrong.

`reference_attention` is the eager, in-process causal attention used by the op
itself and by `SplitModel.run_local`.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

ATTN_IMPL = "lamina"

# kwargs HF passes that carry no attention semantics for a causal decoder.
_BENIGN_KWARGS = {"position_ids", "cache_position", "use_cache", "output_attentions",
                  "return_dict", "past_key_values", "layer_idx", "output_router_logits"}


class UnsupportedAttentionError(ValueError):
    """The model uses an attention feature Lamina's memory side cannot compute."""


def _model_name(module: torch.nn.Module) -> str:
    cfg = getattr(module, "config", None)
    return getattr(cfg, "model_type", None) or type(module).__name__


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        sliding_window: int = -1, softcap: float = 0.0,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention; the Tq queries are the last Tq positions of the Tk keys.

    q: [B, Hq, Tq, D], k: [B, Hkv, Tk, D], v: [B, Hkv, Tk, Dv] -> [B, Tq, Hq, Dv]
    sliding_window > 0 keeps keys with q_pos - window < k_pos <= q_pos.
    softcap > 0 maps scores s -> softcap * tanh(s / softcap).
    sinks: [Hq] per-head logits that join the softmax denominator only.
    """
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    q_pos = torch.arange(Tk - Tq, Tk, device=q.device)[:, None]  # [Tq, 1]
    k_pos = torch.arange(Tk, device=q.device)[None, :]  # [1, Tk]
    keep = k_pos <= q_pos
    if sliding_window > 0:
        keep = keep & (k_pos > q_pos - sliding_window)
    if softcap <= 0.0 and sinks is None:
        # Same kernel HF's sdpa path uses, so fp32 results agree to rounding.
        if Tq == Tk and sliding_window <= 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                 enable_gqa=Hq != Hkv)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale,
                                                 enable_gqa=Hq != Hkv)
        return out.transpose(1, 2).contiguous()
    rep = Hq // Hkv
    kk = k.repeat_interleave(rep, dim=1).float()  # [B, Hq, Tk, D]
    vv = v.repeat_interleave(rep, dim=1).float()
    s = torch.matmul(q.float(), kk.transpose(-1, -2)) * scale  # [B, Hq, Tq, Tk]
    if softcap > 0.0:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, Hq, 1, 1).expand(B, Hq, Tq, 1)
        s = torch.cat([s, sink], dim=-1)
    p = torch.softmax(s, dim=-1)
    if sinks is not None:
        p = p[..., :-1]
    out = torch.matmul(p, vv).to(q.dtype)  # [B, Hq, Tq, Dv]
    return out.transpose(1, 2).contiguous()


@torch.library.custom_op("lamina::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
              sliding_window: int, softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
    """Causal self-attention over a whole sequence; see `reference_attention`."""
    return reference_attention(q, k, v, scale, sliding_window, softcap, sinks)


@attention.register_fake
def _attention_fake(q, k, v, scale, sliding_window, softcap, sinks):
    B, Hq, T, _ = q.shape
    return q.new_empty(B, T, Hq, v.shape[-1])


def hf_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                 sliding_window=None, softcap=None, s_aux=None, is_causal=None,
                 position_bias=None, **kwargs):
    """AttentionInterface entry: validate the call, then emit one lamina.attention node.

    query: [B, Hq, T, D], key: [B, Hkv, T, D], value: [B, Hkv, T, Dv]
    returns ([B, T, Hq, Dv], None) as HF's attention functions do.
    """
    name = _model_name(module)

    def unsupported(feature: str):
        raise UnsupportedAttentionError(
            f"model '{name}' uses an unsupported attention feature: {feature}")

    if module.training or (dropout or 0.0) > 0.0:
        unsupported("attention dropout (put the model in eval mode)")
    if attention_mask is not None:
        unsupported("an explicit attention mask (only causal/sliding masks are supported)")
    if is_causal is False or getattr(module, "is_causal", True) is False:
        unsupported("non-causal attention")
    if position_bias is not None:
        unsupported("additive position bias (ALiBi / relative bias)")
    if kwargs.get("output_attentions"):
        unsupported("output_attentions")
    extra = sorted(k for k, v in kwargs.items() if k not in _BENIGN_KWARGS and v is not None)
    if extra:
        unsupported(f"attention arguments {extra}")
    if query.shape[-1] != key.shape[-1]:
        unsupported(f"query head_dim {query.shape[-1]} != key head_dim {key.shape[-1]}")
    hq, hkv = query.shape[1], key.shape[1]
    if hq % hkv != 0:
        unsupported(f"{hq} query heads not a multiple of {hkv} kv heads")
    if s_aux is not None and tuple(s_aux.shape) != (hq,):
        unsupported(f"attention sinks of shape {tuple(s_aux.shape)} (expected [{hq}])")
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    window = int(sliding_window) if sliding_window else -1
    cap = float(softcap) if softcap else 0.0
    out = torch.ops.lamina.attention(query, key, value, scale, window, cap, s_aux)
    return out, None


def register_with_transformers() -> None:
    """Make `attn_implementation="lamina"` resolve to `hf_attention` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPL, hf_attention)
