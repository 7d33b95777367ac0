"""Continuous-batching scheduler: plain Python over sequence ids and KV slot ids.

Data in: sequences added by the engine, sampled tokens after each step.
Data out: a `StepPlan` per step (via `schedule`), KV slots from one `KVAllocator` per
memory worker. Requests are partitioned across memory workers (paper 5.2, request-level):
a sequence is placed at admission on the worker with the most free slots, which keeps
KV bytes balanced.

Each step every running sequence decodes one token (one new slot). Waiting sequences
are admitted in policy order (FIFO by default) while the batch has room and
`can_allocate` says their KV fits; an admitted sequence feeds all its tokens (prompt,
plus any tokens it generated before a preemption). When a running sequence cannot get
its next slot, the newest running sequences are preempted: their slots are freed and
they wait at the front of the queue, to be recomputed later. Nothing is dropped.

Parallel sampling (n > 1): only the first sequence of a request is queued; its n - 1
siblings ride along as `forks`. The prompt is prefilled once, n tokens are drawn from
its last position, and `fork` then gives each sibling the parent's KV slots by
reference count (`KVAllocator.fork`); from there each appends its own slots.
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
    worker: int = -1  # memory worker while running
    finish_reason: str | None = None
    num_preemptions: int = 0
    seed: int = 0  # this sequence's sampling seed (draws are keyed by seed and position)
    forks: list["Sequence"] = field(default_factory=list)  # siblings not yet forked off

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


def fifo(waiting: deque) -> list:
    return list(waiting)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocators: KVAllocator | list[KVAllocator],
                 policy: Callable[[deque], list] = fifo):
        self.allocs = allocators if isinstance(allocators, list) else [allocators]
        self.config, self.policy = config, policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: newest last
        self.step = 0

    @property
    def alloc(self) -> KVAllocator:
        """The allocator, when there is one memory worker."""
        if len(self.allocs) != 1:
            raise AttributeError("several memory workers: use .allocs")
        return self.allocs[0]

    def add(self, seq: Sequence) -> None:
        cap = max(a.config.num_slots for a in self.allocs)
        if len(seq.tokens) > cap:
            raise ValueError(f"sequence {seq.seq_id} needs {len(seq.tokens)} KV slots; the "
                             f"largest memory worker pool has {cap}")
        self.waiting.append(seq)

    def _place(self, n: int) -> int | None:
        """Worker with the most free slots that can hold n more; None if none can."""
        best = max(range(len(self.allocs)), key=lambda w: (self.allocs[w].num_free(), -w))
        return best if self.allocs[best].can_allocate(n) else None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.allocs[seq.worker].free(seq.seq_id)
        self.running.remove(seq)
        seq.status, seq.num_preemptions = "waiting", seq.num_preemptions + 1
        self.waiting.appendleft(seq)

    def schedule(self) -> StepPlan:
        work: list[SeqWork] = []
        # 1. Decode: one new slot per running sequence, oldest first; a full worker
        #    preempts its newest sequences.
        for seq in list(self.running):
            if seq.status != "running":
                continue  # preempted while making room for an older one
            alloc = self.allocs[seq.worker]
            while not alloc.can_allocate(1):
                victim = [s for s in self.running if s.worker == seq.worker][-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status != "running":
                continue
            alloc.append(seq.seq_id)
            work.append(SeqWork(seq.seq_id, (seq.tokens[-1],), len(seq.tokens) - 1,
                                tuple(alloc.slots(seq.seq_id)), worker=seq.worker,
                                params=seq.params, seeds=(seq.seed,)))
        # 2. Admit waiting sequences in policy order while they fit.
        budget = self.config.max_step_tokens - len(work)
        for seq in self.policy(self.waiting):
            n, k = len(seq.tokens), len(seq.forks)
            w = self._place(n + k)  # room for each fork's first own slot too
            if len(self.running) + 1 + k > self.config.max_batch or n > budget or w is None:
                break  # keep order: no overtaking
            self.waiting.remove(seq)
            self.allocs[w].allocate(seq.seq_id, n)
            seq.status, seq.worker = "running", w
            self.running.append(seq)
            budget -= n
            work.append(SeqWork(seq.seq_id, tuple(seq.tokens), 0,
                                tuple(self.allocs[w].slots(seq.seq_id)), worker=w,
                                params=seq.params,
                                seeds=(seq.seed, *(f.seed for f in seq.forks))))
        if not work and self.waiting:
            seq = self.waiting[0]
            raise RuntimeError(f"sequence {seq.seq_id} ({len(seq.tokens)} tokens) cannot be "
                               f"scheduled: step token budget {self.config.max_step_tokens}, "
                               f"{[a.num_free() for a in self.allocs]} free KV slots")
        plan = StepPlan(self.step, tuple(work))
        self.step += 1
        return plan

    def fork(self, parent: Sequence) -> list[Sequence]:
        """After the parent's prefill: its pending forks share its KV slots and run."""
        kids, parent.forks = parent.forks, []
        for kid in kids:
            self.allocs[parent.worker].fork(parent.seq_id, kid.seq_id)
            kid.status, kid.worker = "running", parent.worker
            self.running.append(kid)
        return kids

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = "finished", reason
        self.allocs[seq.worker].free(seq.seq_id)
        self.running.remove(seq)
