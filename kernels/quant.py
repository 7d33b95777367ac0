"""INT8 KV rows: quantized when written to a pool, dequantized inside the kernels.

Data in: new k [N, Hkv, D] / v [N, Hkv, Dv] (any float dtype) and, for keys, the layer's
channel scales c [Hkv, D]. Data out: int8 rows [N, Hkv, D + 4] to store at their slots,
and (for the reference backend and tests) the fp32 values they stand for.

Grouping (KIVI / ALISA style, adapted to a token-slot pool):
- values: per token and kv head. A row's head h holds D int8 codes and, in the head's
  last 4 bytes, its fp32 scale b = max|v| / 127; v ~= code * b.
- keys: per channel, then per token. Key outliers sit in fixed channels (KIVI), so each
  channel is first divided by a per-(layer, kv head, channel) scale c, calibrated once
  per deployment from the model (`lamina.model.prepare.key_channel_scales`); the
  smoothed row is then quantized per token and head like a value: k ~= code * a * c.
  c is the same for every slot of a layer, so a slot's row is self-contained: copies,
  forks, prefix-cache sharing and tier saves move rows and nothing else. KIVI instead
  shares a scale per channel over a group of G tokens of one sequence; in a pool whose
  slots are shared between sequences that group would have to be re-formed per
  sequence, and the per-token factor keeps every row's full range without clipping.
Attention folds c into the query (q . k = (q * c) . (code * a)), so a kernel reads one
int8 row per key plus its scale and dequantizes in registers.
"""
from __future__ import annotations

import torch

SCALE_BYTES = 4  # one fp32 scale per (token, kv head), after the head's codes
QMAX = 127.0  # symmetric codes in [-127, 127]


def is_quantized(pool: torch.Tensor) -> bool:
    return pool.dtype == torch.int8


def head_dim(pool: torch.Tensor) -> int:
    """The head dim a pool's rows stand for ([S, Hkv, D] float, [S, Hkv, D + 4] int8)."""
    return int(pool.shape[-1]) - (SCALE_BYTES if is_quantized(pool) else 0)


def quantize_rows(x: torch.Tensor, channel: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, H, D] float -> int8 rows [N, H, D + 4]: codes round(x / c / s) with
    s = max|x / c| / 127 per (token, head), then s's 4 bytes. `channel` c [H, D] > 0."""
    xf = x.float()
    if channel is not None:
        xf = xf / channel.to(xf.device)
    s = xf.abs().amax(dim=-1, keepdim=True) / QMAX  # [N, H, 1]
    codes = torch.round(xf / torch.where(s > 0, s, torch.ones_like(s)))
    out = torch.empty(*x.shape[:-1], x.shape[-1] + SCALE_BYTES, dtype=torch.int8,
                      device=x.device)
    out[..., :-SCALE_BYTES] = codes.clamp_(-QMAX, QMAX).to(torch.int8)
    out[..., -SCALE_BYTES:] = s.contiguous().view(torch.int8)
    return out


def row_scales(rows: torch.Tensor) -> torch.Tensor:
    """int8 rows [..., H, D + 4] -> their fp32 scales [..., H]."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)[..., 0]


def dequantize_rows(rows: torch.Tensor, channel: torch.Tensor | None = None) -> torch.Tensor:
    """int8 rows [N, H, D + 4] -> fp32 [N, H, D] (codes * scale, times c for keys)."""
    x = rows[..., :-SCALE_BYTES].float() * row_scales(rows)[..., None]
    return x if channel is None else x * channel.to(x.device)


def fold_channels(q: torch.Tensor, channel: torch.Tensor) -> torch.Tensor:
    """q [N, Hq, D] -> q * c for each query head's kv head (c [Hkv, D]), fp32: attention
    over keys code * a then equals attention over the dequantized keys."""
    rep = q.shape[1] // channel.shape[0]
    return q.float() * channel.to(q.device).repeat_interleave(rep, dim=0)
