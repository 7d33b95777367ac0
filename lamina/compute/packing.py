"""Packing: a `StepPlan` -> one packed batch and each memory worker's share of it.

Data in: `StepPlan` (per sequence: new tokens, start position, slot table, placement).
Data out: `PackedBatch` (input ids and positions [1, N], the logit rows to keep, one
`WorkerPart` per memory worker, and the compute side's own part for local prefill).

Every op outside attention is per token, so all sequences' new tokens are packed into
one [1, N] row: prefill and decode mix in one step without padding. Rows are grouped by
memory worker (`by_worker`) so each worker's rows are one slice: its q/k/v go out
without a gather. `split_micro` cuts a plan into micro-batches for staggered pipelining.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from lamina.engine.messages import StepPlan
from lamina.kernels import SlotBatch
from lamina.memory.sparsity_config import SCORED


@dataclass
class WorkerPart:
    """One memory worker's share of a step."""

    rows: torch.Tensor  # [n] int64: its query rows in the packed token order
    new_slots: torch.Tensor  # [m] int32: where the k/v of `kv_rows` go in its pool
    batch: SlotBatch  # its sequences' slot tables and query positions
    # [m] int64: rows whose k/v it stores; None on creation: the query rows (set so)
    kv_rows: torch.Tensor = None  # type: ignore[assignment]
    # (a, b): rows and kv_rows are both exactly a..b-1 (a slice, no gather); None: not
    span: tuple[int, int] | None = None
    whole: bool = False  # span covers every packed row
    seq_ids: tuple[int, ...] = ()  # the sequence of each batch entry (to name it in errors)
    # per batch entry: its range's leading slots unchanged since its sequence's last plan
    # (the data plane then sends only the rest: `lamina.dataplane.tables`); () = none
    unchanged: tuple[int, ...] = ()

    def __post_init__(self):
        if self.kv_rows is None:
            self.kv_rows = self.rows

    @property
    def active(self) -> bool:
        """It has queries to attend or k/v to store this step."""
        return bool(self.rows.numel() or self.kv_rows.numel())

    def take(self, q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Its share of a layer's packed q [N, Hq, D] and k/v [N, Hkv, D]."""
        if self.whole:
            return q, k, v
        if self.span:
            a, b = self.span
            return q[a:b], k[a:b], v[a:b]
        rows, kv_rows = self.rows.to(q.device), self.kv_rows.to(k.device)
        return q.index_select(0, rows), k.index_select(0, kv_rows), v.index_select(0, kv_rows)

    def take_rows(self, x):
        """Its query rows of a packed [N, ...] tensor (a view when they are a slice)."""
        if self.span:
            return x if self.whole else x[self.span[0]:self.span[1]]
        return x.index_select(0, self.rows.to(x.device))


@dataclass(frozen=True)
class PromptRows:
    """A sequence whose prompt logprobs are wanted (a full prefill asking for them)."""

    sample: int  # its index among the batch's sampled sequences
    row: int  # its first row among the batch's logit rows
    count: int  # its prompt rows after the first token


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch packed for the slices: what `pack` returns."""

    input_ids: torch.Tensor  # [1, N] int64: every sequence's new tokens, in pack order
    positions: torch.Tensor  # [1, N] int64: their absolute positions
    logit_rows: tuple[int, ...]  # packed rows whose logits are needed (the last slice's)
    parts: tuple[WorkerPart, ...]  # one per memory worker
    merge: bool  # some query row attends on several workers (KV split): LSE merge
    # index in logit_rows of each sampled sequence's row (with a draft: its first row;
    # the draft's rows follow it)
    sample: tuple[int, ...]
    prompt: tuple[PromptRows, ...]  # sequences whose prompt logprobs are wanted
    local: WorkerPart | None  # the compute side's own part (local prefill), or None

    @property
    def local_slots(self) -> int:
        """Scratch-pool slots its local part takes."""
        return 0 if self.local is None else self.local.new_slots.numel()


@dataclass
class _PartRows:
    """A worker's share while it is being packed (lists grow per sequence)."""

    q_rows: list = field(default_factory=list)  # packed rows it attends
    kv_rows: list = field(default_factory=list)  # packed rows whose k/v it stores
    new_slots: list = field(default_factory=list)  # pool slots of those k/v
    tables: list = field(default_factory=list)  # per entry: its slot range's slots
    q_pos: list = field(default_factory=list)  # per entry: its queries' positions
    k_pos0: list = field(default_factory=list)  # per entry: position of its first key
    seq_ids: list = field(default_factory=list)  # per entry: its sequence
    unchanged: list = field(default_factory=list)  # per entry: see WorkerPart.unchanged

    def add(self, q_rows, kv_rows, new_slots, table, q_pos, k_pos0: int, seq_id: int,
            unchanged: int = 0):
        self.q_rows.extend(q_rows)
        self.kv_rows.extend(kv_rows)
        self.new_slots.extend(new_slots)
        self.tables.append(table)
        self.q_pos.append(q_pos)
        self.k_pos0.append(k_pos0)
        self.seq_ids.append(seq_id)
        self.unchanged.append(unchanged)

    def build(self, num_rows: int) -> WorkerPart:
        batch = SlotBatch.build(self.tables, [len(x) for x in self.q_pos], self.k_pos0,
                                q_pos=self.q_pos)
        qr, kr = self.q_rows, self.kv_rows
        # rows ascend, so they are a slice iff they span exactly len(qr) rows
        span = (qr[0], qr[-1] + 1) if qr and qr == kr and qr[-1] - qr[0] + 1 == len(qr) else None
        return WorkerPart(torch.tensor(qr, dtype=torch.int64),
                          torch.tensor(self.new_slots, dtype=torch.int32), batch,
                          torch.tensor(kr, dtype=torch.int64), span, span == (0, num_rows),
                          tuple(self.seq_ids), tuple(self.unchanged))


def pack(plan: StepPlan, num_workers: int, local: bool = False,
         local_base: int = 0, tables=None) -> PackedBatch:
    """The plan's sequences packed in plan order; see `PackedBatch`. `tables`: the kept
    slot tables (`compute_side.SlotTables`) a plan of diffs is read against; without
    them every sequence must carry its whole table (`slots_from` 0).

    `local` (paper 5.6): a sequence whose whole context is in this step (start_pos 0, KV
    on one worker) attends on the compute side, over a scratch pool's slots
    `local_base`, `local_base` + 1, ...; its worker only stores its k/v (kv rows, no
    query rows), unless the request's own KV policy scores its prompt there (`SCORED`)."""
    ids: list[int] = []
    pos: list[int] = []
    rows: list[int] = []  # logit rows
    sample: list[int] = []
    prompt: list[PromptRows] = []
    per = [_PartRows() for _ in range(num_workers)]
    mine, merge = _PartRows(), False  # the compute side's own part
    for s in plan.seqs:
        seg = s.placement
        if not all(0 <= w < num_workers for w, _ in seg):
            raise ValueError(f"seq {s.seq_id} placed on memory workers {[w for w, _ in seg]} "
                             f"of {num_workers}")
        n, r0, p0 = len(s.token_ids), len(ids), s.start_pos
        table = _table(s, tables)  # [L] int32
        ids += s.token_ids
        pos += range(p0, p0 + n)
        if s.sample and s.params.prompt_logprobs is not None and p0 == 0 and n > 1:
            prompt.append(PromptRows(len(sample), len(rows), n - 1))
            rows += range(r0, r0 + n - 1)
        if s.sample:  # its last row; with a draft, the rows of its last draft + 1 tokens
            sample.append(len(rows))
            rows += range(r0 + n - 1 - s.draft, r0 + n)
        # a request whose own KV policy scores its prompt attends it where it is stored
        if local and p0 == 0 and len(seg) == 1 and s.params.kv_sparsity not in SCORED:
            at = local_base + len(mine.new_slots)
            per[seg[0][0]].kv_rows.extend(range(r0, r0 + n))  # stores the k/v, attends none
            per[seg[0][0]].new_slots.extend(table.tolist())
            mine.add(range(r0, r0 + n), range(r0, r0 + n), range(at, at + n), range(at, at + n),
                     range(n), 0, s.seq_id)
            continue
        merge |= len(seg) > 1 and seg[-1][1] < p0 + n  # some query sees several ranges
        if tables is None:
            _place(s, table, r0, per, bool((table < 0).any()), 0)
        else:
            _place(s, table, r0, per, tables.holes(s.seq_id), tables.changed_from(s.seq_id))
    own = mine.build(len(ids))
    return PackedBatch(torch.tensor([ids]), torch.tensor([pos]), tuple(rows),
                       tuple(p.build(len(ids)) for p in per), merge, tuple(sample),
                       tuple(prompt), own if own.rows.numel() else None)


def _table(s, tables) -> np.ndarray:
    """s's whole slot table [L] int32."""
    if tables is not None:
        return tables.table(s.seq_id)
    if s.slots_from:
        raise ValueError(f"seq {s.seq_id}: its plan sends slots from position "
                         f"{s.slots_from}; packing it needs the kept tables")
    return np.asarray(s.slots, dtype=np.int32)


def _place(s, table: np.ndarray, r0: int, per: list[_PartRows],
           holes: bool = False, changed: int | None = None) -> None:
    """Sequence `s` (its rows from r0, its whole slot `table`) onto the workers holding
    its slot ranges: each worker attends the queries that see keys in its range and
    stores the new k/v that fall in it. Positions before `s.slots_from` are as in its
    last plan (the memory workers may hold them: `WorkerPart.unchanged`). A table with
    `holes` (-1: slots given back; one worker) lists its other positions as keys;
    `changed`: the first position that became a hole with this plan (what the worker
    holds differs from there on)."""
    n, p0, seg = len(s.token_ids), s.start_pos, s.placement
    if len(seg) == 1:  # all its KV on one worker: its queries see the whole table
        keys, held = table, min(s.slots_from, len(table))
        if holes:
            live = table >= 0
            upto = s.slots_from if changed is None else min(s.slots_from, changed)
            keys = table[live]
            held = int(np.count_nonzero(live[:upto]))  # the worker's copy: its keys up to there
        rows = range(r0, r0 + n)
        per[seg[0][0]].add(rows, rows, table[p0:p0 + n].tolist(), keys, range(p0, p0 + n), 0,
                           s.seq_id, held)
        return
    if holes:
        raise ValueError(f"seq {s.seq_id}: a table with holes must lie on one memory worker")
    ends = [a for _, a in seg[1:]] + [len(table)]
    for (w, a), b in zip(seg, ends):
        q0 = max(a, p0)  # queries (and new k/v) at positions >= a fall in this range
        if q0 >= p0 + n:
            continue
        kv1 = min(b, p0 + n)  # new positions stored here: q0 .. kv1
        per[w].add(range(r0 + q0 - p0, r0 + n), range(r0 + q0 - p0, r0 + kv1 - p0),
                   table[q0:kv1].tolist(), table[a:b], range(q0, p0 + n), a, s.seq_id,
                   max(0, min(s.slots_from, b) - a))


def by_worker(seqs: tuple) -> tuple:
    """The sequences grouped by memory worker (stable; KV-split ones last), so that in the
    packed order each worker's rows are one slice: its q/k/v go out without a gather."""
    return tuple(sorted(seqs, key=lambda s: (len(s.placement) > 1, s.placement[0][0])))


def split_micro(seqs: tuple, n: int) -> list[tuple]:
    """Cut the plan's sequences into <= n contiguous groups of about equal token counts
    (contiguous, so the sampled rows stay in plan order)."""
    total = sum(len(s.token_ids) for s in seqs)
    groups: list[tuple] = []
    cur: list = []
    acc = 0
    for s in seqs:
        cur.append(s)
        acc += len(s.token_ids)
        if acc * n >= total * (len(groups) + 1) and len(groups) < n - 1:
            groups.append(tuple(cur))
            cur = []
    if cur:
        groups.append(tuple(cur))
    return groups
