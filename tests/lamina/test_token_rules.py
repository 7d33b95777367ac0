"""vLLM's request extras on the engine (local executor, SmolLM2) against HF `generate`:
allowed_token_ids (HF's prefix_allowed_tokens_fn), bad_words (HF's bad_words_ids, with
and without speculative drafts), min_p 1 (the greedy tokens), truncate_prompt_tokens, the
stop token's text, skip_special_tokens; rules that leave a draw no token fail the request
alone. Over HTTP with the openai client: the same fields, continue_final_message and
chat_template_kwargs."""
import copy

import openai
import pytest
import torch

from lamina.entrypoints.engine_loop import EngineLoop
from lamina.entrypoints.llm import chat_prompt
from lamina.entrypoints.metrics import EngineMetrics
from lamina.sampling.params import SamplingParams
from lamina.sampling.token_rules import TokenRules, bitmask, fit_width, restrict
from tests.conftest import HF_NEW
from tests.lamina.test_engine import engine, run
from tests.lamina.test_server import _Server

EOS = 2  # SmolLM2's <|im_end|>


def hf(smol, ids, new, **kw) -> list[int]:
    """HF greedy: `new` tokens after `ids` (fewer at EOS), with generate's own options."""
    x = torch.tensor([ids])
    with torch.no_grad():
        out = smol.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                  max_new_tokens=new, pad_token_id=EOS, **kw)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def eng(smol, smol_packed):
    return engine(smol, smol_packed)


def test_allowed_token_ids_answer_as_hf_prefix_constrained(eng, smol, prompts):
    """Every draw among the allowed tokens: HF's prefix_allowed_tokens_fn allowing the
    same; EOS is not among them, so both run to max_tokens."""
    allowed = [13, 28, 30, 253, 260, 282, 1463, 2824]
    (o,) = run(eng, [prompts[3]], SamplingParams(max_tokens=12, temperature=0,
                                                 allowed_token_ids=allowed))
    assert o.token_ids == hf(smol, prompts[3], 12,
                             prefix_allowed_tokens_fn=lambda b, ids: allowed)
    assert set(o.token_ids) <= set(allowed) and o.finish_reason == "length"


@pytest.mark.parametrize("draft", [0, 4])
def test_bad_words_answer_as_hf_bad_words_ids(smol, smol_packed, prompts, draft):
    """The repeated text's continuation holds " spread across Europe." (its first
    tokens: the words' longest), " printing press" and " movable type":
    banned, the answer goes another way, as HF's bad_words_ids (each word as written and
    after a space) make it; with n-gram drafts (which guess the banned words from the
    prompt) the same tokens. The ban is on the words' tokens: " printing presses" (a
    token of its own) may come."""
    eng = engine(smol, smol_packed, speculative_tokens=draft)
    words = ["printing press", "movable type", "spread across Europe."]
    (o,) = run(eng, [prompts[4]], SamplingParams(max_tokens=24, temperature=0,
                                                 bad_words=words))
    enc = [smol.tokenizer.encode(p + w, add_special_tokens=False) for w in words
           for p in ("", " ")]
    assert o.token_ids == hf(smol, prompts[4], 24, bad_words_ids=enc)
    assert o.token_ids != hf(smol, prompts[4], 24)  # the words were there to ban
    out = tuple(o.token_ids)  # the ban is on tokens: " printing presses" may come
    assert not any(out[i:i + len(w)] == tuple(w) for w in enc for i in range(len(out)))
    if draft:
        assert eng.num_accepted_tokens > 0


def test_min_p_one_draws_the_greedy_tokens(eng, prompts, hf_greedy):
    """min_p 1 keeps only the likeliest token: drawn rows (temperature 1, their seeds)
    give HF's greedy tokens."""
    pick = [0, 3, 9]
    outs = run(eng, [prompts[i] for i in pick],
               SamplingParams(max_tokens=HF_NEW, temperature=1.0, min_p=1.0, seed=11))
    assert [o.token_ids for o in outs] == [hf_greedy[i] for i in pick]


def test_truncate_prompt_tokens_runs_the_prompts_tail(eng, smol, prompts):
    (o,) = run(eng, [prompts[6]], SamplingParams(max_tokens=12, temperature=0,
                                                 truncate_prompt_tokens=40))
    assert o.prompt_token_ids == prompts[6][-40:]
    assert o.token_ids == hf(smol, prompts[6][-40:], 12)


def test_the_stop_token_text_is_left_out_unless_asked(eng, smol, prompts, hf_greedy):
    """vLLM's: the stop token (stop_token_ids, EOS) ends the output, its text not in it;
    include_stop_str_in_output keeps it, and a stop string too."""
    first = hf_greedy[4]
    stop = first[5]
    n = first.index(stop) + 1
    dec = smol.tokenizer.decode
    for keep in (False, True):
        (o,) = run(eng, [prompts[4]], SamplingParams(max_tokens=HF_NEW, temperature=0,
                                                     stop_token_ids=(stop,),
                                                     include_stop_str_in_output=keep))
        assert o.token_ids == first[:n] and o.finish_reason == "stop"
        assert o.text == dec(first[:n] if keep else first[:n - 1])
    text = dec(first)
    word = text[len(text) // 2: len(text) // 2 + 6]
    (o,) = run(eng, [prompts[4]], SamplingParams(max_tokens=HF_NEW, temperature=0,
                                                 stop=(word,), include_stop_str_in_output=True))
    assert o.text == text[:text.index(word) + len(word)]


def test_skip_special_tokens_false_keeps_them_in_the_text(eng, smol):
    """ignore_eos runs past the answer's <|im_end|>: the text shows it only when asked."""
    tok = smol.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Say hi."}],
                                     tokenize=False, add_generation_prompt=True)
    for skip in (True, False):
        (o,) = run(eng, [prompt], SamplingParams(max_tokens=30, temperature=0,
                                                 ignore_eos=True, skip_special_tokens=skip))
        assert EOS in o.token_ids
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=skip)
        assert ("<|im_end|>" in o.text) is not skip


def test_rules_that_leave_no_token_fail_the_request_alone(eng, prompts, hf_greedy):
    """allowed_token_ids [EOS] with min_tokens 2: the first draw may take nothing. That
    request fails naming why; the one beside it answers as HF; every slot comes back."""
    good = eng.add_request(prompts[0], SamplingParams(max_tokens=HF_NEW, temperature=0))
    bad = eng.add_request(prompts[1], SamplingParams(max_tokens=8, temperature=0,
                                                     min_tokens=2, allowed_token_ids=[EOS]))
    outs = {}
    while eng.has_unfinished():
        outs.update((o.request_id, o) for o in eng.step())
    assert outs[bad].finish_reason == "error" and "no token may come next" in outs[bad].error
    assert outs[good].token_ids == hf_greedy[0]
    assert eng.free_slots()[0] == eng.config.num_kv_slots
    with pytest.raises(ValueError, match="allowed_token_ids names token 49152"):
        eng.add_request(prompts[0], SamplingParams(allowed_token_ids=[5, 49152]))
    with pytest.raises(ValueError, match="ban every one of allowed_token_ids"):
        eng.add_request(prompts[0], SamplingParams(allowed_token_ids=[2988],
                                                   bad_words=["answer"]))


def test_restrict_ands_the_allowed_mask_and_clears_each_rows_bans():
    masks = b"\xff" * 4 + b"\x0f" * 4  # two rows of 32 tokens
    allowed = bitmask([1, 2, 9, 19, 23], 24)  # 3 bytes: tokens 24.. are left out
    got = restrict(masks, allowed, [(2,), (9, 1)])
    bits = [[(got[r * 4 + (t >> 3)] >> (t & 7)) & 1 for t in range(32)] for r in (0, 1)]
    assert [t for t in range(32) if bits[0][t]] == [1, 9, 19, 23]
    assert [t for t in range(32) if bits[1][t]] == [2, 19]  # row 1 holds t % 8 < 4 only


def test_fit_width_cuts_or_pads_each_row():
    """Rows of one width, each cut to `width` bytes or padded with zero bytes (tokens
    left out), row by row."""
    rows = bytes(range(1, 13))  # 3 rows of 4 bytes
    assert fit_width(rows, 3, 4) == rows
    assert fit_width(rows, 3, 2) == bytes([1, 2, 5, 6, 9, 10])
    assert fit_width(rows, 3, 6) == bytes([1, 2, 3, 4, 0, 0, 5, 6, 7, 8, 0, 0,
                                           9, 10, 11, 12, 0, 0])


def test_a_bad_word_is_banned_where_the_output_ends_in_its_other_tokens():
    rules = TokenRules(None, ((5,), (7, 8, 9), (3, 9)))
    assert rules.banned([]) == (5,)
    assert rules.banned([1, 7, 8]) == (5, 9)
    assert rules.banned([8, 3]) == (5, 9)
    assert rules.banned([7, 8, 1]) == (5,)


def test_chat_template_kwargs_reach_the_template(smol):
    """A template reading a variable of its own gets it; the names of
    apply_chat_template's own arguments are refused."""
    tok = copy.copy(smol.tokenizer)
    tok.chat_template = ("{% if greet %}Hi! {% endif %}{% for m in messages %}"
                         "{{ m['content'] }}{% endfor %}")
    msgs = [{"role": "user", "content": "hello"}]
    assert chat_prompt(tok, msgs, template_kwargs={"greet": True}) == "Hi! hello"
    assert chat_prompt(tok, msgs) == "hello"
    with pytest.raises(ValueError, match=r"chat_template_kwargs: \['tokenize'\]"):
        chat_prompt(tok, msgs, template_kwargs={"tokenize": True})


@pytest.fixture(scope="module")
def server(smol, smol_packed):
    """A server on an engine of its own (the tests' `eng` answers the references)."""
    loop = EngineLoop(engine(smol, smol_packed), EngineMetrics())
    srv = _Server(loop, smol.tokenizer)
    yield srv
    srv.stop()
    loop.shutdown()


def _client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)


def test_rules_leaving_no_token_over_http_fail_that_request_and_the_server_goes_on(
        server, prompts):
    """The first request this server's engine sees leaves its first draw no token: a
    500 naming why (the step ran nothing, yet is timed for /metrics), then a good
    request is answered."""
    code, body = server.post("/v1/completions", {
        "prompt": prompts[0], "max_tokens": 4, "min_tokens": 2, "allowed_token_ids": [EOS]})
    assert code == 500 and "no token may come next" in body["error"]["message"]
    code, body = server.post("/v1/completions", {"prompt": prompts[0], "max_tokens": 4,
                                                 "temperature": 0})
    assert code == 200 and body["choices"][0]["finish_reason"] == "length"


def test_the_fields_over_the_openai_client_answer_as_the_engine(server, eng, prompts):
    """Each case's fields, OpenAI's as arguments and vLLM's in extra_body, give what the
    engine gives for the same SamplingParams (tested against HF above)."""
    cases = [{"bad_words": ("printing press",)}, {"allowed_token_ids": (13, 28, 260, 282)},
             {"min_p": 0.3, "temperature": 1.0, "seed": 5}, {"truncate_prompt_tokens": 20},
             {"stop": ("print",), "include_stop_str_in_output": True},
             {"ignore_eos": True, "skip_special_tokens": False}]
    openai_own = ("temperature", "seed", "stop")
    for case in cases:
        kw = {"temperature": 0, **case}
        got = _client(server).completions.create(
            model="smollm2", prompt=prompts[4], max_tokens=16,
            **{k: v for k, v in kw.items() if k in openai_own},
            extra_body={k: v for k, v in kw.items() if k not in openai_own})
        (want,) = run(eng, [prompts[4]], SamplingParams(max_tokens=16, **kw))
        assert (got.choices[0].text, got.choices[0].model_extra["token_ids"]) == \
            (want.text, want.token_ids), case


def test_continue_final_message_over_the_openai_client(server, eng, smol):
    """The assistant's begun answer is continued: the tokens the engine draws after
    HF's own continue_final_message prompt; with a new turn opened too: 400."""
    msgs = [{"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "My favourite colour is"}]
    got = _client(server).chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=12, temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    text = smol.tokenizer.apply_chat_template(msgs, tokenize=False,
                                              continue_final_message=True)
    assert text.endswith("My favourite colour is")
    (want,) = run(eng, [text], SamplingParams(max_tokens=12, temperature=0))
    assert got.choices[0].model_extra["token_ids"] == want.token_ids
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    code, counted = server.post("/tokenize", {"messages": msgs, "add_generation_prompt": False,
                                              "continue_final_message": True})
    assert code == 200 and counted["tokens"] == want.prompt_token_ids
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).chat.completions.create(
            model="smollm2", messages=msgs, max_tokens=4,
            extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message"
    with pytest.raises(openai.BadRequestError) as e:
        _client(server).chat.completions.create(
            model="smollm2", messages=msgs[:1], max_tokens=4,
            extra_body={"chat_template_kwargs": {"tokenize": True}})
    assert e.value.body["param"] == "chat_template_kwargs"
