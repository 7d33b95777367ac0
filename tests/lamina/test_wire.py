"""Data-plane frames: round trips, and every malformed frame rejected with a clear error."""
import socket
import struct

import pytest
import torch

from lamina.wire import HEADER, FrameError, SocketChannel, decode, encode


def frame(t, layer=3, step=7):
    head, payload = encode(t, layer, step)
    return head + bytes(payload)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32,
                                   torch.int64, torch.uint8])
def test_round_trip(dtype):
    t = (torch.randn(4, 3, 5) * 10).to(dtype)
    out, layer, step = decode(frame(t[:, 1]), expect_layer=3, expect_step=7, expect_shape=(4, 5))
    assert (layer, step) == (3, 7) and out.dtype == dtype and torch.equal(out, t[:, 1])


def test_empty_and_scalar():
    assert decode(frame(torch.zeros(0, 9)))[0].shape == (0, 9)
    assert decode(frame(torch.tensor(2.5)))[0].item() == 2.5


def corrupt(buf: bytes, offset: int, fmt: str, value) -> bytes:
    b = bytearray(buf)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


GOOD = frame(torch.ones(2, 3))


@pytest.mark.parametrize("buf,kw,msg", [
    (b"XXXX" + GOOD[4:], {}, "bad magic"),
    (corrupt(GOOD, 4, "<H", 9), {}, "version 9"),
    (corrupt(GOOD, 7, "<B", 77), {}, "unknown dtype code 77"),
    (corrupt(GOOD, 6, "<B", 12), {}, "12 dims"),
    (corrupt(GOOD, 20, "<Q", 25), {}, "needs 24 bytes, header says 25"),
    (GOOD[:10], {}, "truncated: 10 of"),
    (GOOD[:HEADER.size + 4], {}, "truncated in its shape"),
    (GOOD[:-1], {}, "truncated"),
    (GOOD + b"\0", {}, "payload bytes"),
    (GOOD, {"expect_shape": (3, 2)}, r"shape \(2, 3\), expected \(3, 2\)"),
    (GOOD, {"expect_layer": 4}, "layer 3, expected 4"),
    (GOOD, {"expect_step": 8}, "step 7, expected 8"),
    (GOOD, {"expect_dtype": torch.bfloat16}, "dtype torch.float32, expected"),
])
def test_malformed_frames_rejected(buf, kw, msg):
    with pytest.raises(FrameError, match=msg):
        decode(buf, **kw)


def test_socket_channel_round_trip_and_truncation():
    a, b = socket.socketpair()
    tx, rx = SocketChannel(a), SocketChannel(b)
    q = torch.randn(5, 9, 64)
    tx.send(q, layer=2, step=11)
    tx.send(q.bfloat16(), layer=2, step=11)
    out, layer, step = rx.recv(expect_shape=(5, 9, 64), expect_layer=2)
    assert torch.equal(out, q) and (layer, step) == (2, 11)
    assert torch.equal(rx.recv(expect_dtype=torch.bfloat16)[0], q.bfloat16())
    head, payload = encode(q, 0, 0)
    a.sendall(head + bytes(payload)[:100])  # peer dies mid-frame
    tx.close()
    with pytest.raises(FrameError, match="payload truncated: peer closed after 100"):
        rx.recv()
    rx.close()


def test_socket_channel_rejects_wrong_shape_before_reading_payload():
    a, b = socket.socketpair()
    SocketChannel(a).send(torch.ones(2, 2), 0, 0)
    with pytest.raises(FrameError, match="expected"):
        SocketChannel(b).recv(expect_shape=(4,))
    a.close()
    b.close()


def test_send_many_survives_partial_writes():
    """Frames far larger than the socket buffer: the gather write goes out in pieces and
    resumes mid-buffer; the reader sees every byte in order."""
    import threading

    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    tx, rx = SocketChannel(a), SocketChannel(b)
    frames = [(torch.randn(4096, 9, 64), 0, 1), (torch.arange(7, dtype=torch.int32), 0, 1),
              (torch.randn(3, 3).bfloat16(), 1, 1)]
    got = []
    reader = threading.Thread(target=lambda: got.extend(rx.recv() for _ in frames))
    reader.start()
    tx.send_many(frames)
    reader.join(30)
    assert [(layer, step) for _, layer, step in got] == [(0, 1), (0, 1), (1, 1)]
    assert all(torch.equal(g[0], f[0]) for g, f in zip(got, frames))
    tx.close()
    rx.close()
