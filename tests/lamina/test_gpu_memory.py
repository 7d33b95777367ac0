"""Memory workers with their KV pool on a GPU (Triton kernels) while the compute side
stays on the CPU: q/k/v cross to the pool's device and outputs come back. The engine's
greedy tokens equal HF `generate` on tiny models of several attention kinds, with CPU
pools everywhere and GPU pools where there is a GPU; without one, asking for a GPU pool
is a clear error."""
import pytest
import torch

from lamina.engine.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.executor.local import LocalExecutor
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.sampling.params import SamplingParams
from tests.tiny_models import tiny_model

CUDA = torch.cuda.is_available()


def test_kv_device_is_validated():
    for bad in ("tpu", "cuda:x", "", 0):
        with pytest.raises(ValueError, match="kv_device must be 'cpu' or 'cuda"):
            EngineConfig(kv_device=bad)
    assert EngineConfig(kv_device="cuda:1").kv_device == "cuda:1"


@pytest.mark.skipif(CUDA, reason="checks the message given where torch sees no GPU")
def test_gpu_pool_without_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        KVPool(KVPoolConfig(2, 16, 1, 8, device="cuda"))


def hf_greedy(model, prompts, n):
    """n greedy tokens each from HF's full forward (no cache), EOS not special."""
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            outs.append(ids[len(p):])
    return outs


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "mistral", "gpt_oss"])
def test_gpu_memory_workers_greedy_equals_hf(model_type):
    """Two memory workers with small pools (a 150-token prompt's KV is split over both
    where the model allows it; gpt_oss has sinks, so no split): greedy tokens equal HF's,
    with CPU pools (compiled kernel) and, where there is a GPU, GPU pools (Triton)."""
    from lamina.splitter import split_model

    model = tiny_model(model_type)
    split = split_model(model)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (n,), generator=g).tolist() for n in (5, 23, 60, 150)]
    want = hf_greedy(model, prompts, 24)
    sinks = any(s.sinks is not None for s in split.attention_specs)
    slots = 200 if sinks else 128
    for dev in ["cpu"] + (["cuda"] if CUDA else []):
        cfg = EngineConfig(num_kv_slots=slots, num_memory_workers=2, kv_device=dev,
                           split_kv=not sinks)
        mems = [MemorySide(KVPool(KVPoolConfig.for_specs(split.attention_specs, slots,
                                                         device=dev))) for _ in range(2)]
        assert {m.backend.name for m in mems} == {"triton" if dev == "cuda" else "cpu"}
        eng = LLMEngine(cfg, LocalExecutor(split, mems), None, model.config)
        ids = [eng.add_request(p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
               for p in prompts]
        out, spans = {}, set()
        while eng.has_unfinished():
            for o in eng.step():
                out[o.request_id] = o
            spans |= {len(s.segments) for s in eng.scheduler.running}
        assert [out[i].token_ids for i in ids] == want, dev
        assert (max(spans) > 1) == (not sinks)  # the KV split did happen
        assert eng.free_slots() == [slots, slots]
