"""min_tokens (vLLM's): no EOS, stop token or stop string ends an answer before it has
that many tokens. Against HF `generate(min_new_tokens=...)` (its logits processor bans
the end tokens the same way), with and without speculative drafts, sampled, and over
the `openai` client."""
import openai
import pytest
import torch

from lamina.sampling.params import SamplingParams
from lamina.sampling.token_rules import restrict

from .test_engine import engine, run
from .test_server import _Server

QUESTIONS = ["What is 2+2? Reply with the number only.", "Name a colour. One word."]


@pytest.fixture(scope="module")
def short(smol):
    """Two chat prompts whose greedy answers end (EOS) after 8 and 12 tokens."""
    tok = smol.tokenizer
    return [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                        add_generation_prompt=True))["input_ids"]
            for q in QUESTIONS]


def hf(smol, prompt, new, min_new, ends):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = smol.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=new, min_new_tokens=min_new,
                                  eos_token_id=list(ends), pad_token_id=ends[0])
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("drafts", [0, 4])
def test_greedy_with_min_tokens_equals_hf_min_new_tokens(smol, smol_packed, short, drafts):
    eng = engine(smol, smol_packed, speculative_tokens=drafts)
    eos = sorted(eng.eos_ids)
    plain = run(eng, short, SamplingParams(max_tokens=24, temperature=0))
    assert [len(o.token_ids) for o in plain] == [8, 12]  # they end early on their own
    outs = run(eng, short, SamplingParams(max_tokens=24, min_tokens=16, temperature=0))
    for p, o in zip(short, outs):
        assert o.token_ids == hf(smol, p, 24, 16, eos)
        assert len(o.token_ids) >= 16
    # a stop token banned as EOS is: the first answer's first token
    first = plain[0].token_ids[0]
    stopped = run(eng, short[:1], SamplingParams(max_tokens=24, temperature=0,
                                                 stop_token_ids=(first,)))[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = run(eng, short[:1], SamplingParams(max_tokens=24, temperature=0, min_tokens=3,
                                              stop_token_ids=(first,)))[0]
    assert held.token_ids == hf(smol, short[0], 24, 3, [*eos, first])
    assert eng.free_slots()[0] == eng.config.num_kv_slots


def test_a_stop_string_before_min_tokens_does_not_end_it(smol, smol_packed, short):
    """The second answer holds "colour" early; with min_tokens 6 the stop string is
    looked for only in the text after, so the answer runs on to its EOS, the tokens
    the same as without the stop string."""
    eng = engine(smol, smol_packed)
    greedy = SamplingParams(max_tokens=24, temperature=0)
    full = run(eng, short[1:], greedy)[0]
    assert "colour" in smol.tokenizer.decode(full.token_ids[:3])
    cut = run(eng, short[1:], SamplingParams(max_tokens=24, temperature=0, stop=("colour",)))[0]
    assert cut.finish_reason == "stop" and len(cut.token_ids) <= 3
    late = run(eng, short[1:], SamplingParams(max_tokens=24, temperature=0, stop=("colour",),
                                              min_tokens=6))[0]
    assert late.token_ids == full.token_ids and late.text == full.text


def test_sampled_answers_hold_no_end_token_before_min_tokens(smol, smol_packed, short):
    eng = engine(smol, smol_packed)
    params = SamplingParams(max_tokens=20, min_tokens=14, temperature=1.0, seed=7, n=4)
    for out in run(eng, short, params):
        for c in out.outputs:
            assert len(c.token_ids) >= 14
            assert not set(c.token_ids[:13]) & eng.eos_ids


def test_the_mask_leaves_out_exactly_the_banned_tokens():
    masks = b"\xff" * 4 + b"\x0f" * 4  # two rows of 32 tokens
    got = restrict(masks, None, [(0, 9, 31, 40)] * 2)
    bits = [[(got[r * 4 + (t >> 3)] >> (t & 7)) & 1 for t in range(32)] for r in (0, 1)]
    assert bits[0] == [0 if t in (0, 9, 31) else 1 for t in range(32)]
    assert bits[1] == [int(t % 8 < 4 and t not in (0, 9)) for t in range(32)]
    assert restrict(masks, None, [(), ()]) == masks


def test_min_tokens_checked_and_served(smol, smol_packed, short):
    with pytest.raises(ValueError, match="min_tokens must not exceed max_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="min_tokens must be an int >= 0"):
        SamplingParams(min_tokens=-1)
    eng = engine(smol, smol_packed)
    with pytest.raises(ValueError, match="exceed the model's context"):
        eng.add_request([1] * 8000, SamplingParams(max_tokens=None, min_tokens=500))
    from lamina.entrypoints.engine_loop import EngineLoop

    loop = EngineLoop(eng)
    srv = _Server(loop, smol.tokenizer)
    try:
        cl = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        r = cl.completions.create(model="smollm2", prompt=short[0], max_tokens=24,
                                  temperature=0, extra_body={"min_tokens": 16})
        assert r.choices[0].model_extra["token_ids"] == hf(smol, short[0], 24, 16,
                                                           sorted(eng.eos_ids))
        with pytest.raises(openai.BadRequestError) as e:
            cl.completions.create(model="smollm2", prompt="hi", max_tokens=2,
                                  extra_body={"min_tokens": 3})
        assert e.value.body["param"] == "min_tokens"
    finally:
        srv.stop()
        loop.shutdown()
