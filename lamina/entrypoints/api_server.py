"""OpenAI-compatible HTTP server (FastAPI on uvicorn): `lamina serve`.

Data in: JSON requests on /v1/completions, /v1/chat/completions and /v1/responses
(OpenAI's fields, echo, penalties, logit_bias, chat's text content parts and
max_completion_tokens included, plus vLLM's top_k, seed, stop_token_ids, ignore_eos,
min_tokens, repetition_penalty, prompt_logprobs, stream_options.continuous_usage_stats,
return_tokens_as_token_ids and a chat's echo (vLLM's sampling fields: `_Sampling`);
structured output's response_format / structured_outputs / guided_* and a chat's tools
with a forced tool_choice, made into `StructuredOutputs` by `api_fields` and
`api_tools`; tools left to "auto", read from the answer by
`ServerConfig.tool_call_parser` (`tool_parsers`); a Responses request made a chat
request by `api_responses`, which keeps the stored ones (`background: true` ones run on
a task, polled and cancelled: `api_background`); OpenAI's other fields taken or
refused by name in `api_fields`). Data out: completion JSON with text (or a chat's
tool_calls), token ids, logprobs, finish reasons and usage, or a Response; with `stream:
true`, server-sent events of text deltas, then `data: [DONE]` (Responses: its own
events); Prometheus metrics on /metrics; vLLM's /tokenize and /detokenize
(`api_tokenize`).
Real clients run against it in the tests: openai, guidellm and lm-eval. Requests go to one
`EngineLoop`, so concurrent HTTP requests batch together in the engine. A client that
disconnects (streaming or not) has its request aborted and its KV freed.

Errors, all in OpenAI's shape ({"error": {"message", "type", "param", "code"}}): bad
input 400 naming the field (limits from `ServerConfig`); a missing or wrong API key 401;
an unknown model 404; a body over `max_body_bytes` 413; a full waiting queue 429 with
Retry-After; a request the engine failed alone 500 (the others go on); a stopped engine
503 (or an error event mid-stream).
"""
from __future__ import annotations

import asyncio
import errno
import hmac
import inspect
import json
import logging
import re
import signal
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from lamina.engine.beam_search import BeamSearch, finish_round, next_round
from lamina.engine.sessions import check_session_id
from lamina.entrypoints.api_background import KEPT_LOGS, Background, pending
from lamina.entrypoints.api_beam import beam_params, with_logprobs
from lamina.entrypoints.api_body import TextRoute
from lamina.entrypoints.api_fields import (
    CHAT_REFUSED,
    COMPLETION_REFUSED,
    IGNORED_HEADER,
    UNKNOWN_FIELDS,
    check_fields,
    structured_field,
    structured_outputs,
)
from lamina.entrypoints.api_responses import (
    RESPONSES_REFUSED,
    ResponseStore,
    Stored,
    answer_message,
    input_items,
    listed,
    new_id,
    output_items,
    response_events,
    response_object,
    responses_field,
    to_chat,
)
from lamina.entrypoints.api_stream import (
    chat_logprobs,
    completion_logprobs,
    sse_events,
    token_names,
    vllm_prompt_logprobs,
)
from lamina.entrypoints.api_tokenize import (
    DetokenizeRequest,
    TokenizeRequest,
    detokenize,
    tokenize,
)
from lamina.entrypoints.api_tools import ToolCalling, openai_calls, tool_calling
from lamina.entrypoints.engine_loop import EngineLoop, beside
from lamina.entrypoints.llm import chat_prompt, chat_tokens, template_message
from lamina.entrypoints.tool_parsers import PARSERS, ToolParser, ToolStream
from lamina.errors import EngineDead, EngineOverloaded, RequestFailed
from lamina.sampling.params import SamplingParams

log = logging.getLogger("lamina.server")
DISCONNECT_POLL_S = 0.5  # how often a waiting non-streamed request checks its client
# a field name that can go in a header as it is (an ignored one that cannot is only logged)
_HEADER_SAFE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP front's limits; past each a request answers 400 (413 for the body)."""
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on /v1/*
    max_body_bytes: int = 2 << 20
    max_prompts: int = 64  # prompts in one /v1/completions request
    max_n: int = 16
    max_stop: int = 16  # stop strings
    max_stop_chars: int = 256  # per stop string
    max_logit_bias: int = 300  # entries (OpenAI's bound)
    max_waiting: int | None = 1024  # queued requests before 429 (None: no bound)
    retry_after_s: int = 1  # the 429's Retry-After
    # a request field that is neither read nor OpenAI's: "reject" (400 naming it, as
    # OpenAI does) or "ignore" (taken; the response names it, see `api_fields`)
    unknown_fields: str = "reject"
    # origins a browser page may call this server from (CORS), e.g. "http://localhost:3000",
    # or "*" for any. None by default, so a page elsewhere cannot read the answers (vLLM
    # allows any origin by default; an API key in a page is readable by its users anyway,
    # so opening the server to every site is the deployer's choice, not ours)
    allowed_origins: tuple[str, ...] = ()
    # on SIGTERM (a rolling update, `docker stop`): finish the requests in flight for at
    # most this long, answering new ones 503 and /health 503, then exit; 0: at once (the
    # requests in flight fail). A second SIGTERM, or Ctrl-C, stops at once.
    shutdown_timeout_s: float = 30.0
    # how the model writes a tool call (`tool_parsers.PARSERS`: "hermes", "llama3_json",
    # "mistral", "pythonic"), which tool_choice "auto" needs; None: "auto" is a 400
    tool_call_parser: str | None = None
    # /v1/responses kept for previous_response_id and GET (in memory; least recently
    # used dropped first past either bound). Each holds its whole conversation, so a
    # long chat's turns cost the sum of their histories; over a service the store is
    # also a copy in Ray's GCS (the head node's memory), which the byte bound caps.
    max_stored_responses: int = 1024
    max_stored_response_bytes: int = 256 << 20

    def __post_init__(self):
        t = self.shutdown_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
            raise ValueError(f"ServerConfig.shutdown_timeout_s must be a number >= 0, got "
                             f"{t!r}")
        origins = self.allowed_origins
        if isinstance(origins, list):  # from a YAML file
            origins = tuple(origins)
            object.__setattr__(self, "allowed_origins", origins)
        if not isinstance(origins, tuple) or not all(
                isinstance(o, str) and o for o in origins):
            raise ValueError(f"ServerConfig.allowed_origins must be a list of origins "
                             f"(non-empty strings), got {origins!r}")
        for name in ("max_body_bytes", "max_prompts", "max_n", "max_stop", "max_stop_chars",
                     "max_logit_bias", "retry_after_s", "max_stored_responses",
                     "max_stored_response_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ServerConfig.{name} must be an int >= 1, got {v!r}")
        if self.max_waiting is not None and (not isinstance(self.max_waiting, int)
                                             or self.max_waiting < 1):
            raise ValueError(f"ServerConfig.max_waiting must be an int >= 1 or None, "
                             f"got {self.max_waiting!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str)
                                         or not self.api_key):
            raise ValueError("ServerConfig.api_key must be a non-empty string or None")
        if self.unknown_fields not in UNKNOWN_FIELDS:
            raise ValueError(f"ServerConfig.unknown_fields must be one of {UNKNOWN_FIELDS}, "
                             f"got {self.unknown_fields!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"ServerConfig.tool_call_parser must be one of "
                             f"{sorted(PARSERS)} or None, got {self.tool_call_parser!r}")

    def check(self, body: "_Sampling", prompts: int) -> None:
        """The per-request limits -> ValueError naming the field."""
        stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
        for name, got, most in (("prompt", prompts, self.max_prompts),
                                ("n", body.n, self.max_n),
                                ("stop", len(stops), self.max_stop),
                                ("logit_bias", len(body.logit_bias or {}),
                                 self.max_logit_bias)):
            if got > most:
                raise ValueError(f"{name}: {got} given, this server allows at most {most}")
        if any(len(x) > self.max_stop_chars for x in stops):
            raise ValueError(f"stop: strings of at most {self.max_stop_chars} characters")


class _Nullable(BaseModel):
    """OpenAI's request fields are nullable, null meaning the default: clients that send
    every parameter (JS and Go SDKs, frameworks) send null for the ones not set."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if isinstance(data, dict):  # a declared field's null -> its default
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


class StreamOptions(_Nullable):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False  # OpenAI's: a last event with the request's usage
    # vLLM's (with include_usage): every event carries its choice's usage so far
    continuous_usage_stats: bool = False
    # OpenAI's: random padding on events against length side channels; taken, not added
    include_obfuscation: bool | None = None


class _Sampling(_Nullable):
    # fields not declared here land in `model_extra`: `api_fields` takes, ignores or
    # refuses them by name
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0  # vLLM's
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    # vLLM's (see SamplingParams)
    min_p: float = 0.0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: the text is the tokenizer's `decode`, which puts no space between special
    # tokens (transformers 5, any tokenizer), as vLLM's fast detokenizer, either way
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    user: str | None = None
    # Lamina's: this request's own KV sparsity on the memory workers (None: the
    # deployment's); see SamplingParams.kv_sparsity / kv_budget
    kv_sparsity: str | None = None
    kv_budget: float | int | None = None
    # Lamina's: the conversation this request continues (or the X-Session-Id header);
    # with KV tiers its KV is kept beyond the pool for the next turn
    session_id: str | None = None
    # vLLM's: under `scheduling_policy: priority`, lower is served first
    priority: int = 0
    # vLLM's: logprobs name each token "token_id:<id>" (a token whose text is part of a
    # character, or any, identified without the tokenizer); the text itself is unchanged
    return_tokens_as_token_ids: bool = False
    # vLLM's beam search (`api_beam`): `n` beams, the n best returned, best first;
    # HF's `early_stopping` (False, True or "never") beside vLLM's fields
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # structured output: OpenAI's, vLLM's, vLLM's older names (`api_fields.structured_outputs`)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def num_logprobs(self) -> int | None:
        return None

    def num_prompt_logprobs(self) -> int | None:
        return None

    def _logit_bias(self) -> dict:
        try:
            return {int(k): v for k, v in (self.logit_bias or {}).items()}
        except ValueError:
            raise ValueError("SamplingParams.logit_bias keys must be token ids, got "
                             f"{list(self.logit_bias)!r}") from None

    def params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature,
                              top_p=self.top_p, top_k=self.top_k, n=self.n, seed=self.seed,
                              stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids),
                              ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
                              logprobs=self.num_logprobs(),
                              presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty,
                              repetition_penalty=self.repetition_penalty,
                              logit_bias=self._logit_bias(),
                              prompt_logprobs=self.num_prompt_logprobs(),
                              kv_sparsity=self.kv_sparsity, kv_budget=self.kv_budget,
                              structured_outputs=structured_outputs(self),
                              min_p=self.min_p, allowed_token_ids=self.allowed_token_ids,
                              bad_words=tuple(self.bad_words),
                              include_stop_str_in_output=self.include_stop_str_in_output,
                              skip_special_tokens=self.skip_special_tokens,
                              truncate_prompt_tokens=self.truncate_prompt_tokens)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # the drawn token's logprob and this many top ones
    echo: bool = False  # the prompt comes back before the completion (with its logprobs)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and top ones

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        if self.echo and self.stream:
            raise ValueError("echo is not supported with stream")
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None


class ChatMessage(BaseModel):
    role: str
    # a string, or OpenAI's content parts, of which this server reads text parts; left
    # out or null only on an assistant's turn of tool calls
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    # chat's default: as many tokens as the model's context leaves (OpenAI's); the
    # current name of the cap is max_completion_tokens, max_tokens its older one
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    # tool calling (`api_tools`): "required" or a named function make the answer a call;
    # "auto" reads the model's own calls with the server's parser
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's: how the chat template writes the prompt (`llm.chat_prompt`)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: where the last message is the assistant's (an answer continued), the
    # answer's content begins with it
    echo: bool = False

    def echoed(self) -> str:
        """The text `echo` puts before the answer ("" where there is none)."""
        last = self.messages[-1]
        if not self.echo or last.role != "assistant":
            return ""
        return template_message(last.model_dump(), len(self.messages) - 1)["content"]

    def tool_calling(self, parser: ToolParser | None = None) -> ToolCalling | None:
        return tool_calling(self.tools, self.tool_choice, self.parallel_tool_calls, parser)

    def params(self) -> SamplingParams:
        a, b = self.max_tokens, self.max_completion_tokens
        if a is not None and b is not None and a != b:
            raise ValueError(f"max_completion_tokens: {b} given with max_tokens {a}; "
                             "give one of them")
        return replace(super().params(), max_tokens=b if b is not None else a)

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


class ResponsesRequest(_Nullable):
    """OpenAI's Responses API request (`api_responses` makes it a chat request)."""

    model_config = ConfigDict(extra="allow")  # `api_fields` takes or refuses the rest
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # vLLM's
    seed: int | None = None  # vLLM's
    top_logprobs: int | None = None
    include: list[Literal["message.output_text.logprobs"]] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    structured_outputs: dict[str, Any] | None = None  # vLLM's
    priority: int = 0  # vLLM's
    background: bool = False  # answered at once, polled (`api_background`)


_KINDS = {400: "invalid_request_error", 401: "invalid_request_error",
          404: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error"}


def _error(status: int, message: str, param: str | None = None, code: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    kind = _KINDS.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": code}}, status_code=status, headers=headers)


REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces


class _Guard:
    """ASGI middleware in front of the app: the request's id (the client's
    `X-Request-Id`, else a new one; every response carries it back, the completion ids
    end in it, and a failed request's log line names it), the API key on /v1/* (401)
    and the body's size, counted as it arrives, so a large or endless body is cut off
    (413) without being buffered whole."""

    def __init__(self, app, config: ServerConfig):
        self.app, self.config = app, config

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(REQUEST_ID_HEADER.lower().encode())
        rid = given.decode("latin-1") if given is not None else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def tagged(msg):  # every answer names the request it answers
            if msg["type"] == "http.response.start":
                msg = {**msg, "headers": [*msg.get("headers", []),
                                          (REQUEST_ID_HEADER.encode(), rid.encode())]}
            await send(msg)

        if not _REQUEST_ID.fullmatch(rid):
            return await _error(400, f"{REQUEST_ID_HEADER}: 1-128 printable ASCII characters "
                                f"without spaces, got {rid[:40]!r}",
                                REQUEST_ID_HEADER)(scope, receive, send)
        await self._guarded(scope, receive, tagged, headers)

    async def _guarded(self, scope, receive, send, headers: dict):
        cfg = self.config
        if cfg.api_key is not None and scope["path"].startswith("/v1"):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if not hmac.compare_digest(auth.encode(), f"Bearer {cfg.api_key}".encode()):
                return await _error(401, "Incorrect or missing API key: send "
                                    "'Authorization: Bearer <key>'",
                                    code="invalid_api_key")(scope, receive, send)
        length = headers.get(b"content-length")
        too_big = _error(413, f"request body over {cfg.max_body_bytes} bytes",
                         code="request_too_large")
        if length is not None and (not length.isdigit() or int(length) > cfg.max_body_bytes):
            return await too_big(scope, receive, send)
        seen = 0

        async def counted():  # FastAPI answers the HTTPException in OpenAI's shape
            nonlocal seen
            msg = await receive()
            seen += len(msg.get("body", b""))
            if seen > cfg.max_body_bytes:
                raise HTTPException(413, f"request body over {cfg.max_body_bytes} bytes")
            return msg

        await self.app(scope, counted, send)


def build_app(loop: EngineLoop, model_name: str, tokenizer=None,
              config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app: OpenAI's routes over one engine loop, behind `_Guard`."""
    config = config or ServerConfig()
    if config.max_waiting is not None and loop.max_waiting is None:
        loop.max_waiting = config.max_waiting
    app = FastAPI(title="Lamina", description="attention-offloaded LLM inference")
    app.router.route_class = TextRoute  # bodies with lone surrogates: 400 (`api_body`)
    app.add_middleware(_Guard, config=config)
    if config.allowed_origins:  # outside the guard: a preflight carries no API key
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=["GET", "POST", "DELETE"], allow_headers=["*"],
                           expose_headers=[IGNORED_HEADER, "Retry-After"])
    app.exception_handler(StarletteHTTPException)(_http_error)
    app.exception_handler(RequestValidationError)(_bad_body)
    app.exception_handler(EngineDead)(_engine_dead)
    api = app.state.api = _Api(loop, model_name, tokenizer, config)  # the app holds it
    app.get("/health")(_weakly(api.health))
    app.get("/ping")(_weakly(api.health))  # vLLM's (SageMaker's), GET and POST
    app.post("/ping")(_weakly(api.health))
    app.get("/version")(_weakly(api.version))  # vLLM's
    app.get("/metrics")(_weakly(api.metrics))
    app.get("/v1/models")(_weakly(api.models))
    app.get("/v1/models/{model:path}")(_weakly(api.model))  # a served name may hold slashes
    app.post("/v1/completions")(_weakly(api.completions))
    app.post("/v1/chat/completions")(_weakly(api.chat))
    app.post("/v1/responses")(_weakly(api.responses))
    app.get("/v1/responses/{rid}")(_weakly(api.get_response))
    app.get("/v1/responses/{rid}/input_items")(_weakly(api.response_input_items))
    app.delete("/v1/responses/{rid}")(_weakly(api.delete_response))
    app.post("/v1/responses/{rid}/cancel")(_weakly(api.cancel_response))
    app.post("/tokenize")(_weakly(api.tokenize))  # vLLM's
    app.post("/detokenize")(_weakly(api.detokenize))
    return app


def _weakly(handler: Callable) -> Callable:
    """A route's handler (an `_Api` coroutine method) that holds its `_Api` weakly.
    FastAPI keeps every endpoint it has classified in module-level caches
    (`fastapi.dependencies.models`, 4096 entries each): a bound method there would keep
    the `_Api`, its engine loop and the engine's KV pools alive after the app is gone,
    in a process that serves again (a notebook, the tests, a batch run after a server).
    The app holds the `_Api` (`app.state.api`); FastAPI reads the method's signature."""
    ref = weakref.WeakMethod(handler)

    async def route(*args: Any, **kw: Any) -> Any:
        return await ref()(*args, **kw)  # type: ignore[misc]

    route.__signature__ = inspect.signature(handler)  # type: ignore[attr-defined]
    route.__name__, route.__qualname__ = handler.__name__, handler.__qualname__
    route.__doc__ = handler.__doc__
    return route


async def _http_error(request: Request, exc: StarletteHTTPException):
    return _error(exc.status_code, str(exc.detail), getattr(exc, "param", None))


async def _engine_dead(request: Request, exc: EngineDead):
    """A route that reaches a stopped engine or a service that is gone (a stored response
    read over it): 503, as a request to it is answered."""
    return _error(503, str(exc))


async def _bad_body(request: Request, exc: RequestValidationError):
    first = exc.errors()[0] if exc.errors() else {}
    path = [str(x) for x in first.get("loc", ()) if x != "body"]
    loc = ".".join(path)
    # param: the request's top-level field (as OpenAI names it); the message says where
    return _error(400, f"{loc or 'body'}: {first.get('msg', 'invalid request')}",
                  path[0] if path else None)


class _Api:
    """The routes' handlers over one engine loop and model."""

    def __init__(self, loop: EngineLoop, model_name: str, tokenizer, config: ServerConfig):
        self.loop, self.model_name = loop, model_name
        self.tokenizer, self.config = tokenizer, config
        self.created = int(time.time())  # the model's `created` on /v1/models
        # /v1/responses: a service's loop brings the deployment's store (every front
        # over it reads the same responses); a local one keeps its own
        self.stored = getattr(loop, "response_store", None) or \
            ResponseStore(config.max_stored_responses,
                          max_bytes=config.max_stored_response_bytes)
        self.remote = getattr(loop, "remote", False)
        self.background = Background(self.stored, self._off_loop, watch=self.remote)

    async def _off_loop(self, fn, *args, **kw):
        """fn(*args, **kw). Over a service (`remote` loop: each call a round trip to it)
        on a worker thread, so that this front's event loop goes on streaming the other
        requests meanwhile; a local loop's calls take microseconds and run here."""
        if self.remote:
            return await asyncio.to_thread(fn, *args, **kw)
        return fn(*args, **kw)

    async def health(self):
        if not await self._off_loop(lambda: self.loop.alive):
            return _error(503, f"engine stopped: {self.loop.error}")
        if getattr(self.loop, "draining", False):  # a load balancer sends no more here
            return _error(503, "shutting down: finishing the requests in flight")
        return {"status": "ok"}

    async def version(self):
        from lamina import __version__
        return {"version": __version__}

    async def metrics(self):
        m = self.loop.metrics
        if m is None:
            return _error(404, "this server keeps no metrics")
        return Response(await self._off_loop(m.render), media_type=m.content_type)

    async def models(self):
        return {"object": "list", "data": [self._model_card()]}

    async def model(self, model: str):
        if model != self.model_name:
            return _error(404, f"The model `{model}` does not exist; this server serves "
                          f"`{self.model_name}`", "model", "model_not_found")
        return self._model_card()

    def _wrong_model(self, model: str | None) -> JSONResponse | None:
        if model is None or model == self.model_name:
            return None
        return _error(404, f"The model `{model}` does not exist; this server serves "
                      f"`{self.model_name}`", "model", "model_not_found")

    async def tokenize(self, body: TokenizeRequest):
        """vLLM's /tokenize: a prompt's or a chat's token ids, as the engine sees them
        (`api_tokenize`); a chat's tools listed as for tool_choice "auto"."""
        wrong = self._wrong_model(body.model)
        if wrong is not None or self.tokenizer is None:
            return wrong or _error(400, "this server has no tokenizer", "prompt")
        name = self.config.tool_call_parser
        try:
            if body.messages is not None:  # checked as the chat route checks them
                try:
                    msgs = [ChatMessage.model_validate(m).model_dump() for m in body.messages]
                except ValidationError as e:
                    err = e.errors()[0]
                    return _error(400, f"messages: {'.'.join(map(str, err['loc']))}: "
                                  f"{err['msg']}", "messages")
                body = body.model_copy(update={"messages": msgs})
            return tokenize(self.tokenizer, body, self.loop.engine.max_len,
                            PARSERS[name] if name is not None else None)
        except ValueError as e:
            return _error(400, str(e), re.split(r"[:. ]", str(e))[0])  # its top field

    async def detokenize(self, body: DetokenizeRequest):
        wrong = self._wrong_model(body.model)
        if wrong is not None or self.tokenizer is None:
            return wrong or _error(400, "this server has no tokenizer", "tokens")
        try:
            return detokenize(self.tokenizer, body, self.loop.engine.vocab_size)
        except ValueError as e:
            return _error(400, str(e), "tokens")

    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "lamina"}

    def _params(self, body: _Sampling, n: int) -> SamplingParams | JSONResponse:
        """The request's sampling parameters, or the error answering it."""
        wrong = self._wrong_model(body.model)
        if wrong is not None:
            return wrong
        try:
            self.config.check(body, n)
            return body.params()
        except ValueError as e:
            field_ = str(e).split(" ")[0].removeprefix("SamplingParams.").rstrip(":")
            return _error(400, str(e), field_)

    def _submit(self, aloop: asyncio.AbstractEventLoop, prompts: list,
                params: SamplingParams, updates, session: str | None = None,
                structured: str | None = None, priority: int = 0) -> list | JSONResponse:
        """Queue every prompt (each validated before any is queued) -> their futures,
        or the error answering the request. `updates`: a queue for streamed progress.
        `structured`: the request field that asked for structured output (an error in
        the grammar names it). `aloop`: the event loop `updates` belongs to."""

        def listener(i):
            return lambda out: aloop.call_soon_threadsafe(updates.put_nowait, (i, out))

        try:
            prompts = _checked(prompts, self.loop, params, priority)
            self.loop.check_capacity(len(prompts))
            check_session_id(session)
            return [self.loop.submit(p, params, validated=True,
                                     on_update=listener(i) if updates is not None else None,
                                     session_id=session, priority=priority)
                    for i, p in enumerate(prompts)]
        except (ValueError, TypeError) as e:
            grammar = structured is not None and "StructuredOutputs." in str(e)
            return _error(400, str(e), structured if grammar else _param(str(e)))
        except EngineOverloaded as e:
            return _error(429, str(e), code="server_busy",
                          headers={"Retry-After": str(self.config.retry_after_s)})
        except EngineDead as e:
            return _error(503, str(e))

    async def _run(self, prompts: list, body: _Sampling, request: Request,
                   chunk=None) -> list | JSONResponse:
        """Run the prompts -> their final outputs; with `chunk` (streaming), a response
        of server-sent events made by `chunk` (see `sse_events`) instead."""
        params = self._params(body, len(prompts))
        if isinstance(params, JSONResponse):
            return params
        updates: asyncio.Queue | None = asyncio.Queue() if chunk else None
        session = body.session_id or request.headers.get("x-session-id")
        futs = await self._off_loop(self._submit, asyncio.get_running_loop(), prompts,
                                    params, updates, session, structured_field(body),
                                    body.priority)
        if isinstance(futs, JSONResponse):
            return futs
        if chunk:
            opts = body.stream_options or StreamOptions()
            return StreamingResponse(
                sse_events(self.loop, futs, updates, chunk,
                           _usage if opts.include_usage else None,
                           opts.include_usage and opts.continuous_usage_stats,
                           request.state.request_id),
                media_type="text/event-stream")
        return await self._wait(futs, request)

    async def _wait(self, futs: list, request: Request) -> list | JSONResponse:
        """The requests' final outputs. A client that disconnects first has its requests
        aborted (KV freed at once)."""
        waiter = asyncio.gather(*(asyncio.wrap_future(f) for f in futs))
        try:
            while not (await asyncio.wait({waiter}, timeout=DISCONNECT_POLL_S))[0]:
                if await request.is_disconnected():
                    for f in futs:
                        self.loop.abort(f)
                    waiter.add_done_callback(lambda w: w.exception())  # nobody reads it
                    return _error(499, "client disconnected; request aborted")
            return list(waiter.result())
        except RequestFailed as e:  # this request alone; the engine goes on
            for f in futs:
                self.loop.abort(f)
            log.warning("HTTP request %s failed: %s", request.state.request_id, e)
            return _error(500, str(e), code="request_failed")
        except Exception as e:  # noqa: BLE001 - the engine failed these requests
            log.warning("HTTP request %s failed: %s", request.state.request_id, e)
            return _error(503, f"generation failed: {type(e).__name__}: {e}")

    async def _beam(self, prompts: list, body: _Sampling, request: Request
                    ) -> list | JSONResponse:
        """`use_beam_search`: the rounds of each prompt's search (`engine.beam_search`),
        each round queued, validated, awaited and failed as `_run`'s requests are ->
        one output a prompt, its beams best first."""
        wrong = self._wrong_model(body.model)
        if wrong is not None:
            return wrong
        try:
            self.config.check(body, len(prompts))
            searches = await self._off_loop(self._searches, prompts, body)
        except (ValueError, TypeError) as e:
            return _error(400, str(e), str(e).split(":")[0].split(" ")[0])
        while asked := next_round(searches):
            futs = await self._off_loop(self._submit, asyncio.get_running_loop(),
                                        [ctx for _, ctx in asked],
                                        searches[0].round_params(), None, None, None,
                                        body.priority)
            if isinstance(futs, JSONResponse):
                return futs
            outs = await self._wait(futs, request)
            if isinstance(outs, JSONResponse):
                return outs
            finish_round(asked, outs)
        decode = self.tokenizer.decode
        k = body.num_logprobs()
        return [with_logprobs(s.result(i, lambda ids, skip: decode(
            ids, skip_special_tokens=skip)), k) for i, s in enumerate(searches)]

    def _searches(self, prompts: list, body: _Sampling) -> list[BeamSearch]:
        """One search a prompt, each checked as `_checked` checks a request."""
        engine, params, out = self.loop.engine, body.params(), []
        for p, ids in zip(prompts, _validated(prompts, self.loop, params, body.priority)):
            new = params.max_tokens if params.max_tokens is not None \
                else engine.max_len - len(ids)
            out.append(BeamSearch(ids, beam_params(body, new), engine.eos_ids, p,
                                  body.num_logprobs() or 0))
        return out

    def _decode(self, ids) -> list[str]:
        tok = self.tokenizer
        return [tok.decode([t]) if tok is not None else str(t) for t in ids]

    @staticmethod
    def _names(body: _Sampling):
        """How a request's logprobs name tokens: vLLM's "token_id:<id>", or None (their
        text)."""
        return token_names if body.return_tokens_as_token_ids else None

    async def completions(self, body: CompletionRequest, request: Request,
                          response: Response):
        return await self._answer(self._completions, body, COMPLETION_REFUSED, request,
                                  response)

    async def chat(self, body: ChatRequest, request: Request, response: Response):
        return await self._answer(self._chat, body, CHAT_REFUSED, request, response)

    async def responses(self, body: ResponsesRequest, request: Request, response: Response):
        return await self._answer(self._responses, body, RESPONSES_REFUSED, request,
                                  response)

    async def get_response(self, rid: str, stream: bool = False,
                           starting_after: int = -1):
        if stream and rid in self.background.logs:  # its events resumed
            return StreamingResponse(self.background.follow(rid, starting_after),
                                     media_type="text/event-stream")
        if stream:
            return _error(400, f"stream: this front keeps the events of the background "
                          f"responses it runs with stream: true (and of the last "
                          f"{KEPT_LOGS} finished), and {rid!r} is none of them; retrieve "
                          f"it without stream", "stream")
        got = await self._off_loop(self.stored.get, rid)
        if got is None:
            return _error(404, f"no stored response {rid!r} (not stored, deleted, or "
                          f"dropped: this deployment keeps "
                          f"{await self._off_loop(self.stored.bound)})", "response_id",
                          "not_found")
        return got.response

    async def response_input_items(self, rid: str, limit: int = 20, order: str = "desc",
                                   after: str | None = None):
        got = await self._off_loop(self.stored.get, rid)
        if got is None:
            return _error(404, f"no stored response {rid!r}", "response_id", "not_found")
        if not 1 <= limit <= 100 or order not in ("asc", "desc"):
            return _error(400, f"limit must be 1..100 and order 'asc' or 'desc', got "
                          f"{limit}, {order!r}", "limit" if order in ("asc", "desc")
                          else "order")
        try:
            return listed(got.inputs, limit, order, after)
        except ValueError as e:
            return _error(400, str(e), "after")

    async def delete_response(self, rid: str):
        if not await self._off_loop(self.stored.delete, rid):
            return _error(404, f"no stored response {rid!r}", "response_id", "not_found")
        self.background.stop(rid)  # running here: its request aborted
        return {"id": rid, "object": "response.deleted", "deleted": True}

    async def cancel_response(self, rid: str):
        """A background response stopped (`Background.cancel`); one already finished is
        returned as it is."""
        got = await self._off_loop(self.stored.get, rid)
        if got is None:
            return _error(404, f"no stored response {rid!r}", "response_id", "not_found")
        if not got.response.get("background"):
            return _error(400, f"only background responses can be cancelled; {rid!r} was "
                          "answered in its own request", "response_id")
        if not pending(got):
            return got.response
        return await self.background.cancel(rid, got)

    async def _responses(self, body: ResponsesRequest, request: Request):
        """A Responses request answered by the chat path (`api_responses`)."""
        prev = None
        if body.previous_response_id is not None:
            prev = await self._off_loop(self.stored.get, body.previous_response_id)
            if prev is None:
                return _error(400, f"previous_response_id: no stored response "
                              f"{body.previous_response_id!r} (not stored, deleted, or "
                              f"dropped: this deployment keeps "
                              f"{await self._off_loop(self.stored.bound)})",
                              "previous_response_id", "previous_response_not_found")
        rid = new_id("resp")
        try:
            call = to_chat(body, prev)
            items = input_items(body.input)
            chat = ChatRequest(**call.body)
        except (ValueError, ValidationError) as e:
            where = str(e).split(":")[0].split("\n")[0]
            return _error(400, str(e), responses_field(where.split(".")[0]))
        if body.background and not body.store:
            return _error(400, "background: a background response is stored (store: true) "
                          "and polled (GET /v1/responses/{id})", "background")
        session = call.session or rid
        if body.store and chat.session_id is None and "x-session-id" not in request.headers:
            chat.session_id = session  # with KV tiers each turn's KV waits for the next

        async def keep(resp: dict) -> None:
            if body.store and not await self._off_loop(self.stored.put, rid, Stored(
                    resp, [*call.history, *call.messages, answer_message(resp["output"])],
                    session, items)):
                resp["store"] = False  # over the store's bytes alone: the answer says so

        out = await self._chat(chat, request)
        if isinstance(out, JSONResponse):
            return _renamed(out)
        if isinstance(out, StreamingResponse) and body.background:
            return await self._in_background(rid, body, call, session, items,
                                             out.body_iterator)
        if isinstance(out, StreamingResponse):
            return StreamingResponse(response_events(out.body_iterator, rid, body,
                                                     self.model_name, keep),
                                     media_type="text/event-stream")
        ch = out["choices"][0]
        resp = response_object(rid, body, self.model_name,
                               output_items(ch["message"], ch["logprobs"], new_id("msg")),
                               ch["finish_reason"], out["usage"])
        await keep(resp)
        return resp

    async def _in_background(self, rid: str, body: ResponsesRequest, call, session: str,
                             items: list, chunks) -> dict | JSONResponse:
        """The request's Response `queued` at once (with `stream`, its events as they
        come); its chat stream (already submitted) read on a task of this front
        (`api_background`)."""
        async def nothing(_resp: dict) -> None:  # `Background` stores the last one
            return None

        first = Stored(response_object(rid, body, self.model_name, [], None, None, "queued"),
                       [*call.history, *call.messages], session, items,
                       getattr(self.loop, "owner", None))
        events = response_events(chunks, rid, body, self.model_name, nothing)
        try:
            queued = await self.background.start(rid, first, events, body.stream)
        except ValueError as e:
            return _error(400, str(e), "background")
        if body.stream:  # its events as they come; a client gone leaves it running
            return StreamingResponse(self.background.follow(rid),
                                     media_type="text/event-stream")
        return queued

    async def _answer(self, handler, body: _Sampling, refused: dict, request: Request,
                      response: Response):
        """The request's undeclared fields checked (`api_fields`: 400 naming a refused
        one), then its answer, with the fields it ignored named in a header (on the
        injected `response` where the answer is a dict FastAPI renders)."""
        try:
            ignored = check_fields(body, refused, self.config.unknown_fields)
        except ValueError as e:
            return _error(400, str(e), str(e).split(":")[0])
        out = await handler(body, request)
        names = ", ".join(n for n in ignored if _HEADER_SAFE.fullmatch(n))
        if names:
            (out if isinstance(out, Response) else response).headers[IGNORED_HEADER] = names
        return out

    async def _completions(self, body: CompletionRequest, request: Request):
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        head = {"id": f"cmpl-{request.state.request_id}", "object": "text_completion",
                "created": int(time.time()), "model": self.model_name}
        choice = _CompletionChoices(body, self._decode, self._names(body))
        if body.stream and not body.use_beam_search:  # (refused with it, by `_beam`)
            return await self._run(list(prompts), body, request,
                                   lambda i, c, text, lps, start: {
                                       **head, "choices": [choice(i, c, text, lps, start)]})
        outs = await (self._beam if body.use_beam_search else self._run)(
            list(prompts), body, request)
        if isinstance(outs, JSONResponse):
            return outs
        choices = [choice(i, c, c.text, c.logprobs, out=o) for i, o in enumerate(outs)
                   for c in o.outputs]
        return {**head, "choices": choices, "usage": _usage(outs)}

    async def _chat(self, body: ChatRequest, request: Request):
        tok = self.tokenizer
        if tok is None or getattr(tok, "chat_template", None) is None:
            return _error(400, "this model has no chat template", "messages")
        name = self.config.tool_call_parser
        parser = PARSERS[name] if name is not None else None
        try:
            calling = body.tool_calling(parser)
        except ValueError as e:
            return _error(400, str(e), str(e).split(":")[0])
        try:
            prompt = chat_tokens(tok, chat_prompt(
                tok, [m.model_dump() for m in body.messages], body.tools,
                calling.parser if calling is not None else None, body.add_generation_prompt,
                body.continue_final_message, body.chat_template_kwargs))
        except ValueError as e:
            field = str(e).split(":")[0]
            return _error(400, str(e), field if field in ChatRequest.model_fields
                          else "messages")
        rid, now = f"chatcmpl-{request.state.request_id}", int(time.time())
        head = {"id": rid, "created": now, "model": self.model_name}
        echoed = body.echoed()

        def lp_json(lps):
            return chat_logprobs(lps, self._decode, self._names(body)) \
                if lps is not None else None

        if body.stream and not body.use_beam_search:
            streams: dict[tuple[int, int], ToolStream] = {}

            def chunk(i, c, text, lps, start):
                delta = {"content": text} if start else {"role": "assistant", "content": text}
                fin = c.finish_reason
                if calling is not None and calling.parser is not None:
                    delta, fin = _auto_delta(calling, streams, (i, c.index), delta, fin)
                elif calling is not None:  # the calls come whole, with the finish
                    delta = {} if start else {"role": "assistant"}
                    if fin:
                        message, fin = _answer_message(calling, c)
                        delta.update(message)
                        if "tool_calls" in delta:  # a stream's calls carry their index
                            delta["tool_calls"] = [{"index": k, **tc} for k, tc in
                                                   enumerate(message["tool_calls"])]
                if echoed and not start:
                    delta["content"] = echoed + (delta.get("content") or "")
                return {**head, "object": "chat.completion.chunk", "choices": [{
                    "index": c.index, "delta": delta, "token_ids": c.token_ids[start:],
                    "logprobs": lp_json(lps), "finish_reason": fin}]}
            return await self._run([prompt], body, request, chunk)
        outs = await (self._beam if body.use_beam_search else self._run)(
            [prompt], body, request)
        if isinstance(outs, JSONResponse):
            return outs
        choices = []
        for c in outs[0].outputs:
            message, fin = _answer_message(calling, c)
            if echoed:
                message["content"] = echoed + (message["content"] or "")
            choices.append({"index": c.index, "message": message, "token_ids": c.token_ids,
                            "logprobs": lp_json(c.logprobs), "finish_reason": fin})
        return {**head, "object": "chat.completion", "choices": choices,
                "usage": _usage(outs)}


def _renamed(err: JSONResponse) -> JSONResponse:
    """A chat path's error as the Responses request names its fields."""
    body = json.loads(bytes(err.body))
    e = body["error"]
    param = responses_field(e.get("param"))
    if param != e.get("param") and e["message"].startswith(f"{e['param']}:"):
        e["message"] = f"{param}:{e['message'][len(e['param']) + 1:]}"
    e["param"] = param
    return JSONResponse(body, status_code=err.status_code,
                        headers={k: v for k, v in err.headers.items()
                                 if k.lower() not in ("content-length", "content-type")})


def _answer_message(calling: ToolCalling | None, c) -> tuple[dict, str | None]:
    """A finished chat choice -> (its message, its finish reason): text, or with a
    forced tool call, the calls (text only if the answer was cut before it parses);
    under "auto", the calls the model wrote, if any, and the text around them."""
    if calling is not None and calling.parser is not None:
        content, calls = calling.read(c.text)
        fin = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
    else:
        calls = calling.calls(c.text) if calling is not None else None
        content = None if calls else c.text
        fin = calling.finish_reason if calls and c.finish_reason == "stop" \
            else c.finish_reason
    if calls is None:
        return {"role": "assistant", "content": content}, fin
    return {"role": "assistant", "content": content, "tool_calls": calls}, fin


def _auto_delta(calling: ToolCalling, streams: dict, key, delta: dict, fin
                ) -> tuple[dict, str | None]:
    """A streamed chunk under tool_choice "auto": its text up to where a call may begin
    (`ToolStream`); at the finish, the text held back that was no call, then the calls,
    whole, with their index."""
    assert calling.parser is not None
    stream = streams.setdefault(key, ToolStream(calling.parser, calling.names))
    delta = {**delta, "content": stream.feed(delta["content"])}
    if fin:
        rest, calls = stream.finish()
        delta["content"] += rest
        if calls:
            named = list(calls if calling.parallel else calls[:1])
            delta["tool_calls"] = [{"index": k, **tc} for k, tc in
                                   enumerate(openai_calls(named))]
            fin = "tool_calls" if fin == "stop" else fin
    return delta, fin


class _CompletionChoices:
    """Builds a completion's choices; streamed ones continue their logprobs' text
    offsets from the last token sent."""

    def __init__(self, body: CompletionRequest, decode, names=None):
        # names: how logprobs name tokens, where not by their text
        self.body, self.decode, self.names = body, decode, names or decode
        self.ends: dict[tuple[int, int], int] = {}  # text offset after the last token

    def __call__(self, i, c, text, lps, start=0, out=None) -> dict:
        body, lp, ids = self.body, None, c.token_ids[start:]
        echo = out is not None and body.echo
        if echo:  # the prompt first (its first token has no logprob)
            prompt_text = out.prompt if out.prompt is not None else \
                "".join(self.decode(out.prompt_token_ids))
            text, ids = prompt_text + text, out.prompt_token_ids + ids
        if lps is not None:
            plps = (out.prompt_logprobs or []) if echo else []
            lp = completion_logprobs(plps + list(lps), self.names,
                                     self.ends.get((i, c.index), 0), ids=ids if echo else None)
            if lp["tokens"]:
                self.ends[i, c.index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        ch = {"index": i * body.n + c.index, "text": text, "token_ids": ids,
              "finish_reason": c.finish_reason, "logprobs": lp}
        if out is not None and body.prompt_logprobs is not None:
            ch["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs, self.decode)
        return ch


def _usage(outs) -> dict:
    p = sum(len(o.prompt_token_ids) for o in outs)
    c = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.metrics.get("cached_tokens", 0) for o in outs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _param(message: str) -> str:
    """The request field a validation message is about (for the error's `param`)."""
    for name in ("kv_budget", "max_tokens", "logit_bias", "stop_token_ids", "n=",
                 "session_id", "priority"):
        if name in message:
            return name.rstrip("=")
    return "prompt"


def _checked(prompts: list, loop: EngineLoop, params: SamplingParams,
             priority: int = 0) -> list:
    _validated(prompts, loop, params, priority)
    return prompts


def _validated(prompts: list, loop: EngineLoop, params: SamplingParams,
               priority: int = 0) -> list[list[int]]:
    """Each prompt's token ids, every one checked (ValueError / TypeError naming the
    prompt where there are several)."""
    if not prompts:
        raise ValueError("prompt: empty list")
    out = []
    for i, p in enumerate(prompts):
        try:
            out.append(loop.engine.validate(p, params, priority=priority))
        except (ValueError, TypeError) as e:
            raise type(e)(f"prompt {i}: {e}" if len(prompts) > 1 else str(e)) from None
    return out


def listen(host: str, port: int) -> socket.socket:
    """A socket bound and listening on host:port (0: a free port), made before the engine
    starts, so that a port in use or an address not on this machine fails at once, not
    after the model and its workers are up; uvicorn then serves on it. OSError ->
    ValueError naming the address."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's own
            sock.bind(addr)
            sock.listen(2048)  # listening: SO_REUSEADDR lets no second server bind it now
        except OSError:
            sock.close()
            raise
    except OSError as e:
        hint = " (another server there? pick another --port)" \
            if e.errno == errno.EADDRINUSE else ""
        raise ValueError(f"cannot serve on {host}:{port}: {e.strerror or e}{hint}") from None
    return sock


def serve(llm, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
          config: ServerConfig | None = None, sock: socket.socket | None = None,
          autoscale=None, **uvicorn_kw: Any) -> None:
    """Serve an `LLM` until interrupted: its engine runs on this thread (the one that
    built the model; `EngineLoop.run` says why), HTTP on another. `autoscale`: an
    `AutoscaleConfig` whose autoscaler changes the memory workers meanwhile; without
    one, the LLM's `keeper` grows them back to its size (through the loop)."""
    from lamina.entrypoints.autoscale import AutoscaleRunner
    from lamina.entrypoints.metrics import EngineMetrics

    metrics = EngineMetrics()
    loop = EngineLoop(llm.engine, metrics, thread=False)
    runner = AutoscaleRunner(loop, autoscale) if autoscale is not None else None
    if llm.keeper is not None:  # (the loop's own now)
        if runner is not None:
            llm.keeper.stop()  # the autoscaler sets the count
        metrics.keep_size(llm.keeper)
    try:
        serve_loop(loop, model_name or llm.loaded.source, llm.loaded.tokenizer, host, port,
                   config, sock, **uvicorn_kw)
    finally:
        if runner is not None:
            runner.stop()


def serve_loop(loop, model_name: str, tokenizer, host: str = "127.0.0.1", port: int = 8000,
               config: ServerConfig | None = None, sock: socket.socket | None = None,
               **uvicorn_kw: Any) -> None:
    """Serve an engine loop (`EngineLoop`, or a service's `ServiceLoop`) until
    interrupted, on `sock` (`listen`; None: bound here). A loop made with thread=False
    runs here, and uvicorn in a thread."""
    import uvicorn

    try:
        sock = sock or listen(host, port)
    except ValueError:
        loop.shutdown()  # ended with the loop stopped, as when serving ends
        raise
    config = config or ServerConfig()
    app = build_app(loop, model_name, tokenizer, config)
    threaded = not isinstance(loop, EngineLoop) or loop.threaded
    if threaded:  # uvicorn on this thread: its own SIGTERM waits for open requests
        uvicorn_kw.setdefault("timeout_graceful_shutdown", config.shutdown_timeout_s)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=sock.getsockname()[1],
                                           **uvicorn_kw))
    try:
        if threaded:
            try:
                server.run(sockets=[sock])
            finally:
                loop.shutdown()
            return
        _serve_beside(loop, server, sock, config.shutdown_timeout_s)
    finally:
        sock.close()
    if not server.started:
        raise RuntimeError(f"the HTTP server could not serve on {host}:{port} (its error "
                           "is logged above)")


def _serve_beside(loop: EngineLoop, server, sock: socket.socket, drain_s: float) -> None:
    """The engine loop on this thread, uvicorn on another, until either stops. SIGTERM
    drains the loop (`EngineLoop.drain`) for at most `drain_s`; a second one, or 0 s,
    interrupts it as Ctrl-C does."""
    def on_sigterm(signum, frame):
        if drain_s <= 0 or loop.draining:
            raise KeyboardInterrupt
        loop.drain(drain_s)
        log.info("SIGTERM: finishing the requests in flight (at most %g s), answering new "
                 "ones 503; a second SIGTERM or Ctrl-C stops at once", drain_s)

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, on_sigterm) if main else None
    try:
        beside(loop, lambda: _run_http(server, sock),
               stop=lambda: setattr(server, "should_exit", True))
    except KeyboardInterrupt:
        pass
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
        loop.shutdown()


def _run_http(server, sock: socket.socket) -> None:
    try:
        server.run(sockets=[sock])
    except SystemExit:  # uvicorn's way out when it cannot start; it logged why
        pass

