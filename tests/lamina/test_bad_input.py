"""Bad input through the Python API and in configuration: each case raises the specific
exception naming the problem, changes nothing, and a normal request succeeds right after
(SmolLM2, local executor). HTTP's corpus is in test_server_limits.py, the data plane's in
test_link.py and test_wire.py."""
import math

import pytest

from lamina.engine.config import EngineConfig
from lamina.entrypoints.api_server import ServerConfig
from lamina.entrypoints.engine_loop import EngineLoop
from lamina.errors import EngineOverloaded
from lamina.faults import FaultPlan
from lamina.sampling.params import SamplingParams

from .test_isolation import SLOTS, engine

OK = SamplingParams(max_tokens=2, temperature=0)
VOCAB = 49152


@pytest.fixture(scope="module")
def eng(smol, smol_packed):
    return engine(smol, smol_packed, workers=1)


def _normal(eng, prompts, hf_greedy):
    rid = eng.add_request(prompts[0], OK)
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o for o in eng.step()})
    assert outs[rid].token_ids == hf_greedy[0][:2]
    assert eng.free_slots()[0] == SLOTS


@pytest.mark.parametrize("prompt,params,exc,words", [
    (None, OK, TypeError, "text or a list of token ids"),
    (b"hello", OK, TypeError, "got bytes"),
    ({"a": 1}, OK, TypeError, "got dict"),
    (7, OK, TypeError, "got int"),
    ("", OK, ValueError, "empty prompt"),
    ("ok \ud800", OK, ValueError, "not valid Unicode: a lone surrogate U+D800 at character 3"),
    ([], OK, ValueError, "empty prompt"),
    ([1, True], OK, ValueError, "non-negative ints"),
    ([1, 2.0], OK, ValueError, "non-negative ints"),
    ([1, -3], OK, ValueError, "non-negative ints"),
    ([1, VOCAB], OK, ValueError, f"token id {VOCAB} is outside the vocabulary of {VOCAB}"),
    ([5] * 8192, OK, ValueError, "prompt has 8192 tokens; the model's context is 8192"),
    ([5] * 8000, SamplingParams(max_tokens=500), ValueError,
     "max_tokens 500 + the prompt's 8000 tokens = 8500 exceed the model's context of 8192"),
    ([5, 6], SamplingParams(logit_bias={VOCAB + 1: 1.0}), ValueError,
     f"logit_bias names token {VOCAB + 1}"),
    ([5, 6], SamplingParams(stop_token_ids=(VOCAB,)), ValueError,
     f"stop_token_ids names token {VOCAB}"),
    ([5, 6], SamplingParams(n=65), ValueError, "n=65 parallel samples exceed max_batch 64"),
    ([5, 6], {"max_tokens": 3}, TypeError, "params must be SamplingParams"),
])
def test_bad_request_raises_and_changes_nothing(eng, prompts, hf_greedy, prompt, params,
                                                exc, words):
    n_reqs, waiting = len(eng._reqs), len(eng.scheduler.waiting)
    with pytest.raises(exc) as e:
        eng.add_request(prompt, params)
    assert words in str(e.value)
    assert (len(eng._reqs), len(eng.scheduler.waiting)) == (n_reqs, waiting)
    _normal(eng, prompts, hf_greedy)


def test_clamp_max_tokens_lowers_instead(smol, smol_packed):
    from lamina.engine.engine import LLMEngine

    e = engine(smol, smol_packed, workers=1)
    e = LLMEngine(EngineConfig(num_kv_slots=SLOTS, clamp_max_tokens=True), e.executor,
                  smol.tokenizer, smol.config)
    rid = e.add_request([5] * 2900, SamplingParams(max_tokens=6000, ignore_eos=True,
                                                   temperature=0))
    assert e._reqs[rid].params.max_tokens == 8192 - 2900
    e.abort(rid)


@pytest.mark.parametrize("kw,words", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "SamplingParams.n"),
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": True}, "prompt_logprobs"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": math.nan}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {1: 101}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"),
])
def test_bad_sampling_params(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw)


@pytest.mark.parametrize("make,words", [
    (lambda: EngineConfig(num_kv_slots=0), "num_kv_slots"),
    (lambda: EngineConfig(num_memory_workers=0), "num_memory_workers"),
    (lambda: EngineConfig(max_batch=-1), "max_batch"),
    (lambda: EngineConfig(max_recoveries=-1), "max_recoveries"),
    (lambda: EngineConfig(find_culprits="yes"), "find_culprits must be a bool"),
    (lambda: EngineConfig(step_timeout_s=math.inf), "step_timeout_s"),
    (lambda: EngineConfig(worker_timeout_s=0), "worker_timeout_s"),
    (lambda: EngineConfig(placement_timeout_s=None), "placement_timeout_s"),
    (lambda: EngineConfig(placement_timeout_s=-5), "placement_timeout_s"),
    (lambda: EngineConfig(kv_device="tpu"), "kv_device"),
    (lambda: EngineConfig(pipeline="zigzag"), "pipeline"),
    (lambda: EngineConfig(clamp_max_tokens="yes"), "clamp_max_tokens"),
    (lambda: EngineConfig(faults={"memory_pos": 3}), "faults"),
    (lambda: EngineConfig(num_kv_slots=True), "num_kv_slots must be a positive int"),
    (lambda: EngineConfig(kv_pool_bytes=0), "kv_pool_bytes must be a positive int or None"),
    (lambda: EngineConfig(stream_groups=17), "stream_groups must be an int in 1..16"),
    (lambda: EngineConfig(min_live_memory_workers=0), "min_live_memory_workers must be an int"),
    (lambda: EngineConfig(local_prefill=1), "local_prefill must be a bool"),
    (lambda: EngineConfig(kv_evict="no"), "kv_evict must be a bool"),
    (lambda: EngineConfig(kv_huge_pages="no"), "kv_huge_pages must be a bool"),
    (lambda: EngineConfig(kv_prefault=1), "kv_prefault must be a bool"),
    (lambda: EngineConfig(compute_device="cuda:x"), "compute_device must be 'cpu' or"),
    (lambda: EngineConfig(kv_dtype="int4"), "kv_dtype must be one of"),
    (lambda: EngineConfig(truncation_reuse=True), "truncation_reuse needs the session tiers"),
    (lambda: EngineConfig(kv_host_bytes=1 << 20, prefix_caching=False),
     "kv_host_bytes needs prefix_caching"),
    (lambda: EngineConfig(stream_groups=2, kv_sparsity="h2o", kv_budget=0.5),
     "stream_groups=2 streams q/k/v by groups"),
    (lambda: FaultPlan(memory_pos=-1), "memory_pos"),
    (lambda: ServerConfig(max_n=0), "max_n"),
    (lambda: ServerConfig(max_body_bytes=True), "max_body_bytes"),
    (lambda: ServerConfig(api_key=""), "api_key"),
    (lambda: ServerConfig(max_waiting=0), "max_waiting"),
])
def test_bad_config_refused_by_name(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_engine_loop_queue_bound(eng, prompts, hf_greedy):
    with pytest.raises(ValueError, match="max_waiting"):
        EngineLoop(eng, max_waiting=0)
    loop = EngineLoop(eng, max_waiting=2)
    try:
        loop.waiting = lambda: 2  # as if two requests were queued and not yet running
        with pytest.raises(EngineOverloaded, match="2 requests waiting \\(limit 2\\)"):
            loop.submit(prompts[1], OK)
        assert loop.stats["rejected"] == 1 and not eng.has_unfinished()
        del loop.waiting
        assert loop.submit(prompts[0], OK).result(120).token_ids == hf_greedy[0][:2]
    finally:
        loop.shutdown()
