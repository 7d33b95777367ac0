"""Communication-attention overlap (paper 5.2; `stream` in lamina/dataplane/protocol.py):
a worker's q/k/v of a layer go as groups of whole requests, each attended as it
arrives and answered at once. The group cuts and sub-batches against hand numbers and
`SlotBatch.build`; greedy tokens equal HF's through sockets and shared-memory rings with
KV split over workers (split parts unstreamed, in the same step); each layer attended
group by group (from the trace) with the outputs going back while the next is
attended; the hidden-time arithmetic on hand-built spans."""
import functools
import socket
import threading
from collections import Counter

import pytest
import torch

from lamina import SamplingParams
from lamina.dataplane.protocol import (
    STREAM_SHIFT,
    MemoryServer,
    SocketLink,
    fuse_qkv,
    stream_cuts,
    sub_batch,
)
from lamina.dataplane.transport import SocketChannel
from lamina.engine.config import EngineConfig
from lamina.kernels import AttentionParams, SlotBatch, reference_slot_attention
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.trace import Span, hidden_fraction, overlapping
from tests.conftest import SHORT_NEW
from tests.lamina.test_link import linked_engine, meta_frames, ring_pair


def test_stream_cuts_split_whole_requests_by_rows():
    cu = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7], dtype=torch.int32)
    # 7 rows in 3: cut at the first requests reaching rows 3 and 5
    assert stream_cuts(cu, 3) == [(0, 3), (3, 5), (5, 7)]
    assert stream_cuts(cu, 1) == [(0, 7)]
    # a 10-row prompt and two decode rows: the prompt is never cut
    assert stream_cuts(torch.tensor([0, 10, 11, 12], dtype=torch.int32), 2) == [(0, 1), (1, 3)]
    # width 4 aims at rows 3, 6, 9: all inside the prompt, so one cut after it
    assert stream_cuts(torch.tensor([0, 10, 11, 12], dtype=torch.int32), 4) == [(0, 1), (1, 3)]
    assert stream_cuts(torch.tensor([0, 2], dtype=torch.int32), 8) == [(0, 1)]
    assert stream_cuts(torch.tensor([0], dtype=torch.int32), 3) == []


def test_sub_batch_is_the_batch_of_those_requests():
    tables = [[5, 6, 7], [1, 2], [9, 10, 11, 12], [3]]
    nq, start = [1, 2, 1, 1], [0, 4, 0, 2]
    whole = SlotBatch.build(tables, nq, start)
    sub = sub_batch(whole, 1, 3)
    ref = SlotBatch.build(tables[1:3], nq[1:3], start[1:3])
    for a, b in zip((sub.cu_q, sub.q_pos, sub.slots, sub.cu_k, sub.k_pos0),
                    (ref.cu_q, ref.q_pos, ref.slots, ref.cu_k, ref.k_pos0)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("native,rings", [("both", False), ("both", True), ("none", False),
                                          ("memory", True)])
def test_streamed_greedy_identical_to_hf(smol, smol_packed, prompts, hf_greedy, native, rings,
                                         tmp_path):
    """Two workers, KV split over them (long prompts' parts go unstreamed in the same
    steps), chunked prefill: the tokens are HF's (its first SHORT_NEW), with the C++ ends
    (every memory-end step in C++), the Python ones, and the C++ memory end against the
    Python compute end."""
    eng, ex = linked_engine(smol, smol_packed, 6000, link_cls=functools.partial(
        SocketLink, stream=3), native=native, rings=tmp_path if rings else None,
        max_step_tokens=512)
    assert (ex.link.paths.ext is not None) == (native == "both")
    for w, srv in enumerate(ex.servers):  # each worker's lanes
        srv.tracer.lane, srv.send_tracer.lane = f"memory{w}", f"send{w}"
    tracers = [s.tracer for s in ex.servers] + [s.send_tracer for s in ex.servers]
    for tr in tracers:
        tr.start()
    greedy = SamplingParams(max_tokens=SHORT_NEW, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request(p, greedy) for p in prompts]
    done = {}
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    # a step's last output reaches the compute end before its sender records the span
    # (the C++ memory end's spans are recorded after its step returns): the servers and
    # their send threads end first, then the spans are read
    ex.shutdown()
    for th in [*ex.threads, *(srv.send_thread for srv in ex.servers)]:
        th.join(30)
        assert not th.is_alive()
    spans = [s for tr in tracers for s in tr.stop()]
    assert [done[i].token_ids for i in ids] == [r[:SHORT_NEW] for r in hf_greedy]
    for srv in ex.servers:
        assert srv.steps > 10 and srv.native_steps == (srv.steps if native != "none" else 0)
    assert (ex.link.exchanges > 0) == (native == "both")
    # per step, worker and layer: at most 3 groups attended, each output sent on its
    # own; in the steps where a worker decodes 3 or more sequences, exactly 3
    count = Counter((s.step, s.lane[-1], s.layer, s.kind) for s in spans)
    assert max(count.values()) == 3
    for (step, w, layer, kind), n in count.items():
        other = "send" if kind == "attend" else "attend"
        assert count[step, w, layer, other] == n
    full = {(st, w) for (st, w, layer, kind), n in count.items() if n == 3}
    assert len(full) > 10 and all(count[st, w, layer, "attend"] == 3 for st, w in full
                                  for layer in range(len(ex.compute.params)))
    assert overlapping(spans) == []


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("rings", [False, True])
def test_streamed_step_through_full_socket_buffers(native, rings, tmp_path):
    """A streamed step whose groups and outputs each overflow the socket buffers (4 KiB
    asked for): the compute end sends a layer's 4 groups before it reads an output, so
    the memory end must keep reading while it waits to send (else both block: here a
    PeerTimeout after 10 s). With rings of 160 KiB, two groups fill one and a layer's
    outputs overflow the other (a payload that finds its ring full goes on the socket).
    Each group's output is the reference attention of its requests over the pool once
    every new k/v is written."""
    torch.manual_seed(0)
    b_n, hq, hkv, d, layers = 96, 8, 2, 64, 2
    pool = KVPool(KVPoolConfig(layers, 4 * b_n, hkv, d))
    params = [AttentionParams(0.125), AttentionParams(0.125, sliding_window=2)]
    a, b = socket.socketpair()
    for sock in (a, b):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.settimeout(10)
    ca, cb = {}, {}
    if rings:
        (ca["ring_out"], cb["ring_in"]), (cb["ring_out"], ca["ring_in"]) = (
            ring_pair(tmp_path, "c2m", 160 << 10), ring_pair(tmp_path, "m2c", 160 << 10))
    srv = MemoryServer(MemorySide(pool), params, SocketChannel(b, **cb), "mw", native=native)
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    for i in range(layers):
        for x in pool.layer(i):
            x.copy_(torch.randn_like(x))
    tables = [[4 * r, 4 * r + 1, 4 * r + 2, 4 * r + 3] for r in range(b_n)]
    new = [tb[-1] for tb in tables]
    batch, meta = meta_frames(7, tables, new, head=(1 | (4 - 1) << STREAM_SHIFT,))
    cuts = stream_cuts(batch.cu_q, 4)
    assert [e - a for a, e in cuts] == [24] * 4
    ch = SocketChannel(a, **ca)
    ch.set_timeout(10)  # and the ring's writes
    ch.send_many(meta)
    q, k, v = torch.randn(b_n, hq, d), torch.randn(b_n, hkv, d), torch.randn(b_n, hkv, d)
    x = fuse_qkv(q, k, v)  # [B, F]: 3 KiB a row, 72 KiB a group
    outs = []
    for layer in range(layers):
        for f, e in cuts:  # as `SocketLink._submit_streamed` sends them
            ch.flush(ch.stage([(x[f:e], layer, 7)], wait=False))
        outs.append(torch.cat([ch.recv(expect_layer=layer, expect_step=7,
                                       expect_shape=(e - f, hq, d + 1))[0]
                               for f, e in cuts]))
    ch.close()
    t.join(timeout=30)
    assert srv.error is None and srv.steps == 1 and srv.native_steps == int(native)
    for layer in range(layers):
        kp, vp = pool.layer(layer)
        assert torch.equal(kp[new], k) and torch.equal(vp[new], v)
        o, lse = reference_slot_attention(q, kp, vp, batch, params[layer])
        torch.testing.assert_close(outs[layer][..., :d], o, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outs[layer][..., d], lse, atol=1e-5, rtol=1e-5)


def test_stream_width_is_checked():
    with pytest.raises(ValueError, match="stream width must be 1..16"):
        SocketLink([], stream=17)
    with pytest.raises(ValueError, match="stream_groups must be an int in 1..16"):
        EngineConfig(stream_groups=0)
    with pytest.raises(ValueError, match="kv_sparsity='h2o'.s per-layer selection"):
        EngineConfig(stream_groups=2, kv_sparsity="h2o", kv_budget=0.5)


def sp(lane, kind, t0, t1):
    return Span(lane, kind, 0, 0, 0, t0, t1)


def test_hidden_fraction_on_hand_built_spans():
    spans = [sp("compute0", "submit", 0.0, 4.0),   # 4 s of q/k/v out
             sp("memory0", "attend", 1.0, 2.0), sp("memory1", "attend", 1.5, 3.0),
             sp("send0", "send", 3.0, 5.0),        # 2 s of output back
             sp("memory0", "attend", 4.5, 6.0),
             sp("compute0", "slice", 0.0, 9.0)]    # not a transfer
    # transfers 0..5 (union); attention 1..3 and 4.5..6: hidden 2 + 0.5 of 5
    assert hidden_fraction(spans) == pytest.approx(0.5)
    assert hidden_fraction([sp("compute0", "slice", 0, 1)]) is None
    assert hidden_fraction([sp("compute0", "submit", 0, 1)]) == 0.0
