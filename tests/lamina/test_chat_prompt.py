"""`chat_prompt`: OpenAI's `developer` role reaches a template that does not know it as
`system` (compared with the template's own rendering of a system turn), a template that
knows it keeps it, and a template's refusal is a ValueError naming `messages`."""
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
