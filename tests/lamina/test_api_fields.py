"""Request fields the server does not read (`lamina.entrypoints.api_fields`), on parsed
requests without an engine: OpenAI's fields that change nothing are taken and named; the
ones that would change the answer are refused naming the field unless their value asks
for nothing; unknown ones are refused or, under "ignore", taken; structured output
from each of its spellings, or a 400 naming the field. Over HTTP with the
`openai` client: `tests/lamina/test_server_limits.py`."""
import json
import logging

import pytest

from lamina.entrypoints import api_fields
from lamina.entrypoints.api_fields import (
    CHAT_REFUSED,
    COMPLETION_REFUSED,
    check_fields,
    structured_field,
    structured_outputs,
)
from lamina.entrypoints.api_server import ChatRequest, CompletionRequest, ServerConfig
from lamina.entrypoints.api_tools import history_for_template, tool_calling
from lamina.entrypoints.deploy_config import LaminaConfig
from lamina.sampling.structured import StructuredOutputs

MSGS = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return ChatRequest(messages=MSGS, max_tokens=4, **kw)


def completion(**kw):
    return CompletionRequest(prompt="hi", max_tokens=4, **kw)


def test_openai_fields_that_change_nothing_are_taken_and_named_in_order():
    body = chat(store=True, metadata={"job": "7"}, service_tier="auto",
                parallel_tool_calls=False, prediction={"type": "content", "content": "x"},
                prompt_cache_key="k", safety_identifier="u", user="alice",
                tools=[], tool_choice="none", functions=None, function_call="none",
                response_format={"type": "text"}, modalities=["text"], audio=None,
                web_search_options=None, reasoning_effort=None, verbosity=None)
    assert check_fields(body, CHAT_REFUSED) == [
        "store", "metadata", "service_tier", "prediction", "prompt_cache_key",
        "safety_identifier", "functions", "function_call", "modalities", "audio",
        "web_search_options", "reasoning_effort", "verbosity"]
    # `user`, `response_format`, `tools`, `tool_choice`, `parallel_tool_calls`: read
    assert body.params().max_tokens == 4  # the sampling is the request's own
    assert check_fields(completion(suffix="", best_of=1, store=False),
                        COMPLETION_REFUSED) == ["suffix", "best_of", "store"]
    assert check_fields(completion(n=3, best_of=3), COMPLETION_REFUSED) == ["best_of"]
    assert check_fields(chat(), CHAT_REFUSED) == []


@pytest.mark.parametrize("kw, name, words", [
    ({"functions": [{"name": "f"}]}, "functions", "send `tools`"),
    ({"function_call": {"name": "f"}}, "function_call", "send `tool_choice`"),
    ({"functions": [{"name": "x" * 200}]}, "functions", "..."),  # a long value is cut
    ({"modalities": ["text", "audio"]}, "modalities", "text only"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio", "text only"),
    ({"web_search_options": {}}, "web_search_options", "no web search"),
    ({"reasoning_effort": "low"}, "reasoning_effort", "no reasoning setting"),
    ({"verbosity": "high"}, "verbosity", "no verbosity setting"),
])
def test_chat_fields_that_would_change_the_answer_are_refused_by_name(kw, name, words):
    with pytest.raises(ValueError) as e:
        check_fields(chat(**kw), CHAT_REFUSED, "ignore")  # refused under either mode
    assert str(e.value).startswith(f"{name}: ") and words in str(e.value)
    assert len(str(e.value)) < 200


@pytest.mark.parametrize("kw, name, words", [
    ({"suffix": "end"}, "suffix", "insertion"),
    ({"best_of": 2}, "best_of", "best_of > n"),
    ({"n": 2, "best_of": 4}, "best_of", "use n"),
    ({"tools": []}, "tools", "not a field of this request"),  # chat's, not completions'
])
def test_completion_fields_refused_by_name(kw, name, words):
    with pytest.raises(ValueError) as e:
        check_fields(completion(**kw), COMPLETION_REFUSED)
    assert str(e.value).startswith(f"{name}: ") and words in str(e.value)


def test_unknown_fields_are_refused_unless_the_server_ignores_them():
    body = chat(max_token=100, store=True)  # a typo of max_tokens
    with pytest.raises(ValueError, match="^max_token: not a field of this request .* "
                                         "--unknown-fields ignore"):
        check_fields(body, CHAT_REFUSED)
    assert check_fields(body, CHAT_REFUSED, "ignore") == ["max_token", "store"]
    assert body.params().max_tokens == 4  # taken, not read
    # names that shadow the model's own attributes are data, not attributes
    odd = chat(params=1, model_extra=2, model_config=3)
    assert check_fields(odd, CHAT_REFUSED, "ignore") == ["params", "model_extra",
                                                         "model_config"]
    assert odd.params().max_tokens == 4


def test_each_ignored_name_is_logged_once_and_the_log_is_bounded(monkeypatch, caplog):
    monkeypatch.setattr(api_fields, "_logged", set())
    monkeypatch.setattr(api_fields, "_LOG_AT_MOST", 3)
    with caplog.at_level(logging.DEBUG, logger="lamina.server"):
        for _ in range(3):
            check_fields(chat(store=True, functions=[]), CHAT_REFUSED)
        check_fields(chat(a=1, b=2, c=3), CHAT_REFUSED, "ignore")
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 3  # store, functions, a; then b and c at debug only
    assert "'store' (whether OpenAI keeps the completion)" in infos[0]
    assert "'functions' (its value asks for nothing this server lacks)" in infos[1]
    assert "X-Lamina-Ignored-Fields" in infos[2]
    assert [r.getMessage()[:26] for r in caplog.records if r.levelno == logging.DEBUG] == \
        ["ignoring request field 'b'", "ignoring request field 'c'"]
    monkeypatch.setattr(api_fields, "_logged", set())
    with caplog.at_level(logging.INFO, logger="lamina.server"):
        check_fields(chat(**{"x" * 100_000: 1}), CHAT_REFUSED, "ignore")
    assert api_fields._logged == {"x" * 64} and len(caplog.records[-1].getMessage()) < 300


def test_the_mode_is_validated_in_code_and_in_a_deployment_file():
    assert ServerConfig().unknown_fields == "reject"
    with pytest.raises(ValueError, match="unknown_fields must be one of"):
        ServerConfig(unknown_fields="warn")
    assert LaminaConfig.from_dict({"server": {"unknown_fields": "ignore"}}) \
        .server.unknown_fields == "ignore"
    with pytest.raises(ValueError, match="unknown_fields must be one of"):
        LaminaConfig.from_dict({"server": {"unknown_fields": "yes"}})


def test_the_serve_flags_set_the_server_and_clash_with_a_config_file(tmp_path):
    from lamina.entrypoints.cli import _server_config, build_parser

    args = build_parser().parse_args(["serve", "--unknown-fields", "ignore",
                                      "--shutdown-timeout", "5",
                                      "--allowed-origins", "http://localhost:3000", "*",
                                      "--tool-call-parser", "hermes"])
    cfg = _server_config(args)
    assert (cfg.unknown_fields, cfg.allowed_origins, cfg.shutdown_timeout_s,
            cfg.tool_call_parser) == ("ignore", ("http://localhost:3000", "*"), 5.0, "hermes")
    for bad in (-1, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="shutdown_timeout_s must be a number >= 0"):
            ServerConfig(shutdown_timeout_s=bad)
    assert _server_config(build_parser().parse_args(["serve"])) == ServerConfig()
    f = tmp_path / "lamina.yaml"
    f.write_text("server: {allowed_origins: ['http://a.example']}\n")
    assert _server_config(build_parser().parse_args(["serve", "--config", str(f)])) \
        .allowed_origins == ("http://a.example",)
    with pytest.raises(ValueError, match="drop --allowed-origins"):
        _server_config(build_parser().parse_args(["serve", "--config", str(f),
                                                  "--allowed-origins", "http://b"]))
    f.write_text("server: {tool_call_parser: llama3_json}\n")
    assert _server_config(build_parser().parse_args(["serve", "--config", str(f)])) \
        .tool_call_parser == "llama3_json"
    with pytest.raises(ValueError, match="drop --tool-call-parser"):
        _server_config(build_parser().parse_args(["serve", "--config", str(f),
                                                  "--tool-call-parser", "hermes"]))


@pytest.mark.parametrize("cls, base", [(CompletionRequest, {"prompt": "hi"}),
                                       (ChatRequest, {"messages": MSGS})])
def test_a_null_field_is_the_default_as_in_openais_api(cls, base):
    """Every declared field given as null parses as if it were left out (OpenAI's
    fields are nullable; SDKs that send all parameters send null for unset ones)."""
    nullable = [k for k in cls.model_fields if k not in base]
    assert {"temperature", "top_p", "n", "max_tokens", "presence_penalty", "stream",
            "frequency_penalty", "logprobs", "stream_options"} <= set(nullable)
    plain = cls(**base)
    for name in nullable:
        body = cls.model_validate({**base, name: None})
        assert body.params() == plain.params(), name
        assert getattr(body, name) == getattr(plain, name), name
    every = cls.model_validate({**base, **dict.fromkeys(nullable)})
    assert every.params() == plain.params() and every.model_extra == {}
    for name in base:  # a required field stays required
        with pytest.raises(ValueError, match="Field required"):
            cls.model_validate({**base, name: None})


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("kw, want", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputs(json_object=True)),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     StructuredOutputs(json=SCHEMA)),
    ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputs(regex="[0-9]+")),
    ({"guided_json": SCHEMA}, StructuredOutputs(json=SCHEMA)),
    ({"guided_json": '{"type": "object"}'}, StructuredOutputs(json={"type": "object"})),
    ({"guided_choice": ["y", "n"]}, StructuredOutputs(choice=("y", "n"))),
    ({"guided_grammar": 'start: "x"'}, StructuredOutputs(grammar='start: "x"')),
    ({"guided_regex": "a+"}, StructuredOutputs(regex="a+")),
])
def test_structured_output_from_each_spelling(kw, want):
    """OpenAI's response_format, vLLM's structured_outputs and its guided_* fields all
    make the same StructuredOutputs, on chat and completions alike."""
    for body in (chat(**kw), completion(**kw)):
        assert structured_outputs(body) == want
        assert structured_field(body) == (next(iter(kw)) if want else None)


@pytest.mark.parametrize("kw, words", [
    ({"response_format": {"type": "xml"}},
     "response_format: type must be 'text', 'json_object' or 'json_schema', got 'xml'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     "response_format: type json_schema needs json_schema.schema"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs: "),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs: StructuredOutputs takes exactly one of"),
    ({"guided_choice": []}, "guided_choice: choice must be a list of non-empty strings"),
    ({"guided_json": "{oops"}, "guided_json: json is not valid JSON"),
    ({"guided_regex": "a", "guided_choice": ["b"]},
     "guided_choice: structured output is asked for twice (guided_regex, guided_choice)"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs: structured output is asked for twice"),
])
def test_structured_output_refused_by_field_name(kw, words):
    with pytest.raises(ValueError) as e:
        structured_outputs(chat(**kw))
    assert str(e.value).startswith(words), str(e.value)


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: any object


def test_forced_tool_calls_become_a_json_constraint():
    """A named function: its parameters' schema; "required": an array of calls, each
    one tool's name and parameters (one call without parallel calls); no tools or
    tool_choice "none": a text answer. The answer's text -> OpenAI's tool_calls."""
    named = tool_calling([WEATHER, NOW], {"type": "function", "function": {"name": "now"}},
                         None)
    assert named.spec == StructuredOutputs(json={"type": "object"})
    (call,) = named.calls('{"x": 1}')
    assert call["type"] == "function" and call["function"] == {"name": "now",
                                                               "arguments": '{"x": 1}'}
    assert named.finish_reason == "stop"
    req = tool_calling([WEATHER, NOW], "required", False)
    schema = req.spec.json
    assert schema["maxItems"] == 1 and schema["minItems"] == 1
    assert [a["properties"]["name"] for a in schema["items"]["anyOf"]] == [
        {"const": "weather"}, {"const": "now"}]
    assert "maxItems" not in tool_calling([WEATHER], "required", None).spec.json
    calls = req.calls('[{"name": "weather", "parameters": {"city": "Oslo"}},'
                      ' {"name": "now", "parameters": {}}]')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] \
        == [("weather", {"city": "Oslo"}), ("now", {})]
    assert len({c["id"] for c in calls}) == 2 and req.finish_reason == "tool_calls"
    assert req.calls('[{"name": "weather", "param') is None  # cut by max_tokens
    assert tool_calling(None, None, None) is None
    assert tool_calling([WEATHER], "none", None) is None
    assert structured_field(chat(tools=[WEATHER], tool_choice="required")) == "tool_choice"


@pytest.mark.parametrize("tools, choice, words", [
    ([WEATHER], None, "tool_choice: 'auto' (the default when tools are given) needs a parser"),
    ([WEATHER], {"type": "function"}, "tool_choice: 'none', 'auto', 'required' or"),
    ([WEATHER], "auto", "tool_choice: 'auto' (the default when tools are given)"),
    ([WEATHER], "sometimes", "tool_choice: 'none', 'auto', 'required' or"),
    (None, "required", "tool_choice: names a tool call, but the request has no tools"),
    ([WEATHER], {"type": "function", "function": {"name": "rain"}},
     "tool_choice: names 'rain', not one of the tools (weather)"),
    ([{"type": "function"}], "required", "tools: tool 0 must be"),
    ([{"type": "retrieval", "function": {"name": "a"}}], "required", "tools: tool 0 must be"),
    ([WEATHER, WEATHER], "required", "tools: the name 'weather' is given twice"),
    ([{"type": "function", "function": {"name": "a", "parameters": [1]}}], "required",
     "tools: tool 0's function.parameters must be a JSON schema object"),
])
def test_tool_fields_refused_by_name(tools, choice, words):
    with pytest.raises(ValueError) as e:
        tool_calling(tools, choice, None)
    assert str(e.value).startswith(words), str(e.value)


def test_earlier_calls_written_for_a_template_without_them():
    turn = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3 C"}]
    shown = history_for_template(turn, "{{ message['content'] }}")
    assert shown[1] == {"role": "assistant", "content":
                        '[{"name": "weather", "parameters": {"city": "Oslo"}}]'}
    assert shown[0] == turn[0] and shown[2] == turn[2]
    assert history_for_template(turn, "{% for c in message.tool_calls %}") == turn
