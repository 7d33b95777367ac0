"""Rotational pipelining over compute processes (`lamina.compute.ring`), without Ray:
R compute sides, each on a thread of its own with its own data-plane connection to
every memory worker (socket pairs), contexts moving to the next replica over socket
pairs (`ChannelContextLink`), and the memory servers sending each layer's output to
the replica that runs the next slice (`MemoryServer.route`). This is the Ray
executor's wiring in one process. n batches over n - 1 replicas (n = 3, 4): greedy
tokens equal HF's first 12 on the 16 mixed-length prompts (8 of them at n = 4); from the trace,
slice k of micro-batch j ran on replica (j + k) mod (n - 1), each context came from the
replica of slice k - 1, and no lane ran two tasks at once. Plus the rule, the context frames and
their refusals, unit by unit."""
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lamina import SamplingParams
from lamina.compute.compute_side import ComputeSide
from lamina.compute.ring import Context, Ring
from lamina.dataplane.migration import ChannelContextLink
from lamina.dataplane.protocol import MemoryServer, Routes, SocketLink
from lamina.dataplane.transport import FrameError, SocketChannel
from lamina.engine.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.executor.base import Executor
from lamina.executor.replicas import merged
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.trace import lanes
from tests.conftest import SHORT_NEW
from tests.lamina.test_rotational import PICKS, check_rotation, traced_decode

SLOTS = 8192


class RingExecutor(Executor):
    """R compute sides in a ring (threads standing in for processes) over `workers`
    memory workers, each serving R connections over one pool under a lock."""

    def __init__(self, split, vocab: int, replicas: int, workers: int = 2):
        self.r_n = replicas
        self.computes = [ComputeSide(split, workers) for _ in range(replicas)]
        for r, c in enumerate(self.computes):
            c.vocab_size, c.pool_slots, c.tracer.lane = vocab, SLOTS, f"compute{r}"
        self.params = self.computes[0].params
        self.links = [[] for _ in range(replicas)]  # per replica, its channel per worker
        self.servers = []
        for w in range(workers):
            mem = MemorySide(KVPool(KVPoolConfig.for_specs(split.attention_specs, SLOTS)))
            lock, routes = threading.Lock(), Routes(w)
            for r in range(replicas):
                a, b = socket.socketpair()
                srv = MemoryServer(mem, self.params, SocketChannel(b), f"memory worker {w}",
                                   shared=lock, index=r, route=routes.send)
                routes.add(r, srv)
                self.servers.append(srv)
                threading.Thread(target=srv.serve, daemon=True).start()
                self.links[r].append(SocketChannel(a))
        # the ring: replica r sends to r + 1 on pair r
        pairs = [socket.socketpair() for _ in range(replicas)]
        for r, c in enumerate(self.computes):
            c.join_ring(Ring(r, replicas, ChannelContextLink(
                SocketChannel(pairs[r][0]), SocketChannel(pairs[(r - 1) % replicas][1]))))
        self.pool = ThreadPoolExecutor(replicas)

    def execute(self, plan):
        futures = [self.pool.submit(c.run, plan, SocketLink(self.links[r], ring=self.r_n))
                   for r, c in enumerate(self.computes)]
        return merged(plan, [f.result() for f in futures])

    def start_trace(self):
        for c in self.computes:
            c.tracer.start()
        for s in self.servers:
            s.tracer.start()

    def stop_trace(self):
        spans = [x for c in self.computes for x in c.tracer.stop()]
        return spans + [x for s in self.servers for x in s.tracer.stop()]

    def shutdown(self):
        for chans in self.links:
            for ch in chans:
                ch.close()
        self.pool.shutdown()


@pytest.fixture(scope="module", params=[3, 4])
def ring_run(request, smol, smol_packed, prompts):
    """PICKS[n] of the prompts greedy to SHORT_NEW tokens at n batches over n - 1 replicas
    in a ring; one decode step traced."""
    n = request.param
    ex = RingExecutor(smol_packed, smol.config.vocab_size, n - 1)
    # the memory servers' lanes: one tracer per worker (its connections share it)
    for w in range(2):
        shared = ex.servers[w * (n - 1)].tracer
        shared.lane = f"memory{w}"
        for s in ex.servers[w * (n - 1):(w + 1) * (n - 1)]:
            s.tracer = shared
    cfg = EngineConfig(num_kv_slots=SLOTS, num_memory_workers=2, pipeline="rotational",
                       num_batches=n, num_compute_workers=n - 1, max_step_tokens=2048)
    eng = LLMEngine(cfg, ex, smol.tokenizer, smol.config)
    greedy = SamplingParams(max_tokens=SHORT_NEW, temperature=0.0, ignore_eos=True)
    tokens, spans = traced_decode(eng, ex, [prompts[i] for i in PICKS[n]], greedy)
    ex.shutdown()
    return n, tokens, spans, len(ex.params)


def check_ring(spans, r_n: int, n: int, layers: int, hidden: int, workers: int,
               rows: int = 16):
    """The rotation read off one decode step of `rows` sequences (`check_rotation`), and
    each memory worker attending every (layer, micro-batch) it holds rows of once."""
    assert lanes([s for s in spans if s.kind != "send"]) == [
        *(f"compute{r}" for r in range(r_n)), *(f"memory{w}" for w in range(workers))]
    check_rotation(spans, r_n, n, layers, hidden * 4, rows)
    attends = [(s.lane, s.layer, s.mb) for s in spans if s.kind == "attend"]
    assert len(attends) == len(set(attends))
    assert {(a[1], a[2]) for a in attends} == {(k, j) for k in range(layers) for j in range(n)}


def test_ring_greedy_identical_to_hf(ring_run, hf_greedy):
    n, tokens, _, _ = ring_run
    assert tokens == [hf_greedy[i][:SHORT_NEW] for i in PICKS[n]]


def test_ring_trace_follows_the_papers_replica_rule(ring_run, smol):
    n, _, spans, L = ring_run
    check_ring(spans, n - 1, n, L, smol.config.hidden_size, 2, rows=len(PICKS[n]))


def test_ring_rule_hand_checked():
    """R = 2, 3 micro-batches, 4 slices: the paper's rotation, written out."""
    r0, r1 = (Ring(i, 2, link=None) for i in range(2))
    assert r0.tasks(4, 3) == [(0, 0), (0, 2), (1, 1), (2, 0), (2, 2), (3, 1)]
    assert r1.tasks(4, 3) == [(0, 1), (1, 0), (1, 2), (2, 1), (3, 0), (3, 2)]
    assert [j for j in range(3) if r0.samples(4, j)] == [1]
    assert [j for j in range(3) if r1.samples(4, j)] == [0, 2]
    r2 = Ring(2, 3, link=None)
    assert r2.tasks(3, 4) == [(0, 2), (1, 1), (2, 0), (2, 3)]


@pytest.mark.parametrize("index,size", [(0, 1), (2, 2), (-1, 3), (0, 2.0)])
def test_ring_refuses_bad_places(index, size):
    with pytest.raises(ValueError, match="ring"):
        Ring(index, size, link=None)


def _context_pair():
    a, b = socket.socketpair()
    return ChannelContextLink(SocketChannel(a), None), ChannelContextLink(None, SocketChannel(b))


def test_context_frames_round_trip_and_refuse_the_wrong_one():
    out, inp = _context_pair()
    g = torch.Generator().manual_seed(0)
    h, pos = torch.randn(1, 5, 8, generator=g), torch.arange(5)[None]
    own = torch.randn(2, 3, 4, generator=g).bfloat16()
    out.send(7, Context(3, 1, (5, 3, 4), torch.bfloat16, (h, None, pos), own))
    got = inp.recv(7, 3, 1)
    assert (got.layer, got.mb, got.attn_shape, got.dtype) == (3, 1, (5, 3, 4), torch.bfloat16)
    assert got.tensors[1] is None and torch.equal(got.tensors[0], h)
    assert torch.equal(got.tensors[2], pos) and torch.equal(got.own, own)
    assert got.nbytes == h.nbytes + pos.nbytes + own.nbytes
    out.send(7, Context(4, 0, (5, 3, 4), torch.float32, (h,)))
    with pytest.raises(FrameError, match="slice 4, micro-batch 0 came where slice 4, "
                                         "micro-batch 2 was due"):
        inp.recv(7, 4, 2)


def test_a_memory_server_refuses_a_ring_frame_it_cannot_route(smol_packed):
    """A ring step on a connection with no routes (or a replica index past R) fails
    the step loudly, naming the frame."""
    mem = MemorySide(KVPool(KVPoolConfig.for_specs(smol_packed.attention_specs, 64)))
    srv = MemoryServer(mem, [], SocketChannel(socket.socketpair()[0]), index=0)
    srv.ch = type("Ch", (), {"recv": lambda self, **k: (torch.tensor([2, 0, 1],
                                                                     dtype=torch.int32),)})()
    with pytest.raises(FrameError, match="bad ring frame .* no routes"):
        srv._ring(5, 2)


class _Sent:
    def __init__(self):
        self.frames = []

    def send_queued(self, frame):
        self.frames.append(frame)


def test_a_ring_output_waits_for_the_connection_it_goes_to():
    """A ring step's output for a replica whose connection is not served yet (its
    accept not run: a recovery reconnects, then steps at once) waits for it and goes
    out on it; one that never comes fails after the bound, naming the replica; a reset
    (`close`) ends a wait at once. The Ray ring test saw the step fail instead
    ("no connection to compute worker 1") right after a recovery."""
    routes, late = Routes(worker=3, wait_s=30), _Sent()
    sender = threading.Thread(target=routes.send, args=(1, "frame"))
    sender.start()
    time.sleep(0.3)
    assert sender.is_alive() and late.frames == []  # waiting, nothing sent
    routes.add(1, late)
    sender.join(5)
    assert not sender.is_alive() and late.frames == ["frame"]
    routes.send(1, "next")  # connected: no wait
    assert late.frames == ["frame", "next"]

    routes.wait_s, t0 = 0.2, time.monotonic()
    with pytest.raises(RuntimeError, match=r"memory worker 3: no connection to compute "
                                           r"worker 2 .*not connected within 0.2 s"):
        routes.send(2, "frame")
    assert 0.2 <= time.monotonic() - t0 < 5

    closing = Routes(worker=0, wait_s=60)
    threading.Timer(0.2, closing.close).start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="worker 1 .*its connections were closed"):
        closing.send(1, "frame")
    assert time.monotonic() - t0 < 5


def test_a_failed_connection_fails_every_other_one_of_its_worker():
    """Once one connection's step fails, the others are handed back to be shut down,
    one accepted later is refused, and a waiting output fails at once naming why; the
    first error is kept (a later, induced one does not replace it). Without it a
    compute worker waited out its 120 s timeout on a sound connection for an output
    the failed one was to route to it, while its peer waited on it."""
    routes, first, second = Routes(worker=1, wait_s=60), _Sent(), _Sent()
    assert routes.add(0, first) and routes.add(1, second)
    waiting = []

    def send():
        try:
            routes.send(2, "frame")
        except RuntimeError as e:
            waiting.append(str(e))

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(0.2)
    assert routes.fail(first, "memory worker 1: injected fault") == [second]
    sender.join(5)
    assert waiting == ["memory worker 1: no connection to compute worker 2 to send a ring "
                       "step's output on (a step on another of its connections failed)"]
    assert routes.fail(second, "memory worker 1: send failed") == [first]
    assert routes.failure == "memory worker 1: injected fault"
    assert not routes.add(2, _Sent())  # a connection accepted after: refused
    assert Routes().failure is None  # a reset's new routes: none failed
