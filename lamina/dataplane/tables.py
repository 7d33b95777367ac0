"""Slot tables held across steps on both ends of one data-plane connection, so that a
step's metadata carries each sequence's new slots only (vLLM's cached-request diffs).

Data in (compute end, `SentTables.diff`): a `WorkerPart`'s batch entries, each a KV range
of one sequence (its slots in position order, `SlotBatch.slots[cu_k[b]:cu_k[b+1]]`,
starting at position `k_pos0[b]`), and how many of the range's leading slots are
unchanged since that sequence's last plan (`WorkerPart.unchanged`: the engine's
`SeqWork.slots_from`; 0 for a table sent whole).
Data out: per entry the number of slots the memory end already holds and keeps
(`keep` [B] int32) and the rest (`tail` [sum(len_b - keep_b)] int32); the memory end
(`HeldTables.apply`) rebuilds the whole `SlotBatch.slots` from its tables and the tail.

A decode step of B sequences of context L sends O(B) integers instead of O(B x L). Both
ends key a range by (sequence id, its first position): a sequence whose KV is split over
workers has one range on each. Released sequences (finished, preempted, failed: the
plan's `released`) are dropped on the compute end at once and on the memory end with the
next metadata that reaches it. A connection's tables live and die with it: a replaced
worker or compute side starts both ends empty (every table is then sent whole once).
An entry without a sequence id (-1: probes, hand-built parts) is sent whole and not
held.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from lamina.kernels.slots import GrowingSlots


class TableError(ValueError):
    """The compute end asked the memory end to keep slots it does not hold."""


class SentTables:
    """The compute end's record of what one connection's memory end holds."""

    def __init__(self) -> None:
        self.sent: dict[tuple[int, int], int] = {}  # (seq, first position) -> slots held
        self._starts: dict[int, set[int]] = {}  # seq -> first positions of its ranges
        self.pending: list[int] = []  # released sequences the memory end still holds
        self.overrides: dict[int, object] = {}  # seq -> the KV override the end holds

    def new_overrides(self, overrides: Mapping, seq_ids: Sequence[int]) -> list:
        """Rows (`KVOverride.encode`) of the overrides of `seq_ids` that the memory end
        does not hold yet; recorded as held."""
        rows = []
        for sid in seq_ids:
            ov = overrides.get(sid)
            if ov is not None and self.overrides.get(sid) != ov:
                self.overrides[sid] = ov
                rows.append(ov.encode(sid))
        return rows

    def release(self, seq_ids: Sequence[int]) -> None:
        for sid in seq_ids:
            self.overrides.pop(sid, None)
            starts = self._starts.pop(sid, None)
            if starts is not None:
                for a in starts:
                    del self.sent[(sid, a)]
                self.pending.append(sid)

    def take_released(self) -> list[int]:
        out, self.pending = self.pending, []
        return out

    def diff(self, seq_ids: Sequence[int], slots: torch.Tensor, cu_k: torch.Tensor,
             k_pos0: torch.Tensor, unchanged: Sequence[int]):
        """-> (keep [B] int32, tail [T] int32) for one part's B entries; records what the
        memory end will hold after applying them."""
        b_count = len(cu_k) - 1
        cu, k0 = cu_k.tolist(), k_pos0.tolist()
        known = len(seq_ids) == b_count and len(unchanged) == b_count
        keep = [0] * b_count
        for b in range(b_count):
            sid = seq_ids[b] if known else -1
            if sid < 0:
                continue
            n, key = cu[b + 1] - cu[b], (sid, k0[b])
            keep[b] = max(0, min(self.sent.get(key, 0), unchanged[b], n))
            self.sent[key] = n
            self._starts.setdefault(sid, set()).add(k0[b])
        if not any(keep):
            return torch.tensor(keep, dtype=torch.int32), slots
        flat = slots.numpy()
        tail = np.concatenate([flat[cu[b] + keep[b]:cu[b + 1]] for b in range(b_count)])
        return torch.tensor(keep, dtype=torch.int32), torch.from_numpy(tail)


class HeldTables:
    """The memory end's tables of one connection."""

    def __init__(self) -> None:
        self._t: dict[int, dict[int, GrowingSlots]] = {}  # seq -> first position -> slots

    def __len__(self) -> int:
        return len(self._t)

    def slots(self, seq_id: int) -> dict[int, list[int]]:
        """seq's held ranges: first position -> slots (tests, debugging)."""
        return {a: g.view().tolist() for a, g in self._t.get(seq_id, {}).items()}

    def release(self, seq_ids: Sequence[int]) -> None:
        for sid in seq_ids:
            self._t.pop(sid, None)

    def apply(self, seq_ids: Sequence[int], keep: torch.Tensor, tail: torch.Tensor,
              cu_k: torch.Tensor, k_pos0: torch.Tensor) -> torch.Tensor:
        """-> the entries' whole slots [Nk] int32 (`SlotBatch.slots`); the held tables
        take each entry's kept slots plus its tail. Raises `TableError` (nothing
        changed) on a keep count this end cannot honour."""
        cu, k0, kp = cu_k.tolist(), k_pos0.tolist(), keep.tolist()
        b_count = len(cu) - 1
        lens = [cu[b + 1] - cu[b] for b in range(b_count)]
        if len(kp) != b_count or len(k0) != b_count:
            raise TableError(f"{len(kp)} keep counts and {len(k0)} first positions for "
                             f"{b_count} entries")
        if tail.numel() != cu[-1] - sum(kp):
            raise TableError(f"tail of {tail.numel()} slots, expected {cu[-1] - sum(kp)} "
                             f"({cu[-1]} slots, {sum(kp)} kept)")
        known = len(seq_ids) == b_count
        for b in range(b_count):  # check all first: a refused step changes nothing
            have = self._held(seq_ids[b] if known else -1, k0[b])
            if not 0 <= kp[b] <= min(lens[b], have.n if have else 0):
                sid = seq_ids[b] if known else -1
                raise TableError(f"entry {b} (seq {sid}, KV from position {k0[b]}) keeps "
                                 f"{kp[b]} slots, but this end holds "
                                 f"{have.n if have else 0} (the ends are out of step)")
        if not any(kp) and not known:
            return tail
        flat, pieces, at = tail.numpy(), [], 0
        for b in range(b_count):
            new = flat[at:at + lens[b] - kp[b]]
            at += lens[b] - kp[b]
            sid = seq_ids[b] if known else -1
            if sid < 0:
                pieces.append(new)
                continue
            g = self._t.setdefault(sid, {}).setdefault(k0[b], GrowingSlots())
            g.cut_and_extend(kp[b], new)
            pieces.append(g.view())
        out = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
        return torch.from_numpy(out)

    def _held(self, sid: int, a: int) -> GrowingSlots | None:
        return self._t.get(sid, {}).get(a) if sid >= 0 else None
