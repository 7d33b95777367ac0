"""What the engine hands back per request: `RequestOutput` with one `CompletionOutput` per
sample (n > 1: several), and `TokenLogprob`s when logprobs were asked for.

Data in: the engine's per-step view of a request. Data out: these plain dataclasses,
returned by `LLM.generate`, `LLMEngine.step` and streamed by the server.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    """A drawn token's logprob and the top alternatives (the model's distribution)."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error"; None while running
    logprobs: list[TokenLogprob] | None = None  # with SamplingParams.logprobs
    # beam search's rank of this beam: cumulative logprob / tokens ** length_penalty
    score: float | None = None

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(t.logprob for t in self.logprobs)


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: dict = field(default_factory=dict)
    finished: bool = True  # False: a streamed request's progress so far
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then each
    # token's logprob given the ones before it (and the top alternatives there)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None  # set when the request failed (finish reason "error")

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass(frozen=True)
class MemoryScale:
    """What `LLMEngine.scale_memory_workers` did."""
    before: int  # memory workers before
    after: int  # and after
    preempted: int  # running sequences preempted: they had KV on a leaving worker
    recompute_tokens: int  # their positions no kept pool or tier holds (computed again)
    moved_tokens: int  # saved positions (parked parts, sessions) moved to kept workers
    seconds: float
    # running sequences that went on: their KV on leaving workers moved into kept pools
    relocated: int = 0
    relocated_tokens: int = 0  # the KV positions (pool slots) those moves copied


@dataclass(frozen=True)
class WorkersWait:
    """A sequence larger than the pools there are, waiting for the memory workers to grow
    (`LLMEngine.waiting_for_workers`, while an autoscaler may grow them)."""
    seq_id: int
    tokens: int  # KV positions it needs
    workers: int  # memory workers whose pools hold them (there are fewer)
    waited_s: float  # so far
    wait_s: float  # at the most (then it fails alone)
