"""Token-granular slab KV allocator: plain Python over integer slot ids, no tensors.

Data in: scheduler calls (allocate / adopt / append / fork / write / free) keyed by
request id; retain / release from the prefix cache, which holds slots outside requests.
Data out: slot ids per request (its slot table), which the memory workers use to index
their KV pool tensors, and `CopySlot` orders when copy-on-write needs a KV copy.

- One slot holds one token's K and V for every layer. The free list is a LIFO stack:
  the most recently freed slot is reused first (warm in cache), and a fresh allocator
  hands out 0, 1, 2, ... in order.
- Slots are reference counted, so `fork` shares a request's slots (parallel sampling,
  beam search, shared prompts); `write` into a shared position copies on write.
- Exhaustion raises `KVPoolExhausted` (typed, with counts) and changes nothing;
  `can_allocate` answers the same question without side effects.
- Eviction: `drop` gives back the slots of a range of a request's positions that its
  attention policy will never read again (streaming), `drop_positions` those of any set
  of positions (h2o, snapkv); the table keeps -1 there (a hole), every other position
  keeps its slot.
- Overcommit: with `overcommit=True` the pool holds `num_slots` slots although only
  `device_budget_slots` fit on the device (the rest live in host memory, as the paper's
  unified memory does); `stats()` accounts for the slots beyond the budget.
"""
from __future__ import annotations

from dataclasses import dataclass


class KVPoolExhausted(RuntimeError):
    """Not enough free slots; nothing was allocated. The scheduler queues or preempts."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"KV pool exhausted: need {needed} slots, {free} free")
        self.needed, self.free = needed, free


@dataclass(frozen=True)
class KVAllocatorConfig:
    num_slots: int  # slots the pool can hand out
    device_budget_slots: int | None = None  # slots that fit in device memory (None: all)
    overcommit: bool = False  # allow num_slots > device_budget_slots

    def __post_init__(self):
        if not isinstance(self.num_slots, int) or self.num_slots <= 0:
            raise ValueError(f"num_slots must be a positive int, got {self.num_slots!r}")
        b = self.device_budget_slots
        if b is not None:
            if not isinstance(b, int) or b <= 0:
                raise ValueError(f"device_budget_slots must be a positive int, got {b!r}")
            if b < self.num_slots and not self.overcommit:
                raise ValueError(f"num_slots {self.num_slots} exceeds the device budget {b}; "
                                 "set overcommit=True to back the excess with host memory")

    @property
    def budget(self) -> int:
        return self.num_slots if self.device_budget_slots is None else self.device_budget_slots


@dataclass(frozen=True)
class CopySlot:
    """Copy-on-write order for the memory side: copy KV of slot `src` into slot `dst`."""

    src: int
    dst: int


@dataclass(frozen=True)
class KVStats:
    num_slots: int
    used: int  # distinct live slots
    free: int
    shared: int  # live slots with refcount > 1
    over_budget: int  # live slots beyond the device budget (host-backed when overcommitted)


class KVAllocator:
    def __init__(self, config: KVAllocatorConfig):
        self.config = config
        self._free: list[int] = list(range(config.num_slots - 1, -1, -1))  # top = end
        self._ref: list[int] = [0] * config.num_slots
        self._tables: dict = {}

    # -- queries (no side effects) --
    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def num_free(self) -> int:
        return len(self._free)

    def free_list(self) -> list[int]:
        """Free slots, next to be handed out first."""
        return self._free[::-1]

    def slots(self, req) -> list[int]:
        return list(self._table(req))

    def tail(self, req, n: int) -> list[int]:
        """The last n slots of req's table (a decode step's new ones: O(n), no copy of
        the table)."""
        table = self._table(req)
        return table[len(table) - n:] if n else []

    def refcount(self, slot: int) -> int:
        return self._ref[slot]

    def requests(self) -> list:
        return list(self._tables)

    def stats(self) -> KVStats:
        used = self.config.num_slots - len(self._free)
        shared = sum(1 for r in self._ref if r > 1)
        return KVStats(self.config.num_slots, used, len(self._free), shared,
                       max(0, used - self.config.budget))

    # -- mutations --
    def allocate(self, req, n: int) -> list[int]:
        """Create request `req` with `n` fresh slots (its first n positions)."""
        if req in self._tables:
            raise ValueError(f"request {req!r} already has slots")
        if n < 0:
            raise ValueError(f"cannot allocate {n} slots")
        self._tables[req] = self._pop(n)
        return list(self._tables[req])

    def append(self, req) -> int:
        """One more position for `req`: a fresh slot."""
        table = self._table(req)
        slot = self._pop(1)[0]
        table.append(slot)
        return slot

    def extend(self, req, n: int) -> list[int]:
        """n more positions for `req`, all or nothing."""
        table = self._table(req)
        new = self._pop(n)
        table.extend(new)
        return new

    def adopt(self, req, shared: list[int], n: int) -> list[int]:
        """Create request `req` whose first positions reuse the live slots `shared` (a
        cached prefix: refcounts +1) followed by `n` fresh slots; all or nothing."""
        if req in self._tables:
            raise ValueError(f"request {req!r} already has slots")
        if any(self._ref[s] <= 0 for s in shared):
            raise ValueError("adopt: every shared slot must be live")
        new = self._pop(n)
        for s in shared:
            self._ref[s] += 1
        self._tables[req] = list(shared) + new
        return list(self._tables[req])

    def retain(self, slots: list[int]) -> None:
        """One more reference to each live slot (held outside any request: a cache)."""
        if any(self._ref[s] <= 0 for s in slots):
            raise ValueError("retain: every slot must be live")
        for s in slots:
            self._ref[s] += 1

    def release(self, slots: list[int]) -> list[int]:
        """Drop one reference to each slot (taken by `retain`); -> the slots that became
        free, pushed last to first (so the first is reused first)."""
        released = []
        for s in reversed(slots):
            if self._ref[s] <= 0:
                raise ValueError(f"release: slot {s} is not live")
            self._ref[s] -= 1
            if self._ref[s] == 0:
                self._free.append(s)
                released.append(s)
        return released

    def fork(self, parent, child) -> list[int]:
        """`child` shares every slot of `parent` (refcounts +1; holes stay holes)."""
        if child in self._tables:
            raise ValueError(f"request {child!r} already has slots")
        table = self._table(parent)
        for s in table:
            if s >= 0:
                self._ref[s] += 1
        self._tables[child] = list(table)
        return list(table)

    def write(self, req, pos: int) -> CopySlot | None:
        """Make position `pos` of `req` exclusively owned before it is written.

        Returns the copy the memory side must do when the slot was shared, else None.
        """
        table = self._table(req)
        if not -len(table) <= pos < len(table):
            raise IndexError(f"request {req!r} has {len(table)} positions, not {pos}")
        old = table[pos]
        if old < 0:
            raise IndexError(f"request {req!r}: position {pos} was dropped (evicted)")
        if self._ref[old] == 1:
            return None
        new = self._pop(1)[0]
        self._ref[old] -= 1
        table[pos] = new
        return CopySlot(src=old, dst=new)

    def drop(self, req, start: int, end: int) -> list[int]:
        """Positions start..end-1 of `req` give their slots back (evicted: never read
        again); they become holes (-1) in its table. Returns the slots that became free,
        in push order (the first position's ends on top). Holes already there are
        skipped, so dropping again is harmless."""
        table = self._table(req)
        if not 0 <= start <= end <= len(table):
            raise IndexError(f"request {req!r} has {len(table)} positions, cannot drop "
                             f"{start}..{end - 1}")
        return self._drop(table, range(end - 1, start - 1, -1))

    def drop_positions(self, req, positions) -> list[int]:
        """`drop` for any set of `req`'s positions (the keys a scoring policy left out at
        every layer: `SeqWork.dropped`); the same push order: the first position's slot
        ends on top."""
        table = self._table(req)
        pos = sorted(set(int(p) for p in positions), reverse=True)
        if pos and not 0 <= pos[-1] <= pos[0] < len(table):
            raise IndexError(f"request {req!r} has {len(table)} positions, cannot drop "
                             f"positions {pos[-1]}..{pos[0]}")
        return self._drop(table, pos)

    def truncate(self, req, n: int) -> list[int]:
        """Keep `req`'s first n positions; the slots of the rest go back (a draft's
        positions past the tokens kept), pushed last to first, so the first position
        given back is the next one handed out. -> the slots that became free."""
        table = self._table(req)
        if not 0 <= n <= len(table):
            raise IndexError(f"request {req!r} has {len(table)} positions, cannot keep {n}")
        released = self._drop(table, range(len(table) - 1, n - 1, -1))
        del table[n:]
        return released

    def free(self, req) -> list[int]:
        """Release `req`. Returns the slots that became free, in push order."""
        table = self._tables.pop(req, None)
        if table is None:
            raise KeyError(f"unknown request {req!r}")
        released = []
        for s in reversed(table):  # first position ends on top: reused first, in order
            if s < 0:
                continue  # dropped before
            self._ref[s] -= 1
            if self._ref[s] == 0:
                self._free.append(s)
                released.append(s)
        return released

    def reset(self) -> None:
        """Every slot free, no request: as new (after a step cut part-way, when no table
        can be trusted: `Scheduler.reset`)."""
        self._free = list(range(self.config.num_slots - 1, -1, -1))
        self._ref = [0] * self.config.num_slots
        self._tables = {}

    # -- internals --
    def _table(self, req) -> list[int]:
        try:
            return self._tables[req]
        except KeyError:
            raise KeyError(f"unknown request {req!r}") from None

    def _drop(self, table: list[int], positions) -> list[int]:
        released = []
        for p in positions:
            s = table[p]
            if s < 0:
                continue
            table[p] = -1
            self._ref[s] -= 1
            if self._ref[s] == 0:
                self._free.append(s)
                released.append(s)
        return released

    def _pop(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVPoolExhausted(n, len(self._free))
        out = [self._free.pop() for _ in range(n)]
        for s in out:
            self._ref[s] = 1
        return out
