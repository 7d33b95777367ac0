"""The RDMA channel (paper 5.2): frames written by the sender straight into the
receiver's registered memory, over a reliable-connected (RC) queue pair.

Data in: frames (`transport.encode`: the same header and payload bytes every channel
carries). Data out: the same frames, checked (`transport.parse_header` / `check`), on
the other side. `RdmaChannel` implements `transport.Channel`, so the compute and memory
ends do not know which transport they run on.

Per direction: the receiver registers a ring of `ring_bytes` and an 8-byte credit word
is registered on the sender. A frame is copied into the sender's registered staging
ring at its cursor and RDMA-written (WRITE_WITH_IMM, the immediate being the frame's
length) to the same offset of the receiver's ring; the immediate's completion tells the
receiver a frame is there. Both ends place frames by the jump rule of `ring_place` (a
frame never wraps: it starts over at offset 0), so no offsets travel. The receiver
copies each frame out and RDMA-writes how far it has consumed into the sender's credit
word; a sender a full ring ahead waits for it (`PeerTimeout` after the channel's
timeout). Completions are polled, not waited on with events: the per-layer exchange is
latency-bound (paper Fig. 15).

Connection setup: each end creates its queue pair and registers its buffers, then the
two exchange `RdmaEndpoint`s (QP number, PSN, LID/GID, the ring's and the credit word's
address and rkey) through Ray, as plain dicts (`to_wire` / `from_wire`, checked field by
field), and move their QPs to RTS.

The verbs are behind `Verbs`: `PyverbsVerbs` (pyverbs, `pip install lamina[rdma]`) on a
device, `LoopbackVerbs` (two in-process ends, the same byte and completion semantics)
for the tests of the ring protocol on machines without one. `probe` says whether RDMA
can run here and why not; `choose_transport` picks each worker pair's transport.
"""
from __future__ import annotations

import os
import socket
import struct
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from lamina.dataplane.transport import (
    HEADER,
    IN_PEER,
    IN_RING,
    Channel,
    FrameError,
    PeerTimeout,
    byte_view,
    check,
    encode,
    parse_header,
    ring_place,
)

SYSFS = Path("/sys/class/infiniband")
# per direction; a frame must fit (a 4096-token fp32 q/k/v of SmolLM2: 28 MB)
RING_BYTES = int(os.environ.get("LAMINA_RDMA_RING_BYTES", 64 << 20))
RECV_DEPTH = 256  # receive WRs kept posted (one per WRITE_WITH_IMM in flight)
WIRE_VERSION = 1


@dataclass(frozen=True)
class RdmaEndpoint:
    """One end's half of the connection, exchanged through Ray."""

    qp_num: int  # 24 bits
    psn: int  # 24 bits: its first packet sequence number
    lid: int  # 16 bits (InfiniBand; 0 on RoCE)
    gid: str  # "fe80:0000:...": 8 groups of 4 hex digits (RoCE routes by it)
    mtu: int  # path MTU in bytes: 256 .. 4096
    ring_addr: int  # its receive ring's address, rkey and size
    ring_rkey: int
    ring_bytes: int
    credit_addr: int  # its credit word (the peer writes how far it consumed)
    credit_rkey: int

    def to_wire(self) -> dict:
        return {"version": WIRE_VERSION, **{f.name: getattr(self, f.name)
                                            for f in fields(self)}}

    @classmethod
    def from_wire(cls, d: dict) -> RdmaEndpoint:
        """The peer's endpoint, every field checked: a `ValueError` names the bad one."""
        if not isinstance(d, dict):
            raise ValueError(f"RDMA endpoint: expected a dict, got {type(d).__name__}")
        if d.get("version") != WIRE_VERSION:
            raise ValueError(f"RDMA endpoint: version {d.get('version')!r}, this side "
                             f"speaks {WIRE_VERSION}")
        limits = {"qp_num": 1 << 24, "psn": 1 << 24, "lid": 1 << 16, "ring_addr": 1 << 64,
                  "ring_rkey": 1 << 32, "ring_bytes": 1 << 40, "credit_addr": 1 << 64,
                  "credit_rkey": 1 << 32}
        for name, top in limits.items():
            v = d.get(name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < top:
                raise ValueError(f"RDMA endpoint: {name} must be an int in [0, {top}), "
                                 f"got {v!r}")
        if d.get("mtu") not in (256, 512, 1024, 2048, 4096):
            raise ValueError(f"RDMA endpoint: mtu must be 256..4096 (a power of two), "
                             f"got {d.get('mtu')!r}")
        gid = d.get("gid")
        parts = gid.split(":") if isinstance(gid, str) else []
        if len(parts) != 8 or not all(len(p) == 4 and _hex(p) for p in parts):
            raise ValueError(f"RDMA endpoint: gid must be 8 groups of 4 hex digits, "
                             f"got {gid!r}")
        if d["ring_bytes"] < 1 << 16:
            raise ValueError(f"RDMA endpoint: ring_bytes {d['ring_bytes']} < 64 KiB")
        return cls(**{f.name: d[f.name] for f in fields(cls)})


def _hex(s: str) -> bool:
    try:
        int(s, 16)
        return True
    except ValueError:
        return False


class Verbs(ABC):
    """The verbs an `RdmaChannel` uses, over its registered buffers: `send_buf` (the
    staging ring, mirrored offset for offset in the peer's receive ring), `recv_buf`
    (this end's receive ring) and `credit` (this end's credit word, written by the
    peer)."""

    send_buf: memoryview
    recv_buf: memoryview
    credit: memoryview  # one u64 ("Q")

    @abstractmethod
    def write_frame(self, off: int, n: int) -> None:
        """RDMA WRITE_WITH_IMM of send_buf[off:off + n] to the peer's ring at `off`,
        immediate n (posted; `wait_sent` waits for it)."""

    @abstractmethod
    def write_credit(self, consumed: int) -> None:
        """RDMA WRITE of `consumed` (u64) into the peer's credit word."""

    @abstractmethod
    def poll_frame(self, timeout_s: float | None) -> int:
        """The next frame's length (a WRITE_WITH_IMM completion), reposting its receive
        WR; `PeerTimeout` if none arrives within `timeout_s`."""

    @abstractmethod
    def wait_sent(self, timeout_s: float | None) -> None:
        """Until every posted write has completed; a failed one raises."""

    def close(self) -> None:  # noqa: B027
        pass


class RdmaChannel(Channel):
    """Frames over RDMA writes into the peer's ring (module docstring)."""

    def __init__(self, verbs: Verbs):
        self.v = verbs
        self.cap_out, self.cap_in = len(verbs.send_buf), len(verbs.recv_buf)
        self.pos_out = 0  # bytes placed in the peer's ring (skipped tails counted)
        self.pos_in = 0  # bytes consumed from this end's ring
        self.timeout_s: float | None = None
        self._credit = verbs.credit  # u64: how far the peer consumed

    def set_timeout(self, seconds: float | None) -> None:
        self.timeout_s = seconds

    def send(self, t, layer, step):
        self.send_many([(t, layer, step)])

    def stage(self, frames, wait: bool = True) -> list[tuple[int, int]]:
        """Copy each frame into the staging ring at its place -> (offset, length)s to
        write (`flush`). The ring is the only path, so it is always waited for (`wait`
        is ignored): the memory end that reads it (Python) reads on while it sends."""
        out = []
        for f in frames:
            head, payload = encode(*f)
            n = len(head) + len(payload)
            if n > self.cap_out:
                raise FrameError(f"a {n}-byte frame exceeds the {self.cap_out}-byte RDMA "
                                 f"ring (LAMINA_RDMA_RING_BYTES)")
            off, start = ring_place(self.pos_out, n, self.cap_out)
            self._wait_room(start + n)
            self.v.send_buf[off:off + len(head)] = head
            self.v.send_buf[off + len(head):off + n] = payload
            self.pos_out = start + n
            out.append((off, n))
        return out

    def flush(self, staged) -> None:
        for off, n in staged:
            self.v.write_frame(off, n)
        self.v.wait_sent(self.timeout_s)

    def send_many(self, frames) -> None:
        self.flush(self.stage(frames))

    def _wait_room(self, end: int) -> None:
        """Until the peer has consumed enough that a frame ending at cursor `end`
        overwrites nothing unread."""
        spins, t0 = 0, time.monotonic()
        while end - self._credit[0] > self.cap_out:
            spins += 1
            time.sleep(0 if spins < 100 else 1e-4)
            if self.timeout_s is not None and time.monotonic() - t0 > self.timeout_s:
                raise PeerTimeout(f"RDMA ring: the peer consumed nothing for "
                                  f"{self.timeout_s:g} s")

    def recv(self, **expect):
        n = self.v.poll_frame(self.timeout_s)
        off, start = ring_place(self.pos_in, n, self.cap_in)
        buf = self.v.recv_buf[off:off + n]
        h = parse_header(buf, "RDMA frame")
        if h.ndim & (IN_RING | IN_PEER):
            raise FrameError("RDMA frame says its payload is elsewhere (a shared-memory "
                             "ring or a collective path)")
        shape_end = HEADER.size + 8 * h.ndim
        if n < shape_end or n != shape_end + h.nbytes:
            raise FrameError(f"RDMA frame: {n} bytes written, its header says "
                             f"{shape_end + h.nbytes}")
        shape = struct.unpack_from(f"<{h.ndim}q", buf, HEADER.size)
        check(shape, h, **expect)
        out = torch.empty(shape, dtype=h.dtype)
        if h.nbytes:
            byte_view(out, h.nbytes)[:] = buf[shape_end:n]
        self.pos_in = start + n
        self.v.write_credit(self.pos_in)  # this much of the ring may be written again
        return out, h.layer, h.step

    def close(self) -> None:
        self.v.close()


class LoopbackVerbs(Verbs):
    """One end of an in-process pair (`pair`): a write lands in the peer's buffers and
    its immediate in the peer's completion queue, as RC delivers them (in order)."""

    def __init__(self, send_bytes: int, recv_bytes: int):
        self.send_buf = memoryview(bytearray(send_bytes))
        self.recv_buf = memoryview(bytearray(recv_bytes))
        self.credit = memoryview(bytearray(8)).cast("Q")
        self.peer: LoopbackVerbs | None = None
        self.completions: deque[int] = deque()
        self.writes = 0  # frames written (tests)

    @staticmethod
    def pair(ring_bytes: int) -> tuple[LoopbackVerbs, LoopbackVerbs]:
        a, b = LoopbackVerbs(ring_bytes, ring_bytes), LoopbackVerbs(ring_bytes, ring_bytes)
        a.peer, b.peer = b, a
        return a, b

    def write_frame(self, off, n):
        assert self.peer is not None
        self.peer.recv_buf[off:off + n] = self.send_buf[off:off + n]
        self.peer.completions.append(n)
        self.writes += 1

    def write_credit(self, consumed):
        assert self.peer is not None
        self.peer.credit[0] = consumed

    def poll_frame(self, timeout_s):
        t0 = time.monotonic()
        while not self.completions:
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise PeerTimeout(f"no RDMA frame from the peer within {timeout_s:g} s")
            time.sleep(1e-4)
        return self.completions.popleft()

    def wait_sent(self, timeout_s):
        pass


@dataclass(frozen=True)
class RdmaSupport:
    """Whether RDMA can carry the data plane here, and why not."""

    ok: bool
    devices: tuple[str, ...]
    why: str


def probe(sysfs: Path = SYSFS) -> RdmaSupport:
    """RDMA needs a device (`/sys/class/infiniband`, what ibv_get_device_list reads),
    pyverbs (`pip install lamina[rdma]`), and not `LAMINA_RDMA=0`."""
    import importlib.util

    devices = tuple(sorted(p.name for p in sysfs.iterdir())) if sysfs.is_dir() else ()
    missing = []
    if not devices:
        missing.append(f"no RDMA device ({sysfs} is {'empty' if sysfs.is_dir() else 'absent'})")
    if importlib.util.find_spec("pyverbs") is None:
        missing.append("pyverbs not installed (pip install lamina[rdma]; its source "
                       "builds rdma-core: cmake and a C toolchain)")
    if os.environ.get("LAMINA_RDMA", "1") == "0":
        missing.append("LAMINA_RDMA=0")
    if missing:
        return RdmaSupport(False, devices, "; ".join(missing))
    return RdmaSupport(True, devices, f"devices {', '.join(devices)}, pyverbs installed")


@dataclass(frozen=True)
class TransportChoice:
    # "unix+shm" | "unix" | "rdma" | "tcp"; with a collective path (the socket carries
    # the headers and metadata): "unix+nccl" | "tcp+nccl" | "unix+gloo" | "tcp+gloo"
    kind: str
    why: str


def choose_transport(same_node: bool, shm: bool, rdma: RdmaSupport,
                     collective: str | None = None) -> TransportChoice:
    """A compute / memory worker pair's transport: with a `collective` backend
    (`lamina.dataplane.collective.collective_backend`: NCCL where both ends are GPUs),
    tensors go on it and a Unix socket (co-located) or TCP carries the rest; else
    co-located, a Unix socket (with shared-memory rings where `shm`); on different hosts
    RDMA where it can run, else TCP. The reason is logged with the choice."""
    if collective is not None:
        base = "unix" if same_node else "tcp"
        where = "same node" if same_node else "different nodes"
        how = "GPU to GPU" if collective == "nccl" else "host tensors, LAMINA_COLLECTIVE=gloo"
        return TransportChoice(f"{base}+{collective}", f"{where}: tensors over {collective} "
                               f"({how}), the rest on a {base} socket")
    if same_node:
        if shm:
            return TransportChoice("unix+shm", "same node: a Unix socket as the doorbell, "
                                   "payloads in shared memory")
        return TransportChoice("unix", "same node, shared memory off: a Unix socket")
    if rdma.ok:
        return TransportChoice("rdma", f"different nodes, RDMA available ({rdma.why})")
    return TransportChoice("tcp", f"different nodes; not RDMA: {rdma.why}")


class PyverbsVerbs(Verbs):
    """`Verbs` on an RDMA device through pyverbs: one RC QP, one CQ per direction,
    three registered regions (staging ring, receive ring, credit word + its source).
    Not run in this project's CI (no device): `tests/lamina/test_rdma.py`'s loopback
    test runs it wherever a device is present."""

    def __init__(self, device: str | None = None, ring_bytes: int = RING_BYTES,
                 port: int = 1, gid_index: int = 0):
        import pyverbs.device as d
        import pyverbs.enums as e
        from pyverbs.cq import CQ
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        self.e, self.port, self.gid_index = e, port, gid_index
        name = device or d.get_device_list()[0].name.decode()
        self.ctx = d.Context(name=name)
        self.pd = PD(self.ctx)
        remote = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        self.send_mr = MR(self.pd, ring_bytes, e.IBV_ACCESS_LOCAL_WRITE)
        self.recv_mr = MR(self.pd, ring_bytes, remote)
        self.credit_mr = MR(self.pd, 16, remote)  # [0:8] written by the peer, [8:16] source
        self.send_cq = CQ(self.ctx, RECV_DEPTH * 2, None, None, 0)
        self.recv_cq = CQ(self.ctx, RECV_DEPTH * 2, None, None, 0)
        cap = QPCap(max_send_wr=RECV_DEPTH, max_recv_wr=RECV_DEPTH, max_send_sge=1,
                    max_recv_sge=1)
        init = QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.send_cq, rcq=self.recv_cq, cap=cap)
        attr = QPAttr(port_num=port)
        attr.qp_access_flags = remote
        self.qp = QP(self.pd, init, attr)
        self.psn = int.from_bytes(os.urandom(3), "little")
        self.send_buf = _mr_view(self.send_mr, 0, ring_bytes)
        self.recv_buf = _mr_view(self.recv_mr, 0, ring_bytes)
        self.credit = _mr_view(self.credit_mr, 0, 8).cast("Q")
        self._credit_src = _mr_view(self.credit_mr, 8, 8).cast("Q")
        self.peer: RdmaEndpoint | None = None
        self.posted = 0  # writes not yet completed

    def endpoint(self) -> RdmaEndpoint:
        port = self.ctx.query_port(self.port)
        gid = self.ctx.query_gid(self.port, self.gid_index).gid
        return RdmaEndpoint(self.qp.qp_num, self.psn, port.lid, gid,
                            256 << (port.active_mtu - 1), self.recv_mr.buf, self.recv_mr.rkey,
                            len(self.recv_buf), self.credit_mr.buf, self.credit_mr.rkey)

    def connect(self, peer: RdmaEndpoint) -> None:
        """Post the receive WRs, then INIT -> RTR -> RTS toward the peer's QP."""
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        if peer.ring_bytes != len(self.send_buf):
            raise ValueError(f"RDMA peer's ring is {peer.ring_bytes} bytes, this end "
                             f"stages {len(self.send_buf)}")
        for _ in range(RECV_DEPTH):
            self._post_recv()
        e = self.e
        attr = QPAttr(port_num=self.port)
        attr.path_mtu = {256: 1, 512: 2, 1024: 3, 2048: 4, 4096: 5}[peer.mtu]
        attr.dest_qp_num, attr.rq_psn, attr.sq_psn = peer.qp_num, peer.psn, self.psn
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        gr = GlobalRoute(dgid=GID(peer.gid), sgid_index=self.gid_index)
        attr.ah_attr = AHAttr(port_num=self.port, is_global=1, gr=gr, dlid=peer.lid)
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        self.qp.to_rts(attr)
        self.peer = peer

    def _post_recv(self) -> None:
        from pyverbs.wr import SGE, RecvWR

        # WRITE_WITH_IMM consumes a receive WR but writes nothing into its SGE
        self.qp.post_recv(RecvWR(num_sge=1, sg=[SGE(self.credit_mr.buf + 8, 1,
                                                    self.credit_mr.lkey)]))

    def write_frame(self, off, n):
        from pyverbs.wr import SGE, SendWR

        assert self.peer is not None
        wr = SendWR(opcode=self.e.IBV_WR_RDMA_WRITE_WITH_IMM, num_sge=1,
                    sg=[SGE(self.send_mr.buf + off, n, self.send_mr.lkey)],
                    imm_data=socket.htonl(n))
        wr.set_wr_rdma(self.peer.ring_rkey, self.peer.ring_addr + off)
        self.qp.post_send(wr)
        self.posted += 1

    def write_credit(self, consumed):
        from pyverbs.wr import SGE, SendWR

        assert self.peer is not None
        self._credit_src[0] = consumed
        wr = SendWR(opcode=self.e.IBV_WR_RDMA_WRITE, num_sge=1,
                    sg=[SGE(self.credit_mr.buf + 8, 8, self.credit_mr.lkey)])
        wr.set_wr_rdma(self.peer.credit_rkey, self.peer.credit_addr)
        self.qp.post_send(wr)
        self.posted += 1
        self.wait_sent(None)  # the source word is reused by the next credit

    def poll_frame(self, timeout_s):
        t0 = time.monotonic()
        while True:
            n, wcs = self.recv_cq.poll()
            if n:
                wc = wcs[0]
                if wc.status != self.e.IBV_WC_SUCCESS:
                    raise FrameError(f"RDMA receive completion failed: status {wc.status}")
                self._post_recv()
                return socket.ntohl(wc.imm_data)
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise PeerTimeout(f"no RDMA frame from the peer within {timeout_s:g} s")

    def wait_sent(self, timeout_s):
        t0 = time.monotonic()
        while self.posted:
            n, wcs = self.send_cq.poll(num_entries=self.posted)
            for wc in wcs[:n]:
                if wc.status != self.e.IBV_WC_SUCCESS:
                    raise FrameError(f"RDMA write failed: completion status {wc.status}")
            self.posted -= n
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise PeerTimeout(f"RDMA writes not completed within {timeout_s:g} s")

    def close(self) -> None:
        self.ctx.close()


def _mr_view(mr, offset: int, n: int) -> memoryview:
    """A writable view of a registered region's bytes (no copy)."""
    import ctypes

    return memoryview((ctypes.c_char * n).from_address(mr.buf + offset)).cast("B")
