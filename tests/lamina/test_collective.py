"""The collective path (`lamina.dataplane.collective`) on gloo, the same code NCCL runs
between GPUs: which frames take it, its errors, and the data plane over it on SmolLM2
(greedy tokens equal HF's, one micro-batch a step and two, with a KV split)."""
import socket
import threading

import pytest
import torch

from lamina.compute.compute_side import ComputeSide
from lamina.dataplane.collective import (
    LOOPBACK,
    CollectiveError,
    Rendezvous,
    collective_backend,
    host_store,
    open_path,
)
from lamina.dataplane.protocol import MemoryServer, SocketLink
from lamina.dataplane.transport import (
    IN_PEER,
    IN_RING,
    FrameError,
    PeerTimeout,
    SocketChannel,
    decode,
    frame_header,
)
from lamina.engine.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.executor.base import Executor
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.sampling.params import SamplingParams

from .test_link import generate


def paths(backend: str = "gloo", timeout_s: float = 20.0):
    """(compute end, memory end) of one pair's path, opened as the workers open it: the
    memory end hosts the store and joins on a thread of its own."""
    store, port = host_store(LOOPBACK, timeout_s)
    rdv = Rendezvous(backend, LOOPBACK, port)
    got = {}

    def memory_end():
        try:
            got["path"] = open_path(rdv, 1, "cpu", LOOPBACK, timeout_s, store=store)
        except CollectiveError as e:
            got["error"] = e

    t = threading.Thread(target=memory_end, daemon=True)
    t.start()
    compute = open_path(rdv, 0, "cpu", LOOPBACK, timeout_s)
    t.join()
    return compute, got["path"]


def channel_pair(timeout_s: float = 20.0):
    """Two connected `SocketChannel`s with a gloo path each, and the raw memory socket."""
    a, b = socket.socketpair()
    pc, pm = paths(timeout_s=timeout_s)
    return SocketChannel(a, peer=pc), SocketChannel(b, peer=pm), b


def test_float_tensors_take_the_path_and_metadata_stays_on_the_socket():
    ca, cb, _ = channel_pair()
    ids = torch.arange(7, dtype=torch.int32)
    qkv = torch.randn(33, 96).to(torch.bfloat16)
    empty = torch.empty(0, 96)
    ca.send_many([(ids, -1, 4), (qkv, 0, 4), (empty, 0, 4)])
    got = [cb.recv(expect_step=4) for _ in range(3)]
    assert got[0][0].tolist() == list(range(7)) and got[0][1:] == (-1, 4)
    assert torch.equal(got[1][0], qkv) and got[1][0].dtype == torch.bfloat16
    assert got[2][0].shape == (0, 96)
    # the float frame's payload came on the path; the int32 and the empty one did not
    assert (ca.peer.sent, cb.peer.received) == (1, 1)
    cb.send(got[1][0].float() * 2, 0, 4)
    back = ca.recv(expect_layer=0, expect_shape=(33, 96))[0]
    assert torch.equal(back, qkv.float() * 2)
    # the C++ ends read bytes only: a channel with a path is not theirs
    assert not ca.bytes_only and SocketChannel(socket.socketpair()[0]).bytes_only
    ca.send(qkv, 1, 5)  # checked before its payload is read, as on the socket
    with pytest.raises(FrameError, match=r"shape \(33, 96\), expected \(3, 96\)"):
        cb.recv(expect_shape=(3, 96))
    for ch in (ca, cb):
        ch.close()


def test_frames_saying_their_payload_is_elsewhere_are_refused_by_name():
    x = torch.ones(2, 3)
    a, b = socket.socketpair()
    plain = SocketChannel(a)
    b.sendall(frame_header(x, 0, 1, flags=IN_PEER))
    with pytest.raises(FrameError, match="collective path; this channel has none"):
        plain.recv()
    with pytest.raises(FrameError, match="collective path; none here"):
        decode(frame_header(x, 0, 1, flags=IN_PEER))
    with pytest.raises(FrameError, match="both in a ring and on a peer path"):
        decode(frame_header(x, 0, 1, flags=IN_PEER | IN_RING))


def test_a_payload_that_never_comes_times_out_and_a_gone_peer_fails_the_read():
    ca, cb, raw = channel_pair()
    ca.set_timeout(1.0)
    raw.sendall(frame_header(torch.ones(4, 8), 2, 9, flags=IN_PEER))  # header, no send
    with pytest.raises(PeerTimeout, match="gloo receive of a payload: the peer did not "
                                          "answer"):
        ca.recv(expect_layer=2)
    ca2, cb2, raw2 = channel_pair()
    raw2.sendall(frame_header(torch.ones(4, 8), 2, 9, flags=IN_PEER))
    cb2.peer.close()  # its groups go: the reader's receive fails, it does not hang
    with pytest.raises(FrameError, match="gloo receive of a payload failed"):
        ca2.recv(expect_layer=2)
    for ch in (ca, cb, ca2, cb2):
        ch.close()


def test_the_backend_follows_the_devices_and_lamina_collective(monkeypatch):
    monkeypatch.delenv("LAMINA_COLLECTIVE", raising=False)
    assert collective_backend("cuda", "cuda:0") == "nccl"
    assert collective_backend("cuda", "cpu") is None  # host memory workers: pinned buffers
    assert collective_backend("cpu", "cpu") is None
    monkeypatch.setenv("LAMINA_COLLECTIVE", "gloo")
    assert collective_backend("cpu", "cpu") == "gloo"
    monkeypatch.setenv("LAMINA_COLLECTIVE", "off")
    assert collective_backend("cuda", "cuda") is None
    monkeypatch.setenv("LAMINA_COLLECTIVE", "nccl")
    assert collective_backend("cuda:0", "cuda") == "nccl"
    with pytest.raises(ValueError, match="needs compute_device and kv_device on CUDA"):
        collective_backend("cuda", "cpu")
    monkeypatch.setenv("LAMINA_COLLECTIVE", "yes")
    with pytest.raises(ValueError, match="LAMINA_COLLECTIVE must be one of"):
        collective_backend("cpu", "cpu")
    with pytest.raises(ValueError, match="backend must be one of"):
        Rendezvous("mpi", LOOPBACK, 1)
    with pytest.raises(ValueError, match="port must be 1..65535"):
        Rendezvous("gloo", LOOPBACK, 0)


@pytest.mark.skipif(torch.distributed.is_nccl_available(),
                    reason="NCCL is here: the refusal is for builds without it")
def test_nccl_without_nccl_is_a_clear_error():
    with pytest.raises(CollectiveError, match="needs a CUDA build of torch with NCCL"):
        paths("nccl", timeout_s=5.0)


class CollectiveExecutor(Executor):
    """The compute side here, two memory servers on threads, every channel with a gloo
    path (as `LAMINA_COLLECTIVE=gloo` wires Ray workers)."""

    def __init__(self, split, pools, stream: int = 1):
        self.compute = ComputeSide(split, len(pools))
        chans, self.servers = [], []
        for i, pool in enumerate(pools):
            ca, cb, _ = channel_pair()
            srv = MemoryServer(MemorySide(pool), self.compute.params, cb, f"memory worker {i}")
            threading.Thread(target=srv.serve, daemon=True).start()
            chans.append(ca)
            self.servers.append(srv)
        self.link = SocketLink(chans, stream=stream)

    def execute(self, plan):
        return self.compute.run(plan, self.link)

    def shutdown(self):
        for ch in self.link.channels:
            ch.close()


@pytest.mark.parametrize("pipeline,stream", [("none", 1), ("rotational", 1), ("none", 3)])
def test_the_data_plane_over_gloo_paths_gives_hf_greedy(smol, smol_packed, prompts, hf_greedy,
                                                         pipeline, stream):
    """A 600-token prompt over two 400-slot pools (its KV split: three frames a layer),
    with one micro-batch a step, with two (outputs sent on the memory end's thread while
    it reads the next micro-batch), and streamed (each layer's q|k|v in up to three
    groups, each answered on its own)."""
    pools = [KVPool(KVPoolConfig.for_specs(smol_packed.attention_specs, 400)) for _ in range(2)]
    ex = CollectiveExecutor(smol_packed, pools, stream)
    assert ex.link.paths.ext is None  # the Python ends
    eng = LLMEngine(EngineConfig(num_kv_slots=400, num_memory_workers=2, pipeline=pipeline),
                    ex, smol.tokenizer, smol.config)
    pick = [8, 0, 3]
    got = generate(eng, [prompts[i] for i in pick], SamplingParams(max_tokens=8, temperature=0))
    assert got == [hf_greedy[i][:8] for i in pick]
    assert all(s.error is None and s.steps > 0 and s.native_steps == 0 for s in ex.servers)
    # every q/k/v and output payload took the path: one frame a layer or three
    sent = sum(ch.peer.sent for ch in ex.link.channels)
    received = sum(ch.peer.received for ch in ex.link.channels)
    assert sent >= received > 0 and sent == sum(s.ch.peer.received for s in ex.servers)
    ex.shutdown()
