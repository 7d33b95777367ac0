"""The device-to-device path: a channel's tensors as torch.distributed point-to-point
sends, NCCL between a GPU compute worker and GPU memory workers, gloo on CPU.

Data in: the float tensors a `SocketChannel` with a `PeerPath` sends that lie on the
path's device (a layer's q/k/v one way, its outputs the other). Data out: the same
tensors on the receiver's path device; under NCCL they never touch host memory.

Why: without it a GPU memory worker gets its q/k/v through the host. The compute GPU
copies them into pinned buffers, the socket or shared-memory ring carries bytes, the
memory worker copies them onto its GPU, and the outputs come back the same way. That
is four PCIe crossings and two host copies per layer. NCCL moves them GPU to GPU:
- NVLink or PCIe peer-to-peer where the two processes may map each other's memory;
- its own shared-memory transport otherwise (Ray gives each worker its own
  `CUDA_VISIBLE_DEVICES`, which can rule peer-to-peer out; `NCCL_DEBUG=INFO` says which);
- GPUDirect RDMA or sockets between nodes.
CUDA IPC handles were the alternative. But a handle names a device the opener may not
see under Ray's per-worker visibility, and IPC stops at the node.

How: the socket stays the doorbell. It carries every header, in order, and every frame
that is not such a tensor (the step's int32 metadata). A frame whose payload takes the
path has `IN_PEER` set in its header's ndim byte. Its payload is one send, posted after
the header is on the socket; the reader posts the matching receive once it has parsed
the header. NCCL makes a pair's communicator at its first send and receive, so the
header has to come first. Each direction has a process group of its own (two ranks: the
compute end 0, the memory end 1). A memory worker sends outputs on its own thread while
it reads the next micro-batch's q/k/v, and one NCCL communicator would run both
directions' operations in one order that the two ends issue differently: a deadlock.
Sends return at once. A sent tensor is kept until its send is known finished (gloo
reads it on its own thread; NCCL also records it on its stream).

Rendezvous: the memory worker hosts a `TCPStore`; its address travels with the socket's
(`Rendezvous`). Both ends join both groups and exchange one element each way
(`open_path`), so a path that cannot work fails when the workers connect, with the
backend's error, not in a step.
"""
from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from datetime import timedelta

import torch

from lamina.dataplane.transport import FrameError, PeerTimeout

BACKENDS = ("nccl", "gloo")
MODES = ("auto", "off", *BACKENDS)  # LAMINA_COLLECTIVE
CONNECT_TIMEOUT_S = 120.0  # joining the groups, where the channel has no timeout
MAX_PENDING = 64  # sends not yet known finished, before the oldest is waited for
LOOPBACK = "127.0.0.1"  # where a co-located pair's path meets and connects
HELLO = (1.0, 2.0)  # what the compute end, then the memory end, sends at connect time


class CollectiveError(RuntimeError):
    """A collective path cannot be opened here (no such backend, or the peer never came)."""


@dataclass(frozen=True)
class Rendezvous:
    """Where a pair's collective path meets: the memory worker's store."""

    backend: str  # "nccl" | "gloo"
    host: str
    port: int

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"collective backend must be one of {BACKENDS}, got "
                             f"{self.backend!r}")
        if not 0 < self.port < 1 << 16:
            raise ValueError(f"rendezvous port must be 1..65535, got {self.port}")


def collective_mode() -> str:
    """`LAMINA_COLLECTIVE`: auto (the default), off, nccl or gloo."""
    mode = os.environ.get("LAMINA_COLLECTIVE", "auto")
    if mode not in MODES:
        raise ValueError(f"LAMINA_COLLECTIVE must be one of {MODES}, got {mode!r}")
    return mode


def collective_backend(compute_device: str, kv_device: str) -> str | None:
    """The backend a compute / memory worker pair's tensors take, or None (bytes on the
    socket or in shared memory). auto: NCCL where the slices and the KV pools are both
    on GPUs. gloo: gloo whatever the devices (the same path on CPU, for tests and
    debugging; a GPU end's tensors then go through host memory). nccl: NCCL, which needs
    both on GPUs. off: none."""
    mode = collective_mode()
    both = compute_device.startswith("cuda") and kv_device.startswith("cuda")
    if mode == "nccl" and not both:
        raise ValueError(f"LAMINA_COLLECTIVE=nccl sends GPU tensors: it needs "
                         f"compute_device and kv_device on CUDA, not {compute_device!r} "
                         f"and {kv_device!r}")
    if mode != "auto":
        return None if mode == "off" else mode
    return "nccl" if both else None


def path_device(backend: str, device: str | torch.device) -> torch.device:
    """Where a path's tensors must lie to take it: the GPU under NCCL, the host under
    gloo (whose point-to-point sends take CPU tensors). A GPU gets its index: tensors
    report "cuda:0", and torch.device("cuda") != torch.device("cuda:0")."""
    dev = torch.device(device) if backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def host_store(host: str, timeout_s: float | None = None):
    """The memory worker's end of a rendezvous: a store on a free port of `host` ->
    (the store, to keep while the path opens; its port)."""
    import torch.distributed as dist

    store = dist.TCPStore(host, 0, 2, True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s or CONNECT_TIMEOUT_S))
    return store, store.port


class PeerPath:
    """One channel's point-to-point path: a group to send on and one to receive on."""

    def __init__(self, send_group, recv_group, rank: int, device: torch.device,
                 backend: str):
        self.send_group, self.recv_group = send_group, recv_group
        self.peer, self.device, self.backend = 1 - rank, device, backend
        # how long a gloo wait may take (NCCL's waits only order streams: its watchdog
        # ends a communicator whose operation outlives the group's timeout)
        self.timeout: timedelta | None = None
        self._pending: deque = deque()  # (work, tensor) of sends not known finished
        self.sent = self.received = 0  # payloads (tests, traces)

    def takes(self, t: torch.Tensor) -> bool:
        """Whether a frame's tensor goes on this path: floats on its device."""
        return t.is_floating_point() and t.device == self.device and t.numel() > 0

    def send(self, t: torch.Tensor) -> None:
        t = t.contiguous()
        self._reap()
        work = self._checked(lambda: self.send_group.send([t], self.peer, 0), "send")
        self._pending.append((work, t))
        self.sent += 1

    def recv_into(self, out: torch.Tensor) -> None:
        """Fill `out` with the next payload (under NCCL: the current stream waits)."""
        work = self._checked(lambda: self.recv_group.recv([out], self.peer, 0), "receive")
        self._wait(work, "receive")
        self.received += 1

    def _reap(self, every: bool = False) -> None:
        """Forget finished sends (raising a failed one's error); wait for the oldest
        while too many are out (or for all: `every`)."""
        while self._pending and (every or len(self._pending) > MAX_PENDING
                                 or self._pending[0][0].is_completed()):
            self._wait(self._pending.popleft()[0], "send")

    def _wait(self, work, what: str) -> None:
        if self.timeout is not None and self.backend == "gloo":
            self._checked(lambda: work.wait(self.timeout), what)
        else:
            self._checked(work.wait, what)

    def _checked(self, op, what: str):
        """`op()`, its failure raised as the data plane's: `PeerTimeout` when the peer
        did not answer in time, else `FrameError` (a gone peer, a closed path)."""
        if self.send_group is None:
            raise FrameError(f"{self.backend} {what} of a payload: the path is closed")
        try:
            return op()
        except RuntimeError as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            if "timed out" in msg.lower():
                raise PeerTimeout(f"{self.backend} {what} of a payload: the peer did not "
                                  f"answer ({msg})") from None
            raise FrameError(f"{self.backend} {what} of a payload failed: {msg}") from None

    def set_timeout(self, seconds: float | None) -> None:
        self.timeout = None if seconds is None else timedelta(seconds=seconds)

    def close(self) -> None:
        """Drop the groups without waiting for the peer (it may be gone): a gloo group
        closes its connections when dropped, so the peer's waits fail at once; NCCL's
        communicators are aborted first (dropping one with work in flight can hang)."""
        self._pending.clear()
        groups, self.send_group, self.recv_group = (self.send_group, self.recv_group), None, None
        if self.backend == "nccl":
            for g in groups:
                if g is not None:
                    try:
                        g.abort()
                    except RuntimeError:
                        pass


def _group(backend: str, store, rank: int, timeout: timedelta, host: str):
    """A two-rank process group of `backend` on `store` (joined by both ends)."""
    import torch.distributed as dist

    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    if not dist.is_nccl_available():
        raise CollectiveError(f"the NCCL path needs a CUDA build of torch with NCCL "
                              f"(torch {torch.__version__}, CUDA: {torch.version.cuda}); "
                              f"LAMINA_COLLECTIVE=off sends through the host instead")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, 2, opts)


def open_path(rdv: Rendezvous, rank: int, device: str | torch.device, host: str,
              timeout_s: float | None = None, store=None) -> PeerPath:
    """Join a pair's two groups as `rank` (0: the compute end, 1: the memory end, which
    passes its `host_store`) and exchange one element each way. `host`: this end's
    address for gloo's connections. -> the path, its tensors on `device` (NCCL) or the
    host (gloo)."""
    import torch.distributed as dist

    if not dist.is_available():
        raise CollectiveError("this torch has no torch.distributed")
    dev = path_device(rdv.backend, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # NCCL's communicator binds to the current device
    timeout = timedelta(seconds=timeout_s or CONNECT_TIMEOUT_S)
    try:
        if store is None:
            store = dist.TCPStore(rdv.host, rdv.port, 2, False, timeout=timeout)
        c2m, m2c = (_group(rdv.backend, dist.PrefixStore(name, store), rank, timeout, host)
                    for name in ("c2m", "m2c"))
    except (RuntimeError, ValueError) as e:
        if isinstance(e, CollectiveError):
            raise
        raise CollectiveError(f"{rdv.backend} path to {rdv.host}:{rdv.port} (rank {rank}): "
                              f"{str(e).splitlines()[0]}") from None
    path = PeerPath(c2m, m2c, rank, dev, rdv.backend) if rank == 0 else \
        PeerPath(m2c, c2m, rank, dev, rdv.backend)
    _hello(path, rank)
    return path


def _hello(path: PeerPath, rank: int) -> None:
    """One element each way, in the order a step uses them (compute first)."""
    mine = torch.full((1,), HELLO[rank], device=path.device)
    got = torch.empty(1, device=path.device)
    try:
        if rank == 0:
            path.send(mine)
            path.recv_into(got)
        else:
            path.recv_into(got)
            path.send(mine)
        path._reap(every=True)
    except (FrameError, PeerTimeout) as e:  # a connect-time failure, as the groups' are
        raise CollectiveError(f"{path.backend} path: no hello from the peer: {e}") from None
    if got.item() != HELLO[1 - rank]:
        raise CollectiveError(f"{path.backend} path: the peer's hello was {got.item()}, "
                              f"expected {HELLO[1 - rank]}")
    path.sent = path.received = 0
