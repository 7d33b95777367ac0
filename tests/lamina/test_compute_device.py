"""The compute side on a device: config checks, moving a split, the CUDA-graph bucket
bookkeeping (emulated on the CPU: the same static buffers, padding and row cuts with
eager slices) and, where there is a GPU, greedy output with the slices on it against
HF's on the same GPU, memory workers on the host and on the GPU, graphs on and off."""
import pytest
import torch

from lamina.compute.graphs import bucket_for, buckets
from lamina.engine.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.executor.local import LocalExecutor
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.sampling.params import SamplingParams
from tests.tiny_models import tiny_model

CUDA = torch.cuda.is_available()
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch sees none)")


def test_compute_device_is_validated():
    for bad in ("tpu", "cuda:x", "", 0):
        with pytest.raises(ValueError, match="compute_device must be 'cpu' or 'cuda"):
            EngineConfig(compute_device=bad)
    with pytest.raises(ValueError, match="cuda_graphs must be a bool"):
        EngineConfig(cuda_graphs=1)
    assert EngineConfig(compute_device="cuda:0").compute_device == "cuda:0"


@pytest.mark.skipif(CUDA, reason="checks the message given where torch sees no GPU")
def test_gpu_compute_without_gpu_is_a_clear_error():
    from lamina.model.prepare import prepare_split

    with pytest.raises(ValueError, match="compute_device='cuda', but torch sees no CUDA GPU"):
        prepare_split(tiny_model("llama"), device="cuda")


def test_buckets_and_the_bucket_of_a_step():
    assert buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    assert buckets(1) == (1,)
    assert buckets(20) == (1, 2, 4, 8, 16, 20)
    assert buckets(256)[-3:] == (224, 240, 256) and len(buckets(256)) == 20
    sizes = buckets(20)
    assert [bucket_for(n, sizes) for n in (1, 3, 5, 9, 16, 17, 20, 21)] == \
        [1, 4, 8, 16, 16, 20, 20, None]
    with pytest.raises(ValueError):
        buckets(0)


def hf_greedy(model, prompts, n):
    """n greedy tokens each from HF's full forward (no cache), on the model's device."""
    dev = next(model.parameters()).device
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(n):
                x = torch.tensor([ids], device=dev)
                ids.append(int(model(x).logits[0, -1].argmax()))
            outs.append(ids[len(p):])
    return outs


def _engine(model_type, compute, kv, graph_tokens, workers=2, slots=256):
    from lamina.model.prepare import prepare_split

    model = tiny_model(model_type)
    prep = prepare_split(model, "eager", fuse=False, device=compute)
    mems = [MemorySide(KVPool(KVPoolConfig.for_specs(prep.split.attention_specs, slots,
                                                     device=kv))) for _ in range(workers)]
    ex = LocalExecutor(prep.split, mems, device=compute, graph_tokens=graph_tokens)
    cfg = EngineConfig(num_kv_slots=slots, num_memory_workers=workers, max_batch=8,
                       compute_device=compute, kv_device=kv)
    return model, ex, LLMEngine(cfg, ex, None, model.config)


def _run(eng, prompts, lengths):
    """Greedy tokens per prompt; requests finish at different steps (`lengths`), so
    the decode batch shrinks through several bucket sizes."""
    ids = [eng.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
           for p, n in zip(prompts, lengths)]
    out = {}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] = o
    return [out[i].token_ids for i in ids]


PROMPTS = [[5, 9, 14], list(range(3, 40)), [7] * 11, list(range(60, 95)), [4, 4, 8, 15, 16],
           list(range(10, 30)), [33, 21], list(range(40, 90))]
LENGTHS = [12, 5, 9, 16, 3, 7, 14, 10]


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_graph_buckets_emulated_equal_hf(model_type):
    """Decode steps through the bucket buffers (eager slices on the CPU): padded rows do
    not leak into real ones, q/k/v and logits are cut to the step's rows; the batch
    shrinks from 8 to 1 over buckets 8, 4, 2, 1."""
    model, ex, eng = _engine(model_type, "cpu", "cpu", graph_tokens=8)
    want = [w[:n] for w, n in zip(hf_greedy(model, PROMPTS, 16), LENGTHS)]
    assert _run(eng, PROMPTS, LENGTHS) == want
    assert sorted(ex.compute.graphs._buckets) == [1, 2, 4, 8]


def test_move_split_moves_every_tensor_and_constant():
    """On the meta device (no GPU needed): every parameter and buffer of every slice
    moves, and no node still creates a CPU tensor."""
    from lamina.compute.device import move_split
    from lamina.splitter import split_model

    model = tiny_model("llama")
    split = split_model(model)
    move_split(split, torch.device("meta"))
    tensors = [t for s in split.slices for t in [*s.module.parameters(), *s.module.buffers()]]
    assert tensors and all(t.device.type == "meta" for t in tensors)
    seen = node_devices(split)
    assert seen and all(d.type == "meta" for d in seen)


def node_devices(split) -> list[torch.device]:
    """The devices the split's graph nodes name, as a keyword or an argument."""
    nodes = [n for s in split.slices for m in s.module.modules()
             if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes]
    return [d for n in nodes for d in [n.kwargs.get("device"), *n.args]
            if isinstance(d, torch.device)]


@needs_gpu
@pytest.mark.parametrize("kv", ["cpu", "cuda"])
@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gpt_oss"])
def test_gpu_compute_greedy_equals_hf_on_the_gpu(model_type, kv):
    """Slices on the GPU, memory workers on the host (pinned staging) or the same GPU
    (direct), with and without CUDA graphs: HF's greedy tokens on the same GPU, fp32."""
    for graphs in (0, 8):
        model, ex, eng = _engine(model_type, "cuda", kv, graphs)
        want = [w[:n] for w, n in zip(hf_greedy(model, PROMPTS, 16), LENGTHS)]
        assert _run(eng, PROMPTS, LENGTHS) == want, (kv, graphs)
        g = ex.compute.graphs
        if graphs and model_type == "gpt_oss":  # its MoE fallback reads counts on the host
            assert "synchronizes with the host" in g.disabled
        elif graphs:
            assert g.captures >= 3 and g.disabled is None


@needs_gpu
@pytest.mark.parametrize("kv", ["cpu", "cuda"])
def test_smollm2_on_the_gpu_equals_hf_generate(prompts, kv):
    """Acceptance 1: the 16-prompt mixed-length test with compute_device='cuda' and two
    memory workers on the host / on the GPU equals HF `generate` on the same GPU, fp32."""
    from lamina import LLM

    llm = LLM(compute_device="cuda", kv_device=kv, num_memory_workers=2,
              num_kv_slots=8192, max_batch=16)
    hf, eos = llm.loaded.model, llm.loaded.tokenizer.eos_token_id
    assert next(hf.parameters()).device.type == "cuda"
    want = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            want.append(hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=64, pad_token_id=eos)[0, len(p):].tolist())
    outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0), use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert llm.executor.compute.graphs.captures >= 1
    llm.shutdown()
