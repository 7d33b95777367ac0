"""The engine's orders to the memory workers' KV tiers, and their config and miss, and
the moves of KV between memory workers when they shrink (no torch here: the engine and
the step messages use them; `lamina.memory.tiers` carries them out).

Data in: the engine's session index (`lamina.engine.sessions`). Data out: `TierOrder`s in
`StepPlan.tier_orders`; `TierMiss` back from a memory worker whose load found nothing valid.
"""
from __future__ import annotations

from dataclasses import dataclass

from lamina.errors import SequenceFault

TIER_OPS = ("save", "demote", "prefetch", "drop", "load")


@dataclass(frozen=True)
class TierConfig:
    """Session KV beyond the pools, per memory worker. `host_bytes` 0: no tiers (the
    pool's prefix cache only); `disk_dir` None: no disk tier. Errors name the fields as
    users set them (`EngineConfig.kv_host_bytes`, ...)."""

    host_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0

    def __post_init__(self):
        for f in ("host_bytes", "disk_bytes"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"EngineConfig.kv_{f} must be an int >= 0, got {v!r}")
        if self.disk_dir is not None and (not isinstance(self.disk_dir, str)
                                          or not self.disk_dir):
            raise ValueError(f"EngineConfig.kv_disk_dir must be a directory path or None, "
                             f"got {self.disk_dir!r}")
        if self.disk_dir is not None and not (self.host_bytes and self.disk_bytes):
            raise ValueError("EngineConfig.kv_disk_dir needs kv_host_bytes > 0 and "
                             "kv_disk_bytes > 0 (disk entries pass through the host tier; "
                             "kv_disk_bytes bounds the directory's use)")

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0


@dataclass(frozen=True)
class TierOrder:
    op: str  # one of TIER_OPS
    worker: int  # the memory worker that holds the entry
    entry: int  # the engine's id of one conversation's saved KV
    start: int = 0  # save / load: the first position
    slots: tuple[int, ...] = ()  # save / load: pool slots of positions start..
    seq_id: int = -1  # load: the sequence it is for (what `TierMiss` names)
    # load: the entry's positions start+shift.. go to positions start.. (the
    # conversation's oldest turns were dropped); keys are re-rotated by -shift
    shift: int = 0

    def __post_init__(self):
        if self.op not in TIER_OPS:
            raise ValueError(f"TierOrder.op must be one of {TIER_OPS}, got {self.op!r}")
        if self.shift and (self.op != "load" or self.shift < 0):
            raise ValueError(f"TierOrder {self.op} of entry {self.entry}: shift {self.shift}")
        if self.start < 0 or (self.op in ("save", "load") and not self.slots):
            raise ValueError(f"TierOrder {self.op} of entry {self.entry}: start "
                             f"{self.start}, {len(self.slots)} slots")


@dataclass(frozen=True)
class TierMove:
    """One saved entry moved from a leaving memory worker's tiers into a kept one's host
    tier (`Executor.move_tiers`, when the engine's memory workers shrink)."""
    entry: int
    source: int
    dest: int

    def __post_init__(self):
        if self.source == self.dest:
            raise ValueError(f"TierMove of entry {self.entry}: from worker {self.source} "
                             "to itself")


class TierMiss(SequenceFault):
    """Loads that found no valid entry: the step ran nothing yet (clean), and the engine
    recomputes these sequences instead of failing them."""

    def __init__(self, seq_ids, entries, message: str):
        super().__init__(seq_ids, message, clean=True)
        self.entries = tuple(entries)


def sum_stats(stats) -> dict:
    """Memory workers' tier stats (dicts of counts), added up key by key."""
    out: dict = {}
    for st in stats:
        for k, v in st.items():
            out[k] = out.get(k, 0) + v
    return out


def encode_orders(orders) -> list[int]:
    """Orders as flat ints for a data-plane frame: per order op, entry, start, shift,
    seq_id, n, then n slots."""
    out: list[int] = []
    for o in orders:
        out += [TIER_OPS.index(o.op), o.entry, o.start, o.shift, o.seq_id, len(o.slots),
                *o.slots]
    return out


def decode_orders(flat: list[int], worker: int) -> list[TierOrder]:
    """`encode_orders`' ints back; ValueError naming what is malformed."""
    out, i = [], 0
    while i < len(flat):
        if i + 6 > len(flat) or not 0 <= flat[i] < len(TIER_OPS):
            raise ValueError(f"bad tier order at {i}: {flat[i:i + 6]}")
        op, entry, start, shift, seq_id, n = flat[i:i + 6]
        if n < 0 or i + 6 + n > len(flat):
            raise ValueError(f"tier order at {i} names {n} slots; {len(flat) - i - 6} left")
        out.append(TierOrder(TIER_OPS[op], worker, entry, start, tuple(flat[i + 6:i + 6 + n]),
                             seq_id, shift))
        i += 6 + n
    return out


@dataclass(frozen=True)
class SlotMove:
    """A running sequence's KV at `src_slots` of a leaving memory worker copied into
    `dst_slots` of a kept one (`Executor.move_kv`, when the engine's memory workers
    shrink): the sequence goes on there instead of being preempted."""
    source: int
    dest: int
    src_slots: tuple[int, ...]
    dst_slots: tuple[int, ...]

    def __post_init__(self):
        if self.source == self.dest or len(self.src_slots) != len(self.dst_slots):
            raise ValueError(f"SlotMove of {len(self.src_slots)} slots from worker "
                             f"{self.source} into {len(self.dst_slots)} of worker {self.dest}")
