"""The request fields the HTTP server does not act on: OpenAI's that change nothing here
are taken and ignored; OpenAI's that would change the answer are refused by name; any
other field is refused (as OpenAI does) unless the server ignores unknown fields.

Data in: a parsed request (`api_server.CompletionRequest` / `ChatRequest`, whose fields
not declared there arrive in pydantic's `model_extra`) and `ServerConfig.unknown_fields`.
Data out: the names of the fields ignored (the response names them in the
`X-Lamina-Ignored-Fields` header, and each name is logged once), or a `ValueError`
naming the field, which the server answers with 400 and `param` set to it.

Structured output arrives in one of four spellings, mapped here to one
`StructuredOutputs`: OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's
`structured_outputs` object, vLLM's older `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar`, and a chat's forced tool call (`tool_choice`
"required" or named: `api_tools`); two of them at once are refused. Tools left to
"auto" ask for none: the model's calls are parsed from what it writes, and a structured
output asked beside them holds that text.

Why not refuse every field the server does not read: clients and frameworks built on
OpenAI's API send `store`, `metadata`, `service_tier` or `parallel_tool_calls` by
default, and a 400 for them breaks the client outright (vLLM relaxed its own check for
that reason). Why not ignore every field: a misspelt `max_token` would silently give 16
tokens, and ignoring `tools` or a JSON `response_format` would answer something other
than what was asked.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from lamina.entrypoints.api_tools import tool_calling
from lamina.sampling.structured import StructuredOutputs

log = logging.getLogger("lamina.server")

IGNORED_HEADER = "X-Lamina-Ignored-Fields"
UNKNOWN_FIELDS = ("reject", "ignore")
_LOG_AT_MOST = 256  # distinct field names logged; a client inventing names stays bounded


def _none_or_empty(v, body) -> bool:
    return v is None or v == [] or v == {} or v == ""


# OpenAI's request fields that change nothing in the tokens a request gets back from this
# server: taken, named in the header, otherwise ignored.
HARMLESS: dict[str, str] = {
    "metadata": "tags OpenAI stores with a completion",
    "store": "whether OpenAI keeps the completion",
    "service_tier": "OpenAI's processing tier",
    "prompt_cache_key": "a routing hint for OpenAI's prompt cache (this server's prefix "
                        "cache needs none)",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
    "prediction": "a predicted output: a speed hint, the answer is the same",
    "parallel_tool_calls": "only acts with tools",
}

# OpenAI's fields that would change the answer: accepted only with a value that asks for
# nothing this server lacks, else 400 with the reason.
_Check = Callable[[Any, Any], bool]
CHAT_REFUSED: dict[str, tuple[_Check, str]] = {
    "functions": (_none_or_empty, "the deprecated `functions` are not supported by this "
                                  "server; send `tools`"),
    "function_call": (lambda v, b: v in (None, "none", "auto"),
                      "the deprecated `function_call` is not supported by this server "
                      "(only 'none'); send `tool_choice`"),
    "audio": (lambda v, b: v is None, "this server answers in text only"),
    "modalities": (lambda v, b: v is None or v == ["text"],
                   "this server answers in text only (['text'])"),
    "web_search_options": (lambda v, b: v is None, "this server has no web search"),
    "reasoning_effort": (lambda v, b: v is None, "this model has no reasoning setting"),
    "verbosity": (lambda v, b: v is None, "this model has no verbosity setting"),
}
COMPLETION_REFUSED: dict[str, tuple[_Check, str]] = {
    "suffix": (_none_or_empty, "insertion (a suffix after the completion) is not supported "
                               "by this server"),
    "best_of": (lambda v, b: v is None or v == b.n,
                "best_of > n (ranking extra candidates) is not supported by this server; "
                "use n"),
}


def check_fields(body, refused: dict[str, tuple[_Check, str]],
                 unknown_fields: str = "reject") -> list[str]:
    """The request's undeclared fields -> the names taken and ignored, in order; a
    refused value or (under "reject") an unknown name -> ValueError naming it."""
    ignored = []
    for name, value in (body.model_extra or {}).items():
        if name in refused:
            ok, why = refused[name]
            if not ok(value, body):
                got = repr(value)
                raise ValueError(f"{name}: {why}, got {got[:80]}{'...' * (len(got) > 80)}")
            reason = "its value asks for nothing this server lacks"
        elif name in HARMLESS:
            reason = HARMLESS[name]
        elif unknown_fields == "reject":
            raise ValueError(f"{name}: not a field of this request (a typo? `lamina serve "
                             f"--unknown-fields ignore` takes unknown fields and ignores "
                             f"them)")
        else:
            reason = "not a field this server knows; --unknown-fields ignore"
        _log_once(name, reason)
        ignored.append(name)
    return ignored


_logged: set[str] = set()


def _log_once(name: str, reason: str) -> None:
    name = name[:64]  # what is remembered and logged stays small whatever a client sends
    if name in _logged:
        return
    if len(_logged) >= _LOG_AT_MOST:
        log.debug("ignoring request field %r (%s)", name, reason)
        return
    _logged.add(name)
    log.info("ignoring request field %r (%s); a response names the fields it ignored in "
             "%s", name, reason, IGNORED_HEADER)


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


def _asked(body) -> dict[str, Callable[[], StructuredOutputs]]:
    """The fields asking for structured output -> how each makes its StructuredOutputs."""
    asked: dict[str, Callable[[], StructuredOutputs]] = {}
    rf = body.response_format
    if rf is not None and rf.get("type") != "text":
        asked["response_format"] = lambda: _response_format(rf)
    if body.structured_outputs is not None:
        asked["structured_outputs"] = lambda: StructuredOutputs(**body.structured_outputs)
    for name, kind in GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            asked[name] = lambda kind=kind, v=value: StructuredOutputs(**{kind: v})
    if "tools" in type(body).model_fields and (  # a chat: a forced tool call is JSON too
            body.tool_choice == "required" or isinstance(body.tool_choice, dict)):
        calling = tool_calling(body.tools, body.tool_choice, body.parallel_tool_calls)
        if calling is not None:
            asked["tool_choice"] = lambda: calling.spec
    return asked


def structured_field(body) -> str | None:
    """The request field that asks for structured output, or None."""
    return next(iter(_asked(body)), None)


def structured_outputs(body) -> StructuredOutputs | None:
    """The request's structured output from whichever field asks for it, or None;
    ValueError naming the field when it is malformed or two fields ask."""
    asked = _asked(body)
    if len(asked) > 1:
        raise ValueError(f"{list(asked)[1]}: structured output is asked for twice "
                         f"({', '.join(asked)}); give one")
    for name, make in asked.items():
        try:
            return make()
        except (ValueError, TypeError) as e:
            raise ValueError(f"{name}: {str(e).removeprefix('StructuredOutputs.')}") \
                from None
    return None


def _response_format(rf: dict) -> StructuredOutputs:
    kind = rf.get("type")
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise ValueError("type json_schema needs json_schema.schema, a JSON schema "
                             "object")
        return StructuredOutputs(json=js["schema"])
    raise ValueError(f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
