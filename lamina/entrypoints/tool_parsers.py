"""Tool calls read from a model's own output: `tool_choice` "auto" on /v1/chat/completions.

Data in: an answer's text (whole, or as streamed deltas) and the request's tool names.
Data out: `Parsed` (the text left over, and the calls as (name, arguments JSON) pairs),
or per streamed delta the text that is surely not part of a call.

With "auto" the model decides whether to call a tool, and says so in the format its
family was trained on; the operator names that format (`lamina serve
--tool-call-parser NAME`, as vLLM's flag of the same name):

  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number, text
               around them (Hermes 2/3, Qwen 2/2.5/3, SmolLM2/3; a JSON list inside one
               tag, SmolLM2's form, is read too)
  llama3_json  the whole answer is {"name": ..., "parameters": {...}}, several joined by
               ";", after an optional <|python_tag|> (Llama 3.1/3.2/3.3)
  mistral      text, then [TOOL_CALLS] and a JSON list of {"name", "arguments"}, or
               [TOOL_CALLS]name[ARGS]{...} repeated (Mistral's newer tokenizers)
  pythonic     the whole answer is [f(a=1), g(b="x")] (Llama 3.2/4's "pythonic" prompts)

A call is read only if it parses, names one of the request's tools, and its arguments
are a JSON object; otherwise the answer is text, whole (a client never gets a call to a
function it did not define, and never loses text it could read). A template that does
not show tools to the model (it never mentions `tools`) gets the format's own system
prompt listing them (`system_prompt`), and earlier calls in the history are written in
the format (`format_calls`), so the model sees the convention it is asked to follow.

Streaming (`ToolStream`): text is sent as it comes until it could be the start of a call
(a marker, or for whole-answer formats the answer's first character); from there it is
held, and at the end the held text becomes calls (sent whole, in the last chunk) or text.
"""
from __future__ import annotations

import ast
import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

Call = tuple[str, str]  # (function name, arguments as a JSON object's text)


@dataclass(frozen=True)
class Parsed:
    content: str  # the answer without its calls (unstripped; "" when nothing is left)
    calls: tuple[Call, ...]  # empty: the answer is text


class ToolParser(ABC):
    """One family's tool-call format. `markers`: strings a call region starts with;
    `leading`: calls only at the answer's start (then the whole answer is calls)."""

    name = ""
    markers: tuple[str, ...] = ()
    leading = False

    def parse(self, text: str, names: frozenset[str] | None = None) -> Parsed:
        """text -> the calls in it and the text around them; no calls (the answer as
        text, whole) when any call region fails to parse or names no tool in `names`."""
        try:
            content, raw = self._split(text)
            calls = tuple(_call(n, a, names) for n, a in raw)
        except (ValueError, TypeError, KeyError, SyntaxError, AttributeError):
            return Parsed(text, ())
        return Parsed(content, calls) if calls else Parsed(text, ())

    @abstractmethod
    def _split(self, text: str) -> tuple[str, list[tuple[Any, Any]]]:
        """text -> (the text outside calls, [(name, arguments)]); raises on a bad region."""

    @abstractmethod
    def format_calls(self, calls: list[tuple[str, dict]]) -> str:
        """Calls written as this family's model writes them (for earlier turns)."""

    @abstractmethod
    def system_prompt(self, tools: list[dict]) -> str:
        """The system prompt that lists `tools` in this family's words."""


def _call(name, args, names: frozenset[str] | None) -> Call:
    if isinstance(args, str):
        args = json.loads(args)
    if not isinstance(name, str) or not isinstance(args, dict) or (
            names is not None and name not in names):
        raise ValueError(f"not a call to one of the tools: {name!r}")
    return name, json.dumps(args, ensure_ascii=False)


def _tool_lines(tools: list[dict]) -> str:
    return "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)


class Hermes(ToolParser):
    name, markers = "hermes", ("<tool_call>",)
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def _split(self, text):
        raw: list[tuple[Any, Any]] = []
        for m in self._block.finditer(text):
            got = json.loads(m.group(1))
            for c in got if isinstance(got, list) else [got]:
                raw.append((c["name"], c.get("arguments", c.get("parameters", {}))))
        return self._block.sub("", text), raw

    def format_calls(self, calls):
        return "\n".join("<tool_call>\n" + json.dumps({"name": n, "arguments": a},
                                                      ensure_ascii=False) + "\n</tool_call>"
                         for n, a in calls)

    def system_prompt(self, tools):  # Qwen2.5's template's words
        return ("# Tools\n\nYou may call one or more functions to assist with the user "
                "query.\n\nYou are provided with function signatures within <tools></tools> "
                f"XML tags:\n<tools>\n{_tool_lines(tools)}\n</tools>\n\nFor each function "
                "call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
                "\"arguments\": <args-json-object>}\n</tool_call>")


class Llama3Json(ToolParser):
    name, markers, leading = "llama3_json", ("<|python_tag|>", "{"), True

    def _split(self, text):
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            raise ValueError("not a call")
        dec, raw, at = json.JSONDecoder(), [], 0
        while at < len(body):  # objects joined by ";" (a ";" inside a string is no join)
            c, at = dec.raw_decode(body, at)
            raw.append((c["name"], c.get("parameters", c.get("arguments", {}))))
            rest = body[at:].lstrip()
            if rest and not rest.startswith(";"):
                raise ValueError("text after a call")
            at = len(body) - len(rest[1:].lstrip()) if rest else len(body)
        return "", raw

    def format_calls(self, calls):
        return "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False)
                         for n, a in calls)

    def system_prompt(self, tools):  # Llama 3.1's template's words
        return ("Given the following functions, please respond with a JSON for a function "
                "call with its proper arguments that best answers the given prompt.\n\n"
                "Respond in the format {\"name\": function name, \"parameters\": dictionary "
                "of argument name and its value}. Do not use variables.\n\n"
                + _tool_lines(tools))


class Mistral(ToolParser):
    name, markers = "mistral", ("[TOOL_CALLS]",)

    def _split(self, text):
        head, sep, calls = text.partition("[TOOL_CALLS]")
        if not sep:
            return text, []
        calls = calls.strip()
        if calls.startswith("["):  # [{"name": ..., "arguments": {...}}, ...]
            got = json.JSONDecoder().raw_decode(calls)
            if calls[got[1]:].strip():
                raise ValueError("text after the calls")
            return head, [(c["name"], c["arguments"]) for c in got[0]]
        raw = []  # name[ARGS]{...}, each after its own [TOOL_CALLS]
        for part in ("[TOOL_CALLS]" + calls).split("[TOOL_CALLS]")[1:]:
            name, sep, args = part.partition("[ARGS]")
            if not sep:
                raise ValueError("a call without [ARGS]")
            raw.append((name.strip(), json.loads(args)))
        return head, raw

    def format_calls(self, calls):
        return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls],
                                           ensure_ascii=False)

    def system_prompt(self, tools):
        return ("[AVAILABLE_TOOLS]" + json.dumps(tools, ensure_ascii=False)
                + "[/AVAILABLE_TOOLS]\nTo call tools, answer [TOOL_CALLS] followed by a JSON "
                "list of {\"name\": ..., \"arguments\": {...}}.")


class Pythonic(ToolParser):
    name, markers, leading = "pythonic", ("<|python_start|>", "["), True

    def _split(self, text):
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>")
        tree = ast.parse(body.strip(), mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            raise ValueError("not a list of calls")
        raw = []
        for c in tree.elts:
            if not isinstance(c, ast.Call) or not isinstance(c.func, ast.Name) or c.args:
                raise ValueError("a call must be name(keyword=value, ...)")
            raw.append((c.func.id, {k.arg: ast.literal_eval(k.value) for k in c.keywords}))
        return "", raw

    def format_calls(self, calls):
        return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")"
                               for n, a in calls) + "]"

    def system_prompt(self, tools):  # Llama 3.2's pythonic prompt
        return ("You are an expert in composing functions. You are given a question and a set "
                "of possible functions. Based on the question, you may make one or more "
                "function/tool calls to achieve the purpose. If you decide to invoke any of "
                "the function(s), you MUST put it in the format of [func_name1(params_name1="
                "params_value1, params_name2=params_value2...), func_name2(params)]. You "
                "SHOULD NOT include any other text in the response if you call a function.\n"
                "Here is a list of functions in JSON format that you can invoke:\n"
                + json.dumps(tools, ensure_ascii=False, indent=2))


PARSERS: dict[str, ToolParser] = {p.name: p for p in (Hermes(), Llama3Json(), Mistral(),
                                                       Pythonic())}


def tool_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(PARSERS)}, got {name!r}")
    return PARSERS[name]


class ToolStream:
    """One streamed choice under "auto": `feed(new text)` -> the text to send now;
    `finish()` -> (the rest of the text to send, the calls)."""

    def __init__(self, parser: ToolParser, names: frozenset[str] | None):
        self.parser, self.names = parser, names
        self.text, self.sent = "", 0  # all text so far; how much of it was sent
        self.held = False  # a call region may have begun: nothing more is sent

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.held:
            return ""
        if self.parser.leading:
            head = self.text.lstrip()
            if not head:
                return ""
            if any(m.startswith(head[:len(m)]) for m in self.parser.markers):
                self.held = True
                return ""
            return self._send(len(self.text))  # text: no call can begin later
        at = min((i for i in (self.text.find(m, self.sent) for m in self.parser.markers)
                  if i >= 0), default=-1)
        if at >= 0:
            self.held = True
            return self._send(at)
        end = len(self.text) - _partial_marker(self.text, self.parser.markers)
        end = len(self.text[:end].rstrip()) if self.sent < end else end  # hold whitespace
        return self._send(end)

    def _send(self, end: int) -> str:
        out, self.sent = self.text[self.sent:max(end, self.sent)], max(end, self.sent)
        return out

    def finish(self) -> tuple[str, tuple[Call, ...]]:
        got = self.parser.parse(self.text, self.names)
        rest = (got.content if got.calls else self.text)[self.sent:]
        return (rest.rstrip() if got.calls else rest), got.calls


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that begins some marker."""
    return max((k for m in markers for k in range(1, len(m)) if text.endswith(m[:k])),
               default=0)
