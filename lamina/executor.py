"""Executors run a `StepPlan` through the model slices and the memory side.

Data in: `StepPlan` (tokens, positions, slot tables) from the engine. Data out:
`StepResult` (next-token logits of sampling sequences).

All sequences' new tokens are packed into one [1, N] row: every op outside attention is
per token, so the slices need no padding, and prefill and decode mix freely in one step.
Attention runs on the memory side over each sequence's slot table (`lamina.kernels`).
`LocalExecutor` does it all in this process; the Ray executor (lamina.cluster) runs the
same step with compute and memory workers in separate processes.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod

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


def attention_params(spec) -> AttentionParams:
    return AttentionParams(spec.scale, spec.sliding_window or -1, spec.softcap or 0.0,
                           spec.sinks)


def pack(plan: StepPlan):
    """-> input_ids [1, N], position_ids [1, N], new-token slots [N], SlotBatch, sample rows."""
    ids, pos, new_slots, rows = [], [], [], []
    for s in plan.seqs:
        n = len(s.token_ids)
        ids += s.token_ids
        pos += range(s.start_pos, s.start_pos + n)
        new_slots += s.slots[s.start_pos:]
        if s.sample:
            rows.append(len(ids) - 1)
    batch = SlotBatch.build([s.slots for s in plan.seqs], [len(s.token_ids) for s in plan.seqs])
    return (torch.tensor([ids]), torch.tensor([pos]), torch.tensor(new_slots, dtype=torch.int32),
            batch, rows)


class MemorySide:
    """One memory worker's state: a KV pool and an attention backend."""

    def __init__(self, pool: KVPool, backend=None):
        self.pool = pool
        self.backend = backend or select_backend(device=pool.config.device)

    def attend(self, layer: int, params: AttentionParams, q, k, v, new_slots, batch):
        """q [N, Hq, D], k/v [N, Hkv, D] -> o [N, Hq, Dv] (writes k/v at new_slots first)."""
        kp, vp = self.pool.layer(layer)
        o, _ = prefill_attention(q, k, v, kp, vp, new_slots, batch, params, self.backend)
        return o


class LocalExecutor(Executor):
    def __init__(self, split: SplitModel, memory: MemorySide):
        self.split, self.memory = split, memory
        self.params = [attention_params(s) for s in split.attention_specs]

    @torch.no_grad()
    def execute(self, plan: StepPlan) -> StepResult:
        ids, pos, new_slots, batch, rows = pack(plan)
        t_dense = t_attn = 0.0
        t = time.perf_counter()
        out = self.split.slices[0](ids, pos)
        t_dense += time.perf_counter() - t
        for i, params in enumerate(self.params):
            q, k, v, ctx = out[0], out[1], out[2], out[3:]
            t = time.perf_counter()
            # [1, H, N, D] -> [N, H, D]
            o = self.memory.attend(i, params, q[0].transpose(0, 1), k[0].transpose(0, 1),
                                   v[0].transpose(0, 1), new_slots, batch)
            t_attn += time.perf_counter() - t
            t = time.perf_counter()
            out = self.split.slices[i + 1](pos, o[None], *ctx)  # attn_out [1, N, Hq, Dv]
            t_dense += time.perf_counter() - t
        logits = out[0][0, rows].float()  # [R, V]
        return StepResult(plan.step, tuple(s.seq_id for s in plan.seqs if s.sample), logits,
                          {"dense_s": t_dense, "attention_s": t_attn})
