"""Server-sent events and logprob JSON for the HTTP server (`lamina.entrypoints.api_server`).

Data in: the `EngineLoop` futures of one HTTP request and an asyncio queue that the
loop thread fills with (prompt index, partial `RequestOutput`) and, when a prompt's
future resolves, (prompt index, future). Data out: `data: {json}` events carrying each
choice's new text, token ids and logprobs since the last event, an optional usage
event, then `data: [DONE]`. If the client goes away (the generator is cancelled) the
unfinished requests are aborted, which frees their KV.
"""
from __future__ import annotations

import asyncio
import json
import logging
from concurrent.futures import Future
from typing import AsyncIterator, Callable

log = logging.getLogger("lamina.server")


def _event(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def sse_events(loop, futs: list[Future], updates: asyncio.Queue, chunk: Callable,
                     usage: Callable | None, continuous: bool = False,
                     request_id: str | None = None) -> AsyncIterator[str]:
    """chunk(prompt index, CompletionOutput, new text, new logprobs or None, tokens sent
    before) -> the event's JSON; usage(final outputs) -> the usage JSON of the last
    event (the others then carry `usage: null`, as OpenAI's do, or with `continuous`
    their choice's usage so far, as vLLM's `continuous_usage_stats`). `request_id`: the
    HTTP request's (`X-Request-Id`), named in the log line of a failure."""
    aloop = asyncio.get_running_loop()
    for i, f in enumerate(futs):
        f.add_done_callback(
            lambda f, i=i: aloop.call_soon_threadsafe(updates.put_nowait, (i, f)))
    sent: dict[tuple[int, int], tuple[int, int, bool]] = {}  # -> (tokens, chars, finished)
    finals: dict[int, object] = {}
    try:
        while len(finals) < len(futs):
            i, item = await updates.get()
            if isinstance(item, Future):
                try:
                    out = finals[i] = item.result()
                except Exception as e:  # noqa: BLE001 - the engine failed this request
                    log.warning("HTTP request %s failed: %s", request_id, e)
                    yield _event({"error": {"message": f"generation failed: "
                                            f"{type(e).__name__}: {e}",
                                            "type": "server_error"}})
                    break
            elif i in finals:
                continue  # a partial that arrived after its final
            else:
                out = item
            for c in out.outputs:
                n_tok, n_chr, fin = sent.get((i, c.index), (0, 0, False))
                if fin or (len(c.token_ids) == n_tok and not c.finish_reason):
                    continue
                lps = None if c.logprobs is None else c.logprobs[n_tok:]
                ev = chunk(i, c, c.text[n_chr:], lps, n_tok)
                if usage is not None:
                    ev["usage"] = _so_far(out, c) if continuous else None
                yield _event(ev)
                sent[i, c.index] = (len(c.token_ids), max(n_chr, len(c.text)),
                                    bool(c.finish_reason))
        else:
            if usage is not None:
                yield _event({"choices": [], "usage": usage([finals[i]
                                                             for i in range(len(futs))])})
        yield "data: [DONE]\n\n"
    finally:  # done, failed, or the client went away: stop whatever still runs
        for f in futs:
            loop.abort(f)


def _so_far(out, c) -> dict:
    """One choice's usage so far: its prompt's tokens and the tokens it has drawn."""
    p, n = len(out.prompt_token_ids), len(c.token_ids)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


def completion_logprobs(lps, decode: Callable, offset: int = 0, ids=None) -> dict:
    """OpenAI completions format; `offset`: characters of the completion before these
    tokens. An entry may be None (an echoed prompt's first token): then `ids` gives every
    entry's token and its logprob and top_logprobs are null."""
    toks = decode(ids if ids is not None else [t.token_id for t in lps])
    starts, at = [], offset
    for s in toks:
        starts.append(at)
        at += len(s)
    return {"tokens": toks, "token_logprobs": [t and t.logprob for t in lps],
            "top_logprobs": [t and dict(zip(decode([i for i, _ in t.top]),
                                            [v for _, v in t.top])) for t in lps],
            "text_offset": starts}


def vllm_prompt_logprobs(plps, decode: Callable) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob,
    decoded_token}} for the token itself and its top alternatives."""
    if plps is None:
        return None
    out = []
    for t in plps:
        if t is None:
            out.append(None)
            continue
        pairs = dict(t.top)
        pairs[t.token_id] = t.logprob
        out.append({str(i): {"logprob": v, "decoded_token": decode([i])[0]}
                    for i, v in pairs.items()})
    return out


def token_names(ids) -> list[str]:
    """vLLM's `return_tokens_as_token_ids` names for tokens: "token_id:<id>"."""
    return [f"token_id:{i}" for i in ids]


def chat_logprobs(lps, decode: Callable, names: Callable | None = None) -> dict:
    """OpenAI chat format; `names` (else `decode`) gives each entry's "token", whose
    "bytes" are its text's always (vLLM gives the top alternatives the bytes of their
    "token_id:<id>" names)."""
    def entry(tok_id, lp):
        s = decode([tok_id])[0]
        return {"token": names([tok_id])[0] if names else s, "logprob": lp,
                "bytes": list(s.encode())}

    return {"content": [{**entry(t.token_id, t.logprob),
                         "top_logprobs": [entry(i, v) for i, v in t.top]} for t in lps]}
