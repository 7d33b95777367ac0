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

On a GPU (`device`): the slices run there; q/k/v reach memory workers that read host
memory through pinned buffers on a copy stream and the outputs come back the same way
(`compute/device.py`); memory workers on the same GPU take them as they are. Decode
steps of up to `graph_tokens` tokens replay each slice as a CUDA graph
(`compute/graphs.py`).

Rotational pipelining over several replicas runs either on threads of this one
`ComputeSide` (`use_replicas`, the local executor) or, after `join_ring`, as one process
of a ring of compute workers (`compute/ring.py`): this side then runs only its own
slices of each micro-batch, takes each one's context from the previous replica and
hands it to the next, and samples the micro-batches whose last slice ran here.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from lamina.compute.device import HostStaging, check_device
from lamina.compute.graphs import SliceGraphs
from lamina.compute.memory_link import MemoryLink
from lamina.compute.packing import PackedBatch, PromptRows, by_worker, pack, split_micro
from lamina.compute.ring import Context, Ring
from lamina.engine.messages import SeqWork, StepPlan, StepResult
from lamina.errors import SequenceFault
from lamina.kernels.slots import GrowingSlots
from lamina.memory.memory_side import MemorySide, attention_params
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.sampling.sampler import prompt_logprobs, row_logprobs, sample_rows
from lamina.splitter.split import SplitModel
from lamina.trace import Tracer


class ComputeSide:
    """Runs the slices over one or more micro-batches; the memory side is a `MemoryLink`."""

    def __init__(self, split: SplitModel, num_workers: int, local_kv_dtype: str | None = None,
                 device: str = "cpu", graph_tokens: int = 0):
        self.split, self.num_workers = split, num_workers
        # the slices' device (`move_split` put them there); host memory workers' q/k/v
        # go through `staging` when it is a GPU
        self.device = check_device(device)
        self.staging = HostStaging(self.device) if self.device.type == "cuda" else None
        # decode steps of <= graph_tokens tokens replay captured slices (0: never); on a
        # CPU the same bookkeeping runs eagerly (tests)
        self.graphs = (SliceGraphs(split.slices, self.device, graph_tokens,
                                   emulate=self.device.type != "cuda")
                       if graph_tokens else None)
        self.tables = SlotTables()  # each running sequence's KV slots (plans send diffs)
        # wait for the GPU after each slice so dense_s is its run time, not its launch
        # (always so where q/k/v go to host memory: the copy waits for it anyway)
        self.sync_timers = False
        self.params = [attention_params(s) for s in split.attention_specs]
        # Set: prompts whose whole context is in the step attend here (paper 5.6), over a
        # scratch pool of this KV dtype (the memory workers' own, so the same rounding);
        # the memory workers only store their k/v.
        self.local_kv_dtype = local_kv_dtype
        self.local_key_scales = None  # an int8 scratch pool's key channel scales [L, Hkv, D]
        self._scratch: MemorySide | None = None
        # What a sequence's new data is checked against before anything runs (None: not
        # known here); a bad sequence fails alone (`SequenceFault`), not the step.
        self.vocab_size: int | None = None
        self.pool_slots: int | None = None  # each memory worker's pool
        self.faults = None  # a lamina.faults.FaultPlan (tests) or None
        self.tracer = Tracer("compute0")  # this replica's timeline (`lamina.trace`), off
        # rotational pipelining over several replicas (`use_replicas`): each replica's
        # lane, and the threads that run them
        self.lanes: list[Tracer] = [self.tracer]
        self._threads: ThreadPoolExecutor | None = None
        # rotational pipelining over compute worker processes (`lamina.compute.ring`):
        # this process's place in the ring; it runs its own slices of every step
        self.ring: Ring | None = None

    def use_replicas(self, lanes: list[Tracer]) -> None:
        """Rotational staggered pipelining (paper 5.1) over len(lanes) model replicas:
        threads of this process over the same slices (weights are read-only; torch ops
        release the GIL, so the replicas' slices run at once), each recording on its own
        lane. Slice k of micro-batch j runs on replica (j + k) mod R; the micro-batch's
        context moves to it from the replica that ran slice k - 1 (`_migrate`)."""
        if self.graphs is not None and len(lanes) > 1:
            raise ValueError("CUDA graphs replay on one replica: run several replicas with "
                             "cuda_graphs=False")
        self.lanes, self.tracer = list(lanes), lanes[0]
        self._threads = (ThreadPoolExecutor(len(lanes), "lamina-replica")
                         if len(lanes) > 1 else None)

    def join_ring(self, ring: Ring | None) -> None:
        """Run as one process of a ring of compute workers (`compute/ring.py`), or alone
        again (None)."""
        if ring is not None and self.graphs is not None:
            raise ValueError("CUDA graphs replay on one replica: a ring runs without them")
        if self.ring is not None and self.ring is not ring:
            self.ring.link.close()
        self.ring = ring

    def reset(self) -> None:
        """Forget every sequence's slot table (the engine recovered the workers: each
        sequence's next plan sends its whole table)."""
        self.tables = SlotTables()

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
        toks, new = s.token_ids, s.slots[s.start_pos - s.slots_from:]
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
        if self.local_kv_dtype is None:
            raise RuntimeError("local prefill is off (local_kv_dtype None): no scratch pool")
        if self._scratch is None or self._scratch.pool.config.num_slots < tokens:
            cfg = KVPoolConfig.for_specs(self.split.attention_specs, max(tokens, 256),
                                         self.local_kv_dtype, str(self.device),
                                         self.local_key_scales)
            self._scratch = MemorySide(KVPool(cfg))
        return self._scratch

    @torch.no_grad()
    def run(self, plan: StepPlan, link: MemoryLink) -> StepResult:
        """One step: check, pack, the slices layer by layer with attention on the memory
        side in between, then sampling."""
        for lane in self.lanes:
            lane.step = plan.step
        self.tables.apply(plan)
        self.check(plan)
        groups, mbs = self._pack(plan)
        local_slots = sum(m.packed.local_slots for m in mbs)
        scratch = self._local_side(local_slots) if local_slots else None
        link.begin(plan.step, [m.packed.parts for m in mbs], plan.released,
                   plan.tier_orders, {s.seq_id: s.params.kv_override for s in plan.seqs
                                      if s.params.kv_override is not None},
                   plan.report_dropped)
        timers = StepTimers()
        # One micro-batch with no prompts attending here: nothing runs between a layer's
        # submit and collect, so the link may do both in one call (`exchange`).
        at_once = len(mbs) == 1 and mbs[0].packed.local is None and self.ring is None
        self._place(mbs, at_once)
        cuda = self.device.type == "cuda"
        host = cuda and link.device.type == "cpu"
        # Slice i of micro-batch j: wait for its layer i-1 attention, run the slice,
        # submit. The memory side attends micro-batch j while this thread runs j+1's
        # slice (and this step's own prompts' attention). Several replicas: `_rotate`.
        shared = _Layer(link, scratch, at_once, timers, self.tracer, host,
                        cuda and (host or self.sync_timers))
        here: Sequence[int] = range(len(mbs))  # the micro-batches sampled here
        if self.ring is not None:
            here = self._ring_run(plan.step, mbs, shared)
        elif self._threads is None:
            for i in range(len(self.params) + 1):
                for j, mb in enumerate(mbs):
                    self._slice(i, j, mb, shared)
        else:
            timers = self._rotate(mbs, shared)
        dropped = link.dropped() if plan.report_dropped else ()
        t = time.perf_counter()
        works = [s for j in here for s in groups[j] if s.sample]
        tokens, lps, plps = (self._sample(works, [mbs[j] for j in here]) if works
                             else ([], None, None))
        timers.sample_s = time.perf_counter() - t
        self.tracer.record("sample", -1, t, t + timers.sample_s, mb=0)
        return replace(_in_plan_order(plan, works, tokens, lps, plps,
                                      timers.report(len(mbs))), dropped=dropped)

    def _rotate(self, mbs: list[_MicroBatch], step: _Layer) -> StepTimers:
        """Every slice of every micro-batch on its replica's thread (slice k of j on
        replica (j + k) mod R), each replica taking its slices in the paper's order
        (k, then j); a slice waits for its micro-batch's previous one. -> the step's
        timers (each the largest replica's: they ran at once). A failure on one replica
        stops the others and is raised here."""
        assert self._threads is not None
        r_n, order = len(self.lanes), _Order(len(mbs))
        tasks: list[list[tuple[int, int]]] = [[] for _ in range(r_n)]
        for i in range(len(self.params) + 1):
            for j in range(len(mbs)):
                tasks[(i + j) % r_n].append((i, j))
        steps = [replace(step, timers=StepTimers(), tracer=lane) for lane in self.lanes]
        futures = [self._threads.submit(self._replica, r, tasks[r], mbs, steps[r], order)
                   for r in range(r_n)]
        for f in futures:
            f.result()
        if order.error is not None:
            raise order.error
        return StepTimers.largest([s.timers for s in steps])

    @torch.no_grad()  # grad mode is per thread: `run`'s does not reach here
    def _replica(self, r: int, tasks: list[tuple[int, int]], mbs: list[_MicroBatch],
                 step: _Layer, order: _Order) -> None:
        """Replica r's slices of a step, in order (`_rotate`)."""
        try:
            for i, j in tasks:
                if not order.wait(i, j):
                    return  # another replica failed
                self._migrate(r, i, j, mbs[j], step)
                self._slice(i, j, mbs[j], step)
                order.done(j)
        except BaseException as e:  # noqa: BLE001 - raised by `_rotate`, on the step's thread
            order.fail(e)

    def _migrate(self, r: int, i: int, j: int, mb: _MicroBatch, step: _Layer) -> None:
        """Micro-batch j's context (the splitter's per-cut tensors after slice i - 1)
        to replica r, where slice i runs. The replicas here are threads sharing one
        device, so it moves by reference: the span records what a replica on a device of
        its own would receive (its bytes), from whom (`peer`)."""
        src = (i - 1 + j) % len(self.lanes)
        if i == 0 or src == r or not mb.out:
            return
        t = time.perf_counter()
        ctx = mb.out[3:]
        step.tracer.record("migrate", i, t, mb=j, peer=self.lanes[src].lane,
                           nbytes=sum(c.nbytes for c in ctx if isinstance(c, torch.Tensor)))

    def _ring_run(self, step_no: int, mbs: list[_MicroBatch], step: _Layer) -> list[int]:
        """This replica's slices of a step in a ring of compute processes
        (`lamina.compute.ring`): each one's context comes from the previous replica,
        its attention output from the memory workers, and its own context goes on to
        the next replica. -> the micro-batches whose last slice (and sampling) ran here."""
        ring, last = self.ring, len(self.params)
        assert ring is not None
        for k, j in ring.tasks(last + 1, len(mbs)):
            mb = mbs[j]
            if k > 0:
                t = time.perf_counter()
                ctx = ring.link.recv(step_no, k - 1, j)
                mb.moved, mb.out, mb.own = ctx, (None, None, None, *ctx.tensors), ctx.own
                step.tracer.record("migrate", k, t, mb=j,
                                   peer=f"compute{ring.replica(k - 1, j)}", nbytes=ctx.nbytes)
            self._slice(k, j, mb, step)
            mb.moved = None
            if k < last:  # to the replica running slice k + 1, while the workers attend
                ring.link.send(step_no, Context(k, j, mb.attn_shape(), mb.out[0].dtype,
                                                tuple(mb.out[3:]), mb.own))
        return [j for j in range(len(mbs)) if ring.samples(last + 1, j)]

    def _pack(self, plan: StepPlan) -> tuple[list[tuple], list[_MicroBatch]]:
        """The plan cut into micro-batches, each packed (rows grouped by worker)."""
        groups = [by_worker(g) for g in split_micro(plan.seqs, plan.micro_batches)]
        local, mbs, base = self.local_kv_dtype is not None, [], 0
        for g in groups:  # micro-batches' local tokens take disjoint scratch slots
            mbs.append(_MicroBatch(pack(StepPlan(plan.step, g), self.num_workers, local,
                                        base, self.tables)))
            base += mbs[-1].packed.local_slots
        if any(m.packed.merge for m in mbs) and any(p.sinks is not None for p in self.params):
            raise ValueError("a sequence's KV is split over memory workers, but this model's "
                             "attention has sinks: run with split_kv=False")
        return groups, mbs

    def _place(self, mbs: list[_MicroBatch], at_once: bool) -> None:
        """Each micro-batch's ids/positions on the compute device; a one-micro-batch
        decode step (every row sampled, none attending here) of a captured size runs
        on the graphs."""
        for mb in mbs:
            p = mb.packed
            # a graphed step's ids go straight into its bucket's buffers (one copy)
            mb.graphed = (self.graphs is not None and at_once
                          and len(p.logit_rows) == p.input_ids.shape[1]
                          and self.graphs.begin(p.input_ids, p.positions))
            mb.ids, mb.pos = p.input_ids, p.positions
            if self.device.type != "cpu" and not mb.graphed:
                mb.ids = p.input_ids.to(self.device, non_blocking=True)
                mb.pos = p.positions.to(self.device, non_blocking=True)

    def _slice(self, i: int, j: int, mb: _MicroBatch, step: _Layer) -> None:
        """Slice i of micro-batch j: its input (layer i-1's attention output, collected),
        the slice, and its q/k/v handed to the memory side."""
        n_layers, p = len(self.params), mb.packed
        o = None if i == 0 else self._collect(i - 1, j, mb, step)  # [N, Hq, Dv]
        if i == n_layers and not p.logit_rows:
            mb.out = ()  # nothing to sample in this micro-batch
            return
        if self.faults is not None:
            self.faults.check_layer(i, p.input_ids[0].tolist())
        t = time.perf_counter()
        mb.out = self._run_slice(i, mb, o)
        if step.sync:
            torch.cuda.current_stream(self.device).synchronize()
        t1 = time.perf_counter()
        step.timers.dense_s += t1 - t
        step.tracer.record("slice", i, t, t1, mb=j)
        if i < n_layers:
            self._submit(i, j, mb, step)

    def _run_slice(self, i: int, mb: _MicroBatch, o: torch.Tensor | None) -> tuple:
        if mb.graphed:
            assert self.graphs is not None
            return self.graphs.run(i, o)
        if i == 0:
            return self.split.slices[0](mb.ids, mb.pos)
        assert o is not None
        args = (mb.pos, o[None], *mb.out[3:])  # attn_out [1, N, Hq, Dv]
        if i == len(self.params):
            args = _select_rows(args, mb.packed.logit_rows)
        return self.split.slices[i](*args)

    def _collect(self, layer: int, j: int, mb: _MicroBatch, step: _Layer) -> torch.Tensor:
        """Micro-batch j's attention output of `layer`: o [N, Hq, Dv], packed row order."""
        if mb.ready is not None:  # `exchange` already brought it
            o, mb.ready = mb.ready, None
            return self._to_device(o, j, step)
        t = time.perf_counter()
        dtype = mb.moved.dtype if mb.moved is not None else mb.out[0].dtype
        o = step.link.collect(layer, j, mb.packed.parts, mb.attn_shape(), dtype,
                              mb.packed.merge)
        t1 = time.perf_counter()
        step.timers.wait_s += t1 - t
        step.tracer.record("wait", layer, t, t1, mb=j)
        o = self._to_device(o, j, step)
        if mb.packed.local is not None and mb.own is not None:  # prompts attended here
            o.index_copy_(0, mb.packed.local.rows.to(o.device), mb.own.to(o.dtype))
        return o

    def _to_device(self, o: torch.Tensor, j: int, step: _Layer) -> torch.Tensor:
        """A host attention output onto the compute GPU (pinned, copy stream)."""
        if not step.host:
            return o
        assert self.staging is not None
        t = time.perf_counter()
        o = self.staging.to_device(("o", j), o)
        step.timers.transfer_s += time.perf_counter() - t
        return o

    def _submit(self, layer: int, j: int, mb: _MicroBatch, step: _Layer) -> None:
        """Hand micro-batch j's q/k/v of `layer` to the memory side (and attend its local
        prompts here meanwhile); one call for both ways when `step.at_once`."""
        q, k, v = mb.out[0], mb.out[1], mb.out[2]
        p, timers = mb.packed, step.timers
        qkv = (q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1))
        # [1, H, N, D] -> [N, H, D]
        dev_qkv = qkv
        if step.host:  # to pinned host buffers, read by the link before the next layer
            assert self.staging is not None
            t = time.perf_counter()
            hq, hk, hv = self.staging.to_host(("qkv", j), qkv)
            qkv = (hq, hk, hv)
            timers.transfer_s += time.perf_counter() - t
        t = time.perf_counter()
        if step.at_once:
            r = step.link.exchange(layer, j, *qkv, p.parts, mb.attn_shape(), q.dtype, p.merge)
            if r is not None:
                mb.ready, sent = r
                t1 = time.perf_counter()
                timers.exchanges += 1
                timers.submit_s += sent
                timers.wait_s += t1 - t - sent
                # one call both ways: its sending, then its wait, as two spans
                step.tracer.record("submit", layer, t, t + sent, mb=j)
                step.tracer.record("wait", layer, t + sent, t1, mb=j)
                return
        step.link.submit(layer, j, *qkv, p.parts)
        t1 = time.perf_counter()
        timers.submit_s += t1 - t
        step.tracer.record("submit", layer, t, t1, mb=j)
        if p.local is not None and step.scratch is not None:  # while the workers attend
            t = time.perf_counter()
            mb.own = step.scratch.attend(layer, self.params[layer], *p.local.take(*dev_qkv),
                                         p.local.new_slots, p.local.batch)[0]
            t1 = time.perf_counter()
            timers.local_s += t1 - t
            step.tracer.record("attend", layer, t, t1, mb=j)

    def _sample(self, works: list[SeqWork], mbs: list[_MicroBatch]):
        """-> (tokens, logprobs or None, prompt logprobs or None), one per sequence of
        `works` (the sampled sequences, in pack order)."""
        rows, sample, prompt, at, k = [], [], [], 0, 0
        for mb in mbs:
            if not mb.out:
                continue
            p, logits = mb.packed, mb.out[0]  # [1, R or N, V]
            # picked here if the last slice ran on every token
            rows.append(logits[0] if logits.shape[1] == len(p.logit_rows)
                        else logits[0, list(p.logit_rows)])
            sample += [at + r + t for r, w in zip(p.sample, works[k:k + len(p.sample)])
                       for t in range(w.draft + 1)]  # a draft's rows follow its first
            prompt += [PromptRows(k + x.sample, at + x.row, x.count) for x in p.prompt]
            at, k = at + len(p.logit_rows), k + len(p.sample)
        # the model's dtype (sample_rows casts what it must); one part: no copy
        all_ = rows[0] if len(rows) == 1 else torch.cat(rows)  # [R, V]
        tokens, lps = _draw(all_ if len(sample) == len(all_) else all_[sample], works)
        if not prompt:
            return tokens, lps, None
        plps: list[tuple | None] = [None] * len(works)
        for x in prompt:
            s = works[x.sample]
            top = s.params.prompt_logprobs
            assert top is not None  # packed as a prompt row only when asked for
            plps[x.sample] = prompt_logprobs(all_[x.row:x.row + x.count],
                                             list(s.token_ids[1:x.count + 1]), top)
        return tokens, lps, tuple(plps)


class SlotTables:
    """The compute side's copy of each running sequence's KV slot table, kept from step
    to step so that plans carry only what changed (`SeqWork.slots_from`); packing reads
    the whole tables from here (`table`, int32 views: no per-position Python objects).

    Applying a plan is idempotent (a step re-run after a clean `SequenceFault` applies
    the same plan again): a sequence's table is cut at `slots_from` and extended."""

    def __init__(self) -> None:
        self._t: dict[int, GrowingSlots] = {}
        self._evicted: dict[int, tuple[int, int]] = {}  # seq -> its evicted positions
        self._holed: set[int] = set()  # seqs whose tables have holes (-1)
        # seq -> the first position whose hole status changed with the last plan (the
        # memory workers' copies of its key list then differ from there on)
        self._changed: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._t)

    def table(self, seq_id: int) -> np.ndarray:
        """seq's whole table [L] int32 (a view, valid until its next plan is applied);
        -1 at positions whose slots were given back."""
        return self._t[seq_id].view()

    def holes(self, seq_id: int) -> bool:
        """Whether seq's table has holes (positions whose slots were given back)."""
        return seq_id in self._holed

    def changed_from(self, seq_id: int) -> int | None:
        """The first position that became a hole with the last plan applied; None."""
        return self._changed.get(seq_id)

    def apply(self, plan: StepPlan) -> None:
        self._changed = {}
        for sid in plan.released:
            self._t.pop(sid, None)
            self._evicted.pop(sid, None)
            self._holed.discard(sid)
        for s in plan.seqs:
            t = self._t.get(s.seq_id)
            if s.slots_from == 0:
                t = self._t[s.seq_id] = GrowingSlots()
                self._holed.discard(s.seq_id)
            elif t is None or t.n < s.slots_from:
                have = "none" if t is None else f"{t.n} positions"
                raise RuntimeError(f"seq {s.seq_id}: the plan sends its KV slots from position "
                                   f"{s.slots_from}, but the compute side holds {have} of its "
                                   f"table (engine and executor out of step)")
            t.cut_and_extend(s.slots_from, np.asarray(s.slots, dtype=np.int32))
            self._holes(s, t.view())

    def _holes(self, s: SeqWork, table: np.ndarray) -> None:
        """The plan's holes into seq's table: its evicted range (where it moved) and its
        newly dropped positions; a whole table sent may carry holes of its own."""
        sid, first = s.seq_id, None
        lo, hi = s.evicted
        was = self._evicted.get(sid, (0, 0))
        if was != s.evicted:
            self._evicted[sid] = s.evicted
            table[lo:hi] = -1
            first = was[1] if was[0] == lo and was[1] > was[0] else lo
        if s.dropped:
            table[list(s.dropped)] = -1
            first = min(s.dropped) if first is None else min(first, min(s.dropped))
        if first is not None:
            self._changed[sid] = first
            self._holed.add(sid)
        elif s.slots_from == 0 and (table < 0).any():
            self._holed.add(sid)


@dataclass
class StepTimers:
    """Where a step's time went, in seconds (`StepResult.timings`)."""

    dense_s: float = 0.0  # the slices
    submit_s: float = 0.0  # handing q/k/v to the memory side
    wait_s: float = 0.0  # waiting for its outputs
    local_s: float = 0.0  # local prompts' attention on this side
    transfer_s: float = 0.0  # GPU <-> pinned host copies of q/k/v and o
    sample_s: float = 0.0
    exchanges: int = 0  # layers sent and collected in one `exchange` call

    @staticmethod
    def largest(timers: list[StepTimers]) -> StepTimers:
        """Replicas that ran at once as one: each time the largest; exchanges summed."""
        out = StepTimers()
        for f in fields(StepTimers):
            vals = [getattr(t, f.name) for t in timers]
            setattr(out, f.name, sum(vals) if f.name == "exchanges" else max(vals))
        return out

    def report(self, micro_batches: int) -> dict:
        return {"dense_s": self.dense_s, "submit_s": self.submit_s, "wait_s": self.wait_s,
                "attention_s": self.submit_s + self.wait_s + self.local_s,
                "local_s": self.local_s, "transfer_s": self.transfer_s,
                "sample_s": self.sample_s,
                "micro_batches": micro_batches, "exchanges": self.exchanges}


@dataclass
class _MicroBatch:
    """One micro-batch's state through a step's layers."""

    packed: PackedBatch
    out: tuple = ()  # the last slice's outputs: (q, k, v, *context) or (logits,); ()
    own: torch.Tensor | None = None  # its local part's o of the layer in flight
    ready: torch.Tensor | None = None  # o of the layer in flight, brought by `exchange`
    ids: torch.Tensor | None = None  # packed.input_ids on the compute device
    pos: torch.Tensor | None = None  # packed.positions on the compute device
    graphed: bool = False  # its slices replay the graphs' current bucket
    moved: Context | None = None  # its context, come from the replica of its last slice

    def attn_shape(self) -> tuple[int, int, int]:
        """(N, Hq, Dv) of the layer in flight's attention output."""
        if self.moved is not None:
            return self.moved.attn_shape
        q, v = self.out[0], self.out[2]  # [1, Hq, N, D], [1, Hkv, N, Dv]
        return (q.shape[2], q.shape[1], v.shape[-1])


@dataclass(frozen=True)
class _Layer:
    """What every slice of a step shares."""

    link: MemoryLink
    scratch: MemorySide | None  # the local prompts' pool (None: none this step)
    at_once: bool  # `exchange` may submit and collect in one call
    timers: StepTimers
    tracer: Tracer  # the lane of the replica running the slice
    host: bool = False  # q/k/v and o cross between the GPU and host memory (staging)
    sync: bool = False  # wait for the GPU after each slice


class _Order:
    """A rotational step's progress: how many slices each micro-batch finished, and the
    first failure (which stops every replica)."""

    def __init__(self, micro_batches: int):
        self.finished = [0] * micro_batches
        self.error: BaseException | None = None
        self._cv = threading.Condition()

    def wait(self, i: int, j: int) -> bool:
        """Until micro-batch j has finished slice i - 1: True; False if a replica failed."""
        with self._cv:
            self._cv.wait_for(lambda: self.finished[j] >= i or self.error is not None)
            return self.error is None

    def done(self, j: int) -> None:
        with self._cv:
            self.finished[j] += 1
            self._cv.notify_all()

    def fail(self, e: BaseException) -> None:
        with self._cv:
            if self.error is None:
                self.error = e
            self._cv.notify_all()


def _in_plan_order(plan: StepPlan, works: list[SeqWork], tokens: list, lps, plps,
                   timings: dict) -> StepResult:
    """The step's result with its sequences back in plan order (rows were grouped by
    worker)."""
    if works:
        rank = {s.seq_id: i for i, s in enumerate(s for s in plan.seqs if s.sample)}
        order = sorted(range(len(works)), key=lambda i: rank[works[i].seq_id])
        works, tokens = [works[i] for i in order], [tokens[i] for i in order]
        lps = lps if lps is None else tuple(lps[i] for i in order)
        plps = plps if plps is None else tuple(plps[i] for i in order)
    return StepResult(plan.step, tuple(s.seq_id for s in works), tuple(tokens), timings,
                      lps, plps)


def _draw(logits: torch.Tensor, works: list[SeqWork]):
    """logits [S, V], a row per sequence of `works` (draft + 1 rows for one with a
    draft) -> (tokens per sequence, logprobs per sequence or None). A failure is put on
    the sequences that fail alone (`SequenceFault`, clean: every worker finished the
    step)."""
    try:
        return _draw_rows(logits, works)
    except Exception as e:  # find the sequences it belongs to
        bad, why, at = [], f"{type(e).__name__}: {e}", 0
        for s in works:
            try:
                _draw_rows(logits[at:at + s.draft + 1], [s])
            except Exception as e1:  # noqa: BLE001
                bad.append(s.seq_id)
                why = f"{type(e1).__name__}: {e1}"
            at += s.draft + 1
        if not bad:
            raise
        raise SequenceFault(bad, f"sampling failed: {why}") from e


def _draw_rows(logits: torch.Tensor, works: list[SeqWork]):
    """`_draw` without the isolation. A drafted sequence's row t draws the token at its
    position next_pos - draft + t, with the guessed tokens before it in its history;
    it keeps the draws up to the first that differs from its guess."""
    rows = [(s, t) for s in works for t in range(s.draft + 1)]
    params = [s.params for s, _ in rows]
    toks = sample_rows(logits, params, [s.seeds for s, _ in rows],
                       [s.next_pos - s.draft + t for s, t in rows],
                       [(s.history + s.guess[:t], s.prompt_len) for s, t in rows],
                       [_row_mask(s, t) for s, t in rows])
    lps = (row_logprobs(logits, params, toks) if any(p.logprobs is not None for p in params)
           else None)
    out_t: list[tuple[int, ...]] = []
    out_lp: list = []
    at = 0
    for s in works:
        n = 1
        while n <= s.draft and toks[at + n - 1][0] == s.guess[n - 1]:
            n += 1  # the draw after guessed token n - 1 matched it: row n holds
        out_t.append(toks[at] if not s.draft else tuple(t[0] for t in toks[at:at + n]))
        if lps is not None:
            mine = lps[at:at + n]
            out_lp.append(mine[0] if not s.draft or mine[0] is None
                          else tuple(x[0] for x in mine if x is not None))
        at += s.draft + 1
    return out_t, (tuple(out_lp) if lps is not None else None)


def _row_mask(s: SeqWork, t: int) -> bytes:
    """Draw t's bitmask of a sequence (its only one without a draft; b"": none)."""
    if not s.draft or not s.allowed:
        return s.allowed
    n = len(s.allowed) // (s.draft + 1)
    return s.allowed[t * n:(t + 1) * n]


def _select_rows(args: tuple, rows: Sequence[int]) -> tuple:
    """The last slice's inputs at the sampled rows only. Every op outside attention is
    per token, so each input is [1, N, ...] over the packed tokens."""
    n = args[0].shape[1]
    if len(rows) == n:
        return args
    if any(a.dim() < 2 or a.shape[0] != 1 or a.shape[1] != n for a in args):
        return args  # not token-major: run it whole (still correct, just slower)
    idx = torch.tensor(rows, dtype=torch.long, device=args[0].device)
    return tuple(a.index_select(1, idx) for a in args)
