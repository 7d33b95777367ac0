"""Data-plane frames: round trips, and every malformed frame rejected with a clear error."""
import socket
import struct

import pytest
import torch

from lamina.dataplane.transport import HEADER, FrameError, SocketChannel, decode, encode


def frame(t, layer=3, step=7):
    head, payload = encode(t, layer, step)
    return head + bytes(payload)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int32,
                                   torch.int64, torch.uint8])
def test_round_trip(dtype):
    t = (torch.randn(4, 3, 5) * 10).to(dtype)
    out, layer, step = decode(frame(t[:, 1]), expect_layer=3, expect_step=7, expect_shape=(4, 5))
    assert (layer, step) == (3, 7) and out.dtype == dtype and torch.equal(out, t[:, 1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_socket_channel_round_trips_each_dtype(dtype):
    a, b = socket.socketpair()
    t = (torch.randn(6, 2, 3) * 10).to(dtype)
    w = torch.randn(2, 2, requires_grad=True)  # sent as its values
    SocketChannel(a).send_many([(t.transpose(0, 1), 1, 2), (w, 1, 2)])
    rx = SocketChannel(b)
    out = rx.recv(expect_shape=(2, 6, 3), expect_dtype=dtype)[0]
    assert torch.equal(out, t.transpose(0, 1)) and torch.equal(rx.recv()[0], w.detach())


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


def _ring_pair(tmp_path, cap):
    from lamina.dataplane.transport import ShmRing

    a, b = socket.socketpair()
    out_w = ShmRing(str(tmp_path / "ab"), cap, create=True, min_bytes=0)
    back_w = ShmRing(str(tmp_path / "ba"), cap, create=True, min_bytes=0)
    tx = SocketChannel(a, ring_out=out_w, ring_in=back_w)
    rx = SocketChannel(b, ring_out=ShmRing(str(tmp_path / "ba"), cap, create=False),
                       ring_in=ShmRing(str(tmp_path / "ab"), cap, create=False))
    return tx, rx, a


def test_shared_memory_ring_channel_round_trips_and_wraps(tmp_path):
    """Payloads through the rings (many frames, so the cursors wrap several times and the
    writer waits for the reader); big payloads inline; headers validated as ever."""
    import threading

    tx, rx, a = _ring_pair(tmp_path, cap=4096)
    frames = [torch.randn(n, 3) for n in (1, 7, 50, 100, 33, 2, 300)] * 6  # up to 1.2 KB
    frames.append(torch.randn(700, 3))  # 8.4 KB > cap / 2: goes inline on the socket
    got = []
    reader = threading.Thread(target=lambda: got.extend(
        rx.recv(expect_layer=i % 5, expect_step=9)[0] for i in range(len(frames))))
    reader.start()
    for i, f in enumerate(frames):
        tx.send_many([(f, i % 5, 9)])
    reader.join(30)
    assert len(got) == len(frames) and all(torch.equal(x, y) for x, y in zip(got, frames))
    assert tx.ring_out.pos > 3 * 4096  # it did wrap
    # a header claiming a ring payload on a channel without rings is rejected
    head, _ = encode(torch.ones(2), 0, 0)
    head = bytearray(head)
    head[6] |= 0x80
    c, d = socket.socketpair()
    c.sendall(bytes(head))
    with pytest.raises(FrameError, match="shared-memory ring; this channel has none"):
        SocketChannel(d).recv()
    # wrong shape still caught before the payload is touched
    tx.send(torch.ones(2, 2), 0, 0)
    with pytest.raises(FrameError, match="expected"):
        rx.recv(expect_shape=(4,))
    for ch in (tx, rx):
        ch.close()


def test_silent_peer_times_out(tmp_path):
    """A hung peer: a receive with nothing coming, a send it never drains, and a ring
    write it never makes room for each raise PeerTimeout after the channel's timeout."""
    import time

    from lamina.dataplane.transport import PeerTimeout

    a, b = socket.socketpair()
    tx = SocketChannel(a)
    tx.set_timeout(0.2)
    t = time.monotonic()
    with pytest.raises(PeerTimeout, match=r"no frame header from the peer within 0.2 s"):
        tx.recv()
    assert 0.15 < time.monotonic() - t < 5
    b.sendall(encode(torch.ones(4), 1, 1)[0])  # a header, no payload: that times out too
    with pytest.raises(PeerTimeout, match="frame payload"):
        tx.recv()
    with pytest.raises(PeerTimeout, match=r"took nothing for 0.2 s"):
        for _ in range(10_000):  # fills both socket buffers: b never reads
            tx.send(torch.ones(16_384), 0, 0)

    ring_tx, _, _ = _ring_pair(tmp_path, cap=4096)
    ring_tx.set_timeout(0.2)
    with pytest.raises(PeerTimeout, match="read nothing for 0.2 s"):
        for _ in range(10):  # 1.6 KB each, the reader never consumes
            ring_tx.ring_out.write(torch.ones(400))
    ring_tx.set_timeout(None)
    assert ring_tx.sock.gettimeout() is None and ring_tx.ring_out.timeout_s is None
    for s in (a, b):
        s.close()


def test_stage_wakes_no_peer_until_flush(tmp_path):
    """`stage` puts ring payloads in the ring but writes nothing to the socket, so a
    sender can prepare every peer's frames and then wake them back to back (`flush`)."""
    import select

    tx, rx, a = _ring_pair(tmp_path, cap=1 << 16)
    plain_a, plain_b = socket.socketpair()
    plain_tx, plain_rx = SocketChannel(plain_a), SocketChannel(plain_b)
    frames = [(torch.randn(4, 9, 8), 3, 7), (torch.randn(2, 3, 8), 3, 7)]
    staged = [(ch, ch.stage(frames)) for ch in (tx, plain_tx)]
    assert tx.ring_out.pos == sum(f[0].nbytes for f in frames)  # payloads in the ring
    for peer in (rx.sock, plain_b):
        assert select.select([peer], [], [], 0.05)[0] == []  # no doorbell yet
    for ch, views in staged:
        ch.flush(views)
    for peer in (rx, plain_rx):
        got = [peer.recv(expect_layer=3, expect_step=7)[0] for _ in frames]
        assert all(torch.equal(g, f[0]) for g, f in zip(got, frames))
    for ch in (tx, rx, plain_tx, plain_rx):
        ch.close()


def test_dropped_keys_frame_round_trips_and_refuses_a_bad_one():
    """The memory end's DROPPED frame (h2o / snapkv keys left out at every layer)."""
    from lamina.dataplane.protocol import decode_dropped, encode_dropped
    from lamina.engine.messages import DroppedKeys

    frame = encode_dropped({9: [4, 2], 3: [], 5: [7]})
    assert frame.dtype == torch.int32 and frame.tolist() == [3, 0, 5, 1, 7, 9, 2, 4, 2]
    assert decode_dropped(frame, 1) == [DroppedKeys(3, 1, ()), DroppedKeys(5, 1, (7,)),
                                        DroppedKeys(9, 1, (4, 2))]
    assert decode_dropped(encode_dropped({}), 0) == []
    for bad in ([9, 3, 4, 2], [9], [9, -1]):  # a count past the end, no count, negative
        with pytest.raises(FrameError, match="memory worker 1: bad dropped-keys frame"):
            decode_dropped(torch.tensor(bad, dtype=torch.int32), 1)


@pytest.mark.parametrize("unix", [True, False])
def test_closing_an_endpoint_wakes_its_accept_and_leaves_no_file(unix):
    """`close_endpoint`: an `accept` still waiting ends at once (a recovery closes the
    endpoints nobody connected to), and a Unix endpoint's socket file and folder go."""
    import os
    import threading

    from lamina.dataplane.transport import close_endpoint, listen_stream

    srv, addr = listen_stream(unix, "127.0.0.1", "probe")
    woke = []

    def accept():
        try:
            srv.accept()
        except OSError as e:
            woke.append(e)

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    close_endpoint(srv)
    t.join(5)
    assert not t.is_alive() and len(woke) == 1
    if unix:
        assert not os.path.exists(addr[1]) and not os.path.exists(os.path.dirname(addr[1]))
    close_endpoint(srv)  # again: nothing
