"""The data-plane protocol (`lamina.link`) end to end without Ray: the compute side's
`SocketLink` and `MemoryServer` threads over socket pairs, on SmolLM2; greedy tokens
equal HF's with one q|k/v frame or three, with KV split over workers, and a malformed
frame fails the step loudly."""
import socket
import threading

import pytest
import torch

from lamina.engine import EngineConfig, LLMEngine
from lamina.executor import ComputeSide, Executor, MemorySide, by_worker, pack
from lamina.kv_pool import KVPool, KVPoolConfig
from lamina.link import MemoryServer, SocketLink, fuse_qkv, split_qkv
from lamina.messages import SeqWork, StepPlan
from lamina.sampling import SamplingParams
from lamina.wire import FrameError, SocketChannel

from .test_engine import run


class LinkedExecutor(Executor):
    """ComputeSide in this thread, each memory side serving on a thread of its own."""

    def __init__(self, split, pools, fused=True, link_cls=SocketLink):
        self.compute = ComputeSide(split, len(pools))
        chans, self.servers, self.threads = [], [], []
        for i, pool in enumerate(pools):
            a, b = socket.socketpair()
            srv = MemoryServer(MemorySide(pool), self.compute.params, SocketChannel(b),
                               f"memory worker {i}")
            self.threads.append(threading.Thread(target=srv.serve, daemon=True))
            self.threads[-1].start()
            chans.append(SocketChannel(a))
            self.servers.append(srv)
        self.link = link_cls(chans, fused)

    def execute(self, plan):
        return self.compute.run(plan, self.link)

    def shutdown(self):
        for ch in self.link.channels:
            ch.close()


def linked_engine(smol, split, slots, fused=True, link_cls=SocketLink, **kw):
    pools = [KVPool(KVPoolConfig.for_specs(split.attention_specs, slots)) for _ in range(2)]
    ex = LinkedExecutor(split, pools, fused, link_cls)
    cfg = EngineConfig(num_kv_slots=slots, num_memory_workers=2, **kw)
    return LLMEngine(cfg, ex, smol.tokenizer, smol.config), ex


def generate(eng, prompts, params):
    return [o.token_ids for o in run(eng, prompts, params)]


def test_fuse_and_split_qkv_round_trip():
    n, hq, hkv, d, dv = 5, 6, 2, 4, 3
    q = torch.randn(1, hq, n, d)[0].transpose(0, 1)  # [n, Hq, D], strided as the slices give
    k, v = torch.randn(hkv, n, d).transpose(0, 1), torch.randn(n, hkv, dv)
    x = fuse_qkv(q, k, v)
    assert x.shape == (n, hq * d + hkv * (d + dv)) and x.is_contiguous()
    ref = torch.cat([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], 1)
    assert torch.equal(x, ref)
    for a, b in zip(split_qkv(x, hkv, d, dv), (q, k, v)):
        assert torch.equal(a, b)
    with pytest.raises(FrameError, match="row width 37 is not"):
        split_qkv(x[:, :-1], hkv, d, dv)
    with pytest.raises(FrameError, match="row width"):  # Hq = 3 is no multiple of Hkv = 2
        split_qkv(x[:, :3 * d + hkv * (d + dv)], hkv, d, dv)


def test_rows_grouped_by_worker_are_slices():
    def seq(i, n, w, segments=()):
        return SeqWork(i, (1,) * n, 0, tuple(range(n)), worker=w, segments=segments)

    seqs = (seq(0, 3, 1), seq(1, 2, 0), seq(2, 4, 1), seq(3, 1, 0))
    grouped = by_worker(seqs)
    assert [s.seq_id for s in grouped] == [1, 3, 0, 2]  # stable within a worker
    parts = pack(StepPlan(0, grouped), 2)[3]
    assert [p.span for p in parts] == [(0, 3), (3, 10)]
    assert parts[0].rows.tolist() == [0, 1, 2] and not parts[0].whole
    x = torch.arange(10)
    assert parts[1].take_rows(x).data_ptr() == x[3:].data_ptr()  # a view, no gather
    # a sequence whose KV spans both workers goes last; its rows are on both workers
    split = seq(4, 3, 0, segments=((0, 0), (1, 2)))
    grouped = by_worker((split, *seqs))
    assert [s.seq_id for s in grouped] == [1, 3, 0, 2, 4]
    parts = pack(StepPlan(0, grouped), 2)[3]
    assert parts[0].span is None and parts[1].span is None
    assert parts[0].rows.tolist() == [0, 1, 2, 10, 11, 12] and parts[0].kv_rows.tolist() == [
        0, 1, 2, 10, 11]


@pytest.mark.parametrize("fused", [True, False])
def test_socket_link_greedy_identical_to_hf(smol, smol_split, prompts, hf_greedy, fused):
    pick = [0, 1, 2, 3, 4, 9, 10, 11]
    eng, ex = linked_engine(smol, smol_split, 3000, fused)
    ex.compute.group_rows = fused  # False: the earlier layout (plan order, gathers)
    got = generate(eng, [prompts[i] for i in pick], SamplingParams(max_tokens=16, temperature=0))
    assert got == [hf_greedy[i][:16] for i in pick]
    assert all(s.error is None for s in ex.servers)
    assert min(s.steps for s in ex.servers) > 0  # both workers served
    ex.shutdown()


def test_socket_link_kv_split_and_micro_batches(smol, smol_split, prompts, hf_greedy):
    """A 600-token prompt over two 400-slot pools: its rows go as three frames, the
    others' as one; with the rotational pipeline (two micro-batches per step)."""
    eng, ex = linked_engine(smol, smol_split, 400, pipeline="rotational")
    got = generate(eng, [prompts[8], prompts[0]], SamplingParams(max_tokens=8, temperature=0))
    assert got == [hf_greedy[8][:8], hf_greedy[0][:8]]
    assert all(s.error is None for s in ex.servers)
    ex.shutdown()


class ShortLink(SocketLink):
    """Sends every q|k|v frame one column short, from step `bad_step` on."""

    bad_step = 1

    def submit(self, layer, mb, q, k, v, parts):
        if self.step < self.bad_step:
            return super().submit(layer, mb, q, k, v, parts)
        for ch, p in zip(self.channels, parts):
            if p.rows.numel():
                x = p.take_rows(fuse_qkv(q, k, v))[:, :-1]
                ch.send(x.contiguous(), layer, self.step)


def test_malformed_qkv_frame_fails_the_step_loudly(smol, smol_split, prompts):
    eng, ex = linked_engine(smol, smol_split, 3000, link_cls=ShortLink)
    for p in prompts[:4]:
        eng.add_request(p, SamplingParams(max_tokens=4, temperature=0))
    eng.step()  # step 0 is well formed
    with pytest.raises(FrameError, match="peer closed"):
        eng.step()
    for t in ex.threads:  # a server ends after its error
        t.join(timeout=30)
    errors = [s.error for s in ex.servers]
    assert all(e and "step 1 layer 0 q|k|v frame: row width 959 is not" in e for e in errors)
    ex.shutdown()
