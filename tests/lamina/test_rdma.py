"""The RDMA channel (lamina/dataplane/rdma.py) without a device: the ring placement
rule, frames through `RdmaChannel` over in-process `LoopbackVerbs` (round trips of
every dtype, wrap-around, the credit back-pressure and its timeout, corrupt frames),
the whole data-plane protocol over it (greedy tokens equal HF's), the endpoint
exchanged through Ray checked field by field, the probe and the transport choice. A
loopback test on a real device runs wherever one is present and skips elsewhere."""
import threading

import pytest
import torch

from lamina import SamplingParams
from lamina.compute.compute_side import ComputeSide
from lamina.dataplane.protocol import MemoryServer, SocketLink
from lamina.dataplane.rdma import (
    LoopbackVerbs,
    RdmaChannel,
    RdmaEndpoint,
    RdmaSupport,
    TransportChoice,
    choose_transport,
    probe,
)
from lamina.dataplane.transport import FrameError, PeerTimeout, ring_place
from lamina.engine.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.executor.base import Executor
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig


def test_ring_place_never_wraps_a_frame():
    # a 100-byte ring: 40 at 0, 40 at 40, 30 would end at 110 -> skips the last 20
    # bytes and starts over at 0 (cursor 100); 70 then ends exactly at the end
    assert ring_place(0, 40, 100) == (0, 0)
    assert ring_place(40, 40, 100) == (40, 40)
    assert ring_place(80, 30, 100) == (0, 100)
    assert ring_place(130, 70, 100) == (30, 130)
    assert ring_place(200, 100, 100) == (0, 200)
    for bad in (0, 101):
        with pytest.raises(ValueError, match=f"a {bad}-byte frame does not fit"):
            ring_place(0, bad, 100)


def channels(ring: int = 1 << 16):
    a, b = LoopbackVerbs.pair(ring)
    return RdmaChannel(a), RdmaChannel(b), a, b


def test_frames_round_trip_through_the_ring_and_wrap():
    ca, cb, va, _ = channels(1 << 16)
    g = torch.Generator().manual_seed(0)
    sent = []
    for i in range(40):  # ~107 KB in all: the 64 KiB ring wraps
        t = {0: torch.randn(33, 61, generator=g), 1: torch.randn(7, 3, 5).bfloat16(),
             2: torch.randint(-9, 9, (500,), dtype=torch.int32, generator=g),
             3: torch.empty(0, 4)}[i % 4]
        ca.send_many([(t, i, 100 + i)])
        sent.append(t)
        got, layer, step = cb.recv(expect_layer=i, expect_step=100 + i)
        assert (layer, step) == (i, 100 + i) and got.dtype == t.dtype
        assert got.shape == t.shape and torch.equal(got, t)
    assert va.writes == 40 and ca.pos_out == cb.pos_in > 1 << 16  # wrapped
    # the other way too, several frames in one flush
    cb.send_many([(torch.full((3,), float(i)), 0, i) for i in range(5)])
    assert [ca.recv()[0].tolist() for _ in range(5)] == [[float(i)] * 3 for i in range(5)]


def test_a_sender_a_ring_ahead_waits_for_credit_then_times_out():
    ca, cb, _, _ = channels(1 << 16)
    ca.set_timeout(0.05)
    t = torch.zeros(5000)  # 20 KB + header: three fit in 64 KiB, the fourth does not
    for _ in range(3):
        ca.send(t, 0, 0)
    with pytest.raises(PeerTimeout, match="the peer consumed nothing for 0.05 s"):
        ca.send(t, 0, 0)
    cb.recv()  # one read: its credit makes room
    ca.send(t, 0, 1)
    assert [cb.recv()[2] for _ in range(3)] == [0, 0, 1]
    with pytest.raises(FrameError, match="exceeds the 65536-byte RDMA ring"):
        ca.send(torch.zeros(1 << 15), 0, 0)


def test_corrupt_or_unexpected_frames_are_refused_by_name():
    ca, cb, _, vb = channels()
    ca.send(torch.ones(8), 3, 7)
    vb.recv_buf[0:4] = b"JUNK"  # the magic, overwritten in the receiver's ring
    with pytest.raises(FrameError, match="bad magic"):
        cb.recv()
    ca2, cb2, _, vb2 = channels()
    ca2.send(torch.ones(8), 3, 7)
    vb2.completions[0] += 4  # the immediate disagrees with the header
    with pytest.raises(FrameError, match="written, its header says"):
        cb2.recv()
    ca3, cb3, _, _ = channels()
    ca3.send(torch.ones(8), 3, 7)
    with pytest.raises(FrameError, match="layer"):
        cb3.recv(expect_layer=4)
    with pytest.raises(PeerTimeout, match="no RDMA frame from the peer within 0.01 s"):
        cb3.set_timeout(0.01) or cb3.recv()


class RdmaExecutor(Executor):
    """The compute side and two memory servers (threads) over RDMA channels on
    loopback verbs: the data plane's Python ends, frame for frame."""

    def __init__(self, split, pools):
        self.compute = ComputeSide(split, len(pools))
        chans = []
        for i, pool in enumerate(pools):
            a, b = LoopbackVerbs.pair(1 << 22)
            srv = MemoryServer(MemorySide(pool), self.compute.params, RdmaChannel(b),
                               f"memory worker {i}")
            threading.Thread(target=srv.serve, daemon=True).start()
            chans.append(RdmaChannel(a))
        self.link = SocketLink(chans)

    def execute(self, plan):
        return self.compute.run(plan, self.link)


def test_the_data_plane_over_rdma_channels_gives_hf_greedy(smol, smol_packed, prompts,
                                                            hf_greedy):
    pools = [KVPool(KVPoolConfig.for_specs(smol_packed.attention_specs, 4096))
             for _ in range(2)]
    ex = RdmaExecutor(smol_packed, pools)
    assert ex.link.paths.ext is None  # the Python ends: the C++ ones read sockets
    eng = LLMEngine(EngineConfig(num_kv_slots=4096, num_memory_workers=2), ex,
                    smol.tokenizer, smol.config)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request(p, greedy) for p in prompts[:6]]
    done = {}
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert [done[i].token_ids for i in ids] == [r[:8] for r in hf_greedy[:6]]


ENDPOINT = RdmaEndpoint(qp_num=0x1234, psn=77, lid=5, gid=":".join(["fe80"] + ["0000"] * 7),
                        mtu=4096, ring_addr=1 << 40, ring_rkey=0xABC, ring_bytes=1 << 26,
                        credit_addr=1 << 41, credit_rkey=0xDEF)


def test_endpoint_round_trips_and_each_bad_field_is_named():
    wire = ENDPOINT.to_wire()
    assert wire["version"] == 1 and RdmaEndpoint.from_wire(wire) == ENDPOINT
    for field, bad, words in [("qp_num", 1 << 24, "qp_num must be an int"),
                              ("psn", -1, "psn must be an int"),
                              ("ring_rkey", "7", "ring_rkey must be an int"),
                              ("mtu", 1500, "mtu must be 256..4096"),
                              ("gid", "fe80::1", "gid must be 8 groups"),
                              ("ring_bytes", 4096, "ring_bytes 4096 < 64 KiB"),
                              ("version", 2, "version 2, this side speaks 1")]:
        with pytest.raises(ValueError, match=words):
            RdmaEndpoint.from_wire({**wire, field: bad})
    with pytest.raises(ValueError, match="expected a dict"):
        RdmaEndpoint.from_wire([1, 2])


def test_probe_says_why_rdma_cannot_run(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pyverbs" else real(name, *a))
    s = probe(tmp_path / "absent")
    assert not s.ok and s.devices == ()
    assert s.why.startswith(f"no RDMA device ({tmp_path / 'absent'} is absent); "
                            "pyverbs not installed")
    (tmp_path / "ib").mkdir()
    (tmp_path / "ib" / "mlx5_0").mkdir()
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "pyverbs" else real(name, *a))
    assert probe(tmp_path / "ib") == RdmaSupport(True, ("mlx5_0",),
                                                 "devices mlx5_0, pyverbs installed")
    monkeypatch.setenv("LAMINA_RDMA", "0")
    assert probe(tmp_path / "ib").why == "LAMINA_RDMA=0"


def test_transport_choice_per_worker_pair():
    yes, no = RdmaSupport(True, ("mlx5_0",), "devices mlx5_0"), RdmaSupport(False, (), "no dev")
    assert choose_transport(True, True, yes).kind == "unix+shm"
    assert choose_transport(True, False, yes).kind == "unix"
    assert choose_transport(False, True, yes) == TransportChoice(
        "rdma", "different nodes, RDMA available (devices mlx5_0)")
    assert choose_transport(False, True, no) == TransportChoice(
        "tcp", "different nodes; not RDMA: no dev")


def test_loopback_on_a_real_rdma_device():
    """Two queue pairs on this host's first device, connected to each other: frames
    both ways. Runs wherever ibv_get_device_list() is non-empty and pyverbs imports."""
    support = probe()
    if not support.ok:
        pytest.skip(f"RDMA cannot run here: {support.why}")
    from lamina.dataplane.rdma import PyverbsVerbs

    a, b = PyverbsVerbs(ring_bytes=1 << 20), PyverbsVerbs(ring_bytes=1 << 20)
    a.connect(b.endpoint())
    b.connect(a.endpoint())
    ca, cb = RdmaChannel(a), RdmaChannel(b)
    for ch in (ca, cb):
        ch.set_timeout(5.0)
    for i in range(300):  # 4 KB frames: the 1 MiB ring wraps
        t = torch.full((1000,), float(i))
        ca.send(t, i, i)
        assert torch.equal(cb.recv(expect_layer=i)[0], t)
    cb.send(torch.arange(10), 1, 2)
    assert ca.recv()[0].tolist() == list(range(10))
    ca.close()
    cb.close()
