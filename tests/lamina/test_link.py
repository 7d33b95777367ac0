"""The data-plane protocol (`lamina.dataplane.protocol`) end to end without Ray: the compute side's
`SocketLink` and `MemoryServer` threads over socket pairs, on SmolLM2; greedy tokens
equal HF's with one q|k/v frame or three, with KV split over workers, and a malformed
frame fails the step loudly."""
import re
import socket
import threading
import time

import numpy as np
import pytest
import torch

from lamina.compute.compute_side import ComputeSide
from lamina.compute.packing import WorkerPart, by_worker, pack
from lamina.dataplane.protocol import META, MemoryServer, SocketLink, fuse_qkv, split_qkv
from lamina.dataplane.transport import FrameError, PeerTimeout, ShmRing, SocketChannel, encode
from lamina.engine.config import EngineConfig
from lamina.engine.engine import LLMEngine
from lamina.engine.messages import SeqWork, StepPlan
from lamina.executor.base import Executor
from lamina.kernels import AttentionParams, SlotBatch, reference_slot_attention
from lamina.kernels.quant import dequantize_rows, quantize_rows
from lamina.memory.memory_side import MemorySide
from lamina.memory.pool import KVPool, KVPoolConfig
from lamina.sampling.params import SamplingParams

from .test_engine import run


def ring_pair(tmp, name, cap=16 << 20):
    """(writer, reader) ends of one shared-memory ring."""
    w = ShmRing(str(tmp / name), cap, create=True)
    r = ShmRing(str(tmp / name), cap, create=False)
    w.unlink()
    return w, r


def tcp_pair():
    """A connected loopback TCP pair (what workers on other hosts use)."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        a = socket.create_connection(srv.getsockname())
        b, _ = srv.accept()
    for s in (a, b):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return a, b


class LinkedExecutor(Executor):
    """ComputeSide in this thread, each memory side serving on a thread of its own.
    `native`: which ends run their C++ per-layer path, "both", "memory", "compute" or
    "none" (the Python one); `rings`: a directory for shared-memory rings (big payloads
    go through them, as between co-located processes); `tcp`: loopback TCP, as between
    hosts, instead of socket pairs."""

    def __init__(self, split, pools, one_frame=True, link_cls=SocketLink, native="both", rings=None,
                 tcp=False, local_prefill=False):
        self.compute = ComputeSide(split, len(pools),
                                   pools[0].config.dtype if local_prefill else None)
        chans, self.servers, self.threads, self.rings = [], [], [], []
        for i, pool in enumerate(pools):
            a, b = tcp_pair() if tcp else socket.socketpair()
            ca, cb = {}, {}
            if rings is not None:
                (ca["ring_out"], cb["ring_in"]), (cb["ring_out"], ca["ring_in"]) = (
                    ring_pair(rings, f"c2m{i}"), ring_pair(rings, f"m2c{i}"))
                self.rings += [ca["ring_out"], cb["ring_out"]]
            srv = MemoryServer(MemorySide(pool), self.compute.params, SocketChannel(b, **cb),
                               f"memory worker {i}", native=native in ("both", "memory"))
            self.threads.append(threading.Thread(target=srv.serve, daemon=True))
            self.threads[-1].start()
            chans.append(SocketChannel(a, **ca))
            self.servers.append(srv)
        self.link = link_cls(chans, one_frame, native in ("both", "compute"))

    def execute(self, plan):
        return self.compute.run(plan, self.link)

    def shutdown(self):
        for ch in self.link.channels:
            ch.close()


def linked_engine(smol, split, slots, one_frame=True, link_cls=SocketLink, native="both",
                  rings=None, tcp=False, local_prefill=False, kv_dtype="float32", **kw):
    pools = [KVPool(KVPoolConfig.for_specs(split.attention_specs, slots, kv_dtype))
             for _ in range(2)]
    ex = LinkedExecutor(split, pools, one_frame, link_cls, native, rings, tcp, local_prefill)
    cfg = EngineConfig(num_kv_slots=slots, num_memory_workers=2, kv_dtype=kv_dtype, **kw)
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
    parts = pack(StepPlan(0, grouped), 2).parts
    assert [p.span for p in parts] == [(0, 3), (3, 10)]
    assert parts[0].rows.tolist() == [0, 1, 2] and not parts[0].whole
    x = torch.arange(10)
    assert parts[1].take_rows(x).data_ptr() == x[3:].data_ptr()  # a view, no gather
    # a sequence whose KV spans both workers goes last; its rows are on both workers
    split = seq(4, 3, 0, segments=((0, 0), (1, 2)))
    grouped = by_worker((split, *seqs))
    assert [s.seq_id for s in grouped] == [1, 3, 0, 2, 4]
    parts = pack(StepPlan(0, grouped), 2).parts
    assert parts[0].span is None and parts[1].span is None
    assert parts[0].rows.tolist() == [0, 1, 2, 10, 11, 12] and parts[0].kv_rows.tolist() == [
        0, 1, 2, 10, 11]


def test_local_prefill_parts():
    """Paper 5.6: a sequence whose whole context is in the step (start_pos 0, KV on one
    worker) attends on the compute side over scratch slots from `local_base`; its worker
    gets its k/v rows and slots but no query rows. Decode rows and KV-split prompts
    attend on the workers as before."""
    dec = SeqWork(0, (7,), 3, (40, 41, 42, 43), worker=0)
    fresh = SeqWork(1, (1, 2, 3), 0, (9, 8, 5), worker=1)
    other = SeqWork(2, (4, 5), 0, (30, 31), worker=0)
    split = SeqWork(3, (6, 6, 6), 0, (1, 2, 0), worker=0, segments=((0, 0), (1, 2)))
    plan = StepPlan(0, by_worker((dec, fresh, other, split)))  # order: dec, other, fresh, split
    packed = pack(plan, 2, local=True, local_base=10)
    (w0, w1), merge, own = packed.parts, packed.merge, packed.local
    assert w0.rows.tolist() == [0, 6, 7, 8] and w0.kv_rows.tolist() == [0, 1, 2, 6, 7]
    assert w0.new_slots.tolist() == [43, 30, 31, 1, 2] and w0.span is None
    assert w0.batch.cu_q.tolist() == [0, 1, 4] and w0.batch.slots.tolist() == [40, 41, 42, 43,
                                                                               1, 2]
    assert w1.rows.tolist() == [8] and w1.kv_rows.tolist() == [3, 4, 5, 8]
    assert w1.new_slots.tolist() == [9, 8, 5, 0] and merge
    assert own.rows.tolist() == own.kv_rows.tolist() == [1, 2, 3, 4, 5]
    assert own.new_slots.tolist() == [10, 11, 12, 13, 14]
    assert own.batch.cu_q.tolist() == [0, 2, 5] and own.batch.slots.tolist() == [10, 11, 12,
                                                                                 13, 14]
    assert own.batch.q_pos.tolist() == [0, 1, 0, 1, 2] and own.batch.k_pos0.tolist() == [0, 0]
    assert pack(StepPlan(0, (dec,)), 2, local=True).local is None  # nothing fresh: no own part
    # a worker left with k/v to store only is still active (it gets frames)
    w = pack(StepPlan(0, (fresh,)), 2, local=True).parts[1]
    assert w.active and not w.rows.numel() and w.kv_rows.tolist() == [0, 1, 2]


@pytest.mark.parametrize("native,pipeline", [("both", "none"), ("none", "none"),
                                           ("both", "rotational")])
def test_local_prefill_greedy_identical_to_hf(smol, smol_packed, prompts, hf_greedy, native,
                                              pipeline):
    """Prompts attend on the compute side and only their KV goes to the workers (the C++
    memory end and the Python one, one micro-batch or two, a KV-split prompt among
    them): HF's greedy tokens, and every later decode step reads the KV the workers
    stored."""
    pick = [8, 0, 3, 9, 10]
    eng, ex = linked_engine(smol, smol_packed, 500, native=native, local_prefill=True,
                            pipeline=pipeline)
    got = generate(eng, [prompts[i] for i in pick], SamplingParams(max_tokens=12, temperature=0))
    assert got == [hf_greedy[i][:12] for i in pick]
    assert all(s.error is None for s in ex.servers)
    assert ex.compute._scratch is not None  # some prompts attended here
    assert max(t.get("local_s", 0) for t in eng.step_timings) > 0
    ex.shutdown()


@pytest.mark.parametrize("one_frame,native", [(True, "both"), (False, "both"), (True, "none"),
                                        (True, "memory"), (True, "compute")])
def test_socket_link_greedy_identical_to_hf(smol, smol_packed, prompts, hf_greedy, one_frame,
                                            native):
    """One q|k|v frame or three (`one_frame`; three: the compute end's Python path), each end
    on its C++ or its Python path: all speak the same protocol."""
    pick = [0, 1, 2, 3, 4, 9, 10, 11]
    eng, ex = linked_engine(smol, smol_packed, 3000, one_frame, native=native)
    got = generate(eng, [prompts[i] for i in pick], SamplingParams(max_tokens=16, temperature=0))
    assert got == [hf_greedy[i][:16] for i in pick]
    assert all(s.error is None for s in ex.servers)
    assert min(s.steps for s in ex.servers) > 0  # both workers served
    on = native in ("both", "memory")
    assert [s.native_steps == s.steps for s in ex.servers] == [on, on]
    assert (ex.link._ext is not None) == (one_frame and native in ("both", "compute"))
    # one-micro-batch steps send and collect each layer in one C++ call where it can
    assert (ex.link.exchanges > 0) == (one_frame and native in ("both", "compute"))
    ex.shutdown()


@pytest.mark.parametrize("native", ["both", "none"])
def test_traced_steps_keep_their_path_and_line_up(smol, smol_packed, prompts, hf_greedy,
                                                  native):
    """Tracing over the data plane: the memory ends keep their loop (the C++ `serve_step`
    returns each layer's attention times), every layer of every traced step has one
    attend span per worker that holds rows, inside the compute end's submit-to-wait of
    that layer, and the answers are HF's."""
    from lamina.trace import overlapping

    eng, ex = linked_engine(smol, smol_packed, 3000, native=native)
    for i, srv in enumerate(ex.servers):
        srv.tracer.lane = f"memory{i}"
    pick = [0, 3, 5, 9]
    ids = [eng.add_request(prompts[i], SamplingParams(max_tokens=6, temperature=0))
           for i in pick]
    done = {o.request_id: o for o in eng.step()}
    tracers = [ex.compute.tracer, *(s.tracer for s in ex.servers)]
    for tr in tracers:
        tr.start()
    steps = []
    for _ in range(2):
        steps.append(eng.scheduler.step)
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    spans = [sp for tr in tracers for sp in tr.stop()]
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    assert [done[i].token_ids for i in ids] == [hf_greedy[i][:6] for i in pick]
    assert [s.native_steps == s.steps for s in ex.servers] == [native == "both"] * 2
    assert overlapping(spans) == []
    L = len(ex.compute.params)
    out = {(s.step, s.layer): s for s in spans if s.kind == "submit"}
    back = {(s.step, s.layer): s for s in spans if s.kind == "wait"}
    att = [s for s in spans if s.kind == "attend"]
    assert sorted((s.lane, s.step, s.layer) for s in att) == sorted(
        (f"memory{w}", t, i) for w in range(2) for t in steps for i in range(L))
    for a in att:
        assert out[a.step, a.layer].t0 <= a.t0 <= a.t1 <= back[a.step, a.layer].t1
    ex.shutdown()


@pytest.mark.parametrize("pipeline", ["rotational", "none"])
def test_socket_link_kv_split_and_micro_batches(smol, smol_packed, prompts, hf_greedy, pipeline):
    """A 600-token prompt over two 400-slot pools: its rows go as three frames, the
    others' as one; with the rotational pipeline (two micro-batches per step: the Python
    layer loop) and without (the C++ one)."""
    eng, ex = linked_engine(smol, smol_packed, 400, pipeline=pipeline)
    got = generate(eng, [prompts[8], prompts[0]], SamplingParams(max_tokens=8, temperature=0))
    assert got == [hf_greedy[8][:8], hf_greedy[0][:8]]
    assert all(s.error is None for s in ex.servers)
    # a worker with rows in both micro-batches of a step runs its Python loop
    python_steps = [s.steps - s.native_steps for s in ex.servers]
    assert (max(python_steps) > 0) == (pipeline == "rotational"), python_steps
    ex.shutdown()


def test_memory_ends_hold_each_running_sequences_table(smol, smol_packed, prompts, hf_greedy):
    """Each memory end keeps its sequences' slot tables across steps and is sent only new
    slots: after every step its held ranges equal the allocators' tables of the running
    sequences on that worker, through preemptions (small pools) and a KV split over both
    workers; greedy tokens equal HF's; finished sequences' tables go with the next
    step's metadata. Two micro-batches a step (the memory end's Python loop; every other
    test here runs the tables through the C++ one too)."""
    pick = [8, 1, 3, 4, 10, 11]  # the 600-token prompt spans both 360-slot pools
    eng, ex = linked_engine(smol, smol_packed, 360, pipeline="rotational")
    greedy = SamplingParams(max_tokens=16, temperature=0)
    ids = [eng.add_request(prompts[i], greedy) for i in pick]
    out, split = {}, 0
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] = o
        for w, srv in enumerate(ex.servers):
            for seq in eng.scheduler.running:
                assert srv.tables.slots(seq.seq_id) == {
                    a: eng.allocs[w].slots(seq.seq_id) for ww, a in seq.segments if ww == w}
        split += any(len(q.segments) > 1 for q in eng.scheduler.running)
    assert [out[i].token_ids for i in ids] == [hf_greedy[i][:16] for i in pick]
    assert sum(o.metrics["preemptions"] for o in out.values()) > 0 and split
    assert all(s.error is None for s in ex.servers)
    run(eng, [prompts[0]], SamplingParams(max_tokens=2, temperature=0))
    # the worker that served it holds its table only; the other was sent what to drop
    assert sorted(len(s.tables) for s in ex.servers) == [0, 1]
    ex.shutdown()


def test_bf16_prompts_on_memory_ends_take_the_prompt_kernel(smol, smol_bf16, prompts):
    """bf16 pools where our bf16 prompt kernel runs: a memory end serves a step with a
    prompt in its Python loop (whose backend sends the prompt through that kernel; the
    C++ loop has only the slot kernel) and decode steps in C++; the tokens are those of
    Python ends throughout, which attend every row the same way."""
    from lamina.kernels import prompt_sdpa
    from lamina.splitter.dense import pack_dense

    if prompt_sdpa.bf16_kernel() is None:
        pytest.skip("no bf16 prompt kernel on this CPU: the C++ loop serves every step")
    split, _ = pack_dense(smol_bf16[1], "onednn")
    pick = [prompts[4], prompts[6]]  # 128 and 300 tokens: one on each worker
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    got = {}
    for native in ("both", "none"):
        eng, ex = linked_engine(smol, split, 3000, native=native, kv_dtype="bfloat16")
        got[native] = generate(eng, pick, params)
        assert all(s.error is None and s.steps == 4 for s in ex.servers)
        python_steps = [s.steps - s.native_steps for s in ex.servers]
        assert python_steps == ([1, 1] if native == "both" else [4, 4])
        ex.shutdown()
    assert got["both"] == got["none"]


def test_c_plus_plus_ends_over_tcp(smol, smol_packed, prompts, hf_greedy):
    """The C++ ends over loopback TCP (partial reads and writes of a real stream), a
    600-token prefill among them: HF's greedy tokens."""
    pick = [8, 1, 2, 10]
    eng, ex = linked_engine(smol, smol_packed, 3000, tcp=True)
    got = generate(eng, [prompts[i] for i in pick], SamplingParams(max_tokens=8, temperature=0))
    assert got == [hf_greedy[i][:8] for i in pick]
    assert all(s.error is None and s.native_steps == s.steps > 0 for s in ex.servers)
    ex.shutdown()


def test_compute_end_times_out_on_a_silent_worker():
    """The C++ collect waits at most the channel's timeout, then raises PeerTimeout."""
    a, b = socket.socketpair()
    ch = SocketChannel(a)
    ch.set_timeout(0.3)
    link = SocketLink([ch])
    assert link._ext is not None
    part = WorkerPart(torch.arange(2), torch.tensor([4, 1], dtype=torch.int32),
                      SlotBatch.build([[3, 9, 4], [7, 1]], [1, 1]), span=(0, 2), whole=True)
    link.begin(5, [[part]])
    link.submit(0, 0, torch.randn(2, 6, D), torch.randn(2, HKV, D), torch.randn(2, HKV, D),
                [part])
    t = time.perf_counter()
    with pytest.raises(PeerTimeout, match="from the peer within 0.3 s"):
        link.collect(0, 0, [part], (2, 6, D), torch.float32)
    assert 0.25 < time.perf_counter() - t < 5
    t = time.perf_counter()  # the same wait inside `exchange`
    with pytest.raises(PeerTimeout, match="from the peer within 0.3 s"):
        link.exchange(1, 0, torch.randn(2, 6, D), torch.randn(2, HKV, D),
                      torch.randn(2, HKV, D), [part], (2, 6, D), torch.float32)
    assert 0.25 < time.perf_counter() - t < 5
    a.close()
    b.close()


def test_socket_link_through_shared_memory_rings(smol, smol_packed, prompts, hf_greedy,
                                                 tmp_path):
    """Prefill payloads (q|k|v in, o|lse out) of 64 KiB and more go through the rings,
    decode ones inline on the socket; both ends keep the rings' cursors in step."""
    pick = [8, 5, 0, 1]
    eng, ex = linked_engine(smol, smol_packed, 3000, rings=tmp_path)
    got = generate(eng, [prompts[i] for i in pick], SamplingParams(max_tokens=8, temperature=0))
    assert got == [hf_greedy[i][:8] for i in pick]
    assert all(s.error is None and s.native_steps == s.steps > 0 for s in ex.servers)
    assert all(r.pos > 0 for r in ex.rings)  # both directions used them
    ex.shutdown()


class ShortLink(SocketLink):
    """Sends every q|k|v frame one column short, from step `bad_step` on."""

    bad_step = 1

    def exchange(self, *args, **kw):
        return None  # every layer through `submit` below, never the one-call C++ path

    def submit(self, layer, mb, q, k, v, parts):
        if self.step < self.bad_step:
            return super().submit(layer, mb, q, k, v, parts)
        for ch, p in zip(self.channels, parts):
            if p.rows.numel():
                x = p.take_rows(fuse_qkv(q, k, v))[:, :-1]
                ch.send(x.contiguous(), layer, self.step)


def test_malformed_qkv_frame_fails_the_step_loudly(smol, smol_packed, prompts):
    eng, ex = linked_engine(smol, smol_packed, 3000, link_cls=ShortLink)
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


# -- the memory end's layer loop on a tiny pool, frames written by hand --
HKV, D, LAYERS = 2, 8, 2


def tiny_server(native, dtype=torch.float32, sinks=None, key_scales=None):
    scales = None if key_scales is None else tuple(key_scales.flatten().tolist())
    pool = KVPool(KVPoolConfig(LAYERS, 16, HKV, D, dtype=str(dtype).split(".")[1],
                               key_scales=scales))
    params = [AttentionParams(0.3, sinks=sinks),
              AttentionParams(0.3, sliding_window=2, softcap=5.0, sinks=sinks)]
    a, b = socket.socketpair()
    srv = MemoryServer(MemorySide(pool), params, SocketChannel(b), "mw", native=native)
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    return srv, t, a, pool, params


def meta_frames(step, tables, new_slots, head=(1,), released=(), keep=None):
    """A step's metadata frames by hand: head (micro-batch count, then sequence ids), the
    released sequences, then one micro-batch's new slots and batch with its slots as
    `keep` counts (default none kept) and the tail."""
    batch = SlotBatch.build(tables, [1] * len(tables))
    keep = [0] * len(tables) if keep is None else keep
    tail = [x for t, k in zip(tables, keep) for x in t[k:]]
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return batch, [(t, META, step) for t in (
        i32(list(head)), i32(list(released)), i32(new_slots), batch.cu_q, batch.q_pos,
        i32(keep), i32(tail), batch.cu_k, batch.k_pos0)]


def send_meta(ch, step, tables, new_slots):
    batch, frames = meta_frames(step, tables, new_slots)
    ch.send_many(frames)
    return batch


@pytest.mark.parametrize("dtype,frames", [(torch.float32, None), (torch.bfloat16, None),
                                          (torch.int8, torch.float32),
                                          (torch.int8, torch.bfloat16)])
def test_layer_loops_agree_with_reference(dtype, frames):
    """The C++ and the Python layer loop give the same bytes, and they are the
    reference attention over the pool after the new k/v were written (an int8 pool:
    the rows are NumPy's quantization of k over the channel scales and of v, as the
    `frames` dtype carried them, and the attention is over their dequantized values)."""
    torch.manual_seed(0)
    tables, new = [[3, 9, 4], [7, 1]], [4, 1]
    i8 = dtype == torch.int8
    frames = frames or dtype  # q|k|v as sent (a float pool: its own dtype)
    q, k, v = (torch.randn(2, h, D).to(frames).float() for h in (6, HKV, HKV))
    old = torch.randn(LAYERS, 16, HKV, 2 * D)
    c = torch.rand(LAYERS, HKV, D) + 0.5 if i8 else None  # the keys' channel scales
    outs = {}
    for native in (True, False):
        srv, t, a, pool, params = tiny_server(native, dtype, key_scales=c)
        for i in range(LAYERS):
            kp, vp = pool.layer(i)
            if i8:
                kp.copy_(quantize_rows(old[i, ..., :D], c[i]))
                vp.copy_(quantize_rows(old[i, ..., D:]))
            else:
                kp.copy_(old[i, ..., :D])
                vp.copy_(old[i, ..., D:])
        ch = SocketChannel(a)
        batch = send_meta(ch, 5, tables, new)
        outs[native] = []
        for layer in range(LAYERS):
            ch.send(fuse_qkv(q, k, v).to(frames), layer, 5)
            outs[native].append(ch.recv(expect_layer=layer, expect_step=5,
                                      expect_shape=(2, 6, D + 1))[0])
        ch.close()
        t.join(timeout=30)
        assert srv.error is None and srv.steps == 1 and srv.native_steps == int(native)
        for layer in range(LAYERS):
            kp, vp = pool.layer(layer)
            if i8:
                assert all(np.array_equal(pool_row.numpy(), np_row) for pool_row, np_row in (
                    (kp[new], np_rows(k, c[layer])), (vp[new], np_rows(v, None))))
                kf, vf, qf = dequantize_rows(kp, c[layer]), dequantize_rows(vp), q
            else:
                assert torch.equal(kp[new], k.to(dtype)) and torch.equal(vp[new], v.to(dtype))
                kf, vf, qf = kp.float(), vp.float(), q.to(dtype).float()
            o, lse = reference_slot_attention(qf, kf, vf, batch, params[layer])
            got = outs[native][layer].float()
            tol = 2e-2 if frames == torch.bfloat16 else 1e-4 if i8 else 1e-5
            torch.testing.assert_close(got[..., :D], o, atol=tol, rtol=tol)
            torch.testing.assert_close(got[..., D], lse, atol=tol, rtol=tol)
    for x, y in zip(outs[True], outs[False]):
        assert torch.equal(x, y)


def np_rows(x: torch.Tensor, c: torch.Tensor | None) -> np.ndarray:
    """int8 rows [N, H, D + 4] of x from the grouping's definition, in NumPy: per token
    and head, after dividing channels by c, codes round(x / s) with s = max|x| / 127,
    then s's 4 bytes."""
    y = x.numpy().astype(np.float32) / (1.0 if c is None else c.numpy())
    s = (np.abs(y).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    codes = np.rint(y / np.where(s > 0, s, 1)).clip(-127, 127).astype(np.int8)
    return np.concatenate([codes, s.view(np.int8)], axis=-1)


def good_frame(layer=0, step=5, rows=2, width=6 * D + HKV * 2 * D):
    return b"".join(bytes(x) for x in encode(torch.zeros(rows, width), layer, step))


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("raw,msg", [
    (b"XXXX" + good_frame()[4:], "bad magic b'XXXX'"),
    (good_frame(layer=1), "layer 1, expected 0"),
    (good_frame(step=6), "step 6, expected 5"),
    (good_frame(rows=3), "a q|k|v frame of 3 rows, expected 2 query and 2 KV rows"),
    (good_frame(width=6 * D + HKV * 2 * D - 1), "layer 0 q|k|v frame: row width 79 is not"),
    (good_frame()[:100], "frame payload truncated: peer closed after"),
])
def test_malformed_frames_end_the_server_with_a_clear_error(native, raw, msg):
    srv, t, a, pool, _ = tiny_server(native)
    ch = SocketChannel(a)
    send_meta(ch, 5, [[3, 9, 4], [7, 1]], [4, 1])
    before = pool.layer(0)[0].clone()
    a.sendall(raw)
    a.shutdown(socket.SHUT_WR)
    t.join(timeout=30)
    assert srv.error and msg in srv.error, srv.error
    assert torch.equal(pool.layer(0)[0], before)  # nothing written from a bad frame
    ch.close()


@pytest.mark.parametrize("native,msg", [(True, "4 query heads, but layer 0 has 6 sinks"),
                                      (False, "6 sinks for 4 query heads")])
def test_query_heads_must_match_the_sinks(native, msg):
    """A q|k|v frame of a valid width whose head count is not the model's (its sinks
    say 6) is refused before the kernel reads a sink per head."""
    srv, t, a, pool, _ = tiny_server(native, sinks=(0.1,) * 6)
    ch = SocketChannel(a)
    send_meta(ch, 5, [[3, 9, 4], [7, 1]], [4, 1])
    a.sendall(good_frame(width=4 * D + HKV * 2 * D))
    a.shutdown(socket.SHUT_WR)
    t.join(timeout=30)
    assert srv.error and msg in srv.error, srv.error
    ch.close()


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("reply,msg", [
    (lambda: (torch.zeros(3, 6, D + 1), 0, 5), "shape (3, 6, 9), expected (2, 6, 9)"),
    (lambda: (torch.zeros(2, 6, D + 1), 1, 5), "layer 1, expected 0"),
    (lambda: (torch.zeros(2, 6, D + 1), 0, 4), "step 4, expected 5"),
    (lambda: None, "frame header truncated: peer closed after 0 of 28 bytes"),
])
def test_compute_end_rejects_malformed_outputs(native, reply, msg):
    """The compute end checks each output frame before reading it into o; the C++ and
    the Python path name the same fault."""
    a, b = socket.socketpair()
    link, peer = SocketLink([SocketChannel(a)], native=native), SocketChannel(b)
    assert (link._ext is not None) == native
    batch = SlotBatch.build([[3, 9, 4], [7, 1]], [1, 1])
    part = WorkerPart(torch.arange(2), torch.tensor([4, 1], dtype=torch.int32), batch,
                      span=(0, 2), whole=True)
    link.begin(5, [[part]])
    q, k, v = torch.randn(2, 6, D), torch.randn(2, HKV, D), torch.randn(2, HKV, D)
    link.submit(0, 0, q, k, v, [part])
    for _ in range(9):  # the metadata frames
        peer.recv(expect_layer=META, expect_step=5)
    x = peer.recv(expect_layer=0, expect_step=5)[0]
    assert torch.equal(x, fuse_qkv(q, k, v))  # the q|k|v frame as sent
    if reply() is None:
        peer.close()
    else:
        peer.send(*reply())
    with pytest.raises(FrameError, match=re.escape(msg)):
        link.collect(0, 0, [part], (2, 6, D), torch.float32)
    a.close()


@pytest.mark.parametrize("reply,msg", [
    (lambda o: (o, 0, 5), None),
    (lambda o: (torch.zeros(3, 6, D + 1), 0, 5), "shape (3, 6, 9), expected (2, 6, 9)"),
    (lambda o: (o, 0, 4), "step 4, expected 5"),
    (lambda o: None, "frame header truncated: peer closed after 0 of 28 bytes"),
])
def test_exchange_sends_and_collects_in_one_call(reply, msg):
    """`exchange` (submit and collect as one C++ call): the peer gets the q|k|v frame as
    `submit` sends it, the output comes back into o, and a bad reply is named as
    `collect` names it."""
    a, b = socket.socketpair()
    link, peer = SocketLink([SocketChannel(a)]), SocketChannel(b)
    batch = SlotBatch.build([[3, 9, 4], [7, 1]], [1, 1])
    part = WorkerPart(torch.arange(2), torch.tensor([4, 1], dtype=torch.int32), batch,
                      span=(0, 2), whole=True)
    link.begin(5, [[part]])
    q, k, v = torch.randn(2, 6, D), torch.randn(2, HKV, D), torch.randn(2, HKV, D)
    ol = torch.randn(2, 6, D + 1)
    seen = []

    def serve():
        for _ in range(9):  # the metadata frames
            peer.recv(expect_layer=META, expect_step=5)
        seen.append(peer.recv(expect_layer=0, expect_step=5)[0])
        if reply(ol) is None:
            peer.close()
        else:
            peer.send(*reply(ol))

    th = threading.Thread(target=serve)
    th.start()
    if msg is None:
        o, sent_s = link.exchange(0, 0, q, k, v, [part], (2, 6, D), torch.float32)
        assert torch.equal(o, ol[..., :D]) and sent_s >= 0
    else:
        with pytest.raises(FrameError, match=re.escape(msg)):
            link.exchange(0, 0, q, k, v, [part], (2, 6, D), torch.float32)
    th.join(timeout=30)
    assert torch.equal(seen[0], fuse_qkv(q, k, v))  # the q|k|v frame as sent
    a.close()


def send_meta_ids(ch, step, tables, new_slots, head):
    """`send_meta` with a hand-made first frame (micro-batch count, then sequence ids)."""
    ch.send_many(meta_frames(step, tables, new_slots, head)[1])


@pytest.mark.parametrize("head,tables,bad,msg", [
    ([1, 11, 12], [[3, 9, 4], [7, 99]], (12,), "slot ids out of range [0, 16)"),  # named
    ([1, 11, -1], [[3, 9, 4], [7, 99]], (), "bad slot metadata"),  # an unknown id: no name
    ([1], [[3, 9, 4], [7, 99]], (), "bad slot metadata"),  # no ids sent (older peers)
    ([0, 11], [[3, 9, 4]], (), "bad micro-batch count frame [0, 11]"),  # 0: no ids
    ([65], [[3, 9, 4]], (), "bad micro-batch count frame [65]"),
])
def test_bad_slot_metadata_names_its_sequence(head, tables, bad, msg):
    """The step's first frame carries each batch entry's sequence id: a bad entry is
    reported by id (`bad_seqs`, read by the Ray executor through `health`), so the engine
    fails that request alone; without ids the fault is the channel's."""
    srv, t, a, pool, _ = tiny_server(True)
    ch = SocketChannel(a)
    send_meta_ids(ch, 5, tables, [4, 1], head)
    a.shutdown(socket.SHUT_WR)
    t.join(timeout=30)
    assert srv.error and msg in srv.error, srv.error
    assert srv.bad_seqs == bad
    ch.close()
