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

from dataclasses import dataclass

import torch

from lamina.engine.messages import StepPlan
from lamina.kernels import (
    SlotBatch,
)


@dataclass
class WorkerPart:
    """One memory worker's share of a step."""

    rows: torch.Tensor  # [n] int64: its query rows in the packed token order
    new_slots: torch.Tensor  # [m] int32: where the k/v of `kv_rows` go in its pool
    batch: SlotBatch  # its sequences' slot tables and query positions
    kv_rows: torch.Tensor | None = None  # [m] int64: rows whose k/v it stores (None: rows)
    # (a, b): rows and kv_rows are both exactly a..b-1 (a slice, no gather); None: not
    span: tuple[int, int] | None = None
    whole: bool = False  # span covers every packed row
    seq_ids: tuple[int, ...] = ()  # the sequence of each batch entry (to name it in errors)

    def __post_init__(self):
        if self.kv_rows is None:
            self.kv_rows = self.rows

    @property
    def active(self) -> bool:
        """It has queries to attend or k/v to store this step."""
        return bool(self.rows.numel() or self.kv_rows.numel())

    def take(self, q, k, v):
        """Its share of a layer's packed q [N, Hq, D] and k/v [N, Hkv, D]."""
        if self.whole:
            return q, k, v
        if self.span:
            a, b = self.span
            return q[a:b], k[a:b], v[a:b]
        return (q.index_select(0, self.rows), k.index_select(0, self.kv_rows),
                v.index_select(0, self.kv_rows))

    def take_rows(self, x):
        """Its query rows of a packed [N, ...] tensor (a view when they are a slice)."""
        if self.span:
            return x if self.whole else x[self.span[0]:self.span[1]]
        return x.index_select(0, self.rows)


def pack(plan: StepPlan, num_workers: int, local: bool = False, local_base: int = 0):
    """-> input_ids [1, N], position_ids [1, N], logit rows, [WorkerPart per worker],
    merge (True when some query row attends on several workers: KV split), sample (the
    index in logit rows of each sampled row), prompt ((seq index, first logit row, count)
    for each sequence whose prompt logprobs are wanted: a full prefill asking for them),
    and the compute side's own part (or None).

    `local` (paper 5.6): a sequence whose whole context is in this step (start_pos 0, KV
    on one worker) attends on the compute side, over a scratch pool's slots
    `local_base`, `local_base` + 1, ...; its worker only stores its k/v (kv rows, no
    query rows)."""
    ids, pos, rows, merge, sample, prompt = [], [], [], False, [], []
    # per worker: query rows, kv rows, new slots, tables, q positions, k_pos0, seq ids
    per = [([], [], [], [], [], [], []) for _ in range(num_workers)]
    mine = ([], [], [], [], [], [], [])  # the same for the compute side's own part
    for s in plan.seqs:
        seg = s.placement
        if any(not 0 <= w < num_workers for w, _ in seg):
            raise ValueError(f"seq {s.seq_id} placed on memory workers {[w for w, _ in seg]} "
                             f"of {num_workers}")
        n, r0, p0 = len(s.token_ids), len(ids), s.start_pos
        ids += s.token_ids
        pos += range(p0, p0 + n)
        if s.sample and s.params.prompt_logprobs is not None and p0 == 0 and n > 1:
            prompt.append((len(sample), len(rows), n - 1))
            rows += range(r0, r0 + n - 1)
        if s.sample:
            sample.append(len(rows))
            rows.append(r0 + n - 1)
        if local and p0 == 0 and len(seg) == 1:
            p, at = per[seg[0][0]], local_base + len(mine[2])
            p[1].extend(range(r0, r0 + n))  # the worker stores the k/v, attends nothing
            p[2].extend(s.slots)
            for x, add in zip(mine, (range(r0, r0 + n), range(r0, r0 + n), range(at, at + n),
                                     [range(at, at + n)], [range(n)], [0], [s.seq_id])):
                x.extend(add)
            continue
        merge |= len(seg) > 1 and seg[-1][1] < p0 + n  # some query sees several ranges
        ends = [a for _, a in seg[1:]] + [len(s.slots)]
        for (w, a), b in zip(seg, ends):
            q0 = max(a, p0)  # queries at positions >= a see keys in this range
            if q0 >= p0 + n:
                continue
            p = per[w]
            p[0].extend(range(r0 + q0 - p0, r0 + n))
            kv0, kv1 = max(a, p0), min(b, p0 + n)  # new positions stored here
            p[1].extend(range(r0 + kv0 - p0, r0 + kv1 - p0))
            p[2].extend(s.slots[kv0:kv1])
            p[3].append(s.slots[a:b])
            p[4].append(range(q0, p0 + n))
            p[5].append(a)
            p[6].append(s.seq_id)
    parts = []
    for qr, kr, ns, tables, qpos, k0, sids in [*per, mine]:
        batch = SlotBatch.build(tables, [len(x) for x in qpos], k0, q_pos=qpos)
        # rows ascend, so they are a slice iff they span exactly len(qr) rows
        span = (qr[0], qr[-1] + 1) if qr and qr == kr and qr[-1] - qr[0] + 1 == len(qr) else None
        parts.append(WorkerPart(torch.tensor(qr, dtype=torch.int64),
                                torch.tensor(ns, dtype=torch.int32), batch,
                                torch.tensor(kr, dtype=torch.int64), span,
                                span == (0, len(ids)), tuple(sids)))
    own = parts.pop()
    return (torch.tensor([ids]), torch.tensor([pos]), rows, parts, merge, sample, prompt,
            own if own.rows.numel() else None)


def by_worker(seqs: tuple) -> tuple:
    """The sequences grouped by memory worker (stable; KV-split ones last), so that in the
    packed order each worker's rows are one slice: its q/k/v go out without a gather."""
    return tuple(sorted(seqs, key=lambda s: (len(s.placement) > 1, s.placement[0][0])))


def split_micro(seqs: tuple, n: int) -> list[tuple]:
    """Cut the plan's sequences into <= n contiguous groups of about equal token counts
    (contiguous, so the sampled rows stay in plan order)."""
    total = sum(len(s.token_ids) for s in seqs)
    groups, cur, acc = [], [], 0
    for s in seqs:
        cur.append(s)
        acc += len(s.token_ids)
        if acc * n >= total * (len(groups) + 1) and len(groups) < n - 1:
            groups.append(tuple(cur))
            cur = []
    if cur:
        groups.append(tuple(cur))
    return groups
