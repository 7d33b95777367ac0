"""The HTTP front under hostile input and load, driven by the official `openai` client and
raw sockets (local executor, SmolLM2, uvicorn on loopback): the API key (401), a bad-input
corpus (each case its status, OpenAI's error shape, and a good request right after), a
poison request failing alone (500) among 16 concurrent good ones with HF's tokens, the
bounded queue (429 + Retry-After, nothing lost), and 100 aborted in-flight requests
returning every KV slot."""
import http.client
import json
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from lamina.engine.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.entrypoints.api_server import ServerConfig
from lamina.entrypoints.engine_loop import EngineLoop
from lamina.entrypoints.llm import chat_prompt
from lamina.entrypoints.metrics import EngineMetrics
from lamina.entrypoints.tool_parsers import PARSERS
from lamina.executor.local import LocalExecutor
from lamina.faults import FaultPlan
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig

from .test_isolation import unused_token
from .test_server import _Server

KEY = "sk-lamina-test"
SLOTS = 6000
NEW = 8


def _loop(smol, split, faults=None, max_waiting=None, max_batch=64):
    cfg = EngineConfig(num_kv_slots=SLOTS, max_batch=max_batch, faults=faults)
    mem = MemorySide(KVPool(KVPoolConfig.for_specs(split.attention_specs, SLOTS)))
    ex = LocalExecutor(split, [mem], vocab_size=smol.config.vocab_size, faults=faults)
    eng = LLMEngine(cfg, ex, smol.tokenizer, smol.config)
    return EngineLoop(eng, EngineMetrics(), max_waiting=max_waiting)


class _KeyServer(_Server):
    """The test server with a `ServerConfig`, raw HTTP and an openai client."""

    def raw(self, method, path, body: bytes | None = None, headers=None):
        """-> (status, headers, parsed JSON or raw bytes)."""
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        h.update(headers or {})
        c.request(method, path, body, {k: v for k, v in h.items() if v is not None})
        r = c.getresponse()
        data = r.read()
        c.close()
        try:
            return r.status, dict(r.getheaders()), json.loads(data)
        except ValueError:
            return r.status, dict(r.getheaders()), data

    def client(self, key=KEY, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)


@pytest.fixture(scope="module")
def poison_token(prompts, hf_greedy):
    return unused_token(prompts, hf_greedy)


@pytest.fixture(scope="module")
def srv(smol, smol_packed, poison_token):
    loop = _loop(smol, smol_packed, FaultPlan(compute_token=poison_token))
    cfg = ServerConfig(api_key=KEY, max_body_bytes=64 << 10, max_prompts=8, max_n=4,
                       max_stop=4, max_stop_chars=32, max_logit_bias=8)
    s = _KeyServer(loop, smol.tokenizer, cfg)
    yield s
    s.stop()
    loop.shutdown()


def _good(srv, prompts, hf_greedy):
    """A normal request right after a bad one: served, HF's tokens."""
    r = srv.client().completions.create(model="smollm2", prompt=prompts[0], max_tokens=NEW,
                                        temperature=0)
    assert r.choices[0].model_extra["token_ids"] == hf_greedy[0][:NEW]


def test_api_key_required_on_v1_only(srv, prompts, hf_greedy):
    with pytest.raises(openai.AuthenticationError) as e:
        srv.client(key="wrong").completions.create(model="smollm2", prompt="hi", max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    status, _, body = srv.raw("GET", "/v1/models", headers={"Authorization": None})
    assert status == 401 and body["error"]["type"] == "invalid_request_error"
    assert srv.raw("GET", "/health", headers={"Authorization": None})[0] == 200
    assert [m.id for m in srv.client().models.list()] == ["smollm2"]
    _good(srv, prompts, hf_greedy)


def _body(**kw):
    return json.dumps({"model": "smollm2", "prompt": "Hello", "max_tokens": 2, **kw}).encode()


VOCAB = 49152
BAD_HTTP = [  # (id, path, raw body, status, error param or None, words in the message)
    ("invalid json", "/v1/completions", b'{"prompt": "hi",', 400, None, "JSON"),
    ("not an object", "/v1/completions", b'[1, 2]', 400, None, ""),
    ("invalid utf-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None, ""),
    ("empty body", "/v1/completions", b"", 400, None, ""),
    ("prompt wrong type", "/v1/completions", _body(prompt=3), 400, "prompt", ""),
    # a JSON escape of one UTF-16 surrogate alone: valid JSON, not text (a 500 and a
    # dropped connection once a response echoed it)
    ("lone surrogate", "/v1/completions", b'{"prompt": "ok \\ud800", "max_tokens": 2}', 400,
     "prompt", "prompt: not valid Unicode: a lone surrogate U+D800 at character 3"),
    ("lone surrogate in a key", "/v1/completions",
     b'{"prompt": "ok", "logit_bias": {"\\udc00": 1}}', 400, "logit_bias",
     "logit_bias.\\udc00: not valid Unicode: a lone surrogate U+DC00 at character 0"),
    ("lone surrogate echoed", "/v1/responses",
     b'{"input": "ok", "max_output_tokens": 2, "metadata": {"k": "a\\udfff"}}', 400,
     "metadata", "metadata.k: not valid Unicode: a lone surrogate U+DFFF at character 1"),
    ("nested too deeply", "/v1/completions",
     b'{"prompt": "ok", "stop": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None,
     "body: JSON nested too deeply to read"),
    ("number too long", "/v1/completions", b'{"prompt": "ok", "seed": ' + b"9" * 5000 + b"}",
     400, None, "body: not read: Exceeds the limit (4300 digits)"),
    ("prompt mixed list", "/v1/completions", _body(prompt=[1, "a"]), 400, "prompt", ""),
    ("prompt empty list", "/v1/completions", _body(prompt=[]), 400, "prompt", "empty"),
    ("negative token", "/v1/completions", _body(prompt=[1, -5]), 400, "prompt",
     "non-negative"),
    ("token past vocab", "/v1/completions", _body(prompt=[1, VOCAB + 3]), 400, "prompt",
     f"vocabulary of {VOCAB}"),
    ("float token", "/v1/completions", _body(prompt=[1, 2.5]), 400, "prompt", ""),
    ("too many prompts", "/v1/completions", _body(prompt=["a"] * 9), 400, "prompt",
     "at most 8"),
    ("max_tokens past context", "/v1/completions", _body(max_tokens=9000), 400, "max_tokens",
     "context of 8192"),
    ("max_tokens absurd", "/v1/completions", _body(max_tokens=10 ** 30), 400, "max_tokens",
     ""),
    ("max_tokens float", "/v1/completions", _body(max_tokens=2.5), 400, "max_tokens", ""),
    ("temperature inf", "/v1/completions", _body().replace(b'"max_tokens": 2',
                                                           b'"temperature": Infinity'),
     400, "temperature", ""),
    ("temperature NaN", "/v1/completions", _body().replace(b'"max_tokens": 2',
                                                           b'"temperature": NaN'),
     400, "temperature", ""),
    ("top_p 0", "/v1/completions", _body(top_p=0), 400, "top_p", "(0, 1]"),
    ("n over limit", "/v1/completions", _body(n=5), 400, "n", "at most 4"),
    ("n zero", "/v1/completions", _body(n=0), 400, "n", ">= 1"),
    ("too many stops", "/v1/completions", _body(stop=["a", "b", "c", "d", "e"]), 400, "stop",
     "at most 4"),
    ("stop too long", "/v1/completions", _body(stop="x" * 33), 400, "stop", "32 characters"),
    ("stop empty", "/v1/completions", _body(stop=[""]), 400, "stop", "non-empty"),
    ("logprobs 21", "/v1/completions", _body(logprobs=21), 400, "logprobs", "[0, 20]"),
    ("logit_bias key", "/v1/completions", _body(logit_bias={"x": 1}), 400, "logit_bias",
     "token ids"),
    ("logit_bias value", "/v1/completions", _body(logit_bias={"5": 500}), 400, "logit_bias",
     "[-100, 100]"),
    ("logit_bias past vocab", "/v1/completions", _body(logit_bias={str(VOCAB): 1}), 400,
     "logit_bias", f"vocabulary has {VOCAB}"),
    ("logit_bias too many", "/v1/completions",
     _body(logit_bias={str(i): 1 for i in range(9)}), 400, "logit_bias", "at most 8"),
    ("stop_token_ids past vocab", "/v1/completions", _body(stop_token_ids=[VOCAB]), 400,
     "stop_token_ids", "vocabulary"),
    ("unknown field", "/v1/completions", _body(frobnicate=1), 400, "frobnicate",
     "not a field of this request"),
    ("unknown model", "/v1/completions", _body(model="gpt-9"), 404, "model",
     "`gpt-9` does not exist"),
    ("chat no messages", "/v1/chat/completions",
     json.dumps({"model": "smollm2", "messages": []}).encode(), 400, "messages", ""),
    ("chat bad role type", "/v1/chat/completions",
     json.dumps({"messages": [{"role": 1, "content": "x"}]}).encode(), 400, None, ""),
    ("chat lone surrogate", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     400, "messages", "messages.0.content.0.text: not valid Unicode: a lone surrogate U+DFFF"),
    ("chat top_logprobs alone", "/v1/chat/completions",
     json.dumps({"messages": [{"role": "user", "content": "x"}],
                 "top_logprobs": 2}).encode(), 400, None, "needs logprobs"),
    ("chat unknown model", "/v1/chat/completions",
     json.dumps({"model": "x", "messages": [{"role": "user", "content": "x"}]}).encode(),
     404, "model", "does not exist"),
    ("body over limit", "/v1/completions", _body(prompt="word " * 20000), 413, None,
     "over 65536 bytes"),
    ("unknown route", "/v1/engines", b"{}", 404, None, ""),
]


@pytest.mark.parametrize("case", BAD_HTTP, ids=[c[0] for c in BAD_HTTP])
def test_bad_http_input(srv, prompts, hf_greedy, case):
    _, path, body, status, param, words = case
    got, _, out = srv.raw("POST", path, body)
    assert got == status, out
    err = out["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert param is None or err["param"] == param, err
    assert words in err["message"], err
    _good(srv, prompts, hf_greedy)


def test_chunked_body_over_limit_is_413(srv, prompts, hf_greedy):
    """No Content-Length: the body is counted as it arrives and cut off."""
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    c.putrequest("POST", "/v1/completions")
    for k, v in (("Authorization", f"Bearer {KEY}"), ("Content-Type", "application/json"),
                 ("Transfer-Encoding", "chunked")):
        c.putheader(k, v)
    c.endheaders()
    chunk = b"x" * 16384
    try:
        for _ in range(8):
            c.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        c.send(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server may close before the rest arrives
    r = c.getresponse()
    assert r.status == 413 and b"over 65536 bytes" in r.read()
    c.close()
    _good(srv, prompts, hf_greedy)


def test_openai_client_completions_chat_stream_logprobs(srv, smol, prompts, hf_greedy):
    cl = srv.client()
    r = cl.completions.create(model="smollm2", prompt=prompts[4], max_tokens=NEW,
                              temperature=0, logprobs=2)
    c = r.choices[0]
    assert c.model_extra["token_ids"] == hf_greedy[4][:NEW]
    assert len(c.logprobs.tokens) == NEW and all(len(t) == 2 for t in c.logprobs.top_logprobs)
    assert r.usage.completion_tokens == NEW and r.usage.prompt_tokens == len(prompts[4])
    text = "".join(ch.choices[0].text for ch in cl.completions.create(
        model="smollm2", prompt=prompts[4], max_tokens=NEW, temperature=0, stream=True))
    assert text == c.text
    msgs = [{"role": "user", "content": "Name a colour."}]
    chat = cl.chat.completions.create(model="smollm2", messages=msgs, max_tokens=NEW,
                                      temperature=0, logprobs=True, top_logprobs=3)
    m = chat.choices[0]
    assert m.message.role == "assistant" and len(m.logprobs.content) == len(
        m.model_extra["token_ids"])
    assert all(len(t.top_logprobs) == 3 for t in m.logprobs.content)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in cl.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=NEW, temperature=0, stream=True))
    assert streamed == m.message.content


def test_openai_fields_are_taken_named_or_refused_over_the_openai_client(srv, smol, prompts,
                                                                         hf_greedy):
    """What clients and frameworks send by default (`store`, `metadata`, ...) is taken
    and changes nothing: HF's tokens, the names in the header, streamed too; what would
    change the answer (tools left to "auto", a response_format of an unknown type) is a
    400 naming the field; an unknown field is a 400 unless the server ignores unknown
    fields, and then answers the same."""
    def named(resp):  # the fields a response says it ignored
        return set(resp.headers["x-lamina-ignored-fields"].split(", "))

    cl = srv.client()
    extra = dict(store=True, metadata={"job": "7"}, service_tier="auto", user="alice")
    raw = cl.completions.with_raw_response.create(
        model="smollm2", prompt=prompts[4], max_tokens=NEW, temperature=0,
        extra_body={"store": True, "metadata": {"job": "7"}})
    assert named(raw) == {"store", "metadata"}
    assert raw.parse().choices[0].model_extra["token_ids"] == hf_greedy[4][:NEW]
    msgs = [{"role": "user", "content": "Name a colour."}]
    plain = cl.chat.completions.create(model="smollm2", messages=msgs, max_tokens=NEW,
                                       temperature=0)
    raw = cl.chat.completions.with_raw_response.create(
        model="smollm2", messages=msgs, max_tokens=NEW, temperature=0,
        parallel_tool_calls=False, tool_choice="none", **extra)
    assert named(raw) == {"store", "metadata", "service_tier"}  # the body's order is the
    # client's; parallel_tool_calls and tool_choice "none" are read (no tools: no call)
    assert raw.parse().choices[0].model_extra["token_ids"] == \
        plain.choices[0].model_extra["token_ids"]
    with cl.chat.completions.with_streaming_response.create(
            model="smollm2", messages=msgs, max_tokens=NEW, temperature=0, stream=True,
            **extra) as resp:
        assert named(resp) == {"store", "metadata", "service_tier"}
        text = "".join(ch.choices[0].delta.content or "" for ch in resp.parse())
    assert text == plain.choices[0].message.content
    tool = {"type": "function", "function": {"name": "colour", "parameters": {}}}
    for kw, param in [({"tools": [tool]}, "tool_choice"),  # "auto": no parser here
                      ({"response_format": {"type": "xml"}}, "response_format"),
                      ({"extra_body": {"max_token": 4}}, "max_token")]:
        with pytest.raises(openai.BadRequestError) as e:
            cl.chat.completions.create(model="smollm2", messages=msgs, max_tokens=NEW, **kw)
        assert e.value.param == param, e.value
    with pytest.raises(openai.BadRequestError, match="suffix: insertion"):
        cl.completions.create(model="smollm2", prompt="hi", max_tokens=2, suffix="end")
    lenient = _KeyServer(srv.loop, smol.tokenizer, ServerConfig(api_key=KEY,
                                                                unknown_fields="ignore"))
    try:
        raw = lenient.client().chat.completions.with_raw_response.create(
            model="smollm2", messages=msgs, max_tokens=NEW, temperature=0,
            extra_body={"max_token": 4, "frobnicate": {"x": 1}})
        assert named(raw) == {"max_token", "frobnicate"}
        assert raw.parse().choices[0].model_extra["token_ids"] == \
            plain.choices[0].model_extra["token_ids"]
        with pytest.raises(openai.BadRequestError) as e:  # still refused under "ignore"
            lenient.client().chat.completions.create(model="smollm2", messages=msgs,
                                                     tools=[tool])
        assert e.value.param == "tool_choice"
    finally:
        lenient.stop()
    _good(srv, prompts, hf_greedy)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int
    city: Literal["Paris", "Lyon"]


def test_structured_output_over_the_openai_client(srv, prompts, hf_greedy):
    """OpenAI's `response_format` (a JSON schema: the client's `parse` with a pydantic
    model; a JSON object, streamed), vLLM's `structured_outputs` and `guided_choice`:
    the answers hold (checked by pydantic, `json`, `jsonschema`); a bad regex and two
    fields at once are 400s naming the field; a request right after is HF's."""
    cl = srv.client()
    msgs = [{"role": "user", "content": "Describe a French person as JSON."}]
    r = cl.chat.completions.parse(model="smollm2", messages=msgs, max_tokens=60,
                                  temperature=0, response_format=Person)
    m = r.choices[0]
    assert m.finish_reason == "stop" and isinstance(m.message.parsed, Person), m
    schema = {**Person.model_json_schema(), "additionalProperties": False}  # as `parse` sends
    jsonschema.validate(json.loads(m.message.content), schema)
    text = "".join(ch.choices[0].delta.content or "" for ch in cl.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=60, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}))
    assert text == m.message.content  # streamed: the same tokens
    obj = cl.chat.completions.create(model="smollm2", messages=msgs, max_tokens=60,
                                     temperature=0, response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    pick = cl.completions.create(model="smollm2", prompt="The capital of France is",
                                 max_tokens=8, temperature=0,
                                 extra_body={"guided_choice": ["Paris", "Rome"]})
    assert pick.choices[0].text in ("Paris", "Rome")
    digits = cl.completions.create(model="smollm2", prompt="Pi is about", max_tokens=8,
                                   temperature=0.7, seed=1, n=2, extra_body={
                                       "structured_outputs": {"regex": r" 3\.[0-9]{2}"}})
    assert all(re.fullmatch(r" 3\.[0-9]{2}", c.text) for c in digits.choices), digits
    for extra, param in [({"guided_regex": "a(b"}, "guided_regex"),
                         ({"guided_regex": "a", "response_format": {"type": "json_object"}},
                          "guided_regex"),
                         ({"structured_outputs": {"jsn": {}}}, "structured_outputs")]:
        with pytest.raises(openai.BadRequestError) as e:
            cl.completions.create(model="smollm2", prompt="hi", max_tokens=4,
                                  extra_body=extra)
        assert e.value.param == param, e.value
    _good(srv, prompts, hf_greedy)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 20}}, "required": ["zone"],
        "additionalProperties": False}}}


def test_forced_tool_calls_over_the_openai_client(srv, prompts, hf_greedy):
    """tool_choice naming a function: one call, its arguments valid for its schema
    (`jsonschema`), finish "stop" (OpenAI's for a forced call), streamed alike;
    "required" with parallel_tool_calls false: exactly one call to one of the tools,
    finish "tool_calls"; the call and its result sent back in the next turn are read;
    "auto" (this server was given no parser for the model's own tool-call format), an
    unknown name and a malformed tool are 400s naming the field."""
    cl = srv.client()
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = cl.chat.completions.create(model="smollm2", messages=msgs, max_tokens=40,
                                   temperature=0, tools=[WEATHER, TIME], tool_choice=named)
    m = r.choices[0]
    (call,) = m.message.tool_calls
    assert m.finish_reason == "stop" and m.message.content is None
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    stream = list(cl.chat.completions.create(
        model="smollm2", messages=msgs, max_tokens=40, temperature=0, stream=True,
        tools=[WEATHER, TIME], tool_choice=named))
    deltas = [tc for ch in stream for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == \
        [(0, "get_weather", call.function.arguments)]
    assert stream[-1].choices[0].finish_reason == "stop"
    assert all(not ch.choices[0].delta.content for ch in stream)
    r = cl.chat.completions.create(model="smollm2", messages=msgs, max_tokens=60,
                                   temperature=0, tools=[WEATHER, TIME], tool_choice="required",
                                   parallel_tool_calls=False)
    m = r.choices[0]
    assert m.finish_reason == "tool_calls" and len(m.message.tool_calls) == 1, m
    fn = m.message.tool_calls[0].function
    schema = {"get_weather": WEATHER, "get_time": TIME}[fn.name]["function"]["parameters"]
    jsonschema.validate(json.loads(fn.arguments), schema)
    turn = [*msgs, m.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": m.message.tool_calls[0].id, "content": "18 C"}]
    after = cl.chat.completions.create(model="smollm2", messages=turn, max_tokens=12,
                                       temperature=0, tools=[WEATHER, TIME], tool_choice="none")
    assert after.choices[0].message.content and not after.choices[0].message.tool_calls
    for kw, param in [({"tool_choice": "auto"}, "tool_choice"), ({}, "tool_choice"),
                      ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
                       "tool_choice"),
                      ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools")]:
        with pytest.raises(openai.BadRequestError) as e:
            cl.chat.completions.create(model="smollm2", messages=msgs, max_tokens=4,
                                       **{"tools": [WEATHER], **kw})
        assert e.value.param == param, e.value
    _good(srv, prompts, hf_greedy)


def test_auto_tool_calls_over_the_openai_client(srv, smol, prompts, hf_greedy):
    """With `tool_call_parser="hermes"`, tools left to "auto" (the default): the answer
    is what the completions endpoint writes for the same prompt (the tools listed in the
    system turn) read by the parser; an answer holding a <tool_call> (held to one here
    by a regex, as a model trained on the format writes it) comes back as text and
    calls, finish "tool_calls", alike when streamed (the text first, the call whole at
    the end); parallel_tool_calls false keeps the first call."""
    hermes = _KeyServer(srv.loop, smol.tokenizer,
                        ServerConfig(api_key=KEY, tool_call_parser="hermes"))
    try:
        cl, tools = hermes.client(), [WEATHER, TIME]
        msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
        prompt = chat_prompt(smol.tokenizer, msgs, tools, PARSERS["hermes"])
        plain = cl.completions.create(model="smollm2", prompt=prompt, max_tokens=24,
                                      temperature=0).choices[0]
        r = cl.chat.completions.create(model="smollm2", messages=msgs, max_tokens=24,
                                       temperature=0, tools=tools).choices[0]
        want = PARSERS["hermes"].parse(plain.text, frozenset({"get_weather", "get_time"}))
        assert [(c.function.name, c.function.arguments) for c in
                r.message.tool_calls or []] == list(want.calls)
        assert r.message.content == (want.content.strip() if want.calls else plain.text)
        call = ('<tool_call>\n\\{"name": "get_weather", "arguments": \\{"city": '
                '"(Paris|Oslo)", "unit": "celsius"\\}\\}\n</tool_call>')
        ask = dict(model="smollm2", messages=msgs, max_tokens=120, temperature=0,
                   tools=tools, extra_body={"structured_outputs": {
                       "regex": "Checking\\.\n" + call + "\n" + call}})
        m = cl.chat.completions.create(**ask).choices[0]
        assert m.finish_reason == "tool_calls" and m.message.content == "Checking.", m
        assert [c.function.name for c in m.message.tool_calls] == ["get_weather"] * 2
        for c in m.message.tool_calls:
            assert json.loads(c.function.arguments)["city"] in ("Paris", "Oslo")
        chunks = list(cl.chat.completions.create(stream=True, **ask))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        deltas = [tc for ch in chunks for tc in (ch.choices[0].delta.tool_calls or [])]
        assert text.strip() == "Checking." and chunks[-1].choices[0].finish_reason == \
            "tool_calls"
        assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == \
            [(k, c.function.name, c.function.arguments)
             for k, c in enumerate(m.message.tool_calls)]
        assert [tc for ch in chunks[:-1] for tc in (ch.choices[0].delta.tool_calls or [])] \
            == [] and chunks[0].choices[0].delta.content  # text went out before the end
        one = cl.chat.completions.create(parallel_tool_calls=False, **ask).choices[0]
        assert [(c.function.name, c.function.arguments) for c in one.message.tool_calls] \
            == [(c.function.name, c.function.arguments) for c in m.message.tool_calls[:1]]
    finally:
        hermes.stop()
    _good(srv, prompts, hf_greedy)


def test_browser_origins_only_where_allowed_and_the_model_by_id(srv, smol, prompts,
                                                               hf_greedy):
    """CORS: by default a page elsewhere gets no CORS headers (its preflight is not
    answered); with `allowed_origins` the preflight passes without the API key, an
    answer names the origin and exposes Lamina's header, and another origin is refused.
    `GET /v1/models/{id}` as OpenAI's client retrieves a model."""
    page, other = "http://localhost:3000", "http://evil.example"
    pre = {"Origin": page, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type",
           "Authorization": None}
    status, head, _ = srv.raw("OPTIONS", "/v1/chat/completions", None, pre)
    assert status in (401, 405) and "access-control-allow-origin" not in head
    status, head, _ = srv.raw("POST", "/v1/completions", _body(), {"Origin": page})
    assert status == 200 and "access-control-allow-origin" not in head
    web = _KeyServer(srv.loop, smol.tokenizer, ServerConfig(api_key=KEY,
                                                            allowed_origins=(page,)))
    try:
        status, head, _ = web.raw("OPTIONS", "/v1/chat/completions", None, pre)
        assert status == 200 and head["access-control-allow-origin"] == page
        assert "POST" in head["access-control-allow-methods"]
        status, _, _ = web.raw("OPTIONS", "/v1/chat/completions", None,
                               {**pre, "Origin": other})
        assert status == 400
        status, head, out = web.raw("POST", "/v1/completions", json.dumps(
            {"model": "smollm2", "prompt": prompts[0], "max_tokens": NEW, "temperature": 0,
             "store": True}).encode(), {"Origin": page})
        assert status == 200 and out["choices"][0]["token_ids"] == hf_greedy[0][:NEW]
        assert head["access-control-allow-origin"] == page
        assert "x-lamina-ignored-fields" in head["access-control-expose-headers"].lower()
        status, head, _ = web.raw("POST", "/v1/completions", _body(),
                                  {"Origin": page, "Authorization": None})
        assert status == 401 and head["access-control-allow-origin"] == page  # readable
    finally:
        web.stop()
    cl = srv.client()
    assert cl.models.retrieve("smollm2").id == "smollm2"
    with pytest.raises(openai.NotFoundError) as e:
        cl.models.retrieve("gpt-9")
    assert e.value.code == "model_not_found"


def test_poison_request_fails_alone_over_http(srv, prompts, hf_greedy, poison_token):
    """16 concurrent good requests through the openai client around a request the
    compute side fails: it gets a 500 naming the fault; they get HF's tokens."""
    cl = srv.client()
    eng = srv.loop.engine
    free0 = eng.free_slots()[0]

    def good(i):
        return cl.completions.create(model="smollm2", prompt=prompts[i], max_tokens=NEW,
                                     temperature=0).choices[0].model_extra["token_ids"]

    with ThreadPoolExecutor(17) as pool:
        futs = [pool.submit(good, i) for i in range(8)]
        time.sleep(0.5)
        bad = pool.submit(cl.completions.create, model="smollm2", max_tokens=NEW,
                          prompt=[3, poison_token, 4])
        futs += [pool.submit(good, i) for i in range(8, 16)]
        with pytest.raises(openai.InternalServerError) as e:
            bad.result(300)
        assert e.value.status_code == 500
        assert e.value.body["code"] == "request_failed"
        assert "injected compute fault" in e.value.body["message"]
        assert [f.result(300) for f in futs] == [r[:NEW] for r in hf_greedy]
    assert srv.raw("GET", "/health")[0] == 200 and srv.loop.alive
    deadline = time.time() + 30
    while eng.has_unfinished() and time.time() < deadline:
        time.sleep(0.05)
    assert eng.free_slots()[0] == free0 == SLOTS
    _good(srv, prompts, hf_greedy)


def test_queue_bound_answers_429_and_loses_nothing(smol, smol_packed, prompts, hf_greedy):
    """max_batch 2 and at most 3 waiting: of 24 concurrent requests some are refused with
    429 + Retry-After (the client's typed RateLimitError), every other one succeeds with
    HF's tokens, and the engine's queue never holds more than the bound."""
    loop = _loop(smol, smol_packed, max_waiting=3, max_batch=2)
    s = _KeyServer(loop, smol.tokenizer, ServerConfig(api_key=KEY, max_waiting=3))
    try:
        cl = s.client()

        def one(i):
            try:
                r = cl.completions.create(model="smollm2", prompt=prompts[i % 4],
                                          max_tokens=NEW, temperature=0)
                return i, r.choices[0].model_extra["token_ids"]
            except openai.RateLimitError as e:
                assert e.response.headers["retry-after"] == "1"
                assert e.body["code"] == "server_busy" and "limit 3" in e.body["message"]
                return i, 429

        with ThreadPoolExecutor(24) as pool:
            res = list(pool.map(one, range(24)))
        ok = [(i, t) for i, t in res if t != 429]
        assert len(ok) + sum(t == 429 for _, t in res) == 24  # nothing lost
        assert 0 < len(ok) < 24 and all(t == hf_greedy[i % 4][:NEW] for i, t in ok)
        assert loop.stats["rejected"] == 24 - len(ok)
        assert loop.engine.free_slots()[0] == SLOTS
    finally:
        s.stop()
        loop.shutdown()


def test_hundred_aborts_free_every_slot(srv, prompts):
    """50 streams closed by their client after the first token, and 50 requests aborted
    through `EngineLoop.abort` while running or waiting: every KV slot comes back."""
    loop, eng = srv.loop, srv.loop.engine
    before = loop.stats["aborted"]
    body = json.dumps({"model": "smollm2", "prompt": prompts[1], "max_tokens": 2000,
                       "ignore_eos": True, "temperature": 0, "stream": True}).encode()

    def stream_and_drop(_):
        with socket.create_connection(("127.0.0.1", srv.port), timeout=120) as sk:
            sk.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                       + KEY.encode() + b"\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            got = b""
            while b"data: {" not in got:
                got += sk.recv(4096)

    with ThreadPoolExecutor(25) as pool:
        list(pool.map(stream_and_drop, range(50)))
    from lamina.sampling.params import SamplingParams
    p = SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0)
    futs = [loop.submit(prompts[i % 16], p) for i in range(50)]
    time.sleep(1.0)  # some running, some waiting (max_batch 64 with the streams' leftovers)
    for f in futs:
        loop.abort(f)
    assert all(f.result(120).finish_reason == "abort" for f in futs)
    deadline = time.time() + 120
    while (loop.stats["aborted"] < before + 100 or eng.has_unfinished()) \
            and time.time() < deadline:
        time.sleep(0.1)
    assert loop.stats["aborted"] == before + 100
    assert not eng.has_unfinished() and eng.free_slots()[0] == SLOTS
