"""Engine logprobs (drawn and prompt tokens) against HF's log-softmax, streamed partial
outputs, and abort (exact allocator state after it), on SmolLM2 with the local executor."""
import pytest
import torch

from lamina.sampling.params import SamplingParams

from .test_engine import GREEDY, engine, run


def test_logprobs_equal_hf_log_softmax(smol, smol_packed, prompts, hf_greedy):
    pick = [0, 4]
    p = SamplingParams(max_tokens=12, temperature=0, logprobs=3)
    outs = run(engine(smol, smol_packed), [prompts[i] for i in pick], p)
    for o, i in zip(outs, pick):
        c = o.outputs[0]
        assert c.token_ids == hf_greedy[i][:12] and len(c.logprobs) == 12
        ids = torch.tensor([prompts[i] + c.token_ids[:-1]])
        with torch.no_grad():
            ref = torch.log_softmax(smol.model(ids).logits[0, len(prompts[i]) - 1:].double(), -1)
        for t, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            assert lp.token_id == tok and abs(lp.logprob - ref[t, tok].item()) < 1e-4
            assert [j for j, _ in lp.top] == ref[t].topk(3).indices.tolist()
            assert lp.top[0][0] == tok  # greedy draws the most likely token
        assert abs(c.cumulative_logprob - sum(ref[t, k].item() for t, k in
                                              enumerate(c.token_ids))) < 1e-3
    plain = run(engine(smol, smol_packed), [prompts[0]], SamplingParams(max_tokens=3,
                                                                        temperature=0))
    assert plain[0].outputs[0].logprobs is None


def test_stream_partials_grow_to_the_final_output(smol, smol_packed, prompts, hf_greedy):
    text = smol.tokenizer.decode(hf_greedy[4], skip_special_tokens=True)
    stop = text[len(text) // 2: len(text) // 2 + 6]
    p = SamplingParams(max_tokens=64, temperature=0, stop=(stop,))
    (want,) = run(engine(smol, smol_packed), [prompts[4]], p)
    eng = engine(smol, smol_packed)
    rid = eng.add_request(prompts[4], p, stream=True)
    other = eng.add_request(prompts[0], GREEDY)  # not streamed: only its final output
    partials, finals = [], {}
    while eng.has_unfinished():
        for o in eng.step():
            (partials if not o.finished else finals.setdefault(o.request_id, [])).append(o)
    assert {k: len(v) for k, v in finals.items()} == {rid: 1, other: 1}
    assert all(o.request_id == rid for o in partials)
    final = finals[rid][0]
    assert final.token_ids == want.token_ids and final.text == want.text
    assert [len(o.token_ids) for o in partials] == list(range(1, len(final.token_ids)))
    seen = [o.text for o in partials] + [final.text]
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))  # never takes text back
    assert all(not any(o.text.endswith(stop[:k]) for k in range(1, len(stop)))
               for o in partials)  # a possible stop-string start is held back
    assert finals[other][0].token_ids == hf_greedy[0]


def test_abort_frees_kv_and_others_keep_running(smol, smol_packed, prompts, hf_greedy):
    eng = engine(smol, smol_packed, num_kv_slots=2000, max_batch=3)
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, n=2)
    a = eng.add_request(prompts[5], long)
    b = eng.add_request(prompts[2], GREEDY)
    c = eng.add_request(prompts[7], long)  # no batch room for its 2 samples: waits
    for _ in range(3):
        assert eng.step() == []
    assert [s.status for s in eng._reqs[c].seqs] == ["waiting", "waiting"]
    held = 2000 - eng.free_slots()[0]
    out = eng.abort(a)
    assert out.finished and [x.finish_reason for x in out.outputs] == ["abort", "abort"]
    assert [len(x.token_ids) for x in out.outputs] == [3, 3]
    # a's 200 prompt slots (shared by its forks) and 2 x 2 own slots came back
    assert eng.free_slots()[0] == 2000 - held + 200 + 4
    assert eng.abort(a) is None  # already gone
    out_c = eng.abort(c)  # aborted while waiting: nothing was allocated for it
    assert [x.finish_reason for x in out_c.outputs] == ["abort", "abort"]
    assert out_c.metrics["ttft_s"] is None
    done = []
    while eng.has_unfinished():
        done += eng.step()
    assert [o.request_id for o in done] == [b] and done[0].token_ids == hf_greedy[2]
    assert eng.free_slots()[0] == 2000 and eng.alloc.stats().shared == 0


@pytest.mark.parametrize("pipeline", ["none", "rotational"])
def test_prompt_logprobs_equal_hf_log_softmax(smol, smol_packed, prompts, hf_greedy, pipeline):
    """Each prompt token's logprob given the ones before it, with top-2, next to a request
    that asks for none (and, rotational, split over two micro-batches)."""
    eng = engine(smol, smol_packed, pipeline=pipeline)
    p = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2)
    pick = [1, 4]
    ids = [eng.add_request(prompts[i], p) for i in pick]
    plain = eng.add_request(prompts[0], SamplingParams(max_tokens=3, temperature=0))
    out = {}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] = o
    assert out[plain].prompt_logprobs is None and out[plain].token_ids == hf_greedy[0][:3]
    for rid, i in zip(ids, pick):
        o, ptoks = out[rid], prompts[i]
        assert o.token_ids == hf_greedy[i][:3]
        plp = o.prompt_logprobs
        assert len(plp) == len(ptoks) and plp[0] is None
        with torch.no_grad():
            ref = torch.log_softmax(smol.model(torch.tensor([ptoks])).logits[0, :-1].double(), -1)
        for t in range(1, len(ptoks)):
            e = plp[t]
            assert e.token_id == ptoks[t]
            assert abs(e.logprob - ref[t - 1, ptoks[t]].item()) < 1e-4
            assert [tid for tid, _ in e.top] == torch.topk(ref[t - 1], 2).indices.tolist()
