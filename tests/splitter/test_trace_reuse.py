"""A model like one traced before (same class, config, dtypes) takes that trace rebound to
its own weights, from this process's copies or from the on-disk store a fresh process
reads: its split gives its own HF logits, reads only its own tensors, and the first
model's split is untouched; another config, a module's forward replaced on the instance,
or reuse=False, traces afresh. The store: keyed by config, torch version and the model's
modeling file, a broken file is dropped and rewritten, LAMINA_TRACE_CACHE=0 writes
nothing, the newest STORE_FILES kept."""
import logging
import sys
from collections import OrderedDict

import pytest
import sympy
import torch

from lamina.splitter import split_model, trace_store
from lamina.splitter.trace import TensorMeta, trace, trace_stats
from tests.tiny_models import tiny_model


@pytest.fixture(autouse=True)
def own_store(tmp_path, monkeypatch):
    """An empty store and no in-process copies per test (the suite's shared store holds
    what other tests traced)."""
    monkeypatch.setenv("LAMINA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LAMINA_TRACE_CACHE", raising=False)
    fresh_process(monkeypatch)
    return tmp_path / "traces"


def fresh_process(monkeypatch):
    """This process's trace copies dropped, as in a process that never traced."""
    monkeypatch.setattr(sys.modules["lamina.splitter.trace"], "_TRACES", OrderedDict())


def logits_close(model, sm, seed: int) -> None:
    ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = model(ids).logits
    assert (sm.run_local(ids) - ref).abs().max().item() <= 1e-5


def tracing(caplog) -> list[str]:
    """The trace's "tracing model ..." lines logged so far."""
    return [r.getMessage() for r in caplog.records
            if r.name == "lamina.splitter" and r.getMessage().startswith("tracing model")]


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


@pytest.mark.parametrize("arch", ["llama", "gemma2", "gpt_oss"])
def test_a_fresh_process_takes_the_stored_trace(arch, own_store, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="lamina")
    a = tiny_model(arch, seed=0)
    sa = split_model(a)
    [stored] = own_store.glob("*.pkl")
    # the export (seconds to a minute on a real model) says so as it starts
    assert tracing(caplog) == [f"tracing model '{a.config.model_type}' with torch.export: "
                               "10-30 s; once on this machine, then from the trace store"]
    caplog.clear()
    fresh_process(monkeypatch)
    b = tiny_model(arch, seed=1)
    before = dict(trace_stats)
    sb = split_model(b)
    assert tracing(caplog) == []
    assert trace_stats["loaded"] == before["loaded"] + 1
    assert trace_stats["traced"] == before["traced"]
    logits_close(b, sb, 5)
    own_a = {t.data_ptr() for t in [*a.parameters(), *a.buffers()]}
    assert tensor_ptrs(sb) & {t.data_ptr() for t in b.parameters()} and \
        not tensor_ptrs(sb) & own_a
    assert [s.module.code for s in sa.slices] == [s.module.code for s in sb.slices]
    assert sa.context_bytes_expr == sb.context_bytes_expr  # symbolic shapes survive
    metas = [[[n.meta for n in s.module.graph.nodes] for s in sm.slices] for sm in (sa, sb)]
    assert metas[0] == metas[1]  # every node's value as traced
    assert stored.stat().st_size < 1 << 20  # the graph only, no weights


def test_the_store_keys_on_config_and_torch_version(own_store, monkeypatch):
    split_model(tiny_model("llama"))
    other = tiny_model("llama")
    other.config.rope_theta = 500.0  # another config: another file
    split_model(other)
    assert len(list(own_store.glob("*.pkl"))) == 2
    fresh_process(monkeypatch)
    monkeypatch.setattr(torch, "__version__", "0.0.0+another")
    before = dict(trace_stats)
    split_model(tiny_model("llama", seed=2))  # the file of another torch is not read
    assert trace_stats["traced"] == before["traced"] + 1
    assert len(list(own_store.glob("*.pkl"))) == 3


def test_an_edited_modeling_file_is_traced_afresh(own_store, tmp_path, monkeypatch):
    """A model class from a file (remote code, a transformers checkout) keys the store by
    that file's bytes: the same class name and config after an edit is not the old
    graph."""
    import importlib

    src = tmp_path / "my_llama.py"
    src.write_text("from transformers import LlamaForCausalLM\n\n"
                   "class MyLlama(LlamaForCausalLM):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_llama", raising=False)
    config = tiny_model("llama").config
    split_model(importlib.import_module("my_llama").MyLlama(config).eval())
    fresh_process(monkeypatch)
    before = dict(trace_stats)
    split_model(importlib.import_module("my_llama").MyLlama(config).eval())
    assert trace_stats["loaded"] == before["loaded"] + 1  # the same file: the stored graph
    src.write_text(src.read_text() + "# edited\n")
    fresh_process(monkeypatch)
    m = importlib.reload(sys.modules["my_llama"]).MyLlama(config).eval()
    logits_close(m, split_model(m), 7)
    assert trace_stats["traced"] == before["traced"] + 1
    assert len(list(own_store.glob("*.pkl"))) == 2


def test_a_model_whose_source_cannot_be_read_is_split_and_not_stored(own_store,
                                                                     monkeypatch):
    def unreadable(obj):
        raise TypeError("built in")

    monkeypatch.setattr(trace_store.inspect, "getsourcefile", unreadable)
    m = tiny_model("llama")
    logits_close(m, split_model(m), 8)
    assert not own_store.exists()


def test_a_broken_stored_file_is_dropped_and_traced_afresh(own_store, monkeypatch, caplog):
    split_model(tiny_model("llama"))
    [stored] = own_store.glob("*.pkl")
    stored.write_bytes(b"not a pickle")
    fresh_process(monkeypatch)
    before = dict(trace_stats)
    b = tiny_model("llama", seed=1)
    logits_close(b, split_model(b), 6)
    assert trace_stats["traced"] == before["traced"] + 1
    assert trace_stats["loaded"] == before["loaded"]
    assert "trace store: dropping" in caplog.text
    fresh_process(monkeypatch)  # rewritten whole: the next process loads it
    split_model(tiny_model("llama", seed=2))
    assert trace_stats["loaded"] == before["loaded"] + 1


def test_the_store_off_writes_nothing_and_keeps_the_newest(own_store, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="lamina")
    monkeypatch.setenv("LAMINA_TRACE_CACHE", "0")
    split_model(tiny_model("llama"))
    assert not own_store.exists()
    assert [m.split("; ")[1] for m in tracing(caplog)] == [
        "not stored (no reuse, or the store is off)"]
    monkeypatch.delenv("LAMINA_TRACE_CACHE")
    monkeypatch.setattr(trace_store, "STORE_FILES", 2)
    names = []
    for theta in (1e4, 2e4, 3e4):
        m = tiny_model("llama")
        m.config.rope_theta = theta
        split_model(m)
        names.append({p.name for p in own_store.glob("*.pkl")})
    assert len(names[-1]) == 2 and names[0] <= names[1] and not names[0] <= names[2]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_node_metadata_is_each_values_real_shape_and_dtype(arch):
    """What the trace keeps of each value (a TensorMeta symbolic in batch and tokens) is,
    at a run's sizes, the shape and dtype of the tensor the node computes when run."""
    model = tiny_model(arch)
    gm = trace(model).gm
    pos = next(n for n in gm.graph.nodes if n.target == "position_ids").meta["val"]
    B, T = 3, 7
    sizes = {pos.shape[0]: B, pos.shape[1]: T}
    real = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            real[n.name] = super().run_node(n)
            return real[n.name]

    ids = torch.randint(3, 90, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        Recorder(gm).run(ids, torch.arange(T).expand(B, T))
    checked = 0
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        assert not isinstance(v, torch.Tensor), n.name  # no fake tensors kept
        if isinstance(v, TensorMeta):
            shape = tuple(int(sympy.sympify(s).subs(sizes)) for s in v.shape)
            assert (shape, v.dtype) == (tuple(real[n.name].shape), real[n.name].dtype), n.name
            checked += 1
    assert checked > 40


def test_a_prepared_split_generates_each_modules_code_once(monkeypatch):
    """`prepare_split` builds each slice's module several times over (sliced, packed,
    fused, memoized). From a trace this process holds, Python code is generated once
    per graph module it returns, all of them before the first step, and the prepared
    split's logits are the model's."""
    from lamina.model.prepare import prepare_split

    model = tiny_model("llama")
    trace(model)  # the export (which generates code of its own) done before counting
    made = []
    python_code = torch.fx.Graph.python_code
    monkeypatch.setattr(torch.fx.Graph, "python_code",
                        lambda self, *a, **k: made.append(self) or python_code(self, *a, **k))
    prepared = prepare_split(model, dense_backend="onednn", fuse=False)
    modules = [m for s in prepared.split.slices for m in s.module.modules()
               if isinstance(m, torch.fx.GraphModule)]
    assert prepared.dense.backend == "onednn" and len(modules) > len(prepared.split.slices)
    assert sorted(map(id, made)) == sorted(id(m.graph) for m in modules)
    logits_close(model, prepared.split, seed=3)
