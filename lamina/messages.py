"""The per-step messages between the engine and an executor; nothing else crosses.

Data in: `StepPlan` from the scheduler (which sequences, which tokens at which positions,
which KV slots). Data out: `StepResult` from the executor (next-token logits of the
sequences that sample this step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SeqWork:
    seq_id: int
    token_ids: tuple[int, ...]  # tokens fed this step
    start_pos: int  # position of token_ids[0]
    slots: tuple[int, ...]  # KV slot of every position 0 .. start_pos + len(token_ids) - 1
    sample: bool = True  # return logits of the last fed token
    worker: int = 0  # memory worker holding this sequence's KV (slots are its local ids)

    def __post_init__(self):
        if len(self.slots) != self.start_pos + len(self.token_ids) or not self.token_ids:
            raise ValueError(f"seq {self.seq_id}: {len(self.slots)} slots for positions "
                             f"0..{self.start_pos + len(self.token_ids) - 1}")


@dataclass(frozen=True)
class StepPlan:
    step: int
    seqs: tuple[SeqWork, ...]
    micro_batches: int = 1  # > 1: staggered pipelining over that many sub-batches

    def __post_init__(self):
        if not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"StepPlan.micro_batches must be an int >= 1, "
                             f"got {self.micro_batches!r}")

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass(frozen=True)
class StepResult:
    step: int
    seq_ids: tuple[int, ...]  # rows of `logits`, in plan order
    logits: torch.Tensor  # [R, V] fp32
    timings: dict | None = None  # seconds: dense, attention, ...
