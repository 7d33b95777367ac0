"""Compute worker: a Ray actor holding the model slices; it runs every step's dense part
and exchanges each layer's q/k/v and attention output with the memory workers over the
data plane (`lamina.dataplane.transport` frames), not through Ray.

Data in: a `StepPlan` per step over the control channel (`lamina.dataplane.control`, served on a
thread here; Ray only creates and supervises the actor). Data out: the `StepResult`.
The per-layer protocol is `lamina.dataplane.protocol` (`SocketLink`). In a rotational
ring of R replicas (`lamina.compute.ring`) it also holds a connection to the next
replica (contexts out) and one from the previous (contexts in).
"""
from __future__ import annotations

import os
import socket
import sys
import threading
import time
from dataclasses import dataclass

import ray
import torch

from lamina.compute.compute_side import ComputeSide
from lamina.compute.ring import Ring
from lamina.dataplane.collective import LOOPBACK, Rendezvous, open_path
from lamina.dataplane.control import serve_control
from lamina.dataplane.migration import ChannelContextLink
from lamina.dataplane.paths import native_ext
from lamina.dataplane.probe import probe_exchange
from lamina.dataplane.protocol import SocketLink
from lamina.dataplane.transport import (
    Channel,
    ShmRing,
    SocketChannel,
    close_endpoint,
    connect_stream,
    listen_stream,
    nodelay,
    shut,
)
from lamina.engine.messages import StepPlan, StepResult
from lamina.entrypoints.logs import configure_logging
from lamina.memory.pool import KVPoolConfig
from lamina.model.loader import load, load_tokenizer
from lamina.model.prepare import (
    key_channel_scales,
    prepare_split,
    rotary_frequencies,
    sparsity_for,
)
from lamina.model.quick_load import enabled_for, load_weights_only, remember
from lamina.splitter.weights_only import WeightsOnlyModel

PREFILL_TOKENS = 256  # a step feeding this many tokens counts as prefill-heavy
RING_ACCEPT_S = 60  # how long a ring endpoint waits for the previous replica
# Fewer rows than this: a second thread does not pay. MKL's sgemm (eager) barely scales
# past one thread on skinny shapes; oneDNN's packed kernels and ours do, from one row on.
WIDE_ROWS = {"eager": 16, "onednn": 1, "avx512bf16": 1}


def step_threads(num_tokens: int, micro_batches: int, threads: int, wide: int,
                 wide_rows: int = WIDE_ROWS["eager"]) -> int:
    """Torch threads for a step's dense part: `wide` (every core the memory workers
    leave idle) when they are idle meanwhile, else `threads`. They are idle in a
    prefill-heavy step (their attention is small next to the dense work) and in any
    one-micro-batch step of >= `wide_rows` rows, where the two sides take turns."""
    if num_tokens >= PREFILL_TOKENS or (micro_batches == 1 and num_tokens >= wide_rows):
        return wide
    return threads


@dataclass(frozen=True)
class ComputeWorkerSpec:
    """What a compute worker is started with (kept to start its replacement)."""

    model: str | None  # None: the default model
    dtype: str
    num_memory_workers: int
    threads: int = 1
    wide_threads: int | None = None  # steps whose memory workers sit idle (step_threads)
    dense_backend: str = "auto"
    batch_hint: int = 32  # the batch the dense backend prepacks for
    fuse: bool = True  # fused pointwise chains
    # "cuda": the slices on this worker's GPU (Ray gives it one and sets
    # CUDA_VISIBLE_DEVICES, so it is always "cuda" here); q/k/v go to the memory workers
    # through pinned host buffers
    compute_device: str = "cpu"
    graph_tokens: int = 0  # decode steps replayed as CUDA graphs up to this size (0: none)
    stream_groups: int = 1  # q/k/v streamed in this many groups a layer (SocketLink)
    replica: int = 0  # which model replica it is (its trace lane: "compute<replica>")


@dataclass(frozen=True)
class WorkerStart:
    """How a compute worker got its slices: `weights_only` (no transformers; see
    `lamina.model.quick_load`) or the full load, and the seconds each part took."""

    weights_only: bool
    load_s: float
    split_s: float
    transformers_imported: bool  # by the time the slices were ready


@ray.remote
class ComputeWorker:
    def __init__(self, spec: ComputeWorkerSpec):
        configure_logging()  # its lines go to Ray's log of this worker
        # Steps use `threads`, or `wide_threads` where the memory workers sit idle during
        # the dense part (see `step_threads`).
        self.threads, self.wide_threads = spec.threads, spec.wide_threads or spec.threads
        self.stream_groups = spec.stream_groups
        torch.set_num_threads(spec.threads)
        self._model, self._dtype = spec.model, spec.dtype
        self._key_scales = None  # int8 pools' key channel scales, calibrated on first use
        self._sparsity = None  # the memory workers' SparsityConfig, weights measured
        t0 = time.perf_counter()
        # its tensors alone, bound to the stored trace (no transformers: half of a
        # start), where an earlier full load here recorded how; else the full load.
        # CPU and GPU slices alike unless LAMINA_WEIGHTS_ONLY=0 (`enabled_for`).
        quick = enabled_for(spec.compute_device)
        self.loaded = load_weights_only(spec.model, spec.dtype) if quick else None
        weights_only = self.loaded is not None
        if not weights_only:
            self.loaded = load(spec.model, dtype=spec.dtype, with_tokenizer=False)
        t1 = time.perf_counter()
        prep = prepare_split(self.loaded.model, spec.dense_backend, spec.batch_hint, spec.fuse,
                             spec.compute_device)
        if not weights_only and quick:
            remember(self.loaded, spec.dtype)
        self.start = WorkerStart(weights_only, t1 - t0, time.perf_counter() - t1,
                                 "transformers" in sys.modules)
        self.dense = prep.dense
        self.compute = ComputeSide(prep.split, spec.num_memory_workers,
                                   device=spec.compute_device, graph_tokens=spec.graph_tokens)
        self.compute.vocab_size = int(self.loaded.config.vocab_size)
        self.compute.tracer.lane = f"compute{spec.replica}"
        self.wide_rows = WIDE_ROWS.get(self.dense.backend, WIDE_ROWS["eager"])
        self.channels: list[Channel] = []
        self.replica = spec.replica
        # the ring (rotational over compute workers): contexts to the next replica, from
        # the previous one (accepted on a thread: `listen_ring`)
        self._ring_out: SocketChannel | None = None
        self._ring_in: SocketChannel | None = None
        self._ring_accept: threading.Thread | None = None
        self._lock = threading.Lock()  # one step at a time (control thread or Ray call)
        self._control = None  # the listening socket of the control channel
        native_ext()  # the C++ data plane (built or loaded now, not in the first step)

    def memory_spec(self, num_slots: int, kv_dtype: str, kv_device: str = "cpu",
                    local_prefill: bool = True, faults=None, pool_bytes: int | None = None,
                    sparsity=None, huge_pages: bool = True, prefault: bool = True):
        """What each memory worker needs: its pool shape and per-layer attention params.
        `local_prefill`: fresh prompts attend here, on a scratch pool of `kv_dtype` (paper
        5.6); the memory workers only store their KV. `faults`: a test FaultPlan."""
        specs = self.compute.split.attention_specs
        if kv_dtype == "int8" and self._key_scales is None:
            # once per worker (recoveries ask again), on the local executor's text
            self._key_scales = key_channel_scales(self._full_model(),
                                                  load_tokenizer(self._model), len(specs))
        scales = self._key_scales if kv_dtype == "int8" else None
        self.compute.local_kv_dtype = kv_dtype if local_prefill else None
        self.compute.local_key_scales = scales  # the scratch pool rounds as the workers do
        cfg = KVPoolConfig.for_specs(specs, num_slots, kv_dtype, kv_device, scales, pool_bytes,
                                     huge_pages, prefault)
        self.compute.pool_slots, self.compute.faults = cfg.num_slots, faults
        if sparsity is not None and self._sparsity is None:  # entropy weights: measured once
            self._sparsity = sparsity_for(sparsity, self._full_model(),
                                          load_tokenizer(self._model), len(specs))
        return cfg, self.compute.params, self._sparsity

    def _full_model(self) -> torch.nn.Module:
        """The model itself, for what runs it (calibrations): after a weights-only
        start, loaded now (and dropped after use)."""
        if isinstance(self.loaded.model, WeightsOnlyModel):
            return load(self._model, dtype=self._dtype, with_tokenizer=False).model
        return self.loaded.model

    def ping(self) -> int:
        """Its process id: an answer at all says the worker is alive and not stuck."""
        return os.getpid()

    def start_report(self) -> WorkerStart:
        return self.start

    def rotary(self) -> tuple[float, ...] | None:
        """The model's rotary frequencies (the memory workers' shifted tier loads)."""
        return rotary_frequencies(self.loaded.model)

    def dense_choice(self):
        """The `DenseChoice` this worker's slices run with."""
        return self.dense

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def connect(self, addresses: list, timeout_s: float | None = None, first: int = 0) -> dict:
        """Open the data plane to each memory worker (replacing any earlier one), or,
        with `first` > 0, to memory workers `first`.. joining those it has (a pool
        grown while it serves). A worker that does not answer within `timeout_s` fails
        the step (`PeerTimeout`). -> {"pid", "rdma": {worker index: this end's RDMA
        endpoint}} (the executor hands each to its memory worker's `accept_rdma`)."""
        if first == 0:
            self.disconnect()
        elif len(self.channels) != first:
            raise RuntimeError(f"memory workers from {first} on: this compute worker has "
                               f"{len(self.channels)}")
        mine = {}
        for i, (kind, *addr) in enumerate(addresses, start=first):
            if addr and isinstance(addr[-1], Rendezvous):  # tensors on a collective path
                rdv, addr = addr[-1], addr[:-1]
                sock = connect_stream(kind, addr[0] if kind == "unix" else addr)
                host = LOOPBACK if kind == "unix" else ray.util.get_node_ip_address()
                path = open_path(rdv, 0, self.compute.device, host, timeout_s)
                self.channels.append(SocketChannel(sock, peer=path))
                continue
            if kind == "rdma":
                from lamina.dataplane.rdma import PyverbsVerbs, RdmaChannel, RdmaEndpoint

                verbs = PyverbsVerbs()
                verbs.connect(RdmaEndpoint.from_wire(addr[0]))
                mine[i] = verbs.endpoint().to_wire()
                self.channels.append(RdmaChannel(verbs))
            elif kind == "unix":
                rings = {}
                if len(addr) == 4:  # shared-memory rings: map them before connecting
                    c2m, m2c, cap = addr[1:]
                    rings = {"ring_out": ShmRing(c2m, cap, create=False),
                             "ring_in": ShmRing(m2c, cap, create=False)}
                self.channels.append(SocketChannel(connect_stream(kind, addr[0]), **rings))
            else:
                self.channels.append(SocketChannel(connect_stream(kind, addr)))
        self.set_timeout(timeout_s)
        self.compute.num_workers = len(self.channels)
        return {"pid": os.getpid(), "rdma": mine}

    def keep_memory(self, n: int) -> None:
        """Hang up on memory workers n.. (they leave the deployment), between steps."""
        with self._lock:
            for ch in self.channels[n:]:
                try:
                    ch.close()
                except OSError:
                    pass
            del self.channels[n:]
            self.compute.num_workers = n

    def set_timeout(self, seconds: float | None) -> None:
        for ch in (*self.channels, self._ring_out, self._ring_in):
            if ch is not None:
                ch.set_timeout(seconds)

    def disconnect(self) -> None:
        for ch in (*self.channels, self._ring_out, self._ring_in):
            try:
                if ch is not None:
                    ch.close()
            except OSError:
                pass
        self.channels, self._ring_out, self._ring_in = [], None, None
        self.compute.join_ring(None)

    def reset(self, timeout_s: float) -> bool:
        """Hang up on the memory workers and forget every sequence's slot table, for a
        recovery (the engine resends every sequence's table). Waits up to `timeout_s` for a
        step still running (the hang-up makes it fail at once); False if it does not
        end: the executor replaces this worker."""
        self.interrupt()  # a step blocked on a socket wakes (closing it would not)
        self.disconnect()
        if not self._lock.acquire(timeout=timeout_s):
            return False
        try:
            self.compute.reset()
        finally:
            self._lock.release()
        return True

    def interrupt(self) -> None:
        """Wake a step blocked on its peers (another replica of its ring failed): shut
        its data-plane and ring sockets down, so it fails at once; `recover` rewires."""
        for ch in (*self.channels, self._ring_out, self._ring_in):
            shut(getattr(ch, "sock", None))

    def listen_ring(self, unix: bool) -> tuple:
        """Open the endpoint the previous replica of a ring connects to (accepted on a
        thread); -> its address for that replica's `connect_ring`."""
        srv, addr = listen_stream(unix, ray.util.get_node_ip_address(),
                                  f"ring{self.replica}")

        def accept():
            try:
                srv.settimeout(RING_ACCEPT_S)
                self._ring_in = SocketChannel(nodelay(srv.accept()[0]))
            except OSError:
                pass  # `connect_ring` reports it
            finally:
                close_endpoint(srv)

        self._ring_accept = threading.Thread(target=accept, daemon=True)
        self._ring_accept.start()
        return addr

    def connect_ring(self, index: int, size: int, addr: tuple,
                     timeout_s: float | None = None) -> None:
        """Join a ring of `size` replicas as `index`: connect to the next replica's
        `listen_ring` address and take the previous one's connection (`listen_ring`)."""
        kind, *where = addr
        self._ring_out = SocketChannel(connect_stream(kind, where[0] if kind == "unix"
                                                      else where))
        if self._ring_accept is not None:
            self._ring_accept.join(RING_ACCEPT_S)
        if self._ring_in is None:
            raise RuntimeError(f"compute worker {index}: the previous replica of the ring "
                               f"did not connect within {RING_ACCEPT_S} s")
        for ch in (self._ring_out, self._ring_in):
            ch.set_timeout(timeout_s)
        self.compute.join_ring(Ring(index, size, ChannelContextLink(self._ring_out,
                                                                    self._ring_in)))

    def serve_control(self, unix: bool) -> tuple:
        """Open the step control channel (`lamina.dataplane.control`) for one client, served on a
        thread; a second call replaces the first. -> ("unix", path) or ("tcp", host,
        port) for `lamina.cluster.executor.connect_control`."""
        if self._control is not None:  # wake its accept, if still waiting
            close_endpoint(self._control)
        srv, addr = listen_stream(unix, ray.util.get_node_ip_address(), "control")
        self._control = srv
        threading.Thread(target=self._serve_control, args=(srv,), daemon=True).start()
        return addr

    def _serve_control(self, srv: socket.socket) -> None:
        try:
            conn, _ = srv.accept()
        except OSError:
            return  # replaced before a client came
        finally:
            close_endpoint(srv)
        serve_control(SocketChannel(nodelay(conn)), self.execute)

    def execute(self, plan: StepPlan):
        with self._lock:
            return self._execute(plan)

    def _execute(self, plan: StepPlan):
        # torch's thread count is per calling thread (OpenMP): set it in this one
        n = step_threads(plan.num_tokens, plan.micro_batches, self.threads, self.wide_threads,
                         self.wide_rows)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        t = time.perf_counter()
        ring = self.compute.ring.size if self.compute.ring is not None else 0
        result = self.compute.run(plan, SocketLink(self.channels, stream=self.stream_groups,
                                                   ring=ring))
        result.timings["threads"] = n
        result.timings["worker_s"] = time.perf_counter() - t  # the step inside the actor
        return result

    def start_trace(self) -> None:
        with self._lock:  # between steps
            self.compute.tracer.start()

    def stop_trace(self) -> list:
        with self._lock:
            return self.compute.tracer.stop()

    def probe_exchange(self, tokens, repeat: int) -> dict:
        """Seconds per layer for n tokens' q/k/v out and o back through the real link
        and memory-worker loop (`lamina.dataplane.probe`)."""
        return probe_exchange(SocketLink(self.channels), self.compute.split.attention_specs[0],
                              len(self.compute.params), tokens, repeat)

    def tokens(self, rows: int):
        """A step result's payload for `rows` sampled sequences (for call-cost probes)."""
        return StepResult(-1, tuple(range(rows)), ((0,),) * rows)
