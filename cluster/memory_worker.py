"""Memory worker: a Ray actor holding one KV pool and computing attention for the
requests placed on it.

Data in: the compute worker's frames over the data plane: per step the slot metadata,
per layer and micro-batch q/k/v (the protocol is `lamina.dataplane.protocol`; its `MemoryServer`
runs here, on a thread). Data out: per layer and micro-batch the attention output with
each row's log-sum-exp (so a sequence split over workers merges exactly).
Ray only creates, configures and supervises it (setup / listen / health calls).
"""
from __future__ import annotations

import os
import threading

import ray
import torch

from lamina.dataplane.protocol import MemoryServer
from lamina.dataplane.transport import (
    ShmRing,
    SocketChannel,
    listen_stream,
    nodelay,
    shm_enabled,
)
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool
from lamina.trace import Tracer

RING_BYTES = 64 << 20  # per direction; larger payloads go inline on the socket


def batch_policy() -> bool:
    """Put the calling thread (the data-plane server) under SCHED_BATCH: woken by a
    layer's q/k/v, it no longer preempts the compute worker's thread between its writes
    to the two memory workers (that thread then waited a median ~380 us for the first
    worker's attention before it could wake the second); it runs as soon as that thread
    blocks for the outputs, which it does at once (`exchange_qkv`). Not a realtime
    policy: no privilege needed. False where the OS has no such policy."""
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        return True
    except (AttributeError, OSError):
        return False


@ray.remote
class MemoryWorker:
    def __init__(self, index: int, threads: int = 1):
        torch.set_num_threads(threads)
        self.index = index
        self.memory = self.params = self._srv = self.server = None
        self.tracer = Tracer(f"memory{index}")  # its timeline (`lamina.trace`), off

    def setup(self, pool_config, params, faults=None, tiers=None, rope=None,
              sparsity=None) -> dict:
        self.memory = MemorySide(KVPool(pool_config), faults=faults, tiers=tiers,
                                 worker=self.index, rope_inv_freq=rope, sparsity=sparsity)
        self.params = list(params)
        return {"backend": self.memory.backend.name, "reason": self.memory.backend.reason,
                "pool_bytes": pool_config.nbytes, "pid": os.getpid()}

    def listen(self, kind: str) -> tuple:
        """Open the data-plane endpoint of transport `kind` (`choose_transport`); serve
        one compute worker on a thread. Co-located ("unix+shm"): payloads go through two
        shared-memory rings, the socket is the doorbell. "rdma": a queue pair whose
        endpoint goes back to the compute worker; serving starts once `accept_rdma` has
        its peer's."""
        self._rings = None
        if kind == "rdma":
            from lamina.dataplane.rdma import PyverbsVerbs

            self._verbs, self._peer = PyverbsVerbs(), threading.Event()
            threading.Thread(target=self._serve_rdma, daemon=True).start()
            return ("rdma", self._verbs.endpoint().to_wire())
        unix = kind in ("unix", "unix+shm")
        self._srv, addr = listen_stream(unix, ray.util.get_node_ip_address(),
                                        f"mem{self.index}")
        if kind == "unix+shm" and shm_enabled():
            base = f"/dev/shm/lamina-{os.getpid()}-{self.index}"
            self._rings = (ShmRing(base + "-c2m", RING_BYTES, create=True),
                           ShmRing(base + "-m2c", RING_BYTES, create=True))
            addr = (*addr, base + "-c2m", base + "-m2c", RING_BYTES)
        threading.Thread(target=self._serve, daemon=True).start()
        return addr

    def tier_missing(self, loads: list) -> list[int]:
        """Of a step's tier loads (before it is sent), the sequences whose saved KV this
        worker cannot serve (waits for its disk reads)."""
        tiers = self.memory.tiers
        if tiers is None:
            return [o.seq_id for o in loads]
        return [o.seq_id for o in tiers.missing(loads)]

    def tier_stats(self) -> dict:
        return dict(self.memory.tiers.stats) if self.memory.tiers is not None else {}

    def close_tiers(self) -> None:
        """Delete this worker's tier files (before the deployment goes)."""
        if self.memory is not None and self.memory.tiers is not None:
            self.memory.tiers.close()

    def start_trace(self) -> None:
        self.tracer.start()
        if self.server is not None:  # its output sender's lane
            self.server.send_tracer.start()

    def stop_trace(self) -> list:
        sends = self.server.send_tracer.stop() if self.server is not None else []
        return self.tracer.stop() + sends

    def health(self) -> dict:
        s = self.server
        return {"error": s and s.error, "steps": s.steps if s else 0,
                "bad_seqs": list(s.bad_seqs) if s else [],
                "sched_batch": getattr(self, "sched_batch", False)}

    def accept_rdma(self, peer: dict) -> None:
        """The compute worker's RDMA endpoint: this end's queue pair to RTS, then serve."""
        from lamina.dataplane.rdma import RdmaEndpoint

        self._verbs.connect(RdmaEndpoint.from_wire(peer))
        self._peer.set()

    def _serve_rdma(self):
        from lamina.dataplane.rdma import RdmaChannel

        self._peer.wait()
        self._serve_on(RdmaChannel(self._verbs))

    def _serve(self):
        conn = nodelay(self._srv.accept()[0])
        if self._rings:  # the compute worker mapped them before connecting
            c2m, m2c = self._rings
            for r in self._rings:
                r.unlink()
            ch = SocketChannel(conn, ring_out=m2c, ring_in=c2m)
        else:
            ch = SocketChannel(conn)
        self._serve_on(ch)

    def _serve_on(self, ch) -> None:
        """Serve the compute worker's steps on `ch` until it closes."""
        self.sched_batch = batch_policy()
        self.server = MemoryServer(self.memory, self.params, ch,
                                   f"memory worker {self.index}", tracer=self.tracer)
        self.server.serve()
