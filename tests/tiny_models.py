"""Tiny random-weight configs of many HF decoder architectures (no weights downloaded)."""
from __future__ import annotations

import torch

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)

# model_type -> config overrides. Each exercises a different attention/layout feature.
TINY = {
    "llama": {},
    "mistral": dict(sliding_window=5),  # sliding window on every layer
    "qwen2": dict(use_sliding_window=False),  # qkv bias
    "qwen3": dict(head_dim=16),  # q/k RMSNorm
    # softcap, alternating windows
    "gemma2": dict(head_dim=16, sliding_window=4, attn_logit_softcapping=30.0,
                   final_logit_softcapping=20.0, query_pre_attn_scalar=16),
    "phi3": dict(num_key_value_heads=4),  # fused qkv / gate_up
    "gpt2": dict(n_embd=64, n_layer=3, n_head=4, n_positions=256, vocab_size=96,
                 bos_token_id=1, eos_token_id=2),  # Conv1D, learned positions
    # learned positions (offset 2)
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64, pad_token_id=1),
    "phi": dict(num_key_value_heads=4, partial_rotary_factor=0.5),  # parallel attention + MLP
    "cohere": dict(logit_scale=0.5),  # parallel attention + MLP, LayerNorm
    "gpt_neox": dict(use_parallel_residual=True, rotary_pct=0.25),  # parallel residual
    "gpt_oss": dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention",
                                 "sliding_attention"]),  # sinks
    "starcoder2": dict(sliding_window=6, use_bias=True),
    "olmo2": {},
}


def tiny_model(model_type: str, seed: int = 0, attn: str = "eager"):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(TINY[model_type]) if model_type == "gpt2" else {**COMMON, **TINY[model_type]}
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
    return model.eval()
