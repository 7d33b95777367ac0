"""Clear errors for models the splitter cannot cut correctly."""
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from lamina.splitter import SplitError, UnsupportedAttentionError, split_model
from lamina.splitter.attention_op import hf_attention
from tests.tiny_models import tiny_model


def test_model_without_attention_interface_has_no_attention_node():
    cfg = AutoConfig.for_model("bloom", vocab_size=96, hidden_size=64, n_layer=2, n_head=4)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    # torch 2.11's export refuses bloom's shapes before the splitter looks for attention
    # nodes (torch 2.13 traces it): either way a SplitError naming the model and the cause
    with pytest.raises(SplitError, match="'bloom' has no attention node|tracing model 'bloom' "
                                         "with torch.export failed"):
        split_model(model)


def test_hand_written_attention_has_no_attention_node():
    model = tiny_model("llama")

    def manual(self, hidden_states, position_embeddings=None, **kw):  # bypasses the interface
        return self.o_proj(hidden_states), None

    for layer in model.model.layers:
        layer.self_attn.forward = manual.__get__(layer.self_attn)
    with pytest.raises(SplitError, match="no attention node"):
        split_model(model)


def test_alibi_is_rejected_by_name():
    cfg = AutoConfig.for_model("falcon", vocab_size=96, hidden_size=64, num_hidden_layers=2,
                               num_attention_heads=4, alibi=True)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(UnsupportedAttentionError, match="'falcon'.*ALiBi"):
        split_model(model)


def test_training_mode_is_rejected():
    model = tiny_model("llama").train()
    with pytest.raises(SplitError, match="training mode"):
        split_model(model)


class _Module(torch.nn.Module):
    def __init__(self, causal=True):
        super().__init__()
        self.is_causal = causal
        self.config = AutoConfig.for_model("llama")
        self.eval()


@pytest.mark.parametrize("kwargs,feature", [
    (dict(attention_mask=torch.zeros(1, 1, 3, 3)), "explicit attention mask"),
    (dict(position_bias=torch.zeros(1, 2, 3, 3)), "position bias"),
    (dict(dropout=0.1), "dropout"),
    (dict(head_mask=torch.ones(2)), "head_mask"),
    (dict(s_aux=torch.zeros(5)), "sinks of shape"),
])
def test_unsupported_features_name_model_and_feature(kwargs, feature):
    q = torch.randn(1, 2, 3, 8)
    kwargs.setdefault("attention_mask", None)
    with pytest.raises(UnsupportedAttentionError, match=f"model 'llama'.*{feature}"):
        hf_attention(_Module(), q, q, q, **kwargs)


def test_non_causal_module_is_rejected():
    q = torch.randn(1, 2, 3, 8)
    with pytest.raises(UnsupportedAttentionError, match="non-causal"):
        hf_attention(_Module(causal=False), q, q, q, None)


def test_mismatched_head_dims_rejected():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 4)
    with pytest.raises(UnsupportedAttentionError, match="head_dim"):
        hf_attention(_Module(), q, k, k, None)


def test_unsupported_feature_raised_during_split():
    model = tiny_model("llama")
    orig = model.model.layers[1].self_attn.forward

    def with_bias(*a, **kw):  # a model that adds a relative position bias in layer 1
        kw["position_bias"] = torch.zeros(1)
        return orig(*a, **kw)

    model.model.layers[1].self_attn.forward = with_bias
    with pytest.raises(UnsupportedAttentionError, match="'llama'.*position bias"):
        split_model(model)
