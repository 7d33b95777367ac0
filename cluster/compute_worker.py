"""Compute worker: a Ray actor holding the model slices; it runs every step's dense part
and exchanges each layer's q/k/v and attention output with the memory workers over the
data plane (`lamina.wire` frames), not through Ray.

Data in: a `StepPlan` per step (one Ray call). Data out: the `StepResult`.
"""
from __future__ import annotations

import os
import socket

import ray
import torch

from lamina.executor import ComputeSide
from lamina.kv_pool import KVPoolConfig
from lamina.messages import StepPlan
from lamina.models import load
from lamina.splitter import split_model
from lamina.wire import SocketChannel

from .memory_worker import META


@ray.remote
class ComputeWorker:
    def __init__(self, model: str | None, dtype: str, num_memory_workers: int,
                 threads: int = 1):
        torch.set_num_threads(threads)
        self.loaded = load(model, dtype=dtype, with_tokenizer=False)
        self.compute = ComputeSide(split_model(self.loaded.model), num_memory_workers)
        self.channels: list[SocketChannel] = []

    def memory_spec(self, num_slots: int, kv_dtype: str):
        """What each memory worker needs: its pool shape and per-layer attention params."""
        specs = self.compute.split.attention_specs
        return KVPoolConfig.for_specs(specs, num_slots, kv_dtype), self.compute.params

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def connect(self, addresses: list) -> int:
        for kind, *addr in addresses:
            if kind == "unix":
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(addr[0])
            else:
                s = socket.create_connection(tuple(addr))
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.channels.append(SocketChannel(s))
        return os.getpid()

    def _attend(self, layer, q, k, v, parts):
        step = self._step
        if layer == 0:  # per-step metadata first
            for ch, p in zip(self.channels, parts):
                if p.rows.numel():
                    b = p.batch
                    for t in (p.new_slots, b.cu_q, b.q_pos, b.slots, b.cu_k, b.k_pos0):
                        ch.send(t, META, step)
        live = [(ch, p) for ch, p in zip(self.channels, parts) if p.rows.numel()]
        for ch, p in live:  # send to every worker first, then collect: they run in parallel
            for t in (q, k, v):
                ch.send(t[p.rows], layer, step)
        o = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        for ch, p in live:
            o[p.rows] = ch.recv(expect_layer=layer, expect_step=step,
                                expect_shape=(p.rows.numel(), q.shape[1], v.shape[-1]))[0]
        return o

    def execute(self, plan: StepPlan):
        self._step = plan.step
        return self.compute.run(plan, self._attend)
