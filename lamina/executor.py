"""Executors run a `StepPlan` through the model slices and the memory side.

Data in: `StepPlan` (tokens, positions, per-worker slot tables) from the engine.
Data out: `StepResult` (the tokens drawn for the sampling sequences; the sampler runs
here, on the compute side, so only token ids go back to the engine).

All sequences' new tokens are packed into one [1, N] row: every op outside attention is
per token, so the slices need no padding, and prefill and decode mix freely in one step.
For each attention layer the packed q/k/v rows are split by memory worker (requests are
partitioned across workers; rows are packed grouped by worker, so each worker's share is
one slice), each worker writes its rows' k/v into its pool and attends over its
sequences' slots, and the outputs are put back in row order. With
`plan.micro_batches = 2` the step runs as two sub-batches in a staggered pipeline (paper
5.1, the n = 2 case on one replica): slice i of one overlaps the other's attention.
The last slice (last layer's o_proj and MLP, final norm, lm_head) runs on the sampled
rows only: in a prefill, the other prompt tokens' outputs are never needed. With
`ComputeSide.local_kv_dtype` set (the Ray compute worker; paper 5.6), fresh prompts
attend here over a scratch pool and their workers only store their k/v.
`LocalExecutor` holds its memory sides in this process; `lamina.cluster` runs the same
`ComputeSide` in a Ray actor that talks to memory-worker processes over the data plane.
"""
from __future__ import annotations

import importlib
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from lamina.kernels import (
    AttentionInputError,
    AttentionParams,
    SlotBatch,
    merge_attention,
    prefill_attention,
    select_backend,
    validate_batch,
)
from lamina.splitter.split import SplitModel

from .errors import SequenceFault
from .kv_pool import KVPool, KVPoolConfig
from .messages import SeqWork, StepPlan, StepResult
from .sampling import prompt_logprobs, row_logprobs, sample_rows


class Executor(ABC):
    @abstractmethod
    def execute(self, plan: StepPlan) -> StepResult: ...

    def probe(self, tokens, repeat: int = 20) -> dict:
        """Per-op costs of this executor's own plumbing, for simulator calibration:
        {"exchange_s": {n: one layer's q/k/v out and o back for n tokens}, "submit_s": {n:
        the sending part alone}, "call_s": {n: the per-step call returning n tokens}}.
        Empty when there is nothing to add (in-process). Only call it while no request is
        running."""
        return {}

    def recover(self, error: BaseException) -> bool:
        """After `execute` raised `error`: bring the workers back (replacing dead ones) so
        steps can run again. True if it did; every memory worker's KV is then empty, and
        the engine recomputes what it held. False (the default): not recoverable."""
        return False

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        pass


# Executors that live in other packages, found by name at run time (so lamina/ never
# imports them statically; only lamina.cluster imports ray).
PLUGINS = {"ray": "lamina.cluster.executor:RayExecutor"}


def plugin_executor(name: str):
    if name not in PLUGINS:
        raise ValueError(f"unknown executor {name!r}; choose 'local' or one of {sorted(PLUGINS)}")
    mod, cls = PLUGINS[name].split(":")
    try:
        return getattr(importlib.import_module(mod), cls)
    except ImportError as e:
        raise ImportError(f"executor {name!r} needs {e.name}: {e}") from e


def attention_params(spec) -> AttentionParams:
    return AttentionParams(spec.scale, spec.sliding_window or -1, spec.softcap or 0.0,
                           spec.sinks)


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


class MemorySide:
    """One memory worker's state: a KV pool and an attention backend. The pool may sit on
    a GPU while q/k/v arrive in host memory (the data plane carries host tensors): they
    go to the pool's device and the outputs come back."""

    def __init__(self, pool: KVPool, backend=None, faults=None):
        self.pool = pool
        self.device = pool.k.device
        self.backend = backend or select_backend(device=self.device)
        self.faults = faults  # a lamina.faults.FaultPlan (tests) or None
        self._step = (None, None, None, None)  # new_slots, batch -> their checked forms

    def check(self, new_slots, batch, seq_ids: tuple[int, ...] = ()) -> None:
        """Once per step: the batch's index scans and the new slots' range (per layer,
        `attend(..., checked=True)` then runs only the cheap shape checks). The write
        index (int64) and the batch are put on the pool's device once here. `seq_ids`:
        each batch entry's sequence; a bad entry raises `SequenceFault` naming it."""
        n = self.pool.config.num_slots
        try:
            validate_batch(batch, n)
        except AttentionInputError as e:
            _blame(bad_entries(batch, n), batch, seq_ids, f"bad KV metadata: {e}")
            raise
        if new_slots.numel() and (int(new_slots.min()) < 0 or int(new_slots.max()) >= n):
            raise AttentionInputError(f"new slot ids out of range [0, {n}): min "
                                      f"{int(new_slots.min())}, max {int(new_slots.max())}")
        if self.faults is not None and self.faults.memory_pos is not None:
            cu = batch.cu_q.tolist()
            bad = [b for b in range(batch.num_requests)
                   if self.faults.check_memory(batch.q_pos[cu[b]:cu[b + 1]].tolist())]
            what = f"injected memory fault at position {self.faults.memory_pos}"
            _blame(bad, batch, seq_ids, what)
            if bad:
                raise AttentionInputError(f"{what} (batch entries {bad})")
        self._step = (new_slots, new_slots.long().to(self.device), batch,
                      batch if batch.slots.device == self.device else batch.to(self.device))

    def attend(self, layer: int, params: AttentionParams, q, k, v, new_slots, batch,
               checked: bool = False):
        """q [n, Hq, D], k/v [m, Hkv, D] -> (o [n, Hq, Dv], lse [n, Hq] fp32) on q's device;
        writes k/v at new_slots [m] first."""
        kp, vp = self.pool.layer(layer)
        if checked and self._step[0] is new_slots and self._step[2] is batch:
            new_slots, batch = self._step[1], self._step[3]  # the same objects every layer
        elif batch.slots.device != self.device:
            new_slots, batch = new_slots.to(self.device), batch.to(self.device)
        home = q.device
        if home != self.device:
            q, k, v = (t.to(self.device, non_blocking=True) for t in (q, k, v))
        o, lse = prefill_attention(q, k, v, kp, vp, new_slots, batch, params, self.backend,
                                   checked)
        return (o, lse) if home == self.device else (o.to(home), lse.to(home))


def _blame(bad: list[int], batch: SlotBatch, seq_ids: tuple[int, ...], what: str) -> None:
    """Raise `SequenceFault` for batch entries `bad` when every entry's sequence is known
    (`seq_ids`, one per entry); else return and let the caller raise its own error."""
    if bad and len(seq_ids) == batch.num_requests:
        raise SequenceFault([seq_ids[b] for b in bad], what)


def bad_entries(batch: SlotBatch, num_slots: int) -> list[int]:
    """The batch entries whose own slots or query positions are out of range (the
    per-entry scan behind a failed `validate_batch`); [] when the fault is not any one
    entry's (offsets, dtypes)."""
    cu_q, cu_k = batch.cu_q.tolist(), batch.cu_k.tolist()
    if (len(cu_q) != len(cu_k) or cu_q[-1] != batch.num_queries
            or cu_k[-1] != batch.num_keys):
        return []
    bad = []
    for b in range(len(cu_q) - 1):
        sl, qp = batch.slots[cu_k[b]:cu_k[b + 1]], batch.q_pos[cu_q[b]:cu_q[b + 1]]
        if ((sl.numel() and (int(sl.min()) < 0 or int(sl.max()) >= num_slots))
                or (qp.numel() and int(qp.min()) < 0)):
            bad.append(b)
    return bad


class MemoryLink(ABC):
    """The compute side's view of its memory workers for one step. `submit` hands a
    micro-batch's layer q/k/v over and returns at once; `collect` waits for its output.
    Between the two the compute side runs the other micro-batches (staggered pipelining)."""

    def begin(self, step: int, parts: list[list[WorkerPart]]) -> None:  # noqa: B027
        pass

    @abstractmethod
    def submit(self, layer: int, mb: int, q, k, v, parts: list[WorkerPart]) -> None: ...

    @abstractmethod
    def collect(self, layer: int, mb: int, parts: list[WorkerPart], out_shape, dtype,
                merge: bool = False) -> torch.Tensor: ...

    def exchange(self, layer: int, mb: int, q, k, v, parts: list[WorkerPart], out_shape,
                 dtype, merge: bool = False):
        """`submit` and `collect` at once, for a step with nothing to run between them:
        -> (o, seconds spent sending), or None where this link has no such path."""
        return None


def combine(parts: list[WorkerPart], outs: list, out_shape, dtype, merge: bool):
    """Workers' (o [n_w, Hq, Dv], lse [n_w, Hq]) -> o [N, Hq, Dv] in packed row order.
    `merge`: some rows attended on several workers (KV split); their partials are merged
    exactly by log-sum-exp. Rows are unique within one worker's part."""
    n, hq, dv = out_shape
    if not merge:
        for p, r in zip(parts, outs):
            if p.whole:  # one worker has every row: its output is the answer
                return r[0] if r[0].dtype == dtype else r[0].to(dtype)
        o = torch.empty(n, hq, dv, dtype=dtype)
        for p, r in zip(parts, outs):
            if r is not None and p.span:
                o[p.span[0]:p.span[1]] = r[0]
            elif r is not None:
                o.index_copy_(0, p.rows, r[0].to(dtype))
        return o
    os, lses = [], []
    for p, r in zip(parts, outs):  # each worker's partial over all rows; absent: lse -inf
        if r is not None:
            o = torch.zeros(n, hq, dv)
            lse = torch.full((n, hq), float("-inf"))
            o[p.rows], lse[p.rows] = r[0].float(), r[1]
            os.append(o)
            lses.append(lse)
    return merge_attention(os, lses)[0].to(dtype)


class ComputeSide:
    """Runs the slices over one or more micro-batches; the memory side is a `MemoryLink`."""

    def __init__(self, split: SplitModel, num_workers: int, local_kv_dtype: str | None = None):
        self.split, self.num_workers = split, num_workers
        self.params = [attention_params(s) for s in split.attention_specs]
        self.group_rows = True  # pack rows grouped by worker (False: plan order, to compare)
        # Set: prompts whose whole context is in the step attend here (paper 5.6), over a
        # scratch pool of this KV dtype (the memory workers' own, so the same rounding);
        # the memory workers only store their k/v.
        self.local_kv_dtype = local_kv_dtype
        self._scratch: MemorySide | None = None
        # What a sequence's new data is checked against before anything runs (None: not
        # known here); a bad sequence fails alone (`SequenceFault`), not the step.
        self.vocab_size: int | None = None
        self.pool_slots: int | None = None  # each memory worker's pool
        self.faults = None  # a lamina.faults.FaultPlan (tests) or None

    def check(self, plan: StepPlan) -> None:
        """Each sequence's new tokens and new slots, before any worker sees the step:
        -> SequenceFault(clean) naming every bad one. Only new data is scanned (earlier
        slots passed this when they were new), so a decode step costs O(batch)."""
        bad, why = [], []
        for s in plan.seqs:
            try:
                self._check_seq(s)
            except Exception as e:  # noqa: BLE001 - any failure here is this sequence's
                bad.append(s.seq_id)
                why.append(f"seq {s.seq_id}: {type(e).__name__}: {e}")
        if bad:
            raise SequenceFault(bad, "; ".join(why))

    def _check_seq(self, s: SeqWork) -> None:
        toks, new = s.token_ids, s.slots[s.start_pos:]
        if self.vocab_size is not None and (min(toks) < 0 or max(toks) >= self.vocab_size):
            raise ValueError(f"token ids {min(toks)}..{max(toks)} outside the vocabulary "
                             f"of {self.vocab_size}")
        if self.pool_slots is not None and (min(new) < 0 or max(new) >= self.pool_slots):
            raise ValueError(f"KV slots {min(new)}..{max(new)} outside the pool's "
                             f"{self.pool_slots}")
        if self.faults is not None:
            self.faults.check_sequence(toks)

    def _local_side(self, tokens: int) -> MemorySide:
        """The scratch pool's memory side, grown to hold `tokens` slots."""
        if self._scratch is None or self._scratch.pool.config.num_slots < tokens:
            cfg = KVPoolConfig.for_specs(self.split.attention_specs, max(tokens, 256),
                                         self.local_kv_dtype)
            self._scratch = MemorySide(KVPool(cfg))
        return self._scratch

    @torch.no_grad()
    def run(self, plan: StepPlan, link: MemoryLink) -> StepResult:
        self.check(plan)
        groups = [by_worker(g) if self.group_rows else g
                  for g in split_micro(plan.seqs, plan.micro_batches)]
        local, mbs, base = self.local_kv_dtype is not None, [], 0
        for g in groups:  # micro-batches' local tokens take disjoint scratch slots
            mbs.append(pack(StepPlan(plan.step, g), self.num_workers, local, base))
            base += 0 if mbs[-1][7] is None else mbs[-1][7].new_slots.numel()
        if any(m[4] for m in mbs) and any(p.sinks is not None for p in self.params):
            raise ValueError("a sequence's KV is split over memory workers, but this model's "
                             "attention has sinks: run with split_kv=False")
        mine = self._local_side(base) if base else None
        link.begin(plan.step, [m[3] for m in mbs])
        t_dense = t_submit = t_wait = t_local = 0.0
        exchanges = 0  # layers sent and collected in one `exchange` call
        outs, own, ready = [None] * len(mbs), [None] * len(mbs), [None] * len(mbs)
        n_layers = len(self.params)
        # One micro-batch with no prompts attending here: nothing runs between a layer's
        # submit and collect, so the link may do both in one call (`exchange`).
        at_once = len(mbs) == 1 and mbs[0][7] is None
        # Layer i of micro-batch j: wait for its layer i-1 attention, run slice i, submit.
        # The memory side attends micro-batch j while this thread runs j+1's slice (and
        # this step's own prompts' attention).
        for i in range(n_layers + 1):
            for j, (ids, pos, rows, parts, merge, _, _, lp) in enumerate(mbs):
                if i == 0:
                    args = (ids, pos)
                else:
                    q, v, ctx = outs[j][0], outs[j][2], outs[j][3:]
                    if ready[j] is not None:
                        o, ready[j] = ready[j], None
                    else:
                        t = time.perf_counter()
                        o = link.collect(i - 1, j, parts,
                                         (q.shape[2], q.shape[1], v.shape[-1]), q.dtype, merge)
                        if lp is not None:  # the prompts attended here
                            o.index_copy_(0, lp.rows, own[j].to(o.dtype))
                        t_wait += time.perf_counter() - t
                    args = (pos, o[None], *ctx)  # attn_out [1, N, Hq, Dv]
                    if i == n_layers:
                        if not rows:
                            outs[j] = None  # nothing to sample in this micro-batch
                            continue
                        args = _select_rows(args, rows)
                if self.faults is not None:
                    self.faults.check_layer(i, ids[0].tolist())
                t = time.perf_counter()
                outs[j] = self.split.slices[i](*args)
                t_dense += time.perf_counter() - t
                if i < n_layers:
                    q, k, v = outs[j][0], outs[j][1], outs[j][2]
                    t = time.perf_counter()
                    # [1, H, N, D] -> [N, H, D]
                    qkv = (q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1))
                    if at_once and (r := link.exchange(
                            i, j, *qkv, parts, (q.shape[2], q.shape[1], v.shape[-1]),
                            q.dtype, merge)) is not None:
                        ready[j], sent = r
                        exchanges += 1
                        t_submit += sent
                        t_wait += time.perf_counter() - t - sent
                        continue
                    link.submit(i, j, *qkv, parts)
                    t_submit += time.perf_counter() - t
                    if lp is not None:  # while the memory workers attend theirs
                        t = time.perf_counter()
                        own[j] = mine.attend(i, self.params[i], *lp.take(*qkv), lp.new_slots,
                                             lp.batch)[0]
                        t_local += time.perf_counter() - t
        t = time.perf_counter()
        works, tokens, lps, plps = [s for g in groups for s in g if s.sample], [], None, None
        if works:
            # all: [R, V] logit rows (picked here if the last slice ran on every token)
            all_, sample, prompt, at, k = [], [], [], 0, 0
            for out, m in zip(outs, mbs):
                if out is not None:
                    all_.append(out[0][0] if out[0].shape[1] == len(m[2]) else out[0][0, m[2]])
                    sample += [at + r for r in m[5]]
                    prompt += [(k + i, at + r0, n) for i, r0, n in m[6]]
                    at, k = at + len(m[2]), k + len(m[5])
            # the model's dtype (sample_rows casts what it must); one part: no copy
            all_ = all_[0] if len(all_) == 1 else torch.cat(all_)
            logits = all_ if len(sample) == len(all_) else all_[sample]  # [S, V]
            tokens, lps = _draw(logits, works)
            if prompt:
                plps = [None] * len(works)
                for i, r0, n in prompt:
                    s = works[i]
                    plps[i] = prompt_logprobs(all_[r0:r0 + n], list(s.token_ids[1:n + 1]),
                                              s.params.prompt_logprobs)
                plps = tuple(plps)
        t_sample = time.perf_counter() - t
        if works:  # back to plan order (rows were grouped by worker)
            rank = {s.seq_id: i for i, s in enumerate(s for s in plan.seqs if s.sample)}
            order = sorted(range(len(works)), key=lambda i: rank[works[i].seq_id])
            works, tokens = [works[i] for i in order], [tokens[i] for i in order]
            lps = lps if lps is None else tuple(lps[i] for i in order)
            plps = plps if plps is None else tuple(plps[i] for i in order)
        return StepResult(plan.step, tuple(s.seq_id for s in works), tuple(tokens),
                          {"dense_s": t_dense, "submit_s": t_submit, "wait_s": t_wait,
                           "attention_s": t_submit + t_wait + t_local, "local_s": t_local,
                           "sample_s": t_sample, "micro_batches": len(mbs),
                           "exchanges": exchanges}, lps, plps)


def _draw(logits: torch.Tensor, works: list[SeqWork]):
    """logits [S, V] -> (tokens per row, logprobs per row or None). A failure is put on
    the rows that fail alone (`SequenceFault`, clean: every worker finished the step)."""
    def run(rows, ws):
        toks = sample_rows(rows, [s.params for s in ws], [s.seeds for s in ws],
                           [s.next_pos for s in ws], [(s.history, s.prompt_len) for s in ws])
        lps = None
        if any(s.params.logprobs is not None for s in ws):
            lps = tuple(row_logprobs(rows, [s.params for s in ws], toks))
        return toks, lps

    try:
        return run(logits, works)
    except Exception as e:  # find the rows it belongs to
        bad, why = [], f"{type(e).__name__}: {e}"
        for r, s in enumerate(works):
            try:
                run(logits[r:r + 1], [s])
            except Exception as e1:  # noqa: BLE001
                bad.append(s.seq_id)
                why = f"{type(e1).__name__}: {e1}"
        if not bad:
            raise
        raise SequenceFault(bad, f"sampling failed: {why}") from e


def _select_rows(args: tuple, rows: list[int]) -> tuple:
    """The last slice's inputs at the sampled rows only. Every op outside attention is
    per token, so each input is [1, N, ...] over the packed tokens."""
    n = args[0].shape[1]
    if len(rows) == n:
        return args
    if any(a.dim() < 2 or a.shape[0] != 1 or a.shape[1] != n for a in args):
        return args  # not token-major: run it whole (still correct, just slower)
    idx = torch.tensor(rows, dtype=torch.long)
    return tuple(a.index_select(1, idx) for a in args)


class _LocalLink(MemoryLink):
    """Memory sides in this process: attention runs inside `submit` (no overlap)."""

    def __init__(self, memory: list[MemorySide], params):
        self.memory, self.params, self.ready = memory, params, {}

    def begin(self, step, parts):
        for mb in parts:
            for mem, p in zip(self.memory, mb):
                if p.active:
                    mem.check(p.new_slots, p.batch, p.seq_ids)

    def submit(self, layer, mb, q, k, v, parts):
        self.ready[layer, mb] = [
            mem.attend(layer, self.params[layer], *p.take(q, k, v), p.new_slots, p.batch,
                       checked=True)
            if p.active else None
            for mem, p in zip(self.memory, parts)]

    def collect(self, layer, mb, parts, out_shape, dtype, merge=False):
        return combine(parts, self.ready.pop((layer, mb)), out_shape, dtype, merge)


class LocalExecutor(Executor):
    def __init__(self, split: SplitModel, memory: MemorySide | list[MemorySide],
                 vocab_size: int | None = None, faults=None):
        self.memory = memory if isinstance(memory, list) else [memory]
        self.compute = ComputeSide(split, len(self.memory))
        self.compute.vocab_size, self.compute.faults = vocab_size, faults
        self.compute.pool_slots = min(m.pool.config.num_slots for m in self.memory)
        for m in self.memory:
            m.faults = faults
        self.params = self.compute.params
        self.link = _LocalLink(self.memory, self.params)

    def execute(self, plan: StepPlan) -> StepResult:
        return self.compute.run(plan, self.link)
