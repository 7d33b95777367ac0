"""vLLM's `use_beam_search` on /v1/completions and /v1/chat/completions.

Data in: a parsed request with `use_beam_search: true` (`n` is the beam width, as in
vLLM; `length_penalty`, HF's `early_stopping`, `ignore_eos`, `max_tokens`,
`include_stop_str_in_output`, `skip_special_tokens`, `logprobs`). Data out: the
request's `BeamSearchParams` for a prompt of a given length, or a `ValueError` naming a
field the search cannot honour (the server answers 400 with `param` set to it). The
rounds themselves run in `api_server._Api._beam` through the same queue, validation,
disconnect and failure handling as any request (`lamina.engine.beam_search`).

Refused with beam search, by name: `stream` (the beams are only known at the end; vLLM
refuses it too), a `temperature` other than 0 (the search is HF's deterministic one),
and every field that changes how a token is drawn (stop strings and ids, penalties,
top-p/k, min-p, biases, allowed or banned tokens, structured output, tools, per-request
KV sparsity) or asks for prompt logprobs: the search ranks the model's own logprobs, so
a client asking for them would silently get an answer that ignored them. So is a
`session_id` (a round's beams are requests of their own, not turns of a conversation;
an `X-Session-Id` header is not read for them). `seed` is taken (nothing is drawn at
random).
"""
from __future__ import annotations

from lamina.engine.beam_search import BeamSearchParams
from lamina.engine.outputs import RequestOutput, TokenLogprob

UNSUPPORTED = ("stream", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "min_tokens",
               "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
               "allowed_token_ids", "bad_words", "kv_sparsity", "kv_budget",
               "response_format", "structured_outputs", "guided_json", "guided_regex",
               "guided_choice", "guided_grammar", "prompt_logprobs", "tools", "tool_choice",
               "session_id")


def beam_params(body, max_tokens: int) -> BeamSearchParams:
    """The search a request asks for (its `n` beams, `max_tokens` new tokens at most)."""
    fields = type(body).model_fields
    for name in UNSUPPORTED:
        if name in fields and getattr(body, name) != fields[name].get_default(
                call_default_factory=True):
            raise ValueError(f"{name}: not supported with use_beam_search (the search ranks "
                             "the model's own logprobs; leave it at its default)")
    if "temperature" in body.model_fields_set and body.temperature != 0:
        raise ValueError(f"temperature: beam search here is deterministic (HF's num_beams "
                         f"without sampling): leave temperature out or 0, got "
                         f"{body.temperature!r}")
    if getattr(body, "echo", False) and body.num_logprobs() is not None \
            and "messages" not in fields:
        raise ValueError("echo: echo with logprobs is not supported with use_beam_search "
                         "(it needs the prompt's logprobs, which the search does not compute)")
    try:
        return BeamSearchParams(beam_width=body.n, max_tokens=max_tokens,
                                ignore_eos=body.ignore_eos, length_penalty=body.length_penalty,
                                early_stopping=body.early_stopping,
                                include_stop_str_in_output=body.include_stop_str_in_output,
                                skip_special_tokens=body.skip_special_tokens)
    except ValueError as e:
        name = str(e).split(" ")[0].removeprefix("BeamSearchParams.")
        raise ValueError(f"{'n' if name == 'beam_width' else name}: "
                         f"{str(e).split(' ', 1)[1]}") from None


def with_logprobs(out: RequestOutput, k: int | None) -> RequestOutput:
    """`out` with each beam's logprobs cut to the `k` alternatives asked for (None: none
    asked, so none shown)."""
    for c in out.outputs:
        c.logprobs = None if k is None or c.logprobs is None else [
            TokenLogprob(t.token_id, t.logprob, t.top[:k]) for t in c.logprobs]
    return out
