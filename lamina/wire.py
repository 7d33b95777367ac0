"""Data-plane frames: one tensor per frame, a fixed binary header then raw bytes.

Data in: tensors a compute or memory worker sends for one layer of one step (q/k/v one
way, attention outputs the other). Data out: the same tensors on the other side, after
validation. No pickle: a frame is

    magic "LMNA" | version u16 | ndim u8 | dtype u8 | layer i32 | step i64 |
    nbytes u64 | shape ndim x i64 | payload (nbytes raw bytes, C order)

all little-endian. `decode` checks every field (and the layer, step and shape the
receiver expects) and raises `FrameError` naming what is wrong; nothing malformed
reaches the math. `SocketChannel` carries frames over a connected stream socket
(TCP between hosts, a Unix socket when co-located); an RDMA channel implements the
same `Channel` interface.
"""
from __future__ import annotations

import socket
import struct
from abc import ABC, abstractmethod

import torch

MAGIC, VERSION = b"LMNA", 1
HEADER = struct.Struct("<4sHBBiqQ")  # magic, version, ndim, dtype, layer, step, nbytes
MAX_NDIM = 8
DTYPES = {1: torch.float32, 2: torch.bfloat16, 3: torch.float16, 4: torch.int32,
          5: torch.int64, 6: torch.uint8}
CODES = {v: k for k, v in DTYPES.items()}


class FrameError(ValueError):
    """A data-plane frame failed validation; its step must not be computed."""


def encode(t: torch.Tensor, layer: int, step: int) -> list:
    """-> [header bytes, payload memoryview] (send both, in order; no copy of the data)."""
    if t.dtype not in CODES:
        raise FrameError(f"cannot send dtype {t.dtype}")
    if t.dim() > MAX_NDIM:
        raise FrameError(f"cannot send a {t.dim()}-D tensor (max {MAX_NDIM})")
    t = t.detach().contiguous().cpu()
    payload = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
    head = HEADER.pack(MAGIC, VERSION, t.dim(), CODES[t.dtype], layer, step,
                       t.numel() * t.element_size())
    return [head + struct.pack(f"<{t.dim()}q", *t.shape), memoryview(payload)]


def parse_header(buf: bytes, what: str = "frame"):
    """-> (ndim, dtype, layer, step, nbytes) after checking magic/version/dtype/ndim."""
    if len(buf) < HEADER.size:
        raise FrameError(f"{what} truncated: {len(buf)} of {HEADER.size} header bytes")
    magic, ver, ndim, code, layer, step, nbytes = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise FrameError(f"{what}: bad magic {magic!r} (expected {MAGIC!r})")
    if ver != VERSION:
        raise FrameError(f"{what}: version {ver}, this side speaks {VERSION}")
    if code not in DTYPES:
        raise FrameError(f"{what}: unknown dtype code {code}")
    if ndim > MAX_NDIM:
        raise FrameError(f"{what}: {ndim} dims (max {MAX_NDIM})")
    return ndim, DTYPES[code], layer, step, nbytes


def check(shape, dtype, layer, step, nbytes, expect_layer=None, expect_step=None,
          expect_shape=None, expect_dtype=None, what="frame"):
    if any(d < 0 for d in shape):
        raise FrameError(f"{what}: negative dimension in shape {tuple(shape)}")
    n = 1
    for d in shape:
        n *= d
    if n * torch.empty((), dtype=dtype).element_size() != nbytes:
        raise FrameError(f"{what}: shape {tuple(shape)} of {dtype} needs "
                         f"{n * torch.empty((), dtype=dtype).element_size()} bytes, header says "
                         f"{nbytes}")
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
    ndim, dtype, layer, step, nbytes = parse_header(buf)
    off = HEADER.size + 8 * ndim
    if len(buf) < off:
        raise FrameError(f"frame truncated in its shape: {len(buf)} of {off} bytes")
    shape = struct.unpack_from(f"<{ndim}q", buf, HEADER.size)
    check(shape, dtype, layer, step, nbytes, **expect)
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

    def close(self) -> None:  # noqa: B027
        pass


class SocketChannel(Channel):
    """Frames over a connected stream socket; payloads land directly in the tensor."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def send(self, t, layer, step):
        self.send_many([(t, layer, step)])

    def send_many(self, frames) -> None:
        """Several frames in one gather write (one wake-up for the peer, not one each)."""
        views = [memoryview(b).cast("B") for f in frames for b in encode(*f) if len(b)]
        while views:
            n = self.sock.sendmsg(views)
            while n:  # drop what went out; a partial write resumes mid-buffer
                if n >= len(views[0]):
                    n -= len(views.pop(0))
                else:
                    views[0], n = views[0][n:], 0

    def _read_into(self, view: memoryview, what: str) -> None:
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise FrameError(f"{what} truncated: peer closed after {got} of {len(view)} "
                                 f"bytes")
            got += n

    def recv(self, **expect):
        head = bytearray(HEADER.size)
        self._read_into(memoryview(head), "frame header")
        ndim, dtype, layer, step, nbytes = parse_header(bytes(head))
        shape_b = bytearray(8 * ndim)
        self._read_into(memoryview(shape_b), "frame shape")
        shape = struct.unpack(f"<{ndim}q", shape_b)
        check(shape, dtype, layer, step, nbytes, **expect)
        out = torch.empty(shape, dtype=dtype)
        if nbytes:
            self._read_into(memoryview(out.reshape(-1).view(torch.uint8).numpy()),
                            "frame payload")
        return out, layer, step

    def close(self):
        self.sock.close()
