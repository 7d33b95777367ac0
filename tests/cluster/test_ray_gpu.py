"""The Ray executor with its compute worker on a GPU (issue 32; the NEO-like setup): the
slices and sampling on the GPU, two memory workers holding the KV in host DRAM, q/k/v
through pinned buffers. The 16-prompt mixed-length test equals HF `generate` on the
same GPU in fp32. Skips without a GPU; `benchmarks/gpu_check.sh ray` runs it there.
By default the compute worker must start from the weights alone (a record written here
first); with `LAMINA_WEIGHTS_ONLY=0`, the full way."""

import pytest
import ray
import torch

from lamina import LLM, SamplingParams
from lamina.model import quick_load

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch sees none)")


def test_ray_with_a_gpu_compute_worker_equals_hf_generate_on_the_gpu(smol, smol_split,
                                                                     prompts):
    weights_only = quick_load.enabled_for("cuda")
    if weights_only:  # smol_split put its trace in the store
        assert quick_load.remember(smol, torch.float32) is not None
    llm = LLM(executor="ray", compute_device="cuda", kv_device="cpu", num_memory_workers=2,
              num_kv_slots=8192, max_batch=16)
    try:
        ex = llm.executor
        assert [s.weights_only for s in ex.compute_starts()] == [weights_only]
        assert ex._c_opts.get("num_gpus") == 1  # the compute worker holds the GPU
        assert "num_gpus" not in ex._m_opts
        hf, eos = smol.model.to("cuda"), smol.tokenizer.eos_token_id
        want = []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p], device="cuda")
                want.append(hf.generate(ids, attention_mask=torch.ones_like(ids),
                                        do_sample=False, max_new_tokens=64,
                                        pad_token_id=eos)[0, len(p):].tolist())
        outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0),
                            use_tqdm=False)
        assert [o.token_ids for o in outs] == want
        # decode steps replayed CUDA graphs on the compute worker
        stats = ray.get(ex.compute.__ray_call__.remote(
            lambda w: (str(w.compute.device), w.compute.graphs.captures)))
        assert stats[0].startswith("cuda") and stats[1] >= 1, stats
    finally:
        smol.model.to("cpu")  # the session's model, for the tests after this one
        llm.shutdown()
        ray.shutdown()
