"""The compute side's step: a `StepPlan` through the model slices and the memory link.

Data in: `StepPlan` (tokens, positions, per-worker slot tables) from the engine, and a
`MemoryLink` to the memory workers.
Data out: `StepResult` (the tokens drawn for the sampling sequences; the sampler runs
here, so only token ids go back to the engine).

For each attention layer the packed q/k/v rows are split by memory worker, each worker
writes its rows' k/v into its pool and attends over its sequences' slots, and the
outputs come back in row order. With `plan.micro_batches = 2` the step runs as two
sub-batches in a staggered pipeline (paper 5.1, the n = 2 case on one replica): slice i
of one overlaps the other's attention. The last slice (last layer's o_proj and MLP,
final norm, lm_head) runs on the sampled rows only. With `local_kv_dtype` set (the Ray
compute worker; paper 5.6), fresh prompts attend here over a scratch pool and their
workers only store their k/v.
"""
from __future__ import annotations

import time

import torch

from lamina.compute.memory_link import MemoryLink
from lamina.compute.packing import by_worker, pack, split_micro
from lamina.engine.messages import SeqWork, StepPlan, StepResult
from lamina.errors import SequenceFault
from lamina.memory.memory_side import MemorySide, attention_params
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.sampling.sampler import prompt_logprobs, row_logprobs, sample_rows
from lamina.splitter.split import SplitModel


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
