"""Continuous-batching scheduler: plain Python over sequence ids and KV slot ids.

Data in: sequences added by the engine, sampled tokens after each step.
Data out: a `StepPlan` per step (via `schedule`), KV slots from one `KVAllocator` per
memory worker. Requests are partitioned across memory workers (paper 5.2, request-level):
a sequence is placed at admission on the worker with the most free slots, which keeps
KV bytes balanced.

Each step every running sequence decodes one token (one new slot). Waiting sequences
are admitted in policy order while the batch has room and
`can_allocate` says their KV fits; an admitted sequence feeds its tokens (prompt, plus
any tokens it generated before a preemption) within the step's token budget
(`max_step_tokens`): a prompt longer than the budget left is fed in chunks over the next
steps (`Sequence.pending`), before any new admission, and draws after its last chunk
only. Its slots are all allocated at admission. When a running sequence cannot get
its next slot, the newest running sequences are preempted: their slots are freed and
they wait at the front of the queue, to be recomputed later. Nothing is dropped. With
prefix caching a preempted sequence's KV stays cached (evictable, from its end first,
as others need the slots), so its readmission recomputes only what was taken. With the
session tiers and `swap` (`EngineConfig.preemption_mode`), its KV is also saved to its
workers' host tiers, each worker's part to its own (`_park`), and its readmission loads
from there what the pools' cache lost, each part back onto its worker (`_parts_hit`):
only the last drawn token is computed, or also positions its first worker had no room
to take back (`Skip`) (`Sequence.recomputed` counts the positions a readmission did
compute again).

Policies (`SchedulerConfig.policy`): "fcfs" serves sequences in arrival order.
"priority" (vLLM's convention: a lower `Sequence.priority` is served first; ties in
arrival order) decodes, feeds chunks and admits in priority order; a sequence that
needs a slot preempts the lowest-priority (newest among equals) sequence on its worker;
and a waiting sequence that does not fit (the batch is full or its KV has no room)
preempts running sequences of strictly lower priority, lowest and newest first, until it
fits or none is left. A preempted sequence's work is taken out of the step being planned.

Parallel sampling (n > 1): only the first sequence of a request is queued; its n - 1
siblings ride along as `forks`. The prompt is prefilled once, n tokens are drawn from
its last position, and `fork` then gives each sibling the parent's KV slots by
reference count (`KVAllocator.fork`); from there each appends its own slots.

Eviction: with an `evict` rule (the engine's, for `streaming`), a decoding sequence's
positions that its policy will never read again give their slots back (`drop`: holes in
its table), `evict_chunk` at a time, and its plans say which (`SeqWork.evicted`). With a
`drops` rule (for `h2o` / `snapkv`), plans ask the memory workers which keys those
sequences' policies left out at every layer for good (`StepPlan.report_dropped`); the
engine hands the answer to `note_dropped`, and their slots go back the same way,
`evict_chunk` at a time (`SeqWork.dropped`).

KV split (paper 5.2): with `split_kv`, a sequence whose worker is full spills its next
slots onto another worker instead of being preempted, and a prompt larger than any one
worker's free slots is spread over several. A sequence holds at most one contiguous
position range per worker (`Sequence.segments`); the executor sends its queries to each
and merges the partial attentions exactly by log-sum-exp. Memory workers may join and
leave (`add_workers`, `retire_workers`); while the pools may grow to `ceiling` workers
(an autoscaler runs), a sequence larger than the pools there are, alone, is no fault: it
waits, `short` of the workers it needs, which the autoscaler reads.
"""
from __future__ import annotations

import itertools
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from lamina.engine.messages import SeqWork, StepPlan
from lamina.engine.prefix_cache import RadixCache
from lamina.engine.sessions import SessionIndex, TierMatch
from lamina.engine.speculative import NgramIndex
from lamina.errors import SequenceFault
from lamina.memory.allocator import KVAllocator
from lamina.memory.tier_orders import SlotMove
from lamina.sampling.params import SamplingParams

POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class Part:
    """A sequence's positions start..end-1 whose KV is on one memory worker (a KV split
    over workers has one per worker, in position order)."""

    worker: int
    start: int
    end: int


@dataclass(frozen=True)
class PartsHit:
    """What a readmission takes back of its parked parts (`Scheduler._parts_hit`): its
    pool slots on its first worker, where its first worker's range ends, and the later
    parts to load (empty: none)."""

    hit: list[int]
    end: int
    parts: list[Part]


@dataclass(frozen=True)
class Skip:
    """Positions start..end-1 of a readmitted sequence whose KV is loaded (`loads`:
    (tier entry, pool slots)) once the positions before them are computed: its
    parts' KV comes back after a gap its first worker could not hold."""

    start: int
    end: int
    loads: tuple[tuple[str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class Shortfall:
    """A waiting sequence that fits no pools there are, alone, but fits more memory
    workers (up to `Scheduler.ceiling`): it waits for them."""

    seq_id: int
    tokens: int  # KV positions it needs (its tokens and the next one's)
    workers: int  # memory workers that hold them


@dataclass(frozen=True)
class Retired:
    """What `Scheduler.retire_workers` did with the running sequences that had KV on the
    leaving memory workers: `moved` go on, their parts there now on kept workers' slots
    once `moves` are copied (before the workers leave); `preempted` could not move (no
    room on a kept worker, positions given back, loads to come)."""

    moved: list[Sequence]
    moves: tuple[SlotMove, ...]
    preempted: list[Sequence]


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 64  # running sequences
    max_step_tokens: int = 4096  # tokens fed per step (longer prompts: in chunks)
    split_kv: bool = True  # a sequence's KV may span memory workers
    # evicted positions are given back this many at a time (fewer, larger table changes:
    # the memory workers' held tables are re-sent from the hole on when it grows)
    evict_chunk: int = 64
    policy: str = "fcfs"  # or "priority": see the module's docstring

    def __post_init__(self):
        for f in ("max_batch", "max_step_tokens", "evict_chunk"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"SchedulerConfig.{f} must be a positive int, got {v!r}")
        if not isinstance(self.split_kv, bool):
            raise ValueError(f"SchedulerConfig.split_kv must be a bool, got {self.split_kv!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"SchedulerConfig.policy must be one of {POLICIES}, got "
                             f"{self.policy!r}")


@dataclass
class Sequence:
    seq_id: int
    prompt: list[int]
    params: SamplingParams
    output: list[int] = field(default_factory=list)
    status: str = "waiting"  # waiting | running | finished
    segments: list[tuple[int, int]] = field(default_factory=list)  # (worker, first pos)
    finish_reason: str | None = None
    num_preemptions: int = 0
    seed: int = 0  # this sequence's sampling seed (draws are keyed by seed and position)
    forks: list["Sequence"] = field(default_factory=list)  # siblings not yet forked off
    logprobs: list = field(default_factory=list)  # per output token, if asked for
    cached: int = 0  # prompt tokens its first admission reused (prefix cache or tiers)
    session: str | None = None  # the conversation it continues (engine/sessions.py)
    tier_cached: int = 0  # of `cached`, the positions loaded from the session's tiers
    # positions whose KV slots the executor holds in its table of this sequence (0: it
    # holds none: the next plan sends the whole table)
    sent: int = 0
    # of its tokens, how many wait to be fed (a prompt longer than a step's token budget
    # is fed in chunks; its slots are all allocated at admission)
    pending: int = 0
    evicted: tuple[int, int] = (0, 0)  # positions [a, b) whose slots were given back
    # positions of its own KV cached when it was preempted (by a full pool or a
    # recovery), which its readmission takes back on that worker
    kept: int = 0
    # h2o / snapkv: slots its memory worker reported left out at every layer for good
    # (`note_dropped`), given back `evict_chunk` or more at a time; the positions given
    # back with the next plan; the first position given back so (-1: none)
    pending_drop: list[int] = field(default_factory=list)
    new_drops: tuple[int, ...] = ()
    first_dropped: int = -1
    ngrams: NgramIndex | None = None  # speculative decoding: its n-grams' index
    priority: int = 0  # policy "priority": lower is served first
    # preemptions: the tier entry holding its KV saved when it was last preempted (None:
    # none); positions whose KV it had then; positions readmissions computed again
    parked: str | None = None
    # of that KV, each worker's part, in position order (the first is `parked`'s; a later
    # one has an entry of its own on its worker: `Scheduler.part_key`)
    parts: tuple[Part, ...] = ()
    skip: Skip | None = None  # positions its chunks skip, loaded instead (`Skip`)
    lost: int = 0
    recomputed: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)  # O(1): decode steps use it, not tokens

    @property
    def written(self) -> int:
        """Positions whose KV earlier steps wrote: every position fed but the last drawn
        token's (not yet fed) and the prompt's unfed rest."""
        return self.num_tokens - max(1, self.pending)

    @property
    def last_token(self) -> int:
        return self.output[-1] if self.output else self.prompt[-1]

    @property
    def holes_from(self) -> int | None:
        """The first position whose slot was given back (None: none was)."""
        firsts = [p for p in (self.evicted[0] if self.evicted[1] > self.evicted[0] else -1,
                              self.first_dropped) if p >= 0]
        return min(firsts) if firsts else None

    @property
    def worker(self) -> int:
        """The memory worker its next token's KV goes to (-1 while not running)."""
        return self.segments[-1][0] if self.segments else -1

    @property
    def workers(self) -> list[int]:
        return [w for w, _ in self.segments]

    def parts_upto(self, upto: int) -> list[Part]:
        """Its first `upto` positions as one `Part` per worker holding some of them."""
        bounds = [a for _, a in self.segments[1:]] + [upto]
        return [Part(w, a, min(b, upto)) for (w, a), b in zip(self.segments, bounds)
                if a < min(b, upto)]


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocators: KVAllocator | list[KVAllocator],
                 prefix_caching: bool = False,
                 sessions: SessionIndex | None = None,
                 evict: Callable[[Sequence], tuple[int, int] | None] | None = None,
                 scores_prompt: Callable[[Sequence], bool] | None = None,
                 drops: Callable[[Sequence], bool] | None = None,
                 admits: Callable[[Sequence], bool] | None = None,
                 propose: Callable[[Sequence, int], tuple[int, ...]] | None = None,
                 sparse: Callable[[Sequence], bool] | None = None, swap: bool = False):
        self.allocs = allocators if isinstance(allocators, list) else [allocators]
        self.config = config
        # whether a sequence's KV policy scores its whole prompt where it is stored
        # (h2o, snapkv, swa): such a prompt is computed, never taken from a cache
        self.scores_prompt = scores_prompt or (lambda seq: False)
        # a decoding sequence's positions its KV policy will never read again (its
        # slots are given back), or None; None: no eviction
        self.evict = evict
        # whether a sequence's KV policy drops keys for good on its memory worker (their
        # slots may go back when reported); None: none does
        self.drops = drops
        self.sessions = sessions  # sessions' KV beyond the pools; None: no tiers
        # whether a sequence preempted for room saves its KV to the tiers (`_park`)
        self.swap = swap and sessions is not None
        self.parked_tokens = 0  # positions `_park` saved
        self.num_preemptions = 0  # sequences preempted for room (or workers leaving)
        # whether a waiting sequence may be admitted now (the engine's culprit search
        # holds the others back; they keep their place); None: every one
        self.admits = admits
        # speculative decoding: a decoding sequence's draft of at most n tokens (empty:
        # none), fed after its last token (`engine/speculative.py`); None: no drafts
        self.propose = propose
        # whether a sequence's KV policy cuts its decode rows, which memory workers tell
        # by their one query: its prompt's last position is then never fed alone (from a
        # cached prefix or a chunk's tail), so the prompt attends whole as when fed at once
        self.sparse = sparse or (lambda seq: False)
        # one radix tree per memory worker (`prefix_cache`); None: no caching
        self.caches = [RadixCache(a) for a in self.allocs] if prefix_caching else None
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: newest last
        self.step = 0
        # sequences the executor holds a slot table of that were released since the
        # last plan (the next plan tells it to drop them)
        self._released: list[int] = []
        # waiting sequences found unable ever to be placed (alone, they do not fit the
        # pools: a KV policy's recompute, a pool shrunk): the engine fails their requests
        self.unplaceable: list[SequenceFault] = []
        # memory workers the pools may be grown to (by an autoscaler); 0: no more than
        # there are. A sequence that fits that many waits for them (`short`)
        self.ceiling = 0
        self.short: Shortfall | None = None  # the last plan's (None: no sequence waits so)

    @property
    def alloc(self) -> KVAllocator:
        """The allocator, when there is one memory worker."""
        if len(self.allocs) != 1:
            raise AttributeError("several memory workers: use .allocs")
        return self.allocs[0]

    def add(self, seq: Sequence) -> None:
        if self.workers_for(len(seq.tokens)) is None:
            raise ValueError(f"sequence {seq.seq_id} needs {len(seq.tokens)} KV slots; the "
                             f"memory workers hold {self.capacity()} in all")
        self.waiting.append(seq)

    def capacity(self, workers: int | None = None) -> int:
        """The KV positions one sequence may hold: its worker's pool, or with `split_kv`
        every pool's, of `workers` memory workers (None: those there are, or `ceiling`
        when that is more)."""
        n = max(len(self.allocs), self.ceiling) if workers is None else workers
        slots = self.allocs[0].config.num_slots  # (every pool has as many)
        return slots * (n if self.config.split_kv else 1)

    def workers_for(self, n: int) -> int | None:
        """The memory workers n KV positions of one sequence need (one, or with
        `split_kv` as many pools as they fill); None: more than `capacity`."""
        if n > self.capacity():
            return None
        return -(-n // self.allocs[0].config.num_slots) if self.config.split_kv else 1

    def _place(self, n: int) -> list[tuple[int, int]] | None:
        """[(worker, slots)] for n new slots: the worker with the most free slots if it
        can hold them all, else (split_kv) the fewest most-free workers; None if not."""
        order = sorted(range(len(self.allocs)), key=lambda w: (-self.allocs[w].num_free(), w))
        for w in order[:1] if self.caches is None else order:
            if self._room(w, n):
                return [(w, n)]
        if not self.config.split_kv:
            return None
        if self.caches is not None and sum(a.num_free() for a in self.allocs) < n <= sum(
                a.num_free() + c.evictable() for a, c in zip(self.allocs, self.caches)):
            for c in self.caches:  # a prompt no one worker holds: the cache yields
                c.evict(c.evictable())
        plan, left = [], n
        for w in order:
            take = min(left, self.allocs[w].num_free())
            if take:
                plan.append((w, take))
                left -= take
            if not left:
                return plan
        return None

    def _spill(self, seq: Sequence) -> int | None:
        """A worker this sequence has no range on that can take one more slot, the most
        free first, evicting a cached prefix if need be (a live sequence wins over the
        cache, as in `_room`); not for a sequence with positions given back: those stay
        on one worker."""
        if not self.config.split_kv or seq.holes_from is not None:
            return None
        ws = sorted((w for w in range(len(self.allocs)) if w not in seq.workers),
                    key=lambda w: (-self.allocs[w].num_free(), w))
        return next((w for w in ws if self._room(w, 1)), None)

    def _room(self, w: int, n: int) -> bool:
        """Whether worker w can take n more slots, evicting cached prefixes if need be
        (a live sequence always wins over the cache)."""
        a = self.allocs[w]
        if (not a.can_allocate(n) and self.caches is not None
                and a.num_free() + self.caches[w].evictable() >= n):
            self.caches[w].evict(n - a.num_free())
        return a.can_allocate(n)

    def _hit(self, seq: Sequence, extra: int) -> tuple[int, list[int]]:
        """(worker, cached slots) of seq's longest cached prefix on a worker that can
        hold the rest (+ `extra` fork slots); ([], -1) if none. At least the last token is
        fed, so the step draws from it."""
        if (self.caches is None or seq.params.prompt_logprobs is not None
                or self.scores_prompt(seq)):
            return -1, []  # prompt logprobs need every prompt position computed
        n = len(seq.tokens)
        hits = sorted(((c.match(seq.tokens, n - self._last_fed(seq)), w)
                       for w, c in enumerate(self.caches)),
                      key=lambda h: (-len(h[0]), h[1]))
        most = max(a.num_free() for a in self.allocs)
        for slots, w in hits:
            # Keep the workers balanced: reuse on w only if w is left no fuller than the
            # most-free worker would be holding the whole sequence (else recompute there)
            # (or the sequence's own KV, cached when it was preempted: it was placed there)
            if (slots and (len(slots) >= most - self.allocs[w].num_free()
                           or 0 < seq.kept <= len(slots))
                    and self._room_after(w, slots, n - len(slots), 0, extra, seq.kept > 0)):
                return w, slots
        return -1, []

    def _tier_hit(self, seq: Sequence, extra: int, w: int,
                  hit: list[int]) -> tuple[int, list[int], TierMatch | None]:
        """Where seq's session (or its own KV, saved when it was preempted) has more of
        its tokens saved in the tiers than the pool hit holds: (its worker, the pool
        slots of the prefix there, the match); else (w, hit, None) unchanged."""
        if self.sessions is None or not self._tiers_serve(seq):
            return w, hit, None
        n = len(seq.tokens)
        found = [self.sessions.match(key, seq.tokens, n - self._last_fed(seq))
                 for key in (seq.parked, seq.session) if key is not None]
        m = max((x for x in found if x is not None), key=lambda x: x.upto, default=None)
        if m is None or m.upto <= len(hit):
            return w, hit, None
        pool = (self.caches[m.worker].match(seq.tokens, m.upto) if self.caches is not None
                else [])  # any start of it still in the pool is shared, not loaded
        if not self._room_after(m.worker, pool, n - len(pool), m.upto - len(pool), extra,
                                True):
            return w, hit, None
        return m.worker, pool, m

    def _parts_hit(self, seq: Sequence, extra: int, w: int, hit: list[int],
                   tier: TierMatch | None) -> PartsHit:
        """A readmission's later parts of its KV saved when it was preempted (`_park`),
        each to be loaded back onto its worker (a range per worker, as before): those
        still saved that fit there, in order. Its first worker keeps its first part
        whole (from its pool and tier: `hit` cut to it, as another sequence's cached KV
        may match further) or, with no room there, what its pool still holds: the
        positions between are then computed on the next part's worker before the
        parts are loaded (`Skip`)."""
        none = PartsHit(hit, 0, [])
        if len(seq.parts) < 2 or extra or self.sessions is None:
            return none
        first = seq.parts[0]
        if w not in (-1, first.worker) or (tier is not None and (
                tier.session != seq.parked or tier.shift)):
            return none
        if tier is None and self.caches is not None:  # (`_hit` may have found no room)
            hit = self.caches[first.worker].match(seq.tokens, first.end)
        whole = (tier.upto if tier is not None else len(hit)) >= first.end
        if not (whole or tier is None) or (not whole and self.sparse(seq)):
            return none  # (a sparse one: its gap might be one decode-like row)
        end = first.end if whole else len(hit)
        limit, parts = len(seq.tokens) - self._last_fed(seq), []
        for p in seq.parts[1:]:
            m = self.sessions.match(self.part_key(seq, p), seq.tokens[p.start:p.end],
                                    p.end - p.start)
            if (p.end > limit or m is None or m.worker != p.worker
                    or m.prefix < p.end - p.start):
                break
            parts.append(p)
        while parts and not self._room_parts(seq, hit[:end], end, parts):
            parts.pop()
        return PartsHit(hit[:end], end, parts) if parts else none

    def _room_parts(self, seq: Sequence, hit: list[int], end: int, parts: list[Part]) -> bool:
        """Room for seq's positions 0..end-1 on its first worker (the pool's `hit`
        there kept), `parts` on their workers (the first of them from `end` on), and the
        positions after them on the last one's worker, or what it cannot take on the
        workers seq does not use (`_spill_rest`); cached prefixes evicted where they
        must be."""
        first = seq.parts[0]
        if end > len(hit) and not self._room_keeping(first.worker, end - len(hit), hit):
            return False
        starts = [end] + [p.start for p in parts[1:]]  # where each worker's range starts
        sizes = [p.end - a for p, a in zip(parts, starts)]
        if not all(self._room(p.worker, n) for p, n in zip(parts[:-1], sizes)):
            return False
        used = {first.worker, *(p.worker for p in parts)}
        others = sum(self._capacity(v) for v in range(len(self.allocs)) if v not in used)
        rest = len(seq.tokens) - parts[-1].end
        return self._room(parts[-1].worker, sizes[-1] + max(0, rest - others))

    def _place_parts(self, seq: Sequence, got: PartsHit) -> None:
        """seq's slots as `_room_parts` planned them; its parts' loads ordered, or
        after a gap left to its feed (`Skip`)."""
        n, first, last = len(seq.tokens), seq.parts[0], got.parts[-1]
        if got.end:
            self.allocs[first.worker].adopt(seq.seq_id, got.hit, got.end - len(got.hit))
            seq.segments.append((first.worker, 0))
        starts = [got.end] + [p.start for p in got.parts[1:]]  # (as `_room_parts`)
        here = min(n - starts[-1], self.allocs[last.worker].num_free())
        self._allocate(seq, [(p.worker, p.end - a) for p, a in zip(got.parts[:-1], starts)]
                       + [(last.worker, here)], got.end)
        if starts[-1] + here < n:
            self._spill_rest(seq, starts[-1] + here)
        loads = tuple((self.part_key(seq, p), tuple(
            self.allocs[p.worker].slots(seq.seq_id)[p.start - a:p.end - a]))
            for p, a in zip(got.parts, starts))
        if got.end < first.end:
            seq.skip = Skip(first.end, last.end, loads)
        else:
            self._load_parts(seq, loads)

    def _load_parts(self, seq: Sequence, loads: tuple[tuple[str, tuple[int, ...]], ...]
                    ) -> None:
        """Order each (part's entry, pool slots) loaded from its worker's tier."""
        assert self.sessions is not None
        for key, slots in loads:
            self.sessions.load(key, seq.seq_id, 0, list(slots))

    def _tiers_serve(self, seq: Sequence) -> bool:
        """Whether the tiers may give seq KV: not when every prompt position must be
        computed (prompt logprobs, a policy scoring its prompt)."""
        return (self.sessions is not None and seq.params.prompt_logprobs is None
                and not self.scores_prompt(seq))

    def _load(self, seq: Sequence, m: TierMatch, first: int, slots: list[int]) -> None:
        """Order the tier loads of positions first..m.upto-1 into seq's `slots`: those
        before m.prefix where they were saved, the rest shifted."""
        assert self.sessions is not None
        if first < m.prefix:
            self.sessions.load(m.session, seq.seq_id, first, slots[first:m.prefix])
        a = max(first, m.prefix)
        if a < m.upto:
            self.sessions.load(m.session, seq.seq_id, a, slots[a:m.upto], m.shift)

    def _room_keeping(self, w: int, n: int, keep: list[int]) -> bool:
        """`_room`, without evicting the slots about to be reused: they are held for the
        check (refcount + 1), so eviction skips them."""
        a = self.allocs[w]
        a.retain(keep)
        try:
            return self._room(w, n)
        finally:
            a.release(keep)

    def _room_after(self, w: int, keep: list[int], rest: int, must: int, extra: int,
                    own: bool) -> bool:
        """Room for the `rest` positions after the prefix `keep` reused on worker w (+
        `extra` fork slots): all on w (evicting cached prefixes), else, with `split_kv`
        and no forks, at least `must` of them on w (a tier load's: they go where the
        prefix is) and the others on the other workers (`_spill_rest`). Not split where
        another worker holds the whole sequence, unless the prefix is the sequence's
        `own` KV (a readmission's, a session's: long, and costly to compute again; a
        split costs each step one more worker's partial attention)."""
        if self._room_keeping(w, rest + extra, keep):
            return True
        if not self.config.split_kv or extra:
            return False
        others = [self._capacity(v) for v in range(len(self.allocs)) if v != w]
        if not own and max(others, default=0) >= len(keep) + rest:
            return False
        return self._room_keeping(w, max(must, rest - sum(others)), keep)

    def _capacity(self, w: int) -> int:
        """Slots worker w can give: free, or held only by cached prefixes."""
        return self.allocs[w].num_free() + (self.caches[w].evictable() if self.caches else 0)

    def _spill_rest(self, seq: Sequence, pos: int) -> None:
        """Slots for seq's positions from `pos` on, on the workers it does not use yet:
        their free slots first (the most free worker first), then those cached prefixes
        hold (evicted; `_room_after` counted them). One range per worker."""
        others = sorted((v for v in range(len(self.allocs)) if v not in seq.workers),
                        key=lambda v: (-self.allocs[v].num_free(), v))
        take, left = dict.fromkeys(others, 0), len(seq.tokens) - pos
        for evict in (False, True):
            for v in others:
                can = self._capacity(v) if evict else self.allocs[v].num_free()
                more = min(left, can - take[v])
                take[v], left = take[v] + more, left - more
        assert left == 0, f"sequence {seq.seq_id}: {left} positions without a slot"
        place = [(v, take[v]) for v in others if take[v]]
        for v, t in place:
            self._room(v, t)  # evicts what cached prefixes hold of the t slots
        self._allocate(seq, place, pos)

    def cache(self, seq: Sequence, upto: int) -> int:
        """Cache seq's first `upto` positions (their KV is written): after its prefill,
        when it finishes, and when it is preempted. Of a sequence split over workers,
        the part on its first worker (a cached prefix is one worker's slots); only up to
        its first position given back; a sparse one only up to its prompt's
        end: its decode rows attended to a selection of keys, so the KV they wrote (past
        the first layer) is not what a prompt fed whole writes, and another request
        reusing it would answer otherwise than alone. -> the positions cached (0: none)."""
        if seq.holes_from is not None:
            upto = min(upto, seq.holes_from)
        if self.sparse(seq):
            upto = min(upto, len(seq.prompt))
        parts = seq.parts_upto(upto)
        if self.caches is None or not parts:
            return 0
        w, upto = parts[0].worker, parts[0].end
        self.caches[w].insert(seq.tokens[:upto], self.allocs[w].slots(seq.seq_id)[:upto])
        return upto

    def clear_cache(self, workers=None) -> int:
        """Drop every cached prefix of `workers` (None: all) (their memory workers lost
        their pools, or on request); -> slots freed."""
        return sum(c.clear() for w, c in enumerate(self.caches or [])
                   if workers is None or w in workers)

    def add_workers(self, allocators: list[KVAllocator]) -> None:
        """Memory workers joined (ids after the present ones): from the next plan on,
        new sequences may be placed on them and split KV may spill onto them."""
        self.allocs.extend(allocators)
        if self.caches is not None:
            self.caches.extend(RadixCache(a) for a in allocators)

    def retire_workers(self, n: int) -> Retired:
        """Keep memory workers 0..n-1 only (the others leave the deployment). Each
        running sequence with KV on a leaving worker, oldest first, moves those parts
        onto kept workers that have room (`_relocate`); the others are preempted (what
        a kept worker holds of its first part is cached for its readmission; with swap
        each part is saved to its worker's tier, a leaving worker's too: `relocations`
        says where those go before the worker does). The leaving workers' cached
        prefixes are dropped and their allocators removed. The sessions' entries on
        them are the caller's."""
        if not 1 <= n <= len(self.allocs):
            raise ValueError(f"keep 1..{len(self.allocs)} memory workers, not {n}")
        hit = [s for s in self.running if any(w >= n for w in s.workers)]
        moved: list[Sequence] = []
        moves: list[SlotMove] = []
        for seq in hit:
            got = self._relocate(seq, n)
            if got is not None:
                moved.append(seq)
                moves.extend(got)
        out = [s for s in hit if s not in moved]
        for seq in reversed(out):  # newest first: the oldest ends in front
            first = seq.segments[0][0]
            self._preempt(seq)
            if first >= n:  # what it cached went to a leaving worker's tree
                seq.kept = 0
        for w in range(n, len(self.allocs)):
            if self.caches is not None:
                self.caches[w].clear()
            left = self.allocs[w].requests()
            assert not left, f"memory worker {w} still holds sequences {left}"
        del self.allocs[n:]
        if self.caches is not None:
            del self.caches[n:]
        return Retired(moved, tuple(moves), out)

    def drop_workers(self, lost: Iterable[int]) -> None:
        """Memory workers `lost` are gone from anywhere in the list (a recovery could
        not replace them), after every running sequence was requeued (`preempt_all`)
        and their cached prefixes cleared: their allocators and caches go, the others
        keep their order under new indices (0..), and a waiting sequence's saved parts
        are forgotten (after the recovery forgot every worker's tier entries: none
        names a worker by its old index)."""
        lost = set(lost)
        assert not self.running, "requeue the running sequences first"
        keep = [w for w in range(len(self.allocs)) if w not in lost]
        if not keep or len(keep) + len(lost) != len(self.allocs):
            raise ValueError(f"drop some of memory workers 0..{len(self.allocs) - 1}, "
                             f"not {sorted(lost)}")
        for w in lost:
            left = self.allocs[w].requests()
            assert not left, f"memory worker {w} still holds sequences {left}"
        self.allocs[:] = [self.allocs[w] for w in keep]  # (the engine's list too)
        if self.caches is not None:
            self.caches[:] = [self.caches[w] for w in keep]
        assert self.sessions is None or not self.sessions.sessions
        for seq in self.waiting:
            self._unpark(seq)

    def _relocate(self, seq: Sequence, n: int) -> list[SlotMove] | None:
        """Give each part of seq's KV on workers n.. the same number of slots on a kept
        worker: the last part after the range before it, where that worker is kept and
        has room, else one none of its parts uses, the most free first; cached prefixes
        yield if need be -> the copies to make (its segments now name the kept workers;
        the workers drop its tables and its next plan sends them whole); None, nothing
        changed, when a part finds no such worker, or seq has positions given back or a
        readmission's loads still to come."""
        if seq.holes_from is not None or seq.skip is not None:
            return None
        segments = list(seq.segments)
        moves: list[SlotMove] = []
        for i, (w, start) in enumerate(seq.segments):
            if w < n:
                continue
            src = self.allocs[w].slots(seq.seq_id)
            prev = segments[i - 1][0] if i else -1
            if i == len(segments) - 1 and 0 <= prev < n and self._room(prev, len(src)):
                # the last part continues the kept range before it on that worker
                moves.append(SlotMove(w, prev, tuple(src),
                                      tuple(self.allocs[prev].extend(seq.seq_id, len(src)))))
                del segments[i]
                continue
            used = {v for v, _ in segments}
            order = sorted(range(n), key=lambda d: (-self.allocs[d].num_free(), d))
            dest = next((d for d in order if d not in used and self._room(d, len(src))), None)
            if dest is None:
                for m in moves:  # (each on a worker seq had no slots on)
                    self.allocs[m.dest].free(seq.seq_id)
                return None
            moves.append(SlotMove(w, dest, tuple(src),
                                  tuple(self.allocs[dest].allocate(seq.seq_id, len(src)))))
            segments[i] = (dest, start)
        for m in moves:
            self.allocs[m.source].free(seq.seq_id)
        if seq.sent:  # the workers' tables of it go; its next plan sends them whole
            self._released.append(seq.seq_id)
            seq.sent = 0
        seq.segments = segments
        return moves

    def unmove(self, seqs: list[Sequence]) -> None:
        """Sequences whose moves failed (`retire_workers`): preempted, with nothing
        cached or saved (the kept slots they were given hold no KV of theirs)."""
        for seq in reversed(seqs):
            lost = seq.written
            self._preempt(seq, 0, park=False)
            seq.lost = lost

    def relocations(self, n: int) -> dict[str, int]:
        """Where each saved entry on workers n.. goes before they leave, {entry key:
        kept worker}: a sequence's parked part to a kept worker none of its other
        parts use (its parts updated; with none free, that part and the later ones
        are dropped: their positions are computed again); a session's to the kept
        worker whose tier holds the fewest of the index's positions."""
        assert self.sessions is not None
        moves: dict[str, int] = {}
        for seq in (*self.running, *self.waiting):
            kept: list[Part] = []
            for p in seq.parts:
                free = [w for w in range(n) if w not in {q.worker for q in seq.parts}
                        and w not in {q.worker for q in kept}]
                if p.worker >= n and not free:
                    break
                if p.worker >= n:
                    p = Part(free[0], p.start, p.end)
                    moves[self.part_key(seq, p)] = p.worker
                kept.append(p)
            for p in seq.parts[len(kept):]:
                self.sessions.discard(self.part_key(seq, p))
            seq.parts = tuple(kept)
        held = [0] * n
        for e in self.sessions.sessions.values():
            if e.worker < n:
                held[e.worker] += len(e.tokens)
        for key, e in self.sessions.sessions.items():
            if e.worker >= n and not key.startswith("#"):  # a session's
                w = min(range(n), key=lambda v: (held[v], v))
                moves[key], held[w] = w, held[w] + len(e.tokens)
        return moves

    def orders_plan(self) -> StepPlan:
        """A plan with no work: the tables to drop and the tier orders queued, sent
        at once (before workers leave)."""
        return self._emit([])

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def owes_workers(self) -> bool:
        """Whether the next plan would tell the workers something beside its work:
        tables to drop, tier orders (a finished turn's save, a parked entry's drop)."""
        return bool(self._released or (self.sessions is not None and self.sessions.has_orders()))

    def _release(self, seq: Sequence) -> None:
        for w in seq.workers:
            self.allocs[w].free(seq.seq_id)
        seq.segments, seq.evicted, seq.skip = [], (0, 0), None
        seq.pending_drop, seq.new_drops, seq.first_dropped = [], (), -1
        seq.pending = 0
        if seq.sent:
            self._released.append(seq.seq_id)
            seq.sent = 0

    def _preempt(self, seq: Sequence, written: int | None = None, park: bool = True) -> None:
        """seq back to the front of the queue, its slots freed. With prefix caching its
        first `written` positions (default: every position fed before this step) are
        cached first: their slots stay evictable until others need them, and its
        readmission takes back what is left of them (`Sequence.kept`); with `swap`
        (and `park`) they are saved to its worker's host tier too (`_park`)."""
        seq.lost = seq.written if written is None else written
        seq.kept = self.cache(seq, seq.lost)
        if park and self.swap:
            self._park(seq, seq.lost)
        self._release(seq)
        self.running.remove(seq)
        seq.status, seq.num_preemptions = "waiting", seq.num_preemptions + 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _park(self, seq: Sequence, n: int) -> None:
        """Save seq's first n positions' KV to the host tiers (the orders ride in the
        plan being made, carried out before the step writes into the slots freed): of a
        KV split over workers, each worker's part to that worker's tier, the first
        under `seq.parked`, a later one under an entry of its own (`part_key`); its
        readmission loads each back onto its worker (`_parts_hit`). Not one with slots
        given back (its table has holes); a part larger than the host tier ends the
        parts saved there."""
        assert self.sessions is not None
        if n <= 0 or seq.holes_from is not None or not self._tiers_serve(seq):
            return
        seq.parked = seq.parked or f"#preempted:{seq.seq_id}"  # no session id has '#'
        parts: list[Part] = []
        for p in seq.parts_upto(n):
            if (p.end - p.start) * self.sessions.bytes_per_token > \
                    self.sessions.config.host_bytes:
                break
            self.parked_tokens += self._save_part(seq, self.part_key(seq, p), p)
            parts.append(p)
        for p in seq.parts[1:]:  # a later part the new ones do not replace
            if not any(q.start == p.start for q in parts[1:]):
                self.sessions.discard(self.part_key(seq, p))
        seq.parts = tuple(parts)

    @staticmethod
    def part_key(seq: Sequence, p: Part) -> str:
        """The tier entry of a preempted sequence's part: `parked`, `parked@start`."""
        assert seq.parked is not None
        return seq.parked if p.start == 0 else f"{seq.parked}@{p.start}"

    def save(self, seq: Sequence, key: str, upto: int) -> int:
        """Order seq's first `upto` positions' KV (of a KV split over workers, its first
        worker's part) saved under `key` in that worker's host tier, from the first
        position the entry lacks. -> the positions ordered saved."""
        return self._save_part(seq, key, seq.parts_upto(upto)[0]) if upto > 0 else 0

    def _save_part(self, seq: Sequence, key: str, p: Part) -> int:
        """Order part p of seq's KV saved under `key` in its worker's host tier (the
        entry's positions count from p.start). -> the positions ordered saved."""
        assert self.sessions is not None
        slots = self.allocs[p.worker].slots(seq.seq_id)[:p.end - p.start]
        return self.sessions.saved(key, p.worker, seq.tokens[p.start:p.end], slots)

    def _unpark(self, seq: Sequence) -> None:
        """seq ended: the KV saved when it was preempted is not wanted any more."""
        if seq.parked is not None and self.sessions is not None:
            self.sessions.discard(seq.parked)
            for p in seq.parts[1:]:
                self.sessions.discard(self.part_key(seq, p))
        seq.parked, seq.parts = None, ()

    def preempt_all(self, keep: Mapping[int, int] | None = None) -> int:
        """Every running sequence back to the waiting queue, in admission order ahead of
        the ones already waiting, its slots freed (a recovery dropped the memory workers'
        tables). `keep`: {sequence id: positions} whose KV its worker's pool still holds
        (the recovery kept that pool): they are cached first (`cache`), so its
        readmission reuses them and computes only the rest. -> the positions cached."""
        kept = 0
        for seq in reversed(list(self.running)):  # newest first: the oldest ends in front
            self._preempt(seq, (keep or {}).get(seq.seq_id, 0), park=False)
            kept += seq.kept
        return kept

    def _grow(self, seq: Sequence) -> bool:
        """One more slot for seq's next position; False if seq itself was preempted."""
        w = seq.worker
        while not self._room(w, 1):
            spill = self._spill(seq)
            if spill is not None:
                self.allocs[spill].allocate(seq.seq_id, 1)
                seq.segments.append((spill, seq.num_tokens - 1))
                return True
            victim = self._lowest([s for s in self.running if w in s.workers])
            self._preempt(victim)
            if victim is seq:
                return False
        self.allocs[w].append(seq.seq_id)
        return True

    def _work(self, seq: Sequence, start: int, end: int, seeds: tuple,
              sample: bool = True, guess: tuple[int, ...] = ()) -> SeqWork:
        """seq's work this step: its tokens at positions start..end-1 (a decode with a
        draft: its last token, then `guess` at the positions after it). Its slots are
        the table up to `end` if the executor holds none of it, else only the positions
        it lacks (`SeqWork.slots`); only the KV ranges that begin before `end` are
        named."""
        if end < seq.num_tokens:  # a prompt's chunk: its later slots exist already
            slots = self._range(seq, seq.sent, end)
        elif seq.sent:
            slots = self._tail(seq, seq.sent, end)
        else:
            tables = [self.allocs[w].slots(seq.seq_id) for w in seq.workers]
            slots = tables[0] if len(tables) == 1 else list(itertools.chain(*tables))
        live = [(w, a) for w, a in seq.segments if a < end]
        penalized = seq.params.penalized  # then the draw needs every token so far
        tokens = ((seq.last_token, *guess) if start == seq.num_tokens - 1  # a decode: O(1)
                  else tuple(seq.tokens[start:end]))
        work = SeqWork(seq.seq_id, tokens, start, tuple(slots), sample=sample,
                       worker=live[0][0], params=seq.params, seeds=seeds,
                       segments=tuple(live) if len(live) > 1 else (),
                       history=tuple(seq.tokens) if penalized else (),
                       prompt_len=len(seq.prompt) if penalized else 0, slots_from=seq.sent,
                       evicted=seq.evicted, dropped=seq.new_drops, draft=len(guess))
        seq.sent, seq.new_drops = end, ()
        return work

    def _guess(self, seq: Sequence, spare: int, later: int) -> tuple[int, ...]:
        """seq's draft this step, its slots taken (after the one for its last token);
        empty when it has none, or its KV spans workers, or they do not fit in the
        free slots beside the next slots of the `later` sequences decoding after it on
        its worker (a draft never evicts, spills or preempts, nor makes another do so)."""
        if self.propose is None or spare <= 0 or len(seq.segments) != 1:
            return ()
        guess = self.propose(seq, spare)
        a = self.allocs[seq.worker]
        if not guess or not a.can_allocate(len(guess) + 1 + later):
            return ()
        a.extend(seq.seq_id, len(guess) + 1)
        return guess

    def trim(self, seq: Sequence) -> None:
        """After a step that fed seq a draft: the slots of the positions past those
        written (the guessed tokens not kept) go back, and the executor's table of seq
        is cut there by the next plan (`SeqWork.slots_from`)."""
        keep = seq.num_tokens - 1
        self.allocs[seq.worker].truncate(seq.seq_id, keep)
        seq.sent = min(seq.sent, keep)

    def _range(self, seq: Sequence, start: int, end: int) -> list[int]:
        """The slots of positions start..end-1, read off seq's KV ranges in order."""
        out: list[int] = []
        bounds = [a for _, a in seq.segments[1:]] + [seq.num_tokens]
        for (w, a), b in zip(seq.segments, bounds):
            lo, hi = max(a, start), min(b, end)
            if lo < hi:
                out += self.allocs[w].slots(seq.seq_id)[lo - a:hi - a]
        return out

    def _tail(self, seq: Sequence, start: int, end: int) -> list[int]:
        """The slots of positions start..end-1, the last positions of seq's table: from
        its last segment(s) backwards, without copying the tables."""
        out: list[int] = []
        bounds = [a for _, a in seq.segments[1:]] + [end]
        for (w, a), b in reversed(list(zip(seq.segments, bounds))):
            if b <= start:
                break
            out = self.allocs[w].tail(seq.seq_id, b - max(a, start)) + out
        return out

    def schedule(self) -> StepPlan:
        work: list[SeqWork] = []
        report = False  # whether the memory workers are to say what they dropped
        # 1. Decode: one new slot per running sequence, oldest first; a full worker
        #    spills to another (split_kv) or preempts its newest sequences. A drafted
        #    sequence takes its draft's slots too, where they fit without either.
        spare = self.config.max_step_tokens - len(self.running)  # tokens drafts may add
        decoding = self._rank(s for s in self.running if not s.pending)
        # drafts only: the next slots still to take, per worker (no pass when they are off)
        later = Counter(s.worker for s in decoding) if self.propose else Counter()
        for seq in decoding:
            later[seq.worker] -= 1
            if seq.status != "running":
                continue  # preempted while making room for an older one
            guess = self._guess(seq, spare, later[seq.worker])
            if guess:
                spare -= len(guess)
                end = seq.num_tokens + len(guess)
                work.append(self._work(seq, end - len(guess) - 1, end, (seq.seed,),
                                       guess=guess))
            elif self._grow(seq):
                self._evict(seq)
                report |= self._drops(seq)
                work.append(self._work(seq, seq.num_tokens - 1, seq.num_tokens, (seq.seed,)))
        # 2. Prompts fed in chunks (the next chunk of each), then waiting sequences
        #    admitted while they fit, each in policy order within the step's token budget;
        #    by priority, a waiting sequence of higher priority than a chunked prompt goes
        #    before it and may preempt lower priorities to get in.
        budget = self.config.max_step_tokens - sum(len(w.token_ids) for w in work)
        admits = self.admits or (lambda seq: True)  # (those it holds back keep their place)
        ranked = [s for s in self._rank(self.waiting) if admits(s)]
        waiting = deque(ranked)
        for seq in self._rank(s for s in self.running if s.pending):
            budget = self._admit_all(waiting, budget, work, before=seq)
            if seq.status == "running" and budget > 0:
                budget -= self._feed(seq, seq.num_tokens - seq.pending, budget, work)
        self._admit_all(waiting, budget, work)
        # the first in policy order not admitted: the one that ended admission
        head = next((s for s in ranked if s.status == "waiting"), None)
        self.short = self._shortfall(head)
        stuck = None if work or self.short else head
        if stuck is not None:  # nothing else runs, and it does not fit: it never will
            self.unplaceable.append(SequenceFault(
                [stuck.seq_id], f"sequence {stuck.seq_id} ({len(stuck.tokens)} tokens) "
                f"cannot be placed: {[a.num_free() for a in self.allocs]} free KV slots, "
                f"{sum(c.evictable() for c in self.caches or [])} more the prefix cache "
                f"can give, step token budget {self.config.max_step_tokens}"))
        return self._emit(work, report)

    def _shortfall(self, seq: Sequence | None) -> Shortfall | None:
        """seq's, when it needs more memory workers than there are and `ceiling` allows
        them (its KV, and the next position's)."""
        need = self.workers_for(len(seq.tokens) + 1) if seq is not None else None
        if seq is None or need is None or need <= len(self.allocs):
            return None
        return Shortfall(seq.seq_id, len(seq.tokens) + 1, need)

    def _emit(self, work: list[SeqWork], report: bool = False) -> StepPlan:
        """The next plan: `work`, the tables to drop and the tier orders queued."""
        orders = self.sessions.take_orders() if self.sessions is not None else ()
        plan = StepPlan(self.step, tuple(work), released=tuple(self._released),
                        tier_orders=orders, report_dropped=report)
        self._released.clear()
        self.step += 1
        return plan

    def _admit_all(self, waiting: deque[Sequence], budget: int, work: list[SeqWork],
                   before: Sequence | None = None) -> int:
        """Admit `waiting` (in policy order) from its front while each fits, or only
        those of higher priority than `before` ("priority"); the first that does not fit
        ends admission for this step (no overtaking: `waiting` is emptied). -> the token
        budget left."""
        while waiting and (before is None or (self.config.policy == "priority"
                                              and waiting[0].priority < before.priority)):
            seq = waiting.popleft()
            fed = self._admit(seq, budget, work)
            while not fed and (victim := self._displaceable(seq, budget)) is not None:
                budget += self._unplan(victim, work)
                fed = self._admit(seq, budget, work)
            if not fed:
                waiting.clear()
                break
            budget -= fed
        return budget

    def _rank(self, seqs: Iterable[Sequence]) -> list[Sequence]:
        """seqs (in arrival or admission order) in the order the policy serves them:
        as they are ("fcfs"), or by priority, ties kept in order ("priority")."""
        if self.config.policy == "fcfs":
            return list(seqs)
        return sorted(seqs, key=lambda s: s.priority)

    def _lowest(self, seqs: list[Sequence]) -> Sequence:
        """Of seqs (in admission order), the one to preempt first: the newest ("fcfs"),
        the newest of the lowest priority ("priority"). Decoding in `_rank` order, it is
        never one whose slot this step already took."""
        if self.config.policy == "fcfs":
            return seqs[-1]
        return max(reversed(seqs), key=lambda s: s.priority)

    def _displaceable(self, seq: Sequence, budget: int) -> Sequence | None:
        """A running sequence waiting seq may preempt to get in ("priority" only): the
        lowest of those of strictly lower priority; None if none, or if what keeps seq
        out is the step's token budget (no preemption frees enough of it)."""
        if (self.config.policy != "priority" or budget <= 0
                or (not self.chunks(seq) and len(seq.tokens) > budget)):
            return None
        below = [s for s in self.running if s.priority > seq.priority]
        return self._lowest(below) if below else None

    def _unplan(self, seq: Sequence, work: list[SeqWork]) -> int:
        """Preempt running seq while this step is planned: its work leaves the plan (so
        its positions from that work's first on stay unwritten). -> the tokens that
        frees in the step's budget."""
        mine = next((w for w in work if w.seq_id == seq.seq_id), None)
        if mine is None:  # a prompt's chunk the budget left out this step
            self._preempt(seq)
            return 0
        work.remove(mine)
        self._preempt(seq, mine.start_pos)
        return len(mine.token_ids)

    def _admit(self, seq: Sequence, budget: int, work: list[SeqWork]) -> int:
        """Admit waiting seq if the batch has room and its KV fits: slots for all its
        tokens (reusing a cached prefix where there is one), its first chunk into `work`.
        -> the tokens fed; 0 (nothing changed) if it does not fit."""
        n, k = len(seq.tokens), len(seq.forks)
        if budget <= 0 or len(self.running) + 1 + k > self.config.max_batch:
            return 0
        w, hit = self._hit(seq, k)
        w, hit, tier = self._tier_hit(seq, k, w, hit)
        got = self._parts_hit(seq, k, w, hit, tier)
        if got.parts:  # positions not computed: those kept and loaded
            reuse = got.end + got.parts[-1].end - seq.parts[0].end
        else:
            reuse = tier.upto if tier is not None else len(hit)
        if not self.chunks(seq) and n - reuse > budget and work:
            return 0  # (alone in a step it goes whole: a recompute past the budget)
        place = None if reuse else self._place(n + k)  # room for each fork's first slot
        if not (reuse or place):
            return 0
        self.waiting.remove(seq)
        seq.kept = 0
        if not seq.num_preemptions:  # what its prompt reused, not a readmission's own KV
            seq.cached, seq.tier_cached = reuse, reuse - len(hit)
        if seq.lost:  # a readmission: of the positions it had KV for, those not reused
            seq.recomputed += max(0, seq.lost - reuse)
            seq.lost = min(seq.lost, reuse)  # what a tier load that misses still loses
        if got.parts:  # its KV's parts back on their workers (after a gap: `Skip`)
            self._place_parts(seq, got)
        elif reuse:  # on w what fits there (all but where `_room_after` split it)
            here = min(n - len(hit), self.allocs[w].num_free())
            self.allocs[w].adopt(seq.seq_id, hit, here)
            seq.segments.append((w, 0))
            if len(hit) + here < n:
                self._spill_rest(seq, len(hit) + here)
        else:
            self._allocate(seq, place or [])
        if tier is not None:  # the rest of the reused prefix comes from the tiers
            self._load(seq, tier, len(hit), self.allocs[w].slots(seq.seq_id))
        seq.status = "running"
        self.running.append(seq)
        return self._feed(seq, got.end if seq.skip else reuse, budget, work)

    def chunks(self, seq: Sequence) -> bool:
        """Whether seq's prompt may be fed over several steps: not when it asks for
        prompt logprobs (drawn from one step's rows) or its KV policy scores its prompt
        on the memory workers (one pass over the whole prompt)."""
        return seq.params.prompt_logprobs is None and not self.scores_prompt(seq)

    def _last_fed(self, seq: Sequence) -> int:
        """How many of seq's last tokens a prefix reused from a cache leaves to feed: 1
        (the step draws after it), 2 where its KV policy cuts one-query rows and its
        prompt's last token is the last (a readmission's last token is a drawn one, fed
        alone as when it was drawn)."""
        return 2 if len(seq.tokens) > 1 and self.sparse(seq) and not seq.output else 1

    def _feed(self, seq: Sequence, start: int, budget: int, work: list[SeqWork]) -> int:
        """seq's tokens from position `start` into `work`, at most `budget` of them if it
        `chunks` (a sequence whose KV policy cuts one-query rows is not left one token to
        feed: 2 then, one over `budget` if it is 1); it draws after its last token only.
        A `Skip`'s positions are not fed: its loads are ordered once the positions
        before it are computed, with the positions after it. -> how many were fed."""
        n, skip = seq.num_tokens, seq.skip
        if skip is not None and start == skip.start:  # (in a later step than the gap)
            self._load_parts(seq, skip.loads)
            start, seq.skip = skip.end, None
        end = min(n, start + budget) if self.chunks(seq) else n
        if n - end == 1 and self.sparse(seq):
            end = end - 1 if end - start > 1 else n
        if seq.skip is not None:
            end = min(end, seq.skip.start)
        seq.pending = n - end
        work.append(self._work(seq, start, end, (seq.seed, *(f.seed for f in seq.forks)),
                               sample=end == n))
        return end - start

    def _drops(self, seq: Sequence) -> bool:
        """Whether seq's reported dropped keys may give their slots back: a policy that
        drops for good, its KV on one worker, no session saving it."""
        return (self.drops is not None and len(seq.segments) == 1 and seq.session is None
                and self.drops(seq))

    def note_dropped(self, dropped) -> None:
        """The keys memory workers reported left out for good (`StepResult.dropped`):
        held until `evict_chunk` of a sequence's have come (a sequence that has since
        finished, moved or split is skipped)."""
        by_id = {s.seq_id: s for s in self.running}
        for d in dropped:
            seq = by_id.get(d.seq_id)
            if seq is not None and seq.segments == [(d.worker, 0)] and self._drops(seq):
                seq.pending_drop.extend(d.slots)

    def _evict(self, seq: Sequence) -> None:
        """Give back the slots of the positions seq's KV policy will never read again,
        `evict_chunk` or more at a time. Not for a sequence whose KV spans workers or
        whose session saves its KV."""
        if len(seq.segments) != 1 or seq.session is not None:
            return
        if len(seq.pending_drop) >= self.config.evict_chunk:
            self._give_back(seq)
        if self.evict is None:
            return
        want = self.evict(seq)
        if want is None:
            return
        lo, hi = want
        a, b = seq.evicted
        start = b if b > a else lo
        if hi - start < self.config.evict_chunk or (b > a and a != lo):
            return
        self.allocs[seq.worker].drop(seq.seq_id, start, hi)
        seq.evicted = (lo, hi)

    def _give_back(self, seq: Sequence) -> None:
        """seq's pending dropped keys' positions become holes; the next plan says which."""
        table = np.asarray(self.allocs[seq.worker].slots(seq.seq_id))
        pos = np.flatnonzero(np.isin(table, seq.pending_drop)).tolist()
        seq.pending_drop = []
        if pos:  # ascending
            self.allocs[seq.worker].drop_positions(seq.seq_id, pos)
            seq.new_drops = tuple(pos)
            seq.first_dropped = pos[0] if seq.first_dropped < 0 else min(seq.first_dropped,
                                                                         pos[0])

    def _allocate(self, seq: Sequence, place: list[tuple[int, int]], pos: int = 0) -> None:
        """Fresh slots for seq's tokens from position `pos` on, over the workers `place`
        names."""
        n = len(seq.tokens)
        for w, take in place:
            take = min(take, n - pos)
            if take:
                self.allocs[w].allocate(seq.seq_id, take)
                seq.segments.append((w, pos))
                pos += take

    def fork(self, parent: Sequence) -> list[Sequence]:
        """After the parent's prefill: its pending forks share its KV slots and run."""
        kids, parent.forks = parent.forks, []
        for kid in kids:
            for w in parent.workers:
                self.allocs[w].fork(parent.seq_id, kid.seq_id)
            kid.status, kid.segments = "running", list(parent.segments)
            kid.evicted, kid.first_dropped = parent.evicted, parent.first_dropped
            self.running.append(kid)
        return kids

    def requeue(self, seq: Sequence) -> None:
        """A running seq whose tier load missed: free its slots and queue it in front,
        to be computed (not a preemption: it never ran)."""
        self._release(seq)
        self.running.remove(seq)
        seq.status, seq.cached, seq.tier_cached = "waiting", 0, 0
        self.waiting.appendleft(seq)

    def reset(self, live: Iterable[Sequence]) -> int:
        """After a step cut part-way (`LLMEngine.step`): what the scheduler half did
        (a slot taken, a sequence half admitted, a table sent) cannot be trusted, so it
        starts again from the sequences alone. The allocators and prefix caches are
        emptied; every unfinished sequence of `live` (its requests' sequences: those
        running, then any a cut left outside both queues, then those waiting; a
        sibling not yet forked off stays with its parent) waits to be computed again
        from its tokens so far, holding nothing. -> the sequences requeued from
        outside the waiting queue."""
        queued = {id(s) for s in (*self.running, *self.waiting)}
        riders = {id(k) for s in live for k in s.forks}
        loose = [s for s in live if s.status != "finished" and id(s) not in queued
                 and id(s) not in riders]
        ran = [*self.running, *loose]
        for cache in self.caches or ():
            cache.forget()
        for a in self.allocs:
            a.reset()
        for seq in (*ran, *self.waiting):
            seq.segments, seq.evicted, seq.sent, seq.pending, seq.kept = [], (0, 0), 0, 0, 0
            seq.skip = None
            seq.lost = 0  # what the cut makes it compute again is not a preemption's
            seq.pending_drop, seq.new_drops, seq.first_dropped = [], (), -1
            seq.status = "waiting"
        for seq in self.running:  # a preemption, as far as its figures go
            seq.num_preemptions += 1
        self.waiting = deque([*ran, *self.waiting])
        self.running, self._released = [], []
        return len(ran)

    def finish(self, seq: Sequence, reason: str, keep_kv: bool = True) -> None:
        """`keep_kv`: cache its KV (prefix caching) unless it failed ("error")."""
        seq.status, seq.finish_reason = "finished", reason
        if keep_kv and reason != "error":  # every position fed but the last drawn has KV
            self.cache(seq, seq.written)
        self._release(seq)
        self._unpark(seq)
        self.running.remove(seq)

    def abort(self, seq: Sequence, reason: str = "abort", keep_kv: bool = True) -> None:
        """Drop an unfinished seq wherever it is (running, waiting, or a fork not yet
        forked off) and free its KV; it finishes with `reason`. `keep_kv` False: its KV
        is not cached (the last step failed: what it wrote is not known)."""
        if seq.status == "running":
            self.finish(seq, reason, keep_kv)
        elif seq.status == "waiting":
            if seq in self.waiting:
                self.waiting.remove(seq)
            seq.status, seq.finish_reason, seq.forks = "finished", reason, []
            self._unpark(seq)
