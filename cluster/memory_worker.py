"""Memory worker: a Ray actor holding one KV pool and computing attention for the
requests placed on it, for one compute worker or for several (compute replicas: a
connection each, served on threads of their own over the one pool; a lock makes the
device do one attention at a time). Under rotational pipelining over the replicas, a
layer's output goes out on the connection of the replica that runs the next slice
(`MemoryServer.route`).

Data in: the compute worker's frames over the data plane: per step the slot metadata,
per layer and micro-batch q/k/v (the protocol is `lamina.dataplane.protocol`; its `MemoryServer`
runs here, on a thread). Data out: per layer and micro-batch the attention output with
each row's log-sum-exp (so a sequence split over workers merges exactly).
Ray only creates, configures and supervises it (setup / listen / health calls).
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time

import ray
import torch

from lamina.dataplane.collective import (
    BACKENDS,
    LOOPBACK,
    CollectiveError,
    Rendezvous,
    host_store,
    open_path,
)
from lamina.dataplane.protocol import MemoryServer, Routes
from lamina.dataplane.transport import (
    ShmRing,
    SocketChannel,
    close_endpoint,
    listen_stream,
    nodelay,
    shm_enabled,
    shut,
)
from lamina.entrypoints.logs import configure_logging
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool
from lamina.trace import Tracer

log = logging.getLogger(__name__)
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
        configure_logging()  # its lines go to Ray's log of this worker
        torch.set_num_threads(threads)
        self.index = index
        self.memory = self.params = None
        # each connected compute worker's server, by its replica (the order of `listen`)
        self.routes = Routes(index)
        self._rdma: list = []  # per RDMA connection: (its verbs, its peer's endpoint set)
        self._connections = 0  # endpoints opened, any transport: the next one's replica
        self._shared = None  # the pool's lock when several compute workers share it
        self._listening: list = []  # every stream endpoint opened (closed by `reset`)
        self._threads: list[threading.Thread] = []  # each endpoint's serving thread
        self.tracer = Tracer(f"memory{index}")  # its timeline (`lamina.trace`), off
        self.moves_refused = 0  # KV moves that came past their deadline (`put_slots`)

    def renumber(self, index: int) -> None:
        """Between a recovery's reset and its wiring: this is memory worker `index` now
        (workers before it were dropped: `RayExecutor._drop_lost`)."""
        self.index = index
        self.routes, self.tracer = Routes(index), Tracer(f"memory{index}")
        if self.memory is not None and self.memory.tiers is not None:
            self.memory.tiers.worker = index  # (its log lines)

    def setup(self, pool_config, params, faults=None, tiers=None, rope=None,
              sparsity=None, connections: int = 1) -> dict:
        """`connections`: how many compute workers it serves (> 1: they share the pool
        under a lock)."""
        self.close_tiers()  # a second setup (a recovery's): the earlier store goes
        self.memory = MemorySide(KVPool(pool_config), faults=faults, tiers=tiers,
                                 worker=self.index, rope_inv_freq=rope, sparsity=sparsity)
        self.params = list(params)
        self._shared = threading.Lock() if connections > 1 else None
        return {"backend": self.memory.backend.name, "reason": self.memory.backend.reason,
                "pool_bytes": pool_config.nbytes, "pid": os.getpid(),
                "threads": torch.get_num_threads()}

    def listen(self, kind: str) -> tuple:
        """Open a data-plane endpoint of transport `kind` (`choose_transport`) for one
        compute worker (called once per compute worker), served on a thread of its own.
        Co-located ("unix+shm"): payloads go through two shared-memory rings, the socket
        is the doorbell. "rdma": a queue pair whose endpoint goes back to the compute
        worker; serving starts once `accept_rdma` has its peer's."""
        replica, self._connections = self._connections, self._connections + 1
        if kind == "rdma":
            from lamina.dataplane.rdma import PyverbsVerbs

            n = len(self._rdma)
            self._rdma.append((PyverbsVerbs(), threading.Event()))
            self._start(self._serve_rdma, n, replica)
            return ("rdma", self._rdma[n][0].endpoint().to_wire())
        base, _, extra = kind.partition("+")
        unix, node_ip = base == "unix", ray.util.get_node_ip_address()
        srv, addr = listen_stream(unix, node_ip, f"mem{self.index}-{replica}")
        self._listening.append(srv)
        if extra in BACKENDS:  # tensors over a collective path: its rendezvous goes along
            host = LOOPBACK if unix else node_ip
            store, port = host_store(host)
            rdv = Rendezvous(extra, host, port)
            self._start(self._serve_collective, srv, store, rdv, replica)
            return (*addr, rdv)
        rings = None
        if kind == "unix+shm" and shm_enabled():
            base = f"/dev/shm/lamina-{os.getpid()}-{self.index}-{replica}"
            rings = (ShmRing(base + "-c2m", RING_BYTES, create=True),
                     ShmRing(base + "-m2c", RING_BYTES, create=True))
            addr = (*addr, base + "-c2m", base + "-m2c", RING_BYTES)
        self._start(self._serve, srv, rings, replica)
        return addr

    def _start(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True)
        t.start()
        self._threads.append(t)

    def reset(self, timeout_s: float) -> bool:
        """Make this worker as good as a new one for a recovery (its compute workers
        hung up first), keeping its process and pool: every endpoint closed, every
        connection's serving ended, every sequence's state dropped (`MemorySide.reset`;
        the pool's bytes stay, and the engine keeps the KV they hold). Much faster than
        a new worker (no process, model metadata or pool to set up). False when a
        connection is still being served after `timeout_s` (stuck inside a step): the
        executor replaces this worker instead."""
        for srv in self._listening:  # wakes an `accept` still waiting (Linux: EINVAL)
            close_endpoint(srv)
        self.routes.close()  # wakes a ring output waiting for a connection
        for s in self.servers:  # wakes a read or write still blocked on the socket
            shut(getattr(s.ch, "sock", None))
        deadline = time.monotonic() + timeout_s
        threads = self._threads + [s.send_thread for s in self.servers]
        for t in threads:
            if t.ident is not None:  # (a send thread whose serving never began)
                t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            return False
        self.routes, self._rdma = Routes(self.index), []
        self._listening, self._threads, self._connections = [], [], 0
        if self.memory is not None:
            self.memory.reset()
        return True

    @property
    def servers(self) -> list[MemoryServer]:
        """One per connected compute worker, in the order they were served."""
        return self.routes.servers()

    def tier_missing(self, loads: list) -> list[int]:
        """Of a step's tier loads (before it is sent), the sequences whose saved KV this
        worker cannot serve (waits for its disk reads)."""
        tiers = self.memory.tiers
        if tiers is None:
            return [o.seq_id for o in loads]
        return [o.seq_id for o in tiers.missing(loads)]

    def apply_tiers(self, orders: list) -> None:
        """A step's tier orders before the step is sent, not in its frames (compute
        replicas; a worker with no rows in the step: `RayExecutor._orders_ahead`); under
        the pool's lock, as its serving."""
        with self._shared or contextlib.nullcontext():
            self.memory.apply_tiers(orders)

    def export_tiers(self, entries: list[int]) -> dict:
        """Copies of saved entries for another memory worker (`TierStore.export`)."""
        return self.memory.tiers.export(entries) if self.memory.tiers is not None else {}

    def adopt_tiers(self, entries: dict) -> list[int]:
        """Entries another memory worker exported, into this one's host tier."""
        return self.memory.tiers.adopt(entries) if self.memory.tiers is not None else []

    def read_slots(self, slots: list[int]) -> tuple:
        """Every layer's KV at these pool slots, for another memory worker's pool (a
        scale-down's move of a running sequence: `RayExecutor.move_kv`)."""
        with self._shared or contextlib.nullcontext():
            return self.memory.pool.read(slots)

    def put_slots(self, kv: tuple, slots: list[int], deadline: float) -> bool:
        """KV another memory worker read (`read_slots`) into these pool slots, unless
        past `deadline` (wall clock): the executor has given up on the move by then and
        the engine given the slots to others. -> whether it was written."""
        with self._shared or contextlib.nullcontext():
            late = time.time() - deadline
            if late > 0:
                self.moves_refused += 1
                log.warning("memory worker %d: KV moved to %d slots came %.1f s past its "
                            "deadline: not written", self.index, len(slots), late)
                return False
            self.memory.pool.put(slots, *kv)
            return True

    def tier_stats(self) -> dict:
        return dict(self.memory.tiers.stats) if self.memory.tiers is not None else {}

    def close_tiers(self) -> None:
        """Delete this worker's tier files (before the deployment goes)."""
        if self.memory is not None and self.memory.tiers is not None:
            self.memory.tiers.close()

    def start_trace(self) -> None:
        self.tracer.start()
        for s in self.servers:  # their output senders' lanes
            s.send_tracer.start()

    def stop_trace(self) -> list:
        sends = [x for s in self.servers for x in s.send_tracer.stop()]
        return self.tracer.stop() + sends

    def ping(self) -> int:
        """Its process id: an answer at all says the worker is alive and not stuck."""
        return os.getpid()

    def health(self) -> dict:
        """Its connections' state: the first error, the steps served (summed), every
        sequence a failed step was blamed on, the payloads received on collective
        paths; the KV moves it refused, come too late."""
        ss = self.servers
        return {"error": self.routes.failure or next((s.error for s in ss if s.error), None),
                "steps": sum(s.steps for s in ss),
                "path_payloads": sum(getattr(getattr(s.ch, "peer", None), "received", 0)
                                     for s in ss),
                "bad_seqs": sorted({b for s in ss for b in s.bad_seqs}),
                "sched_batch": getattr(self, "sched_batch", False),
                "moves_refused": self.moves_refused}

    def accept_rdma(self, peer: dict, connection: int = 0) -> None:
        """A compute worker's RDMA endpoint for `connection` (the order of the "rdma"
        `listen` calls): this end's queue pair to RTS, then serve."""
        from lamina.dataplane.rdma import RdmaEndpoint

        verbs, ready = self._rdma[connection]
        verbs.connect(RdmaEndpoint.from_wire(peer))
        ready.set()

    def _serve_rdma(self, n: int, replica: int):
        # (its thread waits for `accept_rdma`, and a connected one on its queue pair: a
        # `reset` cannot end either, so a recovery replaces a worker serving RDMA)
        from lamina.dataplane.rdma import RdmaChannel

        verbs, ready = self._rdma[n]
        ready.wait()
        self._serve_on(RdmaChannel(verbs), replica)

    def _serve(self, srv, rings, replica: int):
        conn = _accept(srv)
        # the rings' names go now: the compute worker mapped them before it connected
        # (or never will: `reset` closed the endpoint first)
        for r in rings or ():
            r.unlink()
            if conn is None:
                r.close()
        if conn is None:
            return
        if rings:
            c2m, m2c = rings
            ch = SocketChannel(conn, ring_out=m2c, ring_in=c2m)
        else:
            ch = SocketChannel(conn)
        self._serve_on(ch, replica)

    def _serve_collective(self, srv, store, rdv: Rendezvous, replica: int):
        """Accept the compute worker, join the path's groups (it joins them after it
        connects), then serve. A path that cannot open is the compute worker's
        `connect` error too (its end fails or times out); here it is logged."""
        conn = _accept(srv)
        if conn is None:
            return
        try:
            path = open_path(rdv, 1, self.memory.pool.config.device, rdv.host, store=store)
        except CollectiveError as e:
            log.error("memory worker %d: %s", self.index, e)
            conn.close()
            return
        self._serve_on(SocketChannel(conn, peer=path), replica)

    def _serve_on(self, ch, replica: int) -> None:
        """Serve compute worker `replica`'s steps on `ch` until it closes."""
        self.sched_batch = batch_policy()
        server = MemoryServer(self.memory, self.params, ch, f"memory worker {self.index}",
                              tracer=self.tracer, shared=self._shared, index=replica,
                              route=self.routes.send)
        if not self.routes.add(replica, server):  # another connection's step failed
            ch.close()  # its compute worker fails its step now, not at its timeout
            return
        server.serve()
        if server.error:  # every connection's step fails with it (`Routes`)
            for other in self.routes.fail(server, server.error):
                shut(getattr(other.ch, "sock", None))


def _accept(srv: socket.socket) -> socket.socket | None:
    """The one peer of a `listen_stream` endpoint; its Unix socket file (and the temp
    folder made for it) removed once connected. None when `reset` closed the endpoint
    before a peer came."""
    try:
        conn = nodelay(srv.accept()[0])
    except OSError:
        return None
    close_endpoint(srv)
    return conn
