"""The per-step messages between the engine and an executor (and `StartedMemory`, a
scale-up's hand-over between steps); nothing else crosses.

The data path of one step, and the file that owns each stage:

  StepPlan                    engine/scheduler.py   which sequences, tokens, positions,
     |                                              KV slots (diffs: new ones only once a
     |                                              table was sent; positions whose slots
     |                                              were given back), sampling (this file),
     |                        engine/engine.py      the tokens each draw may take
     |                                              (`SeqWork.allowed`; sampling/structured.py,
     |                                              sampling/token_rules.py)
     |                        engine/speculative.py  n-gram drafts fed after the last token
     |                                              (`SeqWork.draft`)
  whole slot tables           compute/compute_side.py  SlotTables: kept per sequence
     |  control frame         dataplane/control.py  one msgpack frame to the compute worker
     v                                              (Ray executor; in-process: a call)
  packed batch (PackedBatch)  compute/packing.py    all new tokens as one [1, N] row
     |
  per-worker parts            compute/packing.py    WorkerPart: each memory worker's rows,
     |                                              new slots and SlotBatch
  step metadata (META)        dataplane/protocol.py  once a step, slot tables as diffs
     |                        dataplane/tables.py    against those the memory end holds,
     |                        memory/tiers.py        and the step's KV tier orders (session
     |                                               saves, demotions, prefetches, loads)
     v  per layer:
  q|k|v frames  ----------->  dataplane/protocol.py  SocketLink (compute end) -> MemoryServer
                                                     (memory end); which path: paths.py
  attention                   memory/memory_side.py  write k/v into the pool, attend
                              kernels/               (C++ on CPU pools, Triton on GPU pools)
  o|lse frames  <-----------  dataplane/protocol.py  outputs back, merged by LSE where a
     |                                               sequence's KV is split
  dropped keys  <-----------  memory/sparsity.py     after the last layer, when the plan
     |                                               asks: keys h2o / snapkv left out at
     |                                               every layer (their slots go back)
     v  after the last layer:
  sampled tokens              compute/compute_side.py + sampling/sampler.py (a draft:
     |                                              drawn after each guessed token, kept
     |                                              up to the first miss)
     |
  StepResult                  this file             token ids (and logprobs) in plan order,
     |                                              dropped keys
     |  control frame         dataplane/control.py
     v
  RequestOutput               engine/engine.py      appended, detokenized, finished

Typed throughout: `lamina.dataplane.control` sends the plan and the result as msgpack
decoded by these types, so a malformed message is refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lamina.memory.tier_orders import TierOrder
from lamina.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)

@dataclass(frozen=True)
class SeqWork:
    seq_id: int
    token_ids: tuple[int, ...]  # tokens fed this step
    start_pos: int  # position of token_ids[0]
    # KV slots of positions slots_from .. start_pos + len(token_ids) - 1. A plan carries
    # only what the executor lacks: the whole table (slots_from 0) on a sequence's first
    # step (admission, re-admission after preemption, a fork's first step), then just
    # the new positions' slots (slots_from = start_pos), so a decode plan is O(batch).
    # The compute side keeps each sequence's table (`compute_side.SlotTables`).
    slots: tuple[int, ...]
    sample: bool = True  # draw after the last fed token
    worker: int = 0  # memory worker holding this sequence's KV (slots are its local ids)
    params: SamplingParams = GREEDY
    seeds: tuple[int, ...] = (0,)  # one draw per seed (> 1: the n forks of a prompt)
    # KV split over workers: (worker, first position) per contiguous range, in order; the
    # slots of range i are local ids on its worker. Empty: all on `worker`.
    segments: tuple[tuple[int, int], ...] = ()
    # penalties only (params.penalized): every token so far, prompt first, and how many
    # of them are the prompt (the compute side keeps no per-sequence state)
    history: tuple[int, ...] = ()
    prompt_len: int = 0
    slots_from: int = 0  # the position of slots[0]
    # positions [a, b) whose KV slots were given back (its KV policy never reads them
    # again: `lamina.memory.sparsity_config.evictable`); their table entries are -1 and
    # its attention lists the other positions only. (0, 0): none. Sent every step.
    evicted: tuple[int, int] = (0, 0)
    # positions whose KV slots were given back with this plan (a diff: earlier ones
    # stay holes) because a scoring policy (h2o, snapkv) left their keys out at every
    # layer for good (`StepResult.dropped`); their attention lists the rest only
    dropped: tuple[int, ...] = ()
    # the tokens this draw may take (structured output, min_tokens, allowed_token_ids,
    # bad_words), a bitmask (bit t & 7 of byte t >> 3 = token t); empty: any token.
    # With a draft, draft + 1 bitmasks of equal length, one per draw, in order
    allowed: bytes = b""
    # speculative decoding (engine/speculative.py): the last `draft` fed tokens are a
    # guess at what comes next. The step draws after each of the last draft + 1 fed
    # tokens (each at its own position, with its seed) and keeps the draws up to and
    # including the first that differs from the guess: 1..draft + 1 tokens, the same
    # tokens as drawing one a step (an exact rejection test for a one-token guess)
    draft: int = 0

    def __post_init__(self):
        end = self.start_pos + len(self.token_ids)
        if (not 0 <= self.slots_from <= self.start_pos
                or len(self.slots) != end - self.slots_from or not self.token_ids):
            raise ValueError(f"seq {self.seq_id}: {len(self.slots)} slots from position "
                             f"{self.slots_from} for positions 0..{end - 1}")
        a, b = self.evicted
        if not 0 <= a <= b <= self.start_pos or (b > a and len(self.placement) > 1):
            raise ValueError(f"seq {self.seq_id}: evicted positions {a}..{b - 1} must come "
                             f"before position {self.start_pos}, on one memory worker")
        if self.dropped and (min(self.dropped) < 0 or max(self.dropped) >= self.start_pos
                             or len(self.placement) > 1):
            raise ValueError(f"seq {self.seq_id}: dropped positions {min(self.dropped)}.."
                             f"{max(self.dropped)} must come before position "
                             f"{self.start_pos}, on one memory worker")
        if self.sample and not self.seeds:
            raise ValueError(f"seq {self.seq_id}: sampling needs at least one seed")
        if self.draft and not (0 < self.draft < len(self.token_ids) and self.sample
                               and len(self.seeds) == 1
                               and len(self.allowed) % (self.draft + 1) == 0):
            raise ValueError(f"seq {self.seq_id}: a draft of {self.draft} tokens needs "
                             f"more fed tokens ({len(self.token_ids)}), one seed, and a "
                             f"bitmask per draw or none")
        seg = self.placement
        starts, workers = [a for _, a in seg], [w for w, _ in seg]
        if (starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:]))
                or starts[-1] >= end or len(set(workers)) != len(workers)):
            raise ValueError(f"seq {self.seq_id}: bad KV segments {seg} for {end} positions")

    @property
    def placement(self) -> tuple[tuple[int, int], ...]:
        """(worker, first position) of each KV range."""
        return self.segments or ((self.worker, 0),)

    @property
    def next_pos(self) -> int:
        """Position of the token this step draws (with a draft: the last one it may)."""
        return self.start_pos + len(self.token_ids)

    @property
    def guess(self) -> tuple[int, ...]:
        """The drafted tokens (the last `draft` fed)."""
        return self.token_ids[len(self.token_ids) - self.draft:] if self.draft else ()


@dataclass(frozen=True)
class StepPlan:
    step: int
    seqs: tuple[SeqWork, ...]
    micro_batches: int = 1  # > 1: staggered pipelining over that many sub-batches
    # sequences whose slot tables the compute side drops (finished, preempted, failed
    # since the last plan): applied before `seqs`, idempotent
    released: tuple[int, ...] = ()
    # sessions' KV moves on the memory workers (lamina.memory.tiers), carried out before
    # the step's layers in order: saves of finished turns, demotions, prefetches, drops,
    # and loads into the slots of sequences this step admits
    tier_orders: tuple[TierOrder, ...] = ()
    # the memory workers say which keys their scoring policies left out at every layer
    # for good (`StepResult.dropped`), so their slots can be given back
    report_dropped: bool = False

    def __post_init__(self):
        if not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ValueError(f"StepPlan.micro_batches must be an int >= 1, "
                             f"got {self.micro_batches!r}")

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


# (logprob, top ids, top logprobs) of one drawn token
TokenLogprobs = tuple[float, tuple[int, ...], tuple[float, ...]]
# a prompt's tokens 1..: (logprob of each, top ids per token, top logprobs per token)
PromptLogprobs = tuple[tuple[float, ...], tuple[tuple[int, ...], ...],
                       tuple[tuple[float, ...], ...]]


@dataclass(frozen=True)
class DroppedKeys:
    """Keys of one sequence that its memory worker's scoring policy (h2o, snapkv) left
    out at every layer for good, newly this step: their slots may be given back."""

    seq_id: int
    worker: int
    slots: tuple[int, ...]  # local slot ids on that worker


@dataclass(frozen=True)
class StepResult:
    step: int
    seq_ids: tuple[int, ...]  # sampling sequences, in plan order
    # per sequence, one token per seed; with a draft (`SeqWork.draft`), the tokens it
    # keeps, in order
    token_ids: tuple[tuple[int, ...], ...]
    timings: dict[str, int | float] | None = None  # seconds: dense, attention, sample, ...
    # per sequence: None, or per drawn token (logprob, top ids, top logprobs)
    logprobs: tuple[tuple[TokenLogprobs, ...] | None, ...] | None = None
    # per sequence: None, or for its prompt tokens 1.. (logprobs, top ids, top logprobs)
    prompt_logprobs: tuple[PromptLogprobs | None, ...] | None = None
    dropped: tuple[DroppedKeys, ...] = ()  # when the plan asked (`report_dropped`)


@dataclass(frozen=True)
class StartedMemory:
    """Memory workers an executor started for indices first..first+count-1
    (`Executor.start_memory_workers`), not yet in its steps: what a scale-up hands from
    the thread that started them to the engine's (`LLMEngine.scale_memory_workers`)."""
    first: int
    count: int
    workers: Any = None  # the executor's own: its worker objects and their placement
