"""vLLM's `/tokenize` and `/detokenize` routes: what a client needs to count and budget
tokens the way this server will.

Data in: a `TokenizeRequest` (a completion's `prompt`, or a chat's `messages` with its
`tools`) or a `DetokenizeRequest` (token ids), the served model's tokenizer, its
context length and vocabulary size. Data out: vLLM's answers, `{"count", "tokens",
"token_strs", "max_model_len"}` and `{"prompt"}`.

A chat is written by the same template and tool listing as `/v1/chat/completions`
(`chat_prompt`) and tokenized as the routes tokenize (a prompt with special tokens
added, a chat without: `chat_tokens`; unless `add_special_tokens` says otherwise), so
`count` is the `prompt_tokens` that route would report for the same messages.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from lamina.entrypoints.llm import chat_prompt


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None  # a completion's prompt, or
    messages: list[dict[str, Any]] | None = None  # a chat (with its tools)
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True  # a chat's: the assistant's turn opened
    continue_final_message: bool = False  # a chat's: its last message left open
    chat_template_kwargs: dict[str, Any] | None = None  # a chat's template variables
    # as the routes tokenize: a prompt with them (None: True), a chat without (None: False;
    # its template writes the special tokens it wants)
    add_special_tokens: bool | None = None
    return_token_strs: bool = False  # each token's text too


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


def tokenize(tokenizer, req: TokenizeRequest, max_len: int, parser=None) -> dict:
    """vLLM's /tokenize answer; ValueError naming the field at fault. `parser`: the
    server's tool-call parser (its tools' system prompt, as for tool_choice "auto")."""
    if (req.prompt is None) == (req.messages is None):
        raise ValueError("prompt: give either prompt or messages")
    if req.messages is not None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("messages: this model has no chat template")
        if req.messages == []:
            raise ValueError("messages: empty")
        text = chat_prompt(tokenizer, req.messages, req.tools, parser,
                           add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message,
                           template_kwargs=req.chat_template_kwargs)
    else:
        if req.tools is not None:
            raise ValueError("tools: only with messages")
        text = req.prompt
    special = req.add_special_tokens
    if special is None:
        special = req.messages is None
    ids = tokenizer(text, add_special_tokens=special)["input_ids"]
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": strs}


def detokenize(tokenizer, req: DetokenizeRequest, vocab_size: int) -> dict:
    """vLLM's /detokenize answer; ValueError naming `tokens` for an id past the
    vocabulary."""
    bad = [t for t in req.tokens if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"tokens: {bad[0]} is not a token id (the vocabulary has "
                         f"{vocab_size})")
    return {"prompt": tokenizer.decode(req.tokens)}
