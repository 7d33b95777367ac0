"""Continuous-batching scheduler: plain Python over sequence ids and KV slot ids.

Data in: sequences added by the engine, sampled tokens after each step.
Data out: a `StepPlan` per step (via `schedule`), KV slots from the `KVAllocator`.

Each step every running sequence decodes one token (one new slot). Waiting sequences
are admitted in policy order (FIFO by default) while the batch has room and
`can_allocate` says their KV fits; an admitted sequence feeds all its tokens (prompt,
plus any tokens it generated before a preemption). When a running sequence cannot get
its next slot, the newest running sequences are preempted: their slots are freed and
they wait at the front of the queue, to be recomputed later. Nothing is dropped.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .kv_allocator import KVAllocator
from .messages import SeqWork, StepPlan
from .sampling import SamplingParams


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 64  # running sequences
    max_step_tokens: int = 4096  # tokens fed per step (prefill budget)

    def __post_init__(self):
        for f in ("max_batch", "max_step_tokens"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"SchedulerConfig.{f} must be a positive int, got {v!r}")


@dataclass
class Sequence:
    seq_id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    status: str = "waiting"  # waiting | running | finished
    finish_reason: str | None = None
    num_preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


def fifo(waiting: deque) -> list:
    return list(waiting)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: KVAllocator,
                 policy: Callable[[deque], list] = fifo):
        self.config, self.alloc, self.policy = config, allocator, policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: newest last
        self.step = 0

    def add(self, seq: Sequence) -> None:
        if len(seq.tokens) > self.alloc.config.num_slots:
            raise ValueError(f"sequence {seq.seq_id} needs {len(seq.tokens)} KV slots; the "
                             f"pool has {self.alloc.config.num_slots}")
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.alloc.free(seq.seq_id)
        self.running.remove(seq)
        seq.status, seq.num_preemptions = "waiting", seq.num_preemptions + 1
        self.waiting.appendleft(seq)

    def schedule(self) -> StepPlan:
        work: list[SeqWork] = []
        # 1. Decode: one new slot per running sequence, oldest first.
        for seq in list(self.running):
            if seq.status != "running":
                continue  # preempted while making room for an older one
            while not self.alloc.can_allocate(1):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status != "running":
                continue
            self.alloc.append(seq.seq_id)
            work.append(SeqWork(seq.seq_id, (seq.tokens[-1],), len(seq.tokens) - 1,
                                tuple(self.alloc.slots(seq.seq_id))))
        # 2. Admit waiting sequences in policy order while they fit.
        budget = self.config.max_step_tokens - len(work)
        for seq in self.policy(self.waiting):
            n = len(seq.tokens)
            if len(self.running) >= self.config.max_batch or n > budget \
                    or not self.alloc.can_allocate(n):
                break  # keep order: no overtaking
            self.waiting.remove(seq)
            self.alloc.allocate(seq.seq_id, n)
            seq.status = "running"
            self.running.append(seq)
            budget -= n
            work.append(SeqWork(seq.seq_id, tuple(seq.tokens), 0,
                                tuple(self.alloc.slots(seq.seq_id))))
        if not work and self.waiting:
            seq = self.waiting[0]
            raise RuntimeError(f"sequence {seq.seq_id} ({len(seq.tokens)} tokens) cannot be "
                               f"scheduled: step token budget {self.config.max_step_tokens}, "
                               f"{self.alloc.num_free()} free KV slots")
        plan = StepPlan(self.step, tuple(work))
        self.step += 1
        return plan

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = "finished", reason
        self.alloc.free(seq.seq_id)
        self.running.remove(seq)
