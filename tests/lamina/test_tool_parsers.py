"""Tool calls read from a model's own output (`tool_choice` "auto"): each family's format
on answers written as its models write them (the forms in their model cards and chat
templates), answers that are text, and malformed or foreign calls (text, whole); the
same calls whether the answer arrives whole or streamed in any split, with text sent
before a call region begins and nothing of a call sent as text; each format's written
calls read back as themselves; the tools listed for a template that shows none."""
import json
import random

import pytest

from lamina.entrypoints.api_server import ServerConfig
from lamina.entrypoints.api_tools import history_for_template, tool_calling
from lamina.entrypoints.llm import chat_prompt
from lamina.entrypoints.tool_parsers import PARSERS, ToolStream, tool_parser

NAMES = frozenset({"get_weather", "get_time"})
PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
OSLO_TIME = ("get_time", {"zone": "Europe/Oslo"})

# (parser, answer, text left (stripped; None: the answer is text, whole), calls)
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"unit": "celsius"}}\n</tool_call>', "", [PARIS]),
    ("hermes", 'Let me look both up.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": '
               '"get_time", "arguments": {"zone": "Europe/Oslo"}}\n</tool_call>',
     "Let me look both up.", [PARIS, OSLO_TIME]),
    ("hermes", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}, {"name": "get_time", "arguments": {"zone": "Europe/Oslo"}}]'
               '</tool_call>', "", [PARIS, OSLO_TIME]),  # SmolLM2's list in one tag
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Oslo"}}',
     "", [OSLO_TIME]),  # stopped at end-of-sequence before the closing tag
    ("hermes", "It is sunny in Paris; no tool needed.", None, []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None, []),
    ("hermes", '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>', None, []),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "zone=UTC"}</tool_call>',
     None, []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": '
                    '"celsius"}}', "", [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
                    '"unit": "celsius"}}; {"name": "get_time", "parameters": {"zone": '
                    '"Europe/Oslo"}}', "", [PARIS, OSLO_TIME]),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "a;b"}}', "",
     [("get_time", {"zone": "a;b"})]),  # a ";" inside a string joins nothing
    ("llama3_json", "Paris is sunny today.", None, []),
    ("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}} and more', None, []),
    ("llama3_json", '{"city": "Paris"}', None, []),  # JSON, but not a call
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
                '"unit": "celsius"}}]', "", [PARIS]),
    ("mistral", 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": '
                '"celsius"}[TOOL_CALLS]get_time[ARGS]{"zone": "Europe/Oslo"}',
     "Checking.", [PARIS, OSLO_TIME]),
    ("mistral", "Plain answer, [no] calls.", None, []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city"', None, []),
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), get_time(zone="Europe/Oslo")]',
     "", [PARIS, OSLO_TIME]),
    ("pythonic", '<|python_start|>[get_time(zone="Europe/Oslo")]<|python_end|>', "",
     [OSLO_TIME]),
    ("pythonic", "[1, 2, 3] are numbers.", None, []),
    ("pythonic", '[get_weather("Paris")]', None, []),  # positional: no argument names
    ("pythonic", "Sunny.", None, []),
]


def _ids(case):
    return f"{case[0]}-{CASES.index(case)}"


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_each_format_read_whole(case):
    name, answer, left, calls = case
    got = tool_parser(name).parse(answer, NAMES)
    assert [(n, json.loads(a)) for n, a in got.calls] == [(n, a) for n, a in calls]
    if left is None:  # text: the answer, whole
        assert got.content == answer and not got.calls
    else:
        assert got.content.strip() == left


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_streamed_in_any_split_equals_whole(case):
    """Every split point set (each character alone, random cuts, whole): the text sent
    plus the rest at the finish is the answer's text part, the calls are the whole
    answer's, and text before a call region goes out before the finish."""
    name, answer, left, calls = case
    whole = tool_parser(name).parse(answer, NAMES)
    rng = random.Random(CASES.index(case))
    inner = range(1, len(answer))
    splits = [list(inner), [], *(sorted(rng.sample(inner, k=rng.randint(1, min(6, len(inner)))))
                                 for _ in range(8))]
    for cuts in splits:
        parts = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)])]
        s = ToolStream(tool_parser(name), NAMES)
        sent = "".join(s.feed(p) for p in parts)
        rest, got = s.finish()
        assert got == whole.calls, cuts
        if left is None:
            assert sent + rest == answer, cuts
        else:
            assert (sent + rest).strip() == left and not any(
                m in sent for m in tool_parser(name).markers if m not in left), cuts
            if cuts and left:  # the text before the calls was not held to the end
                assert sent.strip() == left, (cuts, sent)


def test_plain_text_streams_as_it_comes():
    """No call: each delta goes out at once, bar trailing whitespace and the start of a
    marker, which wait for what follows."""
    s = ToolStream(tool_parser("hermes"), NAMES)
    assert [s.feed(d) for d in ["The sky", " is", " blue ", "<tool", "ing> and", "\n"]] == \
        ["The sky", " is", " blue", "", " <tooling> and", ""]
    assert s.finish() == ("\n", ())
    s = ToolStream(tool_parser("llama3_json"), NAMES)
    assert [s.feed(d) for d in ["  ", "Hi", " there"]] == ["", "  Hi", " there"]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_written_calls_read_back_as_themselves(name):
    """An earlier turn's calls as the format writes them parse to the same calls:
    nested arguments, unicode, quotes, ";" and brackets inside strings, no arguments."""
    calls = [("get_weather", {"city": "Zürich; \"Old\" town [x]", "unit": "celsius",
                              "days": [1, 2], "opts": {"hourly": True, "n": None}}),
             ("get_time", {})]
    p = tool_parser(name)
    got = p.parse(p.format_calls(calls), NAMES)
    assert [(n, json.loads(a)) for n, a in got.calls] == calls
    assert got.content.strip() == ""


def test_auto_needs_a_parser_and_reads_calls_with_it():
    tools = [{"type": "function", "function": {"name": n}} for n in sorted(NAMES)]
    with pytest.raises(ValueError, match="--tool-call-parser"):
        tool_calling(tools, "auto", None)
    auto = tool_calling(tools, None, None, tool_parser("hermes"))
    assert auto.parser is PARSERS["hermes"] and auto.forced is None
    text, calls = auto.read(CASES[1][1])
    assert text == "Let me look both up." and [c["function"]["name"] for c in calls] == \
        ["get_weather", "get_time"] and all(c["id"].startswith("call_") for c in calls)
    one = tool_calling(tools, "auto", False, tool_parser("hermes"))
    assert [c["function"]["name"] for c in one.read(CASES[1][1])[1]] == ["get_weather"]
    assert auto.read("Just text.") == ("Just text.", None)
    assert tool_calling(tools, "none", None, tool_parser("hermes")) is None
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ServerConfig(tool_call_parser="qwen")
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        tool_parser("qwen")


def test_tools_listed_for_a_template_that_shows_none(smol):
    """SmolLM2's template never mentions tools: under "auto" the parser's system prompt
    lists them (after the conversation's own system prompt), and an earlier call is
    written in the parser's format; a template that shows tools gets them as they are."""
    tok = smol.tokenizer
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}}
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Time in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_time", "arguments": '{"zone": "Europe/Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    hermes = tool_parser("hermes")
    prompt = chat_prompt(tok, msgs, [tool], hermes)
    system = prompt[:prompt.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and \
        json.dumps(tool) in system and "<tool_call>" in system
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Oslo"}}\n' \
           '</tool_call>' in prompt
    assert "# Tools" not in chat_prompt(tok, msgs, [tool])  # no parser: forced calls only
    bare = chat_prompt(tok, msgs[1:2], [tool], hermes)
    assert bare.startswith("<|im_start|>system\n# Tools")  # in place of the default one

    class ShowsTools:  # a template with its own place for tools
        chat_template = "{% for t in tools %}{% endfor %}{{ messages }}"

        def apply_chat_template(self, msgs, tools, **kw):
            return json.dumps([msgs, tools])

    got, shown = json.loads(chat_prompt(ShowsTools(), msgs[1:2], [tool], hermes))
    assert got == msgs[1:2] and shown == [tool]
    written = history_for_template(msgs[2:3], "", tool_parser("llama3_json"))
    assert written[0]["content"] == '{"name": "get_time", "parameters": {"zone": ' \
                                    '"Europe/Oslo"}}'
