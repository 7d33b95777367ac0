"""OpenAI's Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`) as a
front on the chat path: a request becomes a chat request, its answer a Response.

Data in: a Responses request (`input` as a string or items: messages, `function_call`,
`function_call_output`; `instructions`, `max_output_tokens`, `text.format`, function
`tools`, `tool_choice`, `previous_response_id`, `store`, `stream`). Data out: the chat
request that answers it (`to_chat`: messages, structured output, tools in chat's shape;
a `ValueError` naming the Responses field otherwise), the Response object made of the
chat completion (`to_response`), and with `stream` the Responses event stream made of
the chat stream's chunks (`response_events`: created, output items and their parts,
text deltas, function call arguments, completed).

Stored responses (`store`, OpenAI's default) keep their conversation in `ResponseStore`,
an in-memory LRU bounded by count and by bytes: `previous_response_id` continues it, and
the chain's first response id is the request's `session_id`, so with KV tiers each
turn's KV is kept for the next (`lamina.engine.sessions`); without them the prefix cache
reuses what is still in the pools. A local server's restart forgets stored responses (a 400 naming
`previous_response_id`). Over a Lamina service (`lamina serve --service`), the store is
the service's: every HTTP front of that deployment reads and continues the same
responses, and a copy in Ray's key-value store (`ResponseBacking`, cluster/service.py)
carries them through the service's restarts.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

log = logging.getLogger(__name__)

# Responses fields that would change the answer: accepted only with a value that asks
# for nothing this server lacks (as `api_fields.CHAT_REFUSED`)
RESPONSES_REFUSED: dict[str, tuple[Any, str]] = {
    "conversation": (lambda v, b: v is None, "conversations are not supported by this "
                                             "server; use previous_response_id"),
    "prompt": (lambda v, b: v is None, "stored prompt templates are not supported by this "
                                       "server"),
    "reasoning": (lambda v, b: v is None or not v.get("effort"),
                  "this model has no reasoning setting"),
    "max_tool_calls": (lambda v, b: v is None, "max_tool_calls is not supported by this "
                                               "server; use parallel_tool_calls"),
    "truncation": (lambda v, b: v in (None, "disabled"),
                   "only 'disabled' (a conversation longer than the context is a 400)"),
}


PENDING = ("queued", "in_progress")  # a background response's statuses while it runs


@dataclass
class Stored:
    response: dict  # the Response object as returned
    messages: list[dict]  # the conversation in chat's shape, answer included, no instructions
    session: str  # the chain's first response id
    inputs: list[dict]  # this request's input items, as `input_items` lists them
    owner: str | None = None  # a running background response's front (its lease id)


def input_items(items) -> list[dict]:
    """A request's `input` as OpenAI lists it back (`GET /v1/responses/{id}/input_items`):
    items with ids, a string as one user message of one input_text part."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user",
                  "content": [{"type": "input_text", "text": items}]}]
    out = []
    for it in items:
        it = {"type": "message", **it}
        if it["type"] == "message" and isinstance(it.get("content"), str):
            kind = "output_text" if it.get("role") == "assistant" else "input_text"
            it["content"] = [{"type": kind, "text": it["content"]}]
        prefix = {"message": "msg", "function_call": "fc"}.get(it["type"], "fco")
        out.append({"id": new_id(prefix), **it})
    return out


def listed(items: list[dict], limit: int, order: str, after: str | None) -> dict:
    """OpenAI's list page: `order` "asc" or "desc", `limit` items after the id `after`."""
    seq = items if order == "asc" else items[::-1]
    if after is not None:
        at = next((k for k, it in enumerate(seq) if it["id"] == after), None)
        if at is None:
            raise ValueError(f"after: no input item {after!r} in this response")
        seq = seq[at + 1:]
    page = seq[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(seq) > limit}


class ResponseBacking(Protocol):
    """A durable copy of a `ResponseStore` (writes go through it; a new store loads it)."""

    def load(self) -> list[tuple[str, Stored]]:
        """The responses saved and not dropped, least recently saved first."""

    def save(self, rid: str, item: Stored) -> None: ...

    def drop(self, rid: str) -> None: ...


def stored_bytes(item: Stored) -> int:
    """What a stored response costs its store: its JSON's bytes (what a durable copy
    writes), the whole conversation included, so a chain's turns grow with it."""
    return len(json.dumps(asdict(item)).encode())


class ResponseStore:
    """The last `capacity` stored responses, at most `max_bytes` of them together
    (`stored_bytes`), least recently used dropped first; a response larger than
    `max_bytes` alone is not stored (`put` says so). With a `backing`, it starts with
    the backing's responses (least recently saved dropped first from then on) and every
    put, drop and delete is written through to it; a backing that fails leaves the
    response in memory only (logged), never the request failed."""

    def __init__(self, capacity: int, backing: ResponseBacking | None = None,
                 max_bytes: int | None = None):
        self.capacity, self.max_bytes = capacity, max_bytes
        self._items, self._sizes = OrderedDict[str, Stored](), dict[str, int]()
        self._lock = threading.Lock()
        self._backing = backing
        if backing is not None:
            saved = self._through(backing.load) or []  # under other bounds, maybe
            for rid, item in saved:
                self._items[rid], self._sizes[rid] = item, stored_bytes(item)
            self._evict()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        """The stored responses' bytes together."""
        return sum(self._sizes.values())

    def bound(self) -> str:
        """What the store keeps, in words (for the errors that name a dropped one)."""
        most = f" and at most {self.max_bytes} bytes" if self.max_bytes is not None else ""
        return f"the last {self.capacity} responses{most}"

    def get(self, rid: str) -> Stored | None:
        with self._lock:
            got = self._items.get(rid)
            if got is not None:
                self._items.move_to_end(rid)
            return got

    def put(self, rid: str, item: Stored) -> bool:
        """Stores `item` (the least recently used dropped past the bounds) -> False
        where it alone is over `max_bytes` (then not stored, a warning logged)."""
        size = stored_bytes(item)
        if self.max_bytes is not None and size > self.max_bytes:
            log.warning("stored responses: %s is %d bytes, over the store's %d alone; not "
                        "stored (it cannot be continued or retrieved)", rid, size,
                        self.max_bytes)
            return False
        with self._lock:  # the backing's writes under it too: in the memory's order
            self._items[rid], self._sizes[rid] = item, size
            self._items.move_to_end(rid)
            self._write("save", rid, item)
            self._evict()
        return True

    def statuses(self, rids: list[str]) -> dict[str, str | None]:
        """{id: its Response's status, None where not stored}, without touching their
        places in the LRU order."""
        with self._lock:
            return {rid: (it.response.get("status") if (it := self._items.get(rid))
                          is not None else None) for rid in rids}

    def fail_owned(self, owner: str, error: str) -> list[str]:
        """The background responses still running on the front `owner` (it died) marked
        failed with `error` -> their ids."""
        with self._lock:
            ids = [rid for rid, it in self._items.items() if it.owner == owner and
                   it.response.get("status") in PENDING]
            for rid in ids:
                it = self._items[rid]
                self._items[rid] = replace(it, response={
                    **it.response, "status": "failed",
                    "error": {"code": "server_error", "message": error}})
                self._sizes[rid] = stored_bytes(self._items[rid])
                self._write("save", rid, self._items[rid])
            self._evict()
        return ids

    def delete(self, rid: str) -> bool:
        with self._lock:
            found = self._items.pop(rid, None) is not None
            if found:
                del self._sizes[rid]
                self._write("drop", rid)
            return found

    def _evict(self) -> None:
        """The least recently used dropped until both bounds hold."""
        total = self.nbytes
        while len(self._items) > self.capacity or (
                self.max_bytes is not None and total > self.max_bytes):
            old, _ = self._items.popitem(last=False)
            total -= self._sizes.pop(old)
            self._write("drop", old)

    def _write(self, op: str, *args) -> None:
        if self._backing is not None:
            self._through(getattr(self._backing, op), *args)

    @staticmethod
    def _through(fn, *args):
        """`fn(*args)`, a backing's call; its failure logged, None returned."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - the store goes on in memory
            log.warning("stored responses: the durable copy's %s%s failed (%s: %s); kept "
                        "in memory only", fn.__name__, f" of {args[0]}" if args else "",
                        type(e).__name__, e)
            return None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content, where: str) -> str:
    """A message's content (a string or input_text / output_text parts) -> its text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}: a string or a list of text parts, got {str(content)[:80]}")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind not in ("input_text", "output_text", "text") or not isinstance(
                part.get("text"), str):
            raise ValueError(f"{where}.{j}: a {kind!r} part; this server reads text parts "
                             f"(input_text, output_text) only")
        texts.append(part["text"])
    return "\n".join(texts)


def input_messages(items) -> list[dict]:
    """`input` -> chat messages: a string is one user turn; message items keep their
    role; a run of `function_call` items is one assistant turn's `tool_calls` (joined to
    the assistant text just before it); `function_call_output` is a `tool` turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ValueError("input: a string or a non-empty list of items")
    out: list[dict] = []
    for i, it in enumerate(items):
        kind = it.get("type", "message") if isinstance(it, dict) else None
        if kind == "message" and it.get("role") in ("user", "system", "developer",
                                                    "assistant"):
            out.append({"role": it["role"],
                        "content": _text_of(it.get("content"), f"input.{i}.content")})
        elif kind == "function_call" and all(isinstance(it.get(k), str) for k in
                                             ("call_id", "name", "arguments")):
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1] = {**out[-1], "tool_calls": [*out[-1].get("tool_calls", []), call]}
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output" and isinstance(it.get("call_id"), str):
            output = it.get("output")
            out.append({"role": "tool", "tool_call_id": it["call_id"],
                        "content": output if isinstance(output, str) else
                        _text_of(output, f"input.{i}.output")})
        else:
            raise ValueError(f"input.{i}: a message (role user, system, developer or "
                             f"assistant), function_call or function_call_output item; "
                             f"got {str(it)[:80]}")
    return out


def _chat_tools(tools, tool_choice) -> tuple[list | None, Any]:
    """Responses' flat function tools and tool_choice -> chat's nested ones."""
    out = None
    if tools:
        out = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise ValueError(f"tools.{i}: this server runs function tools only, got "
                                 f"{str(t)[:80]}")
            out.append({"type": "function", "function": {
                k: t[k] for k in ("name", "description", "parameters") if k in t}})
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function" or not isinstance(tool_choice.get("name"),
                                                                   str):
            raise ValueError(f"tool_choice: 'none', 'auto', 'required' or {{'type': "
                             f"'function', 'name': ...}}, got {str(tool_choice)[:80]}")
        tool_choice = {"type": "function", "function": {"name": tool_choice["name"]}}
    return out, tool_choice


def _response_format(text) -> dict | None:
    """`text.format` -> chat's `response_format`."""
    fmt = (text or {}).get("format") if isinstance(text, dict) else None
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "answer"), "schema": fmt.get("schema")}}
    return fmt  # json_object, or a type the chat path refuses by name


# chat's field names in an error -> the Responses request's own
_FIELDS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text", "messages": "input"}


def responses_field(name: str | None) -> str | None:
    return _FIELDS.get(name, name) if name else name


@dataclass(frozen=True)
class ChatCall:
    """What the chat path is asked, and what the answer is stored with."""

    body: dict  # a chat request's JSON
    history: list[dict]  # the conversation before this input (chat's shape)
    messages: list[dict]  # this request's own input (chat's shape), no instructions
    session: str | None  # the chain's first response id (None: not continuing one)


def to_chat(req, previous: Stored | None) -> ChatCall:
    """A Responses request (and the stored response it continues) -> the chat request
    answering it; ValueError naming the Responses field."""
    history = list(previous.messages) if previous is not None else []
    messages = input_messages(req.input)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    streamed = req.stream or bool(req.background)  # a background one reads its events
    tools, choice = _chat_tools(req.tools, req.tool_choice)
    body: dict[str, Any] = {
        "messages": system + history + messages, "temperature": req.temperature,
        "top_p": req.top_p, "top_k": req.top_k, "seed": req.seed,
        "max_completion_tokens": req.max_output_tokens, "tools": tools,
        "tool_choice": choice, "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text), "stream": streamed,
        "logprobs": req.top_logprobs is not None or "message.output_text.logprobs" in (
            req.include or []),
        "top_logprobs": req.top_logprobs,
        "stream_options": {"include_usage": True} if streamed else None,
        "structured_outputs": req.structured_outputs, "user": req.user,
        "priority": req.priority or None}
    return ChatCall({k: v for k, v in body.items() if v is not None}, history, messages,
                    previous.session if previous is not None else None)


def _logprobs(lps: dict | None) -> list:
    return (lps or {}).get("content") or []


def output_items(message: dict, logprobs: dict | None, msg_id: str) -> list[dict]:
    """A chat answer's message -> the Response's output items: a message with its text
    (if any), then a function_call item per tool call."""
    items: list[dict] = []
    if message.get("content") or not message.get("tool_calls"):
        items.append({"type": "message", "id": msg_id, "status": "completed",
                      "role": "assistant", "content": [{
                          "type": "output_text", "text": message.get("content") or "",
                          "annotations": [], "logprobs": _logprobs(logprobs)}]})
    for tc in message.get("tool_calls") or []:
        items.append(function_call_item(tc))
    return items


def function_call_item(tc: dict) -> dict:
    return {"type": "function_call", "id": "fc_" + tc["id"].removeprefix("call_"),
            "call_id": tc["id"], "name": tc["function"]["name"],
            "arguments": tc["function"]["arguments"], "status": "completed"}


def usage(chat_usage: dict | None) -> dict | None:
    if chat_usage is None:
        return None
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat_usage.get(
                "prompt_tokens_details", {}).get("cached_tokens", 0)},
            "output_tokens": chat_usage["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def response_object(rid: str, req, model: str, output: list, finish: str | None,
                    chat_usage: dict | None, status: str | None = None) -> dict:
    """The Response object; `finish`: the chat answer's finish reason."""
    cut = finish == "length"
    return {
        "id": rid, "object": "response", "created_at": int(time.time()), "model": model,
        "status": status or ("incomplete" if cut else "completed"),
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "error": None, "output": output, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id,
        "temperature": req.temperature, "top_p": req.top_p,
        "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled",
        "store": req.store, "background": bool(req.background),
        "metadata": req.metadata or {}, "user": req.user, "usage": usage(chat_usage)}


def answer_message(output: list[dict]) -> dict:
    """The Response's output as the assistant turn the next request continues from."""
    text = "".join(p["text"] for it in output if it["type"] == "message"
                   for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function",
              "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in output if it["type"] == "function_call"]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls}
                                                               if calls else {})}


class _Events:
    """Numbers each event (`sequence_number`) and frames it as server-sent events."""

    def __init__(self):
        self.n = 0

    def __call__(self, kind: str, **fields) -> str:
        ev = {"type": kind, "sequence_number": self.n, **fields}
        self.n += 1
        return f"event: {kind}\ndata: {json.dumps(ev)}\n\n"


async def response_events(chunks: AsyncIterator[str], rid: str, req, model: str,
                          done) -> AsyncIterator[str]:
    """The chat stream's `data:` chunks -> the Responses event stream; `done(response)`
    (a coroutine function) is awaited with the final Response (to store it) before
    `response.completed`. A background one is created `queued` (as its first answer)."""
    ev, msg_id = _Events(), new_id("msg")
    yield ev("response.created", response=response_object(
        rid, req, model, [], None, None, "queued" if req.background else "in_progress"))
    yield ev("response.in_progress", response=response_object(rid, req, model, [], None,
                                                              None, "in_progress"))
    text, lps, calls, finish, chat_usage, opened = "", [], [], None, None, False
    try:
        async for raw in chunks:
            if not raw.startswith("data: {"):
                continue  # [DONE]
            chunk = json.loads(raw[len("data: "):])
            if "error" in chunk:
                failed = response_object(rid, req, model, [], None, None, "failed")
                failed["error"] = {"code": "server_error",
                                   "message": chunk["error"]["message"]}
                yield ev("response.failed", response=failed)
                return
            chat_usage = chunk.get("usage") or chat_usage
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                piece = delta.get("content") or ""
                if piece:
                    if not opened:
                        opened = True
                        for e in _open_message(ev, msg_id):
                            yield e
                    text += piece
                    new_lps = _logprobs(choice.get("logprobs"))
                    lps += new_lps
                    yield ev("response.output_text.delta", item_id=msg_id, output_index=0,
                             content_index=0, delta=piece, logprobs=new_lps)
                calls += delta.get("tool_calls") or []
                finish = choice.get("finish_reason") or finish
    finally:
        await chunks.aclose()  # a client gone: the chat stream aborts its request
    output = []
    if opened:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": lps}
        item = {"type": "message", "id": msg_id, "status": "completed",
                "role": "assistant", "content": [part]}
        yield ev("response.output_text.done", item_id=msg_id, output_index=0,
                 content_index=0, text=text, logprobs=lps)
        yield ev("response.content_part.done", item_id=msg_id, output_index=0,
                 content_index=0, part=part)
        yield ev("response.output_item.done", output_index=0, item=item)
        output.append(item)
    for tc in calls:
        item, k = function_call_item(tc), len(output)
        yield ev("response.output_item.added", output_index=k,
                 item={**item, "arguments": "", "status": "in_progress"})
        yield ev("response.function_call_arguments.delta", item_id=item["id"],
                 output_index=k, delta=item["arguments"])
        yield ev("response.function_call_arguments.done", item_id=item["id"],
                 output_index=k, arguments=item["arguments"], name=item["name"])
        yield ev("response.output_item.done", output_index=k, item=item)
        output.append(item)
    final = response_object(rid, req, model, output, finish, chat_usage)
    await done(final)
    kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
    yield ev(kind, response=final)


def _open_message(ev, msg_id: str) -> list[str]:
    return [ev("response.output_item.added", output_index=0, item={
                "type": "message", "id": msg_id, "status": "in_progress",
                "role": "assistant", "content": []}),
            ev("response.content_part.added", item_id=msg_id, output_index=0,
               content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                      "logprobs": []})]
