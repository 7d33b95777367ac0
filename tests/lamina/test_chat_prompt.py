"""`chat_prompt`: OpenAI's `developer` role reaches a template that does not know it as
`system` (compared with the template's own rendering of a system turn), a template that
knows it keeps it, and a template's refusal is a ValueError naming `messages`. A chat is
tokenized with no special tokens added (one BOS where the template writes it), and a
`TokensPrompt` feeds its ids and keeps its text."""
import copy

import pytest

from lamina.entrypoints.llm import chat_prompt


def test_developer_is_system_to_a_template_that_does_not_name_it(smol):
    tok = smol.tokenizer
    turn = {"role": "user", "content": "hi"}
    want = tok.apply_chat_template([{"role": "system", "content": "Be terse."}, turn],
                                   tokenize=False, add_generation_prompt=True)
    assert "You are a helpful AI assistant" not in want  # a system turn replaces the default
    assert chat_prompt(tok, [{"role": "developer", "content": "Be terse."}, turn]) == want
    assert chat_prompt(tok, [turn]) == tok.apply_chat_template(
        [turn], tokenize=False, add_generation_prompt=True)


def test_a_template_that_names_developer_gets_it_and_a_refusal_names_messages(smol):
    tok = copy.copy(smol.tokenizer)
    tok.chat_template = ("{% for m in messages %}{% if m.role == 'developer' %}[dev]"
                         "{% endif %}{{ m.role }}:{{ m.content }};{% endfor %}")
    assert chat_prompt(tok, [{"role": "developer", "content": "x"}]) == "[dev]developer:x;"
    tok.chat_template = "{{ raise_exception('Unexpected message role.') }}"
    with pytest.raises(ValueError, match="^messages: the model's chat template refused "
                                         "them: Unexpected message role.$"):
        chat_prompt(tok, [{"role": "user", "content": "x"}])


def test_text_that_is_not_unicode_is_refused_naming_where(smol):
    """A lone surrogate (what a JSON `\\ud800` escape alone decodes to) in a message or
    in the prompt a template writes: a ValueError saying where, not the tokenizer's
    TypeError about its argument's types."""
    from lamina.entrypoints.llm import chat_tokens

    tok = smol.tokenizer
    with pytest.raises(ValueError, match="^messages.1.content is not valid Unicode: a lone "
                                         "surrogate U[+]D800 at character 2$"):
        chat_prompt(tok, [{"role": "user", "content": "x"},
                          {"role": "user", "content": [{"type": "text", "text": "ab\ud800"}]}])
    with pytest.raises(ValueError, match="^the chat prompt its messages make is not valid "
                                         "Unicode: a lone surrogate U[+]DBFF at character 1$"):
        chat_tokens(tok, "a\udbff")
    emoji = "\U0001f600"  # a surrogate pair in JSON: one character, kept
    assert chat_tokens(tok, emoji).prompt_token_ids == \
        tuple(tok(emoji, add_special_tokens=False)["input_ids"])


def test_a_chat_gets_the_special_tokens_its_template_writes_once(smol, smol_packed):
    """Llama's way: a tokenizer that puts BOS before every text it encodes and a template
    that writes `{{ bos_token }}` itself. A chat's prompt over HTTP (what the engine is
    fed, /tokenize's count, the answer) and `chat_tokens` (LLM.chat, the service's
    client) are HF's apply_chat_template(tokenize=True) ids: one BOS, not two."""
    from types import SimpleNamespace

    import torch
    from tokenizers.processors import TemplateProcessing

    from lamina.entrypoints.engine_loop import EngineLoop
    from lamina.entrypoints.llm import chat_tokens
    from lamina.entrypoints.metrics import EngineMetrics
    from tests.lamina.test_engine import engine
    from tests.lamina.test_server import _Server

    tok = copy.deepcopy(smol.tokenizer)
    bos = tok.bos_token_id
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, bos)])
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: "
                         "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}"
                         "assistant:{% endif %}")
    msgs = [{"role": "user", "content": "Name a colour."}]
    want = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True,
                                   return_dict=False)
    assert tok("Hi")["input_ids"][0] == bos and want.count(bos) == 1
    assert list(chat_tokens(tok, chat_prompt(tok, msgs)).prompt_token_ids) == want
    loop = EngineLoop(engine(SimpleNamespace(tokenizer=tok, config=smol.config),
                             smol_packed), EngineMetrics())
    srv = _Server(loop, tok)
    try:
        code, counted = srv.post("/tokenize", {"messages": msgs})
        assert code == 200 and counted["tokens"] == want
        code, out = srv.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 8,
                                                      "temperature": 0})
        assert code == 200 and out["usage"]["prompt_tokens"] == len(want)
        x = torch.tensor([want])
        with torch.no_grad():
            ref = smol.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                      max_new_tokens=8, pad_token_id=tok.eos_token_id)
        assert out["choices"][0]["token_ids"] == ref[0, len(want):].tolist()
    finally:
        srv.stop()
        loop.shutdown()


def test_a_tokens_prompt_feeds_its_ids_and_keeps_its_text(smol, smol_packed, prompts,
                                                          hf_greedy):
    """A TokensPrompt is one prompt to `generate` (alone or in a list); the engine feeds
    its ids (HF's greedy answer for them) and gives its text back as the prompt."""
    from lamina.engine.inputs import TokensPrompt
    from lamina.entrypoints.llm import batch_of
    from lamina.sampling.params import SamplingParams
    from tests.conftest import HF_NEW
    from tests.lamina.test_engine import engine, run

    tp = TokensPrompt(prompts[2], "the text it came from")
    assert batch_of(tp, None)[0] == [tp]
    assert batch_of([tp, [1, 2]], SamplingParams())[0] == [tp, [1, 2]]
    (o,) = run(engine(smol, smol_packed), [tp], SamplingParams(max_tokens=HF_NEW,
                                                               temperature=0))
    assert (o.prompt, o.prompt_token_ids, o.token_ids) == \
        ("the text it came from", prompts[2], hf_greedy[2])
