"""OpenAI's Responses API (`/v1/responses`) driven by the official `openai` client (local
executor, SmolLM2, uvicorn on loopback): the answer is HF's greedy tokens for the chat
prompt the input makes; usage counts the prompt and answer; `previous_response_id`
continues a stored conversation (the prompt is the whole history, the first turn's KV
reused), retrieve and delete; the client's streaming helper assembles the same answer
from well-formed, numbered events; structured output through the client's `parse`;
function tools forced, "auto" read by the server's parser, results sent back as
`function_call_output`; fields this server cannot honour refused by name."""
import json
import time

import openai
import pydantic
import pytest
import torch

from lamina.entrypoints.api_server import ServerConfig
from lamina.entrypoints.llm import chat_prompt

from .test_server_limits import KEY, _KeyServer, _loop

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20}}, "required": ["city"],
               "additionalProperties": False}}


@pytest.fixture(scope="module")
def srv(smol, smol_packed):
    loop = _loop(smol, smol_packed)
    s = _KeyServer(loop, smol.tokenizer, ServerConfig(api_key=KEY, tool_call_parser="hermes",
                                                      max_stored_responses=3))
    yield s
    s.stop()
    loop.shutdown()


def _hf(smol, messages, new):
    """HF greedy on the chat prompt the conversation makes -> (prompt ids, text)."""
    ids = smol.tokenizer(chat_prompt(smol.tokenizer, messages))["input_ids"]
    with torch.no_grad():
        t = torch.tensor([ids])
        out = smol.model.generate(t, attention_mask=torch.ones_like(t), do_sample=False,
                                  max_new_tokens=new,
                                  pad_token_id=smol.tokenizer.eos_token_id)[0, len(ids):]
    return ids, smol.tokenizer.decode(out, skip_special_tokens=True)


def test_answers_and_conversations_are_hfs(srv, smol):
    """A string input with instructions: HF's greedy text for [system, user]; usage
    counts its prompt; cut by max_output_tokens: "incomplete". The next turn with
    previous_response_id: HF's text for the whole history, most of its prompt cached;
    the stored response retrieved as returned; deleted, it is a 404 and a 400 naming
    previous_response_id; past max_stored_responses the oldest are dropped. Each
    stored response lists its input items back (`input_items`)."""
    cl = srv.client()
    first = [{"role": "system", "content": "Answer in one sentence."},
             {"role": "user", "content": "What is the capital of France?"}]
    r = cl.responses.create(model="smollm2", instructions=first[0]["content"],
                            input=first[1]["content"], max_output_tokens=24, temperature=0)
    ids, text = _hf(smol, first, 24)
    assert r.output_text == text and r.object == "response" and r.id.startswith("resp_")
    assert (r.usage.input_tokens, r.usage.total_tokens) == (len(ids),
                                                            len(ids) + r.usage.output_tokens)
    assert r.status == ("incomplete" if r.usage.output_tokens == 24 else "completed")
    assert [it.type for it in r.output] == ["message"] and r.output[0].role == "assistant"
    second = [{"role": "user", "content": "And of Italy?"}]
    r2 = cl.responses.create(model="smollm2", previous_response_id=r.id, input=second,
                             instructions=first[0]["content"], max_output_tokens=16,
                             temperature=0)
    history = [*first, {"role": "assistant", "content": r.output_text}, *second]
    ids2, text2 = _hf(smol, history, 16)
    assert r2.output_text == text2 and r2.previous_response_id == r.id
    assert r2.usage.input_tokens == len(ids2)
    assert r2.usage.input_tokens_details.cached_tokens >= len(ids) - 16, r2.usage
    assert cl.responses.retrieve(r2.id).model_dump() == r2.model_dump()
    (item,) = cl.responses.input_items.list(r.id).data  # a string: one user message
    assert (item.type, item.role, [(c.type, c.text) for c in item.content]) == (
        "message", "user", [("input_text", first[1]["content"])])
    page = cl.responses.input_items.list(r2.id, order="asc", limit=1)
    assert [c.text for c in page.data[0].content] == ["And of Italy?"] and not page.has_more
    assert cl.responses.delete(r2.id) is None
    with pytest.raises(openai.NotFoundError):
        cl.responses.retrieve(r2.id)
    with pytest.raises(openai.BadRequestError) as e:
        cl.responses.create(model="smollm2", previous_response_id=r2.id, input="Hi",
                            max_output_tokens=2)
    assert e.value.param == "previous_response_id"
    kept = [cl.responses.create(model="smollm2", input="Hi", max_output_tokens=1).id
            for _ in range(3)]  # the store holds 3: r goes
    with pytest.raises(openai.NotFoundError):
        cl.responses.retrieve(r.id)
    assert [cl.responses.retrieve(k).id for k in kept] == kept
    unstored = cl.responses.create(model="smollm2", input="Hi", max_output_tokens=1,
                                   store=False)
    with pytest.raises(openai.NotFoundError):
        cl.responses.retrieve(unstored.id)


def test_streamed_events_assemble_the_same_answer(srv):
    """The client's streaming helper (which checks that each event refers to an item
    and part it was told of) yields the non-streamed text; the events come in the
    Responses order, numbered from 0; cut by max_output_tokens the stream ends with
    "response.incomplete"."""
    cl = srv.client()
    ask = dict(model="smollm2", input="What colour is the sky?", max_output_tokens=100,
               temperature=0)
    whole = cl.responses.create(**ask)
    assert whole.status == "completed", whole.usage
    with cl.responses.stream(**ask) as s:
        events = list(s)
        final = s.get_final_response()
    assert final.output_text == whole.output_text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        whole.output_text
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert cl.responses.retrieve(final.id).output_text == whole.output_text
    cut = list(cl.responses.create(**{**ask, "max_output_tokens": 3}, stream=True))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.status == "incomplete"
    assert cut[-1].response.incomplete_details.reason == "max_output_tokens"
    assert cut[-1].response.usage.output_tokens == 3


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)


def test_structured_output_through_the_clients_parse(srv):
    r = srv.client().responses.parse(model="smollm2", input="Describe Paris as JSON.",
                                     text_format=City, max_output_tokens=60, temperature=0)
    assert isinstance(r.output_parsed, City), r.output_text


def test_function_tools_forced_auto_and_their_results(srv):
    """tool_choice naming the function: a function_call item whose arguments meet its
    schema; its result sent back as function_call_output on the stored conversation
    gives a text answer. "auto" with the hermes parser (the answer held to a call by a
    regex, as a model trained on the format writes it): text and a function_call, alike
    when streamed."""
    cl = srv.client()
    r = cl.responses.create(model="smollm2", input="Weather in Paris?", tools=[WEATHER],
                            tool_choice={"type": "function", "name": "get_weather"},
                            max_output_tokens=40, temperature=0)
    (call,) = [it for it in r.output if it.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert set(json.loads(call.arguments)) == {"city"}
    after = cl.responses.create(model="smollm2", previous_response_id=r.id, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}],
        tools=[WEATHER], tool_choice="none", max_output_tokens=12, temperature=0)
    assert after.output_text and not [it for it in after.output if it.type != "message"]
    (sent,) = cl.responses.input_items.list(after.id).data
    assert (sent.type, sent.call_id, sent.output) == ("function_call_output", call.call_id,
                                                      "18 C")
    regex = ('Checking\\.\\n<tool_call>\\n\\{"name": "get_weather", "arguments": '
             '\\{"city": "(Paris|Oslo)"\\}\\}\\n</tool_call>')
    ask = dict(model="smollm2", input="Weather in Paris?", tools=[WEATHER],
               max_output_tokens=60, temperature=0,
               extra_body={"structured_outputs": {"regex": regex}})
    auto = cl.responses.create(**ask)
    assert [it.type for it in auto.output] == ["message", "function_call"], auto.output
    assert auto.output_text == "Checking." and auto.output[1].name == "get_weather"
    with cl.responses.stream(**ask) as s:
        events = list(s)
        final = s.get_final_response()
    assert [(it.type, getattr(it, "arguments", None)) for it in final.output] == \
        [(it.type, getattr(it, "arguments", None)) for it in auto.output]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [auto.output[1].arguments]


@pytest.mark.parametrize("kw, param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"background": True, "store": False}, "background"),  # polled: so stored
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"extra_body": {"max_output_token": 5}}, "max_output_token"),
])
def test_what_cannot_be_honoured_is_refused_by_name(srv, kw, param):
    args = {"model": "smollm2", "input": "Hi", "max_output_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        srv.client().responses.create(**args)
    assert e.value.param == param, e.value
    assert srv.client().responses.create(model="smollm2", input="Hi",
                                         max_output_tokens=2).status


def _settled(cl, rid: str, until=("completed", "incomplete", "failed", "cancelled"),
             within_s: float = 120.0):
    """The stored response `rid` polled until its status is one of `until`."""
    deadline = time.monotonic() + within_s
    while (r := cl.responses.retrieve(rid)).status not in until:
        assert time.monotonic() < deadline, r
        time.sleep(0.05)
    return r


def _until(cond, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_background_responses_are_polled_cancelled_and_deleted(srv, smol):
    """`background: true`: the Response comes back at once, `queued`, empty; polled, it
    ends with HF's greedy text and usage, and continues as a stored conversation. One
    cancelled while it runs is `cancelled` and stays so, its request aborted and its
    KV freed; one deleted while it runs is aborted too. Cancelling a finished one
    returns it as it is; one answered in its own request cannot be cancelled. Its
    events cannot be resumed (`stream` on GET: a 400 naming it)."""
    cl, loop = srv.client(), srv.loop
    question = [{"role": "user", "content": "What is the capital of France?"}]
    r = cl.responses.create(model="smollm2", input=question[0]["content"],
                            max_output_tokens=24, temperature=0, background=True)
    assert (r.status, r.background, r.output) == ("queued", True, [])
    done = _settled(cl, r.id)
    ids, text = _hf(smol, question, 24)
    assert done.output_text == text and done.usage.input_tokens == len(ids)
    assert done.status == ("incomplete" if done.usage.output_tokens == 24 else "completed")
    assert done.background and done.created_at == r.created_at
    nxt = cl.responses.create(model="smollm2", previous_response_id=r.id, max_output_tokens=8,
                              input="And of Italy?", temperature=0)
    _, text2 = _hf(smol, [*question, {"role": "assistant", "content": text},
                          {"role": "user", "content": "And of Italy?"}], 8)
    assert nxt.output_text == text2
    assert cl.responses.cancel(r.id).model_dump() == done.model_dump()  # finished: as is

    free, aborted = loop.engine.free_slots(), loop.stats["aborted"]
    long = {"model": "smollm2", "input": "Sing.", "max_output_tokens": 900,
            "background": True, "extra_body": {"structured_outputs": {"regex": "(la ){400}"}}}
    running = cl.responses.create(**long)
    _settled(cl, running.id, ("in_progress",))  # its first tokens are out
    cancelled = cl.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and cancelled.id == running.id
    _until(lambda: loop.stats["aborted"] == aborted + 1)  # the engine's next step
    assert cl.responses.retrieve(running.id).status == "cancelled"  # not overwritten
    assert not loop.engine.scheduler.running and loop.engine.free_slots() == free
    gone = cl.responses.create(**long)
    _settled(cl, gone.id, ("in_progress",))
    cl.responses.delete(gone.id)
    _until(lambda: loop.stats["aborted"] == aborted + 2)
    assert loop.engine.free_slots() == free
    with pytest.raises(openai.NotFoundError):
        cl.responses.retrieve(gone.id)
    plain = cl.responses.create(model="smollm2", input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        cl.responses.cancel(plain.id)
    assert e.value.param == "response_id" and "only background responses" in str(e.value)
    with pytest.raises(openai.NotFoundError):
        cl.responses.cancel("resp_none")
    with pytest.raises(openai.BadRequestError) as e:  # not streamed: no events kept
        cl.responses.retrieve(r.id, stream=True)
    assert e.value.param == "stream"


def test_a_streamed_background_response_runs_on_when_its_client_hangs_up(srv, smol):
    """`background` with `stream`: its events as they come; the client hangs up after a
    few deltas and the response runs on; `GET ?stream=true&starting_after=N` sends the
    rest, numbered on from N, to the last, and the deltas together are HF's greedy
    text, which the stored Response holds too."""
    cl = srv.client()
    question = [{"role": "user", "content": "Write a haiku about rivers."}]
    stream = cl.responses.create(model="smollm2", input=question[0]["content"],
                                 max_output_tokens=24, temperature=0, background=True,
                                 stream=True)
    head = []
    for ev in stream:
        head.append(ev)
        if sum(e.type == "response.output_text.delta" for e in head) == 3:
            break
    stream.close()  # hung up: it runs on
    rid = head[0].response.id
    rest = list(cl.responses.retrieve(rid, stream=True,
                                      starting_after=head[-1].sequence_number))
    events = head + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == _hf(smol, question, 24)[1]
    assert rest[-1].type in ("response.completed", "response.incomplete")
    assert rest[-1].response.output_text == text and _settled(cl, rid).output_text == text


def test_a_store_that_is_gone_answers_503_naming_it():
    """A front's loop may bring its deployment's store (a Lamina service's); with the
    service gone, reading, continuing or deleting a stored response is a 503 with the
    store's error, not a 500."""
    from starlette.testclient import TestClient

    from lamina.entrypoints.api_server import build_app
    from lamina.errors import EngineDead

    class GoneStore:
        def bound(self):
            return "the last 8 responses"

        def get(self, rid):
            raise EngineDead("the Lamina service is gone: RayActorError")

        def put(self, rid, item):
            self.get(rid)

        delete = get

    class Loop:  # what the routes below read of a loop
        max_waiting, response_store = None, GoneStore()

    web = TestClient(build_app(Loop(), "smollm2"))
    for r in (web.get("/v1/responses/resp_1"), web.delete("/v1/responses/resp_1"),
              web.post("/v1/responses", json={"input": "Hi", "previous_response_id": "r"})):
        assert r.status_code == 503, r.text
        assert r.json()["error"]["message"] == "the Lamina service is gone: RayActorError"


class DictBacking:
    """A `ResponseBacking` in a dict, its calls logged; those named in `fail` raise."""

    def __init__(self, saved=(), fail=()):
        self.saved, self.calls, self.fail = dict(saved), [], set(fail)

    def _call(self, *call):
        self.calls.append(call)
        if call[0] in self.fail:
            raise ConnectionError("the key-value store does not answer")

    def load(self):
        self._call("load")
        return list(self.saved.items())

    def save(self, rid, item):
        self._call("save", rid)
        self.saved.pop(rid, None)
        self.saved[rid] = item

    def drop(self, rid):
        self._call("drop", rid)
        del self.saved[rid]


def test_a_store_over_a_backing_starts_with_its_responses_and_writes_through(caplog):
    """A service's store (`ResponseStore` over `KVResponses`): it starts with what the
    backing kept (over its capacity, the oldest dropped there too), every put, eviction
    and delete reaches the backing, and a new store over it starts where this one left;
    a backing that fails leaves the responses in memory, each failure logged."""
    from lamina.entrypoints.api_responses import ResponseStore, Stored

    item = {r: Stored({"id": r}, [], r, []) for r in "abcde"}
    b = DictBacking([(r, item[r]) for r in "abc"])  # saved before, the oldest first
    store = ResponseStore(2, b)  # a smaller capacity than they were saved under
    assert b.calls == [("load",), ("drop", "a")] and list(b.saved) == ["b", "c"]
    assert store.get("a") is None and store.get("b") == item["b"]  # b: the latest used
    store.put("d", item["d"])  # evicts c, the least recently used
    assert store.get("c") is None and list(b.saved) == ["b", "d"]
    assert store.delete("b") and not store.delete("b")
    assert b.calls[2:] == [("save", "d"), ("drop", "c"), ("drop", "b")]
    again = ResponseStore(2, b)  # the next process of the service
    assert again.get("d") == item["d"] and again.get("b") is None and b.calls[-1] == ("load",)

    bad = DictBacking(fail={"load", "save", "drop"})
    store = ResponseStore(2, bad)
    store.put("e", item["e"])
    assert store.get("e") == item["e"] and store.delete("e") and store.get("e") is None
    assert bad.calls == [("load",), ("save", "e"), ("drop", "e")]
    assert caplog.text.count("kept in memory only") == 3, caplog.text


def test_a_dead_fronts_running_background_responses_are_failed():
    """`fail_owned`: exactly the responses still running (queued or in progress) on the
    front that died are failed, with the error given, and written through; its
    finished ones, other fronts' and unowned ones are left as they are. `statuses`
    reads them without touching the least-recently-used order."""
    from lamina.entrypoints.api_responses import ResponseStore, Stored

    rows = {"a": ("f1", "in_progress"), "b": ("f1", "completed"), "c": ("f1", "queued"),
            "d": ("f2", "in_progress"), "e": (None, "queued")}
    back = DictBacking([(r, Stored({"id": r, "status": st}, [], r, [], owner))
                        for r, (owner, st) in rows.items()])
    store = ResponseStore(8, back)
    assert store.fail_owned("f1", "its front died") == ["a", "c"]
    assert back.calls[1:] == [("save", "a"), ("save", "c")]
    for r, (_owner, st) in rows.items():
        got = store.get(r).response
        want = {"id": r, "status": st}
        if r in "ac":
            want = {"id": r, "status": "failed",
                    "error": {"code": "server_error", "message": "its front died"}}
        assert got == want and back.saved[r].response == want
    assert store.fail_owned("f1", "again") == []
    assert store.statuses(["a", "b", "zz"]) == {"a": "failed", "b": "completed", "zz": None}
    two = ResponseStore(2)
    for r in "xyz":
        two.put(r, Stored({"id": r, "status": "queued"}, [], r, []))
        assert two.statuses(["x"]) == {"x": "queued" if r != "z" else None}
    assert two.get("y") is not None  # x, read by `statuses` only, was the oldest


def test_a_store_keeps_its_byte_bound_least_recently_used_first(caplog):
    """`max_bytes` bounds the stored responses' JSON together (the whole conversation
    each holds): past it the least recently used go, as past the count; one over it
    alone is not stored (`put` False, logged, nothing written through); a backing saved
    under a larger bound starts trimmed to this one, the least recently saved first."""
    from lamina.entrypoints.api_responses import ResponseStore, Stored

    def item(rid, chars):  # a response whose conversation holds `chars` characters
        return Stored({"id": rid}, [{"role": "user", "content": "x" * chars}], rid, [])

    def size(it):  # independent of the store: the JSON the durable copy writes
        return len(json.dumps({"response": it.response, "messages": it.messages,
                               "session": it.session, "inputs": it.inputs,
                               "owner": it.owner}).encode())

    a, b, c = item("a", 300), item("b", 300), item("c", 500)
    bound = size(a) + size(b) + 10  # a and b fit together, c with either does not
    store = ResponseStore(8, max_bytes=bound)
    assert store.put("a", a) and store.put("b", b) and store.nbytes == size(a) + size(b)
    assert store.get("a") == a  # b is now the least recently used
    assert store.put("c", c) and store.get("b") is None and store.get("a") is None
    assert len(store) == 1 and store.nbytes == size(c)
    big = item("big", bound)
    assert not store.put("big", big) and store.get("big") is None and store.get("c") == c
    assert "big is " in caplog.text and "not stored" in caplog.text
    assert store.bound() == f"the last 8 responses and at most {bound} bytes"

    back = DictBacking([("a", a), ("b", b), ("c", c)])
    again = ResponseStore(8, back, max_bytes=bound)  # c alone fits: a and b dropped
    assert back.calls == [("load",), ("drop", "a"), ("drop", "b")] and len(again) == 1
    assert not again.put("big", big) and back.calls[-1] == ("drop", "b")  # no write


def test_a_response_over_the_stores_bytes_is_answered_unstored(srv, smol):
    """A response larger than `max_stored_response_bytes` alone is answered whole, its
    `store` false (the stream's final event too); retrieving or continuing it names
    the store's bounds. A smaller one on the same server is stored; a background one
    (polled, so it must be stored) is refused."""
    bound = 6000
    small = _KeyServer(srv.loop, smol.tokenizer, ServerConfig(
        api_key=KEY, max_stored_response_bytes=bound))
    try:
        cl = small.client()
        kept = cl.responses.create(model="smollm2", input="Hi", max_output_tokens=2)
        assert kept.store and cl.responses.retrieve(kept.id).id == kept.id
        long = "Say the words back: " + "lamina " * 600  # ~4 KB, twice in a stored one
        r = cl.responses.create(model="smollm2", input=long, max_output_tokens=2)
        assert r.store is False and r.status == "incomplete"
        events = list(cl.responses.create(model="smollm2", input=long, max_output_tokens=2,
                                          stream=True))
        assert events[-1].response.store is False
        for rid in (r.id, events[-1].response.id):
            with pytest.raises(openai.NotFoundError) as e:
                cl.responses.retrieve(rid)
            assert f"keeps the last 1024 responses and at most {bound} bytes" in str(e.value)
        with pytest.raises(openai.BadRequestError) as e:
            cl.responses.create(model="smollm2", previous_response_id=r.id, input="Hi",
                                max_output_tokens=2)
        assert e.value.param == "previous_response_id" and f"{bound} bytes" in str(e.value)
        assert cl.responses.retrieve(kept.id).id == kept.id
        free = srv.loop.engine.free_slots()
        with pytest.raises(openai.BadRequestError) as e:  # polled: it must be stored
            cl.responses.create(model="smollm2", input=long, max_output_tokens=2,
                                background=True)
        assert e.value.param == "background" and "max_stored_response_bytes" in str(e.value)
        _until(lambda: srv.loop.engine.free_slots() == free)  # its request aborted
    finally:
        small.stop()


@pytest.mark.parametrize("slow", ["store", "submit"])
def test_a_service_fronts_slow_calls_leave_its_event_loop_free(slow):
    """Over a service (a `remote` loop) each stored-response, validate, capacity and
    submit call is a round trip to it: the front makes them on a worker thread, so while
    one request waits on a slow one, the front answers the others (here `/health`)."""
    import asyncio
    import threading

    import httpx

    from lamina.entrypoints.api_server import build_app
    from lamina.errors import EngineOverloaded

    entered, release = threading.Event(), threading.Event()

    def stall(*_):
        entered.set()
        release.wait(5)  # without the worker thread: the event loop stalls this long

    class SlowStore:
        def bound(self):
            return "the last 8 responses"

        def get(self, rid):
            stall()

    class Engine:
        def validate(self, *a, **k):
            pass

    class Loop:
        max_waiting, remote, alive, draining = None, True, True, False
        response_store, engine = SlowStore(), Engine()

        def check_capacity(self, extra):
            stall()
            raise EngineOverloaded(waiting=64, limit=64)

    async def main():
        app = build_app(Loop(), "smollm2")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://front") as c:
            request = (c.get("/v1/responses/resp_1") if slow == "store" else
                       c.post("/v1/completions", json={"prompt": [1, 2, 3]}))
            waiting = asyncio.create_task(request)
            for _ in range(500):
                if entered.is_set():
                    break
                await asyncio.sleep(0.01)
            health = await asyncio.wait_for(c.get("/health"), 5)
            answered_first = not waiting.done()
            release.set()
            return health, answered_first, await waiting

    health, answered_first, slow_answer = asyncio.run(main())
    assert entered.is_set() and health.status_code == 200 and answered_first
    assert slow_answer.status_code == (404 if slow == "store" else 429), slow_answer.text
    if slow == "submit":
        assert "64 requests waiting (limit 64)" in slow_answer.json()["error"]["message"]
