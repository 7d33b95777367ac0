"""A model like one traced before in this process (same class, config, dtypes) takes that
trace rebound to its own weights: its split gives its own HF logits, reads only its own
tensors, and the first model's split is untouched; another config, a module's forward
replaced on the instance, or reuse=False, traces afresh."""
import pytest
import torch

from lamina.splitter import split_model
from lamina.splitter.trace import trace, trace_stats
from tests.tiny_models import tiny_model


def logits_close(model, sm, seed: int) -> None:
    ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = model(ids).logits
    assert (sm.run_local(ids) - ref).abs().max().item() <= 1e-5


def tensor_ptrs(sm) -> set[int]:
    return {t.data_ptr() for s in sm.slices
            for t in [*s.module.parameters(), *s.module.buffers()]}


# llama: plain; gemma2: soft cap, sliding windows, tied embeddings; gpt_oss: sinks
@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt_oss"])
def test_a_second_model_of_the_same_config_reuses_the_trace(arch):
    a, b = tiny_model(arch, seed=0), tiny_model(arch, seed=1)
    sa = split_model(a)
    before = dict(trace_stats)
    sb = split_model(b)
    assert trace_stats["reused"] == before["reused"] + 1
    assert trace_stats["traced"] == before["traced"]
    logits_close(b, sb, 1)
    logits_close(a, sa, 2)  # the first split still reads the first model's weights
    own_b = {t.data_ptr() for t in [*b.parameters(), *b.buffers()]}
    own_a = {t.data_ptr() for t in [*a.parameters(), *a.buffers()]}
    assert tensor_ptrs(sb) & own_b and not tensor_ptrs(sb) & own_a
    assert [n.name for n in sa.slices[1].module.graph.nodes] == \
        [n.name for n in sb.slices[1].module.graph.nodes]


def test_another_config_or_no_reuse_traces_afresh():
    a = tiny_model("llama")
    split_model(a)
    deeper = tiny_model("llama")
    deeper.config.rms_norm_eps = 1e-3  # a config value the graph bakes in
    with torch.no_grad():
        for m in deeper.modules():
            if hasattr(m, "variance_epsilon"):
                m.variance_epsilon = 1e-3
    before = dict(trace_stats)
    sm = split_model(deeper)
    assert trace_stats["traced"] == before["traced"] + 1
    logits_close(deeper, sm, 3)
    trace(a, reuse=False)
    assert trace_stats["traced"] == before["traced"] + 2


def test_a_model_with_a_forward_replaced_on_the_instance_traces_afresh():
    split_model(tiny_model("llama"))  # its trace is cached
    b = tiny_model("llama", seed=1)
    mlp = b.model.layers[0].mlp
    orig = mlp.forward
    mlp.forward = lambda x: 2 * orig(x)  # same class and config, another graph
    before = dict(trace_stats)
    sb = split_model(b)
    assert trace_stats["traced"] == before["traced"] + 1
    logits_close(b, sb, 4)  # the cached graph (no doubling) would miss HF's logits
