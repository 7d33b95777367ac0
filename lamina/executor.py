"""Executors run a `StepPlan` through the model slices and the memory side.

Data in: `StepPlan` (tokens, positions, per-worker slot tables) from the engine.
Data out: `StepResult` (next-token logits of sampling sequences).

All sequences' new tokens are packed into one [1, N] row: every op outside attention is
per token, so the slices need no padding, and prefill and decode mix freely in one step.
For each attention layer the packed q/k/v rows are split by memory worker (requests are
partitioned across workers), each worker writes its rows' k/v into its pool and attends
over its sequences' slots, and the outputs are put back in row order.
`LocalExecutor` holds its memory sides in this process; `lamina.cluster` runs the same
`ComputeSide` in a Ray actor that talks to memory-worker processes over the data plane.
"""
from __future__ import annotations

import importlib
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from lamina.kernels import AttentionParams, SlotBatch, prefill_attention, select_backend
from lamina.splitter.split import SplitModel

from .kv_pool import KVPool
from .messages import StepPlan, StepResult


class Executor(ABC):
    @abstractmethod
    def execute(self, plan: StepPlan) -> StepResult: ...

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

    rows: torch.Tensor  # [n] int64: its rows in the packed token order
    new_slots: torch.Tensor  # [n] int32: where those rows' k/v go in its pool
    batch: SlotBatch  # its sequences' slot tables and query positions


def pack(plan: StepPlan, num_workers: int):
    """-> input_ids [1, N], position_ids [1, N], sample rows, [WorkerPart per worker]."""
    ids, pos, rows = [], [], []
    per = [([], [], [], []) for _ in range(num_workers)]  # rows, new slots, tables, n_new
    for s in plan.seqs:
        if not 0 <= s.worker < num_workers:
            raise ValueError(f"seq {s.seq_id} placed on memory worker {s.worker} of "
                             f"{num_workers}")
        n, r0 = len(s.token_ids), len(ids)
        ids += s.token_ids
        pos += range(s.start_pos, s.start_pos + n)
        if s.sample:
            rows.append(r0 + n - 1)
        p = per[s.worker]
        p[0].extend(range(r0, r0 + n))
        p[1].extend(s.slots[s.start_pos:])
        p[2].append(s.slots)
        p[3].append(n)
    parts = [WorkerPart(torch.tensor(r, dtype=torch.int64), torch.tensor(ns, dtype=torch.int32),
                        SlotBatch.build(t, nn)) for r, ns, t, nn in per]
    return torch.tensor([ids]), torch.tensor([pos]), rows, parts


class MemorySide:
    """One memory worker's state: a KV pool and an attention backend."""

    def __init__(self, pool: KVPool, backend=None):
        self.pool = pool
        self.backend = backend or select_backend(device=pool.config.device)

    def attend(self, layer: int, params: AttentionParams, q, k, v, new_slots, batch):
        """q [n, Hq, D], k/v [n, Hkv, D] -> o [n, Hq, Dv] (writes k/v at new_slots first)."""
        kp, vp = self.pool.layer(layer)
        o, _ = prefill_attention(q, k, v, kp, vp, new_slots, batch, params, self.backend)
        return o


class ComputeSide:
    """Runs the slices; `attend(layer, q, k, v, parts)` is the memory side's job."""

    def __init__(self, split: SplitModel, num_workers: int):
        self.split, self.num_workers = split, num_workers
        self.params = [attention_params(s) for s in split.attention_specs]

    @torch.no_grad()
    def run(self, plan: StepPlan, attend) -> StepResult:
        ids, pos, rows, parts = pack(plan, self.num_workers)
        t_dense = t_attn = 0.0
        t = time.perf_counter()
        out = self.split.slices[0](ids, pos)
        t_dense += time.perf_counter() - t
        for i in range(len(self.params)):
            q, k, v, ctx = out[0], out[1], out[2], out[3:]
            t = time.perf_counter()
            # [1, H, N, D] -> [N, H, D]
            o = attend(i, q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                       parts)
            t_attn += time.perf_counter() - t
            t = time.perf_counter()
            out = self.split.slices[i + 1](pos, o[None], *ctx)  # attn_out [1, N, Hq, Dv]
            t_dense += time.perf_counter() - t
        logits = out[0][0, rows].float()  # [R, V]
        return StepResult(plan.step, tuple(s.seq_id for s in plan.seqs if s.sample), logits,
                          {"dense_s": t_dense, "attention_s": t_attn})


class LocalExecutor(Executor):
    def __init__(self, split: SplitModel, memory: MemorySide | list[MemorySide]):
        self.memory = memory if isinstance(memory, list) else [memory]
        self.compute = ComputeSide(split, len(self.memory))
        self.params = self.compute.params

    def _attend(self, layer, q, k, v, parts):
        o = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        for mem, p in zip(self.memory, parts):
            if p.rows.numel():
                o[p.rows] = mem.attend(layer, self.params[layer], q[p.rows], k[p.rows],
                                       v[p.rows], p.new_slots, p.batch)
        return o

    def execute(self, plan: StepPlan) -> StepResult:
        return self.compute.run(plan, self._attend)
