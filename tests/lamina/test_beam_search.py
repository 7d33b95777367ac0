"""Beam search (`LLM.beam_search`, `lamina.engine.beam_search`) against HF's
`generate(num_beams=W, do_sample=False)` on SmolLM2 in fp32: the same W beams in the same
order with the same scores, for HF's three `early_stopping` rules and length penalties
that favour short, neutral and long answers. Each round computes one token a beam (the
prefix cache holds the rest); a failed round fails its prompt's search alone."""
from __future__ import annotations

import pytest
import torch

from lamina import LLM, BeamSearchParams
from lamina.entrypoints.llm import chat_prompt, chat_tokens
from lamina.faults import FaultPlan

QUESTIONS = ["What is 2+2? Answer with a number only.", "Say yes.", "Name a color.",
             "What is the capital of France? One word."]


@pytest.fixture(scope="module")
def llm():
    llm = LLM(num_kv_slots=4096)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def chats(llm):
    tok = llm.loaded.tokenizer
    return [chat_tokens(tok, chat_prompt(tok, [{"role": "user", "content": q}]))
            for q in QUESTIONS]


def hf_beams(model, prompt, w, new, **kw) -> tuple[list[list[int]], list[float]]:
    """HF's W beams (new tokens, cut after the EOS) and their scores, best first.
    `prompt`: token ids or a `TokensPrompt`."""
    ids = torch.tensor([list(getattr(prompt, "prompt_token_ids", prompt))])
    with torch.no_grad():
        r = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=w,
                           num_return_sequences=w, do_sample=False, max_new_tokens=new,
                           output_scores=True, return_dict_in_generate=True,
                           pad_token_id=2, **kw)
    beams = []
    for s in r.sequences[:, ids.shape[1]:].tolist():
        beams.append(s[:s.index(2) + 1] if 2 in s else s)
    return beams, r.sequences_scores.tolist()


# (beam width, new tokens, length penalty, early_stopping, which questions)
CASES = [(3, 16, 1.0, False, (0, 2)), (2, 12, 0.5, True, (1,)),
         (4, 12, 2.0, "never", (3,)), (3, 12, -1.0, False, (1,))]


@pytest.mark.parametrize("w, new, lp, stopping, which", CASES)
def test_beams_equal_hf_generate_num_beams(llm, smol, chats, w, new, lp, stopping, which):
    prompts = [chats[i] for i in which]
    params = BeamSearchParams(beam_width=w, max_tokens=new, length_penalty=lp,
                              early_stopping=stopping)
    outs = llm.beam_search(prompts, params)
    for p, out in zip(prompts, outs):
        want, scores = hf_beams(smol.model, p, w, new, length_penalty=lp,
                                early_stopping=stopping)
        assert [c.token_ids for c in out.outputs] == want
        assert [c.score for c in out.outputs] == pytest.approx(scores, rel=1e-4, abs=1e-5)
        for c in out.outputs:
            assert c.finish_reason == ("stop" if c.token_ids[-1] == 2 else "length")
            assert c.cumulative_logprob / len(c.token_ids) ** lp == pytest.approx(c.score)
            assert c.text == llm.loaded.tokenizer.decode(
                c.token_ids[:-1] if c.finish_reason == "stop" else c.token_ids)
            assert all(len(t.top) == 2 * w for t in c.logprobs)
        # the prefix cache serves every round but the first: one token a beam a round
        m = out.metrics
        assert m["computed_tokens"] == len(p.prompt_token_ids) - m["cached_tokens"] \
            + (m["rounds"] - 1) * w


def test_the_cases_cover_each_way_a_search_ends(llm, chats):
    """EOS-ended and cut beams, and searches stopped before max_tokens by HF's rule (the
    comparison above is only as strong as what it exercised)."""
    outs = llm.beam_search(chats, BeamSearchParams(beam_width=3, max_tokens=16))
    reasons = {c.finish_reason for o in outs for c in o.outputs}
    assert reasons == {"stop", "length"}
    assert any(o.metrics["rounds"] < 16 for o in outs)
    assert any(o.metrics["rounds"] == 16 for o in outs)


def test_concurrency_limit_searches_prompts_in_turns_alike(llm, chats, capsys):
    """vLLM's `concurrency_limit` and `use_tqdm`: prompts searched one at a time give
    the beams they give all at once; the bar counts every round of both turns."""
    params = BeamSearchParams(beam_width=2, max_tokens=6)
    together = llm.beam_search(chats[:2], params)
    apart = llm.beam_search(chats[:2], params, use_tqdm=True, concurrency_limit=1)
    assert [[c.token_ids for c in o.outputs] for o in apart] == \
        [[c.token_ids for c in o.outputs] for o in together]
    rounds = sum(o.metrics["rounds"] for o in apart)
    assert f"{rounds}round" in capsys.readouterr().err.replace(" ", "")
    with pytest.raises(ValueError, match="concurrency_limit must be None or an int >= 1"):
        llm.beam_search(chats[:1], params, concurrency_limit=0)


def test_without_the_prefix_cache_each_round_computes_whole_contexts(caplog):
    """The same beams, each round feeding every beam's whole context (counted), and a
    warning saying so."""
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    prompt = "The capital of France is"
    outs = {}
    for caching in (True, False):
        llm = LLM(num_kv_slots=1024, prefix_caching=caching)
        try:
            outs[caching] = llm.beam_search([prompt], params)[0]
        finally:
            llm.shutdown()
    assert [c.token_ids for c in outs[False].outputs] == \
        [c.token_ids for c in outs[True].outputs]
    n = len(outs[True].prompt_token_ids)
    assert outs[True].metrics["computed_tokens"] == n + 3 * 2
    assert outs[False].metrics["computed_tokens"] == n + 2 * sum(n + r for r in (1, 2, 3))
    assert "prefix_caching off: every round recomputes" in caplog.text


def test_a_failed_round_fails_its_prompt_alone(smol):
    """A memory worker fails any sequence with a query at the long prompt's position + 3:
    its search reaches it in round 5 (round 1 computes the prompt, round r position
    n + r - 2) and ends with an error naming the round; the short
    prompt's search, running beside it, equals its run alone."""
    short = "The capital of France is"
    long_ = "Tell me a long story about a dragon and a knight who became friends. " * 2
    n = len(smol.tokenizer(long_)["input_ids"])
    assert len(smol.tokenizer(short)["input_ids"]) + 8 < n
    params = BeamSearchParams(beam_width=2, max_tokens=8, ignore_eos=True)
    llm = LLM(num_kv_slots=2048, faults=FaultPlan(memory_pos=n + 3))
    try:
        alone = llm.beam_search([short], params)[0]
        both = llm.beam_search([short, long_], params)
        assert [c.token_ids for c in both[0].outputs] == [c.token_ids for c in alone.outputs]
        assert both[1].error.startswith("beam search round 5: ")
        assert "injected" in both[1].error and both[1].outputs[0].finish_reason == "error"
        assert not llm.engine.has_unfinished()
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kw, words", [
    (dict(beam_width=0, max_tokens=4), "beam_width must be an int in [1, 10]"),
    (dict(beam_width=11, max_tokens=4), "beam_width must be an int in [1, 10]"),
    (dict(beam_width=2, max_tokens=0), "max_tokens must be an int >= 1"),
    (dict(beam_width=2, max_tokens=4, temperature=0.7), "temperature must be 0"),
    (dict(beam_width=2, max_tokens=4, early_stopping="soon"), "early_stopping must be"),
])
def test_params_are_checked_by_name(kw, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        BeamSearchParams(**kw)


def test_a_prompt_past_the_context_is_refused_before_any_runs(llm):
    new = llm.engine.max_len - 10  # "Hi" fits, 20 words do not
    with pytest.raises(ValueError, match=f"prompt 1: max_tokens {new} "):
        llm.beam_search(["Hi", "word " * 20], BeamSearchParams(beam_width=2, max_tokens=new))
    assert not llm.engine.has_unfinished()
