"""Data-plane frames: one tensor per frame, a fixed binary header then raw bytes.

Data in: tensors a compute or memory worker sends for one layer of one step (q/k/v one
way, attention outputs the other). Data out: the same tensors on the other side, after
validation. No pickle: a frame is

    magic "LMNA" | version u16 | ndim u8 | dtype u8 | layer i32 | step i64 |
    nbytes u64 | shape ndim x i64 | payload (nbytes raw bytes, C order)

all little-endian. Bit 7 of the ndim byte (`IN_RING`) says the payload is not on the
stream but in the sender's shared-memory ring (`ShmRing`): co-located workers send
only headers over the Unix socket (the doorbell) and the bytes through shared memory.
Bit 6 (`IN_PEER`) says it comes as a torch.distributed point-to-point send
(`lamina.dataplane.collective`: NCCL from GPU to GPU; gloo on CPU).
`decode` checks every field (and the layer, step and shape the receiver expects) and
raises `FrameError` naming what is wrong; nothing malformed reaches the math.
`SocketChannel` carries frames over a connected stream socket (TCP between hosts, a Unix
socket when co-located); an RDMA channel implements the same `Channel` interface.
"""
from __future__ import annotations

import os
import socket
import struct
import tempfile
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

MAGIC, VERSION = b"LMNA", 1
HEADER = struct.Struct("<4sHBBiqQ")  # magic, version, ndim, dtype, layer, step, nbytes
MAX_NDIM = 8
IN_RING = 0x80  # ndim flag: payload in the shared-memory ring
IN_PEER = 0x40  # ndim flag: payload sent on the channel's collective path
NDIM = 0x3F  # the ndim byte's dimension count, without the flags
RECV_BUF = 1 << 18  # receive buffer of a SocketChannel
DTYPES = {1: torch.float32, 2: torch.bfloat16, 3: torch.float16, 4: torch.int32,
          5: torch.int64, 6: torch.uint8}
CODES = {v: k for k, v in DTYPES.items()}
ITEMSIZE = {t: t.itemsize for t in DTYPES.values()}


class FrameError(ValueError):
    """A data-plane frame failed validation; its step must not be computed."""


class PeerTimeout(TimeoutError):
    """The peer did not answer (or read) within the channel's timeout: it is hung."""


def encode(t: torch.Tensor, layer: int, step: int) -> list:
    """-> [header bytes, payload memoryview] (send both, in order; no copy of the data).
    Runs for every frame, so plain attribute checks and one numpy view: ~5 us here,
    against 17 for the reshape/view/numpy chain it replaced."""
    head = frame_header(t, layer, step)
    if t.requires_grad:
        t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    return [head, byte_view(t, t.numel() * t.element_size())]


def frame_header(t: torch.Tensor, layer: int, step: int, flags: int = 0) -> bytes:
    """The header (and shape) of `t`'s frame, `flags` in its ndim byte; `t` may be on
    any device (its bytes are not touched)."""
    if t.dtype not in CODES:
        raise FrameError(f"cannot send dtype {t.dtype}")
    if t.dim() > MAX_NDIM:
        raise FrameError(f"cannot send a {t.dim()}-D tensor (max {MAX_NDIM})")
    nbytes = t.numel() * t.element_size()
    head = HEADER.pack(MAGIC, VERSION, t.dim() | flags, CODES[t.dtype], layer, step, nbytes)
    return head + struct.pack(f"<{t.dim()}q", *t.shape)


def byte_view(t: torch.Tensor, nbytes: int) -> memoryview:
    """A contiguous CPU tensor's bytes, writable, without a copy."""
    if not nbytes:
        return memoryview(b"")
    flat = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # numpy has no bf16
    return memoryview(flat.numpy()).cast("B", (nbytes,))


def shm_enabled() -> bool:
    """Whether co-located workers put payloads in shared memory (`LAMINA_SHM`, default
    on, where /dev/shm exists)."""
    return os.environ.get("LAMINA_SHM", "1") != "0" and os.path.isdir("/dev/shm")


@dataclass(frozen=True)
class FrameHeader:
    """A frame's fixed header, checked (magic, version, dtype code, ndim)."""

    ndim: int  # may carry the IN_RING or IN_PEER flag
    dtype: torch.dtype
    layer: int
    step: int
    nbytes: int  # payload bytes


def parse_header(buf: bytes, what: str = "frame") -> FrameHeader:
    """The header at the start of `buf`, after checking magic/version/dtype/ndim."""
    if len(buf) < HEADER.size:
        raise FrameError(f"{what} truncated: {len(buf)} of {HEADER.size} header bytes")
    magic, ver, ndim, code, layer, step, nbytes = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise FrameError(f"{what}: bad magic {magic!r} (expected {MAGIC!r})")
    if ver != VERSION:
        raise FrameError(f"{what}: version {ver}, this side speaks {VERSION}")
    if code not in DTYPES:
        raise FrameError(f"{what}: unknown dtype code {code}")
    if ndim & NDIM > MAX_NDIM:
        raise FrameError(f"{what}: {ndim & NDIM} dims (max {MAX_NDIM})")
    if ndim & IN_RING and ndim & IN_PEER:
        raise FrameError(f"{what}: its payload cannot be both in a ring and on a peer path")
    return FrameHeader(ndim, DTYPES[code], layer, step, nbytes)


def check(shape, h: FrameHeader, expect_layer=None, expect_step=None, expect_shape=None,
          expect_dtype=None, what="frame"):
    """The frame's shape and header against its payload size and what the reader
    expects; a mismatch is a `FrameError` naming it."""
    dtype, layer, step, nbytes = h.dtype, h.layer, h.step, h.nbytes
    if any(d < 0 for d in shape):
        raise FrameError(f"{what}: negative dimension in shape {tuple(shape)}")
    n = 1
    for d in shape:
        n *= d
    if n * ITEMSIZE[dtype] != nbytes:
        raise FrameError(f"{what}: shape {tuple(shape)} of {dtype} needs "
                         f"{n * ITEMSIZE[dtype]} bytes, header says {nbytes}")
    if expect_layer is not None and layer != expect_layer:
        raise FrameError(f"{what}: layer {layer}, expected {expect_layer}")
    if expect_step is not None and step != expect_step:
        raise FrameError(f"{what}: step {step}, expected {expect_step}")
    if expect_shape is not None and tuple(shape) != tuple(expect_shape):
        raise FrameError(f"{what}: shape {tuple(shape)}, expected {tuple(expect_shape)}")
    if expect_dtype is not None and dtype != expect_dtype:
        raise FrameError(f"{what}: dtype {dtype}, expected {expect_dtype}")


def decode(buf: bytes, **expect) -> tuple[torch.Tensor, int, int]:
    """A whole frame in memory -> (tensor, layer, step)."""
    h = parse_header(buf)
    ndim, dtype, layer, step, nbytes = h.ndim, h.dtype, h.layer, h.step, h.nbytes
    if ndim & IN_RING:
        raise FrameError("frame says its payload is in a shared-memory ring; none here")
    if ndim & IN_PEER:
        raise FrameError("frame says its payload comes on a collective path; none here")
    off = HEADER.size + 8 * ndim
    if len(buf) < off:
        raise FrameError(f"frame truncated in its shape: {len(buf)} of {off} bytes")
    shape = struct.unpack_from(f"<{ndim}q", buf, HEADER.size)
    check(shape, h, **expect)
    if len(buf) != off + nbytes:
        raise FrameError(f"frame has {len(buf) - off} payload bytes, header says {nbytes}"
                         + (" (truncated)" if len(buf) < off + nbytes else ""))
    data = bytearray(buf[off:])
    t = torch.frombuffer(data, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
    return t.view(dtype).reshape(shape), layer, step


class Channel(ABC):
    @abstractmethod
    def send(self, t: torch.Tensor, layer: int, step: int) -> None: ...

    @abstractmethod
    def recv(self, **expect) -> tuple[torch.Tensor, int, int]: ...

    def send_many(self, frames) -> None:
        for f in frames:
            self.send(*f)

    def stage(self, frames, wait: bool = True):
        """Prepare frames for `flush` (encode, copy payloads out), so a sender serving
        several peers can wake them all back to back: waking one first can cost the
        sender its core before it has served the next. `wait` False: do not wait for
        room in a shared ring where another path exists (`SocketChannel`)."""
        return list(frames)

    def flush(self, staged) -> None:
        self.send_many(staged)

    def close(self) -> None:  # noqa: B027
        pass


def ring_place(pos: int, n: int, cap: int) -> tuple[int, int]:
    """Where a frame of n bytes goes in a ring of `cap` bytes whose cursor (bytes
    written since the start, counting skipped tails) is `pos` -> (offset, cursor of the
    frame's start). A frame that would not fit before the end starts over at 0: the
    tail is skipped, so every frame is one contiguous run (one copy, one RDMA write).
    Shared-memory rings and RDMA rings place by it on both ends."""
    if not 0 < n <= cap:
        raise ValueError(f"a {n}-byte frame does not fit a {cap}-byte ring")
    off = pos % cap
    if off + n > cap:
        return 0, pos + cap - off
    return off, pos


class ShmRing:
    """One direction of a shared-memory byte ring: a file in /dev/shm mapped by both
    processes. Layout: [consumed u64 | pad to 64][capacity bytes]. The writer appends
    payloads at its cursor (jumping to the start when one would not fit before the end),
    waiting while the reader is a full ring behind; the reader copies each payload out
    and publishes how far it has consumed. Both sides apply the same jump rule to the
    same frame sizes, so no offsets travel."""

    CTRL = 64
    # Below this a payload goes inline on the socket: measured here, decode-sized frames
    # (~40 KB at B=32) were no faster through the ring than through the kernel's copy.
    MIN_BYTES = 64 << 10

    def __init__(self, path: str, capacity: int, create: bool, min_bytes: int = MIN_BYTES):
        import mmap
        import os

        self.path, self.cap, self.pos, self.min_bytes = path, capacity, 0, min_bytes
        self.timeout_s: float | None = None  # how long `write` waits for the reader
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, self.CTRL + capacity)
            self.mm = mmap.mmap(fd, self.CTRL + capacity)
        finally:
            os.close(fd)
        self.data = torch.frombuffer(self.mm, dtype=torch.uint8, offset=self.CTRL,
                                     count=capacity)
        self._ctrl = memoryview(self.mm)[:8].cast("Q")
        self.ctrl = torch.frombuffer(self.mm, dtype=torch.int64, count=1)  # for C++ ends

    def fits(self, nbytes: int) -> bool:
        return self.min_bytes <= nbytes <= self.cap // 2

    def has_room(self, nbytes: int) -> bool:
        """Whether `write` would find room for it now (without waiting for the reader)."""
        return ring_place(self.pos, nbytes, self.cap)[1] + nbytes - self._ctrl[0] <= self.cap

    def _place(self, n: int) -> int:
        off, self.pos = ring_place(self.pos, n, self.cap)
        return off

    def write(self, t: torch.Tensor) -> None:
        src = t.reshape(-1).view(torch.uint8)
        n = src.numel()
        spins, t0 = 0, time.monotonic()
        while not self.has_room(n):  # reader a full ring behind
            spins += 1
            time.sleep(0 if spins < 100 else 1e-4)
            if self.timeout_s is not None and time.monotonic() - t0 > self.timeout_s:
                raise PeerTimeout(f"shared-memory ring {self.path}: the peer read nothing "
                                  f"for {self.timeout_s:g} s")
        off = self._place(n)
        self.data[off:off + n].copy_(src)
        self.pos += n

    def read_into(self, out: torch.Tensor) -> None:
        dst = out.reshape(-1).view(torch.uint8)
        n = dst.numel()
        off = self._place(n)
        dst.copy_(self.data[off:off + n])
        self.pos += n
        self._ctrl[0] = self.pos  # this much may now be overwritten

    def unlink(self) -> None:
        import os

        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self._ctrl.release()
        del self.data, self.ctrl
        try:
            self.mm.close()
        except BufferError:  # a tensor still views it; the OS unmaps at exit
            pass


class SocketChannel(Channel):
    """Frames over a connected stream socket, read through a buffer (one syscall for a
    burst of small frames); big payloads land directly in their tensor. With rings
    (co-located peers) payloads go through shared memory and the socket carries only
    the headers. With a `peer` path (`lamina.dataplane.collective.PeerPath`) the float
    tensors on its device go as point-to-point sends (GPU to GPU under NCCL), each
    after its header; the rest stays on the socket."""

    def __init__(self, sock: socket.socket, ring_out: ShmRing | None = None,
                 ring_in: ShmRing | None = None, peer=None):
        self.sock, self.ring_out, self.ring_in, self.peer = sock, ring_out, ring_in, peer
        self._rbuf = bytearray(RECV_BUF)  # received bytes not yet parsed: [_lo, _hi)
        self._rview, self._lo, self._hi = memoryview(self._rbuf), 0, 0
        self._to_peer: list[torch.Tensor] = []  # staged payloads of the peer path

    @property
    def bytes_only(self) -> bool:
        """Whether every payload is bytes on the socket or in a ring: what the C++ ends
        read (a peer path's payloads are not)."""
        return self.peer is None

    def set_timeout(self, seconds: float | None) -> None:
        """Sends and receives (and ring writes) that wait longer than this raise
        `PeerTimeout`; None waits forever."""
        self.sock.settimeout(seconds)
        if self.ring_out is not None:
            self.ring_out.timeout_s = seconds
        if self.peer is not None:
            self.peer.set_timeout(seconds)

    def _recv_into(self, view, what: str) -> int:
        try:
            return self.sock.recv_into(view)
        except TimeoutError:
            raise PeerTimeout(f"no {what} from the peer within {self.sock.gettimeout():g} "
                              f"s") from None

    def send(self, t, layer, step):
        self.send_many([(t, layer, step)])

    def send_many(self, frames) -> None:
        """Several frames in one gather write (one wake-up for the peer, not one each)."""
        self.flush(self.stage(frames))

    def stage(self, frames, wait: bool = True) -> list:
        """Encode the frames and put ring payloads in the ring; the socket write (the
        peer's wake-up) is left to `flush`. `wait` False: a payload that finds the ring
        full goes on the socket instead of waiting for the reader (a streamed step's
        peer may wait for its own send before it reads the ring). A peer path's
        payloads are posted by `flush`, after their headers."""
        views = []
        for f in frames:
            if self.peer is not None and self.peer.takes(f[0]):
                views.append(memoryview(frame_header(*f, flags=IN_PEER)))
                self._to_peer.append(f[0])
                continue
            head, payload = encode(*f)
            ring = self.ring_out
            if (ring is not None and len(payload) and ring.fits(len(payload))
                    and (wait or ring.has_room(len(payload)))):
                self.ring_out.write(torch.frombuffer(payload, dtype=torch.uint8))  # encoded
                head = bytearray(head)
                head[6] |= IN_RING
                payload = b""
            views += [memoryview(b).cast("B") for b in (head, payload) if len(b)]
        return views

    def flush(self, views: list) -> None:
        """One gather write of staged frames, then the peer path's payloads (NCCL pairs
        a send with the receive the reader posts once it has the header)."""
        views = list(views)
        while views:
            try:
                n = self.sock.sendmsg(views)
            except TimeoutError:
                raise PeerTimeout(f"the peer took nothing for {self.sock.gettimeout():g} s "
                                  f"(send)") from None
            while n:  # drop what went out; a partial write resumes mid-buffer
                if n >= len(views[0]):
                    n -= len(views.pop(0))
                else:
                    views[0], n = views[0][n:], 0
        staged, self._to_peer = self._to_peer, []
        for t in staged:
            self.peer.send(t)

    def _fill(self, need: int, what: str, done: int = 0) -> None:
        """Read until `need` (<= RECV_BUF) bytes are buffered: one syscall brings a whole
        burst of small frames (a layer's q/k/v) at once. `done`: bytes of this item
        already taken (for the error message)."""
        if self._hi - self._lo >= need:
            return
        if len(self._rbuf) - self._lo < need:  # move the tail to the front
            n = self._hi - self._lo
            self._rbuf[:n] = self._rbuf[self._lo:self._hi]
            self._lo, self._hi = 0, n
        while self._hi - self._lo < need:
            n = self._recv_into(self._rview[self._hi:], what)
            if n == 0:
                raise FrameError(f"{what} truncated: peer closed after "
                                 f"{done + self._hi - self._lo} of {done + need} bytes")
            self._hi += n

    def _read_into(self, view: memoryview, what: str) -> None:
        """Fill `view`: buffered bytes first; a small rest through the buffer, a big one
        straight from the socket into `view` (no extra copy)."""
        got = min(len(view), self._hi - self._lo)
        view[:got] = self._rview[self._lo:self._lo + got]
        self._lo += got
        rest = len(view) - got
        if rest and rest <= RECV_BUF // 4:
            self._fill(rest, what, got)
            view[got:] = self._rview[self._lo:self._lo + rest]
            self._lo += rest
            return
        while got < len(view):
            n = self._recv_into(view[got:], what)
            if n == 0:
                raise FrameError(f"{what} truncated: peer closed after {got} of {len(view)} "
                                 f"bytes")
            got += n

    def take_pending(self) -> bytes:
        """The received bytes not yet parsed, removed from the buffer (a C++ end
        continues from them: `lamina.dataplane.protocol.MemoryServer`'s fast path)."""
        out = bytes(self._rview[self._lo:self._hi])
        self._lo = self._hi = 0
        return out

    def buffered(self) -> int:
        """Received bytes not yet parsed."""
        return self._hi - self._lo

    def timeout_ms(self) -> int:
        t = self.sock.gettimeout()
        return -1 if t is None else max(1, int(t * 1000))

    def recv(self, **expect):
        self._fill(HEADER.size, "frame header")
        h = parse_header(self._rview[self._lo:self._lo + HEADER.size])
        in_ring, in_peer, ndim = bool(h.ndim & IN_RING), bool(h.ndim & IN_PEER), h.ndim & NDIM
        nbytes = h.nbytes
        if in_ring and self.ring_in is None:
            raise FrameError("frame says its payload is in a shared-memory ring; this "
                             "channel has none")
        if in_peer and self.peer is None:
            raise FrameError("frame says its payload comes on a collective path; this "
                             "channel has none")
        self._fill(HEADER.size + 8 * ndim, "frame shape")
        shape = struct.unpack_from(f"<{ndim}q", self._rbuf, self._lo + HEADER.size)
        self._lo += HEADER.size + 8 * ndim
        check(shape, h, **expect)
        if in_peer:
            out = torch.empty(shape, dtype=h.dtype, device=self.peer.device)
            if nbytes:
                self.peer.recv_into(out)
            return out, h.layer, h.step
        out = torch.empty(shape, dtype=h.dtype)
        if nbytes and in_ring:
            self.ring_in.read_into(out)
        elif nbytes:
            self._read_into(byte_view(out, nbytes), "frame payload")
        return out, h.layer, h.step

    def close(self):
        self.sock.close()
        for r in (self.ring_out, self.ring_in, self.peer):
            if r is not None:
                r.close()


def listen_stream(unix: bool, host: str, name: str) -> tuple[socket.socket, tuple]:
    """A listening stream socket for one peer -> (socket, ("unix", path) or ("tcp",
    host, port)): a Unix socket in a fresh temp dir when co-located, else TCP on `host`."""
    if unix:
        path = os.path.join(tempfile.mkdtemp(prefix="lamina-"), f"{name}.sock")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        addr = ("unix", path)
    else:
        srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        srv.bind((host, 0))
        addr = ("tcp", *srv.getsockname())
    srv.listen(1)
    return srv, addr


def shut(sock: socket.socket | None) -> None:
    """Shut a socket down both ways (None: nothing), waking a thread blocked reading,
    writing or accepting on it; closing it would not. Already shut or closed: nothing."""
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def close_endpoint(srv: socket.socket) -> None:
    """A `listen_stream` socket shut (waking an `accept` still waiting: EINVAL on Linux),
    closed, and its Unix socket file and the folder made for it removed. A second call
    does nothing."""
    if srv.fileno() < 0:
        return
    path = srv.getsockname() if srv.family == socket.AF_UNIX else None
    shut(srv)
    srv.close()
    if path:
        try:
            os.remove(path)
            os.rmdir(os.path.dirname(path))
        except OSError:
            pass


def nodelay(conn: socket.socket) -> socket.socket:
    """TCP sockets send small frames at once (no Nagle delay); Unix ones as they are."""
    if conn.family == socket.AF_INET:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def connect_stream(kind: str, where) -> socket.socket:
    """The client end of `listen_stream`'s address: kind "unix" (where = path) or "tcp"
    (where = (host, port))."""
    if kind == "unix":
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(where)
        return s
    return nodelay(socket.create_connection(tuple(where)))
