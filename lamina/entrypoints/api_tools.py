"""Tool calling on /v1/chat/completions: `tool_choice` "required" or a named function
holds the answer to a call by structured output, whatever the model; "auto" (OpenAI's
default when tools are given) lets the model choose, and reads its calls from its output
with the operator's parser (`tool_parsers`).

Data in: a chat request's `tools` (OpenAI's function definitions), `tool_choice`,
`parallel_tool_calls`, and the server's tool-call parser (or None).
Data out: a `ToolCalling` that holds the answer to a call (`spec`, the
`StructuredOutputs` it is drawn under) or parses it (`parser`), and turns the answer's
text into OpenAI's `tool_calls`; or a `ValueError` naming the field. Named function: the
answer is that function's arguments, a JSON object of its `parameters` schema.
"required": a JSON array of one or more calls (`{"name": ..., "parameters": {...}}`, each
name one of the tools', its parameters that tool's schema; one call only with
`parallel_tool_calls: false`), as vLLM constrains it. "auto": text, calls in the model's
own format, or both; one call only with `parallel_tool_calls: false` (the first).

Why "auto" needs a parser: whether the model called a tool is read from its output, in
a format each model family has its own; without one configured "auto" is a 400 that says
what to send instead, not a text answer that looks like the model declined the tools.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from lamina.entrypoints.tool_parsers import ToolParser
from lamina.sampling.structured import StructuredOutputs

ANY_OBJECT: dict = {"type": "object"}  # a function with no `parameters`: any arguments


@dataclass(frozen=True)
class ToolCalling:
    """What a request's tools and tool_choice hold its answer to."""

    schemas: tuple[tuple[str, dict], ...]  # (name, parameters schema) per tool, in order
    forced: str | None  # the named function; None: "required" (any of them)
    parallel: bool = True  # "required" / "auto": more than one call allowed
    parser: ToolParser | None = None  # "auto": the model's calls read from its text

    @property
    def spec(self) -> StructuredOutputs:
        if self.forced is not None:
            return StructuredOutputs(json=dict(self.schemas)[self.forced])
        call = {"anyOf": [{"type": "object",
                           "properties": {"name": {"const": name}, "parameters": schema},
                           "required": ["name", "parameters"],
                           "additionalProperties": False} for name, schema in self.schemas]}
        calls: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
        if not self.parallel:
            calls["maxItems"] = 1
        return StructuredOutputs(json=calls)

    @property
    def finish_reason(self) -> str:
        """OpenAI's for a complete answer: "stop" when one function was named (the
        model was not choosing to call), "tool_calls" under "required"."""
        return "stop" if self.forced is not None else "tool_calls"

    @property
    def names(self) -> frozenset[str]:
        return frozenset(n for n, _ in self.schemas)

    def read(self, text: str) -> tuple[str | None, list[dict] | None]:
        """An "auto" answer's text -> (its text, None) or (the text around its calls, or
        None when there is none; OpenAI's `tool_calls`)."""
        assert self.parser is not None
        got = self.parser.parse(text, self.names)
        if not got.calls:
            return text, None
        calls = got.calls if self.parallel else got.calls[:1]
        return got.content.strip() or None, openai_calls(list(calls))

    def calls(self, text: str) -> list[dict] | None:
        """A forced answer's text -> OpenAI's `tool_calls`, or None when it does not
        parse (cut short by max_tokens)."""
        if self.forced is not None:
            named = [(self.forced, text)]
        else:
            try:
                named = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                         for c in json.loads(text)]
            except (ValueError, TypeError, KeyError):
                return None
        return openai_calls(named)


def openai_calls(named: list[tuple[str, str]]) -> list[dict]:
    """(name, arguments JSON) pairs -> OpenAI's `tool_calls`, each with a fresh id."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": name, "arguments": args}} for name, args in named]


def tool_calling(tools: list | None, tool_choice, parallel: bool | None,
                 parser: ToolParser | None = None) -> ToolCalling | None:
    """A chat request's tool fields -> its ToolCalling, or None (no tools, or
    tool_choice "none": a text answer); ValueError naming the field. `parser`: the
    server's reader of the model's own calls, which "auto" needs."""
    if tool_choice is not None and tool_choice not in ("none", "auto", "required") and not (
            isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
            and isinstance(tool_choice.get("function"), dict)
            and isinstance(tool_choice["function"].get("name"), str)):
        raise ValueError(f"tool_choice: 'none', 'auto', 'required' or {{'type': 'function', "
                         f"'function': {{'name': ...}}}}, got {str(tool_choice)[:80]}")
    schemas = _schemas(tools or [])
    if not schemas:
        if tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice: names a tool call, but the request has no tools")
        return None
    if tool_choice in (None, "auto"):
        if parser is not None:
            return ToolCalling(schemas, None, parallel is not False, parser)
        raise ValueError("tool_choice: 'auto' (the default when tools are given) needs a "
                         "parser for this model's tool-call format, which this server was "
                         "not given (`lamina serve --tool-call-parser`); send tool_choice "
                         "'required' (the answer is one or more calls) or {'type': "
                         "'function', 'function': {'name': ...}}, or 'none'")
    if tool_choice == "none":
        return None
    forced = None
    if isinstance(tool_choice, dict):
        forced = tool_choice["function"]["name"]
        if forced not in dict(schemas):
            raise ValueError(f"tool_choice: names {forced!r}, not one of the tools "
                             f"({', '.join(n for n, _ in schemas)})")
    return ToolCalling(schemas, forced, parallel is not False)


def _schemas(tools: list) -> tuple[tuple[str, dict], ...]:
    """OpenAI's tool definitions -> (name, parameters schema) each; ValueError naming
    `tools` for a malformed one or a name given twice."""
    out: list[tuple[str, dict]] = []
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict) \
                or not isinstance(f.get("name"), str) or not f["name"]:
            raise ValueError(f"tools: tool {i} must be {{'type': 'function', 'function': "
                             f"{{'name': ..., 'parameters': {{...}}}}}}, got {str(t)[:80]}")
        params = f.get("parameters") or ANY_OBJECT
        if not isinstance(params, dict):
            raise ValueError(f"tools: tool {i}'s function.parameters must be a JSON schema "
                             f"object")
        if f["name"] in dict(out):
            raise ValueError(f"tools: the name {f['name']!r} is given twice")
        out.append((f["name"], params))
    return tuple(out)


def history_for_template(messages: list[dict], template: str,
                         parser: ToolParser | None = None) -> list[dict]:
    """Earlier tool calls for a chat template that has no place for them (it never
    mentions `tool_calls`): an assistant turn's calls become its text, written in the
    parser's format (else as the "required" answers are), so the model sees what it
    called; the tools' results are `tool` turns, which such templates write like any
    other role."""
    if "tool_calls" in template:
        return messages
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls:
            pairs = [(c.get("function", {}).get("name"),
                      _arguments(c.get("function", {}).get("arguments"))) for c in calls]
            shown = parser.format_calls(pairs) if parser is not None else json.dumps(
                [{"name": n, "parameters": a} for n, a in pairs], ensure_ascii=False)
            text = "\n".join(t for t in (m.get("content") or "", shown) if t)
            m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}
        out.append(m)
    return out


def _arguments(args):
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args
