"""HTTP server over a real uvicorn socket, local executor on SmolLM2: completions equal
HF greedy, concurrent requests batch, bad input answers 400 naming the field and the
server keeps serving, chat, n > 1, streaming (SSE) equals the plain answer, logprobs, a
disconnected stream is aborted, engine failure answers 503."""
import gc
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

import lamina
from lamina.entrypoints.api_server import build_app
from lamina.entrypoints.engine_loop import EngineLoop
from lamina.entrypoints.metrics import EngineMetrics
from lamina.errors import EngineDead
from lamina.sampling.params import SamplingParams
from tests.conftest import HF_NEW, http_post
from tests.lamina.test_engine import engine as _engine


class _Server:
    def __init__(self, loop, tokenizer, config=None):
        app = build_app(loop, "smollm2", tokenizer, config)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = loop

    def post(self, path, body, headers=None):
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def stream(self, path, body):
        """POST with stream: true; -> the decoded `data:` events, up to [DONE]."""
        req = urllib.request.Request(self.url + path, json.dumps({**body, "stream": True})
                                     .encode(), {"Content-Type": "application/json"})
        events = []
        with urllib.request.urlopen(req, timeout=300) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            for line in r:
                line = line.decode().strip()
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else
                                  json.loads(line[6:]))
        return events

    def get(self, path):
        return _get(self.url + path)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def server(smol, smol_packed):
    loop = EngineLoop(_engine(smol, smol_packed), EngineMetrics())
    srv = _Server(loop, smol.tokenizer)
    srv.loop = loop
    yield srv
    srv.stop()
    loop.shutdown()


def test_completions_match_hf_and_batch_concurrently(server, prompts, hf_greedy):
    pick = [0, 2, 4, 9]
    bodies = [{"prompt": prompts[i], "max_tokens": HF_NEW, "temperature": 0} for i in pick]
    with ThreadPoolExecutor(4) as pool:  # concurrent HTTP requests share engine steps
        res = list(pool.map(lambda b: server.post("/v1/completions", b), bodies))
    for (status, body), i in zip(res, pick):
        assert status == 200, body
        ch = body["choices"][0]
        assert ch["token_ids"] == hf_greedy[i]
        usage = dict(body["usage"])
        cached = usage.pop("prompt_tokens_details")["cached_tokens"]
        assert usage == {"prompt_tokens": len(prompts[i]),
                         "completion_tokens": len(hf_greedy[i]),
                         "total_tokens": len(prompts[i]) + len(hf_greedy[i])}
        assert 0 <= cached < len(prompts[i])  # what the prefix cache served
    status, body = server.post("/v1/completions", {"prompt": [prompts[0], prompts[2]],
                                                   "max_tokens": 8, "temperature": 0})
    assert status == 200 and [c["token_ids"] for c in body["choices"]] == \
        [hf_greedy[0][:8], hf_greedy[2][:8]]


@pytest.mark.parametrize("body,param,words", [
    ({"prompt": ""}, "prompt", "empty prompt"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "positive"),
    ({"prompt": "hi", "temperature": -1}, "temperature", ">= 0"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p", "(0, 1]"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens", "integer"),
    ({"prompt": "hi", "frobnicate": 1}, "frobnicate", "not a field of this request"),
    ({"prompt": [1] * 9000}, "prompt", "context"),
    ({}, "prompt", "Field required"),
    ({"prompt": "hi", "echo": True, "stream": True}, "echo", "not supported with stream"),
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", "[0, 20]"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias", "token ids"),
    ({"prompt": "hi", "session_id": "../x"}, "session_id", "session_id must be"),
    ({"prompt": "hi", "kv_sparsity": "sparse"}, "kv_sparsity", "unknown KV sparsity policy"),
    ({"prompt": "hi", "kv_budget": 0.2}, "kv_budget", "without kv_sparsity changes nothing"),
    ({"prompt": "hi", "kv_sparsity": "topk", "kv_budget": 3}, "kv_budget",
     "does not cover the 4 sinks"),
])
def test_bad_input_is_400_and_server_keeps_serving(server, body, param, words, prompts,
                                                   hf_greedy):
    status, out = server.post("/v1/completions", body)
    assert status == 400, out
    assert out["error"]["param"] == param and words in out["error"]["message"]
    status, out = server.post("/v1/completions", {"prompt": prompts[0], "max_tokens": 4,
                                                  "temperature": 0})
    assert status == 200 and out["choices"][0]["token_ids"] == hf_greedy[0][:4]


def test_nan_temperature_is_400(server):
    req = urllib.request.Request(server.url + "/v1/completions",
                                 b'{"prompt": "hi", "temperature": NaN}',
                                 {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400 and b"temperature" in e.value.read()


def test_chat_n_seed_health_models(server, smol):
    status, h = server.get("/health")
    assert (status, h) == (200, {"status": "ok"})
    assert server.get("/ping") == server.post("/ping", {}) == (200, {"status": "ok"})  # vLLM's
    assert server.get("/version") == (200, {"version": lamina.__version__})
    assert server.get("/v1/models")[1]["data"][0]["id"] == "smollm2"
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 10,
            "temperature": 0.8, "seed": 3, "n": 2}
    s1, a = server.post("/v1/chat/completions", body)
    s2, b = server.post("/v1/chat/completions", body)
    assert s1 == s2 == 200 and len(a["choices"]) == 2
    assert [c["token_ids"] for c in a["choices"]] == [c["token_ids"] for c in b["choices"]]
    c = a["choices"][0]
    assert c["message"]["role"] == "assistant"
    assert c["message"]["content"] == smol.tokenizer.decode(c["token_ids"],
                                                            skip_special_tokens=True)


def test_stream_equals_plain_completion(server, prompts, hf_greedy, smol):
    text = smol.tokenizer.decode(hf_greedy[4], skip_special_tokens=True)
    body = {"prompt": prompts[4], "max_tokens": 64, "temperature": 0,
            "stop": text[len(text) // 2: len(text) // 2 + 6], "logprobs": 2}
    server.post("/v1/completions", body)  # the prompt cached: both below see it so
    status, plain = server.post("/v1/completions", body)
    assert status == 200
    events = server.stream("/v1/completions", {**body, "stream_options":
                                               {"include_usage": True}})
    assert events[-1] == "[DONE]" and events[-2]["usage"] == plain["usage"]
    chunks = [e["choices"][0] for e in events[:-2]]
    want = plain["choices"][0]
    assert "".join(c["text"] for c in chunks) == want["text"]
    assert sum((c["token_ids"] for c in chunks), []) == want["token_ids"]
    assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["stop"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((c["logprobs"][key] for c in chunks), []) == want["logprobs"][key]
    lp = want["logprobs"]
    assert len(lp["tokens"]) == len(want["token_ids"]) and \
        all(len(t) <= 2 for t in lp["top_logprobs"])
    assert lp["text_offset"][:2] == [0, len(lp["tokens"][0])]


def test_chat_stream_and_logprobs(server):
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    status, plain = server.post("/v1/chat/completions", body)
    assert status == 200
    content = plain["choices"][0]["logprobs"]["content"]
    assert len(content) == len(plain["choices"][0]["token_ids"])
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 and
               c["top_logprobs"][0]["token"] == c["token"] for c in content)  # greedy
    events = server.stream("/v1/chat/completions", body)
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert deltas[0]["role"] == "assistant" and "role" not in deltas[-1]
    assert "".join(d["content"] for d in deltas) == plain["choices"][0]["message"]["content"]
    status, out = server.post("/v1/chat/completions", {**body, "logprobs": False})
    assert status == 400 and "top_logprobs" in out["error"]["message"]


def test_spaces_between_special_tokens_is_taken_and_the_text_is_hf_decodes(server, prompts,
                                                                           smol):
    """vLLM's `spaces_between_special_tokens`, with special tokens drawn back to back
    (the only ones allowed) and kept in the text: for both values the request answers,
    its text HF's `decode` of its tokens (no spaces between them, as vLLM's fast
    detokenizer writes them either way)."""
    body = {"prompt": prompts[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "allowed_token_ids": [0, 1], "skip_special_tokens": False}
    for flag in (True, False):
        status, out = server.post("/v1/completions",
                                  {**body, "spaces_between_special_tokens": flag})
        assert status == 200, out
        ch = out["choices"][0]
        assert len(ch["token_ids"]) == 4 and set(ch["token_ids"]) <= {0, 1}
        assert ch["text"] == smol.tokenizer.decode(ch["token_ids"], skip_special_tokens=False)
        assert "<|" in ch["text"] and " " not in ch["text"]


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(server, prompts, smol):
    """vLLM's `return_tokens_as_token_ids`: the same greedy answer, its logprobs' tokens
    and top alternatives named "token_id:<id>" (the ids the answer carries; each
    alternative's id decodes to the text the plain request shows), text offsets counting
    those names as vLLM's do, streamed as whole; a chat's "bytes" stay its tokens' text."""
    def text(name):
        return smol.tokenizer.decode([int(name.removeprefix("token_id:"))])

    body = {"prompt": prompts[0], "max_tokens": 12, "temperature": 0, "logprobs": 2}
    named_body = {**body, "return_tokens_as_token_ids": True}
    server.post("/v1/completions", body)  # the prompt cached: both below see it so
    (s1, plain), (s2, named) = (server.post("/v1/completions", b) for b in (body, named_body))
    assert s1 == s2 == 200
    a, b = plain["choices"][0], named["choices"][0]
    assert (b["text"], b["token_ids"]) == (a["text"], a["token_ids"])
    lp, lq = a["logprobs"], b["logprobs"]
    assert lq["tokens"] == [f"token_id:{t}" for t in a["token_ids"]]
    assert lq["token_logprobs"] == lp["token_logprobs"]
    assert [{text(k): v for k, v in top.items()} for top in lq["top_logprobs"]] == \
        lp["top_logprobs"]
    assert lq["text_offset"] == [sum(map(len, lq["tokens"][:i])) for i in range(12)]
    chunks = [e["choices"][0]["logprobs"] for e in server.stream("/v1/completions",
                                                                   named_body)[:-1]]
    for key in ("tokens", "top_logprobs", "text_offset"):
        assert sum((c[key] for c in chunks), []) == lq[key]

    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    server.post("/v1/chat/completions", chat)
    (s1, plain), (s2, named) = (server.post("/v1/chat/completions", b) for b in
                                (chat, {**chat, "return_tokens_as_token_ids": True}))
    assert s1 == s2 == 200
    ids = named["choices"][0]["token_ids"]
    assert ids == plain["choices"][0]["token_ids"]
    got, want = (r["choices"][0]["logprobs"]["content"] for r in (named, plain))
    assert [c["token"] for c in got] == [f"token_id:{t}" for t in ids]
    assert [(c["bytes"], c["logprob"]) for c in got] == [(c["bytes"], c["logprob"])
                                                         for c in want]
    assert [[(text(t["token"]), t["bytes"], t["logprob"]) for t in c["top_logprobs"]]
            for c in got] == [[(t["token"], t["bytes"], t["logprob"])
                               for t in c["top_logprobs"]] for c in want]


def test_chat_echo_begins_a_continued_answer_with_its_start(server):
    """vLLM's chat `echo`: where the last message is the assistant's begun answer, the
    content is that text and then the same continuation as without echo (streamed as
    whole); after a user's turn, echo changes nothing."""
    begun = [{"role": "user", "content": "Name a colour."},
             {"role": "assistant", "content": [{"type": "text", "text": "My favourite"},
                                               {"type": "text", "text": "colour is"}]}]
    body = {"messages": begun, "max_tokens": 8, "temperature": 0,
            "add_generation_prompt": False, "continue_final_message": True}
    server.post("/v1/chat/completions", body)  # cached: the requests below alike
    (s1, plain), (s2, echo) = (server.post("/v1/chat/completions", b) for b in
                               (body, {**body, "echo": True}))
    assert s1 == s2 == 200
    a, b = plain["choices"][0], echo["choices"][0]
    assert b["token_ids"] == a["token_ids"] and len(a["token_ids"]) > 0
    assert b["message"]["content"] == "My favourite\ncolour is" + a["message"]["content"]
    events = server.stream("/v1/chat/completions", {**body, "echo": True})
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]) == \
        b["message"]["content"]
    user_last = {**body, "messages": begun[:1], "add_generation_prompt": True,
                 "continue_final_message": False}
    server.post("/v1/chat/completions", user_last)
    (s1, plain), (s2, echo) = (server.post("/v1/chat/completions", b) for b in
                               (user_last, {**user_last, "echo": True}))
    assert s1 == s2 == 200 and echo["choices"] == plain["choices"]


def test_chat_content_parts_and_max_completion_tokens(server):
    """What current OpenAI clients send (guidellm among them): text content parts (joined
    by newlines, as vLLM joins them) and `max_completion_tokens`, max_tokens' new name."""
    def chat(content, **kw):
        return server.post("/v1/chat/completions", {
            "messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": content, "name": "ann"}],
            "temperature": 0, "ignore_eos": True, **kw})

    status, plain = chat("Name a colour.\nThen a fruit.", max_tokens=6)
    assert status == 200 and len(plain["choices"][0]["token_ids"]) == 6
    parts = [{"type": "text", "text": "Name a colour."}, {"type": "text", "text": "Then a fruit."}]
    for kw in ({"max_tokens": 6}, {"max_completion_tokens": 6},
               {"max_tokens": 6, "max_completion_tokens": 6}):
        status, out = chat(parts, **kw)
        assert status == 200 and out["choices"][0]["token_ids"] == \
            plain["choices"][0]["token_ids"], kw
    for content, kw, param, words in [
            (parts, {"max_tokens": 6, "max_completion_tokens": 5}, "max_completion_tokens",
             "give one of them"),
            ([{"type": "image_url", "image_url": {"url": "x"}}], {}, "messages",
             "messages.1.content.0: a 'image_url' part"),
            ([{"type": "text"}], {}, "messages", "text parts"),
            (None, {}, "messages", "null is allowed only for the assistant"),
            ("hi", {"response_format": {"type": "json"}}, "response_format", "type must be")]:
        status, out = chat(content, **kw)
        assert status == 400 and out["error"]["param"] == param, out
        assert words in out["error"]["message"], out
    status, out = chat("hi", max_tokens=2, response_format={"type": "text"})
    assert status == 200 and len(out["choices"][0]["token_ids"]) == 2
    model = server.get("/v1/models")[1]["data"][0]
    assert isinstance(model["created"], int) and model["created"] <= time.time()


def test_nulls_for_unset_fields_answer_as_if_left_out(server, prompts, hf_greedy):
    """A client that sends every parameter, null where unset (OpenAI's fields are
    nullable): HF's greedy tokens, and a chat answer equal to the one without them."""
    unset = dict.fromkeys(("top_p", "n", "presence_penalty", "frequency_penalty", "seed",
                           "stop", "logit_bias", "user", "stream", "stream_options",
                           "top_k", "ignore_eos", "repetition_penalty", "stop_token_ids"))
    status, out = server.post("/v1/completions", {
        "prompt": prompts[0], "max_tokens": 6, "temperature": 0, "logprobs": None,
        "echo": None, "suffix": None, "best_of": None, **unset})
    assert status == 200 and out["choices"][0]["token_ids"] == hf_greedy[0][:6], out
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6,
            "temperature": 0}
    status, plain = server.post("/v1/chat/completions", chat)
    status2, nulls = server.post("/v1/chat/completions", {
        **chat, **unset, "logprobs": None, "top_logprobs": None,
        "max_completion_tokens": None, "tools": None, "response_format": None})
    assert status == status2 == 200, nulls
    assert nulls["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]


def test_a_developer_turn_answers_as_a_system_turn(server):
    """OpenAI's `developer` role (sent by clients for newer models) is the system turn
    to SmolLM2's template, which knows no developer: the same greedy tokens."""
    def tokens(role):
        status, out = server.post("/v1/chat/completions", {
            "messages": [{"role": role, "content": "Answer in French."},
                         {"role": "user", "content": "Name a colour."}],
            "max_tokens": 8, "temperature": 0})
        assert status == 200, out
        return out["choices"][0]["token_ids"]

    assert tokens("developer") == tokens("system") != tokens("user")


def test_chat_without_a_cap_runs_to_the_models_context(smol, smol_packed):
    """OpenAI's chat default: no max_tokens means as many as the context leaves (the
    engine resolves None when it takes the request), not completions' 16."""
    from lamina.entrypoints.api_server import ChatRequest

    body = ChatRequest(messages=[{"role": "user", "content": "hi"}])
    assert body.params().max_tokens is None
    eng = _engine(smol, smol_packed)
    rid = eng.add_request([1, 2, 3], body.params())
    assert eng._reqs[rid].seqs[0].params.max_tokens == eng.max_len - 3 == 8189
    rid = eng.add_request([1, 2, 3], replace(body.params(), max_tokens=5))
    assert eng._reqs[rid].seqs[0].params.max_tokens == 5


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_usage_every_event(server, prompts, path):
    """include_usage: events carry `usage: null` and a last event the request's usage;
    with vLLM's continuous_usage_stats each event carries its choice's usage so far."""
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2,
            **({"prompt": prompts[1]} if path == "/v1/completions" else
               {"messages": [{"role": "user", "content": "Count to ten."}]})}
    status, plain = server.post(path, body)
    assert status == 200
    n_prompt = plain["usage"]["prompt_tokens"]  # one prompt (n counts choices)
    for continuous in (False, True):
        events = server.stream(path, {**body, "stream_options": {
            "include_usage": True, "continuous_usage_stats": continuous}})
        assert events[-1] == "[DONE]" and events[-2]["choices"] == []
        assert events[-2]["usage"]["completion_tokens"] == 12  # both choices
        drawn = {0: 0, 1: 0}
        for e in events[:-2]:
            c = e["choices"][0]
            drawn[c["index"]] += len(c["token_ids"])
            assert e["usage"] == ({"prompt_tokens": n_prompt,
                                   "completion_tokens": drawn[c["index"]],
                                   "total_tokens": n_prompt + drawn[c["index"]]}
                                  if continuous else None)
        assert drawn == {0: 6, 1: 6}
    events = server.stream(path, body)  # no stream_options: no usage anywhere
    assert all("usage" not in e for e in events[:-1])


@pytest.mark.parametrize("stream", [True, False])
def test_disconnected_client_is_aborted(server, prompts, stream):
    loop = server.loop
    before = dict(loop.stats)
    body = json.dumps({"prompt": prompts[2], "max_tokens": 4000, "temperature": 0,
                       "ignore_eos": True, "stream": stream}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        if stream:
            got = b""
            while b"data: {" not in got:  # the first token arrived: the request is running
                got += s.recv(4096)
        else:
            deadline = time.time() + 60
            while not loop.engine.has_unfinished() and time.time() < deadline:
                time.sleep(0.05)  # running once the engine holds it
            assert loop.engine.has_unfinished()
    deadline = time.time() + 120
    while loop.stats["aborted"] == before["aborted"] and time.time() < deadline:
        time.sleep(0.1)
    assert loop.stats["aborted"] == before["aborted"] + 1
    assert loop.stats["finished"] == before["finished"]
    while loop.engine.has_unfinished() and time.time() < deadline:
        time.sleep(0.1)
    assert loop.engine.free_slots()[0] == loop.engine.config.num_kv_slots
    # /metrics says so with no step after the abort: nothing runs, no KV is held
    worker0 = (("memory_worker", "0"),)
    while time.time() < deadline:
        m = _metrics(server)
        if m[("lamina_sequences_running", ())] == 0:
            break
        time.sleep(0.1)
    assert m[("lamina_sequences_running", ())] == 0
    assert m[("lamina_kv_slots_used", worker0)] == m[("lamina_kv_slots_cached", worker0)]


class _Broken:
    def execute(self, plan):
        raise RuntimeError("memory worker 1 died")


def _metrics(server) -> dict:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _delta(before: dict, after: dict, name: str, **labels) -> float:
    """How much a sample of /metrics grew between two reads."""
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0) - before.get(key, 0)


def test_metrics_count_tokens_and_requests(server, prompts, hf_greedy):
    before = _metrics(server)
    status, body = server.post("/v1/completions", {"prompt": [prompts[0], prompts[1]],
                                                   "max_tokens": 5, "temperature": 0,
                                                   "ignore_eos": True})
    assert status == 200
    after = _metrics(server)

    def delta(name, **labels):
        return _delta(before, after, name, **labels)

    assert delta("lamina_generation_tokens_total") == body["usage"]["completion_tokens"] == 10
    assert delta("lamina_prompt_tokens_total") == body["usage"]["prompt_tokens"]
    assert delta("lamina_requests_total", finish="length") == 2
    assert delta("lamina_time_to_first_token_seconds_count") == 2
    assert delta("lamina_engine_steps_total") >= 5
    worker0 = (("memory_worker", "0"),)  # nothing running: only cached prefixes live
    assert after[("lamina_kv_slots_used", worker0)] == after[("lamina_kv_slots_cached",
                                                             worker0)]
    assert after[("lamina_sequences_running", ())] == 0
    # the same prompts again: their prefixes come from the cache, and /metrics says so
    status, again = server.post("/v1/completions", {"prompt": [prompts[0], prompts[1]],
                                                    "max_tokens": 5, "temperature": 0,
                                                    "ignore_eos": True})
    before, after = after, _metrics(server)
    hit = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert status == 200 and hit >= len(prompts[0]) + len(prompts[1]) - 2
    assert delta("lamina_prefix_cache_hit_tokens_total") == hit


def test_metrics_time_steps_and_requests(server, prompts):
    """Steps on /metrics against what the client saw: each step timed once, the tokens
    they fed equal to what `usage` says was computed (prompt tokens not from the cache,
    then each drawn token but the last), their parts adding up to their time, all of it
    within the client's wall time; a streamed request's seconds per output token close
    to the gaps between its events at the client."""
    before = _metrics(server)
    t = time.perf_counter()
    status, body = server.post("/v1/completions", {"prompt": [prompts[2], prompts[5]],
                                                   "max_tokens": 6, "temperature": 0,
                                                   "ignore_eos": True})
    wall = time.perf_counter() - t
    after = _metrics(server)

    def delta(name, **labels):
        return _delta(before, after, name, **labels)

    usage = body["usage"]
    fed = (usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
           + usage["completion_tokens"] - 2)
    assert status == 200 and delta("lamina_step_tokens_sum") == fed
    assert delta("lamina_step_seconds_count") == delta("lamina_engine_steps_total") >= 6
    parts = {p: delta("lamina_step_part_seconds_total", part=p)
             for p in ("dense", "attention", "transfer", "sample", "other")}
    assert parts["dense"] > 0 and parts["attention"] > 0 and parts["transfer"] == 0
    assert sum(parts.values()) == pytest.approx(delta("lamina_step_seconds_sum"))
    assert 0 < delta("lamina_step_seconds_sum") < wall
    for name in ("lamina_request_queue_time_seconds", "lamina_time_to_first_token_seconds",
                 "lamina_request_time_per_output_token_seconds"):
        assert delta(name + "_count") == 2 and 0 < delta(name + "_sum") < 2 * wall

    # streamed: the engine's seconds per token against the client's clock
    n, before = 24, after
    req = urllib.request.Request(server.url + "/v1/completions", json.dumps(
        {"prompt": prompts[6], "max_tokens": n, "temperature": 0, "ignore_eos": True,
         "stream": True}).encode(), {"Content-Type": "application/json"})
    arrived = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            if line.startswith(b"data: {"):
                arrived.append(time.perf_counter())
    after = _metrics(server)
    assert len(arrived) == n  # one event a token
    client = (arrived[-1] - arrived[0]) / (n - 1)
    assert delta("lamina_request_time_per_output_token_seconds_count") == 1
    tpot = delta("lamina_request_time_per_output_token_seconds_sum")
    assert tpot == pytest.approx(client, rel=0.25, abs=0.005)


@pytest.fixture
def broken(smol, smol_packed):
    """A server whose executor fails every step (a dead memory worker)."""
    eng = _engine(smol, smol_packed)
    eng.executor = _Broken()
    loop = EngineLoop(eng)
    srv = _Server(loop, smol.tokenizer)
    yield srv
    srv.stop()
    loop.shutdown()


def test_engine_failure_mid_stream_is_an_error_event(broken):
    events = broken.stream("/v1/completions", {"prompt": "hello", "max_tokens": 4})
    assert events[-1] == "[DONE]" and len(events) == 2
    assert "memory worker 1 died" in events[0]["error"]["message"]
    assert broken.get("/health")[0] == 503


def test_engine_failure_fails_requests_loudly(broken):
    status, out = broken.post("/v1/completions", {"prompt": "hello", "max_tokens": 4})
    assert status == 503 and "memory worker 1 died" in out["error"]["message"]
    assert broken.get("/health")[0] == 503
    status, out = broken.post("/v1/completions", {"prompt": "hello", "max_tokens": 4})
    assert status == 503 and "engine stopped" in out["error"]["message"]


def test_echo_and_prompt_logprobs_equal_hf(server, smol, prompts, hf_greedy):
    """echo: the prompt's tokens and logprobs come first (the first token's null), as
    lm-eval-style loglikelihood scoring reads them; prompt_logprobs: vLLM's per-token
    dicts. Both against HF's log-softmax of the full model's logits."""
    ptoks = prompts[1]
    with torch.no_grad():
        ref = torch.log_softmax(smol.model(torch.tensor([ptoks])).logits[0, :-1].double(), -1)
    status, body = server.post("/v1/completions", {"prompt": ptoks, "max_tokens": 2,
                                                   "temperature": 0, "logprobs": 1,
                                                   "echo": True})
    assert status == 200, body
    ch = body["choices"][0]
    assert ch["token_ids"] == ptoks + hf_greedy[1][:2]
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(ptoks) + 2 and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0
    got = torch.tensor(lp["token_logprobs"][1:len(ptoks)], dtype=torch.float64)
    want = ref[torch.arange(len(ptoks) - 1), torch.tensor(ptoks[1:])]
    assert torch.allclose(got, want, atol=1e-4)
    assert ch["text"] == "".join(lp["tokens"])  # the prompt's text, then the completion's
    assert ch["text"].startswith(smol.tokenizer.decode(ptoks))

    status, body = server.post("/v1/completions", {"prompt": ptoks, "max_tokens": 1,
                                                   "temperature": 0, "prompt_logprobs": 2})
    assert status == 200, body
    plp = body["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ptoks) and plp[0] is None
    for t in range(1, len(ptoks)):
        entry = {int(k): v["logprob"] for k, v in plp[t].items()}
        top2 = torch.topk(ref[t - 1], 2).indices.tolist()
        assert set(entry) == {ptoks[t], *top2}
        assert abs(entry[ptoks[t]] - ref[t - 1, ptoks[t]].item()) < 1e-4
    assert body["choices"][0]["logprobs"] is None and body["choices"][0]["token_ids"] == \
        hf_greedy[1][:1]
    # OpenAI clients often send zero penalties explicitly: accepted, and a no-op
    status, body = server.post("/v1/completions", {"prompt": ptoks, "max_tokens": 4,
                                                   "temperature": 0, "presence_penalty": 0,
                                                   "frequency_penalty": 0.0})
    assert status == 200 and body["choices"][0]["token_ids"] == hf_greedy[1][:4]
    status, body = server.post("/v1/completions", {"prompt": ptoks, "max_tokens": 2,
                                                   "temperature": 0,
                                                   "logit_bias": {"42": 100}})
    assert status == 200 and body["choices"][0]["token_ids"] == [42, 42]


def test_session_id_from_the_body_or_the_header(server):
    """A session id rides along (no tiers here: the pool's cache serves the next turn);
    a malformed X-Session-Id header is refused by name."""
    body = {"prompt": "Hello there, how", "max_tokens": 4, "temperature": 0}
    s1, a = server.post("/v1/completions", {**body, "session_id": "chat-1"})
    s2, b = server.post("/v1/completions", body, {"X-Session-Id": "chat-1"})
    assert (s1, s2) == (200, 200) and a["choices"][0]["text"] == b["choices"][0]["text"]
    status, out = server.post("/v1/completions", body, {"X-Session-Id": "no spaces"})
    assert status == 400 and out["error"]["param"] == "session_id"


def test_x_request_id_names_the_answer_and_a_failures_log_line(server, caplog):
    """The client's X-Request-Id comes back as a header and in the completion's id (a
    new one when none is sent, errors included); a failed request's log line names it
    (streamed or not); a malformed one is refused by name."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    raw = client.completions.with_raw_response.create(
        model="smollm2", prompt="Hello there", max_tokens=2, extra_headers={
            "X-Request-Id": "trace-7f/a=1"})
    assert raw.headers["x-request-id"] == "trace-7f/a=1"
    assert raw.parse().id == "cmpl-trace-7f/a=1"
    chat = client.chat.completions.with_raw_response.create(
        model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    made = chat.headers["x-request-id"]
    assert len(made) == 32 and chat.parse().id == f"chatcmpl-{made}"
    bad = {"prompt": "Hello", "max_tokens": 4, "min_tokens": 2, "allowed_token_ids": [2]}
    for stream in (False, True):
        req = urllib.request.Request(server.url + "/v1/completions", json.dumps(
            {**bad, "stream": stream}).encode(), {"Content-Type": "application/json",
                                                  "X-Request-Id": f"fails-{stream}"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                assert stream and r.headers["x-request-id"] == "fails-True"
                assert b"no token may come next" in r.read()
        except urllib.error.HTTPError as e:
            assert not stream and e.code == 500
            assert e.headers["x-request-id"] == "fails-False"
    assert "HTTP request fails-False failed" in caplog.text
    assert "HTTP request fails-True failed" in caplog.text
    status, out = server.post("/v1/completions", {"prompt": "Hi"}, {"X-Request-Id": "a b"})
    assert status == 400 and out["error"]["param"] == "X-Request-Id"


def test_request_kv_sparsity_reaches_the_engine(server, prompts, hf_greedy):
    """`kv_sparsity` / `kv_budget` in the body become the request's own KV policy: a
    budget covering the context answers as HF (the policy runs and keeps every key); a
    streaming budget of 16 tokens on a 200-token prompt answers otherwise."""
    body = {"prompt": prompts[4], "max_tokens": 6, "temperature": 0}
    status, out = server.post("/v1/completions", {**body, "kv_sparsity": "topk",
                                                  "kv_budget": 1.0})
    assert status == 200 and out["choices"][0]["token_ids"] == hf_greedy[4][:6]
    status, out = server.post("/v1/completions", {**body, "kv_sparsity": "streaming",
                                                  "kv_budget": 16})
    assert status == 200 and out["choices"][0]["token_ids"] != hf_greedy[4][:6]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_runs_the_engine_on_the_calling_thread(smol, smol_packed, prompts, hf_greedy):
    """`serve` runs the engine loop on the thread that calls it (the one that built the
    model) and HTTP on another; `shutdown` ends both, and a port already taken is an
    error naming it instead of an engine that serves nobody."""
    from lamina.entrypoints.api_server import serve_loop

    loop = EngineLoop(_engine(smol, smol_packed), thread=False)
    port, ran, done = _free_port(), [], threading.Event()
    real_run = loop.run

    def run(**kw):
        ran.append(threading.current_thread().name)
        real_run(**kw)

    loop.run = run
    caller = threading.Thread(target=lambda: (serve_loop(loop, "smollm2", smol.tokenizer,
                                                         port=port, log_level="warning"),
                                              done.set()), name="the-caller")
    caller.start()
    body = json.dumps({"prompt": prompts[0], "max_tokens": 6, "temperature": 0}).encode()
    for _ in range(300):
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                out = json.loads(r.read())
            break
        except urllib.error.URLError:
            time.sleep(0.1)
    assert out["choices"][0]["token_ids"] == hf_greedy[0][:6] and ran == ["the-caller"]
    loop.shutdown()
    assert done.wait(30) and not loop.alive
    with pytest.raises(EngineDead):  # failed at once, not left waiting
        loop.submit(prompts[0], SamplingParams(max_tokens=2)).result(5)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        refused = EngineLoop(_engine(smol, smol_packed), thread=False)
        with pytest.raises(ValueError, match=f"cannot serve on 127.0.0.1:{busy}: Address "
                                             "already in use"):
            serve_loop(refused, "smollm2", smol.tokenizer, port=busy, log_level="critical")
        assert not refused.alive


def test_beside_returns_or_raises_what_the_client_thread_did(smol, smol_packed, prompts,
                                                              hf_greedy):
    """`beside`: the engine loop on this thread, `fn` on another; fn's result comes back,
    or its exception, and the loop is stopped either way (later submits fail at once)."""
    from lamina.entrypoints.engine_loop import beside

    loop = EngineLoop(_engine(smol, smol_packed), thread=False)
    got = beside(loop, lambda: loop.generate(prompts[1], SamplingParams(max_tokens=5,
                                                                        temperature=0)))
    assert got.outputs[0].token_ids == hf_greedy[1][:5] and not loop.alive
    loop = EngineLoop(_engine(smol, smol_packed), thread=False)

    def broken():
        raise ValueError("the client's own error")

    with pytest.raises(ValueError, match="the client's own error"):
        beside(loop, broken)
    with pytest.raises(EngineDead):
        loop.submit(prompts[0], SamplingParams(max_tokens=2)).result(5)


def test_drain_finishes_what_runs_refuses_new_work_then_stops(smol, smol_packed, prompts,
                                                              hf_greedy):
    """`EngineLoop.drain`: the request already taken ends with HF's tokens, a new one is
    refused at once (503 over HTTP), and the loop stops by itself; a drain that runs out
    fails what is left, naming the timeout."""
    loop = EngineLoop(_engine(smol, smol_packed))
    fut = loop.submit(prompts[3], SamplingParams(max_tokens=HF_NEW, temperature=0))
    loop.drain(300)
    assert loop.draining and loop.alive
    with pytest.raises(EngineDead, match="shutting down: it finishes the requests it has"):
        loop.submit(prompts[0], SamplingParams(max_tokens=2))
    assert fut.result(300).outputs[0].token_ids == hf_greedy[3]
    loop._thread.join(30)
    assert not loop.alive
    loop = EngineLoop(_engine(smol, smol_packed))
    fut = loop.submit(prompts[8], SamplingParams(max_tokens=400, ignore_eos=True))
    loop.drain(0)
    with pytest.raises(EngineDead, match=r"its drain \(0 s\) ended before this request"):
        fut.result(60)
    loop._thread.join(30)
    assert not loop.alive


def test_a_drain_that_runs_out_fails_what_is_left_over_http(smol, smol_packed, prompts):
    """A drain (SIGTERM's) shorter than the requests in flight: the stream ends with an
    error event naming the drain's bound, then [DONE]; the plain request answers 503 with
    the same reason; /health said "shutting down" meanwhile; the loop then stops."""
    loop = EngineLoop(_engine(smol, smol_packed), EngineMetrics())
    srv = _Server(loop, smol.tokenizer)
    try:
        long = {"max_tokens": 4000, "ignore_eos": True, "temperature": 0}
        with ThreadPoolExecutor(2) as pool:
            plain = pool.submit(srv.post, "/v1/completions", {"prompt": prompts[1], **long})
            streamed = pool.submit(srv.stream, "/v1/completions",
                                   {"prompt": prompts[2], **long})
            deadline = time.monotonic() + 120
            while len(loop.engine.scheduler.running) < 2:
                assert time.monotonic() < deadline, "the two requests never ran"
                time.sleep(0.02)
            # what `lamina serve`'s SIGTERM handler calls; 3 s: /health is asked well
            # within it, and 4000 tokens take far longer
            loop.drain(3)
            health = srv.get("/health")
            status, body = plain.result(120)
            events = streamed.result(120)
        reason = "EngineDead: the server shut down: its drain (3 s) ended before this " \
                 "request finished"
        assert health[0] == 503 and "shutting down" in health[1]["error"]["message"]
        assert status == 503 and body["error"]["message"] == f"generation failed: {reason}"
        tokens = [t for e in events[:-2] for t in e["choices"][0]["token_ids"]]
        assert 0 < len(tokens) < 4000
        assert events[-2] == {"error": {"message": f"generation failed: {reason}",
                                        "type": "server_error"}}
        assert events[-1] == "[DONE]"
        loop._thread.join(30)
        assert not loop.alive
    finally:
        srv.stop()
        loop.shutdown()


def _stream_tokens(url: str, body: dict, first: threading.Event, box: dict) -> None:
    """POST a streamed completion; the token ids as they come, then whether [DONE] came."""
    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    box["ids"], box["done"] = [], False
    with urllib.request.urlopen(req, timeout=300) as r:
        for line in r:
            line = line.decode().strip()
            if line == "data: [DONE]":
                box["done"] = True
            elif line.startswith("data: "):
                box["ids"] += json.loads(line[6:])["choices"][0]["token_ids"]
                first.set()


def test_sigterm_drains_the_requests_in_flight_then_exits(prompts, hf_greedy):
    """`lamina serve` sent SIGTERM mid-stream (a rolling update): the stream runs to its
    end with HF's tokens; meanwhile /health and a new request answer 503; then the
    process exits 0 by itself."""
    # (the drain's bound is another test's: here the stream's 96 tokens, ~10 s of steps
    # beside a busy core, end first even on a slow machine)
    proc, url = _serve_process("--executor", "local", "--memory-workers", "1",
                               "--shutdown-timeout", "300")
    try:
        first, box = threading.Event(), {}
        body = {"prompt": prompts[4], "max_tokens": 96, "ignore_eos": True,
                "temperature": 0}
        streamer = threading.Thread(target=_stream_tokens, args=(
            url + "/v1/completions", body, first, box))
        streamer.start()
        assert first.wait(120)
        proc.send_signal(signal.SIGTERM)  # handled between the engine's steps
        deadline = time.monotonic() + 60
        while (health := _get(url + "/health"))[0] == 200:
            assert time.monotonic() < deadline and not box.get("done")
            time.sleep(0.05)
        assert health[0] == 503 and "shutting down" in health[1]["error"]["message"]
        req = urllib.request.Request(url + "/v1/completions", json.dumps(
            {"prompt": "hi", "max_tokens": 2}).encode(), {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == 503 and b"shutting down" in e.value.read()
        streamer.join(300)
        assert box["done"] and len(box["ids"]) == 96
        assert box["ids"][:len(hf_greedy[4])] == hf_greedy[4]
        assert proc.wait(120) == 0
        assert "SIGTERM: finishing the requests in flight" in proc.stdout.read()
    finally:
        proc.kill()
        proc.wait()


def _serve_process(*args: str) -> tuple[subprocess.Popen, str]:
    """`lamina serve ARGS --port 0` in a process of its own, once healthy -> (it, its URL);
    its output stays readable from `proc.stdout`."""
    proc = subprocess.Popen([sys.executable, "-m", "lamina.entrypoints.cli", "--threads",
                             "1", "serve", *args, "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            m = re.search(r"on http://127\.0\.0\.1:(\d+) \(", line)
            if m:
                break
        else:
            raise AssertionError(f"no serving line (exit code {proc.wait(30)})")
        url = f"http://127.0.0.1:{m.group(1)}"
        _wait_healthy(url)
        return proc, url
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def _wait_healthy(url: str) -> None:
    for _ in range(600):
        try:
            if _get(url + "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server never answered /health")


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_an_app_that_is_gone_keeps_nothing_of_its_engine_alive():
    """FastAPI caches the endpoints it has classified at module level (4096 of each):
    routes that held their handlers' object strongly kept the engine loop, and with a
    real one the engine's KV pools, alive after the app was gone (in this file each
    server's engine, ~360 MB, stayed to the end of the run)."""
    from starlette.testclient import TestClient

    class Loop:  # what /health and /v1/models read of a loop
        max_waiting, alive, draining = None, True, False

    loop = Loop()
    gone = weakref.ref(loop)
    with TestClient(build_app(loop, "smollm2")) as web:  # classified: routes served
        assert web.get("/health").json() == {"status": "ok"}
        assert web.get("/v1/models").json()["data"][0]["id"] == "smollm2"
        assert "/v1/completions" in web.get("/openapi.json").json()["paths"]
    del loop, web
    gc.collect()
    assert gone() is None


def test_the_loop_hands_freed_memory_back_each_time_it_goes_idle(smol, smol_packed, prompts,
                                                                 monkeypatch):
    """glibc keeps what a long-running server frees (`benchmarks/server_rss_probe.py`):
    the loop calls `malloc_trim` once each time it goes idle after work; while requests
    run, only once `TRIM_BUSY_S` has passed since the last call, between steps (under a
    load that never lets it go idle, the RSS crept on); LAMINA_MALLOC_TRIM=0: off."""
    from lamina.entrypoints import engine_loop

    assert engine_loop._malloc_trim() is not None  # glibc's, here
    monkeypatch.setenv("LAMINA_MALLOC_TRIM", "0")
    engine_loop._malloc_trim.cache_clear()
    assert engine_loop._malloc_trim() is None
    engine_loop._malloc_trim.cache_clear()
    monkeypatch.delenv("LAMINA_MALLOC_TRIM")
    eng = _engine(smol, smol_packed)
    busy: list[bool] = []  # at each call: whether the engine held a request
    at: list[float] = []  # and when
    monkeypatch.setattr(engine_loop, "_malloc_trim", lambda: lambda pad: (
        busy.append(eng.has_unfinished()), at.append(time.monotonic()))[0] or 1)
    loop = EngineLoop(eng, thread=False)
    p = SamplingParams(max_tokens=8, temperature=0)
    burst = [loop.submit(prompts[i], p) for i in range(3)]  # queued: taken in one go
    running = threading.Thread(target=loop.run, daemon=True)

    def settled(n: int) -> list[bool]:
        deadline = time.monotonic() + 30
        while len(busy) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # idle on: no further call
        return busy

    try:
        running.start()
        for f in burst:
            f.result(timeout=300)
        assert settled(1) == [False]  # one call for the burst, once it ended
        loop.generate(prompts[3], p, 300)
        assert settled(2) == [False, False]
        # as if 30 s were 0.2 s (raising=False: the code before had none, and failed below)
        monkeypatch.setattr(engine_loop, "TRIM_BUSY_S", 0.2, raising=False)
        t0 = time.monotonic()
        long = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        loop.generate(prompts[5], long, 300)
        took, calls = time.monotonic() - t0, settled(3)[2:]
        # every 0.2 s of the request a call between its steps, then one as it ended
        assert calls[-1] is False and all(calls[:-1]) and len(calls) >= 2, (took, calls)
        assert len(calls) - 1 <= took / 0.2 + 1, (took, calls)
        gaps = [b - a for a, b in zip(at[2:], at[3:])]
        assert all(g >= 0.2 for g in gaps[:-1]), gaps
    finally:
        loop.shutdown()
        running.join(10)


def test_tokenize_counts_what_the_routes_feed_the_engine(server, smol, prompts):
    """vLLM's /tokenize: a prompt's count and ids are the `prompt_tokens` a completion
    reports for it, and a chat's (with a tool) the chat route's; token strings and the
    context come along; /detokenize gives the text back. Bad input: 400 naming the
    field, 404 for another model."""
    tok = smol.tokenizer
    text = tok.decode(prompts[3])
    status, body = server.post("/tokenize", {"prompt": text, "return_token_strs": True})
    assert status == 200 and body["max_model_len"] == 8192
    assert body["tokens"] == tok(text)["input_ids"] and body["count"] == len(body["tokens"])
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    status, done = server.post("/v1/completions", {"prompt": text, "max_tokens": 1})
    assert status == 200 and done["usage"]["prompt_tokens"] == body["count"]
    tool = {"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    chat = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Weather in Oslo?"}], "tools": [tool]}
    status, body = server.post("/tokenize", chat)
    status2, done = server.post("/v1/chat/completions", {**chat, "max_tokens": 1,
                                                         "tool_choice": "required"})
    assert status == status2 == 200 and body["count"] == done["usage"]["prompt_tokens"]
    assert body["token_strs"] is None
    status, open_turn = server.post("/tokenize", {**chat, "add_generation_prompt": False})
    assert status == 200 and open_turn["count"] < body["count"]
    assert body["tokens"][:open_turn["count"]] == open_turn["tokens"]
    status, body = server.post("/detokenize", {"tokens": prompts[3]})
    assert status == 200 and body == {"prompt": tok.decode(prompts[3])}
    for path, bad, param in (
            ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
             "prompt"),
            ("/tokenize", {}, "prompt"),
            ("/tokenize", {"messages": [{"role": "user"}], "tools": [tool]}, "messages"),
            ("/tokenize", {"prompt": "a", "tools": [tool]}, "tools"),
            ("/tokenize", {"messages": [{"content": "no role"}]}, "messages"),
            ("/tokenize", {"prompt": "a", "frobnicate": 1}, "frobnicate"),
            ("/detokenize", {"tokens": [1, smol.config.vocab_size]}, "tokens"),
            ("/detokenize", {"tokens": "abc"}, "tokens")):
        status, body = server.post(path, bad)
        assert status == 400 and body["error"]["param"] == param, (bad, body)
    status, body = server.post("/tokenize", {"model": "other", "prompt": "a"})
    assert status == 404 and body["error"]["code"] == "model_not_found"


def test_use_beam_search_answers_hf_num_beams(server, smol):
    """vLLM's `use_beam_search` (completions, and chat through the `openai` client): the
    `n` choices a prompt are HF's num_beams beams, best first, with their logprobs."""
    import openai

    from tests.lamina.test_beam_search import hf_beams

    tok = smol.tokenizer
    texts = ["The capital of France is", "Memory is"]
    status, out = server.post("/v1/completions", {
        "prompt": texts, "use_beam_search": True, "n": 3, "max_tokens": 8,
        "logprobs": 2, "length_penalty": 0.5, "seed": 7})
    assert status == 200, out
    got = out["choices"]
    assert [c["index"] for c in got] == list(range(6))
    ids = [tok(t)["input_ids"] for t in texts]
    for k, p in enumerate(ids):
        want, _ = hf_beams(smol.model, p, 3, 8, length_penalty=0.5)
        assert [c["token_ids"] for c in got[3 * k:3 * k + 3]] == want
        for c in got[3 * k:3 * k + 3]:
            assert c["text"] == tok.decode(c["token_ids"])
            assert all(len(t) == 2 for t in c["logprobs"]["top_logprobs"])
    assert out["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in got)
    assert out["usage"]["prompt_tokens"] == sum(map(len, ids))

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Name a color."}]
    chat = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=10,
                                          n=2, extra_body={"use_beam_search": True})
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    want, _ = hf_beams(smol.model, tok(prompt, add_special_tokens=False)["input_ids"], 2, 10)
    assert [c.message.content for c in chat.choices] == [
        tok.decode(w[:-1] if w[-1] == 2 else w) for w in want]
    assert [c.finish_reason for c in chat.choices] == [
        "stop" if w[-1] == 2 else "length" for w in want]


@pytest.mark.parametrize("extra, param", [
    ({"stream": True}, "stream"), ({"temperature": 0.7}, "temperature"),
    ({"stop": ["."]}, "stop"), ({"n": 11}, "n"), ({"top_p": 0.5}, "top_p"),
    ({"echo": True, "logprobs": 1}, "echo"), ({"early_stopping": "soon"}, "early_stopping"),
    ({"session_id": "chat-1"}, "session_id"),
])
def test_use_beam_search_refuses_what_it_cannot_honour(server, extra, param):
    status, out = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 4,
                                                  "use_beam_search": True, "n": 2, **extra})
    assert status == 400 and out["error"]["param"] == param, out
    status, out = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2,
                                                  "use_beam_search": True, "n": 2})
    assert status == 200 and len(out["choices"]) == 2


def test_an_autoscaled_server_takes_a_prompt_longer_than_its_pool(tmp_path, prompts,
                                                                  hf_greedy):
    """`lamina serve --config` (its engine loop on the main thread) with one memory
    worker of 100 slots, autoscaled up to 3: a 200-token prompt over HTTP is taken, as it
    fits three pools; the pool grows at the next sample and the answer is HF's greedy
    tokens, /metrics counting 3 workers. A 301-token prompt is refused, 400 naming the
    pools at the ceiling."""
    cfg = tmp_path / "lamina.yaml"
    cfg.write_text("engine: {num_memory_workers: 1, num_kv_slots: 100}\n"
                   "cluster: {executor: local}\n"
                   "autoscale: {max_memory_workers: 3, interval_s: 0.2}\n")
    proc, url = _serve_process("--config", str(cfg))
    try:

        def post(prompt):
            return http_post(url + "/v1/completions", {"prompt": prompt, "max_tokens": HF_NEW,
                                                       "temperature": 0}, timeout=300)

        status, body = post(prompts[5])
        assert status == 200 and body["choices"][0]["token_ids"] == hf_greedy[5]
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            assert "lamina_memory_workers 3.0" in r.read().decode()
        status, body = post(prompts[6] + [1])
        assert status == 400 and body["error"]["message"].endswith(
            "prompt has 301 tokens; the KV pools hold 300 at the most memory workers they "
            "may grow to (3)"), body
    finally:
        proc.kill()
        proc.wait()
